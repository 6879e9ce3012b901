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

import os as _os

import torch as _torch

# Triton kernels run in Triton's interpreter when there is no GPU; the variable must be set
# before the first @triton.jit function is defined.
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from spscan.api import backward, load_plan, plan  # noqa: E402
from spscan.plan import Plan  # noqa: E402
from spscan.reference import reference_backward  # noqa: E402

__version__ = "0.1.0"
__all__ = ["plan", "backward", "load_plan", "Plan", "reference_backward", "forward", "wrap", "param_grads",
           "__version__"]


def forward(plan, x):
    """Run the planned model on ``x``: ``(output, jacobians)`` for :func:`backward` (model plans only)."""
    if not hasattr(plan, "forward") or isinstance(plan, Plan):
        raise TypeError("forward(plan, x) needs a plan made from a model: spscan.plan(model, example_input)")
    return plan.forward(x)


def wrap(model, example_input, **plan_kwargs):
    """An ``nn.Module`` sharing ``model``'s parameters whose backward runs through the scan."""
    if isinstance(model, (_torch.nn.RNN, _torch.nn.GRU, _torch.nn.LSTM)):
        from spscan.recurrent import wrap_recurrent

        return wrap_recurrent(model, example_input, **plan_kwargs)
    from spscan.model import wrap as wrap_model

    return wrap_model(model, example_input, **plan_kwargs)


def param_grads(plan, jacobians, grads):
    """Every parameter gradient of a planned model from the scan's ``dl/dx_i`` (out of order, batched)."""
    from spscan.model import param_grads as _param_grads

    return _param_grads(plan, jacobians, grads)


def __getattr__(name: str):
    # ``spscan.distributed`` loads torch.distributed machinery only when asked for
    if name == "distributed":
        import importlib

        return importlib.import_module("spscan.distributed")
    raise AttributeError(f"module 'spscan' has no attribute {name!r}")
