"""The planner's decision point: candidates, the scan-or-native choice of a wrapped model, profiles."""

import copy
import json
import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn as nn

import spscan
from spscan.cli.calibration import calibrate
from spscan.runtime.choices import current_key
from spscan.planner.choose import Candidate, choose
from spscan.planner.step_profile import StepProfile, forget_loaded, reference_profile


def test_choose_lowest_forced_and_unknown():
    a, b, c = Candidate("a", 2.0), Candidate("b", 1.0), Candidate("c", None)
    d = choose("q", [a, b, c])
    assert d.chosen is b and not d.forced and d.candidate("a") is a
    assert choose("q", [a, b, c], forced="a").chosen is a
    assert choose("q", [c]).chosen is c  # alone: chosen without a prediction
    assert choose("q", [Candidate("x", 1.0), Candidate("y", 1.0)]).chosen.name == "x"  # first among equals
    kept = choose("q", [Candidate("s", 0.95), Candidate("n", 1.0)], incumbent="n", margin=1.1)
    assert kept.chosen.name == "n" and "kept unless another is predicted 1.1x faster" in kept.explain()
    assert "q: n (kept: within 1.1x" in kept.explain()
    won = choose("q", [Candidate("s", 0.5), Candidate("n", 1.0)], incumbent="n", margin=1.1)
    assert won.chosen.name == "s" and "n is kept unless another is predicted 1.1x faster" in won.explain()
    assert won.margin == 1.1 and won.incumbent == "n"  # the threshold travels with the decision
    with pytest.raises(ValueError, match="'z' is not a candidate"):
        choose("q", [a, b], forced="z")
    with pytest.raises(ValueError, match="no candidate"):
        choose("q", [])
    text = d.explain()
    assert "q: b (lowest predicted" in text and "2 s" in text and "1 s" in text and "*" in text


def test_plan_explains_its_depth():
    p = spscan.plan([sp.csr_array(sp.eye(3))] * 20)
    d = p.decision
    assert d.chosen.value == p.levels and d.question == "scan depth" and not d.forced
    assert set(c.value for c in d.candidates) == set(p.candidates)
    forced = spscan.plan([sp.csr_array(sp.eye(3))] * 20, levels=2).decision
    assert forced.forced and forced.chosen.name == "depth 2"
    assert "depth 2 (forced" in spscan.plan([sp.csr_array(sp.eye(3))] * 20, levels=2).explain()


def _chain():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 3 * 3, 4))


def _grads(net, x):
    x = x.clone().requires_grad_(True)
    net.zero_grad(set_to_none=True)
    out = net(x)
    out = out[0] if isinstance(out, tuple) else out
    out.square().sum().backward()
    return [x.grad] + [p.grad for p in net.parameters()]


@pytest.mark.parametrize("kind", ["chain", "graph", "rnn", "stacked"])
def test_native_backward_is_autograd_bit_for_bit(kind):
    if kind == "chain":
        model, x = _chain(), torch.randn(5, 2, 8, 8, dtype=torch.float64)
    elif kind == "graph":
        class Res(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

            def forward(self, x):
                return self.b(torch.relu(self.a(x)) + x)

        torch.manual_seed(0)
        model, x = Res(), torch.randn(4, 6, dtype=torch.float64)
    elif kind == "rnn":
        torch.manual_seed(0)
        model, x = nn.GRU(3, 5), torch.randn(7, 2, 3, dtype=torch.float64)
    else:
        torch.manual_seed(0)
        model, x = nn.LSTM(3, 4, num_layers=2, bidirectional=True), torch.randn(6, 2, 3, dtype=torch.float64)
    model = model.double()
    ref = copy.deepcopy(model)
    wrapped = spscan.wrap(model, x, backward="native")
    assert wrapped.decision.chosen.name == "native" and wrapped.decision.forced
    for step in range(2):  # repeated steps, and a changed batch size
        xs = x if step == 0 else torch.cat([x, x], 1 if kind in ("rnn", "stacked") else 0)
        got, want = _grads(wrapped, xs), _grads(ref, xs)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def _profile(native_cost: float, scan_cost: float) -> StepProfile:
    """The reference CPU profile with every layer costing ``native_cost`` / ``scan_cost`` seconds."""
    prof = reference_profile("cpu")
    fams = {f: {"native": (native_cost, 0.0), "scan": (scan_cost, 0.0)} for f in prof.families}
    rec = {c: {"native": (0.0, native_cost, 0.0, 0.0), "scan": (0.0, scan_cost, 0.0, 0.0)} for c in prof.recurrent}
    return StepProfile("test", "cpu", {"native": 0.0, "scan": 0.0}, fams, rec, "calibrated", "test")


@pytest.fixture
def calibrated_as(tmp_path, monkeypatch):
    """Install a profile as this machine's calibrated one (in a temporary cache)."""
    monkeypatch.setenv("SPSCAN_CACHE_DIR", str(tmp_path))
    forget_loaded()

    def install(prof: StepProfile) -> None:
        prof.save(tmp_path / f"{current_key(torch.device('cpu'))}.json")
        forget_loaded()

    yield install
    forget_loaded()


def test_the_scan_margin_is_a_profile_threshold_explain_shows(calibrated_as):
    """``backward="auto"`` keeps native unless the scan is predicted ``scan_margin`` times faster: a profile
    file may set it (round trip), bad values are refused, and the decision names it."""
    import dataclasses

    x = torch.randn(4, 2, 8, 8)
    prof = _profile(native_cost=1e-3, scan_cost=0.5e-3)  # the scan predicted 2x faster
    calibrated_as(prof)
    d = spscan.wrap(_chain(), x, backward="auto").decision
    assert d.chosen.name == "scan" and d.margin == 1.1 and "native is kept unless another is predicted 1.1x" in d.explain()
    calibrated_as(dataclasses.replace(prof, scan_margin=3.0))
    d = spscan.wrap(_chain(), x, backward="auto").decision
    assert d.chosen.name == "native" and "(kept: within 3x" in d.explain() and "predicted 3x faster" in d.explain()
    assert StepProfile.from_json(dataclasses.replace(prof, scan_margin=3.0).to_json()).scan_margin == 3.0
    for bad in ({"scan_margin": 0.5}, {"scan_margin": True}, {"graph_max_activation_bytes": -1},
                {"graph_max_activation_bytes": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            StepProfile.from_json({**prof.to_json(), **bad})
    legacy = prof.to_json()
    del legacy["scan_margin"], legacy["graph_max_activation_bytes"]  # a file written before they were fields
    assert StepProfile.from_json(legacy).scan_margin == 1.1


def test_plans_are_made_with_the_machine_profiles_critical_path(calibrated_as):
    """One profile per machine: the critical-path constants a plan's depth is decided with are the machine
    profile's (the device class's, with the profile file's overrides, checked on load)."""
    import dataclasses

    pats = [sp.csr_array(sp.eye(3))] * 20
    base = spscan.plan(pats).candidates
    prof = dataclasses.replace(reference_profile("cpu"), critical_path_overrides={"op_overhead_s": 1e-3, "chain_step_s": 1e-3})
    calibrated_as(prof)
    slow = spscan.plan(pats).candidates
    assert slow[0] > 10 * base[0]  # the linear scan priced with the override (deeper scans now explored too)
    assert StepProfile.from_json(prof.to_json()).critical_path.op_overhead_s == 1e-3
    with pytest.raises(ValueError, match="critical_path: 'op_overhead_s'"):
        StepProfile.from_json({**prof.to_json(), "critical_path": {"op_overhead_s": -1.0}})


def test_auto_follows_the_profile(calibrated_as):
    x = torch.randn(4, 2, 8, 8)
    calibrated_as(_profile(native_cost=1e-3, scan_cost=1e-4))
    w = spscan.wrap(_chain(), x, backward="auto")
    assert w.decision.chosen.name == "scan" and w.decision.basis.endswith("(calibrated on this machine)")
    calibrated_as(_profile(native_cost=1e-4, scan_cost=1e-3))
    w = spscan.wrap(_chain(), x, backward="auto")
    d = w.decision
    assert d.chosen.name == "native" and d.candidate("scan").predicted_s == pytest.approx(5e-3)
    text = w.explain()
    assert "backward (batch 4): native" in text and "scan depth" in text and "5 ms" in text
    ref = copy.deepcopy(w.model)
    for g, want in zip(_grads(w, x), _grads(ref, x)):  # chosen, not forced: autograd's gradients bit for bit
        assert torch.equal(g, want)
    rnn = spscan.wrap(nn.RNN(3, 4), torch.randn(10, 2, 3), backward="auto")
    assert rnn.decision.chosen.name == "native" and "T 10, batch 2" in rnn.decision.question


def test_another_per_sample_shape_is_planned_for_its_shape(calibrated_as, monkeypatch):
    """A fully convolutional model fed images of another size than the example's: each size is planned on first
    use and runs the scan as chosen for it (with autograd's gradients), under ``auto`` and a forced scan; the
    plans are kept per size, up to MAX_SHAPE_PLANS."""
    from spscan.chain.wrapper import MAX_SHAPE_PLANS

    calibrated_as(_profile(native_cost=1e-3, scan_cost=1e-4))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(3, 4)).double()
    ref = copy.deepcopy(model)
    for backward in ("auto", "scan"):
        w = spscan.wrap(model, torch.randn(4, 2, 8, 8, dtype=torch.float64), backward=backward)
        assert w.decision.chosen.name == "scan"
        assert "an input of another per-sample shape is planned for its shape on first use" in w.explain()
        ran = []
        run_step = type(w.plan).run_step
        monkeypatch.setattr(type(w.plan), "run_step", lambda self, *a, **k: ran.append(self.in_shape) or
                            run_step(self, *a, **k))
        for size in (8, 11, 8, 11):
            x = torch.randn(4, 2, size, size, dtype=torch.float64)
            ran.clear()
            got, want = _grads(w, x), _grads(ref, x)
            assert ran == [(2, size, size)]
            for g, h in zip(got, want):
                assert (g - h).abs().max().item() <= 1e-12 * max(1.0, h.abs().max().item())
        if backward == "auto":  # a forced mode decides nothing per call: explain() shows the example's decision
            assert "input (B, 2, 11, 11)" in w.explain()
        monkeypatch.undo()
        for size in range(12, 12 + MAX_SHAPE_PLANS + 2):  # older plans are let go
            w(torch.randn(2, 2, size, size, dtype=torch.float64, requires_grad=True)).sum().backward()
        assert len(w._plans) == MAX_SHAPE_PLANS


def test_decision_per_batch_size(calibrated_as):
    prof = _profile(1e-4, 1e-4)
    prof.base = {"native": 0.0, "scan": 5e-2}  # a fixed cost: the scan wins only on big batches
    prof.families["ConvUnit"] = {"native": (0.0, 1e-6), "scan": (0.0, 1e-7)}
    calibrated_as(prof)
    w = spscan.wrap(_chain(), torch.randn(64, 2, 8, 8), backward="auto")
    assert w.decision.chosen.name == "scan"
    small = torch.randn(1, 2, 8, 8, requires_grad=True)
    w(small).sum().backward()
    assert w.decision.question == "backward (batch 1)" and w.decision.chosen.name == "native"
    assert small.grad is not None


def test_backward_option_errors_and_environment(monkeypatch):
    x = torch.randn(2, 2, 8, 8)
    with pytest.raises(ValueError, match="backward: expected one of"):
        spscan.wrap(_chain(), x, backward="fast")
    with pytest.raises(TypeError, match="pass it to spscan.wrap"):
        spscan.plan(_chain(), x, backward="native")
    with pytest.raises(TypeError, match="'backward' is for"):
        spscan.plan([sp.csr_array(sp.eye(2))], backward="native")
    monkeypatch.setenv("SPSCAN_BACKWARD", "native")
    assert spscan.wrap(_chain(), x).backward_mode == "native"
    spscan.plan([sp.csr_array(sp.eye(2))])  # the environment sets no option a chain of patterns lacks


def test_calibration_is_cached_and_read(calibrated_as, tmp_path):
    prof = calibrate("cpu", reps=1, recurrent=False)
    saved = json.loads((tmp_path / f"{current_key(torch.device('cpu'))}.json").read_text())
    assert saved["source"] == "calibrated" and set(saved["families"]) >= {"ConvUnit", "csr", "default"}
    assert all(v >= 0 for regs in prof.families.values() for pair in regs.values() for v in pair)
    w = spscan.wrap(_chain(), torch.randn(3, 2, 8, 8), backward="auto")
    assert "calibrated on this machine" in w.decision.basis


def test_reference_profiles_load():
    for dev in ("cpu", "cuda"):
        p = reference_profile(dev)
        assert p.device_type == dev and {"rnn", "gru", "lstm"} <= set(p.recurrent)
        assert p.layers_time([("NoSuchUnit", 100.0)], "scan") > 0  # an unknown family costs the default's


def test_auto_never_refuses_a_model_the_scan_cannot_plan():
    class Branchy(nn.Module):  # data-dependent control flow: fx cannot trace it, the scan cannot plan it
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)

        def forward(self, x):
            y = self.fc(x)
            return y.relu() if y.sum() > 0 else y.tanh()

    torch.manual_seed(0)
    model, x = Branchy().double(), torch.randn(3, 5, dtype=torch.float64)
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="runs autograd's own backward"):
        net = spscan.wrap(model, x, backward="auto")
    assert net.decision.chosen.name == "native" and "not available" in net.explain()
    for g, want in zip(_grads(net, x), _grads(ref, x)):
        assert torch.equal(g, want)
    with pytest.raises(spscan.NotPlannable, match="cannot capture its forward"):
        spscan.wrap(model, x, backward="scan")


def test_auto_falls_back_only_for_what_the_scan_cannot_plan():
    """backward="auto" runs autograd's backward for a model the scan cannot plan, not for the user's own
    errors: a forward that fails without tracing and a bad option raise as they would without spscan."""

    class Buggy(nn.Module):  # fails under fx *and* eagerly: the model's error, not a refusal
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)
            self.bn = nn.BatchNorm1d(5)

        def forward(self, x):
            y = self.bn(self.fc(x))
            if y.sum() > 0:  # fx cannot trace this; eager gets past it
                y = y.relu()
            return torch.cat(y, y)  # TypeError: cat takes a sequence

    torch.manual_seed(0)
    model, x = Buggy().double(), torch.randn(3, 5, dtype=torch.float64)
    stats = model.bn.running_mean.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(TypeError, match="cat") as info:
            spscan.wrap(model, x, backward="auto")
    assert not isinstance(info.value, spscan.NotPlannable)
    assert torch.equal(model.bn.running_mean, stats)  # the eager check left the statistics alone
    with pytest.raises(TypeError, match="dtype"):
        spscan.wrap(_chain(), torch.randn(2, 2, 8, 8), backward="auto", dtype=torch.float16)
    assert issubclass(spscan.NotPlannable, TypeError)  # code that caught TypeError still does


def test_wrapped_chain_keeps_its_memory_budget():
    """The depth-0 wrapper's step loop checks the plan's max_memory as the engine does."""
    torch.manual_seed(0)
    model = _chain().double()
    x = torch.randn(2, 2, 8, 8, dtype=torch.float64)
    limit = 16 * spscan.plan(model, x, levels=0).core.memory().backward_peak(1)  # batch 2 fits, 64 does not
    net = spscan.wrap(model, x, levels=0, max_memory=limit, backward="scan")
    ref = copy.deepcopy(model)
    for g, want in zip(_grads(net, x), _grads(ref, x)):
        assert torch.allclose(g, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="max_memory"):
        _grads(net, torch.randn(64, 2, 8, 8, dtype=torch.float64))


class _WithEncoder(nn.Module):
    """A linear layer, then a torch encoder layer as a submodule (an opaque node: fx keeps torch.nn layers
    whole), then a linear layer."""

    def __init__(self, d: int, ff: int) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.enc = nn.TransformerEncoderLayer(d, 2, dim_feedforward=ff, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        return self.out(self.enc(self.inp(x)))


def test_opaque_nodes_are_priced_by_their_own_operations(calibrated_as):
    """An opaque node costs what its operations cost, in both regimes: its matrix products as linear layers
    of their multiply-adds (here the encoder layer's four projections, two feed-forward layers and two
    attention products), its other operations as elementwise layers. A bigger node is priced higher."""
    calibrated_as(reference_profile("cpu", 1))
    S, d, B = 8, 32, 4
    x = torch.randn(B, S, d)
    times = {}
    for ff in (64, 1024):
        w = spscan.wrap(_WithEncoder(d, ff), x, backward="auto")
        (unit,) = [u for u in w.plan.units if "opaque" in u.name]
        own = unit.own_cost
        macs = S * (4 * d * d + 2 * d * ff) + 2 * S * S * d  # per sample
        products = sum(work for family, work in own if family == "LinearUnit")
        assert macs <= products <= macs * 1.2  # plus the elements each product writes
        assert sum(1 for family, _ in own if family == "ElementwiseUnit") >= 8  # softmax, norms, adds, relu, ...
        terms = unit.cost_terms(B)
        assert all(t[2] == "native" for t in terms[:-1]) and len(terms[-1]) == 2  # own ops; the wrapping
        times[ff] = {c.name: c.predicted_s for c in w.decision.candidates}
    prof = reference_profile("cpu", 1)
    extra = (2 * S * d * (1024 - 64) * B) * prof.families["LinearUnit"]["native"][1]  # the wider feed-forward
    for regime in ("native", "scan"):
        assert times[1024][regime] - times[64][regime] >= 0.9 * extra


def test_units_are_priced_by_the_work_of_their_operators():
    """A normalization's operator is O(d) (not its dense blocks' G N^2 entries), a product of activations
    costs its multiply-adds, attention its two products and the softmax of its scores."""
    B = 4
    gn = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.Softmax(1))
    plan = spscan.plan(gn, torch.randn(B, 3, 16, 16))
    _, norm, soft = plan.units
    d = 32 * 16 * 16
    for u in (norm, soft):
        assert u.cost_family == "LayerNormUnit" and u.cost_work(B) == B * 3 * d
        assert u.pattern.nnz >= 32 * d  # the dense blocks the work no longer counts

    class Attend(nn.Module):
        def forward(self, x):
            s = x @ x.transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(s, s, s)

    S, E = 6, 5
    w = spscan.wrap(Attend(), torch.randn(B, S, E), backward="scan")
    kinds = {u.name: u for u in w.plan.units}
    (t,) = kinds["matmul"].cost_terms(B)
    assert t[0] == "LinearUnit" and t[1] >= B * S * E * S  # the first product: (S, E) @ (E, S)
    (prod, soft) = kinds["attention"].cost_terms(B)
    assert prod[0] == "LinearUnit" and prod[1] >= B * 2 * S * S * S  # q k^T and P v; q, k, v (S, S)
    assert soft == ("LayerNormUnit", B * 3 * S * S)


def test_the_critical_path_model_prices_operators_by_their_work():
    """Layers the wrapper applies by their own operator (a convolution's, a GroupNorm's backward kernel) are
    costed at a kernel's rate on their operator's work, not as CSR mat-vecs of their patterns (a GroupNorm's
    dense blocks, 2 x 1024^2 entries per sample here): the depth-0 estimate is a step's order of magnitude."""
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 256, 4))
    x = torch.randn(4, 3, 16, 16)
    with_ops = spscan.plan(m, x, levels=0)
    csr = spscan.plan(m, x, levels=0, operators=False)
    t_ops, t_csr = with_ops.core.candidates[0], csr.core.candidates[0]
    assert t_ops < 0.05 < t_csr and t_csr > 20 * t_ops


def test_whole_model_fit_recovers_its_constants():
    """:func:`fit_whole_models` (a GPU's layer fit) recovers per-regime constants from steps made by them,
    the native-priced terms of an opaque node priced by the native fit in the scan regime and by the
    regime's own in the graph regime (which replays them with the rest of the step)."""
    from spscan.cli.calibration import fit_whole_models, layer_features

    want = {"native": [1e-3, 8e-5, 1e-12], "scan": [9e-4, 1.4e-4, 0.0], "graph": [8e-4, 4e-5, 2e-13]}
    models = [[("ConvUnit", 5e6)] * 2 + [("ElementwiseUnit", 1e5)] * 3,
              [("LinearUnit", 2e6)] * 8,
              [("ConvUnit", 3e7)] * 5 + [("MaxPoolUnit", 1e6)] * 4,
              [("LayerNormUnit", 4e5)] * 12 + [("LinearUnit", 9e6, "native")] * 2]
    samples = []
    for terms in models:
        for regime, c in want.items():
            own, nat = layer_features(terms, regime)
            t = sum(a * b for a, b in zip(c, own)) + sum(a * b for a, b in zip(want["native"], nat))
            samples.append((terms, regime, t))
    got = fit_whole_models(samples)
    for regime, c in want.items():
        np.testing.assert_allclose(got[regime], c, rtol=1e-6, atol=1e-15)


def test_whole_model_fit_keeps_its_scale_where_native_terms_overshoot():
    """A model whose native-priced terms (an opaque node's operations) the native fit prices above the whole
    measured step leaves a negative rest: the fit weighs it by the measured step, so it cannot outweigh
    the other models and drive the constants to zero (as weighing it by its clipped rest did)."""
    from spscan.cli.calibration import fit_whole_models, layer_features

    want = {"native": [1e-3, 8e-5, 0.0], "scan": [5e-4, 1.5e-4, 0.0]}
    models = [[("ConvUnit", 5e6)] * n for n in (4, 8, 16, 32)]
    samples = []
    for terms in models:
        for regime, c in want.items():
            own, nat = layer_features(terms, regime)
            samples.append((terms, regime, sum(a * b for a, b in zip(c, own))))
    opaque = [("LinearUnit", 1e6, "native")] * 40 + [("ConvUnit", 1e5)]
    samples.append((opaque, "native", 4.2e-3))
    samples.append((opaque, "scan", 2.0e-3))  # below the 40 native-priced terms' own cost
    got = fit_whole_models(samples)
    for terms in models:
        own, _ = layer_features(terms, "scan")
        pred = sum(a * b for a, b in zip(got["scan"], own))
        assert 0.7 < pred / sum(a * b for a, b in zip(want["scan"], own)) < 1.3


def test_replayed_regime_prices_an_opaque_nodes_operations_with_its_own_constants():
    """The graph regime replays an opaque node's launches with the rest of the step: its operations are priced
    at the graph's constants; the scan runs them as autograd does: at the native ones."""
    from spscan.planner.step_profile import StepProfile

    fam = {"native": (1e-4, 0.0), "scan": (2e-4, 0.0), "graph": (1e-5, 0.0)}
    prof = StepProfile("t", "cuda", {"native": 0.0, "scan": 0.0, "graph": 0.0}, {"default": dict(fam)})
    terms = [("LinearUnit", 1.0, "native")] * 10 + [("LinearUnit", 1.0)]
    assert prof.layers_time(terms, "scan") == pytest.approx(10 * 1e-4 + 2e-4)
    assert prof.layers_time(terms, "graph") == pytest.approx(11 * 1e-5)
    assert prof.layers_time(terms, "native") == pytest.approx(11 * 1e-4)


def test_gpu_calibration_fits_whole_models_alike_for_every_family(monkeypatch):
    """On a GPU ``calibrate()`` times whole small models (here, on the CPU, what it does with them): every
    family gets the same non-negative constants per regime."""
    from spscan.cli import calibration

    base, families = calibration._fit_models(torch.device("cpu"), torch.float32, 1)
    assert set(base) == {"native", "scan"} and all(v >= 0 for v in base.values())
    first = next(iter(families.values()))
    assert all(f == first for f in families.values()) and "default" in families
    assert all(a >= 0 and b >= 0 for a, b in first.values())
