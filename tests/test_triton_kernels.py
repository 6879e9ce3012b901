"""The Triton backend against the torch backend and the float64 reference, in Triton's interpreter.

Every kernel (numeric SpGEMM, batched SpMV, dense GEMM with and without ``tl.dot``, dense GEMV)
runs through ``spscan.plan(..., backend="triton")`` + ``spscan.backward`` with float32 and
float64, shared and per-sample operands, empty segments and odd sizes, under both families of
launch configurations (the interpreter's large tiles and the GPU tiles). Grids are kept to a
few programs: the interpreter costs milliseconds per program instance.
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spscan
from spscan.kernels.triton import launch
from spscan.kernels.triton.segments import SegmentTable
from spscan.kernels.triton.backend import TritonTables, _compiled, _SpMMLaunch, _SpMVLaunch
from spscan.reference import reference_backward

DTYPES = (torch.float64, torch.float32)
# interpreted kernels take CPU tensors; where a GPU makes them compiled, the same tests run on it
DEVICE = torch.device("cuda") if _compiled() else torch.device("cpu")


def _dev(items):
    if items is None:
        return None
    if isinstance(items, torch.Tensor):
        return items.to(DEVICE)
    return [None if t is None else t.to(DEVICE) for t in items]
F32_FLOOR = 1e-6  # relative error floor: a few float32 ulps


# --- problem builders -------------------------------------------------------------------

def _csr(dense_mask: np.ndarray) -> sp.csr_array:
    m = sp.csr_array(dense_mask.astype(np.float64))
    m.sort_indices()
    return m


def random_pattern(rng: np.random.Generator, rows: int, cols: int, density: float,
                   empty_rows: int = 0, long_row: bool = False) -> sp.csr_array:
    """A canonical pattern with some rows left empty and optionally one full row (a long segment)."""
    mask = rng.random((rows, cols)) < density
    if empty_rows:
        mask[rng.choice(rows, size=min(empty_rows, rows), replace=False)] = False
    if long_row:
        mask[rows // 2] = True
    return _csr(mask)


def band(n: int, offsets: Sequence[int]) -> sp.csr_array:
    i = np.arange(n)
    mask = np.zeros((n, n), dtype=bool)
    for o in offsets:
        j = i + o
        ok = (j >= 0) & (j < n)
        mask[i[ok], j[ok]] = True
    return _csr(mask)


def full(rows: int, cols: int) -> sp.csr_array:
    return _csr(np.ones((rows, cols), dtype=bool))


def make_values(pats, shared: Sequence[bool], batch: int, dtype: torch.dtype, seed: int):
    """Values scaled by 1/sqrt(row length) so long chains neither blow up nor vanish."""
    gen = torch.Generator().manual_seed(seed)
    vals = []
    for p, s in zip(pats, shared):
        shape = (p.nnz,) if s else (batch, p.nnz)
        scale = 1.0 / np.sqrt(max(1.0, p.nnz / max(1, p.shape[1])))
        vals.append((torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype))
    return vals


def make_extra(pats, batch: int, dtype: torch.dtype, seed: int, every: int = 2):
    gen = torch.Generator().manual_seed(seed + 1)
    dims = [p.shape[0] for p in pats] + [pats[-1].shape[1]]
    return [torch.randn(batch, d, generator=gen, dtype=torch.float64).to(dtype) if i % every == 1 else None
            for i, d in enumerate(dims)]


def sequential_f32(pats, vals, grad: torch.Tensor, extra) -> list[torch.Tensor]:
    """Plain float32 backprop with explicit dense ``J^T`` (the error yardstick for float32)."""
    n = len(pats)
    g = grad.float()
    if extra is not None and extra[n] is not None:
        g = g + extra[n].float()
    out = [None] * (n + 1)
    out[n] = g
    for i in range(n, 0, -1):
        p = pats[i - 1]
        rows = np.repeat(np.arange(p.shape[0]), np.diff(p.indptr))
        v = vals[i - 1].float()
        dense = torch.zeros((v.shape[0] if v.dim() == 2 else 1, *p.shape), dtype=torch.float32)
        dense[:, torch.as_tensor(rows), torch.as_tensor(p.indices.astype(np.int64))] = v if v.dim() == 2 else v[None]
        g = torch.matmul(dense, g[:, :, None])[:, :, 0]
        if extra is not None and extra[i - 1] is not None:
            g = g + extra[i - 1].float()
        out[i - 1] = g
    return out


def rel_err(got: Sequence[torch.Tensor], ref: Sequence[torch.Tensor]) -> float:
    worst = 0.0
    for o, r in zip(got, ref):
        scale = float(r.abs().max()) if r.numel() else 0.0
        if scale > 0:
            worst = max(worst, float((o.double().cpu() - r).abs().max()) / scale)
    return worst


def check_case(pats, shared, dtype, levels, batch: int = 3, extra_every: Optional[int] = None, seed: int = 0):
    """Triton vs reference (and vs torch backend), plus bitwise repeatability; returns the plan."""
    vals = make_values(pats, shared, batch, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    grad = torch.randn(batch, pats[-1].shape[1], generator=gen, dtype=torch.float64).to(dtype)
    extra = None if extra_every is None else make_extra(pats, batch, dtype, seed, extra_every)

    plan_t = spscan.plan(pats, levels=levels, backend="triton")
    got = spscan.backward(plan_t, _dev(vals), _dev(grad), _dev(extra))
    again = spscan.backward(plan_t, _dev(vals), _dev(grad), _dev(extra))
    assert all(torch.equal(a, b) for a, b in zip(got, again)), "triton backend is not bitwise repeatable"

    ref = reference_backward(pats, vals, grad, extra)
    torch_out = spscan.backward(spscan.plan(pats, levels=levels, backend="torch"), vals, grad, extra)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in ref]
    err = rel_err(got, ref)
    if dtype == torch.float64:
        assert err <= 1e-10, f"float64 relative error {err:.3e} > 1e-10"
        assert rel_err(got, [t.double() for t in torch_out]) <= 1e-10
    else:
        seq = rel_err(sequential_f32(pats, vals, grad, extra), ref)
        bound = 2 * seq + F32_FLOOR
        assert err <= bound, f"float32 relative error {err:.3e} > 2 x sequential float32 ({seq:.3e}) + floor"
    return plan_t


@pytest.fixture(params=["interpret", "device"])
def config_family(request):
    """Run under the interpreter's large tiles and under the GPU tiles (more programs, small problems)."""
    if request.param == "interpret" and _compiled():
        pytest.skip("interpreter tile sizes are for TRITON_INTERPRET=1 runs, not compiled kernels")
    saved = launch.mode
    launch.mode = request.param
    yield request.param
    launch.mode = saved


def _tables(plan) -> list[TritonTables]:
    return [b.tables for b in plan.bindings()]


def _segment_tables(plan, kind) -> list[SegmentTable]:
    return [item.table for t in _tables(plan) for step in t.steps for item in step if isinstance(item, kind)]


# --- sparse primitives: numeric SpGEMM and SpMV ------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("sharing", ["sample", "shared", "mixed"])
def test_sparse_chain(config_family, dtype, sharing):
    rng = np.random.default_rng(11)
    dims = [13, 29, 31, 17, 29, 23, 9]
    pats = [random_pattern(rng, dims[i], dims[i + 1], 0.22, empty_rows=2) for i in range(len(dims) - 1)]
    shared = {"sample": [False] * 6, "shared": [True] * 6, "mixed": [True, False, True, True, False, False]}[sharing]
    plan = check_case(pats, shared, dtype, "full", batch=3, extra_every=2)
    # rows with no entries are empty SpMV segments (output = the affine term)
    assert any(int(t.lengths.min()) == 0 for t in _segment_tables(plan, _SpMVLaunch))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_spgemm_empty_segments(config_family, dtype):
    """Banded products are stored densely, so some positions of a dense block have no planned pairs: the
    launch zeroes the block and its segments cover only the own pattern's entries (none empty)."""
    pats = [band(12, [-1, 0, 1])] * 4 + [band(12, [0, 3])] * 3
    plan = check_case(pats, [False, True] * 3 + [False], dtype, "full", batch=2)
    dense = [item for t in _tables(plan) for step in t.steps for item in step
             if isinstance(item, _SpMMLaunch) and item.op.clear]
    assert dense and all(int(item.table.lengths.min()) > 0 for item in dense)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_long_segments_loop(dtype):
    """A full row among short ones: GPU tiles pick a narrow chunk, so the long segment loops."""
    saved = launch.mode
    launch.mode = "device"
    try:
        rng = np.random.default_rng(5)
        pats = [random_pattern(rng, 300, 300, 0.01, long_row=True) for _ in range(3)]
        plan = check_case(pats, [False, True, False], dtype, 1, batch=2)
        tables = _segment_tables(plan, _SpMMLaunch) + _segment_tables(plan, _SpMVLaunch)
        itemsize = 8 if dtype == torch.float64 else 4
        assert any(t.max_len > t.width(itemsize, False) for t in tables)
    finally:
        launch.mode = saved


@pytest.mark.parametrize("levels", [0, 1, "full"])
def test_levels_and_batch_one(config_family, levels):
    rng = np.random.default_rng(3)
    dims = [5, 8, 1, 7, 7, 3]
    pats = [random_pattern(rng, dims[i], dims[i + 1], 0.5) for i in range(len(dims) - 1)]
    check_case(pats, [False, True, False, False, True], torch.float64, levels, batch=1, extra_every=3)


# --- dense nodes: batched GEMM (tl.dot and fallback) and GEMV ----------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("sharing", ["sample", "shared", "mixed"])
def test_dense_dot_path(config_family, dtype, sharing):
    """20 x 20 nodes (the paper's RNN): tiles pad to 32, tl.dot."""
    pats = [full(20, 20)] * 6
    shared = {"sample": [False] * 6, "shared": [True] * 6, "mixed": [False, True, False, False, True, False]}[sharing]
    check_case(pats, shared, dtype, "full", batch=3, extra_every=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_dense_small_fallback(config_family, dtype):
    """Odd rectangular nodes below 16: the rank-1-update path; mixed operand kinds."""
    dims = [7, 3, 5, 11, 2, 9, 6]
    pats = [full(dims[i], dims[i + 1]) for i in range(len(dims) - 1)]
    check_case(pats, [False, True, True, False, False, True], dtype, "full", batch=3, extra_every=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_dense_odd_and_k_loop(dtype):
    """Odd sizes >= 16 with masked tiles; with GPU tiles k = 70 exceeds one tile, so the k loop runs."""
    saved = launch.mode
    launch.mode = "device"
    try:
        dims = [17, 70, 33, 70, 19, 21]
        pats = [full(dims[i], dims[i + 1]) for i in range(len(dims) - 1)]
        check_case(pats, [False, True, False, False, True], dtype, "full", batch=2, extra_every=2)
    finally:
        launch.mode = saved


def test_dense_64(config_family):
    """64 x 64 nodes (the larger RNN case): one k tile, tl.dot."""
    check_case([full(64, 64)] * 4, [False, False, True, False], torch.float32, "full", batch=2, extra_every=2)


# --- the linear-scan middle as one persistent launch -------------------------------------

def diag(n: int) -> sp.csr_array:
    return _csr(np.eye(n, dtype=bool))


def _lstm_step(h: int) -> tuple[sp.csr_array, sp.csr_array]:
    """The LSTM step's two elements: shared ``(2H, 5H)`` (nnz 4H^2 + H), per-sample ``(5H, 2H)`` (nnz 9H)."""
    eye, zero = np.eye(h, dtype=bool), np.zeros((h, h), dtype=bool)
    shared = _csr(np.block([[np.ones((h, 4 * h), dtype=bool), zero], [np.zeros((h, 4 * h), dtype=bool), eye]]))
    sample = _csr(np.block([[eye, eye], [eye, eye], [eye, eye], [eye, zero], [eye, eye]]))
    return shared, sample


_RNG = np.random.default_rng(23)
CSR_A = random_pattern(_RNG, 7, 7, 0.3, empty_rows=2, long_row=True)  # (7, 7)
CSR_B = random_pattern(_RNG, 9, 40, 0.2, empty_rows=3, long_row=True)  # (9, 40)
CSR_C = random_pattern(_RNG, 40, 1, 0.5, empty_rows=5)  # (40, 1)
CSR_D = random_pattern(_RNG, 5, 3, 0.5)  # (5, 3)
CSR_A2 = random_pattern(_RNG, 3, 9, 0.4, empty_rows=1)  # (3, 9)
LSTM_SHARED, LSTM_SAMPLE = _lstm_step(5)

CHAINS = {
    # uniform dense square chains up to 64 keep the vector in registers (ONE_TILE)
    "20-sample-affine": ([full(20, 20)] * 6, [False] * 6, 2),
    "20-shared": ([full(20, 20)] * 6, [True] * 6, None),
    "5-mixed-affine": ([full(5, 5)] * 6, [False] * 5 + [True], 3),
    # tiled path: m > 64, rectangular, diagonal (elementwise) steps, mixed kinds
    "70-shared-affine": ([full(70, 70)] * 5, [True] * 5, 2),
    "70-sample": ([full(70, 70)] * 4, [False] * 4, None),
    "rect-diag-mixed": ([full(9, 30), diag(30), full(30, 17), diag(17), full(17, 17), diag(17)],
                        [False, True, True, False, False, True], 2),
    # CSR steps (general patterns) in the same launch: empty rows, a long row, an all-empty 1 x 1,
    # rectangular, repeated patterns; shared and per sample, with and without affine terms
    "csr-mixed-affine": ([CSR_A, full(7, 9), CSR_B, diag(40), CSR_C, _csr(np.zeros((1, 1), dtype=bool)),
                          _csr(np.ones((1, 5), dtype=bool) & (np.arange(5) % 2 == 0)), CSR_D, CSR_A2],
                         [False, True, True, False, False, True, False, True, False], 2),
    "csr-sample": ([CSR_A, CSR_A, full(7, 9), CSR_B, diag(40)], [False] * 5, None),
    # the LSTM step as two sparse elements: shared [[W_hh^T, 0], [0, I]] and a per-sample 9H-entry factor
    "lstm-two-elements": ([LSTM_SHARED, LSTM_SAMPLE] * 3, [True, False] * 3, 1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CHAINS))
def test_vec_chain(config_family, dtype, case):
    """levels=0: the middle is one persistent chain launch."""
    pats, shared, extra_every = CHAINS[case]
    check_case(pats, shared, dtype, 0, batch=3, extra_every=extra_every)
    rec = _record(pats, shared, dtype, 0, extra_every=extra_every)[1]
    chains = [dict(s.constexprs) for s in rec if s.kernel == "linear_run_kernel"]
    assert len(chains) == 1 and len(rec) == 1  # every element, CSR ones included, inside the one launch
    assert chains[0]["ONE_TILE"] == (case.split("-")[0] in ("20", "5"))


# --- random chains ------------------------------------------------------------------------

@st.composite
def chains(draw):
    """Short chains mixing sparse, full and diagonal patterns (0-nnz rows, 1 x 1, rectangular)."""
    n = draw(st.integers(1, 6))
    dims = draw(st.lists(st.integers(1, 24), min_size=n + 1, max_size=n + 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    pats = []
    for i in range(n):
        kind = draw(st.sampled_from(["sparse", "full", "diag"] if dims[i] == dims[i + 1] else ["sparse", "full"]))
        if kind == "full":
            pats.append(full(dims[i], dims[i + 1]))
        elif kind == "diag":
            pats.append(_csr(np.eye(dims[i], dtype=bool)))
        else:
            pats.append(random_pattern(rng, dims[i], dims[i + 1], draw(st.sampled_from([0.1, 0.3, 0.7]))))
    shared = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    levels = draw(st.sampled_from([0, 1, "full"]))
    extra_every = draw(st.sampled_from([None, 1, 2]))
    batch = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from(DTYPES))
    return pats, shared, levels, extra_every, batch, dtype


@settings(max_examples=30)
@given(chains())
def test_random_chains(case):
    pats, shared, levels, extra_every, batch, dtype = case
    check_case(pats, shared, dtype, levels, batch=batch, extra_every=extra_every)


# --- what ran: every kernel variant, one launch per work table ---------------------------

def _record(pats, shared, dtype, levels, batch=2, extra_every=2):
    vals = make_values(pats, shared, batch, dtype, 0)
    grad = torch.zeros(batch, pats[-1].shape[1], dtype=dtype)
    extra = None if extra_every is None else make_extra(pats, batch, dtype, 0, extra_every)
    plan = spscan.plan(pats, levels=levels, backend="triton")
    with launch.recording(dry_run=True) as rec:
        spscan.backward(plan, _dev(vals), _dev(grad), _dev(extra))
    return plan, rec


def test_one_launch_per_work_table():
    rng = np.random.default_rng(2)
    dims = [9, 12, 12, 10, 12, 12, 8, 20, 20, 20]
    pats = [random_pattern(rng, dims[i], dims[i + 1], 0.4) for i in range(6)] + [full(8, 20)] + [full(20, 20)] * 2
    plan, rec = _record(pats, [False] * 9, torch.float32, "full")
    program = plan.bindings()[-1].program  # the binding the recorded run made (with extras)
    assert len(rec) == sum(len(st.ops) for st in program.steps)
    assert {"spgemm_kernel", "spmv_kernel", "gemm_kernel", "gemv_kernel"} <= {s.kernel for s in rec}


def test_every_variant_is_exercised():
    """The cases above cover each kernel's operand kinds, both dtypes, dot/fallback and k-loop variants."""
    rng = np.random.default_rng(11)
    dims = [13, 29, 31, 17, 29, 23, 9]
    sparse = [random_pattern(rng, dims[i], dims[i + 1], 0.22, empty_rows=2) for i in range(6)]
    small = [full(d, e) for d, e in zip([7, 3, 5, 11, 2, 9], [3, 5, 11, 2, 9, 6])]
    seen = set()
    saved = launch.mode
    try:
        for mode, dtype, (pats, shared) in itertools.product(
                ["interpret", "device"], DTYPES,
                [(sparse, [True, False, True, True, False, False]), (sparse, [True] * 6), (sparse, [False] * 6),
                 ([full(20, 20)] * 6, [False, True, False, False, True, False]), ([full(20, 20)] * 4, [True] * 4),
                 (small, [False, True, True, False, False, True]),
                 ([full(d, e) for d, e in zip([17, 70, 33, 70, 19], [70, 33, 70, 19, 21])],
                  [False, True, False, False, True])]):
            launch.mode = mode
            for s in _record(pats, shared, dtype, "full")[1]:
                c = dict(s.constexprs)
                sig = dict(s.signature)
                dt = next(t for t in sig.values() if t.startswith("*f"))
                flags = tuple(sorted((k, v) for k, v in c.items() if k.endswith("SHARED") or k in ("USE_DOT", "ONE_K")))
                seen.add((s.kernel, dt, flags))
    finally:
        launch.mode = saved
    for dt in ("*fp32", "*fp64"):
        kinds = {flags for k, d, flags in seen if k == "spgemm_kernel" and d == dt}
        assert {(("A_SHARED", a), ("B_SHARED", b), ("C_SHARED", a and b))
                for a, b in [(True, True), (True, False), (False, True), (False, False)]} <= kinds
        assert {f for k, d, f in seen if k == "spmv_kernel" and d == dt} \
            == {(("M_SHARED", False),), (("M_SHARED", True),)}
        gemm = {dict(f)["USE_DOT"] for k, d, f in seen if k == "gemm_kernel" and d == dt}
        assert gemm == {True, False}
        assert {dict(f)["ONE_K"] for k, d, f in seen if k == "gemm_kernel" and d == dt} == {True, False}
        assert {(dict(f)["A_SHARED"], dict(f)["B_SHARED"]) for k, d, f in seen if k == "gemm_kernel" and d == dt} \
            == {(True, True), (True, False), (False, True), (False, False)}
        assert {dict(f)["M_SHARED"] for k, d, f in seen if k == "gemv_kernel" and d == dt} == {True, False}
    # chain variants are covered by test_vec_chain's cases
    assert "linear_run_kernel" in {s.kernel for s in _record([full(20, 20)] * 4, [False] * 4, torch.float32, 0)[1]}


# --- host-side layout and launch parameters ----------------------------------------------

def test_segment_table_layout():
    pats = [band(12, [-1, 0, 1])] * 4 + [band(12, [0, 3])] * 3
    plan = spscan.plan(pats, levels="full", backend="triton").prepare(device=DEVICE)
    for t in _segment_tables(plan, _SpMMLaunch) + _segment_tables(plan, _SpMVLaunch):
        assert t.seg_ptr.dtype == torch.int32 and t.pair_a.dtype == torch.int32
        lens = np.diff(t.seg_ptr.cpu().numpy())
        assert np.all(np.diff(lens) <= 0), "segments must be sorted long-first"
        assert np.array_equal(lens, t.lengths) and t.npairs == int(lens.sum())


def test_launch_config_single_per_shape():
    saved = launch.mode
    try:
        launch.mode = "interpret"
        assert launch.segment_config(8, 16, 4) == launch.segment_config(8, 16, 4)
        cfg, one_k = launch.gemm_config(20, 20, 20, 16, 4)
        assert cfg.use_dot and one_k and (cfg.block_m, cfg.block_k, cfg.block_p) == (32, 32, 32)
        cfg, _ = launch.gemm_config(7, 3, 5, 16, 4)
        assert not cfg.use_dot
        launch.mode = "device"
        cfg = launch.segment_config(launch.choose_width(np.array([300] + [3] * 500), 4, False), 16, 4)
        assert cfg.block_b * cfg.block_s * cfg.block_w <= 2048
        launch.mode = "bogus"
        with pytest.raises(ValueError, match="launch.mode"):
            launch.interpreting()
    finally:
        launch.mode = saved
    for bad in ("TF32", True, None):
        with pytest.raises(ValueError, match="dot_precision"):
            launch.set_dot_precision(bad)


def test_dot_precision_selects_input_precision():
    saved = launch.dot_precision
    try:
        for want in launch.DOT_PRECISIONS:
            launch.set_dot_precision(want)
            rec = _record([full(20, 20)] * 3, [False] * 3, torch.float32, "full")[1]
            # "exact": the general kernels' float32-exact scheme is FMA products
            assert {dict(s.constexprs)["PRECISION"] for s in rec if s.kernel == "gemm_kernel"} == \
                {"ieee" if want == "exact" else want}
            rec = _record([full(20, 20)] * 3, [False] * 3, torch.float64, "full")[1]
            assert {dict(s.constexprs)["PRECISION"] for s in rec if s.kernel == "gemm_kernel"} == {"ieee"}
        launch.dot_precision = "half"  # set directly, past the setter: refused at the next launch
        with pytest.raises(ValueError, match="dot_precision"):
            _record([full(20, 20)] * 3, [False] * 3, torch.float32, "full")
    finally:
        launch.dot_precision = saved


def test_launcher_shape_errors():
    from spscan.kernels.triton.spgemm import spgemm

    pats = [band(12, [-1, 0, 1])] * 4
    plan = spscan.plan(pats, levels="full", backend="triton").prepare(device=DEVICE)
    table = _segment_tables(plan, _SpMMLaunch)[0]
    with pytest.raises(ValueError, match="output must be shared"):
        spgemm(table, torch.zeros(100), torch.zeros(100), torch.zeros(2, 100))
