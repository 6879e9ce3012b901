"""Row-wise numeric SpGEMM over a precomputed output pattern, with torch ops (the CPU backend).

``C = A @ B`` where ``C``'s pattern was planned once (:mod:`spscan.planner.rowwise`). The index
data held is O(nnz): the CSR structure of ``A``, ``B`` and ``C`` (plus ``C``'s entries as
row-major keys ``i * p + j``). The multiply pairs are generated at run time, one block of output
rows at a time (at most ``chunk_pairs`` pairs, so temporaries stay bounded), and accumulated
into the block's rows of ``C`` either through a dense row accumulator (output rows at least a
quarter full) or at the position found by a sorted search of ``j`` in ``C``'s row pattern.

Order and determinism: pairs are generated in ``(i, k, j)`` order and added in that order, so
each entry of ``C`` is summed in ascending ``k`` (the order of the planned pair lists). On the
CPU the accumulation is ``index_add_`` (sequential in index order); on other devices, where
``index_add_`` uses atomics, the pairs of one block are added slot by slot (the ``s``-th stored
entry of every row at once: no two pairs of one slot share an output entry), in ascending ``s``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from spscan.planner.patterns import Pattern

__all__ = ["RowsTorchTable", "rows_torch_table", "spgemm_rows_torch", "DENSE_ACC_MIN_DENSITY", "CHUNK_PAIRS"]

CHUNK_PAIRS = 1 << 20  # multiply pairs generated per block of output rows (bounds the temporaries)
DENSE_ACC_MIN_DENSITY = 0.25  # output rows at least this full use a dense row accumulator
_DENSE_ACC_MAX = 1 << 22  # dense accumulator entries per block (rows x columns)


@dataclass
class _Chunk:
    r0: int
    r1: int
    a0: int
    a1: int
    c0: int
    c1: int
    npairs: int
    slot_order: Optional[torch.Tensor] = None  # A entries of the block ordered by (slot, row) (non-CPU path)
    slot_bounds: Optional[list[int]] = None


@dataclass
class RowsTorchTable:
    """Device copies of the O(nnz) index data of one row-wise product ``C = A @ B``.

    Attributes:
        shape: ``(m, k, p)``; nnz: ``(nnz_A, nnz_B, nnz_C)``.
        a_cols, a_rows: ``(nnz_A,)`` column (= row of ``B``) and row of each entry of ``A``.
        b_ptr, b_len, b_cols: ``B``'s CSR offsets ``(k,)``, row lengths ``(k,)`` and columns ``(nnz_B,)``.
        c_keys: ``(nnz_C,)`` row-major keys ``i * p + j`` of ``C``'s entries (sorted).
        dense_acc: whether blocks accumulate densely; full: ``C`` is the full pattern.
    """

    shape: tuple[int, int, int]
    nnz: tuple[int, int, int]
    a_cols: torch.Tensor
    a_rows: torch.Tensor
    b_ptr: torch.Tensor
    b_len: torch.Tensor
    b_cols: torch.Tensor
    c_keys: torch.Tensor
    dense_acc: bool
    full: bool
    chunks: list[_Chunk]
    atomic_free: bool  # True when accumulation goes slot by slot (no index_add_)

    def index_bytes(self) -> int:
        t = (self.a_cols, self.a_rows, self.b_ptr, self.b_len, self.b_cols, self.c_keys)
        extra = sum(c.slot_order.numel() * 8 for c in self.chunks if c.slot_order is not None)
        return sum(x.numel() * x.element_size() for x in t) + extra


def _chunk_bounds(row_pairs: np.ndarray, cols: int, dense_acc: bool, chunk_pairs: int) -> np.ndarray:
    """Row boundaries of blocks of at most ``chunk_pairs`` pairs (a longer row is a block of its own)
    and, with a dense accumulator, at most ``_DENSE_ACC_MAX`` accumulator entries."""
    m = row_pairs.shape[0]
    before = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(row_pairs, out=before[1:])
    cuts = [np.nonzero(np.diff(before[:-1] // max(1, chunk_pairs)))[0] + 1]
    if dense_acc and cols:
        per = max(1, _DENSE_ACC_MAX // cols)
        cuts.append(np.arange(per, m, per))
    return np.unique(np.concatenate([[0, m], *cuts])).astype(np.int64)


def rows_torch_table(a: Pattern, b: Pattern, c: Pattern, device: torch.device, chunk_pairs: int = CHUNK_PAIRS,
                     atomic_free: Optional[bool] = None) -> RowsTorchTable:
    """Build the index data of ``C = A @ B`` on ``device`` (``c`` must contain the product's pattern).

    ``atomic_free``: accumulate slot by slot instead of ``index_add_`` (default: on non-CPU devices).
    """
    if a.cols != b.rows or c.shape != (a.rows, b.cols):
        raise ValueError(f"rows_torch_table: shapes do not chain: A {a.shape}, B {b.shape}, C {c.shape}")
    device = torch.device(device)
    if atomic_free is None:
        atomic_free = device.type != "cpu"
    m, p = a.rows, b.cols
    b_len = b.row_lengths()
    row_pairs = np.zeros(m, dtype=np.int64)
    if a.nnz:
        cs = np.zeros(a.nnz + 1, dtype=np.int64)
        np.cumsum(b_len[a.indices], out=cs[1:])
        row_pairs = cs[a.indptr[1:]] - cs[a.indptr[:-1]]
    dense_acc = c.nnz >= DENSE_ACC_MIN_DENSITY * m * p and not atomic_free
    bounds = _chunk_bounds(row_pairs, p, dense_acc, chunk_pairs)
    a_rows = a.row_of_entry()
    chunks = []
    for r0, r1 in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        ch = _Chunk(r0, r1, int(a.indptr[r0]), int(a.indptr[r1]), int(c.indptr[r0]), int(c.indptr[r1]),
                    int(row_pairs[r0:r1].sum()))
        if ch.npairs == 0 and ch.c1 == ch.c0:
            continue
        if atomic_free and ch.npairs:
            slot = np.arange(ch.a0, ch.a1, dtype=np.int64) - a.indptr[a_rows[ch.a0:ch.a1]]
            order = np.argsort(slot, kind="stable")
            counts = np.bincount(slot)
            ch.slot_order = torch.as_tensor(order + ch.a0, device=device)
            ch.slot_bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
        chunks.append(ch)
    dev = lambda x: torch.as_tensor(np.array(x, dtype=np.int64), device=device)  # noqa: E731  (a writable copy)
    c_keys = c.row_of_entry() * p + c.indices
    return RowsTorchTable(
        shape=(m, a.cols, p), nnz=(a.nnz, b.nnz, c.nnz), a_cols=dev(a.indices), a_rows=dev(a_rows),
        b_ptr=dev(b.indptr[:-1]), b_len=dev(b_len), b_cols=dev(b.indices), c_keys=dev(c_keys),
        dense_acc=dense_acc, full=c.is_full, chunks=chunks, atomic_free=atomic_free)


def _expand(t: RowsTorchTable, a_entries: torch.Tensor, npairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs of the given ``A`` entries, in their order then ``j`` ascending: (entry of A, entry of B, key i*p+j)."""
    k = t.a_cols[a_entries]
    rep = t.b_len[k]
    first = torch.cumsum(rep, 0) - rep  # where each A entry's run of pairs starts
    pa = torch.repeat_interleave(a_entries, rep, output_size=npairs)
    pb = torch.repeat_interleave(t.b_ptr[k] - first, rep, output_size=npairs)
    pb += torch.arange(npairs, device=pb.device)
    key = t.a_rows[pa] * t.shape[2] + t.b_cols[pb]
    return pa, pb, key


def spgemm_rows_torch(t: RowsTorchTable, a: torch.Tensor, b: torch.Tensor,
                      out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Numeric ``C = A @ B`` in ``C``'s planned pattern.

    Args:
        t: the product's index data (:func:`rows_torch_table`).
        a: ``A``'s values in CSR order, ``(nnz_A,)`` (shared) or ``(B, nnz_A)``.
        b: ``B``'s values, ``(nnz_B,)`` or ``(B, nnz_B)``.
        out: optional destination ``(nnz_C,)`` (both factors shared) or ``(B, nnz_C)``; may be a view
            into a larger arena. Every entry is overwritten.

    Returns:
        ``C``'s values in CSR order (``out`` when given).
    """
    nnz_a, nnz_b, nnz_c = t.nnz
    if a.shape[-1] != nnz_a or b.shape[-1] != nnz_b or a.dim() not in (1, 2) or b.dim() not in (1, 2):
        raise ValueError(f"spgemm_rows_torch: expected A values (.., {nnz_a}) and B values (.., {nnz_b}), got "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"spgemm_rows_torch: A and B values differ in dtype: {a.dtype} vs {b.dtype}")
    lead = ()
    for v in (a, b):
        if v.dim() == 2:
            if lead and lead != (v.shape[0],):
                raise ValueError(f"spgemm_rows_torch: batch sizes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
            lead = (v.shape[0],)
    if out is None:
        out = torch.empty(lead + (nnz_c,), dtype=a.dtype, device=a.device)
    elif tuple(out.shape) != lead + (nnz_c,) or out.dtype != a.dtype:
        raise ValueError(f"spgemm_rows_torch: out must be {lead + (nnz_c,)} of {a.dtype}, got "
                         f"{tuple(out.shape)} of {out.dtype}")
    p = t.shape[2]
    for ch in t.chunks:
        dst = out[..., ch.c0 : ch.c1]
        if ch.npairs == 0:
            dst.zero_()
            continue
        if t.atomic_free:
            dst.zero_()
            keys = t.c_keys[ch.c0 : ch.c1]
            bounds = ch.slot_bounds
            for s in range(len(bounds) - 1):
                ents = ch.slot_order[bounds[s] : bounds[s + 1]]
                n = int(t.b_len[t.a_cols[ents]].sum())
                if n == 0:
                    continue
                pa, pb, key = _expand(t, ents, n)
                pos = torch.searchsorted(keys, key)
                dst[..., pos] += a[..., pa] * b[..., pb]  # unique positions within one slot
            continue
        pa, pb, key = _expand(t, torch.arange(ch.a0, ch.a1, device=a.device), ch.npairs)
        vals = a[..., pa] * b[..., pb]
        if t.dense_acc:
            base = ch.r0 * p
            if t.full:
                dst.zero_()
                dst.index_add_(-1, key - base, vals)
            else:
                acc = torch.zeros(lead + ((ch.r1 - ch.r0) * p,), dtype=a.dtype, device=a.device)
                acc.index_add_(-1, key - base, vals)
                dst.copy_(acc[..., t.c_keys[ch.c0 : ch.c1] - base])
        else:
            dst.zero_()
            dst.index_add_(-1, torch.searchsorted(t.c_keys[ch.c0 : ch.c1], key), vals)
    return out
