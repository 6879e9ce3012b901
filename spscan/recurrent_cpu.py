"""The RNN, GRU and LSTM forwards on CPU in one compiled pass: outputs (and final cell) and the chain's Jacobian values.

:func:`rnn_forward` does the same for ``nn.RNN`` (tanh or relu): ``h_t = act(gi_t + h_{t-1} W_hh^T)``
and the diagonal ``dh_t/da_t`` the factored chain's second element holds, in one time loop (tanh
through the ``expm1`` below).

:func:`gru_forward` does it for ``nn.GRU`` (PyTorch's equations, gates ``r, z, n``): per step one
product with ``W_hh``, then ``r, z`` (sigmoids), ``n = tanh(gi_n + r (W_hn h + b_hn))`` and
``h' = (h - n) z + n`` as PyTorch's CPU cell writes it, and the values of the factored chain's
diagonal element ``(dr, dz, dm, z)`` plus ``dn`` (the input side of ``n``, for ``W_in``'s gradient),
so the gates are evaluated once instead of being recomputed from the module's outputs.

:class:`spscan.recurrent.RecurrentPlan` (factored layout, sequential forward, CPU tensors, numba
importable) runs the recurrence here instead of running the module and then recomputing the
gates and ``c_t`` from its outputs. One time loop computes, per step,

    a_t = (x_t W_ih^T + b_ih + b_hh) + h_{t-1} W_hh^T          (input part: see below)
    i, f, o = sigmoid(a_i, a_f, a_o),  g = tanh(a_g),  c_t = f c_{t-1} + i g,  h_t = o tanh(c_t)

and writes ``h_t`` and the step's gate element (:func:`spscan.cells.lstm_gate_pattern`) as its ``6H``
compact numbers per sample (:func:`spscan.cells.lstm_gate_encoding`: ``k, f, c_i, c_f, c_g, c_o``;
the ``9H`` CSR values are products of them), so the gates are evaluated once and ``c_t`` comes from
the forward.

:func:`weight_gradients` is the backward's other compiled pass: the layer's weight and bias
gradients from the gate pre-activation gradients the linear scan collects, one pass over them for
all (instead of a GEMM per weight and a sum per bias, each reading them again).

Tiles: from ``TILE_MIN_BATCH`` samples up each forward runs the batch in tiles of ``LANES`` samples,
feature-major (unit ``j`` of a tile is one vector of ``LANES`` samples, :mod:`spscan.kernels.cpu_simd`),
so the hidden-state product is four register accumulators per pass over ``h`` and the elementwise
work runs over whole tiles; the input part of the gates is computed in the time loop for inputs of
at most ``FUSED_MAX_INPUT`` features (:class:`InputProjection`; the paper's RNNs read one), else
read from ``(G, T, B)`` memory made by one GEMM before the loop (:func:`gate_inputs`), and the chain
values are written entry-major (``(T, nnz, B)`` memory, returned as ``(T, B, nnz)`` views),
which the linear scan reads in place. Below ``TILE_MIN_BATCH`` a loop per sample runs (same sums).

Why compiled, and why its own ``exp``: the step is tiny (B x 4H x H multiply-adds, B*5H
transcendentals), so a loop of torch calls is bound by per-call overhead; and a compiled loop
calling libm's ``exp``/``tanh`` per element spends ~10-40 ns on each (they do not vectorize), which
at B = 16, H = 20 is most of the step. ``sigmoid`` and ``tanh`` are therefore computed from an
``expm1`` made of arithmetic only (Cody-Waite reduction ``y = k ln2 + r``, ``|r| <= ln2/2``, a
degree-13 Taylor polynomial for ``expm1(r)``, ``2^k`` built from exponent bits), loops the compiler
can vectorize (``error_model="numpy"``: IEEE division, no zero-division branch); its error is a few units in the last place in float32 and float64 (the tests compare
with the module's forward). ``sigmoid(x) = 1 / (2 + expm1(-x))``, ``tanh(|x|) = -e / (2 + e)`` with
``e = expm1(-2|x|)`` (no cancellation for small ``x``). Every sum runs in a fixed order: results
are bitwise reproducible run to run. No ``fastmath``, no ``parallel``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from spscan.kernels import cpu_nt
from spscan.kernels.cpu_simd import LANES, last_level_cache_bytes

# The vector operations the tiled kernel names: numba intrinsics (kernels/cpu_simd.py), bound before
# its first compile (numba is optional and slow to import).
vload = vstore = vstream = vmuladd = vtranspose = vscale = vabs = None
_VECTOR_OPS = ("vload", "vstore", "vstream", "vmuladd", "vtranspose", "vscale", "vabs")

__all__ = ["FUSED_MAX_INPUT", "InputProjection", "available", "gate_inputs", "gru_forward", "input_projection",
           "lstm_forward", "rnn_forward", "weight_gradients"]

_numba = None  # the numba module once imported; False if it is not installed

# From this batch size up the LSTM, GRU and RNN forwards run in tiles of LANES samples (vector registers
# across the batch, kernels/cpu_simd.py); below it, a loop per sample wastes less of each tile
TILE_MIN_BATCH = 8


def available() -> bool:
    """Whether the compiled forward can run (numba importable)."""
    global _numba
    if _numba is None:
        try:
            import numba
        except ImportError:
            _numba = False
        else:
            _numba = numba
    return bool(_numba)


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


@functools.lru_cache(maxsize=None)
def _expm1_consts(np_dt):
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


def _lstm_cell(e, w, c, h, bits, bitsf, cst, icst):  # pragma: no cover - compiled
    # The LSTM cell over n = e.shape[1] units (the per-sample loop's (b, j) or a tile's (j, lane)):
    # e[0..3] hold the expm1 arguments of i, f, g, o (-a; -2|a| for g) and w[0] a_g (its sign);
    # updates the cell c in place (one array: a second one for the previous cell would keep the
    # loop scalar behind the compiler's overlap check) and writes h, and leaves k (e[0]), f (e[1]),
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


def _lstm_kernel(gi, wt, h0, c0, cst, icst, hs, vals, c, acc, e, w, bits, bitsf):  # pragma: no cover - compiled
    # e rows: expm1 arguments/results of i, f, g, o, tanh(c), then the activations in place;
    # w rows: a_g (its sign), c_i, c_f, c_g. Indexed as 2-D arrays (one base each), which the
    # compiler vectorizes more readily than a dozen separate row views.
    T, B, G = gi.shape
    H = G // 4
    two = cst[18] + cst[18]
    for t in range(T):
        # a_t = gi_t + h_{t-1} W_hh^T, summed over k in ascending order
        hp = h0 if t == 0 else hs[t - 1]
        for b in range(B):
            for j in range(G):
                acc[b, j] = gi[t, b, j]
            for kk in range(H):
                hv = hp[b, kk]
                for j in range(G):
                    acc[b, j] += hv * wt[kk, j]
        # expm1 arguments: -a for the sigmoid gates (i, f, o), -2|a| for g
        for b in range(B):
            for j in range(H):
                p = b * H + j
                e[0, p] = -acc[b, j]
                e[1, p] = -acc[b, H + j]
                w[0, p] = acc[b, 2 * H + j]
                e[2, p] = -two * abs(acc[b, 2 * H + j])
                e[3, p] = -acc[b, 3 * H + j]
        if t == 0:
            c[:] = c0.reshape(-1)
        _lstm_cell_c(e, w, c, hs[t].reshape(-1), bits, bitsf, cst, icst)
        vt = vals[t]
        for b in range(B):
            v = vt[b]
            for j in range(H):
                p = b * H + j
                v[j] = e[0, p]  # k
                v[H + j] = e[1, p]  # f
                v[2 * H + j] = w[1, p]  # c_i
                v[3 * H + j] = w[2, p]  # c_f
                v[4 * H + j] = w[3, p]  # c_g
                v[5 * H + j] = e[2, p]  # c_o


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
        if ni == 1:  # one pass (a bias copy, then a product pass: the T = 1000 LSTM forward 1.70 -> 1.62 ms)
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


def _lstm_tile_kernel(gif, gs, ts, wi, bt, xv, w, h0, c0, cst, icst, hf, hts, hbs, vals, c_n, h, c, a, vt, e, wk, bits,
                      bitsf, stream, hz, hzs):  # pragma: no cover - compiled
    # Tiles of LANES samples, feature-major: row j of a tile (h, c: (H, LANES); a: (4H, LANES); vt:
    # (6H, LANES)) is one vector. gif: the gate inputs, flat, row g of step t at g * gs + t * ts,
    # samples contiguous; vals: (T, 6H, B) entry-major; hs: (T, B, H), h0, c0, c_n: (B, H). e rows:
    # expm1 arguments / results of i, f, g, o, tanh(c), then the activations in place; wk rows: a_g
    # (its sign), c_i, c_f, c_g.
    T, H6, B = vals.shape
    H = H6 // 6
    G = 4 * H
    n = H * LANES
    one = cst[18]
    two = one + one
    vf = vals.reshape(T * 6 * H * B)
    for b0 in range(0, B, LANES):
        nb = min(LANES, B - b0)
        full = nb == LANES
        _tile_load_state_c(h, h0, b0, nb)
        _tile_store_rows_c(h, hz, b0, hzs, nb)  # h_0: step 0's previous state
        _tile_load_state_c(c, c0, b0, nb)
        for t in range(T):
            gb = t * ts + b0
            _tile_inputs_c(gif, gb, gs, full, nb, a, G, wi, bt, xv)
            _tile_hidden_product_c(a, w, h, G)  # a += W_hh h_{t-1}
            # expm1 arguments: -a for the sigmoid gates (i, f, o), -2|a| for g; in vectors (as a loop over
            # the rows of e and wk, which the compiler cannot prove apart from a, it stayed scalar: 0.3
            # of the T = 1000 forward's 1.75 ms)
            e0, e1, e2, e3, w0 = e[0], e[1], e[2], e[3], wk[0]
            for p in range(0, n, LANES):
                ag = vload(a, 2 * n + p)
                vstore(e0, p, vscale(-one, vload(a, p)))
                vstore(e1, p, vscale(-one, vload(a, n + p)))
                vstore(w0, p, ag)
                vstore(e2, p, vscale(-two, vabs(ag)))
                vstore(e3, p, vscale(-one, vload(a, 3 * n + p)))
            _lstm_cell_c(e, wk, c, h, bits, bitsf, cst, icst)
            # the gate element's compact numbers (k, f, c_i, c_f, c_g, c_o; see the module docstring):
            # number q of the tile at vb + q * B (a full tile straight there, a partial one through vt)
            vb = t * 6 * H * B + b0
            out = vf if full else vt
            ob = vb if full else 0
            ostr = B if full else LANES
            st = stream and full
            for j in range(H):
                q = j * LANES
                kv = vload(e[0], q)
                ci = vload(wk[1], q)
                cf = vload(wk[2], q)
                cg = vload(wk[3], q)
                fv = vload(e[1], q)
                _put_c(out, ob + j * ostr, kv, st)
                _put_c(out, ob + (H + j) * ostr, fv, st)
                _put_c(out, ob + (2 * H + j) * ostr, ci, st)
                _put_c(out, ob + (3 * H + j) * ostr, cf, st)
                _put_c(out, ob + (4 * H + j) * ostr, cg, st)
                _put_c(out, ob + (5 * H + j) * ostr, vload(e[2], q), st)
            if not full:
                for q in range(6 * H):
                    for bb in range(nb):
                        vf[vb + q * B + bb] = vt[q * LANES + bb]
            _tile_store_state_c(h, hf, t * hts + b0 * hbs, hbs, nb)
            if t + 1 < T:
                _tile_store_rows_c(h, hz, (t + 1) * B + b0, hzs, nb)  # step t+1's previous state
        for j in range(H):
            for bb in range(nb):
                c_n[b0 + bb, j] = c[j * LANES + bb]


def _rnn_tile_kernel(gif, gs, ts, wi, bt, xv, w, h0, cst, icst, relu, hf, hts, hbs, d, h, a, dv, e, bits,
                     bitsf, stream, hz, hzs):  # pragma: no cover - compiled
    # _rnn_kernel in tiles of LANES samples, feature-major (h, a, dv: (H, LANES)), as the LSTM's tiles:
    # gif row j of step t at j * gs + t * ts (samples contiguous); d: (T, H, B) entry-major
    T, H, B = d.shape
    n = H * LANES
    one = cst[18]
    two = one + one
    zero = one - one
    df = d.reshape(T * H * B)
    for b0 in range(0, B, LANES):
        nb = min(LANES, B - b0)
        full = nb == LANES
        _tile_load_state_c(h, h0, b0, nb)
        _tile_store_rows_c(h, hz, b0, hzs, nb)  # h_0: step 0's previous state
        for t in range(T):
            gb = t * ts + b0
            _tile_inputs_c(gif, gb, gs, full, nb, a, H, wi, bt, xv)
            _tile_hidden_product_c(a, w, h, H)  # a += W_hh h_{t-1}
            if relu:
                for p in range(n):
                    av = a[p]
                    hv = zero if av <= zero else av  # NaN stays NaN, as torch.relu
                    h[p] = hv
                    dv[p] = one if hv > zero else zero
            else:
                for p in range(n):
                    e[p] = -two * abs(a[p])
                _vexpm1_c(e, bits, bitsf, cst, icst)
                for p in range(n):
                    q = e[p]
                    ta = -q / (two + q)
                    hv = ta if a[p] >= zero else -ta
                    h[p] = hv
                    dv[p] = one - hv * hv
            db = t * H * B + b0  # unit j of the tile at db + j * B
            if full:
                for j in range(H):
                    _put_c(df, db + j * B, vload(dv, j * LANES), stream)
            else:
                for j in range(H):
                    for bb in range(nb):
                        df[db + j * B + bb] = dv[j * LANES + bb]
            _tile_store_state_c(h, hf, t * hts + b0 * hbs, hbs, nb)
            if t + 1 < T:
                _tile_store_rows_c(h, hz, (t + 1) * B + b0, hzs, nb)  # step t+1's previous state


def _gru_tile_kernel(gif, gs, ts, wi, bt, xv, w, bhn, h0, cst, icst, hf, hts, hbs, d, dn, h, a, e, wn, bits,
                     bitsf, stream, hz, hzs):  # pragma: no cover - compiled
    # _gru_kernel in tiles of LANES samples, feature-major (h, wn: (H, LANES); a: (3H, LANES)), as the
    # LSTM's tiles: gif row g of step t at g * gs + t * ts; d: (T, 4H, B) entry-major (the chain reads
    # it); dn: (H, T, B) feature-major (the backward multiplies it with gradients it holds that way).
    # a rows: r, z (pre-activations), then hn = b_hn + W_hn h; e rows: expm1 arguments / results of
    # r, z, then of n (-2|a_n|), row 0 holds r once it is known; wn: a_n (its sign, as tanh is odd)
    H, T, B = dn.shape
    G = 3 * H
    n = H * LANES
    one = cst[18]
    two = one + one
    e2 = e[:2].reshape(-1)
    en = e[2]
    df = d.reshape(T * 4 * H * B)
    dnf = dn.reshape(B * T * H)
    for b0 in range(0, B, LANES):
        nb = min(LANES, B - b0)
        full = nb == LANES
        _tile_load_state_c(h, h0, b0, nb)
        _tile_store_rows_c(h, hz, b0, hzs, nb)  # h_0: step 0's previous state
        for t in range(T):
            gb = t * ts + b0
            _tile_inputs_c(gif, gb, gs, full, nb, a, 2 * H, wi, bt, xv)
            for j in range(H):
                for bb in range(LANES):
                    a[(2 * H + j) * LANES + bb] = bhn[j]
            _tile_hidden_product_c(a, w, h, G)  # (r, z) += W_h(r,z) h; hn += W_hn h
            for p in range(n):
                e[0, p] = -a[p]
                e[1, p] = -a[n + p]
            _vexpm1_c(e2, bits, bitsf, cst, icst)
            # the input side of n, gi_n, into wn
            if wi.shape[1] == 0:
                _tile_inputs_c(gif, gb + 2 * H * gs, gs, full, nb, wn, H, wi, bt, xv)
            else:
                _tile_inputs_c(gif, gb, gs, full, nb, wn, H, wi[2 * H:], bt[2 * H * LANES:], xv)
            for p in range(n):
                r = one / (two + e[0, p])
                av = wn[p] + r * a[2 * n + p]  # as torch: i_n + (h_n * r)
                e[0, p] = r
                wn[p] = av
                e[2, p] = -two * abs(av)
            _vexpm1_c(en, bits, bitsf, cst, icst)
            # d rows (dr, dz, dm, z) and dn, per unit, into a's rows 0 .. 4H (a is spent)
            for p in range(n):
                r = e[0, p]
                z = one / (two + e[1, p])
                ta = -e[2, p] / (two + e[2, p])
                nv = ta if wn[p] >= 0 else -ta
                hp = h[p]
                diff = hp - nv
                hn = a[2 * n + p]
                dnv = (one - z) * (one - nv * nv)
                h[p] = diff * z + nv  # as torch's CPU cell: (h - n) * z + n
                a[p] = dnv * hn * r * (one - r)  # dr
                a[n + p] = diff * z * (one - z)  # dz
                a[2 * n + p] = dnv * r  # dm
                e[1, p] = z
                e[2, p] = dnv
            db = t * 4 * H * B + b0  # row q of the tile at db + q * B
            if full:
                for q in range(3 * H):
                    _put_c(df, db + q * B, vload(a, q * LANES), stream)
                for j in range(H):
                    _put_c(df, db + (3 * H + j) * B, vload(e[1], j * LANES), stream)
            else:
                for j in range(H):
                    for bb in range(nb):
                        q = j * LANES + bb
                        df[db + j * B + bb] = a[q]
                        df[db + (H + j) * B + bb] = a[n + q]
                        df[db + (2 * H + j) * B + bb] = a[2 * n + q]
                        df[db + (3 * H + j) * B + bb] = e[1, q]
            _tile_store_state_c(h, hf, t * hts + b0 * hbs, hbs, nb)
            if t + 1 < T:
                _tile_store_rows_c(h, hz, (t + 1) * B + b0, hzs, nb)  # step t+1's previous state
            if full:
                for j in range(H):
                    vstore(dnf, (j * T + t) * B + b0, vload(en, j * LANES))
            else:
                for j in range(H):
                    for bb in range(nb):
                        dnf[(j * T + t) * B + b0 + bb] = en[j * LANES + bb]


def _weight_grad_kernel(af, lda, n, zf, ldz, zrows, nc, acc, out):  # pragma: no cover - compiled
    # out[g, c] = sum_q a[g, q] z[zrows[c], q], q < n (a: M rows, row g at af[g * lda:]; z: rows at
    # zf[r * ldz:]; both feature-major, positions contiguous). Chunks of nc positions (the chunk of z's
    # rows stays in L1 while every block of a's rows reads it) through block_sums (lane-wise partials
    # in acc); at the end each partial is summed across its lanes in order, then the positions past
    # the last whole vector one by one. Fixed order: reproducible bit for bit.
    M, K = out.shape
    nv = n - n % LANES
    for i in range(acc.shape[0]):
        acc[i] = 0
    for c0 in range(0, nv, nc):
        _block_sums_c(af, lda, c0, zf, ldz, c0, LANES, zrows, min(nc, nv - c0), acc, M, K)
    for g in range(M):
        for c in range(K):
            s = _lane_sum_c(acc, (g * K + c) * LANES)
            y = zrows[c] * ldz
            for q in range(nv, n):  # past the last whole vector
                s += af[g * lda + q] * zf[y + q]
            out[g, c] = s


def _rnn_kernel(gi, wt, h0, cst, icst, relu, hs, d, ds, acc, e, bits, bitsf):  # pragma: no cover - compiled
    # h_t = act(gi_t + h_{t-1} W_hh^T) and d_t = act'(.) (tanh: 1 - h_t^2; relu: 1 where h_t > 0);
    # d: (T, H, B) entry-major, written from the sample-major scratch ds (B, H) once per step
    T, B, H = gi.shape
    one = cst[18]
    two = one + one
    zero = one - one
    for t in range(T):
        hp = h0 if t == 0 else hs[t - 1]
        for b in range(B):
            for j in range(H):
                acc[b, j] = gi[t, b, j]
            for kk in range(H):
                hv = hp[b, kk]
                for j in range(H):
                    acc[b, j] += hv * wt[kk, j]
        ht = hs[t]
        dt = ds
        if relu:
            for b in range(B):
                for j in range(H):
                    a = acc[b, j]
                    h = zero if a <= zero else a  # NaN stays NaN, as torch.relu
                    ht[b, j] = h
                    dt[b, j] = one if h > zero else zero
        else:
            for b in range(B):
                for j in range(H):
                    e[b * H + j] = -two * abs(acc[b, j])
            _vexpm1_c(e, bits, bitsf, cst, icst)
            for b in range(B):
                for j in range(H):
                    q = e[b * H + j]
                    ta = -q / (two + q)
                    h = ta if acc[b, j] >= zero else -ta
                    ht[b, j] = h
                    dt[b, j] = one - h * h
        d_t = d[t]
        for j in range(H):
            for b in range(B):
                d_t[j, b] = ds[b, j]


def _gru_kernel(gi, wt, bhn, h0, cst, icst, hs, d, ds, dn, acc, e, w, bits, bitsf):  # pragma: no cover - compiled
    # acc: (r, z, hn) pre-activations; e rows: expm1 arguments/results of r, z, then of n (-2|a_n|),
    # row 0 holds r once it is known; w: a_n (its sign, as tanh is odd); d: (T, 4H, B) entry-major,
    # written from the sample-major scratch ds (B, 4H) once per step
    T, B, G = gi.shape
    H = G // 3
    one = cst[18]
    two = one + one
    e2 = e[:2].reshape(-1)
    en = e[2]
    for t in range(T):
        # (r, z): gi_t + h_{t-1} W_hh^T; hn = b_hn + h_{t-1} W_hn^T; summed over k in ascending order
        hp = h0 if t == 0 else hs[t - 1]
        for b in range(B):
            for j in range(2 * H):
                acc[b, j] = gi[t, b, j]
            for j in range(H):
                acc[b, 2 * H + j] = bhn[j]
            for kk in range(H):
                hv = hp[b, kk]
                for j in range(G):
                    acc[b, j] += hv * wt[kk, j]
        for b in range(B):
            for j in range(H):
                p = b * H + j
                e[0, p] = -acc[b, j]
                e[1, p] = -acc[b, H + j]
        _vexpm1_c(e2, bits, bitsf, cst, icst)
        for b in range(B):
            for j in range(H):
                p = b * H + j
                r = one / (two + e[0, p])
                a = gi[t, b, 2 * H + j] + r * acc[b, 2 * H + j]  # as torch: i_n + (h_n * r)
                e[0, p] = r
                w[p] = a
                e[2, p] = -two * abs(a)
        _vexpm1_c(en, bits, bitsf, cst, icst)
        ht = hs[t]
        dt = ds
        dnt = dn[t]
        for b in range(B):
            for j in range(H):
                p = b * H + j
                r = e[0, p]
                z = one / (two + e[1, p])
                ta = -e[2, p] / (two + e[2, p])
                nv = ta if w[p] >= 0 else -ta
                diff = hp[b, j] - nv
                ht[b, j] = diff * z + nv  # as torch's CPU cell: (h - n) * z + n
                dnv = (one - z) * (one - nv * nv)
                dt[b, j] = dnv * acc[b, 2 * H + j] * r * (one - r)  # dr
                dt[b, H + j] = diff * z * (one - z)  # dz
                dt[b, 2 * H + j] = dnv * r  # dm
                dt[b, 3 * H + j] = z
                dnt[b, j] = dnv
        d_t = d[t]
        for j in range(4 * H):
            for b in range(B):
                d_t[j, b] = ds[b, j]


# The compiled helpers the kernels call by these names (bound by _prepare() before any kernel compiles)
_vexpm1_c = _lstm_cell_c = _tile_load_state_c = _tile_store_state_c = _tile_store_rows_c = _tile_gate_inputs_c = None
_tile_hidden_product_c = _tile_inputs_c = _put_c = _block_sums_c = _lane_sum_c = None
_KERNELS = {"lstm": _lstm_kernel, "lstm_tile": _lstm_tile_kernel, "rnn": _rnn_kernel, "rnn_tile": _rnn_tile_kernel,
            "gru": _gru_kernel, "gru_tile": _gru_tile_kernel, "weight_grad": _weight_grad_kernel}
_compiled_kernels: dict = {}


def _jit(fn, inline: str = "never"):
    # error_model="numpy": IEEE division (no zero-division branch, which would keep the loops scalar)
    return _numba.njit(cache=True, nogil=True, error_model="numpy", inline=inline)(fn)


def _prepare() -> None:
    """Bind the vector operations and compile the helpers the kernels call (once)."""
    global _vexpm1_c, _lstm_cell_c, _tile_load_state_c, _tile_store_state_c, _tile_store_rows_c, _tile_gate_inputs_c
    global _tile_hidden_product_c, _tile_inputs_c, _put_c, _block_sums_c, _lane_sum_c
    if _vexpm1_c is None:
        from spscan.kernels import cpu_simd

        ops = cpu_simd.intrinsics()
        globals().update({name: ops[name] for name in _VECTOR_OPS})
        # the helpers are inlined into the kernels (numba's IR inlining): a call per helper and step
        # passed its arrays through reference counting and cost ~9% of the LSTM forward
        _vexpm1_c = _jit(_vexpm1, "always")
        _lstm_cell_c = _jit(_lstm_cell, "always")
        _tile_load_state_c = _jit(_tile_load_state, "always")
        _tile_store_state_c = _jit(_tile_store_state, "always")
        _tile_store_rows_c = _jit(_tile_store_rows, "always")
        _tile_gate_inputs_c = _jit(_tile_gate_inputs, "always")
        _tile_hidden_product_c = _jit(_tile_hidden_product, "always")
        _tile_inputs_c = _jit(_tile_inputs, "always")
        _put_c = _jit(_put, "always")
        _block_sums_c = cpu_nt.block_sums()
        _lane_sum_c = cpu_nt.lane_sum()


def _compiled(name: str):
    """The compiled kernel ``name`` of ``_KERNELS`` (compiled on first use; numba caches it on disk)."""
    fn = _compiled_kernels.get(name)
    if fn is None:
        _prepare()
        fn = _compiled_kernels[name] = _jit(_KERNELS[name])
    return fn


def rnn_forward(gi: torch.Tensor, w_hh: torch.Tensor, h0: torch.Tensor, relu: bool,
                batch_first: bool = False, buffers=None, prev: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Elman RNN recurrence (tanh or relu) on CPU in one compiled pass.

    Args:
        gi: ``(T, B, H)`` input part of the pre-activations, ``x W_ih^T + b_ih + b_hh``, or an
            :class:`InputProjection` of it (:func:`input_projection`).
        w_hh: ``(H, H)`` the module's ``weight_hh_l0``.
        h0: ``(B, H)`` initial state.
        relu: ``nonlinearity="relu"`` (else tanh, through the same ``expm1`` as the LSTM's).
        batch_first: return ``hs`` as ``(B, T, H)`` (the module's batch-first output; the tiles
            write it so directly).
        buffers: a :class:`spscan.engine.RecycledBuffers` the chain values are taken from (a caller
            that runs every step keeps one: fresh multi-MB tensors page-fault on first touch), or
            ``None``: new tensors.
        prev: ``None``, or a C-contiguous ``(K, T, B)`` tensor (``K >= H``) whose rows ``0 .. H-1``
            receive the previous states feature-major: ``prev[:H, t] = h_{t-1}^T`` (``h_0`` at
            ``t = 0``), the hidden-weight gradients' operand (:func:`weight_gradients`); the tiles
            write it as they go, one vector store per row and step. Its other rows are left as they are.
    Returns:
        ``(hs (T, B, H) or (B, T, H), d (T, B, H))``: the outputs ``h_1..h_T`` and the diagonal of each step's
        ``dh_t/da_t`` (tanh: ``1 - h_t^2``; relu: ``1`` where ``h_t > 0``), the per-sample values of
        the factored chain's second element (a view of ``(T, H, B)`` memory: entry-major, which the
        linear scan reads in place). Of ``gi``'s dtype.

    Raises ``RuntimeError`` without numba, ``TypeError`` for other dtypes or non-CPU tensors.
    """
    if not available():
        raise RuntimeError("spscan.recurrent_cpu needs numba (pip install numba)")
    dt = gi.dtype
    if dt not in (torch.float32, torch.float64) or any(
            t.dtype != dt or t.device.type != "cpu" for t in (gi, w_hh, h0) + _projection_operands(gi)):
        raise TypeError(f"rnn_forward: expected float32/float64 CPU tensors of one dtype, got gi {gi.dtype} on "
                        f"{gi.device}, w_hh {w_hh.dtype}, h0 {h0.dtype}")
    T, B, H = gi.shape
    np_dt = np.float32 if dt == torch.float32 else np.float64
    itype = _INT[np_dt][0]
    cst, icst = _expm1_consts(np_dt)
    # the diagonal element's values entry-major ((T, H, B) memory): the linear scan reads a tile of
    # them in place (kernels/cpu_chain.py)
    d = _values_tensor(buffers, "d", (T, H, B), dt)
    if B >= TILE_MIN_BATCH:
        gif, wi, bt, xv = _tile_input_operands(gi, np_dt)
        n = H * LANES
        bits = np.empty(n, dtype=itype)
        hs, hf, hts, hbs = _outputs(T, B, H, dt, batch_first)
        _compiled("rnn_tile")(
            gif, T * B, B, wi, bt, xv, w_hh.detach().contiguous().numpy(),
            h0.detach().contiguous().numpy(), cst, icst, bool(relu), hf, hts, hbs, d.numpy(), np.empty(n, dtype=np_dt),
            np.empty(n, dtype=np_dt), np.empty(n, dtype=np_dt), np.empty(n, dtype=np_dt), bits, bits.view(np_dt),
            _streams(d), *_prev_rows(prev, T, B, H, np_dt))
        return hs, d.transpose(1, 2)
    if isinstance(gi, InputProjection):
        gi = gi.materialize()
    hs = torch.empty(T, B, H, dtype=dt)
    acc = np.empty((B, H), dtype=np_dt)
    e = np.empty(B * H, dtype=np_dt)
    bits = np.empty(B * H, dtype=itype)
    _compiled("rnn")(gi.detach().contiguous().numpy(), w_hh.detach().t().contiguous().numpy(),
                           h0.detach().contiguous().numpy(), cst, icst, bool(relu), hs.numpy(), d.numpy(),
                           np.empty((B, H), dtype=np_dt), acc, e, bits, bits.view(np_dt))
    _fill_prev(prev, hs, h0)
    return _as_layout(hs, batch_first), d.transpose(1, 2)


def lstm_forward(gi: torch.Tensor, w_hh: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor,
                 batch_first: bool = False, buffers=None, prev: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The LSTM recurrence on CPU in one compiled pass.

    Args:
        gi: ``(T, B, 4H)`` input part of the gate pre-activations, ``x W_ih^T + b_ih + b_hh``, or an
            :class:`InputProjection` of it (:func:`input_projection`).
        w_hh: ``(4H, H)`` the module's ``weight_hh_l0``.
        h0, c0: ``(B, H)`` initial state.
        batch_first, buffers, prev: as :func:`rnn_forward`'s.
    Returns:
        ``(hs (T, B, H) or (B, T, H), c_T (B, H), values (T, B, 6H))``: the outputs ``h_1..h_T``, the last cell and
        the gate element's compact numbers (:func:`spscan.cells.lstm_gate_encoding`; from
        ``TILE_MIN_BATCH`` samples a view of ``(T, 6H, B)`` memory: entry-major, which the linear scan
        reads in place; the forward then runs in tiles of ``LANES`` samples). All of ``gi``'s dtype
        (float32 or float64). ``gi`` is read fastest as a view of ``(4H, T, B)`` memory
        (:func:`gate_inputs`); any other layout is copied once.

    Raises ``RuntimeError`` without numba, ``TypeError`` for other dtypes or non-CPU tensors.
    """
    if not available():
        raise RuntimeError("spscan.recurrent_cpu needs numba (pip install numba)")
    dt = gi.dtype
    if dt not in (torch.float32, torch.float64) or any(
            t.dtype != dt or t.device.type != "cpu" for t in (gi, w_hh, h0, c0) + _projection_operands(gi)):
        raise TypeError(f"lstm_forward: expected float32/float64 CPU tensors of one dtype, got gi {gi.dtype} on "
                        f"{gi.device}, w_hh {w_hh.dtype}, h0 {h0.dtype}, c0 {c0.dtype}")
    T, B, G = gi.shape
    H = G // 4
    np_dt = np.float32 if dt == torch.float32 else np.float64
    itype = _INT[np_dt][0]
    cst, icst = _expm1_consts(np_dt)
    c = torch.empty(B, H, dtype=dt)
    h0n, c0n = h0.detach().contiguous().numpy(), c0.detach().contiguous().numpy()
    if B < TILE_MIN_BATCH:
        if isinstance(gi, InputProjection):
            gi = gi.materialize()
        hs = torch.empty(T, B, H, dtype=dt)
        vals = _values_tensor(buffers, "values", (T, B, 6 * H), dt)
        acc = np.empty((B, G), dtype=np_dt)
        e = np.empty((5, B * H), dtype=np_dt)
        w = np.empty((4, B * H), dtype=np_dt)
        bits = np.empty(4 * B * H, dtype=itype)
        _compiled("lstm")(gi.detach().contiguous().numpy(), w_hh.detach().t().contiguous().numpy(), h0n, c0n, cst, icst,
                  hs.numpy(), vals.numpy(), c.numpy().reshape(-1), acc, e, w, bits, bits.view(np_dt))
        _fill_prev(prev, hs, h0)
        return _as_layout(hs, batch_first), c, vals
    gif, wi, bt, xv = _tile_input_operands(gi, np_dt)
    # the gate element's compact numbers entry-major, (T, 6H, B) memory viewed as (T, B, 6H): the
    # linear scan reads a tile of them in place (kernels/cpu_chain.py)
    vals = _values_tensor(buffers, "values", (T, 6 * H, B), dt)
    n = H * LANES
    bits = np.empty(4 * n, dtype=itype)
    hs, hf, hts, hbs = _outputs(T, B, H, dt, batch_first)
    _compiled("lstm_tile")(
        gif, T * B, B, wi, bt, xv, w_hh.detach().contiguous().numpy(), h0n, c0n, cst, icst, hf, hts, hbs, vals.numpy(),
        c.numpy(),
        np.empty(n, dtype=np_dt), np.empty(n, dtype=np_dt), np.empty(G * LANES, dtype=np_dt),
        np.empty(6 * n, dtype=np_dt), np.empty((5, n), dtype=np_dt), np.empty((4, n), dtype=np_dt), bits,
        bits.view(np_dt), _streams(vals), *_prev_rows(prev, T, B, H, np_dt))
    return hs, c, vals.transpose(1, 2)


class InputProjection(NamedTuple):
    """The input part of the gate pre-activations, ``x W_ih^T + bias``, not yet computed: the tiled
    forwards compute it per step from ``x`` when the input is narrow (at most ``FUSED_MAX_INPUT``
    features), instead of reading a ``(T, B, G)`` tensor made by a GEMM before the loop; that tensor is
    as large as the gate values the forward writes, and at ``I = 1`` the GEMM and the reads of its
    output cost more than the ``G * I`` multiply-adds per sample and step.

    ``x``: ``(T, B, I)``; ``w_ih``: ``(G, I)``; ``bias``: ``(G,)`` or ``None``.
    """

    x: torch.Tensor
    w_ih: torch.Tensor
    bias: Optional[torch.Tensor]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.x.shape[0], self.x.shape[1], self.w_ih.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def materialize(self) -> torch.Tensor:
        """The ``(T, B, G)`` gate inputs (:func:`gate_inputs`)."""
        return gate_inputs(self.x, self.w_ih, self.bias)


# widest input computed inside the tiled forwards (each feature adds G multiply-adds per sample and step)
FUSED_MAX_INPUT = 4


def input_projection(x: torch.Tensor, w_ih: torch.Tensor, bias: Optional[torch.Tensor]):
    """The gate inputs for the compiled forwards: an :class:`InputProjection` the tiles compute from
    ``x`` when ``x`` has at most ``FUSED_MAX_INPUT`` features, else :func:`gate_inputs` (one GEMM)."""
    if x.shape[-1] <= FUSED_MAX_INPUT:
        return InputProjection(x.detach(), w_ih.detach(), None if bias is None else bias.detach())
    return gate_inputs(x, w_ih, bias)


def _projection_operands(gi) -> tuple:
    """The tensors of an :class:`InputProjection` besides ``x`` (for the dtype/device checks); ``()`` for a tensor."""
    if isinstance(gi, InputProjection):
        return (gi.w_ih,) + (() if gi.bias is None else (gi.bias,))
    return ()


def _tile_input_operands(gi, np_dt):
    """``(gif, wi, bt, xv)`` of the tiled kernels' ``_tile_inputs``: from a ``(T, B, G)`` tensor, its
    ``(G, T, B)`` memory flat and an empty ``wi``; from an :class:`InputProjection`, ``x`` as ``(I, T, B)``
    memory flat, ``W_ih``, the bias repeated over a tile and the tile's input scratch."""
    if isinstance(gi, InputProjection):
        x, w_ih, bias = gi
        G, I = w_ih.shape
        bt = np.zeros(G * LANES, dtype=np_dt) if bias is None else np.repeat(bias.to(x.dtype).numpy(), LANES)
        return (x.permute(2, 0, 1).contiguous().numpy().reshape(-1), w_ih.contiguous().numpy(), bt,
                np.empty(I * LANES, dtype=np_dt))
    G = gi.shape[2]
    return (_gate_major(gi).permute(2, 0, 1).numpy().reshape(-1), np.empty((G, 0), dtype=np_dt),
            np.empty(0, dtype=np_dt), np.empty(0, dtype=np_dt))


def _streams(values: torch.Tensor) -> bool:
    """Whether a tiled forward writes ``values`` with non-temporal stores: where they outgrow half the
    last-level cache, so would be evicted before the backward reads them, and plain stores would only
    evict the data that stays (the LSTM at T = 3000, 35 MB: forward 8.6 -> 7.5 ms); below it they
    are still cached when the linear scan reads them (T = 1000, 11.5 MB: backward 3.7 -> 3.1 ms)."""
    return values.numel() * values.element_size() > last_level_cache_bytes() // 2


def _prev_rows(prev: Optional[torch.Tensor], T: int, B: int, H: int, np_dt) -> tuple:
    """``(hz, row_stride)`` of the tiled kernels for a forward's ``prev`` (an empty array: not wanted), checked."""
    if prev is None:
        return np.empty(0, dtype=np_dt), 0
    if (prev.dim() != 3 or prev.shape[0] < H or tuple(prev.shape[1:]) != (T, B) or not prev.is_contiguous()
            or prev.numpy().dtype != np_dt):
        raise ValueError(f"prev: expected a contiguous (K >= {H}, {T}, {B}) {np.dtype(np_dt)} CPU tensor, got "
                         f"{tuple(prev.shape)} {prev.dtype}")
    return prev.numpy().reshape(-1), T * B


def _fill_prev(prev: Optional[torch.Tensor], hs: torch.Tensor, h0: torch.Tensor) -> None:
    """The per-sample loops' ``prev`` rows (the tiles write them as they go): ``h_0 .. h_{T-1}`` feature-major
    from ``hs`` ``(T, B, H)``."""
    if prev is None:
        return
    T, B, H = hs.shape
    _prev_rows(prev, T, B, H, hs.numpy().dtype)
    prev[:H, 0].copy_(h0.t())
    prev[:H, 1:].copy_(hs[:-1].permute(2, 0, 1))

def _values_tensor(buffers, name: str, shape: tuple, dt: torch.dtype) -> torch.Tensor:
    """A tensor the forward fills with chain values: from ``buffers`` (a
    :class:`spscan.engine.RecycledBuffers`, which hands back last step's once nothing uses it) or new."""
    return torch.empty(shape, dtype=dt) if buffers is None else buffers.take(name, shape, dt)


def _outputs(T: int, B: int, H: int, dt: torch.dtype, batch_first: bool):
    """``(hs, flat, time_stride, sample_stride)``: the outputs the tiles write, ``(T, B, H)``, or
    ``(B, T, H)`` when ``batch_first`` (the module's batch-first output, without a copy)."""
    if batch_first:
        hs = torch.empty(B, T, H, dtype=dt)
        return hs, hs.numpy().reshape(-1), H, T * H
    hs = torch.empty(T, B, H, dtype=dt)
    return hs, hs.numpy().reshape(-1), B * H, H


def _as_layout(hs: torch.Tensor, batch_first: bool) -> torch.Tensor:
    """``hs`` ``(T, B, H)`` as :func:`_outputs` lays it out (one copy for ``batch_first``)."""
    return hs.transpose(0, 1).contiguous() if batch_first else hs


def _gate_major(gi: torch.Tensor) -> torch.Tensor:
    """``gi`` ``(T, B, G)`` as a view of ``(G, T, B)`` memory, the layout the tiles read (each gate row's
    samples contiguous): as it is when it already is (:func:`gate_inputs`), else one copy."""
    T, B, G = gi.shape
    gi = gi.detach()
    if gi.stride(1) != 1 or gi.stride(0) != B or gi.stride(2) != T * B:
        gi = gi.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    return gi


def gate_inputs(x: torch.Tensor, w_ih: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W_ih^T + bias`` as a ``(T, B, G)`` view of ``(G, T, B)`` memory, the layout the tiled forwards read.

    ``x``: ``(T, B, I)``; ``w_ih``: ``(G, I)``; ``bias``: ``(G,)`` or ``None``. One GEMM,
    ``W_ih (G, I) @ x (I, T*B)``.
    """
    T, B, I = x.shape
    xs = x.detach().permute(2, 0, 1).reshape(I, T * B)
    w = w_ih.detach()
    out = torch.mm(w, xs) if bias is None else torch.addmm(bias.detach().unsqueeze(1), w, xs)
    return out.view(-1, T, B).permute(1, 2, 0)


# positions per chunk of the weight-gradient kernel: the chunk of the second operand's rows stays in
# the L1 cache while every block of the first's rows reads it (2 KB per row at float32; chunks of 256
# or 1024 positions measured 5-10% slower at N = 16000)
_GRAD_CHUNK = 512


def weight_gradients(a: torch.Tensor, z: torch.Tensor, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
    """``a @ z[rows].T`` in one compiled pass: a recurrent layer's weight and bias gradients from its gate
    pre-activation gradients.

    Args:
        a: ``(M, N)`` with contiguous rows (any row stride): the pre-activation gradients, row ``g``
            over all ``N = T*B`` steps and samples (the layout the backward collects them in).
        z: ``(K, N)`` with contiguous rows (any row stride): the GEMMs' other operands, feature-major
            as well: ``h_{t-1}``'s rows, ``x_t``'s and a row of ones (the bias gradient is the row sum
            of ``a``), as the compiled forwards lay them out (their ``prev``).
        rows: which rows of ``z``, in the order wanted (default: all).
    Returns:
        ``(M, len(rows))`` of ``a``'s dtype.

    Why: the hidden-weight gradient is a ``(4H x N) (N x H)`` product with a long reduction and a
    tiny output (``80 x 20`` over ``N = 16000`` for the paper's LSTM), which the BLAS GEMM runs at a
    fraction of the core's vector width, and the input-weight and bias gradients read ``a`` again
    each. Here each ``4 x 4`` output block is 16 vector accumulators over a cache-sized chunk of both
    operands (lanes along ``N``), and ``a`` is read once for all of them. Sums run in a fixed order
    (lane-wise partials, then across lanes): reproducible bit for bit.

    Raises ``RuntimeError`` without numba, ``TypeError`` for dtypes other than float32/float64 or
    non-CPU tensors, ``ValueError`` for mismatched shapes, rows without contiguous positions or
    ``rows`` out of range.
    """
    if not available():
        raise RuntimeError("spscan.recurrent_cpu needs numba (pip install numba)")
    dt = a.dtype
    if dt not in (torch.float32, torch.float64) or any(t.dtype != dt or t.device.type != "cpu" for t in (a, z)):
        raise TypeError(f"weight_gradients: expected float32/float64 CPU tensors of one dtype, got a {a.dtype} on "
                        f"{a.device}, z {z.dtype} on {z.device}")
    if a.dim() != 2 or z.dim() != 2 or z.shape[1] != a.shape[1] or any(
            t.shape[0] > 1 and t.shape[1] > 1 and t.stride(1) != 1 for t in (a, z)):
        raise ValueError(f"weight_gradients: expected a (M, N) and z (K, N), each with contiguous rows, got a "
                         f"{tuple(a.shape)} strides {a.stride()}, z {tuple(z.shape)} strides {z.stride()}")
    M, N = a.shape
    K = z.shape[0]
    zrows = np.arange(K, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
    if zrows.size and (zrows.min() < 0 or zrows.max() >= K):
        raise ValueError(f"weight_gradients: rows must be within range({K}), got {zrows.tolist()}")
    out = torch.empty(M, zrows.size, dtype=dt)
    if M == 0 or N == 0 or zrows.size == 0:
        return out.zero_()
    af, lda = _flat_rows(a)
    zf, ldz = _flat_rows(z)
    _compiled("weight_grad")(af, lda, N, zf, ldz, zrows, _GRAD_CHUNK, np.empty(M * zrows.size * LANES, dtype=af.dtype),
                             out.numpy())
    return out


def _flat_rows(t: torch.Tensor) -> tuple:
    """``(flat, row_stride)``: a 2-D tensor with contiguous rows as the 1-D NumPy view of its memory from its
    first element (rows ``row_stride`` apart), as the compiled kernels index it."""
    R, N = t.shape
    ld = t.stride(0) if R > 1 else N
    t = t.detach()
    return torch.as_strided(t, ((R - 1) * ld + N,), (1,), t.storage_offset()).numpy(), ld

def gru_forward(gi: torch.Tensor, w_hh: torch.Tensor, b_hn: Optional[torch.Tensor],
                h0: torch.Tensor, batch_first: bool = False, buffers=None,
                prev: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The GRU recurrence (PyTorch's equations, gate order r, z, n) on CPU in one compiled pass.

    Per step, with ``(W_hr; W_hz; W_hn) = W_hh``::

        r = sigmoid(gi_r + h W_hr^T),  z = sigmoid(gi_z + h W_hz^T),  M = b_hn + h W_hn^T
        n = tanh(gi_n + r * M),        h' = (h - n) * z + n            (= (1 - z) n + z h)

    Args:
        gi: ``(T, B, 3H)`` (or an :class:`InputProjection` of it) input part of the pre-activations:
            ``x W_ih^T + b_ih`` plus ``b_hr``, ``b_hz`` on the ``r`` and ``z`` blocks (``b_hn`` is not
            added there: it sits inside ``r * M``).
        w_hh: ``(3H, H)`` the module's ``weight_hh_l0``.
        b_hn: ``(H,)`` the ``n`` block of ``bias_hh_l0``, or ``None`` (no biases).
        h0: ``(B, H)`` initial state.
        batch_first, buffers, prev: as :func:`rnn_forward`'s.
    Returns:
        ``(hs (T, B, H) or (B, T, H), d (T, B, 4H), dn (T, B, H))``: the outputs ``h_1..h_T``; the per-sample values
        of the factored chain's diagonal element, ``(dr, dz, dm, z)`` per step (``dn = (1 - z)(1 - n^2)``,
        ``dr = dn M r (1 - r)``, ``dz = (h - n) z (1 - z)``, ``dm = dn r``: ``dh'`` with respect to the
        pre-activations of ``r``, ``z`` and to ``M``); and ``dn`` (``dh'`` with respect to the input side
        of ``n``, which the input-weight gradients need). ``d`` is a view of ``(T, 4H, B)`` memory
        (entry-major, as :func:`rnn_forward`'s); from ``TILE_MIN_BATCH`` samples ``dn`` is a view of
        ``(H, T, B)`` memory (feature-major, as the backward holds the gradients it multiplies). All of
        ``gi``'s dtype (float32 or float64).

    Raises ``RuntimeError`` without numba, ``TypeError`` for other dtypes or non-CPU tensors.
    """
    if not available():
        raise RuntimeError("spscan.recurrent_cpu needs numba (pip install numba)")
    dt = gi.dtype
    ts = (gi, w_hh, h0) + (() if b_hn is None else (b_hn,)) + _projection_operands(gi)
    if dt not in (torch.float32, torch.float64) or any(t.dtype != dt or t.device.type != "cpu" for t in ts):
        raise TypeError(f"gru_forward: expected float32/float64 CPU tensors of one dtype, got gi {gi.dtype} on "
                        f"{gi.device}, w_hh {w_hh.dtype}, h0 {h0.dtype}"
                        + ("" if b_hn is None else f", b_hn {b_hn.dtype}"))
    T, B, G = gi.shape
    H = G // 3
    if G != 3 * H or tuple(w_hh.shape) != (3 * H, H) or tuple(h0.shape) != (B, H) or (
            b_hn is not None and tuple(b_hn.shape) != (H,)):
        raise ValueError(f"gru_forward: expected gi (T, B, 3H), w_hh (3H, H), h0 (B, H), b_hn (H,), got gi "
                         f"{tuple(gi.shape)}, w_hh {tuple(w_hh.shape)}, h0 {tuple(h0.shape)}"
                         + ("" if b_hn is None else f", b_hn {tuple(b_hn.shape)}"))
    np_dt = np.float32 if dt == torch.float32 else np.float64
    itype = _INT[np_dt][0]
    cst, icst = _expm1_consts(np_dt)
    d = _values_tensor(buffers, "d", (T, 4 * H, B), dt)  # entry-major, as rnn_forward's
    bhn = np.zeros(H, dtype=np_dt) if b_hn is None else b_hn.detach().contiguous().numpy()
    if B >= TILE_MIN_BATCH:
        dn = _values_tensor(buffers, "dn", (H, T, B), dt)
        gif, wi, bt, xv = _tile_input_operands(gi, np_dt)
        n = H * LANES
        bits = np.empty(2 * n, dtype=itype)
        hs, hf, hts, hbs = _outputs(T, B, H, dt, batch_first)
        _compiled("gru_tile")(
            gif, T * B, B, wi, bt, xv, w_hh.detach().contiguous().numpy(), bhn,
            h0.detach().contiguous().numpy(), cst, icst, hf, hts, hbs, d.numpy(), dn.numpy(), np.empty(n, dtype=np_dt),
            np.empty(G * LANES, dtype=np_dt), np.empty((3, n), dtype=np_dt), np.empty(n, dtype=np_dt), bits,
            bits.view(np_dt), _streams(d), *_prev_rows(prev, T, B, H, np_dt))
        return hs, d.transpose(1, 2), dn.permute(1, 2, 0)
    if isinstance(gi, InputProjection):
        gi = gi.materialize()
    hs = torch.empty(T, B, H, dtype=dt)
    dn = _values_tensor(buffers, "dn", (T, B, H), dt)
    acc = np.empty((B, G), dtype=np_dt)
    e = np.empty((3, B * H), dtype=np_dt)
    w = np.empty(B * H, dtype=np_dt)
    bits = np.empty(2 * B * H, dtype=itype)
    _compiled("gru")(gi.detach().contiguous().numpy(), w_hh.detach().t().contiguous().numpy(), bhn,
                           h0.detach().contiguous().numpy(), cst, icst, hs.numpy(), d.numpy(),
                           np.empty((B, 4 * H), dtype=np_dt), dn.numpy(), acc, e, w, bits, bits.view(np_dt))
    _fill_prev(prev, hs, h0)
    return _as_layout(hs, batch_first), d.transpose(1, 2), dn
