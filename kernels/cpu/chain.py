"""Compiled CPU loop for a linear run (the linear-scan middle): the whole run in one call.

For steps ``j = 0 .. steps-1``::

    y_{-1} = vectors[:, vin0 : vin0 + cols[0]]
    y_j    = M_j y_{j-1}  (+ vectors[:, add[j] : add[j] + rows[j]]  if add[j] >= 0)
    vectors[:, out[j] : out[j] + rows[j]] = y_j

``M_j`` is diagonal (``code 0``: ``rows[j]`` values), dense (``code 1`` shared / ``2`` per sample:
a row-major ``(rows[j], cols[j])`` block) or CSR (``code 3`` shared / ``4`` per sample: ``nnz``
values in the order of its pattern, whose row starts are ``csr_indptr[csr_ptr[j] : csr_ptr[j] +
rows[j] + 1]`` and whose columns are ``csr_indices[csr_indptr[...]]``; the indptr entries are global
positions in ``csr_indices``, so a pattern shared by many steps is stored once). Its values for
sample ``b`` start at element ``offset[j] + b * bstride[j]`` of ``sources[src[j]]`` (``bstride 0``:
shared by the batch); entry ``p`` of a CSR step is at that start plus ``(p - csr_indptr[csr_ptr[j]]) *
estride[j]`` (``estride`` 1 unless the values are stored entry-major).

``code 5``: a :data:`~spscan.kernels.backend.GATE_BANDS` step, ``(5H, 2H)`` per sample, from its ``6H``
compact numbers, blocks of ``H`` in the order ``k, f, c_0, c_1, c_2, c_3`` (number ``q`` at the step's
start plus ``q * estride[j]``): with ``(x_1, x_2)`` the step's input and ``w = x_2 + k x_1``, its
output is ``(c_0 w, c_1 w, c_2 w, c_3 x_1, f w)``. Its 9H CSR values are products of these numbers,
so reading the numbers reads a third less and does six multiplies where the CSR rows do nine
(rounded differently: the CSR form sums ``(c_0 k) x_1 + c_0 x_2``).

Why numba: the run is thousands of tiny dependent mat-vecs (``20 x 20`` at a batch of 16), so NumPy's
and torch's per-call overhead, not arithmetic, bounds it. A compiled loop over the whole run
removes that overhead. ``numba`` (``@njit(cache=True)``) compiles on first use, caches the machine
code on disk, needs no compiler at install time (a torch C++ extension would) and no tracing per
chain length (``torch.compile`` would specialize or guard on the step count). No ``fastmath`` and no
``parallel``: every output is summed in ascending inner index (dense: column; CSR: stored position),
so results are bitwise reproducible run to run. The values of a step are read where they lie (arena
or the caller's tensor); only per-sample values stored sample by sample are copied, a tile at a
time, to be read across the batch. A CSR step costs O(nnz * B) multiply-adds, never O(rows * cols).
Without numba the NumPy loop in :mod:`spscan.kernels.torch_ops` runs instead (:func:`available`).

Modules: this one checks a run's arguments and calls the loop (:func:`run_chain`);
:mod:`.chain_tiles` is the loop (tiles of ``LANES`` samples, taps, prefetches);
:mod:`.chain_narrow` the loop for a batch of at most :data:`NARROW_MAX_BATCH` samples that reads its
shared values again and again (:data:`NARROW_MIN_REUSE`; one sample at a time, the lanes along the
features; bitwise the same sums);
:mod:`.chain_tables` makes the tables they read (where each step's values lie, taps, feeds, the
patterns' column blocks and diagonal bands) and the few records that carry them to the loops
(:class:`~.chain_tables.ChainSteps`, made once per step tables and kept in the caller's memo, and the
taps', feeds' and reducing tap's records).
"""

from __future__ import annotations

import functools
import operator
from typing import Optional, Sequence

import numpy as np

from spscan.kernels.cpu import chain_narrow as cpu_chain_narrow
from spscan.kernels.cpu.chain_tables import (MAX_SOURCES, ChainSteps, Reduction, diagonal_bands, feed_tables,
                                             homogeneous, narrow_tables, no_reduction, resolve_steps,
                                             shared_column_blocks, tap_tables)
from spscan.kernels.cpu.chain_tiles import compiled
from spscan.kernels.cpu.fpenv import flushing_subnormals
from spscan.kernels.cpu.jit import available
from spscan.kernels.cpu.simd import LANES

__all__ = ["MAX_SOURCES", "available", "diagonal_bands", "diagonal_runs", "resolve_steps", "run_chain",
           "shared_column_blocks"]

# A reducing tap multiplies out its rows every REDUCE_STEPS steps of a tile: its ring (rows x
# REDUCE_STEPS * LANES values) stays in L2, where storing every step's rows and a GEMM over them
# afterwards would write and read them through memory
REDUCE_STEPS = 32


_NO_CSR = np.zeros(1, dtype=np.int64)

# A batch of at most this many samples runs one sample at a time (cpu_chain_narrow), unless a reducing tap
# sums across it: a tile's LANES lanes would hold mostly padding (narrow / tiled training steps measured
# 0.55-0.73 at B = 1, 0.82-0.92 at 4, 0.93-1.00 at 6: bench/results/calibration.md) ...
NARROW_MAX_BATCH = 4
# ... and where each sample reads the run's shared dense and CSR values at least this many times over
# on average (a recurrence's weight, every step): the narrow loop copies them transposed first, which
# a run that reads each once (a CNN's layers) pays for and does not get back (calibration.md)
NARROW_MIN_REUSE = 2

# a per-sample step with at most this many entries has its values copied entry-major in one pass
# (a pass per row costs a loop setup per row and sample, much of a step whose rows hold 1-2
# entries); larger ones row by row, so the copy stays within L2
TV_STEP_ENTRIES = 4096


def run_chain(code: np.ndarray, src: np.ndarray, offset: np.ndarray, bstride: np.ndarray, rows: np.ndarray,
              cols: np.ndarray, add: np.ndarray, out: np.ndarray, vin0: int, sources: Sequence[np.ndarray],
              vectors: np.ndarray, csr_ptr: Optional[np.ndarray] = None, csr_indptr: Optional[np.ndarray] = None,
              csr_indices: Optional[np.ndarray] = None, estride: Optional[np.ndarray] = None,
              csr_blocks: Optional[np.ndarray] = None, csr_bands: Optional[np.ndarray] = None,
              taps: Sequence[tuple[np.ndarray, int, int, np.ndarray]] = (),
              feeds: Sequence[tuple[np.ndarray, int, int, np.ndarray, int, int, int]] = (),
              memo: Optional[dict] = None) -> None:
    """Run a whole linear run in place on ``vectors`` (see the module docstring for the math).

    Args:
        code, src, offset, bstride, rows, cols, add, out: ``(steps,)`` int64 arrays describing the
            steps (``code`` 0 diagonal, 1/2 dense, 3/4 CSR; ``add[j] = -1`` for no affine term).
        vin0: column of ``y_{-1}`` in ``vectors``.
        sources: 1-D C-contiguous arrays holding the matrices' values, of ``vectors``' dtype.
        vectors: ``(B, size_v)`` C-contiguous float32/float64 array, read and written in place.
        csr_blocks: :func:`shared_column_blocks` of the CSR tables (worked out here when not given).
        csr_bands: :func:`diagonal_bands` of the CSR tables (worked out here when not given).
        taps: ``(steps, row0, rows, buf)`` each: for step ``k`` of ``steps`` (an int64 array of step
            indices; ``-1``: the input ``y_{-1}``), rows ``row0 .. row0 + rows`` of ``y_{steps[k]}`` are
            also written to ``buf[:, k]``
            (``buf``: a C-contiguous ``(rows, len(steps), B)`` array of ``vectors``' dtype, one per
            tap: feature-major, as a tile holds them), as the run produces them. A step is tapped at
            most once. A tap ``(steps, row0, rows, buf, operand)`` with an ``operand`` (C-contiguous
            ``(C, len(steps), B)``) reduces instead: ``buf`` ``(rows, C)`` receives
            ``sum_k sum_b y_{steps[k]}[b, row0 + r] * operand[c, k, b]`` (the product of the stacked
            rows with the operand's, over all steps and samples), computed a few dozen steps at a
            time from rows that are never stored (at most one such tap; not of the input).
        feeds: ``(steps, row0, rows, buf, at, bstride, fstride)`` each: affine terms read where the
            caller holds them. For step ``k`` of ``steps``, row ``row0 + r`` (``r < rows``) of
            ``y_{steps[k]}`` for sample ``b`` gets ``buf[at[k] + b * bstride + r * fstride]`` added
            (``at``: ``(len(steps),)`` int64; ``buf``: 1-D, of ``vectors``' dtype, one per feed; read
            fastest with ``bstride`` 1 or ``fstride`` 1). After ``add[j]``'s term where a step has both.
        out: ``out[j] = -1``: ``y_j`` is not written to ``vectors`` (no caller reads it there; a tap
            may still take its rows).
        estride: ``(steps,)`` int64 element distance between consecutive entries of a per-sample
            step's values (default 1: each sample's values contiguous). A per-sample step stored
            entry-major (``bstride 1``, ``estride`` = the batch) is read in place, without the copy
            a sample-major one needs.
        csr_ptr: ``(steps,)`` int64, where each CSR step's row starts begin in ``csr_indptr`` (any value
            for other steps); csr_indptr, csr_indices: the run's CSR tables (1-D int64, see
            :class:`~spscan.planner.program.LinearRun`). Needed only when a step is CSR.
        memo: a dict the caller keeps for a run it makes again and again: the step tables' checks and
            what is worked out from them (scratch sizes, column blocks, bands) are kept there and
            skipped when the next call passes the very same table arrays (the same objects, which
            the caller promises not to change in place), and so are the per-step tap and feed tables
            of the same tap and feed steps and offsets (the buffers are checked every call).

    Raises ``RuntimeError`` without numba, ``TypeError``/``ValueError`` on mismatched arrays. Bounds
    are the caller's contract (the plan's offsets and patterns); they are not re-checked per element.
    """
    if not available():
        raise RuntimeError("spscan.kernels.cpu.chain needs numba (pip install numba); use the NumPy loop instead")
    if vectors.dtype not in (np.float32, np.float64) or vectors.ndim != 2 or not vectors.flags.c_contiguous:
        raise TypeError(f"vectors: expected a C-contiguous 2-D float32/float64 array, got {vectors.dtype} "
                        f"{vectors.ndim}-D (contiguous={vectors.flags.c_contiguous})")
    steps = int(code.shape[0])
    if steps == 0:
        return
    tables = (code, src, offset, bstride, estride, rows, cols, add, out, csr_ptr, csr_indptr, csr_indices,
              csr_blocks, csr_bands)
    hit = None if memo is None else memo.get("tables")
    if hit is not None and int(vin0) == hit[0] and len(hit[1]) == len(tables) and all(
            map(operator.is_, hit[1], tables)):
        st, width, longest, drun = hit[2]
    else:
        st, width, longest = _checked_tables(code, src, offset, bstride, estride, rows, cols, add, out, int(vin0),
                                             csr_ptr, csr_indptr, csr_indices, csr_blocks, csr_bands)
        drun = None  # the narrow loop's diagonal runs, worked out when it first runs these tables
        if memo is not None:
            memo.clear()
            memo["tables"] = (int(vin0), tables, [st, width, longest, drun])
    for i, s in enumerate(sources):
        if s.dtype != vectors.dtype or s.ndim != 1 or not s.flags.c_contiguous:
            raise TypeError(f"sources[{i}]: expected a C-contiguous 1-D {vectors.dtype} array, got {s.dtype} "
                            f"{s.ndim}-D")
    srcs = homogeneous(sources)
    red = next((t for t in taps if len(t) > 4 and t[4] is not None), None)
    if vectors.shape[0] <= NARROW_MAX_BATCH and red is None:
        nt = None if memo is None else memo.get("narrow")
        if nt is None:
            nt = narrow_tables(st.code, st.src, st.offset, st.rows, st.cols, st.csr_ptr, st.csr_indptr,
                               st.csr_indices, NARROW_MIN_REUSE)
            if memo is not None:
                memo["narrow"] = nt
        if nt.reads >= NARROW_MIN_REUSE * max(vectors.shape[0], 1) * nt.size:  # (blocks made where this holds)
            if drun is None:
                drun = diagonal_runs(st.code, st.src, st.bstride, st.estride, st.rows)
                if memo is not None:
                    memo["tables"][2][3] = drun
            _run_narrow(nt, st, drun, srcs, vectors, width, taps, feeds, memo)
            return
    dt = vectors.dtype
    cur = np.zeros(width * LANES, dtype=dt)
    nxt = np.zeros(width * LANES, dtype=dt)
    tv = np.zeros(longest * LANES, dtype=dt)
    tap_t, tap_bufs = tap_tables(taps, steps, st.rows, int(st.cols[0]), vectors, memo)
    feed_t, feed_bufs = feed_tables(feeds, steps, st.rows, vectors, memo)
    if red is None:
        reduction = no_reduction(dt, LANES)
    else:
        nrows, operand, target = int(red[2]), red[4], red[3]
        C = operand.shape[0]
        # ring rows one vector longer than they hold: rows a power of two apart would all fall in a
        # few L1 sets (the 80 rows of 32 steps at float32: 2 of 64)
        rs = (REDUCE_STEPS + 1) * LANES
        reduction = Reduction(nrows, np.arange(C, dtype=np.int64), operand.reshape(-1),
                              np.empty(nrows * rs, dtype=dt), np.empty(C * rs, dtype=dt),
                              np.zeros(nrows * C * LANES, dtype=dt), target)
    with flushing_subnormals():  # a decaying gradient's subnormals cost ~100x each (cpu_fpenv)
        compiled()(st, srcs, vectors, cur, nxt, tv, tap_t, tap_bufs, feed_t, feed_bufs, reduction)


def diagonal_runs(code: np.ndarray, src: np.ndarray, bstride: np.ndarray, estride: np.ndarray,
                  rows: np.ndarray) -> np.ndarray:
    """``(steps,)`` int64: for each step, how many steps from it on are diagonals (code 0) whose values lie
    row after row (shared, or per sample with unit entry stride), of one source array and one size: the
    narrow loop runs such a stretch (elementwise layers back to back) through one tight loop, up to the
    first step with an affine term, a feed or a tap (known per call). 0 for a step that is not such a
    diagonal. Worked out once per step tables (:func:`run_chain`'s memo)."""
    steps = int(code.shape[0])
    plain = (code == 0) & ((estride == 1) | (bstride == 0))
    link = np.zeros(steps, dtype=bool)  # step j's stretch goes on to step j + 1
    link[:-1] = plain[:-1] & plain[1:] & (src[1:] == src[:-1]) & (rows[1:] == rows[:-1])
    ends = np.flatnonzero(~link) + 1  # one past the last step of each stretch (the last step ends one)
    at = np.arange(steps, dtype=np.int64)
    runs = ends[np.searchsorted(ends, at, side="right")] - at
    return np.where(plain, runs, 0).astype(np.int64)


def _run_narrow(nt, st: ChainSteps, drun: np.ndarray, srcs: tuple, vectors: np.ndarray, width: int, taps, feeds,
                memo) -> None:
    """:func:`run_chain` on a narrow batch: :mod:`.chain_narrow`'s loop over the row blocks ``nt`` of the step
    tables ``st`` (``drun``: their :func:`diagonal_runs`; ``srcs``: the sources as one tuple)."""
    steps = int(st.code.shape[0])
    dt = vectors.dtype
    tval = np.empty(max(nt.size, 1), dtype=dt)
    cur = np.zeros(width, dtype=dt)
    nxt = np.zeros(width, dtype=dt)
    tap_t, tap_bufs = tap_tables(taps, steps, st.rows, int(st.cols[0]), vectors, memo)
    feed_t, feed_bufs = feed_tables(feeds, steps, st.rows, vectors, memo)
    with flushing_subnormals():
        cpu_chain_narrow.compiled()(st, nt, drun, srcs, vectors, cur, nxt, tval, _zero(dt), tap_t, tap_bufs, feed_t,
                                    feed_bufs)


@functools.lru_cache(maxsize=4)
def _zero(dtype) -> np.ndarray:
    """``(1,)``: a zero of ``dtype``, where the narrow loop's scalar sums start (only read), made once per dtype."""
    return np.zeros(1, dtype=dtype)


def _checked_tables(code, src, offset, bstride, estride, rows, cols, add, out, vin0, csr_ptr, csr_indptr,
                    csr_indices, csr_blocks, csr_bands) -> tuple[ChainSteps, int, int]:
    """:func:`run_chain`'s step tables checked, and what the loops need worked out from them: ``(steps, width,
    longest)``, ``steps`` the :class:`~.chain_tables.ChainSteps` the loops read (the defaults filled in: made
    here, once per step tables), ``width`` the rows of the running vector, ``longest`` the entries of the
    entry-major values scratch."""
    steps = int(code.shape[0])
    if estride is None:
        estride = np.ones(steps, dtype=np.int64)
    for name, arr in (("src", src), ("offset", offset), ("bstride", bstride), ("estride", estride), ("rows", rows),
                      ("cols", cols), ("add", add), ("out", out)):
        if arr.shape != (steps,) or arr.dtype != np.int64:
            raise ValueError(f"{name}: expected ({steps},) int64, got {arr.shape} {arr.dtype}")
    if code.dtype != np.int64 or code.min() < 0 or code.max() > 5:
        raise ValueError(f"code: expected int64 codes 0..5, got {code.dtype} in [{code.min()}, {code.max()}]")
    gate = code == 5
    if gate.any() and (np.any(rows[gate] % 5 != 0) or np.any(rows[gate] == 0)
                       or np.any(5 * cols[gate] != 2 * rows[gate])):
        raise ValueError("code 5 (gate bands) steps: expected (5H, 2H) steps")
    if code.max() >= 3:
        for name, arr, shape in (("csr_ptr", csr_ptr, (steps,)), ("csr_indptr", csr_indptr, None),
                                 ("csr_indices", csr_indices, None)):
            if (arr is None or arr.dtype != np.int64 or arr.ndim != 1 or not arr.flags.c_contiguous
                    or (shape is not None and arr.shape != shape)):
                got = "None" if arr is None else f"{arr.shape} {arr.dtype}"
                raise ValueError(f"{name}: a run with CSR steps needs a C-contiguous 1-D int64 array"
                                 f"{f' of shape {shape}' if shape else ''}, got {got}")
    else:
        csr_ptr = np.zeros(steps, dtype=np.int64)
        csr_indptr = csr_indices = _NO_CSR
        csr_blocks = csr_bands = None
    # the running vector and the next one, one tile of LANES samples: every y_j has rows[j] entries
    # and y_{-1} has cols[0]
    width = int(max(rows.max(), cols[0]))
    # per-sample dense or CSR values, entry-major: a whole step's when it has at most TV_STEP_ENTRIES
    # entries (one copy per step), else one row's (at most the longest row of the run's patterns)
    longest = 1
    dense_p = code == 2
    if dense_p.any():
        longest = max(longest, int((rows[dense_p] * cols[dense_p]).max()))
    csr_p = np.flatnonzero(code == 4)
    if csr_p.size:
        starts = csr_ptr[csr_p]
        longest = max(longest, int((csr_indptr[starts + rows[csr_p]] - csr_indptr[starts]).max()))
    if longest > TV_STEP_ENTRIES:
        longest = max(int(cols[dense_p].max()) if dense_p.any() else 1,
                      int(np.diff(csr_indptr).max()) if csr_p.size else 1)
    if gate.any():  # a compact gate step is always copied whole
        longest = max(longest, 6 * int(rows[gate].max()) // 5)
    if csr_blocks is None:
        csr_blocks = shared_column_blocks(csr_indptr, csr_indices)
    elif csr_blocks.shape != csr_indptr.shape or csr_blocks.dtype != np.bool_:
        raise ValueError(f"csr_blocks: expected {csr_indptr.shape} bool (shared_column_blocks), got "
                         f"{csr_blocks.shape} {csr_blocks.dtype}")
    if csr_bands is None:
        csr_bands = diagonal_bands(csr_indptr, csr_indices)
    elif csr_bands.shape != csr_indptr.shape or csr_bands.dtype != np.int64:
        raise ValueError(f"csr_bands: expected {csr_indptr.shape} int64 (diagonal_bands), got "
                         f"{csr_bands.shape} {csr_bands.dtype}")
    return (ChainSteps(code, src, offset, bstride, estride, rows, cols, add, out, csr_ptr, csr_indptr, csr_indices,
                       csr_blocks, csr_bands, int(vin0)), width, longest)
