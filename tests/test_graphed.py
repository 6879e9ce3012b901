"""The backward replayed from a CUDA graph (:mod:`spscan.graphed`, ``spscan.wrap(..., backward="graph")``).

The bookkeeping runs anywhere with a stand-in recorder whose replay runs the recorded call again on the
same buffers (a CUDA graph replays the same launches on them): the inputs copied in, the outputs copied
out, one entry per signature, what cannot be replayed run eagerly. Every result must equal the eager
backward's bit for bit. ``tests/test_gpu.py`` records real graphs on a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spscan
from spscan.choices import layers_decision
from spscan.graphed import GraphedCall
from spscan.resnet import ResNet20


def fake_record(fn, device):
    fn()
    return fn, None


def failing_record(fn, device):
    raise RuntimeError("operation not permitted when stream is capturing")


# ----------------------------------------------------------------------------- GraphedCall


def test_replays_on_new_inputs_and_returns_tensors_of_its_own():
    calls = []

    def fn(a, pair, scale):
        calls.append(1)
        return {"sum": a + pair[0], "prod": a * pair[1] * scale, "none": None}

    g = GraphedCall(fake_record)
    a, b, c = (torch.randn(3, 4, dtype=torch.float64) for _ in range(3))
    first = g(fn, (a, (b, c), 2.0))
    assert len(g.entries) == 1 and first["none"] is None
    kept = {k: v.clone() for k, v in first.items() if v is not None}
    for _ in range(3):
        a2, b2, c2 = (torch.randn(3, 4, dtype=torch.float64) for _ in range(3))
        got = g(fn, (a2, (b2, c2), 2.0))
        assert torch.equal(got["sum"], a2 + b2) and torch.equal(got["prod"], a2 * c2 * 2.0)
        assert got["none"] is None
    assert len(g.entries) == 1
    # results are the caller's: a later call does not change them
    assert all(torch.equal(first[k], v) for k, v in kept.items())
    # another non-tensor value is another signature
    g(fn, (a, (b, c), 3.0))
    assert len(g.entries) == 2


def test_same_tensor_twice_is_one_input():
    g = GraphedCall(fake_record)
    fn = lambda x, y: x * y  # noqa: E731
    a = torch.randn(5)
    assert torch.equal(g(fn, (a, a)), a * a)
    b = torch.randn(5)
    assert torch.equal(g(fn, (b, b)), b * b)
    c = torch.randn(5)
    assert torch.equal(g(fn, (b, c)), b * c)  # no longer the same tensor: another signature
    assert len(g.entries) == 2


def test_result_aliasing_an_input_is_copied():
    g = GraphedCall(fake_record)
    a = torch.randn(4)
    out = g(lambda x: x.view(2, 2), (a,))
    b = torch.randn(4)
    g(lambda x: x.view(2, 2), (b,))
    assert torch.equal(out, a.view(2, 2))


def test_what_cannot_be_replayed_runs_eagerly():
    g = GraphedCall(fake_record)
    w = torch.randn(3, requires_grad=True) * 1.0
    assert torch.equal(g(lambda x: x.detach() * 2, (w,)), w.detach() * 2)  # an autograd graph
    assert torch.equal(g(lambda x, o: x * 2, (w.detach(), [bytearray(2)])), w.detach() * 2)  # an unhashable object
    assert not g.entries
    bad = GraphedCall(failing_record)
    x = torch.randn(3)
    assert torch.equal(bad(lambda t: t + 1, (x,)), x + 1)
    assert len(bad.eager) == 1
    assert torch.equal(bad(lambda t: t + 1, (x,)), x + 1)  # known: eager without trying again
    assert not bad.entries


def test_keeps_at_most_max_graphs():
    g = GraphedCall(fake_record)
    for n in range(1, GraphedCall.MAX_GRAPHS + 3):
        x = torch.randn(n)
        assert torch.equal(g(lambda t: t * 3, (x,)), x * 3)
    assert len(g.entries) == GraphedCall.MAX_GRAPHS


def test_hold_is_kept_with_the_graph():
    g = GraphedCall(fake_record)
    buf = [torch.zeros(2)]
    g(lambda t: t + 1, (torch.randn(2),), hold=lambda: buf)
    (entry,) = g.entries.values()
    assert entry.held is buf


# ----------------------------------------------------------------------------- wrapped models


def _lenet():
    return nn.Sequential(nn.Conv2d(3, 4, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 6, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6 * 2 * 2, 7), nn.ReLU(), nn.Linear(7, 5))


def _ln_mlp():
    return nn.Sequential(nn.Linear(12, 16), nn.LayerNorm(16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 16),
                         nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))


MODELS = {
    "lenet": (_lenet, (3, 16, 16)),
    "resnet": (lambda: ResNet20(width=4), (3, 8, 8)),
    "ln_mlp_dropout": (_ln_mlp, (12,)),
    "bn_cnn": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                                     nn.AvgPool2d(2), nn.Flatten(), nn.Linear(3 * 3 * 3, 4)), (2, 6, 6)),
}


def _graphed(model, x, monkeypatch):
    w = spscan.wrap(model, x, backward="scan")
    monkeypatch.setattr(w, "_choice", lambda key: "graph")
    w.plan._graphed = GraphedCall(fake_record)
    return w


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_graphed_wrapper_equals_eager_bitwise(name, dtype, monkeypatch):
    """Train-mode steps (dropout, batch statistics) at changing batch sizes, with and without the
    input's gradient, weights changed between steps: gradients equal to the eager scan's bit for bit,
    one recorded graph per signature."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().to(dtype).train()
    eager_model = copy.deepcopy(model)
    x0 = torch.randn(3, *shape, dtype=dtype)
    g = _graphed(model, x0, monkeypatch)
    e = spscan.wrap(eager_model, x0, backward="scan")
    for step, (batch, want_x) in enumerate([(3, False), (3, True), (3, False), (2, False), (3, False), (2, True)]):
        with torch.no_grad():
            for p, q in zip(model.parameters(), eager_model.parameters()):
                p.add_(0.01 * step)
                q.add_(0.01 * step)
        x = torch.randn(batch, *shape, dtype=dtype)
        xs = []
        for w, m in ((g, model), (e, eager_model)):
            xi = x.clone().requires_grad_(want_x)
            for p in m.parameters():
                p.grad = None
            torch.manual_seed(100 + step)  # the same dropout masks on both sides
            w(xi).square().sum().backward()
            xs.append(xi)
        for (n, p), q in zip(model.named_parameters(), eager_model.parameters()):
            assert torch.equal(p.grad, q.grad), f"{name} step {step}: {n}"
        if want_x:
            assert torch.equal(xs[0].grad, xs[1].grad)
    assert len(g.plan._graphed.entries) == 4  # (batch 3, 2) x (with, without the input's gradient)


def test_graphed_wrapper_backward_twice(monkeypatch):
    torch.manual_seed(0)
    model = _lenet().double()
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    g = _graphed(model, x, monkeypatch)
    y = g(x).square().sum()
    y.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    y.backward()
    assert all(torch.equal(p.grad, 2 * f) for p, f in zip(model.parameters(), first))
    y2 = g(x).square().sum()
    y2.backward()
    with pytest.raises(RuntimeError, match="second time"):
        y2.backward()


def test_graph_is_a_candidate_only_on_a_gpu(monkeypatch):
    model = _lenet()
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(ValueError, match="'graph' is not a candidate"):
        spscan.wrap(model, x, backward="graph")
    units = spscan.wrap(model, x, backward="scan").plan.units
    cpu = layers_decision(units, 64, torch.device("cpu"), "auto", "")
    assert [c.name for c in cpu.candidates] == ["scan", "native"]
    monkeypatch.setattr("spscan.choices.device_label", lambda device: "a GPU")
    gpu = layers_decision(units, 64, torch.device("cuda"), "auto", "")
    assert [c.name for c in gpu.candidates] == ["scan", "native", "graph"]
    assert all(c.predicted_s > 0 for c in gpu.candidates)
    assert "CUDA graph" in gpu.explain()


def test_an_opaque_node_rules_the_graph_out(monkeypatch):
    """A unit whose saved state carries an autograd graph (an opaque node) cannot be replayed."""
    from spscan.layers.opaque import OpaqueUnit

    class Odd(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=1)  # no analytic unit: an opaque node

    model = nn.Sequential(nn.Linear(6, 6), Odd(), nn.Linear(6, 2))
    x = torch.randn(3, 6)
    w = spscan.wrap(model, x, backward="scan")
    assert any(isinstance(u, OpaqueUnit) for u in w.plan.units)
    monkeypatch.setattr("spscan.choices.device_label", lambda device: "a GPU")
    gpu = layers_decision(w.plan.units, 3, torch.device("cuda"), "auto", "")
    assert "graph" not in [c.name for c in gpu.candidates]
    # and forced through the graphed path, it runs eagerly (same gradients)
    monkeypatch.setattr(w, "_choice", lambda key: "graph")
    w.plan._graphed = GraphedCall(fake_record)
    w(x).sum().backward()
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    assert not w.plan._graphed.entries


# ----------------------------------------------------------------------------- on a GPU: real graphs

def setup_function(function):
    if "cuda" in function.__name__ and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.gpu
def test_cuda_graph_backward_equals_eager_bitwise(name, dtype, monkeypatch):
    """``backward="graph"`` records one CUDA graph per signature (none falls back to eager) and every
    step's gradients equal the eager scan's bit for bit, for new inputs, weights, masks and batch sizes
    (cuDNN's deterministic algorithms: its default weight gradients may sum in any order)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().to("cuda", dtype).train()
    eager_model = copy.deepcopy(model)
    x0 = torch.randn(3, *shape, dtype=dtype, device="cuda")
    g = spscan.wrap(model, x0, backward="graph")
    e = spscan.wrap(eager_model, x0, backward="scan")
    for step, (batch, want_x) in enumerate([(3, False), (3, True), (3, False), (2, False), (3, False), (2, True)]):
        with torch.no_grad():
            for p, q in zip(model.parameters(), eager_model.parameters()):
                p.add_(0.01 * step)
                q.add_(0.01 * step)
        x = torch.randn(batch, *shape, dtype=dtype, device="cuda")
        xs = []
        for w, m in ((g, model), (e, eager_model)):
            xi = x.clone().requires_grad_(want_x)
            for p in m.parameters():
                p.grad = None
            torch.manual_seed(100 + step)
            w(xi).square().sum().backward()
            xs.append(xi)
        for (n, p), q in zip(model.named_parameters(), eager_model.parameters()):
            assert torch.equal(p.grad, q.grad), f"{name} step {step}: {n}"
        if want_x:
            assert torch.equal(xs[0].grad, xs[1].grad)
    graphed = g.plan._graphed
    assert not graphed.eager, "a signature could not be recorded"
    assert len(graphed.entries) == 4


@pytest.mark.gpu
def test_cuda_graph_backward_matches_autograd_in_float64():
    torch.manual_seed(0)
    model = ResNet20(width=4).to("cuda", torch.float64).train()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64, device="cuda")
    g = spscan.wrap(model, x, backward="graph")
    for _ in range(3):
        for m in (model, ref):
            for p in m.parameters():
                p.grad = None
        g(x).square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert float((p.grad - q.grad).abs().max()) <= 1e-9 * max(1.0, float(q.grad.abs().max()))


@pytest.mark.gpu
def test_cuda_auto_decision_offers_the_graph():
    model = _lenet().cuda()
    w = spscan.wrap(model, torch.randn(64, 3, 16, 16, device="cuda"))
    assert "graph" in [c.name for c in w.decision.candidates]
    w(torch.randn(64, 3, 16, 16, device="cuda")).sum().backward()  # whatever it chose runs
