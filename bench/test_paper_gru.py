"""Paper Figure 9 / Table 6: GRU on IRMAS-shaped MFCC sequences, forward / Jacobian fill / backward.

``nn.GRU(C, 20)`` + Linear head on ``h_T`` (11 classes), cross-entropy, on synthetic data with
the paper's shapes (S: 259x38, M: 517x24, L: 1034x12 frames x coefficients;
``spscan.datasets.synthetic_irmas``). Per row (set, batch):

* autograd: forward and backward medians (cuDNN on GPU);
* spscan: the module's own forward, the extra cost of filling the transposed-Jacobian values
  (``RecurrentPlan.forward`` minus the module forward: the paper's "overhead"), and the
  backward through ``spscan.wrap`` (the benchmark's own statistics).

``extra_info`` holds each part normalized by autograd's forward + backward, as the paper plots.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import spscan
from spscan.cli.datasets import IRMAS_SHAPES, synthetic_irmas

import paper_config as cfg

DEV = cfg.DEVICE


class GRUClassifier(nn.Module):
    """``nn.GRU(C, hidden)`` + ``Linear(hidden, 11)`` on the last hidden state."""

    def __init__(self, coeffs: int, hidden: int, classes: int = 11) -> None:
        super().__init__()
        self.rnn: nn.Module = nn.GRU(coeffs, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h_n = self.rnn(x)
        return self.head(h_n[0])


@pytest.mark.parametrize("B", cfg.GRU_BATCHES)
@pytest.mark.parametrize("set_name", cfg.GRU_SETS)
def test_gru_irmas(benchmark, set_name, B):
    benchmark.group = "paper-gru"
    F, C = IRMAS_SHAPES[set_name]
    x, y = synthetic_irmas(set_name, B, seed=0)
    x, y = x.to(DEV), y.to(DEV)
    models = {}
    for name in ("autograd", "spscan"):
        torch.manual_seed(0)
        m = GRUClassifier(C, cfg.GRU_HIDDEN).to(DEV)
        if name == "spscan":
            m.rnn = spscan.wrap(m.rnn, x)
        models[name] = m
    loss_fn = nn.CrossEntropyLoss()

    def fwd(m):
        def run():
            m.zero_grad(set_to_none=True)
            return loss_fn(m(x), y)
        return run

    a_fwd, s_fwd = fwd(models["autograd"]), fwd(models["spscan"])
    probe = time.perf_counter()
    a_fwd().backward()
    rounds = cfg.rounds_for(time.perf_counter() - probe)
    a_forward = cfg.median_time(a_fwd, rounds)
    a_backward = cfg.median_time(lambda loss: loss.backward(), rounds, setup=a_fwd)
    rplan = models["spscan"].rnn.plan
    module = models["spscan"].rnn.plan.module

    def module_forward():
        with torch.no_grad():
            module(x)

    s_module = cfg.median_time(module_forward, rounds)
    s_with_fill = cfg.median_time(lambda: rplan.forward(x), rounds)

    def setup():
        loss = s_fwd()
        cfg.sync()
        return (loss,), {}

    def backward(loss):
        loss.backward()
        cfg.sync()

    benchmark.pedantic(backward, setup=setup, rounds=rounds, warmup_rounds=1)
    s_backward = benchmark.stats.stats.median
    fill = max(0.0, s_with_fill - s_module)
    base = a_forward + a_backward
    benchmark.extra_info.update(
        cfg.common_info(), experiment="gru", set=set_name, frames=F, coeffs=C, B=B, H=cfg.GRU_HIDDEN,
        baseline="cuDNN GRU under autograd" if DEV.type == "cuda" else "torch nn.GRU under autograd",
        data="synthetic IRMAS-shaped MFCCs (spscan.datasets.synthetic_irmas)",
        levels=rplan.levels, layout=rplan.layout, rounds=rounds,
        autograd_forward_s=a_forward, autograd_backward_s=a_backward,
        spscan_forward_s=s_module, spscan_fill_s=fill, spscan_backward_s=s_backward,
        norm_autograd_forward=a_forward / base, norm_autograd_backward=a_backward / base,
        norm_spscan_forward=s_module / base, norm_spscan_fill=fill / base, norm_spscan_backward=s_backward / base,
        backward_speedup=a_backward / s_backward,
        overall_speedup=base / (s_with_fill + s_backward),
    )
