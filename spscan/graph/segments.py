"""The segments of a traced graph's block-level chain: a unit (:class:`Leaf`), a series-parallel
block (:class:`Parallel`: branches that fork at one node and meet at an add or a channel
concatenation) and a step of the live-set chain (:class:`LiveStep`), each with its pattern, its
per-step values and its structured operator. See :mod:`spscan.graph.plan` for how a graph becomes them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from spscan.kernels.backend import StructuredOperator
from spscan.layers import LayerUnit, UnitOperator
from spscan.layers.base import PerDevice
from spscan.layers.registry import JOIN_ADD as _ADD
from spscan.runtime.plan import build_composite, build_plan
from spscan.planner.blocks import block_union, identity_pattern, place, product_pattern, union_pattern

__all__ = ["BlockOperator", "FilledOperator", "Leaf", "LiveOperator", "LiveStep", "Parallel", "grads_while_applied",
           "segment_plans"]


def _first_unit(segments: list[Any]) -> int:
    """The flat index of the first unit of a branch (``-1`` for the identity), nested blocks included."""
    for s in segments:
        if isinstance(s, Leaf):
            return s.k
        if isinstance(s, Parallel):
            ks = [_first_unit(br) for br in s.branches if br]
            if ks:
                return min(ks)
    return -1


class Leaf:
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
        return FilledOperator(self, self.unit.fill(saved, T[self.k]))

    def grads(self, saved, T, g_out, out, needed) -> None:
        if self.unit.roles and any(needed[self.k]):
            out[self.k] = self.unit.param_grads(saved, T[self.k], g_out, needed[self.k])

    def describe(self) -> str:
        return self.unit.name


def grads_while_applied(op: Optional[StructuredOperator]) -> Optional[list]:
    """The parameter gradients a unit's operator computed while it was applied exactly once, else ``None``
    (an operator filled from CSR values never computes any)."""
    if isinstance(op, UnitOperator) and op.applied == 1:
        return op.param_grads
    return None


class FilledOperator(StructuredOperator):
    """``J^T g`` from a unit's CSR values (units without a matrix-free operator): gather and add."""

    def __init__(self, leaf: "Leaf", values: torch.Tensor) -> None:
        self.leaf, self._values = leaf, values
        self.shape = (leaf.d_in, leaf.d_out)
        self.shared = values.dim() == 1

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        bound = self.leaf.spmv_plan.bind((self._values.dim() == 1,), None, g.device)
        return bound.run([self._values], g.contiguous(), check=False)[0]

    def values(self) -> torch.Tensor:
        return self._values


class BlockOperator(StructuredOperator):
    """A parallel block's ``J^T`` for one step, matrix-free: each branch's layers applied in turn
    to ``g`` (its slice, for a concatenation), summed over the branches; the block's CSR values
    (branch composites placed in the union pattern) only when a planned product asks.

    ``needed`` (per unit of the graph, depth 0 only): the block is applied exactly once, to its
    output gradient, so each branch layer's operator is applied once to that layer's own output
    gradient and may compute the parameter gradients ``needed[k]`` on the way, as a chain layer's
    does; a layer whose operator does not (a Linear's ``J^T g`` is one GEMM, its weight gradient
    another) has that output gradient kept, and its rule runs on it in :meth:`collect_param_grads`.
    Either way there is no second pass over the branch afterwards."""

    def __init__(self, block: "Parallel", saved, T, needed: Optional[Sequence[Sequence[bool]]] = None) -> None:
        self.block, self.saved, self.T, self.needed = block, saved, T, needed
        self.shape = (block.d_in, block.d_out)
        self.shared = block.shared
        self._ops: Optional[list] = None
        self.applied = 0
        self._g_out: dict[int, torch.Tensor] = {}  # unit index -> its output gradient (needed, not fused)

    def _operator(self, s, v):
        nd = self.needed
        if nd is None:
            return s.operator(v, self.T)
        if isinstance(s, Leaf):
            return s.operator(v, self.T, nd[s.k] if any(nd[s.k]) else None)
        return s.operator(v, self.T, nd)

    def collect_param_grads(self, done: dict) -> None:
        """Add ``{unit index: parameter gradients}`` its layers' operators computed while this block was
        applied exactly once (nothing otherwise)."""
        if self.applied != 1 or self._ops is None:
            return
        for br, ops, sv in zip(self.block.branches, self._ops, self.saved[0]):
            for s, op, v in zip(br, ops, sv):
                if isinstance(op, BlockOperator):
                    op.collect_param_grads(done)
                elif grads_while_applied(op) is not None:
                    done[s.k] = op.param_grads
                elif s.k in self._g_out:
                    done[s.k] = s.unit.param_grads(v, self.T[s.k], self._g_out.pop(s.k), self.needed[s.k])

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        blk = self.block
        self.applied += 1
        if self._ops is None:
            self._ops = [[self._operator(s, v) for s, v in zip(br, sv)]
                         for br, sv in zip(blk.branches, self.saved[0])]
        keep = self.needed is not None and self.applied == 1
        total = None
        for br, ops, off, d in zip(blk.branches, self._ops, blk.offsets, blk.d_outs):
            h = g if blk.join == _ADD else g[:, off:off + d]
            for s, op in zip(reversed(br), reversed(ops)):
                if keep and isinstance(s, Leaf) and s.unit.roles and any(self.needed[s.k]) and not (
                        isinstance(op, UnitOperator) and op.unit.capabilities.fused_param_grads and op.needed):
                    self._g_out[s.k] = h  # its parameter gradients come from this in collect_param_grads
                h = op.apply(h)
            total = h.clone() if total is None and h is g else (h if total is None else total + h)
        return total

    def values(self) -> torch.Tensor:
        return self.block.fill(self.saved, self.T)[0]


class Parallel:
    """Branches from one fork joined by an add (``sum_b J_b^T``) or a channel concatenation."""

    def __init__(self, join: str, branches: list[list[Any]], d_in: int, d_outs: list[int], opts: dict) -> None:
        self.join, self.branches, self.d_in = join, branches, d_in
        self.d_outs = d_outs
        self.d_out = d_outs[0] if join == _ADD else sum(d_outs)
        self._opts = opts
        self._composites: list[Any] = [None] * len(branches)
        self._gathers: list[Optional[PerDevice]] = [None] * len(branches)
        self.offsets = [0] * len(branches) if join == _ADD else [int(o) for o in np.cumsum([0] + d_outs[:-1])]
        self._ones = PerDevice(lambda dtype, device: torch.ones(self.d_in, dtype=dtype, device=device))
        # (branch composite patterns, the block's union pattern, each branch's map into it): symbolic
        # products of the branches' layers, made on first use. A block that only ever runs as its
        # structured operator (train-mode BatchNorm inside) never needs them; they are most of a
        # residual network's planning time
        self._structure: Optional[tuple[list[sp.csr_array], sp.csr_array, list[PerDevice]]] = None

    def _struct(self) -> tuple[list[sp.csr_array], sp.csr_array, list[PerDevice]]:
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
            self._structure = (pats, pattern, [PerDevice.index(m) for m in maps])
        return self._structure

    @property
    def pattern(self) -> sp.csr_array:
        """The block's ``J^T`` pattern: the union of its branches' composite patterns (made on first use)."""
        return self._struct()[1]

    @property
    def maps(self) -> list[PerDevice]:
        """Per branch, the positions of its composite's entries in :attr:`pattern` (an index table)."""
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
                self._gathers[b] = PerDevice.index(place(got, want))
            self._composites[b] = comp
        return comp

    @property
    def shared(self) -> bool:
        return all(s.shared for br in self.branches for s in br)

    def run(self, x, T):
        outs: list[Any] = [None] * len(self.branches)
        saved: list[Any] = [None] * len(self.branches)
        # the branches run in the model's order (the first unit of each: units are numbered as the forward makes
        # them), so dropout in them draws its masks in the model's order; the join reads them in its own
        for b in sorted(range(len(self.branches)), key=lambda b: _first_unit(self.branches[b])):
            h, ss = x, []
            for s in self.branches[b]:
                h, sv = s.run(h, T)
                ss.append(sv)
            outs[b], saved[b] = h, ss
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
                parts.append(self._ones.get(dtype, device))
            elif len(br) == 1:
                parts.append(filled[0][0])
            else:
                vals = [v for v, _ in filled]
                b = len(parts)
                comp = self._composite(b)
                v = comp.bind(shared=[v.dim() == 1 for v in vals], device=device).run(vals).composite
                if self._gathers[b] is not None:
                    v = torch.index_select(v, v.dim() - 1, self._gathers[b].on(device))
                parts.append(v)
        shared = all(p.dim() == 1 for p in parts)
        nnz = self.pattern.nnz
        out = torch.zeros((nnz,) if shared else (batch, nnz), dtype=dtype, device=device)
        for p, m in zip(parts, self.maps):
            m = m.on(device)  # a branch's entries map to distinct union entries: plain indexed adds, no atomics
            if shared:
                out[m] += p
            else:
                out[:, m] += p
        return out, inner

    def operator(self, saved, T, needed=None) -> StructuredOperator:
        """``needed``: per unit of the graph (not per role of one unit), the parameter gradients the
        branch layers' operators may compute while the block is applied (depth 0 only)."""
        return BlockOperator(self, saved, T, needed)

    def units(self) -> list[int]:
        """The indices of every unit inside the block (nested blocks included)."""
        out: list[int] = []
        for br in self.branches:
            for s in br:
                out += s.units() if isinstance(s, Parallel) else [s.k]
        return out

    def grads(self, saved, T, g_out, out, needed) -> None:
        """Parameter gradients inside the block from ``g_out = dl/dy``: each branch's own
        activations' gradients by applying its layers' ``J^T`` back from the branch output (the
        linear scan over the branch), then each layer's rule. A branch whose layers need nothing
        is not walked."""
        for br, sv, off, d in zip(self.branches, saved[0], self.offsets, self.d_outs):
            ks = [k for s in br for k in (s.units() if isinstance(s, Parallel) else [s.k])]
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


class LiveStep:
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

    def __init__(self, kind: str, leaf: Optional[Leaf], before: list[int], keep: list[int], inputs: list[int],
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
        # per input row block: add into it (its tensor also passes through, or the node reads it twice) or write it
        kept, seen = set(keep), set()
        self.in_adds = []
        for i in inputs:
            self.in_adds.append(i in kept or i in seen)
            seen.add(i)
        self.uncovered = [(b_off[i], before[i]) for i in range(len(before)) if i not in kept and i not in seen]
        blocks = [(r, c, identity_pattern(d)) for r, c, d in self.copies]
        # a unit reading several graph tensors (an opaque node, operator only) has an empty block per input
        self.multi = leaf is not None and len(inputs) > 1
        for (r, c, d) in self.in_rows:
            blocks.append((r, self.new_off + c, identity_pattern(d) if leaf is None else
                           sp.csr_array((d, leaf.d_out), dtype=np.float64) if self.multi else leaf.pattern))
        self.pattern, maps = block_union((self.d_in, self.d_out), blocks)
        const = np.zeros(self.pattern.nnz)
        for m in maps[:len(self.copies)] + ([] if leaf is not None else maps[len(self.copies):]):
            const[m] += 1.0  # identity entries (an input read twice gets 2 on its diagonal)
        self._const = PerDevice(lambda dtype, device: torch.from_numpy(const).to(dtype=dtype, device=device))
        self._unit_map = PerDevice.index(maps[-1]) if leaf is not None and not self.multi else None

    @property
    def shared(self) -> bool:
        return self.leaf is None or self.leaf.shared

    def run(self, x, T):
        live = x if isinstance(x, list) else [x]
        sv = None
        if self.multi:
            y, sv = self.leaf.unit.run_inputs([live[i] for i in self.inputs], T[self.leaf.k])
        elif self.leaf is not None:
            y, sv = self.leaf.run(live[self.inputs[0]], T)
        elif self.kind == _ADD:
            y = live[self.inputs[0]] + live[self.inputs[1]]
        else:
            y = torch.cat([live[i] for i in self.inputs], 1)
        new = [live[i] for i in self.keep] + [y]
        return (new[0] if len(new) == 1 else new), (sv, y.shape[0], y.dtype, y.device)

    def fill(self, saved, T):
        sv, batch, dtype, device = saved
        c = self._const.get(dtype, device)
        if self.leaf is None:
            return c, None
        v = self.leaf.fill(sv, T)[0]
        m = self._unit_map.on(device)  # distinct entries: a plain indexed add, no atomics
        if v.dim() == 1:
            out = c.clone()
            out[m] += v
        else:
            out = c.expand(v.shape[0], c.numel()).clone()
            out[:, m] += v
        return out, None

    def operator(self, saved, T, needed: Optional[Sequence[bool]] = None) -> StructuredOperator:
        return LiveOperator(self, saved, T, needed)

    def grads(self, saved, T, g_out, out, needed) -> None:
        if self.leaf is not None and any(needed[self.leaf.k]):
            g = g_out if self.new_off == 0 else g_out[:, self.new_off:].contiguous()
            self.leaf.grads(saved[0], T, g, out, needed)

    def describe(self) -> str:
        what = self.leaf.describe() if self.leaf is not None else self.kind
        return f"{self.node_name} ({what}) over live [{', '.join(self.names)}]"


class LiveOperator(StructuredOperator):
    """A live-set step's ``J^T`` applied matrix-free: copy the tensors passing through, apply the
    node's operator to ``y``'s slice and add it into its inputs' rows."""

    def __init__(self, step: LiveStep, saved, T, needed: Optional[Sequence[bool]] = None) -> None:
        self.step, self.saved, self.T, self.needed = step, saved, T, needed
        self.shape = (step.d_in, step.d_out)
        self.shared = step.shared
        self._op: Optional[StructuredOperator] = None

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        st = self.step
        out = g.new_empty((g.shape[0], st.d_in))  # every row block is written below: no zero fill
        for r, c, d in st.copies:
            out[:, r:r + d] = g[:, c:c + d]
        for r, d in st.uncovered:
            out[:, r:r + d] = 0
        h = g[:, st.new_off:]
        if st.multi:  # one backward of the node for all its inputs (its parameter gradients come later)
            gis = st.leaf.unit.vjp(self.saved[0], h, [True] * len(st.inputs), [False] * len(st.leaf.unit.roles))[0]
        elif st.leaf is not None:
            if self._op is None:
                self._op = st.leaf.operator(self.saved[0], self.T, self.needed)
            gis = [self._op.apply(h)]
        else:
            gis = [h[:, c:c + d] for _, c, d in st.in_rows]
        for (r, _, d), add, gi in zip(st.in_rows, st.in_adds, gis):
            if gi is None:
                if not add:
                    out[:, r:r + d] = 0
            elif add:
                out[:, r:r + d] += gi
            else:
                out[:, r:r + d] = gi
        return out

    def values(self) -> torch.Tensor:
        return self.step.fill(self.saved, self.T)[0]


def segment_plans(segments: Sequence[Any]) -> list:
    """The engine plans ``segments`` run (leaves' one-layer plans, parallel blocks' composites made so
    far), nested blocks included: what a recorded backward reads besides its inputs."""
    out: list = []
    for s in segments:
        if isinstance(s, Leaf):
            if s.spmv_plan is not None:
                out.append(s.spmv_plan)
        elif isinstance(s, Parallel):
            out += [c for c in s._composites if c is not None]
            for br in s.branches:
                out += segment_plans(br)
        elif isinstance(s, LiveStep) and s.leaf is not None:
            out += segment_plans([s.leaf])
    return out
