"""Storage of the scan's matrices: which products are formed, how (pair lists, row-wise, GEMM), and
whether each is stored densely or with its own pattern, chosen by the cost of what reads it.

Deterministic index work on the CPU; :class:`_Products` computes each pattern pair's symbolic
product once (interned by pattern content).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from .cost import INDEX_BYTES, DeviceProfile, linear_run_kind, row_bins
from .patterns import FullPattern, Pattern, PatternTable, full_pattern
from .rowwise import RowwiseProduct, estimate_product_nnz, pair_list_bytes, rowwise_symbolic, structural_product
from .schedule import MMOp, ScanSchedule
from .symbolic import ProductSymbolic, product_counts, spgemm_symbolic

__all__ = ["MatInfo", "StorageRule", "Uses", "decide_alone", "dense_positions", "dense_storage_by_cost",
           "intern_pattern", "matrix_uses"]


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
    # an input applied to vectors by its layer's own operator (not its CSR values): the entries its mat-vec
    # is priced at (the operator's work; a normalization's O(d), not its dense blocks' G N^2)
    apply_entries: Optional[int] = None

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
                    t += pr.op_overhead_s * (row_bins(x) if x is not None else 1)
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
        key = (a.key, b.key, bool(self.decide_alone(a, b, ("down",)) if dense is None else dense))
        if key in self.cache:
            return self.cache[key]
        dense = key[2]
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
