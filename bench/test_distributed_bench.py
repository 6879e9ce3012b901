"""Model-parallel BPPSA on p = 1, 2, 4 local CPU processes (Gloo over 127.0.0.1).

Run: ``pytest bench/test_distributed_bench.py --benchmark-only``. The chain is a stack of 1-D
convolutions (banded ``J^T``, 5 taps) of ``LAYERS`` layers and width ``WIDTH``, batch ``BATCH``,
float32. The processes stay up for the whole test; each timed call asks every rank for one
``spscan.distributed.backward`` and waits for all of them (the parent's queue round trip is
included). ``extra_info`` carries the scan rounds, the bytes each rank sent (and what the plan
says), the slowest rank's in-process median, and the single-process ``spscan.backward`` of the
whole chain measured in the same test (``ratio`` = single / distributed, > 1: distributed wins).

On a machine with fewer cores than processes the ranks share cores, so these CPU rows show the
cost of the algorithm's extra work (slice composites) and communication, not its scaling; run
``examples/distributed_chain.py`` under ``torchrun`` on several GPUs for that.

Several processes on *one* GPU share it, so a GPU run does not time this suite: NCCL refuses two
ranks on one device ("Duplicate GPU detected"); over Gloo the scan stages its messages through
host copies (Gloo's ``send``/``recv`` take CPU tensors only), which ``tests/test_gpu.py`` checks
with two ranks on one GPU. ``bench/gpu/driver.py`` lists this suite as skipped on a GPU run (see
``bench/gpu/README.md``).
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan
import spscan.distributed as sd

LAYERS, WIDTH, BATCH, TAPS = 64, 256, 16, 3
DTYPE = torch.float32


def _chain() -> list[sp.csr_array]:
    half = TAPS // 2
    band = sp.csr_array(sp.diags([np.ones(WIDTH - abs(o)) for o in range(-half, half + 1)],
                                 list(range(-half, half + 1)), shape=(WIDTH, WIDTH), format="csr"))
    band.sort_indices()
    return [band] * LAYERS


def _values(pats: list, lo: int, hi: int) -> list[torch.Tensor]:
    out = []
    for i in range(lo, hi):
        g = torch.Generator().manual_seed(100 + i)
        out.append((torch.randn(BATCH, pats[i].nnz, generator=g) / np.sqrt(TAPS)).to(DTYPE))
    return out


def _grad(d: int) -> torch.Tensor:
    return torch.randn(BATCH, d, generator=torch.Generator().manual_seed(1)).to(DTYPE)


def _serve(rank: int, p: int, commands, done) -> dict:
    """Rank loop: plan once, then one backward per "step" command until "stop"."""
    pats = _chain()
    dplan = sd.plan(pats, p, rank=rank, levels="auto", backend="torch")
    lo, hi = dplan.slices[rank]
    vals = _values(pats, lo, hi)
    grad = _grad(dplan.dims[-1]) if rank == p - 1 else None
    res = sd.backward(dplan, vals, grad)  # warm-up: lazy lowering of the local plan
    times = []
    while True:
        cmd = commands.get()
        if cmd == "stop":
            break
        t0 = time.perf_counter()
        res = sd.backward(dplan, vals, grad)
        times.append(time.perf_counter() - t0)
        done.put(rank)
    st = res.stats
    return dict(rounds=len(st.rounds), bytes_sent=st.bytes_sent, planned_sent=st.planned_bytes_sent,
                median_s=statistics.median(times) if times else float("nan"), slices=dplan.slices)


class _Group:
    """``p`` ranks kept alive across timed calls (startup costs seconds, a backward milliseconds)."""

    def __init__(self, p: int) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.p = p
        self.commands = [ctx.Queue() for _ in range(p)]
        self.done = ctx.Queue()
        self.results: list = []

        def run() -> None:
            self.results = sd.run_local(_serve, p, args=(self.commands_arg, self.done), timeout=600)

        # each rank reads its own queue: pass the list, ranks index it
        self.commands_arg = _Commands(self.commands)
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def step(self) -> None:
        for q in self.commands:
            q.put("step")
        for _ in range(self.p):
            self.done.get(timeout=120)

    def close(self) -> list:
        for q in self.commands:
            q.put("stop")
        self.thread.join(timeout=120)
        return self.results


class _Commands:
    """Picklable view of the per-rank command queues: ``get()`` reads the calling rank's queue."""

    def __init__(self, queues) -> None:
        self.queues = queues
        self.rank = -1

    def get(self):
        if self.rank < 0:
            import torch.distributed as dist

            self.rank = dist.get_rank()
        return self.queues[self.rank].get()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _single_process_median(rounds: int = 20) -> float:
    pats = _chain()
    plan = spscan.plan(pats, levels="auto", backend="torch")
    vals, grad = _values(pats, 0, LAYERS), _grad(WIDTH)
    spscan.backward(plan, vals, grad)
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        spscan.backward(plan, vals, grad)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_distributed_backward(benchmark, p):
    group = _Group(p)
    try:
        group.step()  # the first call also waits for startup
        benchmark.pedantic(group.step, rounds=15, iterations=1, warmup_rounds=2)
    finally:
        results = group.close()
    for r, (ok, out) in enumerate(results):
        assert ok, f"rank {r} failed:\n{out}"
    stats = [out for _, out in results]
    torch.set_num_threads(1)  # as in each rank
    single = _single_process_median()
    dist_med = benchmark.stats.stats.median
    benchmark.extra_info.update(
        device=f"cpu: {_cpu_name()} ({os.cpu_count()} cores), Gloo over 127.0.0.1",
        processes=p, chain=f"{LAYERS} conv1d layers, width {WIDTH}, {TAPS} taps, batch {BATCH}, {DTYPE}",
        slices=stats[0]["slices"], rounds=max(s["rounds"] for s in stats),
        bytes_sent_per_rank=[s["bytes_sent"] for s in stats],
        planned_bytes_per_rank=[s["planned_sent"] for s in stats],
        slowest_rank_median_ms=1e3 * max(s["median_s"] for s in stats),
        single_process_median_ms=1e3 * single, ratio_single_over_distributed=single / dist_med,
    )
    assert max(s["rounds"] for s in stats) == (0 if p == 1 else int(np.ceil(np.log2(p))))
    assert all(s["bytes_sent"] == s["planned_sent"] for s in stats)
