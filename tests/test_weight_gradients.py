"""The recurrent layers' weight and bias gradients in one compiled pass (:func:`spscan.kernels.cpu.nt.matmul_nt`),
and the forwards' feature-major operands they read (``prev``).

Compared with float64 products of the same operands; then through the wrappers, where the compiled
pass must give what the BLAS GEMMs give.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spscan.recurrent.plan as rec
import spscan.kernels.cpu.recurrence as rc
from spscan.kernels.cpu import nt as cpu_nt
from spscan.kernels.backend import cpu_ops
from spscan.recurrent.wrapper import wrap_recurrent

pytestmark = pytest.mark.skipif(not rc.available(), reason="numba not installed")


def _check(a, z, rows, dtype):
    out = cpu_nt.matmul_nt(a, z, rows)
    zr = z if rows is None else z[list(rows)]
    ref = a.double() @ zr.double().t()
    assert out.dtype == dtype and out.shape == ref.shape
    # each sum within a few roundings of the magnitudes summed (lane-wise partials over chunks)
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    bound = rtol * (a.double().abs() @ zr.double().abs().t())
    assert ((out.double() - ref).abs() <= bound).all()
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("M,N,K,rows", [
    (80, 16000, 22, None),  # the paper's LSTM at T = 1000, B = 16: h_{t-1}, x_t and ones
    (7, 37, 3, None),  # edge rows and columns, a partial last vector
    (9, 1043, 20, [*range(17), 19]),  # chunks, a tail, a choice of rows (a GRU side)
    (1, 5, 2, [1]),  # one row, fewer positions than a vector
    (4, 16, 4, None),  # one block, one vector
    (12, 2049, 38, [37, 0, 5, 5]),  # several chunks, a tail of one; rows in any order, repeated
    (5, 0, 3, None),  # no positions: zeros
    (3, 40, 4, []),  # no rows: empty
])
def test_equals_float64_products(dtype, M, N, K, rows):
    g = torch.Generator().manual_seed(M * 1000 + N)
    a = torch.randn(M, N, generator=g, dtype=torch.float64).to(dtype)
    z = torch.randn(K, N, generator=g, dtype=torch.float64).to(dtype)
    out = _check(a, z, rows, dtype)
    assert torch.equal(out, cpu_nt.matmul_nt(a, z, rows))  # fixed order: bitwise run to run


def _in_order(a, z, lanes=16, chunk=512):
    """``a @ z.T`` summed in the order the compiled pass documents, elementwise in ``a``'s dtype (NumPy
    multiplies and adds, no fused multiply-add): lane ``l`` of each output sums positions ``l, l + lanes,
    ...`` of a chunk, the chunks' partials add up lane by lane, the lanes sum in order, then the positions
    past the last whole vector one by one."""
    import numpy as np

    a, z = a.numpy(), z.numpy()
    M, N = a.shape
    nv = N - N % lanes
    acc = np.zeros((M, z.shape[0], lanes), dtype=a.dtype)
    for c0 in range(0, nv, chunk):
        part = np.zeros_like(acc)
        for q in range(c0, min(c0 + chunk, nv), lanes):
            part = part + a[:, None, q:q + lanes] * z[None, :, q:q + lanes]
        acc = acc + part
    out = acc[..., 0]
    for lane in range(1, lanes):
        out = out + acc[..., lane]
    for q in range(nv, N):
        out = out + a[:, None, q] * z[None, :, q]
    return torch.from_numpy(out)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("M,N,K", [(6, 100, 97), (5, 1043, 40), (3, 31, 16), (4, 16, 17), (2, 7, 33)])
def test_sums_run_in_the_documented_order(dtype, M, N, K):
    """Bitwise the in-order sums: the outputs summed sixteen at a time across their lanes (a transpose and
    vector adds) and one at a time (the last columns) give the same bits as the scalar order."""
    g = torch.Generator().manual_seed(N * 10 + K)
    a = torch.randn(M, N, generator=g, dtype=dtype)
    z = torch.randn(K, N, generator=g, dtype=dtype)
    assert torch.equal(cpu_nt.matmul_nt(a, z), _in_order(a, z))


@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 13), N=st.integers(1, 3000), K=st.integers(1, 30), pad_a=st.integers(0, 40),
       pad_z=st.integers(0, 40), f64=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_fuzzed_sizes_and_row_strides(M, N, K, pad_a, pad_z, f64, seed):
    """Rows of either operand any distance apart (views of wider memory, as a caller's buffers are)."""
    dtype = torch.float64 if f64 else torch.float32
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, N + pad_a, generator=g, dtype=dtype)[:, pad_a:]
    z = torch.randn(K, N + pad_z, generator=g, dtype=dtype)[:, :N]
    _check(a, z, None, dtype)


def test_non_finite_values_propagate():
    a = torch.ones(4, 40)
    z = torch.ones(3, 40)
    a[1, 3] = float("nan")
    z[0, 7] = float("inf")
    out = cpu_nt.matmul_nt(a, z)
    assert out[1].isnan().all()
    assert out[0, 0] == float("inf") and out[0, 1] == 40 and out[0, 2] == 40


def test_bad_input_is_refused():
    a = torch.randn(6, 20)
    with pytest.raises(TypeError, match="float32/float64"):
        cpu_nt.matmul_nt(a.double(), torch.randn(3, 20))
    with pytest.raises(TypeError, match="float32/float64"):
        cpu_nt.matmul_nt(a.half(), torch.randn(3, 20).half())
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_nt.matmul_nt(torch.randn(20, 6).t(), torch.randn(3, 20))
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu_nt.matmul_nt(a, torch.randn(20, 3).t())
    with pytest.raises(ValueError, match="z"):
        cpu_nt.matmul_nt(a, torch.randn(3, 19))
    with pytest.raises(ValueError, match="rows"):
        cpu_nt.matmul_nt(a, torch.randn(3, 20), [0, 3])


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
    """The wrapped layer's parameter gradients by each path agree: reduced in the scan (the LSTM's and
    RNN's when the input needs no gradient and the batch fills the scan's tiles: 16 and 28 of 32 here),
    by the compiled pass over stored pre-activation gradients (the GRU's, a batch of 3 or 21, or with
    the input's gradient), and by the BLAS GEMMs (without the compiled forward)."""
    torch.manual_seed(0)
    cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN}[kind]
    m = cls(3, 7, batch_first=True, bias=bias).to(dtype)
    x = torch.randn(B, 11, 3, dtype=dtype)
    w = wrap_recurrent(m, x)
    calls = []
    real = cpu_nt.matmul_nt
    monkeypatch.setattr(cpu_nt, "matmul_nt", lambda *a: calls.append(1) or real(*a))

    def grads(input_grad: bool):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(input_grad)
        out, _ = w(xi)
        (out.sin() * torch.linspace(-1, 1, 7, dtype=dtype)).sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    paths = {"default": grads(False)}
    reduced = kind != "gru" and rec.reduce_in_scan(frozenset({"weight_hh_l0"}), B)
    assert reduced == (kind != "gru" and B in (16, 28))
    assert bool(calls) != reduced  # the LSTM and RNN reduce in the scan where the batch fills its tiles
    assert all(g.is_contiguous() for g in paths["default"].values())
    calls.clear()
    paths["stored"] = grads(True)
    assert calls
    monkeypatch.setattr(rec, "weight_grads_compile", lambda *a: False)
    monkeypatch.setattr(rec, "reduce_in_scan", lambda *a: False)
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
        assert paths["default"]["bias_ih_l0"].data_ptr() != paths["default"]["bias_hh_l0"].data_ptr()


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["lstm", "gru", "rnn_tanh", "rnn_relu"]), T=st.integers(1, 80), B=st.integers(1, 40),
       H=st.integers(1, 9), I=st.integers(1, 6), batch_first=st.booleans(), bias=st.booleans(),
       input_grad=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_parameter_gradients_equal_autograd_float64(kind, T, B, H, I, batch_first, bias, input_grad, seed):
    """Every path of the parameter gradients (reduced in the scan: partial tiles, rings cut short by the
    sequence's end; stored and passed to matmul_nt) against float64 autograd, with a loss on
    every output and on h_n, a changing batch size in the same wrapper."""
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


def test_reduction_in_the_scan_needs_a_filled_tile():
    """The weight gradients are reduced in the scan only without the input's gradient and where the batch
    fills at least three quarters of its tiles (every lane of a tile is multiplied with the operands)."""
    lanes = cpu_ops.tile_samples()
    params = frozenset({"weight_ih_l0", "weight_hh_l0"})
    assert not rec.reduce_in_scan(None, lanes) and not rec.reduce_in_scan(params | {"input"}, lanes)
    assert not rec.reduce_in_scan(frozenset({"h_0"}), lanes)
    assert rec.reduce_in_scan(params, lanes) and rec.reduce_in_scan(params, 2 * lanes)
    assert not rec.reduce_in_scan(params, 1) and not rec.reduce_in_scan(params, lanes - 1)
    assert rec.reduce_in_scan(params, lanes + lanes // 2) and not rec.reduce_in_scan(params, lanes + 1)
