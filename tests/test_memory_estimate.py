"""The planner's index-memory estimate against what a plan really holds, and dense-stored products.

``estimate_memory(plan, signatures).index_bytes`` must match :func:`held_index_bytes` (the distinct
integer buffers reachable from the symbolic plan and each bound signature's program and backend
tables) on conv/ReLU/pool chains and sparse random chains at depths 0..3, with products stored
densely and sparsely, planned as pair lists and row-wise. A product stored densely holds no
pattern index arrays (its pattern is a :class:`FullPattern`): plan files round trip with it, and
gradients equal the linear scan's in float64.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn

import spscan
from spscan.kernels.spgemm_rows_torch import rows_torch_table, spgemm_rows_torch
from spscan.planner import cost
from spscan.planner.memory import estimate_memory, held_index_bytes
from spscan.planner.patterns import FullPattern, as_pattern, full_pattern, make_pattern

#: estimate vs measured index bytes (the estimate counts the same arrays: it is exact today; the
#: tolerance leaves room for a backend table of a few entries that the model does not know)
TOLERANCE = 0.02


def _held(plan) -> int:
    core = getattr(plan, "core", plan)
    return held_index_bytes(core._scan, *[(b.program, b.tables) for b in core.bindings()])


def _estimate(plan):
    core = getattr(plan, "core", plan)
    sigs = [(k[0], k[1], k[3], k[4]) for k in core._bound]
    return estimate_memory(core._scan, sigs)


def _products(plan):
    core = getattr(plan, "core", plan)
    return [m for m in core._scan.mats.values() if m.algo != "input"]


def _conv_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3, padding=1),
                        nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(6, 6, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    with torch.no_grad():
        for m in net:
            if isinstance(m, nn.Conv2d):  # prune: ~30 % of the weights kept
                m.weight.mul_((torch.rand_like(m.weight) < 0.3).to(m.weight.dtype))
    return net.double()


def _random_chain(n: int, d: int, density: float, seed: int) -> list[sp.csr_array]:
    rng = np.random.default_rng(seed)
    return [sp.csr_array((rng.random((d, d)) < density).astype(np.float64)) for _ in range(n)]


@pytest.fixture
def rowwise_everywhere(monkeypatch):
    """A CPU profile whose pair-list cap is one byte: every sparse product runs row-wise."""
    monkeypatch.setattr(cost, "_CPU", dataclasses.replace(cost._CPU, pair_list_max_bytes=1.0))


def _check_estimate(plan) -> None:
    held = _held(plan)
    est = _estimate(plan)
    assert held > 0
    assert abs(est.index_bytes - held) <= TOLERANCE * held, (est, held)
    core = getattr(plan, "core", plan)
    assert est.symbolic_bytes == held_index_bytes(core._scan)


@pytest.mark.parametrize("levels", [0, 1, 2, 3])
def test_estimate_matches_held_conv_relu_pool(levels):
    net = _conv_net()
    x = torch.randn(1, 2, 16, 16, dtype=torch.float64)
    plan = spscan.plan(net, x, prune_zeros=True, levels=levels)
    assert plan.core.levels == levels
    assert len(plan.core.bindings()) >= 1
    _check_estimate(plan)


@pytest.mark.parametrize("levels", [1, 2, 3])
@pytest.mark.parametrize("density", [0.03, 0.3])
def test_estimate_matches_held_random_chains(levels, density):
    pats = _random_chain(13, 24, density, seed=levels)
    plan = spscan.plan(pats, levels=levels, backend="torch")
    if density == 0.3 and levels >= 2:
        assert any(m.pattern.is_full for m in _products(plan))  # dense-stored products are covered
    _check_estimate(plan)
    # more signatures: shared inputs and extra terms, bound on top of the default one
    n = len(pats)
    plan.bind(shared=[i % 2 == 0 for i in range(n)], has_extra=[i % 3 == 0 for i in range(n + 1)])
    plan.bind(first_output=False)
    _check_estimate(plan)


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_estimate_matches_held_rowwise(rowwise_everywhere, levels):
    pats = _random_chain(11, 20, 0.12, seed=7)
    plan = spscan.plan(pats, levels=levels, backend="torch")
    assert any(m.algo == "rows" for m in _products(plan))
    _check_estimate(plan)


def test_dense_products_hold_no_pattern_arrays():
    pats = _random_chain(13, 24, 0.3, seed=2)
    plan = spscan.plan(pats, levels=2, backend="torch", dtype=torch.float64)
    dense = [m for m in _products(plan) if m.pattern.is_full]
    assert dense
    for m in dense:
        assert isinstance(m.pattern, FullPattern)
        assert "indices" not in vars(m.pattern) and "indptr" not in vars(m.pattern)
    # the symbolic plan holds less than the full patterns' index arrays would be
    scan = plan._scan
    distinct = {id(m.pattern): m.pattern for m in dense}.values()
    full_arrays = sum(8 * (p.rows + 1 + p.nnz) for p in distinct)
    held = held_index_bytes(scan)
    with_arrays = held_index_bytes(scan, [(p.indptr, p.indices) for p in distinct])
    assert with_arrays - held == full_arrays


def test_full_pattern_is_the_array_pattern():
    for rows, cols in [(1, 1), (3, 5), (700, 3000)]:
        f = full_pattern(rows, cols)
        g = make_pattern((rows, cols), np.arange(rows + 1) * cols, np.tile(np.arange(cols), rows))
        assert f.key == g.key and f.nnz == g.nnz == rows * cols and f.is_full
        assert np.array_equal(f.indptr, g.indptr) and np.array_equal(f.indices, g.indices)
        assert np.array_equal(f.row_lengths(), g.row_lengths())
        assert as_pattern(f.to_scipy()).key == f.key
        with pytest.raises(ValueError):
            f.indices[0] = 1  # read-only, as every pattern's arrays


def _grads(plan, vals, grad):
    return spscan.backward(plan, vals, grad)


@pytest.mark.parametrize("rowwise", [False, True])
def test_gradients_and_plan_files_with_dense_products(tmp_path, monkeypatch, rowwise):
    if rowwise:
        monkeypatch.setattr(cost, "_CPU", dataclasses.replace(cost._CPU, pair_list_max_bytes=1.0))
    pats = _random_chain(13, 24, 0.3, seed=3)
    g = torch.Generator().manual_seed(0)
    vals = [torch.randn(2, p.nnz, generator=g, dtype=torch.float64) for p in pats]
    grad = torch.randn(2, pats[-1].shape[1], generator=g, dtype=torch.float64)
    ref = _grads(spscan.plan(pats, levels=0, backend="torch", dtype=torch.float64), vals, grad)
    scale = max(float(r.abs().max()) for r in ref)
    for levels in (1, 2, 3):
        plan = spscan.plan(pats, levels=levels, backend="torch", dtype=torch.float64)
        dense = [m for m in _products(plan) if m.pattern.is_full]
        if levels >= 2:
            assert dense and all(isinstance(m.pattern, FullPattern) for m in dense)
            assert any(m.algo == ("rows" if rowwise else "pairs") for m in dense)
        out = _grads(plan, vals, grad)
        assert max(float((a - b).abs().max()) for a, b in zip(out, ref)) <= 1e-10 * scale
        path = tmp_path / f"plan{levels}.npz"
        plan.save(path)
        loaded = spscan.load_plan(path)
        lmats = loaded._scan.mats
        for mid, m in plan._scan.mats.items():
            assert lmats[mid].pattern.key == m.pattern.key and lmats[mid].algo == m.algo
            if m.algo != "input" and m.pattern.is_full:
                assert isinstance(lmats[mid].pattern, FullPattern)
        assert loaded.summary() == plan.summary()
        est, lest = estimate_memory(plan._scan), estimate_memory(loaded._scan)
        assert lest.index_bytes == est.index_bytes
        out2 = _grads(loaded, vals, grad)
        assert all(torch.equal(a, b) for a, b in zip(out, out2))


def test_composite_with_a_dense_product():
    pats = _random_chain(6, 12, 0.4, seed=1)
    comp = spscan.plan_composite(pats)
    ref = pats[0]
    for p in pats[1:]:
        ref = ref @ p
    pat = comp.composite_pattern
    assert pat.shape == ref.shape
    dense = comp._scan.mats[comp._scan.schedule.root[0]].pattern.is_full
    if dense:
        assert pat.nnz == ref.shape[0] * ref.shape[1]
    else:
        assert pat.nnz == sp.csr_array(ref).nnz


@pytest.mark.parametrize("atomic_free", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rowwise_full_output_without_keys(atomic_free, dtype):
    """A full ``C`` over sparse factors (few pairs per entry: no dense accumulator on the NumPy path)."""
    rng = np.random.default_rng(0)
    a_s = sp.csr_array((rng.random((40, 30)) < 0.05).astype(np.float64))
    b_s = sp.csr_array((rng.random((30, 50)) < 0.05).astype(np.float64))
    a, b, c = as_pattern(a_s), as_pattern(b_s), full_pattern(40, 50)
    t = rows_torch_table(a, b, c, torch.device("cpu"), chunk_pairs=7, atomic_free=atomic_free)
    assert t.c_keys is None and "c_keys" not in t.dev
    assert not t.dense_acc or atomic_free is False
    av = torch.randn(3, a.nnz, dtype=dtype, generator=torch.Generator().manual_seed(1))
    bv = torch.randn(3, b.nnz, dtype=dtype, generator=torch.Generator().manual_seed(2))
    out = spgemm_rows_torch(t, av, bv)
    for s in range(3):
        am = sp.csr_array((av[s].double().numpy(), a.indices, a.indptr), shape=a.shape)
        bm = sp.csr_array((bv[s].double().numpy(), b.indices, b.indptr), shape=b.shape)
        want = (am @ bm).toarray().reshape(-1)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        np.testing.assert_allclose(out[s].double().numpy(), want, rtol=tol, atol=tol)


# --- bindings of one plan share their tables ---------------------------------------------------

def _table_ops(bound) -> list:
    """The ops of a binding's program that hold index tables (an Apply holds none)."""
    return [op for st in bound.program.steps for op in st.ops if type(op).__name__ != "Apply"]


@pytest.mark.parametrize("levels", [0, 1, 2])
def test_model_bindings_share_tables(levels):
    """A model plan binds with and without dl/dx_0: the second binding reuses every table of the first
    (the same objects) but the one that left the last mat-vec out, and the estimate of both equals what
    they hold, exactly."""
    net = _conv_net(1)
    x = torch.randn(2, 2, 16, 16, dtype=torch.float64)
    plan = spscan.plan(net, x, prune_zeros=True, levels=levels)
    core = plan.core
    with_x0, without_x0 = (core.bind([u.shared for u in plan.units], None, None, plan.operator_flags, f)
                           for f in (True, False))
    assert len(core.bindings()) == 2 and without_x0.program.skipped_first
    first_ids = {id(op) for op in _table_ops(with_x0)}
    differ = [op for op in _table_ops(without_x0) if id(op) not in first_ids]
    assert len(differ) <= 1 and len(_table_ops(without_x0)) >= len(_table_ops(with_x0)) - 1
    held_one = held_index_bytes(core._scan, with_x0.program, with_x0.tables)
    held_both = _held(plan)
    assert held_both - held_one == held_index_bytes(core._scan, with_x0.program, with_x0.tables, differ,
                                                    [t for st in without_x0.tables.steps for o, t in st
                                                     if any(o is d for d in differ)]) - held_one
    assert _estimate(plan).index_bytes == held_both
    sig = [(k[0], k[1], k[3], k[4]) for k, b in core._bound.items() if b is with_x0]
    assert estimate_memory(core._scan, sig).index_bytes == held_one


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chain_bindings_share_tables_and_gradients(backend):
    """Random chains (CSR linear runs in the middle, dense-stored products): the binding without dl/dx_0
    shares all but the tables that differ, and gives the other gradients bit for bit."""
    pats = _random_chain(9, 12, 0.3, seed=5)
    plan = spscan.plan(pats, levels=1, backend=backend, dtype=torch.float64)
    full = plan.bind()
    part = plan.bind(first_output=False)
    shared = {id(op) for op in _table_ops(full)} & {id(op) for op in _table_ops(part)}
    assert shared and len(shared) >= len(_table_ops(part)) - 1
    if backend == "torch":
        assert _estimate(plan).index_bytes == _held(plan)
    g = torch.Generator().manual_seed(4)
    vals = [torch.randn(2, p.nnz, generator=g, dtype=torch.float64) for p in pats]
    grad = torch.randn(2, pats[-1].shape[1], generator=g, dtype=torch.float64)
    a, b = full.run(vals, grad).grads, part.run(vals, grad).grads
    assert b[0] is None and all(torch.equal(u, v) for u, v in zip(a[1:], b[1:]))
    ref = spscan.backward(spscan.plan(pats, levels=0, backend="torch", dtype=torch.float64), vals, grad)
    scale = max(float(r.abs().max()) for r in ref)
    assert max(float((u - r).abs().max()) for u, r in zip(a, ref)) <= 1e-10 * scale


def test_dense_stored_pair_products_hold_O_pairs():
    """A product computed from pair lists and stored densely keeps the pair lists of its own pattern (and
    that pattern): O(pairs + nnz), no per-position pointer over the dense block; its lowered segments are
    its own entries, written at their dense positions after the block is zeroed."""
    pats = _random_chain(13, 24, 0.3, seed=2)
    plan = spscan.plan(pats, levels=2, backend="torch", dtype=torch.float64)
    scan = plan._scan
    nodes = [m for mid, m in scan.mats.items() if m.algo == "pairs"]
    scatter = [m for m in nodes if m.scatters]
    assert scatter
    for m in scatter:
        own = m.sym.pattern
        assert isinstance(m.pattern, FullPattern) and m.densified and own.nnz < m.pattern.nnz
        assert m.sym.pair_ptr.shape == (own.nnz + 1,)
        # pair_a, pair_b, the pointer, the own pattern's row starts and columns: nothing of size rows * cols
        assert held_index_bytes(m.sym) == 8 * (2 * m.sym.npairs + own.nnz + 1 + own.rows + 1 + own.nnz)
    spmm = [op for st in plan.bindings()[0].program.steps for op in st.ops if type(op).__name__ == "SpMM"]
    assert sum(b.out.size for op in spmm for b in op.bins) == sum(m.sym.pattern.nnz for m in nodes)
    assert sum(size for op in spmm for _, size in op.clear) == sum(m.pattern.nnz for m in scatter)
    assert _estimate(plan).index_bytes == _held(plan)
