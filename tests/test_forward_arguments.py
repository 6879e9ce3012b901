"""A traced model whose forward takes optional arguments besides its input (``forward(x, mask=None,
residual=True)``) is planned with their defaults; a call that passes other values runs the model's own
forward and backward under ``backward="auto"`` and is refused under a forced scan. A model wrapped with an
example of several inputs reads those after the first at each step, without gradients."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import spscan
from spscan.runtime.choices import NativeModule
from spscan.errors import NotPlannable


class Gated(nn.Module):
    """Optional arguments of each plain kind: a tensor that defaults to None, a float, a bool that changes
    the graph (a skip connection), a keyword-only string."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x, mask=None, scale: float = 0.5, residual: bool = True, *, act: str = "tanh"):
        y = torch.tanh(self.a(x)) if act == "tanh" else torch.relu(self.a(x))
        if mask is not None:
            y = y * mask
        y = self.b(y) * scale
        if residual:
            y = y + x
        return self.head(y)


def _grads(model, x, *args, **kwargs):
    """Output and gradients (input, then parameters) of one backward of a fixed weighting of the output."""
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    y = model(x, *args, **kwargs)
    w = torch.linspace(-1.0, 1.0, y.numel(), dtype=y.dtype).reshape(y.shape)
    (y * w).sum().backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]


def _close(got, want, tol):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


CALLS = [((), {}), ((None,), {}), ((), {"scale": 0.5}), ((None, 0.5, True), {"act": "tanh"}),
         ((), {"residual": True, "mask": None})]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("args,kwargs", CALLS)
def test_a_call_with_the_defaults_runs_the_scan(dtype, tol, args, kwargs):
    torch.manual_seed(0)
    model = Gated().to(dtype)
    ref = copy.deepcopy(model)
    x = torch.randn(5, 6, dtype=dtype)
    wrapped = spscan.wrap(model, x, backward="scan")
    assert wrapped.plan.fixed_arguments == {"mask": None, "scale": 0.5, "residual": True, "act": "tanh"}
    for batch in (5, 1, 3):  # batch of one and a changing batch
        xb = torch.randn(batch, 6, dtype=dtype)
        _close(_grads(wrapped, xb, *args, **kwargs), _grads(ref, xb), tol)


def test_the_scan_runs_for_the_defaults_and_not_for_other_values(monkeypatch):
    torch.manual_seed(1)
    model = Gated().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    wrapped = spscan.wrap(model, x, backward="scan")
    ran = []
    run_step = type(wrapped.plan).run_step
    monkeypatch.setattr(type(wrapped.plan), "run_step", lambda self, *a, **k: ran.append(1) or run_step(self, *a, **k))
    _grads(wrapped, x, None, scale=0.5)
    assert ran == [1]
    auto = spscan.wrap(model, x, backward="auto")
    ran.clear()
    _grads(auto, x, torch.ones(4, 6, dtype=torch.float64))
    assert ran == []  # a mask: the model's own forward and backward


@pytest.mark.parametrize("args,kwargs", [((torch.full((4, 6), 0.5),), {}), ((), {"scale": 2.0}),
                                         ((), {"residual": False}), ((), {"act": "relu"}), ((None, 1),  {})])
def test_other_values_run_the_models_own_backward_under_auto(args, kwargs):
    torch.manual_seed(2)
    model = Gated().double()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    args = tuple(a.double() if isinstance(a, torch.Tensor) else a for a in args)
    wrapped = spscan.wrap(model, x, backward="auto")
    got, want = _grads(wrapped, x, *args, **kwargs), _grads(ref, x, *args, **kwargs)
    for a, b in zip(got, want):
        assert torch.equal(a, b)  # autograd's own, bit for bit
    assert "planned with mask=None, scale=0.5, residual=True, act='tanh'; a call with other values: native" \
        in wrapped.explain()


def test_other_values_are_refused_under_a_forced_scan():
    model = Gated()
    x = torch.randn(4, 6)
    wrapped = spscan.wrap(model, x, backward="scan")
    with pytest.raises(TypeError, match=r"traced with mask=None, scale=0.5, residual=True, act='tanh'.*"
                                        r"this call passes mask=a tensor \(4, 6\)"):
        wrapped(x, torch.ones(4, 6))
    with pytest.raises(TypeError, match="residual=False"):
        wrapped(x, residual=False)
    with torch.no_grad():  # nothing recorded: the model's own forward, whatever the arguments
        assert torch.equal(wrapped(x, residual=False), model(x, residual=False))
    with pytest.raises(TypeError, match="unexpected keyword argument 'dropout'"):
        wrapped(x, dropout=0.1)  # the model's own error


def test_a_wrapper_with_fixed_arguments_pickles():
    torch.manual_seed(3)
    model = Gated().double()
    x = torch.randn(3, 6, dtype=torch.float64)
    wrapped = spscan.wrap(model, x, backward="scan")
    again = pickle.loads(pickle.dumps(wrapped))
    assert again.plan.fixed_arguments == wrapped.plan.fixed_arguments
    _close(_grads(again, x, scale=0.5), _grads(copy.deepcopy(model), x), 1e-12)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 3), nn.Linear(4, 3)

    def forward(self, x, y):
        return self.a(x) + self.b(y)


def test_a_second_input_without_a_default_is_refused_with_its_name():
    x = torch.randn(4, 6)
    with pytest.raises(NotPlannable, match=r"one tensor input .*got 2 inputs \(x, y\)"):
        spscan.wrap(TwoInputs(), x, backward="scan")
    with pytest.warns(UserWarning, match="got 2 inputs"):
        wrapped = spscan.wrap(TwoInputs(), x, backward="auto")
    assert isinstance(wrapped, NativeModule)


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_an_example_of_several_inputs_reads_the_others_each_step(backward):
    """``wrap(model, (x, y))``: the inputs after the first carry no gradient (as a recurrent state, a mask or a
    time step does) and are read at each step (:mod:`spscan.graph.state`), with autograd's gradients for the
    parameters and ``x``; one that requires a gradient runs autograd's own step under ``auto``. ``plan``
    plans a model of one input."""
    torch.manual_seed(4)
    model = TwoInputs().double()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    with pytest.raises(NotPlannable, match="an example of 2 inputs"):
        spscan.plan(model, [x, y])
    wrapped = spscan.wrap(model, (x, y), backward=backward)
    assert not isinstance(wrapped, NativeModule) and wrapped.plan.state is not None
    for b in (4, 3):
        x, y = torch.randn(b, 6, dtype=torch.float64), torch.randn(b, 4, dtype=torch.float64)
        got, want = _grads(wrapped, x, y), _grads(ref, x, y)
        _close(got, want, 1e-12)
    if backward == "auto":
        yg = y.clone().requires_grad_()
        wrapped(x, yg).sum().backward()
        assert yg.grad is not None


def test_a_torch_layer_as_the_model_takes_its_masks_natively():
    """``nn.TransformerEncoderLayer`` (fx cannot trace into it: one opaque node) called with a padding mask:
    the scan was planned without one, so that call runs the layer's own backward; without a mask, the scan."""
    torch.manual_seed(5)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    ref = copy.deepcopy(layer)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    wrapped = spscan.wrap(layer, x, backward="auto")
    assert wrapped.plan.fixed_arguments == {"src_mask": None, "src_key_padding_mask": None, "is_causal": False}
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[0, 3:] = True
    _close(_grads(wrapped, x, src_key_padding_mask=pad), _grads(ref, x, src_key_padding_mask=pad), 1e-12)
    _close(_grads(wrapped, x, is_causal=False), _grads(ref, x), 1e-9)
