"""The schedule simulator against the papers' unit-time examples and closed forms.

Expected numbers are derived from the papers' text (quoted next to each test), not from the
simulator: the out-of-order backprop paper (``papers/ooo-backprop.txt``, §5.2 and §8.4.1), the
weight-prediction paper (``papers/model-parallel-weight-prediction.txt``, §3, Figs. 6 and 8,
eqs. 5-6) and BPPSA (``papers/bppsa-paper.txt``, §2.2).
"""

import math
import os

import numpy as np
import pytest
import scipy.sparse as sp

from spscan.parallel.pipeline.simulator import (
    LayerCosts, Link, Overheads, Task, bppsa_scan, dualpipe, gpipe, list_schedule, one_f_one_b, ooo_pipe, pipedream,
    torch_schedule, zero_bubble,
)

UNIT16 = LayerCosts.uniform(16)  # every F, output gradient and weight gradient takes one unit


# ----------------------------------------------------------------------------- out-of-order backprop


def test_ooo_cross_layer_8_layers_two_gpus():
    # §5.2.1, Fig. 5: 8 layers on 2 GPUs, one batch: conventional 23 units, fast-forwarding 19,
    # modulo allocation 16 ("1.44x").
    c = LayerCosts.uniform(8)
    assert gpipe(c, 2, 1).step_time == 23
    assert ooo_pipe(c, 2, 1).step_time == 19
    assert ooo_pipe(c, 2, 1, modulo=True).step_time == 16


def test_ooo_16_layer_ffnn_speedups():
    # §8.4.1: 16-layer FFNN, 4 GPUs, micro-batches A-D, unit costs, no communication cost:
    # fast-forwarding 1.22x and with modulo allocation 1.62x over GPipe.
    # GPipe by hand: last stage's forwards end at (4 + 3) * 4 = 28; a stage's backward of one
    # micro-batch is 4 x (W + I) = 8 units (stage 0: 7, layer 1 has no output gradient), and the
    # gradient leaves after the stage's first layer's I, so stage s ends at 60 + 8 (3 - s) - [s == 0]: 83.
    # Fast-forwarding: stage 3 runs 16 I's from 28 (sending at 32, 36, 40, 44) then 16 W's: ends 60;
    # stage 1 receives at 36, 40, 44, 48, runs I's 36-52, W's 52-68: 68 -> 83 / 68 = 1.2206.
    # Modulo: the device holding layers 4, 8, 12, 16 does 48 unit tasks and cannot start before t = 3,
    # so 51 is the best possible; 83 / 51 = 1.627 (the paper truncates to 1.62).
    g, o1, o2 = gpipe(UNIT16, 4, 4), ooo_pipe(UNIT16, 4, 4), ooo_pipe(UNIT16, 4, 4, modulo=True)
    assert g.step_time == 83
    assert o1.step_time == 68
    assert o2.step_time == 51
    assert math.floor(100 * g.step_time / o1.step_time) == 122
    assert math.floor(100 * g.step_time / o2.step_time) == 162
    # modulo keeping GPipe's per-device flush cannot reach it
    assert ooo_pipe(UNIT16, 4, 4, modulo=True, flush=True).step_time > 51


def test_ooo_modulo_places_layer_l_on_device_l_mod_p():
    o2 = ooo_pipe(UNIT16, 4, 4, modulo=True)
    assert o2.extra["placement"] == [(l - 1) % 4 for l in range(1, 17)]
    for dev, acts in enumerate(o2.actions):
        assert {a.layers[0] % 4 for a in acts} == {(dev + 1) % 4}
    # same work in every schedule: 16 F + 15 I + 16 W per micro-batch
    for tl in (gpipe(UNIT16, 4, 4), ooo_pipe(UNIT16, 4, 4), o2):
        kinds = [a.kind for dev in tl.actions for a in dev]
        assert (kinds.count("F"), kinds.count("I"), kinds.count("W")) == (64, 60, 64)


def test_fast_forwarding_runs_input_gradients_before_weight_gradients():
    o1 = ooo_pipe(UNIT16, 4, 4)
    for acts in o1.actions[1:]:
        kinds = "".join(a.kind for a in acts if a.kind != "F")
        assert kinds == "I" * 16 + "W" * 16
    conv = gpipe(UNIT16, 4, 4)
    assert "".join(a.kind for a in conv.actions[3] if a.kind != "F")[:4] == "WIWI"


# ----------------------------------------------------------------------------- weight prediction


@pytest.mark.parametrize("N", [3, 4])
def test_dualpipe_round_trip_and_version_difference(N):
    # §3.1-3.3, Figs. 6b and 8: one forward and one backward per pipeline time unit; batch b is
    # forwarded by GPU k in unit b + k and back-propagated there in unit b + 2N - 2 - k (Fig. 8,
    # N = 3: the 5th batch runs in units 5..9), so its round trip is 2N - 1 units; SpecTrain's
    # version difference is s = 2N - k - 2 (forward, eq. 5) and s = k (backward, eq. 6).
    c = LayerCosts.uniform(N, forward=1.0, backward_input=0.0, backward_weight=1.0)
    tl = dualpipe(c, N, 4, overlap=1.0, last_stage_sequential=False, spectrain=True)
    fu, bu = tl.extra["forward_unit"], tl.extra["backward_unit"]
    for b in range(tl.extra["total_microbatches"]):
        for k in range(N):
            assert fu[b, k] == b + k
            assert bu[b, k] == b + 2 * N - 2 - k
    assert bu[4, 0] - fu[4, 0] + 1 == 2 * N - 1
    for k in range(N):
        assert tl.version_difference[k, "F"] == 2 * N - k - 2
        assert tl.version_difference[k, "B"] == k
    # one batch per unit in steady state (both tasks share the unit)
    assert tl.step_time == pytest.approx(4.0)
    assert tl.bubble_fraction == pytest.approx(0.0)


@pytest.mark.parametrize("N", [3, 4])
def test_pipedream_single_issue_timeline(N):
    # Fig. 6a: PipeDream issues one task per time unit; with unit tasks each GPU alternates F and B
    # in steady state (one batch per two units), GPU 0 admits N batches before its first backward,
    # and weight stashing keeps batch b on the version N - 1 - k updates old at stage k
    # (the updates of the batches still in flight above it).
    c = LayerCosts.uniform(N, forward=1.0, backward_input=0.0, backward_weight=1.0)
    pd = pipedream(c, N, 4)
    dp = dualpipe(c, N, 4, overlap=1.0, last_stage_sequential=False)
    assert pd.step_time == pytest.approx(8.0)
    assert pd.step_time / dp.step_time == pytest.approx(2.0)
    order0 = [a.kind for a in pd.actions[0]]
    assert order0[:N + 1] == ["F"] * N + ["B"]
    assert "".join(order0[N:N + 8]) == "BF" * 4
    total = pd.extra["total_microbatches"]
    for k in range(N):
        assert pd.staleness[total - 1, k] == (N - 1 - k, N - 1 - k)
    assert not pd.exact and pd.max_staleness == N - 1


def test_dualpipe_vanilla_staleness():
    # vanilla DualPipe: the forward of batch b at stage k sees the updates of batches whose
    # backward at stage k ended before unit b + k, i.e. b' <= b - 2N + 1 + 2k: 2N - 2 - 2k missing;
    # the backward (unit b + 2N - 2 - k) sees every earlier batch's update of stage k.
    N = 4
    c = LayerCosts.uniform(N, forward=1.0, backward_input=0.0, backward_weight=1.0)
    tl = dualpipe(c, N, 4, overlap=1.0, last_stage_sequential=False)
    for k in range(N):
        assert tl.staleness[tl.extra["total_microbatches"] - 1, k] == (2 * N - 2 - 2 * k, 0)


# ----------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("p,m", [(2, 1), (4, 4), (4, 8), (8, 3)])
def test_gpipe_bubble_formula(p, m):
    # GPipe (Huang et al.) with equal stages, per micro-batch forward f and backward b:
    # step = (m + p - 1)(f + b), bubble = (p - 1) / (m + p - 1).
    c = LayerCosts.uniform(2 * p, forward=1.0, backward_input=0.0, backward_weight=2.0)
    tl = gpipe(c, p, m)
    assert tl.step_time == pytest.approx((m + p - 1) * 6.0)
    assert tl.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert tl.peak_activations == [2.0 * m] * p  # every micro-batch's activations at once
    f1 = one_f_one_b(c, p, m)
    assert f1.step_time == pytest.approx(tl.step_time)  # same bubble as GPipe ...
    assert f1.peak_activations == [2.0 * min(m, p - s) for s in range(p)]  # ... at most p - s in flight
    assert tl.max_staleness == f1.max_staleness == 0 and tl.exact and f1.exact


def test_zero_bubble_split_fills_the_drain():
    c = LayerCosts.uniform(8)
    f1, zb = one_f_one_b(c, 4, 8), zero_bubble(c, 4, 8)
    assert zb.step_time < f1.step_time
    assert zb.bubble_fraction < f1.bubble_fraction
    assert zb.max_staleness == 0
    # every stage's W follows its I for the same micro-batch
    for acts in zb.actions:
        seen_i = set()
        for a in acts:
            if a.kind == "I":
                seen_i.add(a.microbatch)
            if a.kind == "W" and a.layers[0] > 1:
                assert a.microbatch in seen_i


def test_torch_schedules_replayed():
    c = LayerCosts.uniform(8)
    ours = gpipe(c, 2, 4)
    theirs = torch_schedule("GPipe", c, 2, 4)
    assert theirs.step_time == pytest.approx(ours.step_time)
    assert theirs.extra["torch_order"][0] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"]
    # torch's 1F1B order on rank 0 is ours
    f1 = one_f_one_b(c, 2, 4)
    assert [s for s in f1.order(0)] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    zb = torch_schedule("InterleavedZeroBubble", c, 2, 4, stages_per_rank=2)
    assert zb.extra["stages"] == 4 and zb.bubble_fraction < theirs.bubble_fraction


def test_bppsa_scan_log_rounds_against_linear_pipeline():
    # BPPSA §2.2/§3: the scan's backward needs ceil(log2 p) communication steps, pipelined backprop
    # p - 1. With zero compute and a unit link: forward p - 1 hops for both; backward log2 p vs p - 1.
    import spscan.distributed as D

    for p in (2, 4, 8):
        n = 2 * p
        pats = [sp.csr_array(sp.eye(4)) for _ in range(n)]
        dplan = D.plan(pats, p, slices=[2 * r for r in range(p + 1)])
        zero = LayerCosts.uniform(n, 0.0, 0.0, 0.0)
        tl = bppsa_scan(dplan, pats, zero, 1, batch=2, pair_time=0.0, link=Link(latency=1.0))
        assert tl.step_time == pytest.approx((p - 1) + math.ceil(math.log2(p)))
        assert gpipe(zero, p, 1, Link(latency=1.0), bounds=dplan.bounds).step_time == pytest.approx(2 * (p - 1))
        rounds = [sum(a.kind == "X" for a in acts) for acts in tl.actions]
        assert rounds == [dplan.rounds] * p


def test_bppsa_scan_messages_and_order_follow_the_plan():
    import spscan.distributed as D

    rng = np.random.default_rng(0)
    pats = []
    for i in range(10):
        a = sp.random(12, 12, density=0.15, random_state=rng, format="csr") + sp.eye(12)
        a = sp.csr_array(a)
        a.sort_indices()
        pats.append(a)
    dplan = D.plan(pats, 4)
    costs = LayerCosts.uniform(10)
    tl = bppsa_scan(dplan, pats, costs, 2, batch=3, pair_time=0.01, link=Link(latency=0.5, bandwidth=1e3))
    for r in range(4):
        sent, _ = dplan.planned_bytes(r, 3, __import__("torch").float32, [False] * 4, [False] * 4)
        assert tl.extra["bytes_sent"][r] == sent
        kinds = [a.kind for a in tl.actions[r]]
        assert kinds[:2] == ["F", "F"] and kinds[-1] == "W"
    # a rank's round k cannot end before its peer's partial has arrived
    ends = {(a.device, a.kind, a.round): a for acts in tl.actions for a in acts}
    for r in range(4):
        for k in range(dplan.rounds):
            src = dplan.recv_peer(r, k)
            if src is not None:
                before = ends[src, "X", k - 1] if k else next(a for a in tl.actions[src] if a.kind in ("R", "I"))
                assert ends[r, "X", k].end >= before.end + 0.5 - 1e-9
    assert tl.exact and tl.max_staleness == 0


# ----------------------------------------------------------------------------- engine and inputs


def test_list_schedule_priorities_and_delays():
    tasks = [Task(0, 0, "F", 0, (1, 1), 2.0, (0,)), Task(1, 1, "F", 0, (2, 2), 1.0, (0,), [(0, 0.5)]),
             Task(1, 1, "W", 0, (2, 2), 1.0, (1,)), Task(1, 1, "W", 1, (2, 2), 1.0, (2,))]
    start, end = list_schedule(tasks, 2)
    # device 1 is idle until 2.5 except for the W tasks, which have lower priority but are ready at 0
    assert list(start) == [0.0, 2.5, 0.0, 1.0]
    with pytest.raises(ValueError, match="deadlock"):
        list_schedule([Task(0, 0, "F", 0, (1, 1), 1.0, (0,), [(1, 0.0)]),
                       Task(0, 0, "F", 1, (1, 1), 1.0, (0,), [(0, 0.0)])], 1)


def test_deterministic_and_errors():
    a, b = ooo_pipe(UNIT16, 4, 4, modulo=True), ooo_pipe(UNIT16, 4, 4, modulo=True)
    assert [a.order(d) for d in range(4)] == [b.order(d) for d in range(4)]
    with pytest.raises(ValueError, match="backward_weight: expected 3"):
        LayerCosts((1.0,) * 3, (1.0,) * 3, (1.0,) * 2)
    with pytest.raises(ValueError, match="layer\\(s\\) \\[2\\]"):
        LayerCosts((1.0, -1.0), (1.0, 1.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="p: expected an int in \\[1, n=16\\]"):
        gpipe(UNIT16, 17, 4)
    with pytest.raises(ValueError, match="m: expected a positive int"):
        gpipe(UNIT16, 4, 0)
    with pytest.raises(ValueError, match="bounds: expected 5"):
        gpipe(UNIT16, 4, 2, bounds=[0, 4, 8, 16])


def test_draw_writes_png(tmp_path):
    from spscan.parallel.pipeline.draw import draw_timelines

    path = draw_timelines([gpipe(UNIT16, 4, 4), ooo_pipe(UNIT16, 4, 4, modulo=True)], str(tmp_path / "t" / "x.png"))
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000


def test_timeline_panels_share_a_labelled_time_axis_and_a_legend():
    from spscan.parallel.pipeline.draw import timeline_figure

    fig = timeline_figure([gpipe(UNIT16, 4, 4), ooo_pipe(UNIT16, 4, 4, modulo=True)])
    axes = fig.axes
    assert len({ax.get_xlim() for ax in axes}) == 1  # one time scale for every panel
    assert axes[-1].get_xlabel().startswith("time")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "F: forward" in labels and any(label.startswith("W: ") for label in labels)


# ----------------------------------------------------------------------------- runtime costs


def test_overheads_per_action_and_per_step():
    # two layers, one per stage; layer 1's I is never run, so stage 0: F = 1, B = W = 1; stage 1: F = 1, B = 2.
    # 1F1B, p = 2, m = 2, by hand: rank 1 runs F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]; rank 0 F0 F1 [0,2],
    # B0 [4,5], B1 [7,8] -> 8.
    c = LayerCosts.uniform(2)
    assert one_f_one_b(c, 2, 2).step_time == pytest.approx(8.0)
    # + 0.5 per F, 0.25 per B, 1 before rank 0's first action, 2 after each rank's last: stage 0 F 1.5 B 1.25,
    # stage 1 F 1.5 B 2.25. rank 0: S [0,1] F0 [1,2.5] F1 [2.5,4]; rank 1: F0 [2.5,4] B0 [4,6.25] F1 [6.25,7.75]
    # B1 [7.75,10] U [10,12]; rank 0: B0 [6.25,7.5] B1 [10,11.25] U [11.25,13.25] -> 13.25.
    ov = Overheads(action={"F": 0.5, "B": 0.25}, step_start=[1.0, 0.0], step_end=2.0)
    tl = one_f_one_b(c, 2, 2, overheads=ov)
    assert tl.step_time == pytest.approx(13.25)
    assert [str(a) for a in tl.actions[0]][0] == "-1S" and tl.actions[0][-1].kind == "U"
    assert tl.actions[0][-1].start == pytest.approx(11.25)
    # torch's own GPipe list, the same overheads: every action of a kind longer by the same amount
    base, more = torch_schedule("GPipe", c, 2, 2), torch_schedule("GPipe", c, 2, 2, overheads=Overheads({"F": 0.5}))
    fb = {str(a): a.end - a.start for a in base.actions[1]}
    fm = {str(a): a.end - a.start for a in more.actions[1]}
    assert all(fm[k] == pytest.approx(fb[k] + (0.5 if "F" in k else 0.0)) for k in fb)
    with pytest.raises(ValueError, match="Overheads.action\\['F'\\]"):
        Overheads(action={"F": -1.0})
    with pytest.raises(ValueError, match="step_start: expected 2 values"):
        one_f_one_b(c, 2, 2, overheads=Overheads(step_start=[1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="Link.bandwidth"):
        Link(bandwidth=0.0)


def test_blocking_link_holds_the_sender():
    # two ranks, two layers each, F = 1 per layer, no backward compute, link latency 1, m = 2.
    # Overlapped sends: rank 0 F0 [0,2] F1 [2,4]; rank 1 F0 [3,5] F1 [5,7]; its spine at 7 reaches rank 0 at 8.
    # Blocking sends: rank 0 F0 [0,3] F1 [3,6] (each holds the send); rank 1 F0 [3,5] F1 [6,8];
    # round 0 on rank 1 sends for 1 [8,9]: rank 0 has it at 9.
    import spscan.distributed as D

    pats = [sp.csr_array(sp.eye(4)) for _ in range(4)]
    dplan = D.plan(pats, 2, slices=[0, 2, 4])
    c = LayerCosts.uniform(4, 1.0, 0.0, 0.0)
    free = bppsa_scan(dplan, pats, c, 2, batch=2, pair_time=0.0, link=Link(latency=1.0))
    held = bppsa_scan(dplan, pats, c, 2, batch=2, pair_time=0.0, link=Link(latency=1.0, blocking=True))
    assert free.step_time == pytest.approx(8.0)
    assert held.step_time == pytest.approx(9.0)
    assert [(a.start, a.end) for a in held.actions[0] if a.kind == "F"] == [(0.0, 3.0), (3.0, 6.0)]
