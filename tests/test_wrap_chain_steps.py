"""The wrapper's depth-0 operator chain (``LayerUnit.chain_step``): each layer's step runs the ATen
ops autograd runs for it, activations pass between layers in their natural shapes, and every
gradient equals autograd's (float64 to 1e-10; float32 within 2x autograd's own float32 error)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import spscan


def _lenet():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 6, 3, bias=False), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _vgg():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(5 * 2 * 2, 3))


def _general_steps():
    # layers without a specialized step: asymmetric 'same' padding, Tanh, a 1-d pool, a Linear on (L, F)
    return nn.Sequential(
        nn.Conv1d(2, 3, 4, padding="same"), nn.Tanh(), nn.MaxPool1d(2), nn.Linear(4, 3), nn.Sigmoid(),
        nn.Flatten(), nn.Linear(9, 2))


CASES = {"lenet": (_lenet, (5, 3, 10, 10)), "vgg": (_vgg, (4, 3, 8, 8)), "general": (_general_steps, (3, 2, 8))}


def _grads(model, x, y, wrapped: bool, x_grad: bool):
    net = spscan.wrap(model, x, levels=0) if wrapped else model
    model.zero_grad(set_to_none=True)
    xx = x.clone().requires_grad_(x_grad)
    out = net(xx)
    (out * y).sum().backward()
    res = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if x_grad:
        res["x"] = xx.grad.clone()
    return res, net


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("x_grad", [False, True])
def test_chain_steps_match_autograd_float64(name, x_grad):
    make, shape = CASES[name]
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(*shape, dtype=torch.float64)
    y = torch.randn_like(model(x))
    ref, _ = _grads(model, x, y, False, x_grad)
    got, net = _grads(model, x, y, True, x_grad)
    assert any(s.chain is not None for s in net.plan._steps.values())  # the chain steps ran
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-10, msg=k)


def test_chain_steps_frozen_parameters_and_batch_change():
    torch.manual_seed(1)
    model = _lenet().double()
    model[0].bias.requires_grad_(False)
    model[7].weight.requires_grad_(False)
    x = torch.randn(5, 3, 10, 10, dtype=torch.float64)
    net = spscan.wrap(model, x, levels=0)
    for b in (5, 2, 7):
        xb = torch.randn(b, 3, 10, 10, dtype=torch.float64, requires_grad=True)
        yb = torch.randn(b, 3, dtype=torch.float64)
        model.zero_grad(set_to_none=True)
        (model(xb) * yb).sum().backward()
        ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        ref_x = xb.grad
        model.zero_grad(set_to_none=True)
        xb.grad = None
        (net(xb) * yb).sum().backward()
        assert model[0].bias.grad is None and model[7].weight.grad is None
        for n, p in model.named_parameters():
            if n in ref:
                torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=1e-10, msg=n)
        torch.testing.assert_close(xb.grad, ref_x, rtol=0, atol=1e-10)


def test_chain_steps_retained_graph_backward_twice():
    torch.manual_seed(2)
    model = _vgg().double()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    net = spscan.wrap(model, x, levels=0)
    out = net(x).square().sum()
    out.backward(retain_graph=True)
    first = {n: p.grad.clone() for n, p in model.named_parameters()}
    out.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, 2 * first[n], rtol=1e-12, atol=1e-12, msg=n)
    with pytest.raises(RuntimeError, match="second time"):
        out.backward()


@pytest.mark.parametrize("name", ["lenet", "vgg"])
def test_chain_steps_float32_error_within_twice_autograds(name):
    make, shape = CASES[name]
    torch.manual_seed(3)
    model64 = make().double()
    x64 = torch.randn(*shape, dtype=torch.float64)
    y64 = torch.randn_like(model64(x64))
    ref, _ = _grads(model64, x64, y64, False, True)
    model32 = make()
    model32.load_state_dict({k: v.float() for k, v in model64.state_dict().items()})
    ag, _ = _grads(model32, x64.float(), y64.float(), False, True)
    sc, _ = _grads(model32, x64.float(), y64.float(), True, True)
    for k in ref:
        err_ag = (ag[k].double() - ref[k]).abs().max().item()
        err_sc = (sc[k].double() - ref[k]).abs().max().item()
        assert err_sc <= 2 * err_ag + 1e-7, (k, err_sc, err_ag)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


_MATH = ("convolution_backward", "threshold_backward", "max_pool2d_with_indices_backward", "mm", "sum")


@pytest.mark.parametrize("name", ["lenet", "vgg"])
def test_chain_backward_runs_no_more_aten_ops_than_autograd(name):
    """The scan's backward dispatches no more ATen ops than autograd's, and no more of the ops that
    do the math (each layer's input-gradient and parameter-gradient ops appear once)."""
    make, shape = CASES[name]
    torch.manual_seed(4)
    model = make()
    x = torch.randn(*shape)
    net = spscan.wrap(model, x, levels=0)
    counts = {}
    for side, m in (("autograd", model), ("spscan", net)):
        for _ in range(2):  # the second backward: nothing left to decide or lower
            model.zero_grad(set_to_none=True)
            loss = m(x).square().sum()
            with _CountOps() as c:
                loss.backward()
        counts[side] = c.ops
    assert len(counts["spscan"]) <= len(counts["autograd"]), counts
    for op in _MATH:
        assert counts["spscan"].count(f"aten.{op}") <= counts["autograd"].count(f"aten.{op}"), (op, counts)


class _ThresholdNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.threshold_backward:
            self.numel += args[0].numel()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("padding", [0, 1])
def test_relu_mask_applied_at_the_pooled_resolution(padding):
    """ReLU -> MaxPool2d (disjoint windows): the pool's step masks g where the pooled output is <= 0 and
    the ReLU passes g on; the gradients are autograd's bit for bit (every entry is g or 0), including
    windows whose inputs are all cut to 0 and windows that reach into the padding."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, padding=padding),
                          nn.Conv2d(3, 2, 3), nn.ReLU(), nn.MaxPool2d(3 - padding), nn.Flatten()).double()
    with torch.no_grad():
        model[0].bias.fill_(-0.8)  # many windows with every input <= 0
    x = torch.randn(3, 2, 12, 12, dtype=torch.float64)
    y = torch.randn_like(model(x))
    net = spscan.wrap(model, x, levels=0)
    got = {}
    for side, m in (("autograd", model), ("spscan", net)):
        model.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        loss = (m(xx) * y).sum()
        with _ThresholdNumel() as c:
            loss.backward()
        got[side] = ({n: p.grad.clone() for n, p in model.named_parameters()}, xx.grad, c.numel)
    (pa, xa, na), (ps, xs, ns) = got["autograd"], got["spscan"]
    assert torch.equal(xs, xa)
    for n in pa:
        assert torch.equal(ps[n], pa[n]), n
    assert ns < na  # the masks ran on the pooled tensors


class _OpCount(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it, and the backward kernels of convs, pools and ReLUs."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if func.overloadpacket in (torch.ops.aten.convolution_backward, torch.ops.aten.threshold_backward,
                                   torch.ops.aten.max_pool2d_with_indices_backward):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("frozen", [(0, 1, 2, 3), (0, 1, 2), (0, 1), (1, 2), (3,), (2, 3), ()])
@pytest.mark.parametrize("x_grad", [False, True])
def test_frozen_bottom_layers_cost_nothing(frozen, x_grad):
    """Fine-tuning: with the parameters of the layers in ``frozen`` (indices of the parametrized layers,
    bottom first) not requiring grad and no input gradient, the chain stops above the lowest layer
    that wants a gradient, as autograd does: the backward runs no more conv, pool and ReLU backward
    kernels than autograd's (and at most two more ATen ops in all), and every gradient is autograd's
    bit for bit (float64)."""
    torch.manual_seed(4)
    model = _vgg().double()
    params = [m for m in model if isinstance(m, (nn.Conv2d, nn.Linear))]
    for i in frozen:
        for p in params[i].parameters():
            p.requires_grad_(False)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    if len(frozen) == len(params) and not x_grad:
        return  # nothing requires a gradient: torch refuses the backward on both sides
    net = spscan.wrap(model, x, levels=0)
    got, counts = [], []
    for m in (model, net):
        model.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(x_grad)
        loss = (m(xx) * y).sum()
        with _OpCount() as c:
            loss.backward()
        counts.append((c.count, c.kernels))
        got.append(({n: p.grad for n, p in model.named_parameters()}, xx.grad))
    (pa, xa), (ps, xs) = got
    assert (xs is None) == (xa is None) and (xs is None or torch.equal(xs, xa))
    for n in pa:
        assert (ps[n] is None) == (pa[n] is None), n
        assert ps[n] is None or torch.equal(ps[n], pa[n]), n
    # the scan's own bookkeeping (a copy of the top gradient, a reshape) may add two light ops
    assert counts[1][1] <= counts[0][1] and counts[1][0] <= counts[0][0] + 2, counts
