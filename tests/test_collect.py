"""``BoundPlan.run(collect=..., keep=...)``: chain gradients stacked feature-major into the caller's buffers
(written by the compiled CPU linear scan as it goes, copied after the run elsewhere) and results that hold
only the gradients kept; against the plain run and the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan
from spscan.runtime import Collect, StackedExtra
from spscan.kernels.cpu import chain as cpu_chain
from spscan.reference import reference_backward


def _chain(n: int, d: int, seed: int) -> list[sp.csr_array]:
    """``n`` square ``d x d`` patterns: dense, diagonal and banded ones (like a recurrent step's)."""
    rng = np.random.default_rng(seed)
    pats = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            m = (rng.random((d, d)) < 0.5) | np.eye(d, dtype=bool)
        elif kind == 1:
            m = np.eye(d, dtype=bool)
        else:
            m = np.eye(d, dtype=bool) | np.eye(d, k=1, dtype=bool)
        pats.append(sp.csr_array(m.astype(np.float64)))
    return pats


def _values(pats, batch, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, p.nnz, generator=g, dtype=torch.float64).to(dtype) for p in pats]


@pytest.mark.parametrize("levels", [0, 1])
@pytest.mark.parametrize("batch", [1, 16, 19])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_collect_equals_the_gradients_and_keep_drops_the_rest(levels, batch, dtype):
    n, d = 9, 7
    pats = _chain(n, d, batch)
    vals = _values(pats, batch, dtype, 1)
    grad = torch.randn(batch, d, dtype=torch.float64).to(dtype)
    plan = spscan.plan(pats, levels=levels)
    bound = plan.bind((False,) * n, (False,) * (n + 1))
    full = [g.clone() for g in bound.run(vals, grad).grads]
    ref = reference_backward(pats, vals, grad)
    if dtype == torch.float64:
        for f, r in zip(full, ref):
            torch.testing.assert_close(f, r, rtol=1e-10, atol=1e-12)
    every = range(1, n + 1, 2)  # odd positions up to the top (the run's input), increasing
    some = range(n - 1, -1, -3)  # decreasing, rows 2..5
    a = torch.full((d, len(every), batch), float("nan"), dtype=dtype)
    b = torch.full((3, len(some), batch), float("nan"), dtype=dtype)
    keep = np.zeros(n + 1, dtype=bool)
    keep[0] = True
    res = bound.run(vals, grad, keep=keep, collect=[Collect(every, slice(None), a), Collect(some, slice(2, 5), b)])
    for k, i in enumerate(every):
        assert torch.equal(a[:, k].t(), full[i]), i
    for k, i in enumerate(some):
        assert torch.equal(b[:, k].t(), full[i][:, 2:5]), i
    assert torch.equal(res[0], full[0])
    grads = res.grads
    assert grads[0] is not None and all(g is None for g in grads[1:])
    with pytest.raises(ValueError, match="not kept"):
        res[3]
    with pytest.raises(ValueError, match="not kept"):
        res.stacked(range(1, 3))
    # without keep every gradient is still there, and the collected ones agree
    res = bound.run(vals, grad, collect=[Collect(every, slice(None), a)])
    assert all(torch.equal(g, f) for g, f in zip(res.grads, full))


@pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")
def test_the_compiled_scan_writes_the_collected_rows_itself(monkeypatch):
    """On the compiled CPU linear scan the rows come from the kernel (no copy out of the vectors), and
    gradients nobody keeps are not written to the vectors at all."""
    n, d, batch = 6, 5, 16
    pats = _chain(n, d, 3)
    vals = _values(pats, batch, torch.float64, 2)
    grad = torch.randn(batch, d, dtype=torch.float64)
    bound = spscan.plan(pats, levels=0).bind((False,) * n, (False,) * (n + 1))
    full = [g.clone() for g in bound.run(vals, grad).grads]
    seen = []
    real = cpu_chain.run_chain

    def spy(*args, **kw):
        seen.append((kw.get("taps", ()), args[7].copy()))
        return real(*args, **kw)

    monkeypatch.setattr(cpu_chain, "run_chain", spy)
    a = torch.zeros(d, n, batch, dtype=torch.float64)
    keep = [True] + [False] * n
    res = bound.run(vals, grad, keep=keep, collect=[Collect(range(1, n + 1), slice(None), a)])
    (taps, out), = seen
    # every step's output only in the collected rows, but the last one's: dl/dx_0, kept
    assert len(taps) == 1 and (out[:-1] == -1).all() and out[-1] >= 0
    for k in range(n):
        assert torch.equal(a[:, k].t(), full[k + 1])
    assert torch.equal(res[0], full[0])


@pytest.mark.parametrize("levels", [0, 1])
@pytest.mark.parametrize("batch", [1, 16, 19])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("compiled", [
    pytest.param(True, marks=pytest.mark.skipif(not cpu_chain.available(), reason="numba (optional) not installed")),
    False])
def test_collect_with_an_operand_is_the_product_of_the_stacked_rows(monkeypatch, levels, batch, dtype, compiled):
    """``Collect(..., operand=Z)``: ``out = stacked rows @ Z^T`` over all steps and samples, whether the
    compiled linear scan reduces as it goes (one such request), or the engine stacks and multiplies
    (two requests, other backends, levels >= 1); other requests of the same run are unchanged."""
    if not compiled:
        monkeypatch.setattr(cpu_chain, "available", lambda: False)
    n, d = 40, 6
    pats = _chain(n, d, batch)
    vals = _values(pats, batch, dtype, 4)
    grad = torch.randn(batch, d, dtype=torch.float64).to(dtype)
    bound = spscan.plan(pats, levels=levels).bind((False,) * n, (False,) * (n + 1))
    full = [g.clone() for g in bound.run(vals, grad).grads]
    every = range(0, n, 2)  # not the run's input (position n)
    g = torch.Generator().manual_seed(batch)
    z = torch.randn(5, len(every), batch, generator=g, dtype=torch.float64).to(dtype)
    def check(got, rows, operand):
        # within a few roundings of the magnitudes summed (float32: sums of K * B products)
        a, b = rows.double().reshape(rows.shape[0], -1), operand.double().reshape(operand.shape[0], -1)
        rtol = 1e-12 if dtype == torch.float64 else 1e-5 * a.shape[1] ** 0.5
        assert ((got.double() - a @ b.t()).abs() <= rtol * (a.abs() @ b.abs().t()) + 1e-30).all()

    stacked = torch.stack([full[i][:, 1:5].t() for i in every], 1)  # (4, K, B)
    red = torch.full((4, 5), float("nan"), dtype=dtype)
    odd = range(1, n, 2)
    other = torch.zeros(d, len(odd), batch, dtype=dtype)
    res = bound.run(vals, grad, collect=[Collect(every, slice(1, 5), red, operand=z), Collect(odd, slice(None), other)])
    check(red, stacked, z)
    for k, i in enumerate(odd):
        assert torch.equal(other[:, k].t(), full[i])
    assert all(torch.equal(a, b) for a, b in zip(res.grads, full))
    # two reducing requests: the engine's GEMMs (the compiled scan reduces against one operand per run)
    red2 = torch.zeros(d, 5, dtype=dtype)
    z2 = z[:, : len(odd)].contiguous()
    bound.run(vals, grad, collect=[Collect(every, slice(1, 5), red, operand=z), Collect(odd, slice(None), red2,
                                                                                       operand=z2)])
    check(red, stacked, z)
    check(red2, torch.stack([full[i].t() for i in odd], 1), z2)


def test_collect_checks_its_requests():
    pats = _chain(4, 5, 0) + [sp.csr_array(np.ones((5, 3)))]
    vals = _values(pats, 2, torch.float64, 0)
    grad = torch.randn(2, 3, dtype=torch.float64)
    bound = spscan.plan(pats, levels=0).bind((False,) * 5, (False,) * 6)
    with pytest.raises(ValueError, match="one size"):
        bound.run(vals, grad, collect=[Collect(range(3, 6), slice(None), torch.zeros(5, 3, 2, dtype=torch.float64))])
    with pytest.raises(ValueError, match="contiguous \\(5, 2, 2\\)"):
        bound.run(vals, grad, collect=[Collect(range(1, 3), slice(None), torch.zeros(5, 2, 3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="step 1"):
        bound.run(vals, grad, collect=[Collect(range(1, 3), slice(0, 5, 2), torch.zeros(3, 2, 2, dtype=torch.float64))])
    with pytest.raises(ValueError, match="within"):
        bound.run(vals, grad, collect=[Collect(range(4, 7), slice(None), torch.zeros(5, 3, 2, dtype=torch.float64))])
    with pytest.raises(TypeError, match="Collect"):
        bound.run(vals, grad, collect=[(range(1, 3), slice(None), torch.zeros(5, 2, 2, dtype=torch.float64))])
    with pytest.raises(ValueError, match="keep: expected 6 flags"):
        bound.run(vals, grad, keep=[True])
    z = torch.zeros(4, 2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="operand must be a contiguous \\(C > 0, 2, 2\\)"):
        bound.run(vals, grad, collect=[Collect(range(1, 3), slice(None), torch.zeros(5, 4, dtype=torch.float64),
                                               operand=torch.zeros(4, 3, 2, dtype=torch.float64))])
    with pytest.raises(ValueError, match="operand"):
        bound.run(vals, grad, collect=[Collect(range(1, 3), slice(None), torch.zeros(5, 4, dtype=torch.float64),
                                               operand=z.float())])
    with pytest.raises(ValueError, match="out must be a contiguous \\(5, 4\\)"):
        bound.run(vals, grad, collect=[Collect(range(1, 3), slice(None), torch.zeros(5, 2, 2, dtype=torch.float64),
                                               operand=z)])


@pytest.mark.parametrize("levels", [0, 1])
@pytest.mark.parametrize("layout", ["contiguous", "feature_major", "batch_first"])
@pytest.mark.parametrize("compiled", [True, False])
def test_stacked_extra_is_read_where_it_lies(levels, layout, compiled, monkeypatch):
    """A ``StackedExtra`` covering some columns of each term (``row0``, ``size``), in any layout, gives the
    reference's gradients: read in place by the compiled CPU scan, loaded into the vectors elsewhere."""
    if not compiled:
        monkeypatch.setattr(cpu_chain, "available", lambda: False)
    n, d, batch, r0, r = 8, 6, 17, 2, 3
    pats = _chain(n, d, 7)
    vals = _values(pats, batch, torch.float64, 4)
    grad = torch.randn(batch, d, dtype=torch.float64)
    index = range(1, n, 2)
    K = len(index)
    g = torch.Generator().manual_seed(5)
    base = torch.randn(K, batch, r, generator=g, dtype=torch.float64)
    if layout == "contiguous":
        terms = base.clone()
    elif layout == "feature_major":  # (r, K, B) memory
        terms = base.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    else:  # (B, K, r) memory, as a batch-first module's output gradient viewed time-major
        terms = base.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(terms, base)
    ext = StackedExtra(terms, index, n + 1, row0=r0, size=d)
    full = [None] * (n + 1)
    for k, i in enumerate(index):
        full[i] = torch.zeros(batch, d, dtype=torch.float64)
        full[i][:, r0:r0 + r] = base[k]
        assert torch.equal(ext[i], full[i])
    ref = reference_backward(pats, vals, grad, full)
    bound = spscan.plan(pats, levels=levels).bind((False,) * n, [x is not None for x in full])
    fed = []
    real = cpu_chain.run_chain
    monkeypatch.setattr(cpu_chain, "run_chain", lambda *a, **kw: (fed.append(len(kw.get("feeds", ()))), real(*a, **kw)))
    got = bound.run(vals, grad, ext, check=False).grads
    for o, w in zip(got, ref):
        torch.testing.assert_close(o, w, rtol=1e-10, atol=1e-12)
    if levels == 0 and compiled and cpu_chain.available():
        assert fed == [1]  # the compiled loop read the terms in place
    # checked, it reads as the padded list
    got = bound.run(vals, grad, ext).grads
    for o, w in zip(got, ref):
        torch.testing.assert_close(o, w, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="must fit"):
        StackedExtra(terms, index, n + 1, row0=d - 1, size=d)
