"""Lowering a planned scan (:class:`~.planning.ScanPlan`) to a :class:`~.program.Program`: the arenas' layout
per signature (which inputs are shared, which ``extra`` terms exist: :func:`layout`), then the work tables of
every step (:func:`lower`), built once per plan where two signatures' tables have the same content
(:class:`LoweringCache`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .patterns import Pattern
from .cost import bin_widths, linear_run_kind
from .planning import ScanPlan
from .storage import dense_positions
from .schedule import GRAD, extra_vec, schedule_for
from .program import (SAMPLE, SHARED, Apply, Bin, BlockRef, Gemm, Gemv, LinearRun, Program, ProgramStep, RowProduct,
                      RowSpGEMM, SpMM, SpMV)

__all__ = ["Layout", "LoweringCache", "layout", "lower", "middle_runs", "mv_kind"]


def _binned(lengths: np.ndarray, first: np.ndarray, a_src: np.ndarray, b_src: np.ndarray,
            out: np.ndarray, add: Optional[np.ndarray], zero_a: int, zero_b: int) -> list[Bin]:
    """Group segments by padded width; pad each with (zero, zero) pairs.

    ``first[j]`` is where segment ``j`` starts in the flat pair arrays ``a_src``/``b_src``.
    Long segments are listed first so the widest launches start earliest.
    """
    if lengths.size == 0:
        return []
    widths = bin_widths(lengths)
    bins = []
    for w in sorted(np.unique(widths).tolist(), reverse=True):
        sel = np.nonzero(widths == w)[0]
        seg_len = lengths[sel]
        t = np.arange(w, dtype=np.int64)
        valid = t[None, :] < seg_len[:, None]
        src = first[sel][:, None] + t[None, :]
        src = np.where(valid, src, 0)
        a = np.where(valid, a_src[src] if a_src.size else zero_a, zero_a)
        b = np.where(valid, b_src[src] if b_src.size else zero_b, zero_b)
        bins.append(Bin(int(w), a.astype(np.int64), b.astype(np.int64), out[sel].astype(np.int64),
                        None if add is None else add[sel].astype(np.int64)))
    return bins


class _Alloc:
    def __init__(self) -> None:
        self.size = 0

    def take(self, count: int, align: int = 1) -> int:
        if align > 1:
            self.size += (-self.size) % align
        off = self.size
        self.size += count
        return off


def mv_kind(op, phase: str, pattern: Pattern, n: int, operators: Sequence[bool], drop_out) -> Optional[str]:
    """How lowering runs the mat-vec ``op`` of a step in ``phase`` (its matrix's ``pattern``): ``None``
    (dropped: the middle's ``dl/dx_0`` is not wanted), ``"apply"`` (a layer's structured operator),
    ``"gemv"`` (a full pattern) or ``"spmv"``. :func:`spscan.planner.memory.estimate_memory` counts the
    tables by the same rule."""
    if op.out == drop_out and phase == "mid":
        return None
    if op.mat < n and operators[op.mat]:
        return "apply"
    return "gemv" if pattern.is_full else "spmv"


def middle_runs(steps, mats, profile, operators: Sequence[bool] = ()) -> dict[int, int]:
    """Start index -> length of each run (>= 2) of chainable single-MV middle steps on ``profile``'s
    device (a layer that comes as a structured operator applies itself and ends a run)."""
    runs: dict[int, int] = {}
    n = len(operators)
    i = 0
    while i < len(steps):
        j = i
        while (j < len(steps) and steps[j].phase == "mid" and len(steps[j].mv) == 1
               and not (steps[j].mv[0].mat < n and operators[steps[j].mv[0].mat])
               and linear_run_kind(mats[steps[j].mv[0].mat].pattern, profile) is not None):
            j += 1
        if j - i >= 2:
            runs[i] = j - i
        i = max(j, i + 1)
    return runs


@dataclass
class Layout:
    """Where every value of one signature lives and which work tables its steps need (no table built).

    ``pending`` lists the tables in build order as ``(step, what, payload, key)``: ``what`` is one of
    ``"run"``, ``"gemm"``, ``"rows"``, ``"spmm"``, ``"apply"``, ``"gemv"``, ``"spmv"``; ``key`` is
    everything the table's content depends on (``None`` for an ``"apply"``, which holds none), so two
    signatures whose tables have equal keys hold equal tables (:class:`LoweringCache` shares them).
    """

    sched: object
    shared: tuple[bool, ...]
    has_extra: tuple[bool, ...]
    operators: tuple[bool, ...]
    kind: dict[int, str]
    offset: dict[int, int]
    input_offsets: list[int]
    voff: dict[int, int]
    vdim: dict[int, int]
    extra_slots: dict[int, int]
    dropped: set[int]  # vectors laid out but not computed (dl/dx_0 when it is not wanted)
    steps: list[ProgramStep]
    pending: list[tuple[ProgramStep, str, object, Optional[tuple]]]
    zero: dict[str, int]
    zero_v: int
    size_s: int
    size_p: int
    size_v: int
    period: int = 0


class LoweringCache:
    """Work tables lowered for one plan, shared by its bindings: a table whose key (see :class:`Layout`)
    is already here is reused as the same object, so bindings that differ in a few tables (a model's
    binding with and without ``dl/dx_0``) hold the rest once. Keys name the plan's own matrices by
    identity: one cache serves one plan."""

    def __init__(self) -> None:
        self.tables: dict[tuple, object] = {}

    def get(self, key: Optional[tuple], build):
        if key is None:
            return build()
        hit = self.tables.get(key)
        if hit is None:
            hit = self.tables[key] = build()
        return hit


def layout(plan: ScanPlan, shared: Sequence[bool], has_extra: Sequence[bool],
           operators: Optional[Sequence[bool]] = None, first_output: bool = True, period: int = 0) -> Layout:
    """Lay out the arenas of one value signature and list the work tables it needs (see :func:`lower`).

    ``first_output=False`` leaves out the middle's mat-vec that only produces ``dl/dx_0`` but keeps
    its vector slot, so every other slot, and hence every other table, is the same as with
    ``first_output=True``. ``period > 0``: the values repeat with that period (a recurrent chain:
    shared layer ``i`` holds the values of layer ``i mod period``), so each shared element gets one
    slot, which every period reads (the fused recurrence kernels need exactly that: a shared block
    that stays put); per-sample layers keep their own slots.
    """
    n = plan.n
    shared = tuple(bool(s) for s in shared)
    has_extra = tuple(bool(e) for e in has_extra)
    operators = (False,) * n if operators is None else tuple(bool(o) for o in operators)
    sched = schedule_for(plan.schedule.kind, n, plan.levels, has_extra) if any(has_extra[:n]) else plan.schedule
    reduce = sched.kind == "reduce"
    mats = plan.mats
    pats = plan.patterns

    alloc = {SHARED: _Alloc(), SAMPLE: _Alloc()}
    kind: dict[int, str] = {}
    offset: dict[int, int] = {}
    input_offsets = []
    in_products = {m for st in sched.steps for op in st.mm for m in (op.left, op.right) if m < n}
    period = _checked_period(period, n, shared, pats)
    for i in range(n):
        k = SHARED if shared[i] else SAMPLE
        kind[i] = k
        if operators[i] and i not in in_products:
            input_offsets.append(-1)  # applied by its operator only: no CSR values at all
            continue
        if period and i >= period and shared[i] and input_offsets[i - period] >= 0:
            offset[i] = offset[i - period]  # the same values as one period before: one copy
        else:
            offset[i] = alloc[k].take(pats[i].nnz)
        input_offsets.append(offset[i])
    drop_out = None if first_output or reduce else sched.outputs[0]

    valloc = _Alloc()
    vdim: dict[int, int] = {}
    voff: dict[int, int] = {}
    dropped: set[int] = set()

    def vec(v: int, dim: int) -> None:
        vdim[v] = dim
        voff[v] = valloc.take(dim)

    if not reduce:  # a reduction has no incoming gradient
        vec(GRAD, pats[n - 1].cols)
    extra_slots = {}
    for i in range(n):
        if has_extra[i]:
            vec(extra_vec(i), pats[i].rows)
            extra_slots[i] = voff[extra_vec(i)]

    # Product kinds are known before any slot is placed; zero slots go last, fixed after.
    for st in sched.steps:
        for op in st.mm:
            kind[op.out] = SHARED if kind[op.left] == SHARED and kind[op.right] == SHARED else SAMPLE

    pending = []  # (step, op-kind, payload) resolved once zero slots are known
    steps: list[ProgramStep] = []
    runs = middle_runs(sched.steps, mats, plan.profile, operators)
    skip_until = -1
    for si, st in enumerate(sched.steps):
        if si < skip_until:
            continue
        pstep = ProgramStep(st.phase, st.level)
        if si in runs:
            chain_ops = [s.mv[0] for s in sched.steps[si : si + runs[si]]]
            for op in chain_ops:
                vec(op.out, mats[op.mat].pattern.rows)
            if chain_ops[-1].out == drop_out:
                dropped.add(drop_out)
                chain_ops = chain_ops[:-1]
            pending.append((pstep, "run", chain_ops))
            steps.append(pstep)
            skip_until = si + runs[si]
            continue
        # --- matrix products: GEMM groups by (kinds, shape); pair products by kinds
        gemm_groups: dict[tuple, list] = {}
        pair_groups: dict[tuple, list] = {}
        for op in st.mm:
            info = mats[op.out]
            key = (kind[op.left], kind[op.right], kind[op.out])
            if info.algo == "gemm":
                shape = (mats[op.left].pattern.shape, mats[op.right].pattern.shape)
                gemm_groups.setdefault(key + shape, []).append(op)
            elif info.algo == "rows":
                pair_groups.setdefault(("rows",) + key, []).append(op)
            else:
                pair_groups.setdefault(key, []).append(op)
        for key, ops in gemm_groups.items():
            (m, k), (_, p) = key[3], key[4]
            out0 = alloc[key[2]].take(len(ops) * m * p, align=m * p)
            for j, op in enumerate(ops):
                offset[op.out] = out0 + j * m * p
            pending.append((pstep, "gemm", (key, ops, out0)))
        for key, ops in pair_groups.items():
            rows = key[0] == "rows"
            kinds = key[1:] if rows else key
            for op in ops:
                pat = mats[op.out].pattern
                # dense outputs are block-aligned so later GEMMs view them without an index
                offset[op.out] = alloc[kinds[2]].take(pat.nnz, align=pat.nnz if pat.is_full else 1)
            pending.append((pstep, "rows" if rows else "spmm", (kinds, ops)))
        # --- matrix-vector products: GEMV groups by (kind, shape); sparse by matrix kind. A dropped
        # mat-vec is laid out as if computed (the slots of the others stay where they are)
        gemv_groups: dict[tuple, list] = {}
        spmv_groups: dict[str, list] = {}
        for op in st.mv:
            p = mats[op.mat].pattern
            how = mv_kind(op, st.phase, p, n, operators, drop_out)
            if how is None:
                dropped.add(op.out)
                how = mv_kind(op, st.phase, p, n, operators, None)
            if how == "apply":
                vec(op.out, p.rows)
                if op.out not in dropped:
                    pending.append((pstep, "apply", op))
            elif how == "gemv":
                gemv_groups.setdefault((kind[op.mat], p.shape), []).append(op)
            elif how == "spmv":
                spmv_groups.setdefault(kind[op.mat], []).append(op)
        for key, ops in gemv_groups.items():
            m = key[1][0]
            out0 = valloc.take(len(ops) * m)
            for j, op in enumerate(ops):
                vdim[op.out] = m
                voff[op.out] = out0 + j * m
            if ops[-1].out in dropped:  # outputs stay contiguous from out0 (one left out elsewhere is computed)
                ops = ops[:-1]
            dropped.difference_update(o.out for o in ops)
            if ops:
                pending.append((pstep, "gemv", (key, ops, out0)))
        for key, ops in spmv_groups.items():
            for op in ops:
                vec(op.out, mats[op.mat].pattern.rows)
            ops = [op for op in ops if op.out not in dropped]
            if ops:
                pending.append((pstep, "spmv", (key, ops)))
        steps.append(pstep)

    zero = {SHARED: alloc[SHARED].take(1), SAMPLE: alloc[SAMPLE].take(1)}
    zero_v = valloc.take(1)
    lay = Layout(sched, shared, has_extra, operators, kind, offset, input_offsets, voff, vdim, extra_slots, dropped,
                 steps, [], zero, zero_v, alloc[SHARED].size, alloc[SAMPLE].size, valloc.size, period)
    lay.pending = [(pstep, what, payload, _table_key(lay, mats, n, what, payload)) for pstep, what, payload in pending]
    return lay


def _checked_period(period: int, n: int, shared: Sequence[bool], pats) -> int:
    """``period`` when the chain repeats with it (layer ``i``'s pattern and sharedness are layer
    ``i - period``'s), else a ``ValueError``; 0 stays 0."""
    period = int(period)
    if period == 0:
        return 0
    if period < 0 or n % period:
        raise ValueError(f"period: expected 0 or a positive divisor of the chain's {n} layers, got {period}")
    for i in range(period, n):
        if shared[i] != shared[i - period] or pats[i].key != pats[i - period].key:
            raise ValueError(f"period={period}: layer {i + 1} differs from layer {i + 1 - period} in pattern or "
                             f"sharedness; the values cannot repeat with this period")
    return period


def _table_key(lay: Layout, mats, n: int, what: str, payload) -> Optional[tuple]:
    """Everything the table of one pending item depends on (matrices by identity, slots by value)."""
    offset, voff, kind = lay.offset, lay.voff, lay.kind
    if what == "gemm":
        key, ops, out0 = payload
        return (what, key, out0, tuple(offset[o.left] for o in ops), tuple(offset[o.right] for o in ops))
    if what == "rows":
        key, ops = payload
        return (what, key, tuple((id(mats[o.left].pattern), id(mats[o.right].pattern), id(mats[o.out].pattern),
                                  offset[o.left], offset[o.right], offset[o.out]) for o in ops))
    if what == "spmm":
        key, ops = payload
        return (what, key, lay.zero[key[0]], lay.zero[key[1]],
                tuple((id(mats[o.out]), offset[o.left], offset[o.right], offset[o.out]) for o in ops))
    if what == "run":
        ops = payload
        return (what, voff[ops[0].vin], tuple((id(mats[o.mat].pattern), kind[o.mat], offset[o.mat], o.mat if o.mat < n else -1,
                                               -1 if o.add is None else voff[o.add], voff[o.out]) for o in ops))
    if what == "gemv":
        key, ops, out0 = payload
        return (what, key, out0, lay.zero_v, tuple((offset[o.mat], voff[o.vin], -1 if o.add is None else voff[o.add])
                                                   for o in ops))
    if what == "spmv":
        key, ops = payload
        return (what, key, lay.zero[key], lay.zero_v,
                tuple((id(mats[o.mat].pattern), offset[o.mat], voff[o.vin], voff[o.out],
                       -1 if o.add is None else voff[o.add]) for o in ops))
    return None  # "apply": no table


def lower(plan: ScanPlan, shared: Sequence[bool], has_extra: Sequence[bool],
          operators: Optional[Sequence[bool]] = None, first_output: bool = True,
          cache: Optional[LoweringCache] = None, period: int = 0) -> Program:
    """Lay out arenas and build every step's work tables for one value signature.

    ``operators[i]``: layer ``i+1`` comes as a structured operator (it applies ``J^T`` itself); its
    mat-vecs become :class:`Apply` ops and its CSR values get arena slots only if a planned product
    reads them. ``first_output=False``: ``dl/dx_0`` is not wanted, and the linear scan's last
    mat-vec, which only produces it, is left out. ``cache``: the plan's :class:`LoweringCache`; a
    table another binding of the plan already built (same key) is reused, not rebuilt. ``period``:
    the values repeat with this period (see :func:`layout`).
    """
    n = plan.n
    lay = layout(plan, shared, has_extra, operators, first_output, period)
    cache = LoweringCache() if cache is None else cache
    mats = plan.mats
    pats = plan.patterns
    sched, kind, offset, voff, vdim = lay.sched, lay.kind, lay.offset, lay.voff, lay.vdim
    zero, zero_v = lay.zero, lay.zero_v
    reduce = sched.kind == "reduce"

    for pstep, what, payload, key in lay.pending:
        if what == "gemm":
            def build(payload=payload):
                gkey, ops, out0 = payload
                (m, k), (_, p) = gkey[3], gkey[4]
                a = BlockRef(m, k, np.array([offset[o.left] for o in ops], dtype=np.int64))
                b = BlockRef(k, p, np.array([offset[o.right] for o in ops], dtype=np.int64))
                return Gemm(gkey[0], gkey[1], gkey[2], a, b, out0)
        elif what == "rows":
            def build(payload=payload):
                gkey, ops = payload
                prods = [RowProduct(mats[op.left].pattern, mats[op.right].pattern, mats[op.out].pattern,
                                    offset[op.left], offset[op.right], offset[op.out]) for op in ops]
                return RowSpGEMM(gkey[0], gkey[1], gkey[2], prods)
        elif what == "spmm":
            def build(payload=payload):
                gkey, ops = payload
                lens, firsts, a_src, b_src, outs, clear = [], [], [], [], [], []
                base = 0
                for op in ops:
                    info = mats[op.out]
                    sym = info.sym
                    lens.append(np.diff(sym.pair_ptr))
                    firsts.append(sym.pair_ptr[:-1] + base)
                    a_src.append(sym.pair_a + offset[op.left])
                    b_src.append(sym.pair_b + offset[op.right])
                    if info.scatters:
                        outs.append(offset[op.out] + dense_positions(sym.pattern))
                        clear.append((offset[op.out], info.pattern.nnz))
                    else:
                        outs.append(offset[op.out] + np.arange(sym.pattern.nnz, dtype=np.int64))
                    base += sym.npairs
                bins = _binned(np.concatenate(lens), np.concatenate(firsts), np.concatenate(a_src),
                               np.concatenate(b_src), np.concatenate(outs), None, zero[gkey[0]], zero[gkey[1]])
                return SpMM(gkey[0], gkey[1], gkey[2], bins, tuple(clear))
        elif what == "run":
            def build(ops=payload):
                pats_ = [mats[o.mat].pattern for o in ops]
                csr_ids: dict[str, int] = {}  # distinct CSR patterns, by key, in order of first use
                for p in pats_:
                    if linear_run_kind(p, plan.profile) == "sparse":
                        csr_ids.setdefault(p.key, len(csr_ids))
                by_key = {p.key: p for p in pats_}
                return LinearRun(
                    dense=np.array([p.is_full for p in pats_], dtype=bool),
                    shared=np.array([kind[o.mat] == SHARED for o in ops], dtype=bool),
                    rows=np.array([p.rows for p in pats_], dtype=np.int64),
                    cols=np.array([p.cols for p in pats_], dtype=np.int64),
                    mat_offset=np.array([offset[o.mat] for o in ops], dtype=np.int64),
                    layers=np.array([o.mat if o.mat < n else -1 for o in ops], dtype=np.int64),
                    vin0=voff[ops[0].vin],
                    add=np.array([voff[o.add] if o.add is not None else -1 for o in ops], dtype=np.int64),
                    out=np.array([voff[o.out] for o in ops], dtype=np.int64),
                    pattern=np.array([csr_ids.get(p.key, -1) for p in pats_], dtype=np.int64),
                    csr=tuple(by_key[k] for k in csr_ids),
                )
        elif what == "apply":
            def build(op=payload):
                p = mats[op.mat].pattern
                return Apply(op.mat, p.rows, p.cols, voff[op.vin], voff[op.out], -1 if op.add is None else voff[op.add])
        elif what == "gemv":
            def build(payload=payload):
                gkey, ops, out0 = payload
                m, k = gkey[1]
                mref = BlockRef(m, k, np.array([offset[o.mat] for o in ops], dtype=np.int64))
                vin = np.array([voff[o.vin] for o in ops], dtype=np.int64)[:, None] + np.arange(k)
                add = np.array([voff[o.add] if o.add is not None else -1 for o in ops], dtype=np.int64)
                add_idx = np.where(add[:, None] >= 0, add[:, None] + np.arange(m), zero_v)
                return Gemv(gkey[0], mref, vin, add_idx, out0)
        else:
            def build(payload=payload):
                gkey, ops = payload
                lens, firsts, a_src, b_src, outs, adds = [], [], [], [], [], []
                base = 0
                for op in ops:
                    pat = mats[op.mat].pattern
                    lens.append(pat.row_lengths())
                    firsts.append(pat.indptr[:-1] + base)
                    a_src.append(offset[op.mat] + np.arange(pat.nnz, dtype=np.int64))
                    b_src.append(voff[op.vin] + pat.indices)
                    outs.append(voff[op.out] + np.arange(pat.rows, dtype=np.int64))
                    if op.add is None:
                        adds.append(np.full(pat.rows, zero_v, dtype=np.int64))
                    else:
                        adds.append(voff[op.add] + np.arange(pat.rows, dtype=np.int64))
                    base += pat.nnz
                bins = _binned(np.concatenate(lens), np.concatenate(firsts), np.concatenate(a_src),
                               np.concatenate(b_src), np.concatenate(outs), np.concatenate(adds),
                               zero[gkey], zero_v)
                return SpMV(gkey, bins)
        pstep.ops.append(cache.get(key, build))

    outputs = [(voff[v], vdim[v]) if v in voff and v not in lay.dropped else (-1, pats[0].rows) for v in sched.outputs]
    root_mat = root_vec = None
    if reduce:
        m, v = sched.root
        root_mat = (kind[m], offset[m], mats[m].pattern.nnz)
        root_vec = None if v is None else (voff[v], vdim[v])
    return Program(
        n=n, shared=lay.shared, has_extra=lay.has_extra,
        size_s=lay.size_s, size_p=lay.size_p, size_v=lay.size_v,
        input_offsets=lay.input_offsets, grad_slot=-1 if reduce else voff[GRAD], extra_slots=lay.extra_slots,
        outputs=outputs, steps=[s for s in lay.steps if s.ops], mat_kind=kind, mat_offset=offset,
        root_mat=root_mat, root_vec=root_vec, operators=lay.operators,
        skipped_first=bool(outputs) and outputs[0][0] < 0, period=lay.period,
    )
