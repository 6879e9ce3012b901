"""Triton kernels on a CUDA device against the libraries a user would otherwise call.

Rows (one pytest-benchmark test each; baselines are measured inside the same test, so every
ratio in ``extra_info`` compares timings taken back to back on one device):

(a) ``test_spgemm_gpu``: numeric SpGEMM from planned pair lists (``spscan.plan_composite`` with
    the Triton backend, bound once) on products of two conv-like transposed Jacobians, vs
    ``torch.sparse`` CSR @ CSR (cuSPARSE, which redoes its symbolic phase every call) and SciPy
    on the CPU; also 16 per-sample value sets in one launch. ``test_spgemm_cpu`` runs the same comparison with the torch backend's
    numeric SpGEMM on the CPU (small sizes, seconds), so this suite shows something without a GPU.
(b) achieved GB/s of SpGEMM (``test_spgemm_gpu``) and batched SpMV (``test_spmv_gpu``) against a
    device-to-device copy of the same byte count, measured in the same test.
(c) ``test_rnn_backward_gpu``: the paper's RNN backward (``T`` = 1000 and 30000, ``B`` = 16,
    ``H`` = 20: a chain of ``T`` dense per-sample ``20 x 20`` Jacobians, ``spscan.plan([W] * T)``,
    values ``(T, B, 400)``) vs cuDNN autograd backward of ``nn.RNN``.
(d) ``test_rnn_backward_cuda_graph``: the same backward replayed from a CUDA graph vs launched
    normally.
(e) ``test_planning_time_per_profile``: ``spscan.plan`` time (first call in the process) under
    the CPU and the CUDA device profiles (the cost model picks different depths; the CUDA one
    only where there is a device), against one backward of the plan for the run's device
    measured in the same test (``plan_over_backward_ratio``: backwards that pay for planning).

The paper's sweeps (RNN over T and B, GRU/IRMAS, VGG-11 products, the training step) are in
``test_paper_*.py`` and ``test_rnn_step.py``; ``bench/gpu/run.sh`` runs them all on a GPU.

Bytes are compulsory traffic: every value, index and output read or written once (shared
factors once per call, per-sample ones once per sample); GB/s = bytes / median time. Copy GB/s
count read + write. Every timed function synchronizes before returning.
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan
from spscan.kernels.triton.segments import segments_from_pairs
from spscan.kernels.triton.spmv import spmv
from spscan.planner.patterns import as_pattern
from spscan.planner.symbolic import spgemm_symbolic

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="GPU benchmark: needs a CUDA device (compiled Triton kernels, cuSPARSE, cuDNN); "
                     "test_spgemm_cpu covers the CPU")


def device_name() -> str:
    if CUDA:
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def median_time(fn: Callable[[], object], reps: int = 10, warmup: int = 2) -> float:
    """Median wall seconds of ``fn`` (which synchronizes) over ``reps`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def conv_pattern(channels: int, height: int, width: int, k: int = 3) -> sp.csr_array:
    """``J^T`` of a stride-1 'same' ``k x k`` convolution ``channels -> channels`` (``d = channels*h*w``).

    Entry ``(input, output)`` exists when the input pixel lies in the output pixel's window; every
    channel pair connects (channel-major indices), as in a dense conv layer.
    """
    r = k // 2
    y, x = np.divmod(np.arange(height * width), width)
    dy = np.abs(y[:, None] - y[None, :]) <= r
    dx = np.abs(x[:, None] - x[None, :]) <= r
    stencil = sp.csr_array((dy & dx).astype(np.float64))
    pat = sp.csr_array(sp.kron(np.ones((channels, channels)), stencil, format="csr"))
    pat.sum_duplicates()
    pat.sort_indices()
    return pat


def copy_gbps(nbytes: int, device: torch.device) -> float:
    """Device copy bandwidth (read + write) for a buffer of ``nbytes``, measured now."""
    n = max(1, nbytes // 4)
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)

    def run() -> None:
        dst.copy_(src)
        sync()

    return 2 * 4 * n / median_time(run, reps=20) / 1e9


def _index_bytes(table) -> int:
    return sum(t.numel() * t.element_size() for t in (table.seg_ptr, table.pair_a, table.pair_b, table.out))


# --- (a) + (b): numeric SpGEMM -----------------------------------------------------------

SPGEMM_SIZES = {"conv4x32x32": (4, 32, 32), "conv8x32x32": (8, 32, 32)}


def _composite_bytes(pairs: int, nnz_c: int, batch: int, nnz_a: int, nnz_b: int, per_sample: bool) -> int:
    """Compulsory traffic of one numeric product: int32 pair indices and segment offsets once,
    values once (per sample when batched), outputs written once."""
    index = 4 * (2 * pairs + 2 * nnz_c + 1)
    return index + 4 * (batch if per_sample else 1) * (nnz_a + nnz_b + nnz_c)


@needs_cuda
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("size", list(SPGEMM_SIZES))
def test_spgemm_gpu(benchmark, size):
    benchmark.group = "kernels-spgemm"
    dev = DEV
    a = conv_pattern(*SPGEMM_SIZES[size])
    t0 = time.perf_counter()
    cplan = spscan.plan_composite([a, a], backend="triton", device=dev, dtype=torch.float32)
    shared = cplan.bind(shared=[True, True], device=dev)  # index tables uploaded once
    symbolic_s = time.perf_counter() - t0
    pc = cplan.composite_pattern
    pairs = len(spgemm_symbolic(as_pattern(a), as_pattern(a)).pair_a)
    rng = np.random.default_rng(0)
    va_np, vb_np = rng.standard_normal(a.nnz).astype(np.float32), rng.standard_normal(a.nnz).astype(np.float32)
    va, vb = torch.from_numpy(va_np).to(dev), torch.from_numpy(vb_np).to(dev)

    def triton_shared() -> torch.Tensor:
        out = shared.run([va, vb], check=False).composite
        sync()
        return out

    # correctness first, against SciPy (the CPU baseline below)
    sa = sp.csr_array((va_np.astype(np.float64), a.indices, a.indptr), shape=a.shape)
    sb = sp.csr_array((vb_np.astype(np.float64), a.indices, a.indptr), shape=a.shape)
    got = sp.csr_array((triton_shared().cpu().double().numpy(), pc.indices, pc.indptr), shape=pc.shape)
    want = sa @ sb
    assert abs(got - want).max() <= 1e-4 * abs(want).max()

    benchmark.pedantic(triton_shared, rounds=20, warmup_rounds=3)
    t_triton = benchmark.stats.stats.median

    crow = torch.from_numpy(a.indptr.astype(np.int64)).to(dev)
    col = torch.from_numpy(a.indices.astype(np.int64)).to(dev)
    ta = torch.sparse_csr_tensor(crow, col, va, size=a.shape)
    tb = torch.sparse_csr_tensor(crow, col, vb, size=a.shape)

    def cusparse() -> None:
        torch.matmul(ta, tb)
        sync()

    t_cusparse = median_time(cusparse, reps=10)
    sa32, sb32 = sa.astype(np.float32), sb.astype(np.float32)
    t_scipy = median_time(lambda: sa32 @ sb32, reps=3, warmup=1)

    batch = 16
    per_sample = cplan.bind(shared=[False, False], device=dev)
    va_b = torch.randn(batch, a.nnz, device=dev)
    vb_b = torch.randn(batch, a.nnz, device=dev)

    def triton_batched() -> None:
        per_sample.run([va_b, vb_b], check=False)
        sync()

    t_batched = median_time(triton_batched, reps=10)

    bytes_shared = _composite_bytes(pairs, pc.nnz, 1, a.nnz, a.nnz, False)
    bytes_batched = _composite_bytes(pairs, pc.nnz, batch, a.nnz, a.nnz, True)
    copy = copy_gbps(bytes_batched, dev)
    flops = 2 * pairs
    benchmark.extra_info.update({
        "device": device_name(), "dtype": "float32", "d": a.shape[0], "nnz_A": a.nnz, "nnz_C": pc.nnz,
        "pairs": pairs, "symbolic_once_s": symbolic_s, "path": "spscan.plan_composite(backend='triton')",
        "flops": flops, "bytes": bytes_shared, "GFLOPs": flops / t_triton / 1e9, "GBps": bytes_shared / t_triton / 1e9,
        "torch_sparse_s": t_cusparse, "scipy_cpu_s": t_scipy,
        "speedup_vs_torch_sparse": t_cusparse / t_triton, "speedup_vs_scipy": t_scipy / t_triton,
        "batched_B": batch, "batched_s": t_batched, "batched_bytes": bytes_batched,
        "batched_GBps": bytes_batched / t_batched / 1e9, "batched_GFLOPs": batch * flops / t_batched / 1e9,
        "batched_speedup_vs_B_torch_sparse_calls": batch * t_cusparse / t_batched,
        "copy_GBps": copy, "batched_fraction_of_copy": bytes_batched / t_batched / 1e9 / copy,
    })


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_spgemm_cpu(benchmark):
    """The torch backend's numeric SpGEMM (``plan_composite``) vs SciPy and torch.sparse, all on the CPU."""
    benchmark.group = "kernels-spgemm-cpu"
    a = conv_pattern(2, 16, 16)
    cplan = spscan.plan_composite([a, a], backend="torch", device="cpu", dtype=torch.float32)
    bound = cplan.bind(shared=[True, True], device="cpu")
    pc = cplan.composite_pattern
    pairs = len(spgemm_symbolic(as_pattern(a), as_pattern(a)).pair_a)
    rng = np.random.default_rng(0)
    va_np, vb_np = rng.standard_normal(a.nnz).astype(np.float32), rng.standard_normal(a.nnz).astype(np.float32)
    va, vb = torch.from_numpy(va_np), torch.from_numpy(vb_np)

    def planned() -> torch.Tensor:
        return bound.run([va, vb], check=False).composite

    sa = sp.csr_array((va_np, a.indices, a.indptr), shape=a.shape)
    sb = sp.csr_array((vb_np, a.indices, a.indptr), shape=a.shape)
    want = sa @ sb
    got = sp.csr_array((planned().double().numpy(), pc.indices, pc.indptr), shape=pc.shape)
    assert abs(got - want).max() <= 1e-4 * abs(want).max()

    benchmark.pedantic(planned, rounds=20, warmup_rounds=2)
    t_planned = benchmark.stats.stats.median
    crow, col = torch.from_numpy(a.indptr.astype(np.int64)), torch.from_numpy(a.indices.astype(np.int64))
    ta = torch.sparse_csr_tensor(crow, col, va, size=a.shape)
    tb = torch.sparse_csr_tensor(crow, col, vb, size=a.shape)
    t_torch_sparse = median_time(lambda: torch.matmul(ta, tb), reps=10)
    t_scipy = median_time(lambda: sa @ sb, reps=10)
    benchmark.extra_info.update({
        "device": device_name(), "d": a.shape[0], "nnz_A": a.nnz, "nnz_C": pc.nnz, "pairs": pairs,
        "flops": 2 * pairs, "GFLOPs": 2 * pairs / t_planned / 1e9,
        "torch_sparse_s": t_torch_sparse, "scipy_s": t_scipy,
        "speedup_vs_torch_sparse": t_torch_sparse / t_planned, "speedup_vs_scipy": t_scipy / t_planned,
    })


# --- (b): batched SpMV --------------------------------------------------------------------

SPMV_SIZES = {"conv16x32x32": (16, 32, 32), "conv32x64x64": (32, 64, 64)}


@needs_cuda
@pytest.mark.parametrize("size", list(SPMV_SIZES))
def test_spmv_gpu(benchmark, size):
    """``J^T g`` for 16 samples with per-sample values, one launch (the spine / down-sweep primitive)."""
    benchmark.group = "kernels-spmv"
    dev = DEV
    c, h, w = SPMV_SIZES[size]
    a = conv_pattern(c, h, w)
    rows, cols, batch = a.shape[0], a.shape[1], 16
    # vector arena: [g (cols) | out (rows) | zero]; matrix arena: per-sample values (B, nnz)
    zero_v = cols + rows
    lengths = np.diff(a.indptr)
    table = segments_from_pairs(lengths, np.arange(a.nnz, dtype=np.int64), a.indices.astype(np.int64),
                                cols + np.arange(rows, dtype=np.int64), np.full(rows, zero_v, dtype=np.int64),
                                (a.nnz, zero_v + 1), dev)
    vals = torch.randn(batch, a.nnz, device=dev)
    vec = torch.zeros(batch, zero_v + 1, device=dev)
    vec[:, :cols] = torch.randn(batch, cols, device=dev)

    def triton_spmv() -> None:
        spmv(table, vals, vec)
        sync()

    triton_spmv()
    ref = torch.stack([torch.sparse_csr_tensor(torch.from_numpy(a.indptr.astype(np.int64)).to(dev),
                                               torch.from_numpy(a.indices.astype(np.int64)).to(dev), vals[b],
                                               size=a.shape) @ vec[b, :cols] for b in range(batch)])
    assert torch.allclose(vec[:, cols:zero_v], ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))

    benchmark.pedantic(triton_spmv, rounds=20, warmup_rounds=3)
    t = benchmark.stats.stats.median
    nbytes = _index_bytes(table) + table.add.numel() * table.add.element_size() \
        + 4 * batch * (a.nnz + cols + 2 * rows)
    copy = copy_gbps(nbytes, dev)
    benchmark.extra_info.update({
        "device": device_name(), "dtype": "float32", "B": batch, "d": rows, "nnz": a.nnz,
        "flops": 2 * batch * a.nnz, "bytes": nbytes, "GFLOPs": 2 * batch * a.nnz / t / 1e9,
        "GBps": nbytes / t / 1e9, "copy_GBps": copy, "fraction_of_copy": nbytes / t / 1e9 / copy,
    })


# --- (c) + (d): the paper's RNN backward -------------------------------------------------

RNN_H, RNN_B = 20, 16


def _rnn_scan(T: int):
    dev = DEV
    w = sp.csr_array(np.ones((RNN_H, RNN_H)))
    plan = spscan.plan([w] * T, backend="triton", device=dev, dtype=torch.float32, batch_size=RNN_B)
    gen = torch.Generator(device=dev).manual_seed(0)
    values = torch.randn(T, RNN_B, RNN_H * RNN_H, device=dev, generator=gen) / RNN_H ** 0.5
    grad = torch.randn(RNN_B, RNN_H, device=dev, generator=gen)
    return plan, values, grad


@needs_cuda
@pytest.mark.parametrize("T", [1000, 30000])
def test_rnn_backward_gpu(benchmark, T):
    benchmark.group = "kernels-rnn-backward"
    dev = DEV
    plan, values, grad = _rnn_scan(T)

    def scan() -> None:
        spscan.backward(plan, values, grad)
        sync()

    scan()  # compiles the kernels and uploads the tables
    benchmark.pedantic(scan, rounds=10, warmup_rounds=2)
    t_scan = benchmark.stats.stats.median

    rnn = torch.nn.RNN(RNN_H, RNN_H).to(dev)
    x = torch.randn(T, RNN_B, RNN_H, device=dev, requires_grad=True)
    out, _ = rnn(x)
    params = [x, *rnn.parameters()]

    def cudnn() -> None:
        torch.autograd.grad(out[-1], params, grad_outputs=grad, retain_graph=True)
        sync()

    t_cudnn = median_time(cudnn, reps=10)
    tables = plan.bindings()[0].tables
    benchmark.extra_info.update({
        "device": device_name(), "T": T, "B": RNN_B, "H": RNN_H, "levels": plan.levels,
        "launches": tables.launches() if hasattr(tables, "launches") else None,
        "cudnn_backward_s": t_cudnn, "speedup_vs_cudnn": t_cudnn / t_scan,
        "note": "scan: dl/dh_t for every t from explicit Jacobians; cuDNN: BPTT grads of input and weights",
    })


@needs_cuda
@pytest.mark.parametrize("T", [1000, 30000])
def test_rnn_backward_cuda_graph(benchmark, T):
    benchmark.group = "kernels-rnn-cuda-graph"
    plan, values, grad = _rnn_scan(T)

    def eager() -> None:
        spscan.backward(plan, values, grad)
        sync()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as graph capture requires
        for _ in range(3):
            spscan.backward(plan, values, grad)
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = spscan.backward(plan, values, grad)

    def replay() -> None:
        graph.replay()
        sync()

    replay()
    eager_out = spscan.backward(plan, values, grad)
    sync()
    assert all(torch.equal(a, b) for a, b in zip(static_out, eager_out)), "graph replay differs from eager"

    benchmark.pedantic(replay, rounds=20, warmup_rounds=3)
    t_graph = benchmark.stats.stats.median
    t_eager = median_time(eager, reps=10)
    benchmark.extra_info.update({
        "device": device_name(), "T": T, "B": RNN_B, "H": RNN_H, "levels": plan.levels,
        "eager_s": t_eager, "speedup_graph_vs_eager": t_eager / t_graph,
    })


# --- (e): planning time per device profile -------------------------------------------------

def _plan_chains() -> dict:
    w = sp.csr_array(np.ones((RNN_H, RNN_H)))
    cnn = [conv_pattern(2, 16, 16)] * 6
    return {"rnn20-T1000": [w] * 1000, "conv2x16x16-depth6": cnn}


@pytest.mark.parametrize("chain", ["rnn20-T1000", "conv2x16x16-depth6"])
def test_planning_time_per_profile(benchmark, chain):
    benchmark.group = "kernels-planning"
    pats = _plan_chains()[chain]
    per_profile = {}
    for prof in ("cpu", "cuda") if CUDA else ("cpu",):  # a plan for a device needs that device
        t0 = time.perf_counter()
        p = spscan.plan(pats, device=prof, backend="torch", batch_size=RNN_B)
        per_profile[prof] = {"plan_s": time.perf_counter() - t0, "levels": p.levels}
    plan = spscan.plan(pats, device=DEV, batch_size=RNN_B)
    gen = torch.Generator().manual_seed(0)
    values = [(torch.randn(RNN_B, q.nnz, generator=gen) / max(1.0, q.nnz / q.shape[1]) ** 0.5).to(DEV) for q in pats]
    grad = torch.randn(RNN_B, pats[-1].shape[1], generator=gen).to(DEV)

    def backward() -> None:
        spscan.backward(plan, values, grad)
        sync()

    t_backward = median_time(backward, reps=5, warmup=2)
    benchmark.pedantic(lambda: spscan.plan(pats, device=DEV, batch_size=RNN_B), rounds=3, warmup_rounds=1)
    t_plan = benchmark.stats.stats.median
    benchmark.extra_info.update({
        "device": device_name(), "chain": chain, "layers": len(pats), "B": RNN_B,
        **{f"{k}_{prof}_profile": v for prof, d in per_profile.items() for k, v in d.items()},
        "backward_s": t_backward, "levels": plan.levels, "plan_over_backward_ratio": t_plan / t_backward,
    })
