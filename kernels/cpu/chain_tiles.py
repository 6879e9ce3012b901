"""The compiled loop of a linear run (:mod:`.chain` checks its arguments and calls it): numba, over the
fixed-width vectors of :mod:`.simd`.

Loop order: the batch runs in tiles of ``LANES`` samples, each through the whole run before the
next (a tile's running vector stays in L1). Within a tile the running vector is feature-major (row
``i`` of ``y`` is one vector of ``LANES`` samples), so every step is, per output row, one vector
accumulator in a register: a shared dense or CSR row adds ``w * y[col]`` per stored entry, four rows
of one length at a time (four independent accumulators; rows that share one column list, and dense
rows, eight at a time, reading each column's vector once); a diagonal band of rows with one or two
entries (:func:`.chain_tables.diagonal_bands`: row ``i + r`` has row ``i``'s columns plus ``r``, as
in Jacobians made of diagonal blocks) runs without reading each row's start and columns; a
per-sample dense or CSR row adds ``values * y[col]``, its values read in place when they are stored
entry-major (``bstride`` 1) and the tile is full, else first copied entry-major (``(n, LANES)``, a
step or a row at a time). Each output is summed in ascending stored order lane by lane, so a
sample's result does not depend on the batch size or its tile. The outputs a few steps ahead are
prefetched: the sample-major buffer's ``LANES`` rows lie far apart, and the hardware prefetchers do
not fetch them early.

Taps: rows of chosen steps' outputs go, as the tile holds them (one vector store per row), to the
caller's feature-major buffers; or, for one tap with an operand ``Z``, are multiplied with ``Z``'s
columns of the same steps and samples (a weight gradient, ``sum_k y_k Z_k^T``): the tapped rows of a
few dozen steps gather in a small ring (L2-resident) that :func:`.nt.block_sums` multiplies out
in 4 x 4 register blocks, so they are never stored (a full tile reads ``Z`` where it lies, an evenly
spaced run of its columns at a time). Lane-wise partial sums, summed in order at the end:
reproducible bit for bit.
"""

from __future__ import annotations

from spscan.kernels.cpu import nt as cpu_nt

from spscan.kernels.cpu import simd as cpu_simd
from spscan.kernels.cpu.jit import numba_module
from spscan.kernels.cpu.simd import LANES

__all__ = ["compiled"]

# The vector operations the kernel names: numba intrinsics (kernels/cpu/simd.py), bound by compiled()
# before the first compile (numba is optional and slow to import).
get = vload = vstore = vzero = vscale = vmul = vadd = vmuladd = vmuladdv = vtranspose = vtranspose_add = None
prefetch = prefetch_read = None
block_sums = lane_sum = None  # cpu_nt.block_sums(), cpu_nt.lane_sum(), bound with them
_four_rows_alike_c = _store4_c = None  # the helpers below, compiled (inlined where called)
_VECTOR_OPS = ("get", "vload", "vstore", "vzero", "vscale", "vmul", "vadd", "vmuladd", "vmuladdv", "vtranspose",
               "vtranspose_add", "prefetch", "prefetch_read")
# A step's outputs and per-sample values are prefetched this many steps ahead (2 to 8 steps measured
# alike), the values only for steps of at most PREFETCH_VALUES_MAX entries per tile (a small step's
# lines; a large one streams anyway)
PREFETCH_STEPS = 4
PREFETCH_VALUES_MAX = 1 << 14


def _four_rows_alike(indptr, r, n):  # pragma: no cover - compiled
    # rows r + 1 .. r + 3 of the CSR tables hold n entries each, as row r does
    return (indptr[r + 2] - indptr[r + 1] == n and indptr[r + 3] - indptr[r + 2] == n
            and indptr[r + 4] - indptr[r + 3] == n)


def _store4(a, i, a0, a1, a2, a3):  # pragma: no cover - compiled
    # rows i .. i + 3 of the tile a (at i * LANES, ...) = a0 .. a3
    vstore(a, i * LANES, a0)
    vstore(a, (i + 1) * LANES, a1)
    vstore(a, (i + 2) * LANES, a2)
    vstore(a, (i + 3) * LANES, a3)


def _chain_kernel(st, sources, vectors, cur, nxt, tv, taps, tap_bufs, feeds, feed_bufs,
                  red):  # pragma: no cover - compiled
    # st: the run's step tables (chain_tables.ChainSteps), read below under their own names; taps, feeds: the
    # per-step tap and feed tables (TapTables, FeedTables), their buffers tap_bufs, feed_bufs (tuples); red:
    # the reducing tap's operands (Reduction; chain_tables.no_reduction where no tap reduces)
    (code, src, offset, bstride, estride, rows, cols, add, out, csr_ptr, csr_indptr, csr_indices, same, bands,
     vin0) = st
    # same: shared_column_blocks(csr_indptr, csr_indices); bands: diagonal_bands(csr_indptr, csr_indices)
    # out[j] < 0: y_j is not stored in vectors; taps.at[j] >= 0: row taps.row0[j] + r of y_j (r <
    # taps.rows[j]) goes to tap_bufs[taps.buf[j]][r * taps.ld[j] + taps.at[j]:][:batch], samples
    # contiguous; the tap tables have steps + 1 entries, the last one for the input y_{-1}; feeds.at[j] >=
    # 0: row feeds.row0[j] + r of y_j (r < feeds.rows[j]) gets feed_bufs[feeds.buf[j]][feeds.at[j] + b *
    # feeds.bs[j] + r * feeds.fs[j]] added for sample b (an affine term read where the caller holds it)
    # taps.buf[j] < 0: the reducing tap (at most one; never the input): rows taps.row0[j] .. + red.rows
    # of y_j go to the ring red.ring (red.rows rows of rw positions, rs = rw + LANES apart, rs =
    # red.zt.shape[0] // len(red.cols)), to be multiplied with the operand's columns red.op[c *
    # taps.ld[j] + taps.at[j] + b] (c < len(red.cols)) of the same samples (copied to red.zt, rows
    # likewise, in a partial tile); a full ring (and the last, at each tile's end) is
    # multiplied out into red.acc by cpu_nt's block_sums: the tapped rows are never stored. Lanes
    # past the batch are zeros there. At the end red.out (red.rows x len(red.cols)) gets red.acc's
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
    nred = red.cols.shape[0]
    rs = red.zt.shape[0] // nred if nred > 0 else 0
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
        ta = taps.at[code.shape[0]]
        if ta >= 0:  # the run's input y_{-1} is tapped too (entry `steps` of the tap tables)
            r0 = taps.row0[code.shape[0]]
            ld = taps.ld[code.shape[0]]
            dst = tap_bufs[taps.buf[code.shape[0]]]
            for i in range(taps.rows[code.shape[0]]):
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
                        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero(cur)
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
                        _store4_c(nxt, i, a0, a1, a2, a3)
                        _store4_c(nxt, i + 4, a4, a5, a6, a7)
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
                    elif i + 4 <= m and (cj == 1 or _four_rows_alike_c(csr_indptr, cp + i, n)):
                        # four rows of one length at once: four independent accumulators
                        a0 = a1 = a2 = a3 = vzero(cur)
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
                        _store4_c(nxt, i, a0, a1, a2, a3)
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
            else:  # per-sample dense (2), CSR (4) or gate bands (5): values copied entry-major into tv, then rows
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
                if cj == 5:  # gate bands from their 6H compact numbers (backend.GATE_BANDS)
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
                        # a diagonal band of short rows (row i + r: row i's columns + r; as the five
                        # blocks of H rows of gate bands): no per-row lookups, the same sums
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
                    elif i + 4 <= m and (cj == 2 or _four_rows_alike_c(csr_indptr, cp + i, n)):
                        # four rows of one length at once (their entries are consecutive)
                        a0 = a1 = a2 = a3 = vzero(cur)
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
                        _store4_c(nxt, i, a0, a1, a2, a3)
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
            fa = feeds.at[j]
            if fa >= 0:
                fsrc = feed_bufs[feeds.buf[j]]
                r0 = feeds.row0[j]
                d = feeds.rows[j]
                fbs = feeds.bs[j]
                fs = feeds.fs[j]
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
            if jn < code.shape[0] and taps.at[jn] >= 0 and taps.buf[jn] < 0:
                # the reducing tap's operand columns of a later step: a line in each of its rows, far
                # apart (the hardware prefetchers do not fetch them early)
                for c in range(nred):
                    prefetch_read(red.op, c * taps.ld[jn] + taps.at[jn] + b0)
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
            ta = taps.at[j]
            if ta >= 0 and taps.buf[j] < 0:
                # the reducing tap: the rows into the ring; a full tile reads the operand where it lies, a
                # run of evenly spaced columns at a time (zc, then zd apart; a break multiplies out first),
                # a partial one copies its samples' columns, zero-padded, into red.zt
                r0 = taps.row0[j]
                tb = ta + b0
                if full and nr > 1 and tb != zc + nr * zd:
                    block_sums(red.ring, rs, 0, red.op, zld, zc, zd, red.cols, nr * LANES, red.acc, red.rows, nred)
                    nr = 0
                if nr == 0:
                    zc = tb
                    zld = taps.ld[j]
                elif nr == 1:
                    zd = tb - zc
                rb = nr * LANES
                for i in range(red.rows):
                    if full:
                        vstore(red.ring, i * rs + rb, vload(nxt, (r0 + i) * LANES))
                    else:
                        vstore(red.ring, i * rs + rb, vzero(red.ring))
                        for bb in range(nb):
                            red.ring[i * rs + rb + bb] = nxt[(r0 + i) * LANES + bb]
                if not full:
                    for c in range(nred):
                        vstore(red.zt, c * rs + rb, vzero(red.zt))
                        for bb in range(nb):
                            red.zt[c * rs + rb + bb] = red.op[c * zld + tb + bb]
                nr += 1
                if nr * LANES == rw:
                    if full:
                        block_sums(red.ring, rs, 0, red.op, zld, zc, zd, red.cols, rw, red.acc, red.rows, nred)
                    else:
                        block_sums(red.ring, rs, 0, red.zt, rs, 0, LANES, red.cols, rw, red.acc, red.rows, nred)
                    nr = 0
            elif ta >= 0:
                # the tapped rows feature-major, as the tile holds them: one vector store per row (no
                # transposes; each store fills a whole cache line when the batch is a multiple of LANES)
                r0 = taps.row0[j]
                ld = taps.ld[j]
                dst = tap_bufs[taps.buf[j]]
                tb = ta + b0
                if full:
                    for i in range(taps.rows[j]):
                        vstore(dst, tb + i * ld, vload(nxt, (r0 + i) * LANES))
                else:
                    for i in range(taps.rows[j]):
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
            block_sums(red.ring, rs, 0, red.op, zld, zc, zd, red.cols, nr * LANES, red.acc, red.rows, nred)
        elif nr > 0:
            block_sums(red.ring, rs, 0, red.zt, rs, 0, LANES, red.cols, nr * LANES, red.acc, red.rows, nred)
    for g in range(red.rows):
        for c in range(nred):
            red.out[g, c] = lane_sum(red.acc, (g * nred + c) * LANES)



_compiled = None


def compiled():
    """The compiled :func:`_chain_kernel` (numba; compiled on first use, cached on disk)."""
    global _compiled
    if _compiled is None:
        cpu_simd.bind(globals(), _VECTOR_OPS)
        globals()["block_sums"] = cpu_nt.block_sums()
        globals()["lane_sum"] = cpu_nt.lane_sum()
        numba = numba_module()
        # inlined where called (numba's IR inlining): the same code as written out in the loop
        for name in ("_four_rows_alike", "_store4"):
            globals()[name + "_c"] = numba.njit(cache=True, nogil=True, error_model="numpy",
                                                inline="always")(globals()[name])
        _compiled = numba.njit(cache=True, nogil=True, error_model="numpy")(_chain_kernel)
    return _compiled
