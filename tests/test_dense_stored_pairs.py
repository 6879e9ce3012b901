"""Products computed from pair lists and stored densely, on both backends: each writes its own pattern's
entries at their dense positions after zeroing its block, so the gradients equal the linear scan's and
the float64 reference, whatever the arenas held before (they are reused between calls)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan
from spscan.reference import reference_backward
from test_triton_kernels import DEVICE, config_family  # noqa: F401  (the interpreter tests' fixture)


def _chain(n: int, d: int, density: float, seed: int) -> list[sp.csr_array]:
    rng = np.random.default_rng(seed)
    return [sp.csr_array((rng.random((d, d)) < density).astype(np.float64)) for _ in range(n)]


def _values(pats, shared, batch: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.nnz, generator=g, dtype=torch.float64) if s else
            torch.randn(batch, p.nnz, generator=g, dtype=torch.float64) for p, s in zip(pats, shared)]


def _check(pats, shared, levels, backend: str, device: torch.device) -> None:
    vals = _values(pats, shared, 2, seed=1)
    grad = torch.randn(2, pats[-1].shape[1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    plan = spscan.plan(pats, levels=levels, backend=backend, dtype=torch.float64)
    assert any(m.scatters for m in plan._scan.mats.values()), "the case must hold a dense-stored pair product"
    dev = lambda ts: [t.to(device) for t in ts]  # noqa: E731
    first = spscan.backward(plan, dev(vals), grad.to(device))
    for bound in plan.bindings():  # poison the reused arenas: unreached dense positions must be written
        for arena in bound.workspace.current_arenas or ():
            arena.fill_(float("nan"))
    again = spscan.backward(plan, dev(vals), grad.to(device))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    linear = spscan.backward(spscan.plan(pats, levels=0, backend="torch", dtype=torch.float64), vals, grad)
    ref = reference_backward(pats, vals, grad)
    scale = max(float(r.abs().max()) for r in ref)
    for got in (first, linear):
        assert max(float((a.cpu() - r).abs().max()) for a, r in zip(got, ref)) <= 1e-10 * scale


@pytest.mark.parametrize("sharing", ["sample", "shared", "mixed"])
@pytest.mark.parametrize("levels", [2, 3])
def test_torch_backend(sharing, levels):
    pats = _chain(13, 24, 0.3, seed=3)
    shared = {"sample": [False] * 13, "shared": [True] * 13, "mixed": [i % 2 == 0 for i in range(13)]}[sharing]
    _check(pats, shared, levels, "torch", torch.device("cpu"))


@pytest.mark.parametrize("sharing", ["sample", "mixed"])
def test_triton_backend(config_family, sharing):  # noqa: F811
    pats = _chain(7, 12, 0.3, seed=11)
    shared = [False] * 7 if sharing == "sample" else [i % 2 == 0 for i in range(7)]
    _check(pats, shared, "full", "triton", DEVICE)
