"""Row-wise numeric SpGEMM over a precomputed output pattern, with torch ops (the CPU backend).

``C = A @ B`` where ``C``'s pattern was planned once (:mod:`spscan.planner.rowwise`). The index
data held is O(nnz): the CSR structure of ``A``, ``B`` and ``C`` (plus ``C``'s entries as
row-major keys ``i * p + j``). The multiply pairs are generated at run time, one block of output
rows at a time (at most ``chunk_pairs`` pairs, so temporaries stay bounded), and accumulated
into the block's rows of ``C`` either through a dense row accumulator (output rows at least a
quarter full) or at the position found by a sorted search of ``j`` in ``C``'s row pattern.

Order and determinism: pairs are generated in ``(i, k, j)`` order and added in that order, so
each entry of ``C`` is summed in ascending ``k`` (the order of the planned pair lists). On the
CPU the index arithmetic runs in NumPy (its gathers and ``repeat`` cost a fraction of eager
torch's advanced indexing) and the accumulation is ``np.bincount`` (a sequential loop in input
order; it sums in float64, so float32 products are rounded once, at the end). On other devices,
where ``index_add_`` uses atomics, the pairs of one block are added slot by slot (the ``s``-th
stored entry of every row at once: no two pairs of one slot share an output entry), in
ascending ``s``.

A block accumulates densely when its rows' ``rows x p`` accumulator costs at most
``DENSE_ACC_MAX_RATIO`` times the product's pairs (dense or nearly dense outputs); otherwise
positions come from a search of the row-major key ``i * p + j`` among ``C``'s keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from spscan.planner.patterns import Pattern

__all__ = ["RowsTorchTable", "rows_torch_table", "spgemm_rows_torch", "DENSE_ACC_MAX_RATIO", "CHUNK_PAIRS"]

CHUNK_PAIRS = 1 << 20  # multiply pairs generated per block of output rows (bounds the temporaries)
DENSE_ACC_MAX_RATIO = 4  # dense accumulation when m * p <= this many times the pairs
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
    """The O(nnz) index data of one row-wise product ``C = A @ B``.

    Host arrays (NumPy, shared with the patterns where possible): ``a_cols`` ``(nnz_A,)`` (the
    rows of ``B`` that ``A``'s entries select), ``a_rows`` ``(nnz_A,)``, ``b_ptr``/``b_len``
    ``(k,)``, ``b_cols`` ``(nnz_B,)``, and ``c_keys`` ``(nnz_C,)`` (row-major keys ``i * p + j``,
    sorted; absent when ``C`` is full). With ``atomic_free`` the same arrays also live on the
    device (``dev``) and blocks accumulate slot by slot.
    """

    shape: tuple[int, int, int]
    nnz: tuple[int, int, int]
    a_cols: np.ndarray
    a_rows: np.ndarray
    b_ptr: np.ndarray
    b_len: np.ndarray
    b_cols: np.ndarray
    c_keys: Optional[np.ndarray]
    dense_acc: bool
    full: bool
    chunks: list[_Chunk]
    atomic_free: bool
    dev: dict[str, torch.Tensor]

    def index_bytes(self) -> int:
        """Bytes held beyond the operand and output patterns themselves."""
        own = self.a_rows.nbytes + (0 if self.c_keys is None else self.c_keys.nbytes) + self.b_len.nbytes
        extra = sum(c.slot_order.numel() * 8 for c in self.chunks if c.slot_order is not None)
        return int(own + extra + sum(t.numel() * t.element_size() for t in self.dev.values()))


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
    """Build the index data of ``C = A @ B`` for values on ``device`` (``c`` must contain the product's pattern).

    ``atomic_free``: accumulate slot by slot with torch ops (default, and required, on non-CPU
    devices); otherwise NumPy index arithmetic and ``np.bincount`` (CPU tensors only).
    """
    if a.cols != b.rows or c.shape != (a.rows, b.cols):
        raise ValueError(f"rows_torch_table: shapes do not chain: A {a.shape}, B {b.shape}, C {c.shape}")
    device = torch.device(device)
    if atomic_free is None or device.type != "cpu":
        atomic_free = device.type != "cpu" if atomic_free is None else atomic_free or device.type != "cpu"
    m, p = a.rows, b.cols
    b_len = b.row_lengths()
    row_pairs = np.zeros(m, dtype=np.int64)
    if a.nnz:
        cs = np.zeros(a.nnz + 1, dtype=np.int64)
        np.cumsum(b_len[a.indices], out=cs[1:])
        row_pairs = cs[a.indptr[1:]] - cs[a.indptr[:-1]]
    dense_acc = m * p <= DENSE_ACC_MAX_RATIO * max(1, int(row_pairs.sum())) and not atomic_free
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
    full = c.is_full
    c_keys = None if full else c.row_of_entry() * p + c.indices  # a full C's key is its position
    dev: dict[str, torch.Tensor] = {}
    if atomic_free:
        for name, arr in (("a_cols", a.indices), ("a_rows", a_rows), ("b_ptr", b.indptr[:-1]), ("b_len", b_len),
                          ("b_cols", b.indices), ("c_keys", c_keys)):
            if arr is None:
                continue
            dev[name] = torch.as_tensor(np.array(arr, dtype=np.int64), device=device)  # a writable copy
    return RowsTorchTable(
        shape=(m, a.cols, p), nnz=(a.nnz, b.nnz, c.nnz), a_cols=a.indices, a_rows=a_rows, b_ptr=b.indptr[:-1],
        b_len=b_len, b_cols=b.indices, c_keys=c_keys, dense_acc=dense_acc, full=full, chunks=chunks,
        atomic_free=atomic_free, dev=dev)


def _expand_torch(t: RowsTorchTable, a_entries: torch.Tensor, npairs: int):
    """Pairs of the given ``A`` entries, in their order then ``j`` ascending: (entry of A, entry of B, key i*p+j)."""
    d = t.dev
    k = d["a_cols"][a_entries]
    rep = d["b_len"][k]
    first = torch.cumsum(rep, 0) - rep  # where each A entry's run of pairs starts
    pa = torch.repeat_interleave(a_entries, rep, output_size=npairs)
    pb = torch.repeat_interleave(d["b_ptr"][k] - first, rep, output_size=npairs)
    pb += torch.arange(npairs, device=pb.device)
    key = d["a_rows"][pa] * t.shape[2] + d["b_cols"][pb]
    return pa, pb, key


def _np(x: torch.Tensor) -> np.ndarray:
    return (x.detach() if x.requires_grad else x).numpy()


def _run_numpy(t: RowsTorchTable, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """CPU path: NumPy index arithmetic per block, ``np.bincount`` accumulation (sequential, in pair order)."""
    an, bn, on = _np(a), _np(b), _np(out)
    batch = on.shape[0] if on.ndim == 2 else 0
    p = t.shape[2]
    for ch in t.chunks:
        dst = on[..., ch.c0 : ch.c1]
        n = ch.npairs
        if n == 0:
            dst[...] = 0
            continue
        k = t.a_cols[ch.a0 : ch.a1]
        rep = t.b_len[k]
        first = np.cumsum(rep) - rep
        pa = np.repeat(np.arange(ch.a0, ch.a1, dtype=np.int64), rep)
        pb = np.repeat(t.b_ptr[k] - first, rep)
        pb += np.arange(n, dtype=np.int64)
        key = np.repeat(t.a_rows[ch.a0 : ch.a1] - ch.r0, rep)
        key *= p
        key += t.b_cols[pb]
        vals = an[..., pa] * bn[..., pb]
        if t.dense_acc or t.full:
            width = (ch.r1 - ch.r0) * p
            take = None if t.full else t.c_keys[ch.c0 : ch.c1] - ch.r0 * p
        else:
            width = ch.c1 - ch.c0
            key = np.searchsorted(t.c_keys[ch.c0 : ch.c1], key + ch.r0 * p)
            take = None
        rows = [vals] if vals.ndim == 1 else list(vals)
        if vals.ndim == 1 and batch:  # shared factors but a per-sample destination cannot happen; keep shapes honest
            raise ValueError("spgemm_rows_torch: shared factors need a shared output")
        for s, v in enumerate(rows):
            acc = np.bincount(key, weights=v, minlength=width)
            res = acc if take is None else acc[take]
            if batch:
                dst[s] = res
            else:
                dst[...] = res


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
    if not t.atomic_free:
        if a.device.type != "cpu":
            raise ValueError(f"spgemm_rows_torch: this table runs on CPU tensors, got {a.device}")
        _run_numpy(t, a, b, out)
        return out
    for ch in t.chunks:
        dst = out[..., ch.c0 : ch.c1]
        dst.zero_()
        if ch.npairs == 0:
            continue
        keys = None if t.full else t.dev["c_keys"][ch.c0 : ch.c1]
        bounds = ch.slot_bounds
        for s in range(len(bounds) - 1):
            ents = ch.slot_order[bounds[s] : bounds[s + 1]]
            n = int(t.dev["b_len"][t.dev["a_cols"][ents]].sum())
            if n == 0:
                continue
            pa, pb, key = _expand_torch(t, ents, n)
            pos = key - ch.c0 if keys is None else torch.searchsorted(keys, key)
            dst[..., pos] += a[..., pa] * b[..., pb]  # unique positions within one slot
    return out
