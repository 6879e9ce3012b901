"""The workspace of a bound plan: what a run writes, kept per batch size, dtype and device.

A :class:`Workspace` holds the value arenas, the working buffers and the CUDA graphs recorded
over them; it is the only part of a binding that changes between calls, and the only part
:meth:`~spscan.runtime.BoundPlan.release_buffers` frees. :class:`RecycledBuffers` does the same
for a front end's own large host tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

from spscan.planner.program import Program

__all__ = ["CAPTURE_ERROR_MODE", "RecycledBuffers", "Workspace", "record_cuda_graph"]

_MAX_GRAPHS = 4  # CUDA graphs a workspace keeps (one per batch size and dtype in use)

#: how strictly a CUDA-graph capture made here refuses what it cannot record (``torch.cuda.graph``'s
#: ``capture_error_mode``): only in the recording thread. The default, ``"global"``, fails a capture for
#: a call any other thread makes meanwhile (a data loader's thread allocating pinned memory or copying
#: a batch to the GPU), and these captures happen inside a user's training loop, whose other threads
#: spscan does not control. The recording thread's own unsafe calls (a copy from the host, a wait for
#: the device, a ``cudaMalloc``) still fail the capture.
CAPTURE_ERROR_MODE = "thread_local"


def record_cuda_graph(fn: Callable[[], Any], device: torch.device) -> tuple[Callable[[], None], Any]:
    """``fn``'s launches as a CUDA graph: ``(replay, graph)``; a replay rewrites what ``fn`` wrote. Every
    CUDA graph spscan records is recorded here (a workspace's program, a front end's backward or whole
    step, :mod:`spscan.runtime.graphed`). Only this thread's calls can fail the capture
    (:data:`CAPTURE_ERROR_MODE`)."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():  # a step without device work (an identity) records an empty graph
        warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
        with torch.cuda.graph(graph, capture_error_mode=CAPTURE_ERROR_MODE):
            fn()
    return graph.replay, graph


def _storage_use_count(t: torch.Tensor) -> Optional[int]:
    """How many tensors (views, NumPy arrays, saved tensors) use ``t``'s storage; ``None`` if torch
    cannot say (``torch._C._storage_Use_Count`` is not a public API: without it nothing is recycled)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return None
    try:
        return int(count(t.untyped_storage()._cdata))
    except (AttributeError, RuntimeError, TypeError):
        return None


class RecycledBuffers:
    """Large CPU tensors handed out again once nothing else uses them.

    A front end that makes multi-MB tensors on every step (the compiled recurrent forwards' chain
    values, the backward's copies of the scan's gradients) pays for fresh memory on first touch: the
    OS maps and zeroes it page by page, which can cost more than the step's arithmetic.
    :meth:`take` returns the tensor it handed out last time under ``name`` when its storage has no
    other user left (no view, NumPy array or saved tensor of it: its use count is back to what it was
    when it was made) and its shape and dtype match; otherwise a new one, which it keeps instead. So a
    tensor a caller still holds is never handed out twice, and at most one tensor per name is kept.
    CUDA tensors are never kept (the caching allocator already recycles device memory).
    """

    def __init__(self) -> None:
        self._held: dict[str, tuple[torch.Tensor, int]] = {}

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype,
             device: torch.device = torch.device("cpu")) -> torch.Tensor:
        """An uninitialized ``shape`` tensor of ``dtype`` on ``device``, recycled where it can be."""
        shape = tuple(int(d) for d in shape)
        if torch.device(device).type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        hit = self._held.get(name)
        if hit is not None:
            t, baseline = hit
            if t.shape == shape and t.dtype == dtype and _storage_use_count(t) == baseline:
                return t.view(shape)
        t = torch.empty(shape, dtype=dtype)
        baseline = _storage_use_count(t)
        if baseline is None:
            self._held.pop(name, None)
            return t
        self._held[name] = (t, baseline)
        # callers get a view: whoever keeps it (or a view of it) counts as a user of the storage
        return t.view(shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors kept (whether or not a caller still uses them)."""
        return sum(t.numel() * t.element_size() for t, _ in self._held.values())

    def address(self, name: str) -> Optional[int]:
        """The data pointer of the tensor kept under ``name`` (``None``: none kept)."""
        hit = self._held.get(name)
        return None if hit is None else hit[0].data_ptr()

    def clear(self) -> None:
        """Free every kept tensor (those still in use live on with their users)."""
        self._held.clear()


class Workspace:
    """Arenas, working buffers and CUDA graphs of one bound program on its device.

    The arenas ``(S, P)`` (shared and per-sample matrix values) are held for one ``(batch, dtype)``
    at a time, so memory stays at one backward's peak; working buffers grow to the largest request
    and are reused (fresh multi-MB CPU buffers page-fault on every call).
    """

    def __init__(self, program: Program, device: torch.device) -> None:
        self.program = program
        self.device = device
        self._arena_key: Optional[tuple] = None
        self._arenas: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._scratch: dict[str, torch.Tensor] = {}
        self._graphs: dict = {}  # CUDA graphs by (batch, dtype, launch settings, buffer addresses)

    def arenas(self, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Matrix arenas ``(S, P)`` for one call, reused while the batch size and dtype repeat."""
        key = (batch, dtype)
        if self._arena_key != key:
            self._arenas = None  # hold at most one set
            prog = self.program
            self._arenas = (torch.empty(prog.size_s, dtype=dtype, device=self.device),
                            torch.empty(batch, prog.size_p, dtype=dtype, device=self.device))
            self._arena_key = key
        return self._arenas

    @property
    def current_arenas(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The arenas of the last call (``None`` before the first or after a release)."""
        return self._arenas

    def buffer(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat working buffer of at least ``numel`` elements kept between calls."""
        hit = self._scratch.get(name)
        if hit is None or hit.numel() < numel or hit.dtype != dtype:
            hit = self._scratch[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return hit[:numel]

    def replay(self, key: tuple, launch: Callable[[], None]) -> None:
        """Run ``launch`` through the CUDA graph kept under ``key`` (recorded on first use).

        The first call runs eagerly (compiling the kernels and giving this call's result), then records
        the launches; the capture runs nothing, so the buffers keep the eager result. Inside a caller's
        own capture the launches are recorded there instead.
        """
        if torch.cuda.is_current_stream_capturing():
            launch()
            return
        replay = self._graphs.get(key)
        if replay is not None:
            replay()
            return
        launch()
        replay, graph = record_cuda_graph(launch, self.device)
        if len(self._graphs) >= _MAX_GRAPHS:  # buffers of old batch sizes are gone: drop their graphs
            self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = replay  # (the bound method keeps its graph alive)

    def held_buffers(self) -> list[torch.Tensor]:
        """The buffers a run writes and reads now (arenas, working buffers)."""
        held = list(self._arenas) if self._arenas is not None else []
        return held + list(self._scratch.values())

    def release(self) -> None:
        """Free the arenas, working buffers and CUDA graphs."""
        self._graphs.clear()
        self._arena_key = self._arenas = None
        self._scratch.clear()
