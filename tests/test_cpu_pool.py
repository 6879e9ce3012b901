"""The compiled CPU max-pooling forward (:mod:`spscan.kernels.cpu.pool`): output and indices bit for
bit ATen's, over drawn shapes, windows, dtypes and NaN/inf/tied inputs; where it does not apply it
says so (``None``) and the layer runs ATen's kernel; through ``spscan.wrap`` the gradients stay
autograd's bit for bit."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import spscan
from spscan.kernels.cpu import chain as cpu_chain
from spscan.kernels.cpu import pool as cpu_pool

pytestmark = pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")


def _aten(x, k, s, p, d, ceil):
    return torch.ops.aten.max_pool2d_with_indices(x, k, s if s else [], p, d, ceil)


def _assert_same(got, want):
    (y, i), (yr, ir) = got, want
    assert y.shape == yr.shape and y.dtype == yr.dtype and i.dtype == ir.dtype == torch.int64
    assert torch.equal(i, ir)
    assert torch.equal(y.isnan(), yr.isnan())
    keep = ~yr.isnan()
    assert torch.equal(y[keep], yr[keep])


@st.composite
def _case(draw):
    k = draw(st.sampled_from([2, 3]))
    sh, sw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ph, pw = draw(st.integers(0, k // 2)), draw(st.integers(0, k // 2))
    ceil = draw(st.booleans())
    h, w = draw(st.integers(k, 13)), draw(st.integers(k, 13))
    n, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    stride = draw(st.sampled_from([None, (sh, sw)]))
    return (n, c, h, w), k, stride, (ph, pw), 1, ceil, dtype


@settings(max_examples=200)
@given(case=_case(), seed=st.integers(0, 2**16), ties=st.booleans(), specials=st.booleans())
def test_equals_aten(case, seed, ties, specials):
    """2x2 and 3x3 windows (stride or none, padding up to half the kernel, ceil mode: windows inside the
    plane and windows clipped by every edge), both dtypes; inputs with many ties (rounded values,
    zeros), NaN and +-inf: ATen's output and indices."""
    shape, k, s, p, d, ceil, dtype = case
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype)
    if ties:
        x = torch.round(x).clamp_min(0)  # a ReLU-like input: many windows of equal values
    if specials:
        flat = x.view(-1)
        picks = torch.randint(0, flat.numel(), (3,), generator=g)
        flat[picks[0]] = float("nan")
        flat[picks[1]] = float("inf")
        flat[picks[2]] = float("-inf")
    with mock.patch.object(cpu_pool, "MIN_NUMEL", 0):
        got = cpu_pool.max_pool2d_with_indices(x, k, s, p, d, ceil)
    assert got is not None
    _assert_same(got, _aten(x, k, s, p, d, ceil))


@settings(max_examples=60)
@given(n=st.integers(1, 3), c=st.integers(1, 3), h=st.integers(3, 13), w=st.integers(3, 13),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16),
       k=st.sampled_from([2, 3]), pad=st.integers(0, 1), ceil=st.booleans())
def test_windows_full_of_ties_nan_and_infinities(n, c, h, w, dtype, seed, k, pad, ceil):
    """Stride 2 (the common 2/2 and overlapping 3/2 pools) on inputs of small integers, many NaN and
    infinities, so that windows hold several NaN, several equal maxima or only -inf: the tree of picks
    reports ATen's position in each."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, c, h, w), generator=g).to(dtype)
    flat = x.view(-1)
    count = max(1, flat.numel() // 6)
    flat[torch.randint(0, flat.numel(), (count,), generator=g)] = float("nan")
    flat[torch.randint(0, flat.numel(), (count,), generator=g)] = float("-inf")
    flat[torch.randint(0, flat.numel(), (count // 2 + 1,), generator=g)] = float("inf")
    with mock.patch.object(cpu_pool, "MIN_NUMEL", 0):
        got = cpu_pool.max_pool2d_with_indices(x, k, 2, pad, 1, ceil)
    _assert_same(got, _aten(x, k, 2, pad, 1, ceil))


def test_windows_of_nan_and_minus_inf():
    """A window of only -inf reports its first in-bounds position; a window with several NaN the last
    NaN; ties the first maximum (row by row) — as ATen's loop."""
    x = torch.zeros(1, 1, 4, 4 * 40)
    x[0, 0, :2, :2] = float("-inf")
    x[0, 0, 0, 2] = float("nan")
    x[0, 0, 1, 3] = float("nan")
    x[0, 0, 2:, 4:6] = 1.0
    with mock.patch.object(cpu_pool, "MIN_NUMEL", 0):
        for args in ((2, None, 0, 1, False), (3, 2, 1, 1, True), (2, (1, 2), 1, 1, False), (3, 1, 0, 1, False)):
            _assert_same(cpu_pool.max_pool2d_with_indices(x, *args), _aten(x, *args))
        y, i = cpu_pool.max_pool2d_with_indices(x, 2, None, 0, 1, False)
    assert y[0, 0, 0, 0] == float("-inf") and i[0, 0, 0, 0] == 0
    assert y[0, 0, 0, 1].isnan() and i[0, 0, 0, 1] == 4 * 40 + 3  # the later NaN
    assert i[0, 0, 1, 2] == 2 * 160 + 4  # first of four equal maxima


def test_where_it_does_not_apply():
    """``None`` (the caller runs ATen) for small, non-contiguous, integer, half, 3-d, grad-requiring or
    empty inputs, for a padding torch refuses (its own error stays torch's), for windows other than
    2x2 and 3x3 without dilation, and with more torch
    threads than :data:`~spscan.kernels.cpu.pool.MAX_THREADS`."""
    big = torch.randn(2, 4, 64, 64)
    assert cpu_pool.max_pool2d_with_indices(big, 2, None, 0, 1, False) is not None
    for x in (torch.randn(1, 1, 8, 8), big.transpose(2, 3), big.to(torch.int32), big.half(), big[0],
              big.clone().requires_grad_(True), torch.randn(0, 4, 64, 64)):
        assert cpu_pool.max_pool2d_with_indices(x, 2, None, 0, 1, False) is None
    assert cpu_pool.max_pool2d_with_indices(big, 2, None, 2, 1, False) is None  # padding > kernel / 2
    for window in ((4, None, 0, 1), (5, 1, 2, 1), ((2, 3), None, 0, 1), (3, 2, 0, 2), (1, None, 0, 1)):
        assert cpu_pool.max_pool2d_with_indices(big, *window, False) is None  # ATen's loop is as fast
    threads = torch.get_num_threads()
    try:  # many threads: ATen's parallel kernel is the faster one
        for k, most in cpu_pool.MAX_THREADS.items():
            torch.set_num_threads(most)
            assert cpu_pool.max_pool2d_with_indices(big, k, 2, 0, 1, False) is not None
            torch.set_num_threads(most + 1)
            assert cpu_pool.max_pool2d_with_indices(big, k, 2, 0, 1, False) is None
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("pool", [nn.MaxPool2d(2), nn.MaxPool2d(3, 2), nn.MaxPool2d(3, 2, padding=1, ceil_mode=True)])
def test_wrapped_cnn_step_is_autograds_bit_for_bit(pool):
    """A CNN big enough for the compiled pool (float32, B = 16): forward output and every gradient equal
    autograd's bit for bit, through ``spscan.wrap`` (depth 0)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), pool, nn.Conv2d(8, 4, 3), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten())
    x = torch.randn(16, 3, 32, 32)
    net = spscan.wrap(model, x, levels=0)
    out = {}
    for side, m in (("autograd", model), ("spscan", net)):
        model.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        y = m(xx)
        (y * torch.linspace(-1, 1, y.shape[1])).sum().backward()
        out[side] = (y.detach(), xx.grad, {n: p.grad.clone() for n, p in model.named_parameters()})
    (ya, xa, pa), (ys, xs, ps) = out["autograd"], out["spscan"]
    assert torch.equal(ys, ya) and torch.equal(xs, xa)
    for n in pa:
        assert torch.equal(ps[n], pa[n]), n


@pytest.mark.parametrize("pool, family", [(nn.MaxPool2d(2), "MaxPoolUnit"), (nn.MaxPool2d(3, 2), "MaxPoolUnit"),
                                          (nn.MaxPool2d(3, 1, padding=1), "MaxPoolUnit"),
                                          (nn.MaxPool2d(4, 2), "MaxPoolUnit/window"),
                                          (nn.MaxPool2d(3, 2, dilation=2), "MaxPoolUnit/window"),
                                          (nn.MaxPool1d(2), "MaxPoolUnit/window")])
def test_cost_family_follows_the_compiled_windows(pool, family):
    """A pool is priced as the compiled forward's family exactly where that forward applies (2-d, 2x2 or
    3x3, no dilation); a 1-d pool runs ATen's forward."""
    shape = (4, 32) if isinstance(pool, nn.MaxPool1d) else (4, 16, 16)
    plan = spscan.plan(nn.Sequential(pool), torch.randn(2, *shape))
    assert plan.units[0].cost_family == family
    if isinstance(pool, nn.MaxPool2d):
        assert cpu_pool.compiled_window(pool.kernel_size, pool.dilation) == (family == "MaxPoolUnit")


def test_the_pool_bench_runs_and_checks_every_row():
    """``python -m bench.pool_forward``: one round per row at one thread, every pool of its table computed
    by the compiled forward and checked equal to ATen's (it raises where they differ)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "pool_forward.py"
    spec = importlib.util.spec_from_file_location("pool_forward_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rows = bench.run(rounds=1)
    finally:
        torch.set_num_threads(threads)
    assert len(rows) == 2 + len(bench.POOLS)
    assert not any("not applied" in r for r in rows)
