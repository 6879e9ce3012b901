"""The run-time engine, split by lifetime.

* :class:`BoundProgram` (``bound.py``): one plan lowered for one value signature on one device, its
  tables uploaded; made once by :meth:`spscan.Plan.bind` and never changed.
* :class:`~spscan.runtime.workspace.Workspace` (``workspace.py``): what a run writes, per batch size,
  dtype and device (arenas, working buffers, captured CUDA graphs).
* :class:`RunRequest` (``request.py``): one call, built from value sources (a list, a stacked tensor,
  :class:`ValuesBuffer`, :class:`PeriodicValues`, :class:`StackedExtra`, the last two also in place as
  :class:`PeriodicBuffer`, :class:`ExtraBuffer`) and output sinks (every
  gradient, ``keep`` flags, :class:`Collect`).

:class:`BoundPlan` joins a program and its workspace and executes requests into a
:class:`ScanResult`. Every front end (the chain API, the model wrapper, the recurrent modules, the
model-parallel scan) runs through it; none reads arenas or work tables.
"""

from spscan.runtime.bound import BoundPlan, BoundProgram
from spscan.runtime.checks import canonical_device, check_inputs, fmt_bytes
from spscan.runtime.request import (Collect, ExtraBuffer, PeriodicBuffer, PeriodicValues, RunRequest, StackedExtra,
                                   ValuesBuffer)
from spscan.runtime.result import Gradients, ScanResult
from spscan.runtime.workspace import CAPTURE_ERROR_MODE, RecycledBuffers, Workspace
from spscan.kernels.backend import StructuredOperator

__all__ = ["CAPTURE_ERROR_MODE", "BoundPlan", "BoundProgram", "Collect", "ExtraBuffer", "Gradients", "PeriodicBuffer",
           "PeriodicValues", "RecycledBuffers", "RunRequest", "ScanResult", "StackedExtra", "StructuredOperator", "ValuesBuffer",
           "Workspace", "canonical_device", "check_inputs", "fmt_bytes"]
