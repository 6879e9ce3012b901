"""Whether a wrapped model's step runs the scan, its own autograd backward (``native``) or, on a GPU, the
scan's whole step replayed from CUDA graphs (``graph``, :mod:`spscan.runtime.graphed`).

They are candidates of one :class:`~spscan.planner.choose.Decision`, predicted from the machine's step
profile (:mod:`spscan.planner.step_profile`; fitted by :func:`spscan.calibrate`). ``backward="scan"``,
``"native"`` or ``"graph"`` forces one (``graph`` only where it is a candidate: on a GPU, a chain,
traced model or recurrent module). A wrapped model that runs ``native`` calls the model's own forward and
lets autograd do the backward: its gradients are autograd's, bit for bit, and it costs nothing besides
a dictionary lookup. The choice depends on the batch (and a recurrent module's length), so it is made
per input signature, on first use, from the formula (no timing).
"""

from __future__ import annotations

import abc
import os
import platform
import sys
import warnings
from collections import Counter
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from spscan.runtime.autograd import in_functorch_transform
from spscan.planner.choose import Candidate, Decision, choose, explain
from spscan.runtime.model_keys import ModelKeys
from spscan.planner.step_profile import StepProfile, load_step_profile, machine_key

__all__ = ["BACKWARD_MODES", "BackwardChoice", "NativeModule", "autocast_on",
           "batch_of", "current_key", "device_label", "graph_activation_bytes", "opaque_lines", "opaque_nodes",
           "opaque_warning", "outside_autocast", "recurrent_lines",
           "layers_decision", "recurrent_decision", "recurrent_graph_bytes", "recurrent_shapes", "sequence_signature",
           "step_profile"]

BACKWARD_MODES = ("auto", "scan", "native", "graph")


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def current_key(device: torch.device) -> str:
    """:func:`~spscan.planner.step_profile.machine_key` of ``device`` with this process's torch and threads."""
    return machine_key(device.type, device_label(device), torch.get_num_threads(), torch.__version__)


def check_backward(mode: Any) -> str:
    if mode not in BACKWARD_MODES:
        raise ValueError(f"backward: expected one of {BACKWARD_MODES}, got {mode!r}")
    return mode


def step_profile(device: Optional[torch.device]) -> StepProfile:
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return load_step_profile(dev.type, current_key(dev), torch.get_num_threads())


GRAPH_DETAIL = "the scan's whole step replayed from CUDA graphs"


def graph_activation_bytes(units: Sequence[Any], batch: int) -> int:
    """A lower bound of what a recorded step keeps: every layer's input at ``batch``, in float32."""
    return 4 * batch * sum(int(u.d_in) for u in units)


#: what ``backward="auto"`` runs under ``torch.autocast`` or in a ``torch.func`` transform
#: (:meth:`BackwardChoice._call_choice`)
AUTOCAST_NOTE = "under torch.autocast or a torch.func transform: native"


def _decide(question: str, native: float, scan: float, scan_detail: str, mode: str, prof: StepProfile,
            more: Sequence[Candidate] = (), notes: Sequence[str] = ()) -> Decision:
    cands = [Candidate("scan", scan, scan_detail), Candidate("native", native, "the model's own autograd backward"),
             *more]
    bound = prof.describe_thresholds()
    notes = (*notes, bound) if bound else tuple(notes)
    return choose(question, cands, None if mode == "auto" else mode, basis=prof.describe(), incumbent="native",
                  margin=prof.scan_margin, notes=((AUTOCAST_NOTE, *notes) if mode == "auto" else tuple(notes)))


def layers_decision(units: Sequence[Any], batch: int, device: Optional[torch.device], mode: str,
                    scan_detail: str, profile: Optional[StepProfile] = None, notes: Sequence[str] = ()) -> Decision:
    """Scan or native for a chain or traced graph of ``units`` at batch ``batch``; on a GPU also the scan's
    whole step replayed from CUDA graphs (``graph``), where the profile prices it and the activations a
    recording keeps fit the profile's ``graph_max_activation_bytes``. (An opaque node's own autograd backward is
    recorded with the rest: the forward graph rewrites the tensors its autograd graph saved, in place.)
    ``profile``: the step profile to decide with (default: the device's, :func:`step_profile`); ``notes``: lines
    the explanation adds (what else decides a call)."""
    prof = step_profile(device) if profile is None else profile
    layers = [t for u in units for t in u.cost_terms(batch)]
    more = []
    # a unit that records its own step (a recurrent layer's wrapper) does not nest in a recorded model step
    if (device is not None and torch.device(device).type == "cuda" and prof.has_regime("graph")
            and all(getattr(u, "replays_in_step_graph", True) for u in units)
            and graph_activation_bytes(units, batch) <= prof.graph_max_activation_bytes):
        more.append(Candidate("graph", prof.layers_time(layers, "graph"), GRAPH_DETAIL))
    return _decide(f"backward (batch {batch})", prof.layers_time(layers, "native"), prof.layers_time(layers, "scan"),
                   scan_detail, mode, prof, more, notes)


def recurrent_graph_bytes(shapes: Sequence[tuple[int, int]], seq_len: int, batch: int) -> int:
    """A lower bound of what a recorded recurrent step keeps: every (layer, direction)'s input and hidden state
    at every step, in float32."""
    return 4 * seq_len * batch * sum(i + h for i, h in shapes)


def recurrent_decision(cell: str, shapes: Sequence[tuple[int, int]], seq_len: int, batch: int,
                       device: Optional[torch.device], mode: str, scan_detail: str,
                       profile: Optional[StepProfile] = None) -> Decision:
    """Scan or native for a recurrent module of ``cell`` kind whose (layer, direction)s have
    ``(input_size, hidden_size)`` ``shapes``, for a ``(seq_len, batch)`` input; on a GPU also the whole
    step replayed from CUDA graphs (``graph``) where the activations a recording keeps fit
    the profile's ``graph_max_activation_bytes``. A profile that does not price a recurrent ``graph`` offers it
    without a prediction: chosen only when forced (:func:`spscan.calibrate` on a GPU prices it, and so
    does the shipped CUDA profile). ``profile`` as in :func:`layers_decision`."""
    prof = step_profile(device) if profile is None else profile
    t = {r: sum(prof.recurrent_time(cell, seq_len, batch, i, h, r) for i, h in shapes) for r in ("native", "scan")}
    more = []
    if (device is not None and torch.device(device).type == "cuda"
            and recurrent_graph_bytes(shapes, seq_len, batch) <= prof.graph_max_activation_bytes):
        if prof.has_recurrent_regime(cell, "graph"):
            more.append(Candidate("graph", sum(prof.recurrent_time(cell, seq_len, batch, i, h, "graph")
                                               for i, h in shapes), GRAPH_DETAIL))
        else:
            more.append(Candidate("graph", None, GRAPH_DETAIL + " (not priced by this profile: only when forced)"))
    return _decide(f"backward (T {seq_len}, batch {batch})", t["native"], t["scan"], scan_detail, mode, prof, more)


# -- nodes that run autograd's own backward inside the scan (explain() and the forced scan's warning)

#: what :func:`opaque_warning` names before "and N more"
OPAQUE_NAMED = 3


def opaque_nodes(plan: Any, mode: str = "auto") -> list[tuple[str, str, int]]:
    """``(label, reason, count)`` of the plan's nodes that run their own call and autograd's own backward inside
    the scan (:class:`~spscan.layers.opaque.OpaqueUnit`), in plan order, the same label and reason counted
    once; empty for a plan without units (a recurrent module's). ``mode``: the wrapper's ``backward``. A
    recurrent layer inside a traced model (``unit.recurrent``) is not one: it runs its own recurrent wrapper,
    whose decision :func:`recurrent_lines` shows."""
    from spscan.layers.opaque import OpaqueUnit

    seen: Counter = Counter()
    for u in getattr(plan, "units", ()) or ():
        if isinstance(u, OpaqueUnit) and getattr(u, "recurrent", None) is None:
            seen[(u.label, getattr(u, "reason", "") or "no analytic unit for this call")] += 1
    return [(label, reason, n) for (label, reason), n in seen.items()]


def recurrent_lines(plan: Any, batch: Optional[int]) -> list[str]:
    """What :meth:`BackwardChoice.explain` says of each recurrent layer inside a traced model: it runs its own
    recurrent wrapper, which decides per ``(T, B)`` (the scan, or the layer's own backward), and that decision
    for ``batch``, indented."""
    lines = []
    for u in getattr(plan, "units", ()) or ():
        rec = getattr(u, "recurrent", None)
        if rec is None:
            continue
        d = rec.decision(batch) if batch is not None else None
        lines.append(f"recurrent layer inside the model: {u.label}: its own recurrent wrapper decides per "
                     "(length, batch) between its scan and its own backward" + (":" if d is not None else ""))
        if d is not None:
            lines += ["  " + ln for ln in d.explain().splitlines()]
    return lines


def opaque_lines(plan: Any, mode: str = "auto") -> list[str]:
    """The lines :meth:`BackwardChoice.explain` adds for :func:`opaque_nodes`: one per node, what it runs and
    why, and once what that means."""
    nodes = opaque_nodes(plan, mode)
    if not nodes:
        return []
    lines = [f"autograd's own backward inside the scan: {label}: {reason}" + (f" (x{n})" if n > 1 else "")
             for label, reason, n in nodes]
    total = sum(n for _, _, n in nodes)
    lines.append(f"  ({total} node{'s' if total > 1 else ''}: where the scan runs, {'each' if total > 1 else 'it'} "
                 "runs its own call again with autograd recording and takes its J^T g and parameter gradients from "
                 "torch.autograd.grad; the gradients are exact, and the scan runs at depth 0 around it)")
    return lines


def opaque_warning(wrapper: Any, plan: Any) -> Optional[str]:
    """The message of the one warning a wrapper with a forced ``scan`` or ``graph`` gives where its plan has
    nodes that run autograd's own backward (None: it has none)."""
    nodes = opaque_nodes(plan, wrapper.backward_mode)
    if not nodes:
        return None
    total = sum(n for _, _, n in nodes)
    named = [label + (f" (x{n})" if n > 1 else "") for label, _, n in nodes[:OPAQUE_NAMED]]
    rest = sum(n for _, _, n in nodes[OPAQUE_NAMED:])
    which = ", ".join(named) + (f" and {rest} more" if rest else "")
    model = type(getattr(wrapper, wrapper._model_attr)).__name__
    return (f"spscan: {type(wrapper).__name__} around {model} with backward={wrapper.backward_mode!r}: "
            f"{total} node{'s' if total > 1 else ''} of its plan run{'' if total > 1 else 's'} autograd's own "
            f"backward inside the scan, not an analytic unit: {which}. The gradients are exact; explain() says "
            "why for each (backward='auto' chooses between the scan and autograd without this warning)")


#: the frames :func:`user_stacklevel` steps over: spscan's own and torch's (a module's call, torch.compiler.disable)
_INTERNAL = tuple(os.path.dirname(os.path.abspath(f)) + os.sep
                  for f in (os.path.dirname(os.path.abspath(__file__)), torch.__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` of :func:`warnings.warn`, called from the caller of this function, that points at the
    first frame outside spscan and torch (the user's line that called the wrapper)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


class BackwardChoice(ModelKeys, abc.ABC):
    """Mixin of the wrapped modules: the scan-or-native decision per input signature.

    A subclass sets :attr:`backward_mode` and implements :meth:`_backward_decision`. ``decision`` is
    the decision of the last signature seen (the example input's before any call)."""

    backward_mode: str = "auto"
    #: ``(rewrap, options, (shape, dtype) of the example input or None)`` as ``spscan.wrap`` made it: how it is
    #: made again where it is unpickled, ``rewrap(model, options, spec, training)`` (:meth:`__reduce_ex__`);
    #: None for a wrapper made otherwise
    wrapped_as: Optional[tuple] = None

    def __reduce_ex__(self, protocol: Any):
        """Pickled (``torch.save``, ``copy.deepcopy``, a process spawned with it) as the wrapped model and how
        ``spscan.wrap`` wrapped it: a plan holds device tables, recorded CUDA graphs and closures, and is
        made again where it is loaded (planning is deterministic), with the backward mode it had."""
        how = self.__dict__.get("wrapped_as")
        if how is None:
            return super().__reduce_ex__(protocol)
        rewrap, options, spec = how
        return rewrap, (getattr(self, self._model_attr), {**options, "backward": self.backward_mode}, spec,
                        self.training)

    def _init_choice(self, mode: str, first: Optional[Hashable]) -> None:
        self._keep_model_keys()  # the wrapper's state_dict is the model's (ModelKeys)
        self.backward_mode = check_backward(mode)
        self._decisions: dict[Hashable, Decision] = {}
        # the last signature, in a plain dict: setting a module attribute on every call costs microseconds
        self._seen: dict[str, Any] = {"last": first}
        if first is not None:
            # planned with the example input: decided now, not in the first step (a forced mode that is not
            # a candidate here, "graph" off a GPU, is refused now)
            self._decision_for(first)

    @abc.abstractmethod
    def _backward_decision(self, key: Hashable) -> Decision:
        """The decision for an input of signature ``key`` (a batch size, or ``(T, B)``)."""

    def _decision_for(self, key: Hashable) -> Decision:
        d = self._decisions.get(key)
        if d is None:
            d = self._decide_new(key)
        self._seen["last"] = key
        return d

    @torch.compiler.disable  # under torch.compile the planner's cost model runs as it is, not traced
    def _decide_new(self, key: Hashable) -> Decision:
        d = self._decisions[key] = self._backward_decision(key)
        return d

    # -- the call (the wrappers' forward): what runs, then the front end's scan step

    def forward(self, x: Any, *rest: Any) -> Any:
        """The wrapped module's call on ``x`` (and a recurrent module's ``hx``): its own forward where
        :meth:`_call_choice` says ``native`` or :meth:`_forward_alone`; under ``torch.autocast`` a forced
        scan with autocast off (:func:`outside_autocast`); else the front end's :meth:`_scan_step`."""
        if isinstance(x, torch.Tensor) and x.is_inference() and torch.is_grad_enabled():
            # made under torch.inference_mode (a frozen backbone's features): autograd takes it as a constant,
            # but the scan saves its input and may mark it as requiring a gradient; a normal tensor of it
            x = x.clone()
        key = self._signature(x)
        choice = self._call_choice(key, x)
        if choice == "native" or self._forward_alone():
            return getattr(self, self._model_attr)(x, *rest)
        if autocast_on(x):
            return outside_autocast(self.forward, self._scan_dtype(), x, *rest)
        return self._scan_step(key, choice, x, *rest)

    @abc.abstractmethod
    def _signature(self, x: Any) -> Optional[Hashable]:
        """The input signature the decision is per (a batch size, or ``(T, B)``); None for an input the
        scan's checks will refuse."""

    def _forward_alone(self) -> bool:
        """Whether this call runs the wrapped module's own forward whatever the choice (with gradients
        off, a model wrapper: nothing is recorded)."""
        return False

    @abc.abstractmethod
    def _scan_dtype(self) -> Optional[torch.dtype]:
        """The dtype the scan computes in: the module's parameters'."""

    @abc.abstractmethod
    def _scan_step(self, key: Optional[Hashable], choice: str, x: Any, *rest: Any) -> Any:
        """The call through the scan (``choice``: ``scan`` or ``graph``)."""

    def _after_step(self, key: Optional[Hashable], choice: str) -> None:
        """After a call of signature ``key`` that ran ``choice``: where it was ``graph`` and the whole step
        could not be recorded as CUDA graphs (the device refused an operation while recording; that call
        ran the scan's eager step, with the same gradients), ``backward="auto"`` decides the signature
        again with ``graph`` left unpriced: the next calls run what is predicted fastest of the rest."""
        if choice != "graph" or not self.plan.step_graphs.unrecordable:
            return
        if self.backward_mode != "auto" or key is None:
            return
        d = self._decision_for(key)
        if d.chosen.name != "graph":
            return
        why = self.plan.step_graphs.failure
        failed = " (its recording failed here" + (f": {why})" if why else ")")
        cands = [c if c.name != "graph" else Candidate("graph", None, c.detail + failed) for c in d.candidates]
        self._decisions[key] = choose(d.question, cands, None, basis=d.basis, incumbent=d.incumbent, margin=d.margin,
                                      notes=d.notes)

    def _call_choice(self, key: Optional[Hashable], x: Any) -> str:
        """What a call of signature ``key`` with input ``x`` runs: :meth:`_choice`, except that with
        ``backward="auto"`` a call under ``torch.autocast`` or inside a ``torch.func`` transform, or with a
        ``PackedSequence`` (variable-length sequences, which the scan does not take), runs the model's own
        forward and backward (``"native"``): the scan computes in the module's dtype, where autograd follows
        autocast's casts, and its backward runs on buffers of its own, which functorch cannot see through. A forced ``scan`` or ``graph`` runs under autocast as a custom function that
        does not take reduced precision does (``torch.amp.custom_fwd(cast_inputs=...)``): the wrapper calls
        :func:`outside_autocast`; inside a ``torch.func`` transform it is refused."""
        choice = self._choice(key)
        if choice != "native" and self.backward_mode == "auto" and (
                autocast_on(x) or in_functorch_transform() or isinstance(x, torch.nn.utils.rnn.PackedSequence)):
            return "native"
        return choice

    def _choice(self, key: Optional[Hashable]) -> str:
        """The candidate a call of signature ``key`` runs: the forced mode, else the decision's choice
        (``"scan"`` for ``None``, an input the scan's checks will refuse)."""
        if self.backward_mode != "auto":
            return self.backward_mode
        return "scan" if key is None else self._decision_for(key).chosen.name

    @property
    def decision(self) -> Optional[Decision]:
        """The scan-or-native :class:`~spscan.planner.choose.Decision` for the last input signature."""
        last = self._seen["last"]
        return None if last is None else self._decision_for(last)

    def explain(self) -> str:
        """What the planner chose for this model and what it compared each choice with, and every node that runs
        autograd's own backward inside the scan, with why (:func:`opaque_lines`)."""
        ds = ([self.decision] if self.decision is not None else []) + self.plan.all_decisions()
        text = explain(ds, f"{type(self).__name__} around {type(getattr(self, self._model_attr)).__name__}:")
        last = self._seen["last"]
        batch = last[-1] if isinstance(last, tuple) else last
        return "\n".join([text, *opaque_lines(self.plan, self.backward_mode), *recurrent_lines(self.plan, batch)])

    def _warn_opaque(self) -> None:
        """Before a step that runs the scan with a forced ``scan`` or ``graph``: one ``UserWarning`` per wrapper
        where the plan that runs has nodes that run autograd's own backward (:func:`opaque_warning`). Each plan
        is looked at once (a traced model's plan for its other mode is made on first use)."""
        seen = self._seen
        if seen.get("opaque_checked") is self.plan or self.backward_mode == "auto":
            return
        seen["opaque_checked"] = self.plan
        if seen.get("opaque_warned"):
            return
        message = opaque_warning(self, self.plan)
        if message is not None:
            seen["opaque_warned"] = True
            warnings.warn(message, UserWarning, stacklevel=user_stacklevel())


def autocast_on(x: Any) -> bool:
    """Whether ``torch.autocast`` is on for the device of the tensor ``x`` (False for anything else)."""
    return isinstance(x, torch.Tensor) and torch.is_autocast_enabled(x.device.type)


def outside_autocast(call: Callable[..., Any], dtype: Optional[torch.dtype], *args: Any) -> Any:
    """``call(*args)`` with autocast off for the device of ``args[0]`` and every floating tensor among
    ``args`` (or inside a tuple or list among them, an LSTM's ``(h_0, c_0)``) cast to ``dtype``, the
    module's own (None, a module without floating parameters: left as they are): how a forced ``scan`` or ``graph`` runs under ``torch.autocast``, as a custom function
    without reduced-precision support does (``torch.amp.custom_fwd(cast_inputs=dtype)``). Its outputs are
    in ``dtype``; autograd casts their gradients back to what the caller's graph holds."""

    def cast(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(dtype) if dtype is not None and v.is_floating_point() and v.dtype != dtype else v
        if isinstance(v, (tuple, list)):
            return type(v)(cast(t) for t in v)
        return v

    with torch.autocast(args[0].device.type, enabled=False):
        return call(*(cast(a) for a in args))


def recurrent_shapes(module: Any) -> list[tuple[int, int]]:
    """``(input_size, hidden_size)`` of each (layer, direction) of an ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM``,
    layer by layer (what :func:`recurrent_decision` prices)."""
    dirs = 2 if module.bidirectional else 1
    return [(module.input_size if layer == 0 else module.hidden_size * dirs, module.hidden_size)
            for layer in range(module.num_layers) for _ in range(dirs)]


def sequence_signature(module: Any, x: Any) -> Optional[tuple[int, int]]:
    """``(T, B)`` of a recurrent module's input (``(T, B, I)``, ``(B, T, I)`` if batch_first, or
    unbatched ``(T, I)``), or ``None`` for anything else."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3) or x.numel() == 0:
        return None
    if x.dim() == 2:
        return int(x.shape[0]), 1
    return (int(x.shape[1]), int(x.shape[0])) if module.batch_first else (int(x.shape[0]), int(x.shape[1]))


def batch_of(x: Any) -> Optional[int]:
    """The batch size of a model input ``(B, ...)``, or ``None`` for anything else."""
    return int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[0] > 0 else None


class NativeModule(ModelKeys, torch.nn.Module):
    """A model the scan cannot plan (fx cannot trace it, or a node or layer has no unit), wrapped with
    ``backward="auto"``: it runs its own forward and autograd's backward, and says why.

    ``decision`` offers the scan as a candidate without a prediction, its reason as the detail, so
    ``explain()`` reads like any other wrapper's.
    """

    backward_mode = "native"

    def __init__(self, model: torch.nn.Module, reason: str) -> None:
        super().__init__()
        self.model = model
        self._keep_model_keys()  # its state_dict is the model's (ModelKeys)
        self.reason = reason
        self.decision = choose("backward", [Candidate("native", None, "the model's own autograd backward"),
                                            Candidate("scan", None, f"not available: {reason}")],
                               basis="the scan cannot plan this model")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def explain(self) -> str:
        return explain([self.decision], f"{type(self).__name__} around {type(self.model).__name__}: the whole model "
                                        "runs autograd's own backward")
