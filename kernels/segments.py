"""Host-side layout shared by the segment-reduction kernels (numeric SpGEMM and SpMV).

The planner hands each step's products as power-of-two bins of padded pair lists. For the
kernels a step becomes ONE flat table: segments sorted long-first (stable, so the order is
deterministic), their pairs concatenated without padding, and ``seg_ptr`` offsets. A program
then takes consecutive segments of similar length and loops only as far as its first (longest)
one, so a whole step is one launch with no tiny per-row programs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from spscan.planner.program import Bin

from .launch import choose_width

__all__ = ["SegmentTable", "segment_table", "segments_from_pairs", "index_dtype"]

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
            self._widths[key] = choose_width(self.lengths, itemsize=itemsize, interpret=interpret)
        return self._widths[key]


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
