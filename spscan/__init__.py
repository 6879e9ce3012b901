"""spscan: back-propagation as a parallel scan over sparse transposed Jacobians (BPPSA).

``plan()`` does every data-independent step once (patterns, symbolic SpGEMM, the scan
schedule); ``backward()`` does only numeric work per step.
"""

from __future__ import annotations

import os as _os

import torch as _torch

# Triton kernels run in Triton's interpreter when there is no GPU; the variable must be set
# before the first @triton.jit function is defined.
if not _torch.cuda.is_available():
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from spscan.reference import reference_backward  # noqa: E402

__version__ = "0.1.0"
__all__ = ["reference_backward", "__version__"]
