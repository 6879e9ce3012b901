"""Launch parameters for every Triton kernel, chosen in this one place.

Each primitive asks one function here for its block sizes and warps, given only host-side
shape data (segment lengths known at planning time, block shapes, the batch size), so no
launch ever reads device memory to decide how to run. On a GPU the tiles are sized for
registers; in Triton's CPU interpreter (``TRITON_INTERPRET=1``) every program instance costs
milliseconds, so one large tile per program keeps grids tiny. Either way there is exactly one
configuration per shape (no autotuning: the interpreter cannot run several).

Module-level switches:

* ``dot_precision`` (default ``"exact"``): how float32 ``tl.dot`` products (dense nodes, the chunk
  maps of parallel linear runs and structured recurrences) run: ``"exact"`` float32-exact by the
  scheme each kernel was tuned fastest with (exact fp32 multiply-adds, or three TF32 products where
  :data:`RECURRENCE_EXACT_DOT` says so); ``"ieee"`` exact fp32 multiply-adds everywhere; ``"tf32x3"``
  three TF32 tensor-core products per product (the operands split into a TF32 high part and a TF32
  remainder; the remainders' product is dropped), within a few fp32 ulps; ``"tf32"`` one TF32
  product (10-bit mantissa inputs, ~1e-3 relative error). Set it with :func:`set_dot_precision`;
  read at each launch (:func:`input_precision`); float64 is always exact. Triton's interpreter
  computes every choice exactly, so only a GPU shows the difference.
* ``chunk_steps`` (default ``None``: ``~sqrt(steps)``): the chunk length of linear runs that run
  parallel over their steps (:func:`chunked_run_config`), read when a plan's tables are built.
* ``mode``: ``None`` follows ``TRITON_INTERPRET``; ``"device"`` or ``"interpret"`` forces one
  family of configurations (tests use ``"device"`` to run the GPU tile sizes in the interpreter).
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch

from spscan.planner.recurrence import CHUNK_SCALE

__all__ = [
    "dot_precision", "DOT_PRECISIONS", "mode", "chunk_steps", "set_dot_precision", "input_precision", "interpreting",
    "next_pow2", "choose_width",
    "SegmentConfig", "GemmConfig", "GemvConfig", "segment_config", "gemm_config", "gemv_config",
    "LinearRunConfig", "linear_run_config", "ChunkedRunConfig", "chunked_run_config", "DiagonalRunConfig",
    "diagonal_run_config", "RecurrenceConfig", "recurrence_config", "pointwise_config", "LaunchSpec", "launch",
    "recording",
]

DOT_PRECISIONS = ("exact", "ieee", "tf32x3", "tf32")
dot_precision: str = "exact"
mode: Optional[str] = None
chunk_steps: Optional[int] = None

_MAX_WIDTH = 128  # widest pair chunk per segment and step of the reduction loop


def _checked_precision(precision: Any) -> str:
    if not isinstance(precision, str) or precision not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision: expected one of {', '.join(map(repr, DOT_PRECISIONS))}, got {precision!r}")
    return precision


def set_dot_precision(precision: str) -> None:
    """How float32 ``tl.dot`` products run from the next launch on: ``"exact"``, ``"ieee"``, ``"tf32x3"``
    or ``"tf32"`` (see the module docstring). A bound plan's CUDA graphs are kept per setting."""
    global dot_precision
    dot_precision = _checked_precision(precision)


def input_precision(dtype: torch.dtype, exact: str = "ieee") -> str:
    """``tl.dot``'s ``input_precision`` for a launch on ``dtype`` values: ``dot_precision`` for float32
    (``"exact"`` as the kernel's float32-exact scheme ``exact``), ``"ieee"`` otherwise (TF32 applies to
    float32 inputs only)."""
    precision = _checked_precision(dot_precision)
    if dtype != torch.float32:
        return "ieee"
    return exact if precision == "exact" else precision


def interpreting() -> bool:
    """Whether launches use the interpreter-sized configurations."""
    if mode is not None:
        if mode not in ("device", "interpret"):
            raise ValueError(f"launch.mode: expected None, 'device' or 'interpret', got {mode!r}")
        return mode == "interpret"
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(x: int) -> int:
    """Smallest power of two ``>= max(x, 1)``."""
    x = max(int(x), 1)
    return 1 << (x - 1).bit_length()


def _tile(itemsize: int, interpret: bool) -> int:
    """Elements of one program's working tile (registers on a GPU, numpy arrays when interpreting)."""
    if interpret:
        return 1 << 16
    return 2048 if itemsize <= 4 else 1024


def choose_width(lengths: np.ndarray, itemsize: int = 4, interpret: Optional[bool] = None) -> int:
    """Pair-chunk width for a step's segments, ``lengths`` sorted long-first (per-sample pairs).

    A program takes ``tile // width`` consecutive segments and loops ``ceil(longest / width)``
    times over a full tile, so its cost is its iteration count (times the sector waste of chunks
    under 8 indices): the width minimising the total over programs wins, and among near-ties
    (within 5%) the widest, which gives more programs and longer contiguous reads.

    Not the same decision as :func:`spscan.planner.cost.bin_widths`: that one pads the
    segments of a lowered work table into bins (the torch backend's gather layout and the
    planner's launch count), so it trades padding against the number of bins; this one is
    the Triton kernels' loop step over an unpadded long-first table (padding already removed
    by :func:`spscan.kernels.triton.segments.segment_table`), so it trades loop iterations against
    tile shape and sector use. One rule cannot serve both.
    """
    interpret = interpreting() if interpret is None else interpret
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return 1
    tile = _tile(itemsize, interpret)
    top = min(_MAX_WIDTH, next_pow2(int(lengths.max())))
    costs = {}
    w = 1
    while w <= top:
        heads = lengths[:: max(1, tile // w)]  # longest segment of each program (sorted long-first)
        # a chunk narrower than a 32-byte sector wastes the rest of the sector on every index load
        waste = 32 * -(-4 * w // 32) / (4 * w)
        costs[w] = int(np.maximum(-(-heads // w), 1).sum()) * waste
        w *= 2
    best = min(costs.values())
    return max(w for w, c in costs.items() if c <= 1.05 * best)


def _warps(elements: int) -> int:
    return 8 if elements >= 4096 else 4 if elements >= 1024 else 2 if elements >= 256 else 1


@dataclass(frozen=True)
class SegmentConfig:
    """Segment reduction (SpGEMM, SpMV): a program reduces ``block_s`` segments for ``block_b`` samples."""

    block_b: int
    block_s: int
    block_w: int
    num_warps: int


def segment_config(width: int, batch: int, itemsize: int, interpret: Optional[bool] = None) -> SegmentConfig:
    """Tiles for a segment-reduction launch: ``width`` from :func:`choose_width`, ``batch`` samples computed."""
    interpret = interpreting() if interpret is None else interpret
    tile = _tile(itemsize, interpret)
    block_b = min(next_pow2(batch), 64 if interpret else 8)
    block_b = max(1, min(block_b, tile // width))
    block_s = max(1, min(tile // (width * block_b), 1 << 14))
    return SegmentConfig(block_b, block_s, width, 4 if interpret else _warps(block_b * block_s * width))


@dataclass(frozen=True)
class GemmConfig:
    """Batched small GEMM: a program computes a ``block_m x block_p`` tile of one node for ``block_b`` samples."""

    block_b: int
    block_m: int
    block_k: int
    block_p: int
    use_dot: bool
    num_warps: int


def gemm_config(m: int, k: int, p: int, batch: int, itemsize: int,
                interpret: Optional[bool] = None) -> tuple[GemmConfig, bool]:
    """Tiles for ``(m, k) @ (k, p)`` node blocks over ``batch`` samples; also whether k fits one tile.

    ``tl.dot`` needs every tile dimension ``>= 16``: it is used when ``m, k, p >= 16`` (tiles are
    powers of two, so 20 pads to 32); smaller nodes accumulate rank-1 updates (no k tile).
    """
    interpret = interpreting() if interpret is None else interpret
    use_dot = min(m, k, p) >= 16
    cap_mp = 64 if itemsize <= 4 else 32
    if use_dot:
        bm, bp = min(next_pow2(m), cap_mp), min(next_pow2(p), cap_mp)
        bk = min(next_pow2(k), 64 if itemsize <= 4 else 32)
    else:
        # rank-1 updates of a (bm, bp) tile, one k at a time: no k tile
        bm, bp, bk = min(next_pow2(m), 32), min(next_pow2(p), 32), 1
    block_b = min(next_pow2(batch), 16 if interpret else 4)
    warps = 4 if use_dot or interpret else _warps(bm * bp)
    return GemmConfig(block_b, bm, bk, bp, use_dot, warps), k <= bk


@dataclass(frozen=True)
class GemvConfig:
    """Batched small GEMV: a program computes ``block_n`` nodes' ``block_m`` rows for ``block_b`` samples."""

    block_b: int
    block_n: int
    block_m: int
    block_k: int
    num_warps: int


def gemv_config(m: int, k: int, nodes: int, batch: int, itemsize: int,
                interpret: Optional[bool] = None) -> tuple[GemvConfig, bool]:
    """Tiles for ``nodes`` GEMVs ``(m, k) @ (k,)`` over ``batch`` samples; also whether k fits one tile."""
    interpret = interpreting() if interpret is None else interpret
    tile = _tile(itemsize, interpret)
    bm = min(next_pow2(m), 64)
    bk = min(next_pow2(k), max(1, tile // bm), 128)
    # on a GPU the node block depends on the shape only (fewer compiled variants; masking is cheap)
    block_n = max(1, min(tile // (bm * bk), next_pow2(nodes) if interpret else 32))
    block_b = min(next_pow2(batch), 64 if interpret else 4)
    warps = 4 if interpret else _warps(block_n * bm * bk)
    return GemvConfig(block_b, block_n, bm, bk, warps), k <= bk



@dataclass(frozen=True)
class LinearRunConfig:
    """Persistent GEMV run (a linear run): a program walks every step for ``block_b`` samples."""

    block_b: int
    block_m: int
    block_k: int
    num_warps: int


def linear_run_config(uniform_m: int, batch: int, all_shared: bool, itemsize: int,
                 interpret: Optional[bool] = None) -> tuple[LinearRunConfig, bool]:
    """Tiles for a linear run of mat-vecs; also whether one register tile holds every matrix.

    ``uniform_m``: the common size when every step is a dense ``m x m`` block, else 0. Up to
    ``m = 64`` the running vector stays in registers. With per-sample matrices a GPU program
    takes one sample (the run is sequential: more programs stream more bandwidth); shared
    matrices are loaded once per step for as many samples as the tile budget allows.
    """
    interpret = interpreting() if interpret is None else interpret
    one_tile = 0 < uniform_m <= 64
    if one_tile:
        bm = bk = next_pow2(uniform_m)
    else:
        bm, bk = 32, (64 if itemsize <= 4 else 32)
    budget = (1 << 16) if interpret else 8192
    if interpret:
        block_b = min(next_pow2(batch), 64)
    elif all_shared:
        block_b = min(next_pow2(batch), 16)
    else:
        block_b = 1
    block_b = max(1, min(block_b, budget // (bm * bk)))
    warps = 4 if interpret else _warps(block_b * bm * bk)
    return LinearRunConfig(block_b, bm, bk, warps), one_tile


# --- the one place kernels are launched -------------------------------------------------

_POINTER_TYPES = {"torch.float32": "*fp32", "torch.float64": "*fp64", "torch.int32": "*i32", "torch.int64": "*i64"}


@dataclass(frozen=True)
class LaunchSpec:
    """What a launch compiles: kernel (module, name), argument types, constexpr values, warps.

    Ahead-of-time compilation (``tests/test_triton_compile.py``) replays exactly these.
    """

    module: str
    kernel: str
    signature: tuple[tuple[str, str], ...]  # (argument, triton type) for runtime arguments
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int


_recorder: Optional[list] = None
_dry_run: bool = False


def _arg_type(name: str, value: Any) -> str:
    if hasattr(value, "dtype") and hasattr(value, "data_ptr"):
        key = str(value.dtype)
        if key not in _POINTER_TYPES:
            raise TypeError(f"kernel argument {name}: expected a float32/float64/int32/int64 tensor, got {value.dtype}")
        return _POINTER_TYPES[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"kernel argument {name}: expected a tensor or an int, got {type(value).__name__}")
    if value == 1:  # Triton's JIT compiles an int argument equal to 1 as the constant 1 (unless told not to)
        return "i32:1"
    return "i32" if -(1 << 31) <= value < (1 << 31) else "i64"


@contextmanager
def recording(dry_run: bool = True) -> Iterator[list]:
    """Collect a :class:`LaunchSpec` per launch inside the block (and skip the launches if ``dry_run``)."""
    global _recorder, _dry_run
    saved = (_recorder, _dry_run)
    _recorder, _dry_run = [], dry_run
    try:
        yield _recorder
    finally:
        _recorder, _dry_run = saved


@dataclass(frozen=True)
class ChunkedRunConfig:
    """A uniform linear run parallel over its steps: ``chunks`` chunks of ``chunk`` steps, each
    chunk's map a ``(block_m, block_m)`` tile (``block_m > m``: column ``m`` holds its additive term)."""

    m: int
    chunk: int
    chunks: int
    block_m: int
    num_warps: int

    @property
    def scratch_per_sample(self) -> int:
        """Working entries per sample: every chunk's map and entry vector."""
        return self.chunks * self.block_m * (self.block_m + 1)


# Runs shorter than this stay sequential (one persistent program per block of samples): the
# chunked form's three launches and its composition work only pay off over many steps.
CHUNKED_MIN_STEPS = 64
CHUNKED_MAX_M = 63  # a chunk map (m + 1 columns) fits one 64 x 64 register tile


def _chunk_length(steps: int, chunk: Optional[int]) -> int:
    """``chunk``, else ``chunk_steps``, else ``~sqrt(steps)`` (at least 8), within ``1..steps``."""
    if chunk is None:
        chunk = chunk_steps if chunk_steps is not None else max(8, int(round(math.sqrt(steps))))
    return max(1, min(int(chunk), steps))


def chunked_run_config(m: int, steps: int, chunk: Optional[int] = None) -> Optional[ChunkedRunConfig]:
    """Chunking of a uniform run of ``steps`` square ``m x m`` steps, or ``None`` where the run stays
    sequential (``m`` too large, too few steps).

    ``chunk`` (default ``~sqrt(steps)``) balances the critical path: ``chunk`` dependent products
    per chunk map and as many mat-vecs per expanded chunk against ``steps / chunk`` carries.
    """
    if not 0 < m <= CHUNKED_MAX_M or steps < CHUNKED_MIN_STEPS:
        return None
    chunk = _chunk_length(steps, chunk)
    bm = max(16, next_pow2(m + 1))
    return ChunkedRunConfig(m, chunk, -(-steps // chunk), bm, 4)


@dataclass(frozen=True)
class DiagonalRunConfig:
    """A run of ``m``-entry diagonals parallel over its steps and lanes: ``chunks`` chunks of ``chunk``
    steps, ``block_l`` lanes (sample, entry) per program."""

    m: int
    chunk: int
    chunks: int
    block_l: int
    num_warps: int

    @property
    def scratch_per_sample(self) -> int:
        """Working entries per sample: every chunk's scales, shifts and entry vector."""
        return 3 * self.chunks * self.m


def diagonal_run_config(m: int, steps: int, chunk: Optional[int] = None) -> Optional[DiagonalRunConfig]:
    """Chunking of a run of ``steps`` diagonals of ``m`` entries, or ``None`` where it stays sequential
    (fewer than :data:`CHUNKED_MIN_STEPS` steps). Any ``m``: lanes are independent. ``chunk`` as in
    :func:`chunked_run_config`."""
    if m <= 0 or steps < CHUNKED_MIN_STEPS:
        return None
    chunk = max(_chunk_length(steps, chunk), -(-steps // 65535))  # chunks are grid dimension 1 (<= 65535)
    block = 1024 if interpreting() else 128  # the interpreter pays per program; a GPU wants many programs
    return DiagonalRunConfig(m, chunk, -(-steps // chunk), block, 4)


@dataclass(frozen=True)
class RecurrenceConfig:
    """A structured recurrence (:mod:`spscan.kernels.triton.recurrence`) parallel over its steps: ``chunks`` chunks
    of ``chunk`` fused steps; blocks padded to ``block_n`` columns; the compose launch holds
    ``compose_rows`` lanes per program, the expand launch ``expand_rows`` samples."""

    chunk: int
    chunks: int
    block_n: int
    compose_rows: int
    compose_warps: int
    expand_rows: int
    expand_warps: int
    carry_warps: int
    compose_dot: Optional[str] = None  # a fixed float32 scheme (tuning); None: from dot_precision
    expand_dot: Optional[str] = None

    def lanes(self, itemsize: int) -> int:
        """Compose lanes per program for values of ``itemsize`` bytes: float64 tiles hold half as many
        (their registers spilled at the float32 count: compile report)."""
        return self.compose_rows if itemsize <= 4 else max(16, self.compose_rows // 2)

    @property
    def compose_precision(self) -> str:
        """``tl.dot``'s precision for float32 chunk maps, read at each launch (see :func:`input_precision`)."""
        return self.compose_dot or input_precision(torch.float32, RECURRENCE_EXACT_DOT["compose"])

    @property
    def expand_precision(self) -> str:
        """The same for the expansion's products."""
        return self.expand_dot or input_precision(torch.float32, RECURRENCE_EXACT_DOT["expand"])


# Structured recurrences of fewer fused steps, or of blocks wider than this, stay on the general kernels
# (the shared blocks are held for a whole launch; planner.cost's recurrence_max_n says the same).
RECURRENCE_MIN_STEPS = 16
RECURRENCE_MAX_N = 64
# Launch parameters of the structured recurrence on a GPU, by state size m = ny * n (the widest first):
# (largest m, compose lanes per program, compose warps, expand warps, carry warps). Chosen by
# ``bench/gpu/tune.py`` on the device named in ``RECURRENCE_TUNED_ON``.
RECURRENCE_TUNED_ON = "NVIDIA H100 80GB HBM3 (bench/results/nvidia-h100-80gb-hbm3/recurrence/tune_rnn.log)"
RECURRENCE_TABLE: tuple[tuple[int, int, int, int, int], ...] = (
    (32, 64, 4, 4, 2),  # states up to 32 wide (tuned at m = 20)
    (1 << 30, 64, 4, 4, 4),  # wider states (tuned at m = 40)
)
# the chunk length as a multiple of sqrt(steps): the planner's, which costs it
RECURRENCE_CHUNK_SCALE = CHUNK_SCALE
# the float32-exact scheme of each phase's products under dot_precision "exact": "ieee" (FMA) or "tf32x3"
# (three TF32 products: as exact against float64 and faster; the tune is in bench/results/calibration.md)
RECURRENCE_EXACT_DOT = {"compose": "tf32x3", "expand": "tf32x3"}


def recurrence_config(n: int, ny: int, steps: int, chunk: Optional[int] = None,
                      interpret: Optional[bool] = None) -> Optional[RecurrenceConfig]:
    """Launch parameters of a structured recurrence with blocks of ``n``, a state of ``ny`` blocks and
    ``steps`` fused steps, or ``None`` where it stays on the general kernels (too few steps).

    ``chunk``: chunk length (default ``chunk_steps``, else ``RECURRENCE_CHUNK_SCALE * sqrt(steps)``, at least 8).
    """
    interpret = interpreting() if interpret is None else interpret
    if steps < RECURRENCE_MIN_STEPS or n > RECURRENCE_MAX_N:
        return None
    if chunk is None and chunk_steps is None:
        chunk = max(8, int(round(RECURRENCE_CHUNK_SCALE * math.sqrt(steps))))
    chunk = max(_chunk_length(steps, chunk), -(-steps // 65535))  # chunks are grid dimension 1 (<= 65535)
    block_n = max(16, next_pow2(n))  # tl.dot takes tiles of 16 and more
    m = n * ny
    if interpret:  # the interpreter pays per program: few, large ones
        return RecurrenceConfig(chunk, -(-steps // chunk), block_n, 256, 4, 64, 4, 4)
    _, rows, cw, ew, kw = next(row for row in RECURRENCE_TABLE if m <= row[0])
    if block_n >= 64:  # 64-wide blocks: twice the warps keep a 64-lane tile's registers from spilling (compile report)
        cw = max(cw, 8)
    # the carry holds two (m + 1)-square tiles: one warp per 2048 of their entries, so they stay in registers
    kw = max(kw, min(16, next_pow2(m + 1) ** 2 // 2048))
    return RecurrenceConfig(chunk, -(-steps // chunk), block_n, rows, cw, 16, ew, kw)


def pointwise_config(n: int) -> tuple[int, int]:
    """``(block, warps)`` of an elementwise pass over ``n`` entries: 512 entries per program and four
    warps on a GPU (four entries per thread: 16-byte float32 accesses; the float32 passes within 80
    registers, the widest, the gated-cell evaluation in float64, within 192, none spilling: compile report);
    in the interpreter one program per 64 Ki entries."""
    if interpreting():
        return min(1 << 16, next_pow2(n)), 4
    return 512, 4


def launch(kernel, grid: tuple[int, ...], args: dict[str, Any], constexprs: dict[str, Any], num_warps: int) -> None:
    """Launch ``kernel`` on ``grid`` with runtime ``args`` and ``constexprs`` (recorded when asked).

    Grid dimensions 1 and 2 are limited to 65535 by CUDA; callers put the large extent first.
    """
    if any(g > 65535 for g in grid[1:]) or grid[0] >= (1 << 31):
        raise ValueError(f"launch grid {grid}: expected dims 1-2 <= 65535 and dim 0 < 2**31")
    if _recorder is not None:
        fn = getattr(kernel, "fn", kernel)
        _recorder.append(LaunchSpec(
            fn.__module__, fn.__name__, tuple((k, _arg_type(k, v)) for k, v in args.items()),
            tuple(constexprs.items()), int(num_warps)))
    if _dry_run:
        return
    kernel[grid](**args, **constexprs, num_warps=num_warps)
