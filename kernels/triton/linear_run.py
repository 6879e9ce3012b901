"""The linear-scan middle as one persistent launch: ``y_j = M_j @ y_{j-1} + add_j`` for ``j = 1..steps``.

A :class:`~spscan.planner.program.LinearRun` is a run of dependent mat-vecs whose matrices are
dense (row-major ``m_j x k_j``), diagonal (``m_j`` entries) or CSR (``nnz_j`` entries in the order
of one of the run's patterns), each shared (arena ``S``, no batch stride) or per sample (arena
``P``). A launch per step would cost more than the step, so each program walks the whole run for
``BLOCK_B`` samples:

* uniform runs (every step dense, square, the same ``m <= 64``): the running vector stays in
  registers between steps (``ONE_TILE``);
* otherwise each step is tiled over rows and ``k``, reads ``y_{j-1}`` back from the vector
  arena, and a block barrier orders the steps. A CSR step's row tile walks its rows' stored
  entries ``BLOCK_K`` at a time (up to the tile's longest row), gathering ``y_{j-1}`` at their
  columns: O(nnz) loads, never ``m x k``.

A step's matrix is read by two masked loads (shared / per sample), so one launch serves mixed
runs and a shared matrix is loaded once for every sample of the program. Per-step metadata
is one ``(steps, 8)`` integer table; the CSR patterns' row starts and columns are two flat
integer tables, each distinct pattern stored once. Sums are fixed-order ``tl.sum``: deterministic.
Loops whose bound is a run-time value are ``while`` loops: Triton 3.6's interpreter cannot take a
tensor as a ``range`` bound.

A long run whose every step is a square ``m x m`` dense block or diagonal (``m <= 63``) runs
instead parallel over its steps (:func:`linear_run_chunked`, three launches; the comment above
its kernels says how), which is what makes one run a scan rather than a loop on a GPU. A long
run of diagonals only (any ``m``) runs the same three phases per lane.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from spscan.kernels.triton import launch

__all__ = ["linear_run_table", "linear_run_kernel", "linear_run", "chunked_size", "diagonal_size",
           "run_compose_kernel", "run_carry_kernel", "run_expand_kernel", "diag_chunk_kernel", "diag_carry_kernel",
           "linear_run_chunked"]

FIELDS = 8  # kind (0 diagonal, 1 dense, 2 CSR), shared, rows, cols, mat_offset, add (-1: none), out, csr_ptr
DIAG, DENSE, CSR = 0, 1, 2


@triton.jit
def linear_run_kernel(
    s_ptr, p_ptr, v_ptr,  # shared values (N_S,), per-sample values (B, N_P), vectors (B, N_V)
    table,  # (steps, FIELDS) per-step metadata
    csr_indptr, csr_indices,  # the CSR patterns' row starts (global entry positions) and columns
    vin0, steps, batch, m, stride_p, stride_v,  # m: the common size when ONE_TILE
    ONE_TILE: tl.constexpr, NF: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    smp = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    smp_ok = smp < batch
    vrow = v_ptr + smp[:, None] * stride_v  # (BLOCK_B, 1)
    prow = p_ptr + smp[:, None, None] * stride_p  # (BLOCK_B, 1, 1)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    if ONE_TILE:
        # BLOCK_K == BLOCK_M >= m: the running vector never leaves registers
        tile_ok = (rows[:, None] < m) & (ks[None, :] < m)
        keep = smp_ok[:, None] & (rows[None, :] < m)
        y = tl.load(vrow + vin0 + ks[None, :], mask=smp_ok[:, None] & (ks[None, :] < m), other=0.0)
        j = 0
        while j < steps:
            meta = table + j * NF
            sh = tl.load(meta + 1)
            off = tl.load(meta + 4).to(tl.int64)
            add = tl.load(meta + 5).to(tl.int64)
            out = tl.load(meta + 6).to(tl.int64)
            blk = off + rows[:, None] * m + ks[None, :]
            a = tl.load(s_ptr + blk, mask=tile_ok & (sh != 0), other=0.0)[None, :, :] \
                + tl.load(prow + blk[None, :, :], mask=smp_ok[:, None, None] & tile_ok[None, :, :] & (sh == 0),
                          other=0.0)
            ynew = tl.sum(a * y[:, None, :], axis=2)
            ynew += tl.load(vrow + add + rows[None, :], mask=keep & (add >= 0), other=0.0)
            tl.store(vrow + out + rows[None, :], ynew, mask=keep)
            y = ynew
            j += 1
    else:
        j = 0
        while j < steps:
            meta = table + j * NF
            kind = tl.load(meta)
            sh = tl.load(meta + 1)
            mj = tl.load(meta + 2)
            kj = tl.load(meta + 3)
            off = tl.load(meta + 4).to(tl.int64)
            add = tl.load(meta + 5).to(tl.int64)
            out = tl.load(meta + 6).to(tl.int64)
            cp = tl.load(meta + 7).to(tl.int64)
            prev = tl.load(table + tl.maximum(j - 1, 0) * NF + 6).to(tl.int64)
            src = tl.where(j == 0, vin0, prev)
            r0 = 0
            while r0 < mj:
                r = r0 + rows
                keep = smp_ok[:, None] & (r[None, :] < mj)
                acc = tl.zeros([BLOCK_B, BLOCK_M], dtype=v_ptr.dtype.element_ty)
                if kind == 1:  # dense
                    k0 = 0
                    while k0 < kj:
                        kk = k0 + ks
                        tile_ok = (r[:, None] < mj) & (kk[None, :] < kj)
                        blk = off + r[:, None] * kj + kk[None, :]
                        a = tl.load(s_ptr + blk, mask=tile_ok & (sh != 0), other=0.0)[None, :, :] \
                            + tl.load(prow + blk[None, :, :],
                                      mask=smp_ok[:, None, None] & tile_ok[None, :, :] & (sh == 0), other=0.0)
                        x = tl.load(vrow + src + kk[None, :], mask=smp_ok[:, None] & (kk[None, :] < kj), other=0.0)
                        acc += tl.sum(a * x[:, None, :], axis=2)
                        k0 += BLOCK_K
                elif kind == 2:  # CSR: each row's stored entries, BLOCK_K at a time in stored order
                    row_ok = r < mj
                    first = tl.load(csr_indptr + cp).to(tl.int64)  # the pattern's first entry
                    start = tl.load(csr_indptr + cp + r, mask=row_ok, other=0).to(tl.int64)
                    length = tl.load(csr_indptr + cp + r + 1, mask=row_ok, other=0).to(tl.int64) - start
                    longest = tl.max(length, axis=0)
                    k0 = 0
                    while k0 < longest:
                        t = k0 + ks
                        ent_ok = t[None, :] < length[:, None]  # (BLOCK_M, BLOCK_K)
                        pos = start[:, None] + t[None, :]
                        col = tl.load(csr_indices + pos, mask=ent_ok, other=0).to(tl.int64)
                        loc = off + (pos - first)
                        a = tl.load(s_ptr + loc, mask=ent_ok & (sh != 0), other=0.0)[None, :, :] \
                            + tl.load(prow + loc[None, :, :],
                                      mask=smp_ok[:, None, None] & ent_ok[None, :, :] & (sh == 0), other=0.0)
                        x = tl.load(vrow[:, :, None] + src + col[None, :, :],
                                    mask=smp_ok[:, None, None] & ent_ok[None, :, :], other=0.0)
                        acc += tl.sum(a * x, axis=2)
                        k0 += BLOCK_K
                else:  # diagonal: m_j == k_j entries scale the vector
                    d = tl.load(s_ptr + off + r, mask=(r < mj) & (sh != 0), other=0.0)[None, :] \
                        + tl.load(p_ptr + smp[:, None] * stride_p + off + r[None, :], mask=keep & (sh == 0), other=0.0)
                    acc += d * tl.load(vrow + src + r[None, :], mask=keep, other=0.0)
                acc += tl.load(vrow + add + r[None, :], mask=keep & (add >= 0), other=0.0)
                tl.store(vrow + out + r[None, :], acc, mask=keep)
                r0 += BLOCK_M
            # step j + 1 reads what every thread of the program wrote in step j
            tl.debug_barrier()
            j += 1


def linear_run_table(op, dtype: torch.dtype, device: torch.device) \
        -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """A LinearRun's tables on ``device`` as ``dtype`` integers: the ``(steps, FIELDS)`` metadata, the
    common size (0 if not uniform), and the CSR row starts and columns (one zero entry each when the
    run has no CSR step, so the kernel always gets valid pointers)."""
    steps = op.steps
    meta = np.zeros((steps, FIELDS), dtype=np.int64)
    meta[:, 0] = np.where(op.sparse, CSR, np.where(op.dense, DENSE, DIAG))
    meta[:, 1] = op.shared
    meta[:, 2] = op.rows
    meta[:, 3] = op.cols
    meta[:, 4] = op.mat_offset
    meta[:, 5] = op.add
    meta[:, 6] = op.out
    meta[:, 7] = op.csr_ptr
    m = int(op.rows[0]) if steps else 0
    uniform = bool(steps and np.all(meta[:, 0] == DENSE) and np.all(op.rows == m) and np.all(op.cols == m))
    indptr = op.csr_indptr if op.csr_indptr.size else np.zeros(1, dtype=np.int64)
    indices = op.csr_indices if op.csr_indices.size else np.zeros(1, dtype=np.int64)
    return (torch.as_tensor(meta, dtype=dtype, device=device), (m if uniform else 0),
            torch.as_tensor(indptr, dtype=dtype, device=device), torch.as_tensor(indices, dtype=dtype, device=device))


def linear_run(table: torch.Tensor, uniform_m: int, all_shared: bool, vin0: int, s: torch.Tensor, p: torch.Tensor,
              v: torch.Tensor, csr_indptr: torch.Tensor, csr_indices: torch.Tensor) -> None:
    """Run a whole linear run in one launch, in place on ``v``.

    Args:
        table: ``(steps, FIELDS)`` from :func:`linear_run_table`; ``uniform_m``: the common square size or 0;
            ``all_shared``: every matrix is in ``s`` (a program then serves many samples).
        vin0: slot of ``y_0``. s: ``(N_S,)``; p: ``(B, N_P)``; v: ``(B, N_V)``.
        csr_indptr, csr_indices: the run's CSR tables from :func:`linear_run_table` (1-D, ``table``'s dtype).
    """
    steps = int(table.shape[0])
    if steps == 0:
        return
    if p.dim() != 2 or v.dim() != 2 or p.shape[0] != v.shape[0]:
        raise ValueError(f"linear_run: expected p (B, N_P) and v (B, N_V), got {tuple(p.shape)} and {tuple(v.shape)}")
    if csr_indptr.dim() != 1 or csr_indices.dim() != 1 or csr_indptr.dtype != table.dtype \
            or csr_indices.dtype != table.dtype:
        raise ValueError(f"linear_run: expected 1-D {table.dtype} CSR tables, got {tuple(csr_indptr.shape)} "
                         f"{csr_indptr.dtype} and {tuple(csr_indices.shape)} {csr_indices.dtype}")
    batch = v.shape[0]
    cfg, one_tile = launch.linear_run_config(uniform_m, batch, all_shared, v.element_size())
    grid = (triton.cdiv(batch, cfg.block_b),)
    launch.launch(
        linear_run_kernel, grid,
        dict(s_ptr=s, p_ptr=p, v_ptr=v, table=table, csr_indptr=csr_indptr, csr_indices=csr_indices, vin0=vin0,
             steps=steps, batch=batch, m=uniform_m, stride_p=p.stride(0), stride_v=v.stride(0)),
        dict(ONE_TILE=one_tile, NF=FIELDS, BLOCK_B=cfg.block_b, BLOCK_M=cfg.block_m, BLOCK_K=cfg.block_k),
        cfg.num_warps,
    )


# --- the same run, parallel over its steps (uniform square dense / diagonal runs) ------------------
#
# A run of ``n`` steps is cut into chunks of ``L`` consecutive steps. Each chunk's affine map
# ``y_out = P_c y_in + a_c`` is composed by one program per (chunk, sample) (``run_compose_kernel``:
# ``L`` products ``M_j P`` of ``m x m`` blocks, ``a_c`` kept as column ``m`` of ``P``); one program
# per sample then walks the ``n / L`` chunk maps to get every chunk's entry vector
# (``run_carry_kernel``); and one program per (chunk, sample) re-runs its chunk's steps from that
# entry, writing every ``y_j`` (``run_expand_kernel``). The critical path is ``~2 L + n / L``
# dependent steps instead of ``n`` (``L ~ sqrt(n)``), for ``m^3`` extra multiply-adds per dense step
# and sample (a diagonal scales rows); this is the scan's middle run with the up-sweep fused into
# registers, never written out.


@triton.jit
def _run_block(s_ptr, prow, meta, rows, ks, m, NF: tl.constexpr):
    """Step ``meta``'s matrix, shared or per sample: a dense block as a ``(BM, BM)`` tile (zero outside
    ``m x m``) and a diagonal as a ``(BM,)`` vector; the other of the two is all zero (its loads
    are masked off)."""
    kind = tl.load(meta)
    sh = tl.load(meta + 1)
    off = tl.load(meta + 4).to(tl.int64)
    ok = (rows[:, None] < m) & (ks[None, :] < m) & (kind == 1)
    blk = off + rows[:, None] * m + ks[None, :]
    tile = tl.load(s_ptr + blk, mask=ok & (sh != 0), other=0.0) + tl.load(prow + blk, mask=ok & (sh == 0), other=0.0)
    dok = (rows < m) & (kind != 1)
    diag = tl.load(s_ptr + off + rows, mask=dok & (sh != 0), other=0.0) \
        + tl.load(prow + off + rows, mask=dok & (sh == 0), other=0.0)
    return tile, diag


@triton.jit
def _chunk_program(p_ptr, v_ptr, stride_p, stride_v, BM: tl.constexpr):
    """A (chunk, sample) program's chunk, sample, rows of the per-sample values and of the vectors, and the
    row and column indices of a ``(BM, BM)`` tile."""
    c = tl.program_id(0)
    smp = tl.program_id(1).to(tl.int64)
    return c, smp, p_ptr + smp * stride_p, v_ptr + smp * stride_v, tl.arange(0, BM), tl.arange(0, BM)


@triton.jit
def _chunk_first(s_ptr, prow, table, c, chunk, steps, rows, ks, m, NF: tl.constexpr):
    """Chunk ``c``'s first step, the step past its last, and its first step's block (:func:`_run_block`)."""
    j = c * chunk
    end = tl.minimum(j + chunk, steps)
    nxt, nxt_d = _run_block(s_ptr, prow, table + j * NF, rows, ks, m, NF)
    return j, end, nxt, nxt_d


@triton.jit
def _chunk_step(s_ptr, prow, table, j, end, rows, ks, m, nxt, nxt_d, NF: tl.constexpr, OUT: tl.constexpr):
    """Step ``j`` of a chunk ending before ``end``: its block (``nxt, nxt_d``, loaded a step ahead), kind,
    affine-term column and (with ``OUT``) output column; and the next step's block, loaded first: it
    does not depend on this step's product."""
    meta = table + j * NF
    kind = tl.load(meta)
    add = tl.load(meta + 5).to(tl.int64)
    out = add
    if OUT:
        out = tl.load(meta + 6).to(tl.int64)
    a, d = nxt, nxt_d
    if j + 1 < end:
        nxt, nxt_d = _run_block(s_ptr, prow, meta + NF, rows, ks, m, NF)
    return a, d, kind, add, out, nxt, nxt_d


@triton.jit
def run_compose_kernel(
    s_ptr, p_ptr, v_ptr, c_ptr,  # shared values, per-sample values (B, N_P), vectors (B, N_V), chunk maps
    table, steps, m, chunk, stride_p, stride_v, stride_c,
    NF: tl.constexpr, BM: tl.constexpr, PRECISION: tl.constexpr,
):
    c, smp, prow, vrow, rows, ks = _chunk_program(p_ptr, v_ptr, stride_p, stride_v, BM)
    # [I | 0]: the identity on the first m columns, the chunk's additive term in column m
    acc = tl.where((rows[:, None] == ks[None, :]) & (rows[:, None] < m), 1.0, 0.0).to(v_ptr.dtype.element_ty)
    j, end, nxt, nxt_d = _chunk_first(s_ptr, prow, table, c, chunk, steps, rows, ks, m, NF)
    while j < end:
        a, d, kind, add, _, nxt, nxt_d = _chunk_step(s_ptr, prow, table, j, end, rows, ks, m, nxt, nxt_d, NF, False)
        if kind == 1:
            acc = tl.dot(a, acc, input_precision=PRECISION)
        else:  # a diagonal scales the rows: no product
            acc = acc * d[:, None]
        addv = tl.load(vrow + add + rows, mask=(rows < m) & (add >= 0), other=0.0)
        acc += tl.where(ks[None, :] == m, addv[:, None], 0.0)
        j += 1
    tl.store(c_ptr + smp * stride_c + c * (BM * BM) + rows[:, None] * BM + ks[None, :], acc)


@triton.jit(do_not_specialize=["chunks"])  # a loop bound of 0 (chunks == 1) crashed Triton 3.6's coalesce pass
def run_carry_kernel(
    c_ptr, v_ptr, e_ptr,  # chunk maps and entry vectors (B, stride_c), vectors (B, N_V)
    vin0, chunks, m, stride_v, stride_c, e_off,
    BM: tl.constexpr,
):
    smp = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BM)
    crow = c_ptr + smp * stride_c
    erow = e_ptr + smp * stride_c + e_off
    y = tl.load(v_ptr + smp * stride_v + vin0 + rows, mask=rows < m, other=0.0)
    nxt = tl.load(crow + rows[:, None] * BM + rows[None, :])
    c = 0
    while c < chunks - 1:
        p = nxt
        if c + 2 < chunks:  # the next chunk's map does not depend on y: load it first
            nxt = tl.load(crow + (c + 1) * (BM * BM) + rows[:, None] * BM + rows[None, :])
        tl.store(erow + c * BM + rows, y)
        y = tl.sum(p * tl.where(rows == m, 1.0, y)[None, :], axis=1)  # [y; 1]: the map's additive column
        c += 1
    tl.store(erow + c * BM + rows, y)


@triton.jit
def run_expand_kernel(
    s_ptr, p_ptr, v_ptr, e_ptr,  # shared values, per-sample values (B, N_P), vectors (B, N_V), entries
    table, steps, m, chunk, stride_p, stride_v, stride_c, e_off,
    NF: tl.constexpr, BM: tl.constexpr,
):
    c, smp, prow, vrow, rows, ks = _chunk_program(p_ptr, v_ptr, stride_p, stride_v, BM)
    y = tl.load(e_ptr + smp * stride_c + e_off + c * BM + rows, mask=rows < m, other=0.0)
    j, end, nxt, nxt_d = _chunk_first(s_ptr, prow, table, c, chunk, steps, rows, ks, m, NF)
    while j < end:
        a, d, kind, add, out, nxt, nxt_d = _chunk_step(s_ptr, prow, table, j, end, rows, ks, m, nxt, nxt_d, NF, True)
        if kind == 1:
            y = tl.sum(a * y[None, :], axis=1)
        else:
            y = d * y
        y += tl.load(vrow + add + rows, mask=(rows < m) & (add >= 0), other=0.0)
        tl.store(vrow + out + rows, y, mask=rows < m)
        j += 1


# --- a run of diagonals, parallel over its steps and its lanes --------------------------------------
#
# When every step is an ``m``-entry diagonal (the quasi-Newton forward's ``J_t``), each of the
# ``batch * m`` lanes (sample, entry) is its own scalar recurrence ``y <- d_j y + add_j``. The same
# three phases as above then work on vectors of lanes instead of ``m x m`` tiles (compose and expand
# are one kernel, ``diag_chunk_kernel``: both walk a chunk's steps with that recurrence): a chunk's map is
# a scale and a shift per lane (``m`` multiply-adds per step and sample instead of ``m^3``), and a
# program serves ``BLOCK_L`` lanes of any samples, so ``m`` has no upper bound. Working memory per
# sample: every chunk's scales, shifts and entries (``3 * chunks * m``, laid out in that order).


@triton.jit
def _diag_lanes(p_ptr, v_ptr, lanes, m, stride_p, stride_v, BLOCK_L: tl.constexpr):
    """This program's lanes (block ``program_id(0)``): validity, sample, entry, and each lane's
    element in the rows of ``p_ptr`` and ``v_ptr`` (per-sample values or scratch, and vectors)."""
    lane = tl.program_id(0).to(tl.int64) * BLOCK_L + tl.arange(0, BLOCK_L)
    ok = lane < lanes
    smp = lane // m
    u = lane % m
    return ok, smp, u, p_ptr + smp * stride_p + u, v_ptr + smp * stride_v + u


@triton.jit
def _diag_step(s_ptr, prow, vrow, meta, ok, u):
    """Step ``meta``'s diagonal entries (shared or per sample) and additive term (0 without one)."""
    sh = tl.load(meta + 1)
    off = tl.load(meta + 4).to(tl.int64)
    add = tl.load(meta + 5).to(tl.int64)
    d = tl.load(s_ptr + off + u, mask=ok & (sh != 0), other=0.0) + tl.load(prow + off, mask=ok & (sh == 0), other=0.0)
    return d, tl.load(vrow + add, mask=ok & (add >= 0), other=0.0)


@triton.jit
def diag_chunk_kernel(
    s_ptr, p_ptr, v_ptr, c_ptr,  # shared values, per-sample values (B, N_P), vectors (B, N_V), scratch
    table, steps, m, lanes, chunk, chunks, stride_p, stride_v, stride_c,
    NF: tl.constexpr, BLOCK_L: tl.constexpr, EXPAND: tl.constexpr,
):
    """Walk chunk ``program_id(1)``'s steps for lane block ``program_id(0)``. Both phases run the same recurrence
    ``shift <- d_j shift + add_j``: composing (``EXPAND`` false) from 0, also multiplying up the
    ``scale``, and storing both at the end; expanding from the chunk's entry, storing every ``y_j``."""
    c = tl.program_id(1)
    ok, smp, u, prow, vrow = _diag_lanes(p_ptr, v_ptr, lanes, m, stride_p, stride_v, BLOCK_L)
    crow = c_ptr + smp * stride_c + u
    scale = tl.full([BLOCK_L], 1.0, dtype=v_ptr.dtype.element_ty)
    if EXPAND:
        shift = tl.load(crow + (2 * chunks + c) * m, mask=ok, other=0.0)
    else:
        shift = tl.zeros([BLOCK_L], dtype=v_ptr.dtype.element_ty)
    j = c * chunk
    end = tl.minimum(j + chunk, steps)
    d_next, a_next = _diag_step(s_ptr, prow, vrow, table + j * NF, ok, u)
    while j < end:
        d, a = d_next, a_next
        if j + 1 < end:  # the next step's terms do not depend on this one: load them first
            d_next, a_next = _diag_step(s_ptr, prow, vrow, table + (j + 1) * NF, ok, u)
        shift = d * shift + a
        if EXPAND:
            tl.store(vrow + tl.load(table + j * NF + 6).to(tl.int64), shift, mask=ok)
        else:
            scale = d * scale
        j += 1
    if not EXPAND:
        tl.store(crow + c * m, scale, mask=ok)
        tl.store(crow + (chunks + c) * m, shift, mask=ok)


@triton.jit(do_not_specialize=["chunks"])
def diag_carry_kernel(
    c_ptr, v_ptr,  # scratch (B, stride_c), vectors (B, N_V)
    vin0, m, lanes, chunks, stride_v, stride_c,
    BLOCK_L: tl.constexpr,
):
    ok, smp, u, crow, vrow = _diag_lanes(c_ptr, v_ptr, lanes, m, stride_c, stride_v, BLOCK_L)
    erow = crow + 2 * chunks * m
    y = tl.load(vrow + vin0, mask=ok, other=0.0)
    c = 0
    while c < chunks - 1:
        tl.store(erow + c * m, y, mask=ok)
        y = tl.load(crow + c * m, mask=ok, other=0.0) * y + tl.load(crow + (chunks + c) * m, mask=ok, other=0.0)
        c += 1
    tl.store(erow + c * m, y, mask=ok)


def diagonal_size(op) -> int:
    """The common size ``m`` of a :class:`~spscan.planner.program.LinearRun` every step of which is an
    ``m``-entry diagonal (what the diagonal kernels take), else 0."""
    if not op.steps:
        return 0
    m = int(op.rows[0])
    ok = np.all(op.rows == m) and np.all(op.cols == m) and not np.any(op.sparse) and not np.any(op.dense)
    return m if ok else 0


def chunked_size(op) -> int:
    """The common size ``m`` of a :class:`~spscan.planner.program.LinearRun` every step of which is a
    square ``m x m`` dense block or diagonal (what the chunked kernels take), else 0."""
    if not op.steps:
        return 0
    m = int(op.rows[0])
    ok = np.all(op.rows == m) and np.all(op.cols == m) and not np.any(op.sparse)
    return m if ok else 0


def linear_run_chunked(table: torch.Tensor, vin0: int, s: torch.Tensor, p: torch.Tensor,
                       v: torch.Tensor, scratch: torch.Tensor,
                       cfg: "launch.ChunkedRunConfig | launch.DiagonalRunConfig",
                       precision: Optional[str] = None) -> None:
    """Run a uniform linear run (every step an ``m x m`` dense block or diagonal; see
    :func:`chunked_size`) parallel over its steps, in place on ``v``: compose each chunk's map, carry
    the entry vectors across chunks, expand every chunk (see the comment above the kernels). With a
    :class:`~spscan.kernels.triton.launch.DiagonalRunConfig` (a run of diagonals only, see
    :func:`diagonal_size`) the same three phases run per lane.

    ``scratch``: ``(B, >= cfg.scratch_per_sample)`` working memory of ``v``'s dtype (rows may be strided); ``cfg`` from
    :func:`~spscan.kernels.triton.launch.chunked_run_config` (or ``diagonal_run_config``) for this run's ``m`` and step count.
    ``precision`` of the chunk maps' products (``tl.dot``'s ``input_precision``): by default
    :func:`~spscan.kernels.triton.launch.input_precision` of ``v``'s dtype (exact unless
    ``launch.dot_precision`` says otherwise for float32).
    """
    if precision is None:
        precision = launch.input_precision(v.dtype)
    steps = int(table.shape[0])
    batch = v.shape[0]
    if steps == 0 or batch == 0:
        return
    if scratch.dim() != 2 or scratch.shape[0] != batch or scratch.shape[1] < cfg.scratch_per_sample \
            or scratch.stride(1) != 1 or scratch.dtype != v.dtype:
        raise ValueError(f"linear_run_chunked: expected a {v.dtype} scratch ({batch}, >= {cfg.scratch_per_sample}) "
                         f"with unit column stride, got {tuple(scratch.shape)} {scratch.dtype}")
    if isinstance(cfg, launch.DiagonalRunConfig):
        _diagonal_run(table, vin0, s, p, v, scratch, cfg)
        return
    m, bm, chunks = cfg.m, cfg.block_m, cfg.chunks
    stride_c = scratch.stride(0)
    e_off = chunks * bm * bm
    common = dict(s_ptr=s, p_ptr=p, v_ptr=v, table=table, steps=steps, m=m, chunk=cfg.chunk,
                  stride_p=p.stride(0), stride_v=v.stride(0), stride_c=stride_c)
    if chunks > 1:
        launch.launch(run_compose_kernel, (chunks - 1, batch), dict(common, c_ptr=scratch),
                      dict(NF=FIELDS, BM=bm, PRECISION=precision), cfg.num_warps)
    if chunks == 1:  # the only chunk starts from y_0: no carry
        scratch[:, e_off: e_off + m].copy_(v[:, vin0: vin0 + m])
    else:
        launch.launch(run_carry_kernel, (batch,),
                      dict(c_ptr=scratch, v_ptr=v, e_ptr=scratch, vin0=vin0, chunks=chunks, m=m, stride_v=v.stride(0),
                           stride_c=stride_c, e_off=e_off),
                      dict(BM=bm), cfg.num_warps)
    launch.launch(run_expand_kernel, (chunks, batch), dict(common, e_ptr=scratch, e_off=e_off),
                  dict(NF=FIELDS, BM=bm), cfg.num_warps)


def _diagonal_run(table: torch.Tensor, vin0: int, s: torch.Tensor, p: torch.Tensor, v: torch.Tensor,
                  scratch: torch.Tensor, cfg: "launch.DiagonalRunConfig") -> None:
    """A run of ``m``-entry diagonals in chunks, per lane (see the comment above the diagonal kernels)."""
    steps, batch = int(table.shape[0]), v.shape[0]
    m, chunks, block = cfg.m, cfg.chunks, cfg.block_l
    lanes = batch * m
    lane_blocks = triton.cdiv(lanes, block)
    common = dict(s_ptr=s, p_ptr=p, v_ptr=v, c_ptr=scratch, table=table, steps=steps, m=m, lanes=lanes,
                  chunk=cfg.chunk, chunks=chunks, stride_p=p.stride(0), stride_v=v.stride(0),
                  stride_c=scratch.stride(0))
    consts = dict(NF=FIELDS, BLOCK_L=block)
    if chunks > 1:
        launch.launch(diag_chunk_kernel, (lane_blocks, chunks - 1), common, dict(consts, EXPAND=False),
                      cfg.num_warps)
        launch.launch(diag_carry_kernel, (lane_blocks,),
                      dict(c_ptr=scratch, v_ptr=v, vin0=vin0, m=m, lanes=lanes, chunks=chunks,
                           stride_v=v.stride(0), stride_c=scratch.stride(0)),
                      dict(BLOCK_L=block), cfg.num_warps)
    else:  # the only chunk starts from y_0: no carry
        scratch[:, 2 * m: 3 * m].copy_(v[:, vin0: vin0 + m])
    launch.launch(diag_chunk_kernel, (lane_blocks, chunks), common, dict(consts, EXPAND=True), cfg.num_warps)
