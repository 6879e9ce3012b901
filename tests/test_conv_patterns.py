"""Conv patterns built from valid entries only equal the full-grid construction they replace.

``reference_conv_entries`` is the previous construction (enumerate every (input, output-channel,
tap) combination, then mask), kept here as the reference: pattern and weight gather must match
it exactly on a grid of conv configurations.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn as nn

from spscan.layers import ConvUnit, _conv_entries, _flat_index, _prod, coo_to_csr


def reference_conv_entries(cin, cout, groups, s_in, s_out, k, s, d, pad_lo, drop):
    """Previous construction: the full index grid (ci, i..., co, taps reversed), masked."""
    nd = len(s_in)
    cin_g, cout_g = cin // groups, cout // groups
    nax = 2 + 2 * nd

    def ax(values: np.ndarray, pos: int) -> np.ndarray:
        shape = [1] * nax
        shape[pos] = values.size
        return values.astype(np.int64).reshape(shape)

    per_ci = _prod(s_in) * cout_g * _prod(k)
    chunk = max(1, (1 << 22) // max(1, per_ci))
    parts_r, parts_c, parts_w = [], [], []
    for ci0 in range(0, cin, chunk):
        ci = ax(np.arange(ci0, min(cin, ci0 + chunk)), 0)
        i = [ax(np.arange(s_in[t]), 1 + t) for t in range(nd)]
        co = (ci // cin_g) * cout_g + ax(np.arange(cout_g), 1 + nd)
        kk = [ax(np.arange(k[t] - 1, -1, -1), 2 + nd + t) for t in range(nd)]
        full = np.broadcast(ci, *i, co, *kk).shape
        valid = np.ones(full, dtype=bool)
        o = []
        for t in range(nd):
            num = i[t] + pad_lo[t] - kk[t] * d[t]
            valid &= (num >= 0) & (num % s[t] == 0) & (num < s[t] * s_out[t])
            o.append(num // s[t])
        widx = np.broadcast_to(_flat_index([co, ci % cin_g, *kk], [cout, cin_g, *k]), full)
        valid &= ~drop[widx]
        parts_r.append(np.broadcast_to(_flat_index([ci, *i], [cin, *s_in]), full)[valid])
        parts_c.append(np.broadcast_to(_flat_index([co, *o], [cout, *s_out]), full)[valid])
        parts_w.append(widx[valid])
    return np.concatenate(parts_r), np.concatenate(parts_c), np.concatenate(parts_w)


def _unit(module: nn.Module, x_shape: tuple[int, ...]) -> ConvUnit:
    with torch.no_grad():
        out = module(torch.zeros((1,) + x_shape, dtype=module.weight.dtype))
    return ConvUnit(0, module, x_shape, tuple(out.shape[1:]))


def _check(module: nn.Module, x_shape: tuple[int, ...], drop_seed=None) -> ConvUnit:
    u = _unit(module, x_shape)
    drop = np.zeros(module.weight.numel(), dtype=bool)
    if drop_seed is not None:
        drop = np.random.default_rng(drop_seed).random(drop.size) < 0.4
    args = (module.in_channels, module.out_channels, module.groups, x_shape[1:], u.out_shape[1:], u.kernel,
            u.stride, u.dilation, u.pad_lo, drop)
    got = _conv_entries(*args)
    want = reference_conv_entries(*args)
    for g, w in zip(got, want):
        assert g.dtype == np.int64 and np.array_equal(g, w)
    # and the unit itself: the same canonical pattern and weight gather as the reference's
    if drop_seed is None:
        pattern, order = coo_to_csr(want[0], want[1], (u.d_in, u.d_out))
        assert isinstance(order, slice), "the reference enumerates in CSR order"
        assert np.array_equal(u.pattern.indptr, pattern.indptr)
        assert np.array_equal(u.pattern.indices, pattern.indices)
        assert np.array_equal(u.weight_gather.array, want[2])
    return u


CONV2D = list(itertools.product(
    [(1, 1), (4, 4), (3, 1)],  # stride
    [0, 1, (2, 0), "same", "valid"],  # padding
    [(1, 1), (2, 1)],  # dilation
    [1, 2],  # groups
    [(3, 3), (5, 2)],  # kernel
))


@pytest.mark.parametrize("stride,pad,dil,groups,kernel", CONV2D)
def test_conv2d_entries_equal_the_full_grid(stride, pad, dil, groups, kernel):
    if pad == "same" and stride != (1, 1):
        pytest.skip("torch refuses padding='same' with stride")
    h, w = 11, 8  # odd and even sizes
    need = [dil[t] * (kernel[t] - 1) + 1 for t in range(2)]
    pp = (0, 0) if isinstance(pad, str) else (pad if isinstance(pad, tuple) else (pad, pad))
    if need[0] > h + 2 * pp[0] or need[1] > w + 2 * pp[1]:
        pytest.skip("kernel larger than the padded input")
    m = nn.Conv2d(2 * groups, 3 * groups, kernel, stride=stride, padding=pad, dilation=dil, groups=groups).double()
    _check(m, (2 * groups, h, w))
    _check(m, (2 * groups, h, w), drop_seed=1)


@pytest.mark.parametrize("stride,pad,dil,groups,kernel,length", [
    (1, 0, 1, 1, 3, 9), (2, 1, 1, 1, 4, 10), (3, 2, 2, 2, 3, 13), (1, "same", 3, 1, 4, 7),
    (4, 0, 1, 3, 11, 31), (5, 4, 2, 1, 2, 6), (1, "valid", 1, 2, 1, 1),
])
def test_conv1d_entries_equal_the_full_grid(stride, pad, dil, groups, kernel, length):
    m = nn.Conv1d(groups, 2 * groups, kernel, stride=stride, padding=pad, dilation=dil, groups=groups).double()
    _check(m, (groups, length))
    _check(m, (groups, length), drop_seed=2)


def test_alexnet_like_stride4_conv():
    """A stride-4 11x11 conv (AlexNet's first layer, on a 63x63 input): about 1/16 of the grid is valid."""
    m = nn.Conv2d(3, 8, 11, stride=4, padding=2)
    u = _check(m, (3, 63, 63))
    assert u.pattern.nnz == 3 * 8 * sum(int(np.count_nonzero(row)) for row in _valid_taps_2d(u))


def _valid_taps_2d(u: ConvUnit):
    """Per input position, which of the 11x11 taps reach an output (independent count per axis)."""
    out = []
    for i in range(63):
        for j in range(63):
            hits = []
            for a in range(11):
                for b in range(11):
                    ni, nj = i + 2 - a, j + 2 - b
                    hits.append(ni >= 0 and nj >= 0 and ni % 4 == 0 and nj % 4 == 0
                                and ni // 4 < u.out_shape[1] and nj // 4 < u.out_shape[2])
            out.append(np.array(hits))
    return out
