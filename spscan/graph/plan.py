"""Models ``torch.fx`` can trace: residual blocks, pre-activation blocks, channel concatenations,
functional ops and any DAG of nodes (analytic units, or opaque nodes that run their own autograd
backward), planned for scan backprop.

``plan_graph(model, example_input)`` traces ``model`` with ``torch.fx`` and maps every node to a
layer unit through one registry (:data:`spscan.layers.registry.NODE_UNITS`: module types and
functions/methods alike;
basic-indexing slices ``x[:, :, ::2, ::2]`` and zero padding of any dims, ``F.pad(x, (0, 0, 0, 0,
p, p))``, are selection units, so He et al.'s option-A shortcut in a ``LambdaLayer`` plans).

* A straight chain of supported nodes is planned as a chain of layers (a
  :class:`~spscan.chain.model.ModelPlan` whose functional nodes have units and no module).
* A graph with skips is decomposed into series-parallel blocks: a fork node ``x`` whose paths
  meet again at a join ``y = a + b`` (add) or ``y = cat([a, b, ...], 1)`` (channel concatenation),
  with ``x`` the join's immediate dominator. Each path from ``x`` to the join is a branch (a chain
  of segments, possibly empty: the identity). The block's transposed Jacobian is
  ``sum_b J_b^T`` for an add (``I + J_F^T`` for a residual block) or ``[J_1^T | J_2^T | ...]``
  for a concatenation, where ``J_b^T`` is the branch's composite ``J_1^T ... J_m^T``, computed per
  step by the engine's composite plan (:func:`spscan.runtime.plan.build_composite`). The block's pattern
  (the union of the branch patterns) and the index maps that place each branch's values in it
  are symbolic, made once (:mod:`spscan.planner.blocks`). The graph is then a chain at block level,
  planned by the ordinary scan. Inside a block, the gradients at the branch's own activations
  (what its parameter gradients need) come from a scan over the branch with the block output's
  gradient, after the block-level scan.
* Any other DAG (a node of one branch read by another branch, crossing skips, a tensor read by
  several later joins, ``u + u``) is planned as the **live-set chain**, the block-triangular
  system of Naumov's formulation written as a chain: over fx's topological order, the state
  after node ``n`` is the live set (the tensors produced so far that a later node still reads,
  plus ``n``'s output), and each node is one chain step whose ``J^T`` is a block matrix
  (:class:`LiveStep`): identity blocks for the tensors passing through, the node's own ``J^T``
  from its output's columns to its inputs' rows (added to the identity where an input stays
  live), and no identity for the tensors whose last use it is. A node reading the whole live set
  alone stays a plain unit step. Patterns are placed blocks, unioned once
  (:func:`spscan.planner.blocks.block_union`); per step the values are a constant (the identity
  entries) plus the node's unit values at planned positions, and the structured operator copies
  the passing tensors and applies the node's own operator to its slice, so train-mode BatchNorm
  runs matrix-free at depth 0 as in the block path.

  Cost: the scan keeps one gradient per step boundary, ``B * sum_s d_live(s)`` values, against
  ``B * sum_n d_n`` for a chain of the same nodes; a step's ``J^T`` holds ``d_live`` identity
  entries besides the node's. A graph whose live-set chain would carry more than
  :data:`LIVE_STATE_LIMIT` (16) times the values of its own tensors is refused with the numbers,
  naming the node with the widest live set (e.g. ``n`` tensors all read again by the last node:
  ``~n^2/2`` against ``2n``); ``max_memory`` bounds the rest as for any plan. Series-parallel
  graphs keep the block path (its live-set form would carry the skip through every node of the
  branch).

**Opaque nodes.** A node without an analytic unit (a function or tensor method the registry does not
know, a form its unit does not cover, a leaf module such as ``nn.MultiheadAttention`` or
``nn.TransformerEncoderLayer``, a node reading a parameter functionally, ``x + self.pos_embed``, or
reading several graph tensors, ``q @ k.transpose(-2, -1)``, ``a * b``) is an
:class:`~spscan.layers.opaque.OpaqueUnit`: its forward is the node's own call, recorded by autograd on
its detached inputs (a module's own call, so dropout draws its masks as the module does), and its
``J^T g`` for every graph input and its parameter gradients come from its own autograd backward. It has
no CSR values, so the scan runs at depth 0 around it, as around train-mode BatchNorm. A node reading
several graph tensors makes the graph a live-set chain; its step applies one backward for all its
inputs. Tensors that do not keep the batch dim first (``qkv.permute(2, 0, 3, 1, 4)``) and tensors made
from parameters (``self.cls.expand(B, -1, -1)``) are not part of the chain: each opaque node reading
them recomputes them from its graph tensors and the live parameters, at the current batch size. The
plan's summary names them (``opaque: self.attn (MultiheadAttention)``).

Refused: a forward ``torch.fx`` cannot trace (data-dependent control flow, named with the model), and an
output that does not keep the batch dim first (named with its node and source line).
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn

from spscan.chain.backward import ForwardState, Jacobians
from spscan.graph.outputs import part_gates, stopped
from spscan.graph.recurrent import RecurrentNodeUnit, input_batch_dim
from spscan.graph.state import StateInputs, StateSlot, state_batch_dims
from spscan.graph.segments import (BlockOperator, Leaf, LiveOperator, LiveStep, Parallel, grads_while_applied,
                                   segment_plans)
from spscan.graph.structure import LIVE_STATE_LIMIT, NotSeriesParallel
from spscan.graph.trace import Traced
from spscan.layers.registry import NODE_UNITS, supported_node_targets
from spscan.chain.model import ModelPlan
from spscan.chain.planning import levels_for_coupled_layers, plan_chain
from spscan.chain.wrapper import Replan, SpscanModule
from spscan.options import option_default
from spscan.runtime.checks import attributes_kept
from spscan.runtime.plan import build_plan

__all__ = ["plan_graph", "wrap_graph", "GraphPlan", "GraphSpscanModule", "NODE_UNITS",
           "supported_node_targets", "LIVE_STATE_LIMIT"]


class GraphPlan(ModelPlan):
    """A traced model with skips or concatenations, planned as a chain of blocks.

    Attributes:
        segments: the top-level blocks: a unit, a parallel block (``add``/``cat`` of branches) or,
            for a graph that is not series-parallel, a live-set step (one node over the live set).
        units: every layer unit (flat, in trace order); ``layer_names`` their module names (or node names).
        patterns: the block-level ``J^T`` patterns the core scan runs over.
        core: the block-level scan plan.
    """

    element_name = "block"

    def __init__(self, model: nn.Module, traced: Traced, segments: list[Any], in_shape: tuple[int, ...],
                 core: Any, operators: bool = True, operator_only: bool = False) -> None:
        super().__init__(model, traced.units, traced.names, in_shape, core, operators=operators,
                         module_backed=traced.module_backed)
        self.segments = segments
        # planned with train-mode BatchNorm: the blocks run only as structured operators, their patterns
        # were never formed and the core scan holds empty placeholders for them
        self.operator_only = bool(operator_only)
        out = traced.env[traced.output_node]
        self.out_shape = tuple(out.shape[1:])

    def __len__(self) -> int:
        return len(self.segments)

    @property
    def patterns(self) -> list:
        """The block-level ``J^T`` patterns (a parallel block's are made on first use)."""
        return [s.pattern for s in self.segments]


    def step_tensors(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._check_layers()
        self._check_input(x)
        flat = [t for u in self.units for t in u.tensors()]
        self._check_roles(flat)
        for u, o in self._pruned:
            u._check_pruned_still_zero(flat[o])
        return flat

    def summary(self) -> str:
        what = "live-set steps" if any(isinstance(s, LiveStep) for s in self.segments) else "blocks"
        lines = [f"GraphPlan: {len(self.units)} layers in {len(self.segments)} {what}, input {self.in_shape} -> "
                 f"output {self.out_shape}"]
        for i, s in enumerate(self.segments):
            nnz = "(operator only)" if isinstance(s, Parallel) and s._structure is None else s.pattern.nnz
            lines.append(f"  [{i}] {s.describe():<60} J^T {s.d_in}x{s.d_out} nnz={nnz} "
                         f"{'shared' if s.shared else 'per-sample'}")
        lines.append(self.core.summary())
        return "\n".join(lines)

    __str__ = summary

    def _run(self, x, tensors):
        saved = []
        for s in self.segments:
            x, sv = s.run(x, tensors)
            saved.append(sv)
        return x, saved

    def _fill_all(self, saved, tensors):
        filled = [s.fill(sv, tensors) for s, sv in zip(self.segments, saved)]
        return [v for v, _ in filled], [inner for _, inner in filled]

    def _fill(self, saved, tensors):
        return self._fill_all(saved, tensors)[0]

    def _leaf_of(self, s: Any) -> Optional[Leaf]:
        return s if isinstance(s, Leaf) else (s.leaf if isinstance(s, LiveStep) else None)

    def _values(self, saved, tensors, needed: Optional[list[list[bool]]] = None):
        """Per block: a structured operator (the wrapper's default: CSR values only where a planned
        product needs them) or CSR values (``operators=False``). ``needed`` (per unit): at depth 0 a
        unit step's operator may compute those parameter gradients while it is applied
        (:meth:`fused_param_grads` collects them)."""
        if self.use_operators:
            fuse = needed is not None and self.levels == 0
            out = []
            for s, sv in zip(self.segments, saved):
                leaf = self._leaf_of(s)
                if isinstance(s, Parallel):
                    out.append(s.operator(sv, tensors, needed if fuse else None))
                else:
                    out.append(s.operator(sv, tensors, needed[leaf.k] if fuse and leaf is not None else None))
            return out
        return self._fill(saved, tensors)

    # -- the pieces of a step's backward (spscan.chain.backward.StepBackward), per block
    layer_elements = False

    @property
    def element_shared(self) -> list[bool]:
        """Per block: whether its values are shared by the batch."""
        return [bool(s.shared) for s in self.segments]

    @property
    def element_operator_flags(self) -> list[bool]:
        """Per block: whether the wrapper's backward passes a structured operator (see :meth:`_values`)."""
        return [self.use_operators] * len(self.segments)

    def step_elements(self, st: ForwardState, step: Any) -> tuple[list[Any], list[Any]]:
        """One step's block elements (:meth:`_values`), twice: they are what the scan runs and what
        :meth:`fused_param_grads` reads."""
        values = self._values(st.saved, st.tensors, step.needed)
        return values, values

    def fused_param_grads(self, values: Sequence[Any]) -> dict[int, list[Optional[torch.Tensor]]]:
        """``{unit index: parameter gradients}`` that unit operators computed while the scan applied them
        (each exactly once, to the unit's output gradient)."""
        done: dict[int, list[Optional[torch.Tensor]]] = {}
        for s, v in zip(self.segments, values):
            if isinstance(v, BlockOperator):
                v.collect_param_grads(done)
                continue
            leaf = self._leaf_of(s)
            op = v._op if isinstance(v, LiveOperator) else v
            if leaf is not None and grads_while_applied(op) is not None:
                done[leaf.k] = op.param_grads
        return done

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Jacobians]:
        """Run the model on ``x``; ``(output, jacobians)`` with one value tensor per block."""
        if self.operator_only:
            raise ValueError(f"{type(self.model).__name__}: planned with BatchNorm in train mode, whose J^T couples the "
                             "samples of a batch: its blocks run only as structured operators (train through "
                             "spscan.wrap), there are no per-block values for spscan.backward; plan again in eval "
                             "mode (model.eval()) for them")
        self._check_input(x)
        with torch.no_grad():
            tensors = [[t.detach() for t in ts] for ts in self._tensors()]
            y, saved = self._run(x.detach(), tensors)
            values, inner = self._fill_all(saved, tensors)
        jac = Jacobians(values, x.shape[0], saved, tensors)
        jac.inner = inner  # type: ignore[attr-defined]
        return y, jac

    def lowest_needed_element(self, needed: Sequence[Sequence[bool]]) -> int:
        """Without ``dl/dx_0``: the lowest block whose operator must be applied for the parameter gradients
        ``needed`` (per unit): a parallel block holding a needed unit (its layers compute them while
        applied), else one above the lowest unit step with a needed unit (its gradients come from the
        block gradient above it). Blocks below need nothing: a frozen bottom costs no work."""
        for i, s in enumerate(self.segments):
            if isinstance(s, Parallel):
                if any(any(needed[k]) for k in s.units()):
                    return i
            else:
                leaf = self._leaf_of(s)
                if leaf is not None and any(needed[leaf.k]):
                    return i + 1
        return len(self.segments)

    def unit_param_grads(self, saved, tensors, grads, needed) -> list[list[Optional[torch.Tensor]]]:
        """dl/dθ per unit and role from the block-boundary gradients ``grads`` (``n+1``)."""
        out: list[Any] = [[None] * len(u.roles) for u in self.units]
        for i, s in enumerate(self.segments):
            s.grads(saved[i], tensors, grads[i + 1], out, needed)
        return out

    def engine_plans(self) -> list:
        return [self.core, *segment_plans(self.segments)]


def plan_graph(model: nn.Module, example_input: torch.Tensor, *, prune_zeros: bool = False,
               operators: bool = True, dag: str = "auto", batch_dim: Optional[int] = None, **kwargs: Any) -> ModelPlan:
    """Plan any model ``torch.fx`` can trace whose nodes are supported, any DAG (see the module docstring).

    Returns a :class:`~spscan.chain.model.ModelPlan` for a straight chain, else a :class:`GraphPlan`. ``dag``:
    ``"auto"`` plans a chain of series-parallel blocks where the graph is one and the live-set chain
    otherwise; ``"live"`` plans the live-set chain always (the same gradients; for comparison).
    ``batch_dim``: the input's batch dim where it is known (a model with state arguments: told with the state),
    else told from the model (:func:`~spscan.graph.recurrent.input_batch_dim`).
    ``kwargs`` go to the block-level ``spscan.plan`` (``levels``, ``backend``, ``device``, ``dtype``, ...).

    Raises:
        NotPlannable: a form the scan cannot plan: a node that does not keep the batch dim first, a general
            DAG whose live-set chain exceeds :data:`LIVE_STATE_LIMIT` (names the node and the numbers), hooks
            on the model itself, an untraceable forward (names ``node.format_node()`` and its source line).
        ValueError: the example input does not fit a layer; options that contradict the model.
    """
    with attributes_kept(model):  # the planner's runs and traces leave the model's attributes as they were
        return _plan_graph(model, example_input, prune_zeros=prune_zeros, operators=operators, dag=dag,
                           batch_dim=batch_dim, **kwargs)


def _plan_graph(model: nn.Module, example_input: torch.Tensor, *, prune_zeros: bool, operators: bool, dag: str,
                batch_dim: Optional[int], **kwargs: Any) -> ModelPlan:
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1 or example_input.shape[0] < 1:
        raise ValueError("example_input: expected a tensor (B, *in_shape) with a batch dimension, got "
                         f"{getattr(example_input, 'shape', type(example_input).__name__)}")
    if dag not in ("auto", "live"):
        raise ValueError(f"dag: expected 'auto' or 'live', got {dag!r}")
    opts = {k: kwargs[k] for k in ("backend", "device", "dtype") if k in kwargs}
    if batch_dim is None:
        batch_dim = input_batch_dim(model, example_input)
    try:
        traced = Traced(model, example_input, prune_zeros, opts, batch_dim)
        if not traced.units:
            raise ValueError("the traced forward has no layers (nothing but adds or concatenations of the input)")
        try:
            segments = traced.parse() if dag == "auto" else traced.live_steps()
        except NotSeriesParallel:
            segments = traced.live_steps()  # any DAG: a chain over the live set
    except (TypeError, ValueError) as e:
        raise type(e)(f"{type(model).__name__}: {e}") from e
    in_shape = tuple(example_input.shape[:batch_dim]) + tuple(example_input.shape[batch_dim + 1:])
    if all(isinstance(s, Leaf) for s in segments):
        kwargs = levels_for_coupled_layers(traced.units, kwargs)  # layers without CSR values
        core, factored, norm = plan_chain(traced.units, operators=operators, **kwargs)
        plan = ModelPlan(traced.model, traced.units, traced.names, in_shape, core, operators=operators,
                         module_backed=traced.module_backed, factored=factored)
        plan.decisions = [d for d in (norm,) if d is not None]
        plan.bind_signatures()
        return _traced_as(plan, traced, model)
    norm_form = kwargs.pop("norm_form", "auto")
    if norm_form not in ("auto", "dense"):
        raise ValueError(f"{type(model).__name__}: norm_form={norm_form!r}: a model with skips or concatenations "
                         "plans its blocks' composites with dense normalization blocks (the factored form is for "
                         "chains); use norm_form='auto' or 'dense'")
    coupled = [(u, name) for u, name in zip(traced.units, traced.names) if not u.has_csr_values]
    if coupled:
        # train-mode BatchNorm: its J^T couples the batch and exists only as an operator, so every block
        # runs matrix-free and the block-level scan stays linear (no composite values are ever formed)
        u, name = coupled[0]
        levels = kwargs.get("levels", "auto")
        if not operators or levels not in ("auto", 0):
            raise ValueError(f"{type(model).__name__}: layer {u.index} ({name}: {u.name}) has no per-sample J^T values "
                             f"({u.operator_only_because}): in a model with skips or concatenations it runs "
                             f"only as a structured operator at block depth 0; got operators={operators}, "
                             f"levels={levels!r}; use levels=0 or 'auto' with operators=True"
                             + (", or eval mode (model.eval())" if u.capabilities.mode_dependent else ""))
        kwargs = {**kwargs, "levels": 0}
        # the blocks never form values: an empty pattern of each block's shape stands in for its J^T (the
        # symbolic products of the branches are most of a residual network's planning time)
        pats = [sp.csr_array((s.d_in, s.d_out), dtype=np.float64) if isinstance(s, Parallel) else s.pattern
                for s in segments]
        core = build_plan(pats, bind=None, **kwargs)
        plan = GraphPlan(traced.model, traced, segments, in_shape, core, operators=operators, operator_only=True)
        return _traced_as(plan, traced, model)
    core = build_plan([s.pattern for s in segments], bind=None, **kwargs)
    plan = GraphPlan(traced.model, traced, segments, in_shape, core, operators=operators)
    return _traced_as(plan, traced, model)


def _traced_as(plan: ModelPlan, traced: Traced, model: nn.Module) -> ModelPlan:
    """``plan`` marked with what its graph was traced with: the model's mode, its forward's optional arguments
    and how the forward's result is made from the scan's output (:attr:`ModelPlan.planned_training`,
    :attr:`ModelPlan.fixed_arguments`, :attr:`ModelPlan.output_tail`)."""
    plan.planned_training = model.training
    plan.input_batch_dim = traced.batch_dim
    plan.reads_dtype = traced.dtype_read
    plan.squeezes_batch = traced.squeezes_batch
    plan.fixed_arguments = dict(traced.fixed_arguments)
    plan.output_tail = traced.output_tail
    # the units' tensors that reach only some parts of a packed result: gated per step (graph.outputs.gated)
    plan.part_gates = part_gates(traced, plan.units, plan._role_slices)
    # the units' tensors (and the input) whose every path to the result passes through a gradient stop
    plan.stopped_roles, plan.input_stopped = stopped(traced, plan.units, plan._role_slices)
    return plan


class GraphSpscanModule(SpscanModule):
    """``model`` (a traced graph with blocks) whose backward runs through the block-level scan (its plan a
    :class:`GraphPlan`, whose :meth:`GraphPlan.step_tensors` reads the units' tensors)."""


def wrap_graph(model: nn.Module, example_input: torch.Tensor, state: Optional[Sequence[Any]] = None,
               **plan_kwargs: Any) -> SpscanModule:
    """:func:`spscan.wrap` for a model with its own forward: planned by :func:`plan_graph`; a
    :class:`GraphSpscanModule` when the graph has blocks, else a chain's :class:`SpscanModule`. ``state``: the
    forward's arguments after its input in the example call, state that carries no gradient
    (``forward(input, hidden)``: :mod:`spscan.graph.state`)."""
    backward = plan_kwargs.pop("backward", option_default("backward"))
    slot = None
    if state is not None:
        slot = StateSlot(state, *state_batch_dims(model, example_input, state))
    plan_fn = functools.partial(_plan_for_backward, backward, slot)
    plan = plan_fn(model, example_input, **plan_kwargs)
    cls = GraphSpscanModule if isinstance(plan, GraphPlan) else SpscanModule
    return cls(model, plan, backward, example_input.shape[plan.input_batch_dim], example_input.device,
               Replan(plan_fn, example_input, plan_kwargs, plan.input_batch_dim))


def _plan_for_backward(backward: str, slot: Optional[StateSlot], model: nn.Module, example_input: torch.Tensor,
                       **plan_kwargs: Any) -> ModelPlan:
    """:func:`plan_graph`, its recurrent nodes following the wrapper's ``backward`` (a forced scan forces theirs)
    and the planning options a recurrent plan takes too; a model with state arguments read from ``slot``."""
    if slot is None:
        plan = plan_graph(model, example_input, **plan_kwargs)
    else:
        with slot.copied():  # the input's batch dim as told with the state (state_batch_dims)
            plan = plan_graph(StateInputs(model, slot), example_input, batch_dim=slot.input_dim, **plan_kwargs)
    plan.state = slot
    for u in plan.units:
        if isinstance(u, RecurrentNodeUnit):
            u.recurrent.configure(backward, plan_kwargs)
    return plan
