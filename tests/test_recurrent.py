"""RNN / GRU / LSTM through the scan: every gradient equals autograd's."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spscan
import spscan.recurrent.plan as rec
from spscan.recurrent.plan import plan_recurrent, recurrent_patterns
from spscan.recurrent.wrapper import RecurrentWrapper, wrap_recurrent
from spscan.reference import reference_backward

CELLS = {"rnn_tanh": nn.RNN, "rnn_relu": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}


def make_module(kind: str, input_size: int, hidden: int, *, batch_first: bool, bias: bool, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    kw = {"nonlinearity": kind[4:]} if kind.startswith("rnn") else {}
    return CELLS[kind](input_size, hidden, batch_first=batch_first, bias=bias, **kw).to(dtype)


def make_inputs(m: nn.Module, T: int, B: int, *, with_h0: bool, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, m.input_size) if m.batch_first else (T, B, m.input_size)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    hx = None
    if with_h0:
        h0 = (0.5 * torch.randn(1, B, m.hidden_size, generator=g, dtype=torch.float64)).to(dtype)
        if isinstance(m, nn.LSTM):
            hx = (h0, (0.5 * torch.randn(1, B, m.hidden_size, generator=g, dtype=torch.float64)).to(dtype))
        else:
            hx = h0
    return x, hx


def loss_fn(out, state, loss: str, seed=2):
    """Deterministic random linear functionals of the outputs (a 'loss' with rich gradients)."""
    g = torch.Generator().manual_seed(seed)
    h_n, c_n = state if isinstance(state, tuple) else (state, None)
    total = out.sum() * 0.0
    if loss in ("step", "both"):
        total = total + (out * torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)).sum()
    if loss in ("final", "both"):
        total = total + (h_n * torch.randn(h_n.shape, generator=g, dtype=torch.float64).to(h_n.dtype)).sum()
        if c_n is not None:
            total = total + (c_n.tanh() * torch.randn(c_n.shape, generator=g, dtype=torch.float64).to(c_n.dtype)).sum()
    return total


def grads_of(f, m: nn.Module, x: torch.Tensor, hx, loss: str) -> list[torch.Tensor]:
    """[dx, dh0, (dc0), d params...] of ``loss_fn(f(x, hx))``."""
    x = x.detach().clone().requires_grad_(True)
    leaves = [x]
    if hx is not None:
        hx = tuple(h.detach().clone().requires_grad_(True) for h in hx) if isinstance(hx, tuple) else hx.detach().clone().requires_grad_(True)
        leaves += list(hx) if isinstance(hx, tuple) else [hx]
    for p in m.parameters():
        p.grad = None
    out, state = f(x, hx)
    loss_fn(out, state, loss).backward()
    res = [leaf.grad for leaf in leaves] + [p.grad for p in m.parameters()]
    return [torch.zeros(()) if r is None else r.detach().clone() for r in res]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


@st.composite
def configs(draw):
    kind = draw(st.sampled_from(sorted(CELLS)))
    hidden = draw(st.integers(1, 64))
    # long sequences with big hidden sizes only rarely: keeps the suite fast
    t_max = 400 if hidden <= 8 else (60 if hidden <= 24 else 12)
    T = draw(st.integers(1, t_max))
    B = draw(st.integers(1, 8))
    return dict(
        kind=kind, hidden=hidden, T=T, B=B, input_size=draw(st.integers(1, 6)),
        batch_first=draw(st.booleans()), bias=draw(st.booleans()), with_h0=draw(st.booleans()),
        loss=draw(st.sampled_from(["step", "final", "both"])),
    )


@settings(max_examples=60)
@given(cfg=configs())
def test_float64_gradients_equal_autograd(cfg):
    m = make_module(cfg["kind"], cfg["input_size"], cfg["hidden"], batch_first=cfg["batch_first"], bias=cfg["bias"])
    x, hx = make_inputs(m, cfg["T"], cfg["B"], with_h0=cfg["with_h0"], dtype=torch.float64)
    want = grads_of(m, m, x, hx, cfg["loss"])
    w = wrap_recurrent(m, x)
    got = grads_of(w, m, x, hx, cfg["loss"])
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert rel_err(a, b) <= 1e-9, (i, rel_err(a, b), cfg)


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_large_hidden_long_sequence(kind):
    m = make_module(kind, 3, 64, batch_first=False, bias=True)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(0.5)  # keep the long product of Jacobians away from overflow
    x, hx = make_inputs(m, 300, 2, with_h0=True, dtype=torch.float64)
    want = grads_of(m, m, x, hx, "both")
    got = grads_of(wrap_recurrent(m, x), m, x, hx, "both")
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) <= 1e-9, (i, rel_err(a, b))


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("loss", ["step", "final", "both"])
def test_float32_error_within_twice_autograd(kind, loss):
    m64 = make_module(kind, 4, 20, batch_first=True, bias=True)
    m32 = make_module(kind, 4, 20, batch_first=True, bias=True, dtype=torch.float32)
    x, hx = make_inputs(m64, 200, 4, with_h0=True, dtype=torch.float64)
    ref = grads_of(m64, m64, x, hx, loss)
    x32 = x.float()
    hx32 = tuple(h.float() for h in hx) if isinstance(hx, tuple) else hx.float()
    auto = grads_of(m32, m32, x32, hx32, loss)
    ours = grads_of(wrap_recurrent(m32, x32), m32, x32, hx32, loss)
    for i, (r, a, o) in enumerate(zip(ref, auto, ours)):
        scale = r.abs().max().item()
        err_auto = (a.double() - r).abs().max().item()
        err_ours = (o.double() - r).abs().max().item()
        assert err_ours <= 2 * err_auto + 1e-6 * scale + 1e-12, (i, err_ours, err_auto)


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("layout", ["factored", "materialized"])
def test_chain_matches_reference_backward(kind, layout):
    """The chain's patterns and values (CSR order) give the reference's state gradients."""
    m = make_module(kind, 2, 3, batch_first=False, bias=True)
    x, hx = make_inputs(m, 5, 2, with_h0=True, dtype=torch.float64)
    plan = plan_recurrent(m, x, layout=layout)
    _, saved = plan.forward(x, hx)
    D = plan.state_size
    g = torch.Generator().manual_seed(3)
    top = torch.randn(2, D, generator=g, dtype=torch.float64)
    extra = torch.randn(5, 2, D, generator=g, dtype=torch.float64)
    pats = recurrent_patterns(m, 5, layout)
    per = len(pats) // 5
    ext = [None] * (len(pats) + 1)
    for t in range(5):
        ext[per * (t + 1)] = extra[t]
    vals = saved.values if layout == "factored" else list(saved.values)
    ref = reference_backward(pats, vals, top, ext)[0::per]
    grads = plan._scan(saved, top, extra)  # extra[t] is the direct gradient of s_{t+1}
    assert len(grads) == len(pats) + 1
    got = [grads[i].clone() for i in range(0, len(pats) + 1, per)]
    for t in range(6):
        torch.testing.assert_close(got[t], ref[t], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("layout", ["factored", "materialized"])
@pytest.mark.parametrize("levels", [0, 1, "auto", "full"])
def test_every_depth_equals_autograd(kind, layout, levels):
    """Every up-sweep depth of the core plan gives autograd's gradients; ``plan.levels`` is the plan's."""
    m = make_module(kind, 2, 5, batch_first=False, bias=True)
    x, hx = make_inputs(m, 37, 3, with_h0=True, dtype=torch.float64)
    want = grads_of(m, m, x, hx, "both")
    w = wrap_recurrent(m, x, layout=layout, levels=levels)
    got = grads_of(w, m, x, hx, "both")
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) <= 1e-12, (layout, levels, i)
    core_plan = w.plan.scan_plan(37, x.device, x.dtype)
    assert w.plan.levels == core_plan.levels
    if isinstance(levels, int):
        assert w.plan.levels == levels
    elif levels == "full":
        assert w.plan.levels == len(w.plan.patterns).bit_length() - 1  # floor(log2 n) for n chain elements


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("levels", [0, "auto", "full"])
def test_factored_and_materialized_agree(kind, levels):
    m = make_module(kind, 3, 7, batch_first=True, bias=False)
    x, hx = make_inputs(m, 23, 4, with_h0=True, dtype=torch.float64)
    a = grads_of(wrap_recurrent(m, x, layout="factored", levels=levels), m, x, hx, "both")
    b = grads_of(wrap_recurrent(m, x, layout="materialized", levels=levels), m, x, hx, "both")
    for u, v in zip(a, b):
        assert rel_err(u, v) <= 1e-12


def test_same_parameters_optimizer_and_changing_shapes():
    m = make_module("lstm", 3, 5, batch_first=True, bias=True, dtype=torch.float32)
    w = wrap_recurrent(m, torch.randn(2, 10, 3))
    assert [id(p) for p in w.parameters()] == [id(p) for p in m.parameters()]
    opt = torch.optim.Adam(w.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in m.parameters()]
    for B, T in ((2, 10), (5, 3), (1, 17), (5, 3)):
        opt.zero_grad()
        out, (h, c) = w(torch.randn(B, T, 3))
        assert out.shape == (B, T, 5) and h.shape == (1, B, 5) and c.shape == (1, B, 5)
        (out.pow(2).mean() + h.sum()).backward()
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, m.parameters()))
    assert w.plan.cached_lengths() == [3, 10, 17]


def test_forward_outputs_equal_module_and_no_grad_path():
    m = make_module("gru", 3, 4, batch_first=False, bias=True)
    w = wrap_recurrent(m)
    x = torch.randn(6, 2, 3, dtype=torch.float64)
    o1, h1 = m(x)
    o2, h2 = w(x)
    # the GRU's CPU forward is spscan.kernels.cpu.recurrence's compiled pass (its own summation order): rounding
    # may differ
    assert o2.shape == o1.shape and h2.shape == h1.shape
    assert (o1 - o2).abs().max() <= 1e-14 * o1.abs().max() and (h1 - h2).abs().max() <= 1e-14 * h1.abs().max()
    with torch.no_grad():
        o3, _ = w(x)
    assert torch.equal(o1, o3)


def test_only_output_used_and_only_input_requires_grad():
    m = make_module("rnn_tanh", 2, 3, batch_first=False, bias=True)
    for p in m.parameters():
        p.requires_grad_(False)
    x = torch.randn(4, 2, 2, dtype=torch.float64, requires_grad=True)
    w = wrap_recurrent(m, x)
    w(x)[0][-1].sum().backward()
    g = x.grad.clone()
    x.grad = None
    m(x)[0][-1].sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "module, exc, match",
    [
        (nn.RNN(2, 3, num_layers=2), ValueError, "num_layers=1"),
        (nn.GRU(2, 3, bidirectional=True), ValueError, "bidirectional"),
        (nn.LSTM(2, 4, proj_size=2), spscan.NotPlannable, "proj_size=0"),
        (nn.GRU(2, 3).half(), spscan.NotPlannable, "float16 parameters: the scan computes in float32 or float64"),
        (nn.RNN(2, 3).bfloat16(), spscan.NotPlannable, "autocast"),
    ],
)
def test_refuses_what_it_cannot_do(module, exc, match):
    """The single-layer plan's refusals; a form the scan cannot plan (``NotPlannable``) is what
    ``spscan.wrap``'s default ``backward="auto"`` runs natively instead. The one wrapper plans a stacked or
    bidirectional module layer by layer instead."""
    with pytest.raises(exc, match=match):
        plan_recurrent(module)
    if exc is ValueError:
        assert type(wrap_recurrent(module).plan).__name__ == "StackedRecurrentPlan"
    else:
        with pytest.raises(exc, match=match):
            wrap_recurrent(module)


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.RNN, nn.GRU or nn.LSTM"):
        plan_recurrent(nn.Linear(2, 3))
    with pytest.raises(ValueError, match="layout: expected"):
        plan_recurrent(nn.RNN(2, 3), layout="dense")
    w = wrap_recurrent(nn.RNN(2, 3))
    with pytest.raises(ValueError, match="feature size 2, got 5"):
        w(torch.randn(4, 1, 5))
    with pytest.raises(ValueError, match="2 or 3 dims"):
        w(torch.randn(4))


def test_recurrent_plan_forward_backward():
    """``plan.forward(x)`` / ``plan.backward(saved, grad_output, grad_h_n, grad_c_n)`` equal autograd."""
    m = make_module("lstm", 2, 3, batch_first=False, bias=True)
    x, _ = make_inputs(m, 6, 2, with_h0=False, dtype=torch.float64)
    plan = plan_recurrent(m, x)
    (out, (h, c)), saved = plan.forward(x)
    go, gh = torch.randn_like(out), torch.randn_like(h)
    r = plan.backward(saved, go, gh, None)
    xr = x.clone().requires_grad_(True)
    o2, (h2, _) = m(xr)
    want = torch.autograd.grad((o2, h2), [xr, m.weight_hh_l0], (go, gh))
    torch.testing.assert_close(r["input"], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r["weight_hh_l0"], want[1], rtol=1e-10, atol=1e-12)
    import spscan

    # spscan.backward returns the chain's n+1 gradients: a recurrent plan is pointed to its own call
    with pytest.raises(TypeError, match=r"plan\.backward\(saved, grad_output"):
        spscan.backward(plan, saved, (go, (gh, None)))


def test_public_api_dispatch():
    """``spscan.plan`` / ``forward`` / ``backward`` / ``wrap`` on a recurrent module."""
    import spscan

    m = make_module("gru", 2, 3, batch_first=True, bias=True)
    x, hx = make_inputs(m, 7, 2, with_h0=True, dtype=torch.float64)
    plan = spscan.plan(m, x)
    (out, h), saved = spscan.forward(plan, x)
    go, gh = torch.randn_like(out), torch.randn_like(h)
    r = plan.backward(saved, go, gh)
    xr = x.clone().requires_grad_(True)
    o2, h2 = m(xr)
    want = torch.autograd.grad((o2, h2), [xr, m.bias_hh_l0], (go, gh))
    torch.testing.assert_close(r["input"], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r["bias_hh_l0"], want[1], rtol=1e-10, atol=1e-12)
    w = spscan.wrap(m, x)
    assert isinstance(w, RecurrentWrapper) and w.module is m


def test_unbatched_input_with_initial_state():
    m = make_module("lstm", 3, 4, batch_first=True, bias=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    hx = (torch.randn(1, 4, generator=g, dtype=torch.float64), torch.randn(1, 4, generator=g, dtype=torch.float64))
    want = grads_of(m, m, x, hx, "both")
    got = grads_of(wrap_recurrent(m), m, x, hx, "both")
    for a, b in zip(got, want):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("levels", [0, 1, "auto"])
def test_core_stacked_values_match_list(levels):
    """The core accepts one stacked (n, B, nnz) tensor for a chain of equal patterns; it must
    give what the list of per-step tensors gives (the recurrent module relies on this for long T)."""
    import spscan

    pat = recurrent_patterns(nn.GRU(1, 3), 6, layout="materialized")[0]
    g = torch.Generator().manual_seed(0)
    vals = 0.5 * torch.rand(6, 2, pat.nnz, generator=g, dtype=torch.float64)
    top = torch.randn(2, 3, generator=g, dtype=torch.float64)
    extra = [None] + [torch.randn(2, 3, generator=g, dtype=torch.float64) for _ in range(5)] + [None]
    ref = reference_backward([pat] * 6, list(vals), top, extra)
    plan = spscan.plan([pat] * 6, levels=levels, dtype=torch.float64)
    for v in (list(vals), vals):
        got = spscan.backward(plan, v, top, extra=extra)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_retain_graph_backward_twice_accumulates(kind):
    m = make_module(kind, 2, 3, batch_first=False, bias=True)
    x = torch.randn(5, 2, 2, dtype=torch.float64)
    w = wrap_recurrent(m, x)
    out, h = w(x)
    h = h[0] if isinstance(h, tuple) else h
    loss = out.sum() + h.pow(2).sum()
    loss.backward(retain_graph=True)
    once = m.weight_hh_l0.grad.clone()
    loss.backward()
    torch.testing.assert_close(m.weight_hh_l0.grad, 2 * once, rtol=1e-12, atol=1e-12)


def test_recycled_buffers_hand_out_only_unused_tensors():
    """A kept tensor comes back only when nothing else uses its storage: not while a caller holds what
    it was given, a view of it or a NumPy array of it; shape or dtype changes make a new one."""
    from spscan.runtime import RecycledBuffers

    pool = RecycledBuffers()
    a = pool.take("x", (3, 4), torch.float32)
    b = pool.take("x", (3, 4), torch.float32)
    assert a.data_ptr() != b.data_ptr()  # the caller still holds a
    del a
    p = b.data_ptr()
    v = b.t()
    del b
    assert pool.take("x", (3, 4), torch.float32).data_ptr() != p  # a view of it is alive
    q = pool.address("x")
    del v
    c = pool.take("x", (3, 4), torch.float32)
    assert c.data_ptr() == q
    arr = c.numpy()
    del c
    assert pool.take("x", (3, 4), torch.float32).data_ptr() != q
    del arr
    assert pool.take("x", (4, 3), torch.float32).shape == (4, 3)
    assert pool.take("x", (4, 3), torch.float64).dtype == torch.float64
    pool.clear()
    assert pool.address("x") is None


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_forward_buffers_recycled_only_when_free(kind):
    """The compiled forward's chain values come from the plan's recycled buffers: the next step gets
    last step's memory once its graph is freed by the backward, never while a graph holding it lives
    (two forwards before one backward, a retained graph); gradients match autograd's every time."""
    pytest.importorskip("numba")
    T, B, H = 7, 16, 5
    m = make_module(kind, 2, H, batch_first=True, bias=True)
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(B, T, 2, generator=g, dtype=torch.float64) for _ in range(4)]
    w = wrap_recurrent(m, xs[0])
    name = "values" if kind == "lstm" else "d"

    def loss_of(module, x):
        out, state = module(x)
        state = state if isinstance(state, tuple) else (state,)
        return out.pow(2).sum() + sum(s.sum() for s in state)

    def grads(f, x_list):
        m.zero_grad(set_to_none=True)
        total = sum(loss_of(f, x) for x in x_list)
        total.backward()
        return [p.grad.clone() for p in m.parameters()]

    def check(x_list):
        got = grads(w, x_list)
        want = grads(m, x_list)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)

    check(xs[:1])
    first = w.plan.buffers.address(name)
    assert first is not None
    check(xs[1:2])  # the graph of the step before is gone: its memory is used again
    assert w.plan.buffers.address(name) == first
    check(xs[1:3])  # two forwards in flight before one backward: they cannot share it
    # a retained graph keeps its values: a forward in between must not overwrite them
    m.zero_grad(set_to_none=True)
    loss = loss_of(w, xs[3])
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in m.parameters()]
    loss_of(w, xs[0]).backward()
    m.zero_grad(set_to_none=True)
    loss.backward()
    for a, b in zip([p.grad for p in m.parameters()], once):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert "kept between steps" in w.plan.summary() and w.plan.buffers.nbytes > 0
    w.plan.release_buffers()
    assert w.plan.buffers.address(name) is None and w.plan.buffers.nbytes == 0
    assert "kept between steps" not in w.plan.summary()
    check(xs[2:3])
    # another batch size (a partial tile), then the first again: new memory, the same gradients
    check([torch.cat([xs[0], xs[1][:4]])])
    check(xs[3:4])


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(kind, reentrant):
    """``torch.utils.checkpoint`` over a wrapped module (what the forward saves goes through
    ``save_for_backward``, so checkpointing drops and recomputes it): the same gradients as without."""
    from torch.utils.checkpoint import checkpoint

    m = make_module(kind, 2, 5, batch_first=True, bias=True)
    x = torch.randn(16, 7, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    w = wrap_recurrent(m, x)

    def grads(use):
        m.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        out = checkpoint(lambda t: w(t)[0], xx, use_reentrant=reentrant) if use else w(xx)[0]
        out.pow(2).sum().backward()
        return [p.grad.clone() for p in m.parameters()] + [xx.grad]

    for a, b in zip(grads(True), grads(False)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["lstm", "rnn_tanh"])
def test_second_backward_without_retain_graph_refused(kind):
    """The backward frees what the forward saved unless the graph is retained, as autograd does: a
    second backward through the same graph raises autograd's own error."""
    m = make_module(kind, 2, 3, batch_first=False, bias=True)
    x = torch.randn(5, 2, 2, dtype=torch.float64)
    w = wrap_recurrent(m, x)
    loss = w(x)[0].sum()  # sum keeps no tensors: the second backward reaches the wrapper's node
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_gradients_survive_the_next_backward(kind):
    """The scan's vector arena is reused between backwards: what a backward returned stays intact."""
    m = make_module(kind, 3, 4, batch_first=False, bias=True)
    x1, hx1 = make_inputs(m, 9, 2, with_h0=True, dtype=torch.float64, seed=1)
    x2, hx2 = make_inputs(m, 9, 2, with_h0=True, dtype=torch.float64, seed=2)
    plan = plan_recurrent(m, x1)
    _, s1 = plan.forward(x1, hx1)
    _, s2 = plan.forward(x2, hx2)
    go = torch.ones(9, 2, 4, dtype=torch.float64)
    first = plan.backward(s1, go, None)
    kept = {k: v.clone() for k, v in first.items() if v is not None}
    second = plan.backward(s2, go, None)
    for k, v in kept.items():
        assert torch.equal(first[k], v), k
        assert not torch.equal(second[k], v), k


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("levels", [0, 1])
def test_triton_backend_equals_autograd(kind, levels):
    """The Triton kernels (Triton's interpreter on CPU) behind the recurrent wrapper, per-step and final losses."""
    m = make_module(kind, 2, 3, batch_first=True, bias=True, dtype=torch.float32)
    x, hx = make_inputs(m, 6, 2, with_h0=True, dtype=torch.float32)
    ref = make_module(kind, 2, 3, batch_first=True, bias=True, dtype=torch.float64)
    want = grads_of(ref, ref, x.double(), tuple(h.double() for h in hx) if isinstance(hx, tuple) else hx.double(), "both")
    auto32 = grads_of(m, m, x, hx, "both")
    w = wrap_recurrent(m, x, levels=levels, backend="triton")
    assert w.plan.scan_plan(6, x.device, x.dtype).backend == "triton"
    got = grads_of(w, m, x, hx, "both")
    again = grads_of(w, m, x, hx, "both")
    for i, (a, b, r) in enumerate(zip(got, auto32, want)):
        assert torch.equal(a, again[i]), i  # deterministic, and the reused arena does not leak between calls
        bound = 2 * (b.double() - r).abs().max().item() + 1e-6 * max(r.abs().max().item(), 1.0)
        assert (a.double() - r).abs().max().item() <= bound, (kind, levels, i)


# --------------------------------------------------------------------------- the LSTM's and RNN's compiled CPU forwards


def _no_compiled_forward(monkeypatch):
    import spscan.kernels.cpu.recurrence as rc

    monkeypatch.setattr(rc, "available", lambda: False)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", ["batched", "batch_first", "unbatched", "batch1_T1", "tile8", "tile16", "tile20"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_h0", [True, False])
def test_lstm_compiled_forward_equals_module_path(monkeypatch, dtype, shape, bias, with_h0):
    """The one-pass compiled forward (outputs, c_T, the gate element's values) gives the module's outputs
    and the same gradients as the module's forward followed by the batched recomputation. ``tile*``:
    batches the forward runs in tiles of ``LANES`` samples (one partial tile, one full, full + partial),
    whose values are stored entry-major."""
    pytest.importorskip("numba")
    T, B = {"batch1_T1": (1, 1), "tile8": (9, 8), "tile16": (11, 16), "tile20": (7, 20)}.get(shape, (13, 3))
    m = make_module("lstm", 3, 6, batch_first=shape in ("batch_first", "tile20"), bias=bias, dtype=dtype)
    x, hx = make_inputs(m, T, B, with_h0=with_h0, dtype=dtype)
    if shape == "unbatched":
        x = x[:, 0]
        hx = None if hx is None else tuple(h[:, 0] for h in hx)
    plan = plan_recurrent(m, x)
    assert plan._compiled_forward_applies(x, hx)
    (out, (h_n, c_n)), saved = plan.forward(x, hx)
    with torch.no_grad():
        want_out, (want_h, want_c) = m(x, hx)
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    for a, b in ((out, want_out), (h_n, want_h), (c_n, want_c)):
        assert a.shape == b.shape and a.dtype == b.dtype and rel_err(a, b) <= tol
    got = grads_of(wrap_recurrent(m, x), m, x, hx, "both")
    _no_compiled_forward(monkeypatch)
    assert not plan._compiled_forward_applies(x, hx)
    _, ref_saved = plan.forward(x, hx)
    for a, b in zip(saved.values, ref_saved.values):
        assert a.shape == b.shape and rel_err(a, b) <= tol
    want = grads_of(wrap_recurrent(m, x), m, x, hx, "both")
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and rel_err(a, b) <= (1e-12 if dtype == torch.float64 else 1e-5), i


@pytest.mark.parametrize("path", ["compiled", "numpy", "unknown_form"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_lstm_compact_gate_values_on_every_path(monkeypatch, path, dtype):
    """The compiled forward hands the gate element over as its 6H compact numbers (an encoded
    PeriodicValues element): the compiled linear scan applies them as they are (code 5), the NumPy
    loop and a kernel that does not know the form read them expanded to the 9H CSR values; every
    way gives autograd's gradients (a full and a partial tile, a loss on every step)."""
    pytest.importorskip("numba")
    from spscan.recurrent.cells import lstm_gate_encoding
    from spscan.runtime import PeriodicValues
    from spscan.kernels.cpu import chain as cpu_chain
    from spscan.kernels.cpu import chain_tables as cpu_chain_tables

    m = make_module("lstm", 2, 5, batch_first=True, bias=True, dtype=dtype)
    x, hx = make_inputs(m, 17, 21, with_h0=True, dtype=dtype)
    plan = plan_recurrent(m, x)
    (_, _), saved = plan.forward(x, hx)
    values = saved.values
    assert isinstance(values, PeriodicValues) and values.encodings[1] is lstm_gate_encoding(5)
    assert values.elements[1].shape == (17, 21, 30)  # 6H numbers per sample, not 9H CSR values
    assert values[3].shape == (21, 45) and torch.equal(values[3], lstm_gate_encoding(5).expand(values.elements[1][1]))
    codes = []
    run_chain = cpu_chain.run_chain
    monkeypatch.setattr(cpu_chain, "run_chain", lambda code, *a, **k: (codes.append(code), run_chain(code, *a, **k)))
    if path == "numpy":
        monkeypatch.setattr(cpu_chain, "available", lambda: False)
    elif path == "unknown_form":
        monkeypatch.setattr(cpu_chain_tables, "ENCODED_CODES", {})
    want = grads_of(m, m, x, hx, "both")
    got = grads_of(wrap_recurrent(m, x), m, x, hx, "both")
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) <= (1e-12 if dtype == torch.float64 else 2e-5), (path, i)
    ran_code5 = any(bool((c == 5).any()) for c in codes)
    assert ran_code5 == (path == "compiled")


def test_compact_gate_values_through_a_checked_run():
    """The engine's checked run validates encoded periodic values as the CSR list they stand for and
    runs that list: bit for bit a run of the expanded values given as a plain list (to a binding that
    is not periodic: the recurrent plan's binding takes PeriodicValues only); the unchecked run
    applies the compact numbers (code 5), rounded differently: close, not equal."""
    pytest.importorskip("numba")
    m = make_module("lstm", 1, 4, batch_first=False, bias=True, dtype=torch.float64)
    x, hx = make_inputs(m, 9, 16, with_h0=True, dtype=torch.float64)
    plan = plan_recurrent(m, x)
    (_, _), saved = plan.forward(x, hx)
    assert saved.values.encodings[1] is not None
    bound = plan._bound(9, x.device, x.dtype, False)
    top = torch.randn(16, 8, dtype=torch.float64)
    checked = [g.clone() for g in bound.run(saved.values, top, check=True)]
    unchecked = [g.clone() for g in bound.run(saved.values, top, check=False)]
    with pytest.raises(ValueError, match="periodic"):
        bound.run(list(saved.values), top, check=True)
    plain = plan.scan_plan(9, x.device, x.dtype).bind(bound.shared, bound.has_extra, x.device)
    as_list = [g.clone() for g in plain.run(list(saved.values), top, check=True)]
    for a, b, c in zip(checked, unchecked, as_list):
        assert torch.equal(a, c)
        torch.testing.assert_close(b, c, rtol=1e-13, atol=1e-13)


def test_encoded_periodic_values_are_checked():
    from spscan.recurrent.cells import lstm_gate_encoding
    from spscan.runtime import PeriodicValues

    shared, compact = torch.zeros(10), torch.zeros(4, 2, 18)
    with pytest.raises(ValueError, match="encodings"):
        PeriodicValues([shared, compact], 4, encodings=[None])
    with pytest.raises(ValueError, match="encodings\\[1\\]"):
        PeriodicValues([shared, compact], 4, encodings=[None, lstm_gate_encoding(2)])  # 12 numbers, not 18
    with pytest.raises(ValueError, match="encodings\\[0\\]"):
        PeriodicValues([shared, compact], 4, encodings=[lstm_gate_encoding(3), None])  # a shared element
    v = PeriodicValues([shared, compact], 4, encodings=[None, lstm_gate_encoding(3)])
    assert len(v) == 8 and v[1].shape == (2, 27) and v.expanded(1).shape == (4, 2, 27) and v[0] is shared


def test_lstm_compiled_forward_saturated_gates():
    """Large pre-activations (saturated sigmoid/tanh, the expm1 clamp) and tiny ones (tanh near 0)."""
    pytest.importorskip("numba")
    for scale in (60.0, 1e-6):
        m = make_module("lstm", 2, 5, batch_first=False, bias=True)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(scale)
        x, hx = make_inputs(m, 20, 3, with_h0=True, dtype=torch.float64)
        x = x * scale
        (out, (h_n, c_n)), _ = plan_recurrent(m, x).forward(x, hx)
        with torch.no_grad():
            want_out, (want_h, want_c) = m(x, hx)
        for a, b in ((out, want_out), (h_n, want_h), (c_n, want_c)):
            assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-13 * b.abs().max() + 1e-300
        want = grads_of(m, m, x, hx, "both")
        got = grads_of(wrap_recurrent(m, x), m, x, hx, "both")
        for i, (a, b) in enumerate(zip(got, want)):
            assert rel_err(a, b) <= 1e-9, (scale, i)


@pytest.mark.parametrize("kind", ["rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", ["batched", "batch_first", "unbatched", "batch1_T1", "tile8", "tile16", "tile20"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_h0", [True, False])
def test_rnn_compiled_forward_equals_module_path(monkeypatch, kind, dtype, shape, bias, with_h0):
    """The RNN's one-pass compiled forward (outputs and the diagonal element's values) gives the module's
    outputs and the same gradients as the module's forward followed by the batched recomputation
    (``tile*``: the forward in tiles of ``LANES`` samples, as the LSTM test says)."""
    pytest.importorskip("numba")
    T, B = {"batch1_T1": (1, 1), "tile8": (9, 8), "tile16": (11, 16), "tile20": (7, 20)}.get(shape, (13, 3))
    m = make_module(kind, 3, 6, batch_first=shape in ("batch_first", "tile20"), bias=bias, dtype=dtype)
    x, hx = make_inputs(m, T, B, with_h0=with_h0, dtype=dtype)
    if shape == "unbatched":
        x = x[:, 0]
        hx = None if hx is None else hx[:, 0]
    plan = plan_recurrent(m, x)
    assert plan._compiled_forward_applies(x, hx)
    (out, h_n), saved = plan.forward(x, hx)
    with torch.no_grad():
        want_out, want_h = m(x, hx)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for a, b in ((out, want_out), (h_n, want_h)):
        assert a.shape == b.shape and a.dtype == b.dtype and rel_err(a, b) <= tol
    got = grads_of(wrap_recurrent(m, x), m, x, hx, "both")
    _no_compiled_forward(monkeypatch)
    assert not plan._compiled_forward_applies(x, hx)
    _, ref_saved = plan.forward(x, hx)
    assert len(saved.values) == len(ref_saved.values)
    for a, b in zip(saved.values, ref_saved.values):
        assert a.shape == b.shape and rel_err(a, b) <= tol
    want = grads_of(wrap_recurrent(m, x), m, x, hx, "both")
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and rel_err(a, b) <= (1e-12 if dtype == torch.float64 else 1e-5), i


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh", "rnn_relu"])
@pytest.mark.parametrize("input_size", [1, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_compiled_forward_input_projection(kind, input_size, dtype, bias):
    """The tiled forwards compute the input part of the gates in their time loop for inputs of at most
    ``FUSED_MAX_INPUT`` features and read it from one GEMM's output above that: both give the module's
    outputs, the same chain values as each other, and autograd's gradients (a full and a partial tile,
    a non-contiguous batch-first input)."""
    pytest.importorskip("numba")
    import spscan.kernels.cpu.recurrence as rc

    assert rc.FUSED_MAX_INPUT == 4  # the sizes above sit at and past the bound
    T, B = 9, 20
    m = make_module(kind, input_size, 6, batch_first=True, bias=bias, dtype=dtype)
    x, hx = make_inputs(m, T, 2 * B, with_h0=True, dtype=dtype)
    x = x[::2]  # every other sample: a strided view
    hx = tuple(h[:, ::2] for h in hx) if isinstance(hx, tuple) else hx[:, ::2]
    plan = plan_recurrent(m, x)
    assert plan._compiled_forward_applies(x, hx)
    params = [p.detach() for p in m.parameters()]
    xt = x.detach().transpose(0, 1)
    bias_vec = (params[2] + params[3]) if bias and kind != "gru" else (
        torch.cat([params[2][:12] + params[3][:12], params[2][12:]]) if bias else None)
    proj = rc.input_projection(xt, params[0], bias_vec)
    assert isinstance(proj, rc.InputProjection) == (input_size <= rc.FUSED_MAX_INPUT)
    gemm = rc.gate_inputs(xt, params[0], bias_vec)
    materialized = proj.materialize() if isinstance(proj, rc.InputProjection) else proj
    assert rel_err(materialized, gemm) <= (1e-15 if dtype == torch.float64 else 1e-7)
    h0 = (hx[0] if isinstance(hx, tuple) else hx)[0]
    if kind == "lstm":
        fused = rc.gated_cell_forward(rc.InputProjection(xt, params[0], bias_vec), params[1], h0, hx[1][0])
        read = rc.gated_cell_forward(gemm, params[1], h0, hx[1][0])
    elif kind == "gru":
        b_hn = params[3][12:] if bias else None
        fused = rc.reset_gated_forward(rc.InputProjection(xt, params[0], bias_vec), params[1], b_hn, h0)
        read = rc.reset_gated_forward(gemm, params[1], b_hn, h0)
    else:
        fused = rc.activation_recurrence_forward(rc.InputProjection(xt, params[0], bias_vec), params[1], h0,
                                                 relu=kind == "rnn_relu")
        read = rc.activation_recurrence_forward(gemm, params[1], h0, relu=kind == "rnn_relu")
    tol = 1e-13 if dtype == torch.float64 else 2e-6
    for a, b in zip(fused, read):
        assert a.shape == b.shape and rel_err(a, b) <= tol
    (out, state), _ = plan.forward(x, hx)
    with torch.no_grad():
        want_out, want_state = m(x, hx)
    assert rel_err(out, want_out) <= tol
    for a, b in zip(state if isinstance(state, tuple) else (state,),
                    want_state if isinstance(want_state, tuple) else (want_state,)):
        assert rel_err(a, b) <= tol
    got = grads_of(wrap_recurrent(m, x), m, x, hx, "both")
    want = grads_of(lambda xx, hh: m(xx, hh), m, x, hx, "both")
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and rel_err(a, b) <= (1e-12 if dtype == torch.float64 else 1e-5), i


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_compiled_forward_streamed_values_equal_plain(monkeypatch, kind, dtype):
    """The tiled forwards write the chain values with non-temporal stores where they outgrow half the
    last-level cache and with plain stores below: both give the same outputs and values, bit for bit
    (full and partial tiles; the partial one goes through a scratch tile either way)."""
    pytest.importorskip("numba")
    import spscan.kernels.cpu.recurrence as rc

    T, B, I = 7, 21, 1
    m = make_module(kind, I, 6, batch_first=False, bias=True, dtype=dtype)
    x, hx = make_inputs(m, T, B, with_h0=True, dtype=dtype)
    params = [p.detach() for p in m.parameters()]
    h0 = (hx[0] if isinstance(hx, tuple) else hx)[0]
    bias_vec = params[2] + params[3] if kind != "gru" else torch.cat([params[2][:12] + params[3][:12], params[2][12:]])
    gi = rc.input_projection(x.detach(), params[0], bias_vec)

    def run():
        if kind == "lstm":
            return rc.gated_cell_forward(gi, params[1], h0, hx[1][0])
        if kind == "gru":
            return rc.reset_gated_forward(gi, params[1], params[3][12:], h0)
        return rc.activation_recurrence_forward(gi, params[1], h0, relu=False)

    results = {}
    for streamed, cache in ((True, 0), (False, 1 << 40)):
        monkeypatch.setattr(rc, "last_level_cache_bytes", lambda cache=cache: cache)
        values = run()[-1]
        assert rc._streams(values) is streamed
        results[streamed] = run()
    for a, b in zip(results[True], results[False]):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.isfinite(results[True][-1]).all()


def test_rnn_compiled_forward_saturated_and_tiny():
    """tanh at large pre-activations (the expm1 clamp) and tiny ones (no cancellation near 0); relu's NaN."""
    pytest.importorskip("numba")
    for scale in (60.0, 1e-6):
        m = make_module("rnn_tanh", 2, 5, batch_first=False, bias=True)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(scale)
        x, hx = make_inputs(m, 20, 3, with_h0=True, dtype=torch.float64)
        x = x * scale
        (out, h_n), _ = plan_recurrent(m, x).forward(x, hx)
        with torch.no_grad():
            want_out, want_h = m(x, hx)
        for a, b in ((out, want_out), (h_n, want_h)):
            assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-13 * b.abs().max() + 1e-300
        want = grads_of(m, m, x, hx, "both")
        got = grads_of(wrap_recurrent(m, x), m, x, hx, "both")
        for i, (a, b) in enumerate(zip(got, want)):
            assert rel_err(a, b) <= 1e-9, (scale, i)
    m = make_module("rnn_relu", 2, 5, batch_first=False, bias=True)
    x, hx = make_inputs(m, 6, 2, with_h0=True, dtype=torch.float64)
    x[2, 1, 0] = float("nan")
    (out, _), _ = plan_recurrent(m, x).forward(x, hx)
    with torch.no_grad():
        want_out, _ = m(x, hx)
    assert torch.equal(out.isnan(), want_out.isnan()) and out.isnan().any()
    keep = ~want_out.isnan()
    assert (out[keep] - want_out[keep]).abs().max() <= 1e-13 * want_out[keep].abs().max()


@pytest.mark.parametrize("np_dtype", ["float64", "float32"])
def test_compiled_expm1_within_a_few_ulp(np_dtype):
    """The vectorizable expm1 behind the compiled sigmoid/tanh against a float64 (resp. extended) reference."""
    pytest.importorskip("numba")
    import numpy as np

    import spscan.kernels.cpu.recurrence_steps as rs

    vexpm1 = rs.compiled()["_vexpm1_c"]
    dt = np.dtype(np_dtype).type
    itype = rs.int_type(dt)
    cst, icst = rs.expm1_consts(dt)  # float32: the shorter series
    g = np.random.default_rng(0)
    y = np.concatenate([g.uniform(-80, 80, 4000), g.uniform(-1, 1, 4000), g.uniform(-1e-6, 1e-6, 1000),
                        [0.0, -0.0, 1e-30, -1e-30, 0.34657, -0.34657, 0.5, -0.5, 80.0, -80.0]]).astype(dt)
    buf = y.copy()
    bits = np.empty(buf.shape[0], dtype=itype)
    vexpm1(buf, bits, bits.view(dt), cst, icst)
    ref = np.expm1(y.astype(np.longdouble))
    ulp = np.finfo(dt).eps
    err = np.abs(buf.astype(np.longdouble) - ref) / np.abs(ref).clip(np.finfo(dt).tiny)
    assert float(err.max()) <= 4 * ulp, float(err.max() / ulp)
    # the clamp keeps 2^k a normal number: far outside the range the result saturates, finite
    far = np.array([-1e4, 1e4 if np_dtype == "float64" else 88.0], dtype=dt)
    vexpm1(far, bits[:2], bits[:2].view(dt), cst, icst)
    assert far[0] == -1.0 and np.isfinite(far[1])


def test_lstm_changing_batch_and_length_equals_autograd():
    """One wrapper, inputs of changing batch size and length (plans cached per length): autograd's gradients."""
    m = make_module("lstm", 3, 5, batch_first=True, bias=True)
    w = wrap_recurrent(m, torch.randn(4, 7, 3, dtype=torch.float64))
    for seed, (B, T, with_h0, loss) in enumerate(((4, 7, True, "both"), (1, 7, False, "step"), (6, 1, True, "final"),
                                                  (2, 11, True, "both"), (4, 7, False, "final"))):
        x, hx = make_inputs(m, T, B, with_h0=with_h0, dtype=torch.float64, seed=seed + 10)
        want = grads_of(m, m, x, hx, loss)
        got = grads_of(w, m, x, hx, loss)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape and rel_err(a, b) <= 1e-12, (B, T, i)


@pytest.mark.parametrize("kind", ["rnn_tanh", "gru", "lstm"])
@pytest.mark.parametrize("B", [3, 16])
def test_gradient_on_the_last_output_only(kind, B):
    """An output gradient that is zero but at the last step (a loss on ``out[:, -1]``) joins the top of the
    scan, which then runs without affine terms; NaN at an earlier step is not zero and reaches the
    gradients as under autograd."""
    m = make_module(kind, 2, 5, batch_first=True, bias=True)
    x, hx = make_inputs(m, 9, B, with_h0=True, dtype=torch.float64, seed=4)
    w = wrap_recurrent(m, x)
    g = torch.zeros(B, 9, 5, dtype=torch.float64)
    g[:, -1] = torch.randn(B, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for poison in (False, True):
        if poison:
            g[1, 2, 3] = float("nan")
        res = []
        for f in (m, w):
            xi = x.detach().clone().requires_grad_(True)
            for p in m.parameters():
                p.grad = None
            f(xi, hx)[0].backward(g)
            res.append([xi.grad.clone()] + [p.grad.clone() for p in m.parameters()])
        for a, b in zip(res[1], res[0]):
            assert torch.equal(a.isnan(), b.isnan()), (kind, poison)
            fin = ~b.isnan()
            assert poison or fin.all()
            assert rel_err(a[fin], b[fin]) <= 1e-12 if fin.any() else True, (kind, poison)


@pytest.mark.parametrize("kind", ["rnn_tanh", "gru", "lstm"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_outputs_changed_in_place_do_not_change_gradients(kind, batch_first):
    """The compiled forwards write the module's output layout directly; what the backward keeps is a
    copy, so a caller changing the outputs in place (``out.mul_(2)``) gets the gradients of that."""
    m = make_module(kind, 2, 5, batch_first=batch_first, bias=True)
    x, hx = make_inputs(m, 7, 16, with_h0=True, dtype=torch.float64, seed=6)  # a full tile
    w = wrap_recurrent(m, x)
    res = []
    for f, inplace in ((m, False), (w, True)):
        xi = x.detach().clone().requires_grad_(True)
        for p in m.parameters():
            p.grad = None
        out = f(xi, hx)[0]
        if inplace:
            out.mul_(2.0)
        else:
            out = out * 2.0
        (out * out).sum().backward()
        res.append([xi.grad.clone()] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(res[1], res[0]):
        assert rel_err(a, b) <= 1e-12


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("frozen", ["weight_hh_l0", "weight_ih_l0", "bias", "all_params", "input"])
def test_only_the_gradients_needed_are_computed(kind, frozen):
    """Frozen parameters or an input without gradient: the rest equals autograd's, and the backward
    hands back nothing for what needs no gradient (its GEMMs are not run)."""
    torch.manual_seed(0)
    ref_m = CELLS[kind](3, 5, batch_first=True).double()
    m = CELLS[kind](3, 5, batch_first=True).double()
    m.load_state_dict(ref_m.state_dict())
    for mod in (ref_m, m):
        for name, p in mod.named_parameters():
            if frozen == "all_params" or name == frozen or (frozen == "bias" and name.startswith("bias")):
                p.requires_grad_(False)
    x = torch.randn(4, 9, 3, dtype=torch.float64, requires_grad=frozen != "input")
    w = wrap_recurrent(m, x)
    grads = []
    for mod in (ref_m, w):
        x.grad = None
        out = mod(x)[0]
        (out ** 2).sum().backward()
        grads.append((None if x.grad is None else x.grad.clone(),
                      {n: (None if p.grad is None else p.grad.clone()) for n, p in mod.named_parameters()}))
    (xa, pa), (xb, pb) = grads
    assert (xa is None) == (xb is None)
    if xa is not None:
        torch.testing.assert_close(xb, xa, rtol=1e-10, atol=1e-12)
    for n, g in pa.items():
        n2 = n if n in pb else "module." + n
        assert (g is None) == (pb[n2] is None), n
        if g is not None:
            torch.testing.assert_close(pb[n2], g, rtol=1e-10, atol=1e-12)
    # the plan itself returns None for what it was not asked for
    plan = w.plan
    _, saved = plan.forward(x.detach())
    r = plan.backward(saved, torch.ones(4, 9, 5, dtype=torch.float64), None, None, wanted=frozenset({"input"}))
    assert r["input"] is not None and r["weight_ih_l0"] is None and r["weight_hh_l0"] is None
    assert r["bias_ih_l0"] is None


@pytest.mark.parametrize("forward", ["sequential", "newton"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("unbatched", [False, True])
@pytest.mark.parametrize("cls,layers,bidirectional", [(nn.RNN, 1, False), (nn.GRU, 1, False), (nn.LSTM, 1, False),
                                                      (nn.LSTM, 2, False), (nn.GRU, 1, True)])
def test_outputs_are_laid_out_as_the_modules_own(cls, layers, bidirectional, unbatched, batch_first, forward):
    """Every output has the strides of the module's own (a batch-first output is a view of time-major memory
    on the CPU): dropout after the layer draws its mask into a tensor of those strides, so with the same seed
    the wrapped module and the module give the same masked output. And each is a tensor of its own, which the
    caller may change in place (autograd refuses that for a function's outputs that are views)."""
    torch.manual_seed(0)
    m = cls(3, 5, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first).double()
    x = torch.randn(4, 7, 3, dtype=torch.float64)
    x = x[0] if unbatched else x
    w = spscan.wrap(copy.deepcopy(m), x, backward="scan", forward=forward)
    got, want = w(x.clone().requires_grad_()), m(x.clone().requires_grad_())
    def flat(o):
        return [o[0], *(o[1] if isinstance(o[1], tuple) else (o[1],))]

    for a, b in zip(flat(got), flat(want)):
        assert a.stride() == b.stride() and torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    drop = nn.Dropout(0.5)
    torch.manual_seed(1)
    a = drop(got[0])
    torch.manual_seed(1)
    assert torch.allclose(a, drop(want[0]), rtol=1e-12, atol=1e-14)
    grads = []
    for f, inplace in ((w, True), (m, False)):
        xi = x.clone().requires_grad_()
        out = f(xi)[0]
        out = out.mul_(2.0) if inplace else out * 2.0
        (out * out).sum().backward()
        grads.append(xi.grad)
    assert torch.allclose(grads[0], grads[1], rtol=1e-10, atol=1e-14)
