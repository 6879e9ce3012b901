"""The GRU's one-pass compiled CPU forward (:func:`spscan.kernels.cpu.recurrence.reset_gated_forward`) and the
wrapper around it.

The forward is compared with ``nn.GRU``'s own (float64 to a few units in the last place, float32 to
float32 rounding), its saved chain values with those of the module path (the module's forward and
the batched recomputation of the gates), and every gradient with float64 autograd.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spscan.kernels.cpu.recurrence as rc
from spscan.recurrent.plan import plan_recurrent
from spscan.recurrent.wrapper import wrap_recurrent

needs_numba = pytest.mark.skipif(not rc.available(), reason="numba not installed")

SHAPES = {  # name: (T, B, batch_first, unbatched)
    "batched": (13, 3, False, False),
    "batch_first": (13, 3, True, False),
    "unbatched": (13, 1, False, True),
    "batch1": (13, 1, False, False),
    "T1": (1, 4, False, False),
    "batch1_T1": (1, 1, True, False),
    "even_T": (8, 2, False, False),
    # the forward in tiles of LANES samples: one partial tile, one full, full + partial
    "tile8": (9, 8, False, False),
    "tile16": (11, 16, True, False),
    "tile20": (7, 20, False, False),
}


def make_gru(input_size: int, hidden: int, *, batch_first: bool, bias: bool, dtype, seed: int = 0) -> nn.GRU:
    torch.manual_seed(seed)
    return nn.GRU(input_size, hidden, batch_first=batch_first, bias=bias).to(dtype)


def make_inputs(m: nn.GRU, T: int, B: int, *, unbatched: bool, with_h0: bool, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    if unbatched:
        shape = (T, m.input_size)
    else:
        shape = (B, T, m.input_size) if m.batch_first else (T, B, m.input_size)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if not with_h0:
        return x, None
    hshape = (1, m.hidden_size) if unbatched else (1, B, m.hidden_size)
    return x, (0.5 * torch.randn(hshape, generator=g, dtype=torch.float64)).to(dtype)


def loss_of(out: torch.Tensor, h_n: torch.Tensor, loss: str, batch_first: bool, unbatched: bool, seed: int = 2):
    """Random linear functionals: of every output (``"every"``), of the last output only (``"last"``,
    through ``output``, not ``h_n``), of ``h_n`` (``"final"``) or of every output and ``h_n`` (``"both"``)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(t):
        return torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.dtype)

    if loss == "last":
        last = out[-1] if (unbatched or not batch_first) else out[:, -1]
        return (last * rnd(last)).sum()
    total = out.sum() * 0.0
    if loss in ("every", "both"):
        total = total + (out * rnd(out)).sum()
    if loss in ("final", "both"):
        total = total + (h_n * rnd(h_n)).sum()
    return total


def grads(f, m: nn.GRU, x: torch.Tensor, hx, loss: str) -> list[torch.Tensor]:
    """``[output, h_n, dx, (dh0), d params...]`` of ``loss_of(f(x, hx))``."""
    x = x.detach().clone().requires_grad_(True)
    leaves = [x]
    if hx is not None:
        hx = hx.detach().clone().requires_grad_(True)
        leaves.append(hx)
    for p in m.parameters():
        p.grad = None
    out, h_n = f(x, hx)
    loss_of(out, h_n, loss, m.batch_first, x.dim() == 2).backward()
    res = [out, h_n] + [leaf.grad for leaf in leaves] + [p.grad for p in m.parameters()]
    return [r.detach().clone() for r in res]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def _no_compiled_forward(monkeypatch):
    monkeypatch.setattr(rc, "available", lambda: False)


# --------------------------------------------------------------------------- the forward


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("with_h0", [True, False])
def test_gru_compiled_forward_equals_module(monkeypatch, dtype, shape, bias, with_h0):
    """Outputs and ``h_n`` equal ``nn.GRU``'s to rounding; the saved chain values and ``dn`` equal the module
    path's (the module's forward and the batched recomputation of the gates)."""
    T, B, batch_first, unbatched = SHAPES[shape]
    m = make_gru(3, 6, batch_first=batch_first, bias=bias, dtype=dtype)
    x, hx = make_inputs(m, T, B, unbatched=unbatched, with_h0=with_h0, dtype=dtype)
    plan = plan_recurrent(m, x)
    assert plan._compiled_forward_applies(x, hx)
    (out, h_n), saved = plan.forward(x, hx)
    with torch.no_grad():
        want_out, want_h = m(x, hx)
    # float64: a few units in the last place; float32: float32 rounding (~2^-23 per operation, a few steps)
    tol = 4e-15 if dtype == torch.float64 else 2e-6
    for a, b in ((out, want_out), (h_n, want_h)):
        assert a.shape == b.shape and a.dtype == b.dtype and rel_err(a, b) <= tol, (rel_err(a, b), tol)
    assert out.stride() == want_out.stride()  # laid out as the module lays its output out
    _no_compiled_forward(monkeypatch)
    assert not plan._compiled_forward_applies(x, hx)
    (ref_out, _), ref_saved = plan.forward(x, hx)
    assert torch.equal(ref_out, want_out)  # the fallback is the module's own forward
    assert len(saved.values) == len(ref_saved.values) == 3 * T
    for i, (a, b) in enumerate(zip(saved.values, ref_saved.values)):
        assert a.shape == b.shape and a.dtype == b.dtype and rel_err(a, b) <= 4 * tol, (i, rel_err(a, b))
    assert rel_err(saved.coefs["dn"], ref_saved.coefs["dn"]) <= 4 * tol
    assert torch.equal(saved.h_prev[0], ref_saved.h_prev[0]) and rel_err(saved.h_prev, ref_saved.h_prev) <= tol


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gru_compiled_forward_long_sequence(dtype):
    """No drift over many steps: T = 300, the float32 forward as close to float64's as the module's float32 is."""
    m64 = make_gru(2, 16, batch_first=False, bias=True, dtype=torch.float64)
    x64, h64 = make_inputs(m64, 300, 5, unbatched=False, with_h0=True, dtype=torch.float64)
    with torch.no_grad():
        want, _ = m64(x64, h64)
    m = make_gru(2, 16, batch_first=False, bias=True, dtype=dtype)
    x, hx = x64.to(dtype), h64.to(dtype)
    (out, _), _ = plan_recurrent(m, x).forward(x, hx)
    if dtype == torch.float64:
        assert rel_err(out, want) <= 1e-14
    else:
        with torch.no_grad():
            mod32, _ = m(x, hx)
        assert rel_err(out, want) <= 2 * rel_err(mod32, want) + 1e-7


@needs_numba
def test_gru_compiled_forward_saturated_and_tiny():
    """Large pre-activations (saturated gates, the expm1 clamp) and tiny ones (tanh, sigmoid near 0)."""
    for scale in (60.0, 1e-6):
        m = make_gru(2, 5, batch_first=False, bias=True, dtype=torch.float64)
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(scale)
        x, hx = make_inputs(m, 20, 3, unbatched=False, with_h0=True, dtype=torch.float64)
        x = x * scale
        plan = plan_recurrent(m, x)
        assert plan._compiled_forward_applies(x, hx)
        (out, h_n), _ = plan.forward(x, hx)
        with torch.no_grad():
            want_out, want_h = m(x, hx)
        for a, b in ((out, want_out), (h_n, want_h)):
            assert torch.isfinite(a).all() and (a - b).abs().max() <= 1e-13 * b.abs().max() + 1e-300
        want = grads(m, m, x, hx, "both")
        got = grads(wrap_recurrent(m, x), m, x, hx, "both")
        for i, (a, b) in enumerate(zip(got, want)):
            assert rel_err(a, b) <= 1e-9, (scale, i)


@needs_numba
@pytest.mark.parametrize("B", [2, 16])
def test_gru_compiled_forward_nan_and_inf(B):
    """A NaN input spreads through its sample as in the module (the expm1 clamp does not hide it); an infinite
    one saturates the gates the same way (B = 16: the tiled forward)."""
    m = make_gru(2, 4, batch_first=False, bias=True, dtype=torch.float64)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x, hx = make_inputs(m, 6, B, unbatched=False, with_h0=True, dtype=torch.float64)
        x[2, 1, 0] = bad
        plan = plan_recurrent(m, x)
        assert plan._compiled_forward_applies(x, hx)
        (out, _), _ = plan.forward(x, hx)
        with torch.no_grad():
            want, _ = m(x, hx)
        assert torch.equal(out.isnan(), want.isnan()) and (want.isnan().any() == (bad != bad))
        keep = ~want.isnan()
        assert (out[keep] - want[keep]).abs().max() <= 1e-14 * want[keep].abs().max()


@needs_numba
def test_gru_forward_refuses_bad_arguments():
    gi = torch.zeros(3, 2, 12, dtype=torch.float64)
    w = torch.zeros(12, 4, dtype=torch.float64)
    h0 = torch.zeros(2, 4, dtype=torch.float64)
    hs, d, dn = rc.reset_gated_forward(gi, w, None, h0)
    assert hs.shape == (3, 2, 4) and d.shape == (3, 2, 16) and dn.shape == (3, 2, 4)
    # zero weights: r = z = 1/2, n = 0, h stays 0; dz = (h - n) z (1 - z) = 0, dn = 1/2, dm = 1/4
    assert torch.equal(hs, torch.zeros_like(hs)) and torch.all(d[..., 12:] == 0.5) and torch.all(dn == 0.5)
    assert torch.all(d[..., 8:12] == 0.25) and torch.all(d[..., :8] == 0)
    with pytest.raises(TypeError, match="reset_gated_forward.*float32/float64"):
        rc.reset_gated_forward(gi.float(), w, None, h0)
    with pytest.raises(TypeError, match="b_hn torch.float32"):
        rc.reset_gated_forward(gi, w, torch.zeros(4), h0)
    with pytest.raises(ValueError, match=r"w_hh \(3H, H\).*w_hh \(12, 5\)"):
        rc.reset_gated_forward(gi, torch.zeros(12, 5, dtype=torch.float64), None, h0)
    with pytest.raises(ValueError, match=r"b_hn \(5,\)"):
        rc.reset_gated_forward(gi, w, torch.zeros(5, dtype=torch.float64), h0)


# --------------------------------------------------------------------------- gradients


CASES = [  # (shape, bias, with_h0, loss)
    ("batched", True, True, "every"),
    ("batched", True, False, "last"),
    ("batch_first", True, True, "last"),
    ("batch_first", False, False, "every"),
    ("unbatched", True, True, "both"),
    ("unbatched", False, False, "last"),
    ("batch1", True, True, "every"),
    ("batch1", False, True, "final"),
    ("T1", True, True, "both"),
    ("T1", False, False, "last"),
    ("batch1_T1", True, True, "every"),
    ("even_T", True, False, "final"),
    ("batched", False, True, "both"),
    ("tile16", True, True, "every"),
    ("tile20", False, True, "last"),
    ("tile8", True, False, "both"),
]


@pytest.mark.parametrize("shape,bias,with_h0,loss", CASES)
def test_gru_gradients_equal_autograd_float64(shape, bias, with_h0, loss):
    """Input, ``h_0`` and every parameter gradient equal float64 autograd's (whichever forward runs)."""
    T, B, batch_first, unbatched = SHAPES[shape]
    m = make_gru(3, 6, batch_first=batch_first, bias=bias, dtype=torch.float64)
    x, hx = make_inputs(m, T, B, unbatched=unbatched, with_h0=with_h0, dtype=torch.float64)
    w = wrap_recurrent(m, x)
    assert w.plan._compiled_forward_applies(x, hx) == rc.available()
    want = grads(m, m, x, hx, loss)
    got = grads(w, m, x, hx, loss)
    assert len(got) == len(want) == 3 + (hx is not None) + (4 if bias else 2)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        assert rel_err(a, b) <= 1e-12, (i, rel_err(a, b))


@pytest.mark.parametrize("shape,bias,with_h0,loss", [c for c in CASES if c[0] in ("batched", "batch_first", "T1")])
def test_gru_gradients_float32_within_autograd_error(shape, bias, with_h0, loss):
    """float32: against float64 autograd, at most twice float32 autograd's own error (plus a rounding floor)."""
    T, B, batch_first, unbatched = SHAPES[shape]
    m64 = make_gru(3, 6, batch_first=batch_first, bias=bias, dtype=torch.float64)
    x64, h64 = make_inputs(m64, T, B, unbatched=unbatched, with_h0=with_h0, dtype=torch.float64)
    want = grads(m64, m64, x64, h64, loss)
    m = make_gru(3, 6, batch_first=batch_first, bias=bias, dtype=torch.float32)
    x, hx = x64.float(), (None if h64 is None else h64.float())
    auto32 = grads(m, m, x, hx, loss)
    got = grads(wrap_recurrent(m, x), m, x, hx, loss)
    for i, (a, b, r) in enumerate(zip(got, auto32, want)):
        assert a.dtype == torch.float32
        bound = 2 * (b.double() - r).abs().max().item() + 1e-6 * max(r.abs().max().item(), 1.0)
        assert (a.double() - r).abs().max().item() <= bound, (i, (a.double() - r).abs().max().item(), bound)


@settings(max_examples=15)
@given(T=st.integers(1, 9), B=st.integers(1, 4), I=st.integers(1, 4), H=st.integers(1, 7), bias=st.booleans(),
       batch_first=st.booleans(), with_h0=st.booleans(), loss=st.sampled_from(["every", "last", "final", "both"]))
def test_gru_gradients_equal_autograd_any_shape(T, B, I, H, bias, batch_first, with_h0, loss):
    """Sizes down to 1 x 1 (H = 1: every block a single unit): outputs and every gradient equal float64 autograd's."""
    m = make_gru(I, H, batch_first=batch_first, bias=bias, dtype=torch.float64)
    x, hx = make_inputs(m, T, B, unbatched=False, with_h0=with_h0, dtype=torch.float64)
    want = grads(m, m, x, hx, loss)
    got = grads(wrap_recurrent(m, x), m, x, hx, loss)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-12, (i, rel_err(a, b))


def test_gru_repeated_backward_and_steps():
    """``retain_graph`` backwards accumulate exactly twice the gradients; two steps are bitwise identical."""
    m = make_gru(3, 5, batch_first=True, bias=True, dtype=torch.float64)
    x, hx = make_inputs(m, 9, 4, unbatched=False, with_h0=True, dtype=torch.float64)
    w = wrap_recurrent(m, x)
    x = x.clone().requires_grad_(True)
    out, h_n = w(x, hx)
    loss = loss_of(out, h_n, "both", True, False)
    loss.backward(retain_graph=True)
    first = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    loss.backward()
    for a, p in zip(first, [x] + list(m.parameters())):
        assert torch.allclose(p.grad, 2 * a, rtol=1e-14, atol=0)
    one = grads(w, m, x, hx, "both")
    two = grads(w, m, x, hx, "both")
    for a, b in zip(one, two):
        assert torch.equal(a, b)
    want = grads(m, m, x, hx, "both")
    for i, (a, b) in enumerate(zip(one, want)):
        assert rel_err(a, b) <= 1e-12, i


# --------------------------------------------------------------------------- when the compiled pass does not apply


@pytest.mark.parametrize("case", ["no_numba", "materialized", "h0_other_dtype", "newton"])
def test_gru_fallback_paths_equal_autograd(monkeypatch, case):
    """Where the compiled pass does not apply the module's own forward (or Newton's) runs, with the same gradients."""
    m = make_gru(3, 6, batch_first=False, bias=True, dtype=torch.float64)
    x, hx = make_inputs(m, 11, 3, unbatched=False, with_h0=True, dtype=torch.float64)
    kw = {}
    if case == "no_numba":
        _no_compiled_forward(monkeypatch)
    elif case == "materialized":
        kw["layout"] = "materialized"
    elif case == "newton":
        kw["forward"] = "newton"
    w = wrap_recurrent(m, x, **kw)
    if case == "h0_other_dtype":
        # a float32 h0 for a float64 module: not the compiled pass; the module's own check refuses it
        assert not w.plan._compiled_forward_applies(x, hx.float())
        with pytest.raises(RuntimeError):
            w(x.requires_grad_(True), hx.float())
        return
    if case != "newton":  # Newton's forward does not go through the compiled pass either way
        assert not w.plan._compiled_forward_applies(x, hx)
    want = grads(m, m, x, hx, "both")
    got = grads(w, m, x, hx, "both")
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and rel_err(a, b) <= (1e-9 if case == "newton" else 1e-12), (case, i, rel_err(a, b))


def test_gru_no_grad_forward_is_the_module_forward():
    """Without anything needing a gradient nothing is saved and the module's own forward runs."""
    m = make_gru(3, 6, batch_first=True, bias=True, dtype=torch.float64)
    x, hx = make_inputs(m, 7, 2, unbatched=False, with_h0=True, dtype=torch.float64)
    w = wrap_recurrent(m, x)
    with torch.no_grad():
        out, h_n = w(x, hx)
        want_out, want_h = m(x, hx)
    assert torch.equal(out, want_out) and torch.equal(h_n, want_h)
