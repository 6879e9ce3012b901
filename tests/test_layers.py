"""Layer units vs torch.func.jacrev and autograd, in float64: pattern ⊇ jacrev support, values
equal J^T (≤ 1e-12), no guaranteed zero stored, parameter gradients equal autograd's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.prune as prune
from hypothesis import given, settings
from hypothesis import strategies as st

from layer_checks import (
    assert_no_guaranteed_zeros,
    build_unit,
    check_param_grads,
    check_values,
    jacobian_support,
    run_errors,
    seq,
)
from spscan.layers import make_unit

FAST = settings(max_examples=25)
# torch warns that even kernels with padding='same' copy the input; those cases are tested on purpose
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same'")


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    for p in module.parameters():
        with torch.no_grad():
            p.normal_()
    return module.double()


# ----------------------------------------------------------------------------- Linear


@FAST
@given(fi=st.integers(1, 6), fo=st.integers(1, 6), lead=st.sampled_from([(), (1,), (3,)]),
       bias=st.booleans(), batch=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_linear(fi, fo, lead, bias, batch, seed):
    m = _seeded(nn.Linear(fi, fo, bias=bias), seed)
    x = seq(batch, *lead, fi, seed=seed)
    u = check_values(m, x)
    assert u.shared
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))
    check_param_grads(m, u, x, seed)


@FAST
@given(fi=st.integers(1, 6), fo=st.integers(1, 6), amount=st.floats(0.0, 1.0), seed=st.integers(0, 2**16))
def test_linear_pruned(fi, fo, amount, seed):
    m = _seeded(nn.Linear(fi, fo), seed)
    torch.manual_seed(seed)
    prune.random_unstructured(m, "weight", amount=amount)
    x = seq(2, fi, seed=seed)
    u = check_values(m, x)
    assert u.nnz == int(m.weight_mask.sum())
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))
    check_param_grads(m, u, x, seed)


def test_linear_prune_zeros_and_stale_pruning():
    m = _seeded(nn.Linear(4, 3), 1)
    with torch.no_grad():
        m.weight[0, 1] = 0.0
        m.weight[2, 3] = 0.0
    x = seq(2, 4)
    assert build_unit(m, x).nnz == 12
    u = build_unit(m, x, prune_zeros=True)
    assert u.nnz == 10
    check_values(m, x, u)
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))
    with torch.no_grad():
        m.weight[2, 3] = 0.5  # a pruned weight that became non-zero must be reported, not dropped
    run_errors(lambda: u.run(x, u.tensors()), ValueError, "layer 0", "pruned", "re-plan")


# ----------------------------------------------------------------------------- Conv


@st.composite
def conv2d_cases(draw):
    groups = draw(st.integers(1, 3))
    cin = groups * draw(st.integers(1, 2))
    cout = groups * draw(st.integers(1, 2))
    k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    d = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    s = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    mode = draw(st.sampled_from(["int", "int", "tuple", "same", "valid"]))
    if mode == "same":
        s = (1, 1)
        pad = "same"
    elif mode == "valid":
        pad = "valid"
    elif mode == "int":
        pad = draw(st.integers(0, 2))
    else:
        pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    pp = (0, 0) if isinstance(pad, str) else (pad if isinstance(pad, tuple) else (pad, pad))
    h = draw(st.integers(max(1, d[0] * (k[0] - 1) + 1 - 2 * pp[0]), 7))
    w = draw(st.integers(max(1, d[1] * (k[1] - 1) + 1 - 2 * pp[1]), 7))
    bias = draw(st.booleans())
    return dict(cin=cin, cout=cout, k=k, s=s, pad=pad, d=d, groups=groups, h=h, w=w, bias=bias)


@FAST
@given(c=conv2d_cases(), seed=st.integers(0, 2**16))
def test_conv2d(c, seed):
    m = _seeded(nn.Conv2d(c["cin"], c["cout"], c["k"], stride=c["s"], padding=c["pad"], dilation=c["d"],
                          groups=c["groups"], bias=c["bias"]), seed)
    x = seq(2, c["cin"], c["h"], c["w"], seed=seed)
    u = check_values(m, x)
    assert u.shared
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))
    check_param_grads(m, u, x, seed)


@FAST
@given(groups=st.integers(1, 2), cg=st.integers(1, 2), k=st.integers(1, 4), s=st.integers(1, 3),
       pad=st.sampled_from([0, 1, 2, "same", "valid"]), d=st.integers(1, 3), extra=st.integers(0, 5),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_conv1d(groups, cg, k, s, pad, d, extra, bias, seed):
    if pad == "same":
        s = 1
    p = 0 if isinstance(pad, str) else pad
    length = max(1, d * (k - 1) + 1 - 2 * p) + extra
    m = _seeded(nn.Conv1d(groups * cg, groups * 2, k, stride=s, padding=pad, dilation=d, groups=groups,
                          bias=bias), seed)
    x = seq(2, groups * cg, length, seed=seed)
    u = check_values(m, x)
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))
    check_param_grads(m, u, x, seed)


@settings(max_examples=15)
@given(c=conv2d_cases(), amount=st.floats(0.1, 0.9), structured=st.booleans(), seed=st.integers(0, 2**16))
def test_conv2d_pruned(c, amount, structured, seed):
    m = _seeded(nn.Conv2d(c["cin"], c["cout"], c["k"], stride=c["s"], padding=c["pad"], dilation=c["d"],
                          groups=c["groups"], bias=c["bias"]), seed)
    torch.manual_seed(seed)
    if structured:
        prune.ln_structured(m, "weight", amount=amount, n=1, dim=0)
    else:
        prune.l1_unstructured(m, "weight", amount=amount)
    x = seq(2, c["cin"], c["h"], c["w"], seed=seed)
    u = check_values(m, x)
    full = build_unit(_seeded(nn.Conv2d(c["cin"], c["cout"], c["k"], stride=c["s"], padding=c["pad"],
                                        dilation=c["d"], groups=c["groups"]), seed), x)
    assert u.nnz <= full.nnz
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))
    check_param_grads(m, u, x, seed)


def test_conv_refuses_other_padding_modes():
    m = nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect").double()
    run_errors(lambda: build_unit(m, seq(1, 2, 5, 5)), ValueError, "layer 0", "Conv2d", "zeros", "reflect")


def test_conv_prune_zeros():
    m = _seeded(nn.Conv2d(2, 3, 3, padding=1), 3)
    with torch.no_grad():
        m.weight[1, 0] = 0.0  # one whole 3x3 tap set
    x = seq(2, 2, 4, 4)
    u = build_unit(m, x, prune_zeros=True)
    assert u.nnz == build_unit(m, x).nnz - 100  # a 3x3 tap set on a 4x4 image, pad 1: (4*3-2)**2 pairs
    check_values(m, x, u)
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))


# ----------------------------------------------------------------------------- elementwise


ACTIVATIONS = [nn.ReLU(), nn.LeakyReLU(0.07), nn.Tanh(), nn.Sigmoid(), nn.GELU(), nn.GELU(approximate="tanh"),
               nn.SiLU(), nn.ELU(0.7), nn.Softplus(beta=2.0, threshold=3.0), nn.Hardtanh(-0.5, 1.5), nn.ReLU6()]


@settings(max_examples=20)
@given(idx=st.integers(0, len(ACTIVATIONS) - 1), shape=st.sampled_from([(1,), (5,), (2, 3), (2, 2, 3)]),
       batch=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_activation(idx, shape, batch, seed):
    m = ACTIVATIONS[idx]
    x = 3 * seq(batch, *shape, seed=seed)
    u = check_values(m, x)
    assert not u.shared
    # ±x and ±x/100: every diagonal entry is non-zero for one of them (ReLU's positive side, Hardtanh's
    # linear range) — nothing stored is a guaranteed zero
    probes = torch.stack([x[0], -x[0], x[0] / 100, -x[0] / 100])
    assert_no_guaranteed_zeros(u, jacobian_support(m, probes))


@pytest.mark.parametrize("m", ACTIVATIONS, ids=lambda m: repr(m))
def test_activation_at_zero_and_extremes(m):
    x = torch.tensor([[0.0, -0.0, 1e-300, -1e-300, 40.0, -40.0, 0.5]], dtype=torch.float64)
    check_values(m, x)


# ----------------------------------------------------------------------------- pooling


@st.composite
def pool2d_cases(draw, dilation: bool = True):
    k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    s = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    p = (draw(st.integers(0, k[0] // 2)), draw(st.integers(0, k[1] // 2)))
    d = (draw(st.integers(1, 2)), draw(st.integers(1, 2))) if dilation else (1, 1)
    h = draw(st.integers(max(1, d[0] * (k[0] - 1) + 1 - 2 * p[0]), 7))
    w = draw(st.integers(max(1, d[1] * (k[1] - 1) + 1 - 2 * p[1]), 7))
    return dict(k=k, s=s, p=p, d=d, h=h, w=w, ceil=draw(st.booleans()), c=draw(st.integers(1, 2)))


def _maxpool_support(m: nn.MaxPool2d, c: int, h: int, w: int) -> np.ndarray:
    """Union of torch's argmax pairs over one-hot-peak inputs, one per input position."""
    d = c * h * w
    xs = -torch.ones(d, c, h, w, dtype=torch.float64)
    xs.view(d, -1)[torch.arange(d), torch.arange(d)] = 1.0
    y, idx = F.max_pool2d(xs, m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode,
                          return_indices=True)
    ho, wo = y.shape[2:]
    sup = np.zeros((d, c * ho * wo), dtype=bool)
    rows = (torch.arange(c).view(1, c, 1, 1) * h * w + idx).reshape(d, -1)
    sup[rows.numpy().reshape(-1), np.tile(np.arange(c * ho * wo), d)] = True
    return sup


def _windows_hit_input(out_len: int, in_len: int, k: int, s: int, p: int, d: int) -> bool:
    """Whether every window along one dimension holds at least one input element."""
    taps = (torch.arange(out_len) * s - p)[:, None] + d * torch.arange(k)[None, :]
    return bool(((taps >= 0) & (taps < in_len)).any(1).all())


@settings(max_examples=30)
@given(c=pool2d_cases(), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_maxpool2d(c, ties, seed):
    m = nn.MaxPool2d(c["k"], c["s"], c["p"], dilation=c["d"], ceil_mode=c["ceil"])
    x = seq(3, c["c"], c["h"], c["w"], seed=seed)
    if ties:
        x = torch.round(x)  # many equal values per window: the value must follow torch's argmax pick
    out = m(x).shape[2:]
    if not all(_windows_hit_input(out[t], x.shape[2 + t], c["k"][t], c["s"][t], c["p"][t], c["d"][t])
               for t in range(2)):
        # some window sees only padding: torch's argmax there is not an input index — refused
        run_errors(lambda: build_unit(m, x), ValueError, "layer 0", "padding")
        return
    u = check_values(m, x)
    assert not u.shared
    assert_no_guaranteed_zeros(u, _maxpool_support(m, c["c"], c["h"], c["w"]))


def test_maxpool2d_constant_input_ties():
    m = nn.MaxPool2d(3, stride=1, padding=1)
    x = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    check_values(m, x)


@FAST
@given(k=st.integers(1, 4), s=st.integers(1, 3), d=st.integers(1, 2), ceil=st.booleans(),
       extra=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_maxpool1d(k, s, d, ceil, extra, seed):
    p = k // 2
    m = nn.MaxPool1d(k, s, p, dilation=d, ceil_mode=ceil)
    x = seq(2, 2, max(1, d * (k - 1) + 1 - 2 * p) + extra, seed=seed)
    with torch.no_grad():
        out_len = F.max_pool1d(x, k, s, p, dilation=d, ceil_mode=ceil).shape[-1]
    if not _windows_hit_input(out_len, x.shape[-1], k, s, p, d):
        # some window sees only padding: torch's argmax there is not an input index — refused
        run_errors(lambda: build_unit(m, x), ValueError, "layer 0", "padding")
        return
    check_values(m, x)


@settings(max_examples=30)
@given(c=pool2d_cases(dilation=False), include=st.booleans(),
       divisor=st.sampled_from([None, None, 1, 3, 7]), seed=st.integers(0, 2**16))
def test_avgpool2d(c, include, divisor, seed):
    m = nn.AvgPool2d(c["k"], c["s"], c["p"], ceil_mode=c["ceil"], count_include_pad=include,
                     divisor_override=divisor)
    x = seq(2, c["c"], c["h"], c["w"], seed=seed)
    u = check_values(m, x)
    assert u.shared
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))


@FAST
@given(k=st.integers(1, 4), s=st.integers(1, 3), include=st.booleans(), ceil=st.booleans(),
       extra=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_avgpool1d(k, s, include, ceil, extra, seed):
    p = k // 2
    m = nn.AvgPool1d(k, s, p, ceil_mode=ceil, count_include_pad=include)
    x = seq(2, 2, max(1, k - 2 * p) + extra, seed=seed)
    u = check_values(m, x)
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))


# ----------------------------------------------------------------------------- BatchNorm, Dropout, reshapes


def _bn(cls, c: int, affine: bool, seed: int) -> nn.Module:
    m = cls(c, affine=affine).double()
    gen = torch.Generator().manual_seed(seed)
    m.running_mean.copy_(torch.randn(c, generator=gen, dtype=torch.float64))
    m.running_var.copy_(torch.rand(c, generator=gen, dtype=torch.float64) + 0.5)
    if affine:
        with torch.no_grad():
            m.weight.copy_(torch.randn(c, generator=gen, dtype=torch.float64))
            m.bias.copy_(torch.randn(c, generator=gen, dtype=torch.float64))
    return m.eval()


@FAST
@given(kind=st.sampled_from(["1d", "1d-seq", "2d"]), c=st.integers(1, 4), affine=st.booleans(),
       seed=st.integers(0, 2**16))
def test_batchnorm_eval(kind, c, affine, seed):
    m = _bn(nn.BatchNorm2d if kind == "2d" else nn.BatchNorm1d, c, affine, seed)
    shape = {"1d": (c,), "1d-seq": (c, 3), "2d": (c, 2, 3)}[kind]
    x = seq(3, *shape, seed=seed)
    u = check_values(m, x)
    assert u.shared
    assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))
    check_param_grads(m, u, x, seed)


def test_batchnorm_train_mode_has_no_csr_values():
    """Batch statistics couple the samples: the unit runs (as the module does) but has no per-sample values."""
    m = _bn(nn.BatchNorm2d, 2, True, 0).train()
    x = seq(2, 2, 3, 3)
    u = build_unit(m.eval(), x)
    m.train()
    y, saved = u.run(x, u.tensors())
    assert not u.has_csr_values and u.has_operator
    run_errors(lambda: u.fill(saved, u.tensors()), ValueError, "layer 0", "BatchNorm2d", "train mode")
    m2 = nn.BatchNorm1d(3, track_running_stats=False).double().eval()  # no running stats: batch statistics always
    u2 = make_unit(4, m2, (3,), (3,))
    assert not u2.has_csr_values


@pytest.mark.parametrize("m", [nn.Flatten(), nn.Identity(), nn.Dropout(0.4).eval(), nn.Flatten(2)],
                         ids=["flatten", "identity", "dropout-eval", "flatten2"])
def test_identity_like(m):
    x = seq(2, 2, 3, 2)
    u = check_values(m, x)
    assert u.shared
    assert u.nnz == u.d_in == u.d_out


def test_flatten_over_batch_is_refused():
    run_errors(lambda: make_unit(2, nn.Flatten(0), (3, 2), (12,)), ValueError, "layer 2", "start_dim")


@pytest.mark.parametrize("p", [0.0, 0.3, 0.75, 1.0])
@pytest.mark.parametrize("kind,shape", [(nn.Dropout, (2, 5)), (nn.Dropout1d, (3, 4)), (nn.Dropout2d, (4, 2, 3))],
                         ids=["dropout", "dropout1d", "dropout2d"])
def test_dropout_train_mask_is_the_value(kind, shape, p):
    m = kind(p).train()
    x = seq(3, *shape) + 5.0  # no zero inputs: a zero output then means a dropped element
    u = build_unit(m, x)
    torch.manual_seed(11)
    y, saved = u.run(x, [])
    v = u.fill(saved, [])
    d = x[0].numel()
    assert v.shape == (3, d) and not u.shared
    # the forward applied exactly the mask stored as J^T's diagonal ...
    torch.testing.assert_close(y.reshape(3, -1), x.reshape(3, -1) * v, rtol=0, atol=0)
    # ... and it is the mask torch's module draws from the same RNG state
    torch.manual_seed(11)
    assert torch.equal(y, m(x))
    if kind is not nn.Dropout and 0 < p < 1:  # one draw per channel
        per_channel = v.reshape(3, shape[0], -1)
        assert torch.equal(per_channel, per_channel[..., :1].expand_as(per_channel))


def test_unsupported_layer_type():
    run_errors(lambda: make_unit(3, nn.Softmin(dim=1), (4,), (4,)), TypeError, "layer 3", "Softmin", "supported")

    class MyReLU(nn.ReLU):
        def forward(self, x):
            return x.clamp(min=1.0)

    run_errors(lambda: make_unit(1, MyReLU(), (4,), (4,)), TypeError, "layer 1", "MyReLU")
