"""Batched SpMV over planned segments: ``v[b, out[s]] = sum_t M[.., pm[t]] * v[b, pv[t]] + v[b, add[s]]``.

Every ``J^T g`` of a step (the spine of the up-sweep, the linear-scan middle and the
down-sweep) is one launch. The matrix values live in the shared arena ``(N_S,)`` or the
per-sample arena ``(B, N_P)``; vectors are always per sample ``(B, N_V)``. The affine term of
the scan is fused (``add`` points at the arena's zero slot where a node has none). Same tiling
and fixed reduction order as :mod:`spscan.kernels.triton.spgemm`: a program reduces ``BLOCK_S``
long-first segments for ``BLOCK_B`` samples, reading indices and a shared matrix once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spscan.kernels.triton import launch
from spscan.kernels.triton.segments import SegmentTable, segment_block, segment_dot

__all__ = ["spmv_kernel", "spmv"]


@triton.jit
def spmv_kernel(
    m_ptr, v_ptr,  # matrix values: shared (N_S,) or per sample (B, N_P); vectors (B, N_V)
    seg_ptr, pair_m, pair_v, out_idx, add_idx,  # the step's segment table
    nseg, batch, stride_m, stride_v,
    M_SHARED: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
):
    seg, seg_ok, start, end, longest, smp, smp_ok = segment_block(seg_ptr, nseg, batch, BLOCK_B, BLOCK_S)
    y = segment_dot(m_ptr, v_ptr, pair_m, pair_v, start, end, longest, smp, smp_ok, stride_m, stride_v,
                    v_ptr.dtype.element_ty, M_SHARED, False, BLOCK_B, BLOCK_S, BLOCK_W)
    keep = smp_ok[:, None] & seg_ok[None, :]
    rows = smp[:, None] * stride_v
    ia = tl.load(add_idx + seg, mask=seg_ok, other=0).to(tl.int64)
    y += tl.load(v_ptr + rows + ia[None, :], mask=keep, other=0.0)
    o = tl.load(out_idx + seg, mask=seg_ok, other=0).to(tl.int64)
    tl.store(v_ptr + rows + o[None, :], y, mask=keep)


def spmv(table: SegmentTable, m: torch.Tensor, v: torch.Tensor) -> None:
    """One step's batched SpMV with the affine term, in place on ``v``.

    Args:
        table: the step's segments (long-first) with ``add`` slots.
        m: matrix values, ``(N_S,)`` shared by the batch or ``(B, N_P)`` per sample.
        v: vectors ``(B, N_V)``; outputs are written to ``v[:, out]``.
    """
    if table.nseg == 0:
        return
    if table.add is None:
        raise ValueError("spmv: expected a segment table with add slots (the zero slot where none), got add=None")
    if v.dim() != 2 or (m.dim() == 2 and m.shape[0] != v.shape[0]):
        raise ValueError(f"spmv: expected v (B, N_V) and m (N,) or (B, N); got v {tuple(v.shape)}, m {tuple(m.shape)}")
    batch = v.shape[0]
    cfg, grid = table.launch_config(batch, v.element_size())
    launch.launch(
        spmv_kernel, grid,
        dict(m_ptr=m, v_ptr=v, seg_ptr=table.seg_ptr, pair_m=table.pair_a, pair_v=table.pair_b,
             out_idx=table.out, add_idx=table.add, nseg=table.nseg, batch=batch,
             stride_m=m.stride(0) if m.dim() == 2 else 0, stride_v=v.stride(0)),
        dict(M_SHARED=m.dim() == 1, BLOCK_B=cfg.block_b, BLOCK_S=cfg.block_s, BLOCK_W=cfg.block_w),
        cfg.num_warps,
    )
