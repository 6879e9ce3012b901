"""PyTorch's ``word_language_model`` trained with truncated back-propagation through time, through
``spscan.wrap(model, (tokens, hidden))`` against plain autograd, interleaved in the same run.

Each step: ``output, hidden = model(tokens, hidden)``, NLL loss, ``loss.backward()``, SGD, and the hidden state
detached for the next batch (the example's training loop). Prints a markdown table of median step times
(interquartile range) and the ratio autograd / wrapped.

    python bench/word_lm.py --threads 2 --steps 15 --out bench/results/cpu-2core/word-lm.md
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import subprocess
import time
import warnings

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import spscan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from zoo_models import WordLanguageModel as RNNModel  # noqa: E402  (the example's model, as posted)


#: (name, rnn type, ntoken, emsize = nhid, layers, bptt, batch)
CONFIGS = [
    ("example defaults (LSTM)", "LSTM", 10000, 200, 2, 35, 20),
    ("long bptt (GRU)", "GRU", 1000, 64, 1, 256, 16),
    ("long bptt (LSTM)", "LSTM", 1000, 64, 1, 256, 16),
]


def _detach(h):
    return tuple(t.detach() for t in h) if isinstance(h, tuple) else h.detach()


def _runner(net, base, tokens, targets, batch):
    opt = torch.optim.SGD(base.parameters(), lr=0.1)
    state = {"h": base.init_hidden(batch)}

    def step():
        opt.zero_grad()
        out, h = net(tokens, state["h"])
        F.nll_loss(out, targets).backward()
        opt.step()
        state["h"] = _detach(h)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    lines = ["# word_language_model through `spscan.wrap(model, (tokens, hidden))`", "",
             f"CPU ({platform.machine()}), {args.threads} threads, torch {torch.__version__}, commit {commit}, "
             f"{time.strftime('%Y-%m-%d')}. One training step (forward, NLL loss, backward, SGD; the hidden state "
             f"detached between steps), float32, dropout 0.2; median of {args.steps} interleaved steps (IQR) after "
             "2 warm-up steps. Ratio: autograd / wrapped (> 1: the wrapper is faster).", "",
             "| model | T x B | autograd (ms) | `auto` (ms) | ratio | `auto` ran | forced `scan` (ms) | ratio |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for name, kind, ntok, nh, nl, bptt, batch in CONFIGS:
        torch.manual_seed(0)
        ref = RNNModel(kind, ntok, nh, nh, nl)
        m_auto, m_scan = copy.deepcopy(ref), copy.deepcopy(ref)
        tokens = torch.randint(0, ntok, (bptt, batch))
        targets = torch.randint(0, ntok, (bptt * batch,))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w_auto = spscan.wrap(m_auto, (tokens, m_auto.init_hidden(batch)))
            w_scan = spscan.wrap(m_scan, (tokens, m_scan.init_hidden(batch)), backward="scan")
        runs = {"autograd": _runner(ref, ref, tokens, targets, batch),
                "auto": _runner(w_auto, m_auto, tokens, targets, batch),
                "scan": _runner(w_scan, m_scan, tokens, targets, batch)}
        times: dict[str, list[float]] = {k: [] for k in runs}
        for i in range(args.steps + 2):
            for k, run in runs.items():
                t = time.perf_counter()
                run()
                if i >= 2:
                    times[k].append(time.perf_counter() - t)

        def med(k):
            q = statistics.quantiles(times[k], n=4)
            return statistics.median(times[k]) * 1e3, q[0] * 1e3, q[2] * 1e3

        a, s, n = med("autograd"), med("scan"), med("auto")
        ran = w_auto.decision.chosen.name if hasattr(w_auto, "decision") else "native"
        lines.append(f"| {name}: {kind}({nh}, {nh}, {nl} layers), vocab {ntok} | {bptt} x {batch} | "
                     f"{a[0]:.1f} ({a[1]:.1f}-{a[2]:.1f}) | {n[0]:.1f} ({n[1]:.1f}-{n[2]:.1f}) | "
                     f"{a[0] / n[0]:.2f}x | {ran} "
                     f"| {s[0]:.1f} ({s[1]:.1f}-{s[2]:.1f}) | {a[0] / s[0]:.2f}x |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
