"""Shared checks for the layer library: a unit against torch.func.jacrev and autograd (float64)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn

from spscan.layers import LayerUnit, make_unit


def build_unit(module: nn.Module, x: torch.Tensor, prune_zeros: bool = False) -> LayerUnit:
    """The unit of ``module`` for per-sample input shape ``x.shape[1:]``."""
    with torch.no_grad():
        y = module(x[:1])
    return make_unit(0, module, tuple(x.shape[1:]), tuple(y.shape[1:]), prune_zeros=prune_zeros)


def dense_jt(module: nn.Module, x1: torch.Tensor) -> np.ndarray:
    """``J^T`` ``(d_in, d_out)`` of ``module`` at one sample ``x1`` (per-sample shape), by jacrev."""
    f = lambda v: module(v.reshape((1,) + tuple(x1.shape))).reshape(-1)  # noqa: E731
    return torch.func.jacrev(f)(x1.reshape(-1).detach()).detach().T.numpy()


def filled(unit: LayerUnit, values: torch.Tensor, b: int) -> np.ndarray:
    v = values if values.dim() == 1 else values[b]
    p = unit.pattern
    return sp.csr_array((v.detach().numpy(), p.indices, p.indptr), shape=p.shape).toarray()


def assert_canonical(unit: LayerUnit) -> None:
    p = unit.pattern
    assert isinstance(p, sp.csr_array)
    assert p.shape == (unit.d_in, unit.d_out)
    q = p.copy()
    q.sum_duplicates()
    assert q.nnz == p.nnz, "duplicate entries"
    assert p.has_sorted_indices
    assert np.all(np.diff(p.indptr) >= 0)


def check_values(module: nn.Module, x: torch.Tensor, unit: Optional[LayerUnit] = None,
                 tol: float = 1e-12) -> LayerUnit:
    """Pattern canonical, forward equal to the module's, values equal jacrev's J^T, and every
    jacrev non-zero inside the pattern, for each sample of ``x`` (float64)."""
    unit = unit or build_unit(module, x)
    assert_canonical(unit)
    with torch.no_grad():
        y_ref = module(x)
        y, saved = unit.run(x, [t.detach() for t in unit.tensors()])
        values = unit.fill(saved, [t.detach() for t in unit.tensors()])
    assert torch.equal(y, y_ref)
    assert values.shape == ((unit.nnz,) if unit.shared else (x.shape[0], unit.nnz))
    pat = unit.pattern.toarray() != 0
    for b in range(x.shape[0]):
        jt = dense_jt(module, x[b])
        outside = (jt != 0) & ~pat
        assert not outside.any(), f"jacrev non-zero outside the pattern at {np.argwhere(outside)[:3]}"
        err = np.abs(filled(unit, values, b) - jt).max(initial=0.0)
        assert err <= tol, f"values differ from jacrev by {err}"
    return unit


def jacobian_support(module: nn.Module, xs: torch.Tensor) -> np.ndarray:
    """Union over the samples of ``xs`` of the jacrev non-zeros of ``J^T`` (boolean, dense)."""
    acc = None
    for b in range(xs.shape[0]):
        nz = dense_jt(module, xs[b]) != 0
        acc = nz if acc is None else (acc | nz)
    return acc


def assert_no_guaranteed_zeros(unit: LayerUnit, support: np.ndarray) -> None:
    """Every pattern entry is non-zero for some input: the pattern equals the observed support."""
    pat = unit.pattern.toarray() != 0
    extra = pat & ~support
    assert not extra.any(), f"pattern entries never non-zero: {np.argwhere(extra)[:3]}"
    assert not (support & ~pat).any()


def check_param_grads(module: nn.Module, unit: LayerUnit, x: torch.Tensor, seed: int = 0,
                      tol: float = 1e-12) -> None:
    """The unit's dl/dθ (w.r.t. its effective tensors) equals autograd's for a random dl/dy."""
    tensors = [t.detach().clone().requires_grad_(True) for t in unit.tensors()]
    if not tensors:
        return
    y_ag, _ = unit.run(x, tensors)  # run with graph: differentiable in the effective tensors
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(y_ag.shape, generator=gen, dtype=y_ag.dtype)
    ref = torch.autograd.grad(y_ag, tensors, g)
    with torch.no_grad():
        _, saved = unit.run(x, [t.detach() for t in tensors])
        got = unit.param_grads(saved, [t.detach() for t in tensors], g.reshape(g.shape[0], -1))
    for role, a, b in zip(unit.roles, got, ref):
        scale = max(1.0, float(b.abs().max()))
        err = float((a - b).abs().max())
        assert err <= tol * scale, f"{role}: param grad differs by {err}"


def run_errors(fn, exc, *words: str) -> None:
    """``fn()`` raises ``exc`` whose message contains every word."""
    try:
        fn()
    except exc as e:  # noqa: PERF203
        msg = str(e)
        for w in words:
            assert w in msg, f"{w!r} not in {msg!r}"
        return
    raise AssertionError(f"expected {exc.__name__}")


def seq(*shape: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


__all__: Sequence[str] = [
    "build_unit", "dense_jt", "filled", "check_values", "jacobian_support",
    "assert_no_guaranteed_zeros", "check_param_grads", "run_errors", "seq", "assert_canonical",
]
