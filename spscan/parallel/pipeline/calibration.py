"""The simulator's prediction of a real run's steps, calibrated only with measurements other than
the step times: isolated stage and slice costs, optimizer steps, Gloo ping-pong, the runtime's
overheads from a negligible-compute run, and the CPU share the machine's load left the ranks."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from spscan.parallel.pipeline.bppsa import bppsa_scan
from spscan.parallel.pipeline.costs import LayerCosts, Link, Overheads
from spscan.parallel.pipeline.measured import step_cpu_shares
from spscan.parallel.pipeline.mlp import MULTI_STAGE, build_mlp, chain_patterns, dims_at, stage_key
from spscan.parallel.pipeline.probes import fit_link, median
from spscan.parallel.pipeline.schedules import one_f_one_b, torch_schedule
from spscan.parallel.pipeline.timeline import Timeline

__all__ = ["calibrated_link", "calibrated_costs", "calibrated_overheads", "round_loads", "predicted_step_times",
           "explained_step_times", "busy_per_device", "predicted_timeline"]


def calibrated_link(results: Sequence[dict], blocking: bool = False) -> Link:
    """The link fitted to the ping-pong one-way times (median over ranks 0 and 1), ``latency + bytes /
    bandwidth``; ``blocking``: the blocking ``send``/``recv`` ping-pong (spscan's scan) instead of
    ``isend``/``irecv`` (torch's schedules)."""
    kind = "blocking" if blocking else "async"
    rows = [r["calibration"][kind] for r in results if r["calibration"].get(kind)]
    if not rows:
        return Link(blocking=blocking)
    sizes = rows[0].keys()
    return fit_link({int(n): median([row[n] for row in rows]) for n in sizes}, blocking=blocking)


def calibrated_costs(results: Sequence[dict], cfg: dict, method: str) -> LayerCosts:
    """Per-layer costs of one micro-batch for a torch schedule, from the isolated stage timings
    (:func:`compare`'s calibration, the runtime's own functions on every stage): each stage's ``F``,
    ``I`` and ``W`` on its last layer (stage-level schedules only use the sums), the first stage's
    ``I`` zero and its ``W`` its whole backward (torch runs nothing in the first stage's input step);
    without a split (``GPipe``, ``1F1B``, ``Interleaved1F1B``) ``I + W`` is the measured ``B``."""
    bounds = results[0]["methods"][method]["bounds"]
    stage: dict[str, dict] = {}
    for r in results:
        stage.update(r["calibration"]["stage"])
    n = bounds[-1]
    f, i_, w = np.zeros(n), np.zeros(n), np.zeros(n)
    split = method in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    for s in range(len(bounds) - 1):
        c = stage[stage_key(bounds, s)]
        last = bounds[s + 1] - 1
        f[last] = c["F"]
        if s == 0:
            w[last] = c["B"]
        elif split:
            i_[last], w[last] = c["I"], c["W"]
        else:
            # B split in the measured I : W proportion
            tot = c["I"] + c["W"]
            i_[last] = c["B"] * c["I"] / tot if tot > 0 else c["B"]
            w[last] = c["B"] - i_[last]
    model = build_mlp(cfg["dims"], cfg.get("seed", 0))
    elem = torch.empty((), dtype=cfg.get("dtype", torch.float32)).element_size()
    mb = cfg["batch"] // cfg["microbatches"]
    bb = tuple(float(mb * d * elem) for d in dims_at(model, cfg["dims"][0]))
    return LayerCosts(tuple(f), tuple(i_), tuple(w), bb[1:], bb)


def calibrated_overheads(results: Sequence[dict], method: str, floor: Optional[dict] = None) -> Overheads:
    """:class:`~spscan.parallel.pipeline.simulator.Overheads` of ``method``: per action, ``floor``'s
    (:func:`runtime_overheads` of a negligible-compute run) in-call overhead plus its per-call gap;
    per rank, ``floor``'s time to the first event before the step, and the isolated optimizer step
    (``results``' calibration) after it. Without ``floor`` only the optimizer step."""
    world = len(results)
    end = [r["calibration"]["opt"][method] for r in results]
    if floor is None:
        return Overheads(step_end=end)
    act = {k: v + floor["gap"] for k, v in floor["in_action"].items()}
    return Overheads(action=act, step_start=[float(v) for v in floor["start"][:world]], step_end=end)


def _slowed(costs: LayerCosts, ov: Overheads, factor: float) -> tuple[LayerCosts, Overheads]:
    """Compute and runtime costs ``factor`` times longer (a CPU share of ``1 / factor``)."""
    c = LayerCosts(tuple(v * factor for v in costs.forward), tuple(v * factor for v in costs.backward_input),
                   tuple(v * factor for v in costs.backward_weight), costs.activation, costs.boundary_bytes)

    def sc(v: Any) -> Any:
        return [x * factor for x in v] if isinstance(v, (list, tuple)) else v * factor

    return c, Overheads({k: v * factor for k, v in ov.action.items()}, sc(ov.step_start), sc(ov.step_end))


def round_loads(results: Sequence[dict], blocking: bool = False, probe: str = "burst") -> list[tuple[float, Link]]:
    """Per calibration round: the CPU share a computing rank got (a probe's CPU time over its wall time,
    summed over the ranks; ``probe="burst"``: short forwards between short sleeps, as a pipeline rank
    computes; ``"share"``: the calibration's long uninterrupted compute) and the link fitted to that
    round's ping-pong (median one-way times: what a message took under that round's load, the
    receiver's wake-up included)."""
    kind = "blocking" if blocking else "async"
    n = len(results[0]["calibration"]["rounds"][probe])
    out = []
    for k in range(n):
        cpu = sum(r["calibration"]["rounds"][probe][k][0] for r in results)
        wall = sum(r["calibration"]["rounds"][probe][k][1] for r in results)
        rows = [r["calibration"]["rounds"][kind][k] for r in results
                if len(r["calibration"]["rounds"][kind]) > k and r["calibration"]["rounds"][kind][k]]
        lk = fit_link({int(sz): median([row[sz] for row in rows]) for sz in rows[0]}, blocking) if rows \
            else Link(blocking=blocking)
        out.append((min(1.0, cpu / wall) if wall > 0 else 1.0, lk))
    return out


def predicted_step_times(results: Sequence[dict], cfg: dict, method: str, floor: Optional[dict] = None
                         ) -> tuple[float, np.ndarray]:
    """``(dedicated, loaded)``: the simulated step of ``method`` on a machine running nothing else
    (CPU costs, least-contended link), and one simulated step per calibration round under that
    round's measured load (:func:`round_loads`: every compute and runtime cost divided by the CPU
    share, the link as measured then). Their median predicts the median measured step."""
    dedicated = predicted_timeline(results, cfg, method, floor).step_time
    loaded = [predicted_timeline(results, cfg, method, floor, share=a, link=lk).step_time
              for a, lk in round_loads(results, blocking=method == "scan")]
    return dedicated, np.array(loaded)


def explained_step_times(results: Sequence[dict], cfg: dict, method: str, floor: Optional[dict] = None
                         ) -> np.ndarray:
    """Per timed step, the dedicated-machine simulation (:func:`predicted_timeline`) with every compute
    and runtime cost divided by the CPU share the ranks got in that step (:func:`step_cpu_shares`).
    Not an independent prediction (the share is read from the steps themselves), but no parameter is
    fitted to a step time: it tests whether the cost model plus the machine's load explain the steps."""
    return np.array([predicted_timeline(results, cfg, method, floor, share=a).step_time
                     for a in step_cpu_shares(results, method)])


def busy_per_device(tl: Timeline) -> list[float]:
    """Time each device of a simulated step spends in its actions (overheads included): on a machine
    running nothing else, the CPU time each rank's main thread spends in the step."""
    return [float(sum(a.end - a.start for a in acts)) for acts in tl.actions]


def predicted_timeline(results: Sequence[dict], cfg: dict, method: str, floor: Optional[dict] = None,
                       link: Any = True, share: float = 1.0) -> Timeline:
    """The simulator's timeline of ``method`` calibrated with measurements other than its step times:

    * compute: the isolated stage costs of :func:`calibrated_costs` (torch), or for the scan each
      slice's isolated forward (with the Jacobian values, and the loss on the last rank), local scan
      backward (as the spine's ``I`` on the last rank, as the finish's ``I`` elsewhere) and ``g^T x``
      weight gradients, all on the whole batch;
    * link (``link=True``): ``latency + bytes / bandwidth`` fitted to the ping-pong at the run's message
      sizes (the fastest of each size: the least-contended messages), overlapped for torch (``isend``/
      ``irecv``), blocking the sender for the scan (``send``); ``False``: none; a :class:`Link`: that one;
    * ``share``: the CPU share a busy rank gets (1: a core of its own); costs are divided by it;
    * ``floor``: :func:`runtime_overheads` of the same method on a negligible-compute model, the
      per-action and per-step runtime costs (without it, only the optimizer step is added).
    """
    world = len(results)
    bounds = results[0]["methods"][method]["bounds"]
    ov = calibrated_overheads(results, method, floor)
    if method == "scan":
        import spscan.distributed as D

        model = build_mlp(cfg["dims"], cfg.get("seed", 0))
        pats = chain_patterns(model)
        n = len(pats)
        f, i_, w = np.zeros(n), np.zeros(n), np.zeros(n)
        for r in results:
            sc = r["calibration"]["scan"]
            last = bounds[r["rank"] + 1] - 1
            f[last] = sc["F"] + sc["loss"]
            i_[last] = sc["I"]
            w[last] = sc["W"]
        elem = torch.empty((), dtype=cfg.get("dtype", torch.float32)).element_size()
        bb = tuple(float(cfg["batch"] * d * elem) for d in dims_at(model, cfg["dims"][0]))
        full = LayerCosts(tuple(f), tuple(i_), tuple(w), bb[1:], bb)
        dplan = D.plan(pats, world, slices=bounds)
        # composite products (p > 2): time per multiply pair from the local backward's rate
        nnz = sum(p.nnz for p in pats)
        pair_time = float(np.median([r["calibration"]["scan"]["I"] for r in results])) / max(
            1.0, nnz * cfg["batch"] / world)
        lk = link if isinstance(link, Link) else calibrated_link(results, blocking=True) if link \
            else Link(blocking=True)
        if floor is not None:
            # the scan's step is one action of each kind per rank: its overheads are per step
            ov = Overheads(action={{"S": "I"}.get(k, k): v for k, v in ov.action.items()},
                           step_start=ov.step_start, step_end=ov.step_end)
        full, ov = _slowed(full, ov, 1.0 / share)
        return bppsa_scan(dplan, pats, full, 1, cfg["batch"], pair_time, lk, element_bytes=elem, overheads=ov)
    costs, ov = _slowed(calibrated_costs(results, cfg, method), ov, 1.0 / share)
    lk = link if isinstance(link, Link) else calibrated_link(results) if link else Link()
    if method == "1F1B":
        return one_f_one_b(costs, world, cfg["microbatches"], lk, bounds=bounds, overheads=ov)
    spr = 2 if method in MULTI_STAGE else None
    return torch_schedule(method, costs, world, cfg["microbatches"], lk, stages_per_rank=spr, bounds=bounds,
                          overheads=ov)
