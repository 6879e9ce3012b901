"""Linear maps with shared values: ``nn.Linear``, convolutions, transposed convolutions, the
separable channel-wise resamplings (upsampling, adaptive average pooling, padding), and
``nn.Embedding`` (a linear map of one-hot token ids), and means and sums over per-sample dims."""

from __future__ import annotations

import abc
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn
import torch.nn.functional as F

from spscan.errors import LayerReplaced
from spscan.layers.base import (LayerUnit, PerDevice, UnitCapabilities, _effective, _flat_index,
                                _prod, _tuple, check_pattern_entries, coo_to_csr)

__all__ = ["LinearUnit", "ConvUnit", "ConvTransposeUnit", "SeparableResampleUnit", "EmbeddingUnit",
           "ReductionUnit"]


class _WeightGatherMixin:
    """Units whose ``J^T`` entries are elements of one weight tensor (shared values)."""

    weight_gather: PerDevice
    zero_weights: PerDevice  # flat weight indices dropped from the pattern (must stay zero)

    def _drop_mask(self, module: nn.Module, prune_zeros: bool) -> np.ndarray:
        """Boolean per flat weight element: ``True`` if it is pruned (left out of the pattern)."""
        w = _effective(module, "weight").detach()
        drop = torch.zeros(w.numel(), dtype=torch.bool)
        if hasattr(module, "weight_mask"):
            drop |= (module.weight_mask.detach().reshape(-1) == 0).cpu()
        if prune_zeros:
            drop |= (w.reshape(-1) == 0).cpu()
        return drop.numpy()

    def _check_pruned_still_zero(self, w: torch.Tensor) -> None:
        if not self.zero_weights.array.size:
            return
        dropped = torch.index_select(w.detach().reshape(-1), 0, self.zero_weights.on(w.device))
        if bool((dropped != 0).any()):
            k = int(torch.nonzero(dropped != 0)[0, 0])
            raise LayerReplaced(
                f"layer {self.index} ({self.name}): weight element {int(self.zero_weights.array[k])} was "
                f"pruned (left out of the pattern) at plan time but is now {float(dropped[k])}; "
                "pruned weights must stay zero — re-plan after changing the pruning"
            )

    def fill(self, saved: Any, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        w = tensors[0]
        # index_select: a 1-D gather without advanced indexing's overhead on CPU
        return torch.index_select(w.detach().reshape(-1), 0, self.weight_gather.on(w.device))


# ----------------------------------------------------------------------------- Linear


class LinearUnit(_WeightGatherMixin, LayerUnit):
    """``nn.Linear`` on per-sample input ``(*, in_features)``: ``J^T = I_L ⊗ W^T`` (shared)."""

    shared = True
    roles = ("weight", "bias")
    capabilities = UnitCapabilities(structured_operator=True)

    def __init__(self, index, module: nn.Linear, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        # the weight's shape, not ``in_features``/``out_features``: a weight given anew need not update them
        fo, fi = _effective(module, "weight").shape
        self.out_features = fo
        if len(in_shape) < 1 or in_shape[-1] != fi:
            raise ValueError(
                f"layer {index} (Linear): expected per-sample input (*, {fi}), got {tuple(in_shape)}")
        lead = _prod(in_shape[:-1])
        check_pattern_entries(index, "Linear", lead * fi * fo)
        drop = self._drop_mask(module, prune_zeros)
        i, j = np.divmod(np.arange(fi * fo, dtype=np.int64), fo)  # (i, j) row-major: CSR order of W^T
        keep = ~drop[j * fi + i]
        j, i = j[keep], i[keep]
        widx = j * fi + i
        l = np.arange(lead, dtype=np.int64)[:, None]
        rows = (l * fi + i[None, :]).reshape(-1)
        cols = (l * fo + j[None, :]).reshape(-1)
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        self.weight_gather = PerDevice.index(np.broadcast_to(widx[None, :], (lead, widx.size)).reshape(-1)[order])
        self.zero_weights = PerDevice.index(np.flatnonzero(drop))

    def run(self, x, tensors):
        if self.zero_weights.array.size:
            self._check_pruned_still_zero(tensors[0])
        return F.linear(x, tensors[0], tensors[1] if len(tensors) > 1 else None), x

    def apply_transposed(self, saved, tensors, g):
        w = tensors[0].detach()
        return torch.matmul(g.reshape(g.shape[0], -1, w.shape[0]), w).reshape(g.shape[0], -1)

    def chain_step(self, needed=None):
        if len(self.in_shape) != 1:
            return super().chain_step(needed)
        want_w = bool(needed) and bool(needed[0])
        has_b = len(self.roles) > 1
        want_b = bool(needed) and has_b and bool(needed[1])
        fo = self.out_features

        def step(saved, tensors, g):  # autograd's addmm backward: g W, g^T x, sum over the batch
            if g.dim() != 2:
                g = g.reshape(g.shape[0], fo)
            gi = g.mm(tensors[0])
            if not (want_w or want_b):
                return gi, None
            gw = g.t().mm(saved) if want_w else None
            if not has_b:
                return gi, [gw]
            return gi, [gw, g.sum(0) if want_b else None]

        return step

    def param_grads(self, saved, tensors, g_out, needed=None):
        x = saved
        needed = needed or [True] * len(self.roles)
        g = g_out.reshape(x.shape[:-1] + (self.out_features,))
        out: list[Optional[torch.Tensor]] = []
        for role, need in zip(self.roles, needed):
            if not need:
                out.append(None)
            elif role == "weight":
                # one GEMM over batch and leading dims, as autograd does
                out.append(g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])))
            else:
                out.append(g.reshape(-1, g.shape[-1]).sum(0))
        return out

    def batched_weight_grad_key(self):
        if len(self.in_shape) != 1 or not self.roles or self.roles[0] != "weight":
            return None
        return ("linear", tuple(self.parameters_for_roles()[0][0].shape))


# ----------------------------------------------------------------------------- convolutions


def _conv_taps(n_in: int, n_out: int, k: int, s: int, d: int, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One spatial axis of a convolution: every (input position, tap, output position) that meets,
    ``o = (i + pad - tap*d) / s`` integral and in range, sorted by input then output position."""
    i = np.arange(n_in, dtype=np.int64)[:, None]
    tap = np.arange(k - 1, -1, -1, dtype=np.int64)[None, :]  # descending taps: ascending outputs
    num = i + pad - tap * d
    valid = (num >= 0) & (num % s == 0) & (num < s * n_out)
    ii, tt = np.nonzero(valid)  # row-major: input ascending, then output ascending
    return ii.astype(np.int64), (k - 1 - tt).astype(np.int64), (num[ii, tt] // s).astype(np.int64)


def _conv_planes(s_in: Sequence[int], s_out: Sequence[int], k: Sequence[int], s: Sequence[int], d: Sequence[int],
                 pad_lo: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (input position, output position, tap) of one channel plane that meets, as flat indices
    ordered by (input position, output position): the product over the axes of :func:`_conv_taps`."""
    nd = len(s_in)
    axes = [_conv_taps(s_in[t], s_out[t], k[t], s[t], d[t], pad_lo[t]) for t in range(nd)]
    # spatial combinations: one triple per axis, ordered by (i_1..i_nd, o_1..o_nd)
    grids = np.meshgrid(*[np.arange(a[0].size, dtype=np.int64) for a in axes], indexing="ij")
    pick = [g.ravel() for g in grids]
    keys = [axes[t][2][pick[t]] for t in reversed(range(nd))] + [axes[t][0][pick[t]] for t in reversed(range(nd))]
    order = np.lexsort(keys) if keys and keys[0].size else np.zeros(0, dtype=np.int64)
    pick = [q[order] for q in pick]
    plane_in = _flat_index([axes[t][0][pick[t]] for t in range(nd)], s_in)
    plane_out = _flat_index([axes[t][2][pick[t]] for t in range(nd)], s_out)
    plane_tap = _flat_index([axes[t][1][pick[t]] for t in range(nd)], k)
    return plane_in, plane_out, plane_tap


def _conv_entries(cin: int, cout: int, groups: int, s_in: Sequence[int], s_out: Sequence[int], k: Sequence[int],
                  s: Sequence[int], d: Sequence[int], pad_lo: Sequence[int],
                  drop: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Structural entries of a convolution's ``J^T`` in CSR order: (input row, output column, flat
    weight index), each (nnz,) int64, pruned weights (``drop[w]``) left out.

    Built from the valid entries only: per spatial axis the (input, tap, output) triples that meet
    (:func:`_conv_taps`), their product over the axes grouped by input position, then repeated over
    the output channels of each input channel's group. Row ``(ci, i...)`` holds ``(co, o...)``
    ascending, so the entries come out in CSR order with no sort.
    """
    cin_g, cout_g = cin // groups, cout // groups
    plane_in, plane_out, plane_tap = _conv_planes(s_in, s_out, k, s, d, pad_lo)
    n_in, n_out, n_tap = _prod(s_in), _prod(s_out), _prod(k)
    # each input position's combinations, repeated over the group's output channels (channel outer)
    per_pos = np.bincount(plane_in, minlength=n_in).astype(np.int64)
    start = np.zeros(n_in, dtype=np.int64)
    np.cumsum(per_pos[:-1], out=start[1:])
    pos = np.repeat(np.arange(n_in, dtype=np.int64), per_pos * cout_g)
    local = np.arange(pos.size, dtype=np.int64) - np.repeat(start * cout_g, per_pos * cout_g)
    width = per_pos[pos]
    co_l = local // np.maximum(width, 1)
    comb = start[pos] + local % np.maximum(width, 1)
    # per input channel ci of group g, only scalar offsets change:
    #   row = ci*n_in + row_in, col = g*cout_g*n_out + col_base, w = (g*cout_g*cin_g + ci % cin_g)*n_tap + w_base
    row_in = plane_in[comb]
    col_base = co_l * n_out + plane_out[comb]
    w_base = co_l * (cin_g * n_tap) + plane_tap[comb]
    del pos, local, width, co_l, comb
    if drop.any():
        parts = []
        for ci in range(cin):
            g = ci // cin_g
            w = w_base + (g * cout_g * cin_g + ci % cin_g) * n_tap
            keep = ~drop[w]
            parts.append((row_in[keep] + ci * n_in, col_base[keep] + g * cout_g * n_out, w[keep]))
        return tuple(np.concatenate([q[t] for q in parts]) for t in range(3))  # type: ignore[return-value]
    m = row_in.size
    rows = np.empty(cin * m, dtype=np.int64)
    cols = np.empty(cin * m, dtype=np.int64)
    widx = np.empty(cin * m, dtype=np.int64)
    for ci in range(cin):
        g = ci // cin_g
        np.add(row_in, ci * n_in, out=rows[ci * m:(ci + 1) * m])
        np.add(col_base, g * cout_g * n_out, out=cols[ci * m:(ci + 1) * m])
        np.add(w_base, (g * cout_g * cin_g + ci % cin_g) * n_tap, out=widx[ci * m:(ci + 1) * m])
    return rows, cols, widx


class _ConvLike(_WeightGatherMixin, LayerUnit):
    """What a convolution and a transposed convolution share: zero padding, a per-sample input
    ``(C_in, L)`` or ``(C_in, H, W)``, shared values gathered from the weight, and a bias gradient
    summed over batch and positions."""

    shared = True
    roles = ("weight", "bias")
    one_d: type  # the 1-d module type of the family
    capabilities = UnitCapabilities(structured_operator=True, fused_param_grads=True)

    @abc.abstractmethod
    def _backward(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, mask: list[bool]):
        """Autograd's ``convolution_backward`` of the layer: ``(dl/dx, dl/dw, dl/db)`` as ``mask`` says."""

    def apply_transposed(self, saved, tensors, g):
        return self.apply_transposed_and_param_grads(saved, tensors, g, [False] * len(self.roles))[0]

    def apply_transposed_and_param_grads(self, saved, tensors, g, needed):
        """``J^T g`` and the parameter gradients for ``g = dl/dy`` from one ``convolution_backward`` (the
        input and weight gradients share its work, as autograd's conv backward does)."""
        gy = g.reshape((g.shape[0],) + self.out_shape)
        want_w = bool(needed[0]) if needed else False
        want_b = bool(needed[1]) if needed and len(self.roles) > 1 else False
        gi, gw, gb = self._backward(saved, tensors[0], gy, [True, want_w, want_b])
        params: list[Optional[torch.Tensor]] = [gw if want_w else None]
        if len(self.roles) > 1:
            params.append(gb if want_b else None)
        return gi.reshape(g.shape[0], -1), params

    def _geometry(self, index: int, module: nn.Module,
                  in_shape: tuple[int, ...]) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """``(spatial dims, kernel, stride, dilation)``, after checking the padding mode and the input's shape."""
        nd = 1 if isinstance(module, self.one_d) else 2
        self.nd = nd
        if module.padding_mode != "zeros":
            raise ValueError(
                f"layer {index} ({self.name}): padding_mode 'zeros' expected, got {module.padding_mode!r}")
        # channels and kernel from the weight, as ``F.conv`` takes them (a weight given anew need not update
        # ``in_channels``/``out_channels``/``kernel_size``): (C_out, C_in/g, *k), transposed (C_in, C_out/g, *k)
        w = _effective(module, "weight").shape
        a, b, k = w[0], w[1] * module.groups, tuple(w[2:])
        self.c_in, self.c_out = (a, b) if module.transposed else (b, a)
        if len(in_shape) != nd + 1 or in_shape[0] != self.c_in:
            raise ValueError(f"layer {index} ({self.name}): expected per-sample input ({self.c_in}, "
                             f"{'L' if nd == 1 else 'H, W'}), got {tuple(in_shape)}")
        # each output entry reads C_in/g k taps (a transposed one: each input entry feeds C_out/g k outputs)
        per = _prod(k) * (self.c_out if module.transposed else self.c_in) // module.groups
        check_pattern_entries(index, self.name, per * _prod(self.out_shape if not module.transposed else in_shape))
        return nd, k, _tuple(module.stride, nd), _tuple(module.dilation, nd)

    def _set_entries(self, rows: np.ndarray, cols: np.ndarray, widx: np.ndarray, drop: np.ndarray) -> None:
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        self.weight_gather = PerDevice.index(widx[order])
        self.zero_weights = PerDevice.index(np.flatnonzero(drop))

    def _bias_grad(self, g: torch.Tensor) -> torch.Tensor:
        return g.sum(dim=[0] + list(range(2, g.dim())))


class ConvUnit(_ConvLike):
    """``nn.Conv1d`` / ``nn.Conv2d`` (any stride, padding incl. ``'same'``, dilation, groups,
    bias), zero padding. ``J^T[in, out] = W[co, ci - g*Cin_g, k]`` where the tap ``k`` of output
    ``out`` reads input ``in``; values are shared."""

    one_d = nn.Conv1d

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd, k, s, d = self._geometry(index, module, in_shape)
        if isinstance(module.padding, str):
            if module.padding == "valid":
                pad_lo = (0,) * nd
            else:  # 'same': torch pads total = d*(k-1), the odd element on the high side
                pad_lo = tuple((dd * (kk - 1)) // 2 for dd, kk in zip(d, k))
            pad_hi = tuple(dd * (kk - 1) - pl if module.padding == "same" else 0
                           for dd, kk, pl in zip(d, k, pad_lo))
        else:
            pad_lo = _tuple(module.padding, nd)
            pad_hi = pad_lo
        self.stride, self.dilation, self.pad_lo, self.pad_hi, self.kernel = s, d, pad_lo, pad_hi, k
        self._conv = F.conv1d if nd == 1 else F.conv2d
        drop = self._drop_mask(module, prune_zeros)
        self._set_entries(*_conv_entries(self.c_in, self.c_out, module.groups, tuple(in_shape[1:]),
                                         tuple(out_shape[1:]), k, s, d, pad_lo, drop), drop)

    def run(self, x, tensors):
        if self.zero_weights.array.size:
            self._check_pruned_still_zero(tensors[0])
        m = self.module  # what its _conv_forward runs for zero padding (string padding included)
        return self._conv(x, tensors[0], tensors[1] if len(tensors) > 1 else None, m.stride, m.padding, m.dilation,
                          m.groups), x

    def _padded_input(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """``x`` and the symmetric padding to convolve it with (asymmetric 'same' padding made explicit)."""
        if self.pad_lo == self.pad_hi:
            return x, list(self.pad_lo)
        pads = []
        for lo, hi in zip(reversed(self.pad_lo), reversed(self.pad_hi)):
            pads += [lo, hi]
        return F.pad(x, pads), [0] * self.nd

    def _backward(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, mask: list[bool]):
        """``convolution_backward`` of this layer: ``(dl/dx, dl/dw, dl/db)`` where ``mask`` says (as
        autograd's conv backward, one call for all three); the input gradient cropped back to ``x``."""
        xin, pad = self._padded_input(x)  # asymmetric 'same' padding: pad explicitly, convolve unpadded
        gi, gw, gb = torch.ops.aten.convolution_backward(
            gy, xin, w.detach(), [self.out_shape[0]] if mask[2] else None, list(self.stride), pad,
            list(self.dilation), False, [0] * self.nd, self.module.groups, mask)
        if mask[0] and xin is not x:  # crop the explicit padding back off
            gi = gi[(slice(None), slice(None)) + tuple(slice(lo, lo + n) for lo, n in zip(self.pad_lo, x.shape[2:]))]
        return gi, gw, gb

    def chain_step(self, needed=None):
        if self.pad_lo != self.pad_hi:  # asymmetric 'same' padding: pad and crop (the general path)
            return super().chain_step(needed)
        want_w = bool(needed) and bool(needed[0])
        has_b = len(self.roles) > 1
        want_b = bool(needed) and has_b and bool(needed[1])
        args = (list(self.stride), list(self.pad_lo), list(self.dilation), False, [0] * self.nd, self.module.groups,
                [True, want_w, want_b])
        bias_sizes = [self.out_shape[0]] if want_b else None
        nd, out_shape = self.nd + 2, self.out_shape
        conv_backward = torch.ops.aten.convolution_backward

        def step(saved, tensors, g):  # one convolution_backward: input, weight and bias gradients
            if g.dim() != nd:
                g = g.reshape((g.shape[0],) + out_shape)
            gi, gw, gb = conv_backward(g, saved, tensors[0], bias_sizes, *args)
            if not (want_w or want_b):
                return gi, None
            return gi, ([gw, gb] if has_b else [gw])

        return step

    def param_grads(self, saved, tensors, g_out, needed=None):
        x = saved
        needed = list(needed or [True] * len(self.roles))
        g = g_out.reshape((x.shape[0],) + self.out_shape)
        out: list[Optional[torch.Tensor]] = [None] * len(self.roles)
        want_b = len(self.roles) > 1 and bool(needed[1])
        if needed[0]:  # weight and bias gradients from one call, as autograd's conv backward
            _, out[0], gb = self._backward(x, tensors[0], g, [False, True, want_b])
            if want_b:
                out[1] = gb
        elif want_b:
            out[1] = self._bias_grad(g)
        return out


class ConvTransposeUnit(_ConvLike):
    """``nn.ConvTranspose1d`` / ``nn.ConvTranspose2d`` (stride, padding, output_padding, dilation,
    groups, bias), zero padding. A transposed convolution is the adjoint of the convolution with
    the same weight from its output space to its input space, so its ``J^T`` is that convolution's
    ``J``: the convolution's entries with rows and columns swapped. Values are shared."""

    one_d = nn.ConvTranspose1d

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd, k, s, d = self._geometry(index, module, in_shape)
        p = _tuple(module.padding, nd)
        op = _tuple(module.output_padding, nd)
        self.stride, self.dilation, self.padding, self.output_padding = s, d, p, op
        drop = self._drop_mask(module, prune_zeros)
        # the adjoint convolution: (C_out, out spatial) -> (C_in, in spatial), weight (C_in, C_out/g, k)
        rows_c, cols_c, widx = _conv_entries(self.c_out, self.c_in, module.groups,
                                             tuple(out_shape[1:]), tuple(in_shape[1:]), k, s, d, p, drop)
        self._set_entries(cols_c, rows_c, widx, drop)

    def run(self, x, tensors):
        self._check_pruned_still_zero(tensors[0])
        b = tensors[1] if len(tensors) > 1 else None
        fn = F.conv_transpose1d if self.nd == 1 else F.conv_transpose2d
        m = self.module
        return fn(x, tensors[0], b, m.stride, m.padding, m.output_padding, m.groups, m.dilation), x

    def _backward(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, mask: list[bool]):
        """Autograd's ``convolution_backward`` of the transposed convolution: ``(dl/dx, dl/dw, dl/db)`` as
        ``mask`` says, from one call."""
        return torch.ops.aten.convolution_backward(
            gy, x, w.detach(), [self.out_shape[0]] if mask[2] else None, list(self.stride), list(self.padding),
            list(self.dilation), True, list(self.output_padding), self.module.groups, mask)

    def param_grads(self, saved, tensors, g_out, needed=None):
        x = saved
        needed = list(needed or [True] * len(self.roles))
        g = g_out.reshape((x.shape[0],) + self.out_shape)
        out: list[Optional[torch.Tensor]] = [None] * len(self.roles)
        if needed[0]:
            out[0] = self._backward(x, tensors[0], g, [False, True, False])[1]
        if len(self.roles) > 1 and needed[1]:
            out[1] = self._bias_grad(g)
        return out


# ----------------------------------------------------------------------------- separable resampling


def _axis_probes(module: nn.Module, s_in: tuple[int, ...]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The module's response (float64) to ones, ``(*s_out)``, and per axis ``t`` to a one-hot along
    ``t`` times ones along the other axes, ``(s_in[t], *s_out)``."""
    nd = len(s_in)
    with torch.no_grad():
        total = module(torch.ones((1, 1) + s_in, dtype=torch.float64))[0, 0].numpy()
        probes = []
        for t in range(nd):
            p = torch.ones((s_in[t], 1) + s_in, dtype=torch.float64)
            onehot = torch.eye(s_in[t], dtype=torch.float64).reshape((s_in[t], 1) + tuple(
                s_in[t] if u == t else 1 for u in range(nd)))
            probes.append(module(p * onehot)[:, 0].numpy())  # (k_t, *s_out)
    return total, probes


def _plane_entries(total: np.ndarray, probes: list[np.ndarray], s_in: tuple[int, ...],
                   s_out: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One channel plane's non-zero ``(input, output, value)`` entries from the axis probes:
    ``prod_t A_t[o_t, k_t]``, with ``A_t`` read off probe ``t`` divided by the other axes' sum."""
    nd = len(s_in)
    pairs = []  # per axis: the (k, o_t) pairs that can meet
    for t in range(nd):
        other = tuple(u + 1 for u in range(nd) if u != t)
        nz = np.abs(probes[t]).max(axis=other) != 0 if other else probes[t] != 0
        pairs.append(np.nonzero(nz))
    if nd == 1:
        k1, o1 = pairs[0]
        vals = probes[0][k1, o1]
        rin, rout = k1, o1
    else:
        (k1, o1), (k2, o2) = pairs
        a, b = np.meshgrid(np.arange(k1.size), np.arange(k2.size), indexing="ij")
        a, b = a.reshape(-1), b.reshape(-1)
        K1, O1, K2, O2 = k1[a], o1[a], k2[b], o2[b]
        tot = total[O1, O2]
        with np.errstate(divide="ignore", invalid="ignore"):
            vals = np.where(tot != 0, probes[0][K1, O1, O2] * probes[1][K2, O1, O2] / tot, 0.0)
        rin, rout = K1 * s_in[1] + K2, O1 * s_out[1] + O2
    keep = vals != 0
    return rin[keep], rout[keep], vals[keep]


#: the largest per-axis factor (output x input positions) the operator keeps dense
_AXIS_FACTOR_MAX = 1 << 22


def _axis_factors(rin: np.ndarray, rout: np.ndarray, vals: np.ndarray, s_in: tuple[int, ...],
                  s_out: tuple[int, ...]) -> Optional[list[np.ndarray]]:
    """Dense per-axis factors ``A_t`` ``(O_t, K_t)`` with ``plane[k, o] = prod_t A_t[o_t, k_t]``, read off the
    plane's entries (a Kronecker product: with ``(k_2*, o_2*)`` one entry, ``A_1 = plane[(., k_2*), (., o_2*)]``
    up to a factor that ``A_2`` takes), or ``None`` where a factor would exceed :data:`_AXIS_FACTOR_MAX` or the
    entries are not such a product (then the layer keeps its CSR values only)."""
    if any(o * k > _AXIS_FACTOR_MAX for o, k in zip(s_out, s_in)) or vals.size == 0:
        return None
    if len(s_in) == 1:
        a = np.zeros((s_out[0], s_in[0]))
        a[rout, rin] = vals
        return [a]
    k1, k2 = np.divmod(rin, s_in[1])
    o1, o2 = np.divmod(rout, s_out[1])
    a1, a2 = np.zeros((s_out[0], s_in[0])), np.zeros((s_out[1], s_in[1]))
    at = (k2 == k2[0]) & (o2 == o2[0])
    a1[o1[at], k1[at]] = vals[at]
    at = (k1 == k1[0]) & (o1 == o1[0])
    a2[o2[at], k2[at]] = vals[at] / a1[o1[0], k1[0]]
    if np.count_nonzero(a1) * np.count_nonzero(a2) != vals.size or not np.allclose(
            a1[o1, k1] * a2[o2, k2], vals, rtol=1e-12, atol=0.0):
        return None
    return [a1, a2]


class SeparableResampleUnit(LayerUnit):
    """Channel-wise linear maps that act on each spatial axis separately: ``nn.Upsample``
    (``nearest``, ``nearest-exact``, ``linear``, ``bilinear``, ``bicubic``, ``area``),
    ``nn.UpsamplingNearest2d`` / ``UpsamplingBilinear2d``, ``nn.AdaptiveAvgPool1d/2d``,
    ``nn.ZeroPad1d/2d``, ``nn.ReflectionPad1d/2d``, ``nn.ReplicationPad1d/2d``.

    ``J^T[(c, k...), (c, o...)] = prod_t A_t[o_t, k_t]``: shared values, the same for every
    channel. The per-axis factors are read off the module itself at plan time (float64 probes:
    a one-hot along one axis, ones along the others), so every option (``align_corners``,
    ``scale_factor`` rounding, negative padding, ...) comes out as torch computes it; the result
    is checked against the module on a random input before it is used. Exact zeros are left out.
    """

    shared = True
    capabilities = UnitCapabilities(structured_operator=True)  # where the map factors per axis (all but huge ones)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd = len(in_shape) - 1
        if nd not in (1, 2):
            raise ValueError(f"layer {index} ({self.name}): expected per-sample input (C, L) or (C, H, W), got "
                             f"{tuple(in_shape)}")
        c, s_in, s_out = in_shape[0], tuple(in_shape[1:]), tuple(out_shape[1:])
        if out_shape[0] != c:
            raise ValueError(f"layer {index} ({self.name}): channel count changed {c} -> {out_shape[0]}")
        rin, rout, vals = _plane_entries(*_axis_probes(module, s_in), s_in, s_out)
        n_in, n_out = _prod(s_in), _prod(s_out)
        ch = np.arange(c, dtype=np.int64)[:, None]
        rows = (ch * n_in + rin[None, :]).reshape(-1)
        cols = (ch * n_out + rout[None, :]).reshape(-1)
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        entry_values = np.array(np.broadcast_to(vals[None, :], (c, vals.size)).reshape(-1)[order])
        self._values = PerDevice(
            lambda dtype, device: torch.from_numpy(entry_values).to(device=device, dtype=dtype))
        # the separability the construction relies on, checked on the module itself
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn((1, 1) + s_in, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            want = module(probe).reshape(-1).numpy()
        plane = sp.csr_array((vals, (rin, rout)), shape=(n_in, n_out))
        got = plane.T @ probe.reshape(-1).numpy()
        if not np.allclose(got, want, rtol=1e-10, atol=1e-12):
            raise ValueError(f"layer {index} ({self.name}): the module is not a separable channel-wise linear map "
                             "with these options (got a mismatch of "
                             f"{float(np.abs(got - want).max()):.3g}); not supported")
        factors = _axis_factors(rin, rout, vals, s_in, s_out)
        if factors is None:  # no dense per-axis factors: the CSR values only
            self.capabilities = UnitCapabilities()
        # the operator: one small matrix product per axis, no gathers
        self._factors = PerDevice(lambda dtype, device: [torch.from_numpy(a).to(device=device, dtype=dtype)
                                                               for a in factors or ()])

    def run(self, x, tensors):
        return self.module(x), (x.dtype, x.device)

    def fill(self, saved, tensors):
        return self._values.get(*saved)

    def apply_transposed(self, saved, tensors, g):
        """``J^T g`` per channel plane as ``A_1^T G A_2`` (``G`` the ``(O_1, O_2)`` plane of ``g``; one product
        along a 1-d axis), with the per-axis factors of :func:`_axis_factors`."""
        factors = self._factors.get(g.dtype, g.device)
        b = g.shape[0]
        y = g.reshape((b,) + self.out_shape)
        y = torch.matmul(y, factors[-1])  # the last axis: (..., O_last) @ (O_last, K_last)
        if len(factors) == 2:
            y = torch.matmul(factors[0].t(), y)  # the first: (K_1, O_1) @ (..., O_1, K_2)
        return y.reshape(b, self.d_in)


# ----------------------------------------------------------------------------- Embedding


class EmbeddingUnit(LayerUnit):
    """``nn.Embedding`` on integer token ids ``(*L)`` -> ``(*L, D)``: a row of the weight per id.

    The ids are integers, so there is no input gradient: ``J^T`` with respect to them is empty (no
    entries; the operator gives zeros). The weight gradient is ATen's embedding backward (the one
    autograd calls: ``padding_idx`` rows get none, ``scale_grad_by_freq`` divides by the ids' counts
    in the batch). ``max_norm`` renormalizes rows in place in the forward, as the module does.
    ``sparse=True`` (a sparse weight gradient) is refused.
    """

    shared = True
    roles = ("weight",)
    integer_input = True
    capabilities = UnitCapabilities(structured_operator=True)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        if module.sparse:
            raise ValueError(f"layer {index} (Embedding): sparse=True (a sparse weight gradient) is not supported; "
                             "use sparse=False")
        self.pattern = sp.csr_array((self.d_in, self.d_out), dtype=np.float64)
        self._none = PerDevice(lambda dtype, device: torch.zeros(0, dtype=dtype, device=device))

    def run(self, x, tensors):
        m = self.module
        if x.is_floating_point() or x.is_complex():
            raise TypeError(f"layer {self.index} (Embedding): integer token ids expected, got {x.dtype}")
        y = F.embedding(x, tensors[0], m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, False)
        return y, x

    def fill(self, saved, tensors):
        return self._none.get(tensors[0].dtype, tensors[0].device)

    def apply_transposed(self, saved, tensors, g):
        return g.new_zeros((g.shape[0], self.d_in))

    def param_grads(self, saved, tensors, g_out, needed=None):
        if needed is not None and not needed[0]:
            return [None]
        w, m = tensors[0], self.module
        g = g_out.reshape(saved.shape + (w.shape[1],))
        pad = -1 if m.padding_idx is None else m.padding_idx
        return [torch.ops.aten.embedding_dense_backward(g, saved, w.shape[0], pad, m.scale_grad_by_freq)]


# ----------------------------------------------------------------------------- means and sums


class _Reduction(nn.Module):
    """A traced ``x.mean(dims)`` / ``x.sum(dims)`` over per-sample dims (``dims`` normalized, all >= 1)."""

    def __init__(self, kind: str, dims: tuple[int, ...], keepdim: bool) -> None:
        super().__init__()
        if kind not in ("mean", "sum"):
            raise ValueError(f"unknown reduction {kind!r}")
        self.kind, self.dims, self.keepdim = kind, tuple(dims), bool(keepdim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.mean if self.kind == "mean" else x.sum)(self.dims, keepdim=self.keepdim)

    def extra_repr(self) -> str:
        return f"{self.kind}, dims={self.dims}, keepdim={self.keepdim}"


class ReductionUnit(LayerUnit):
    """A mean or sum over per-sample dims (a transformer's mean over tokens, a global average pool
    written as ``x.mean((2, 3))``): each input entry feeds one output entry with weight ``1/n`` (mean)
    or 1 (sum). ``J^T`` has one entry per row (shared); its operator broadcasts ``g`` back over the
    reduced dims."""

    shared = True
    capabilities = UnitCapabilities(structured_operator=True)

    def __init__(self, index: int, module: _Reduction, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
        super().__init__(index, module, in_shape, out_shape)
        nd = len(self.in_shape) + 1
        if not module.dims or not all(1 <= d < nd for d in module.dims):
            raise ValueError(f"{module.kind} over dims {module.dims}: per-sample dims (>= 1) expected")
        kept = [s if d + 1 not in module.dims else 1 for d, s in enumerate(self.in_shape)]
        self._kept = tuple(kept)  # the output's shape with the reduced dims kept as 1
        n = _prod(self.in_shape) // max(1, _prod(kept))
        if _prod(kept) != self.d_out:
            raise ValueError(f"{module.kind}: output of {self.d_out} entries for kept shape {self._kept}")
        coords = np.indices(self.in_shape).reshape(len(self.in_shape), -1)
        coords[[d - 1 for d in module.dims]] = 0
        cols = np.ravel_multi_index(tuple(coords), self._kept) if coords.size else np.zeros(self.d_in, np.int64)
        rows = np.arange(self.d_in, dtype=np.int64)
        self.pattern, _ = coo_to_csr(rows, cols.astype(np.int64), (self.d_in, self.d_out))  # one entry per row
        self.scale = 1.0 / n if module.kind == "mean" else 1.0
        self._values = PerDevice(lambda dtype, device: torch.full((self.d_in,), self.scale, dtype=dtype,
                                                                        device=device))

    @property
    def name(self) -> str:
        return self.module.kind

    def run(self, x, tensors):
        return self.module(x), (x.dtype, x.device)

    def fill(self, saved, tensors):
        return self._values.get(*saved)

    def apply_transposed(self, saved, tensors, g):
        b = g.shape[0]
        gi = g.reshape((b,) + self._kept).expand((b,) + self.in_shape)
        return (gi * self.scale if self.scale != 1.0 else gi).reshape(b, self.d_in)
