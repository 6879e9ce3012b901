"""The numeric backend interface: what the run-time engine may ask of a backend, declared.

A backend turns a lowered :class:`~spscan.planner.program.Program` into device tables once
(:meth:`Backend.make_tables`) and runs it per call (:meth:`Backend.run`) in place on three
arenas: shared matrix values ``S`` ``(N_S,)``, per-sample matrix values ``P`` ``(B, N_P)`` and
vectors ``V`` ``(B, N_V)``. What a backend can do is stated in its :class:`Capabilities` and in
the two attributes every :class:`Tables` object carries, never probed with ``getattr``.

Two implementations: ``"torch"`` (:mod:`spscan.kernels.torch_ops`: vectorized torch/NumPy, the
CPU default and the reference for the kernels) and ``"triton"``
(:mod:`spscan.kernels.triton.backend`: the Triton kernels, on CUDA or in Triton's interpreter),
found by name through :mod:`spscan.kernels.registry`. This module imports neither.

The compiled CPU loops (numba) that front ends call outside a program run are declared here too, in
:data:`cpu_ops` (:class:`CpuOps`): the forwards of three recurrence forms, the long-reduction
product of their weight gradients and the max-pooling forward; and the fused Triton passes of a
Newton iteration on a recurrence, in :data:`fixed_point_ops` (:class:`FixedPointOps`). Each imports its
module on first use, so importing spscan imports neither those modules nor numba nor triton.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

__all__ = ["Capabilities", "Tables", "Backend", "CpuOps", "Feed", "FixedPointOps", "GATE_BANDS", "StructuredOperator",
           "Tap", "ValueEncoding", "cpu_ops", "fixed_point_ops", "load_feeds", "run_apply"]


@dataclass(frozen=True)
class ValueEncoding:
    """Per-sample values of a layer stored in a compact form instead of its CSR values.

    Some layers' ``J^T`` has fewer free numbers than stored entries (e.g. :data:`GATE_BANDS`: ``9H``
    CSR entries made of ``6H`` numbers). A layer may hand over those numbers and say how to make
    the CSR values from them: every path that needs CSR values (products of the schedule, the
    NumPy loop, Triton) expands them with ``expand``; a kernel that knows the form by ``name``
    applies it from the compact numbers directly (:mod:`.cpu.chain`: :data:`GATE_BANDS`), reading
    and computing less.

    Attributes:
        name: the form, as the kernels know it (:data:`GATE_BANDS`), or any other name (then only
            ``expand`` is used).
        width: compact numbers per sample.
        expand: ``(..., width)`` -> ``(..., nnz)``: the pattern's CSR values (any leading dimensions).
    """

    name: str
    width: int
    expand: Callable[[torch.Tensor], torch.Tensor]


GATE_BANDS = "gate_bands"
"""A :class:`ValueEncoding` form: a ``(5H, 2H)`` per-sample ``J^T`` of five diagonal bands of ``H`` rows,
given by ``6H`` numbers per sample, blocks of ``H`` in the order ``k, f, c_0, c_1, c_2, c_3``. With the
input ``(x_1, x_2)`` (two blocks of ``H``) and ``w = x_2 + k x_1``, the output is ``(c_0 w, c_1 w, c_2 w,
c_3 x_1, f w)``: bands 0-2 and 4 read columns ``(u, H + u)`` of row ``u`` of their block, band 3 column
``u``. Its ``9H`` CSR values (rows in that order; a two-entry row ``[c k, c]``) are products of the
numbers. A gated recurrence with a cell state has such a step Jacobian; the compiled linear scan
applies it from the numbers (``w`` once, then five products per unit)."""


@dataclass(frozen=True)
class Tap:
    """Rows of some outputs of a run that the caller wants stacked (see :meth:`Backend.run`).

    Attributes:
        cols: ``(K,)`` int64, the vector-arena columns where those outputs start, in the order wanted.
        row0, rows: row ``row0 + r`` of output ``k`` goes to ``out[r, k]`` (``r < rows``).
        out: ``(rows, K, B)`` contiguous (feature-major), of the vectors' dtype and device.
        operand: ``None``, or ``(C, K, B)`` contiguous: then the stacked rows are wanted only
            multiplied with it (:class:`spscan.runtime.Collect`), and ``out`` is ``(rows, C)``.
    """

    cols: np.ndarray
    row0: int
    rows: int
    out: torch.Tensor
    operand: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class Feed:
    """Affine terms of some steps, where the caller holds them (see :meth:`Backend.run`).

    Attributes:
        cols: ``(K,)`` int64, the vector-arena column where each term's slot (an extra slot of the
            program, ``size`` columns wide) starts, in the order of ``terms``.
        size: a slot's width.
        row0: ``terms[k]`` fills slot columns ``row0 .. row0 + terms.shape[-1]``; the slot's other
            columns are zero.
        terms: ``(K, B, r)``, any strides, of the vectors' dtype and device.
    """

    cols: np.ndarray
    size: int
    row0: int
    terms: torch.Tensor


def load_feeds(vectors: torch.Tensor, feeds: Sequence[Feed]) -> None:
    """Write each :class:`Feed`'s terms into its slots of ``vectors`` (zero in the slots' other columns):
    what a backend that does not read feeds in place does before its steps."""
    for f in feeds:
        K, B, r = f.terms.shape
        cols = np.asarray(f.cols, dtype=np.int64)
        gap = int(cols[1] - cols[0]) if K > 1 else f.size
        if gap >= f.size and bool(np.all(np.diff(cols) == gap)):
            # evenly spaced slots: one strided view of them, (B, K, size)
            block = vectors.as_strided((B, K, f.size), (vectors.stride(0), gap * vectors.stride(1), vectors.stride(1)),
                                       vectors.storage_offset() + int(cols[0]) * vectors.stride(1))
            if r < f.size:
                block.zero_()
            block[..., f.row0:f.row0 + r].copy_(f.terms.transpose(0, 1))
        else:
            full = f.terms.new_zeros(B, K, f.size)
            full[..., f.row0:f.row0 + r] = f.terms.transpose(0, 1)
            idx = torch.as_tensor((cols[:, None] + np.arange(f.size)).reshape(-1), device=vectors.device)
            vectors[:, idx] = full.reshape(B, K * f.size)


class StructuredOperator(ABC):
    """A layer's transposed Jacobian applied matrix-free: ``J^T g`` for a batch of vectors.

    Passed in place of a layer's CSR values, it lets the engine skip forming those values where
    the schedule only multiplies the layer's matrix by vectors (the linear scan, the down-sweep);
    :meth:`values` gives the CSR values when a planned product needs them.

    Attributes:
        shape: ``(d_in, d_out)``, the shape of ``J^T``.
        shared: whether :meth:`values` is ``(nnz,)`` (shared by the batch) rather than ``(B, nnz)``.
    """

    shape: tuple[int, int]
    shared: bool

    @abstractmethod
    def apply(self, g: torch.Tensor) -> torch.Tensor:
        """``(B, d_out) -> (B, d_in)``: ``J^T g`` for every sample (``g`` may be a strided view)."""

    def apply_into(self, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`apply`, writing into ``out`` (a ``(B, d_in)`` view) where the operator can; returns the
        tensor holding the result (``out``, or a new one the caller copies)."""
        return self.apply(g)

    @abstractmethod
    def values(self) -> torch.Tensor:
        """The CSR values of ``J^T`` in its pattern's order, ``(nnz,)`` or ``(B, nnz)``."""


def run_apply(op, vectors: torch.Tensor, inputs: Callable[[int], StructuredOperator]) -> None:
    """One :class:`~spscan.planner.program.Apply` op, the same on every backend (the operator is
    torch code on the vectors' device): ``V[:, out] = J^T V[:, vin] (+ V[:, add])``."""
    dst = vectors[:, op.out : op.out + op.rows]
    operator, g = inputs(op.layer), vectors[:, op.vin : op.vin + op.cols]
    y = operator.apply(g) if op.add >= 0 else operator.apply_into(g, dst)
    if op.add >= 0:
        torch.add(y, vectors[:, op.add : op.add + op.rows], out=dst)
    elif y is not dst:
        dst.copy_(y)


@dataclass(frozen=True)
class Capabilities:
    """What a backend does, stated once.

    Attributes:
        reads_caller_inputs: linear runs over input matrices may read the caller's value tensors
            directly (the engine then skips loading them into the arena when nothing else reads them).
        graph_capturable: ``run`` only launches kernels on static buffers (no host sync, no
            allocation), so a bound backward can be captured in a CUDA graph.
        device_types: device types it runs on (``"cpu"`` for Triton means its interpreter).
    """

    reads_caller_inputs: bool
    graph_capturable: bool
    device_types: tuple[str, ...]


class Tables(ABC):
    """A program's device-side tables, built once per (program, device) by :meth:`Backend.make_tables`.

    Attributes every implementation sets:
        reads_arena_inputs: some launch reads input matrices from the arenas (else the engine
            need not copy the caller's values there).
        run_scratch: per-sample entries of working buffer the linear runs need (``arenas["C"]``), 0 if none.
    """

    reads_arena_inputs: bool = True
    run_scratch: int = 0


class Backend(ABC):
    """One numeric backend (see the module docstring)."""

    name: str
    capabilities: Capabilities

    def check_device(self, device: torch.device) -> None:
        """Raise ``ValueError`` if this backend cannot run on ``device`` (called when a plan is bound)."""
        if device.type not in self.capabilities.device_types:
            raise ValueError(f"backend={self.name!r} cannot run on device {device}; it runs on "
                             f"{', '.join(self.capabilities.device_types)}")

    @abstractmethod
    def make_tables(self, program, device: torch.device, memo: Optional[dict] = None) -> Tables:
        """All host work for ``program`` on ``device``: index tables uploaded once. ``memo`` (one dict per
        plan, backend and device): an op object another program of the plan shares reuses its device
        tables from there instead of building them again."""

    def launch_settings(self) -> tuple:
        """The process-wide settings, read at each launch, that change what the launches compute: a CUDA
        graph captured under one of them is replayed only under the same. None by default."""
        return ()

    @abstractmethod
    def run(self, tables: Tables, arenas: dict[str, torch.Tensor], vectors: torch.Tensor,
            inputs: Optional[Callable[[int], torch.Tensor]] = None, taps: Sequence[Tap] = (),
            skip: Optional[np.ndarray] = None, feeds: Sequence[Feed] = ()) -> bool:
        """Run every step in order, in place on ``arenas`` (``"S"``, ``"P"``, optional ``"C"``) and ``vectors``.

        ``inputs``: ``layer index -> the caller's values tensor`` (``(B, nnz)`` or ``(nnz,)``), read
        only by backends whose capabilities say ``reads_caller_inputs``.

        ``taps`` and ``skip`` are an offer: a backend that can write each :class:`Tap`'s rows as it
        produces those outputs (feature-major: no transposes into the sample-major arena, no copy
        out of it afterwards) does so and returns ``True``; it may then leave unwritten the arena columns
        of the outputs starting at ``skip`` (``int64`` offsets: outputs nobody reads after the run),
        unless a later step of its own reads them. Returning ``False`` means it did neither: every
        output is in ``vectors``, and the engine copies the taps from there.

        ``feeds`` are the program's extra terms that the engine did not load into ``vectors``: a
        backend reads them where they lie, or writes them into their slots first (:func:`load_feeds`).
        """


class CpuOps:
    """The compiled CPU operations (numba) front ends may call, declared in one place (:data:`cpu_ops`).

    Each method imports its module on first use and forwards its arguments unchanged; the module's
    function documents them. Where numba is absent :meth:`recurrence_available` is false and
    :meth:`max_pool2d_with_indices` returns ``None``, and the callers run their torch paths.
    """

    @staticmethod
    def tile_samples() -> int:
        """Samples the compiled linear scan runs side by side in one tile (:data:`.cpu.simd.LANES`): a batch
        that is not a multiple of it leaves lanes idle in its last tile."""
        from spscan.kernels.cpu.simd import LANES

        return LANES

    @staticmethod
    def recurrence_available() -> bool:
        """Whether the compiled recurrence forwards can run (numba importable)."""
        from spscan.kernels.cpu import recurrence as cpu_recurrence

        return cpu_recurrence.available()

    @staticmethod
    def input_projection(x: torch.Tensor, w_ih: torch.Tensor, bias: Optional[torch.Tensor]):
        """The input part ``x W_ih^T + bias`` of a forward's pre-activations, in the form the forwards read
        (:func:`spscan.kernels.cpu.recurrence.input_projection`)."""
        from spscan.kernels.cpu import recurrence as cpu_recurrence

        return cpu_recurrence.input_projection(x, w_ih, bias)

    @staticmethod
    def activation_recurrence_forward(gi, w_hh: torch.Tensor, h0: torch.Tensor, relu: bool,
                                      batch_first: bool = False, buffers=None,
                                      prev: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``h_t = act(gi_t + h_{t-1} W^T)``: ``(hs, d)``
        (:func:`spscan.kernels.cpu.recurrence.activation_recurrence_forward`)."""
        from spscan.kernels.cpu import recurrence as cpu_recurrence

        return cpu_recurrence.activation_recurrence_forward(gi, w_hh, h0, relu, batch_first, buffers, prev)

    @staticmethod
    def gated_cell_forward(gi, w_hh: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, batch_first: bool = False,
                           buffers=None, prev: Optional[torch.Tensor] = None
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Four gates and a cell state: ``(hs, c_T, values)``, the values in the :data:`GATE_BANDS` form
        (:func:`spscan.kernels.cpu.recurrence.gated_cell_forward`)."""
        from spscan.kernels.cpu import recurrence as cpu_recurrence

        return cpu_recurrence.gated_cell_forward(gi, w_hh, h0, c0, batch_first, buffers, prev)

    @staticmethod
    def reset_gated_forward(gi, w_hh: torch.Tensor, b_hn: Optional[torch.Tensor], h0: torch.Tensor,
                            batch_first: bool = False, buffers=None, prev: Optional[torch.Tensor] = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reset and update gates: ``(hs, d, dn)`` (:func:`spscan.kernels.cpu.recurrence.reset_gated_forward`)."""
        from spscan.kernels.cpu import recurrence as cpu_recurrence

        return cpu_recurrence.reset_gated_forward(gi, w_hh, b_hn, h0, batch_first, buffers, prev)

    @staticmethod
    def max_pool_compiled(kernel_size, dilation) -> bool:
        """Whether a 2-d max-pool of this window has a compiled forward
        (:func:`spscan.kernels.cpu.pool.compiled_window`)."""
        from spscan.kernels.cpu import pool as cpu_pool

        return cpu_pool.compiled_window(kernel_size, dilation)

    @staticmethod
    def max_pool2d_with_indices(x: torch.Tensor, kernel_size, stride, padding, dilation, ceil_mode: bool
                                ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """ATen's ``max_pool2d_with_indices`` on CPU, or ``None`` where the compiled loop does not apply
        (:func:`spscan.kernels.cpu.pool.max_pool2d_with_indices`)."""
        from spscan.kernels.cpu import pool as cpu_pool

        return cpu_pool.max_pool2d_with_indices(x, kernel_size, stride, padding, dilation, ceil_mode)


cpu_ops = CpuOps()


class FixedPointOps:
    """The fused elementwise passes of a Newton iteration on a recurrence (Triton, on CUDA or in its
    interpreter), declared in one place (:data:`fixed_point_ops`): each forwards its arguments to
    :mod:`spscan.kernels.triton.fixed_point`, whose functions document them."""

    @staticmethod
    def activation_eval(a, s, f, d, rv, rr, maxima, scale, relu: bool) -> None:
        """``f = act(a)`` with its derivative, residual and maxima in one pass
        (:func:`spscan.kernels.triton.fixed_point.activation_eval`)."""
        from spscan.kernels.triton import fixed_point

        fixed_point.activation_eval(a, s, f, d, rv, rr, maxima, scale, relu)

    @staticmethod
    def reset_gated_eval(gi, gh, p, f, c, dn, rv, rr, maxima, scale) -> None:
        """A reset-gated step with its coefficients, residual and maxima in one pass
        (:func:`spscan.kernels.triton.fixed_point.reset_gated_eval`)."""
        from spscan.kernels.triton import fixed_point

        fixed_point.reset_gated_eval(gi, gh, p, f, c, dn, rv, rr, maxima, scale)

    @staticmethod
    def gated_cell_eval(gi, gh, p, f, c, rv, rr, maxima, scale) -> None:
        """A step with four gates and a cell state, its coefficients, Jacobian, residual and maxima in one pass
        (:func:`spscan.kernels.triton.fixed_point.gated_cell_eval`)."""
        from spscan.kernels.triton import fixed_point

        fixed_point.gated_cell_eval(gi, gh, p, f, c, rv, rr, maxima, scale)

    @staticmethod
    def update(d, s, maxima) -> None:
        """The guess plus the scan's stacked update, last step first, and ``max|δ|``
        (:func:`spscan.kernels.triton.fixed_point.update`)."""
        from spscan.kernels.triton import fixed_point

        fixed_point.update(d, s, maxima)


fixed_point_ops = FixedPointOps()
