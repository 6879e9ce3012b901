"""The host work of planning and of a call, made proportionate (no timing here: bench/test_planning.py and
bench/test_core_bench.py::test_backward_host_cost time it):

* the depth search of ``levels="auto"`` builds the up-sweep one level at a time (``schedule.UpSweep``) and a
  whole schedule only for the depths it costs, reusing the chosen depth's schedule (and, at depth 0, its
  input matrices) for the plan;
* ``schedule_costs`` prices a step of one mat-vec once per (phase, pattern, operator entries);
* ``spscan.backward`` checks a call against tables made once per plan (no O(n) copies or counts).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan
from spscan.runtime.checks import check_inputs
from spscan.planner import cost, planning, schedule
from spscan.planner.cost import profile_for
from spscan.planner.patterns import as_chain

CPU = profile_for("cpu")


def _norm(s: schedule.ScanSchedule):
    return (s.n, s.levels, s.steps, s.products, s.outputs, s.num_mats, s.num_vecs, s.kind, s.root)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 33, 100, 255, 256, 257])
def test_upsweep_finishes_every_depth_as_blelloch_schedule(n):
    up = schedule.UpSweep(n)
    for k in range(schedule.max_levels(n) + 1):
        if k:
            step = up.extend()
            assert step.phase == "up" and step.level == k - 1
        assert up.depth == k
        whole = up.finish()
        assert _norm(whole) == _norm(schedule.blelloch_schedule(n, k))
        for d in range(k):  # the down-sweep step of each level reads what down_mats says, in order
            down = [st for st in whole.steps if st.phase == "down" and st.level == d]
            assert up.down_mats(d) == ([op.mat for op in down[0].mv] if down else [])
    with pytest.raises(ValueError):
        up.extend()
    with pytest.raises(ValueError):
        up.down_mats(up.depth)


@pytest.mark.parametrize("n", [5, 40, 129])
def test_upsweep_with_extras(n):
    rng = np.random.default_rng(n)
    flags = list(rng.random(n + 1) < 0.4)
    for k in range(schedule.max_levels(n) + 1):
        up = schedule.UpSweep(n, flags)
        for _ in range(k):
            up.extend()
        assert _norm(up.finish()) == _norm(schedule.blelloch_schedule(n, k, flags))


def _counting(monkeypatch):
    calls = {"finish": 0, "blelloch": 0}
    finish, blelloch = schedule.UpSweep.finish, planning.blelloch_schedule

    def counted_finish(self):
        calls["finish"] += 1
        return finish(self)

    def counted_blelloch(*args, **kwargs):
        calls["blelloch"] += 1
        return blelloch(*args, **kwargs)

    monkeypatch.setattr(schedule.UpSweep, "finish", counted_finish)
    monkeypatch.setattr(planning, "blelloch_schedule", counted_blelloch)
    return calls


def test_a_long_chain_that_stays_linear_builds_one_schedule(monkeypatch):
    """A recurrent chain whose depth-1 bound already loses: one schedule (depth 0) in all, its inputs as planned."""
    pats = as_chain([sp.csr_array(np.ones((20, 20))), sp.csr_array(np.eye(20))] * 2000)
    calls = _counting(monkeypatch)
    plan = planning.plan_scan(pats, "auto", CPU, batch_hint=16)
    assert plan.levels == 0 and sorted(plan.candidates) == [0] and plan.explored == 0
    assert calls == {"finish": 1, "blelloch": 0}
    forced = planning.plan_scan(pats, 0, CPU, batch_hint=16)
    assert _norm(plan.schedule) == _norm(forced.schedule)
    assert sorted(plan.mats) == sorted(forced.mats) == list(range(len(pats)))
    assert all(plan.mats[i].algo == "input" and plan.mats[i].pattern is pats[i] for i in plan.mats)
    assert plan.candidates == forced.candidates


@pytest.mark.parametrize("profile", ["cpu", "cuda"])
def test_the_search_finishes_only_the_depths_it_costs(monkeypatch, profile):
    rng = np.random.default_rng(0)
    pats = as_chain([sp.csr_array((np.ones(32), rng.permutation(32), np.arange(33)), shape=(32, 32))
                     for _ in range(100)])
    prof = profile_for(profile)
    calls = _counting(monkeypatch)
    plan = planning.plan_scan(pats, "auto", prof, batch_hint=16)
    # every costed depth once (one more where the last one's up-sweep alone lost after costing it); the
    # chosen depth's schedule is the search's
    assert len(plan.candidates) <= calls["finish"] <= len(plan.candidates) + 1
    assert calls["blelloch"] == 0
    forced = planning.plan_scan(pats, plan.levels, prof, batch_hint=16)
    assert _norm(plan.schedule) == _norm(forced.schedule)


def test_memory_limited_search_still_plans_the_chosen_depth():
    pats = as_chain([sp.csr_array(np.ones((2, 2)))] * 1000)

    def peak(p):
        from spscan.planner.memory import estimate_memory
        return estimate_memory(p).total(16)

    limit = peak(planning.plan_scan(pats, 0, CPU, batch_hint=1)) * 1.5
    plan = planning.plan_scan(pats, "auto", CPU, batch_hint=1, memory_limit=limit, memory_of=peak)
    forced = planning.plan_scan(pats, plan.levels, CPU, batch_hint=1)
    assert _norm(plan.schedule) == _norm(forced.schedule)
    assert sorted(plan.mats) == sorted(forced.mats)


def _plans():
    rng = np.random.default_rng(3)
    chains = {
        "factored": [sp.csr_array(np.ones((6, 6))), sp.csr_array(np.eye(6))] * 40,
        "perm": [sp.csr_array((np.ones(16), rng.permutation(16), np.arange(17)), shape=(16, 16)) for _ in range(33)],
        "mixed": [sp.random(8 + i % 3, 8 + (i + 1) % 3, density=0.3, format="csr", random_state=i)
                  for i in range(20)],
    }
    for name, chain in chains.items():
        pats = as_chain(chain)
        for prof in (CPU, profile_for("cuda")):
            for k in range(schedule.max_levels(len(pats)) + 1):
                yield name, prof, planning.plan_scan(pats, k, prof, batch_hint=4)


def test_schedule_costs_price_repeated_steps_as_each_alone():
    """The per-(phase, pattern, entries) memo of one-mat-vec steps gives every step exactly its own cost."""
    for name, prof, plan in _plans():
        n = plan.n
        for entries in (None, [None if i % 3 else 5 * i + 1 for i in range(n)]):
            mats = dict(plan.mats)
            if entries is not None:
                mats = {m: dataclasses.replace(v, apply_entries=entries[m]) if m < n else v for m, v in mats.items()}
            costs = cost.schedule_costs(plan.schedule, mats, prof, 4, 4)
            assert len(costs) == len(plan.schedule.steps)
            for st, c in zip(plan.schedule.steps, costs):
                nnz, flops, nbytes, t, nnz_read, _ = cost._step_cost(st, mats, prof, 4, 4)
                assert (c.phase, c.level, c.nodes_mm, c.nodes_mv) == (st.phase, st.level, len(st.mm), len(st.mv))
                assert (c.nnz, c.flops, c.bytes, c.nnz_read) == (nnz, flops, nbytes, nnz_read), name
                if not prof.parallel_run_max_m and not prof.recurrence_rate:
                    assert c.time_s == t  # (a chunked run spreads its total over its steps afterwards)


def test_call_tables_and_checks():
    pats = [sp.csr_array(np.eye(3))] * 5 + [sp.csr_array(np.ones((3, 2)))]
    plan = spscan.plan(pats, levels=0)
    dims, nnz, uniform = plan._call_tables
    assert list(dims) == plan.dims and list(nnz) == plan.nnz and uniform is False
    assert plan._call_tables is plan._call_tables  # made once
    same = spscan.plan([sp.csr_array(np.eye(3))] * 4, levels=0)
    assert same._call_tables[2] is True
    grad = torch.randn(2, 2)
    values = [torch.randn(2, p.nnz) for p in pats]
    for uniform_nnz in (None, False):
        out = check_inputs(plan.n, nnz, dims, None, None, values, grad, None, False, uniform_nnz=uniform_nnz)
        assert out[1] is False and out[2] == (False,) * 6
    with pytest.raises(ValueError, match="same nnz"):
        check_inputs(plan.n, nnz, dims, None, None, torch.randn(6, 2, 3), grad, None, False, uniform_nnz=False)
    # a plan of one nnz: stacked values checked as before, with or without the flag
    n4 = same._call_tables
    stacked = torch.randn(4, 2, 3)
    for uniform_nnz in (None, True):
        out = check_inputs(4, n4[1], n4[0], None, None, stacked, torch.randn(2, 3), None, False, uniform_nnz=uniform_nnz)
        assert out[1] is True and out[2] == (False,) * 4


def test_backward_uses_the_binding_of_its_signature():
    n = 200
    plan = spscan.plan([sp.csr_array(sp.eye(4))] * n, levels=0)
    assert len(plan.bindings()) == 1
    g = torch.Generator().manual_seed(0)
    stacked = 1 + 0.05 * torch.randn(n, 3, 4, generator=g)  # (no underflow: the loop flushes subnormals)
    grad = torch.randn(3, 4, generator=g)
    a = spscan.backward(plan, stacked, grad)
    b = spscan.backward(plan, list(stacked), grad)
    assert len(plan.bindings()) == 1  # the binding made at plan time, found again
    assert torch.equal(a.stacked(), b.stacked())
    want = grad.clone()
    for i in range(n - 1, -1, -1):
        want = stacked[i] * want
    assert torch.equal(a[0], want)  # a diagonal chain: one product per entry, in order
    shared = spscan.backward(plan, torch.randn(n, 4, generator=g), grad)
    assert len(plan.bindings()) == 2 and shared[0].shape == (3, 4)
    with pytest.raises(ValueError, match=r"values\[7\] \(layer 8\)"):
        bad = list(stacked)
        bad[7] = torch.randn(3, 5)
        spscan.backward(plan, bad, grad)
