"""Where the GPU time of a recurrent backward goes: ``python bench/gpu/profile_rnn.py [[cell:]T ...]``.

For each T (default 1000 and 30000; B = 16, H = 20, float32) of the paper's RNN (``rnn``, the rows of
``bench/test_rnn_step.py``) or of a GRU or an LSTM (``gru:10000``, ``lstm:10000``: the rows of
``bench/test_recurrent_step.py``, loss on the last output) it times cuDNN autograd's and
spscan's ``loss.backward()`` (CUDA events, medians), splits spscan's backward into its parts
with ``torch.profiler`` (the kernels by device time, the host calls by self time, the number
of launches) and prints the bound plan's program: how many steps and launches one scan makes.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_recurrent_step import _setup as recurrent_step_setup  # noqa: E402
from test_rnn_step import B, H  # noqa: E402
from test_rnn_step import _setup as rnn_step_setup  # noqa: E402
from tune import events_ms  # noqa: E402


def _median_ms(fn, reps: int = 10) -> float:
    return events_ms(fn, reps, warmup=False)


def _setup(cell: str, T: int, scan: bool):
    if cell != "rnn":
        rnn, forward = recurrent_step_setup(cell, T, scan, device="cuda")
        return rnn, forward
    model, forward, _ = rnn_step_setup(T, torch.device("cuda"), scan)  # the rows of bench/test_rnn_step.py
    return model.rnn, forward


def _time_backward(forward) -> float:
    times = []
    for _ in range(7):
        loss = forward()
        torch.cuda.synchronize()
        times.append(_median_ms(lambda: loss.backward(), reps=1))
    return statistics.median(times)


def main(cases) -> None:
    for cell, T in cases:
        _, fwd_a = _setup(cell, T, scan=False)
        wrapped, fwd_s = _setup(cell, T, scan=True)
        for f in (fwd_a, fwd_s):
            for _ in range(3):
                f().backward()
        torch.cuda.synchronize()
        ta, ts_ = _time_backward(fwd_a), _time_backward(fwd_s)
        sa = _median_ms(lambda: fwd_a().backward(), 5)
        ss = _median_ms(lambda: fwd_s().backward(), 5)
        fa = _median_ms(lambda: fwd_a(), 5)
        fs = _median_ms(lambda: fwd_s(), 5)
        plan = wrapped.plan
        print(f"\n===== {cell} T={T} B={B} H={H}: levels={plan.levels} layout={plan.layout}")
        print(f"backward ms: autograd {ta:.3f}  spscan {ts_:.3f}  ratio {ta / ts_:.3f}")
        print(f"forward  ms: autograd {fa:.3f}  spscan {fs:.3f}")
        print(f"step     ms: autograd {sa:.3f}  spscan {ss:.3f}  ratio {sa / ss:.3f}")
        for bp in plan.scan_plan(T, torch.device("cuda"), torch.float32).bindings():
            prog = bp.program
            kinds: dict[str, int] = {}
            for step in prog.steps:
                for op in step.ops:
                    kinds[type(op).__name__] = kinds.get(type(op).__name__, 0) + 1
            print(f"bound {bp.device} shared={sum(bp.shared)}/{len(bp.shared)}: {len(prog.steps)} steps, ops {kinds}")
        loss = fwd_s()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            loss.backward()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(ka.table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
        print(ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
        losses = [fwd_s() for _ in range(3)]
        torch.cuda.synchronize()
        cp = cProfile.Profile()
        cp.enable()
        for loss in losses:
            loss.backward()
        torch.cuda.synchronize()
        cp.disable()
        print("-- host time of 3 spscan backwards (cProfile, by own time)")
        pstats.Stats(cp).sort_stats("tottime").print_stats(22)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fwd_s()
            torch.cuda.synchronize()
        print("-- spscan forward")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    args = sys.argv[1:] or ["1000", "30000"]
    main([(a.split(":")[0], int(a.split(":")[1])) if ":" in a else ("rnn", int(a)) for a in args])
