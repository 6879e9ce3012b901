"""Numeric SpGEMM from planned pair lists: ``C.data[c] = sum_t A.data[pa[t]] * B.data[pb[t]]``.

The symbolic half (which pairs feed each output entry) was done once by the planner; this is
the numeric half, batched over samples. A step's products arrive as one long-first
:class:`~spscan.kernels.triton.segments.SegmentTable`; a program reduces ``BLOCK_S`` consecutive
segments for ``BLOCK_B`` samples, in chunks of ``BLOCK_W`` pairs, so the index chunk and any
shared (batch-independent) factor are loaded once per program and reused by every sample.
The reduction order is fixed by the tiles (per-lane partial sums over chunks, then one
``tl.sum``), so results are bitwise reproducible; there are no atomics.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from spscan.kernels.triton import launch
from spscan.kernels.triton.segments import SegmentTable, segment_block, segment_dot

__all__ = ["spgemm_kernel", "spgemm", "product_operands", "row_stride"]


@triton.jit
def spgemm_kernel(
    a_ptr, b_ptr, c_ptr,  # value arenas: shared (N,) or per sample (B, N) with row stride
    seg_ptr, pair_a, pair_b, out_idx,  # the step's segment table
    nseg, batch, stride_a, stride_b, stride_c,
    A_SHARED: tl.constexpr, B_SHARED: tl.constexpr, C_SHARED: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr,
):
    seg, seg_ok, start, end, longest, smp, smp_ok = segment_block(seg_ptr, nseg, batch, BLOCK_B, BLOCK_S)
    c = segment_dot(a_ptr, b_ptr, pair_a, pair_b, start, end, longest, smp, smp_ok, stride_a, stride_b,
                    c_ptr.dtype.element_ty, A_SHARED, B_SHARED, BLOCK_B, BLOCK_S, BLOCK_W)
    o = tl.load(out_idx + seg, mask=seg_ok, other=0).to(tl.int64)
    if C_SHARED:
        tl.store(c_ptr + o[None, :], c, mask=smp_ok[:, None] & seg_ok[None, :])
    else:
        tl.store(c_ptr + smp[:, None] * stride_c + o[None, :], c, mask=smp_ok[:, None] & seg_ok[None, :])


def row_stride(arena: torch.Tensor) -> int:
    """Row stride of a per-sample arena ``(B, N)``; 0 for a shared one ``(N,)``."""
    return arena.stride(0) if arena.dim() == 2 else 0


def product_operands(name: str, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[bool, bool, bool, int]:
    """``(a shared, b shared, c shared, batch)`` of a product's arenas ``(N,)`` / ``(B, N)``.

    Raises ``ValueError`` naming ``name`` unless ``c`` is shared exactly when both factors are.
    """
    a_sh, b_sh, c_sh = a.dim() == 1, b.dim() == 1, c.dim() == 1
    if c_sh != (a_sh and b_sh):
        raise ValueError(f"{name}: output must be shared exactly when both factors are; got a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, c {tuple(c.shape)}")
    return a_sh, b_sh, c_sh, 1 if c_sh else c.shape[0]


def spgemm(table: SegmentTable, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
           clear: Sequence[tuple[int, int]] = ()) -> None:
    """Numeric SpGEMM for one step, in place: ``c[..., out[s]] = sum a[..., pair_a] * b[..., pair_b]``.

    ``clear``: ``(offset, size)`` blocks of ``c`` zeroed first (dense-stored products, whose segments
    cover only their own pattern's entries: the other positions of the block are zeros).

    Args:
        table: the step's segments (long-first), ``nseg`` outputs and their pairs.
        a, b: value arenas, ``(N,)`` when shared by the batch or ``(B, N)`` per sample.
        c: output arena, ``(N,)`` only when both factors are shared, else ``(B, N)``.
    """
    for off, size in clear:
        c.narrow(-1, off, size).zero_()  # a device fill: no host sync, capturable in a CUDA graph
    if table.nseg == 0:
        return
    a_sh, b_sh, c_sh, batch = product_operands("spgemm", a, b, c)
    cfg, grid = table.launch_config(batch, c.element_size())
    launch.launch(
        spgemm_kernel, grid,
        dict(a_ptr=a, b_ptr=b, c_ptr=c, seg_ptr=table.seg_ptr, pair_a=table.pair_a, pair_b=table.pair_b,
             out_idx=table.out, nseg=table.nseg, batch=batch,
             stride_a=row_stride(a), stride_b=row_stride(b), stride_c=row_stride(c)),
        dict(A_SHARED=a_sh, B_SHARED=b_sh, C_SHARED=c_sh,
             BLOCK_B=cfg.block_b, BLOCK_S=cfg.block_s, BLOCK_W=cfg.block_w),
        cfg.num_warps,
    )

