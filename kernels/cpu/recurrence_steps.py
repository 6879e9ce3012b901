"""The pieces of one recurrence step that the compiled loops (:mod:`.recurrence_loops`) inline.

* :func:`_vexpm1`: ``expm1`` of a 1-D buffer in place, from arithmetic only, so the loop vectorizes:
  Cody-Waite reduction ``y = k ln2 + r`` (``|r| <= ln2/2``), a degree-13 Taylor polynomial for
  ``expm1(r)`` (degree 8 in float32, see ``_SHORT``), ``2^k`` built from exponent bits. libm's
  ``exp``/``tanh``, called per element, do not vectorize and would be most of a small step. Its
  error is a few units in the last place in float32 and float64. The
  loops derive ``sigmoid(x) = 1 / (2 + expm1(-x))`` and ``tanh(|x|) = -e / (2 + e)`` with ``e =
  expm1(-2|x|)`` (no cancellation for small ``x``) from it.
* :func:`_gated_cell`: the cell-state update of four gates (three sigmoid, one tanh) and the
  derivatives the chain's gate element needs.
* ``_tile_*``: moves between a tile of ``LANES`` samples held feature-major (row ``j`` is one vector
  of ``LANES`` samples, :mod:`.simd`) and the sample- or feature-major memory outside, the
  tile's gate inputs, and the hidden-state product in four register accumulators.
* :func:`_sample_preactivations`: the pre-activations of the loops that run sample by sample.

They are compiled with ``inline="always"`` (numba's IR inlining): a call per helper and step passed
its arrays through reference counting. numba keys a kernel's on-disk cache by the kernel's own
source file, so after a change here clear the caches (``__pycache__/*.nbi``, ``*.nbc``) or the
loops keep the old code (an installed release replaces every file, which invalidates them).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from spscan.kernels.cpu.jit import numba_module
from spscan.kernels.cpu.simd import LANES, bind

__all__ = ["compiled", "expm1_consts", "int_type"]

# The vector operations the helpers name: numba intrinsics (kernels/cpu/simd.py), bound by compiled()
# before the first compile (numba is optional and slow to import).
vload = vstore = vstream = vtranspose = vmuladd = None
_VECTOR_OPS = ("vload", "vstore", "vstream", "vtranspose", "vmuladd")

# expm1 constants, per dtype: clamp range (2^k stays a normal number), Cody-Waite ln2 split, the
# rounding constant 1.5 * 2^mantissa_bits, then the Taylor coefficients 1/2!, 1/3!, ..., 1/13!, then 1
_TAYLOR = [1.0 / math.factorial(n) for n in range(2, 14)]
_CONSTS = {
    np.float64: [-708.0, 709.0, 1.0 / math.log(2.0), 6.93147180369123816490e-01, 1.90821492927058770002e-10,
                 1.5 * 2.0 ** 52],
    np.float32: [-87.0, 88.0, 1.0 / math.log(2.0), 0.693359375, -2.12194440e-4, 1.5 * 2.0 ** 23],
}
# integer view of the float: bits of the rounding constant, exponent bias, mantissa bits
_INT = {np.float64: (np.int64, 1075 << 52 | 1 << 51, 1023, 52), np.float32: (np.int32, 150 << 23 | 1 << 22, 127, 23)}
# float32 stops the series at r^8/8!: with |r| <= ln2/2 the first dropped term, r^9/9!, is below
# 6e-10 |r| -- under 1/200 of a float32 unit in the last place of expm1(r) ~ r -- and the
# polynomial is 5 multiply-adds shorter (the forwards spend most of their elementwise time here)
_SHORT = {np.float64: 0, np.float32: 1}


def int_type(np_dt):
    """The integer type of ``np_dt``'s width, the scratch :func:`_vexpm1` reads its floats' bits through."""
    return _INT[np_dt][0]


@functools.lru_cache(maxsize=None)
def expm1_consts(np_dt):
    """``(cst, icst)`` of :func:`_vexpm1` for ``np_dt`` (made once per dtype; the kernels only read them)."""
    itype, magic_bits, bias, shift = _INT[np_dt]
    cst = np.array(_CONSTS[np_dt] + _TAYLOR + [1.0], dtype=np_dt)
    return cst, np.array([magic_bits, bias, shift, _SHORT[np_dt]], dtype=itype)


def _vexpm1(buf, bits, bitsf, cst, icst):  # pragma: no cover - compiled
    """``buf[:] = expm1(buf[:])`` in place (1-D); ``bits`` (int) and ``bitsf`` (the same memory as float) scratch.

    ``k = round(y / ln2)`` by adding ``1.5 * 2^m`` (its low bits then hold ``k``), ``2^k`` from exponent bits.
    """
    lo, hi, log2e, ln2hi, ln2lo, magic = cst[0], cst[1], cst[2], cst[3], cst[4], cst[5]
    c2, c3, c4, c5, c6, c7 = cst[6], cst[7], cst[8], cst[9], cst[10], cst[11]
    c8, c9, c10, c11, c12, c13 = cst[12], cst[13], cst[14], cst[15], cst[16], cst[17]
    one = cst[18]
    magic_bits, bias, shift = icst[0], icst[1], icst[2]
    short = icst[3] != 0  # float32: the Taylor terms from r^9 on are below its rounding (see _SHORT)
    for q in range(buf.shape[0]):
        y = min(max(buf[q], lo), hi)
        kf = y * log2e + magic
        k = kf - magic
        r = (y - k * ln2hi) - k * ln2lo
        if short:
            p = c8
        else:
            p = c13
            p = p * r + c12
            p = p * r + c11
            p = p * r + c10
            p = p * r + c9
            p = p * r + c8
        p = p * r + c7
        p = p * r + c6
        p = p * r + c5
        p = p * r + c4
        p = p * r + c3
        p = p * r + c2
        buf[q] = r + r * r * p  # expm1(r)
        bitsf[q] = kf
    for q in range(buf.shape[0]):
        bits[q] = (bits[q] - magic_bits + bias) << shift
    for q in range(buf.shape[0]):
        s = bitsf[q]  # 2^k
        buf[q] = s * buf[q] + (s - one)  # expm1(k ln2 + r) = 2^k expm1(r) + (2^k - 1)


def _gated_cell(e, w, c, h, bits, bitsf, cst, icst):  # pragma: no cover - compiled
    # The cell-state update over n = e.shape[1] units (the per-sample loop's (b, j) or a tile's (j, lane)):
    # i, f, o = sigmoid(a_i, a_f, a_o), g = tanh(a_g), c' = f c + i g, h = o tanh(c').
    # e[0..3] hold the expm1 arguments of i, f, g, o (-a; -2|a| for g) and w[0] a_g (its sign);
    # updates the cell state c in place (one array: a second one for the previous state would keep
    # the loop scalar behind the compiler's overlap check) and writes h, and leaves k (e[0]), f (e[1]),
    # c_o (e[2]), o (e[3]), c_i, c_f, c_g (w[1..3]) for the gate element's values
    n = e.shape[1]
    one = cst[18]
    two = one + one
    _vexpm1_c(e[:4].reshape(-1), bits, bitsf, cst, icst)
    for p in range(n):
        i = one / (two + e[0, p])
        f = one / (two + e[1, p])
        ga = -e[2, p] / (two + e[2, p])
        g = ga if w[0, p] >= 0 else -ga
        o = one / (two + e[3, p])
        cpp = c[p]
        cn = f * cpp + i * g
        w[1, p] = g * i * (one - i)  # c_i
        w[2, p] = cpp * f * (one - f)  # c_f
        w[3, p] = i * (one - g * g)  # c_g
        c[p] = cn
        e[4, p] = -two * abs(cn)
        e[1, p] = f
        e[3, p] = o
    _vexpm1_c(e[4], bits, bitsf, cst, icst)
    for p in range(n):
        ta = -e[4, p] / (two + e[4, p])
        tc = ta if c[p] >= 0 else -ta
        o = e[3, p]
        h[p] = o * tc
        e[0, p] = o * (one - tc * tc)  # k
        e[2, p] = tc * o * (one - o)  # c_o


def _put(a, i, v, stream):  # pragma: no cover - compiled
    # a[i : i + LANES] = v: a plain store, or with stream a non-temporal one (_streams)
    if stream:
        vstream(a, i, v)
    else:
        vstore(a, i, v)


def _tile_load_state(h, h0, b0, nb):  # pragma: no cover - compiled
    # the tile's initial state: h[j] = samples b0 .. b0+nb of h0[:, j] (B, H); lanes past the batch zero
    for j in range(h0.shape[1]):
        for bb in range(LANES):
            h[j * LANES + bb] = h0[b0 + bb, j] if bb < nb else 0


def _tile_store_state(src, dst, base, stride, nb):  # pragma: no cover - compiled
    # the tile's rows j < len(src) // LANES to sample-major memory: dst[base + bb * stride + j] =
    # src[j * LANES + bb] for the nb samples (register transposes of LANES rows where the tile is full)
    rows = src.shape[0] // LANES
    j0 = 0
    if nb == LANES:
        while j0 + LANES <= rows:
            vtranspose(src, j0 * LANES, LANES, dst, base + j0, stride)
            j0 += LANES
    for j in range(j0, rows):
        for bb in range(nb):
            dst[base + bb * stride + j] = src[j * LANES + bb]


def _tile_store_rows(src, dst, base, stride, nb):  # pragma: no cover - compiled
    # the tile's rows j < len(src) // LANES to feature-major memory (nothing when dst is empty):
    # dst[base + j * stride + bb] = src[j * LANES + bb] for the nb samples, one vector store per row
    # where the tile is full
    if dst.shape[0] == 0:
        return
    rows = src.shape[0] // LANES
    if nb == LANES:
        for j in range(rows):
            vstore(dst, base + j * stride, vload(src, j * LANES))
    else:
        for j in range(rows):
            for bb in range(nb):
                dst[base + j * stride + bb] = src[j * LANES + bb]


def _tile_gate_inputs(gif, gb, gs, full, nb, a, rows):  # pragma: no cover - compiled
    # a[g] = the tile's gate inputs of row g (gif at gb + g * gs, samples contiguous), g < rows; lanes
    # past the batch zero
    if full:
        for g in range(rows):
            vstore(a, g * LANES, vload(gif, gb + g * gs))
    else:
        for g in range(rows):
            for bb in range(LANES):
                a[g * LANES + bb] = gif[gb + g * gs + bb] if bb < nb else 0


def _tile_inputs(gif, gb, gs, full, nb, a, rows, wi, bt, xv):  # pragma: no cover - compiled
    # a[g], g < rows: the tile's gate inputs. wi without columns: read, as _tile_gate_inputs (gif
    # holds them); else computed, a[g] = bt[g] + sum_i wi[g, i] x_i in ascending i (gif holds the
    # input, its row i at gb + i * gs; bt: (rows, LANES) the bias repeated; xv: (I, LANES) scratch)
    ni = wi.shape[1]
    if ni == 0:
        _tile_gate_inputs_c(gif, gb, gs, full, nb, a, rows)
    else:
        _tile_gate_inputs_c(gif, gb, gs, full, nb, xv, ni)
        if ni == 1:  # one pass instead of a bias copy, then a product pass
            x = vload(xv, 0)
            for g in range(rows):
                vstore(a, g * LANES, vmuladd(vload(bt, g * LANES), wi[g, 0], x))
        else:
            for g in range(rows):
                vstore(a, g * LANES, vload(bt, g * LANES))
            _tile_hidden_product_c(a, wi, xv, rows)


def _tile_hidden_product(a, w, h, rows):  # pragma: no cover - compiled
    # a[g] += sum_k w[g, k] h[k] for g < rows (h: (H, LANES)), summed over k in ascending order; four
    # rows at a time, each an accumulator in a register
    H = w.shape[1]
    g = 0
    while g + 4 <= rows:
        a0 = vload(a, g * LANES)
        a1 = vload(a, (g + 1) * LANES)
        a2 = vload(a, (g + 2) * LANES)
        a3 = vload(a, (g + 3) * LANES)
        for k in range(H):
            x = vload(h, k * LANES)
            a0 = vmuladd(a0, w[g, k], x)
            a1 = vmuladd(a1, w[g + 1, k], x)
            a2 = vmuladd(a2, w[g + 2, k], x)
            a3 = vmuladd(a3, w[g + 3, k], x)
        vstore(a, g * LANES, a0)
        vstore(a, (g + 1) * LANES, a1)
        vstore(a, (g + 2) * LANES, a2)
        vstore(a, (g + 3) * LANES, a3)
        g += 4
    while g < rows:
        a0 = vload(a, g * LANES)
        for k in range(H):
            a0 = vmuladd(a0, w[g, k], vload(h, k * LANES))
        vstore(a, g * LANES, a0)
        g += 1


def _sample_preactivations(acc, gi, t, hp, wt, B, H, G):  # pragma: no cover - compiled
    # acc[b, :G] = gi[t, b, :G] + hp[b] @ wt for the B samples, summed over k in ascending order (the
    # loops that run sample by sample; hp: h_{t-1}, (B, H); wt: W^T, (H, G))
    for b in range(B):
        for j in range(G):
            acc[b, j] = gi[t, b, j]
        for kk in range(H):
            hv = hp[b, kk]
            for j in range(G):
                acc[b, j] += hv * wt[kk, j]


def _tile_begin(h, h0, hz, hzs, b0, B):  # pragma: no cover - compiled
    # the tile of samples b0 .. b0 + LANES (of B): its initial state h from h0, and h_0 as step 0's
    # previous state into hz (when wanted); returns its sample count and whether it is full
    nb = min(LANES, B - b0)
    _tile_load_state_c(h, h0, b0, nb)
    _tile_store_rows_c(h, hz, b0, hzs, nb)
    return nb, nb == LANES


# The compiled helpers, by the names the helpers above and the loops call them (bound by compiled())
_vexpm1_c = _gated_cell_c = _put_c = _tile_load_state_c = _tile_store_state_c = _tile_store_rows_c = None
_tile_gate_inputs_c = _tile_inputs_c = _tile_hidden_product_c = _tile_begin_c = None
_sample_preactivations_c = None
_HELPERS = ("_vexpm1", "_gated_cell", "_put", "_tile_load_state", "_tile_store_state", "_tile_store_rows",
            "_tile_gate_inputs", "_tile_inputs", "_tile_hidden_product", "_tile_begin",
            "_sample_preactivations")


def jit(fn, inline: str = "never"):
    """``fn`` compiled as every recurrence loop and helper is: on disk cache, no GIL, ``error_model="numpy"``
    (IEEE division: no zero-division branch, which would keep the loops scalar)."""
    return numba_module().njit(cache=True, nogil=True, error_model="numpy", inline=inline)(fn)


def compiled() -> dict:
    """The compiled helpers by the names the loops call them (``"_vexpm1_c"``, ...): bound here, with the
    vector operations they use, before any loop compiles (compiled on first use, inlined where called)."""
    if _vexpm1_c is None:
        bind(globals(), _VECTOR_OPS)
        globals().update({name + "_c": jit(globals()[name], "always") for name in _HELPERS})
    return {name + "_c": globals()[name + "_c"] for name in _HELPERS}
