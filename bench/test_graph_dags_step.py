"""One training step of a full-width CIFAR ResNet-20 with **option-A** shortcuts through
``spscan.wrap`` vs plain autograd, with the graph planned both ways: series-parallel blocks (what
``dag="auto"`` picks for it) and the general live-set chain (``dag="live"``).

Run: ``pytest bench/test_graph_dags_step.py --benchmark-only -s``. The model: a 3x3 stem, 3 stages
of 3 BasicBlocks with 16/32/64 channels whose shortcut is the identity, or where the shape changes
``F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, c//4, c//4))`` in a ``LambdaLayer`` (He et al. 2016, option
A), global average pooling, a 10-way linear classifier; **train mode**, float32, batch 16 of
3x32x32, cross-entropy on random labels. Timed as ``bench/test_resnet_step.py`` times its option-B
model: one thread, ``time.process_time``, interleaved (autograd, blocks, live set, repeated), medians;
``extra_info`` carries the medians, the ratios, both planning times and the device.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import spscan

from conftest import device_name

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")  # the reference ResNet-20: examples/resnet.py
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from resnet import ResNet20  # noqa: E402

BATCH = 16
ROUNDS = 7


def _step(net: nn.Module, x, y, loss_fn) -> float:
    net.zero_grad(set_to_none=True)
    t0 = time.process_time()
    loss_fn(net(x), y).backward()
    return time.process_time() - t0


@pytest.mark.slow
def test_resnet20_option_a_step_cpu(benchmark):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        plain = ResNet20(shortcut="A").train()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(BATCH, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (BATCH,), generator=g)
        nets, planning = {}, {}
        for dag in ("auto", "live"):
            m = ResNet20(shortcut="A").train()
            m.load_state_dict(plain.state_dict())
            t0 = time.perf_counter()
            nets[dag] = spscan.wrap(m, x, dag=dag)
            planning[dag] = time.perf_counter() - t0
        loss_fn = nn.CrossEntropyLoss()
        plain.zero_grad()
        loss_fn(plain(x), y).backward()
        for net in nets.values():
            net.zero_grad()
            loss_fn(net(x), y).backward()
            worst = max(float((p.grad - q.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-30)
                        for p, q in zip(plain.parameters(), net.parameters()))
            assert worst < 1e-3, worst  # float32, 20 layers deep: rounding only
        order = [("autograd", plain), ("blocks", nets["auto"]), ("live", nets["live"])]
        for _ in range(2):
            for _, net in order:
                _step(net, x, y, loss_fn)
        times = {k: [] for k, _ in order}
        for _ in range(ROUNDS):
            for k, net in order:
                times[k].append(_step(net, x, y, loss_fn))
        med = {k: statistics.median(v) for k, v in times.items()}
        benchmark.group = "resnet20-option-a-train-step"
        benchmark.pedantic(lambda: loss_fn(nets["auto"](x), y).backward(), rounds=3)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        info = dict(device=device_name(), threads=1, load_average_1min=load, model="resnet20-option-a-16-32-64",
                    batch=BATCH, input="3x32x32", train_mode=True, timer="process_time",
                    autograd_median_s=med["autograd"], blocks_median_s=med["blocks"], live_median_s=med["live"],
                    blocks_over_autograd=med["blocks"] / med["autograd"], live_over_autograd=med["live"] / med["autograd"],
                    planning_blocks_s=planning["auto"], planning_live_s=planning["live"],
                    plan_blocks=nets["auto"].plan.summary().splitlines()[0],
                    plan_live=nets["live"].plan.summary().splitlines()[0])
        benchmark.extra_info.update(info)
        print(f"\nresnet20 option A, train step: autograd {med['autograd'] * 1e3:.1f} ms, blocks "
              f"{med['blocks'] * 1e3:.1f} ms ({info['blocks_over_autograd']:.2f}x), live set {med['live'] * 1e3:.1f} ms "
              f"({info['live_over_autograd']:.2f}x); planning blocks {planning['auto']:.1f} s, live set "
              f"{planning['live']:.1f} s; {info['device']}, load {load}\n  {info['plan_blocks']}\n  {info['plan_live']}")
    finally:
        torch.set_num_threads(threads)
