"""Public entry points: :func:`plan`, :func:`backward`, :func:`load_plan` (and model dispatch)."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from spscan.executor import check_inputs, output_views, run
from spscan.plan import Plan, _fmt_bytes
from spscan.planner.cost import profile_for
from spscan.planner.memory import estimate_memory
from spscan.planner.patterns import as_chain
from spscan.planner.planning import plan_scan

__all__ = ["plan", "backward", "load_plan"]

_RECURRENT = (torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM)


def _resolve_device(device) -> Optional[torch.device]:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: not a valid torch device: {device!r}") from exc


def plan(
    patterns: Any,
    *args: Any,
    levels: Union[str, int] = "auto",
    backend: str = "auto",
    device=None,
    dtype: Optional[torch.dtype] = None,
    max_memory: Optional[int] = None,
    batch_size: int = 16,
    **kwargs: Any,
):
    """Plan the backward scan over a chain of transposed-Jacobian patterns (or a model).

    Args:
        patterns: ``n`` patterns in layer order, ``patterns[i-1]`` the structure of ``J_i^T``
            (shape ``(d_{i-1}, d_i)``), each a canonical SciPy CSR matrix/array or torch sparse
            CSR tensor (values ignored). An ``nn.Sequential`` or single-layer ``nn.RNN``/``GRU``/
            ``LSTM`` followed by an example input plans that model instead.
        levels: ``"auto"`` (cost model of the critical path), ``"full"`` (pure Blelloch) or an int
            ``K >= 0`` (0 = linear scan; clamped to the chain's maximum depth).
        backend: ``"auto"`` (Triton on CUDA, torch on CPU), ``"torch"`` or ``"triton"``.
        device, dtype: what the plan is for; ``None`` accepts whatever each call passes.
        max_memory: byte limit for ``backward``'s peak at ``batch_size``; ``"auto"`` lowers the
            depth to fit, a forced depth that does not fit raises ``ValueError`` with the numbers.
        batch_size: the batch size the cost model and memory check assume (calls may use any).

    Returns:
        a :class:`Plan`.
    """
    if isinstance(patterns, torch.nn.Module):
        opts = dict(levels=levels, backend=backend, device=device, dtype=dtype, max_memory=max_memory,
                    batch_size=batch_size, **kwargs)
        if isinstance(patterns, _RECURRENT):
            from spscan.recurrent import plan_recurrent

            return plan_recurrent(patterns, *args, **opts)
        from spscan.model import plan_model

        return plan_model(patterns, *args, **opts)
    if args or kwargs:
        extra = list(kwargs) or [f"{len(args)} positional"]
        raise TypeError(f"plan(patterns, ...): unexpected arguments {extra}")
    if not (levels in ("auto", "full") or (isinstance(levels, int) and not isinstance(levels, bool))):
        raise ValueError(f"levels: expected 'auto', 'full' or an int >= 0, got {levels!r}")
    if isinstance(levels, int) and levels < 0:
        raise ValueError(f"levels: expected an int >= 0, got {levels}")
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: expected 'auto', 'torch' or 'triton', got {backend!r}")
    if dtype is not None and dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    if max_memory is not None and (not isinstance(max_memory, (int, float)) or max_memory <= 0):
        raise ValueError(f"max_memory: expected a positive number of bytes, got {max_memory!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
    dev = _resolve_device(device)
    if backend == "auto":
        backend = "triton" if dev is not None and dev.type == "cuda" else "torch"

    pats = as_chain(patterns)
    elem = 8 if dtype == torch.float64 else 4
    profile = profile_for(dev.type if dev is not None else "cpu")

    def peak(candidate) -> int:
        return estimate_memory(candidate).total(batch_size)

    scan = plan_scan(pats, levels, profile, batch_hint=batch_size, elem_bytes=elem,
                     memory_limit=max_memory, memory_of=peak)
    if max_memory is not None and peak(scan) > max_memory:
        raise ValueError(
            f"max_memory={_fmt_bytes(max_memory)}: the plan at levels={scan.levels} needs "
            f"{_fmt_bytes(peak(scan))} at batch {batch_size} "
            + ("(even the linear scan does not fit)" if levels == "auto" else "(use fewer levels or 'auto')")
        )
    return Plan(scan, backend, dev, dtype, None if max_memory is None else int(max_memory), levels)


def backward(
    plan: Plan,
    values: Any,
    grad: torch.Tensor,
    extra: Optional[Sequence[Optional[torch.Tensor]]] = None,
    *,
    check_finite: bool = False,
) -> list[torch.Tensor]:
    """Run the planned scan: ``dl/dx_i`` for every ``i`` from one step's Jacobian values.

    Args:
        plan: from :func:`plan`.
        values: ``n`` tensors, ``values[i-1]`` the entries of ``J_i^T`` in its pattern's CSR order,
            ``(B, nnz_i)`` per sample or ``(nnz_i,)`` shared by the batch; or one stacked
            ``(n, B, nnz)`` / ``(n, nnz)`` tensor when every layer has the same nnz.
        grad: ``(B, d_n)``, ``dl/dx_n``.
        extra: optional ``n+1`` entries, ``None`` or ``(B, d_i)``: added to ``dl/dx_i`` (the affine
            scan ``g_{i-1} = J_i^T g_i + extra[i-1]``, for losses that read intermediate outputs).
        check_finite: raise ``ValueError`` if any input holds NaN/Inf (costs a device sync);
            by default non-finite values propagate as in autograd.

    Returns:
        ``n+1`` tensors ``(B, d_i)``; ``[n]`` is ``grad`` (+ ``extra[n]``). They are views into one
        buffer owned by the result (not necessarily contiguous). Inputs are never modified.
    """
    if hasattr(plan, "_spscan_backward") and not isinstance(plan, Plan):
        return plan._spscan_backward(values, grad, extra=extra)
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a spscan Plan, got {type(plan).__name__}")
    items, stacked, shared, has_extra = check_inputs(plan, values, grad, extra, check_finite)
    vectors, program = run(plan, items, stacked, shared, has_extra, grad, extra)
    return output_views(vectors, program)


def load_plan(path) -> Plan:
    """Read a plan written by :meth:`Plan.save` (no pickle; validated, ``ValueError`` if corrupted)."""
    from spscan.planner.serialize import load_scan

    scan, opts = load_scan(path)
    try:
        dtype = None if opts["dtype"] is None else {"float32": torch.float32, "float64": torch.float64}[opts["dtype"]]
        backend = opts["backend"]
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend {backend!r}")
        return Plan(scan, backend, _resolve_device(opts["device"]), dtype, opts["max_memory"],
                    opts["requested_levels"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: corrupted spscan plan: bad options ({exc})") from exc
