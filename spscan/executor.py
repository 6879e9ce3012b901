"""Runs a lowered program: validates the step's tensors, loads the arenas, calls the backend."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from spscan.plan import ValuesBuffer, _fmt_bytes
from spscan.planner.memory import estimate_memory

__all__ = ["check_inputs", "execute", "run", "output_views"]

_FLOATS = (torch.float32, torch.float64)


def _fail(kind, msg: str):
    raise kind(msg)


def check_inputs(plan, values, grad, extra, check_finite: bool):
    """Validate one step's inputs against the plan; returns (values list or stacked, shared mask, extra mask).

    Never copies or mutates the caller's tensors.
    """
    n = plan.n
    pats = plan._scan.patterns
    if not isinstance(grad, torch.Tensor):
        _fail(TypeError, f"grad: expected a torch.Tensor of shape (B, {pats[-1].cols}), got {type(grad).__name__}")
    if grad.dtype not in _FLOATS:
        _fail(TypeError, f"grad: expected dtype float32 or float64, got {grad.dtype}")
    if grad.dim() != 2 or grad.shape[1] != pats[-1].cols:
        _fail(ValueError, f"grad: expected shape (B, {pats[-1].cols}) for layer {n}'s output, got {tuple(grad.shape)}")
    batch, dtype, device = grad.shape[0], grad.dtype, grad.device
    if plan.dtype is not None and dtype != plan.dtype:
        _fail(TypeError, f"grad: the plan was made for {plan.dtype}, got {dtype}")
    if plan.device is not None and device != plan.device:
        _fail(ValueError, f"grad: the plan was made for device {plan.device}, got {device}")
    if batch < 1:
        _fail(ValueError, "grad: batch size must be at least 1, got 0")

    stacked = isinstance(values, torch.Tensor)
    if stacked:
        if values.dim() not in (2, 3) or values.shape[0] != n:
            _fail(ValueError, f"values: a stacked tensor must be (n={n}, B, nnz) or (n, nnz), got {tuple(values.shape)}")
        nnzs = {p.nnz for p in pats}
        if len(nnzs) != 1:
            _fail(ValueError, "values: a stacked tensor needs every layer to have the same nnz; pass a list")
        items: Sequence[torch.Tensor] = [values]
    else:
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            _fail(TypeError, f"values: expected a sequence of {n} tensors, got {type(values).__name__}")
        if len(values) != n:
            _fail(ValueError, f"values: expected {n} tensors (one per layer), got {len(values)}")
        items = values
    nnzs = plan._nnz
    checked: dict[int, bool] = {}  # a tensor repeated along the chain is checked once per shape
    shared = []
    for i, v in enumerate(items):
        nnz = nnzs[0] if stacked else nnzs[i]
        key = id(v)
        hit = checked.get(key)
        if hit is not None and v.shape[-1] == nnz:
            shared.append(hit)
            continue
        layer = f"layer {i + 1}" if not stacked else "values"
        if not isinstance(v, torch.Tensor):
            _fail(TypeError, f"values[{i}] ({layer}): expected a torch.Tensor, got {type(v).__name__}")
        if v.layout != torch.strided:
            _fail(TypeError, f"values[{i}] ({layer}): expected a dense strided tensor of CSR values, got layout {v.layout}")
        if v.dtype != dtype:
            _fail(TypeError, f"values[{i}] ({layer}): dtype {v.dtype} differs from grad's {dtype}")
        if v.device != device:
            _fail(ValueError, f"values[{i}] ({layer}): on {v.device}, grad is on {device}")
        shape = tuple(v.shape[1:]) if stacked else tuple(v.shape)
        if shape == (nnz,):
            is_shared = True
        elif shape == (batch, nnz):
            is_shared = False
        else:
            pshape = pats[i if not stacked else 0].shape
            _fail(ValueError, f"values[{i}] ({layer}): expected shape ({batch}, {nnz}) or ({nnz},) "
                              f"for a {pshape} pattern with nnz={nnz}, got {tuple(v.shape)}")
        checked[key] = is_shared
        shared.append(is_shared)
    if stacked:
        shared = shared * n
    has_extra = [False] * (n + 1)
    if extra is not None:
        if isinstance(extra, torch.Tensor) or not hasattr(extra, "__len__") or len(extra) != n + 1:
            got = len(extra) if hasattr(extra, "__len__") and not isinstance(extra, torch.Tensor) else type(extra).__name__
            _fail(ValueError, f"extra: expected a sequence of n+1={n + 1} entries (None or (B, d_i)), got {got}")
        for i, e in enumerate(extra):
            if e is None:
                continue
            d = pats[i].rows if i < n else pats[-1].cols
            if not isinstance(e, torch.Tensor):
                _fail(TypeError, f"extra[{i}]: expected None or a tensor of shape ({batch}, {d}), got {type(e).__name__}")
            if e.dtype != dtype:
                _fail(TypeError, f"extra[{i}]: dtype {e.dtype} differs from grad's {dtype}")
            if e.device != device:
                _fail(ValueError, f"extra[{i}]: on {e.device}, grad is on {device}")
            if tuple(e.shape) != (batch, d):
                _fail(ValueError, f"extra[{i}]: expected shape ({batch}, {d}) (dl/dx_{i}), got {tuple(e.shape)}")
            has_extra[i] = True
    if check_finite:
        tensors = [("grad", grad)] + [(f"values[{i}]", v) for i, v in enumerate(items)]
        if extra is not None:
            tensors += [(f"extra[{i}]", e) for i, e in enumerate(extra) if e is not None]
        for name, t in tensors:
            if not bool(torch.isfinite(t).all()):
                _fail(ValueError, f"{name}: contains NaN or Inf (check_finite=True)")
    return items, stacked, tuple(shared), tuple(has_extra)


def run(plan, items, stacked: bool, shared: tuple, has_extra: tuple, grad: torch.Tensor,
        extra: Optional[Sequence[Optional[torch.Tensor]]], *, reuse_vectors: bool = False):
    """Run the scan on inputs already known to be valid; returns ``(vector arena, program)``.

    ``dl/dx_i`` sits at ``program.outputs[i] = (offset, d_i)`` of the ``(B, size_v)`` arena
    (:func:`output_views` makes the list the public API returns). Callers that build the values
    themselves (the recurrent chains) skip :func:`check_inputs`' per-layer Python work and the
    ``n+1`` views, and read what they need from the arena as strided views. ``reuse_vectors``:
    the arena is the plan's working buffer, overwritten by the next call (the caller copies out
    what it keeps); otherwise it is new and owned by the result.
    """
    if plan.max_memory is not None:
        need = estimate_memory(plan._scan).backward_peak(grad.shape[0])
        if need > plan.max_memory:
            raise ValueError(f"max_memory={_fmt_bytes(plan.max_memory)}: backward at batch {grad.shape[0]} "
                             f"needs ~{_fmt_bytes(need)}; use a smaller batch or re-plan")
    program = plan.program(shared, has_extra)
    runner, tables = plan._runner(program, grad.device)
    with torch.no_grad():
        return execute(plan, program, runner, tables, items, stacked, grad, extra, reuse_vectors), program


def execute(plan, program, runner, tables, items, stacked: bool, grad: torch.Tensor,
            extra: Optional[Sequence[Optional[torch.Tensor]]], reuse_vectors: bool = False) -> torch.Tensor:
    """Load the arenas from the caller's tensors (copies), run the program, return the vector arena.

    The matrix arenas are internal and reused across calls of the same shape (no allocation or
    first-touch cost per step); the vector arena is new each call because the results view it,
    unless ``reuse_vectors`` (the caller copies out what it keeps before the next call).
    """
    n = plan.n
    batch, dtype, device = grad.shape[0], grad.dtype, grad.device
    s_arena, p_arena = plan._arenas(program, batch, dtype, device)
    if reuse_vectors:
        vectors = plan._scratch("vectors", batch * program.size_v, dtype, device).view(batch, program.size_v)
    else:
        vectors = torch.empty(batch, program.size_v, dtype=dtype, device=device)
    s_arena[program.zero_s] = 0
    p_arena[:, program.zero_p] = 0
    vectors[:, program.zero_v] = 0
    in_place = (isinstance(items, ValuesBuffer) and items.plan is plan and items.shared == program.shared
                and items.arenas[0] is s_arena and items.arenas[1] is p_arena)
    if stacked and not in_place:
        v = items[0]
        nnz = plan._scan.patterns[0].nnz
        own = s_arena[: n * nnz].view(n, nnz) if v.dim() == 2 else \
            p_arena[:, : n * nnz].view(batch, n, nnz).transpose(0, 1)
        in_place = v.data_ptr() == own.data_ptr() and v.stride() == own.stride() and v.shape == own.shape
    if in_place or not getattr(tables, "needs_arena_inputs", True):
        pass  # values already sit in the input arena, or no launch reads them from there
    elif stacked:
        v = items[0]
        nnz = plan._scan.patterns[0].nnz
        if v.dim() == 2:
            s_arena[: n * nnz] = v.reshape(-1)
        else:
            p_arena[:, : n * nnz].view(batch, n, nnz).copy_(v.transpose(0, 1))
    else:
        sh = [v.reshape(-1) for v, s in zip(items, program.shared) if s]
        ps = [v for v, s in zip(items, program.shared) if not s]
        if sh:
            s_arena[: sum(t.shape[0] for t in sh)] = torch.cat(sh)
        if ps:
            p_arena[:, : sum(t.shape[1] for t in ps)] = torch.cat(ps, dim=1)
    d_n = grad.shape[1]
    g = vectors[:, program.grad_slot : program.grad_slot + d_n]
    g.copy_(grad)
    if extra is not None and extra[n] is not None:
        g.add_(extra[n])
    if program.extra_slots:
        vectors[:, plan._extra_columns(program, device)] = torch.cat([extra[i] for i in program.extra_slots], dim=1)
    layer = items[0].__getitem__ if stacked else items.__getitem__
    arenas = {"S": s_arena, "P": p_arena}
    if getattr(tables, "chain_scratch", False) and program.chain_scratch:
        arenas["C"] = plan._scratch("chain", batch * program.chain_scratch, dtype, device)
    runner(tables, arenas, vectors, inputs=layer)
    return vectors


def output_views(vectors: torch.Tensor, program) -> list[torch.Tensor]:
    """``dl/dx_i`` as views of the vector arena, made by one ``tensor_split`` (long chains)."""
    cuts, pick = program.output_split
    pieces = vectors.tensor_split(cuts, dim=1)
    return [pieces[k] for k in pick]
