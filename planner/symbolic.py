"""Symbolic SpGEMM: the product's pattern and, per output entry, the input entry pairs that feed it.

For ``C = A @ B`` (CSR), entry ``c`` of ``C`` is ``sum_t A.data[pair_a[t]] * B.data[pair_b[t]]`` over
``t in [pair_ptr[c], pair_ptr[c+1])``, pairs ordered by the inner index ``k`` ascending. This is
the ``multiply_symbolic`` half of a sparse library's SpGEMM, done once per distinct pattern pair;
the numeric half at run time is a pure gather-multiply-segment-sum with no index merging.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import scipy.sparse as sp

from .patterns import Pattern, full_pattern, make_pattern

__all__ = ["ProductSymbolic", "product_counts", "product_pattern", "spgemm_symbolic", "expand_pairs"]


@dataclass(frozen=True, eq=False)
class ProductSymbolic:
    """Symbolic result of ``A @ B``: output pattern and the planned pair lists (local entry ids)."""

    pattern: Pattern
    pair_ptr: np.ndarray  # (nnz_C + 1,)
    pair_a: np.ndarray  # (npairs,) entry ids into A's values
    pair_b: np.ndarray  # (npairs,) entry ids into B's values

    @cached_property
    def npairs(self) -> int:
        return int(self.pair_a.shape[0])


def product_counts(a: Pattern, b: Pattern) -> int:
    """Number of multiply pairs of ``A @ B`` (half its FLOPs), without forming anything."""
    if a.cols != b.rows:
        raise ValueError(f"inner dimensions differ: {a.shape} @ {b.shape}")
    return int(b.row_lengths()[a.indices].sum())


def product_pattern(a: Pattern, b: Pattern) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pattern of ``C = A @ B`` and the number of multiply pairs of each entry, without pair lists.

    Returns canonical CSR ``(indptr (m+1,), indices (nnz_C,), counts (nnz_C,))``, all int64, with
    ``counts == np.diff(spgemm_symbolic(a, b).pair_ptr)``. Runs SciPy's compiled SpGEMM on
    all-ones operands: each output value is then the number of inner indices ``k`` with both
    ``A[i, k]`` and ``B[k, j]`` stored, and a positive count is never dropped as a zero. Costs
    O(npairs) in compiled code and O(nnz_C) memory, against the pair lists' O(npairs) memory
    and sort.
    """
    if a.cols != b.rows:
        raise ValueError(f"inner dimensions differ: {a.shape} @ {b.shape}")
    ones_a = sp.csr_array((np.ones(a.nnz, dtype=np.int64), a.indices, a.indptr), shape=a.shape)
    ones_b = sp.csr_array((np.ones(b.nnz, dtype=np.int64), b.indices, b.indptr), shape=b.shape)
    c = ones_a @ ones_b
    c.sort_indices()
    return (np.asarray(c.indptr, dtype=np.int64), np.asarray(c.indices, dtype=np.int64),
            np.asarray(c.data, dtype=np.int64))


def expand_pairs(a: Pattern, b: Pattern) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All multiply pairs of ``A @ B`` as (row i, col j, entry of A, entry of B), in (i, k) order."""
    len_b = b.row_lengths()
    rep = len_b[a.indices]
    total = int(rep.sum())
    pa = np.repeat(np.arange(a.nnz, dtype=np.int64), rep)
    # entry of B: indptr_B[k] + (position within the run of pa)
    run_start = np.cumsum(rep) - rep
    within = np.arange(total, dtype=np.int64) - np.repeat(run_start, rep)
    pb = b.indptr[a.indices][pa] + within
    i = a.row_of_entry()[pa]
    j = b.indices[pb]
    return i, j, pa, pb


def spgemm_symbolic(a: Pattern, b: Pattern, dense_out: bool = False) -> ProductSymbolic:
    """Plan ``C = A @ B``: pattern of ``C`` (or the full pattern if ``dense_out``) and its pair lists.

    With ``dense_out`` the output is stored densely (row-major); positions no pair reaches are
    empty segments, i.e. computed zeros.
    """
    if a.cols != b.rows:
        raise ValueError(f"inner dimensions differ: {a.shape} @ {b.shape}")
    m, p = a.rows, b.cols
    i, j, pa, pb = expand_pairs(a, b)
    key = i * p + j
    order = np.argsort(key, kind="stable")  # stable: pairs of one entry stay in k order
    key, pa, pb = key[order], pa[order], pb[order]
    if dense_out:
        out = full_pattern(m, p)
        counts = np.bincount(key, minlength=m * p)
    else:
        uniq, counts = np.unique(key, return_counts=True)
        rows = uniq // p
        indptr = np.zeros(m + 1, dtype=np.int64)
        np.add.at(indptr, rows + 1, 1)
        indptr = np.cumsum(indptr)
        out = make_pattern((m, p), indptr, uniq % p)
    pair_ptr = np.zeros(out.nnz + 1, dtype=np.int64)
    np.cumsum(counts, out=pair_ptr[1:])
    return ProductSymbolic(out, pair_ptr, pa, pb)

