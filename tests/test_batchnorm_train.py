"""Train-mode BatchNorm: exact, as a structured operator that couples the samples of a batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import spscan

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")  # the reference ResNet-20: examples/resnet.py
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from resnet import ResNet20  # noqa: E402


def _net(momentum=0.1, track=True, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=momentum, track_running_stats=track),
                         nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6, momentum=momentum),
                         nn.Tanh(), nn.Linear(6, 2)).double()


def _close(a, b, scale):
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10 * scale)


@pytest.mark.parametrize("momentum, track", [(0.1, True), (None, True), (0.1, False)])
def test_sgd_steps_equal_autograd(momentum, track):
    ref, ours = _net(momentum, track), _net(momentum, track)
    w = spscan.wrap(ours, torch.randn(3, 2, 5, 5, dtype=torch.float64))
    assert w.plan.levels == 0 and all(w.plan.operator_flags)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step, batch in enumerate([7, 7, 4, 9, 2]):  # the batch size may change
        x = torch.randn(batch, 2, 5, 5, generator=g, dtype=torch.float64)
        xr, xo = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        opt_r.zero_grad()
        opt_o.zero_grad()
        lr_, lo = ref(xr).pow(2).sum(), w(xo).pow(2).sum()
        _close(lo, lr_, 1.0)
        lr_.backward()
        lo.backward()
        # relative to the largest gradient of the step: weights feeding a BatchNorm have gradients near 0
        scale = max(float(t.abs().max()) for t in [xr.grad] + [p.grad for p in ref.parameters()])
        _close(xo.grad, xr.grad, scale)
        for p, q in zip(ref.parameters(), ours.parameters()):
            _close(q.grad, p.grad, scale)
        opt_r.step()
        opt_o.step()
    for mr, mo in zip(ref.modules(), ours.modules()):
        if isinstance(mr, nn.modules.batchnorm._BatchNorm) and mr.track_running_stats:
            _close(mo.running_mean, mr.running_mean, 1.0)
            _close(mo.running_var, mr.running_var, 1.0)
            assert int(mo.num_batches_tracked) == int(mr.num_batches_tracked) == 5


def test_float32_within_autograd_noise():
    ref64 = _net()
    ref, ours = _net().float(), _net().float()
    w = spscan.wrap(ours, torch.randn(3, 2, 5, 5))
    x = torch.randn(8, 2, 5, 5, generator=torch.Generator().manual_seed(3))
    grads = []
    for m, inp in ((ref64, x.double()), (ref, x), (w, x)):
        xi = inp.clone().requires_grad_(True)
        m(xi).pow(2).sum().backward()
        grads.append(xi.grad.double())
    err_auto = float((grads[1] - grads[0]).abs().max())
    err_ours = float((grads[2] - grads[0]).abs().max())
    assert err_ours <= 2 * err_auto + 1e-6 * float(grads[0].abs().max())


def test_deeper_plans_refused_and_eval_mode_planned_as_before():
    with pytest.raises(ValueError, match=r"layer 1 \(BatchNorm2d\).*levels=1"):
        spscan.wrap(_net(), torch.randn(3, 2, 5, 5, dtype=torch.float64), levels=1)
    net = _net().eval()
    w = spscan.wrap(net, torch.randn(3, 2, 5, 5, dtype=torch.float64), levels=1)
    assert w.plan.levels == 1
    net.train()  # switched after planning at depth 1: its values cannot enter the products
    with pytest.raises(ValueError, match="train mode"):
        w(torch.randn(3, 2, 5, 5, dtype=torch.float64)).sum().backward()


def _small_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(12, 3)).double()


@pytest.mark.parametrize("make, shape", [(_small_cnn, (4, 2, 6, 6)),
                                         (lambda: ResNet20(width=4).double(),
                                          (3, 3, 8, 8))], ids=["chain", "resnet"])
@pytest.mark.parametrize("levels", ["auto", "full"])
def test_planned_in_eval_mode_then_trained(make, shape, levels):
    """A model wrapped in eval mode (after a validation pass, or loaded from a checkpoint saved then) and then
    trained: with ``levels="auto"`` a plan whose depth a train-mode BatchNorm cannot run at is made again, once,
    as the model now is; training steps equal autograd's, and eval mode runs on the new plan. A forced depth
    stays refused, naming the layer."""
    net = make().eval()
    ref = make()
    ref.load_state_dict(net.state_dict())
    x0 = torch.randn(shape, dtype=torch.float64)
    if levels == "full":
        w = spscan.wrap(net, x0, backward="scan", levels=levels)
        if w.plan.levels == 0:
            return  # a chain of blocks of depth 0: nothing to refuse
        net.train()
        with pytest.raises(ValueError, match=r"layer \d+ \((\w+: )?BatchNorm\dd\).*train mode"):
            w(x0).sum().backward()
        return
    w = spscan.wrap(net, x0, backward="scan", levels=levels)
    first = w.plan
    if make is _small_cnn:
        assert first.levels > 0  # what eval mode plans here: the case this test is for
    for mode in ("train", "train", "eval"):
        for m in (w, ref):
            m.train(mode == "train")
            m.zero_grad(set_to_none=True)
        x = torch.randn(shape, dtype=torch.float64)
        y, y_ref = w(x), ref(x)
        _close(y, y_ref, 1.0)
        y.square().sum().backward()
        y_ref.square().sum().backward()
        for p, q in zip(net.parameters(), ref.parameters()):
            _close(p.grad, q.grad, float(q.grad.abs().max()))
        for a, b in zip(net.buffers(), ref.buffers()):
            assert torch.equal(a, b)  # running statistics updated as autograd's model updates them
    assert (w.plan is not first) == (first.levels > 0)


class _BnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Linear(4, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.c1(x))).mean((2, 3)))


@pytest.mark.parametrize("backward", ["auto", "scan", "native"])
@pytest.mark.parametrize("between", ["eval", "other_shape", "train_other_shape"])
def test_a_validation_batch_between_a_forward_and_its_backward(backward, between):
    """A training forward, then a call planned on first use (eval mode under no_grad, a batch of another image
    size), then the first forward's backward. Planning ran the model and wrote the BatchNorm statistics back
    with ``copy_``, a new version of a tensor the recorded backward had saved: "one of the variables needed
    for gradient computation has been modified by an inplace operation" (``auto``). The planner now puts them
    back without a new version, and a call under no_grad plans nothing. Gradients and statistics are autograd's."""
    import copy

    torch.manual_seed(0)
    model = _BnNet().double()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    net = spscan.wrap(model, x, backward=backward)
    other = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    losses = []
    for m, wrapped in ((ref, ref), (model, net)):
        loss = wrapped(x).square().sum()
        if between == "eval":
            wrapped.eval()
            with torch.no_grad():
                wrapped(x)
            wrapped.train()
        elif between == "other_shape":
            with torch.no_grad():
                wrapped(other)
        else:
            wrapped(other).sum()  # a second training forward, never backpropagated
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-12)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-9, atol=1e-12), n
    for a, b in zip(model.buffers(), ref.buffers()):
        assert torch.allclose(a.double(), b.double(), rtol=1e-12, atol=1e-14)
