"""Products ``A Z^T`` of two feature-major operands over a short run of positions, in vector lanes: the
reducing tap of the compiled linear scan (:class:`~spscan.runtime.Collect` with an ``operand``).

:func:`block_sums` adds ``a``'s rows times ``z``'s rows over ``w`` positions into lane-wise partial sums:
blocks of 4 rows by 4 columns, 16 vector accumulators in registers over the positions (lanes along the
positions, both operands' rows contiguous there), 4 x 1 and 1 x 1 blocks at the edges. The caller sums
the lanes at the end, in order (:func:`lane_sum`): every sum runs in a fixed order, so results are
reproducible bit for bit. The compiled linear scan (:mod:`.chain_tiles`) runs it on the rows it has just
produced, a few dozen steps at a time, without storing them. (A product over stored operands is a BLAS
GEMM's: it runs faster and on every thread torch has.)
"""

from __future__ import annotations

from spscan.kernels.cpu import simd as cpu_simd
from spscan.kernels.cpu.jit import numba_module
from spscan.kernels.cpu.simd import LANES

__all__ = ["block_sums", "lane_sum"]

# bound by block_sums() before the first compile (numba is optional and slow to import)
vload = vstore = vzero = vadd = vmuladd = vmuladdv = vtranspose = None
_VECTOR_OPS = ("vload", "vstore", "vzero", "vadd", "vmuladd", "vmuladdv", "vtranspose")

_block_sums_c = None
_add4_c = _lane_sum_c = None  # compiled with block_sums() / lane_sum()


def _block_sums(af, lda, ab, zf, ldz, zb, zgs, zrows, w, acc, M, K):  # pragma: no cover - compiled
    # acc[(g * K + c) * LANES + l] += sum over q = l, l + LANES, ... < w of a[g, q] z[zrows[c], q], where
    # row g of a is af[ab + g * lda:] (contiguous) and row r of z holds its positions in groups of
    # LANES, group u at zf[zb + r * ldz + u * zgs:] (zgs = LANES: contiguous; any other distance,
    # negative too: a caller's (steps, batch) memory read a tile at a time) (w a multiple of LANES)
    g = 0
    while g < M:
        a0 = g * lda + ab
        if g + 4 <= M:
            k = 0
            while k + 4 <= K:
                s00 = vzero(af)
                s01 = vzero(af)
                s02 = vzero(af)
                s03 = vzero(af)
                s10 = vzero(af)
                s11 = vzero(af)
                s12 = vzero(af)
                s13 = vzero(af)
                s20 = vzero(af)
                s21 = vzero(af)
                s22 = vzero(af)
                s23 = vzero(af)
                s30 = vzero(af)
                s31 = vzero(af)
                s32 = vzero(af)
                s33 = vzero(af)
                y0 = zrows[k] * ldz + zb
                y1 = zrows[k + 1] * ldz + zb
                y2 = zrows[k + 2] * ldz + zb
                y3 = zrows[k + 3] * ldz + zb
                zo = 0
                for q in range(0, w, LANES):
                    x0 = vload(af, a0 + q)
                    x1 = vload(af, a0 + lda + q)
                    x2 = vload(af, a0 + 2 * lda + q)
                    x3 = vload(af, a0 + 3 * lda + q)
                    w0 = vload(zf, y0 + zo)
                    w1 = vload(zf, y1 + zo)
                    w2 = vload(zf, y2 + zo)
                    w3 = vload(zf, y3 + zo)
                    s00 = vmuladdv(s00, x0, w0)
                    s01 = vmuladdv(s01, x0, w1)
                    s02 = vmuladdv(s02, x0, w2)
                    s03 = vmuladdv(s03, x0, w3)
                    s10 = vmuladdv(s10, x1, w0)
                    s11 = vmuladdv(s11, x1, w1)
                    s12 = vmuladdv(s12, x1, w2)
                    s13 = vmuladdv(s13, x1, w3)
                    s20 = vmuladdv(s20, x2, w0)
                    s21 = vmuladdv(s21, x2, w1)
                    s22 = vmuladdv(s22, x2, w2)
                    s23 = vmuladdv(s23, x2, w3)
                    s30 = vmuladdv(s30, x3, w0)
                    s31 = vmuladdv(s31, x3, w1)
                    s32 = vmuladdv(s32, x3, w2)
                    s33 = vmuladdv(s33, x3, w3)
                    zo += zgs
                b = (g * K + k) * LANES  # row g's partials of columns k .. k+3, then the next rows'
                _add4_c(acc, b, LANES, s00, s01, s02, s03)
                _add4_c(acc, b + K * LANES, LANES, s10, s11, s12, s13)
                _add4_c(acc, b + 2 * K * LANES, LANES, s20, s21, s22, s23)
                _add4_c(acc, b + 3 * K * LANES, LANES, s30, s31, s32, s33)
                k += 4
            for c in range(k, K):  # the last columns: 4 x 1
                s00 = vzero(af)
                s10 = vzero(af)
                s20 = vzero(af)
                s30 = vzero(af)
                y0 = zrows[c] * ldz + zb
                for q in range(0, w, LANES):
                    w0 = vload(zf, y0)
                    y0 += zgs
                    s00 = vmuladdv(s00, vload(af, a0 + q), w0)
                    s10 = vmuladdv(s10, vload(af, a0 + lda + q), w0)
                    s20 = vmuladdv(s20, vload(af, a0 + 2 * lda + q), w0)
                    s30 = vmuladdv(s30, vload(af, a0 + 3 * lda + q), w0)
                _add4_c(acc, (g * K + c) * LANES, K * LANES, s00, s10, s20, s30)  # rows g .. g+3 of column c
            g += 4
        else:  # the last rows: 1 x 1
            for c in range(K):
                s00 = vzero(af)
                y0 = zrows[c] * ldz + zb
                for q in range(0, w, LANES):
                    s00 = vmuladdv(s00, vload(af, a0 + q), vload(zf, y0))
                    y0 += zgs
                b = (g * K + c) * LANES
                vstore(acc, b, vadd(vload(acc, b), s00))
            g += 1


def _add4(acc, b, d, s0, s1, s2, s3):  # pragma: no cover - compiled
    # the partials s0 .. s3 added to acc at b, b + d, b + 2d, b + 3d
    vstore(acc, b, vadd(vload(acc, b), s0))
    vstore(acc, b + d, vadd(vload(acc, b + d), s1))
    vstore(acc, b + 2 * d, vadd(vload(acc, b + 2 * d), s2))
    vstore(acc, b + 3 * d, vadd(vload(acc, b + 3 * d), s3))


def _lane_sum(acc, q):  # pragma: no cover - compiled
    # acc[q] + acc[q + 1] + ... + acc[q + LANES - 1], in that order
    s = acc[q]
    for r in range(1, LANES):
        s += acc[q + r]
    return s


def block_sums():
    """The compiled :func:`_block_sums` (numba; compiled on first use, cached on disk): arguments
    ``(af, lda, ab, zf, ldz, zb, zrows, w, acc, M, K)`` as its comment says. Callable from other
    compiled kernels."""
    global _block_sums_c
    if _block_sums_c is None:
        numba = numba_module()
        cpu_simd.bind(globals(), _VECTOR_OPS)
        globals()["_add4_c"] = numba.njit(cache=True, nogil=True, inline="always")(_add4)
        _block_sums_c = numba.njit(cache=True, nogil=True, error_model="numpy")(_block_sums)
    return _block_sums_c


def lane_sum():
    """The compiled :func:`_lane_sum` (``acc, q``: the ``LANES`` partial sums at ``q`` summed in order), for the
    kernels that read :func:`block_sums`' partials; inlined where it is called."""
    global _lane_sum_c
    if _lane_sum_c is None:
        _lane_sum_c = numba_module().njit(cache=True, nogil=True, error_model="numpy", inline="always")(_lane_sum)
    return _lane_sum_c
