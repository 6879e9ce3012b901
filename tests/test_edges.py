"""Bad input is refused early with a clear error, and nothing is lost: the next valid call is right."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from torch import nn

import spscan

EYE = sp.csr_array(sp.eye(3))


@pytest.mark.parametrize("kwargs, kind, words", [
    (dict(max_memory=float("nan")), ValueError, "max_memory"),
    (dict(max_memory=float("inf")), ValueError, "max_memory"),
    (dict(max_memory=-1), ValueError, "max_memory"),
    (dict(max_memory="1GB"), TypeError, "max_memory"),
    (dict(max_memory=True), TypeError, "max_memory"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(levels=-1), ValueError, "levels"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(batch_size=0), ValueError, "batch_size"),
])
def test_plan_options_refused(kwargs, kind, words):
    with pytest.raises(kind, match=words):
        spscan.plan([EYE, EYE], **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_unavailable_device_refused_at_plan_time():
    with pytest.raises(ValueError, match="CUDA is not available"):
        spscan.plan([EYE], device="cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        spscan.wrap(nn.Linear(3, 3), torch.randn(1, 3), device="cuda")


def test_single_matrix_where_a_chain_is_expected():
    for single in (EYE, sp.csr_matrix(np.eye(3)), torch.eye(3).to_sparse_csr()):
        with pytest.raises(TypeError, match=r"pass \[pattern\]"):
            spscan.plan(single)


def test_wrapped_model_refusals_then_a_valid_step():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    w = spscan.wrap(net, x)
    before = [p.detach().clone() for p in net.parameters()]
    x_keep = x.clone()
    with pytest.raises(TypeError, match=r"layer 0 \(0: Linear\).*float32"):
        w(x.double())
    with pytest.raises(TypeError, match="layer 0"):
        w(torch.ones(5, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"per-sample shape \(4,\).*layer 0 \(0: Linear\)"):
        w(torch.randn(5, 4))
    # nothing changed: parameters, input, and the next valid step equals autograd
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters())) and torch.equal(x, x_keep)
    xr = x.clone().requires_grad_(True)
    w(xr).pow(2).sum().backward()
    got = [xr.grad] + [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    xa = x.clone().requires_grad_(True)
    net(xa).pow(2).sum().backward()
    want = [xa.grad] + [p.grad for p in net.parameters()]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.fc = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.body(x)) + x.mean(1, keepdim=True))


@pytest.mark.parametrize("kind", ["sequential", "traced"])
def test_a_layer_replaced_after_wrapping_is_planned_again(kind):
    """``model.fc = nn.Linear(...)`` after wrapping (a new head for fine-tuning): the plan ran the old module
    and the step was refused ("planned Linear, now Linear"); the wrapper plans the model again as it is now
    (warning once which layer changed) and gives autograd's gradients, the new module's included."""
    import copy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)) if kind == "sequential" else _Head()
    net = net.double()
    w = spscan.wrap(net, torch.randn(2, 3, dtype=torch.float64), backward="scan")
    w(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
    if kind == "sequential":
        net[2] = nn.Linear(4, 2).double()
    else:
        net.fc = nn.Linear(4, 2).double()
    ref = copy.deepcopy(net)
    net.zero_grad(set_to_none=True)
    x = torch.randn(3, 3, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"replaced after planning \(planned Linear, now another Linear object\)"):
        y = w(x)
    y.square().sum().backward()
    ref(x).square().sum().backward()
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 3, 3, padding="same")

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.tanh(h) + 0.5 * h)


@pytest.mark.parametrize("kind", ["sequential", "traced"])
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_parameter_given_anew_with_another_shape_is_planned_again(kind, layer):
    """``fc.weight = nn.Parameter(torch.randn(5, 4))`` after wrapping (the module's ``out_features`` left as it
    was, as torch's own forward ignores it): the traced plan crashed in the backward ("shape '[3, 2]' is
    invalid"); the wrapper plans again from the parameters' shapes, warning which role changed."""
    import copy

    torch.manual_seed(0)
    if layer == "linear":
        net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)) if kind == "sequential" else _Head()
        x = torch.randn(3, 3, dtype=torch.float64)
        new_w, new_b = torch.randn(5, 4), torch.randn(5)
    else:
        net = (nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 3, 3, padding="same"))
               if kind == "sequential" else _Convs())
        x = torch.randn(3, 2, 5, 5, dtype=torch.float64)
        new_w, new_b = torch.randn(5, 4, 1, 1), torch.randn(5)  # another kernel size, too
    net = net.double()
    w = spscan.wrap(net, x, backward="scan")
    w(x).sum().backward()
    last = list(net.modules())[-1]
    last.weight, last.bias = nn.Parameter(new_w.double()), nn.Parameter(new_b.double())
    ref = copy.deepcopy(net)
    net.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match=r"given anew after planning"):
        y = w(x)
    y_ref = ref(x)
    torch.testing.assert_close(y, y_ref)
    wt = torch.randn_like(y_ref)
    (y * wt).sum().backward()
    (y_ref * wt).sum().backward()
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_train_mode_batchnorm_at_a_forced_depth_refused_at_wrap_time():
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
    with pytest.raises(ValueError, match=r"layer 1 \(BatchNorm1d\): in train mode it couples the samples"):
        spscan.wrap(net, torch.randn(2, 3), levels=1)
    assert spscan.wrap(net, torch.randn(2, 3)).plan.levels == 0  # the linear scan runs it exactly


@pytest.mark.parametrize("which", ["sequential", "gru"])
def test_empty_batch_behaves_as_torch(which):
    torch.manual_seed(0)
    if which == "sequential":
        net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        w = spscan.wrap(net, torch.randn(2, 3))
        x = torch.randn(0, 3, requires_grad=True)
        out = w(x)
    else:
        net = nn.GRU(3, 4)
        w = spscan.wrap(net, torch.randn(5, 2, 3))
        x = torch.randn(5, 0, 3, requires_grad=True)
        out = w(x)[0]
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert all(p.grad is None or not p.grad.any() for p in net.parameters())


def test_backward_refuses_inputs_that_require_grad_in_grad_mode():
    plan = spscan.plan([EYE, EYE])
    vals = [torch.ones(3, requires_grad=True), torch.ones(3)]
    with pytest.raises(ValueError, match="not differentiable"):
        spscan.backward(plan, vals, torch.ones(1, 3))
    with pytest.raises(ValueError, match="not differentiable"):
        spscan.backward(plan, [torch.ones(3)] * 2, torch.ones(1, 3, requires_grad=True))
    with torch.no_grad():
        assert spscan.backward(plan, vals, torch.ones(1, 3))[0].tolist() == [[1.0, 1.0, 1.0]]


def test_recurrent_plan_refused_by_chain_backward():
    m = nn.RNN(2, 3)
    plan = spscan.plan(m, torch.randn(4, 1, 2))
    _, saved = spscan.forward(plan, torch.randn(4, 1, 2))
    with pytest.raises(TypeError, match=r"plan\.backward\(saved"):
        spscan.backward(plan, saved, torch.randn(1, 3))


def test_long_value_lists_are_checked_as_one():
    """A long list of value tensors (checked and run as one stacked tensor) gives the stacked input's
    gradients, and a bad entry is still named by its layer."""
    n = 80
    plan = spscan.plan([EYE] * n, levels=0)
    g = torch.Generator().manual_seed(0)
    stacked = torch.randn(n, 2, 3, dtype=torch.float64, generator=g)
    grad = torch.randn(2, 3, dtype=torch.float64, generator=g)
    want = spscan.backward(plan, stacked, grad).stacked()
    for values in (list(stacked), [v.clone() for v in stacked], tuple(stacked)):
        assert torch.equal(spscan.backward(plan, values, grad).stacked(), want)
    shared = torch.randn(n, 3, dtype=torch.float64, generator=g)
    assert torch.equal(spscan.backward(plan, list(shared), grad).stacked(), spscan.backward(plan, shared, grad).stacked())
    bad = list(stacked)
    bad[41] = bad[41].float()
    with pytest.raises(TypeError, match=r"values\[41\] \(layer 42\): dtype torch.float32"):
        spscan.backward(plan, bad, grad)
    bad = list(stacked)
    bad[7] = torch.randn(3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"values\[7\] \(layer 8\): expected shape \(2, 3\) or \(3,\)"):
        spscan.backward(plan, bad, grad)
    bad = list(stacked)
    bad[5] = bad[5].clone().requires_grad_(True)
    with pytest.raises(ValueError, match="not differentiable"):
        spscan.backward(plan, bad, grad)
