"""Lowering a periodic linear run to a structured recurrence: the descriptor the fused kernels take.

A :class:`~spscan.planner.program.LinearRun` of ``p * F`` steps that repeats one period of ``p``
sub-steps ``F`` times, where one sub-step is a *shared* matrix made of dense and diagonal ``N x N``
blocks (``S``) and the others are grids of diagonal blocks (``E``, per-sample or shared), is the
recurrence ``y' = S E_s y + a_s`` (order 0) or ``y' = E_s S y + a_s`` (order 1): a recurrent
network's backward chain, or its forward Jacobians in a Newton solve. :func:`recurrence_of` finds
that structure from the run's table and its patterns alone, once, and writes it down as block
grids and offsets (:class:`Recurrence`): what the kernels need, in their terms (blocks, diagonals,
value positions), never a layer's name.

The shared sub-step must read the same values in every period (its arena offset does not move):
a binding whose signature declares the values periodic (``Plan.bind(period=...)``) lays one copy
of each shared element out, so its runs qualify; a general chain whose shared layers happen to
have equal patterns keeps one offset per layer and stays on the general kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .patterns import Pattern

__all__ = ["Recurrence", "recurrence_of", "periodic_structure", "MAX_STATE_BLOCKS", "MAX_INNER_BLOCKS", "CHUNK_SCALE"]

MAX_STATE_BLOCKS = 2  # blocks of the recurrence's state (the kernels hold them as named tiles)
MAX_INNER_BLOCKS = 5  # blocks of the vectors between the parts
MAX_SHARED_BLOCKS = 10  # blocks of the shared part's grid
# a run of F fused steps goes in chunks of CHUNK_SCALE * sqrt(F) steps: the critical path is ~2 chunk + F / chunk
# dependent steps, and a chunk's step costs more than a carry's (the kernels' launches and the cost model agree)
CHUNK_SCALE = 0.7


@dataclass(frozen=True)
class Recurrence:
    """A periodic linear run as a structured recurrence (see the module docstring).

    Block grids are tuples of rows of blocks. ``e1``/``e2`` entries: ``(kind, rel, stride)`` with kind
    0 absent, 1 per-sample (from the step's value base ``p_base + s * p_step``), 2 shared (from
    ``s_base``). ``sg`` entries: ``(kind, rel, rs, cs)`` with kind 0 absent, 1 dense (entry ``(i, k)``
    at ``rel + rs * i + cs * k``), 2 diagonal (entry ``i`` at ``rel + rs * i``). ``outs``: each
    sub-step's output slot relative to ``out_base + s * out_step``, in sub-step order.
    """

    n: int  # block size
    ny: int  # state blocks (m = ny * n)
    nz: int  # blocks between S and E (the shared part's input in order 0, its output in order 1)
    k1: int  # output blocks of E1
    order: int  # 0: E then S; 1: S then E
    e1: tuple
    e2: tuple  # () when the per-step part is one grid
    sg: tuple
    outs: tuple
    steps: int  # fused steps F
    period: int  # run sub-steps per fused step
    s_base: int
    p_base: int
    p_step: int
    v_in: int
    out_base: int
    out_step: int
    add_base: int
    add_step: int
    adds: int  # fused steps s < adds receive a_s

    @property
    def m(self) -> int:
        return self.ny * self.n

    @property
    def affine(self) -> int:
        """1 when some step has an additive term (the chunk maps then carry one)."""
        return 1 if self.adds > 0 else 0

    def flops_per_step(self) -> tuple[int, int]:
        """Multiply-adds per fused step and sample: (vector step, composing a chunk map's ``m + 1`` columns):
        ``n^2`` per dense block, ``n`` per diagonal one."""
        n = self.n
        vec = sum(n * n if b[0] == 1 else n for row in self.sg for b in row if b[0]) + \
            n * sum(1 for g in (self.e1, self.e2) for row in g for b in row if b[0])
        return vec, vec * (self.m + self.affine)


def _affine(values: np.ndarray) -> Optional[tuple[int, int]]:
    """``(first, step)`` when ``values`` is an arithmetic progression, else ``None``."""
    if values.size == 0:
        return None
    step = int(values[1] - values[0]) if values.size > 1 else 0
    if np.all(values == values[0] + step * np.arange(values.size)):
        return int(values[0]), step
    return None


def _positions(p: Optional[Pattern], kind: str, rows: int, cols: int) -> np.ndarray:
    """Value position of every stored entry as a dense ``(rows, cols)`` array (-1: not stored)."""
    pos = np.full((rows, cols), -1, dtype=np.int64)
    if kind == "dense" or (kind == "sparse" and p.is_full):
        pos[:] = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols)
    elif kind == "diag":
        pos[np.arange(rows), np.arange(rows)] = np.arange(rows)
    else:
        r = np.repeat(np.arange(rows, dtype=np.int64), np.diff(p.indptr))
        pos[r, p.indices] = np.arange(p.nnz, dtype=np.int64)
    return pos


def _blocks(pos: np.ndarray, n: int) -> Optional[list[list[tuple]]]:
    """The ``n x n`` block grid of one matrix: each block ``("empty",)``, ``("diag", first, stride)`` or
    ``("dense", first, rs, cs)`` with affine value positions, else ``None`` (not structured)."""
    rows, cols = pos.shape
    eye = np.eye(n, dtype=bool)
    ar = np.arange(n)
    grid = []
    for br in range(rows // n):
        row = []
        for bc in range(cols // n):
            blk = pos[br * n:(br + 1) * n, bc * n:(bc + 1) * n]
            stored = blk >= 0
            if not stored.any():
                row.append(("empty",))
            elif np.array_equal(stored, eye):
                d = _affine(blk[ar, ar])
                if d is None:
                    return None
                row.append(("diag",) + d)
            elif stored.all():
                first, rs = int(blk[0, 0]), int(blk[1, 0] - blk[0, 0]) if n > 1 else 0
                cs = int(blk[0, 1] - blk[0, 0]) if n > 1 else 0
                if not np.array_equal(blk, first + rs * ar[:, None] + cs * ar[None, :]):
                    return None
                row.append(("dense", first, rs, cs))
            else:
                return None
        grid.append(row)
    return grid


def _period_shape(positions: list[np.ndarray], shared: list[Optional[bool]]) -> Optional[tuple]:
    """One period's sub-steps (their values' positions as dense arrays, in run order; ``shared[r]`` or
    ``None`` where not known yet) as a structured recurrence: ``(n, grids, s_sub, order)`` (block size,
    block grids, the shared part's sub-step, 0 for ``S E`` and 1 for ``E S``), else ``None``."""
    p = len(positions)
    n = 0
    for pos in positions:
        n = math.gcd(n, math.gcd(*pos.shape))
    if positions[-1].shape[0] != positions[0].shape[1]:
        return None  # a period maps the state to itself
    grids = [_blocks(pos, n) for pos in positions]
    if any(g is None for g in grids):
        return None
    dense = [r for r, g in enumerate(grids) if any(b[0] == "dense" for row in g for b in row)]
    if not dense and n == 1:  # 1 x 1 blocks read as diagonals: the shared part is the last or the first
        dense = [r for r in (p - 1, 0) if shared[r] is not False][:1]
    if len(dense) != 1 or dense[0] not in (p - 1, 0) or shared[dense[0]] is False:
        return None
    s_sub = dense[0]
    if positions[0].shape[1] // n > MAX_STATE_BLOCKS:
        return None
    return n, grids, s_sub, 0 if s_sub == p - 1 else 1


def _vector_macs(grids: list, n: int) -> int:
    """Multiply-adds of one step on one vector: ``n^2`` per dense block, ``n`` per diagonal one."""
    return sum(n * n if b[0] == "dense" else n for g in grids for row in g for b in row if b[0] != "empty")


def periodic_structure(patterns: list[Pattern], max_n: int = 1 << 30) -> Optional[tuple[int, int, int]]:
    """Whether a run of these matrices (in run order) is a structured recurrence by its patterns alone:
    ``(period, fused steps, multiply-adds per fused step and sample of composing a chunk map)``, else
    ``None``. The cost model's view (:func:`recurrence_of` decides on the lowered run, where the
    values' sharedness and places are known)."""
    total = len(patterns)
    for p in (2, 3):
        if total % p or total // p < 2:
            continue
        if any(patterns[j].key != patterns[j % p].key for j in range(p, total)):
            continue
        shape = _period_shape([_positions(q, "sparse", q.rows, q.cols) for q in patterns[:p]], [None] * p)
        if shape is None or shape[0] > max_n:
            continue
        n, grids, _, _ = shape
        return p, total // p, _vector_macs(grids, n) * (patterns[0].cols + 1)
    return None


def recurrence_of(op, min_steps: int = 2) -> Optional[Recurrence]:
    """The structured recurrence a linear run is, or ``None`` (see the module docstring).

    ``op``: a :class:`~spscan.planner.program.LinearRun`; ``min_steps``: fewest fused steps worth it.
    """
    total = op.steps
    for period in (2, 3):
        if total % period or total // period < min_steps:
            continue
        rec = _with_period(op, period)
        if rec is not None:
            return rec
    return None


def _with_period(op, p: int) -> Optional[Recurrence]:
    F = op.steps // p
    idx = np.arange(F) * p
    shared, mats, offs = [], [], []
    for r in range(p):
        j = idx + r
        for field in (op.dense, op.shared, op.rows, op.cols, op.pattern):
            if np.any(field[j] != field[r]):
                return None
        if r < p - 1 and np.any(op.add[j] >= 0):
            return None  # additive terms only on a period's last output
        kind = "dense" if op.dense[r] else ("sparse" if op.pattern[r] >= 0 else "diag")
        shared.append(bool(op.shared[r]))
        pat = op.csr[int(op.pattern[r])] if kind == "sparse" else None
        mats.append(_positions(pat, kind, int(op.rows[r]), int(op.cols[r])))
        off = _affine(op.mat_offset[j])
        if off is None or (shared[-1] and off[1] != 0):
            return None  # shared values must sit in one place for every period
        offs.append(off)
    # the per-sample values of a period advance together
    steps_p = {o[1] for o, s in zip(offs, shared) if not s}
    if len(steps_p) > 1:
        return None
    p_step = steps_p.pop() if steps_p else 0
    # outputs: one progression per sub-step, one common stride
    outs = [_affine(op.out[idx + r]) for r in range(p)]
    if any(o is None for o in outs) or len({o[1] for o in outs}) > 1:
        return None
    out_step = outs[0][1]
    # additive terms: a progression over the first ``adds`` fused steps, none after
    add = op.add[idx + p - 1]
    adds = int(np.argmax(add < 0)) if np.any(add < 0) else F
    if np.any(add[adds:] >= 0):
        return None
    add_prog = _affine(add[:adds]) if adds else (0, 0)
    if add_prog is None:
        return None
    shape = _period_shape(mats, shared)
    if shape is None:
        return None
    n, grids, s_sub, order = shape
    e_subs = list(range(p - 1)) if order == 0 else list(range(1, p))
    ny = int(op.cols[0]) // n
    s_base = min((offs[r][0] for r in range(p) if shared[r]), default=0)
    per = [r for r in range(p) if not shared[r]]
    p_base = offs[per[0]][0] if per else 0

    def e_grid(r: int) -> tuple:
        base = offs[r][0] - (s_base if shared[r] else p_base)
        kind = 2 if shared[r] else 1
        return tuple(tuple((0, 0, 0) if b[0] == "empty" else (kind, base + b[1], b[2]) for b in row)
                     for row in grids[r])

    base_s = offs[s_sub][0] - s_base
    sg = tuple(tuple((0, 0, 0, 0) if b[0] == "empty" else
                     (1, base_s + b[1], b[2], b[3]) if b[0] == "dense" else (2, base_s + b[1], b[2], 0)
                     for b in row) for row in grids[s_sub])
    e1 = e_grid(e_subs[0])
    e2 = e_grid(e_subs[1]) if len(e_subs) > 1 else ()
    k1 = len(e1)
    nz = len(sg[0]) if order == 0 else len(sg)
    if nz > MAX_INNER_BLOCKS or k1 > MAX_INNER_BLOCKS or len(sg) * len(sg[0]) > MAX_SHARED_BLOCKS:
        return None
    return Recurrence(
        n=n, ny=ny, nz=nz, k1=k1, order=order, e1=e1, e2=e2, sg=sg,
        outs=tuple(int(o[0] - outs[0][0]) for o in outs), steps=F, period=p, s_base=int(s_base),
        p_base=int(p_base), p_step=int(p_step), v_in=int(op.vin0), out_base=int(outs[0][0]), out_step=int(out_step),
        add_base=int(add_prog[0]), add_step=int(add_prog[1]), adds=adds)
