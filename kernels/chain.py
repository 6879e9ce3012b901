"""Numeric products of planned CSR matrices with batched values (torch): SpGEMM, GEMM, SpMV, GEMV.

Used where a few whole-matrix products are needed outside a lowered scan program, e.g. reducing
one contiguous slice of the chain to its composite transposed Jacobian. The symbolic half (the
product pattern and, per output entry, its input entry pairs) comes from
:func:`spscan.planner.symbolic.spgemm_symbolic`; this module only gathers, multiplies and sums.

Values are ``(nnz,)`` (shared by the batch) or ``(B, nnz)`` (per sample). Segment sums run over
power-of-two padded bins written to unique output slots: a fixed-order reduction with no atomics
and no ``index_add_``, so results are bitwise reproducible on CPU and CUDA.

>>> import numpy as np, scipy.sparse as sp, torch
>>> from spscan.planner.patterns import as_pattern
>>> a = as_pattern(sp.csr_array(np.array([[1.0, 0.0], [1.0, 1.0]])))
>>> prod = PlannedProduct(a, a)
>>> prod(torch.tensor([2.0, 3.0, 4.0]), torch.tensor([2.0, 3.0, 4.0])).tolist()
[4.0, 18.0, 16.0]
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from spscan.planner.patterns import Pattern, full_pattern
from spscan.planner.symbolic import spgemm_symbolic

__all__ = ["SegmentBins", "segment_bins", "gather_multiply_sum", "PlannedProduct", "PlannedMatvec"]


class SegmentBins:
    """Host-side binning of planned segments: ``out[c] = sum_t a[pair_a[t]] * b[pair_b[t]]``.

    Segments (output entries) are grouped by the power of two that bounds their length; each bin
    is a dense ``(nseg, width)`` pair table padded with a slot that points at an appended zero.
    """

    def __init__(self, pair_ptr: np.ndarray, pair_a: np.ndarray, pair_b: np.ndarray,
                 size_a: int, size_b: int) -> None:
        self.size_a = int(size_a)
        self.size_b = int(size_b)
        self.n_out = int(pair_ptr.shape[0] - 1)
        lengths = np.diff(pair_ptr)
        self.bins: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._device: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        nonempty = np.nonzero(lengths)[0]
        self.has_empty = nonempty.size < self.n_out
        if nonempty.size == 0:
            return
        widths = 1 << np.ceil(np.log2(lengths[nonempty])).astype(np.int64)
        for w in np.unique(widths):
            seg = nonempty[widths == w]
            pos = pair_ptr[seg][:, None] + np.arange(w, dtype=np.int64)[None, :]
            valid = pos < pair_ptr[seg + 1][:, None]
            pos = np.where(valid, pos, 0)
            # padded slots read the zero appended after each operand
            ia = np.where(valid, pair_a[pos], self.size_a)
            ib = np.where(valid, pair_b[pos], self.size_b)
            self.bins.append((ia, ib, seg))

    def on(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """The bins as int64 index tensors on ``device`` (copied once per device)."""
        key = str(device)
        hit = self._device.get(key)
        if hit is None:
            hit = [tuple(torch.as_tensor(x, dtype=torch.int64, device=device) for x in b) for b in self.bins]
            self._device[key] = hit
        return hit


def segment_bins(pair_ptr: np.ndarray, pair_a: np.ndarray, pair_b: np.ndarray, size_a: int,
                 size_b: int) -> SegmentBins:
    """Bin the planned pair lists of one product (see :class:`SegmentBins`)."""
    return SegmentBins(np.asarray(pair_ptr, np.int64), np.asarray(pair_a, np.int64),
                       np.asarray(pair_b, np.int64), size_a, size_b)


def _pad_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(x.shape[:-1] + (1,))], dim=-1)


def gather_multiply_sum(bins: SegmentBins, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out[..., c] = sum_t a[..., pair_a[t]] * b[..., pair_b[t]]`` over each planned segment.

    Args:
        bins: from :func:`segment_bins`.
        a: ``(size_a,)`` or ``(B, size_a)``.
        b: ``(size_b,)`` or ``(B, size_b)``.

    Returns:
        ``(n_out,)`` if both operands are shared, else ``(B, n_out)``.
    """
    batch = a.shape[:-1] if a.dim() == 2 else b.shape[:-1]
    out = a.new_zeros(batch + (bins.n_out,))
    tables = bins.on(a.device)
    if not tables:
        return out
    ap, bp = _pad_zero(a), _pad_zero(b)
    for ia, ib, seg in tables:
        out[..., seg] = (ap[..., ia] * bp[..., ib]).sum(-1)
    return out


class PlannedProduct:
    """``C = A @ B`` for fixed CSR patterns: symbolic once here, numeric per call.

    ``C`` is stored densely (row-major ``full_pattern``) when ``dense_out`` or when both operands
    are full; two full operands multiply with a batched GEMM instead of pair lists.
    """

    def __init__(self, a: Pattern, b: Pattern, dense_out: bool = False) -> None:
        if a.cols != b.rows:
            raise ValueError(f"PlannedProduct: inner dimensions differ: A is {a.shape}, B is {b.shape}")
        self.a, self.b = a, b
        self.gemm = a.is_full and b.is_full
        if self.gemm:
            self.pattern = full_pattern(a.rows, b.cols)
            self.bins: Optional[SegmentBins] = None
            self.work = a.rows * a.cols * b.cols
        else:
            sym = spgemm_symbolic(a, b, dense_out=dense_out)
            self.pattern = sym.pattern
            self.bins = segment_bins(sym.pair_ptr, sym.pair_a, sym.pair_b, a.nnz, b.nnz)
            self.work = sym.npairs

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a``: ``(nnz_A,)``/``(B, nnz_A)``, ``b``: ``(nnz_B,)``/``(B, nnz_B)`` -> ``(..., nnz_C)``."""
        if self.gemm:
            m, k, p = self.a.rows, self.a.cols, self.b.cols
            c = torch.matmul(a.unflatten(-1, (m, k)), b.unflatten(-1, (k, p)))
            return c.flatten(-2)
        return gather_multiply_sum(self.bins, a, b)


class PlannedMatvec:
    """``y = M x (+ add)`` for a fixed CSR pattern ``M`` (dense GEMV when ``M`` is full)."""

    def __init__(self, m: Pattern) -> None:
        self.m = m
        self.bins = None
        if not m.is_full:
            self.bins = segment_bins(m.indptr, np.arange(m.nnz, dtype=np.int64), m.indices, m.nnz, m.cols)

    def __call__(self, values: torch.Tensor, x: torch.Tensor, add: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``values``: ``(nnz,)``/``(B, nnz)``; ``x``: ``(B, cols)``; ``add``: ``(B, rows)`` -> ``(B, rows)``."""
        if self.bins is None:
            mat = values.unflatten(-1, (self.m.rows, self.m.cols))
            y = torch.matmul(mat, x.unsqueeze(-1)).squeeze(-1)
        else:
            y = gather_multiply_sum(self.bins, values, x)
        return y if add is None else y + add
