"""Long linear recurrences with structured steps, parallel over their steps: the fused kernel family.

A :class:`~spscan.planner.recurrence.Recurrence` describes a linear run whose every step is the same
small structure: a matrix ``S`` shared by all steps and samples (dense blocks and diagonals), and a
per-step map ``E_s`` made of diagonal blocks (per-sample or shared values). In block form, with ``N``
the block size, the state ``y`` has ``NY`` blocks and the vector between the two parts ``NZ``::

    order 0:  u = E1_s y,  z = E2_s u (if E2),  y' = S z + a_s
    order 1:  z = S y,     u = E1_s z,          y' = E2_s u (if E2) + a_s

Both parts are grids of ``N x N`` blocks given as flat constexpr tuples (block ``(r, c)`` of a grid
with ``NI`` columns at ``(r * NI + c) * fields``; Triton takes one level of tuple): an ``E`` block is
``(kind, rel, stride)`` (kind 0 absent, 1 per-sample values, 2 shared values; entry ``i`` at
``rel + stride * i`` from the step's value base), an ``S`` block ``(kind, rel, rs, cs)`` (kind 1
dense, entry ``(i, k)`` at ``rel + rs * i + cs * k``; kind 2 diagonal, entry ``i`` at ``rel + rs * i``).

Three launches, as in :mod:`.linear_run`'s chunked runs, but built around the structure:

* **compose** (``recurrence_chunk_kernel``, ``EXPAND=False``): chunk ``c``'s map ``y_out = P_c y_in + v_c``
  is found by running the recurrence itself on *lanes*: lane ``(sample, col)`` starts from the unit
  vector ``e_col`` (``col < m``) or from zero (``col == m``, the affine lane, which alone receives the
  ``a_s`` terms). A program holds ``ROWS`` lanes of any samples as ``(ROWS, BN)`` tiles per block, so
  the shared part of every step is one ``tl.dot`` of the lane tile with the shared block, which sits
  in registers or shared memory for the whole launch; the per-step part reads only the step's
  diagonal entries. Per-step matrices are never formed or written.
* **carry** (``recurrence_carry_kernel``): one program per sample walks the chunk maps, writing each
  chunk's entry vector (``m`` entries).
* **expand** (``recurrence_chunk_kernel``, ``EXPAND=True``): one program per (chunk, block of ``ROWS``
  samples) runs its chunk's steps from the entry vector and writes every sub-step's output once
  (the vector after each part: ``u``, ``z`` and ``y'``), as the run's table asks.

The critical path is ``chunk + chunks + chunk`` dependent steps. Sums are fixed-order (``tl.dot``
and ``tl.sum`` over fixed tiles): bitwise deterministic. The kernels see only blocks, diagonals and
offsets; which layer made them is the planner's business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from spscan.kernels.triton import launch

if TYPE_CHECKING:  # annotations only: the planner's descriptor
    from spscan.planner.recurrence import Recurrence

__all__ = ["recurrence_chunk_kernel", "recurrence_carry_kernel", "run_recurrence", "recurrence_scratch"]


@triton.jit
def _pick(x0, x1, x2, x3, x4, I: tl.constexpr):
    """Block ``I`` of a vector held as up to five ``(rows, BN)`` tiles."""
    if I == 0:
        out = x0
    elif I == 1:
        out = x1
    elif I == 2:
        out = x2
    elif I == 3:
        out = x3
    else:
        out = x4
    return out


@triton.jit
def _pick_tile(t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, I: tl.constexpr):
    """Shared tile ``I`` (row-major over the ``S`` grid) of the ten a launch preloads."""
    if I < 5:
        out = _pick(t0, t1, t2, t3, t4, I)
    else:
        out = _pick(t5, t6, t7, t8, t9, I - 5)
    return out


@triton.jit
def _eblock(pv, sv, ok, cols, cok, G: tl.constexpr, I: tl.constexpr):
    """Block ``I`` (flat index) of a grid of diagonals: per-sample entries as ``(rows, BN)``, shared ones
    as ``(1, BN)``."""
    if G[I * 3] == 1:
        out = tl.load(pv + G[I * 3 + 1] + G[I * 3 + 2] * cols[None, :], mask=ok, other=0.0)
    else:
        out = tl.load(sv + G[I * 3 + 1] + G[I * 3 + 2] * cols, mask=cok, other=0.0)[None, :]
    return out


@triton.jit
def _erow(x0, x1, x2, x3, x4, pv, sv, ok, cols, cok, G: tl.constexpr, ROW: tl.constexpr, NI: tl.constexpr):
    """Output block ``ROW`` of a grid of diagonals: ``sum_c diag(G[ROW][c]) x_c``."""
    acc = tl.zeros_like(x0)
    for c in tl.static_range(NI):
        if G[(ROW * NI + c) * 3] != 0:  # per-sample (rows, BN) or shared (1, BN) entries
            acc += _eblock(pv, sv, ok, cols, cok, G, ROW * NI + c) * _pick(x0, x1, x2, x3, x4, c)
    return acc


@triton.jit
def _stile(sv, G: tl.constexpr, I: tl.constexpr, NI: tl.constexpr, NO: tl.constexpr, kk, ii, N: tl.constexpr,
           BN: tl.constexpr):
    """Dense block ``I`` (row-major over the ``NO x NI`` grid) transposed, as a ``(BN, BN)`` tile:
    ``T[k, i] = S_block[i, k]``; zero where the block is not dense."""
    tile = tl.zeros([BN, BN], dtype=sv.dtype.element_ty)
    if I < NO * NI:
        if G[I * 4] == 1:
            tile = tl.load(sv + G[I * 4 + 1] + G[I * 4 + 2] * ii[None, :] + G[I * 4 + 3] * kk[:, None],
                           mask=(kk[:, None] < N) & (ii[None, :] < N), other=0.0)
    return tile


@triton.jit
def _sdiag(sv, G: tl.constexpr, I: tl.constexpr, cols, cok):
    """Diagonal block ``I`` (flat index) of the shared part, as ``(1, BN)``."""
    return tl.load(sv + G[I * 4 + 1] + G[I * 4 + 2] * cols, mask=cok, other=0.0)[None, :]


@triton.jit
def _store(ptr, x0, x1, x2, x3, x4, NB: tl.constexpr, N: tl.constexpr, ok, cols):
    """Store a vector of ``NB`` blocks at ``ptr`` (``(rows, 1)`` pointers), block ``b`` at ``b * N``."""
    tl.store(ptr + cols[None, :], x0, mask=ok)
    if NB > 1:
        tl.store(ptr + N + cols[None, :], x1, mask=ok)
    if NB > 2:
        tl.store(ptr + 2 * N + cols[None, :], x2, mask=ok)
    if NB > 3:
        tl.store(ptr + 3 * N + cols[None, :], x3, mask=ok)
    if NB > 4:
        tl.store(ptr + 4 * N + cols[None, :], x4, mask=ok)


@triton.jit
def recurrence_chunk_kernel(
    s_ptr, p_ptr, v_ptr, c_ptr,  # shared values, per-sample values (B, N_P), vectors (B, N_V), scratch (B, stride_c)
    s_base, p_base, p_step, stride_p,  # shared blocks from s_base; step s's per-sample values at p_base + s * p_step
    v_in, out_base, out_step, add_base, add_step, adds, stride_v,  # y_0, outputs, a_s (steps s < adds)
    steps, chunk, rows_total, m, stride_c, e_off,  # rows: lanes (compose) or samples (expand)
    N: tl.constexpr, BN: tl.constexpr, NY: tl.constexpr, NZ: tl.constexpr, K1: tl.constexpr,
    ORDER: tl.constexpr, E1: tl.constexpr, E2: tl.constexpr, HAS_E2: tl.constexpr, SG: tl.constexpr,
    OUTS: tl.constexpr,
    HAS_ADD: tl.constexpr, AFFINE: tl.constexpr, EXPAND: tl.constexpr, ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Walk chunk ``program_id(1)``'s steps for row block ``program_id(0)``: composing its map on lanes
    (``EXPAND`` false: lane ``(sample, col)``, ``col <= m``; stores the ``m + AFFINE`` columns of the
    map) or expanding it from each sample's entry vector (``EXPAND``: stores every sub-step's output)."""
    dt = v_ptr.dtype.element_ty
    c = tl.program_id(1)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = r < rows_total
    m1 = m + AFFINE
    if EXPAND:
        smp = r
        col = r * 0
    else:
        smp = r // m1
        col = r % m1
    cols = tl.arange(0, BN)
    kk = tl.arange(0, BN)
    cok = cols < N
    ok = row_ok[:, None] & cok[None, :]
    sv = s_ptr + s_base
    # the shared part's dense blocks: loaded once, held for every step of the chunk
    if ORDER == 0:
        SNO: tl.constexpr = NY
        SNI: tl.constexpr = NZ
    else:
        SNO: tl.constexpr = NZ
        SNI: tl.constexpr = NY
    t0 = _stile(sv, SG, 0, SNI, SNO, kk, cols, N, BN)
    t1 = _stile(sv, SG, 1, SNI, SNO, kk, cols, N, BN)
    t2 = _stile(sv, SG, 2, SNI, SNO, kk, cols, N, BN)
    t3 = _stile(sv, SG, 3, SNI, SNO, kk, cols, N, BN)
    t4 = _stile(sv, SG, 4, SNI, SNO, kk, cols, N, BN)
    t5 = _stile(sv, SG, 5, SNI, SNO, kk, cols, N, BN)
    t6 = _stile(sv, SG, 6, SNI, SNO, kk, cols, N, BN)
    t7 = _stile(sv, SG, 7, SNI, SNO, kk, cols, N, BN)
    t8 = _stile(sv, SG, 8, SNI, SNO, kk, cols, N, BN)
    t9 = _stile(sv, SG, 9, SNI, SNO, kk, cols, N, BN)
    vrow = v_ptr + smp[:, None] * stride_v
    if EXPAND:  # the chunk's entry vector (compact, m entries)
        erow = c_ptr + smp[:, None] * stride_c + e_off + c * m
        y0 = tl.load(erow + cols[None, :], mask=ok, other=0.0)
        y1 = tl.load(erow + N + cols[None, :], mask=ok & (NY > 1), other=0.0)
    else:  # the unit vector e_col (zero for the affine lane col == m)
        y0 = tl.where(ok & (col[:, None] == cols[None, :]), 1.0, 0.0).to(dt)
        y1 = tl.where(ok & (col[:, None] == N + cols[None, :]) & (NY > 1), 1.0, 0.0).to(dt)
    zero = tl.zeros_like(y0)
    pv0 = p_ptr + smp[:, None] * stride_p + p_base
    s = c * chunk
    end = tl.minimum(s + chunk, steps)
    while s < end:
        pv = pv0 + s * p_step
        orow = vrow + out_base + s * out_step  # this step's outputs (written when expanding)
        acc0 = zero
        acc1 = zero
        if ORDER == 0:
            # y' = S z, z = E2 E1 y: each block of z is formed when its products with S are due, so one
            # z tile is live at a time (E1's blocks are recomputed per use: elementwise work)
            for zb in tl.static_range(NZ):
                if HAS_E2:
                    zc = zero
                    for kb in tl.static_range(K1):
                        if E2[(zb * K1 + kb) * 3] != 0:
                            uk = _erow(y0, y1, zero, zero, zero, pv, sv, ok, cols, cok, E1, kb, NY)
                            if EXPAND:
                                tl.store(orow + OUTS[0] + kb * N + cols[None, :], uk, mask=ok)
                            zc += _eblock(pv, sv, ok, cols, cok, E2, zb * K1 + kb) * uk
                    if EXPAND:
                        tl.store(orow + OUTS[1] + zb * N + cols[None, :], zc, mask=ok)
                else:
                    zc = _erow(y0, y1, zero, zero, zero, pv, sv, ok, cols, cok, E1, zb, NY)
                    if EXPAND:
                        tl.store(orow + OUTS[0] + zb * N + cols[None, :], zc, mask=ok)
                for rb in tl.static_range(NY):
                    if SG[(rb * NZ + zb) * 4] == 1:
                        tile = _pick_tile(t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, rb * NZ + zb)
                        if rb == 0:
                            acc0 = tl.dot(zc, tile, acc0, input_precision=PRECISION, out_dtype=acc0.dtype)
                        else:
                            acc1 = tl.dot(zc, tile, acc1, input_precision=PRECISION, out_dtype=acc1.dtype)
                    elif SG[(rb * NZ + zb) * 4] == 2:
                        d = _sdiag(sv, SG, rb * NZ + zb, cols, cok)
                        if rb == 0:
                            acc0 += zc * d
                        else:
                            acc1 += zc * d
        else:
            # z = S y, y' = E2 E1 z: each block of z is formed once and folded into E1's outputs at once
            ua0 = zero
            ua1 = zero
            ua2 = zero
            ua3 = zero
            ua4 = zero
            for zb in tl.static_range(NZ):
                zc = zero
                for jb in tl.static_range(NY):
                    if SG[(zb * NY + jb) * 4] == 1:
                        zc = tl.dot(_pick(y0, y1, zero, zero, zero, jb),
                                    _pick_tile(t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, zb * NY + jb), zc,
                                    input_precision=PRECISION, out_dtype=zc.dtype)
                    elif SG[(zb * NY + jb) * 4] == 2:
                        zc += _pick(y0, y1, zero, zero, zero, jb) * _sdiag(sv, SG, zb * NY + jb, cols, cok)
                if EXPAND:
                    tl.store(orow + OUTS[0] + zb * N + cols[None, :], zc, mask=ok)
                for kb in tl.static_range(K1):
                    if E1[(kb * NZ + zb) * 3] != 0:
                        part = _eblock(pv, sv, ok, cols, cok, E1, kb * NZ + zb) * zc
                        if HAS_E2:
                            if kb == 0:
                                ua0 += part
                            elif kb == 1:
                                ua1 += part
                            elif kb == 2:
                                ua2 += part
                            elif kb == 3:
                                ua3 += part
                            else:
                                ua4 += part
                        elif kb == 0:
                            acc0 += part
                        else:
                            acc1 += part
            if HAS_E2:
                for kb in tl.static_range(K1):
                    uk = _pick(ua0, ua1, ua2, ua3, ua4, kb)
                    if EXPAND:
                        tl.store(orow + OUTS[1] + kb * N + cols[None, :], uk, mask=ok)
                    for rb in tl.static_range(NY):
                        if E2[(rb * K1 + kb) * 3] != 0:
                            if rb == 0:
                                acc0 += _eblock(pv, sv, ok, cols, cok, E2, rb * K1 + kb) * uk
                            else:
                                acc1 += _eblock(pv, sv, ok, cols, cok, E2, rb * K1 + kb) * uk
        y0 = acc0
        y1 = acc1
        if HAS_ADD:  # a_s: every sample row when expanding, the affine lane only when composing
            a_ok = ok & (s < adds)
            if not EXPAND:
                a_ok = a_ok & (col[:, None] == m)
            arow = vrow + add_base + s * add_step
            y0 += tl.load(arow + cols[None, :], mask=a_ok, other=0.0)
            if NY > 1:
                y1 += tl.load(arow + N + cols[None, :], mask=a_ok, other=0.0)
        if EXPAND:  # the state, where the run's table puts the period's last output
            _store(orow + OUTS[2 if HAS_E2 else 1], y0, y1, zero, zero, zero, NY, N, ok, cols)
        s += 1
    if not EXPAND:  # lane (sample, col) holds column col of the chunk's map (col == m: its additive term)
        mrow = c_ptr + smp[:, None] * stride_c + (c * m1 + col[:, None]) * (NY * BN)
        tl.store(mrow + cols[None, :], y0, mask=ok)
        if NY > 1:
            tl.store(mrow + BN + cols[None, :], y1, mask=ok)


@triton.jit(do_not_specialize=["chunks"])  # a loop bound of 0 (chunks == 1) crashed Triton 3.6's coalesce pass
def recurrence_carry_kernel(
    c_ptr, v_ptr,  # scratch (B, stride_c), vectors (B, N_V)
    v_in, chunks, m, stride_v, stride_c, e_off,
    N: tl.constexpr, BN: tl.constexpr, NY: tl.constexpr, AFFINE: tl.constexpr, MP: tl.constexpr,
):
    """Entry vector of every chunk for sample ``program_id(0)``: ``e_0 = y_0``, ``e_{c+1} = P_c e_c + v_c``.

    Chunk ``c``'s map is stored lane by lane (row ``col`` = column ``col`` of ``P_c``, blocks padded to
    ``BN``); it is read as an ``(m + AFFINE) x m`` tile in compact order, and ``e`` carries a trailing 1
    for the additive row."""
    smp = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, MP)  # input entry (map row)
    i = tl.arange(0, MP)  # output entry
    m1 = m + AFFINE
    pad = (i // N) * BN + i % N
    tok = (j[:, None] < m1) & (i[None, :] < m)
    width = NY * BN
    crow = c_ptr + smp * stride_c
    erow = crow + e_off
    one = tl.where(j == m, 1.0, 0.0).to(v_ptr.dtype.element_ty)
    y = tl.load(v_ptr + smp * stride_v + v_in + j, mask=j < m, other=0.0) + one
    nxt = tl.load(crow + j[:, None] * width + pad[None, :], mask=tok & (chunks > 1), other=0.0)
    k = 0
    while k < chunks - 1:
        p = nxt
        if k + 2 < chunks:  # the next map does not depend on y: load it first
            nxt = tl.load(crow + ((k + 1) * m1 + j[:, None]) * width + pad[None, :], mask=tok, other=0.0)
        tl.store(erow + k * m + j, y, mask=j < m)
        y = tl.sum(p * y[:, None], axis=0) + one
        k += 1
    tl.store(erow + k * m + j, y, mask=j < m)


def _flat(grid: tuple) -> tuple:
    """A block grid (rows of block tuples) as the flat tuple of ints the kernels index: block ``(r, c)``'s
    fields at ``(r * columns + c) * fields``."""
    return tuple(int(f) for row in grid for blk in row for f in blk)


def recurrence_scratch(rec: "Recurrence", cfg: "launch.RecurrenceConfig") -> int:
    """Working entries per sample of a recurrence run: every chunk's map (lane by lane, blocks padded)
    and entry vector."""
    return cfg.chunks * ((rec.m + rec.affine) * rec.ny * cfg.block_n + rec.m)


def run_recurrence(rec: "Recurrence", s: torch.Tensor, p: torch.Tensor, v: torch.Tensor, scratch: torch.Tensor,
                   cfg: "launch.RecurrenceConfig", phases: str = "compose,carry,expand") -> None:
    """Run the structured recurrence ``rec`` (see the module docstring) in place on ``v``.

    ``s``: the shared values ``(N_S,)``; ``p``: per-sample values ``(B, N_P)``; ``v``: vectors ``(B, N_V)``;
    ``scratch``: ``(B, >= recurrence_scratch(rec, cfg))`` of ``v``'s dtype with unit column stride;
    ``cfg`` from :func:`~spscan.kernels.triton.launch.recurrence_config`. ``phases``: the launches to make (all
    three for a result; one alone times that phase, each reading what the previous call left).
    """
    batch = v.shape[0]
    if rec.steps == 0 or batch == 0:
        return
    need = recurrence_scratch(rec, cfg)
    if scratch.dim() != 2 or scratch.shape[0] != batch or scratch.shape[1] < need or scratch.stride(1) != 1 \
            or scratch.dtype != v.dtype:
        raise ValueError(f"run_recurrence: expected a {v.dtype} scratch ({batch}, >= {need}) with unit column stride, "
                         f"got {tuple(scratch.shape)} {scratch.dtype}")
    chunks = cfg.chunks
    e_off = chunks * (rec.m + rec.affine) * rec.ny * cfg.block_n
    exact = v.dtype != torch.float32
    args = dict(s_ptr=s, p_ptr=p, v_ptr=v, c_ptr=scratch, s_base=rec.s_base, p_base=rec.p_base, p_step=rec.p_step,
                stride_p=p.stride(0), v_in=rec.v_in, out_base=rec.out_base, out_step=rec.out_step,
                add_base=rec.add_base, add_step=rec.add_step, adds=rec.adds, stride_v=v.stride(0),
                steps=rec.steps, chunk=cfg.chunk, m=rec.m, stride_c=scratch.stride(0), e_off=e_off)
    consts = dict(N=rec.n, BN=cfg.block_n, NY=rec.ny, NZ=rec.nz, K1=rec.k1, ORDER=rec.order, E1=_flat(rec.e1),
                  E2=_flat(rec.e2), HAS_E2=len(rec.e2) > 0, SG=_flat(rec.sg), OUTS=rec.outs, HAS_ADD=rec.adds > 0,
                  AFFINE=rec.affine)
    if chunks > 1 and "compose" in phases:
        lanes = batch * (rec.m + rec.affine)
        rows = cfg.lanes(v.element_size())
        launch.launch(recurrence_chunk_kernel, (triton.cdiv(lanes, rows), chunks - 1),
                      dict(args, rows_total=lanes),
                      dict(consts, EXPAND=False, ROWS=rows,
                           PRECISION="ieee" if exact else cfg.compose_precision), cfg.compose_warps)
    if "carry" in phases:
        launch.launch(recurrence_carry_kernel, (batch,),
                      dict(c_ptr=scratch, v_ptr=v, v_in=rec.v_in, chunks=chunks, m=rec.m, stride_v=v.stride(0),
                           stride_c=scratch.stride(0), e_off=e_off),
                      dict(N=rec.n, BN=cfg.block_n, NY=rec.ny, AFFINE=rec.affine,
                           MP=launch.next_pow2(rec.m + rec.affine)), cfg.carry_warps)
    if "expand" in phases:
        launch.launch(recurrence_chunk_kernel, (triton.cdiv(batch, cfg.expand_rows), chunks),
                      dict(args, rows_total=batch),
                      dict(consts, EXPAND=True, ROWS=cfg.expand_rows,
                           PRECISION="ieee" if exact else cfg.expand_precision), cfg.expand_warps)
