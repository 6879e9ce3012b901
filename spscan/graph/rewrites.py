"""Rewrites of a traced model's ``torch.fx`` graph, made before its nodes are matched to units, and the
check that the rewritten graph computes what the model's own forward computes.

* **In place becomes out of place** (:func:`out_of_place`). A model as people write it updates tensors in
  place: ``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``, ``x.relu_()``, ``F.relu_(x)``,
  ``torch.tanh_(x)``, ``x.mul_(2)``, ``x[:, 0] = 0``. Each such node becomes its out-of-place op with the
  same numbers (``x.relu()``, ``inplace=False``, ``torch.tanh``); an in-place call without an out-of-place
  twin (``x.fill_(0)``, ``x[i] = v``) runs on a copy of its input (:class:`OnCopy`). Every later reader of
  the updated tensor then reads the node's output, as it read the updated tensor in the model. A module
  that writes into its input (``inplace=True`` on a module type) is marked (:data:`WRITES_INPUT`): its
  unit computes the same map out of place, and where it runs as its own call it is given a copy.
  An update of a tensor that shares memory with another one read later (``v = x[:, :2]; v.relu_()`` and
  ``x`` read again) is refused by the tracing (:meth:`~spscan.graph.trace.Traced._check_no_alias`): out of
  place, the other tensor would not see it.
* **What the forward computes without gradients stops them** (:func:`gradient_stops`). fx records the
  calls inside ``with torch.no_grad():`` as any others; the tracer marks each node with the grad mode it
  was made in (:data:`GRAD_ENABLED`), and where a value made without gradients is read with them, the
  reader reads it through :func:`detached` (its gradient there is zero, as autograd's). An in-place update
  made without gradients of a tensor that has them (``with torch.no_grad(): h.clamp_(0, 1)``: later readers
  see the new values, and autograd passes their gradient to ``h`` unchanged) is refused: out of place it
  would be a gradient stop, which autograd's is not. (A user's ``torch.autograd.Function`` is one node, its
  own call, whose gradient is its own backward's: :class:`~spscan.graph.tracer.FunctionCall`.)
* **A time-major input taken batch first** (:func:`batch_second_input`): every graph tensor of the scan keeps
  the batch dim first; a model that reads its input with the batch on dim 1 (a time-major sequence) gets it
  batch first and moves it back (``x.transpose(0, 1)``, a view of the same memory) before its first read.
* **Differences as sums** (:func:`subtractions_as_sums`): ``a - b`` of two computed tensors is
  ``a + (-b)``.
* **The graph computes the model's forward** (:func:`check_graph_is_the_forward`): fx records ``h += y`` as
  ``h = h + y`` (its proxies have no in-place operators), so a tensor another name still refers to
  (``skip = h; h += 1; return h + skip``) is not updated in the graph as it is in the model. The rewritten
  graph is run against the model's own forward on the example, with the same random numbers: a graph
  whose output differs (beyond rounding) is refused (:class:`~spscan.errors.NotPlannable`), never planned with other numbers.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from spscan.errors import NotPlannable
from spscan.graph.nodes import node_source, node_text
from spscan.runtime.checks import buffers_kept

__all__ = ["GRAD_ENABLED", "OnCopy", "WRITES_INPUT", "UPDATES", "batch_second_input", "check_graph_is_the_forward",
           "detached", "gradient_stops", "out_of_place", "subtractions_as_sums"]

#: ``node.meta`` key: a ``call_module`` node whose module writes its result into its input (``inplace=True``)
WRITES_INPUT = "spscan_writes_input"
#: ``node.meta`` key: the node whose tensor this (rewritten) node updated in the model, for the alias check
UPDATES = "spscan_updates"
#: ``node.meta`` key: whether gradients were enabled where the forward made the node (set by the tracer)
GRAD_ENABLED = "spscan_grad_enabled"

# ``operator.iadd(a, b)`` written out (fx's proxies have no ``__iadd__``: ``a += b`` is traced as ``a + b``)
_AUGMENTED = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
              operator.ipow: operator.pow, operator.imatmul: operator.matmul, operator.iand: operator.and_,
              operator.ior: operator.or_, operator.ixor: operator.xor, operator.ilshift: operator.lshift,
              operator.irshift: operator.rshift}
# modules whose functions have in-place twins named ``f_`` (``F.relu_``, ``torch.tanh_``)
_FUNCTION_HOMES = (torch, F, torch.special)


class OnCopy:
    """An in-place tensor method without an out-of-place twin, run on a copy of its tensor: ``OnCopy("fill_")(x,
    0)`` is ``x.clone().fill_(0)``; ``OnCopy("__setitem__")(x, i, v)`` is ``x.clone()`` with ``[i] = v``. Returns
    the copy (what the model's later code reads as the updated tensor)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.__name__ = f"{method.strip('_')}_on_a_copy"
        self.__qualname__ = self.__name__

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        y = x.clone()
        getattr(y, self.method)(*args, **kwargs)
        return y

    def __repr__(self) -> str:
        return f"OnCopy({self.method!r})"


def _method_twin(name: str) -> Optional[str]:
    """The out-of-place twin of the in-place tensor method ``name`` (``relu_`` -> ``relu``); ``""`` for an in-place
    method without one (``fill_``); None for a method that is not in place."""
    if not name.endswith("_") or name.startswith("_") or not callable(getattr(torch.Tensor, name, None)):
        return None
    twin = name[:-1]
    return twin if callable(getattr(torch.Tensor, twin, None)) else ""


def _function_twin(f: Any) -> Optional[Callable[..., Any]]:
    """The out-of-place twin of the in-place function ``f`` (``F.relu_`` -> ``F.relu``, ``torch.tanh_`` ->
    ``torch.tanh``), None for any other function."""
    name = getattr(f, "__name__", None)
    if not isinstance(name, str) or not name.endswith("_") or name.startswith("_"):
        return None
    for home in _FUNCTION_HOMES:
        if getattr(home, name, None) is f:
            twin = getattr(home, name[:-1], None)
            if callable(twin):
                return twin
    return None


def _without_inplace_flag(f: Any, args: tuple, kwargs: dict) -> Optional[tuple[tuple, dict]]:
    """``(args, kwargs)`` of a call ``f(*args, **kwargs)`` that passes ``inplace=True`` (by keyword or position:
    ``F.relu(x, True)``, ``F.dropout(x, p, training, True)``), with ``inplace=False``; None for any other call."""
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return None
    if "inplace" not in sig.parameters:
        return None
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return None
    if bound.arguments.get("inplace") is not True:
        return None
    bound.arguments["inplace"] = False
    return tuple(bound.args), dict(bound.kwargs)


def _writes_input(m: nn.Module) -> bool:
    return getattr(m, "inplace", False) is True


def out_of_place(graph: fx.Graph, root: nn.Module) -> list[fx.Node]:
    """Rewrite every in-place node of ``graph`` (traced from ``root``) as described in the module docstring;
    the nodes that updated a tensor in the model, in graph order (each with ``meta[UPDATES]``)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    updated: list[fx.Node] = []
    for node in list(graph.nodes):
        target = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if target is None:
            continue
        if node.op == "call_method":
            twin = _method_twin(node.target)
            if twin is None and node.target != "__setitem__":
                continue
            if twin:
                node.target = twin
            else:  # fill_, zero_, copy_, setitem: on a copy, as a function of the tensor
                node.op, node.target = "call_function", OnCopy(node.target)
        elif node.op == "call_function":
            if node.target is operator.setitem:
                node.target = OnCopy("__setitem__")
            elif node.target in _AUGMENTED:
                node.target = _AUGMENTED[node.target]
            elif _function_twin(node.target) is not None:
                node.target = _function_twin(node.target)
            else:
                rewritten = _without_inplace_flag(node.target, node.args, node.kwargs)
                if rewritten is None:
                    continue
                node.args, node.kwargs = rewritten
        elif node.op == "call_module":
            if not _writes_input(root.get_submodule(node.target)):
                continue
            node.meta[WRITES_INPUT] = True
        else:
            continue
        node.meta[UPDATES] = target
        # what the model read as the updated tensor after this node, the graph reads from this node
        target.replace_all_uses_with(node, delete_user_cb=lambda user: order[user] > order[node])
        updated.append(node)
    return updated


def detached(v: Any) -> Any:
    """``v`` without gradients: a tensor detached, a tuple (a structseq, a named tuple) or list of tensors each
    detached, anything else as it is (a size computed without gradients)."""
    if isinstance(v, torch.Tensor):
        return v.detach()
    if isinstance(v, (tuple, list)):
        items = [detached(e) for e in v]
        if hasattr(type(v), "n_fields"):  # torch.return_types: x.max(1)'s (values, indices)
            return type(v)(items)
        if hasattr(v, "_fields"):
            return type(v)(*items)
        return type(v)(items)
    return v


_COMPUTED = ("call_function", "call_method", "call_module")


def gradient_stops(graph: fx.Graph, updates: list[fx.Node], updates_state: Callable[[fx.Node], bool]) -> None:
    """Where a node made without gradients (``meta[GRAD_ENABLED]`` False: inside ``torch.no_grad()``) is read by
    one made with them, or is the output, make that reader read ``detached(node)`` (see the module docstring).
    ``updates``: the in-place nodes :func:`out_of_place` rewrote; one made without gradients that does not
    update a parameter or buffer (``updates_state``) is refused (:class:`NotPlannable`), naming its source."""
    for node in updates:
        if node.meta.get(GRAD_ENABLED, True) is False and not updates_state(node):
            raise NotPlannable(f"the forward updates a tensor in place under torch.no_grad() ({node_text(node)} at "
                               f"{node_source(node)}): autograd passes the updated tensor's gradient through that "
                               "update unchanged, which the scan's graph, computing it out of place, cannot")
    for node in list(graph.nodes):
        if node.op not in _COMPUTED or node.meta.get(GRAD_ENABLED, True) is not False:
            continue
        readers = [u for u in node.users if u.op == "output" or u.meta.get(GRAD_ENABLED, True) is not False]
        if not readers:
            continue
        with graph.inserting_after(node):
            stop = graph.call_function(detached, (node,))
        stop.meta[GRAD_ENABLED] = True
        if "nn_module_stack" in node.meta:
            stop.meta["nn_module_stack"] = node.meta["nn_module_stack"]
        stop.stack_trace = node.stack_trace
        for u in readers:
            u.replace_input_with(node, stop)


def subtractions_as_sums(graph: fx.Graph, is_sub: Callable[[fx.Node], bool]) -> None:
    """Rewrite ``a - b`` of two computed tensors as ``a + (-b)`` (the same numbers bit for bit: IEEE subtraction
    is the addition of the negation), so that a difference of two branches is an add join with a scale unit on
    its second branch instead of an opaque node. ``is_sub(node)``: whether a node is a subtraction. Operands
    read straight from a parameter or buffer, Python numbers and ``alpha=`` are left as written."""
    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method") or not is_sub(node) \
                or node.kwargs or len(node.args) != 2 \
                or not all(isinstance(a, fx.Node) and a.op != "get_attr" for a in node.args):
            continue
        a, b = node.args
        with graph.inserting_before(node):
            neg = graph.create_node("call_function", operator.neg, (b,), name=f"{node.name}_neg")
        neg.meta = dict(node.meta)
        node.op, node.target, node.args = "call_function", operator.add, (a, neg)


class _Interpreter(fx.Interpreter):
    """Runs the rewritten graph as the tracing runs its nodes: a module that writes into its input is given a
    copy (the graph's later readers read the node's output)."""

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_module" and n.meta.get(WRITES_INPUT):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            if args and isinstance(args[0], torch.Tensor):
                args = (args[0].clone(),) + tuple(args[1:])
            return self.module.get_submodule(n.target)(*args, **kwargs)
        return super().run_node(n)


def _same(a: Any, b: Any) -> bool:
    """Whether two forward results are the same computation's: equal, except that floating entries may differ
    by rounding (a rewritten node can hand the next layer the same numbers in another memory layout, and a
    GEMM rounds by layout), at most ``1000 eps`` of the tensor's largest entry; non-finite entries equal."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if torch.equal(a, b) or not a.is_floating_point():
            return bool(torch.equal(a, b))
        finite = b.isfinite()
        if not torch.equal(finite, a.isfinite()) or not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()):
            return False
        if not finite.any():
            return True
        scale = float(b[finite].abs().max())
        return float((a[finite] - b[finite]).abs().max()) <= 1e3 * torch.finfo(b.dtype).eps * scale
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and not isinstance(a, torch.Tensor)


def check_graph_is_the_forward(model: nn.Module, graph: fx.Graph, x: torch.Tensor, batch_dim: int = 0) -> None:
    """Raise :class:`NotPlannable` if ``graph`` (traced from ``model``, its forward's optional arguments fixed at
    their defaults, then rewritten) computes another output than ``model(x)``: both run with the same random
    numbers and the model's buffers restored after each (a train-mode BatchNorm's statistics), without
    gradients. An error of the model's own forward propagates. ``x`` is batch first, as the graph takes it; the
    model takes it with the batch on ``batch_dim`` (:func:`batch_second_input`)."""
    devices = [x.device] if x.device.type == "cuda" else []

    def run(call: Callable[[], Any]) -> Any:
        with torch.no_grad(), buffers_kept(model), torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            return call()

    own = run(lambda: model(x.transpose(0, 1) if batch_dim else x))
    try:
        traced = run(lambda: _Interpreter(model, graph=graph).run(x))
    except Exception as e:  # the graph fails where the model does not: a form fx recorded otherwise
        raise NotPlannable(f"the traced graph of {type(model).__name__} fails on the example where its own forward "
                           f"runs ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from e
    if not _same(own, traced):
        raise NotPlannable(f"the traced graph of {type(model).__name__} computes another output than its own "
                           "forward on the example: the forward does something torch.fx does not record, such as an "
                           "in-place update (`h += y`, `h.mul_(2)`) of a tensor that another name still refers to, "
                           "or that shares its memory")


def batch_second_input(graph: fx.Graph) -> None:
    """Rewrite ``graph`` (one input) to take its input with the batch first where the model reads it with the
    batch on dim 1: every read of the input reads ``input.transpose(0, 1)``, the model's own layout (the same
    memory as the caller's tensor, so what reads it in memory order, dropout's mask, reads it as in the
    model)."""
    (inp,) = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(inp):
        moved = graph.call_method("transpose", (inp, 0, 1))
    moved.meta[GRAD_ENABLED] = True
    inp.replace_all_uses_with(moved, delete_user_cb=lambda user: user is not moved)
