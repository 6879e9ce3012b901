"""Real model-parallel steps (Gloo CPU processes): every torch.distributed.pipelining schedule and
spscan's scan give autograd's gradients (float64) on the same MLP, and the bytes they report."""

import numpy as np
import torch

from spscan.pipeline.realrun import _data, build_mlp, compare, reference_grads

CFG = dict(dims=[16, 24, 24, 24, 8], batch=8, microbatches=4, warmup=0, steps=1, update=False, return_grads=True,
           dtype=torch.float64, cost_reps=1)


def _check(res, cfg, methods):
    model = build_mlp(cfg["dims"], 0, torch.float64)
    x, y = _data(cfg)
    ref = {n: g.numpy() for n, g in zip([n for n, _ in model.named_parameters()], reference_grads(model, x, y))}
    for name in methods:
        got = {}
        for r in res:
            got.update(r["methods"][name]["grads"])
        assert sorted(got) == sorted(ref), name
        for k in ref:
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-10, atol=1e-12, err_msg=f"{name}: {k}")


def test_all_schedules_and_scan_exact_two_ranks():
    methods = ["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "scan"]
    res = compare(CFG, methods, world=2)
    _check(res, CFG, methods)
    elem = 8
    # GPipe/1F1B: one cut after module 4 (width 24): activations forward and gradients back, all 8 rows
    assert [r["methods"]["GPipe"]["bytes_sent"] for r in res] == [8 * 24 * elem] * 2
    # the scan: rank 0 sends x_{b_1} forward, rank 1 sends dl/dx_{b_1} (its spine vector) in round 0
    assert [r["methods"]["scan"]["bytes_sent"] for r in res] == [8 * 24 * elem] * 2
    assert all(len(r["methods"][m]["times"]) == 1 for r in res for m in methods)
    assert res[0]["link"] is not None and res[0]["link"][0] > 0


def test_scan_exact_three_ranks():
    # three processes on fewer cores: correctness only; rank 1 reduces its slice, two rounds
    cfg = dict(CFG, dims=[16, 24, 24, 24, 24, 8])
    res = compare(cfg, ["scan", "GPipe"], world=3)
    _check(res, cfg, ["scan", "GPipe"])
    assert res[1]["methods"]["scan"]["bytes_sent"] > 8 * 24 * 8  # a composite, not just a vector
