"""Driver of ``bench/gpu/run.sh``: GPU tests, then GPU benchmarks, then one report, inside a deadline.

``python bench/gpu/driver.py --out DIR --deadline EPOCH_S [--quick]`` (``run.sh`` installs the
checkout first and passes a deadline 8 minutes after it started). The full run measures the headline
rows first, then tunes the structured-recurrence kernels (``tune.py``), then runs the GPU tests and
the other suites while the budget lasts. Each test or benchmark
suite is its own ``pytest`` process with a time limit cut to what is left before the deadline
(a suite that runs over is stopped and reported as such; the others keep their rows, and so do the
tests it finished: the ``rowlog`` plugin in this folder appends each row as its test ends). Suites
that cannot run on one GPU (:data:`SUITES_NOT_ON_ONE_GPU`) are listed as skipped with the reason.
DIR receives few files: ``summary.json`` (environment, test counts, suites, target checks),
``tune.json`` (the tune's variants and winners, full run only),
``bench.json`` (every pytest-benchmark row, tagged with its suite), ``report.md`` (the paper
figures' sections from :mod:`spscan.cli.report`, a table of the training steps against autograd
and one of every ratio) and a few PNGs.
Exit status: 0 when everything ran and passed, 1 when a test or suite failed or ran over,
3 when there is no CUDA device (the CPU-runnable parts still ran).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REPORT_RESERVE_S = 25  # kept back from the deadline for the report

# (suite name, bench file, pytest -k filter or None, time cap in seconds); quick mode uses the second list.
# The headline rows run first (the RNN at T = 1000 and 30000, the GRU and the LSTM at T = 1000 and 10000),
# then the structured-recurrence tune (TUNE), the GPU tests, and the rest while the budget lasts.
HEADLINE = [
    ("rnn_step", "bench/test_rnn_step.py", "cuda", 60),
    ("recurrent_step", "bench/test_recurrent_step.py", "cuda", 70),  # GRU, LSTM at T=1000, 10000
]
SUITES_FULL = HEADLINE + [
    # the parallel (Newton) forward vs cuDNN at T = 30000, RNN and GRU, full and quasi-Newton
    ("newton", "bench/test_newton.py", "cuda and 30000-20 and not lstm and forward", 60),
    ("kernels", "bench/test_kernels_gpu.py", None, 100),
    # training steps through spscan.wrap on the device vs cuDNN / cuBLAS autograd, timed in the same test
    ("cnn_step", "bench/test_cnn_step.py", "cuda", 45),  # LeNet-5 B=64, small VGG B=32: step, backward
    ("resnet_step", "bench/test_resnet_step.py", "cuda", 60),  # ResNet-20 train mode B=16 (plans ~3 s)
    ("stacked_step", "bench/test_stacked_step.py", "cuda", 45),  # 2-layer GRU at T=1000, 10000
    ("spgemm", "bench/test_paper_spgemm.py", None, 45),
    ("rnn", "bench/test_paper_rnn.py", "not training", 60),
    ("gru", "bench/test_paper_gru.py", None, 45),
    ("core", "bench/test_core_bench.py", None, 30),
]
# bench/gpu/tune.py on the headline shapes (its quick variant set), after the headline rows: (arguments, cap)
TUNE = (["--quick", "--cases", "rnn30000,gru10000,lstm10000"], 90)
SUITES_QUICK = [
    ("kernels", "bench/test_kernels_gpu.py", "conv4x32x32 or 1000 or planning", 100),
    ("rnn_step", "bench/test_rnn_step.py", "cuda and 1000", 60),
    ("cnn_step", "bench/test_cnn_step.py", "cuda and lenet5-step", 45),  # the CNN path on the device, one row
]
# suites the full run cannot run on one GPU, with the reason the report gives
SUITES_NOT_ON_ONE_GPU = [
    ("distributed", "bench/test_distributed_bench.py",
     "not a GPU measurement: several ranks on one GPU share it, so there is no scaling to time (NCCL refuses two "
     "ranks on one device, 'Duplicate GPU detected'; over Gloo the scan stages its messages through host copies, "
     "and tests/test_gpu.py::test_gloo_ranks_share_one_gpu checks two ranks on this GPU). Its rows are CPU "
     "processes (Gloo over 127.0.0.1)"),
]
# suites whose rows are training steps (autograd and spscan medians): the report's step table
STEP_SUITES = ("rnn_step", "cnn_step", "resnet_step", "recurrent_step", "stacked_step")
# the paper's RNN sweep over T and B (Figure 8): the sizes the full run keeps within its budget
FULL_ONLY = "T=10,100,1000,10000,30000;B=1,4,16,64,256"
TESTS_FULL = (["tests/test_recurrence_kernels.py", "tests/test_newton_fused.py", "tests/test_gpu.py",
               "tests/test_linear_run_chunked.py", "tests/test_triton_kernels.py"], None, 150)
TESTS_QUICK = (["tests/test_gpu.py", "tests/test_linear_run_chunked.py"],
               "sparse-mixed or dense20 or chain20 or graph or chunked", 100)
MAX_PNGS = 2  # the output folder holds at most 8 files: 6 fixed (tune.json included) + these
PNG_PRIORITY = ["gpu_ratios.png", "rnn_sweep_T.png", "spgemm.png", "gru.png", "rnn_sweep_B.png"]


def unlinked_figure(markdown: str, name: str) -> str:
    """``markdown`` with every image link to ``name`` replaced by a note that the figure was left out."""
    note = f"_(figure {name} left out of this folder: regenerate it from bench.json)_"
    return re.sub(r"!\[[^\]]*\]\(" + re.escape(name) + r"\)", lambda _: note, markdown)


def environment() -> dict[str, Any]:
    """Versions and the device, as this process sees them."""
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node(),
                            "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    for mod in ("torch", "triton", "numpy", "scipy", "pytest", "hypothesis", "pytest_benchmark", "jax"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # a missing optional package is reported, not fatal
            info[mod] = f"missing ({type(exc).__name__})"
    import torch

    info["cuda"] = bool(torch.cuda.is_available())
    if info["cuda"]:
        props = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=f"sm_{props.major}{props.minor}",
                    multiprocessors=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1),
                    torch_cuda=torch.version.cuda)
    else:
        info["device"] = f"cpu ({platform.machine()}, {os.cpu_count()} cores)"
    return info


def run_pytest(name: str, args: list[str], timeout: float, log: Path, env: dict[str, str]) -> dict[str, Any]:
    """One pytest process with a time limit; its output goes to ``log`` and its counts are parsed."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
           "--rootdir", str(ROOT), *args]
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=max(1.0, timeout))
            status = {0: "passed", 5: "nothing ran"}.get(rc, f"failed (exit {rc})")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            rc, status = -9, f"stopped at its {timeout:.0f} s limit"
    text = log.read_text(errors="replace")
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|deselected)", text)}
    failed = [ln.split(" ", 1)[1] for ln in text.splitlines() if ln.startswith(("FAILED ", "ERROR "))]
    return {"name": name, "status": status, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
            "counts": counts, "failed": failed[:50]}


def keep_logged_rows(work: Path, name: str) -> int:
    """Rows of a suite whose ``--benchmark-json`` was never written (stopped at its limit, crashed):
    the ones ``rowlog`` appended as each test ended, written as that JSON. Returns how many."""
    js, log = work / f"{name}.json", work / f"{name}.rows.jsonl"
    if (js.is_file() and js.stat().st_size) or not log.is_file():
        return 0
    rows = [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()]
    if rows:
        js.write_text(json.dumps({"machine_info": None, "benchmarks": rows}, default=str))
    return len(rows)


def step_rows(rows: list[dict]) -> list[dict[str, Any]]:
    """The training-step rows (both medians in ``extra_info``) of :data:`STEP_SUITES`, one dict each."""
    out = []
    for r in rows:
        info = r.get("extra_info", {})
        if r.get("suite") not in STEP_SUITES or "autograd_median_s" not in info or "spscan_median_s" not in info:
            continue
        model = info.get("model") or info.get("cell") or "rnn (bitstream classifier)"
        shape = ", ".join(f"{k}={info[k]}" for k in ("batch", "T", "B", "H") if k in info)
        out.append({"suite": r["suite"], "name": r["name"], "model": model, "shape": shape, "mode": info.get("mode"),
                    "autograd_ms": 1e3 * info["autograd_median_s"], "spscan_ms": 1e3 * info["spscan_median_s"],
                    "speedup_vs_autograd": info.get("speedup_vs_autograd"), "levels": info.get("levels"),
                    "backend": info.get("backend"), "grad_max_rel_diff": info.get("grad_max_rel_diff"),
                    "device": info.get("device")})
    return out


def say(msg: str) -> None:
    print(msg, flush=True)


def bar_label(test_name: str, key: str) -> str:
    """A row's label in the ratio figure: ``test_rnn_step_cuda[30000-backward]`` and
    ``speedup_vs_autograd`` read ``rnn step cuda (30000, backward) vs autograd``."""
    base, _, params = test_name.partition("[")
    words = base.removeprefix("test_").replace("_", " ")
    if params:
        words += " (" + params.rstrip("]").replace("-", ", ") + ")"
    baseline = key.removeprefix("speedup_").replace("vs_", "vs ").replace("_", " ")
    return f"{words} {baseline}".strip()


def ratio_figure(bars: list[tuple[str, float]], device: str, path: Path) -> Path:
    """One horizontal bar per (label, speedup), log scale, a line at 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.3 * len(bars) + 1.5))
    ax.barh([b[0] for b in bars], [b[1] for b in bars])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("speedup over the baseline timed in the same run (log scale; > 1: spscan faster)")
    ax.set_title(device)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # long labels: keep every axis label
    plt.close(fig)
    return path


def _ratio_items(info: dict[str, Any]) -> list[tuple[str, float]]:
    keys = ("speedup", "ratio", "fraction", "GBps")
    return [(k, float(v)) for k, v in info.items()
            if any(s in k for s in keys) and isinstance(v, (int, float)) and not isinstance(v, bool)]


def targets(rows: list[dict]) -> list[dict[str, Any]]:
    """The issue's targets, each read from the rows that measure it (``None`` where not measured)."""

    def pick(pred, key):
        vals = [r["extra_info"][key] for r in rows
                if key in r.get("extra_info", {}) and pred(r["name"], r["extra_info"])]
        return max(vals) if vals else None

    def rec(cell: str, T: int, mode: str):
        return lambda n, i: (i.get("cell", "rnn") == cell and i.get("T") == T and i.get("mode") == mode
                             and "newton" not in n)

    checks = [
        ("RNN backward vs cuDNN, T=30000 B=16 H=20", 30.0, pick(rec("rnn", 30000, "backward"), "speedup_vs_autograd")),
        ("RNN training step vs cuDNN, T=30000 B=16 H=20", 3.0, pick(rec("rnn", 30000, "step"), "speedup_vs_autograd")),
        ("GRU backward vs cuDNN, T=10000", 15.0, pick(rec("gru", 10000, "backward"), "speedup_vs_autograd")),
        ("LSTM backward vs cuDNN, T=10000", 5.0, pick(rec("lstm", 10000, "backward"), "speedup_vs_autograd")),
        ("RNN backward vs cuDNN, T=1000", 2.0, pick(rec("rnn", 1000, "backward"), "speedup_vs_autograd")),
        ("Newton forward vs cuDNN's forward, RNN T=30000", 2.0,
         pick(lambda n, i: "newton" in n and i.get("cell") == "rnn" and i.get("mode") == "forward",
              "ratio_sequential_over_newton")),
        ("Newton forward vs cuDNN's forward, GRU T=30000", 2.0,
         pick(lambda n, i: "newton" in n and i.get("cell") == "gru" and i.get("mode") == "forward",
              "ratio_sequential_over_newton")),
        ("numeric SpGEMM vs cuSPARSE (best product)", 3.0,
         pick(lambda n, i: "spgemm" in n, "speedup_vs_torch_sparse")),
        ("SpGEMM achieved / device-copy bandwidth", 0.5,
         pick(lambda n, i: "spgemm" in n, "batched_fraction_of_copy")),
        ("SpMV achieved / device-copy bandwidth", 0.5, pick(lambda n, i: "spmv" in n, "fraction_of_copy")),
    ]
    return [{"target": t, "want_at_least": want, "measured": got,
             "met": None if got is None else bool(got >= want)} for t, want, got in checks]


def write_outputs(out: Path, work: Path, env_info: dict, tests: Optional[dict], suites: list[dict],
                  quick: bool) -> dict[str, Any]:
    """bench.json, report.md, PNGs and summary.json in ``out``."""
    rows, machine = [], None
    for s in suites:
        js = work / f"{s['name']}.json"
        if js.is_file() and js.stat().st_size:
            data = json.loads(js.read_text())
            machine = machine or data.get("machine_info")
            for r in data.get("benchmarks", []):
                r["suite"] = s["name"]
                rows.append(r)
    (out / "bench.json").write_text(json.dumps({"environment": env_info, "machine_info": machine,
                                                "suites": suites, "benchmarks": rows}, indent=1, default=str))
    report_dir = work / "report"
    pngs: list[Path] = []
    parts = [f"# GPU run: {env_info.get('device')}\n",
             f"torch {env_info.get('torch')}, triton {env_info.get('triton')}, Python {env_info.get('python')}; "
             f"{'quick' if quick else 'full'} run started {env_info['started_utc']} UTC. Every ratio compares "
             "medians measured in the same run on this device.\n"]
    if not env_info.get("cuda"):
        parts.append("**No CUDA device** (`torch.cuda.is_available()` is False): the GPU tests and the GPU "
                     "benchmark rows skipped; nothing in this report was measured on a GPU.\n")
    if tests is not None:
        parts.append(f"Tests: {tests['status']}, {tests['counts']} in {tests['seconds']} s.\n")
        parts += [f"* failed: `{f}`" for f in tests["failed"]]
    parts.append("\n## Targets\n\n| target | want >= | measured | met |\n|---|---|---|---|")
    checks = targets(rows)
    for c in checks:
        m = "n/a" if c["measured"] is None else f"{c['measured']:.3g}"
        parts.append(f"| {c['target']} | {c['want_at_least']} | {m} | {c['met']} |")
    steps = step_rows(rows)
    parts.append("\n## Training steps vs autograd\n\nspscan through `spscan.wrap` against the same model under "
                 "autograd (cuDNN / cuBLAS on a GPU), interleaved in one test; medians, > 1: spscan faster.\n")
    if steps:
        parts.append("| suite | model | shape | mode | autograd ms | spscan ms | speedup | levels | backend | "
                     "grad rel. diff |\n|---|---|---|---|---|---|---|---|---|---|")
        for t in steps:
            diff = "" if t["grad_max_rel_diff"] is None else f"{t['grad_max_rel_diff']:.2g}"
            parts.append(f"| {t['suite']} | {t['model']} | {t['shape']} | {t['mode']} | {t['autograd_ms']:.3g} | "
                         f"{t['spscan_ms']:.3g} | {t['speedup_vs_autograd']:.3g} | {t['levels']} | "
                         f"{t['backend'] or ''} | {diff} |")
    else:
        parts.append("_No training-step rows in this run._")
    parts.append("\n## Every row\n\n| suite | benchmark | median | device | ratios |\n|---|---|---|---|---|")
    bars = []
    for r in rows:
        info = r.get("extra_info", {})
        items = _ratio_items(info)
        med = r.get("stats", {}).get("median")
        ratios = ", ".join(f"{k}={v:.3g}" for k, v in items)
        parts.append(f"| {r['suite']} | `{r['name']}` | {med:.4g} s | {info.get('device', '')} | {ratios} |"
                     if med is not None else f"| {r['suite']} | `{r['name']}` | n/a | | {ratios} |")
        bars += [(bar_label(r["name"], k), v) for k, v in items if "speedup" in k and v > 0]
    parts.append("\n## Suites\n\n| suite | status | tests | seconds |\n|---|---|---|---|")
    parts += [f"| {s['name']} | {s['status']}{'; ' + s['note'] if s.get('note') else ''} | "
              f"{', '.join(f'{v} {k}' for k, v in s['counts'].items())} | {s['seconds']} |" for s in suites]
    if bars:
        try:
            pngs.append(ratio_figure(bars, str(env_info.get("device")), out / "gpu_ratios.png"))
        except Exception as exc:  # a plotting problem must not lose the numbers
            parts.append(f"\n_ratio figure not drawn: {type(exc).__name__}: {exc}_")
    paper = ""
    jsons = [work / f"{s['name']}.json" for s in suites if (work / f"{s['name']}.json").is_file()]
    jsons = [p for p in jsons if p.stat().st_size]
    if jsons:
        try:
            from spscan.cli.report import write_report

            path = write_report(jsons, report_dir, {"quick": quick, "notes": [f"device: {env_info.get('device')}"]})
            paper = path.read_text()
            order = {name: i for i, name in enumerate(PNG_PRIORITY)}
            for png in sorted(report_dir.glob("*.png"), key=lambda q: (order.get(q.name, len(order)), q.name)):
                if len(pngs) >= MAX_PNGS:  # its link becomes a note where it stood
                    paper = unlinked_figure(paper, png.name)
                    continue
                shutil.copy(png, out / png.name)
                pngs.append(out / png.name)
        except Exception as exc:
            paper = f"\n_paper sections not rendered: {type(exc).__name__}: {exc}_\n"
    (out / "report.md").write_text("\n".join(parts) + "\n\n# Paper sections\n\n" + paper + "\n")
    summary = {"environment": env_info, "tests": tests, "suites": suites, "targets": checks, "steps": steps,
               "files": sorted(p.name for p in out.iterdir() if p.is_file())}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def run_tune(out: Path, env: dict[str, str], limit: float) -> dict[str, Any]:
    """``bench/gpu/tune.py`` with :data:`TUNE`'s arguments inside ``limit`` seconds; its JSON to ``out``."""
    if limit < 15:
        say(f"== tune: not run, {limit:.0f} s left")
        return {"name": "tune", "status": "not run: out of time", "rc": None, "seconds": 0, "counts": {}}
    say(f"== tune: bench/gpu/tune.py {' '.join(TUNE[0])} (limit {limit:.0f} s)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run([sys.executable, str(HERE / "tune.py"), *TUNE[0], "--out", tmp], cwd=ROOT,
                                  env=env, capture_output=True, text=True, timeout=limit)
            rc, status = proc.returncode, "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            text = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            rc, status, text = -9, f"stopped at its {limit:.0f} s limit", str(exc.stdout or "")
        if (Path(tmp) / "tune.json").exists():
            shutil.copy(Path(tmp) / "tune.json", out / "tune.json")
    say("   " + "\n   ".join(text.strip().splitlines()[-8:]))
    return {"name": "tune", "status": status, "rc": rc, "seconds": round(time.monotonic() - t0, 1), "counts": {}}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds by which everything must end")
    ap.add_argument("--quick", action="store_true", help="smoke run: a few tests and benchmark rows")
    ns = ap.parse_args(argv)
    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = ns.deadline or time.time() + 480
    left = lambda: deadline - time.time() - REPORT_RESERVE_S  # noqa: E731

    env_info = environment()
    say("== environment\n" + json.dumps(env_info, indent=1))
    cuda = env_info["cuda"]
    if not cuda:
        say("!! NO CUDA DEVICE: torch.cuda.is_available() is False. The GPU tests skip and the GPU benchmark "
            "rows skip; running only what a CPU can (test collection, CPU benchmark rows, the report).")
    env = dict(os.environ, PYTHONUNBUFFERED="1", SPSCAN_BENCH_QUICK="1" if ns.quick or not cuda else "0")
    if cuda and not ns.quick:
        env["SPSCAN_BENCH_ONLY"] = FULL_ONLY
    work = Path(tempfile.mkdtemp(prefix="spscan-gpu-"))
    failed = False

    suites = []

    def run_tests() -> dict:
        files, kfilter, cap = TESTS_QUICK if ns.quick else TESTS_FULL
        args = [*files, *(["-k", kfilter] if kfilter else [])]
        say(f"== tests: pytest {' '.join(args)} (limit {min(cap, left()):.0f} s)")
        result = run_pytest("tests", args, min(cap, left()), work / "tests.log", env)
        shutil.copy(work / "tests.log", out / "tests.log")
        say(f"   {result['status']} {result['counts']} in {result['seconds']} s")
        for f in result["failed"]:
            say(f"   FAILED {f}")
        return result

    tests = None
    if ns.quick or not cuda:
        tests = run_tests()
        failed |= tests["rc"] not in (0, 5)
    plan = SUITES_QUICK if ns.quick else SUITES_FULL
    for index, (name, path, kfilter, cap) in enumerate(plan):
        if tests is None and index == len(HEADLINE):  # after the headline rows: the tune, then the tests
            suites.append(run_tune(out, env, min(TUNE[1], left())))
            failed |= suites[-1]["rc"] not in (0, None)
            tests = run_tests()
            failed |= tests["rc"] not in (0, 5)
        limit = min(cap, left())
        if limit < 15:
            suites.append({"name": name, "status": "not run: out of time", "rc": None, "seconds": 0, "counts": {}})
            say(f"== {name}: not run, {left():.0f} s left")
            continue
        args = [path, f"--benchmark-json={work / (name + '.json')}", *(["-k", kfilter] if kfilter else []),
                "-p", "rowlog"]
        say(f"== bench {name}: pytest {' '.join(args[:1] + args[2:-2])} (limit {limit:.0f} s)")
        suite_env = dict(env, SPSCAN_BENCH_ROWS=str(work / f"{name}.rows.jsonl"),
                         PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])))
        r = run_pytest(name, args, limit, work / f"{name}.log", suite_env)
        kept = keep_logged_rows(work, name)
        if kept:
            r["note"] = f"{kept} row(s) kept from the tests that finished"
        suites.append(r)
        say(f"   {r['status']} {r['counts']} in {r['seconds']} s" + (f" ({r['note']})" if kept else ""))
        for f in r["failed"]:
            say(f"   FAILED {f}")
        if r["rc"] not in (0, 5):
            failed = True
            say("   " + "\n   ".join((work / f"{name}.log").read_text(errors="replace").splitlines()[-15:]))
    if not ns.quick:
        for name, path, reason in SUITES_NOT_ON_ONE_GPU:
            suites.append({"name": name, "status": f"skipped: {reason}", "rc": None, "seconds": 0, "counts": {}})
            say(f"== {name} ({path}): skipped, {reason}")

    summary = write_outputs(out, work, env_info, tests, suites, ns.quick)
    shutil.rmtree(work, ignore_errors=True)  # every row is in bench.json, the failing logs' tails in run.log
    say("\n== targets (ratios measured in this run)")
    for c in summary["targets"]:
        m = "n/a" if c["measured"] is None else f"{c['measured']:.3g}"
        say(f"   {c['target']:<48} want >= {c['want_at_least']:<6} got {m:<8} met={c['met']}")
    say(f"\n== wrote {', '.join(summary['files'])} to {out}")
    if not cuda:
        say("!! NO CUDA DEVICE: nothing above was measured on a GPU.")
        return 3
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
