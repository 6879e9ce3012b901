"""Fit the reference CUDA step profile's layer constants to measured "never slower" rows.

    python bench/gpu/fit_cuda_profile.py ROWS.json [--out planner/data/step-profile-cuda.json]
        [--table bench/results/<device>/profile-fit.md]

A GPU step of the small models people wrap is host-bound: what a layer costs is mostly the launches
and the Python around them, not its work, and a one-layer step's median moves by more than a layer
costs. So a GPU's profile prices every family alike, per regime (``native``: the model's own autograd
step; ``scan``; ``graph``: the whole step from CUDA graphs) one ``base``, one cost per layer and one
per unit of work, fitted to whole models (:func:`spscan.calibration.fit_whole_models`, which
``spscan.calibrate()`` applies on a GPU to its own small models). This script applies it to the
measured rows of a "never slower" run, each model planned here (on the CPU: the units and their work
do not depend on the device), for the shipped reference profile. The recurrent constants are kept
from the profile being replaced, or taken from a GPU's own calibration (``--recurrent-from``: the
whole-step graph of a recurrent module is priced only there). It prints, and writes as a table, the
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
from spscan.calibration import fit_whole_models, layer_features  # noqa: E402

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


def terms(case) -> list[tuple]:
    model, _ = case.build("cpu")
    x, _ = case.data("cpu")
    wrapped = spscan.wrap(model, x, backward="scan")
    return [t for u in wrapped.plan.units for t in u.cost_terms(case.batch)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("--profile", default=str(ROOT / "planner" / "data" / "step-profile-cuda.json"))
    ap.add_argument("--out", default=None, help="write the fitted profile here (default: print only)")
    ap.add_argument("--table", default=None)
    ap.add_argument("--fitted-on", default="")
    ap.add_argument("--recurrent-from", default=None,
                    help="a profile spscan.calibrate() wrote on the GPU (graphs.sh with GRAPHS_CALIBRATE_RECURRENT=1): "
                         "its recurrent constants, every regime's (the whole-step graph's too), replace the kept ones")
    a = ap.parse_args()
    data = json.loads(Path(a.rows).read_text())
    rows = [r for r in data["rows"] if r.get("device") == "cuda" and r.get("ratio")]
    by_name = {c.name: c for c in CASES}
    per_row = []
    for row in rows:
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
    table = "\n".join(lines)
    print(table)
    for r, (base, fixed, per) in coef.items():
        print(f"{r:7s} base {base * 1e6:8.1f} us   per layer {fixed * 1e6:7.2f} us   per work {per * 1e12:8.4f} ps")
    if a.out:
        prof = json.loads(Path(a.profile).read_text())
        prof["base"] = {r: coef[r][0] for r in coef}
        prof["families"] = {f: {r: [coef[r][1], coef[r][2]] for r in coef} for f in prof["families"]}
        if a.recurrent_from:
            prof["recurrent"] = json.loads(Path(a.recurrent_from).read_text())["recurrent"]
        if a.fitted_on:
            prof["fitted_on"] = a.fitted_on
        Path(a.out).write_text(json.dumps(prof, indent=1, sort_keys=True) + "\n")
    if a.table:
        Path(a.table).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
