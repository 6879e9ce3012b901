"""The event simulator under every schedule: tasks, the list scheduler that runs them, and the
:class:`Timeline` it yields (actions, step time, bubble, peak activations, staleness).

:func:`list_schedule` runs non-preemptive devices, each picking its ready task of smallest priority
key; a dependency waits its delay (the link time between devices). Ties are broken by task
creation order, so every run is deterministic.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from spscan.parallel.pipeline.costs import Overheads

__all__ = ["Action", "Timeline", "Task", "list_schedule"]


@dataclass(frozen=True)
class Action:
    """One task as run: ``str(action)`` is torch's form ``"{stage}{kind}{microbatch}"`` (e.g. ``"1F0"``).

    ``kind``: ``F`` forward, ``I`` input gradient, ``W`` weight gradient, ``B`` both, ``R`` slice
    reduction (scan), ``X`` scan round ``round``. ``layers``: the 1-based layers ``(first, last)`` it covers.
    """

    device: int
    stage: int
    kind: str
    microbatch: Optional[int]
    layers: tuple[int, int]
    start: float
    end: float
    round: Optional[int] = None

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        rk = "" if self.round is None else str(self.round)
        return f"{self.stage}{self.kind}{rk}{mb}"


@dataclass
class Timeline:
    """Result of one simulated schedule.

    Attributes:
        schedule: its name.
        devices, microbatches: ``p`` and ``m``.
        actions: per device, its actions in start order.
        step_time: time of one training step of ``m`` micro-batches (asynchronous schedules: the
            steady-state time per ``m`` micro-batches).
        bubble_fraction: idle share of ``devices * step_time`` (over the steady window when asynchronous).
        peak_activations: per device, the largest activation memory held at once.
        staleness: ``(microbatch, stage) -> (forward, backward)``: weight updates of that stage that
            sequential SGD (one update per micro-batch) would have applied before this micro-batch
            but that the task's weights miss. All zero for synchronous schedules.
        version_difference: SpecTrain's ``s`` per ``(stage, "F"|"B")`` where the schedule predicts weights.
        exact: the step computes exactly the gradients of synchronous SGD.
        extra: schedule-specific numbers (message bytes, composite sizes, ...).
    """

    schedule: str
    devices: int
    microbatches: int
    actions: list[list[Action]]
    step_time: float
    bubble_fraction: float
    peak_activations: list[float]
    staleness: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    version_difference: dict[tuple[int, str], int] = field(default_factory=dict)
    exact: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def max_staleness(self) -> int:
        return max((max(v) for v in self.staleness.values()), default=0)

    def order(self, device: int) -> list[str]:
        """The device's actions in torch's string form, e.g. ``["0F0", "0F1", "0B0", ...]``."""
        return [str(a) for a in self.actions[device]]

    def summary(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "p": self.devices, "m": self.microbatches, "step_time": self.step_time,
                "bubble": self.bubble_fraction, "peak_activations": max(self.peak_activations, default=0.0),
                "max_staleness": self.max_staleness, "exact": self.exact}


@dataclass
class Task:
    """A unit of work for :func:`list_schedule`.

    ``deps``: ``(task index, delay)``: this task may start ``delay`` after that task ends.
    ``key``: priority on its device (smallest first among ready tasks).
    ``memory``: ``(amount, free_after)``: ``amount`` is held from this task's start until the last
    end of the tasks ``free_after`` (indices), for the peak-memory count. Kind ``"-"`` marks an
    internal zero-time task (a barrier), not shown as an action.
    """

    device: int
    stage: int
    kind: str
    microbatch: Optional[int]
    layers: tuple[int, int]
    duration: float
    key: tuple
    deps: list[tuple[int, float]] = field(default_factory=list)
    memory: Optional[tuple[float, list[int]]] = None
    round: Optional[int] = None


def list_schedule(tasks: Sequence[Task], devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Run ``tasks`` on ``devices`` non-preemptive devices; returns ``(start, end)`` per task.

    At every time a device is free it starts, among its tasks whose dependencies are met (delays
    included), the one with the smallest ``(key, index)``. Raises ``ValueError`` on a cycle or a
    dependency on an unknown task.
    """
    nt = len(tasks)
    start = np.full(nt, np.nan)
    end = np.full(nt, np.nan)
    waiting = np.zeros(nt, dtype=np.int64)
    dependents: list[list[int]] = [[] for _ in range(nt)]
    for i, t in enumerate(tasks):
        if not 0 <= t.device < devices:
            raise ValueError(f"task {i} ({t.stage}{t.kind}{t.microbatch}): device {t.device} not in [0, {devices})")
        for d, _ in t.deps:
            if not 0 <= d < nt:
                raise ValueError(f"task {i}: dependency on unknown task {d}")
            dependents[d].append(i)
        waiting[i] = len(t.deps)
    ready_at = np.zeros(nt)
    future: list[tuple[float, int]] = [(0.0, i) for i in range(nt) if waiting[i] == 0]
    heapq.heapify(future)
    avail: list[list[tuple[tuple, int]]] = [[] for _ in range(devices)]
    free = [0.0] * devices
    done = 0
    now = 0.0
    eps = 1e-12
    while done < nt:
        while future and future[0][0] <= now + eps:
            _, i = heapq.heappop(future)
            heapq.heappush(avail[tasks[i].device], (tasks[i].key, i))
        progressed = False
        for d in range(devices):
            if free[d] <= now + eps and avail[d]:
                _, i = heapq.heappop(avail[d])
                t = tasks[i]
                start[i], end[i] = now, now + t.duration
                free[d] = end[i]
                done += 1
                progressed = True
                for j in dependents[i]:
                    waiting[j] -= 1
                    if waiting[j] == 0:
                        ready_at[j] = max((end[k] + delay for k, delay in tasks[j].deps), default=0.0)
                        heapq.heappush(future, (max(ready_at[j], now), j))
        if progressed:
            continue
        nxt = [f for f in free if f > now + eps]
        if future:
            nxt.append(future[0][0])
        if not nxt:
            stuck = [i for i in range(nt) if np.isnan(start[i])][:5]
            raise ValueError(f"schedule deadlock: tasks {stuck} can never start (a dependency cycle)")
        now = min(nxt)
    return start, end


def apply_overheads(tasks: list[Task], devices: int, ov: Optional[Overheads]) -> None:
    """Add ``ov`` to a task graph in place: per-kind action overheads, then one ``S`` task per device
    that all its tasks follow and one ``U`` task per device that follows all of them."""
    if ov is None:
        return
    for t in tasks:
        if t.kind in ov.action and t.kind != "-":
            t.duration += float(ov.action[t.kind])
    n0 = len(tasks)
    start, end = ov.per_device("step_start", devices), ov.per_device("step_end", devices)
    for d in range(devices):
        mine = [i for i in range(n0) if tasks[i].device == d]
        if start[d] > 0:
            tasks.append(Task(d, -1, "S", None, (0, 0), start[d], (-1,)))
            s_id = len(tasks) - 1
            for i in mine:
                tasks[i].deps.append((s_id, 0.0))
        if end[d] > 0:
            tasks.append(Task(d, -1, "U", None, (0, 0), end[d], (math.inf,), [(i, 0.0) for i in mine]))


def bubble_fraction(acts: list[list[Action]], lo: float, hi: float) -> float:
    """Idle share of ``len(acts) * (hi - lo)``; a device running two actions at once counts as busy once."""
    if hi <= lo:
        return 0.0
    busy = 0.0
    for dev in acts:
        cur_s = cur_e = None
        for a in sorted(dev, key=lambda x: x.start):
            s_, e_ = max(a.start, lo), min(a.end, hi)
            if e_ <= s_:
                continue
            if cur_e is None or s_ > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s_, e_
            else:
                cur_e = max(cur_e, e_)
        if cur_e is not None:
            busy += cur_e - cur_s
    return 1.0 - busy / (len(acts) * (hi - lo))


def timeline_measures(tasks: Sequence[Task], start: np.ndarray, end: np.ndarray, devices: int,
                      window: Optional[tuple[float, float]] = None
                      ) -> tuple[list[list[Action]], float, float, list[float]]:
    """``(actions per device, span, bubble fraction, peak memory per device)`` of scheduled ``tasks``,
    over ``window`` (default: from 0 to the last end)."""
    acts: list[list[Action]] = [[] for _ in range(devices)]
    for i, t in enumerate(tasks):
        if t.kind == "-" or (t.duration == 0 and t.kind in ("I", "W", "B") and t.memory is None):
            continue  # empty placeholders (e.g. layer 1's input gradient) are not actions
        acts[t.device].append(Action(t.device, t.stage, t.kind, t.microbatch, t.layers, float(start[i]),
                                     float(end[i]), t.round))
    for a in acts:
        a.sort(key=lambda x: (x.start, x.end))
    lo, hi = window if window is not None else (0.0, float(np.nanmax(end)) if len(end) else 0.0)
    span = hi - lo
    bubble = bubble_fraction(acts, lo, hi)
    # peak memory: +amount at start, -amount at the end of its freeing task
    events: list[list[tuple[float, int, float]]] = [[] for _ in range(devices)]
    for i, t in enumerate(tasks):
        if t.memory is not None and t.memory[0]:
            amt, rel = t.memory
            events[t.device].append((float(start[i]), 1, amt))
            events[t.device].append((float(max(end[k] for k in rel)), 0, -amt))
    peaks = []
    for ev in events:
        ev.sort()
        cur = peak = 0.0
        for _, _, a in ev:
            cur += a
            peak = max(peak, cur)
        peaks.append(peak)
    return acts, span, bubble, peaks


def synchronous_timeline(name: str, tasks: list[Task], devices: int, m: int, stages: Iterable[int],
                         overheads: Optional[Overheads] = None, **fields: Any) -> Timeline:
    """Run a synchronous schedule's task graph (``overheads`` added first) and return its timeline:
    no (micro-batch, stage) of ``stages`` misses an update. ``fields``: the rest of :class:`Timeline`."""
    apply_overheads(tasks, devices, overheads)
    start, end = list_schedule(tasks, devices)
    acts, span, bubble, peaks = timeline_measures(tasks, start, end, devices)
    stages = list(stages)
    return Timeline(name, devices, m, acts, span, bubble, peaks, {(j, s): (0, 0) for j in range(m) for s in stages},
                    **fields)
