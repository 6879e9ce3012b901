"""Torch backend: the planned numeric primitives as vectorized gather-multiply-segment-sum.

Each work table of a :class:`~spscan.planner.program.Program` becomes a few torch ops: a
power-of-two bin of segments is ``(a[..., idx_a] * b[..., idx_b]).sum(-1)`` written to unique
output slots (a fixed-order reduction: deterministic on CPU and CUDA, no atomics, no
``index_add_``); a GEMM/GEMV group is one batched ``matmul`` over same-shaped blocks viewed in
place. This backend is the CPU default and the baseline the Triton kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from spscan.planner.program import BlockRef, Gemm, Gemv, Program, SpMM, SpMV

__all__ = ["TorchTables", "run_program"]

Index = Union[torch.Tensor, slice]


def _as_index(arr: np.ndarray, device: torch.device) -> Index:
    """A slice when ``arr`` is a contiguous run (no gather needed), else a device index tensor."""
    flat = arr.reshape(-1)
    if flat.size and arr.ndim == 1 and np.array_equal(flat, np.arange(flat[0], flat[0] + flat.size)):
        return slice(int(flat[0]), int(flat[0]) + flat.size)
    return torch.as_tensor(np.ascontiguousarray(arr), dtype=torch.int64, device=device)


@dataclass
class _Blocks:
    rows: int
    cols: int
    base: int  # >= 0: view path
    block: Optional[Index]
    flat: Optional[torch.Tensor]  # (nodes, rows*cols) gather index when offsets are unaligned


def _blocks(ref: BlockRef, device: torch.device) -> _Blocks:
    if ref.base >= 0:
        blk = ref.block
        if blk.size and np.all(np.diff(blk) == 1):
            return _Blocks(ref.rows, ref.cols, ref.base, slice(int(blk[0]), int(blk[-1]) + 1), None)
        return _Blocks(ref.rows, ref.cols, ref.base, torch.as_tensor(blk, device=device), None)
    size = ref.rows * ref.cols
    flat = ref.offsets[:, None] + np.arange(size, dtype=np.int64)
    return _Blocks(ref.rows, ref.cols, -1, None, torch.as_tensor(flat, device=device))


def _view_blocks(arena: torch.Tensor, b: _Blocks) -> torch.Tensor:
    """``(nodes, rows, cols)`` (shared) or ``(B, nodes, rows, cols)`` (per sample)."""
    size = b.rows * b.cols
    if b.base >= 0:
        nb = (arena.shape[-1] - b.base) // size
        view = arena[..., b.base : b.base + nb * size].unflatten(-1, (nb, b.rows, b.cols))
        return view[..., b.block, :, :]
    return arena[..., b.flat].unflatten(-1, (b.rows, b.cols))


class TorchTables:
    """Device copies of a program's index tables, made once per (program, device)."""

    def __init__(self, program: Program, device: torch.device):
        self.program = program
        self.device = device
        self.steps = []
        for st in program.steps:
            ops = []
            for op in st.ops:
                if isinstance(op, (SpMM, SpMV)):
                    bins = [
                        (
                            torch.as_tensor(b.a, device=device),
                            torch.as_tensor(b.b, device=device),
                            _as_index(b.out, device),
                            None if b.add is None else _as_index(b.add, device),
                        )
                        for b in op.bins
                    ]
                    ops.append((op, bins))
                elif isinstance(op, Gemm):
                    ops.append((op, (_blocks(op.a, device), _blocks(op.b, device))))
                else:
                    ops.append((op, (_blocks(op.mats, device), _as_index(op.vin.reshape(-1), device),
                                     _as_index(op.add.reshape(-1), device))))
            self.steps.append(ops)


def _gather(arena: torch.Tensor, idx: Index) -> torch.Tensor:
    return arena[..., idx]


def _batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over node blocks; a shared operand is ``(nodes, m, k)``, a per-sample one ``(B, nodes, m, k)``.

    Operands are made contiguous and folded into one ``bmm``: ``matmul`` on strided arena views
    can fall back to a path that is orders of magnitude slower.
    """
    if a.dim() == 3 and b.dim() == 3:
        return torch.bmm(a.contiguous(), b.contiguous())
    if a.dim() == 4 and b.dim() == 4:
        batch, nodes, m, k = a.shape
        p = b.shape[-1]
        c = torch.bmm(a.reshape(batch * nodes, m, k), b.reshape(batch * nodes, k, p))
        return c.view(batch, nodes, m, p)
    if a.dim() == 3:  # shared left factor: fold the batch into the columns of b
        nodes, m, k = a.shape
        batch, _, _, p = b.shape
        bb = b.permute(1, 2, 0, 3).reshape(nodes, k, batch * p)
        c = torch.bmm(a.contiguous(), bb).view(nodes, m, batch, p)
        return c.permute(2, 0, 1, 3)
    batch, nodes, m, k = a.shape  # shared right factor: fold the batch into the rows of a
    p = b.shape[-1]
    aa = a.permute(1, 0, 2, 3).reshape(nodes, batch * m, k)
    c = torch.bmm(aa, b.contiguous()).view(nodes, batch, m, p)
    return c.permute(1, 0, 2, 3)


def run_program(tables: TorchTables, arenas: dict[str, torch.Tensor], vectors: torch.Tensor) -> None:
    """Run every step of the program in order, in place on the arenas."""
    batch = vectors.shape[0]
    for ops in tables.steps:
        for op, t in ops:
            if isinstance(op, SpMM):
                src_a, src_b, dst = arenas[op.kind_a], arenas[op.kind_b], arenas[op.kind_out]
                for ia, ib, out, _ in t:
                    dst[..., out] = (_gather(src_a, ia) * _gather(src_b, ib)).sum(-1)
            elif isinstance(op, Gemm):
                ba, bb = t
                c = _batched_matmul(_view_blocks(arenas[op.kind_a], ba), _view_blocks(arenas[op.kind_b], bb))
                n, m, p = op.nodes, ba.rows, bb.cols
                dst = arenas[op.kind_out]
                dst[..., op.out_offset : op.out_offset + n * m * p] = c.flatten(-3)
            elif isinstance(op, SpMV):
                src = arenas[op.kind_m]
                for ia, ib, out, add in t:
                    vectors[:, out] = (_gather(src, ia) * vectors[:, ib]).sum(-1) + vectors[:, add]
            else:  # Gemv
                bm, vin, add = t
                m, k, n = bm.rows, bm.cols, op.nodes
                x = vectors[:, vin].view(batch, n, k, 1)
                y = _batched_matmul(_view_blocks(arenas[op.kind_m], bm), x).reshape(batch, n * m)
                vectors[:, op.out_offset : op.out_offset + n * m] = y + vectors[:, add]


def make_tables(program: Program, device: torch.device) -> TorchTables:
    return TorchTables(program, device)
