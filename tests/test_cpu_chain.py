"""The compiled linear-run loop (kernels/cpu/chain.py) against a float64 NumPy loop, the NumPy path of
the torch backend, and spscan.reference; float32/float64, diagonal/dense/per-sample steps, affine
terms, odd sizes, inf/NaN propagation, bitwise repeatability."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan
from spscan.kernels.cpu import chain as cpu_chain
from spscan.reference import reference_backward

pytestmark = pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")


def _random_run(rng, steps: int, batch: int, dtype, affine: bool, kinds=("diag_s", "diag_p", "dense_s", "dense_p")):
    """A random run: sizes chain (odd ones included), values spread over three sources at odd offsets."""
    dims = [int(rng.choice([1, 3, 5, 7, 20]))]
    code, src, off, bst, rows, cols, add, out = ([] for _ in range(8))
    sizes = [7, 0, 3]  # element counts so far (odd starting offsets)
    steps_desc = []
    for j in range(steps):
        kind = kinds[int(rng.integers(len(kinds)))]
        k = dims[-1]
        m = k if kind.startswith("diag") else int(rng.choice([1, 2, 5, 7, 20]))
        n = m if kind.startswith("diag") else m * k
        if kind.endswith("_s"):
            s = int(rng.choice([0, 2]))
            steps_desc.append((kind, s, sizes[s], n))
            sizes[s] += n + 1
        else:
            steps_desc.append((kind, 1, sizes[1], n))
            sizes[1] += n
        dims.append(m)
    size_p = sizes[1] + 3
    srcs = [rng.standard_normal(sizes[0]) * 0.5, rng.standard_normal((batch, size_p)) * 0.5,
            rng.standard_normal(sizes[2]) * 0.5]
    col = dims[0] + 2  # vector arena: [pad, pad, y0, adds..., outs...]
    vin0 = 2
    adds_at = []
    for j, m in enumerate(dims[1:]):
        if affine and rng.random() < 0.6:
            adds_at.append(col)
            col += m
        else:
            adds_at.append(-1)
    for j, ((kind, s, o, n), m, k) in enumerate(zip(steps_desc, dims[1:], dims[:-1])):
        code.append(0 if kind.startswith("diag") else (1 if kind == "dense_s" else 2))
        src.append(s)
        off.append(o)
        bst.append(size_p if s == 1 else 0)
        rows.append(m)
        cols.append(k)
        add.append(adds_at[j])
        out.append(col)
        col += m
    vectors = rng.standard_normal((batch, col + 1))
    arr = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    desc = dict(code=arr(code), src=arr(src), offset=arr(off), bstride=arr(bst), rows=arr(rows), cols=arr(cols),
                add=arr(add), out=arr(out), vin0=vin0)
    sources = [srcs[0].astype(dtype), srcs[1].astype(dtype).reshape(-1), srcs[2].astype(dtype)]
    return desc, sources, vectors.astype(dtype)


def _numpy_loop(desc, sources, vectors):
    """The same math, one step at a time in float64 (the test's own reference)."""
    v = vectors.astype(np.float64).copy()
    srcs = [s.astype(np.float64) for s in sources]
    batch = v.shape[0]
    y = v[:, desc["vin0"]:desc["vin0"] + desc["cols"][0]].copy()
    for j in range(desc["code"].shape[0]):
        c, s, o, bs = (int(desc[x][j]) for x in ("code", "src", "offset", "bstride"))
        m, k, a, out = (int(desc[x][j]) for x in ("rows", "cols", "add", "out"))
        n = m if c == 0 else m * k
        vals = np.stack([srcs[s][o + b * bs: o + b * bs + n] for b in range(batch)])
        if c == 0:
            y = vals * y
        else:
            y = np.einsum("bik,bk->bi", vals.reshape(batch, m, k), y)
        if a >= 0:
            y = y + v[:, a:a + m]
        v[:, out:out + m] = y
    return v


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_run_chain_equals_numpy_loop(dtype, tol, affine, seed):
    rng = np.random.default_rng(seed)
    desc, sources, vectors = _random_run(rng, steps=int(rng.integers(1, 40)), batch=int(rng.choice([1, 3, 16])),
                                         dtype=dtype, affine=affine)
    want = _numpy_loop(desc, sources, vectors)
    got = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=got, **desc)
    scale = np.abs(want).max() + 1e-30
    assert np.abs(got - want).max() <= tol * scale * max(1, desc["code"].shape[0] ** 0.5)
    untouched = np.ones(got.shape[1], dtype=bool)
    for o, m in zip(desc["out"], desc["rows"]):
        untouched[o:o + m] = False
    assert np.array_equal(got[:, untouched], vectors[:, untouched])  # only the outputs are written
    again = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=again, **desc)
    assert np.array_equal(again, got)  # bitwise repeatable


@pytest.mark.parametrize("kind", ["diag_s", "diag_p", "dense_s", "dense_p"])
def test_inf_and_nan_propagate_as_in_numpy(kind):
    rng = np.random.default_rng(1)
    desc, sources, vectors = _random_run(rng, steps=6, batch=4, dtype=np.float64, affine=True, kinds=(kind,))
    vectors[1, desc["vin0"]] = np.inf
    vectors[2, desc["vin0"]] = -np.inf
    sources[0][:] = np.where(rng.random(sources[0].shape) < 0.3, 0.0, sources[0])
    sources[1][:] = np.where(rng.random(sources[1].shape) < 0.3, 0.0, sources[1])
    with np.errstate(all="ignore"):
        want = _numpy_loop(desc, sources, vectors)
    got = vectors.copy()
    with np.errstate(all="ignore"):
        cpu_chain.run_chain(sources=sources, vectors=got, **desc)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.isinf(got), np.isinf(want))
    assert np.isinf(got).any() or np.isnan(got).any()
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=1e-12, atol=1e-12)


def test_run_chain_rejects_bad_arrays():
    rng = np.random.default_rng(0)
    desc, sources, vectors = _random_run(rng, steps=3, batch=2, dtype=np.float64, affine=False)
    with pytest.raises(TypeError, match="sources\\[1\\]"):
        cpu_chain.run_chain(sources=[sources[0], sources[1].astype(np.float32), sources[2]], vectors=vectors, **desc)
    with pytest.raises(ValueError, match="rows"):
        cpu_chain.run_chain(sources=sources, vectors=vectors, **{**desc, "rows": desc["rows"][:2]})
    with pytest.raises(TypeError, match="vectors"):
        cpu_chain.run_chain(sources=sources, vectors=vectors.astype(np.float16), **desc)


# ----------------------------------------------------------------------------- through the engine


def _rnn_like_chain(T: int, H: int, factored: bool):
    dense = sp.csr_array(np.ones((H, H)))
    diag = sp.csr_array(np.eye(H))
    return [dense, diag] * T if factored else [dense] * T


def _values(pats, batch, dtype, shared_dense: bool, seed: int):
    """Per-sample diagonal values; dense values shared (one tensor repeated) or per sample."""
    g = torch.Generator().manual_seed(seed)
    out, cache = [], {}
    for p in pats:
        h = p.shape[0]
        if p.nnz < h * h or not shared_dense:  # diagonal, or per-sample dense
            out.append(torch.randn(batch, p.nnz, generator=g, dtype=dtype) / (1 if p.nnz < h * h else h ** 0.5))
        else:
            if id(p) not in cache:
                cache[id(p)] = torch.randn(p.nnz, generator=g, dtype=dtype) / h ** 0.5
            out.append(cache[id(p)])
    return out


@pytest.fixture(params=["compiled", "numpy"])
def cpu_loop(request, monkeypatch):
    """Which CPU loop runs the linear scan; yields the list of compiled-loop calls made."""
    calls = []
    if request.param == "numpy":
        monkeypatch.setattr(cpu_chain, "available", lambda: False)
    run = cpu_chain.run_chain

    def spy(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(cpu_chain, "run_chain", spy)
    yield request.param, calls
    assert (len(calls) > 0) == (request.param == "compiled")


@pytest.mark.parametrize("factored,shared_dense", [(True, True), (False, True), (False, False)])
@pytest.mark.parametrize("extra", [False, True])
def test_engine_linear_run_equals_reference(cpu_loop, factored, shared_dense, extra):
    """Linear scan (levels=0) of RNN-shaped chains: both CPU loops match the float64 reference."""
    pats = _rnn_like_chain(9, 5, factored)
    batch = 3
    plan = spscan.plan(pats, levels=0, backend="torch")
    vals = _values(pats, batch, torch.float64, shared_dense, seed=3)
    grad = torch.randn(batch, 5, dtype=torch.float64)
    ex = [torch.randn(batch, 5, dtype=torch.float64) if (extra and i % 3 == 1) else None for i in range(len(pats) + 1)]
    got = spscan.backward(plan, vals, grad, extra=ex if extra else None)
    want = reference_backward(pats, vals, grad, extra=ex if extra else None)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_engine_compiled_and_numpy_loops_agree_in_float32(monkeypatch):
    pats = _rnn_like_chain(40, 20, True)
    plan = spscan.plan(pats, levels=0, backend="torch")
    vals = _values(pats, 16, torch.float32, True, seed=5)
    grad = torch.randn(16, 20)
    compiled = spscan.backward(plan, vals, grad)
    monkeypatch.setattr(cpu_chain, "available", lambda: False)
    numpy_path = spscan.backward(plan, vals, grad)
    ref = reference_backward(pats, [v.double() for v in vals], grad.double())
    for c, n, r in zip(compiled, numpy_path, ref):
        err_c = (c.double() - r).abs().max()
        err_n = (n.double() - r).abs().max()
        assert err_c <= 2 * err_n + 1e-6 * r.abs().max()


# --------------------------------------------------------------------------- periodic values, stacked extras

from spscan.runtime import PeriodicValues, StackedExtra  # noqa: E402


def _periodic_chain(T: int, H: int, batch: int, dtype, seed: int):
    """A GRU-shaped period (shared dense, per-sample diagonal, shared dense) repeated ``T`` times, as
    :class:`PeriodicValues` whose per-sample element is a strided view into a larger tensor."""
    g = torch.Generator().manual_seed(seed)
    pats = [sp.csr_array(np.ones((H, H))), sp.csr_array(np.eye(H)), sp.csr_array(np.ones((H, H)))] * T
    w1 = torch.randn(H * H, generator=g, dtype=dtype) / H ** 0.5
    w2 = torch.randn(H * H, generator=g, dtype=dtype) / H ** 0.5
    big = torch.randn(T, batch, 2 * H + 1, generator=g, dtype=dtype)  # the diagonal is columns 1 .. H
    d = big[..., 1 : H + 1]
    return pats, PeriodicValues([w1, d, w2], T)


@pytest.mark.parametrize("extra", [False, True])
@pytest.mark.parametrize("check", [False, True])
def test_periodic_values_and_stacked_extra_equal_lists(cpu_loop, extra, check):
    """The compact forms give the same gradients as the lists they stand for (both CPU loops)."""
    T, H, batch, per = 7, 4, 3, 3
    pats, vals = _periodic_chain(T, H, batch, torch.float64, seed=11)
    n = per * T
    terms = torch.randn(T - 1, batch, H, dtype=torch.float64)
    ext = StackedExtra(terms, range(per, n, per), n + 1) if extra else None
    ext_list = [None] * (n + 1)
    for t in range(T - 1):
        ext_list[per * (t + 1)] = terms[t]
    grad = torch.randn(batch, H, dtype=torch.float64)
    plan = spscan.plan(pats, levels=0, backend="torch")
    bound = plan.bind([True, False, True] * T, [e is not None for e in ext_list] if extra else None)
    got = bound.run(vals, grad, ext, check=check).grads
    want = reference_backward(pats, list(vals), grad, extra=ext_list if extra else None)
    assert len(got) == len(want) == n + 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    lists = bound.run(list(vals), grad, ext_list if extra else None, check=check).grads
    for a, b in zip(got, lists):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("levels", [1, "full"])
def test_periodic_values_through_products(levels, backend):
    """A plan with products (not only the linear run) loads PeriodicValues into its arenas as the
    list of tensors it stands for: same gradients as the reference, bitwise those of the list."""
    T, H, batch = 6, 3, 2
    pats, vals = _periodic_chain(T, H, batch, torch.float64, seed=12)
    grad = torch.randn(batch, H, dtype=torch.float64)
    dev = torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    vals = PeriodicValues([e.to(dev) for e in vals.elements], T)
    plan = spscan.plan(pats, levels=levels, backend=backend, device=dev)
    bound = plan.bind([True, False, True] * T)
    got = [g.cpu() for g in bound.run(vals, grad.to(dev), check=False).grads]
    want = reference_backward(pats, [v.cpu() for v in vals], grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    lists = bound.run(list(vals), grad.to(dev), check=False).grads
    for a, b in zip(got, lists):
        assert torch.equal(a, b.cpu())


def test_periodic_values_and_stacked_extra_read_as_lists():
    w = torch.arange(4.0)
    d = torch.arange(30.0).view(5, 2, 3)
    v = PeriodicValues([w, d], 5)
    assert len(v) == 10
    assert v[0] is w and v[8] is w and torch.equal(v[3], d[1]) and torch.equal(v[-1], d[4])
    assert [x.shape for x in v[1:5:2]] == [(2, 3), (2, 3)]
    assert sum(1 for _ in v) == 10
    with pytest.raises(IndexError):
        v[10]
    with pytest.raises(ValueError, match=r"elements\[1\].*\(5, B, nnz\)"):
        PeriodicValues([w, d[:4]], 5)
    terms = torch.arange(12.0).view(2, 2, 3)
    e = StackedExtra(terms, range(2, 6, 3), 7)
    assert len(e) == 7 and e[0] is None and torch.equal(e[2], terms[0]) and torch.equal(e[5], terms[1])
    assert e[-2] is not None and e[6] is None
    with pytest.raises(IndexError):
        e[7]
    with pytest.raises(ValueError, match="range of K positions"):
        StackedExtra(terms, range(2, 9, 3), 10)
    with pytest.raises(ValueError, match=r"\[0, 7\)"):
        StackedExtra(terms, range(4, 8, 3), 7)


def test_resolve_steps_memo_reuses_tables_for_one_layout():
    """With a memo, periodic values laid out as before (each element at the same place in a base of the
    same size: recycled buffers, or a new shared tensor of the same size) reuse the earlier step tables;
    another layout (a different batch, an entry-major view) gets its own; the sources are always the
    current call's tensors."""
    from spscan.runtime import PeriodicValues

    T, B, n = 6, 3, 4
    code = np.array([3, 4] * T, dtype=np.int64)
    shared = [True, False] * T
    layers = np.arange(2 * T, dtype=np.int64)
    offsets = np.zeros(2 * T, dtype=np.int64)
    arena_s, arena_p = np.zeros(4), np.zeros((B, 4))
    memo: dict = {}

    def resolve(values, batch=B):
        arena = arena_p if batch == B else np.zeros((batch, 4))
        return cpu_chain.resolve_steps(code, shared, layers, offsets, arena_s, arena, values.__getitem__,
                                       torch.float64, memo=memo)

    per = torch.randn(T, B, n, dtype=torch.float64)
    first = resolve(PeriodicValues([torch.randn(5, dtype=torch.float64), per], T))
    again_w = torch.randn(5, dtype=torch.float64)
    second = resolve(PeriodicValues([again_w, per], T))
    assert len(memo) == 1
    assert all(a is b for a, b in zip(first[:5], second[:5]))  # the same tables
    assert second[5][2].ctypes.data == again_w.data_ptr()  # this call's shared tensor
    assert second[2][1::2].tolist() == [t * B * n for t in range(T)] and second[3][1] == n
    em = torch.randn(T, n, B, dtype=torch.float64).transpose(1, 2)  # entry-major
    third = resolve(PeriodicValues([again_w, em], T))
    assert len(memo) == 2 and third[3][1] == 1 and third[4][1] == B
    other = torch.randn(T, B + 1, n, dtype=torch.float64)
    fourth = resolve(PeriodicValues([again_w, other], T), batch=B + 1)
    assert len(memo) == 3 and fourth[3][1] == n
