"""Tracing a model with ``torch.fx``: its forward's optional arguments fixed at their defaults
(:func:`fixed_arguments`), modules with hooks (and those the tracing names) kept as one call
(:class:`LeafTracer`), and, for a forward whose Python reads its tensors' sizes (``assert t <= block_size``,
``torch.arange(t)``), the per-sample sizes made the example's numbers while the batch size stays traced
(:class:`ShapeTracer`): a plan is made per per-sample shape, and the batch may change between calls."""

from __future__ import annotations

import contextlib
import inspect
import operator
import sys
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from spscan.chain.model import has_hooks
from spscan.chain.wrapper import PLAIN_ARGUMENT_TYPES
from spscan.graph.rewrites import GRAD_ENABLED
from spscan.runtime.checks import attributes_kept, buffers_kept

__all__ = ["ExampleRejected", "FunctionCall", "LeafTracer", "ShapeTracer", "Whole", "drop_fixed_inputs", "fixed_arguments",
           "raise_if_forward_fails"]


def fixed_arguments(model: nn.Module) -> dict[str, Any]:
    """``{name: default}`` of the parameters of ``model``'s forward after its input that have a plain default
    (None, a bool, number or string): ``forward(x, mask=None, causal=False)``. The model is traced with them
    at those values (fx's ``concrete_args``), so a call that passes nothing else runs the planned graph; a
    parameter without a default, or with another kind of default, stays an input of the graph (refused:
    the scan plans one tensor input)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature Python can read
        return {}
    return {p.name: p.default for p in params[1:]
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is not p.empty
            and type(p.default) in PLAIN_ARGUMENT_TYPES}


def drop_fixed_inputs(graph: fx.Graph) -> None:
    """Remove what fx's ``concrete_args`` leaves of the fixed parameters: their placeholders and the checks
    that a call passed the planned values (``_assert_is_none``, ``torch._assert``), which read nothing else.
    The forward itself saw the values, not the placeholders; a placeholder the forward's nodes do read is
    kept (the graph then has several inputs and is refused as such)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][1:]
    for ph in placeholders:
        members, todo = set(), [ph]
        while todo:
            n = todo.pop()
            if n not in members:
                members.add(n)
                todo.extend(n.users)
        if any(n.op == "output" or any(i not in members for i in n.all_input_nodes) for n in members):
            continue  # the forward reads it
        for n in reversed(list(graph.nodes)):
            if n in members:
                graph.erase_node(n)


class Whole(nn.Module):
    """A model that is itself a ``torch.nn`` layer, called as a leaf of a one-node graph."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


class ExampleRejected(ValueError):
    """A node rejected the planner's example batch (of 2)."""


def raise_if_forward_fails(model: nn.Module, example_input: Any) -> None:
    """Run ``model`` eagerly on ``example_input`` as a training step runs it (gradients on: a forward that
    registers a hook on a tensor needs them; no random numbers drawn, buffers as they were) and let its own
    error through: a forward that fails without tracing is the model's error, not a form the scan cannot
    plan."""
    with attributes_kept(model), buffers_kept(model), torch.enable_grad(), torch.random.fork_rng(devices=[]):
        model(example_input)  # (a cache it grows, ``self.cos_cached``, left as it was: the trace must see it)


_APPLY = torch.autograd.Function.apply.__func__.__code__  # type: ignore[attr-defined]


def _inside_function() -> bool:
    """Whether a ``torch.autograd.Function``'s ``apply`` is running further up the stack (fx traces through
    its forward)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is _APPLY:
            return True
        frame = frame.f_back
    return False


def _torchs_own(fn: type) -> bool:
    return fn.__module__ == "torch" or fn.__module__.startswith("torch.")


class FunctionCall:
    """A user's ``torch.autograd.Function`` as a graph node's target: ``FunctionCall(Fn)(*args)`` is
    ``Fn.apply(*args)``. The node runs as its own call, and its gradient comes from autograd's backward of
    it: the function's own ``backward`` (a gradient reversal, a straight-through estimator), not its forward's
    derivative."""

    def __init__(self, fn: type) -> None:
        self.fn = fn
        self.__name__ = self.__qualname__ = f"{fn.__qualname__}.apply"
        self.__module__ = fn.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn.apply(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionCall({self.fn.__module__}.{self.fn.__qualname__})"


@contextlib.contextmanager
def _functions_as_calls(tracer: fx.Tracer) -> Iterator[None]:
    """While tracing, a user's ``torch.autograd.Function`` applied to traced tensors is recorded as one node
    (:class:`FunctionCall`) instead of traced through: fx would record its forward's operations and lose its
    backward. ``Function.apply`` is replaced for the duration of the trace (as fx patches what it wraps) and
    put back after; torch's own functions (reentrant checkpointing) are traced through as before."""
    base = torch.autograd.Function
    original = base.__dict__["apply"]

    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        if not _torchs_own(cls) and any(isinstance(a, fx.Proxy) for a in pytree.tree_leaves((args, kwargs))):
            return tracer.create_proxy("call_function", FunctionCall(cls), args, kwargs)
        return original.__func__(cls, *args, **kwargs)

    base.apply = classmethod(apply)  # type: ignore[assignment]
    try:
        yield
    finally:
        base.apply = original  # type: ignore[assignment]


class _Proxy(fx.Proxy):
    """fx's proxy with item assignment (``y[:, 0] = 0``, ``y[mask] = v``) recorded as an ``operator.setitem``
    node, which the rewrites make an out-of-place update (:func:`~spscan.graph.rewrites.out_of_place`)."""

    def __setitem__(self, key: Any, value: Any) -> None:
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


class LeafTracer(fx.Tracer):
    """fx's tracer, with a module that has hooks kept as one call (fx would trace through a container or a
    module of the user's, and its hooks would not run), and the modules named in ``leaves``: each becomes an
    opaque node."""

    def __init__(self, leaves: Optional[set] = None) -> None:
        super().__init__()
        self.leaves = set(leaves or ())

    # a buffer read in the forward is a node (``self.pos[:t]`` slices it with a traced size), as a parameter is
    proxy_buffer_attributes = True

    def trace(self, root: Any, concrete_args: Optional[dict] = None) -> fx.Graph:  # type: ignore[override]
        """fx's trace, with gradients enabled as a training step's forward runs: a node made inside the
        forward's own ``torch.no_grad()`` is marked so (``meta[GRAD_ENABLED]``, :func:`gradient_stops`)."""
        with torch.enable_grad(), _functions_as_calls(self):
            return super().trace(root, concrete_args)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None) -> fx.Node:
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        # torch's own autograd functions are traced through (a user's is one node: _functions_as_calls); reentrant
        # checkpointing runs its forward without gradients, and its gradient is its forward's (its backward
        # recomputes it with them)
        node.meta[GRAD_ENABLED] = True if _inside_function() else torch.is_grad_enabled()
        return node

    def _filter_traceback_frames(self, user_stack_summary):  # fx's hook: a node's recorded source lines
        """fx's frames of the forward, less this tracer's own (a node's source is the model's line)."""
        frames = super()._filter_traceback_frames(user_stack_summary)
        return type(frames).from_list([f for f in frames if f.filename != __file__])

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return has_hooks(m) or module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


class _ShapeProxy(_Proxy):
    """A traced tensor whose sizes its tracer knows from two example batches (:class:`ShapeTracer`): ``size()``,
    ``shape`` and ``dim()`` give Python numbers for the per-sample sizes and a traced size for the batch's;
    ``ndim``, ``len()``, ``dtype`` and ``is_floating_point()`` give the examples' (their Python reads them in
    conditions and ``torch.finfo``: the plan is made again for another per-sample shape, and a model whose
    dtype changes is planned again)."""

    def _examples(self) -> Optional[tuple]:
        got = self.tracer.examples.get(self.node)  # type: ignore[attr-defined]
        return got if got is not None and all(isinstance(v, torch.Tensor) for v in got) else None

    def _size_of(self, d: int) -> Any:
        a, b = (v.shape for v in self._examples())  # type: ignore[union-attr]
        if a[d] == b[d]:
            return int(a[d])
        return self.tracer.create_proxy("call_method", "size", (self, d), {})

    def size(self, dim: Optional[int] = None) -> Any:
        ex = self._examples()
        if ex is None:
            return fx.Proxy.__getattr__(self, "size")(*(() if dim is None else (dim,)))
        if dim is not None:
            return self._size_of(dim % ex[0].dim())
        return tuple(self._size_of(d) for d in range(ex[0].dim()))

    @property
    def shape(self) -> Any:  # type: ignore[override]
        return self.size()

    def dim(self) -> Any:
        ex = self._examples()
        return ex[0].dim() if ex is not None else fx.Proxy.__getattr__(self, "dim")()

    @property
    def ndim(self) -> Any:  # ``assert 1 < x.ndim`` (LLaMA's ``reshape_for_broadcast``)
        return self.dim()

    def __len__(self) -> int:  # ``len(src)``: the first dim's size where it is a per-sample size
        size = self.size(0)
        if not isinstance(size, int):
            raise TypeError("len() of a traced tensor whose first dim is the batch")
        return size

    def _fixed(self, what: str) -> Any:
        """A property of the examples (the same for both), else the traced attribute."""
        ex = self._examples()
        if ex is None or getattr(ex[0], what) != getattr(ex[1], what):
            return fx.Proxy.__getattr__(self, what)
        return getattr(ex[0], what)

    @property
    def dtype(self) -> Any:  # ``torch.finfo(scores.dtype).min``, ``if self.weight.dtype == torch.float16``
        got = self._fixed("dtype")
        if isinstance(got, torch.dtype):
            self.tracer.dtype_read = True  # type: ignore[attr-defined]
        return got

    def is_floating_point(self) -> Any:
        ex = self._examples()
        return ex[0].is_floating_point() if ex is not None else fx.Proxy.__getattr__(self, "is_floating_point")()


class ShapeTracer(LeafTracer):
    """:class:`LeafTracer` that runs every traced call on two example batches (of 2 and 3 samples) as it records
    it, so that the forward's Python may read its tensors' per-sample sizes as numbers (``B, T, C = x.size()``,
    ``assert T <= self.block_size``, ``torch.arange(T)``): a size the two batches agree on is that number in the
    graph (the plan is per per-sample shape), a size they do not (the batch's) stays traced. Control flow on
    tensor values is still refused. The examples draw random numbers and update buffers (dropout, BatchNorm):
    :meth:`trace` restores both."""

    def __init__(self, leaves: Optional[set], examples: tuple) -> None:
        super().__init__(leaves)
        self.examples: dict = {}
        self.dtype_read = False  # the forward read a tensor's dtype as a value (``torch.finfo(x.dtype).min``)
        self._inputs = examples
        self._running = False

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ShapeProxy(node, self)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if self._running:  # a parameter or buffer an example's run of a module reads: the tensor itself
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        if self._running:  # an example's run of a module: the module itself, nothing recorded
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def trace(self, root: Any, concrete_args: Optional[dict] = None) -> fx.Graph:  # type: ignore[override]
        with buffers_kept(root), torch.random.fork_rng(devices=[]):
            return super().trace(root, concrete_args)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):
        p = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        if kind == "placeholder":
            if not self.examples:  # the input (the forward's optional arguments are fixed, not traced)
                self.examples[p.node] = self._inputs
        elif kind != "output":
            self._running = True
            try:
                with torch.no_grad():
                    self.examples[p.node] = tuple(self._run(kind, target, args, kwargs, i) for i in range(2))
            except Exception:  # an example the call rejects: its sizes stay traced
                pass
            finally:
                self._running = False
        return p

    def _run(self, kind: str, target: Any, args: Any, kwargs: Any, i: int) -> Any:
        missing = object()

        def value(v: Any) -> Any:
            if isinstance(v, fx.Proxy):
                got = self.examples.get(v.node, missing)
                if got is missing:
                    raise LookupError(v.node.name)
                return got[i]
            return v

        a = fx.node.map_aggregate(args, value)
        k = fx.node.map_aggregate(kwargs, value)
        if kind == "call_function":
            return target(*a, **k)
        if kind == "call_method":
            return getattr(a[0], target)(*a[1:], **k)
        if kind == "call_module":
            m = self.root.get_submodule(target)
            return type(m).forward(m, *a, **k)
        if kind == "get_attr":
            obj: Any = self.root
            for part in target.split("."):
                obj = getattr(obj, part)
            return obj
        raise LookupError(kind)
