"""Structured recurrences: the planner's descriptor, the fused kernels and the periodic binding.

The kernels (:mod:`spscan.kernels.triton.recurrence`) run in Triton's interpreter here (compiled on a GPU)
against a float64 loop over the run's own table (:mod:`recurrence_cases`), for every period the
recurrent chains make, in both directions (the backward's ``S E`` and the Newton forward's ``E S``):
odd block sizes, ``H = 1``, one fused step, batch 1, a step count that is not a multiple of the
chunk, additive terms on some steps or none, float32 and float64, and the GPU's launch
configurations. End to end: ``spscan.wrap`` of ``nn.RNN``/``nn.GRU``/``nn.LSTM`` on the Triton
backend against float64 autograd, with the kernels that ran recorded.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import spscan
from spscan.runtime import PeriodicValues
from spscan.kernels.triton import launch
from spscan.kernels.triton.recurrence import recurrence_scratch, run_recurrence
from spscan.kernels.triton.backend import _compiled
from spscan.planner.cost import profile_for
from spscan.planner.patterns import as_chain
from spscan.planner.planning import plan_scan
from spscan.planner.recurrence import periodic_structure, recurrence_of

from recurrence_cases import PERIODS, build, reference

DEVICE = torch.device("cuda") if _compiled() else torch.device("cpu")
FUSED = {"recurrence_chunk_kernel", "recurrence_carry_kernel"}


def _check(kind, n, steps, batch, adds, dtype, chunk, device_mode=False, seed=0):
    op, S, P, V = build(kind, n, steps, batch, adds, seed=seed, dtype=dtype)
    rec = recurrence_of(op, min_steps=1)
    assert rec is not None, kind
    saved = launch.mode
    launch.mode = "device" if device_mode else saved
    try:
        cfg = launch.recurrence_config(rec.n, rec.ny, max(steps, launch.RECURRENCE_MIN_STEPS), chunk=chunk)
    finally:
        launch.mode = saved
    cfg = dataclasses.replace(cfg, chunk=chunk, chunks=-(-steps // chunk))
    ref = reference(op, S, P, V)
    cols = np.concatenate([np.arange(o, o + r) for o, r in zip(op.out, op.rows)])
    Vk = V.clone()
    Vk[:, cols] = float("nan")  # every output must be written
    S, P, Vk = S.to(DEVICE), P.to(DEVICE), Vk.to(DEVICE)
    scratch = torch.full((batch, recurrence_scratch(rec, cfg)), float("nan"), dtype=dtype, device=DEVICE)
    run_recurrence(rec, S, P, Vk, scratch, cfg)
    got = Vk.cpu().double()
    scale = float(ref[:, cols].abs().max())
    err = float((got[:, cols] - ref[:, cols]).abs().max()) / scale
    untouched = np.setdiff1d(np.arange(V.shape[1]), cols)
    assert torch.equal(got[:, untouched], V.double()[:, untouched]), "wrote outside the run's outputs"
    return err, rec


@pytest.mark.parametrize("kind", PERIODS)
def test_every_period_matches_float64_loop(kind):
    err, rec = _check(kind, 5, 23, 3, 20, torch.float64, chunk=5)
    assert err < 1e-12, err
    assert rec.order == (1 if kind.endswith("_fwd") else 0)
    err, _ = _check(kind, 3, 17, 2, 0, torch.float32, chunk=4)
    assert err < 2e-6, err


@pytest.mark.parametrize("kind", ["rnn", "gru", "lstm_fwd"])
@pytest.mark.parametrize("n, steps, batch, adds, chunk", [
    (1, 9, 2, 9, 4),     # H = 1
    (7, 1, 2, 1, 4),     # one fused step: one chunk, no composition
    (6, 11, 1, 4, 11),   # batch 1, one chunk
    (4, 13, 3, 13, 1),   # chunks of one step
    (9, 10, 5, 0, 3),    # no additive terms; a short last chunk
])
def test_edge_shapes(kind, n, steps, batch, adds, chunk):
    err, _ = _check(kind, n, steps, batch, adds, torch.float64, chunk)
    assert err < 1e-12, err


@pytest.mark.parametrize("kind", ["rnn", "lstm"])
def test_gpu_launch_configurations(kind):
    """The GPU's configurations (lanes per program, sample rows, warps), here in the interpreter."""
    err, _ = _check(kind, 20, 19, 17, 10, torch.float32, chunk=6, device_mode=True)
    assert err < 2e-6, err


def test_descriptor_refuses_what_is_not_one_recurrence():
    op, _, _, _ = build("rnn", 4, 10, 2, 5)
    assert recurrence_of(op) is not None
    moved = dataclasses.replace(op, mat_offset=op.mat_offset + np.where(op.shared, np.arange(op.steps), 0))
    assert recurrence_of(moved) is None  # shared values that move between periods (a general chain)
    mixed = op.add.copy()
    mixed[0] = 3  # an additive term inside a period
    assert recurrence_of(dataclasses.replace(op, add=mixed)) is None
    gap = op.add.copy()
    gap[2 * 2 + 1] = -1  # additive terms with a gap
    assert recurrence_of(dataclasses.replace(op, add=gap)) is None
    short = dataclasses.replace(op, dense=op.dense[:-1], shared=op.shared[:-1], rows=op.rows[:-1], cols=op.cols[:-1],
                                mat_offset=op.mat_offset[:-1], layers=op.layers[:-1], add=op.add[:-1],
                                out=op.out[:-1], pattern=op.pattern[:-1])
    assert recurrence_of(short) is None  # not a whole number of periods
    assert recurrence_of(op, min_steps=11) is None


def test_cost_model_sees_the_recurrence():
    from spscan.recurrent.cells import recurrent_patterns

    for kind, layout_steps in ((nn.RNN, 2), (nn.GRU, 3), (nn.LSTM, 2)):
        pats = as_chain(recurrent_patterns(kind(1, 20), 300, "factored"))
        per, fused, macs = periodic_structure(list(reversed(pats)))
        assert (per, fused) == (layout_steps, 300) and macs > 0
        assert plan_scan(pats, "auto", profile_for("cuda"), batch_hint=16).levels == 0
    assert periodic_structure(as_chain(recurrent_patterns(nn.RNN(1, 20), 300, "materialized"))) is None


def test_periodic_binding_holds_shared_values_once():
    from spscan.recurrent.cells import CELLS, recurrent_patterns

    T, H, B = 12, 5, 3
    pats = recurrent_patterns(nn.RNN(2, H), T, "factored")
    plan = spscan.plan(pats, levels=0, backend="torch")
    plain = plan.bind([True, False] * T)
    periodic = plan.bind([True, False] * T, period=2)
    assert periodic.program.size_s == plain.program.size_s - (T - 1) * H * H
    w = torch.randn(H, H, dtype=torch.float64)
    d = torch.rand(T, B, H, dtype=torch.float64)
    values = CELLS["rnn_tanh"].jacobian_values("factored", {"d": d}, w, H)
    g = torch.randn(B, H, dtype=torch.float64)
    a = periodic.run(values, g)
    b = plain.run(values, g)
    for i in range(2 * T + 1):
        assert torch.allclose(a[i], b[i], rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="periodic"):
        periodic.run(list(values), g)
    with pytest.raises(ValueError, match="period"):
        plan.bind([True, False] * T, period=5)
    with pytest.raises(ValueError, match="period"):
        plan.bind([True, False] * (T - 1) + [False, False], period=2)


def _autograd_grads(mod, x, loss_of):
    x = x.detach().requires_grad_(True)
    loss_of(mod(x)).backward()
    return [x.grad] + [p.grad.clone() for p in mod.parameters()]


@pytest.mark.parametrize("cell, forward", [(nn.RNN, "sequential"), (nn.GRU, "sequential"), (nn.LSTM, "sequential"),
                                           (nn.RNN, "newton"), (nn.LSTM, "newton")])
def test_wrapped_modules_run_the_fused_kernels(cell, forward):
    """``spscan.wrap`` on the Triton backend: the recurrence kernels run, gradients equal float64 autograd,
    with a loss on every step and on the last one, a batch that changes, repeated backwards."""
    torch.manual_seed(0)
    T, H = 18, 6
    mod = cell(3, H).double().to(DEVICE)
    x = torch.randn(T, 4, 3, dtype=torch.float64, device=DEVICE)
    w = spscan.wrap(mod, x, backend="triton", levels=0, forward=forward)
    ramp = None

    def every_step(out):
        nonlocal ramp
        o = out[0]
        if ramp is None or ramp.shape != o.shape:
            ramp = torch.linspace(-1, 1, o.numel(), dtype=o.dtype, device=o.device).view_as(o)
        return (o * ramp).sum()

    last = lambda out: (out[0][-1] ** 2).sum()  # noqa: E731
    # each signature twice: on a GPU the second call replays the backward's CUDA graph
    for rep, (loss_of, batch) in enumerate(((every_step, 4), (every_step, 4), (last, 4), (last, 4), (every_step, 1),
                                             (every_step, 1))):
        xb = x[:, :batch] * (1.0 + 0.1 * rep)  # new inputs and weights every call
        with torch.no_grad():
            for p in mod.parameters():
                p.mul_(0.98)
        with launch.recording(dry_run=False) as rec:
            xg = xb.detach().requires_grad_(True)
            mod.zero_grad()
            loss_of(w(xg)).backward()
        got = [xg.grad] + [p.grad.clone() for p in mod.parameters()]
        mod.zero_grad()
        want = _autograd_grads(mod, xb, loss_of)
        mod.zero_grad()
        # eager launches are recorded; a CUDA graph's replays are not: then the bound tables say what runs
        ran = {r.kernel for r in rec} | {name for b in w.plan.scan_plan(T, DEVICE, torch.float64).bindings()
                                         for st in b.tables.steps for item in st if hasattr(item, "rec")
                                         for name in FUSED}
        assert FUSED <= ran
        for a, b in zip(got, want):
            assert float((a - b).abs().max()) <= 1e-10 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("cell", [nn.RNN, nn.GRU, nn.LSTM])
def test_graphed_backward_replays_on_new_inputs(cell, monkeypatch):
    """The CUDA-graph backward's bookkeeping (inputs copied into its own buffers, outputs copied out,
    one entry per signature), with a stand-in recorder that replays by running the backward again on
    those buffers, so it runs anywhere: every call equals the eager backward, for new upstream
    gradients, new forward values, new weights and a changed batch size."""
    from spscan.recurrent.plan import plan_recurrent
    from spscan.recurrent.backward import GraphedBackward as _GraphedBackward

    def record(fn, device):  # a stand-in recording: a replay runs the call again on the same buffers
        fn()
        return fn, None

    torch.manual_seed(1)
    mod = cell(2, 5).double()
    plan = plan_recurrent(mod, torch.randn(7, 3, 2, dtype=torch.float64), backend="torch")
    graphed = _GraphedBackward(record)
    for step, batch in enumerate((3, 3, 3, 2, 3)):
        with torch.no_grad():
            for p in mod.parameters():
                p.add_(0.01 * torch.randn_like(p))
        x = torch.randn(7, batch, 2, dtype=torch.float64)
        (out, _), saved = plan.forward(x, None)
        go = torch.randn_like(out)
        gh = torch.randn(1, batch, 5, dtype=torch.float64)
        gc = torch.randn(1, batch, 5, dtype=torch.float64) if cell is nn.LSTM else None
        want = plan._backward(saved, go, gh, gc)
        got = graphed(plan, saved, (go, gh, gc), None)
        for k, v in want.items():
            assert (v is None) == (got[k] is None), k
            if v is not None:
                torch.testing.assert_close(got[k], v, rtol=1e-12, atol=1e-12)
    assert len(graphed.entries) == 2  # one per batch size


@pytest.mark.parametrize("cell", [nn.RNN, nn.GRU, nn.LSTM])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_periodic_chain_through_the_engine_matches_the_reference(cell, dtype):
    """A recurrent chain's patterns and random periodic values through ``spscan.plan`` at depth 0 and a
    periodic binding (the fused kernels), against ``spscan.reference`` in float64, with additive terms
    on every step for two batch sizes on one binding; with terms on every other step the run is not one
    recurrence and takes the general kernels, as correct."""
    from spscan.recurrent.cells import cell_for, recurrent_patterns
    from spscan.reference import reference_backward

    T, H = 17, 5
    mod = cell(1, H)
    rec_cell = cell_for(mod)
    pats = recurrent_patterns(mod, T, "factored")
    per = len(rec_cell.factored_layout(H))
    shared = rec_cell.shared_flags(H)
    plan = spscan.plan(pats, levels=0, backend="triton", device=DEVICE, dtype=dtype)
    dims = [p.shape[0] for p in pats] + [pats[-1].shape[1]]
    every = [i % per == 0 and 0 < i < per * T for i in range(per * T + 1)]  # a loss on every step
    some = [e and i % (2 * per) == 0 for i, e in enumerate(every)]  # on every other: not one recurrence
    g = torch.Generator().manual_seed(3)
    for has_extra, batch in ((every, 3), (every, 1), (some, 2)):
        bound = plan.bind(shared * T, has_extra, DEVICE, period=per)
        fused = any(hasattr(item, "rec") for st in bound.tables.steps for item in st)
        assert fused == (has_extra is every)
        elements = [torch.randn(p.nnz, generator=g, dtype=torch.float64) * 0.3 if sh else
                    torch.rand(T, batch, p.nnz, generator=g, dtype=torch.float64)
                    for p, sh in zip(plan.patterns[:per], shared)]
        values = PeriodicValues(elements, T)
        grad = torch.randn(batch, dims[-1], generator=g, dtype=torch.float64)
        extra = [torch.randn(batch, d, generator=g, dtype=torch.float64) if e else None
                 for d, e in zip(dims, has_extra)]
        want = reference_backward(pats, list(values), grad, extra)
        got = bound.run(PeriodicValues([e.to(DEVICE, dtype) for e in elements], T), grad.to(DEVICE, dtype),
                        [None if e is None else e.to(DEVICE, dtype) for e in extra])
        scale = max(float(w.abs().max()) for w in want)
        err = max(float((got[i].double().cpu() - want[i]).abs().max()) for i in range(len(want))) / scale
        assert err < (1e-12 if dtype == torch.float64 else 2e-6), err


def test_stacked_bidirectional_module_runs_the_fused_kernels():
    """A 2-layer bidirectional GRU through ``spscan.wrap`` on the Triton backend: every (layer, direction)
    is a structured recurrence, and the gradients equal float64 autograd's."""
    torch.manual_seed(2)
    T = 17
    mod = nn.GRU(3, 4, num_layers=2, bidirectional=True).double().to(DEVICE)
    x = torch.randn(T, 2, 3, dtype=torch.float64, device=DEVICE)
    w = spscan.wrap(mod, x, backend="triton", levels=0)
    xg = x.clone().requires_grad_(True)
    (w(xg)[0] ** 2).sum().backward()
    got = [xg.grad] + [p.grad.clone() for p in mod.parameters()]
    mod.zero_grad()
    want = _autograd_grads(mod, x, lambda out: (out[0] ** 2).sum())
    for a, b in zip(got, want):
        assert float((a - b).abs().max()) <= 1e-10 * max(1.0, float(b.abs().max()))
    layers = w.plan.layer_plans
    assert len(layers) == 4
    for p in layers:
        assert any(hasattr(item, "rec") for b in p.scan_plan(T, DEVICE, torch.float64).bindings()
                   for st in b.tables.steps for item in st)
