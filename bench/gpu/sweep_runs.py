"""Recurrent backwards on a GPU under several scan shapes.

``python bench/gpu/sweep_runs.py [T ...] [rnn gru lstm]``: for the paper's bitstream RNN (H = 20,
B = 16, float32; the rows of ``bench/test_rnn_step.py``) and a GRU and an LSTM of the same size
(loss on the last output) it times ``loss.backward()`` (CUDA events, median of 7) of cuDNN
autograd and of ``spscan.wrap`` under: the cost model's choice (``levels="auto"``), one linear run
parallel over its steps (``levels=0``) at several chunk lengths
(``spscan.kernels.triton.launch.chunk_steps``), the deep up-sweep the cost model chose before runs were
chunked (``parallel_run_max_m = 0``), and for the GRU and the LSTM (T <= 10000) both layouts
(materialized: one block per step) at the cost model's depth, depth 0 and depth 1. The RNN's and
the GRU's main shapes are timed again with float32 ``tl.dot`` products as three TF32 tensor-core
products or one (``spscan.kernels.triton.launch.dot_precision`` = ``"tf32x3"`` / ``"tf32"``; exact FMAs
otherwise). Prints one line per configuration with the ratio against cuDNN measured in the same
process and the weight gradients' largest relative error against float64 autograd (``err``;
cuDNN's own float32 error on the cuDNN line).
"""

from __future__ import annotations

import copy
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

import spscan
from spscan.kernels.triton import launch
from spscan.cli.datasets import bitstream_dataset
from spscan.planner.cost import profile_for
from spscan.planner.patterns import as_chain
from spscan.planner.planning import plan_scan
from spscan.recurrent.plan import recurrent_patterns

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

    forward.module = gru
    forward.reference = lambda: _grads64(gru, lambda m: m(x.double())[0][-1].pow(2).sum())
    return mod, forward


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().double().clone() for p in module.parameters()]


def _grads64(module: nn.Module, loss_of) -> list[torch.Tensor]:
    """Parameter gradients of a float64 copy of ``module`` under ``loss_of(copy)``."""
    m64 = copy.deepcopy(module).double()
    m64.zero_grad(set_to_none=True)
    loss_of(m64).backward()
    return _grads(m64)


def _err(forward, ref: list[torch.Tensor]) -> float:
    """Largest relative error of ``forward``'s parameter gradients (one more backward) against ``ref``."""
    forward().backward()
    got = _grads(forward.module)
    return max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in zip(got, ref))


def _rnn_forward(T: int, scan: bool, **kw):
    model, forward = rnn_step_setup(T, DEV, scan=scan, **kw)[:2]
    forward.module = model
    if not scan:
        x, y = (t.to(DEV) for t in bitstream_dataset(16, T, seed=0))
        forward.reference = lambda: _grads64(model, lambda m: nn.functional.cross_entropy(m(x.double()), y))
    return model.rnn, forward  # the wrapper, whose plan the line reports


def _levels_without_chunked_runs(T: int) -> int:
    """The depth the cost model picks for the factored RNN chain when runs are not chunked."""
    pats = as_chain(recurrent_patterns(nn.RNN(1, 20), T))
    return plan_scan(pats, "auto", profile_for("cuda", {"parallel_run_max_m": 0}), batch_hint=16).levels


def _line(name: str, T: int, base: float, ours: float, mod, err: float) -> None:
    plan = getattr(mod, "plan", None)
    levels = plan.levels if plan is not None else "-"
    print(f"{name:<34} T={T:<6} cuDNN {base:8.3f} ms  spscan {ours:8.3f} ms  ratio {base / ours:7.2f}  "
          f"levels {levels}  err {err:.1e}", flush=True)


def _baseline(name: str, T: int, forward) -> tuple[float, list[torch.Tensor]]:
    """cuDNN's backward time and the float64 reference gradients; prints cuDNN's own error."""
    base = _backward_ms(forward)
    ref = forward.reference()
    print(f"{name + ' cuDNN (float32)':<34} T={T:<6} cuDNN {base:8.3f} ms  err {_err(forward, ref):.1e}", flush=True)
    return base, ref


def _timed_config(label: str, T: int, base: float, ref, make, chunk=None, precision: str = "ieee") -> None:
    """One configuration's line; a configuration the planner refuses says why and the sweep goes on."""
    launch.chunk_steps = chunk
    launch.set_dot_precision(precision)
    try:
        mod, fs = make()
        _line(label, T, base, _backward_ms(fs), mod, _err(fs, ref))
    except Exception as exc:
        print(f"{label:<34} T={T:<6} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    finally:
        launch.chunk_steps = None
        launch.set_dot_precision("ieee")


def main(ts, cells) -> None:
    print(f"device: {torch.cuda.get_device_name(DEV)}")
    for T in ts:
        if "rnn" in cells:
            _rnn(T)
        for name, cls in (("gru", nn.GRU), ("lstm", nn.LSTM)):
            if name in cells and T <= 10000:
                _cell(name, cls, T)


def _rnn(T: int) -> None:
    base, ref = _baseline("rnn", T, _rnn_forward(T, scan=False)[1])
    configs = [("rnn auto", {}, None, "ieee"), ("rnn levels=0", {"levels": 0}, None, "ieee")]
    configs += [(f"rnn levels=0 chunk={c}", {"levels": 0}, c, "ieee") for c in (32, 64, 128, 256, 512)
                if c * 8 <= 2 * T]
    configs += [("rnn before (no chunked runs)", {"levels": _levels_without_chunked_runs(T)}, None, "ieee")]
    configs += [(f"rnn {label} {p}", kw, None, p) for p in ("tf32x3", "tf32")
                for label, kw in (("auto", {}), ("levels=0", {"levels": 0}))]
    for name, kw, chunk, precision in configs:
        _timed_config(name, T, base, ref, lambda: _rnn_forward(T, scan=True, **kw), chunk, precision)


def _cell(name: str, cls, T: int) -> None:
    base, ref = _baseline(name, T, _cell_forward(cls, T, scan=False)[1])
    configs = [("auto", {}, "ieee"), ("factored", {"layout": "factored"}, "ieee"),
               ("materialized auto", {"layout": "materialized"}, "ieee"),
               ("materialized levels=0", {"layout": "materialized", "levels": 0}, "ieee"),
               ("materialized levels=1", {"layout": "materialized", "levels": 1}, "ieee")]
    configs += [(f"auto {p}", {}, p) for p in ("tf32x3", "tf32")]
    for label, kw, precision in configs:
        _timed_config(f"{name} {label}", T, base, ref, lambda: _cell_forward(cls, T, True, **kw), None, precision)


if __name__ == "__main__":
    args = sys.argv[1:]
    cells = [a for a in args if not a.isdigit()] or ["rnn", "gru", "lstm"]
    main([int(a) for a in args if a.isdigit()] or [1000, 10000, 30000], cells)
