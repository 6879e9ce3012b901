"""One contract every registered layer unit keeps (float64): its pattern holds the dense Jacobian's
non-zeros and its fill their values, its structured operator, fused step and chain step equal
``J^T g`` from those values, its parameter gradients equal autograd's, and every capability it
declares holds (shape preservation, mode independence, low-rank factors, the ReLU mask)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from layer_checks import build_unit, check_param_grads, check_values, filled, seq
from spscan.layers import NODE_UNITS, LayerUnit, make_unit, supported_layer_types, unit_capabilities
from spscan.layers.registry import ATTENTION, JOIN_ADD, JOIN_CAT, PRODUCT_MATMUL, PRODUCT_MUL

# one sample per registered module type: (module factory, per-sample input shape)
SAMPLES = {
    nn.Linear: (lambda: nn.Linear(4, 3), (4,)),
    nn.Conv1d: (lambda: nn.Conv1d(2, 3, 3, padding=1), (2, 5)),
    nn.Conv2d: (lambda: nn.Conv2d(2, 4, 3, stride=2, padding=1, groups=2), (2, 5, 5)),
    nn.ReLU: (nn.ReLU, (6,)),
    nn.LeakyReLU: (lambda: nn.LeakyReLU(0.1), (6,)),
    nn.Tanh: (nn.Tanh, (2, 3)),
    nn.Sigmoid: (nn.Sigmoid, (6,)),
    nn.GELU: (nn.GELU, (6,)),
    nn.MaxPool1d: (lambda: nn.MaxPool1d(3, stride=2), (2, 7)),
    nn.MaxPool2d: (lambda: nn.MaxPool2d(2), (2, 4, 4)),
    nn.AvgPool1d: (lambda: nn.AvgPool1d(3, stride=2, padding=1), (2, 7)),
    nn.AvgPool2d: (lambda: nn.AvgPool2d(2), (2, 4, 4)),
    nn.BatchNorm1d: (lambda: nn.BatchNorm1d(3).eval(), (3,)),
    nn.BatchNorm2d: (lambda: nn.BatchNorm2d(2).eval(), (2, 3, 3)),
    nn.Dropout: (lambda: nn.Dropout(0.3).eval(), (5,)),
    nn.Dropout1d: (lambda: nn.Dropout1d(0.3).eval(), (2, 4)),
    nn.Dropout2d: (lambda: nn.Dropout2d(0.3).eval(), (2, 3, 3)),
    nn.SiLU: (nn.SiLU, (6,)),
    nn.ELU: (nn.ELU, (6,)),
    nn.Softplus: (nn.Softplus, (6,)),
    nn.Hardtanh: (nn.Hardtanh, (6,)),
    nn.ReLU6: (nn.ReLU6, (6,)),
    nn.Flatten: (nn.Flatten, (2, 3)),
    nn.Identity: (nn.Identity, (4,)),
    nn.Unflatten: (lambda: nn.Unflatten(1, (2, 3)), (6,)),
    nn.LayerNorm: (lambda: nn.LayerNorm(4), (2, 4)),
    nn.GroupNorm: (lambda: nn.GroupNorm(2, 4), (4, 3)),
    nn.Softmax: (lambda: nn.Softmax(dim=-1), (5,)),
    nn.LogSoftmax: (lambda: nn.LogSoftmax(dim=1), (3, 4)),
    nn.PReLU: (lambda: nn.PReLU(3), (3, 4)),
    nn.Hardswish: (nn.Hardswish, (6,)),
    nn.Hardsigmoid: (nn.Hardsigmoid, (6,)),
    nn.Mish: (nn.Mish, (6,)),
    nn.SELU: (nn.SELU, (6,)),
    nn.CELU: (lambda: nn.CELU(0.7), (6,)),
    nn.Softsign: (nn.Softsign, (6,)),
    nn.AdaptiveAvgPool1d: (lambda: nn.AdaptiveAvgPool1d(3), (2, 7)),
    nn.AdaptiveAvgPool2d: (lambda: nn.AdaptiveAvgPool2d((2, 3)), (2, 5, 5)),
    nn.Upsample: (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), (2, 3, 3)),
    nn.UpsamplingNearest2d: (lambda: nn.UpsamplingNearest2d(scale_factor=2), (1, 2, 3)),
    nn.UpsamplingBilinear2d: (lambda: nn.UpsamplingBilinear2d(scale_factor=2), (1, 2, 2)),
    nn.ZeroPad1d: (lambda: nn.ZeroPad1d((1, 2)), (2, 4)),
    nn.ZeroPad2d: (lambda: nn.ZeroPad2d(1), (2, 3, 3)),
    nn.ReflectionPad1d: (lambda: nn.ReflectionPad1d(1), (2, 4)),
    nn.ReflectionPad2d: (lambda: nn.ReflectionPad2d(1), (1, 3, 3)),
    nn.ReplicationPad1d: (lambda: nn.ReplicationPad1d(2), (2, 4)),
    nn.ReplicationPad2d: (lambda: nn.ReplicationPad2d(1), (1, 3, 3)),
    nn.ConvTranspose1d: (lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), (2, 4)),
    nn.ConvTranspose2d: (lambda: nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1), (2, 3, 3)),
}

BATCH = 3


def test_every_registered_layer_type_has_a_sample():
    # nn.Embedding reads integer ids (no Jacobian to compare with): its contract is the test below
    assert set(supported_layer_types()) == set(SAMPLES) | {nn.Embedding}


def test_embedding_contract():
    """No input gradient (an empty J^T, a zero operator) and autograd's weight gradient, padding row included."""
    torch.manual_seed(0)
    m = nn.Embedding(7, 3, padding_idx=1).double()
    ids = torch.tensor([[1, 2, 2, 6], [0, 1, 5, 2], [3, 3, 3, 3]])
    unit = make_unit(0, m, (4,), (4, 3))
    assert unit.integer_input and unit.nnz == 0 and unit.pattern.shape == (4, 12)
    y, saved = unit.run(ids, [m.weight.detach()])
    assert torch.equal(y, m(ids).detach()) and unit.fill(saved, [m.weight]).numel() == 0
    g = seq(BATCH, 12, seed=1)
    assert torch.equal(unit.apply_transposed(saved, [m.weight], g), torch.zeros(BATCH, 4, dtype=g.dtype))
    (want,) = torch.autograd.grad(m(ids), m.weight, g.reshape(BATCH, 4, 3))
    _close(unit.param_grads(saved, [m.weight.detach()], g)[0], want, "weight gradient")
    assert unit.param_grads(saved, [m.weight.detach()], g, [False]) == [None]


def test_every_node_target_maps_to_a_unit_class_a_builder_a_join_or_a_product():
    for key, entry in NODE_UNITS.items():
        if isinstance(key, type):
            assert isinstance(entry, type) and issubclass(entry, LayerUnit), key
        else:
            assert entry in (JOIN_ADD, JOIN_CAT, PRODUCT_MATMUL, PRODUCT_MUL, ATTENTION) or callable(entry), key


def _sample(t: type, seed: int = 0):
    factory, shape = SAMPLES[t]
    torch.manual_seed(seed)
    m = factory().double()
    for p in m.parameters():
        with torch.no_grad():
            p.normal_()
    if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
        m.running_mean.normal_()
        m.running_var.uniform_(0.5, 2.0)
    return m, seq(BATCH, *shape, seed=seed)


def _jt_times(unit: LayerUnit, values: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``J^T g`` per sample from the unit's CSR values: ``(B, d_in)``."""
    return torch.stack([torch.from_numpy(filled(unit, values, b) @ g[b].numpy()) for b in range(g.shape[0])])


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.reshape(b.shape[0], -1), b.reshape(b.shape[0], -1)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if not a.numel():
        return
    err = float((a - b).abs().max())
    assert err <= 1e-12 * max(1.0, float(b.abs().max())), f"{what}: differs by {err}"


@pytest.mark.parametrize("t", list(SAMPLES), ids=lambda t: t.__name__)
def test_unit_contract(t):
    m, x = _sample(t)
    unit = check_values(m, x)  # pattern canonical, forward equals the module's, fill equals jacrev's J^T
    check_param_grads(m, unit, x)
    caps = unit.capabilities
    assert caps == type(unit).capabilities_for(m) or t in (nn.MaxPool1d, nn.MaxPool2d)  # pools narrow in __init__
    assert unit_capabilities(m) == type(unit).capabilities_for(m)
    if caps.shape_preserving:
        assert unit.out_shape == unit.in_shape
    tensors = [t_.detach() for t_ in unit.tensors()]
    with torch.no_grad():
        y, saved = unit.run(x, tensors)
        values = unit.fill(saved, tensors)
        g = seq(BATCH, unit.d_out, seed=1)
        want = _jt_times(unit, values, g)
        grads = unit.param_grads(saved, tensors, g)
        assert unit.has_operator == caps.structured_operator
        if unit.has_operator:
            _close(unit.apply_transposed(saved, tensors, g), want, "apply_transposed")
            _close(unit.apply_transposed_into(saved, tensors, g, torch.empty_like(want)), want, "apply_transposed_into")
            _close(unit.operator(saved, tensors).apply(g), want, "operator")
            needed = [True] * len(unit.roles)
            gi, both = unit.apply_transposed_and_param_grads(saved, tensors, g, needed)
            _close(gi, want, "apply_transposed_and_param_grads")
            step_gi, step_grads = unit.chain_step(needed or None)(saved, tensors, g.reshape((BATCH,) + unit.out_shape))
            assert step_gi.shape == (BATCH,) + unit.in_shape
            _close(step_gi, want, "chain_step")
            for r, (a, b, c) in enumerate(zip(both, step_grads or [None] * len(grads), grads)):
                _close(a, c, f"fused parameter gradient {r}")
                if step_grads is not None:
                    _close(b, c, f"chain-step parameter gradient {r}")
        if caps.low_rank_factors:
            left, right = unit.factor_patterns()
            lv, rv = unit.factor_fill(saved, tensors)
            for b in range(BATCH):
                lb = lv if lv.dim() == 1 else lv[b]
                rb = rv if rv.dim() == 1 else rv[b]
                dense_l = np.zeros(left.shape)
                dense_l[np.repeat(np.arange(left.shape[0]), np.diff(left.indptr)), left.indices] = lb.numpy()
                dense_r = np.zeros(right.shape)
                dense_r[np.repeat(np.arange(right.shape[0]), np.diff(right.indptr)), right.indices] = rb.numpy()
                assert np.abs(dense_l @ dense_r - filled(unit, values, b)).max() <= 1e-12
        if caps.relu_mask:
            _close(values, (y > 0).to(y.dtype), "ReLU mask")


@pytest.mark.parametrize("t", list(SAMPLES), ids=lambda t: t.__name__)
def test_flags_follow_the_mode_only_where_declared(t):
    m, x = _sample(t)
    unit = build_unit(m, x)
    flags = (unit.shared, unit.has_operator, unit.has_csr_values)
    m.train(not m.training)
    try:
        if (unit.shared, unit.has_operator, unit.has_csr_values) != flags:
            assert unit.capabilities.mode_dependent
    finally:
        m.train(not m.training)


@pytest.mark.parametrize("pool_m, shape, out", [
    (nn.MaxPool2d(2), (2, 4, 4), (2, 2, 2)),
    (nn.MaxPool2d(3, stride=1), (2, 4, 4), (2, 2, 2)),  # overlapping windows
    (nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True), (2, 5, 5), (2, 3, 3)),
    (nn.MaxPool1d(3, stride=2), (2, 7), (2, 3)),
])
def test_max_pool_applies_the_relu_mask_below_it(pool_m, shape, out):
    """The pool's step with the ReLU mask below it applied at the pooled resolution equals the two steps
    one after the other bit for bit, overlapping windows included, and its operator is ATen's backward."""
    relu_m = nn.ReLU()
    x = seq(BATCH, *shape, seed=3)
    relu, pool = make_unit(0, relu_m, shape, shape), make_unit(1, pool_m, shape, out)
    assert relu.capabilities.relu_mask and pool.capabilities.fuses_relu_below and pool.has_operator
    with torch.no_grad():
        h, s_relu = relu.run(x, [])
        _, s_pool = pool.run(h, [])
        g = seq(BATCH, *out, seed=4)
        pooled = pool.chain_step()(s_pool, [], g)[0]
        plain = relu.chain_step()(s_relu, [], pooled)[0]
        fused = relu.chain_step(masked_above=True)(s_relu, [], pool.chain_step(relu_below=True)(s_pool, [], g)[0])[0]
    hh = h.clone().requires_grad_(True)
    assert torch.equal(torch.autograd.grad(pool_m(hh), hh, g)[0], pooled)
    assert torch.equal(plain, fused)
    assert torch.equal(pool.apply_transposed(s_pool, [], g.reshape(BATCH, -1)), pooled.reshape(BATCH, -1))
