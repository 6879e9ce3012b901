"""The recurrent layers' weight and bias gradients from the compiled forwards' feature-major operands (``prev``:
rows ``h_{t-1}``, ``x_t``, ones) in one GEMM per side, against the GEMMs over the saved states, and against
float64 autograd.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spscan.recurrent.plan as rec
import spscan.kernels.cpu.recurrence as rc
from spscan.recurrent.wrapper import wrap_recurrent

pytestmark = pytest.mark.skipif(not rc.available(), reason="numba not installed")


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,batch_first", [(3, False), (16, True), (21, False), (21, True)])
def test_forward_writes_previous_states_feature_major(kind, dtype, B, batch_first):
    """``prev[:H, t] = h_{t-1}^T`` from every forward (tiles: full, partial; the per-sample loop below
    TILE_MIN_BATCH); rows past ``H`` untouched."""
    T, H, I = 9, 6, 2
    g = torch.Generator().manual_seed(B)
    x = torch.randn(T, B, I, generator=g, dtype=dtype)
    h0 = torch.randn(B, H, generator=g, dtype=dtype)
    G = {"lstm": 4, "gru": 3, "rnn_tanh": 1}[kind] * H
    w_ih = torch.randn(G, I, generator=g, dtype=dtype) / 2
    w_hh = torch.randn(G, H, generator=g, dtype=dtype) / 3
    gi = rc.input_projection(x, w_ih, None)
    prev = torch.full((H + 2, T, B), 7.0, dtype=dtype)
    if kind == "lstm":
        hs = rc.gated_cell_forward(gi, w_hh, h0, torch.zeros(B, H, dtype=dtype), batch_first, prev=prev)[0]
    elif kind == "gru":
        hs = rc.reset_gated_forward(gi, w_hh, None, h0, batch_first, prev=prev)[0]
    else:
        hs = rc.activation_recurrence_forward(gi, w_hh, h0, False, batch_first, prev=prev)[0]
    tm = hs.transpose(0, 1) if batch_first else hs
    expect = torch.cat([h0.unsqueeze(0), tm[:-1]]).permute(2, 0, 1)
    assert torch.equal(prev[:H], expect)
    assert (prev[H:] == 7).all()
    with pytest.raises(ValueError, match="prev"):
        rc.activation_recurrence_forward(rc.input_projection(x, torch.randn(H, I, dtype=dtype), None),
                                         torch.randn(H, H, dtype=dtype), h0, False,
                                         prev=torch.empty(H - 1, T, B, dtype=dtype))


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B", [3, 16, 21, 28])
@pytest.mark.parametrize("bias", [True, False])
def test_wrapper_gradients_equal_the_gemm_path(monkeypatch, kind, dtype, B, bias):
    """The wrapped layer's parameter gradients by each path agree: one GEMM against the compiled forward's
    operands (with and without the input's gradient; batches that fill the scan's tiles or not), and the
    GEMMs against the saved states (:func:`~spscan.recurrent.backward.weight_grad`)."""
    torch.manual_seed(0)
    cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN}[kind]
    m = cls(3, 7, batch_first=True, bias=bias).to(dtype)
    x = torch.randn(B, 11, 3, dtype=dtype)
    w = wrap_recurrent(m, x)
    calls = []
    real = rec.operand_weight_grads
    monkeypatch.setattr(rec, "operand_weight_grads", lambda *a: calls.append(1) or real(*a))

    def grads(input_grad: bool):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(input_grad)
        out, _ = w(xi)
        (out.sin() * torch.linspace(-1, 1, 7, dtype=dtype)).sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    paths = {"operands": grads(False)}
    assert calls
    assert all(g.is_contiguous() for g in paths["operands"].values())
    calls.clear()
    paths["operands, input"] = grads(True)
    assert calls
    monkeypatch.setattr(rec, "has_operands", lambda *a: False)
    calls.clear()
    paths["gemm"] = grads(False)
    assert not calls
    # float32: sums over T * B = 308 products in another order (rounding up to ~300 * 6e-8 of their size)
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-5, atol=2e-5)
    for name, got in paths.items():
        assert got.keys() == paths["gemm"].keys()
        for n in got:
            torch.testing.assert_close(got[n], paths["gemm"][n], **tol, msg=lambda e: f"{name} {n}: {e}")
    if bias and kind != "gru":  # separate tensors (an optimizer may update them in place, one after the other)
        assert paths["operands"]["bias_ih_l0"].data_ptr() != paths["operands"]["bias_hh_l0"].data_ptr()


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["lstm", "gru", "rnn_tanh", "rnn_relu"]), T=st.integers(1, 80), B=st.integers(1, 40),
       H=st.integers(1, 9), I=st.integers(1, 6), batch_first=st.booleans(), bias=st.booleans(),
       input_grad=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_parameter_gradients_equal_autograd_float64(kind, T, B, H, I, batch_first, bias, input_grad, seed):
    """The parameter gradients (partial tiles, one-step sequences, with and without the input's gradient)
    against float64 autograd, with a loss on every output and on h_n, a changing batch size in the same
    wrapper."""
    torch.manual_seed(seed)
    cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN, "rnn_relu": nn.RNN}[kind]
    kw = {"nonlinearity": kind[4:]} if kind.startswith("rnn") else {}
    ref = cls(I, H, batch_first=batch_first, bias=bias, **kw).double()
    m = cls(I, H, batch_first=batch_first, bias=bias, **kw).double()
    m.load_state_dict(ref.state_dict())
    w = None
    for b in (B, max(1, B // 2)):
        g = torch.Generator().manual_seed(seed + b)
        x = torch.randn((b, T, I) if batch_first else (T, b, I), generator=g, dtype=torch.float64)
        proj = torch.randn(H, generator=g, dtype=torch.float64)
        if w is None:
            w = wrap_recurrent(m, x)
        grads = []
        for mod in (ref, w):
            mod.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(input_grad)
            out, state = mod(xi)
            h_n = state[0] if kind == "lstm" else state
            ((out * proj).sin().sum() + (h_n ** 2).sum()).backward()
            grads.append([p.grad for p in mod.parameters()] + ([xi.grad] if input_grad else []))
        for a, b_ in zip(*grads):
            torch.testing.assert_close(b_, a, rtol=1e-10, atol=1e-12)
