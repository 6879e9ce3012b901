"""Row-wise numeric SpGEMM over precomputed output patterns, in Triton: O(nnz) index data.

For ``C = A @ B`` with ``C``'s pattern planned once (:mod:`spscan.planner.rowwise`), one program
owns one output row ``i`` for ``BLOCK_B`` samples. It zeroes the row, then for each stored
``A[i, k]`` in ascending ``k`` reads ``B``'s row ``k`` in chunks of ``BLOCK_J`` entries, finds
each ``B[k, j]``'s position in ``C``'s row by a binary search of ``j`` in the row's sorted
columns (``j`` itself when the row is full), and adds ``A[i, k] * B[k, j]`` there. Within one
``k`` the positions are distinct, and a block barrier separates consecutive ``k``, so the
read-add-write of the row is race free without atomics, and every entry is summed in ascending
``k``: bitwise reproducible. The host tables hold, per entry of ``A``, its value slot and
``B``-row; per row of ``B``, its value slot, column start and length; the columns of ``B`` and
``C``; per output row, six scalars — never a per-pair index.

A step's products are concatenated into one :class:`RowsTable` (rows sorted by pair count,
longest first), so a step is one launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from spscan.planner.patterns import Pattern
from spscan.planner.program import RowProduct

from spscan.kernels.triton import launch
from spscan.kernels.triton.segments import index_dtype
from spscan.kernels.triton.spgemm import product_operands, row_stride

__all__ = ["spgemm_rows_kernel", "RowsTable", "rows_table", "rows_config", "spgemm_rows",
           "spgemm_rows_product"]


@triton.jit
def spgemm_rows_kernel(
    a_ptr, b_ptr, c_ptr,  # value arenas: shared (N,) or per sample (B, N) with row stride
    row_a, row_alen, row_c, row_ccol, row_clen, row_steps,  # per output row (long-first)
    ae_val, ae_brow,  # per entry of A: value slot, row of B (into the br_* tables)
    br_val, br_col, br_len,  # per row of B: first value slot, first column position, length
    cols,  # columns of B's and C's patterns, concatenated
    batch, stride_a, stride_b, stride_c,
    A_SHARED: tl.constexpr, B_SHARED: tl.constexpr, C_SHARED: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_J: tl.constexpr,
):
    r = tl.program_id(0)
    pid_b = tl.program_id(1)
    smp = (pid_b * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    smp_ok = smp < batch
    lane = tl.arange(0, BLOCK_J)
    a0 = tl.load(row_a + r).to(tl.int64)
    alen = tl.load(row_alen + r)
    c0 = tl.load(row_c + r).to(tl.int64)
    cc0 = tl.load(row_ccol + r).to(tl.int64)
    clen = tl.load(row_clen + r)
    steps = tl.load(row_steps + r)  # binary-search depth; -1: the row is full (position = column)
    if C_SHARED:
        c_row = c_ptr + c0 + smp[:, None] * 0
    else:
        c_row = c_ptr + smp[:, None] * stride_c + c0
    zero = tl.zeros([BLOCK_B, BLOCK_J], dtype=c_ptr.dtype.element_ty)
    # run-time loop bounds are while loops: Triton 3.6's interpreter cannot take them in range()
    z0 = 0
    while z0 < clen:
        pos = z0 + lane
        tl.store(c_row + pos[None, :], zero, mask=smp_ok[:, None] & (pos < clen)[None, :])
        z0 += BLOCK_J
    tl.debug_barrier()
    t = 0
    while t < alen:
        e = a0 + t
        slot_a = tl.load(ae_val + e).to(tl.int64)
        g = tl.load(ae_brow + e).to(tl.int64)
        bv0 = tl.load(br_val + g).to(tl.int64)
        bc0 = tl.load(br_col + g).to(tl.int64)
        blen = tl.load(br_len + g)
        if A_SHARED:
            va = tl.load(a_ptr + slot_a + smp * 0)
        else:
            va = tl.load(a_ptr + smp * stride_a + slot_a, mask=smp_ok, other=0.0)
        j0 = 0
        while j0 < blen:
            lj = j0 + lane
            ok = lj < blen
            col = tl.load(cols + bc0 + lj, mask=ok, other=0).to(tl.int64)
            if B_SHARED:
                vb = tl.load(b_ptr + bv0 + lj, mask=ok, other=0.0)[None, :]
            else:
                vb = tl.load(b_ptr + smp[:, None] * stride_b + bv0 + lj[None, :],
                             mask=smp_ok[:, None] & ok[None, :], other=0.0)
            lo = tl.zeros([BLOCK_J], dtype=tl.int64)
            hi = lo + clen
            it = 0
            while it < steps:  # lower bound of col in C's row (it is always there)
                active = lo < hi
                mid = (lo + hi) // 2
                v = tl.load(cols + cc0 + mid, mask=ok & active, other=0)
                right = v < col
                lo = tl.where(active & right, mid + 1, lo)
                hi = tl.where(active & (v >= col), mid, hi)
                it += 1
            pos = tl.where(steps < 0, col, lo)
            ptrs = c_row + pos[None, :]
            m2 = smp_ok[:, None] & ok[None, :]
            cur = tl.load(ptrs, mask=m2, other=0.0)
            tl.store(ptrs, cur + va[:, None] * vb, mask=m2)
            j0 += BLOCK_J
        tl.debug_barrier()  # the next k may add to the same entries
        t += 1


@dataclass
class RowsTable:
    """Device index tables of a step's row-wise products (see the module docstring for the fields)."""

    row_a: torch.Tensor
    row_alen: torch.Tensor
    row_c: torch.Tensor
    row_ccol: torch.Tensor
    row_clen: torch.Tensor
    row_steps: torch.Tensor
    ae_val: torch.Tensor
    ae_brow: torch.Tensor
    br_val: torch.Tensor
    br_col: torch.Tensor
    br_len: torch.Tensor
    cols: torch.Tensor
    nrows: int
    npairs: int
    max_b_row: int

    def index_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.row_a, self.row_alen, self.row_c, self.row_ccol, self.row_clen, self.row_steps, self.ae_val,
            self.ae_brow, self.br_val, self.br_col, self.br_len, self.cols))


def _search_steps(lengths: np.ndarray) -> np.ndarray:
    """Binary-search depth that finds any column in a sorted row of ``lengths`` entries."""
    steps = np.zeros(lengths.shape, dtype=np.int64)
    pos = lengths > 0
    steps[pos] = np.ceil(np.log2(lengths[pos] + 1)).astype(np.int64)
    return steps


def rows_table(products: Sequence[RowProduct], arena_sizes: Sequence[int], device: torch.device) -> RowsTable:
    """Concatenate a step's products into one long-first :class:`RowsTable` on ``device``.

    ``arena_sizes``: sizes of the arenas indexed (int32 tables when every index fits).
    """
    row_parts = {k: [] for k in ("a", "alen", "c", "ccol", "clen", "steps", "pairs")}
    ae_val, ae_brow, br_val, br_col, br_len, cols = [], [], [], [], [], []
    n_ae = n_br = n_cols = 0
    for pr in products:
        a, b, c = pr.a, pr.b, pr.c
        if a.cols != b.rows or c.shape != (a.rows, b.cols):
            raise ValueError(f"rows_table: shapes do not chain: A {a.shape}, B {b.shape}, C {c.shape}")
        b_len = b.row_lengths()
        # B's rows, then C's columns, appended to the shared column table
        br_val.append(pr.b_offset + b.indptr[:-1])
        br_col.append(n_cols + b.indptr[:-1])
        br_len.append(b_len)
        cols.append(b.indices)
        c_col0 = n_cols + b.nnz
        full = c.is_full  # a full row's position is the column itself: its columns are never read
        if not full:
            cols.append(c.indices)
        n_cols += b.nnz + (0 if full else c.nnz)
        ae_val.append(pr.a_offset + np.arange(a.nnz, dtype=np.int64))
        ae_brow.append(n_br + a.indices)
        n_br += b.rows
        clen = c.row_lengths()
        pairs = np.zeros(a.rows, dtype=np.int64)
        if a.nnz:
            cs = np.concatenate([[0], np.cumsum(b_len[a.indices])])
            pairs = cs[a.indptr[1:]] - cs[a.indptr[:-1]]
        steps = np.where(clen == c.cols, -1, _search_steps(clen))
        if full:
            steps[:] = -1
        row_parts["a"].append(n_ae + a.indptr[:-1])
        row_parts["alen"].append(a.row_lengths())
        row_parts["c"].append(pr.c_offset + c.indptr[:-1])
        row_parts["ccol"].append(np.zeros(c.rows, np.int64) if full else c_col0 + c.indptr[:-1])
        row_parts["clen"].append(clen)
        row_parts["steps"].append(steps)
        row_parts["pairs"].append(pairs)
        n_ae += a.nnz
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
    rows = {k: cat(v) for k, v in row_parts.items()}
    keep = (rows["clen"] > 0) | (rows["pairs"] > 0)
    order = np.argsort(-rows["pairs"][keep], kind="stable")
    rows = {k: v[keep][order] for k, v in rows.items()}
    tables = dict(ae_val=cat(ae_val), ae_brow=cat(ae_brow), br_val=cat(br_val), br_col=cat(br_col),
                  br_len=cat(br_len), cols=cat(cols))
    idt = index_dtype(n_cols, n_ae, n_br, *arena_sizes)

    def dev(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(x), dtype=idt, device=device)

    blen = tables["br_len"]
    return RowsTable(
        row_a=dev(rows["a"]), row_alen=dev(rows["alen"]), row_c=dev(rows["c"]), row_ccol=dev(rows["ccol"]),
        row_clen=dev(rows["clen"]), row_steps=dev(rows["steps"]),
        **{k: dev(v) for k, v in tables.items()},
        nrows=int(rows["a"].size), npairs=int(rows["pairs"].sum()), max_b_row=int(blen.max()) if blen.size else 0,
    )


@dataclass(frozen=True)
class RowsConfig:
    block_b: int
    block_j: int
    num_warps: int


def rows_config(max_b_row: int, batch: int, interpret: bool) -> RowsConfig:
    """Tiles of a row-wise launch: ``BLOCK_J`` entries of a ``B`` row for ``BLOCK_B`` samples."""
    block_j = min(launch.next_pow2(max_b_row), 1024 if interpret else 128)
    block_b = min(launch.next_pow2(batch), 64 if interpret else 4)
    warps = 4 if interpret else (4 if block_b * block_j >= 256 else 2 if block_b * block_j >= 64 else 1)
    return RowsConfig(block_b, block_j, warps)


def spgemm_rows(table: RowsTable, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
    """Numeric row-wise SpGEMM of one step, in place on ``c``.

    Args:
        table: the step's products (:func:`rows_table`).
        a, b: value arenas, ``(N,)`` when shared by the batch or ``(B, N)`` per sample.
        c: output arena, ``(N,)`` only when both factors are shared, else ``(B, N)``.
    """
    if table.nrows == 0:
        return
    a_sh, b_sh, c_sh, batch = product_operands("spgemm_rows", a, b, c)
    cfg = rows_config(table.max_b_row, batch, launch.interpreting())
    grid = (table.nrows, triton.cdiv(batch, cfg.block_b))
    launch.launch(
        spgemm_rows_kernel, grid,
        dict(a_ptr=a, b_ptr=b, c_ptr=c, row_a=table.row_a, row_alen=table.row_alen, row_c=table.row_c,
             row_ccol=table.row_ccol, row_clen=table.row_clen, row_steps=table.row_steps, ae_val=table.ae_val,
             ae_brow=table.ae_brow, br_val=table.br_val, br_col=table.br_col, br_len=table.br_len,
             cols=table.cols, batch=batch, stride_a=row_stride(a), stride_b=row_stride(b),
             stride_c=row_stride(c)),
        dict(A_SHARED=a_sh, B_SHARED=b_sh, C_SHARED=c_sh, BLOCK_B=cfg.block_b, BLOCK_J=cfg.block_j),
        cfg.num_warps,
    )


def spgemm_rows_product(a: Pattern, b: Pattern, c: Pattern, a_vals: torch.Tensor, b_vals: torch.Tensor) -> torch.Tensor:
    """One product ``C = A @ B`` outside a scan: values ``(nnz,)`` or ``(B, nnz)`` in, ``C``'s values out.

    ``c`` must contain the pattern of ``A @ B`` (e.g. :func:`spscan.planner.rowwise.rowwise_symbolic`).
    """
    if a_vals.shape[-1] != a.nnz or b_vals.shape[-1] != b.nnz:
        raise ValueError(f"spgemm_rows_product: expected A values (.., {a.nnz}) and B values (.., {b.nnz}), got "
                         f"{tuple(a_vals.shape)} and {tuple(b_vals.shape)}")
    if a_vals.dtype != b_vals.dtype:
        raise TypeError(f"spgemm_rows_product: A and B values differ in dtype: {a_vals.dtype} vs {b_vals.dtype}")
    shared = a_vals.dim() == 1 and b_vals.dim() == 1
    batch = 1 if shared else max(v.shape[0] for v in (a_vals, b_vals) if v.dim() == 2)
    out = torch.empty((c.nnz,) if shared else (batch, c.nnz), dtype=a_vals.dtype, device=a_vals.device)
    table = rows_table([RowProduct(a, b, c, 0, 0, 0)], (a.nnz, b.nnz, c.nnz), a_vals.device)
    spgemm_rows(table, a_vals.contiguous(), b_vals.contiguous(), out)
    return out
