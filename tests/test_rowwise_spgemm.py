"""The row-wise (O(nnz) index) numeric SpGEMM against SciPy and the planned pair-list product.

Patterns are drawn by hypothesis (empty rows and matrices, dense rows, diagonal, rectangular,
1x1); values are float64 and float32, shared ``(nnz,)`` or per sample ``(B, nnz)``. Both
backends: the torch implementation (CPU accumulation and the atomic-free slot order, tiny
row blocks so several blocks run) and the Triton kernel in the interpreter (a handful of
programs per case). The Triton kernel is also compiled ahead of time for sm_80 and sm_90.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spscan  # noqa: F401  (sets up Triton's interpreter on CPU-only machines before triton is imported)
from spscan.kernels.triton import launch
from spscan.kernels.triton.aot import specs_to_json
from spscan.kernels.triton.spgemm_rows import RowProduct, rows_table, spgemm_rows, spgemm_rows_product
from spscan.kernels.spgemm_rows_torch import rows_torch_table, spgemm_rows_torch
from spscan.kernels.triton.backend import _compiled
from spscan.planner.patterns import Pattern, full_pattern, make_pattern
from spscan.planner.rowwise import (pair_list_bytes, row_pair_counts, rowwise_index_bytes,
                                    rowwise_symbolic)
from spscan.planner.symbolic import product_counts, spgemm_symbolic

from strategies import pattern as scipy_pattern

DEVICE = torch.device("cuda") if _compiled() else torch.device("cpu")
TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-5)}


def _pat(m: sp.csr_array) -> Pattern:
    m = sp.csr_array(m)
    m.sort_indices()
    return make_pattern(m.shape, m.indptr, m.indices)


@st.composite
def operands(draw, max_dim: int = 7):
    """Patterns A (m, k), B (k, p), sometimes with a forced full row / empty row, and the output storage."""
    m, k, p = (draw(st.integers(1, max_dim)) for _ in range(3))
    a = draw(scipy_pattern(m, k)).toarray() != 0
    b = draw(scipy_pattern(k, p)).toarray() != 0
    if draw(st.booleans()):
        a[draw(st.integers(0, m - 1))] = True  # a dense row of A: many pairs per output entry
    if draw(st.booleans()):
        b[draw(st.integers(0, k - 1))] = False
    return _pat(sp.csr_array(a.astype(float))), _pat(sp.csr_array(b.astype(float))), draw(st.booleans())


def _values(p: Pattern, batch, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (p.nnz,) if batch is None else (batch, p.nnz)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _scipy_reference(a: Pattern, b: Pattern, c: Pattern, av: torch.Tensor, bv: torch.Tensor) -> np.ndarray:
    """C's values in ``c``'s CSR order, per sample, from SciPy in float64."""
    batch = max([v.shape[0] for v in (av, bv) if v.dim() == 2], default=None)
    rows = c.row_of_entry()
    out = []
    for s in range(batch or 1):
        x = av[s] if av.dim() == 2 else av
        y = bv[s] if bv.dim() == 2 else bv
        A = sp.csr_array((x.double().numpy(), a.indices, a.indptr), shape=a.shape)
        B = sp.csr_array((y.double().numpy(), b.indices, b.indptr), shape=b.shape)
        out.append((A @ B).toarray()[rows, c.indices])
    return np.stack(out) if batch else out[0]


def _pair_list_product(a: Pattern, b: Pattern, dense_out: bool, av: torch.Tensor, bv: torch.Tensor):
    """The planned pair-list product: ``C[c] = sum over planned pairs of A[pa] * B[pb]``, float64."""
    sym = spgemm_symbolic(a, b, dense_out=dense_out)
    prod = av.double()[..., sym.pair_a] * bv.double()[..., sym.pair_b]
    seg = np.repeat(np.arange(sym.pattern.nnz), np.diff(sym.pair_ptr))
    out = torch.zeros(prod.shape[:-1] + (sym.pattern.nnz,), dtype=torch.float64)
    out.index_add_(-1, torch.as_tensor(seg, dtype=torch.int64), prod)
    return sym.pattern, out


def _check(a, b, dense_out, batch_a, batch_b, dtype, run):
    sym = rowwise_symbolic(a, b, dense_out=dense_out)
    pairs_pattern, pairs_vals = None, None
    av, bv = _values(a, batch_a, dtype, 1), _values(b, batch_b, dtype, 2)
    got = run(sym, av, bv)
    ref = _scipy_reference(a, b, sym.pattern, av, bv)
    assert got.dtype == dtype and tuple(got.shape) == tuple(ref.shape)
    torch.testing.assert_close(got.double().cpu(), torch.as_tensor(ref), **TOL[dtype])
    pairs_pattern, pairs_vals = _pair_list_product(a, b, dense_out, av, bv)
    assert np.array_equal(pairs_pattern.indptr, sym.pattern.indptr)
    assert np.array_equal(pairs_pattern.indices, sym.pattern.indices)
    torch.testing.assert_close(got.double().cpu(), pairs_vals, **TOL[dtype])
    again = run(sym, av, bv)
    assert torch.equal(got, again), "row-wise product is not bitwise reproducible"


def _torch_runner(atomic_free: bool, chunk_pairs: int):
    def run(sym, av, bv):
        t = rows_torch_table(sym.a, sym.b, sym.pattern, torch.device("cpu"), chunk_pairs=chunk_pairs,
                             atomic_free=atomic_free)
        return spgemm_rows_torch(t, av, bv)
    return run


def _triton_run(sym, av, bv):
    return spgemm_rows_product(sym.a, sym.b, sym.pattern, av.to(DEVICE), bv.to(DEVICE)).cpu()


# --- symbolic side ---------------------------------------------------------------------

@settings(max_examples=60)
@given(operands())
def test_symbolic_pattern_matches_pair_lists(ops):
    a, b, dense_out = ops
    sym = rowwise_symbolic(a, b, dense_out=dense_out)
    ref = spgemm_symbolic(a, b, dense_out=dense_out)
    assert np.array_equal(sym.pattern.indptr, ref.pattern.indptr)
    assert np.array_equal(sym.pattern.indices, ref.pattern.indices)
    assert sym.npairs == ref.npairs == product_counts(a, b)
    per_row = np.bincount(ref.pattern.row_of_entry(), weights=np.diff(ref.pair_ptr), minlength=a.rows)
    assert np.array_equal(row_pair_counts(a, b), per_row.astype(np.int64))
    assert sym.index_bytes == rowwise_index_bytes(a, b, sym.pattern)


def test_index_memory_is_linear_in_nnz_not_in_pairs():
    """A dense row times a dense matrix: pairs grow as m*k*p, the row-wise tables as nnz."""
    a, b = full_pattern(64, 64), full_pattern(64, 64)
    sym = rowwise_symbolic(a, b)
    assert sym.npairs == 64 ** 3
    assert sym.index_bytes < pair_list_bytes(sym.npairs, sym.pattern.nnz) / 20
    with pytest.raises(ValueError, match="inner dimensions"):
        rowwise_symbolic(full_pattern(2, 3), full_pattern(2, 3))
    with pytest.raises(ValueError, match="out pattern has shape"):
        rowwise_symbolic(full_pattern(2, 3), full_pattern(3, 2), out=full_pattern(3, 3))


# --- torch backend ----------------------------------------------------------------------

@settings(max_examples=80)
@given(operands(), st.sampled_from([(None, None), (3, None), (None, 2), (2, 2)]),
       st.sampled_from([torch.float64, torch.float32]), st.booleans(), st.sampled_from([1, 5, 1 << 20]))
def test_torch_rowwise_matches_scipy_and_pairs(ops, batches, dtype, atomic_free, chunk_pairs):
    a, b, dense_out = ops
    _check(a, b, dense_out, *batches, dtype, _torch_runner(atomic_free, chunk_pairs))


def test_torch_rowwise_edges():
    one = full_pattern(1, 1)
    sym = rowwise_symbolic(one, one)
    t = rows_torch_table(one, one, sym.pattern, torch.device("cpu"))
    out = spgemm_rows_torch(t, torch.tensor([3.0], dtype=torch.float64), torch.tensor([[2.0], [-1.0]],
                                                                                      dtype=torch.float64))
    assert out.tolist() == [[6.0], [-3.0]]
    empty = make_pattern((3, 4), np.zeros(4, np.int64), np.zeros(0, np.int64))
    sym = rowwise_symbolic(empty, full_pattern(4, 2), dense_out=True)
    t = rows_torch_table(empty, full_pattern(4, 2), sym.pattern, torch.device("cpu"))
    buf = torch.full((2, 6), 7.0)
    spgemm_rows_torch(t, torch.zeros(2, 0), torch.ones(2, 8), out=buf)
    assert torch.equal(buf, torch.zeros(2, 6))  # unreached entries of a dense output are computed zeros
    with pytest.raises(ValueError, match="expected A values"):
        spgemm_rows_torch(t, torch.zeros(2, 1), torch.ones(2, 8))
    with pytest.raises(ValueError, match="batch sizes differ"):
        spgemm_rows_torch(t, torch.zeros(2, 0), torch.ones(3, 8))
    with pytest.raises(TypeError, match="dtype"):
        spgemm_rows_torch(t, torch.zeros(2, 0, dtype=torch.float64), torch.ones(2, 8))


def test_torch_rowwise_writes_into_an_arena_view():
    rng = np.random.default_rng(3)
    a = _pat(sp.csr_array((rng.random((9, 7)) < 0.4).astype(float)))
    b = _pat(sp.csr_array((rng.random((7, 11)) < 0.5).astype(float)))
    sym = rowwise_symbolic(a, b)
    av, bv = _values(a, 4, torch.float64, 5), _values(b, 4, torch.float64, 6)
    arena = torch.full((4, sym.pattern.nnz + 10), -1.0, dtype=torch.float64)
    t = rows_torch_table(a, b, sym.pattern, torch.device("cpu"), chunk_pairs=7)
    spgemm_rows_torch(t, av, bv, out=arena[:, 5 : 5 + sym.pattern.nnz])
    assert torch.all(arena[:, :5] == -1) and torch.all(arena[:, 5 + sym.pattern.nnz :] == -1)
    ref = _scipy_reference(a, b, sym.pattern, av, bv)
    torch.testing.assert_close(arena[:, 5 : 5 + sym.pattern.nnz], torch.as_tensor(ref), rtol=1e-12, atol=1e-12)


# --- Triton backend (interpreter on CPU) ------------------------------------------------

@settings(max_examples=40)
@given(operands(max_dim=5), st.sampled_from([(None, None), (3, None), (None, 2), (2, 2)]),
       st.sampled_from([torch.float64, torch.float32]))
def test_triton_rowwise_matches_scipy_and_pairs(ops, batches, dtype):
    a, b, dense_out = ops
    _check(a, b, dense_out, *batches, dtype, _triton_run)


@pytest.mark.parametrize("mode", ["interpret", "device"])
def test_triton_rowwise_step_of_several_products(mode):
    """One launch over two products at arena offsets, with B rows longer than one chunk in GPU tiles."""
    rng = np.random.default_rng(7)
    a1 = _pat(sp.csr_array((rng.random((5, 6)) < 0.5).astype(float)))
    b1 = _pat(sp.csr_array(np.ones((6, 150))))  # 150 > the GPU chunk of 128: two chunks per B row
    a2 = _pat(sp.csr_array((rng.random((4, 6)) < 0.5).astype(float)))
    b2 = _pat(sp.csr_array((rng.random((6, 12)) < 0.3).astype(float)))  # sparse output rows: searched positions
    s1, s2 = rowwise_symbolic(a1, b1), rowwise_symbolic(a2, b2)
    off = dict(a1=3, a2=3 + a1.nnz + 2, b1=1, b2=1 + b1.nnz, c1=4, c2=4 + s1.pattern.nnz + 3)
    size_a, size_b = off["a2"] + a2.nnz + 1, off["b2"] + b2.nnz
    size_c = off["c2"] + s2.pattern.nnz + 2
    dtype, batch = torch.float64, 3
    A = torch.randn(batch, size_a, dtype=dtype)
    B = torch.randn(size_b, dtype=dtype)  # shared right factor
    C = torch.full((batch, size_c), 9.0, dtype=dtype)
    prods = [RowProduct(a1, b1, s1.pattern, off["a1"], off["b1"], off["c1"]),
             RowProduct(a2, b2, s2.pattern, off["a2"], off["b2"], off["c2"])]
    table = rows_table(prods, (size_a, size_b, size_c), DEVICE)
    saved = launch.mode
    launch.mode = mode
    try:
        if mode == "device" and not _compiled():
            assert launch.interpreting() is False
        dev = lambda x: x.to(DEVICE)  # noqa: E731
        Cd = dev(C)
        spgemm_rows(table, dev(A), dev(B), Cd)
    finally:
        launch.mode = saved
    Cd = Cd.cpu()
    for (a, b, s), (ka, kb, kc) in zip(((a1, b1, s1), (a2, b2, s2)), (("a1", "b1", "c1"), ("a2", "b2", "c2"))):
        av = A[:, off[ka] : off[ka] + a.nnz]
        bv = B[off[kb] : off[kb] + b.nnz]
        ref = _scipy_reference(a, b, s.pattern, av, bv)
        torch.testing.assert_close(Cd[:, off[kc] : off[kc] + s.pattern.nnz], torch.as_tensor(ref),
                                   rtol=1e-12, atol=1e-12)
    untouched = torch.ones(size_c, dtype=torch.bool)
    untouched[off["c1"] : off["c1"] + s1.pattern.nnz] = False
    untouched[off["c2"] : off["c2"] + s2.pattern.nnz] = False
    assert torch.all(Cd[:, untouched] == 9.0)
    assert table.npairs == s1.npairs + s2.npairs
    assert table.index_bytes() <= rowwise_index_bytes(a1, b1, s1.pattern) + rowwise_index_bytes(a2, b2, s2.pattern)


def test_triton_rowwise_rejects_mismatched_sharing():
    a = full_pattern(2, 2)
    s = rowwise_symbolic(a, a)
    table = rows_table([RowProduct(a, a, s.pattern, 0, 0, 0)], (4, 4, 4), DEVICE)
    with pytest.raises(ValueError, match="shared exactly when"):
        spgemm_rows(table, torch.zeros(4, device=DEVICE), torch.zeros(4, device=DEVICE),
                    torch.zeros(1, 4, device=DEVICE))
    with pytest.raises(ValueError, match="do not chain"):
        rows_table([RowProduct(a, full_pattern(3, 2), s.pattern, 0, 0, 0)], (4, 4, 4), DEVICE)


# --- ahead-of-time compilation for sm_80 / sm_90 ---------------------------------------

def _record_specs() -> list:
    """Launch specs of the GPU configurations for every operand sharing, both dtypes and index widths."""
    rng = np.random.default_rng(2)
    a = _pat(sp.csr_array((rng.random((6, 5)) < 0.5).astype(float)))
    b = _pat(sp.csr_array(np.ones((5, 200))))
    s = rowwise_symbolic(a, b)
    specs = []
    saved = launch.mode
    launch.mode = "device"
    try:
        for sizes in ((100, 1000, 1000), (1 << 32, 1000, 1000)):  # int32 and int64 index tables
            table = rows_table([RowProduct(a, b, s.pattern, 0, 0, 0)], sizes, torch.device("cpu"))
            for dtype in (torch.float32, torch.float64):
                for a_sh, b_sh, batch in ((False, False, 16), (True, False, 16), (False, True, 3), (True, True, 1)):
                    mk = lambda shared, n: torch.zeros((n,) if shared else (batch, n), dtype=dtype)  # noqa: E731
                    c = mk(a_sh and b_sh, s.pattern.nnz)
                    with launch.recording(dry_run=True) as rec:
                        spgemm_rows(table, mk(a_sh, a.nnz), mk(b_sh, b.nnz), c)
                    specs += rec
    finally:
        launch.mode = saved
    return specs


def test_rowwise_kernel_compiles_for_cuda(tmp_path):
    specs = _record_specs()
    assert {s.kernel for s in specs} == {"spgemm_rows_kernel"}
    payload = json.loads(specs_to_json(specs))
    assert {dict(s["signature"])["row_a"] for s in payload} == {"*i32", "*i64"}
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(payload))
    env = dict(os.environ, TRITON_INTERPRET="0")
    procs = {cap: subprocess.Popen([sys.executable, "-m", "spscan.kernels.triton.aot", str(path), str(cap)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for cap in (80, 90)}
    for cap, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        lines = out.splitlines()
        assert proc.returncode == 0, "\n".join(ln for ln in lines if ln.startswith("FAIL")) or err[-3000:]
        assert len([ln for ln in lines if ln.startswith("ok")]) == len(payload)


# --- the planner's choice and the scan through both backends ---------------------------

@pytest.fixture
def rowwise_everywhere(monkeypatch):
    """A CPU profile whose pair-list cap is zero: every sparse product runs row-wise."""
    import dataclasses

    from spscan.planner import cost

    monkeypatch.setattr(cost, "_CPU", dataclasses.replace(cost._CPU, pair_list_max_bytes=0.0))
    return cost._CPU


def _reference_error(pats, levels, backend, dtype, batch=2, seed=0):
    plan = spscan.plan(pats, levels=levels, backend=backend, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    vals = [torch.randn((batch, p.nnz) if i % 2 else (p.nnz,), generator=g, dtype=torch.float64)
            for i, p in enumerate(pats)]
    grad = torch.randn(batch, pats[-1].shape[1], generator=g, dtype=torch.float64)
    ref = spscan.reference_backward(pats, vals, grad)
    got = spscan.backward(plan, [v.to(dtype) for v in vals], grad.to(dtype))
    scale = max(1.0, max(float(r.abs().max()) for r in ref))
    return plan, max(float((a.double() - r).abs().max()) for a, r in zip(got, ref)) / scale


@settings(max_examples=30, suppress_health_check=[HealthCheck.function_scoped_fixture])  # the patch is the same for all
@given(st.data())
def test_scan_with_rowwise_products_equals_reference(rowwise_everywhere, data):
    from strategies import chain

    pats = data.draw(chain(max_n=7, max_dim=6))
    levels = data.draw(st.sampled_from([1, 2, "full"]))
    plan, err = _reference_error(pats, levels, "torch", torch.float64)
    assert err <= 1e-12
    # the cap of zero sends every sparse product with any pair row-wise
    assert all(m.algo != "pairs" or m.sym.npairs == 0 for m in plan._scan.mats.values())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rowwise_scan_both_backends(rowwise_everywhere, backend, dtype):
    rng = np.random.default_rng(4)
    dims = [6, 9, 7, 8, 5, 9, 4]
    pats = [sp.csr_array((rng.random((dims[i], dims[i + 1])) < 0.25).astype(float)) for i in range(6)]
    plan, err = _reference_error(pats, "full", backend, dtype)
    assert err <= (1e-12 if dtype == torch.float64 else 1e-5)
    assert any(m.algo == "rows" for m in plan._scan.mats.values())


def test_planner_picks_rowwise_only_when_pair_lists_are_large():
    from spscan.planner.cost import profile_for
    from spscan.planner.patterns import PatternTable
    from spscan.planner.storage import _Products, dense_storage_by_cost

    cpu = profile_for("cpu")
    table = PatternTable()
    small = table.intern(_pat(sp.csr_array(np.eye(50))))
    products = _Products(table, cpu)
    assert products.product(small, small).algo == "pairs"
    # a (2000 x 2000) product with 100 pairs per entry: pair lists ~ 0.5 GiB > the CPU cap of 256 MiB
    a = table.intern(_pat(sp.random(2000, 2000, density=0.05, format="csr", random_state=1)))
    info = products.product(a, a)
    assert products.rowwise(a, a) and info.algo == "rows"
    assert info.rw.npairs == product_counts(a, a)
    assert products.index_estimate(a, a) < pair_list_bytes(info.rw.npairs, 0) / 10
    assert info.pattern.is_full == dense_storage_by_cost(2000, 2000, structural_product_nnz(a), cpu)
    # the storage rule follows the consumer's rates: dense when a GEMV of all entries beats an SpMV of nnz
    assert dense_storage_by_cost(100, 100, 10_000, cpu) and not dense_storage_by_cost(100, 100, 100, cpu)


def structural_product_nnz(a: Pattern) -> int:
    from spscan.planner.rowwise import structural_product

    return structural_product(a, a).nnz


def test_memory_estimate_counts_rowwise_tables(rowwise_everywhere):
    from spscan.planner.memory import estimate_memory

    rng = np.random.default_rng(5)
    pats = [sp.csr_array((rng.random((30, 30)) < 0.05).astype(float)) for _ in range(4)]
    plan = spscan.plan(pats, levels=2, backend="torch")
    rows = [m for m in plan._scan.mats.values() if m.algo == "rows"]
    assert rows
    est = estimate_memory(plan._scan)
    assert est.plan_bytes >= sum(m.rw.index_bytes for m in rows)
