"""The modified Blelloch scan (paper Algorithm 1) as a static schedule, with hybrid depth.

The scan runs over the array ``a = [g_n, J_n^T, ..., J_1^T]`` (positions ``0..n``) with
``A ◇ B = B·A``. With depth ``K`` it does ``K`` up-sweep levels of pairwise products, a linear
scan over the ``ceil((n+1)/2^K)`` block reductions, then ``K`` down-sweep levels with the
operands of ◇ reversed. ``K = 0`` is backprop with explicit Jacobians; ``K = max_levels(n)`` is
pure Blelloch (the middle part is then a single step, Algorithm 1's root).

Elements are affine maps ``g -> M g + v`` (the affine scan): ``M`` is a matrix id (``None`` once
the element contains the gradient: the *spine*), ``v`` a vector id or ``None``. Products of two
matrices are ``MMOp`` (SpGEMM / GEMM); everything that touches a vector is ``MVOp`` (SpMV / GEMV).
This module is pure bookkeeping over ids: no patterns, no values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

__all__ = ["MMOp", "MVOp", "Step", "ScanSchedule", "max_levels", "blelloch_schedule", "reduction_schedule",
           "schedule_for", "UpSweep", "GRAD"]

GRAD = 0  # vector id of the incoming gradient g_n (+ extra[n])


def max_levels(n: int) -> int:
    """Up-sweep depth of the pure Blelloch scan over ``n`` Jacobians (``n+1`` array elements)."""
    return max(0, math.ceil(math.log2(n + 1)) - 1)


def extra_vec(i: int) -> int:
    """Vector id of ``extra[i]``, ``0 <= i < n``."""
    return 1 + i


class MMOp(NamedTuple):
    """``out = left @ right`` (``left`` holds the lower layers: it is applied last)."""

    out: int
    left: int
    right: int


class MVOp(NamedTuple):
    """``out = mat @ vin + add`` (``add`` may be ``None``)."""

    out: int
    mat: int
    vin: int
    add: Optional[int]


@dataclass
class Step:
    phase: str  # "up" | "mid" | "down"
    level: int
    mm: list[MMOp] = field(default_factory=list)
    mv: list[MVOp] = field(default_factory=list)


@dataclass
class ScanSchedule:
    """Static schedule for ``n`` Jacobians at depth ``levels``.

    Matrix ids ``0..n-1`` are the inputs in layer order (id ``i-1`` is ``J_i^T``); product ids follow.
    Vector id ``0`` is the gradient, ``1+i`` is ``extra[i]``; computed vectors follow.
    ``outputs[i]`` is the vector id of ``dl/dx_i``.
    """

    n: int
    levels: int
    steps: list[Step]
    products: dict[int, MMOp]  # product id -> op
    outputs: list[int]
    num_mats: int
    num_vecs: int
    kind: str = "scan"  # "scan": outputs are every dl/dx_i; "reduce": the composite ``root`` only
    root: Optional[tuple[Optional[int], Optional[int]]] = None  # reduce: (matrix id, vector id or None)


def _pairs(n: int, d: int):
    for i in range(0, n - (1 << d) + 1, 1 << (d + 1)):
        yield i + (1 << d) - 1, min(i + (1 << (d + 1)) - 1, n)


Element = tuple[Optional[int], Optional[int]]


def _combine(left: Element, right: Element, step: Step, products: dict[int, MMOp], new) -> Element:
    """``right ◇ left`` for adjacent elements (``left`` holds the higher layers): one up-sweep node.

    ``(M_r, v_r) ∘ (M_l, v_l) = (M_r M_l, M_r v_l + v_r)``; a left element that contains the gradient
    (``M_l is None``, the spine) only needs the mat-vec.
    """
    (lm, lv), (rm, rv) = left, right
    if lm is None:
        v = new("vec")
        step.mv.append(MVOp(v, rm, lv, rv))
        return None, v
    m = new("mat")
    op = MMOp(m, rm, lm)
    products[m] = op
    step.mm.append(op)
    if lv is None:
        return m, rv
    vv = new("vec")
    step.mv.append(MVOp(vv, rm, lv, rv))
    return m, vv


def _counters(n: int, start: Optional[dict[str, int]] = None):
    counters = {"mat": n, "vec": n + 2} if start is None else dict(start)

    def new(kind: str) -> int:
        value = counters[kind]
        counters[kind] = value + 1
        return value

    return counters, new


def reduction_schedule(n: int, has_extra: Optional[Sequence[bool]] = None) -> ScanSchedule:
    """Reduce a whole chain to its affine composite ``g_0 = M g_n + v`` by a pairwise product tree.

    ``M = J_1^T J_2^T ... J_n^T`` (``(d_0, d_n)``) and ``v = sum_i J_1^T..J_i^T extra[i]`` over the
    given ``extra[i]``, ``0 <= i < n`` (``extra[n]`` is not part of the composite). The nodes are
    the up-sweep's (same operands, same order), so a slice of a model-parallel scan is planned,
    lowered and run exactly like the up-sweep of a scan. ``root`` is the composite's
    ``(matrix id, vector id or None)``; there are no per-layer outputs.
    """
    if n < 1:
        raise ValueError(f"a chain needs at least one Jacobian, got n={n}")
    flags = [False] * (n + 1) if has_extra is None else [bool(f) for f in has_extra]
    counters, new = _counters(n)
    # scan order: element k holds layer n-k (k = 0 is the top layer), as in the Blelloch array
    cur: list[Element] = [(n - 1 - k, extra_vec(n - 1 - k) if flags[n - 1 - k] else None) for k in range(n)]
    steps: list[Step] = []
    products: dict[int, MMOp] = {}
    level = 0
    while len(cur) > 1:
        step = Step("up", level)
        nxt = [_combine(cur[2 * j], cur[2 * j + 1], step, products, new) for j in range(len(cur) // 2)]
        cur = nxt + ([cur[-1]] if len(cur) % 2 else [])
        steps.append(step)
        level += 1
    return ScanSchedule(n, level, steps, products, [], counters["mat"], counters["vec"], kind="reduce",
                        root=cur[0])


def schedule_for(kind: str, n: int, levels: int, has_extra: Optional[Sequence[bool]] = None) -> ScanSchedule:
    """The schedule of a plan of ``kind`` (``"scan"`` at depth ``levels`` or ``"reduce"``) for an extra signature."""
    if kind == "reduce":
        return reduction_schedule(n, has_extra)
    return blelloch_schedule(n, levels, has_extra)


def blelloch_schedule(n: int, levels: int, has_extra: Optional[Sequence[bool]] = None) -> ScanSchedule:
    """Build the hybrid modified-Blelloch schedule.

    Args:
        n: number of Jacobians (``>= 1``).
        levels: up-sweep depth ``K``, ``0 <= K <= max_levels(n)``.
        has_extra: ``n+1`` flags, whether ``extra[i]`` is given (``extra[n]`` is folded into the
            gradient and ignored here). ``None`` means no extras.
    """
    if n < 1:
        raise ValueError(f"a chain needs at least one Jacobian, got n={n}")
    if not 0 <= levels <= max_levels(n):
        raise ValueError(f"levels must lie in [0, {max_levels(n)}] for n={n}, got {levels}")
    up = UpSweep(n, has_extra)
    for _ in range(levels):
        up.extend()
    return up.finish()


class UpSweep:
    """The up-sweep of :func:`blelloch_schedule` built one level at a time.

    The first ``K`` up-sweep levels of the schedule are the same nodes, with the same ids, at every
    depth ``>= K``, and the down-sweep step of level ``d`` reads matrices fixed once level ``d - 1``
    is built. So a depth search extends one ``UpSweep`` level by level, asks :meth:`down_mats` for
    what mirrors each new level, and :meth:`finish`es a whole schedule (middle and down-sweep) only
    for the depths it costs. Schedules finished from one ``UpSweep`` share its up-sweep
    :class:`Step` objects (read-only, as every schedule is).
    """

    def __init__(self, n: int, has_extra: Optional[Sequence[bool]] = None) -> None:
        if n < 1:
            raise ValueError(f"a chain needs at least one Jacobian, got n={n}")
        flags = [False] * (n + 1) if has_extra is None else [bool(f) for f in has_extra]
        self.n = n
        self._counters, self._new = _counters(n)
        # el[k] = (matrix id or None, vector id or None); position k >= 1 holds layer n-k+1.
        self.el: list[Element] = [(None, GRAD)]
        self.el += [(n - k, extra_vec(n - k) if flags[n - k] else None) for k in range(1, n + 1)]
        self.span = [(k, k) for k in range(n + 1)]
        self.steps: list[Step] = []
        self.products: dict[int, MMOp] = {}

    @property
    def depth(self) -> int:
        """Up-sweep levels built so far."""
        return len(self.steps)

    def extend(self) -> Step:
        """Build the next up-sweep level and return its step."""
        n, d = self.n, len(self.steps)
        if d >= max_levels(n):
            raise ValueError(f"levels must lie in [0, {max_levels(n)}] for n={n}, got {d + 1}")
        el, span, products, new = self.el, self.span, self.products, self._new
        step = Step("up", d)
        for l, r in _pairs(n, d):
            assert span[l][1] + 1 == span[r][0], "up-sweep operands must be adjacent"
            el[r] = _combine(el[l], el[r], step, products, new)
            span[r] = (span[l][0], span[r][1])
        self.steps.append(step)
        return step

    def down_mats(self, level: int) -> list[int]:
        """The matrices the down-sweep step of ``level`` (``< depth``) reads, one mat-vec each, in the
        order of that step's mat-vecs in every schedule of depth ``> level``."""
        if not 0 <= level < len(self.steps):
            raise ValueError(f"down_mats: level {level} is not built (depth {len(self.steps)})")
        el = self.el
        # the left operand of each pair of ``level``: fixed since level - 1 (no later level writes it); the
        # first pair's is the spine, which meets the identity and takes no mat-vec
        return [el[l][0] for l, _ in _pairs(self.n, level) if el[l][0] is not None]

    def finish(self) -> ScanSchedule:
        """The whole schedule at the depth built so far (this builder may be extended afterwards)."""
        n, levels, el, span = self.n, len(self.steps), self.el, self.span
        counters, new = _counters(n, self._counters)
        width = 1 << levels
        ends = [min((j + 1) * width - 1, n) for j in range(math.ceil((n + 1) / width))]
        for j, e in enumerate(ends):
            assert span[e] == (j * width, e), f"block {j} not fully reduced: {span[e]}"
        assert el[ends[0]][0] is None
        IDENT = -1
        excl: dict[int, int] = {ends[0]: IDENT}
        inclusive = el[ends[0]][1]
        steps = list(self.steps)
        out = counters["vec"]
        for j in range(1, len(ends)):  # one mat-vec per step, outputs numbered in order
            m, vv = el[ends[j]]
            excl[ends[j]] = inclusive
            steps.append(Step("mid", j - 1, [], [MVOp(out, m, inclusive, vv)]))
            inclusive = out
            out += 1
        counters["vec"] = out
        g0 = inclusive

        for d in reversed(range(levels)):
            step = Step("down", d)
            for l, r in _pairs(n, d):
                tm, tv = el[l]
                e = excl[r]
                excl[l] = e
                if e == IDENT:
                    assert tm is None, "only the spine meets the identity"
                    excl[r] = tv
                else:
                    v = new("vec")
                    step.mv.append(MVOp(v, tm, e, tv))
                    excl[r] = v
            if step.mv:
                steps.append(step)

        outputs = [g0] + [excl[n - i + 1] for i in range(1, n + 1)]
        assert outputs[n] == GRAD
        return ScanSchedule(n, levels, steps, dict(self.products), outputs, counters["mat"], counters["vec"])
