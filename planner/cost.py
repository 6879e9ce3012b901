"""Cost model of the scan's critical path, per target device.

Each scan step is a handful of launches (one per primitive group) that run one after another,
so a step costs ``launches * op_overhead + work / rate``. The linear-scan middle part costs one
launch per reduced block; the up-sweep buys a shorter middle with more (and denser) work. The
constants are per device class; they decide ``levels="auto"`` and sparse-vs-dense storage of
every planned product (by the cost of what reads it) and never affect results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from .patterns import Pattern
from .recurrence import CHUNK_SCALE as RECURRENCE_CHUNK_SCALE, periodic_structure

if TYPE_CHECKING:
    from .schedule import ScanSchedule

__all__ = ["INDEX_BYTES", "DeviceProfile", "LevelCost", "bin_widths", "linear_run_kind", "profile_for",
           "row_bins", "schedule_costs"]

INDEX_BYTES = 8  # bytes of one stored index (int64)

# profile fields added after version 3 files were first written, in the groups they came in: a
# file without a group was planned by a profile that did not have it, whose behavior the group's
# defaults keep (no chunked linear runs; CSR steps of at most 2**16 entries in runs; no structured
# recurrences; a layer's own operator priced at the default rate; the normalization form's margin and
# dense-block bound as they were fixed before they were profile fields)
LATER_PROFILE_FIELDS = (("parallel_run_max_m", "parallel_run_min_steps", "parallel_run_rate", "chain_sparse_step_s"),
                         ("run_sparse_max_nnz",), ("recurrence_rate", "recurrence_step_s", "recurrence_max_n"),
                         ("operator_rate",), ("factored_margin", "dense_block_limit"))
_LATER_INT_FIELDS = ("parallel_run_max_m", "parallel_run_min_steps", "recurrence_max_n", "dense_block_limit")
_ZERO_ALLOWED = ("parallel_run_max_m", "recurrence_max_n")


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    op_overhead_s: float  # fixed cost of one launched primitive group
    pair_rate: float  # gather-multiply-accumulate pairs per second (sparse, per sample)
    gemm_rate: float  # multiply-adds per second in batched small dense GEMM
    gemv_rate: float  # multiply-adds per second in batched dense GEMV
    bytes_budget: float  # symbolic exploration stops when a level's index data would exceed this
    chain_step_s: float  # fixed cost of one step of the fused middle chain (dense / diagonal)
    # a sparse product whose pair lists would exceed this many bytes runs row-wise over its output
    # pattern (O(nnz) index data, :mod:`spscan.planner.rowwise`) instead
    pair_list_max_bytes: float = float(1 << 26)
    # ``None`` (default): every planned product is stored dense or sparse by the cost of what reads
    # it (:class:`spscan.planner.storage.StorageRule`). A density in (0, 1] overrides that: products
    # at least this dense are stored densely (the fixed rule of plan file version 2, where it was 0.35)
    dense_threshold: Optional[float] = None
    # the device runs a linear run of square ``m x m`` dense / diagonal steps parallel over its steps
    # (chunked: kernels.linear_run) when ``m <= parallel_run_max_m`` (0: never) and it has at least
    # ``parallel_run_min_steps`` steps
    parallel_run_max_m: int = 0
    parallel_run_min_steps: int = 64
    # multiply-adds per second (``m^3`` per dense step, per sample) of composing the chunks' maps
    parallel_run_rate: float = 1.0e12
    # fixed cost of one sparse (CSR) step of the fused middle chain; ``None``: ``chain_step_s``
    chain_sparse_step_s: Optional[float] = None
    # largest CSR pattern (stored entries) a fused linear run takes as a step; a bigger one stays a
    # standalone SpMV (``None``: no bound). On a GPU a run walks a step's rows in one program per
    # block of samples, while a standalone SpMV spreads them over the device; on a CPU the compiled
    # run loop is the fastest way through any CSR step (a standalone SpMV there is eager gathers)
    run_sparse_max_nnz: Optional[int] = 1 << 16
    # structured recurrences (a run repeating one shared block and per-step diagonals, the fused kernels
    # of kernels.recurrence): multiply-adds per second of composing the chunk maps (0: the device does
    # not run them) and the time of one dependent step of a chunk or of the carry
    recurrence_rate: float = 0.0
    recurrence_step_s: float = 1.0e-6
    recurrence_max_n: int = 0  # the widest block the fused recurrence kernels take (0: none)
    # entries per second (per sample) of a layer's own operator applying its J^T (ATen's convolution or
    # normalization backward, a GEMM): a dense kernel's rate, not the CSR gathers' pair_rate
    operator_rate: float = 1.0e10
    # the normalization form (:func:`spscan.chain.planning.plan_chain`): ``norm_form="auto"`` keeps a layer's
    # low-rank factors only when their estimated time is below its dense blocks' divided by
    # ``factored_margin`` (the CPU constants price per-sample dense GEMMs below what a core runs, so the
    # margin keeps the estimate from picking factors that run slower: bench/results/calibration.md); above
    # ``dense_block_limit`` dense-block entries per sample a layer's blocks are never planned into products
    # (a dense LayerNorm(1024) over 16 tokens is 16.8M entries per sample: 4 GiB of values a step at batch
    # 64, float32; its factors 98k)
    factored_margin: float = 2.0
    dense_block_limit: int = 1 << 22

    def run_step_s(self, kind: str) -> float:
        """Fixed cost of one fused linear-run step of kind ``"dense"``, ``"diag"`` or ``"sparse"``."""
        if kind == "sparse" and self.chain_sparse_step_s is not None:
            return self.chain_sparse_step_s
        return self.chain_step_s

    def gemm_time(self, macs: float, launches: int) -> float:
        return launches * self.op_overhead_s + macs / self.gemm_rate

    @classmethod
    def from_dict(cls, raw: Any) -> "DeviceProfile":
        """A profile from its fields as a plan file (or a device profile file) stores them, checked: a dict of
        every field, where the groups of :data:`LATER_PROFILE_FIELDS` may be absent (their defaults). Raises
        ``ValueError`` naming the field for anything else."""
        names = [f.name for f in fields(cls)]
        for group in LATER_PROFILE_FIELDS:
            if isinstance(raw, dict) and all(k not in raw for k in group):
                raw = dict(raw, **{f.name: f.default for f in fields(cls) if f.name in group})
        if not isinstance(raw, dict) or sorted(raw) != sorted(names):
            raise ValueError(f"expected the keys {names}, got {raw!r}")
        if not isinstance(raw["name"], str):
            raise ValueError(f"'name': expected a string, got {raw['name']!r}")
        for k in names[1:]:
            v = raw[k]
            if k in _LATER_INT_FIELDS:
                if not isinstance(v, int) or isinstance(v, bool) or v < (0 if k in _ZERO_ALLOWED else 1):
                    raise ValueError(f"'{k}': expected a non-negative int (at least 1 for "
                                     f"parallel_run_min_steps and dense_block_limit), got {v!r}")
                continue
            if k == "recurrence_rate":  # 0: the device runs no structured recurrences
                if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                    raise ValueError(f"'recurrence_rate': expected a finite number >= 0, got {v!r}")
                continue
            if k == "chain_sparse_step_s" and v is None:
                continue  # the dense steps' cost
            if k == "run_sparse_max_nnz":
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                    raise ValueError(f"'run_sparse_max_nnz': expected null (no bound) or an int "
                                     f">= 1, got {v!r}")
                continue
            if k == "dense_threshold":
                if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 1):
                    raise ValueError(f"'dense_threshold': expected null (storage by cost) or a "
                                     f"density in (0, 1], got {v!r}")
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"'{k}': expected a finite positive number, got {v!r}")
        return cls(**raw)

    def describe_thresholds(self) -> str:
        """The thresholds of this profile that decide besides its rates, as ``explain()`` shows them."""
        run = (f"chunked linear runs of width <= {self.parallel_run_max_m} and >= {self.parallel_run_min_steps} "
               "steps" if self.parallel_run_max_m else "no chunked linear runs")
        rec = f"fused recurrences of blocks <= {self.recurrence_max_n}" if self.recurrence_max_n else "no fused recurrences"
        csr = "any" if self.run_sparse_max_nnz is None else f"<= {self.run_sparse_max_nnz}"
        store = ("storage by the cost of what reads it" if self.dense_threshold is None
                 else f"dense storage at density >= {self.dense_threshold:g}")
        return (f"{self.name} thresholds: {store}; {run}; CSR run steps of {csr} entries; {rec}; factored norm form "
                f"must win by {self.factored_margin:g}x; dense norm blocks <= {self.dense_block_limit} entries")


# Orders of magnitude of a small multi-core CPU (torch eager) and a recent datacenter GPU (Triton launches:
# latency-bound for small levels, bandwidth-bound for big ones), fitted to the measurements listed in
# bench/results/calibration.md.
_CPU = DeviceProfile("cpu", op_overhead_s=3.0e-5, pair_rate=1.0e8, gemm_rate=4.0e9, gemv_rate=1.0e9,
                     bytes_budget=2.0e9, chain_step_s=2.0e-6, run_sparse_max_nnz=None)
_CUDA = DeviceProfile("cuda", op_overhead_s=6.0e-6, pair_rate=6.0e10, gemm_rate=3.0e12, gemv_rate=6.0e11, operator_rate=3.0e12,
                      bytes_budget=8.0e9, chain_step_s=2.0e-6, pair_list_max_bytes=float(1 << 28),
                      parallel_run_max_m=63, parallel_run_rate=7.7e11, chain_sparse_step_s=5.0e-6,
                      recurrence_rate=6.0e12, recurrence_step_s=5.0e-7, recurrence_max_n=64)


def profile_for(device_type: str, overrides: Optional[dict] = None) -> DeviceProfile:
    """The cost-model constants of a device class, with ``overrides`` (field name -> value) applied.

    ``{"dense_threshold": 0.35}`` restores the former fixed storage rule; any other value must be a
    density in (0, 1].
    """
    base = _CUDA if device_type == "cuda" else _CPU
    prof = replace(base, **overrides) if overrides else base
    thr = prof.dense_threshold
    if thr is not None and (isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0 < thr <= 1):
        raise ValueError(f"dense_threshold: expected None (storage by cost) or a density in (0, 1], got {thr!r}")
    return prof


# --------------------------------------------------------------------------- the steps of a schedule


@dataclass
class LevelCost:
    phase: str
    level: int
    nodes_mm: int
    nodes_mv: int
    nnz: int  # entries produced (matrices) per sample
    flops: int  # 2 * multiply-adds, per sample
    bytes: int  # values + indices touched, per sample for values
    time_s: float
    nnz_read: int = 0  # stored entries of the matrices the step multiplies (products' operands, mat-vecs')


def bin_widths(lengths: np.ndarray) -> np.ndarray:
    """Padded width per segment of a launch: the exact length when there are few distinct
    lengths (conv rows: interior, border and corner counts), else the next power of two (at
    most 2x padding)."""
    widths = np.maximum(lengths, 1)
    if np.unique(widths).size <= 8:
        return widths
    pos = widths > 1
    widths[pos] = 1 << np.ceil(np.log2(widths[pos])).astype(np.int64)
    return widths


_RUN_KIND: dict[str, str] = {}
_BINS: dict[tuple[str, int], int] = {}


def linear_run_kind(p: Pattern, profile: DeviceProfile) -> Optional[str]:
    """How a fused linear run (the scan's middle) takes a matrix of pattern ``p`` on ``profile``'s
    device: ``"dense"`` (full pattern: a row-major block), ``"diag"`` (the identity pattern: ``m``
    scale factors), ``"sparse"`` (any other pattern: a CSR step over its ``indptr``/``indices``), or
    ``None`` (the step stays a standalone SpMV: a CSR pattern over ``profile.run_sparse_max_nnz``
    entries). See :func:`_linear_run_kind`."""
    kind = _RUN_KIND.get(p.key)
    if kind is None:
        _RUN_KIND[p.key] = kind = _linear_run_kind(p)
    limit = profile.run_sparse_max_nnz
    if kind == "sparse" and limit is not None and p.nnz > limit:
        return None
    return kind


def _linear_run_kind(p: Pattern) -> str:
    """The run kind of one pattern, on any device.

    * Full patterns are ``"dense"`` and identity patterns ``"diag"`` (no index read at all).
    * Every other pattern is ``"sparse"``, nearly dense ones included: their values arrive in CSR
      order, so a dense step would need a scatter of the values into a block on every call, while
      the CSR step reads them in place at one index per entry (at most twice the dense step's reads).
    """
    if p.is_full:
        return "dense"
    if (p.rows == p.cols and p.nnz == p.rows and np.array_equal(p.indices, np.arange(p.rows))
            and np.array_equal(p.indptr, np.arange(p.rows + 1))):
        return "diag"
    return "sparse"


def _seg_bins(counts: np.ndarray) -> int:
    """Number of launches (width bins) a set of segment lengths falls into."""
    return int(np.unique(bin_widths(counts)).size) if counts.size else 0


def row_bins(p: Pattern) -> int:
    """Launches of an SpMV with pattern ``p`` (cached: long chains repeat a few patterns)."""
    key = (p.key, 0)
    if key not in _BINS:
        _BINS[key] = _seg_bins(p.row_lengths())
    return _BINS[key]


def _pair_bins(info: Any) -> int:
    """Launches of a planned SpGEMM (cached per own pattern and pair count): one per width bin of the own
    entries' pair counts, and for a dense-stored product one more that zeroes its block."""
    key = (info.sym.pattern.key, info.sym.npairs)
    if key not in _BINS:
        _BINS[key] = _seg_bins(np.diff(info.sym.pair_ptr))
    return _BINS[key] + int(info.scatters)


def schedule_costs(
    sched: "ScanSchedule", mats: dict[int, Any], profile: DeviceProfile, batch: int, elem: int
) -> list[LevelCost]:
    """The estimated time, work and bytes of every step of ``sched`` with its matrices ``mats`` (each a
    :class:`~spscan.planner.storage.MatInfo`: storage reads the costs, never the other way), for one
    batch of ``batch`` samples of ``elem``-byte values on ``profile``'s device."""
    out = []
    run_steps: list[tuple[int, Pattern]] = []  # (index in out, pattern) of the fused linear-run steps
    # a step of one mat-vec and no product (the linear scan's, one per step of a long chain) costs what its
    # matrix's pattern and operator entries say: costed once per (phase, pattern, entries), the same numbers
    single: dict[tuple, tuple] = {}
    for st in sched.steps:
        if not st.mm and len(st.mv) == 1:
            info = mats[st.mv[0].mat]
            key = (st.phase, info.pattern, info.apply_entries)
            hit = single.get(key)
            if hit is None:
                hit = single[key] = _step_cost(st, mats, profile, batch, elem)
            nnz, flops, nbytes, t, nnz_read, run_pattern = hit
            if run_pattern is not None:
                run_steps.append((len(out), run_pattern))
            out.append(LevelCost(st.phase, st.level, 0, 1, nnz, flops, nbytes, t, nnz_read))
            continue
        nnz, flops, nbytes, t, nnz_read, run_pattern = _step_cost(st, mats, profile, batch, elem)
        if run_pattern is not None:
            run_steps.append((len(out), run_pattern))
        out.append(LevelCost(st.phase, st.level, len(st.mm), len(st.mv), nnz, flops, nbytes, t, nnz_read))
    _parallel_run_costs(out, run_steps, profile, batch)
    return out


def _step_cost(st: Any, mats: dict[int, Any], profile: DeviceProfile, batch: int, elem: int) -> tuple:
    """``(nnz, flops, nbytes, time_s, nnz_read, run_pattern)`` of one step of :func:`schedule_costs`
    (``run_pattern``: the pattern of a step of the fused linear run, else ``None``)."""
    pairs = gemm = gemv = 0
    launches = 0
    nnz = 0
    nbytes = 0
    bins_pairs = 0
    gemm_shapes = set()
    for op in st.mm:
        info = mats[op.out]
        nnz += info.pattern.nnz
        if info.algo == "gemm":
            gemm += info.gemm_macs
            l, r = mats[op.left].pattern, mats[op.right].pattern
            gemm_shapes.add((l.shape, r.shape))
            nbytes += (l.nnz + r.nnz + info.pattern.nnz) * elem
        elif info.algo == "rows":  # one launch per step; indices O(nnz), read once per sample block
            pairs += info.rw.npairs
            bins_pairs = max(bins_pairs, 1)
            nbytes += info.rw.npairs * 2 * elem + info.pattern.nnz * elem + info.rw.index_bytes
        else:
            pairs += info.sym.npairs
            bins_pairs = max(bins_pairs, _pair_bins(info))
            nbytes += info.sym.npairs * (2 * elem + 2 * INDEX_BYTES) + info.pattern.nnz * elem
    mv_sparse = mv_dense = 0
    mv_bins = 0
    gemv_shapes = set()
    applied = 0  # mat-vecs a layer's own operator makes: one call each
    applied_entries = 0
    for op in st.mv:
        info = mats[op.mat]
        p = info.pattern
        if info.apply_entries is not None:
            applied_entries += info.apply_entries
            applied += 1
            nbytes += (info.apply_entries + p.rows + p.cols) * elem
            continue
        if p.is_full:
            gemv += p.nnz
            gemv_shapes.add(p.shape)
            mv_dense += 1
        else:
            mv_sparse += p.nnz
            mv_bins = max(mv_bins, row_bins(p))
        nbytes += p.nnz * (elem + (0 if p.is_full else 2 * INDEX_BYTES)) + p.rows * elem
    launches = bins_pairs + len(gemm_shapes) + mv_bins + len(gemv_shapes) + applied
    run_kind = linear_run_kind(mats[st.mv[0].mat].pattern, profile) \
        if st.phase == "mid" and len(st.mv) == 1 and not applied else None
    run_pattern = None
    if run_kind is not None:
        launches = 0  # a step of a fused linear run: no launch of its own
        t = profile.run_step_s(run_kind)
        run_pattern = mats[st.mv[0].mat].pattern
    else:
        t = 0.0
    t += launches * profile.op_overhead_s
    t += batch * (pairs + mv_sparse) / profile.pair_rate
    t += batch * gemm / profile.gemm_rate + batch * gemv / profile.gemv_rate
    t += batch * applied_entries / profile.operator_rate
    flops = 2 * (pairs + gemm + mv_sparse + gemv + applied_entries)
    nnz_read = sum(mats[op.left].pattern.nnz + mats[op.right].pattern.nnz for op in st.mm)
    nnz_read += sum(mats[op.mat].pattern.nnz if mats[op.mat].apply_entries is None else mats[op.mat].apply_entries
                    for op in st.mv)
    return nnz, flops, nbytes, t, nnz_read, run_pattern


def _parallel_run_costs(out: list[LevelCost], run_steps: list[tuple[int, Pattern]], profile: DeviceProfile,
                        batch: int) -> None:
    """Re-cost the middle's linear run where the device runs it parallel over its steps.

    A run whose every step is a square ``m x m`` dense block or diagonal (``m <=
    profile.parallel_run_max_m``, at least ``profile.parallel_run_min_steps`` steps) runs in chunks
    of ``L ~ sqrt(n)`` steps: ``2 L + n / L`` dependent steps on the critical path instead of ``n``,
    plus composing every chunk's map (``m^3`` multiply-adds per dense step, ``m^2`` per diagonal,
    per sample, at ``parallel_run_rate``). A run of diagonals only runs so per lane, for any ``m``
    (``m`` multiply-adds per step and sample). The total is spread evenly over the run's steps.
    """
    n = len(run_steps)
    if profile.recurrence_rate > 0 and n:
        rec = periodic_structure([p for _, p in run_steps], profile.recurrence_max_n)
        if rec is not None:  # the fused recurrence kernels: a shared block and per-step diagonals
            period, fused, macs = rec
            chunk = max(8.0, RECURRENCE_CHUNK_SCALE * math.sqrt(fused))
            total = (profile.recurrence_step_s * (2 * chunk + fused / chunk) + 3 * profile.op_overhead_s
                     + batch * fused * macs / profile.recurrence_rate)
            for i, p in run_steps:
                c = out[i]
                out[i] = replace(c, time_s=c.time_s - profile.run_step_s(linear_run_kind(p, profile)) + total / n)
            return
    if not profile.parallel_run_max_m or n < max(1, profile.parallel_run_min_steps):
        return
    m = run_steps[0][1].rows
    kinds = [linear_run_kind(p, profile) for _, p in run_steps]
    if any(p.rows != m or p.cols != m for _, p in run_steps) or any(k not in ("dense", "diag") for k in kinds):
        return
    diagonal = all(k == "diag" for k in kinds)
    if m > profile.parallel_run_max_m and not diagonal:
        return
    chunk = max(8.0, math.sqrt(n))
    macs = n * m if diagonal else sum(m ** 3 if k == "dense" else m * m for k in kinds)
    total = profile.chain_step_s * (2 * chunk + n / chunk) + batch * macs / profile.parallel_run_rate
    for i, _ in run_steps:
        c = out[i]
        out[i] = replace(c, time_s=c.time_s - profile.chain_step_s + total / n)
