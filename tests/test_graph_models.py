"""Models torch.fx traces (residual networks with BatchNorm in eval and train mode, pre-activation
blocks, concatenations, functional ops) through spscan.wrap: every parameter's and the input's gradient equal autograd's (float64 ≤ 1e-9
relative; float32 within 2x autograd's own float32 error against a float64 reference), and five
SGD steps from the same initialization land on the same parameters."""

from __future__ import annotations

import copy
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import spscan
from layer_checks import run_errors
from spscan.chain.model import ModelPlan
from spscan.graph.plan import GraphPlan

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")  # the reference ResNet-20: examples/resnet.py
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from resnet import ResNet20  # noqa: E402


# ----------------------------------------------------------------------------- models


class PreActBlock(nn.Module):
    """Pre-activation residual block (He et al. 2016b): x + conv(relu(bn(conv(relu(bn(x))))))."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.bn1, self.conv1 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1)
        self.bn2, self.conv2 = nn.BatchNorm2d(c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        out = self.conv1(F.relu(self.bn1(x)))
        out = self.conv2(F.relu(self.bn2(out)))
        return x + out


class PreActNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 3, 3, padding=1)
        self.block1, self.block2 = PreActBlock(3), PreActBlock(3)
        self.head = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4))

    def forward(self, x):
        return self.head(self.block2(self.block1(self.stem(x))))


class NormMLP(nn.Module):
    """An MLP with LayerNorm and GELU, one residual connection, written with functional ops."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln1 = nn.Linear(6, 8), nn.LayerNorm(8)
        self.fc2, self.ln2 = nn.Linear(8, 8), nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = F.gelu(self.ln1(self.fc1(x)))
        h = h + F.gelu(self.ln2(self.fc2(h)))
        return self.out(h)


class Classifier(nn.Module):
    """A small CNN classifier ending in LogSoftmax, with functional pooling and a view."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 3, 3, padding=1), nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 2 * 2, 5)
        self.logp = nn.LogSoftmax(dim=1)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = torch.tanh(self.conv2(x))
        x = x.view(x.size(0), -1)
        return self.logp(self.fc(x))


class DenseBlock(nn.Module):
    """DenseNet-style: each layer's output concatenated to its input along channels."""

    def __init__(self, c: int, growth: int) -> None:
        super().__init__()
        self.l1 = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, growth, 3, padding=1))
        self.l2 = nn.Sequential(nn.BatchNorm2d(c + growth), nn.ReLU(), nn.Conv2d(c + growth, growth, 3, padding=1))
        self.fc = nn.Linear((c + 2 * growth) * 16, 3)

    def forward(self, x):
        x = torch.cat([x, self.l1(x)], 1)
        x = torch.cat([x, self.l2(x)], 1)
        return self.fc(torch.flatten(x, 1))


def _init(model: nn.Module, seed: int) -> nn.Module:
    """Random parameters and running statistics (so eval-mode BatchNorm is not the identity)."""
    torch.manual_seed(seed)
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            m.running_mean.normal_(0, 0.3)
            m.running_var.uniform_(0.5, 1.5)
            nn.init.normal_(m.weight, 1.0, 0.2)
            nn.init.normal_(m.bias, 0.0, 0.2)
    return model.eval()


CASES = {
    "resnet20": (lambda: ResNet20(width=2, classes=5), (3, 3, 8, 8), GraphPlan),
    "preact": (lambda: PreActNet(), (3, 2, 5, 5), GraphPlan),
    "norm_mlp": (lambda: NormMLP(), (4, 6), GraphPlan),
    "logsoftmax_classifier": (lambda: Classifier(), (3, 1, 8, 8), ModelPlan),
    "dense_block": (lambda: DenseBlock(2, 2), (2, 2, 4, 4), GraphPlan),
}


def _loss(y: torch.Tensor) -> torch.Tensor:
    w = torch.linspace(-1.0, 1.0, y[0].numel(), dtype=y.dtype).reshape(y.shape[1:])
    return (y * w).sum() + 0.5 * (y * y).sum()


def _grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    model.zero_grad()
    xi = x.clone().requires_grad_(True)
    y = model(xi)
    _loss(y).backward()
    named = model.model if isinstance(model, spscan.SpscanModule) else model
    return y.detach(), {n: p.grad.clone() for n, p in named.named_parameters()}, xi.grad.clone()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


# ----------------------------------------------------------------------------- float64


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_float64(name):
    make, shape, kind = CASES[name]
    model = _init(make(), 0).double()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    wrapped = spscan.wrap(model, x)
    assert type(wrapped.plan) is kind  # a straight chain is a chain plan, not a graph of blocks
    y_ref, g_ref, gx_ref = _grads(model, x)
    y, g, gx = _grads(wrapped, x)
    assert torch.equal(y, y_ref)
    assert _rel(gx, gx_ref) <= 1e-9
    assert set(g) == set(g_ref)
    for n in g_ref:
        assert _rel(g[n], g_ref[n]) <= 1e-9, n


@pytest.mark.parametrize("name", ["preact", "dense_block"])
def test_csr_values_and_full_depth(name):
    """The wrapper with CSR values everywhere (operators=False) and every block in up-sweep products."""
    make, shape, _ = CASES[name]
    model = _init(make(), 9).double()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    wrapped = spscan.wrap(model, x, operators=False, levels="full")
    y_ref, g_ref, gx_ref = _grads(model, x)
    y, g, gx = _grads(wrapped, x)
    assert torch.equal(y, y_ref)
    assert _rel(gx, gx_ref) <= 1e-9
    for n in g_ref:
        assert _rel(g[n], g_ref[n]) <= 1e-9, n


@pytest.mark.parametrize("levels", [0, "full"])
def test_resnet20_levels_and_explicit_api(levels):
    """The block-level scan at both ends of the depth range, and spscan.forward/backward/param_grads."""
    model = _init(ResNet20(width=2, classes=5), 2).double()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    plan = spscan.plan(model, x, levels=levels)
    # blocks: stem conv, BN, ReLU; 9 residual blocks, each followed by its ReLU; pool, view, fc
    assert len(plan) == 3 + 9 * 2 + 3
    assert sum(isinstance(s, type(plan.segments[3])) for s in plan.segments) == 9
    y, jac = spscan.forward(plan, x)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    gs = spscan.backward(plan, jac, grad)
    pg = spscan.param_grads(plan, jac, gs)
    model.zero_grad()
    xi = x.clone().requires_grad_(True)
    (model(xi) * grad).sum().backward()
    assert _rel(gs[0].reshape(x.shape), xi.grad) <= 1e-9
    for n, p in model.named_parameters():
        assert _rel(pg[n], p.grad) <= 1e-9, n


# ----------------------------------------------------------------------------- float32


@pytest.mark.parametrize("name", ["resnet20", "norm_mlp", "dense_block"])
def test_gradients_float32(name):
    make, shape, _ = CASES[name]
    base = _init(make(), 5)
    x64 = torch.randn(shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    _, g64, gx64 = _grads(copy.deepcopy(base).double(), x64)
    m32 = copy.deepcopy(base).float()
    x32 = x64.float()
    _, ga, gxa = _grads(m32, x32)
    _, gs, gxs = _grads(spscan.wrap(m32, x32), x32)

    def check(got, auto, ref, what):
        err_s = float((got.double() - ref).abs().max())
        err_a = float((auto.double() - ref).abs().max())
        # 2x autograd's own error; the floor of a few float32 ulps covers an autograd error that is exactly 0
        floor = 4 * torch.finfo(torch.float32).eps * float(ref.abs().max())
        assert err_s <= 2 * err_a + floor, f"{what}: {err_s} vs autograd's {err_a}"

    check(gxs, gxa, gx64, "input")
    for n in g64:
        check(gs[n], ga[n], g64[n], n)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("name", ["resnet20", "preact", "norm_mlp", "logsoftmax_classifier", "dense_block"])
def test_sgd_steps_equal_autograd(name):
    make, shape, _ = CASES[name]
    ref = _init(make(), 7).double()
    mine = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(8)
    xs = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(5)]
    wrapped = spscan.wrap(mine, xs[0])
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_mine = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    for x in xs:
        for model, opt in ((ref, opt_ref), (wrapped, opt_mine)):
            opt.zero_grad()
            _loss(model(x)).backward()
            opt.step()
    for (n, p), (_, q) in zip(ref.named_parameters(), mine.named_parameters()):
        assert _rel(q.detach(), p.detach()) <= 1e-9, n


def test_resnet20_train_mode_batchnorm():
    """BatchNorm in train mode (batch statistics couple the samples): gradients, running statistics
    and 5 SGD steps equal autograd's, the blocks run as structured operators at block depth 0."""
    ref = _init(ResNet20(width=2, classes=5), 11).double().train()
    mine = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(12)
    xs = [torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64) for _ in range(5)]
    wrapped = spscan.wrap(mine, xs[0])
    assert isinstance(wrapped.plan, GraphPlan) and wrapped.plan.levels == 0
    y_ref, g_ref, gx_ref = _grads(ref, xs[0])
    y, g, gx = _grads(wrapped, xs[0])
    assert torch.equal(y, y_ref) and _rel(gx, gx_ref) <= 1e-9
    for n in g_ref:
        assert _rel(g[n], g_ref[n]) <= 1e-9, n
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_mine = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    for x in xs:
        for model, opt in ((ref, opt_ref), (wrapped, opt_mine)):
            opt.zero_grad()
            _loss(model(x)).backward()
            opt.step()
    for (n, p), (_, q) in zip(ref.named_parameters(), mine.named_parameters()):
        assert _rel(q.detach(), p.detach()) <= 1e-9, n
    for (n, a), (_, b) in zip(ref.named_buffers(), mine.named_buffers()):
        assert torch.equal(a, b) if not a.dtype.is_floating_point else _rel(b, a) <= 1e-9, n


def test_train_mode_blocks_form_no_patterns():
    """With train-mode BatchNorm the blocks only ever run as structured operators: planning and
    training form none of their symbolic products (most of a residual network's planning time);
    the core API's per-block values are refused with the reason; in eval mode they are formed."""
    from spscan.graph.segments import Parallel as _Parallel

    model = _init(ResNet20(width=2, classes=5), 13).double().train()
    x = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    wrapped = spscan.wrap(model, x)
    plan = wrapped.plan
    blocks = [s for s in plan.segments if isinstance(s, _Parallel)]
    assert blocks and plan.operator_only
    for _ in range(2):
        _loss(wrapped(x)).backward()
    assert all(b._structure is None for b in blocks)
    assert "(operator only)" in plan.summary()
    run_errors(lambda: plan.forward(x), ValueError, "train mode", "model.eval()")
    evaluated = spscan.wrap(model.eval(), x, levels=0).plan
    assert not evaluated.operator_only
    assert all(p.nnz > 0 for p in evaluated.patterns)


class _ConvBackwardCount(TorchDispatchMode):
    """Counts ``convolution_backward`` calls dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.convolution_backward:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("frozen", ["none", "block_conv_weights", "bn_biases", "everything_but_head"])
@pytest.mark.parametrize("input_grad", [True, False])
def test_block_layers_compute_parameter_gradients_as_applied(frozen, input_grad):
    """At block depth 0 each branch layer's operator computes its parameter gradients while the block
    is applied (one ``convolution_backward`` per conv, as autograd): no second pass over the branches.
    Frozen parameters and an input without ``requires_grad`` change nothing but what is computed;
    gradients equal autograd's bit for bit (train-mode BatchNorm, float64)."""
    ref = _init(ResNet20(width=2, classes=5), 21).double().train()
    mine = copy.deepcopy(ref)
    for model in (ref, mine):
        for n, p in model.named_parameters():
            if ((frozen == "block_conv_weights" and "layer" in n and "conv" in n and n.endswith("weight"))
                    or (frozen == "bn_biases" and "bn" in n and n.endswith("bias"))
                    or (frozen == "everything_but_head" and not n.startswith("fc"))):
                p.requires_grad_(False)
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    wrapped = spscan.wrap(mine, x)
    assert isinstance(wrapped.plan, GraphPlan) and wrapped.plan.levels == 0
    counts, grads = [], []
    for model in (ref, wrapped):
        model.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(input_grad)
        loss = _loss(model(xi))
        with _ConvBackwardCount() as c:
            loss.backward()
        counts.append(c.count)
        named = model.model if isinstance(model, spscan.SpscanModule) else model
        grads.append(({n: None if p.grad is None else p.grad.clone() for n, p in named.named_parameters()},
                      xi.grad))
    (g_ref, gx_ref), (g, gx) = grads
    assert (gx is None) == (gx_ref is None) and (gx is None or torch.equal(gx, gx_ref))
    for n in g_ref:
        assert (g[n] is None) == (g_ref[n] is None), n
        assert g[n] is None or torch.equal(g[n], g_ref[n]), n
    assert counts[1] <= counts[0], counts


# ----------------------------------------------------------------------------- refusals


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2.0  # a product with a scalar: no analytic unit, its own backward (opaque)


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x), x


def test_refusals_name_the_node_and_line():
    x = torch.zeros(2, 4)
    assert "mul 2" in spscan.wrap(_Scaled(), x).plan.summary()  # a scalar factor: a scale unit
    net = _init(PreActNet(), 0)
    net.block1.bn1.train()  # couples the batch: planned matrix-free at block depth 0 only
    run_errors(lambda: spscan.wrap(net, torch.zeros(2, 2, 5, 5), levels="full"), ValueError, "BatchNorm2d",
               "block1.bn1", "block depth 0", "levels='full'")
    run_errors(lambda: spscan.wrap(net, torch.zeros(2, 2, 5, 5), operators=False), ValueError, "block1.bn1",
               "operators=False")

    class Sliced(nn.Module):
        def forward(self, x):
            return x[:, [0, 1]]  # advanced indexing reading each entry once: a selection (found by probing)

    class Repeated(nn.Module):
        def forward(self, x):
            return x[:, [0, 0]]  # an entry read twice: not a selection, its own backward (opaque)

    assert "opaque" not in spscan.wrap(Sliced(), x).plan.summary()
    assert "opaque: operator.getitem(x," in spscan.wrap(Repeated(), x).plan.summary()

    class Mixed(nn.Module):
        def forward(self, x):
            return x.view(-1)

    run_errors(lambda: spscan.wrap(Mixed(), x), spscan.NotPlannable, "nothing to scan")


class _Results(nn.Module):
    """A forward whose result is not one batch-first tensor: a tuple with the input and a constant, a dict,
    the batch merged into the rows (a language model's ``logits.view(-1, V)``), a tensor with the batch second."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc, self.fc2, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 3), nn.Linear(6, 4)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        y = self.fc2(h)
        if self.how == "reconstruction":  # an autoencoder's loss against its own input, inside the forward
            return F.mse_loss(self.fc3(h), x), y
        if self.how == "tuple":
            return y, x, None
        if self.how == "dict":
            return {"logits": y, "hidden": h, "n": 3}
        if self.how == "rows":
            return F.log_softmax(y.view(-1, 1), dim=1) + y.reshape(-1, 1)
        return y.unsqueeze(0).transpose(0, 1).transpose(0, 2), h  # (3, B, 1) and (B, 6)


@pytest.mark.parametrize("how", ["tuple", "dict", "rows", "batch_second", "reconstruction"])
def test_results_other_than_one_batch_first_tensor(how):
    """The chain ends in the graph tensors the result is computed from (concatenated where several), and the
    wrapper makes the result from it after the scan's step, under autograd: autograd's gradients."""
    torch.manual_seed(0)
    model = _init(_Results(how), 1).double()
    ref = copy.deepcopy(model)
    w = spscan.wrap(model, torch.randn(4, 3, 4, dtype=torch.float64), backward="scan")
    flat = lambda r: [t for t in (r.values() if isinstance(r, dict) else r if isinstance(r, tuple) else [r])  # noqa
                      if isinstance(t, torch.Tensor)]
    for b in (4, 2):
        x = torch.randn(b, 3, 4, dtype=torch.float64)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = w(xa), ref(xb)
        assert type(got) is type(want)
        if isinstance(want, (tuple, dict)):
            assert [type(v) for v in (got.values() if isinstance(got, dict) else got)] == \
                [type(v) for v in (want.values() if isinstance(want, dict) else want)]
        ga, gb = flat(got), flat(want)
        torch.manual_seed(b)
        wts = [torch.randn_like(t) for t in gb]
        sum((a * wt).sum() for a, wt in zip(ga, wts)).backward()
        sum((a * wt).sum() for a, wt in zip(gb, wts)).backward()
        for a, c in zip(ga, gb):
            assert a.shape == c.shape and _rel(a, c) <= 1e-12
        assert _rel(xa.grad, xb.grad) <= 1e-10
        for p, q in zip(model.parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None)  # fc3 is read by the reconstruction alone
            assert p.grad is None or _rel(p.grad, q.grad) <= 1e-10
            p.grad = q.grad = None


class _NextTokenLoss(nn.Module):
    """A language model whose forward returns its next-token loss, the targets taken from its own token ids."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc, self.head = nn.Embedding(20, 6), nn.Linear(6, 6), nn.Linear(6, 20)

    def forward(self, ids):
        logits = self.head(torch.tanh(self.fc(self.emb(ids))))
        return F.cross_entropy(logits[:, :-1].reshape(-1, 20), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_result_reading_the_token_ids_themselves(dtype):
    """``ids[:, 1:]`` (the loss's targets) was a graph tensor packed with the logits into the scan's floating
    output, so ``cross_entropy`` got float targets and the forced scan crashed; integer tensors of the result
    are computed again from the input after the step."""
    torch.manual_seed(0)
    model = _NextTokenLoss().to(dtype)
    ref = copy.deepcopy(model)
    w = spscan.wrap(model, torch.randint(0, 20, (3, 9)), backward="scan")
    for b in (3, 1, 4):
        ids = torch.randint(0, 20, (b, 9))
        got, want = w(ids), ref(ids)
        assert _rel(got, want) <= (1e-12 if dtype == torch.float64 else 1e-6)
        got.backward()
        want.backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) <= (1e-10 if dtype == torch.float64 else 1e-5)
            p.grad = q.grad = None


# ----------------------------------------------------------------------------- random DAGs


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_KINDS = ["linear", "relu", "tanh", "layernorm", "gelu"]


@st.composite
def _chains(draw, depth: int, allow_empty: bool = False):
    n = draw(st.integers(0 if allow_empty else 1, 3))
    items = []
    for _ in range(n):
        if depth > 0 and draw(st.integers(0, 2)) == 0:
            join = draw(st.sampled_from(["add", "cat"]))
            items.append((join, draw(_chains(depth - 1, allow_empty=True)), draw(_chains(depth - 1))))
        else:
            items.append(("layer", draw(st.sampled_from(_KINDS))))
    return items


class RandomDAG(nn.Module):
    """A model from a recipe: layers, adds of two branches and feature concatenations (followed by
    a Linear back to the width), nested; forward is plain Python over the recipe (fx unrolls it)."""

    def __init__(self, recipe, d: int) -> None:
        super().__init__()
        self.d = d
        self.mods = nn.ModuleList()
        self.program = self._build(recipe)

    def _add(self, m: nn.Module) -> int:
        self.mods.append(m)
        return len(self.mods) - 1

    def _build(self, chain):
        prog = []
        for item in chain:
            if item[0] == "layer":
                m = {"linear": lambda: nn.Linear(self.d, self.d), "relu": nn.ReLU, "tanh": nn.Tanh,
                     "layernorm": lambda: nn.LayerNorm(self.d), "gelu": nn.GELU}[item[1]]()
                prog.append(("layer", self._add(m)))
            else:
                a, b = self._build(item[1]), self._build(item[2])
                proj = self._add(nn.Linear(2 * self.d, self.d)) if item[0] == "cat" else None
                prog.append((item[0], a, b, proj))
        return prog

    def _run(self, prog, x):
        for p in prog:
            if p[0] == "layer":
                x = self.mods[p[1]](x)
            else:
                a, b = self._run(p[1], x), self._run(p[2], x)
                x = a + b if p[0] == "add" else self.mods[p[3]](torch.cat([a, b], 1))
        return x

    def forward(self, x):
        return self._run(self.program, x)


@settings(max_examples=12, deadline=None)
@given(recipe=_chains(2), seed=st.integers(0, 2**16))
def test_random_dags_equal_autograd(recipe, seed):
    torch.manual_seed(seed)
    model = RandomDAG(recipe, 3).double()
    if not list(model.mods):
        return
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    wrapped = spscan.wrap(model, x, levels=seed % 3)  # 0, 1 or 2 up-sweep levels at block level
    y_ref, g_ref, gx_ref = _grads(model, x)
    y, g, gx = _grads(wrapped, x)
    assert torch.equal(y, y_ref)
    assert _rel(gx, gx_ref) <= 1e-9
    for n in g_ref:
        assert _rel(g[n], g_ref[n]) <= 1e-9, n


def test_block_pattern_symbolics():
    """Union (sum and side by side), the structural product and placement, against dense arithmetic."""
    import numpy as np
    import scipy.sparse as sp

    from spscan.planner.blocks import place, product_pattern, union_pattern

    pats = [sp.csr_array(sp.random(5, 4, density=0.4, random_state=i, format="csr")) for i in range(3)]
    for p in pats:
        p.data[:] = 1.0
    u, maps = union_pattern(pats)
    dense = sum(p.toarray() for p in pats) != 0
    assert np.array_equal(u.toarray() != 0, dense)
    for p, m in zip(pats, maps):
        rows = np.repeat(np.arange(5), np.diff(p.indptr))
        urows = np.repeat(np.arange(5), np.diff(u.indptr))
        assert np.array_equal(urows[m], rows) and np.array_equal(u.indices[m], p.indices)
    side, smaps = union_pattern(pats, [0, 4, 8])
    assert np.array_equal(side.toarray() != 0, np.hstack([p.toarray() for p in pats]) != 0)
    assert np.array_equal(smaps[1], place(side, pats[1], 4))
    sq = [sp.csr_array(sp.random(4, 4, density=0.3, random_state=i, format="csr")) for i in range(3)]
    prod = product_pattern(sq)
    ref = (sq[0].toarray() != 0).astype(int) @ (sq[1].toarray() != 0) @ (sq[2].toarray() != 0)
    assert np.array_equal(prod.toarray() != 0, ref != 0)
    run_errors(lambda: place(pats[0], sp.csr_array(np.ones((5, 4)))), ValueError, "outside the union")


# ----------------------------------------------------------------------------- nodes the output does not read


class _DeadBranch(nn.Module):
    """``self.b(x)`` is computed and never read."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 6), nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        y = self.a(x)
        z = self.b(x)  # noqa: F841 - dead on purpose
        return self.c(torch.tanh(y))


class _DeadInBlock(nn.Module):
    """A residual block with a dead node reading the block's input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.d, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        y = self.a(x) + x
        z = self.d(y)  # noqa: F841
        return self.c(torch.relu(self.b(y)) + y)


class _LastState(nn.Module):
    """The usual recurrent classifier: ``out, h = self.rnn(x)`` and a head on the last layer's final state;
    the sequence output is never read (num_layers equals the planner's probe batch of 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(4, 6, num_layers=2, batch_first=True)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        out, h = self.rnn(x)
        return self.fc(h[-1])


def _some_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """As :func:`_grads`, for the parameters that got a gradient."""
    model.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_(True)
    y = model(xi)
    _loss(y).backward()
    named = model.model if isinstance(model, spscan.SpscanModule) else model
    return y.detach(), {n: p.grad.clone() for n, p in named.named_parameters() if p.grad is not None}, xi.grad.clone()


@pytest.mark.parametrize("make, shape, dead", [(_DeadBranch, (4, 5), "b."), (_DeadInBlock, (4, 5), "d."),
                                               (_LastState, (3, 7, 4), "-")], ids=["chain", "block", "last_state"])
@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_nodes_the_output_does_not_read_are_left_out(make, shape, dead, backward):
    """A node the output does not depend on is not a step of the chain (it once was: the forward ran it
    in line, with wrong outputs and gradients, or planning failed); its parameters get no gradient
    (``None``), as under autograd. Two steps, the batch size changing."""
    model = _init(make(), 3).double()
    ref = copy.deepcopy(model)
    wrapped = spscan.wrap(model, torch.randn(shape, dtype=torch.float64), backward=backward)
    live = {n for n, _ in ref.named_parameters() if not n.startswith(dead)}
    for batch in (shape[0], 2):
        x = torch.randn((batch, *shape[1:]), generator=torch.Generator().manual_seed(batch), dtype=torch.float64)
        y_ref, g_ref, gx_ref = _some_grads(ref, x)
        y, g, gx = _some_grads(wrapped, x)
        assert _rel(y, y_ref) <= 1e-12
        assert _rel(gx, gx_ref) <= 1e-9
        assert set(g) == set(g_ref) == live
        for n in g_ref:
            assert _rel(g[n], g_ref[n]) <= 1e-9, n


# ----------------------------------------------------------------------------- a forward that reads self.training


class _ModeBranches(nn.Module):
    """``self.training`` read in Python: fx freezes it into the traced graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = F.dropout(torch.tanh(self.a(x)), 0.4, training=self.training)
        if self.training:
            h = h * 1.5
        return self.b(h)


@pytest.mark.parametrize("first", ["train", "eval"])
def test_a_traced_forward_follows_the_models_mode(first):
    """A traced graph is specialized to the mode it was traced in; the wrapper runs the plan traced in the
    model's present mode (the other made on first use, then both kept): outputs and gradients equal
    autograd's in train and in eval mode, with gradients on in both (it once kept the train-mode graph,
    dropout and all, in eval mode)."""
    model = _init(_ModeBranches(), 5).double().train(first == "train")
    ref = copy.deepcopy(model)
    wrapped = spscan.wrap(model, torch.randn(4, 5, dtype=torch.float64), backward="scan")
    plans = set()
    for mode in ("train", "eval", "train", "eval", "train"):
        for m in (wrapped, ref):
            m.train(mode == "train")
        x = torch.randn(4, 5, dtype=torch.float64)
        torch.manual_seed(1)
        y, g, gx = _grads(wrapped, x)
        torch.manual_seed(1)
        y_ref, g_ref, gx_ref = _grads(ref, x)
        assert torch.equal(y, y_ref)
        assert _rel(gx, gx_ref) <= 1e-12
        for n in g_ref:
            assert _rel(g[n], g_ref[n]) <= 1e-12, n
        assert wrapped.plan.planned_training == (mode == "train")
        plans.add(id(wrapped.plan))
    assert len(plans) == 2  # one plan per mode, each made once


class _TwoHeads(nn.Module):
    """A trunk and two heads; the loss may read one head only (an auxiliary head used now and then)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.trunk, self.h1, self.h2 = nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if self.how == "dict":
            return {"main": self.h1(h), "aux": self.h2(h)}
        return self.h1(h), self.h2(h)


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("how", ["tuple", "dict"])
def test_a_parameter_only_an_unread_output_depends_on_keeps_no_gradient(how, backward):
    """Autograd leaves ``.grad`` None for a parameter that only outputs the loss does not read depend on; the
    scan gave it zeros, and SGD with momentum and weight decay then moved it (0.26 after three steps). The
    parameters are autograd's after every step: the auxiliary head read at the first step only, then the
    main head read through ``.detach()`` with the auxiliary one."""
    torch.manual_seed(0)
    model = _init(_TwoHeads(how), 2).double()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    w = spscan.wrap(model, x, backward=backward)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1) for m in (ref, model)]
    for step in range(4):
        for m, run, opt in ((ref, ref, opts[0]), (model, w, opts[1])):
            opt.zero_grad()
            out = run(x)
            main, aux = (out["main"], out["aux"]) if how == "dict" else out
            if step == 0:
                loss = main.square().sum() + aux.square().sum()
            elif step == 3:
                loss = main.detach().sum() + aux.square().sum()
            else:
                loss = main.square().sum()
            loss.backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), f"step {step}: {n}"
        for opt in opts:
            opt.step()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p, q, rtol=1e-12, atol=1e-14), f"step {step}: {n}"


class _WithValues(nn.Module):
    """Logits with values computed from them that carry no gradient, and one number per sample."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 3)

    def forward(self, x):
        y = self.a(x)
        return y, y.argmax(1), y > 0, (y > 0).float(), y.topk(2, 1).indices, y.sum(1), y[:, 0]


def test_integer_boolean_and_per_sample_number_results():
    """Integers and booleans (``y.argmax(1)``, ``y > 0``) are not graph tensors of the scan: the result
    recomputes them from what they are made of (packed into the scan's floating output they came back wrong,
    argmax all 0); a result of one number per sample (``y.sum(1)``) is packed as a column (it crashed
    ``wrap``). Values, dtypes and gradients are autograd's."""
    torch.manual_seed(0)
    model = _WithValues().double()
    ref = copy.deepcopy(model)
    w = spscan.wrap(model, torch.randn(4, 6, dtype=torch.float64), backward="scan")
    for b in (5, 1):
        x = torch.randn(b, 6, dtype=torch.float64)
        got, want = w(x), ref(x)
        for a, c in zip(got, want):
            assert a.dtype == c.dtype and a.shape == c.shape and torch.equal(a, c)
            assert a.requires_grad == c.requires_grad
        (got[0].square().sum() + got[5].sum() + got[6].sum() + (got[3] * got[0]).sum()).backward()
        (want[0].square().sum() + want[5].sum() + want[6].sum() + (want[3] * want[0]).sum()).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) <= 1e-12
            p.grad = q.grad = None


class _TwoDropouts(nn.Module):
    """Two branches with dropout, the one computed second read first by the join (``h + d``)."""

    def __init__(self, join):
        super().__init__()
        self.join = join
        self.a, self.b, self.o = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.d1, self.d2 = nn.Dropout(0.5), nn.Dropout(0.3)

    def forward(self, x):
        d = self.d1(self.a(x))
        h = self.d2(torch.tanh(self.b(x)))
        return self.o(h + d if self.join == "add" else torch.cat([h, d], 1)[:, :8])


@pytest.mark.parametrize("join", ["add", "cat"])
def test_parallel_branches_draw_their_masks_in_the_models_order(join):
    """The block ran its branches in the join's order, so the dropout of the branch computed second drew first:
    another mask than the model's from the same seed (output off by 0.3). Branches run in the forward's order."""
    torch.manual_seed(0)
    model = _TwoDropouts(join).double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, torch.randn(4, 8, dtype=torch.float64), backward="scan")
    for b in (4, 2):
        x = torch.randn(b, 8, dtype=torch.float64)
        torch.manual_seed(b)
        y = w(x)
        torch.manual_seed(b)
        y_ref = ref(x)
        assert _rel(y, y_ref) <= 1e-12
        y.square().sum().backward()
        y_ref.square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) <= 1e-10
            p.grad = q.grad = None
