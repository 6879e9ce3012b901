"""Paper Figure 8 / Tables 4-5 (RNN sensitivity) and Figure 7 (training curves), bitstream RNN of section 4.1.

``nn.RNN(1, 20)`` + Linear head on ``h_T``, cross-entropy. Each row times the backward pass
through ``spscan.wrap`` (the benchmark's own statistics) and, in the same test on the same
device, autograd's backward (cuDNN on GPU) and both forwards; ``extra_info`` carries the
medians and the backward and overall (forward + backward) speedups ``autograd / spscan``.

Sweeps: sequence length ``T`` at ``B = 16`` and batch size ``B`` at ``T = 1000`` (sizes in
``paper_config``). Run: ``pytest bench/test_paper_rnn.py --benchmark-only``.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import spscan
from spscan.cli.datasets import bitstream_dataset
from spscan.cli.demo import BitstreamClassifier, train_side_by_side

import paper_config as cfg

DEV = cfg.DEVICE


def _setup(T: int, B: int, scan: bool):
    """A seeded classifier (wrapped or not) and a ``forward() -> loss`` closure on one fixed batch."""
    x, y = bitstream_dataset(B, T, seed=0)
    x, y = x.to(DEV), y.to(DEV)
    torch.manual_seed(0)
    model = BitstreamClassifier(cfg.RNN_HIDDEN).to(DEV)
    if scan:
        model.rnn = spscan.wrap(model.rnn, x)
    loss_fn = nn.CrossEntropyLoss()

    def forward():
        model.zero_grad(set_to_none=True)
        return loss_fn(model(x), y)

    return model, forward


def _measure(benchmark, T: int, B: int, experiment: str) -> None:
    _, a_fwd = _setup(T, B, scan=False)
    model, s_fwd = _setup(T, B, scan=True)
    probe = time.perf_counter()
    a_fwd().backward()
    rounds = cfg.rounds_for(time.perf_counter() - probe)
    a_forward = cfg.median_time(a_fwd, rounds)
    a_backward = cfg.median_time(lambda loss: loss.backward(), rounds, setup=a_fwd)
    s_forward = cfg.median_time(s_fwd, rounds)

    def setup():
        loss = s_fwd()
        cfg.sync()
        return (loss,), {}

    def backward(loss):
        loss.backward()
        cfg.sync()

    benchmark.pedantic(backward, setup=setup, rounds=rounds, warmup_rounds=1)
    s_backward = benchmark.stats.stats.median
    plan = model.rnn.plan
    benchmark.extra_info.update(
        cfg.common_info(), experiment=experiment, T=T, B=B, H=cfg.RNN_HIDDEN,
        baseline="cuDNN RNN under autograd" if DEV.type == "cuda" else "torch nn.RNN under autograd",
        levels=plan.levels, layout=plan.layout, rounds=rounds,
        autograd_forward_s=a_forward, autograd_backward_s=a_backward,
        spscan_forward_s=s_forward, spscan_backward_s=s_backward,
        backward_speedup=a_backward / s_backward,
        overall_speedup=(a_forward + a_backward) / (s_forward + s_backward),
        # a dense H x H SpMV per step per sample: what the linear scan would do
        flops_linear_scan=2 * T * B * cfg.RNN_HIDDEN ** 2,
    )


@pytest.mark.parametrize("T", cfg.RNN_SWEEP_T)
def test_rnn_sweep_T(benchmark, T):
    """Backward latency and speedups over the sequence length at B = 16 (Figure 8a, Table 4)."""
    benchmark.group = "paper-rnn-sweep-T"
    _measure(benchmark, T, cfg.RNN_SWEEP_T_BATCH, "rnn_T")


@pytest.mark.parametrize("B", cfg.RNN_SWEEP_B)
def test_rnn_sweep_B(benchmark, B):
    """Backward latency and speedups over the batch size at T = 1000 (Figure 8b, Table 5)."""
    benchmark.group = "paper-rnn-sweep-B"
    _measure(benchmark, cfg.RNN_SWEEP_B_SEQ, B, "rnn_B")


def test_rnn_training_curves(benchmark):
    """A short side-by-side training run (as the demo, ``spscan.cli.demo``): loss vs wall-clock for both (Figure 7)."""
    benchmark.group = "paper-rnn-training"
    result = {}

    def run():
        result["logs"] = train_side_by_side(**cfg.RNN_TRAINING, device=str(DEV), progress=False, log=lambda s: None)

    benchmark.pedantic(run, rounds=1, iterations=1)
    auto, ours, summary = result["logs"]
    benchmark.extra_info.update(
        cfg.common_info(), experiment="rnn_training", **{k: v for k, v in summary.items() if k != "device"},
        autograd_loss=[round(v, 5) for v in auto.losses], autograd_wall_s=[round(v, 5) for v in auto.wall_clock()],
        spscan_loss=[round(v, 5) for v in ours.losses], spscan_wall_s=[round(v, 5) for v in ours.wall_clock()],
    )
