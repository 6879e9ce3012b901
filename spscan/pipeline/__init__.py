"""Pipeline model parallelism side by side with spscan's model-parallel scan.

* :mod:`spscan.pipeline.simulator` — deterministic schedule simulator (GPipe, 1F1B, zero-bubble
  B/W split, out-of-order pipelines, PipeDream, DualPipe (+ SpecTrain), torch's own schedules and
  the BPPSA scan from a :class:`spscan.distributed.DistributedPlan`).
* :mod:`spscan.pipeline.draw` — timelines as PNG.
* :mod:`spscan.pipeline.spectrain` — SpecTrain weight prediction and an asynchronous-pipeline emulation.

Nothing here is imported by ``import spscan``.
"""

from spscan.pipeline.simulator import (  # noqa: F401
    SCHEDULES, Action, LayerCosts, Link, Overheads, Timeline, bppsa_scan, contiguous_bounds, dualpipe, gpipe,
    list_schedule, one_f_one_b, ooo_pipe, pipedream, torch_schedule, zero_bubble,
)
