"""Model-parallel BPPSA (spscan.distributed): gradients vs the float64 reference on 2, 3 and 4
Gloo processes, the ceil(log2 p) communication rounds and planned message bytes, and failure
behaviour (a bad or dead rank makes every rank raise instead of hanging).

Each spawned group runs a batch of cases, since process startup dominates the cost.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given
from hypothesis import strategies as st

import spscan
import spscan.distributed as sd
from spscan.planner.patterns import as_pattern

from distributed_cases import (check_comm, crash_before_backward, failure_cases, make_chain, run_cases,
                               run_cases_and_subgroups)

TOL = 1e-10


def _cases(p: int) -> list[dict]:
    n_min = p  # one layer per rank at least
    return [
        dict(kind="sparse", n=9, seed=1 + p, batches=[3, 1]),  # balanced slices, batch changes on one plan
        dict(kind="dense", n=8, seed=2 + p, slices=_uneven(p, 8)),
        dict(kind="mixed", n=10, seed=3 + p, extra="all", shared="some"),
        dict(kind="sparse", n=n_min, seed=4 + p, extra="some", shared="all"),  # one layer per rank
        dict(kind="band", n=12, seed=5, slices=_single_first(p, 12), extra="some", levels=0),
        dict(kind="sparse", n=7, seed=6 + p, extra="all", dtype=torch.float32, batches=[2]),
    ]


def _uneven(p: int, n: int) -> list[int]:
    """Most layers on the last rank, one on each of the others."""
    return list(range(p)) + [n]


def _single_first(p: int, n: int) -> list[int]:
    """Rank 0 owns a single layer, the rest split evenly."""
    rest = np.linspace(1, n, p).round().astype(int).tolist()
    return [0] + rest


def _check_group(p: int, results: list) -> None:
    for r, (ok, out) in enumerate(results):
        assert ok, f"rank {r} failed:\n{out}"
    cases = _cases(p)
    for ci, case in enumerate(cases):
        per_rank = [out["world"][ci] for _, out in results]
        tol = 1e-5 if case.get("dtype") == torch.float32 else TOL
        for r, res in enumerate(per_rank):
            assert res["error"] <= tol, f"p={p} case {ci} ({case['kind']}) rank {r}: rel. error {res['error']:.3g}"
        check_comm(p, [res["stats"] for res in per_rank], f"p={p} case {ci}")
    sub = {}
    for _, out in results:
        sub.update(out["sub"])
    assert sub["solo"]["error"] <= TOL
    assert sub["solo"]["stats"][0]["rounds"] == [] and sub["solo"]["stats"][0]["bytes_sent"] == 0
    if p >= 3:
        assert sub["tail"]["error"] <= TOL


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_gradients_rounds_and_bytes(p):
    # p = 6: three rounds, and ranks that receive three pieces (their application order matters)
    results = sd.run_local(run_cases_and_subgroups, p, args=(_cases(p),), timeout=150)
    _check_group(p, results)


@pytest.mark.parametrize("p", [2, 3])
def test_triton_backend_on_every_rank(p):
    """Slice reductions, round compositions and the finish run the Triton kernels (interpreter here)."""
    cases = [
        dict(kind="sparse", n=6, seed=11 + p, backend="triton", levels=1),
        dict(kind="mixed", n=7, seed=12 + p, extra="all", shared="some", backend="triton"),
        dict(kind="dense", n=p + 1, seed=13, extra="some", dtype=torch.float32, backend="triton", batches=[2]),
    ]
    results = sd.run_local(run_cases, p, args=(cases,), timeout=240)
    for r, (ok, out) in enumerate(results):
        assert ok, f"rank {r} failed:\n{out}"
        for ci, (case, res) in enumerate(zip(cases, out)):
            tol = 1e-5 if case.get("dtype") == torch.float32 else TOL
            assert res["error"] <= tol, f"p={p} case {ci} rank {r}: rel. error {res['error']:.3g}"
    check_comm(p, [[s for s in out[0]["stats"]] for _, out in results], f"p={p} triton")


def test_bad_input_on_one_rank_fails_everywhere():
    p = 3
    results = sd.run_local(failure_cases, p, timeout=90)
    for r, (ok, out) in enumerate(results):
        assert ok, f"rank {r} failed:\n{out}"
    for r, (_, rep) in enumerate(results):
        kind, msg, secs = rep[0]
        if r == 1:
            assert kind == "ValueError" and "rank 1" in msg and "nnz" in msg, msg
        else:
            assert kind == "PeerError" and "[1]" in msg, msg
        assert secs < 15
        kind, msg, _ = rep[1]
        assert kind == "ValueError" and "batch" in msg and "(0, 3)" in msg, (r, msg)
        assert rep[2][0] == "ok", rep[2]
        assert float(rep[3][1]) <= TOL


def test_dead_rank_makes_others_raise_within_timeout():
    p = 3
    results = sd.run_local(crash_before_backward, p, timeout=90, pg_timeout=10)
    assert not results[p - 1][0] and "simulated failure" in results[p - 1][1]
    for r in range(p - 1):
        ok, (kind, msg, secs) = results[r]
        assert ok and kind == "PeerError", (r, kind, msg)
        assert f"rank {r}" in msg
        assert secs < 30


def test_dense_chain_message_sizes_from_first_principles():
    """p=4 over a width-d dense chain: round 0 sends 1 vector and 2 matrices, round 1 sends 2 vectors."""
    d, batch, p = 5, 2, 4
    pats = [sp.csr_array(np.ones((d, d)))] * 8
    dplan = sd.plan(pats, p, slices=[0, 2, 4, 6, 8])
    shared, extra = [False] * p, [False] * p
    sizes = {(r, k): dplan.message_numel(r, k, batch, shared, extra) for r in range(p) for k in range(2)}
    assert sizes == {(0, 0): 0, (1, 0): batch * d * d, (2, 0): batch * d * d, (3, 0): batch * d,
                     (0, 1): 0, (1, 1): 0, (2, 1): batch * d, (3, 1): batch * d}
    # shared values send one matrix for the whole batch; extras add a (B, d) vector
    assert dplan.message_numel(1, 0, batch, [True] * p, extra) == d * d
    assert dplan.message_numel(1, 0, batch, shared, [False, True, False, False]) == batch * d * d + batch * d
    sent, recv = dplan.planned_bytes(1, batch, torch.float64, shared, extra)
    assert (sent, recv) == (8 * batch * d * d, 8 * (batch * d * d + batch * d))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8, 13])
def test_round_structure_is_logarithmic(p):
    pats = make_chain("sparse", max(p, 3) + 2, 0)
    dplan = sd.plan(pats, p)
    assert dplan.rounds == (math.ceil(math.log2(p)) if p > 1 else 0)
    for r in range(p):
        # each rank's boundary gradient depends on every later rank: the received ranges tile r+1..p-1
        covered = []
        for k in range(dplan.rounds):
            src = dplan.recv_peer(r, k)
            if src is not None:
                a, b = dplan.partial_range(src, k)
                covered += list(range(a, b + 1))
                assert dplan.send_peer(src, k) == r
        assert covered == list(range(r + 1, p))


def test_planned_composites_match_products():
    """Composite patterns (what is sent) equal the structural products of the ranges they cover."""
    pats = make_chain("sparse", 11, 5)
    dplan = sd.plan(pats, 5, slices=[0, 2, 3, 6, 9, 11])
    canon = [as_pattern(p) for p in pats]
    for r in range(5):
        for k in range(dplan.rounds):
            pat = dplan.partial_pattern(r, k)
            a, b = dplan.partial_range(r, k)
            if b == 4:
                assert pat is None
                continue
            prod = canon[dplan.bounds[a]].to_scipy()
            for p in canon[dplan.bounds[a] + 1: dplan.bounds[b + 1]]:
                prod = prod @ p.to_scipy()
            prod = sp.csr_array(prod)
            dense = pat.nnz == pat.shape[0] * pat.shape[1]
            got = sp.csr_array((np.ones(pat.nnz), pat.indices, pat.indptr), shape=pat.shape).toarray() != 0
            want = prod.toarray() != 0
            assert (got | ~want).all() and (dense or (got == want).all())


@given(st.lists(st.integers(1, 36), min_size=1, max_size=8), st.integers(1, 8))
def test_balanced_slices_optimal(nnzs, p):
    """The cut minimizes the largest slice cost (checked by brute force on small chains)."""
    import itertools

    p = min(p, len(nnzs))
    # 6x6 patterns holding the first z positions in row-major order: nnz and products vary
    pats = []
    for z in nnzs:
        rows, cols = np.divmod(np.arange(z), 6)
        pats.append(sp.csr_array((np.ones(z), (rows, cols)), shape=(6, 6)))
    bounds = sd.balanced_slices(pats, p)
    assert bounds[0] == 0 and bounds[-1] == len(pats) and len(bounds) == p + 1
    assert all(b > a for a, b in zip(bounds, bounds[1:]))
    cost = sd._layer_costs([as_pattern(x) for x in pats])
    best = min(max(cost[a:b].sum() for a, b in zip((0,) + c, c + (len(pats),)))
               for c in itertools.combinations(range(1, len(pats)), p - 1))
    got = max(cost[a:b].sum() for a, b in zip(bounds, bounds[1:]))
    assert got == pytest.approx(best)


def test_balanced_slices_follow_flops():
    # a heavy dense layer in the middle gets a slice of its own
    light = sp.csr_array(sp.eye(20, format="csr"))
    heavy = sp.csr_array(np.ones((20, 20)))
    pats = [light] * 6 + [heavy] + [light] * 6
    assert sd.balanced_slices(pats, 3) == [0, 6, 7, 13]


def test_balanced_slices_accept_a_plan_and_a_model():
    pats = make_chain("sparse", 6, 1)
    assert sd.balanced_slices(spscan.plan(pats), 2) == sd.balanced_slices(pats, 2)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(),
                              torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh()), torch.nn.Linear(64, 2))
    x = torch.zeros(2, 8)
    bounds = sd.balanced_slices(net, 3, example_input=x)
    layer_pats = spscan.plan(net, x, levels=0).patterns
    assert bounds == sd.balanced_slices(layer_pats, 3) and bounds[-1] == 5
    with pytest.raises(TypeError, match="example input"):
        sd.balanced_slices(net, 2)


def test_plan_validation():
    pats = make_chain("sparse", 4, 1)
    with pytest.raises(ValueError, match="world_size"):
        sd.plan(pats, 5)
    with pytest.raises(ValueError, match="slices"):
        sd.plan(pats, 2, slices=[0, 0, 4])
    with pytest.raises(ValueError, match="slices"):
        sd.plan(pats, 2, slices=[0, 2, 3])
    with pytest.raises(ValueError, match="rank"):
        sd.plan(pats, 2).rank_plan(2)
    with pytest.raises(TypeError):
        sd.plan("abc", 1)
    big = sd.plan(pats, 3, slices=[0, 1, 3, 4])
    big.bytes_budget = 1.0  # the middle rank's two-layer product is over this
    with pytest.raises(ValueError, match="planning budget"):
        big.rank_plan(1)
    with pytest.raises(TypeError, match="DistributedPlan"):
        sd.backward(spscan.plan(pats), [], None)


@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 6), st.floats(0.0, 1.0), st.floats(0.0, 1.0),
       st.booleans(), st.booleans(), st.integers(0, 1000))
def test_composite_and_matvec_match_dense(m, k, n, da, db, with_extra, shared_a, seed):
    """The slice reduction's primitives on the engine: the composite of two layers and one mat-vec."""
    rng = np.random.default_rng(seed)
    a = sp.csr_array(sp.random(m, k, density=da, format="csr", random_state=seed))
    b = sp.csr_array(sp.random(k, n, density=db, format="csr", random_state=seed + 1))
    if seed % 4 == 0:
        a, b = sp.csr_array(np.ones((m, k))), sp.csr_array(np.ones((k, n)))
    batch = 3
    va = torch.from_numpy(rng.standard_normal(a.nnz if shared_a else (batch, a.nnz)))
    vb = torch.from_numpy(rng.standard_normal((batch, b.nnz)))
    ext = [torch.from_numpy(rng.standard_normal((batch, m))) if with_extra else None,
           torch.from_numpy(rng.standard_normal((batch, k))) if with_extra else None, None]
    cplan = spscan.plan_composite([a, b])
    bound = cplan.bind((shared_a, False), (with_extra, with_extra, False))
    res = bound.run([va, vb], extra=ext if with_extra else None)
    c, cv = res.composite, res.composite_vector
    pc = cplan.composite_pattern
    x = torch.from_numpy(rng.standard_normal((batch, k)))
    y = spscan.backward(spscan.plan([a], levels=0), [va], x, [torch.ones(batch, m, dtype=torch.float64), None])[0]
    for s in range(batch):
        ad = sp.csr_array(((va if shared_a else va[s]).numpy(), a.indices, a.indptr), shape=a.shape).toarray()
        bd = sp.csr_array((vb[s].numpy(), b.indices, b.indptr), shape=b.shape).toarray()
        cd = sp.csr_array((c[s].numpy(), pc.indices, pc.indptr), shape=pc.shape)
        np.testing.assert_allclose(cd.toarray(), ad @ bd, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(y[s].numpy(), ad @ x[s].numpy() + 1, rtol=1e-12, atol=1e-12)
        if with_extra:
            want = ext[0][s].numpy() + ad @ ext[1][s].numpy()
            np.testing.assert_allclose(cv[s].numpy(), want, rtol=1e-12, atol=1e-12)
    assert cv is None or cv.shape == (batch, m)
    # deterministic: the same call twice is bitwise identical
    assert torch.equal(bound.run([va, vb], extra=ext if with_extra else None).composite, c)