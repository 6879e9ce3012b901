"""Symbolic planning of a whole scan: products per level, dense/sparse storage by cost, depth choice.

Everything here is deterministic index work on the CPU: the same patterns and options give the
same plan on every machine and every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from .cost import DeviceProfile
from .patterns import FullPattern, Pattern, PatternTable, full_pattern, make_pattern
from .recurrence import CHUNK_SCALE as RECURRENCE_CHUNK_SCALE, periodic_structure
from .schedule import MMOp, ScanSchedule, Step, blelloch_schedule, max_levels
from .rowwise import (RowwiseProduct, estimate_product_nnz, pair_list_bytes, rowwise_symbolic,
                      structural_product)
from .symbolic import ProductSymbolic, product_counts, product_pattern, spgemm_symbolic

__all__ = ["MatInfo", "ScanPlan", "LevelCost", "StorageRule", "Uses", "matrix_uses", "plan_scan"]

INDEX_BYTES = 8


@dataclass(eq=False)
class MatInfo:
    """How one matrix of the scan is stored and computed (shared by all nodes with the same operands)."""

    # the stored pattern: the product's own pattern, or the full one when stored densely (a FullPattern:
    # its shape only, no index arrays held)
    pattern: Pattern
    # "input" | "pairs" (gather-multiply-segment-sum) | "gemm" (both operands dense) | "rows" (row-wise
    # over the output pattern, O(nnz) index data: products whose pair lists would be too large)
    algo: str
    # "pairs": the pair lists over the product's OWN pattern (``sym.pattern``), also when it is stored
    # densely: then each own entry lands at its dense position (:func:`dense_positions`) and the rest of
    # the dense block is zero, so the pair data stays O(pairs + nnz(own)), not O(rows * cols)
    sym: Optional[ProductSymbolic] = None
    rw: Optional[RowwiseProduct] = None

    @property
    def dense(self) -> bool:
        return self.pattern.is_full

    gemm_macs: int = 0  # multiply-adds per sample of a "gemm" product
    # the storage rule stored this product densely although its own pattern is not full
    densified: bool = False

    @property
    def scatters(self) -> bool:
        """A pair-list product stored densely over an own pattern that is not full: its own entries are
        written at their dense positions and the rest of the block is zeroed."""
        return self.algo == "pairs" and self.sym.pattern.nnz != self.pattern.nnz

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


class Uses(NamedTuple):
    """What reads one matrix of a schedule: the phases of its mat-vecs, and the product that takes it."""

    mv: tuple[str, ...]
    mm: Optional[MMOp]


def matrix_uses(sched: ScanSchedule) -> dict[int, Uses]:
    """Readers of every matrix of ``sched`` (up-sweep products, middle and down-sweep mat-vecs).

    Each matrix is an operand of at most one product. The composite of a reduction schedule counts
    one mat-vec (``"root"``): whatever takes the composite applies it to vectors.
    """
    mv: dict[int, list[str]] = {}
    mm: dict[int, MMOp] = {}
    for st in sched.steps:
        for op in st.mm:
            mm[op.left] = op
            mm[op.right] = op
        for op in st.mv:
            mv.setdefault(op.mat, []).append(st.phase)
    if sched.kind == "reduce" and sched.root is not None and sched.root[0] is not None:
        mv.setdefault(sched.root[0], []).append("root")
    return {m: Uses(tuple(mv.get(m, ())), mm.get(m)) for m in set(mv) | set(mm)}


_NO_USES = Uses((), None)


class StorageRule:
    """Dense-or-sparse storage of a planned product, chosen by the cost of what consumes it.

    A product ``X`` with its own pattern of ``s`` entries out of ``S = rows * cols`` is stored either
    with that pattern (CSR) or densely (the full pattern; entries no pair reaches are computed
    zeros). Computing ``X`` takes the same multiply-adds either way. What differs, in the cost
    model's units (seconds for ``batch`` samples at the device profile's rates):

    * writing it: ``s`` or ``S`` entries (at ``gemv_rate``, a streaming rate);
    * each mat-vec that reads it (down-sweep, middle, spine): ``s`` gather-multiply-adds at
      ``pair_rate`` or ``S`` multiply-adds at ``gemv_rate``; in the middle, a fused linear-run
      step or a launch of its own (:func:`linear_run_kind`);
    * the product ``P`` that takes ``X`` as an operand (one level up, if the depth has it): a dense
      operand's pattern is full, so ``P`` has ``rows(X) * nnz(R)`` pairs (``X`` on the left) or
      ``nnz(L) * cols(X)`` (on the right) instead of the pair count of the two sparse patterns, and
      a GEMM at ``gemm_rate`` when both operands are dense.

    The two operands of ``P`` are decided together (at most four combinations); a product no
    planned product reads is decided by its own writes and mat-vecs. Ties go to the sparse storage.
    ``profile.dense_threshold``, when set, overrides the cost model: dense exactly when the own
    pattern's density is at least the threshold (the rule of plan file version 2).
    """

    def __init__(self, profile: DeviceProfile, batch: int):
        self.profile = profile
        self.batch = max(1, int(batch))

    def _reads(self, x: Optional[Pattern], nnz: int, size: int, dense: bool, mv: Sequence[str]) -> float:
        """Writing ``X`` and the mat-vecs ``mv`` reading it; ``x`` its own pattern (``None``: only ``nnz`` known)."""
        pr, b = self.profile, self.batch
        t = b * (size if dense else nnz) / pr.gemv_rate
        for phase in mv:
            if dense:
                t += b * size / pr.gemv_rate
            else:
                t += b * nnz / pr.pair_rate
            if phase == "mid":  # one mat-vec per middle step: a fused run step, or a launch of its own
                kind = "dense" if dense else (linear_run_kind(x, pr) if x is not None else None)
                if kind is not None:
                    t += pr.run_step_s(kind)
                else:
                    t += pr.op_overhead_s * (_row_bins(x) if x is not None else 1)
        return t

    def _threshold(self, nnz: int, size: int) -> bool:
        return nnz < size and nnz >= self.profile.dense_threshold * size

    def alone(self, shape: tuple[int, int], own: Optional[Pattern], nnz: int, mv: Sequence[str]) -> bool:
        """Whether a product read by no planned product (only by the mat-vecs ``mv``) is stored densely."""
        size = shape[0] * shape[1]
        if nnz >= size:
            return False
        if self.profile.dense_threshold is not None:
            return self._threshold(nnz, size)
        return self._reads(own, nnz, size, True, mv) < self._reads(own, nnz, size, False, mv)

    def joint(self, left: Pattern, right: Pattern, left_uses: Optional[Uses], right_uses: Optional[Uses],
              sparse_pairs: int) -> tuple[bool, bool]:
        """Storage (dense?) of the operands of ``P = left @ right``: own patterns ``left``/``right``;
        ``*_uses`` the mat-vecs of an operand still to decide, ``None`` for one already stored (an
        input or a decided product). ``sparse_pairs``: pairs of ``P`` over the two given patterns."""
        pr, b = self.profile, self.batch
        opts = []
        for p, uses in ((left, left_uses), (right, right_uses)):
            free = uses is not None and not p.is_full
            if free and pr.dense_threshold is not None:
                opts.append((self._threshold(p.nnz, p.rows * p.cols),))
            else:
                opts.append((False, True) if free else (False,))
        best, choice = math.inf, (False, False)
        for dl in opts[0]:
            for dr in opts[1]:
                t = 0.0
                if left_uses is not None:
                    t += self._reads(left, left.nnz, left.rows * left.cols, dl, left_uses.mv)
                if right_uses is not None:
                    t += self._reads(right, right.nnz, right.rows * right.cols, dr, right_uses.mv)
                lf, rf = dl or left.is_full, dr or right.is_full
                if lf and rf:
                    t += b * left.rows * left.cols * right.cols / pr.gemm_rate
                else:
                    pairs = left.rows * right.nnz if lf else left.nnz * right.cols if rf else sparse_pairs
                    t += b * pairs / pr.pair_rate
                if t < best:
                    best, choice = t, (dl, dr)
        return choice


def intern_pattern(table: PatternTable, p: Pattern) -> Pattern:
    """``p`` interned in ``table``; a full pattern as a :class:`~.patterns.FullPattern` (no index arrays
    held) unless the table already holds it (an input's)."""
    if p.is_full and not isinstance(p, FullPattern):
        p = full_pattern(p.rows, p.cols)
    return table.intern(p)


def decide_alone(rule: StorageRule, a: Pattern, b: Pattern, mv: Sequence[str], rowwise: bool,
                 estimate: Callable[[], int], own: Callable[[], Pattern]) -> bool:
    """Whether ``A @ B``, read by the mat-vecs ``mv`` and no product, is stored densely.

    A row-wise product is first judged by its sampled nnz (``estimate()``), which settles clear
    dense cases without forming its own pattern (``own()``, which may cost as much as the product).
    """
    if a.is_full and b.is_full:
        return False
    shape = (a.rows, b.cols)
    if rowwise and rule.alone(shape, None, estimate(), mv):
        return True
    p = own()
    return rule.alone(shape, p, p.nnz, mv)


def dense_positions(own: Pattern) -> np.ndarray:
    """``(nnz,)`` int64: the row-major position in the dense ``rows x cols`` block of each entry of ``own``."""
    return own.row_of_entry() * own.cols + own.indices


class _Products:
    """Per-pattern-pair symbolic products, computed once (interned by pattern content).

    A sparse product runs on planned pair lists (O(pairs) index data) unless those would exceed
    ``profile.pair_list_max_bytes``; then it runs row-wise over its output pattern (O(nnz)). Its
    storage — its own pattern or dense — is decided by :class:`StorageRule` once the products and
    mat-vecs reading it are known (:class:`_Levels`); ``product(a, b, dense)`` forms either.
    """

    def __init__(self, table: PatternTable, profile: DeviceProfile, batch: int = 16):
        self.table = table
        self.profile = profile
        self.rule = StorageRule(profile, batch)
        self.cache: dict[tuple[str, str, bool], MatInfo] = {}
        self._npairs: dict[tuple[str, str], int] = {}
        self._own: dict[tuple[str, str], Pattern] = {}
        self._syms: dict[tuple[str, str], ProductSymbolic] = {}
        self._estimates: dict[tuple[str, str], int] = {}

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

    def _sym(self, a: Pattern, b: Pattern) -> ProductSymbolic:
        key = (a.key, b.key)
        sym = self._syms.get(key)
        if sym is None:
            sym = spgemm_symbolic(a, b)
            sym = self._syms[key] = ProductSymbolic(intern_pattern(self.table, sym.pattern), sym.pair_ptr,
                                                    sym.pair_a, sym.pair_b)
        return sym

    def own(self, a: Pattern, b: Pattern) -> Pattern:
        """The product's own pattern (every position some pair reaches; full for a GEMM)."""
        key = (a.key, b.key)
        hit = self._own.get(key)
        if hit is None:
            if a.is_full and b.is_full:
                hit = full_pattern(a.rows, b.cols)
            elif self.rowwise(a, b):
                hit = structural_product(a, b)
            else:
                hit = self._sym(a, b).pattern
            hit = self._own[key] = intern_pattern(self.table, hit)
        return hit

    def own_estimate(self, a: Pattern, b: Pattern) -> int:
        """nnz of the own pattern of a row-wise product, sampled (:func:`estimate_product_nnz`)."""
        key = (a.key, b.key)
        if key not in self._estimates:
            self._estimates[key] = estimate_product_nnz(a, b)
        return self._estimates[key]

    def decide_alone(self, a: Pattern, b: Pattern, mv: Sequence[str]) -> bool:
        """Storage of ``A @ B`` read only by the mat-vecs ``mv`` (:func:`decide_alone`)."""
        return decide_alone(self.rule, a, b, mv, self.rowwise(a, b), lambda: self.own_estimate(a, b),
                            lambda: self.own(a, b))

    def product(self, a: Pattern, b: Pattern, dense: Optional[bool] = None) -> MatInfo:
        """``A @ B`` stored densely (``dense``) or with its own pattern; ``None``: as the storage rule
        stores a product read by one down-sweep mat-vec and no product."""
        if dense is None:
            dense = self.decide_alone(a, b, ("down",))
        key = (a.key, b.key, bool(dense))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if a.is_full and b.is_full:
            info = MatInfo(self.table.intern(full_pattern(a.rows, b.cols)), "gemm")
            info.gemm_macs = a.rows * a.cols * b.cols
        elif self.rowwise(a, b):
            out = self.table.intern(full_pattern(a.rows, b.cols)) if dense else self.own(a, b)
            rw = rowwise_symbolic(a, b, out=out)
            info = MatInfo(rw.pattern, "rows", rw=rw, densified=bool(dense))
        else:
            sym = self._sym(a, b)
            if dense and not sym.pattern.is_full:  # the own pattern's pairs, written into the dense block
                info = MatInfo(self.table.intern(full_pattern(a.rows, b.cols)), "pairs", sym=sym, densified=True)
            else:
                info = MatInfo(sym.pattern, "pairs", sym=sym)
        self.cache[key] = info
        return info


def dense_storage_by_cost(rows: int, cols: int, nnz: int, profile: DeviceProfile) -> bool:
    """:class:`StorageRule` for a product read by one mat-vec and no product (batch-independent):
    dense when writing and reading ``rows * cols`` entries at ``gemv_rate`` beats writing ``nnz`` and
    gathering them at ``pair_rate``."""
    return nnz >= rows * cols or StorageRule(profile, 1).alone((rows, cols), None, nnz, ("down",))


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


_RUN_KIND: dict[str, str] = {}
_BINS: dict[tuple[str, int], int] = {}


def linear_run_kind(p: Pattern, profile: DeviceProfile) -> Optional[str]:
    """How a fused linear run (the scan's middle) takes a matrix of pattern ``p`` on ``profile``'s
    device: ``"dense"`` (full pattern: a row-major block), ``"diag"`` (the identity pattern: ``m``
    scale factors), ``"sparse"`` (any other pattern: a CSR step over its ``indptr``/``indices``), or
    ``None`` (the step stays a standalone SpMV: a CSR pattern over ``profile.run_sparse_max_nnz``
    entries). See :func:`_linear_run_kind`."""
    kind = _RUN_KIND.get(p.key)
    if kind is None:
        _RUN_KIND[p.key] = kind = _linear_run_kind(p)
    limit = profile.run_sparse_max_nnz
    if kind == "sparse" and limit is not None and p.nnz > limit:
        return None
    return kind


def _linear_run_kind(p: Pattern) -> str:
    """The run kind of one pattern, on any device.

    * Full patterns are ``"dense"`` and identity patterns ``"diag"`` (no index read at all).
    * Every other pattern is ``"sparse"``, nearly dense ones included: their values arrive in CSR
      order, so a dense step would need a scatter of the values into a block on every call, while
      the CSR step reads them in place at one index per entry (at most twice the dense step's reads).
    """
    if p.is_full:
        return "dense"
    if (p.rows == p.cols and p.nnz == p.rows and np.array_equal(p.indices, np.arange(p.rows))
            and np.array_equal(p.indptr, np.arange(p.rows + 1))):
        return "diag"
    return "sparse"


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
    """Launches of a planned SpGEMM (cached per own pattern and pair count): one per width bin of the own
    entries' pair counts, and for a dense-stored product one more that zeroes its block."""
    key = (info.sym.pattern.key, info.sym.npairs)
    if key not in _BINS:
        _BINS[key] = _seg_bins(np.diff(info.sym.pair_ptr))
    return _BINS[key] + int(info.scatters)


def _step_costs(
    sched: ScanSchedule, mats: dict[int, MatInfo], profile: DeviceProfile, batch: int, elem: int
) -> list[LevelCost]:
    out = []
    run_steps: list[tuple[int, Pattern]] = []  # (index in out, pattern) of the fused linear-run steps
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
        run_kind = linear_run_kind(mats[st.mv[0].mat].pattern, profile) \
            if st.phase == "mid" and len(st.mv) == 1 else None
        if run_kind is not None:
            launches = 0  # a step of a fused linear run: no launch of its own
            t = profile.run_step_s(run_kind)
            run_steps.append((len(out), mats[st.mv[0].mat].pattern))
        else:
            t = 0.0
        t += launches * profile.op_overhead_s
        t += batch * (pairs + mv_sparse) / profile.pair_rate
        t += batch * gemm / profile.gemm_rate + batch * gemv / profile.gemv_rate
        flops = 2 * (pairs + gemm + mv_sparse + gemv)
        out.append(LevelCost(st.phase, st.level, len(st.mm), len(st.mv), nnz, flops, nbytes, t))
    _parallel_run_costs(out, run_steps, profile, batch)
    return out


def _parallel_run_costs(out: list[LevelCost], run_steps: list[tuple[int, Pattern]], profile: DeviceProfile,
                        batch: int) -> None:
    """Re-cost the middle's linear run where the device runs it parallel over its steps.

    A run whose every step is a square ``m x m`` dense block or diagonal (``m <=
    profile.parallel_run_max_m``, at least ``profile.parallel_run_min_steps`` steps) runs in chunks
    of ``L ~ sqrt(n)`` steps: ``2 L + n / L`` dependent steps on the critical path instead of ``n``,
    plus composing every chunk's map (``m^3`` multiply-adds per dense step, ``m^2`` per diagonal,
    per sample, at ``parallel_run_rate``). A run of diagonals only runs so per lane, for any ``m``
    (``m`` multiply-adds per step and sample). The total is spread evenly over the run's steps.
    """
    n = len(run_steps)
    if profile.recurrence_rate > 0 and n:
        rec = periodic_structure([p for _, p in run_steps], profile.recurrence_max_n)
        if rec is not None:  # the fused recurrence kernels: a shared block and per-step diagonals
            period, fused, macs = rec
            chunk = max(8.0, RECURRENCE_CHUNK_SCALE * math.sqrt(fused))
            total = (profile.recurrence_step_s * (2 * chunk + fused / chunk) + 3 * profile.op_overhead_s
                     + batch * fused * macs / profile.recurrence_rate)
            for i, p in run_steps:
                c = out[i]
                out[i] = replace(c, time_s=c.time_s - profile.run_step_s(linear_run_kind(p, profile)) + total / n)
            return
    if not profile.parallel_run_max_m or n < max(1, profile.parallel_run_min_steps):
        return
    m = run_steps[0][1].rows
    kinds = [linear_run_kind(p, profile) for _, p in run_steps]
    if any(p.rows != m or p.cols != m for _, p in run_steps) or any(k not in ("dense", "diag") for k in kinds):
        return
    diagonal = all(k == "diag" for k in kinds)
    if m > profile.parallel_run_max_m and not diagonal:
        return
    chunk = max(8.0, math.sqrt(n))
    macs = n * m if diagonal else sum(m ** 3 if k == "dense" else m * m for k in kinds)
    total = profile.chain_step_s * (2 * chunk + n / chunk) + batch * macs / profile.parallel_run_rate
    for i, _ in run_steps:
        c = out[i]
        out[i] = replace(c, time_s=c.time_s - profile.chain_step_s + total / n)


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
    exact inputs: the same own pattern, storage and pair count as :class:`_Products`.
    Pair lists are built only for the depth finally chosen.
    """

    def __init__(self, products: _Products):
        self.products = products
        self.rule = products.rule
        self.counts: dict[tuple[str, str], int] = {}
        self._own: dict[tuple[str, str], tuple[Pattern, np.ndarray]] = {}
        self.cache: dict[tuple[str, str, bool], MatInfo] = {}

    def npairs(self, a: Pattern, b: Pattern) -> int:
        key = (a.key, b.key)
        hit = self.counts.get(key)
        if hit is None:
            hit = self.counts[key] = product_counts(a, b)
        return hit

    def _counted(self, a: Pattern, b: Pattern) -> tuple[Pattern, np.ndarray]:
        key = (a.key, b.key)
        hit = self._own.get(key)
        if hit is None:
            indptr, indices, counts = product_pattern(a, b)
            own = intern_pattern(self.products.table, make_pattern((a.rows, b.cols), indptr, indices))
            hit = self._own[key] = (own, counts)
        return hit

    def _planned_like(self, a: Pattern, b: Pattern) -> bool:
        """A GEMM or a row-wise product plans no pair lists: formed as the planner forms it (as cheap)."""
        return (a.is_full and b.is_full) or self.products.rowwise(a, b)

    def own(self, a: Pattern, b: Pattern) -> Pattern:
        return self.products.own(a, b) if self._planned_like(a, b) else self._counted(a, b)[0]

    def decide_alone(self, a: Pattern, b: Pattern, mv: Sequence[str]) -> bool:
        if self._planned_like(a, b):
            return self.products.decide_alone(a, b, mv)
        own = self.own(a, b)
        return self.rule.alone((a.rows, b.cols), own, own.nnz, mv)

    def product(self, a: Pattern, b: Pattern, dense: Optional[bool] = None) -> MatInfo:
        """``MatInfo`` of ``A @ B`` equal to ``_Products.product`` in pattern, algo and pairs per entry."""
        if dense is None:
            dense = self.decide_alone(a, b, ("down",))
        key = (a.key, b.key, bool(dense))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if self._planned_like(a, b):
            info = self.products.product(a, b, dense)
        else:
            pattern, counts = self._counted(a, b)
            if dense and not pattern.is_full:
                info = MatInfo(self.products.table.intern(full_pattern(a.rows, b.cols)), "pairs",
                               sym=_PairCounts(pattern, counts), densified=True)
            else:
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


class _Levels:
    """Up-sweep products formed level by level, each stored as :class:`StorageRule` decides once the
    schedule shows what reads it: when the product taking it as an operand is formed (jointly with
    that product's other operand), when a spine mat-vec takes it, or, for products no planned
    product reads, at the end (:meth:`finalize`) by their mat-vecs alone.

    ``provider`` is :class:`_Products` (pair lists) or :class:`_DepthSearch` (pair counts): both give
    the same own patterns, pair counts and therefore the same decisions.
    """

    def __init__(self, pats: Sequence[Pattern], provider, sched: Optional[ScanSchedule] = None):
        self.provider = provider
        self.mats: dict[int, MatInfo] = {i: MatInfo(p, "input") for i, p in enumerate(pats)}
        self.pending: dict[int, tuple[Pattern, Pattern]] = {}  # product id -> its operands' stored patterns
        self.schedule(sched)

    def schedule(self, sched: Optional[ScanSchedule]) -> None:
        """The schedule whose readers decide storage (the uses are computed only if a decision needs them)."""
        self._sched = sched
        self._uses: Optional[dict[int, Uses]] = None

    def uses(self, m: int) -> Uses:
        if self._uses is None:
            self._uses = matrix_uses(self._sched)
        return self._uses.get(m, _NO_USES)

    def _store(self, m: int, dense: bool) -> None:
        a, b = self.pending.pop(m)
        self.mats[m] = self.provider.product(a, b, dense)

    def decide(self, step: Step) -> None:
        """Store the pending matrices ``step`` reads (its products' operands, its mat-vecs' matrices)."""
        prov = self.provider
        for op in step.mm:
            pl, pr = op.left in self.pending, op.right in self.pending
            if not (pl or pr):
                continue
            lp = prov.own(*self.pending[op.left]) if pl else self.mats[op.left].pattern
            rp = prov.own(*self.pending[op.right]) if pr else self.mats[op.right].pattern
            dl = dr = False
            if (pl and not lp.is_full) or (pr and not rp.is_full):
                dl, dr = prov.rule.joint(lp, rp, self.uses(op.left) if pl else None,
                                         self.uses(op.right) if pr else None, prov.npairs(lp, rp))
            if pl:
                self._store(op.left, dl)
            if pr:
                self._store(op.right, dr)
        for op in step.mv:
            if op.mat in self.pending:
                a, b = self.pending[op.mat]
                self._store(op.mat, prov.decide_alone(a, b, self.uses(op.mat).mv))

    def form(self, step: Step) -> None:
        """The products of ``step`` (operands already stored), pending until their readers are known."""
        for op in step.mm:
            self.pending[op.out] = (self.mats[op.left].pattern, self.mats[op.right].pattern)

    def finalize(self) -> dict[int, MatInfo]:
        """Every matrix, the pending products stored by their mat-vecs alone (``self`` is unchanged)."""
        out = dict(self.mats)
        prov = self.provider
        for m, (a, b) in self.pending.items():
            out[m] = prov.product(a, b, prov.decide_alone(a, b, self.uses(m).mv))
        return out


class _Steps(NamedTuple):
    steps: list[Step]


def _costs_of(steps: Sequence[Step], mats: dict[int, MatInfo], profile: DeviceProfile, batch: int,
              elem: int) -> list[LevelCost]:
    return _step_costs(_Steps(list(steps)), mats, profile, batch, elem)  # type: ignore[arg-type]


def _planned_mats(sched: ScanSchedule, levels: int, pats: list[Pattern], products: _Products,
                  profile: DeviceProfile, what: str,
                  advice: str = "choose fewer levels") -> dict[int, MatInfo]:
    """Inputs and the products of the first ``levels`` up-sweep levels, with their pair lists and storage.

    ``what`` names the request in the error raised when a level's pair indices exceed the budget.
    """
    lv = _Levels(pats, products, sched)
    for d, st in enumerate(sched.steps[:levels]):
        lv.decide(st)
        est_bytes = 0
        for op in st.mm:
            a, b = lv.mats[op.left].pattern, lv.mats[op.right].pattern
            est_bytes += products.index_estimate(a, b)
            if est_bytes > profile.bytes_budget:
                raise ValueError(
                    f"{what}: up-sweep level {d} needs ~{est_bytes / 2**30:.1f} GiB of product index data, over the "
                    f"planning budget of {profile.bytes_budget / 2**30:.1f} GiB; {advice}"
                )
        lv.form(st)
    mats = lv.finalize()
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

    Every product's storage (dense or its own pattern) is chosen by :class:`StorageRule` from what
    reads it at the depth planned, so a product of the deepest level (read by mat-vecs only) may be
    stored otherwise than the same product one level below the top of a deeper plan.

    ``"auto"`` evaluates ``K = 0, 1, ...`` in order and stops at the first depth that cannot win:
    its up-sweep alone (bounded below from pair counts before the level's products are
    formed) costs at least the best estimate so far, the estimate has risen twice (on a profile
    with chunked linear runs: above the best depth >= 1 so far, since a chunked depth 0 is costed
    on other terms than the up-sweeps), or the level's pair indices exceed the budget. Candidates
    are costed from product patterns and pair counts; pair lists are built only for the depth chosen.
    """
    n = len(patterns)
    table = PatternTable()
    pats = [table.intern(p) for p in patterns]
    kmax = max_levels(n)
    products = _Products(table, profile, batch_hint)
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
    lv = _Levels(pats, search)
    candidates: dict[int, float] = {}
    best: Optional[tuple[int, ScanSchedule]] = None
    up_prev = 0.0  # up-sweep cost of the last depth costed (its levels are the next depth's first ones)
    worse = 0
    best_deep: Optional[int] = None
    explored = 0
    for k in range(kmax + 1):
        sched = blelloch_schedule(n, k)
        lv.schedule(sched)
        if k > 0:
            if best is not None and worse >= 2:
                break  # the cost has turned up twice
            level = sched.steps[k - 1]
            lv.decide(level)  # the operands of this level: their readers are known now
            if search.index_bytes(level, lv.mats, profile.bytes_budget) > profile.bytes_budget:
                break  # this level's fill-in is never expanded symbolically
            if best is not None and (up_prev + search.level_lower_bound(level, lv.mats, profile, batch_hint)
                                     >= candidates[best[0]]):
                break  # deeper plans only add up-sweep work: none can win
            lv.form(level)
            explored = k
        mats = lv.finalize()
        sub = {i: mats[i] for i in range(sched.num_mats) if i in mats}
        costs = _costs_of(sched.steps, sub, profile, batch_hint, elem_bytes)
        up = 0.0
        for c in costs[:k]:
            up += c.time_s
        up_prev = up
        if k > 0 and best is not None and up >= candidates[best[0]]:
            break
        t = up + sum(c.time_s for c in costs[k:])
        if memory_limit is not None and memory_of is not None:
            if memory_of(ScanPlan(pats, k, sub, sched, profile, batch_hint, elem_bytes)) > memory_limit:
                continue
        candidates[k] = t
        # where depth 0 is a chunked run its cost is of another kind than the up-sweeps': deeper plans are
        # then compared with the best deeper plan so far, so a cheap depth 0 does not end the search
        rival = best_deep if profile.parallel_run_max_m else (best[0] if best is not None else None)
        if best is None or t < candidates[best[0]]:
            best = (k, sched)
        if rival is None or t < candidates[rival]:
            worse = 0
            if k > 0:
                best_deep = k
        else:
            worse += 1
    if best is None:
        k, sched = 0, blelloch_schedule(n, 0)
        mats0 = {i: MatInfo(p, "input") for i, p in enumerate(pats)}
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
    rule over the tree's readers, interned patterns), so a model-parallel slice reduction runs on
    the same engine as a scan. Raises ``ValueError`` when a level's pair indices exceed the device
    profile's budget.
    """
    from .schedule import reduction_schedule

    table = PatternTable()
    pats = [table.intern(p) for p in patterns]
    sched = reduction_schedule(len(pats))
    products = _Products(table, profile, batch_hint)
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
