"""Paper Figure 10: FLOPs of every BPPSA step on the pruned VGG-11 conv chain vs backprop's gradient operators.

The chain is VGG-11's convolutional part on 32x32 inputs as in the paper's Figure 3 (8 x
(conv 3x3 + ReLU) and 5 max-pools: 21 transposed Jacobians). A seeded model is pruned by
magnitude (``torch.nn.utils.prune.l1_unstructured``, 97 % of every conv weight, made permanent)
and planned with ``prune_zeros=True`` so the pruned weights leave the patterns. No retraining:
the pattern, not the values, decides the FLOPs.

For a schedule of depth ``K`` every node's FLOPs come from the symbolic products: an up-sweep
``mm`` node ``A @ B`` costs ``2 * pairs(A, B)`` (the planned pair count), an ``mv`` node costs
``2 * nnz(M)``. The x-axis of the figure is what the same node would cost if the matrices were
dense. The baseline's "gradient operators" are the linear scan's SpMVs, ``2 * nnz(J_i^T)``.
Choices: the paper's (up-sweep L0-L2, i.e. ``levels=3``, linear scan, down-sweep) and the
planner's automatic depth. The symbolic walk below is pattern-only (SciPy boolean products and
pair counts), so it also works where the planner's pair-list budget refuses a depth.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn
from torch.nn.utils import prune

import spscan
from spscan.planner.planning import step_costs
from spscan.planner.schedule import blelloch_schedule, max_levels

import paper_config as cfg

VGG11_CFG = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


def pruned_vgg11_convs(divisor: int = 1, amount: float = cfg.VGG_PRUNE_AMOUNT, seed: int = 0) -> nn.Sequential:
    """VGG-11's conv+ReLU+max-pool chain (channels divided by ``divisor``), magnitude-pruned per conv."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    c = 3
    for v in VGG11_CFG:
        if v == "M":
            layers.append(nn.MaxPool2d(2, 2))
            continue
        v = max(1, int(v) // divisor)
        conv = nn.Conv2d(c, v, 3, padding=1)
        prune.l1_unstructured(conv, "weight", amount=amount)
        prune.remove(conv, "weight")  # zeros become part of the weight, the mask goes away
        layers += [conv, nn.ReLU()]
        c = v
    return nn.Sequential(*layers)


def _count_pairs(a: sp.csr_array, b: sp.csr_array) -> int:
    """Multiply pairs of ``A @ B`` (half its FLOPs) without forming the product."""
    return int(np.diff(b.indptr)[a.indices].sum())


def symbolic_step_flops(patterns: list[sp.csr_array], levels: int) -> list[dict[str, Any]]:
    """One record per scan node of the depth-``levels`` schedule: phase, level, kind, FLOPs (sparse and dense).

    ``critical`` marks, per step, the node with the most FLOPs (it bounds the step's time when
    the step's nodes run in parallel); every node of the linear-scan middle is critical.
    """
    n = len(patterns)
    sched = blelloch_schedule(n, levels)
    mats = {i: sp.csr_array(p, dtype=bool) for i, p in enumerate(patterns)}
    rows: list[dict[str, Any]] = []
    for step in sched.steps:
        recs = []
        for op in step.mm:
            a, b = mats[op.left], mats[op.right]
            recs.append(dict(kind="mm", flops=2 * _count_pairs(a, b), dense_flops=2 * a.shape[0] * a.shape[1] * b.shape[1]))
            mats[op.out] = sp.csr_array(a @ b, dtype=bool)  # later mv nodes need its nnz
        for op in step.mv:
            m = mats[op.mat]
            recs.append(dict(kind="mv", flops=2 * m.nnz, dense_flops=2 * m.shape[0] * m.shape[1]))
        top = max(range(len(recs)), key=lambda i: recs[i]["flops"]) if recs else -1
        for i, r in enumerate(recs):
            r.update(phase=step.phase, level=step.level, critical=step.phase == "mid" or i == top)
            rows.append(r)
    return rows


def _chain(divisor: int):
    model = pruned_vgg11_convs(divisor)
    x = torch.randn(1, 3, 32, 32)
    t0 = time.perf_counter()
    base = spscan.plan(model, x, prune_zeros=True, levels=0)
    return model, x, base, time.perf_counter() - t0


@pytest.mark.parametrize("choice", ["paper", "auto"])
def test_vgg11_pruned_flops(benchmark, choice):
    benchmark.group = "paper-vgg11"
    divisor = cfg.VGG_CHANNEL_DIVISOR
    model, x, base, plan0_s = _chain(divisor)
    patterns = [sp.csr_array(p) for p in base.patterns]
    n = len(patterns)
    info: dict[str, Any] = {}
    plan = None
    t0 = time.perf_counter()
    if choice == "auto":
        plan = spscan.plan(model, x, prune_zeros=True, levels="auto")
        levels = plan.levels
        info["planner_candidates_s"] = {str(k): v for k, v in plan.core._scan.candidates.items()}
        info["planner_explored_levels"] = plan.core._scan.explored
    else:
        levels = min(cfg.VGG_PAPER_LEVELS, max_levels(n))
        try:
            plan = spscan.plan(model, x, prune_zeros=True, levels=levels)
        except ValueError as e:  # the planner's pair-list budget; the FLOP walk below still runs
            info["planner_refused"] = str(e)
    info["plan_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    steps = symbolic_step_flops(patterns, levels)
    info["symbolic_walk_s"] = time.perf_counter() - t0
    if plan is not None:
        # cross-check: the plan's own per-step FLOPs (dense-stored products count their full size in mv)
        info["plan_step_flops"] = [int(c.flops) for c in step_costs(plan.core._scan)]
    baseline = [dict(kind="bp", flops=2 * p.nnz, dense_flops=2 * p.shape[0] * p.shape[1], layer=i + 1)
                for i, p in enumerate(patterns)]

    if plan is not None:
        _, jac = spscan.forward(plan, x)
        grad = torch.randn(1, plan.patterns[-1].shape[1])
        values = list(jac.values)
        spscan.backward(plan.core, values, grad)
        benchmark.pedantic(lambda: spscan.backward(plan.core, values, grad), rounds=cfg.ROUNDS, warmup_rounds=1)
        bp_s = cfg.median_time(lambda: spscan.backward(base.core, values, grad), cfg.ROUNDS)
        info["linear_scan_backward_s"] = bp_s
        info["backward_ratio_vs_linear"] = bp_s / benchmark.stats.stats.median
    else:
        benchmark.pedantic(lambda: None, rounds=1)
        info["backward_timed"] = False
    crit = sum(s["flops"] for s in steps if s["critical"])
    benchmark.extra_info.update(
        cfg.common_info(), experiment="vgg_flops", choice=choice, levels=levels, max_levels=max_levels(n), n=n,
        channel_divisor=divisor, prune_amount=cfg.VGG_PRUNE_AMOUNT,
        pruning="torch.nn.utils.prune.l1_unstructured on every conv weight of a seeded (untrained) model",
        plan_linear_s=plan0_s, layer_nnz=[int(p.nnz) for p in patterns],
        steps=steps, baseline_ops=baseline,
        total_flops=int(sum(s["flops"] for s in steps)), critical_path_flops=int(crit),
        baseline_total_flops=int(sum(b["flops"] for b in baseline)),
        max_step_flops=int(max(s["flops"] for s in steps)), max_baseline_flops=int(max(b["flops"] for b in baseline)),
        flops_per_sample=True, **info,
    )
