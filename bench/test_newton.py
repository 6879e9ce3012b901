"""The Newton forward (spscan.recurrent.newton) vs the sequential forward: iterations, time per iteration, ratio.

Run: ``pytest bench/test_newton.py --benchmark-only -s``. Every row times, interleaved in the
same test on the same device, the module's own forward (torch's CPU loop, cuDNN on CUDA) and
the Newton forward of ``spscan.plan(module, x, forward="newton")`` on the same weights and batch
(B = 16, default initialization, random inputs), and records in ``extra_info``: the iterations
to converge, the time per iteration, both medians and ``ratio = sequential / newton`` (> 1 means
the Newton forward is faster), the forward scan's depth and the device; CUDA rows also the floor of
any forward (or step) of that shape and ``fraction_of_floor`` (``bench/floors.py``). ``mode="step"`` times a
whole training step (forward + loss on every output + backward) of ``spscan.wrap(module, x,
forward="newton")`` against autograd through the module.

Each row runs one ``method`` (``newton={"method": ...}``): ``"newton"`` (the full ``J_t``, DEER:
few iterations, each a scan of dense ``H x H`` steps) or ``"quasi"`` (its diagonal, quasi-DEER:
more iterations, each a scan of diagonal steps, which costs ``O(H)`` per step instead of ``O(H^3)``
in a parallel run's chunk maps). The default grid is small (a loaded 2-core CPU);
``SPSCAN_BENCH_NEWTON_FULL=1`` runs the whole grid T in (100, 1000, 10000, 100000) x H in (1, 20,
64, 256). The CUDA rows (cuDNN baseline, including the target point T=30000, H=20) skip cleanly
without a GPU.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import pytest
import torch
from conftest import device_name
from floors import recurrent_floor
from torch import nn

import spscan
from spscan.recurrent.newton import NewtonNotConverged

B = 16
INPUTS = 8
FULL = os.environ.get("SPSCAN_BENCH_NEWTON_FULL", "") not in ("", "0")
CELLS = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}

if FULL:
    CPU_GRID = [(T, H) for T in (100, 1000, 10000, 100000) for H in (1, 20, 64, 256)]
else:
    CPU_GRID = [(100, 1), (100, 20), (1000, 20), (1000, 64), (10000, 20)]
CUDA_GRID = [(T, H) for T in (100, 1000, 10000, 30000, 100000) for H in (1, 20, 64, 256)] if FULL else \
    [(1000, 20), (30000, 20), (30000, 64)]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev: torch.device) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def _setup(cell: str, T: int, H: int, dev: torch.device, mode: str, method: str):
    torch.manual_seed(0)
    options = {"forward": "newton", "newton": {"method": method}}
    m = CELLS[cell](INPUTS, H).to(dev)
    x = torch.randn(T, B, INPUTS, device=dev)
    if mode == "forward":
        plan = spscan.plan(m, x, **options)

        def base():
            with torch.no_grad():
                m(x)

        def ours():
            with torch.no_grad():
                plan.forward(x)

        return base, ours, plan
    w = spscan.wrap(m, x, **options)
    xg = x.clone().requires_grad_(True)

    def base():
        m.zero_grad(set_to_none=True)
        m(xg)[0].sum().backward()

    def ours():
        m.zero_grad(set_to_none=True)
        w(xg)[0].sum().backward()

    return base, ours, w.plan


def _run(benchmark, cell: str, T: int, H: int, dev: torch.device, mode: str, rounds: int,
         method: str = "newton") -> None:
    base, ours, plan = _setup(cell, T, H, dev, mode, method)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NewtonNotConverged)  # a fallback would time the sequential forward twice
        _timed(base, dev), _timed(ours, dev)  # warm-up: allocator, binding
        pairs = [(_timed(base, dev), _timed(ours, dev)) for _ in range(rounds)]
        info = plan.last_forward
        seq = statistics.median(p[0] for p in pairs)
        newton = statistics.median(p[1] for p in pairs)
        benchmark.pedantic(ours, rounds=1, iterations=1)
    fplan = plan.newton.forward_plan(T, dev, torch.float32, plan.newton_options.method)
    benchmark.extra_info.update({
        "device": device_name() if dev.type == "cpu" else torch.cuda.get_device_name(dev),
        "cell": cell, "T": T, "H": H, "B": B, "mode": mode, "method": method,
        "iterations": info.iterations, "stop": info.reason,
        # one more scan, of the full J_t, after more than 16 iterations (the conditioning check)
        "amplification_measured": info.amplification is not None,
        "baseline": "cuDNN" if dev.type == "cuda" else "torch CPU loop",
        "sequential_ms": seq * 1e3, "newton_ms": newton * 1e3,
        "ms_per_iteration": newton * 1e3 / max(1, info.iterations),  # the conditioning scan included
        "ratio_sequential_over_newton": seq / newton,
        "forward_scan_levels": fplan.levels,
    })
    if dev.type == "cuda":  # the floor of any forward (or step): what the sequential one must read, write and multiply
        benchmark.extra_info.update(recurrent_floor(cell, T, B, H, INPUTS, mode, newton))
    checked = ", conditioning scan" if info.amplification is not None else ""
    per_iter = newton * 1e3 / max(1, info.iterations)
    print(f"\n[{benchmark.extra_info['device']}] {mode} {method} {cell} T={T} H={H} B={B}: "
          f"{info.iterations} iterations ({info.reason}{checked}), newton {newton * 1e3:.2f} ms "
          f"({per_iter:.2f} ms/iter, scan levels {fplan.levels}) vs {benchmark.extra_info['baseline']} "
          f"{seq * 1e3:.2f} ms: ratio {seq / newton:.3f}")


@pytest.mark.parametrize("method", ["newton", "quasi"])
@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("T,H", CPU_GRID)
def test_newton_forward_cpu(benchmark, cell, T, H, method):
    rounds = 3 if T * H <= 1_000_000 else 1  # one interleaved pair only for the full grid's biggest points
    _run(benchmark, cell, T, H, torch.device("cpu"), "forward", rounds, method)


@pytest.mark.parametrize("cell", ["gru"])
@pytest.mark.parametrize("T,H", [(1000, 20)])
def test_newton_training_step_cpu(benchmark, cell, T, H):
    _run(benchmark, cell, T, H, torch.device("cpu"), "step", 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["newton", "quasi"])
@pytest.mark.parametrize("mode", ["forward", "step"])
@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("T,H", CUDA_GRID)
def test_newton_cuda_vs_cudnn(benchmark, mode, cell, T, H, method):
    _run(benchmark, cell, T, H, torch.device("cuda"), mode, 5, method)
