"""What the segment-reduction kernels (numeric SpGEMM and SpMV) share: the table and the loop.

Host side: the planner hands each step's products as bins of padded pair lists (the torch
backend's layout, see :func:`spscan.planner.cost.bin_widths`). For the kernels a step
becomes ONE flat table: segments sorted long-first (stable, so the order is deterministic),
their pairs concatenated without padding, and ``seg_ptr`` offsets. A program then takes
consecutive segments of similar length and loops only as far as its first (longest) one, so a
whole step is one launch with no tiny per-row programs.

Device side: :func:`segment_block` (which segments and samples a program owns) and
:func:`segment_dot` (their pair reduction) are the ``@triton.jit`` helpers both kernels call.
The reduction loop is a ``while`` over a bound read from ``seg_ptr``: Triton 3.6's interpreter
cannot take a tensor as a ``range`` bound (it converts the bound with ``int()`` on a
one-element array, which NumPy 2.4 rejects), and a ``while`` compiles to the same loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from spscan.planner.program import Bin

from spscan.kernels.triton import launch

__all__ = ["SegmentTable", "segment_table", "segments_from_pairs", "index_dtype", "segment_block", "segment_dot",
           "gather_rows"]

_I32_MAX = np.iinfo(np.int32).max


def index_dtype(*limits: int) -> torch.dtype:
    """int32 when every index (and pair offset) stays below 2**31, else int64."""
    return torch.int32 if max([0, *limits]) <= _I32_MAX else torch.int64


@dataclass
class SegmentTable:
    """One step's segments for a reduction ``out[s] = sum_t a[pair_a[t]] * b[pair_b[t]] (+ add[s])``.

    Attributes:
        seg_ptr: ``(nseg + 1,)`` offsets into the pair arrays, segments sorted long-first.
        pair_a, pair_b: ``(npairs,)`` arena slots of the left / right factor of each pair.
        out: ``(nseg,)`` output slots; ``add``: ``(nseg,)`` vector slots added (SpMV) or ``None``.
    """

    seg_ptr: torch.Tensor
    pair_a: torch.Tensor
    pair_b: torch.Tensor
    out: torch.Tensor
    add: Optional[torch.Tensor]
    nseg: int
    npairs: int
    max_len: int
    lengths: np.ndarray  # (nseg,) sorted long-first, host copy for launch decisions
    _widths: dict = field(default_factory=dict)

    def width(self, itemsize: int, interpret: bool) -> int:
        """Pair-chunk width for these lengths (see :func:`launch.choose_width`), cached."""
        key = (itemsize, interpret)
        if key not in self._widths:
            self._widths[key] = launch.choose_width(self.lengths, itemsize=itemsize, interpret=interpret)
        return self._widths[key]

    def launch_config(self, batch: int, itemsize: int) -> tuple[launch.SegmentConfig, tuple[int, int]]:
        """Tiles and grid ``(segment blocks, sample blocks)`` of a launch over ``batch`` samples."""
        interpret = launch.interpreting()
        cfg = launch.segment_config(self.width(itemsize, interpret), batch, itemsize, interpret)
        return cfg, (triton.cdiv(self.nseg, cfg.block_s), triton.cdiv(batch, cfg.block_b))


# --- device side: the part of a segment-reduction kernel SpGEMM and SpMV share -------------

@triton.jit
def segment_block(seg_ptr, nseg, batch, BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr):
    """The ``BLOCK_S`` segments (axis 0 of the grid) and ``BLOCK_B`` samples (axis 1) of this program.

    Returns ``seg, seg_ok, start, end`` (each ``(BLOCK_S,)``: segment ids, validity and pair
    ranges), ``longest`` (pairs of the block's first, hence longest, segment) and ``smp,
    smp_ok`` (``(BLOCK_B,)`` int64 sample ids and validity).
    """
    first = tl.program_id(0) * BLOCK_S
    seg = first + tl.arange(0, BLOCK_S)
    seg_ok = seg < nseg
    start = tl.load(seg_ptr + seg, mask=seg_ok, other=0)
    end = tl.load(seg_ptr + seg + 1, mask=seg_ok, other=0)
    # segments are sorted long-first: the block's first one bounds the loop
    longest = tl.load(seg_ptr + first + 1) - tl.load(seg_ptr + first)
    smp = (tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    return seg, seg_ok, start, end, longest, smp, smp < batch


@triton.jit
def gather_rows(ptr, idx, ok, smp, smp_ok, stride, SHARED: tl.constexpr):
    """``ptr[idx]`` for a shared arena (``(1, *idx.shape)``) or ``ptr[smp, idx]`` per sample
    (``(BLOCK_B, *idx.shape)``, row ``stride``); masked entries read 0."""
    if SHARED:
        vals = tl.load(ptr + idx, mask=ok, other=0.0)[None, :, :]
    else:
        vals = tl.load(ptr + smp[:, None, None] * stride + idx[None, :, :],
                       mask=smp_ok[:, None, None] & ok[None, :, :], other=0.0)
    return vals


@triton.jit
def segment_dot(x_ptr, y_ptr, pair_x, pair_y, start, end, longest, smp, smp_ok, stride_x, stride_y,
                acc_dtype: tl.constexpr, X_SHARED: tl.constexpr, Y_SHARED: tl.constexpr,
                BLOCK_B: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr):
    """``(BLOCK_B, BLOCK_S)`` sums ``sum_t x[.., pair_x[t]] * y[.., pair_y[t]]`` over each segment's pairs.

    Chunks of ``BLOCK_W`` pairs up to ``longest``; per-lane partial sums in ``acc_dtype``, then
    one ``tl.sum``: a fixed reduction order, bitwise reproducible.
    """
    lane = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_B, BLOCK_S, BLOCK_W], dtype=acc_dtype)
    t0 = 0
    while t0 < longest:
        pos = start[:, None] + t0 + lane[None, :]
        ok = pos < end[:, None]
        ix = tl.load(pair_x + pos, mask=ok, other=0).to(tl.int64)
        iy = tl.load(pair_y + pos, mask=ok, other=0).to(tl.int64)
        acc += gather_rows(x_ptr, ix, ok, smp, smp_ok, stride_x, X_SHARED) \
            * gather_rows(y_ptr, iy, ok, smp, smp_ok, stride_y, Y_SHARED)
        t0 += BLOCK_W
    return tl.sum(acc, axis=2)


def segment_table(bins: Sequence[Bin], zero_a: int, zero_b: int, arena_sizes: Sequence[int],
                  device: torch.device) -> SegmentTable:
    """Flatten a step's bins (padding removed) into one long-first :class:`SegmentTable`.

    ``zero_a``/``zero_b`` are the padding slots of the two factors: a real pair never reads them,
    and the planner pads only at the tail of a segment.
    """
    lens, a_parts, b_parts, outs, adds = [], [], [], [], []
    for b in bins:
        real = (b.a != zero_a) | (b.b != zero_b)
        n_real = real.sum(axis=1)
        if b.width and not np.array_equal(real, np.arange(b.width)[None, :] < n_real[:, None]):
            raise ValueError(f"bin of width {b.width}: expected padding pairs only at segment tails")
        lens.append(n_real.astype(np.int64))
        a_parts.append(b.a[real])
        b_parts.append(b.b[real])
        outs.append(np.asarray(b.out, dtype=np.int64))
        if b.add is not None:
            adds.append(np.asarray(b.add, dtype=np.int64))
    if adds and len(adds) != len(bins):
        raise ValueError(f"bins: expected every bin or none to carry an add term, got {len(adds)} of {len(bins)}")
    lengths = np.concatenate(lens) if lens else np.zeros(0, np.int64)
    flat_a = np.concatenate(a_parts) if a_parts else np.zeros(0, np.int64)
    flat_b = np.concatenate(b_parts) if b_parts else np.zeros(0, np.int64)
    out = np.concatenate(outs) if outs else np.zeros(0, np.int64)
    return segments_from_pairs(lengths, flat_a, flat_b, out, np.concatenate(adds) if adds else None,
                               arena_sizes, device)


def segments_from_pairs(lengths: np.ndarray, pair_a: np.ndarray, pair_b: np.ndarray, out: np.ndarray,
                        add: Optional[np.ndarray], arena_sizes: Sequence[int], device: torch.device) -> SegmentTable:
    """A long-first :class:`SegmentTable` from flat pair lists.

    Args:
        lengths: ``(nseg,)`` pairs per segment; segment ``s`` owns the next ``lengths[s]`` entries
            of ``pair_a``/``pair_b`` (``(npairs,)`` arena slots, in the caller's order).
        out: ``(nseg,)`` output slots; add: ``(nseg,)`` vector slots or ``None``.
        arena_sizes: sizes of the arenas indexed (int32 tables when all fit).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1].astype(np.int64)
    order = np.argsort(-lengths, kind="stable")
    lengths = lengths[order]
    seg_ptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    npairs = int(seg_ptr[-1])
    if pair_a.shape != (npairs,) or pair_b.shape != (npairs,) or out.shape != lengths.shape:
        raise ValueError(f"segments: expected {npairs} pairs and {lengths.size} outputs, got pair_a "
                         f"{pair_a.shape}, pair_b {pair_b.shape}, out {out.shape}")
    # source position of every pair once segments are listed in sorted order
    take = np.repeat(starts[order] - seg_ptr[:-1], lengths) + np.arange(npairs, dtype=np.int64)
    out = np.asarray(out)[order]
    add = None if add is None else np.asarray(add)[order]
    idt = index_dtype(npairs, *arena_sizes)

    def dev(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.ascontiguousarray(x), dtype=idt, device=device)

    return SegmentTable(
        seg_ptr=dev(seg_ptr), pair_a=dev(pair_a[take]), pair_b=dev(pair_b[take]), out=dev(out),
        add=None if add is None else dev(add), nseg=int(lengths.size), npairs=npairs,
        max_len=int(lengths[0]) if lengths.size else 0, lengths=lengths,
    )
