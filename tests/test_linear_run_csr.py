"""CSR elements inside the fused linear run (the linear-scan middle).

Random chains mixing dense, diagonal and general sparse (CSR) elements -- empty rows, 1 x 1,
rectangular, repeated patterns, batch 1, shared and per-sample values, affine ``extra`` terms,
values as a list and as one stacked tensor, non-contiguous values -- through every CPU path of
the run: the compiled loop (numba), the NumPy loop, the eager-torch loop, and the unfused program
(one SpMV op per sparse element), each against ``spscan.reference`` in float64. The Triton kernel's
CSR steps are tested in ``test_triton_kernels.py`` (``test_vec_chain``).

float32 tolerance: each output entry is a chain of sums of at most ``nnz`` row entries; the
yardstick is plain float32 backprop with explicit dense ``J^T`` (what autograd computes), and a
path may be at most twice as far from the float64 reference as that (the project's float32 rule),
plus a floor of a few ulps for outputs where the yardstick happens to be exact.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan
from spscan.kernels import torch_ops
from spscan.kernels.cpu import chain as cpu_chain
from spscan.planner import cost, planning
from spscan.planner import lowering as lowering_mod
from spscan.planner.cost import profile_for
from spscan.planner.memory import estimate_memory
from spscan.planner.patterns import as_chain, as_pattern
from spscan.planner.program import LinearRun
from spscan.reference import reference_backward

F32_FLOOR = 1e-6


def _csr(mask: np.ndarray) -> sp.csr_array:
    m = sp.csr_array(mask.astype(np.float64))
    m.sort_indices()
    return m


def _sparse(rng: np.random.Generator, rows: int, cols: int, density: float, empty_rows: int = 0) -> sp.csr_array:
    """A pattern that is neither full nor the identity (so the run takes it as a CSR step)."""
    while True:
        mask = rng.random((rows, cols)) < density
        if empty_rows:
            mask[rng.choice(rows, size=min(empty_rows, rows), replace=False)] = False
        full, eye = mask.all(), rows == cols and np.array_equal(mask, np.eye(rows, dtype=bool))
        if not full and not eye:
            return _csr(mask)


def lstm_step(h: int) -> tuple[sp.csr_array, sp.csr_array]:
    """The LSTM step as two elements: shared ``(2H, 5H)`` ``[[W_hh^T, 0], [0, I]]`` (nnz ``4H^2 + H``)
    and a per-sample ``(5H, 2H)`` factor with ``9H`` entries."""
    eye, zero = np.eye(h, dtype=bool), np.zeros((h, h), dtype=bool)
    shared = _csr(np.block([[np.ones((h, 4 * h), dtype=bool), zero], [np.zeros((h, 4 * h), dtype=bool), eye]]))
    sample = _csr(np.block([[eye, eye], [eye, eye], [eye, eye], [eye, zero], [eye, eye]]))
    return shared, sample


def random_chain(rng: np.random.Generator, n: int) -> list[sp.csr_array]:
    """Dense, diagonal and CSR elements (empty rows, an all-empty 1 x 1, rectangular), some repeated."""
    dims = [int(rng.choice([1, 3, 6, 9]))]
    pats: list[sp.csr_array] = []
    for _ in range(n):
        k = dims[-1]
        kind = str(rng.choice(["dense", "diag", "csr", "csr", "csr", "repeat"]))
        prev = [p for p in pats if p.shape[0] == k]
        if kind == "repeat" and prev:
            p = prev[int(rng.integers(len(prev)))]
        elif kind == "dense":
            p = _csr(np.ones((k, int(rng.choice([1, 4, 7]))), dtype=bool))
        elif kind == "diag":
            p = _csr(np.eye(k, dtype=bool))
        elif k == 1 and rng.random() < 0.5:
            p = _csr(np.zeros((1, 1), dtype=bool))  # an empty 1 x 1: a CSR step with no entry
        else:
            m = int(rng.choice([1, 2, 5, 8, 13]))
            p = _sparse(rng, k, m, float(rng.choice([0.2, 0.5, 0.9])), empty_rows=int(rng.integers(0, 2)))
        pats.append(p)
        dims.append(p.shape[1])
    return pats


def make_values(pats, shared, batch: int, dtype: torch.dtype, seed: int, pooled: bool = False) -> list[torch.Tensor]:
    """Values scaled by 1/sqrt(row length); a repeated shared pattern reuses one tensor (as an RNN's weight).

    ``pooled``: every per-sample tensor is a column slice of one ``(B, total)`` buffer and every shared
    one a slice of one 1-D buffer (as a front end fills them), else each is a tensor of its own.
    """
    gen = torch.Generator().manual_seed(seed)
    out, same = [], {}
    for p, s in zip(pats, shared):
        scale = 1.0 / np.sqrt(max(1.0, p.nnz / max(1, p.shape[0])))
        if s and id(p) in same:
            out.append(same[id(p)])
            continue
        v = (torch.randn((p.nnz,) if s else (batch, p.nnz), generator=gen, dtype=torch.float64) * scale).to(dtype)
        if s:
            same[id(p)] = v
        out.append(v)
    if pooled:
        for flag in (True, False):
            idx = [i for i, v in enumerate(out) if (v.dim() == 1) == flag and all(v is not w for w in out[:i])]
            if not idx:
                continue
            buf = torch.cat([out[i] for i in idx], dim=-1)
            ends = np.cumsum([out[i].shape[-1] for i in idx]).tolist()
            views = {id(out[i]): buf[..., e - out[i].shape[-1]:e] for i, e in zip(idx, ends)}
            out = [views.get(id(v), v) for v in out]
    return out


def make_extra(pats, batch: int, dtype: torch.dtype, seed: int) -> list[Optional[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    dims = [p.shape[0] for p in pats] + [pats[-1].shape[1]]
    return [torch.randn(batch, d, generator=gen, dtype=torch.float64).to(dtype) if i % 2 == 1 else None
            for i, d in enumerate(dims)]


def dense_f32(pats, vals, grad, extra) -> list[torch.Tensor]:
    """Plain float32 backprop with explicit dense ``J^T`` (the float32 yardstick)."""
    n = len(pats)
    g = grad.float() + (extra[n].float() if extra is not None and extra[n] is not None else 0)
    out = [None] * (n + 1)
    out[n] = g
    for i in range(n, 0, -1):
        p = pats[i - 1]
        rows = torch.as_tensor(np.repeat(np.arange(p.shape[0]), np.diff(p.indptr)))
        v = vals[i - 1].float()
        dense = torch.zeros((v.shape[0] if v.dim() == 2 else 1, *p.shape))
        dense[:, rows, torch.as_tensor(p.indices.astype(np.int64))] = v if v.dim() == 2 else v[None]
        g = torch.matmul(dense, g[:, :, None])[:, :, 0]
        if extra is not None and extra[i - 1] is not None:
            g = g + extra[i - 1].float()
        out[i - 1] = g
    return out


def rel_err(got, ref) -> float:
    worst = 0.0
    for o, r in zip(got, ref):
        scale = float(r.abs().max()) if r.numel() else 0.0
        if scale > 0:
            worst = max(worst, float((o.double() - r).abs().max()) / scale)
    return worst


def runs_of(plan, shared, has_extra) -> list[LinearRun]:
    program = plan.bind(tuple(shared), tuple(has_extra)).program
    return [op for st in program.steps for op in st.ops if isinstance(op, LinearRun)]


PATHS = ["compiled", "numpy", "torch", "unfused"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Which path runs the middle: the compiled loop, the NumPy loop, the eager-torch loop, or no fused
    run for CSR elements at all (each a standalone SpMV, the program before CSR steps joined runs).
    Yields the path name and the list of compiled-loop calls made."""
    calls = []
    if request.param == "compiled" and not cpu_chain.available():
        pytest.skip("numba not installed")
    if request.param in ("numpy", "torch", "unfused"):
        monkeypatch.setattr(cpu_chain, "available", lambda: False)
    if request.param == "torch":
        monkeypatch.setattr(torch_ops, "NUMPY_RUN_MAX_WORK", 0)
    if request.param == "unfused":
        kind = cost.linear_run_kind
        monkeypatch.setattr(lowering_mod, "linear_run_kind", lambda p, profile: None if kind(p, profile) == "sparse" else kind(p, profile))
    run = cpu_chain.run_chain

    def spy(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(cpu_chain, "run_chain", spy)
    yield request.param, calls


def check(pats, vals, grad, extra, dtype, path_name, stacked=None):
    """The path against the float64 reference; the plan's middle is (or, unfused, is not) one run with CSR steps."""
    n = len(pats)
    shared = [v.dim() == 1 for v in vals]
    has_extra = [e is not None for e in extra] if extra is not None else [False] * (n + 1)
    plan = spscan.plan(pats, levels=0, backend="torch")
    runs = runs_of(plan, shared, has_extra)
    csr_steps = sum(int(op.sparse.sum()) for op in runs)
    n_sparse = sum(cost.linear_run_kind(as_pattern(p), profile_for("cpu")) == "sparse" for p in pats)
    if path_name == "unfused":
        assert csr_steps == 0
    elif n >= 2:
        assert csr_steps == n_sparse  # every element is a step of the one run
    got = spscan.backward(plan, stacked if stacked is not None else vals, grad, extra)
    again = spscan.backward(plan, stacked if stacked is not None else vals, grad, extra)
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "not bitwise repeatable"
    ref = reference_backward(pats, [v.double() for v in vals], grad.double(),
                             None if extra is None else [None if e is None else e.double() for e in extra])
    err = rel_err(got, ref)
    if dtype == torch.float64:
        assert err <= 1e-12, f"float64 relative error {err:.3e}"
    else:
        yard = rel_err(dense_f32(pats, vals, grad, extra), ref)
        assert err <= 2 * yard + F32_FLOOR, f"float32 relative error {err:.3e} > 2 x {yard:.3e} + floor"
    return got


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("seed", range(8))
def test_random_mixed_chains(path, dtype, seed):
    """Dense / diagonal / CSR chains, shared and per-sample values, with and without affine terms."""
    rng = np.random.default_rng(seed)
    pats = random_chain(rng, int(rng.integers(2, 24)))
    batch = int(rng.choice([1, 3, 8]))
    shared = [bool(s) for s in rng.random(len(pats)) < 0.4]
    pooled = seed % 4 < 2
    vals = make_values(pats, shared, batch, dtype, seed, pooled=pooled)
    grad = torch.randn(batch, pats[-1].shape[1], generator=torch.Generator().manual_seed(seed), dtype=dtype)
    extra = make_extra(pats, batch, dtype, seed) if seed % 2 else None
    check(pats, vals, grad, extra, dtype, path[0])
    distinct = len({id(v) for v in vals})
    if path[0] == "compiled" and (pooled or distinct + 2 <= cpu_chain.MAX_SOURCES):
        assert path[1], "the compiled loop did not run"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_lstm_shaped_chain(path, dtype):
    """The LSTM step as two CSR elements (shared + per sample), T = 12, batch 1 and 5, affine terms."""
    shared_pat, sample_pat = lstm_step(4)
    pats = [shared_pat, sample_pat] * 12
    for batch in (1, 5):
        vals = make_values(pats, [True, False] * 12, batch, dtype, batch, pooled=True)
        grad = torch.randn(batch, pats[-1].shape[1], dtype=dtype)
        extra = [torch.randn(batch, p.shape[0], dtype=dtype) if i % 2 == 0 else None for i, p in enumerate(pats)]
        check(pats, vals, grad, extra + [None], dtype, path[0])


def test_stacked_values(path):
    """Values as one stacked ``(n, B, nnz)`` / ``(n, nnz)`` tensor: read in place, same gradients as a list."""
    rng = np.random.default_rng(5)
    perm = _csr(np.eye(6, dtype=bool)[rng.permutation(6)])  # nnz 6, not the identity: a CSR step
    band = _csr(np.eye(6, k=1, dtype=bool) | np.eye(6, k=-5, dtype=bool))  # nnz 6, cyclic shift
    pats = [perm, _csr(np.eye(6, dtype=bool)), band, perm, band, perm]
    for stacked in (torch.randn(6, 3, 6, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)):
        vals = list(stacked.unbind(0))
        grad = torch.randn(3, 6, dtype=torch.float64)
        check(pats, vals, grad, None, torch.float64, path[0], stacked=stacked)
        if path[0] == "compiled":
            assert path[1]


def test_non_contiguous_values_fall_back(path):
    """Values that are not a plain view of a contiguous tensor: the compiled loop is not used (it reads
    in place), the NumPy loop runs instead, with the same gradients."""
    rng = np.random.default_rng(9)
    pats = [_sparse(rng, 5, 7, 0.4, 1), _sparse(rng, 7, 7, 0.5, 2), _csr(np.ones((7, 3), dtype=bool)),
            _sparse(rng, 3, 4, 0.6)]
    batch = 4
    vals = [torch.randn(batch, 2 * p.nnz, dtype=torch.float64)[:, ::2] for p in pats]  # last stride 2
    vals[1] = torch.randn(pats[1].nnz, batch, dtype=torch.float64).t()  # transposed storage
    assert not any(v.is_contiguous() for v in vals)
    grad = torch.randn(batch, 4, dtype=torch.float64)
    check(pats, vals, grad, None, torch.float64, path[0])
    assert not path[1], "the compiled loop must not read non-contiguous values"


def test_patterns_are_interned_and_estimates_do_not_grow_with_t():
    """A T-step LSTM chain stores its two patterns once; the memory estimate's index bytes do not grow with T."""
    shared_pat, sample_pat = lstm_step(5)
    est = {}
    for t in (20, 40):
        plan = spscan.plan([shared_pat, sample_pat] * t, levels=0, backend="torch")
        (run,) = runs_of(plan, [True, False] * t, [False] * (2 * t + 1))
        assert len(run.csr) == 2 and run.steps in (2 * t - 1, 2 * t)
        assert run.csr_indptr.size == (10 + 1) + (25 + 1)
        assert run.csr_indices.size == shared_pat.nnz + sample_pat.nnz
        assert set(run.pattern.tolist()) == {0, 1}
        est[t] = estimate_memory(plan._scan).plan_bytes
    assert est[20] == est[40]


def test_run_kind_of_patterns():
    rng = np.random.default_rng(0)
    cpu, cuda = profile_for("cpu"), profile_for("cuda")
    for prof in (cpu, cuda):
        assert cost.linear_run_kind(as_pattern(_csr(np.ones((3, 4), dtype=bool))), prof) == "dense"
        assert cost.linear_run_kind(as_pattern(_csr(np.eye(4, dtype=bool))), prof) == "diag"
        assert cost.linear_run_kind(as_pattern(_sparse(rng, 4, 4, 0.95)), prof) == "sparse"  # nearly dense: CSR
        assert cost.linear_run_kind(as_pattern(_csr(np.zeros((3, 2), dtype=bool))), prof) == "sparse"
    # a big CSR step: on a GPU its own work dwarfs a run's savings and a standalone SpMV spreads it
    # over the device; on a CPU the compiled run loop is the fastest way through it
    big = as_pattern(sp.csr_array(sp.eye(cuda.run_sparse_max_nnz + 2, k=1, format="csr")))
    assert cost.linear_run_kind(big, cuda) is None
    assert cost.linear_run_kind(big, cpu) == "sparse"
    assert cost.linear_run_kind(big, profile_for("cpu", {"run_sparse_max_nnz": 1 << 16})) is None


def test_big_csr_steps_take_the_compiled_loop_on_cpu():
    """The LSTM step at H = 128 (a shared CSR element of 4 H^2 + H = 65664 entries, over the GPU
    profile's bound for run steps): on the CPU profile it is a step of the one fused run, which takes
    the compiled/NumPy loop (eager torch's gathers were 40x slower per step), and the gradients match
    the float64 reference; the CUDA profile keeps such an element a standalone SpMV."""
    shared_pat, sample_pat = lstm_step(128)
    assert shared_pat.nnz > profile_for("cuda").run_sparse_max_nnz
    pats = [shared_pat, sample_pat] * 3
    shared = [True, False] * 3
    plan = spscan.plan(pats, levels=0, backend="torch")
    (run,) = runs_of(plan, shared, [False] * 7)
    assert int(run.sparse.sum()) == 6
    assert torch_ops.uses_numpy(torch_ops._run_plan(run), torch.empty(16, 1))
    for device, want in (("cpu", {0: 6}), ("cuda", {})):  # the middle's runs: start step -> length
        scan = planning.plan_scan(as_chain(pats), 0, profile_for(device))
        assert lowering_mod.middle_runs(scan.schedule.steps, scan.mats, scan.profile) == want, device
    vals = make_values(pats, shared, 2, torch.float64, 0, pooled=True)
    grad = torch.randn(2, pats[-1].shape[1], dtype=torch.float64)
    got = spscan.backward(plan, vals, grad)
    ref = reference_backward(pats, vals, grad)
    scale = max(float(r.abs().max()) for r in ref)
    assert max(float((g - r).abs().max()) for g, r in zip(got, ref)) <= 1e-12 * scale


def test_plan_files_keep_the_run_bound():
    """The profile's bound on CSR run steps travels in plan files; a file written before the field
    existed was planned with the former fixed bound (2**16 entries) and loads with it."""
    from dataclasses import asdict

    from spscan.planner.serialize import _profile

    cpu, cuda = profile_for("cpu"), profile_for("cuda")
    assert cpu.run_sparse_max_nnz is None and cuda.run_sparse_max_nnz == 1 << 16
    assert _profile(asdict(cpu)) == cpu and _profile(asdict(cuda)) == cuda
    old = {k: v for k, v in asdict(cpu).items() if k != "run_sparse_max_nnz"}
    assert _profile(old).run_sparse_max_nnz == 1 << 16
    for bad in (0, -3, 2.5, True, "big"):
        with pytest.raises(ValueError, match="run_sparse_max_nnz"):
            _profile(dict(asdict(cpu), run_sparse_max_nnz=bad))


# ------------------------------------------------------------------ the compiled loop itself


def _random_csr_run(rng, steps: int, batch: int, dtype):
    """A run of random dense / diagonal / CSR steps over three value sources at odd offsets."""
    dims = [int(rng.choice([1, 4, 9]))]
    kinds, mats, pool = [], [], []
    for _ in range(steps):
        k = dims[-1]
        kind = str(rng.choice(["diag", "dense", "csr", "csr"]))
        shared = bool(rng.random() < 0.5)
        if kind == "diag":
            m = k
        else:
            m = int(rng.choice([1, 3, 8]))
        if kind == "csr":
            reuse = [q for q in pool if q.shape == (m, k)]
            pat = reuse[0] if reuse and rng.random() < 0.5 else _sparse(rng, m, k, 0.4, int(rng.integers(0, 2))) \
                if (m, k) != (1, 1) else _csr(np.zeros((1, 1), dtype=bool))
            if all(pat is not q for q in pool):
                pool.append(pat)
            mats.append(pat)
        else:
            mats.append(None)
        kinds.append((kind, shared))
        dims.append(m)
    nnz = [p.nnz if p is not None else (m * k if kd == "dense" else m)
           for p, (kd, _), m, k in zip(mats, kinds, dims[1:], dims[:-1])]
    sizes = [5, 3, 0]  # sources 0 and 2 shared, 1 per sample
    src, off = [], []
    for (kd, sh), c in zip(kinds, nnz):
        s = (0 if rng.random() < 0.5 else 2) if sh else 1
        src.append(s)
        off.append(sizes[s])
        sizes[s] += c + 1
    sources = [rng.standard_normal(sizes[0]), rng.standard_normal((batch, sizes[1])), rng.standard_normal(sizes[2])]
    starts = np.cumsum([0] + [q.shape[0] + 1 for q in pool])
    base = np.cumsum([0] + [q.nnz for q in pool])
    indptr = np.concatenate([q.indptr.astype(np.int64) + b for q, b in zip(pool, base)] or [np.zeros(1, np.int64)])
    indices = np.concatenate([q.indices.astype(np.int64) for q in pool] or [np.zeros(1, np.int64)])
    code, csr_ptr = [], []
    for (kd, sh), p in zip(kinds, mats):
        code.append(0 if kd == "diag" else {"dense": 1, "csr": 3}[kd] + (0 if sh else 1))
        csr_ptr.append(int(starts[[i for i, q in enumerate(pool) if q is p][0]]) if p is not None else -1)
    vin0, col = 1, 1 + dims[0]
    add, out = [], []
    for m in dims[1:]:
        if rng.random() < 0.5:
            add.append(col)
            col += m
        else:
            add.append(-1)
        out.append(col)
        col += m
    vectors = rng.standard_normal((batch, col + 2)).astype(dtype)
    i64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    desc = dict(code=i64(code), src=i64(src), offset=i64(off),
                bstride=i64([sizes[1] if s == 1 else 0 for s in src]), rows=i64(dims[1:]), cols=i64(dims[:-1]),
                add=i64(add), out=i64(out), vin0=vin0, csr_ptr=i64(csr_ptr), csr_indptr=indptr, csr_indices=indices)
    srcs = [sources[0].astype(dtype), sources[1].astype(dtype).reshape(-1), sources[2].astype(dtype)]
    return desc, srcs, vectors, mats


def _reference_loop(desc, sources, vectors, mats):
    """The same math in float64 with SciPy matrices built from each step's values."""
    v = vectors.astype(np.float64).copy()
    srcs = [s.astype(np.float64) for s in sources]
    batch = v.shape[0]
    y = v[:, desc["vin0"]:desc["vin0"] + desc["cols"][0]].copy()
    for j in range(desc["code"].shape[0]):
        c, s, o, bs = (int(desc[x][j]) for x in ("code", "src", "offset", "bstride"))
        m, k, a, out = (int(desc[x][j]) for x in ("rows", "cols", "add", "out"))
        ynew = np.zeros((batch, m))
        for b in range(batch):
            if c == 0:
                ynew[b] = srcs[s][o + b * bs: o + b * bs + m] * y[b]
            elif c in (1, 2):
                ynew[b] = srcs[s][o + b * bs: o + b * bs + m * k].reshape(m, k) @ y[b]
            else:
                p = mats[j]
                data = srcs[s][o + b * bs: o + b * bs + p.nnz]
                ynew[b] = sp.csr_array((data, p.indices, p.indptr), shape=p.shape) @ y[b]
        if a >= 0:
            ynew += v[:, a:a + m]
        v[:, out:out + m] = ynew
        y = ynew
    return v


@pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 3e-6)])
@pytest.mark.parametrize("seed", range(6))
def test_run_chain_csr_codes(dtype, tol, seed):
    """Codes 3/4 (shared / per-sample CSR) next to diagonal and dense steps: the float64 loop's result,
    only the outputs written, bitwise repeatable. float32: each output is a sum of <= 9 products per
    step; 3e-6 relative (25 ulps) per sqrt(step) bounds the accumulated rounding."""
    rng = np.random.default_rng(seed)
    desc, sources, vectors, mats = _random_csr_run(rng, int(rng.integers(1, 30)), int(rng.choice([1, 2, 7])), dtype)
    want = _reference_loop(desc, sources, vectors, mats)
    got = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=got, **desc)
    scale = np.abs(want).max() + 1e-30
    assert np.abs(got - want).max() <= tol * scale * max(1, desc["code"].shape[0] ** 0.5)
    untouched = np.ones(got.shape[1], dtype=bool)
    for o, m in zip(desc["out"], desc["rows"]):
        untouched[o:o + m] = False
    assert np.array_equal(got[:, untouched], vectors[:, untouched])
    again = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=again, **desc)
    assert np.array_equal(again, got)


@pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")
def test_run_chain_rejects_missing_csr_tables():
    rng = np.random.default_rng(3)
    desc, sources, vectors, _ = _random_csr_run(rng, 12, 2, np.float64)
    if not (desc["code"] >= 3).any():
        desc["code"][-1] = 3  # make sure a CSR step is there (values are not read: the call is refused)
    with pytest.raises(ValueError, match="csr_indptr"):
        cpu_chain.run_chain(sources=sources, vectors=vectors, **{**desc, "csr_indptr": None})
    with pytest.raises(ValueError, match="csr_ptr"):
        cpu_chain.run_chain(sources=sources, vectors=vectors, **{**desc, "csr_ptr": desc["csr_ptr"][:1]})
    with pytest.raises(ValueError, match="code"):
        cpu_chain.run_chain(sources=sources, vectors=vectors, **{**desc, "code": desc["code"] + 5})


@pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_run_chain_csr_sample_loops_agree(dtype):
    """The batch runs in tiles of LANES samples (a full one and a partial one here): each sample's outputs
    are summed in stored order whatever its tile, so they equal a run of that sample alone bit for bit."""
    from spscan.kernels.cpu.simd import LANES

    rng = np.random.default_rng(12)
    batch = LANES + 3
    desc, sources, vectors, _ = _random_csr_run(rng, 25, batch, dtype)
    together = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=together, **desc)
    for b in range(batch):
        one = vectors[b:b + 1].copy()
        srcs = [sources[0], sources[1].reshape(batch, -1)[b].copy(), sources[2]]
        cpu_chain.run_chain(sources=srcs, vectors=one, **desc)
        assert np.array_equal(one[0], together[b]), b
