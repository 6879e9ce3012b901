"""Dense-or-sparse storage of planned products, chosen by the cost of what reads them.

The fixed rule it replaces stored every pair-list product at least 35 % dense densely; a product
another product reads then gives that product a full operand and ``rows * nnz`` pairs instead of its
sparse count. Chains are drawn where one level-0 product is ~0.4 dense and is read by a level-1
product: the cost rule keeps it sparse (the threshold rule, still available as an explicit
``dense_threshold``, densifies it and multiplies the level-1 pairs), and gradients equal the
float64 reference at every depth.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spscan
from spscan.runtime.plan import Plan
from spscan.planner import planning, storage
from spscan.planner.cost import profile_for
from spscan.planner.patterns import as_chain, full_pattern
from spscan.planner.planning import plan_scan
from spscan.planner.storage import StorageRule, Uses
from spscan.planner.schedule import blelloch_schedule, max_levels
from spscan.reference import reference_backward

CPU = profile_for("cpu")


def _rand(rows: int, cols: int, density: float, rng) -> sp.csr_array:
    return sp.csr_array((rng.random((rows, cols)) < density).astype(np.float64))


def _chain(d: int, rho_l: float, rho: float, seed: int) -> list[sp.csr_array]:
    """Seven layers; at depth 2 the level-1 product is ``(J1 J2) @ (J3 J4)`` with ``J2 = J3 = I``: its
    left operand is ``J1`` (density ``rho_l``), its right operand ``J4`` (density ``rho``). A sparse
    left operand keeps the GEMM of two densified operands out of reach (at ~0.06 it would win); one
    denser than ~0.5/d makes the level-1 pairs outweigh the right operand's own mat-vec (below, a
    dense right operand is the cheaper choice and the rule takes it)."""
    rng = np.random.default_rng(seed)
    eye = sp.csr_array(np.eye(d))
    return [_rand(d, d, rho_l, rng), eye, eye, _rand(d, d, rho, rng), _rand(d, d, 0.2, rng), _rand(d, d, 0.2, rng),
            _rand(d, d, 0.2, rng)]


def _right_operand(plan) -> tuple[int, int]:
    """Ids of the level-1 product and of its right operand (the ~0.4-dense level-0 product)."""
    op = plan.schedule.steps[1].mm[0]
    return op.out, op.right


def _torch_plan(scan) -> Plan:
    return Plan(scan, "torch", None, torch.float64, None, scan.levels)


def _check_gradients(plan, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    vals = [torch.randn(2, p.nnz, generator=g, dtype=torch.float64) for p in plan.patterns]
    grad = torch.randn(2, plan.patterns[-1].shape[1], generator=g, dtype=torch.float64)
    got = spscan.backward(plan, vals, grad)
    ref = reference_backward(plan.patterns, vals, grad)
    for x, y in zip(got, ref):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(d=st.integers(48, 80), rho_l=st.floats(0.025, 0.05), rho=st.floats(0.37, 0.45), seed=st.integers(0, 10**6),
       batch=st.sampled_from([16, 64]))
def test_cost_rule_keeps_a_product_another_product_reads_sparse(d, rho_l, rho, seed, batch):
    pats = as_chain(_chain(d, rho_l, rho, seed))
    rule = plan_scan(pats, 2, CPU, batch_hint=batch, elem_bytes=8)
    fixed = plan_scan(pats, 2, profile_for("cpu", {"dense_threshold": 0.35}), batch_hint=batch, elem_bytes=8)
    top, right = _right_operand(rule)
    own = rule.mats[right].pattern
    assert 0.35 <= own.density < 0.5
    # the old rule densifies it, and the level-1 product's pairs grow by 1/density (at least 2x)
    assert fixed.mats[right].densified and fixed.mats[right].pattern.is_full
    assert fixed.mats[top].algo != "gemm" and rule.mats[top].algo != "gemm"
    assert fixed.mats[top].work >= 2 * rule.mats[top].work
    # the cost rule keeps its own pattern and its plan is the cheaper one by the planner's own estimate
    assert not rule.mats[right].densified and rule.mats[right].pattern.key == own.key
    assert rule.candidates[2] < fixed.candidates[2]
    # the storage rule's decision, restated: the level-1 pairs saved outweigh the dense mat-vec's gain
    r = StorageRule(CPU, batch)
    left = rule.mats[rule.schedule.steps[1].mm[0].left].pattern
    uses = storage.matrix_uses(rule.schedule)
    assert r.joint(left, own, None, uses[right], storage.product_counts(left, own)) == (False, False)
    _check_gradients(_torch_plan(rule), seed)


@settings(max_examples=10, deadline=None)
@given(d=st.integers(10, 20), rho=st.floats(0.37, 0.45), seed=st.integers(0, 10**6))
def test_every_depth_exact_under_both_rules(d, rho, seed):
    pats = as_chain(_chain(d, 0.1, rho, seed))
    for levels in range(max_levels(len(pats)) + 1):
        for profile in (CPU, profile_for("cpu", {"dense_threshold": 0.35})):
            _check_gradients(_torch_plan(plan_scan(pats, levels, profile, batch_hint=1, elem_bytes=8)), seed)


@pytest.mark.parametrize("batch", [1, 16])
def test_a_product_read_only_by_mat_vecs_is_stored_as_its_mat_vecs_cost_least(batch):
    """Products no planned product reads (the deepest level's, and the spine's operands): dense exactly
    when writing and reading the full matrix costs less than its own pattern by the cost model."""
    from spscan.planner.rowwise import structural_product

    rng = np.random.default_rng(7)
    chain = [sp.csr_array((rng.random((20, 20)) < 0.12).astype(float)) if i % 2 else sp.csr_array(np.eye(20))
             for i in range(20)]
    plan = plan_scan(as_chain(chain), 2, CPU, batch_hint=batch, elem_bytes=8)
    uses = storage.matrix_uses(plan.schedule)
    rule = StorageRule(CPU, batch)
    seen = set()
    for m, op in plan.schedule.products.items():
        if uses[m].mm is not None:
            continue
        own = structural_product(plan.mats[op.left].pattern, plan.mats[op.right].pattern)
        want = rule.alone(own.shape, own, own.nnz, uses[m].mv)
        assert plan.mats[m].densified == want
        assert plan.mats[m].pattern.is_full == (want or own.is_full)
        seen.add(want)
    assert seen == {True, False}
    _check_gradients(_torch_plan(plan))


def test_joint_rule_prefers_a_gemm_when_both_operands_are_nearly_dense():
    """Two 0.9-dense operands: densifying both makes the product a GEMM (gemm_rate >> pair_rate)."""
    rng = np.random.default_rng(1)
    a = as_chain([_rand(64, 64, 0.9, rng)])[0]
    b = as_chain([_rand(64, 64, 0.9, rng)])[0]
    pend = Uses(("down",), None)
    pairs = storage.product_counts(a, b)
    assert StorageRule(CPU, 16).joint(a, b, pend, pend, pairs) == (True, True)
    # an already stored (sparse) partner: densifying one side alone only adds pairs
    assert StorageRule(CPU, 16).joint(a, b, pend, None, pairs)[0] is False
    full = full_pattern(64, 64)
    assert StorageRule(CPU, 16).joint(full, b, None, pend, storage.product_counts(full, b)) == (False, True)


def test_threshold_override_is_validated():
    with pytest.raises(ValueError, match="dense_threshold"):
        profile_for("cpu", {"dense_threshold": 1.5})
    with pytest.raises(ValueError, match="dense_threshold"):
        profile_for("cpu", {"dense_threshold": 0})
    assert profile_for("cpu").dense_threshold is None


def test_search_and_forced_plans_store_alike():
    """``levels="auto"`` decides storage from pair counts and the forced depth from pair lists: same result."""
    pats = as_chain(_chain(16, 0.4, 0.4, 3))
    for batch in (1, 16):
        auto = plan_scan(pats, "auto", CPU, batch_hint=batch)
        forced = plan_scan(pats, auto.levels, CPU, batch_hint=batch)
        assert {m: (i.pattern.key, i.densified) for m, i in auto.mats.items()} == \
            {m: (i.pattern.key, i.densified) for m, i in forced.mats.items()}
        for k in range(max_levels(len(pats)) + 1):
            sched = blelloch_schedule(len(pats), k)
            assert sorted(storage.matrix_uses(sched)) == sorted(
                set(range(sched.num_mats)) - {m for m in range(sched.num_mats)
                                              if not any(m in (o.left, o.right) for s in sched.steps for o in s.mm)
                                              and not any(m == o.mat for s in sched.steps for o in s.mv)})
