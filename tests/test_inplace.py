"""In-place forms as people write them (``inplace=True`` modules and functions, ``x.relu_()``, ``F.relu_(x)``,
``torch.tanh_(x)``, ``h += y``) give autograd's gradients through the scan (float64): the tracing rewrites
each out of place with the same numbers, no unit runs a module in place, and an in-place update that the
out-of-place graph could not reproduce (a view of another tensor read later, a name still referring to
the updated tensor) is refused, never planned with other numbers."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import spscan
from layer_checks import build_unit, check_values, seq
from spscan.layers import supported_layer_types

# every registered module type that can be made to write into its input
INPLACE_TYPES = [t for t in supported_layer_types() if "inplace" in inspect.signature(t.__init__).parameters]

# one factory per type: the module with the given inplace flag (arguments that make it non-trivial)
_ARGS = {nn.LeakyReLU: (0.1,), nn.ELU: (0.7,), nn.CELU: (0.7,), nn.Hardtanh: (-0.5, 0.8),
         nn.Dropout: (0.3,), nn.Dropout1d: (0.3,), nn.Dropout2d: (0.3,)}
_SHAPES = {nn.Dropout1d: (2, 5), nn.Dropout2d: (2, 3, 3)}


def _module(t: type, inplace: bool) -> nn.Module:
    m = t(*_ARGS.get(t, ()), inplace=inplace).double()
    return m.eval() if "Dropout" in t.__name__ else m


def test_the_inplace_types_are_the_activations_and_dropouts():
    names = {t.__name__ for t in INPLACE_TYPES}
    assert {"ReLU", "ReLU6", "LeakyReLU", "ELU", "CELU", "SELU", "SiLU", "Hardtanh", "Hardswish", "Hardsigmoid",
            "Mish", "Dropout"} <= names


@pytest.mark.parametrize("t", INPLACE_TYPES, ids=lambda t: t.__name__)
def test_a_unit_never_runs_its_module_in_place(t):
    """The unit of a module made with ``inplace=True`` leaves its input as it was and keeps the contract of the
    out-of-place module: the same output, values equal to jacrev's ``J^T`` at the input, the same ``J^T g``."""
    x = seq(3, *_SHAPES.get(t, (7,)), seed=2) * 4  # both sides of every kink
    inplace, plain = _module(t, True), _module(t, False)
    unit = build_unit(inplace, x.clone())
    before = x.clone()
    tensors = [v.detach() for v in unit.tensors()]
    with torch.no_grad():
        y, saved = unit.run(x, tensors)
        values = unit.fill(saved, tensors)
    assert torch.equal(x, before), "the unit wrote into its input"
    assert torch.equal(y, plain(x))
    # the in-place module's unit against the out-of-place module: autograd differentiates celu_ from its output,
    # celu from its input, each with alpha rounded to float32 once (relatively 1e-8 |x| apart for alpha = 0.7)
    celu = t is nn.CELU
    assert check_values(plain, x, unit=unit, tol=1e-6 if celu else 1e-12) is unit
    other = build_unit(plain, x)
    with torch.no_grad():
        y2, saved2 = other.run(x, tensors)
        if not celu:
            assert torch.equal(values, other.fill(saved2, tensors))
        if unit.has_operator:
            g = seq(3, unit.d_out, seed=5)
            a, b = unit.apply_transposed(saved, tensors, g), other.apply_transposed(saved2, tensors, g)
            assert torch.equal(a, b) or celu and torch.allclose(a, b, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------- whole models

def _check_grads(model: nn.Module, x: torch.Tensor, backward: str = "scan", batches=(4, 3)) -> nn.Module:
    """Wrap ``model`` and compare output, input and parameter gradients with autograd on a copy, float64, over
    two steps of other batch sizes; the wrapper."""
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a forced scan names the nodes it runs as their own backward
        w = spscan.wrap(model, x, backward=backward)
    for step, b in enumerate(batches):
        xs = torch.randn((b,) + tuple(x.shape[1:]), dtype=x.dtype, generator=torch.Generator().manual_seed(step))
        xa, xb = xs.clone().requires_grad_(), xs.clone().requires_grad_()
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        ya, yb = w(xa), ref(xb)
        assert torch.equal(ya, yb), f"step {step}: forward"
        wt = torch.randn(yb.shape, dtype=yb.dtype, generator=torch.Generator().manual_seed(10 + step))
        (ya * wt).sum().backward()
        (yb * wt).sum().backward()
        pairs = [("input", xa.grad, xb.grad)] + [(n, p.grad, q.grad) for (n, p), q in
                                                 zip(model.named_parameters(), ref.parameters())]
        for name, a, b_ in pairs:
            assert (a is None) == (b_ is None), f"step {step}: {name}"
            if b_ is not None:
                err = float((a - b_).abs().max()) / max(float(b_.abs().max()), 1e-300)
                assert err <= 1e-12, f"step {step}: {name} differs by {err:.2e} (relative)"
    return w


def _alias(h, skip_fn):
    skip = h
    h = skip_fn(h)
    return h, skip


# (name, what the model does to h): each in-place form people write
FORMS = {
    "module ReLU(inplace=True)": lambda m, h: m.relu(h),
    "module Threshold(inplace=True)": lambda m, h: m.threshold(h),
    "module Hardswish(inplace=True)": lambda m, h: m.hardswish(h),
    "module Hardsigmoid(inplace=True)": lambda m, h: m.hardsigmoid(h),
    "module SELU(inplace=True)": lambda m, h: m.selu(h),
    "module CELU(inplace=True)": lambda m, h: m.celu(h),
    "module Mish(inplace=True)": lambda m, h: m.mish(h),
    "module SiLU(inplace=True)": lambda m, h: m.silu(h),
    "module ELU(inplace=True)": lambda m, h: m.elu(h),
    "module LeakyReLU(inplace=True)": lambda m, h: m.leaky(h),
    "module ReLU6(inplace=True)": lambda m, h: m.relu6(h),
    "module Hardtanh(inplace=True)": lambda m, h: m.hardtanh(h),
    "module Dropout(inplace=True), eval": lambda m, h: m.dropout(h),
    "F.relu(h, inplace=True)": lambda m, h: F.relu(h, inplace=True),
    "F.relu(h, True)": lambda m, h: F.relu(h, True),
    "F.silu(h, inplace=True)": lambda m, h: F.silu(h, inplace=True),
    "F.hardswish(h, True)": lambda m, h: F.hardswish(h, True),
    "F.leaky_relu(h, 0.2, True)": lambda m, h: F.leaky_relu(h, 0.2, True),
    "F.dropout(h, 0.5, False, True)": lambda m, h: F.dropout(h, 0.5, False, True),
    "F.relu_(h)": lambda m, h: F.relu_(h),
    "torch.relu_(h)": lambda m, h: torch.relu_(h),
    "torch.tanh_(h)": lambda m, h: torch.tanh_(h),
    "torch.sigmoid_(h)": lambda m, h: torch.sigmoid_(h),
    "F.hardtanh_(h)": lambda m, h: F.hardtanh_(h),
    "F.leaky_relu_(h)": lambda m, h: F.leaky_relu_(h, 0.1),
    "F.elu_(h)": lambda m, h: F.elu_(h),
    "h.relu_()": lambda m, h: h.relu_(),
    "h.sigmoid_()": lambda m, h: h.sigmoid_(),
    "h.tanh_()": lambda m, h: h.tanh_(),
    "h.mul_(2.0)": lambda m, h: h.mul_(2.0),
    "h.add_(1.0)": lambda m, h: h.add_(1.0),
    "h.div_(3.0)": lambda m, h: h.div_(3.0),
    "h.clamp_(min=0)": lambda m, h: h.clamp_(min=0),
    "h.clamp_(-0.5, 0.5)": lambda m, h: h.clamp_(-0.5, 0.5),
    "h.exp_()": lambda m, h: h.exp_(),
    "h.abs_()": lambda m, h: h.abs_(),
    "h.neg_()": lambda m, h: h.neg_(),
    "h.square_()": lambda m, h: h.square_(),
    "h.fill_(2.0) on a copy": lambda m, h: h * 1.0 + h.clone().fill_(2.0),
}


class _Forms(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.relu, self.threshold = nn.ReLU(inplace=True), nn.Threshold(0.1, -1.0, inplace=True)
        self.hardswish, self.hardsigmoid = nn.Hardswish(inplace=True), nn.Hardsigmoid(inplace=True)
        self.selu, self.celu, self.mish = nn.SELU(inplace=True), nn.CELU(0.7, inplace=True), nn.Mish(inplace=True)
        self.silu, self.elu, self.leaky = nn.SiLU(inplace=True), nn.ELU(inplace=True), nn.LeakyReLU(0.1, inplace=True)
        self.relu6, self.hardtanh = nn.ReLU6(inplace=True), nn.Hardtanh(inplace=True)
        self.dropout = nn.Dropout(0.5, inplace=True)

    def forward(self, x):
        h = self.fc1(x) * 3.0
        return self.fc2(FORMS[self.form](self, h))


class _Reread(nn.Module):
    """The updated tensor read again under its old name afterwards, as a skip: ``skip = h; h.relu_(); h + skip``."""

    def __init__(self, form):
        super().__init__()
        self.inner = _Forms(form)

    def forward(self, x):
        h = self.inner.fc1(x) * 3.0
        skip = h
        FORMS[self.inner.form](self.inner, h)
        return self.inner.fc2(h + skip * 0.5)


@pytest.mark.parametrize("form", list(FORMS))
def test_every_inplace_form_gives_autograds_gradients(form):
    torch.manual_seed(0)
    _check_grads(_Forms(form).double().eval(), torch.randn(4, 6, dtype=torch.float64))


@pytest.mark.parametrize("form", [f for f in FORMS if not f.startswith(("F.", "torch.", "h.fill_"))
                                  or f.startswith(("F.relu_", "F.hardtanh_", "F.elu_", "F.leaky_relu_"))])
def test_a_tensor_updated_in_place_is_read_updated_under_its_old_name(form):
    """``skip = h; <update h in place>; h + skip``: both names read the updated tensor, in the model and in the
    plan (the in-place node's later readers read its output)."""
    torch.manual_seed(1)
    _check_grads(_Reread(form).double().eval(), torch.randn(4, 6, dtype=torch.float64))


def test_inplace_modules_in_a_chain():
    """An ``nn.Sequential`` of in-place activations is planned as a chain, each unit out of place."""
    torch.manual_seed(2)
    acts = [nn.Hardswish(inplace=True), nn.ReLU(inplace=True), nn.SELU(inplace=True), nn.Hardsigmoid(inplace=True),
            nn.Mish(inplace=True), nn.CELU(0.5, inplace=True), nn.ELU(inplace=True)]
    layers = []
    for a in acts:
        layers += [nn.Linear(5, 5), a]
    model = nn.Sequential(*layers, nn.Linear(5, 2)).double()
    w = _check_grads(model, torch.randn(4, 5, dtype=torch.float64) * 3)
    assert type(w.plan).__name__ == "ModelPlan"


class _SqueezeExcite(nn.Module):
    """MobileNetV3's block as torchvision writes it: in-place activations, and the block's input read twice."""

    def __init__(self, c):
        super().__init__()
        self.expand = nn.Conv2d(c, 2 * c, 1)
        self.act = nn.Hardswish(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1, self.fc2 = nn.Conv2d(2 * c, c, 1), nn.Conv2d(c, 2 * c, 1)
        self.relu, self.scale_act = nn.ReLU(inplace=True), nn.Hardsigmoid(inplace=True)
        self.project = nn.Conv2d(2 * c, c, 1)

    def forward(self, x):
        h = self.act(self.expand(x))
        s = self.scale_act(self.fc2(self.relu(self.fc1(self.pool(h)))))
        out = self.project(s * h)
        out += x
        return out


def test_a_squeeze_excite_block_with_inplace_activations():
    torch.manual_seed(3)
    _check_grads(nn.Sequential(_SqueezeExcite(3), _SqueezeExcite(3)).double(),
                 torch.randn(2, 3, 5, 5, dtype=torch.float64) * 3, batches=(2, 3))


# ------------------------------------------------------------------------------------------- refusals

class _Aliased(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)
        self.register_buffer("count", torch.zeros(8))

    def forward(self, x):
        h = self.fc1(x) * 2.0
        if self.how == "augmented assignment of a tensor another name refers to":
            skip = h
            h += 1.0  # torch.fx records h = h + 1: skip would not see the update
            h = h + skip
        elif self.how == "a view updated, its base read later":
            v = h[:, :3]
            v.relu_()
        elif self.how == "the base updated, a view read later":
            v = h.view(h.shape[0], 2, 4)
            h.mul_(2.0)
            h = v.flatten(1)
        elif self.how == "a buffer updated":
            h = h + self.count.add_(1.0)
        return self.fc2(h)


ALIASED = ["augmented assignment of a tensor another name refers to", "a view updated, its base read later",
           "the base updated, a view read later", "a buffer updated"]


@pytest.mark.parametrize("how", ALIASED)
def test_an_update_the_graph_cannot_reproduce_is_refused(how):
    """Refused by a forced scan (NotPlannable, naming the node or the forward) and run as the model's own
    step by ``auto``: never planned with other numbers."""
    torch.manual_seed(4)
    model = _Aliased(how).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.raises(spscan.NotPlannable, match="in-place|another output"):
        spscan.wrap(copy.deepcopy(model), x, backward="scan")
    with pytest.warns(UserWarning, match="autograd's own backward"):
        w = spscan.wrap(model, x, backward="auto")
    assert w.backward_mode == "native"


# ------------------------------------------------------------------------------------------- random stacks

_STACK_FORMS = ["module ReLU(inplace=True)", "module Hardswish(inplace=True)", "module SELU(inplace=True)",
                "module Mish(inplace=True)", "module LeakyReLU(inplace=True)", "module Hardsigmoid(inplace=True)",
                "F.relu(h, inplace=True)", "F.relu_(h)", "torch.tanh_(h)", "h.sigmoid_()", "h.mul_(2.0)",
                "h.add_(1.0)", "h.clamp_(min=0)", "F.elu_(h)"]
_OUT_OF_PLACE = {"relu": F.relu, "tanh": torch.tanh, "gelu": F.gelu, "hardswish": F.hardswish}


class _Stack(nn.Module):
    """Layers of ``Linear -> form`` where a form is an in-place one of :data:`FORMS`, an out-of-place activation,
    or a residual ``h += skip`` / ``h = h + skip``."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps
        self.lin = nn.ModuleList(nn.Linear(5, 5) for _ in steps)
        self.forms = _Forms("h.relu_()")

    def forward(self, x):
        h = x
        for lin, (kind, what) in zip(self.lin, self.steps):
            skip = h
            h = lin(h)
            if kind == "inplace":
                h = FORMS[what](self.forms, h)
            elif kind == "plain":
                h = _OUT_OF_PLACE[what](h)
            elif kind == "residual +=":
                h += skip
            else:
                h = h + skip
        return h


_step = st.one_of(st.tuples(st.just("inplace"), st.sampled_from(_STACK_FORMS)),
                  st.tuples(st.just("plain"), st.sampled_from(sorted(_OUT_OF_PLACE))),
                  st.tuples(st.sampled_from(["residual +=", "residual +"]), st.just("")))


@settings(max_examples=25)
@given(steps=st.lists(_step, min_size=1, max_size=6), seed=st.integers(0, 2 ** 16))
def test_random_stacks_of_inplace_and_out_of_place_forms(steps, seed):
    torch.manual_seed(seed)
    model = _Stack(steps).double().eval()
    _check_grads(model, torch.randn(3, 5, dtype=torch.float64), batches=(3, 2))


class _ItemAssignment(nn.Module):
    """Item assignment as people write it: fx's proxies have none, the tracer records it as ``operator.setitem``,
    and the rewrite runs it on a copy that every later reader (another name for the tensor too) reads."""

    def __init__(self, form: int) -> None:
        super().__init__()
        self.a, self.o, self.form = nn.Linear(12, 12), nn.Linear(12, 4), form

    def forward(self, x):
        y = self.a(x)
        z = y
        if self.form == 0:
            y[:, 0] = 0
        elif self.form == 1:
            y[:, :2] *= 2
        elif self.form == 2:
            y[:, 3:5] = torch.tanh(y[:, 5:7])
        else:
            y[:, 1] = 3.0
            return self.o(z) + y.sum(1, keepdim=True)
        return self.o(y)


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("form", range(4))
def test_item_assignment_gives_autograds_gradients(form, backward):
    torch.manual_seed(0)
    _check_grads(_ItemAssignment(form).double(), torch.randn(4, 12, dtype=torch.float64), backward)
