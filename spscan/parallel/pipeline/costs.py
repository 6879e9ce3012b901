"""Inputs of the schedule simulator: per-layer costs, the link between devices and the runtime's
overheads (all in one time unit of the caller's choice)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LayerCosts", "Link", "Overheads"]


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

