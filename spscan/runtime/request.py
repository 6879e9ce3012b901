"""What one run is asked to do: value sources, output sinks and options, declared in one place.

A :class:`RunRequest` is built by a front end (or by :meth:`~spscan.runtime.BoundPlan.run` from its
keywords) and executed by :meth:`~spscan.runtime.BoundPlan.execute`.

* **Value sources**: a list of ``n`` tensors (or structured operators), one stacked tensor, a
  :class:`ValuesBuffer` already in the binding's arena, or :class:`PeriodicValues` (a chain that
  repeats a few elements; a :class:`PeriodicBuffer` already in the arena); affine terms as a list or a
  :class:`StackedExtra` (an :class:`ExtraBuffer` already in their slots).
* **Output sinks**: every gradient (the default), only those flagged in ``keep``, or rows of some
  gradients stacked into the caller's buffers (:class:`Collect`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from spscan.kernels.backend import ValueEncoding

__all__ = ["Collect", "ExtraBuffer", "PeriodicBuffer", "PeriodicValues", "RunRequest", "StackedExtra", "ValuesBuffer"]


@dataclass(frozen=True)
class RunRequest:
    """One run of a bound program.

    Sources:
        values: ``n`` tensors ``(B, nnz_i)`` / ``(nnz_i,)`` matching the binding's ``shared`` (or
            structured operators where it was bound with them), one stacked ``(n, B, nnz)`` /
            ``(n, nnz)`` tensor, a :class:`ValuesBuffer` or a :class:`PeriodicValues`.
        grad: ``(B, d_n)`` (a scan); ``None`` for a reduction.
        extra: ``n+1`` entries (a list with ``None`` where absent, or a :class:`StackedExtra`), given
            exactly where the binding's ``has_extra`` says.

    Sinks:
        keep: ``n+1`` flags, the ``dl/dx_i`` the caller reads (default: all); the others are ``None``
            in the result. A linear scan of structured operators then frees each other one as soon as
            the next operator has read it; the compiled CPU linear scan does not write them.
        collect: :class:`Collect` requests, rows of some gradients stacked into the caller's buffers
            (written as they are produced where the backend can, else copied after the run). Not for
            a linear scan of structured operators.
        scratch: the result views the workspace's vector buffer (valid until the next run) instead
            of a new one.
        stop: a linear scan of structured operators applies elements ``n-1 .. stop`` only, so
            ``dl/dx_i`` for ``i < stop`` are ``None`` (frozen bottom layers and an input without
            gradient cost nothing, as in autograd). Ignored by other programs.

    Execution:
        check: validate the inputs (front ends that build the values themselves pass ``False``).
        check_finite: also refuse NaN/Inf (a device sync).
        graph: on a CUDA device with a graph-capturable backend, record the program's launches in a
            CUDA graph per batch size and dtype and replay it (the loads of values, ``grad`` and
            ``extra`` stay eager copies into the workspace). Ignored where it does not apply.
    """

    values: Any
    grad: Optional[torch.Tensor] = None
    extra: Any = None
    keep: Optional[Sequence[bool]] = None
    collect: Sequence["Collect"] = ()
    scratch: bool = False
    stop: int = 0
    check: bool = True
    check_finite: bool = False
    graph: bool = False


class ValuesBuffer(list):
    """A list of value tensors that live in a bound plan's input arena (see :meth:`~spscan.runtime.BoundPlan.values_buffer`)."""

    def __init__(self, views, bound, arenas: tuple) -> None:
        super().__init__(views)
        self.bound = bound
        self.shared = bound.shared
        self.arenas = arenas

    @property
    def stacked(self) -> torch.Tensor:
        """All layers as one ``(n, B, nnz)`` (per sample) or ``(n, nnz)`` (shared) view."""
        nnz = {int(v.shape[-1]) for v in self}
        if len(nnz) != 1 or len(set(self.shared)) != 1:
            raise ValueError("stacked view needs every layer to have the same nnz and sharedness")
        k, n = nnz.pop(), len(self)
        s_arena, p_arena = self.arenas
        if self.shared[0]:
            return s_arena[: n * k].view(n, k)
        return p_arena[:, : n * k].view(p_arena.shape[0], n, k).transpose(0, 1)


class PeriodicValues(Sequence):
    """The values of a chain that repeats ``len(elements)`` layers ``periods`` times, as a few tensors.

    ``elements[k]`` is either ``(nnz_k,)``, shared by the batch and the same in every period, or
    ``(periods, B, nnz_k)``, per sample, row ``t`` for period ``t``. Layer ``i`` (0-based, ``values[i]``)
    is element ``i % len(elements)`` of period ``i // len(elements)``: the object reads as the list of
    ``n = len(elements) * periods`` tensors (``len``, indexing, iteration), so every path that takes a
    list takes it. :meth:`~spscan.runtime.BoundPlan.run` hands it to the backend as it is; the compiled CPU linear run
    (:func:`spscan.kernels.cpu.chain.resolve_steps`) then locates all ``n`` layers' values with a few
    array operations instead of one Python look-up per layer (the recurrent front ends: ``n`` in the
    thousands). With ``check=True`` it is validated as the list it stands for.

    ``encodings[k]`` (a :class:`~spscan.kernels.backend.ValueEncoding`, or ``None``): per-sample element
    ``k`` is ``(periods, B, width)`` compact numbers, not CSR values. Indexing and the arena loads
    expand them to CSR values; the compiled CPU linear run reads the forms it knows as they are.
    """

    def __init__(self, elements: Sequence[torch.Tensor], periods: int,
                 encodings: Optional[Sequence[Optional[ValueEncoding]]] = None) -> None:
        self.elements = tuple(elements)
        self.periods = int(periods)
        self.encodings = tuple(encodings) if encodings is not None else (None,) * len(self.elements)
        if len(self.encodings) != len(self.elements):
            raise ValueError(f"encodings: expected one per element ({len(self.elements)}), got {len(self.encodings)}")
        for k, e in enumerate(self.elements):
            if not isinstance(e, torch.Tensor) or e.dim() not in (1, 3) or (e.dim() == 3 and e.shape[0] != self.periods):
                got = tuple(e.shape) if isinstance(e, torch.Tensor) else type(e).__name__
                raise ValueError(f"elements[{k}]: expected a (nnz,) shared or ({self.periods}, B, nnz) per-sample "
                                 f"tensor, got {got}")
            enc = self.encodings[k]
            if enc is not None and (not isinstance(enc, ValueEncoding) or e.dim() != 3 or e.shape[2] != enc.width):
                raise ValueError(f"encodings[{k}]: a ValueEncoding of a ({self.periods}, B, width) per-sample element "
                                 f"of its width, got {enc!r} for shape {tuple(e.shape)}")

    def __len__(self) -> int:
        return len(self.elements) * self.periods

    def decoded(self) -> "PeriodicValues":
        """The same values with every encoded element expanded to its CSR values (itself if none is encoded)."""
        if all(e is None for e in self.encodings):
            return self
        return PeriodicValues([self.expanded(k) for k in range(len(self.elements))], self.periods)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"layer index {i} out of range for {n} layers")
        t, k = divmod(i, len(self.elements))
        e = self.elements[k]
        if e.dim() == 1:
            return e
        enc = self.encodings[k]
        return e[t] if enc is None else enc.expand(e[t])

    def expanded(self, k: int) -> torch.Tensor:
        """Element ``k`` as CSR values: ``(nnz,)`` or ``(periods, B, nnz)`` (expanded where it is encoded)."""
        e, enc = self.elements[k], self.encodings[k]
        return e if enc is None else enc.expand(e)


class StackedExtra(Sequence):
    """The ``n+1`` affine terms of a scan, given at evenly spaced positions by one stacked tensor.

    ``terms`` ``(K, B, r)``, any strides; ``index`` a ``range`` of ``K`` chain positions; entry ``i`` is
    ``terms[index.index(i)]`` where ``i`` is in ``index`` (placed at columns ``row0 .. row0 + r`` of a
    ``(B, size)`` term, zero elsewhere, when ``size`` is given; ``size`` defaults to ``r``), ``None``
    elsewhere; ``length = n + 1``. Reads as that list; :meth:`~spscan.runtime.BoundPlan.run` loads all ``K`` terms
    with one copy instead of gathering ``K`` tensors (a loss on every step of a long recurrence), and
    the compiled CPU linear scan reads them where they lie (fastest when ``terms`` is a view of
    feature-major ``(r, K, B)`` memory).
    """

    def __init__(self, terms: torch.Tensor, index: range, length: int, row0: int = 0,
                 size: Optional[int] = None) -> None:
        if not isinstance(index, range) or terms.dim() != 3 or len(index) != terms.shape[0]:
            raise ValueError(f"terms/index: expected a (K, B, r) tensor and a range of K positions, got "
                             f"{tuple(terms.shape)} and {index!r}")
        if len(index) and (min(index[0], index[-1]) < 0 or max(index[0], index[-1]) >= length):  # a range's ends
            raise ValueError(f"index: positions must lie in [0, {length}), got {index!r}")
        size = terms.shape[2] if size is None else int(size)
        if row0 < 0 or row0 + terms.shape[2] > size:
            raise ValueError(f"row0/size: the terms' {terms.shape[2]} columns from {row0} must fit a term of {size}")
        self.terms = terms
        self.index = index
        self.length = int(length)
        self.row0 = int(row0)
        self.size = size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(f"position {i} out of range for {self.length} entries")
        if i not in self.index:
            return None
        t = self.terms[self.index.index(i)]
        if t.shape[1] == self.size:
            return t
        full = t.new_zeros(t.shape[0], self.size)
        full[:, self.row0:self.row0 + t.shape[1]] = t
        return full


class PeriodicBuffer(PeriodicValues):
    """A :class:`PeriodicValues` whose elements are views of a periodic binding's input arenas, laid out as a run
    loads them (see :meth:`~spscan.runtime.BoundPlan.periodic_buffer`): filled in place and passed as ``values``,
    it is run without a copy."""

    def __init__(self, elements: Sequence[torch.Tensor], periods: int, bound: Any, arenas: tuple) -> None:
        super().__init__(elements, periods)
        self.bound = bound
        self.arenas = arenas


class ExtraBuffer(StackedExtra):
    """A :class:`StackedExtra` whose terms are a view of the slots a binding's working vectors hold them in (see
    :meth:`~spscan.runtime.BoundPlan.extra_buffer`): filled in place and passed as ``extra`` to a run that keeps
    its result in the working buffer (``scratch`` or ``graph``), it is run without a copy."""

    def __init__(self, terms: torch.Tensor, index: range, length: int, bound: Any, vectors: torch.Tensor) -> None:
        super().__init__(terms, index, length)
        self.bound = bound
        self.vectors = vectors


class Collect(NamedTuple):
    """Rows of some chain gradients, wanted stacked feature-major: after :meth:`~spscan.runtime.BoundPlan.run`,
    ``out[r, k, b]`` holds ``dl/dx_{index[k]}[b, rows][r]``, i.e. ``out[:, k] = dl/dx_{index[k]}[:, rows].T``.

    With an ``operand`` ``Z`` (``(C, len(index), B)``, contiguous, of the run's dtype and device), the
    stacked rows are wanted only multiplied with it over all steps and samples: ``out`` is
    ``(len(rows), C)`` and receives ``S Z^T`` for ``S`` the stacked rows viewed ``(len(rows),
    len(index) * B)`` (a weight gradient: the gradients of a layer's pre-activations times its
    inputs). A backend that can computes it a few steps at a time as it produces the rows, never
    storing them (the compiled CPU linear scan; at most one such request per run); otherwise the
    engine stacks them and runs one GEMM.

    ``index``: chain positions whose gradients have one size ``d``; ``rows``: a slice of ``range(d)``
    with step 1; ``out``: ``(len(rows), len(index), B)``, contiguous, of the run's dtype and device
    (the caller's: a buffer it recycles). ``out[r]`` viewed ``(len(index) * B,)`` is one row of a
    GEMM operand over all steps and samples. A backend that can writes the rows as it produces
    them -- the compiled CPU linear scan, one vector store per row and tile, as its tiles hold
    them -- instead of a copy out of the sample-major vectors afterwards.
    """

    index: range
    rows: slice
    out: torch.Tensor
    operand: Optional[torch.Tensor] = None
