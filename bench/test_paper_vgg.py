"""Paper Figure 10: the pruned VGG-11 study under two conventions, at every depth.

The chain is VGG-11's convolutional part on 32x32 inputs (8 x (conv 3x3 + ReLU), 5 max-pools:
21 transposed Jacobians), taken from a VGG-11 (features + a 512->10 classifier) briefly trained
on CIFAR-shaped data (synthetic unless a local CIFAR-10 is found: ``paper_cifar``), then 97 % of
the weights pruned by magnitude, per layer (``l1_unstructured`` on every conv and the linear
layer) or globally (``global_unstructured`` over all of them, the class-blind scheme the paper's
pruning reference found best). No retraining: the pattern, not the values, decides the FLOPs.

Depth: in the paper's Figure 3 L0 is the row of input matrices, so "up-sweep L0-L2" is two levels
of products: ``levels=2``. Every depth ``K = 0 .. max`` is reported.

Two conventions of counting FLOPs per node (mm: 2 x multiply pairs; mv: 2 x stored entries):

* **spscan (plan once)**: the architecture's patterns, fixed for all samples and steps (a ReLU's
  or max-pool's possible zeros stay stored), with the planner's own storage and algorithm per
  product: dense or its own pattern, chosen by the cost of what reads the product (the next level's
  product and the mat-vecs), pair lists or row-wise; BP's gradient operators are the pruned layers'
  SpMVs (``levels=0``).
* **paper**: per-sample patterns with the possible zeros eliminated (only active ReLUs, only each
  pooling window's argmax), products kept in CSR, FLOPs averaged over a batch; BP's gradient
  operators are the *unpruned* network's (2 x stored entries of its plan-once ``J^T``).

Measured on this machine: planning time and index memory per depth, the backward time of
``spscan.backward`` at each depth the planner makes (batch 1, float64; linear scan timed in the
same run, interleaved), gradients against ``levels=0``, and the planner's ``levels="auto"``.

``python bench/test_paper_vgg.py OUT_DIR`` writes ``vgg11_study.md``, ``vgg11_study.json`` and
``vgg11_fig10.png`` there; the pytest suite records the same numbers in ``extra_info``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn
from torch.nn.utils import prune

import spscan
from spscan.cli.report import step_flops_scatter
from spscan.planner.memory import estimate_memory, held_index_bytes
from spscan.planner.planning import step_costs
from spscan.planner.schedule import blelloch_schedule, max_levels

sys.path.insert(0, str(Path(__file__).parent))
import paper_cifar  # noqa: E402
import paper_config as cfg  # noqa: E402

VGG11_CFG = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


# --- the network: train briefly, prune -----------------------------------------------------

def vgg11(divisor: int = 1, seed: int = 0) -> nn.Sequential:
    """VGG-11 for 32x32 inputs: conv/ReLU/max-pool features (channels divided by ``divisor``) + a linear head."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    c = 3
    for v in VGG11_CFG:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        v = max(1, int(v) // divisor)
        layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
        c = v
    return nn.Sequential(nn.Sequential(*layers), nn.Flatten(), nn.Linear(c, 10))


def train_briefly(model: nn.Module, steps: int, batch: int, seed: int = 0) -> dict[str, Any]:
    """Adam (lr 3e-4) on CIFAR-shaped data; returns the data source and the mean loss of the first and
    last fifth of the steps (plain SGD does not move a VGG without batch norm in so few steps)."""
    x, y, source = paper_cifar.cifar10_train(steps * batch, seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    losses = []
    model.train()
    for s in range(steps):
        xb, yb = x[s * batch : (s + 1) * batch], y[s * batch : (s + 1) * batch]
        loss = nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    head = max(1, steps // 5)
    return {"data": source, "steps": steps, "batch": batch, "loss_first": float(np.mean(losses[:head])),
            "loss_last": float(np.mean(losses[-head:]))}


def magnitude_prune(model: nn.Module, amount: float, scope: str) -> None:
    """Prune ``amount`` of the conv and linear weights by magnitude, per layer or globally; made permanent."""
    mods = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    if scope == "layer":
        for m in mods:
            prune.l1_unstructured(m, "weight", amount=amount)
    elif scope == "global":
        prune.global_unstructured([(m, "weight") for m in mods], pruning_method=prune.L1Unstructured, amount=amount)
    else:
        raise ValueError(f"scope: expected 'layer' or 'global', got {scope!r}")
    for m in mods:
        prune.remove(m, "weight")


# --- FLOPs per node ------------------------------------------------------------------------

def _bool(p) -> sp.csr_array:
    p = sp.csr_array(p)
    return sp.csr_array((np.ones(p.nnz, dtype=bool), p.indices, p.indptr), shape=p.shape)


def _pairs(a: sp.csr_array, b: sp.csr_array) -> int:
    return int(np.diff(b.indptr)[a.indices].sum())


def _critical(rows: list[dict], phase_level: list[tuple]) -> None:
    """Mark the largest node of each step (every node of the linear-scan middle is on the path)."""
    for key in phase_level:
        idx = [i for i, r in enumerate(rows) if (r["phase"], r["level"], r["step"]) == key]
        if not idx:
            continue
        top = max(idx, key=lambda i: rows[i]["flops"])
        for i in idx:
            rows[i]["critical"] = rows[i]["phase"] == "mid" or i == top


def walk_csr(patterns: list[sp.csr_array], levels: int, max_level: Optional[int] = None) -> list[dict]:
    """Per-node FLOPs with every product kept in CSR (SciPy boolean products): the paper's counting.

    ``max_level``: up-sweep levels whose products are formed (deeper nodes are not counted).
    """
    sched = blelloch_schedule(len(patterns), levels)
    mats = {i: _bool(p) for i, p in enumerate(patterns)}
    rows: list[dict] = []
    keys = []
    for si, st in enumerate(sched.steps):
        keys.append((st.phase, st.level, si))
        for op in st.mm:
            a, b = mats[op.left], mats[op.right]
            rows.append(dict(phase=st.phase, level=st.level, step=si, kind="mm", flops=2 * _pairs(a, b),
                             dense_flops=2 * a.shape[0] * a.shape[1] * b.shape[1]))
            mats[op.out] = _bool(a @ b)
        for op in st.mv:
            m = mats[op.mat]
            rows.append(dict(phase=st.phase, level=st.level, step=si, kind="mv", flops=2 * m.nnz,
                             dense_flops=2 * m.shape[0] * m.shape[1]))
    _critical(rows, keys)
    return rows


def walk_plan(plan) -> list[dict]:
    """Per-node FLOPs of a spscan plan: its own products (pairs, row-wise or GEMM) and storage."""
    scan = plan._scan
    rows: list[dict] = []
    keys = []
    for si, st in enumerate(scan.schedule.steps):
        keys.append((st.phase, st.level, si))
        for op in st.mm:
            info, a, b = scan.mats[op.out], scan.mats[op.left].pattern, scan.mats[op.right].pattern
            rows.append(dict(phase=st.phase, level=st.level, step=si, kind="mm", flops=2 * info.work,
                             dense_flops=2 * a.rows * a.cols * b.cols, algo=info.algo, dense=info.pattern.is_full,
                             densified=info.densified))
        for op in st.mv:
            m = scan.mats[op.mat].pattern
            rows.append(dict(phase=st.phase, level=st.level, step=si, kind="mv", flops=2 * m.nnz,
                             dense_flops=2 * m.rows * m.cols, dense=m.is_full))
    _critical(rows, keys)
    return rows


def per_sample_patterns(plan0, jac, sample: int) -> list[sp.csr_array]:
    """The chain's patterns for one sample with the possible zeros eliminated (values exactly zero)."""
    out = []
    for p, v in zip(plan0.patterns, jac.values):
        vals = (v[sample] if v.dim() == 2 else v).detach().cpu().numpy()
        q = sp.csr_array((vals, p.indices, p.indptr), shape=p.shape)
        q.eliminate_zeros()
        q.sort_indices()
        out.append(q)
    return out


def summarize(rows: list[dict], baseline: list[dict]) -> dict[str, Any]:
    crit = [r for r in rows if r["critical"]]
    bp_max = max(b["flops"] for b in baseline)
    up = {}
    for lvl in sorted({r["level"] for r in rows if r["phase"] == "up" and r["kind"] == "mm"}):
        up[f"L{lvl + 1}"] = max(r["flops"] for r in rows if r["phase"] == "up" and r["kind"] == "mm" and r["level"] == lvl)
    mid = [r["flops"] for r in rows if r["phase"] == "mid"]
    return {
        "total_flops": int(sum(r["flops"] for r in rows)),
        "critical_path_flops": int(sum(r["flops"] for r in crit)),
        "critical_steps": len(crit),
        "max_step_flops": int(max(r["flops"] for r in rows)),
        "max_up_mm_flops_by_level": up,
        "max_mid_flops": int(max(mid)) if mid else 0,
        "max_baseline_flops": int(bp_max),
        "baseline_total_flops": int(sum(b["flops"] for b in baseline)),
        "max_step_vs_bp_max": float(max(r["flops"] for r in rows) / bp_max),
    }


def _average(walks: list[list[dict]]) -> list[dict]:
    out = []
    for nodes in zip(*walks):
        r = dict(nodes[0])
        r["flops"] = float(np.mean([n["flops"] for n in nodes]))
        out.append(r)
    return out


# --- the study -----------------------------------------------------------------------------

def _index_bytes(plan) -> dict[str, int]:
    """Index memory of a plan: the planner's estimate (for the signatures bound) and what is held, measured
    as the distinct integer buffers reachable from the symbolic plan (patterns, pair lists, row-wise data)
    and from it plus every bound signature's program and backend tables."""
    scan = plan._scan
    sigs = [(k[0], k[1], k[3], k[4]) for k in plan._bound]
    est = estimate_memory(scan, sigs)
    return {"estimate_plan_bytes": int(est.index_bytes), "estimate_scan_bytes": int(est.symbolic_bytes),
            "held_scan_bytes": int(held_index_bytes(scan)),
            "held_bytes": int(held_index_bytes(scan, *[(b.program, b.tables) for b in plan.bindings()])),
            "bindings": len(sigs)}


def _planner_seconds(plan) -> float:
    """The planner's own estimate of one backward at batch 1: its cost model over the step kinds it
    planned (pair lists, row-wise, dense GEMM, SpMV/GEMV, linear-run steps)."""
    return float(sum(c.time_s for c in step_costs(dataclasses.replace(plan._scan, batch_hint=1))))


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_study(divisor: int = 1, scopes=("layer", "global"), train_steps: int = 60, train_batch: int = 32,
              samples: int = 4, time_limit_s: float = 120.0, rounds: int = 3, depth_cap: Optional[dict] = None,
              log=print, time_backward: bool = True) -> dict[str, Any]:
    """The whole study; returns a JSON-able record (see the module docstring).

    ``time_backward=False`` (a busy machine): each depth's backward runs once, for its gradients
    against ``levels=0``, and is not timed (:func:`carry_times` can take the times of an earlier record).

    ``depth_cap``: per pruning scope, the deepest ``K`` planned by spscan (the paper-convention walk
    covers every depth regardless).
    """
    depth_cap = {"global": 2} if depth_cap is None else depth_cap
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    net = vgg11(divisor)
    t0 = time.perf_counter()
    train = train_briefly(net, train_steps, train_batch)
    train["seconds"] = time.perf_counter() - t0
    log(f"trained {train}")
    trained_state = {k: v.clone() for k, v in net.state_dict().items()}
    x_eval, _, _ = paper_cifar.cifar10_train(samples, seed=99)
    record: dict[str, Any] = {"rounds": rounds, "time_limit_s": time_limit_s, "divisor": divisor, "prune_amount": cfg.VGG_PRUNE_AMOUNT, "training": train,
                              "device": cfg.device_label(torch.device("cpu")), "scopes": {}}
    # the unpruned network's operators (the paper's BP baseline)
    feats0 = net[0].double()
    x1 = x_eval[:1].double()
    p_full = spscan.plan(feats0, x1, levels=0)
    unpruned = [dict(kind="bp", flops=2 * p.nnz, dense_flops=2 * p.shape[0] * p.shape[1], layer=i + 1)
                for i, p in enumerate(p_full.patterns)]
    del p_full
    for scope in scopes:
        net.load_state_dict(trained_state)
        magnitude_prune(net, cfg.VGG_PRUNE_AMOUNT, scope)
        feats = net[0].double()
        kept = {f"conv{j + 1}": float((m.weight != 0).float().mean())
                for j, m in enumerate([m for m in feats if isinstance(m, nn.Conv2d)])}
        rec: dict[str, Any] = {"conv_density": kept}
        t = time.perf_counter()
        p0 = spscan.plan(feats, x1, prune_zeros=True, levels=0)
        rec["plan_s"] = {"0": time.perf_counter() - t}
        pats = [sp.csr_array(p) for p in p0.patterns]
        n = len(pats)
        kmax = max_levels(n)
        rec["n"], rec["max_levels"] = n, kmax
        pruned_bp = [dict(kind="bp", flops=2 * p.nnz, dense_flops=2 * p.shape[0] * p.shape[1], layer=i + 1)
                     for i, p in enumerate(pats)]
        # the paper's convention: per-sample patterns, zeros eliminated, averaged
        _, jac = spscan.forward(p0, x_eval.double())
        persample = [per_sample_patterns(p0, jac, s) for s in range(samples)]
        rec["paper"], rec["spscan"], rec["timing"], rec["index"], rec["refused"] = {}, {}, {}, {}, {}
        for k in range(kmax + 1):
            t = time.perf_counter()
            walks = [walk_csr(ps, k) for ps in persample]
            rows = _average(walks)
            rec["paper"][str(k)] = {"summary": summarize(rows, unpruned), "steps": rows,
                                    "walk_s": time.perf_counter() - t}
            log(f"[{scope}] paper K={k}: {rec['paper'][str(k)]['summary']}")
        grad = torch.randn(1, pats[-1].shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        vals = [v[:1] if v.dim() == 2 else v for v in jac.values]
        ref = p0.backward(vals, grad)
        for k in range(min(kmax, depth_cap.get(scope, kmax)) + 1):
            t = time.perf_counter()
            try:
                plan = p0 if k == 0 else spscan.plan(feats, x1, prune_zeros=True, levels=k)
            except (ValueError, MemoryError) as e:
                rec["refused"][str(k)] = str(e)
                log(f"[{scope}] K={k} refused: {e}")
                continue
            rec["plan_s"][str(k)] = time.perf_counter() - t
            rows = walk_plan(plan.core)
            rec["spscan"][str(k)] = {"summary": summarize(rows, pruned_bp), "steps": rows}
            idx = _index_bytes(plan.core)
            idx["peak_rss_gib_so_far"] = _rss_gib()
            rec["index"][str(k)] = idx
            est_s = _planner_seconds(plan.core)
            rec["planner_backward_s"] = {**rec.get("planner_backward_s", {}), str(k): est_s}
            log(f"[{scope}] spscan K={k}: plan {rec['plan_s'][str(k)]:.1f}s, {rec['spscan'][str(k)]['summary']}, "
                f"index {idx}, planner's estimate {est_s:.3g} s per backward (B=1)")
            # measured backward (batch 1), only where the planner's own cost model says it fits the time limit
            if est_s > time_limit_s:
                rec["timing"][str(k)] = {"timed": False, "planner_estimate_s": est_s,
                                         "reason": f"~{est_s:.0f} s per backward by the planner's cost model"}
                del plan
                gc.collect()
                continue
            t = time.perf_counter()
            g = plan.backward(vals, grad)
            first = time.perf_counter() - t
            err = max(float((a - b).abs().max()) for a, b in zip(g, ref))
            scale = max(float(r.abs().max()) for r in ref)
            if not time_backward:
                rec["timing"][str(k)] = {"timed": False, "planner_estimate_s": est_s, "reason": "not re-timed",
                                         "max_abs_err_vs_levels0": err, "rel_err_vs_levels0": err / scale}
                log(f"[{scope}] K={k} gradients {rec['timing'][str(k)]}")
                del plan, g
                gc.collect()
                continue
            ts, tl = [], []
            for _ in range(rounds):
                t = time.perf_counter()
                p0.backward(vals, grad)
                tl.append(time.perf_counter() - t)
                t = time.perf_counter()
                plan.backward(vals, grad)
                ts.append(time.perf_counter() - t)
            rec["timing"][str(k)] = {"timed": True, "planner_estimate_s": est_s, "first_call_s": first,
                                     "backward_s": float(np.median(ts)),
                                     "linear_s": float(np.median(tl)),
                                     "ratio_vs_linear": float(np.median(tl) / np.median(ts)),
                                     "max_abs_err_vs_levels0": err, "rel_err_vs_levels0": err / scale}
            log(f"[{scope}] K={k} backward {rec['timing'][str(k)]}")
            del plan, g
            gc.collect()
        t = time.perf_counter()
        auto = spscan.plan(feats, x1, prune_zeros=True, levels="auto")
        rec["auto"] = {"levels": auto.levels, "plan_s": time.perf_counter() - t,
                       "candidates_s": {str(k): v for k, v in auto.core.candidates.items()},
                       "explored": auto.core.explored_levels}
        log(f"[{scope}] auto: {rec['auto']}")
        rec["bp_pruned"] = pruned_bp
        rec["bp_unpruned"] = unpruned
        rec["peak_rss_gib"] = _rss_gib()
        record["scopes"][scope] = rec
        del auto, p0, jac, persample
        gc.collect()
    return record


def carry_times(rec: dict[str, Any], prev: dict[str, Any], source: str) -> None:
    """Take the load-dependent numbers (backward and linear-scan times, plan times) of ``prev``, a record of
    the same study made on a quiet machine, for every depth ``rec`` did not time; ``source`` says which."""
    for sc, r in rec["scopes"].items():
        p = prev.get("scopes", {}).get(sc)
        if p is None:
            continue
        for k, tm in r["timing"].items():
            old = p.get("timing", {}).get(k, {})
            if not tm.get("timed") and old.get("timed"):
                for key in ("first_call_s", "backward_s", "linear_s", "ratio_vs_linear"):
                    tm[key] = old[key]
                tm["timed"] = True
                tm["times_from"] = source
        r["plan_s_measured_busy"] = dict(r["plan_s"])
        r["plan_s"] = {k: p["plan_s"].get(k, v) for k, v in r["plan_s"].items()}
        if "auto" in r and "auto" in p:
            r["auto"]["plan_s_measured_busy"] = r["auto"]["plan_s"]
            r["auto"]["plan_s"] = p["auto"]["plan_s"]
    rec["timing_note"] = (f"Times (plan time, backward, linear scan) are from {source}: this run was made on a busy "
                          "machine and re-measured only what does not depend on load (index memory, plan sizes, "
                          "FLOPs, storage, the planner's estimates, gradients against `levels=0`).")


# --- report --------------------------------------------------------------------------------

def _n(v: float) -> str:
    return f"{v:.3g}"


def write_report(rec: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "vgg11_study.json").write_text(json.dumps(rec, indent=1, default=float))
    scope = "layer" if "layer" in rec["scopes"] else next(iter(rec["scopes"]))
    lines = [f"## Pruned VGG-11 study (Figure 10), channels/{rec['divisor']}, {100 * rec['prune_amount']:.0f} % pruned",
             "", f"Device: {rec['device']}. Network: VGG-11 (conv features + 512->10 head) trained "
             f"{rec['training']['steps']} Adam steps of batch {rec['training']['batch']} on "
             f"{rec['training']['data']} (loss {rec['training']['loss_first']:.3f} -> {rec['training']['loss_last']:.3f}), "
             "then magnitude-pruned (no retraining). The paper's depth is `levels=2` (Figure 3 numbers the input "
             "row L0). Timings: `spscan.backward`, batch 1, float64, median of "
             f"{rec.get('rounds', 3)} runs interleaved with the linear scan (`levels=0`) of the same run. FLOPs are per sample; *largest step* is the largest node of any step; *critical path* sums "
             "each step's largest node (all of the linear-scan middle). *Planner's estimate*: its cost model "
             "(CPU profile) over the steps it planned (pair lists, row-wise, dense GEMM, mat-vecs), batch 1; a depth "
             f"whose estimate is over {rec.get('time_limit_s', 120):.0f} s is not timed.", ""]
    if rec.get("timing_note"):
        lines += [rec["timing_note"], ""]
    for sc, r in rec["scopes"].items():
        lines += [f"### {sc} magnitude pruning", "",
                  "Conv weight density kept: " + ", ".join(f"{k} {v:.3f}" for k, v in r["conv_density"].items()), "",
                  "| K | paper: largest step | paper: critical path | paper: largest / BP max (unpruned) "
                  "| spscan: largest step | spscan: critical path | spscan: largest / BP max (pruned) "
                  "| plan time | index memory (planner's estimate / held: distinct integer buffers of the plan and its "
                  "bound tables) | planner's estimate, B=1 | backward, B=1 | linear scan | grads vs K=0 (rel) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for k in range(r["max_levels"] + 1):
            kk = str(k)
            pa = r["paper"][kk]["summary"]
            ss = r["spscan"].get(kk, {}).get("summary")
            idx = r["index"].get(kk)
            tm = r["timing"].get(kk, {})
            refused = r["refused"].get(kk)
            cells = [kk, _n(pa["max_step_flops"]), _n(pa["critical_path_flops"]), f"{pa['max_step_vs_bp_max']:.2f}x"]
            if ss is None:
                why = f"refused: {refused}" if refused else "not planned in this run (depth cap)"
                cells += [why, "", "", "", "", "", "", "", ""]
            else:
                cells += [_n(ss["max_step_flops"]), _n(ss["critical_path_flops"]), f"{ss['max_step_vs_bp_max']:.1f}x",
                          f"{r['plan_s'][kk]:.1f} s",
                          f"{idx['estimate_plan_bytes'] / 2**30:.2f} / {idx['held_bytes'] / 2**30:.2f} GiB"
                          if "held_bytes" in idx else f"{idx['estimate_plan_bytes'] / 2**30:.2f} GiB / see below"]
                est_s = tm.get("planner_estimate_s", r.get("planner_backward_s", {}).get(kk))
                cells.append(f"{est_s:.3g} s" if est_s is not None else "")
                if tm.get("timed"):
                    cells += [f"{tm['backward_s']:.3g} s", f"{tm['linear_s']:.3g} s", f"{tm['rel_err_vs_levels0']:.1e}"]
                elif "rel_err_vs_levels0" in tm:
                    cells += ["not re-timed", "", f"{tm['rel_err_vs_levels0']:.1e}"]
                else:
                    cells += ["not timed (over the time limit)", "", ""]
            lines.append("| " + " | ".join(cells) + " |")
        for note in r.get("index_measured", []):
            lines += ["", note]
        a = r["auto"]
        stored = []
        for k in range(r["max_levels"] + 1):
            steps = r["spscan"].get(str(k), {}).get("steps")
            if steps:
                mm = [s for s in steps if s["kind"] == "mm"]
                stored.append(f"K={k}: {sum(bool(s.get('densified')) for s in mm)} of {len(mm)} products dense "
                              f"({sum(s.get('algo') == 'gemm' for s in mm)} GEMM)")
        if stored:
            lines += ["", "Storage (each product dense or its own pattern, by the cost of the product and mat-vecs "
                      "that read it): " + "; ".join(stored) + "."]
        lines += ["", f"Planner's own choice (`levels=\"auto\"`, CPU profile): K={a['levels']} "
                  f"(estimated critical path per depth: " + ", ".join(
                      f"K={k}: {v:.3g} s" for k, v in a["candidates_s"].items()) + f"; planned in {a['plan_s']:.1f} s).", ""]
    # figure: both conventions side by side at levels=2 for the first scope
    r = rec["scopes"][scope]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (name, steps, bp) in zip(axes, [
            ("paper convention (per-sample, zeros eliminated; BP = unpruned)", r["paper"]["2"]["steps"],
             r["bp_unpruned"]),
            ("spscan convention (plan once; BP = pruned SpMVs)", r["spscan"].get("2", {}).get("steps", []),
             r["bp_pruned"])]):
        step_flops_scatter(ax, steps, bp, "FLOP per sample")
        ax.set_title(name, fontsize=9)
    fig.suptitle(f"Pruned VGG-11 ({scope} magnitude pruning, {100 * rec['prune_amount']:.0f}%), levels=2: Figure 10 "
                 "under both conventions")
    fig.tight_layout()
    fig.savefig(out / "vgg11_fig10.png", dpi=110)
    lines.append("![Figure 10 under both conventions](vgg11_fig10.png)")
    path = out / "vgg11_study.md"
    path.write_text("\n".join(lines) + "\n")
    return path


# --- pytest-benchmark entry ----------------------------------------------------------------

_STUDY: dict[int, dict[str, Any]] = {}  # one study per channel divisor and session (both rows read it)


@pytest.mark.parametrize("choice", ["paper", "auto"])
def test_vgg11_pruned_flops(benchmark, choice):
    """One row per choice (the paper's depth, ``levels=2``, and the planner's): FLOPs of both conventions."""
    benchmark.group = "paper-vgg11"
    divisor = cfg.VGG_CHANNEL_DIVISOR
    if divisor not in _STUDY:
        _STUDY[divisor] = run_study(divisor, scopes=("layer",), train_steps=10 if cfg.QUICK else 60,
                                    samples=2 if cfg.QUICK else 4, rounds=cfg.ROUNDS,
                                    time_limit_s=30 if cfg.QUICK else 120, log=lambda *a: None)
    rec = _STUDY[divisor]
    r = rec["scopes"]["layer"]
    k = cfg.VGG_PAPER_LEVELS if choice == "paper" else r["auto"]["levels"]
    k = min(k, r["max_levels"])
    ss = r["spscan"].get(str(k))
    tm = r["timing"].get(str(k), {})
    benchmark.pedantic(lambda: None, rounds=1)
    benchmark.extra_info.update(
        cfg.common_info(), experiment="vgg_flops", choice=choice, levels=k, max_levels=r["max_levels"], n=r["n"],
        channel_divisor=divisor, prune_amount=cfg.VGG_PRUNE_AMOUNT, training=rec["training"],
        pruning="torch.nn.utils.prune.l1_unstructured on every conv and linear weight of the briefly trained model",
        plan_s=r["plan_s"].get(str(k)), symbolic_walk_s=r["paper"][str(k)]["walk_s"],
        steps=ss["steps"] if ss else r["paper"][str(k)]["steps"], baseline_ops=r["bp_pruned"],
        paper_convention=r["paper"][str(k)]["summary"], spscan_convention=ss["summary"] if ss else None,
        backward_timed=bool(tm.get("timed")), backward_ratio_vs_linear=tm.get("ratio_vs_linear"),
        planner_candidates_s=r["auto"]["candidates_s"], planner_explored_levels=r["auto"]["explored"],
        planner_refused=r["refused"].get(str(k)), index=r["index"].get(str(k)), timing=tm,
        **(ss["summary"] if ss else r["paper"][str(k)]["summary"]),
    )
    if tm.get("timed"):
        assert tm["rel_err_vs_levels0"] <= 1e-10


if __name__ == "__main__":
    # python bench/test_paper_vgg.py [OUT_DIR [DIVISOR [TIMES_FROM.json LABEL]]]: with an earlier record, the
    # backward is not timed (a busy machine) and that record's times are reported, labelled LABEL
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/results/cpu-2core")
    div = int(sys.argv[2]) if len(sys.argv) > 2 else cfg.VGG_CHANNEL_DIVISOR
    prev = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else None
    t0 = time.perf_counter()
    record = run_study(div, log=lambda *a: print(*a, flush=True), time_backward=prev is None)
    record["study_s"] = time.perf_counter() - t0
    if prev is not None:
        carry_times(record, prev, sys.argv[4] if len(sys.argv) > 4 else sys.argv[3])
    print(write_report(record, out))
