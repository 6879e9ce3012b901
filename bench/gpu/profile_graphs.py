"""Where a wrapped model's training step goes on a GPU: forward and backward timed apart (device synchronized
around each), for plain autograd and for ``spscan.wrap`` with ``backward="scan"`` and ``"graph"``, then the
host calls of one graphed step by own CPU time (``torch.profiler``).

    python bench/gpu/profile_graphs.py [--models lenet5,resnet20] [--threads 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import spscan  # noqa: E402
from never_slower_models import CASES  # noqa: E402


def _phases(net, params, case, x, y, head, reps=30):
    fwd, bwd = [], []
    for r in range(reps + 5):
        for p in params:
            p.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = case.step_loss(net(x), head, y)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if r >= 5:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return statistics.median(fwd) * 1e3, statistics.median(bwd) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="lenet5,resnet20")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lines = []
    graphed = []
    for name in a.models.split(","):
        case = next(c for c in CASES if c.name == name)
        model, head = case.build("cuda")
        x, y = case.data("cuda")
        sides = {"autograd": (model, model)}
        for mode in ("scan", "graph"):
            m = copy.deepcopy(model)
            sides[mode] = (spscan.wrap(m, x, backward=mode), m)
        for label, (net, mod) in sides.items():
            params = list(mod.parameters()) + (list(head.parameters()) if head is not None else [])
            f, b = _phases(net, params, case, x, y, head)
            lines.append(f"{name:10s} {label:9s} forward {f:6.3f} ms  backward {b:6.3f} ms  step {f + b:6.3f} ms")
            print(lines[-1], flush=True)
        graphed.append((name, case, *sides["graph"], x, y, head))
    # one profiler session for every model: tearing the profiler's CUDA tracing down and setting it up again
    # between recorded CUDA graphs can crash the process
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for name, case, net, mod, x, y, head in graphed:
            params = list(mod.parameters())
            with record_function(f"graphed step x5: {name}"):
                for _ in range(5):
                    for p in params:
                        p.grad = None
                    case.step_loss(net(x), head, y).backward()
                torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    lines.append(f"--- graphed steps x5 of {a.models}, host calls by own time\n{table}")
    print(lines[-1], flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "profile_graphs.log").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
