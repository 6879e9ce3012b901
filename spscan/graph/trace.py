"""Tracing a model with ``torch.fx`` into layer units and the segments of its block-level chain,
and the refusals that name the layer, the call and its source line.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Optional

import numpy as np
import torch
import torch.fx as fx
import torch.nn as nn

from spscan.errors import NotPlannable
from spscan.graph.rewrites import (UPDATES, WRITES_INPUT, batch_second_input, check_graph_is_the_forward, detached,
                                   gradient_stops, out_of_place, subtractions_as_sums)
from spscan.graph.recurrent import RECURRENT_TYPES, RecurrentCall, RecurrentNodeUnit, recurrent_calls
from spscan.graph.segments import Leaf
from spscan.graph.outputs import chain_end
from spscan.graph.structure import live_steps, series_parallel
from spscan.layers import LayerUnit, make_unit, unit_capabilities
from spscan.layers.elementwise import ParamAffineUnit
from spscan.layers.opaque import OpaqueUnit, counted_call
from spscan.layers.shape import ParamCatUnit, PerSampleReshapeUnit, SelectionUnit, _PerSampleReshape, _Selection
from spscan.layers.products import AttentionUnit, ProductUnit, _Attention
from spscan.layers.registry import (ATTENTION, JOIN_ADD as _ADD, JOIN_CAT as _CAT, NODE_UNITS, PRODUCT_MATMUL,
                                    PRODUCT_MUL, SCALAR_FORMS, scalar_unit)
from spscan.chain.model import has_hooks
from spscan.chain.wrapper import model_dtype
from spscan.chain.planning import example_rejected
from spscan.graph.nodes import first_line, node_key, node_text, refuse_node
from spscan.graph.tracer import (ExampleRejected, LeafTracer, ShapeTracer, Whole, drop_fixed_inputs,
                                 fixed_arguments, raise_if_forward_fails)
from spscan.runtime.checks import ModuleAttributes, buffers_kept

__all__ = ["Traced"]

# nodes that compute shapes for a view/reshape (never tensors of the graph)
_TENSOR_QUERIES = {("method", "size"), ("method", "dim"), ("method", "numel"), getattr}
# arithmetic on Python numbers that keeps a per-sample size per-sample
_NUMBER_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.pow,
                      operator.neg, operator.mod, math.sqrt}
# calls that only move, split or select entries (a chain of them is a selection: see Traced._selection)
_MOVES = {operator.getitem, torch.reshape, torch.flatten, torch.permute, torch.transpose, torch.swapaxes,
          torch.swapdims, torch.movedim, torch.moveaxis, torch.unbind, torch.chunk, torch.split, torch.squeeze,
          torch.unsqueeze, torch.select, torch.narrow, torch.unflatten, torch.flip, torch.roll} | {
    ("method", m) for m in ("reshape", "view", "flatten", "unflatten", "permute", "transpose", "swapaxes", "swapdims",
                            "movedim", "moveaxis", "contiguous", "squeeze", "unsqueeze", "unbind", "chunk", "split",
                            "select", "narrow", "flip", "roll")}




def _each_once(params: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """``params`` with each parameter once (its first name): an opaque node's backward asks autograd for one
    gradient per parameter, the sum over every read of it in the node's call."""
    seen: set[int] = set()
    out = []
    for name, p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out

def _recorded(call: Any, frozen: list[bool]) -> Any:
    """``call`` run as an opaque node's step runs it: gradients on, each floating input a leaf that requires
    one, except those of ``frozen`` (constants of the step); the leaves of its last run in ``run.leaves``."""

    def run(*xs: torch.Tensor) -> Any:
        with torch.enable_grad():
            xs = tuple(x.detach().requires_grad_(not f and (x.is_floating_point() or x.is_complex()))
                       for x, f in zip(xs, frozen))
            run.leaves = xs  # type: ignore[attr-defined]
            return call(*xs)

    return run


def _unreached(y: Any, leaves: tuple) -> list[bool]:
    """Per leaf: whether ``y`` does not depend on it differentiably (autograd gives it no gradient: read only
    through a comparison, an ``argmax``, a ``.detach()``)."""
    want = [i for i, t in enumerate(leaves) if t.requires_grad]
    out = [False] * len(leaves)
    if not want or not isinstance(y, torch.Tensor) or not y.requires_grad or not y.is_floating_point():
        return [True] * len(leaves) if isinstance(y, torch.Tensor) and not y.requires_grad else out
    got = torch.autograd.grad(y, [leaves[i] for i in want], torch.ones_like(y), allow_unused=True)
    for i, g in zip(want, got):
        out[i] = g is None
    return out


def _squeezes_dim0(node: fx.Node, env: dict) -> bool:
    """Whether a ``squeeze`` node may drop dim 0 of its tensor (every size-1 dim, or dim 0 among its dims)."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        return True
    x = env.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    nd = x.dim() if isinstance(x, torch.Tensor) else 0
    dims = dims if isinstance(dims, (tuple, list)) else (dims,)
    return any(isinstance(d, int) and nd and d % nd == 0 for d in dims) or any(not isinstance(d, int) for d in dims)


def _holds_traced(v: Any) -> bool:
    """Whether ``v`` is, or holds (a tuple, list or dict of), a traced value or a tensor."""
    if isinstance(v, (fx.Proxy, torch.Tensor)):
        return True
    if isinstance(v, (tuple, list)):
        return any(_holds_traced(t) for t in v)
    if isinstance(v, dict):
        return any(_holds_traced(t) for t in v.values())
    return False


class Traced:
    """The traced graph with per-node example values, units and the series-parallel parse."""

    def __init__(self, model: nn.Module, example_input: torch.Tensor, prune_zeros: bool, opts: dict,
                 batch_dim: int = 0) -> None:
        """``batch_dim``: the dim of the model's input that is the batch (1: a time-major sequence, see
        :func:`~spscan.graph.recurrent.input_batch_dim`); the graph takes the input batch first either way."""
        self.model, self.prune_zeros, self.opts, self.batch_dim = model, prune_zeros, opts, batch_dim
        self.dtype_read = False  # the forward's Python read a tensor's dtype as a value (ShapeTracer)
        # a ``squeeze`` of a graph tensor that may drop dim 0 (no dim given, or dim 0): at batch 1 the model's forward
        # drops the batch dim (``fc(h_n.squeeze())`` returns ``(C,)``), which the planner's batch of 2 does not show
        self.squeezes_batch = False
        if has_hooks(model):
            raise NotPlannable("the model has forward/backward hooks of its own, which its "
                               "traced graph would not run (hooks on its submodules are fine: each such module runs "
                               "as its own call)")
        #: the forward's optional parameters the graph is planned with (:func:`fixed_arguments`)
        self.fixed_arguments = fixed_arguments(model)
        #: submodules that update their own buffers in their forward (timm's BatchNormAct2d counts its batches):
        #: each runs as its own call, an opaque node, which updates them once per step as the model does
        self.stateful: set[str] = set()
        while True:
            self.graph = self._trace(model, example_input)
            if batch_dim:
                batch_second_input(self.graph)
            model = self.model
            # what the model updates in place, the graph computes out of place (graph_rewrites)
            self.updates = out_of_place(self.graph, model)
            stateful = {p for p in map(self._updates_state_of, self.updates) if p} - self.stateful
            if not stateful:
                break
            self.stateful |= stateful  # traced again, those modules as leaves
        # what the forward computes under its own torch.no_grad() is read through a gradient stop
        gradient_stops(self.graph, self.updates, self._updates_state)
        # a recurrent layer is one node run by its recurrent wrapper (graph_recurrent)
        self.recurrent_calls = recurrent_calls(self.graph, model)
        subtractions_as_sums(self.graph, lambda n: SCALAR_FORMS.get(node_key(n, model)) == "sub")
        self.units: list[LayerUnit] = []
        self.names: list[str] = []
        self.module_backed: list[bool] = []
        self.leaf_of: dict[fx.Node, Leaf] = {}
        self.kind: dict[fx.Node, str] = {}  # "input", "unit", "add", "cat"
        self.tin: dict[fx.Node, list[fx.Node]] = {}
        # tensors computed from graph tensors that do not keep the batch dim first (``qkv.permute(2, 0, 3, 1,
        # 4)``): not part of the chain, recomputed inside each opaque node reading them; -> their graph tensors
        self.virtual: dict[fx.Node, list[fx.Node]] = {}
        # graph tensors autograd records no gradient for in the model: made from graph tensors only by calls whose
        # results need none (``x.new_empty(shape)``, ``x.detach()``, ``x > 0``) and what is made from those alone
        # (timm's drop path: ``x.new_empty(shape).bernoulli_(p)``); an opaque node reading one does not ask
        # autograd for its gradient, which autograd would not compute (the derivative of ``bernoulli``)
        self.constants: set[fx.Node] = set()
        # per opaque node, the graph tensors it reads and passes no gradient to
        self.dead_edges: dict[fx.Node, set[fx.Node]] = {}
        x = example_input.detach()
        x = x.transpose(0, 1) if batch_dim else x  # batch first, as the graph takes it
        x2 = x[:2] if x.shape[0] >= 2 else torch.cat([x[:1], x[:1]])  # the batch of 2 the planner traces
        # the planner's run of the nodes on the example leaves the model's buffers as they were (a functional
        # train-mode batch_norm on them updates its running statistics)
        try:
            with buffers_kept(model):
                self._propagate(x2)
        except ExampleRejected as e:
            raise_if_forward_fails(model, example_input)  # the model's own error on the example is the user's
            raise NotPlannable(f"{e}; the model itself runs on the example, so its per-sample shapes depend on the "
                               "batch size (the planner traces a batch of 2)") from e
        # the rewritten graph must compute the model's own forward (fx does not record every in-place update)
        check_graph_is_the_forward(model, self.graph, x2, batch_dim)
        self._drop_dead()

    def _trace(self, model: nn.Module, example_input: torch.Tensor) -> fx.Graph:
        def trace(tracer: LeafTracer) -> fx.Graph:
            tracer.record_stack_traces = True
            before = ModuleAttributes(model)
            try:
                if self.fixed_arguments:
                    graph = tracer.trace(model, concrete_args=dict(self.fixed_arguments))
                    drop_fixed_inputs(graph)
                else:
                    graph = tracer.trace(model)
                stored = before.changed()
            finally:
                before.restore()  # no proxy left in the model
            if stored:
                # a value the forward keeps on the model (``self.h = h.detach()`` for the next batch, ``self.kl``
                # read by the loss, ``self.steps += 1``, ``self.feats.append(x)``): the scan's step runs the graph,
                # not the forward, and would never set it
                what = "a tensor it computes" if _holds_traced(stored[0][1]) else "a value"
                raise NotPlannable(f"its forward stores {what} on the model (self.{stored[0][0]}), which the scan's "
                                   "step would not set")
            return graph

        tracer = LeafTracer(self.stateful)
        try:
            return trace(tracer)
        except NotPlannable:
            raise
        except Exception as e:  # data-dependent control flow and the like, or a forward that fails anyway
            raise_if_forward_fails(model, example_input)
            if not tracer.is_leaf_module(model, ""):
                # Python that reads the tensors' sizes (``assert T <= block_size``): traced again, the per-sample
                # sizes the example's numbers (the plan is per per-sample shape)
                x = example_input.detach()
                d = self.batch_dim
                x2 = x.narrow(d, 0, 2) if x.shape[d] >= 2 else torch.cat([x.narrow(d, 0, 1)] * 2, d)
                shapes = ShapeTracer(self.stateful, (x2, torch.cat([x2, x2.narrow(d, 0, 1)], d)))
                try:
                    graph = trace(shapes)
                    self.dtype_read = shapes.dtype_read
                    return graph
                except Exception:
                    pass
                raise NotPlannable(f"torch.fx.symbolic_trace cannot capture its forward ({e}); "
                                   "spscan plans models whose graph fx can trace") from e
            # a torch.nn layer fx cannot see into (nn.TransformerEncoderLayer): the model is one opaque node, as
            # it would be inside a model of the user's
            self.model = Whole(model)
            return tracer.trace(self.model)

    def _updates_state(self, node: fx.Node) -> bool:
        """Whether ``node`` (in place, rewritten out of place) updates a parameter or buffer, or a view of one."""
        target = node.meta[UPDATES]
        while target.op != "get_attr":
            if UPDATES in target.meta:  # an update of an update's result (``self.ema.mul_(0.9).add_(y)``)
                target = target.meta[UPDATES]
            elif node_key(target, self.model) in _MOVES and target.args and isinstance(target.args[0], fx.Node):
                target = target.args[0]
            else:
                return False
        return True

    def _updates_state_of(self, node: fx.Node) -> Optional[str]:
        """The path of the innermost submodule whose forward ``node`` updates a parameter or buffer of (in place,
        rewritten out of place: ``self.num_batches_tracked.add_(1)``), else None (also for the model itself)."""
        if not self._updates_state(node):
            return None
        stack = node.meta.get("nn_module_stack")
        path = list(stack.values())[-1][0] if stack else ""
        return path or None

    def _propagate(self, x2: torch.Tensor) -> None:
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise NotPlannable(f"expected a forward with one tensor input (and optional arguments with defaults), got "
                               f"{len(placeholders)} inputs ({', '.join(n.target for n in placeholders)})")
        self.env = env  # filled as the nodes are propagated; opaque nodes' evaluators read it
        # the dtype the scan computes in (the parameters'); a graph tensor is of it (see _not_scanned)
        self.dtype = model_dtype(self.model) or (x2.dtype if x2.is_floating_point() else torch.get_default_dtype())
        with torch.no_grad():
            for node in self.graph.nodes:
                if node.op == "placeholder":
                    env[node] = x2
                    self.kind[node] = "input"
                    self.tin[node] = []
                    self.input_node = node
                    continue
                if node.op == "output":
                    self.output_node, self.output_tail = chain_end(self, node)
                    continue
                if node.op == "get_attr":  # a parameter or buffer read functionally: a constant of the graph
                    env[node] = self._attr(node.target)
                    continue
                if UPDATES in node.meta:
                    self._check_no_alias(node)
                key = node_key(node, self.model)
                args = fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
                tensor_inputs = list(dict.fromkeys(t for n in node.all_input_nodes
                                                   for t in ([n] if n in self.kind else self.virtual.get(n, []))))
                consts = [n for n in node.all_input_nodes if n not in self.kind and
                          (isinstance(env[n], torch.Tensor) or n in self.virtual)]
                if tensor_inputs and key in (("method", "squeeze"), torch.squeeze, ("method", "squeeze_")) \
                        and _squeezes_dim0(node, env):
                    self.squeezes_batch = True
                if not tensor_inputs or (node.op != "call_module" and key in _TENSOR_QUERIES):
                    # shape arithmetic for a view/reshape, or a tensor made from parameters and buffers alone
                    # (``self.cls.expand(B, -1, -1)``, ``self.wpe(torch.arange(t))``): a constant of the step,
                    # evaluated here, never part of the graph; an opaque node reading it recomputes it from the live
                    # parameters, and its parameter gradients come from that node's own backward
                    val = self._call(node, args, kwargs)
                    if not (key is getattr and tensor_inputs and isinstance(val, torch.Tensor)):
                        env[node] = val
                        continue
                    # ``x.mT``, ``x.T``: an attribute that is a tensor computed from a graph tensor
                builder = NODE_UNITS.get(key)
                if key in SCALAR_FORMS and len(tensor_inputs) == 1 and not consts \
                        and self._scalar(node, key, args, kwargs, tensor_inputs, env):
                    y = env[node]
                elif key in SCALAR_FORMS and len(tensor_inputs) == 1 and len(consts) == 1 \
                        and self._param_affine(node, key, args, kwargs, tensor_inputs, consts[0], env):
                    y = env[node]
                elif builder in (PRODUCT_MATMUL, PRODUCT_MUL):
                    y = self._product(node, key, builder, args, kwargs, tensor_inputs, env)
                elif builder == ATTENTION:
                    y = self._attention(node, key, args, kwargs, tensor_inputs, env)
                elif builder == _CAT and len(tensor_inputs) == 1 and consts \
                        and self._param_cat(node, args, kwargs, tensor_inputs, env):
                    y = env[node]
                elif builder is None or consts or (builder not in (_ADD, _CAT) and len(tensor_inputs) > 1):
                    y = self._opaque(node, key, args, kwargs, tensor_inputs, env,
                                     self._why_opaque(node, builder, consts, tensor_inputs))
                elif builder in (_ADD, _CAT):
                    y = self._join(node, key, builder, args, kwargs, tensor_inputs, env)
                else:
                    y = self._unit(node, key, builder, args, kwargs, tensor_inputs, env)
                if node in self.kind and self._not_scanned(y) and not isinstance(self.units[-1], OpaqueUnit):
                    # an analytic unit computing in another dtype than the scan's (``scores.float()`` in a float64
                    # model, LLaMA's softmax in float32), or integers (``ids[:, 1:]``): recomputed, as autograd
                    # computes it, by the node that casts back (``.type_as(x)``) or reads it
                    self._undo_last_unit(node)
                    y = self._opaque(node, key, args, kwargs, tensor_inputs, env, "another dtype than the scan's")
                if node in self.virtual:
                    env[node] = y
                    continue
                if not isinstance(y, torch.Tensor) or y.dim() < 1 or y.shape[0] != 2:
                    raise refuse_node(node, f"expected a tensor (B, ...) keeping the batch dim; got "
                                  f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__} for "
                                  "an example batch of 2")
                env[node] = y

    def _drop_dead(self) -> None:
        """Leave out the units the output does not depend on (``out, h = self.rnn(x)`` with only ``h`` used;
        a branch computed and never read): they contribute nothing to the output or to a gradient, and their
        parameters get none, as in autograd. They are not run either, so what they would change besides
        their output (a dead dropout's random numbers, a dead train-mode BatchNorm's running statistics) is
        not changed. The units left are numbered again in order."""
        nodes = [n for n in self.graph.nodes if n in self.kind]
        alive = {self.output_node}
        for n in reversed(nodes):
            if n in alive:
                alive.update(self.tin[n])
        if self.input_node not in alive:
            raise refuse_node(self.output_node, "the output does not depend on the input")
        dead = [n for n in nodes if n not in alive]
        if not dead:
            return
        for n in dead:
            del self.kind[n], self.tin[n]
            self.leaf_of.pop(n, None)
        kept = sorted(self.leaf_of.items(), key=lambda nl: nl[1].k)
        self.units = [leaf.unit for _, leaf in kept]
        self.names = [self.names[leaf.k] for _, leaf in kept]
        self.module_backed = [self.module_backed[leaf.k] for _, leaf in kept]
        for k, (n, leaf) in enumerate(kept):
            leaf.unit.index = leaf.k = k

    def _call(self, node, args, kwargs):
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            if node.meta.get(WRITES_INPUT) and args and isinstance(args[0], torch.Tensor):
                args = (args[0].clone(),) + tuple(args[1:])  # it writes into its input: a copy, never the graph's
            return self.model.get_submodule(node.target)(*args, **kwargs)
        return node.target(*args, **kwargs)

    def _check_no_alias(self, node: fx.Node) -> None:
        """Refuse an in-place update (rewritten out of place) of a tensor that shares its memory with another
        tensor the graph reads after it (``v = x[:, :2]; v.relu_()``, then ``x``): in the model the other one sees
        the update, out of place it would not."""
        target = node.meta[UPDATES]
        val = self.env.get(target)
        if not isinstance(val, torch.Tensor):
            return
        storage = val.untyped_storage().data_ptr()
        state = [t for t in (*self.model.parameters(), *self.model.buffers()) if t.numel()]
        if target.op == "get_attr" or any(t.untyped_storage().data_ptr() == storage for t in state):
            raise refuse_node(node, f"an in-place update of {target.name}, a parameter or buffer of the model (or a "
                                    "view of one): the forward changes the model's state")
        order = {n: i for i, n in enumerate(self.graph.nodes)}
        for other, v in self.env.items():
            if other is target or other is node or not isinstance(v, torch.Tensor) or v.numel() == 0 \
                    or v.untyped_storage().data_ptr() != storage:
                continue
            if any(order[u] > order[node] for u in other.users):
                raise refuse_node(node, f"an in-place update of {target.name}, which shares its memory with "
                                        f"{other.name} (a view), read after it: out of place, {other.name} would not "
                                        "see the update")

    def _join(self, node, key, builder, args, kwargs, tensor_inputs, env):
        if builder == _ADD:
            if len(node.args) != 2 or not all(isinstance(a, fx.Node) and isinstance(env.get(a), torch.Tensor)
                                              for a in node.args) \
                    or node.kwargs.get("alpha", 1) != 1 or len(node.kwargs) > (1 if "alpha" in node.kwargs else 0):
                return self._opaque(node, key, args, kwargs, tensor_inputs, env, "an add of a number, or with alpha")
            a, b = args[0], args[1]
            if a.shape != b.shape:
                return self._opaque(node, key, args, kwargs, tensor_inputs, env, "an add that broadcasts")
            self.tin[node] = [node.args[0], node.args[1]]
        else:
            seq = node.args[0] if node.args else node.kwargs.get("tensors")
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            if not isinstance(seq, (list, tuple)) or not all(isinstance(a, fx.Node) for a in seq):
                return self._opaque(node, key, args, kwargs, tensor_inputs, env, "a concatenation of this form")
            nd = env[seq[0]].dim()
            if dim % nd != 1:
                return self._opaque(node, key, args, kwargs, tensor_inputs, env,
                                    "a concatenation along another dim than dim 1")
            self.tin[node] = list(seq)
        self.kind[node] = builder
        return self._call(node, args, kwargs)

    def _attr(self, target: str) -> Any:
        obj: Any = self.model
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    def _between(self, node: fx.Node, inputs: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
        """The nodes ``node`` is computed from, back to its graph tensors ``inputs``, in an order that computes
        them (virtual tensors, constants, shape arithmetic); and the graph tensors read only for their shapes."""
        order: list[fx.Node] = []
        shapes: list[fx.Node] = []
        seen: set = set(inputs)

        def visit(n: fx.Node) -> None:
            for p in n.all_input_nodes:
                if p in seen:
                    continue
                seen.add(p)
                if p in self.kind:
                    shapes.append(p)
                    continue
                visit(p)
                order.append(p)

        visit(node)
        return order, shapes

    def _selection(self, node: fx.Node, inputs: list[fx.Node], call, x: torch.Tensor,
                   y: torch.Tensor) -> Optional[LayerUnit]:
        """A node that only moves entries of its one graph tensor, through any chain of reshapes, permutations
        (the batch dim moved and back: ``qkv.permute(2, 0, 3, 1, 4)[0]``) and basic indexing: a
        :class:`SelectionUnit` with the gather the chain amounts to, found by running the chain on the entries'
        own indices; a per-sample reshape where that gather keeps every entry in its place (a recurrent layer's
        ``out`` unpacked from its result: no copy forward, no scatter into zeros backward). ``None`` where any
        step computes values (only index-moving ops may touch a tensor)."""
        if len(inputs) != 1:
            return None
        order, _ = self._between(node, inputs)
        for n in order + [node]:
            val = self.env.get(n, y if n is node else None)
            holds = isinstance(val, torch.Tensor) or (isinstance(val, (tuple, list)) and
                                                     any(isinstance(v, torch.Tensor) for v in val))
            moves = node_key(n, self.model) in _MOVES or getattr(n.target, "moves_entries", False) is True \
                or (n.target is getattr and n.args[1:] in (("T",), ("mT",)))
            if n.op == "get_attr" or n.op == "call_module" or (holds and not moves):
                return None
        d_in = int(np.prod(x.shape[1:]))
        try:
            with torch.no_grad():
                probe = call(torch.arange(2 * d_in, dtype=torch.int64).reshape((2,) + tuple(x.shape[1:])))
        except Exception:
            return None
        if not isinstance(probe, torch.Tensor) or probe.dtype != torch.int64 or probe.shape != (2,) + y.shape[1:]:
            return None
        src = probe[0].reshape(-1)
        if not bool((probe[1].reshape(-1) - src == d_in).all()) or src.numel() == 0 \
                or int(src.min()) < 0 or int(src.max()) >= d_in or torch.unique(src).numel() != src.numel():
            return None
        if src.numel() == d_in and bool((src == torch.arange(d_in)).all()):
            # laid out as the chain lays it out (a batch-first recurrent output: a view of time-major memory)
            memory = None if probe.is_contiguous() else tuple(sorted(range(probe.dim()),
                                                                     key=lambda d: (-probe.stride(d), d)))
            return PerSampleReshapeUnit(len(self.units), _PerSampleReshape(tuple(y.shape[1:]), memory),
                                        tuple(x.shape[1:]), tuple(y.shape[1:]))
        return SelectionUnit(len(self.units), _Selection("index", src.numpy()), tuple(x.shape[1:]), tuple(y.shape[1:]))

    def _evaluator(self, node: fx.Node, inputs: list[fx.Node]):
        """``call(*ts)``: ``node`` computed from its graph tensors ``ts``, with the constants it reads
        recomputed every call (parameters read live, shape arithmetic at the current batch size: a graph
        tensor read only for its shape stands in as one element broadcast to its shape); the parameters it
        reads; and the modules it recomputes (named for its label)."""
        order, shapes = self._between(node, inputs)
        env, fn, attr = self.env, self._call, self._attr
        params = [(n.target, attr(n.target)) for n in order if n.op == "get_attr"]
        params = [(t, v) for t, v in params if isinstance(v, nn.Parameter)]
        mods = [n.target for n in order if n.op == "call_module"]  # a module recomputed here (a tuple output)
        params += [(f"{t}.{n}", p) for t in mods for n, p in self.model.get_submodule(t).named_parameters()]
        params += [(f"{n.target.path}.{k}", p) for n in order if isinstance(n.target, RecurrentCall)
                   for k, p in n.target.module.named_parameters()]
        params = _each_once(params)  # a module recomputed twice here (an LSTMCell fed its own state) reads them once
        inner = [f"self.{t} ({type(self.model.get_submodule(t)).__name__})" for t in mods]

        def call(*ts: torch.Tensor) -> Any:
            vals: dict[fx.Node, Any] = dict(zip(inputs, ts))
            b = ts[0].shape[0]
            for p in shapes:
                # its shape, dtype and device (``device=x.device``), no memory: one element broadcast
                vals[p] = torch.empty((), dtype=env[p].dtype, device=ts[0].device).expand((b,) + tuple(env[p].shape[1:]))
            for p in order + [node]:
                if p.op == "get_attr":
                    vals[p] = attr(p.target)
                else:
                    a = fx.node.map_arg(p.args, lambda n: vals[n])
                    kw = fx.node.map_arg(p.kwargs, lambda n: vals[n])
                    vals[p] = fn(p, a, kw)
            return vals[node]

        return call, params, inner

    def _why_opaque(self, node: fx.Node, builder: Any, consts: list, tensor_inputs: list) -> str:
        """Why a node without a unit's form runs its own backward (what ``explain()`` says of it)."""
        if builder is None:
            if node.target is detached or (node.op == "call_method" and node.target == "detach") \
                    or node.target is torch.detach:
                return ("a gradient stop (.detach(), or a value the forward computes under torch.no_grad()): its "
                        "J^T is zero")
            if node.op == "call_module":
                m = self.model.get_submodule(node.target)
                if node.target in self.stateful:
                    return "its forward updates its own parameters or buffers (state no analytic unit keeps): its own call"
                if isinstance(m, RECURRENT_TYPES):
                    return ("a recurrent layer whose results the model uses as a tuple (passed on whole), not taken "
                            "apart: its own call")
                return f"no analytic unit for the module type {type(m).__module__}.{type(m).__name__}"
            what = f"Tensor.{node.target}" if node.op == "call_method" else node_text(node).split("(")[0]
            return f"no analytic unit for {what}"
        virtual = [c for c in consts if c in self.virtual]
        if virtual:
            order, _ = self._between(node, tensor_inputs)
            mods = [self.model.get_submodule(n.target) for n in order if n.op == "call_module"]
            if mods:
                return ("no analytic unit for the module type " + ", ".join(
                    dict.fromkeys(f"{type(m).__module__}.{type(m).__name__}" for m in mods)) +
                        " (its result taken apart here)")
            return "it reads a tensor that does not keep the batch dim first, recomputed here"
        if consts:
            return ("it reads a parameter, a buffer or a constant made from them besides its graph tensor (their "
                    "gradients come from its own backward)")
        return "it reads several graph tensors in a form no unit covers"

    def _opaque(self, node, key, args, kwargs, tensor_inputs, env, why: str = "no analytic unit for this call"):
        """A node without an analytic unit (or one reading parameters, or several graph tensors): its own call
        and its own autograd backward (:class:`OpaqueUnit`); ``why``: what ``explain()`` says of it."""
        if not tensor_inputs:
            raise refuse_node(node, "a node of the graph that reads no tensor of the graph")
        xins = [env[n] for n in tensor_inputs]
        k = len(self.units)
        call, params, inner = self._evaluator(node, tensor_inputs)
        if node.op == "call_module":
            m = self.model.get_submodule(node.target)  # its hooks run with its call, as in the model
            params = [(f"{node.target}.{n}", p) for n, p in m.named_parameters()] + params
            name, backed, label = node.target, True, f"self.{node.target} ({type(m).__name__})"
        elif isinstance(node.target, RecurrentCall):
            m = node.target.module
            params = [(f"{node.target.path}.{n}", p) for n, p in m.named_parameters()] + params
            name, backed, label = node.target.path, True, f"self.{node.target.path} ({type(m).__name__})"
        else:
            m, name, backed, label = nn.Module(), node.name, False, node_text(node)
            if inner:
                label += f" of {', '.join(inner)}"
        frozen = [n in self.constants for n in tensor_inputs]
        # planning draws none of the model's random numbers, nor updates its running statistics
        with torch.random.fork_rng(devices=[]), buffers_kept(m):
            try:
                # what its operations cost, for the step profile; run as the step runs it (its inputs recorded)
                run = _recorded(call, frozen)
                y, own_cost = counted_call(run, xins)
                # the inputs it passes no gradient to (``torch.where(a > 0, b, c)`` reads ``a`` only so)
                self.dead_edges[node] = {t for t, dead in zip(tensor_inputs, _unreached(y, run.leaves)) if dead}
                # a result that needs no gradient from inputs that would (``x.new_empty(...)``): a constant
                constant = isinstance(y, torch.Tensor) and not y.requires_grad and not params and not (
                    node.op == "call_module" and any(True for _ in m.parameters()))
                y = y.detach() if isinstance(y, torch.Tensor) else y
                # which output dim is the batch, not told by the size alone: a batch of 3 (a batch of 1 would fail a
                # train-mode BatchNorm of one value per channel)
                three = call(*[torch.cat([t, t[:1]]) for t in xins])
            except Exception as e:
                raise refuse_node(node, example_rejected(k, tuple(xins[0].shape[1:]), e), ExampleRejected) from e
        keeps_batch = (isinstance(y, torch.Tensor) and isinstance(three, torch.Tensor) and y.dim() >= 1
                       and y.shape[0] == xins[0].shape[0] and three.shape == (3,) + y.shape[1:])
        # a complex tensor (LLaMA's rotary embedding: ``torch.view_as_complex(q) * freqs_cis``) is not a graph
        # tensor either (the scan's gradients are real), nor one of another dtype than the scan's (a float32
        # island in a float64 model), nor integers or booleans (``y.argmax(1)``, ``y > 0``, which carry no
        # gradient): recomputed inside the node that makes them real, casts them or reads them
        if not keeps_batch or self._not_scanned(y):
            self.virtual[node] = list(tensor_inputs)
            return y
        if node.op != "call_module" and not params:
            sel = self._selection(node, tensor_inputs, call, xins[0], y)
            if sel is not None:
                self._add_unit(node, sel, name, False, tensor_inputs)
                return y
        # one role per parameter: the node's backward gives each its whole gradient through every read of it
        params = _each_once(params)
        if isinstance(node.target, RecurrentCall):
            unit: OpaqueUnit = RecurrentNodeUnit(k, m, [tuple(t.shape[1:]) for t in xins], tuple(y.shape[1:]), call,
                                                 label, params, own_cost, call=node.target)
        else:
            unit = OpaqueUnit(k, m, [tuple(t.shape[1:]) for t in xins], tuple(y.shape[1:]), call, label, params,
                              own_cost, reason=why, constant_inputs=frozen)
        self._add_unit(node, unit, name, backed, tensor_inputs)
        if constant:
            self.constants.add(node)
        return y

    def _scalar(self, node, key, args, kwargs, tensor_inputs, env) -> bool:
        """``x * c``, ``x / c``, ``-x``, ``x + c``, ``c - x``, ... with ``c`` a Python number: a :class:`ScaleUnit`
        (``env[node]`` set); ``False`` for any other form."""
        src = tensor_inputs[0]
        x_first = bool(node.args) and node.args[0] is src
        if not x_first and not (len(node.args) == 2 and node.args[1] is src):
            return False
        xin = env[src]
        sargs = [env[a] if isinstance(a, fx.Node) and a is not src and self._per_sample_number(a) else a
                 for a in node.args]
        unit = scalar_unit(len(self.units), SCALAR_FORMS[key], sargs, node.kwargs, x_first,
                           tuple(xin.shape[1:]), tuple(xin.shape[1:]))
        if unit is None:
            return False
        y = self._call(node, args, kwargs)
        if not isinstance(y, torch.Tensor) or y.shape != xin.shape or y.dtype != xin.dtype:
            return False  # broadcasting into a larger shape, or a type promotion (an integer tensor / 2)
        env[node] = y
        self._add_unit(node, unit, node.name, False, [src])
        return True

    def _per_sample_number(self, node: fx.Node) -> bool:
        """Whether ``node`` is a Python number computed only from per-sample sizes and constants (``(c // h) **
        -0.5`` with ``c = x.shape[-1]``): the same for every batch, so a factor fixed when planning."""
        if not isinstance(self.env.get(node), (int, float)) or isinstance(self.env.get(node), bool):
            return False
        todo, seen = [node], set()
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            t = self.env.get(m.args[0]) if m.args and isinstance(m.args[0], fx.Node) else None
            if m.op == "call_method" and m.target == "size" and isinstance(t, torch.Tensor):
                d = m.args[1] if len(m.args) > 1 else m.kwargs.get("dim")
                if not isinstance(d, int) or d % t.dim() == 0:
                    return False  # the batch size, or the whole size
            elif m.op == "call_function" and m.target is operator.getitem and isinstance(t, torch.Size):
                src = m.args[0]
                if not isinstance(m.args[1], int) or m.args[1] % len(t) == 0 or src.op != "call_function" \
                        or src.target is not getattr or src.args[1] != "shape":
                    return False
            elif m.op == "call_function" and m.target in _NUMBER_ARITHMETIC:
                todo.extend(m.all_input_nodes)
            else:
                return False
        return True

    def _param_affine(self, node, key, args, kwargs, tensor_inputs, const: fx.Node, env) -> bool:
        """``x + p`` / ``x * p`` (either order) with ``p`` a parameter read by ``get_attr`` that broadcasts into
        ``x``'s shape: a :class:`ParamAffineUnit` (``env[node]`` set); ``False`` for any other form."""
        form = SCALAR_FORMS[key]
        src = tensor_inputs[0]
        p = env[const]
        if form not in ("add", "mul") or node.kwargs or const.op != "get_attr" or not isinstance(p, nn.Parameter) \
                or len(node.args) != 2 or set(node.args) != {src, const}:
            return False
        xin = env[src]
        y = self._call(node, args, kwargs)
        if not isinstance(y, torch.Tensor) or y.shape != xin.shape or y.dtype != xin.dtype:
            return False
        try:
            unit = ParamAffineUnit(len(self.units), form, const.target, p, tuple(xin.shape[1:]), tuple(y.shape[1:]))
        except ValueError:
            return False
        env[node] = y
        self._add_unit(node, unit, node.name, False, [src])
        return True

    def _param_cat(self, node, args, kwargs, tensor_inputs, env) -> bool:
        """``torch.cat([p.expand(B, ...), x], dim)`` with parameters ``p`` read by ``get_attr`` and one graph tensor
        ``x``, along a per-sample dim: a :class:`ParamCatUnit` (``env[node]`` set); ``False`` for any other form."""
        seq = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if not isinstance(seq, (list, tuple)) or not isinstance(dim, int) or set(node.kwargs) - {"tensors", "dim"} \
                or len(node.args) > 2:
            return False
        src = tensor_inputs[0]
        pieces: list = []
        for n in seq:
            if n is src:
                pieces.append(None)
                continue
            base = n.args[0] if isinstance(n, fx.Node) and n.op == "call_method" and n.target == "expand" else None
            p = env.get(base) if isinstance(base, fx.Node) and base.op == "get_attr" else None
            if not isinstance(p, nn.Parameter) or p.dim() == 0 or p.shape[0] != 1 \
                    or tuple(env[n].shape) != (env[src].shape[0],) + tuple(p.shape[1:]):
                return False
            pieces.append((base.target, p))
        xin = env[src]
        y = self._call(node, args, kwargs)
        try:
            unit = ParamCatUnit(len(self.units), dim, pieces, tuple(xin.shape[1:]), tuple(y.shape[1:]))
        except ValueError:
            return False
        env[node] = y
        self._add_unit(node, unit, node.name, False, [src])
        return True

    def _product(self, node, key, kind, args, kwargs, tensor_inputs, env):
        """``a @ b`` / ``a * b`` of two distinct graph tensors: a :class:`ProductUnit` (any other form, such as
        ``2 * x``, ``x * x`` or a broadcast, is an opaque node)."""
        if kwargs or len(node.args) != 2 or list(node.args) != tensor_inputs or len(tensor_inputs) != 2:
            return self._opaque(node, key, args, kwargs, tensor_inputs, env,
                                "a product of one tensor with itself, or with a number")
        a, b = (env[n] for n in tensor_inputs)
        y = self._call(node, args, kwargs)
        try:
            unit = ProductUnit(len(self.units), kind, [tuple(a.shape[1:]), tuple(b.shape[1:])], tuple(y.shape[1:]))
        except ValueError as e:
            return self._opaque(node, key, args, kwargs, tensor_inputs, env, f"a product of this form ({e})")
        self._add_unit(node, unit, node.name, False, tensor_inputs)
        return y

    def _attention(self, node, key, args, kwargs, tensor_inputs, env):
        """``F.scaled_dot_product_attention(q, k, v)`` of graph tensors, no dropout, no grouped heads, a mask the
        batch does not change (see :meth:`_constant_mask`):
        an :class:`AttentionUnit` (other forms: an opaque node)."""
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        given = dict(zip(names, node.args))
        given.update(node.kwargs)
        extra = set(given) - set(names) - {"scale", "enable_gqa"}
        qkv = [given.get(n) for n in names[:3]]
        mask = given.get("attn_mask")
        if mask is not None:
            mask = self._constant_mask(mask, env[qkv[0]] if isinstance(qkv[0], fx.Node) else None)
            if mask is None:
                return self._opaque(node, key, args, kwargs, tensor_inputs, env,
                                    "attention with a mask computed from the input or learned")
        plain = (not extra and given.get("dropout_p", 0.0) == 0.0
                 and not given.get("enable_gqa", False) and isinstance(given.get("is_causal", False), bool)
                 and (given.get("scale") is None or isinstance(given.get("scale"), (int, float)))
                 and all(isinstance(n, fx.Node) and n in tensor_inputs for n in qkv))
        if not plain:
            return self._opaque(node, key, args, kwargs, tensor_inputs, env,
                                "attention with dropout, grouped heads or a query, key or value that is not a tensor "
                                "of the graph")
        y = self._call(node, args, kwargs)
        module = _Attention(given.get("is_causal", False), given.get("scale"), mask)
        try:
            unit = AttentionUnit(len(self.units), module, [tuple(env[n].shape[1:]) for n in tensor_inputs],
                                 [tensor_inputs.index(n) for n in qkv], tuple(y.shape[1:]))
        except ValueError as e:
            return self._opaque(node, key, args, kwargs, tensor_inputs, env, f"attention of this form ({e})")
        self._add_unit(node, unit, node.name, False, tensor_inputs)
        return y

    def _constant_mask(self, node: Any, q: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """An attention mask the batch does not change: a parameter or buffer read as it is (held by reference),
        or a tensor computed from per-sample sizes and constants alone (its value when planning); ``None`` for a
        mask computed from graph tensors, from a parameter or buffer, or with a batch dim."""
        val = self.env.get(node) if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not (val.dtype == torch.bool or val.is_floating_point()) \
                or q is None or val.dim() > q.dim() or (val.dim() == q.dim() and val.shape[0] != 1):
            return None
        if node.op == "get_attr":
            return None if val.requires_grad else val  # a learned bias needs its own gradient: opaque
        todo, seen = list(node.all_input_nodes), set()
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if m in self.kind or m in self.virtual or m.op == "get_attr":
                return None
            v = self.env.get(m)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if not self._per_sample_number(m):
                    return None
            elif isinstance(v, torch.Size) or (m.op == "call_method" and m.target == "size"):
                return None  # a whole shape, the batch size with it
            else:
                todo.extend(m.all_input_nodes)
        return val.clone()

    def _not_scanned(self, y: Any) -> bool:
        """Whether ``y`` is a tensor the scan does not carry: not floating (integers, booleans, complex) or of
        another dtype than the scan's (:attr:`dtype`)."""
        return isinstance(y, torch.Tensor) and (not y.is_floating_point() or y.dtype != self.dtype)

    def _undo_last_unit(self, node: fx.Node) -> None:
        """Take back the unit just made for ``node`` (the last one)."""
        self.units.pop()
        self.names.pop()
        self.module_backed.pop()
        del self.kind[node], self.tin[node]
        self.leaf_of.pop(node, None)
        self.constants.discard(node)

    def _add_unit(self, node: fx.Node, unit: LayerUnit, name: str, backed: bool, inputs: list[fx.Node]) -> None:
        self.leaf_of[node] = Leaf(unit, len(self.units))
        self.units.append(unit)
        self.names.append(name)
        self.module_backed.append(backed)
        self.kind[node] = "unit"
        self.tin[node] = list(inputs)
        if not isinstance(unit, OpaqueUnit) and not unit.roles and all(n in self.constants for n in inputs):
            self.constants.add(node)  # an analytic map of constants alone (``mask / keep``)

    def _unit(self, node, key, builder, args, kwargs, tensor_inputs, env):
        if len(tensor_inputs) != 1 or not (node.args and node.args[0] is tensor_inputs[0]):
            return self._opaque(node, key, args, kwargs, tensor_inputs, env,  # ``x * x``, ``2 * x``
                                "its graph tensor is not its first argument, or it reads several")
        src = tensor_inputs[0]
        xin = env[src]
        k = len(self.units)
        if node.op == "call_module":
            m = self.model.get_submodule(node.target)
            if has_hooks(m):  # what its hooks do is not in its unit's J^T: its own call and backward
                return self._opaque(node, key, args, kwargs, tensor_inputs, env,
                                    "the module has hooks, which its analytic unit would not run")
            if len(node.args) != 1 or node.kwargs:
                raise refuse_node(node, "a module called with extra arguments is not supported")
            if unit_capabilities(m).shape_preserving:
                # no call: dropout would draw random numbers, train-mode BN would update its statistics (a copy:
                # the model's own call returns another tensor, in train mode at least)
                y = xin.clone()
            else:
                try:
                    y = self._call(node, (xin,), {})
                except Exception as e:
                    raise refuse_node(node, example_rejected(k, tuple(xin.shape[1:]), e), ExampleRejected) from e
                if not isinstance(y, torch.Tensor):  # ``MaxPool2d(return_indices=True)``'s (values, indices)
                    return self._opaque(node, key, args, kwargs, tensor_inputs, env, "its result is not one tensor")
            try:
                unit = make_unit(k, m, tuple(xin.shape[1:]), tuple(y.shape[1:]), prune_zeros=self.prune_zeros)
            except (TypeError, ValueError) as e:  # a configuration its unit does not cover: its own call and backward
                return self._opaque(node, key, args, kwargs, tensor_inputs, env,
                                    f"its unit does not cover this configuration ({first_line(e)})")
            name, backed = node.target, True
        else:
            y = self._call(node, args, kwargs)
            if not isinstance(y, torch.Tensor) or y.dim() < 1 or y.shape[0] != xin.shape[0]:
                # not a per-sample map (``x.transpose(0, 1)``): what opaque nodes do with such a tensor
                return self._opaque(node, key, args, kwargs, tensor_inputs, env, "not a map of each sample alone")
            try:
                unit = builder(k, args, kwargs, tuple(xin.shape[1:]), tuple(y.shape[1:]), self.prune_zeros)
            except (TypeError, ValueError) as e:  # a form the analytic unit does not cover: the node's own backward
                return self._opaque(node, key, args, kwargs, tensor_inputs, env,
                                    f"its unit does not cover this form ({first_line(e)})")
            name, backed = node.name, False
        self._add_unit(node, unit, name, backed, [src])
        return y

    def live_steps(self) -> list[Any]:
        """The graph as a chain over its live set (:func:`spscan.graph.structure.live_steps`)."""
        return live_steps(self)

    def parse(self) -> list[Any]:
        """The graph as a chain of series-parallel blocks (:func:`spscan.graph.structure.series_parallel`)."""
        return series_parallel(self)
