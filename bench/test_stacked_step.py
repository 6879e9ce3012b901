"""Stacked recurrent training steps through ``spscan.wrap`` vs autograd (one scan per layer and direction).

Run: ``pytest bench/test_stacked_step.py --benchmark-only``.

``test_stacked_step_cpu``: ``nn.GRU(1, 20, num_layers=2)`` and a bidirectional 2-layer
``nn.LSTM(1, 20)`` (``batch_first``), B = 16, T = 1000 and 3000, a linear head and cross-entropy on
the last output (``loss="last"``, as ``bench/test_recurrent_step.py``) or on every step's output
(``loss="every"``). ``mode="step"`` times ``zero_grad`` + forward + loss + backward;
``mode="backward"`` times ``loss.backward()`` alone (its forward runs untimed just before). Both
sides run interleaved in the same test, one thread (``torch.set_num_threads(1)``, restored
afterwards), wall time (``time.perf_counter``: on a quiet machine one thread's wall time is its CPU
time); ``extra_info`` has both medians,
``speedup_vs_autograd = autograd / spscan`` and the depth the planner chose for each (layer,
direction) scan (``levels``, index ``layer * directions + direction``).

Every row runs with ``torch.set_flush_denormal(True)`` (see ``bench/test_recurrent_step.py``: over
thousands of steps a last-output gradient decays into float32 denormals, whose ~100x arithmetic
penalty would be measured on both sides instead of the scan) and restores the default afterwards.

``test_stacked_step_cuda`` (skips without a CUDA device): the 2-layer GRU at T = 1000 and 10000,
loss on the last output, ``step`` and ``backward``, ``spscan.wrap(rnn.cuda(), x.cuda())`` (one
Triton scan per layer) against cuDNN's multi-layer GRU under autograd, timed by
``bench/cuda_step.py`` (synchronized wall time, interleaved, warm-up first, 10 pairs); each length
is wrapped once for both modes, and one step's gradients must agree with autograd's before any timing.
"""

from __future__ import annotations

import functools
import os
import statistics

import pytest
import torch
from torch import nn

import spscan
from spscan.kernels.cpu import chain as cpu_chain

from conftest import device_name, time_mode
from cuda_step import checked_step, needs_cuda, plan_backend, record, step_info, time_pairs

H, B = 20, 16
MODELS = {
    "gru-2layer": lambda: nn.GRU(1, H, num_layers=2, batch_first=True),
    "lstm-2layer-bidirectional": lambda: nn.LSTM(1, H, num_layers=2, bidirectional=True, batch_first=True),
}
ROUNDS = {1000: 7, 3000: 5}


def _setup(name: str, T: int, loss: str, scan: bool, device: str = "cpu"):
    torch.manual_seed(0)
    rnn = MODELS[name]().to(device)
    width = H * (2 if rnn.bidirectional else 1)
    head = nn.Linear(width, 2).to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, 1, generator=g).to(device)
    y = torch.randint(0, 2, (B,) if loss == "last" else (B * T,), generator=g).to(device)
    if scan:
        rnn = spscan.wrap(rnn, x)
    loss_fn = nn.CrossEntropyLoss()

    def forward():
        rnn.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        out = rnn(x)[0]
        logits = head(out[:, -1]) if loss == "last" else head(out).reshape(B * T, 2)
        return loss_fn(logits, y)

    return rnn, forward


CASES = [
    ("gru-2layer", 1000, "last"),
    ("gru-2layer", 3000, "last"),
    ("gru-2layer", 1000, "every"),
    ("lstm-2layer-bidirectional", 1000, "every"),
]


@pytest.mark.parametrize("mode", ["step", "backward"])
@pytest.mark.parametrize("name, T, loss", CASES)
def test_stacked_step_cpu(benchmark, flush_denormal, one_thread, name, T, loss, mode):
    benchmark.group = f"{name}-cpu-T{T}-{loss}-{mode}"
    rounds = ROUNDS[T]
    _, a_fwd = _setup(name, T, loss, scan=False)
    wrapped, s_fwd = _setup(name, T, loss, scan=True)
    time_mode(mode, a_fwd), time_mode(mode, s_fwd)  # warm-up: allocator, plans and lowering for this T
    pairs = [(time_mode(mode, a_fwd), time_mode(mode, s_fwd)) for _ in range(rounds)]
    base = statistics.median(p[0] for p in pairs)
    ours = statistics.median(p[1] for p in pairs)
    if mode == "backward":
        benchmark.pedantic(lambda loss: loss.backward(), setup=lambda: ((s_fwd(),), {}), rounds=rounds)
    else:
        benchmark.pedantic(lambda: s_fwd().backward(), rounds=rounds)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    benchmark.extra_info.update(
        device=device_name(), load_average_1min=load, model=name, T=T, B=B, H=H, loss=loss, mode=mode,
        levels=wrapped.plan.levels, autograd_median_s=base, spscan_median_s=ours, speedup_vs_autograd=base / ours,
        median_ratio_of_pairs=statistics.median(a / o for a, o in pairs), flush_denormal=flush_denormal,
        compiled_middle=cpu_chain.available(), threads=torch.get_num_threads(), pairs=rounds,
    )


# the stacked 2-layer GRU against cuDNN's multi-layer GRU under autograd: loss on the last output
CUDA_CASES = [("gru-2layer", T, mode) for T in (1000, 10000) for mode in ("step", "backward")]
CUDA_ROUNDS = 10
CUDA_GRAD_TOL = 1e-3  # one step in full float32 on both sides, summed in other orders over T steps


@functools.cache
def _cuda_pair(name: str, T: int):
    """Both sides on the device (planned once for the two modes) and their checked gradients."""
    plain, a_fwd = _setup(name, T, "last", scan=False, device="cuda")
    wrapped, s_fwd = _setup(name, T, "last", scan=True, device="cuda")
    worst = checked_step(a_fwd, s_fwd, plain.parameters(), wrapped.parameters(), CUDA_GRAD_TOL, f"{name} T={T}")
    return wrapped, a_fwd, s_fwd, worst


@needs_cuda
@pytest.mark.parametrize("name, T, mode", CUDA_CASES)
def test_stacked_step_cuda(benchmark, name, T, mode):
    """``spscan.wrap(rnn.cuda(), x.cuda())`` (one Triton scan per layer) vs cuDNN, synchronized wall time."""
    benchmark.group = f"{name}-cuda-T{T}-last-{mode}"
    wrapped, a_fwd, s_fwd, worst = _cuda_pair(name, T)
    pairs = time_pairs(mode, a_fwd, s_fwd, CUDA_ROUNDS)
    record(benchmark, mode, s_fwd, CUDA_ROUNDS)
    benchmark.extra_info.update(
        device=device_name(), model=name, T=T, B=B, H=H, loss="last", mode=mode, levels=wrapped.plan.levels,
        backend=plan_backend(wrapped.plan), grad_max_rel_diff=worst, **step_info(pairs),
    )
