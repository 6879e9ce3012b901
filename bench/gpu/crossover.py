"""The crossover map of the recurrent scan: where it beats the model's own backward (cuDNN on a GPU, ATen on a
CPU), over hidden size, sequence length and batch, for ``nn.RNN``, ``nn.GRU`` and ``nn.LSTM``; and the cost
model's choices replayed against it.

    python bench/gpu/crossover.py --out DIR [--quick] [--device cuda|cpu] [--budget-s 540]
        [--cells rnn,gru,lstm] [--hidden 20,64,128,256] [--lengths 1000,10000,30000] [--batches 1,16,64]
        [--modes backward,step] [--rounds 5]

Each point ``(cell, H, T, B)`` builds the module (one layer, input size 1, batch first: a bitstream as in
the paper's RNN benchmark), wraps it twice, ``spscan.wrap(m, x, backward="scan")`` (timed) and
``spscan.wrap(m, x)`` (``auto``: its decision and the times it predicted are recorded, not timed again),
and times, interleaved round by round after two warm-up pairs, the module under plain autograd and the
forced scan: ``backward`` (``loss.backward()`` alone, the forward done before the clock starts) and
``step`` (forward and backward), the loss ``out[:, -1].sum()`` (a loss on the last output, as the
headline rows). A device clock synchronizes before each reading. A row records both medians, ``ratio``
(autograd / scan, > 1: the scan is faster) with its quartiles over the rounds, ``fraction_of_floor``
(``bench/floors.py``: the scan's floor time over its measured time) and the choice: ``chosen``
(``scan``, ``native`` or ``graph``), ``predicted_ms`` per candidate, and ``choice_ok``: whether the chosen
side measured within 3 % of the faster one (``graph`` is the scan's step replayed; it counts as the scan
here). A point whose gradients differ from autograd's (relative 1e-3, float32) is recorded with its
error and not timed.

The points run in the order most worth having first (the headline shapes, then the rest by growing cost),
and ``crossover.json`` is rewritten after each, so a run cut by ``--budget-s`` (wall seconds; no point but the
first is started past it; the points not run are listed as ``skipped``) or by a time limit keeps what it measured. ``crossover.png`` draws one heat map per
(cell, mode, batch): ``log2`` of the ratio over ``(T, H)``, each cell labelled with the ratio and a mark
where the cost model chose wrong (needs matplotlib; skipped with a note without it). ``--quick`` is a
small grid (H 20 and 64, T 1000, B 16) for a smoke run; on a CPU it is smaller still.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parents[1]), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import spscan  # noqa: E402
from floors import recurrent_floor  # noqa: E402
from never_slower import device_clock  # noqa: E402

CELLS = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}
#: the chosen side must measure within this factor of the faster one for the choice to count as right
CHOICE_SLACK = 1.03


def points(cells, hidden, lengths, batches) -> list[tuple[str, int, int, int]]:
    """The grid, the headline shapes first (H 20, B 16, the longest T), then by growing work ``T*B*H^2``."""
    grid = [(c, h, t, b) for c in cells for h in hidden for t in lengths for b in batches]
    return sorted(grid, key=lambda p: (not (p[1] == 20 and p[3] == 16 and p[2] == max(lengths)),
                                       p[2] * p[3] * p[1] ** 2, list(CELLS).index(p[0])))


def _time_mode(mode: str, module: nn.Module, x: torch.Tensor, clock) -> float:
    for p in module.parameters():
        p.grad = None
    if mode == "backward":
        out = module(x)[0]
        loss = out[:, -1].sum()
        t0 = clock()
        loss.backward()
        return clock() - t0
    t0 = clock()
    module(x)[0][:, -1].sum().backward()
    return clock() - t0


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    for p in module.parameters():
        p.grad = None
    module(x)[0][:, -1].sum().backward()
    return [p.grad.detach().clone() for p in module.parameters()]


def _decision(wrapped: nn.Module) -> dict:
    d = getattr(wrapped, "decision", None)
    if d is None:
        return {"chosen": None, "predicted_ms": {}}
    return {"chosen": d.chosen.name,
            "predicted_ms": {c.name: (None if c.predicted_s is None else round(c.predicted_s * 1e3, 4))
                             for c in d.candidates}}


def measure_point(cell: str, H: int, T: int, B: int, modes, rounds: int, device: torch.device) -> list[dict]:
    """The rows of one point: one per mode."""
    torch.manual_seed(0)
    module = CELLS[cell](1, H, batch_first=True).to(device)
    x = torch.randn(B, T, 1, device=device)
    base = dict(cell=cell, H=H, T=T, B=B, input=1, device=device.type)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scan = spscan.wrap(module, x, backward="scan")
        auto = spscan.wrap(module, x)
    plan_s = time.perf_counter() - t0
    choice = _decision(auto)
    err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
              for a, b in zip(_grads(scan, x), _grads(module, x)))
    if not err <= 1e-3:
        return [dict(base, mode=m, error=f"gradients differ from autograd's: relative {err:.2e}", **choice)
                for m in modes]
    clock = device_clock(device.type)
    rows = []
    for mode in modes:
        for _ in range(2):
            _time_mode(mode, module, x, clock), _time_mode(mode, scan, x, clock)
        pairs = []
        for r in range(rounds):
            sides = (module, scan) if r % 2 == 0 else (scan, module)
            got = {id(s): _time_mode(mode, s, x, clock) for s in sides}
            pairs.append((got[id(module)], got[id(scan)]))
        native_s = statistics.median(p[0] for p in pairs)
        scan_s = statistics.median(p[1] for p in pairs)
        ratios = sorted(p[0] / p[1] for p in pairs)
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        chosen = choice["chosen"]
        chosen_s = scan_s if chosen in ("scan", "graph") else native_s
        rows.append(dict(base, mode=mode, native_ms=native_s * 1e3, scan_ms=scan_s * 1e3,
                         ratio=native_s / scan_s, ratio_q25=q[0], ratio_q75=q[2], rounds=rounds, plan_s=plan_s,
                         grad_error=err, **choice,
                         choice_ok=None if chosen is None else chosen_s <= CHOICE_SLACK * min(native_s, scan_s),
                         **recurrent_floor(cell, T, B, H, 1, mode, scan_s)))
    return rows


def heat_maps(rows: list[dict], path: Path) -> Optional[str]:
    """``path`` (PNG): one panel per (cell, mode, batch), log2 ratio over (T, H); None, or why it was skipped."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no heat map"
    timed = [r for r in rows if "ratio" in r]
    if not timed:
        return "no timed rows: no heat map"
    panels = sorted({(r["cell"], r["mode"], r["B"]) for r in timed}, key=lambda k: (list(CELLS).index(k[0]), k[1], k[2]))
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False, constrained_layout=True)
    for ax, (cell, mode, B) in zip(axes.flat, panels):
        sel = [r for r in timed if (r["cell"], r["mode"], r["B"]) == (cell, mode, B)]
        Ts, Hs = sorted({r["T"] for r in sel}), sorted({r["H"] for r in sel})
        grid = [[math.nan] * len(Ts) for _ in Hs]
        for r in sel:
            i, j = Hs.index(r["H"]), Ts.index(r["T"])
            grid[i][j] = math.log2(r["ratio"])
            mark = "" if r.get("choice_ok") in (None, True) else " !"
            ax.text(j, i, f"{r['ratio']:.2g}x{mark}", ha="center", va="center", fontsize=8,
                    color="white" if abs(grid[i][j]) > 2.5 else "black")
        im = ax.imshow(grid, cmap="RdBu", vmin=-4, vmax=4, origin="lower", aspect="auto")
        ax.set_xticks(range(len(Ts)), [str(t) for t in Ts])
        ax.set_yticks(range(len(Hs)), [str(h) for h in Hs])
        ax.set_xlabel("T")
        ax.set_ylabel("H")
        ax.set_title(f"{cell} {mode}, B = {B}", fontsize=9)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.colorbar(im, ax=axes, shrink=0.6, label="log2(autograd / scan)")
    fig.suptitle(f"recurrent scan vs autograd ({timed[0]['device']}); '!': the cost model chose the slower side",
                 fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for crossover.json and crossover.png")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="a small grid (a smoke run)")
    ap.add_argument("--cells", default="rnn,gru,lstm")
    ap.add_argument("--hidden", default="20,64,128,256")
    ap.add_argument("--lengths", default="1000,10000,30000")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--modes", default="backward,step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=540.0, help="no point but the first is started after this many seconds")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cells = [c for c in args.cells.split(",") if c]
    if any(c not in CELLS for c in cells):
        ap.error(f"--cells: expected some of {', '.join(CELLS)}, got {args.cells}")
    hidden, lengths, batches = _ints(args.hidden), _ints(args.lengths), _ints(args.batches)
    if args.quick:
        hidden, lengths, batches = ([20, 64], [1000], [16]) if device.type == "cuda" else ([8], [50], [4])
    modes = [m for m in args.modes.split(",") if m]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else
                f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
                torch=torch.__version__, date=time.strftime("%Y-%m-%d"), commit=os.environ.get("SPSCAN_COMMIT"),
                rounds=args.rounds, choice_slack=CHOICE_SLACK, loss="out[:, -1].sum()", dtype="float32")
    rows: list[dict] = []
    start = time.perf_counter()
    todo = points(cells, hidden, lengths, batches)
    skipped = []
    for k, (cell, H, T, B) in enumerate(todo):
        if k > 0 and time.perf_counter() - start > args.budget_s:
            skipped = todo[k:]
            break
        try:
            got = measure_point(cell, H, T, B, modes, args.rounds, device)
        except Exception as e:  # a point the device cannot run (memory): recorded, the map goes on
            got = [dict(cell=cell, H=H, T=T, B=B, mode=m, error=f"{type(e).__name__}: {str(e)[:200]}") for m in modes]
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows += got
        for r in got:
            what = r.get("error") or (f"ratio {r['ratio']:.2f} (scan {r['scan_ms']:.3f} ms, autograd "
                                      f"{r['native_ms']:.3f} ms), chose {r['chosen']}"
                                      f"{'' if r['choice_ok'] in (None, True) else ' (WRONG)'}")
            print(f"{cell} H={H} T={T} B={B} {r['mode']}: {what}", flush=True)
        meta["skipped"] = [list(p) for p in todo[k + 1:]]
        (out / "crossover.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    meta["skipped"] = [list(p) for p in skipped]
    meta["elapsed_s"] = round(time.perf_counter() - start, 1)
    timed = [r for r in rows if "ratio" in r]
    wrong = [r for r in timed if r.get("choice_ok") is False]
    meta["summary"] = dict(points=len(todo), timed_rows=len(timed), skipped_points=len(skipped),
                           wrong_choices=len(wrong), scan_faster=sum(r["ratio"] > 1 for r in timed))
    (out / "crossover.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    note = heat_maps(rows, out / "crossover.png")
    print(f"{len(timed)} rows timed, {len(wrong)} wrong choices, {len(skipped)} points skipped (budget); "
          f"{out / 'crossover.json'}" + (f"; {note}" if note else f", {out / 'crossover.png'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
