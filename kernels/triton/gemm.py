"""Batched small dense GEMMs for dense scan nodes: ``C_j = A_j @ B_j`` for every node ``j`` and sample.

When both factors of an up-sweep product are full (e.g. ``20 x 20`` dense per-sample blocks), the planner groups a step's same-shaped products into one work table; this is one
launch for all of them. Blocks sit row-major at ``BlockRef.offsets`` in their arena (shared
``(N_S,)``: no batch stride, or per sample ``(B, N_P)``); outputs are ``nodes`` consecutive
``m x p`` blocks from ``out_offset``. A program computes one ``BLOCK_M x BLOCK_P`` tile of one
node for ``BLOCK_B`` samples, loading a shared factor once when ``k`` fits one tile. Tiles of
16 or more in every dimension use ``tl.dot`` (``input_precision`` from ``launch.input_precision``:
exact unless ``launch.dot_precision`` says otherwise); smaller nodes accumulate ``k`` rank-1 updates
in order (two 2-D tiles; a 3-D broadcast-multiply-sum of small float32 tiles compiled wrong under
Triton 3.6 on sm_90, e.g. ``12 x 12 x 12`` and ``11 x 2 x 9`` nodes).
Accumulation is in the arena dtype. The inner size ``k`` is a compile-time constant (one
variant per size): the k loop is then a ``range`` loop that Triton software-pipelines and that
Triton 3.6's interpreter runs (it cannot take a run-time value as a ``range`` bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spscan.planner.program import BlockRef

from spscan.kernels.triton import launch

__all__ = ["gemm_kernel", "gemm", "node_batch_tile"]


@triton.jit
def node_batch_tile(batch, BLOCK_B: tl.constexpr):
    """Grid of the dense-node kernels: axis 0 enumerates (node block, sample block) pairs, sample
    blocks fastest; axis 1 is the output tile. Returns ``(node block, sample block, tile)``."""
    nbb = tl.cdiv(batch, BLOCK_B)
    return tl.program_id(0) // nbb, tl.program_id(0) % nbb, tl.program_id(1)


@triton.jit
def gemm_kernel(
    a_ptr, b_ptr, c_ptr,  # value arenas: shared (N,) or per sample (B, N) with row stride
    a_off, b_off,  # (nodes,) block offsets of each node's factors
    out_offset, nodes, batch, m, p, stride_a, stride_b, stride_c,  # stride 0 = shared
    k: tl.constexpr,  # a compile-time bound: the k loop stays a software-pipelined ``for``
    A_SHARED: tl.constexpr, B_SHARED: tl.constexpr, ONE_K: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
):
    node, bblk, tile = node_batch_tile(batch, BLOCK_B)
    tiles_p = tl.cdiv(p, BLOCK_P)
    rows = (tile // tiles_p) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_p) * BLOCK_P + tl.arange(0, BLOCK_P)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < p
    if not USE_DOT:
        # small nodes: k rank-1 updates of the (BLOCK_M, BLOCK_P) tile, in order (2-D tensors only)
        a_col = a_ptr + tl.load(a_off + node).to(tl.int64) + rows * k
        b_row = b_ptr + tl.load(b_off + node).to(tl.int64) + cols
        c_tile = c_ptr + out_offset + node.to(tl.int64) * m * p + rows[:, None] * p + cols[None, :]
        for i in range(BLOCK_B):
            s = bblk * BLOCK_B + i
            s_ok = s < batch
            s64 = s.to(tl.int64)
            acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=c_ptr.dtype.element_ty)
            for kk in range(k):
                av = tl.load(a_col + s64 * stride_a + kk, mask=row_ok & s_ok, other=0.0)
                bv = tl.load(b_row + s64 * stride_b + kk * p, mask=col_ok & s_ok, other=0.0)
                acc += av[:, None] * bv[None, :]
            tl.store(c_tile + s64 * stride_c, acc, mask=row_ok[:, None] & col_ok[None, :] & s_ok)
    else:
        a_tile = a_ptr + tl.load(a_off + node).to(tl.int64) + rows[:, None] * k + ks[None, :]
        b_tile = b_ptr + tl.load(b_off + node).to(tl.int64) + ks[:, None] * p + cols[None, :]
        c_tile = c_ptr + out_offset + node.to(tl.int64) * m * p + rows[:, None] * p + cols[None, :]
        a_mask = row_ok[:, None] & (ks[None, :] < k)
        b_mask = (ks[:, None] < k) & col_ok[None, :]
        if ONE_K:
            # a shared factor is the same for every sample: load it once
            if A_SHARED:
                a_fix = tl.load(a_tile, mask=a_mask, other=0.0)
            if B_SHARED:
                b_fix = tl.load(b_tile, mask=b_mask, other=0.0)
        for i in range(BLOCK_B):
            s = bblk * BLOCK_B + i
            s_ok = s < batch
            s64 = s.to(tl.int64)
            acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=c_ptr.dtype.element_ty)
            if ONE_K:
                if A_SHARED:
                    a = a_fix
                else:
                    a = tl.load(a_tile + s64 * stride_a, mask=a_mask & s_ok, other=0.0)
                if B_SHARED:
                    b = b_fix
                else:
                    b = tl.load(b_tile + s64 * stride_b, mask=b_mask & s_ok, other=0.0)
                acc += tl.dot(a, b, input_precision=PRECISION)
            else:
                for k0 in range(0, k, BLOCK_K):
                    a = tl.load(a_tile + s64 * stride_a + k0,
                                mask=row_ok[:, None] & (k0 + ks[None, :] < k) & s_ok, other=0.0)
                    b = tl.load(b_tile + s64 * stride_b + k0 * p,
                                mask=(k0 + ks[:, None] < k) & col_ok[None, :] & s_ok, other=0.0)
                    acc += tl.dot(a, b, input_precision=PRECISION)
            tl.store(c_tile + s64 * stride_c, acc, mask=row_ok[:, None] & col_ok[None, :] & s_ok)


def gemm(a_off: torch.Tensor, b_off: torch.Tensor, a_ref: BlockRef, b_ref: BlockRef, out_offset: int,
         a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """Batched ``(m, k) @ (k, p)`` over a step's nodes, in place on ``c``.

    Args:
        a_off, b_off: ``(nodes,)`` device copies of ``a_ref.offsets`` / ``b_ref.offsets``.
        a_ref, b_ref: block shapes ``(m, k)`` and ``(k, p)``.
        out_offset: first output slot; node ``j`` writes ``c[..., out_offset + j*m*p : +m*p]``.
        a, b: arenas, ``(N,)`` shared or ``(B, N)`` per sample; ``c``: ``(N,)`` only when both are shared.
    """
    nodes = int(a_off.shape[0])
    if nodes == 0:
        return
    m, k, p = a_ref.rows, a_ref.cols, b_ref.cols
    if b_ref.rows != k:
        raise ValueError(f"gemm: inner dimensions differ: a is ({m}, {k}), b is ({b_ref.rows}, {p})")
    a_sh, b_sh, c_sh = a.dim() == 1, b.dim() == 1, c.dim() == 1
    if c_sh != (a_sh and b_sh):
        raise ValueError(f"gemm: output must be shared exactly when both factors are; got a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, c {tuple(c.shape)}")
    batch = 1 if c_sh else c.shape[0]
    cfg, one_k = launch.gemm_config(m, k, p, batch, c.element_size())
    precision = launch.input_precision(c.dtype)
    grid = (nodes * triton.cdiv(batch, cfg.block_b), triton.cdiv(m, cfg.block_m) * triton.cdiv(p, cfg.block_p))
    launch.launch(
        gemm_kernel, grid,
        dict(a_ptr=a, b_ptr=b, c_ptr=c, a_off=a_off, b_off=b_off, out_offset=out_offset, nodes=nodes,
             batch=batch, m=m, p=p, stride_a=0 if a_sh else a.stride(0),
             stride_b=0 if b_sh else b.stride(0), stride_c=0 if c_sh else c.stride(0)),
        dict(k=k, A_SHARED=a_sh, B_SHARED=b_sh, ONE_K=one_k, USE_DOT=cfg.use_dot, PRECISION=precision,
             BLOCK_B=cfg.block_b, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k, BLOCK_P=cfg.block_p),
        cfg.num_warps,
    )
