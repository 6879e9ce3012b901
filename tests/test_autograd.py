"""Wrapped modules are autograd citizens: gradcheck, repeated backward, clear refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spscan


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(2 * 2 * 2, 3))


def _mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid(), nn.Linear(4, 2))


CASES = {"cnn": (_cnn, (2, 1, 4, 4)), "mlp": (_mlp, (3, 3))}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("levels", [0, "full"])
def test_gradcheck_wrapped_sequential(name, levels):
    make, shape = CASES[name]
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    w = spscan.wrap(model, x, levels=levels)
    params = [p for p in model.parameters()]
    assert torch.autograd.gradcheck(lambda x, *ps: w(x), (x, *params))


@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM])
def test_gradcheck_wrapped_recurrent(kind):
    torch.manual_seed(0)
    m = kind(2, 3, batch_first=True).double()
    x = torch.randn(2, 5, 2, dtype=torch.float64, requires_grad=True)
    w = spscan.wrap(m, x)

    def f(x, *ps):
        out, state = w(x)
        h = state[0] if isinstance(state, tuple) else state
        return out, h

    assert torch.autograd.gradcheck(f, (x, *m.parameters()))


@pytest.mark.parametrize("name", ["mlp", "rnn"])
def test_repeated_backward_over_retained_graph(name):
    torch.manual_seed(0)
    if name == "mlp":
        model = _mlp().double()
        x = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
        w = spscan.wrap(model, x)
        loss = w(x).pow(2).sum()
    else:
        model = nn.GRU(2, 3).double()
        x = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
        w = spscan.wrap(model, x)
        loss = w(x)[0].pow(2).sum()
    loss.backward(retain_graph=True)
    first = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    loss.backward(retain_graph=True)
    second = [x.grad] + [p.grad for p in model.parameters()]
    for a, b in zip(first, second):
        torch.testing.assert_close(b, 2 * a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["mlp", "lstm"])
def test_second_derivative_refused_not_silent(name):
    torch.manual_seed(0)
    if name == "mlp":
        model = _mlp().double()
        x = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
        out = spscan.wrap(model, x)(x)
    else:
        model = nn.LSTM(2, 3).double()
        x = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
        out = spscan.wrap(model, x)(x)[0]
    params = list(model.parameters())
    g = torch.autograd.grad(out.pow(2).sum(), [x] + params, create_graph=True)
    want = torch.autograd.grad(model(x).pow(2).sum() if name == "mlp" else model(x)[0].pow(2).sum(), [x] + params)
    for a, b in zip(g, want):  # first order is still right
        torch.testing.assert_close(a.detach(), b, rtol=1e-10, atol=1e-12)
    for src in (params, [x]):
        with pytest.raises(RuntimeError, match="differentiated twice"):
            torch.autograd.grad(g[0].sum(), src, allow_unused=True)


def test_torch_func_refused_clearly():
    model = _mlp().double()
    x = torch.randn(3, 3, dtype=torch.float64)
    w = spscan.wrap(model, x)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, x):
        return torch.func.functional_call(w, {"model." + k: v for k, v in p.items()}, (x,)).sum()

    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.grad(f)(params, x)
