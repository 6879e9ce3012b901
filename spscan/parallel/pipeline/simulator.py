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

Every schedule but DualPipe (whose devices advance in lock-step time units, timed directly) is run
by one list scheduler (:func:`list_schedule`): non-preemptive devices, each picking its ready task
of smallest priority key; a dependency between devices waits the link time (:class:`Link`:
``latency + bytes / bandwidth``, the sender free meanwhile or, blocking, busy). A runtime's costs
outside the compute (:class:`Overheads`: per action of each kind, before and after each device's
step) are added as measured. Everything is deterministic (ties broken by task creation order).

Where each part lives: the inputs in :mod:`spscan.parallel.pipeline.costs`, the list scheduler and the
timeline in :mod:`spscan.parallel.pipeline.timeline`, placements and task graphs in
:mod:`spscan.parallel.pipeline.taskgraph`, the pipeline schedules in :mod:`spscan.parallel.pipeline.schedules` and
the scan in :mod:`spscan.parallel.pipeline.bppsa`; this module gathers them under one name.
"""

from __future__ import annotations

from spscan.parallel.pipeline.bppsa import bppsa_scan
from spscan.parallel.pipeline.costs import LayerCosts, Link, Overheads
from spscan.parallel.pipeline.schedules import (
    SCHEDULES, dualpipe, gpipe, one_f_one_b, ooo_pipe, pipedream, torch_schedule, zero_bubble,
)
from spscan.parallel.pipeline.taskgraph import contiguous_bounds
from spscan.parallel.pipeline.timeline import Action, Task, Timeline, list_schedule

__all__ = ["LayerCosts", "Link", "Overheads", "Action", "Timeline", "Task", "list_schedule", "contiguous_bounds",
           "gpipe", "one_f_one_b", "zero_bubble", "ooo_pipe", "pipedream", "dualpipe", "torch_schedule",
           "bppsa_scan", "SCHEDULES"]
