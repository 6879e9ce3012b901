"""spscan: back-propagation as a parallel scan over sparse transposed Jacobians (BPPSA).

``plan()`` does every data-independent step once (patterns, symbolic SpGEMM, the scan
schedule); ``backward()`` does only numeric work per step.

>>> import scipy.sparse as sp, torch, spscan
>>> eye = sp.csr_array(sp.eye(3))
>>> p = spscan.plan([eye, eye])
>>> g = spscan.backward(p, [torch.ones(3), 2 * torch.ones(3)], torch.ones(1, 3))
>>> g[0].tolist()
[[2.0, 2.0, 2.0]]
"""

from __future__ import annotations

from spscan.api import backward, forward, load_plan, plan, plan_composite, wrap
from spscan.cli.calibration import calibrate
from spscan.runtime import BoundPlan, ScanResult
from spscan.errors import NotPlannable
from spscan.chain.model import ModelPlan, param_grads
from spscan.chain.wrapper import SpscanModule
from spscan.runtime.plan import Plan
from spscan.recurrent.plan import RecurrentPlan
from spscan.recurrent.stacked import StackedRecurrentPlan
from spscan.reference import reference_backward

__version__ = "0.1.0"
__all__ = ["plan", "backward", "plan_composite", "load_plan", "Plan", "BoundPlan", "ScanResult", "ModelPlan", "SpscanModule",
           "RecurrentPlan", "StackedRecurrentPlan", "reference_backward", "forward", "wrap", "param_grads", "calibrate",
           "NotPlannable", "__version__"]


def __getattr__(name: str):
    # ``spscan.distributed`` loads torch.distributed machinery only when asked for
    if name == "distributed":
        import importlib

        return importlib.import_module("spscan.distributed")
    raise AttributeError(f"module 'spscan' has no attribute {name!r}")
