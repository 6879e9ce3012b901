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
