"""Pipeline model parallelism side by side with spscan's model-parallel scan.

* :mod:`spscan.pipeline.simulator` — deterministic schedule simulator (GPipe, 1F1B, zero-bubble
  B/W split, out-of-order pipelines, PipeDream, DualPipe (+ SpecTrain), torch's own schedules and
  the BPPSA scan from a :class:`spscan.distributed.DistributedPlan`), gathered from
  :mod:`~spscan.pipeline.costs` (inputs), :mod:`~spscan.pipeline.timeline` (the list scheduler and
  its timelines), :mod:`~spscan.pipeline.taskgraph` (placements, task graphs),
  :mod:`~spscan.pipeline.schedules` (the pipelines) and :mod:`~spscan.pipeline.bppsa` (the scan).
* :mod:`spscan.pipeline.realrun` — real steps of torch's schedules and the scan as Gloo CPU
  processes, with the simulator calibrated to predict them: :mod:`~spscan.pipeline.mlp` (the model),
  :mod:`~spscan.pipeline.probes` and :mod:`~spscan.pipeline.runners` (what each rank measures and
  runs), :mod:`~spscan.pipeline.measured` and :mod:`~spscan.pipeline.calibration` (the readout and
  the prediction).
* :mod:`spscan.pipeline.draw` — timelines as PNG.
* :mod:`spscan.pipeline.spectrain` — SpecTrain weight prediction and an asynchronous-pipeline emulation.

Nothing here is imported by ``import spscan``.
"""

from spscan.pipeline.simulator import (  # noqa: F401
    SCHEDULES, Action, LayerCosts, Link, Overheads, Timeline, bppsa_scan, contiguous_bounds, dualpipe, gpipe,
    list_schedule, one_f_one_b, ooo_pipe, pipedream, torch_schedule, zero_bubble,
)
