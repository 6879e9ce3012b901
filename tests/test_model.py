"""Model-level API on nn.Sequential chains: wrapped training equals autograd (float64 ≤ 1e-9
relative; float32 within 2x autograd's own error), SGD trajectories match, explicit
forward/backward/param_grads, batch-size changes, Table 1 sparsities, and clear refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.prune as prune

import spscan
from layer_checks import run_errors
from spscan.layers import make_unit
from spscan.chain.model import Jacobians, ModelPlan, param_grads
from spscan.chain.planning import plan_model
from spscan.chain.wrapper import wrap_chain as wrap

# torch warns that even kernels with padding='same' copy the input; those cases are tested on purpose
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")
LEVELS = [0, 1, "full", "auto"]


def _bn_eval(m: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
    m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
    with torch.no_grad():
        m.weight.copy_(torch.randn(m.num_features, generator=gen))
        m.bias.copy_(torch.randn(m.num_features, generator=gen))
    return m.eval()


def mlp() -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 5))
    return net, (3, 4)


def cnn_strided() -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(1)
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(6, 6, 3, dilation=2, padding=2, groups=3), nn.LeakyReLU(0.1),
        nn.MaxPool2d(3, stride=2, padding=1),  # overlapping windows
        nn.Flatten(), nn.Linear(24, 8), nn.Sigmoid(), nn.Linear(8, 4))
    return net, (3, 8, 8)


def cnn_pruned_bn_dropout() -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(2)
    net = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AvgPool2d(2, padding=1, ceil_mode=True, count_include_pad=False),
        nn.Sequential(nn.Conv2d(4, 4, (3, 1), bias=False), nn.Identity()), nn.GELU(approximate="tanh"),
        nn.Flatten(), nn.Dropout(0.3), nn.Linear(16, 6))
    prune.l1_unstructured(net[0], "weight", amount=0.5)
    prune.random_unstructured(net[8], "weight", amount=0.4)
    _bn_eval(net[1], 2)
    return net, (2, 5, 7)


def conv1d_net() -> tuple[nn.Module, tuple[int, ...]]:
    torch.manual_seed(3)
    net = nn.Sequential(
        nn.Conv1d(2, 4, 5, stride=2), nn.GELU(), nn.MaxPool1d(2, ceil_mode=True),
        nn.Conv1d(4, 4, 4, padding="same", dilation=1), nn.BatchNorm1d(4), nn.Tanh(), nn.AvgPool1d(3, 1, 1),
        nn.Flatten(), nn.Linear(20, 3))
    _bn_eval(net[4], 3)
    return net, (2, 21)


MODELS = {"mlp": mlp, "cnn_strided": cnn_strided, "cnn_pruned_bn_dropout": cnn_pruned_bn_dropout,
          "conv1d": conv1d_net}


def _autograd_step(net, x, target, seed):
    x = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = net(x)
    loss = ((y - target) ** 2).sum() + y.sum()
    loss.backward()
    return y.detach(), x.grad, {n: p.grad for n, p in net.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / max(1e-300, float(b.double().abs().max())))


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("name", list(MODELS))
def test_wrapped_gradients_equal_autograd_float64(name, levels):
    net, shape = MODELS[name]()
    net = net.double()
    ref = MODELS[name]()[0].double()  # a second identical build (deepcopy cannot copy pruned modules)
    x = torch.randn(3, *shape, dtype=torch.float64)
    w = wrap(net, x, levels=levels)
    target = torch.randn(3, *w.plan.out_shape, dtype=torch.float64)
    y_ref, gx_ref, gp_ref = _autograd_step(ref, x, target, seed=7)
    y, gx, gp = _autograd_step(w, x, target, seed=7)  # the wrapper names parameters model.<name>
    assert torch.equal(y, y_ref)
    assert _rel(gx, gx_ref) <= 1e-9
    assert {n.removeprefix("model.") for n in gp} == set(gp_ref)
    for n, g in gp.items():
        assert _rel(g, gp_ref[n.removeprefix("model.")]) <= 1e-9, n


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("name", list(MODELS))
def test_wrapped_gradients_float32_within_autograd_error(name, levels):
    # three identical builds (deepcopy cannot copy pruned modules); dropout off: float32 and float64
    # tensors need not draw the same mask
    net, net64, ag32 = (MODELS[name]()[0] for _ in range(3))
    shape = MODELS[name]()[1]
    net64 = net64.double()
    for m in (net, net64, ag32):
        for layer in m.modules():
            if isinstance(layer, nn.modules.dropout._DropoutNd):
                layer.eval()
    x = torch.randn(4, *shape)
    w = wrap(net, x, levels=levels)
    target = torch.randn(4, *w.plan.out_shape)
    _, gx64, gp64 = _autograd_step(net64, x.double(), target.double(), seed=0)
    _, gx_ag, gp_ag = _autograd_step(ag32, x, target, seed=0)
    _, gx_sp, gp_sp = _autograd_step(w, x, target, seed=0)
    pairs = [(gx_sp, gx_ag, gx64)] + [(gp_sp["model." + n], gp_ag[n], gp64[n]) for n in gp64]
    for sp_, ag, ref in pairs:
        floor = 1e-6 * float(ref.abs().max())
        err_sp = float((sp_.double() - ref).abs().max())
        err_ag = float((ag.double() - ref).abs().max())
        assert err_sp <= 2 * err_ag + floor, (err_sp, err_ag, floor)


@pytest.mark.parametrize("name", ["cnn_strided", "cnn_pruned_bn_dropout"])
def test_sgd_steps_match_autograd(name):
    net, shape = MODELS[name]()
    net = net.double()
    ref = MODELS[name]()[0].double()
    x = torch.randn(5, *shape, dtype=torch.float64)
    w = wrap(net, x, levels="full")
    target = torch.randn(5, *w.plan.out_shape, dtype=torch.float64)
    opt = torch.optim.SGD(w.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        for model, o in ((w, opt), (ref, opt_ref)):
            o.zero_grad()
            torch.manual_seed(100 + step)
            loss = ((model(x) - target) ** 2).mean()
            loss.backward()
            o.step()
    for (n, p), (n_ref, p_ref) in zip(net.named_parameters(), ref.named_parameters()):
        assert n == n_ref
        assert _rel(p.detach(), p_ref.detach()) <= 1e-9, n
    # pruned weights stayed pruned (the gradient reaching weight_orig is masked), so the plan still holds
    w(x)


def test_wrap_shares_parameters_and_freezing_and_batch_change():
    net, shape = cnn_strided()
    net = net.double()
    net[2].weight.requires_grad_(False)
    net[6].bias.requires_grad_(False)
    w = wrap(net, torch.zeros(2, *shape, dtype=torch.float64))
    assert [id(p) for p in w.parameters()] == [id(p) for p in net.parameters()]
    ref = copy.deepcopy(net)
    for b in (2, 5, 1):
        for m in (w, ref):
            m.zero_grad(set_to_none=True)
        x = torch.randn(b, *shape, dtype=torch.float64)
        target = torch.randn(b, 4, dtype=torch.float64)
        _, gx, gp = _autograd_step(w, x, target, seed=0)
        _, gx_ref, gp_ref = _autograd_step(ref, x, target, seed=0)
        assert _rel(gx, gx_ref) <= 1e-9
        assert net[2].weight.grad is None and net[6].bias.grad is None
        for n, g in gp_ref.items():
            if g is None:
                assert gp["model." + n] is None
            else:
                assert _rel(gp["model." + n], g) <= 1e-9
    # input that does not require grad: parameters still get theirs
    w.zero_grad()
    w(torch.randn(2, *shape, dtype=torch.float64)).sum().backward()
    assert net[0].weight.grad is not None


@pytest.mark.parametrize("levels", LEVELS)
def test_explicit_forward_backward_param_grads(levels):
    net, shape = cnn_pruned_bn_dropout()
    net = net.double()
    x = torch.randn(3, *shape, dtype=torch.float64)
    plan = plan_model(net, x, levels=levels)
    assert isinstance(plan, ModelPlan)
    assert len(plan.patterns) == len(plan.units) == len(plan.layer_names) == 10
    assert plan.layer_names[4] == "4.0" and plan.units[4].module is net[4][0]
    assert "Conv2d" in plan.summary() and isinstance(plan.levels, int)
    for b in (3, 2):
        xb = torch.randn(b, *shape, dtype=torch.float64)
        torch.manual_seed(5)
        y, jac = plan.forward(xb)
        assert isinstance(jac, Jacobians) and len(jac) == 10 and jac.batch == b
        g = torch.randn_like(y)
        grads = plan.backward(jac, g)
        pg = param_grads(plan, jac, grads)
        xr = xb.clone().requires_grad_(True)
        torch.manual_seed(5)
        yr = net(xr)
        assert torch.equal(y, yr.detach())
        params = [p for p in net.parameters() if p.requires_grad]
        ref = torch.autograd.grad(yr, [xr] + params, g)
        assert _rel(grads[0].reshape(xb.shape), ref[0]) <= 1e-9
        names = [n for n, p in net.named_parameters() if p.requires_grad]
        assert set(pg) == set(names)
        for n, r in zip(names, ref[1:]):
            assert _rel(pg[n], r) <= 1e-9, n
        # the values are the reference chain's: float64 backprop over the same patterns agrees
        ref_grads = spscan.reference_backward(plan.patterns, list(jac), g)
        assert _rel(grads[0], ref_grads[0]) <= 1e-9


def test_public_dispatch():
    net, shape = mlp()
    net = net.double()
    x = torch.randn(2, *shape, dtype=torch.float64)
    plan = spscan.plan(net, x, levels=0)
    assert isinstance(plan, ModelPlan)
    y, jac = spscan.forward(plan, x)
    grads = spscan.backward(plan, jac, torch.ones_like(y))
    pg = spscan.param_grads(plan, jac, grads)
    xr = x.clone().requires_grad_(True)
    ref = torch.autograd.grad(net(xr).sum(), [xr] + list(net.parameters()))
    assert _rel(grads[0].reshape(x.shape), ref[0]) <= 1e-9
    for (n, _), r in zip(net.named_parameters(), ref[1:]):
        assert _rel(pg[n], r) <= 1e-9
    w = spscan.wrap(net, x, levels=0)
    assert isinstance(w, nn.Module)


def test_table1_sparsity():
    """Table 1: VGG-11's first conv (3->64, 3x3, pad 1), ReLU and 2x2/2 max-pool on a 32x32 image."""
    net = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2, 2))
    plan = plan_model(net, torch.zeros(1, 3, 32, 32), levels=0)
    sparsity = [1 - p.nnz / (p.shape[0] * p.shape[1]) for p in plan.patterns]
    assert [round(s, 5) for s in sparsity] == [0.99157, 0.99998, 0.99994]
    # the closed forms: conv taps (32*3-2)^2 per channel pair, one entry per ReLU row and pool output
    assert [p.nnz for p in plan.patterns] == [64 * 3 * 94 * 94, 64 * 32 * 32, 64 * 32 * 32]


# ----------------------------------------------------------------------------- refusals


def test_unsupported_layer_named():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Softmax2d()))
    run_errors(lambda: plan_model(net, torch.zeros(1, 4)), TypeError, "layer 3", "2.1", "Softmax2d", "supported")


def test_non_chain_models_refused():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            return self.a(x) * self.b(x)  # a product of branches: a live-set step (a sum is a planned block)

    # a model with its own forward is traced (spscan.graph.plan); spscan.chain.model plans chains only and says where to go
    # the product of two branches is a product unit (an operator per input) in a live-set step
    assert "mul (product) over live [a, b]" in spscan.plan(Net(), torch.zeros(1, 4)).summary()
    run_errors(lambda: plan_model(Net(), torch.zeros(1, 4)), TypeError, "Net", "nn.Sequential", "spscan.plan(model")
    run_errors(lambda: wrap(Net(), torch.zeros(1, 4)), TypeError, "Net", "spscan.wrap(model")

    class Seq(nn.Sequential):
        def forward(self, x):
            return super().forward(x) * 2

    # containers with their own forward are traced op by op (their nodes analytic or opaque), never refused
    for m in (Seq(nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), Seq(nn.ReLU())), nn.Sequential(nn.Linear(4, 4), Net())):
        x = torch.randn(3, 4, dtype=torch.float64)
        m = m.double()
        ref = copy.deepcopy(m)
        w = spscan.wrap(m, x)
        w(x).square().sum().backward()
        ref(x).square().sum().backward()
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    run_errors(lambda: plan_model(nn.Sequential(), torch.zeros(1, 4)), ValueError, "at least one layer")
    # a single supported layer is a chain of one
    assert len(plan_model(nn.Linear(4, 2), torch.zeros(1, 4), levels=0)) == 1


def test_mismatched_inputs():
    net = nn.Sequential(nn.Linear(12, 4), nn.ReLU(), nn.Linear(5, 2))
    run_errors(lambda: plan_model(net, torch.zeros(2, 7)), ValueError, "layer 0", "Linear", "(7,)")
    run_errors(lambda: plan_model(net, torch.zeros(2, 12)), ValueError, "layer 2", "Linear", "(4,)")
    bn = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(4).eval())
    run_errors(lambda: plan_model(bn, torch.zeros(2, 1, 5, 5)), ValueError, "layer 1", "BatchNorm2d", "4 channels")
    good = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten())
    plan = plan_model(good, torch.zeros(2, 1, 5, 5), levels=0)
    run_errors(lambda: plan.forward(torch.zeros(2, 1, 6, 5)), ValueError, "expected shape (B, 1, 5, 5)", "(2, 1, 6, 5)")
    run_errors(lambda: plan.forward(torch.zeros(1, 5, 5)), ValueError, "expected shape")
    w = wrap(good, torch.zeros(2, 1, 5, 5), levels=0)
    assert w(torch.zeros(3, 1, 4, 4)).shape == (3, 8)  # another image size: planned for it
    run_errors(lambda: w(torch.zeros(3, 2, 5, 5)), ValueError, "layer 0", "Conv2d", "(2, 5, 5)")
    run_errors(lambda: plan_model(good, torch.tensor(1.0)), ValueError, "example_input")


def test_batchnorm_train_mode_and_hooks_refused():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2).eval())
    plan = plan_model(net, torch.zeros(1, 1, 4, 4), levels=0)
    net.train()
    run_errors(lambda: plan.forward(torch.zeros(2, 1, 4, 4)), ValueError, "layer 1", "BatchNorm2d", "eval")
    net2 = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
    net2[1].register_forward_hook(lambda m, i, o: o * 2)
    # the chain front end refuses the layer (NotPlannable); spscan.plan and spscan.wrap trace such a chain
    run_errors(lambda: plan_model(net2, torch.zeros(1, 3)), spscan.NotPlannable, "layer 1", "hooks")


def test_pruned_weight_regrowing_is_planned_again():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        net[0].weight[0, 0] = 0.0
    w = wrap(net, torch.zeros(1, 4), prune_zeros=True, levels=0)
    assert w.plan.patterns[0].nnz == 15
    w(torch.randn(2, 4)).sum().backward()
    with torch.no_grad():
        net[0].weight[0, 0] = 1.0
    # a pruned weight regrown (dynamic sparse training): planned again, with a warning, then autograd's gradients
    x = torch.randn(2, 4)
    net.zero_grad()
    with pytest.warns(UserWarning, match=r"layer 0 .*weight element 0 was pruned .* planned again"):
        y = w(x)
    assert w.plan.patterns[0].nnz == 16
    y.sum().backward()
    g = net[0].weight.grad.clone()
    net.zero_grad()
    net(x).sum().backward()
    torch.testing.assert_close(g, net[0].weight.grad)


def test_param_grads_input_checks():
    net, shape = mlp()
    plan = plan_model(net, torch.zeros(1, *shape), levels=0)
    y, jac = plan.forward(torch.zeros(2, *shape))
    grads = plan.backward(jac, torch.ones_like(y))
    run_errors(lambda: param_grads(plan, list(jac), grads), TypeError, "Jacobians")
    run_errors(lambda: param_grads(plan, jac, grads[1:]), ValueError, "expected 9")


@pytest.mark.parametrize("levels", [0, "full"])
def test_wrapped_gradients_triton_backend(levels):
    """The Triton backend (interpreted on CPU, compiled on CUDA) behind the wrapper gives autograd's gradients."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    net, shape = cnn_strided()
    net, ref = net.double().to(dev), cnn_strided()[0].double().to(dev)
    x = torch.randn(2, *shape, dtype=torch.float64, device=dev)
    w = wrap(net, x, levels=levels, backend="triton")
    target = torch.randn(2, *w.plan.out_shape, dtype=torch.float64, device=dev)
    _, gx, gp = _autograd_step(w, x, target, seed=0)
    _, gx_ref, gp_ref = _autograd_step(ref, x, target, seed=0)
    assert _rel(gx, gx_ref) <= 1e-9
    for n, g in gp_ref.items():
        assert _rel(gp["model." + n], g) <= 1e-9, n


def test_double_backward_refused():
    net, shape = mlp()
    w = wrap(net.double(), torch.zeros(1, *shape, dtype=torch.float64), levels=0)
    x = torch.randn(2, *shape, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad((w(x) ** 2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|twice"):
        gx.sum().backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("levels", LEVELS)
def test_wrapped_gradients_on_cuda(levels):
    net, shape = cnn_pruned_bn_dropout()
    ref = cnn_pruned_bn_dropout()[0]
    net, ref = net.double().cuda(), ref.double().cuda()
    x = torch.randn(4, *shape, dtype=torch.float64, device="cuda")
    w = wrap(net, x, levels=levels, device="cuda")
    target = torch.randn(4, *w.plan.out_shape, dtype=torch.float64, device="cuda")
    _, gx_ref, gp_ref = _autograd_step(ref, x, target, seed=3)
    _, gx, gp = _autograd_step(w, x, target, seed=3)
    assert _rel(gx, gx_ref) <= 1e-9
    for n, g in gp_ref.items():
        assert _rel(gp["model." + n], g) <= 1e-9, n


def test_maxpool_return_indices_refused():
    net = nn.Sequential(nn.Conv2d(1, 1, 1), nn.MaxPool2d(2, return_indices=True))
    run_errors(lambda: plan_model(net, torch.zeros(1, 1, 4, 4)), spscan.NotPlannable, "layer 1", "one tensor")
    run_errors(lambda: make_unit(1, nn.MaxPool2d(2, return_indices=True), (1, 4, 4), (1, 2, 2)), ValueError,
               "layer 1", "return_indices")


# ----------------------------------------------------------------------------- random chains

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def random_chains(draw):
    """A random shape-compatible CNN/MLP chain on a small image, and its per-sample input shape."""
    c, h, w = draw(st.integers(1, 3)), draw(st.integers(3, 7)), draw(st.integers(3, 7))
    in_shape = (c, h, w)
    layers: list[nn.Module] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["conv", "conv", "act", "maxpool", "avgpool", "bn", "dropout2d"]))
        if kind == "conv":
            k = draw(st.integers(1, 3))
            groups = draw(st.sampled_from([g for g in (1, 2, 3) if c % g == 0]))
            cout = groups * draw(st.integers(1, 2))
            layers.append(nn.Conv2d(c, cout, k, stride=draw(st.integers(1, 2)), padding=draw(st.integers(0, 1)),
                                    dilation=draw(st.integers(1, 2)) if k > 1 else 1, groups=groups))
        elif kind == "act":
            layers.append(draw(st.sampled_from([nn.ReLU(), nn.Tanh(), nn.GELU(), nn.LeakyReLU(0.2), nn.Sigmoid(),
                                                nn.SiLU(), nn.ELU(), nn.Softplus(), nn.ReLU6()])))
        elif kind == "dropout2d":
            layers.append(nn.Dropout2d(0.3))  # train mode: a sampled channel mask
        elif kind == "maxpool":
            k = draw(st.integers(1, 3))
            layers.append(nn.MaxPool2d(k, stride=draw(st.integers(1, 2)), padding=draw(st.integers(0, k // 2)),
                                       ceil_mode=draw(st.booleans())))
        elif kind == "avgpool":
            k = draw(st.integers(1, 3))
            layers.append(nn.AvgPool2d(k, stride=draw(st.integers(1, 2)), padding=draw(st.integers(0, k // 2)),
                                       count_include_pad=draw(st.booleans())))
        else:
            layers.append(_bn_eval(nn.BatchNorm2d(c), draw(st.integers(0, 9))))
        try:
            with torch.no_grad():
                out = nn.Sequential(*layers)(torch.zeros(1, *in_shape)).shape[1:]
        except RuntimeError:  # the image became too small for this layer: end the chain here
            layers.pop()
            break
        c = out[0]
    with torch.no_grad():
        d = nn.Sequential(*layers)(torch.zeros(1, *in_shape)).numel() if layers else c * h * w
    layers += [nn.Flatten(), nn.Linear(d, draw(st.integers(1, 4)))]
    return layers, in_shape, draw(st.sampled_from(LEVELS)), draw(st.integers(1, 3))


@settings(max_examples=20)
@given(case=random_chains(), seed=st.integers(0, 2**16))
def test_random_chains_equal_autograd(case, seed):
    layers, in_shape, levels, batch = case
    torch.manual_seed(seed)
    net = nn.Sequential(*layers).double()
    for m in net.modules():  # fresh weights, deterministic per example
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.reset_parameters()
    x = torch.randn(batch, *in_shape, dtype=torch.float64)
    w = wrap(net, x, levels=levels)
    xs = x.clone().requires_grad_(True)
    torch.manual_seed(seed + 1)  # the same dropout masks in both forwards
    y = w(xs)
    g = torch.randn_like(y)
    y.backward(g)
    got = [xs.grad] + [p.grad for p in net.parameters()]
    for p in net.parameters():
        p.grad = None
    xr = x.clone().requires_grad_(True)
    torch.manual_seed(seed + 1)
    yr = net(xr)
    assert torch.equal(y, yr.detach())
    ref = torch.autograd.grad(yr, [xr] + list(net.parameters()), g)
    for a, b in zip(got, ref):
        assert _rel(a, b) <= 1e-9


def test_module_repeated_in_chain():
    """The same Linear twice (shared weights): two layers in the chain, gradients summed."""
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)
    net = nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh(), lin).double()
    x = torch.randn(3, 5, dtype=torch.float64)
    w = wrap(net, x, levels=LEVELS[-1])
    assert len(w.plan.units) == 5
    target = torch.randn(3, 5, dtype=torch.float64)
    _, gx, gp = _autograd_step(w, x, target, seed=0)
    gp = {n: g.clone() for n, g in gp.items()}
    net.zero_grad(set_to_none=True)
    _, gx_ref, gp_ref = _autograd_step(net, x, target, seed=0)
    assert _rel(gx, gx_ref) <= 1e-9
    assert set(gp) == {"model.0.weight", "model.0.bias"}
    for n, g in gp_ref.items():
        assert _rel(gp["model." + n], g) <= 1e-9
    plan = w.plan
    y, jac = plan.forward(x)
    grads = plan.backward(jac, torch.ones_like(y))
    pg = param_grads(plan, jac, grads)
    xr = x.clone().requires_grad_(True)
    r = torch.autograd.grad(net(xr).sum(), [xr, lin.weight, lin.bias])
    assert set(pg) == {"0.weight", "0.bias"}
    assert _rel(pg["0.weight"], r[1]) <= 1e-9 and _rel(pg["0.bias"], r[2]) <= 1e-9


@pytest.mark.parametrize("operators", [True, False])
def test_step_signature_changes_on_one_wrapper(operators):
    """The wrapper decides its backward once per signature (inputs needing gradients, device, module
    modes): switching between them on one wrapper — batch size, an input with and without
    ``requires_grad``, a frozen then unfrozen weight, train/eval (dropout masks, batch-norm statistics),
    float32/float64, a repeated backward over a retained graph — always gives autograd's gradients."""
    torch.manual_seed(5)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Flatten(), nn.Dropout(0.25), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    ref = copy.deepcopy(net)
    w = wrap(net, torch.zeros(2, 2, 4, 4, dtype=torch.float64), operators=operators)
    assert w.plan.levels == 0

    def check(b: int, x_grad: bool, train: bool, dtype: torch.dtype, frozen: bool, twice: bool = False) -> None:
        for m in (w, ref):
            m.train(train)
            m.to(dtype)
            m.zero_grad(set_to_none=True)
        net[6].weight.requires_grad_(not frozen)
        ref[6].weight.requires_grad_(not frozen)
        x = torch.randn(b, 2, 4, 4, dtype=dtype)
        t = torch.randn(b, 3, dtype=dtype)
        grads = []
        for m in (w, ref):
            xi = x.clone().requires_grad_(x_grad)
            torch.manual_seed(11)  # the same dropout mask on both sides
            y = m(xi)
            loss = ((y - t) ** 2).sum()
            loss.backward(retain_graph=twice)
            if twice:
                loss.backward()  # accumulates a second, equal gradient
            grads.append((xi.grad, {n.removeprefix("model."): p.grad for n, p in m.named_parameters()}))
        (gx, gp), (gx_ref, gp_ref) = grads
        tol = 1e-9 if dtype == torch.float64 else 1e-4
        assert (gx is None) == (not x_grad)
        if x_grad:
            assert _rel(gx, gx_ref) <= tol
        for n, g in gp_ref.items():
            if g is None:
                assert gp[n] is None, n
            else:
                # absolute floor: a conv bias before train-mode batch norm has a zero gradient (rounding only)
                err = float((gp[n].double() - g.double()).abs().max())
                assert err <= tol * max(1.0, float(g.double().abs().max())), (n, b, x_grad, train, dtype, frozen)
        assert torch.allclose(net[1].running_mean, ref[1].running_mean, rtol=tol, atol=tol)

    check(4, True, True, torch.float64, False)
    check(3, False, True, torch.float64, False)
    check(5, True, False, torch.float64, False)
    check(4, False, True, torch.float64, True)
    check(2, True, True, torch.float64, False, twice=True)
    check(6, True, True, torch.float32, False)
    check(4, True, False, torch.float32, True)
    check(4, True, True, torch.float64, False)
    assert len(w.plan._steps) >= 4  # one cached backward per signature seen


def test_second_backward_without_retain_graph_refused_like_autograd():
    """The wrapper frees each layer's activations as its backward runs (the graph is not retained),
    so a second backward over the same graph raises as autograd's does; with ``retain_graph=True``
    the second one adds the same gradients again."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)).double()
    w = wrap(net, torch.zeros(3, 4, dtype=torch.float64))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = w(x).sum()  # sum keeps no tensors: the second backward reaches the wrapper's node
    y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.backward()
    x.grad = None
    y = w(x).sum()
    y.backward(retain_graph=True)
    first = x.grad.clone()
    y.backward()
    assert torch.allclose(x.grad, 2 * first)
