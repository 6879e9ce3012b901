"""Layers that move entries without changing them: reshapes (``J^T = I``) and per-sample
selections (slices, zero padding and permutations of the per-sample dims: a 0/1 ``J^T`` with at most
one entry per row and column)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn
import torch.nn.functional as F

from spscan.layers.base import LayerUnit, PerDevice, UnitCapabilities, _identity_pattern

__all__ = ["ReshapeUnit", "UnflattenUnit", "PerSampleReshapeUnit", "SelectionUnit", "ParamCatUnit"]


class ReshapeUnit(LayerUnit):
    """``nn.Flatten`` / ``nn.Identity``: the flattened activation is unchanged, ``J^T = I`` (shared)."""

    shared = True
    capabilities = UnitCapabilities(structured_operator=True)

    @classmethod
    def capabilities_for(cls, module):
        return replace(cls.capabilities, shape_preserving=isinstance(module, nn.Identity))

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        if isinstance(module, nn.Flatten):
            nd = len(in_shape) + 1
            sd = module.start_dim % nd
            if sd == 0:
                raise ValueError(f"layer {index} (Flatten): start_dim >= 1 expected (the batch dim must stay), "
                                 f"got start_dim={module.start_dim}")
        self.pattern = _identity_pattern(self.d_in)
        self._ones = PerDevice(lambda dtype, device: torch.ones(self.d_in, dtype=dtype, device=device))

    @property
    def cost_family(self) -> str:
        """Every reshape (``nn.Flatten``, ``nn.Unflatten``, a traced ``view``) is priced by the fitted reshape."""
        return "ReshapeUnit"

    def run(self, x, tensors):
        m = self.module
        if type(m) is nn.Flatten:  # its forward, without the module call
            return x.flatten(m.start_dim, m.end_dim), (x.dtype, x.device)
        return m(x), (x.dtype, x.device)

    def fill(self, saved, tensors):
        return self._ones.get(*saved)

    def apply_transposed(self, saved, tensors, g):
        return g

    def chain_step(self, needed=None):
        if type(self).apply_transposed is not ReshapeUnit.apply_transposed:
            return super().chain_step(needed)
        in_shape = self.in_shape
        return lambda saved, tensors, g: (g.reshape((g.shape[0],) + in_shape), None)


class UnflattenUnit(ReshapeUnit):
    """``nn.Unflatten`` of a per-sample dim: the flattened activation is unchanged, ``J^T = I``."""

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        nd = len(in_shape) + 1
        if isinstance(module.dim, int) and module.dim % nd == 0:
            raise ValueError(f"layer {index} (Unflatten): dim >= 1 expected (the batch dim must stay), "
                             f"got dim={module.dim}")
        super().__init__(index, module, in_shape, out_shape)


class _PerSampleReshape(nn.Module):
    """``view``/``reshape``/``flatten`` that keeps the batch dim: ``(B, *a) -> (B, *shape)``.

    ``memory``: where the traced chain's result is laid out in another order than row-major (a batch-first
    recurrent layer's output, a view of time-major memory), its dims from the outermost in memory to the
    innermost: the result is made so too, so what reads it in memory order (dropout's mask) reads it as in the
    model."""

    def __init__(self, shape: tuple[int, ...], memory: Optional[tuple[int, ...]] = None):
        super().__init__()
        self.shape = tuple(shape)
        self.memory = None if memory is None else tuple(memory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.reshape((x.shape[0],) + self.shape)
        if self.memory is None:  # row-major, as in the model (``out.contiguous()`` of a view of time-major memory)
            return y.contiguous()
        back = sorted(range(len(self.memory)), key=self.memory.__getitem__)
        return y.permute(self.memory).contiguous().permute(back)


class PerSampleReshapeUnit(ReshapeUnit):
    """A traced ``view``/``reshape``/``flatten``/``contiguous`` keeping the batch dim: ``J^T = I``."""


class _Selection(nn.Module):
    """A traced basic-indexing slice ``x[key]``, a constant zero ``F.pad(x, pad)`` (any dims, channels too),
    a permutation of the dims ``x.permute(dims)`` (``transpose``/``swapaxes`` of two dims; dim 0 stays), or
    ``index``: output entry ``j`` of a sample is its input entry ``arg[j]`` (a chain of moves found by probing)."""

    def __init__(self, kind: str, arg: Any) -> None:
        super().__init__()
        if kind not in ("slice", "pad", "permute", "index"):
            raise ValueError(f"unknown selection kind {kind!r}")
        self.kind, self.arg = kind, arg
        self.index = PerDevice.index(arg) if kind == "index" else None  # arg: the source entry of each output entry

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "slice":
            return x[self.arg]
        if self.kind == "pad":
            return F.pad(x, self.arg)
        if self.kind == "permute":
            return x.permute(self.arg)
        return x.reshape(x.shape[0], -1).index_select(1, self.index.on(x.device))

    def extra_repr(self) -> str:
        return f"{self.kind}, {self.arg!r}"


def _selection_pattern(src: np.ndarray, d_in: int, d_out: int, what: str) -> sp.csr_array:
    """The 0/1 ``J^T`` (``d_in x d_out``) of an output whose entry ``j`` is input entry ``src[j]`` (``-1``: a
    constant, no input); ``ValueError`` if an input entry is read twice or the sizes disagree."""
    if src.size != d_out:
        raise ValueError(f"{what}: {src.size} selected entries for an output of {d_out}")
    cols = np.flatnonzero(src >= 0)
    rows = src[cols]
    order = np.argsort(rows, kind="stable")
    rows, cols = rows[order], cols[order]
    if rows.size > 1 and not bool((rows[1:] != rows[:-1]).all()):
        raise ValueError(f"{what}: an input entry is read twice (not a selection)")
    indptr = np.zeros(d_in + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=d_in), out=indptr[1:])
    return sp.csr_array((np.ones(rows.size), cols.astype(np.int64), indptr), shape=(d_in, d_out))


class SelectionUnit(LayerUnit):
    """A per-sample selection: every output entry is one input entry or a zero, each input entry
    read at most once. ``x[:, :, ::2, ::2]`` (a strided slice: ``J^T`` scatters the gradient into
    zeros) and ``F.pad(x, (0, 0, 0, 0, p, p))`` (zero padding, here of channels: ``J^T`` crops), the
    two halves of He et al.'s option-A shortcut; ``x.transpose(1, 2)`` (a permutation: ``J^T`` is the
    inverse permutation), the token mixing of an MLP-Mixer. ``J^T`` is a 0/1 matrix with at most one
    entry per row and column (shared by the batch); its operator is the scatter, the crop or the
    inverse permutation itself."""

    shared = True
    capabilities = UnitCapabilities(structured_operator=True)

    def __init__(self, index: int, module: _Selection, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
        super().__init__(index, module, in_shape, out_shape)
        d_in = self.d_in
        with torch.no_grad():
            if module.kind != "pad":
                probe = module(torch.arange(2 * d_in, dtype=torch.int64).reshape((2,) + self.in_shape))
                probe = probe.reshape((2,) + self.out_shape) if module.kind == "index" else probe
                if probe.dim() < 1 or probe.shape[0] != 2 or not bool((probe[1] - probe[0] == d_in).all()):
                    what = "index" if module.kind == "slice" else "permutation"
                    raise ValueError(f"{what} {module.arg!r}: the batch dim must be kept whole and first")
                src = probe[0].reshape(-1)
            else:
                src = F.pad(torch.arange(d_in, dtype=torch.int64).reshape((1,) + self.in_shape), module.arg,
                            value=-1).reshape(-1)
        self.pattern = _selection_pattern(src.numpy(), d_in, self.d_out, module.kind)
        if module.kind == "permute":
            self._inverse = tuple(int(i) for i in np.argsort(module.arg))
        self._ones = PerDevice(lambda dtype, device: torch.ones(self.nnz, dtype=dtype, device=device))

    @property
    def name(self) -> str:
        return {"slice": "getitem", "pad": "pad", "permute": "permute", "index": "selection"}[self.module.kind]

    @property
    def cost_family(self) -> str:
        """Priced by the fitted reshape: a selection moves each element at most once, as a reshape's copy
        does, and autograd's own backward of it (a scatter into zeros, a crop, a permutation) does the same
        work as its operator. (Priced as the default layer, a pooling window's, the step of an adding-problem
        RNN read through ``out[:, -1]`` was predicted 25 ms dearer in the scan than it is.)"""
        return "ReshapeUnit"

    def run(self, x, tensors):
        y = self.module(x)
        return (y.reshape((x.shape[0],) + self.out_shape) if self.module.kind == "index" else y), (x.dtype, x.device)

    def fill(self, saved, tensors):
        return self._ones.get(*saved)

    def apply_transposed(self, saved, tensors, g):
        b = g.shape[0]
        gy = g.reshape((b,) + self.out_shape)
        if self.module.kind == "pad":
            return F.pad(gy, tuple(-p for p in self.module.arg)).reshape(b, self.d_in)
        if self.module.kind == "permute":
            return gy.permute(self._inverse).reshape(b, self.d_in)
        if self.module.kind == "index":
            return g.new_zeros((b, self.d_in)).index_copy_(1, self.module.index.on(g.device), g.reshape(b, -1))
        gi = gy.new_zeros((b,) + self.in_shape)
        gi[self.module.arg] = gy
        return gi.reshape(b, self.d_in)


class ParamCatUnit(LayerUnit):
    """``torch.cat([p.expand(B, ...), x], dim)``: one graph tensor joined along a per-sample dim with
    parameters repeated over the batch (a ViT's class token, DeiT's class and distillation tokens).
    ``J^T`` for ``x`` is the crop of its slice (a 0/1 selection shared by the batch); each parameter's
    gradient is its slice of ``g`` summed over the batch. ``pieces`` lists the cat's operands in order:
    ``None`` for ``x``, ``(qualified name, parameter)`` for the others."""

    shared = True
    capabilities = UnitCapabilities(structured_operator=True)

    def __init__(self, index: int, dim: int, pieces: list, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
        super().__init__(index, nn.Module(), in_shape, out_shape)
        nd = len(in_shape) + 1
        if sum(p is None for p in pieces) != 1 or not 1 <= dim % nd:
            raise ValueError("expected one graph tensor joined along a per-sample dim")
        self.dim = dim % nd
        self._x_at = next(i for i, p in enumerate(pieces) if p is None)
        params = [p for _, p in (q for q in pieces if q is not None)]
        self.roles = tuple(n for n, _ in (q for q in pieces if q is not None))
        self.params = params
        for p in params:
            if p.dim() != nd or p.shape[0] != 1 or any(a != b for k, (a, b) in enumerate(zip(p.shape[1:], in_shape))
                                                     if k + 1 != self.dim):
                raise ValueError(f"parameter of shape {tuple(p.shape)} does not join (B, *{in_shape}) along dim {dim}")
        sizes = [in_shape[self.dim - 1] if p is None else p[1].shape[self.dim] for p in pieces]
        self._sizes = sizes
        if sum(sizes) != out_shape[self.dim - 1]:
            raise ValueError(f"cat along dim {dim}: pieces of {sizes} for an output of {out_shape}")
        ids = torch.arange(self.d_in, dtype=torch.int64).reshape((1,) + tuple(in_shape))
        src = torch.cat([ids if p is None else torch.full((1,) + tuple(p[1].shape[1:]), -1, dtype=torch.int64)
                         for p in pieces], self.dim).reshape(-1).numpy()
        self.pattern = _selection_pattern(src, self.d_in, self.d_out, "cat")
        self._ones = PerDevice(lambda dtype, device: torch.ones(self.d_in, dtype=dtype, device=device))

    @property
    def name(self) -> str:
        return f"cat {', '.join(self.roles)}"

    def tensors(self) -> list[torch.Tensor]:
        return list(self.params)

    def parameters_for_roles(self) -> list[tuple[nn.Parameter, Optional[torch.Tensor]]]:
        return [(p, None) for p in self.params]

    def run(self, x, tensors):
        b = x.shape[0]
        it = iter(tensors)
        parts = [x if i == self._x_at else next(it).expand((b,) + tuple(-1 for _ in self.in_shape))
                 for i in range(len(self._sizes))]
        return torch.cat(parts, self.dim), (x.dtype, x.device)

    def fill(self, saved, tensors):
        return self._ones.get(*saved)

    def _slices(self, g):
        b = g.shape[0]
        return torch.split(g.reshape((b,) + self.out_shape), self._sizes, self.dim)

    def apply_transposed(self, saved, tensors, g):
        return self._slices(g)[self._x_at].reshape(g.shape[0], self.d_in)

    def param_grads(self, saved, tensors, g_out, needed=None):
        parts = [s for i, s in enumerate(self._slices(g_out)) if i != self._x_at]
        return [None if needed is not None and not needed[k] else s.sum(0, keepdim=True)
                for k, s in enumerate(parts)]
