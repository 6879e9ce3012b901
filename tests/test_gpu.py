"""The compiled Triton path on a CUDA device, through the public API (skipped without CUDA).

* every kernel (numeric SpGEMM, batched SpMV, dense GEMM with and without ``tl.dot`` and with
  the k loop, dense GEMV, the persistent chain in both its register and tiled forms) through
  ``spscan.plan(..., device="cuda", backend="triton")`` + ``spscan.backward``, against the torch
  backend on the same device and the float64 reference on the CPU;
* a plan's backward (``spscan.backward`` and a bound plan's ``run``) captured in a CUDA graph and
  replayed with new values in the same input tensors gives bitwise the gradients an eager call
  gives;
* bitwise determinism: two runs, two plans and a second process give identical bits;
* ``spscan.wrap`` of an ``nn.RNN`` on the GPU against float64 autograd;
* the model-parallel scan with two processes on one GPU over Gloo (messages through host copies).

The interpreter tests (``test_triton_kernels.py``) run the same kernels on the CPU; these tests
are what only a GPU can show (compilation for the device, grid limits, streams, capture).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import spscan
import spscan.distributed as sd
from distributed_cases import check_comm, run_cases
from spscan.reference import reference_backward
from test_triton_kernels import (F32_FLOOR, band, diag, full, make_extra, make_values, random_pattern, rel_err,
                                 sequential_f32)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")


def _cases() -> dict:
    """name -> (patterns, shared flags, levels, batch, extra every k-th or None); one per kernel variant."""
    rng = np.random.default_rng(11)
    dims = [13, 29, 31, 17, 29, 23, 9]
    sparse = [random_pattern(rng, dims[i], dims[i + 1], 0.22, empty_rows=2) for i in range(6)]
    wide = [random_pattern(rng, 300, 300, 0.01, long_row=True) for _ in range(3)]
    return {
        "sparse-mixed": (sparse, [True, False, True, True, False, False], "full", 3, 2),
        "sparse-shared": (sparse, [True] * 6, "full", 3, None),
        "sparse-long-rows": (wide, [False, True, False], 1, 2, None),
        "band-empty-segments": ([band(12, [-1, 0, 1])] * 4 + [band(12, [0, 3])] * 3,
                                [False, True] * 3 + [False], "full", 2, None),
        "dense20-dot": ([full(20, 20)] * 8, [False, True, False, False, True, False, False, False], "full", 16, 2),
        "dense-small-fallback": ([full(d, e) for d, e in zip([7, 3, 5, 11, 2, 9], [3, 5, 11, 2, 9, 6])],
                                 [False, True, True, False, False, True], "full", 3, 2),
        "dense-k-loop": ([full(d, e) for d, e in zip([17, 70, 33, 70, 19], [70, 33, 70, 19, 21])],
                         [False, True, False, False, True], "full", 2, 2),
        "chain20-registers": ([full(20, 20)] * 12, [False] * 12, 0, 16, 2),
        "chain70-tiled": ([full(70, 70)] * 5, [True] * 5, 0, 3, 2),
        "chain-rect-diag": ([full(9, 30), diag(30), full(30, 17), diag(17), full(17, 17), diag(17)],
                            [False, True, True, False, False, True], 0, 3, 2),
        "rnn64-auto": ([full(64, 64)] * 32, [False] * 32, "auto", 16, None),
        # long uniform runs, parallel over their steps (chunked): the factored RNN step, odd batch,
        # adds on every other step; per-sample dense blocks with a 64-wide tile
        "chunked-rnn20": ([full(20, 20), diag(20)] * 150, [True, False] * 150, 0, 5, 2),
        "chunked-dense50": ([full(50, 50)] * 90, [False] * 90, 0, 3, 3),
        # diagonals only (the quasi-Newton forward): per lane, m past the tiles' 63, one shared step
        "chunked-diag300": ([diag(300)] * 80, [False] * 79 + [True], 0, 5, 2),
    }


CASES = _cases()


def _inputs(pats, shared, batch, dtype, every, seed=0):
    vals = make_values(pats, shared, batch, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    grad = torch.randn(batch, pats[-1].shape[1], generator=gen, dtype=torch.float64).to(dtype)
    extra = None if every is None else make_extra(pats, batch, dtype, seed, every)
    return vals, grad, extra


def _cuda(items):
    if items is None:
        return None
    if isinstance(items, torch.Tensor):
        return items.to(CUDA)
    return [None if t is None else t.to(CUDA) for t in items]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_torch_and_reference(case, dtype):
    pats, shared, levels, batch, every = CASES[case]
    vals, grad, extra = _inputs(pats, shared, batch, dtype, every)
    plan_t = spscan.plan(pats, levels=levels, backend="triton", device=CUDA, dtype=dtype, batch_size=batch)
    got = spscan.backward(plan_t, _cuda(vals), _cuda(grad), _cuda(extra))
    torch.cuda.synchronize()
    assert all(g.device == torch.empty(0, device=CUDA).device for g in got)
    plan_c = spscan.plan(pats, levels=levels, backend="torch", device=CUDA, dtype=dtype, batch_size=batch)
    ref_torch = spscan.backward(plan_c, _cuda(vals), _cuda(grad), _cuda(extra))
    ref = reference_backward(pats, vals, grad, extra)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in ref]
    assert all(bool(torch.isfinite(g).all()) for g in got)
    err = rel_err(got, ref)
    if dtype == torch.float64:
        assert err <= 1e-10, f"{case}: float64 relative error {err:.3e} vs reference"
        assert rel_err(got, [t.double().cpu() for t in ref_torch]) <= 1e-10
    else:
        seq = rel_err(sequential_f32(pats, vals, grad, extra), ref)
        # a chunked run reaches each output through a composed map of up to ``chunk`` products and a
        # carry over the chunks: another association than the loop's (3.7x its error on chunked-rnn20)
        k = 4 if case.startswith("chunked") else 2
        assert err <= k * seq + F32_FLOOR, f"{case}: float32 error {err:.3e} > {k} x sequential ({seq:.3e}) + floor"
        assert rel_err(got, [t.double().cpu() for t in ref_torch]) <= 4 * seq + 2 * F32_FLOOR


def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


DETERMINISM_CASES = ["sparse-mixed", "dense20-dot", "chain70-tiled", "rnn64-auto", "chunked-rnn20", "chunked-diag300"]


@pytest.mark.parametrize("case", DETERMINISM_CASES)
def test_bitwise_repeatable(case):
    """Same inputs: identical bits across calls, across two plans, and after unrelated work in between."""
    pats, shared, levels, batch, every = CASES[case]
    vals, grad, extra = (_cuda(x) for x in _inputs(pats, shared, batch, torch.float32, every))
    p1 = spscan.plan(pats, levels=levels, backend="triton", device=CUDA, batch_size=batch)
    p2 = spscan.plan(pats, levels=levels, backend="triton", device=CUDA, batch_size=batch)
    first = [g.clone() for g in spscan.backward(p1, vals, grad, extra)]
    torch.randn(1 << 20, device=CUDA).sum()  # unrelated work on the stream between runs
    for p in (p1, p2, p1):
        again = spscan.backward(p, vals, grad, extra)
        assert all(torch.equal(a, b) for a, b in zip(first, again)), case


_SUBPROCESS = """
import hashlib, sys, torch, spscan
sys.path.insert(0, {tests!r})
from test_gpu import CASES, _inputs, _cuda, _digest
pats, shared, levels, batch, every = CASES[{case!r}]
vals, grad, extra = (_cuda(x) for x in _inputs(pats, shared, batch, torch.float32, every))
p = spscan.plan(pats, levels=levels, backend="triton", device="cuda", batch_size=batch)
print(_digest(spscan.backward(p, vals, grad, extra)))
"""


def test_bitwise_repeatable_across_processes():
    """A fresh process (new compilation cache lookups, new allocator state) gives the same bits."""
    case = "sparse-mixed"
    pats, shared, levels, batch, every = CASES[case]
    vals, grad, extra = (_cuda(x) for x in _inputs(pats, shared, batch, torch.float32, every))
    p = spscan.plan(pats, levels=levels, backend="triton", device=CUDA, batch_size=batch)
    here = _digest(spscan.backward(p, vals, grad, extra))
    code = _SUBPROCESS.format(tests=str(Path(__file__).parent), case=case)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == here


GRAPH_CASES = ["dense20-dot", "chain20-registers", "sparse-mixed", "rnn64-auto", "chunked-rnn20"]


@pytest.mark.parametrize("api", ["backward", "bound"])
@pytest.mark.parametrize("case", GRAPH_CASES)
def test_cuda_graph_replay_equals_eager(case, api):
    """Capture a backward once (``spscan.backward``, or ``BoundPlan.run`` of ``plan.bind``); replay it
    after copying new values into the same tensors: bitwise what an eager call gives."""
    pats, shared, levels, batch, every = CASES[case]
    plan = spscan.plan(pats, levels=levels, backend="triton", device=CUDA, dtype=torch.float32, batch_size=batch)
    vals, grad, extra = (_cuda(x) for x in _inputs(pats, shared, batch, torch.float32, every, seed=0))
    if api == "bound":
        bound = plan.bind(shared=shared, has_extra=None if extra is None else [e is not None for e in extra],
                          device=CUDA)

        def step():
            return bound.run(vals, grad, extra, check=False).grads
    else:

        def step():
            return spscan.backward(plan, vals, grad, extra)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile, upload tables) off the default stream
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (1, 2):
        new_vals, new_grad, new_extra = _inputs(pats, shared, batch, torch.float32, every, seed=seed)
        for dst, src in zip(vals, new_vals):
            dst.copy_(src)
        grad.copy_(new_grad)
        if extra is not None:
            for dst, src in zip(extra, new_extra):
                if dst is not None:
                    dst.copy_(src)
        graph.replay()
        replayed = [g.clone() for g in static_out]
        eager = [g.clone() for g in step()]
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(replayed, eager)), f"{case} ({api}): replay differs from eager"
        ref = reference_backward(pats, new_vals, new_grad, new_extra)
        seq = rel_err(sequential_f32(pats, new_vals, new_grad, new_extra), ref)
        assert rel_err(replayed, ref) <= 2 * seq + F32_FLOOR


@pytest.mark.parametrize("case", ["dense20-dot", "sparse-mixed", "band-empty-segments"])
def test_bound_run_graph_equals_eager(case):
    """``BoundPlan.run(graph=True)``: the first call per batch size runs eagerly and captures, later
    calls replay with new values loaded into the plan's buffers; bitwise what ``graph=False`` gives,
    across new values and a change of batch size and back, with and without ``scratch``."""
    pats, shared, levels, batch, every = CASES[case]
    plan = spscan.plan(pats, levels=levels, backend="triton", device=CUDA, dtype=torch.float32, batch_size=batch)
    for seed, b, scratch in [(0, batch, False), (1, batch, True), (2, batch + 3, False), (3, batch + 3, True),
                             (4, batch, False)]:
        vals, grad, extra = (_cuda(x) for x in _inputs(pats, shared, b, torch.float32, every, seed=seed))
        bound = plan.bind(shared=shared, has_extra=None if extra is None else [e is not None for e in extra],
                          device=CUDA)
        got = [g.clone() for g in bound.run(vals, grad, extra, check=False, scratch=scratch, graph=True).grads]
        want = bound.run(vals, grad, extra, check=False).grads
        assert all(torch.equal(a, w) for a, w in zip(got, want)), f"{case} seed {seed}: graph differs from eager"


@pytest.mark.parametrize("case", ["dense20-dot", "chunked-rnn20", "chunked-dense50"])
def test_dot_precision_accuracy_and_graphs(case):
    """``launch.dot_precision``: float32 ``tl.dot`` products (dense nodes, chunk maps) as exact FMAs,
    three TF32 products or one, against the float64 reference; a bound plan's CUDA graph is kept per
    setting, so replaying after a change gives bitwise what eager gives under the new setting."""
    from spscan.kernels.triton import launch

    pats, shared, levels, batch, every = CASES[case]
    vals, grad, extra = _inputs(pats, shared, batch, torch.float32, every)
    ref = reference_backward(pats, vals, grad, extra)
    seq = rel_err(sequential_f32(pats, vals, grad, extra), ref)
    plan = spscan.plan(pats, levels=levels, backend="triton", device=CUDA, dtype=torch.float32, batch_size=batch)
    bound = plan.bind(shared=shared, has_extra=None if extra is None else [e is not None for e in extra], device=CUDA)
    saved = launch.dot_precision
    # tf32x3 drops the product of the two TF32 remainders (~2^-22 relative per product): a few
    # float32 ulps, so within twice the exact kernel's bound. One TF32 product keeps 10 mantissa bits
    # (2^-11 relative per product); over the 150 dense products of chunked-rnn20 a random walk of
    # such errors reaches ~1e-2
    bounds = {"ieee": 4 * seq + F32_FLOOR, "tf32x3": 8 * seq + 2 * F32_FLOOR, "tf32": 5e-2}
    try:
        for precision in ["ieee", "tf32x3", "tf32", "ieee"]:
            launch.set_dot_precision(precision)
            eager = [g.clone() for g in bound.run(_cuda(vals), _cuda(grad), _cuda(extra), check=False).grads]
            for _ in range(2):  # captured under this setting, then replayed
                graphed = bound.run(_cuda(vals), _cuda(grad), _cuda(extra), check=False, graph=True).grads
                assert all(torch.equal(a, w) for a, w in zip(graphed, eager)), f"{case} {precision}: graph != eager"
            err = rel_err(eager, ref)
            assert err <= bounds[precision], f"{case} {precision}: relative error {err:.2e} > {bounds[precision]:.2e}"
    finally:
        launch.dot_precision = saved


def test_gemm_small_nodes_direct():
    """The dense-node GEMM on the device for small and odd node shapes (the rank-1-update path) and
    ``tl.dot`` sizes, every shared/per-sample mix, float32 and float64, against float64 torch."""
    from spscan.kernels.triton.gemm import gemm
    from spscan.planner.program import BlockRef

    g = torch.Generator().manual_seed(5)
    batch, nodes = 3, 5
    for (m, k, p) in [(7, 3, 5), (12, 12, 12), (11, 2, 9), (1, 7, 1), (12, 40, 3), (20, 20, 20), (17, 70, 33)]:
        for a_sh in (False, True):
            for b_sh in (False, True):
                A = torch.randn(*(() if a_sh else (batch,)), nodes * m * k + 3, generator=g, dtype=torch.float64)
                Bm = torch.randn(*(() if b_sh else (batch,)), nodes * k * p + 5, generator=g, dtype=torch.float64)
                a_ref = BlockRef(m, k, np.arange(nodes) * m * k + 3)
                b_ref = BlockRef(k, p, np.arange(nodes) * k * p + 5)
                want = ((A if not a_sh else A.expand(batch, -1))[:, 3:].reshape(batch, nodes, m, k)
                        @ (Bm if not b_sh else Bm.expand(batch, -1))[:, 5:].reshape(batch, nodes, k, p))
                for dt, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
                    c_sh = a_sh and b_sh
                    c = torch.full((*(() if c_sh else (batch,)), nodes * m * p), float("nan"), dtype=dt, device=CUDA)
                    gemm(torch.as_tensor(a_ref.offsets, device=CUDA), torch.as_tensor(b_ref.offsets, device=CUDA),
                         a_ref, b_ref, 0, A.to(dt).to(CUDA), Bm.to(dt).to(CUDA), c)
                    got = c.double().cpu()
                    got = (got if not c_sh else got.expand(batch, -1)).reshape(batch, nodes, m, p)
                    err = float((got - want).abs().max() / want.abs().max())
                    assert err <= tol, f"({m}, {k}, {p}) a_sh={a_sh} b_sh={b_sh} {dt}: relative error {err:.2e}"


def test_wrap_rnn_on_gpu_matches_autograd():
    """``spscan.wrap`` of an ``nn.RNN`` (T = 64, B = 16, H = 20) on the GPU vs float64 autograd."""
    torch.manual_seed(0)
    rnn = torch.nn.RNN(20, 20).to(CUDA)
    ref = torch.nn.RNN(20, 20).to(CUDA).double()
    ref.load_state_dict({k: v.double() for k, v in rnn.state_dict().items()})
    x = torch.randn(64, 16, 20, device=CUDA)
    w = spscan.wrap(rnn, x, backend="triton")
    weights = torch.randn(64, 16, 20, device=CUDA, dtype=torch.float64)

    def grads(f, module, inp):
        inp = inp.detach().clone().requires_grad_(True)
        for p in module.parameters():
            p.grad = None
        out, _ = f(inp)
        (out * weights.to(out.dtype)).sum().backward()
        return [inp.grad.detach().clone()] + [p.grad.detach().clone() for p in module.parameters()]

    got = grads(w, rnn, x)  # eager scan, then the scan's launches are captured
    again = grads(w, rnn, x)  # replayed
    want = grads(ref, ref, x.double())
    auto32 = grads(rnn, rnn, x)
    for i, (a, b, r, c) in enumerate(zip(got, again, want, auto32)):
        assert torch.equal(a, b), i
        bound = 2 * float((c.double() - r).abs().max()) + 1e-6 * max(float(r.abs().max()), 1.0)
        assert float((a.double() - r).abs().max()) <= bound, i
    x2 = torch.randn(64, 16, 20, device=CUDA)  # new values through the replayed graph
    for i, (a, r, c) in enumerate(zip(grads(w, rnn, x2), grads(ref, ref, x2.double()), grads(rnn, rnn, x2))):
        bound = 2 * float((c.double() - r).abs().max()) + 1e-6 * max(float(r.abs().max()), 1.0)
        assert float((a.double() - r).abs().max()) <= bound, i


def test_gloo_ranks_share_one_gpu():
    """Two processes on one GPU over Gloo (NCCL refuses two ranks per device): the values and gradients
    stay on the device, the messages go through host copies; gradients equal the float64 reference,
    every byte sent is a planned one."""
    p = 2
    cases = [
        dict(kind="sparse", n=6, seed=21, device="cuda"),
        dict(kind="mixed", n=7, seed=22, extra="all", shared="some", device="cuda", batches=[2, 3]),
        dict(kind="dense", n=5, seed=23, dtype=torch.float32, device="cuda"),
    ]
    results = sd.run_local(run_cases, p, args=(cases,), timeout=240)
    for r, (ok, out) in enumerate(results):
        assert ok, f"rank {r} failed:\n{out}"
        for ci, (case, res) in enumerate(zip(cases, out)):
            tol = 1e-5 if case.get("dtype") == torch.float32 else 1e-10
            assert res["error"] <= tol, f"case {ci} rank {r}: rel. error {res['error']:.3g}"
    check_comm(p, [[s for s in out[0]["stats"]] for _, out in results], "gloo on one GPU")
