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
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spscan

from conftest import device_name

BATCH = 16
ROUNDS = 7


class LambdaLayer(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class BlockA(nn.Module):
    """BasicBlock with the option-A shortcut."""

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != planes:
            self.shortcut = LambdaLayer(lambda x: F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, planes // 4, planes // 4),
                                                        "constant", 0))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return F.relu(out)


class ResNet20A(nn.Module):
    def __init__(self, width: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        layers, cin = [], width
        for stage, w in enumerate((width, 2 * width, 4 * width)):
            for b in range(3):
                layers.append(BlockA(cin, w, 2 if (stage > 0 and b == 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.layers(x)
        x = F.adaptive_avg_pool2d(x, 1)
        x = x.view(x.size(0), -1)
        return self.fc(x)


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
        plain = ResNet20A().train()
        g = torch.Generator().manual_seed(1)
        x = torch.randn(BATCH, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (BATCH,), generator=g)
        nets, planning = {}, {}
        for dag in ("auto", "live"):
            m = ResNet20A().train()
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
