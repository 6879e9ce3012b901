"""Measurements a rank of a real run takes of itself, in its own process: traces of the calls a
step makes, resident memory and scheduler counters from ``/proc``, isolated costs of a pipeline
stage and of an optimizer step, a CPU-share probe, and Gloo ping-pong with the link fitted to it."""

from __future__ import annotations

import re
import time
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn

from spscan.parallel.pipeline.costs import Link

__all__ = ["fit_link"]

# labels of traced compute calls: torch's actions "{stage}{kind}{microbatch}", the scan's "{rank}{F|S|W}"
ACTION_LABEL = re.compile(r"^(\d+)([FBIW])(\d+)$")
SCAN_LABEL = re.compile(r"^\d+[FSW]$")


def clear_peak_rss() -> Optional[int]:
    """Reset this process's peak RSS (Linux ``clear_refs``); returns the current RSS in bytes, or None."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return proc_status("VmRSS")
    except OSError:
        return None


def proc_status(field: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` (e.g. ``VmRSS``, ``VmHWM``) in bytes, or None."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def schedstat() -> tuple[Optional[int], Optional[int]]:
    """This thread's ``(cpu ns, run-queue wait ns)`` from ``/proc/thread-self/schedstat``, or Nones."""
    try:
        with open("/proc/thread-self/schedstat") as fh:
            cpu, wait = fh.read().split()[:2]
        return int(cpu), int(wait)
    except (OSError, ValueError):
        return None, None


class Trace:
    """Wall and CPU time of the calls a step makes, while ``on``: ``(label, start, end, cpu, cpu_start)``
    with ``start``/``end`` on the system-wide monotonic clock (comparable between the processes),
    ``cpu`` the calling thread's CPU seconds in the call and ``cpu_start`` its CPU clock at the start."""

    def __init__(self) -> None:
        self.on = False
        self.events: list[tuple[str, float, float, float, float]] = []

    def wrap(self, label: Any, fn: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = fn(*args, **kwargs)
            if self.on:
                name = label(args, kwargs) if callable(label) else label
                self.events.append((name, t0, time.perf_counter(), time.thread_time() - c0, c0))
            return out

        return traced

    def mark(self, label: str, t0: float, c0: float) -> None:
        if self.on:
            self.events.append((label, t0, time.perf_counter(), time.thread_time() - c0, c0))


class TracedComms:
    """Within the block, ``torch.distributed.pipelining``'s point-to-point helpers record into ``trace``
    (``post``: posting ``isend``/``irecv``; ``wait``: waiting for them); restored on exit. Used only in
    the worker processes :func:`compare` starts."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def __enter__(self) -> "TracedComms":
        from torch.distributed.pipelining import schedules as sch

        self.saved = (sch._wait_batch_p2p, sch._batch_p2p)
        sch._wait_batch_p2p = self.trace.wrap("wait", self.saved[0])
        sch._batch_p2p = self.trace.wrap("post", self.saved[1])
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch.distributed.pipelining import schedules as sch

        sch._wait_batch_p2p, sch._batch_p2p = self.saved


def median(ts: Sequence[float]) -> float:
    """Median of the samples; NaN for none."""
    return float(np.median(ts)) if len(ts) else float("nan")


def time_stage(mods: Sequence[nn.Module], x: torch.Tensor, y: Optional[torch.Tensor], first: bool
                ) -> dict[str, float]:
    """One sample (CPU seconds of this thread) of a pipeline stage's actions on micro-batch input ``x``,
    made with the functions ``torch.distributed.pipelining`` runs for them: ``F`` the forward with
    autograd recording (plus the loss on the last stage, ``y`` given), ``B`` its full backward
    (``stage_backward``), ``I`` its input step (``stage_backward_input``; none on the first stage, whose
    input needs no gradient) and ``W`` its weight step (``stage_backward_weight``, from what ``I`` kept)."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    sub = nn.Sequential(*mods)
    inp = x.detach().requires_grad_(not first)
    clock = time.thread_time

    def fwd() -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
        out = sub(inp)
        if y is not None:
            return nn.functional.cross_entropy(out, y), None
        return out, [torch.ones_like(out)]

    t0 = clock()
    out, g = fwd()
    tf = clock() - t0
    t0 = clock()
    stage_backward(out if g is None else [out], g, [inp])
    tb = clock() - t0
    ti = tw = 0.0
    if not first:
        out, g = fwd()
        t0 = clock()
        _, groups = stage_backward_input([out], g, [inp], sub.parameters())
        ti = clock() - t0
        t0 = clock()
        stage_backward_weight(sub.parameters(), groups)
        tw = clock() - t0
    for q in sub.parameters():
        q.grad = None
    return {"F": tf, "B": tb, "I": ti, "W": tw}


def burst_share(mods: Sequence[nn.Module], x: torch.Tensor, bursts: int = 8, pause: float = 5e-4
                 ) -> tuple[float, float]:
    """``(CPU s, wall s)`` of ``bursts`` forwards of ``mods`` on ``x``, each after a ``pause`` asleep: the
    share of a core a thread gets when, like a pipeline rank, it computes in short bursts between
    waits (a scheduler favours such threads over ones that never sleep)."""
    cpu = wall = 0.0
    for _ in range(bursts):
        time.sleep(pause)
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.no_grad():
            h = x
            for m_ in mods:
                h = m_(h)
        cpu += time.thread_time() - c0
        wall += time.perf_counter() - t0
    return cpu, wall


def opt_sample(params: Sequence[torch.Tensor], lr: float) -> float:
    """One SGD step (and gradient reset) over copies of ``params`` with gradients: CPU seconds."""
    qs = [q.detach().clone().requires_grad_(True) for q in params]
    for q in qs:
        q.grad = torch.ones_like(q)
    opt = torch.optim.SGD(qs, lr=lr)
    t0 = time.thread_time()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.thread_time() - t0


def ping_pong(rank: int, sizes: Sequence[int], reps: int, blocking: bool) -> Optional[dict[int, list[float]]]:
    """One-way seconds per message of ``n`` bytes between ranks 0 and 1 (``reps`` round trips / 2), with
    ``isend``/``irecv`` + ``wait`` (as torch's schedules) or blocking ``send``/``recv`` (as spscan's
    scan). Ranks above 1 return None."""
    import torch.distributed as dist

    if rank > 1:
        return None
    peer = 1 - rank
    out = {}
    for n in sizes:
        buf = torch.zeros(max(1, n // 4))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if blocking:
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            else:
                if rank == 0:
                    dist.isend(buf, peer).wait()
                    dist.irecv(buf, peer).wait()
                else:
                    dist.irecv(buf, peer).wait()
                    dist.isend(buf, peer).wait()
            ts.append((time.perf_counter() - t0) / 2)
        out[int(n)] = ts
    return out


def fit_link(one_way: dict[int, float], blocking: bool = False) -> Link:
    """``latency + bytes / bandwidth`` fitted to ping-pong one-way times ``{bytes: seconds}``: the line
    through the smallest message's time (mostly latency) closest, in least squares, to the larger
    messages' (Hockney's model; a free intercept goes negative on noisy timings)."""
    n = np.array(sorted(one_way), dtype=np.float64)
    t = np.array([one_way[int(k)] for k in n])
    dn, dt = n[1:] - n[0], t[1:] - t[0]
    slope = float(dn @ dt / (dn @ dn)) if len(n) > 1 and dn @ dn > 0 else 0.0
    if slope <= 1e-15:  # no measurable size dependence (above a petabyte per second): latency only
        return Link(float(max(t[0], 0.0)), blocking=blocking)
    return Link(float(max(t[0] - slope * n[0], 0.0)), float(1.0 / slope), blocking=blocking)
