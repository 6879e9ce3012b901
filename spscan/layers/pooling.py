"""Channel-wise window pooling: ``nn.MaxPool1d/2d`` and ``nn.AvgPool1d/2d``."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import has_torch_function_unary

from spscan.kernels.backend import cpu_ops
from spscan.layers.base import LayerUnit, PerDevice, UnitCapabilities, _flat_index, _tuple, coo_to_csr

__all__ = ["MaxPoolUnit", "AvgPoolUnit"]


def _window_entries(c: int, s_in: Sequence[int], s_out: Sequence[int], k, s, p, d):
    """Every in-bounds window candidate of a channel-wise pool, as flat (input, output, plane
    position) index arrays in (c, o..., k...) order."""
    nd = len(s_in)
    nax = 1 + 2 * nd
    def ax(n: int, pos: int) -> np.ndarray:
        shape = [1] * nax
        shape[pos] = n
        return np.arange(n, dtype=np.int64).reshape(shape)
    ch = ax(c, 0)
    o = [ax(s_out[t], 1 + t) for t in range(nd)]
    kk = [ax(k[t], 1 + nd + t) for t in range(nd)]
    i = [o[t] * s[t] - p[t] + kk[t] * d[t] for t in range(nd)]
    full = np.broadcast(ch, *o, *kk).shape
    valid = np.ones(full, dtype=bool)
    for t in range(nd):
        valid &= (i[t] >= 0) & (i[t] < s_in[t])
    plane = np.broadcast_to(_flat_index(i, s_in), full)
    rows = np.broadcast_to(_flat_index([ch, *i], [c, *s_in]), full)[valid]
    cols = np.broadcast_to(_flat_index([ch, *o], [c, *s_out]), full)[valid]
    return rows, cols, plane[valid], valid, full


def _check_pool_input(unit: LayerUnit, index: int, in_shape: tuple[int, ...]) -> int:
    """The number of spatial dims of a 1-d or 2-d pool, after checking the input has them."""
    nd = 1 if isinstance(unit.module, (nn.MaxPool1d, nn.AvgPool1d)) else 2
    if len(in_shape) != nd + 1:
        raise ValueError(f"layer {index} ({unit.name}): expected per-sample input of {nd + 1} dims "
                         f"(C, spatial), got {tuple(in_shape)}")
    return nd


class MaxPoolUnit(LayerUnit):
    """``nn.MaxPool1d`` / ``nn.MaxPool2d`` (any kernel, stride, padding, dilation, ceil_mode).

    The pattern holds every in-bounds candidate of every window; the value is 1 exactly at the
    index ``max_pool(..., return_indices=True)`` reports for that output (ties: torch's pick).
    The structured operator is ATen's pooling backward with the forward's indices (a 1-d pool runs it
    as a ``1 x L`` plane), as autograd applies it: one kernel call where the CSR path gathers and sums.
    Overlapping windows (kernel > stride) sum an input's gradients in the kernel's fixed order, so
    the result is deterministic (on a CUDA device too: its 2-d pooling backward gathers per input, no
    atomics); the CSR values stay available for a planned product that needs them."""

    shared = False
    capabilities = UnitCapabilities(structured_operator=True, fuses_relu_below=True)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        if module.return_indices:
            raise ValueError(f"layer {index} ({self.name}): return_indices=False expected (a chain passes one "
                             "tensor on), got return_indices=True")
        nd = self.nd = _check_pool_input(self, index, in_shape)
        k = _tuple(module.kernel_size, nd)
        s = _tuple(module.stride if module.stride is not None else module.kernel_size, nd)
        p = _tuple(module.padding, nd)
        d = _tuple(module.dilation, nd)
        rows, cols, plane, _, _ = _window_entries(in_shape[0], in_shape[1:], out_shape[1:], k, s, p, d)
        empty = np.flatnonzero(np.bincount(cols, minlength=self.d_out) == 0)
        if empty.size:
            # torch returns -inf and an out-of-range argmax there: no well-defined Jacobian to plan
            raise ValueError(f"layer {index} ({self.name}): output element {int(empty[0])} pools a window that "
                             f"lies entirely in the padding (input {tuple(in_shape)}, kernel {k}, stride {s}, "
                             f"padding {p}, dilation {d}); expected every window to hold an input element")
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        self.entry_out = PerDevice.index(cols[order])
        self.entry_plane = PerDevice.index(plane[order])
        # 2x2 and 3x3 windows have a compiled forward on a CPU (2-5x ATen's speed on one thread): a cost
        # family of their own (other windows run ATen's forward in every regime)
        self._compiled_forward = nd == 2 and cpu_ops.max_pool_compiled(k, d)
        # windows that never overlap: every input takes at most one output's gradient
        self.disjoint_windows = all(ss >= (kk - 1) * dd + 1 for ss, kk, dd in zip(s, k, d))
        # ATen's 2-d pooling backward arguments; a 1-d pool is a 2-d one over (1, L) planes
        one = ((1,), (1,), (0,), (1,)) if nd == 1 else ((), (), (), ())
        self._backward_args = ([*one[0], *k], [*one[1], *s], [*one[2], *p], [*one[3], *d], bool(module.ceil_mode))
        self._plane_shape = ((1,) + tuple(in_shape[1:]) if nd == 1 else tuple(in_shape[1:]),
                             (1,) + tuple(out_shape[1:]) if nd == 1 else tuple(out_shape[1:]))

    @property
    def cost_family(self) -> str:
        return "MaxPoolUnit" if self._compiled_forward else "MaxPoolUnit/window"

    def _pool_backward(self, saved, g, relu_below: bool = False):
        """``J^T g`` as ``(B, C, *in_spatial)`` by ATen's pooling backward; ``relu_below``: ``g`` masked
        first where the pooled output is ``<= 0`` (see :meth:`chain_step`). A 2-d ``g`` already in the
        output's shape is read as it is (no view: the step dispatches what autograd's node does)."""
        idx, x, y = saved
        if self.nd == 2:
            if g.dim() != 4:
                g = g.reshape(idx.shape)
            if relu_below:
                g = torch.ops.aten.threshold_backward(g, y, 0)
            return torch.ops.aten.max_pool2d_with_indices_backward(g, x, *self._backward_args, idx)
        b, c = idx.shape[0], idx.shape[1]
        s_in, s_out = self._plane_shape
        g = g.reshape((b, c) + s_out)
        if relu_below:
            g = torch.ops.aten.threshold_backward(g, y.reshape((b, c) + s_out), 0)
        x, idx = x.reshape((b, c) + s_in), idx.reshape((b, c) + s_out)
        gi = torch.ops.aten.max_pool2d_with_indices_backward(g, x, *self._backward_args, idx)
        return gi.view((b,) + self.in_shape)

    def apply_transposed(self, saved, tensors, g):
        return self._pool_backward(saved, g).reshape(g.shape[0], self.d_in)

    def run(self, x, tensors):
        m = self.module
        if self.nd == 2 and not has_torch_function_unary(x):  # F.max_pool2d(..., return_indices=True)'s call
            # on a CPU, the compiled kernel gives ATen's (output, indices) bit for bit
            got = cpu_ops.max_pool2d_with_indices(x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
            y, idx = got if got is not None else torch._C._nn.max_pool2d_with_indices(
                x, m.kernel_size, m.stride if m.stride is not None else [], m.padding, m.dilation, m.ceil_mode)
        else:
            fn = F.max_pool1d if self.nd == 1 else F.max_pool2d
            y, idx = fn(x, m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode, return_indices=True)
        # the input, as autograd keeps it (its pooling backward reads the shape), and the output (held
        # by the next layer anyway) for a ReLU mask applied at the pooled resolution (chain_step)
        return y, (idx, x, y)

    def chain_step(self, needed=None, relu_below: bool = False):
        """Autograd's pooling backward, ``(B, *out_shape) -> (B, *in_shape)``. ``relu_below``: the layer
        below is a ReLU whose mask this step applies, at the pooled resolution: every input that takes a
        gradient is the argmax of each window that gives it one, and each such window's pooled value is
        that input (the ReLU's output), so masking ``g`` where the pooled output is ``<= 0`` before the
        pooling backward gives exactly ``threshold_backward(pool_backward(g), x, 0)`` (the same terms
        summed in the same order where windows overlap) with a window's share of the elementwise work.
        The ReLU's own step is then the identity (:meth:`ElementwiseUnit.chain_step` with ``masked_above``)."""
        backward = self._pool_backward
        if relu_below:
            return lambda saved, tensors, g: (backward(saved, g, True), None)
        return lambda saved, tensors, g: (backward(saved, g), None)

    def fill(self, saved, tensors):
        idx, x = saved[0], saved[1]
        dtype = x.dtype
        idx = idx.reshape(idx.shape[0], -1)
        picked = torch.index_select(idx, 1, self.entry_out.on(idx.device))
        return (picked == self.entry_plane.on(idx.device)).to(dtype)


def _avg_divisors(s_in: Sequence[int], s_out: Sequence[int], k, s, p, count_include_pad: bool,
                  divisor_override) -> np.ndarray:
    """The divisor of every output position ``(*s_out)``, as torch's avg_pool kernels compute it."""
    nd = len(s_out)
    size_pad = np.ones(s_out, dtype=np.int64)
    size_in = np.ones(s_out, dtype=np.int64)
    for t in range(nd):
        o = np.arange(s_out[t], dtype=np.int64)
        start = o * s[t] - p[t]
        end = np.minimum(start + k[t], s_in[t] + p[t])
        span_pad = end - start
        span_in = np.minimum(end, s_in[t]) - np.maximum(start, 0)
        shape = [1] * nd
        shape[t] = s_out[t]
        size_pad = size_pad * span_pad.reshape(shape)
        size_in = size_in * span_in.reshape(shape)
    if divisor_override:
        return np.full(s_out, float(divisor_override))
    return (size_pad if count_include_pad else size_in).astype(np.float64)


class AvgPoolUnit(LayerUnit):
    """``nn.AvgPool1d`` / ``nn.AvgPool2d`` (count_include_pad, ceil_mode, divisor_override):
    ``J^T[in, out] = 1/divisor(out)`` over the in-bounds window candidates; values are shared.
    The structured operator is ATen's ``avg_pool2d_backward`` (a 1-d pool over ``1 x L`` planes), as
    autograd applies it."""

    shared = True
    capabilities = UnitCapabilities(structured_operator=True)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd = self.nd = _check_pool_input(self, index, in_shape)
        k = _tuple(module.kernel_size, nd)
        s = _tuple(module.stride if module.stride is not None else module.kernel_size, nd)
        p = _tuple(module.padding, nd)
        s_in, s_out = in_shape[1:], out_shape[1:]
        rows, cols, _, valid, full = _window_entries(in_shape[0], s_in, s_out, k, s, p, (1,) * nd)
        div = _avg_divisors(s_in, s_out, k, s, p, module.count_include_pad, getattr(module, "divisor_override", None))
        div_full = np.broadcast_to(div.reshape((1,) + tuple(s_out) + (1,) * nd), full)[valid]
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        self.entry_divisor = div_full[order]
        # 1/divisor computed in float64 then rounded once: what the backward kernel yields for grad 1
        self._values = PerDevice(
            lambda dtype, device: torch.from_numpy(1.0 / self.entry_divisor).to(device=device, dtype=dtype))
        one = ((1,), (1,), (0,)) if nd == 1 else ((), (), ())
        self._backward_args = ([*one[0], *k], [*one[1], *s], [*one[2], *p], bool(module.ceil_mode),
                               bool(module.count_include_pad), getattr(module, "divisor_override", None))
        self._planes = ((1,) + tuple(s_in), (1,) + tuple(s_out)) if nd == 1 else (tuple(s_in), tuple(s_out))

    def run(self, x, tensors):
        # the input, as autograd keeps it: its pooling backward reads the shape
        return self.module(x), (x.dtype, x.device, x)

    def fill(self, saved, tensors):
        return self._values.get(saved[0], saved[1])

    def _pool_backward(self, saved, g):
        x = saved[2]
        b, c = x.shape[0], x.shape[1]
        if self.nd == 1 or g.dim() != 4:
            g, x = g.reshape((b, c) + self._planes[1]), x.reshape((b, c) + self._planes[0])
        gi = torch.ops.aten.avg_pool2d_backward(g, x, *self._backward_args)
        return gi.view((b,) + self.in_shape) if self.nd == 1 else gi

    def apply_transposed(self, saved, tensors, g):
        return self._pool_backward(saved, g).reshape(g.shape[0], self.d_in)

    def chain_step(self, needed=None):
        """Autograd's pooling backward, ``(B, *out_shape) -> (B, *in_shape)``."""
        backward = self._pool_backward
        return lambda saved, tensors, g: (backward(saved, g), None)
