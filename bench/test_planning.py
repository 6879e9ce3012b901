"""Planning time of ``levels="auto"`` against planning at the depth it picks, on four workloads.

Run: ``pytest bench/test_planning.py --benchmark-only``. The depth search costs depths in order and
stops before it builds pair lists (or whole schedules) it will not use, so ``auto`` should cost at most
~1.5x the plan of its own choice. Each row times both sides interleaved (auto, then the chosen depth, repeated) on
the same device and reports in ``extra_info`` the medians, their ratio ``auto / chosen`` (<= 1.5 is
the goal), the depth chosen and the candidates costed.

Workloads: LeNet-5 (3x32x32), a small VGG (16-M-32-M-64-64-M, 32x32), a MobileNet-like stack of
depthwise-separable blocks (32x32, eval mode), a 200-layer chain of random
256x256 patterns (density 0.02) and ``nn.RNN(1, 20)`` at T = 30000 (B = 16).
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn

import spscan

from conftest import device_name
from never_slower_models import mobilenet_like as _mobilenet_stack


def lenet5():
    return nn.Sequential(
        nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    ), torch.randn(1, 3, 32, 32)


def vgg_small():
    layers: list[nn.Module] = []
    c = 3
    for v in [16, "M", 32, "M", 64, 64, "M"]:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
            c = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 4 * 4, 10)), torch.randn(1, 3, 32, 32)


def mobilenet_like():
    """The depthwise-separable block stack of the never-slower suite, in eval mode, on 32x32 inputs."""
    return _mobilenet_stack().eval(), torch.randn(1, 3, 32, 32)


def random_chain():
    rng = np.random.default_rng(0)
    return [sp.random(256, 256, density=0.02, format="csr", random_state=rng) for _ in range(200)], None


def rnn_t30000():
    torch.manual_seed(0)
    return nn.RNN(1, 20, batch_first=True), torch.randn(16, 30000, 1)


WORKLOADS = {"lenet5": (lenet5, 5), "vgg_small": (vgg_small, 5), "mobilenet_like": (mobilenet_like, 5),
             "random200_256": (random_chain, 5),
             "rnn_T30000": (rnn_t30000, 3)}


def _plan(what, x, levels):
    return spscan.plan(what, x, levels=levels) if x is not None else spscan.plan(what, levels=levels)


def _timed(what, x, levels):
    t0 = time.perf_counter()
    plan = _plan(what, x, levels)
    return time.perf_counter() - t0, plan


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_plan_auto_vs_chosen_depth(benchmark, workload):
    benchmark.group = f"planning-{workload}"
    make, rounds = WORKLOADS[workload]
    what, x = make()
    _, plan = _timed(what, x, "auto")  # warm-up: imports, caches of pattern kinds
    k = plan.levels
    _timed(what, x, k)
    pairs = [(_timed(what, x, "auto")[0], _timed(what, x, k)[0]) for _ in range(rounds)]
    auto = statistics.median(p[0] for p in pairs)
    chosen = statistics.median(p[1] for p in pairs)
    benchmark.pedantic(lambda: _plan(what, x, "auto"), rounds=1)
    scan = getattr(plan, "core", plan)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    benchmark.extra_info.update(
        device=device_name(), load_average_1min=load, workload=workload, levels_chosen=k,
        auto_median_s=auto, chosen_depth_median_s=chosen, ratio_auto_over_chosen=auto / chosen,
        median_ratio_of_pairs=statistics.median(a / c for a, c in pairs), rounds=rounds,
        summary_first_line=scan.summary().splitlines()[0] if hasattr(scan, "summary") else None,
    )
