"""Deterministic schedule simulator for model-parallel training of a chain of layers.

Given per-layer costs (forward ``F``, input-gradient ``I`` and weight-gradient ``W`` per
micro-batch, in any time unit), ``p`` devices, ``m`` micro-batches and a link model, each
schedule below produces a :class:`Timeline`: the per-device action list in the vocabulary of
``torch.distributed.pipelining`` (``F``, ``I``, ``W``, ``B = I + W``; the scan adds ``R``, the
reduction of a slice to its composite, and ``X``, one scan round), the step time, the bubble
fraction, the peak activations held per device and the weight staleness of every
(micro-batch, stage).

Schedules:

* :func:`gpipe` — all forwards, then all backwards, flush (conventional per-layer ``W`` then ``I``).
* :func:`one_f_one_b` — synchronous 1F1B with flush (PipeDream-flush, ``torch`` ``Schedule1F1B``).
* :func:`zero_bubble` — 1F1B order of ``F`` and ``I`` with the ``W`` tasks deferred into idle time.
* :func:`ooo_pipe` — out-of-order backprop: gradient fast-forwarding (``I`` before ``W``) and
  optional modulo layer allocation (layer ``l`` on device ``l mod p``).
* :func:`pipedream` — asynchronous 1F1B with weight stashing (no flush; steady state).
* :func:`dualpipe` — one forward and one backward task per pipeline time unit; with
  ``spectrain=True`` each task also carries the paper's version difference ``s``.
* :func:`torch_schedule` — any schedule ``torch.distributed.pipelining`` ships, from its own
  per-rank action lists.
* :func:`bppsa_scan` — spscan's model-parallel scan, from a real
  :class:`spscan.distributed.DistributedPlan` (its rounds, peers and planned composites).

Every schedule is run by one list scheduler (:func:`list_schedule`): non-preemptive devices,
each picking its ready task of smallest priority key; a dependency between devices waits the
link time (:class:`Link`: ``latency + bytes / bandwidth``, the sender free meanwhile or, blocking,
busy). A runtime's costs outside the compute (:class:`Overheads`: per action of each kind, before
and after each device's step) are added as measured. Everything is deterministic (ties broken by
task creation order).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np

__all__ = ["LayerCosts", "Link", "Overheads", "Action", "Timeline", "Task", "list_schedule", "contiguous_bounds",
           "gpipe", "one_f_one_b", "zero_bubble", "ooo_pipe", "pipedream", "dualpipe", "torch_schedule",
           "bppsa_scan", "SCHEDULES"]


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer costs of one micro-batch, layer order (``n`` layers).

    Attributes:
        forward: ``(n,)`` time of ``F`` of each layer.
        backward_input: ``(n,)`` time of ``I`` (``dl/dx_{l-1}`` from ``dl/dx_l``); layer 1's is never run.
        backward_weight: ``(n,)`` time of ``W`` (``dl/dθ_l``).
        activation: ``(n,)`` memory one micro-batch holds for layer ``l`` from its ``F`` until its
            last backward task (any unit; default 1 per layer).
        boundary_bytes: ``(n+1,)`` bytes of ``x_l`` per micro-batch (what crosses a cut after layer ``l``).
    """

    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    activation: tuple[float, ...] = ()
    boundary_bytes: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n == 0:
            raise ValueError("LayerCosts.forward: expected at least one layer, got 0")
        for name in ("backward_input", "backward_weight"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"LayerCosts.{name}: expected {n} entries (one per layer), got {len(getattr(self, name))}")
        act = self.activation or (1.0,) * n
        if len(act) != n:
            raise ValueError(f"LayerCosts.activation: expected {n} entries, got {len(act)}")
        bb = self.boundary_bytes or (0.0,) * (n + 1)
        if len(bb) != n + 1:
            raise ValueError(f"LayerCosts.boundary_bytes: expected {n + 1} entries (x_0..x_n), got {len(bb)}")
        for name, vals in (("forward", self.forward), ("backward_input", self.backward_input),
                           ("backward_weight", self.backward_weight), ("activation", act)):
            bad = [i + 1 for i, v in enumerate(vals) if not (math.isfinite(float(v)) and float(v) >= 0)]
            if bad:
                raise ValueError(f"LayerCosts.{name}: expected finite non-negative costs, layer(s) {bad} are not")
        object.__setattr__(self, "forward", tuple(float(v) for v in self.forward))
        object.__setattr__(self, "backward_input", tuple(float(v) for v in self.backward_input))
        object.__setattr__(self, "backward_weight", tuple(float(v) for v in self.backward_weight))
        object.__setattr__(self, "activation", tuple(float(v) for v in act))
        object.__setattr__(self, "boundary_bytes", tuple(float(v) for v in bb))

    @property
    def n(self) -> int:
        return len(self.forward)

    @classmethod
    def uniform(cls, n: int, forward: float = 1.0, backward_input: float = 1.0, backward_weight: float = 1.0,
                activation: float = 1.0, boundary_bytes: float = 0.0) -> "LayerCosts":
        """``n`` identical layers (the papers' unit-time examples)."""
        return cls((forward,) * n, (backward_input,) * n, (backward_weight,) * n, (activation,) * n,
                   (boundary_bytes,) * (n + 1))

    def scaled(self, factor: float) -> "LayerCosts":
        """Costs of ``factor`` micro-batches at once (compute linear in the batch)."""
        return LayerCosts(tuple(v * factor for v in self.forward), tuple(v * factor for v in self.backward_input),
                          tuple(v * factor for v in self.backward_weight), tuple(v * factor for v in self.activation),
                          tuple(v * factor for v in self.boundary_bytes))


@dataclass(frozen=True)
class Link:
    """A message between two devices takes ``latency + bytes / bandwidth``.

    ``blocking=False``: the devices stay free meanwhile (an asynchronous send, as
    ``torch.distributed.pipelining`` posts ``isend``/``irecv``); ``blocking=True``: the sender is
    busy until the message is delivered (a synchronous ``send``, as spscan's scan sends), which
    :func:`bppsa_scan` adds to the sending task.
    """

    latency: float = 0.0
    bandwidth: float = math.inf
    blocking: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"Link.latency: expected a finite non-negative time, got {self.latency!r}")
        if not self.bandwidth > 0:
            raise ValueError(f"Link.bandwidth: expected a positive rate (bytes per time unit), got {self.bandwidth!r}")

    def time(self, nbytes: float) -> float:
        return self.latency + (nbytes / self.bandwidth if nbytes and math.isfinite(self.bandwidth) else 0.0)


@dataclass(frozen=True)
class Overheads:
    """Runtime costs outside the layers' compute, each on the device that pays it (it is busy meanwhile).

    Attributes:
        action: per action kind (``"F"``, ``"B"``, ``"I"``, ``"W"``, ``"R"``, ``"X"``), a fixed time added
            to every action of that kind (the runtime's bookkeeping around the compute: the schedule
            executor's step from one action to the next, posting sends and receives, autograd set-up).
        step_start: per device (or one value for all), time before its first action (splitting the
            batch into micro-batches, clearing the previous step's state): shown as an ``S`` action.
        step_end: per device (or one value for all), time after its last action (the optimizer step
            and gradient reset): shown as a ``U`` action; the step ends when every device's ``U`` does.
    """

    action: dict[str, float] = field(default_factory=dict)
    step_start: Any = 0.0
    step_end: Any = 0.0

    def __post_init__(self) -> None:
        for k, v in self.action.items():
            if not (math.isfinite(float(v)) and float(v) >= 0):
                raise ValueError(f"Overheads.action[{k!r}]: expected a finite non-negative time, got {v!r}")
        for name in ("step_start", "step_end"):
            vals = getattr(self, name)
            vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
            if not all(math.isfinite(float(v)) and float(v) >= 0 for v in vals):
                raise ValueError(f"Overheads.{name}: expected finite non-negative times, got {getattr(self, name)!r}")

    def per_device(self, name: str, devices: int) -> list[float]:
        vals = getattr(self, name)
        if isinstance(vals, (list, tuple)):
            if len(vals) != devices:
                raise ValueError(f"Overheads.{name}: expected {devices} values (one per device), got {len(vals)}")
            return [float(v) for v in vals]
        return [float(vals)] * devices


def _apply_overheads(tasks: list["Task"], devices: int, ov: Optional[Overheads]) -> None:
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


# ----------------------------------------------------------------------------- outputs


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


# ----------------------------------------------------------------------------- the list scheduler


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


def _bubble(acts: list[list[Action]], lo: float, hi: float) -> float:
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


def _timeline(name: str, tasks: Sequence[Task], start: np.ndarray, end: np.ndarray, devices: int, m: int,
              window: Optional[tuple[float, float]] = None) -> tuple[list[list[Action]], float, float, list[float]]:
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
    bubble = _bubble(acts, lo, hi)
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


# ----------------------------------------------------------------------------- placement


def contiguous_bounds(costs: LayerCosts, parts: int) -> list[int]:
    """Cut ``n`` layers into ``parts`` contiguous groups minimizing the largest ``F + I + W`` sum.

    Returns boundaries ``[0, b_1, ..., n]`` (group ``s`` holds layers ``b_s+1 .. b_{s+1}``).
    """
    n = costs.n
    if not isinstance(parts, int) or not 1 <= parts <= n:
        raise ValueError(f"parts: expected an int in [1, n={n}] (a layer per device at least), got {parts!r}")
    w = np.array(costs.forward) + np.array(costs.backward_input) + np.array(costs.backward_weight)
    prefix = np.concatenate([[0.0], np.cumsum(w)])

    def cut(limit: float) -> Optional[list[int]]:
        b = [0]
        for s in range(parts - 1):
            left = parts - 1 - s
            end = int(np.searchsorted(prefix, prefix[b[-1]] + limit + 1e-12, side="right")) - 1
            end = min(max(end, b[-1] + 1), n - left)
            b.append(end)
        if prefix[n] - prefix[b[-1]] > limit + 1e-9 or any(prefix[y] - prefix[x] > limit + 1e-9 and y > x + 1
                                                          for x, y in zip(b, b[1:])):
            return None
        return b + [n]

    if np.allclose(w, w[0]) and n % parts == 0:
        return [s * (n // parts) for s in range(parts + 1)]
    lo, hi = float(w.max()), float(prefix[n])
    best = cut(hi)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        got = cut(mid)
        if got is not None:
            best, hi = got, mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
    assert best is not None
    return best


def _check_pm(costs: LayerCosts, p: int, m: int) -> None:
    if not isinstance(costs, LayerCosts):
        raise TypeError(f"costs: expected a LayerCosts, got {type(costs).__name__}")
    if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= costs.n:
        raise ValueError(f"p: expected an int in [1, n={costs.n}] (a layer per device at least), got {p!r}")
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"m: expected a positive int (micro-batches), got {m!r}")


# ----------------------------------------------------------------------------- per-layer task graphs


class _LayerGraph:
    """Per-layer ``F``/``I``/``W`` tasks of ``m`` micro-batches; ``device_of[l]`` places layer ``l``."""

    def __init__(self, costs: LayerCosts, m: int, device_of: Sequence[int], stage_of: Sequence[int], link: Link):
        self.costs, self.m, self.link = costs, m, link
        self.device_of, self.stage_of = list(device_of), list(stage_of)
        self.tasks: list[Task] = []
        n = costs.n
        self.F: dict[tuple[int, int], int] = {}
        self.I: dict[tuple[int, int], int] = {}
        self.W: dict[tuple[int, int], int] = {}
        for j in range(m):
            for l in range(1, n + 1):
                self.F[l, j] = self._add(l, "F", j, costs.forward[l - 1])
            for l in range(n, 0, -1):
                self.I[l, j] = self._add(l, "I", j, costs.backward_input[l - 1] if l > 1 else 0.0)
                self.W[l, j] = self._add(l, "W", j, costs.backward_weight[l - 1])
        for j in range(m):
            for l in range(1, n + 1):
                f = self.tasks[self.F[l, j]]
                if l > 1:
                    f.deps.append((self.F[l - 1, j], self._delay(l - 1, l, l - 1)))
                for kind in ("I", "W"):
                    t = self.tasks[getattr(self, kind)[l, j]]
                    t.deps.append((self.F[l, j], 0.0))
                    if l < n:  # dl/dx_l comes from the next layer's input gradient
                        t.deps.append((self.I[l + 1, j], self._delay(l + 1, l, l)))
                # layer l's activation lives until both of its backward tasks are done
                f.memory = (costs.activation[l - 1], [self.I[l, j], self.W[l, j]])

    def _delay(self, src_layer: int, dst_layer: int, boundary: int) -> float:
        if self.device_of[src_layer - 1] == self.device_of[dst_layer - 1]:
            return 0.0
        return self.link.time(self.costs.boundary_bytes[boundary])

    def _add(self, l: int, kind: str, j: int, dur: float) -> int:
        self.tasks.append(Task(self.device_of[l - 1], self.stage_of[l - 1], kind, j, (l, l), dur, ()))
        return len(self.tasks) - 1


def _layers_placement(costs: LayerCosts, p: int, modulo: bool, bounds: Optional[Sequence[int]]
                      ) -> tuple[list[int], list[int], list[int]]:
    n = costs.n
    if modulo:
        # the paper's GPU_{l mod p} with GPUs numbered from 1: layer 1 on the first device
        dev = [(l - 1) % p for l in range(1, n + 1)]
        return dev, [l - 1 for l in range(1, n + 1)], list(range(n + 1))
    b = list(bounds) if bounds is not None else contiguous_bounds(costs, p)
    if len(b) != p + 1 or b[0] != 0 or b[-1] != n or any(y <= x for x, y in zip(b, b[1:])):
        raise ValueError(f"bounds: expected {p + 1} strictly increasing boundaries from 0 to n={n}, got {list(b)}")
    dev = [0] * n
    for s in range(p):
        for l in range(b[s] + 1, b[s + 1] + 1):
            dev[l - 1] = s
    return dev, dev[:], b


def _flush_schedule(name: str, costs: LayerCosts, p: int, m: int, link: Link, modulo: bool, fast_forward: bool,
                    bounds: Optional[Sequence[int]], flush: bool = True, overheads: Optional[Overheads] = None
                    ) -> Timeline:
    device_of, stage_of, _ = _layers_placement(costs, p, modulo, bounds)
    g = _LayerGraph(costs, m, device_of, stage_of, link)
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
    _apply_overheads(g.tasks, p, overheads)
    start, end = list_schedule(g.tasks, p)
    acts, span, bubble, peaks = _timeline(name, g.tasks, start, end, p, m)
    return Timeline(name, p, m, acts, span, bubble, peaks,
                    {(j, s): (0, 0) for j in range(m) for s in sorted(set(stage_of))}, exact=True,
                    extra={"placement": device_of})


def gpipe(costs: LayerCosts, p: int, m: int, link: Link = Link(), bounds: Optional[Sequence[int]] = None,
          overheads: Optional[Overheads] = None) -> Timeline:
    """GPipe: every device runs all its forwards, then conventional backprop per micro-batch
    (per layer ``W`` then ``I``, as the out-of-order paper's baseline), then the step ends (flush).
    ``overheads``: runtime costs outside the compute (:class:`Overheads`; per-layer actions here)."""
    _check_pm(costs, p, m)
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
    (16 layers, 4 devices, 4 micro-batches) these settings give its 1.22x and 1.62x over GPipe;
    OOO-Pipe2 with ``flush=True`` gives 1.57x.
    """
    _check_pm(costs, p, m)
    flush = (not modulo) if flush is None else bool(flush)
    return _flush_schedule("OOO-Pipe2" if modulo else "OOO-Pipe1", costs, p, m, link, modulo, True, bounds, flush)


# ----------------------------------------------------------------------------- stage-level task graphs


class _StageGraph:
    """Stage-level tasks: stage ``s`` = layers ``bounds[s]+1 .. bounds[s+1]`` on device ``device_of_stage[s]``."""

    def __init__(self, costs: LayerCosts, bounds: Sequence[int], device_of_stage: Sequence[int], link: Link,
                 split_w: bool):
        self.costs, self.bounds, self.dev, self.link, self.split_w = costs, list(bounds), list(device_of_stage), link, split_w
        self.S = len(bounds) - 1
        self.tasks: list[Task] = []
        self.ids: dict[tuple[str, int, int], int] = {}
        f = np.array(costs.forward)
        i_ = np.array(costs.backward_input).copy()
        i_[0] = 0.0  # nobody needs dl/dx_0
        w = np.array(costs.backward_weight)
        a = np.array(costs.activation)
        self.cF = [float(f[bounds[s]:bounds[s + 1]].sum()) for s in range(self.S)]
        self.cI = [float(i_[bounds[s]:bounds[s + 1]].sum()) for s in range(self.S)]
        self.cW = [float(w[bounds[s]:bounds[s + 1]].sum()) for s in range(self.S)]
        self.cA = [float(a[bounds[s]:bounds[s + 1]].sum()) for s in range(self.S)]

    def delay(self, s_from: int, s_to: int, boundary_layer: int) -> float:
        if self.dev[s_from] == self.dev[s_to]:
            return 0.0
        return self.link.time(self.costs.boundary_bytes[boundary_layer])

    def add(self, kind: str, s: int, j: int, key: tuple = ()) -> int:
        dur = {"F": self.cF[s], "I": self.cI[s], "W": self.cW[s], "B": self.cI[s] + self.cW[s]}[kind]
        layers = (self.bounds[s] + 1, self.bounds[s + 1])
        self.tasks.append(Task(self.dev[s], s, kind, j, layers, dur, key))
        self.ids[kind, s, j] = len(self.tasks) - 1
        return len(self.tasks) - 1

    def build(self, m: int, first_mb: int = 0) -> None:
        """All tasks of micro-batches ``first_mb .. first_mb+m-1`` with their data dependencies."""
        bkinds = ("I", "W") if self.split_w else ("B",)
        for j in range(first_mb, first_mb + m):
            for s in range(self.S):
                self.add("F", s, j)
                for k in bkinds:
                    self.add(k, s, j)
        for j in range(first_mb, first_mb + m):
            for s in range(self.S):
                f = self.tasks[self.ids["F", s, j]]
                if s > 0:
                    f.deps.append((self.ids["F", s - 1, j], self.delay(s - 1, s, self.bounds[s])))
                grad_kind = "I" if self.split_w else "B"
                for k in bkinds:
                    t = self.tasks[self.ids[k, s, j]]
                    t.deps.append((self.ids["F", s, j], 0.0))
                    if s < self.S - 1:
                        t.deps.append((self.ids[grad_kind, s + 1, j], self.delay(s + 1, s, self.bounds[s + 1])))
                last = self.ids["W" if self.split_w else "B", s, j]
                if self.split_w:
                    # W reads what I leaves (the stage's output gradient): run after it on the device
                    self.tasks[last].deps.append((self.ids["I", s, j], 0.0))
                f.memory = (self.cA[s], [last])

    def chain(self, order: Sequence[tuple[str, int, int]]) -> None:
        """Make a device run ``order`` (``(kind, stage, microbatch)``) strictly in sequence."""
        for a, b in zip(order, order[1:]):
            self.tasks[self.ids[b]].deps.append((self.ids[a], 0.0))
        for pos, k in enumerate(order):
            self.tasks[self.ids[k]].key = (0, pos)


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


def one_f_one_b(costs: LayerCosts, p: int, m: int, link: Link = Link(), bounds: Optional[Sequence[int]] = None,
                overheads: Optional[Overheads] = None) -> Timeline:
    """Synchronous 1F1B with flush (PipeDream-flush; ``torch`` ``Schedule1F1B``): stage ``s`` runs
    ``p - s`` warm-up forwards, then alternates one backward and one forward, then drains.
    ``overheads``: runtime costs outside the compute (:class:`Overheads`)."""
    _check_pm(costs, p, m)
    _, _, b = _layers_placement(costs, p, False, bounds)
    g = _StageGraph(costs, b, list(range(p)), link, split_w=False)
    g.build(m)
    for s in range(p):
        g.chain(_one_f_one_b_order(s, p, m, 0, p - s, "B"))
    _apply_overheads(g.tasks, p, overheads)
    start, end = list_schedule(g.tasks, p)
    acts, span, bubble, peaks = _timeline("1F1B", g.tasks, start, end, p, m)
    return Timeline("1F1B", p, m, acts, span, bubble, peaks, {(j, s): (0, 0) for j in range(m) for s in range(p)})


def zero_bubble(costs: LayerCosts, p: int, m: int, link: Link = Link(), bounds: Optional[Sequence[int]] = None,
                overheads: Optional[Overheads] = None) -> Timeline:
    """Zero-bubble-style B/W split (ZB-H1-like): 1F1B's order of ``F`` and ``I`` (input gradient only,
    so the gradient reaches the previous stage sooner) with every ``W`` deferred: a device runs a
    ready ``W`` only when its next ``F``/``I`` is not ready, and the rest after its last ``I``."""
    _check_pm(costs, p, m)
    _, _, b = _layers_placement(costs, p, False, bounds)
    g = _StageGraph(costs, b, list(range(p)), link, split_w=True)
    g.build(m)
    for s in range(p):
        g.chain(_one_f_one_b_order(s, p, m, 0, p - s, "I"))
        for j in range(m):
            g.tasks[g.ids["W", s, j]].key = (1, j)
    _apply_overheads(g.tasks, p, overheads)
    start, end = list_schedule(g.tasks, p)
    acts, span, bubble, peaks = _timeline("ZB-H1", g.tasks, start, end, p, m)
    return Timeline("ZB-H1", p, m, acts, span, bubble, peaks, {(j, s): (0, 0) for j in range(m) for s in range(p)})


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
    _check_pm(costs, p, m)
    _, _, b = _layers_placement(costs, p, False, bounds)
    total = total if total is not None else 2 * (p + m)
    g = _StageGraph(costs, b, list(range(p)), link, split_w=False)
    g.build(total)
    for s in range(p):
        g.chain(_one_f_one_b_order(s, p, total, 0, p - s, "B"))
    start, end = list_schedule(g.tasks, p)
    done0 = {j: float(end[g.ids["B", 0, j]]) for j in range(total)}
    period, window = _steady(done0, m, total)
    acts, _, bubble, peaks = _timeline("PipeDream", g.tasks, start, end, p, m, window)
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
    _check_pm(costs, p, m)
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap: expected a fraction in [0, 1], got {overlap!r}")
    _, _, b = _layers_placement(costs, p, False, bounds)
    g = _StageGraph(costs, b, list(range(p)), link, split_w=False)
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
    bubble = _bubble(acts, *window)
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
    _check_pm(costs, p, m)
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
    S = 1 + max(s for r in actions for _, s, _ in r)
    if S > costs.n:
        raise ValueError(f"torch_schedule({name!r}): {S} stages need at least {S} layers, costs has {costs.n}")
    dev_of = [-1] * S
    for r, flat in enumerate(actions):
        for _, s, _ in flat:
            dev_of[s] = r
    b = list(bounds) if bounds is not None else contiguous_bounds(costs, S)
    split = any(k in ("I", "W") for r in actions for k, _, _ in r)
    g = _StageGraph(costs, b, dev_of, link, split_w=split)
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
    _apply_overheads(g.tasks, p, overheads)
    start, end = list_schedule(g.tasks, p)
    acts, span, bubble, peaks = _timeline(name, g.tasks, start, end, p, m)
    return Timeline(name, p, m, acts, span, bubble, peaks, {(j, s): (0, 0) for j in range(m) for s in range(S)},
                    extra={"stages": S, "stage_device": dev_of, "torch_order": [[f"{s}{k}{j}" for k, s, j in r]
                                                                                for r in actions]})


# ----------------------------------------------------------------------------- spscan's scan


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
    _check_pm(costs, p, m)
    shared = list(shared) if shared is not None else [False] * p
    has_extra = [False] * p
    mv = pair_time if matvec_time is None else matvec_time
    bounds = list(dplan.bounds)
    g = _StageGraph(costs, bounds, list(range(p)), link, split_w=True)
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
    _apply_overheads(tasks, p, overheads)
    start, end = list_schedule(tasks, p)
    acts, span, bubble, peaks = _timeline("BPPSA scan", tasks, start, end, p, m)
    sent = [sum(v for (src, _), v in msg_bytes.items() if src == r) for r in range(p)]
    return Timeline("BPPSA scan", p, m, acts, span, bubble, peaks, {(j, s): (0, 0) for j in range(m) for s in range(p)},
                    exact=True, extra={"rounds": dplan.rounds, "bytes_sent": sent, "bounds": bounds})


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
