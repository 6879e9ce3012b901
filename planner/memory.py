"""Memory the plan holds and the peak of one ``backward`` call, from the symbolic plan alone.

Index data is counted array by array, as :func:`held_index_bytes` measures it:

* the symbolic plan: every distinct pattern that holds arrays (a product stored densely is a
  :class:`~.patterns.FullPattern` and holds none), planned pair lists (``pair_ptr``, ``pair_a``,
  ``pair_b``), row-wise per-row pair counts;
* per bound value signature (by default one: every input per sample, no ``extra``, no
  structured operators), the lowered work tables of :func:`~.lowering.lower` (padded SpGEMM and
  SpMV bins, GEMV/GEMM block offsets, linear runs with their CSR patterns) and the torch
  backend's own tables (the linear runs' gather tables, kept as NumPy and as tensors; the
  row-wise products' row and key arrays, and the arrays a dense operand's pattern is read into).
  Bindings of one plan share every table whose content is the same (:class:`~.lowering.LoweringCache`,
  keyed by :func:`~.lowering.layout`): a shared table is counted once, as it is held once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .patterns import FullPattern, Pattern
from .cost import INDEX_BYTES, bin_widths, linear_run_kind
from .planning import ScanPlan

__all__ = ["MemoryEstimate", "Signature", "estimate_memory", "held_index_bytes"]

#: a bound value signature: (shared, has_extra, operators, first_output), as :meth:`spscan.Plan.bind` takes it
Signature = tuple[Sequence[bool], Sequence[bool], Sequence[bool], bool]

@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes, assuming every input is per sample (the worst case) and no ``extra`` terms.

    Index data: ``plan_bytes`` (symbolic plan and the bound signatures' tables; of it,
    ``symbolic_bytes`` the symbolic plan's own) plus ``run_step_bytes`` (per-step scalars of the fused
    linear runs: they grow with the chain, the rest with its distinct patterns); ``index_bytes`` is
    their sum.
    """

    plan_bytes: int  # index data held by the plan and its bound tables, run steps' scalars excluded
    values_per_sample: int  # matrix entries (inputs + products) per sample
    vectors_per_sample: int  # vector entries per sample
    temp_per_sample: int  # largest per-step temporary, per sample
    elem_bytes: int
    symbolic_bytes: int = 0  # of plan_bytes: patterns, pair lists and row-wise counts of the symbolic plan
    run_step_bytes: int = 0  # linear runs: eight int64 scalars per step

    @property
    def index_bytes(self) -> int:
        """Every index byte held: what :func:`held_index_bytes` measures over the plan and its bindings."""
        return self.plan_bytes + self.run_step_bytes

    def backward_peak(self, batch: int) -> int:
        """Peak bytes allocated by ``backward`` for batch size ``batch`` (index tables excluded)."""
        per = self.values_per_sample + self.vectors_per_sample + self.temp_per_sample
        return batch * per * self.elem_bytes

    def total(self, batch: int) -> int:
        return self.index_bytes + self.backward_peak(batch)


def _arrays_bytes(p: Pattern) -> int:
    return 0 if isinstance(p, FullPattern) else int(p.indptr.nbytes + p.indices.nbytes)


def _symbolic_bytes(plan: ScanPlan) -> int:
    """Patterns, pair lists and row-wise counts held by the symbolic plan (each distinct array once)."""
    pats: dict[int, Pattern] = {id(p): p for p in plan.patterns}
    arrays: dict[int, int] = {}
    for info in plan.mats.values():
        pats[id(info.pattern)] = info.pattern
        sym = info.sym
        if sym is not None:
            pats[id(sym.pattern)] = sym.pattern  # its own pattern (a dense-stored product's pairs cover it)
            arrays[id(sym.pair_ptr)] = INDEX_BYTES * sym.pair_ptr.shape[0]
            pa = getattr(sym, "pair_a", None)
            if pa is not None:
                arrays[id(pa)] = INDEX_BYTES * pa.shape[0]
                arrays[id(sym.pair_b)] = INDEX_BYTES * sym.pair_b.shape[0]
            else:  # pair counts of a candidate depth: the pair lists it would hold
                arrays[id(sym)] = 2 * INDEX_BYTES * sym.npairs
        if info.rw is not None:
            arrays[id(info.rw.row_pairs)] = INDEX_BYTES * info.rw.row_pairs.shape[0]
            pats[id(info.rw.a)] = info.rw.a
            pats[id(info.rw.b)] = info.rw.b
    return sum(_arrays_bytes(p) for p in pats.values()) + sum(arrays.values())


def _bins_bytes(lengths: list[np.ndarray], with_add: bool) -> int:
    """Padded bins of one SpGEMM or SpMV launch group: two slot arrays of the padded widths, out (and add)."""
    if not lengths:
        return 0
    lens = np.concatenate(lengths)
    if lens.size == 0:
        return 0
    padded = int(bin_widths(lens.copy()).sum())
    return INDEX_BYTES * (2 * padded + (2 if with_add else 1) * lens.size)


def _progression(arr: np.ndarray) -> bool:
    return arr.size == 1 or (arr.size > 1 and arr[1] > arr[0] and bool(np.all(np.diff(arr) == arr[1] - arr[0])))


def _run_csr_bytes(p: Pattern) -> int:
    """One CSR pattern of a linear run: its row starts and columns in the program, and the torch
    backend's gather tables (padded positions and rows, once as NumPy and once as tensors)."""
    lengths = p.row_lengths()
    widths = bin_widths(lengths.copy())
    gather = 0
    for w in np.unique(widths).tolist():
        sel = np.flatnonzero(widths == w)
        gather += sel.size * w + (0 if _progression(sel) else sel.size)
    return INDEX_BYTES * (p.rows + 1 + p.nnz + 2 * gather)


def _rows_table_bytes(a: Pattern, b: Pattern, c: Pattern) -> int:
    """The torch backend's row-wise table beyond the patterns: a row per entry of A, a length per row of B,
    the sorted keys of a sparse C, and the arrays a full operand's pattern is read into."""
    n = a.nnz + b.rows
    if not c.is_full:
        n += c.nnz
    if isinstance(a, FullPattern):
        n += a.nnz
    if isinstance(b, FullPattern):
        n += b.rows + 1 + b.nnz
    return INDEX_BYTES * n


def _binding_bytes(plan: ScanPlan, sig: Signature, run_patterns: dict,
                   seen: Optional[set] = None) -> tuple[int, int]:
    """Index bytes of one bound signature's tables (as :func:`~.lowering.lower` and the torch backend
    build them) and, apart, its linear runs' per-step scalars. ``run_patterns``: key -> bytes of the
    runs' CSR tables (each distinct pattern once per run). ``seen``: the keys of tables counted for
    earlier signatures of the same plan (updated): the bindings share those (:class:`~.lowering.LoweringCache`)."""
    from .lowering import layout

    shared, has_extra, operators, first_output = sig
    n = plan.n
    shared = tuple(bool(x) for x in shared) if shared else (False,) * n
    has_extra = tuple(bool(x) for x in has_extra) if has_extra else (False,) * (n + 1)
    operators = tuple(bool(x) for x in operators) if operators else (False,) * n
    mats = plan.mats
    lay = layout(plan, shared, has_extra, operators, first_output)
    seen = set() if seen is None else seen
    total = steps_bytes = 0
    for _, what, payload, key in lay.pending:
        if key is None or key in seen:
            continue
        seen.add(key)
        if what == "run":
            ops = payload
            steps_bytes += 8 * INDEX_BYTES * len(ops)
            distinct: set[str] = set()
            for op in ops:
                p = mats[op.mat].pattern
                if linear_run_kind(p, plan.profile) == "sparse" and p.key not in distinct:
                    distinct.add(p.key)
                    if p.key not in run_patterns:
                        run_patterns[p.key] = _run_csr_bytes(p)
                    total += run_patterns[p.key]
        elif what == "gemm":
            total += 4 * INDEX_BYTES * len(payload[1])  # block offsets and block numbers of both factors
        elif what == "rows":
            for op in payload[1]:
                total += _rows_table_bytes(mats[op.left].pattern, mats[op.right].pattern, mats[op.out].pattern)
        elif what == "spmm":
            total += _bins_bytes([np.diff(mats[op.out].sym.pair_ptr) for op in payload[1]], with_add=False)
        elif what == "gemv":
            for op in payload[1]:  # input slots (k), add slots (m), block offset and number
                p = mats[op.mat].pattern
                total += INDEX_BYTES * (p.rows + p.cols + 2)
        elif what == "spmv":
            total += _bins_bytes([mats[op.mat].pattern.row_lengths() for op in payload[1]], with_add=True)
    return total, steps_bytes


def estimate_memory(plan: ScanPlan, bindings: Optional[Sequence[Signature]] = None) -> MemoryEstimate:
    """Bytes the plan holds and the peak of ``backward``, from the symbolic plan alone.

    ``bindings``: the value signatures whose tables to count (``(shared, has_extra, operators,
    first_output)`` each, empty sequences meaning the default); ``None``: the default signature
    alone (every input per sample, no extras, no structured operators).
    """
    mats = plan.mats
    sched = plan.schedule
    symbolic = _symbolic_bytes(plan)
    plan_bytes = symbolic
    run_steps = 0
    run_patterns: dict[str, int] = {}
    seen: set = set()  # tables shared by several signatures are held (and counted) once
    for sig in ([((), (), (), True)] if bindings is None else bindings):
        tables, steps = _binding_bytes(plan, sig, run_patterns, seen)
        plan_bytes += tables
        run_steps += steps
    values = sum(p.nnz for p in plan.patterns)
    temp = 0
    for st in sched.steps:
        step_pairs = 0
        for op in st.mm:
            info = mats[op.out]
            values += info.pattern.nnz
            if info.algo == "pairs":
                step_pairs += 2 * info.sym.npairs
            elif info.algo == "rows":
                # pairs are generated per block of output rows (at most ~2**20 pairs and a 2**22-entry
                # row accumulator per sample at a time)
                step_pairs += min(info.rw.npairs, 1 << 20) + min(info.pattern.rows * info.pattern.cols, 1 << 22)
            else:
                step_pairs += info.pattern.nnz
        in_run = (st.phase == "mid" and len(st.mv) == 1
                  and linear_run_kind(mats[st.mv[0].mat].pattern, plan.profile) == "sparse")
        for op in st.mv:
            p = mats[op.mat].pattern
            if in_run or not p.is_full:
                step_pairs += 2 * p.nnz
            else:
                step_pairs += p.rows
        temp = max(temp, 2 * step_pairs)
    vectors = plan.patterns[-1].cols + sum(p.rows for p in plan.patterns)
    vectors += sum(mats[op.mat].pattern.rows for st in sched.steps for op in st.mv)
    return MemoryEstimate(int(plan_bytes), int(values), int(vectors), int(temp), plan.elem_bytes,
                          symbolic_bytes=int(symbolic), run_step_bytes=int(run_steps))


def held_index_bytes(*objs) -> int:
    """Bytes of the distinct integer buffers reachable from ``objs`` (measured, not estimated).

    Walks attributes, dicts and sequences (32 levels deep) and collects every integer NumPy array
    (by its base buffer) and integer torch tensor (by its storage); overlapping address ranges
    (a tensor made from a NumPy view, a view of a pattern's array) count once. What
    :func:`estimate_memory`'s ``index_bytes`` is checked against.
    """
    import torch

    spans: dict[int, int] = {}
    seen: set[int] = set()

    def walk(obj, depth: int) -> None:
        if depth > 32 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            if base.dtype.kind in "iu" and base.nbytes:
                start = base.__array_interface__["data"][0]
                spans[start] = max(spans.get(start, 0), base.nbytes)
        elif isinstance(obj, torch.Tensor):
            if obj.dtype in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8) and obj.numel():
                st = obj.untyped_storage()
                spans[st.data_ptr()] = max(spans.get(st.data_ptr(), 0), st.nbytes())
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                walk(v, depth + 1)
        elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            for v in getattr(obj, "__dict__", {}).values():
                walk(v, depth + 1)
            for name in getattr(type(obj), "__slots__", ()):
                if hasattr(obj, name):
                    walk(getattr(obj, name), depth + 1)

    for o in objs:
        walk(o, 0)
    total = 0
    end = -1
    for start in sorted(spans):
        stop = start + spans[start]
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total
