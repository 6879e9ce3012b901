"""The layer library: one unit per layer type that knows its transposed-Jacobian pattern,
how to fill that pattern's values for a batch, and its parameter-gradient rule.

Every activation is flattened per sample in row-major ``(C, *spatial)`` order, exactly as
``x.flatten(1)`` does, so a layer mapping ``(B, *in_shape)`` to ``(B, *out_shape)`` has
``J^T`` of shape ``(d_in, d_out)`` with ``d_in = prod(in_shape)`` and ``d_out = prod(out_shape)``.

A unit's life:

* ``__init__`` (plan time, once): from shapes, hyper-parameters and any pruning mask only,
  build the canonical SciPy CSR ``pattern`` and the gather indices that map each stored entry
  to the tensor it is read from (a weight element, an activation element, ...).
* ``run(x, tensors)`` (every step): the layer's forward on ``(B, *in_shape)``; returns the
  output and what ``fill`` and ``param_grads`` need (saved activations, argmax indices, masks).
* ``fill(saved, tensors)``: the entries of ``J^T`` in the pattern's CSR order, ``(nnz,)`` when
  they do not depend on the sample (shared by the batch) or ``(B, nnz)`` otherwise.
* ``param_grads(saved, tensors, g_out)``: ``dl/dθ`` for each of the unit's learnable tensors
  from ``g_out = dl/dx_out`` of shape ``(B, d_out)``.

``tensors`` are the *effective* learnable tensors (for a module pruned with
``torch.nn.utils.prune`` that is ``weight_orig * weight_mask``), so the caller decides whether
they carry an autograd graph.

Pruning: entries of ``J^T`` that read a pruned weight (``weight_mask == 0``, or an exactly-zero
weight with ``prune_zeros=True``) are left out of the pattern. Those weights must stay zero
for as long as the plan is used; every ``run`` checks it and raises if one became non-zero.
"""

from __future__ import annotations

import abc

import math
from typing import Any, Optional, Sequence, Union

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import has_torch_function_unary

from spscan.kernels import cpu_pool
from spscan.kernels.backend import StructuredOperator

__all__ = [
    "LayerUnit",
    "LinearUnit",
    "ConvUnit",
    "ElementwiseUnit",
    "MaxPoolUnit",
    "AvgPoolUnit",
    "BatchNormUnit",
    "DropoutUnit",
    "ReshapeUnit",
    "LayerNormUnit",
    "GroupNormUnit",
    "SoftmaxUnit",
    "ElementwiseMoreUnit",
    "PReLUUnit",
    "UnflattenUnit",
    "SeparableResampleUnit",
    "ConvTransposeUnit",
    "make_unit",
    "supported_layer_types",
    "coo_to_csr",
    "LowRankFactors",
]


# ----------------------------------------------------------------------------- helpers


def coo_to_csr(rows: np.ndarray, cols: np.ndarray,
               shape: tuple[int, int]) -> tuple[sp.csr_array, Union[np.ndarray, slice]]:
    """Canonical CSR pattern from structural entries ``(rows[k], cols[k])``.

    Returns the pattern (data all ones, sorted indices, no duplicates) and ``order``, the
    permutation such that CSR entry ``e`` is structural entry ``order[e]`` (``slice(None)`` when the
    entries already came in CSR order). Raises if two
    structural entries coincide (a layer generator bug: each unit maps every entry to one source).
    """
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    key = rows * np.int64(shape[1]) + cols
    step = np.diff(key)
    order: Union[np.ndarray, slice]
    if step.size == 0 or bool((step > 0).all()):
        order = slice(None)  # generated in CSR order already: no sort, no copies
        r, c = rows, cols
    else:
        order = np.argsort(key, kind="stable")
        key = key[order]
        step = np.diff(key)
        r, c = rows[order], cols[order]
    if bool((step == 0).any()):
        k = int(np.flatnonzero(step == 0)[0])
        raise ValueError(f"duplicate structural entry ({r[k]}, {c[k]}) in a generated pattern")
    indptr = np.zeros(shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(r, minlength=shape[0]), out=indptr[1:])
    index_dtype = np.int32 if max(shape) < 2**31 - 1 and r.size < 2**31 - 1 else np.int64
    pattern = sp.csr_array(
        (np.ones(r.size), c.astype(index_dtype), indptr.astype(index_dtype)), shape=shape
    )
    return pattern, order


def _prod(shape: Sequence[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) if len(shape) else 1


def _tuple(v: Any, n: int) -> tuple[int, ...]:
    if isinstance(v, (tuple, list)):
        if len(v) != n:
            raise ValueError(f"expected {n} values, got {v!r}")
        return tuple(int(t) for t in v)
    return (int(v),) * n


def _flat_index(idx: Sequence[np.ndarray], dims: Sequence[int]) -> np.ndarray:
    """Row-major flat index of a multi-index (numpy broadcasting)."""
    out = np.zeros(np.broadcast(*idx).shape, dtype=np.int64) if len(idx) else np.zeros((), np.int64)
    for i, d in zip(idx, dims):
        out = out * d + i
    return out


class _IndexCache:
    """A numpy index array with per-device torch copies made on first use."""

    def __init__(self, array: np.ndarray):
        a = np.ascontiguousarray(array, dtype=np.int64)
        self.array = a if a.flags.writeable else a.copy()  # broadcast views are read-only; torch wants writable
        self._by_device: dict[torch.device, torch.Tensor] = {}

    def on(self, device: torch.device) -> torch.Tensor:
        t = self._by_device.get(device)
        if t is None:
            t = torch.from_numpy(self.array).to(device)
            self._by_device[device] = t
        return t


# ----------------------------------------------------------------------------- base class


class LayerUnit(abc.ABC):
    """One layer of a chain: its pattern, its value fill and its parameter-gradient rule.

    Attributes:
        index: position of the layer in the (flattened) chain, for messages.
        module: the ``nn.Module`` it stands for.
        in_shape, out_shape: per-sample shapes (no batch dimension).
        pattern: canonical SciPy CSR array of shape ``(d_in, d_out)``; its data is all ones.
        shared: ``True`` if ``fill`` returns ``(nnz,)`` values shared by the batch.
        roles: names of the learnable tensors on the module (``"weight"``, ``"bias"``) that
            ``tensors``/``param_grads`` refer to, in order; absent (``None``) ones are left out.
    """

    shared: bool = False
    roles: tuple[str, ...] = ()

    def __init__(self, index: int, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
        self.index = index
        self.module = module
        self.in_shape = tuple(in_shape)
        self.out_shape = tuple(out_shape)
        self.d_in = _prod(self.in_shape)
        self.d_out = _prod(self.out_shape)
        self.pattern: sp.csr_array
        self.roles = tuple(r for r in type(self).roles if _effective(module, r) is not None)

    # -- learnable tensors
    def tensors(self) -> list[torch.Tensor]:
        """The effective learnable tensors (``orig * mask`` for pruned ones), in ``roles`` order."""
        return [_effective(self.module, r) for r in self.roles]

    def parameters_for_roles(self) -> list[tuple[nn.Parameter, Optional[torch.Tensor]]]:
        """For each role, the ``nn.Parameter`` that holds it and the pruning mask (or ``None``)."""
        out = []
        for r in self.roles:
            if hasattr(self.module, r + "_orig") and hasattr(self.module, r + "_mask"):
                out.append((getattr(self.module, r + "_orig"), getattr(self.module, r + "_mask")))
            else:
                out.append((getattr(self.module, r), None))
        return out

    @property
    def name(self) -> str:
        return type(self.module).__name__

    # -- per step
    @abc.abstractmethod
    def run(self, x: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        """The layer's forward from its effective tensors, and what ``fill``/``param_grads`` need."""

    @abc.abstractmethod
    def fill(self, saved: Any, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``J^T`` values in the pattern's CSR order: ``(B, nnz)`` per sample or ``(nnz,)`` shared."""

    def param_grads(self, saved: Any, tensors: Sequence[torch.Tensor], g_out: torch.Tensor,
                    needed: Optional[Sequence[bool]] = None) -> list[Optional[torch.Tensor]]:
        """``dl/dθ`` for each role; ``needed[k] = False`` skips role ``k`` (returns ``None``)."""
        return [None] * len(self.roles)

    # -- the structured operator (matrix-free J^T)
    def apply_transposed(self, saved: Any, tensors: Sequence[torch.Tensor], g: torch.Tensor) -> torch.Tensor:
        """``J^T g`` for ``g`` ``(B, d_out)`` without forming ``J^T``: ``(B, d_in)`` (units that can)."""
        raise NotImplementedError

    @property
    def has_operator(self) -> bool:
        """Whether :meth:`apply_transposed` is implemented (the unit has a structured operator)."""
        return type(self).apply_transposed is not LayerUnit.apply_transposed

    @property
    def has_csr_values(self) -> bool:
        """Whether :meth:`fill` can give per-sample CSR values now (a layer that couples the samples
        of a batch cannot: it runs as a structured operator only)."""
        return True

    def operator(self, saved: Any, tensors: Sequence[torch.Tensor],
                 needed: Optional[Sequence[bool]] = None) -> "UnitOperator":
        """This step's ``J^T`` as a :class:`~spscan.kernels.backend.StructuredOperator`. ``needed``: the
        roles whose parameter gradients the operator may compute along with ``J^T g`` when that is
        cheaper (it is then applied to ``g = dl/d output`` exactly once, as in the linear scan)."""
        return UnitOperator(self, saved, tensors, needed)

    def chain_step(self, needed: Optional[Sequence[bool]] = None):
        """This layer's step of a depth-0 operator chain, decided once per signature: a function
        ``step(saved, tensors, g) -> (gi, grads)`` with ``g = dl/dy`` of shape ``(B, *out_shape)`` (or
        ``(B, d_out)``) and ``gi = J^T g`` of shape ``(B, *in_shape)``; ``grads`` is ``None`` when no role is
        ``needed``, else one entry per role (``None`` where not needed), computed from the same ``g``.

        Activations keep their natural shapes from step to step (no flattening between layers, as in
        autograd). The default adapts :meth:`apply_transposed` / :meth:`param_grads` (and a fused
        ``apply_transposed_and_param_grads`` where the unit has one); units override it with the
        one or two ATen calls autograd makes for the layer, their arguments fixed here.
        """
        want = list(needed) if needed is not None and any(needed) else None
        in_shape, d_out = self.in_shape, self.d_out
        fused = getattr(self, "apply_transposed_and_param_grads", None)
        apply, grads = self.apply_transposed, self.param_grads

        def step(saved, tensors, g):
            b = g.shape[0]
            g = g.reshape(b, d_out)
            if want is None:
                return apply(saved, tensors, g).reshape((b,) + in_shape), None
            if fused is not None:
                gi, pg = fused(saved, tensors, g, want)
                return gi.reshape((b,) + in_shape), pg
            gi = apply(saved, tensors, g)
            return gi.reshape((b,) + in_shape), grads(saved, tensors, g, want)

        return step

    @property
    def nnz(self) -> int:
        return int(self.pattern.nnz)

    def sparsity(self) -> float:
        """Fraction of guaranteed zeros: ``1 - nnz / (d_in * d_out)``."""
        return 1.0 - self.nnz / (self.d_in * self.d_out)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(index={self.index}, {self.name}, {self.in_shape}->{self.out_shape}, "
                f"nnz={self.nnz}, {'shared' if self.shared else 'per-sample'})")


class UnitOperator(StructuredOperator):
    """A unit's ``J^T`` for one step: :meth:`apply` is the layer's own input-gradient op (a conv's
    transposed convolution with the shared weight, a mask multiply for ReLU, a matmul for Linear,
    the pooling backward for max-pool); :meth:`values` fills the CSR values only when asked."""

    def __init__(self, unit: LayerUnit, saved: Any, tensors: Sequence[torch.Tensor],
                 needed: Optional[Sequence[bool]] = None) -> None:
        self.unit, self.saved, self.tensors = unit, saved, tensors
        self.shape = (unit.d_in, unit.d_out)
        self.shared = bool(unit.shared)
        self.needed = needed
        self.param_grads: Optional[list] = None  # set when apply() computed them on the way
        self.applied = 0

    def apply(self, g: torch.Tensor) -> torch.Tensor:
        return self.apply_into(g, None)

    def apply_into(self, g: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
        self.applied += 1
        fused = getattr(self.unit, "apply_transposed_and_param_grads", None)
        if fused is not None and self.needed is not None and any(self.needed):
            gi, self.param_grads = fused(self.saved, self.tensors, g, self.needed)
            return gi
        if out is not None and hasattr(self.unit, "apply_transposed_into"):
            return self.unit.apply_transposed_into(self.saved, self.tensors, g, out)
        return self.unit.apply_transposed(self.saved, self.tensors, g)

    def values(self) -> torch.Tensor:
        return self.unit.fill(self.saved, self.tensors)


def _effective(module: nn.Module, role: str) -> Optional[torch.Tensor]:
    if hasattr(module, role + "_orig") and hasattr(module, role + "_mask"):
        # pruned by torch.nn.utils.prune: recompute as its forward pre-hook does, keeping the graph
        return getattr(module, role + "_orig") * getattr(module, role + "_mask")
    return getattr(module, role, None)


def _identity_pattern(d: int) -> sp.csr_array:
    ar = np.arange(d, dtype=np.int32)
    return sp.csr_array((np.ones(d), ar, np.arange(d + 1, dtype=np.int32)), shape=(d, d))


class _WeightGatherMixin:
    """Units whose ``J^T`` entries are elements of one weight tensor (shared values)."""

    weight_gather: _IndexCache
    zero_weights: _IndexCache  # flat weight indices dropped from the pattern (must stay zero)

    def _drop_mask(self, module: nn.Module, prune_zeros: bool) -> np.ndarray:
        """Boolean per flat weight element: ``True`` if it is pruned (left out of the pattern)."""
        w = _effective(module, "weight").detach()
        drop = torch.zeros(w.numel(), dtype=torch.bool)
        if hasattr(module, "weight_mask"):
            drop |= (module.weight_mask.detach().reshape(-1) == 0).cpu()
        if prune_zeros:
            drop |= (w.reshape(-1) == 0).cpu()
        return drop.numpy()

    def _check_pruned_still_zero(self, w: torch.Tensor) -> None:
        if not self.zero_weights.array.size:
            return
        dropped = torch.index_select(w.detach().reshape(-1), 0, self.zero_weights.on(w.device))
        if bool((dropped != 0).any()):
            k = int(torch.nonzero(dropped != 0)[0, 0])
            raise ValueError(
                f"layer {self.index} ({self.name}): weight element {int(self.zero_weights.array[k])} was "
                f"pruned (left out of the pattern) at plan time but is now {float(dropped[k])}; "
                "pruned weights must stay zero — re-plan after changing the pruning"
            )

    def fill(self, saved: Any, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        w = tensors[0]
        # index_select: several times faster than advanced indexing for a 1-D gather on CPU
        return torch.index_select(w.detach().reshape(-1), 0, self.weight_gather.on(w.device))


# ----------------------------------------------------------------------------- Linear


class LinearUnit(_WeightGatherMixin, LayerUnit):
    """``nn.Linear`` on per-sample input ``(*, in_features)``: ``J^T = I_L ⊗ W^T`` (shared)."""

    shared = True
    roles = ("weight", "bias")

    def __init__(self, index, module: nn.Linear, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        fi, fo = module.in_features, module.out_features
        if len(in_shape) < 1 or in_shape[-1] != fi:
            raise ValueError(
                f"layer {index} (Linear): expected per-sample input (*, {fi}), got {tuple(in_shape)}")
        lead = _prod(in_shape[:-1])
        drop = self._drop_mask(module, prune_zeros)
        i, j = np.divmod(np.arange(fi * fo, dtype=np.int64), fo)  # (i, j) row-major: CSR order of W^T
        keep = ~drop[j * fi + i]
        j, i = j[keep], i[keep]
        widx = j * fi + i
        l = np.arange(lead, dtype=np.int64)[:, None]
        rows = (l * fi + i[None, :]).reshape(-1)
        cols = (l * fo + j[None, :]).reshape(-1)
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        self.weight_gather = _IndexCache(np.broadcast_to(widx[None, :], (lead, widx.size)).reshape(-1)[order])
        self.zero_weights = _IndexCache(np.flatnonzero(drop))

    def run(self, x, tensors):
        if self.zero_weights.array.size:
            self._check_pruned_still_zero(tensors[0])
        return F.linear(x, tensors[0], tensors[1] if len(tensors) > 1 else None), x

    def apply_transposed(self, saved, tensors, g):
        w = tensors[0].detach()
        return torch.matmul(g.reshape(g.shape[0], -1, w.shape[0]), w).reshape(g.shape[0], -1)

    def chain_step(self, needed=None):
        if len(self.in_shape) != 1:
            return super().chain_step(needed)
        want_w = bool(needed) and bool(needed[0])
        has_b = len(self.roles) > 1
        want_b = bool(needed) and has_b and bool(needed[1])
        fo = self.module.out_features

        def step(saved, tensors, g):  # autograd's addmm backward: g W, g^T x, sum over the batch
            if g.dim() != 2:
                g = g.reshape(g.shape[0], fo)
            gi = g.mm(tensors[0])
            if not (want_w or want_b):
                return gi, None
            gw = g.t().mm(saved) if want_w else None
            if not has_b:
                return gi, [gw]
            return gi, [gw, g.sum(0) if want_b else None]

        return step

    def param_grads(self, saved, tensors, g_out, needed=None):
        x = saved
        needed = needed or [True] * len(self.roles)
        g = g_out.reshape(x.shape[:-1] + (self.module.out_features,))
        out: list[Optional[torch.Tensor]] = []
        for role, need in zip(self.roles, needed):
            if not need:
                out.append(None)
            elif role == "weight":
                # one GEMM over batch and leading dims, as autograd does
                out.append(g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1])))
            else:
                out.append(g.reshape(-1, g.shape[-1]).sum(0))
        return out


def _conv_taps(n_in: int, n_out: int, k: int, s: int, d: int, pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One spatial axis of a convolution: every (input position, tap, output position) that meets,
    ``o = (i + pad - tap*d) / s`` integral and in range, sorted by input then output position."""
    i = np.arange(n_in, dtype=np.int64)[:, None]
    tap = np.arange(k - 1, -1, -1, dtype=np.int64)[None, :]  # descending taps: ascending outputs
    num = i + pad - tap * d
    valid = (num >= 0) & (num % s == 0) & (num < s * n_out)
    ii, tt = np.nonzero(valid)  # row-major: input ascending, then output ascending
    return ii.astype(np.int64), (k - 1 - tt).astype(np.int64), (num[ii, tt] // s).astype(np.int64)


def _conv_entries(cin: int, cout: int, groups: int, s_in: Sequence[int], s_out: Sequence[int], k: Sequence[int],
                  s: Sequence[int], d: Sequence[int], pad_lo: Sequence[int],
                  drop: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Structural entries of a convolution's ``J^T`` in CSR order: (input row, output column, flat
    weight index), each (nnz,) int64, pruned weights (``drop[w]``) left out.

    Built from the valid entries only: per spatial axis the (input, tap, output) triples that meet
    (:func:`_conv_taps`), their product over the axes grouped by input position, then repeated over
    the output channels of each input channel's group. Row ``(ci, i...)`` holds ``(co, o...)``
    ascending, so the entries come out in CSR order with no sort.
    """
    nd = len(s_in)
    cin_g, cout_g = cin // groups, cout // groups
    axes = [_conv_taps(s_in[t], s_out[t], k[t], s[t], d[t], pad_lo[t]) for t in range(nd)]
    # spatial combinations: one triple per axis, ordered by (i_1..i_nd, o_1..o_nd)
    grids = np.meshgrid(*[np.arange(a[0].size, dtype=np.int64) for a in axes], indexing="ij")
    pick = [g.ravel() for g in grids]
    keys = [axes[t][2][pick[t]] for t in reversed(range(nd))] + [axes[t][0][pick[t]] for t in reversed(range(nd))]
    order = np.lexsort(keys) if keys and keys[0].size else np.zeros(0, dtype=np.int64)
    pick = [q[order] for q in pick]
    plane_in = _flat_index([axes[t][0][pick[t]] for t in range(nd)], s_in)
    plane_out = _flat_index([axes[t][2][pick[t]] for t in range(nd)], s_out)
    plane_tap = _flat_index([axes[t][1][pick[t]] for t in range(nd)], k)
    n_in, n_out, n_tap = _prod(s_in), _prod(s_out), _prod(k)
    # each input position's combinations, repeated over the group's output channels (channel outer)
    per_pos = np.bincount(plane_in, minlength=n_in).astype(np.int64)
    start = np.zeros(n_in, dtype=np.int64)
    np.cumsum(per_pos[:-1], out=start[1:])
    pos = np.repeat(np.arange(n_in, dtype=np.int64), per_pos * cout_g)
    local = np.arange(pos.size, dtype=np.int64) - np.repeat(start * cout_g, per_pos * cout_g)
    width = per_pos[pos]
    co_l = local // np.maximum(width, 1)
    comb = start[pos] + local % np.maximum(width, 1)
    # per input channel ci of group g, only scalar offsets change:
    #   row = ci*n_in + row_in, col = g*cout_g*n_out + col_base, w = (g*cout_g*cin_g + ci % cin_g)*n_tap + w_base
    row_in = plane_in[comb]
    col_base = co_l * n_out + plane_out[comb]
    w_base = co_l * (cin_g * n_tap) + plane_tap[comb]
    del pos, local, width, co_l, comb
    if drop.any():
        parts = []
        for ci in range(cin):
            g = ci // cin_g
            w = w_base + (g * cout_g * cin_g + ci % cin_g) * n_tap
            keep = ~drop[w]
            parts.append((row_in[keep] + ci * n_in, col_base[keep] + g * cout_g * n_out, w[keep]))
        return tuple(np.concatenate([q[t] for q in parts]) for t in range(3))  # type: ignore[return-value]
    m = row_in.size
    rows = np.empty(cin * m, dtype=np.int64)
    cols = np.empty(cin * m, dtype=np.int64)
    widx = np.empty(cin * m, dtype=np.int64)
    for ci in range(cin):
        g = ci // cin_g
        np.add(row_in, ci * n_in, out=rows[ci * m:(ci + 1) * m])
        np.add(col_base, g * cout_g * n_out, out=cols[ci * m:(ci + 1) * m])
        np.add(w_base, (g * cout_g * cin_g + ci % cin_g) * n_tap, out=widx[ci * m:(ci + 1) * m])
    return rows, cols, widx


# ----------------------------------------------------------------------------- Conv


class ConvUnit(_WeightGatherMixin, LayerUnit):
    """``nn.Conv1d`` / ``nn.Conv2d`` (any stride, padding incl. ``'same'``, dilation, groups,
    bias), zero padding. ``J^T[in, out] = W[co, ci - g*Cin_g, k]`` where the tap ``k`` of output
    ``out`` reads input ``in``; values are shared."""

    shared = True
    roles = ("weight", "bias")

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd = 1 if isinstance(module, nn.Conv1d) else 2
        self.nd = nd
        if module.padding_mode != "zeros":
            raise ValueError(
                f"layer {index} ({self.name}): padding_mode 'zeros' expected, got {module.padding_mode!r}")
        if len(in_shape) != nd + 1:
            raise ValueError(
                f"layer {index} ({self.name}): expected per-sample input (C, {'L' if nd == 1 else 'H, W'}), "
                f"got {tuple(in_shape)}")
        cin, cout, groups = module.in_channels, module.out_channels, module.groups
        if in_shape[0] != cin:
            raise ValueError(f"layer {index} ({self.name}): expected {cin} input channels, got {in_shape[0]}")
        k = _tuple(module.kernel_size, nd)
        s = _tuple(module.stride, nd)
        d = _tuple(module.dilation, nd)
        s_in = tuple(in_shape[1:])
        s_out = tuple(out_shape[1:])
        if isinstance(module.padding, str):
            if module.padding == "valid":
                pad_lo = (0,) * nd
            else:  # 'same': torch pads total = d*(k-1), the odd element on the high side
                pad_lo = tuple((dd * (kk - 1)) // 2 for dd, kk in zip(d, k))
            pad_hi = tuple(dd * (kk - 1) - pl if module.padding == "same" else 0
                           for dd, kk, pl in zip(d, k, pad_lo))
        else:
            pad_lo = _tuple(module.padding, nd)
            pad_hi = pad_lo
        self.stride, self.dilation, self.pad_lo, self.pad_hi, self.kernel = s, d, pad_lo, pad_hi, k
        self._conv = F.conv1d if nd == 1 else F.conv2d
        drop = self._drop_mask(module, prune_zeros)
        rows, cols, widx = _conv_entries(cin, cout, groups, s_in, s_out, k, s, d, pad_lo, drop)
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        self.weight_gather = _IndexCache(widx[order])
        self.zero_weights = _IndexCache(np.flatnonzero(drop))

    def run(self, x, tensors):
        if self.zero_weights.array.size:
            self._check_pruned_still_zero(tensors[0])
        m = self.module  # what its _conv_forward runs for zero padding (string padding included)
        return self._conv(x, tensors[0], tensors[1] if len(tensors) > 1 else None, m.stride, m.padding, m.dilation,
                          m.groups), x

    def _padded_input(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """``x`` and the symmetric padding to convolve it with (asymmetric 'same' padding made explicit)."""
        if self.pad_lo == self.pad_hi:
            return x, list(self.pad_lo)
        pads = []
        for lo, hi in zip(reversed(self.pad_lo), reversed(self.pad_hi)):
            pads += [lo, hi]
        return F.pad(x, pads), [0] * self.nd

    def apply_transposed(self, saved, tensors, g):
        return self.apply_transposed_and_param_grads(saved, tensors, g, [False] * len(self.roles))[0]

    def apply_transposed_and_param_grads(self, saved, tensors, g, needed):
        """``J^T g`` and the parameter gradients for ``g = dl/dy`` from one ``convolution_backward`` (the
        input and weight gradients share its work, as autograd's conv backward does)."""
        x = saved
        xin, pad = self._padded_input(x)
        gy = g.reshape((g.shape[0],) + self.out_shape)
        want_w = bool(needed[0]) if needed else False
        want_b = bool(needed[1]) if needed and len(self.roles) > 1 else False
        # the bias gradient from the same call, as autograd's conv backward computes it
        gi, gw, gb = torch.ops.aten.convolution_backward(
            gy, xin, tensors[0].detach(), [self.out_shape[0]] if want_b else None, list(self.stride), pad,
            list(self.dilation), False, [0] * self.nd, self.module.groups, [True, want_w, want_b])
        if xin is not x:  # crop the explicit padding back off
            gi = gi[(slice(None), slice(None)) + tuple(slice(lo, lo + n) for lo, n in zip(self.pad_lo, x.shape[2:]))]
        params: list[Optional[torch.Tensor]] = [gw if want_w else None]
        if len(self.roles) > 1:
            params.append(gb if want_b else None)
        return gi.reshape(g.shape[0], -1), params

    def chain_step(self, needed=None):
        if self.pad_lo != self.pad_hi:  # asymmetric 'same' padding: pad and crop (the general path)
            return super().chain_step(needed)
        want_w = bool(needed) and bool(needed[0])
        has_b = len(self.roles) > 1
        want_b = bool(needed) and has_b and bool(needed[1])
        args = (list(self.stride), list(self.pad_lo), list(self.dilation), False, [0] * self.nd, self.module.groups,
                [True, want_w, want_b])
        bias_sizes = [self.out_shape[0]] if want_b else None
        nd, out_shape = self.nd + 2, self.out_shape
        conv_backward = torch.ops.aten.convolution_backward

        def step(saved, tensors, g):  # one convolution_backward: input, weight and bias gradients
            if g.dim() != nd:
                g = g.reshape((g.shape[0],) + out_shape)
            gi, gw, gb = conv_backward(g, saved, tensors[0], bias_sizes, *args)
            if not (want_w or want_b):
                return gi, None
            return gi, ([gw, gb] if has_b else [gw])

        return step

    def param_grads(self, saved, tensors, g_out, needed=None):
        x = saved
        w = tensors[0]
        needed = list(needed or [True] * len(self.roles))
        g = g_out.reshape((x.shape[0],) + self.out_shape)
        out: list[Optional[torch.Tensor]] = [None] * len(self.roles)
        want_b = len(self.roles) > 1 and bool(needed[1])
        if needed[0]:  # weight and bias gradients from one call, as autograd's conv backward
            xin, pad = self._padded_input(x)  # asymmetric 'same' padding: pad explicitly, convolve unpadded
            _, out[0], gb = torch.ops.aten.convolution_backward(
                g, xin, w.detach(), [self.out_shape[0]] if want_b else None, list(self.stride), pad,
                list(self.dilation), False, [0] * self.nd, self.module.groups, [False, True, want_b])
            if want_b:
                out[1] = gb
        elif want_b:
            out[1] = g.sum(dim=[0] + list(range(2, g.dim())))
        return out


# ----------------------------------------------------------------------------- elementwise


def _gelu_derivative(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """d gelu(x)/dx, written as torch's gelu_backward computes it."""
    if approximate == "tanh":
        k_beta = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
        k_kappa = 0.044715
        x_sq = x * x
        inner = k_beta * (x + k_kappa * x_sq * x)
        t = torch.tanh(inner)
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * (k_beta * (1 + 3 * k_kappa * x_sq))
    cdf = 0.5 * (1 + torch.erf(x * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


class ElementwiseUnit(LayerUnit):
    """ReLU, LeakyReLU, Tanh, Sigmoid, GELU, SiLU, ELU, Softplus, Hardtanh, ReLU6: diagonal ``J^T``,
    per-sample values ``f'(x)`` written as torch's backward formulas compute them."""

    shared = False

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        if isinstance(module, nn.GELU) and module.approximate not in ("none", "tanh"):
            raise ValueError(f"layer {index} (GELU): approximate 'none' or 'tanh' expected, got {module.approximate!r}")
        self.pattern = _identity_pattern(self.d_in)

    def run(self, x, tensors):
        m = self.module
        if isinstance(m, nn.ReLU):
            y = F.relu(x)
            return y, y
        if isinstance(m, nn.LeakyReLU):
            return F.leaky_relu(x, m.negative_slope), x
        if isinstance(m, nn.Tanh):
            y = torch.tanh(x)
            return y, y
        if isinstance(m, nn.Sigmoid):
            y = torch.sigmoid(x)
            return y, y
        if isinstance(m, nn.GELU):
            return F.gelu(x, approximate=m.approximate), x
        if isinstance(m, nn.SiLU):
            return F.silu(x), x
        if isinstance(m, nn.ELU):
            return F.elu(x, m.alpha), x
        if isinstance(m, nn.Softplus):
            return F.softplus(x, m.beta, m.threshold), x
        return F.hardtanh(x, m.min_val, m.max_val), x  # Hardtanh, ReLU6

    def fill(self, saved, tensors):
        m = self.module
        s = saved.detach().reshape(saved.shape[0], -1)
        if isinstance(m, nn.ReLU):
            return (s > 0).to(s.dtype)
        if isinstance(m, nn.LeakyReLU):
            return torch.where(s > 0, torch.ones_like(s), torch.full_like(s, m.negative_slope))
        if isinstance(m, nn.Tanh):
            return 1 - s * s
        if isinstance(m, nn.Sigmoid):
            return (1 - s) * s
        if isinstance(m, nn.GELU):
            return _gelu_derivative(s, m.approximate)
        if isinstance(m, nn.SiLU):
            sig = torch.sigmoid(s)
            return sig * (1 + s * (1 - sig))
        if isinstance(m, nn.ELU):
            return torch.where(s <= 0, m.alpha * torch.exp(s), torch.ones_like(s))
        if isinstance(m, nn.Softplus):
            z = torch.exp(s * m.beta)
            return torch.where(s * m.beta > m.threshold, torch.ones_like(s), z / (z + 1))
        return ((s > m.min_val) & (s < m.max_val)).to(s.dtype)

    def apply_transposed(self, saved, tensors, g):
        if isinstance(self.module, nn.ReLU):  # autograd's own op: one pass, no mask tensor
            return torch.ops.aten.threshold_backward(g, saved.reshape(saved.shape[0], -1), 0)
        return g * self.fill(saved, tensors)

    @property
    def is_relu(self) -> bool:
        return isinstance(self.module, nn.ReLU)

    def chain_step(self, needed=None, masked_above: bool = False):
        """``masked_above``: the max-pool above applied this ReLU's mask at its pooled resolution
        (:meth:`MaxPoolUnit.chain_step` with ``relu_below``): the step passes ``g`` on unchanged."""
        if masked_above:
            if not self.is_relu:
                raise ValueError(f"layer {self.index} ({self.name}): masked_above applies to a ReLU only")
            return lambda saved, tensors, g: (g, None)
        if not self.is_relu:
            return super().chain_step(needed)
        threshold_backward = torch.ops.aten.threshold_backward

        def step(saved, tensors, g):  # autograd's own op on the saved output
            if g.shape != saved.shape:
                g = g.reshape(saved.shape)
            return threshold_backward(g, saved, 0), None

        return step

    def apply_transposed_into(self, saved, tensors, g, out):
        if isinstance(self.module, nn.ReLU):
            return torch.ops.aten.threshold_backward.grad_input(g, saved.reshape(saved.shape[0], -1), 0,
                                                                grad_input=out)
        return torch.mul(g, self.fill(saved, tensors), out=out)


class ReshapeUnit(LayerUnit):
    """``nn.Flatten`` / ``nn.Identity``: the flattened activation is unchanged, ``J^T = I`` (shared)."""

    shared = True

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        if isinstance(module, nn.Flatten):
            nd = len(in_shape) + 1
            sd = module.start_dim % nd
            if sd == 0:
                raise ValueError(f"layer {index} (Flatten): start_dim >= 1 expected (the batch dim must stay), "
                                 f"got start_dim={module.start_dim}")
        self.pattern = _identity_pattern(self.d_in)
        self._ones: dict[tuple, torch.Tensor] = {}

    def run(self, x, tensors):
        m = self.module
        if type(m) is nn.Flatten:  # its forward, without the module call
            return x.flatten(m.start_dim, m.end_dim), (x.dtype, x.device)
        return m(x), (x.dtype, x.device)

    def fill(self, saved, tensors):
        dtype, device = saved
        key = (dtype, device)
        if key not in self._ones:
            self._ones[key] = torch.ones(self.d_in, dtype=dtype, device=device)
        return self._ones[key]

    def apply_transposed(self, saved, tensors, g):
        return g

    def chain_step(self, needed=None):
        if type(self).apply_transposed is not ReshapeUnit.apply_transposed:
            return super().chain_step(needed)
        in_shape = self.in_shape
        return lambda saved, tensors, g: (g.reshape((g.shape[0],) + in_shape), None)


class DropoutUnit(LayerUnit):
    """``nn.Dropout`` / ``nn.Dropout1d`` / ``nn.Dropout2d``: diagonal ``J^T``. Eval: ones (shared).
    Train: the sampled mask scaled by ``1/(1-p)`` (per sample; for the channel-wise kinds one
    draw per channel, spread over its elements), sampled exactly as ``F.dropout*`` samples it."""

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        self.feature_dims = {nn.Dropout1d: 1, nn.Dropout2d: 2}.get(type(module), 0)
        if self.feature_dims and len(in_shape) != self.feature_dims + 1:
            raise ValueError(f"layer {index} ({self.name}): expected per-sample input (C, "
                             f"{'L' if self.feature_dims == 1 else 'H, W'}), got {tuple(in_shape)}")
        self.pattern = _identity_pattern(self.d_in)

    @property
    def shared(self) -> bool:  # type: ignore[override]
        return not self.module.training

    def run(self, x, tensors):
        p = float(self.module.p)
        if not self.module.training or p == 0.0:
            return x.clone() if self.module.training else x, ("ones", x.shape[0], x.dtype, x.device, self.module.training)
        if p == 1.0:
            scale = torch.zeros_like(x)
        elif self.feature_dims:
            # as torch's feature dropout: one bernoulli_(1-p) per (sample, channel), / (1-p), broadcast
            noise = x.new_empty(x.shape[:2] + (1,) * self.feature_dims).bernoulli_(1 - p).div_(1 - p)
            return x * noise, ("mask", noise.expand_as(x))
        elif x.device.type == "cuda":
            # F.dropout uses the fused kernel on CUDA: same call, same mask; its backward is grad*mask/(1-p)
            y, mask = torch.native_dropout(x, p, True)
            return y, ("mask", mask.to(x.dtype) * (1.0 / (1.0 - p)))
        else:
            # same RNG call and arithmetic as F.dropout on CPU: bernoulli_(1-p), then / (1-p)
            scale = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
        return x * scale, ("mask", scale)

    def fill(self, saved, tensors):
        if saved[0] == "ones":
            _, b, dtype, device, training = saved
            ones = torch.ones(self.d_in, dtype=dtype, device=device)
            return ones.expand(b, -1) if training else ones
        return saved[1].reshape(saved[1].shape[0], -1)  # expanded channel masks materialize here

    def apply_transposed(self, saved, tensors, g):
        if saved[0] == "ones":
            return g
        return g * saved[1].reshape(saved[1].shape[0], -1)


# ----------------------------------------------------------------------------- pooling


def _window_entries(c: int, s_in: Sequence[int], s_out: Sequence[int], k, s, p, d):
    """Every in-bounds window candidate of a channel-wise pool, as flat (input, output, plane
    position) index arrays in (c, o..., k...) order."""
    nd = len(s_in)
    nax = 1 + 2 * nd
    def ax(n: int, pos: int) -> np.ndarray:
        shape = [1] * nax
        shape[pos] = n
        return np.arange(n, dtype=np.int64).reshape(shape)
    ch = ax(c, 0)
    o = [ax(s_out[t], 1 + t) for t in range(nd)]
    kk = [ax(k[t], 1 + nd + t) for t in range(nd)]
    i = [o[t] * s[t] - p[t] + kk[t] * d[t] for t in range(nd)]
    full = np.broadcast(ch, *o, *kk).shape
    valid = np.ones(full, dtype=bool)
    for t in range(nd):
        valid &= (i[t] >= 0) & (i[t] < s_in[t])
    plane = np.broadcast_to(_flat_index(i, s_in), full)
    rows = np.broadcast_to(_flat_index([ch, *i], [c, *s_in]), full)[valid]
    cols = np.broadcast_to(_flat_index([ch, *o], [c, *s_out]), full)[valid]
    return rows, cols, plane[valid], valid, full


class MaxPoolUnit(LayerUnit):
    """``nn.MaxPool1d`` / ``nn.MaxPool2d`` (any kernel, stride, padding, dilation, ceil_mode).

    The pattern holds every in-bounds candidate of every window; the value is 1 exactly at the
    index ``max_pool(..., return_indices=True)`` reports for that output (ties: torch's pick)."""

    shared = False

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd = 1 if isinstance(module, nn.MaxPool1d) else 2
        self.nd = nd
        if module.return_indices:
            raise ValueError(f"layer {index} ({self.name}): return_indices=False expected (a chain passes one "
                             "tensor on), got return_indices=True")
        if len(in_shape) != nd + 1:
            raise ValueError(f"layer {index} ({self.name}): expected per-sample input of {nd + 1} dims "
                             f"(C, spatial), got {tuple(in_shape)}")
        k = _tuple(module.kernel_size, nd)
        s = _tuple(module.stride if module.stride is not None else module.kernel_size, nd)
        p = _tuple(module.padding, nd)
        d = _tuple(module.dilation, nd)
        rows, cols, plane, _, _ = _window_entries(in_shape[0], in_shape[1:], out_shape[1:], k, s, p, d)
        empty = np.flatnonzero(np.bincount(cols, minlength=self.d_out) == 0)
        if empty.size:
            # torch returns -inf and an out-of-range argmax there: no well-defined Jacobian to plan
            raise ValueError(f"layer {index} ({self.name}): output element {int(empty[0])} pools a window that "
                             f"lies entirely in the padding (input {tuple(in_shape)}, kernel {k}, stride {s}, "
                             f"padding {p}, dilation {d}); expected every window to hold an input element")
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        self.entry_out = _IndexCache(cols[order])
        self.entry_plane = _IndexCache(plane[order])
        # windows that never overlap: every input takes at most one gradient, so the scatter below is
        # deterministic on every device (overlapping windows keep the CSR values and their fixed-order sums)
        self.disjoint_windows = all(ss >= (kk - 1) * dd + 1 for ss, kk, dd in zip(s, k, d))

    @property
    def has_operator(self) -> bool:  # type: ignore[override]
        return self.disjoint_windows

    def apply_transposed(self, saved, tensors, g):
        return self.apply_transposed_into(saved, tensors, g, g.new_empty(g.shape[0], self.d_in))

    def apply_transposed_into(self, saved, tensors, g, out):
        idx = saved[0]
        b, c = idx.shape[0], idx.shape[1]
        dst = out.view(b, c, self.d_in // c)
        dst.zero_()
        dst.scatter_(2, idx.reshape(b, c, -1), g.reshape(b, c, -1))
        return out

    def run(self, x, tensors):
        m = self.module
        if self.nd == 2 and not has_torch_function_unary(x):  # F.max_pool2d(..., return_indices=True)'s call
            # on a CPU, the compiled kernel gives ATen's (output, indices) bit for bit, ~5x faster
            got = cpu_pool.max_pool2d_with_indices(x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
            y, idx = got if got is not None else torch._C._nn.max_pool2d_with_indices(
                x, m.kernel_size, m.stride if m.stride is not None else [], m.padding, m.dilation, m.ceil_mode)
        else:
            fn = F.max_pool1d if self.nd == 1 else F.max_pool2d
            y, idx = fn(x, m.kernel_size, m.stride, m.padding, m.dilation, ceil_mode=m.ceil_mode, return_indices=True)
        # the input, as autograd keeps it (its pooling backward reads the shape), and the output (held
        # by the next layer anyway) for a ReLU mask applied at the pooled resolution (chain_step)
        return y, (idx, x, y)

    @property
    def has_chain_step(self) -> bool:
        """Whether :meth:`chain_step` is the single ATen pooling backward (2-d, disjoint windows)."""
        return self.nd == 2 and self.disjoint_windows

    def chain_step(self, needed=None, relu_below: bool = False):
        """``relu_below``: the layer below is a ReLU whose mask this step applies, at the pooled
        resolution: with disjoint windows each input takes the gradient of at most one output, that
        of its window's argmax, whose ReLU output is the pooled value; so masking ``g`` where the
        pooled output is ``<= 0`` before the scatter gives exactly ``threshold_backward(scatter(g), x, 0)``
        with a quarter (a window's share) of the elementwise work. The ReLU's own step is then the
        identity (:meth:`ElementwiseUnit.chain_step` with ``masked_above``)."""
        if not self.has_chain_step:
            if relu_below:
                raise ValueError(f"layer {self.index} ({self.name}): relu_below needs a 2-d pool with disjoint "
                                 f"windows, got {self.nd}-d, disjoint={self.disjoint_windows}")
            return super().chain_step(needed)
        m = self.module
        args = (list(_tuple(m.kernel_size, 2)), list(_tuple(m.stride if m.stride is not None else m.kernel_size, 2)),
                list(_tuple(m.padding, 2)), list(_tuple(m.dilation, 2)), bool(m.ceil_mode))
        pool_backward = torch.ops.aten.max_pool2d_with_indices_backward
        threshold_backward = torch.ops.aten.threshold_backward

        if relu_below:
            def step(saved, tensors, g):
                idx, x, y = saved
                if g.dim() != 4:
                    g = g.reshape(idx.shape)
                return pool_backward(threshold_backward(g, y, 0), x, *args, idx), None
            return step

        def step(saved, tensors, g):  # autograd's pooling backward (disjoint windows: one write per input)
            idx, x = saved[0], saved[1]
            if g.dim() != 4:
                g = g.reshape(idx.shape)
            return pool_backward(g, x, *args, idx), None

        return step

    def fill(self, saved, tensors):
        idx, x = saved[0], saved[1]
        dtype = x.dtype
        idx = idx.reshape(idx.shape[0], -1)
        picked = torch.index_select(idx, 1, self.entry_out.on(idx.device))
        return (picked == self.entry_plane.on(idx.device)).to(dtype)


class AvgPoolUnit(LayerUnit):
    """``nn.AvgPool1d`` / ``nn.AvgPool2d`` (count_include_pad, ceil_mode, divisor_override):
    ``J^T[in, out] = 1/divisor(out)`` over the in-bounds window candidates; values are shared."""

    shared = True

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd = 1 if isinstance(module, nn.AvgPool1d) else 2
        self.nd = nd
        if len(in_shape) != nd + 1:
            raise ValueError(f"layer {index} ({self.name}): expected per-sample input of {nd + 1} dims "
                             f"(C, spatial), got {tuple(in_shape)}")
        k = _tuple(module.kernel_size, nd)
        s = _tuple(module.stride if module.stride is not None else module.kernel_size, nd)
        p = _tuple(module.padding, nd)
        s_in, s_out = in_shape[1:], out_shape[1:]
        rows, cols, _, valid, full = _window_entries(in_shape[0], s_in, s_out, k, s, p, (1,) * nd)
        # divisor per output position, as torch's avg_pool kernels compute it
        size_pad = np.ones(s_out, dtype=np.int64) if nd else None
        size_in = np.ones(s_out, dtype=np.int64)
        for t in range(nd):
            o = np.arange(s_out[t], dtype=np.int64)
            start = o * s[t] - p[t]
            end = np.minimum(start + k[t], s_in[t] + p[t])
            span_pad = end - start
            span_in = np.minimum(end, s_in[t]) - np.maximum(start, 0)
            shape = [1] * nd
            shape[t] = s_out[t]
            size_pad = size_pad * span_pad.reshape(shape)
            size_in = size_in * span_in.reshape(shape)
        divisor_override = getattr(module, "divisor_override", None)
        if divisor_override:
            div = np.full(s_out, float(divisor_override))
        elif module.count_include_pad:
            div = size_pad.astype(np.float64)
        else:
            div = size_in.astype(np.float64)
        div_full = np.broadcast_to(div.reshape((1,) + tuple(s_out) + (1,) * nd), full)[valid]
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        self.entry_divisor = div_full[order]
        self._values: dict[tuple, torch.Tensor] = {}

    def run(self, x, tensors):
        return self.module(x), (x.dtype, x.device)

    def fill(self, saved, tensors):
        key = saved
        v = self._values.get(key)
        if v is None:
            # 1/divisor computed in float64 then rounded once: what the backward kernel yields for grad 1
            v = torch.from_numpy(1.0 / self.entry_divisor).to(device=key[1], dtype=key[0])
            self._values[key] = v
        return v


# ----------------------------------------------------------------------------- BatchNorm


def _affine_mask(roles: Sequence[str], needed: Optional[Sequence[bool]]) -> list[bool]:
    """``[weight wanted, bias wanted]`` (a normalization backward kernel's output mask) from ``needed``
    per role (``None``: every role)."""
    need = dict(zip(roles, needed if needed is not None else [True] * len(roles)))
    return [bool(need.get("weight", False)), bool(need.get("bias", False))]


def _by_role(roles: Sequence[str], gw: Optional[torch.Tensor], gb: Optional[torch.Tensor],
             mask: list[bool]) -> list[Optional[torch.Tensor]]:
    """A kernel's weight and bias gradients in ``roles`` order (``None`` where ``mask`` left one out)."""
    got = {"weight": gw if mask[0] else None, "bias": gb if mask[1] else None}
    return [got[r] for r in roles]



class BatchNormUnit(LayerUnit):
    """``nn.BatchNorm1d`` / ``nn.BatchNorm2d``, in both modes.

    Eval mode (running statistics): ``y = (x - mean) * w / sqrt(var + eps) + b``, a diagonal ``J^T``
    with shared values. Train mode (batch statistics, running statistics updated exactly as the
    module updates them): the layer couples the samples of a batch, ``J^T g = (w * invstd) (g -
    mean_B(g) - x_hat mean_B(g x_hat))`` per channel over batch and spatial positions — a per-channel
    diagonal plus a rank-2 correction across the batch. That is not a per-sample matrix, so it has
    no CSR values: the layer runs as a structured operator only, and a plan that would multiply it
    into an up-sweep product (``levels >= 1``) is refused (``levels="auto"`` plans the linear scan).
    """

    shared = True
    roles = ("weight", "bias")

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        if len(in_shape) not in ((1, 2) if isinstance(module, nn.BatchNorm1d) else (3,)):
            raise ValueError(f"layer {index} ({self.name}): unexpected per-sample input shape {tuple(in_shape)}")
        c = in_shape[0]
        if c != module.num_features:
            raise ValueError(f"layer {index} ({self.name}): expected {module.num_features} channels "
                             f"(num_features), got per-sample input {tuple(in_shape)}")
        self.pattern = _identity_pattern(self.d_in)
        self.channel_of = _IndexCache(np.repeat(np.arange(c, dtype=np.int64), self.d_in // c))

    @property
    def batch_statistics(self) -> bool:
        """Whether the forward normalizes with the batch's statistics (train mode, or no running stats)."""
        m = self.module
        return m.training or m.running_var is None

    @property
    def has_csr_values(self) -> bool:  # type: ignore[override]
        return not self.batch_statistics

    def run(self, x, tensors):
        m = self.module
        w = tensors[self.roles.index("weight")] if "weight" in self.roles else None
        b = tensors[self.roles.index("bias")] if "bias" in self.roles else None
        if not self.batch_statistics:
            y = F.batch_norm(x, m.running_mean, m.running_var, w, b, False, 0.0, m.eps)
            return y, ("eval", x)
        # the module's own train-mode arithmetic: momentum, cumulative average, num_batches_tracked
        factor = 0.0 if m.momentum is None else m.momentum
        if m.training and m.track_running_stats and m.num_batches_tracked is not None:
            m.num_batches_tracked.add_(1)
            factor = 1.0 / float(m.num_batches_tracked) if m.momentum is None else m.momentum
        track = m.track_running_stats and m.training
        if x.numel() == x.shape[1]:  # F.batch_norm's own checks
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {x.size()}")
        if m.eps <= 0.0:
            raise ValueError(f"batch_norm eps must be positive during training, but got {m.eps}")
        # what F.batch_norm runs (the same kernel choice on every device), keeping the kernel's batch
        # statistics and workspace for its own backward
        y, mean, var_t, reserve, impl = torch.ops.aten._batch_norm_impl_index(
            x, w, b, m.running_mean if track else None, m.running_var if track else None, True, factor, m.eps,
            torch.backends.cudnn.enabled)
        return y, ("batch", x, mean, var_t, reserve, impl)

    def _scale(self, tensors, invstd: torch.Tensor) -> torch.Tensor:
        return invstd * tensors[self.roles.index("weight")].detach() if "weight" in self.roles else invstd

    def fill(self, saved, tensors):
        if saved[0] == "batch":
            raise ValueError(f"layer {self.index} ({self.name}): in train mode the layer couples the samples of a "
                             "batch and has no per-sample CSR values; it runs as a structured operator in the "
                             "linear scan: plan with levels=0 (or 'auto'), or call model.eval()")
        m = self.module
        # per-channel w / sqrt(var + eps), spread to every element of the channel
        scale = self._scale(tensors, torch.rsqrt(m.running_var.detach() + m.eps))
        return torch.index_select(scale, 0, self.channel_of.on(scale.device))

    def _batch_backward(self, saved, tensors, g, mask: list[bool]):
        """Train mode: ``(dl/dx, dl/dweight, dl/dbias)`` from autograd's own kernel, where ``mask`` says."""
        _, x, mean, var_t, reserve, impl = saved
        w = tensors[self.roles.index("weight")].detach() if "weight" in self.roles else None
        return torch.ops.aten._batch_norm_impl_index_backward(impl, x, g.reshape(x.shape), w, None, None, mean, var_t,
                                                              True, self.module.eps, mask, reserve)

    def apply_transposed(self, saved, tensors, g):
        if saved[0] == "eval":
            return g * self.fill(saved, tensors)
        return self._batch_backward(saved, tensors, g, [True, False, False])[0].reshape(g.shape[0], -1)

    def apply_transposed_and_param_grads(self, saved, tensors, g, needed):
        """``J^T g`` and the weight/bias gradients for ``g = dl/dy``; in train mode from one call of the
        forward kernel's own backward (as autograd's batch-norm backward)."""
        if saved[0] == "eval":
            return g * self.fill(saved, tensors), self.param_grads(saved, tensors, g, needed)
        mask = _affine_mask(self.roles, needed)
        gi, gw, gb = self._batch_backward(saved, tensors, g, [True] + mask)
        return gi.reshape(g.shape[0], -1), _by_role(self.roles, gw, gb, mask)

    def param_grads(self, saved, tensors, g_out, needed=None):
        m = self.module
        x = saved[1]
        needed = needed or [True] * len(self.roles)
        if saved[0] == "batch":
            mask = _affine_mask(self.roles, needed)
            if not any(mask):
                return [None] * len(self.roles)
            _, gw, gb = self._batch_backward(saved, tensors, g_out, [False] + mask)
            return _by_role(self.roles, gw, gb, mask)
        g = g_out.reshape(x.shape)
        dims = [0] + list(range(2, x.dim()))
        shape = [1, -1] + [1] * (x.dim() - 2)
        out: list[Optional[torch.Tensor]] = []
        for role, need in zip(self.roles, needed):
            if not need:
                out.append(None)
            elif role == "weight":
                xhat = (x - m.running_mean.reshape(shape)) * torch.rsqrt(m.running_var + m.eps).reshape(shape)
                out.append((g * xhat).sum(dims))
            else:
                out.append(g.sum(dims))
        return out


# ----------------------------------------------------------------------------- more layers
#
# Normalization and softmax: the exact ``J^T`` of each normalized group / softmax slice is a
# diagonal plus a rank-1 or rank-2 term. The structured operator applies it in O(N) per slice with
# the layer's own backward kernel (as autograd does); the CSR values, needed only where a planned
# product multiplies the layer into an up-sweep (levels >= 1), write each slice's block densely.
#
# Why dense blocks, not the factored form ``J^T = D - U V^T`` as two chain elements ``[D | -U]``
# (N x (N+r)) and ``[I ; V^T]`` ((N+r) x N), for those products: measured with the core API
# (bench/test_norm_factored.py: float32, B = 8, one thread, both in the same run), the factors win next
# to sparse neighbours (conv 3x3 -> GroupNorm(64-element groups) -> ReLU, twice: level-1 backward 13 ms
# vs 71-105 ms, planned memory 37 vs 318 MiB) but lose next to dense ones (Linear(256) -> LayerNorm(256)
# -> GELU, twice: 14-21 ms vs 11-13 ms, 81 vs 44 MiB), since a product with a dense weight is a dense
# per-sample matrix either way. The choice depends on the neighbours (a planning decision), and one
# layer contributing two chain elements is not in the chain and graph front ends yet. Depth 0, what
# ``levels="auto"`` picks for such models, never forms the blocks: LayerNorm(1024) MLP, B = 64: 5.9 ms
# backward with the operator vs 1356 ms through the dense blocks (autograd 5.1 ms), same run,
# bench/test_norm_step.py.


def _dense_blocks(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Structural entries of a block-diagonal ``J^T`` whose blocks are the index sets ``groups``
    ``(G, N)`` (each row one group of flat per-sample indices): every (row j, col i) of a group,
    in (group, j, i) order."""
    g, n = groups.shape
    rows = np.broadcast_to(groups[:, :, None], (g, n, n)).reshape(-1)
    cols = np.broadcast_to(groups[:, None, :], (g, n, n)).reshape(-1)
    return rows, cols


def _low_rank_entries(groups: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Structural entries of the two factors of a block-diagonal ``J^T = L R`` whose blocks are a
    diagonal plus rank ``rank`` (``groups`` ``(G, N)``: each row one group of flat per-sample indices,
    ``d = G N``, the inner dimension ``d + rank G``): ``L`` ``(d, d + rank G)`` holds a diagonal and, in
    row ``i`` of group ``g``, the columns ``d + rank g + j``; ``R`` ``(d + rank G, d)`` the diagonal and
    the rows ``d + rank g + j`` over the group's columns. Entries of ``L`` as ``(rows, cols)`` in
    ``(part, g, n)`` order, ``part`` 0 the diagonal and ``1 + j`` rank column ``j``; ``R``'s are the
    transposed pairs in the same order."""
    g, n = groups.shape
    d = g * n
    rows = np.broadcast_to(groups[None], (1 + rank, g, n))
    inner = d + rank * np.arange(g, dtype=np.int64)[:, None] + np.arange(rank, dtype=np.int64)[:, None, None]
    cols = np.concatenate([groups[None], np.broadcast_to(inner, (rank, g, n))])
    return rows.reshape(-1), cols.reshape(-1), d + rank * g


class LowRankFactors:
    """``J^T`` as the product of two sparse factors, for units whose per-group ``J^T`` is a diagonal
    plus a rank-``r`` correction (LayerNorm, GroupNorm: ``r = 2``; Softmax, LogSoftmax: ``r = 1``).

    A dense ``N x N`` block per group costs ``N^2`` entries per sample in every up-sweep product
    it enters; the factors ``L`` ``(d, d + rG)`` and ``R`` ``(d + rG, d)`` hold ``(1 + r) N`` each, and
    ``J^T g = L (R g)``: ``R`` maps ``g`` to ``[g', <v_1, g>, ..., <v_r, g>]`` per group, ``L`` combines
    them. In a chain the factors are two elements (``R`` nearer the output), which the planner
    multiplies like any others; whether a plan uses them instead of the dense blocks is a planning
    decision (:func:`spscan.model.plan_chain`).

    Subclasses set ``rank`` and ``factor_groups`` (``(G, N)`` flat indices) and implement
    :meth:`_factor_parts`.
    """

    rank: int
    factor_groups: np.ndarray

    @property
    def pattern(self) -> sp.csr_array:  # type: ignore[override]
        """The dense blocks' pattern, built on first use (a plan that factors the layer never needs it)."""
        return self._blocks()[0]

    @property
    def dense_order(self) -> Optional[_IndexCache]:
        """CSR position -> ``(group, j, i)`` entry of the dense blocks (``None``: the same order)."""
        return self._blocks()[1]

    def _blocks(self) -> tuple[sp.csr_array, Optional[_IndexCache]]:
        got = self.__dict__.get("_dense")
        if got is None:
            rows, cols = _dense_blocks(self.factor_groups)
            pat, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
            got = self._dense = (pat, None if isinstance(order, slice) else _IndexCache(order))
        return got

    @property
    def nnz(self) -> int:
        """Entries of the dense blocks, ``G N^2`` (counted without building them)."""
        g, n = self.factor_groups.shape
        return int(g) * int(n) * int(n)

    def factor_patterns(self) -> tuple[sp.csr_array, sp.csr_array]:
        """``(L, R)`` patterns, ``(d_in, d_in + rG)`` and ``(d_in + rG, d_out)``."""
        got = self.__dict__.get("_factors")
        if got is None:
            rows, cols, inner = _low_rank_entries(self.factor_groups, self.rank)
            left, lo = coo_to_csr(rows, cols, (self.d_in, inner))
            right, ro = coo_to_csr(cols, rows, (inner, self.d_out))
            got = self._factors = ((left, None if isinstance(lo, slice) else _IndexCache(lo)),
                                   (right, None if isinstance(ro, slice) else _IndexCache(ro)))
        return got[0][0], got[1][0]

    @property
    def factor_inner(self) -> int:
        """The inner dimension ``d + rG`` between the factors."""
        return self.d_in + self.rank * self.factor_groups.shape[0]

    def factor_shared(self) -> tuple[bool, bool]:
        """Whether ``L``'s and ``R``'s values are shared by the batch."""
        return False, False

    @abc.abstractmethod
    def _factor_parts(self, saved: Any, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L parts, R parts)``, each ``(B, 1 + r, G, N)`` (or ``(1 + r, G, N)`` where shared) in the
        entry order of :func:`_low_rank_entries`: part 0 the diagonal, part ``1 + j`` rank term ``j``."""

    def factor_fill(self, saved: Any, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(L values, R values)`` in their patterns' CSR order, ``(B, nnz)`` or ``(nnz,)`` where shared."""
        self.factor_patterns()
        out = []
        for parts, (_, order) in zip(self._factor_parts(saved, tensors), self._factors):
            v = parts.reshape(-1) if parts.dim() == 3 else parts.reshape(parts.shape[0], -1)
            if order is not None:
                v = torch.index_select(v, v.dim() - 1, order.on(v.device))
            out.append(v)
        return out[0], out[1]


class _GroupNormalizeUnit(LowRankFactors, LayerUnit):
    """Shared by LayerNorm and GroupNorm: per sample, the flat activation splits into ``G``
    contiguous groups of ``N`` elements, each normalized by its own mean and (biased) variance,
    then scaled by a gain read from ``weight`` and shifted by ``bias``.

    Per group, ``J^T = rstd (I - 1/N 11^T - 1/N x̂ x̂^T) diag(gain)``: a diagonal plus rank 2.

    * Structured operator (the linear scan, the down-sweep): ``J^T g = rstd (w⊙g - mean(w⊙g) -
      x̂ mean(x̂⊙w⊙g))`` per group, O(N), through the layer's own backward kernel
      (``native_layer_norm_backward`` / ``native_group_norm_backward``, which autograd calls), with the
      weight and bias gradients from the same call when the scan applies the layer once (depth 0).
    * CSR values (up-sweep products only): one dense ``N x N`` block per group, per sample,
      ``J^T[j, i] = gain_i * rstd * (δ_ij - 1/N - x̂_i x̂_j / N)``.

    The run saves ``(x, mean, rstd)`` from the forward kernel, so neither path recomputes statistics.
    """

    shared = False
    roles = ("weight", "bias")
    groups: int
    group_size: int

    def _setup(self, gain_index: Optional[np.ndarray]) -> None:
        g, n = self.groups, self.group_size
        self.rank, self.factor_groups = 2, np.arange(self.d_in, dtype=np.int64).reshape(g, n)
        self.gain_index = None if gain_index is None else _IndexCache(gain_index)

    def _tensor(self, tensors: Sequence[torch.Tensor], role: str) -> Optional[torch.Tensor]:
        return tensors[self.roles.index(role)] if role in self.roles else None

    def _detached(self, tensors: Sequence[torch.Tensor], role: str) -> Optional[torch.Tensor]:
        t = self._tensor(tensors, role)
        return None if t is None else t.detach()

    def _normalized(self, saved: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x̂ (B, G, N), rstd (B, G, 1))`` from the saved input and statistics."""
        x, mean, rstd = saved
        b = x.shape[0]
        rstd = rstd.detach().reshape(b, self.groups, 1)
        xg = x.detach().reshape(b, self.groups, self.group_size)
        return (xg - mean.detach().reshape(b, self.groups, 1)) * rstd, rstd

    def fill(self, saved, tensors):
        x = saved[0]
        b, n = x.shape[0], self.group_size
        xhat, rstd = self._normalized(saved)
        eye = torch.eye(n, dtype=x.dtype, device=x.device)
        blk = eye - 1.0 / n - xhat.unsqueeze(3) * xhat.unsqueeze(2) / n  # (B, G, j, i), symmetric
        scale = rstd.unsqueeze(3)  # (B, G, 1, 1)
        w = self._tensor(tensors, "weight")
        if w is not None:
            gain = torch.index_select(w.detach().reshape(-1), 0, self.gain_index.on(w.device))
            scale = scale * gain.reshape(1, self.groups, 1, n)
        return (blk * scale).reshape(b, -1)

    def _factor_parts(self, saved, tensors):
        # L = [rstd I | -rstd/N 1 | -rstd/N x̂], R = [diag(gain) ; gain^T ; (x̂ gain)^T] per group
        xhat, rstd = self._normalized(saved)
        n = self.group_size
        w = self._tensor(tensors, "weight")
        if w is None:
            gain = torch.ones_like(xhat)
        else:
            gain = torch.index_select(w.detach().reshape(-1), 0, self.gain_index.on(w.device))
            gain = gain.reshape(1, self.groups, n).expand_as(xhat)
        r = rstd.expand_as(xhat)
        left = torch.stack([r, r * (-1.0 / n), xhat * r * (-1.0 / n)], 1)
        right = torch.stack([gain, gain, xhat * gain], 1)
        return left, right

    @abc.abstractmethod
    def _backward(self, saved: Any, tensors: Sequence[torch.Tensor], g: torch.Tensor,
                  mask: list[bool]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The layer's backward kernel on ``g`` ``(B, d_out)``: ``(dl/dx, dl/dweight, dl/dbias)``, each
        computed only where ``mask`` says so."""

    def apply_transposed(self, saved, tensors, g):
        return self._backward(saved, tensors, g, [True, False, False])[0].reshape(g.shape[0], -1)

    def apply_transposed_and_param_grads(self, saved, tensors, g, needed):
        """``J^T g`` and the weight/bias gradients for ``g = dl/dy`` from one backward-kernel call."""
        mask = _affine_mask(self.roles, needed)
        gi, gw, gb = self._backward(saved, tensors, g, [True] + mask)
        return gi.reshape(g.shape[0], -1), _by_role(self.roles, gw, gb, mask)

    def param_grads(self, saved, tensors, g_out, needed=None):
        mask = _affine_mask(self.roles, needed)
        if not any(mask):
            return [None] * len(self.roles)
        _, gw, gb = self._backward(saved, tensors, g_out, [False] + mask)
        return _by_role(self.roles, gw, gb, mask)


class LayerNormUnit(_GroupNormalizeUnit):
    """``nn.LayerNorm`` over the trailing ``normalized_shape`` (elementwise affine optional, with
    or without bias): groups are the per-sample leading positions, ``N = prod(normalized_shape)``."""

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        ns = tuple(module.normalized_shape)
        if len(ns) > len(in_shape) or tuple(in_shape[len(in_shape) - len(ns):]) != ns:
            raise ValueError(f"layer {index} (LayerNorm): expected per-sample input ending in normalized_shape "
                             f"{ns}, got {tuple(in_shape)}")
        self.normalized_shape = list(ns)
        self.group_size = _prod(ns)
        self.groups = self.d_in // self.group_size
        gain = np.tile(np.arange(self.group_size, dtype=np.int64), self.groups) if "weight" in self.roles else None
        self._setup(gain)

    def run(self, x, tensors):
        # the kernel F.layer_norm calls, keeping its statistics for the backward
        y, mean, rstd = torch.native_layer_norm(x, self.normalized_shape, self._tensor(tensors, "weight"),
                                                self._tensor(tensors, "bias"), self.module.eps)
        return y, (x, mean, rstd)

    def _backward(self, saved, tensors, g, mask):
        x, mean, rstd = saved
        return torch.ops.aten.native_layer_norm_backward(
            g.reshape(x.shape), x.detach(), self.normalized_shape, mean.detach(), rstd.detach(),
            self._detached(tensors, "weight"), self._detached(tensors, "bias"), mask)


class GroupNormUnit(_GroupNormalizeUnit):
    """``nn.GroupNorm`` on per-sample ``(C, *spatial)``: ``G = num_groups`` groups of
    ``N = C/G * prod(spatial)`` elements, per-channel affine."""

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        if len(in_shape) < 1 or in_shape[0] != module.num_channels:
            raise ValueError(f"layer {index} (GroupNorm): expected per-sample input ({module.num_channels}, ...) "
                             f"(num_channels), got {tuple(in_shape)}")
        self.groups = int(module.num_groups)
        self.group_size = self.d_in // self.groups
        self.hxw = self.d_in // in_shape[0]
        gain = np.repeat(np.arange(in_shape[0], dtype=np.int64), self.hxw) if "weight" in self.roles else None
        self._setup(gain)

    def run(self, x, tensors):
        # what F.group_norm runs (aten::group_norm: a contiguous input, then native_group_norm)
        xc = x.contiguous()
        y, mean, rstd = torch.native_group_norm(xc, self._tensor(tensors, "weight"), self._tensor(tensors, "bias"),
                                                x.shape[0], self.in_shape[0], self.hxw, self.groups,
                                                self.module.eps)
        return y, (xc, mean, rstd)

    def _backward(self, saved, tensors, g, mask):
        x, mean, rstd = saved
        return torch.ops.aten.native_group_norm_backward(
            g.reshape(x.shape).contiguous(), x.detach(), mean.detach(), rstd.detach(),
            self._detached(tensors, "weight"), x.shape[0], self.in_shape[0], self.hxw, self.groups, mask)


class SoftmaxUnit(LowRankFactors, LayerUnit):
    """``nn.Softmax`` / ``nn.LogSoftmax`` along ``dim`` (not the batch dim). Per slice along ``dim``
    (``N`` its length, ``s`` the softmax): Softmax ``J^T = diag(s) - s s^T``, LogSoftmax
    ``J^T = I - s 1^T`` (``J^T[j, i] = δ_ij - s_j``), a diagonal minus rank 1.

    * Structured operator: ``J^T g = s⊙(g - <s, g>)`` (Softmax) or ``g - s Σg`` (LogSoftmax) per
      slice, O(N), through the layer's own backward kernel (``_softmax_backward_data`` /
      ``_log_softmax_backward_data``, which autograd calls).
    * CSR values (up-sweep products only): one dense ``N x N`` block per slice, per sample.
    """

    shared = False

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd = len(in_shape) + 1
        if module.dim is None:
            raise ValueError(f"layer {index} ({self.name}): an explicit dim expected (dim=None picks one "
                             "implicitly), got dim=None")
        dim = int(module.dim)
        if not -nd <= dim < nd or dim % nd == 0:
            raise ValueError(f"layer {index} ({self.name}): dim in 1..{nd - 1} (or its negative) expected "
                             f"for per-sample input {tuple(in_shape)}; the batch dim 0 couples samples, got {dim}")
        self.dim = dim % nd
        self.log = isinstance(module, nn.LogSoftmax)
        flat = np.arange(self.d_in, dtype=np.int64).reshape(in_shape)
        slices = np.moveaxis(flat, self.dim - 1, -1).reshape(-1, in_shape[self.dim - 1])
        self.slices = _IndexCache(slices.reshape(-1))
        self.n_slice = slices.shape[1]
        self.rank, self.factor_groups = 1, np.ascontiguousarray(slices)

    def run(self, x, tensors):
        fn = F.log_softmax if self.log else F.softmax
        y = fn(x, self.dim)
        return y, y

    def fill(self, saved, tensors):
        y = saved.detach().reshape(saved.shape[0], -1)
        s = torch.index_select(y, 1, self.slices.on(y.device)).reshape(y.shape[0], -1, self.n_slice)
        if self.log:
            s = torch.exp(s)
            eye = torch.eye(self.n_slice, dtype=y.dtype, device=y.device)
            v = eye - s.unsqueeze(3)  # [b, slice, j, i] = δ_ij - s_j
        else:
            v = torch.diag_embed(s) - s.unsqueeze(3) * s.unsqueeze(2)
        v = v.reshape(y.shape[0], -1)
        order = self.dense_order
        return v if order is None else torch.index_select(v, 1, order.on(y.device))

    def factor_shared(self):
        return False, self.log  # LogSoftmax's R = [I ; 1^T] is a constant

    def _factor_parts(self, saved, tensors):
        # Softmax: L = [diag(s) | -s], R = [I ; s^T]; LogSoftmax: L = [I | -s], R = [I ; 1^T] (per slice)
        y = saved.detach().reshape(saved.shape[0], -1)
        s = torch.index_select(y, 1, self.slices.on(y.device)).reshape(y.shape[0], -1, self.n_slice)
        if self.log:
            s = torch.exp(s)
            ones = torch.ones_like(s)
            return torch.stack([ones, -s], 1), torch.ones((2,) + s.shape[1:], dtype=s.dtype, device=s.device)
        return torch.stack([s, -s], 1), torch.stack([torch.ones_like(s), s], 1)

    def apply_transposed(self, saved, tensors, g):
        y = saved.detach()
        back = torch.ops.aten._log_softmax_backward_data if self.log else torch.ops.aten._softmax_backward_data
        return back(g.reshape(y.shape), y, self.dim, y.dtype).reshape(g.shape[0], -1)


def _hardswish_derivative(x: torch.Tensor) -> torch.Tensor:
    """As torch's hardswish_backward: 0 up to -3, x/3 + 1/2 on (-3, 3), 1 from 3."""
    return torch.where(x <= -3, torch.zeros_like(x), torch.where(x < 3, x / 3 + 0.5, torch.ones_like(x)))


def _mish_derivative(x: torch.Tensor) -> torch.Tensor:
    """As torch's mish_backward: tanh(softplus(x)) + x * sigmoid(x) * (1 - tanh(softplus(x))^2)."""
    sig = torch.sigmoid(x)
    t = torch.tanh(F.softplus(x))
    return t + x * sig * (1 - t * t)


class ElementwiseMoreUnit(LayerUnit):
    """Hardswish, Hardsigmoid, Mish, SELU, CELU, Softsign: diagonal ``J^T``, per-sample ``f'(x)``
    as torch's backward formulas compute it."""

    shared = False

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        self.pattern = _identity_pattern(self.d_in)

    def run(self, x, tensors):
        return self.module(x), x

    def fill(self, saved, tensors):
        m = self.module
        s = saved.detach().reshape(saved.shape[0], -1)
        if isinstance(m, nn.Hardswish):
            return _hardswish_derivative(s)
        if isinstance(m, nn.Hardsigmoid):
            # torch's kernel multiplies by 1.0f / 6.0f, a float32 constant, in every dtype
            return ((s > -3) & (s < 3)).to(s.dtype) * float(np.float32(1.0) / np.float32(6.0))
        if isinstance(m, nn.Mish):
            return _mish_derivative(s)
        if isinstance(m, nn.SELU):
            scale, alpha = 1.0507009873554804934193349852946, 1.6732632423543772848170429916717
            return torch.where(s <= 0, scale * alpha * torch.exp(s), torch.full_like(s, scale))
        if isinstance(m, nn.CELU):
            # torch differentiates celu as elu with input scale 1.0 / alpha.toFloat(): alpha rounded to float32
            inv = 1.0 / float(np.float32(m.alpha))
            return torch.where(s <= 0, inv * m.alpha * torch.exp(s * inv), torch.ones_like(s))
        d = 1 + s.abs()  # Softsign: 1 / (1 + |x|)^2
        return 1 / (d * d)


class PReLUUnit(LayerUnit):
    """``nn.PReLU`` (one slope, or one per channel = per-sample dim 0): diagonal ``J^T``,
    ``1`` where ``x > 0`` else the channel's slope (per sample); ``dl/dw = sum g x [x <= 0]``."""

    shared = False
    roles = ("weight",)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        k = module.num_parameters
        if len(in_shape) < 1:
            raise ValueError(f"layer {index} (PReLU): expected per-sample input (C, ...), got {tuple(in_shape)}")
        if k != 1 and k != in_shape[0]:
            raise ValueError(f"layer {index} (PReLU): num_parameters 1 or {in_shape[0]} (channels) expected, "
                             f"got {k}")
        self.pattern = _identity_pattern(self.d_in)
        self.per_channel = k != 1
        per = self.d_in // in_shape[0]
        ch = np.repeat(np.arange(in_shape[0], dtype=np.int64), per) if self.per_channel else np.zeros(self.d_in, np.int64)
        self.channel_of = _IndexCache(ch)

    def run(self, x, tensors):
        return F.prelu(x, tensors[0]), x

    def fill(self, saved, tensors):
        s = saved.detach().reshape(saved.shape[0], -1)
        slope = torch.index_select(tensors[0].detach().reshape(-1), 0, self.channel_of.on(s.device))
        return torch.where(s > 0, torch.ones_like(s), slope.expand_as(s))

    def param_grads(self, saved, tensors, g_out, needed=None):
        if needed is not None and not needed[0]:
            return [None]
        x = saved
        c = self.in_shape[0]
        contrib = torch.where(x > 0, torch.zeros_like(x), x) * g_out.reshape(x.shape)
        per_channel = contrib.reshape(x.shape[0], c, -1).sum((0, 2))
        return [per_channel if self.per_channel else per_channel.sum().reshape(1)]


class UnflattenUnit(ReshapeUnit):
    """``nn.Unflatten`` of a per-sample dim: the flattened activation is unchanged, ``J^T = I``."""

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        nd = len(in_shape) + 1
        if isinstance(module.dim, int) and module.dim % nd == 0:
            raise ValueError(f"layer {index} (Unflatten): dim >= 1 expected (the batch dim must stay), "
                             f"got dim={module.dim}")
        super().__init__(index, module, in_shape, out_shape)


class SeparableResampleUnit(LayerUnit):
    """Channel-wise linear maps that act on each spatial axis separately: ``nn.Upsample``
    (``nearest``, ``nearest-exact``, ``linear``, ``bilinear``, ``bicubic``, ``area``),
    ``nn.UpsamplingNearest2d`` / ``UpsamplingBilinear2d``, ``nn.AdaptiveAvgPool1d/2d``,
    ``nn.ZeroPad1d/2d``, ``nn.ReflectionPad1d/2d``, ``nn.ReplicationPad1d/2d``.

    ``J^T[(c, k...), (c, o...)] = prod_t A_t[o_t, k_t]``: shared values, the same for every
    channel. The per-axis factors are read off the module itself at plan time (float64 probes:
    a one-hot along one axis, ones along the others), so every option (``align_corners``,
    ``scale_factor`` rounding, negative padding, ...) comes out as torch computes it; the result
    is checked against the module on a random input before it is used. Exact zeros are left out.
    """

    shared = True

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd = len(in_shape) - 1
        if nd not in (1, 2):
            raise ValueError(f"layer {index} ({self.name}): expected per-sample input (C, L) or (C, H, W), got "
                             f"{tuple(in_shape)}")
        c, s_in, s_out = in_shape[0], tuple(in_shape[1:]), tuple(out_shape[1:])
        if out_shape[0] != c:
            raise ValueError(f"layer {index} ({self.name}): channel count changed {c} -> {out_shape[0]}")
        with torch.no_grad():
            total = module(torch.ones((1, 1) + s_in, dtype=torch.float64))[0, 0].numpy()
            probes = []
            for t in range(nd):
                p = torch.ones((s_in[t], 1) + s_in, dtype=torch.float64)
                onehot = torch.eye(s_in[t], dtype=torch.float64).reshape((s_in[t], 1) + tuple(
                    s_in[t] if u == t else 1 for u in range(nd)))
                probes.append(module(p * onehot)[:, 0].numpy())  # (k_t, *s_out)
        # per axis: the (k, o_t) pairs that can meet
        pairs = []
        for t in range(nd):
            other = tuple(u + 1 for u in range(nd) if u != t)
            nz = np.abs(probes[t]).max(axis=other) != 0 if other else probes[t] != 0
            pairs.append(np.nonzero(nz))  # (k, o_t)
        if nd == 1:
            k1, o1 = pairs[0]
            vals = probes[0][k1, o1]
            rin, rout = k1, o1
        else:
            (k1, o1), (k2, o2) = pairs
            a, b = np.meshgrid(np.arange(k1.size), np.arange(k2.size), indexing="ij")
            a, b = a.reshape(-1), b.reshape(-1)
            K1, O1, K2, O2 = k1[a], o1[a], k2[b], o2[b]
            tot = total[O1, O2]
            with np.errstate(divide="ignore", invalid="ignore"):
                vals = np.where(tot != 0, probes[0][K1, O1, O2] * probes[1][K2, O1, O2] / tot, 0.0)
            rin, rout = K1 * s_in[1] + K2, O1 * s_out[1] + O2
        keep = vals != 0
        rin, rout, vals = rin[keep], rout[keep], vals[keep]
        n_in, n_out = _prod(s_in), _prod(s_out)
        ch = np.arange(c, dtype=np.int64)[:, None]
        rows = (ch * n_in + rin[None, :]).reshape(-1)
        cols = (ch * n_out + rout[None, :]).reshape(-1)
        self.pattern, order = coo_to_csr(rows, cols, (self.d_in, self.d_out))
        self.entry_values = np.array(np.broadcast_to(vals[None, :], (c, vals.size)).reshape(-1)[order])
        self._values: dict[tuple, torch.Tensor] = {}
        # the separability the construction relies on, checked on the module itself
        gen = torch.Generator().manual_seed(0)
        probe = torch.randn((1, 1) + s_in, generator=gen, dtype=torch.float64)
        with torch.no_grad():
            want = module(probe).reshape(-1).numpy()
        plane = sp.csr_array((vals, (rin, rout)), shape=(n_in, n_out))
        got = plane.T @ probe.reshape(-1).numpy()
        if not np.allclose(got, want, rtol=1e-10, atol=1e-12):
            raise ValueError(f"layer {index} ({self.name}): the module is not a separable channel-wise linear map "
                             "with these options (got a mismatch of "
                             f"{float(np.abs(got - want).max()):.3g}); not supported")

    def run(self, x, tensors):
        return self.module(x), (x.dtype, x.device)

    def fill(self, saved, tensors):
        v = self._values.get(saved)
        if v is None:
            v = torch.from_numpy(self.entry_values).to(device=saved[1], dtype=saved[0])
            self._values[saved] = v
        return v


class ConvTransposeUnit(_WeightGatherMixin, LayerUnit):
    """``nn.ConvTranspose1d`` / ``nn.ConvTranspose2d`` (stride, padding, output_padding, dilation,
    groups, bias), zero padding. A transposed convolution is the adjoint of the convolution with
    the same weight from its output space to its input space, so its ``J^T`` is that convolution's
    ``J``: the convolution's entries with rows and columns swapped. Values are shared."""

    shared = True
    roles = ("weight", "bias")

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd = 1 if isinstance(module, nn.ConvTranspose1d) else 2
        self.nd = nd
        if module.padding_mode != "zeros":
            raise ValueError(f"layer {index} ({self.name}): padding_mode 'zeros' expected, got {module.padding_mode!r}")
        if len(in_shape) != nd + 1 or in_shape[0] != module.in_channels:
            raise ValueError(f"layer {index} ({self.name}): expected per-sample input ({module.in_channels}, "
                             f"{'L' if nd == 1 else 'H, W'}), got {tuple(in_shape)}")
        k = _tuple(module.kernel_size, nd)
        s = _tuple(module.stride, nd)
        d = _tuple(module.dilation, nd)
        p = _tuple(module.padding, nd)
        op = _tuple(module.output_padding, nd)
        self.stride, self.dilation, self.padding, self.output_padding = s, d, p, op
        drop = self._drop_mask(module, prune_zeros)
        # the adjoint convolution: (C_out, out spatial) -> (C_in, in spatial), weight (C_in, C_out/g, k)
        rows_c, cols_c, widx = _conv_entries(module.out_channels, module.in_channels, module.groups,
                                             tuple(out_shape[1:]), tuple(in_shape[1:]), k, s, d, p, drop)
        self.pattern, order = coo_to_csr(cols_c, rows_c, (self.d_in, self.d_out))
        self.weight_gather = _IndexCache(widx[order])
        self.zero_weights = _IndexCache(np.flatnonzero(drop))

    def run(self, x, tensors):
        self._check_pruned_still_zero(tensors[0])
        b = tensors[1] if len(tensors) > 1 else None
        fn = F.conv_transpose1d if self.nd == 1 else F.conv_transpose2d
        m = self.module
        return fn(x, tensors[0], b, m.stride, m.padding, m.output_padding, m.groups, m.dilation), x

    def param_grads(self, saved, tensors, g_out, needed=None):
        x = saved
        needed = list(needed or [True] * len(self.roles))
        g = g_out.reshape((x.shape[0],) + self.out_shape)
        out: list[Optional[torch.Tensor]] = [None] * len(self.roles)
        if needed[0]:
            out[0] = torch.ops.aten.convolution_backward(
                g, x, tensors[0].detach(), None, list(self.stride), list(self.padding), list(self.dilation),
                True, list(self.output_padding), self.module.groups, [False, True, False])[1]
        if len(self.roles) > 1 and needed[1]:
            out[1] = g.sum(dim=[0] + list(range(2, g.dim())))
        return out



# ----------------------------------------------------------------------------- registry


_REGISTRY: list[tuple[type, type]] = [
    (nn.Linear, LinearUnit),
    (nn.Conv1d, ConvUnit),
    (nn.Conv2d, ConvUnit),
    (nn.ReLU, ElementwiseUnit),
    (nn.LeakyReLU, ElementwiseUnit),
    (nn.Tanh, ElementwiseUnit),
    (nn.Sigmoid, ElementwiseUnit),
    (nn.GELU, ElementwiseUnit),
    (nn.MaxPool1d, MaxPoolUnit),
    (nn.MaxPool2d, MaxPoolUnit),
    (nn.AvgPool1d, AvgPoolUnit),
    (nn.AvgPool2d, AvgPoolUnit),
    (nn.BatchNorm1d, BatchNormUnit),
    (nn.BatchNorm2d, BatchNormUnit),
    (nn.Dropout, DropoutUnit),
    (nn.Dropout1d, DropoutUnit),
    (nn.Dropout2d, DropoutUnit),
    (nn.SiLU, ElementwiseUnit),
    (nn.ELU, ElementwiseUnit),
    (nn.Softplus, ElementwiseUnit),
    (nn.Hardtanh, ElementwiseUnit),
    (nn.ReLU6, ElementwiseUnit),
    (nn.Flatten, ReshapeUnit),
    (nn.Identity, ReshapeUnit),
    (nn.Unflatten, UnflattenUnit),
    (nn.LayerNorm, LayerNormUnit),
    (nn.GroupNorm, GroupNormUnit),
    (nn.Softmax, SoftmaxUnit),
    (nn.LogSoftmax, SoftmaxUnit),
    (nn.PReLU, PReLUUnit),
    (nn.Hardswish, ElementwiseMoreUnit),
    (nn.Hardsigmoid, ElementwiseMoreUnit),
    (nn.Mish, ElementwiseMoreUnit),
    (nn.SELU, ElementwiseMoreUnit),
    (nn.CELU, ElementwiseMoreUnit),
    (nn.Softsign, ElementwiseMoreUnit),
    (nn.AdaptiveAvgPool1d, SeparableResampleUnit),
    (nn.AdaptiveAvgPool2d, SeparableResampleUnit),
    (nn.Upsample, SeparableResampleUnit),
    (nn.UpsamplingNearest2d, SeparableResampleUnit),
    (nn.UpsamplingBilinear2d, SeparableResampleUnit),
    (nn.ZeroPad1d, SeparableResampleUnit),
    (nn.ZeroPad2d, SeparableResampleUnit),
    (nn.ReflectionPad1d, SeparableResampleUnit),
    (nn.ReflectionPad2d, SeparableResampleUnit),
    (nn.ReplicationPad1d, SeparableResampleUnit),
    (nn.ReplicationPad2d, SeparableResampleUnit),
    (nn.ConvTranspose1d, ConvTransposeUnit),
    (nn.ConvTranspose2d, ConvTransposeUnit),
]


def supported_layer_types() -> tuple[type, ...]:
    """The ``nn.Module`` types the layer library has a unit for (exact types, not subclasses)."""
    return tuple(t for t, _ in _REGISTRY)


def make_unit(index: int, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
              prune_zeros: bool = False) -> LayerUnit:
    """The unit for ``module`` at chain position ``index`` mapping per-sample ``in_shape`` to ``out_shape``.

    Raises ``TypeError`` for a layer type without a unit (subclasses with their own ``forward``
    are refused: the unit would not know what they compute).
    """
    for t, unit in _REGISTRY:
        if type(module) is t:
            return unit(index, module, tuple(in_shape), tuple(out_shape), prune_zeros=prune_zeros)
    names = ", ".join(t.__name__ for t, _ in _REGISTRY)
    raise TypeError(f"layer {index}: unsupported layer type {type(module).__module__}.{type(module).__name__}; "
                    f"supported: {names}")
