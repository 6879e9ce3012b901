"""State arguments: a forward that takes, besides its input, tensors carried from one step to the next that carry
no gradient (``forward(input, hidden)``, as PyTorch's ``word_language_model`` takes its LSTM's state, detached
between batches for truncated back-propagation through time).

``spscan.wrap(model, (x, hidden))`` plans such a model as a model of one input: the traced module is
:class:`StateInputs`, whose forward reads each state tensor from a :class:`StateSlot` the wrapper fills before
every step (:meth:`StateSlot.set`). Each read is a call of :func:`read_state` on the input, a node of the graph
whose result depends on no graph tensor (autograd passes it no gradient: a constant of the step), so every
layer reading the state (a recurrent layer's ``h_0``) is planned as it would be with any other tensor of the
step that has no gradient. The read follows the input's batch: the planner's example batches (of 2, and one
longer along the input's batch dim to tell the batch dim) read the state's first samples, repeated where the
batch is longer than the state's; a step reads the state as the caller gave it.

Which dim of each state tensor is its batch is told once, from the example (:func:`state_batch_dims`): a dim of
the input's batch size, the model run on both one sample larger where that is ambiguous.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from spscan.errors import NotPlannable
from spscan.runtime.checks import buffers_kept

__all__ = ["StateInputs", "StateSlot", "read_state", "state_batch_dims"]


class StateSlot:
    """The state tensors of the step being run (flat, in the order of the forward's arguments), the dims they
    and the input take their batch on, and the structure of the arguments (``(h, c)`` pairs, lists)."""

    def __init__(self, state: Sequence[Any], input_dim: int, dims: Sequence[int]) -> None:
        leaves, self.spec = pytree.tree_flatten(tuple(state))
        self.input_dim, self.dims = int(input_dim), tuple(int(d) for d in dims)
        self.values: list[torch.Tensor] = [t.detach().clone() for t in leaves]
        # what every call must match: the per-sample shape (the batch dim left out), dtype and device of each
        self.per_sample = [self._per_sample(t, d) for t, d in zip(self.values, self.dims)]
        self.number = next(_NUMBERS)
        _SLOTS[self.number] = self

    @staticmethod
    def _per_sample(t: torch.Tensor, d: int) -> tuple:
        return tuple(t.shape[:d]) + tuple(t.shape[d + 1:]), t.dtype, t.device

    def mismatch(self, x: torch.Tensor, state: Sequence[Any]) -> Optional[str]:
        """Why ``state`` (the call's arguments after the input ``x``) is not a state the plans read (None: it is):
        another structure, a tensor of another per-sample shape, dtype or device, or batch than ``x``'s, or one
        that requires a gradient (the scan passes none to the state)."""
        leaves, spec = pytree.tree_flatten(tuple(state))
        if spec != self.spec or not all(isinstance(t, torch.Tensor) for t in leaves):
            return f"arguments of another structure than the example's ({pytree.tree_unflatten(leaves, spec)!r:.80})"
        b = x.shape[self.input_dim] if x.dim() > self.input_dim else None
        for i, (t, d, want) in enumerate(zip(leaves, self.dims, self.per_sample)):
            if t.dim() != len(want[0]) + 1 or self._per_sample(t, d)[::2] != want[::2]:
                return f"state tensor {i} of shape {tuple(t.shape)} on {t.device}, planned for {want[0]} per sample"
            if t.dtype != want[1] and not (t.is_floating_point() and want[1].is_floating_point):
                # (a floating state follows the model's dtype: ``model.double()`` after wrapping)
                return f"state tensor {i} of dtype {t.dtype}, planned for {want[1]}"
            if t.shape[d] != b:
                return f"state tensor {i} of batch {t.shape[d]} (dim {d}), the input's is {b}"
            if t.requires_grad:
                return (f"state tensor {i} requires a gradient (the scan passes none to the state: detach it, as "
                        "truncated back-propagation through time does between batches)")
        return None

    @contextlib.contextmanager
    def copied(self) -> Iterator[None]:
        """Planning runs the forward on the state: on copies of it, so a forward that updates its state in
        place (a streaming memory, a counter) leaves the caller's tensors as they were."""
        values = self.values
        self.values = [t.clone() for t in values]
        try:
            yield
        finally:
            self.values = values

    def set(self, state: Sequence[Any]) -> None:
        """The state the next step reads (checked by :meth:`mismatch`)."""
        self.values = pytree.tree_leaves(tuple(state))

    def read(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """State tensor ``i`` for the input ``x``: as given where its batch is ``x``'s, else (the planner's
        examples) its first samples, the first repeated where ``x``'s batch is larger."""
        t, d = self.values[i], self.dims[i]
        b, have = x.shape[self.input_dim], self.values[i].shape[self.dims[i]]
        if have == b:
            return t
        if have > b:
            return t.narrow(d, 0, b)
        return torch.cat([t] + [t.narrow(d, 0, 1)] * (b - have), d)


#: the slots :func:`read_state` reads, by number (a traced call's arguments are numbers, not objects)
_SLOTS: "weakref.WeakValueDictionary[int, StateSlot]" = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def read_state(x: torch.Tensor, slot: int, i: int) -> torch.Tensor:
    """State tensor ``i`` of the slot numbered ``slot`` for the input ``x`` (:meth:`StateSlot.read`), without a
    gradient: a call fx records as a node reading the input (so the planner keeps it in the step)."""
    return _SLOTS[slot].read(x, i).detach()


fx.wrap("read_state")


class StateInputs(nn.Module):
    """``model`` as a model of one input: ``model(x, *state)``, the state read from ``slot``. Its mode is the
    model's (``train()``/``eval()`` on the model are seen)."""

    def __init__(self, model: nn.Module, slot: StateSlot) -> None:
        super().__init__()
        self.model = model
        self.slot = slot

    @property
    def training(self) -> bool:  # type: ignore[override]
        return self.__dict__["_modules"]["model"].training if "_modules" in self.__dict__ else True

    @training.setter
    def training(self, value: bool) -> None:  # nn.Module.__init__ and train(): the model's mode is the one read
        pass

    def forward(self, x):
        n = len(self.slot.dims)
        leaves = [read_state(x, self.slot.number, i) for i in range(n)]
        return self.model(x, *pytree.tree_unflatten(leaves, self.slot.spec))


def _grown(t: torch.Tensor, d: int) -> torch.Tensor:
    return torch.cat([t, t.narrow(d, 0, 1)], d)


def state_batch_dims(model: nn.Module, x: torch.Tensor, state: Sequence[Any]) -> tuple[int, tuple[int, ...]]:
    """``(the input's batch dim, each state tensor's)`` for ``model(x, *state)``: the input's dim 0 or 1 (a
    time-major model's token ids ``(T, B)``), each state tensor's a dim of that size (an LSTM's ``h_0``
    ``(L, B, H)``: dim 1). Each assignment that fits the sizes is tried by running the model (without gradients,
    its random numbers, buffers and the caller's tensors left as they were) with the input and the state one
    sample larger; of those it runs on, the one whose state tensors take their batch on their first dims is
    taken (a time-major input with a padding mask ``(B, T)`` runs one entry longer in time too, with the mask
    longer along its dim 1: a mask's batch is its dim 0), then the input's dim 0.

    Raises:
        NotPlannable: no assignment fits (a state tensor without a dim of the input's batch size, or none the
            model runs on).
    """
    leaves, spec = pytree.tree_flatten(tuple(state))
    tried, runs = [], []
    for xd in (0, 1)[:max(1, min(2, x.dim()))]:
        b = x.shape[xd]
        options = [[d for d in range(t.dim()) if t.shape[d] == b] for t in leaves]
        if not all(options):
            continue
        combos = sorted(itertools.islice(itertools.product(*options), 16), key=sum)
        for dims in combos:
            tried.append((xd, dims))
            grown = pytree.tree_unflatten([_grown(t, d) for t, d in zip(leaves, dims)], spec)
            try:
                with torch.no_grad(), buffers_kept(model), torch.random.fork_rng(
                        devices=[x.device] if x.device.type == "cuda" else []):
                    model(_grown(x, xd), *grown)
            except Exception:
                continue
            runs.append((sum(dims), xd, tuple(dims)))
            break  # the first that runs, of this input dim's assignments by their dims' sum
    if runs:
        _, xd, dims = min(runs)
        return xd, dims
    shapes = ", ".join(str(tuple(t.shape)) for t in leaves)
    raise NotPlannable(f"{type(model).__name__}: state arguments {shapes} beside an input {tuple(x.shape)}: "
                       "found no dim of each that is the input's batch and that the model runs on one sample larger"
                       + ("" if tried else " (no state tensor has a dim of the input's batch size)"))
