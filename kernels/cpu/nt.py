"""Products ``A Z^T`` of two feature-major operands over a long dimension, in vector lanes: the compiled CPU
weight-gradient GEMMs of a recurrence.

A recurrence's weight gradient is ``sum_n a[:, n] z[:, n]^T`` over all ``N = T*B`` steps and samples:
a ``(M x N) (N x K)`` product with a long reduction and a tiny output (``80 x 22`` over ``N = 16000``
at ``H = 20``, ``T = 1000``, ``B = 16``), which the BLAS GEMM runs at a fraction of the core's vector
width. :func:`block_sums` adds ``a``'s rows times ``z``'s rows over ``w`` positions into lane-wise
partial sums: blocks of 4 rows by 4 columns, 16 vector accumulators in registers over the positions
(lanes along ``N``, both operands' rows contiguous there), 4 x 1 and 1 x 1 blocks at the edges. The
caller sums the lanes at the end, in order: every sum runs in a fixed order, so results are
reproducible bit for bit. Used by :func:`matmul_nt` (chunk by chunk of memory it holds) and by the
compiled linear scan (:mod:`.cpu_chain_tiles`, on the gradients it has just produced, a few dozen
steps at a time, without storing them).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from spscan.kernels.cpu import simd as cpu_simd
from spscan.kernels.cpu.fpenv import flushing_subnormals
from spscan.kernels.cpu.jit import available, numba_module
from spscan.kernels.cpu.simd import LANES

__all__ = ["block_sums", "lane_sum", "matmul_nt"]

# bound by block_sums() before the first compile (numba is optional and slow to import)
vload = vstore = vzero = vadd = vmuladd = vmuladdv = vtranspose = None
_VECTOR_OPS = ("vload", "vstore", "vzero", "vadd", "vmuladd", "vmuladdv", "vtranspose")

_block_sums_c = None
_add4_c = _lane_sum_c = None  # compiled with block_sums() / lane_sum()
_matmul_nt_c = None


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


def _matmul_nt_kernel(af, lda, n, zf, ldz, zrows, nc, acc, out, tr, zt):  # pragma: no cover - compiled
    # out[g, c] = sum_q a[g, q] z[zrows[c], q], q < n (a: M rows, row g at af[g * lda:]; z: rows at
    # zf[r * ldz:]; both feature-major, positions contiguous). Chunks of nc positions (the chunk of z's
    # rows stays in L1 while every block of a's rows reads it) through block_sums (lane-wise partials
    # in acc); at the end each partial is summed across its lanes in order, then the positions past
    # the last whole vector one by one. Fixed order: reproducible bit for bit. The end runs LANES
    # outputs of a row at a time where it can: their partials transposed (tr: LANES x LANES scratch),
    # so lane l of all of them is one vector and the in-order sums are vector adds, and the positions
    # past the last whole vector read from zt ((n % LANES) x K: those columns of z's rows, transposed),
    # the same operations in the same order as one output at a time.
    M, K = out.shape
    nv = n - n % LANES
    for i in range(acc.shape[0]):
        acc[i] = 0
    for c0 in range(0, nv, nc):
        _block_sums_c(af, lda, c0, zf, ldz, c0, LANES, zrows, min(nc, nv - c0), acc, M, K)
    for q in range(nv, n):
        for c in range(K):
            zt[(q - nv) * K + c] = zf[zrows[c] * ldz + q]
    of = out.reshape(M * K)
    for g in range(M):
        c = 0
        while c + LANES <= K:
            vtranspose(acc, (g * K + c) * LANES, LANES, tr, 0, LANES)
            s = vload(tr, 0)
            for r in range(1, LANES):
                s = vadd(s, vload(tr, r * LANES))
            for q in range(nv, n):
                s = vmuladd(s, af[g * lda + q], vload(zt, (q - nv) * K + c))
            vstore(of, g * K + c, s)
            c += LANES
        for c in range(c, K):
            s = _lane_sum_c(acc, (g * K + c) * LANES)
            for q in range(nv, n):  # past the last whole vector
                s += af[g * lda + q] * zt[(q - nv) * K + c]
            of[g * K + c] = s



# positions per chunk of the product: the chunk of the second operand's rows stays in the L1 cache while
# every block of the first's rows reads it (2 KB per row at float32; shorter or longer chunks measured slower)
_CHUNK = 512


def matmul_nt(a: torch.Tensor, z: torch.Tensor, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``a @ z[rows].T`` in one compiled pass over ``a``.

    Args:
        a: ``(M, N)`` with contiguous rows (any row stride), ``N`` long (a recurrence's pre-activation
            gradients, row ``g`` over all ``N = T*B`` steps and samples).
        z: ``(K, N)`` with contiguous rows (any row stride): the other operands, feature-major as well
            (the previous states' rows, the inputs' and a row of ones, whose product is ``a``'s row sums).
        rows: which rows of ``z``, in the order wanted (default: all).
    Returns:
        ``(M, len(rows))`` of ``a``'s dtype.

    Why: a ``(M x N) (N x K)`` product with a long reduction and a tiny output, which the BLAS GEMM
    runs at a fraction of the core's vector width, and several such products read ``a`` again each.
    Here each ``4 x 4`` output block is 16 vector accumulators over a cache-sized chunk of both
    operands (lanes along ``N``), and ``a`` is read once for all of them. Sums run in a fixed order
    (lane-wise partials, then across lanes): reproducible bit for bit.

    Raises ``RuntimeError`` without numba, ``TypeError`` for dtypes other than float32/float64 or
    non-CPU tensors, ``ValueError`` for mismatched shapes, rows without contiguous positions or
    ``rows`` out of range.
    """
    if not available():
        raise RuntimeError("spscan.kernels.cpu.nt needs numba (pip install numba)")
    dt = a.dtype
    if dt not in (torch.float32, torch.float64) or any(t.dtype != dt or t.device.type != "cpu" for t in (a, z)):
        raise TypeError(f"matmul_nt: expected float32/float64 CPU tensors of one dtype, got a {a.dtype} on "
                        f"{a.device}, z {z.dtype} on {z.device}")
    if a.dim() != 2 or z.dim() != 2 or z.shape[1] != a.shape[1] or any(
            t.shape[0] > 1 and t.shape[1] > 1 and t.stride(1) != 1 for t in (a, z)):
        raise ValueError(f"matmul_nt: expected a (M, N) and z (K, N), each with contiguous rows, got a "
                         f"{tuple(a.shape)} strides {a.stride()}, z {tuple(z.shape)} strides {z.stride()}")
    M, N = a.shape
    K = z.shape[0]
    zrows = np.arange(K, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    if zrows.size and (zrows.min() < 0 or zrows.max() >= K):
        raise ValueError(f"matmul_nt: rows must be within range({K}), got {zrows.tolist()}")
    out = torch.empty(M, zrows.size, dtype=dt)
    if M == 0 or N == 0 or zrows.size == 0:
        return out.zero_()
    af, lda = _flat_rows(a)
    zf, ldz = _flat_rows(z)
    with flushing_subnormals():  # as the scan that made ``a`` (cpu_fpenv)
        K = zrows.size
        _compiled_matmul_nt()(af, lda, N, zf, ldz, zrows, _CHUNK, np.empty(M * K * LANES, dtype=af.dtype), out.numpy(),
                              np.empty(LANES * LANES, dtype=af.dtype), np.empty(max(N % LANES, 1) * K, dtype=af.dtype))
    return out


def _compiled_matmul_nt():
    global _matmul_nt_c
    if _matmul_nt_c is None:
        block_sums()
        lane_sum()
        _matmul_nt_c = numba_module().njit(cache=True, nogil=True, error_model="numpy")(_matmul_nt_kernel)
    return _matmul_nt_c


def _flat_rows(t: torch.Tensor) -> tuple:
    """``(flat, row_stride)``: a 2-D tensor with contiguous rows as the 1-D NumPy view of its memory from its
    first element (rows ``row_stride`` apart), as the compiled kernels index it."""
    R, N = t.shape
    ld = t.stride(0) if R > 1 else N
    t = t.detach()
    return torch.as_strided(t, ((R - 1) * ld + N,), (1,), t.storage_offset()).numpy(), ld

