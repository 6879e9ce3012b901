"""Recurrent layers inside a traced model: an ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` called anywhere in a model's
forward is one node of the graph whose forward and backward are the recurrent front end's (front ends nest:
the graph front end calls :mod:`spscan.recurrent.plan` / :mod:`spscan.recurrent.stacked` for that node).

* **The rewrite** (:func:`recurrent_calls`, made at trace time before nodes are matched to units). The layer's
  call ``self.rnn(x)`` / ``self.rnn(x, hx)``, whose result is a tuple, becomes a call of :class:`RecurrentCall`
  that returns one tensor, batch first: what the layer returns, packed per sample
  (``output`` with its time steps, then ``h_n`` and, for an LSTM, ``c_n``, each ``(L*D, H)`` per sample).
  Every ``out, h = self.rnn(x)`` element the model reads becomes an :class:`Unpack` of that tensor: the same
  tensor as the layer's, in its layout (``batch_first`` or time-major, ``h_n`` with the batch second), which
  only moves entries, so what the model selects from it (``h[-1]``, ``out[:, -1]``) is a selection unit.
  An LSTM's state pair used whole (``return logits, hidden``, as a character language model hands its state
  to the next batch) is rebuilt from its two unpacked tensors (:func:`lstm_state`). A layer whose result
  tuple itself is used otherwise (returned whole, passed on as a tuple) keeps its call (an opaque node).
* **The node** (:class:`RecurrentNodeUnit`): an opaque unit whose call runs the layer through its recurrent
  wrapper (:func:`spscan.wrap` of the layer, made once per node), so its ``J^T g`` to the input sequence
  (and to ``h_0``) and its parameter gradients come from the recurrent plan: the scan over time and the
  batched weight GEMMs. The wrapper decides per ``(T, B)`` between the scan and the layer's own backward
  (on a GPU also its whole step from CUDA graphs), as the layer wrapped alone does; lengths are planned per
  length. The graph's own cost model prices the node at what that decision predicts.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from spscan.chain.model import has_hooks
from spscan.layers.base import LayerUnit
from spscan.layers.opaque import OpaqueUnit
from spscan.options import option_default
from spscan.planner.step_profile import PREDICTED
from spscan.recurrent.cells import sequence_dims
from spscan.runtime.checks import buffers_kept

__all__ = ["RECURRENT_TYPES", "RecurrentCall", "RecurrentNodeUnit", "Unpack", "input_batch_dim", "lstm_state",
           "recurrent_calls"]

RECURRENT_TYPES = (nn.RNN, nn.GRU, nn.LSTM)
#: the model's planning options a recurrent layer's plan inside it takes as well (the scan's depth, the numeric
#: backend, the memory bound); the others are the graph's own (its batch, its layer forms)
SHARED_OPTIONS = ("levels", "backend", "max_memory")


def input_batch_dim(model: nn.Module, example_input: torch.Tensor) -> int:
    """Which dim of ``model``'s input is the batch: 1 for a model that reads its input time-major (``(T, B, ...)``,
    as ``nn.RNN`` without ``batch_first`` takes it, and as ``word_language_model`` hands token ids ``(T, B)`` to its
    embedding and then to its ``nn.LSTM``), else 0.

    Told by running the model twice without gradients (its random numbers and buffers left as they were): on
    the example, and on the example with one more entry along its dim 1. The input is time-major where a
    time-major recurrent layer inside the model (``batch_first=False``) reads a batch one larger in the second
    run: its batch is the input's dim 1. A batch-first model that transposes its input for a time-major layer
    (``self.rnn(x.transpose(0, 1))``) grows that layer's time steps instead, and stays batch first; so does a
    model the second run fails on (its own error comes from the planner's checks, on the example)."""
    layers = [m for m in model.modules() if isinstance(m, RECURRENT_TYPES) and not m.batch_first]
    if not layers or example_input.dim() < 2 or example_input.shape[1] < 1:
        return 0
    seen: dict[int, list] = {}

    def record(i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            seen.setdefault(i, []).append(tuple(x.shape) if isinstance(x, torch.Tensor) and x.dim() == 3 else None)
        return hook

    x = example_input.detach()
    more = torch.cat([x, x.narrow(1, 0, 1)], 1)
    hooks = [m.register_forward_pre_hook(record(i)) for i, m in enumerate(layers)]
    runs = []
    try:
        for example in (x, more):
            seen.clear()
            try:
                with torch.no_grad(), buffers_kept(model), torch.random.fork_rng(
                        devices=[x.device] if x.device.type == "cuda" else []):
                    model(example)
            except Exception:
                return 0
            runs.append({i: list(v) for i, v in seen.items()})
    finally:
        for h in hooks:
            h.remove()
    first, second = runs
    for i, shapes in first.items():
        again = second.get(i, [])
        for a, b in zip(shapes, again):
            if a is not None and b is not None and a[0] == b[0] and b[1] == a[1] + 1:
                return 1
    return 0


def _inner_mode(backward: str) -> str:
    """What a recurrent node's wrapper runs for the model wrapper's ``backward``: a forced scan forces it; any
    other mode lets the node decide (``auto``)."""
    return "scan" if backward == "scan" else "auto"


class RecurrentCall:
    """The call ``self.<path>(x[, hx])`` of a recurrent layer as a node target: ``(B, n)``, what the layer
    returns packed per sample (see :class:`Unpack`). With gradients on, it runs through the layer's recurrent
    wrapper; with gradients off (tracing, evaluation), the layer itself."""

    def __init__(self, path: str, module: nn.Module, parts: tuple[str, ...] = ("output", "h_n", "c_n")) -> None:
        self.path, self.module = path, module
        # what the model reads of the layer's results, in packing order: only those are packed, so the others
        # get no gradient (None) and the recurrent backward does no work for them
        self.parts = tuple(p for p in ("output", "h_n", "c_n") if p in parts and (p != "c_n" or self.is_lstm))
        self.__name__ = self.__qualname__ = f"{path.replace('.', '_')}_through_its_scan"
        self.backward = _inner_mode(option_default("backward"))
        self.options: dict = {}  # the model's planning options that a recurrent plan takes too (configure)
        self.seq_len: Optional[int] = None  # the planned length (the traced example's)
        self._wrapper: Optional[nn.Module] = None

    @property
    def is_lstm(self) -> bool:
        return isinstance(self.module, nn.LSTM)

    def configure(self, backward: str, options: dict) -> None:
        """Follow the model wrapper's ``backward`` (see :func:`_inner_mode`) and its planning options that apply
        to a recurrent plan too (:data:`SHARED_OPTIONS`); made before the node's first decision."""
        mode, options = _inner_mode(backward), {k: v for k, v in options.items() if k in SHARED_OPTIONS}
        if (mode, options) != (self.backward, self.options):
            self.backward, self.options, self._wrapper = mode, options, None

    def wrapper(self) -> nn.Module:
        """The layer's recurrent wrapper (made on first use, sharing the layer's parameters; never registered
        as a submodule of the model)."""
        if self._wrapper is None:
            import spscan  # the public entry: the recurrent front end that owns this layer

            self._wrapper = spscan.wrap(self.module, backward=self.backward, **self.options)
        return self._wrapper

    def decision(self, batch: int) -> Any:
        """The node's own scan-or-native decision for a batch of ``batch`` at the planned length."""
        if self.seq_len is None:
            return None
        return self.wrapper()._decision_for((self.seq_len, int(batch)))

    def __call__(self, x: torch.Tensor, hx: Any = None) -> torch.Tensor:
        m = self.module
        if x.dim() != 3:
            raise ValueError(f"self.{self.path} ({type(m).__name__}): a batched input (3 dims) expected inside a "
                             f"model, got {x.dim()} dims")
        T, b = sequence_dims(x, m.batch_first)
        if self.seq_len is None:
            self.seq_len = int(T)
        if torch.is_grad_enabled():
            out, state = self.wrapper()(x, hx)
        else:
            out, state = m(x, hx)
        h_n, c_n = state if self.is_lstm else (state, None)
        got = {"output": out if m.batch_first else out.transpose(0, 1), "h_n": h_n, "c_n": c_n}
        parts = [got[p].reshape(b, -1) if p == "output" else got[p].transpose(0, 1).reshape(b, -1)
                 for p in self.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1)

    def __repr__(self) -> str:
        return f"RecurrentCall({self.path!r})"


class Unpack:
    """One element of what a recurrent layer returns (``output``, ``h_n`` or ``c_n``) from its packed tensor
    ``(B, n)``: the layer's tensor in the layer's own layout. Only moves entries (:attr:`moves_entries`), so a
    chain of it and indexing is one selection unit."""

    moves_entries = True

    def __init__(self, call: RecurrentCall, which: str) -> None:
        m = call.module
        self.which = which
        self.batch_first = m.batch_first
        self.parts = call.parts
        self.states = sum(p != "output" for p in call.parts)
        self.layers = m.num_layers * (2 if m.bidirectional else 1)
        self.hidden = m.hidden_size
        self.width = self.hidden * (2 if m.bidirectional else 1)
        self.__name__ = self.__qualname__ = f"{call.path.replace('.', '_')}_{which}"

    def __call__(self, packed: torch.Tensor) -> torch.Tensor:
        b, n = packed.shape[0], packed.shape[1]
        size = self.layers * self.hidden
        steps = n - self.states * size if "output" in self.parts else 0  # the output's entries per sample
        start = sum(steps if p == "output" else size for p in self.parts[:self.parts.index(self.which)])
        if self.which == "output":
            out = packed.narrow(1, start, steps).reshape(b, steps // self.width, self.width)
            # time-major memory, as the layer lays its output out (a batch-first one is a view of it): what reads
            # it in memory order (dropout's random mask) reads it as in the model
            out = out.transpose(0, 1).contiguous()
            return out.transpose(0, 1) if self.batch_first else out
        return packed.narrow(1, start, size).reshape(b, self.layers, self.hidden).transpose(0, 1)

    def __repr__(self) -> str:
        return f"Unpack({self.which!r})"


def lstm_state(h_n: torch.Tensor, c_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An LSTM's ``(h_n, c_n)`` pair, made again from its two tensors where a model uses the pair whole."""
    return h_n, c_n


def recurrent_calls(graph: fx.Graph, root: nn.Module) -> list[RecurrentCall]:
    """Rewrite every call of a recurrent layer of ``root`` whose result the graph only takes apart (``out, h =
    self.rnn(x)``; an LSTM's ``(h_n, c_n)`` too) as described in the module docstring; the calls made."""
    made = []
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        m = root.get_submodule(node.target)
        if type(m) not in RECURRENT_TYPES or getattr(m, "proj_size", 0) or node.kwargs or not 1 <= len(node.args) <= 2 \
                or has_hooks(m) or m._forward_pre_hooks:  # hooks, pruning's too: its own call runs them
            continue
        users = list(node.users)
        if not users or not all(_element(u) is not None for u in users):
            continue
        lstm = isinstance(m, nn.LSTM)
        states = [u for u in users if _element(u) == 1]
        # (h_n, c_n) used as a pair (returned, passed on): both read, the pair rebuilt below
        pairs = [v for v in states if not all(_element(w) is not None for w in v.users)] if lstm else []
        read = {"output": any(_element(u) == 0 and u.users for u in users)}
        if lstm:
            read.update({which: bool(pairs) or any(_element(w) == i for v in states for w in v.users if w.users)
                         for i, which in enumerate(("h_n", "c_n"))})
        else:
            read["h_n"] = any(v.users for v in states)
        if not any(read.values()):
            continue  # nothing of it is read: left as it is (fx's dead code, dropped with the output's)
        call = RecurrentCall(node.target, m, tuple(p for p, r in read.items() if r))
        node.op, node.target = "call_function", call
        for u in users:
            if _element(u) == 0 or not lstm:
                which = "output" if _element(u) == 0 else "h_n"
                if which in call.parts:
                    u.target, u.args = Unpack(call, which), (node,)
                else:
                    graph.erase_node(u)  # read by nothing
                continue
            if u in pairs:
                with graph.inserting_after(u):
                    h = graph.call_function(Unpack(call, "h_n"), (node,))
                with graph.inserting_after(h):
                    c = graph.call_function(Unpack(call, "c_n"), (node,))
                with graph.inserting_after(c):
                    pair = graph.call_function(lstm_state, (h, c))
                u.replace_all_uses_with(pair)
                graph.erase_node(u)
                continue
            for w in list(u.users):
                which = ("h_n", "c_n")[_element(w)]
                if which in call.parts:
                    w.target, w.args = Unpack(call, which), (node,)
                else:
                    graph.erase_node(w)
            graph.erase_node(u)
        made.append(call)
    return made


def _element(node: fx.Node) -> Optional[int]:
    """``i`` for ``operator.getitem(t, i)`` with ``i`` 0 or 1 (also -2, -1), else None."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2 or node.kwargs:
        return None
    i = node.args[1]
    return i % 2 if isinstance(i, int) and not isinstance(i, bool) and -2 <= i <= 1 else None


class RecurrentNodeUnit(OpaqueUnit):
    """A recurrent layer's node (:class:`RecurrentCall`): its call through the layer's recurrent wrapper, its
    backward that wrapper's (the recurrent scan, or the layer's own where the node decides so). No CSR values:
    the graph's scan runs at depth 0 around it."""

    #: a whole step recorded as CUDA graphs does not nest the node's own step (its wrapper records its own)
    replays_in_step_graph = False

    def __init__(self, *args: Any, call: RecurrentCall, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recurrent = call
        self.reason = "a recurrent layer: its own recurrent scan (or its own backward, as it decides)"

    @property
    def name(self) -> str:
        return f"recurrent: {self.label}"

    @property
    def cost_family(self) -> str:
        """The call's wrapping (its read results packed, their gradients passed to the layer's backward) is a
        copy of its input and output elements: priced by the fitted reshape, as a selection is."""
        return "ReshapeUnit"

    def cost_terms(self, batch: int) -> list[tuple]:
        """What the node's own decision predicts: the layer's own step (``native``), and the candidate it
        chooses where the model runs the scan; and one layer of its input and output elements for the call's
        wrapping, as for any opaque node."""
        d = self.recurrent.decision(batch)
        if d is None:
            return super().cost_terms(batch)
        native = next(c.predicted_s for c in d.candidates if c.name == "native")
        chosen = d.chosen.predicted_s if d.chosen.predicted_s is not None else native
        return [(PREDICTED, {"native": native, "scan": chosen, "graph": chosen})] + LayerUnit.cost_terms(self, batch)
