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


@pytest.mark.parametrize("form", ["stacked", "list"])
def test_backward_host_cost(benchmark, form):
    """``spscan.backward`` on a chain of 30000 4x4 diagonal patterns (B = 4, depth 0): numeric work is a
    few microseconds per layer, so the row shows the per-call host work. ``form``: the values as one
    stacked ``(n, B, nnz)`` tensor, or as a Python list of its ``n`` rows (checked, then run, as one)."""
    n, batch = 30000, 4
    plan = spscan.plan([sp.csr_array(sp.eye(4))] * n, levels=0, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(n, batch, 4, generator=g).to(DEVICE)
    values = stacked if form == "stacked" else list(stacked)
    grad = torch.randn(batch, 4, generator=g).to(DEVICE)
    spscan.backward(plan, values, grad)  # lower once, outside the timing
    benchmark(lambda: spscan.backward(plan, values, grad))
    benchmark.extra_info.update(device=device_name(), levels=plan.levels, n=n, batch=batch, form=form)
    _medians[("host", form)] = benchmark.stats.stats.median
    if form == "list" and ("host", "stacked") in _medians:
        benchmark.extra_info["list_vs_stacked"] = benchmark.stats.stats.median / _medians[("host", "stacked")]
