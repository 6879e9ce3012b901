"""spscan's model-parallel scan on the schedule simulator, from a real
:class:`spscan.distributed.DistributedPlan`: its slices, rounds, peers and planned composites."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from spscan.parallel.pipeline.costs import LayerCosts, Link, Overheads
from spscan.parallel.pipeline.taskgraph import StageGraph, check_pm
from spscan.parallel.pipeline.timeline import Task, Timeline, synchronous_timeline

__all__ = ["bppsa_scan"]


def _csr(pat: Any):
    import scipy.sparse as sp

    if hasattr(pat, "to_scipy"):
        return pat.to_scipy()
    return sp.csr_array(pat)


def _pairs(a, b) -> float:
    """Multiply pairs of the sparse product ``a @ b`` (``sum_k nnz(a[:, k]) nnz(b[k, :])``)."""
    a, b = a.tocsr(), b.tocsr()
    col_a = np.bincount(a.indices, minlength=a.shape[1]).astype(np.float64)
    row_b = np.diff(b.indptr).astype(np.float64)
    return float(np.dot(col_a, row_b))


def _tree_cost(pats: list) -> float:
    """Multiply pairs of the slice's pairwise reduction tree (adjacent pairs, level by level)."""
    import scipy.sparse as sp

    cur = [(_csr(q) != 0).astype(np.float64) for q in pats]
    total = 0.0
    while len(cur) > 1:
        nxt = []
        for i in range(0, len(cur) - 1, 2):
            total += _pairs(cur[i], cur[i + 1])
            c = sp.csr_array(cur[i] @ cur[i + 1])
            c.data[:] = 1.0
            nxt.append(c)
        if len(cur) % 2:
            nxt.append(cur[-1])
        cur = nxt
    return total


def bppsa_scan(dplan: Any, patterns: Sequence[Any], costs: LayerCosts, m: int, batch: int,
               pair_time: float, link: Link = Link(), element_bytes: int = 4, shared: Optional[Sequence[bool]] = None,
               matvec_time: Optional[float] = None, overheads: Optional[Overheads] = None) -> Timeline:
    """spscan's model-parallel scan as a timeline, from a real :class:`spscan.distributed.DistributedPlan`.

    Forward: the batch's ``m`` micro-batches flow through the ranks as in GPipe (``F``; the cost
    includes forming the Jacobian values). Backward, per rank ``r`` (the plan's own schedule):
    ``R`` reduces the slice to its composite (the last rank instead runs its whole slice's backward,
    ``I``, the spine), then round ``k`` (``X``) sends the partial to ``send_peer(r, k)``
    (``message_numel`` elements, ``link`` time) and composes the one from ``recv_peer(r, k)``; then
    the rank applies the received pieces to get its boundary gradient and finishes its slice (``I``),
    then its weight gradients (``W``).

    Args:
        dplan: the distributed plan (``world_size = p``); ``patterns``: the ``n`` patterns it was made from.
        costs: per-layer costs of one micro-batch (``I``/``W`` of the finish and the spine are ``m``
            times these).
        m, batch: micro-batches of the forward and the batch size ``B`` of the whole scan.
        pair_time: time per multiply pair of a composite product per sample (``× B`` for per-sample values).
        matvec_time: time per nonzero of a matrix-vector product per sample (default ``pair_time``).
        shared: per rank, every layer of the rank has batch-shared values ``(nnz,)`` (default all False).
        link: with ``blocking=True`` a sender is busy for each message's link time (its ``F`` or ``X``).
        overheads: the runtime's costs outside the compute (:class:`Overheads`; per action and per step).
    """
    p = dplan.world_size
    if len(patterns) != costs.n:
        raise ValueError(f"patterns: expected {costs.n} (one per layer of costs), got {len(patterns)}")
    if dplan.bounds[-1] != costs.n:
        raise ValueError(f"dplan: covers n={dplan.bounds[-1]} layers, costs has {costs.n}")
    check_pm(costs, p, m)
    shared = list(shared) if shared is not None else [False] * p
    has_extra = [False] * p
    mv = pair_time if matvec_time is None else matvec_time
    bounds = list(dplan.bounds)
    g = StageGraph(costs, bounds, list(range(p)), link, split_w=True)
    # forward: GPipe's forward phase over m micro-batches
    for j in range(m):
        for s in range(p):
            i = g.add("F", s, j, (0, j))
            if s > 0:
                # a blocking send ends with the delivery: the sender's F already holds the link time
                g.tasks[i].deps.append((g.ids["F", s - 1, j], 0.0 if link.blocking else g.delay(s - 1, s, bounds[s])))
            if s < p - 1 and link.blocking:
                g.tasks[i].duration += g.delay(s, s + 1, bounds[s + 1])
    tasks = g.tasks
    last = p - 1
    mult = lambda r: 1.0 if shared[r] else float(batch)  # noqa: E731
    msg_bytes = {}
    state: dict[tuple[int, int], int] = {}  # (rank, k): task after which the rank's partial before round k exists
    act_total = [g.cA[s] * m for s in range(p)]
    for r in range(p):
        lo, hi = bounds[r], bounds[r + 1]
        lastF = g.ids["F", r, m - 1]
        if r == last:
            dur = m * g.cI[r]
            kind = "I"
        elif dplan.send_peer(r, 0) is not None:
            dur = _tree_cost(list(patterns[lo:hi])) * pair_time * mult(r)
            kind = "R"
        else:
            dur, kind = 0.0, "R"
        tasks.append(Task(r, r, kind, None, (lo + 1, hi), dur, (1, 0), [(lastF, 0.0)]))
        state[r, 0] = len(tasks) - 1
    for k in range(dplan.rounds):
        for r in range(p):
            src = dplan.recv_peer(r, k)
            dst = dplan.send_peer(r, k)
            deps = [(state[r, k], 0.0)]
            dur = 0.0
            if dst is not None and link.blocking:
                dur += link.time(dplan.message_numel(r, k, batch, shared, has_extra) * element_bytes)
            if src is not None:
                nbytes = dplan.message_numel(src, k, batch, shared, has_extra) * element_bytes
                msg_bytes[src, k] = nbytes
                deps.append((state[src, k], link.time(nbytes)))
                own = dplan.partial_pattern(r, k) if dst is not None or dplan.send_peer(r, k + 1) is not None else None
                got = dplan.partial_pattern(src, k)
                if k + 1 < dplan.rounds and dplan.send_peer(r, k + 1) is not None and own is not None:
                    first, lastr = dplan.partial_range(src, k)
                    mu = 1.0 if all(shared[first: lastr + 1]) and shared[r] else float(batch)
                    if got is not None:
                        dur += _pairs(_csr(own), _csr(got)) * pair_time * mu
                    dur += own.nnz * mv * float(batch)
            tasks.append(Task(r, r, "X", None, (bounds[r] + 1, bounds[r + 1]), dur, (2, k), deps, round=k))
            state[r, k + 1] = len(tasks) - 1
    for r in range(p):
        lo, hi = bounds[r], bounds[r + 1]
        prev = state[r, dplan.rounds]
        if r != last:
            apply = 0.0
            for k in range(dplan.rounds):
                src = dplan.recv_peer(r, k)
                if src is not None and dplan.partial_pattern(src, k) is not None:
                    apply += dplan.partial_pattern(src, k).nnz * mv * float(batch)
            tasks.append(Task(r, r, "I", None, (lo + 1, hi), apply + m * g.cI[r], (3, 0), [(prev, 0.0)]))
            prev = len(tasks) - 1
        tasks.append(Task(r, r, "W", None, (lo + 1, hi), m * g.cW[r], (4, 0), [(prev, 0.0)]))
        w_id = len(tasks) - 1
        # the slice's Jacobian values (activations of all m micro-batches) live until its W is done
        tasks[g.ids["F", r, 0]].memory = (act_total[r], [w_id])
    sent = [sum(v for (src, _), v in msg_bytes.items() if src == r) for r in range(p)]
    return synchronous_timeline("BPPSA scan", tasks, p, m, range(p), overheads, exact=True,
                                extra={"rounds": dplan.rounds, "bytes_sent": sent, "bounds": bounds})
