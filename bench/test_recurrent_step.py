"""Recurrent training steps through ``spscan.wrap`` vs autograd, and the compiled CPU middle chain vs NumPy.

Run: ``pytest bench/test_recurrent_step.py --benchmark-only``.

``test_recurrent_step_cpu``: ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` (input 1, hidden 20,
``batch_first``), T = 1000, 3000, 10000, B = 16, a linear head and cross-entropy on the last
output (``loss="last"``; for the LSTM also ``loss="every"``: the head and cross-entropy on every
step's output). ``mode="step"`` times ``zero_grad`` + forward + loss + backward;
``mode="backward"`` times ``loss.backward()`` alone (its forward runs untimed just before);
``mode="forward"`` times ``zero_grad`` + forward + loss alone (with autograd recording; its
backward runs untimed just after). Both sides run interleaved in the same test, one thread
(``torch.set_num_threads(1)``, restored afterwards), 11 pairs per row, timed with
``time.process_time`` (the CPU time of this process: with one thread it is the work done, and it
is far less disturbed than wall time when other processes share the cores); ``extra_info`` has
both medians and ``speedup_vs_autograd = autograd / spscan``. Autograd's ``nn.LSTM`` on CPU runs
oneDNN's fused LSTM forward and backward (float32).

``test_recurrent_step_cpu_wide``: the three cells at H = 64, 128 and 256 (T = 1000, B = 16, step,
loss on the last output, 5 pairs).

``test_middle_chain_compiled_vs_numpy``: the paper's RNN chain as the recurrent wrapper plans it
(factored: shared ``W_hh^T`` and per-sample diagonal ``1 - h^2``, T = 1000, 3000, 10000, B = 16,
H = 20, linear scan), ``spscan.backward`` with the compiled loop (kernels/cpu/chain.py) against the
NumPy loop, interleaved: ``speedup_compiled_vs_numpy``.

Denormals: over thousands of steps the gradient of a loss on the last output decays into the
float32 denormal range, where x86 arithmetic slows down by ~100x. spscan's compiled loops flush
denormals to zero on their own while they run (kernels/cpu/fpenv.py); autograd's kernels do not,
and a row would time autograd's denormal penalty rather than its backward. So every row here runs
with ``torch.set_flush_denormal(True)`` (recorded as ``flush_denormal`` in ``extra_info``), the
faster baseline, and restores the default (off) afterwards. ``bench/never_slower.py`` times the
default instead: nothing flushed outside spscan's loops.

``test_recurrent_step_cuda`` (skips without a CUDA device): ``nn.GRU`` and ``nn.LSTM`` at T = 1000
and 10000, B = 16, loss on the last output, ``step`` and ``backward``, ``spscan.wrap(rnn.cuda(),
x.cuda())`` (Triton backend) against cuDNN under autograd, timed by ``bench/cuda_step.py``
(synchronized wall time, interleaved, warm-up first, 10 pairs); each (cell, T) is wrapped once for
both modes, and one step's gradients must agree with autograd's before any timing. The plain RNN's CUDA rows are ``bench/test_rnn_step.py``'s.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn

import spscan
from spscan.kernels.cpu import chain as cpu_chain

from conftest import device_name, time_mode
from cuda_step import checked_step, needs_cuda, plan_backend, record, step_info, time_pairs
from floors import recurrent_floor

H, B = 20, 16
CELLS = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}
ROUNDS = {1000: 11, 3000: 11, 10000: 11}  # interleaved pairs per row (medians)
CLOCK = time.process_time


def _setup(cell: str, T: int, scan: bool, loss: str = "last", device: str = "cpu", hidden: int = H):
    torch.manual_seed(0)
    rnn = CELLS[cell](1, hidden, batch_first=True).to(device)
    head = nn.Linear(hidden, 2).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, 1, generator=g).to(device)
    y = torch.randint(0, 2, (B,), generator=g).to(device)
    if scan:
        rnn = spscan.wrap(rnn, x)
    loss_fn = nn.CrossEntropyLoss()

    def forward():
        rnn.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        out = rnn(x)[0]
        if loss == "every":
            return loss_fn(head(out).reshape(B * T, 2), y.repeat_interleave(T))
        return loss_fn(head(out[:, -1]), y)

    return rnn, forward


# every cell: step and backward with a loss on the last output; the LSTM also: its forward alone and
# a loss on every output (where its compiled forward and per-step losses matter)
ROWS = [(cell, T, mode, loss) for cell in CELLS for T in (1000, 3000, 10000)
        for mode in ("step", "backward", "forward") for loss in ("last", "every")
        if cell == "lstm" or (mode != "forward" and loss == "last")]


@pytest.mark.parametrize("cell,T,mode,loss", ROWS, ids=["-".join(map(str, r)) for r in ROWS])
def test_recurrent_step_cpu(benchmark, flush_denormal, one_thread, cell, T, mode, loss):
    benchmark.group = f"{cell}-cpu-T{T}-{mode}-{loss}"
    rounds = ROUNDS[T]
    _, a_fwd = _setup(cell, T, scan=False, loss=loss)
    wrapped, s_fwd = _setup(cell, T, scan=True, loss=loss)
    time_mode(mode, a_fwd, CLOCK), time_mode(mode, s_fwd, CLOCK)  # warm-up: allocator, plan and lowering for this T
    pairs = [(time_mode(mode, a_fwd, CLOCK), time_mode(mode, s_fwd, CLOCK)) for _ in range(rounds)]
    base = statistics.median(p[0] for p in pairs)
    ours = statistics.median(p[1] for p in pairs)
    if mode == "backward":
        benchmark.pedantic(lambda loss: loss.backward(), setup=lambda: ((s_fwd(),), {}), rounds=rounds)
    elif mode == "forward":
        benchmark.pedantic(s_fwd, rounds=rounds)
    else:
        benchmark.pedantic(lambda: s_fwd().backward(), rounds=rounds)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    benchmark.extra_info.update(
        device=device_name(), load_average_1min=load, cell=cell, T=T, B=B, H=H, mode=mode, loss=loss,
        levels=wrapped.plan.levels, autograd_median_s=base, spscan_median_s=ours, speedup_vs_autograd=base / ours,
        median_ratio_of_pairs=statistics.median(a / o for a, o in pairs), flush_denormal=flush_denormal,
        compiled_middle=cpu_chain.available(), clock=CLOCK.__name__, threads=torch.get_num_threads(),
        pairs=rounds,
    )


WIDE = [(cell, hidden) for cell in CELLS for hidden in (64, 128, 256)]


@pytest.mark.parametrize("cell,hidden", WIDE, ids=[f"{c}-H{h}" for c, h in WIDE])
def test_recurrent_step_cpu_wide(benchmark, flush_denormal, one_thread, cell, hidden):
    """Wider cells (H = 64, 128, 256), T = 1000, B = 16, one training step, loss on the last output:
    the LSTM's shared CSR element (``4 H^2 + H`` entries) passes 2**16 entries from H = 128."""
    benchmark.group = f"{cell}-cpu-H{hidden}-step"
    rounds = 5
    _, a_fwd = _setup(cell, 1000, scan=False, hidden=hidden)
    wrapped, s_fwd = _setup(cell, 1000, scan=True, hidden=hidden)
    time_mode("step", a_fwd, CLOCK), time_mode("step", s_fwd, CLOCK)
    pairs = [(time_mode("step", a_fwd, CLOCK), time_mode("step", s_fwd, CLOCK)) for _ in range(rounds)]
    base = statistics.median(p[0] for p in pairs)
    ours = statistics.median(p[1] for p in pairs)
    benchmark.pedantic(lambda: s_fwd().backward(), rounds=rounds)
    benchmark.extra_info.update(
        device=device_name(), cell=cell, T=1000, B=B, H=hidden, mode="step", loss="last",
        levels=wrapped.plan.levels, autograd_median_s=base, spscan_median_s=ours, speedup_vs_autograd=base / ours,
        flush_denormal=flush_denormal, compiled_middle=cpu_chain.available(), clock=CLOCK.__name__,
        threads=torch.get_num_threads(), pairs=rounds,
    )


@pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")
@pytest.mark.parametrize("T", [1000, 3000, 10000])
def test_middle_chain_compiled_vs_numpy(benchmark, flush_denormal, monkeypatch, T):
    benchmark.group = f"middle-chain-T{T}"
    pats = [sp.csr_array(np.ones((H, H))), sp.csr_array(np.eye(H))] * T
    plan = spscan.plan(pats, levels=0, backend="torch")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(H * H, generator=g) / H ** 0.5
    d = torch.rand(T, B, H, generator=g)  # 1 - h^2 in [0, 1)
    values = [v for t in range(T) for v in (w, d[t])]  # as the recurrent wrapper passes them: views, no copies
    grad = torch.randn(B, H, generator=g)
    compiled = cpu_chain.available

    def run(use_compiled: bool) -> float:
        monkeypatch.setattr(cpu_chain, "available", compiled if use_compiled else (lambda: False))
        t0 = time.perf_counter()
        spscan.backward(plan, values, grad)
        return time.perf_counter() - t0

    run(True), run(False)
    rounds = ROUNDS[T] * 2
    pairs = [(run(False), run(True)) for _ in range(rounds)]
    numpy_s = statistics.median(p[0] for p in pairs)
    ours = statistics.median(p[1] for p in pairs)
    monkeypatch.setattr(cpu_chain, "available", compiled)
    benchmark.pedantic(lambda: spscan.backward(plan, values, grad), rounds=rounds)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    benchmark.extra_info.update(
        device=device_name(), load_average_1min=load, T=T, B=B, H=H, chain="factored RNN (W_hh^T, diag)",
        levels=plan.levels, numpy_median_s=numpy_s, compiled_median_s=ours, speedup_compiled_vs_numpy=numpy_s / ours,
        median_ratio_of_pairs=statistics.median(a / o for a, o in pairs), flush_denormal=flush_denormal,
    )


# GRU and LSTM against cuDNN's fused RNN kernels under autograd (the plain RNN's CUDA rows are in
# bench/test_rnn_step.py): step and backward, loss on the last output, a short and a long sequence
# (the short ones first: a run stopped at its time limit keeps both cells' rows)
CUDA_ROWS = [(cell, T, mode) for T in (1000, 10000) for cell in ("gru", "lstm") for mode in ("step", "backward")]
CUDA_ROUNDS = 10
CUDA_GRAD_TOL = 1e-3  # one step in full float32 on both sides, summed in other orders over T steps


@functools.cache
def _cuda_pair(cell: str, T: int):
    """Both sides on the device (planned once for the two modes) and their checked gradients."""
    plain, a_fwd = _setup(cell, T, scan=False, device="cuda")
    wrapped, s_fwd = _setup(cell, T, scan=True, device="cuda")
    worst = checked_step(a_fwd, s_fwd, plain.parameters(), wrapped.parameters(), CUDA_GRAD_TOL, f"{cell} T={T}")
    return wrapped, a_fwd, s_fwd, worst


@needs_cuda
@pytest.mark.parametrize("cell,T,mode", CUDA_ROWS, ids=["-".join(map(str, r)) for r in CUDA_ROWS])
def test_recurrent_step_cuda(benchmark, cell, T, mode):
    """``spscan.wrap(rnn.cuda(), x.cuda())`` (Triton scan) vs cuDNN under autograd, synchronized wall time."""
    benchmark.group = f"{cell}-cuda-T{T}-{mode}-last"
    wrapped, a_fwd, s_fwd, worst = _cuda_pair(cell, T)
    pairs = time_pairs(mode, a_fwd, s_fwd, CUDA_ROUNDS)
    record(benchmark, mode, s_fwd, CUDA_ROUNDS)
    info = step_info(pairs)
    benchmark.extra_info.update(
        device=device_name(), cell=cell, T=T, B=B, H=H, mode=mode, loss="last", levels=wrapped.plan.levels,
        backend=plan_backend(wrapped.plan), grad_max_rel_diff=worst, **info,
        **recurrent_floor(cell, T, B, H, 1, mode, info["spscan_median_s"]),
    )
