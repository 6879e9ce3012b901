"""The per-step work tables a planned scan is lowered to (:mod:`.lowering`), which the numeric backends run.

A :class:`Program` fixes where every value lives and what every launch reads and writes:

* three arenas: shared matrix values ``S`` (``(N_S,)``), per-sample matrix values ``P``
  (``(B, N_P)``) and per-sample vectors ``V`` (``(B, N_V)``). Inputs sit first in layer order (so
  loading them is one concatenation); the last slot of each arena is a constant zero that pads
  pair lists and stands for "no extra term".
* per scan step, one work table per primitive: :class:`SpMM` (planned pair lists binned by
  segment length into power-of-two widths, no merging left), :class:`Gemm` (batched dense
  products of same-shaped nodes), :class:`SpMV` and :class:`Gemv` (with the affine ``+ add``
  term fused). A level is therefore a few launches, never one per node.

A product of two shared operands is shared (computed once for the batch); anything touching a
per-sample operand is per sample. The program depends on which inputs are shared and which
``extra`` terms exist, so plans lower lazily per such signature and cache the result; a table whose
content two signatures share (:func:`.lowering.layout` gives each a key) is built and held once per plan
(:class:`.lowering.LoweringCache`). A product stored densely over pair lists keeps its own pattern's pairs:
:attr:`SpMM.clear` zeroes its block and the bins write the own entries at their dense positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .patterns import Pattern

__all__ = ["Program", "BlockRef", "SpMM", "RowSpGEMM", "RowProduct", "Gemm", "SpMV", "Gemv", "LinearRun", "Apply", "Bin",
           "SHARED", "SAMPLE"]

SHARED, SAMPLE = "S", "P"


@dataclass
class Bin:
    """Segments whose length fits ``width``: ``out[j] = sum_t a[j, t] * b[j, t] (+ add[j])``."""

    width: int
    a: np.ndarray  # (nseg, width) slots of the left factor (matrix values)
    b: np.ndarray  # (nseg, width) slots of the right factor (matrix values or vector entries)
    out: np.ndarray  # (nseg,) output slots
    add: Optional[np.ndarray] = None  # (nseg,) vector slots added (SpMV only)


@dataclass
class BlockRef:
    """A batch of dense ``rows x cols`` blocks at arena ``offsets`` (row-major each).

    ``base``/``block`` describe the same blocks as ``arena[base : ...].view(-1, rows, cols)[block]``
    when every offset is ``base`` plus a multiple of the block size (no per-entry index needed).
    """

    rows: int
    cols: int
    offsets: np.ndarray  # (nodes,)
    base: int = -1
    block: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        size = self.rows * self.cols
        if self.offsets.size:
            base = int(self.offsets.min() % size)
            if np.all((self.offsets - base) % size == 0):
                self.base = base
                self.block = (self.offsets - base) // size


@dataclass
class SpMM:
    kind_a: str
    kind_b: str
    kind_out: str
    bins: list[Bin]
    # (offset, size) of each dense-stored output whose own pattern is not full: zeroed before the bins
    # write its own entries (at their dense positions), so no index is held for the unreached positions
    clear: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class RowProduct:
    """One row-wise product ``C = A @ B``: the three patterns and where their values sit in the arenas."""

    a: Pattern
    b: Pattern
    c: Pattern
    a_offset: int
    b_offset: int
    c_offset: int


@dataclass
class RowSpGEMM:
    """Row-wise products of one step (:mod:`spscan.planner.rowwise`): no pair lists, the backends
    build O(nnz) tables from the patterns; every entry of each ``C`` is written."""

    kind_a: str
    kind_b: str
    kind_out: str
    products: list[RowProduct]


@dataclass
class Gemm:
    kind_a: str
    kind_b: str
    kind_out: str
    a: BlockRef  # (m, k)
    b: BlockRef  # (k, p)
    out_offset: int  # nodes * m * p contiguous slots in the output arena

    @property
    def nodes(self) -> int:
        return int(self.a.offsets.shape[0])


@dataclass
class SpMV:
    kind_m: str
    bins: list[Bin]


@dataclass
class Gemv:
    kind_m: str
    mats: BlockRef  # (m, k)
    vin: np.ndarray  # (nodes, k) vector slots
    add: np.ndarray  # (nodes, m) vector slots (zero slot where there is no extra)
    out_offset: int  # nodes * m contiguous vector slots

    @property
    def nodes(self) -> int:
        return int(self.mats.offsets.shape[0])


@dataclass
class LinearRun:
    """A run of dependent mat-vecs (the linear-scan middle): ``y_j = M_j y_{j-1} + add_j``.

    Every ``M_j`` is dense (row-major ``(m_j, k_j)`` block), diagonal (``m_j`` entries) or CSR
    (``nnz`` entries in its pattern's order), shared (``(nnz,)``) or per sample (``(B, nnz)``);
    ``y_0`` is read at ``vin0`` and ``y_j`` written at ``out[j]`` (contiguous). The values stay where
    they are (arena or the caller's tensor); a CSR step's structure is one of the run's distinct
    patterns (``csr``, interned by pattern key: a long RNN chain repeats a few), stored once as
    ``csr_indptr``/``csr_indices``. Backends run the whole run from one call (torch: one
    ``mm``/``bmm``/``mul``/gather-sum per step into contiguous buffers; CPU: one compiled loop;
    Triton: one persistent launch), never one launch per step.
    """

    dense: np.ndarray  # (steps,) bool: dense block (else diagonal, or CSR where pattern >= 0)
    shared: np.ndarray  # (steps,) bool: matrix values in the shared arena
    rows: np.ndarray  # (steps,) m_j
    cols: np.ndarray  # (steps,) k_j
    mat_offset: np.ndarray  # (steps,) arena offset of M_j's values
    layers: np.ndarray  # (steps,) input layer index of M_j, or -1 for a product
    vin0: int
    add: np.ndarray  # (steps,) vector offset of add_j, or -1
    out: np.ndarray  # (steps,) vector offset of y_j
    pattern: Optional[np.ndarray] = None  # (steps,) index into ``csr`` of a CSR step, -1 otherwise
    csr: tuple[Pattern, ...] = ()  # the run's distinct CSR patterns
    # the CSR tables: each pattern's indptr, shifted to where its columns start in ``csr_indices``,
    # concatenated ((sum(rows_p + 1),)); the columns concatenated ((sum(nnz_p),)); and per step where
    # its indptr starts in ``csr_indptr`` (-1 for a dense/diagonal step)
    csr_indptr: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    csr_indices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    csr_ptr: Optional[np.ndarray] = None

    def __post_init__(self) -> None:
        if self.pattern is None:
            self.pattern = np.full(self.steps, -1, dtype=np.int64)
        if self.csr_ptr is None:
            self.csr_ptr = np.full(self.steps, -1, dtype=np.int64)
            if self.csr:
                starts = np.cumsum([0] + [p.rows + 1 for p in self.csr])[:-1].astype(np.int64)
                self.csr_ptr = np.where(self.pattern >= 0, starts[np.maximum(self.pattern, 0)], -1).astype(np.int64)
                base = np.cumsum([0] + [p.nnz for p in self.csr])[:-1]
                self.csr_indptr = np.concatenate([p.indptr + b for p, b in zip(self.csr, base)]).astype(np.int64)
                self.csr_indices = np.concatenate([p.indices for p in self.csr]).astype(np.int64)

    @property
    def steps(self) -> int:
        return int(self.rows.shape[0])

    @property
    def sparse(self) -> np.ndarray:
        """``(steps,)`` bool: CSR steps."""
        return self.pattern >= 0

    @property
    def nnz(self) -> np.ndarray:
        """``(steps,)`` stored entries of each step's matrix (its values per sample or shared)."""
        nnz = np.where(self.dense, self.rows * self.cols, self.rows)
        if self.csr:
            per_pattern = np.array([p.nnz for p in self.csr], dtype=np.int64)
            nnz = np.where(self.sparse, per_pattern[np.maximum(self.pattern, 0)], nnz)
        return nnz.astype(np.int64)


@dataclass
class Apply:
    """``y = J_layer^T x (+ add)`` by the layer's structured operator (matrix-free), for every sample.

    ``x`` is read at vector offset ``vin`` (``cols`` entries), ``y`` written at ``out`` (``rows``),
    ``add`` a vector offset or -1. Both backends run it by calling the operator the caller passed
    as that layer's values: no index table.
    """

    layer: int
    rows: int
    cols: int
    vin: int
    out: int
    add: int


@dataclass
class ProgramStep:
    phase: str
    level: int
    ops: list = field(default_factory=list)


@dataclass
class Program:
    n: int
    shared: tuple[bool, ...]
    has_extra: tuple[bool, ...]
    size_s: int
    size_p: int
    size_v: int
    input_offsets: list[int]  # per layer: offset in its arena (S if shared else P)
    grad_slot: int
    extra_slots: dict[int, int]  # layer index i -> offset of extra[i] in V
    outputs: list[tuple[int, int]]  # (offset, dim) of dl/dx_i in V
    steps: list[ProgramStep]
    mat_kind: dict[int, str]
    mat_offset: dict[int, int]
    root_mat: Optional[tuple[str, int, int]] = None  # reduce: the composite's (arena, offset, nnz)
    root_vec: Optional[tuple[int, int]] = None  # reduce: (offset, dim) of its affine term in V, if any
    operators: tuple[bool, ...] = ()  # per layer: applied by its structured operator
    skipped_first: bool = False  # dl/dx_0 was not wanted and is not computed (outputs[0] has offset -1)
    period: int = 0  # > 0: shared layer i's values are layer (i mod period)'s, held once (see layout)

    @property
    def zero_s(self) -> int:
        return self.size_s - 1

    @property
    def zero_p(self) -> int:
        return self.size_p - 1

    @property
    def zero_v(self) -> int:
        return self.size_v - 1

    @property
    def output_split(self) -> tuple[list[int], list[int]]:
        """Cut points of the vector arena and, per output, which piece is ``dl/dx_i``."""
        cached = getattr(self, "_output_split", None)
        if cached is None:
            bounds = sorted({b for off, d in self.outputs if off >= 0 for b in (off, off + d)})
            piece = {off: k + 1 for k, off in enumerate(bounds)}  # piece k+1 starts at bounds[k]
            cached = (bounds, [piece[off] if off >= 0 else -1 for off, d in self.outputs])
            self._output_split = cached
        return cached

    @property
    def run_scratch(self) -> int:
        """Per-sample entries of the largest linear run's outputs (its working buffer), 0 if none."""
        cached = getattr(self, "_run_scratch", None)
        if cached is None:
            cached = max((int(op.rows.sum()) for st in self.steps for op in st.ops if isinstance(op, LinearRun)),
                         default=0)
            self._run_scratch = cached
        return cached

    def index_bytes(self) -> int:
        total = 0
        for st in self.steps:
            for op in st.ops:
                for arr in _arrays(op):
                    total += arr.nbytes
        return total


def _arrays(op):
    if isinstance(op, (SpMM, SpMV)):
        for b in op.bins:
            yield b.a
            yield b.b
            yield b.out
            if b.add is not None:
                yield b.add
    elif isinstance(op, RowSpGEMM):
        for pr in op.products:  # the operand and output patterns are the tables (row starts, columns)
            yield from (pr.a.indptr, pr.a.indices, pr.b.indptr, pr.b.indices, pr.c.indptr)
            if not pr.c.is_full:
                yield pr.c.indices
    elif isinstance(op, Gemm):
        yield op.a.offsets
        yield op.b.offsets
    elif isinstance(op, Gemv):
        yield op.mats.offsets
        yield op.vin
        yield op.add
    elif isinstance(op, LinearRun):
        yield op.mat_offset
        yield op.add
        yield op.out
        yield op.pattern
        yield op.csr_ptr
        yield op.csr_indptr
        yield op.csr_indices
