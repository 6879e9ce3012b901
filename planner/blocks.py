"""Symbolic work for graph-shaped models: the pattern of a block whose transposed Jacobian is a
sum of branch composites (a residual block, ``I + J_F^T``) or their side-by-side concatenation
(a channel concatenation), the pattern of a general block matrix assembled from placed blocks
(a live-set step of a general DAG: identity blocks for the tensors passing through, the node's
``J^T`` blocks), and the index maps that place each block's values in the result.

Done once at plan time; per step the values are one indexed add per block (distinct entries).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import scipy.sparse as sp

__all__ = ["union_pattern", "block_union", "identity_pattern", "product_pattern", "place"]


def identity_pattern(d: int) -> sp.csr_array:
    """The canonical CSR pattern of ``I_d``."""
    ar = np.arange(d, dtype=np.int64)
    return sp.csr_array((np.ones(d), ar, np.arange(d + 1, dtype=np.int64)), shape=(d, d))


def _keys(p: sp.csr_array, col_offset: int, width: int, row_offset: int = 0) -> np.ndarray:
    rows = np.repeat(np.arange(row_offset, row_offset + p.shape[0], dtype=np.int64), np.diff(p.indptr))
    return rows * np.int64(width) + (p.indices.astype(np.int64) + col_offset)


def block_union(shape: tuple[int, int], blocks: Sequence[tuple[int, int, sp.csr_array]]
                ) -> tuple[sp.csr_array, list[np.ndarray]]:
    """The canonical CSR pattern of the ``shape`` matrix that is the sum of the placed blocks, and per
    block the position in it of each of the block's entries (in the block's CSR order).

    ``blocks[b] = (row_offset, col_offset, P_b)``: ``P_b`` (canonical CSR) occupies rows
    ``row_offset .. row_offset + P_b.shape[0] - 1`` and the columns likewise. Blocks may overlap (their
    entries then share a position: the values are summed there).
    """
    n_rows, n_cols = int(shape[0]), int(shape[1])
    keys = []
    for b, (r, c, p) in enumerate(blocks):
        if r < 0 or c < 0 or r + p.shape[0] > n_rows or c + p.shape[1] > n_cols:
            raise ValueError(f"blocks[{b}]: a {p.shape[0]}x{p.shape[1]} block at ({r}, {c}) does not fit in "
                             f"{n_rows}x{n_cols}")
        keys.append(_keys(p, int(c), n_cols, int(r)))
    union = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    union.sort(kind="stable")  # each block's keys are already sorted: merging runs is cheap
    if union.size:
        union = union[np.concatenate(([True], union[1:] != union[:-1]))]
    rows, cols = np.divmod(union, np.int64(max(n_cols, 1)))
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n_rows), out=indptr[1:])
    pattern = sp.csr_array((np.ones(union.size), cols, indptr), shape=(n_rows, n_cols))
    maps = [np.searchsorted(union, k).astype(np.int64) for k in keys]
    return pattern, maps


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
    return block_union((d_in, d_out), [(0, o, p) for p, o in zip(patterns, offsets)])


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
