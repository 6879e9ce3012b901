"""Symbolic planning of a whole scan: the products of every level and the choice of depth.

Everything here is deterministic index work on the CPU: the same patterns and options give the
same plan on every machine and every rank. What a product costs and how it is stored are asked of
:mod:`.cost` and :mod:`.storage`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence, Union

import numpy as np

from .choose import Candidate, Decision, choose
from .cost import DeviceProfile, LevelCost, row_bins, schedule_costs
from .patterns import Pattern, PatternTable, full_pattern, make_pattern
from .schedule import ScanSchedule, Step, UpSweep, blelloch_schedule, max_levels
from .storage import _NO_USES, MatInfo, StorageRule, Uses, _Products, intern_pattern, matrix_uses
from .symbolic import product_pattern

__all__ = ["ScanPlan", "plan_reduction", "plan_scan", "step_costs"]


@dataclass
class ScanPlan:
    patterns: list[Pattern]  # per layer (interned objects)
    levels: int
    mats: dict[int, MatInfo]
    schedule: ScanSchedule
    profile: DeviceProfile
    batch_hint: int
    elem_bytes: int
    candidates: dict[int, float] = field(default_factory=dict)  # K -> estimated seconds
    explored: int = 0  # deepest level whose products the depth search costed

    @property
    def n(self) -> int:
        return len(self.patterns)


class _PairCounts:
    """The cost-relevant half of a :class:`ProductSymbolic`: pattern and pairs per entry, no pair lists."""

    __slots__ = ("pattern", "pair_ptr", "npairs")

    def __init__(self, pattern: Pattern, counts: np.ndarray):
        self.pattern = pattern
        self.pair_ptr = np.zeros(counts.size + 1, dtype=np.int64)
        np.cumsum(counts, out=self.pair_ptr[1:])
        self.npairs = int(self.pair_ptr[-1])


class _DepthSearch:
    """Symbolic state of ``levels="auto"``: what the cost model needs, computed only as far as needed.

    A product is first known by its pair count (:func:`product_counts`, O(nnz(A))), which bounds
    its level's cost from below; then by its pattern and pairs per entry
    (:func:`~.symbolic.product_pattern`, compiled, no pair lists), which gives the cost model's
    exact inputs: the same own pattern, storage and pair count as :class:`_Products`.
    Pair lists are built only for the depth finally chosen.
    """

    def __init__(self, products: _Products):
        self.products = products
        self.rule = products.rule
        self.npairs = products.npairs  # pair counts: one memo for the search and the planned products
        self._own: dict[tuple[str, str], tuple[Pattern, np.ndarray]] = {}
        self.cache: dict[tuple[str, str, bool], MatInfo] = {}

    def _counted(self, a: Pattern, b: Pattern) -> tuple[Pattern, np.ndarray]:
        key = (a.key, b.key)
        hit = self._own.get(key)
        if hit is None:
            indptr, indices, counts = product_pattern(a, b)
            own = intern_pattern(self.products.table, make_pattern((a.rows, b.cols), indptr, indices))
            hit = self._own[key] = (own, counts)
        return hit

    def _planned_like(self, a: Pattern, b: Pattern) -> bool:
        """A GEMM or a row-wise product plans no pair lists: formed as the planner forms it (as cheap)."""
        return (a.is_full and b.is_full) or self.products.rowwise(a, b)

    def own(self, a: Pattern, b: Pattern) -> Pattern:
        return self.products.own(a, b) if self._planned_like(a, b) else self._counted(a, b)[0]

    def decide_alone(self, a: Pattern, b: Pattern, mv: Sequence[str]) -> bool:
        if self._planned_like(a, b):
            return self.products.decide_alone(a, b, mv)
        own = self.own(a, b)
        return self.rule.alone((a.rows, b.cols), own, own.nnz, mv)

    def product(self, a: Pattern, b: Pattern, dense: Optional[bool] = None) -> MatInfo:
        """``MatInfo`` of ``A @ B`` equal to ``_Products.product`` in pattern, algo and pairs per entry."""
        key = (a.key, b.key, bool(self.decide_alone(a, b, ("down",)) if dense is None else dense))
        if key in self.cache:
            return self.cache[key]
        dense = key[2]
        if self._planned_like(a, b):
            info = self.products.product(a, b, dense)
        else:
            pattern, counts = self._counted(a, b)
            if dense and not pattern.is_full:
                info = MatInfo(self.products.table.intern(full_pattern(a.rows, b.cols)), "pairs",
                               sym=_PairCounts(pattern, counts), densified=True)
            else:
                info = MatInfo(pattern, "pairs", sym=_PairCounts(pattern, counts))
        self.cache[key] = info
        return info

    @staticmethod
    def operand_pairs(step: Step, mats: dict[int, MatInfo]) -> dict[tuple[Pattern, Pattern], int]:
        """The distinct ``(left, right)`` operand patterns of ``step``'s products, with how many products
        take each (interned patterns: a long chain's level repeats a few pairs, priced once each)."""
        out: dict[tuple[Pattern, Pattern], int] = {}
        for op in step.mm:
            key = (mats[op.left].pattern, mats[op.right].pattern)
            out[key] = out.get(key, 0) + 1
        return out

    def index_bytes(self, step: Step, mats: dict[int, MatInfo], budget: float,
                    pairs: Optional[dict[tuple[Pattern, Pattern], int]] = None) -> int:
        """Pair-index bytes of one up-sweep level's sparse products (the exploration budget's measure);
        summed as far as needed to exceed ``budget``. ``pairs``: :meth:`operand_pairs` of the step."""
        est = 0
        for (a, b), count in (self.operand_pairs(step, mats) if pairs is None else pairs).items():
            est += count * self.products.index_estimate(a, b)
            if est > budget:
                break
        return est

    def level_lower_bound(self, step: Step, mats: dict[int, MatInfo], profile: DeviceProfile,
                          batch: int, pairs: Optional[dict[tuple[Pattern, Pattern], int]] = None) -> float:
        """A lower bound of :func:`_step_costs` for an up-sweep level whose products are not planned.

        Exact in every term but the number of SpGEMM launches, counted as one (the exact count,
        the number of width bins of the pairs per entry, is at least one). ``pairs``: :meth:`operand_pairs`
        of the step.
        """
        pairs = self.operand_pairs(step, mats) if pairs is None else pairs
        return self._lower_bound(pairs, [op.mat for op in step.mv], mats, profile, batch)

    def _lower_bound(self, pairs: dict[tuple[Pattern, Pattern], int], mv_mats: Sequence[int],
                     mats: dict[int, MatInfo], profile: DeviceProfile, batch: int) -> float:
        npairs = gemm = gemv = mv_sparse = 0
        gemm_shapes = set()
        gemv_shapes = set()
        mv_bins = 0
        for (a, b), count in pairs.items():
            if a.is_full and b.is_full:
                gemm += count * (a.rows * a.cols * b.cols)
                gemm_shapes.add((a.shape, b.shape))
            else:
                npairs += count * self.npairs(a, b)
        mv_patterns: dict[Pattern, int] = {}
        for m in mv_mats:
            p = mats[m].pattern
            mv_patterns[p] = mv_patterns.get(p, 0) + 1
        for p, count in mv_patterns.items():
            if p.is_full:
                gemv += count * p.nnz
                gemv_shapes.add(p.shape)
            else:
                mv_sparse += count * p.nnz
                mv_bins = max(mv_bins, row_bins(p))
        launches = (1 if npairs else 0) + len(gemm_shapes) + mv_bins + len(gemv_shapes)
        t = 0.0
        t += launches * profile.op_overhead_s
        t += batch * (npairs + mv_sparse) / profile.pair_rate
        t += batch * gemm / profile.gemm_rate + batch * gemv / profile.gemv_rate
        return t

    def down_lower_bound(self, sched: ScanSchedule, level: int, mats: dict[int, MatInfo], profile: DeviceProfile,
                         batch: int) -> float:
        """A lower bound of the cost of ``sched``'s down-sweep step at ``level`` from the matrices already
        planned (its mat-vecs read the matrices of that level, all known before the next level's products
        are formed); 0 where one of them is not planned yet."""
        for st in sched.steps:
            if st.phase == "down" and st.level == level:
                return self.mv_lower_bound([op.mat for op in st.mv], mats, profile, batch)
        return 0.0

    def mv_lower_bound(self, mv_mats: Sequence[int], mats: dict[int, MatInfo], profile: DeviceProfile,
                       batch: int) -> float:
        """:meth:`down_lower_bound` of a down-sweep step given by the matrices of its mat-vecs
        (:meth:`~.schedule.UpSweep.down_mats`): no schedule needed."""
        if any(m not in mats for m in mv_mats):
            return 0.0
        return self._lower_bound({}, mv_mats, mats, profile, batch)


class _Levels:
    """Up-sweep products formed level by level, each stored as :class:`StorageRule` decides once the
    schedule shows what reads it: when the product taking it as an operand is formed (jointly with
    that product's other operand), when a spine mat-vec takes it, or, for products no planned
    product reads, at the end (:meth:`finalize`) by their mat-vecs alone.

    ``provider`` is :class:`_Products` (pair lists) or :class:`_DepthSearch` (pair counts): both give
    the same own patterns, pair counts and therefore the same decisions.
    """

    def __init__(self, pats: Sequence[Pattern], provider, sched: Optional[ScanSchedule] = None,
                 apply_entries: Optional[Sequence[Optional[int]]] = None,
                 inputs: Optional[dict[int, MatInfo]] = None):
        self.provider = provider
        # ``inputs``: the chain's input_mats made already (read only: each planning copies the dict)
        self.mats: dict[int, MatInfo] = input_mats(pats, apply_entries) if inputs is None else dict(inputs)
        self.pending: dict[int, tuple[Pattern, Pattern]] = {}  # product id -> its operands' stored patterns
        self.schedule(sched)

    def schedule(self, sched: Union[None, ScanSchedule, Callable[[], ScanSchedule]]) -> None:
        """The schedule whose readers decide storage, or a function that makes it (the uses, and a schedule
        given by a function, are made only if a decision needs them)."""
        self._sched = sched
        self._uses: Optional[dict[int, Uses]] = None

    def uses(self, m: int) -> Uses:
        if self._uses is None:
            sched = self._sched if isinstance(self._sched, ScanSchedule) else self._sched()
            self._uses = matrix_uses(sched)
        return self._uses.get(m, _NO_USES)

    def _store(self, m: int, dense: bool) -> None:
        a, b = self.pending.pop(m)
        self.mats[m] = self.provider.product(a, b, dense)

    def decide(self, step: Step) -> None:
        """Store the pending matrices ``step`` reads (its products' operands, its mat-vecs' matrices)."""
        prov = self.provider
        for op in step.mm:
            pl, pr = op.left in self.pending, op.right in self.pending
            if not (pl or pr):
                continue
            lp = prov.own(*self.pending[op.left]) if pl else self.mats[op.left].pattern
            rp = prov.own(*self.pending[op.right]) if pr else self.mats[op.right].pattern
            dl = dr = False
            if (pl and not lp.is_full) or (pr and not rp.is_full):
                dl, dr = prov.rule.joint(lp, rp, self.uses(op.left) if pl else None,
                                         self.uses(op.right) if pr else None, prov.npairs(lp, rp))
            if pl:
                self._store(op.left, dl)
            if pr:
                self._store(op.right, dr)
        for op in step.mv:
            if op.mat in self.pending:
                a, b = self.pending[op.mat]
                self._store(op.mat, prov.decide_alone(a, b, self.uses(op.mat).mv))

    def form(self, step: Step) -> None:
        """The products of ``step`` (operands already stored), pending until their readers are known."""
        for op in step.mm:
            self.pending[op.out] = (self.mats[op.left].pattern, self.mats[op.right].pattern)

    def finalize(self) -> dict[int, MatInfo]:
        """Every matrix, the pending products stored by their mat-vecs alone (``self`` is unchanged)."""
        out = dict(self.mats)
        prov = self.provider
        for m, (a, b) in self.pending.items():
            out[m] = prov.product(a, b, prov.decide_alone(a, b, self.uses(m).mv))
        return out


class _Once:
    """``make()``'s result, made on the first call and kept (a depth's schedule, while the search is at that depth)."""

    __slots__ = ("_make", "_made")

    def __init__(self, make: Callable[[], ScanSchedule]):
        self._make = make
        self._made: Optional[ScanSchedule] = None

    def __call__(self) -> ScanSchedule:
        if self._made is None:
            self._made = self._make()
        return self._made


class _Steps(NamedTuple):
    steps: list[Step]


def _costs_of(steps: Sequence[Step], mats: dict[int, MatInfo], profile: DeviceProfile, batch: int,
              elem: int) -> list[LevelCost]:
    return schedule_costs(_Steps(list(steps)), mats, profile, batch, elem)  # type: ignore[arg-type]


def input_mats(pats: Sequence[Pattern], apply_entries: Optional[Sequence[Optional[int]]] = None
               ) -> dict[int, MatInfo]:
    """The chain's matrices as the scan's inputs; ``apply_entries[i]`` (where given and not ``None``): input
    ``i`` is applied by its layer's operator, its mat-vec priced at that many entries."""
    if apply_entries is not None and len(apply_entries) != len(pats):
        raise ValueError(f"apply_entries: expected one entry per matrix ({len(pats)}), got {len(apply_entries)}")
    return {i: MatInfo(p, "input", apply_entries=None if apply_entries is None or apply_entries[i] is None
                       else int(apply_entries[i])) for i, p in enumerate(pats)}


def _planned_mats(sched: ScanSchedule, levels: int, pats: list[Pattern], products: _Products,
                  profile: DeviceProfile, what: str,
                  advice: str = "choose fewer levels",
                  apply_entries: Optional[Sequence[Optional[int]]] = None,
                  inputs: Optional[dict[int, MatInfo]] = None) -> dict[int, MatInfo]:
    """Inputs and the products of the first ``levels`` up-sweep levels, with their pair lists and storage.

    ``what`` names the request in the error raised when a level's pair indices exceed the budget.
    ``inputs``: :func:`input_mats` of the chain, where made already.
    """
    if levels == 0:  # the linear scan: the inputs alone
        mats = input_mats(pats, apply_entries) if inputs is None else inputs
        return {i: mats[i] for i in range(sched.num_mats) if i in mats}
    lv = _Levels(pats, products, sched, apply_entries, inputs)
    for d, st in enumerate(sched.steps[:levels]):
        lv.decide(st)
        est_bytes = 0
        for op in st.mm:
            a, b = lv.mats[op.left].pattern, lv.mats[op.right].pattern
            est_bytes += products.index_estimate(a, b)
            if est_bytes > profile.bytes_budget:
                raise ValueError(
                    f"{what}: up-sweep level {d} needs ~{est_bytes / 2**30:.1f} GiB of product index data, over the "
                    f"planning budget of {profile.bytes_budget / 2**30:.1f} GiB; {advice}"
                )
        lv.form(st)
    mats = lv.finalize()
    return {i: mats[i] for i in range(sched.num_mats) if i in mats}


def plan_scan(
    patterns: Sequence[Pattern],
    levels: Union[str, int],
    profile: DeviceProfile,
    batch_hint: int = 16,
    elem_bytes: int = 4,
    memory_limit: Optional[float] = None,
    memory_of=None,
    apply_entries: Optional[Sequence[Optional[int]]] = None,
) -> ScanPlan:
    """Plan the products of every up-sweep level needed and choose the depth ``K``.

    ``apply_entries``: per matrix, the entries of its mat-vec where its layer applies it by its own
    operator (``None``: by its CSR values), for the costs only.

    ``levels``: ``"auto"`` (minimum estimated critical-path time among the depths whose symbolic
    products fit the exploration budget and ``memory_limit``), an int (clamped to the chain's
    maximum depth) or ``"full"``. ``memory_of(plan) -> bytes`` evaluates a candidate's peak.

    Every product's storage (dense or its own pattern) is chosen by :class:`StorageRule` from what
    reads it at the depth planned, so a product of the deepest level (read by mat-vecs only) may be
    stored otherwise than the same product one level below the top of a deeper plan.

    ``"auto"`` evaluates ``K = 0, 1, ...`` in order and stops at the first depth that cannot win:
    its up-sweep alone (bounded below from pair counts before the level's products are
    formed) costs at least the best estimate so far, the estimate has risen twice (on a profile
    with chunked linear runs: above the best depth >= 1 so far, since a chunked depth 0 is costed
    on other terms than the up-sweeps), or the level's pair indices exceed the budget. Candidates
    are costed from product patterns and pair counts; pair lists are built only for the depth chosen.
    The up-sweep is built one level at a time (:class:`~.schedule.UpSweep`: a level's bounds need only
    that level and the down-sweep step that mirrors it), a whole schedule only for a depth that is
    costed, and the chosen depth's schedule (at depth 0 its input matrices too) goes into the plan as
    the search made it: a long chain that stays linear builds one schedule, as ``levels=0`` does.
    """
    n = len(patterns)
    table = PatternTable()
    pats = [table.intern(p) for p in patterns]
    kmax = max_levels(n)
    products = _Products(table, profile, batch_hint)
    if levels != "auto":
        k = kmax if levels == "full" else min(int(levels), kmax)
        sched = blelloch_schedule(n, k)
        mats = _planned_mats(sched, k, pats, products, profile, f"levels={levels}", apply_entries=apply_entries)
        costs = _costs_of(sched.steps, mats, profile, batch_hint, elem_bytes)
        up = 0.0
        for c in costs[:k]:
            up += c.time_s
        plan = ScanPlan(pats, k, mats, sched, profile, batch_hint, elem_bytes)
        plan.candidates = {k: up + sum(c.time_s for c in costs[k:])}
        plan.explored = k
        return plan

    search = _DepthSearch(products)
    inputs = input_mats(pats, apply_entries)
    lv = _Levels(pats, search, apply_entries=apply_entries, inputs=inputs)
    # the up-sweep is built one level at a time; a depth's whole schedule (middle and down-sweep) only
    # once its bounds let it be costed (a chain of 30000 steps stops at depth 1 without building one)
    upsweep = UpSweep(n)
    candidates: dict[int, float] = {}
    best: Optional[tuple[int, ScanSchedule, dict[int, MatInfo]]] = None  # depth, its schedule, its mats
    up_prev = 0.0  # up-sweep cost of the last depth costed (its levels are the next depth's first ones)
    worse = 0
    best_deep: Optional[int] = None
    explored = 0
    for k in range(kmax + 1):
        if k > 0:
            if best is not None and worse >= 2:
                break  # the cost has turned up twice
            level = upsweep.extend()
            schedule_k = _Once(upsweep.finish)  # the schedule at depth k, made once, when first needed
            lv.schedule(schedule_k)
            lv.decide(level)  # the operands of this level: their readers are known now
            pairs = search.operand_pairs(level, lv.mats)
            if search.index_bytes(level, lv.mats, profile.bytes_budget, pairs) > profile.bytes_budget:
                break  # this level's fill-in is never expanded symbolically
            if best is not None:
                up_bound = up_prev + search.level_lower_bound(level, lv.mats, profile, batch_hint, pairs)
                if up_bound >= candidates[best[0]]:
                    break  # deeper plans only add up-sweep work: none can win
                if not profile.parallel_run_max_m and (
                        up_bound + search.mv_lower_bound(upsweep.down_mats(k - 1), lv.mats, profile, batch_hint)
                        >= candidates[best[0]]):
                    # every depth from k on runs up-sweep levels 0..k-1 and the down-sweep level k-1 over the
                    # same matrices: their bound already costs more than the best depth, so no product of
                    # this level need be formed (a chunked-run profile costs depth 0 otherwise: not used there)
                    break
            lv.form(level)
            explored = k
            sched = schedule_k()
            lv.schedule(sched)
            mats = lv.finalize()
            sub = {i: mats[i] for i in range(sched.num_mats) if i in mats}
        else:
            sched = upsweep.finish()
            lv.schedule(sched)
            sub = inputs  # depth 0 forms no product
        costs = _costs_of(sched.steps, sub, profile, batch_hint, elem_bytes)
        up = 0.0
        for c in costs[:k]:
            up += c.time_s
        up_prev = up
        if k > 0 and best is not None and up >= candidates[best[0]]:
            break
        t = up + sum(c.time_s for c in costs[k:])
        if memory_limit is not None and memory_of is not None:
            if memory_of(ScanPlan(pats, k, sub, sched, profile, batch_hint, elem_bytes)) > memory_limit:
                continue
        candidates[k] = t
        # where depth 0 is a chunked run its cost is of another kind than the up-sweeps': deeper plans are
        # then compared with the best deeper plan so far, so a cheap depth 0 does not end the search
        rival = best_deep if profile.parallel_run_max_m else (best[0] if best is not None else None)
        if best is None or t < candidates[best[0]]:
            best = (k, sched, sub)
        if rival is None or t < candidates[rival]:
            worse = 0
            if k > 0:
                best_deep = k
        else:
            worse += 1
    if best is None:
        sched = blelloch_schedule(n, 0)
        candidates[0] = sum(c.time_s for c in _costs_of(sched.steps, inputs, profile, batch_hint, elem_bytes))
        best = (0, sched, inputs)
    k = depth_decision(candidates, profile).chosen.value
    # the chosen depth's schedule as the search made it; its products planned again with their pair lists
    # (the search formed them from pair counts only), the linear scan's inputs as they are
    sched = best[1] if k == best[0] else blelloch_schedule(n, k)
    mats = best[2] if k == best[0] == 0 else _planned_mats(
        sched, k, pats, products, profile, "levels=auto", apply_entries=apply_entries, inputs=inputs)
    plan = ScanPlan(pats, k, mats, sched, profile, batch_hint, elem_bytes)
    plan.candidates = candidates
    plan.explored = explored
    return plan


def depth_decision(candidates: dict[int, float], profile: DeviceProfile, forced: Optional[int] = None) -> Decision:
    """The scan depth as a :class:`~spscan.planner.choose.Decision` over the depths the search costed
    (the shallowest among equal estimates)."""
    cands = [Candidate(f"depth {k}", t, "linear scan" if k == 0 else f"{k} up-sweep level{'s' if k > 1 else ''}", k)
             for k, t in sorted(candidates.items())]
    return choose("scan depth", cands, None if forced is None else f"depth {forced}",
                  basis=f"{profile.name} critical-path model", notes=(profile.describe_thresholds(),))


def step_costs(plan: ScanPlan) -> list[LevelCost]:
    return schedule_costs(plan.schedule, plan.mats, plan.profile, plan.batch_hint, plan.elem_bytes)



def plan_reduction(
    patterns: Sequence[Pattern],
    profile: DeviceProfile,
    batch_hint: int = 16,
    elem_bytes: int = 4,
) -> ScanPlan:
    """Plan the composite of a whole chain, ``J_1^T J_2^T ... J_n^T`` (and its affine term), by the
    pairwise product tree of :func:`~spscan.planner.schedule.reduction_schedule`.

    The products are planned exactly as up-sweep products (same symbolic SpGEMM, same storage
    rule over the tree's readers, interned patterns), so a model-parallel slice reduction runs on
    the same engine as a scan. Raises ``ValueError`` when a level's pair indices exceed the device
    profile's budget.
    """
    from .schedule import reduction_schedule

    table = PatternTable()
    pats = [table.intern(p) for p in patterns]
    sched = reduction_schedule(len(pats))
    products = _Products(table, profile, batch_hint)
    mats = _planned_mats(sched, sched.levels, pats, products, profile, f"composite of {len(pats)} layers",
                         "cut the chain where the composites stay small")
    plan = ScanPlan(pats, sched.levels, mats, sched, profile, batch_hint, elem_bytes)
    plan.explored = sched.levels
    return plan


def composite_pattern(plan: ScanPlan) -> Pattern:
    """The stored pattern of a reduction plan's composite matrix."""
    if plan.schedule.kind != "reduce":
        raise ValueError("composite_pattern: expected a reduction plan (plan_reduction), got a scan plan")
    return plan.mats[plan.schedule.root[0]].pattern
