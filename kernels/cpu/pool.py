"""Compiled CPU max-pooling forward (2-d, NCHW) with torch's indices, bit for bit ATen's results.

ATen's CPU ``max_pool2d_with_indices`` for contiguous NCHW input walks each window with a scalar
compare-and-branch per element, slower than the convolution before it (bench/results/calibration.md):
the largest single cost of a small CNN's forward on a CPU. This module computes the 2x2 and 3x3
windows (VGG's and LeNet's 2/2 pool, AlexNet's and ResNet's overlapping 3/2; any stride, padding and
ceil mode, no dilation) in loops compiled by numba, and returns the same ``(output, indices)``:

* the same windows (``padding`` on both sides, ``ceil_mode``, torch's output size);
* the same pick: scanning the window row by row, a value replaces the running maximum when it
  is greater or NaN (so the first of equal maxima wins, and the last NaN of a window is
  reported), starting from ``-inf`` at the window's first in-bounds position; a window inside the
  plane is reduced as a tree of the same picks (:func:`_pick`), which gives the same result because
  the rule is associative, with a shorter chain of dependent compares (a 3x3 window: four picks
  deep instead of nine), a window clipped by the plane's edge one position at a time;
* indices are flat positions ``h * W + w`` within the input plane, int64, so autograd's
  ``max_pool2d_with_indices_backward`` reads them unchanged.

:func:`max_pool2d_with_indices` returns ``None`` where it does not apply (numba not installed, a
non-CPU, non-float32/64, non-contiguous or not 4-d input, another window, an output-size edge case
torch refuses): the caller then runs ATen's kernel; so does a process with more than
:data:`MAX_THREADS` torch threads, where ATen's parallel kernel is faster. No ``fastmath`` and no
``parallel``; each output is one window's maximum, so results do not depend on threads.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from spscan.kernels.cpu.jit import available, numba_module

__all__ = ["compiled_window", "max_pool2d_with_indices", "output_size"]


def _pick(m, mi, v, vi):  # pragma: no cover - compiled, inlined where called
    """The running maximum ``(m, mi)`` after visiting ``(v, vi)``, which comes later in ATen's scan order:
    ``v`` replaces it when greater or NaN. The rule is associative (the result is a window's last NaN,
    else its first maximum), so a window may be reduced as a tree of picks, each pair in scan order."""
    t = (v > m) | (v != v)
    return (v if t else m), (vi if t else mi)


def _borders(x, out, idx, p, k, sh, sw, ph, pw, rows, cols):  # pragma: no cover - compiled
    """Plane ``p``'s outputs outside ``rows x cols`` (half-open ranges) of a ``k x k`` window without
    dilation: each window clipped to the plane, in ATen's order (row by row from its first in-bounds
    position)."""
    h, w = x.shape[1], x.shape[2]
    ow_n = out.shape[2]
    for oh in range(out.shape[1]):
        inner = rows[0] <= oh < rows[1]
        ih0 = max(oh * sh - ph, 0)
        ih1 = min(oh * sh - ph + k, h)
        for ow in range(ow_n):
            if inner and cols[0] <= ow < cols[1]:
                continue
            iw0 = max(ow * sw - pw, 0)
            iw1 = min(ow * sw - pw + k, w)
            m = x[p, ih0, iw0]
            mi = ih0 * w + iw0
            for ih in range(ih0, ih1):
                for iw in range(iw0, iw1):
                    m, mi = _pick_c(m, mi, x[p, ih, iw], ih * w + iw)
            out[p, oh, ow] = m
            idx[p, oh, ow] = mi


def _row2x2(x0, x1, o, io, b0, b1, lo, hi, sw, pw):  # pragma: no cover - compiled, inlined where called
    """Outputs ``lo:hi`` of one output row of 2x2 windows inside the plane, over input rows ``x0, x1``
    (flat offsets ``b0, b1``): two picks per input row, then the rows."""
    for ow in range(lo, hi):
        c = ow * sw - pw
        m0, i0 = _pick_c(x0[c], b0 + c, x0[c + 1], b0 + c + 1)
        m1, i1 = _pick_c(x1[c], b1 + c, x1[c + 1], b1 + c + 1)
        o[ow], io[ow] = _pick_c(m0, i0, m1, i1)


def _row3x3(x0, x1, x2, o, io, b0, lo, hi, sw, pw):  # pragma: no cover - compiled, inlined where called
    """Outputs ``lo:hi`` of one output row of 3x3 windows inside the plane, over input rows ``x0, x1, x2``
    (the first at flat offset ``b0``): three picks per input row (a chain of two), then the rows."""
    w = x0.shape[0]
    b1 = b0 + w
    b2 = b1 + w
    for ow in range(lo, hi):
        c = ow * sw - pw
        m0, i0 = _pick_c(x0[c], b0 + c, x0[c + 1], b0 + c + 1)
        m0, i0 = _pick_c(m0, i0, x0[c + 2], b0 + c + 2)
        m1, i1 = _pick_c(x1[c], b1 + c, x1[c + 1], b1 + c + 1)
        m1, i1 = _pick_c(m1, i1, x1[c + 2], b1 + c + 2)
        m2, i2 = _pick_c(x2[c], b2 + c, x2[c + 1], b2 + c + 1)
        m2, i2 = _pick_c(m2, i2, x2[c + 2], b2 + c + 2)
        m0, i0 = _pick_c(m0, i0, m1, i1)
        o[ow], io[ow] = _pick_c(m0, i0, m2, i2)


def _pool2_kernel(x, out, idx):  # pragma: no cover - compiled
    """2x2 windows, stride 2, no padding, every window inside the plane (VGG's and LeNet's pool): four
    candidates in row order, branches on the plane's own indices (measured 1.2-1.3x faster here than
    :func:`_windows_kernel`'s tree on these windows)."""
    planes, _, w = x.shape
    oh_n, ow_n = out.shape[1], out.shape[2]
    for p in range(planes):
        for oh in range(oh_n):
            r = 2 * oh
            for ow in range(ow_n):
                c = 2 * ow
                m = -np.inf
                mi = r * w + c
                v = x[p, r, c]
                if v > m or v != v:
                    m = v
                    mi = r * w + c
                v = x[p, r, c + 1]
                if v > m or v != v:
                    m = v
                    mi = r * w + c + 1
                v = x[p, r + 1, c]
                if v > m or v != v:
                    m = v
                    mi = (r + 1) * w + c
                v = x[p, r + 1, c + 1]
                if v > m or v != v:
                    m = v
                    mi = (r + 1) * w + c + 1
                out[p, oh, ow] = m
                idx[p, oh, ow] = mi


def _windows_kernel(x, out, idx, k, sh, sw, ph, pw, rows, cols):  # pragma: no cover - compiled
    """``k x k`` windows, ``k`` 2 or 3 (any stride and padding, no dilation; AlexNet's and ResNet's
    overlapping 3/2 too): the outputs whose window lies inside the plane (``rows x cols``, half-open
    ranges) a row at a time by :func:`_row2x2` or :func:`_row3x3`, the others by :func:`_borders`."""
    w = x.shape[2]
    lo, hi = cols[0], cols[1]
    border = rows[0] > 0 or rows[1] < out.shape[1] or lo > 0 or hi < out.shape[2]
    for p in range(x.shape[0]):
        for oh in range(rows[0], rows[1]):
            r = oh * sh - ph
            b = r * w
            o, io = out[p, oh], idx[p, oh]
            # the common strides as constants in the inlined row loop: its loads at a known stride, ~1.5x faster
            if k == 2:
                if sw == 2:
                    _row2x2_c(x[p, r], x[p, r + 1], o, io, b, b + w, lo, hi, 2, pw)
                elif sw == 1:
                    _row2x2_c(x[p, r], x[p, r + 1], o, io, b, b + w, lo, hi, 1, pw)
                else:
                    _row2x2_c(x[p, r], x[p, r + 1], o, io, b, b + w, lo, hi, sw, pw)
            elif sw == 2:
                _row3x3_c(x[p, r], x[p, r + 1], x[p, r + 2], o, io, b, lo, hi, 2, pw)
            elif sw == 1:
                _row3x3_c(x[p, r], x[p, r + 1], x[p, r + 2], o, io, b, lo, hi, 1, pw)
            else:
                _row3x3_c(x[p, r], x[p, r + 1], x[p, r + 2], o, io, b, lo, hi, sw, pw)
        if border:
            _borders_c(x, out, idx, p, k, sh, sw, ph, pw, rows, cols)


_pick_c = _row2x2_c = _row3x3_c = _borders_c = None  # the helpers above, compiled (all but the last inlined)
_KERNELS = {"windows": _windows_kernel, "2/2": _pool2_kernel}  # "2/2": every window of a 2x2/2 pool inside
_compiled: dict[str, object] = {}


def _kernel(name: str):
    fn = _compiled.get(name)
    if fn is None:
        numba = numba_module()
        global _pick_c, _row2x2_c, _row3x3_c, _borders_c
        if _pick_c is None:
            # inlined where called (numba's IR inlining): the same code as written out in the loop, so a
            # constant argument (the stride 2) is a constant in the inlined copy
            _pick_c = numba.njit(cache=True, nogil=True, inline="always")(_pick)
            _row2x2_c = numba.njit(cache=True, nogil=True, inline="always")(_row2x2)
            _row3x3_c = numba.njit(cache=True, nogil=True, inline="always")(_row3x3)
            _borders_c = numba.njit(cache=True, nogil=True)(_borders)
        fn = _compiled[name] = numba.njit(cache=True, nogil=True)(_KERNELS[name])
    return fn


def compiled_window(kernel_size, dilation) -> bool:
    """Whether a 2-d pooling window has a compiled forward here (2x2 or 3x3, no dilation; any stride,
    padding and ceil mode): the windows :func:`max_pool2d_with_indices` computes, given an input it
    applies to."""
    k = _pair(kernel_size)
    return k[0] == k[1] and k[0] in (2, 3) and _pair(dilation) == (1, 1)


def _inside(out_n: int, size: int, k: int, stride: int, pad: int) -> tuple[int, int]:
    """The half-open range of outputs whose window ``[o * stride - pad, o * stride - pad + k)`` lies in
    ``[0, size)``."""
    lo = -(-pad // stride)
    hi = min(out_n, (size - k + pad) // stride + 1) if size >= k - pad else 0
    lo = min(lo, out_n)
    return lo, max(lo, hi)


def output_size(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool) -> int:
    """Torch's pooled length (``pooling_output_shape``): floor or ceil of the window count, where a
    last window starting in the right padding is dropped in ceil mode."""
    num = size + 2 * pad - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)
    out = num // stride + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _pair(v) -> tuple[int, int]:
    if isinstance(v, (tuple, list)):
        if len(v) == 1:
            return int(v[0]), int(v[0])
        return int(v[0]), int(v[1])
    return int(v), int(v)


# Below this many input elements ATen's kernel is faster than the compiled call's fixed cost (~25 us of
# argument handling against ~3 ns saved per element)
MIN_NUMEL = 16384

# The compiled loops run on one thread; ATen's splits the planes over torch's threads and scales about
# linearly. Measured (bench/results/cpu-2core/pool-forward.md, 2-core x86_64): ATen 3.4-4.9x slower
# than the loop on one thread and 1.7-2.4x on two for 2x2 windows, 2.0-2.8x and 1.2-1.5x for 3x3. By that
# scaling ATen's kernel is the faster one from five threads on for 2x2 windows and from three for 3x3
# (unmeasured here: the compiled loop keeps only what was measured), and runs instead
MAX_THREADS = {2: 4, 3: 2}


def max_pool2d_with_indices(x: torch.Tensor, kernel_size, stride: Optional[Sequence[int]], padding, dilation,
                            ceil_mode: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(output (N, C, OH, OW), indices int64)`` equal to ``torch.ops.aten.max_pool2d_with_indices``
    for a 2x2 or 3x3 window without dilation (any stride, padding and ceil mode) over a contiguous CPU
    float32/float64 input ``(N, C, H, W)`` of at least :data:`MIN_NUMEL` elements, with at most
    :data:`MAX_THREADS` (per window size) torch threads; ``None`` where it does not apply (then
    ATen's kernel is the one to run). ``stride`` empty or ``None``: the kernel size."""
    if (x.dim() != 4 or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64)
            or x.numel() < MIN_NUMEL or not x.is_contiguous() or x.requires_grad
            or not compiled_window(kernel_size, dilation) or not available()):
        return None  # other windows: ATen's loop is as fast as a compiled one (bench/results/calibration.md)
    kh, kw = _pair(kernel_size)
    if torch.get_num_threads() > MAX_THREADS[kh]:
        return None
    sh, sw = _pair(stride) if stride else (kh, kw)
    ph, pw = _pair(padding)
    n, c, h, w = x.shape
    if min(sh, sw) < 1 or min(ph, pw) < 0 or 2 * ph > kh or 2 * pw > kw:
        return None  # torch's own checks and messages
    oh = output_size(h, kh, sh, ph, 1, ceil_mode)
    ow = output_size(w, kw, sw, pw, 1, ceil_mode)
    if oh < 1 or ow < 1 or n * c == 0:
        return None
    out = torch.empty((n, c, oh, ow), dtype=x.dtype)
    idx = torch.empty((n, c, oh, ow), dtype=torch.int64)
    xs = x.numpy().reshape(n * c, h, w)
    os_, is_ = out.numpy().reshape(n * c, oh, ow), idx.numpy().reshape(n * c, oh, ow)
    if (kh, sh, sw, ph, pw) == (2, 2, 2, 0, 0) and 2 * oh <= h and 2 * ow <= w:
        _kernel("2/2")(xs, os_, is_)
    else:
        rows, cols = _inside(oh, h, kh, sh, ph), _inside(ow, w, kw, sw, pw)
        _kernel("windows")(xs, os_, is_, kh, sh, sw, ph, pw, rows, cols)
    return out, idx
