"""The compiled loop of a linear run for a narrow batch (a few samples): one sample at a time, the vector
lanes along the features.

Why: the tiled loop (:mod:`.chain_tiles`) runs ``LANES`` samples side by side, one per lane, so a
batch of one does a whole tile's arithmetic (a 64 x 256 shared block: 16384 vector multiply-adds, 1 lane
of 16 used). Here each sample runs alone and a shared dense block's rows go along the lanes: the same
block is 1024 vector multiply-adds. That is the batch of one of a recurrent step on a single sequence
(an online or reinforcement-learning update, a generated sequence), where the tiled loop left a 1000-step
LSTM slower than autograd.

The sums are the tiled loop's, operation for operation: every output starts at zero and adds ``value *
input`` in ascending stored order (a multiply, then an add: no fused multiply-add, no reassociation), a
diagonal is one product, a gate step the same products, so a sample's result is bitwise the same in
either loop (and in any batch). For that a shared step's values are read by blocks of rows that agree
slot by slot, each slot's column the same in every row or one further per row (a weight block beside
its diagonal band of identity entries; :func:`.chain_tables.narrow_tables`): the call first copies
such a block of ``R`` rows position by position (the ``R`` values of stored position ``q`` together;
16 x 16 register transposes), once for all the steps that share those values, so its rows run as
``LANES``-row vectors, four at a time, each row still summing its own entries in stored order; rows
past the last whole vector, and rows alone in their block, sum as scalars. Per-sample dense and CSR
steps (values the sample's own, not worth reordering per call) sum row by row as scalars, as the tiled
loop does per lane.

Diagonal steps back to back (elementwise layers: a chain of activations, scalings, masks) whose values lie
row after row run through one tight loop, each a product per row in place, until a step with an affine
term, a feed or a tap (:func:`.chain.diagonal_runs`): there the general step's table reads and branches
cost several times its few multiplies (a chain of 30000 4-wide diagonals ran 3-5x faster so). The products are the same, so the results are too.

The copy is what the narrow loop pays: :func:`.chain.run_chain` takes it only where each sample
reads the shared values at least ``NARROW_MIN_REUSE`` times over (a recurrence's weight, read every
step), not for a run that reads each layer's weight once. Not here: the reducing tap (a weight gradient
summed across a full batch's lanes; that batch runs tiled) and prefetching (a sample's running vector
and blocks stay in L1).
"""

from __future__ import annotations

from spscan.kernels.cpu import simd as cpu_simd
from spscan.kernels.cpu.jit import numba_module
from spscan.kernels.cpu.simd import LANES

__all__ = ["compiled"]

# bound by compiled() before the first compile (numba is optional and slow to import)
get = vload = vstore = vzero = vmul = vmuladd = vmuladdv = vtranspose = None
_VECTOR_OPS = ("get", "vload", "vstore", "vzero", "vmul", "vmuladd", "vmuladdv", "vtranspose")


def _narrow_kernel(st, blocks, drun, sources, vectors, cur, nxt, tval, zero, taps, tap_bufs, feeds,
                   feed_bufs):  # pragma: no cover - compiled
    # st: the run's step tables (chain_tables.ChainSteps), read below under their own names; blocks: their
    # shared steps' row blocks (chain_tables.NarrowTables); taps, feeds: the per-step tap and feed tables
    # (TapTables, FeedTables), their buffers tap_bufs, feed_bufs (tuples)
    (code, src, offset, bstride, estride, rows, cols, add, out, csr_ptr, csr_indptr, csr_indices, _, _, vin0) = st
    # cur, nxt: (width,) the sample's running vector and the next one. Shared steps (codes 1, 3): blocks
    # blocks.step_b0[j] .. blocks.step_b1[j], block u: rows blk_r0[u] .. + blk_rows[u] (R) of blk_n[u] (n)
    # entries each (blocks.blk_r0, ...), slot q of row r0 + r at column blk_cols[blk_col[u] + q] + r *
    # col_step[.] (0 or 1), its value at tval[step_tv[j] + blk_val[u] + q * R + r], copied there (from the
    # row-major values at the step's offset + blk_val[u]) for the first step of those values (step_fill[j]).
    # zero: (1,) a zero of the dtype (scalar sums start there)
    # drun: (steps,) the diagonal run from each step (cpu_chain.diagonal_runs): where it is 2 or more, the
    # steps go through one tight loop until one has an affine term, a feed or a tap
    batch = vectors.shape[0]
    steps = code.shape[0]
    for j in range(steps):
        if blocks.step_fill[j]:
            s = sources[src[j]]
            o = offset[j]
            tv = blocks.step_tv[j]
            for u in range(blocks.step_b0[j], blocks.step_b1[j]):
                R = blocks.blk_rows[u]
                n = blocks.blk_n[u]
                bs = o + blocks.blk_val[u]  # row r, position q at bs + r * n + q; copied to bt + q * R + r
                bt = tv + blocks.blk_val[u]
                r = 0
                while r + LANES <= R:  # LANES x LANES tiles through register transposes
                    q = 0
                    while q + LANES <= n:
                        vtranspose(s, bs + r * n + q, n, tval, bt + q * R + r, R)
                        q += LANES
                    for qq in range(q, n):
                        for i in range(LANES):
                            tval[bt + qq * R + r + i] = get(s, bs + (r + i) * n + qq)
                    r += LANES
                for rr in range(r, R):
                    for q in range(n):
                        tval[bt + q * R + rr] = get(s, bs + rr * n + q)
    for b in range(batch):
        for kk in range(cols[0]):
            cur[kk] = vectors[b, vin0 + kk]
        ta = taps.at[steps]
        if ta >= 0:  # the run's input y_{-1} is tapped too
            r0 = taps.row0[steps]
            ld = taps.ld[steps]
            dst = tap_bufs[taps.buf[steps]]
            for i in range(taps.rows[steps]):
                dst[ta + b + i * ld] = cur[r0 + i]
        j = 0
        while j < steps:
            if drun[j] > 1:  # diagonals back to back (elementwise layers): each a product per row, in place
                m = rows[j]
                s = sources[src[j]]
                e = j + drun[j]
                jj = j
                while jj < e and add[jj] < 0 and feeds.at[jj] < 0 and taps.at[jj] < 0:
                    vb = offset[jj] + b * bstride[jj]
                    for i in range(m):
                        cur[i] = get(s, vb + i) * cur[i]
                    oj = out[jj]
                    if oj >= 0:
                        for i in range(m):
                            vectors[b, oj + i] = cur[i]
                    jj += 1
                if jj > j:
                    j = jj
                    continue
            m = rows[j]
            s = sources[src[j]]
            cj = code[j]
            es = estride[j]
            if cj == 0:  # diagonal: one product per row
                if bstride[j] == 0:
                    vb = offset[j]
                    es = 1
                else:
                    vb = offset[j] + b * bstride[j]
                i = 0
                if es == 1:
                    while i + LANES <= m:
                        vstore(nxt, i, vmul(vload(s, vb + i), vload(cur, i)))
                        i += LANES
                while i < m:
                    nxt[i] = get(s, vb + i * es) * cur[i]
                    i += 1
            elif cj == 1 or cj == 3:  # shared: blocks of rows with one column list, their values by column
                tv = blocks.step_tv[j]
                for u in range(blocks.step_b0[j], blocks.step_b1[j]):
                    r0 = blocks.blk_r0[u]
                    R = blocks.blk_rows[u]
                    n = blocks.blk_n[u]
                    ca = blocks.blk_col[u]
                    va = tv + blocks.blk_val[u]
                    r = 0
                    while r + 4 * LANES <= R:
                        a0 = a1 = a2 = a3 = vzero(cur)
                        for q in range(n):
                            c = get(blocks.blk_cols, ca + q)
                            vq = va + q * R + r
                            if get(blocks.col_step, ca + q) == 0:  # one column for every row: one input
                                x = get(cur, c)
                                a0 = vmuladd(a0, x, vload(tval, vq))
                                a1 = vmuladd(a1, x, vload(tval, vq + LANES))
                                a2 = vmuladd(a2, x, vload(tval, vq + 2 * LANES))
                                a3 = vmuladd(a3, x, vload(tval, vq + 3 * LANES))
                            else:  # a diagonal: row r0 + r reads column c + r
                                a0 = vmuladdv(a0, vload(tval, vq), vload(cur, c + r))
                                a1 = vmuladdv(a1, vload(tval, vq + LANES), vload(cur, c + r + LANES))
                                a2 = vmuladdv(a2, vload(tval, vq + 2 * LANES), vload(cur, c + r + 2 * LANES))
                                a3 = vmuladdv(a3, vload(tval, vq + 3 * LANES), vload(cur, c + r + 3 * LANES))
                        vstore(nxt, r0 + r, a0)
                        vstore(nxt, r0 + r + LANES, a1)
                        vstore(nxt, r0 + r + 2 * LANES, a2)
                        vstore(nxt, r0 + r + 3 * LANES, a3)
                        r += 4 * LANES
                    while r + LANES <= R:
                        a0 = vzero(cur)
                        for q in range(n):
                            c = get(blocks.blk_cols, ca + q)
                            if get(blocks.col_step, ca + q) == 0:
                                a0 = vmuladd(a0, get(cur, c), vload(tval, va + q * R + r))
                            else:
                                a0 = vmuladdv(a0, vload(tval, va + q * R + r), vload(cur, c + r))
                        vstore(nxt, r0 + r, a0)
                        r += LANES
                    while r < R:
                        acc = zero[0]
                        for q in range(n):
                            c = get(blocks.blk_cols, ca + q) + r * get(blocks.col_step, ca + q)
                            acc = acc + get(tval, va + q * R + r) * get(cur, c)
                        nxt[r0 + r] = acc
                        r += 1
            elif cj == 5:  # gate bands from their 6H compact numbers (see cpu_chain)
                hh = m // 5
                vb = offset[j] + b * bstride[j]
                u = 0
                if es == 1:
                    while u + LANES <= hh:
                        gh = vload(cur, u)
                        w = vmuladdv(vload(cur, hh + u), vload(s, vb + u), gh)
                        vstore(nxt, u, vmul(vload(s, vb + 2 * hh + u), w))
                        vstore(nxt, hh + u, vmul(vload(s, vb + 3 * hh + u), w))
                        vstore(nxt, 2 * hh + u, vmul(vload(s, vb + 4 * hh + u), w))
                        vstore(nxt, 3 * hh + u, vmul(vload(s, vb + 5 * hh + u), gh))
                        vstore(nxt, 4 * hh + u, vmul(vload(s, vb + hh + u), w))
                        u += LANES
                while u < hh:
                    gh = cur[u]
                    w = cur[hh + u] + get(s, vb + u * es) * gh
                    nxt[u] = get(s, vb + (2 * hh + u) * es) * w
                    nxt[hh + u] = get(s, vb + (3 * hh + u) * es) * w
                    nxt[2 * hh + u] = get(s, vb + (4 * hh + u) * es) * w
                    nxt[3 * hh + u] = get(s, vb + (5 * hh + u) * es) * gh
                    nxt[4 * hh + u] = get(s, vb + (hh + u) * es) * w
                    u += 1
            else:  # per-sample dense (2) or CSR (4): row by row, each in stored order
                k = cols[j]
                vb = offset[j] + b * bstride[j]
                cp = csr_ptr[j] if cj == 4 else 0
                g0 = csr_indptr[cp] if cj == 4 else 0
                for i in range(m):
                    if cj == 2:
                        p = i * k
                        n = k
                    else:
                        p = csr_indptr[cp + i] - g0
                        n = csr_indptr[cp + i + 1] - g0 - p
                    acc = zero[0]
                    for q in range(n):
                        c = q if cj == 2 else get(csr_indices, g0 + p + q)
                        acc = acc + get(s, vb + (p + q) * es) * get(cur, c)
                    nxt[i] = acc
            a = add[j]
            if a >= 0:
                for i in range(m):
                    nxt[i] += vectors[b, a + i]
            fa = feeds.at[j]
            if fa >= 0:
                fsrc = feed_bufs[feeds.buf[j]]
                r0, fbs, fs = feeds.row0[j], feeds.bs[j], feeds.fs[j]
                for i in range(feeds.rows[j]):
                    nxt[r0 + i] += fsrc[fa + b * fbs + i * fs]
            ta = taps.at[j]
            if ta >= 0:
                r0, ld, dst = taps.row0[j], taps.ld[j], tap_bufs[taps.buf[j]]
                for i in range(taps.rows[j]):
                    dst[ta + b + i * ld] = nxt[r0 + i]
            oj = out[j]
            if oj >= 0:
                for i in range(m):
                    vectors[b, oj + i] = nxt[i]
            cur, nxt = nxt, cur
            j += 1


_compiled = None


def compiled():
    """The compiled :func:`_narrow_kernel` (numba; compiled on first use, cached on disk)."""
    global _compiled
    if _compiled is None:
        cpu_simd.bind(globals(), _VECTOR_OPS)
        _compiled = numba_module().njit(cache=True, nogil=True, error_model="numpy")(_narrow_kernel)
    return _compiled
