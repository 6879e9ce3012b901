"""Pipeline schedules on the simulator: synchronous ones with a flush (GPipe, out-of-order
pipelines, 1F1B, zero-bubble), asynchronous ones (PipeDream, DualPipe with or without SpecTrain),
and any schedule ``torch.distributed.pipelining`` ships, from its own per-rank action lists."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from spscan.parallel.pipeline.costs import LayerCosts, Link, Overheads
from spscan.parallel.pipeline.taskgraph import LayerGraph, StageGraph, check_pm, contiguous_bounds, layers_placement
from spscan.parallel.pipeline.timeline import (
    Action, Task, Timeline, bubble_fraction, list_schedule, synchronous_timeline, timeline_measures,
)

__all__ = ["gpipe", "one_f_one_b", "zero_bubble", "ooo_pipe", "pipedream", "dualpipe", "torch_schedule", "SCHEDULES"]


# ----------------------------------------------------------------------------- synchronous, per layer


def _flush_schedule(name: str, costs: LayerCosts, p: int, m: int, link: Link, modulo: bool, fast_forward: bool,
                    bounds: Optional[Sequence[int]], flush: bool = True, overheads: Optional[Overheads] = None
                    ) -> Timeline:
    device_of, stage_of, _ = layers_placement(costs, p, modulo, bounds)
    g = LayerGraph(costs, m, device_of, stage_of, link)
    n = costs.n
    for j in range(m):
        for l in range(1, n + 1):
            if fast_forward:
                # critical path first: input (output-) gradients, then forwards; weight gradients
                # fill the idle time
                g.tasks[g.F[l, j]].key = (1, j, l)
                g.tasks[g.I[l, j]].key = (0, j, -l)
                g.tasks[g.W[l, j]].key = (2, j, -l)
            else:
                g.tasks[g.F[l, j]].key = (0, j, l)
                # conventional backprop of one layer: weight gradient, then output gradient
                g.tasks[g.W[l, j]].key = (1, j, -l, 0)
                g.tasks[g.I[l, j]].key = (1, j, -l, 1)
    if flush:
        # GPipe: a device starts backward work only once its forwards are all done
        for d in sorted(set(device_of)):
            g.tasks.append(Task(d, -1, "-", None, (0, 0), 0.0, (0, m, 0),
                                [(g.F[l, j], 0.0) for j in range(m) for l in range(1, n + 1) if device_of[l - 1] == d]))
            barrier = len(g.tasks) - 1
            for j in range(m):
                for l in range(1, n + 1):
                    if device_of[l - 1] == d:
                        g.tasks[g.I[l, j]].deps.append((barrier, 0.0))
                        g.tasks[g.W[l, j]].deps.append((barrier, 0.0))
    return synchronous_timeline(name, g.tasks, p, m, sorted(set(stage_of)), overheads, exact=True,
                                extra={"placement": device_of})


def gpipe(costs: LayerCosts, p: int, m: int, link: Link = Link(), bounds: Optional[Sequence[int]] = None,
          overheads: Optional[Overheads] = None) -> Timeline:
    """GPipe: every device runs all its forwards, then conventional backprop per micro-batch
    (per layer ``W`` then ``I``, as the out-of-order paper's baseline), then the step ends (flush).
    ``overheads``: runtime costs outside the compute (:class:`Overheads`; per-layer actions here)."""
    check_pm(costs, p, m)
    return _flush_schedule("GPipe", costs, p, m, link, False, False, bounds, overheads=overheads)


def ooo_pipe(costs: LayerCosts, p: int, m: int, link: Link = Link(), modulo: bool = False,
             bounds: Optional[Sequence[int]] = None, flush: Optional[bool] = None) -> Timeline:
    """Out-of-order pipeline (OOO-Pipe1; OOO-Pipe2 with ``modulo=True``), synchronous (one update per step).

    Every device runs, among its ready tasks, input gradients ``I`` first (gradient
    fast-forwarding: the critical path), then forwards, and fills its idle time with weight
    gradients ``W``. ``modulo`` places layer ``l`` on device ``(l-1) mod p`` (the paper's
    ``GPU_{l mod p}``). ``flush``: keep GPipe's phase order on every device (all its forwards before
    any backward work); default ``True`` for OOO-Pipe1 (GPipe with fast-forwarding) and ``False``
    for OOO-Pipe2, whose micro-batches start their backward as soon as their gradient arrives
    (the forward stall modulo allocation removes). With the out-of-order paper's unit costs
    (16 layers, 4 devices, 4 micro-batches) these defaults reproduce its speedups over GPipe
    (``tests/test_pipeline_sim.py``); OOO-Pipe2 with ``flush=True`` keeps most of its gain.
    """
    check_pm(costs, p, m)
    flush = (not modulo) if flush is None else bool(flush)
    return _flush_schedule("OOO-Pipe2" if modulo else "OOO-Pipe1", costs, p, m, link, modulo, True, bounds, flush)


# ----------------------------------------------------------------------------- synchronous, per stage


def _one_f_one_b_order(s: int, p: int, m: int, first: int, warmup: int, bkind: str) -> list[tuple[str, int, int]]:
    order: list[tuple[str, int, int]] = []
    warm = min(m, warmup)
    for j in range(warm):
        order.append(("F", s, first + j))
    nf = warm
    for j in range(m):
        order.append((bkind, s, first + j))
        if nf < m:
            order.append(("F", s, first + nf))
            nf += 1
    return order


def _one_f_one_b_graph(costs: LayerCosts, p: int, m: int, link: Link, bounds: Optional[Sequence[int]],
                       split_w: bool) -> StageGraph:
    """Stage tasks of ``m`` micro-batches in 1F1B order: stage ``s`` runs ``p - s`` warm-up forwards,
    then one backward (its ``I`` alone with ``split_w``) and one forward in turn; a split ``W`` runs
    when its device has nothing else ready."""
    _, _, b = layers_placement(costs, p, False, bounds)
    g = StageGraph(costs, b, list(range(p)), link, split_w=split_w)
    g.build(m)
    for s in range(p):
        g.chain(_one_f_one_b_order(s, p, m, 0, p - s, "I" if split_w else "B"))
        if split_w:
            for j in range(m):
                g.tasks[g.ids["W", s, j]].key = (1, j)
    return g


def one_f_one_b(costs: LayerCosts, p: int, m: int, link: Link = Link(), bounds: Optional[Sequence[int]] = None,
                overheads: Optional[Overheads] = None) -> Timeline:
    """Synchronous 1F1B with flush (PipeDream-flush; ``torch`` ``Schedule1F1B``): stage ``s`` runs
    ``p - s`` warm-up forwards, then alternates one backward and one forward, then drains.
    ``overheads``: runtime costs outside the compute (:class:`Overheads`)."""
    check_pm(costs, p, m)
    g = _one_f_one_b_graph(costs, p, m, link, bounds, split_w=False)
    return synchronous_timeline("1F1B", g.tasks, p, m, range(p), overheads)


def zero_bubble(costs: LayerCosts, p: int, m: int, link: Link = Link(), bounds: Optional[Sequence[int]] = None,
                overheads: Optional[Overheads] = None) -> Timeline:
    """Zero-bubble-style B/W split (ZB-H1-like): 1F1B's order of ``F`` and ``I`` (input gradient only,
    so the gradient reaches the previous stage sooner) with every ``W`` deferred: a device runs a
    ready ``W`` only when its next ``F``/``I`` is not ready, and the rest after its last ``I``."""
    check_pm(costs, p, m)
    g = _one_f_one_b_graph(costs, p, m, link, bounds, split_w=True)
    return synchronous_timeline("ZB-H1", g.tasks, p, m, range(p), overheads)


# ----------------------------------------------------------------------------- asynchronous pipelines


def _staleness_from_updates(update_end: dict[int, list[float]], uses: dict[tuple[int, int], tuple[float, float]]
                            ) -> dict[tuple[int, int], tuple[int, int]]:
    """Missing updates: for task times ``(tf, tb)`` of micro-batch ``j`` at stage ``s``, sequential SGD
    would have applied the updates of micro-batches ``0..j-1``; count those not done by then."""
    out = {}
    for (j, s), (tf, tb) in uses.items():
        ends = update_end[s]
        seen_f = sum(1 for jj in range(j) if ends[jj] <= tf + 1e-9)
        seen_b = sum(1 for jj in range(j) if ends[jj] <= tb + 1e-9)
        out[j, s] = (j - seen_f, j - seen_b)
    return out


def _steady(acts_end: dict[int, float], m: int, total: int) -> tuple[float, tuple[float, float]]:
    """Steady-state time per ``m`` micro-batches, measured between two completions in the middle."""
    j0 = max(0, total // 2 - m // 2)
    j1 = min(total - 1, j0 + m)
    if j1 == j0:
        return acts_end[total - 1], (0.0, acts_end[total - 1])
    period = (acts_end[j1] - acts_end[j0]) * m / (j1 - j0)
    return period, (acts_end[j0], acts_end[j1])


def pipedream(costs: LayerCosts, p: int, m: int, link: Link = Link(), bounds: Optional[Sequence[int]] = None,
              total: Optional[int] = None) -> Timeline:
    """PipeDream (asynchronous 1F1B, weight stashing): no flush, every micro-batch is an optimizer
    step at each stage (update at the end of its backward there); stage ``s`` keeps ``p - s``
    micro-batches in flight and a micro-batch's backward uses the weights its forward used.

    ``total`` micro-batches are simulated (default ``2 (p + m)``); ``step_time`` and the bubble are
    the steady-state values per ``m`` micro-batches.
    """
    check_pm(costs, p, m)
    total = total if total is not None else 2 * (p + m)
    g = _one_f_one_b_graph(costs, p, total, link, bounds, split_w=False)
    start, end = list_schedule(g.tasks, p)
    done0 = {j: float(end[g.ids["B", 0, j]]) for j in range(total)}
    period, window = _steady(done0, m, total)
    acts, _, bubble, peaks = timeline_measures(g.tasks, start, end, p, window)
    upd = {s: [float(end[g.ids["B", s, j]]) for j in range(total)] for s in range(p)}
    uses = {}
    for j in range(total):
        for s in range(p):
            tf = float(start[g.ids["F", s, j]])
            uses[j, s] = (tf, tf)  # weight stashing: the backward uses the forward's version
    stale = _staleness_from_updates(upd, uses)
    return Timeline("PipeDream", p, m, acts, period, bubble, peaks, stale, exact=False,
                    extra={"total_microbatches": total, "window": window})


def dualpipe(costs: LayerCosts, p: int, m: int, link: Link = Link(), bounds: Optional[Sequence[int]] = None,
             spectrain: bool = False, overlap: float = 0.0, total: Optional[int] = None,
             last_stage_sequential: bool = True) -> Timeline:
    """DualPipe (weight-prediction paper, Alg. 1): in pipeline time unit ``t`` stage ``k`` runs the
    forward of batch ``t - k`` and the backward of batch ``t - (2p - 2 - k)``; all devices
    synchronize at the end of the unit and then apply the buffered gradient (one update per unit).

    A unit lasts the slowest stage's ``F`` and ``B``: concurrent on one device they take
    ``max(F, B) + (1 - overlap) min(F, B)`` (``overlap = 1``: the paper's idealization that the two
    fully share the device), plus one link time. The last stage runs its two tasks in sequence
    (``F + B``) unless ``last_stage_sequential=False`` (Figure 6's picture of one forward and one
    backward per unit on every device).
    With ``spectrain`` the timeline also carries SpecTrain's version differences
    (``s = 2p - k - 2`` forward, ``s = k`` backward, eqs. 5-6), measured from the timeline as the units
    between a task and its batch's round-trip end.
    """
    check_pm(costs, p, m)
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap: expected a fraction in [0, 1], got {overlap!r}")
    _, _, b = layers_placement(costs, p, False, bounds)
    g = StageGraph(costs, b, list(range(p)), link, split_w=False)
    total = total if total is not None else 2 * (p + m)
    units = total + 2 * p - 2
    t = 0.0
    acts: list[list[Action]] = [[] for _ in range(p)]
    unit_start, f_unit, b_unit = [], {}, {}
    mem_ev: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    f_time, b_time = {}, {}
    for u in range(units):
        unit_start.append(t)
        longest = 0.0
        for k in range(p):
            jf, jb = u - k, u - (2 * p - 2 - k)
            df = g.cF[k] if 0 <= jf < total else 0.0
            db = g.cI[k] + g.cW[k] if 0 <= jb < total else 0.0
            if k == p - 1 and last_stage_sequential:
                dur, b_off = df + db, df
            else:
                dur, b_off = max(df, db) + (1.0 - overlap) * min(df, db), (1.0 - overlap) * df
            longest = max(longest, dur)
            layers = (b[k] + 1, b[k + 1])
            if df:
                acts[k].append(Action(k, k, "F", jf, layers, t, t + df))
            if 0 <= jf < total:
                f_unit[jf, k], f_time[jf, k] = u, t
                mem_ev[k].append((t, g.cA[k]))
            if db:
                acts[k].append(Action(k, k, "B", jb, layers, t + b_off, t + b_off + db))
            if 0 <= jb < total:
                b_unit[jb, k], b_time[jb, k] = u, t + b_off
                mem_ev[k].append((t + b_off + db, -g.cA[k]))
        link_t = link.time(max(costs.boundary_bytes[x] for x in b[1:-1])) if p > 1 else 0.0
        t += longest + link_t
    unit_start.append(t)
    for a in acts:
        a.sort(key=lambda x: (x.start, x.end))
    done0 = {j: unit_start[b_unit[j, 0] + 1] for j in range(total)}
    period, window = _steady(done0, m, total)
    bubble = bubble_fraction(acts, *window)
    peaks = []
    for k in range(p):
        cur = pk = 0.0
        for _, amt in sorted(mem_ev[k], key=lambda e: (e[0], e[1] > 0)):
            cur += amt
            pk = max(pk, cur)
        peaks.append(pk)
    # updates of stage k's weights land at the end of the unit of each backward there
    upd = {k: [unit_start[b_unit[j, k] + 1] for j in range(total)] for k in range(p)}
    stale = _staleness_from_updates(upd, {(j, k): (f_time[j, k], b_time[j, k]) for j in range(total) for k in range(p)})
    vd: dict[tuple[int, str], int] = {}
    if spectrain:
        j = total // 2
        for k in range(p):
            end_unit = b_unit[j, 0]
            vd[k, "F"] = end_unit - f_unit[j, k]
            vd[k, "B"] = end_unit - b_unit[j, k]
    name = "DualPipe+SpecTrain" if spectrain else "DualPipe"
    return Timeline(name, p, m, acts, period, bubble, peaks, stale, vd, exact=False,
                    extra={"total_microbatches": total, "window": window, "unit_start": unit_start,
                           "forward_unit": f_unit, "backward_unit": b_unit, "predicted": spectrain,
                           "dual_issue": overlap > 0})


# ----------------------------------------------------------------------------- torch's own schedules


def _torch_actions(name: str, p: int, m: int, stages_per_rank: Optional[int]) -> list[list[tuple[str, int, int]]]:
    """Per rank, torch's compute actions of schedule ``name`` as ``(kind, stage, microbatch)``, in order."""
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    except ImportError as exc:  # older torch
        raise ValueError(f"torch_schedule: this torch has no schedule action lists ({exc})") from exc
    ops = get_schedule_ops(name, p, m, stages_per_rank)
    actions = []
    for rank_ops in ops:
        flat = []
        for a in rank_ops:
            if a is None:
                continue
            subs = a.sub_actions if a.sub_actions is not None else (a,)
            for x in subs:
                kind = x.computation_type.value
                if kind in ("F", "I", "W", "B"):
                    flat.append((kind, x.stage_index, x.microbatch_index))
        actions.append(flat)
    return actions


def torch_schedule(name: str, costs: LayerCosts, p: int, m: int, link: Link = Link(),
                   stages_per_rank: Optional[int] = None, bounds: Optional[Sequence[int]] = None,
                   overheads: Optional[Overheads] = None) -> Timeline:
    """Simulate a schedule of ``torch.distributed.pipelining`` from its own per-rank action lists.

    ``name`` is what ``torch.distributed.pipelining.schedules.get_schedule_class`` accepts (e.g.
    ``"GPipe"``, ``"Interleaved1F1B"``, ``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``,
    ``"DualPipeV"``). Multi-stage schedules place stage ``s`` on the rank whose list runs it; the
    layers are cut into ``p * stages_per_rank`` stages. Each rank runs its compute actions strictly
    in torch's order (``OVERLAP_F_B`` runs its two sub-actions back to back). ``overheads``: the
    runtime's costs outside the compute (:class:`Overheads`: per action, per step).
    """
    check_pm(costs, p, m)
    actions = _torch_actions(name, p, m, stages_per_rank)
    S = 1 + max(s for r in actions for _, s, _ in r)
    if S > costs.n:
        raise ValueError(f"torch_schedule({name!r}): {S} stages need at least {S} layers, costs has {costs.n}")
    dev_of = [-1] * S
    for r, flat in enumerate(actions):
        for _, s, _ in flat:
            dev_of[s] = r
    b = list(bounds) if bounds is not None else contiguous_bounds(costs, S)
    split = any(k in ("I", "W") for r in actions for k, _, _ in r)
    g = StageGraph(costs, b, dev_of, link, split_w=split)
    g.build(m)
    for r, flat in enumerate(actions):
        order = [(k if k != "B" or not split else "B", s, j) for k, s, j in flat]
        if split:
            # a full backward in a split schedule: run its I and W back to back
            exp = []
            for k, s, j in order:
                exp.extend([("I", s, j), ("W", s, j)] if k == "B" else [(k, s, j)])
            order = exp
        g.chain(order)
    return synchronous_timeline(name, g.tasks, p, m, range(S), overheads,
                                extra={"stages": S, "stage_device": dev_of,
                                       "torch_order": [[f"{s}{k}{j}" for k, s, j in r] for r in actions]})


SCHEDULES: dict[str, Callable[..., Timeline]] = {
    "GPipe": gpipe,
    "1F1B": one_f_one_b,
    "ZB-H1": zero_bubble,
    "OOO-Pipe1": lambda c, p, m, link=Link(), **kw: ooo_pipe(c, p, m, link, modulo=False, **kw),
    "OOO-Pipe2": lambda c, p, m, link=Link(), **kw: ooo_pipe(c, p, m, link, modulo=True, **kw),
    "PipeDream": pipedream,
    "DualPipe": dualpipe,
    "DualPipe+SpecTrain": lambda c, p, m, link=Link(), **kw: dualpipe(c, p, m, link, spectrain=True, **kw),
}
