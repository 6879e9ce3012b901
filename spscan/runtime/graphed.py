"""Device work replayed from CUDA graphs: a backward (:class:`GraphedCall`) or a wrapped model's whole
training step, forward and backward (:class:`GraphedStep`).

A wrapped model's step on a GPU is many small launches (each layer's forward, its operator, its
parameter gradients, the copies between them), and for the small models people train, their host cost
exceeds their device time: eager autograd launches dozens of kernels per step too. Recorded once as a
CUDA graph, each half of the step is one replay.

What a graph needs and what :class:`GraphedCall` does for it (:class:`GraphedStep` below does without
the input copies: its forward graph writes the activations where its backward graph reads them):

* **Fixed addresses.** A graph reads and writes the memory it was recorded with. The call's inputs (the
  upstream gradient, what the forward saved, the weights) are copied into buffers of its own (one
  ``torch._foreach_copy_`` call; on a GPU one device copy per tensor), and the outputs are copied out
  of the graph's memory into one new buffer per dtype (one copy each; the results are views of it).
  The caller's tensors may live anywhere and the results are the caller's to keep.
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

Used by the wrapped chains and traced graphs (:meth:`spscan.chain.model.ModelPlan.run_step`: the whole step,
else the backward alone) and the recurrent modules (:meth:`spscan.recurrent.plan.RecurrentFront.run_step`:
the whole step; :class:`spscan.recurrent.backward.GraphedBackward`: the backward alone); imports no
front end.
"""

from __future__ import annotations

import os
import traceback
import weakref
from typing import Any, Callable, Hashable, Optional

import torch

import spscan.kernels as _kernels
from spscan.runtime.autograd import (Unseen, flatten_tensors, keep_graph, map_tensors, refuse_second_derivative,
                                     tensors_and_signature)
from spscan.runtime.workspace import record_cuda_graph

__all__ = ["GraphedCall", "GraphedStep", "copy_all", "record_cuda_graph"]


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


def _buffer_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized buffer a copy of ``t`` can be written into: ``t``'s strides where no two of its
    elements share memory, else dense ones (an expanded tensor, the upstream gradient of a ``sum``, has
    stride 0, and a buffer with it could not be written)."""
    return torch.empty_like(t, memory_format=torch.preserve_format)


def _packing(outputs: list[torch.Tensor]) -> tuple[list, list[torch.Tensor]]:
    """One buffer per dtype for ``outputs``: ``(flats, views)``, ``flats`` as :func:`_copies` reads them and
    ``views[i]`` the place of ``outputs[i]`` in its buffer (what a recorded call copies its outputs into)."""
    groups: dict = {}
    for i, t in enumerate(outputs):
        groups.setdefault((t.dtype, t.device), []).append(i)
    flats, views = [], [None] * len(outputs)
    for (dtype, dev), idx in groups.items():
        sizes = [outputs[i].numel() for i in idx]
        flat = torch.empty(sum(sizes), dtype=dtype, device=dev)
        for i, piece in zip(idx, flat.split(sizes)):
            views[i] = piece.view(outputs[i].shape)
        flats.append((flat, sizes, [(i, outputs[i].shape) for i in idx]))
    return flats, views


def _copies(skeleton: Any, flats: list, n: int) -> Any:
    """The outputs a replay wrote into ``flats``, copied (one copy per buffer), in ``skeleton``'s structure."""
    parts: list[Optional[torch.Tensor]] = [None] * n
    for flat, sizes, slots in flats:
        for piece, (slot, shape) in zip(flat.clone().split(sizes), slots):
            parts[slot] = piece.view(shape)
    return map_tensors(skeleton, lambda s: parts[s.index])


class _Entry:
    """One recorded signature: the input buffers, the replay, the output buffers and what to return."""

    __slots__ = ("static", "unique", "replay", "flats", "n_out", "skeleton", "graph", "held")

    def __init__(self, static, unique, replay, flats, n_out, skeleton, graph, held) -> None:
        self.static, self.unique, self.replay = static, unique, replay
        self.flats, self.n_out, self.skeleton = flats, n_out, skeleton
        self.graph, self.held = graph, held

    def results(self) -> Any:
        """Copies of the outputs the last replay wrote, in the call's structure."""
        return _copies(self.skeleton, self.flats, self.n_out)


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
        try:
            tensors, structure = tensors_and_signature(args)
        except Unseen:
            return fn(*args)
        if not tensors:
            return fn(*args)
        device = tensors[0].device
        if any(t.device != device for t in tensors):  # a graph runs on one device
            return fn(*args)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # the caller records a graph
            return fn(*args)
        sig = (key, structure, tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors))
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
        static = [_buffer_like(tensors[i]) for i in unique]
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
        flats, views = _packing(out)

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


# ----------------------------------------------------------------------------- the whole step


class _Lease:
    """Held by the autograd node of one replayed forward: while it lives (and its backward has not run
    without ``retain_graph``), the recorded activations are that forward's and another forward of the
    signature runs eagerly."""

    __slots__ = ("entry", "__weakref__")

    def __init__(self, entry: "_StepEntry") -> None:
        self.entry = entry

    def __del__(self) -> None:
        if self.entry.lease is not None and self.entry.lease() is self:
            self.entry.lease = None


class _StepEntry:
    """One signature's forward and backward graphs, the input buffers they read and what they wrote.

    The forward is recorded on its first replayed call; the graph writes the outputs and every saved
    activation at addresses of its own, which the backward, recorded on the first backward, reads in
    place. The copied inputs (the activations: ``x``, a recurrent module's initial state) are read from
    buffers of the entry's own; the other inputs (the parameters) where they are (the signature holds
    their addresses: an optimizer updates them in place)."""

    def __init__(self, front, inputs: tuple, copied: int, needs: tuple, record: Optional[Callable]) -> None:
        # record None: a warm-up entry, whose forward and backward run eagerly (what a recording will run)
        self.front, self.needs, self.record = front, needs, record
        self.static: list[Optional[torch.Tensor]] = [
            None if t is None else _buffer_like(t) for t in inputs[:copied]]
        self.inputs = (*self.static, *inputs[copied:])
        self.static_gy: Optional[list[torch.Tensor]] = None
        self.outputs: tuple = ()
        self.state: Any = None
        self.out: Any = None
        self.replay_forward: Optional[Callable[[], None]] = None
        self.replay_backward: Optional[Callable[[], None]] = None
        self.graphs: list = []
        self.held: list = []  # the front end's buffers each recording reads (front.step_buffers())
        self.failed = False  # the forward could not be recorded: the signature runs eagerly
        self.backward_eager = False  # the backward could not be recorded: it runs eagerly after a replay
        self.error: Optional[str] = None  # why a recording failed ("forward: ..." or "backward: ...")
        self.lease: Optional[Any] = None  # weak reference to the live _Lease

    def busy(self) -> bool:
        return self.lease is not None and self.lease() is not None

    def _forward(self) -> None:
        with torch.no_grad():
            outputs, self.state = self.front.scan_forward(self.inputs)
            if not all(isinstance(o, torch.Tensor) for o in outputs):
                raise TypeError("a recorded step's outputs are tensors")
            self.outputs = tuple(outputs)

    def _backward(self) -> None:
        with torch.no_grad():
            grads = self.front.step_backward(self.state, tuple(self.static_gy), self.needs)
            skeleton, got = flatten_tensors(tuple(grads))
            flats, views = _packing(got)  # written by the graph: a replay's results leave in one copy each
            copy_all(views, got)
            self.out = (skeleton, flats, len(got))

    def recorded(self, device: torch.device) -> bool:
        """Record the forward if it is not yet; ``False`` where it cannot be (then it runs eagerly)."""
        if self.record is None:
            return True
        if self.replay_forward is None and not self.failed:
            try:
                self.replay_forward, graph = self.record(self._forward, device)
            except Exception as e:  # noqa: BLE001 - what the graph cannot record runs eagerly
                self.failed = True
                self.error = _why("forward", e)
                return False
            self.graphs.append(graph)
            self.held.append(self.front.step_buffers())
        return not self.failed

    def run_forward(self, copied: tuple) -> tuple:
        """The outputs for the copied inputs ``copied`` (copies: the graph rewrites its own at the next replay)."""
        copy_all([s for s in self.static if s is not None], [t for t in copied if t is not None])
        if self.record is None:
            self._forward()
        else:
            self.replay_forward()
        return tuple(o.clone() for o in self.outputs)

    def run_backward(self, gys: tuple) -> tuple:
        """The gradients of the inputs for the upstream gradients ``gys`` of the last replayed forward's outputs."""
        if self.static_gy is None:
            self.static_gy = [torch.empty(g.shape, dtype=g.dtype, device=g.device) for g in gys]
        copy_all(self.static_gy, list(gys))
        if self.record is None:
            self._backward()
            return _copies(*self.out)
        if self.replay_backward is None and not self.backward_eager:
            try:
                self.replay_backward, graph = self.record(self._backward, gys[0].device)
                self.graphs.append(graph)
                self.held.append(self.front.step_buffers())
            except Exception as e:  # noqa: BLE001 - the backward runs eagerly on the forward's activations
                self.backward_eager = True
                self.error = _why("backward", e)
        if self.backward_eager:
            with torch.no_grad():
                return tuple(self.front.step_backward(self.state, tuple(self.static_gy), self.needs))
        self.replay_backward()
        return _copies(*self.out)


# the installed package's own folders (spscan, spscan.kernels): a frame there is this package's, wherever the
# checkout or a user's code lives (a clone folder named ``spscan`` holds the tests too)
_PACKAGE_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep
                      for f in (os.path.dirname(os.path.abspath(__file__)), _kernels.__file__))


def _why(part: str, e: Exception) -> str:
    """A failed recording's reason, one line: what was recorded, the device's or the code's error and
    where it was raised (the innermost frame of this package, else the innermost)."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if os.path.abspath(f.filename).startswith(_PACKAGE_DIRS)]
    at = (ours or frames)[-1:] if frames else []
    where = "".join(f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})" for f in at)
    return f"{part}: {type(e).__name__}: {first[:200]}{where}"


class _GraphedStepFunction(torch.autograd.Function):
    """Forward: the recorded forward's replay. Backward: the recorded backward's."""

    @staticmethod
    def forward(ctx, entry: _StepEntry, copied: int, *inputs):  # type: ignore[override]
        outputs = entry.run_forward(inputs[:copied])
        lease = _Lease(entry)
        entry.lease = weakref.ref(lease)
        ctx.lease = lease
        ctx.save_for_backward(*inputs)  # read in backward: a second backward without retain_graph raises
        return outputs

    @staticmethod
    def backward(ctx, *gys):  # type: ignore[override]
        inputs = ctx.saved_tensors
        entry = ctx.lease.entry
        with torch.no_grad():
            grads = entry.run_backward(gys)
        if not keep_graph():  # the activations were read for the last time: another forward may replay
            entry.lease = None
        out = (None, None, *grads)
        if torch.is_grad_enabled():
            out = refuse_second_derivative(list(inputs) + list(gys), out)
        return out


class GraphedStep:
    """A wrapped module's whole training step replayed from two CUDA graphs per signature: the forward
    (which keeps the activations at addresses of its own) and the backward (which reads them there).

    ``front`` is a front end of the autograd bridge (:class:`~spscan.runtime.autograd.FrontEnd`): its
    ``scan_forward(inputs) -> (outputs, state)`` is recorded as it is; ``step_backward(state, grad_outputs,
    needs)`` gives one gradient (or None) per input, as ``scan_backward`` does but always eagerly (the graph
    records it); both run with gradient recording off. ``step_buffers()``: the buffers of its own a
    recording reads (an engine's arenas, which a later batch size replaces), kept with the graph.
    :meth:`__call__` gives the outputs of one forward through the graphs, recorded on a signature's second
    call. Its first call runs the same ``scan_forward`` and ``step_backward`` eagerly, on buffers of its
    own: what they make on first use (a binding's index tables uploaded from the host, a kernel's compiled
    specialization, recycled buffers) is made then, since a capture refuses a copy from the host
    (``torch.cuda.make_graphed_callables`` warms up the callables it records the same way).
    :meth:`__call__` gives ``None`` where the caller runs its ordinary path instead: grad mode off,
    autocast, a parameter that is not a leaf, a signature whose recording failed (:attr:`unrecordable`
    then says so, and :attr:`failure` why; an entry's :attr:`_StepEntry.error` also keeps why its
    backward could not be), and a forward whose signature's activations still belong to an earlier
    forward whose backward has not run (forwards of several micro-batches before their backwards).
    Dropout's random numbers are drawn anew by every replay (CUDA graphs carry the generator's offsets); a
    batch-norm's running statistics are updated by every replay, as in eager. A forward that records
    an autograd graph of its own (an opaque node's call, whose backward asks autograd for a
    vector-Jacobian product) is recorded with it, as ``torch.cuda.make_graphed_callables`` records a
    module's: the forward graph rewrites the tensors that autograd graph saved, in place, and the
    backward graph replays its kernels on them (:class:`GraphedCall`, which copies a saved state into
    buffers of its own, cannot, and runs such a backward eagerly).
    """

    MAX_GRAPHS = 4

    def __init__(self, front, record: Optional[Callable] = None) -> None:
        self.front = front
        self.record = record if record is not None else record_cuda_graph
        self.entries: dict = {}
        self.seen: set = set()
        self.failure: Optional[str] = None  # the last call declined as its signature's recording failed: why

    @property
    def unrecordable(self) -> bool:
        """Whether the last call declined as its signature's recording failed (:attr:`failure` says why)."""
        return self.failure is not None

    def release(self) -> None:
        self.entries.clear()
        self.seen.clear()

    def __call__(self, inputs: tuple, copied: int, key: Hashable = ()) -> Optional[tuple]:
        """The outputs of ``front.scan_forward(inputs)``, recorded for autograd, from the graphs; or ``None``.

        ``inputs[:copied]``: the activations (tensors or ``None``), copied into the entry's buffers;
        ``inputs[copied:]``: the parameters, read in place (their addresses are part of the signature).
        ``key``: what else selects a graph (the modes the front end's forward follows)."""
        self.failure = None
        params = inputs[copied:]
        if not torch.is_grad_enabled() or torch.is_autocast_enabled() or any(t.grad_fn is not None for t in params):
            return None
        acts = [t for t in inputs[:copied] if t is not None]
        if not acts:
            return None
        device = acts[0].device
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        needs = tuple(t is not None and t.requires_grad for t in inputs)
        sig = (key, tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in inputs[:copied]),
               needs, tuple(t.data_ptr() for t in params))
        entry = self.entries.get(sig)
        if entry is None:
            if sig not in self.seen:
                if len(self.seen) >= 64:
                    self.seen.clear()
                self.seen.add(sig)
                # the first call runs what the recording will, eagerly: everything made on first use (a
                # binding's index tables, a kernel's compiled specialization, recycled buffers) is made
                # here, since making it during a capture copies from the host, which a capture refuses
                return _GraphedStepFunction.apply(_StepEntry(self.front, tuple(inputs), copied, needs, None),
                                                  copied, *inputs)
            if len(self.entries) >= self.MAX_GRAPHS:
                self.entries.pop(next(iter(self.entries)))
            entry = self.entries[sig] = _StepEntry(self.front, tuple(inputs), copied, needs, self.record)
        if entry.busy():
            return None
        if not entry.recorded(device):
            self.failure = entry.error
            return None
        return _GraphedStepFunction.apply(entry, copied, *inputs)
