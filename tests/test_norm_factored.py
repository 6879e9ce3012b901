"""LayerNorm, GroupNorm, Softmax and LogSoftmax as two low-rank factors ``J^T = L R`` in the chain
(:class:`spscan.layers.LowRankFactors`, ``norm_form`` of :func:`spscan.chain.planning.plan_chain`): the
factors against the dense blocks and autograd, the planner's choice, and the model plan's mapping
from its core elements back to layers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import spscan
from spscan.chain import model as chain_model, planning as chain_planning
from spscan.layers import LowRankFactors
from spscan.planner import cost

from layer_checks import build_unit, filled, run_errors, seq
from test_layers_more import (NORM_CASES, NORM_CHAINS, _rel, _seeded, _step, check_chain_equals_autograd,
                              check_float32_within_autograd_error)


def _factor_matrix(pattern: sp.csr_array, values: torch.Tensor, b: int) -> sp.csr_array:
    v = values if values.dim() == 1 else values[b]
    return sp.csr_array((v.detach().numpy(), pattern.indices, pattern.indptr), shape=pattern.shape)


@pytest.mark.parametrize("name", list(NORM_CASES))
def test_factors_multiply_to_the_dense_blocks(name):
    """Per unit, float64: ``L R`` equals the dense blocks (CSR values) for every sample; the factors
    hold ``(1 + r) N`` entries per group each and are canonical CSR of shapes ``(d, d + rG)``,
    ``(d + rG, d)``."""
    make, shape = NORM_CASES[name]
    m = _seeded(make(), 3)
    u = build_unit(m, seq(2, *shape))
    assert isinstance(u, LowRankFactors)
    left, right = u.factor_patterns()
    g, n = u.factor_groups.shape
    inner = u.d_in + u.rank * g
    assert left.shape == (u.d_in, inner) and right.shape == (inner, u.d_out) == (u.factor_inner, u.d_out)
    assert left.nnz == right.nnz == (1 + u.rank) * g * n
    for p in (left, right):
        q = p.copy()
        q.sum_duplicates()
        q.sort_indices()
        assert q.nnz == p.nnz and np.array_equal(q.indices, p.indices)
    x = seq(3, *shape, seed=5)
    t = [v.detach() for v in u.tensors()]
    _, saved = u.run(x, t)
    dense = u.fill(saved, t)
    lv, rv = u.factor_fill(saved, t)
    sh_l, sh_r = u.factor_shared()
    assert lv.shape == ((left.nnz,) if sh_l else (3, left.nnz))
    assert rv.shape == ((right.nnz,) if sh_r else (3, right.nnz))
    for b in range(3):
        prod = (_factor_matrix(left, lv, b) @ _factor_matrix(right, rv, b)).toarray()
        np.testing.assert_allclose(prod, filled(u, dense, b), rtol=0, atol=1e-13)


@pytest.mark.parametrize("levels", [1, "full"])
@pytest.mark.parametrize("name", list(NORM_CHAINS))
def test_factored_chains_equal_autograd(name, levels):
    """``norm_form="factored"`` at depth 1 and full, with and without operators, float64: input and
    parameter gradients equal autograd's (≤ 1e-9 relative), batch 3, then 1, then 5 on one wrapper."""
    for w in check_chain_equals_autograd(name, levels=levels, norm_form="factored"):
        assert any(w.plan.factored)
        assert len(w.plan.patterns) == w.plan.core.n == len(w.plan.units) + sum(w.plan.factored)


@pytest.mark.parametrize("name", ["mlp_layernorm_logsoftmax", "cnn_groupnorm_softmax"])
def test_factored_float32_within_autograd_error(name):
    """float32, factored at full depth: spscan's error against a float64 reference is at most 2x
    autograd's own float32 error."""
    check_float32_within_autograd_error(name, levels="full", norm_form="factored")


def _gn_cnn() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 16, 10), nn.LogSoftmax(dim=1)).double()


def _ln_mlp(d: int = 64) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d), nn.GELU(), nn.Linear(d, d), nn.LayerNorm(d),
                         nn.GELU(), nn.Linear(d, 10)).double()


def test_core_api_maps_elements_to_layers():
    """``plan.forward`` gives two value tensors per factored layer; ``spscan.backward`` returns one
    gradient per layer boundary (the factors' inner gradient left out), equal to autograd's and to
    the dense plan's; ``param_grads`` from them equal autograd's; a wrong count names the rule;
    ``extra`` terms per layer boundary give the dense plan's gradients; the summary shows the factors."""
    torch.manual_seed(2)
    net = _gn_cnn()
    x = seq(5, 4, 4, 4, seed=1)
    fac = spscan.plan(net, x, levels=1, norm_form="factored")
    den = spscan.plan(net, x, levels=1, norm_form="dense")
    assert fac.factored == [False, True, False, False, True, False, False, False, True]
    assert den.factored == [False] * 9
    y, jac = fac.forward(x)
    assert len(jac) == fac.core.n == 12
    g = seq(*y.shape, seed=3)
    grads = spscan.backward(fac, jac, g)
    ref = spscan.backward(den, den.forward(x)[1], g)
    assert len(grads) == len(ref) == 10
    for a, r in zip(grads, ref):
        assert a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    xr = x.clone().requires_grad_(True)
    net.zero_grad()
    (net(xr) * g).sum().backward()
    torch.testing.assert_close(grads[0].reshape(x.shape), xr.grad, rtol=1e-10, atol=1e-12)
    pg = chain_model.param_grads(fac, jac, grads)
    for n, p in net.named_parameters():
        torch.testing.assert_close(pg[n], p.grad, rtol=1e-10, atol=1e-12, msg=n)
    run_errors(lambda: spscan.backward(fac, list(jac)[:-1], g), ValueError, "expected 12", "two for a factored")
    # extra terms per layer boundary (a loss read at layer 4's output and at the input) as in the dense plan
    extra = [None] * 10
    extra[4] = seq(5, grads[4].shape[1], seed=7)
    extra[0] = seq(5, grads[0].shape[1], seed=8)
    got_e = fac.backward(jac, g, extra)
    ref_e = den.backward(den.forward(x)[1], g, extra)
    for a, r in zip(got_e, ref_e):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(got_e[0], grads[0])
    run_errors(lambda: fac.backward(jac, g, [None] * 12), ValueError, "extra", "expected 10")
    text = fac.summary()
    assert "J^T = L R" in text and "dense blocks" in text


def test_auto_chooses_by_cost():
    """``norm_form="auto"``: the factors next to convs (the dense blocks would fill their products),
    the blocks next to a Linear over the whole LayerNorm (the products are dense anyway); depth 0
    (forced or chosen) keeps the layer's kernel; the profile's ``dense_block_limit`` factors without planning
    the blocks into products."""
    cnn, x_cnn = _gn_cnn(), seq(2, 4, 4, 4)
    mlp, x_mlp = _ln_mlp(256), seq(2, 256)
    assert any(spscan.plan(cnn, x_cnn, levels=1).factored)
    assert not any(spscan.plan(mlp, x_mlp, levels=1).factored)
    assert not any(spscan.plan(cnn, x_cnn, levels=0).factored)
    auto = spscan.plan(cnn, x_cnn)
    if auto.levels == 0:
        assert not any(auto.factored)
    old = cost._CPU
    try:
        cost._CPU = dataclasses.replace(old, dense_block_limit=1000)  # below a LayerNorm(256)'s 65536 block entries
        calls = []
        real = chain_planning.build_plan

        def spy(pats, **kw):
            calls.append(len(pats))
            return real(pats, **kw)

        chain_planning.build_plan = spy
        try:
            p = spscan.plan(mlp, x_mlp, levels=1)
        finally:
            chain_planning.build_plan = real
        assert p.factored == [False, True, False, False, True, False, False]
        assert calls == [9]  # only the factored chain was planned
        assert all("_dense" not in u.__dict__ for u in p.units)  # the blocks' pattern was never built
        p0 = spscan.plan(mlp, x_mlp, levels=0)  # depth 0: the layers' kernels, not the factors' SpMVs
        assert not any(p0.factored)
        calls.clear()
        chain_planning.build_plan = spy
        try:
            pa = spscan.plan(mlp, x_mlp)
        finally:
            chain_planning.build_plan = real
        if pa.levels == 0:  # the factored chain's best was the linear scan: the kernels instead
            assert not any(pa.factored) and calls == [9, 7]
        else:
            assert any(pa.factored) and calls == [9]
    finally:
        cost._CPU = old


def test_sgd_steps_equal_autograd():
    """Five SGD steps with momentum through the factored wrapper (depth 1) from the same initialization
    equal autograd's, and the batch size changes between steps."""
    torch.manual_seed(4)
    ref_net = _gn_cnn()
    net = _gn_cnn()
    net.load_state_dict(ref_net.state_dict())
    w = spscan.wrap(net, seq(3, 4, 4, 4), levels=1, norm_form="factored")
    assert any(w.plan.factored)
    opt_r = torch.optim.SGD(ref_net.parameters(), lr=0.1, momentum=0.9)
    opt_w = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step, b in enumerate((3, 1, 4, 3, 2)):
        x = seq(b, 4, 4, 4, seed=10 + step)
        target = torch.randint(0, 10, (b,), generator=torch.Generator().manual_seed(step))
        for model, opt in ((ref_net, opt_r), (w, opt_w)):
            opt.zero_grad()
            nn.functional.nll_loss(model(x), target).backward()
            opt.step()
    for (n, a), b in zip(net.named_parameters(), ref_net.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=n)


class _TracedMLP(nn.Module):
    """A straight chain with its own forward (traced by torch.fx) and functional ops."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 3)

    def forward(self, x):
        return torch.log_softmax(self.fc2(torch.relu(self.norm(self.fc1(x)))), dim=1)


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, x):
        return x + self.norm(self.fc(x))


def test_traced_chain_factors_and_graph_refuses():
    """A traced straight chain takes ``norm_form`` like a Sequential (gradients equal autograd's); a
    graph with a skip plans its blocks dense and refuses ``"factored"`` with the reason."""
    torch.manual_seed(5)
    net = _TracedMLP().double()
    x = seq(4, 6, seed=2)
    w = spscan.wrap(net, x, levels=1, norm_form="factored")
    assert any(w.plan.factored)
    for a, r in zip(_step(w, x, 1), _step(net, x, 1)):
        assert _rel(a, r) <= 1e-9
    run_errors(lambda: spscan.wrap(_Residual().double(), x, levels=1, norm_form="factored"), ValueError,
               "norm_form='factored'", "chains")
    spscan.wrap(_Residual().double(), x, levels=1, norm_form="dense")


def test_bad_norm_form():
    run_errors(lambda: spscan.plan(_ln_mlp(8), seq(2, 8), norm_form="lowrank"), ValueError,
               "norm_form", "'auto'", "'lowrank'")


@st.composite
def _norm_chain(draw):
    """A random chain of per-token Linear/Conv1d maps, activations and normalization layers over
    per-sample ``(tokens, features)``: every layer type with factors, odd sizes, groups of one."""
    t = draw(st.integers(1, 3))
    f = f0 = draw(st.integers(1, 6))
    layers: list[nn.Module] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["linear", "conv", "ln", "gn", "softmax", "logsoftmax", "gelu"]))
        if kind == "linear":
            f_new = draw(st.integers(1, 6))
            layers.append(nn.Linear(f, f_new))
            f = f_new
        elif kind == "conv":
            layers.append(nn.Conv1d(t, t, 1))
        elif kind == "ln":
            layers.append(nn.LayerNorm(f, elementwise_affine=draw(st.booleans())))
        elif kind == "gn":  # torch needs more than one value per group
            sizes = [d for d in range(1, t + 1) if t % d == 0 and (t // d) * f > 1]
            if sizes:
                layers.append(nn.GroupNorm(draw(st.sampled_from(sizes)), t, affine=draw(st.booleans())))
        elif kind in ("softmax", "logsoftmax"):
            cls = nn.Softmax if kind == "softmax" else nn.LogSoftmax
            layers.append(cls(dim=draw(st.sampled_from([1, 2, -1]))))
        else:
            layers.append(nn.GELU())
    if not any(isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.Softmax, nn.LogSoftmax)) for m in layers):
        layers.append(nn.LayerNorm(f))
    return nn.Sequential(*layers), (t, f0)


@settings(max_examples=60)
@given(case=_norm_chain(), form=st.sampled_from(["factored", "auto", "dense"]),
       levels=st.sampled_from([0, 1, "full", "auto"]), seed=st.integers(0, 2**16), batch=st.integers(1, 4))
def test_random_norm_chains_equal_autograd(case, form, levels, seed, batch):
    """Hypothesis-drawn chains through every factored layer type, any ``norm_form`` and depth,
    float64: input and parameter gradients equal autograd's (≤ 1e-9 relative)."""
    net, shape = case
    torch.manual_seed(seed)
    net = net.double()
    for p in net.parameters():
        with torch.no_grad():
            p.add_(0.3 * torch.randn_like(p))
    x = seq(batch, *shape, seed=seed)
    w = spscan.wrap(net, x, levels=levels, norm_form=form)
    for a, r in zip(_step(w, x, seed), _step(net, x, seed)):
        assert _rel(a, r) <= 1e-9
