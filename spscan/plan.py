"""The :class:`Plan`: everything a scan needs that does not depend on values, made once.

Like a sparse library's SpGEMM "reuse" handle, the plan owns the symbolic results (patterns,
pair lists per product, the scan schedule and its depth) and the lowered work tables; each
training step only calls :func:`spscan.backward` with new values.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from spscan.planner.memory import MemoryEstimate, estimate_memory
from spscan.planner.planning import ScanPlan, step_costs
from spscan.planner.program import Program, lower
from spscan.planner.schedule import max_levels

__all__ = ["Plan", "ValuesBuffer"]


class ValuesBuffer(list):
    """A list of value tensors that live in a plan's input arena (see :meth:`Plan.values_buffer`)."""

    def __init__(self, views, plan: "Plan", shared: tuple, arenas: tuple) -> None:
        super().__init__(views)
        self.plan = plan
        self.shared = shared
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


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return str(b)


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
        self.backend = backend
        self.device = device
        self.dtype = dtype
        self.max_memory = max_memory
        self.requested_levels = requested_levels
        self._programs: dict[tuple, Program] = {}
        self._tables: dict[tuple, object] = {}
        self._patterns_cache: Optional[list] = None
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._scratch_bufs: dict[tuple, torch.Tensor] = {}
        self._extra_cols: dict[tuple, torch.Tensor] = {}  # (program, device) -> vector columns of the extras
        self._nnz = [p.nnz for p in scan.patterns]

    # -- introspection ------------------------------------------------------------------
    @property
    def n(self) -> int:
        return self._scan.n

    @property
    def levels(self) -> int:
        return self._scan.levels

    @property
    def max_levels(self) -> int:
        return max_levels(self.n)

    @property
    def patterns(self) -> list[sp.csr_array]:
        if self._patterns_cache is None:
            self._patterns_cache = [p.to_scipy() for p in self._scan.patterns]
        return list(self._patterns_cache)

    @property
    def dims(self) -> list[int]:
        """``d_0 .. d_n``: the size of each ``x_i``."""
        pats = self._scan.patterns
        return [p.rows for p in pats] + [pats[-1].cols]

    def memory(self) -> MemoryEstimate:
        """Bytes held by the plan and the per-sample peak of ``backward`` (see :class:`MemoryEstimate`)."""
        return estimate_memory(self._scan)

    def summary(self, batch: Optional[int] = None) -> str:
        """A table per scan step: nodes (mm/mv), nnz produced, FLOPs, bytes; totals; critical path; memory."""
        scan = self._scan
        batch = scan.batch_hint if batch is None else batch
        costs = step_costs(scan)
        lines = [
            f"spscan plan: n={self.n} Jacobians, levels K={self.levels} (max {self.max_levels}), "
            f"backend={self.backend}, device={self.device or 'any'}, dtype={self.dtype or 'any'}",
            f"{'step':<10}{'mm':>7}{'mv':>7}{'nnz':>14}{'FLOPs':>16}{'bytes':>14}{'est. time':>12}",
        ]
        tot_flops = tot_bytes = tot_nnz = 0
        crit_flops = 0
        for c in costs:
            name = f"{c.phase}{c.level}" if c.phase != "mid" else f"mid{c.level}"
            flops = c.flops * batch
            by = c.bytes * batch
            lines.append(f"{name:<10}{c.nodes_mm:>7}{c.nodes_mv:>7}{c.nnz:>14,}{flops:>16,}{_fmt_bytes(by):>14}"
                         f"{c.time_s * 1e3:>10.3f}ms")
            tot_flops += flops
            tot_bytes += by
            tot_nnz += c.nnz
            # the critical path runs one node per step: the costliest one
            crit_flops += flops // max(1, c.nodes_mm + c.nodes_mv) if c.phase != "mid" else flops
        lines.append(f"{'total':<10}{sum(c.nodes_mm for c in costs):>7}{sum(c.nodes_mv for c in costs):>7}"
                     f"{tot_nnz:>14,}{tot_flops:>16,}{_fmt_bytes(tot_bytes):>14}"
                     f"{sum(c.time_s for c in costs) * 1e3:>10.3f}ms")
        lines.append(f"steps on the critical path: {len(costs)}; critical-path FLOPs ~ {crit_flops:,} "
                     f"(batch {batch})")
        if scan.candidates:
            cand = ", ".join(f"K={k}: {t * 1e3:.3f}ms" for k, t in sorted(scan.candidates.items()))
            lines.append(f"cost model ({scan.profile.name}, batch {scan.batch_hint}): {cand}")
        mem = self.memory()
        lines.append(f"memory: plan holds {_fmt_bytes(mem.plan_bytes)}; backward peak "
                     f"{_fmt_bytes(mem.backward_peak(batch))} at batch {batch} "
                     f"({_fmt_bytes(mem.backward_peak(1))} per sample)")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Plan(n={self.n}, levels={self.levels}, backend={self.backend!r}, "
                f"device={self.device}, dtype={self.dtype})")

    # -- lowering -----------------------------------------------------------------------
    def program(self, shared: Sequence[bool], has_extra: Sequence[bool]) -> Program:
        """The lowered work tables for one sharedness / extra signature (made once, cached)."""
        if type(shared) is tuple and type(has_extra) is tuple:  # noqa: E721 - the common call: no per-layer work
            prog = self._programs.get((shared, has_extra))
            if prog is not None:
                return prog
        key = (tuple(bool(s) for s in shared), tuple(bool(e) for e in has_extra))
        prog = self._programs.get(key)
        if prog is None:
            prog = lower(self._scan, key[0], key[1])
            self._programs[key] = prog
        return prog

    def prepare(self, shared: Optional[Sequence[bool]] = None, has_extra: Optional[Sequence[bool]] = None,
                device=None) -> "Plan":
        """Lower (and copy to ``device``) ahead of the first ``backward`` so no step pays for it.

        ``shared[i]``: whether layer ``i+1``'s values will be passed as ``(nnz,)``;
        ``has_extra[i]``: whether ``extra[i]`` will be passed. Defaults: all per sample, no extras.
        """
        shared = [False] * self.n if shared is None else list(shared)
        has_extra = [False] * (self.n + 1) if has_extra is None else list(has_extra)
        prog = self.program(shared, has_extra)
        dev = torch.device(device) if device is not None else (self.device or torch.device("cpu"))
        self._runner(prog, dev)
        return self

    def _runner(self, program: Program, device: torch.device):
        key = (id(program), str(device), self.backend)
        hit = self._tables.get(key)
        if hit is None:
            if self.backend == "triton":
                from spscan.kernels import triton_backend as backend
            else:
                from spscan.kernels import torch_ops as backend
            hit = (backend.run_program, backend.make_tables(program, device))
            self._tables[key] = hit
        return hit

    def _extra_columns(self, program: Program, device: torch.device):
        """Vector-arena columns of every ``extra[i]`` (in ``program.extra_slots`` order), made once.

        One ``index_put`` of the concatenated extras replaces a copy per layer (a long chain with a
        loss on every step would otherwise pay microseconds of Python per layer).
        """
        key = (id(program), str(device))
        hit = self._extra_cols.get(key)
        if hit is None:
            dims = self.dims
            cols = np.concatenate([np.arange(off, off + dims[i]) for i, off in program.extra_slots.items()])
            hit = torch.as_tensor(cols, dtype=torch.int64, device=device)
            self._extra_cols[key] = hit
        return hit

    def _arenas(self, program: Program, batch: int, dtype: torch.dtype, device: torch.device):
        """Matrix arenas ``(S, P)`` for one call, reused while the shape repeats.

        Their layout depends only on which inputs are shared (never on ``extra``), so a
        :meth:`values_buffer` filled before the call is read in place.
        """
        key = (program.shared, batch, dtype, str(device))
        hit = self._buffers.get(key)
        if hit is None:
            self._buffers.clear()  # hold at most one set: memory stays at one backward's peak
            hit = (torch.empty(program.size_s, dtype=dtype, device=device),
                   torch.empty(batch, program.size_p, dtype=dtype, device=device))
            self._buffers[key] = hit
        return hit

    def _scratch(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat working buffer of at least ``numel`` entries kept between calls (no first-touch cost
        per call: fresh multi-MB CPU allocations page-fault on every call). Its contents never
        survive a call; :meth:`release_buffers` frees it."""
        key = (name, dtype, str(device))
        hit = self._scratch_bufs.get(key)
        if hit is None or hit.numel() < numel:
            self._scratch_bufs.pop(key, None)
            hit = torch.empty(numel, dtype=dtype, device=device)
            self._scratch_bufs[key] = hit
        return hit[:numel]

    def values_buffer(self, batch: int, *, dtype: torch.dtype = torch.float32, device="cpu",
                      shared: Optional[Sequence[bool]] = None) -> "ValuesBuffer":
        """Views into the plan's own input arena, to fill in place and pass as ``values``.

        ``backward`` then reads the values where they are instead of copying them (for long
        chains the copy is a sizeable part of a step). ``buf[i]`` is ``(B, nnz_i)`` (or
        ``(nnz_i,)`` where ``shared[i]``); ``buf.stacked`` is ``(n, B, nnz)`` / ``(n, nnz)`` when
        every layer has the same nnz and sharedness. The buffer stays valid until the plan's
        buffers are released or another batch size / dtype / device / sharedness is used.
        """
        shared = [False] * self.n if shared is None else [bool(s) for s in shared]
        if len(shared) != self.n:
            raise ValueError(f"shared: expected {self.n} flags, got {len(shared)}")
        device = torch.device(device)
        program = self.program(shared, [False] * (self.n + 1))
        s_arena, p_arena = self._arenas(program, batch, dtype, device)
        views = []
        for i, p in enumerate(self._scan.patterns):
            off = program.input_offsets[i]
            views.append(s_arena[off : off + p.nnz] if shared[i] else p_arena[:, off : off + p.nnz])
        return ValuesBuffer(views, self, program.shared, (s_arena, p_arena))

    def release_buffers(self) -> None:
        """Free the matrix arenas and working buffers kept between calls."""
        self._buffers.clear()
        self._scratch_bufs.clear()

    # -- persistence --------------------------------------------------------------------
    def save(self, path) -> None:
        """Write the plan (symbolic results included) to ``path`` as a pickle-free ``.npz``."""
        from spscan.planner.serialize import save_scan

        options = {
            "backend": self.backend,
            "device": None if self.device is None else str(self.device),
            "dtype": None if self.dtype is None else str(self.dtype).replace("torch.", ""),
            "max_memory": self.max_memory,
            "requested_levels": self.requested_levels,
        }
        save_scan(path, self._scan, options)
