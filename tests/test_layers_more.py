"""The normalization, softmax, resampling, transposed-convolution and extra activation units vs
torch.func.jacrev and autograd in float64: pattern ⊇ jacrev support, values equal J^T (≤ 1e-12),
parameter gradients equal autograd's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import layer_checks
from layer_checks import (
    assert_no_guaranteed_zeros,
    build_unit,
    check_param_grads,
    check_values,
    jacobian_support,
    run_errors,
    seq,
)
from spscan.layers import make_unit, supported_layer_types

FAST = settings(max_examples=10, deadline=None)
# jacrev has no batching rule for nearest-exact upsampling's backward: slower, still exact
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")


def _seeded(module: nn.Module, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    for p in module.parameters():
        with torch.no_grad():
            p.normal_()
    return module.double()


# ----------------------------------------------------------------------------- normalization


@FAST
@given(lead=st.sampled_from([(), (2,), (2, 3)]), ns=st.sampled_from([(4,), (2, 3), (1,)]),
       affine=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_layernorm(lead, ns, affine, bias, seed):
    m = _seeded(nn.LayerNorm(list(ns), elementwise_affine=affine, bias=bias), seed)
    x = seq(2, *lead, *ns, seed=seed)
    u = check_values(m, x)
    assert not u.shared and u.nnz == u.d_in * int(np.prod(ns))
    check_param_grads(m, u, x, seed)


@FAST
@given(groups=st.integers(1, 3), cg=st.integers(1, 2), spatial=st.sampled_from([(), (3,), (2, 3)]),
       affine=st.booleans(), seed=st.integers(0, 2**16))
def test_groupnorm(groups, cg, spatial, affine, seed):
    if cg * int(np.prod(spatial)) == 1:
        cg = 2  # torch refuses a single value per group
    m = _seeded(nn.GroupNorm(groups, groups * cg, affine=affine), seed)
    x = seq(2, groups * cg, *spatial, seed=seed)
    u = check_values(m, x)
    assert u.nnz == groups * (u.d_in // groups) ** 2  # one dense block per group
    check_param_grads(m, u, x, seed)


@FAST
@given(shape=st.sampled_from([(5,), (3, 4), (2, 3, 2)]), log=st.booleans(), data=st.data(),
       seed=st.integers(0, 2**16))
def test_softmax(shape, log, data, seed):
    dim = data.draw(st.sampled_from([d for d in range(1, len(shape) + 1)] + [-1]))
    m = (nn.LogSoftmax if log else nn.Softmax)(dim=dim)
    x = seq(2, *shape, seed=seed)
    u = check_values(m, x)
    assert_no_guaranteed_zeros(u, jacobian_support(m, x))


def test_softmax_refusals():
    run_errors(lambda: build_unit(nn.Softmax(dim=0), seq(2, 3)), ValueError, "layer 0", "Softmax", "batch dim")
    run_errors(lambda: make_unit(0, nn.LogSoftmax(), (3,), (3,)), ValueError, "LogSoftmax", "dim=None")
    run_errors(lambda: make_unit(0, nn.LayerNorm(4), (3,), (3,)), ValueError, "LayerNorm", "(4,)", "(3,)")
    run_errors(lambda: make_unit(0, nn.Unflatten(0, (1, 2)), (2,), (2,)), ValueError, "Unflatten", "dim=0")


# ----------------------------------------------------------------------------- activations


@pytest.mark.parametrize("module", [nn.Hardswish(), nn.Hardsigmoid(), nn.Mish(), nn.SELU(), nn.CELU(0.7),
                                    nn.Softsign()], ids=lambda m: type(m).__name__)
def test_elementwise_more(module):
    x = seq(3, 2, 5, seed=1) * 3
    x[0, 0, :3] = torch.tensor([-3.0, 3.0, 0.0], dtype=torch.float64)  # the kinks, as torch's backward picks
    u = check_values(module, x)
    assert u.nnz == u.d_in


@FAST
@given(c=st.integers(1, 4), spatial=st.sampled_from([(), (3,), (2, 2)]), per_channel=st.booleans(),
       seed=st.integers(0, 2**16))
def test_prelu(c, spatial, per_channel, seed):
    m = _seeded(nn.PReLU(c if per_channel else 1), seed)
    x = seq(3, c, *spatial, seed=seed)
    x.view(-1)[0] = 0.0
    u = check_values(m, x)
    check_param_grads(m, u, x, seed)


def test_unflatten():
    m = nn.Unflatten(1, (2, 3))
    u = check_values(m, seq(2, 6))
    assert u.shared and u.out_shape == (2, 3)


# ----------------------------------------------------------------------------- resampling and padding


@pytest.mark.parametrize("module,shape", [
    (nn.AdaptiveAvgPool2d((2, 3)), (2, 5, 7)),
    (nn.AdaptiveAvgPool2d(1), (3, 4, 4)),
    (nn.AdaptiveAvgPool2d((None, 2)), (1, 3, 5)),
    (nn.AdaptiveAvgPool1d(3), (2, 7)),
    (nn.ZeroPad2d((1, 2, 0, 1)), (2, 3, 3)),
    (nn.ZeroPad2d((-1, 1, 2, -1)), (1, 4, 4)),
    (nn.ZeroPad1d(2), (2, 3)),
    (nn.ReflectionPad2d(1), (1, 3, 4)),
    (nn.ReplicationPad1d((2, 1)), (2, 3)),
    (nn.Upsample(scale_factor=2, mode="nearest"), (2, 3, 2)),
    (nn.Upsample(size=(5, 3), mode="nearest"), (1, 3, 2)),
    (nn.Upsample(scale_factor=1.7, mode="nearest-exact"), (1, 3, 3)),
    (nn.Upsample(scale_factor=2, mode="bilinear"), (2, 3, 2)),
    (nn.Upsample(size=(4, 5), mode="bilinear", align_corners=True), (1, 3, 2)),
    (nn.Upsample(scale_factor=1.5, mode="bicubic"), (1, 3, 4)),
    (nn.Upsample(scale_factor=3, mode="linear"), (2, 4)),
    (nn.UpsamplingNearest2d(scale_factor=2), (1, 2, 2)),
    (nn.UpsamplingBilinear2d(size=(3, 5)), (1, 2, 3)),
], ids=lambda v: repr(v) if isinstance(v, tuple) else type(v).__name__)
def test_resampling(module, shape):
    x = seq(2, *shape, seed=3)
    u = check_values(module, x)
    assert u.shared
    assert_no_guaranteed_zeros(u, jacobian_support(module, x))


# ----------------------------------------------------------------------------- ConvTranspose


@st.composite
def convt_cases(draw):
    groups = draw(st.integers(1, 2))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    nd = draw(st.sampled_from([1, 2]))
    k = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    s = tuple(draw(st.integers(1, 3)) for _ in range(nd))
    d = tuple(draw(st.integers(1, 2)) for _ in range(nd))
    p = tuple(draw(st.integers(0, 1)) for _ in range(nd))
    # output_padding must be smaller than stride or dilation
    op = tuple(draw(st.integers(0, max(ss, dd) - 1)) for ss, dd in zip(s, d))
    size = tuple(draw(st.integers(1, 4)) for _ in range(nd))
    return dict(groups=groups, cin=cin, cout=cout, nd=nd, k=k, s=s, d=d, p=p, op=op, size=size,
                bias=draw(st.booleans()))


def _affine_jt(module: nn.Module, x1: torch.Tensor) -> np.ndarray:
    """``J^T`` of an affine layer from its outputs on the basis vectors (jacrev's vmap falls back
    to a slow loop for transposed convolutions)."""
    d = x1.numel()
    basis = torch.cat([torch.zeros(1, d, dtype=x1.dtype), torch.eye(d, dtype=x1.dtype)]).reshape((d + 1,) + x1.shape)
    with torch.no_grad():
        y = module(basis).reshape(d + 1, -1)
    return (y[1:] - y[:1]).numpy()


@FAST
@given(c=convt_cases(), seed=st.integers(0, 2**16))
def test_conv_transpose(c, seed):
    cls = nn.ConvTranspose1d if c["nd"] == 1 else nn.ConvTranspose2d
    m = cls(c["cin"], c["cout"], c["k"], stride=c["s"], padding=c["p"], output_padding=c["op"], groups=c["groups"],
            dilation=c["d"], bias=c["bias"])
    m = _seeded(m, seed)
    x = seq(2, c["cin"], *c["size"], seed=seed)
    with torch.no_grad():
        if m(x[:1]).numel() == 0:
            return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer_checks, "dense_jt", _affine_jt)
        u = check_values(m, x)
        assert u.shared
        assert_no_guaranteed_zeros(u, jacobian_support(m, x[:1]))
    check_param_grads(m, u, x, seed)


def test_conv_transpose_pruned():
    import torch.nn.utils.prune as prune

    m = _seeded(nn.ConvTranspose2d(2, 3, 3, stride=2), 4)
    prune.l1_unstructured(m, "weight", amount=0.5)
    x = seq(2, 2, 3, 3, seed=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(layer_checks, "dense_jt", _affine_jt)
        u = check_values(m, x)
    dense = build_unit(nn.ConvTranspose2d(2, 3, 3, stride=2).double(), x)
    assert u.nnz < dense.nnz
    check_param_grads(m, u, x, 4)


def test_registry_lists_the_new_layers():
    names = {t.__name__ for t in supported_layer_types()}
    for n in ("LayerNorm", "GroupNorm", "Softmax", "LogSoftmax", "AdaptiveAvgPool2d", "ZeroPad2d", "Upsample",
              "ConvTranspose2d", "PReLU", "Hardswish", "Mish", "SELU", "Unflatten"):
        assert n in names
