"""Pipeline model parallelism side by side with spscan's model-parallel scan.

* :mod:`spscan.parallel.pipeline.simulator` — deterministic schedule simulator (GPipe, 1F1B, zero-bubble
  B/W split, out-of-order pipelines, PipeDream, DualPipe (+ SpecTrain), torch's own schedules and
  the BPPSA scan from a :class:`spscan.distributed.DistributedPlan`), gathered from
  :mod:`~spscan.parallel.pipeline.costs` (inputs), :mod:`~spscan.parallel.pipeline.timeline` (the list scheduler and
  its timelines), :mod:`~spscan.parallel.pipeline.taskgraph` (placements, task graphs),
  :mod:`~spscan.parallel.pipeline.schedules` (the pipelines) and :mod:`~spscan.parallel.pipeline.bppsa` (the scan).
* :mod:`spscan.parallel.pipeline.realrun` — real steps of torch's schedules and the scan as Gloo CPU
  processes, with the simulator calibrated to predict them: :mod:`~spscan.parallel.pipeline.mlp` (the model),
  :mod:`~spscan.parallel.pipeline.probes` and :mod:`~spscan.parallel.pipeline.runners` (what each rank measures and
  runs), :mod:`~spscan.parallel.pipeline.measured` and :mod:`~spscan.parallel.pipeline.calibration` (the readout and
  the prediction).
* :mod:`spscan.parallel.pipeline.draw` — timelines as PNG.
* :mod:`spscan.parallel.pipeline.spectrain` — SpecTrain weight prediction and an asynchronous-pipeline emulation.

Nothing here is imported by ``import spscan``.
"""

from spscan.parallel.pipeline.simulator import (  # noqa: F401
    SCHEDULES, Action, LayerCosts, Link, Overheads, Timeline, bppsa_scan, contiguous_bounds, dualpipe, gpipe,
    list_schedule, one_f_one_b, ooo_pipe, pipedream, torch_schedule, zero_bubble,
)
