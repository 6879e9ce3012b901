"""Public entry points: :func:`plan`, :func:`backward`, :func:`plan_composite`, :func:`load_plan`.

Chains of patterns are planned here (:func:`spscan.runtime.plan.build_plan`); an ``nn.Module`` is handed
to its front end (:mod:`spscan.chain.model` for traced chains, :mod:`spscan.recurrent.plan` for
``nn.RNN``/``GRU``/``LSTM``), which plans through the same entry point and runs on the same engine.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import torch

from spscan.runtime.choices import NativeModule
from spscan.runtime import Gradients, check_inputs
from spscan.errors import NotPlannable
from spscan.options import CHAIN, GRAPH, PATTERNS, RECURRENT, check_options, takes_options
from spscan.graph.plan import plan_graph, wrap_graph
from spscan.chain.model import ModelPlan
from spscan.chain.planning import UnitRefused, is_chain_model, plan_model
from spscan.chain.wrapper import wrap_chain
from spscan.runtime.plan import Plan, build_composite, build_plan, resolve_device
from spscan.recurrent.plan import RecurrentPlan, plan_recurrent
from spscan.recurrent.wrapper import wrap_recurrent
from spscan.recurrent.stacked import StackedRecurrentPlan, is_stacked, plan_stacked

__all__ = ["plan", "backward", "forward", "wrap", "plan_composite", "load_plan"]

_RECURRENT = (torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM)


def _front_end(model: torch.nn.Module):
    """``(kind, plan, wrap)`` of the front end that owns ``model``: the one place a model is dispatched."""
    if type(model) in _RECURRENT:  # (a subclass, a parametrized one, is traced: one opaque node where it is torch's)
        if is_stacked(model):  # num_layers > 1 or bidirectional: one scan per (layer, direction)
            return RECURRENT, plan_stacked, wrap_recurrent
        return RECURRENT, plan_recurrent, wrap_recurrent
    if is_chain_model(model):
        return CHAIN, plan_model, wrap_chain
    return GRAPH, plan_graph, wrap_graph  # a model with its own forward: traced with torch.fx


def _model_options(func: str, model: torch.nn.Module, example_input, options: dict):
    kind, plan_fn, wrap_fn = _front_end(model)
    if example_input is None and kind != RECURRENT:
        raise TypeError(f"{func}(model, example_input): a {type(model).__name__} is planned from an example input "
                        f"(B, *in_shape); pass one, e.g. a batch of your data")
    if options.get("batch_size") is None and kind != RECURRENT and isinstance(example_input, torch.Tensor) \
            and example_input.dim() >= 1 and example_input.shape[0] > 0:
        # the cost model plans for the batch the user showed (a recurrent front end reads its own layout)
        options = {**options, "batch_size": int(example_input.shape[0])}
    return plan_fn, wrap_fn, check_options(func, kind, options, f"a {type(model).__name__}")


def _chain_or_traced(model: torch.nn.Module, example_input: torch.Tensor, **options: Any) -> Any:
    """A chain's plan made again where the chain changed after wrapping: traced where a layer is one the chain
    front end does not plan now (a layer given hooks, or replaced by a module with a forward of its own)."""
    try:
        return plan_model(model, example_input, **options)
    except NotPlannable:
        return plan_graph(model, example_input, **options)


def _check_one_input(model: torch.nn.Module, example_input: Any) -> None:
    """Refuse an example of several inputs (``(src, tgt)``): the scan plans a model of one tensor input (and
    optional arguments with defaults); ``wrap(..., backward="auto")`` then runs autograd's own backward."""
    if isinstance(example_input, (tuple, list)):
        raise NotPlannable(f"{type(model).__name__}: an example of {len(example_input)} inputs; the scan plans a "
                           "model of one tensor input (B, *in_shape), whose forward's other arguments, if any, "
                           "have defaults or are state without gradients (an example (x, hidden))")


def _state_example(model: torch.nn.Module, example_input: Any) -> Optional[tuple]:
    """``(x, state)`` for an example ``(x, *state)`` of a traced model whose forward takes state after its input
    (``forward(input, hidden)``: tensors, or tuples and lists of them, none requiring a gradient); else None."""
    if not isinstance(example_input, (tuple, list)) or len(example_input) < 2 or _front_end(model)[0] != GRAPH:
        return None
    x, state = example_input[0], tuple(example_input[1:])
    leaves = torch.utils._pytree.tree_leaves(state)
    if not isinstance(x, torch.Tensor) or not leaves or not all(
            isinstance(t, torch.Tensor) and not t.requires_grad for t in leaves):
        return None
    return x, state


@takes_options
def plan(patterns: Any, example_input: Optional[torch.Tensor] = None, **options: Any):
    """Plan the backward scan over a chain of transposed-Jacobian patterns (or a model).

    Args:
        patterns: ``n`` patterns in layer order, ``patterns[i-1]`` the structure of ``J_i^T``
            (shape ``(d_{i-1}, d_i)``), each a canonical SciPy CSR matrix/array or torch sparse
            CSR tensor (values ignored). A model followed by an example input plans that model
            instead: an ``nn.Sequential`` chain (:mod:`spscan.chain.model`), an ``nn.RNN``/``GRU``/``LSTM``
            (:mod:`spscan.recurrent.plan`; stacked and bidirectional ones through :mod:`spscan.recurrent.stacked`)
            or any other model ``torch.fx`` traces (:mod:`spscan.graph.plan`).
        example_input: for a model, a batch ``(B, *in_shape)`` (a recurrent module: ``(T, B, I)``,
            or ``(B, T, I)`` if batch_first); its per-sample shape is planned.

    Returns:
        a :class:`Plan`, already bound (lowered, tables on its device) for per-sample values
        without ``extra`` terms (other signatures are bound on first use or with :meth:`Plan.bind`);
        for a model, the front end's plan.

    """
    if isinstance(patterns, torch.nn.Module):
        if options.get("backward", "auto") != "auto":
            raise TypeError("plan(): option 'backward' chooses what a wrapped model runs; pass it to spscan.wrap")
        plan_fn, _, opts = _model_options("plan", patterns, example_input, options)
        opts.pop("backward", None)
        _check_one_input(patterns, example_input)
        try:
            return plan_fn(patterns, example_input, **opts)
        except UnitRefused:  # a layer its unit does not cover: the chain traced, that layer an opaque node
            return plan_graph(patterns, example_input, **opts)
    if example_input is not None:
        raise TypeError("plan(patterns): an example input is for a model; a chain of patterns takes none")
    return build_plan(patterns, **check_options("plan", PATTERNS, options, "a chain of patterns"))


@takes_options
def wrap(model: torch.nn.Module, example_input: Optional[torch.Tensor] = None, **options: Any) -> torch.nn.Module:
    """An ``nn.Module`` sharing ``model``'s parameters whose backward runs through the scan.

    ``loss.backward()`` fills the input's and every parameter's ``.grad`` as autograd would. The
    model is planned as :func:`plan` plans it, with the same options.

    Args:
        model: an ``nn.Sequential``, an ``nn.RNN``/``GRU``/``LSTM`` (stacked, bidirectional) or any
            model ``torch.fx`` traces.
        example_input: a batch ``(B, *in_shape)`` (a recurrent module: ``(T, B, I)``, or
            ``(B, T, I)`` if batch_first; optional there: lengths are planned on first use).

    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"wrap(model, example_input): model must be an nn.Module, got {type(model).__name__}")
    with_state = _state_example(model, example_input)
    if with_state is not None:  # forward(input, hidden): planned for the input, the state read per step
        example_input, state = with_state
    _, wrap_fn, opts = _model_options("wrap", model, example_input, options)
    try:
        try:
            _check_one_input(model, example_input)
            if with_state is not None:
                wrapped = wrap_graph(model, example_input, state, **opts)
            elif wrap_fn is wrap_chain:
                wrapped = wrap_chain(model, example_input, replan_fn=_chain_or_traced, **opts)
            else:
                wrapped = wrap_fn(model, example_input, **opts)
        except UnitRefused:  # a layer its unit does not cover: the chain traced, that layer an opaque node
            wrapped = wrap_graph(model, example_input, None if with_state is None else state, **opts)
    except NotPlannable as e:
        if opts.get("backward") != "auto":
            raise
        # backward="auto" never refuses a model: what the scan cannot plan runs autograd's own backward
        reason = str(e).splitlines()[0]
        warnings.warn(f"spscan.wrap: {reason}; the model runs autograd's own backward (backward='native'). "
                      "wrap(..., backward='scan') raises instead", stacklevel=2)
        return NativeModule(model, reason)
    if example_input is None or isinstance(example_input, torch.Tensor):
        # how to make it again where it is unpickled (a plan holds closures and device tables: not pickled)
        spec = None if example_input is None else (tuple(example_input.shape), example_input.dtype)
        if with_state is not None:  # and the state's shapes and dtypes, in its structure
            spec += (torch.utils._pytree.tree_map(lambda t: (tuple(t.shape), t.dtype), state),)
        wrapped.wrapped_as = (_wrap_again, dict(options), spec)
    return wrapped


def _wrap_again(model: torch.nn.Module, options: dict, spec: Optional[tuple], training: bool) -> torch.nn.Module:
    """A wrapper unpickled (``torch.load``, ``copy.deepcopy``): ``model`` wrapped again as it was, planned
    from a zero example of the shape and dtype it was planned from, on the model's device."""
    from spscan.chain.wrapper import model_device

    example = None
    if spec is not None:
        device = model_device(model) or torch.device("cpu")
        example = torch.zeros(spec[0], dtype=spec[1], device=device)
        if len(spec) > 2:  # state arguments: (x, *state) of zeros
            is_spec = lambda v: isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], torch.dtype)  # noqa: E731
            state = torch.utils._pytree.tree_map(lambda v: torch.zeros(v[0], dtype=v[1], device=device), spec[2],
                                                 is_leaf=is_spec)
            example = (example, *state)
    wrapped = wrap(model, example, **options)
    wrapped.training = training  # the wrapper's own flag; the model's came with it
    return wrapped


def forward(plan: Any, x: torch.Tensor):
    """Run the planned model on ``x``: ``(output, jacobians)`` for :func:`backward` (model plans only)."""
    if not isinstance(plan, (ModelPlan, RecurrentPlan, StackedRecurrentPlan)):
        raise TypeError("forward(plan, x) needs a plan made from a model: spscan.plan(model, example_input)")
    return plan.forward(x)


def plan_composite(patterns: Any, *, backend: str = "auto", device=None, dtype: Optional[torch.dtype] = None,
                   batch_size: int = 16) -> Plan:
    """Plan the composite ``M = J_1^T J_2^T ... J_n^T`` of a chain (and its affine term).

    The products are planned as the scan's up-sweep products are (symbolic once, pairwise tree)
    and run on the same engine. ``plan.bind(shared, has_extra).run(values, extra=extra)`` returns
    a result whose ``.composite`` holds ``M``'s values in the CSR order of
    ``plan.composite_pattern`` (``(nnz,)`` if every input is shared, else ``(B, nnz)``) and whose
    ``.composite_vector`` is ``v = sum_i J_1^T..J_i^T extra[i]`` (``(B, d_0)``, or ``None``), so
    that ``dl/dx_0 = M dl/dx_n + v``.

    >>> import scipy.sparse as sp, torch
    >>> p = plan_composite([sp.csr_array(sp.eye(2))] * 3)
    >>> p.bind(shared=[True] * 3).run([torch.full((2,), 2.0)] * 3).composite.tolist()
    [8.0, 8.0]
    """
    return build_composite(patterns, backend=backend, device=device, dtype=dtype, batch_size=batch_size)


def backward(
    plan: Plan,
    values: Any,
    grad: torch.Tensor,
    extra: Optional[Sequence[Optional[torch.Tensor]]] = None,
    *,
    check_finite: bool = False,
) -> Sequence[torch.Tensor]:
    """Run the planned scan: ``dl/dx_i`` for every ``i`` from one step's Jacobian values.

    Args:
        plan: from :func:`plan` (a chain plan, or a model plan with the values ``spscan.forward``
            returned).
        values: ``n`` tensors, ``values[i-1]`` the entries of ``J_i^T`` in its pattern's CSR order,
            ``(B, nnz_i)`` per sample or ``(nnz_i,)`` shared by the batch; or one stacked
            ``(n, B, nnz)`` / ``(n, nnz)`` tensor when every layer has the same nnz.
        grad: ``(B, d_n)``, ``dl/dx_n``.
        extra: optional ``n+1`` entries, ``None`` or ``(B, d_i)``: added to ``dl/dx_i`` (the affine
            scan ``g_{i-1} = J_i^T g_i + extra[i-1]``, for losses that read intermediate outputs).
        check_finite: raise ``ValueError`` if any input holds NaN/Inf (costs a device sync);
            by default non-finite values propagate as in autograd.

    Returns:
        a sequence of ``n+1`` tensors ``(B, d_i)`` (:class:`spscan.runtime.Gradients`: indexable,
        ``len``, iterable, ``.stacked()``); ``[n]`` is ``grad`` (+ ``extra[n]``). They are views into
        one buffer owned by the result (not necessarily contiguous), each made only when asked for,
        so a long chain costs no per-layer host work. Inputs are never modified.
    """
    if isinstance(plan, ModelPlan):
        return plan.backward(values, grad, extra)
    if isinstance(plan, (RecurrentPlan, StackedRecurrentPlan)):
        raise TypeError("spscan.backward returns the n+1 chain gradients dl/dx_i; a recurrent plan's backward "
                        "returns input, initial-state and parameter gradients instead: call "
                        "plan.backward(saved, grad_output, grad_h_n[, grad_c_n]) with the saved state from "
                        "spscan.forward(plan, x), or train through spscan.wrap(module)")
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a spscan Plan, got {type(plan).__name__}")
    if plan.kind != "scan":
        raise TypeError("plan: a composite plan has no per-layer gradients; run it with "
                        "plan.bind(shared, has_extra).run(values, extra=...)")
    dims, nnz, uniform = plan._call_tables  # tuples made once: no O(n) copy per call
    items, stacked, shared, has_extra, _, _, device, operators = check_inputs(
        plan.n, nnz, dims, plan.dtype, plan.device, values, grad, extra, check_finite, uniform_nnz=uniform)
    if torch.is_grad_enabled() and _any_requires_grad(grad, items, extra):
        raise ValueError("spscan.backward is not differentiable: its results would be silently detached from the "
                         "inputs that require grad (values, grad or extra). Call it under torch.no_grad() or pass "
                         "detached tensors; to train a model, use spscan.wrap(model), whose backward runs the scan "
                         "inside autograd")
    # the flags come from check_inputs (one per layer, tuples) and the device from the tensors (canonical, there):
    # the binding is looked up directly, without Plan.bind's checks of caller-given flags and device
    bound = plan._binding(shared, has_extra, device, operators)
    return Gradients(bound.run(items[0] if stacked else items, grad, extra, check=False))


def _any_requires_grad(grad, items, extra) -> bool:
    if grad.requires_grad:
        return True
    seen: set[int] = set()
    for v in items:  # a tensor repeated along the chain is looked at once
        if id(v) not in seen:
            seen.add(id(v))
            if isinstance(v, torch.Tensor) and v.requires_grad:
                return True
    return any(e is not None and e.requires_grad for e in (extra or ()))


def load_plan(path) -> Plan:
    """Read a plan written by :meth:`Plan.save` (no pickle; validated, ``ValueError`` if corrupted)."""
    from spscan.planner.serialize import load_scan

    scan, opts = load_scan(path)
    try:
        dtype = None if opts["dtype"] is None else {"float32": torch.float32, "float64": torch.float64}[opts["dtype"]]
        backend = opts["backend"]
        if backend not in ("torch", "triton"):
            raise ValueError(f"backend {backend!r}")
        return Plan(scan, backend, resolve_device(opts["device"]), dtype, opts["max_memory"],
                    opts["requested_levels"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: corrupted spscan plan: bad options ({exc})") from exc
