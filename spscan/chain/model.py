"""Model-level API for ``nn.Sequential`` chains: plan once from the model, then per step run the
forward that fills the transposed-Jacobian values, scan, and compute parameter gradients.

>>> import torch, torch.nn as nn
>>> from spscan.chain.model import plan_model
>>> net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3)).double()
>>> plan = plan_model(net, torch.zeros(1, 1, 2, 2, dtype=torch.float64), levels=0)
>>> [p.shape for p in plan.patterns]
[(4, 8), (8, 8), (8, 8), (8, 3)]

``plan_model(model, example_input, **kw)`` builds a :class:`ModelPlan`; ``plan.forward(x)``
returns ``(output, jacobians)``; ``plan._spscan_backward(jacobians, grad)`` (what
``spscan.backward`` calls) returns ``[dl/dx_0, ..., dl/dx_n]``; :func:`param_grads` turns those
into ``dl/dθ``; :func:`wrap` packages all of it as an ``nn.Module`` trained with ``loss.backward()``.

Pruned weights (``torch.nn.utils.prune`` masks, or exactly-zero weights with
``prune_zeros=True``) are left out of the patterns and must stay zero while the plan is used.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import torch
import torch.nn as nn

from spscan.runtime.autograd import apply as autograd_apply, keep_graph, refuse_functorch
from spscan.chain.backward import (RELEASED, ForwardState, Jacobians, StepBackward,  # noqa: F401
                                   collect_param_grads, unit_param_grads)
from spscan.errors import NotPlannable
from spscan.runtime.graphed import GraphedCall, GraphedStep
from spscan.runtime import check_inputs
from spscan.options import option_default
from spscan.runtime.choices import BackwardChoice, batch_of, layers_decision
from spscan.planner.choose import Candidate, Decision, choose, explain as explain_decisions
from spscan.layers import LayerUnit, make_unit, supported_layer_types, unit_capabilities
from spscan.layers.opaque import OpaqueUnit
from spscan.runtime.plan import build_plan

__all__ = ["ModelPlan", "Jacobians", "plan_model", "plan_chain", "param_grads", "wrap_chain", "SpscanModule"]


# ----------------------------------------------------------------------------- chain discovery


def _is_plain_sequential(m: nn.Module) -> bool:
    return isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward


class UnitRefused(NotPlannable):
    """A layer of a chain whose analytic unit does not cover its configuration (``padding_mode="circular"``,
    ``sparse=True``, ...): ``spscan.plan`` and ``spscan.wrap`` trace the chain instead, that layer an opaque
    node (its own call and autograd backward)."""


def has_hooks(m: nn.Module) -> bool:
    """Whether ``m`` has forward or backward hooks of its own other than ``torch.nn.utils.prune`` masks (they
    could change what it computes, and an analytic ``J^T`` would not follow): a traced model runs such a
    module as an opaque node, its own call (hooks included) and its own autograd backward."""
    from torch.nn.utils.prune import BasePruningMethod

    pre = [h for h in m._forward_pre_hooks.values() if not isinstance(h, BasePruningMethod)]
    return bool(pre or m._forward_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None))


def check_hooks(index: int, name: str, m: nn.Module) -> None:
    """Refuse layer ``index`` (``name``) of a chain planned directly if it has hooks (:func:`has_hooks`);
    ``spscan.plan`` and ``spscan.wrap`` trace such a chain instead, the hooked layer an opaque node."""
    if has_hooks(m):
        raise ValueError(
            f"layer {index} ({name or type(m).__name__}: {type(m).__name__}): forward/backward hooks other "
            "than torch.nn.utils.prune masks are not supported (they could change what the layer computes)")


def is_chain_model(model: nn.Module) -> bool:
    """A supported layer, or a plain ``nn.Sequential`` (nested plain ones allowed) of supported
    layers without hooks: planned as a chain directly. Anything else (a module with its own forward, a layer
    without a unit or with hooks, anywhere in it) is traced with torch.fx (:mod:`spscan.graph.plan`), where a
    sequential container is the trivial graph and a layer without a unit (or with hooks) an opaque node."""
    supported = supported_layer_types()
    if has_hooks(model):
        return False
    if type(model) in supported:
        return True
    if not _is_plain_sequential(model):
        return False
    for child in model._modules.values():
        if child is None:
            continue
        if isinstance(child, nn.Sequential):
            if not is_chain_model(child):
                return False
        elif type(child) not in supported or has_hooks(child):
            return False
    return True


def _plain_containers(model: nn.Module) -> bool:
    """A supported layer, or plain ``nn.Sequential`` containers all the way down (any leaves): what
    :func:`plan_model` takes, naming a leaf without a unit."""
    if type(model) in supported_layer_types():
        return True
    return _is_plain_sequential(model) and all(_plain_containers(c) for c in model._modules.values()
                                               if isinstance(c, nn.Sequential))


def _flatten_chain(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every layer of a (nested) ``nn.Sequential`` chain."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    supported = supported_layer_types()
    if not _is_plain_sequential(model):
        if type(model) in supported:
            return [("", model)]
        raise NotPlannable(
            f"{type(model).__name__} is not a chain spscan can plan: expected an nn.Sequential (without an "
            "overridden forward) of supported layers, or a single supported layer; a custom forward may "
            "branch, reuse or transform activations in ways the plan cannot see")
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, seq: nn.Module) -> None:
        # _modules, not named_children(): the latter skips a module repeated in the chain
        for name, child in seq._modules.items():
            if child is None:
                continue
            q = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Sequential):
                if not _is_plain_sequential(child):
                    raise NotPlannable(f"layer {len(out)} ({q}): {type(child).__name__} overrides forward; "
                                    "only plain nn.Sequential containers can be flattened into a chain")
                walk(q, child)
            else:
                out.append((q, child))

    walk("", model)
    return out


# ----------------------------------------------------------------------------- the plan


class ModelPlan:
    """A plan for an ``nn.Sequential`` chain: the layer units, their patterns and the core scan plan.

    Attributes:
        model: the planned model (its parameters are read at every step, never copied).
        units: one :class:`~spscan.layers.LayerUnit` per layer, in chain order.
        layer_names: qualified module name of each layer.
        factored: per layer, whether its ``J^T`` enters the scan as two low-rank factors
            (:class:`~spscan.layers.LowRankFactors`, chosen by :func:`plan_chain`) instead of one matrix.
        patterns: the core chain's element patterns, SciPy CSR: ``J_k^T`` ``(d_{k-1}, d_k)`` for each
            layer, or its factors ``L`` then ``R`` for a factored one.
        core: the core scan plan (:class:`spscan.Plan`) built from ``patterns``.
        in_shape, out_shape: per-sample input and output shapes.
    """

    def __init__(self, model: nn.Module, units: list[LayerUnit], layer_names: list[str],
                 in_shape: tuple[int, ...], core: Any, operators: bool = True,
                 factored: Optional[Sequence[bool]] = None):
        self.use_operators = bool(operators)
        self.model = model
        self.units = units
        self.layer_names = layer_names
        self.in_shape = in_shape
        self.out_shape = units[-1].out_shape
        self.core = core
        self.decisions: list[Decision] = []  # the front end's choices besides the core's depth (norm form, ...)
        # a traced forward is specialized to the mode it was traced in (``self.training`` read in Python, as
        # ``F.dropout(x, training=self.training)`` does): the model's ``training`` then, else None (a chain of
        # layers, whose units follow their modules' modes at run time)
        self.planned_training: Optional[bool] = None
        # a traced forward's optional parameters, ``{name: value}``, at the values the graph was traced with
        # (``forward(x, mask=None)``: the graph of a call without a mask); a call that passes other values
        # runs the model's own forward (:meth:`SpscanModule.forward`)
        self.fixed_arguments: dict[str, Any] = {}
        # a traced forward whose result is not the chain's output itself (a tuple, ``logits.view(-1, V)``, an RNN's
        # ``h_n``): how the wrapper makes that result from the output, under autograd (None: the output is it)
        self.output_tail: Optional[Callable[[torch.Tensor], Any]] = None
        self.factored = [False] * len(units) if factored is None else [bool(f) for f in factored]
        if len(self.factored) != len(units):
            raise ValueError(f"factored: expected {len(units)} flags (one per layer), got {len(self.factored)}")
        self._patterns = [p for u, f in zip(units, self.factored) for p in (u.factor_patterns() if f else (u.pattern,))]
        # the core element after each layer's output (the gradient dl/dx_k is the core's dl/dx at that element)
        self._ends: Optional[list[int]] = None
        if any(self.factored):
            ends, e = [], 0
            for f in self.factored:
                e += 2 if f else 1
                ends.append(e)
            self._ends = ends
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=True)}
        # (unit k, role r) -> (qualified parameter name, parameter, pruning mask or None)
        self.param_roles: list[list[tuple[str, nn.Parameter, Optional[torch.Tensor]]]] = [
            [(names[id(p)], p, mask) for p, mask in u.parameters_for_roles()] for u in units]
        # per-step bookkeeping decided once (see _flat_tensors, _check_layers, _step_backward)
        self._layer_paths = [tuple(n.split(".")) if n else () for n in layer_names]
        self._role_layer = [k for k, u in enumerate(units) for _ in u.roles]  # flat tensor -> its layer
        self._role_names = [(u, u.roles, tuple(r + "_orig" for r in u.roles)) for u in units if u.roles]
        # units whose sharedness and operator flag follow the module's mode (dropout, batch-norm)
        self._dynamic_units = [u for u in units if u.capabilities.mode_dependent]
        # the effective tensors' slice of the autograd function's inputs, per layer
        ends = [0]
        for u in units:
            ends.append(ends[-1] + len(u.roles))
        self._role_slices = [slice(a, b) for a, b in zip(ends, ends[1:])]
        self._steps: dict[tuple, StepBackward] = {}
        # the wrapper's backward replayed from CUDA graphs (on a GPU, where the wrapper chose "graph")
        self.graph_backward = False
        self._graphed = GraphedCall()
        # the whole step (forward and backward) replayed from CUDA graphs, where the wrapper chose "graph"
        self.step_graphs = GraphedStep(self)

    element_name = "layer"  # what one element of the core chain is (a traced graph's are blocks)

    @property
    def patterns(self) -> list:
        """The core chain's element patterns (see the class docstring)."""
        return self._patterns

    # -- contract attributes
    @property
    def levels(self) -> int:
        """Up-sweep depth of the core plan (0 = linear scan)."""
        return self.core.levels

    def __len__(self) -> int:
        return len(self.units)

    def summary(self) -> str:
        """One line per layer (type, shapes, nnz, sparsity, shared/per-sample) and the core's summary."""
        lines = [f"ModelPlan: {len(self.units)} layers, input {self.in_shape} -> output {self.out_shape}"]
        for k, (u, n) in enumerate(zip(self.units, self.layer_names)):
            if self.factored[k]:
                left, right = u.factor_patterns()
                what = (f"J^T = L R, L {left.shape[0]}x{left.shape[1]} nnz={left.nnz}, "
                        f"R {right.shape[0]}x{right.shape[1]} nnz={right.nnz} (dense blocks: nnz={u.nnz})")
            else:
                what = f"J^T {u.d_in}x{u.d_out} nnz={u.nnz} sparsity={u.sparsity():.6f}"
            lines.append(
                f"  [{k}] {n or '-':<12} {u.name:<12} {str(u.in_shape):>16} -> {str(u.out_shape):<16} "
                f"{what} {'shared' if u.shared else 'per-sample'}")
        lines.append(self.core.summary())
        return "\n".join(lines)

    __str__ = summary

    # -- per step
    def all_decisions(self) -> list[Decision]:
        """The planner's choices for this model: the core scan's depth, then the front end's."""
        return [self.core.decision] + list(self.decisions)

    def explain(self) -> str:
        """What the planner chose for this model and what it compared each choice with."""
        return explain_decisions(self.all_decisions(), f"{type(self).__name__} of {type(self.model).__name__}:")

    def _check_input(self, x: torch.Tensor, flat: Optional[Sequence[torch.Tensor]] = None) -> None:
        """Refuse an input of the wrong per-sample shape, or of another dtype/device than the parameters.
        ``flat``: the step's effective tensors (:meth:`_flat_tensors`), read instead of the modules."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a tensor input of shape (B, *{self.in_shape}), got {type(x).__name__}")
        if x.dim() != len(self.in_shape) + 1 or tuple(x.shape[1:]) != self.in_shape:
            raise ValueError(f"input: expected shape (B, {', '.join(map(str, self.in_shape))}) as in the "
                             f"example input, got {tuple(x.shape)}")
        if flat is not None:
            if not flat:
                return
            t, k = flat[0], self._role_layer[0]
            if t.dtype == x.dtype and t.device == x.device:
                return
            self._input_mismatch(x, k, t)
        for k, u in enumerate(self.units):
            t = next(u.module.parameters(), None)
            if t is None:
                continue
            self._input_mismatch(x, k, t)
            return

    def _input_mismatch(self, x: torch.Tensor, k: int, t: torch.Tensor) -> None:
        u = self.units[k]
        if t.dtype != x.dtype and not (u.integer_input and not x.is_floating_point()):
            raise TypeError(f"input: dtype {x.dtype}, but layer {k} ({self.layer_names[k] or '-'}: "
                            f"{type(u.module).__name__}) has {t.dtype} parameters; convert the input "
                            f"(x.to({t.dtype})) or the model")
        if t.device != x.device:
            raise ValueError(f"input: on {x.device}, but layer {k} ({self.layer_names[k] or '-'}: "
                             f"{type(u.module).__name__}) has parameters on {t.device}")

    def _check_layers(self) -> None:
        """Refuse a model whose planned layers were replaced after planning (the old ones would run), or one
        given hooks after planning where its analytic unit would not run them."""
        model = self.model
        for path, u in zip(self._layer_paths, self.units):  # walk each layer's path: no module listing
            m = model
            for key in path:
                m = m._modules.get(key)
                if m is None:
                    break
            if m is not u.module:
                break
            if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks) and not isinstance(u, OpaqueUnit) \
                    and has_hooks(m):
                raise ValueError(f"layer {u.index} ({u.name}): hooks were registered on it after the model was "
                                 "planned; wrap the model again (a module with hooks runs as its own call)")
        else:
            return
        modules = dict(self.model.named_modules(remove_duplicate=False))
        for k, (name, u) in enumerate(zip(self.layer_names, self.units)):
            now = modules.get(name) if name else self.model
            if now is not u.module:
                raise ValueError(f"layer {k} ({name or '-'}): the model's module was replaced after planning "
                                 f"(planned {type(u.module).__name__}, now "
                                 f"{type(now).__name__ if now is not None else 'missing'}); wrap the model again")

    def _run(self, x: torch.Tensor, tensors: list[list[torch.Tensor]]) -> tuple[torch.Tensor, list[Any]]:
        saved = []
        for u, t in zip(self.units, tensors):
            x, s = u.run(x, t)
            saved.append(s)
        return x, saved

    def _tensors(self) -> list[list[torch.Tensor]]:
        return [u.tensors() for u in self.units]

    def step_tensors(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The units' effective tensors for a wrapped step of ``x``, once the input and the layers are checked
        against the plan. Built in the step (with grad enabled) so pruning masks stay in the autograd graph."""
        flat = self._flat_tensors()
        self._check_input(x, flat)
        self._check_layers()
        return flat

    def _flat_tensors(self) -> list[torch.Tensor]:
        """Every unit's effective tensors (:meth:`LayerUnit.tensors`), flat, in unit and role order.

        A role held as a plain parameter is read from the module's parameter dict (the common case:
        no attribute lookups that miss); anything else (a pruned weight, ``orig * mask``, built here
        with grad enabled so the mask stays in the autograd graph) goes through the unit.
        """
        flat: list[torch.Tensor] = []
        for u, roles, origs in self._role_names:
            params = u.module._parameters
            got = [params.get(r) for r in roles]
            if any(t is None for t in got) or any(o in params for o in origs):  # (not `None in got`: tensor ==)
                got = u.tensors()
            flat += got
        return flat

    def _fill(self, saved: list[Any], tensors: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        if self._ends is None:
            return [u.fill(s, t) for u, s, t in zip(self.units, saved, tensors)]
        out: list[torch.Tensor] = []
        for u, f, s, t in zip(self.units, self.factored, saved, tensors):
            if f:
                out += u.factor_fill(s, t)
            else:
                out.append(u.fill(s, t))
        return out

    def _layer_grads(self, grads: list) -> list:
        """The core's ``dl/dx`` per element boundary -> ``[dl/dx_0, ..., dl/dx_n]`` per layer boundary
        (a factored layer's inner gradient is left out)."""
        return grads if self._ends is None else [grads[0]] + [grads[e] for e in self._ends]

    @property
    def element_shared(self) -> list[bool]:
        """Per core element: whether its values are shared by the batch."""
        if self._ends is None:
            return [u.shared for u in self.units]
        return [sh for u, f in zip(self.units, self.factored) for sh in (u.factor_shared() if f else (u.shared,))]

    @property
    def element_operator_flags(self) -> list[bool]:
        """Per core element: whether the wrapper passes a structured operator (a factor never is one)."""
        flags = self.operator_flags
        if self._ends is None:
            return flags
        return [fl for f, op in zip(self.factored, flags) for fl in ((False, False) if f else (op,))]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Jacobians]:
        """Run the model on ``x`` ``(B, *in_shape)`` once; return ``(output (B, *out_shape), jacobians)``.

        The output carries no autograd graph; ``jacobians`` holds the values of every ``J_i^T`` and
        the activations the parameter gradients need.
        """
        self._check_input(x)
        with torch.no_grad():
            tensors = [[t.detach() for t in ts] for ts in self._tensors()]
            y, saved = self._run(x.detach(), tensors)
            values = self._fill(saved, tensors)
        return y, Jacobians(values, x.shape[0], saved, tensors)

    def backward(self, values: Union[Jacobians, Sequence[torch.Tensor]], grad: torch.Tensor,
                 extra: Optional[Sequence[Optional[torch.Tensor]]] = None, *,
                 first_output: bool = True, stop: int = 0) -> list[torch.Tensor]:
        """``[dl/dx_0, ..., dl/dx_n]`` (each ``(B, d_i)``) from the step's values and ``grad`` ``(B, d_n)``
        (or ``(B, *out_shape)``): the contract of :func:`spscan.backward`. ``values`` may hold a
        layer's :class:`~spscan.kernels.backend.StructuredOperator` instead of its CSR values;
        ``first_output=False`` leaves ``dl/dx_0`` out (``None``). A factored layer
        (:attr:`factored`) takes two value tensors, its factors ``L`` then ``R``, as ``forward``
        returns them; its inner gradient is not returned. ``extra``: ``n + 1`` entries, one per
        layer boundary, as for :func:`spscan.backward`. ``stop``: no gradient below element ``stop``
        is wanted (a linear scan of operators then skips those elements; see ``BoundPlan.run``)."""
        vals = list(values.values if isinstance(values, Jacobians) else values)
        if len(vals) != self.core.n:
            what = self.element_name if self._ends is None else "layer, two for a factored layer"
            raise ValueError(f"values: expected {self.core.n} tensors (one per {what}), got {len(vals)}")
        if isinstance(grad, torch.Tensor) and grad.dim() != 2:
            grad = grad.reshape(grad.shape[0], -1)
        if extra is not None and self._ends is not None:  # per layer boundary -> per element boundary
            extra = list(extra)
            if len(extra) != len(self.units) + 1:
                raise ValueError(f"extra: expected {len(self.units) + 1} entries (one per layer boundary, None for "
                                 f"none), got {len(extra)}")
            per_element: list[Optional[torch.Tensor]] = [None] * (self.core.n + 1)
            per_element[0] = extra[0]
            for e, t in zip(self._ends, extra[1:]):
                per_element[e] = t
            extra = per_element
        items, stacked, shared, has_extra, _, _, device, operators = check_inputs(
            self.core.n, self.core.nnz, self.core.dims, self.core.dtype, self.core.device, vals, grad, extra, False)
        bound = self.core.bind(shared, has_extra, device, operators, first_output)
        values = items[0] if stacked else items
        return self._layer_grads(bound.run(values, grad, extra, check=False, graph=True, stop=stop).grads)

    def bind_signatures(self, device=None) -> None:
        """Bind the core plan for what the wrapper's backward passes (shared flags, operators, with and
        without ``dl/dx_0``), so no step lowers anything."""
        shared = self.element_shared
        for first in (True, False):
            self.core.bind(shared, None, device, self.element_operator_flags, first)

    @property
    def operator_flags(self) -> list[bool]:
        """Per layer: whether the wrapper passes its structured operator instead of CSR values (a
        factored layer passes its factors' values)."""
        return [not f and ((self.use_operators and u.has_operator) or not u.has_csr_values)
                for u, f in zip(self.units, self.factored)]

    def _values(self, saved: list[Any], tensors: list[list[torch.Tensor]],
                needed: Optional[list[list[bool]]] = None) -> list[Any]:
        """Per layer: its structured operator where :attr:`operator_flags` says so, else its CSR values.
        ``needed``: per layer, the parameter gradients an operator may compute while it is applied
        (only at depth 0, where each layer's ``J^T`` is applied once, to ``dl/dx_k``)."""
        fuse = needed is not None and self.levels == 0
        out: list[Any] = []
        for k, (u, s, t, op) in enumerate(zip(self.units, saved, tensors, self.operator_flags)):
            if self.factored[k]:
                out += u.factor_fill(s, t)
            else:
                out.append(u.operator(s, t, needed[k] if fuse else None) if op else u.fill(s, t))
        return out

    # -- the autograd front end (spscan.runtime.autograd.FrontEnd): inputs (x, *the units' tensors)
    materialize_grads = True
    stash_state = False  # the state lives with the graph; the backward frees activations itself

    def scan_forward(self, inputs: tuple):
        x, *flat = inputs
        # grad mode is off here: the layers read the tensors as they are (no detached copies)
        tensors = [list(flat[sl]) for sl in self._role_slices]
        y, saved = self._run(x.detach(), tensors)
        state = ForwardState(saved, tensors, x.shape)
        state.graph = self.graph_backward
        return (y,), state

    def scan_backward(self, state: "ForwardState", grad_outputs: tuple, needs: tuple) -> tuple:
        """The autograd front end's backward: :meth:`_eager_backward`, replayed from a CUDA graph per
        signature where the forward was told to (:attr:`graph_backward`, :mod:`spscan.runtime.graphed`)."""
        gy = grad_outputs[0].contiguous()
        if not state.graph:
            return self._eager_backward(state, gy, needs)
        if state.released:
            raise RuntimeError(RELEASED)
        x_shape = state.x_shape

        def backward(saved, tensors, g):
            return self._eager_backward(ForwardState(saved, tensors, x_shape), g, needs)

        # the effective tensors as values (a pruned weight is made in the step, with an autograd graph)
        tensors = [[t.detach() for t in ts] for ts in state.tensors]
        out = self._graphed(backward, (state.saved, tensors, gy), (needs, tuple(x_shape), self._dynamic_key()),
                            self.engine_buffers)
        if not keep_graph():  # as the eager backward frees the activations once they are read
            state.released = True
            state.saved = None
        return out

    def _eager_backward(self, state: "ForwardState", gy: torch.Tensor, needs: tuple) -> tuple:
        return self._step_backward((False, *needs), gy.device).run(state, gy)[1:]

    # -- the whole step from CUDA graphs (spscan.runtime.graphed.GraphedStep's front, with scan_forward)
    def step_backward(self, state: "ForwardState", grad_outputs: tuple, needs: tuple) -> tuple:
        # a state of its own: the eager backward lets go of activations in it as it reads them
        return self._eager_backward(ForwardState(list(state.saved), state.tensors, state.x_shape), grad_outputs[0],
                                    needs)

    def step_buffers(self) -> list[torch.Tensor]:
        return self.engine_buffers()

    def run_step(self, x: torch.Tensor, flat: Sequence[torch.Tensor], graph: bool) -> torch.Tensor:
        """The wrapped forward of ``x`` with the units' effective tensors ``flat``, recorded for autograd:
        with ``graph`` the whole step from CUDA graphs where :class:`~spscan.runtime.graphed.GraphedStep`
        can (a signature's first step runs its work eagerly), else its backward alone from one; without,
        the eager scan."""
        if graph:
            out = self.step_graphs((x, *flat), 1, self._dynamic_key())
            if out is not None:
                return out[0]
        self.graph_backward = graph
        return autograd_apply(self, x, *flat)[0]

    def release_buffers(self) -> None:
        """Free the memory kept between steps: the recorded CUDA graphs (whole steps and backwards) with
        their activations and buffers, and the engine plans' arenas and working buffers. The next step
        of a signature runs eagerly and records again."""
        self._graphed.release()
        self.step_graphs.release()
        for plan in self.engine_plans():
            plan.release_buffers()

    def engine_plans(self) -> list:
        """The engine plans a backward runs (their bindings' buffers are read by a recorded graph)."""
        return [self.core]

    def engine_buffers(self) -> list[torch.Tensor]:
        """The buffers the engine's bound plans hold now (kept alive with a recorded backward)."""
        return [t for p in self.engine_plans() for b in p.bindings() for t in b.held_buffers()]

    def needs_linear_scan(self) -> bool:
        """Whether a layer now couples the samples of a batch (a BatchNorm put in train mode after the plan was
        made in eval mode) where this plan multiplies matrices (depth > 0): only a linear-scan plan runs it."""
        return self.levels > 0 and any(not u.has_csr_values for u in self._dynamic_units)

    def _dynamic_key(self) -> tuple:
        """The state of the units whose sharedness or operator flag follows the module's mode."""
        return tuple((u.shared, (self.use_operators and u.has_operator) or not u.has_csr_values)
                     for u in self._dynamic_units) if self._dynamic_units else ()

    def _step_backward(self, needs_input_grad: tuple, device: torch.device) -> StepBackward:
        """The wrapper's backward for one signature, decided once and cached: which inputs need
        gradients (``needs_input_grad`` of the autograd function), the device, and the state of the
        units whose sharedness or operator flag follows the module's mode (dropout, batch-norm)."""
        key = (needs_input_grad, device, self._dynamic_key())
        hit = self._steps.get(key)
        if hit is None:
            hit = self._steps[key] = StepBackward(self, needs_input_grad, device)
        return hit


def example_rejected(k: int, in_shape: tuple, error: Exception) -> str:
    """Why layer ``k`` refused the example input that reached it, with what to do where the cause is likely
    a missing batch dimension (the first layer rejecting a per-sample shape of one dimension or none)."""
    msg = f"the example input reaching it has per-sample shape {in_shape}, which it rejects: {error}"
    if k == 0 and len(in_shape) <= 1:
        msg += (". The example input's first dimension is the batch (spscan plans per sample): a single sample "
                "needs a batch dimension; pass x.unsqueeze(0) (a batch of one) or a batch of your data")
    return msg


def levels_for_coupled_layers(units: Sequence[LayerUnit], kwargs: dict) -> dict:
    """A layer that couples the samples of a batch (train-mode BatchNorm) has no CSR values to
    multiply into up-sweep products: ``levels="auto"`` becomes the linear scan; a deeper forced
    depth is refused, naming the layer."""
    coupled = [u for u in units if not u.has_csr_values]
    if not coupled:
        return kwargs
    levels = kwargs.get("levels", "auto")
    if levels == "auto":
        return {**kwargs, "levels": 0}
    if levels != 0:
        u = coupled[0]
        raise ValueError(f"layer {u.index} ({u.name}): {u.operator_only_because}, so it runs as a structured "
                         f"operator only; levels={levels!r} would multiply it into up-sweep products: use levels=0 "
                         "or 'auto'" + (", or model.eval()" if u.capabilities.mode_dependent else ""))
    return kwargs


NORM_FORMS = ("auto", "dense", "factored")

# above this many dense-block entries per sample, a layer's blocks are never planned into products:
# a dense LayerNorm(1024) over 16 tokens is 16.8M entries per sample (its values alone 4 GiB a step at
# batch 64, float32), the factors 98k
DENSE_BLOCK_LIMIT = 1 << 22

# ``norm_form="auto"`` keeps the factors only when their estimated time is below the dense blocks' divided
# by this: the CPU profile prices per-sample dense GEMMs below what a core runs, so the margin keeps the
# estimate from picking factors that run slower (bench/results/calibration.md)
FACTORED_MARGIN = 2.0


def plan_chain(units: Sequence[LayerUnit], norm_form: str = "auto", operators: bool = True,
               **kwargs: Any) -> tuple[Any, list[bool], Any]:
    """The core plan of a chain of layer units, per layer whether it is factored, and the normalization-form
    :class:`~spscan.planner.choose.Decision` (``None`` when no layer has factors).

    A layer whose ``J^T`` is a block-diagonal of diagonal-plus-low-rank blocks
    (:class:`~spscan.layers.LowRankFactors`: LayerNorm, GroupNorm, Softmax, LogSoftmax) enters the
    chain either as its dense blocks (one element) or as its two factors ``L R`` (two elements,
    ``(1 + r) N`` entries per group each instead of ``N^2``). ``norm_form``:

    * ``"dense"``: the blocks (at depth 0 the wrapper applies the layer's own backward kernel and
      never forms them).
    * ``"factored"``: the factors, at any depth.
    * ``"auto"``: the planner's choice. At depth 0 nothing is multiplied, so the dense form (applied
      as the layer's kernel) is kept. Where the plan multiplies matrices (a depth ``K >= 1``, forced
      or chosen by ``levels="auto"``), both chains are planned and the one with the lower estimated
      critical-path time is kept (the factors must win by :data:`FACTORED_MARGIN`): the factors win
      where the blocks would fill the neighbours' products (a conv next to a GroupNorm), the blocks
      where the products are dense anyway (a Linear next to a LayerNorm over its whole output) and
      one element fewer is cheaper. Where a layer's blocks exceed :data:`DENSE_BLOCK_LIMIT`
      entries per sample, only the factored chain is planned; if its best depth is 0, the linear
      scan with the layers' kernels is planned instead.

    ``kwargs`` go to :func:`spscan.runtime.plan.build_plan` (``levels``, ``backend``, ...).
    """
    if norm_form not in NORM_FORMS:
        raise ValueError(f"norm_form: expected one of {NORM_FORMS}, got {norm_form!r}")
    can = [u.capabilities.low_rank_factors and u.has_csr_values for u in units]
    dense = [False] * len(units)

    def core_of(flags: Sequence[bool], **over: Any):
        pats = [p for u, f in zip(units, flags) for p in (u.factor_patterns() if f else (u.pattern,))]
        # what the wrapper applies by a layer's own operator (as ModelPlan.operator_flags) is priced by its work
        work = [e for u, f in zip(units, flags) for e in ((None, None) if f else (
            u.cost_entries if (operators and u.has_operator) or not u.has_csr_values else None,))]
        return build_plan(pats, bind=None, apply_entries=work, **{**kwargs, **over})

    def decided(core, flags, why: str, rivals: Sequence[tuple[str, Any]] = ()):
        """``(core, flags, the norm-form decision)``: the chain kept, and the rivals costed against it."""
        name = "factored" if any(flags) else "dense"
        best = core.candidates.get(core.levels)
        cands = [Candidate(name, best, why)]
        for other, plan in rivals:
            t = plan.candidates.get(plan.levels)
            factor = FACTORED_MARGIN if other == "factored" else 1.0
            cands.append(Candidate(other, None if t is None else t * factor,
                                   f"depth {plan.levels}" + (f", estimate x {FACTORED_MARGIN} (must win by it)"
                                                             if factor != 1.0 else "")))
        forced = name if norm_form != "auto" else None
        return core, flags, choose("normalization form", cands, forced, basis="critical-path model of each chain")

    if not any(can):
        return core_of(dense), dense, None
    if norm_form == "dense":
        return decided(core_of(dense), dense, "as asked")
    if norm_form == "factored":
        return decided(core_of(can), can, "as asked")
    levels = kwargs.get("levels", "auto")
    if levels == 0:
        return decided(core_of(dense), dense, "depth 0: each layer's own backward kernel, nothing multiplied")
    if any(c and u.nnz > DENSE_BLOCK_LIMIT for u, c in zip(units, can)):
        other = core_of(can)
        if other.levels == 0:  # the linear scan: each layer's own kernel (faster than the factors' SpMVs)
            return decided(core_of(dense, levels=0), dense, "the factored chain's best depth is 0: kernels instead",
                           [("factored", other)])
        return decided(other, can, f"dense blocks exceed {DENSE_BLOCK_LIMIT} entries")
    plain = core_of(dense)
    if plain.levels == 0 and levels == "auto":
        return decided(plain, dense, "depth 0 chosen: each layer's kernel, no products to fill")
    other = core_of(can)
    if other.levels == 0:
        return decided(plain, dense, "the factored chain's best depth is 0: kernels are faster", [("factored", other)])
    t_plain, t_other = plain.candidates.get(plain.levels), other.candidates.get(other.levels)
    if t_plain is not None and t_other is not None and t_other * FACTORED_MARGIN < t_plain:
        return decided(other, can, f"depth {other.levels}", [("dense", plain)])
    return decided(plain, dense, f"depth {plain.levels}", [("factored", other)])


def plan_model(model: nn.Module, example_input: torch.Tensor, *, prune_zeros: bool = False,
               operators: bool = True, **kwargs: Any) -> ModelPlan:
    """Plan an ``nn.Sequential`` chain (nested Sequentials are flattened) for scan backprop.

    Args:
        model: a plain ``nn.Sequential`` of supported layers (see
            :func:`spscan.layers.supported_layer_types`), or one supported layer.
        example_input: ``(B, *in_shape)``; only its per-sample shape (and dtype) matter — every
            later input must have the same per-sample shape.
        prune_zeros: also leave exactly-zero weights of Linear/Conv layers out of the patterns
            (they must stay zero while the plan is used).
        operators: in the wrapper's backward, layers that have a structured operator (conv,
            linear, activations, max-pool, batch-norm, reshapes, dropout) apply ``J^T`` directly
            instead of forming CSR values, wherever the scan only multiplies them by vectors.
        norm_form: ``"auto"`` (default), ``"dense"`` or ``"factored"``: how LayerNorm, GroupNorm,
            Softmax and LogSoftmax enter up-sweep products (see :func:`plan_chain`).
        **kwargs: passed to ``spscan.plan(patterns, **kwargs)`` (``levels``, ``backend``, ...).

    Raises:
        TypeError: a layer type without a unit (names the first one: index, name, type), or a
            model that is not a chain.
        ValueError: the example input does not fit a layer (names the layer and the shapes).
    """
    if isinstance(model, nn.Module) and not _plain_containers(model):
        raise NotPlannable(f"{type(model).__name__}: spscan.chain.model plans nn.Sequential chains of supported layers (or "
                        "one layer); a model with its own forward is traced with torch.fx by spscan.graph.plan: use "
                        "spscan.plan(model, example_input) or spscan.wrap(model, example_input)")
    chain = _flatten_chain(model)
    if not chain:
        raise ValueError("model: expected at least one layer, got an empty nn.Sequential")
    supported = supported_layer_types()
    for k, (name, m) in enumerate(chain):
        if type(m) not in supported:
            kind = "a container with its own forward" if list(m.children()) else "an unsupported layer type"
            raise NotPlannable(f"layer {k} ({name or '-'}): {type(m).__module__}.{type(m).__name__} is {kind}; "
                            f"supported: {', '.join(t.__name__ for t in supported)} (spscan.plan and spscan.wrap "
                            "trace such a chain with torch.fx and run that layer as its own autograd backward)")
        check_hooks(k, name, m)
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1:
        raise ValueError("example_input: expected a tensor (B, *in_shape) with a batch dimension, got "
                         f"{getattr(example_input, 'shape', type(example_input).__name__)}")
    x = example_input.detach()[:1]
    in_shape0 = tuple(x.shape[1:])
    units: list[LayerUnit] = []
    with torch.no_grad():
        for k, (name, m) in enumerate(chain):
            in_shape = tuple(x.shape[1:])
            if unit_capabilities(m).shape_preserving:
                y = x  # no call: dropout would draw random numbers, train-mode BN would update stats
            else:
                try:
                    y = m(x)
                except Exception as e:  # the layer's own message says what it expected
                    raise ValueError(f"layer {k} ({name or '-'}: {type(m).__name__}): "
                                     + example_rejected(k, in_shape, e)) from e
                if not isinstance(y, torch.Tensor):
                    raise UnitRefused(f"layer {k} ({name or '-'}: {type(m).__name__}): returns {type(y).__name__}; "
                                     "expected one tensor (a chain passes one tensor on; e.g. return_indices=False)")
            try:
                units.append(make_unit(k, m, in_shape, tuple(y.shape[1:]), prune_zeros=prune_zeros))
            except (TypeError, ValueError) as e:
                if y is x:  # not called (shape-preserving): the input may well be what is wrong
                    raise
                raise UnitRefused(str(e)) from e  # the layer ran: its configuration is what the unit lacks
            x = y
    kwargs = levels_for_coupled_layers(units, kwargs)
    core, factored, norm = plan_chain(units, operators=operators, **kwargs)
    plan = ModelPlan(model, units, [n for n, _ in chain], in_shape0, core, operators=operators, factored=factored)
    plan.decisions = [d for d in (norm,) if d is not None]
    plan.bind_signatures()
    return plan


# ----------------------------------------------------------------------------- parameter gradients


def param_grads(plan: ModelPlan, jacobians: Jacobians, grads: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every parameter gradient of the chain from the scan's output.

    Args:
        plan: the :class:`ModelPlan`.
        jacobians: what ``plan.forward(x)`` returned for this step.
        grads: ``n+1`` tensors from the scan, ``grads[i] = dl/dx_i`` of shape ``(B, d_i)``.

    Returns:
        ``{qualified parameter name: gradient}`` for every parameter with ``requires_grad``, named as
        in ``model.named_parameters()`` (pruned weights: ``<layer>.weight_orig``, gradient times mask).
        A parameter used by several layers gets the sum.

    All layers are independent once the scan is done, so this runs out of the scan's critical
    path; same-shaped Linear layers are batched into one GEMM.
    """
    if not isinstance(jacobians, Jacobians):
        raise TypeError(f"jacobians: expected the Jacobians returned by forward(), got {type(jacobians).__name__}")
    if hasattr(plan, "unit_param_grads"):  # a traced graph with blocks: grads are per block
        return plan.param_grads(jacobians, grads)
    if len(grads) != len(plan.units) + 1:
        raise ValueError(f"grads: expected {len(plan.units) + 1} tensors, got {len(grads)}")
    needed = [[p.requires_grad for _, p, _ in roles] for roles in plan.param_roles]
    with torch.no_grad():
        return collect_param_grads(plan.param_roles, unit_param_grads(plan, jacobians, grads, needed))


# ----------------------------------------------------------------------------- wrap


def model_dtype(model: nn.Module) -> Optional[torch.dtype]:
    """The dtype of ``model``'s first floating parameter (else buffer); ``None`` for a model without one."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def model_device(model: nn.Module) -> Optional[torch.device]:
    """Where ``model``'s parameters (else buffers) live; ``None`` for a model without either."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return None


#: the kinds of value a traced forward's optional arguments are planned at (:attr:`ModelPlan.fixed_arguments`:
#: fx specializes the graph to them); a call passes the planned value where it is that value or equal to it
PLAIN_ARGUMENT_TYPES = (type(None), bool, int, float, str)
_NOT_PLANNED = object()  # an argument the plan has no value for (SpscanModule._unplanned_argument)
#: how many plans a wrapper keeps for the per-sample shapes (and modes) it was called with (SpscanModule._plan_for)
MAX_SHAPE_PLANS = 8


class SpscanModule(BackwardChoice, nn.Module):
    """``model`` with the same forward, whose backward runs through the scan.

    Holds ``model`` as a submodule, so ``parameters()`` yields the model's own parameter objects
    and optimizers work unchanged. Input ``(B, *in_shape)``, output ``(B, *out_shape)``.
    ``backward``: ``"auto"`` (the planner chooses, per batch size, the scan, the model's own
    autograd backward or, on a GPU, the scan's whole step from CUDA graphs: :attr:`decision`,
    :meth:`explain`), ``"scan"``, ``"native"`` or ``"graph"``. With gradients off, or nothing that needs
    one, a call runs the model's own forward; under ``torch.autocast`` see
    :meth:`~spscan.runtime.choices.BackwardChoice._call_choice`. A traced model whose forward takes optional
    arguments (``forward(x, mask=None)``) is planned with their defaults; see :meth:`forward`.
    """

    def __init__(self, model: nn.Module, plan: ModelPlan, backward: str = "auto", batch: Optional[int] = None,
                 device: Optional[torch.device] = None, replan: Optional["Replan"] = None):
        super().__init__()
        self.model = model
        self.plan = plan
        self._replan = replan
        # the plans made for other per-sample shapes and, for a traced model, the other mode: (mode, shape) -> plan,
        # the most recently used last (_plan_for); None for a shape the scan cannot plan (backward="auto": native)
        self._plans: "OrderedDict[tuple, Optional[ModelPlan]]" = OrderedDict({self._plan_key(plan): plan})
        # where the steps run, for the choice: the plan's device, else the model's, else the example input's
        self._example_device = device
        self._init_choice(backward, None if batch is None else (tuple(plan.in_shape), int(batch)))

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """The model's call on ``x``, its backward as :attr:`decision` says. Further arguments are those of the
        model's own forward: where they are the values the graph was planned with (its defaults,
        :attr:`ModelPlan.fixed_arguments`) the call is planned as any other; other values (a mask where the
        default is None) change the graph, so with ``backward="auto"`` that call runs the model's own forward
        and backward, and with a forced ``scan`` or ``graph`` it is refused (TypeError). An input of another
        per-sample shape than the example's (an image of another size, a sequence of another length) is planned
        for its shape on first use (:meth:`_plan_for`)."""
        if args or kwargs:
            try:
                other = self._unplanned_argument(x, args, kwargs)
            except TypeError:  # arguments the model's forward does not take: its own error
                return self.model(x, *args, **kwargs)
            if other is not None:
                if self.backward_mode not in ("auto", "native") and torch.is_grad_enabled():
                    raise TypeError(f"{type(self).__name__} with backward={self.backward_mode!r}: the scan runs the "
                                    f"graph of {type(self.model).__name__} traced with "
                                    f"{self._planned_arguments() or 'no arguments'} besides the input; "
                                    f"this call passes {other}, which changes it (backward='auto' runs such a call "
                                    "through the model's own backward)")
                return self.model(x, *args, **kwargs)
        return super().forward(x)

    def _unplanned_argument(self, x: Any, args: tuple, kwargs: dict) -> Optional[str]:
        """``name=value`` of the first argument besides ``x`` that is not the value the graph was planned with
        (None: every one is); TypeError where the model's forward does not take them."""
        fixed = self.plan.fixed_arguments
        bound = inspect.signature(self.model.forward).bind(x, *args, **kwargs)
        for name, value in list(bound.arguments.items())[1:]:
            planned = fixed.get(name, _NOT_PLANNED)
            if not (value is planned or (type(value) is type(planned) and type(value) in PLAIN_ARGUMENT_TYPES
                                         and value == planned)):
                shown = f"a tensor {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
                return f"{name}={shown}"
        return None

    def _planned_arguments(self) -> str:
        """``name=value, ...`` of :attr:`ModelPlan.fixed_arguments` ('' for none)."""
        return ", ".join(f"{k}={v!r}" for k, v in self.plan.fixed_arguments.items())

    def _call_choice(self, key: Optional[Hashable], x: Any) -> str:
        """As :meth:`BackwardChoice._call_choice`, and with ``backward="auto"`` an input of a per-sample shape the
        scan cannot plan runs the model's own step (``"native"``)."""
        if key is not None and self.backward_mode == "auto" and self._plan_for(key[0]) is None:
            return "native"
        return super()._call_choice(key, x)

    def _backward_decision(self, key) -> Decision:
        shape, batch = key
        plan = self._plan_for(shape)
        detail = f"{plan.element_name}s: {len(plan)}, depth {plan.levels}"
        if len(self._plans) > 1:
            detail += f", input (B, {', '.join(map(str, shape))})"
        device = plan.core.device or model_device(self.model) or self._example_device
        notes: tuple[str, ...] = ()
        if self._replan is not None:
            notes = (f"an input of another per-sample shape is planned for its shape on first use (the last "
                     f"{MAX_SHAPE_PLANS} kept)",)
        if self.backward_mode == "auto" and plan.fixed_arguments:
            notes += (f"planned with {self._planned_arguments()}; a call with other values: native",)
        return layers_decision(plan.units, batch, device, self.backward_mode, detail, notes=notes)

    def _signature(self, x: Any) -> Optional[tuple[tuple[int, ...], int]]:
        """``(per-sample shape, batch size)``: each per-sample shape has its plan, each batch size its decision."""
        b = batch_of(x)
        return None if b is None else (tuple(x.shape[1:]), b)

    def _forward_alone(self) -> bool:
        return not torch.is_grad_enabled()  # nothing is recorded: the model's own forward

    def _scan_dtype(self) -> Optional[torch.dtype]:
        return model_dtype(self.model)

    @torch.compiler.disable  # under torch.compile the scan's step runs as it is (a graph break), not traced
    def _scan_step(self, key: Optional[int], choice: str, x: torch.Tensor) -> torch.Tensor:
        refuse_functorch()
        if self._replan is not None and key is not None:
            self._plan_for(key[0])
        flat = self._step_tensors(x)
        if x.shape[0] == 0 or not (x.requires_grad or any(t.requires_grad for t in flat)):
            # an empty batch (nothing to scan), or nothing that needs a gradient: plain torch
            return self.model(x)
        self._warn_opaque()  # a forced scan whose plan has nodes that run autograd's own backward: once
        y = self.plan.run_step(x, flat, choice == "graph")
        self._after_step(key, choice)
        tail = self.plan.output_tail
        return y if tail is None else tail(y)

    def _plan_key(self, plan: ModelPlan, shape: Optional[tuple] = None) -> tuple:
        """What a plan is kept under: the mode a traced plan was specialized to (None for a chain, whose units
        follow their modules' modes) and the per-sample input shape."""
        return (plan.planned_training, tuple(plan.in_shape) if shape is None else tuple(shape))

    def _plan_for(self, shape: tuple) -> Optional[ModelPlan]:
        """Make :attr:`plan` the one that runs an input of per-sample ``shape`` in the model's present mode, and
        return it (None: the scan cannot plan that shape, and ``backward="auto"`` runs the model's own step).

        * Each per-sample shape has its plan (an image of another size, a sequence of another length: a recurrent
          layer inside the model is planned for that length), made on first use from a zero example of that shape;
          the last :data:`MAX_SHAPE_PLANS` are kept, the oldest one's buffers freed.
        * A traced plan is specialized to the mode it was traced in (``self.training`` read in Python): in the
          other mode (the model's ``training`` flag) the plan traced in that mode runs, made on first use; both
          are kept, as training and evaluation alternate.
        * A plan made in eval mode at a depth a train-mode BatchNorm cannot run at (levels ``"auto"``) is made
          again as the model now is, once (the linear scan, which runs in either mode).
        """
        plan, mode, shape = self.plan, self.model.training, tuple(shape)
        if plan.in_shape == shape and plan.planned_training in (None, mode):
            if self._replan is not None and self._replan.levels == "auto" and plan.needs_linear_scan():
                self.plan = self._replan(self.model, shape)
                self._plans[self._plan_key(plan)] = self.plan
                plan.release_buffers()
            return self.plan
        if self._replan is None:  # planned directly (no way to plan another shape): the contract's own check
            return plan
        key = (None if plan.planned_training is None else mode, shape)
        if key not in self._plans:
            try:
                self._plans[key] = self._replan(self.model, shape)
            except NotPlannable:
                if self.backward_mode != "auto":
                    raise
                self._plans[key] = None  # the model's own step for this shape
            except ValueError as e:  # the model rejects that shape (its own error, as planning words it)
                raise ValueError(f"input: per-sample shape {shape}, planned on first use (the example's was "
                                 f"{tuple(plan.in_shape)}): {e}") from e
            while len(self._plans) > MAX_SHAPE_PLANS:
                _, old = self._plans.popitem(last=False)
                if old is not None and old is not plan:
                    old.release_buffers()
        self._plans.move_to_end(key)
        got = self._plans[key]
        if got is not None:
            self.plan = got
        return got

    def _step_tensors(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.plan.step_tensors(x)


class Replan:
    """How a wrapper's plan is made again (:meth:`SpscanModule._scan_step`): the planning function, the
    example input's shape and dtype (a zero batch of them stands in, on the model's device) and the options."""

    def __init__(self, plan_fn: Callable[..., ModelPlan], example_input: torch.Tensor, options: dict) -> None:
        self.plan_fn, self.options = plan_fn, dict(options)
        self.shape, self.dtype = tuple(example_input.shape), example_input.dtype

    @property
    def levels(self) -> Any:
        return self.options.get("levels", "auto")

    def __call__(self, model: nn.Module, per_sample: Optional[tuple] = None) -> ModelPlan:
        """A plan of ``model`` as it is now, for the example's per-sample shape or ``per_sample``."""
        shape = self.shape if per_sample is None else self.shape[:1] + tuple(per_sample)
        x = torch.zeros(shape, dtype=self.dtype, device=model_device(model) or torch.device("cpu"))
        return self.plan_fn(model, x, **self.options)


def wrap_chain(model: nn.Module, example_input: torch.Tensor, **plan_kwargs: Any) -> SpscanModule:
    """An ``nn.Module`` equal to ``model`` in forward whose backward is the scan.

    ``loss.backward()`` fills ``x.grad`` and every parameter's ``.grad`` (not those with
    ``requires_grad=False``) as autograd would. ``plan_kwargs`` go to :func:`plan_model`.
    """
    backward = plan_kwargs.pop("backward", option_default("backward"))
    return SpscanModule(model, plan_model(model, example_input, **plan_kwargs), backward, example_input.shape[0],
                        example_input.device, Replan(plan_model, example_input, plan_kwargs))
