"""The tables the compiled linear-run loops (:mod:`.chain_tiles`, :mod:`.chain_narrow`) read: where each
step's values lie (:func:`resolve_steps`), the taps' and feeds' per-step tables, the properties of the
run's CSR patterns they exploit (:func:`shared_column_blocks`, :func:`diagonal_bands`), and the
narrow-batch loop's blocks of shared rows (:func:`narrow_tables`).

All of it is index work, done when a run is planned or, with a memo, once per run and values
layout: nothing here grows with the batch, and nothing is redone per call that a memo keeps.

The loops take these tables as a few records (:class:`ChainSteps`, :class:`TapTables`,
:class:`FeedTables`, :class:`NarrowTables`, :class:`Reduction`), not one argument per array: named tuples,
which numba passes as tuples of their arrays (reading a field compiles to reading that array). A record
of index tables is made once, where its tables are made, and passed again call after call; the values
and the caller's buffers a call reads and writes travel beside them. numba works out a named tuple's type
on every call from its fields (about 6 k instructions a call for the tiled loop's four records, counted
with callgrind: 0.1 % of an rnn-1000 step's run), so the loops take few records, not one per table.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from spscan.kernels.backend import GATE_BANDS

__all__ = ["ENCODED_CODES", "MAX_SOURCES", "ChainSteps", "FeedTables", "NarrowTables", "Reduction", "TapTables",
           "diagonal_bands", "feed_tables", "homogeneous", "narrow_tables", "no_reduction", "resolve_steps",
           "shared_column_blocks", "tap_tables"]


class ChainSteps(NamedTuple):
    """A run's step tables as the compiled loops read them: :func:`.chain.run_chain`'s, checked, the defaults
    filled in and the patterns' properties worked out. Made once per step tables (``run_chain``'s memo keeps
    it), not per call. All arrays ``(steps,)`` int64 but the CSR tables and their properties."""

    code: np.ndarray  # 0 diagonal, 1/2 dense shared/per sample, 3/4 CSR shared/per sample, 5 gate bands
    src: np.ndarray  # which of the sources holds the step's values
    offset: np.ndarray  # where they start there
    bstride: np.ndarray  # from one sample's values to the next (0: shared)
    estride: np.ndarray  # from one entry of a per-sample step's values to the next
    rows: np.ndarray
    cols: np.ndarray
    add: np.ndarray  # column of the step's affine term in the vectors (-1: none)
    out: np.ndarray  # column of the step's output in the vectors (-1: not stored there)
    csr_ptr: np.ndarray  # where a CSR step's row starts begin in csr_indptr
    csr_indptr: np.ndarray  # the run's CSR tables (global positions in csr_indices)
    csr_indices: np.ndarray
    same: np.ndarray  # (len(csr_indptr),) bool: shared_column_blocks(csr_indptr, csr_indices)
    bands: np.ndarray  # (len(csr_indptr),) int64: diagonal_bands(csr_indptr, csr_indices)
    vin0: int  # column of the input y_{-1} in the vectors


class TapTables(NamedTuple):
    """:func:`tap_tables`: per step, ``steps + 1`` entries (the last for the input ``y_{-1}``), where the tapped
    rows go. Made once per taps (the memo keeps it); the buffers they name travel beside it, per call."""

    buf: np.ndarray  # index of the tap's buffer among the stored taps' (-1: the reducing tap)
    at: np.ndarray  # where the step's column starts in its buffer (-1: not tapped)
    ld: np.ndarray  # the buffer's row stride (the reducing tap: its operand's)
    row0: np.ndarray  # the first tapped row of the step's vector
    rows: np.ndarray  # how many


class FeedTables(NamedTuple):
    """:func:`feed_tables`: per step (``steps`` entries), where its affine terms lie in the caller's buffers.
    Made once per feeds (the memo keeps it); the buffers travel beside it, per call."""

    buf: np.ndarray  # index of the feed's buffer
    at: np.ndarray  # the step's first term there (-1: not fed)
    bs: np.ndarray  # from one sample's terms to the next
    fs: np.ndarray  # from one row's term to the next
    row0: np.ndarray  # the first fed row of the step's output
    rows: np.ndarray  # how many


class Reduction(NamedTuple):
    """The reducing tap's operands for the tiled loop (:mod:`.chain_tiles`): made per call, as they are the
    caller's operand and output and the call's scratch; :func:`no_reduction` where no tap reduces."""

    rows: int  # rows of the tapped vectors reduced
    cols: np.ndarray  # arange(C): the operand's columns
    op: np.ndarray  # the operand, (C, taps, B) flat
    ring: np.ndarray  # scratch: the tapped rows of a few dozen steps, a tile's lanes each
    zt: np.ndarray  # scratch: a partial tile's operand columns, zero-padded
    acc: np.ndarray  # scratch: lane-wise partial sums, (rows, C, LANES) flat
    out: np.ndarray  # (rows, C): the lane sums, the caller's buffer


@functools.lru_cache(maxsize=4)
def no_reduction(dtype, lanes: int) -> Reduction:
    """The :class:`Reduction` of a run without a reducing tap (the loop reads none of it), made once per dtype.
    Its arrays have the types a reducing tap's have, so both runs share one compiled loop."""
    dtype = np.dtype(dtype)
    dummy = np.zeros(lanes, dtype=dtype)
    return Reduction(0, np.zeros(0, dtype=np.int64), dummy, dummy, dummy, dummy, np.zeros((0, 0), dtype))


def feed_tables(feeds, steps: int, rows: np.ndarray, vectors: np.ndarray,
                memo: Optional[dict] = None) -> tuple[FeedTables, tuple]:
    """The per-step :class:`FeedTables` and the tuple of buffers of :func:`.chain.run_chain`'s ``feeds``,
    checked (every element a feed names lies within its buffer)."""
    if not feeds:
        return _no_feeds(steps, vectors.dtype)
    batch = vectors.shape[0]
    # the tables of the same feeds (steps arrays, rows, strides and offsets) come back every call: kept, with
    # the furthest element each feed reads from its offsets, so only the buffers are checked per call
    key = ("feeds", steps, batch) + tuple((id(f[0]), int(f[1]), int(f[2]), int(f[5]), int(f[6]),
                                            np.asarray(f[4], dtype=np.int64).tobytes()) for f in feeds)
    hit = None if memo is None else memo.get(key)
    if hit is not None:
        tables, reach, _ = hit
        bufs = [f[3] for f in feeds]
        if all(isinstance(b, np.ndarray) and b.dtype == vectors.dtype and b.ndim == 1 and r < b.size
               for b, r in zip(bufs, reach)):
            return tables, homogeneous(bufs)
    tables, bufs = _feed_tables_checked(feeds, steps, rows, vectors)
    if memo is not None:
        reach = [int(np.max(f[4], initial=-1)) + (batch - 1) * int(f[5]) + (int(f[2]) - 1) * int(f[6])
                 for f in feeds]
        _memo_put(memo, key, (tables, reach, [f[0] for f in feeds]))  # the steps arrays kept: their ids too
    return tables, bufs


def _feed_tables_checked(feeds, steps: int, rows: np.ndarray, vectors: np.ndarray):
    """:func:`feed_tables` without a memo: every feed checked, the tables made."""
    feed_buf = np.zeros(steps, dtype=np.int64)
    feed_at = np.full(steps, -1, dtype=np.int64)
    feed_bs = np.zeros(steps, dtype=np.int64)
    feed_fs = np.zeros(steps, dtype=np.int64)
    feed_row0 = np.zeros(steps, dtype=np.int64)
    feed_rows = np.zeros(steps, dtype=np.int64)
    batch = vectors.shape[0]
    bufs = []
    for f, (idx, row0, nrows, buf, at, bstride, fstride) in enumerate(feeds):
        idx = np.asarray(idx, dtype=np.int64)
        at = np.asarray(at, dtype=np.int64)
        row0, nrows, bstride, fstride = int(row0), int(nrows), int(bstride), int(fstride)
        if not isinstance(buf, np.ndarray) or buf.dtype != vectors.dtype or buf.ndim != 1:
            raise ValueError(f"feeds[{f}]: expected a 1-D {vectors.dtype} array")
        if at.shape != idx.shape or bstride < 0 or fstride < 0 or nrows < 1 or row0 < 0:
            raise ValueError(f"feeds[{f}]: expected one offset per step and non-negative strides")
        if idx.size and (idx.min() < 0 or idx.max() >= steps or np.any(row0 + nrows > rows[idx])):
            raise ValueError(f"feeds[{f}]: steps must lie in [0, {steps}) and rows {row0}..{row0 + nrows} within "
                             "each step's output")
        if idx.size and (at.min() < 0 or at.max() + (batch - 1) * bstride + (nrows - 1) * fstride >= buf.size):
            raise ValueError(f"feeds[{f}]: the terms reach past their buffer ({buf.size} elements)")
        before = int(np.count_nonzero(feed_at >= 0))
        feed_at[idx] = at
        if int(np.count_nonzero(feed_at >= 0)) != before + idx.size:
            raise ValueError(f"feeds[{f}]: a step is fed at most once")
        feed_buf[idx] = f
        feed_bs[idx] = bstride
        feed_fs[idx] = fstride
        feed_row0[idx] = row0
        feed_rows[idx] = nrows
        bufs.append(buf)
    return FeedTables(feed_buf, feed_at, feed_bs, feed_fs, feed_row0, feed_rows), homogeneous(bufs)


@functools.lru_cache(maxsize=16)
def _no_feeds(steps: int, dtype) -> tuple[FeedTables, tuple]:
    """:func:`feed_tables` of a run without feeds (the loop only reads them), made once per length and dtype."""
    zeros = np.zeros(steps, dtype=np.int64)
    tables = FeedTables(zeros, np.full(steps, -1, dtype=np.int64), zeros, zeros, zeros, zeros)
    for a in tables:
        a.flags.writeable = False
    return tables, _no_buffers(dtype)


@functools.lru_cache(maxsize=4)
def _no_buffers(dtype) -> tuple:
    """The buffers of no taps or no feeds: one placeholder the loop never reads, made once per dtype."""
    return homogeneous([np.zeros(1, dtype)])


def tap_tables(taps, steps: int, rows: np.ndarray, cols0: int, vectors: np.ndarray,
               memo: Optional[dict] = None) -> tuple[TapTables, tuple]:
    """The per-step :class:`TapTables` and the tuple of flat buffers of :func:`.chain.run_chain`'s ``taps``,
    checked. With ``memo`` (``run_chain``'s), the per-step tables of taps of the same step arrays (the same
    objects), rows and batch are kept; the buffers are checked per call."""
    batch = vectors.shape[0]
    key = ("taps", batch) + tuple((id(t[0]), int(t[1]), int(t[2]), _operand_of(t) is not None) for t in taps)
    hit = None if memo is None else memo.get(key)
    if hit is not None:
        kept, tables = hit
        bufs = []
        for t, k in zip(taps, kept):
            if not _tap_arrays_fit(t, len(k), batch, vectors.dtype):
                break
            if _operand_of(t) is None:
                bufs.append(t[3].reshape(-1))
        else:
            return tables, (homogeneous(bufs) if bufs else _no_buffers(vectors.dtype))
    tables, bufs = _tap_tables_checked(taps, steps, rows, cols0, vectors)
    if memo is not None:
        # the step arrays are kept with the tables, so their ids in the key stay theirs
        _memo_put(memo, key, ([t[0] for t in taps], tables))
    return tables, bufs


def _memo_put(memo: dict, key, value) -> None:
    """``memo[key] = value`` in :func:`.chain.run_chain`'s memo, bounded: past 16 entries (a caller passing new tap
    or feed step arrays every call) the tap and feed entries go; the step tables' entries (``"tables"``, and
    ``"narrow"``: :func:`narrow_tables`) stay."""
    if len(memo) > 16:
        kept = {k: memo[k] for k in ("tables", "narrow") if k in memo}
        memo.clear()
        memo.update(kept)
    memo[key] = value


def _tap_tables_checked(taps, steps: int, rows: np.ndarray, cols0: int, vectors: np.ndarray):
    """:func:`tap_tables` without a memo: every tap checked, the tables made."""
    # entry `steps` stands for the input y_{-1} (step -1)
    tap_buf = np.zeros(steps + 1, dtype=np.int64)
    tap_at = np.full(steps + 1, -1, dtype=np.int64)
    tap_ld = np.zeros(steps + 1, dtype=np.int64)
    tap_row0 = np.zeros(steps + 1, dtype=np.int64)
    tap_rows = np.zeros(steps + 1, dtype=np.int64)
    sizes = np.append(rows, cols0).astype(np.int64)  # rows of y_0 .. y_{steps-1}, then of y_{-1}
    batch = vectors.shape[0]
    bufs = []
    reducing = 0
    for t, tap in enumerate(taps):
        idx, row0, nrows, buf = tap[:4]
        operand = _operand_of(tap)
        idx = np.asarray(idx, dtype=np.int64)
        if operand is not None:
            reducing += 1
            if reducing > 1 or (idx.size and idx.min() == -1):
                raise ValueError(f"taps[{t}]: at most one tap reduces against an operand, and not the input y_-1")
        idx = np.where(idx == -1, steps, idx)  # the input's entry
        row0, nrows = int(row0), int(nrows)
        if not _tap_arrays_fit(tap, idx.shape[0], batch, vectors.dtype):
            shapes = [f"{a.shape} {a.dtype} (contiguous={a.flags.c_contiguous})" if isinstance(a, np.ndarray)
                      else type(a).__name__ for a in ((buf,) if operand is None else (buf, operand))]
            want = (f"({nrows}, {idx.shape[0]}, {batch})" if operand is None
                    else f"(C, {idx.shape[0]}, {batch}) operand and a ({nrows}, C) buffer")
            raise ValueError(f"taps[{t}]: expected C-contiguous {want} {vectors.dtype} arrays, got "
                             f"{', '.join(shapes)}")
        if idx.size and (idx.min() < 0 or idx.max() > steps or row0 < 0 or nrows < 0
                         or np.any(row0 + nrows > sizes[idx])):
            raise ValueError(f"taps[{t}]: steps must lie in [-1, {steps}) and rows {row0}..{row0 + nrows} within "
                             "each step's vector")
        before = int(np.count_nonzero(tap_at >= 0))
        tap_at[idx] = 0
        if int(np.count_nonzero(tap_at >= 0)) != before + idx.size:  # a step seen before, or twice here
            raise ValueError(f"taps[{t}]: a step is tapped at most once")
        # the buffer's index among the stored taps'; -1: the reducing tap (tap_ld: its operand's row stride)
        tap_buf[idx] = len(bufs) if operand is None else -1
        tap_at[idx] = np.arange(idx.size, dtype=np.int64) * batch
        tap_ld[idx] = idx.size * batch
        tap_row0[idx] = row0
        tap_rows[idx] = nrows
        if operand is None:
            bufs.append(buf.reshape(-1))
    return (TapTables(tap_buf, tap_at, tap_ld, tap_row0, tap_rows),
            homogeneous(bufs) if bufs else _no_buffers(vectors.dtype))


def _operand_of(tap) -> Optional[np.ndarray]:
    """A tap's operand (its fifth entry), or ``None`` for a tap that stores its rows."""
    return tap[4] if len(tap) > 4 else None


def _tap_arrays_fit(tap, ksteps: int, batch: int, dtype) -> bool:
    """Whether a tap's buffer (and operand) have the shapes, dtype and layout :func:`.chain.run_chain` needs."""
    nrows, buf, operand = int(tap[2]), tap[3], _operand_of(tap)
    arrays = (buf,) if operand is None else (buf, operand)
    if not all(isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.c_contiguous for a in arrays):
        return False
    if operand is None:
        return buf.shape == (nrows, ksteps, batch)
    return (operand.ndim == 3 and operand.shape[0] > 0 and operand.shape[1:] == (ksteps, batch)
            and buf.shape == (nrows, operand.shape[0]))


def homogeneous(arrays: Sequence[np.ndarray]) -> tuple:
    """``arrays`` as the homogeneous tuple the loop indexes at run time, padded (with its first array) to a
    power of two so few specializations compile."""
    n = 2
    while n < len(arrays):
        n *= 2
    return tuple(arrays) + (arrays[0],) * (n - len(arrays))

def shared_column_blocks(csr_indptr: np.ndarray, csr_indices: np.ndarray) -> np.ndarray:
    """``(len(csr_indptr),)`` bool: entry ``r`` is true where CSR rows ``r .. r+3`` of the run's tables
    (global row numbers, as ``csr_indptr`` counts them) are non-empty and have one column list, so a
    block of them reads each column's vector once (as the rows of a dense block embedded in a wider
    pattern).

    A property of the run's patterns: worked out once per run (the backend keeps it with the run's
    tables) and passed to :func:`.chain.run_chain`, not redone per call.
    """
    indptr = np.asarray(csr_indptr, dtype=np.int64)
    out = np.zeros(indptr.shape[0], dtype=np.bool_)
    R = indptr.shape[0] - 1
    if R < 4:
        return out
    n = np.diff(indptr)
    row = np.repeat(np.arange(R), n)  # the row of each entry
    pos = np.arange(indptr[0], indptr[-1])
    # each row against the next: same length and, slot by slot, the same column
    nxt_len = np.append(n[1:], -1)
    same_len = n == nxt_len
    ok = same_len[row]
    eq = np.zeros(pos.shape[0], dtype=np.bool_)
    eq[ok] = np.asarray(csr_indices)[pos[ok]] == np.asarray(csr_indices)[pos[ok] + n[row[ok]]]
    mismatched = np.bincount(row[~eq], minlength=R).astype(bool)
    row_eq = same_len & ~mismatched
    out[: R - 3] = (n[: R - 3] > 0) & row_eq[: R - 3] & row_eq[1 : R - 2] & row_eq[2 : R - 1]
    return out


def diagonal_bands(csr_indptr: np.ndarray, csr_indices: np.ndarray) -> np.ndarray:
    """``(len(csr_indptr),)`` int64: entry ``r`` is the number of consecutive rows from ``r`` (global row
    numbers of the run's tables) that form one diagonal band: each has row ``r``'s length, non-zero, and
    row ``r + d`` has row ``r``'s columns plus ``d`` (0 for an empty row; a lone row is a band of 1).

    Transposed Jacobians made of diagonal blocks have such rows (a :data:`~..backend.GATE_BANDS` step is
    five bands of ``H`` rows with one or two entries each), which the compiled loop then runs without
    reading each row's start and columns. Worked out once per run, like :func:`shared_column_blocks`.
    """
    indptr = np.asarray(csr_indptr, dtype=np.int64)
    R = indptr.shape[0] - 1
    out = np.zeros(indptr.shape[0], dtype=np.int64)
    if R < 1:
        return out
    idx = np.asarray(csr_indices, dtype=np.int64)
    n = np.diff(indptr)
    # follows[r]: row r + 1 continues row r's band (same non-zero length, every column shifted by one)
    follows = np.zeros(R, dtype=np.bool_)
    cand = np.flatnonzero((n[:-1] > 0) & (n[:-1] == n[1:]))
    if cand.size:
        cn = n[cand]
        row = np.repeat(np.arange(cand.size), cn)  # the candidate of each entry
        pos = np.arange(row.size) - np.repeat(np.cumsum(cn) - cn, cn) + np.repeat(indptr[cand], cn)
        bad = idx[pos + cn[row]] != idx[pos] + 1
        follows[cand] = np.bincount(row[bad], minlength=cand.size) == 0
    # a band runs from r to the first row s >= r that row s + 1 does not follow
    stop = np.minimum.accumulate(np.where(follows, R, np.arange(R))[::-1])[::-1]
    length = np.where(n > 0, stop - np.arange(R) + 1, 0)
    out[:R] = length
    return out


class NarrowTables(NamedTuple):
    """:func:`narrow_tables`: the shared steps' row blocks for :mod:`.chain_narrow`."""

    step_tv: np.ndarray  # (steps,) where the step's values start in tval (0 for others)
    step_fill: np.ndarray  # (steps,) 1 for the first step of its values: the call copies them into tval
    step_b0: np.ndarray  # (steps,) the step's blocks step_b0[j] .. step_b1[j] (empty for others)
    step_b1: np.ndarray
    blk_r0: np.ndarray  # per block: first row, rows (R), entries per row (n)
    blk_rows: np.ndarray
    blk_n: np.ndarray
    blk_col: np.ndarray  # where its column list starts in blk_cols
    blk_val: np.ndarray  # its first entry, counted from the step's first: the R x n values there, row by row
    blk_cols: np.ndarray  # csr_indices, then 0 .. k - 1 for the dense steps
    col_step: np.ndarray  # aligned with blk_cols: slot q of a block's row r reads column blk_cols[.] + r * col_step[.]
    size: int  # elements of tval: the shared values, one copy per distinct (source, offset, pattern)
    reads: int  # the shared values the run reads: size times their average reuse


def narrow_tables(code: np.ndarray, src: np.ndarray, offset: np.ndarray, rows: np.ndarray, cols: np.ndarray,
                  csr_ptr: np.ndarray, csr_indptr: np.ndarray, csr_indices: np.ndarray,
                  min_reuse: float = 0.0) -> NarrowTables:
    """The row blocks of a run's shared dense (code 1) and CSR (code 3) steps for the narrow-batch loop.

    A block is a run of consecutive rows whose column lists agree slot by slot, each slot's column the
    same in every row or one further per row (a dense step is one block; a recurrence's weight block
    with its diagonal band of identity entries is one). A call copies each block's values, transposed
    (the ``R`` rows' values of stored position ``q`` together), into a scratch ``tval`` the loop reads,
    so it runs the block's rows along the vector lanes, each row still summing its entries in stored
    order. Steps with the same values (source, offset and pattern: a recurrence's weight, step after
    step) share one copy, which is what makes the copy pay (``reads / size``). Where the run reads its
    shared values fewer than ``min_reuse`` times over, only ``size`` and ``reads`` are worked out (no
    blocks: a large CNN's patterns are not scanned for a loop that will not run). Index work only, once
    per run (``run_chain``'s memo keeps it).
    """
    steps = int(code.shape[0])
    indptr = np.asarray(csr_indptr, dtype=np.int64)
    shared = np.flatnonzero((code == 1) | (code == 3))
    keys = [(1, int(rows[j]), int(cols[j])) if code[j] == 1 else (3, int(csr_ptr[j]), int(rows[j])) for j in shared]
    nnz = {key: key[1] * key[2] if key[0] == 1 else int(indptr[key[1] + key[2]] - indptr[key[1]]) for key in keys}
    step_tv = np.zeros(steps, dtype=np.int64)
    step_fill = np.zeros(steps, dtype=np.int64)
    values: dict = {}  # (src, offset, pattern key) -> start in tval
    size = reads = 0
    for j, key in zip(shared, keys):
        vkey = (int(src[j]), int(offset[j]), key)
        if vkey not in values:
            values[vkey] = size
            step_fill[j] = 1
            size += nnz[key]
        step_tv[j] = values[vkey]
        reads += nnz[key]
    step_b0 = np.zeros(steps, dtype=np.int64)
    step_b1 = np.zeros(steps, dtype=np.int64)
    if reads < min_reuse * size:  # nothing the size of the patterns is made
        empty = np.zeros(0, dtype=np.int64)
        return NarrowTables(step_tv, np.zeros(steps, dtype=np.int64), step_b0, step_b1, *([empty] * 7), size,
                            reads)
    indices = np.asarray(csr_indices, dtype=np.int64)
    dense_k = int(cols[code == 1].max()) if (code == 1).any() else 0
    blk_cols = np.concatenate([indices, np.arange(dense_k, dtype=np.int64)])
    col_step = np.zeros(blk_cols.shape[0], dtype=np.int64)
    lens = np.diff(indptr)
    patterns: dict = {}  # pattern key -> (first block, blocks)
    blocks: list[np.ndarray] = []  # per pattern: (blocks, 5) r0, R, n, col, val
    nblk = 0
    for j, key in zip(shared, keys):
        if key not in patterns:
            if key[0] == 1:
                table = np.array([[0, key[1], key[2], indices.shape[0], 0]], dtype=np.int64)
            else:
                table = _row_blocks(indptr, indices, lens, key[1], key[2], col_step)
            patterns[key] = (nblk, table.shape[0])
            blocks.append(table)
            nblk += table.shape[0]
        b0, nb = patterns[key]
        step_b0[j], step_b1[j] = b0, b0 + nb
    table = np.concatenate(blocks) if blocks else np.zeros((0, 5), dtype=np.int64)
    cols_ = [np.ascontiguousarray(table[:, c]) for c in range(5)]
    return NarrowTables(step_tv, step_fill, step_b0, step_b1, *cols_, blk_cols, col_step, size, reads)


def _row_blocks(indptr: np.ndarray, indices: np.ndarray, lens: np.ndarray, cp: int, m: int, col_step: np.ndarray):
    """A CSR pattern's (rows ``cp .. cp + m`` of the run's tables) blocks of consecutive rows whose column
    lists agree slot by slot up to a shift (slot ``q`` of row ``r0 + r`` is column ``c_q + r * d_q``, ``d_q``
    0 or 1: a dense block, or a diagonal band beside it), as ``(blocks, 5)`` rows ``(r0, R, n, col,
    val)`` (``val``: its first entry, counted from the pattern's first). ``col_step[col + q] = d_q`` is set."""
    g0 = int(indptr[cp])
    rel = indptr[cp:cp + m + 1] - g0
    n = lens[cp:cp + m]
    # ok[r]: row r + 1 has row r's length and, slot by slot, its column or the next; same[r]: with the
    # same shifts as row r - 1 to row r
    ok = np.zeros(max(m - 1, 0), dtype=np.bool_)
    same = np.zeros(max(m - 1, 0), dtype=np.bool_)
    cand = np.flatnonzero(n[:-1] == n[1:]) if m > 1 else np.zeros(0, dtype=np.int64)
    shift = np.full(int(rel[-1]), -1, dtype=np.int64)  # entry of row r: its column in row r + 1 minus its own
    if cand.size:
        cn = n[cand]
        row = np.repeat(np.arange(cand.size), cn)
        pos = g0 + np.arange(row.size) - np.repeat(np.cumsum(cn) - cn, cn) + np.repeat(rel[cand], cn)
        d = indices[pos + cn[row]] - indices[pos]
        shift[pos - g0] = d
        ok[cand] = np.bincount(row[(d != 0) & (d != 1)], minlength=cand.size) == 0
        pair = cand[(cand >= 1) & ok[cand]]
        pair = pair[ok[pair - 1] & (n[pair - 1] == n[pair])]
        if pair.size:
            pn = n[pair]
            prow = np.repeat(np.arange(pair.size), pn)
            e = np.arange(prow.size) - np.repeat(np.cumsum(pn) - pn, pn) + np.repeat(rel[pair], pn)
            bad = shift[e] != shift[e - pn[prow]]
            same[pair] = np.bincount(prow[bad], minlength=pair.size) == 0
    first = np.ones(m - 1, dtype=np.bool_) if m > 1 else ok
    if m > 2:
        first[1:] = ~ok[:-1]
    cont = ok & (first | same)
    r0 = np.flatnonzero(np.concatenate([[True], ~cont])) if m else np.zeros(0, dtype=np.int64)
    R = np.diff(np.append(r0, m))
    multi = r0[R > 1]
    if multi.size:  # a block's shifts: its first row's to its second
        mn = n[multi]
        e = np.arange(mn.sum()) - np.repeat(np.cumsum(mn) - mn, mn) + np.repeat(rel[multi], mn)
        col_step[g0 + e] = shift[e]
    table = np.stack([r0, R, n[r0], g0 + rel[r0], rel[r0]], axis=1).astype(np.int64)
    return table


# at most this many value arrays per run: the loop indexes them as one homogeneous tuple
MAX_SOURCES = 16

# the compact value forms (kernels.backend.ValueEncoding names) the loop applies directly, and their codes
ENCODED_CODES = {GATE_BANDS: 5}


def resolve_steps(code: Sequence[int], shared: Sequence[bool], layers: Sequence[int], offsets: Sequence[int],
                  arena_s: np.ndarray, arena_p: np.ndarray, inputs: Optional[Callable], dtype,
                  memo: Optional[dict] = None) \
        -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]]:
    """Where each step's values lie: ``(code, src, offset, bstride, estride, sources)`` for
    :func:`.chain.run_chain`, or ``None`` when some input matrix is not a plain strided view of a
    contiguous CPU tensor of ``dtype`` (or is encoded in a form the loop does not know).

    Steps over products read the arenas (``arena_s`` 1-D, shared; ``arena_p`` ``(B, size_p)``);
    steps over input layers (``layers[j] >= 0`` and ``inputs`` given) read the caller's tensor
    ``inputs(layer)`` (``(nnz,)`` shared or ``(B, nnz)``) in place, through its base tensor. ``code``
    is ``code`` with the steps over encoded periodic elements given their form's code
    (:data:`ENCODED_CODES`), which reads the compact numbers in place.

    ``memo``: a dict the caller keeps per run (``code``, ``shared``, ``layers`` and ``offsets`` the
    same every call): periodic values laid out as in an earlier call (each element at the same place
    in a base tensor of the same size, as recycled buffers are) reuse that call's step tables; only
    the list of sources is made again.
    """
    import torch

    if not arena_p.flags.c_contiguous or not arena_s.flags.c_contiguous:
        return None
    owner = getattr(inputs, "__self__", None)
    if hasattr(owner, "elements") and hasattr(owner, "periods"):
        sources = [arena_s.reshape(-1), arena_p.reshape(-1)]
        facts = _periodic_facts(owner, sources, dtype)
        if facts is None:
            return None
        key = ("periodic", facts, arena_p.shape[1] if arena_p.ndim == 2 else 0)
        tables = None if memo is None else memo.get(key)
        if tables is None:
            tables = _periodic_tables(facts, code, shared, layers, offsets, arena_p)
            if memo is not None:
                if len(memo) > 16:
                    memo.clear()
                memo[key] = tables
        return None if tables is None else (*tables, sources)
    sources = [arena_s.reshape(-1), arena_p.reshape(-1)]
    if isinstance(owner, torch.Tensor) and owner.dim() in (2, 3) and inputs is not None:
        # stacked values: one tensor (n, nnz) or (n, B, nnz), layer i at row i
        if owner.dtype != dtype or owner.device.type != "cpu" or owner.stride(-1) != 1:
            return None
        base = owner if owner._base is None else owner._base
        if not base.is_contiguous():
            return None
        start = (owner.data_ptr() - base.data_ptr()) // owner.element_size()
        sources.append(base.detach().numpy().reshape(-1))
        # the step tables follow from the layout alone: the same objects every call of that layout (the
        # loop's checks of them are kept too, cpu_chain.run_chain's memo)
        layout = ("stacked", start, owner.stride(0), owner.stride(1) if owner.dim() == 3 else 0,
                  arena_p.shape[1] if arena_p.ndim == 2 else 0)
        tables = None if memo is None else memo.get(layout)
        if tables is None:
            code_a, src, off, bst, est = tables = _arena_tables(code, shared, offsets, arena_p)
            lay = np.asarray(layers, dtype=np.int64)
            from_input = np.flatnonzero(lay >= 0)
            src[from_input] = len(sources) - 1
            off[from_input] = start + lay[from_input] * owner.stride(0)
            bst[from_input] = layout[3]
            if memo is not None:
                if len(memo) > 16:
                    memo.clear()
                memo[layout] = tables
        return (*tables, sources)
    code_a, src, off, bst, est = _arena_tables(code, shared, offsets, arena_p)
    lay = np.asarray(layers, dtype=np.int64)
    if inputs is None:
        return code_a, src, off, bst, est, sources
    from_input = np.flatnonzero(lay >= 0)
    if from_input.size == 0:
        return code_a, src, off, bst, est, sources
    get = owner.__getitem__ if isinstance(owner, (list, tuple)) else inputs
    tensors = [get(i) for i in lay[from_input].tolist()]
    # distinct tensors once (a shared matrix repeats along the run), then distinct base tensors once
    uniq_ids, first, inverse = np.unique(np.fromiter(map(id, tensors), dtype=np.int64, count=len(tensors)),
                                         return_index=True, return_inverse=True)
    uniq = [tensors[k] for k in first.tolist()]
    if not all(isinstance(t, torch.Tensor) for t in uniq):
        return None
    u_base = [t if t._base is None else t._base for t in uniq]
    slots: dict[int, int] = {}
    for base in {id(b): b for b in u_base}.values():
        if (base.dtype != dtype or base.device.type != "cpu" or not base.is_contiguous()
                or len(sources) >= MAX_SOURCES):
            return None
        slots[id(base)] = len(sources)
        sources.append(base.detach().numpy().reshape(-1))
    u_src = np.fromiter((slots[id(b)] for b in u_base), dtype=np.int64, count=len(uniq))
    u_ptr = np.fromiter((t.data_ptr() - b.data_ptr() for t, b in zip(uniq, u_base)), dtype=np.int64, count=len(uniq))
    layout = [(t.dim(), t.stride(-1), t.stride(0)) for t in uniq]  # (t.stride() with no argument is slow)
    if any(nd not in (1, 2) or last != 1 for nd, last, _ in layout):
        return None
    u_bst = np.fromiter((s0 if nd == 2 else 0 for nd, _, s0 in layout), dtype=np.int64, count=len(uniq))
    src[from_input] = u_src[inverse]
    off[from_input] = u_ptr[inverse] // sources[-1].itemsize
    bst[from_input] = u_bst[inverse]
    return code_a, src, off, bst, est, sources


def _arena_tables(code: Sequence[int], shared: Sequence[bool], offsets: Sequence[int], arena_p: np.ndarray):
    """``(code, src, offset, bstride, estride)`` with every step reading the arenas: per-sample steps
    ``P`` (source 1, a sample's row apart), the others ``S`` (source 0); ``code`` as an int64 array."""
    steps = len(code)
    code = np.asarray(code, dtype=np.int64)
    src = np.zeros(steps, dtype=np.int64)
    off = np.asarray(offsets, dtype=np.int64).copy()
    bst = np.zeros(steps, dtype=np.int64)
    est = np.ones(steps, dtype=np.int64)
    per_sample = (code == 2) | (code == 4) | ((code == 0) & ~np.asarray(shared, dtype=bool))
    src[per_sample] = 1
    bst[per_sample] = arena_p.shape[1] if arena_p.ndim == 2 else 0
    return code, src, off, bst, est


def _periodic_facts(owner, sources: list, dtype) -> Optional[tuple]:
    """Per element of periodic values (element ``k``: ``(nnz,)`` shared or ``(T, B, nnz)`` per sample, a
    per-sample one possibly stored entry-major: ``(T, nnz, B)`` memory viewed as ``(T, B, nnz)``):
    ``(source slot, start, time stride, sample stride, entry stride, base size, code)`` (``code`` -1
    unless the element is encoded in a form this loop knows), its base tensors appended to
    ``sources``; ``None`` where an element is not a strided view of a contiguous CPU tensor of
    ``dtype`` or is encoded in a form this loop does not know (the caller's loop reads it expanded)."""
    facts = []
    slots: dict[int, int] = {}
    for e, enc in zip(owner.elements, getattr(owner, "encodings", (None,) * len(owner.elements))):
        code = -1
        if enc is not None:
            code = ENCODED_CODES.get(enc.name, -2)
            if code < 0:
                return None
        base = e if e._base is None else e._base
        if (e.dtype != dtype or e.device.type != "cpu" or e.dim() not in (1, 3) or (e.dim() == 1 and e.stride(0) != 1)
                or not base.is_contiguous()):
            return None
        slot = slots.get(id(base))
        if slot is None:
            if len(sources) >= MAX_SOURCES:
                return None
            slot = slots[id(base)] = len(sources)
            sources.append(base.detach().numpy().reshape(-1))
        start = (e.data_ptr() - base.data_ptr()) // e.element_size()
        strides = (e.stride(0), e.stride(1), e.stride(2)) if e.dim() == 3 else (0, 0, 1)
        facts.append((slot, start) + strides + (base.numel(), code))
    return tuple(facts)


def _periodic_tables(facts: tuple, code: Sequence[int], shared: Sequence[bool], layers: Sequence[int],
                     offsets: Sequence[int], arena_p: np.ndarray) -> Optional[tuple]:
    """``(code, src, offset, bstride, estride)`` of :func:`resolve_steps` for periodic values with element
    ``facts`` (:func:`_periodic_facts`): element ``k`` of period ``t`` starts at ``start_k + t *
    stride_k``, sample ``b`` ``b * bstride_k`` later, entry ``q`` ``q * estride_k`` later; an encoded
    element's steps get its form's code (``None`` unless they were planned as per-sample dense or CSR
    steps). Steps over products read the arenas."""
    code, src, off, bst, est = _arena_tables(code, shared, offsets, arena_p)
    code = code.copy()
    lay = np.asarray(layers, dtype=np.int64)
    from_input = np.flatnonzero(lay >= 0)
    if from_input.size:
        f = np.asarray(facts, dtype=np.int64)  # (elements, 7)
        t, k = np.divmod(lay[from_input], f.shape[0])
        src[from_input] = f[k, 0]
        off[from_input] = f[k, 1] + t * f[k, 2]
        bst[from_input] = f[k, 3]
        est[from_input] = f[k, 4]
        encoded = f[k, 6] >= 0
        if encoded.any():
            at = from_input[encoded]
            planned = code[at]
            if not np.all((planned == 2) | (planned == 4)):
                return None
            code[at] = f[k[encoded], 6]
    return code, src, off, bst, est
