"""Chains and per-rank workers for the multi-process tests of :mod:`spscan.distributed`.

Workers run inside processes started by :func:`spscan.distributed.run_local`; each runs a batch
of cases in one process group (process startup dominates the cost) and returns plain data
(errors, communication counts) for the parent test to assert on.
"""

from __future__ import annotations

import math
import time
from typing import Any, Optional

import numpy as np
import scipy.sparse as sp
import torch
import torch.distributed as dist

import spscan.distributed as sd
from spscan.reference import reference_backward


def make_chain(kind: str, n: int, seed: int) -> list[sp.csr_array]:
    """A chain of ``n`` canonical transposed-Jacobian patterns of one ``kind``.

    ``sparse``: random rectangular patterns (empty rows, 1-wide layers possible); ``dense``: every
    pattern full; ``band``: square banded patterns whose products fill in to dense composites;
    ``mixed``: dense, sparse and diagonal layers interleaved.
    """
    rng = np.random.default_rng(seed)
    pats = []
    if kind == "band":
        d = 12
        for i in range(n):
            m = sp.diags([np.ones(d - abs(o)) for o in (-1, 0, 1)], [-1, 0, 1], shape=(d, d), format="csr")
            pats.append(m)
    else:
        dims = rng.integers(1 if kind == "sparse" else 2, 7, n + 1)
        for i in range(n):
            r, c = int(dims[i]), int(dims[i + 1])
            if kind == "dense" or (kind == "mixed" and i % 3 == 0):
                m = sp.csr_array(np.ones((r, c)))
            elif kind == "mixed" and i % 3 == 1:
                m = sp.csr_array(sp.eye(r, c, format="csr"))
                if m.nnz == 0:
                    m = sp.csr_array(np.ones((r, c)))
            else:
                m = sp.random(r, c, density=float(rng.uniform(0.2, 0.7)), format="csr",
                              random_state=int(rng.integers(1 << 30)))
            pats.append(m)
    out = []
    for m in pats:
        m = sp.csr_array(m)
        m.sum_duplicates()
        m.sort_indices()
        out.append(m)
    return out


def make_step(pats: list, seed: int, batch: int, dtype: torch.dtype, shared: str, extra: str):
    """Values ``(B, nnz)`` or ``(nnz,)`` per layer, ``grad`` and the ``extra`` list for one step.

    ``shared``: ``"none"``, ``"all"`` or ``"some"`` (every other layer shared);
    ``extra``: ``"none"``, ``"all"`` (every index incl. ``n``) or ``"some"`` (every third index).
    """
    g = torch.Generator().manual_seed(seed)
    n = len(pats)
    vals = []
    for i, p in enumerate(pats):
        is_shared = shared == "all" or (shared == "some" and i % 2 == 1)
        shape = (p.nnz,) if is_shared else (batch, p.nnz)
        vals.append(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype))
    dims = [p.shape[0] for p in pats] + [pats[-1].shape[1]]
    grad = torch.randn(batch, dims[-1], generator=g, dtype=torch.float64).to(dtype)
    ex: Optional[list] = None
    if extra != "none":
        ex = [torch.randn(batch, dims[i], generator=g, dtype=torch.float64).to(dtype)
              if extra == "all" or i % 3 == 0 else None for i in range(n + 1)]
    return vals, grad, ex


def local_extra(ex: Optional[list], lo: int, hi: int, last: bool) -> Optional[list]:
    if ex is None:
        return None
    mine = list(ex[lo: hi + 1])
    if not last:
        mine[-1] = None  # index hi is the next rank's first index
    return mine


def rel_error(got, ref) -> float:
    err = 0.0
    for a, b in zip(got, ref):
        a = a.detach().to(torch.float64)
        scale = float(b.abs().max()) if b.numel() else 0.0
        diff = float((a - b).abs().max()) if b.numel() else 0.0
        err = max(err, diff / scale if scale > 0 else diff)
    return err


def run_case(rank: int, p: int, case: dict, group=None) -> dict:
    """One backward of ``case`` on this rank; the reference is recomputed locally from the same seeds."""
    pats = make_chain(case["kind"], case["n"], case["seed"])
    dtype = case.get("dtype", torch.float64)
    dplan = sd.plan(pats, p, slices=case.get("slices"), levels=case.get("levels", "auto"),
                    backend=case.get("backend", "auto"))
    out: dict[str, Any] = {"slices": dplan.slices, "rounds_planned": dplan.rounds}
    lo, hi = dplan.slices[rank]
    errs = []
    device = torch.device(case.get("device", "cpu"))
    for step, batch in enumerate(case.get("batches", [3])):
        vals, grad, ex = make_step(pats, case["seed"] * 7 + step, batch, dtype, case.get("shared", "none"),
                                   case.get("extra", "none"))
        ref = reference_backward(pats, vals, grad, ex)
        on = [v.to(device) for v in vals]
        ex_on = None if ex is None else [None if e is None else e.to(device) for e in ex]
        res = sd.backward(dplan, on[lo:hi], grad.to(device) if rank == p - 1 else None, group=group,
                          extra=local_extra(ex_on, lo, hi, rank == p - 1), timeout=60)
        assert all(t.device.type == device.type for t in res), [t.device for t in res]
        assert len(res) == hi - lo + 1 and res.start == lo and res.stop == hi + 1
        for k, t in enumerate(res):
            assert tuple(t.shape) == (batch, dplan.dims[lo + k]), (k, t.shape)
        errs.append(rel_error([t.cpu() for t in res], ref[lo: hi + 1]))
        st = res.stats
        out.setdefault("stats", []).append(dict(
            rounds=list(st.rounds), participating=dplan.participating_rounds(rank),
            messages_sent=st.messages_sent, messages_received=st.messages_received,
            bytes_sent=st.bytes_sent, bytes_received=st.bytes_received,
            planned_sent=st.planned_bytes_sent, planned_received=st.planned_bytes_received,
            collectives=st.collectives, log=list(st.log)))
    out["error"] = max(errs)
    return out


def run_cases(rank: int, p: int, cases: list) -> list:
    return [run_case(rank, p, c) for c in cases]


def run_cases_and_subgroups(rank: int, p: int, cases: list) -> dict:
    """The cases on the whole group, then on sub-groups (``group=`` with non-identity rank maps)."""
    out = {"world": run_cases(rank, p, cases)}
    # every rank must create every group, in the same order
    solo = dist.new_group([p - 1])
    tail = dist.new_group(list(range(1, p)))
    sub = {}
    if rank == p - 1:
        sub["solo"] = run_case(0, 1, dict(kind="sparse", n=4, seed=3, extra="all"), group=solo)
    if rank >= 1 and p - 1 >= 2:
        sub["tail"] = run_case(rank - 1, p - 1, dict(kind="mixed", n=7, seed=4, extra="some"), group=tail)
    dist.barrier()
    out["sub"] = sub
    return out


def failure_cases(rank: int, p: int) -> list:
    """Bad input on one rank, mismatched batch sizes, then a good step on the same group."""
    pats = make_chain("sparse", 6, 11)
    dplan = sd.plan(pats, p)
    lo, hi = dplan.slices[rank]
    vals, grad, _ = make_step(pats, 5, 2, torch.float64, "none", "none")
    report = []

    def attempt(local_vals, g, extra=None):
        t0 = time.monotonic()
        try:
            sd.backward(dplan, local_vals, g, extra=extra, timeout=20)
            report.append(("ok", "", time.monotonic() - t0))
        except Exception as exc:  # the parent checks the type and message per rank
            report.append((type(exc).__name__, str(exc), time.monotonic() - t0))

    mine = vals[lo:hi]
    g = grad if rank == p - 1 else None
    # 1. rank 1 passes values with the wrong nnz
    bad = [v[:, :-1] if rank == 1 and i == 0 else v for i, v in enumerate(mine)]
    attempt(bad, g)
    # 2. rank 0 passes a batch of 3 while the gradient has 2
    if rank == 0:
        mine3 = [torch.cat([v, v[:1]]) for v in mine]
        attempt(mine3, g)
    else:
        attempt(mine, g)
    # 3. a good step still works afterwards
    attempt(mine, g)
    ref = reference_backward(pats, vals, grad)
    res = sd.backward(dplan, mine, g)
    report.append(("error", str(rel_error(res, ref[lo: hi + 1])), 0.0))
    return report


def crash_before_backward(rank: int, p: int) -> tuple:
    """The last rank dies before communicating; the others must raise, not hang."""
    pats = make_chain("sparse", 4, 2)
    dplan = sd.plan(pats, p)
    lo, hi = dplan.slices[rank]
    vals, _, _ = make_step(pats, 1, 2, torch.float64, "none", "none")
    if rank == p - 1:
        raise RuntimeError("simulated failure before backward")
    t0 = time.monotonic()
    try:
        sd.backward(dplan, vals[lo:hi], None, timeout=5)
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0


def expected_rounds(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def check_comm(p: int, stats_per_rank: list, what: str) -> None:
    """Rounds are ceil(log2 p) and every byte sent is a planned value byte."""
    for step in range(len(stats_per_rank[0])):
        rows = [s[step] for s in stats_per_rank]
        total_sent = sum(s["bytes_sent"] for s in rows)
        assert total_sent == sum(s["bytes_received"] for s in rows), what
        for r, s in enumerate(rows):
            assert s["rounds"] == s["participating"], (what, r)
            assert len(s["rounds"]) <= expected_rounds(p), (what, r, s["rounds"])
            assert s["bytes_sent"] == s["planned_sent"], (what, r, s)
            assert s["bytes_received"] == s["planned_received"], (what, r, s)
            assert s["messages_sent"] <= len(s["rounds"]) and s["messages_received"] <= len(s["rounds"])
            assert s["collectives"] == 1, (what, r)
        assert max(len(s["rounds"]) for s in rows) == expected_rounds(p), what
        # the first rank only receives; the last rank (which holds the gradient) only sends
        assert rows[0]["messages_sent"] == 0 and rows[-1]["messages_received"] == 0, what
        # every rank but the first sends exactly the rounds that have a peer below it
        for r, s in enumerate(rows):
            want = sum(1 for k in range(expected_rounds(p)) if r - (1 << k) >= 0)
            assert s["messages_sent"] == want, (what, r)
