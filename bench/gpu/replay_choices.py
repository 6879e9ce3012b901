"""What ``backward="auto"`` would choose on a GPU with a step profile, against the "never slower" rows a GPU
measured: no GPU needed (each model is planned here, on the CPU; its units, work and the profile's
prediction do not depend on the device).

    python bench/gpu/replay_choices.py ROWS.json [ROWS.json ...] [--profile planner/data/step-profile-cuda.json]
        [--out TABLE.md]

A row measured every candidate (autograd, the chosen one and the others forced in the same rounds), so
the choice a profile makes for it has a measured time: the table gives it, the ratio autograd / that
time, and the best measured candidate. A profile ships when its choices lose to none by much.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import spscan  # noqa: E402
from fit_cuda_profile import measured, recurrent_shape  # noqa: E402
from never_slower_models import CASES  # noqa: E402
from spscan.runtime.choices import layers_decision, recurrent_decision  # noqa: E402
from spscan.planner.step_profile import StepProfile  # noqa: E402

CUDA = torch.device("cuda")  # named, never used: the decisions read its type


def decide(case, profile: StepProfile):
    """The decision ``backward="auto"`` makes for ``case`` on a GPU with ``profile``."""
    if case.family == "recurrent":
        kind, shapes, T, B = recurrent_shape(case)
        return recurrent_decision(kind, shapes, T, B, CUDA, "auto", "", profile=profile)
    model, _ = case.build("cpu")
    x, _ = case.data("cpu")
    return layers_decision(spscan.wrap(model, x, backward="scan").plan.units, case.batch, CUDA, "auto", "",
                           profile=profile)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("rows", nargs="+")
    ap.add_argument("--profile", default=str(ROOT / "planner" / "data" / "step-profile-cuda.json"))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    profile = StepProfile.from_json(json.loads(Path(a.profile).read_text()))
    by_name = {c.name: c for c in CASES}
    lines = ["| model | threads | choice | predicted (ms) | measured (ms) | ratio vs autograd | best measured | "
             "choice / best |", "|---|---:|---|---:|---:|---:|---|---:|"]
    ratios, losses = [], []
    for f in a.rows:
        for row in json.loads(Path(f).read_text())["rows"]:
            if row.get("device") != "cuda" or not row.get("ratio"):
                continue
            m = measured(row)
            d = decide(by_name[row["model"]], profile)
            name = d.chosen.name
            best = min(m, key=m.get)
            got = m.get(name)
            if got is None:  # the row did not time this candidate
                lines.append(f"| {row['model']} | {row['threads_label']} | {name} | "
                             f"{d.chosen.predicted_s * 1e3:.2f} | - | - | {best} | - |")
                continue
            ratios.append(row["autograd_s"] / got)
            losses.append(got / m[best])
            lines.append(f"| {row['model']} | {row['threads_label']} | {name} | {d.chosen.predicted_s * 1e3:.2f} | "
                         f"{got * 1e3:.2f} | {ratios[-1]:.2f} | {best} ({m[best] * 1e3:.2f}) | {losses[-1]:.2f} |")
    gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")
    lines.append("")
    lines.append(f"{len(ratios)} rows: ratio vs autograd >= 0.97 in {sum(r >= 0.97 for r in ratios)} "
                 f"(geometric mean {gm:.2f}, lowest {min(ratios, default=float('nan')):.2f}); the choice within "
                 f"10% of the best measured in {sum(v <= 1.1 for v in losses)}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(f"Choices of `{Path(a.profile).name}` replayed against measured rows "
                               f"(`python bench/gpu/replay_choices.py`)\n\n{text}\n")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
