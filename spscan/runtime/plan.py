"""The :class:`Plan`: everything a scan needs that does not depend on values, made once.

Like a sparse library's SpGEMM "reuse" handle, the plan owns the symbolic results (patterns,
pair lists per product, the scan schedule and its depth). It is immutable; :meth:`Plan.bind`
makes the run-time half (:class:`spscan.runtime.BoundPlan`: lowered work tables on a device, for
one value signature), cached per signature, and each training step only runs that with new
values. :func:`build_plan` and :func:`build_composite` are the planning entry points every
front end uses.
"""

from __future__ import annotations

from functools import cached_property

import math
from dataclasses import replace
from typing import Any, Optional, Sequence, Union

import scipy.sparse as sp
import torch

from spscan.runtime import BoundPlan, ValuesBuffer, canonical_device, fmt_bytes
from spscan.kernels.registry import backend_names, default_backend, get_backend
from spscan.planner.choose import Decision
from spscan.planner.cost import DeviceProfile
from spscan.runtime.choices import step_profile
from spscan.planner.memory import MemoryEstimate, estimate_memory
from spscan.planner.patterns import Pattern, as_chain
from spscan.planner.lowering import LoweringCache
from spscan.planner.planning import ScanPlan, composite_pattern, depth_decision, plan_reduction, plan_scan, step_costs
from spscan.planner.schedule import max_levels

__all__ = ["Plan", "build_plan", "build_composite", "resolve_device", "check_plan_options"]


class Plan:
    """A planned scan over ``n`` transposed Jacobians (see :func:`spscan.plan`).

    Attributes:
        patterns: canonical pattern of each ``J_i^T`` as a SciPy CSR array, in layer order.
        levels: the up-sweep depth ``K`` in use (0 = linear scan, ``max_levels`` = pure Blelloch).
        backend: ``"torch"`` or ``"triton"``.
        device, dtype: what the plan was made for (``None``: taken from each call's tensors).
        max_memory: the byte limit given at planning time, checked again per call.
    """

    def __init__(self, scan: ScanPlan, backend: str, device: Optional[torch.device],
                 dtype: Optional[torch.dtype], max_memory: Optional[int], requested_levels) -> None:
        self._scan = scan
        self._backend = backend
        self._device = device
        self._dtype = dtype
        self._max_memory = max_memory
        self._requested_levels = requested_levels
        self._patterns_cache: Optional[list] = None
        self._bound: dict[tuple, BoundPlan] = {}  # run-time halves, one per (signature, device)
        self._last_binding: Optional[tuple] = None  # (shared, has_extra, operators, rest of the key, binding)
        # work tables and their device copies shared by the bindings (each distinct table built once)
        self._lowering = LoweringCache()
        self._table_memo: dict[tuple, dict] = {}  # (backend, device) -> the backend's per-table memo

    backend = property(lambda self: self._backend, doc="``'torch'`` or ``'triton'``.")
    device = property(lambda self: self._device, doc="The device the plan is for (``None``: any).")
    dtype = property(lambda self: self._dtype, doc="The dtype the plan is for (``None``: float32 or float64).")
    max_memory = property(lambda self: self._max_memory, doc="The byte limit given at planning time.")
    requested_levels = property(lambda self: self._requested_levels, doc="``levels`` as requested.")

    # -- introspection ------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self._scan.n

    @property
    def levels(self) -> int:
        return self._scan.levels

    @property
    def batch_size(self) -> int:
        """The batch size the cost model and the memory check planned for (calls may use any)."""
        return self._scan.batch_hint

    @property
    def max_levels(self) -> int:
        return max_levels(self.n)

    @property
    def patterns(self) -> list[sp.csr_array]:
        if self._patterns_cache is None:
            self._patterns_cache = [p.to_scipy() for p in self._scan.patterns]
        return list(self._patterns_cache)

    @cached_property
    def _shape_tables(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        pats = self._scan.patterns
        return tuple(p.rows for p in pats) + (pats[-1].cols,), tuple(p.nnz for p in pats)

    @cached_property
    def _call_tables(self) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """``(dims, nnz, uniform)`` as every call checks its inputs against them: tuples made once (the
        public :attr:`dims` and :attr:`nnz` are fresh lists, O(n) each), and whether every layer has one nnz."""
        dims, nnz = self._shape_tables
        return dims, nnz, len(set(nnz)) == 1

    @property
    def dims(self) -> list[int]:
        """``d_0 .. d_n``: the size of each ``x_i``."""
        return list(self._shape_tables[0])

    @property
    def nnz(self) -> list[int]:
        """Stored entries of each ``J_i^T``, in layer order."""
        return list(self._shape_tables[1])

    @property
    def kind(self) -> str:
        """``"scan"`` (every ``dl/dx_i``) or ``"composite"`` (the product of all ``J_i^T``)."""
        return "composite" if self._scan.schedule.kind == "reduce" else "scan"

    @property
    def composite_pattern(self) -> sp.csr_array:
        """The stored pattern of the composite ``J_1^T ... J_n^T`` (composite plans only)."""
        if self.kind != "composite":
            raise ValueError("composite_pattern: this is a scan plan; make one with spscan.plan_composite")
        return composite_pattern(self._scan).to_scipy()

    @property
    def candidates(self) -> dict[int, float]:
        """Estimated critical-path seconds of each depth the cost model evaluated (``levels="auto"``)."""
        return dict(self._scan.candidates)

    @property
    def decision(self) -> Decision:
        """The depth as the planner's :class:`~spscan.planner.choose.Decision`: the depths it costed, their
        estimates, and whether ``levels`` forced it."""
        forced = None if self._requested_levels == "auto" else self.levels
        return depth_decision(self._scan.candidates, self._scan.profile, forced)

    def explain(self) -> str:
        """What the planner chose and what it compared it with (see :mod:`spscan.planner.choose`)."""
        return self.decision.explain()

    @property
    def explored_levels(self) -> int:
        """The deepest up-sweep level whose products were planned."""
        return self._scan.explored

    def memory(self) -> MemoryEstimate:
        """Bytes held by the plan and the per-sample peak of ``backward`` (see :class:`MemoryEstimate`)."""
        return estimate_memory(self._scan)

    def summary(self, batch: Optional[int] = None, verbose: bool = False) -> str:
        """The plan in a few lines: its depth, per up-sweep level, linear scan and down-sweep level the
        nodes (products ``mm``, mat-vecs ``mv``), the stored entries of the matrices they read, FLOPs,
        bytes and the estimated time; totals, the cost model's candidates and memory. ``verbose``: one
        row per scan step. ``batch``: the batch the FLOPs and bytes are for (default: the batch
        planned for)."""
        scan = self._scan
        batch = scan.batch_hint if batch is None else batch
        costs = step_costs(scan)
        rows: list[tuple[str, list]] = []
        for c in costs:
            if verbose:
                rows.append((f"{c.phase}{c.level}", [c]))
                continue
            name = "linear scan" if c.phase == "mid" else f"{c.phase} {c.level}"
            if rows and rows[-1][0] == name:
                rows[-1][1].append(c)
            else:
                rows.append((name, [c]))
        lines = [
            f"spscan plan: n={self.n} Jacobians, levels K={self.levels} (max {self.max_levels}), "
            f"backend={self.backend}, device={self.device or 'any'}, dtype={self.dtype or 'any'}, "
            f"planned for batch {scan.batch_hint}",
            f"{'step':<16}{'steps':>6}{'mm':>7}{'mv':>7}{'nnz read':>14}{'FLOPs':>16}{'bytes':>12}{'est. time':>12}",
        ]

        def row(name: str, cs: list) -> str:
            return (f"{name:<16}{len(cs):>6}{sum(c.nodes_mm for c in cs):>7}{sum(c.nodes_mv for c in cs):>7}"
                    f"{sum(c.nnz_read for c in cs):>14,}{batch * sum(c.flops for c in cs):>16,}"
                    f"{fmt_bytes(batch * sum(c.bytes for c in cs)):>12}{sum(c.time_s for c in cs) * 1e3:>10.3f}ms")

        lines += [row(name, cs) for name, cs in rows]
        lines.append(row("total", costs))
        # the critical path runs one node per step: the costliest one
        crit = sum(batch * c.flops // max(1, c.nodes_mm + c.nodes_mv) if c.phase != "mid" else batch * c.flops
                   for c in costs)
        lines.append(f"steps on the critical path: {len(costs)}; critical-path FLOPs ~ {crit:,} (batch {batch})")
        if scan.candidates:
            cand = ", ".join(f"K={k}: {t * 1e3:.3f}ms" for k, t in sorted(scan.candidates.items()))
            lines.append(f"cost model ({scan.profile.name}, batch {scan.batch_hint}): {cand}")
        mem = self.memory()
        lines.append(f"memory: plan holds {fmt_bytes(mem.plan_bytes)}; backward peak "
                     f"{fmt_bytes(mem.backward_peak(batch))} at batch {batch} "
                     f"({fmt_bytes(mem.backward_peak(1))} per sample)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Plan(n={self.n}, levels={self.levels}, backend={self.backend!r}, "
                f"device={self.device}, dtype={self.dtype})")

    def step_costs(self):
        """The cost model's estimate per scan step (phase, level, nodes, nnz, FLOPs, bytes, seconds)."""
        return step_costs(self._scan)

    # -- the run-time half ----------------------------------------------------------------
    def bind(self, shared: Optional[Sequence[bool]] = None, has_extra: Optional[Sequence[bool]] = None,
             device=None, operators: Optional[Sequence[bool]] = None, first_output: bool = True,
             period: int = 0) -> BoundPlan:
        """The run-time engine for one value signature on one device (made once, cached).

        Lowers the plan and uploads its index tables: every later :meth:`BoundPlan.run` is numeric
        work only. ``shared[i]``: layer ``i+1``'s values will be ``(nnz,)``; ``has_extra[i]``:
        ``extra[i]`` will be given; ``operators[i]``: layer ``i+1`` comes as a
        :class:`~spscan.kernels.backend.StructuredOperator` (applied matrix-free; its CSR values
        are asked for only where a planned product needs them); ``first_output=False``: ``dl/dx_0``
        is not wanted (the scan's last mat-vec is left out); ``period > 0``: the values will come as a
        :class:`~spscan.runtime.PeriodicValues` of ``period`` elements (a recurrent chain), so each
        shared element is held once and every period reads it there (what the device's fused
        recurrence kernels take). Defaults: all per sample, no extras, no operators, not periodic,
        ``self.device`` (else CPU).
        """
        n = self.n
        # a tuple is taken as it is (equal flags hash equal, numpy's bools included): a long chain's
        # flags are not copied on every call
        shared = (False,) * n if shared is None else shared if isinstance(shared, tuple) else tuple(map(bool, shared))
        has_extra = (False,) * (n + 1) if has_extra is None else \
            has_extra if isinstance(has_extra, tuple) else tuple(map(bool, has_extra))
        if len(shared) != n:
            raise ValueError(f"shared: expected {n} flags (one per layer), got {len(shared)}")
        if len(has_extra) != n + 1:
            raise ValueError(f"has_extra: expected {n + 1} flags (one per dl/dx_i), got {len(has_extra)}")
        ops = (False,) * n if operators is None else operators if isinstance(operators, tuple) else \
            tuple(map(bool, operators))
        if len(ops) != n:
            raise ValueError(f"operators: expected {n} flags (one per layer), got {len(ops)}")
        dev = resolve_device(device) if device is not None else (self._device or torch.device("cpu"))
        return self._binding(shared, has_extra, dev, ops, bool(first_output), int(period))

    def _binding(self, shared: tuple, has_extra: tuple, device: torch.device, operators: Optional[tuple] = None,
                 first_output: bool = True, period: int = 0) -> BoundPlan:
        operators = (False,) * self.n if operators is None else operators
        # the last signature by identity first: a long chain's flag tuples are made once per signature
        # (engine.checks.uniform_flags), so a repeated call skips hashing and comparing n flags
        last = self._last_binding
        if (last is not None and last[0] is shared and last[1] is has_extra and last[2] is operators
                and last[3] == (device, first_output, period)):
            return last[4]
        key = (shared, has_extra, device, operators, first_output, period)
        hit = self._bound.get(key)
        if hit is None:
            memo = self._table_memo.setdefault((self._backend, device), {})
            hit = BoundPlan(self._scan, shared, has_extra, device, get_backend(self._backend), self._dtype,
                            self._max_memory, operators, first_output, self._lowering, memo, period)
            self._bound[key] = hit
        self._last_binding = (shared, has_extra, operators, (device, first_output, period), hit)
        return hit

    def bindings(self) -> list[BoundPlan]:
        """Every run-time half made so far."""
        return list(self._bound.values())

    def prepare(self, shared: Optional[Sequence[bool]] = None, has_extra: Optional[Sequence[bool]] = None,
                device=None) -> "Plan":
        """:meth:`bind` ahead of the first ``backward`` (same arguments); returns the plan."""
        self.bind(shared, has_extra, device)
        return self

    def values_buffer(self, batch: int, *, dtype: torch.dtype = torch.float32, device="cpu",
                      shared: Optional[Sequence[bool]] = None) -> ValuesBuffer:
        """Views into the input arena of the binding for ``shared`` (no extras) to fill in place.

        ``backward`` then reads the values where they are instead of copying them (for long
        chains the copy is a sizeable part of a step). ``buf[i]`` is ``(B, nnz_i)`` (or
        ``(nnz_i,)`` where ``shared[i]``); ``buf.stacked`` is ``(n, B, nnz)`` / ``(n, nnz)`` when
        every layer has the same nnz and sharedness. Valid until another batch size or dtype is run
        or the buffers are released.
        """
        return self.bind(shared, None, device).values_buffer(batch, dtype)

    def release_buffers(self) -> None:
        """Free the arenas and working buffers every binding keeps between calls."""
        for b in self._bound.values():
            b.release_buffers()

    # -- persistence --------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the plan (symbolic results included) to ``path`` as a pickle-free ``.npz``."""
        from spscan.planner.serialize import save_scan

        if self.kind != "scan":
            raise ValueError("save: only scan plans are saved (a composite plan is cheap to rebuild)")
        options = {
            "backend": self.backend,
            "device": None if self.device is None else str(self.device),
            "dtype": None if self.dtype is None else str(self.dtype).replace("torch.", ""),
            "max_memory": self.max_memory,
            "requested_levels": self.requested_levels,
        }
        save_scan(path, self._scan, options)


# ----------------------------------------------------------------------------- planning entry points


def resolve_device(device) -> Optional[torch.device]:
    """``device`` as a ``torch.device`` (``None`` stays ``None``); ``ValueError`` if invalid or not available."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: not a valid torch device: {device!r}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA is not available on this machine (torch "
                             f"{torch.__version__}, built {'with' if torch.backends.cuda.is_built() else 'without'} CUDA)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: expected a CPU or CUDA device")
    return canonical_device(dev)


def backend_device(backend: str, dev: Optional[torch.device]) -> Optional[torch.device]:
    """The plan's device: ``dev``, or where ``backend`` must run when it cannot run on the CPU
    (compiled Triton kernels: the current CUDA device). ``ValueError`` if ``backend`` cannot run on it."""
    impl = get_backend(backend)
    if dev is None and "cpu" not in impl.capabilities.device_types and torch.cuda.is_available():
        dev = resolve_device(impl.capabilities.device_types[0])
    impl.check_device(dev or torch.device("cpu"))  # without CUDA: the backend says why it cannot run
    return dev


def check_plan_options(levels, backend, dtype, max_memory, batch_size) -> None:
    """Refuse bad planning options early, naming the argument and the expected value."""
    if not (levels in ("auto", "full") or (isinstance(levels, int) and not isinstance(levels, bool))):
        raise ValueError(f"levels: expected 'auto', 'full' or an int >= 0, got {levels!r}")
    if isinstance(levels, int) and levels < 0:
        raise ValueError(f"levels: expected an int >= 0, got {levels}")
    if backend != "auto" and backend not in backend_names():
        raise ValueError(f"backend: expected 'auto', {', '.join(map(repr, backend_names()))}, got {backend!r}")
    if dtype is not None and dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    if max_memory is not None:
        if isinstance(max_memory, bool) or not isinstance(max_memory, (int, float)):
            raise TypeError(f"max_memory: expected a number of bytes, got {type(max_memory).__name__}")
        if not math.isfinite(max_memory) or max_memory <= 0:
            raise ValueError(f"max_memory: expected a positive, finite number of bytes, got {max_memory!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")


def plan_profile(device=None, backend: str = "auto") -> DeviceProfile:
    """The critical-path cost model's constants and thresholds a plan for ``device`` (and ``backend``) is made
    with (:func:`build_plan`; the front ends' own choices read its thresholds too): those of the machine's
    profile (:attr:`~spscan.planner.step_profile.StepProfile.critical_path`), the one every decision reads."""
    dev = resolve_device(device)
    if backend == "auto":
        backend = default_backend(dev)
    dev = backend_device(backend, dev)
    return step_profile(dev).critical_path


def build_plan(patterns: Any, *, levels: Union[str, int] = "auto", backend: str = "auto", device=None,
               dtype: Optional[torch.dtype] = None, max_memory: Optional[float] = None, batch_size: int = 16,
               bind: Optional[tuple[Sequence[bool], Sequence[bool]]] = ((), ()),
               apply_entries: Optional[Sequence[Optional[int]]] = None) -> Plan:
    """Plan the backward scan of a chain (what :func:`spscan.plan` does for patterns).

    ``bind``: the ``(shared, has_extra)`` signature to bind now (empty tuples: the default, all per
    sample and no extras; ``None``: bind nothing yet). ``apply_entries``: per matrix, the work (entries)
    of applying it where a layer's own operator does (``None``: its CSR values), for the cost model's
    estimates (the front ends for models pass it). See :func:`spscan.plan` for the rest.
    """
    check_plan_options(levels, backend, dtype, max_memory, batch_size)
    dev = resolve_device(device)
    if backend == "auto":
        backend = default_backend(dev)
    dev = backend_device(backend, dev)
    pats = as_chain(patterns)
    elem = 8 if dtype == torch.float64 else 4
    profile = plan_profile(dev, backend)

    def peak(candidate) -> int:
        return estimate_memory(candidate).total(batch_size)

    scan = plan_scan(pats, levels, profile, batch_hint=batch_size, elem_bytes=elem,
                     memory_limit=max_memory, memory_of=peak, apply_entries=apply_entries)
    if max_memory is not None and peak(scan) > max_memory:
        raise ValueError(
            f"max_memory={fmt_bytes(max_memory)}: the plan at levels={scan.levels} needs "
            f"{fmt_bytes(peak(scan))} at batch {batch_size} "
            + ("(even the linear scan does not fit)" if levels == "auto" else "(use fewer levels or 'auto')")
        )
    plan = Plan(scan, backend, dev, dtype, None if max_memory is None else int(max_memory), levels)
    if bind is not None:
        shared, has_extra = bind
        plan.bind(shared or None, has_extra or None)
    return plan


def build_composite(patterns: Any, *, backend: str = "auto", device=None, dtype: Optional[torch.dtype] = None,
                    batch_size: int = 16, bytes_budget: Optional[float] = None) -> Plan:
    """Plan the composite ``J_1^T J_2^T ... J_n^T`` of a chain (what :func:`spscan.plan_composite` does).

    ``bytes_budget``: the most pair-index bytes one reduction level may plan (default: the device profile's).
    """
    check_plan_options(0, backend, dtype, None, batch_size)
    dev = resolve_device(device)
    if backend == "auto":
        backend = default_backend(dev)
    dev = backend_device(backend, dev)
    pats: list[Pattern] = as_chain(patterns)
    elem = 8 if dtype == torch.float64 else 4
    profile = plan_profile(dev, backend)
    if bytes_budget is not None:
        profile = replace(profile, bytes_budget=float(bytes_budget))
    scan = plan_reduction(pats, profile, batch_hint=batch_size, elem_bytes=elem)
    return Plan(scan, backend, dev, dtype, None, "composite")
