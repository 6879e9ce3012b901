"""Core engine: planned scan == sequential float64 backprop, for every depth and input kind."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn
from hypothesis import given, settings
from hypothesis import strategies as st

import spscan
from spscan.kernels import torch_ops
from spscan.planner.program import LinearRun
from spscan.planner.schedule import max_levels
from spscan.reference import reference_backward

from strategies import chain


def make_values(patterns, batch, dtype, shared_mask, seed=0):
    g = torch.Generator().manual_seed(seed)
    vals = []
    for p, shared in zip(patterns, shared_mask):
        shape = (p.nnz,) if shared else (batch, p.nnz)
        vals.append(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype))
    return vals


def rel_err(got, ref):
    scale = max(ref.abs().max().item(), 1e-300)
    return (got.double() - ref).abs().max().item() / scale if ref.numel() else 0.0


def check_chain(patterns, batch, dtype, shared_mask, levels, with_extra, seed):
    n = len(patterns)
    vals = make_values(patterns, batch, dtype, shared_mask, seed)
    g = torch.Generator().manual_seed(seed + 1)
    dims = [p.shape[0] for p in patterns] + [patterns[-1].shape[1]]
    grad = torch.randn(batch, dims[n], generator=g, dtype=torch.float64).to(dtype)
    extra = None
    if with_extra:
        extra = [torch.randn(batch, dims[i], generator=g, dtype=torch.float64).to(dtype) if i % 2 == 0 else None
                 for i in range(n + 1)]
    ref = reference_backward(patterns, vals, grad, extra)
    plan = spscan.plan(patterns, levels=levels)
    out = spscan.backward(plan, vals, grad, extra)
    assert len(out) == n + 1
    for i, (o, r) in enumerate(zip(out, ref)):
        assert o.shape == (batch, dims[i]) and o.dtype == dtype
        if dtype == torch.float64:
            assert rel_err(o, r) <= 1e-10, (i, levels)
    if dtype == torch.float32:
        # spscan's float32 error must stay within 2x that of float32 sequential backprop
        seq = [t.float() for t in _seq_float32(patterns, vals, grad, extra)]
        for i, (o, s, r) in enumerate(zip(out, seq, ref)):
            bound = 2 * (s.double() - r).abs().max().item() + 1e-6 * max(r.abs().max().item(), 1.0)
            assert (o.double() - r).abs().max().item() <= bound, (i, levels)
    return out


def _seq_float32(patterns, vals, grad, extra):
    """Sequential backprop in float32 with torch sparse ops (the float32 error yardstick)."""
    n = len(patterns)
    g = grad.clone()
    if extra is not None and extra[n] is not None:
        g = g + extra[n]
    out = [None] * (n + 1)
    out[n] = g
    for i in range(n, 0, -1):
        p = patterns[i - 1]
        v = vals[i - 1]
        rows = torch.as_tensor(np.repeat(np.arange(p.shape[0]), np.diff(p.indptr)))
        cols = torch.as_tensor(p.indices.astype(np.int64))
        vb = v.expand(g.shape[0], -1) if v.dim() == 1 else v
        nxt = torch.zeros(g.shape[0], p.shape[0], dtype=g.dtype)
        for b in range(g.shape[0]):
            dense = torch.zeros(p.shape, dtype=g.dtype)
            dense[rows, cols] = vb[b]
            nxt[b] = dense @ g[b]
        g = nxt
        if extra is not None and extra[i - 1] is not None:
            g = g + extra[i - 1]
        out[i - 1] = g
    return out


@settings(max_examples=200)
@given(
    patterns=chain(),
    batch=st.integers(1, 8),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    levels=st.sampled_from(["auto", "full", 0, 1, 2, 3]),
    with_extra=st.booleans(),
    data=st.data(),
)
def test_matches_reference(patterns, batch, dtype, levels, with_extra, data):
    shared = data.draw(st.lists(st.booleans(), min_size=len(patterns), max_size=len(patterns)))
    check_chain(patterns, batch, dtype, shared, levels, with_extra, seed=data.draw(st.integers(0, 1000)))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 9, 31, 100, 129])
@pytest.mark.parametrize("levels", ["full", 0, 2, "auto"])
def test_long_chains(n, levels):
    rng = np.random.default_rng(n)
    dims = rng.integers(1, 6, n + 1)
    pats = []
    for i in range(n):
        mask = rng.random((dims[i], dims[i + 1])) < 0.5
        pats.append(sp.csr_array(mask.astype(float)))
    check_chain(pats, 3, torch.float64, [i % 3 == 0 for i in range(n)], levels, with_extra=(n % 2 == 1), seed=n)


def test_every_depth_same_gradients_dense_and_sparse():
    n = 20
    pats = [sp.csr_array(np.ones((5, 5))) if i % 4 == 0 else sp.csr_array(np.eye(5) + np.eye(5, k=1))
            for i in range(n)]
    vals = make_values(pats, 4, torch.float64, [False] * n)
    grad = torch.randn(4, 5, dtype=torch.float64)
    ref = reference_backward(pats, vals, grad)
    for k in range(max_levels(n) + 1):
        out = spscan.backward(spscan.plan(pats, levels=k), vals, grad)
        assert max(rel_err(o, r) for o, r in zip(out, ref)) <= 1e-12


def test_one_by_one_and_n_equals_one():
    p = sp.csr_array(np.ones((1, 1)))
    plan = spscan.plan([p])
    assert plan.levels == 0 and plan.n == 1
    out = spscan.backward(plan, [torch.tensor([3.0], dtype=torch.float64)], torch.tensor([[2.0]], dtype=torch.float64))
    assert out[0].item() == 6.0 and out[1].item() == 2.0


def test_empty_pattern_gives_zero_gradients():
    pats = [sp.csr_array(np.ones((3, 4))), sp.csr_array((4, 2)), sp.csr_array(np.ones((2, 2)))]
    vals = make_values(pats, 2, torch.float64, [False, False, True])
    out = spscan.backward(spscan.plan(pats, levels="full"), vals, torch.ones(2, 2, dtype=torch.float64))
    assert torch.all(out[0] == 0) and torch.all(out[1] == 0)


def test_bitwise_deterministic_and_inputs_untouched():
    rng = np.random.default_rng(3)
    pats = [sp.csr_array((rng.random((6, 6)) < 0.4).astype(float)) for _ in range(13)]
    vals = make_values(pats, 5, torch.float32, [i % 2 == 0 for i in range(13)])
    grad = torch.randn(5, 6)
    extra = [torch.randn(5, 6) for _ in range(14)]
    before = [v.clone() for v in vals] + [grad.clone()] + [e.clone() for e in extra]
    plan = spscan.plan(pats, levels=2)
    a = spscan.backward(plan, vals, grad, extra)
    b = spscan.backward(plan, vals, grad, extra)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for x, y in zip(before, vals + [grad] + extra):
        assert torch.equal(x, y)


def test_batch_size_changes_between_calls():
    rng = np.random.default_rng(4)
    pats = [sp.csr_array((rng.random((4, 4)) < 0.6).astype(float)) for _ in range(9)]
    plan = spscan.plan(pats, levels="auto")
    for batch in (1, 7, 2, 16):
        vals = make_values(pats, batch, torch.float64, [False] * 9, seed=batch)
        grad = torch.randn(batch, 4, dtype=torch.float64)
        ref = reference_backward(pats, vals, grad)
        out = spscan.backward(plan, vals, grad)
        assert max(rel_err(o, r) for o, r in zip(out, ref)) <= 1e-12


def test_stacked_values_and_non_contiguous_inputs():
    n, h, batch = 12, 4, 3
    w = sp.csr_array(np.ones((h, h)))
    vals = torch.randn(batch, n, h * h, dtype=torch.float64).transpose(0, 1)  # non-contiguous (n, B, nnz)
    grad = torch.randn(h, batch, dtype=torch.float64).t()  # non-contiguous (B, d)
    ref = reference_backward([w] * n, list(vals), grad)
    plan = spscan.plan([w] * n, levels="full")
    for v in (vals, list(vals), [t[:, ::1] for t in vals]):
        out = spscan.backward(plan, v, grad)
        assert max(rel_err(o, r) for o, r in zip(out, ref)) <= 1e-12


def test_torch_csr_patterns_accepted():
    dense = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    p_t = dense.to_sparse_csr()
    p_s = sp.csr_array(dense.numpy())
    plan = spscan.plan([p_t, p_s.T.tocsr()])
    assert np.array_equal(plan.patterns[0].indptr, p_s.indptr)
    assert np.array_equal(plan.patterns[0].indices, p_s.indices)
    assert plan.patterns[1].shape == (3, 2)


def test_summary_and_memory():
    rng = np.random.default_rng(5)
    pats = [sp.csr_array((rng.random((8, 8)) < 0.3).astype(float)) for _ in range(16)]
    plan = spscan.plan(pats, levels=2)
    text = plan.summary()
    for word in ("up 0", "up 1", "linear scan", "down 0", "total", "critical-path FLOPs", "memory", "batch 16"):
        assert word in text
    verbose = plan.summary(verbose=True)
    for word in ("up0", "up1", "mid", "down0", "total"):
        assert word in verbose
    for word in ():
        assert word in text
    mem = plan.memory()
    assert mem.backward_peak(8) == 8 * mem.backward_peak(1) > 0


def test_max_memory_lowers_depth_or_refuses():
    n = 64
    pats = [sp.csr_array(np.ones((16, 16)))] * n
    free = spscan.plan(pats, levels="full")
    need_full = free.memory().total(16)
    lin = spscan.plan(pats, levels=0).memory().total(16)
    assert lin < need_full
    limited = spscan.plan(pats, levels="auto", max_memory=(lin + need_full) // 2)
    assert limited.memory().total(16) <= (lin + need_full) // 2
    with pytest.raises(ValueError, match="max_memory"):
        spscan.plan(pats, levels="full", max_memory=(lin + need_full) // 2)
    with pytest.raises(ValueError, match="even the linear scan"):
        spscan.plan(pats, levels="auto", max_memory=1000)


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(6)
    pats = [sp.csr_array((rng.random((5, 5)) < 0.5).astype(float)) for _ in range(11)] + \
           [sp.csr_array(np.ones((5, 3)))]
    plan = spscan.plan(pats, levels=2, dtype=torch.float64)
    path = tmp_path / "plan.npz"
    plan.save(path)
    loaded = spscan.load_plan(path)
    assert loaded.levels == plan.levels and loaded.dtype == torch.float64 and loaded.backend == plan.backend
    for a, b in zip(loaded.patterns, plan.patterns):
        assert a.shape == b.shape and np.array_equal(a.indices, b.indices) and np.array_equal(a.indptr, b.indptr)
    vals = make_values(pats, 3, torch.float64, [False] * 12)
    grad = torch.randn(3, 3, dtype=torch.float64)
    for x, y in zip(spscan.backward(plan, vals, grad), spscan.backward(loaded, vals, grad)):
        assert torch.equal(x, y)
    assert loaded.summary().splitlines()[1:] == plan.summary().splitlines()[1:]


def test_auto_prefers_linear_or_deeper_consistently():
    """The chosen depth minimizes the plan's own cost estimate among the candidates it explored."""
    pats = [sp.csr_array(np.ones((20, 20)))] * 300
    plan = spscan.plan(pats)
    cands = plan.candidates
    assert plan.levels == min(cands, key=cands.get)


def _not_quite_diagonal(d: int) -> sp.csr_array:
    """nnz == d and column indices 0..d-1, but not one entry per row (row 0 holds two)."""
    indptr = np.array([0, 2] + list(range(2, d + 1)), dtype=np.int64)[: d + 1]
    indptr[-1] = d
    return sp.csr_array((np.ones(d), np.arange(d), indptr), shape=(d, d))


@pytest.fixture(params=["numpy", "torch"])
def cpu_chain(request, monkeypatch):
    """Both CPU loops of the linear-scan middle: NumPy (small steps) and eager torch (large steps)."""
    if request.param == "torch":
        monkeypatch.setattr(torch_ops, "NUMPY_RUN_MAX_WORK", 0)
    return request.param


def _chain_loops(plan, batch):
    """Which CPU loop each middle chain of the plan's linear-scan program takes at this batch."""
    program = plan.bind((False,) * plan.n, (False,) * (plan.n + 1)).program
    vectors = torch.empty(batch, 1)
    return {torch_ops.uses_numpy(torch_ops._run_plan(op), vectors)
            for st in program.steps for op in st.ops if isinstance(op, LinearRun)}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_extra", [False, True])
def test_middle_chain_kinds_every_depth(with_extra, dtype, cpu_chain):
    """Dense, diagonal, near-diagonal and sparse steps, shared and per sample, through the fused middle."""
    h = 4
    kinds = [sp.csr_array(np.ones((h, h))), sp.csr_array(sp.eye(h)), _not_quite_diagonal(h),
             sp.csr_array(np.triu(np.ones((h, h))))]
    rng = np.random.default_rng(11)
    n = 37
    pats = [kinds[int(k)] for k in rng.integers(0, 4, n)]
    shared = [bool(s) for s in rng.random(n) < 0.4]
    assert _chain_loops(spscan.plan(pats, levels=0), 3) == {cpu_chain == "numpy"}
    for k in range(max_levels(n) + 1):
        out = check_chain(pats, 3, dtype, shared, k, with_extra, seed=k)
        assert len(out) == n + 1


def test_middle_chain_reads_values_that_require_grad_and_propagates_inf(cpu_chain):
    """Caller tensors that require grad are read, not refused; inf/NaN propagate without warnings."""
    h, n, batch = 3, 12, 2
    pats = [sp.csr_array(np.ones((h, h))), sp.csr_array(sp.eye(h))] * (n // 2)
    vals = make_values(pats, batch, torch.float64, [True, False] * (n // 2))
    vals = [v.requires_grad_() for v in vals]
    grad = torch.randn(batch, h, dtype=torch.float64)
    ref = reference_backward(pats, [v.detach() for v in vals], grad)
    with pytest.raises(ValueError, match="torch.no_grad"):  # results would be detached without a word
        spscan.backward(spscan.plan(pats, levels=0), vals, grad)
    with torch.no_grad():
        out = spscan.backward(spscan.plan(pats, levels=0), vals, grad)
    assert max(rel_err(o, r) for o, r in zip(out, ref)) <= 1e-12
    bad = [v.detach().clone() for v in vals]
    bad[-1][0, 0] = float("inf")
    bad[-3].fill_(1e308)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = spscan.backward(spscan.plan(pats, levels=0), bad, grad)
    assert not torch.isfinite(out[0][0]).all() and torch.isfinite(out[-1]).all()


def test_factored_recurrent_chain_stacked_and_list():
    """The factored RNN layout (shared W^T, per-sample diagonal) and a stacked dense chain."""
    h, t_len, batch = 5, 40, 3
    w, d = sp.csr_array(np.ones((h, h))), sp.csr_array(sp.eye(h))
    pats = [w, d] * t_len
    wv = torch.randn(h * h, dtype=torch.float64)
    vals = []
    for _ in range(t_len):
        vals += [wv, torch.rand(batch, h, dtype=torch.float64)]
    grad = torch.randn(batch, h, dtype=torch.float64)
    extra = [torch.randn(batch, h, dtype=torch.float64) for _ in range(2 * t_len + 1)]
    ref = reference_backward(pats, vals, grad, extra)
    for levels in (0, 1, "auto"):
        out = spscan.backward(spscan.plan(pats, levels=levels), vals, grad, extra)
        assert max(rel_err(o, r) for o, r in zip(out, ref)) <= 1e-12
    stacked = torch.randn(t_len, batch, h * h, dtype=torch.float64)
    ref = reference_backward([w] * t_len, list(stacked), grad)
    plan = spscan.plan([w] * t_len, levels=0)
    for _ in range(3):  # temporaries made per layer must not be confused across steps
        out = spscan.backward(plan, stacked, grad)
        assert max(rel_err(o, r) for o, r in zip(out, ref)) <= 1e-12


def test_values_buffer_in_place():
    h, n, batch = 3, 25, 2
    w = sp.csr_array(np.ones((h, h)))
    plan = spscan.plan([w] * n, levels=0)
    buf = plan.values_buffer(batch, dtype=torch.float64)
    vals = torch.randn(n, batch, h * h, dtype=torch.float64)
    buf.stacked.copy_(vals)
    grad = torch.randn(batch, h, dtype=torch.float64)
    ref = reference_backward([w] * n, list(vals), grad)
    for v in (buf, buf.stacked):
        out = spscan.backward(plan, v, grad)
        assert max(rel_err(o, r) for o, r in zip(out, ref)) <= 1e-12
    assert torch.equal(buf.stacked, vals)  # inputs are never modified


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_periodic_and_extra_buffers_in_place(backend, monkeypatch):
    """A periodic binding's values and its affine terms written in place (BoundPlan.periodic_buffer, extra_buffer):
    the run copies nothing in and gives what the copied inputs give; a buffer used after the arenas changed, or
    with a run that does not keep the working vectors, is copied in and still right."""
    import spscan.runtime.bound as bound_mod
    from spscan.recurrent.cells import recurrent_patterns
    from spscan.runtime import PeriodicValues, StackedExtra

    T, H, B = 20, 3, 2
    pats = recurrent_patterns(nn.RNN(1, H), T, "factored")
    plan = spscan.plan(pats, levels=0, backend=backend)
    has_extra = [i % 2 == 0 and i < 2 * T for i in range(2 * T + 1)]
    bound = plan.bind([True, False] * T, has_extra, period=2)
    w = torch.randn(H * H, dtype=torch.float64)
    d = torch.rand(T, B, H, dtype=torch.float64)
    r = torch.randn(T, B, H, dtype=torch.float64)
    g = torch.randn(B, H, dtype=torch.float64)
    taps = range(0, 2 * T, 2)
    want = bound.run(PeriodicValues([w, d], T), g, StackedExtra(r, taps, 2 * T + 1), scratch=True).stacked(taps,
                                                                                                            copy=True)
    values, extra = bound.periodic_buffer(B, torch.float64), bound.extra_buffer(B, torch.float64)
    assert [tuple(e.shape) for e in values.elements] == [(H * H,), (T, B, H)] and extra.terms.shape == (T, B, H)
    loads = []
    monkeypatch.setattr(bound_mod, "_load_periodic", lambda *a, **k: loads.append("values"))
    monkeypatch.setattr(bound_mod, "load_feeds", lambda *a, **k: loads.append("extra"))
    monkeypatch.setattr(bound_mod, "Feed", lambda *a, **k: loads.append("feed"))
    for check in (False, True):
        values.elements[0].copy_(w)
        values.elements[1].copy_(d)
        extra.terms.copy_(r)
        got = bound.run(values, g, extra, scratch=True, check=check).stacked(taps)
        assert torch.allclose(got, want, rtol=1e-13, atol=1e-15) and not loads
    monkeypatch.undo()
    extra.terms.copy_(r)
    got = bound.run(values, g, extra, scratch=False).stacked(taps)  # a fresh result buffer: the terms copied in
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-15)
    bound.run(PeriodicValues([w, d[:, :1]], T), g[:1], StackedExtra(r[:, :1], taps, 2 * T + 1))  # new arenas
    values.elements[1].copy_(d)
    extra.terms.copy_(r)
    got = bound.run(values, g, extra, scratch=True).stacked(taps)  # stale views: read as ordinary inputs
    assert torch.allclose(got, want, rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="not periodic"):
        plan.bind([True, False] * T, has_extra).periodic_buffer(B, torch.float64)
    uneven = [i in (0, 1, 7) for i in range(2 * T + 1)]
    with pytest.raises(ValueError, match="evenly spaced"):
        plan.bind([True, False] * T, uneven, period=2).extra_buffer(B, torch.float64)


def test_chain_output_period_detection():
    """The middle chain copies its outputs out once per position of a repeating size pattern."""
    period = torch_ops._out_period
    rows = np.array([5, 3, 2] * 4)
    out = 7 + np.concatenate([[0], np.cumsum(rows)[:-1]])
    assert period(rows, out) == 3
    assert period(np.full(6, 4), 2 + 4 * np.arange(6)) == 1
    assert period(np.array([5, 3, 2, 5, 3]), np.array([0, 5, 8, 10, 15])) == 5  # the whole run is one period
    long = np.arange(1, 20)  # 19 steps, no period up to 16
    assert period(long, np.concatenate([[0], np.cumsum(long)[:-1]])) == 0
    assert period(rows, out[::-1].copy()) == 0  # not one contiguous run
    # a chain whose sizes never repeat (20 steps): per-step copies, same gradients
    dims = [(7 * i) % 23 + 1 for i in range(21)]
    pats = [sp.csr_array(np.ones((dims[i], dims[i + 1]))) for i in range(20)]
    plan = spscan.plan(pats, levels=0)
    chains = [op for st in plan.bind((False,) * 20, (False,) * 21).program.steps for op in st.ops
              if isinstance(op, LinearRun)]
    assert chains and all(torch_ops._run_plan(op).period == 0 for op in chains)
    for dtype in (torch.float64, torch.float32):
        check_chain(pats, 2, dtype, [False, True] * 10, 0, True, seed=5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_index_work_at_run_time(backend, monkeypatch):
    """Planning binds the default signature; backward after that lowers nothing and uploads no table."""
    import spscan.runtime as engine
    import spscan.runtime.bound as bound
    from spscan.kernels.registry import get_backend

    pats = [sp.csr_array(sp.random(6, 6, density=0.4, random_state=i)) + sp.csr_array(sp.eye(6)) for i in range(9)]
    plan = spscan.plan(pats, levels=1, backend=backend)
    plan.bind(None, [True] + [False] * 9)  # a second signature, bound ahead of time

    def refuse(*args, **kwargs):
        raise AssertionError("index work inside backward")

    made = []
    monkeypatch.setattr(bound, "lower", refuse)
    monkeypatch.setattr(type(get_backend(backend)), "make_tables", refuse)
    monkeypatch.setattr(engine.BoundPlan, "__init__", lambda *a, **k: made.append(a) or refuse())
    vals = make_values(pats, 2, torch.float64, [False] * 9)
    grad = torch.randn(2, 6, dtype=torch.float64)
    ref = reference_backward(pats, vals, grad)
    for _ in range(2):
        out = spscan.backward(plan, vals, grad)
        assert max(rel_err(o, r) for o, r in zip(out, ref)) <= 1e-12
    extra = [torch.ones(2, 6, dtype=torch.float64)] + [None] * 9
    out = spscan.backward(plan, vals, grad, extra)
    assert rel_err(out[1], ref[1]) <= 1e-12 and not made


def test_backward_returns_one_buffer_as_a_sequence():
    """spscan.backward's result: indexable (negative indices, slices), len, iterable, list()-able and
    stacked() without a tensor per layer; equal to the reference."""
    n, B = 7, 3
    pats = [sp.csr_array(sp.eye(4))] * n
    plan = spscan.plan(pats, levels=0)
    vals = torch.randn(n, B, 4, dtype=torch.float64)
    grad = torch.randn(B, 4, dtype=torch.float64)
    out = spscan.backward(plan, vals, grad)
    ref = reference_backward(pats, list(vals), grad)
    assert len(out) == n + 1 and not isinstance(out, list)
    assert torch.equal(out[-1], out[n]) and torch.equal(out[n], grad)
    assert [t.shape for t in out[2:4]] == [(B, 4), (B, 4)]
    assert all(torch.allclose(a, r) for a, r in zip(out, ref))
    stacked = out.stacked()
    assert stacked.shape == (n + 1, B, 4) and torch.equal(stacked, torch.stack(list(out)))
    assert out.stacked(copy=True).is_contiguous()
    with pytest.raises(IndexError, match="out of range for 8 gradients"):
        out[8]
    with pytest.raises(TypeError, match="integers or slices"):
        out["0"]
