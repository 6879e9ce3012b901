"""The one exception a planner raises for a model it cannot plan."""

from __future__ import annotations

__all__ = ["LayerReplaced", "NotPlannable"]


class NotPlannable(TypeError):
    """The model, or one of its layers or traced nodes, has a form the scan cannot plan.

    The message names the layer or node, where it was written, and why. ``spscan.wrap(...,
    backward="auto")`` catches exactly this and runs the model's own autograd backward instead; any
    other error (a bad option, an example input the model itself rejects, a bug in the model's
    forward) propagates. A ``TypeError`` subclass, so code that caught ``TypeError`` still does.
    """


class LayerReplaced(ValueError):
    """The model changed after planning in a way its plan would not follow (a layer replaced, given hooks, a
    parametrization or parameters anew, pruned weights regrown): the plan would run what was planned. A wrapper
    that can plan again does (:meth:`spscan.chain.wrapper.SpscanModule._scan_step`)."""
