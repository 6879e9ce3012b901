"""Traced models with nodes that have no analytic unit: each runs as an opaque unit (its own call and its
own autograd backward, the scan at depth 0 around it), with gradients equal to autograd's."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spscan
from spscan.runtime.choices import NativeModule


def _check(model, xs, dtype=torch.float64, tol=1e-9, seed=0):
    """Wrap ``model`` on ``xs[0]``; for each input in ``xs`` (a training step each), outputs and gradients of the
    input and of every parameter equal those of a deep copy under plain autograd (same dropout masks)."""
    model = model.to(dtype)
    ref = copy.deepcopy(model)
    xs = [x.to(dtype) if x.is_floating_point() else x for x in xs]
    wrapped = spscan.wrap(model, xs[0])
    for step, x in enumerate(xs):
        for m in (model, ref):
            m.zero_grad()
        xa, xb = x.clone(), x.clone()
        if x.is_floating_point():
            xa.requires_grad_(True)
            xb.requires_grad_(True)
        torch.manual_seed(seed + step)
        ya = wrapped(xa)
        torch.manual_seed(seed + step)
        yb = ref(xb)
        w = torch.randn_like(yb)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        scale = max(1.0, yb.abs().max().item())
        assert (ya - yb).abs().max().item() <= tol * scale
        pairs = [(xa.grad, xb.grad)] if x.is_floating_point() else []
        pairs += [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
        for a, b in pairs:
            assert (a is None) == (b is None)
            if a is not None:
                assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())
    return wrapped


class _Wrap(nn.Module):
    def __init__(self, inner: nn.Module, c: int) -> None:
        super().__init__()
        self.inner, self.out = inner, nn.Linear(c, 3)

    def forward(self, x):
        return self.out(self.inner(x))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("train", [True, False])
def test_transformer_encoder_layer(norm_first, train):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True,
                                       norm_first=norm_first)
    model = _Wrap(layer, 16).train(train)
    w = _check(model, [torch.randn(3, 5, 16), torch.randn(3, 5, 16), torch.randn(1, 5, 16)])
    assert "opaque: self.inner (TransformerEncoderLayer)" in w.plan.summary()


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_an_opaque_node_recorded_in_a_cuda_graph_reads_its_parameters_through_aliases(monkeypatch, dropout):
    """Recorded in a CUDA graph (the capture branch forced here), an opaque node's call reads its parameters
    through new leaves on the same memory and its backward asks for their gradients: its autograd graph
    reaches none of the parameters' own leaf nodes, which a training step's graph made on the default
    stream (a capture handing them a gradient fails). The gradients are autograd's, dropout included."""
    from spscan.layers import opaque

    monkeypatch.setattr(opaque, "_capturing", lambda xs: True)
    reached = []
    real = opaque.OpaqueUnit.run_inputs

    def spy(self, xs, tensors):
        y, saved = real(self, xs, tensors)
        seen, stack = set(), [saved[1].grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            if hasattr(fn, "variable"):
                reached.append(fn.variable)
            stack.extend(f for f, _ in fn.next_functions)
        return y, saved

    monkeypatch.setattr(opaque.OpaqueUnit, "run_inputs", spy)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True, dropout=dropout)
    model = _Wrap(layer, 16)
    _check(model, [torch.randn(3, 5, 16), torch.randn(3, 5, 16)])
    params = {id(p) for p in layer.parameters()}
    assert reached and not any(id(v) in params for v in reached)
    assert sum(v.shape == layer.linear1.weight.shape for v in reached) >= 1  # its aliases, as leaves


def test_a_torch_layer_fx_cannot_trace_as_the_whole_model():
    """nn.TransformerEncoderLayer as the model itself (fx cannot trace its forward) is one opaque node, as it is
    inside a model: backward="scan" runs, and "auto" chooses between the two without a fallback warning."""
    torch.manual_seed(23)
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    w = _check(layer, [torch.randn(3, 4, 8), torch.randn(1, 4, 8)])
    assert "opaque: self.layer (TransformerEncoderLayer)" in w.plan.summary()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net = spscan.wrap(copy.deepcopy(layer), torch.randn(2, 4, 8, dtype=torch.float64), backward="auto")
    assert "scan" in net.explain() and "not available" not in net.explain()


class Mixer(nn.Module):
    def __init__(self, s: int = 5, c: int = 6) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.tok = nn.Sequential(nn.Linear(s, 7), nn.GELU(), nn.Linear(7, s))
        self.ch = nn.Sequential(nn.Linear(c, 9), nn.GELU(), nn.Linear(9, c))

    def forward(self, x):
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.n2(x))


def test_mixer_block():
    torch.manual_seed(1)
    _check(Mixer(), [torch.randn(3, 5, 6), torch.randn(1, 5, 6), torch.randn(4, 5, 6)])


class ViT(nn.Module):
    def __init__(self, c: int = 8, patch: int = 2, heads: int = 2, tokens: int = 4) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, c, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, c))
        self.pos = nn.Parameter(torch.randn(1, tokens + 1, c))
        self.n1, self.n2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
        self.head = nn.Linear(c, 3)
        self.heads = heads

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        b, n, c = x.shape
        x = torch.cat([self.cls.expand(b, -1, -1), x], 1) + self.pos
        qkv = self.qkv(self.n1(x)).reshape(b, n + 1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        a = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        o = (a.softmax(-1) @ v).transpose(1, 2).reshape(b, n + 1, c)
        x = x + self.proj(o)
        x = x + self.mlp(self.n2(x))
        return self.head(x[:, 0])


def test_small_vit():
    torch.manual_seed(2)
    w = _check(ViT(), [torch.randn(3, 3, 4, 4), torch.randn(1, 3, 4, 4), torch.randn(2, 3, 4, 4)])
    text = w.plan.summary()
    assert "cat cls" in text and "mul 0.5" in text and "opaque" not in text


def test_numbers_from_sizes():
    """A factor computed from per-sample sizes (``x.shape[-1] ** -0.5``, ``x.size(1)``) is a ScaleUnit; one that
    reads the batch size (``x.shape[0]``, ``x.size(0)``, ``len(x)`` via ``size()``) changes with the batch and stays
    an opaque node: gradients are autograd's for every batch size either way."""
    class Sizes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Linear(6, 6)

        def forward(self, x):  # (B, 4, 6)
            b, n, c = x.shape
            h = self.f(x) * (c // 2) ** -0.5 + x.size(1)
            h = h / x.size(-1) - (n + 1) + h / math.sqrt(c)
            return (h / b + h * x.size(0)).flatten(1)

    torch.manual_seed(21)
    w = _check(Sizes(), [torch.randn(3, 4, 6), torch.randn(1, 4, 6), torch.randn(5, 4, 6)])
    text = w.plan.summary()
    assert "mul 0.57735" in text and "add 4" in text and "div 6" in text and "add -5" in text  # x - 5 as x + (-5)
    assert text.count("opaque") == 2 and "div 2.44949" in text  # h / math.sqrt(c) too


class Tokens(nn.Module):
    """Class and distillation tokens (DeiT) on either side of the patches, a difference of two branches, and
    the subtraction spelled three ways."""

    def __init__(self) -> None:
        super().__init__()
        self.cls, self.dist = nn.Parameter(torch.randn(1, 1, 6)), nn.Parameter(torch.randn(1, 1, 6))
        self.f, self.g, self.h = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):  # (B, 4, 6)
        b = x.shape[0]
        x = torch.cat((self.cls.expand(b, -1, -1), x, self.dist.expand(b, 1, 6)), dim=1)
        d = self.f(x) - torch.tanh(self.g(x))
        d = torch.sub(d, x).sub(self.f(d))
        return self.h(d - d).flatten(1) + self.h(d).flatten(1)


@pytest.mark.parametrize("plan_kw", [{}, {"levels": "full", "operators": False}])
def test_parameter_tokens_and_differences_are_analytic(plan_kw):
    """``cat([p.expand(B, ...), x])`` is a selection with the parameter's gradient summed over the batch, and
    ``a - b`` of two graph tensors an add join with a negation on its second branch (bit for bit ``a - b``):
    no opaque node, at depth 0 and at full depth, with autograd's gradients as the batch size changes."""
    torch.manual_seed(19)
    model = Tokens().double()
    ref = copy.deepcopy(model)
    w = spscan.wrap(model, torch.randn(3, 4, 6, dtype=torch.float64), **plan_kw)
    text = w.plan.summary()
    assert "opaque" not in text and "cat cls, dist" in text and "neg" in text
    for b in (3, 1, 2):
        x = torch.randn(b, 4, 6, dtype=torch.float64, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        y, yr = w(x), ref(xr)
        assert torch.equal(y, yr)
        gy = torch.randn_like(yr)
        (y * gy).sum().backward()
        (yr * gy).sum().backward()
        assert torch.allclose(x.grad, xr.grad, rtol=0, atol=1e-12)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12), n


def test_parameter_tokens_float32_and_forms_left_opaque():
    """float32 within 1e-5; a token that is not expanded over the batch (repeat, a buffer) stays opaque and
    still gets autograd's gradients."""
    torch.manual_seed(20)
    _check(Tokens(), [torch.randn(3, 4, 6), torch.randn(2, 4, 6)], dtype=torch.float32, tol=1e-5)

    class Repeated(Tokens):
        def forward(self, x):
            return self.h(torch.cat([self.cls.repeat(x.shape[0], 1, 1), x], 1)).flatten(1)

    w = _check(Repeated(), [torch.randn(3, 4, 6), torch.randn(1, 4, 6)])
    assert "opaque: torch.cat" in w.plan.summary()


def test_small_vit_float32():
    torch.manual_seed(3)
    _check(ViT(), [torch.randn(3, 3, 4, 4), torch.randn(2, 3, 4, 4)], dtype=torch.float32, tol=1e-5)


class TextClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(11, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc(self.emb(x).mean(1))


def test_embedding_classifier_with_token_input():
    torch.manual_seed(4)
    w = _check(TextClassifier(), [torch.randint(0, 11, (4, 7)), torch.randint(0, 11, (1, 7)),
                                  torch.randint(0, 11, (3, 7))])
    text = w.plan.summary()
    assert "Embedding" in text and "mean" in text and "opaque" not in text


@pytest.mark.parametrize("kw", [{}, {"padding_idx": 2}, {"scale_grad_by_freq": True}, {"max_norm": 1.0}])
@pytest.mark.parametrize("plan_kw", [{}, {"levels": "full", "operators": False}])
def test_embedding_unit(kw, plan_kw):
    """nn.Embedding is an analytic unit (no input gradient; ATen's weight gradient), in a chain and at any depth,
    with the module's options; the token ids' batch changes between steps."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Embedding(11, 4, **kw), nn.Flatten(), nn.Linear(20, 3), nn.Tanh()).double()
    ref = copy.deepcopy(model)
    xs = [torch.randint(0, 11, (6, 5)), torch.randint(0, 11, (1, 5)), torch.tensor([[2, 2, 2, 3, 2]] * 2)]
    wrapped = spscan.wrap(model, xs[0], **plan_kw)
    assert "Embedding" in wrapped.plan.summary() and "opaque" not in wrapped.plan.summary()
    for x in xs:
        model.zero_grad()
        ref.zero_grad()
        ya, yb = wrapped(x), ref(x)
        w = torch.randn_like(yb)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        assert torch.allclose(ya, yb, rtol=0, atol=1e-12)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12)
        assert torch.equal(model[0].weight, ref[0].weight)  # max_norm renormalized the same rows in place


@pytest.mark.parametrize("make, x", [
    (lambda: nn.Sequential(nn.Embedding(5, 2, sparse=True), nn.Flatten(), nn.Linear(6, 2)),
     lambda: torch.randint(0, 5, (4, 3))),
    (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"), nn.ReLU(), nn.Flatten(),
                           nn.Linear(3 * 5 * 5, 2)).double(), lambda: torch.randn(4, 2, 5, 5, dtype=torch.float64)),
], ids=["sparse_embedding", "circular_padding"])
def test_a_layer_its_unit_does_not_cover_runs_as_its_own_call(make, x):
    """A layer of a supported type in a configuration its analytic unit does not cover (a sparse embedding
    gradient, circular padding) no longer refuses the chain: the chain is traced, that layer an opaque node,
    and the gradients are autograd's (the embedding's stays sparse)."""
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    wrapped = spscan.wrap(model, x(), backward="scan")
    assert "opaque" in wrapped.plan.summary()
    for _ in range(2):
        xs = x()
        wrapped(xs).square().sum().backward()
        ref(xs).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.layout == q.grad.layout
        assert torch.allclose(p.grad.to_dense(), q.grad.to_dense(), rtol=1e-6, atol=1e-7)


def test_embedding_refusals():
    wrapped = spscan.wrap(nn.Sequential(nn.Embedding(5, 2), nn.Flatten()), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids"):
        wrapped(torch.zeros(2, 3))


class _Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        y = self.f(x)
        z = torch.special.erf(y) + x
        return self.g(_Cube.apply(z * y))  # a product of two graph tensors and a custom function


def test_unknown_functions_and_two_tensor_products():
    torch.manual_seed(5)
    w = _check(Custom(), [torch.randn(1, 5), torch.randn(3, 5), torch.randn(3, 5)])
    text = w.plan.summary()
    assert "mul (product) over live [f, add]" in text and "opaque: torch._C._special.special_erf" in text


def test_data_dependent_control_flow_still_refused():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Linear(3, 3)

        def forward(self, x):
            if x.sum() > 0:
                return self.f(x)
            return x

    with pytest.raises(TypeError, match="Branchy.*fx"):
        spscan.wrap(Branchy(), torch.zeros(2, 3))


class Odd(nn.Module):
    """Joins the join units do not cover: a scalar add, a broadcast add, a square and a concatenation along
    the last dim, each its own backward."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(3, 4)

    def forward(self, x):
        y = self.f(x) + 1.0
        z = y + y.mean(-1, keepdim=True)
        return torch.cat([z * z, y], -1)


def test_joins_outside_the_join_units():
    torch.manual_seed(6)
    _check(Odd(), [torch.randn(2, 5, 3), torch.randn(1, 5, 3), torch.randn(3, 5, 3)])


class Attention(nn.Module):
    """``nn.MultiheadAttention`` as a leaf submodule: three graph arguments and a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn, self.out = nn.LayerNorm(8), nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        h = self.norm(x)
        return self.out(x + self.attn(h, h, h)[0])


def test_multihead_attention_submodule():
    torch.manual_seed(7)
    w = _check(Attention(), [torch.randn(2, 3, 8), torch.randn(1, 3, 8)])
    assert "of self.attn (MultiheadAttention)" in w.plan.summary()


class GatedAttention(nn.Module):
    """Single-head softmax attention written with ``@`` and a gated MLP (SwiGLU-like): products of two graph
    tensors, planned as analytic product units."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(c, c), nn.Linear(c, c), nn.Linear(c, c)
        self.up, self.gate, self.down = nn.Linear(c, 8), nn.Linear(c, 8), nn.Linear(8, c)
        self.head = nn.Linear(c, 2)

    def forward(self, x):  # (B, T, c)
        a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), dim=-1)
        x = x + torch.bmm(a, self.v(x))
        x = x + self.down(self.up(x) * torch.sigmoid(self.gate(x)))
        return self.head(x).flatten(1)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
def test_attention_and_gates_are_analytic_products(dtype, tol):
    torch.manual_seed(7)
    w = _check(GatedAttention(), [torch.randn(3, 4, 6), torch.randn(1, 4, 6), torch.randn(2, 4, 6)], dtype=dtype, tol=tol)
    text = w.plan.summary()
    assert "opaque" not in text
    assert text.count("(matmul)") == 2 and "(product)" in text


@pytest.mark.parametrize("kind, shapes", [("matmul", [(3, 4), (4, 2)]), ("matmul", [(2, 3, 4), (2, 4, 5)]),
                                          ("mul", [(3, 2), (3, 2)]), ("matmul", [(1, 1), (1, 1)])])
def test_product_unit_is_the_jacobian(kind, shapes):
    """Each input's J^T g is autograd's vector-Jacobian product, per sample."""
    from spscan.layers.products import ProductUnit

    a, b = (torch.randn((3,) + s, dtype=torch.float64, requires_grad=True) for s in shapes)
    y = a @ b if kind == "matmul" else a * b
    unit = ProductUnit(0, kind, shapes, tuple(y.shape[1:]))
    out, saved = unit.run_inputs([a.detach().reshape(3, -1), b.detach().reshape(3, -1)], [])
    assert torch.equal(out, y.detach())
    g = torch.randn_like(y)
    ga, gb = torch.autograd.grad(y, [a, b], g)
    (ja, jb), pg = unit.vjp(saved, g.reshape(3, -1), [True, True], [])
    assert pg == [] and torch.allclose(ja, ga.reshape(3, -1)) and torch.allclose(jb, gb.reshape(3, -1))
    assert unit.vjp(saved, g.reshape(3, -1), [False, True], [])[0][0] is None


def test_products_outside_the_unit_run_their_own_backward():
    """A broadcast, a square of one tensor and a scalar factor are opaque nodes, with autograd's gradients."""
    class Forms(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f, self.g = nn.Linear(4, 4), nn.Linear(4, 1)

        def forward(self, x):
            y = self.f(x)
            return (y * self.g(x)) + (y * y) * 0.5 + torch.mul(y, 2.0)

    from spscan.layers.products import ProductUnit

    torch.manual_seed(8)
    w = _check(Forms(), [torch.randn(3, 4), torch.randn(1, 4)])
    assert "opaque: operator.mul(f, g)" in w.plan.summary()
    with pytest.raises(ValueError, match="equal shapes"):
        ProductUnit(0, "mul", [(4,), (1,)], (4,))
    with pytest.raises(ValueError, match="equal leading dims"):
        ProductUnit(0, "matmul", [(2, 3, 4), (4, 5)], (2, 3, 5))


@pytest.mark.parametrize("kind, dims, keepdim, shape", [("mean", (1,), False, (4, 3)), ("sum", (2,), True, (4, 3)),
                                                        ("mean", (2, 3), False, (2, 3, 5)), ("sum", (1, 2), False, (1, 2)),
                                                        ("mean", (1,), True, (5,))])
def test_reduction_unit_is_the_jacobian(kind, dims, keepdim, shape):
    """A mean/sum over per-sample dims: its pattern and values are autograd's Jacobian, its operator the same
    product."""
    from spscan.layers.linear import ReductionUnit, _Reduction

    mod = _Reduction(kind, dims, keepdim)
    x = torch.randn((3,) + shape, dtype=torch.float64)
    y = mod(x)
    unit = ReductionUnit(0, mod, shape, tuple(y.shape[1:]))
    jac = torch.autograd.functional.jacobian(lambda v: mod(v.reshape((1,) + shape)).reshape(-1), x[0].reshape(-1))
    out, saved = unit.run(x, [])
    pat = unit.pattern.copy()
    pat.data = unit.fill(saved, []).numpy()
    dense = torch.from_numpy(pat.toarray())
    assert torch.equal(out, y) and torch.allclose(dense, jac.T, rtol=0, atol=1e-15)
    g = torch.randn(3, unit.d_out, dtype=torch.float64)
    assert torch.allclose(unit.apply_transposed(saved, [], g), g @ dense.T, rtol=0, atol=1e-14)


@pytest.mark.parametrize("plan_kw", [{}, {"levels": "full", "operators": False}])
def test_reductions_in_a_model(plan_kw):
    """A global average pool written as a mean and a keepdim sum plan as analytic units at any depth."""
    class Pooled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(3, 2)

        def forward(self, x):
            h = torch.tanh(self.conv(x))
            h = torch.mean(h.sum(-1, keepdim=True), dim=(2, 3), keepdim=True)
            return self.fc(h.mean((2, 3)))

    torch.manual_seed(10)
    model = Pooled().double()
    ref = copy.deepcopy(model)
    wrapped = spscan.wrap(model, torch.randn(3, 2, 4, 5, dtype=torch.float64), **plan_kw)
    assert "opaque" not in wrapped.plan.summary()
    for b in (3, 1):
        x = torch.randn(b, 2, 4, 5, dtype=torch.float64)
        (wrapped(x) ** 2).sum().backward()
        (ref(x) ** 2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12)


def test_sequential_with_a_layer_without_a_unit_is_traced():
    """A plain nn.Sequential holding a layer the library has no unit for (Softmin, Softmax2d) is the trivial traced
    graph with that layer as an opaque node, not a refused chain; the chain planner itself still names the layer."""
    from spscan.chain.planning import plan_model

    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(4, 6), nn.Softmin(dim=1), nn.Sequential(nn.Unflatten(1, (6, 1, 1)),
                                                                          nn.Softmax2d(), nn.Flatten()), nn.Linear(6, 2))
    w = _check(model, [torch.randn(3, 4), torch.randn(1, 4)])
    text = w.plan.summary()
    assert "opaque: self.1 (Softmin)" in text and "opaque: self.2.1 (Softmax2d)" in text
    with pytest.raises(TypeError, match=r"layer 1 \(1\): torch.nn.modules.activation.Softmin is an unsupported"):
        plan_model(model, torch.randn(3, 4))


class SdpaBlock(nn.Module):
    """A pre-norm transformer block with multi-head attention through F.scaled_dot_product_attention (q, k, v from
    one projection, heads split by reshape and permute), the way current models write it."""

    def __init__(self, c: int = 8, heads: int = 2, causal: bool = False, scale=None, self_only: bool = False) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.mlp = nn.Sequential(nn.Linear(c, 2 * c), nn.GELU(), nn.Linear(2 * c, c))
        self.heads, self.causal, self.scale, self.self_only = heads, causal, scale, self_only

    def forward(self, x):  # (B, T, c)
        b, t, c = x.shape
        h = self.n1(x)
        if self.self_only:  # one tensor as q, k and v
            h = h.reshape(b, t, self.heads, c // self.heads).transpose(1, 2)
            o = F.scaled_dot_product_attention(h, h, h, is_causal=self.causal, scale=self.scale)
        else:
            q, k, v = self.qkv(h).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale)
        x = x + self.proj(o.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.n2(x))


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"scale": 0.3}, {"self_only": True}, {"self_only": True,
                                                                                               "causal": True}])
def test_scaled_dot_product_attention_is_an_analytic_unit(kw):
    torch.manual_seed(12)
    w = _check(SdpaBlock(**kw), [torch.randn(3, 5, 8), torch.randn(1, 5, 8), torch.randn(2, 5, 8)])
    assert "(attention)" in w.plan.summary() or " attention " in w.plan.summary()


def test_scaled_dot_product_attention_float32():
    torch.manual_seed(13)
    _check(SdpaBlock(), [torch.randn(4, 6, 8), torch.randn(2, 6, 8)], dtype=torch.float32, tol=1e-5)


class MaskedAttention(nn.Module):
    """SDPA with an attention mask of each kind: a boolean buffer (one query row masked everywhere), a float mask
    computed from per-sample sizes, a learned bias (a parameter: its own gradient), a mask per batch entry."""

    def __init__(self, kind: str, c: int = 8, t: int = 5) -> None:
        super().__init__()
        self.kind, self.heads = kind, 2
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        keep = torch.rand(1, 2, t, t) > 0.4
        keep[..., 0] = True
        keep[0, 1, 2] = False  # a query that sees no key: zeros out, as torch's attention gives
        self.register_buffer("keep", keep)
        self.bias = nn.Parameter(torch.randn(2, t, t))

    def forward(self, x):  # (B, T, c)
        b, t, c = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        mask = {"buffer": lambda: self.keep,
                "sizes": lambda: torch.triu(torch.full((t, t), -1.5), 1) + torch.arange(t) / t,
                "learned": lambda: self.bias,
                "per_batch": lambda: torch.zeros((b, 1, t, t))}[self.kind]()
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.proj(o.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("kind", ["buffer", "sizes", "learned", "per_batch"])
def test_scaled_dot_product_attention_with_a_mask(kind):
    """A mask the batch does not change (a buffer, or computed from sizes) keeps the attention analytic; a learned
    bias and a mask with a batch dim make it an opaque node. Autograd's gradients either way."""
    torch.manual_seed(22)
    w = _check(MaskedAttention(kind), [torch.randn(3, 5, 8), torch.randn(1, 5, 8), torch.randn(2, 5, 8)])
    text = w.plan.summary()
    assert ("opaque" not in text and "attention" in text) == (kind in ("buffer", "sizes"))
    if kind == "buffer":
        _check(MaskedAttention(kind), [torch.randn(2, 5, 8)], dtype=torch.float32, tol=1e-5)


@pytest.mark.parametrize("slots", [(0, 1, 2), (0, 0, 1), (0, 0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_unit_is_the_jacobian(slots, causal):
    """Each graph input's J^T g is autograd's vector-Jacobian product of torch's attention (inputs read twice add)."""
    from spscan.layers.products import AttentionUnit, _Attention

    n = max(slots) + 1
    shapes = [(2, 4, 3), (2, 5, 3), (2, 5, 6)][:n] if slots == (0, 1, 2) else [(2, 4, 3)] * n
    xs = [torch.randn((3,) + s, dtype=torch.float64, requires_grad=True) for s in shapes]
    q, k, v = (xs[i] for i in slots)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    unit = AttentionUnit(0, _Attention(causal, None), shapes, slots, tuple(y.shape[1:]))
    out, saved = unit.run_inputs([x.detach().reshape(3, -1) for x in xs], [])
    assert torch.equal(out, y.detach())
    g = torch.randn_like(y)
    want = torch.autograd.grad(y, xs, g)
    got, pg = unit.vjp(saved, g.reshape(3, -1), [True] * n, [])
    assert pg == []
    for a, b in zip(got, want):
        assert torch.allclose(a, b.reshape(3, -1), rtol=1e-10, atol=1e-12)


class Scalars(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.f(x) * 0.125
        h = 2 * torch.tanh(h / 3.0) + 1
        h = 1 - (-h) - 2
        h = torch.neg(torch.mul(h, 3)).div(7.0) + x * -0.5
        return self.g(h)


@pytest.mark.parametrize("plan_kw", [{}, {"levels": "full", "operators": False}])
def test_scalar_arithmetic_is_an_analytic_unit(plan_kw):
    """x * c, c * x, x / c, -x, x + c, c - x, x - c (methods and functions too) with Python numbers: a shared c·I,
    applied as autograd applies it (g / c for a division), at any depth."""
    torch.manual_seed(15)
    model = Scalars().double()
    ref = copy.deepcopy(model)
    w = spscan.wrap(model, torch.randn(3, 4, dtype=torch.float64), **plan_kw)
    text = w.plan.summary()
    assert "opaque" not in text and "mul 0.125" in text and "div 3" in text and "rsub 1" in text and "neg" in text
    for b in (3, 1):
        x = torch.randn(b, 4, dtype=torch.float64)
        (w(x) ** 2).sum().backward()
        (ref(x) ** 2).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12)


def test_scalar_forms_outside_the_unit():
    """A division of a number by a tensor and an int tensor made float stay opaque, with autograd's gradients."""
    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Linear(3, 3)

        def forward(self, x):
            return 1.0 / (self.f(x) ** 2 + 1.0)

    torch.manual_seed(16)
    w = _check(Other(), [torch.randn(3, 3), torch.randn(1, 3)])
    assert "opaque: operator.truediv(1.0, add)" in w.plan.summary()


class LayerScaled(nn.Module):
    """A position embedding added and a LayerScale (x * gamma) on a residual branch: parameters read functionally."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 4, 6))
        self.bias = nn.Parameter(torch.randn(6))
        self.gamma = nn.Parameter(torch.randn(6))
        self.f = nn.Linear(6, 6)

    def forward(self, x):  # (B, 4, 6)
        x = self.pos + x
        x = x + self.gamma * torch.tanh(self.f(x))
        return (x + self.bias).flatten(1)


@pytest.mark.parametrize("plan_kw", [{}, {"levels": "full", "operators": False}])
def test_parameter_add_and_scale_are_analytic(plan_kw):
    torch.manual_seed(17)
    model = LayerScaled().double()
    ref = copy.deepcopy(model)
    w = spscan.wrap(model, torch.randn(3, 4, 6, dtype=torch.float64), **plan_kw)
    text = w.plan.summary()
    assert "opaque" not in text and "add pos" in text and "mul gamma" in text and "add bias" in text
    for b in (3, 1):
        x = torch.randn(b, 4, 6, dtype=torch.float64, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        gy = torch.randn(b, 24, dtype=torch.float64)
        (w(x) * gy).sum().backward()
        (ref(xr) * gy).sum().backward()
        assert torch.allclose(x.grad, xr.grad, rtol=0, atol=1e-12)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12), n


def test_parameter_affine_unit_float32():
    torch.manual_seed(18)
    _check(LayerScaled(), [torch.randn(3, 4, 6), torch.randn(2, 4, 6)], dtype=torch.float32, tol=1e-5)


def test_forced_depth_names_why_a_node_has_no_values():
    """A forced depth > 0 around a node without CSR values is refused with that node's reason, not BatchNorm's."""
    class Squared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Linear(3, 3)

        def forward(self, x):
            y = self.f(x)
            return y * y + x

    with pytest.raises(ValueError, match="opaque node, run as its own autograd backward") as e:
        spscan.wrap(Squared(), torch.randn(2, 3), levels=2)
    assert "train mode" not in str(e.value) and "model.eval()" not in str(e.value)
    with pytest.raises(ValueError, match="depends on the values of the tensors it multiplies"):
        spscan.wrap(GatedAttention(), torch.randn(2, 4, 6), levels=2)


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("make", [lambda: nn.LSTM(3, 4, proj_size=2), lambda: nn.LSTM(3, 4, num_layers=2, proj_size=2),
                                  lambda: nn.GRU(3, 4).bfloat16(), lambda: nn.RNN(3, 4, num_layers=2).half()],
                         ids=["lstm_proj", "stacked_lstm_proj", "gru_bf16", "stacked_rnn_f16"])
def test_recurrent_forms_the_scan_cannot_plan_run_natively(make):
    """A recurrent module the scan cannot plan (LSTM projections, half-precision parameters) is wrapped
    with ``backward="auto"`` as any unplannable model is: its own backward, with a warning saying why
    (it used to raise ``ValueError`` / ``TypeError``)."""
    model = make()
    dtype = model.weight_hh_l0.dtype
    x = torch.randn(5, 2, 3, dtype=dtype)
    with pytest.warns(UserWarning, match="autograd's own backward"):
        wrapped = spscan.wrap(model, x, backward="auto")
    assert isinstance(wrapped, NativeModule) and wrapped.decision.chosen.name == "native"
    ref = copy.deepcopy(model)
    out, ref_out = wrapped(x)[0], ref(x)[0]
    assert torch.equal(out, ref_out)
    out.float().sum().backward()
    ref_out.float().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def _hooked_net():
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 2))


#: hook kind -> (registers it on a fresh net, appending to a log)
HOOKS = {
    "forward": lambda net, log: net[1].register_forward_hook(lambda m, i, o: (log.append("f"), o * 2)[1]),
    "forward_pre": lambda net, log: net[0].register_forward_pre_hook(lambda m, i: (log.append("p"), (i[0] + 1,))[1]),
    "full_backward": lambda net, log: net[0].register_full_backward_hook(lambda m, gi, go: (log.append("b"), None)[1]),
    "full_backward_changes_grad": lambda net, log: net[3].register_full_backward_hook(
        lambda m, gi, go: (log.append("b"), (gi[0] * 3,))[1]),
    "on_a_container": lambda net, log: net[2].register_forward_hook(lambda m, i, o: (log.append("n"), o + 1)[1]),
}


@pytest.mark.parametrize("kind", list(HOOKS))
@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_modules_with_hooks_run_their_own_call(kind, backward):
    """A module with forward or backward hooks (logging, feature extraction, gradient surgery) runs as an opaque
    node: its own call, hooks included, and its own autograd backward, the scan around it. Gradients equal
    autograd's and every hook runs once per step (planning calls a forward hook on its example). A hook on the
    model itself (which its traced graph would not run) makes it unplannable: ``auto`` runs it natively."""
    torch.manual_seed(0)
    model = _hooked_net().double()
    ref = copy.deepcopy(model)
    log, ref_log = [], []
    HOOKS[kind](model, log)
    HOOKS[kind](ref, ref_log)
    wrapped = spscan.wrap(model, torch.randn(4, 3, dtype=torch.float64), backward=backward)
    assert isinstance(wrapped, spscan.SpscanModule)
    log.clear()
    for batch in (4, 2):
        x = torch.randn(batch, 3, dtype=torch.float64)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        wrapped(xa).square().sum().backward()
        ref(xb).square().sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert log == ref_log


def test_hooks_on_the_model_itself_or_added_after_planning():
    model = _hooked_net()
    model.register_forward_hook(lambda m, i, o: o)
    with pytest.raises(spscan.NotPlannable, match="hooks of its own"):
        spscan.wrap(model, torch.randn(2, 3), backward="scan")
    with pytest.warns(UserWarning, match="hooks of its own"):
        assert isinstance(spscan.wrap(model, torch.randn(2, 3), backward="auto"), NativeModule)
    model = _hooked_net()
    ref = _hooked_net()
    ref.load_state_dict(model.state_dict())
    wrapped = spscan.wrap(model, torch.randn(2, 3), backward="scan")
    for m in (model, ref):  # its unit would not run it: planned again, that module its own call
        m[2][1].register_forward_hook(lambda m, i, o: o * 2)
    x = torch.randn(2, 3)
    with pytest.warns(UserWarning, match=r"2\.1: hooks were registered on it after planning"):
        y = wrapped(x)
    torch.testing.assert_close(y, ref(x))
    model.register_forward_hook(lambda m, i, o: o * 3)  # on the model itself: refused under a forced scan
    with pytest.raises(ValueError, match="hooks on Sequential itself, registered after planning"):
        wrapped(x)


def test_a_model_whose_shapes_depend_on_the_batch_size():
    """A forward whose per-sample shapes depend on the batch size (here a product over the batch) runs on the
    user's example but not on the planner's batch of 2: a form the scan cannot plan (``auto`` runs it natively),
    where a wrong example input is the user's error, as the model's own forward says."""

    class BatchMixing(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):
            y = self.a(x)
            return self.b(torch.einsum("bi,ci->bc", y, y)[:, :4])

    x = torch.randn(5, 4)
    with pytest.raises(spscan.NotPlannable, match="per-sample shapes depend on the batch size"):
        spscan.wrap(BatchMixing(), x, backward="scan")
    with pytest.warns(UserWarning, match="batch size"):
        assert isinstance(spscan.wrap(BatchMixing(), x, backward="auto"), NativeModule)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # the model's own error on a wrong example
        spscan.wrap(BatchMixing(), torch.randn(5, 7), backward="auto")


class _TensorHook(nn.Module):
    """A gradient hook registered on a tensor inside the forward (gradient scaling, logging)."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.o = nn.Linear(12, 8), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.tanh(self.f(x))
        h.register_hook(lambda g: g * 0.1)
        return self.o(h)


def test_a_tensor_hook_in_the_forward_runs_autograds_step():
    """fx cannot trace ``register_hook``; the check that the model itself runs runs it as a training step does
    (gradients on: it raised "cannot register a hook on a tensor that doesn't require gradient" from ``wrap``,
    under ``auto`` too). ``auto`` runs autograd's own step, hook included; a forced scan refuses."""
    torch.manual_seed(0)
    model, x = _TensorHook().double(), torch.randn(4, 12, dtype=torch.float64)
    ref = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="cannot capture its forward"):
        w = spscan.wrap(model, x, backward="auto")
    assert isinstance(w, NativeModule)
    w(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    with pytest.raises(spscan.NotPlannable):
        spscan.wrap(_TensorHook(), x.float(), backward="scan")


class _LearnedState(nn.Module):
    """A learned initial state expanded to the batch (``h0.expand(B, -1)``) into a cell that runs as its own call."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.h0, self.o = nn.GRUCell(4, 8), nn.Parameter(torch.randn(1, 8)), nn.Linear(8, 3)

    def forward(self, x):
        return self.o(self.cell(x, self.h0.expand(x.size(0), -1)))


def test_a_learned_state_expanded_to_the_batch_into_an_opaque_module():
    """Counting the node's operations for the step profile made torch's counter fail on the expanded parameter
    (its module tracker asks a no-grad input for a gradient function); the scan refused the model with that
    internal error, and a misleading "per-sample shapes depend on the batch size". The node is now priced
    uncounted; its gradients are its own backward's."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="autograd's own backward inside the scan"):
        _check(_LearnedState(), [torch.randn(3, 4), torch.randn(1, 4), torch.randn(5, 4)])


class _ComplexRope(nn.Module):
    """LLaMA's reference rotary embedding: ``view_as_complex`` of the queries times ``freqs_cis`` (a plain complex
    attribute), ``view_as_real``, ``.type_as(x)``; then its softmax in float32, cast back."""

    def __init__(self, t: int = 6, d: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d, bias=False), nn.Linear(d, 3, bias=False)
        freqs = torch.outer(torch.arange(t).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
        self.freqs_cis = torch.polar(torch.ones_like(freqs), freqs)

    def forward(self, x):
        q = self.a(x)
        q_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))
        q = torch.view_as_real(q_ * self.freqs_cis).flatten(2).type_as(x)
        return self.b(F.softmax(q.float(), dim=-1).type_as(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_complex_and_other_dtype_islands_are_recomputed_by_the_node_that_leaves_them(dtype):
    """A complex tensor was a graph tensor, its real gradient handed to autograd for a complex output ("both
    grad_output and output are required to have the same dtype"); a float32 island in a float64 model
    (``F.softmax(s.float(), -1).type_as(x)``) ran analytic units in float32 on float64 gradients ("expected
    scalar type Double but found Float"). Both are recomputed inside the node that makes them real, or the
    model's dtype, again: autograd's own gradients, exactly."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="autograd's own backward inside the scan"):
        w = _check(_ComplexRope(), [torch.randn(3, 6, 8), torch.randn(1, 6, 8)], dtype=dtype,
                   tol=1e-12 if dtype == torch.float64 else 1e-6)
    assert not any("view_as_complex" == n for n in w.plan.layer_names)


class _ReadsItsTensors(nn.Module):
    """Python that reads its tensors as values, as posted language-model code does: ``x.ndim`` (llama2c's
    ``reshape_for_broadcast``), ``torch.finfo(h.dtype).min`` (HF GPT-2, BERT), ``if self.fc.weight.dtype in
    (...)`` (HF T5's layer norm), ``len(h)`` of a time-major tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(20, 6), nn.Linear(6, 20)
        self.register_buffer("cos", torch.randn(16, 6))

    def forward(self, ids):
        h = self.emb(ids)
        ndim = h.ndim
        shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(h.shape)]
        h = h * self.cos[: h.shape[1]].view(shape)
        h = torch.where((ids != 0)[:, :, None], h, torch.finfo(h.dtype).min / 1e300)
        if self.fc.weight.dtype in (torch.float16, torch.bfloat16):
            h = h.to(self.fc.weight.dtype)
        steps = len(h.transpose(0, 1))
        return self.fc(h) / steps


def test_python_reading_ndim_dtype_and_len_is_traced_with_their_values():
    """fx cannot trace these (a proxy's ``ndim`` in a condition, ``torch.finfo`` of a proxy's dtype, ``len()``);
    the model was refused ("Proxy object cannot be iterated") and ``auto`` ran autograd. The retrace on
    example batches gives them the examples' values; a plan that read the dtype is planned again when the
    model's dtype changes (``finfo`` of the new one)."""
    torch.manual_seed(0)
    model = _ReadsItsTensors()
    ids = [torch.randint(0, 20, (3, 9)), torch.randint(0, 20, (1, 9)), torch.randint(0, 20, (4, 12))]
    w = _check(model, ids)
    assert w.plan.reads_dtype
    ref = copy.deepcopy(model).float()
    model.float()
    with pytest.warns(UserWarning, match="the parameters' dtype"):
        got = w(ids[0])
    assert w.plan.layer_names and torch.equal(got, ref(ids[0]))
