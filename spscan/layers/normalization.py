"""Normalization layers, and the low-rank factored form of ``J^T`` they share with softmax.

The exact ``J^T`` of each normalized group (and of each softmax slice) is a diagonal plus a
rank-1 or rank-2 term. The structured operator applies it in O(N) per group with the layer's own
backward kernel (as autograd does); the CSR values, needed only where a planned product multiplies
the layer into an up-sweep (``levels >= 1``), write each group's block densely, or, where the plan
chooses it, as two sparse factors (:class:`LowRankFactors`). Which form is cheaper depends on the
neighbours (a dense weight next to the layer makes the products dense either way), so it is a
planning decision (:func:`spscan.chain.planning.plan_chain`; measurements in
``bench/results/cpu-2core/norm_factored.md``).
"""

from __future__ import annotations

import abc
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn
import torch.nn.functional as F

from spscan.errors import NotPlannable
from spscan.layers.base import (MAX_PATTERN_ENTRIES, LayerUnit, PerDevice, UnitCapabilities, _identity_pattern, _prod,
                                coo_to_csr)

__all__ = ["BatchNormUnit", "LayerNormUnit", "GroupNormUnit", "LowRankFactors"]


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


def _role_tensor(unit: LayerUnit, tensors: Sequence[torch.Tensor], role: str) -> Optional[torch.Tensor]:
    return tensors[unit.roles.index(role)] if role in unit.roles else None


# ----------------------------------------------------------------------------- BatchNorm


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
    capabilities = UnitCapabilities(shape_preserving=True, structured_operator=True, fused_param_grads=True,
                                    mode_dependent=True)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        if len(in_shape) not in ((1, 2) if isinstance(module, nn.BatchNorm1d) else (3,)):
            raise ValueError(f"layer {index} ({self.name}): unexpected per-sample input shape {tuple(in_shape)}")
        c = in_shape[0]
        if c != module.num_features:
            raise ValueError(f"layer {index} ({self.name}): expected {module.num_features} channels "
                             f"(num_features), got per-sample input {tuple(in_shape)}")
        self.pattern = _identity_pattern(self.d_in)
        self.channel_of = PerDevice.index(np.repeat(np.arange(c, dtype=np.int64), self.d_in // c))

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
        w, b = _role_tensor(self, tensors, "weight"), _role_tensor(self, tensors, "bias")
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
        w = _role_tensor(self, tensors, "weight")
        return invstd * w.detach() if w is not None else invstd

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
        w = _role_tensor(self, tensors, "weight")
        w = w.detach() if w is not None else None
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


# ----------------------------------------------------------------------------- low-rank factors


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


def _csr_with_order(rows: np.ndarray, cols: np.ndarray, shape: tuple[int, int]):
    """:func:`coo_to_csr`, its permutation kept only where it is not the identity."""
    pat, order = coo_to_csr(rows, cols, shape)
    return pat, None if isinstance(order, slice) else PerDevice.index(order)


class LowRankFactors(LayerUnit):
    """``J^T`` as the product of two sparse factors, for units whose per-group ``J^T`` is a diagonal
    plus a rank-``r`` correction (LayerNorm, GroupNorm: ``r = 2``; Softmax, LogSoftmax: ``r = 1``);
    such units declare ``low_rank_factors``.

    A dense ``N x N`` block per group costs ``N^2`` entries per sample in every up-sweep product
    it enters; the factors ``L`` ``(d, d + rG)`` and ``R`` ``(d + rG, d)`` hold ``(1 + r) N`` each, and
    ``J^T g = L (R g)``: ``R`` maps ``g`` to ``[g', <v_1, g>, ..., <v_r, g>]`` per group, ``L`` combines
    them. In a chain the factors are two elements (``R`` nearer the output), which the planner
    multiplies like any others; whether a plan uses them instead of the dense blocks is a planning
    decision (:func:`spscan.chain.planning.plan_chain`).

    Subclasses set ``rank`` and ``factor_groups`` (``(G, N)`` flat indices) and implement
    :meth:`_factor_parts`.
    """

    capabilities = UnitCapabilities(low_rank_factors=True)
    rank: int
    factor_groups: np.ndarray

    @property
    def pattern(self) -> sp.csr_array:  # type: ignore[override]
        """The dense blocks' pattern, built on first use (a plan that factors the layer never needs it)."""
        return self._blocks()[0]

    @property
    def dense_order(self) -> Optional[PerDevice]:
        """CSR position -> ``(group, j, i)`` entry of the dense blocks (``None``: the same order)."""
        return self._blocks()[1]

    def _blocks(self) -> tuple[sp.csr_array, Optional[PerDevice]]:
        got = self.__dict__.get("_dense")
        if got is None:
            if self.nnz > MAX_PATTERN_ENTRIES:  # (a GroupNorm at 64x64: 10^9 entries; planned as its factors, or not)
                raise NotPlannable(f"layer {self.index} ({self.name}): its dense J^T blocks would hold {self.nnz:,} "
                                   f"entries, more than {MAX_PATTERN_ENTRIES:,}")
            got = self._dense = _csr_with_order(*_dense_blocks(self.factor_groups), (self.d_in, self.d_out))
        return got

    @property
    def cost_family(self) -> str:
        """Every unit of this kind is priced by the fitted LayerNorm: a per-group normalization whose
        operator is one O(N) backward kernel (LayerNorm's, GroupNorm's or Softmax's)."""
        return "LayerNormUnit"

    @property
    def cost_entries(self) -> int:
        """The operator's work per sample is O(d) (:class:`~spscan.layers.base.LayerUnit`), not the dense
        blocks' ``G N^2`` entries: a GroupNorm over 4096-element groups has 2048 times more."""
        return self.d_in

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
            got = self._factors = (_csr_with_order(rows, cols, (self.d_in, inner)),
                                   _csr_with_order(cols, rows, (inner, self.d_out)))
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


# ----------------------------------------------------------------------------- LayerNorm, GroupNorm


class _GroupNormalizeUnit(LowRankFactors):
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
    capabilities = UnitCapabilities(structured_operator=True, fused_param_grads=True, low_rank_factors=True)
    groups: int
    group_size: int

    def _setup(self, gain_index: Optional[np.ndarray]) -> None:
        g, n = self.groups, self.group_size
        self.rank, self.factor_groups = 2, np.arange(self.d_in, dtype=np.int64).reshape(g, n)
        self.gain_index = None if gain_index is None else PerDevice.index(gain_index)

    def _tensor(self, tensors: Sequence[torch.Tensor], role: str) -> Optional[torch.Tensor]:
        return _role_tensor(self, tensors, role)

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

    def _gain(self, w: torch.Tensor) -> torch.Tensor:
        """The per-element gain ``(G * N,)`` read from the weight."""
        return torch.index_select(w.detach().reshape(-1), 0, self.gain_index.on(w.device))

    def fill(self, saved, tensors):
        x = saved[0]
        b, n = x.shape[0], self.group_size
        xhat, rstd = self._normalized(saved)
        eye = torch.eye(n, dtype=x.dtype, device=x.device)
        blk = eye - 1.0 / n - xhat.unsqueeze(3) * xhat.unsqueeze(2) / n  # (B, G, j, i), symmetric
        scale = rstd.unsqueeze(3)  # (B, G, 1, 1)
        w = self._tensor(tensors, "weight")
        if w is not None:
            scale = scale * self._gain(w).reshape(1, self.groups, 1, n)
        return (blk * scale).reshape(b, -1)

    def _factor_parts(self, saved, tensors):
        # L = [rstd I | -rstd/N 1 | -rstd/N x̂], R = [diag(gain) ; gain^T ; (x̂ gain)^T] per group
        xhat, rstd = self._normalized(saved)
        n = self.group_size
        w = self._tensor(tensors, "weight")
        gain = torch.ones_like(xhat) if w is None else self._gain(w).reshape(1, self.groups, n).expand_as(xhat)
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
