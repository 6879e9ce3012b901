"""Two checkouts of spscan against each other on the same benchmark rows, in one sitting, interleaved.

    python -m bench.ab --side before=PYTHON:DIR --side after=PYTHON:DIR [--runs 3] --out TABLE.md \
        -- bench/test_recurrent_step.py::test_recurrent_step_cpu bench/test_cnn_step.py::test_cnn_step_cpu

Each side is a checkout (``DIR``, where its ``bench/`` lives) and the interpreter that imports that
checkout's spscan (``PYTHON``). Run ``r`` runs the pytest-benchmark rows on every side in turn, the
order alternating between runs (before, after; after, before; ...), so slow drift in the machine's
load falls on both sides alike. A row's figures are medians over its runs: the benchmark's own
median time, and ``speedup_vs_autograd`` where the row records one (its autograd baseline timed in
interleaved pairs in the same process). The table gives, per row present on both sides, both times,
after/before, both ratios against autograd and their quotient; ``--bound`` (default 0.05) flags the
rows whose ratio against autograd moved by more than that (the comparison a row is built for:
absolute times move with the machine, the ratio much less).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

__all__ = ["run_side", "parse_sides", "rows_of", "format_table", "main"]


def run_side(python: str, root: Path, tests: list[str], out: Path, env: dict) -> float:
    """One pass of ``tests`` in ``root`` with ``python``; the benchmark JSON goes to ``out``. Seconds taken."""
    t0 = time.perf_counter()
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--benchmark-json={out}", *tests]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{root}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    return time.perf_counter() - t0


def parse_sides(specs: list[str]) -> list[tuple[str, str, Path]]:
    """``[(name, python, checkout)]`` from ``NAME=PYTHON:DIR`` arguments."""
    sides = []
    for s in specs:
        name, rest = s.split("=", 1)
        python, root = rest.split(":", 1)
        sides.append((name, python, Path(root).resolve()))
    return sides


def rows_of(path: Path) -> dict[str, tuple[float, Optional[float]]]:
    """``{row: (median seconds, speedup_vs_autograd or None)}`` of one pytest-benchmark JSON."""
    data = json.loads(path.read_text())
    out = {}
    for b in data["benchmarks"]:
        ratio = b.get("extra_info", {}).get("speedup_vs_autograd")
        out[b["fullname"].split("::", 1)[-1]] = (float(b["stats"]["median"]), None if ratio is None else float(ratio))
    return out


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.1f} s"


def format_table(names: tuple[str, str], runs: dict[str, list[dict]], bound: float, header: list[str]) -> str:
    a, b = names
    common = [r for r in runs[a][0] if all(r in rr for rr in runs[a] + runs[b])]
    lines = header + ["", f"| row | {a} | {b} | {b}/{a} time | vs autograd, {a} | vs autograd, {b} | ratio moved |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
    quot, times, flagged = [], [], []
    for row in common:
        ta = statistics.median(rr[row][0] for rr in runs[a])
        tb = statistics.median(rr[row][0] for rr in runs[b])
        ra = [rr[row][1] for rr in runs[a] if rr[row][1] is not None]
        rb = [rr[row][1] for rr in runs[b] if rr[row][1] is not None]
        times.append(tb / ta)
        cells = [f"{tb / ta:.3f}", "-", "-", "-"]
        if ra and rb:
            ma, mb = statistics.median(ra), statistics.median(rb)
            q = mb / ma
            quot.append(q)
            mark = " **" if abs(q - 1) > bound else ""
            if mark:
                flagged.append(row)
            cells[1:] = [f"{ma:.2f}x", f"{mb:.2f}x", f"{q:.3f}{mark}"]
        lines.append(f"| {row} | {_fmt_s(ta)} | {_fmt_s(tb)} | " + " | ".join(cells) + " |")
    geo = lambda v: math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")  # noqa: E731
    lines += ["", f"{len(common)} rows; geometric mean {b}/{a} time {geo(times):.3f}; ratio against autograd "
              f"{b}/{a}: geometric mean {geo(quot):.3f}, {len(flagged)} of {len(quot)} rows moved by more than "
              f"{bound:.0%} (marked **)"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    tests: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, tests = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n")[0])
    p.add_argument("--side", action="append", required=True, help="NAME=PYTHON:DIR (twice: the first is the baseline)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--bound", type=float, default=0.05)
    p.add_argument("--note", action="append", default=[])
    args = p.parse_args(argv)
    if len(args.side) != 2 or not tests:
        p.error("two --side and the benchmark rows after '--' expected")
    sides = parse_sides(args.side)
    env = dict(os.environ, SPSCAN_BACKWARD="scan")
    runs: dict[str, list[dict]] = {n: [] for n, _, _ in sides}
    took: dict[str, list[float]] = {n: [] for n, _, _ in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.runs):
            for name, python, root in (sides if r % 2 == 0 else sides[::-1]):
                out = Path(tmp) / f"{name}-{r}.json"
                took[name].append(run_side(python, root, tests, out, env))
                runs[name].append(rows_of(out))
                print(f"run {r + 1}/{args.runs} {name}: {took[name][-1]:.0f} s", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    header = [f"# {sides[0][0]} against {sides[1][0]}: {' '.join(tests)}", "",
              f"{args.runs} runs per side, alternating; each row's figures are medians over the runs. "
              f"1-minute load at the end {load:.2f}. Produced by `python -m bench.ab`.", *args.note]
    text = format_table((sides[0][0], sides[1][0]), runs, args.bound, header)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
