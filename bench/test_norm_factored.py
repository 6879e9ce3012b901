"""A diagonal-plus-rank-2 ``J^T`` (LayerNorm/GroupNorm) in planned products: dense per-group blocks
vs the factored form as two chain elements, with the core API (``spscan.plan`` on patterns, random
values).

``test_norm_form_wrap`` times the same comparison end to end through ``spscan.wrap`` (``norm_form``
``"dense"``, ``"factored"`` and the planner's ``"auto"`` choice, backward of a training step,
interleaved) and records which form ``"auto"`` chose.

Run: ``pytest bench/test_norm_factored.py --benchmark-only -s``. Per normalized group of ``N``
elements ``J^T = D - U V^T`` (``r = 2``): the dense form stores the ``N x N`` block; the factored form
is ``[D | -U]`` (``N x (N + r)``) followed by ``[I ; V^T]`` (``(N + r) x N``), ``3N`` entries per group
each. Chains: ``mlp`` = (Linear(256) -> LayerNorm(256) -> GELU) x 2 -> Linear(256, 10); ``cnn`` =
(conv 3x3, 16 channels, 4x4 -> GroupNorm(4 groups of 64) -> ReLU) x 2. Float32, B = 8, one thread,
``time.process_time``; both forms are planned at the same forced depth and timed interleaved in the
same run; ``extra_info`` holds both medians and planned bytes (from ``plan.summary()``).
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn

import spscan
from spscan.layers import make_unit

from conftest import device_name

BATCH, ROUNDS = 8, 5


def _canonical(m) -> sp.csr_array:
    m = sp.csr_array(m)
    m.sum_duplicates()
    m.sort_indices()
    return m


def _factors(d: int, n: int) -> list[sp.csr_array]:
    """``[D | -U]`` and ``[I ; V^T]`` patterns for ``d / n`` groups of ``n`` (two rank columns each)."""
    grp = np.arange(d) // n
    extra = d + 2 * (d // n)
    rows = np.concatenate([np.arange(d)] * 3)
    cols = np.concatenate([np.arange(d), d + 2 * grp, d + 2 * grp + 1])
    ones = np.ones(3 * d)
    return [_canonical(sp.csr_array((ones, (rows, cols)), shape=(d, extra))),
            _canonical(sp.csr_array((ones, (cols, rows)), shape=(extra, d)))]


def _chain(kind: str, model: str) -> list[sp.csr_array]:
    if model == "mlp":
        d = n = 256
        first = last = _canonical(np.ones((d, d)))
        tail = [_canonical(np.ones((d, 10)))]
    else:
        c, h = 16, 4
        d, n = c * h * h, 4 * h * h
        first = last = _canonical(make_unit(0, nn.Conv2d(c, c, 3, padding=1), (c, h, h), (c, h, h)).pattern)
        tail = []
    norm = [_canonical(sp.block_diag([np.ones((n, n))] * (d // n)))] if kind == "dense" else _factors(d, n)
    eye = _canonical(sp.identity(d))
    return [first, *norm, eye, last, *norm, eye, *tail]


def _bytes(plan) -> str:
    total = [line for line in plan.summary().splitlines() if line.startswith("total")]
    return " ".join(total[0].split()[-3:-1]) if total else "?"  # "... <bytes> <unit> <est. time>"


@pytest.mark.slow
@pytest.mark.parametrize("levels", [0, 1])
@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_norm_dense_vs_factored(benchmark, model, levels):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {}
        for kind in ("dense", "factored"):
            pats = _chain(kind, model)
            plan = spscan.plan(pats, levels=levels, dtype=torch.float32, batch_size=BATCH)
            gen = torch.Generator().manual_seed(0)
            vals = [torch.randn(BATCH, p.nnz, generator=gen) for p in pats]
            grad = torch.randn(BATCH, pats[-1].shape[1], generator=gen)
            runs[kind] = (plan, vals, grad, sum(p.nnz for p in pats))

        def once(kind: str) -> float:
            plan, vals, grad, _ = runs[kind]
            t0 = time.process_time()
            spscan.backward(plan, vals, grad)
            return time.process_time() - t0

        for _ in range(2):
            once("dense"), once("factored")
        pairs = [(once("dense"), once("factored")) for _ in range(ROUNDS)]
        dense, fact = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        benchmark.group = f"norm-factored-{model}-levels{levels}"
        benchmark.pedantic(lambda: once("factored"), rounds=3)
        benchmark.extra_info.update(
            device=device_name(), threads=1, model=model, levels=levels, batch=BATCH,
            dense_median_s=dense, factored_median_s=fact, factored_vs_dense=fact / dense,
            dense_input_nnz=runs["dense"][3], factored_input_nnz=runs["factored"][3],
            dense_planned=_bytes(runs["dense"][0]), factored_planned=_bytes(runs["factored"][0]), timer="process_time")
        print(f"\n{model} levels={levels}: dense blocks {dense * 1e3:.1f} ms ({_bytes(runs['dense'][0])} planned), "
              f"factored {fact * 1e3:.1f} ms ({_bytes(runs['factored'][0])}), factored/dense {fact / dense:.2f}x")
    finally:
        torch.set_num_threads(threads)


def _wrap_model(model: str) -> tuple[nn.Module, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if model == "cnn":  # conv 3x3 -> GroupNorm(4 groups of 64): the blocks fill the conv's products
        c = 16
        net = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c), nn.ReLU(),
                            nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c), nn.ReLU())
        return net, torch.randn(BATCH, c, 4, 4, generator=gen)
    if model == "mlp":  # Linear(256) -> LayerNorm(256): the products are dense either way
        d = 256
        net = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.GELU(), nn.Linear(d, d), nn.LayerNorm(d),
                            nn.GELU(), nn.Linear(d, 10))
        return net, torch.randn(BATCH, d, generator=gen)
    # 16 tokens of 64 features: per-token 1x1 conv, LayerNorm over the features, softmax over them
    net = nn.Sequential(nn.Conv1d(16, 16, 1), nn.LayerNorm(64), nn.GELU(), nn.Conv1d(16, 16, 1), nn.LayerNorm(64),
                        nn.Softmax(dim=-1))
    return net, torch.randn(BATCH, 16, 64, generator=gen)


@pytest.mark.slow
@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("model", ["cnn", "mlp", "tokens"])
def test_norm_form_wrap(benchmark, one_thread, model, levels):
    from conftest import time_mode

    torch.manual_seed(0)
    net, x = _wrap_model(model)
    x.requires_grad_(True)
    forms = ("dense", "factored", "auto")
    plans = {}
    wrapped = {}
    for form in forms:
        t0 = time.process_time()
        wrapped[form] = spscan.wrap(net, x, levels=levels, norm_form=form)
        plans[form] = time.process_time() - t0

    def once(form: str) -> float:
        w = wrapped[form]
        return time_mode("backward", lambda: w(x).square().sum(), time.process_time)

    for _ in range(2):
        for form in forms:
            once(form)
    runs = {form: [] for form in forms}
    for _ in range(ROUNDS + 2):
        for form in forms:
            runs[form].append(once(form))
    med = {form: statistics.median(v) for form, v in runs.items()}
    chosen = "factored" if any(wrapped["auto"].plan.factored) else "dense"
    benchmark.group = f"norm-form-wrap-{model}-levels{levels}"
    benchmark.pedantic(lambda: once("auto"), rounds=3)
    benchmark.extra_info.update(
        device=device_name(), threads=1, model=model, levels=levels, batch=BATCH, auto_chose=chosen,
        **{f"{f}_backward_s": med[f] for f in forms}, **{f"{f}_plan_s": plans[f] for f in forms},
        factored_speedup=med["dense"] / med["factored"], timer="process_time")
    print(f"\n{model} levels={levels}: backward dense {med['dense'] * 1e3:.2f} ms, factored "
          f"{med['factored'] * 1e3:.2f} ms (dense/factored {med['dense'] / med['factored']:.2f}x), auto chose "
          f"{chosen} ({med['auto'] * 1e3:.2f} ms); planning {plans['dense']:.2f} / {plans['factored']:.2f} / "
          f"{plans['auto']:.2f} s")
