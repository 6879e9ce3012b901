"""Real model-parallel training steps on one machine: ``torch.distributed.pipelining`` schedules and
spscan's model-parallel scan, as Gloo CPU processes, on the same MLP chain.

The model is ``Linear(d_0, d_1), ReLU, Linear(d_1, d_2), ReLU, ..., Linear(d_{L-1}, d_L)``; every
module is one layer of the chain (its transposed Jacobian: ``W`` for a linear layer, shared by the
batch; ``diag(x > 0)`` per sample for a ReLU). A method cuts it into stages of whole modules.

:func:`compare` runs ``torch.distributed.pipelining`` schedule classes and spscan's scan in one
set of processes, interleaved step by step. spscan's step: forward of the whole batch slice by
slice, the model-parallel scan (:func:`spscan.distributed.backward`) for every ``dl/dx_i``, then
each layer's weight gradient from its own ``dl/dx_i`` (``g^T x`` for a linear layer).

It returns, per rank and method, the measured step times with a trace of every call the step
made (wall and CPU time: compute actions, message posts and waits, loss, optimizer), the bytes
sent per step, the peak resident memory growth during a step and the parameter gradients of the
last step as NumPy arrays keyed like ``model.named_parameters()`` (to compare against
single-process autograd), plus the calibration measurements of the simulator, taken in the same
processes between the timed steps: isolated stage costs, optimizer steps and Gloo ping-pong.

:func:`predicted_timeline` turns the calibration (and :func:`runtime_overheads` of a run of a
negligible-compute model) into the simulator's prediction of each method's step;
:func:`step_times` gives the measured ones.

Where each part lives: the model in :mod:`spscan.parallel.pipeline.mlp`, the measurements a rank takes in
:mod:`spscan.parallel.pipeline.probes`, what each rank runs in :mod:`spscan.parallel.pipeline.runners`, the readout of
the results in :mod:`spscan.parallel.pipeline.measured` and the predictions in
:mod:`spscan.parallel.pipeline.calibration`; this module starts the run and gathers them under one name.
"""

from __future__ import annotations

from typing import Sequence

from spscan.parallel.pipeline.calibration import (
    busy_per_device, calibrated_costs, calibrated_link, calibrated_overheads, explained_step_times,
    predicted_step_times, predicted_timeline, round_loads,
)
from spscan.parallel.pipeline.measured import measured_cpu, runtime_overheads, step_breakdown, step_cpu_shares, step_times
from spscan.parallel.pipeline.mlp import (
    MULTI_STAGE, SINGLE_STAGE, build_mlp, chain_patterns, chain_values, reference_grads, stage_bounds,
)
from spscan.parallel.pipeline.probes import fit_link
from spscan.parallel.pipeline.runners import compare_worker

# the batch, the stage keys and the action labels, under the private names tests read
from spscan.parallel.pipeline.mlp import batch_data as _data  # noqa: F401
from spscan.parallel.pipeline.mlp import stage_key as _stage_key  # noqa: F401
from spscan.parallel.pipeline.probes import ACTION_LABEL as _ACTION  # noqa: F401

__all__ = ["build_mlp", "chain_patterns", "chain_values", "stage_bounds", "compare", "reference_grads", "fit_link",
           "step_times", "step_breakdown", "runtime_overheads", "calibrated_link", "calibrated_costs",
           "calibrated_overheads", "round_loads", "busy_per_device", "measured_cpu", "step_cpu_shares",
           "explained_step_times", "predicted_step_times",
           "predicted_timeline", "SINGLE_STAGE", "MULTI_STAGE"]


def compare(cfg: dict, methods: Sequence[str], world: int = 2, timeout: float = 600.0) -> list[dict]:
    """Train the MLP with every method in ``methods`` (torch schedule class names and ``"scan"``) on
    ``world`` Gloo processes, interleaved round by round (each round runs one step of every
    method, in a rotating order, then one sample of every calibration measurement), so that all
    methods and the calibration see the same machine load.

    ``cfg``: ``dims`` (layer widths), ``batch``, ``microbatches``, ``warmup``, ``steps``; optional
    ``seed``, ``lr``, ``update`` (default True: SGD step after each step), ``return_grads``,
    ``dtype``, ``threads`` (per process, default 1), ``levels`` (scan).

    Returns, per rank: ``link`` (one-way latency s, bandwidth B/s between ranks 0 and 1, fitted to
    the ``isend``/``irecv`` ping-pong), ``calibration`` (medians over the rounds, CPU seconds:
    ``stage``: every owned pipeline stage's ``F``/``B``/``I``/``W`` on one micro-batch keyed by
    ``"bounds/stage"``; ``scan``: the scan slice's ``F``/``loss``/``I``/``W`` on the whole batch;
    ``opt``: each method's optimizer step; ``async``/``blocking``: one-way wall seconds per message
    size, the fastest, and ``async_median``/``blocking_median``; ``rounds``: per round, ``share``
    and ``burst`` ``(CPU s, wall s)`` of the compute probes and the ping-pong medians) and
    ``methods[name]``: ``times`` (this rank's seconds per step), ``steps`` (per step: ``start``/``end``
    on the monotonic clock shared by the processes, ``cpu_start`` this thread's CPU clock then,
    ``events`` ``(label, start, end, cpu, cpu_start)`` of every traced call (torch's actions as
    ``"{stage}{kind}{microbatch}"``, ``post``, ``wait``, ``loss``, ``opt``; the scan's ``"{rank}F"``,
    ``"{rank}S"`` (its distributed backward), ``"{rank}W"``, ``send``, ``wait``, ``loss``, ``opt``),
    ``cpu`` and ``run_wait``: this rank's main-thread CPU time and run-queue wait in the step),
    ``bytes_sent`` per step, ``peak_rss_growth`` (bytes, from one extra untimed step),
    ``bounds``/``stages``, ``scan_seconds`` (the scan's phases per step) and ``grads`` (last step).
    """
    from spscan.distributed import run_local

    if cfg["batch"] % cfg["microbatches"]:
        raise ValueError(f"batch: expected a multiple of microbatches={cfg['microbatches']}, got {cfg['batch']}")
    cfg = dict(cfg, methods=list(methods))
    out = run_local(compare_worker, world, (cfg,), timeout=timeout, threads=cfg.get("threads", 1))
    bad = [msg for ok, msg in out if not ok]
    if bad:
        raise RuntimeError(f"model-parallel comparison: a rank failed:\n{bad[0]}")
    return [res for _, res in out]
