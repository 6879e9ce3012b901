"""The bound program: one plan lowered for one value signature on one device, its tables uploaded.

Three lifetimes meet here. :class:`BoundProgram` is immutable and made once per signature by
:meth:`spscan.Plan.bind` (the lowered program, the backend's device tables, the layouts derived
from them). :class:`~spscan.runtime.workspace.Workspace` holds what a run writes, per batch size
and dtype. A :class:`~spscan.runtime.request.RunRequest` is one call. :class:`BoundPlan` joins a
program to its workspace and executes requests: it loads the value arenas, launches the program
and hands back a :class:`~spscan.runtime.result.ScanResult`. Every front end runs through it; none
reads arenas or work tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from spscan.runtime.checks import canonical_device, check_inputs, fmt_bytes
from spscan.runtime.request import (Collect, ExtraBuffer, PeriodicBuffer, PeriodicValues, RunRequest, StackedExtra,
                                   ValuesBuffer)
from spscan.runtime.result import ScanResult, _ListResult
from spscan.runtime.workspace import Workspace
from spscan.kernels.backend import Backend, Feed, Tap, load_feeds
from spscan.planner.memory import estimate_memory
from spscan.planner.planning import ScanPlan
from spscan.planner.lowering import LoweringCache, lower
from spscan.planner.program import Apply

__all__ = ["BoundPlan", "BoundProgram"]


def _periodic_views(elements: Sequence[tuple[int, bool]], T: int, s_arena: torch.Tensor, p_arena: torch.Tensor,
                    batch: int, once: bool) -> list[torch.Tensor]:
    """Where a periodic chain's elements (``(nnz, shared)`` each) lie in the input arenas, laid out as the
    layer-order concatenation would lay them (shared layers back to back in ``S``, per-sample layers in ``P``):
    a shared element as a ``(reps, nnz)`` block (``reps`` 1 if ``once``, the binding holding each shared element
    once, else ``T``), a per-sample one as a ``(T, B, nnz)`` strided view."""
    views: list[Optional[torch.Tensor]] = [None] * len(elements)
    reps = 1 if once else T
    width = sum(nnz for nnz, sh in elements if sh)
    block = s_arena[: reps * width].view(reps, width)
    off = 0
    for k, (nnz, sh) in enumerate(elements):
        if sh:
            views[k] = block[:, off : off + nnz]
            off += nnz
    width = sum(nnz for nnz, sh in elements if not sh)
    block = p_arena[:, : T * width].view(batch, T, width)
    off = 0
    for k, (nnz, sh) in enumerate(elements):
        if not sh:
            views[k] = block[:, :, off : off + nnz].transpose(0, 1)
            off += nnz
    return views


def _load_periodic(values: PeriodicValues, s_arena: torch.Tensor, p_arena: torch.Tensor, batch: int,
                   once: bool = False) -> None:
    """Load a periodic chain's values into the input arenas (:func:`_periodic_views`) with one strided copy per
    element instead of a Python look-up and a concatenation over ``n`` layers."""
    elements = [values.expanded(k) for k in range(len(values.elements))]
    views = _periodic_views([(int(e.shape[-1]), e.dim() == 1) for e in elements], values.periods, s_arena, p_arena,
                            batch, once)
    for dst, e in zip(views, elements):
        dst.copy_(e.unsqueeze(0).expand(dst.shape[0], -1) if e.dim() == 1 else e)


class BoundProgram:
    """A plan lowered for one ``(shared, has_extra)`` signature on one device, its tables uploaded.

    All index work happens here, once; nothing in it changes afterwards except memos of layouts
    derived from the program (the columns of a ``stacked`` block or a ``keep`` mask).
    ``shared[i]``: layer ``i+1``'s values come as ``(nnz,)`` (shared by the batch);
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
        self._index_cache: dict = {}  # layouts derived from the program, worked out on first use
        self.backend = backend
        self.dtype = dtype
        self.max_memory = max_memory
        self.kind = scan.schedule.kind
        self.n = scan.n
        pats = scan.patterns
        self._nnz = [p.nnz for p in pats]
        self._dims = [p.rows for p in pats] + [pats[-1].cols]
        self._uniform_nnz = len(set(self._nnz)) == 1  # (a checked call need not count n layers' nnz)
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

    def tap(self, c: Collect, batch: int, dtype: torch.dtype) -> Tap:
        """A :class:`Collect` as the backend's :class:`~spscan.kernels.backend.Tap` (arena columns), checked;
        the columns of an ``index`` are worked out once per bound plan."""
        if not isinstance(c, Collect):
            raise TypeError(f"collect: expected spscan.runtime.Collect entries, got {type(c).__name__}")
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

    def skip_offsets(self, keep: np.ndarray) -> np.ndarray:
        """The vector offsets of the gradients ``keep`` leaves out (memoized: a caller passes the same flags
        step after step; at most a few masks are held)."""
        key = ("skip", keep.tobytes())
        skip = self._index_cache.get(key)
        if skip is None:
            offs = self._index_cache.get("output_offsets")
            if offs is None:
                offs = self._index_cache["output_offsets"] = np.fromiter(
                    (off for off, _ in self.program.outputs), dtype=np.int64, count=self.n + 1)
            if sum(1 for k in self._index_cache if k[0] == "skip") > 8:
                for k in [k for k in self._index_cache if k[0] == "skip"]:
                    del self._index_cache[k]
            skip = self._index_cache[key] = offs[~keep & (offs >= 0)]
            skip.flags.writeable = False
        return skip


class BoundPlan(BoundProgram):
    """A :class:`BoundProgram` with its :class:`~spscan.runtime.workspace.Workspace`: the object
    :meth:`spscan.Plan.bind` returns. :meth:`execute` (or :meth:`run`, the same from keywords) is
    the only per-step call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.workspace = Workspace(self.program, self.device)

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

    # -- the workspace ------------------------------------------------------------------
    def held_buffers(self) -> list[torch.Tensor]:
        """The buffers a run writes and reads now (arenas, working buffers): a caller that records runs in
        its own CUDA graph keeps these alive for as long as it replays it (a later batch size or dtype
        makes the plan hold new ones and let go of these)."""
        return self.workspace.held_buffers()

    def release_buffers(self) -> None:
        """Free the arenas, working buffers and CUDA graphs kept between calls (tables stay)."""
        self.workspace.release()

    def values_buffer(self, batch: int, dtype: torch.dtype = torch.float32) -> ValuesBuffer:
        """Views into the input arena to fill in place and pass as ``values`` (no copy in :meth:`run`).

        Valid until another batch size or dtype is run or the buffers are released.
        """
        s_arena, p_arena = self.workspace.arenas(batch, dtype)
        views = []
        for i, nnz in enumerate(self._nnz):
            off = self.program.input_offsets[i]
            views.append(s_arena[off : off + nnz] if self.shared[i] else p_arena[:, off : off + nnz])
        return ValuesBuffer(views, self, (s_arena, p_arena))

    def periodic_buffer(self, batch: int, dtype: torch.dtype = torch.float32) -> PeriodicBuffer:
        """A periodic binding's values as views into its input arenas (each shared element once, each per-sample one
        ``(periods, B, nnz)``, strided), to fill in place and pass as ``values``: :meth:`run` then copies nothing.

        Valid until another batch size or dtype is run or the buffers are released; a run may leave the arenas
        changed, so fill every element before each run.
        """
        if not self.period:
            raise ValueError("periodic_buffer: this binding is not periodic (bind it with period=...)")
        s_arena, p_arena = self.workspace.arenas(batch, dtype)
        elements = [(self._nnz[k], self.shared[k]) for k in range(self.period)]
        views = _periodic_views(elements, self.n // self.period, s_arena, p_arena, batch, once=True)
        return PeriodicBuffer([v[0] if sh else v for v, (_, sh) in zip(views, elements)], self.n // self.period,
                              self, (s_arena, p_arena))

    def extra_buffer(self, batch: int, dtype: torch.dtype = torch.float32) -> ExtraBuffer:
        """The affine terms' slots in the working vectors as one ``(K, B, d)`` strided view, to fill in place and
        pass as ``extra`` to a run with ``scratch=True`` or ``graph=True`` (which keep the working vectors): the
        run then copies nothing in. Only for a binding whose terms lie at evenly spaced positions, in evenly
        spaced columns of one size (a loss on every step of a recurrence: ``ValueError`` otherwise).

        Valid until another batch size or dtype is run or the buffers are released; a run overwrites the slots,
        so fill them before each run.
        """
        if self._extra_block is None:
            raise ValueError("extra_buffer: this binding's affine terms do not lie in evenly spaced slots of one size")
        first, gap, d = self._extra_block
        size_v = self.program.size_v
        vectors = self.workspace.buffer("vectors", batch * size_v, dtype).view(batch, size_v)
        terms = vectors.as_strided((len(self._extra_range), batch, d), (gap, size_v, 1), vectors.storage_offset() + first)
        return ExtraBuffer(terms, self._extra_range, self.n + 1, self, vectors)

    # -- the run --------------------------------------------------------------------------
    def run(self, values: Any, grad: Optional[torch.Tensor] = None,
            extra: Optional[Sequence[Optional[torch.Tensor]]] = None, **options) -> ScanResult:
        """Run the bound program on one step's values: :meth:`execute` of a
        :class:`~spscan.runtime.request.RunRequest` made from these arguments (its fields are the
        keyword options: ``keep``, ``collect``, ``scratch``, ``stop``, ``check``, ``check_finite``,
        ``graph``)."""
        try:
            request = RunRequest(values, grad, extra, **options)
        except TypeError as e:
            names = ", ".join(f for f in RunRequest.__dataclass_fields__ if f not in ("values", "grad", "extra"))
            raise TypeError(f"BoundPlan.run: {e}; the options are {names}") from None
        return self.execute(request)

    def _check(self, req: RunRequest):
        """``(items, stacked, batch, dtype)`` of a request, validated against the signature where it asks."""
        values, grad, extra = req.values, req.grad, req.extra
        periodic = values if isinstance(values, PeriodicValues) else None
        if self.period and (periodic is None or len(periodic.elements) != self.period):
            got = f"{len(periodic.elements)} elements" if periodic is not None else type(values).__name__
            raise ValueError(f"values: this binding is periodic (period={self.period}): expected a PeriodicValues of "
                             f"{self.period} elements, got {got}")
        if not req.check:
            stacked = isinstance(values, torch.Tensor)
            items = [values] if stacked else values
            if grad is not None:
                return items, stacked, grad.shape[0], grad.dtype
            per = next((v for v in items if isinstance(v, torch.Tensor) and v.dim() == (3 if stacked else 2)), None)
            batch = int(per.shape[1 if stacked else 0]) if per is not None else next(
                (int(e.shape[0]) for e in (extra or ()) if e is not None), 1)
            return items, stacked, batch, items[0].dtype
        # the compact forms are validated as the lists they stand for
        if periodic is not None:
            values = list(values)
        if isinstance(extra, StackedExtra):
            extra = list(extra)
        items, stacked, shared, has_extra, batch, dtype, device, operators = check_inputs(
            self.n, self._nnz, self._dims, self.dtype, None, values, grad, extra, req.check_finite,
            needs_grad=self.kind == "scan", uniform_nnz=self._uniform_nnz)
        if device != self.device:
            raise ValueError(f"{'grad' if grad is not None else 'values'}: on {device}, the bound plan is for "
                             f"{self.device} (bind it for that device)")
        if shared != self.shared or has_extra != self.has_extra or operators != self.operators:
            raise ValueError("values/extra: their sharedness or extra terms differ from the signature this plan "
                             "was bound for (use spscan.backward, which binds per signature)")
        if periodic is not None:  # the periodic form (one copy of each shared element) of the checked list
            items = periodic.decoded()
        return items, stacked, batch, dtype

    def check_memory(self, batch: int) -> None:
        """Refuse a backward at ``batch`` whose peak would exceed the plan's ``max_memory``."""
        if self.max_memory is not None and batch * self._peak_per_sample > self.max_memory:
            raise ValueError(f"max_memory={fmt_bytes(self.max_memory)}: backward at batch {batch} needs "
                             f"~{fmt_bytes(batch * self._peak_per_sample)}; use a smaller batch or re-plan")

    def execute(self, req: RunRequest) -> ScanResult:
        """Run the bound program for one :class:`~spscan.runtime.request.RunRequest`."""
        items, stacked, batch, dtype = self._check(req)
        grad, keep, collect = req.grad, req.keep, req.collect
        self.check_memory(batch)
        if self._operator_chain is not None and not stacked:
            if collect:
                raise ValueError("collect: not available for a linear scan of structured operators (use keep)")
            with torch.no_grad():
                return _ListResult(self._run_operator_chain(items, grad, keep, req.stop))
        if keep is not None and len(keep) != self.n + 1:
            raise ValueError(f"keep: expected {self.n + 1} flags, got {len(keep)}")
        taps = [self.tap(c, batch, dtype) for c in collect]
        skip = None
        if keep is not None:
            keep = np.asarray(keep, dtype=bool)
            skip = self.skip_offsets(keep)
        with torch.no_grad():
            vectors, tapped = self._execute(items, stacked, batch, dtype, grad, req.extra, req.scratch,
                                            req.graph and self._graphable, taps, skip)
        composite = None
        root = self.program.root_mat
        if root is not None:
            arena, off, nnz = root
            s_arena, p_arena = self.workspace.current_arenas
            src = s_arena[off : off + nnz] if arena == "S" else p_arena[:, off : off + nnz]
            composite = src.clone() if not req.scratch else src
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

    def _execute(self, items, stacked: bool, batch: int, dtype: torch.dtype, grad: Optional[torch.Tensor],
                 extra, scratch: bool, graph: bool = False, taps: Sequence[Tap] = (),
                 skip: Optional[np.ndarray] = None) -> tuple[torch.Tensor, bool]:
        """Load the arenas from the caller's tensors (copies), run the program; returns the vector arena and
        whether the backend wrote ``taps`` itself (see :meth:`~spscan.kernels.backend.Backend.run`)."""
        prog, n, device = self.program, self.n, self.device
        s_arena, p_arena = self.workspace.arenas(batch, dtype)
        if scratch or graph:  # a captured graph writes to the same vector buffer every replay
            vectors = self.workspace.buffer("vectors", batch * prog.size_v, dtype).view(batch, prog.size_v)
        else:
            vectors = torch.empty(batch, prog.size_v, dtype=dtype, device=device)
        # narrow + zero_: a device fill (assigning a Python scalar through indexing copies a host
        # scalar, which CUDA-graph capture refuses)
        s_arena.narrow(0, prog.zero_s, 1).zero_()
        p_arena.narrow(1, prog.zero_p, 1).zero_()
        vectors.narrow(1, prog.zero_v, 1).zero_()
        in_place = (isinstance(items, (ValuesBuffer, PeriodicBuffer)) and items.bound is self
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
                if not (isinstance(extra, ExtraBuffer) and extra.bound is self and extra.vectors.data_ptr()
                        == vectors.data_ptr() and extra.vectors.shape == vectors.shape):
                    cols = first + gap * np.arange(extra.terms.shape[0], dtype=np.int64)
                    feeds.append(Feed(cols, d, extra.row0, extra.terms))
                    if graph:  # a captured graph reads the slots: load them now, eagerly
                        load_feeds(vectors, feeds)
                        feeds = []
                # else: the terms were written into their slots of these vectors (extra_buffer)
            elif (isinstance(extra, StackedExtra) and extra.index == self._extra_range
                  and extra.size == extra.terms.shape[2]):
                # (K, B, d) -> (B, K*d): the same columns, in the same order, as the concatenation below
                vectors[:, self._extra_cols] = extra.terms.transpose(0, 1).reshape(batch, -1)
            else:
                vectors[:, self._extra_cols] = torch.cat([extra[i] for i in prog.extra_slots], dim=1)
        layer = items[0].__getitem__ if stacked else items.__getitem__
        arenas = {"S": s_arena, "P": p_arena}
        if self.tables.run_scratch:
            arenas["C"] = self.workspace.buffer("run", batch * self.tables.run_scratch, dtype)
        if graph:
            self._run_graphed(arenas, vectors, batch, dtype)
            return (vectors if scratch else vectors.clone()), False
        tapped = self.backend.run(self.tables, arenas, vectors, layer, taps, skip, feeds)
        return vectors, bool(tapped)

    def _run_graphed(self, arenas: dict[str, torch.Tensor], vectors: torch.Tensor, batch: int,
                     dtype: torch.dtype) -> None:
        """The program's launches through the workspace's CUDA graph for this buffer set."""
        key = (batch, dtype, self.backend.launch_settings(), vectors.data_ptr(),
               *(t.data_ptr() for _, t in sorted(arenas.items())))
        self.workspace.replay(key, lambda: self.backend.run(self.tables, arenas, vectors, None))
