"""A plain Python attribute the forward reads (a temperature annealed, a flag toggled), changed after the model
was wrapped: tracing baked its old value into the graph, so the wrapper plans the model again for the new one (as
for a new input shape, warning once), and outputs and gradients stay autograd's (float64)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import spscan


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(8, 8), nn.Linear(8, 3)
        self.tau, self.use_skip = 1.0, False

    def forward(self, x):
        h = torch.tanh(self.a(x) / self.tau)
        if self.use_skip:
            h = h + x
        return self.o(h)


class _Counting(nn.Module):
    """Runs as its own call (it has a hook) and counts its calls in a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.calls = nn.Linear(8, 8), 0
        self.register_forward_hook(lambda m, i, o: None)

    def forward(self, x):
        self.calls += 1
        return torch.relu(self.l(x))


class _WithCounter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.o = _Counting(), nn.Linear(8, 3)

    def forward(self, x):
        return self.o(self.c(x))


def _step(w, ref, x):
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    for p in (*w.parameters(), *ref.parameters()):
        p.grad = None
    ya, yb = w(xa), ref(xb)
    (ya ** 2).sum().backward()
    (yb ** 2).sum().backward()
    errs = [float((ya - yb).detach().abs().max()), float((xa.grad - xb.grad).abs().max())]
    errs += [float((p.grad - q.grad).abs().max()) for p, q in zip(w.model.parameters(), ref.parameters())]
    return max(errs)


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_an_attribute_changed_after_wrap_is_planned_again(backward):
    torch.manual_seed(0)
    model = _Tempered().double()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, x, backward=backward)
    assert _step(w, ref, x) <= 1e-12
    with pytest.warns(UserWarning, match=r"tau: 1.0 -> 0.5 changed after _Tempered was planned"):
        model.tau = ref.tau = 0.5
        assert _step(w, ref, x) <= 1e-12
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # once per wrapper
        for tau, skip in ((0.25, False), (0.25, True), (1.0, False), (0.25, True)):
            model.tau = ref.tau = tau
            model.use_skip = ref.use_skip = skip
            assert _step(w, ref, x) <= 1e-12, (tau, skip)
    # each value set has its plan (the last ones kept), made once: the return to an earlier one plans nothing
    assert len(w._plans) == 4


def test_an_attribute_a_module_of_its_own_call_changes_plans_nothing():
    """A module run as its own call (an opaque node) reads its attributes itself; its forward changing one on
    every call (a counter) neither warns nor plans again."""
    torch.manual_seed(0)
    model = _WithCounter().double()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, x, backward="scan")
        first = model.c.calls
        for _ in range(3):
            assert _step(w, ref, x) <= 1e-12
    assert model.c.calls > first and len(w._plans) == 1


class _Stack(nn.Module):
    """A forward looping over an ``nn.ModuleList``: fx unrolls the loop over the layers it holds then."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(2))
        self.out = nn.Linear(6, 2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


@pytest.mark.parametrize("kind", ["module_list", "sequential", "reassigned"])
def test_a_layer_appended_after_wrapping_is_planned(kind):
    """A layer appended to a container after wrapping (progressive growing): the traced loop ran the old layers
    only, silently (output off by 0.6, the new layer without a gradient). The wrapper keeps the containers'
    module names with its plans and plans again when they change."""
    torch.manual_seed(0)
    model = (nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)) if kind == "sequential" else _Stack()).double()
    w = spscan.wrap(model, torch.randn(3, 6, dtype=torch.float64), backward="scan")
    if kind == "module_list":
        model.layers.append(nn.Linear(6, 6).double())
    elif kind == "reassigned":  # a new container holding the same layers and one more
        model.layers = nn.ModuleList([*model.layers, nn.Linear(6, 6).double()])
    else:
        model.insert(0, nn.Linear(6, 6).double())
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="the modules of|another container"):
        y = w(x)
    y_ref = ref(x)
    assert torch.allclose(y, y_ref, rtol=1e-12, atol=1e-14)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14), n


class _KeepsState(nn.Module):
    """``self.h = h.detach()``: the state kept on the model for the next batch (truncated BPTT)."""

    def __init__(self) -> None:
        super().__init__()
        self.gru, self.fc, self.h = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 2), None

    def forward(self, x):
        out, h = self.gru(x, self.h)
        self.h = h.detach()
        return self.fc(out[:, -1])


class _KeepsLoss(nn.Module):
    """``self.kl = ...``: a term the loss reads from the model after the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Linear(6, 8), nn.Linear(4, 6)

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, 1)
        self.kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(1).mean()
        return self.dec(torch.tanh(mu))


@pytest.mark.parametrize("make", [_KeepsState, _KeepsLoss])
def test_a_forward_that_stores_a_tensor_on_the_model(make):
    """A forward that keeps a tensor it computes on the model: the scan's step runs the traced graph, which
    would never set it (the loss read a stale ``self.kl``; the tracer left a proxy in ``self.h``, and the
    model itself no longer ran). Refused under a forced scan, autograd's own step under ``auto``, and the
    model's attributes as they were after planning."""
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6, 3, dtype=torch.float64) if make is _KeepsState else torch.randn(4, 6, dtype=torch.float64)
    before = {k: v for k, v in vars(model).items() if not k.startswith("_")}
    with pytest.raises(spscan.NotPlannable, match=r"stores a tensor it computes on the model \(self\.(h|kl)\)"):
        spscan.wrap(model, x, backward="scan")
    with pytest.warns(UserWarning, match="stores a tensor"):
        w = spscan.wrap(model, x, backward="auto")
    assert {k: v for k, v in vars(model).items() if not k.startswith("_")} == before
    for step in range(3):
        for m, net in ((model, w), (ref, ref)):
            m.zero_grad()
            y = net(x)
            loss = y.square().sum() + (m.kl if make is _KeepsLoss else 0)
            loss.backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)


class _Appends(nn.Module):
    """``self.feats.append(h)`` (a perceptual loss's features), ``self.cache["h"] = h``, ``self.steps += 1``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.a, self.b = kind, nn.Linear(4, 4), nn.Linear(4, 2)
        self.feats, self.cache, self.steps = [], {}, 0

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.kind == "list":
            self.feats.append(h)
        elif self.kind == "dict":
            self.cache["h"] = h
        else:
            self.steps += 1
            h = h * min(1.0, self.steps / 2)  # a warm-up factor
        return self.b(h)


@pytest.mark.parametrize("kind", ["list", "dict", "counter"])
def test_a_forward_that_changes_a_container_or_a_number_on_the_model(kind):
    """What the forward appends to a list, writes into a dict, or counts on the model: the scan's step would not
    do it (a loss reading the features lost them; a warm-up factor stayed at its traced value), and tracing left
    a proxy in the user's list. Refused under a forced scan; autograd's own step under ``auto``, the model's
    containers and numbers as they were after planning."""
    torch.manual_seed(0)
    model = _Appends(kind).double()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(spscan.NotPlannable, match="stores a value on the model"):
        spscan.wrap(model, x, backward="scan")
    with pytest.warns(UserWarning, match="stores a value"):
        w = spscan.wrap(model, x, backward="auto")
    assert model.feats == [] and model.cache == {} and model.steps == 0
    for step in range(3):
        for m, net in ((model, w), (ref, ref)):
            m.zero_grad()
            y = net(x)
            extra = sum(f.square().sum() for f in m.feats) if kind == "list" else 0
            (y.square().sum() + extra).backward()
            m.feats.clear()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
    assert model.steps == ref.steps
