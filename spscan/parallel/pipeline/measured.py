"""What a real run measured, read from :func:`spscan.parallel.pipeline.realrun.compare`'s results: step
times, where each rank's step went, the CPU share the ranks got, and the runtime's costs outside
the compute (from a run of a negligible-compute model)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from spscan.parallel.pipeline.mlp import stage_key
from spscan.parallel.pipeline.probes import ACTION_LABEL, SCAN_LABEL, median

__all__ = ["step_times", "step_breakdown", "step_cpu_shares", "measured_cpu", "runtime_overheads"]


def step_times(results: Sequence[dict], method: str) -> np.ndarray:
    """Seconds of every timed step of ``method``: from the first rank's start to the last rank's end
    (all ranks read one monotonic clock)."""
    steps = [r["methods"][method]["steps"] for r in results]
    return np.array([max(s[k]["end"] for s in steps) - min(s[k]["start"] for s in steps)
                     for k in range(len(steps[0]))])


def step_breakdown(results: Sequence[dict], method: str) -> list[dict]:
    """Per rank, medians over the timed steps of where the rank's step time went (seconds):
    ``compute`` (the schedule's F/B/I/W calls, or the scan step's forward, scan and weight phases),
    ``wait`` (blocked on a receive), ``post`` (posting sends and receives), ``loss``, ``opt``, ``other``
    (the rest: the runtime between the calls), ``cpu`` (the main thread's CPU time) and ``run_wait``
    (time it was ready to run but waited for a core), plus ``actions``: calls per step."""
    out = []
    for r in results:
        rows = []
        for st in r["methods"][method]["steps"]:
            acc = {"compute": 0.0, "wait": 0.0, "post": 0.0, "loss": 0.0, "opt": 0.0, "send": 0.0, "actions": 0}
            for label, t0, t1, *_ in st["events"]:
                if ACTION_LABEL.match(label) or SCAN_LABEL.match(label):
                    acc["compute"] += t1 - t0
                    acc["actions"] += 1
                elif label in acc:
                    acc[label] += t1 - t0
            acc["wall"] = st["end"] - st["start"]
            acc["other"] = acc["wall"] - sum(acc[k] for k in ("compute", "wait", "post", "loss", "opt", "send"))
            acc["cpu"] = st["cpu"] if st["cpu"] is not None else float("nan")
            acc["run_wait"] = st["run_wait"] if st["run_wait"] is not None else float("nan")
            rows.append(acc)
        out.append({k: median([row[k] for row in rows]) for k in rows[0]} if rows else {})
    return out


def step_cpu_shares(results: Sequence[dict], method: str) -> np.ndarray:
    """Per timed step of ``method``, the CPU share its ranks got: the mean over the ranks of the main
    thread's CPU time over its CPU time plus its run-queue wait in that step (1: never waited for a
    core). Read from the scheduler's counters, not from the step times."""
    steps = [r["methods"][method]["steps"] for r in results]
    out = []
    for k in range(len(steps[0])):
        sh = [s[k]["cpu"] / (s[k]["cpu"] + s[k]["run_wait"]) for s in steps
              if s[k]["cpu"] is not None and s[k]["run_wait"] is not None and s[k]["cpu"] > 0]
        out.append(float(np.mean(sh)) if sh else 1.0)
    return np.array(out)


def measured_cpu(results: Sequence[dict], method: str) -> list[float]:
    """Per rank, the median over the timed steps of its main thread's CPU seconds in the step."""
    return [median([s["cpu"] for s in r["methods"][method]["steps"] if s["cpu"] is not None]) for r in results]


def runtime_overheads(results: Sequence[dict], method: str) -> dict:
    """The runtime's costs outside the compute, in CPU seconds of each rank's main thread, from a run
    of a model so narrow that its compute is negligible (e.g. 8 wide), per call of its trace (never
    from step times):

    * ``in_action[kind]``: over the calls of kind ``F``/``B``/``I``/``W``, the call's CPU time minus the
      same stage's isolated cost in that run's calibration (torch's bookkeeping inside the call); for
      the scan ``F``/``S``/``W`` (forward, distributed backward, weight phase);
    * ``gap``: per call, the rank's CPU time in the step outside every traced call but the message
      posts, divided by its calls (the schedule executor between the calls, posting messages);
    * ``start``: per rank, its CPU time from the step's start to its first traced call.

    Each is the median over a rank's steps (and calls), then (but ``start``) the median over the ranks.
    """
    per_rank: list[dict[str, float]] = []
    gaps, starts = [], []
    for r in results:
        kinds: dict[str, list[float]] = {}
        cal = r["calibration"]
        bounds = r["methods"][method]["bounds"]
        g_r, s_r = [], []
        for st in r["methods"][method]["steps"]:
            ev = sorted(st["events"], key=lambda e: e[1])
            n_act, traced = 0, 0.0
            for label, t0, t1, cpu, _ in ev:
                m_ = ACTION_LABEL.match(label)
                if m_:
                    stage, kind = int(m_.group(1)), m_.group(2)
                    iso = cal["stage"].get(stage_key(bounds, stage), {})
                    base = iso.get("B" if kind == "W" and stage == 0 else kind, 0.0)
                    kinds.setdefault(kind, []).append(max(0.0, cpu - base))
                    n_act += 1
                    traced += cpu
                elif SCAN_LABEL.match(label):
                    kind = label[-1]
                    base = cal["scan"].get({"S": "I"}.get(kind, kind), 0.0)
                    kinds.setdefault(kind, []).append(max(0.0, cpu - base))
                    n_act += 1
                    traced += cpu
                elif label != "post":
                    traced += cpu
            first = ev[0][4] - st["cpu_start"] if ev else 0.0
            s_r.append(max(0.0, first))
            if n_act and st["cpu"] is not None:
                g_r.append(max(0.0, st["cpu"] - traced - first) / n_act)
        gaps.append(median(g_r))
        starts.append(median(s_r))
        per_rank.append({k: median(v) for k, v in kinds.items()})
    in_action = {k: median([d[k] for d in per_rank if k in d]) for k in sorted({k for d in per_rank for k in d})}
    return {"in_action": in_action, "gap": median(gaps), "start": starts}
