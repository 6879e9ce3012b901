"""The plan of the model-parallel scan (:mod:`spscan.distributed`): the chain's cut into contiguous
slices, one per rank (:func:`balanced_slices` balances their planned FLOPs), the cross-rank schedule
of recursive doubling (peers, partial patterns, message sizes) and, per rank, the plans it runs on
the one engine: the slice composite, the compositions of the rounds and the boundary scan.

Pure planning, deterministic: every rank derives the same composite patterns from all patterns, so
only values travel at run time. Nothing here needs a process group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch

from spscan.api import plan as _plan_model
from spscan.runtime.plan import build_composite, build_plan, plan_profile
from spscan.planner.patterns import Pattern, as_chain
from spscan.planner.symbolic import product_counts

__all__ = ["DistributedPlan", "RankPlan", "plan", "balanced_slices"]


# ----------------------------------------------------------------------------- slicing


def layer_costs(pats: Sequence[Pattern]) -> np.ndarray:
    """FLOPs charged to each layer: its backward SpMV plus its product with the next layer."""
    cost = np.array([2.0 * p.nnz for p in pats])
    for i in range(len(pats) - 1):
        a, b = pats[i], pats[i + 1]
        cost[i] += 2.0 * (a.rows * a.cols * b.cols if a.is_full and b.is_full else product_counts(a, b))
    return cost


def balanced_slices(patterns: Any, world_size: int, example_input: Optional[torch.Tensor] = None) -> list[int]:
    """Cut a chain into ``world_size`` contiguous slices of near-equal planned FLOPs.

    Args:
        patterns: ``n`` transposed-Jacobian patterns in layer order (SciPy/torch CSR), anything
            with a ``.patterns`` list (a :class:`spscan.Plan`, a model plan), or an
            ``nn.Sequential`` with ``example_input`` ``(B, *in_shape)``. A model has one pattern per
            (flattened) layer, so the cuts are layer indices.
        world_size: number of slices ``p``, ``1 <= p <= n``.
        example_input: only for an ``nn.Sequential``.

    Returns:
        boundaries ``[0, b_1, ..., b_{p-1}, n]``: rank ``r`` owns layers ``b_r+1 .. b_{r+1}``.
        Each layer costs ``2 nnz_i`` (its SpMV) ``+ 2 pairs(J_i^T J_{i+1}^T)`` (its share of the
        slice reduction); the cut minimizes the largest slice cost.
    """
    if isinstance(patterns, torch.nn.Module):
        if example_input is None:
            raise TypeError("balanced_slices(model, world_size, example_input): a model needs an example input")
        patterns = _plan_model(patterns, example_input, levels=0, backend="torch").patterns
    pats = _as_patterns(patterns)
    n = len(pats)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= n:
        raise ValueError(f"world_size: expected an int in [1, n={n}] (one layer per rank at least), got {world_size!r}")
    cost = layer_costs(pats)
    prefix = np.concatenate([[0.0], np.cumsum(cost)])

    def cuts(limit: float) -> Optional[list[int]]:
        bounds = [0]
        for r in range(world_size - 1):
            start = bounds[-1]
            left = world_size - 1 - r  # slices still to place after this one
            # the furthest end within the limit that leaves a layer for every later slice
            end = int(np.searchsorted(prefix, prefix[start] + limit, side="right")) - 1
            end = min(max(end, start + 1), n - left)
            if prefix[end] - prefix[start] > limit and end > start + 1:
                return None
            bounds.append(end)
        if prefix[n] - prefix[bounds[-1]] > limit:
            return None
        return bounds + [n]

    # feasibility is monotone in the limit: bisect it (O(n) memory, exact to float resolution)
    lo_l, hi_l = float(cost.max()), float(prefix[n])
    best = cuts(lo_l)
    if best is not None:
        return best
    best = cuts(hi_l)
    for _ in range(200):
        mid = 0.5 * (lo_l + hi_l)
        if not lo_l < mid < hi_l:
            break
        got = cuts(mid)
        if got is not None:
            best, hi_l = got, mid
        else:
            lo_l = mid
    assert best is not None
    return best


def _as_patterns(patterns: Any) -> list[Pattern]:
    if hasattr(patterns, "patterns") and not isinstance(patterns, (list, tuple)):
        patterns = patterns.patterns
    return as_chain(patterns)


# ----------------------------------------------------------------------------- plan


@dataclass
class RankPlan:
    """What one rank needs at run time: plans on the one engine (no products of its own).

    Attributes:
        rank, lo, hi: the rank owns layers ``lo+1 .. hi`` and gradients ``dl/dx_lo .. dl/dx_hi``.
        local: the scan plan (:func:`spscan.plan`) over ``patterns[lo:hi]`` (finishes the slice).
        reduce: the composite plan (:func:`spscan.plan_composite`) of the slice, ``None`` if the rank
            never sends its own element (the last rank, whose element is the gradient, and rank 0).
        compose: round ``k`` -> the plan that composes the rank's partial with the piece received in
            round ``k`` when the result is sent on: a two-element composite plan (the piece is a
            matrix) or a one-layer scan (the piece is the gradient vector).
        boundary: the scan over the matrix pieces received, in round order, that turns the last piece
            (the gradient) into ``dl/dx_hi``; ``None`` on the last rank.
    """

    rank: int
    lo: int
    hi: int
    local: Any
    reduce: Any = None
    compose: dict[int, Any] = field(default_factory=dict)
    boundary: Any = None


class DistributedPlan:
    """A chain cut into ``world_size`` slices, with the cross-rank scan planned (see :func:`plan`).

    Attributes:
        world_size: ``p``.
        bounds: ``[0, b_1, ..., n]``; ``slices[r] = (b_r, b_{r+1})``.
        rounds: ``ceil(log2 p)``, the communication rounds of one backward.
        patterns: canonical pattern of each ``J_i^T`` (SciPy CSR), in layer order.
        dims: ``d_0 .. d_n``.
        bytes_budget: the most pair-index bytes one composite product may plan.
    """

    def __init__(self, patterns: list[Pattern], world_size: int, bounds: list[int], plan_kwargs: dict,
                 bytes_budget: float = float("inf")) -> None:
        self._pats = patterns
        self.bytes_budget = bytes_budget
        self.world_size = world_size
        self.bounds = bounds
        self.plan_kwargs = dict(plan_kwargs)
        self.rounds = math.ceil(math.log2(world_size)) if world_size > 1 else 0
        self._slice_plans: dict[int, Any] = {}
        self._compose_plans: dict[tuple[int, int], Any] = {}
        self._partial: dict[tuple[int, int], Optional[sp.csr_array]] = {}
        self._ranks: dict[int, RankPlan] = {}

    @property
    def n(self) -> int:
        return len(self._pats)

    @property
    def patterns(self) -> list[sp.csr_array]:
        return [p.to_scipy() for p in self._pats]

    @property
    def slices(self) -> list[tuple[int, int]]:
        return [(self.bounds[r], self.bounds[r + 1]) for r in range(self.world_size)]

    @property
    def dims(self) -> list[int]:
        return [p.rows for p in self._pats] + [self._pats[-1].cols]

    def __repr__(self) -> str:
        return f"DistributedPlan(n={self.n}, world_size={self.world_size}, bounds={self.bounds}, rounds={self.rounds})"

    # -- the cross-rank schedule ---------------------------------------------------------
    def send_peer(self, rank: int, k: int) -> Optional[int]:
        """The rank that ``rank`` sends to in round ``k`` (``rank - 2^k``), or ``None``."""
        return rank - (1 << k) if rank - (1 << k) >= 0 else None

    def recv_peer(self, rank: int, k: int) -> Optional[int]:
        """The rank that ``rank`` receives from in round ``k`` (``rank + 2^k``), or ``None``."""
        return rank + (1 << k) if rank + (1 << k) < self.world_size else None

    def sends(self, rank: int, k: int) -> bool:
        return self.send_peer(rank, k) is not None

    def _composite_kwargs(self) -> dict:
        kw = {k: v for k, v in self.plan_kwargs.items() if k in ("backend", "device", "dtype", "batch_size")}
        return kw

    def slice_plan(self, rank: int):
        """The composite plan of ``rank``'s slice (``M_rank``, the product of its transposed Jacobians)."""
        hit = self._slice_plans.get(rank)
        if hit is None:
            lo, hi = self.bounds[rank], self.bounds[rank + 1]
            hit = build_composite(self._pats[lo:hi], bytes_budget=self.bytes_budget, **self._composite_kwargs())
            self._slice_plans[rank] = hit
        return hit

    def slice_pattern(self, rank: int) -> sp.csr_array:
        """Stored pattern of the composite ``M_rank``."""
        return self.slice_plan(rank).composite_pattern

    def partial_range(self, rank: int, k: int) -> tuple[int, int]:
        """Ranks ``[first, last]`` whose slices the partial of ``rank`` covers before round ``k``."""
        return rank, min(self.world_size - 1, rank + (1 << k) - 1)

    def _compose_plan(self, rank: int, k: int):
        """The composite plan of ``rank``'s partial before round ``k`` with the matrix piece received in it."""
        key = (rank, k)
        hit = self._compose_plans.get(key)
        if hit is None:
            own = self.partial_pattern(rank, k)
            got = self.partial_pattern(self.recv_peer(rank, k), k)
            hit = build_composite([own, got], bytes_budget=self.bytes_budget, **self._composite_kwargs())
            self._compose_plans[key] = hit
        return hit

    def partial_pattern(self, rank: int, k: int) -> Optional[sp.csr_array]:
        """Matrix pattern of ``rank``'s partial before round ``k``; ``None`` once it holds the gradient."""
        key = (rank, k)
        if key in self._partial:
            return self._partial[key]
        if rank + (1 << k) - 1 >= self.world_size - 1:
            out: Optional[sp.csr_array] = None
        elif k == 0:
            out = self.slice_pattern(rank)
        else:
            got = self.partial_pattern(self.recv_peer(rank, k - 1), k - 1)
            out = None if got is None else self._compose_plan(rank, k - 1).composite_pattern
        self._partial[key] = out
        return out

    # -- message sizes --------------------------------------------------------------------
    def message_numel(self, rank: int, k: int, batch: int, shared: Sequence[bool], has_extra: Sequence[bool]) -> int:
        """Elements of the message ``rank`` sends in round ``k`` (0 if it sends none).

        ``shared[r]``: every layer of rank ``r`` has ``(nnz,)`` values; ``has_extra[r]``: rank ``r``
        passes an ``extra`` term for an index it owns (below its last one).
        """
        if not self.sends(rank, k):
            return 0
        first, last = self.partial_range(rank, k)
        pat = self.partial_pattern(rank, k)
        if pat is None:
            return batch * self.dims[self.bounds[rank]]
        mat = pat.nnz * (1 if all(shared[first: last + 1]) else batch)
        vec = batch * pat.shape[0] if any(has_extra[first: last + 1]) else 0
        return mat + vec

    def planned_bytes(self, rank: int, batch: int, dtype: torch.dtype, shared: Sequence[bool],
                      has_extra: Sequence[bool]) -> tuple[int, int]:
        """``(bytes sent, bytes received)`` by ``rank`` in one backward (all rounds)."""
        elem = torch.empty((), dtype=dtype).element_size()
        sent = sum(self.message_numel(rank, k, batch, shared, has_extra) for k in range(self.rounds))
        recv = 0
        for k in range(self.rounds):
            src = self.recv_peer(rank, k)
            if src is not None:
                recv += self.message_numel(src, k, batch, shared, has_extra)
        return sent * elem, recv * elem

    def participating_rounds(self, rank: int) -> list[int]:
        """Rounds in which ``rank`` sends or receives."""
        return [k for k in range(self.rounds)
                if self.send_peer(rank, k) is not None or self.recv_peer(rank, k) is not None]

    # -- per rank -------------------------------------------------------------------------
    def rank_plan(self, rank: int) -> RankPlan:
        """The plans ``rank`` runs (made once, cached)."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank: expected an int in [0, {self.world_size}), got {rank!r}")
        hit = self._ranks.get(rank)
        if hit is not None:
            return hit
        lo, hi = self.bounds[rank], self.bounds[rank + 1]
        rp = RankPlan(rank, lo, hi, build_plan(self._pats[lo:hi], bind=None, **self.plan_kwargs))
        last = self.world_size - 1
        if rank != last and self.sends(rank, 0):
            rp.reduce = self.slice_plan(rank)
        pieces = []
        for k in range(self.rounds):
            src = self.recv_peer(rank, k)
            if src is None:
                continue
            got = self.partial_pattern(src, k)
            if got is not None:
                pieces.append(got)
            if k + 1 < self.rounds and self.sends(rank, k + 1):
                own = self.partial_pattern(rank, k)
                assert own is not None, "a partial that is sent on after receiving is still a matrix"
                rp.compose[k] = self._compose_plan(rank, k) if got is not None else \
                    build_plan([own], levels=0, bind=None, **self._composite_kwargs())
        if rank != last and pieces:
            rp.boundary = build_plan(pieces, levels=0, bind=None, **self._composite_kwargs())
        self._ranks[rank] = rp
        return rp


def plan(patterns: Any, world_size: int, slices: Optional[Sequence[int]] = None, rank: Optional[int] = None,
         **plan_kwargs: Any) -> DistributedPlan:
    """Plan a model-parallel backward of a chain over ``world_size`` ranks.

    Call it with the same arguments on every rank: planning is deterministic, so every rank
    derives the same composite patterns and only values are exchanged at run time.

    Args:
        patterns: all ``n`` patterns of the chain in layer order (``patterns[i-1]`` is ``J_i^T``,
            shape ``(d_{i-1}, d_i)``), SciPy or torch CSR; or an object with ``.patterns``.
        world_size: number of ranks ``p`` (``1 <= p <= n``).
        slices: boundaries ``[0, b_1, ..., n]`` (strictly increasing, ``p+1`` entries); rank ``r``
            owns layers ``b_r+1 .. b_{r+1}``. Default: :func:`balanced_slices`.
        rank: if given, that rank's local plan and products are built now (else on first use).
        **plan_kwargs: passed to :func:`spscan.plan` for each slice's local plan (``levels``,
            ``backend``, ``device``, ``dtype``, ...).

    Returns:
        a :class:`DistributedPlan`.
    """
    pats = _as_patterns(patterns)
    n = len(pats)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= n:
        raise ValueError(f"world_size: expected an int in [1, n={n}] (one layer per rank at least), got {world_size!r}")
    if slices is None:
        bounds = balanced_slices(pats, world_size)
    else:
        bounds = [int(b) for b in slices]
        if len(bounds) != world_size + 1 or bounds[0] != 0 or bounds[-1] != n or any(
                b1 <= b0 for b0, b1 in zip(bounds, bounds[1:])):
            raise ValueError(f"slices: expected {world_size + 1} strictly increasing boundaries from 0 to n={n} "
                             f"(every rank owns at least one layer), got {list(slices)}")
    profile = plan_profile(plan_kwargs.get("device"), plan_kwargs.get("backend", "auto"))
    dplan = DistributedPlan(pats, world_size, bounds, plan_kwargs, profile.bytes_budget)
    if rank is not None:
        dplan.rank_plan(rank)
    return dplan
