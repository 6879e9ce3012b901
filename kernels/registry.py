"""The backends by name: ``"torch"`` and ``"triton"``, each imported and made once, on first use.

Sits above the interface (:mod:`.backend`) and its two implementations (:mod:`.torch_ops`,
:mod:`.triton.backend`), which import only the interface: nothing below imports this module.

>>> get_backend("torch").capabilities.reads_caller_inputs
True
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from spscan.kernels.backend import Backend

__all__ = ["backend_names", "default_backend", "get_backend"]


def _torch() -> Backend:
    from spscan.kernels.torch_ops import TorchBackend

    return TorchBackend()


def _triton() -> Backend:
    from spscan.kernels.triton.backend import TritonBackend

    return TritonBackend()


_FACTORIES: dict[str, Callable[[], Backend]] = {"torch": _torch, "triton": _triton}
_INSTANCES: dict[str, Backend] = {}


def backend_names() -> tuple[str, ...]:
    """The backends a plan may name (besides ``"auto"``)."""
    return tuple(_FACTORIES)


def default_backend(device: Optional[torch.device]) -> str:
    """``"auto"`` resolved: Triton on a CUDA device, torch everywhere else."""
    return "triton" if device is not None and device.type == "cuda" else "torch"


def get_backend(name: str) -> Backend:
    """The backend called ``name`` (``"torch"`` or ``"triton"``; imported on first use)."""
    hit = _INSTANCES.get(name)
    if hit is None:
        if name not in _FACTORIES:
            raise ValueError(f"backend: expected one of {', '.join(map(repr, _FACTORIES))}, got {name!r}")
        hit = _INSTANCES[name] = _FACTORIES[name]()
    return hit
