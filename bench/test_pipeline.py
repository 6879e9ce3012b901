"""Model-parallel schedules side by side: simulated for p = 2..64, measured for p <= 4 (Gloo CPU).

Writes into ``SPSCAN_PIPELINE_RESULTS`` (default ``bench/results/cpu-2core/pipeline``):

* ``simulated.md/.json`` — step time, bubble, peak activations, staleness, exactness per schedule
  and p, from :mod:`spscan.parallel.pipeline.simulator` with unit layer costs;
* ``timelines_*.png`` — the papers' unit-time examples and every schedule at p = 4;
* ``convergence.md/.png`` — exact vs stale (PipeDream) vs stale + SpecTrain training;
* ``measured.md/.json`` — torch.distributed.pipelining schedules and spscan's scan on one MLP,
  p = 2 (and p = 4, oversubscribed), interleaved in one set of processes, with the simulator's
  predictions (calibrated with isolated stage costs, Gloo ping-pong, the runtime overheads of a
  negligible-compute copy and the measured CPU share; never with the predicted step times) and
  their errors, and where each rank's step went;
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
import scipy.sparse as sp
import torch

from spscan.parallel.pipeline import simulator as S
from spscan.parallel.pipeline.draw import draw_timelines

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
    from spscan.parallel.pipeline.spectrain import pipedream_staleness, train_pipelined

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


def _ms(v: float) -> str:
    return f"{1e3 * v:.1f}"


def _spread(a) -> str:
    return f"{_ms(np.percentile(a, 10))}–{_ms(np.percentile(a, 90))}"


def test_measured_vs_simulated(benchmark):
    from spscan.parallel.pipeline import realrun as R

    cfg = dict(dims=[512] * 9, batch=256, microbatches=4, warmup=3, steps=20)
    tiny = dict(cfg, dims=[8] * 9)
    out = {}

    def run():
        out["real"] = R.compare(cfg, MEASURED, world=2)
        out["floor"] = R.compare(tiny, MEASURED, world=2)
        out["p4"] = R.compare(dict(cfg, warmup=1, steps=3), ["GPipe", "1F1B", "scan"], world=4)

    benchmark.pedantic(run, rounds=1, iterations=1)
    res, floor = out["real"], out["floor"]
    loads = R.round_loads(res)
    shares = [a for a, _ in loads]
    long_shares = [a for a, _ in R.round_loads(res, probe="share")]
    link, blink = R.calibrated_link(res), R.calibrated_link(res, blocking=True)
    rows = []
    for m in MEASURED:
        st = R.step_times(res, m)
        ov = R.runtime_overheads(floor, m)
        dedicated, loaded = R.predicted_step_times(res, cfg, m, ov)
        busy = R.busy_per_device(R.predicted_timeline(res, cfg, m, ov))
        expl = R.explained_step_times(res, cfg, m, ov)
        ex_med = float(np.median(expl))
        cpu = R.measured_cpu(res, m)
        bare = R.predicted_timeline(res, cfg, m).step_time  # compute + link + optimizer, no runtime overheads
        med, pred = float(np.median(st)), float(np.median(loaded))
        bd = R.step_breakdown(res, m)
        rows.append({"p": 2, "method": m, "measured_s": med, "measured_p10_p90": [float(np.percentile(st, q))
                                                                              for q in (10, 90)],
                     "measured_min_s": float(st.min()), "steps": len(st), "vs_gpipe": None,
                     "predicted_s": pred, "predicted_p10_p90": [float(np.percentile(loaded, q)) for q in (10, 90)],
                     "error": pred / med - 1, "within_25": abs(pred / med - 1) <= 0.25,
                     "dedicated_s": dedicated, "compute_link_only_s": bare,
                     "cpu_measured_s": cpu, "cpu_predicted_s": busy,
                     "explained_s": ex_med, "explained_error": ex_med / med - 1,
                     "explained_within_25": abs(ex_med / med - 1) <= 0.25,
                     "explained_step_error_median": float(np.median(np.abs(expl / st - 1))),
                     "step_cpu_share": float(np.median(R.step_cpu_shares(res, m))),
                     "cpu_error": [b / c - 1 for b, c in zip(busy, cpu)],
                     "dedicated_vs_fastest": dedicated / float(st.min()) - 1,
                     "overheads": {"in_action_s": ov["in_action"], "gap_s": ov["gap"], "step_start_s": ov["start"],
                                   "optimizer_s": [r["calibration"]["opt"][m] for r in res]},
                     "breakdown": bd,
                     "bytes_sent_per_rank": [r["methods"][m]["bytes_sent"] for r in res],
                     "peak_rss_growth": [r["methods"][m]["peak_rss_growth"] for r in res]})
    gp = rows[0]["measured_s"]
    for r in rows:
        r["vs_gpipe"] = gp / r["measured_s"]
    p4 = out["p4"]
    for m in ("GPipe", "1F1B", "scan"):
        st = R.step_times(p4, m)
        rows.append({"p": 4, "method": m, "measured_s": float(np.median(st)), "bytes_sent_per_rank":
                     [r["methods"][m]["bytes_sent"] for r in p4],
                     "breakdown": R.step_breakdown(p4, m)})
    calib = {"link_async": [link.latency, link.bandwidth], "link_blocking": [blink.latency, blink.bandwidth],
             "ping_pong_fastest_s": res[0]["calibration"]["async"], "ping_pong_median_s": res[0]["calibration"][
                 "async_median"], "round_cpu_share": shares,
             "round_link": [[lk.latency, lk.bandwidth] for _, lk in loads], "round_cpu_share_long": long_shares,
             "stage_cpu_s": {k: v for r in res for k, v in r["calibration"]["stage"].items()},
             "scan_slice_cpu_s": [r["calibration"]["scan"] for r in res]}
    _write("measured.json", json.dumps({"device": _device(), "config": {k: v for k, v in cfg.items()},
                                        "calibration": calib, "rows": rows}, indent=1, default=str))
    ok = [r["method"] for r in rows if r["p"] == 2 and r["within_25"]]
    miss = [r for r in rows if r["p"] == 2 and not r["within_25"]]
    lines = [f"Device: {_device()}; Gloo, 1 thread per process; MLP {cfg['dims']} (Linear+ReLU, 15 chain layers), "
             f"batch {cfg['batch']}, {cfg['microbatches']} micro-batches (the scan runs the whole batch), SGD step "
             f"included; every method's steps interleaved round by round in one set of processes, "
             f"{cfg['steps']} timed steps each, one calibration round after every round of steps.", "",
             "**Measured**: a step runs from the first rank's start to the last rank's end (one monotonic clock); "
             "median and 10th–90th percentile over the steps. **Predicted**: the simulator, calibrated only with "
             "measurements other than these step times (below), once per calibration round under that round's "
             "measured load; median and 10th–90th percentile over the rounds. **Dedicated**: the same "
             "prediction for a machine running nothing else (CPU share 1, least-contended link), compared "
             "with the fastest measured step. **Explained**: the dedicated prediction with compute and runtime "
             "costs divided, step by step, by the CPU share the ranks got in that step (main-thread CPU time over "
             "CPU time plus run-queue wait): not independent (the share is read from the steps), but nothing is "
             "fitted to a step time; median over the steps, and the median per-step error. **CPU / rank**: each rank's main-thread CPU time per step "
             "(`/proc/thread-self/schedstat`, median) against the time the dedicated prediction keeps that rank "
             "busy: the cost model's compute and runtime overheads, whatever the machine's load.", "",
             f"CPU share a computing rank got during the calibration rounds (median, range; 1.0 is a core of its "
             f"own): {np.median(shares):.2f} ({min(shares):.2f}–{max(shares):.2f}) in 1–2 ms bursts between short "
             f"sleeps (what the prediction uses: a rank computes an action at a time between waits), "
             f"{np.median(long_shares):.2f} ({min(long_shares):.2f}–{max(long_shares):.2f}) over the calibration's "
             "uninterrupted compute.", "",
             "| p | method | measured ms (p10–p90) | predicted ms (p10–p90) | error | within 25 % | "
             "steps' CPU share | explained ms | error (per step) | within 25 % | dedicated ms | fastest step ms | "
             "compute + link only ms | CPU / rank: measured, predicted ms (error) | vs GPipe (measured) | "
             "bytes sent / rank / step |",
             "|---:|---|---:|---:|---:|:---:|---:|---:|---:|:---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        if r["p"] == 2:
            lines.append(f"| 2 | {r['method']} | {_ms(r['measured_s'])} ({'–'.join(_ms(v) for v in r['measured_p10_p90'])}) | "
                         f"{_ms(r['predicted_s'])} ({'–'.join(_ms(v) for v in r['predicted_p10_p90'])}) | "
                         f"{r['error']:+.0%} | {'yes' if r['within_25'] else '**no**'} | {r['step_cpu_share']:.2f} | "
                         f"{_ms(r['explained_s'])} | {r['explained_error']:+.0%} ({r['explained_step_error_median']:.0%}) | "
                         f"{'yes' if r['explained_within_25'] else '**no**'} | {_ms(r['dedicated_s'])} | "
                         f"{_ms(r['measured_min_s'])} | {_ms(r['compute_link_only_s'])} | "
                         + "; ".join(f"{_ms(c)}, {_ms(b)} ({e:+.0%})" for c, b, e in
                                     zip(r["cpu_measured_s"], r["cpu_predicted_s"], r["cpu_error"]))
                         + f" | {r['vs_gpipe']:.2f}x | "
                         f"{', '.join(str(b) for b in r['bytes_sent_per_rank'])} |")
    for r in rows:
        if r["p"] == 4:
            lines.append(f"| 4 (4 processes on 2 cores: correctness and bytes only) | {r['method']} | "
                         f"{_ms(r['measured_s'])} | | | | | | | | | | | | | "
                         f"{', '.join(str(b) for b in r['bytes_sent_per_rank'])} |")
    missed = ", ".join(f"{r['method']} ({r['error']:+.0%})" for r in miss) or "none"
    ex_ok = [r["method"] for r in rows if r["p"] == 2 and r["explained_within_25"]]
    ex_miss = ", ".join(f"{r['method']} ({r['explained_error']:+.0%})" for r in rows
                        if r["p"] == 2 and not r["explained_within_25"]) or "none"
    lines += ["", f"Predicted within 25 %: {', '.join(ok) or 'none'}; missed: {missed}. Explained with the steps' "
              f"own CPU share within 25 %: {', '.join(ex_ok) or 'none'}; missed: {ex_miss}.", ""]
    p2 = [r for r in rows if r["p"] == 2]
    rq = [b["run_wait"] / b["wall"] for r in p2 for b in r["breakdown"]]
    cpu_err = [e for r in p2 for e in r["cpu_error"]]
    lines += [f"Load: a rank's main thread waited for a core (run queue) {min(rq):.0%}–{max(rq):.0%} of its step "
              f"(median {np.median(rq):.0%}); the dedicated prediction keeps each rank busy within "
              f"{min(cpu_err):+.0%}…{max(cpu_err):+.0%} of the CPU time it measured (the cost model's compute and "
              "runtime overheads, whatever the load).", ""]
    lines += ["**Where each rank's step went** (medians over the steps, ms): compute = the schedule's F/B/I/W calls "
              "(scan: forward, distributed backward, weight phase; wall time, so contention inside a call counts "
              "here), wait = blocked on a receive, post = posting sends/receives, other = the runtime between calls; "
              "CPU = the main thread's CPU time in the step, run-queue = the time it was ready but every core was "
              "busy (`/proc/thread-self/schedstat`).", "",
              "| method | rank | wall | compute | wait | post | other | CPU | run-queue |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["p"] == 2:
            for k, b in enumerate(r["breakdown"]):
                lines.append(f"| {r['method']} | {k} | {_ms(b['wall'])} | {_ms(b['compute'])} | {_ms(b['wait'])} | "
                             f"{_ms(b['post'])} | {_ms(b['other'])} | {_ms(b['cpu'])} | {_ms(b['run_wait'])} |")
    stage = calib["stage_cpu_s"]
    lines += ["", "**Calibration: which measurement sets which parameter** (none of them is a step time of the "
              "table above):", "",
              "| parameter | value | measured by |", "|---|---|---|",
              "| per-stage F / B / I / W (one micro-batch) | "
              + "; ".join(f"stage {k}: " + " / ".join(_ms(v[a]) for a in "FBIW") + " ms"
                          for k, v in sorted(stage.items()))
              + " | CPU time of each stage's layers run alone through the runtime's own functions (forward with "
              "autograd recording and the loss on the last stage, `stage_backward`, `stage_backward_input`, "
              "`stage_backward_weight`; the first stage has no input step, its weight step is its full backward), "
              "median over the rounds |",
              "| scan slice F (+ loss) / local backward / W (whole batch) | "
              + "; ".join(f"rank {k}: {_ms(v['F'] + v['loss'])} / {_ms(v['I'])} / {_ms(v['W'])} ms"
                          for k, v in enumerate(calib["scan_slice_cpu_s"]))
              + " | CPU time of the slice's forward with Jacobian values, its one-rank `spscan.backward`, its `g^T x` |",
              f"| optimizer step per rank | {', '.join(_ms(v) for v in rows[0]['overheads']['optimizer_s'])} ms (GPipe) | "
              "CPU time of one SGD step + gradient reset over copies of the rank's parameters |",
              f"| link latency + bytes / bandwidth, isend/irecv (torch) | {1e6 * link.latency:.0f} us, "
              f"{link.bandwidth / 1e9:.2f} GB/s | ping-pong at the run's message sizes "
              f"({', '.join(str(n) for n in res[0]['calibration']['sizes'])} B), the fastest one-way time of each size |",
              f"| link, blocking send/recv (scan; the sender is busy) | {1e6 * blink.latency:.0f} us, "
              f"{blink.bandwidth / 1e9:.2f} GB/s | the same with `send`/`recv` |",
              "| per-action runtime overhead, per-step start | per method below | CPU time of the same schedule's calls "
              "on an 8-wide copy of the model (compute negligible): in-call time minus that copy's isolated stage "
              "cost, plus the CPU time between calls per call (executor, message posts) |",
              "| CPU share, link under load (per round) | see above | the compute probes' CPU time / wall time; the "
              "round's ping-pong medians |", "",
              "| method | in-call overhead per action kind (us) | between calls per action (us) | step start per rank (us) |",
              "|---|---|---:|---|"]
    for r in rows:
        if r["p"] == 2:
            o = r["overheads"]
            lines.append(f"| {r['method']} | {', '.join(f'{k}: {1e6 * v:.0f}' for k, v in o['in_action_s'].items())} | "
                         f"{1e6 * o['gap_s']:.0f} | {', '.join(f'{1e6 * v:.0f}' for v in o['step_start_s'])} |")
    _write("measured.md", "\n".join(lines) + "\n")
    benchmark.extra_info.update({"device": _device(), "rows": [{k: v for k, v in r.items() if k != "breakdown"}
                                                               for r in rows]})
    assert all(math.isfinite(r["measured_s"]) and r["measured_s"] > 0 for r in rows)
    assert all(math.isfinite(r["predicted_s"]) and r["predicted_s"] > 0 for r in rows if r["p"] == 2)


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
