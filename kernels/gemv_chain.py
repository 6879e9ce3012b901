"""The linear-scan middle as one persistent launch: ``y_j = M_j @ y_{j-1} + add_j`` for ``j = 1..steps``.

A :class:`~spscan.planner.program.GemvChain` is a run of dependent dense ``m x m`` mat-vecs; a
launch per step would cost more than the step itself, so each program walks the whole chain
for ``BLOCK_B`` samples. When ``m`` fits one tile (``BLOCK_M >= m``) the running vector stays in
registers between steps; otherwise each step is tiled over rows and ``k``, reads ``y_{j-1}``
back from the vector arena, and a block barrier orders the steps. Matrices are row-major at
``mats.offsets`` in the shared arena ``(N_S,)`` (no batch stride: one load serves every sample
of the program) or the per-sample arena ``(B, N_P)``. Sums are fixed-order ``tl.sum``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from spscan.planner.program import BlockRef

from . import launch

__all__ = ["gemv_chain_kernel", "gemv_chain"]


@triton.jit
def gemv_chain_kernel(
    m_ptr, v_ptr,  # matrices: shared (N_S,) or per sample (B, N_P); vectors (B, N_V)
    m_off, add_idx,  # (steps,) block offsets; (steps, m) affine slots (unused without HAS_ADD)
    vin0, out_offset, steps, batch, m, stride_m, stride_v,  # stride_m 0 = shared
    M_SHARED: tl.constexpr, HAS_ADD: tl.constexpr, ONE_TILE: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    smp = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    smp_ok = smp < batch
    vrow = v_ptr + smp[:, None] * stride_v  # (BLOCK_B, 1)
    mrow = smp[:, None, None] * stride_m  # (BLOCK_B, 1, 1); 0 when shared
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        # BLOCK_K == BLOCK_M >= m: the running vector never leaves registers
        tile_ok = (rows[:, None] < m) & (ks[None, :] < m)
        y = tl.load(vrow + vin0 + ks[None, :], mask=smp_ok[:, None] & (ks[None, :] < m), other=0.0)
        for j in range(steps):
            mo = tl.load(m_off + j).to(tl.int64)
            blk = m_ptr + mo + rows[:, None] * m + ks[None, :]
            if M_SHARED:
                a = tl.load(blk, mask=tile_ok, other=0.0)[None, :, :]
            else:
                a = tl.load(blk[None, :, :] + mrow, mask=smp_ok[:, None, None] & tile_ok[None, :, :], other=0.0)
            ynew = tl.sum(a * y[:, None, :], axis=2)
            keep = smp_ok[:, None] & (rows[None, :] < m)
            if HAS_ADD:
                ia = tl.load(add_idx + j * m + rows, mask=rows < m, other=0).to(tl.int64)
                ynew += tl.load(vrow + ia[None, :], mask=keep, other=0.0)
            tl.store(vrow + out_offset + j * m + rows[None, :], ynew, mask=keep)
            y = ynew
    else:
        for j in range(steps):
            src = tl.where(j == 0, vin0, out_offset + (j - 1) * m)
            mo = tl.load(m_off + j).to(tl.int64)
            for r0 in range(0, m, BLOCK_M):
                r = r0 + rows
                acc = tl.zeros([BLOCK_B, BLOCK_M], dtype=v_ptr.dtype.element_ty)
                for k0 in range(0, m, BLOCK_K):
                    kk = k0 + ks
                    tile_ok = (r[:, None] < m) & (kk[None, :] < m)
                    blk = m_ptr + mo + r[:, None] * m + kk[None, :]
                    if M_SHARED:
                        a = tl.load(blk, mask=tile_ok, other=0.0)[None, :, :]
                    else:
                        a = tl.load(blk[None, :, :] + mrow, mask=smp_ok[:, None, None] & tile_ok[None, :, :],
                                    other=0.0)
                    x = tl.load(vrow + src + kk[None, :], mask=smp_ok[:, None] & (kk[None, :] < m), other=0.0)
                    acc += tl.sum(a * x[:, None, :], axis=2)
                keep = smp_ok[:, None] & (r[None, :] < m)
                if HAS_ADD:
                    ia = tl.load(add_idx + j * m + r, mask=r < m, other=0).to(tl.int64)
                    acc += tl.load(vrow + ia[None, :], mask=keep, other=0.0)
                tl.store(vrow + out_offset + j * m + r[None, :], acc, mask=keep)
            # step j + 1 reads what every thread of the program wrote in step j
            tl.debug_barrier()


def gemv_chain(m_off: torch.Tensor, add: Optional[torch.Tensor], ref: BlockRef, vin0: int, out_offset: int,
               mats: torch.Tensor, v: torch.Tensor) -> None:
    """Run a whole chain of ``steps`` dense ``(m, m)`` mat-vecs in one launch, in place on ``v``.

    Args:
        m_off: ``(steps,)`` device copy of ``ref.offsets``; ``add``: ``(steps, m)`` slots or ``None``.
        vin0: slot of ``y_0`` (``m`` entries); step ``j`` (1-based) writes ``v[:, out_offset + (j-1)*m : +m]``.
        mats: ``(N_S,)`` shared or ``(B, N_P)`` per sample; ``v``: ``(B, N_V)``.
    """
    steps = int(m_off.shape[0])
    if steps == 0:
        return
    m = ref.rows
    if ref.cols != m:
        raise ValueError(f"gemv_chain: expected square ({m}, {m}) matrices, got ({ref.rows}, {ref.cols})")
    if add is not None and tuple(add.shape) != (steps, m):
        raise ValueError(f"gemv_chain: expected add slots ({steps}, {m}), got {tuple(add.shape)}")
    batch = v.shape[0]
    shared = mats.dim() == 1
    cfg, one_tile = launch.chain_config(m, batch, shared, v.element_size())
    grid = (triton.cdiv(batch, cfg.block_b),)
    launch.launch(
        gemv_chain_kernel, grid,
        dict(m_ptr=mats, v_ptr=v, m_off=m_off, add_idx=m_off if add is None else add, vin0=vin0,
             out_offset=out_offset, steps=steps, batch=batch, m=m,
             stride_m=0 if shared else mats.stride(0), stride_v=v.stride(0)),
        dict(M_SHARED=shared, HAS_ADD=add is not None, ONE_TILE=one_tile,
             BLOCK_B=cfg.block_b, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k),
        cfg.num_warps,
    )
