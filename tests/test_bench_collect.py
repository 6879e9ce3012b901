"""Every benchmark module imports and its tests collect, in quick and full mode.

The benchmark suites are not run by the test suite (they time things), so a broken import in one
of them would only show on the machine that runs it (a GPU run, a report regeneration). The GPU
driver's own bookkeeping (rows of a suite stopped at its limit, the training-step table, the
no-device notice) is checked here too, on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("quick", ["1", "0"])
def test_every_bench_module_collects(quick):
    env = dict(os.environ, SPSCAN_BENCH_QUICK=quick)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "bench"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "error" not in out.lower().splitlines()[-1], out[-3000:]
    assert " tests collected" in out or " test collected" in out, out[-1000:]


def _driver():
    """``bench/gpu/driver.py`` as a module (it is a script, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_driver", ROOT / "bench" / "gpu" / "driver.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_driver_keeps_the_rows_of_a_suite_stopped_at_its_limit(tmp_path):
    """pytest-benchmark writes its JSON at the end of the session; a suite killed at its limit keeps
    the rows of the tests that finished through the ``rowlog`` plugin."""
    driver = _driver()
    bench = tmp_path / "test_two_rows.py"
    bench.write_text(
        "import time\n\n"
        "def test_finishes(benchmark):\n"
        "    benchmark.pedantic(lambda: None, rounds=3)\n"
        "    benchmark.extra_info.update(suite_probe=1, autograd_median_s=2e-3, spscan_median_s=1e-3,\n"
        "                                speedup_vs_autograd=2.0, mode='step', model='probe')\n\n"
        "def test_hangs(benchmark):\n"
        "    time.sleep(600)\n")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, SPSCAN_BENCH_ROWS=str(work / "cnn_step.rows.jsonl"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(driver.HERE), os.environ.get("PYTHONPATH")])))
    args = [str(bench), f"--benchmark-json={work / 'cnn_step.json'}", "-p", "rowlog"]
    r = driver.run_pytest("cnn_step", args, 10, work / "cnn_step.log", env)
    assert r["status"] == "stopped at its 10 s limit", (r, (work / "cnn_step.log").read_text()[-2000:])
    assert not (work / "cnn_step.json").exists()
    assert driver.keep_logged_rows(work, "cnn_step") == 1
    rows = json.loads((work / "cnn_step.json").read_text())["benchmarks"]
    assert [(x["name"], x["extra_info"]["suite_probe"], x["stats"]["rounds"]) for x in rows] == [("test_finishes", 1, 3)]
    # the report's training-step table reads the kept row; without CUDA the report says so
    out = tmp_path / "out"
    out.mkdir()
    env_info = {"device": "cpu (test)", "cuda": False, "started_utc": "now", "torch": "t", "triton": "t",
                "python": "p"}
    summary = driver.write_outputs(out, work, env_info, None, [r], quick=False)
    assert [(s["model"], s["mode"], s["speedup_vs_autograd"]) for s in summary["steps"]] == [("probe", "step", 2.0)]
    report = (out / "report.md").read_text()
    assert "**No CUDA device**" in report
    assert "| cnn_step | probe |  | step | 2 | 1 | 2 | None |" in report


def test_gpu_driver_turns_links_to_left_out_figures_into_notes():
    driver = _driver()
    md = "a\n![GRU](gru.png)\nb ![x](gru.png) ![T](rnn_sweep_T.png)\n"
    out = driver.unlinked_figure(md, "gru.png")
    assert "](gru.png)" not in out and out.count("figure gru.png left out of this folder") == 2
    assert "![T](rnn_sweep_T.png)" in out


def test_ratio_figure_rows_have_human_labels():
    driver = _driver()
    assert driver.bar_label("test_rnn_step_cuda[30000-backward]", "speedup_vs_autograd") == \
        "rnn step cuda (30000, backward) vs autograd"
    assert driver.bar_label("test_spgemm", "speedup_vs_torch_sparse") == "spgemm vs torch sparse"
