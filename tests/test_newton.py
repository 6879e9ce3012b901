"""The Newton forward (spscan.recurrent.newton): converged outputs equal the sequential forward, gradients autograd's."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_recurrent import CELLS, grads_of, make_inputs, make_module, rel_err
from torch import nn

import spscan
from spscan.recurrent.newton import NewtonNotConverged, NewtonOptions, transpose_pattern
from spscan.recurrent.plan import RecurrentPlan, plan_recurrent
from spscan.recurrent.wrapper import wrap_recurrent

# every Newton forward run here, (kind, method, dtype, T, iterations, reason): the counts the tests saw
ITERATIONS: list[tuple] = []


def newton_forward(m: nn.Module, x: torch.Tensor, hx, **kw):
    """Outputs of the Newton forward and its record; fails on a fallback (the warning is an error here)."""
    p = plan_recurrent(m, x, forward="newton", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NewtonNotConverged)
        with torch.no_grad():
            (out, state), _ = p.forward(x, hx)
    info = p.last_forward
    ITERATIONS.append((p.kind, info.method, str(x.dtype), info.seq_len, info.iterations, info.reason))
    assert info.converged and info.iterations == len(info.deltas)
    return out, state, info


def flat(out, state) -> list[torch.Tensor]:
    return [out] + (list(state) if isinstance(state, tuple) else [state])


def tame(m: nn.Module, scale: float) -> nn.Module:
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return m


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(sorted(CELLS)))
    hidden = draw(st.integers(1, 12))
    return dict(
        kind=kind, hidden=hidden, T=draw(st.integers(1, 80)), B=draw(st.integers(1, 3)),
        input_size=draw(st.integers(1, 4)), batch_first=draw(st.booleans()), bias=draw(st.booleans()),
        with_h0=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
        layout=draw(st.sampled_from(["factored", "materialized"])),
    )


@settings(max_examples=40)
@given(cfg=cases())
def test_float64_outputs_equal_sequential(cfg):
    m = make_module(cfg["kind"], cfg["input_size"], cfg["hidden"], batch_first=cfg["batch_first"], bias=cfg["bias"],
                    seed=cfg["seed"])
    x, hx = make_inputs(m, cfg["T"], cfg["B"], with_h0=cfg["with_h0"], dtype=torch.float64, seed=cfg["seed"] + 1)
    out, state, info = newton_forward(m, x, hx, layout=cfg["layout"])
    with torch.no_grad():
        want = flat(*m(x, hx))
    for a, b in zip(flat(out, state), want):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_err(a, b) <= 1e-10, (rel_err(a, b), cfg, info)
    # after k iterations the first k steps are exact: T steps never need more than T scans
    assert info.iterations <= cfg["T"], info


@settings(max_examples=25)
@given(cfg=cases(), loss=st.sampled_from(["step", "final", "both"]))
def test_float64_gradients_equal_autograd(cfg, loss):
    m = make_module(cfg["kind"], cfg["input_size"], cfg["hidden"], batch_first=cfg["batch_first"], bias=cfg["bias"],
                    seed=cfg["seed"])
    x, hx = make_inputs(m, cfg["T"], cfg["B"], with_h0=cfg["with_h0"], dtype=torch.float64, seed=cfg["seed"] + 1)
    want = grads_of(m, m, x, hx, loss)
    w = wrap_recurrent(m, x, forward="newton", layout=cfg["layout"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", NewtonNotConverged)
        got = grads_of(w, m, x, hx, loss)
    assert w.plan.last_forward.converged
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        assert rel_err(a, b) <= 1e-9, (i, rel_err(a, b), cfg)


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_long_sequence_float64_and_float32(kind):
    """T = 2000: float64 to 1e-10; float32 within the error the sequential float32 forward itself makes.

    Rounding errors enter every step and are carried forward by the products of the Jacobians: any
    float32 evaluation of the recurrence (the module's loop or the scan, which reassociates the
    same sums) is off the exact states by about ``eps * sum_t ||J_T..J_t||``. The Newton result
    adds the stopping tolerance (16 eps of the state's scale). So it is bounded by a small
    multiple of the sequential float32 error plus that tolerance, both against float64.
    """
    m64 = tame(make_module(kind, 3, 8, batch_first=False, bias=True, seed=3), 0.8)
    x, hx = make_inputs(m64, 2000, 2, with_h0=True, dtype=torch.float64, seed=4)
    out, state, info = newton_forward(m64, x, hx)
    with torch.no_grad():
        want = flat(*m64(x, hx))
    for a, b in zip(flat(out, state), want):
        assert rel_err(a, b) <= 1e-10, (rel_err(a, b), info)
    assert info.iterations <= 12, info  # a contractive recurrence: a handful, whatever T

    m32 = make_module(kind, 3, 8, batch_first=False, bias=True, dtype=torch.float32, seed=3)
    tame(m32, 0.8)
    x32 = x.float()
    hx32 = tuple(h.float() for h in hx) if isinstance(hx, tuple) else hx.float()
    out32, state32, info32 = newton_forward(m32, x32, hx32)
    with torch.no_grad():
        seq32 = flat(*m32(x32, hx32))
    eps = torch.finfo(torch.float32).eps
    for a, s, r in zip(flat(out32, state32), seq32, want):
        scale = r.abs().max().item()
        err_newton = (a.double() - r).abs().max().item()
        err_seq = (s.double() - r).abs().max().item()
        assert err_newton <= 4 * err_seq + 32 * eps * scale, (err_newton, err_seq, info32)


@pytest.mark.parametrize("kind", sorted(CELLS))
def test_long_sequence_gradients(kind):
    m = tame(make_module(kind, 2, 6, batch_first=True, bias=True, seed=5), 0.8)
    x, hx = make_inputs(m, 1000, 2, with_h0=True, dtype=torch.float64, seed=6)
    want = grads_of(m, m, x, hx, "both")
    w = wrap_recurrent(m, x, forward="newton")
    got = grads_of(w, m, x, hx, "both")
    assert w.plan.last_forward.converged
    ITERATIONS.append((kind, "newton", "torch.float64", 1000, w.plan.last_forward.iterations, "grad"))
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) <= 1e-9, (i, rel_err(a, b))


@pytest.mark.parametrize("kind", sorted(CELLS))
@pytest.mark.parametrize("damping", [0.0, 0.5])
def test_quasi_newton_and_damping_converge_to_the_same_states(kind, damping):
    m = tame(make_module(kind, 3, 8, batch_first=False, bias=True, seed=7), 0.7)
    x, hx = make_inputs(m, 120, 2, with_h0=True, dtype=torch.float64, seed=8)
    with torch.no_grad():
        want = flat(*m(x, hx))
    full = newton_forward(m, x, hx, newton={"damping": damping})
    quasi = newton_forward(m, x, hx, newton=NewtonOptions(method="quasi", damping=damping, max_iter=200))
    for out, state, info in (full, quasi):
        for a, b in zip(flat(out, state), want):
            assert rel_err(a, b) <= 1e-10, (rel_err(a, b), info)
    # quadratic vs linear convergence: the full Jacobian never needs more iterations here
    assert full[2].iterations <= quasi[2].iterations


def test_backward_reuses_the_converged_jacobians(monkeypatch):
    """A Newton forward builds the saved state itself: the sequential recompute path is never taken."""
    m = make_module("gru", 2, 5, batch_first=False, bias=True)
    x, hx = make_inputs(m, 30, 2, with_h0=True, dtype=torch.float64)
    want = grads_of(m, m, x, hx, "both")
    w = wrap_recurrent(m, x, forward="newton")

    def refuse(*a, **k):
        raise AssertionError("the Jacobians were recomputed after the Newton forward")

    monkeypatch.setattr(RecurrentPlan, "_save", refuse)
    got = grads_of(w, m, x, hx, "both")
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-9


def test_not_converged_falls_back_and_warns():
    """A budget too small for the recurrence: the sequential forward runs, the warning says how far it got."""
    m = make_module("rnn_tanh", 2, 6, batch_first=False, bias=True)
    x, hx = make_inputs(m, 60, 2, with_h0=False, dtype=torch.float64)
    p = plan_recurrent(m, x, forward="newton", newton={"max_iter": 2})
    with pytest.warns(NewtonNotConverged, match=r"budget after 2 iteration"):
        (out, h_n), _ = p.forward(x)
    with torch.no_grad():
        ref, ref_h = m(x)
    assert torch.equal(out, ref) and torch.equal(h_n, ref_h)  # the sequential forward's own result
    info = p.last_forward
    assert not info.converged and info.iterations == 2 and info.reason == "budget"

    # and through the wrapper: the gradients are still exact
    w = wrap_recurrent(m, x, forward="newton", newton={"max_iter": 2})
    want = grads_of(m, m, x, hx, "both")
    with pytest.warns(NewtonNotConverged):
        got = grads_of(w, m, x, hx, "both")
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-9


def test_chaotic_recurrence_does_not_converge_and_falls_back():
    """An expanding tanh RNN (spectral radius of W_hh about 4, chaotic): the linearization overshoots."""
    torch.manual_seed(0)
    m = nn.RNN(1, 16).double()
    with torch.no_grad():
        m.weight_hh_l0.copy_(4.0 * torch.randn(16, 16, dtype=torch.float64) / 16**0.5)
    x = torch.randn(400, 1, 1, dtype=torch.float64)
    p = plan_recurrent(m, x, forward="newton", newton={"max_iter": 30})
    with pytest.warns(NewtonNotConverged, match="did not converge"):
        (out, _), _ = p.forward(x)
    with torch.no_grad():
        ref = m(x)[0]
    assert torch.equal(out, ref)
    assert not p.last_forward.converged and p.last_forward.reason in ("budget", "non-finite", "ill-conditioned")
    assert p.last_forward.iterations <= 30


def test_ill_conditioned_recurrence_is_detected():
    """Chaotic at this length: the iteration converges (residual at rounding level) to states that differ
    from the sequential loop's, because rounding errors grow ~1e10-fold along the sequence. The
    amplification scan sees it; the sequential forward runs and the warning names the cause."""
    torch.manual_seed(0)
    m = nn.RNN(1, 16).double()
    with torch.no_grad():
        m.weight_hh_l0.copy_(3.0 * torch.randn(16, 16, dtype=torch.float64) / 16**0.5)
    x = torch.randn(150, 1, 1, dtype=torch.float64)
    p = plan_recurrent(m, x, forward="newton", newton={"max_iter": 151})
    with pytest.warns(NewtonNotConverged, match=r"ill-conditioned after \d+ iteration"):
        (out, _), _ = p.forward(x)
    with torch.no_grad():
        assert torch.equal(out, m(x)[0])
    info = p.last_forward
    assert info.reason == "ill-conditioned" and info.amplification > 1 / torch.finfo(torch.float64).eps ** 0.5
    # a milder one (shorter) passes the same check and equals the loop
    x = x[:60]
    out, _, info = newton_forward(m, x, None, newton={"max_iter": 61})
    with torch.no_grad():
        assert rel_err(out, m(x)[0]) <= 1e-10
    assert info.amplification is not None and info.amplification < 1 / torch.finfo(torch.float64).eps ** 0.5


@pytest.mark.parametrize("levels", [0, 2, "full"])
def test_forward_scan_uses_the_requested_depth(levels):
    m = make_module("lstm", 2, 4, batch_first=False, bias=True)
    x, hx = make_inputs(m, 37, 2, with_h0=True, dtype=torch.float64)
    p = plan_recurrent(m, x, forward="newton", levels=levels)
    fplan = p.newton.forward_plan(37, torch.device("cpu"), torch.float64)
    want_levels = fplan.max_levels if levels == "full" else min(levels, fplan.max_levels)
    assert fplan.levels == want_levels
    # the forward plan's patterns are the backward step's factors, transposed and in reverse order
    per = len(p.patterns) // 37  # elements per step (2 for the factored LSTM)
    assert per == 2 and len(fplan.patterns) == 2 * 37
    step = p.patterns[:per]
    fstep = fplan.patterns[:per]
    for a, b in zip(reversed(step), fstep):
        assert (abs(a.T) != abs(b)).nnz == 0 and a.shape[::-1] == b.shape
    out, state, _ = newton_forward(m, x, hx, levels=levels)
    with torch.no_grad():
        want = flat(*m(x, hx))
    for a, b in zip(flat(out, state), want):
        assert rel_err(a, b) <= 1e-10


@settings(max_examples=30)
@given(rows=st.integers(1, 9), cols=st.integers(1, 9), density=st.floats(0, 1), seed=st.integers(0, 1000))
def test_transpose_pattern_permutes_values(rows, cols, density, seed):
    rng = np.random.default_rng(seed)
    dense = (rng.random((rows, cols)) < density) * rng.standard_normal((rows, cols))
    p = sp.csr_array(dense)
    p.sort_indices()
    pt, perm = transpose_pattern(p)
    assert pt.has_canonical_format
    got = sp.csr_array((p.data[perm], pt.indices, pt.indptr), shape=pt.shape).toarray()
    np.testing.assert_array_equal(got, dense.T)


def test_wrapper_no_grad_path_auto_and_unbatched():
    m = make_module("lstm", 3, 5, batch_first=True, bias=True)
    x, hx = make_inputs(m, 40, 3, with_h0=True, dtype=torch.float64)
    w = spscan.wrap(m, x, forward="newton")
    with torch.no_grad():
        out, (h, c) = w(x, hx)
        ref, (rh, rc) = m(x, hx)
    assert w.plan.last_forward is not None and w.plan.last_forward.converged
    for a, b in ((out, ref), (h, rh), (c, rc)):
        assert rel_err(a, b) <= 1e-10
    # unbatched input through the plan
    xu = x[0]
    hu = (hx[0][:, 0], hx[1][:, 0])
    p = spscan.plan(m, xu, forward="newton")
    with torch.no_grad():
        (ou, (hn, cn)), _ = p.forward(xu, hu)
        ro, (rh, rc) = m(xu, hu)
    for a, b in ((ou, ro), (hn, rh), (cn, rc)):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-10
    # auto: whichever it picks, the result is the module's
    pa = spscan.plan(m, x, forward="auto")
    assert pa.forward_method(40, 3, "cpu", torch.float64) in ("sequential", "newton")
    with torch.no_grad():
        (oa, _), _ = pa.forward(x, hx)
    assert rel_err(oa, ref) <= 1e-10


def test_auto_follows_the_cost_model(monkeypatch):
    m = make_module("rnn_tanh", 2, 4, batch_first=False, bias=True)
    x, _ = make_inputs(m, 50, 2, with_h0=False, dtype=torch.float64)
    p = spscan.plan(m, x, forward="auto")
    est = p.newton.estimate(50, 2, "cpu", torch.float64, p.newton_options)
    assert est["sequential"] > 0 and est["newton"] > 0
    want = "newton" if est["newton"] < est["sequential"] else "sequential"
    assert p.forward_method(50, 2, "cpu", torch.float64) == want
    monkeypatch.setattr(type(p.newton), "estimate", lambda self, *a, **k: {"sequential": 1.0, "newton": 0.5})
    assert p.forward_method(50, 2, "cpu", torch.float64) == "newton"
    with torch.no_grad():
        p.forward(x)
    assert p.last_forward is not None and p.last_forward.converged
    monkeypatch.undo()


def test_auto_explains_the_iteration_count_it_assumed_then_measured():
    """The forward decision's explanation says how many iterations it costed and where the count came from:
    ``expected_iterations`` before any Newton forward, the last converged one's count after."""
    m = make_module("gru", 2, 4, batch_first=False, bias=True)
    x, _ = make_inputs(m, 40, 2, with_h0=False, dtype=torch.float64)
    p = spscan.plan(m, x, forward="auto", newton={"expected_iterations": 11})
    p.forward_method(40, 2, "cpu", torch.float64)
    assert "11 Newton iterations over the scan (assumed: NewtonOptions.expected_iterations" in \
        p.forward_decision.explain()
    _, _, info = newton_forward(m, x, None)
    p.last_forward = info
    p.forward_method(40, 2, "cpu", torch.float64)
    assert f"{info.iterations} Newton iterations over the scan (as the last Newton forward took (T 40, batch 2))" \
        in p.forward_decision.explain()


def test_bad_options_are_refused():
    m = make_module("gru", 2, 3, batch_first=False, bias=True)
    x, _ = make_inputs(m, 5, 1, with_h0=False, dtype=torch.float64)
    with pytest.raises(ValueError, match="forward: expected 'sequential', 'newton' or 'auto', got 'fast'"):
        spscan.plan(m, x, forward="fast")
    with pytest.raises(ValueError, match="newton method"):
        spscan.plan(m, x, forward="newton", newton={"method": "secant"})
    with pytest.raises(ValueError, match="unknown options"):
        spscan.plan(m, x, forward="newton", newton={"tol": 1e-3})
    with pytest.raises(ValueError, match="damping"):
        NewtonOptions(damping=-1.0)
    with pytest.raises(ValueError, match="max_iter"):
        NewtonOptions(max_iter=0)
    with pytest.raises(TypeError, match="newton: expected None, a dict"):
        spscan.plan(m, x, forward="newton", newton=3)
    with pytest.raises(spscan.NotPlannable, match="proj_size=0, got 2"):  # stacked modules take forward= per layer
        spscan.wrap(nn.LSTM(2, 3, num_layers=2, proj_size=2).double(), x, forward="newton", backward="scan")
    p = spscan.plan(m, x, forward="newton")
    with pytest.raises(TypeError, match="input: expected dtype torch.float64"):
        p.forward(x.float())


def test_triton_backend_forward_scan():
    """The forward-direction scan runs on the Triton kernels too (interpreter on CPU)."""
    m = make_module("rnn_tanh", 2, 3, batch_first=False, bias=True)
    x, hx = make_inputs(m, 6, 2, with_h0=True, dtype=torch.float64)
    out, state, _ = newton_forward(m, x, hx, backend="triton", levels=1)
    with torch.no_grad():
        want = flat(*m(x, hx))
    for a, b in zip(flat(out, state), want):
        assert rel_err(a, b) <= 1e-10


@pytest.mark.parametrize("kind", ["rnn_tanh", "gru"])
def test_triton_quasi_forward_runs_diagonals_per_lane(kind):
    """The quasi-Newton forward's scan is a run of per-sample diagonals: on the Triton backend it runs
    parallel over its steps per lane (the diagonal kernels), and converges to the sequential forward."""
    from spscan.kernels.triton import launch

    m = tame(make_module(kind, 2, 5, batch_first=False, bias=True), 0.5)
    x, hx = make_inputs(m, 70, 2, with_h0=True, dtype=torch.float64)
    with launch.recording(dry_run=False) as rec:
        out, state, info = newton_forward(m, x, hx, backend="triton", levels=0, newton={"method": "quasi"})
    assert info.method == "quasi"
    assert {"diag_chunk_kernel", "diag_carry_kernel"} <= {r.kernel for r in rec}
    with torch.no_grad():
        want = flat(*m(x, hx))
    for a, b in zip(flat(out, state), want):
        assert rel_err(a, b) <= 1e-10


def test_iteration_counts_were_recorded():
    """Runs last in this file: every Newton forward above left its iteration count (shown with -s)."""
    if not ITERATIONS:
        pytest.skip("run with the other tests of this file")
    for kind, method, dtype, T, iters, reason in ITERATIONS:
        assert iters >= (1 if T > 0 else 0) and reason
    longest = [r for r in ITERATIONS if r[3] >= 1000]
    print("\nNewton iterations (kind, method, dtype, T, iterations, stop):")
    for r in longest + ITERATIONS[:10]:
        print("  ", r)
