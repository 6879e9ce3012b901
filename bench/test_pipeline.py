"""Model-parallel schedules side by side: simulated for p = 2..64, measured for p <= 4 (Gloo CPU).

Writes into ``SPSCAN_PIPELINE_RESULTS`` (default ``bench/results/cpu-2core/pipeline``):

* ``simulated.md/.json`` — step time, bubble, peak activations, staleness, exactness per schedule
  and p, from :mod:`spscan.pipeline.simulator` with unit layer costs;
* ``timelines_*.png`` — the papers' unit-time examples and every schedule at p = 4;
* ``convergence.md/.png`` — exact vs stale (PipeDream) vs stale + SpecTrain training;
* ``measured.md/.json`` — torch.distributed.pipelining schedules and spscan's scan on one MLP,
  p = 2 (and p = 4, oversubscribed), interleaved in one set of processes, with the simulator's
  calibrated predictions;
* ``README.md`` — all of the above in one page.

Run: ``python -m pytest -q bench/test_pipeline.py --benchmark-disable`` (a few minutes on 2 cores).
"""

from __future__ import annotations

import json
import math
import os
import platform
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from spscan.pipeline import simulator as S
from spscan.pipeline.draw import draw_timelines

OUT = Path(os.environ.get("SPSCAN_PIPELINE_RESULTS", Path(__file__).parent / "results" / "cpu-2core" / "pipeline"))
SIM_P = (2, 4, 8, 16, 32, 64)
N_LAYERS = 128
MB_ROWS = 8  # samples per micro-batch in the unit-cost model


def _device() -> str:
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared)"


def _write(name: str, text: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(text)


def _chain(kind: str, n: int, d: int = 32) -> list:
    """Unit-cost chains for the scan: ``diagonal`` (elementwise layers; composites stay diagonal) or
    ``banded`` (tridiagonal J^T, conv-like; composites fill in up to dense)."""
    if kind == "diagonal":
        a = sp.csr_array(sp.eye(d, format="csr"))
    else:
        a = sp.csr_array(sp.diags([1.0, 1.0, 1.0], [-1, 0, 1], shape=(d, d), format="csr"))
    a.sort_indices()
    return [a] * n


def _simulate_all(p: int, m: int, chain: str) -> list[S.Timeline]:
    import spscan.distributed as D

    costs = S.LayerCosts.uniform(N_LAYERS)
    tls = [S.gpipe(costs, p, m), S.one_f_one_b(costs, p, m), S.zero_bubble(costs, p, m),
           S.ooo_pipe(costs, p, m), S.ooo_pipe(costs, p, m, modulo=True), S.pipedream(costs, p, m),
           S.dualpipe(costs, p, m), S.dualpipe(costs, p, m, spectrain=True)]
    pats = _chain(chain, N_LAYERS)
    dplan = D.plan(pats, p, slices=S.contiguous_bounds(costs, p))
    # one unit of I is one micro-batch's SpMV over a layer: nnz * rows multiply pairs
    pair_time = 1.0 / (pats[0].nnz * MB_ROWS)
    tls.append(S.bppsa_scan(dplan, pats, costs, m, batch=m * MB_ROWS, pair_time=pair_time))
    tls[-1].schedule = f"BPPSA scan ({chain})"
    return tls


def test_simulated_comparison(benchmark):
    rows = []

    def sweep():
        rows.clear()
        for chain in ("diagonal", "banded"):
            for m_rule in ("2p", "1"):
                for p in SIM_P:
                    m = 2 * p if m_rule == "2p" else 1
                    tls = _simulate_all(p, m, chain)
                    base = tls[0].step_time
                    for tl in tls:
                        if chain == "banded" and not tl.schedule.startswith("BPPSA"):
                            continue  # the pipelines do not depend on the Jacobians' structure
                        rows.append({**tl.summary(), "m_rule": m_rule, "chain": chain,
                                     "speedup_vs_gpipe": base / tl.step_time})

    benchmark.pedantic(sweep, rounds=1, iterations=1)
    benchmark.extra_info.update({"device": _device(), "cases": len(rows)})
    # sanity: the scan is exact and fresh, the asynchronous pipelines are not
    assert all(r["exact"] and r["max_staleness"] == 0 for r in rows if r["schedule"].startswith("BPPSA"))
    assert all(not r["exact"] for r in rows if r["schedule"].startswith(("PipeDream", "DualPipe")))
    _write("simulated.json", json.dumps(rows, indent=1))

    def pivot(m_rule: str, title: str) -> list[str]:
        sel = [r for r in rows if r["m_rule"] == m_rule]
        names = list(dict.fromkeys(r["schedule"] for r in sel))
        out = [title, "", "| schedule | " + " | ".join(f"p={p}" for p in SIM_P) + " |",
               "|---|" + "---:|" * len(SIM_P)]
        for n in names:
            cells = {r["p"]: r for r in sel if r["schedule"] == n}
            out.append(f"| {n} | " + " | ".join(f"{cells[p]['speedup_vs_gpipe']:.2f}x" for p in SIM_P) + " |")
        return out + [""]

    lines = [f"Unit costs: {N_LAYERS} layers, F = I = W = 1 per layer per micro-batch, no link cost. "
             "Asynchronous schedules (PipeDream, DualPipe) report their steady-state time per m micro-batches. "
             "The scan reduces each slice to a composite and runs ceil(log2 p) rounds over the whole batch "
             f"(m x {MB_ROWS} rows, per-sample values): 'diagonal' Jacobians keep composites diagonal, 'banded' "
             "(tridiagonal 32 x 32) ones fill in.", ""]
    lines += pivot("2p", "**Step time of GPipe / step time of the schedule, m = 2p micro-batches** (higher is faster)")
    lines += pivot("1", "**The same with m = 1 (no micro-batching: the regime of one long chain per step)**")
    sel = [r for r in rows if r["m_rule"] == "2p" and r["p"] == 8]
    lines += ["**p = 8, m = 16: bubble, memory, staleness**", "",
              "| schedule | step time | bubble | peak activations / device (layer x micro-batch) | "
              "max staleness (updates) | exact gradients |", "|---|---:|---:|---:|---:|:---:|"]
    for r in sel:
        lines.append(f"| {r['schedule']} | {r['step_time']:.0f} | {r['bubble']:.0%} | {r['peak_activations']:.0f} | "
                     f"{r['max_staleness']} | {'yes' if r['exact'] else 'no'} |")
    _write("simulated.md", "\n".join(lines) + "\n")


def test_timelines(benchmark):
    def draw():
        u16 = S.LayerCosts.uniform(16)
        draw_timelines([S.gpipe(u16, 4, 4), S.ooo_pipe(u16, 4, 4), S.ooo_pipe(u16, 4, 4, modulo=True)],
                       str(OUT / "timelines_ooo_ffnn16.png"),
                       title="Out-of-order backprop paper, 16-layer FFNN, 4 devices, 4 micro-batches, unit costs "
                             "(83 / 68 / 51 units: 1.22x, 1.62x)")
        u4 = S.LayerCosts.uniform(4, 1.0, 0.0, 1.0)
        draw_timelines([S.pipedream(u4, 4, 4), S.dualpipe(u4, 4, 4, overlap=1.0, last_stage_sequential=False,
                                                          spectrain=True)],
                       str(OUT / "timelines_pipedream_dualpipe.png"), until=24,
                       title="Weight-prediction paper, Fig. 6: PipeDream (one task per unit) vs DualPipe "
                             "(one forward and one backward per unit), 4 GPUs")
        import spscan.distributed as D

        c = S.LayerCosts.uniform(16)
        pats = _chain("diagonal", 16)
        dplan = D.plan(pats, 4, slices=[0, 4, 8, 12, 16])
        tls = [S.gpipe(c, 4, 8), S.one_f_one_b(c, 4, 8), S.zero_bubble(c, 4, 8),
               S.torch_schedule("ZBVZeroBubble", c, 4, 8, stages_per_rank=2),
               S.torch_schedule("DualPipeV", c, 4, 8, stages_per_rank=2),
               S.bppsa_scan(dplan, pats, c, 8, batch=8 * MB_ROWS, pair_time=1.0 / (pats[0].nnz * MB_ROWS))]
        draw_timelines(tls, str(OUT / "timelines_p4.png"),
                       title="16 layers, p = 4, m = 8, unit costs: pipelines and spscan's scan (diagonal chain)")
        return tls

    tls = benchmark.pedantic(draw, rounds=1, iterations=1)
    for name in ("timelines_ooo_ffnn16.png", "timelines_pipedream_dualpipe.png", "timelines_p4.png"):
        assert (OUT / name).stat().st_size > 10_000
    benchmark.extra_info.update({"device": _device(), "p4_steps": {t.schedule: t.step_time for t in tls}})


def _make_stages(seed: int, p: int, width: int = 64, din: int = 32, classes: int = 10):
    torch.manual_seed(seed)
    stages = []
    for k in range(p):
        mods = [torch.nn.Linear(din if k == 0 else width, width), torch.nn.Tanh()]
        if k == p - 1:
            mods.append(torch.nn.Linear(width, classes))
        stages.append(torch.nn.Sequential(*mods))
    return stages


def _clusters(seed: int, n: int = 20000, din: int = 32, classes: int = 10, noise: float = 2.0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, din, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    return centers[y] + noise * torch.randn(n, din, generator=g), y


def test_convergence(benchmark):
    from spscan.pipeline.spectrain import pipedream_staleness, train_pipelined

    p, steps, rows_per_mb = 8, 2000, 32
    x, y = _clusters(1)
    xtr, ytr, xte, yte = x[:16000], y[:16000], x[16000:], y[16000:]

    def batches(b):
        i = (b * rows_per_mb) % 16000
        return xtr[i:i + rows_per_mb], ytr[i:i + rows_per_mb]

    stale = pipedream_staleness(p)
    logs: dict[tuple[float, str], object] = {}

    def run():
        for lr in (0.005, 0.01, 0.02):
            for mode in ("exact", "stale", "spectrain"):
                logs[lr, mode] = train_pipelined(_make_stages(0, p), batches, steps, mode, stale, lr, 0.9,
                                                 eval_data=(xte, yte), eval_every=50)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds synchronization
    try:
        benchmark.pedantic(run, rounds=1, iterations=1)
    finally:
        torch.set_num_threads(threads)
    table = ["Synthetic 10-class Gaussian clusters (32 features, noise 2.0), 8 stages of Linear(64)+Tanh, "
             f"momentum SGD 0.9, {steps} steps of {rows_per_mb} rows, one seed; stale = PipeDream weight "
             f"stashing (stage k lags {stale} updates), SpecTrain predicts W - s lr v with s = the lag.", "",
             "| lr | exact acc | stale acc | SpecTrain acc | accuracy lost to staleness that SpecTrain recovers | "
             "final train loss exact / stale / SpecTrain |", "|---:|---:|---:|---:|---:|---|"]
    summary = {}
    for lr in (0.005, 0.01, 0.02):
        acc = {m: logs[lr, m].eval_accuracy[-1] for m in ("exact", "stale", "spectrain")}
        loss = {m: float(np.mean(logs[lr, m].loss[-200:])) for m in ("exact", "stale", "spectrain")}
        gap = acc["exact"] - acc["stale"]
        rec = (acc["spectrain"] - acc["stale"]) / gap if gap > 0 else float("nan")
        summary[lr] = {"accuracy": acc, "train_loss": loss, "recovered": rec}
        table.append(f"| {lr} | {acc['exact']:.1%} | {acc['stale']:.1%} | {acc['spectrain']:.1%} | "
                     f"{rec:.0%} | {loss['exact']:.3f} / {loss['stale']:.3f} / {loss['spectrain']:.3f} |")
    _write("convergence.md", "\n".join(table) + "\n")
    _write("convergence.json", json.dumps({str(k): v for k, v in summary.items()}, indent=1))
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    colors = {"exact": "black", "stale": "tab:red", "spectrain": "tab:blue"}
    for ax, lr in zip(axes, (0.005, 0.01, 0.02)):
        for mode in ("exact", "stale", "spectrain"):
            lg = logs[lr, mode]
            ax.plot(lg.eval_steps, lg.eval_loss, color=colors[mode],
                    label={"exact": "exact (sync / BPPSA)", "stale": "stale (PipeDream)",
                           "spectrain": "stale + SpecTrain"}[mode])
        ax.set_title(f"lr {lr}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("held-out loss", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle("8-stage pipeline, one seed: exact vs stale vs SpecTrain", fontsize=9)
    fig.tight_layout()
    fig.savefig(OUT / "convergence.png", dpi=110)
    benchmark.extra_info.update({"device": _device(), "summary": {str(k): v for k, v in summary.items()}})
    # staleness must cost something at every lr here, or the experiment shows nothing
    assert all(summary[lr]["train_loss"]["stale"] > summary[lr]["train_loss"]["exact"] for lr in summary)


MEASURED = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "scan"]


def test_measured_vs_simulated(benchmark):
    from spscan.pipeline.realrun import compare, predicted_timeline

    cfg = dict(dims=[512] * 9, batch=256, microbatches=4, warmup=3, steps=10, cost_reps=7)
    tiny = dict(cfg, dims=[8] * 9)
    out = {}

    def run():
        out["real"] = compare(cfg, MEASURED, world=2)
        out["floor"] = compare(tiny, MEASURED, world=2)
        out["p4"] = compare(dict(cfg, warmup=1, steps=3), ["GPipe", "1F1B", "scan"], world=4)

    benchmark.pedantic(run, rounds=1, iterations=1)
    rows = []
    res, floor = out["real"], out["floor"]
    med = {m: float(np.median([np.median(r["methods"][m]["times"]) for r in res])) for m in MEASURED}
    for m in MEASURED:
        tl = predicted_timeline(res, cfg, m)
        tl_in = predicted_timeline(res, cfg, m, in_step=True)
        fl = float(np.median([np.median(r["methods"][m]["times"]) for r in floor]))
        # share of the step the rank spent inside the schedule's compute actions
        share = [sum(v * cfg["microbatches"] for v in r["methods"][m]["action_costs"].values()) / med[m]
                 for r in res] if m != "scan" else []
        rows.append({"p": 2, "method": m, "measured_s": med[m], "vs_gpipe": med["GPipe"] / med[m],
                     "in_step_sim_s": tl_in.step_time, "in_step_sim_error": tl_in.step_time / med[m] - 1,
                     "compute_share": share,
                     "bytes_sent_per_rank": [r["methods"][m]["bytes_sent"] for r in res],
                     "peak_rss_growth": [r["methods"][m]["peak_rss_growth"] for r in res],
                     "simulated_s": tl.step_time, "sim_error": tl.step_time / med[m] - 1,
                     "floor_s": fl, "sim_plus_floor_error": (tl.step_time + fl) / med[m] - 1,
                     "sim_peak_activation_bytes": max(tl.peak_activations)})
    p4 = out["p4"]
    for m in ("GPipe", "1F1B", "scan"):
        t = float(np.median([np.median(r["methods"][m]["times"]) for r in p4]))
        rows.append({"p": 4, "method": m, "measured_s": t, "bytes_sent_per_rank": [r["methods"][m]["bytes_sent"]
                                                                                 for r in p4]})
    _write("measured.json", json.dumps({"device": _device(), "config": {k: v for k, v in cfg.items()},
                                        "link": res[0]["link"], "rows": rows}, indent=1, default=str))
    lines = [f"Device: {_device()}; Gloo, 1 thread per process; MLP {cfg['dims']} (Linear+ReLU, 15 chain layers), "
             f"batch {cfg['batch']}, {cfg['microbatches']} micro-batches (the scan runs the whole batch), SGD step "
             f"included; every method's steps interleaved round by round in one set of processes, median of "
             f"{cfg['steps']} steps. Simulated: the simulator with per-module F/I/W and the link measured in the "
             "same processes; + floor: plus the same schedule's measured step time on an 8-wide copy of the model "
             "(framework overhead with negligible compute).", "",
             "In-step: each stage's costs scaled to the time its F/B/I/W calls took inside the steps; compute "
             "share: that time over the step, per rank.", "",
             "| p | method | measured ms | vs GPipe (same run) | bytes sent / rank / step | simulated ms | error | "
             "simulated + floor | error | in-step simulated | error | compute share |",
             "|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["p"] == 2:
            lines.append(f"| 2 | {r['method']} | {1e3 * r['measured_s']:.1f} | {r['vs_gpipe']:.2f}x | "
                         f"{', '.join(str(b) for b in r['bytes_sent_per_rank'])} | {1e3 * r['simulated_s']:.1f} | "
                         f"{r['sim_error']:+.0%} | {1e3 * (r['simulated_s'] + r['floor_s']):.1f} | "
                         f"{r['sim_plus_floor_error']:+.0%} | {1e3 * r['in_step_sim_s']:.1f} | "
                         f"{r['in_step_sim_error']:+.0%} | {', '.join(f'{c:.0%}' for c in r['compute_share'])} |")
        else:
            lines.append(f"| 4 (4 processes on 2 cores) | {r['method']} | {1e3 * r['measured_s']:.1f} | | "
                         f"{', '.join(str(b) for b in r['bytes_sent_per_rank'])} | | | | | | | |")
    _write("measured.md", "\n".join(lines) + "\n")
    benchmark.extra_info.update({"device": _device(), "rows": rows})
    assert all(math.isfinite(r["measured_s"]) and r["measured_s"] > 0 for r in rows)


def test_report(benchmark):
    """One page with every table and figure (run after the other tests of this file)."""
    parts = benchmark.pedantic(lambda: {n: (OUT / n).read_text() if (OUT / n).exists() else "(not run)\n"
                                        for n in ("simulated.md", "convergence.md", "measured.md")},
                               rounds=1, iterations=1)
    text = ["# Model-parallel schedules: simulated and measured", "",
            f"Written by `bench/test_pipeline.py` on {_device()}.", "",
            "## Simulated (unit costs)", "", parts["simulated.md"],
            "![out-of-order paper](timelines_ooo_ffnn16.png)", "",
            "![PipeDream vs DualPipe](timelines_pipedream_dualpipe.png)", "",
            "![p = 4](timelines_p4.png)", "",
            "## Staleness and SpecTrain", "", parts["convergence.md"], "![convergence](convergence.png)", "",
            "## Measured (Gloo, CPU)", "", parts["measured.md"]]
    _write("README.md", "\n".join(text))
