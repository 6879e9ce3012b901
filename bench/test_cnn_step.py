"""One training step of two CNN chains through ``spscan.wrap`` vs plain autograd, on one device.

Run: ``pytest bench/test_cnn_step.py --benchmark-only``. Models: LeNet-5 (3x32x32, B = 64), a
small VGG (16-M-32-M-64-64-M + Linear, 3x32x32, B = 32) and an AlexNet-like stack (three convolutions,
each under an overlapping 3x3/stride-2 max-pool, two dropouts and two Linear layers, 3x127x127,
B = 32), cross-entropy on random labels.
``mode="forward"`` times forward + loss, ``"backward"`` times ``loss.backward()`` alone (its
forward runs untimed just before), ``"step"`` times ``zero_grad`` + forward + loss + backward. Both
sides are timed interleaved in the same test (one autograd run, then one spscan run, repeated), so
a change in machine load hits both alike; ``extra_info`` carries both medians and
``speedup_vs_autograd = autograd / spscan`` (> 1: spscan faster), the depth in use and the device.
Times are wall time (``time.perf_counter``) on one thread (``torch.set_num_threads(1)`` for the
test, restored after). Not process CPU time: where the kernel accounts it per scheduler tick (as in
some virtual machines), a 2 ms backward reads as 2 or 6 ms at random; on a quiet machine one thread's
wall time is its CPU time. ``extra_info`` also carries the spread of the per-pair ratios
(quartiles) and the number of ATen ops each side's ``loss.backward()`` dispatches (counted once,
outside the timing: the scan's backward should run no more than autograd's). No denormal
flushing is needed here (``flush_denormal=False``): the losses stay far from the float32 denormal
range.

``test_cnn_step_cuda`` (skips without a CUDA device): the same models, data and modes ``step`` and
``backward`` on the GPU, ``spscan.wrap(model.cuda(), x.cuda())`` (Triton backend) against cuDNN /
cuBLAS under autograd, timed by ``bench/cuda_step.py`` (synchronized wall time, interleaved,
warm-up first, 15 pairs); each model is wrapped once for both modes, and one step's gradients
must agree with autograd's before any timing.
"""

from __future__ import annotations

import functools
import os
import statistics
import time

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import spscan

from conftest import device_name
from cuda_step import checked_step, needs_cuda, plan_backend, record, step_info, time_pairs


def lenet5() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    )


def vgg_small() -> nn.Sequential:
    layers: list[nn.Module] = []
    c = 3
    for v in [16, "M", 32, "M", 64, 64, "M"]:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
            c = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 4 * 4, 10))


def alexnet_like() -> nn.Sequential:
    """Overlapping max-pools (kernel 3 > stride 2) after each convolution, on 3x127x127 inputs."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(32, 48, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Flatten(), nn.Dropout(), nn.Linear(48 * 3 * 3, 64), nn.ReLU(), nn.Dropout(), nn.Linear(64, 10),
    )


# name: (model, batch, input height and width)
MODELS = {"lenet5": (lenet5, 64, 32), "vgg_small": (vgg_small, 32, 32), "alexnet_like": (alexnet_like, 32, 127)}


def _setup(name: str, scan: bool, device: str = "cpu"):
    make, batch, size = MODELS[name]
    torch.manual_seed(0)
    model = make().to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    net = spscan.wrap(model, x) if scan else model
    loss_fn = nn.CrossEntropyLoss()

    def forward():
        net.zero_grad(set_to_none=True)
        return loss_fn(net(x), y)

    return net, forward


_clock = time.perf_counter


class _CountOps(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it (not timed: a Python hook per op)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(forward) -> int:
    loss = forward()
    with _CountOps() as c:
        loss.backward()
    return c.count


def _time(mode: str, forward) -> float:
    if mode == "backward":
        loss = forward()
        t0 = _clock()
        loss.backward()
        return _clock() - t0
    t0 = _clock()
    loss = forward()
    if mode == "step":
        loss.backward()
    return _clock() - t0


@pytest.mark.parametrize("mode", ["forward", "backward", "step"])
@pytest.mark.parametrize("name", list(MODELS))
def test_cnn_step_cpu(benchmark, name, mode):
    benchmark.group = f"cnn-{name}-{mode}"
    rounds = 11
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, a_fwd = _setup(name, scan=False)
        net, s_fwd = _setup(name, scan=True)
        for _ in range(3):  # warm-up: allocator, lowering for this batch size
            _time(mode, a_fwd), _time(mode, s_fwd)
        pairs = [(_time(mode, a_fwd), _time(mode, s_fwd)) for _ in range(rounds)]
        if mode == "backward":
            benchmark.pedantic(lambda loss: loss.backward(), setup=lambda: ((s_fwd(),), {}), rounds=rounds)
        elif mode == "step":
            benchmark.pedantic(lambda: s_fwd().backward(), rounds=rounds)
        else:
            benchmark.pedantic(s_fwd, rounds=rounds)
        ops = (_backward_ops(a_fwd), _backward_ops(s_fwd))
        device = device_name()
    finally:
        torch.set_num_threads(threads)
    base = statistics.median(p[0] for p in pairs)
    ours = statistics.median(p[1] for p in pairs)
    ratios = sorted(a / o for a, o in pairs)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    benchmark.extra_info.update(
        device=device, load_average_1min=load, model=name, batch=MODELS[name][1], mode=mode,
        levels=net.plan.levels, autograd_median_s=base, spscan_median_s=ours, speedup_vs_autograd=base / ours,
        median_ratio_of_pairs=statistics.median(ratios), ratio_q25=ratios[len(ratios) // 4],
        ratio_q75=ratios[(3 * len(ratios)) // 4], aten_ops_per_backward_autograd=ops[0],
        aten_ops_per_backward_spscan=ops[1], threads=1, clock="wall", flush_denormal=False,
    )


CUDA_ROUNDS = 15
CUDA_GRAD_TOL = 1e-3  # one step in full float32 on both sides: rounding order only


@functools.cache
def _cuda_pair(name: str):
    """Both sides on the device (planned once for the model's rows) and their checked gradients."""
    plain, a_fwd = _setup(name, scan=False, device="cuda")
    net, s_fwd = _setup(name, scan=True, device="cuda")
    worst = checked_step(a_fwd, s_fwd, plain.parameters(), net.parameters(), CUDA_GRAD_TOL, name)
    return net, a_fwd, s_fwd, worst


@needs_cuda
@pytest.mark.parametrize("mode", ["step", "backward"])
@pytest.mark.parametrize("name", ["lenet5", "vgg_small"])  # no dropout: the gradient check compares one step
def test_cnn_step_cuda(benchmark, name, mode):
    """Against cuDNN / cuBLAS under autograd on the same device: ``spscan.wrap(model.cuda(), x.cuda())``
    (the backend picked for the device: Triton), the same seeds and data as the CPU rows."""
    benchmark.group = f"cnn-{name}-cuda-{mode}"
    net, a_fwd, s_fwd, worst = _cuda_pair(name)
    pairs = time_pairs(mode, a_fwd, s_fwd, CUDA_ROUNDS)
    record(benchmark, mode, s_fwd, CUDA_ROUNDS)
    benchmark.extra_info.update(
        device=device_name(), model=name, batch=MODELS[name][1], mode=mode, levels=net.plan.levels,
        backend=plan_backend(net.plan), grad_max_rel_diff=worst, **step_info(pairs),
    )
