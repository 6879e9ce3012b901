"""Task graphs the schedules are built from: the placement of layers on devices, per-layer
``F``/``I``/``W`` tasks (layer-level schedules) and per-stage tasks (stage-level schedules), with
their data dependencies, link delays and activation lifetimes."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from spscan.parallel.pipeline.costs import LayerCosts, Link
from spscan.parallel.pipeline.timeline import Task

__all__ = ["contiguous_bounds"]


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


def check_pm(costs: LayerCosts, p: int, m: int) -> None:
    """Reject anything but :class:`LayerCosts`, ``1 <= p <= n`` devices and ``m >= 1`` micro-batches."""
    if not isinstance(costs, LayerCosts):
        raise TypeError(f"costs: expected a LayerCosts, got {type(costs).__name__}")
    if not isinstance(p, int) or isinstance(p, bool) or not 1 <= p <= costs.n:
        raise ValueError(f"p: expected an int in [1, n={costs.n}] (a layer per device at least), got {p!r}")
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"m: expected a positive int (micro-batches), got {m!r}")


class LayerGraph:
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


def layers_placement(costs: LayerCosts, p: int, modulo: bool, bounds: Optional[Sequence[int]]
                     ) -> tuple[list[int], list[int], list[int]]:
    """``(device of each layer, stage of each layer, stage boundaries)``: contiguous stages cut at
    ``bounds`` (default :func:`contiguous_bounds`) or, with ``modulo``, layer ``l`` on device ``(l-1) mod p``."""
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


class StageGraph:
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
