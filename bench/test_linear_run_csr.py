"""CSR elements inside the fused linear run: a chain shaped like the LSTM step as two sparse elements.

The chain (H = 20, B = 16, T steps): a shared ``(2H, 5H)`` element ``[[W_hh^T, 0], [0, I_H]]``
(nnz ``4H^2 + H`` = 1620) alternating with a per-sample ``(5H, 2H)`` element with ``9H`` = 180
entries, planned at ``levels=0`` (the linear scan). Baseline, measured in the same run and
interleaved pair by pair: the same plan lowered with CSR elements kept out of the fused run (each
one a standalone SpMV op, as before they could join it). Values are laid out as a front end fills
them: the shared element's values one tensor repeated, the per-sample ones views of one
``(T, B, 9H)`` buffer. Times are CPU time (``time.process_time``) with one torch thread.

Run: ``pytest bench/test_linear_run_csr.py --benchmark-only`` or ``python bench/test_linear_run_csr.py [T]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import scipy.sparse as sp
import torch

import spscan
from spscan.planner import cost, planning
from spscan.planner import lowering as lowering_mod
from spscan.planner.program import LinearRun, SpMV

H, B = 20, 16


def lstm_step(h: int) -> tuple[sp.csr_array, sp.csr_array]:
    eye, zero = np.eye(h, dtype=bool), np.zeros((h, h), dtype=bool)
    shared = sp.csr_array(np.block([[np.ones((h, 4 * h), dtype=bool), zero],
                                    [np.zeros((h, 4 * h), dtype=bool), eye]]).astype(np.float64))
    sample = sp.csr_array(np.block([[eye, eye], [eye, eye], [eye, eye], [eye, zero], [eye, eye]]).astype(np.float64))
    return shared, sample


def _bound(pats, shared, fused: bool):
    """The level-0 plan bound for (shared, per-sample) values; ``fused=False`` keeps CSR elements out of runs."""
    kind = cost.linear_run_kind
    saved = lowering_mod.linear_run_kind
    if not fused:
        lowering_mod.linear_run_kind = lambda p, profile: None if kind(p, profile) == "sparse" else kind(p, profile)
    try:
        plan = spscan.plan(pats, levels=0, backend="torch")
        bound = plan.bind(shared, (False,) * (len(pats) + 1))
    finally:
        lowering_mod.linear_run_kind = saved
    ops = [op for st in bound.program.steps for op in st.ops]
    if fused:
        assert sum(int(op.sparse.sum()) for op in ops if isinstance(op, LinearRun)) == len(pats)
    else:
        assert sum(isinstance(op, SpMV) for op in ops) == len(pats)
    return bound


def measure(T: int = 1000, rounds: int = 7, dtype: torch.dtype = torch.float32) -> dict:
    """Interleaved ``(unfused, fused)`` CPU times of one ``run``; medians, ratio, and the max difference."""
    torch.set_num_threads(1)
    a, c = lstm_step(H)
    pats = [a, c] * T
    shared = tuple([True, False] * T)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(a.nnz, generator=gen, dtype=torch.float64).to(dtype) / (4 * H) ** 0.5
    per = torch.randn(T, B, c.nnz, generator=gen, dtype=torch.float64).to(dtype)
    values = [w if i % 2 == 0 else per[i // 2] for i in range(2 * T)]
    grad = torch.randn(B, 2 * H, generator=gen, dtype=torch.float64).to(dtype)
    before, after = _bound(pats, shared, False), _bound(pats, shared, True)

    def timed(bound):
        t0 = time.process_time()
        out = bound.run(values, grad)
        return time.process_time() - t0, out

    timed(before), timed(after)  # warm-up: numba compile / cache load, allocator
    pairs = [(timed(before)[0], timed(after)[0]) for _ in range(rounds)]
    r0, r1 = before.run(values, grad), after.run(values, grad)
    diff = max(float((x - y).abs().max()) for x, y in zip(r0.grads, r1.grads))
    base = statistics.median(p[0] for p in pairs)
    ours = statistics.median(p[1] for p in pairs)
    return dict(T=T, unfused_s=base, fused_s=ours, speedup=base / ours, pairs=pairs, max_abs_diff=diff,
                dtype=str(dtype).replace("torch.", ""))


def test_lstm_two_element_chain(benchmark):
    from conftest import device_name

    res = measure(T=1000, rounds=5)
    a, c = lstm_step(H)
    pats = [a, c] * 1000
    bound = _bound(pats, tuple([True, False] * 1000), True)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(a.nnz, generator=gen)
    per = torch.randn(1000, B, c.nnz, generator=gen)
    values = [w if i % 2 == 0 else per[i // 2] for i in range(2000)]
    grad = torch.randn(B, 2 * H, generator=gen)
    benchmark.pedantic(lambda: bound.run(values, grad), rounds=5)
    benchmark.extra_info.update(device=device_name(), baseline="same plan, CSR elements unfused (SpMV ops)",
                                unfused_median_s=res["unfused_s"], fused_median_s=res["fused_s"],
                                speedup=res["speedup"], nnz=(a.nnz, c.nnz), H=H, B=B, T=1000)


if __name__ == "__main__":
    import platform

    T = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    for dt in (torch.float32, torch.float64):
        r = measure(T=T, dtype=dt)
        print(f"cpu ({platform.processor() or platform.machine()}, 1 torch thread), {r['dtype']}, H={H} B={B} "
              f"T={T}: unfused {r['unfused_s'] * 1e3:.1f} ms, fused {r['fused_s'] * 1e3:.2f} ms, "
              f"speedup {r['speedup']:.1f}x (max |diff| {r['max_abs_diff']:.2e}); pairs (ms): "
              + ", ".join(f"{p0 * 1e3:.0f}/{p1 * 1e3:.2f}" for p0, p1 in r["pairs"]))
