"""Gradient stops as people write them give autograd's gradients through the scan (float64): ``.detach()``,
a value computed inside the forward's own ``with torch.no_grad():`` (fx records those calls as any others;
the tracer marks them and their readers read them through a gradient stop), comparisons feeding
``torch.where``; an in-place update under ``torch.no_grad()`` of a tensor that has gradients (a
straight-through estimator) is refused under a forced scan and runs autograd's own step under ``auto``; and
planning leaves the model's buffers as they were (a functional train-mode ``batch_norm`` on them)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spscan
from spscan.errors import NotPlannable


def _steps(model: nn.Module, x: torch.Tensor, backward: str = "scan", batches=(4, 3, 4)) -> nn.Module:
    """Wrap ``model`` and compare output, input and parameter gradients and buffers with autograd on a copy,
    float64, over steps of several batch sizes; the wrapper."""
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a forced scan names the nodes it runs as their own backward
        w = spscan.wrap(model, x, backward=backward)
        for step, b in enumerate(batches):
            # planning left the buffers as they were; every step updates them alike
            for a, b_ in zip(model.buffers(), ref.buffers()):
                assert torch.equal(a, b_), f"step {step}: a buffer differs before the step"
            xs = torch.randn((b,) + tuple(x.shape[1:]), dtype=x.dtype, generator=torch.Generator().manual_seed(step))
            xa, xb = xs.clone().requires_grad_(), xs.clone().requires_grad_()
            for p in (*model.parameters(), *ref.parameters()):
                p.grad = None
            ya, yb = w(xa), ref(xb)
            assert torch.allclose(ya, yb, rtol=1e-12, atol=1e-14), f"step {step}: forward"
            wt = torch.randn(yb.shape, dtype=yb.dtype, generator=torch.Generator().manual_seed(10 + step))
            (ya * wt).sum().backward()
            (yb * wt).sum().backward()
            pairs = [("input", xa.grad, xb.grad)] + [(n, p.grad, q.grad) for (n, p), q in
                                                     zip(model.named_parameters(), ref.parameters())]
            for name, a, b_ in pairs:
                # autograd leaves it None where no gradient reaches it (an optimizer then skips it): so does the scan
                assert (a is None) == (b_ is None), f"step {step}: {name}: None where the other has a gradient"
                if b_ is None:
                    continue
                err = float((a - b_).abs().max()) / max(float(b_.abs().max()), 1e-300)
                assert err <= 1e-11, f"step {step}: {name} differs by {err:.2e} (relative)"
        for a, b_ in zip(model.buffers(), ref.buffers()):
            assert torch.equal(a, b_), "a buffer differs after the last step"
    return w


class _Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x):
        s = (self.a(x).abs().mean(1, keepdim=True) + 1).detach()
        return self.o(self.a(x) / s)


class _NoGradNormalizer(nn.Module):
    """A normalizer computed without gradients, with a layer of its own read only there."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.side, self.o = nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            s = torch.sigmoid(self.side(h)).sum(1, keepdim=True) + 1
        return self.o(torch.tanh(h) * s)


class _NoGradMax(nn.Module):
    """``x.max(1)`` (values and indices) computed without gradients, its values read with them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            m = h.max(1, keepdim=True)
        return self.o(h - m.values)


class _NestedModes(nn.Module):
    """``torch.enable_grad()`` inside ``torch.no_grad()``: the inner region has gradients again."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.o = nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            s = torch.tanh(h)
            with torch.enable_grad():
                t = self.b(h)
        return self.o(h * s + t)


class _Where(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = self.a(x)
        return self.o(torch.where(h > 0, h, 0.1 * h))


class _Ema(nn.Module):
    """A running mean kept by hand: ``self.mean.mul_(m).add_(...)`` under ``torch.no_grad()``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(12))

    def forward(self, h):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * h.mean(0))
        return h - self.mean


class _WithEma(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.ema, self.o = nn.Linear(12, 12), _Ema(), nn.Linear(12, 3)

    def forward(self, x):
        return self.o(torch.relu(self.ema(self.a(x))))


class _FunctionalBatchNorm(nn.Module):
    """``F.batch_norm`` in train mode on the model's own buffers (its running statistics updated each step)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(12, 8)
        self.w, self.b = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.randn(8))
        self.register_buffer("rm", torch.zeros(8))
        self.register_buffer("rv", torch.ones(8))

    def forward(self, x):
        return F.batch_norm(self.a(x), self.rm, self.rv, self.w, self.b, training=self.training)


class _MaskOnly(nn.Module):
    """A layer read only through a comparison (a mask) and one through an ``argmax`` (an index): no gradient
    reaches either, and autograd leaves their parameters' gradients None."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.pick, self.b = nn.Linear(12, 12), nn.Linear(12, 5), nn.Linear(12, 12)
        self.emb, self.o = nn.Embedding(5, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = torch.where(self.gate(x) > 0, self.b(x), 0.1 * x)
        return self.o(h + self.emb(self.pick(x).argmax(1)))


class _ParamDetached(nn.Module):
    """Parameters read only through ``.detach()`` (a frozen scale, a weight used without its gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(12, 12), nn.Linear(12, 3)
        self.scale = nn.Parameter(torch.rand(12) + 0.5)

    def forward(self, x):
        h = torch.tanh(F.linear(x, self.a.weight.detach(), self.a.bias)) * self.scale.detach()
        return self.o(h)


MODELS = {"detach": _Detached, "param_detached": _ParamDetached, "no_grad_normalizer": _NoGradNormalizer, "no_grad_max": _NoGradMax,
          "nested_modes": _NestedModes, "where": _Where, "ema_buffer": _WithEma,
          "functional_batch_norm": _FunctionalBatchNorm, "mask_only": _MaskOnly}


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("name", list(MODELS))
def test_gradient_stops_give_autograds_gradients(name, backward):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    _steps(model, torch.randn(4, 12, dtype=torch.float64), backward)


def test_a_gradient_stop_says_so_in_explain():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(_NoGradNormalizer().double(), torch.randn(4, 12, dtype=torch.float64), backward="scan")
    assert "a gradient stop (.detach(), or a value the forward computes under torch.no_grad())" in w.explain()


class _StraightThrough(nn.Module):
    """Rounding with a straight-through gradient: autograd passes ``h``'s gradient through the no-grad update."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            h.copy_(h.round())
        return self.o(h)


def test_an_inplace_update_without_gradients_is_refused_and_auto_runs_autograd():
    torch.manual_seed(0)
    x = torch.randn(4, 12, dtype=torch.float64)
    with pytest.raises(NotPlannable, match=r"in place under torch.no_grad\(\).*h.copy_\(h.round\(\)\)"):
        spscan.wrap(_StraightThrough().double(), x, backward="scan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # auto says it runs autograd's own backward
        w = _steps(_StraightThrough().double(), x, "auto")
    assert "torch.no_grad()" in w.explain()


class _GradReverse(torch.autograd.Function):
    """A gradient reversal layer (domain-adversarial training): the identity forward, a negated backward."""

    @staticmethod
    def forward(ctx, x, alpha):
        ctx.alpha = alpha
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.alpha * g, None


class _Adversarial(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f, self.c, self.d = nn.Linear(12, 8), nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.f(x))
        return torch.cat([self.c(h), self.d(_GradReverse.apply(h, 0.5))], 1)


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_a_custom_autograd_function_is_its_own_call(backward):
    """fx would trace through the function's forward and lose its backward (the scan then differentiated the
    identity: the discriminator's gradient was not reversed); it is one node, its own call, whose gradient is
    its own backward's."""
    torch.manual_seed(0)
    w = _steps(_Adversarial().double(), torch.randn(4, 12, dtype=torch.float64), backward)
    if backward == "scan":
        assert "_GradReverse.apply" in w.explain()


class _Checkpointed(nn.Module):
    """torch's own reentrant checkpointing (an autograd.Function whose gradient is its forward's): planned."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.o = nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.b(torch.tanh(self.a(t)))), x,
                                              use_reentrant=True)
        return self.o(h)


def test_torchs_own_checkpoint_function_is_traced_through():
    torch.manual_seed(0)
    w = _steps(_Checkpointed().double(), torch.randn(4, 12, dtype=torch.float64), "scan")
    assert type(w).__name__ != "NativeModule"


class _SegNetPool(nn.Module):
    """SegNet's pooling: ``MaxPool2d(return_indices=True)``'s (values, indices) into ``MaxUnpool2d``."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.p, self.u = nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2, return_indices=True), nn.MaxUnpool2d(2)
        self.o = nn.Linear(256, 3)

    def forward(self, x):
        y, i = self.p(self.c(x))
        return self.o(self.u(torch.tanh(y), i).flatten(1))


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_a_module_returning_values_and_indices_runs_as_its_own_call(backward):
    """A module whose result is not one tensor runs as its own call (it made ``wrap`` fail with an
    AttributeError, under ``auto`` too); the indices it returns carry no gradient."""
    torch.manual_seed(0)
    _steps(_SegNetPool().double(), torch.randn(4, 3, 8, 8, dtype=torch.float64), backward)


def _drop_path(x, drop_prob: float, training: bool):
    """timm's ``drop_path``: a per-sample mask made from the input (``x.new_empty``) by ``bernoulli_``."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    mask.div_(keep)
    return x * mask


class DropPathBlock(nn.Module):
    """A residual block with stochastic depth, as timm's ViT and ConvNeXt blocks train."""

    def __init__(self, rate: float = 0.3) -> None:
        super().__init__()
        self.a, self.b, self.rate = nn.Linear(8, 8), nn.Linear(8, 3), rate

    def forward(self, x):
        return self.b(x + _drop_path(torch.relu(self.a(x)), self.rate, self.training))


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_a_random_mask_made_from_the_input_is_a_constant(backward):
    """``x.new_empty(shape).bernoulli_(p)`` reads a graph tensor but records no gradient in the model; the scan
    asked autograd for one through ``bernoulli`` ("derivative for aten::bernoulli is not implemented", in
    ``loss.backward()``). Such a tensor is a constant of the step: the nodes reading it get it without a
    gradient, as the model's do. Same masks (same seed), autograd's gradients, over steps and batch sizes."""
    torch.manual_seed(0)
    model = DropPathBlock().double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, torch.randn(4, 8, dtype=torch.float64), backward=backward)
    for step, b in enumerate((4, 3, 1)):
        x = torch.randn(b, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        torch.manual_seed(step)
        ya = w(xa)
        torch.manual_seed(step)
        yb = ref(xb)
        assert torch.equal(ya, yb), f"step {step}: forward"
        wt = torch.randn(yb.shape, dtype=yb.dtype, generator=torch.Generator().manual_seed(10 + step))
        (ya * wt).sum().backward()
        (yb * wt).sum().backward()
        assert torch.allclose(xa.grad, xb.grad, rtol=1e-12, atol=1e-14), f"step {step}: input gradient"
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14), f"step {step}: {n}"


class _StoppedBranches(nn.Module):
    """The input and a layer reach the result only through ``.detach()``; a returned tensor detached."""

    def __init__(self) -> None:
        super().__init__()
        self.t, self.d, self.e = nn.Linear(5, 5), nn.Linear(5, 3), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.t(x)).detach()
        return self.d(h), self.e(h).detach()


def test_what_only_gradient_stops_lead_from_keeps_no_gradient():
    """Autograd leaves ``.grad`` None for the input and the parameters every path of whose to the loss passes
    through ``.detach()`` (an optimizer with weight decay skips them); the scan gave zeros. It hands them to
    the scan detached; a returned ``.detach()``-ed tensor does not require a gradient, as autograd's."""
    torch.manual_seed(0)
    model = _StoppedBranches().double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, torch.randn(3, 5, dtype=torch.float64), backward="scan")
    for b in (3, 1):
        x = torch.randn(b, 5, dtype=torch.float64)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ya, za), (yb, zb) = w(xa), ref(xb)
        assert za.requires_grad == zb.requires_grad and torch.equal(za, zb)
        ya.square().sum().backward()
        yb.square().sum().backward()
        assert xa.grad is None and xb.grad is None
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), n
            assert p.grad is None or torch.allclose(p.grad, q.grad, rtol=1e-12, atol=1e-14), n
            p.grad = q.grad = None
