"""Symbolic work for graph-shaped models: the pattern of a block whose transposed Jacobian is a
sum of branch composites (a residual block, ``I + J_F^T``) or their side-by-side concatenation
(a channel concatenation), and the index maps that place each branch's values in it.

Done once at plan time; per step the block's values are one indexed add per branch (distinct entries).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import scipy.sparse as sp

__all__ = ["union_pattern", "identity_pattern", "product_pattern", "place"]


def identity_pattern(d: int) -> sp.csr_array:
    """The canonical CSR pattern of ``I_d``."""
    ar = np.arange(d, dtype=np.int64)
    return sp.csr_array((np.ones(d), ar, np.arange(d + 1, dtype=np.int64)), shape=(d, d))


def _keys(p: sp.csr_array, col_offset: int, width: int) -> np.ndarray:
    rows = np.repeat(np.arange(p.shape[0], dtype=np.int64), np.diff(p.indptr))
    return rows * np.int64(width) + (p.indices.astype(np.int64) + col_offset)


def union_pattern(patterns: Sequence[sp.csr_array],
                  col_offsets: Optional[Sequence[int]] = None) -> tuple[sp.csr_array, list[np.ndarray]]:
    """The canonical CSR pattern of ``sum_b P_b`` (``col_offsets=None``: all ``(d_in, d_out)``) or of
    ``[P_1 | P_2 | ...]`` (``col_offsets[b]`` the first column of branch ``b``), and per branch the
    position in it of each of ``P_b``'s entries, in ``P_b``'s CSR order.

    Every pattern must be canonical CSR (sorted, no duplicates) with the same number of rows.
    """
    if not patterns:
        raise ValueError("patterns: expected at least one branch pattern, got none")
    d_in = patterns[0].shape[0]
    for b, p in enumerate(patterns):
        if p.shape[0] != d_in:
            raise ValueError(f"patterns[{b}]: expected {d_in} rows (the block input), got {p.shape[0]}")
    if col_offsets is None:
        d_out = patterns[0].shape[1]
        for b, p in enumerate(patterns):
            if p.shape[1] != d_out:
                raise ValueError(f"patterns[{b}]: a sum needs {d_out} columns (the block output), got {p.shape[1]}")
        offsets = [0] * len(patterns)
    else:
        offsets = [int(o) for o in col_offsets]
        d_out = offsets[-1] + patterns[-1].shape[1]
    keys = [_keys(p, o, d_out) for p, o in zip(patterns, offsets)]
    union = np.concatenate(keys)
    union.sort(kind="stable")  # each branch's keys are already sorted: merging runs is cheap
    if union.size:
        union = union[np.concatenate(([True], union[1:] != union[:-1]))]
    rows, cols = np.divmod(union, np.int64(d_out))
    indptr = np.zeros(d_in + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=d_in), out=indptr[1:])
    pattern = sp.csr_array((np.ones(union.size), cols, indptr), shape=(d_in, d_out))
    maps = [np.searchsorted(union, k).astype(np.int64) for k in keys]
    return pattern, maps


def product_pattern(patterns: Sequence[sp.csr_array]) -> sp.csr_array:
    """The canonical CSR pattern of ``P_1 @ P_2 @ ... @ P_n`` (structural: every path counts, no
    cancellation), by SciPy's sparse product of the 0/1 patterns."""
    acc = sp.csr_array(patterns[0], dtype=np.float64, copy=True)
    acc.data[:] = 1.0
    for p in patterns[1:]:
        q = sp.csr_array(p, dtype=np.float64, copy=True)
        q.data[:] = 1.0
        acc = acc @ q
        acc.data[:] = 1.0  # keep the numbers small; only the structure matters
    acc = sp.csr_array(acc)
    acc.sum_duplicates()
    acc.sort_indices()
    acc.data[:] = 1.0
    return acc


def place(union: sp.csr_array, pattern: sp.csr_array, col_offset: int = 0) -> np.ndarray:
    """Position in ``union`` of each entry of ``pattern`` (CSR order), its columns shifted by
    ``col_offset``; ``ValueError`` if an entry is not in ``union``."""
    width = union.shape[1]
    u = _keys(union, 0, width)
    k = _keys(pattern, col_offset, width)
    pos = np.searchsorted(u, k)
    if k.size and (pos.max() >= u.size or not np.array_equal(u[np.minimum(pos, u.size - 1)], k)):
        raise ValueError("pattern: an entry lies outside the union pattern")
    return pos.astype(np.int64)
