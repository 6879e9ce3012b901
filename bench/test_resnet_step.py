"""One training step of a full-width CIFAR ResNet-20 through ``spscan.wrap`` vs plain autograd.

Run: ``pytest bench/test_resnet_step.py --benchmark-only -s`` (``bench/`` is outside the default
test run). The model is He et al. 2016's CIFAR ResNet-20: a 3x3 stem, 3 stages of 3 BasicBlocks
with 16/32/64 channels, option-B shortcuts (1x1 conv + BatchNorm where the shape changes), global
average pooling and a 10-way linear classifier, in **train mode** (BatchNorm with batch statistics,
running statistics updated), float32, batch 16 of 3x32x32, cross-entropy on random labels.

``mode="step"`` times ``zero_grad`` + forward + loss + ``backward``; ``mode="backward"`` times
``loss.backward()`` alone (its forward runs untimed just before). Both sides run on one thread and
are timed with ``time.process_time`` (CPU time of this process: on a shared machine another
process's load does not count), interleaved (one autograd step, then one spscan step, repeated),
and compared by their medians; ``extra_info`` carries both medians, ``speedup_vs_autograd =
autograd / spscan`` (> 1: spscan faster), the median of the per-pair ratios, the planned depth
(``plan.levels``), the first line of ``plan.summary()``, the planning time and the device.
The plan is made once per module (about 3 s on a 2-core CPU: in train mode the blocks' patterns are
never formed); the whole file runs in about a minute.

``test_resnet20_step_cuda`` (skips without a CUDA device): the same model and data on the GPU,
``spscan.wrap(model.cuda(), x.cuda())`` (Triton backend) against cuDNN under autograd, timed by
``bench/cuda_step.py`` (synchronized wall time, interleaved, warm-up first, 15 pairs); the plan is
made once per module and its gradients checked against autograd's before any timing.
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
from cuda_step import checked_step, needs_cuda, plan_backend, record, step_info, time_pairs

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")  # the reference ResNet-20: examples/resnet.py
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from resnet import ResNet20  # noqa: E402

BATCH = 16
ROUNDS = 7


@pytest.fixture(scope="module")
def setup():
    """Two identical train-mode ResNet-20s (one plain, one wrapped), the data, and the planning time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plain = ResNet20().train()
    mine = ResNet20().train()
    mine.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    t0 = time.perf_counter()
    wrapped = spscan.wrap(mine, x)
    planning_s = time.perf_counter() - t0
    loss_fn = nn.CrossEntropyLoss()
    # the same gradients as autograd (train-mode BatchNorm: one step from the same state)
    plain.zero_grad(), wrapped.zero_grad()
    loss_fn(plain(x), y).backward()
    loss_fn(wrapped(x), y).backward()
    worst = max(float((p.grad - q.grad).abs().max()) / max(float(p.grad.abs().max()), 1e-30)
                for p, q in zip(plain.parameters(), mine.parameters()))
    assert worst < 1e-3, worst  # float32, 20 layers deep: rounding only
    yield dict(plain=plain, wrapped=wrapped, x=x, y=y, loss_fn=loss_fn, planning_s=planning_s, worst=worst)
    torch.set_num_threads(threads)


def _time(mode: str, net: nn.Module, s: dict) -> float:
    net.zero_grad(set_to_none=True)
    if mode == "backward":
        loss = s["loss_fn"](net(s["x"]), s["y"])
        t0 = time.process_time()
        loss.backward()
        return time.process_time() - t0
    t0 = time.process_time()
    s["loss_fn"](net(s["x"]), s["y"]).backward()
    return time.process_time() - t0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["step", "backward"])
def test_resnet20_step_cpu(benchmark, setup, mode):
    s = setup
    benchmark.group = f"resnet20-train-{mode}"
    for _ in range(2):  # warm-up: allocator, the lowering for this batch size
        _time(mode, s["plain"], s), _time(mode, s["wrapped"], s)
    pairs = [(_time(mode, s["plain"], s), _time(mode, s["wrapped"], s)) for _ in range(ROUNDS)]
    base = statistics.median(p[0] for p in pairs)
    ours = statistics.median(p[1] for p in pairs)
    net = s["wrapped"]
    if mode == "backward":
        benchmark.pedantic(lambda loss: loss.backward(),
                           setup=lambda: ((s["loss_fn"](net(s["x"]), s["y"]),), {}), rounds=3)
    else:
        benchmark.pedantic(lambda: s["loss_fn"](net(s["x"]), s["y"]).backward(), rounds=3)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    info = dict(
        device=device_name(), threads=torch.get_num_threads(), load_average_1min=load, model="resnet20-16-32-64",
        batch=BATCH, input="3x32x32", mode=mode, train_mode=True, levels=net.plan.levels,
        plan=net.plan.summary().splitlines()[0], planning_s=s["planning_s"], autograd_median_s=base,
        spscan_median_s=ours, speedup_vs_autograd=base / ours,
        median_ratio_of_pairs=statistics.median(a / o for a, o in pairs), grad_max_rel_diff=s["worst"],
        timer="process_time",
    )
    benchmark.extra_info.update(info)
    print(f"\nresnet20 train {mode}: autograd {base * 1e3:.1f} ms, spscan {ours * 1e3:.1f} ms, "
          f"spscan/autograd {ours / base:.2f}x (pairs' median {1 / info['median_ratio_of_pairs']:.2f}x), "
          f"levels={net.plan.levels}, planning {s['planning_s']:.1f} s, {info['device']}, "
          f"load {load}\n  {info['plan']}")


CUDA_ROUNDS = 15
CUDA_GRAD_TOL = 1e-3  # one step in full float32 on both sides: rounding order only


@pytest.fixture(scope="module")
def setup_cuda():
    """The same two train-mode ResNet-20s and data on the CUDA device, planned once for the module."""
    torch.manual_seed(0)
    plain = ResNet20().train().cuda()
    mine = ResNet20().train().cuda()
    mine.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 32, 32, generator=g).cuda()
    y = torch.randint(0, 10, (BATCH,), generator=g).cuda()
    t0 = time.perf_counter()
    wrapped = spscan.wrap(mine, x)
    torch.cuda.synchronize()
    planning_s = time.perf_counter() - t0
    loss_fn = nn.CrossEntropyLoss()

    def forward(net: nn.Module):
        def run() -> torch.Tensor:
            net.zero_grad(set_to_none=True)
            return loss_fn(net(x), y)

        return run

    worst = checked_step(forward(plain), forward(wrapped), plain.parameters(), mine.parameters(), CUDA_GRAD_TOL,
                         "resnet20 on CUDA")
    return dict(plain=forward(plain), wrapped=forward(wrapped), net=wrapped, planning_s=planning_s, worst=worst)


@needs_cuda
@pytest.mark.parametrize("mode", ["step", "backward"])
def test_resnet20_step_cuda(benchmark, setup_cuda, mode):
    """Against cuDNN under autograd on the same device (train mode, batch statistics), synchronized wall time."""
    s = setup_cuda
    benchmark.group = f"resnet20-train-cuda-{mode}"
    pairs = time_pairs(mode, s["plain"], s["wrapped"], CUDA_ROUNDS)
    record(benchmark, mode, s["wrapped"], CUDA_ROUNDS)
    net = s["net"]
    benchmark.extra_info.update(
        device=device_name(), model="resnet20-16-32-64", batch=BATCH, input="3x32x32", mode=mode, train_mode=True,
        levels=net.plan.levels, backend=plan_backend(net.plan), plan=net.plan.summary().splitlines()[0],
        planning_s=s["planning_s"], grad_max_rel_diff=s["worst"], **step_info(pairs),
    )
