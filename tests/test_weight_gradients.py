"""The recurrent layers' weight and bias gradients in one compiled pass (:func:`spscan.recurrent_cpu.weight_gradients`).

Compared with float64 products of the same operands; then through the wrappers, where the compiled
pass must give what the BLAS GEMMs give.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spscan.recurrent as rec
import spscan.recurrent_cpu as rc
from spscan.recurrent import wrap_recurrent

needs_numba = pytest.mark.skipif(not rc.available(), reason="numba not installed")
pytestmark = needs_numba


def _reference(a, z1, z2):
    cols = [z1] + ([] if z2 is None else [z2]) + [torch.ones(a.shape[1], 1, dtype=a.dtype)]
    return a.double() @ torch.cat(cols, 1).double()


def _check(a, z1, z2, dtype):
    out = rc.weight_gradients(a, z1, z2)
    ref = _reference(a, z1, z2)
    assert out.dtype == dtype and out.shape == ref.shape
    # float32: sums of N products, each rounded, accumulated in float32 in blocks of a chunk
    rtol = 1e-12 if dtype == torch.float64 else 2e-5
    scale = (a.double().abs() @ torch.cat(
        [z1.abs()] + ([] if z2 is None else [z2.abs()]) + [torch.ones(a.shape[1], 1, dtype=a.dtype)], 1).double())
    assert ((out.double() - ref).abs() <= rtol * scale + 1e-30).all()
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("M,N,K1,K2", [
    (80, 16000, 20, 1),  # the paper's LSTM at T = 1000, B = 16: whole blocks, chunks, tail-free
    (7, 37, 3, 0),  # edge rows and columns, a partial last vector
    (9, 1043, 17, 2),  # a full 16-column transpose plus one by one; chunk and tail
    (1, 5, 1, 1),  # one row, fewer positions than a vector
    (4, 16, 4, 0),  # one block, one vector
    (12, 2049, 33, 5),  # two 16-column transposes; two chunks and a tail of one
    (5, 0, 2, 1),  # no positions: zeros
])
def test_equals_float64_products(dtype, M, N, K1, K2):
    g = torch.Generator().manual_seed(M * 1000 + N)
    a = torch.randn(M, N, generator=g, dtype=torch.float64).to(dtype)
    z1 = torch.randn(N, K1, generator=g, dtype=torch.float64).to(dtype)
    z2 = torch.randn(N, K2, generator=g, dtype=torch.float64).to(dtype) if K2 else None
    out = _check(a, z1, z2, dtype)
    assert torch.equal(out, rc.weight_gradients(a, z1, z2))  # fixed order: bitwise run to run


@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 13), N=st.integers(1, 3000), K1=st.integers(1, 35), K2=st.integers(0, 3),
       pad=st.integers(0, 40), f64=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_fuzzed_sizes_and_row_strides(M, N, K1, K2, pad, f64, seed):
    """Rows of ``a`` any distance apart (a view of wider memory, as a caller's buffer may be);
    non-contiguous ``z`` are copied."""
    dtype = torch.float64 if f64 else torch.float32
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, N + pad, generator=g, dtype=dtype)[:, pad:]
    z1 = torch.randn(K1, N, generator=g, dtype=dtype).t()  # non-contiguous
    z2 = torch.randn(N, K2, generator=g, dtype=dtype) if K2 else None
    _check(a, z1, z2, dtype)


def test_non_finite_values_propagate():
    a = torch.ones(4, 40)
    z = torch.ones(40, 2)
    a[1, 3] = float("nan")
    z[7, 0] = float("inf")
    out = rc.weight_gradients(a, z)
    assert out[1].isnan().all()
    assert out[0, 0] == float("inf") and out[0, 1] == 40 and out[0, 2] == 40


def test_bad_input_is_refused():
    a = torch.randn(6, 20)
    with pytest.raises(TypeError, match="float32/float64"):
        rc.weight_gradients(a.double(), torch.randn(20, 3))
    with pytest.raises(TypeError, match="float32/float64"):
        rc.weight_gradients(a.half(), torch.randn(20, 3).half())
    with pytest.raises(ValueError, match="contiguous rows"):
        rc.weight_gradients(torch.randn(20, 6).t(), torch.randn(20, 3))
    with pytest.raises(ValueError, match="z1"):
        rc.weight_gradients(a, torch.randn(19, 3))
    with pytest.raises(ValueError, match="z2"):
        rc.weight_gradients(a, torch.randn(20, 3), torch.randn(20))


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B", [3, 16, 21])
def test_wrapper_gradients_equal_the_gemm_path(monkeypatch, kind, dtype, B):
    """The wrapped layer's parameter gradients by the compiled pass and by the BLAS GEMMs agree (the
    GEMM path is what runs without numba or off CPU), and the compiled pass is the one taken."""
    torch.manual_seed(0)
    cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn_tanh": nn.RNN}[kind]
    m = cls(3, 7, batch_first=True).to(dtype)
    x = torch.randn(B, 11, 3, dtype=dtype)
    w = wrap_recurrent(m, x)
    calls = []
    real = rc.weight_gradients
    monkeypatch.setattr(rc, "weight_gradients", lambda *a: calls.append(1) or real(*a))

    def grads():
        m.zero_grad(set_to_none=True)
        out, _ = w(x)
        (out.sin() * torch.linspace(-1, 1, 7, dtype=dtype)).sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    compiled = grads()
    assert calls and all(g.is_contiguous() for g in compiled.values())
    monkeypatch.setattr(rec, "_weight_grads_compile", lambda *a: False)
    calls.clear()
    gemm = grads()
    assert not calls
    tol = dict(rtol=1e-12, atol=1e-13) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    for n in gemm:
        torch.testing.assert_close(compiled[n], gemm[n], **tol)
    # the biases are separate tensors (the optimizer may update them in place, one after the other)
    if kind != "gru":
        assert compiled["bias_ih_l0"].data_ptr() != compiled["bias_hh_l0"].data_ptr()
