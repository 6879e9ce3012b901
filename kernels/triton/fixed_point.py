"""The pointwise half of a Newton iteration on a recurrence, fused: one pass over the steps per evaluation.

A Newton (DEER) iteration for ``s_t = F(s_{t-1}, x_t)`` evaluates ``F`` at every step of the current
guess at once, forms the per-step Jacobian factors and the residual ``r_t = F(s_{t-1}) - s_t``, solves
the affine scan ``δ_t = J_t δ_{t-1} + r_t`` and adds ``δ`` to the guess. Besides the batched GEMM with
the shared weights and the scan, everything is elementwise over the ``T x B`` steps; written as torch
ops it is a few dozen passes over ``(T, B, H)`` tensors, each launched on its own. Here it is two
kernels, each one pass:

* an **evaluation** (:data:`activation_eval_kernel`: ``f = act(a)``; :data:`reset_gated_eval_kernel`:
  reset and update gates with a candidate ``n = tanh(a_n + r * m_n)``; :data:`gated_cell_eval_kernel`: four
  gates and a cell state) reads the pre-activations and the guess once and writes ``f``, the derivative
  coefficients (time order, what a backward reuses), the per-sample Jacobian factor (a diagonal; for the
  gated cell its ``(2W, 5W)`` element, nine CSR values per unit) scaled and **last step first** (the order
  the forward scan takes its steps in), the residual last step first, and the maxima ``max|f|`` and
  ``max|f - s|``;
* an **update** (:data:`update_kernel`) adds the scan's stacked result (any strides, last step first)
  to the guess in time order and finds ``max|δ|``.

Maxima are found on the device: the bits of a non-negative float order as the float does (and a NaN's
above infinity's), so a block's ``max|x|`` is an integer max of the bit patterns, merged across programs
with one integer ``atomic_max`` into a buffer the caller zeroed. The caller reads them with one host
sync per iteration. Sums are per element: results are bitwise deterministic.

The kernels see steps, samples, widths and gate blocks; which cell made them is the caller's business.
Activations are written with ``exp`` (``tanh x = sign(x)(1 - e)/(1 + e)``, ``e = exp(-2|x|)``): the
interpreter has no ``libdevice``; the error is a few ulps of 1 near 0, absolute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spscan.kernels.triton import launch

__all__ = ["activation_eval_kernel", "reset_gated_eval_kernel", "gated_cell_eval_kernel", "update_kernel",
           "activation_eval", "reset_gated_eval", "gated_cell_eval", "update", "maxima_buffer"]


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _entries(BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """This program's flat entry indices: 32-bit (divisions inline) unless the pass has ``2**31`` entries or more
    (64-bit divisions are calls, with a stack frame: compile report)."""
    if WIDE:
        out = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        out = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return out


@triton.jit
def _absmax_bits(x, BITS: tl.constexpr):
    """The bit pattern of ``max|x|`` over a block, as an integer (masked lanes must hold 0)."""
    if BITS == 64:
        out = tl.max(tl.abs(x).to(tl.int64, bitcast=True), axis=0)
    else:
        out = tl.max(tl.abs(x).to(tl.int32, bitcast=True), axis=0)
    return out


@triton.jit
def _step_entry(i, batch, width):
    """``(row, u, t, b)`` of flat entry ``i`` of a ``(steps, batch, width)`` tensor: ``row = t * batch + b``."""
    row = i // width
    u = i - row * width
    t = row // batch
    return row, u, t, row - t * batch


@triton.jit
def activation_eval_kernel(a_ptr, s_ptr, f_ptr, d_ptr, rv_ptr, rr_ptr, max_ptr, scale_ptr, steps, batch, width,
                           rv_t, rv_b, rr_t, rr_b, RELU: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr,
                           WIDE: tl.constexpr):
    """``f = act(a)``, ``d = act'``, ``rv[T-1-t] = scale * d[t]``, ``rr[T-1-t] = f[t] - s[t]`` over ``(steps, batch,
    width)``: ``a``, ``s``, ``f``, ``d`` contiguous, ``rv``/``rr`` at strides ``(rv_t, rv_b, 1)``/``(rr_t, rr_b, 1)``;
    ``max|f|`` and ``max|f - s|`` merged into ``max_ptr[0]``, ``max_ptr[1]`` (integer bits)."""
    i = _entries(BLOCK, WIDE)
    _, u, t, b = _step_entry(i, batch, width)
    ok = t < steps
    a = tl.load(a_ptr + i, mask=ok, other=0.0)
    s = tl.load(s_ptr + i, mask=ok, other=0.0)
    scale = tl.load(scale_ptr)
    if RELU:
        f = tl.where(a < 0, 0.0, a)  # a NaN stays NaN (as torch.relu keeps it), so the maxima see it
        d = tl.where(f > 0, 1.0, 0.0).to(f.dtype)
    else:
        f = _tanh(a)
        d = 1.0 - f * f
    r = tl.where(ok, f - s, 0.0)
    tl.store(f_ptr + i, f, mask=ok)
    tl.store(d_ptr + i, d, mask=ok)
    tl.store(rv_ptr + (steps - 1 - t) * rv_t + b * rv_b + u, scale * d, mask=ok)
    tl.store(rr_ptr + (steps - 1 - t) * rr_t + b * rr_b + u, r, mask=ok)
    tl.atomic_max(max_ptr, _absmax_bits(tl.where(ok, f, 0.0), BITS))
    tl.atomic_max(max_ptr + 1, _absmax_bits(r, BITS))


@triton.jit
def reset_gated_eval_kernel(gi_ptr, gh_ptr, p_ptr, f_ptr, c_ptr, dn_ptr, rv_ptr, rr_ptr, max_ptr, scale_ptr,
                            steps, batch, width, rv_t, rv_b, rr_t, rr_b, BITS: tl.constexpr, BLOCK: tl.constexpr,
                            WIDE: tl.constexpr):
    """A reset-gated step at every ``(t, b, u)``: with ``gi``/``gh`` ``(T*B, 3W)`` (blocks ``a, b, c`` of the
    input and hidden parts) and ``p`` the state buffer ``(T+1, B, W)`` (``p[t]`` the previous state of step
    ``t``, ``p[t+1]`` the guess): ``r = σ(gi_a + gh_a)``, ``z = σ(gi_b + gh_b)``, ``n = tanh(gi_c + r gh_c)``,
    ``f = n + z (p[t] - n)``. Coefficients ``c`` ``(T*B, 4W)``: ``[dn gh_c r(1-r), (p[t] - n) z(1-z), dn r, z]``
    with ``dn = (1-z)(1-n^2)`` (``dn_ptr``); ``rv`` ``(T, B, 4W)`` at strides ``(rv_t, rv_b, 1)`` the coefficients
    scaled, last step first; ``rr`` ``(T, B, W)`` at ``(rr_t, rr_b, 1)`` the residual ``f - p[t+1]``, last step
    first; ``max|f|``, ``max|f - p[t+1]|`` as in :data:`activation_eval_kernel`."""
    i = _entries(BLOCK, WIDE)
    row, u, t, b = _step_entry(i, batch, width)
    ok = t < steps
    g = row * (3 * width) + u
    xa = tl.load(gi_ptr + g, mask=ok, other=0.0)
    xb = tl.load(gi_ptr + g + width, mask=ok, other=0.0)
    xc = tl.load(gi_ptr + g + 2 * width, mask=ok, other=0.0)
    ha = tl.load(gh_ptr + g, mask=ok, other=0.0)
    hb = tl.load(gh_ptr + g + width, mask=ok, other=0.0)
    hc = tl.load(gh_ptr + g + 2 * width, mask=ok, other=0.0)
    prev = tl.load(p_ptr + i, mask=ok, other=0.0)
    s = tl.load(p_ptr + batch * width + i, mask=ok, other=0.0)
    scale = tl.load(scale_ptr)
    r = _sigmoid(xa + ha)
    z = _sigmoid(xb + hb)
    n = _tanh(xc + r * hc)
    f = n + z * (prev - n)
    dn = (1.0 - z) * (1.0 - n * n)
    c0 = dn * hc * r * (1.0 - r)
    c1 = (prev - n) * z * (1.0 - z)
    c2 = dn * r
    res = tl.where(ok, f - s, 0.0)
    cw = row * (4 * width) + u
    rw = (steps - 1 - t) * rv_t + b * rv_b + u
    tl.store(f_ptr + i, f, mask=ok)
    tl.store(dn_ptr + i, dn, mask=ok)
    tl.store(c_ptr + cw, c0, mask=ok)
    tl.store(c_ptr + cw + width, c1, mask=ok)
    tl.store(c_ptr + cw + 2 * width, c2, mask=ok)
    tl.store(c_ptr + cw + 3 * width, z, mask=ok)
    tl.store(rv_ptr + rw, scale * c0, mask=ok)
    tl.store(rv_ptr + rw + width, scale * c1, mask=ok)
    tl.store(rv_ptr + rw + 2 * width, scale * c2, mask=ok)
    tl.store(rv_ptr + rw + 3 * width, scale * z, mask=ok)
    tl.store(rr_ptr + (steps - 1 - t) * rr_t + b * rr_b + u, res, mask=ok)
    tl.atomic_max(max_ptr, _absmax_bits(tl.where(ok, f, 0.0), BITS))
    tl.atomic_max(max_ptr + 1, _absmax_bits(res, BITS))


@triton.jit
def gated_cell_eval_kernel(gi_ptr, gh_ptr, p_ptr, f_ptr, c_ptr, rv_ptr, rr_ptr, max_ptr, scale_ptr, steps, batch, width,
                           rv_t, rv_b, rr_t, rr_b, BITS: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """A step with four gates and a cell state at every ``(t, b, u)``: with ``gi``/``gh`` ``(T*B, 4W)`` (blocks
    ``i, f, g, o``) and ``p`` the state buffer ``(T+1, B, 2W)`` (``p[t] = (h, c)`` before step ``t``, ``p[t+1]`` the
    guess): ``c' = σ(f) c + σ(i) tanh(g)``, ``h' = σ(o) tanh(c')``, ``f`` ``(T, B, 2W)`` = ``(h', c')``. Coefficients
    ``c`` ``(T*B, 6W)``: ``[k, σ(f), ci, cf, cg, co]`` with ``k = σ(o)(1 - tanh^2 c')``, ``ci = tanh(g) σ(i)(1-σ(i))``,
    ``cf = c σ(f)(1-σ(f))``, ``cg = σ(i)(1 - tanh^2 g)``, ``co = tanh(c') σ(o)(1-σ(o))``. ``rv`` ``(T, B, 9W)`` at
    strides ``(rv_t, rv_b, 1)``: the step's ``(2W, 5W)`` Jacobian (``d(h', c')/d(a_i, a_f, a_g, a_o, c)``
    transposed back: row ``u`` ``[ci k, cf k, cg k, co, σ(f) k]``, row ``W + u`` ``[ci, cf, cg, σ(f)]``, CSR order)
    scaled, last step first; ``rr`` ``(T, B, 2W)`` at ``(rr_t, rr_b, 1)`` the residual ``f - p[t+1]``, last step
    first; ``max|f|``, ``max|f - p[t+1]|`` as in :data:`activation_eval_kernel`."""
    i = _entries(BLOCK, WIDE)
    row, u, t, b = _step_entry(i, batch, width)
    ok = t < steps
    g = row * (4 * width) + u
    ai = tl.load(gi_ptr + g, mask=ok, other=0.0) + tl.load(gh_ptr + g, mask=ok, other=0.0)
    af = tl.load(gi_ptr + g + width, mask=ok, other=0.0) + tl.load(gh_ptr + g + width, mask=ok, other=0.0)
    ag = tl.load(gi_ptr + g + 2 * width, mask=ok, other=0.0) + tl.load(gh_ptr + g + 2 * width, mask=ok, other=0.0)
    ao = tl.load(gi_ptr + g + 3 * width, mask=ok, other=0.0) + tl.load(gh_ptr + g + 3 * width, mask=ok, other=0.0)
    sp = row * (2 * width) + u
    c_prev = tl.load(p_ptr + sp + width, mask=ok, other=0.0)
    s_h = tl.load(p_ptr + sp + 2 * batch * width, mask=ok, other=0.0)
    s_c = tl.load(p_ptr + sp + 2 * batch * width + width, mask=ok, other=0.0)
    scale = tl.load(scale_ptr)
    gate_i = _sigmoid(ai)
    gate_f = _sigmoid(af)
    gate_g = _tanh(ag)
    gate_o = _sigmoid(ao)
    c = gate_f * c_prev + gate_i * gate_g
    tc = _tanh(c)
    h = gate_o * tc
    k = gate_o * (1.0 - tc * tc)
    ci = gate_g * gate_i * (1.0 - gate_i)
    cf = c_prev * gate_f * (1.0 - gate_f)
    cg = gate_i * (1.0 - gate_g * gate_g)
    co = tc * gate_o * (1.0 - gate_o)
    res_h = tl.where(ok, h - s_h, 0.0)
    res_c = tl.where(ok, c - s_c, 0.0)
    tl.store(f_ptr + sp, h, mask=ok)
    tl.store(f_ptr + sp + width, c, mask=ok)
    cw = row * (6 * width) + u
    tl.store(c_ptr + cw, k, mask=ok)
    tl.store(c_ptr + cw + width, gate_f, mask=ok)
    tl.store(c_ptr + cw + 2 * width, ci, mask=ok)
    tl.store(c_ptr + cw + 3 * width, cf, mask=ok)
    tl.store(c_ptr + cw + 4 * width, cg, mask=ok)
    tl.store(c_ptr + cw + 5 * width, co, mask=ok)
    rw = (steps - 1 - t) * rv_t + b * rv_b
    top = rw + 5 * u  # row u of the transposed Jacobian: five entries
    tl.store(rv_ptr + top, scale * (ci * k), mask=ok)
    tl.store(rv_ptr + top + 1, scale * (cf * k), mask=ok)
    tl.store(rv_ptr + top + 2, scale * (cg * k), mask=ok)
    tl.store(rv_ptr + top + 3, scale * co, mask=ok)
    tl.store(rv_ptr + top + 4, scale * (gate_f * k), mask=ok)
    bottom = rw + 5 * width + 4 * u  # row W + u: four entries
    tl.store(rv_ptr + bottom, scale * ci, mask=ok)
    tl.store(rv_ptr + bottom + 1, scale * cf, mask=ok)
    tl.store(rv_ptr + bottom + 2, scale * cg, mask=ok)
    tl.store(rv_ptr + bottom + 3, scale * gate_f, mask=ok)
    rp = (steps - 1 - t) * rr_t + b * rr_b + u
    tl.store(rr_ptr + rp, res_h, mask=ok)
    tl.store(rr_ptr + rp + width, res_c, mask=ok)
    tl.atomic_max(max_ptr, tl.maximum(_absmax_bits(tl.where(ok, h, 0.0), BITS),
                                      _absmax_bits(tl.where(ok, c, 0.0), BITS)))
    tl.atomic_max(max_ptr + 1, tl.maximum(_absmax_bits(res_h, BITS), _absmax_bits(res_c, BITS)))


@triton.jit
def update_kernel(d_ptr, s_ptr, max_ptr, steps, batch, width, d_t, d_b, d_w, BITS: tl.constexpr,
                  BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """``s[T-1-j] += d[j]`` for ``d`` ``(steps, batch, width)`` at strides ``(d_t, d_b, d_w)`` and ``s``
    contiguous; ``max|d|`` merged into ``max_ptr[0]`` (integer bits)."""
    i = _entries(BLOCK, WIDE)
    _, u, j, b = _step_entry(i, batch, width)
    ok = j < steps
    d = tl.load(d_ptr + j * d_t + b * d_b + u * d_w, mask=ok, other=0.0)
    dst = s_ptr + ((steps - 1 - j) * batch + b) * width + u
    tl.store(dst, tl.load(dst, mask=ok, other=0.0) + d, mask=ok)
    tl.atomic_max(max_ptr, _absmax_bits(d, BITS))


# --------------------------------------------------------------------------- launchers


def maxima_buffer(dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed buffer of three maxima of ``dtype`` (``max|f|``, ``max|f - s|``, ``max|δ|``): the kernels merge
    into its integer view; read it as floats."""
    return torch.zeros(3, dtype=dtype, device=device)


def _bits(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    if t.dtype == torch.float64:
        return t.view(torch.int64), 64
    if t.dtype == torch.float32:
        return t.view(torch.int32), 32
    raise TypeError(f"fixed-point kernels: expected float32 or float64, got {t.dtype}")


def _launch_pass(kernel, n: int, maxima: torch.Tensor, slot: int, args: dict, consts: dict, reach: int) -> None:
    """One launch of an elementwise pass over ``n`` entries (none if ``n`` is 0) that merges its maxima into the
    integer bits of ``maxima`` from entry ``slot`` on; 64-bit indices where ``n`` or ``reach`` (the farthest offset
    it computes from a pointer) come near ``2**31``."""
    if n == 0:
        return
    bits, nbits = _bits(maxima)
    block, warps = launch.pointwise_config(n)
    wide = max(n, reach) + block >= (1 << 31)
    launch.launch(kernel, (triton.cdiv(n, block),), dict(args, max_ptr=bits[slot:]),
                  dict(consts, BITS=nbits, BLOCK=block, WIDE=wide), warps)


def _check(name: str, t: torch.Tensor, shape: tuple, like: torch.Tensor, strided: bool = False) -> None:
    """``t`` of ``shape``, ``like``'s dtype and device, contiguous (``strided``: unit stride in its last dimension)."""
    dense = t.stride(-1) == 1 if strided and t.dim() else t.is_contiguous()
    if tuple(t.shape) != tuple(shape) or t.dtype != like.dtype or t.device != like.device or not dense:
        what = "with unit stride in its last dimension" if strided else "contiguous"
        raise ValueError(f"{name}: expected a {like.dtype} tensor of shape {tuple(shape)} on {like.device}, {what}; "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device} with strides {tuple(t.stride())}")


def _reach(*tensors: torch.Tensor) -> int:
    """The farthest entry any of ``tensors`` spans from its first (its offsets a kernel computes)."""
    return max(sum((k - 1) * st for k, st in zip(t.shape, t.stride())) + 1 for t in tensors)


def activation_eval(a: torch.Tensor, s: torch.Tensor, f: torch.Tensor, d: torch.Tensor, rv: torch.Tensor,
                    rr: torch.Tensor, maxima: torch.Tensor, scale: torch.Tensor, relu: bool) -> None:
    """One launch of :data:`activation_eval_kernel` over ``a`` ``(T, B, W)``: ``s``, ``f``, ``d`` the same, contiguous;
    ``rv``, ``rr`` the same shape, any strides with a unit last one (views of a scan's input buffers);
    ``maxima`` from :func:`maxima_buffer`, ``scale`` one entry."""
    if a.dim() != 3:
        raise ValueError(f"a: expected (T, B, W) pre-activations, got shape {tuple(a.shape)}")
    _check("a", a, a.shape, a)
    for name, t in (("s", s), ("f", f), ("d", d)):
        _check(name, t, a.shape, a)
    for name, t in (("rv", rv), ("rr", rr)):
        _check(name, t, a.shape, a, strided=True)
    steps, batch, width = a.shape
    _launch_pass(activation_eval_kernel, a.numel(), maxima, 0,
                 dict(a_ptr=a, s_ptr=s, f_ptr=f, d_ptr=d, rv_ptr=rv, rr_ptr=rr, scale_ptr=scale, steps=steps,
                      batch=batch, width=width, rv_t=rv.stride(0), rv_b=rv.stride(1), rr_t=rr.stride(0),
                      rr_b=rr.stride(1)), dict(RELU=bool(relu)), _reach(rv, rr))


def reset_gated_eval(gi: torch.Tensor, gh: torch.Tensor, p: torch.Tensor, f: torch.Tensor, c: torch.Tensor,
                     dn: torch.Tensor, rv: torch.Tensor, rr: torch.Tensor, maxima: torch.Tensor,
                     scale: torch.Tensor) -> None:
    """One launch of :data:`reset_gated_eval_kernel`: ``p`` ``(T+1, B, W)``, ``gi``/``gh`` ``(T, B, 3W)``,
    ``f``/``dn`` ``(T, B, W)``, ``c`` ``(T, B, 4W)``, contiguous; ``rv`` ``(T, B, 4W)`` and ``rr`` ``(T, B, W)``,
    any strides with a unit last one."""
    if p.dim() != 3:
        raise ValueError(f"p: expected a (T+1, B, W) state buffer, got shape {tuple(p.shape)}")
    steps, batch, width = p.shape[0] - 1, p.shape[1], p.shape[2]
    _check("p", p, (steps + 1, batch, width), p)
    for name, t, w in (("gi", gi, 3), ("gh", gh, 3), ("f", f, 1), ("c", c, 4), ("dn", dn, 1)):
        _check(name, t, (steps, batch, w * width), p)
    for name, t, w in (("rv", rv, 4), ("rr", rr, 1)):
        _check(name, t, (steps, batch, w * width), p, strided=True)
    n = steps * batch * width
    _launch_pass(reset_gated_eval_kernel, n, maxima, 0,
                 dict(gi_ptr=gi, gh_ptr=gh, p_ptr=p, f_ptr=f, c_ptr=c, dn_ptr=dn, rv_ptr=rv, rr_ptr=rr, scale_ptr=scale,
                      steps=steps, batch=batch, width=width, rv_t=rv.stride(0), rv_b=rv.stride(1), rr_t=rr.stride(0),
                      rr_b=rr.stride(1)), {}, max(4 * n + batch * width, _reach(rv, rr)))


def gated_cell_eval(gi: torch.Tensor, gh: torch.Tensor, p: torch.Tensor, f: torch.Tensor, c: torch.Tensor,
                    rv: torch.Tensor, rr: torch.Tensor, maxima: torch.Tensor, scale: torch.Tensor) -> None:
    """One launch of :data:`gated_cell_eval_kernel`: ``p`` ``(T+1, B, 2W)``, ``gi``/``gh`` ``(T, B, 4W)``, ``f``
    ``(T, B, 2W)``, ``c`` ``(T, B, 6W)``, contiguous; ``rv`` ``(T, B, 9W)`` and ``rr`` ``(T, B, 2W)``, any strides
    with a unit last one."""
    if p.dim() != 3 or p.shape[2] % 2:
        raise ValueError(f"p: expected a (T+1, B, 2W) state buffer, got shape {tuple(p.shape)}")
    steps, batch, width = p.shape[0] - 1, p.shape[1], p.shape[2] // 2
    _check("p", p, (steps + 1, batch, 2 * width), p)
    for name, t, w in (("gi", gi, 4), ("gh", gh, 4), ("f", f, 2), ("c", c, 6)):
        _check(name, t, (steps, batch, w * width), p)
    for name, t, w in (("rv", rv, 9), ("rr", rr, 2)):
        _check(name, t, (steps, batch, w * width), p, strided=True)
    n = steps * batch * width
    _launch_pass(gated_cell_eval_kernel, n, maxima, 0,
                 dict(gi_ptr=gi, gh_ptr=gh, p_ptr=p, f_ptr=f, c_ptr=c, rv_ptr=rv, rr_ptr=rr, scale_ptr=scale,
                      steps=steps, batch=batch, width=width, rv_t=rv.stride(0), rv_b=rv.stride(1), rr_t=rr.stride(0),
                      rr_b=rr.stride(1)), {}, max(6 * n + 2 * batch * width, _reach(rv, rr)))


def update(d: torch.Tensor, s: torch.Tensor, maxima: torch.Tensor) -> None:
    """``s[T-1-j] += d[j]`` (``d`` ``(T, B, W)``, any strides; ``s`` contiguous, the same shape) and ``max|d|``
    into ``maxima[2]``: one launch of :data:`update_kernel`."""
    if d.dim() != 3 or d.dtype != s.dtype or d.device != s.device:
        raise ValueError(f"update: expected a 3-d {s.dtype} update on {s.device}, got {tuple(d.shape)} {d.dtype}")
    _check("s", s, d.shape, s)
    steps, batch, width = d.shape
    _launch_pass(update_kernel, d.numel(), maxima, 2,
                 dict(d_ptr=d, s_ptr=s, steps=steps, batch=batch, width=width, d_t=d.stride(0), d_b=d.stride(1),
                      d_w=d.stride(2)), {}, _reach(d))
