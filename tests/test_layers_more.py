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
    filled,
    jacobian_support,
    run_errors,
    seq,
)
import spscan
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


# ----------------------------------------------------------------------------- structured operators
#
# LayerNorm, GroupNorm, Softmax and LogSoftmax apply J^T matrix-free (O(N) per normalized group or
# softmax slice); their CSR values (dense blocks) are formed only for up-sweep products.


def _norm_cases():
    """(id, module factory, per-sample input shape): odd sizes, a group of one element, 4-D softmax."""
    return [
        ("ln_affine", lambda: nn.LayerNorm(5), (5,)),
        ("ln_plain", lambda: nn.LayerNorm(5, elementwise_affine=False), (3, 5)),
        ("ln_no_bias", lambda: nn.LayerNorm([2, 3], bias=False), (4, 2, 3)),
        ("ln_d1", lambda: nn.LayerNorm(1), (1,)),
        ("ln_d1_lead", lambda: nn.LayerNorm(1), (3, 1)),
        ("gn_affine", lambda: nn.GroupNorm(3, 6), (6, 2, 3)),
        ("gn_plain", lambda: nn.GroupNorm(2, 4, affine=False), (4, 3)),
        ("gn_one_channel_per_group", lambda: nn.GroupNorm(3, 3), (3, 5)),
        ("gn_flat", lambda: nn.GroupNorm(1, 5), (5,)),
        ("softmax_last", lambda: nn.Softmax(dim=-1), (7,)),
        ("softmax_dim1_4d", lambda: nn.Softmax(dim=1), (3, 2, 4)),
        ("logsoftmax_dim2", lambda: nn.LogSoftmax(dim=2), (3, 5)),
        ("logsoftmax_dim1_4d", lambda: nn.LogSoftmax(dim=1), (4, 3, 2)),
        ("softmax_d1", lambda: nn.Softmax(dim=1), (1,)),
    ]


NORM_CASES = {name: (make, shape) for name, make, shape in _norm_cases()}


@pytest.mark.parametrize("name", list(NORM_CASES))
def test_norm_operator_equals_csr_values_and_autograd(name):
    """Per unit, float64: J^T g from the operator = the CSR values times g = autograd's vjp, on a
    strided g (the engine passes views of its vector arena); the fused weight and bias gradients
    equal autograd's; batch 3 then batch 1 with one unit."""
    make, shape = NORM_CASES[name]
    m = _seeded(make(), 7)
    u = build_unit(m, seq(2, *shape))
    assert u.has_operator and not u.shared
    for b in (3, 1):
        x = seq(b, *shape, seed=b)
        tensors = [t.detach().clone().requires_grad_(True) for t in u.tensors()]
        plain = [t.detach() for t in tensors]
        xr = x.clone().requires_grad_(True)
        with torch.enable_grad():
            y_ref, _ = u.run(xr, tensors)
        assert torch.equal(y_ref.detach(), m(x).detach())
        g = seq(b, 2 * u.d_out, seed=11)[:, ::2]  # a strided (B, d_out) view
        ref = torch.autograd.grad(y_ref, [xr] + tensors, g.reshape(y_ref.shape))
        ref_x, ref_p = ref[0].reshape(b, -1), ref[1:]
        _, saved = u.run(x, plain)
        torch.testing.assert_close(u.operator(saved, plain).apply(g), ref_x, rtol=1e-12, atol=1e-12)
        vals = u.fill(saved, plain)
        assert vals.shape == (b, u.nnz)
        via_csr = torch.stack([torch.from_numpy(filled(u, vals, k) @ g[k].numpy()) for k in range(b)])
        torch.testing.assert_close(via_csr, ref_x, rtol=1e-10, atol=1e-12)
        if not u.roles:
            continue
        op = u.operator(saved, plain, [True] * len(u.roles))  # fused: one backward-kernel call
        torch.testing.assert_close(op.apply(g), ref_x, rtol=1e-12, atol=1e-12)
        for got in (op.param_grads, u.param_grads(saved, plain, g)):
            for role, a, r in zip(u.roles, got, ref_p):
                torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=role)
        if "bias" in u.roles:
            only_bias = u.operator(saved, plain, [r == "bias" for r in u.roles])
            only_bias.apply(g)
            assert [a is None for a in only_bias.param_grads] == [r != "bias" for r in u.roles]


def _norm_chains():
    """Chains through every normalization/softmax unit (name -> (model factory, per-sample input shape))."""
    return {
        "mlp_layernorm_logsoftmax": (lambda: nn.Sequential(
            nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 5), nn.LogSoftmax(dim=1)), (6,)),
        "cnn_groupnorm_softmax": (lambda: nn.Sequential(
            nn.Conv2d(2, 6, 3, padding=1), nn.GroupNorm(3, 6), nn.ReLU(), nn.Conv2d(6, 4, 1), nn.Softmax(dim=1),
            nn.Flatten(), nn.Linear(4 * 3 * 3, 3)), (2, 3, 3)),
        "odd_sizes": (lambda: nn.Sequential(
            nn.Linear(4, 3), nn.LayerNorm(3, elementwise_affine=False), nn.Tanh(), nn.Linear(3, 1), nn.LayerNorm(1),
            nn.Linear(1, 2), nn.GroupNorm(1, 2), nn.Softmax(dim=-1)), (4,)),
    }


NORM_CHAINS = _norm_chains()


def _step(model, x, seed):
    xr = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    y = model(xr)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    (y * w).sum().backward()
    return [xr.grad] + [p.grad.clone() for p in model.parameters()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max error relative to the reference's largest entry; a reference that is zero up to rounding
    (everything before a LayerNorm(1) gets no gradient) is compared at 1e-12 absolute."""
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-3)


@pytest.mark.parametrize("levels", [0, 1, "full"])
@pytest.mark.parametrize("name", list(NORM_CHAINS))
def test_norm_chains_equal_autograd(name, levels):
    """spscan.wrap at depth 0 (operators), 1 and full (dense blocks in the products), with and without
    operators, float64: input and parameter gradients equal autograd's (≤ 1e-9 relative), batch 3,
    then 1, then 5 on the same wrapper."""
    check_chain_equals_autograd(name, levels=levels)


def check_chain_equals_autograd(name: str, **wrap_kw) -> list:
    """:data:`NORM_CHAINS` ``name`` in float64 through ``spscan.wrap(**wrap_kw)`` with and without
    operators: input and parameter gradients equal autograd's (≤ 1e-9 relative), batch 3, then 1,
    then 5 on the same wrappers (returned)."""
    make, shape = NORM_CHAINS[name]
    torch.manual_seed(0)
    net = make().double()
    for p in net.parameters():
        with torch.no_grad():
            p.add_(0.3 * torch.randn_like(p))  # gains and biases away from 1 and 0
    wrappers = [spscan.wrap(net, seq(3, *shape), operators=ops, **wrap_kw) for ops in (True, False)]
    for b in (3, 1, 5):
        x = seq(b, *shape, seed=b)
        ref = _step(net, x, b)
        for w in wrappers:
            got = _step(w, x, b)
            for k, (a, r) in enumerate(zip(got, ref)):
                assert _rel(a, r) <= 1e-9, (k, _rel(a, r))
    return wrappers


@pytest.mark.parametrize("name", ["mlp_layernorm_logsoftmax", "cnn_groupnorm_softmax"])
def test_norm_chain_depth0_forms_no_dense_block(name):
    """At depth 0 every normalization/softmax layer is applied as its operator: no CSR values are filled."""
    make, shape = NORM_CHAINS[name]
    net = make().double()
    x = seq(4, *shape)
    w = spscan.wrap(net, x, levels=0)
    norm = [u for u in w.plan.units if type(u).__name__ in ("LayerNormUnit", "GroupNormUnit", "SoftmaxUnit")]
    assert norm and all(w.plan.operator_flags[u.index] for u in norm)
    calls = []
    for u in norm:
        u.fill = lambda *a, _u=u: calls.append(_u.index)  # would return None: the step would fail
    _step(w, x, 0)
    assert calls == []


@pytest.mark.parametrize("levels", [0, "full"])
@pytest.mark.parametrize("name", ["mlp_layernorm_logsoftmax", "cnn_groupnorm_softmax"])
def test_norm_chains_float32_within_autograd_error(name, levels):
    """float32: spscan's error against a float64 reference is at most 2x autograd's own float32 error."""
    check_float32_within_autograd_error(name, levels=levels)


def check_float32_within_autograd_error(name: str, **wrap_kw) -> None:
    """:data:`NORM_CHAINS` ``name`` in float32 through ``spscan.wrap(**wrap_kw)``: every gradient's error
    against a float64 reference is at most 2x autograd's own float32 error."""
    make, shape = NORM_CHAINS[name]
    torch.manual_seed(1)
    net32 = make()
    net64 = make().double()
    net64.load_state_dict({k: v.double() for k, v in net32.state_dict().items()})
    x = seq(6, *shape, seed=2, dtype=torch.float32)
    w = spscan.wrap(net32, x, **wrap_kw)
    ref = _step(net64, x.double(), 3)
    ag = _step(net32, x, 3)
    got = _step(w, x, 3)
    for k, (s, a, r) in enumerate(zip(got, ag, ref)):
        floor = 1e-6 * float(r.abs().max())
        err_s, err_a = float((s.double() - r).abs().max()), float((a.double() - r).abs().max())
        assert err_s <= 2 * err_a + floor, (k, err_s, err_a)


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.AdaptiveAvgPool2d(1), (3, 9, 11)), (lambda: nn.AdaptiveAvgPool2d((3, 5)), (2, 9, 11)),
    (lambda: nn.Upsample(scale_factor=3, mode="bicubic"), (2, 4, 5)), (lambda: nn.ZeroPad2d((-1, 2, 1, -2)), (2, 5, 6)),
    (lambda: nn.ReplicationPad1d(3), (2, 7)), (lambda: nn.Upsample(size=7, mode="linear", align_corners=True), (2, 10))])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_separable_resample_operator_is_autograds_backward(make, shape, dtype):
    """Pools, resamples and pads apply ``J^T`` as one small product per axis (no CSR gathers): autograd's
    input gradient, batch 1 and 4, for a non-contiguous gradient too."""
    from spscan.layers.linear import SeparableResampleUnit

    m = make()
    for batch in (1, 4):
        x = torch.randn((batch,) + shape, dtype=dtype, requires_grad=True)
        unit = spscan.plan(nn.Sequential(m), x.detach()).units[0]
        assert isinstance(unit, SeparableResampleUnit) and unit.has_operator
        y = m(x)
        g = torch.randn(unit.d_out, batch, dtype=dtype).t()  # non-contiguous
        (want,) = torch.autograd.grad(y, x, g.reshape(y.shape))
        tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(unit.apply_transposed(None, [], g), want.reshape(batch, -1), **tol)


def test_separable_resample_factors_refuse_what_is_not_a_product():
    """The per-axis factors are read off the plane's entries only where they reproduce every entry."""
    from spscan.layers.linear import _axis_factors

    rin, rout = np.array([0, 1, 2, 3]), np.array([0, 0, 0, 0])  # a 2 x 2 input plane summed into one output
    assert len(_axis_factors(rin, rout, np.array([1.0, 2.0, 3.0, 6.0]), (2, 2), (1, 1))) == 2  # [1, 3] x [1, 2]
    assert _axis_factors(rin, rout, np.array([1.0, 2.0, 3.0, 5.0]), (2, 2), (1, 1)) is None  # rank 2
    assert _axis_factors(rin[:3], rout[:3], np.array([1.0, 2.0, 3.0]), (2, 2), (1, 1)) is None  # a missing entry


@pytest.mark.parametrize("make, shape", [
    (lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, dilation=1), (4, 5, 6)),
    (lambda: nn.ConvTranspose2d(3, 2, (2, 3), stride=(1, 2), padding=(0, 1), dilation=2, bias=False), (3, 4, 4)),
    (lambda: nn.ConvTranspose1d(2, 3, 4, stride=3, output_padding=2), (2, 5)),
    (lambda: nn.PReLU(3), (3, 4, 2)), (lambda: nn.PReLU(), (5,)), (nn.Hardswish, (3, 7)), (nn.SELU, (9,))])
def test_operators_of_transposed_convs_and_more_activations_are_autograds(make, shape):
    """Transposed convolutions, PReLU and the activations torch writes as their own formulas apply ``J^T``
    without CSR values: autograd's input and parameter gradients (float64, batch 1 and 3)."""
    torch.manual_seed(0)
    m = make().double()
    for batch in (1, 3):
        x = torch.randn((batch,) + shape, dtype=torch.float64, requires_grad=True)
        unit = spscan.plan(nn.Sequential(m), x.detach()).units[0]
        assert unit.has_operator
        y, saved = unit.run(x.detach(), unit.tensors())
        g = torch.randn(y.shape, dtype=torch.float64)
        params = [p for _, p in m.named_parameters()]
        want = torch.autograd.grad(m(x), [x] + params, g)
        gi, grads = unit.apply_transposed_and_param_grads(saved, unit.tensors(), g.reshape(batch, -1),
                                                          [True] * len(unit.roles))
        torch.testing.assert_close(gi, want[0].reshape(batch, -1), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(unit.apply_transposed(saved, unit.tensors(), g.reshape(batch, -1)),
                                   want[0].reshape(batch, -1), rtol=1e-12, atol=1e-12)
        for got, w in zip(grads, want[1:]):
            torch.testing.assert_close(got, w, rtol=1e-12, atol=1e-12)
