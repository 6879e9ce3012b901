"""The backward replayed from a CUDA graph (:mod:`spscan.runtime.graphed`, ``spscan.wrap(..., backward="graph")``).

The bookkeeping runs anywhere with a stand-in recorder whose replay runs the recorded call again on the
same buffers (a CUDA graph replays the same launches on them): the inputs copied in, the outputs copied
out, one entry per signature, what cannot be replayed run eagerly. Every result must equal the eager
backward's bit for bit. ``tests/test_gpu.py`` records real graphs on a GPU.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import spscan
from spscan.runtime.choices import graph_activation_bytes, layers_decision, step_profile
from spscan.runtime.graphed import GraphedCall, GraphedStep

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")  # the reference ResNet-20: examples/resnet.py
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from resnet import ResNet20  # noqa: E402


def fake_record(fn, device):
    """A recording stands in for ``torch.cuda.graph``: nothing runs while recording, a replay runs the
    recorded call again (on the same buffers, as a graph's launches do)."""
    return fn, None


def failing_record(fn, device):
    raise RuntimeError("operation not permitted when stream is capturing")


def test_a_recording_is_failed_only_by_its_own_thread(monkeypatch):
    """A capture made inside a training loop fails for what the recording thread does, not for what a
    data loader's threads do meanwhile (pinned memory, copies to the GPU): ``thread_local``."""
    from spscan.runtime import graphed

    seen = {}

    class Graph:
        def replay(self):
            seen["replayed"] = True

    class Capture:
        def __init__(self, graph, **kw):
            seen.update(kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    ran = []
    replay, graph = graphed.record_cuda_graph(lambda: ran.append(1), torch.device("cuda"))
    replay()
    assert ran == [1] and seen == {"capture_error_mode": "thread_local", "replayed": True}


def test_a_workspace_records_its_program_through_the_one_recorder(monkeypatch):
    """A bound program's launches (:meth:`Workspace.replay`) are recorded by ``record_cuda_graph`` as every
    other graph is: run eagerly once, recorded, then replayed per key; at most ``_MAX_GRAPHS`` kept; inside
    a caller's own capture the launches just run (they are recorded there)."""
    from spscan.runtime import workspace as ws

    recorded = []

    def record(fn, device):
        recorded.append(device)
        return fn, None

    monkeypatch.setattr(ws, "record_cuda_graph", record)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    w = ws.Workspace(program=None, device=torch.device("cpu"))
    ran = []
    w.replay(("b", 1), lambda: ran.append(1))  # eager run, then the recording (a stand-in: runs nothing)
    assert ran == [1] and len(recorded) == 1
    w.replay(("b", 1), lambda: ran.append(2))  # replays what was recorded
    assert ran == [1, 1] and len(recorded) == 1
    for b in range(2, 2 + ws._MAX_GRAPHS):
        w.replay(("b", b), lambda: None)
    assert len(w._graphs) == ws._MAX_GRAPHS and ("b", 1) not in w._graphs
    capturing[0] = True
    w.replay(("b", 99), lambda: ran.append(3))
    assert ran[-1] == 3 and ("b", 99) not in w._graphs
    w.release()
    assert not w._graphs


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


def test_an_expanded_input_is_copied_into_a_dense_buffer():
    """The upstream gradient of ``y.sum()`` is an expanded tensor (stride 0): its copy cannot keep that
    stride, since no buffer with it could be written."""
    g = GraphedCall(fake_record)
    fn = lambda gy, w: gy @ w  # noqa: E731
    w = torch.randn(3, 2, dtype=torch.float64)
    for value in (1.0, 2.0, 3.0):
        gy = torch.full((1, 3), value, dtype=torch.float64).expand(4, 3)
        assert torch.equal(g(fn, (gy, w)), gy.contiguous() @ w)
    assert len(g.entries) == 1


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
    # opaque nodes (attention, the layer's own call): their autograd backward is recorded with the step
    "transformer_dropout": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.2, batch_first=True), (5, 8)),
}


def _graphed(model, x, monkeypatch):
    w = spscan.wrap(model, x, backward="scan")
    monkeypatch.setattr(w, "_choice", lambda key: "graph")
    w.plan._graphed = GraphedCall(fake_record)
    w.plan.step_graphs = GraphedStep(w.plan, fake_record)
    return w


# (batch, the input's gradient wanted): every signature twice or more (its first call warms, eager)
STEPS = [(3, False), (3, False), (3, True), (3, True), (3, False), (2, False), (2, False), (2, True), (2, True),
         (3, False)]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_graphed_wrapper_equals_eager_bitwise(name, dtype, monkeypatch):
    """Train-mode steps (dropout, batch statistics) at changing batch sizes, with and without the
    input's gradient, weights changed between steps: gradients equal to the eager scan's bit for bit,
    one recorded graph per signature."""
    _check_equals_eager(name, dtype, "cpu", lambda model, x0: _graphed(model, x0, monkeypatch))


def _check_equals_eager(name, dtype, device, make_graphed):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().to(device, dtype).train()
    eager_model = copy.deepcopy(model)
    x0 = torch.randn(3, *shape, dtype=dtype, device=device)
    g = make_graphed(model, x0)
    e = spscan.wrap(eager_model, x0, backward="scan")
    for step, (batch, want_x) in enumerate(STEPS):
        with torch.no_grad():
            for p, q in zip(model.parameters(), eager_model.parameters()):
                p.add_(0.01 * step)
                q.add_(0.01 * step)
        x = torch.randn(batch, *shape, dtype=dtype, device=device)
        xs = []
        for w, m in ((g, model), (e, eager_model)):
            xi = x.clone().requires_grad_(want_x)
            for p in m.parameters():
                p.grad = None
            torch.manual_seed(100 + step)  # the same dropout masks on both sides (CPU)
            w(xi).square().sum().backward()
            xs.append(xi)
        for (n, p), q in zip(model.named_parameters(), eager_model.parameters()):
            assert torch.equal(p.grad, q.grad), f"{name} step {step}: {n}"
        if want_x:
            assert torch.equal(xs[0].grad, xs[1].grad)
        for a, b in zip(model.buffers(), eager_model.buffers()):  # batch-norm statistics, updated once a step
            assert torch.equal(a, b)
    # one recorded step per (batch 3, 2) x (with, without the input's gradient)
    steps = g.plan.step_graphs
    assert len(steps.entries) == 4 and not any(e.failed for e in steps.entries.values()), \
        [e.error for e in steps.entries.values()]


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


class CountingRecord:
    """:func:`fake_record` that counts recordings and replays."""

    def __init__(self):
        self.recorded = self.replays = 0

    def __call__(self, fn, device):
        self.recorded += 1

        def replay():
            self.replays += 1
            fn()
        return replay, None


def _step_pair(monkeypatch, make=_lenet, shape=(3, 16, 16)):
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    x = torch.randn(2, *shape, dtype=torch.float64)
    g = _graphed(model, x, monkeypatch)
    rec = CountingRecord()
    g.plan.step_graphs = GraphedStep(g.plan, rec)
    return model, ref, g, rec


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


def _train_and_compare(model, ref, wrapped, steps):
    """``steps`` steps of ``wrapped`` and of autograd on ``ref`` on the same inputs, the loss of each kept
    until the next is made (as a training loop keeps it): the gradients agree after every step."""
    loss = None
    for _ in range(steps):
        x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        loss = wrapped(x).square().sum()
        loss.backward()
        ref(x).square().sum().backward()
        for a, b in zip(_grads(model), _grads(ref)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    return loss


def test_step_graph_replays_in_a_training_loop(monkeypatch):
    """The loop people write (the last loss kept until the next step's assignment): after the first
    step of a signature every step is one forward replay and one backward replay, gradients as eager."""
    model, ref, g, rec = _step_pair(monkeypatch)
    _train_and_compare(model, ref, g, 4)
    assert rec.recorded == 2 and rec.replays == 2 * 3  # forward and backward; steps 2-4 replay both
    g.plan.release_buffers()  # graphs and activations freed: the next step warms, the one after records
    _train_and_compare(model, ref, g, 2)
    assert rec.recorded == 4 and rec.replays == 2 * 3 + 2


def test_step_graph_backward_twice_and_micro_batches(monkeypatch):
    model, ref, g, rec = _step_pair(monkeypatch)
    xs = [torch.randn(2, 3, 16, 16, dtype=torch.float64) for _ in range(3)]
    g(xs[0]).sum().backward()  # warms the signature
    y = g(xs[1]).square().sum()
    model.zero_grad(set_to_none=True)
    y.backward(retain_graph=True)
    first = _grads(model)
    y.backward()
    assert all(torch.equal(p.grad, 2 * f) for p, f in zip(model.parameters(), first))
    with pytest.raises(RuntimeError, match="second time"):
        y.backward()
    # two micro-batches forwarded before either backward: the second cannot replay (the recorded
    # activations are the first's until its backward ran), and both gradients are right
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    a, b = g(xs[1]).square().sum(), g(xs[2]).square().sum()
    a.backward()
    b.backward()
    ref(xs[1]).square().sum().backward()
    ref(xs[2]).square().sum().backward()
    for p, q in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    # without grad mode the model's own forward runs: the same output, nothing replayed
    before = rec.replays
    with torch.no_grad():
        torch.testing.assert_close(g(xs[0]), ref(xs[0]), rtol=1e-12, atol=1e-12)
    assert rec.replays == before


def test_step_graph_follows_modes_and_replaced_parameters(monkeypatch):
    """Train and eval mode are separate signatures (dropout and batch statistics on or off), and a
    parameter replaced by a new tensor (``p.data = ...``) is read where it now is."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                          nn.Linear(16, 4)).double()
    ref = copy.deepcopy(model)
    g = _graphed(model, torch.randn(5, 12, dtype=torch.float64), monkeypatch)
    e = spscan.wrap(ref, torch.randn(5, 12, dtype=torch.float64), backward="scan")
    for step, train in enumerate([True, True, True, False, False, False, True, True]):
        if step == 5:
            for m in (model, ref):
                m[0].weight.data = m[0].weight.data * 1.5  # a new tensor at a new address
        for m in (model, ref):
            m.train(train)
            m.zero_grad(set_to_none=True)
        x = torch.randn(5, 12, dtype=torch.float64)
        for w in (g, e):
            torch.manual_seed(step)
            w(x).square().sum().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {n}"
        for a, b in zip(model.buffers(), ref.buffers()):
            assert torch.equal(a, b)
    assert len(g.plan.step_graphs.entries) == 3  # train, eval, train with the new weight (eval with it: warmed only)


def test_step_graph_whose_backward_cannot_be_recorded(monkeypatch):
    """A backward the graph cannot record runs eagerly on the activations the forward's replay wrote."""
    model, ref, g, rec = _step_pair(monkeypatch)

    def forward_only(fn, device):
        if fn.__name__ == "_backward":
            raise RuntimeError("operation not permitted when stream is capturing")
        return fn, None

    g.plan.step_graphs = GraphedStep(g.plan, forward_only)
    _train_and_compare(model, ref, g, 3)
    (entry,) = g.plan.step_graphs.entries.values()
    assert entry.backward_eager and entry.replay_forward is not None
    # the device's error and where it was raised (here the recording itself, the stand-in raising)
    assert re.fullmatch(r"backward: RuntimeError: operation not permitted when stream is capturing "
                        r"\(at graphed\.py:\d+ in run_backward\)", entry.error), entry.error


def test_step_graph_leaves_pruned_weights_to_the_backward_graph(monkeypatch):
    """Effective weights made in the step (a pruning mask applied) are not leaves: the step is not
    recorded whole, its backward still replays from a graph."""
    import torch.nn.utils.prune as prune

    model, ref, g, rec = _step_pair(monkeypatch)
    for m in (model, ref):
        prune.l1_unstructured(m[0], "weight", amount=0.3)
    g = _graphed(model, torch.randn(2, 3, 16, 16, dtype=torch.float64), monkeypatch)
    _train_and_compare(model, ref, g, 3)
    assert not g.plan.step_graphs.entries and len(g.plan._graphed.entries) == 1


def test_graph_is_a_candidate_only_on_a_gpu(monkeypatch):
    model = _lenet()
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(ValueError, match="'graph' is not a candidate"):
        spscan.wrap(model, x, backward="graph")
    units = spscan.wrap(model, x, backward="scan").plan.units
    cpu = layers_decision(units, 64, torch.device("cpu"), "auto", "")
    assert [c.name for c in cpu.candidates] == ["scan", "native"]
    monkeypatch.setattr("spscan.runtime.choices.device_label", lambda device: "a GPU")
    gpu = layers_decision(units, 64, torch.device("cuda"), "auto", "")
    assert [c.name for c in gpu.candidates] == ["scan", "native", "graph"]
    assert all(c.predicted_s > 0 for c in gpu.candidates)
    assert "CUDA graph" in gpu.explain()
    # a batch whose activations a recording would keep beyond the profile's bound: not offered, and the
    # bound is named
    limit = step_profile(torch.device("cuda")).graph_max_activation_bytes
    big = layers_decision(units, limit // graph_activation_bytes(units, 1) + 1, torch.device("cuda"), "auto", "")
    assert "graph" not in [c.name for c in big.candidates]
    assert "graph offered up to 1 GiB of activations" in big.explain()


def test_an_opaque_node_is_recorded_with_the_step(monkeypatch):
    """A unit whose saved state carries an autograd graph (an opaque node) is recorded with the whole step
    (its forward graph rewrites what that autograd graph saved); the backward alone cannot be replayed
    (a copy of the saved state is not what autograd reads), so there it runs eagerly."""
    from spscan.layers.opaque import OpaqueUnit

    class Odd(nn.Module):
        def forward(self, x):
            return torch.cumsum(x, dim=1)  # no analytic unit: an opaque node

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), Odd(), nn.Linear(6, 2)).double()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 6, dtype=torch.float64)
    w = spscan.wrap(model, x, backward="scan")
    assert any(isinstance(u, OpaqueUnit) for u in w.plan.units)
    monkeypatch.setattr("spscan.runtime.choices.device_label", lambda device: "a GPU")
    gpu = layers_decision(w.plan.units, 3, torch.device("cuda"), "auto", "")
    assert "graph" in [c.name for c in gpu.candidates]
    w = _graphed(model, x, monkeypatch)
    for _ in range(4):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        w(x).square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    (entry,) = w.plan.step_graphs.entries.values()
    assert entry.replay_backward is not None and not entry.backward_eager
    # the backward alone (a step whose forward ran eagerly: another forward holds the recorded one)
    a = w(x).sum()
    b = w(x).sum()
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    (a + b).backward()
    (2 * ref(x).sum()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    assert not w.plan._graphed.entries and len(w.plan._graphed.eager) == 0


@pytest.mark.parametrize("kind", ["chain", "recurrent"])
def test_a_step_that_cannot_be_recorded_is_decided_again(kind):
    """Where the device refuses to record a signature's step, ``backward="auto"`` decides that signature
    again without ``graph`` (unpriced, with the reason); that call and the next ones give autograd's
    gradients."""
    from spscan.planner.choose import Candidate, choose

    torch.manual_seed(0)
    if kind == "chain":
        model = _lenet().double()
        x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
        key = ((3, 16, 16), 2)
    else:
        model = nn.GRU(3, 4).double()
        x = torch.randn(5, 2, 3, dtype=torch.float64)
        key = (5, 2)
    ref = copy.deepcopy(model)
    w = spscan.wrap(model, x, backward="auto")
    # as a GPU profile that prices the graph cheapest would decide
    w._decisions[key] = choose("backward", [Candidate("scan", 2.0), Candidate("native", 3.0),
                                            Candidate("graph", 1.0, "the whole step from CUDA graphs")],
                               incumbent="native", margin=1.1)
    w.plan.step_graphs = GraphedStep(w.plan, failing_record)
    for step in range(3):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        out, want = w(x), ref(x)
        (out[0] if kind == "recurrent" else out).square().sum().backward()
        (want[0] if kind == "recurrent" else want).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)
        # call 1 warms (eager); call 2 fails to record: the signature is decided again
        assert w.decision.chosen.name == ("graph" if step == 0 else "scan")
    d = w.decision
    assert d.candidate("graph").predicted_s is None
    # the reason is the device's error, kept with the entry and shown in the decision
    assert "its recording failed here: forward: RuntimeError: operation not permitted when stream is capturing" \
        in d.explain()
    assert all(e.error and e.error.startswith("forward: RuntimeError") for e in w.plan.step_graphs.entries.values())


# ----------------------------------------------------------------------------- recurrent modules

RECURRENT = {
    "rnn": lambda: nn.RNN(3, 5),
    "gru_batch_first": lambda: nn.GRU(3, 5, batch_first=True),
    "lstm": lambda: nn.LSTM(3, 5),
    "stacked_lstm_dropout": lambda: nn.LSTM(3, 5, num_layers=2, dropout=0.3),
    "bidirectional_gru": lambda: nn.GRU(3, 4, bidirectional=True),
}

# (T, B (None: unbatched), with an initial state, the input's gradient wanted, what the loss reads)
RECURRENT_STEPS = [(6, 2, False, False, "all"), (6, 2, False, False, "all"), (6, 2, False, False, "all"),
                   (6, 2, True, True, "output"), (6, 2, True, True, "output"), (4, 3, False, True, "h_n"),
                   (4, 3, False, True, "h_n"), (5, None, True, False, "all"), (5, None, True, False, "all"),
                   (6, 2, False, False, "all")]


def _recurrent_step(w, module, T, B, with_h0, want_x, reads, step, dtype, device):
    """One training step of ``w`` on inputs drawn from ``step``: the outputs, the input's and ``h_0``'s
    gradients."""
    torch.manual_seed(1000 + step)
    layers = module.num_layers * (2 if module.bidirectional else 1)
    shape = (T, module.input_size) if B is None else ((B, T, module.input_size) if module.batch_first else
                                                      (T, B, module.input_size))
    x = torch.randn(shape, dtype=dtype, device=device).requires_grad_(want_x)
    hx = None
    if with_h0:
        hshape = (layers, module.hidden_size) if B is None else (layers, B, module.hidden_size)
        h0 = torch.randn(hshape, dtype=dtype, device=device).requires_grad_()
        hx = (h0, torch.randn(hshape, dtype=dtype, device=device)) if isinstance(module, nn.LSTM) else h0
    for q in module.parameters():
        q.grad = None
    torch.manual_seed(2000 + step)  # the same dropout masks on both sides (CPU)
    out, h = w(x, hx)
    h_n = h[0] if isinstance(module, nn.LSTM) else h
    loss = {"all": out.square().sum() + h_n.sum() + (h[1].sum() if isinstance(module, nn.LSTM) else 0),
            "output": out.square().sum(), "h_n": h_n.square().sum()}[reads]
    loss.backward()
    first = hx[0] if isinstance(hx, tuple) else hx
    return [out, h_n, x.grad, None if first is None else first.grad]


def _check_recurrent_equals_eager(name, dtype, device, make_graphed, steps_of):
    torch.manual_seed(0)
    module = RECURRENT[name]().to(device, dtype).train()
    eager_module = copy.deepcopy(module)
    T, B = RECURRENT_STEPS[0][:2]
    x0 = torch.randn((B, T, 3) if module.batch_first else (T, B, 3), dtype=dtype, device=device)
    g = make_graphed(module, x0)
    e = spscan.wrap(eager_module, x0, backward="scan")
    for step, (T, B, with_h0, want_x, reads) in enumerate(RECURRENT_STEPS):
        with torch.no_grad():
            for p, q in zip(module.parameters(), eager_module.parameters()):
                p.add_(0.01)
                q.add_(0.01)
        got = _recurrent_step(g, module, T, B, with_h0, want_x, reads, step, dtype, device)
        want = _recurrent_step(e, eager_module, T, B, with_h0, want_x, reads, step, dtype, device)
        for what, a, b in zip(("output", "h_n", "x.grad", "h_0.grad"), got, want):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{name} step {step}: {what}"
        for (n, p), q in zip(module.named_parameters(), eager_module.parameters()):
            assert torch.equal(p.grad, q.grad), f"{name} step {step}: {n}"
    steps = steps_of(g)
    # one recorded step per signature seen twice or more: (6, 2), with and without h_0; (4, 3); unbatched
    errors = [e.error for e in steps.entries.values() if e.failed or e.backward_eager]
    assert len(steps.entries) == 4 and not errors, errors


def _graphed_recurrent(module, x, monkeypatch, record=fake_record):
    w = spscan.wrap(module, x, backward="scan")
    monkeypatch.setattr(w, "_choice", lambda key: "graph")
    w.plan.step_graphs = GraphedStep(w.plan, record)
    return w


@pytest.mark.parametrize("name", list(RECURRENT))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_graphed_recurrent_step_equals_eager_bitwise(name, dtype, monkeypatch):
    """A recurrent module's whole step through the step graphs (an initial state or none, the loss on the
    output, on ``h_n`` or on both, changing lengths and batches, unbatched, batch-first, stacked with
    dropout, bidirectional): outputs and gradients equal to the eager scan's bit for bit."""
    _check_recurrent_equals_eager(name, dtype, "cpu", lambda m, x0: _graphed_recurrent(m, x0, monkeypatch),
                                  lambda g: g.plan.step_graphs)


def test_graphed_recurrent_replays_and_leases(monkeypatch):
    """A signature's first call runs eagerly, the second records, later ones replay; a second forward before
    the first's backward runs eagerly (the activations belong to the first); release_buffers drops the
    recordings."""
    torch.manual_seed(0)
    module = nn.GRU(3, 4).double()
    ref = copy.deepcopy(module)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    rec = CountingRecord()
    w = _graphed_recurrent(module, x, monkeypatch, rec)
    for n in range(4):
        module.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        w(x)[0].sum().backward()
        ref(x)[0].sum().backward()
        for p, q in zip(module.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    # forward and backward recorded in call 2 and replayed in calls 2, 3 and 4 (a recording runs nothing)
    assert rec.recorded == 2 and rec.replays == 3 * 2
    # the engine buffers the recordings read are kept with them (a later batch size replaces the engine's)
    (entry,) = w.plan.step_graphs.entries.values()
    now = w.plan.step_buffers()
    assert now and len(entry.held) == 2 and all(any(t is h for h in entry.held[1]) for t in now)
    a = w(x)[0].sum()
    b = w(x)[0].sum()  # the first forward's activations are still held: this one runs eagerly
    assert rec.replays == 7
    module.zero_grad(set_to_none=True)
    (a + b).backward()
    ref.zero_grad(set_to_none=True)
    (2 * ref(x)[0].sum()).backward()
    for p, q in zip(module.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    w.plan.release_buffers()
    assert not w.plan.step_graphs.entries


class _HostCopies(TorchFunctionMode):
    """Refuses a tensor made from host data for a device (``torch.as_tensor(array, device=...)``): on a
    GPU, a copy from the host, which a CUDA-graph capture refuses."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("as_tensor", "tensor") and args \
                and not isinstance(args[0], torch.Tensor) and kwargs.get("device") is not None:
            raise RuntimeError(f"operation not permitted when stream is capturing: torch.{func.__name__} "
                               "from host data")
        return func(*args, **kwargs)


class _HostReads(TorchDispatchMode):
    """Refuses reading a tensor's value on the host (``.item()``, ``bool(t)``, ``float(t)``, ``nonzero``):
    on a GPU, a wait for the device, which a CUDA-graph capture refuses."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default):
            raise RuntimeError(f"operation not permitted when stream is capturing: {func}")
        return func(*args, **(kwargs or {}))


def capture_like_record(fn, device):
    """A stand-in for ``torch.cuda.graph`` that refuses, while it records, what a capture refuses that a
    CPU can show: copies from the host and reads of a value on the host. It runs ``fn`` to record it
    (a capture runs the Python, recording the launches); a replay runs it again."""
    with _HostCopies(), _HostReads():
        fn()
    return fn, None


@pytest.mark.parametrize("name", ["rnn", "gru_batch_first", "lstm", "bidirectional_gru"])
def test_recurrent_step_records_what_a_capture_allows_on_the_gpu_path(name, monkeypatch):
    """The recurrent step along the path it takes on a GPU (the Triton scan, the module's own forward, no
    CPU-only shortcut) records under the rules of a capture, for every signature: a loss on ``h_n`` alone,
    whose upstream gradient of the output is zeros in the step (the ordinary backward gets none), used a
    binding whose gather indices were first uploaded inside the recording, until a signature's first
    call ran the step itself eagerly."""
    import spscan.recurrent.plan as recurrent

    monkeypatch.setattr(recurrent.RecurrentPlan, "_compiled_forward_applies", lambda self, x, hx: False)
    monkeypatch.setattr(recurrent, "any_nonzero", lambda t: True)

    plain = spscan.wrap

    def wrap(m, x, **kw):  # both sides on the Triton scan (Triton's interpreter here)
        return plain(m, x, backend="triton", **kw)

    def make(m, x0):
        w = wrap(m, x0, backward="scan")
        monkeypatch.setattr(w, "_choice", lambda key: "graph")
        w.plan.step_graphs = GraphedStep(w.plan, capture_like_record)
        return w

    monkeypatch.setattr(spscan, "wrap", wrap)
    _check_recurrent_equals_eager(name, torch.float64, "cpu", make, lambda g: g.plan.step_graphs)


@pytest.mark.parametrize("name", ["lenet", "transformer"])
def test_model_step_records_what_a_capture_allows(name, monkeypatch):
    """A wrapped model's step (structured operators; a transformer layer's opaque nodes, whose autograd
    backward is recorded with the step) records under the rules of a capture at every signature, and
    its gradients equal the eager scan's bit for bit."""
    MODELS_NO_RNG = {"lenet": MODELS["lenet"],
                     "transformer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                                     (5, 8))}
    monkeypatch.setitem(MODELS, name, MODELS_NO_RNG[name])

    def make(model, x0):
        w = spscan.wrap(model, x0, backward="scan")
        monkeypatch.setattr(w, "_choice", lambda key: "graph")
        w.plan.step_graphs = GraphedStep(w.plan, capture_like_record)
        return w

    _check_equals_eager(name, torch.float64, "cpu", make)


def test_graphed_recurrent_step_on_an_expanded_input(monkeypatch):
    """An input with stride 0 (one sequence broadcast over the batch) is copied into a dense buffer of
    the step's own; every replay equals autograd's step."""
    torch.manual_seed(0)
    module = nn.GRU(3, 4).double()
    ref = copy.deepcopy(module)
    x0 = torch.randn(5, 1, 3, dtype=torch.float64).expand(5, 2, 3)
    w = _graphed_recurrent(module, x0, monkeypatch)
    for step in range(4):
        x = (torch.randn(5, 1, 3, dtype=torch.float64) + step).expand(5, 2, 3)
        for m in (module, ref):
            m.zero_grad(set_to_none=True)
        out, h = w(x)
        (out.square().sum() + h.sum()).backward()
        out_r, h_r = ref(x)
        (out_r.square().sum() + h_r.sum()).backward()
        assert torch.allclose(out, out_r, atol=1e-12) and torch.allclose(h, h_r, atol=1e-12)
        for p, q in zip(module.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-10)
    assert len(w.plan.step_graphs.entries) == 1


def test_graphed_recurrent_train_and_eval_are_separate_recordings(monkeypatch):
    """Dropout between stacked layers is recorded in train mode only: eval is another signature, whose
    outputs and gradients are the eager eval step's."""
    torch.manual_seed(0)
    module = nn.LSTM(3, 4, num_layers=2, dropout=0.5).double()
    ref = copy.deepcopy(module)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    w = _graphed_recurrent(module, x, monkeypatch)
    for mode in ("train", "eval", "train", "eval"):
        for m in (module, ref):
            getattr(m, mode)()
            m.zero_grad(set_to_none=True)
        for _ in range(2):
            out = w(x)[0]
            out.sum().backward()
            want = ref(x)[0]
            want.sum().backward()
        if mode == "eval":
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
            for p, q in zip(module.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10)
    assert len(w.plan.step_graphs.entries) == 2


def test_graphed_recurrent_newton_forward_runs_eagerly(monkeypatch):
    torch.manual_seed(0)
    module = nn.RNN(3, 4).double()
    x = torch.randn(8, 2, 3, dtype=torch.float64)
    w = spscan.wrap(module, x, backward="scan", forward="newton")
    monkeypatch.setattr(w, "_choice", lambda key: "graph")
    w.plan.step_graphs = GraphedStep(w.plan, fake_record)
    for _ in range(3):
        w(x)[0].sum().backward()
    assert not w.plan.step_graphs.entries


def test_recurrent_graph_is_a_gpu_candidate(monkeypatch):
    """On a GPU a recurrent module's decision offers ``graph``, priced by the shipped profile; a profile that
    does not price it offers it unpriced (taken only when forced); off a GPU forcing it is refused at wrap
    time."""
    from spscan.runtime.choices import recurrent_decision
    from spscan.planner.step_profile import reference_profile

    monkeypatch.setattr("spscan.runtime.choices.device_label", lambda device: "a GPU")

    cpu = recurrent_decision("lstm", [(16, 32)], 100, 16, torch.device("cpu"), "auto", "")
    assert "graph" not in [c.name for c in cpu.candidates]
    gpu = recurrent_decision("lstm", [(16, 32)], 100, 16, torch.device("cuda"), "auto", "")
    assert gpu.candidate("graph").predicted_s > 0
    unpriced = copy.deepcopy(reference_profile("cuda"))
    for regs in unpriced.recurrent.values():
        regs.pop("graph", None)
    gpu = recurrent_decision("lstm", [(16, 32)], 100, 16, torch.device("cuda"), "auto", "", profile=unpriced)
    cand = gpu.candidate("graph")
    assert cand is not None and cand.predicted_s is None and gpu.chosen.name != "graph"
    assert "not priced by this profile" in gpu.explain()
    assert recurrent_decision("lstm", [(16, 32)], 100, 16, torch.device("cuda"), "graph", "",
                              profile=unpriced).chosen.name == "graph"
    huge = recurrent_decision("lstm", [(16, 32)], 10 ** 6, 1024, torch.device("cuda"), "auto", "")
    assert huge.candidate("graph") is None
    with pytest.raises(ValueError, match="'graph' is not a candidate here"):
        spscan.wrap(nn.LSTM(3, 4), torch.randn(5, 2, 3), backward="graph")


def test_a_calibrated_recurrent_graph_is_chosen_where_cheaper(tmp_path, monkeypatch):
    """A GPU profile that prices the recurrent ``graph`` (as ``spscan.calibrate()`` fits it there) makes it a
    candidate like the others: chosen where predicted cheapest."""
    from spscan.runtime.choices import current_key, recurrent_decision
    from spscan.planner.step_profile import forget_loaded, reference_profile

    monkeypatch.setattr("spscan.runtime.choices.device_label", lambda device: "a GPU")
    monkeypatch.setenv("SPSCAN_CACHE_DIR", str(tmp_path))
    prof = copy.deepcopy(reference_profile("cuda", torch.get_num_threads()))
    for regs in prof.recurrent.values():
        regs["graph"] = tuple(0.5 * v for v in regs["native"])
    prof.source = "calibrated"
    prof.save(tmp_path / f"{current_key(torch.device('cuda'))}.json")
    forget_loaded()
    try:
        d = recurrent_decision("lstm", [(16, 32), (32, 32)], 100, 16, torch.device("cuda"), "auto", "")
        assert d.chosen.name == "graph"
        assert d.candidate("graph").predicted_s == pytest.approx(0.5 * d.candidate("native").predicted_s)
    finally:
        forget_loaded()


# ----------------------------------------------------------------------------- on a GPU: real graphs

#: the tests below record real CUDA graphs (run on a GPU: bench/results/nvidia-h200/graphs.log)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", [n for n in MODELS if "dropout" not in n])  # a replay draws its own masks
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.gpu
@gpu
def test_cuda_graph_backward_equals_eager_bitwise(name, dtype, monkeypatch):
    """``backward="graph"`` records one CUDA graph per signature (none falls back to eager) and every
    step's gradients equal the eager scan's bit for bit, for new inputs, weights and batch sizes
    (cuDNN's deterministic algorithms: its default weight gradients may sum in any order)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    _check_equals_eager(name, dtype, "cuda", lambda model, x0: spscan.wrap(model, x0, backward="graph"))


@pytest.mark.gpu
@gpu
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
@gpu
def test_cuda_auto_decision_offers_the_graph():
    model = _lenet().cuda()
    w = spscan.wrap(model, torch.randn(64, 3, 16, 16, device="cuda"))
    assert "graph" in [c.name for c in w.decision.candidates]
    w(torch.randn(64, 3, 16, 16, device="cuda")).sum().backward()  # whatever it chose runs


@pytest.mark.gpu
@gpu
def test_cuda_step_graph_draws_new_dropout_masks_and_reads_its_own():
    """Every replay of a recorded step draws new dropout masks, and its backward reads the mask its
    forward drew: with the dropout last, ``dl/dW`` of ``sum(c * y)`` is ``((y != 0) * c / (1 - p))^T x``."""
    torch.manual_seed(0)
    p = 0.5
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(p)).cuda()
    x = torch.randn(32, 16, device="cuda")
    c = torch.randn(32, 64, device="cuda")
    g = spscan.wrap(model, x, backward="graph")
    masks = []
    for _ in range(5):
        model.zero_grad(set_to_none=True)
        y = g(x)
        (c * y).sum().backward()
        kept = (y != 0).float()
        want = (kept * c / (1 - p)).t() @ x
        torch.testing.assert_close(model[0].weight.grad, want, rtol=1e-5, atol=1e-5)
        masks.append(kept)
    steps = g.plan.step_graphs
    assert len(steps.entries) == 1 and not any(e.failed for e in steps.entries.values()), \
        [e.error for e in steps.entries.values()]
    assert not torch.equal(masks[3], masks[4])
    assert 0.4 < float(masks[4].mean()) < 0.6


@pytest.mark.parametrize("name", [n for n in RECURRENT if "dropout" not in n])  # a replay draws its own masks
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.gpu
@gpu
def test_cuda_recurrent_graph_step_equals_eager_bitwise(name, dtype, monkeypatch):
    """``backward="graph"`` on a recurrent module records one forward and one backward graph per signature
    (none falls back to eager), and every step's outputs and gradients equal the eager scan's bit for bit."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    _check_recurrent_equals_eager(name, dtype, "cuda", lambda m, x0: spscan.wrap(m, x0, backward="graph"),
                                  lambda g: g.plan.step_graphs)


@pytest.mark.gpu
@gpu
def test_cuda_recurrent_graph_step_matches_autograd_in_float64():
    torch.manual_seed(0)
    module = nn.LSTM(8, 16, num_layers=2).to("cuda", torch.float64)
    ref = copy.deepcopy(module)
    x = torch.randn(50, 4, 8, dtype=torch.float64, device="cuda")
    g = spscan.wrap(module, x, backward="graph")
    for _ in range(4):
        for m in (module, ref):
            m.zero_grad(set_to_none=True)
        out, (h, c) = g(x)
        (out.square().sum() + h.sum()).backward()
        out, (h, c) = ref(x)
        (out.square().sum() + h.sum()).backward()
        for p, q in zip(module.parameters(), ref.parameters()):
            assert float((p.grad - q.grad).abs().max()) <= 1e-9 * max(1.0, float(q.grad.abs().max()))
    assert len(g.plan.step_graphs.entries) == 1


@pytest.mark.gpu
@gpu
def test_cuda_graph_step_records_an_opaque_nodes_autograd_backward():
    """A transformer layer (opaque nodes: attention, the layer's own call) through the whole-step graphs:
    every step's gradients match autograd's in float64 (no dropout), and with dropout on the step is
    recorded and runs."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).to("cuda", torch.float64)
    ref = copy.deepcopy(layer)
    x = torch.randn(4, 6, 16, dtype=torch.float64, device="cuda")
    g = spscan.wrap(layer, x, backward="graph")
    for step in range(4):
        xs = x + step
        for m in (layer, ref):
            m.zero_grad(set_to_none=True)
        g(xs).square().sum().backward()
        ref(xs).square().sum().backward()
        for p, q in zip(layer.parameters(), ref.parameters()):
            assert float((p.grad - q.grad).abs().max()) <= 1e-9 * max(1.0, float(q.grad.abs().max()))
    (entry,) = g.plan.step_graphs.entries.values()
    assert not entry.failed and not entry.backward_eager, entry.error
    drop = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.3, batch_first=True).cuda()
    xd = torch.randn(4, 6, 16, device="cuda")
    gd = spscan.wrap(drop, xd, backward="graph")
    for _ in range(3):
        drop.zero_grad(set_to_none=True)
        gd(xd).square().sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in drop.parameters())
    (entry,) = gd.plan.step_graphs.entries.values()
    assert not entry.failed and not entry.backward_eager, entry.error
