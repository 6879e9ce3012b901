"""The crossover map's harness (``bench/gpu/crossover.py``) on a CPU: a tiny grid runs end to end, every row
carries its timings, ratio, floor and the cost model's choice with whether it was right, and the JSON and
the heat map are written; a point past the budget is listed as skipped, not dropped silently."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _crossover():
    spec = importlib.util.spec_from_file_location("crossover", ROOT / "bench" / "gpu" / "crossover.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_tiny_grid_runs_end_to_end(tmp_path):
    xo = _crossover()
    assert xo.main(["--out", str(tmp_path), "--device", "cpu", "--cells", "rnn,lstm", "--hidden", "4",
                    "--lengths", "12", "--batches", "1,3", "--rounds", "2"]) == 0
    got = json.loads((tmp_path / "crossover.json").read_text())
    rows = got["rows"]
    assert {(r["cell"], r["B"], r["mode"]) for r in rows} == {(c, b, m) for c in ("rnn", "lstm") for b in (1, 3)
                                                            for m in ("backward", "step")}
    for r in rows:
        assert "error" not in r, r
        assert r["native_ms"] > 0 and r["scan_ms"] > 0 and r["ratio"] == pytest.approx(r["native_ms"] / r["scan_ms"])
        assert r["ratio_q25"] <= r["ratio_q75"] and r["grad_error"] <= 1e-3
        assert r["chosen"] in ("scan", "native") and set(r["predicted_ms"]) >= {"scan", "native"}
        assert isinstance(r["choice_ok"], bool) and 0 < r["fraction_of_floor"]
    summary = got["meta"]["summary"]
    assert summary["timed_rows"] == 8 and summary["skipped_points"] == 0
    assert summary["wrong_choices"] == sum(not r["choice_ok"] for r in rows)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "crossover.png").stat().st_size > 0


def test_points_past_the_budget_are_listed_as_skipped(tmp_path):
    xo = _crossover()
    assert xo.main(["--out", str(tmp_path), "--device", "cpu", "--cells", "gru", "--hidden", "4,6",
                    "--lengths", "8", "--batches", "2", "--modes", "backward", "--rounds", "2",
                    "--budget-s", "0"]) == 0
    got = json.loads((tmp_path / "crossover.json").read_text())
    assert len(got["rows"]) == 1  # the first point starts before any time has passed
    assert got["meta"]["skipped"] == [["gru", 6, 8, 2]] and got["meta"]["summary"]["skipped_points"] == 1


def test_the_headline_shapes_come_first():
    xo = _crossover()
    order = xo.points(["rnn", "gru"], [20, 64], [1000, 30000], [1, 16])
    assert order[:2] == [("rnn", 20, 30000, 16), ("gru", 20, 30000, 16)]
    assert len(order) == len(set(order)) == 16
