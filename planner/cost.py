"""Cost model of the scan's critical path, per target device.

Each scan step is a handful of launches (one per primitive group) that run one after another,
so a step costs ``launches * op_overhead + work / rate``. The linear-scan middle part costs one
launch per reduced block; the up-sweep buys a shorter middle with more (and denser) work. The
constants are per device class; they decide ``levels="auto"`` and sparse-vs-dense storage of
every planned product (by the cost of what reads it) and never affect results.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

__all__ = ["DeviceProfile", "profile_for"]


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
    # it (:class:`spscan.planner.planning.StorageRule`). A density in (0, 1] overrides that: products
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

    def run_step_s(self, kind: str) -> float:
        """Fixed cost of one fused linear-run step of kind ``"dense"``, ``"diag"`` or ``"sparse"``."""
        if kind == "sparse" and self.chain_sparse_step_s is not None:
            return self.chain_sparse_step_s
        return self.chain_step_s

    def sparse_time(self, pairs: float, launches: int) -> float:
        return launches * self.op_overhead_s + pairs / self.pair_rate

    def gemm_time(self, macs: float, launches: int) -> float:
        return launches * self.op_overhead_s + macs / self.gemm_rate

    def gemv_time(self, macs: float, launches: int) -> float:
        return launches * self.op_overhead_s + macs / self.gemv_rate


# Measured orders of magnitude: torch eager ops on a small multi-core CPU, and Triton launches
# on a recent datacenter GPU (launch-latency bound for small levels, bandwidth bound for big ones).
# A CSR step of the persistent Triton run on an H100: 4.7 us (the materialized LSTM, 2H x 2H with
# 2H^2 + 2H entries, H = 20, B = 16: 46.7 ms for 10000 steps) to 6.4 us (its factored chain).
# A chunked run's composition on an H100 (fp32, exact products): 3.84e9 multiply-adds (the RNN at
# T = 30000, B = 16, H = 20) in 5.1 ms, ~7.7e11/s; its expansion ~1.2 ms for chunks of 245 steps.
# A structured recurrence on an H100 (kernels.recurrence, tf32x3 chunk maps; bench/gpu/tune.py): the chunk
# maps' real multiply-adds at 9.3e12/s (RNN, m = 20), 5.9e12/s (GRU) and 4.8e12/s (LSTM, m = 40); a
# dependent step ~1 us in a chunk and ~0.4 us in the carry.
# A CPU middle-chain step is one NumPy dot or multiply on views (~1.4 us) plus reading the
# caller's tensor (~0.7 us); see kernels.torch_ops.NUMPY_RUN_MAX_WORK.
_CPU = DeviceProfile("cpu", op_overhead_s=3.0e-5, pair_rate=1.0e8, gemm_rate=4.0e9, gemv_rate=1.0e9,
                     bytes_budget=2.0e9, chain_step_s=2.0e-6, run_sparse_max_nnz=None)
_CUDA = DeviceProfile("cuda", op_overhead_s=6.0e-6, pair_rate=6.0e10, gemm_rate=3.0e12, gemv_rate=6.0e11,
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
