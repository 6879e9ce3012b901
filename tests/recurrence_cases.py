"""Structured linear runs for the recurrence kernels' tests: the periods recurrent chains make, in
both directions, laid out in arenas as a periodic binding lays them out, and a float64 loop that
runs any :class:`~spscan.planner.program.LinearRun` step by step from the same arenas."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from spscan.recurrent.elements import _blocksum_pattern, _gru_weight_pattern, _lstm_weight_pattern, lstm_gate_pattern
from spscan.planner.patterns import as_pattern
from spscan.planner.program import LinearRun

PERIODS = ("rnn", "gru", "lstm", "rnn_fwd", "gru_fwd", "lstm_fwd")


def _full(r: int, c: int) -> sp.csr_array:
    return sp.csr_array(np.ones((r, c)))


def _eye(n: int) -> sp.csr_array:
    return sp.csr_array(sp.eye(n))


def _t(p: sp.csr_array) -> sp.csr_array:
    q = sp.csr_array(p.T)
    q.sort_indices()
    return q


def period(kind: str, n: int) -> list[tuple[str, bool, sp.csr_array]]:
    """One period as (run kind, shared, pattern) per sub-step, in the run's order."""
    if kind == "rnn":
        return [("diag", False, _eye(n)), ("dense", True, _full(n, n))]
    if kind == "rnn_fwd":
        return [("dense", True, _full(n, n)), ("diag", False, _eye(n))]
    if kind == "gru":
        return [("sparse", True, _blocksum_pattern(4, n)), ("diag", False, _eye(4 * n)),
                ("sparse", True, _gru_weight_pattern(n))]
    if kind == "gru_fwd":
        return [("sparse", True, _t(_gru_weight_pattern(n))), ("diag", False, _eye(4 * n)),
                ("sparse", True, _t(_blocksum_pattern(4, n)))]
    if kind == "lstm":
        return [("sparse", False, lstm_gate_pattern(n)), ("sparse", True, _lstm_weight_pattern(n))]
    if kind == "lstm_fwd":
        return [("sparse", True, _t(_lstm_weight_pattern(n))), ("sparse", False, _t(lstm_gate_pattern(n)))]
    raise ValueError(kind)


def build(kind: str, n: int, steps: int, batch: int, adds: int, seed: int = 0, dtype=torch.float64,
          scale: float = 0.9):
    """A structured run of ``steps`` fused steps of ``kind``'s period: (op, S arena, P arena, V arena).

    Per-sample values advance backwards through P (as a backward chain's do); the first ``adds`` fused
    steps have additive terms; values are drawn so the chain neither blows up nor vanishes."""
    rng = np.random.default_rng(seed)
    per = period(kind, n)
    p = len(per)
    pats = [as_pattern(pat) for _, _, pat in per]
    nnz = [pt.nnz if k == "sparse" else (pt.rows * pt.cols if k == "dense" else pt.rows) for (k, _, _), pt in
           zip(per, pats)]
    # shared values once; per-sample values of every fused step, the last step first
    s_off, size_s = [], 3  # a few leading entries: offsets need not start at 0
    for (k, sh, _), z in zip(per, nnz):
        s_off.append(size_s if sh else -1)
        size_s += z if sh else 0
    width = sum(z for (k, sh, _), z in zip(per, nnz) if not sh)
    size_p = 5 + steps * width
    p_off = []
    acc = 0
    for (k, sh, _), z in zip(per, nnz):
        p_off.append(acc if not sh else -1)
        acc += z if not sh else 0
    m = per[0][2].shape[1]
    rows = [pt.rows for pt in pats]
    # vectors: y_0, the additive terms, then each fused step's sub-step outputs
    v_in = 2
    slot = v_in + m
    out = np.zeros(steps * p, dtype=np.int64)
    add = np.full(steps * p, -1, dtype=np.int64)
    for s in range(adds):  # the additive terms first, the last step's first (as a backward chain's)
        add[(adds - 1 - s) * p + p - 1] = slot
        slot += m
    for s in range(steps):
        for r in range(p):
            out[s * p + r] = slot
            slot += rows[r]
    size_v = slot + 1
    mat_offset = np.zeros(steps * p, dtype=np.int64)
    for s in range(steps):
        for r in range(p):
            mat_offset[s * p + r] = s_off[r] if per[r][1] else 5 + (steps - 1 - s) * width + p_off[r]
    csr = tuple(pt for (k, _, _), pt in zip(per, pats) if k == "sparse")
    pattern = np.full(steps * p, -1, dtype=np.int64)
    ci = 0
    for r, (k, _, _) in enumerate(per):
        if k == "sparse":
            pattern[r::p] = ci
            ci += 1
    op = LinearRun(
        dense=np.tile([k == "dense" for k, _, _ in per], steps), shared=np.tile([sh for _, sh, _ in per], steps),
        rows=np.tile(rows, steps).astype(np.int64), cols=np.tile([pt.cols for pt in pats], steps).astype(np.int64),
        mat_offset=mat_offset, layers=np.arange(steps * p, dtype=np.int64)[::-1].copy(), vin0=v_in, add=add, out=out,
        pattern=pattern, csr=csr)
    g = torch.Generator().manual_seed(seed)
    S = torch.randn(size_s, generator=g, dtype=torch.float64)
    for (k, sh, _), off, z, pt in zip(per, s_off, nnz, pats):
        if sh and k != "diag":  # dense blocks scaled so a step is about norm-preserving
            S[off:off + z] *= scale / np.sqrt(max(1, pt.cols / n * n))
    P = torch.rand(batch, size_p, generator=g, dtype=torch.float64) * 1.6 - 0.6
    V = torch.randn(batch, size_v, generator=g, dtype=torch.float64)
    return op, S.to(dtype), P.to(dtype), V.to(dtype)


def reference(op: LinearRun, S: torch.Tensor, P: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """The run in float64, one sub-step at a time: the vectors arena afterwards."""
    V = V.double().clone()
    S, P = S.double(), P.double()
    y = V[:, op.vin0:op.vin0 + int(op.cols[0])]
    for j in range(op.steps):
        r, c, off = int(op.rows[j]), int(op.cols[j]), int(op.mat_offset[j])
        if op.pattern[j] >= 0:
            pt = op.csr[int(op.pattern[j])]
            vals = S[off:off + pt.nnz].expand(V.shape[0], -1) if op.shared[j] else P[:, off:off + pt.nnz]
            rowi = np.repeat(np.arange(r), np.diff(pt.indptr))
            prod = vals * y[:, torch.as_tensor(np.array(pt.indices))]
            new = torch.zeros(V.shape[0], r, dtype=torch.float64).index_add_(1, torch.as_tensor(rowi), prod)
        elif op.dense[j]:
            M = (S[off:off + r * c].view(1, r, c) if op.shared[j] else P[:, off:off + r * c].view(-1, r, c))
            new = (M @ y.unsqueeze(2)).squeeze(2)
        else:
            d = S[off:off + r].view(1, r) if op.shared[j] else P[:, off:off + r]
            new = d * y
        if op.add[j] >= 0:
            new = new + V[:, op.add[j]:op.add[j] + r]
        V[:, op.out[j]:op.out[j] + r] = new
        y = new
    return V
