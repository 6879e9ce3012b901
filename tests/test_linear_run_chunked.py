"""Linear runs parallel over their steps (chunked) on the Triton backend, and their cost in the planner.

A uniform run (every step a square ``m x m`` dense block or diagonal, shared or per sample) is cut
into chunks: each chunk's affine map is composed, the entry vectors are carried across chunks,
then every chunk is expanded from its entry. Checked here in Triton's interpreter (or compiled on a
GPU), against a float64 sequential loop and the float64 reference: odd ``m`` (1 .. 50), one chunk,
chunks of one step, a short last chunk, batch 1 and odd batches, adds on some steps, float32 and
float64; through ``spscan.plan``/``spscan.backward`` with the kernels that ran recorded, repeated
calls and a batch that changes; the planner choosing depth 0 for such runs where the device runs
them in chunks.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn

import spscan
from spscan.kernels.triton import launch
from spscan.kernels.triton.linear_run import FIELDS, chunked_size, diagonal_size, linear_run_chunked
from spscan.kernels.triton.backend import _compiled
from spscan.planner.cost import profile_for
from spscan.planner.patterns import as_chain
from spscan.planner.planning import plan_scan
from spscan.reference import reference_backward

DEVICE = torch.device("cuda") if _compiled() else torch.device("cpu")
CHUNKED = {"run_compose_kernel", "run_carry_kernel", "run_expand_kernel"}
DIAGONAL = {"diag_chunk_kernel", "diag_carry_kernel"}


def _run_problem(m: int, steps: int, batch: int, dtype: torch.dtype, seed: int, diagonal: bool = False):
    """A random uniform run in the kernels' layout: the table, shared and per-sample values, the
    vector arena (``y_0`` first, outputs poisoned with NaN, some adds), and the float64 outputs.
    ``diagonal``: every step a diagonal (else half of them dense blocks)."""
    rng = np.random.default_rng(seed)
    dense = (rng.random(steps) < 0.5) & (not diagonal)
    shared = rng.random(steps) < 0.5
    meta = np.zeros((steps, FIELDS), dtype=np.int64)
    s_parts, p_parts, so, po = [np.zeros(1)], [np.zeros((batch, 1))], 1, 1
    nv = m * (steps + 1)
    for j in range(steps):
        n = m * m if dense[j] else m
        scale = 1.0 / np.sqrt(m) if dense[j] else 1.0
        if shared[j]:
            s_parts.append(rng.standard_normal(n) * scale)
            off, so = so, so + n
        else:
            p_parts.append(rng.standard_normal((batch, n)) * scale)
            off, po = po, po + n
        add = -1
        if rng.random() < 0.4:
            add, nv = nv, nv + m
        meta[j] = [1 if dense[j] else 0, int(shared[j]), m, m, off, add, m * (j + 1), -1]
    s = np.concatenate(s_parts)
    p = np.concatenate(p_parts, axis=1)
    v = rng.standard_normal((batch, nv))
    v[:, m: m * (steps + 1)] = np.nan
    ref = v.copy()
    for b in range(batch):
        y = ref[b, :m]
        for j in range(steps):
            kind, sh, _, _, off, add, out, _ = meta[j]
            src = s if sh else p[b]
            y = src[off: off + m * m].reshape(m, m) @ y if kind else src[off: off + m] * y
            if add >= 0:
                y = y + ref[b, add: add + m]
            ref[b, out: out + m] = y
    t = lambda a: torch.as_tensor(a, dtype=dtype, device=DEVICE)  # noqa: E731
    return torch.as_tensor(meta, dtype=torch.int32, device=DEVICE), t(s), t(p), t(v), ref[:, m: m * (steps + 1)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("m,steps,batch,chunk", [
    (20, 70, 3, None),  # default chunking (8 chunks of 9, the last short)
    (5, 64, 1, 64),  # one chunk: no composition, no carry (y_0 is the chunk's entry)
    (20, 64, 2, 32),  # two chunks: one map composed, one carry step
    (1, 64, 2, 1),  # chunks of one step, m = 1 (16-wide tiles)
    (31, 65, 2, 9),  # m + 1 = 32 fills the tile exactly
    (50, 66, 1, 16),  # 64-wide tiles
])
def test_chunked_kernels_match_sequential(m, steps, batch, chunk, dtype):
    table, s, p, v, want = _run_problem(m, steps, batch, dtype, seed=m + steps)
    cfg = launch.chunked_run_config(m, steps, chunk=chunk)
    assert cfg is not None and cfg.chunks == -(-steps // cfg.chunk)
    scratch = torch.full((batch, cfg.scratch_per_sample + 5), float("nan"), dtype=dtype, device=DEVICE)
    linear_run_chunked(table, 0, s, p, v, scratch[:, 2:], cfg)  # rows strided, offset into the buffer
    got = v[:, m: m * (steps + 1)].double().cpu().numpy()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.isfinite(got).all()
    assert err <= (1e-12 if dtype == torch.float64 else 2e-5), err


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("m,steps,batch,chunk", [
    (20, 70, 3, None),  # default chunking (8 chunks of 9, the last short)
    (5, 64, 1, 64),  # one chunk: no composition, no carry
    (1, 64, 2, 1),  # chunks of one step, m = 1: lanes are samples
    (7, 130, 2, 16),  # lanes of one program cover several samples
    (300, 64, 4, 9),  # m far past the tiled kernels' 63; 1200 lanes: two lane blocks even at 1024 lanes
])
def test_diagonal_kernels_match_sequential(m, steps, batch, chunk, dtype):
    """A run of diagonals (shared or per sample, adds on some steps) per lane, against a float64 loop."""
    table, s, p, v, want = _run_problem(m, steps, batch, dtype, seed=m + steps, diagonal=True)
    cfg = launch.diagonal_run_config(m, steps, chunk=chunk)
    assert cfg is not None and cfg.chunks == -(-steps // cfg.chunk)
    scratch = torch.full((batch, cfg.scratch_per_sample + 5), float("nan"), dtype=dtype, device=DEVICE)
    with launch.recording(dry_run=False) as rec:
        linear_run_chunked(table, 0, s, p, v, scratch[:, 2:], cfg)  # rows strided, offset into the buffer
    want_kernels = DIAGONAL if cfg.chunks > 1 else {"diag_chunk_kernel"}
    assert {r.kernel for r in rec} == want_kernels
    got = v[:, m: m * (steps + 1)].double().cpu().numpy()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert np.isfinite(got).all()
    assert err <= (1e-12 if dtype == torch.float64 else 2e-5), err


def test_diagonal_config_and_size():
    assert launch.diagonal_run_config(20, 63) is None  # short runs stay sequential
    cfg = launch.diagonal_run_config(500, 10000)  # no upper bound on m
    assert (cfg.m, cfg.chunk, cfg.chunks) == (500, 100, 100) and cfg.scratch_per_sample == 3 * 100 * 500
    assert launch.diagonal_run_config(4, 200000, chunk=1).chunks <= 65535  # a CUDA grid dimension

    def run(cols, dense=(False, False, False), sparse=(False, False, False)):
        return SimpleNamespace(steps=3, rows=np.array([4, 4, 4]), cols=np.array(cols), dense=np.array(dense),
                               sparse=np.array(sparse))

    assert diagonal_size(run([4, 4, 4])) == 4
    assert diagonal_size(run([4, 5, 4])) == 0
    assert diagonal_size(run([4, 4, 4], dense=(False, True, False))) == 0  # a dense step: the tiled kernels
    assert chunked_size(run([4, 4, 4], dense=(False, True, False))) == 4
    assert diagonal_size(run([4, 4, 4], sparse=(False, True, False))) == 0
    assert diagonal_size(SimpleNamespace(steps=0, rows=np.zeros(0), cols=np.zeros(0), dense=np.zeros(0),
                                         sparse=np.zeros(0))) == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_diagonal_run_through_the_engine(dtype):
    """``spscan.backward`` on a chain of 90 per-sample diagonals (m = 70, past the tiled kernels'
    bound) at depth 0: the diagonal kernels run; gradients match the float64 reference across batch
    sizes; the CUDA profile costs depth 0 of a long such chain as a parallel run, not a loop."""
    m, n = 70, 90
    pats = [sp.csr_array(np.eye(m))] * n
    shared = [False] * n
    plan = spscan.plan(pats, levels=0, backend="triton", device=DEVICE, dtype=dtype)
    _check_engine(plan, pats, shared, dtype, (3, 1), 4, DIAGONAL)
    long = as_chain([sp.csr_array(np.eye(m))] * 4000)
    runs = plan_scan(long, "auto", profile_for("cuda"), batch_hint=16).candidates[0]
    sequential = plan_scan(long, "auto", profile_for("cuda", {"parallel_run_max_m": 0}), batch_hint=16).candidates[0]
    assert runs < 0.1 * sequential


def test_chunked_config_bounds_and_errors():
    assert launch.chunked_run_config(64, 1000) is None  # a 65-column chunk map does not fit a 64 tile
    assert launch.chunked_run_config(20, 63) is None  # short runs stay sequential
    cfg = launch.chunked_run_config(20, 10000)
    assert cfg.m == 20 and cfg.chunk == 100 and cfg.chunks == 100 and cfg.block_m == 32
    assert cfg.scratch_per_sample == 100 * 32 * 33
    def run(cols, sparse=(False, False, False)):
        return SimpleNamespace(steps=3, rows=np.array([4, 4, 4]), cols=np.array(cols), sparse=np.array(sparse))

    assert chunked_size(run([4, 4, 4])) == 4
    assert chunked_size(run([4, 5, 4])) == 0
    assert chunked_size(run([4, 4, 4], (False, True, False))) == 0  # a CSR step
    assert chunked_size(SimpleNamespace(steps=0, rows=np.zeros(0), cols=np.zeros(0), sparse=np.zeros(0))) == 0
    table, s, p, v, _ = _run_problem(4, 64, 2, torch.float64, 0)
    with pytest.raises(ValueError, match="scratch"):
        linear_run_chunked(table, 0, s, p, v, torch.zeros(2, 10, dtype=torch.float64, device=DEVICE),
                           launch.chunked_run_config(4, 64))


def test_planner_constants_match_the_kernels():
    cuda = profile_for("cuda")
    assert cuda.parallel_run_max_m == launch.CHUNKED_MAX_M
    assert cuda.parallel_run_min_steps == launch.CHUNKED_MIN_STEPS
    assert profile_for("cpu").parallel_run_max_m == 0


def _rnn_chain(h: int, steps: int):
    w = sp.csr_array(np.ones((h, h)))
    d = sp.csr_array(np.eye(h))
    return [w, d] * (steps // 2), [True, False] * (steps // 2)


def test_planner_prefers_one_chunked_run_on_cuda():
    """The factored RNN chain on the CUDA profile: a chunked run makes depth 0 several times cheaper
    than the sequential run and competitive with the best up-sweep; without chunked runs the same
    chain wants a deep up-sweep. (The CPU profile has no chunked runs.) The CUDA profile's structured
    recurrences (which this chain also is) are left out here; with them depth 0 is cheaper still."""
    pats = as_chain(_rnn_chain(20, 4000)[0])
    no_rec = {"recurrence_rate": 0.0}
    with_runs = plan_scan(pats, "auto", profile_for("cuda", no_rec), batch_hint=16)
    without = plan_scan(pats, "auto", profile_for("cuda", dict(no_rec, parallel_run_max_m=0)), batch_hint=16)
    assert with_runs.candidates[0] < 0.2 * without.candidates[0]
    assert with_runs.candidates[0] < 1.5 * min(without.candidates.values())
    assert without.levels >= 6
    fused = plan_scan(pats, "auto", profile_for("cuda"), batch_hint=16)
    assert fused.levels == 0 and fused.candidates[0] < with_runs.candidates[0]


def _values(pats, shared, batch, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for q, sh in zip(pats, shared):
        shape = (q.nnz,) if sh else (batch, q.nnz)
        scale = 1.0 / np.sqrt(max(1.0, q.nnz / q.shape[1]))
        out.append((torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_chunked_run_through_the_engine(dtype):
    """``spscan.backward`` on a factored RNN chain at depth 0: the chunked kernels run, the gradients
    match the float64 reference; a second call and a different batch size give the same answers."""
    pats, shared = _rnn_chain(7, 160)
    plan = spscan.plan(pats, levels=0, backend="triton", device=DEVICE, dtype=dtype)
    _check_engine(plan, pats, shared, dtype, (3, 1, 3), 3, CHUNKED)


def _check_engine(plan, pats, shared, dtype, batches, every: int, kernels: set) -> None:
    """``spscan.backward`` through ``plan`` for each batch size (extra terms on every ``every``-th
    vector): ``kernels`` among the launches, gradients against the float64 reference."""
    tol = 1e-11 if dtype == torch.float64 else 1e-4
    m = pats[-1].shape[1]
    for batch in batches:
        vals = _values(pats, shared, batch, dtype, seed=batch)
        gen = torch.Generator().manual_seed(7)
        grad = torch.randn(batch, m, generator=gen, dtype=torch.float64).to(dtype)
        extra = [torch.randn(batch, pats[i - 1].shape[1] if i else pats[0].shape[0], generator=gen,
                             dtype=torch.float64).to(dtype) if i % every == 1 else None
                 for i in range(len(pats) + 1)]
        with launch.recording(dry_run=False) as rec:
            got = spscan.backward(plan, [x.to(DEVICE) for x in vals], grad.to(DEVICE),
                                  [None if e is None else e.to(DEVICE) for e in extra])
        assert kernels <= {r.kernel for r in rec}
        ref = reference_backward(pats, vals, grad, extra)
        scale = max(float(r.abs().max()) for r in ref)
        err = max(float((g.double().cpu() - r).abs().max()) for g, r in zip(got, ref)) / scale
        assert err <= tol, (batch, err)


def test_auto_layout_is_factored_everywhere():
    """The factored chain is a structured recurrence on a GPU (the fused kernels), so "auto" never
    materializes per-sample ``H x H`` blocks."""
    from spscan.recurrent.cells import cell_for, recurrent_patterns, resolve_layout

    assert resolve_layout("auto") == "factored"
    assert resolve_layout("materialized") == "materialized"
    assert resolve_layout("factored") == "factored"
    with pytest.raises(ValueError, match="layout"):
        resolve_layout("dense")
    for module in (nn.RNN(2, 3), nn.GRU(2, 300), nn.LSTM(2, 1)):  # every cell and size: the factored chain
        H = module.hidden_size
        assert len(recurrent_patterns(module, 4)) == 4 * len(cell_for(module).factored_layout(H))


def test_max_memory_counts_the_chunked_runs_working_memory():
    """``max_memory`` covers the planner's peak plus the chunk maps the Triton backend keeps per sample."""
    pats, shared = _rnn_chain(7, 160)
    batch = 2
    free = spscan.plan(pats, levels=0, backend="triton", device=DEVICE, dtype=torch.float64)
    need = free.memory().backward_peak(batch)
    cfg = launch.chunked_run_config(7, len(pats))
    scratch = batch * cfg.scratch_per_sample * 8
    vals = [x.to(DEVICE) for x in _values(pats, shared, batch, torch.float64, seed=0)]
    grad = torch.ones(batch, 7, dtype=torch.float64, device=DEVICE)
    tight = spscan.plan(pats, levels=0, backend="triton", device=DEVICE, dtype=torch.float64,
                        max_memory=need + scratch // 2, batch_size=1)
    with pytest.raises(ValueError, match="max_memory"):
        spscan.backward(tight, vals, grad)
    enough = spscan.plan(pats, levels=0, backend="triton", device=DEVICE, dtype=torch.float64,
                         max_memory=need + scratch, batch_size=1)
    spscan.backward(enough, vals, grad)


def test_sparse_run_steps_cost_what_was_measured_on_cuda():
    cuda, cpu = profile_for("cuda"), profile_for("cpu")
    assert cuda.run_step_s("sparse") > cuda.run_step_s("dense") == cuda.run_step_s("diag") == cuda.chain_step_s
    assert cpu.run_step_s("sparse") == cpu.chain_step_s  # None: the dense steps' cost
    # a plan file keeps the field (a float on CUDA, null on the CPU)
    from spscan.planner.serialize import _profile
    assert _profile(dataclasses.asdict(cuda)) == cuda and _profile(dataclasses.asdict(cpu)) == cpu
    old = {k: v for k, v in dataclasses.asdict(cuda).items()
           if k not in ("parallel_run_max_m", "parallel_run_min_steps", "parallel_run_rate", "chain_sparse_step_s")}
    assert _profile(old).parallel_run_max_m == 0 and _profile(old).chain_sparse_step_s is None
