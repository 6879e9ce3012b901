"""Symbolic planning of a whole scan: products per level, dense/sparse storage, depth choice, memory.

Everything here is deterministic index work on the CPU: the same patterns and options give the
same plan on every machine and every rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np

from .cost import DeviceProfile
from .patterns import Pattern, PatternTable, full_pattern
from .schedule import ScanSchedule, blelloch_schedule, max_levels
from .symbolic import ProductSymbolic, product_counts, spgemm_symbolic

__all__ = ["MatInfo", "ScanPlan", "LevelCost", "plan_scan"]

INDEX_BYTES = 8


@dataclass(eq=False)
class MatInfo:
    """How one matrix of the scan is stored and computed (shared by all nodes with the same operands)."""

    pattern: Pattern
    algo: str  # "input" | "pairs" (gather-multiply-segment-sum) | "gemm" (both operands dense)
    sym: Optional[ProductSymbolic] = None

    @property
    def dense(self) -> bool:
        return self.pattern.is_full

    gemm_macs: int = 0  # multiply-adds per sample of a "gemm" product

    @property
    def work(self) -> int:
        """Multiply-adds of this product for one sample (0 for inputs)."""
        if self.algo == "pairs":
            return self.sym.npairs
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
    explored: int = 0  # deepest level whose products were planned

    @property
    def n(self) -> int:
        return len(self.patterns)


class _Products:
    """Per-pattern-pair symbolic products, computed once (interned by pattern content)."""

    def __init__(self, table: PatternTable, profile: DeviceProfile):
        self.table = table
        self.profile = profile
        self.cache: dict[tuple[str, str], MatInfo] = {}

    def product(self, a: Pattern, b: Pattern) -> MatInfo:
        key = (a.key, b.key)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if a.is_full and b.is_full:
            info = MatInfo(self.table.intern(full_pattern(a.rows, b.cols)), "gemm")
            info.gemm_macs = a.rows * a.cols * b.cols
        else:
            sym = spgemm_symbolic(a, b)
            if sym.pattern.density >= self.profile.dense_threshold and not sym.pattern.is_full:
                sym = spgemm_symbolic(a, b, dense_out=True)
            sym = ProductSymbolic(self.table.intern(sym.pattern), sym.pair_ptr, sym.pair_a, sym.pair_b)
            info = MatInfo(sym.pattern, "pairs", sym=sym)
        self.cache[key] = info
        return info


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


_CHAIN_KIND: dict[str, Optional[str]] = {}
_BINS: dict[tuple[str, int], int] = {}


def chain_kind(p: Pattern) -> Optional[str]:
    """``"dense"`` / ``"diag"`` for matrices the fused middle chain takes, else ``None``."""
    if p.key in _CHAIN_KIND:
        return _CHAIN_KIND[p.key]
    _CHAIN_KIND[p.key] = kind = _chain_kind(p)
    return kind


def _chain_kind(p: Pattern) -> Optional[str]:
    if p.is_full:
        return "dense"
    if (p.rows == p.cols and p.nnz == p.rows and np.array_equal(p.indices, np.arange(p.rows))
            and np.array_equal(p.indptr, np.arange(p.rows + 1))):
        return "diag"
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
        if st.phase == "mid" and len(st.mv) == 1 and chain_kind(mats[st.mv[0].mat].pattern):
            launches = 0  # a step of the fused middle chain: no launch of its own
            t = profile.chain_step_s
        else:
            t = 0.0
        t += launches * profile.op_overhead_s
        t += batch * (pairs + mv_sparse) / profile.pair_rate
        t += batch * gemm / profile.gemm_rate + batch * gemv / profile.gemv_rate
        flops = 2 * (pairs + gemm + mv_sparse + gemv)
        out.append(LevelCost(st.phase, st.level, len(st.mm), len(st.mv), nnz, flops, nbytes, t))
    return out


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
    """
    n = len(patterns)
    table = PatternTable()
    pats = [table.intern(p) for p in patterns]
    kmax = max_levels(n)
    if levels == "full":
        wanted: Optional[int] = kmax
    elif levels == "auto":
        wanted = None
    else:
        wanted = min(int(levels), kmax)
    deepest = kmax if wanted is None else wanted

    products = _Products(table, profile)
    full = blelloch_schedule(n, deepest)
    mats: dict[int, MatInfo] = {i: MatInfo(p, "input") for i, p in enumerate(pats)}
    explored = 0
    for d, st in enumerate(full.steps[:deepest]):
        # Cheap pre-check so a level whose fill-in explodes is never expanded symbolically.
        est_bytes = 0
        for op in st.mm:
            a, b = mats[op.left].pattern, mats[op.right].pattern
            if not (a.is_full and b.is_full):
                est_bytes += 2 * INDEX_BYTES * product_counts(a, b)
            if est_bytes > profile.bytes_budget:
                break
        if est_bytes > profile.bytes_budget and wanted is None:
            break
        if est_bytes > profile.bytes_budget:
            raise ValueError(
                f"levels={levels}: up-sweep level {d} needs ~{est_bytes / 2**30:.1f} GiB of pair "
                f"indices (budget {profile.bytes_budget / 2**30:.1f} GiB); choose fewer levels"
            )
        for op in st.mm:
            mats[op.out] = products.product(mats[op.left].pattern, mats[op.right].pattern)
        explored = d + 1

    candidates: dict[int, float] = {}
    chosen_plan = None
    ks = range(explored + 1) if wanted is None else [wanted]
    up_cost = [0.0]  # cumulative cost of the first K up-sweep levels (the same for every depth)
    for c in _step_costs(ScanSchedule(n, deepest, full.steps[:explored], {}, [], 0, 0), mats, profile,
                         batch_hint, elem_bytes):
        up_cost.append(up_cost[-1] + c.time_s)
    worse = 0
    for k in ks:
        if wanted is None and chosen_plan is not None and (up_cost[k] >= candidates[chosen_plan.levels] or worse >= 2):
            break  # deeper plans only add up-sweep work, or the cost has turned up twice: none can win
        sched = blelloch_schedule(n, k)
        sub = {i: mats[i] for i in range(sched.num_mats) if i in mats}
        plan = ScanPlan(pats, k, sub, sched, profile, batch_hint, elem_bytes)
        rest = ScanSchedule(n, k, sched.steps[k:], {}, [], 0, 0)  # middle and down-sweep
        t = up_cost[k] + sum(c.time_s for c in _step_costs(rest, sub, profile, batch_hint, elem_bytes))
        if memory_limit is not None and memory_of is not None and wanted is None:
            if memory_of(plan) > memory_limit:
                continue
        candidates[k] = t
        if chosen_plan is None or t < candidates[chosen_plan.levels]:
            chosen_plan = plan
            worse = 0
        else:
            worse += 1
    if chosen_plan is None:
        chosen_plan = ScanPlan(pats, 0, {i: mats[i] for i in range(n)}, blelloch_schedule(n, 0), profile,
                               batch_hint, elem_bytes)
        candidates[0] = sum(c.time_s for c in _step_costs(chosen_plan.schedule, chosen_plan.mats, profile,
                                                          batch_hint, elem_bytes))
    chosen_plan.candidates = candidates
    chosen_plan.explored = explored
    return chosen_plan


def step_costs(plan: ScanPlan) -> list[LevelCost]:
    return _step_costs(plan.schedule, plan.mats, plan.profile, plan.batch_hint, plan.elem_bytes)

