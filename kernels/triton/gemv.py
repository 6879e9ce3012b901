"""Batched small dense GEMVs for dense scan nodes: ``v[b, out_j] = M_j @ v[b, vin_j] + v[b, add_j]``.

The matrix-vector products of a step whose matrices are full (same shape ``m x k``) are one
launch. Matrices sit row-major at ``BlockRef.offsets`` in the shared arena ``(N_S,)`` or the
per-sample arena ``(B, N_P)``; ``vin`` ``(nodes, k)`` and ``add`` ``(nodes, m)`` are vector slots
(``add`` is the zero slot where a node has no affine term); outputs are ``nodes`` consecutive
``m``-vectors from ``out_offset``. A program covers ``BLOCK_N`` nodes' ``BLOCK_M`` rows for
``BLOCK_B`` samples; when ``k`` fits one tile the input indices (and a shared matrix) are loaded
once for all samples. The k-sum is a fixed-order ``tl.sum``: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spscan.planner.program import BlockRef

from spscan.kernels.triton import launch
from spscan.kernels.triton.gemm import node_batch_tile

__all__ = ["gemv_kernel", "gemv"]


@triton.jit
def gemv_kernel(
    m_ptr, v_ptr,  # matrices: shared (N_S,) or per sample (B, N_P); vectors (B, N_V)
    m_off, vin_idx, add_idx,  # (nodes,), (nodes, k), (nodes, m)
    out_offset, nodes, batch, m, k, stride_m, stride_v,  # stride_m 0 = shared
    M_SHARED: tl.constexpr, ONE_K: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    nblk, bblk, tile = node_batch_tile(batch, BLOCK_B)
    node = (nblk * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    node_ok = node < nodes
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < m
    ks = tl.arange(0, BLOCK_K)
    keep = node_ok[:, None] & row_ok[None, :]
    mo = tl.load(m_off + node, mask=node_ok, other=0).to(tl.int64)
    mat = m_ptr + mo[:, None, None] + rows[None, :, None] * k + ks[None, None, :]
    ia = tl.load(add_idx + node[:, None] * m + rows[None, :], mask=keep, other=0).to(tl.int64)
    io = out_offset + node[:, None] * m + rows[None, :]
    if ONE_K:
        # indices (and a shared matrix) are the same for every sample: load them once
        x_ok = node_ok[:, None] & (ks[None, :] < k)
        m_mask = keep[:, :, None] & (ks[None, None, :] < k)
        ix = tl.load(vin_idx + node[:, None] * k + ks[None, :], mask=x_ok, other=0).to(tl.int64)
        if M_SHARED:
            mat_fix = tl.load(mat, mask=m_mask, other=0.0)
    for i in range(BLOCK_B):
        s = bblk * BLOCK_B + i
        s_ok = s < batch
        vrow = v_ptr + s.to(tl.int64) * stride_v
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=v_ptr.dtype.element_ty)
        if ONE_K:
            if M_SHARED:
                a = mat_fix
            else:
                a = tl.load(mat + s.to(tl.int64) * stride_m, mask=m_mask & s_ok, other=0.0)
            x = tl.load(vrow + ix, mask=x_ok & s_ok, other=0.0)
            acc += tl.sum(a * x[:, None, :], axis=2)
        else:
            k0 = 0
            while k0 < k:  # not range(0, k, ..): Triton 3.6's interpreter rejects a tensor bound
                kk = k0 + ks
                x_ok = node_ok[:, None] & (kk[None, :] < k)
                ix = tl.load(vin_idx + node[:, None] * k + kk[None, :], mask=x_ok, other=0).to(tl.int64)
                a = tl.load(mat + s.to(tl.int64) * stride_m + k0,
                            mask=keep[:, :, None] & (kk[None, None, :] < k) & s_ok, other=0.0)
                x = tl.load(vrow + ix, mask=x_ok & s_ok, other=0.0)
                acc += tl.sum(a * x[:, None, :], axis=2)
                k0 += BLOCK_K
        acc += tl.load(vrow + ia, mask=keep & s_ok, other=0.0)
        tl.store(vrow + io, acc, mask=keep & s_ok)


def gemv(m_off: torch.Tensor, vin: torch.Tensor, add: torch.Tensor, ref: BlockRef, out_offset: int,
         mats: torch.Tensor, v: torch.Tensor) -> None:
    """Batched ``(m, k) @ (k,)`` plus the affine term over a step's nodes, in place on ``v``.

    Args:
        m_off: ``(nodes,)`` device copy of ``ref.offsets``; ``vin``: ``(nodes, k)``; ``add``: ``(nodes, m)``.
        ref: the matrices' block shape ``(m, k)``.
        out_offset: node ``j`` writes ``v[:, out_offset + j*m : +m]``.
        mats: ``(N_S,)`` shared or ``(B, N_P)`` per sample; ``v``: ``(B, N_V)``.
    """
    nodes = int(m_off.shape[0])
    if nodes == 0:
        return
    m, k = ref.rows, ref.cols
    if tuple(vin.shape) != (nodes, k) or tuple(add.shape) != (nodes, m):
        raise ValueError(f"gemv: expected vin ({nodes}, {k}) and add ({nodes}, {m}), "
                         f"got {tuple(vin.shape)} and {tuple(add.shape)}")
    batch = v.shape[0]
    cfg, one_k = launch.gemv_config(m, k, nodes, batch, v.element_size())
    grid = (triton.cdiv(nodes, cfg.block_n) * triton.cdiv(batch, cfg.block_b), triton.cdiv(m, cfg.block_m))
    launch.launch(
        gemv_kernel, grid,
        dict(m_ptr=mats, v_ptr=v, m_off=m_off, vin_idx=vin, add_idx=add, out_offset=out_offset, nodes=nodes,
             batch=batch, m=m, k=k, stride_m=0 if mats.dim() == 1 else mats.stride(0), stride_v=v.stride(0)),
        dict(M_SHARED=mats.dim() == 1, ONE_K=one_k,
             BLOCK_B=cfg.block_b, BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k),
        cfg.num_warps,
    )
