"""Sizes, device and timing helpers shared by the paper-reproduction suites (``bench/test_paper_*.py``).

Every size comes from here, selected by two environment variables that ``python -m spscan bench``
sets (and that a plain ``pytest bench/test_paper_rnn.py`` run may set by hand):

* ``SPSCAN_BENCH_QUICK=1``: small sizes (the whole quick run is a few minutes on a 2-core CPU);
  unset or ``0``: the paper's sizes.
* ``SPSCAN_BENCH_DEVICE=cpu|cuda``: where to run (default: cuda if available, else cpu).
* ``SPSCAN_BENCH_VGG_DIVISOR``: divide VGG-11's conv channels (default 4 quick, 1 full).
* ``SPSCAN_BENCH_ONLY``: optional comma list that restricts the RNN sweep values, e.g.
  ``T=10,100,1000;B=2,16`` (used to cut a full run short on slow machines).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Optional

import torch

QUICK: bool = os.environ.get("SPSCAN_BENCH_QUICK", "0") not in ("", "0", "false", "no")


def bench_device() -> torch.device:
    """The device the suites run on (``SPSCAN_BENCH_DEVICE``; cuda when available otherwise)."""
    name = os.environ.get("SPSCAN_BENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("SPSCAN_BENCH_DEVICE=cuda but torch sees no CUDA device")
    return dev


DEVICE = bench_device()


def device_label(dev: torch.device = DEVICE) -> str:
    """Human-readable device name recorded in every row's extra_info."""
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def versions() -> dict[str, str]:
    """Versions of the libraries the timings depend on."""
    import spscan

    try:
        import triton

        tv = triton.__version__
    except Exception:  # triton is optional on CPU-only installs
        tv = "n/a"
    return {"torch": torch.__version__, "triton": tv, "python": sys.version.split()[0], "spscan": spscan.__version__}


def _only(key: str) -> Optional[list[int]]:
    """Values of ``key`` kept by ``SPSCAN_BENCH_ONLY`` (``None``: no restriction)."""
    spec = os.environ.get("SPSCAN_BENCH_ONLY", "")
    for part in spec.split(";"):
        if part.strip().startswith(key + "="):
            return [int(v) for v in part.split("=", 1)[1].split(",") if v.strip()]
    return None


def _restrict(key: str, values: list[int]) -> list[int]:
    keep = _only(key)
    return values if keep is None else [v for v in values if v in keep]


# --- Figure 8 / Tables 4-5: bitstream RNN (hidden 20)
RNN_HIDDEN = 20
RNN_SWEEP_T = _restrict("T", [10, 100, 1000] if QUICK else [10, 30, 100, 300, 1000, 3000, 10000, 30000])
RNN_SWEEP_T_BATCH = 16
RNN_SWEEP_B = _restrict("B", [2, 16, 64] if QUICK else [2, 4, 8, 16, 32, 64, 128, 256])
RNN_SWEEP_B_SEQ = 1000
# Figure 7: samples, epochs, batch, T of the short side-by-side training run
# (quick: short sequences and 120 steps, enough for the curve to show the loss falling)
RNN_TRAINING = dict(seq_len=100, samples=640, epochs=3, batch_size=16) if QUICK else \
    dict(seq_len=1000, samples=640, epochs=3, batch_size=16)

# --- Figure 9 / Table 6: GRU on IRMAS-shaped data (hidden 20)
GRU_HIDDEN = 20
GRU_SETS = ["S", "M"] if QUICK else ["S", "M", "L"]
GRU_BATCHES = [16] if QUICK else [16, 32, 64]

# --- Figure 10: pruned VGG-11 conv chain on 32x32 inputs
# quick mode divides every conv's channel count; SPSCAN_BENCH_VGG_DIVISOR overrides (full width: a few
# minutes of training, planning and per-sample symbolic walks on a small CPU)
VGG_CHANNEL_DIVISOR = int(os.environ.get("SPSCAN_BENCH_VGG_DIVISOR") or (4 if QUICK else 1))
VGG_PRUNE_AMOUNT = 0.97
# the paper's "up-sweep L0-L2" (section 5.3): Figure 3 numbers the row of input matrices L0, so two
# levels of products, then the linear scan and the down-sweep
VGG_PAPER_LEVELS = 2

# --- SpGEMM on VGG-11 Jacobian products
SPGEMM_PRODUCTS = 4 if QUICK else 8  # first k consecutive pairs J_i^T . J_{i+1}^T of the chain

# --- section 3.5 convergence: LeNet-5 on CIFAR-10 (or a synthetic stand-in)
CONV_BATCH = 16 if QUICK else 64
CONV_ITERS = 25 if QUICK else 200
CONV_LEVELS: object = "auto"  # quick and full alike, so the quick row points the same way as the full one

ROUNDS = 3 if QUICK else 5


def sync(dev: torch.device = DEVICE) -> None:
    """Wait for queued GPU work so host timers measure it."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_time(fn: Callable[[], Any], rounds: int, setup: Optional[Callable[[], Any]] = None,
                dev: torch.device = DEVICE) -> float:
    """Median wall-clock seconds of ``fn(setup())`` over ``rounds`` runs after one warm-up (setup untimed)."""
    ts = []
    for r in range(rounds + 1):
        arg = setup() if setup is not None else None
        sync(dev)
        t0 = time.perf_counter()
        fn() if setup is None else fn(arg)
        sync(dev)
        if r:
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def rounds_for(seconds_per_call: float, budget_s: float = 2.0) -> int:
    """How many timed rounds fit ``budget_s`` (at least 3: a single round on a loaded machine is noise)."""
    return max(3, min(ROUNDS, int(budget_s / max(seconds_per_call, 1e-6))))


def common_info() -> dict[str, Any]:
    """extra_info fields every paper row carries."""
    return {"device": device_label(), "quick": QUICK, **versions()}
