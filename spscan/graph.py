"""Models ``torch.fx`` can trace: residual blocks, pre-activation blocks, channel concatenations,
functional ops and any DAG of supported nodes, planned for scan backprop.

``plan_graph(model, example_input)`` traces ``model`` with ``torch.fx`` and maps every node to a
layer unit through one registry (:data:`spscan.layers.registry.NODE_UNITS`: module types and
functions/methods alike;
basic-indexing slices ``x[:, :, ::2, ::2]`` and zero padding of any dims, ``F.pad(x, (0, 0, 0, 0,
p, p))``, are selection units, so He et al.'s option-A shortcut in a ``LambdaLayer`` plans).

* A straight chain of supported nodes keeps today's plan (a :class:`TracedChainPlan`, which is a
  :class:`~spscan.model.ModelPlan`).
* A graph with skips is decomposed into series-parallel blocks: a fork node ``x`` whose paths
  meet again at a join ``y = a + b`` (add) or ``y = cat([a, b, ...], 1)`` (channel concatenation),
  with ``x`` the join's immediate dominator. Each path from ``x`` to the join is a branch (a chain
  of segments, possibly empty: the identity). The block's transposed Jacobian is
  ``sum_b J_b^T`` for an add (``I + J_F^T`` for a residual block) or ``[J_1^T | J_2^T | ...]``
  for a concatenation, where ``J_b^T`` is the branch's composite ``J_1^T ... J_m^T``, computed per
  step by the engine's composite plan (:func:`spscan.plan.build_composite`). The block's pattern
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
  (:class:`_LiveStep`): identity blocks for the tensors passing through, the node's own ``J^T``
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

Unsupported ops (and joins other than an add of two tensors without ``alpha`` or a
concatenation along channels) are refused naming the node and its source line.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.fx as fx
import torch.nn as nn

from spscan.kernels.backend import StructuredOperator
from spscan.autograd import apply as autograd_apply, refuse_functorch
from spscan.layers import LayerUnit, UnitOperator, make_unit, supported_layer_types, unit_capabilities
from spscan.layers.registry import JOIN_ADD as _ADD, JOIN_CAT as _CAT, NODE_UNITS, supported_node_targets
from spscan.layers.shape import PerSampleReshapeUnit, SelectionUnit, _Selection  # noqa: F401 (importable here)
from spscan.chain_backward import ForwardState, Jacobians, collect_param_grads
from spscan.model import (ModelPlan, SpscanModule, check_hooks, example_rejected, levels_for_coupled_layers,
                          plan_chain)
from spscan.plan import build_composite, build_plan
from spscan.planner.blocks import block_union, identity_pattern, place, product_pattern, union_pattern

__all__ = ["plan_graph", "wrap_graph", "GraphPlan", "TracedChainPlan", "GraphSpscanModule", "NODE_UNITS",
           "supported_node_targets",
           "SelectionUnit", "LIVE_STATE_LIMIT"]


# ----------------------------------------------------------------------------- node targets

# nodes that compute shapes for a view/reshape (never tensors of the graph)
_TENSOR_QUERIES = {("method", "size"), ("method", "dim"), ("method", "numel"), getattr}
_SHAPE_QUERIES = _TENSOR_QUERIES | {operator.getitem, operator.mul, operator.floordiv, operator.add,
                                    operator.sub}


def _node_key(node: fx.Node, root: nn.Module) -> Any:
    if node.op == "call_module":
        return type(root.get_submodule(node.target))
    if node.op == "call_method":
        return ("method", node.target)
    return node.target


def _source(node: fx.Node) -> str:
    """The innermost user frame that made ``node`` (``file:line in fn: code``), and the module it is in."""
    frames, lines = [], (node.stack_trace or "").splitlines()
    for i, ln in enumerate(lines):
        m = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', ln)
        if m:
            nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append(m.groups() + ("" if nxt.startswith("File ") else nxt,))
    user = [f for f in frames if "/torch/" not in f[0].replace("\\", "/")]
    where = "source line unknown"
    if user:
        f, line, fn, code = user[-1]
        where = f"{f}:{line} in {fn}" + (f": {code.strip()}" if code else "")
    stack = node.meta.get("nn_module_stack")
    if stack:
        path, cls = list(stack.values())[-1]
        where += f", in module '{path}' ({getattr(cls, '__name__', cls)})"
    return where


class _NotSeriesParallel(TypeError):
    """The graph is not a chain of series-parallel blocks: it is planned as a live-set chain instead."""


def _op_text(node: fx.Node) -> str:
    """``node`` as the call it stands for: ``operator.mul(relu, 2)``, ``x.view(...)``, ``self.fc(x)``."""
    args = [a.name if isinstance(a, fx.Node) else repr(a) for a in node.args]
    args += [f"{k}={v.name if isinstance(v, fx.Node) else repr(v)}" for k, v in node.kwargs.items()]
    if node.op == "call_method":
        return f"{args[0]}.{node.target}({', '.join(args[1:])})" if args else f".{node.target}()"
    if node.op == "call_module":
        name = f"self.{node.target}"
    else:
        t = node.target
        mod = {"_operator": "operator"}.get(getattr(t, "__module__", None) or "", getattr(t, "__module__", None) or "")
        name = f"{mod}.{getattr(t, '__name__', repr(t))}".lstrip(".")
    return f"{name}({', '.join(args)})"


def _refuse(node: fx.Node, why: str, exc: type = TypeError) -> Exception:
    """An error naming the layer the node is in (its path and type), the call, where it was written, and
    why; a layer that subclasses a supported type with its own forward is told so."""
    stack = node.meta.get("nn_module_stack")
    head, hint = "", ""
    if stack:
        path, cls = list(stack.values())[-1]
        cls = cls if isinstance(cls, type) else None
        head = f"layer '{path}' ({getattr(cls, '__name__', cls)}): "
        base = next((b for b in (cls.__mro__[1:] if cls else ()) if b in NODE_UNITS), None)
        if base is not None and cls.forward is not base.forward:
            hint = (f"; {cls.__name__} subclasses nn.{base.__name__} but defines its own forward, which is traced "
                    f"op by op instead of taking nn.{base.__name__}'s Jacobian")
    return exc(f"{head}{_op_text(node)} (node {node.name}, at {_source(node)}): {why}{hint}")


# ----------------------------------------------------------------------------- segments


class _Leaf:
    """One unit of the graph (flat index ``k``)."""

    def __init__(self, unit: LayerUnit, k: int) -> None:
        self.unit, self.k = unit, k
        self.pattern = unit.pattern
        self.d_in, self.d_out = unit.d_in, unit.d_out
        # units without a matrix-free operator apply their CSR values through a one-layer plan on the
        # engine: its planned segment sums are deterministic on every device (no index_add_ atomics)
        self.spmv_plan = None if unit.has_operator else build_plan([unit.pattern], levels=0, bind=None)

    @property
    def shared(self) -> bool:
        return self.unit.shared

    def run(self, x, T):
        return self.unit.run(x, T[self.k])

    def fill(self, saved, T):
        return self.unit.fill(saved, T[self.k]), None

    def operator(self, saved, T, needed: Optional[Sequence[bool]] = None) -> StructuredOperator:
        """``needed``: the roles whose parameter gradients the unit's operator may compute while it is
        applied (depth 0, where it is applied once, to this unit's output gradient)."""
        if self.unit.has_operator:
            return self.unit.operator(saved, T[self.k], needed)
        return _FilledOperator(self, self.unit.fill(saved, T[self.k]))

    def grads(self, saved, T, g_out, out, needed) -> None:
        if self.unit.roles and any(needed[self.k]):
            out[self.k] = self.unit.param_grads(saved, T[self.k], g_out, needed[self.k])

    def describe(self) -> str:
        return self.unit.name


def _grads_while_applied(op: Optional[StructuredOperator]) -> Optional[list]:
    """The parameter gradients a unit's operator computed while it was applied exactly once, else ``None``
    (an operator filled from CSR values never computes any)."""
    if isinstance(op, UnitOperator) and op.applied == 1:
        return op.param_grads
    return None


class _FilledOperator(StructuredOperator):
    """``J^T g`` from a unit's CSR values (units without a matrix-free operator): gather and add."""

    def __init__(self, leaf: "_Leaf", values: torch.Tensor) -> None:
        self.leaf, self._values = leaf, values
        self.shape = (leaf.d_in, leaf.d_out)
        self.shared = values.dim() == 1

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        bound = self.leaf.spmv_plan.bind((self._values.dim() == 1,), None, g.device)
        return bound.run([self._values], g.contiguous(), check=False)[0]

    def values(self) -> torch.Tensor:
        return self._values


class _BlockOperator(StructuredOperator):
    """A parallel block's ``J^T`` for one step, matrix-free: each branch's layers applied in turn
    to ``g`` (its slice, for a concatenation), summed over the branches; the block's CSR values
    (branch composites placed in the union pattern) only when a planned product asks.

    ``needed`` (per unit of the graph, depth 0 only): the block is applied exactly once, to its
    output gradient, so each branch layer's operator is applied once to that layer's own output
    gradient and may compute the parameter gradients ``needed[k]`` on the way, as a chain layer's
    does (:meth:`collect_param_grads`), instead of a second pass over the branch afterwards."""

    def __init__(self, block: "_Parallel", saved, T, needed: Optional[Sequence[Sequence[bool]]] = None) -> None:
        self.block, self.saved, self.T, self.needed = block, saved, T, needed
        self.shape = (block.d_in, block.d_out)
        self.shared = block.shared
        self._ops: Optional[list] = None
        self.applied = 0

    def _operator(self, s, v):
        nd = self.needed
        if nd is None:
            return s.operator(v, self.T)
        if isinstance(s, _Leaf):
            return s.operator(v, self.T, nd[s.k] if any(nd[s.k]) else None)
        return s.operator(v, self.T, nd)

    def collect_param_grads(self, done: dict) -> None:
        """Add ``{unit index: parameter gradients}`` its layers' operators computed while this block was
        applied exactly once (nothing otherwise)."""
        if self.applied != 1 or self._ops is None:
            return
        for br, ops in zip(self.block.branches, self._ops):
            for s, op in zip(br, ops):
                if isinstance(op, _BlockOperator):
                    op.collect_param_grads(done)
                elif _grads_while_applied(op) is not None:
                    done[s.k] = op.param_grads

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        blk = self.block
        self.applied += 1
        if self._ops is None:
            self._ops = [[self._operator(s, v) for s, v in zip(br, sv)]
                         for br, sv in zip(blk.branches, self.saved[0])]
        total = None
        for ops, off, d in zip(self._ops, blk.offsets, blk.d_outs):
            h = g if blk.join == _ADD else g[:, off:off + d]
            for op in reversed(ops):
                h = op.apply(h)
            total = h.clone() if total is None and h is g else (h if total is None else total + h)
        return total

    def values(self) -> torch.Tensor:
        return self.block.fill(self.saved, self.T)[0]


class _Parallel:
    """Branches from one fork joined by an add (``sum_b J_b^T``) or a channel concatenation."""

    def __init__(self, join: str, branches: list[list[Any]], d_in: int, d_outs: list[int], opts: dict) -> None:
        self.join, self.branches, self.d_in = join, branches, d_in
        self.d_outs = d_outs
        self.d_out = d_outs[0] if join == _ADD else sum(d_outs)
        self._opts = opts
        self._composites: list[Any] = [None] * len(branches)
        self._gathers: list[Optional[torch.Tensor]] = [None] * len(branches)
        self.offsets = [0] * len(branches) if join == _ADD else [int(o) for o in np.cumsum([0] + d_outs[:-1])]
        self._ones: dict = {}
        # (branch composite patterns, the block's union pattern, each branch's map into it): symbolic
        # products of the branches' layers, made on first use. A block that only ever runs as its
        # structured operator (train-mode BatchNorm inside) never needs them; they are most of a
        # residual network's planning time
        self._structure: Optional[tuple[list[sp.csr_array], sp.csr_array, list[torch.Tensor]]] = None

    def _struct(self) -> tuple[list[sp.csr_array], sp.csr_array, list[torch.Tensor]]:
        if self._structure is None:
            pats: list[sp.csr_array] = []
            for br in self.branches:
                if not br:
                    pats.append(identity_pattern(self.d_in))
                elif len(br) == 1:
                    pats.append(br[0].pattern)
                else:  # the composite's structure; its numeric plan on first use (operators rarely need it)
                    pats.append(product_pattern([s.pattern for s in br]))
            pattern, maps = union_pattern(pats, None if self.join == _ADD else self.offsets)
            self._structure = (pats, pattern, [torch.from_numpy(m) for m in maps])
        return self._structure

    @property
    def pattern(self) -> sp.csr_array:
        """The block's ``J^T`` pattern: the union of its branches' composite patterns (made on first use)."""
        return self._struct()[1]

    @property
    def maps(self) -> list[torch.Tensor]:
        """Per branch, the positions of its composite's entries in :attr:`pattern`."""
        return self._struct()[2]

    @property
    def _branch_patterns(self) -> list[sp.csr_array]:
        return self._struct()[0]

    def _composite(self, b: int):
        """Branch ``b``'s composite plan (made on first use), its values placed by ``maps[b]``."""
        comp = self._composites[b]
        if comp is None:
            comp = build_composite([s.pattern for s in self.branches[b]], **self._opts)
            got = sp.csr_array(comp.composite_pattern)
            want = self._branch_patterns[b]
            if not (np.array_equal(got.indptr, want.indptr) and np.array_equal(got.indices, want.indices)):
                # the engine may store the product denser (e.g. dense): keep the structural entries only
                self._gathers[b] = torch.from_numpy(place(got, want))
            self._composites[b] = comp
        return comp

    @property
    def shared(self) -> bool:
        return all(s.shared for br in self.branches for s in br)

    def run(self, x, T):
        outs, saved = [], []
        for br in self.branches:
            h, ss = x, []
            for s in br:
                h, sv = s.run(h, T)
                ss.append(sv)
            outs.append(h)
            saved.append(ss)
        if self.join == _ADD:
            y = outs[0]
            for o in outs[1:]:
                y = y + o
        else:
            y = torch.cat(outs, 1)
        return y, (saved, x.shape[0], x.dtype, x.device)

    def fill(self, saved, T):
        saved_b, batch, dtype, device = saved
        inner, parts = [], []
        for br, sv in zip(self.branches, saved_b):
            filled = [s.fill(v, T) for s, v in zip(br, sv)]
            inner.append(filled)
            if not br:
                key = (dtype, device)
                if key not in self._ones:
                    self._ones[key] = torch.ones(self.d_in, dtype=dtype, device=device)
                parts.append(self._ones[key])
            elif len(br) == 1:
                parts.append(filled[0][0])
            else:
                vals = [v for v, _ in filled]
                b = len(parts)
                comp = self._composite(b)
                v = comp.bind(shared=[v.dim() == 1 for v in vals], device=device).run(vals).composite
                if self._gathers[b] is not None:
                    v = torch.index_select(v, v.dim() - 1, self._gathers[b].to(device))
                parts.append(v)
        shared = all(p.dim() == 1 for p in parts)
        nnz = self.pattern.nnz
        out = torch.zeros((nnz,) if shared else (batch, nnz), dtype=dtype, device=device)
        for p, m in zip(parts, self.maps):
            m = m.to(device)  # a branch's entries map to distinct union entries: plain indexed adds, no atomics
            if shared:
                out[m] += p
            else:
                out[:, m] += p
        return out, inner

    def operator(self, saved, T, needed=None) -> StructuredOperator:
        """``needed``: per unit of the graph (not per role of one unit), the parameter gradients the
        branch layers' operators may compute while the block is applied (depth 0 only)."""
        return _BlockOperator(self, saved, T, needed)

    def units(self) -> list[int]:
        """The indices of every unit inside the block (nested blocks included)."""
        out: list[int] = []
        for br in self.branches:
            for s in br:
                out += s.units() if isinstance(s, _Parallel) else [s.k]
        return out

    def grads(self, saved, T, g_out, out, needed) -> None:
        """Parameter gradients inside the block from ``g_out = dl/dy``: each branch's own
        activations' gradients by applying its layers' ``J^T`` back from the branch output (the
        linear scan over the branch), then each layer's rule. A branch whose layers need nothing
        is not walked."""
        for br, sv, off, d in zip(self.branches, saved[0], self.offsets, self.d_outs):
            ks = [k for s in br for k in (s.units() if isinstance(s, _Parallel) else [s.k])]
            if not any(any(needed[k]) for k in ks):
                continue
            g = g_out if self.join == _ADD else g_out[:, off:off + d]
            for i in range(len(br) - 1, -1, -1):
                br[i].grads(sv[i], T, g, out, needed)
                if i > 0:
                    g = br[i].operator(sv[i], T).apply(g)

    def describe(self) -> str:
        inner = " ; ".join("I" if not br else " -> ".join(s.describe() for s in br) for br in self.branches)
        return f"{self.join}[{inner}]"


# ----------------------------------------------------------------------------- general DAGs: the live-set chain

#: A general DAG is refused when its live-set chain would carry more than this many times the values
#: of the graph's own tensors (``sum_s d_live(s) > LIVE_STATE_LIMIT * sum_n d_n``, per sample).
LIVE_STATE_LIMIT = 16


class _LiveStep:
    """One node of a general DAG as one step of a chain over the live set.

    The chain's state before the step is the live set ``L = [t_1, ..., t_p]`` (tensors produced so far
    and still read later, in production order, flattened and stacked per sample); after it,
    ``L' = [the t_i still read later] + [y]``, ``y`` the node's output. Its transposed Jacobian, shape
    ``(d(L), d(L'))``, is a block matrix: an identity block for every tensor passing through, the
    node's ``J^T`` blocks in ``y``'s columns (``J_unit^T`` in its input's rows; for an add ``I`` in
    each input's rows; for a concatenation ``I`` at the input's channel offset) and nothing else: a
    tensor whose last use is this node has its row filled only by the node's ``J^T``. An input that
    also passes through gets both in its row (different columns), so ``g_t = g'_t + J^T g'_y``.
    """

    def __init__(self, kind: str, leaf: Optional[_Leaf], before: list[int], keep: list[int], inputs: list[int],
                 cat_offsets: list[int], node_name: str, names: list[str]) -> None:
        self.kind, self.leaf, self.node_name = kind, leaf, node_name
        self.dims_before = before
        self.keep, self.inputs, self.names = keep, inputs, names
        b_off = [int(o) for o in np.cumsum([0] + before[:-1])]
        after = [before[i] for i in keep]
        self.d_new = leaf.d_out if leaf is not None else (before[inputs[0]] if kind == _ADD else
                                                          sum(before[i] for i in inputs))
        a_off = [int(o) for o in np.cumsum([0] + after)]
        self.new_off = a_off[-1]
        self.d_in, self.d_out = int(sum(before)), self.new_off + self.d_new
        # pass-through copies, merged into contiguous runs: (row offset, column offset, width)
        runs: list[list[int]] = []
        for i, j in zip(keep, a_off):
            if runs and runs[-1][0] + runs[-1][2] == b_off[i] and runs[-1][1] + runs[-1][2] == j:
                runs[-1][2] += before[i]
            else:
                runs.append([b_off[i], j, before[i]])
        self.copies = [tuple(r) for r in runs]
        # the node's J^T blocks: (row offset, column offset within y, width of the input)
        self.in_rows = [(b_off[i], c, before[i]) for i, c in zip(inputs, cat_offsets)]
        blocks = [(r, c, identity_pattern(d)) for r, c, d in self.copies]
        for (r, c, d) in self.in_rows:
            blocks.append((r, self.new_off + c, leaf.pattern if leaf is not None else identity_pattern(d)))
        self.pattern, maps = block_union((self.d_in, self.d_out), blocks)
        const = np.zeros(self.pattern.nnz)
        for m in maps[:len(self.copies)] + ([] if leaf is not None else maps[len(self.copies):]):
            const[m] += 1.0  # identity entries (an input read twice gets 2 on its diagonal)
        self._const_np = const
        self._unit_map = torch.from_numpy(maps[-1]) if leaf is not None else None
        self._const: dict = {}

    @property
    def shared(self) -> bool:
        return self.leaf is None or self.leaf.shared

    def run(self, x, T):
        live = x if isinstance(x, list) else [x]
        sv = None
        if self.leaf is not None:
            y, sv = self.leaf.run(live[self.inputs[0]], T)
        elif self.kind == _ADD:
            y = live[self.inputs[0]] + live[self.inputs[1]]
        else:
            y = torch.cat([live[i] for i in self.inputs], 1)
        new = [live[i] for i in self.keep] + [y]
        return (new[0] if len(new) == 1 else new), (sv, y.shape[0], y.dtype, y.device)

    def _constant(self, dtype, device) -> torch.Tensor:
        key = (dtype, device)
        if key not in self._const:
            self._const[key] = torch.from_numpy(self._const_np).to(dtype=dtype, device=device)
        return self._const[key]

    def fill(self, saved, T):
        sv, batch, dtype, device = saved
        c = self._constant(dtype, device)
        if self.leaf is None:
            return c, None
        v = self.leaf.fill(sv, T)[0]
        m = self._unit_map.to(device)  # distinct entries: a plain indexed add, no atomics
        if v.dim() == 1:
            out = c.clone()
            out[m] += v
        else:
            out = c.expand(v.shape[0], c.numel()).clone()
            out[:, m] += v
        return out, None

    def operator(self, saved, T, needed: Optional[Sequence[bool]] = None) -> StructuredOperator:
        return _LiveOperator(self, saved, T, needed)

    def grads(self, saved, T, g_out, out, needed) -> None:
        if self.leaf is not None and any(needed[self.leaf.k]):
            g = g_out if self.new_off == 0 else g_out[:, self.new_off:].contiguous()
            self.leaf.grads(saved[0], T, g, out, needed)

    def describe(self) -> str:
        what = self.leaf.describe() if self.leaf is not None else self.kind
        return f"{self.node_name} ({what}) over live [{', '.join(self.names)}]"


class _LiveOperator(StructuredOperator):
    """A live-set step's ``J^T`` applied matrix-free: copy the tensors passing through, apply the
    node's operator to ``y``'s slice and add it into its inputs' rows."""

    def __init__(self, step: _LiveStep, saved, T, needed: Optional[Sequence[bool]] = None) -> None:
        self.step, self.saved, self.T, self.needed = step, saved, T, needed
        self.shape = (step.d_in, step.d_out)
        self.shared = step.shared
        self._op: Optional[StructuredOperator] = None

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        st = self.step
        out = g.new_zeros((g.shape[0], st.d_in))
        for r, c, d in st.copies:
            out[:, r:r + d] = g[:, c:c + d]
        h = g[:, st.new_off:]
        if st.leaf is not None:
            if self._op is None:
                self._op = st.leaf.operator(self.saved[0], self.T, self.needed)
            r, _, d = st.in_rows[0]
            out[:, r:r + d] += self._op.apply(h)
        else:
            for r, c, d in st.in_rows:
                out[:, r:r + d] += h[:, c:c + d]
        return out

    def values(self) -> torch.Tensor:
        return self.step.fill(self.saved, self.T)[0]


# ----------------------------------------------------------------------------- tracing


class _Traced:
    """The traced graph with per-node example values, units and the series-parallel parse."""

    def __init__(self, model: nn.Module, example_input: torch.Tensor, prune_zeros: bool, opts: dict) -> None:
        self.model, self.prune_zeros, self.opts = model, prune_zeros, opts
        tracer = fx.Tracer()
        tracer.record_stack_traces = True
        try:
            self.graph = tracer.trace(model)
        except Exception as e:  # data-dependent control flow and the like
            raise TypeError(f"{type(model).__name__}: torch.fx.symbolic_trace cannot capture its forward ({e}); "
                            "spscan plans models whose graph fx can trace") from e
        self.units: list[LayerUnit] = []
        self.names: list[str] = []
        self.module_backed: list[bool] = []
        self.leaf_of: dict[fx.Node, _Leaf] = {}
        self.kind: dict[fx.Node, str] = {}  # "input", "unit", "add", "cat"
        self.tin: dict[fx.Node, list[fx.Node]] = {}
        self._propagate(example_input)

    def _propagate(self, example_input: torch.Tensor) -> None:
        x = example_input.detach()
        x2 = x[:2] if x.shape[0] >= 2 else torch.cat([x[:1], x[:1]])
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            raise TypeError(f"{type(self.model).__name__}: expected a forward with one tensor input, got "
                            f"{len(placeholders)} inputs ({', '.join(n.name for n in placeholders)})")
        with torch.no_grad():
            for node in self.graph.nodes:
                if node.op == "placeholder":
                    env[node] = x2
                    self.kind[node] = "input"
                    self.tin[node] = []
                    self.input_node = node
                    continue
                if node.op == "output":
                    res = node.args[0]
                    if not isinstance(res, fx.Node) or not isinstance(env.get(res), torch.Tensor):
                        raise _refuse(node, "expected the forward to return one tensor")
                    self.output_node = res
                    continue
                if node.op == "get_attr":
                    raise _refuse(node, "reads a module attribute (a parameter or buffer used functionally); "
                                  "only parameters held by supported layer modules are planned")
                key = _node_key(node, self.model)
                args = fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
                tensor_inputs = [n for n in node.all_input_nodes if isinstance(env.get(n), torch.Tensor)]
                if node.op != "call_module" and (not tensor_inputs or key in _TENSOR_QUERIES):
                    # shape arithmetic for a view/reshape: evaluated here, never part of the graph
                    if key not in _SHAPE_QUERIES:
                        raise _refuse(node, "unsupported op (outside the tensor graph only shape arithmetic is "
                                      "supported)")
                    env[node] = self._call(node, args, kwargs)
                    if isinstance(env[node], torch.Tensor):
                        raise _refuse(node, "an op creating a tensor outside the graph's input is not supported")
                    continue
                builder = NODE_UNITS.get(key)
                if builder is None:
                    if isinstance(key, type):
                        kind = ("a container with its own forward that fx did not trace through"
                                if list(self.model.get_submodule(node.target).children()) else "an unsupported layer type")
                        raise _refuse(node, f"{key.__module__}.{key.__name__} is {kind}; supported layer types: "
                                      f"{', '.join(t.__name__ for t in supported_layer_types())}")
                    raise _refuse(node, "unsupported op (spscan.graph.supported_node_targets() lists the supported "
                                  "functions and tensor methods)")
                if builder in (_ADD, _CAT):
                    y = self._join(node, key, builder, args, kwargs, tensor_inputs, env)
                else:
                    y = self._unit(node, key, builder, args, kwargs, tensor_inputs, env)
                if not isinstance(y, torch.Tensor) or y.dim() < 1 or y.shape[0] != 2:
                    raise _refuse(node, f"expected a tensor (B, ...) keeping the batch dim; got "
                                  f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__} for "
                                  "an example batch of 2", ValueError)
                env[node] = y
        self.env = env

    def _call(self, node, args, kwargs):
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            return self.model.get_submodule(node.target)(*args, **kwargs)
        return node.target(*args, **kwargs)

    def _join(self, node, key, builder, args, kwargs, tensor_inputs, env):
        if builder == _ADD:
            if len(node.args) != 2 or not all(isinstance(a, fx.Node) and isinstance(env.get(a), torch.Tensor)
                                              for a in node.args) \
                    or node.kwargs.get("alpha", 1) != 1 or len(node.kwargs) > (1 if "alpha" in node.kwargs else 0):
                raise _refuse(node, "an add is supported between two tensors of the graph (the join of two "
                              "branches), without alpha or scalars")
            a, b = args[0], args[1]
            if a.shape != b.shape:
                raise _refuse(node, f"an add of two branches needs equal shapes (no broadcasting), got "
                              f"{tuple(a.shape)} and {tuple(b.shape)}", ValueError)
            self.tin[node] = [node.args[0], node.args[1]]
        else:
            seq = node.args[0] if node.args else node.kwargs.get("tensors")
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            if not isinstance(seq, (list, tuple)) or not all(isinstance(a, fx.Node) for a in seq):
                raise _refuse(node, "a concatenation of graph tensors expected")
            nd = env[seq[0]].dim()
            if dim % nd != 1:
                raise _refuse(node, f"concatenation along dim 1 (channels/features) expected, got dim={dim}", ValueError)
            self.tin[node] = list(seq)
        self.kind[node] = builder
        return self._call(node, args, kwargs)

    def _unit(self, node, key, builder, args, kwargs, tensor_inputs, env):
        if len(tensor_inputs) != 1 or not (node.args and node.args[0] is tensor_inputs[0]):
            raise _refuse(node, "a layer reading one tensor of the graph (its first argument) expected")
        src = tensor_inputs[0]
        xin = env[src]
        k = len(self.units)
        if node.op == "call_module":
            m = self.model.get_submodule(node.target)
            check_hooks(k, node.target, m)
            if len(node.args) != 1 or node.kwargs:
                raise _refuse(node, "a module called with extra arguments is not supported")
            if unit_capabilities(m).shape_preserving:
                y = xin  # no call: dropout would draw random numbers, train-mode BN would update its statistics
            else:
                try:
                    y = m(xin)
                except Exception as e:
                    raise _refuse(node, example_rejected(k, tuple(xin.shape[1:]), e), ValueError) from e
            try:
                unit = make_unit(k, m, tuple(xin.shape[1:]), tuple(y.shape[1:]), prune_zeros=self.prune_zeros)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{e} [node {node.format_node()} at {_source(node)}]") from e
            name, backed = node.target, True
        else:
            y = self._call(node, args, kwargs)
            if not isinstance(y, torch.Tensor) or y.dim() < 1 or y.shape[0] != xin.shape[0]:
                raise _refuse(node, "expected a tensor keeping the batch dim", ValueError)
            try:
                unit = builder(k, args, kwargs, tuple(xin.shape[1:]), tuple(y.shape[1:]), self.prune_zeros)
            except (TypeError, ValueError) as e:
                raise _refuse(node, str(e), type(e)) from e
            name, backed = node.name, False
        self.units.append(unit)
        self.names.append(name)
        self.module_backed.append(backed)
        self.leaf_of[node] = _Leaf(unit, k)
        self.kind[node] = "unit"
        self.tin[node] = [src]
        return y

    # -- the live-set chain (any DAG)
    def live_steps(self) -> list[Any]:
        """The graph as a chain over its live set (see :class:`_LiveStep`), in fx's topological order.
        A node whose only input is the whole live set and is read by nothing else stays a plain unit.
        Nodes the output does not depend on are left out (their parameters get no gradient, as in autograd).
        """
        nodes = [n for n in self.graph.nodes if n in self.kind]
        alive = {self.output_node}
        for n in reversed(nodes):
            if n in alive:
                alive.update(self.tin[n])
        if self.input_node not in alive:
            raise _refuse(self.output_node, "the output does not depend on the input", ValueError)
        nodes = [n for n in nodes if n in alive]
        last = {p: i for i, n in enumerate(nodes) for p in self.tin[n]}
        dim = {n: int(np.prod(self.env[n].shape[1:])) for n in nodes}
        # the live sets first (cheap), so that a graph past the limit is refused before any pattern is built
        live, plan, widths = [self.input_node], [], []
        for i, n in enumerate(nodes[1:], 1):
            keep = [j for j, t in enumerate(live) if last.get(t, -1) > i]
            plan.append((n, list(live), keep))
            live = [live[j] for j in keep] + [n]
            widths.append((sum(dim[t] for t in live), n, live))
        total, own = sum(w for w, _, _ in widths), sum(dim[n] for n in nodes[1:])
        if total > LIVE_STATE_LIMIT * own:
            w, n, ts = max(widths, key=lambda t: t[0])
            raise _refuse(n, f"as a live-set chain (the graph is not series-parallel) it would carry {total} values per "
                          f"sample over its {len(plan)} steps, more than {LIVE_STATE_LIMIT}x the {own} of the graph's "
                          f"own tensors (widest after this node: {len(ts)} live tensors, {w} values: "
                          f"{', '.join(t.name for t in ts)})", ValueError)
        steps: list[Any] = []
        for n, before, keep in plan:
            inputs = [before.index(p) for p in self.tin[n]]
            kind, leaf = self.kind[n], self.leaf_of.get(n)
            if kind == "unit" and len(before) == 1 and not keep:
                steps.append(leaf)
                continue
            offs = [0] * len(inputs)
            if kind == _CAT:
                offs = [int(o) for o in np.cumsum([0] + [dim[p] for p in self.tin[n][:-1]])]
            steps.append(_LiveStep(kind, leaf, [dim[t] for t in before], keep, inputs, offs, n.name,
                                   [t.name for t in before]))
        return steps

    # -- series-parallel parse
    def parse(self) -> list[Any]:
        nodes = [n for n in self.graph.nodes if n in self.kind]
        users: dict[fx.Node, int] = {n: 0 for n in nodes}
        for n in nodes:
            for p in set(self.tin[n]):
                users[p] += 1
            if len(set(self.tin[n])) != len(self.tin[n]):
                raise _refuse(n, "a join reading the same tensor twice", _NotSeriesParallel)
        dom: dict[fx.Node, set] = {}
        for n in nodes:
            preds = self.tin[n]
            dom[n] = ({n} | set.intersection(*[dom[p] for p in preds])) if preds else {n}
        order = {n: i for i, n in enumerate(nodes)}
        self.consumed: dict[fx.Node, int] = {n: 0 for n in nodes}
        self.visited: set = set()
        segs = self._back(self.output_node, self.input_node, dom, order)
        for n in nodes:
            if n is not self.output_node and self.consumed[n] != users[n]:
                raise _refuse(n, "its output is read across branches of different blocks (the graph is not a "
                              "chain of series-parallel blocks)", _NotSeriesParallel)
        return segs

    def _back(self, end, start, dom, order) -> list[Any]:
        segs: list[Any] = []
        node = end
        while node is not start:
            if node in self.visited:
                raise _refuse(node, "read by two branches of one block (not series-parallel)", _NotSeriesParallel)
            self.visited.add(node)
            kind = self.kind[node]
            if kind == "unit":
                segs.insert(0, self.leaf_of[node])
                src = self.tin[node][0]
                self.consumed[src] += 1
                node = src
            elif kind in (_ADD, _CAT):
                fork = max(dom[node] - {node}, key=lambda n: order[n])
                if order[fork] < order[start]:
                    raise _refuse(node, f"this join's branches start before {start.format_node()}, outside the block "
                                  "it belongs to (not series-parallel)", _NotSeriesParallel)
                branches = []
                for inp in self.tin[node]:
                    if inp is fork:
                        self.consumed[fork] += 1
                        branches.append([])
                    else:
                        self.consumed[inp] += 1
                        branches.append(self._back(inp, fork, dom, order))
                d_in = int(np.prod(self.env[fork].shape[1:]))
                d_outs = [int(np.prod(self.env[i].shape[1:])) for i in self.tin[node]]
                segs.insert(0, _Parallel(kind, branches, d_in, d_outs, self.opts))
                node = fork
            else:
                raise _refuse(node, "unexpected node in the graph")
        return segs


# ----------------------------------------------------------------------------- plans


class TracedChainPlan(ModelPlan):
    """A traced model that is a straight chain: today's chain plan; functional nodes (``F.relu``,
    ``x.view(...)``) have units that stand for them and no module in the model."""

    def __init__(self, *args: Any, module_backed: Sequence[bool], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.module_backed = list(module_backed)

    def _check_layers(self) -> None:
        modules = dict(self.model.named_modules(remove_duplicate=False))
        for k, (name, u, backed) in enumerate(zip(self.layer_names, self.units, self.module_backed)):
            if backed and modules.get(name) is not u.module:
                raise ValueError(f"layer {k} ({name}): the model's module was replaced after planning; "
                                 "wrap the model again")


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

    def __init__(self, model: nn.Module, traced: _Traced, segments: list[Any], in_shape: tuple[int, ...],
                 core: Any, operators: bool = True, operator_only: bool = False) -> None:
        super().__init__(model, traced.units, traced.names, in_shape, core, operators=operators)
        self.segments = segments
        # planned with train-mode BatchNorm: the blocks run only as structured operators, their patterns
        # were never formed and the core scan holds empty placeholders for them
        self.operator_only = bool(operator_only)
        self.module_backed = traced.module_backed
        out = traced.env[traced.output_node]
        self.out_shape = tuple(out.shape[1:])

    def __len__(self) -> int:
        return len(self.segments)

    @property
    def patterns(self) -> list:
        """The block-level ``J^T`` patterns (a parallel block's are made on first use)."""
        return [s.pattern for s in self.segments]

    _check_layers = TracedChainPlan._check_layers

    def summary(self) -> str:
        what = "live-set steps" if any(isinstance(s, _LiveStep) for s in self.segments) else "blocks"
        lines = [f"GraphPlan: {len(self.units)} layers in {len(self.segments)} {what}, input {self.in_shape} -> "
                 f"output {self.out_shape}"]
        for i, s in enumerate(self.segments):
            nnz = "(operator only)" if isinstance(s, _Parallel) and s._structure is None else s.pattern.nnz
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

    def _leaf_of(self, s: Any) -> Optional[_Leaf]:
        return s if isinstance(s, _Leaf) else (s.leaf if isinstance(s, _LiveStep) else None)

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
                if isinstance(s, _Parallel):
                    out.append(s.operator(sv, tensors, needed if fuse else None))
                else:
                    out.append(s.operator(sv, tensors, needed[leaf.k] if fuse and leaf is not None else None))
            return out
        return self._fill(saved, tensors)

    def fused_param_grads(self, values: Sequence[Any]) -> dict[int, list[Optional[torch.Tensor]]]:
        """``{unit index: parameter gradients}`` that unit operators computed while the scan applied them
        (each exactly once, to the unit's output gradient)."""
        done: dict[int, list[Optional[torch.Tensor]]] = {}
        for s, v in zip(self.segments, values):
            if isinstance(v, _BlockOperator):
                v.collect_param_grads(done)
                continue
            leaf = self._leaf_of(s)
            op = v._op if isinstance(v, _LiveOperator) else v
            if leaf is not None and _grads_while_applied(op) is not None:
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
            if isinstance(s, _Parallel):
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

    def param_grads(self, jac: Jacobians, grads: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{parameter name: gradient}`` from a step's ``forward`` result and the scan's block gradients."""
        if len(grads) != len(self.segments) + 1:
            raise ValueError(f"grads: expected {len(self.segments) + 1} tensors, got {len(grads)}")
        needed = [[p.requires_grad for _, p, _ in roles] for roles in self.param_roles]
        with torch.no_grad():
            return collect_param_grads(self.param_roles, self.unit_param_grads(jac.saved, jac.tensors, grads, needed))

    def scan_backward(self, state: ForwardState, grad_outputs: tuple, needs: tuple) -> tuple:
        """The autograd front end's backward (:class:`spscan.autograd.FrontEnd`): block values, the
        block-level scan, then every branch's inner scan and all parameter gradients."""
        gy = grad_outputs[0]
        needed, pos = [], 1
        for u in self.units:
            needed.append(list(needs[pos:pos + len(u.roles)]))
            pos += len(u.roles)
        values = self._values(state.saved, state.tensors, needed)
        grads = self.backward(values, gy.reshape(gy.shape[0], -1).contiguous(), first_output=needs[0],
                              stop=0 if needs[0] else self.lowest_needed_element(needed))
        gx = grads[0].reshape(state.x_shape) if needs[0] else None
        # parameter gradients a unit's operator computed while the scan applied it (one conv backward each)
        done = self.fused_param_grads(values)
        rest = [[n and (k not in done or done[k][r] is None) for r, n in enumerate(nd)]
                for k, nd in enumerate(needed)]
        per_unit = self.unit_param_grads(state.saved, state.tensors, grads, rest)
        for k, d in done.items():
            for r, v in enumerate(d):
                if v is not None and needed[k][r]:
                    per_unit[k][r] = v
        return (gx, *[g for gs in per_unit for g in gs])


def plan_graph(model: nn.Module, example_input: torch.Tensor, *, prune_zeros: bool = False,
               operators: bool = True, dag: str = "auto", **kwargs: Any) -> ModelPlan:
    """Plan any model ``torch.fx`` can trace whose nodes are supported, any DAG (see the module docstring).

    Returns a :class:`TracedChainPlan` for a straight chain, else a :class:`GraphPlan`. ``dag``:
    ``"auto"`` plans a chain of series-parallel blocks where the graph is one and the live-set chain
    otherwise; ``"live"`` plans the live-set chain always (the same gradients; for comparison).
    ``kwargs`` go to the block-level ``spscan.plan`` (``levels``, ``backend``, ``device``, ``dtype``, ...).

    Raises:
        TypeError: an unsupported node (names ``node.format_node()`` and its source line).
        ValueError: the example input does not fit a layer, or a general DAG's live-set chain exceeds
            :data:`LIVE_STATE_LIMIT` (names the node and the numbers).
    """
    if not isinstance(example_input, torch.Tensor) or example_input.dim() < 1 or example_input.shape[0] < 1:
        raise ValueError("example_input: expected a tensor (B, *in_shape) with a batch dimension, got "
                         f"{getattr(example_input, 'shape', type(example_input).__name__)}")
    if dag not in ("auto", "live"):
        raise ValueError(f"dag: expected 'auto' or 'live', got {dag!r}")
    opts = {k: kwargs[k] for k in ("backend", "device", "dtype") if k in kwargs}
    try:
        traced = _Traced(model, example_input, prune_zeros, opts)
        if not traced.units:
            raise ValueError("the traced forward has no layers (nothing but adds or concatenations of the input)")
        try:
            segments = traced.parse() if dag == "auto" else traced.live_steps()
        except _NotSeriesParallel:
            segments = traced.live_steps()  # any DAG: a chain over the live set
    except (TypeError, ValueError) as e:
        raise type(e)(f"{type(model).__name__}: {e}") from e
    in_shape = tuple(example_input.shape[1:])
    if all(isinstance(s, _Leaf) for s in segments):
        kwargs = levels_for_coupled_layers(traced.units, kwargs)  # layers without CSR values
        core, factored = plan_chain(traced.units, **kwargs)
        plan: ModelPlan = TracedChainPlan(model, traced.units, traced.names, in_shape, core, operators=operators,
                                          module_backed=traced.module_backed, factored=factored)
        plan.bind_signatures()
        return plan
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
            raise ValueError(f"{type(model).__name__}: layer {u.index} ({name}: {u.name}) couples the samples of a "
                             "batch (no per-sample J^T values): in a model with skips or concatenations it runs "
                             f"only as a structured operator at block depth 0; got operators={operators}, "
                             f"levels={levels!r}; use levels=0 or 'auto' with operators=True, or eval mode "
                             "(model.eval())")
        kwargs = {**kwargs, "levels": 0}
        # the blocks never form values: an empty pattern of each block's shape stands in for its J^T (the
        # symbolic products of the branches are most of a residual network's planning time)
        pats = [sp.csr_array((s.d_in, s.d_out), dtype=np.float64) if isinstance(s, _Parallel) else s.pattern
                for s in segments]
        core = build_plan(pats, bind=None, **kwargs)
        return GraphPlan(model, traced, segments, in_shape, core, operators=operators, operator_only=True)
    core = build_plan([s.pattern for s in segments], bind=None, **kwargs)
    return GraphPlan(model, traced, segments, in_shape, core, operators=operators)


# ----------------------------------------------------------------------------- autograd


class GraphSpscanModule(SpscanModule):
    """``model`` (a traced graph with blocks) whose backward runs through the block-level scan."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        refuse_functorch()
        self.plan._check_input(x)
        self.plan._check_layers()
        if x.shape[0] == 0:
            return self.model(x)
        flat = [t for u in self.plan.units for t in u.tensors()]
        return autograd_apply(self.plan, x, *flat)[0]


def wrap_graph(model: nn.Module, example_input: torch.Tensor, **plan_kwargs: Any) -> SpscanModule:
    """:func:`spscan.wrap` for a model with its own forward: planned by :func:`plan_graph`; a
    :class:`GraphSpscanModule` when the graph has blocks, else a chain's :class:`SpscanModule`."""
    plan = plan_graph(model, example_input, **plan_kwargs)
    if isinstance(plan, GraphPlan):
        return GraphSpscanModule(model, plan)
    return SpscanModule(model, plan)
