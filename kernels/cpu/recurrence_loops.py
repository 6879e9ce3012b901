"""The compiled recurrence loops (numba): one pass over time that computes the outputs and the chain's
per-step Jacobian values (the math and the callers: :mod:`.recurrence`).

Three recurrences, named by their form, each as a loop over tiles of ``LANES`` samples (the fast
path: feature-major tiles, vector registers across the batch, :mod:`.simd`) and as a loop per
sample (small batches):

* ``"activation"``: ``h_t = act(a_t)``, ``a_t = gi_t + h_{t-1} W^T``, ``act`` tanh or relu;
* ``"gated_cell"``: four gates ``i, f, g, o`` (sigmoid, sigmoid, tanh, sigmoid) and a cell state:
  ``c_t = f c_{t-1} + i g``, ``h_t = o tanh(c_t)``;
* ``"reset_gated"``: gates ``r, z`` (sigmoid) and ``n = tanh(gi_n + r (b_n + h_{t-1} W_n^T))``, the
  reset gate ``r`` scaling the hidden product; ``h_t = (h_{t-1} - n) z + n``.

Every sum runs in a fixed order (the hidden product over ``k`` ascending): results are bitwise
reproducible run to run. No ``fastmath``, no ``parallel``.
"""

from __future__ import annotations

from spscan.kernels.cpu import recurrence_steps as cpu_recurrence_steps
from spscan.kernels.cpu.simd import LANES, bind

__all__ = ["compiled"]

# The vector operations the loops name: numba intrinsics (kernels/cpu/simd.py), bound with the compiled
# helpers of kernels/cpu/recurrence_steps.py before the first compile (numba is optional and slow to import).
vload = vstore = vscale = vabs = None
_VECTOR_OPS = ("vload", "vstore", "vscale", "vabs")
_vexpm1_c = _gated_cell_c = _put_c = _tile_load_state_c = _tile_inputs_c = _tile_hidden_product_c = None
_tile_begin_c = _tile_store_state_c = _tile_store_rows_c = _sample_preactivations_c = None


def _gated_cell_tile_loop(gif, gs, ts, wi, bt, xv, w, h0, c0, cst, icst, hf, hts, hbs, vals, c_n, h, c, a, vt, e, wk,
                          bits, bitsf, stream, hz, hzs):  # pragma: no cover - compiled
    # Tiles of LANES samples, feature-major: row j of a tile (h, c: (H, LANES); a: (4H, LANES); vt:
    # (6H, LANES)) is one vector. gif: the gate inputs, flat, row g of step t at g * gs + t * ts,
    # samples contiguous; vals: (T, 6H, B) entry-major; hs: (T, B, H), h0, c0, c_n: (B, H); hz: the
    # previous states feature-major (see cpu_recurrence's prev), hzs its row stride. e rows:
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
        nb, full = _tile_begin_c(h, h0, hz, hzs, b0, B)
        _tile_load_state_c(c, c0, b0, nb)
        for t in range(T):
            _tile_inputs_c(gif, t * ts + b0, gs, full, nb, a, G, wi, bt, xv)
            _tile_hidden_product_c(a, w, h, G)  # a += W h_{t-1}
            # expm1 arguments: -a for the sigmoid gates (i, f, o), -2|a| for g; in vectors (as a loop over
            # the rows of e and wk, which the compiler cannot prove apart from a, it stayed scalar)
            e0, e1, e2, e3, w0 = e[0], e[1], e[2], e[3], wk[0]
            for p in range(0, n, LANES):
                ag = vload(a, 2 * n + p)
                vstore(e0, p, vscale(-one, vload(a, p)))
                vstore(e1, p, vscale(-one, vload(a, n + p)))
                vstore(w0, p, ag)
                vstore(e2, p, vscale(-two, vabs(ag)))
                vstore(e3, p, vscale(-one, vload(a, 3 * n + p)))
            _gated_cell_c(e, wk, c, h, bits, bitsf, cst, icst)
            # the gate element's compact numbers (k, f, c_i, c_f, c_g, c_o; see cpu_recurrence):
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


def _activation_tile_loop(gif, gs, ts, wi, bt, xv, w, h0, cst, icst, relu, hf, hts, hbs, d, h, a, dv, e, bits,
                          bitsf, stream, hz, hzs):  # pragma: no cover - compiled
    # h_t = act(gi_t + W h_{t-1}) in tiles of LANES samples, feature-major (h, a, dv: (H, LANES)), as
    # _gated_cell_tile_loop's: gif row j of step t at j * gs + t * ts (samples contiguous); d: (T, H, B)
    # entry-major, act'(a_t) (tanh: 1 - h_t^2; relu: 1 where h_t > 0)
    T, H, B = d.shape
    n = H * LANES
    one = cst[18]
    two = one + one
    zero = one - one
    df = d.reshape(T * H * B)
    for b0 in range(0, B, LANES):
        nb, full = _tile_begin_c(h, h0, hz, hzs, b0, B)
        for t in range(T):
            _tile_inputs_c(gif, t * ts + b0, gs, full, nb, a, H, wi, bt, xv)
            _tile_hidden_product_c(a, w, h, H)  # a += W h_{t-1}
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


def _reset_gated_tile_loop(gif, gs, ts, wi, bt, xv, w, bhn, h0, cst, icst, hf, hts, hbs, d, dn, h, a, e, wn, bits,
                           bitsf, stream, hz, hzs):  # pragma: no cover - compiled
    # _reset_gated_loop in tiles of LANES samples, feature-major (h, wn: (H, LANES); a: (3H, LANES)), as
    # _gated_cell_tile_loop's: gif row g of step t at g * gs + t * ts; d: (T, 4H, B) entry-major (the chain reads
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
        nb, full = _tile_begin_c(h, h0, hz, hzs, b0, B)
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


def _gated_cell_loop(gi, wt, h0, c0, cst, icst, hs, vals, c, acc, e, w, bits, bitsf):  # pragma: no cover - compiled
    # _gated_cell_tile_loop sample by sample: vals (T, B, 6H) sample-major.
    # e rows: expm1 arguments/results of i, f, g, o, tanh(c), then the activations in place;
    # w rows: a_g (its sign), c_i, c_f, c_g. Indexed as 2-D arrays (one base each), which the
    # compiler vectorizes more readily than a dozen separate row views.
    T, B, G = gi.shape
    H = G // 4
    two = cst[18] + cst[18]
    for t in range(T):
        # a_t = gi_t + h_{t-1} W^T, summed over k in ascending order
        hp = h0 if t == 0 else hs[t - 1]
        _sample_preactivations_c(acc, gi, t, hp, wt, B, H, G)
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
        _gated_cell_c(e, w, c, hs[t].reshape(-1), bits, bitsf, cst, icst)
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


def _activation_loop(gi, wt, h0, cst, icst, relu, hs, d, ds, acc, e, bits, bitsf):  # pragma: no cover - compiled
    # h_t = act(gi_t + h_{t-1} W^T) and d_t = act'(.) (tanh: 1 - h_t^2; relu: 1 where h_t > 0);
    # d: (T, H, B) entry-major, written from the sample-major scratch ds (B, H) once per step
    T, B, H = gi.shape
    one = cst[18]
    two = one + one
    zero = one - one
    for t in range(T):
        hp = h0 if t == 0 else hs[t - 1]
        _sample_preactivations_c(acc, gi, t, hp, wt, B, H, H)
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


def _reset_gated_loop(gi, wt, bhn, h0, cst, icst, hs, d, ds, dn, acc, e, w, bits, bitsf):  # pragma: no cover - compiled
    # _reset_gated_tile_loop sample by sample. acc: (r, z, hn) pre-activations; e rows: expm1
    # arguments/results of r, z, then of n (-2|a_n|), row 0 holds r once it is known; w: a_n (its sign,
    # as tanh is odd); d: (T, 4H, B) entry-major, written from the sample-major scratch ds (B, 4H) once
    # per step
    T, B, G = gi.shape
    H = G // 3
    one = cst[18]
    two = one + one
    e2 = e[:2].reshape(-1)
    en = e[2]
    for t in range(T):
        # (r, z): gi_t + h_{t-1} W_(r,z)^T; hn = b_n + h_{t-1} W_n^T; summed over k in ascending order
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


_LOOPS = {"gated_cell_tile": _gated_cell_tile_loop, "activation_tile": _activation_tile_loop,
          "reset_gated_tile": _reset_gated_tile_loop, "gated_cell": _gated_cell_loop,
          "activation": _activation_loop, "reset_gated": _reset_gated_loop}
_compiled_loops: dict = {}


def compiled(name: str):
    """The compiled loop ``name`` of ``_LOOPS`` (compiled on first use; numba caches it on disk)."""
    fn = _compiled_loops.get(name)
    if fn is None:
        if vload is None:
            bind(globals(), _VECTOR_OPS)
            globals().update(cpu_recurrence_steps.compiled())
        fn = _compiled_loops[name] = cpu_recurrence_steps.jit(_LOOPS[name])
    return fn
