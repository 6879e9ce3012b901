"""What the example scripts share: their command line, and training one model two ways, side by side.

:func:`train_side_by_side` makes two copies of a model from the same initial weights: one trained with
plain autograd, the other wrapped with ``spscan.wrap`` (the whole model; an ordinary ``loss.backward()``
then runs through the scan). Both see the same batches in the same order with the same optimizer, one
step each in turn, the side that goes first alternating, so both run under the same machine load. It
prints both losses as they train and, at the end, the median step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Callable, Sequence

import torch
from torch import nn

import spscan

Batch = tuple[torch.Tensor, torch.Tensor]


def parser(description: str, *, steps: int, quick_steps: int) -> argparse.ArgumentParser:
    """The options every example takes: ``--steps``, ``--quick``, ``--device``, ``--seed``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=None,
                   help=f"timed training steps per side (default {steps}; {quick_steps} with --quick)")
    p.add_argument("--quick", action="store_true", help="a small, short run (a few seconds)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where to train (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default 0)")
    p.set_defaults(default_steps=steps, quick_steps=quick_steps)
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; fill in ``--steps`` and check that ``--device cuda`` has a GPU."""
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = args.quick_steps if args.quick else args.default_steps
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    torch.manual_seed(args.seed)
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], device: torch.device) -> tuple[float, float]:
    """One training step; returns its loss and its wall time in seconds."""
    x, y = batch
    _sync(device)
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    _sync(device)
    seconds = time.perf_counter() - start
    return loss.item(), seconds


def train_side_by_side(model: nn.Module, batches: Sequence[Batch],
                       loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                       steps: int, warmup: int = 2, lr: float = 1e-3, log_every: int = 0) -> float:
    """Train ``model`` with autograd and through ``spscan.wrap``, step for step; return autograd's median
    step time over spscan's (> 1: the wrapped model trains faster).

    ``batches``: ``(input, target)`` pairs on the model's device, used in turn; the first is the example
    input the wrapper is planned with. ``warmup`` steps per side run first and are not timed (the first
    step of a wrapped model prepares what it runs, such as compiled loops); ``steps`` are timed.
    """
    device = next(model.parameters()).device
    reference = copy.deepcopy(model)                    # plain PyTorch: autograd's backward
    start = time.perf_counter()
    wrapped = spscan.wrap(model, batches[0][0])          # the same parameters; loss.backward() runs the scan
    print(f"spscan.wrap planned the model in {time.perf_counter() - start:.1f} s")
    sides = {"autograd": reference, "spscan": wrapped}
    opts = {name: torch.optim.Adam(m.parameters(), lr=lr) for name, m in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    log_every = log_every or max(1, (warmup + steps) // 5)
    for step in range(warmup + steps):
        batch = batches[step % len(batches)]
        order = ["autograd", "spscan"] if step % 2 == 0 else ["spscan", "autograd"]
        losses = {}
        for name in order:
            losses[name], seconds = _train_step(sides[name], opts[name], batch, loss_fn, device)
            if step >= warmup:
                times[name].append(seconds)
        if step % log_every == 0 or step == warmup + steps - 1:
            print(f"step {step + 1:4d}  loss  autograd {losses['autograd']:.4f}  spscan {losses['spscan']:.4f}")
    auto_ms = 1e3 * statistics.median(times["autograd"])
    scan_ms = 1e3 * statistics.median(times["spscan"])
    decision = getattr(wrapped, "decision", None)
    chosen = f"; the wrapper chose {decision.chosen.name}" if decision is not None else ""
    ratio = auto_ms / scan_ms
    print(f"training step on {device.type}: autograd {auto_ms:.2f} ms, spscan {scan_ms:.2f} ms "
          f"(median of {steps} interleaved steps{chosen})")
    print(f"speed: {ratio:.2f}x autograd")
    return ratio
