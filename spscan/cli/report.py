"""Markdown report and figures from the pytest-benchmark JSON of the paper-reproduction suites.

``write_report(json_paths, out_dir)`` reads one or more ``--benchmark-json`` files, groups the
rows by ``extra_info["experiment"]`` (Table 1 rows by their test name), and writes
``report.md`` plus one PNG per figure into ``out_dir``. Only what the JSON holds is reported:
every ratio is between medians measured in the same run on the same device.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from spscan.planner.choose import format_seconds

__all__ = ["FIGURES", "load_rows", "step_flops_scatter", "write_report"]

#: figure file names, by experiment
FIGURES = {
    "rnn_T": "rnn_sweep_T.png",
    "rnn_B": "rnn_sweep_B.png",
    "rnn_training": "rnn_training_curves.png",
    "gru": "gru.png",
    "vgg_flops": "vgg11_flops.png",
    "table1": "table1.png",
    "spgemm": "spgemm.png",
    "convergence": "convergence.png",
}


def _experiment(row: dict) -> Optional[str]:
    info = row.get("extra_info", {})
    if "experiment" in info:
        return info["experiment"]
    if "table1" in row.get("fullname", "") or "table1" in row.get("name", ""):
        return "table1"
    return None


def load_rows(json_paths: Iterable[Path]) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """Rows per experiment (each a pytest-benchmark row with ``median`` added) and the first file's machine info."""
    groups: dict[str, list[dict]] = defaultdict(list)
    machine: dict[str, Any] = {}
    for p in json_paths:
        data = json.loads(Path(p).read_text())
        machine = machine or dict(data.get("machine_info", {}), datetime=data.get("datetime"))
        for row in data.get("benchmarks", []):
            exp = _experiment(row)
            if exp is None:
                continue
            row = dict(row)
            row["median"] = row.get("stats", {}).get("median", float("nan"))
            groups[exp].append(row)
    return groups, machine


# ------------------------------------------------------------------ formatting

def _t(s: Optional[float]) -> str:
    """Seconds in a readable unit (``n/a`` when unknown)."""
    text = format_seconds(s)
    return "n/a" if text == "-" else text


def _x(r: Optional[float]) -> str:
    """A ratio as ``1.23x``."""
    if r is None or (isinstance(r, float) and (math.isnan(r) or math.isinf(r))):
        return "n/a"
    return f"{r:.3g}x"


def _n(v: Optional[float]) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3g}" if isinstance(v, float) else f"{v:,}"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    _plt().close(fig)
    return name


# ------------------------------------------------------------------ sections

def _rnn_sweep(rows: list[dict], key: str, out: Path, name: str, title: str) -> str:
    rows = sorted(rows, key=lambda r: r["extra_info"][key])
    e = [r["extra_info"] for r in rows]
    lines = [_table(
        [key, "autograd fwd", "autograd bwd", "spscan fwd", "spscan bwd (median)", "levels", "backward speedup",
         "overall speedup"],
        [[i[key], _t(i["autograd_forward_s"]), _t(i["autograd_backward_s"]), _t(i["spscan_forward_s"]),
          _t(r["median"]), i.get("levels"), _x(i["backward_speedup"]), _x(i["overall_speedup"])]
         for r, i in zip(rows, e)])]
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [i[key] if key == "T" else 1.0 / i[key] for i in e]
    a1.plot(xs, [i["autograd_backward_s"] for i in e], "o-", color="tab:red", label="autograd backward")
    a1.plot(xs, [r["median"] for r in rows], "o-", color="tab:blue", label="spscan backward")
    a1.set_xscale("log")
    a1.set_yscale("log")
    a1.set_ylabel("backward latency per iteration (s)")
    a2.plot(xs, [i["backward_speedup"] for i in e], "o-", label="backward speedup")
    a2.plot(xs, [i["overall_speedup"] for i in e], "s--", label="overall speedup")
    a2.axhline(1.0, color="gray", lw=0.8)
    a2.set_xscale("log")
    a2.set_ylabel("speedup vs autograd (x)")
    for a in (a1, a2):
        a.set_xlabel("sequence length T" if key == "T" else "1 / batch size")
        a.grid(alpha=0.3)
        a.legend()
    fig.suptitle(title)
    lines.append(f"\n![{title}]({_save(fig, out, name)})")
    return "\n".join(lines)


def _rnn_training(rows: list[dict], out: Path) -> str:
    i = rows[0]["extra_info"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(i["spscan_wall_s"], i["spscan_loss"], color="tab:blue", label="BPPSA (spscan)")
    ax.plot(i["autograd_wall_s"], i["autograd_loss"], color="tab:red", label="autograd")
    ax.set_xlabel("training wall-clock time (s)")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Bitstream RNN training, T={i.get('seq_len')}, B={i.get('batch_size')}")
    body = _table(["T", "samples", "epochs", "B", "autograd backward", "spscan backward", "backward speedup",
                   "overall speedup", "last-step loss autograd", "last-step loss spscan"],
                  [[i.get("seq_len"), i.get("samples"), i.get("epochs"), i.get("batch_size"),
                    _t(i.get("autograd_backward_s")), _t(i.get("bppsa_backward_s")), _x(i.get("backward_speedup")),
                    _x(i.get("overall_speedup")), _n(i.get("last_step_loss_autograd", i.get("final_loss_autograd"))),
                    _n(i.get("last_step_loss_bppsa", i.get("final_loss_bppsa")))]])
    return body + "\n\nSums over all steps but the first (Adam, learning rate of `spscan.cli.demo`).\n\n" \
        f"![training curves]({_save(fig, out, FIGURES['rnn_training'])})"


def _gru(rows: list[dict], out: Path) -> str:
    order = {"S": 0, "M": 1, "L": 2}
    rows = sorted(rows, key=lambda r: (order.get(r["extra_info"]["set"], 9), r["extra_info"]["B"]))
    e = [r["extra_info"] for r in rows]
    table = _table(
        ["set (FxC)", "B", "autograd fwd", "autograd bwd", "spscan fwd", "Jacobian fill", "spscan bwd", "levels",
         "bwd / autograd total", "backward speedup", "overall speedup"],
        [[f"{i['set']} ({i['frames']}x{i['coeffs']})", i["B"], _t(i["autograd_forward_s"]), _t(i["autograd_backward_s"]),
          _t(i["spscan_forward_s"]), _t(i["spscan_fill_s"]), _t(r["median"]), i.get("levels"),
          f"{i['norm_spscan_backward']:.3f}", _x(i["backward_speedup"]), _x(i["overall_speedup"])] for r, i in zip(rows, e)])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(e)), 4))
    labels, pos = [], []
    for k, i in enumerate(e):
        x0 = 3 * k
        ax.bar(x0, i["norm_autograd_forward"], color="tab:gray", label="forward" if k == 0 else None)
        ax.bar(x0, i["norm_autograd_backward"], bottom=i["norm_autograd_forward"], color="tab:red",
               label="autograd backward" if k == 0 else None)
        ax.bar(x0 + 1, i["norm_spscan_forward"], color="tab:gray")
        ax.bar(x0 + 1, i["norm_spscan_fill"], bottom=i["norm_spscan_forward"], color="tab:orange",
               label="Jacobian fill (overhead)" if k == 0 else None)
        ax.bar(x0 + 1, i["norm_spscan_backward"], bottom=i["norm_spscan_forward"] + i["norm_spscan_fill"],
               color="tab:blue", label="spscan backward" if k == 0 else None)
        labels += [f"{i['set']} B{i['B']}\nautograd", "spscan"]
        pos += [x0, x0 + 1]
    ax.set_xticks(pos, labels, fontsize=7)
    ax.set_ylabel("time / autograd (forward + backward)")
    ax.set_title("GRU on IRMAS-shaped data (Figure 9)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return table + f"\n\n![GRU]({_save(fig, out, FIGURES['gru'])})"


def _vgg(rows: list[dict], out: Path) -> str:
    rows = sorted(rows, key=lambda r: r["extra_info"]["choice"] != "paper")
    e = [r["extra_info"] for r in rows]
    table = _table(
        ["choice", "levels (max)", "channels", "plan time", "symbolic walk", "total FLOP", "critical-path FLOP",
         "largest step FLOP", "largest BP operator FLOP", "BP total FLOP", "backward (B=1)", "linear scan (B=1)",
         "vs linear scan"],
        [[i["choice"], f"{i['levels']} ({i['max_levels']})", f"1/{i['channel_divisor']}", _t(i.get("plan_s")),
          _t(i.get("symbolic_walk_s")), _n(i["total_flops"]), _n(i["critical_path_flops"]), _n(i["max_step_flops"]),
          _n(i["max_baseline_flops"]), _n(i["baseline_total_flops"]),
          _t((i.get("timing") or {}).get("backward_s")) if i.get("backward_timed") else "not timed",
          _t((i.get("timing") or {}).get("linear_s")) if i.get("backward_timed") else "",
          _x(i.get("backward_ratio_vs_linear"))]
         for i in e])
    notes = []
    for i in e:
        if i.get("planner_refused"):
            notes.append(f"* `{i['choice']}`: the planner refused this depth ({i['planner_refused']}); its FLOPs "
                         "come from the pattern-only symbolic walk and no backward was timed.")
        if i["choice"] == "auto" and i.get("planner_candidates_s"):
            c = ", ".join(f"K={k}: {_t(v)}" for k, v in i["planner_candidates_s"].items())
            notes.append(f"* planner's estimated critical-path time per depth: {c} "
                         f"(levels explored: {i.get('planner_explored_levels')}).")
    plt = _plt()
    fig, axes = plt.subplots(1, len(e), figsize=(6 * len(e), 4.6), squeeze=False)
    for ax, i in zip(axes[0], e):
        step_flops_scatter(ax, i["steps"], i["baseline_ops"], "FLOP with CSR (per sample)")
        ax.set_title(f"{i['choice']}: levels={i['levels']}, channels/{i['channel_divisor']}")
    fig.suptitle(f"Pruned VGG-11 ({100 * e[0]['prune_amount']:.0f}% conv weights pruned): FLOP per scan step (Figure 10)")
    return table + "\n\n" + "\n".join(notes) + f"\n\n![VGG-11 FLOPs]({_save(fig, out, FIGURES['vgg_flops'])})"


#: Figure 10's marks: a scan step by its kind (``mv``/``mm``) and whether it is on the critical path
_STEP_STYLES = {("mv", True): ("tab:orange", "o", "mv (critical)"), ("mv", False): ("moccasin", "o", "mv"),
                ("mm", True): ("tab:blue", "s", "mm (critical)"), ("mm", False): ("lightsteelblue", "s", "mm")}


def step_flops_scatter(ax, steps: list[dict], baseline_ops: list[dict], ylabel: str) -> None:
    """Figure 10 on ``ax``: each scan step's FLOP (``steps``: dicts with ``kind``, ``critical``, ``flops``,
    ``dense_flops``) and each backpropagation operator's (``baseline_ops``) against the FLOP the product
    would take with dense transposed Jacobians, log-log. A step of 0 FLOP is drawn at 1."""
    for (kind, crit), (color, marker, label) in _STEP_STYLES.items():
        pts = [s for s in steps if s["kind"] == kind and bool(s["critical"]) == crit]
        if pts:
            ax.scatter([p["dense_flops"] for p in pts], [max(p["flops"], 1) for p in pts], c=color, marker=marker,
                       edgecolors="k", linewidths=0.4, label=label, s=36)
    ax.scatter([b["dense_flops"] for b in baseline_ops], [b["flops"] for b in baseline_ops], facecolors="none",
               edgecolors="tab:green", s=90, linewidths=1.4, label="BP gradient operator")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("FLOP if the transposed Jacobians were dense")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _table1(rows: list[dict], out: Path) -> str:
    order = {"conv": 0, "relu": 1, "maxpool": 2}
    rows = sorted(rows, key=lambda r: order.get(r["extra_info"].get("operator"), 9))
    e = [r["extra_info"] for r in rows]
    table = _table(
        ["operator", "J^T shape", "sparsity", "analytic values (median)", "pattern once", "autograd column-at-a-time",
         "speedup", "speedup incl. pattern", "paper"],
        [[i.get("operator"), "x".join(map(str, i.get("jacobian_T_shape", []))), f"{i.get('sparsity', float('nan')):.6f}",
          _t(r["median"]), _t(i.get("pattern_once_s")), _t(i.get("baseline_s_extrapolated")),
          _x(i.get("speedup_values")), _x(i.get("speedup_pattern_and_values")), _x(i.get("paper_speedup"))]
         for r, i in zip(rows, e)])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ops = [i.get("operator") for i in e]
    xs = range(len(ops))
    ax.bar([x - 0.2 for x in xs], [i.get("speedup_values", 0) for i in e], 0.4, label="spscan (this run)")
    ax.bar([x + 0.2 for x in xs], [i.get("paper_speedup", 0) for i in e], 0.4, label="paper (Threadripper 1950X)",
           color="tab:gray")
    ax.set_xticks(list(xs), ops)
    ax.set_yscale("log")
    ax.set_ylabel("speedup vs autograd column-at-a-time")
    ax.set_title("Table 1: analytic transposed-Jacobian generation")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    note = (f"\n\nThe baseline is timed on {e[0].get('baseline_columns_timed')} columns and extrapolated linearly "
            "to all columns (bench/test_table1.py).") if e else ""
    return table + note + f"\n\n![Table 1]({_save(fig, out, FIGURES['table1'])})"


def _spgemm(rows: list[dict], out: Path) -> str:
    rows = sorted(rows, key=lambda r: r["extra_info"]["index"])
    e = [r["extra_info"] for r in rows]
    table = _table(
        ["product", "shape", "pairs", "nnz C", "planned numeric", "torch.sparse CSR@CSR", "SciPy", "vs torch.sparse",
         "vs SciPy", "planned GB/s", "copy GB/s", "symbolic once"],
        [[i["product"], f"{i['a_shape'][0]}x{i['a_shape'][1]} @ {i['b_shape'][0]}x{i['b_shape'][1]}", _n(i["pairs"]),
          _n(i["nnz_c"]), _t(r["median"]), _t(i["torch_sparse_s"]), _t(i["scipy_s"]), _x(i["speedup_vs_torch_sparse"]),
          _x(i["speedup_vs_scipy"]), f"{i['planned_gbs']:.3g}", f"{i['copy_gbs']:.3g}", _t(i["symbolic_once_s"])]
         for r, i in zip(rows, e)])
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = list(range(len(e)))
    for off, key, label in ((-0.27, None, "planned (numeric only)"), (0.0, "torch_sparse_s", "torch.sparse"),
                            (0.27, "scipy_s", "SciPy")):
        ys = [r["median"] if key is None else r["extra_info"][key] for r in rows]
        a1.bar([x + off for x in xs], ys, 0.27, label=label)
    a1.set_yscale("log")
    a1.set_ylabel("seconds per product")
    a1.set_xticks(xs, [i["product"] for i in e], rotation=30, ha="right", fontsize=7)
    a1.legend(fontsize=8)
    a2.bar([x - 0.2 for x in xs], [i["planned_gbs"] for i in e], 0.4, label="planned product")
    a2.bar([x + 0.2 for x in xs], [i["copy_gbs"] for i in e], 0.4, label="torch.clone (copy)", color="tab:gray")
    a2.set_ylabel("GB/s")
    a2.set_xticks(xs, [i["product"] for i in e], rotation=30, ha="right", fontsize=7)
    a2.legend(fontsize=8)
    for a in (a1, a2):
        a.grid(axis="y", alpha=0.3)
    fig.suptitle("SpGEMM on pruned VGG-11 transposed-Jacobian products")
    return table + f"\n\n![SpGEMM]({_save(fig, out, FIGURES['spgemm'])})"


def _convergence(rows: list[dict], out: Path) -> str:
    i = rows[0]["extra_info"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(i["autograd_loss"], color="tab:red", lw=2.5, alpha=0.6, label="autograd")
    ax.plot(i["spscan_loss"], color="tab:blue", lw=1.0, label="BPPSA (spscan.wrap)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss")
    ax.set_title(f"LeNet-5, SGD lr 0.001 momentum 0.9, B={i['batch']}")
    ax.grid(alpha=0.3)
    ax.legend()
    body = _table(["data", "B", "iterations", "levels", "max abs loss difference", "final loss autograd",
                   "final loss spscan", "autograd train time", "spscan train time"],
                  [[i["data"], i["batch"], i["iterations"], i.get("levels"), f"{i['max_abs_loss_diff']:.3g}",
                    _n(i["final_loss_autograd"]), _n(i["final_loss_spscan"]), _t(i["autograd_train_s"]),
                    _t(rows[0]["median"])]])
    return body + f"\n\n![convergence]({_save(fig, out, FIGURES['convergence'])})"


SECTIONS = [
    ("rnn_T", "RNN sensitivity to the sequence length (Figure 8a, Table 4)",
     lambda rows, out: _rnn_sweep(rows, "T", out, FIGURES["rnn_T"], "Bitstream RNN, B = 16: backward and speedup vs T")),
    ("rnn_B", "RNN sensitivity to the batch size (Figure 8b, Table 5)",
     lambda rows, out: _rnn_sweep(rows, "B", out, FIGURES["rnn_B"], "Bitstream RNN, T = 1000: backward and speedup vs 1/B")),
    ("rnn_training", "RNN training curves (Figure 7)", _rnn_training),
    ("gru", "GRU on IRMAS-shaped data (Figure 9, Table 6)", _gru),
    ("vgg_flops", "Pruned VGG-11: FLOP per scan step (Figure 10)", _vgg),
    ("table1", "Analytic transposed-Jacobian generation (Table 1)", _table1),
    ("spgemm", "Planned numeric SpGEMM vs full SpGEMM", _spgemm),
    ("convergence", "Convergence: LeNet-5 through spscan vs autograd (section 3.5)", _convergence),
]

INTRO = {
    "rnn_T": "`nn.RNN(1, 20)` + Linear head, cross-entropy on the bitstream task (eq. 8); the backward goes "
             "through `spscan.wrap`. Speedup = autograd median / spscan median (overall: forward + backward).",
    "rnn_B": "Same model at T = 1000 over the batch size.",
    "rnn_training": "A short side-by-side run of `spscan.cli.demo.train_side_by_side` (same seed, same batches).",
    "gru": "`nn.GRU(C, 20)` + Linear head on synthetic data with IRMAS' shapes (`spscan.cli.datasets.synthetic_irmas`). "
           "spscan fwd = the module's own forward; fill = `RecurrentPlan.forward` (the forward that also writes the "
           "transposed-Jacobian values) minus that, 0 where the compiled one-pass forward is the faster of the two; "
           "the overall speedup counts `RecurrentPlan.forward` and the backward.",
    "vgg_flops": "VGG-11's conv+ReLU+max-pool chain on 32x32 inputs (21 transposed Jacobians), 97% of each conv "
                 "weight pruned by magnitude (`torch.nn.utils.prune.l1_unstructured` of a briefly trained model; "
                 "pruned weights leave the patterns via `prune_zeros=True`). mm node FLOP = 2 x planned pairs; "
                 "mv node FLOP = 2 x nnz. *critical*: the largest node of each step (every node of the linear-scan "
                 "middle). The BP baseline's gradient operators are the linear scan's SpMVs (`levels=0`). "
                 "`paper` = the paper's depth, `levels=2` (two product levels; Figure 3's L0 is the input row); "
                 "`auto` = the planner's depth. Backward: `spscan.backward` at batch 1, float64, interleaved with the "
                 "linear scan in the same run. Both conventions, every depth: `vgg11_study.md`.",
    "table1": "VGG-11's first conv (3->64, 3x3), its ReLU and its 2x2 max-pool on one 32x32 image, from "
              "bench/test_table1.py.",
    "spgemm": "The first up-sweep level's products of the pruned VGG-11 chain, one matrix each (values shared). "
              "Planned = numeric half only over pair lists computed once (`PlannedProduct`); torch.sparse and SciPy "
              "redo the symbolic half every call. Planned bytes = pairs x (2 x 8 B index + 2 x 4 B value) + "
              "nnz(C) x 4 B; copy GB/s counts read + write of a `torch.clone` of the same size.",
    "convergence": "LeNet-5 trained through `spscan.wrap` and through autograd from one seed with the same batches.",
}


def _header(groups: dict[str, list[dict]], machine: dict[str, Any], meta: dict[str, Any]) -> str:
    first = next((r["extra_info"] for rows in groups.values() for r in rows if "torch" in r["extra_info"]), {})
    device = first.get("device") or meta.get("device") or "unknown"
    vers = {k: first.get(k) or meta.get(k) for k in ("torch", "triton", "python", "spscan")}
    quick = first.get("quick", meta.get("quick"))
    lines = [
        "# spscan: paper benchmarks",
        "",
        f"* device: **{device}**",
        f"* versions: torch {vers['torch']}, triton {vers['triton']}, python {vers['python']}, spscan {vers['spscan']}",
        f"* sizes: {'quick (small sizes)' if quick else 'paper sizes (where listed below)'}",
        f"* date: {machine.get('datetime', meta.get('date', 'n/a'))}",
    ]
    cpu = machine.get("cpu", {})
    if isinstance(cpu, dict) and cpu.get("brand_raw"):
        lines.append(f"* host CPU: {cpu['brand_raw']} ({cpu.get('count', '?')} logical cores)")
    if meta.get("loadavg") is not None:
        lines.append(f"* 1-minute load average when the run started: {meta['loadavg']:.2f} "
                     "(timings on a shared, loaded machine are noisy)")
    for note in meta.get("notes", []):
        lines.append(f"* {note}")
    if meta.get("suites"):
        lines += ["", _table(["suite", "status", "wall time"],
                             [[s["name"], s["status"], _t(s.get("seconds"))] for s in meta["suites"]])]
    lines += ["", "Medians are pytest-benchmark's (or, for baselines, the median of the same number of rounds "
              "timed in the same test); every ratio compares medians measured in the same run on the same device."]
    return "\n".join(lines)


def write_report(json_paths: Sequence[Path], out_dir: Path, meta: Optional[dict[str, Any]] = None) -> Path:
    """Write ``report.md`` and the figures of every experiment present in ``json_paths``; return the report path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    meta.setdefault("python", platform.python_version() if sys.version else None)
    groups, machine = load_rows(json_paths)
    parts = [_header(groups, machine, meta)]
    for key, title, render in SECTIONS:
        rows = groups.get(key)
        parts.append(f"\n## {title}\n")
        if not rows:
            parts.append("_Not run (no rows in the benchmark JSON)._")
            continue
        parts.append(INTRO[key] + "\n")
        try:
            parts.append(render(rows, out))
        except (KeyError, TypeError, ValueError, IndexError) as e:  # a malformed row must not lose the report
            parts.append(f"_Could not render this section: {type(e).__name__}: {e}_")
    path = out / "report.md"
    path.write_text("\n".join(parts) + "\n")
    return path
