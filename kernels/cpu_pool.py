"""Compiled CPU max-pooling forward (2-d, NCHW) with torch's indices, bit for bit ATen's results.

ATen's CPU ``max_pool2d_with_indices`` for contiguous NCHW input walks each window with a scalar
compare-and-branch per element, slower than the convolution before it (bench/results/calibration.md):
the largest single cost of a small CNN's forward on a CPU. This module runs the
same loop compiled by numba, with a straight-line 2x2/stride-2 path (the common VGG/LeNet pool),
and returns the same ``(output, indices)``:

* the same windows (``padding`` on both sides, ``dilation``, ``ceil_mode``, torch's output size);
* the same pick: scanning the window row by row, a value replaces the running maximum when it
  is greater or NaN (so the first of equal maxima wins, and the last NaN of a window is
  reported), starting from ``-inf`` at the window's first in-bounds position;
* indices are flat positions ``h * W + w`` within the input plane, int64, so autograd's
  ``max_pool2d_with_indices_backward`` reads them unchanged.

:func:`max_pool2d_with_indices` returns ``None`` where it does not apply (numba not installed, a
non-CPU, non-float32/64, non-contiguous or not 4-d input, an output-size edge case torch refuses):
the caller then runs ATen's kernel; so does a process with more than :data:`MAX_THREADS` torch
threads, where ATen's parallel kernel is faster. No ``fastmath`` and no ``parallel``; each output
is one window's maximum, so results do not depend on threads.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from .cpu_numba import available, numba_module

__all__ = ["max_pool2d_with_indices", "output_size"]


def _pool2_kernel(x, out, idx):  # pragma: no cover - compiled
    """2x2 windows, stride 2, no padding, no dilation (floor): four candidates in row order."""
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


def _pool_kernel(x, out, idx, kh, kw, sh, sw, ph, pw, dh, dw):  # pragma: no cover - compiled
    """Any window: ATen's loop (first in-bounds position, then row by row)."""
    planes, h, w = x.shape
    oh_n, ow_n = out.shape[1], out.shape[2]
    for p in range(planes):
        for oh in range(oh_n):
            ih0 = oh * sh - ph
            ih1 = min(ih0 + (kh - 1) * dh + 1, h)
            while ih0 < 0:
                ih0 += dh
            for ow in range(ow_n):
                iw0 = ow * sw - pw
                iw1 = min(iw0 + (kw - 1) * dw + 1, w)
                while iw0 < 0:
                    iw0 += dw
                m = -np.inf
                mi = ih0 * w + iw0
                for ih in range(ih0, ih1, dh):
                    for iw in range(iw0, iw1, dw):
                        v = x[p, ih, iw]
                        if v > m or v != v:
                            m = v
                            mi = ih * w + iw
                out[p, oh, ow] = m
                idx[p, oh, ow] = mi


_compiled: dict[str, object] = {}


def _kernel(name: str):
    fn = _compiled.get(name)
    if fn is None:
        src = _pool2_kernel if name == "pool2" else _pool_kernel
        fn = _compiled[name] = numba_module().njit(cache=True, nogil=True)(src)
    return fn


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

# The compiled loop runs on one thread; ATen's splits the planes over torch's threads and scales
# linearly (measured: 5.2x slower than the loop on one thread, 2.5x on two), so from five threads on
# ATen's kernel is the faster one and runs instead
MAX_THREADS = 4


def max_pool2d_with_indices(x: torch.Tensor, kernel_size, stride: Optional[Sequence[int]], padding, dilation,
                            ceil_mode: bool) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``(output (N, C, OH, OW), indices int64)`` equal to ``torch.ops.aten.max_pool2d_with_indices``
    for a contiguous CPU float32/float64 input ``(N, C, H, W)`` of at least :data:`MIN_NUMEL`
    elements, with at most :data:`MAX_THREADS` torch threads; ``None`` where it does not apply (then
    ATen's kernel is the one to run). ``stride`` empty or ``None``: the kernel size."""
    if (x.dim() != 4 or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64)
            or x.numel() < MIN_NUMEL or not x.is_contiguous() or x.requires_grad
            or torch.get_num_threads() > MAX_THREADS or not available()):
        return None
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(stride) if stride else (kh, kw)
    ph, pw = _pair(padding)
    dh, dw = _pair(dilation)
    n, c, h, w = x.shape
    if min(kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw) < 0 or 2 * ph > kh or 2 * pw > kw:
        return None  # torch's own checks and messages
    oh = output_size(h, kh, sh, ph, dh, ceil_mode)
    ow = output_size(w, kw, sw, pw, dw, ceil_mode)
    if oh < 1 or ow < 1 or n * c == 0:
        return None
    out = torch.empty((n, c, oh, ow), dtype=x.dtype)
    idx = torch.empty((n, c, oh, ow), dtype=torch.int64)
    xs = x.numpy().reshape(n * c, h, w)
    os_, is_ = out.numpy().reshape(n * c, oh, ow), idx.numpy().reshape(n * c, oh, ow)
    if (kh, kw, sh, sw, ph, pw, dh, dw) == (2, 2, 2, 2, 0, 0, 1, 1) and 2 * oh <= h and 2 * ow <= w:
        _kernel("pool2")(xs, os_, is_)
    else:
        _kernel("pool")(xs, os_, is_, kh, kw, sh, sw, ph, pw, dh, dw)
    return out, idx
