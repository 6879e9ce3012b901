"""Paper section 3.5: LeNet-5 trained through spscan.wrap and through autograd from one seed converge alike.

LeNet-5 (conv 5x5x6, ReLU, max-pool 2, conv 5x5x16, ReLU, max-pool 2, flatten, Linear 120, ReLU,
Linear 84, ReLU, Linear 10) on CIFAR-10 (or a synthetic stand-in, see ``paper_cifar``), SGD with
learning rate 0.001 and momentum 0.9 as in the paper, the same initial weights and batch order.
The benchmark times the spscan run; ``extra_info`` carries both loss curves, the autograd run's
time and the largest per-iteration loss difference. Both sides run one untimed forward and backward
first, so a short (quick) run does not time one-time setup.
"""

from __future__ import annotations

import time

import torch
from torch import nn

import spscan

import paper_config as cfg
from paper_cifar import cifar10_train

DEV = cfg.DEVICE


def lenet5() -> nn.Sequential:
    """LeNet-5 for 3x32x32 inputs as an ``nn.Sequential`` chain."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    )


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, order: torch.Tensor) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    losses = []
    for idx in order:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    cfg.sync()
    return losses


def test_lenet5_convergence(benchmark):
    benchmark.group = "paper-convergence"
    B, iters = cfg.CONV_BATCH, cfg.CONV_ITERS
    x, y, source = cifar10_train(B * iters, seed=0)
    x, y = x.to(DEV), y.to(DEV)
    order = torch.randperm(B * iters, generator=torch.Generator().manual_seed(1)).view(iters, B).to(DEV)
    torch.manual_seed(0)
    base = lenet5().to(DEV)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    ours = spscan.wrap(lenet5().to(DEV), x[:B], levels=cfg.CONV_LEVELS)
    plan_s = time.perf_counter() - t0
    for m in (base, ours):  # one untimed forward and backward each (one-time setup; the weights do not change)
        nn.CrossEntropyLoss()(m(x[order[0]]), y[order[0]]).backward()
        m.zero_grad(set_to_none=True)
    cfg.sync()
    t0 = time.perf_counter()
    auto_losses = _train(base, x, y, order)
    auto_s = time.perf_counter() - t0
    result = {}

    def run():
        result["losses"] = _train(ours, x, y, order)

    benchmark.pedantic(run, rounds=1, iterations=1)
    ours_s = benchmark.stats.stats.median
    diffs = [abs(a - b) for a, b in zip(auto_losses, result["losses"])]
    benchmark.extra_info.update(
        cfg.common_info(), experiment="convergence", data=source, batch=B, iterations=iters,
        optimizer="SGD lr=0.001 momentum=0.9", seed=0, plan_s=plan_s, requested_levels=str(cfg.CONV_LEVELS), levels=ours.plan.levels if hasattr(ours, "plan") else None,
        autograd_loss=[round(v, 6) for v in auto_losses], spscan_loss=[round(v, 6) for v in result["losses"]],
        max_abs_loss_diff=max(diffs), final_loss_autograd=auto_losses[-1], final_loss_spscan=result["losses"][-1],
        autograd_train_s=auto_s, spscan_train_s=ours_s, overall_speedup=auto_s / ours_s,
    )
    assert max(diffs) < 1e-2
