"""The one bridge between torch autograd and the scan.

Every wrapped module (a chain, a traced graph, a recurrent module, stacked or not) records its
backward through :class:`ScanFunction`, by way of :func:`apply`. The front end implements the
small :class:`FrontEnd` protocol: its forward returns the outputs and what the backward needs, its
backward returns one gradient per input. The bridge owns what is the same for all of them: the
refusal of ``torch.func`` transforms and of second derivatives (a clear error, never a silent
``None``), the saved state's lifetime (freed with the graph where the front end asks for it, so a
second backward through a freed graph raises autograd's own error), and running the backward with
gradient recording off. And, for a front end whose result is packed from several parts (a forward returning
several tensors), that a parameter only unread parts depend on keeps a ``None`` gradient, as in autograd
(:func:`split_parts`, :func:`gated`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Optional, Protocol

import torch

from spscan.runtime import PeriodicValues

__all__ = ["FrontEnd", "PartsRead", "ScanFunction", "apply", "gated", "holds_tensors", "in_functorch_transform",
           "keep_graph", "map_tensors", "refuse_functorch", "refuse_second_derivative", "split_parts",
           "tensors_and_signature"]


class FrontEnd(Protocol):
    """What a wrapped module's plan gives the bridge.

    Attributes:
        materialize_grads: autograd passes zeros (``True``) or ``None`` (``False``) for outputs the
            loss does not reach.
        stash_state: the forward's state goes through ``ctx.save_for_backward`` (its tensors are freed
            after a backward that does not retain the graph, and checked for in-place changes); else it
            is kept on the context as it is and the front end manages its lifetime.
    """

    materialize_grads: bool
    stash_state: bool

    def scan_forward(self, inputs: tuple) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The module's outputs for ``inputs`` (run with gradient recording off) and the state its
        backward reads."""

    def scan_backward(self, state: Any, grad_outputs: tuple, needs: tuple[bool, ...]) -> tuple:
        """One gradient (or ``None``) per input of :meth:`scan_forward`, from the outputs' gradients;
        ``needs[k]``: input ``k`` wants one. Runs with gradient recording off."""


_NOT_TWICE = ("spscan's scan backward cannot be differentiated twice: second derivatives (create_graph=True, "
              "Hessian-vector products, gradient penalties) are not supported through a wrapped module; "
              "compute them with plain autograd on the unwrapped model")


class _RefuseSecondDerivative(torch.autograd.Function):
    """Passes first-order gradients through; differentiating them raises (never a silent ``None``)."""

    @staticmethod
    def forward(n_sources: int, *tensors):  # type: ignore[override]
        return tuple(t.clone() for t in tensors[n_sources:])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.n_sources = inputs[0]

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        raise RuntimeError(_NOT_TWICE)


def refuse_second_derivative(sources: Sequence[Optional[torch.Tensor]], grads: tuple) -> tuple:
    """``grads`` as outputs of a node fed by ``sources`` (the function's inputs): a first-order
    gradient stays usable, and differentiating it again with respect to any source raises."""
    idx = [k for k, g in enumerate(grads) if isinstance(g, torch.Tensor)]
    if not idx:
        return grads
    srcs = [s for s in sources if isinstance(s, torch.Tensor) and s.requires_grad]
    out = _RefuseSecondDerivative.apply(len(srcs), *srcs, *[grads[k] for k in idx])
    res = list(grads)
    for k, t in zip(idx, out):
        res[k] = t
    return tuple(res)


def in_functorch_transform() -> bool:
    """Whether this runs inside a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, ``vmap``)."""
    return getattr(torch._C._functorch, "maybe_current_level", lambda: None)() is not None


def refuse_functorch() -> None:
    """Raise inside a ``torch.func`` transform: the scan's backward writes into its own buffers (a wrapper
    with ``backward="auto"`` runs the model's own step there instead)."""
    if in_functorch_transform():
        raise RuntimeError("torch.func transforms (grad, vjp, jacrev, vmap) over a spscan-wrapped module are not "
                           "supported: the scan's backward runs its own batched kernels on preallocated buffers; "
                           "use loss.backward() or torch.autograd.grad, with the batch as the leading dimension")


def keep_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); ``True`` where unknown."""
    get = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    if get is None:
        return True
    try:
        return bool(get())
    except RuntimeError:
        return True


# --------------------------------------------------------------------------- saved state


class _Slot:
    """Where a saved-state object held a tensor that now lies in ``ctx.saved_tensors`` (index ``index``)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


# The one tensor walker (map_tensors, tensors_and_signature). Its containers: dicts, lists, tuples, and the
# classes of this package whose objects hold tensors in their attributes (a front end's saved state,
# PeriodicValues), which register with holds_tensors; anything else is a leaf, passed on as it is.
# Hand-written rather than torch.utils._pytree's tree_map: it runs twice per training step, and on a stacked
# LSTM's saved state it took 62 us a call against tree_map's 235 us.

_ATOMS = frozenset([type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size, range, slice])
_HOLDERS: set = set()


def holds_tensors(cls: type) -> type:
    """Class decorator: objects of ``cls`` hold tensors in their attributes (``__dict__``), and the tensor walker
    (:func:`map_tensors`, :func:`tensors_and_signature`) looks inside them: their tensors go through
    ``ctx.save_for_backward`` and into a recorded graph's signature. A copy is made with ``object.__new__``
    and the attributes set, no ``__init__``."""
    _HOLDERS.add(cls)
    return cls


holds_tensors(PeriodicValues)


class Unseen(Exception):
    """What :func:`tensors_and_signature` walked holds something a recorded graph could not replay."""


_TENSOR = object()  # a tensor's place in a signature


def _walk(value, fn, trace: Optional[list]):
    """``value`` rebuilt with ``fn`` applied to its tensors (and :class:`_Slot` s); with ``trace``, a hashable
    record of everything else appended to it, in the same order. Dispatched on the exact type first."""
    t = type(value)
    if t in _ATOMS:
        if trace is not None:
            trace.append((t, value))
        return value
    if t is torch.Tensor or t is _Slot or isinstance(value, torch.Tensor):
        if trace is not None:
            trace.append(_TENSOR)
        return fn(value)
    if t is dict or isinstance(value, dict):
        if trace is not None:
            trace.append((dict, tuple(value)))
        return {k: _walk(v, fn, trace) for k, v in value.items()}
    if t is list or t is tuple:
        if trace is not None:
            trace.append((t, len(value)))
        return t([_walk(v, fn, trace) for v in value])
    if t in _HOLDERS:
        if trace is not None:
            trace.append((t, tuple(value.__dict__)))
        copy = object.__new__(t)
        copy.__dict__.update({k: _walk(v, fn, trace) for k, v in value.__dict__.items()})
        return copy
    if trace is not None:  # passed on as it is: part of the signature (a configuration object)
        try:
            hash(value)
        except TypeError:
            raise Unseen from None
        trace.append((t, value))
    return value


def map_tensors(value, fn):
    """A copy of ``value`` with ``fn`` applied to every tensor (or :class:`_Slot`) it holds, inside the walker's
    containers (dicts, lists, tuples, :func:`holds_tensors` objects); other objects are kept as they are.
    Containers are rebuilt, not changed."""
    return _walk(value, fn, None)


def tensors_and_signature(value: Any) -> tuple[list[torch.Tensor], Hashable]:
    """``value``'s tensors, in :func:`map_tensors`' order, and a hashable signature of everything else (its
    structure and every other leaf). Raises :class:`Unseen` where a replay could not reproduce ``value``: a
    tensor with an autograd graph, or an unhashable leaf (a hashable one is part of the signature: a new
    object is a new signature)."""
    tensors: list[torch.Tensor] = []
    trace: list = []

    def take(t: torch.Tensor) -> torch.Tensor:
        if t.grad_fn is not None:  # it carries an autograd graph of the first call's tensors
            raise Unseen
        tensors.append(t)
        return t

    _walk(value, take, trace)
    return tensors, tuple(trace)


def flatten_tensors(value) -> tuple[Any, list[torch.Tensor]]:
    """``value`` with each tensor it holds replaced by a slot, and those tensors in slot order
    (:func:`map_tensors` with the slots' indices rebuilds it)."""
    tensors: list[torch.Tensor] = []

    def slot(t):
        tensors.append(t)
        return _Slot(len(tensors) - 1)

    return map_tensors(value, slot), tensors


def _save(ctx, front: FrontEnd, state, inputs: tuple) -> None:
    ctx.n_inputs = len(inputs)
    if front.stash_state:
        skeleton, tensors = flatten_tensors(state)
        ctx.state = None if state is None else skeleton
        ctx.save_for_backward(*inputs, *tensors)
    else:
        ctx.state = state  # kept with the graph: backward(retain_graph=True) can run again
        ctx.save_for_backward(*inputs)  # read only to attach the refusal of second derivatives


def _load(ctx) -> tuple[Any, tuple]:
    saved = ctx.saved_tensors
    inputs = saved[: ctx.n_inputs]
    if not ctx.front.stash_state or ctx.state is None:
        return ctx.state, inputs
    tensors = saved[ctx.n_inputs:]
    return map_tensors(ctx.state, lambda s: tensors[s.index]), inputs


# --------------------------------------------------------------------------- the function


class PartsRead:
    """Which parts of one step's packed result (a forward returning several tensors, or one and the tensors made
    from it) the loss read: ``used[j]`` for part ``j``, filled in by :func:`split_parts`'s backward, which runs
    before the scan's; None until then."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used: Optional[list[bool]] = None


class _Split(torch.autograd.Function):
    """The packed result split into its parts (copies, contiguous as each was in the model); the backward
    records which parts have a gradient (a part the loss does not read has None) and packs theirs, zeros for
    the others, for the scan's backward."""

    @staticmethod
    def forward(ctx, record: PartsRead, y: torch.Tensor, sizes: list):  # type: ignore[override]
        ctx.set_materialize_grads(False)
        ctx.record, ctx.shapes = record, [(y.shape[0], n) for n in sizes]
        return tuple(p.clone(memory_format=torch.contiguous_format) for p in y.split(sizes, 1))

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.record.used = [g is not None for g in grads]
        ref = next(g for g in grads if g is not None)
        return None, torch.cat([g.reshape(s) if g is not None else ref.new_zeros(s)
                                for g, s in zip(grads, ctx.shapes)], 1), None


class _Gate(torch.autograd.Function):
    """A tensor of the scan's inputs (a parameter) that reaches only some parts of the packed result: its
    gradient is None where the loss read none of them, as autograd leaves a parameter that only an unread
    output depends on (an optimizer with momentum or weight decay moves a parameter whose gradient is zero)."""

    @staticmethod
    def forward(ctx, record: PartsRead, parts: frozenset, t: torch.Tensor):  # type: ignore[override]
        ctx.record, ctx.parts = record, parts
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        used = ctx.record.used
        if used is not None and not any(used[j] for j in ctx.parts):
            return None, None, None
        return None, None, g


def gated(flat: list, gates: dict, record: PartsRead) -> list:
    """``flat`` with each tensor of ``gates`` (flat index -> the parts it reaches) behind a :class:`_Gate`."""
    return [_Gate.apply(record, gates[i], t) if i in gates and t.requires_grad else t for i, t in enumerate(flat)]


def split_parts(record: PartsRead, y: torch.Tensor, sizes: list) -> tuple:
    """``y`` ``(B, sum(sizes))`` split into its parts, recorded (:class:`_Split`)."""
    return _Split.apply(record, y, sizes)


class ScanFunction(torch.autograd.Function):
    """Forward: the front end's forward. Backward: the front end's scan backward.

    ``forward`` takes ``ctx`` itself rather than defining ``setup_context``: with that, every
    ``apply`` binds its arguments through ``inspect.signature`` (a per-step host cost), and the
    ``torch.func`` support it would buy is refused anyway (:func:`refuse_functorch`).
    """

    @staticmethod
    def forward(ctx, front: FrontEnd, *inputs):  # type: ignore[override]
        ctx.set_materialize_grads(front.materialize_grads)
        outputs, state = front.scan_forward(inputs)
        ctx.front = front
        _save(ctx, front, state, inputs)
        # an output that is an input must be a new tensor (autograd refuses to return an input as is)
        return tuple(o.clone() if any(o is i for i in inputs) else o for o in outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):  # type: ignore[override]
        state, inputs = _load(ctx)
        with torch.no_grad():
            grads = ctx.front.scan_backward(state, grad_outputs, tuple(ctx.needs_input_grad[1:]))
        out = (None, *grads)
        if torch.is_grad_enabled():  # create_graph=True: differentiating these again raises
            out = refuse_second_derivative(list(inputs) + list(grad_outputs), out)
        return out


def apply(front: FrontEnd, *inputs) -> tuple[torch.Tensor, ...]:
    """The front end's outputs for ``inputs``, with its scan backward recorded for autograd."""
    refuse_functorch()
    return ScanFunction.apply(front, *inputs)
