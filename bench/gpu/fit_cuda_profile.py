"""Fit the reference CUDA step profile's constants to measured "never slower" rows.

    python bench/gpu/fit_cuda_profile.py ROWS.json [ROWS.json ...] [--out planner/data/step-profile-cuda.json]
        [--table bench/results/<device>/profile-fit.md]

A GPU step of the small models people wrap is host-bound: what a layer costs is mostly the launches
and the Python around them, not its work, and a one-layer step's median moves by more than a layer
costs. So a GPU's profile prices every family alike, per regime (``native``: the model's own autograd
step; ``scan``; ``graph``: the whole step from CUDA graphs) one ``base``, one cost per layer and one
per unit of work, fitted to whole models (:func:`spscan.cli.calibration.fit_whole_models`, which
``spscan.calibrate()`` applies on a GPU to its own small models). This script applies it to the
measured rows of "never slower" runs (several files pool their rows: one GPU at several thread counts,
several runs), each model planned here (on the CPU: the units and their work do not depend on the
device), for the shipped reference profile. The recurrent constants are kept from the profile being
replaced, taken from a GPU's own calibration (``--recurrent-from``), or fitted to the recurrent rows
among ROWS (``--recurrent-rows``: :func:`spscan.cli.calibration.fit_recurrent`, each regime's measured
step at the sizes people train, where the calibration's small modules may not reach: an LSTM's
whole-step graph at T = 1000 costs twice what they predict). It prints, and writes as a table, the
prediction against the measurement for every row and regime.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import spscan  # noqa: E402
from never_slower_models import CASES  # noqa: E402
from spscan.cli.calibration import fit_recurrent, fit_whole_models, layer_features  # noqa: E402
from spscan.runtime.choices import recurrent_shapes, sequence_signature  # noqa: E402
from spscan.planner.step_profile import StepProfile, recurrent_features  # noqa: E402

REGIMES = ("native", "scan", "graph")


def measured(row: dict) -> dict[str, float]:
    """The row's measured median step per regime."""
    out = {"native": row["autograd_s"]}
    out[row["choice"]] = row["chosen_s"]
    if row.get("other") and row.get("other_s"):
        out[row["other"]] = row["other_s"]
    for m in row.get("more", []):
        if m.get("measured_s"):
            out[m["name"]] = m["measured_s"]
    return out


def recurrent_shape(case) -> tuple[str, list[tuple[int, int]], int, int]:
    """A recurrent case's cell kind, ``(input, hidden)`` per (layer, direction), length and batch."""
    model, _ = case.build("cpu")
    x, _ = case.data("cpu")
    kind = spscan.wrap(model, x, backward="scan").plan.kind
    return (kind, recurrent_shapes(model), *sequence_signature(model, x))


def terms(case) -> list[tuple]:
    model, _ = case.build("cpu")
    x, _ = case.data("cpu")
    wrapped = spscan.wrap(model, x, backward="scan")
    return [t for u in wrapped.plan.units for t in u.cost_terms(case.batch)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--profile", default=str(ROOT / "planner" / "data" / "step-profile-cuda.json"))
    ap.add_argument("--out", default=None, help="write the fitted profile here (default: print only)")
    ap.add_argument("--table", default=None)
    ap.add_argument("--fitted-on", default="")
    ap.add_argument("--recurrent-from", default=None,
                    help="a profile spscan.calibrate() wrote on the GPU (graphs.sh with GRAPHS_CALIBRATE_RECURRENT=1): "
                         "its recurrent constants, every regime's (the whole-step graph's too), replace the kept ones")
    ap.add_argument("--recurrent-rows", action="store_true",
                    help="fit the recurrent constants to the recurrent rows among ROWS instead")
    a = ap.parse_args()
    rows = [r for f in a.rows for r in json.loads(Path(f).read_text())["rows"]
            if r.get("device") == "cuda" and r.get("ratio")]
    by_name = {c.name: c for c in CASES}
    recurrent_rows = [r for r in rows if by_name[r["model"]].family == "recurrent"]
    per_row = []
    for row in rows:
        if by_name[row["model"]].family == "recurrent":
            continue
        ts = terms(by_name[row["model"]])
        per_row.append((row["model"], ts, measured(row)))
    coef = fit_whole_models([(ts, regime, t) for _, ts, m in per_row for regime, t in m.items()])

    def predict(ts, regime):
        own, nat = layer_features(ts, regime)
        return sum(c * x for c, x in zip(coef[regime], own)) + sum(c * x for c, x in zip(coef["native"], nat))

    lines = ["| model | regime | layers | predicted (ms) | measured (ms) | predicted / measured |",
             "|---|---|---:|---:|---:|---:|"]
    for name, ts, m in per_row:
        for regime in REGIMES:
            if regime not in m or regime not in coef:
                continue
            p = predict(ts, regime)
            lines.append(f"| {name} | {regime} | {len(ts)} | {p * 1e3:.2f} | {m[regime] * 1e3:.2f} | "
                         f"{p / m[regime]:.2f} |")
    recurrent = json.loads(Path(a.recurrent_from).read_text())["recurrent"] if a.recurrent_from else None
    if a.recurrent_rows and recurrent_rows:
        shaped = [(row, recurrent_shape(by_name[row["model"]])) for row in recurrent_rows]

        def features(kind, shapes, T, B):
            return [sum(v) for v in zip(*(recurrent_features(kind, T, B, i, h) for i, h in shapes))]

        fitted = fit_recurrent([(kind.split("_")[0], regime, features(kind, shapes, T, B), t)
                                for row, (kind, shapes, T, B) in shaped for regime, t in measured(row).items()])
        recurrent = {cell: {r: list(v) for r, v in regs.items()} for cell, regs in fitted.items()}
        lines += ["", "| model | regime | predicted (ms) | measured (ms) | predicted / measured |", "|---|---|---:|---:|---:|"]
        check = StepProfile.from_json({**json.loads(Path(a.profile).read_text()), "recurrent": recurrent})
        for row, (kind, shapes, T, B) in shaped:
            for regime, t in measured(row).items():
                p = sum(check.recurrent_time(kind, T, B, i, h, regime) for i, h in shapes)
                lines.append(f"| {row['model']} | {regime} | {p * 1e3:.2f} | {t * 1e3:.2f} | {p / t:.2f} |")
    table = "\n".join(lines)
    print(table)
    for r, (base, fixed, per) in coef.items():
        print(f"{r:7s} base {base * 1e6:8.1f} us   per layer {fixed * 1e6:7.2f} us   per work {per * 1e12:8.4f} ps")
    if a.out:
        prof = json.loads(Path(a.profile).read_text())
        prof["base"] = {r: coef[r][0] for r in coef}
        prof["families"] = {f: {r: [coef[r][1], coef[r][2]] for r in coef} for f in prof["families"]}
        if recurrent is not None:
            prof["recurrent"] = recurrent
        if a.fitted_on:
            prof["fitted_on"] = a.fitted_on
        Path(a.out).write_text(json.dumps(prof, indent=1, sort_keys=True) + "\n")
    if a.table:
        Path(a.table).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
