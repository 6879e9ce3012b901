"""Recurrent backwards on a GPU under several scan shapes.

``python bench/gpu/sweep_runs.py [T ...] [rnn gru lstm]``: for the paper's bitstream RNN (H = 20,
B = 16, float32; the rows of ``bench/test_rnn_step.py``) and a GRU and an LSTM of the same size
(loss on the last output) it times ``loss.backward()`` (CUDA events, median of 7) of cuDNN
autograd and of ``spscan.wrap`` under: the cost model's choice (``levels="auto"``), one linear run
parallel over its steps (``levels=0``) at several chunk lengths
(``spscan.kernels.launch.chunk_steps``), the deep up-sweep the cost model chose before runs were
chunked (``parallel_run_max_m = 0``), and for the GRU and the LSTM (T <= 10000) both layouts
(materialized: one block per step) at the cost model's depth, depth 0 and depth 1. Prints one line
per configuration with the ratio against cuDNN measured in the same process.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch
from torch import nn

import spscan
from spscan.kernels import launch
from spscan.planner.cost import profile_for
from spscan.planner.patterns import as_chain
from spscan.planner.planning import plan_scan
from spscan.recurrent import recurrent_patterns

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_rnn_step import _setup as rnn_step_setup  # noqa: E402

DEV = torch.device("cuda")


def _ms(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def _backward_ms(forward, reps: int = 7) -> float:
    for _ in range(2):
        forward().backward()
    times = []
    for _ in range(reps):
        loss = forward()
        torch.cuda.synchronize()
        times.append(_ms(loss.backward))
    return statistics.median(times)


def _cell_forward(cls, T: int, scan: bool, **kw):
    torch.manual_seed(0)
    gru = cls(8, 20).to(DEV)
    x = torch.randn(T, 16, 8, device=DEV)
    mod = spscan.wrap(gru, x, **kw) if scan else gru

    def forward():
        gru.zero_grad(set_to_none=True)
        return mod(x)[0][-1].pow(2).sum()

    return mod, forward


def _levels_without_chunked_runs(T: int) -> int:
    """The depth the cost model picks for the factored RNN chain when runs are not chunked."""
    pats = as_chain(recurrent_patterns(nn.RNN(1, 20), T))
    return plan_scan(pats, "auto", profile_for("cuda", {"parallel_run_max_m": 0}), batch_hint=16).levels


def _line(name: str, T: int, base: float, ours: float, mod) -> None:
    plan = getattr(mod, "plan", None)
    levels = plan.levels if plan is not None else "-"
    print(f"{name:<34} T={T:<6} cuDNN {base:8.3f} ms  spscan {ours:8.3f} ms  ratio {base / ours:7.2f}  "
          f"levels {levels}", flush=True)


def main(ts, cells) -> None:
    print(f"device: {torch.cuda.get_device_name(DEV)}")
    for T in ts:
        if "rnn" in cells:
            _rnn(T)
        for name, cls in (("gru", nn.GRU), ("lstm", nn.LSTM)):
            if name in cells and T <= 10000:
                _cell(name, cls, T)


def _rnn(T: int) -> None:
    if True:
        _, fa = rnn_step_setup(T, DEV, scan=False)[:2]
        base = _backward_ms(fa)
        configs = [("rnn auto", {}, None), ("rnn levels=0", {"levels": 0}, None)]
        configs += [(f"rnn levels=0 chunk={c}", {"levels": 0}, c) for c in (32, 64, 128, 256, 512) if c * 8 <= 2 * T]
        configs += [("rnn before (no chunked runs)", {"levels": _levels_without_chunked_runs(T)}, None)]
        for name, kw, chunk in configs:
            launch.chunk_steps = chunk
            try:
                model, fs = rnn_step_setup(T, DEV, scan=True, **kw)[:2]
                _line(name, T, base, _backward_ms(fs), model.rnn)
            except Exception as exc:  # keep sweeping: a configuration the planner refuses says why
                print(f"{name:<34} T={T:<6} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            finally:
                launch.chunk_steps = None


def _cell(name: str, cls, T: int) -> None:
    _, fa = _cell_forward(cls, T, scan=False)
    base = _backward_ms(fa)
    for label, kw in [("auto", {}), ("factored", {"layout": "factored"}),
                      ("materialized auto", {"layout": "materialized"}),
                      ("materialized levels=0", {"layout": "materialized", "levels": 0}),
                      ("materialized levels=1", {"layout": "materialized", "levels": 1})]:
        try:
            mod, fs = _cell_forward(cls, T, True, **kw)
            _line(f"{name} {label}", T, base, _backward_ms(fs), mod)
        except Exception as exc:
            print(f"{name} {label:<29} T={T:<6} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    cells = [a for a in args if not a.isdigit()] or ["rnn", "gru", "lstm"]
    main([int(a) for a in args if a.isdigit()] or [1000, 10000, 30000], cells)
