"""Fit the reference CUDA step profile's layer constants to measured "never slower" rows.

    python bench/gpu/fit_cuda_profile.py ROWS.json [--out planner/data/step-profile-cuda.json]
        [--table bench/results/<device>/profile-fit.md]

A GPU step of the small models people wrap is host-bound: what a layer costs is mostly the launches
and the Python around them, not its work. ``spscan.calibrate()`` fits each family from one-layer
models, and on a GPU those steps are too short to tell the families apart (their medians move by
more than a layer costs). This fit uses whole models instead: for each regime (``native``: the
model's own autograd step; ``scan``; ``graph``: the whole step replayed from CUDA graphs) it fits
one ``base``, one fixed cost per layer and one cost per unit of work, the same for every family
(non-negative least squares in relative error), on the rows' measured medians, each model planned
here (on the CPU: the units and their work do not depend on the device). The recurrent constants
are kept from the profile being replaced. It prints, and writes as a table, the prediction against
the measurement for every row and regime.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import nnls

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import spscan  # noqa: E402
from never_slower_models import CASES  # noqa: E402

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


def features(ts: list[tuple], regime: str) -> tuple[list[float], list[float]]:
    """``[1, layers, work]`` of the terms the regime's constants price, and ``[0, layers, work]`` of those
    priced as ``native`` in every regime (an opaque node's own operations), which the native fit prices."""
    own = [t for t in ts if len(t) < 3 or t[2] == regime]
    native = [t for t in ts if len(t) >= 3 and t[2] == "native" and regime != "native"]
    return ([1.0, float(len(own)), float(sum(t[1] for t in own))],
            [0.0, float(len(native)), float(sum(t[1] for t in native))])


def fit(rows: list[tuple[list[float], float]]) -> list[float]:
    a = np.asarray([r[0] for r in rows], dtype=np.float64)
    t = np.asarray([r[1] for r in rows], dtype=np.float64)
    w = 1.0 / t
    coef, _ = nnls(a * w[:, None], t * w)
    return [float(c) for c in coef]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("--profile", default=str(ROOT / "planner" / "data" / "step-profile-cuda.json"))
    ap.add_argument("--out", default=None, help="write the fitted profile here (default: print only)")
    ap.add_argument("--table", default=None)
    ap.add_argument("--fitted-on", default="")
    a = ap.parse_args()
    data = json.loads(Path(a.rows).read_text())
    rows = [r for r in data["rows"] if r.get("device") == "cuda" and r.get("ratio")]
    by_name = {c.name: c for c in CASES}
    per_row = []
    for row in rows:
        ts = terms(by_name[row["model"]])
        per_row.append((row["model"], ts, measured(row)))
    coef: dict[str, list[float]] = {}
    for regime in REGIMES:  # native first: the other regimes' native-priced terms are priced by its fit
        samples = []
        for _, ts, m in per_row:
            if regime in m:
                own, nat = features(ts, regime)
                fixed = sum(c * x for c, x in zip(coef.get("native", [0.0] * 3), nat))
                samples.append((own, m[regime] - fixed))
        if samples:
            coef[regime] = fit(samples)

    def predict(ts, regime):
        own, nat = features(ts, regime)
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
        if a.fitted_on:
            prof["fitted_on"] = a.fitted_on
        Path(a.out).write_text(json.dumps(prof, indent=1, sort_keys=True) + "\n")
    if a.table:
        Path(a.table).write_text(table + "\n")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
