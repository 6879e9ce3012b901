"""Symbolic half of the row-wise SpGEMM: the output pattern and O(nnz) index data, no pair lists.

For ``C = A @ B`` (CSR) the row-wise (Gustavson) numeric phase owns one output row ``i`` at a
time and, for each stored ``A[i, k]`` in ascending ``k``, adds ``A[i, k] * B[k, :]`` into row
``i`` of ``C``; the position of ``B[k, j]`` in ``C``'s row is found by a search of ``j`` in the
row's sorted column indices (or directly, ``j`` itself, when the row is full). So the numeric
phase needs only the CSR structure of ``A``, ``B`` and ``C`` — O(nnz) index memory — where the
planned pair lists of :mod:`spscan.planner.symbolic` hold two indices per multiply-add
(O(FLOPs)). Every output entry is summed in ascending ``k``, the order of the pair lists, with no
atomics: results are reproducible bit for bit.

This module computes the output pattern (SciPy's boolean product: no cancellation can occur),
the pairs per output row (for load balance and the cost model) and what the numeric phase holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import scipy.sparse as sp

from .patterns import Pattern, full_pattern, make_pattern

__all__ = ["RowwiseProduct", "rowwise_symbolic", "row_pair_counts", "rowwise_index_bytes", "pair_list_bytes",
           "structural_product", "estimate_product_nnz", "INDEX_BYTES"]

INDEX_BYTES = 8


def row_pair_counts(a: Pattern, b: Pattern) -> np.ndarray:
    """``(a.rows,)`` multiply-adds of each output row of ``A @ B`` (one per stored pair ``A[i,k], B[k,j]``)."""
    if a.cols != b.rows:
        raise ValueError(f"row_pair_counts: inner dimensions differ: {a.shape} @ {b.shape}")
    per_entry = b.row_lengths()[a.indices]
    cs = np.zeros(a.nnz + 1, dtype=np.int64)
    np.cumsum(per_entry, out=cs[1:])
    return cs[a.indptr[1:]] - cs[a.indptr[:-1]]


def rowwise_index_bytes(a: Pattern, b: Pattern, c: Pattern) -> int:
    """Bytes of index data the row-wise numeric phase holds for ``C = A @ B``.

    Per entry of ``A``: its value slot and the row of ``B`` it selects; per row of ``B``: value
    slot, column start and length; per entry of ``B`` and ``C``: the column index; per output
    row: five scalars (A range, C slot, C column start, length, search depth). At most 8 bytes
    each (int32 where the arenas allow).
    """
    return INDEX_BYTES * (2 * a.nnz + 3 * b.rows + b.nnz + c.nnz + 6 * c.rows)


def pair_list_bytes(npairs: int, nnz_c: int) -> int:
    """Bytes of the planned pair lists of a product (two indices per pair, padded bins up to 2x, one
    output slot per entry), as :mod:`spscan.planner.memory` counts them."""
    return 2 * 2 * INDEX_BYTES * int(npairs) + INDEX_BYTES * int(nnz_c)


@dataclass(frozen=True, eq=False)
class RowwiseProduct:
    """``C = A @ B`` planned for the row-wise numeric phase.

    Attributes:
        a, b: the operands' patterns, ``(m, k)`` and ``(k, p)``.
        pattern: ``C``'s stored pattern ``(m, p)`` (the full pattern when stored densely).
        row_pairs: ``(m,)`` multiply-adds per output row.
    """

    a: Pattern
    b: Pattern
    pattern: Pattern
    row_pairs: np.ndarray

    @cached_property
    def npairs(self) -> int:
        """Multiply-adds per sample (half the FLOPs)."""
        return int(self.row_pairs.sum())

    @property
    def index_bytes(self) -> int:
        return rowwise_index_bytes(self.a, self.b, self.pattern)


def structural_product(a: Pattern, b: Pattern) -> Pattern:
    """Pattern of ``A @ B`` (every position some pair reaches), canonical."""
    if a.cols != b.rows:
        raise ValueError(f"structural_product: inner dimensions differ: {a.shape} @ {b.shape}")
    sa = sp.csr_array((np.ones(a.nnz, dtype=bool), a.indices, a.indptr), shape=a.shape)
    sb = sp.csr_array((np.ones(b.nnz, dtype=bool), b.indices, b.indptr), shape=b.shape)
    c = sp.csr_array(sa @ sb)
    c.sum_duplicates()
    c.sort_indices()
    return make_pattern((a.rows, b.cols), c.indptr, c.indices)


def rowwise_symbolic(a: Pattern, b: Pattern, dense_out: bool = False, out: Pattern | None = None) -> RowwiseProduct:
    """Plan ``C = A @ B`` for the row-wise numeric phase.

    Args:
        a, b: canonical operand patterns, ``a.cols == b.rows``.
        dense_out: store ``C`` densely (row-major full pattern; unreached positions are computed zeros).
        out: ``C``'s pattern when already known (e.g. from a pattern-only walk); must contain the product's.
    """
    if a.cols != b.rows:
        raise ValueError(f"rowwise_symbolic: inner dimensions differ: {a.shape} @ {b.shape}")
    if out is None:
        out = full_pattern(a.rows, b.cols) if dense_out else structural_product(a, b)
    elif out.shape != (a.rows, b.cols):
        raise ValueError(f"rowwise_symbolic: out pattern has shape {out.shape}, expected {(a.rows, b.cols)}")
    return RowwiseProduct(a, b, out, row_pair_counts(a, b))


def estimate_product_nnz(a: Pattern, b: Pattern, sample_rows: int = 256) -> int:
    """nnz of ``A @ B``: exact when ``A`` has at most ``sample_rows`` rows, else extrapolated from
    ``sample_rows`` evenly spaced rows (deterministic; costs about ``sample_rows / m`` of the product)."""
    if a.cols != b.rows:
        raise ValueError(f"estimate_product_nnz: inner dimensions differ: {a.shape} @ {b.shape}")
    m = a.rows
    if m <= sample_rows:
        return structural_product(a, b).nnz
    rows = np.unique(np.linspace(0, m - 1, sample_rows).round().astype(np.int64))
    lens = a.row_lengths()[rows]
    indptr = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(lens, out=indptr[1:])
    take = np.repeat(a.indptr[rows] - indptr[:-1], lens) + np.arange(indptr[-1], dtype=np.int64)
    sub = make_pattern((rows.size, a.cols), indptr, a.indices[take])
    return int(round(structural_product(sub, b).nnz * m / rows.size))
