"""Symbolic planning of a whole scan: products per level, dense/sparse storage, depth choice, memory.

Everything here is deterministic index work on the CPU: the same patterns and options give the
same plan on every machine and every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np

from .cost import DeviceProfile
from .patterns import Pattern, PatternTable, full_pattern, make_pattern
from .schedule import ScanSchedule, Step, blelloch_schedule, max_levels
from .rowwise import (RowwiseProduct, estimate_product_nnz, pair_list_bytes, rowwise_symbolic,
                      structural_product)
from .symbolic import ProductSymbolic, product_counts, product_pattern, spgemm_symbolic

__all__ = ["MatInfo", "ScanPlan", "LevelCost", "plan_scan"]

INDEX_BYTES = 8


@dataclass(eq=False)
class MatInfo:
    """How one matrix of the scan is stored and computed (shared by all nodes with the same operands)."""

    pattern: Pattern
    # "input" | "pairs" (gather-multiply-segment-sum) | "gemm" (both operands dense) | "rows" (row-wise
    # over the output pattern, O(nnz) index data: products whose pair lists would be too large)
    algo: str
    sym: Optional[ProductSymbolic] = None
    rw: Optional[RowwiseProduct] = None

    @property
    def dense(self) -> bool:
        return self.pattern.is_full

    gemm_macs: int = 0  # multiply-adds per sample of a "gemm" product

    @property
    def work(self) -> int:
        """Multiply-adds of this product for one sample (0 for inputs)."""
        if self.algo == "pairs":
            return self.sym.npairs
        if self.algo == "rows":
            return self.rw.npairs
        return self.gemm_macs


@dataclass
class LevelCost:
    phase: str
    level: int
    nodes_mm: int
    nodes_mv: int
    nnz: int  # entries produced (matrices) per sample
    flops: int  # 2 * multiply-adds, per sample
    bytes: int  # values + indices touched, per sample for values
    time_s: float


@dataclass
class ScanPlan:
    patterns: list[Pattern]  # per layer (interned objects)
    levels: int
    mats: dict[int, MatInfo]
    schedule: ScanSchedule
    profile: DeviceProfile
    batch_hint: int
    elem_bytes: int
    candidates: dict[int, float] = field(default_factory=dict)  # K -> estimated seconds
    explored: int = 0  # deepest level whose products the depth search costed

    @property
    def n(self) -> int:
        return len(self.patterns)


class _Products:
    """Per-pattern-pair symbolic products, computed once (interned by pattern content).

    A sparse product runs on planned pair lists (O(pairs) index data) unless those would exceed
    ``profile.pair_list_max_bytes``; then it runs row-wise over its output pattern (O(nnz)), and
    its storage — the exact pattern or dense — is chosen by the cost model: the work and bytes of
    the mat-vec that consumes it (:func:`dense_storage_by_cost`). Pair-list products keep the
    profile's ``dense_threshold`` (the rule plan files are checked against).
    """

    def __init__(self, table: PatternTable, profile: DeviceProfile):
        self.table = table
        self.profile = profile
        self.cache: dict[tuple[str, str], MatInfo] = {}
        self._npairs: dict[tuple[str, str], int] = {}

    def npairs(self, a: Pattern, b: Pattern) -> int:
        key = (a.key, b.key)
        hit = self._npairs.get(key)
        if hit is None:
            hit = self._npairs[key] = product_counts(a, b)
        return hit

    def rowwise(self, a: Pattern, b: Pattern) -> bool:
        """Whether ``A @ B`` runs row-wise: sparse, with pair lists over ``profile.pair_list_max_bytes``."""
        if a.is_full and b.is_full:
            return False
        return pair_list_bytes(self.npairs(a, b), 0) > self.profile.pair_list_max_bytes

    def index_estimate(self, a: Pattern, b: Pattern) -> int:
        """Index bytes planning ``A @ B`` builds (the exploration budget's measure), before forming it."""
        if a.is_full and b.is_full:
            return 0
        n = self.npairs(a, b)
        if self.rowwise(a, b):
            nnz_c = min(n, a.rows * b.cols)
            return 8 * (2 * a.nnz + 3 * b.rows + b.nnz + nnz_c + 6 * a.rows)
        return 2 * INDEX_BYTES * n

    def product(self, a: Pattern, b: Pattern) -> MatInfo:
        key = (a.key, b.key)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if a.is_full and b.is_full:
            info = MatInfo(self.table.intern(full_pattern(a.rows, b.cols)), "gemm")
            info.gemm_macs = a.rows * a.cols * b.cols
        elif self.rowwise(a, b):
            m, p = a.rows, b.cols
            # the sampled estimate settles clear dense cases without forming the product's pattern
            dense = dense_storage_by_cost(m, p, estimate_product_nnz(a, b), self.profile)
            if dense:
                out = full_pattern(m, p)
            else:
                out = structural_product(a, b)
                if dense_storage_by_cost(m, p, out.nnz, self.profile):
                    out = full_pattern(m, p)
            rw = rowwise_symbolic(a, b, out=self.table.intern(out))
            info = MatInfo(rw.pattern, "rows", rw=rw)
        else:
            sym = spgemm_symbolic(a, b)
            if sym.pattern.density >= self.profile.dense_threshold and not sym.pattern.is_full:
                sym = spgemm_symbolic(a, b, dense_out=True)
            sym = ProductSymbolic(self.table.intern(sym.pattern), sym.pair_ptr, sym.pair_a, sym.pair_b)
            info = MatInfo(sym.pattern, "pairs", sym=sym)
        self.cache[key] = info
        return info


def dense_storage_by_cost(rows: int, cols: int, nnz: int, profile: DeviceProfile) -> bool:
    """Store a row-wise product densely when the scan's use of it is cheaper that way.

    Every product is consumed by mat-vecs (down-sweep, middle): sparse, ``nnz`` gather-multiply-adds
    at ``pair_rate``; dense, ``rows * cols`` multiply-adds at ``gemv_rate`` plus as many written
    entries (the zeros the product does not reach). Computing it costs the same pairs either way.
    """
    size = rows * cols
    return 2 * size / profile.gemv_rate < nnz / profile.pair_rate


def bin_widths(lengths: np.ndarray) -> np.ndarray:
    """Padded width per segment of a launch: the exact length when there are few distinct
    lengths (conv rows: interior, border and corner counts), else the next power of two (at
    most 2x padding)."""
    widths = np.maximum(lengths, 1)
    if np.unique(widths).size <= 8:
        return widths
    pos = widths > 1
    widths[pos] = 1 << np.ceil(np.log2(widths[pos])).astype(np.int64)
    return widths


_RUN_KIND: dict[str, Optional[str]] = {}
_BINS: dict[tuple[str, int], int] = {}


def linear_run_kind(p: Pattern) -> Optional[str]:
    """How a fused linear run (the scan's middle) takes a matrix of pattern ``p``: ``"dense"``
    (full pattern: a row-major block), ``"diag"`` (the identity pattern: ``m`` scale factors),
    ``"sparse"`` (any other pattern: a CSR step over its ``indptr``/``indices``), or ``None`` (the
    step stays a standalone SpMV; see :func:`_linear_run_kind`)."""
    if p.key in _RUN_KIND:
        return _RUN_KIND[p.key]
    _RUN_KIND[p.key] = kind = _linear_run_kind(p)
    return kind


# Largest pattern (stored entries) a run takes as a CSR step; see :func:`_linear_run_kind`.
RUN_SPARSE_MAX_NNZ = 1 << 16


def _linear_run_kind(p: Pattern) -> Optional[str]:
    """The run kind of one pattern.

    * Full patterns are ``"dense"`` and identity patterns ``"diag"`` (no index read at all).
    * Every other pattern is ``"sparse"``, nearly dense ones included: their values arrive in CSR
      order, so a dense step would need a scatter of the values into a block on every call, while
      the CSR step reads them in place at one index per entry (at most twice the dense step's reads).
    * A sparse pattern with more than :data:`RUN_SPARSE_MAX_NNZ` entries stays out of runs: its
      own work (``nnz * B`` multiply-adds, ~1 ms on one CPU core at ``B = 16``) dwarfs the per-step
      overhead a run removes (microseconds), while a standalone SpMV launch spreads its rows over
      the whole device (a run walks them in one program per block of samples).
    """
    if p.is_full:
        return "dense"
    if (p.rows == p.cols and p.nnz == p.rows and np.array_equal(p.indices, np.arange(p.rows))
            and np.array_equal(p.indptr, np.arange(p.rows + 1))):
        return "diag"
    if p.nnz <= RUN_SPARSE_MAX_NNZ:
        return "sparse"
    return None


def _seg_bins(counts: np.ndarray) -> int:
    """Number of launches (width bins) a set of segment lengths falls into."""
    return int(np.unique(bin_widths(counts)).size) if counts.size else 0


def _row_bins(p: Pattern) -> int:
    """Launches of an SpMV with pattern ``p`` (cached: long chains repeat a few patterns)."""
    key = (p.key, 0)
    if key not in _BINS:
        _BINS[key] = _seg_bins(p.row_lengths())
    return _BINS[key]


def _pair_bins(info: "MatInfo") -> int:
    """Launches of a planned SpGEMM (cached per output pattern and pair count)."""
    key = (info.pattern.key, info.sym.npairs)
    if key not in _BINS:
        _BINS[key] = _seg_bins(np.diff(info.sym.pair_ptr))
    return _BINS[key]


def _step_costs(
    sched: ScanSchedule, mats: dict[int, MatInfo], profile: DeviceProfile, batch: int, elem: int
) -> list[LevelCost]:
    out = []
    for st in sched.steps:
        pairs = gemm = gemv = 0
        launches = 0
        nnz = 0
        nbytes = 0
        bins_pairs = 0
        gemm_shapes = set()
        for op in st.mm:
            info = mats[op.out]
            nnz += info.pattern.nnz
            if info.algo == "gemm":
                gemm += info.gemm_macs
                l, r = mats[op.left].pattern, mats[op.right].pattern
                gemm_shapes.add((l.shape, r.shape))
                nbytes += (l.nnz + r.nnz + info.pattern.nnz) * elem
            elif info.algo == "rows":  # one launch per step; indices O(nnz), read once per sample block
                pairs += info.rw.npairs
                bins_pairs = max(bins_pairs, 1)
                nbytes += info.rw.npairs * 2 * elem + info.pattern.nnz * elem + info.rw.index_bytes
            else:
                pairs += info.sym.npairs
                bins_pairs = max(bins_pairs, _pair_bins(info))
                nbytes += info.sym.npairs * (2 * elem + 2 * INDEX_BYTES) + info.pattern.nnz * elem
        mv_sparse = mv_dense = 0
        mv_bins = 0
        gemv_shapes = set()
        for op in st.mv:
            p = mats[op.mat].pattern
            if p.is_full:
                gemv += p.nnz
                gemv_shapes.add(p.shape)
                mv_dense += 1
            else:
                mv_sparse += p.nnz
                mv_bins = max(mv_bins, _row_bins(p))
            nbytes += p.nnz * (elem + (0 if p.is_full else 2 * INDEX_BYTES)) + p.rows * elem
        launches = bins_pairs + len(gemm_shapes) + mv_bins + len(gemv_shapes)
        if st.phase == "mid" and len(st.mv) == 1 and linear_run_kind(mats[st.mv[0].mat].pattern):
            launches = 0  # a step of a fused linear run: no launch of its own
            t = profile.chain_step_s
        else:
            t = 0.0
        t += launches * profile.op_overhead_s
        t += batch * (pairs + mv_sparse) / profile.pair_rate
        t += batch * gemm / profile.gemm_rate + batch * gemv / profile.gemv_rate
        flops = 2 * (pairs + gemm + mv_sparse + gemv)
        out.append(LevelCost(st.phase, st.level, len(st.mm), len(st.mv), nnz, flops, nbytes, t))
    return out


class _PairCounts:
    """The cost-relevant half of a :class:`ProductSymbolic`: pattern and pairs per entry, no pair lists."""

    __slots__ = ("pattern", "pair_ptr", "npairs")

    def __init__(self, pattern: Pattern, counts: np.ndarray):
        self.pattern = pattern
        self.pair_ptr = np.zeros(counts.size + 1, dtype=np.int64)
        np.cumsum(counts, out=self.pair_ptr[1:])
        self.npairs = int(self.pair_ptr[-1])


class _DepthSearch:
    """Symbolic state of ``levels="auto"``: what the cost model needs, computed only as far as needed.

    A product is first known by its pair count (:func:`product_counts`, O(nnz(A))), which bounds
    its level's cost from below; then by its pattern and pairs per entry
    (:func:`~.symbolic.product_pattern`, compiled, no pair lists), which gives the cost model's
    exact inputs: the same output pattern, storage and pair count as :meth:`_Products.product`.
    Pair lists are built only for the depth finally chosen.
    """

    def __init__(self, products: _Products):
        self.products = products
        self.counts: dict[tuple[str, str], int] = {}
        self.cache: dict[tuple[str, str], MatInfo] = {}

    def npairs(self, a: Pattern, b: Pattern) -> int:
        key = (a.key, b.key)
        hit = self.counts.get(key)
        if hit is None:
            hit = self.counts[key] = product_counts(a, b)
        return hit

    def product(self, a: Pattern, b: Pattern) -> MatInfo:
        """``MatInfo`` of ``A @ B`` equal to ``_Products.product`` in pattern, algo and pairs per entry."""
        key = (a.key, b.key)
        hit = self.cache.get(key) or self.products.cache.get(key)
        if hit is not None:
            return hit
        if (a.is_full and b.is_full) or self.products.rowwise(a, b):
            info = self.products.product(a, b)  # a GEMM or a row-wise product plans no pair lists: as cheap
        else:
            indptr, indices, counts = product_pattern(a, b)
            pattern = make_pattern((a.rows, b.cols), indptr, indices)
            if pattern.density >= self.products.profile.dense_threshold and not pattern.is_full:
                dense = np.zeros(a.rows * b.cols, dtype=np.int64)
                dense[np.repeat(np.arange(a.rows, dtype=np.int64), np.diff(indptr)) * b.cols + indices] = counts
                pattern, counts = full_pattern(a.rows, b.cols), dense
            pattern = self.products.table.intern(pattern)
            info = MatInfo(pattern, "pairs", sym=_PairCounts(pattern, counts))
        self.cache[key] = info
        return info

    def index_bytes(self, step: Step, mats: dict[int, MatInfo], budget: float) -> int:
        """Pair-index bytes of one up-sweep level's sparse products (the exploration budget's measure)."""
        est = 0
        for op in step.mm:
            a, b = mats[op.left].pattern, mats[op.right].pattern
            est += self.products.index_estimate(a, b)
            if est > budget:
                break
        return est

    def level_lower_bound(self, step: Step, mats: dict[int, MatInfo], profile: DeviceProfile,
                          batch: int) -> float:
        """A lower bound of :func:`_step_costs` for an up-sweep level whose products are not planned.

        Exact in every term but the number of SpGEMM launches, counted as one (the exact count,
        the number of width bins of the pairs per entry, is at least one).
        """
        pairs = gemm = gemv = mv_sparse = 0
        gemm_shapes = set()
        gemv_shapes = set()
        mv_bins = 0
        for op in step.mm:
            a, b = mats[op.left].pattern, mats[op.right].pattern
            if a.is_full and b.is_full:
                gemm += a.rows * a.cols * b.cols
                gemm_shapes.add((a.shape, b.shape))
            else:
                pairs += self.npairs(a, b)
        for op in step.mv:
            p = mats[op.mat].pattern
            if p.is_full:
                gemv += p.nnz
                gemv_shapes.add(p.shape)
            else:
                mv_sparse += p.nnz
                mv_bins = max(mv_bins, _row_bins(p))
        launches = (1 if pairs else 0) + len(gemm_shapes) + mv_bins + len(gemv_shapes)
        t = 0.0
        t += launches * profile.op_overhead_s
        t += batch * (pairs + mv_sparse) / profile.pair_rate
        t += batch * gemm / profile.gemm_rate + batch * gemv / profile.gemv_rate
        return t


class _Steps(NamedTuple):
    steps: list[Step]


def _costs_of(steps: Sequence[Step], mats: dict[int, MatInfo], profile: DeviceProfile, batch: int,
              elem: int) -> list[LevelCost]:
    return _step_costs(_Steps(list(steps)), mats, profile, batch, elem)  # type: ignore[arg-type]


def _planned_mats(sched: ScanSchedule, levels: int, pats: list[Pattern], products: _Products,
                  profile: DeviceProfile, what: str,
                  advice: str = "choose fewer levels") -> dict[int, MatInfo]:
    """Inputs and the products of the first ``levels`` up-sweep levels, with their pair lists.

    ``what`` names the request in the error raised when a level's pair indices exceed the budget.
    """
    mats: dict[int, MatInfo] = {i: MatInfo(p, "input") for i, p in enumerate(pats)}
    for d, st in enumerate(sched.steps[:levels]):
        est_bytes = 0
        for op in st.mm:
            a, b = mats[op.left].pattern, mats[op.right].pattern
            est_bytes += products.index_estimate(a, b)
            if est_bytes > profile.bytes_budget:
                raise ValueError(
                    f"{what}: up-sweep level {d} needs ~{est_bytes / 2**30:.1f} GiB of product index data, over the "
                    f"planning budget of {profile.bytes_budget / 2**30:.1f} GiB; {advice}"
                )
        for op in st.mm:
            mats[op.out] = products.product(mats[op.left].pattern, mats[op.right].pattern)
    return {i: mats[i] for i in range(sched.num_mats) if i in mats}


def plan_scan(
    patterns: Sequence[Pattern],
    levels: Union[str, int],
    profile: DeviceProfile,
    batch_hint: int = 16,
    elem_bytes: int = 4,
    memory_limit: Optional[float] = None,
    memory_of=None,
) -> ScanPlan:
    """Plan the products of every up-sweep level needed and choose the depth ``K``.

    ``levels``: ``"auto"`` (minimum estimated critical-path time among the depths whose symbolic
    products fit the exploration budget and ``memory_limit``), an int (clamped to the chain's
    maximum depth) or ``"full"``. ``memory_of(plan) -> bytes`` evaluates a candidate's peak.

    ``"auto"`` evaluates ``K = 0, 1, ...`` in order and stops at the first depth that cannot win:
    its up-sweep alone (bounded below from pair counts before the level's products are
    formed) costs at least the best estimate so far, the estimate has risen twice, or the level's
    pair indices exceed the budget. Candidates are costed from product patterns and pair counts;
    pair lists are built only for the depth chosen.
    """
    n = len(patterns)
    table = PatternTable()
    pats = [table.intern(p) for p in patterns]
    kmax = max_levels(n)
    products = _Products(table, profile)
    if levels != "auto":
        k = kmax if levels == "full" else min(int(levels), kmax)
        sched = blelloch_schedule(n, k)
        mats = _planned_mats(sched, k, pats, products, profile, f"levels={levels}")
        costs = _costs_of(sched.steps, mats, profile, batch_hint, elem_bytes)
        up = 0.0
        for c in costs[:k]:
            up += c.time_s
        plan = ScanPlan(pats, k, mats, sched, profile, batch_hint, elem_bytes)
        plan.candidates = {k: up + sum(c.time_s for c in costs[k:])}
        plan.explored = k
        return plan

    search = _DepthSearch(products)
    mats: dict[int, MatInfo] = {i: MatInfo(p, "input") for i, p in enumerate(pats)}
    candidates: dict[int, float] = {}
    best: Optional[tuple[int, ScanSchedule]] = None
    up_cost = [0.0]  # cumulative cost of the first K up-sweep levels (the same for every depth)
    worse = 0
    explored = 0
    for k in range(kmax + 1):
        sched = blelloch_schedule(n, k)
        if k > 0:
            if best is not None and worse >= 2:
                break  # the cost has turned up twice
            level = sched.steps[k - 1]
            if search.index_bytes(level, mats, profile.bytes_budget) > profile.bytes_budget:
                break  # this level's fill-in is never expanded symbolically
            if best is not None and (up_cost[-1] + search.level_lower_bound(level, mats, profile, batch_hint)
                                     >= candidates[best[0]]):
                break  # deeper plans only add up-sweep work: none can win
            for op in level.mm:
                mats[op.out] = search.product(mats[op.left].pattern, mats[op.right].pattern)
            explored = k
            up_cost.append(up_cost[-1] + _costs_of([level], mats, profile, batch_hint, elem_bytes)[0].time_s)
            if best is not None and up_cost[k] >= candidates[best[0]]:
                break
        sub = {i: mats[i] for i in range(sched.num_mats) if i in mats}
        t = up_cost[k] + sum(c.time_s for c in _costs_of(sched.steps[k:], sub, profile, batch_hint, elem_bytes))
        if memory_limit is not None and memory_of is not None:
            if memory_of(ScanPlan(pats, k, sub, sched, profile, batch_hint, elem_bytes)) > memory_limit:
                continue
        candidates[k] = t
        if best is None or t < candidates[best[0]]:
            best = (k, sched)
            worse = 0
        else:
            worse += 1
    if best is None:
        k, sched = 0, blelloch_schedule(n, 0)
        mats0 = {i: mats[i] for i in range(n)}
        candidates[0] = sum(c.time_s for c in _costs_of(sched.steps, mats0, profile, batch_hint, elem_bytes))
    else:
        k, sched = best
    plan = ScanPlan(pats, k, _planned_mats(sched, k, pats, products, profile, "levels=auto"), sched, profile,
                    batch_hint, elem_bytes)
    plan.candidates = candidates
    plan.explored = explored
    return plan


def step_costs(plan: ScanPlan) -> list[LevelCost]:
    return _step_costs(plan.schedule, plan.mats, plan.profile, plan.batch_hint, plan.elem_bytes)



def plan_reduction(
    patterns: Sequence[Pattern],
    profile: DeviceProfile,
    batch_hint: int = 16,
    elem_bytes: int = 4,
) -> ScanPlan:
    """Plan the composite of a whole chain, ``J_1^T J_2^T ... J_n^T`` (and its affine term), by the
    pairwise product tree of :func:`~spscan.planner.schedule.reduction_schedule`.

    The products are planned exactly as up-sweep products (same symbolic SpGEMM, same storage
    rule, interned patterns), so a model-parallel slice reduction runs on the same engine as a
    scan. Raises ``ValueError`` when a level's pair indices exceed the device profile's budget.
    """
    from .schedule import reduction_schedule

    table = PatternTable()
    pats = [table.intern(p) for p in patterns]
    sched = reduction_schedule(len(pats))
    products = _Products(table, profile)
    mats = _planned_mats(sched, sched.levels, pats, products, profile, f"composite of {len(pats)} layers",
                         "cut the chain where the composites stay small")
    plan = ScanPlan(pats, sched.levels, mats, sched, profile, batch_hint, elem_bytes)
    plan.explored = sched.levels
    return plan


def composite_pattern(plan: ScanPlan) -> Pattern:
    """The stored pattern of a reduction plan's composite matrix."""
    if plan.schedule.kind != "reduce":
        raise ValueError("composite_pattern: expected a reduction plan (plan_reduction), got a scan plan")
    return plan.mats[plan.schedule.root[0]].pattern
