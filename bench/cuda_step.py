"""Timing for the CUDA rows of the training-step benchmarks (CNN, ResNet-20, recurrent, stacked).

Each CUDA row times the wrapped model (``spscan.wrap(model.cuda(), x.cuda())``: the backend is
picked for the device, Triton on CUDA) against the same model under autograd (cuDNN / cuBLAS),
interleaved in one test: warm-up pairs first (allocator, plans, Triton compilation, CUDA-graph
capture), then ``rounds`` pairs of (autograd, spscan). A part of a step is timed by
:func:`cuda_clock`, which synchronizes the device before reading ``time.perf_counter``, so a
time covers the host work and every kernel it launched. :func:`step_info` turns the pairs into
the ``extra_info`` both sides share: both medians, ``speedup_vs_autograd = autograd / spscan``
(> 1: spscan faster), the spread of the per-pair ratios, and the math settings of the device.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, Iterable

import pytest
import torch
from spscan.kernels.triton import launch

from conftest import time_mode

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_clock() -> float:
    """``time.perf_counter()`` after every queued kernel of the current device has finished."""
    torch.cuda.synchronize()
    return time.perf_counter()


def time_pairs(mode: str, autograd_forward: Callable[[], torch.Tensor], spscan_forward: Callable[[], torch.Tensor],
               rounds: int, warmup: int = 3) -> list[tuple[float, float]]:
    """``rounds`` interleaved ``(autograd_s, spscan_s)`` pairs of ``mode`` (``"step"``, ``"backward"``
    or ``"forward"``, as :func:`conftest.time_mode`), each side synchronized, after ``warmup`` pairs."""
    for _ in range(warmup):
        time_mode(mode, autograd_forward, cuda_clock), time_mode(mode, spscan_forward, cuda_clock)
    return [(time_mode(mode, autograd_forward, cuda_clock), time_mode(mode, spscan_forward, cuda_clock))
            for _ in range(rounds)]


def record(benchmark, mode: str, spscan_forward: Callable[[], torch.Tensor], rounds: int) -> None:
    """The pytest-benchmark row of the spscan side, synchronized inside the timed function."""

    def backward(loss: torch.Tensor) -> None:
        loss.backward()
        torch.cuda.synchronize()

    def setup():
        loss = spscan_forward()
        torch.cuda.synchronize()
        return (loss,), {}

    def step() -> None:
        spscan_forward().backward()
        torch.cuda.synchronize()

    if mode == "backward":
        benchmark.pedantic(backward, setup=setup, rounds=rounds)
    elif mode == "step":
        benchmark.pedantic(step, rounds=rounds)
    else:
        raise ValueError(f"mode: expected 'step' or 'backward', got {mode!r}")


def step_info(pairs: list[tuple[float, float]]) -> dict:
    """Both medians, their ratio and the quartiles of the per-pair ratios; the device's math settings."""
    base = statistics.median(p[0] for p in pairs)
    ours = statistics.median(p[1] for p in pairs)
    ratios = sorted(a / o for a, o in pairs)
    return dict(
        autograd_median_s=base, spscan_median_s=ours, speedup_vs_autograd=base / ours,
        median_ratio_of_pairs=statistics.median(ratios), ratio_q25=ratios[len(ratios) // 4],
        ratio_q75=ratios[(3 * len(ratios)) // 4], pairs=len(pairs), clock="synchronized wall",
        cudnn_benchmark=torch.backends.cudnn.benchmark, cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
        matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32, spscan_dot_precision=launch.dot_precision,
    )


def plan_backend(plan) -> object:
    """The backend that runs a wrapper's scan: a name, or a list (one per layer and direction) for a
    stacked recurrent plan; a recurrent plan reports the plan of its most recent length."""
    if hasattr(plan, "layer_plans"):
        return [plan_backend(p) for p in plan.layer_plans]
    if hasattr(plan, "scan_plan"):
        w = plan.module.weight_hh_l0
        return plan.scan_plan(plan.last_seq_len or 1, w.device, w.dtype).backend
    return plan.core.backend


@contextlib.contextmanager
def full_float32():
    """cuDNN convolutions and cuBLAS matmuls in full float32 (no TF32) inside, the settings restored after."""
    conv, mm = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, mm


def checked_step(autograd_forward: Callable[[], torch.Tensor], spscan_forward: Callable[[], torch.Tensor],
                 autograd_params: Iterable[torch.nn.Parameter], spscan_params: Iterable[torch.nn.Parameter],
                 tol: float, what: str) -> float:
    """One step on each side from the same weights, in full float32 (so the difference is rounding
    order only); ``AssertionError`` naming ``what`` if the gradients differ by ``tol`` or more
    (:func:`max_rel_grad_diff`). Returns that difference."""
    with full_float32():
        autograd_forward().backward()
        spscan_forward().backward()
    worst = max_rel_grad_diff(autograd_params, spscan_params)
    assert worst < tol, f"{what}: spscan's gradients differ from autograd's by {worst:.3g} (relative, limit {tol:g})"
    return worst


def max_rel_grad_diff(reference: Iterable[torch.nn.Parameter], other: Iterable[torch.nn.Parameter]) -> float:
    """Largest ``max|g_ref - g| / max|g_ref|`` over matching parameters (their ``.grad`` after one step)."""
    worst = 0.0
    for p, q in zip(reference, other, strict=True):
        if p.grad is None or q.grad is None:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} has no gradient on one side "
                             f"(autograd: {p.grad is not None}, spscan: {q.grad is not None})")
        scale = max(float(p.grad.abs().max()), 1e-30)
        worst = max(worst, float((p.grad - q.grad).abs().max()) / scale)
    return worst
