"""The plan of a model's layers (:class:`ModelPlan`): per step, the forward that fills the transposed-Jacobian
values, the scan, and the parameter gradients. A chain's plan is made by :mod:`spscan.chain.planning`, a
traced graph's (a subclass) by :mod:`spscan.graph.plan`; :mod:`spscan.chain.wrapper` makes either a module.

>>> import torch, torch.nn as nn
>>> from spscan.chain.planning import plan_model
>>> net = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3)).double()
>>> plan = plan_model(net, torch.zeros(1, 1, 2, 2, dtype=torch.float64), levels=0)
>>> [p.shape for p in plan.patterns]
[(4, 8), (8, 8), (8, 8), (8, 3)]

``plan_model(model, example_input, **kw)`` builds a :class:`ModelPlan`; ``plan.forward(x)``
returns ``(output, jacobians)``; ``plan._spscan_backward(jacobians, grad)`` (what
``spscan.backward`` calls) returns ``[dl/dx_0, ..., dl/dx_n]``; :func:`param_grads` turns those
into ``dl/dθ``; :func:`spscan.chain.wrapper.wrap_chain` packages all of it as an ``nn.Module`` trained with
``loss.backward()``.

Pruned weights (``torch.nn.utils.prune`` masks, or exactly-zero weights with
``prune_zeros=True``) are left out of the patterns and must stay zero while the plan is used.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.nn as nn

from spscan.runtime.autograd import apply as autograd_apply, keep_graph
from spscan.chain.backward import (RELEASED, ForwardState, FusedUnitOperator, Jacobians, StepBackward,
                                   collect_param_grads, unit_param_grads)
from spscan.runtime.graphed import GraphedCall, GraphedStep
from spscan.runtime import check_inputs
from spscan.errors import LayerReplaced
from spscan.planner.choose import Decision, explain as explain_decisions
from spscan.layers import LayerUnit

__all__ = ["Jacobians", "LayerReplaced", "ModelPlan", "ModelWatch", "global_hooks", "has_hooks", "param_grads"]


# ----------------------------------------------------------------------------- chain discovery


def has_hooks(m: nn.Module) -> bool:
    """Whether ``m`` has forward or backward hooks of its own other than ``torch.nn.utils.prune`` masks (they
    could change what it computes, and an analytic ``J^T`` would not follow): a traced model runs such a
    module as an opaque node, its own call (hooks included) and its own autograd backward."""
    from torch.nn.utils.prune import BasePruningMethod

    pre = [h for h in m._forward_pre_hooks.values() if not isinstance(h, BasePruningMethod)]
    return bool(pre or m._forward_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None))


def global_hooks() -> bool:
    """Whether hooks are registered for every module (``torch.nn.modules.module.register_module_forward_hook``
    and its kin): the scan, which does not call the modules, would not run them."""
    mod = torch.nn.modules.module
    return bool(mod._global_forward_hooks or mod._global_forward_pre_hooks or mod._global_backward_hooks
                or mod._global_backward_pre_hooks)


class ModelWatch:
    """The model's modules as a plan was made from them: each one's class, parameter objects and whether it
    had hooks. :meth:`changed` says what differs now (a hook or a parametrization registered after planning,
    which the units would not follow; a parameter given anew, whose gradient a unit holding the old one would
    give to the old one), in time linear in the modules with no allocation."""

    def __init__(self, model: nn.Module) -> None:
        # (the model itself: its class and forward; its hooks are the wrapper's to see)
        self.entries = [(name or type(m).__name__, m, type(m), tuple(m._parameters.values()), tuple(m._parameters),
                         has_hooks(m) or m is model, len(m._forward_pre_hooks), m.__dict__.get("forward"))
                        for name, m in model.named_modules()]

    def changed(self) -> Optional[str]:
        for name, m, cls, params, names, hooked, pre, forward in self.entries:
            if type(m) is not cls:
                return f"{name}: {type(m).__name__} after planning (planned {cls.__name__}; a parametrization?)"
            if m.__dict__.get("forward") is not forward:
                return f"{name}: its forward was replaced after planning"
            if not hooked and (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                               or m._backward_pre_hooks) and has_hooks(m):
                return f"{name}: hooks were registered on it after planning"
            now = m._parameters
            if len(now) != len(params) or any(a is not b for a, b in zip(now.values(), params)):
                return f"{name}: its parameters were given anew after planning"
            if len(m._forward_pre_hooks) != pre or (names and tuple(now) != names):
                return f"{name}: its pruning changed after planning"
        return None


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
                 factored: Optional[Sequence[bool]] = None, module_backed: Optional[Sequence[bool]] = None):
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
        # a traced forward's state arguments (``forward(input, hidden)``), read from this slot, which the wrapper
        # fills before each step (:mod:`spscan.graph.state`); None: the forward takes its input alone
        self.state: Any = None
        # the dim of the model's input that is the batch: 1 for a traced model that reads a time-major sequence
        # (``(T, B, ...)``); the plan runs on the input batch first (:meth:`batch_first`), as the graph takes it
        self.input_batch_dim = 0
        # a traced forward whose Python read a tensor's dtype as a value (``torch.finfo(x.dtype).min``): valid for
        # the parameters' dtype it was traced with (the wrapper keeps its plans under it, :class:`PythonState`)
        self.reads_dtype = False
        # a traced forward that squeezes a tensor of the batch where it may drop dim 0 (``h_n.squeeze()``,
        # ``x.squeeze(0)``): at batch 1 it drops the batch dim, where the plan keeps it (the wrapper runs such a
        # call as the model's own step)
        self.squeezes_batch = False
        # a traced forward whose result is not the chain's output itself (a tuple, ``logits.view(-1, V)``, an RNN's
        # ``h_n``): how the wrapper makes that result from the output and the step's input, under autograd (None:
        # the output is it)
        self.output_tail: Optional[Callable[..., Any]] = None
        # a packed result's parts: the flat tensors that reach only some of them (-> those parts), whose gradient
        # is None where the loss reads none (the wrapper gates them per step)
        self.part_gates: dict[int, frozenset] = {}
        # the flat tensors (and whether the input) every path of whose to the result passes through a gradient stop
        # (``.detach()``): handed to the scan detached, so their gradient is None, as autograd leaves it
        self.stopped_roles: frozenset = frozenset()
        self.input_stopped = False
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
        # per layer: whether it is a module of the model (a traced forward's functional nodes, ``F.relu``,
        # ``x.view(...)``, have units that stand for them and no module)
        self.module_backed = [True] * len(units) if module_backed is None else [bool(b) for b in module_backed]
        self._layer_paths = [tuple(n.split(".")) if n else () for n in layer_names]
        self._role_layer = [k for k, u in enumerate(units) for _ in u.roles]  # flat tensor -> its layer
        self._role_names = [(u, u.roles, tuple(r + "_orig" for r in u.roles)) for u in units if u.roles]
        self._watch = ModelWatch(model)  # the modules as planned (_check_layers)
        # units whose pruned weights were left out of their patterns, with their weight's flat position
        # (step_tensors: a weight regrown there, as dynamic sparse training does, is planned again)
        offsets = list(itertools.accumulate([0] + [len(u.roles) for u in units]))
        self._pruned = [(u, int(o)) for u, o in zip(units, offsets[:-1])
                        if getattr(u, "zero_weights", None) is not None and u.zero_weights.array.size]
        with torch.no_grad():  # the shapes the units were planned for (a parameter given anew may change them)
            self._role_shapes = [t.shape for u in units for t in u.tensors()]
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

    def batch_first(self, x: Any) -> Any:
        """The model's input ``x`` as the plan runs it, batch first (a view of ``x``: for a time-major model,
        :attr:`input_batch_dim` 1, ``x.transpose(0, 1)``)."""
        if self.input_batch_dim and isinstance(x, torch.Tensor) and x.dim() >= 2:
            return x.transpose(0, self.input_batch_dim)
        return x

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
        # token ids: read by the first layer (an embedding, an opaque node of its own call), not by layer k
        takes_ids = u.integer_input or self.units[0].integer_input
        if t.dtype != x.dtype and not (takes_ids and not x.is_floating_point()):
            raise TypeError(f"input: dtype {x.dtype}, but layer {k} ({self.layer_names[k] or '-'}: "
                            f"{type(u.module).__name__}) has {t.dtype} parameters; convert the input "
                            f"(x.to({t.dtype})) or the model")
        if t.device != x.device:
            raise ValueError(f"input: on {x.device}, but layer {k} ({self.layer_names[k] or '-'}: "
                             f"{type(u.module).__name__}) has parameters on {t.device}")

    def _check_roles(self, flat: Sequence[torch.Tensor]) -> None:
        """Refuse (:class:`LayerReplaced`) a step whose layer was given a parameter of another shape after
        planning (``fc.weight = nn.Parameter(torch.randn(5, 64))``): its unit's pattern is of the old shape."""
        if all(t.shape == s for t, s in zip(flat, self._role_shapes)):
            return
        i = next(i for i, (t, s) in enumerate(zip(flat, self._role_shapes)) if t.shape != s)
        k = self._role_layer[i]
        u = self.units[k]
        role = u.roles[i - sum(len(v.roles) for v in self.units[:k])]
        raise LayerReplaced(f"layer {k} ({self.layer_names[k] or '-'}): its {role} was given anew after planning "
                            f"(planned {tuple(self._role_shapes[i])}, now {tuple(flat[i].shape)}); wrap the model "
                            "again")

    def _check_layers(self) -> None:
        """Refuse a model whose planned layers were replaced after planning (the old ones would run), or one
        given hooks after planning where its analytic unit would not run them."""
        model = self.model
        for path, u, backed in zip(self._layer_paths, self.units, self.module_backed):  # no module listing
            if not backed:
                continue
            m = model
            for key in path:
                m = m._modules.get(key)
                if m is None:
                    break
            if m is not u.module:
                break
        else:
            what = self._watch.changed()
            if what is not None:  # planned again as it is now: a module with hooks runs as its own call
                raise LayerReplaced(f"{what}; wrap the model again")
            return
        modules = dict(self.model.named_modules(remove_duplicate=False))
        for k, (name, u, backed) in enumerate(zip(self.layer_names, self.units, self.module_backed)):
            now = modules.get(name) if name else self.model
            if backed and now is not u.module:
                was = type(u.module).__name__
                what = ("missing" if now is None else f"another {was} object" if type(now) is type(u.module)
                        else type(now).__name__)
                raise LayerReplaced(f"layer {k} ({name or '-'}): the model's module was replaced after planning "
                                    f"(planned {was}, now {what}); wrap the model again")

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
        self._check_layers()  # first: reading a changed model's tensors may run what changed (a parametrization)
        flat = self._flat_tensors()
        self._check_input(x, flat)
        self._check_roles(flat)
        for u, o in self._pruned:
            u._check_pruned_still_zero(flat[o])
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

    # -- the pieces of a step's backward (spscan.chain.backward.StepBackward runs them, for a traced graph too)
    layer_elements = True  # the core's elements are the layers (a traced graph's are blocks)

    def step_elements(self, st: ForwardState, step: StepBackward) -> tuple[list[Any], list[Any]]:
        """``(per layer: its operator, its CSR values or None for a factored layer; the core's elements)``
        for one step: a layer's structured operator where :attr:`operator_flags` says so (computing the
        parameter gradients ``step`` decided while it is applied, at depth 0), else its CSR values; a
        factored layer passes its two factors' values."""
        values = [(FusedUnitOperator(u, s, t, fused) if op else (None if f else u.fill(s, t)))
                  for (u, op, fused), f, s, t in zip(step.layers, self.factored, st.saved, st.tensors)]
        if self._ends is None:
            return values, values
        elements: list[Any] = []
        for (u, _, _), f, v, s, t in zip(step.layers, self.factored, values, st.saved, st.tensors):
            if f:
                elements += u.factor_fill(s, t)
            else:
                elements.append(v)
        return values, elements

    def fused_param_grads(self, values: Sequence[Any]) -> dict[int, list[Optional[torch.Tensor]]]:
        """``{layer: parameter gradients}`` that layers' operators computed while the scan applied them
        (each exactly once, to the layer's output gradient)."""
        return {k: v.param_grads for k, v in enumerate(values)
                if isinstance(v, FusedUnitOperator) and v.needed is not None and v.applied == 1}

    def unit_param_grads(self, saved: Sequence[Any], tensors: Sequence[Sequence[torch.Tensor]],
                         grads: Sequence[Optional[torch.Tensor]], needed: list[list[bool]]) -> list[list[Any]]:
        """dl/dθ per layer and role ``needed`` from the layer-boundary gradients ``grads`` (``n+1``)."""
        return unit_param_grads(self.units, saved, tensors, grads, needed)

    def lowest_needed_element(self, needed: Sequence[Sequence[bool]]) -> int:
        """Without ``dl/dx_0``: the lowest core element the scan must apply for the parameter gradients
        ``needed`` (per layer): the one above the lowest layer with a gradient wanted (that layer's
        gradients come from the gradient at its output). Layers below need nothing."""
        k = next((k for k, nd in enumerate(needed) if any(nd)), None)
        if k is None:
            return self.core.n
        return k + 1 if self._ends is None else self._ends[k]

    def param_grads(self, jacobians: Jacobians, grads: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{parameter name: gradient}`` from a step's ``forward`` result and the scan's gradients at the
        element boundaries (:func:`param_grads`)."""
        if not isinstance(jacobians, Jacobians):
            raise TypeError(f"jacobians: expected the Jacobians returned by forward(), got {type(jacobians).__name__}")
        if len(grads) != len(self) + 1:
            raise ValueError(f"grads: expected {len(self) + 1} tensors, got {len(grads)}")
        needed = [[p.requires_grad for _, p, _ in roles] for roles in self.param_roles]
        with torch.no_grad():
            return collect_param_grads(self.param_roles,
                                       self.unit_param_grads(jacobians.saved, jacobians.tensors, grads, needed))

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
        if graph and self.state is None:  # a recorded step would read the state it was recorded with
            out = self.step_graphs((x, *flat), 1, self._dynamic_key())
            if out is not None:
                return out[0]
        self.graph_backward = graph and self.state is None
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


# ----------------------------------------------------------------------------- parameter gradients


def param_grads(plan: ModelPlan, jacobians: Jacobians, grads: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every parameter gradient of the model from the scan's output.

    Args:
        plan: the :class:`ModelPlan` (or a traced graph's :class:`~spscan.graph.plan.GraphPlan`).
        jacobians: what ``plan.forward(x)`` returned for this step.
        grads: ``len(plan) + 1`` tensors from the scan, ``grads[i] = dl/dx_i`` of shape ``(B, d_i)``, one
            per layer boundary (a graph's: per block boundary).

    Returns:
        ``{qualified parameter name: gradient}`` for every parameter with ``requires_grad``, named as
        in ``model.named_parameters()`` (pruned weights: ``<layer>.weight_orig``, gradient times mask).
        A parameter used by several layers gets the sum.

    All layers are independent once the scan is done, so this runs out of the scan's critical
    path; same-shaped Linear layers are batched into one GEMM.
    """
    return plan.param_grads(jacobians, grads)
