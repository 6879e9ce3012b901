"""``python -m spscan bench``: run the paper-reproduction benchmark suites and write a report.

Each suite is a pytest-benchmark file under ``bench/`` run in its own ``pytest`` process with
``--benchmark-json DIR/json/<suite>.json`` (so ``--benchmark-compare``, ``--benchmark-save`` and
the other pytest-benchmark options work as usual: pass them after ``--``). Sizes are chosen by
the suites from ``SPSCAN_BENCH_QUICK`` / ``SPSCAN_BENCH_DEVICE``, which this command sets.
Afterwards :func:`spscan.cli.report.write_report` turns the JSON into ``DIR/report.md`` and
one PNG per figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["SUITES", "NEEDS", "main", "parse_args", "find_bench_dir", "missing_modules", "failure_cause"]

#: suite name -> bench file, in run order (cheapest figures first)
SUITES: dict[str, str] = {
    "table1": "test_table1.py",
    "vgg": "test_paper_vgg.py",
    "rnn": "test_paper_rnn.py",
    "gru": "test_paper_gru.py",
    "spgemm": "test_paper_spgemm.py",
    "convergence": "test_paper_convergence.py",
}


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Options of ``python -m spscan bench``; everything after ``--`` goes to pytest unchanged."""
    argv = list(argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(
        prog="python -m spscan bench",
        description="Run the paper's benchmarks (pytest-benchmark suites in bench/) and write report.md and "
                    "the figures. Extra pytest arguments go after '--'.",
    )
    p.add_argument("--quick", action="store_true", help="small sizes (a few minutes on a 2-core CPU)")
    p.add_argument("--out", default="spscan-bench", help="output directory (default ./spscan-bench)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="device for the suites (default: cuda if available, else cpu)")
    p.add_argument("--suites", default=",".join(SUITES),
                   help=f"comma-separated subset of: {', '.join(SUITES)} (default: all)")
    p.add_argument("--only", default=None,
                   help="restrict the RNN sweeps, e.g. 'T=10,100,1000;B=2,16' (sets SPSCAN_BENCH_ONLY)")
    p.add_argument("--bench-dir", default=None, help="directory holding the bench suites (default: the checkout's bench/)")
    p.add_argument("--report-only", action="store_true",
                   help="do not run anything: rebuild report.md and the figures from DIR/json/*.json")
    p.add_argument("--note", action="append", default=[], help="a line added to the report header (repeatable)")
    ns = p.parse_args(argv)
    names = [s.strip() for s in ns.suites.split(",") if s.strip()]
    unknown = [s for s in names if s not in SUITES]
    if unknown:
        p.error(f"unknown suite(s) {unknown}; choose from {list(SUITES)}")
    ns.suites = names
    return ns, passthrough


def find_bench_dir(explicit: Optional[str] = None) -> Path:
    """The ``bench/`` directory of the source checkout; ``FileNotFoundError`` with a clear message if absent."""
    if explicit:
        d = Path(explicit)
    else:
        d = Path(__file__).resolve().parents[2] / "bench"  # spscan/cli/bench.py -> checkout/bench
    if not (d / SUITES["rnn"]).is_file():
        raise FileNotFoundError(
            f"benchmark suites not found in {d}: `python -m spscan bench` runs the pytest-benchmark files of a "
            "source checkout. Install spscan editable from the repository (pip install -e .) or pass "
            "--bench-dir /path/to/spscan/bench.")
    return d


def _env(ns: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["SPSCAN_BENCH_QUICK"] = "1" if ns.quick else "0"
    if ns.device:
        env["SPSCAN_BENCH_DEVICE"] = ns.device
    if ns.only:
        env["SPSCAN_BENCH_ONLY"] = ns.only
    return env


def _run_suite(name: str, bench: Path, out: Path, env: dict[str, str], extra: list[str]) -> dict:
    """One suite in its own pytest process; its output goes to ``out/logs/<name>.log``."""
    (out / "json").mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    js = out / "json" / f"{name}.json"
    cmd = [sys.executable, "-m", "pytest", str(bench / SUITES[name]), "-q", "-p", "no:cacheprovider",
           "--rootdir", str(bench.parent), f"--benchmark-json={js}", "-W", "ignore::UserWarning", *extra]
    t0 = time.perf_counter()
    with open(out / "logs" / f"{name}.log", "w") as log:
        rc = subprocess.call(cmd, cwd=str(bench.parent), env=env, stdout=log, stderr=subprocess.STDOUT)
    status = {0: "passed", 5: "no tests ran"}.get(rc, f"failed (exit {rc}, see logs/{name}.log)")
    return {"name": name, "status": status, "rc": rc, "seconds": time.perf_counter() - t0, "json": js}


#: what the suites import beyond spscan's own dependencies (the ``bench`` extra), module -> distribution
NEEDS: dict[str, str] = {"pytest": "pytest", "pytest_benchmark": "pytest-benchmark"}


def missing_modules() -> list[str]:
    """Distributions the suites need that this interpreter cannot import."""
    return [dist for mod, dist in NEEDS.items() if importlib.util.find_spec(mod) is None]


_CAUSE = re.compile(r"^(E\s+)?(\w+(Error|Exception)\b.*|ERROR .*|FAILED .*|.*No module named .*)$")


def failure_cause(log: Path, limit: int = 4) -> list[str]:
    """The lines of a suite's log that say why it failed (exceptions, ERROR/FAILED lines), last ones first
    kept; the last lines of the log if none match."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    hits = [ln.strip() for ln in lines if _CAUSE.match(ln.strip())]
    seen: list[str] = []
    for ln in hits:
        if ln not in seen:
            seen.append(ln)
    return seen[-limit:] if seen else [ln.strip() for ln in lines[-limit:] if ln.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m spscan bench``; returns the exit status (1 if any suite failed)."""
    ns, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    from spscan.cli.report import write_report

    meta: dict = {"quick": ns.quick, "notes": list(ns.note)}
    if hasattr(os, "getloadavg"):
        meta["loadavg"] = os.getloadavg()[0]
    results: list[dict] = []
    if not ns.report_only:
        try:
            bench = find_bench_dir(ns.bench_dir)
        except FileNotFoundError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        missing = missing_modules()
        if missing:
            print(f"error: the benchmark suites need {', '.join(missing)}, which this Python cannot import "
                  f"({sys.executable}). Install the bench extra: pip install -e \".[bench]\" in the checkout "
                  f"(or pip install {' '.join(missing)}).", file=sys.stderr)
            return 2
        from tqdm.auto import tqdm

        env = _env(ns)
        bar = tqdm(ns.suites, desc="benchmark suites", unit="suite", disable=None)  # no bar unless a terminal
        for name in bar:
            bar.set_postfix_str(name)
            r = _run_suite(name, bench, out, env, extra)
            results.append(r)
            tqdm.write(f"{name:<12} {r['status']} in {r['seconds']:.0f} s")
            if r["rc"] not in (0, 5):
                for line in failure_cause(out / "logs" / f"{name}.log"):
                    tqdm.write(f"  {line}")
        meta["suites"] = [{k: r[k] for k in ("name", "status", "seconds")} for r in results]
        if ns.only:
            meta["notes"].append(f"RNN sweeps restricted to {ns.only}")
    paths = sorted((out / "json").glob("*.json")) if (out / "json").is_dir() else []
    paths = [p for p in paths if p.stat().st_size > 0]
    report = write_report(paths, out, meta)
    print(f"report: {report}")
    return 1 if any(r["rc"] not in (0, 5) for r in results) else 0
