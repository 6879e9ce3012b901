"""The calibration side of the real-run comparison, on hand-made measurements (no processes): the
link fit, step times from per-rank clocks, the runtime overheads read from a trace, and the
prediction made from them."""

import numpy as np
import pytest

from spscan.parallel.pipeline import realrun as R
from spscan.parallel.pipeline import simulator as S

CFG = dict(dims=[8] * 9, batch=8, microbatches=4)
B = [0, 8, 15]
STAGE = {"0,8,15/0": {"F": 1e-3, "B": 3e-3, "I": 0.0, "W": 1e-3},
         "0,8,15/1": {"F": 2e-3, "B": 4e-3, "I": 1e-3, "W": 2e-3}}


def _rank(rank: int, steps: list[dict]) -> dict:
    return {"rank": rank, "calibration": {
        "stage": {k: v for k, v in STAGE.items() if k.endswith(f"/{rank}")}, "scan": {},
        "opt": {"GPipe": 5e-4}, "sizes": [4, 1000],
        "async": {4: 1e-4, 1000: 1e-4 + 1000 / 1e8}, "blocking": None,
        "rounds": {"share": [(1.0, 1.0), (1.0, 4.0)], "burst": [(1.0, 1.0), (1.0, 2.0)],
                   "async": [{4: 1e-4, 1000: 2e-4}, {4: 1e-3, 1000: 1.1e-3}],
                   "blocking": []}},
        "methods": {"GPipe": {"bounds": B, "steps": steps}}}


def test_fit_link_recovers_latency_and_bandwidth():
    lk = R.fit_link({4: 5e-5 + 4 / 2e9, 1 << 17: 5e-5 + (1 << 17) / 2e9, 1 << 19: 5e-5 + (1 << 19) / 2e9})
    assert lk.latency == pytest.approx(5e-5) and lk.bandwidth == pytest.approx(2e9)
    # no size dependence measurable: latency only
    assert R.fit_link({4: 1e-4, 1000: 1e-4}).bandwidth == float("inf")
    assert R.fit_link({4: 2e-4}, blocking=True) == S.Link(2e-4, blocking=True)


def test_step_times_span_the_ranks():
    s0 = [{"start": 10.0, "end": 10.5}, {"start": 20.0, "end": 20.2}]
    s1 = [{"start": 10.1, "end": 10.7}, {"start": 20.0, "end": 20.3}]
    res = [{"methods": {"m": {"steps": s0}}}, {"methods": {"m": {"steps": s1}}}]
    np.testing.assert_allclose(R.step_times(res, "m"), [0.7, 0.3])


def test_runtime_overheads_from_a_trace():
    # rank 0: F0 0 and F0 1 take 1.2 ms of CPU each (isolated 1 ms: 0.2 ms inside the call), B0 0 3.5 ms
    # (0.5 inside), a wait and a post; the step's CPU is 7.5 ms of which 0.3 ms before the first call:
    # outside the calls (posts count as runtime) 7.5 - (1.2 + 1.2 + 3.5 + 0.1 wait) - 0.3 = 1.2 ms over 3 calls.
    ev0 = [("0F0", 1.0, 1.1, 1.2e-3, 100.0003), ("post", 1.1, 1.11, 0.05e-3, 100.0016),
           ("0F1", 1.2, 1.3, 1.2e-3, 100.002), ("wait", 1.3, 1.4, 0.1e-3, 100.0035),
           ("0B0", 1.4, 1.5, 3.5e-3, 100.004)]
    st0 = {"start": 1.0, "end": 1.6, "cpu_start": 100.0, "cpu": 7.5e-3, "run_wait": 0.0, "events": ev0}
    # rank 1: F1 0 2.1 ms (isolated 2), B1 0 4.3 ms (isolated 4); CPU 7 ms, 0.1 ms before its first call
    ev1 = [("1F0", 1.0, 1.1, 2.1e-3, 50.0001), ("1B0", 1.2, 1.3, 4.3e-3, 50.003)]
    st1 = {"start": 1.0, "end": 1.6, "cpu_start": 50.0, "cpu": 7.0e-3, "run_wait": 0.0, "events": ev1}
    ov = R.runtime_overheads([_rank(0, [st0]), _rank(1, [st1])], "GPipe")
    # medians per rank, then over the ranks
    assert ov["in_action"]["F"] == pytest.approx(np.median([0.2e-3, 0.1e-3]))
    assert ov["in_action"]["B"] == pytest.approx(np.median([0.5e-3, 0.3e-3]))
    assert ov["start"] == pytest.approx([0.3e-3, 0.1e-3])
    assert ov["gap"] == pytest.approx(np.median([1.2e-3 / 3, (7e-3 - 6.4e-3 - 0.1e-3) / 2]))


def test_prediction_uses_the_calibration_and_scales_with_the_cpu_share():
    res = [_rank(0, []), _rank(1, [])]
    tl = R.predicted_timeline(res, CFG, "GPipe", link=False)
    # GPipe over the isolated stage costs: stage 0 F 1 ms, B 3 ms (its W: the first stage's I is empty);
    # stage 1 F 2 ms, B 4 ms; 4 micro-batches, then each rank's optimizer step (0.5 ms).
    c = S.LayerCosts(tuple([0.0] * 7 + [1e-3] + [0.0] * 6 + [2e-3]), tuple([0.0] * 14 + [4e-3 * 1 / 3]),
                     tuple([0.0] * 7 + [3e-3] + [0.0] * 6 + [4e-3 * 2 / 3]))
    ref = S.torch_schedule("GPipe", c, 2, 4, bounds=B, overheads=S.Overheads(step_end=5e-4))
    assert tl.step_time == pytest.approx(ref.step_time)
    # by hand: rank 1's forwards end at 1 + 4 x 2 = 9 ms, its backwards at 25, rank 0's last B at 28 -> 28.5
    assert tl.step_time == pytest.approx(28.5e-3)
    half = R.predicted_timeline(res, CFG, "GPipe", link=False, share=0.5)
    assert half.step_time == pytest.approx(2 * tl.step_time)
    dedicated, loaded = R.predicted_step_times(res, CFG, "GPipe")
    assert dedicated == pytest.approx(R.predicted_timeline(res, CFG, "GPipe").step_time)
    # round 2 ran at half a core with 1 ms messages: slower than round 1
    assert len(loaded) == 2 and loaded[1] > 2 * loaded[0] - 1e-9


def test_explained_steps_divide_by_the_cpu_share_the_ranks_got():
    # step 1: both ranks never waited for a core (share 1); step 2: rank 0 got 1/2, rank 1 1/4 (mean 3/8)
    s0 = [{"cpu": 2e-3, "run_wait": 0.0}, {"cpu": 2e-3, "run_wait": 2e-3}]
    s1 = [{"cpu": 1e-3, "run_wait": 0.0}, {"cpu": 1e-3, "run_wait": 3e-3}]
    res = [_rank(0, s0), _rank(1, s1)]
    np.testing.assert_allclose(R.step_cpu_shares(res, "GPipe"), [1.0, 0.375])
    ex = R.explained_step_times(res, CFG, "GPipe")
    ded = R.predicted_timeline(res, CFG, "GPipe").step_time
    assert ex[0] == pytest.approx(ded)
    # compute and overheads stretch by 1 / 0.375, the (fastest) link does not
    assert ded / 0.375 * 0.98 < ex[1] <= ded / 0.375 + 1e-12
