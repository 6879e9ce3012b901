"""Triton backend: runs a lowered :class:`~spscan.planner.program.Program` with one launch per
scan step per primitive (and per operand-kind group the planner makes within a step).

``make_tables`` does all host work once per (program, device): every step's SpGEMM and SpMV
bins become one long-first segment table (:mod:`spscan.kernels.triton.segments`), dense node offsets
and vector slots are uploaded, all as int32 where the arena fits (else int64). ``run_program``
then only launches kernels: no host sync, no allocation, static shapes, so a whole backward
can be captured in a CUDA graph. Semantics match :mod:`spscan.kernels.torch_ops` exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from spscan.planner.program import Apply, BlockRef, Gemm, Gemv, LinearRun, Program, RowSpGEMM, SpMM, SpMV
from spscan.planner.recurrence import Recurrence, recurrence_of

from spscan.kernels.backend import Backend, Capabilities, Tables, load_feeds, run_apply
from spscan.kernels.triton import launch
from spscan.kernels.triton.gemm import gemm
from spscan.kernels.triton.gemv import gemv
from spscan.kernels.triton.segments import SegmentTable, index_dtype, segment_table
from spscan.kernels.triton.spgemm import spgemm
from spscan.kernels.triton.spgemm_rows import RowsTable, rows_table, spgemm_rows
from spscan.kernels.triton.spmv import spmv
from spscan.kernels.triton.linear_run import chunked_size, diagonal_size, linear_run, linear_run_chunked, linear_run_table
from spscan.kernels.triton.recurrence import recurrence_scratch, run_recurrence

__all__ = ["TritonTables", "TritonBackend", "make_tables", "run_program"]


@dataclass
class _SpMMLaunch:
    op: SpMM
    table: SegmentTable


@dataclass
class _RowsLaunch:
    op: RowSpGEMM
    table: RowsTable


@dataclass
class _SpMVLaunch:
    op: SpMV
    table: SegmentTable


@dataclass
class _GemmLaunch:
    op: Gemm
    a_off: torch.Tensor
    b_off: torch.Tensor


@dataclass
class _GemvLaunch:
    op: Gemv
    m_off: torch.Tensor
    vin: torch.Tensor
    add: torch.Tensor


@dataclass
class _ApplyLaunch:
    op: Apply


@dataclass
class _LinearRunLaunch:
    op: LinearRun
    table: torch.Tensor
    uniform_m: int
    all_shared: bool
    csr_indptr: torch.Tensor
    csr_indices: torch.Tensor
    # parallel over the steps: a uniform run of m x m tiles, or of diagonals per lane
    chunked: Optional[Union[launch.ChunkedRunConfig, launch.DiagonalRunConfig]] = None
    scratch_offset: int = 0  # where its working memory starts in each sample's row of arenas["C"]


@dataclass
class _RecurrenceLaunch:
    """A linear run that is a structured recurrence (:mod:`spscan.planner.recurrence`): the fused kernels."""

    op: LinearRun
    rec: Recurrence
    config: launch.RecurrenceConfig
    scratch_offset: int = 0

    @property
    def scratch_per_sample(self) -> int:
        return recurrence_scratch(self.rec, self.config)


Launch = Union[_ApplyLaunch, _SpMMLaunch, _RowsLaunch, _SpMVLaunch, _GemmLaunch, _GemvLaunch, _LinearRunLaunch,
               _RecurrenceLaunch]


def _run_launch(op: LinearRun, idt: torch.dtype, device: torch.device) -> Union[_LinearRunLaunch, _RecurrenceLaunch]:
    rec = recurrence_of(op, min_steps=launch.RECURRENCE_MIN_STEPS)
    if rec is not None:  # one shared block and per-step diagonals, repeated: the fused kernels
        cfg = launch.recurrence_config(rec.n, rec.ny, rec.steps)
        if cfg is not None:
            return _RecurrenceLaunch(op, rec, cfg)
    table, uniform_m, indptr, indices = linear_run_table(op, idt, device)
    m = diagonal_size(op)
    if m:  # diagonals only: per lane, any m
        chunked = launch.diagonal_run_config(m, op.steps)
    else:
        m = chunked_size(op)
        chunked = launch.chunked_run_config(m, op.steps) if m else None
    return _LinearRunLaunch(op, table, uniform_m, bool(np.all(op.shared)), indptr, indices, chunked)


def _offsets(ref: BlockRef, limit: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(ref.offsets, dtype=index_dtype(limit), device=device)


def _check_disjoint(step: int, reads: list[tuple[str, np.ndarray]], writes: list[tuple[str, np.ndarray]],
                    sizes: dict[str, int]) -> None:
    """A step's launches run concurrently over their entries: none may read what the step writes."""
    for arena in {a for a, _ in writes}:
        written = np.zeros(sizes[arena], dtype=bool)
        for a, w in writes:
            if a == arena:
                written[w] = True
        if any(a == arena and r.size and written[r].any() for a, r in reads):
            raise ValueError(f"program step {step}: arena {arena} has slots both read and written in one step; "
                             f"expected disjoint inputs and outputs")


class TritonTables(Tables):
    """Device-side index tables of one program, built once; see :func:`make_tables`."""

    def __init__(self, program: Program, device: torch.device, memo: Optional[dict] = None) -> None:
        self.program = program
        self.device = torch.device(device)
        sizes = {"S": program.size_s, "P": program.size_p, "V": program.size_v}
        zeros = {"S": program.zero_s, "P": program.zero_p, "V": program.zero_v}
        self.reads_arena_inputs = True  # kernels read input values from the arenas only
        self.run_scratch = 0  # per-sample working entries of the chunked linear runs (arenas["C"])
        self.steps: list[list[Launch]] = []
        memo = {} if memo is None else memo  # id(op) -> (op, its launch): ops shared with other programs

        def shared(op, build):
            hit = memo.get(id(op))
            if hit is None or hit[0] is not op:
                hit = memo[id(op)] = (op, build())
            return hit[1]

        for si, st in enumerate(program.steps):
            launches: list[Launch] = []
            reads: list[tuple[str, np.ndarray]] = []
            writes: list[tuple[str, np.ndarray]] = []
            for op in st.ops:
                if isinstance(op, SpMM):
                    launches.append(shared(op, lambda op=op: _SpMMLaunch(op, segment_table(
                        op.bins, zeros[op.kind_a], zeros[op.kind_b],
                        (sizes[op.kind_a], sizes[op.kind_b], sizes[op.kind_out]), self.device))))
                    for b in op.bins:
                        reads += [(op.kind_a, b.a.ravel()), (op.kind_b, b.b.ravel())]
                        writes.append((op.kind_out, b.out.ravel()))
                    writes += [(op.kind_out, np.arange(off, off + size)) for off, size in op.clear]
                elif isinstance(op, RowSpGEMM):
                    launches.append(shared(op, lambda op=op: _RowsLaunch(op, rows_table(
                        op.products, (sizes[op.kind_a], sizes[op.kind_b], sizes[op.kind_out]), self.device))))
                    for pr in op.products:
                        reads += [(op.kind_a, np.arange(pr.a_offset, pr.a_offset + pr.a.nnz)),
                                  (op.kind_b, np.arange(pr.b_offset, pr.b_offset + pr.b.nnz))]
                        writes.append((op.kind_out, np.arange(pr.c_offset, pr.c_offset + pr.c.nnz)))
                elif isinstance(op, SpMV):
                    launches.append(shared(op, lambda op=op: _SpMVLaunch(op, segment_table(
                        op.bins, zeros[op.kind_m], zeros["V"], (sizes[op.kind_m], sizes["V"]), self.device))))
                    for b in op.bins:
                        reads += [("V", b.b.ravel()), ("V", b.add.ravel())]
                        writes.append(("V", b.out.ravel()))
                elif isinstance(op, Gemm):
                    launches.append(shared(op, lambda op=op: _GemmLaunch(
                        op, _offsets(op.a, sizes[op.kind_a], self.device), _offsets(op.b, sizes[op.kind_b], self.device))))
                    size = op.nodes * op.a.rows * op.b.cols
                    writes.append((op.kind_out, np.arange(op.out_offset, op.out_offset + size)))
                    for kind, ref in ((op.kind_a, op.a), (op.kind_b, op.b)):
                        blk = ref.rows * ref.cols
                        reads.append((kind, (ref.offsets[:, None] + np.arange(blk)).ravel()))
                elif isinstance(op, Gemv):
                    idt = index_dtype(sizes[op.kind_m], sizes["V"])
                    launches.append(shared(op, lambda op=op, idt=idt: _GemvLaunch(
                        op, _offsets(op.mats, sizes[op.kind_m], self.device),
                        torch.as_tensor(np.ascontiguousarray(op.vin), dtype=idt, device=self.device),
                        torch.as_tensor(np.ascontiguousarray(op.add), dtype=idt, device=self.device))))
                    reads += [("V", op.vin.ravel()), ("V", op.add.ravel())]
                    writes.append(("V", np.arange(op.out_offset, op.out_offset + op.nodes * op.mats.rows)))
                elif isinstance(op, Apply):
                    launches.append(_ApplyLaunch(op))  # the caller's operator: torch ops on the device
                    reads += [("V", np.arange(op.vin, op.vin + op.cols))]
                    reads += [("V", np.arange(op.add, op.add + op.rows))] if op.add >= 0 else []
                    writes.append(("V", np.arange(op.out, op.out + op.rows)))
                elif isinstance(op, LinearRun):
                    limit = max(sizes["S"], sizes["P"], sizes["V"])
                    limit = max(limit, int(op.csr_indices.size) + 1)
                    item = shared(op, lambda op=op, limit=limit: _run_launch(op, index_dtype(limit), self.device))
                    if isinstance(item, _RecurrenceLaunch):  # its own working memory, after the other runs'
                        item = dataclasses.replace(item, scratch_offset=self.run_scratch)
                        self.run_scratch += item.scratch_per_sample
                    elif item.chunked is not None:
                        item = dataclasses.replace(item, scratch_offset=self.run_scratch)
                        self.run_scratch += item.chunked.scratch_per_sample
                    launches.append(item)
                    # the chain reads its own outputs step by step: only y_0 and the adds come from outside
                    reads.append(("V", np.arange(op.vin0, op.vin0 + int(op.cols[0]))))
                    reads += [("V", np.arange(a, a + r)) for a, r in zip(op.add.tolist(), op.rows.tolist()) if a >= 0]
                    writes += [("V", np.arange(o, o + r)) for o, r in zip(op.out.tolist(), op.rows.tolist())]
                else:
                    raise TypeError(f"program step {si}: unknown work table {type(op).__name__}")
            _check_disjoint(si, reads, writes, sizes)
            self.steps.append(launches)

    def launches(self) -> int:
        """Kernel launches per backward (for summaries and benchmarks)."""
        return sum(len(s) for s in self.steps)


def _compiled() -> bool:
    """Whether the kernels were defined for compilation (not in Triton's CPU interpreter)."""
    import triton

    from spscan.kernels.triton.spgemm import spgemm_kernel

    return isinstance(spgemm_kernel, triton.runtime.JITFunction)


def make_tables(program: Program, device: torch.device, memo: Optional[dict] = None) -> TritonTables:
    """Upload ``program``'s index tables to ``device`` once (re-laid out for the kernels); ``memo``: see
    :meth:`~spscan.kernels.backend.Backend.make_tables`."""
    device = torch.device(device)
    _check_device(device)
    return TritonTables(program, device, memo)


def _check_device(device: torch.device) -> None:
    if _compiled() and device.type != "cuda":
        raise ValueError(f"backend='triton': compiled kernels need a CUDA device, got {device} (use "
                         f"backend='torch' on the CPU; Triton's interpreter runs them on the CPU only when "
                         f"TRITON_INTERPRET=1 is set before triton is first imported)")


def run_program(tables: TritonTables, arenas: dict[str, torch.Tensor], vectors: torch.Tensor,
                inputs=None) -> None:
    """Run every step in order, in place on ``arenas["S"]`` ``(N_S,)``, ``arenas["P"]`` ``(B, N_P)``
    and ``vectors`` ``(B, N_V)``.

    Only kernel launches: capturable in a CUDA graph once the arenas are static. ``inputs`` (the
    caller's per-layer values) is read only by :class:`~spscan.planner.program.Apply` ops (a
    layer's structured operator); every kernel reads the arenas, so the engine always loads them
    (``reads_arena_inputs``).
    """
    for si, launches in enumerate(tables.steps):
        for item in launches:
            if isinstance(item, _SpMMLaunch):
                op = item.op
                spgemm(item.table, arenas[op.kind_a], arenas[op.kind_b], arenas[op.kind_out], op.clear)
            elif isinstance(item, _RowsLaunch):
                op = item.op
                spgemm_rows(item.table, arenas[op.kind_a], arenas[op.kind_b], arenas[op.kind_out])
            elif isinstance(item, _SpMVLaunch):
                spmv(item.table, arenas[item.op.kind_m], vectors)
            elif isinstance(item, _GemmLaunch):
                op = item.op
                gemm(item.a_off, item.b_off, op.a, op.b, op.out_offset,
                     arenas[op.kind_a], arenas[op.kind_b], arenas[op.kind_out])
            elif isinstance(item, _ApplyLaunch):
                run_apply(item.op, vectors, inputs)
            elif isinstance(item, _RecurrenceLaunch):
                scratch = arenas["C"].view(vectors.shape[0], -1)[:, item.scratch_offset:]
                run_recurrence(item.rec, arenas["S"], arenas["P"], vectors, scratch, item.config)
            elif isinstance(item, _LinearRunLaunch) and item.chunked is not None:
                scratch = arenas["C"].view(vectors.shape[0], -1)[:, item.scratch_offset:]
                linear_run_chunked(item.table, int(item.op.vin0), arenas["S"], arenas["P"], vectors, scratch,
                                   item.chunked)
            elif isinstance(item, _LinearRunLaunch):
                linear_run(item.table, item.uniform_m, item.all_shared, int(item.op.vin0), arenas["S"], arenas["P"],
                          vectors, item.csr_indptr, item.csr_indices)
            else:
                op = item.op
                gemv(item.m_off, item.vin, item.add, op.mats, op.out_offset, arenas[op.kind_m], vectors)


class TritonBackend(Backend):
    """The Triton backend (see the module docstring): compiled on CUDA, or Triton's interpreter on the CPU."""

    name = "triton"

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        return Capabilities(reads_caller_inputs=False, graph_capturable=True,
                            device_types=("cuda",) if _compiled() else ("cpu", "cuda"))

    def check_device(self, device: torch.device) -> None:
        _check_device(device)

    def make_tables(self, program: Program, device: torch.device, memo: Optional[dict] = None) -> TritonTables:
        return make_tables(program, device, memo)

    def launch_settings(self) -> tuple:
        return (launch.dot_precision,)

    def run(self, tables, arenas, vectors, inputs=None, taps=(), skip=None, feeds=()) -> bool:
        load_feeds(vectors, feeds)
        run_program(tables, arenas, vectors, inputs)
        return False  # taps: the engine copies them from the vectors
