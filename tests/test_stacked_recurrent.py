"""Stacked and bidirectional RNN / GRU / LSTM through one scan per (layer, direction): every gradient equals autograd's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spscan
from spscan.recurrent.wrapper import RecurrentWrapper
from spscan.recurrent.stacked import StackedRecurrentPlan

CELLS = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}


def make(kind: str, input_size: int, hidden: int, *, dtype=torch.float64, seed=0, **kw) -> nn.Module:
    torch.manual_seed(seed)
    return CELLS[kind](input_size, hidden, **kw).to(dtype)


def make_inputs(m: nn.Module, T: int, B: int, *, with_h0: bool, dtype=torch.float64, seed=1, unbatched=False):
    g = torch.Generator().manual_seed(seed)
    shape = (T, m.input_size) if unbatched else ((B, T, m.input_size) if m.batch_first else (T, B, m.input_size))
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if not with_h0:
        return x, None
    n = m.num_layers * (2 if m.bidirectional else 1)
    hshape = (n, m.hidden_size) if unbatched else (n, B, m.hidden_size)
    h0 = (0.5 * torch.randn(hshape, generator=g, dtype=torch.float64)).to(dtype)
    if isinstance(m, nn.LSTM):
        return x, (h0, (0.5 * torch.randn(hshape, generator=g, dtype=torch.float64)).to(dtype))
    return x, h0


def loss_fn(out, state, seed=2):
    """Random linear functionals of every output (per-step losses), ``h_n`` and ``tanh(c_n)``."""
    g = torch.Generator().manual_seed(seed)
    h_n, c_n = state if isinstance(state, tuple) else (state, None)

    def rnd(t):
        return torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)

    total = (out * rnd(out)).sum() + (h_n * rnd(h_n)).sum()
    if c_n is not None:
        total = total + (c_n.tanh() * rnd(c_n)).sum()
    return total


def run(f, m: nn.Module, x: torch.Tensor, hx, *, rng_seed: int = 7):
    """``[output, dx, dh0, (dc0), d params...]`` of ``loss_fn(f(x, hx))``; the RNG is seeded before the forward
    (dropout masks)."""
    x = x.detach().clone().requires_grad_(True)
    leaves = [x]
    if hx is not None:
        hx = tuple(h.detach().clone().requires_grad_(True) for h in hx) if isinstance(hx, tuple) \
            else hx.detach().clone().requires_grad_(True)
        leaves += list(hx) if isinstance(hx, tuple) else [hx]
    for p in m.parameters():
        p.grad = None
    torch.manual_seed(rng_seed)
    out, state = f(x, hx)
    loss_fn(out, state).backward()
    res = [out.detach()] + [leaf.grad for leaf in leaves] + [p.grad for p in m.parameters()]
    return [r.detach().clone() for r in res]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def assert_equal_autograd(m, x, hx, tol=1e-9, **plan_kwargs):
    want = run(m, m, x, hx)
    w = spscan.wrap(m, x, **plan_kwargs)
    assert isinstance(w, RecurrentWrapper)
    got = run(w, m, x, hx)
    assert len(got) == len(want) == 1 + 1 + (0 if hx is None else len(hx) if isinstance(hx, tuple) else 1) \
        + len(list(m.parameters()))
    # a reverse direction's input GEMM runs over a time-flipped copy, and the RNN's, GRU's and LSTM's CPU
    # forwards are spscan.kernels.cpu.recurrence's compiled passes (their own summation order): rounding may differ
    assert rel_err(got[0], want[0]) <= 1e-14
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert rel_err(a, b) <= tol, (i, rel_err(a, b))
    return w


CASES = [
    # the two: a 2-layer GRU and a bidirectional 2-layer LSTM, per-step losses
    ("gru", dict(num_layers=2), dict(batch_first=False)),
    ("gru", dict(num_layers=2), dict(batch_first=True)),
    ("lstm", dict(num_layers=2, bidirectional=True), dict(batch_first=False)),
    ("lstm", dict(num_layers=2, bidirectional=True), dict(batch_first=True)),
    # bidirectional single layer, relu RNN, no biases
    ("gru", dict(num_layers=1, bidirectional=True), dict(batch_first=False)),
    ("rnn", dict(num_layers=2, nonlinearity="relu", bias=False), dict(batch_first=True)),
    ("lstm", dict(num_layers=3), dict(batch_first=False)),
]


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("kind, arch, layout", CASES)
def test_float64_gradients_equal_autograd(kind, arch, layout, with_h0):
    m = make(kind, 3, 5, **arch, **layout)
    x, hx = make_inputs(m, 23, 3, with_h0=with_h0)
    assert_equal_autograd(m, x, hx)


@pytest.mark.parametrize("kind, bidirectional", [("rnn", False), ("gru", True), ("lstm", True)])
def test_dropout_in_train_mode_uses_torchs_masks(kind, bidirectional):
    """Dropout between layers (train mode): from the same RNG seed, the outputs are bitwise the module's (the
    masks are torch's), the gradients equal autograd's and the RNG state afterwards is the same."""
    m = make(kind, 2, 6, num_layers=3, dropout=0.4, bidirectional=bidirectional)
    m.train()
    x, hx = make_inputs(m, 13, 3, with_h0=True)
    w = assert_equal_autograd(m, x, hx)
    torch.manual_seed(11)
    m(x, hx)
    after_module = torch.rand(3)
    torch.manual_seed(11)
    w(x, hx)
    assert torch.equal(torch.rand(3), after_module)
    # a different seed gives different masks: the test above would see them
    torch.manual_seed(12)
    o12 = w(x, hx)[0]
    torch.manual_seed(11)
    assert not torch.equal(w(x, hx)[0], o12)
    m.eval()  # eval: no dropout, the output does not depend on the RNG
    torch.manual_seed(12)
    o_eval = w(x, hx)[0]
    torch.manual_seed(11)
    assert torch.equal(w(x, hx)[0], o_eval)
    assert rel_err(o_eval, m(x, hx)[0]) <= 1e-14


@pytest.mark.parametrize("levels", [0, 1, "full"])
def test_every_depth_equals_autograd(levels):
    m = make("gru", 2, 4, num_layers=2, bidirectional=True)
    x, hx = make_inputs(m, 37, 2, with_h0=True)
    w = assert_equal_autograd(m, x, hx, tol=1e-12, levels=levels)
    assert len(w.plan.levels) == 4
    if isinstance(levels, int):
        assert w.plan.levels == [levels] * 4
    else:
        assert all(k >= 6 for k in w.plan.levels)  # floor(log2(3 * 37)) for the factored GRU chain


@pytest.mark.parametrize("kind, arch", [("gru", dict(num_layers=2)), ("lstm", dict(num_layers=2, bidirectional=True))])
def test_float32_error_within_twice_autograd(kind, arch):
    m64 = make(kind, 4, 20, **arch, batch_first=True)
    m32 = make(kind, 4, 20, **arch, batch_first=True, dtype=torch.float32)
    x, hx = make_inputs(m64, 100, 4, with_h0=True)
    ref = run(m64, m64, x, hx)
    x32 = x.float()
    hx32 = tuple(h.float() for h in hx) if isinstance(hx, tuple) else hx.float()
    auto = run(m32, m32, x32, hx32)
    ours = run(spscan.wrap(m32, x32), m32, x32, hx32)
    for i, (r, a, o) in enumerate(zip(ref, auto, ours)):
        scale = r.abs().max().item()
        err_auto = (a.double() - r).abs().max().item()
        err_ours = (o.double() - r).abs().max().item()
        assert err_ours <= 2 * err_auto + 1e-6 * scale + 1e-12, (i, err_ours, err_auto)


@pytest.mark.parametrize("kind, arch", [
    ("gru", dict(num_layers=2)),
    ("lstm", dict(num_layers=2, bidirectional=True, dropout=0.3)),
])
def test_five_sgd_steps_equal_autograds(kind, arch):
    """From the same initialization (and RNG seeds: dropout in train mode), 5 SGD steps give autograd's parameters."""
    finals = []
    for use_scan in (False, True):
        m = make(kind, 3, 6, **arch, batch_first=True)
        m.train()
        model = spscan.wrap(m, torch.zeros(4, 12, 3, dtype=torch.float64)) if use_scan else m
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(5):
            x, hx = make_inputs(m, 12, 4, with_h0=True, seed=100 + step)
            torch.manual_seed(step)
            opt.zero_grad()
            out, state = model(x, hx)
            (loss_fn(out, state, seed=200 + step) / out.numel()).backward()
            opt.step()
        finals.append([p.detach().clone() for p in m.parameters()])
    for i, (a, b) in enumerate(zip(*finals)):
        assert rel_err(b, a) <= 1e-9, (i, rel_err(b, a))
        assert not torch.equal(a, make(kind, 3, 6, **arch, batch_first=True).state_dict()[list(m.state_dict())[i]])


def test_recycled_buffers_across_steps_and_accumulation():
    """A full tile of samples (the compiled forwards, whose values each (layer, direction) plan
    recycles): SGD steps, then two forwards accumulated into one backward, give autograd's parameters;
    release_buffers frees what the layer plans keep."""
    finals = []
    for use_scan in (False, True):
        m = make("lstm", 3, 5, num_layers=2, bidirectional=True, batch_first=True)
        model = spscan.wrap(m, torch.zeros(16, 6, 3, dtype=torch.float64)) if use_scan else m
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            opt.zero_grad()
            xs = [make_inputs(m, 6, 16, with_h0=True, seed=300 + step + k)[0] for k in range(1 + (step == 3))]
            loss = sum(loss_fn(*model(x), seed=400 + step) / 100 for x in xs)
            loss.backward()
            opt.step()
        finals.append([p.detach().clone() for p in m.parameters()])
        if use_scan:
            assert any(lp.buffers.address("values") is not None for lp in model.plan.layer_plans)
            model.plan.release_buffers()
            assert all(lp.buffers.address("values") is None for lp in model.plan.layer_plans)
    for i, (a, b) in enumerate(zip(*finals)):
        assert rel_err(b, a) <= 1e-9, (i, rel_err(b, a))


def test_unbatched_input_changing_shapes_same_parameters():
    m = make("lstm", 3, 4, num_layers=2, bidirectional=True, batch_first=True)
    x, hx = make_inputs(m, 6, 1, with_h0=True, unbatched=True)
    want = run(m, m, x, hx)
    w = spscan.wrap(m, None)  # no example input: every length is planned on first use
    got = run(w, m, x, hx)
    for a, b in zip(got, want):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-12
    assert [id(p) for p in w.parameters()] == [id(p) for p in m.parameters()]
    for B, T in ((2, 10), (5, 3), (1, 17), (5, 3)):
        x, hx = make_inputs(m, T, B, with_h0=B != 5, seed=B + T)
        got, want = run(w, m, x, hx), run(m, m, x, hx)
        out, (h, c) = w(x)
        assert out.shape == (B, T, 8) and h.shape == c.shape == (4, B, 4)
        for a, b in zip(got, want):
            assert rel_err(a, b) <= 1e-12
    assert sorted({n for p in w.plan.layer_plans for n in p.cached_lengths()}) == [3, 6, 10, 17]


def test_plan_forward_backward_and_public_api():
    """``spscan.plan`` / ``spscan.forward`` / ``plan.backward`` on a stacked module; ``spscan.backward`` points to it."""
    m = make("gru", 2, 3, num_layers=2, bidirectional=True, batch_first=True)
    x, hx = make_inputs(m, 7, 2, with_h0=True)
    plan = spscan.plan(m, x)
    assert isinstance(plan, StackedRecurrentPlan) and len(plan.layer_plans) == 4
    (out, h), saved = spscan.forward(plan, x)
    go, gh = torch.randn_like(out), torch.randn_like(h)
    r = plan.backward(saved, go, gh)
    xr = x.clone().requires_grad_(True)
    o2, h2 = m(xr)
    names = [n for n, _ in m.named_parameters()]
    want = torch.autograd.grad((o2, h2), [xr] + list(m.parameters()), (go, gh))
    torch.testing.assert_close(r["input"], want[0], rtol=1e-10, atol=1e-12)
    for n, g in zip(names, want[1:]):
        torch.testing.assert_close(r[n], g, rtol=1e-10, atol=1e-12)
    assert r["h_0"].shape == (4, 2, 3) and r["c_0"] is None
    with pytest.raises(TypeError, match=r"plan\.backward\(saved, grad_output"):
        spscan.backward(plan, saved, go)
    assert "layer 1 reverse" in plan.summary()


def test_only_output_used_and_only_input_requires_grad():
    m = make("rnn", 2, 3, num_layers=2, bidirectional=True)
    for p in m.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
    w = spscan.wrap(m, x)
    w(x)[0][-1].sum().backward()
    g = x.grad.clone()
    x.grad = None
    m(x)[0][-1].sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # the no-grad path: the module's outputs
        assert torch.equal(w(x)[0], m(x)[0])


def test_retain_graph_backward_twice_accumulates():
    m = make("lstm", 2, 3, num_layers=2, bidirectional=True)
    x = torch.randn(5, 2, 2, dtype=torch.float64)
    w = spscan.wrap(m, x)
    out, (h, c) = w(x)
    loss = out.sum() + h.pow(2).sum() + c.sum()
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in m.parameters()]
    loss.backward()
    for a, p in zip(once, m.parameters()):
        torch.testing.assert_close(p.grad, 2 * a, rtol=1e-12, atol=1e-12)


def test_second_derivative_and_torch_func_refused():
    m = make("gru", 2, 3, num_layers=2)
    x = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
    w = spscan.wrap(m, x)
    params = list(m.parameters())
    g = torch.autograd.grad(w(x)[0].pow(2).sum(), [x] + params, create_graph=True)
    want = torch.autograd.grad(m(x)[0].pow(2).sum(), [x] + params)
    for a, b in zip(g, want):  # first order is still right
        torch.testing.assert_close(a.detach(), b, rtol=1e-10, atol=1e-12)
    with pytest.raises(RuntimeError, match="differentiated twice"):
        torch.autograd.grad(g[0].sum(), params, allow_unused=True)
    p = {k: v.detach() for k, v in m.named_parameters()}
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.grad(lambda p, x: torch.func.functional_call(w, {"module." + k: v for k, v in p.items()},
                                                                (x,))[0].sum())(p, x.detach())


def test_refusals_are_clear():
    with pytest.raises(spscan.NotPlannable, match="proj_size=0, got 2"):
        spscan.wrap(nn.LSTM(3, 4, num_layers=2, proj_size=2), torch.randn(5, 1, 3), backward="scan")
    with pytest.raises(spscan.NotPlannable, match="proj_size=0, got 2"):
        spscan.plan(nn.LSTM(3, 4, bidirectional=True, proj_size=2), torch.randn(5, 1, 3))
    with pytest.raises(spscan.NotPlannable, match="torch.bfloat16 parameters"):
        spscan.plan(nn.GRU(3, 4, num_layers=2).bfloat16(), torch.randn(5, 1, 3).bfloat16())
    m = nn.GRU(3, 4, num_layers=2)
    w = spscan.wrap(m, torch.randn(5, 2, 3))
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(5, 2, 3), [5, 3])
    with pytest.raises(TypeError, match="PackedSequence.*pad_packed_sequence"):
        w(packed)
    with pytest.raises(ValueError, match="feature size 3, got 5"):
        w(torch.randn(4, 1, 5))
    with pytest.raises(ValueError, match=r"hx: expected h_0 of shape \(2, B, 4\)"):
        w(torch.randn(4, 2, 3), torch.zeros(1, 2, 4))
    with pytest.raises(TypeError, match=r"hx: expected a tuple \(h_0, c_0\)"):
        spscan.wrap(nn.LSTM(3, 4, num_layers=2), None)(torch.randn(4, 2, 3), torch.zeros(2, 2, 4))
    m.num_layers = 3
    with pytest.raises(ValueError, match="num_layers / bidirectional changed after wrapping"):
        w(torch.randn(4, 2, 3))


def test_newton_forward_per_layer():
    """``forward="newton"`` reaches every (layer, direction): each layer's recurrence is solved by Newton
    iterations over its planned scan; outputs and gradients equal the module's up to rounding."""
    m = make("gru", 2, 3, num_layers=2, bidirectional=True)
    x, hx = make_inputs(m, 40, 2, with_h0=True)
    want = run(m, m, x, hx)
    w = spscan.wrap(m, x, forward="newton")
    got = run(w, m, x, hx)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) <= 1e-9, (i, rel_err(a, b))
    assert all(p.last_forward is not None and p.last_forward.converged for p in w.plan.layer_plans)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("frozen", ["l0", "l1_reverse", "input"])
def test_stacked_only_the_gradients_needed_are_computed(kind, frozen):
    """Frozen first- or second-layer parameters, or an input without gradient: the rest equals autograd's
    (the upper layer still passes its input's gradient down), and nothing comes back for the rest."""
    ref = make(kind, 3, 4, num_layers=2, bidirectional=True, batch_first=True)
    m = make(kind, 3, 4, num_layers=2, bidirectional=True, batch_first=True)
    for mod in (ref, m):
        for name, p in mod.named_parameters():
            if frozen != "input" and name.endswith(frozen):
                p.requires_grad_(False)
    x = torch.randn(2, 7, 3, dtype=torch.float64, requires_grad=frozen != "input")
    w = spscan.wrap(m, x)
    got = []
    for mod in (ref, w):
        x.grad = None
        out = mod(x)[0]
        (out ** 3).sum().backward()
        got.append((x.grad, {n.removeprefix("module."): p.grad for n, p in mod.named_parameters()}))
    (xa, pa), (xb, pb) = got
    assert (xa is None) == (xb is None)
    if xa is not None:
        torch.testing.assert_close(xb, xa, rtol=1e-10, atol=1e-12)
    for n, g in pa.items():
        assert (g is None) == (pb[n] is None), n
        if g is not None:
            torch.testing.assert_close(pb[n], g, rtol=1e-10, atol=1e-12)
