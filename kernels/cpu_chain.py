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

``code 5``: the LSTM gate element (:func:`spscan.cells.lstm_gate_pattern`, ``(5H, 2H)``, per sample)
from its ``6H`` compact numbers (:func:`spscan.cells.lstm_gate_encoding`), blocks of ``H`` in the
order ``k, f, c_i, c_f, c_g, c_o`` (number ``q`` at the step's start plus ``q * estride[j]``): with
``(g_h, g_c)`` the step's input and ``w = g_c + k g_h``, its output is ``(c_i w, c_f w, c_g w,
c_o g_h, f w)``. Its 9H CSR values are products of these numbers, so reading the numbers reads a
third less and does six multiplies where the CSR rows do nine (rounded differently: the CSR form
sums ``(c_i k) g_h + c_i g_c``).

Why numba: the run is thousands of tiny dependent mat-vecs (the paper's RNN: 20x20, B = 16), so
NumPy's and torch's per-call overhead, not arithmetic, bounds it (~2 us per step against ~0.3 us
of work). A compiled loop over the whole run removes that overhead. ``numba`` (``@njit(cache=True)``)
compiles on first use, caches the machine code on disk, needs no compiler at install time (a torch
C++ extension would) and no tracing per chain length (``torch.compile`` would specialize or guard
on the step count). No ``fastmath`` and no ``parallel``: every output is summed in ascending inner
index (dense: column; CSR: stored position), so results are bitwise reproducible run to run. The
values of a step are read where they lie (arena or the caller's tensor); only per-sample values
stored sample by sample are copied, a tile at a time, to be read across the batch. A CSR
step costs O(nnz * B) multiply-adds, never O(rows * cols). Without numba the NumPy loop in
:mod:`spscan.kernels.torch_ops` runs instead (:func:`available`).

Loop order: the batch runs in tiles of ``LANES`` samples (:mod:`.cpu_simd`), each through the
whole run before the next (a tile's running vector stays in L1). Within a tile the running vector
is feature-major (row ``i`` of ``y`` is one vector of ``LANES`` samples), so every step is, per
output row, one vector accumulator in a register: a shared dense or CSR row adds ``w * y[col]``
per stored entry, four rows of one length at a time (four independent accumulators; rows that
share one column list, and dense rows, eight at a time, reading each column's vector once); a
diagonal band of rows with one or two entries (:func:`diagonal_bands`: row ``i + r`` has row ``i``'s
columns plus ``r``, as in Jacobians made of diagonal blocks) runs without reading each row's start
and columns; a per-sample dense or CSR row adds
``values * y[col]``, its values read in place when they are stored entry-major (``bstride`` 1) and
the tile is full, else first copied entry-major (``(n, LANES)``, a step or a row at a time). Each
output is summed in ascending stored order lane by lane, so a sample's result does not depend on
the batch size or its tile. The outputs a few steps ahead are prefetched: the sample-major buffer's
``LANES`` rows lie far apart, and the hardware prefetchers do not fetch them early.

Taps: rows of chosen steps' outputs go, as the tile holds them (one vector store per row), to the
caller's feature-major buffers; or, for one tap with an operand ``Z``, are multiplied with ``Z``'s
columns of the same steps and samples (a weight gradient, ``sum_k y_k Z_k^T``): the tapped rows of
``REDUCE_STEPS`` steps gather in a small ring (L2-resident) that :func:`.cpu_nt.block_sums`
multiplies out in 4 x 4 register blocks, so they are never stored (a full tile reads ``Z`` where it
lies, an evenly spaced run of its columns at a time). Lane-wise partial sums, summed in order at
the end: reproducible bit for bit.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import numpy as np

from . import cpu_nt, cpu_simd
from .backend import GATE_BANDS
from .cpu_numba import available, numba_module
from .cpu_simd import LANES

# The vector operations the kernel names: numba intrinsics (kernels/cpu_simd.py), bound by _kernel()
# before the first compile (numba is optional and slow to import).
get = vload = vstore = vzero = vscale = vmul = vadd = vmuladd = vmuladdv = vtranspose = vtranspose_add = None
prefetch = prefetch_read = None
block_sums = lane_sum = None  # cpu_nt.block_sums(), cpu_nt.lane_sum(), bound with them
_VECTOR_OPS = ("get", "vload", "vstore", "vzero", "vscale", "vmul", "vadd", "vmuladd", "vmuladdv", "vtranspose",
               "vtranspose_add", "prefetch", "prefetch_read")
# A step's outputs and per-sample values are prefetched this many steps ahead (the T = 1000 LSTM
# chain: 3.2 -> 2.5-2.9 ms with its gate values; 2 to 8 steps alike), the values only for steps of
# at most PREFETCH_VALUES_MAX entries per tile (a small step's lines; a large one streams anyway)
PREFETCH_STEPS = 4
PREFETCH_VALUES_MAX = 1 << 14
# A reducing tap multiplies out its rows every REDUCE_STEPS steps of a tile (its ring: rows x
# REDUCE_STEPS * LANES values, 170 KB for the T = 1000 LSTM's 80 gate rows in float32, stays in L2;
# storing the rows, 5 MB, and a GEMM over them afterwards cost the LSTM's backward ~0.4 ms more)
REDUCE_STEPS = 32

__all__ = ["available", "diagonal_bands", "numba_module", "resolve_steps", "run_chain", "shared_column_blocks"]

def _chain_kernel(code, src, offset, bstride, estride, rows, cols, add, out, vin0, sources, vectors, cur, nxt,
                  csr_ptr, csr_indptr, csr_indices, tv, same, bands, tap_buf, tap_at, tap_ld, tap_row0, tap_rows,
                  tap_bufs, feed_buf, feed_at, feed_bs, feed_fs, feed_row0, feed_rows,
                  feed_bufs, red_rows, red_cols, red_op, red_ring, red_zt, red_acc,
                  red_out):  # pragma: no cover - compiled
    # same: shared_column_blocks(csr_indptr, csr_indices); bands: diagonal_bands(csr_indptr, csr_indices)
    # out[j] < 0: y_j is not stored in vectors; tap_at[j] >= 0: row tap_row0[j] + r of y_j (r <
    # tap_rows[j]) goes to tap_bufs[tap_buf[j]][r * tap_ld[j] + tap_at[j]:][:batch], samples contiguous;
    # the tap tables have steps + 1 entries, the last one for the input y_{-1}; feed_at[j] >= 0: row
    # feed_row0[j] + r of y_j (r < feed_rows[j]) gets feed_bufs[feed_buf[j]][feed_at[j] + b * feed_bs[j]
    # + r * feed_fs[j]] added for sample b (an affine term read where the caller holds it)
    # tap_buf[j] < 0: the reducing tap (at most one; never the input): rows tap_row0[j] .. + red_rows
    # of y_j go to the ring red_ring (red_rows rows of rw positions, rs = rw + LANES apart, rs =
    # red_zt.shape[0] // len(red_cols)), to be multiplied with the operand's columns red_op[c *
    # tap_ld[j] + tap_at[j] + b] (c < len(red_cols)) of the same samples (copied to red_zt, rows
    # likewise, in a partial tile); a full ring (and the last, at each tile's end) is
    # multiplied out into red_acc by cpu_nt's block_sums: the tapped rows are never stored. Lanes
    # past the batch are zeros there. At the end red_out (red_rows x len(red_cols)) gets red_acc's
    # lane sums.
    # cur, nxt: (width * LANES,) feature-major tiles (row i of y at i * LANES); tv: per-sample values
    # copied entry-major (a step's or a row's). In a partial tile the lanes past the batch are never
    # written out and never mix with the others (every operation is lane by lane), so they are not
    # cleared per step: they hold leftovers of earlier steps and tiles.
    # Moves between the sample-major ``vectors`` and a tile go through LANES x LANES register
    # transposes (vtranspose) where the tile is full, element by element elsewhere.
    batch, sv = vectors.shape
    vflat = vectors.reshape(batch * sv)
    line = 64 // vectors.itemsize  # elements per cache line
    nred = red_cols.shape[0]
    rs = red_zt.shape[0] // nred if nred > 0 else 0
    rw = rs - LANES
    zc = zd = zld = 0  # the reducing tap's run of operand columns in a full tile (start, spacing, row stride)
    for b0 in range(0, batch, LANES):
        nb = min(LANES, batch - b0)
        full = nb == LANES
        nr = 0  # steps in the reducing tap's ring
        k0 = 0
        if full:
            while k0 + LANES <= cols[0]:
                vtranspose(vflat, b0 * sv + vin0 + k0, sv, cur, k0 * LANES, LANES)
                k0 += LANES
        for kk in range(k0, cols[0]):
            for bb in range(LANES):
                cur[kk * LANES + bb] = vectors[b0 + bb, vin0 + kk] if bb < nb else 0
        ta = tap_at[code.shape[0]]
        if ta >= 0:  # the run's input y_{-1} is tapped too (entry `steps` of the tap tables)
            r0 = tap_row0[code.shape[0]]
            ld = tap_ld[code.shape[0]]
            dst = tap_bufs[tap_buf[code.shape[0]]]
            for i in range(tap_rows[code.shape[0]]):
                for bb in range(nb):
                    dst[ta + b0 + i * ld + bb] = cur[(r0 + i) * LANES + bb]
        for j in range(code.shape[0]):
            m = rows[j]
            k = cols[j]
            s = sources[src[j]]
            o = offset[j]
            bs = bstride[j]
            es = estride[j]
            cj = code[j]
            # per-sample values batch-contiguous (entry-major storage) and a full tile: read in place
            direct = bs == 1 and full
            if cj == 0 and bs == 0:  # shared diagonal
                for i in range(m):
                    vstore(nxt, i * LANES, vscale(get(s, o + i), vload(cur, i * LANES)))
            elif cj == 0 and direct:  # per-sample diagonal, entry-major
                for i in range(m):
                    vstore(nxt, i * LANES, vmul(vload(s, o + b0 + i * es), vload(cur, i * LANES)))
            elif cj == 0:  # per-sample diagonal
                for i in range(m):
                    for bb in range(nb):
                        nxt[i * LANES + bb] = get(s, o + (b0 + bb) * bs + i * es) * cur[i * LANES + bb]
            elif cj == 1 or cj == 3:  # shared dense / CSR: rows of stored entries in ascending order
                if cj == 3:
                    cp = csr_ptr[j]
                    o -= csr_indptr[cp]  # value of global entry p: get(s, o + p)
                i = 0
                while i < m:
                    if cj == 1:
                        p, n = o + i * k, k
                    else:
                        p = csr_indptr[cp + i]
                        n = csr_indptr[cp + i + 1] - p
                    if i + 8 <= m and (cj == 1 or (same[cp + i] and same[cp + i + 1] and same[cp + i + 4])):
                        # eight rows of one column list: eight independent accumulators (four leave the
                        # adds' latency exposed on long rows)
                        a0 = vzero(cur)
                        a1 = vzero(cur)
                        a2 = vzero(cur)
                        a3 = vzero(cur)
                        a4 = vzero(cur)
                        a5 = vzero(cur)
                        a6 = vzero(cur)
                        a7 = vzero(cur)
                        # row r's entry q: get(s, p + r * n + q) (dense: o + (i + r) * k + q; CSR: o + p + ...)
                        vb = p if cj == 1 else o + p
                        for q in range(n):
                            x = vload(cur, (q if cj == 1 else get(csr_indices, p + q)) * LANES)
                            a0 = vmuladd(a0, get(s, vb + q), x)
                            a1 = vmuladd(a1, get(s, vb + n + q), x)
                            a2 = vmuladd(a2, get(s, vb + 2 * n + q), x)
                            a3 = vmuladd(a3, get(s, vb + 3 * n + q), x)
                            a4 = vmuladd(a4, get(s, vb + 4 * n + q), x)
                            a5 = vmuladd(a5, get(s, vb + 5 * n + q), x)
                            a6 = vmuladd(a6, get(s, vb + 6 * n + q), x)
                            a7 = vmuladd(a7, get(s, vb + 7 * n + q), x)
                        vstore(nxt, i * LANES, a0)
                        vstore(nxt, (i + 1) * LANES, a1)
                        vstore(nxt, (i + 2) * LANES, a2)
                        vstore(nxt, (i + 3) * LANES, a3)
                        vstore(nxt, (i + 4) * LANES, a4)
                        vstore(nxt, (i + 5) * LANES, a5)
                        vstore(nxt, (i + 6) * LANES, a6)
                        vstore(nxt, (i + 7) * LANES, a7)
                        i += 8
                    elif cj == 3 and bands[cp + i] > 1 and n <= 2:
                        # a diagonal band of short rows (row i + r: row i's columns + r): no per-row lookups
                        L = min(bands[cp + i], m - i)
                        c0 = get(csr_indices, p) * LANES
                        c1 = get(csr_indices, p + n - 1) * LANES
                        for r in range(L):
                            a0 = vmuladd(vzero(cur), get(s, o + p + r * n), vload(cur, c0 + r * LANES))
                            if n == 2:
                                a0 = vmuladd(a0, get(s, o + p + r * n + 1), vload(cur, c1 + r * LANES))
                            vstore(nxt, (i + r) * LANES, a0)
                        i += L
                    elif i + 4 <= m and (cj == 1 or (csr_indptr[cp + i + 2] - csr_indptr[cp + i + 1] == n
                                                   and csr_indptr[cp + i + 3] - csr_indptr[cp + i + 2] == n
                                                   and csr_indptr[cp + i + 4] - csr_indptr[cp + i + 3] == n)):
                        # four rows of one length at once: four independent accumulators
                        a0 = vzero(cur)
                        a1 = vzero(cur)
                        a2 = vzero(cur)
                        a3 = vzero(cur)
                        if cj == 1:
                            for q in range(n):
                                x = vload(cur, q * LANES)
                                a0 = vmuladd(a0, get(s, p + q), x)
                                a1 = vmuladd(a1, get(s, p + k + q), x)
                                a2 = vmuladd(a2, get(s, p + 2 * k + q), x)
                                a3 = vmuladd(a3, get(s, p + 3 * k + q), x)
                        elif same[cp + i]:
                            for q in range(n):
                                x = vload(cur, get(csr_indices, p + q) * LANES)
                                a0 = vmuladd(a0, get(s, o + p + q), x)
                                a1 = vmuladd(a1, get(s, o + p + n + q), x)
                                a2 = vmuladd(a2, get(s, o + p + 2 * n + q), x)
                                a3 = vmuladd(a3, get(s, o + p + 3 * n + q), x)
                        else:
                            for q in range(n):
                                a0 = vmuladd(a0, get(s, o + p + q), vload(cur, get(csr_indices, p + q) * LANES))
                                a1 = vmuladd(a1, get(s, o + p + n + q), vload(cur, get(csr_indices, p + n + q) * LANES))
                                a2 = vmuladd(a2, get(s, o + p + 2 * n + q),
                                             vload(cur, get(csr_indices, p + 2 * n + q) * LANES))
                                a3 = vmuladd(a3, get(s, o + p + 3 * n + q),
                                             vload(cur, get(csr_indices, p + 3 * n + q) * LANES))
                        vstore(nxt, i * LANES, a0)
                        vstore(nxt, (i + 1) * LANES, a1)
                        vstore(nxt, (i + 2) * LANES, a2)
                        vstore(nxt, (i + 3) * LANES, a3)
                        i += 4
                    else:
                        a0 = vzero(cur)
                        if cj == 1:
                            for q in range(n):
                                a0 = vmuladd(a0, get(s, p + q), vload(cur, q * LANES))
                        else:
                            for q in range(n):
                                a0 = vmuladd(a0, get(s, o + p + q), vload(cur, get(csr_indices, p + q) * LANES))
                        vstore(nxt, i * LANES, a0)
                        i += 1
            else:  # per-sample dense (2), CSR (4) or LSTM gate (5): values copied entry-major into tv, then rows
                cp = csr_ptr[j] if cj == 4 else 0
                g0 = csr_indptr[cp] if cj == 4 else 0
                nnz = csr_indptr[cp + m] - g0 if cj == 4 else (6 * (m // 5) if cj == 5 else m * k)
                # the whole step at once (always a gate's: the scratch is sized for it), else row by row
                whole = direct or cj == 5 or nnz * LANES <= tv.shape[0]
                if whole and not direct:
                    q0 = 0
                    if full and es == 1:
                        while q0 + LANES <= nnz:
                            vtranspose(s, o + b0 * bs + q0, bs, tv, q0 * LANES, LANES)
                            q0 += LANES
                    for bb in range(nb):
                        vb = o + (b0 + bb) * bs
                        for q in range(q0, nnz):
                            tv[q * LANES + bb] = get(s, vb + q * es)
                # value q of the tile: varr[vbase + q * vstr] (in place, or the entry-major copy)
                varr = s if direct else tv
                vbase = o + b0 if direct else 0
                vstr = es if direct else LANES
                if cj == 5:  # the LSTM gate element from its 6H compact numbers (module docstring)
                    hh = m // 5
                    for u in range(hh):
                        gh = vload(cur, u * LANES)
                        # gc + k * gh: the cell's total gradient
                        w = vmuladdv(vload(cur, (hh + u) * LANES), vload(varr, vbase + u * vstr), gh)
                        vstore(nxt, u * LANES, vmul(vload(varr, vbase + (2 * hh + u) * vstr), w))
                        vstore(nxt, (hh + u) * LANES, vmul(vload(varr, vbase + (3 * hh + u) * vstr), w))
                        vstore(nxt, (2 * hh + u) * LANES, vmul(vload(varr, vbase + (4 * hh + u) * vstr), w))
                        vstore(nxt, (3 * hh + u) * LANES, vmul(vload(varr, vbase + (5 * hh + u) * vstr), gh))
                        vstore(nxt, (4 * hh + u) * LANES, vmul(vload(varr, vbase + (hh + u) * vstr), w))
                i = m if cj == 5 else 0
                while i < m:
                    if cj == 2:
                        p, n = i * k, k
                    else:
                        p = csr_indptr[cp + i] - g0
                        n = csr_indptr[cp + i + 1] - g0 - p
                    if whole and cj == 4 and bands[cp + i] > 1 and n <= 2:
                        # a diagonal band of short rows (row i + r: row i's columns + r; the LSTM gate
                        # element's five blocks of H rows): no per-row lookups, the same sums
                        L = min(bands[cp + i], m - i)
                        c0 = get(csr_indices, g0 + p) * LANES
                        c1 = get(csr_indices, g0 + p + n - 1) * LANES
                        for r in range(L):
                            e0 = vbase + (p + r * n) * vstr
                            a0 = vmuladdv(vzero(cur), vload(varr, e0), vload(cur, c0 + r * LANES))
                            if n == 2:
                                a0 = vmuladdv(a0, vload(varr, e0 + vstr), vload(cur, c1 + r * LANES))
                            vstore(nxt, (i + r) * LANES, a0)
                        i += L
                    elif not whole:  # one row's values copied, then that row alone
                        for bb in range(nb):
                            vb = o + (b0 + bb) * bs + p * es
                            for q in range(n):
                                tv[q * LANES + bb] = get(s, vb + q * es)
                        a0 = vzero(cur)
                        for q in range(n):
                            c = q if cj == 2 else get(csr_indices, g0 + p + q)
                            a0 = vmuladdv(a0, vload(tv, q * LANES), vload(cur, c * LANES))
                        vstore(nxt, i * LANES, a0)
                        i += 1
                    elif i + 4 <= m and (cj == 2 or (csr_indptr[cp + i + 2] - csr_indptr[cp + i + 1] == n
                                                     and csr_indptr[cp + i + 3] - csr_indptr[cp + i + 2] == n
                                                     and csr_indptr[cp + i + 4] - csr_indptr[cp + i + 3] == n)):
                        # four rows of one length at once (their entries are consecutive)
                        a0 = vzero(cur)
                        a1 = vzero(cur)
                        a2 = vzero(cur)
                        a3 = vzero(cur)
                        if cj == 2:
                            for q in range(n):
                                x = vload(cur, q * LANES)
                                a0 = vmuladdv(a0, vload(varr, vbase + (p + q) * vstr), x)
                                a1 = vmuladdv(a1, vload(varr, vbase + (p + n + q) * vstr), x)
                                a2 = vmuladdv(a2, vload(varr, vbase + (p + 2 * n + q) * vstr), x)
                                a3 = vmuladdv(a3, vload(varr, vbase + (p + 3 * n + q) * vstr), x)
                        else:
                            for q in range(n):
                                e0 = p + q
                                a0 = vmuladdv(a0, vload(varr, vbase + e0 * vstr),
                                              vload(cur, get(csr_indices, g0 + e0) * LANES))
                                e0 += n
                                a1 = vmuladdv(a1, vload(varr, vbase + e0 * vstr),
                                              vload(cur, get(csr_indices, g0 + e0) * LANES))
                                e0 += n
                                a2 = vmuladdv(a2, vload(varr, vbase + e0 * vstr),
                                              vload(cur, get(csr_indices, g0 + e0) * LANES))
                                e0 += n
                                a3 = vmuladdv(a3, vload(varr, vbase + e0 * vstr),
                                              vload(cur, get(csr_indices, g0 + e0) * LANES))
                        vstore(nxt, i * LANES, a0)
                        vstore(nxt, (i + 1) * LANES, a1)
                        vstore(nxt, (i + 2) * LANES, a2)
                        vstore(nxt, (i + 3) * LANES, a3)
                        i += 4
                    else:
                        a0 = vzero(cur)
                        for q in range(n):
                            c = q if cj == 2 else get(csr_indices, g0 + p + q)
                            a0 = vmuladdv(a0, vload(varr, vbase + (p + q) * vstr), vload(cur, c * LANES))
                        vstore(nxt, i * LANES, a0)
                        i += 1
            a = add[j]
            if a >= 0:
                i0 = 0
                if full:
                    while i0 + LANES <= m:
                        vtranspose_add(vflat, b0 * sv + a + i0, sv, nxt, i0 * LANES, LANES)
                        i0 += LANES
                for i in range(i0, m):
                    for bb in range(nb):
                        nxt[i * LANES + bb] += vectors[b0 + bb, a + i]
            fa = feed_at[j]
            if fa >= 0:
                fsrc = feed_bufs[feed_buf[j]]
                r0 = feed_row0[j]
                d = feed_rows[j]
                fbs = feed_bs[j]
                fs = feed_fs[j]
                fb = fa + b0 * fbs
                if full and fbs == 1:  # feature-major terms: a row of the tile is one vector load
                    for i in range(d):
                        vstore(nxt, (r0 + i) * LANES, vadd(vload(nxt, (r0 + i) * LANES), vload(fsrc, fb + i * fs)))
                else:
                    i0 = 0
                    if full and fs == 1:  # sample-major rows: register transposes, as from the vectors
                        while i0 + LANES <= d:
                            vtranspose_add(fsrc, fb + i0, fbs, nxt, (r0 + i0) * LANES, LANES)
                            i0 += LANES
                    for i in range(i0, d):
                        for bb in range(nb):
                            nxt[(r0 + i) * LANES + bb] += fsrc[fb + bb * fbs + i * fs]
            jn = j + PREFETCH_STEPS
            if jn < code.shape[0] and tap_at[jn] >= 0 and tap_buf[jn] < 0:
                # the reducing tap's operand columns of a later step: a line in each of its rows, far
                # apart (without, their misses cost the T = 1000 LSTM's scan ~0.15 ms)
                for c in range(nred):
                    prefetch_read(red_op, c * tap_ld[jn] + tap_at[jn] + b0)
            if jn < code.shape[0]:
                # a later step's outputs (LANES rows of the sample-major buffer, far apart) and its
                # per-sample values: lines the hardware prefetchers do not fetch ahead
                on = out[jn]
                mn = rows[jn]
                if on >= 0:
                    for bb in range(nb):
                        rb = (b0 + bb) * sv + on
                        for q in range(0, mn, line):
                            prefetch(vflat, rb + q)
                        prefetch(vflat, rb + mn - 1)
                cn = code[jn]
                bsn = bstride[jn]
                if bsn != 0:
                    if cn == 4:
                        cq = csr_ptr[jn]
                        nn = csr_indptr[cq + mn] - csr_indptr[cq]
                    elif cn == 5:
                        nn = 6 * (mn // 5)
                    else:
                        nn = mn * cols[jn] if cn == 2 else mn
                    if 0 < nn * nb <= PREFETCH_VALUES_MAX:
                        sn = sources[src[jn]]
                        esn = estride[jn]
                        if bsn == 1:  # entry-major: a tile's values of entry q are LANES in a row
                            for q in range(nn):
                                prefetch_read(sn, offset[jn] + b0 + q * esn)
                                prefetch_read(sn, offset[jn] + b0 + q * esn + LANES - 1)
                        else:
                            for bb in range(nb):
                                vb = offset[jn] + (b0 + bb) * bsn
                                for q in range(0, nn * esn, line):
                                    prefetch_read(sn, vb + q)
                                prefetch_read(sn, vb + (nn - 1) * esn)
            ta = tap_at[j]
            if ta >= 0 and tap_buf[j] < 0:
                # the reducing tap: the rows into the ring; a full tile reads the operand where it lies, a
                # run of evenly spaced columns at a time (zc, then zd apart; a break multiplies out first),
                # a partial one copies its samples' columns, zero-padded, into red_zt
                r0 = tap_row0[j]
                tb = ta + b0
                if full and nr > 1 and tb != zc + nr * zd:
                    block_sums(red_ring, rs, 0, red_op, zld, zc, zd, red_cols, nr * LANES, red_acc, red_rows, nred)
                    nr = 0
                if nr == 0:
                    zc = tb
                    zld = tap_ld[j]
                elif nr == 1:
                    zd = tb - zc
                rb = nr * LANES
                for i in range(red_rows):
                    if full:
                        vstore(red_ring, i * rs + rb, vload(nxt, (r0 + i) * LANES))
                    else:
                        vstore(red_ring, i * rs + rb, vzero(red_ring))
                        for bb in range(nb):
                            red_ring[i * rs + rb + bb] = nxt[(r0 + i) * LANES + bb]
                if not full:
                    for c in range(nred):
                        vstore(red_zt, c * rs + rb, vzero(red_zt))
                        for bb in range(nb):
                            red_zt[c * rs + rb + bb] = red_op[c * zld + tb + bb]
                nr += 1
                if nr * LANES == rw:
                    if full:
                        block_sums(red_ring, rs, 0, red_op, zld, zc, zd, red_cols, rw, red_acc, red_rows, nred)
                    else:
                        block_sums(red_ring, rs, 0, red_zt, rs, 0, LANES, red_cols, rw, red_acc, red_rows, nred)
                    nr = 0
            elif ta >= 0:
                # the tapped rows feature-major, as the tile holds them: one vector store per row (no
                # transposes; each store fills a whole cache line when the batch is a multiple of LANES)
                r0 = tap_row0[j]
                ld = tap_ld[j]
                dst = tap_bufs[tap_buf[j]]
                tb = ta + b0
                if full:
                    for i in range(tap_rows[j]):
                        vstore(dst, tb + i * ld, vload(nxt, (r0 + i) * LANES))
                else:
                    for i in range(tap_rows[j]):
                        for bb in range(nb):
                            dst[tb + i * ld + bb] = nxt[(r0 + i) * LANES + bb]
            oj = out[j]
            if oj >= 0:
                i0 = 0
                if full:
                    while i0 + LANES <= m:
                        vtranspose(nxt, i0 * LANES, LANES, vflat, b0 * sv + oj + i0, sv)
                        i0 += LANES
                for i in range(i0, m):
                    for bb in range(nb):
                        vectors[b0 + bb, oj + i] = nxt[i * LANES + bb]
            cur, nxt = nxt, cur
        if nr > 0 and full:  # the ring's last steps of this tile
            block_sums(red_ring, rs, 0, red_op, zld, zc, zd, red_cols, nr * LANES, red_acc, red_rows, nred)
        elif nr > 0:
            block_sums(red_ring, rs, 0, red_zt, rs, 0, LANES, red_cols, nr * LANES, red_acc, red_rows, nred)
    for g in range(red_rows):
        for c in range(nred):
            red_out[g, c] = lane_sum(red_acc, (g * nred + c) * LANES)


_compiled = None


def _kernel():
    global _compiled
    if _compiled is None:
        ops = cpu_simd.intrinsics()
        globals().update({name: ops[name] for name in _VECTOR_OPS})
        globals()["block_sums"] = cpu_nt.block_sums()
        globals()["lane_sum"] = cpu_nt.lane_sum()
        _compiled = numba_module().njit(cache=True, nogil=True, error_model="numpy")(_chain_kernel)
    return _compiled


_NO_CSR = np.zeros(1, dtype=np.int64)

# a per-sample step with at most this many entries has its values copied entry-major in one pass
# (a pass per row costs a loop setup per row and sample: the LSTM gate element's 100 rows of 1-2
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
        raise RuntimeError("spscan.kernels.cpu_chain needs numba (pip install numba); use the NumPy loop instead")
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
            a is b for a, b in zip(hit[1], tables)):
        estride, csr_ptr, csr_indptr, csr_indices, csr_blocks, csr_bands, width, longest = hit[2]
    else:
        estride, csr_ptr, csr_indptr, csr_indices, csr_blocks, csr_bands, width, longest = _checked_tables(
            code, src, offset, bstride, estride, rows, cols, add, out, csr_ptr, csr_indptr, csr_indices,
            csr_blocks, csr_bands)
        if memo is not None:
            memo.clear()
            memo["tables"] = (int(vin0), tables, (estride, csr_ptr, csr_indptr, csr_indices, csr_blocks, csr_bands,
                                                  width, longest))
    for i, s in enumerate(sources):
        if s.dtype != vectors.dtype or s.ndim != 1 or not s.flags.c_contiguous:
            raise TypeError(f"sources[{i}]: expected a C-contiguous 1-D {vectors.dtype} array, got {s.dtype} "
                            f"{s.ndim}-D")
    srcs = _homogeneous(sources)
    cur = np.zeros(width * LANES, dtype=vectors.dtype)
    nxt = np.zeros(width * LANES, dtype=vectors.dtype)
    tv = np.zeros(longest * LANES, dtype=vectors.dtype)
    tap_buf, tap_at, tap_ld, tap_row0, tap_rows, tap_bufs = _tap_tables(taps, steps, rows, int(cols[0]), vectors,
                                                                        memo)
    feed_tables = _feed_tables(feeds, steps, rows, vectors, memo)
    red = next((t for t in taps if len(t) > 4 and t[4] is not None), None)
    if red is None:
        dummy = np.zeros(LANES, dtype=vectors.dtype)
        reduce_args = (0, np.zeros(0, dtype=np.int64), dummy, dummy, dummy, dummy, np.zeros((0, 0), vectors.dtype))
    else:
        nrows, operand, target = int(red[2]), red[4], red[3]
        C = operand.shape[0]
        acc = np.zeros(nrows * C * LANES, dtype=vectors.dtype)
        # ring rows one vector longer than they hold: rows a power of two apart would all fall in a
        # few L1 sets (the 80 rows of 32 steps at float32: 2 of 64)
        rs = (REDUCE_STEPS + 1) * LANES
        reduce_args = (nrows, np.arange(C, dtype=np.int64), operand.reshape(-1),
                       np.empty(nrows * rs, dtype=vectors.dtype), np.empty(C * rs, dtype=vectors.dtype), acc, target)
    _kernel()(code, src, offset, bstride, estride, rows, cols, add, out, int(vin0), srcs, vectors, cur, nxt,
              csr_ptr, csr_indptr, csr_indices, tv, csr_blocks, csr_bands, tap_buf, tap_at, tap_ld, tap_row0,
              tap_rows, tap_bufs, *feed_tables, *reduce_args)


def _checked_tables(code, src, offset, bstride, estride, rows, cols, add, out, csr_ptr, csr_indptr, csr_indices,
                    csr_blocks, csr_bands):
    """:func:`run_chain`'s step tables checked, and what the loop needs worked out from them: ``(estride,
    csr_ptr, csr_indptr, csr_indices, csr_blocks, csr_bands, width, longest)`` (the defaults filled in;
    ``width``: rows of the running vector; ``longest``: entries of the entry-major values scratch)."""
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
        raise ValueError("code 5 (LSTM gate) steps: expected (5H, 2H) steps")
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
    return estride, csr_ptr, csr_indptr, csr_indices, csr_blocks, csr_bands, width, longest


def _feed_tables(feeds, steps: int, rows: np.ndarray, vectors: np.ndarray, memo: Optional[dict] = None):
    """Per-step ``(feed_buf, feed_at, feed_bs, feed_fs, feed_row0, feed_rows)`` and the tuple of buffers of
    :func:`run_chain`'s ``feeds``, checked (every element a feed names lies within its buffer)."""
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
            return tables + (_homogeneous(bufs),)
    tables = _feed_tables_checked(feeds, steps, rows, vectors)
    if memo is not None:
        reach = [int(np.max(f[4], initial=-1)) + (batch - 1) * int(f[5]) + (int(f[2]) - 1) * int(f[6])
                 for f in feeds]
        _memo_put(memo, key, (tables[:6], reach, [f[0] for f in feeds]))  # the steps arrays kept: their ids too
    return tables


def _feed_tables_checked(feeds, steps: int, rows: np.ndarray, vectors: np.ndarray):
    """:func:`_feed_tables` without a memo: every feed checked, the tables made."""
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
    return feed_buf, feed_at, feed_bs, feed_fs, feed_row0, feed_rows, _homogeneous(bufs or [np.zeros(1, vectors.dtype)])


@functools.lru_cache(maxsize=16)
def _no_feeds(steps: int, dtype) -> tuple:
    """:func:`_feed_tables` of a run without feeds (the loop only reads them), made once per length and dtype."""
    zeros = np.zeros(steps, dtype=np.int64)
    tables = (zeros, np.full(steps, -1, dtype=np.int64), zeros, zeros, zeros, zeros,
              _homogeneous([np.zeros(1, dtype)]))
    for a in tables[:6]:
        a.flags.writeable = False
    return tables


def _tap_tables(taps, steps: int, rows: np.ndarray, cols0: int, vectors: np.ndarray, memo: Optional[dict] = None):
    """Per-step ``(tap_buf, tap_at, tap_ld, tap_row0, tap_rows)`` and the tuple of flat buffers of
    :func:`run_chain`'s ``taps``, checked. With ``memo`` (:func:`run_chain`'s), the per-step tables of taps
    of the same step arrays (the same objects), rows and batch are kept; the buffers are checked per call."""
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
            return tables + (_homogeneous(bufs or [np.zeros(1, vectors.dtype)]),)
    tables = _tap_tables_checked(taps, steps, rows, cols0, vectors)
    if memo is not None:
        # the step arrays are kept with the tables, so their ids in the key stay theirs
        _memo_put(memo, key, ([t[0] for t in taps], tables[:5]))
    return tables


def _memo_put(memo: dict, key, value) -> None:
    """``memo[key] = value`` in :func:`run_chain`'s memo, bounded: past 16 entries (a caller passing new tap
    or feed step arrays every call) the tap and feed entries go; the step tables' entry stays."""
    if len(memo) > 16:
        checked = memo.get("tables")
        memo.clear()
        if checked is not None:
            memo["tables"] = checked
    memo[key] = value


def _tap_tables_checked(taps, steps: int, rows: np.ndarray, cols0: int, vectors: np.ndarray):
    """:func:`_tap_tables` without a memo: every tap checked, the tables made."""
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
    return tap_buf, tap_at, tap_ld, tap_row0, tap_rows, _homogeneous(bufs or [np.zeros(1, vectors.dtype)])


def _operand_of(tap) -> Optional[np.ndarray]:
    """A tap's operand (its fifth entry), or ``None`` for a tap that stores its rows."""
    return tap[4] if len(tap) > 4 else None


def _tap_arrays_fit(tap, ksteps: int, batch: int, dtype) -> bool:
    """Whether a tap's buffer (and operand) have the shapes, dtype and layout :func:`run_chain` needs."""
    nrows, buf, operand = int(tap[2]), tap[3], _operand_of(tap)
    arrays = (buf,) if operand is None else (buf, operand)
    if not all(isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.c_contiguous for a in arrays):
        return False
    if operand is None:
        return buf.shape == (nrows, ksteps, batch)
    return (operand.ndim == 3 and operand.shape[0] > 0 and operand.shape[1:] == (ksteps, batch)
            and buf.shape == (nrows, operand.shape[0]))


def _homogeneous(arrays: Sequence[np.ndarray]) -> tuple:
    """``arrays`` as the homogeneous tuple the loop indexes at run time, padded (with its first array) to a
    power of two so few specializations compile."""
    n = 2
    while n < len(arrays):
        n *= 2
    return tuple(arrays) + (arrays[0],) * (n - len(arrays))


def shared_column_blocks(csr_indptr: np.ndarray, csr_indices: np.ndarray) -> np.ndarray:
    """``(len(csr_indptr),)`` bool: entry ``r`` is true where CSR rows ``r .. r+3`` of the run's tables
    (global row numbers, as ``csr_indptr`` counts them) are non-empty and have one column list, so a
    block of them reads each column's vector once (the LSTM weight element's ``W_hh^T`` rows).

    A property of the run's patterns: worked out once per run (the backend keeps it with the run's
    tables) and passed to :func:`run_chain`, not redone per call.
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

    Transposed Jacobians made of diagonal blocks have such rows: the LSTM gate element is five bands
    of ``H`` rows with one or two entries each, which the compiled loop then runs without reading
    each row's start and columns. Worked out once per run, like :func:`shared_column_blocks`.
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


MAX_SOURCES = 16

# the compact value forms (kernels.backend.ValueEncoding names) this loop applies directly, and their codes
ENCODED_CODES = {GATE_BANDS: 5}


def resolve_steps(code: Sequence[int], shared: Sequence[bool], layers: Sequence[int], offsets: Sequence[int],
                  arena_s: np.ndarray, arena_p: np.ndarray, inputs: Optional[Callable], dtype,
                  memo: Optional[dict] = None) \
        -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]]:
    """Where each step's values lie: ``(code, src, offset, bstride, estride, sources)`` for :func:`run_chain`,
    or ``None`` when some input matrix is not a plain strided view of a contiguous CPU tensor of ``dtype``
    (or is encoded in a form this loop does not know).

    Steps over products read the arenas (``arena_s`` 1-D, shared; ``arena_p`` ``(B, size_p)``);
    steps over input layers (``layers[j] >= 0`` and ``inputs`` given) read the caller's tensor
    ``inputs(layer)`` (``(nnz,)`` shared or ``(B, nnz)``) in place, through its base tensor. ``code``
    is ``code`` with the steps over encoded periodic elements given their form's code (``"lstm_gate"``:
    5), which reads the compact numbers in place.

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
    code_a, src, off, bst, est = _arena_tables(code, shared, offsets, arena_p)
    lay = np.asarray(layers, dtype=np.int64)
    sources = [arena_s.reshape(-1), arena_p.reshape(-1)]
    if inputs is None:
        return code_a, src, off, bst, est, sources
    from_input = np.flatnonzero(lay >= 0)
    if from_input.size == 0:
        return code_a, src, off, bst, est, sources
    if isinstance(owner, torch.Tensor) and owner.dim() in (2, 3):
        # stacked values: one tensor (n, nnz) or (n, B, nnz), layer i at row i
        if owner.dtype != dtype or owner.device.type != "cpu" or owner.stride(-1) != 1:
            return None
        base = owner if owner._base is None else owner._base
        if not base.is_contiguous():
            return None
        start = (owner.data_ptr() - base.data_ptr()) // owner.element_size()
        src[from_input] = len(sources)
        off[from_input] = start + lay[from_input] * owner.stride(0)
        bst[from_input] = owner.stride(1) if owner.dim() == 3 else 0
        sources.append(base.detach().numpy().reshape(-1))
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
