"""The bounded depth search of ``levels="auto"``: same depth and plans as the exhaustive search, fewer pair lists.

``EXPECTED`` holds the depth ``K`` and the candidate depths costed on the chains below (see the note
above it); ``test_auto_equals_the_exhaustive_search`` plans every depth of several chains and checks
that ``auto`` picks the cheapest, with every product stored by the cost model's storage rule.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import spscan
from spscan.planner import planning, storage
from spscan.planner.cost import profile_for
from spscan.planner.memory import estimate_memory
from spscan.planner.patterns import PatternTable, as_chain, as_pattern
from spscan.planner.symbolic import product_counts, product_pattern, spgemm_symbolic

from strategies import pattern as pattern_strategy

CPU = profile_for("cpu")


def rand(d1, d2, density, seed):
    rng = np.random.default_rng(seed)
    m = rng.random((d1, d2)) < density
    return sp.csr_array(m.astype(np.float64))

def band(d, w):
    m = np.zeros((d, d), bool)
    for o in range(-w, w + 1):
        m |= np.eye(d, k=o, dtype=bool)
    return sp.csr_array(m.astype(np.float64))

def perm(d, seed):
    rng = np.random.default_rng(seed)
    return sp.csr_array((np.ones(d), rng.permutation(d), np.arange(d + 1)), shape=(d, d))

def diag(d):
    return sp.csr_array(np.eye(d))

def dense(a, b):
    return sp.csr_array(np.ones((a, b)))

CHAINS = {  # name -> chain of SciPy CSR patterns
    "dense20_T300": lambda: [dense(20, 20)] * 300,
    "dense4_T64": lambda: [dense(4, 4)] * 64,
    "dense2_T1000": lambda: [dense(2, 2)] * 1000,
    "factored_T200": lambda: [dense(20, 20), diag(20)] * 200,
    "diag_T500": lambda: [diag(64)] * 500,
    "perm_T100": lambda: [perm(32, i) for i in range(100)],
    "band_T40": lambda: [band(48, 1)] * 40,
    "band_mixed_T33": lambda: [band(30, i % 3) for i in range(33)],
    "random_sparse_T50": lambda: [rand(40, 40, 0.03, i) for i in range(50)],
    "random_mixed_T12": lambda: [rand(8 + i % 5, 8 + (i + 1) % 5, 0.3, i) for i in range(12)],
    "random200_256": lambda: [rand(256, 256, 0.02, i) for i in range(200)],
    "tiny_n1": lambda: [dense(3, 2)],
    "tiny_n2": lambda: [rand(5, 4, 0.5, 1), rand(4, 6, 0.5, 2)],
    "rect_T9": lambda: [rand(6 + i, 7 + i, 0.4, i) for i in range(9)],
}


def lenet5() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(
        nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    ), torch.randn(1, 3, 32, 32)


def vgg_small() -> tuple[nn.Module, torch.Tensor]:
    layers: list[nn.Module] = []
    c = 3
    for v in [16, "M", 32, "M", 64, 64, "M"]:
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU()]
            c = v
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 4 * 4, 10)), torch.randn(1, 3, 32, 32)


MODELS = {"lenet5": lenet5, "vgg_small": vgg_small}

# (chain, batch hint) or (chain, variant, parameter) -> (K, sorted candidate depths costed). First
# computed by the exhaustive search the bounded one replaced. Recomputed when the fused linear run
# began to take CSR steps (small sparse matrices in the middle no longer cost a launch each, so most
# of these chains now settle on the linear scan; e.g. perm_T100 at B=1: K=4 -> 0). Every product's
# storage is now the cost model's choice (storage.StorageRule) instead of a fixed density: on these
# chains it gives this same table as the fixed 0.35 threshold. The CUDA rows were recomputed when the
# CUDA profile began to run uniform linear runs in chunks (parallel over their steps): dense2_T1000's
# middle became cheap, K=6 -> 3; and again when a CSR step of its linear run was costed as measured
# on a GPU (5 us, not the dense steps' 2 us): random_sparse_T50 and band_T40, K=0 -> 1. ``test_auto_equals_the_exhaustive_search``
# checks the choice against every forced depth. The candidate lists of dense4_T64, factored_T200 (B=1) and
# random_sparse_T50 (B=16, 256) shrank when the search began to bound a depth by its new up-sweep level plus
# the down-sweep level that mirrors it: the choices did not change.
EXPECTED = {
    ('dense20_T300', 1): (0, [0, 1, 2]),
    ('dense20_T300', 16): (0, [0]),
    ('dense20_T300', 256): (0, [0]),
    ('dense4_T64', 1): (0, [0, 1]),
    ('dense4_T64', 16): (0, [0, 1]),
    ('dense4_T64', 256): (0, [0, 1]),
    ('dense2_T1000', 1): (4, [0, 1, 2, 3, 4, 5, 6]),
    ('dense2_T1000', 16): (4, [0, 1, 2, 3, 4, 5, 6]),
    ('dense2_T1000', 256): (4, [0, 1, 2, 3, 4, 5, 6]),
    ('factored_T200', 1): (0, [0]),
    ('factored_T200', 16): (0, [0]),
    ('factored_T200', 256): (0, [0]),
    ('diag_T500', 1): (2, [0, 1, 2, 3, 4]),
    ('diag_T500', 16): (0, [0, 1, 2]),
    ('diag_T500', 256): (0, [0, 1, 2]),
    ('perm_T100', 1): (0, [0, 1, 2]),
    ('perm_T100', 16): (0, [0, 1, 2]),
    ('perm_T100', 256): (0, [0, 1, 2]),
    ('band_T40', 1): (0, [0]),
    ('band_T40', 16): (0, [0]),
    ('band_T40', 256): (0, [0]),
    ('band_mixed_T33', 1): (0, [0]),
    ('band_mixed_T33', 16): (0, [0]),
    ('band_mixed_T33', 256): (0, [0]),
    ('random_sparse_T50', 1): (0, [0]),
    ('random_sparse_T50', 16): (0, [0]),
    ('random_sparse_T50', 256): (0, [0]),
    ('random_mixed_T12', 1): (0, [0]),
    ('random_mixed_T12', 16): (0, [0]),
    ('random_mixed_T12', 256): (0, [0]),
    ('random200_256', 1): (0, [0]),
    ('random200_256', 16): (0, [0]),
    ('random200_256', 256): (0, [0]),
    ('tiny_n1', 1): (0, [0]),
    ('tiny_n1', 16): (0, [0]),
    ('tiny_n1', 256): (0, [0]),
    ('tiny_n2', 1): (0, [0]),
    ('tiny_n2', 16): (0, [0]),
    ('tiny_n2', 256): (0, [0]),
    ('rect_T9', 1): (0, [0]),
    ('rect_T9', 16): (0, [0]),
    ('rect_T9', 256): (0, [0]),
    ('dense2_T1000', 'mem', 1.5): (0, [0]),
    ('dense2_T1000', 'mem', 3.0): (4, [0, 1, 2, 3, 4, 5, 6]),
    ('dense2_T1000', 'budget', 2000): (4, [0, 1, 2, 3, 4, 5, 6]),
    ('dense2_T1000', 'budget', 20000): (4, [0, 1, 2, 3, 4, 5, 6]),
    ('dense2_T1000', 'budget', 200000): (4, [0, 1, 2, 3, 4, 5, 6]),
    ('dense2_T1000', 'cuda', 16): (3, [0, 1, 2, 3, 4, 5]),
    ('perm_T100', 'mem', 1.5): (0, [0]),
    ('perm_T100', 'mem', 3.0): (0, [0, 1, 2]),
    ('perm_T100', 'budget', 2000): (0, [0]),
    ('perm_T100', 'budget', 20000): (0, [0]),
    ('perm_T100', 'budget', 200000): (0, [0, 1, 2]),
    ('perm_T100', 'cuda', 16): (3, [0, 1, 2, 3, 4, 5]),
    ('random_sparse_T50', 'mem', 1.5): (0, [0]),
    ('random_sparse_T50', 'mem', 3.0): (0, [0]),
    ('random_sparse_T50', 'budget', 2000): (0, [0]),
    ('random_sparse_T50', 'budget', 20000): (0, [0]),
    ('random_sparse_T50', 'budget', 200000): (0, [0]),
    ('random_sparse_T50', 'cuda', 16): (1, [0, 1, 2]),
    ('band_T40', 'mem', 1.5): (0, [0]),
    ('band_T40', 'mem', 3.0): (0, [0]),
    ('band_T40', 'budget', 2000): (0, [0]),
    ('band_T40', 'budget', 20000): (0, [0]),
    ('band_T40', 'budget', 200000): (0, [0]),
    ('band_T40', 'cuda', 16): (1, [0, 1, 2]),
    ('rect_T9', 'mem', 1.5): (0, [0]),
    ('rect_T9', 'mem', 3.0): (0, [0]),
    ('rect_T9', 'budget', 2000): (0, [0]),
    ('rect_T9', 'budget', 20000): (0, [0]),
    ('rect_T9', 'budget', 200000): (0, [0]),
    ('rect_T9', 'cuda', 16): (0, [0]),
    ('lenet5', 16): (0, [0, 1]),
    ('lenet5', 64): (0, [0, 1]),
    ('vgg_small', 16): (0, [0]),
    ('vgg_small', 64): (0, [0]),
}


def _patterns(name: str):
    if name in MODELS:
        model, x = MODELS[name]()
        return as_chain(spscan.plan(model, x, levels=0).patterns)
    return as_chain(CHAINS[name]())


def _peak(plan) -> int:
    return estimate_memory(plan).total(16)


def _auto(key):
    pats = _patterns(key[0])
    if len(key) == 2:
        return pats, planning.plan_scan(pats, "auto", CPU, batch_hint=key[1])
    variant, param = key[1], key[2]
    if variant == "mem":
        limit = _peak(planning.plan_scan(pats, 0, CPU, batch_hint=1)) * param
        return pats, planning.plan_scan(pats, "auto", CPU, batch_hint=1, memory_limit=limit, memory_of=_peak)
    if variant == "budget":
        return pats, planning.plan_scan(pats, "auto", profile_for("cpu", {"bytes_budget": param}), batch_hint=1)
    assert variant == "cuda"
    return pats, planning.plan_scan(pats, "auto", profile_for("cuda"), batch_hint=param)


def _same_mats(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for i in a:
        x, y = a[i], b[i]
        assert x.algo == y.algo and x.pattern.key == y.pattern.key and x.gemm_macs == y.gemm_macs
        if x.algo == "pairs":
            for f in ("pair_ptr", "pair_a", "pair_b"):
                assert np.array_equal(getattr(x.sym, f), getattr(y.sym, f)), (i, f)


@pytest.mark.parametrize("key", list(EXPECTED), ids=[":".join(map(str, k)) for k in EXPECTED])
def test_auto_picks_the_same_depth_as_the_exhaustive_search(key):
    pats, plan = _auto(key)
    k, cands = EXPECTED[key]
    assert plan.levels == k
    assert sorted(plan.candidates) == cands
    assert plan.levels == min(plan.candidates, key=plan.candidates.get)
    # the chosen plan is the plan of that depth, with its pair lists
    profile = plan.profile
    forced = planning.plan_scan(pats, k, profile, batch_hint=plan.batch_hint)
    _same_mats(plan.mats, forced.mats)
    assert plan.schedule.steps == forced.schedule.steps
    assert forced.candidates[k] == pytest.approx(plan.candidates[k], rel=1e-12)


@pytest.mark.parametrize("name", ["lenet5", "random200_256", "factored_T200", "dense20_T300"])
def test_pair_lists_only_for_the_chosen_depth(name, monkeypatch):
    """A chain that settles on the linear scan plans no SpGEMM pair lists at all."""
    calls = []

    def counting(a, b, dense_out=False):
        calls.append((a.key, b.key))
        return spgemm_symbolic(a, b, dense_out)

    monkeypatch.setattr(storage, "spgemm_symbolic", counting)
    plan = planning.plan_scan(_patterns(name), "auto", CPU, batch_hint=16)
    assert plan.levels == 0 and calls == []
    # and a chain that chooses a deeper plan plans only the products of its levels, once each
    pats = as_chain(CHAINS["perm_T100"]())
    plan = planning.plan_scan(pats, "auto", profile_for("cuda"), batch_hint=16)
    assert plan.levels == 3
    distinct = {(plan.mats[op.left].pattern.key, plan.mats[op.right].pattern.key)
                for st in plan.schedule.steps[:4] for op in st.mm}
    assert sorted(calls) == sorted(distinct)


@settings(max_examples=60)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 9), st.data())
def test_counted_product_equals_planned_product(m, k, n, data):
    """The search's pattern-and-counts product is the planner's product without the pair lists."""
    a = as_pattern(data.draw(pattern_strategy(m, k)))
    b = as_pattern(data.draw(pattern_strategy(k, n)))
    indptr, indices, counts = product_pattern(a, b)
    sym = spgemm_symbolic(a, b)
    assert np.array_equal(indptr, sym.pattern.indptr) and np.array_equal(indices, sym.pattern.indices)
    assert np.array_equal(counts, np.diff(sym.pair_ptr)) and counts.sum() == product_counts(a, b)
    table = PatternTable()
    real = storage._Products(table, CPU).product(table.intern(a), table.intern(b))
    counted = planning._DepthSearch(storage._Products(table, CPU)).product(table.intern(a), table.intern(b))
    assert counted.algo == real.algo and counted.pattern.key == real.pattern.key
    assert counted.work == real.work
    if real.algo == "pairs":
        assert np.array_equal(counted.sym.pair_ptr, real.sym.pair_ptr)


@pytest.mark.parametrize("name", ["perm_T100", "random_sparse_T50", "band_mixed_T33", "rect_T9", "dense4_T64"])
@pytest.mark.parametrize("batch", [1, 256])
def test_level_lower_bound_is_below_the_level_cost(name, batch):
    pats = as_chain(CHAINS[name]())
    plan = planning.plan_scan(pats, "full", CPU, batch_hint=batch)
    search = planning._DepthSearch(storage._Products(PatternTable(), CPU))
    costs = planning.step_costs(plan)
    for d in range(plan.levels):
        bound = search.level_lower_bound(plan.schedule.steps[d], plan.mats, CPU, batch)
        assert 0 < bound <= costs[d].time_s


@pytest.mark.parametrize("name", ["perm_T100", "random_sparse_T50", "band_T40", "band_mixed_T33", "rect_T9",
                                  "random_mixed_T12", "diag_T500"])
@pytest.mark.parametrize("batch", [1, 16])
def test_auto_equals_the_exhaustive_search(name, batch):
    """Every depth planned with its own storage decisions: ``auto``'s depth is the cheapest one."""
    from spscan.planner.schedule import max_levels

    pats = as_chain(CHAINS[name]())
    auto = planning.plan_scan(pats, "auto", CPU, batch_hint=batch)
    costs = {k: planning.plan_scan(pats, k, CPU, batch_hint=batch).candidates[k]
             for k in range(max_levels(len(pats)) + 1)}
    assert auto.levels == min(costs, key=costs.get)
    for k, t in auto.candidates.items():
        assert t == pytest.approx(costs[k], rel=1e-12)
