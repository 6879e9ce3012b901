"""The run-time engine: one plan bound to a device, a backend and a value signature.

A :class:`BoundPlan` is made by :meth:`spscan.Plan.bind` (once per signature, cached by the
plan): it lowers the symbolic plan to a :class:`~spscan.planner.program.Program` for one
sharedness / extra signature, has the backend upload the program's index tables to the device,
and fixes the memory check. Its :meth:`BoundPlan.run` does only numeric work: load the value
arenas, launch the program, hand back a :class:`ScanResult`. Every front end (the chain API,
the model wrapper, the recurrent modules, the model-parallel scan) runs through this one class;
none of them reads arenas or work tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from spscan.kernels.backend import Backend, Feed, StructuredOperator, Tap, ValueEncoding, load_feeds
from spscan.planner.memory import estimate_memory
from spscan.planner.planning import ScanPlan
from spscan.planner.program import Apply, LoweringCache, Program, lower

__all__ = ["BoundPlan", "Collect", "ScanResult", "ValuesBuffer", "PeriodicValues", "RecycledBuffers", "StackedExtra",
           "StructuredOperator", "check_inputs", "fmt_bytes"]

_FLOATS = (torch.float32, torch.float64)


_MAX_GRAPHS = 4  # CUDA graphs a bound plan keeps (one per batch size and dtype in use)


def canonical_device(device) -> torch.device:
    """``device`` with its index filled in: ``cuda`` means the current CUDA device, as a tensor's
    ``.device`` would name it (``cuda:0``), so plan and tensor devices compare equal."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def fmt_bytes(b: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return str(b)


def _storage_use_count(t: torch.Tensor) -> Optional[int]:
    """How many tensors (views, NumPy arrays, saved tensors) use ``t``'s storage; ``None`` if torch
    cannot say (``torch._C._storage_Use_Count`` is not a public API: without it nothing is recycled)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        return int(count(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError, TypeError):
        return None


class RecycledBuffers:
    """Large CPU tensors handed out again once nothing else uses them.

    A front end that makes multi-MB tensors on every step (the compiled recurrent forwards' chain
    values, the backward's copies of the scan's gradients) pays for fresh memory on first touch: the
    OS maps and zeroes it page by page. Measured on one core (2-core x86_64 VM): the T = 10000 LSTM's
    forward took 68 ms with a fresh 115 MB values tensor per step and 21 ms with a recycled one.
    :meth:`take` returns the tensor it handed out last time under ``name`` when its storage has no
    other user left (no view, NumPy array or saved tensor of it: its use count is back to what it was
    when it was made) and its shape and dtype match; otherwise a new one, which it keeps instead. So a
    tensor a caller still holds is never handed out twice, and at most one tensor per name is kept.
    CUDA tensors are never kept (the caching allocator already recycles device memory).
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[torch.Tensor, int]] = {}

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype,
             device: torch.device = torch.device("cpu")) -> torch.Tensor:
        """An uninitialized ``shape`` tensor of ``dtype`` on ``device``, recycled where it can be."""
        shape = tuple(int(d) for d in shape)
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        hit = self._held.get(name)
        if hit is not None:
            t, baseline = hit
            if t.shape == shape and t.dtype == dtype and _storage_use_count(t) == baseline:
                return t.view(shape)
        t = torch.empty(shape, dtype=dtype)
        baseline = _storage_use_count(t)
        if baseline is None:
            self._held.pop(name, None)
            return t
        self._held[name] = (t, baseline)
        # callers get a view: whoever keeps it (or a view of it) counts as a user of the storage
        return t.view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors kept (whether or not a caller still uses them)."""
        return sum(t.numel() * t.element_size() for t, _ in self._held.values())

    def address(self, name: str) -> Optional[int]:
        """The data pointer of the tensor kept under ``name`` (``None``: none kept)."""
        hit = self._held.get(name)
        return None if hit is None else hit[0].data_ptr()

    def clear(self) -> None:
        """Free every kept tensor (those still in use live on with their users)."""
        self._held.clear()


class ValuesBuffer(list):
    """A list of value tensors that live in a bound plan's input arena (see :meth:`BoundPlan.values_buffer`)."""

    def __init__(self, views, bound: "BoundPlan", arenas: tuple) -> None:
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
    list takes it. :meth:`BoundPlan.run` hands it to the backend as it is; the compiled CPU linear run
    (:func:`spscan.kernels.cpu_chain.resolve_steps`) then locates all ``n`` layers' values with a few
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


def _load_periodic(values: PeriodicValues, s_arena: torch.Tensor, p_arena: torch.Tensor, batch: int,
                   once: bool = False) -> None:
    """Load a periodic chain's values into the input arenas as the layer-order concatenation
    would (shared layers back to back in ``S``, per-sample layers in ``P``), with one strided
    copy per element instead of a Python look-up and a concatenation over ``n`` layers.
    ``once``: the binding holds each shared element once (a periodic signature), not once per period."""
    T = values.periods
    elements = [values.expanded(k) for k in range(len(values.elements))]
    shared = [e for e in elements if e.dim() == 1]
    per = [e for e in elements if e.dim() == 3]
    if shared:
        width = sum(int(e.shape[0]) for e in shared)
        reps = 1 if once else T
        block = s_arena[: reps * width].view(reps, width)
        off = 0
        for e in shared:
            block[:, off : off + e.shape[0]].copy_(e.unsqueeze(0).expand(reps, -1))
            off += int(e.shape[0])
    if per:
        width = sum(int(e.shape[2]) for e in per)
        block = p_arena[:, : T * width].view(batch, T, width)
        off = 0
        for e in per:
            block[:, :, off : off + e.shape[2]].copy_(e.transpose(0, 1))
            off += int(e.shape[2])


class StackedExtra(Sequence):
    """The ``n+1`` affine terms of a scan, given at evenly spaced positions by one stacked tensor.

    ``terms`` ``(K, B, r)``, any strides; ``index`` a ``range`` of ``K`` chain positions; entry ``i`` is
    ``terms[index.index(i)]`` where ``i`` is in ``index`` (placed at columns ``row0 .. row0 + r`` of a
    ``(B, size)`` term, zero elsewhere, when ``size`` is given; ``size`` defaults to ``r``), ``None``
    elsewhere; ``length = n + 1``. Reads as that list; :meth:`BoundPlan.run` loads all ``K`` terms
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


class Collect(NamedTuple):
    """Rows of some chain gradients, wanted stacked feature-major: after :meth:`BoundPlan.run`,
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


class ScanResult:
    """The output of one :meth:`BoundPlan.run`.

    For a scan: ``result[i]`` is ``dl/dx_i`` ``(B, d_i)``, ``result.grads`` the contract's list of
    ``n+1`` tensors, ``result.stacked(idx)`` a ``(len(idx), B, d)`` block of equally sized
    gradients (a strided view where the engine wrote them evenly spaced). For a reduction:
    ``result.composite`` (the composite matrix's values, ``(nnz,)`` or ``(B, nnz)``, in the order
    of the plan's ``composite_pattern``) and ``result.composite_vector`` (its affine term
    ``(B, d_0)`` or ``None``). Every tensor views storage owned by the result, unless the run was
    made with ``scratch=True``: then they view the bound plan's working buffer, valid until its
    next run.
    """

    def __init__(self, vectors: torch.Tensor, program: Program, composite: Optional[torch.Tensor] = None,
                 index_cache: Optional[dict] = None, kept: Optional[Sequence[bool]] = None) -> None:
        self._vectors = vectors
        self._program = program
        self._kept = None if kept is None else np.asarray(kept, dtype=bool)  # None: every gradient (run(keep=...))
        # the bound plan's: device column indices of irregular ``stacked`` blocks, uploaded once
        self._index_cache = {} if index_cache is None else index_cache
        self._grads: Optional[list[torch.Tensor]] = None
        self.composite = composite

    def __len__(self) -> int:
        return len(self._program.outputs)

    def __getitem__(self, i: int) -> torch.Tensor:
        off, d = self._program.outputs[i]
        if off < 0:
            raise ValueError(f"dl/dx_{i} was not computed: the plan was bound without it (first_output=False)")
        if self._kept is not None and not self._kept[i]:
            raise ValueError(f"dl/dx_{i} was not kept: the run was asked for others only (keep=...)")
        return self._vectors[:, off : off + d]

    @property
    def grads(self) -> list[torch.Tensor]:
        """``[dl/dx_0, ..., dl/dx_n]`` as views made by one ``tensor_split`` (cheap for long chains);
        ``None`` where not computed (bound without ``dl/dx_0``) or not kept (``run(keep=...)``)."""
        if self._grads is None:
            cuts, pick = self._program.output_split
            pieces = self._vectors.tensor_split(cuts, dim=1)
            kept = self._kept
            self._grads = [pieces[k] if k >= 0 and (kept is None or kept[i]) else None for i, k in enumerate(pick)]
        return list(self._grads)

    def stacked(self, idx: range, copy: bool = False) -> torch.Tensor:
        """``(len(idx), B, d)`` for chain indices whose gradients all have size ``d``.

        The linear scan writes its outputs at evenly spaced offsets, so this is usually one
        strided view (no copy; a reversed run: one copy); otherwise one gather of the columns.
        ``copy=True`` always returns a new, contiguous tensor (one copy, two after a gather).
        The layout of each ``idx`` is worked out once per bound plan (and its gather indices
        uploaded once), so a repeated call does no host work proportional to ``len(idx)``.
        """
        if self._kept is not None and not self._kept[np.arange(idx.start, idx.stop, idx.step)].all():
            raise ValueError(f"stacked: some gradients at {idx} were not kept (keep=...)")
        key = (idx.start, idx.stop, idx.step)
        layout = self._index_cache.get(key)
        if layout is None:
            layout = self._index_cache[key] = self._stacked_layout(idx)
        v = self._vectors
        if layout[0] == "view":
            _, count, first, step, d = layout
            view = v.as_strided((count, v.shape[0], d), (abs(step) * v.stride(1), v.stride(0), v.stride(1)),
                                v.storage_offset() + first * v.stride(1))
            if step < 0:
                # flip copies; with copy=True the copy is contiguous (a plain flip keeps the batch-major
                # layout of the view, and a reshape of it would copy again)
                if copy:
                    return view.index_select(0, torch.arange(count - 1, -1, -1, device=v.device))
                return view.flip(0)
            return view.clone(memory_format=torch.contiguous_format) if copy else view
        # irregular offsets: one gather of all the columns ((B, K*d), the batch outermost), not K slices
        _, count, cols, d = layout
        out = v.index_select(1, cols).view(v.shape[0], count, d).transpose(0, 1)
        return out.contiguous() if copy else out

    def _stacked_layout(self, idx: range) -> tuple:
        """``("view", K, first, step, d)`` for evenly spaced outputs, else ``("gather", K, cols, d)``."""
        outs = self._program.outputs
        offs = np.fromiter((outs[i][0] for i in idx), dtype=np.int64, count=len(idx))
        dims = {outs[i][1] for i in idx}
        if len(dims) != 1:
            raise ValueError(f"stacked: the gradients at {idx} have different sizes {sorted(dims)}")
        d = dims.pop()
        if offs.size > 1:
            step = int(offs[1] - offs[0])
            if step != 0 and abs(step) >= d and bool(np.all(np.diff(offs) == step)):
                return ("view", int(offs.size), int(offs.min()), step, d)
        cols = torch.as_tensor((offs[:, None] + np.arange(d)).reshape(-1), device=self._vectors.device)
        return ("gather", int(offs.size), cols, d)

    @property
    def composite_vector(self) -> Optional[torch.Tensor]:
        root = self._program.root_vec
        if root is None:
            return None
        off, d = root
        return self._vectors[:, off : off + d]


class _ListResult(ScanResult):
    """A :class:`ScanResult` whose gradients are separate tensors (a linear scan of structured operators)."""

    def __init__(self, grads: list[Optional[torch.Tensor]]) -> None:
        self._list = grads
        self.composite = None

    def __len__(self) -> int:
        return len(self._list)

    def __getitem__(self, i: int) -> torch.Tensor:
        g = self._list[i]
        if g is None:
            raise ValueError(f"dl/dx_{i} was not computed: the plan was bound without it (first_output=False)")
        return g

    @property
    def grads(self) -> list[torch.Tensor]:
        return list(self._list)

    def stacked(self, idx: range, copy: bool = False) -> torch.Tensor:
        return torch.stack([self[i] for i in idx])

    @property
    def composite_vector(self) -> Optional[torch.Tensor]:
        return None


def _fail(kind, msg: str):
    raise kind(msg)


def check_inputs(n: int, nnzs: Sequence[int], dims: Sequence[int], plan_dtype, plan_device, values: Any,
                 grad: Optional[torch.Tensor], extra, check_finite: bool, *, needs_grad: bool = True):
    """Validate one call's inputs; returns ``(items, stacked, shared, has_extra, batch, dtype, device, operators)``.

    ``nnzs[i]``: nnz of ``J_{i+1}^T``; ``dims``: ``d_0 .. d_n``. Never copies or mutates the caller's
    tensors. ``needs_grad=False`` (a reduction) takes ``grad=None`` and the batch from the values.
    """
    d_n = dims[n]
    if needs_grad or grad is not None:
        if not isinstance(grad, torch.Tensor):
            _fail(TypeError, f"grad: expected a torch.Tensor of shape (B, {d_n}), got {type(grad).__name__}")
        if grad.dtype not in _FLOATS:
            _fail(TypeError, f"grad: expected dtype float32 or float64, got {grad.dtype}")
        if grad.dim() != 2 or grad.shape[1] != d_n:
            _fail(ValueError, f"grad: expected shape (B, {d_n}) for layer {n}'s output, got {tuple(grad.shape)}")
        batch, dtype, device = grad.shape[0], grad.dtype, grad.device
        if batch < 1:
            _fail(ValueError, "grad: batch size must be at least 1, got 0")
    else:
        first = values if isinstance(values, torch.Tensor) else next(iter(values), None) if hasattr(values, "__iter__") else None
        if not isinstance(first, torch.Tensor):
            _fail(TypeError, f"values: expected a sequence of {n} tensors, got {type(values).__name__}")
        dtype, device = first.dtype, first.device
        if dtype not in _FLOATS:
            _fail(TypeError, f"values[0] (layer 1): expected dtype float32 or float64, got {dtype}")
        batch = None  # taken from the first per-sample value or extra
    if plan_dtype is not None and dtype != plan_dtype:
        _fail(TypeError, f"{'grad' if grad is not None else 'values'}: the plan was made for {plan_dtype}, got {dtype}")
    if plan_device is not None and device != plan_device:
        _fail(ValueError, f"{'grad' if grad is not None else 'values'}: the plan was made for device {plan_device}, "
                          f"got {device}")

    stacked = isinstance(values, torch.Tensor)
    if stacked:
        if values.dim() not in (2, 3) or values.shape[0] != n:
            _fail(ValueError, f"values: a stacked tensor must be (n={n}, B, nnz) or (n, nnz), got {tuple(values.shape)}")
        if len(set(nnzs)) != 1:
            _fail(ValueError, "values: a stacked tensor needs every layer to have the same nnz; pass a list")
        items: Sequence[torch.Tensor] = [values]
    else:
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            _fail(TypeError, f"values: expected a sequence of {n} tensors, got {type(values).__name__}")
        if len(values) != n:
            _fail(ValueError, f"values: expected {n} tensors (one per layer), got {len(values)}")
        items = values
    if batch is None:
        for v in items:
            if isinstance(v, torch.Tensor) and v.dim() == (3 if stacked else 2):
                batch = int(v.shape[1 if stacked else 0])
                break
        else:
            for e in extra or ():
                if isinstance(e, torch.Tensor) and e.dim() == 2:
                    batch = int(e.shape[0])
                    break
            else:
                batch = 1
    checked: dict[int, bool] = {}  # a tensor repeated along the chain is checked once per shape
    shared = []
    operators = [False] * n
    for i, v in enumerate(items):
        nnz = nnzs[0] if stacked else nnzs[i]
        key = id(v)
        hit = checked.get(key)
        if hit is not None and v.shape[-1] == nnz:  # (operators are never recorded here)
            shared.append(hit)
            continue
        layer = f"layer {i + 1}" if not stacked else "values"
        if isinstance(v, StructuredOperator) and not stacked:
            if tuple(v.shape) != (dims[i], dims[i + 1]):
                _fail(ValueError, f"values[{i}] ({layer}): a structured operator of shape {tuple(v.shape)}, expected "
                                  f"({dims[i]}, {dims[i + 1]})")
            shared.append(bool(v.shared))
            operators[i] = True
            continue
        if not isinstance(v, torch.Tensor):
            _fail(TypeError, f"values[{i}] ({layer}): expected a torch.Tensor, got {type(v).__name__}")
        if v.layout != torch.strided:
            _fail(TypeError, f"values[{i}] ({layer}): expected a dense strided tensor of CSR values, got layout {v.layout}")
        if v.dtype != dtype:
            _fail(TypeError, f"values[{i}] ({layer}): dtype {v.dtype} differs from {'grad' if grad is not None else 'values[0]'}'s {dtype}")
        if v.device != device:
            _fail(ValueError, f"values[{i}] ({layer}): on {v.device}, {'grad' if grad is not None else 'values[0]'} is on {device}")
        shape = tuple(v.shape[1:]) if stacked else tuple(v.shape)
        if shape == (nnz,):
            is_shared = True
        elif shape == (batch, nnz):
            is_shared = False
        else:
            _fail(ValueError, f"values[{i}] ({layer}): expected shape ({batch}, {nnz}) or ({nnz},) "
                              f"for a ({dims[i if not stacked else 0]}, {dims[(i if not stacked else 0) + 1]}) "
                              f"pattern with nnz={nnz}, got {tuple(v.shape)}")
        checked[key] = is_shared
        shared.append(is_shared)
    if stacked:
        shared = shared * n
    has_extra = [False] * (n + 1)
    if extra is not None:
        if isinstance(extra, torch.Tensor) or not hasattr(extra, "__len__") or len(extra) != n + 1:
            got = len(extra) if hasattr(extra, "__len__") and not isinstance(extra, torch.Tensor) else type(extra).__name__
            _fail(ValueError, f"extra: expected a sequence of n+1={n + 1} entries (None or (B, d_i)), got {got}")
        for i, e in enumerate(extra):
            if e is None:
                continue
            d = dims[i]
            if not isinstance(e, torch.Tensor):
                _fail(TypeError, f"extra[{i}]: expected None or a tensor of shape ({batch}, {d}), got {type(e).__name__}")
            if e.dtype != dtype:
                _fail(TypeError, f"extra[{i}]: dtype {e.dtype} differs from the values' {dtype}")
            if e.device != device:
                _fail(ValueError, f"extra[{i}]: on {e.device}, the values are on {device}")
            if tuple(e.shape) != (batch, d):
                _fail(ValueError, f"extra[{i}]: expected shape ({batch}, {d}) (dl/dx_{i}), got {tuple(e.shape)}")
            if i == n and not needs_grad:
                _fail(ValueError, f"extra[{n}]: a composite covers dl/dx_0 .. dl/dx_{n - 1} only; expected None")
            has_extra[i] = True
    if check_finite:
        tensors = ([("grad", grad)] if grad is not None else []) + [(f"values[{i}]", v) for i, v in enumerate(items)]
        if extra is not None:
            tensors += [(f"extra[{i}]", e) for i, e in enumerate(extra) if e is not None]
        for name, t in tensors:
            if not bool(torch.isfinite(t).all()):
                _fail(ValueError, f"{name}: contains NaN or Inf (check_finite=True)")
    return items, stacked, tuple(shared), tuple(has_extra), batch, dtype, device, tuple(operators)


class BoundPlan:
    """A plan lowered for one ``(shared, has_extra)`` signature on one device, its tables uploaded.

    Made by :meth:`spscan.Plan.bind`; all index work happens here, once. :meth:`run` is the only
    per-step call. ``shared[i]``: layer ``i+1``'s values come as ``(nnz,)`` (shared by the batch);
    ``has_extra[i]``: ``extra[i]`` is given.

    Attributes:
        shared, has_extra, device, backend: the signature.
        program: the lowered :class:`~spscan.planner.program.Program` (read-only).
        tables: the backend's device tables (read-only).
    """

    def __init__(self, scan: ScanPlan, shared: tuple, has_extra: tuple, device: torch.device, backend: Backend,
                 dtype: Optional[torch.dtype], max_memory: Optional[int], operators: Optional[tuple] = None,
                 first_output: bool = True, lowering: Optional[LoweringCache] = None,
                 table_memo: Optional[dict] = None, period: int = 0) -> None:
        device = canonical_device(device)
        backend.check_device(device)
        self.shared = shared
        self.has_extra = has_extra
        self.operators = (False,) * scan.n if operators is None else operators
        self.first_output = first_output
        self.device = device
        self._index_cache: dict = {}
        self._graphs: dict = {}  # run(graph=True): CUDA graphs by (batch, dtype, buffer addresses)
        self.backend = backend
        self.dtype = dtype
        self.max_memory = max_memory
        self.kind = scan.schedule.kind
        self.n = scan.n
        pats = scan.patterns
        self._nnz = [p.nnz for p in pats]
        self._dims = [p.rows for p in pats] + [pats[-1].cols]
        # ``lowering`` / ``table_memo``: the plan's caches, so tables equal to another binding's are held once
        self.program = lower(scan, shared, has_extra, self.operators, first_output, lowering, period)
        self.period = self.program.period  # > 0: values come as PeriodicValues of this many elements
        self.tables = backend.make_tables(self.program, device, table_memo)
        # run(graph=True) applies: launches only, on this plan's buffers (no caller tensor read by a launch)
        self._any_operators = any(self.operators)  # read per run: a chain of 60000 layers makes any() cost
        self._graphable = (device.type == "cuda" and backend.capabilities.graph_capturable
                           and self.tables.reads_arena_inputs and not self._any_operators)
        # the planner's peak plus the backend's working memory for linear runs (per sample)
        self._peak_per_sample = (estimate_memory(scan).backward_peak(1) + self.tables.run_scratch * scan.elem_bytes
                                 if max_memory is not None else 0)
        cols = [np.arange(off, off + self._dims[i]) for i, off in self.program.extra_slots.items()]
        # one index_put of the concatenated extras instead of a copy per layer (long chains with a loss per step)
        self._extra_cols = torch.as_tensor(np.concatenate(cols), dtype=torch.int64, device=device) if cols else None
        # the extra positions as a range when evenly spaced (a StackedExtra over them loads with one copy)
        slots = list(self.program.extra_slots)
        step = slots[1] - slots[0] if len(slots) > 1 else 1
        self._extra_range = range(slots[0], slots[-1] + step, step) if slots and step > 0 else None
        if self._extra_range is not None and list(self._extra_range) != slots:
            self._extra_range = None
        # ... and, when their columns in V are evenly spaced too, (first column, spacing, size): then the
        # stacked terms go in with one strided copy (no gather and no index tensor)
        self._extra_block: Optional[tuple[int, int, int]] = None
        if self._extra_range is not None:
            offs = [self.program.extra_slots[i] for i in slots]
            sizes = {self._dims[i] for i in slots}
            gap = offs[1] - offs[0] if len(offs) > 1 else max(sizes)
            if len(sizes) == 1 and gap >= max(sizes) and all(b - a == gap for a, b in zip(offs, offs[1:])):
                self._extra_block = (offs[0], gap, sizes.pop())
        self._arena_key: Optional[tuple] = None
        self._arenas: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._scratch: dict[str, torch.Tensor] = {}
        self._operator_chain = self._find_operator_chain()

    @property
    def graph_capturable(self) -> bool:
        """Whether :meth:`run` can be recorded in a CUDA graph (``graph=True`` applies): a CUDA device, a
        backend whose launches read only the plan's own buffers, no structured operators."""
        return self._graphable

    # -- a linear scan of structured operators only ---------------------------------------
    def _find_operator_chain(self) -> Optional[list[int]]:
        """Layers (top first) when the program is a plain linear scan of structured operators.

        Then the vector arena only relays each operator's output to the next one's input: the run
        calls the operators on their own contiguous tensors instead (no copies in and out of the
        arena's strided columns), in the same order, so results are identical.
        """
        prog = self.program
        ops = [op for st in prog.steps for op in st.ops]
        if self.kind != "scan" or not ops or any(self.has_extra) or len(ops) != sum(len(st.ops) for st in prog.steps):
            return None
        if not all(isinstance(op, Apply) and op.add < 0 for op in ops) or any(len(st.ops) != 1 for st in prog.steps):
            return None
        layers = [op.layer for op in ops]
        expect = list(range(self.n - 1, self.n - 1 - len(ops), -1))
        if layers != expect or len(ops) < self.n - 1:
            return None
        vin = prog.grad_slot
        for op in ops:  # each operator reads what the previous one wrote
            if op.vin != vin:
                return None
            vin = op.out
        return layers

    @property
    def operator_chain(self) -> Optional[tuple[int, ...]]:
        """The layers (top first) whose operators a run applies, each once and in this order, when the
        program is a plain linear scan of structured operators; ``None`` otherwise."""
        chain = self._operator_chain
        return None if chain is None else tuple(chain)

    def _run_operator_chain(self, items, grad: torch.Tensor, keep: Optional[Sequence[bool]] = None,
                            stop: int = 0) -> list[Optional[torch.Tensor]]:
        """``dl/dx_i`` ``(B, d_i)`` from applying the operators in chain order. Each operator gets what the
        one above it returned: ``grad`` may be ``(B, *shape)`` and an operator may return its ``J^T g`` in
        its layer's natural input shape, when the operators above and below it accept that (the model
        wrapper's chain steps do, as autograd passes activations unflattened); results are flattened."""
        out: list[Optional[torch.Tensor]] = [None] * (self.n + 1)
        if keep is None:
            out[self.n] = g = grad.clone()
            for layer in self._operator_chain:
                if layer < stop:
                    break
                g = items[layer].apply(g)
                out[layer] = g
        else:
            g = grad
            if keep[self.n]:
                out[self.n] = g = grad.clone()
            for layer in self._operator_chain:  # a gradient not kept is freed once the next layer has read it
                if layer < stop:
                    break
                g = items[layer].apply(g)
                if keep[layer]:
                    out[layer] = g
        for i, t in enumerate(out):
            if t is not None and t.dim() != 2:
                out[i] = t.reshape(t.shape[0], -1)
        return out

    # -- buffers --------------------------------------------------------------------------
    def _get_arenas(self, batch: int, dtype: torch.dtype):
        """Matrix arenas ``(S, P)`` for one call, reused while the batch size and dtype repeat."""
        key = (batch, dtype)
        if self._arena_key != key:
            self._arenas = None  # hold at most one set: memory stays at one backward's peak
            prog = self.program
            self._arenas = (torch.empty(prog.size_s, dtype=dtype, device=self.device),
                            torch.empty(batch, prog.size_p, dtype=dtype, device=self.device))
            self._arena_key = key
        return self._arenas

    def _scratch_buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat working buffer kept between calls (fresh multi-MB CPU buffers page-fault on every call)."""
        hit = self._scratch.get(name)
        if hit is None or hit.numel() < numel or hit.dtype != dtype:
            hit = self._scratch[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return hit[:numel]

    def held_buffers(self) -> list[torch.Tensor]:
        """The buffers a run writes and reads now (arenas, working buffers): a caller that records runs in
        its own CUDA graph keeps these alive for as long as it replays it (a later batch size or dtype
        makes the plan hold new ones and let go of these)."""
        held = list(self._arenas) if self._arenas is not None else []
        return held + list(self._scratch.values())

    def release_buffers(self) -> None:
        """Free the arenas, working buffers and CUDA graphs kept between calls (tables stay)."""
        self._graphs.clear()
        self._arena_key = self._arenas = None
        self._scratch.clear()

    def values_buffer(self, batch: int, dtype: torch.dtype = torch.float32) -> ValuesBuffer:
        """Views into the input arena to fill in place and pass as ``values`` (no copy in :meth:`run`).

        Valid until another batch size or dtype is run or the buffers are released.
        """
        s_arena, p_arena = self._get_arenas(batch, dtype)
        views = []
        for i, nnz in enumerate(self._nnz):
            off = self.program.input_offsets[i]
            views.append(s_arena[off : off + nnz] if self.shared[i] else p_arena[:, off : off + nnz])
        return ValuesBuffer(views, self, (s_arena, p_arena))

    # -- the run --------------------------------------------------------------------------
    def run(self, values: Any, grad: Optional[torch.Tensor] = None,
            extra: Optional[Sequence[Optional[torch.Tensor]]] = None, *, check: bool = True,
            check_finite: bool = False, scratch: bool = False,
            keep: Optional[Sequence[bool]] = None, graph: bool = False, stop: int = 0,
            collect: Sequence[Collect] = ()) -> ScanResult:
        """Run the bound program on one step's values.

        Args:
            values: ``n`` tensors ``(B, nnz_i)`` / ``(nnz_i,)`` matching :attr:`shared`, or one stacked
                ``(n, B, nnz)`` / ``(n, nnz)`` tensor.
            grad: ``(B, d_n)`` (a scan); ``None`` for a reduction.
            extra: ``n+1`` entries, given exactly where :attr:`has_extra` says.
            check: validate the inputs (front ends that build the values themselves pass ``False``).
            check_finite: also refuse NaN/Inf (a device sync).
            scratch: the result views the bound plan's working buffer (valid until the next run)
                instead of a new one.
            keep: ``n+1`` flags, the ``dl/dx_i`` the caller reads (default: all); the others are
                ``None`` in the result (``result[i]`` raises). A linear scan of structured operators
                (:attr:`operator_chain`) then holds only those, freeing each other one as soon as the
                next operator has read it; the compiled CPU linear scan does not write the others.
            collect: :class:`Collect` requests: rows of some gradients stacked into the caller's
                buffers (written as they are produced where the backend can, else copied after the
                run). Not for a linear scan of structured operators.
            graph: on a CUDA device with a graph-capturable backend, capture the program's kernel
                launches in a CUDA graph the first time a batch size and dtype is seen (after an eager
                run that gives this call's result) and replay it on later calls: the loads of the
                values, ``grad`` and ``extra`` stay eager copies into the plan's own buffers, so new
                values go through the same graph. Removes the per-launch host cost (tens of launches
                per backward). Ignored where it does not apply (CPU, structured operators).
            stop: a linear scan of structured operators (:attr:`operator_chain`) applies the operators
                of elements ``n-1 .. stop`` only, so ``dl/dx_i`` for ``i < stop`` are ``None`` (a caller
                that needs nothing below, e.g. frozen bottom layers and an input without gradient,
                does no work there, as autograd). Ignored by other programs.
        """
        periodic = values if isinstance(values, PeriodicValues) else None
        if self.period and (periodic is None or len(periodic.elements) != self.period):
            got = f"{len(periodic.elements)} elements" if periodic is not None else type(values).__name__
            raise ValueError(f"values: this binding is periodic (period={self.period}): expected a PeriodicValues of "
                             f"{self.period} elements, got {got}")
        if check:
            # the compact forms are validated as the lists they stand for
            if periodic is not None:
                values = list(values)
            if isinstance(extra, StackedExtra):
                extra = list(extra)
            items, stacked, shared, has_extra, batch, dtype, device, operators = check_inputs(
                self.n, self._nnz, self._dims, self.dtype, None, values, grad, extra, check_finite,
                needs_grad=self.kind == "scan")
            if device != self.device:
                raise ValueError(f"{'grad' if grad is not None else 'values'}: on {device}, the bound plan is for "
                                 f"{self.device} (bind it for that device)")
            if shared != self.shared or has_extra != self.has_extra or operators != self.operators:
                raise ValueError("values/extra: their sharedness or extra terms differ from the signature this plan "
                                 "was bound for (use spscan.backward, which binds per signature)")
            if periodic is not None:  # the periodic form (one copy of each shared element) of the checked list
                items = periodic.decoded()
        else:
            stacked = isinstance(values, torch.Tensor)
            items = [values] if stacked else values
            if grad is not None:
                batch, dtype = grad.shape[0], grad.dtype
            else:
                lead = items[0]
                dtype = lead.dtype
                per = next((v for v in items if isinstance(v, torch.Tensor) and v.dim() == (3 if stacked else 2)), None)
                batch = int(per.shape[1 if stacked else 0]) if per is not None else next(
                    (int(e.shape[0]) for e in (extra or ()) if e is not None), 1)
        if self.max_memory is not None and batch * self._peak_per_sample > self.max_memory:
            raise ValueError(f"max_memory={fmt_bytes(self.max_memory)}: backward at batch {batch} needs "
                             f"~{fmt_bytes(batch * self._peak_per_sample)}; use a smaller batch or re-plan")
        if self._operator_chain is not None and not stacked:
            if collect:
                raise ValueError("collect: not available for a linear scan of structured operators (use keep)")
            with torch.no_grad():
                return _ListResult(self._run_operator_chain(items, grad, keep, stop))
        if keep is not None and len(keep) != self.n + 1:
            raise ValueError(f"keep: expected {self.n + 1} flags, got {len(keep)}")
        taps = [self._tap(c, batch, dtype) for c in collect]
        skip = None
        if keep is not None:
            keep = np.asarray(keep, dtype=bool)
            key = ("skip", keep.tobytes())  # a caller passes the same flags step after step
            skip = self._index_cache.get(key)
            if skip is None:
                offs = self._index_cache.get("output_offsets")
                if offs is None:
                    offs = self._index_cache["output_offsets"] = np.fromiter(
                        (off for off, _ in self.program.outputs), dtype=np.int64, count=self.n + 1)
                if sum(1 for k in self._index_cache if k[0] == "skip") > 8:  # bounded
                    for k in [k for k in self._index_cache if k[0] == "skip"]:
                        del self._index_cache[k]
                skip = self._index_cache[key] = offs[~keep & (offs >= 0)]
                skip.flags.writeable = False
        with torch.no_grad():
            vectors, tapped = self._execute(items, stacked, batch, dtype, grad, extra, scratch,
                                            graph and self._graphable, taps, skip)
        composite = None
        root = self.program.root_mat
        if root is not None:
            arena, off, nnz = root
            s_arena, p_arena = self._arenas
            src = s_arena[off : off + nnz] if arena == "S" else p_arena[:, off : off + nnz]
            composite = src.clone() if not scratch else src
        if collect and not tapped:  # the backend wrote every gradient to the vectors: copy the rows asked for
            every = ScanResult(vectors, self.program, None, self._index_cache)
            with torch.no_grad():
                for c in collect:
                    rows = every.stacked(c.index)[..., c.rows].permute(2, 0, 1)
                    if c.operand is None:
                        c.out.copy_(rows)
                    else:
                        torch.mm(rows.reshape(rows.shape[0], -1), c.operand.reshape(c.operand.shape[0], -1).t(),
                                 out=c.out)
        return ScanResult(vectors, self.program, composite, self._index_cache, kept=keep)

    def _tap(self, c: Collect, batch: int, dtype: torch.dtype) -> Tap:
        """A :class:`Collect` as the backend's :class:`~spscan.kernels.backend.Tap` (arena columns), checked;
        the columns of an ``index`` are worked out once per bound plan."""
        if not isinstance(c, Collect):
            raise TypeError(f"collect: expected spscan.engine.Collect entries, got {type(c).__name__}")
        key = ("collect", c.index.start, c.index.stop, c.index.step)
        hit = self._index_cache.get(key)
        if hit is None:
            outs = self.program.outputs
            if len(c.index) == 0 or min(c.index) < 0 or max(c.index) > self.n:
                raise ValueError(f"collect: index {c.index} must be non-empty within 0..{self.n}")
            dims = {outs[i][1] for i in c.index}
            cols = np.fromiter((outs[i][0] for i in c.index), dtype=np.int64, count=len(c.index))
            if len(dims) != 1 or cols.min() < 0:
                raise ValueError(f"collect: the gradients at {c.index} must be computed and of one size, got sizes "
                                 f"{sorted(dims)}")
            hit = self._index_cache[key] = (cols, dims.pop())
        cols, d = hit
        r0, r1, step = c.rows.indices(d)
        out, operand = c.out, c.operand
        if step != 1 or r1 <= r0:
            raise ValueError(f"collect: rows must be a non-empty slice of range({d}) with step 1, got {c.rows}")

        def fits(t, shape) -> bool:
            return (isinstance(t, torch.Tensor) and (shape is None or t.shape == shape) and t.dtype == dtype
                    and t.device == self.device and t.is_contiguous())

        def got(t) -> str:
            return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__

        if operand is not None and not (fits(operand, None) and operand.dim() == 3 and operand.shape[0] > 0
                                        and operand.shape[1:] == (len(c.index), batch)):
            raise ValueError(f"collect: operand must be a contiguous (C > 0, {len(c.index)}, {batch}) {dtype} tensor "
                             f"on {self.device}, got {got(operand)}")
        want = (r1 - r0, len(c.index), batch) if operand is None else (r1 - r0, operand.shape[0])
        if not fits(out, want):
            raise ValueError(f"collect: out must be a contiguous {want} {dtype} tensor on {self.device}, got "
                             f"{got(out)}")
        return Tap(cols, r0, r1 - r0, out, operand)

    def _execute(self, items, stacked: bool, batch: int, dtype: torch.dtype, grad: Optional[torch.Tensor],
                 extra, scratch: bool, graph: bool = False, taps: Sequence[Tap] = (),
                 skip: Optional[np.ndarray] = None) -> tuple[torch.Tensor, bool]:
        """Load the arenas from the caller's tensors (copies), run the program; returns the vector arena and
        whether the backend wrote ``taps`` itself (see :meth:`~spscan.kernels.backend.Backend.run`)."""
        prog, n, device = self.program, self.n, self.device
        s_arena, p_arena = self._get_arenas(batch, dtype)
        if scratch or graph:  # a captured graph writes to the same vector buffer every replay
            vectors = self._scratch_buffer("vectors", batch * prog.size_v, dtype).view(batch, prog.size_v)
        else:
            vectors = torch.empty(batch, prog.size_v, dtype=dtype, device=device)
        # narrow + zero_: a device fill (assigning a Python scalar through indexing copies a host
        # scalar, which CUDA-graph capture refuses)
        s_arena.narrow(0, prog.zero_s, 1).zero_()
        p_arena.narrow(1, prog.zero_p, 1).zero_()
        vectors.narrow(1, prog.zero_v, 1).zero_()
        in_place = (isinstance(items, ValuesBuffer) and items.bound is self
                    and items.arenas[0] is s_arena and items.arenas[1] is p_arena)
        nnz0 = self._nnz[0]
        if stacked and not in_place:
            v = items[0]
            own = s_arena[: n * nnz0].view(n, nnz0) if v.dim() == 2 else \
                p_arena[:, : n * nnz0].view(batch, n, nnz0).transpose(0, 1)
            in_place = v.data_ptr() == own.data_ptr() and v.stride() == own.stride() and v.shape == own.shape
        if in_place or not self.tables.reads_arena_inputs:
            pass  # values already sit in the input arena, or no launch reads them from there
        elif stacked:
            v = items[0]
            if v.dim() == 2:
                s_arena[: n * nnz0] = v.reshape(-1)
            else:
                p_arena[:, : n * nnz0].view(batch, n, nnz0).copy_(v.transpose(0, 1))
        elif self._any_operators:
            # operator layers: CSR values only where a planned product reads them
            offs = prog.input_offsets
            vals = [(v.values() if op else v) for v, op, off in zip(items, self.operators, offs) if off >= 0]
            shs = [s for s, off in zip(prog.shared, offs) if off >= 0]
            sh = [v.reshape(-1) for v, s in zip(vals, shs) if s]
            ps = [v for v, s in zip(vals, shs) if not s]
            if sh:
                s_arena[: sum(t.shape[0] for t in sh)] = torch.cat(sh)
            if ps:
                p_arena[:, : sum(t.shape[1] for t in ps)] = torch.cat(ps, dim=1)
        elif isinstance(items, PeriodicValues):
            _load_periodic(items, s_arena, p_arena, batch, once=self.period > 0)
        else:
            sh = [v.reshape(-1) for v, s in zip(items, prog.shared) if s]
            ps = [v for v, s in zip(items, prog.shared) if not s]
            if sh:
                s_arena[: sum(t.shape[0] for t in sh)] = torch.cat(sh)
            if ps:
                p_arena[:, : sum(t.shape[1] for t in ps)] = torch.cat(ps, dim=1)
        if grad is not None:
            g = vectors[:, prog.grad_slot : prog.grad_slot + grad.shape[1]]
            g.copy_(grad)
            if extra is not None and extra[n] is not None:
                g.add_(extra[n])
        feeds: list[Feed] = []
        if self._extra_cols is not None:
            if isinstance(extra, StackedExtra) and extra.index == self._extra_range and self._extra_block is not None:
                # term k goes to columns first + k*gap ... + d: handed to the backend, which reads the
                # stack where it lies or loads it with one strided copy (load_feeds)
                first, gap, d = self._extra_block
                if extra.size != d:
                    raise ValueError(f"extra: terms of size {extra.size}, the gradients there have {d}")
                cols = first + gap * np.arange(extra.terms.shape[0], dtype=np.int64)
                feeds.append(Feed(cols, d, extra.row0, extra.terms))
                if graph:  # a captured graph reads the slots: load them now, eagerly
                    load_feeds(vectors, feeds)
                    feeds = []
            elif (isinstance(extra, StackedExtra) and extra.index == self._extra_range
                  and extra.size == extra.terms.shape[2]):
                # (K, B, d) -> (B, K*d): the same columns, in the same order, as the concatenation below
                vectors[:, self._extra_cols] = extra.terms.transpose(0, 1).reshape(batch, -1)
            else:
                vectors[:, self._extra_cols] = torch.cat([extra[i] for i in prog.extra_slots], dim=1)
        layer = items[0].__getitem__ if stacked else items.__getitem__
        arenas = {"S": s_arena, "P": p_arena}
        if self.tables.run_scratch:
            arenas["C"] = self._scratch_buffer("run", batch * self.tables.run_scratch, dtype)
        if graph:
            self._run_graphed(arenas, vectors, batch, dtype)
            return (vectors if scratch else vectors.clone()), False
        tapped = self.backend.run(self.tables, arenas, vectors, layer, taps, skip, feeds)
        return vectors, bool(tapped)

    def _run_graphed(self, arenas: dict[str, torch.Tensor], vectors: torch.Tensor, batch: int,
                     dtype: torch.dtype) -> None:
        """The program's launches through a CUDA graph kept per buffer set (see ``run(graph=True)``)."""
        if torch.cuda.is_current_stream_capturing():  # inside the caller's capture: record the launches there
            self.backend.run(self.tables, arenas, vectors, None)
            return
        key = (batch, dtype, self.backend.launch_settings(), vectors.data_ptr(),
               *(t.data_ptr() for _, t in sorted(arenas.items())))
        g = self._graphs.get(key)
        if g is not None:
            g.replay()
            return
        # eager first: compiles the kernels and gives this call's result; the capture below only
        # records launches (nothing runs), so the buffers keep that result
        self.backend.run(self.tables, arenas, vectors, None)
        torch.cuda.current_stream(self.device).synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self.backend.run(self.tables, arenas, vectors, None)
        if len(self._graphs) >= _MAX_GRAPHS:  # buffers of old batch sizes are gone: drop their graphs
            self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = g
