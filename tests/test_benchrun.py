"""``python -m spscan bench``: argument parsing and the report generator on a tiny synthetic benchmark JSON.

Nothing here runs or times a benchmark: the JSON rows are made up with the fields the suites write.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spscan.cli import bench as benchrun
from spscan.cli.report import FIGURES, load_rows, write_report

COMMON = {"device": "cpu (test, 2 cores, 2 threads)", "quick": True, "torch": "2.x", "triton": "3.x",
          "python": "3.x", "spscan": "0.1.0"}


def _row(name: str, median: float, **info) -> dict:
    return {"name": name, "fullname": f"bench/x.py::{name}", "group": None, "params": {},
            "stats": {"median": median, "min": median, "max": median, "rounds": 1}, "extra_info": info}


def _rnn(exp: str, key: str, v: int) -> dict:
    return _row(f"test_{exp}[{v}]", 0.01 * v, **COMMON, experiment=exp, T=v if key == "T" else 1000,
                B=v if key == "B" else 16, levels=2, autograd_forward_s=0.01, autograd_backward_s=0.02 * v,
                spscan_forward_s=0.012, spscan_backward_s=0.01 * v, backward_speedup=2.0, overall_speedup=1.5)


def _rows() -> list[dict]:
    step = lambda kind, f, crit, phase="up": dict(kind=kind, flops=f, dense_flops=10 * f, critical=crit, phase=phase, level=0)
    rows = [_rnn("rnn_T", "T", t) for t in (10, 100)] + [_rnn("rnn_B", "B", b) for b in (2, 16)]
    rows.append(_row("test_rnn_training_curves", 3.0, **COMMON, experiment="rnn_training", seq_len=100, samples=32,
                     epochs=1, batch_size=16, autograd_backward_s=1.0, bppsa_backward_s=0.5, backward_speedup=2.0,
                     overall_speedup=1.2, last_step_loss_autograd=2.2, last_step_loss_bppsa=2.2, autograd_loss=[2.3, 2.2],
                     autograd_wall_s=[0.1, 0.2], spscan_loss=[2.3, 2.2], spscan_wall_s=[0.05, 0.1]))
    rows.append(_row("test_gru_irmas[S-16]", 0.1, **COMMON, experiment="gru", set="S", frames=259, coeffs=38, B=16,
                     levels=0, autograd_forward_s=0.1, autograd_backward_s=0.3, spscan_forward_s=0.1, spscan_fill_s=0.05,
                     norm_autograd_forward=0.25, norm_autograd_backward=0.75, norm_spscan_forward=0.25,
                     norm_spscan_fill=0.125, norm_spscan_backward=0.25, backward_speedup=3.0, overall_speedup=1.6))
    for choice, lv in (("paper", 3), ("auto", 0)):
        rows.append(_row(f"test_vgg11_pruned_flops[{choice}]", 0.02, **COMMON, experiment="vgg_flops", choice=choice,
                         levels=lv, max_levels=4, n=21, channel_divisor=4, prune_amount=0.97, plan_s=1.0,
                         symbolic_walk_s=0.5, steps=[step("mm", 100, True), step("mm", 50, False), step("mv", 20, True, "mid")],
                         baseline_ops=[dict(kind="bp", flops=20, dense_flops=400, layer=1)], total_flops=170,
                         critical_path_flops=120, baseline_total_flops=20, max_step_flops=100, max_baseline_flops=20,
                         planner_refused="budget" if choice == "paper" else None,
                         planner_candidates_s={"0": 0.01} if choice == "auto" else None))
    for op, sp in (("conv", 1e3), ("relu", 1e5), ("maxpool", 1e4)):
        rows.append(_row(f"test_table1_analytic_generation[{op}]", 1e-4, device="cpu", operator=op,
                         jacobian_T_shape=[3072, 65536], sparsity=0.999, pattern_once_s=0.01, baseline_s_extrapolated=1.0,
                         speedup_values=sp, speedup_pattern_and_values=sp / 10, paper_speedup=sp * 2,
                         baseline_columns_timed=256))
    rows.append(_row("test_spgemm_vgg11[0]", 1e-4, **COMMON, experiment="spgemm", product="conv1^T . relu1^T", index=0,
                     a_shape=[3, 4], b_shape=[4, 4], pairs=10, nnz_c=8, torch_sparse_s=2e-4, scipy_s=1e-4,
                     speedup_vs_torch_sparse=2.0, speedup_vs_scipy=1.0, planned_gbs=1.0, copy_gbs=10.0,
                     symbolic_once_s=1e-3))
    rows.append(_row("test_lenet5_convergence", 2.0, **COMMON, experiment="convergence", data="synthetic", batch=4,
                     iterations=3, levels=2, autograd_loss=[2.3, 2.2, 2.1], spscan_loss=[2.3, 2.2, 2.1],
                     max_abs_loss_diff=1e-7, final_loss_autograd=2.1, final_loss_spscan=2.1, autograd_train_s=1.5))
    return rows


def _write_json(tmp_path: Path) -> Path:
    p = tmp_path / "json" / "all.json"
    p.parent.mkdir()
    p.write_text(json.dumps({"machine_info": {"cpu": {"brand_raw": "Test CPU", "count": 2}},
                             "datetime": "2026-01-01T00:00:00", "benchmarks": _rows()}))
    return p


def test_report_from_synthetic_json(tmp_path):
    js = _write_json(tmp_path)
    groups, machine = load_rows([js])
    assert set(groups) == set(FIGURES)
    report = write_report([js], tmp_path / "out", {"loadavg": 1.5, "notes": ["a note"]})
    text = report.read_text()
    assert "cpu (test, 2 cores, 2 threads)" in text and "torch 2.x" in text and "a note" in text
    assert "Could not render" not in text and "Not run" not in text
    for png in FIGURES.values():
        f = tmp_path / "out" / png
        assert f.is_file() and f.stat().st_size > 1000, png
        assert f"({png})" in text
    assert "| 10 |" in text and "2x" in text  # a sweep row and its speedup


def test_report_with_missing_experiments(tmp_path):
    p = tmp_path / "one.json"
    p.write_text(json.dumps({"benchmarks": [_rnn("rnn_T", "T", 10)]}))
    text = write_report([p], tmp_path / "out").read_text()
    assert "Not run" in text and (tmp_path / "out" / FIGURES["rnn_T"]).is_file()


def test_parse_args():
    ns, extra = benchrun.parse_args(["--quick", "--out", "d", "--device", "cpu", "--suites", "rnn,vgg", "--",
                                     "--benchmark-compare", "-k", "T"])
    assert ns.quick and ns.out == "d" and ns.device == "cpu" and ns.suites == ["rnn", "vgg"]
    assert extra == ["--benchmark-compare", "-k", "T"]
    ns, extra = benchrun.parse_args([])
    assert not ns.quick and ns.suites == list(benchrun.SUITES) and extra == []
    with pytest.raises(SystemExit):
        benchrun.parse_args(["--suites", "nope"])
    with pytest.raises(SystemExit):
        benchrun.parse_args(["--device", "tpu"])


def test_missing_bench_dir(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="pip install -e"):
        benchrun.find_bench_dir(str(tmp_path))
    assert benchrun.main(["--out", str(tmp_path / "o"), "--bench-dir", str(tmp_path)]) == 2
    assert "benchmark suites not found" in capsys.readouterr().err


def test_report_only(tmp_path):
    _write_json(tmp_path)
    assert benchrun.main(["--report-only", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").is_file() and (tmp_path / FIGURES["vgg_flops"]).is_file()


def test_bench_dir_of_checkout():
    assert (benchrun.find_bench_dir() / "test_paper_rnn.py").is_file()


def test_missing_bench_dependency_is_named_on_screen(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(benchrun.NEEDS, "spscan_no_such_module", "no-such-dist")
    assert benchrun.missing_modules() == ["no-such-dist"]
    assert benchrun.main(["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "no-such-dist" in err and '.[bench]' in err


def test_failed_suite_prints_its_cause(tmp_path, capsys):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / benchrun.SUITES["rnn"]).write_text("import spscan_no_such_module\n\ndef test_x():\n    pass\n")
    rc = benchrun.main(["--out", str(tmp_path / "o"), "--bench-dir", str(bench), "--suites", "rnn"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "rnn" in out and "failed" in out
    assert "No module named 'spscan_no_such_module'" in out  # on screen, not only in the log


def test_bench_extra_lists_what_the_runner_needs():
    tomllib = pytest.importorskip("tomllib")
    root = benchrun.find_bench_dir().parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {req.split(">")[0].split("=")[0].split("<")[0].strip() for req in extras["bench"]}
    assert set(benchrun.NEEDS.values()) <= names
    assert '.[bench]' in (root / "README.md").read_text()
