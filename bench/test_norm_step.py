"""The backward of an MLP with LayerNorm(1024) (B = 64, float32): autograd vs spscan with the
LayerNorm structured operator vs spscan forming LayerNorm's dense per-sample blocks.

Run: ``pytest bench/test_norm_step.py --benchmark-only -s``. Model: ``Linear(1024, 1024) ->
LayerNorm(1024) -> GELU`` twice, then ``Linear(1024, 10)``, cross-entropy on random labels; the
plan is the linear scan (``levels="auto"`` picks depth 0). The dense-block side is the same plan
with LayerNorm's operator withheld (as before LayerNorm had one): its ``J^T`` values, one dense
1024 x 1024 block per sample, are filled and multiplied by the gradient. The three are timed
interleaved on one thread with ``time.process_time`` (``loss.backward()`` only; each forward
runs untimed before it) and compared by their medians, all in the same run.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
import torch
from torch import nn

import spscan
from spscan.layers import LayerNormUnit

from conftest import device_name

D, BATCH, ROUNDS = 1024, 64, 5


class _DenseBlockLayerNorm(LayerNormUnit):
    """LayerNorm without its structured operator: the scan multiplies its dense CSR blocks."""

    @property
    def has_operator(self) -> bool:
        return False


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.GELU(), nn.Linear(D, D), nn.LayerNorm(D), nn.GELU(),
                         nn.Linear(D, 10))


def _backward_time(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    net.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(net(x), y)
    t0 = time.process_time()
    loss.backward()
    return time.process_time() - t0


@pytest.mark.slow
def test_layernorm_mlp_backward_cpu(benchmark):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(BATCH, D, generator=g)
        y = torch.randint(0, 10, (BATCH,), generator=g)
        plain = _mlp()
        ops = spscan.wrap(_mlp(), x)
        dense = spscan.wrap(_mlp(), x)
        for u in dense.plan.units:
            if isinstance(u, LayerNormUnit):
                u.__class__ = _DenseBlockLayerNorm
        dense.plan.bind_signatures()
        assert ops.plan.levels == 0 and dense.plan.levels == 0
        nets = (plain, ops, dense)
        for _ in range(2):  # warm-up
            for n in nets:
                _backward_time(n, x, y)
        rows = [tuple(_backward_time(n, x, y) for n in nets) for _ in range(ROUNDS)]
        ag, op, dn = (statistics.median(r[k] for r in rows) for k in range(3))
        benchmark.group = "layernorm-mlp-backward"
        benchmark.pedantic(lambda loss: loss.backward(),
                           setup=lambda: ((nn.functional.cross_entropy(ops(x), y),), {}), rounds=3)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        benchmark.extra_info.update(
            device=device_name(), threads=1, load_average_1min=load, d=D, batch=BATCH, levels=ops.plan.levels,
            autograd_median_s=ag, operator_median_s=op, dense_blocks_median_s=dn, operator_vs_autograd=op / ag,
            dense_blocks_vs_autograd=dn / ag, dense_blocks_vs_operator=dn / op, timer="process_time")
        print(f"\nLayerNorm({D}) MLP backward, B={BATCH}: autograd {ag * 1e3:.1f} ms, operator {op * 1e3:.1f} ms "
              f"({op / ag:.2f}x autograd), dense blocks {dn * 1e3:.1f} ms ({dn / ag:.0f}x autograd, "
              f"{dn / op:.0f}x the operator), {device_name()}, load {load}")
    finally:
        torch.set_num_threads(threads)
