"""Planning time and backward time of the core engine: linear scan vs auto vs full Blelloch.

(a) the paper's RNN chain: T = 1000 dense 20x20 transposed Jacobians, B = 16;
(b) a chain of sparse CNN Jacobians (conv / ReLU / max-pool patterns of a small CNN on 16x16).
FLOPs and bytes per call come from the plan's symbolic products (``extra_info``); the ratios
against the linear scan are those of medians measured in the same run.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan
from spscan.planner.planning import step_costs

from conftest import device_name

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LEVELS = [0, "auto", "full"]
_medians: dict[tuple[str, str], float] = {}


def rnn_chain(T: int = 1000, H: int = 20):
    return [sp.csr_array(np.ones((H, H)))] * T


def cnn_chain():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
    )
    return spscan.plan(model, torch.randn(1, 3, 16, 16), levels=0).patterns


CHAINS = {"rnn_T1000_H20": rnn_chain, "cnn10": cnn_chain}


def _values(patterns, batch):
    g = torch.Generator().manual_seed(0)
    if all(p is patterns[0] for p in patterns):
        return torch.randn(len(patterns), batch, patterns[0].nnz, generator=g) / np.sqrt(patterns[0].shape[1])
    return [torch.randn(batch, p.nnz, generator=g) * 0.3 for p in patterns]


def _info(benchmark, plan, batch):
    costs = step_costs(plan._scan)
    benchmark.extra_info.update(
        device=device_name(), levels=plan.levels, max_levels=plan.max_levels, batch=batch,
        flops=int(sum(c.flops for c in costs) * batch), bytes=int(sum(c.bytes for c in costs) * batch),
        steps=len(costs),
    )


@pytest.mark.parametrize("chain", list(CHAINS))
def test_plan_time(benchmark, chain):
    patterns = CHAINS[chain]()
    plan = benchmark(lambda: spscan.plan(patterns, levels="auto", device=DEVICE))
    benchmark.extra_info.update(device=device_name(), levels=plan.levels, n=plan.n)


@pytest.mark.parametrize("levels", LEVELS, ids=[str(x) for x in LEVELS])
@pytest.mark.parametrize("chain", list(CHAINS))
def test_backward_time(benchmark, chain, levels):
    patterns = CHAINS[chain]()
    batch = 16
    plan = spscan.plan(patterns, levels=levels, device=DEVICE)
    values = _values(patterns, batch)
    values = values.to(DEVICE) if isinstance(values, torch.Tensor) else [v.to(DEVICE) for v in values]
    grad = torch.randn(batch, plan.dims[-1], device=DEVICE)
    spscan.backward(plan, values, grad)  # lower and upload once, outside the timing

    def run():
        out = spscan.backward(plan, values, grad)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return out

    benchmark(run)
    _info(benchmark, plan, batch)
    _medians[(chain, str(levels))] = benchmark.stats.stats.median
    linear = _medians.get((chain, "0"))
    if linear is not None and str(levels) != "0":
        benchmark.extra_info["speedup_vs_linear"] = linear / benchmark.stats.stats.median
