"""One training step of the paper's bitstream RNN (§4.1: H=20, B=16) through spscan.wrap vs autograd.

Run: ``pytest bench/test_rnn_step.py --benchmark-only``. Each spscan row carries, in
``extra_info``, the autograd median measured in the same test on the same device and the
ratio ``autograd / spscan`` (> 1 means spscan is faster), the scan depth in use and the chain.
``mode="step"`` times forward + loss + backward; ``mode="backward"`` times ``loss.backward()``
alone (the forward, which also builds the Jacobian values, runs in the untimed setup).
The CUDA rows compare with cuDNN autograd at T=30000 and skip cleanly without a GPU.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from torch import nn

import spscan
from spscan.cli.datasets import bitstream_dataset
from spscan.cli.demo import BitstreamClassifier

from floors import recurrent_floor

H, B = 20, 16


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _setup(T: int, dev: torch.device, scan: bool, **plan_kwargs):
    x, y = bitstream_dataset(B, T, seed=0)
    x, y = x.to(dev), y.to(dev)
    torch.manual_seed(0)
    model = BitstreamClassifier(H).to(dev)
    if scan:
        model.rnn = spscan.wrap(model.rnn, x, **plan_kwargs)
    loss_fn = nn.CrossEntropyLoss()

    def forward():
        model.zero_grad(set_to_none=True)
        return loss_fn(model(x), y)

    def step():
        forward().backward()
        _sync(dev)

    return model, forward, step


def _time_step(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def _time_backward(forward, dev: torch.device) -> float:
    loss = forward()
    _sync(dev)
    t0 = time.perf_counter()
    loss.backward()
    _sync(dev)
    return time.perf_counter() - t0


def _run(benchmark, T: int, mode: str, dev: torch.device, rounds: int, **plan_kwargs) -> None:
    _, a_fwd, a_step = _setup(T, dev, scan=False)
    model, s_fwd, s_step = _setup(T, dev, scan=True, **plan_kwargs)
    # the ratio comes from interleaved pairs, so a change in machine load hits both sides alike
    timer = (lambda f, s: _time_step(s)) if mode == "step" else (lambda f, s: _time_backward(f, dev))
    timer(a_fwd, a_step), timer(s_fwd, s_step)  # warm-up: allocator, plan for this T
    pairs = [(timer(a_fwd, a_step), timer(s_fwd, s_step)) for _ in range(rounds)]
    base = statistics.median(p[0] for p in pairs)
    ours = statistics.median(p[1] for p in pairs)
    if mode == "step":
        benchmark.pedantic(s_step, rounds=rounds)
    else:

        def setup():
            loss = s_fwd()
            _sync(dev)
            return (loss,), {}

        def backward(loss):
            loss.backward()
            _sync(dev)

        benchmark.pedantic(backward, setup=setup, rounds=rounds)
    plan = model.rnn.plan
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    benchmark.extra_info.update(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu, {torch.get_num_threads()} threads",
        load_average_1min=load, T=T, B=B, H=H, mode=mode, layout=plan.layout, levels=plan.levels,
        autograd_median_s=base, spscan_median_s=ours, speedup_vs_autograd=base / ours,
        median_ratio_of_pairs=statistics.median(a / o for a, o in pairs),
    )
    if dev.type == "cuda":  # the analytic floor of the row (bench/floors.py)
        benchmark.extra_info.update(recurrent_floor("rnn", T, B, H, 1, mode, ours))


@pytest.mark.parametrize("mode", ["step", "backward"])
@pytest.mark.parametrize("T", [1000, 3000, 10000])
def test_rnn_step_cpu(benchmark, T, mode):
    benchmark.group = f"rnn-cpu-T{T}-{mode}"
    _run(benchmark, T, mode, torch.device("cpu"), rounds=7 if T < 10000 else 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["step", "backward"])
@pytest.mark.parametrize("T", [1000, 30000])
def test_rnn_step_cuda(benchmark, T, mode):
    """Against cuDNN's RNN under autograd, as in the paper's Figure 8."""
    benchmark.group = f"rnn-cuda-T{T}-{mode}"
    _run(benchmark, T, mode, torch.device("cuda"), rounds=10)
