"""The max-pooling forward on a CPU: ATen's ``max_pool2d_with_indices`` against the compiled one
(:mod:`spscan.kernels.cpu.pool`) on the pools of the bench's CNNs, at the current torch thread count.

Each row times both in interleaved rounds (median of the rounds, wall time, float32, a ReLU'd input as
the pools see it) and checks that output and indices are equal. Run: ``python -m bench.pool_forward
[--threads N]``; it prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Optional, Sequence

import torch

from spscan.kernels.cpu import pool as cpu_pool

# (the model it comes from, input (N, C, H, W), kernel, stride, padding, ceil_mode)
POOLS = (
    ("lenet5 pool 1", (64, 6, 28, 28), 2, 2, 0, False),
    ("lenet5 pool 2", (64, 16, 10, 10), 2, 2, 0, False),
    ("vgg_small pool 1", (32, 16, 32, 32), 2, 2, 0, False),
    ("vgg_small pool 2", (32, 32, 16, 16), 2, 2, 0, False),
    ("alexnet_like pool 1", (32, 16, 31, 31), 3, 2, 0, False),
    ("alexnet_like pool 2", (32, 32, 15, 15), 3, 2, 0, False),
    ("alexnet_like pool 3", (32, 48, 7, 7), 3, 2, 0, False),
    ("ResNet stem pool (3/2, pad 1)", (16, 64, 56, 56), 3, 2, 1, False),
    ("3/1 pad 1 (Inception-style)", (16, 32, 28, 28), 3, 1, 1, False),
    ("3/2 ceil (GoogLeNet-style)", (16, 64, 28, 28), 3, 2, 0, True),
)


def run(rounds: int = 40) -> list[str]:
    rows = ["| pool | input | window | ATen (us) | compiled (us) | ATen / compiled |", "|---|---|---|---:|---:|---:|"]
    for name, shape, k, s, p, ceil in POOLS:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).relu()
        aten = lambda: torch.ops.aten.max_pool2d_with_indices(x, k, s, p, 1, ceil)  # noqa: E731
        ours = lambda: cpu_pool.max_pool2d_with_indices(x, k, s, p, 1, ceil)  # noqa: E731
        got = ours()
        if got is None:
            rows.append(f"| {name} | {tuple(shape)} | {k}/{s} pad {p} | - | not applied | - |")
            continue
        want = aten()
        if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
            raise AssertionError(f"{name}: the compiled forward differs from ATen's")
        for _ in range(3):
            aten(), ours()
        ta, tb = [], []
        for _ in range(rounds):  # interleaved: the two see the same machine state
            for fn, times in ((aten, ta), (ours, tb)):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        a, b = statistics.median(ta), statistics.median(tb)
        rows.append(f"| {name} | {tuple(shape)} | {k}/{s} pad {p}{' ceil' if ceil else ''} | {a * 1e6:.0f} | "
                    f"{b * 1e6:.0f} | {a / b:.2f}x |")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pool_forward", description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--rounds", type=int, default=40)
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n".join(run(ns.rounds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
