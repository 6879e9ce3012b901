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

import torch as _torch

from spscan.api import backward, load_plan, plan, plan_composite
from spscan.engine import BoundPlan, ScanResult
from spscan.graph import wrap_graph as _wrap_graph
from spscan.model import ModelPlan, SpscanModule, param_grads
from spscan.model import is_chain_model as _is_chain_model
from spscan.model import wrap as _wrap_model
from spscan.plan import Plan
from spscan.recurrent import RecurrentPlan, wrap_recurrent as _wrap_recurrent
from spscan.stacked import StackedRecurrentPlan, is_stacked as _is_stacked, wrap_stacked as _wrap_stacked
from spscan.reference import reference_backward

__version__ = "0.1.0"
__all__ = ["plan", "backward", "plan_composite", "load_plan", "Plan", "BoundPlan", "ScanResult", "ModelPlan", "SpscanModule",
           "RecurrentPlan", "StackedRecurrentPlan", "reference_backward", "forward", "wrap", "param_grads", "__version__"]


def forward(plan, x):
    """Run the planned model on ``x``: ``(output, jacobians)`` for :func:`backward` (model plans only)."""
    if not isinstance(plan, (ModelPlan, RecurrentPlan, StackedRecurrentPlan)):
        raise TypeError("forward(plan, x) needs a plan made from a model: spscan.plan(model, example_input)")
    return plan.forward(x)


def wrap(model, example_input, **plan_kwargs):
    """An ``nn.Module`` sharing ``model``'s parameters whose backward runs through the scan."""
    if isinstance(model, (_torch.nn.RNN, _torch.nn.GRU, _torch.nn.LSTM)):
        if _is_stacked(model):  # num_layers > 1 or bidirectional
            return _wrap_stacked(model, example_input, **plan_kwargs)
        return _wrap_recurrent(model, example_input, **plan_kwargs)
    if _is_chain_model(model):
        return _wrap_model(model, example_input, **plan_kwargs)
    return _wrap_graph(model, example_input, **plan_kwargs)  # a model with its own forward: traced with torch.fx


def __getattr__(name: str):
    # ``spscan.distributed`` loads torch.distributed machinery only when asked for
    if name == "distributed":
        import importlib

        return importlib.import_module("spscan.distributed")
    raise AttributeError(f"module 'spscan' has no attribute {name!r}")
