"""The zoo benchmark: a training step of each model of the zoo (``tests/zoo_models.py``: torchvision's,
timm's, and code as people post it) through ``spscan.wrap(model, x)`` against plain autograd, float32.

Run::

    python bench/zoo.py [--quick] [--threads 2] [--backward auto|scan] [--models NAME,...] [--out FILE.md]

Each row builds the model at its benchmark size (``Case.make("bench")``: batches of 16 images of 32x32 or
64x64, sequences at the lengths people train: pixel-by-pixel GRU T=784, the adding problem T=1000,
language models T=128..256), wraps it with ``spscan.wrap(model, x)`` (``backward="auto"`` by default, the
library's default: the planner's choice per input signature; ``--backward scan`` forces the scan) and
times, as ``bench/never_slower.py`` does, interleaved rounds of one training step per side (``p.grad =
None`` for every parameter, forward, ``loss.backward()``; the loss ``(y * w).sum()`` for fixed random
``w``): plain autograd on an identical copy of the model and the wrapped model, the sides taking turns
going first, after a seeded step whose gradients must agree (:func:`bench.never_slower.grad_error` below
1e-3: a row whose gradients differ is reported and not timed) and warm-up steps. The row's **ratio** is the
median over rounds of ``autograd_time / wrapped_time`` (> 1: the wrapped step is faster), with its
interquartile range; rows under the bar (0.97) are marked. *chose* is the wrapper's
``decision.chosen.name`` (``scan``, ``native``: the model's own autograd backward, or ``graph`` on a
GPU); *plan s* the seconds ``spscan.wrap`` took (tracing and planning, once per model).

``--profile`` adds, for every row where ``native`` was chosen, where the wrapper's time goes besides the
model's own forward and backward: the forward alone and the backward alone of both sides (medians), and
the functions of ``spscan`` that the wrapped step calls, by their own time (cProfile).

``--quick`` runs fewer rounds per row (under three minutes for the whole zoo on two cores).
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

BAR = 0.97


@dataclass
class ZooRow:
    model: str
    family: str
    batch: int
    input: str
    chose: str = "-"
    ratio: Optional[float] = None
    q25: Optional[float] = None
    q75: Optional[float] = None
    autograd_s: Optional[float] = None
    spscan_s: Optional[float] = None
    plan_s: Optional[float] = None
    rounds: int = 0
    refused: Optional[str] = None
    wrong: Optional[str] = None
    skipped: Optional[str] = None
    notes: list[str] = field(default_factory=list)
    profile: list[str] = field(default_factory=list)


def _describe(x) -> str:
    kind = "ids" if not x.is_floating_point() else ""
    return "x".join(str(s) for s in x.shape) + (f" {kind}" if kind else "")


def _copy(case, model):
    """An identical copy of ``model`` (``torch.nn.utils.weight_norm``'s modules cannot be deep-copied: the same
    seeded build, loaded with the model's state)."""
    from bench.never_slower import fresh_copy

    try:
        return fresh_copy(model)
    except RuntimeError:
        other = case.build("bench").to(next(model.parameters()).device)
        other.load_state_dict(model.state_dict())
        return other


def _stepper(case, net, params, x, w: list):
    """One training step of ``net``; the loss weights ``w[0]`` are drawn (seeded) on the first step of either side."""
    import torch

    def step() -> None:
        for p in params:
            p.grad = None
        y = case.output(net(x))
        if not w:
            w.append(torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.device, y.dtype))
        (y * w[0]).sum().backward()

    return step


def measure(case, args) -> ZooRow:
    import torch

    import spscan
    from bench.never_slower import device_clock, grad_error, median_ratio, quartiles, refusal, rounds_for

    device = args.device
    model = case.build("bench").to(device)
    x = case.batch(case.bench_batch, "bench", seed=0).to(device)
    row = ZooRow(case.name, case.family, case.bench_batch, _describe(x))
    plain = _copy(case, model)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a forced scan names its opaque nodes; auto names what it refused
            wrapped = spscan.wrap(model, x, backward=args.backward)
    except Exception as e:  # noqa: BLE001 - the refusal is the row's result
        row.refused = refusal(e)
        return row
    row.plan_s = time.perf_counter() - t0
    dec = getattr(wrapped, "decision", None)
    row.chose = str(dec.chosen.name) if dec is not None else type(wrapped).__name__
    reason = getattr(wrapped, "reason", None)  # spscan.runtime.choices.NativeModule: the scan refused the model
    if reason:
        row.notes.append("scan refused: " + (reason if len(reason) <= 120 else reason[:117] + "..."))
    w: list = []
    steps = [_stepper(case, plain, list(plain.parameters()), x, w),
             _stepper(case, wrapped, list(model.parameters()), x, w)]

    # a seeded step on both sides: the gradients must agree before anything is timed (a forced scan warns, on its
    # first step, of the nodes that run autograd's own backward inside it: counted in the row's note)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in steps:
            torch.manual_seed(1234)
            step()
    for w_ in caught:
        m = re.search(r"(\d+) nodes? of its plan runs? autograd's own backward", str(w_.message))
        if m:
            row.notes.append(f"{m.group(1)} node{'s' if m.group(1) != '1' else ''} on autograd's backward")
    err = grad_error(list(plain.parameters()), list(model.parameters()))
    if not err < 1e-3:
        row.wrong = f"gradients differ from autograd's by {err:.3g} (relative, limit 1e-3)"
        return row

    clock = device_clock(device)
    times: list[tuple[float, float]] = []

    def one_round() -> None:
        t = [0.0, 0.0]
        order = (0, 1) if len(times) % 2 == 0 else (1, 0)
        for k in order:
            t0 = clock()
            steps[k]()
            t[k] = clock() - t0
        times.append((t[0], t[1]))

    warnings.simplefilter("ignore")  # the rest of the run: what the first step said is in the note
    for _ in range(args.warmup):
        one_round()
    n = rounds_for(sum(times[-1]), args.budget, args.min_rounds, args.max_rounds)
    times.clear()
    for _ in range(n):
        one_round()
    row.rounds = n
    row.ratio = median_ratio(times)
    row.q25, row.q75 = quartiles([a / b for a, b in times])
    row.autograd_s = statistics.median(a for a, _ in times)
    row.spscan_s = statistics.median(b for _, b in times)
    if row.ratio < BAR:
        row.notes.append(f"below {BAR:g}")
    if args.profile and row.chose == "native":
        row.profile = profile_native(case, plain, wrapped, model, x, w[0], args)
    return row


def profile_native(case, plain, wrapped, model, x, w, args, n: int = 21) -> list[str]:
    """Where a wrapper that chose ``native`` spends its time besides the model: forward and backward alone,
    each side (medians of ``n``), then cProfile's view of ``n`` wrapped steps (spscan's functions by their
    own time, and the model's call inside the wrapper)."""
    import cProfile
    import pstats

    from bench.never_slower import device_clock

    clock = device_clock(args.device)
    out = []

    def parts(net, params):
        fw, bw = [], []
        for _ in range(n):
            for p in params:
                p.grad = None
            t0 = clock()
            loss = (case.output(net(x)) * w).sum()
            t1 = clock()
            loss.backward()
            t2 = clock()
            fw.append(t1 - t0)
            bw.append(t2 - t1)
        return statistics.median(fw), statistics.median(bw)

    sides = {"autograd": (plain, list(plain.parameters())), "spscan": (wrapped, list(model.parameters()))}
    res = {}
    for _ in range(2):  # interleaved twice, the second kept
        for name, (net, params) in sides.items():
            res[name] = parts(net, params)
    (af, ab), (sf, sb) = res["autograd"], res["spscan"]
    out.append(f"forward: autograd {af * 1e3:.3f} ms, wrapper {sf * 1e3:.3f} ms (+{(sf - af) * 1e6:.0f} us); "
               f"backward: autograd {ab * 1e3:.3f} ms, wrapper {sb * 1e3:.3f} ms (+{(sb - ab) * 1e6:.0f} us)")
    params = list(model.parameters())
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        for p in params:
            p.grad = None
        (case.output(wrapped(x)) * w).sum().backward()
    prof.disable()
    st = pstats.Stats(prof)
    rows = []
    for (fn, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        if f"{os.sep}spscan{os.sep}" in fn or fn.startswith(str(ROOT / "spscan")):
            rows.append((tt, ct, nc, f"{Path(fn).relative_to(ROOT) if fn.startswith(str(ROOT)) else fn}:{line}({func})"))
    rows.sort(reverse=True)
    own = sum(r[0] for r in rows)
    out.append(f"spscan's own time in {n} wrapped steps: {own / n * 1e6:.0f} us per step; top functions "
               "(own us per step, cumulative us per step, calls per step):")
    for tt, ct, nc, where in rows[:8]:
        out.append(f"  {tt / n * 1e6:8.1f} {ct / n * 1e6:9.1f} {nc / n:6.1f}  {where}")
    return out


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}" if s < 0.1 else f"{s * 1e3:.0f}"


def format_table(rows: Sequence[ZooRow]) -> str:
    head = ["model", "family", "batch", "input", "chose", "ratio autograd/spscan (IQR)", "autograd (ms)",
            "spscan (ms)", "plan (s)", "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 5 + ["---:"] * 4 + ["---"]) + "|"]
    for r in rows:
        if r.ratio is None:
            ratio = "-"
        else:
            ratio = f"{r.ratio:.2f} ({r.q25:.2f}-{r.q75:.2f})"
            if r.ratio < BAR:
                ratio = f"**{ratio}**"
        note = "; ".join([t for t in (r.skipped, r.refused, r.wrong) if t] + r.notes).replace("|", "\\|")
        plan = "-" if r.plan_s is None else f"{r.plan_s:.1f}"
        lines.append("| " + " | ".join([r.model, r.family, str(r.batch), r.input, r.chose, ratio, _ms(r.autograd_s),
                                        _ms(r.spscan_s), plan, note]) + " |")
    return "\n".join(lines)


def summary(rows: Sequence[ZooRow]) -> str:
    import math

    ran = [r for r in rows if r.ratio is not None]
    below = [r for r in ran if r.ratio < BAR]
    parts = [f"{len(ran)} rows timed", f"{sum(1 for r in rows if r.refused)} refused",
             f"{sum(1 for r in rows if r.wrong)} with wrong gradients", f"{sum(1 for r in rows if r.skipped)} skipped"]
    if ran:
        geo = math.exp(sum(math.log(r.ratio) for r in ran) / len(ran))
        parts.append(f"geometric mean ratio {geo:.2f}")
    parts.append(f"below {BAR:g}: " + (", ".join(f"{r.model} {r.ratio:.2f}" for r in below) or "none"))
    return "; ".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/zoo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds per row (the whole zoo in under 3 minutes)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--backward", default="auto", choices=["auto", "scan", "native", "graph"],
                   help="spscan.wrap's backward= (default auto: the planner's choice)")
    p.add_argument("--models", default="", help="comma-separated model names (or parts of names) to run")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--profile", action="store_true", help="where the wrapper's time goes on rows that chose native")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    if args.quick:
        args.warmup, args.budget, args.min_rounds, args.max_rounds = 1, 0.6, 3, 5
    else:
        args.warmup, args.budget, args.min_rounds, args.max_rounds = 2, 6.0, 7, 41
    from zoo_models import CASES, missing

    wanted = [s for s in args.models.split(",") if s]
    cases = [c for c in CASES if not wanted or any(s == c.name or s in c.name for s in wanted)]
    if args.device.startswith("cuda"):
        dev = torch.cuda.get_device_name(0)
    else:
        dev = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    import spscan  # noqa: F401 - imported before the clock starts

    header = [f"# The zoo: a training step through `spscan.wrap(model, x, backward={args.backward!r})` against "
              "autograd", "",
              f"{dev}, {args.threads} torch thread{'s' if args.threads != 1 else ''}, float32, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d', time.gmtime())}{', --quick' if args.quick else ''}. ratio = median over "
              "interleaved rounds of autograd step time / wrapped step time (> 1: the wrapped step is faster); "
              f"**bold**: below {BAR:g}. Run: `python bench/zoo.py{' --quick' if args.quick else ''}"
              f"{'' if args.backward == 'auto' else ' --backward ' + args.backward}`."]
    print("\n".join(header), flush=True)
    rows = []
    start = time.perf_counter()
    for case in cases:
        why = missing(case.needs)
        if why:
            rows.append(ZooRow(case.name, case.family, case.bench_batch, "-", skipped=why))
            continue
        t0 = time.perf_counter()
        row = measure(case, args)
        rows.append(row)
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        print(f"  {case.name}: chose {row.chose}, ratio {ratio} "
              f"{row.refused or row.wrong or ''} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if load is not None and load + args.threads > (os.cpu_count() or 1) + 0.5 and args.threads > 1:
        print(f"warning: the 1-minute load average is {load:.1f} on {os.cpu_count()} cores: {args.threads} torch "
              "threads contend with other processes, and OpenMP's spinning threads then make both sides' "
              "multi-threaded ops several times slower (try --threads 1, or OMP_WAIT_POLICY=PASSIVE)",
              file=sys.stderr)
    text = ["", format_table(rows), "", summary(rows) + f" ({time.perf_counter() - start:.0f} s"
            + (f", load average over 1 min at the end {load:.1f})" if load is not None else ")")]
    profiled = [r for r in rows if r.profile]
    if profiled:
        text += ["", "## Where a wrapper that chose `native` spends its time", ""]
        for r in profiled:
            text += [f"**{r.model}** (ratio {r.ratio:.2f})", "", "```text", *r.profile, "```", ""]
    print("\n".join(text), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(header + text).rstrip() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
