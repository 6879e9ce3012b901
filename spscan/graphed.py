"""A backward's device work replayed from one CUDA graph per input signature (:class:`GraphedCall`).

A wrapped model's backward on a GPU is many small launches (each layer's operator, its parameter
gradients, the copies between them), and for the small models people train, their host cost exceeds
their device time: eager autograd launches dozens of kernels per step too. Recorded once as a CUDA
graph, the whole backward is one replay.

What a graph needs and what :class:`GraphedCall` does for it:

* **Fixed addresses.** A graph reads and writes the memory it was recorded with. The call's inputs (the
  upstream gradient, what the forward saved, the weights) are copied into buffers of its own (one
  ``torch._foreach_copy_``), and the outputs are copied out of the graph's memory into one new buffer
  per dtype (one copy each; the results are views of it). The caller's tensors may live anywhere and
  the results are the caller's to keep.
* **One graph per signature.** The shapes, strides and dtypes of every input, which of them are the
  same tensor, the non-tensor values of the inputs and the caller's ``key`` (e.g. which gradients
  are wanted) select the graph; the first call with a new signature runs eagerly on the copies (its
  result is returned), then records. At most :attr:`GraphedCall.MAX_GRAPHS` are kept.
* **Only what a graph can replay.** Inputs holding objects the walk cannot see into, or tensors
  that carry an autograd graph (a backward that asks autograd for a vector-Jacobian product would
  replay the first call's tensors), run eagerly, as does a signature whose recording failed, and
  a call made while the caller itself records a graph. Eager and replayed results are the same
  kernels on the same values: bitwise equal.
* **Memory the graph reads stays alive.** ``hold()`` names the buffers the recorded work reads
  that belong to someone else (an engine's arenas, which a later batch size replaces); they are kept
  with the graph.

Used by the wrapped chains and traced graphs (:class:`spscan.model.ModelPlan`) and the recurrent
modules (:class:`spscan.recurrent_backward.GraphedBackward`); imports no front end.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import torch

from spscan.autograd import flatten_tensors, map_tensors
from spscan.engine import PeriodicValues

__all__ = ["GraphedCall", "copy_all", "record_cuda_graph"]


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all ``i``, as one call where torch has it."""
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src)
    else:
        for d, s in zip(dst, src):
            d.copy_(s)


def record_cuda_graph(fn: Callable[[], Any], device: torch.device) -> tuple[Callable[[], None], Any]:
    """``fn``'s launches as a CUDA graph: ``(replay, graph)``; a replay rewrites what ``fn`` wrote."""
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay, graph


class _Unseen(Exception):
    """The inputs hold something a graph cannot replay (see :func:`_walk`)."""


_ATOMS = frozenset([type(None), bool, int, float, str, torch.dtype, torch.device, torch.Size, range, slice])


def _walk(value: Any, tensors: list[torch.Tensor], atoms: list) -> None:
    """Collect ``value``'s tensors in the order :func:`~spscan.autograd.map_tensors` visits them and a
    hashable trace of everything else; raise :class:`_Unseen` for what a replay could not reproduce: a
    tensor with an autograd graph, or an unhashable object ``map_tensors`` passes on as it is. (A
    hashable one is part of the signature: a new object is a new signature, recorded anew.)"""
    t = type(value)
    if t in _ATOMS:
        atoms.append((t, value))
    elif isinstance(value, torch.Tensor):
        if value.grad_fn is not None:  # it carries an autograd graph of the first call's tensors
            raise _Unseen
        tensors.append(value)
        atoms.append(_TENSOR)
    elif t is dict or isinstance(value, dict):
        atoms.append((dict, tuple(value)))
        for v in value.values():
            _walk(v, tensors, atoms)
    elif t is list or t is tuple:
        atoms.append((t, len(value)))
        for v in value:
            _walk(v, tensors, atoms)
    elif isinstance(value, PeriodicValues) or getattr(t, "_holds_tensors", False):
        atoms.append((t, tuple(value.__dict__)))
        for v in value.__dict__.values():
            _walk(v, tensors, atoms)
    else:  # passed on as it is: a configuration object (a value encoding) is part of the signature
        try:
            hash(value)
        except TypeError:
            raise _Unseen from None
        atoms.append((t, value))


_TENSOR = object()  # a tensor's place in a signature's trace


class _Entry:
    """One recorded signature: the input buffers, the replay, the output buffers and what to return."""

    __slots__ = ("static", "unique", "replay", "flats", "layout", "skeleton", "graph", "held")

    def __init__(self, static, unique, replay, flats, layout, skeleton, graph, held) -> None:
        self.static, self.unique, self.replay = static, unique, replay
        self.flats, self.layout, self.skeleton = flats, layout, skeleton
        self.graph, self.held = graph, held

    def results(self) -> Any:
        """Copies of the outputs the last replay wrote (one buffer per dtype), in the call's structure."""
        parts: list[Optional[torch.Tensor]] = [None] * self.layout
        for (flat, sizes, slots) in self.flats:
            for piece, (slot, shape) in zip(flat.clone().split(sizes), slots):
                parts[slot] = piece.view(shape)
        return map_tensors(self.skeleton, lambda s: parts[s.index])


class GraphedCall:
    """``fn(*args)`` replayed from one CUDA graph per signature of ``args`` (see the module docstring).

    ``record(fn, device) -> (replay, graph)`` records; tests give a stand-in that replays by calling
    ``fn`` again, so the bookkeeping runs on any device."""

    MAX_GRAPHS = 4
    #: inputs larger than this run eagerly: a graph keeps a copy of them, and the backward's own
    #: intermediate buffers, for as long as it is kept
    MAX_INPUT_BYTES = 1 << 30

    def __init__(self, record: Optional[Callable] = None) -> None:
        self.entries: dict = {}
        self.eager: set = set()
        self.record = record if record is not None else record_cuda_graph

    def release(self) -> None:
        """Drop every recorded graph and its buffers (the next call of a signature records again)."""
        self.entries.clear()
        self.eager.clear()

    def __call__(self, fn: Callable[..., Any], args: tuple, key: Hashable = (),
                 hold: Optional[Callable[[], list]] = None) -> Any:
        tensors: list[torch.Tensor] = []
        atoms: list = []
        try:
            _walk(args, tensors, atoms)
        except _Unseen:
            return fn(*args)
        if not tensors:
            return fn(*args)
        device = tensors[0].device
        if any(t.device != device for t in tensors):  # a graph runs on one device
            return fn(*args)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # the caller records a graph
            return fn(*args)
        sig = (key, tuple(atoms), tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors))
        if sig in self.eager:
            return fn(*args)
        # one buffer per distinct tensor (a tensor the inputs hold twice is one input of the graph)
        first: dict = {}
        slot = tuple(first.setdefault((t.data_ptr(), t.shape, t.stride(), t.dtype), i) for i, t in enumerate(tensors))
        sig = sig + (slot,)
        hit = self.entries.get(sig)
        if hit is not None:
            copy_all(hit.static, [tensors[i] for i in hit.unique])
            hit.replay()
            return hit.results()
        unique = sorted(set(slot))
        if sum(tensors[i].numel() * tensors[i].element_size() for i in unique) > self.MAX_INPUT_BYTES:
            self.eager.add(sig)
            return fn(*args)
        static = [torch.empty_strided(tensors[i].shape, tensors[i].stride(), dtype=tensors[i].dtype,
                                      device=tensors[i].device) for i in unique]
        copy_all(static, [tensors[i] for i in unique])
        at = {i: static[n] for n, i in enumerate(unique)}
        it = iter(range(len(tensors)))
        s_args = map_tensors(args, lambda _t: at[slot[next(it)]])
        result = fn(*s_args)  # eager on the copies: compiles, binds, and is this call's result
        entry = self._record(fn, s_args, result, static, unique, device, hold)
        # a result that is (a view of) one of the copies would change with the next call's inputs
        mine = {b.untyped_storage().data_ptr() for b in static}
        result = map_tensors(result, lambda t: t.clone() if t.untyped_storage().data_ptr() in mine else t)
        if entry is None:
            self.eager.add(sig)
        else:
            if len(self.entries) >= self.MAX_GRAPHS:  # the oldest signature's graph and buffers go
                self.entries.pop(next(iter(self.entries)))
            self.entries[sig] = entry
        return result

    def _record(self, fn, s_args, result, static, unique, device, hold) -> Optional[_Entry]:
        skeleton, out = flatten_tensors(result)
        groups: dict = {}
        for i, t in enumerate(out):
            groups.setdefault((t.dtype, t.device), []).append(i)
        flats, views = [], [None] * len(out)
        for (dtype, dev), idx in groups.items():
            sizes = [out[i].numel() for i in idx]
            flat = torch.empty(sum(sizes), dtype=dtype, device=dev)
            for i, piece in zip(idx, flat.split(sizes)):
                views[i] = piece.view(out[i].shape)
            flats.append((flat, sizes, [(i, out[i].shape) for i in idx]))

        def run() -> None:
            got: list[torch.Tensor] = []
            map_tensors(fn(*s_args), lambda t: got.append(t))
            if len(got) != len(out) or any(a.shape != b.shape or a.dtype != b.dtype for a, b in zip(got, out)):
                raise RuntimeError("the recorded call's outputs differ from the eager call's")
            copy_all(views, got)

        try:
            replay, graph = self.record(run, device)
        except Exception:  # noqa: BLE001 - a call the graph cannot record runs eagerly (same results)
            return None
        held = hold() if hold is not None else None
        return _Entry(static, unique, replay, flats, len(out), skeleton, graph, held)
