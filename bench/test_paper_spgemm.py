"""Numeric-only planned SpGEMM vs full SpGEMM libraries on VGG-11 transposed-Jacobian products.

Products are the scan's first up-sweep level on the pruned VGG-11 conv chain of
``test_paper_vgg``: ``J_i^T @ J_{i+1}^T`` for consecutive layers (conv1^T.relu1^T,
relu1^T.pool1^T, pool1^T.conv2^T, ...). One matrix (values shared, as one sample):

* ``planned``: the numeric half only (``spscan.plan_composite`` of the two layers: gather-multiply-
  segment-sum over the pair lists of ``spscan.planner.symbolic.spgemm_symbolic``, computed once);
  the benchmark's own statistics. The plan's backend is the device's default: the torch gather-multiply-
  segment-sum on CPU, the Triton SpGEMM kernels on CUDA (the row ``backend`` says which ran).
* ``torch.sparse``: CSR @ CSR, symbolic + numeric every call;
* ``scipy``: ``csr_array @ csr_array`` (CPU rows only).
* ``copy``: ``torch.clone`` of a float32 tensor as large as the planned product's traffic,
  giving the device's copy bandwidth in the same run.

Planned bytes = ``pairs * (2 index reads * 8 + 2 value reads * 4) + nnz_C * 4``; GB/s of the
planned product use that count, copy GB/s count read + write.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan

import paper_config as cfg
from test_paper_vgg import magnitude_prune, vgg11

DEV = cfg.DEVICE
_CHAIN: dict[str, list] = {}


def _patterns() -> tuple[list[sp.csr_array], list[str]]:
    """The pruned VGG-11 chain's patterns and layer kinds (computed once per session)."""
    if not _CHAIN:
        model = vgg11(cfg.VGG_CHANNEL_DIVISOR)[0]  # the conv/ReLU/max-pool features
        magnitude_prune(model, cfg.VGG_PRUNE_AMOUNT, "layer")
        plan = spscan.plan(model, torch.randn(1, 3, 32, 32), prune_zeros=True, levels=0)
        _CHAIN["patterns"] = [sp.csr_array(p) for p in plan.patterns]
        kinds, counts = [], {}
        for m in model:
            k = {"Conv2d": "conv", "ReLU": "relu", "MaxPool2d": "pool"}[type(m).__name__]
            counts[k] = counts.get(k, 0) + 1
            kinds.append(f"{k}{counts[k]}")
        _CHAIN["kinds"] = kinds
    return _CHAIN["patterns"], _CHAIN["kinds"]


def _torch_csr(p: sp.csr_array, values: np.ndarray) -> torch.Tensor:
    return torch.sparse_csr_tensor(torch.from_numpy(p.indptr.astype(np.int64)), torch.from_numpy(p.indices.astype(np.int64)),
                                   torch.from_numpy(values), size=p.shape).to(DEV)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("i", range(cfg.SPGEMM_PRODUCTS))
def test_spgemm_vgg11(benchmark, i):
    benchmark.group = "paper-spgemm"
    pats, kinds = _patterns()
    a, b = pats[i], pats[i + 1]
    rng = np.random.default_rng(i)
    va = rng.standard_normal(a.nnz).astype(np.float32)
    vb = rng.standard_normal(b.nnz).astype(np.float32)
    t0 = time.perf_counter()
    cplan = spscan.plan_composite([a, b], device=DEV)
    bound = cplan.bind((True, True), None, DEV)  # index tables to the device once
    symbolic_s = time.perf_counter() - t0
    ta, tb = torch.from_numpy(va).to(DEV), torch.from_numpy(vb).to(DEV)
    pattern = cplan.composite_pattern

    def planned():
        out = bound.run([ta, tb], check=False).composite
        cfg.sync()
        return out

    rounds = 21  # sub-millisecond calls: more rounds steady the median on a loaded machine
    c = benchmark.pedantic(planned, rounds=rounds, warmup_rounds=1)
    t_planned = benchmark.stats.stats.median
    A, Bm = _torch_csr(a, va), _torch_csr(b, vb)
    t_torch = cfg.median_time(lambda: A @ Bm, rounds)
    sa, sb = sp.csr_array((va, a.indices, a.indptr), shape=a.shape), sp.csr_array((vb, b.indices, b.indptr), shape=b.shape)
    t_scipy = cfg.median_time(lambda: sa @ sb, rounds) if DEV.type == "cpu" else float("nan")
    # same numbers as SciPy's product on the planned pattern
    ref = (sa @ sb).tocsr()
    ref.sort_indices()
    assert ref.nnz <= pattern.nnz  # SciPy drops nothing but exact cancellation; the plan may store C densely
    npairs, nnz_c = sum(c.flops for c in cplan.step_costs()) // 2, int(pattern.nnz)
    planned_bytes = npairs * (2 * 8 + 2 * 4) + nnz_c * 4
    buf = torch.empty(max(1, planned_bytes // 4), dtype=torch.float32, device=DEV)
    t_copy = cfg.median_time(lambda: torch.clone(buf), rounds)
    flops = 2 * npairs
    benchmark.extra_info.update(
        cfg.common_info(), experiment="spgemm", product=f"{kinds[i]}^T . {kinds[i + 1]}^T", index=i,
        a_shape=list(a.shape), b_shape=list(b.shape), nnz_a=int(a.nnz), nnz_b=int(b.nnz), nnz_c=nnz_c,
        pairs=npairs, flops=flops, planned_bytes=planned_bytes, symbolic_once_s=symbolic_s,
        channel_divisor=cfg.VGG_CHANNEL_DIVISOR, prune_amount=cfg.VGG_PRUNE_AMOUNT,
        planned_s=t_planned, torch_sparse_s=t_torch, scipy_s=t_scipy, copy_s=t_copy,
        planned_gflops=flops / t_planned / 1e9, planned_gbs=planned_bytes / t_planned / 1e9,
        copy_gbs=2 * buf.numel() * 4 / t_copy / 1e9,
        speedup_vs_torch_sparse=t_torch / t_planned, speedup_vs_scipy=t_scipy / t_planned,
        fraction_of_copy_bw=(planned_bytes / t_planned) / (2 * buf.numel() * 4 / t_copy),
        backend=f"{cplan.backend} (plan_composite)",
    )
    assert c.shape[-1] == nnz_c
