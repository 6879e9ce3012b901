"""The Newton forward's fused passes (spscan.kernels.triton.fixed_point, Cell.fused_step): each pass against the
torch cell it replaces, and whole Newton forwards on the Triton backend against the torch-op iteration and the
module: compiled on a CUDA device where there is one, else in Triton's interpreter on the CPU."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from test_recurrent import make_inputs, make_module, rel_err

import spscan
from spscan.kernels.triton import fixed_point, launch
from spscan.recurrent.cells import cell_named, module_params
from spscan.recurrent.newton import NewtonNotConverged, transpose_pattern
from spscan.runtime import PeriodicValues
from spscan.recurrent.plan import plan_recurrent

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
FUSED_KINDS = ["rnn_tanh", "rnn_relu", "gru", "lstm"]
EVALUATION = {"rnn_tanh": "activation_eval_kernel", "rnn_relu": "activation_eval_kernel",
              "gru": "reset_gated_eval_kernel", "lstm": "gated_cell_eval_kernel"}
PASSES = set(EVALUATION.values()) | {"update_kernel"}


def _on_dev(m, x, hx):
    """The module, input and initial state on the device the tests run on."""
    hx = None if hx is None else (tuple(h.to(DEV) for h in hx) if isinstance(hx, tuple) else hx.to(DEV))
    return m.to(DEV), x.to(DEV), hx


def _newton(m, x, hx, backend, **kw):
    p = plan_recurrent(m, x, forward="newton", backend=backend, levels=0, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NewtonNotConverged)
        with torch.no_grad(), launch.recording(dry_run=False) as rec:
            outputs, saved = p.run_forward(x, hx)
    return outputs, saved, p.last_forward, Counter(r.kernel for r in rec)


def _flat(outputs) -> list[torch.Tensor]:
    out, state = outputs
    return [out] + (list(state) if isinstance(state, tuple) else [state])


def _loss(out, state) -> torch.Tensor:
    """A loss on every output and on the final state (both parts of an LSTM's)."""
    return out.pow(2).sum() + sum(part.sum() for part in (state if isinstance(state, tuple) else (state,)))


def _tame(m, scale=0.7):
    with torch.no_grad():
        for q in m.parameters():
            q.mul_(scale)
    return m


# --------------------------------------------------------------------------- one evaluation pass


def _guess(kind, T, B, H, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    m = make_module(kind, 3, H, batch_first=False, bias=bias).to(dtype)
    params = [q.detach() for q in module_params(m)]
    x = torch.randn(T, B, 3, generator=g, dtype=dtype)
    D = cell_named(kind).state_size(H)
    states = torch.randn(T + 1, B, D, generator=g, dtype=dtype) * 0.8  # s_0 and an arbitrary guess
    gi = torch.addmm(params[2], x.reshape(T * B, 3), params[0].t()).view(T, B, -1) if bias else x @ params[0].t()
    return [q.to(DEV) for q in params], gi.to(DEV), states.to(DEV)


@pytest.mark.parametrize("kind", FUSED_KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,B,H,bias", [(9, 3, 5, True), (1, 1, 1, False), (4, 2, 17, False), (33, 1, 2, True)])
def test_fused_step_matches_the_cell(kind, dtype, T, B, H, bias):
    """f, every coefficient and the step's values as :meth:`Cell.step` gives them; the residual and the scaled
    per-sample factor last step first; the maxima; odd sizes, T = B = H = 1."""
    cell = cell_named(kind)
    params, gi, states = _guess(kind, T, B, H, dtype, bias=bias)
    maxima = fixed_point.maxima_buffer(dtype, DEV)
    scale = torch.full((1,), 0.625, dtype=dtype, device=DEV)
    ev = cell.fused_step(gi, states, params, H, {}, maxima, scale)
    f, coefs = cell.step(gi, states[:-1], params, H)
    tol = 1e-13 if dtype == torch.float64 else 2e-5
    assert (ev.f - f).abs().max() <= tol
    assert set(ev.coefs) == set(coefs)
    for k in coefs:
        assert (ev.coefs[k] - coefs[k]).abs().max() <= tol, k
    want_values = cell.factored_values(coefs, params[1], H)
    got_values = PeriodicValues(ev.values, T, ev.encodings)  # the LSTM's gate element as its compact numbers
    assert len(ev.values) == len(want_values)
    for k, b in enumerate(want_values):
        a = got_values.expanded(k)
        assert a.shape == b.shape and (a - b).abs().max() <= tol
    # the per-sample element transposed (its values in the transposed pattern's order), scaled, last step first
    j = next(k for k, b in enumerate(want_values) if b.dim() == 3)
    _, perm = transpose_pattern(cell.factored_patterns(H)[j])
    want_rv = (got_values.expanded(j)[..., torch.as_tensor(perm, device=DEV)] * 0.625).flip(0)
    assert (ev.reversed_factor - want_rv).abs().max() <= (0 if kind != "lstm" else tol)  # the LSTM's: products
    assert torch.equal(ev.reversed_residual, (ev.f - states[1:]).flip(0))
    got = maxima.tolist()
    assert got[0] == ev.f.abs().max().item() and got[1] == ev.reversed_residual.abs().max().item() and got[2] == 0


def test_fused_step_buffers_are_reused_and_maxima_merge():
    """A second evaluation writes the same buffers (no new allocation per iteration); maxima merge with what the
    buffer held (the caller zeroes it per iteration)."""
    cell = cell_named("gru")
    params, gi, states = _guess("gru", 6, 2, 4, torch.float64)
    buffers: dict = {}
    maxima = fixed_point.maxima_buffer(torch.float64, DEV)
    scale = torch.ones(1, dtype=torch.float64, device=DEV)
    first = cell.fused_step(gi, states, params, 4, buffers, maxima, scale)
    ptrs = {k: v.data_ptr() for k, v in buffers.items()}
    maxima.fill_(100.0)
    second = cell.fused_step(gi, states, params, 4, buffers, maxima, scale)
    assert {k: v.data_ptr() for k, v in buffers.items()} == ptrs and second.f.data_ptr() == first.f.data_ptr()
    assert maxima[:2].tolist() == [100.0, 100.0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_maxima_carry_non_finite_values(dtype):
    """A NaN or an infinity in an update reaches the maxima (the bits of NaN order above infinity's): the
    iteration sees a non-finite update and falls back. A NaN pre-activation gives a NaN state under either
    activation, as torch's, and the maxima see every non-finite state."""
    T, B, H = 5, 2, 3
    s = torch.zeros(T, B, H, dtype=dtype, device=DEV)
    for bad in (float("nan"), float("inf"), -float("inf")):
        d = torch.randn(T, B, H, dtype=dtype, device=DEV)
        d[3, 1, 2] = bad
        maxima = fixed_point.maxima_buffer(dtype, s.device)
        fixed_point.update(d, s.clone(), maxima)
        got = maxima[2].item()
        assert (got != got) if bad != bad else got == float("inf")
        for relu in (False, True):
            a = torch.randn(T, B, H, dtype=dtype, device=DEV)
            a[0, 0, 0] = bad
            maxima.zero_()
            f, d_, rv, rr = (torch.empty_like(a) for _ in range(4))
            fixed_point.activation_eval(a, s, f, d_, rv, rr, maxima, torch.ones(1, dtype=dtype, device=DEV), relu=relu)
            act = torch.relu(a) if relu else torch.tanh(a)
            assert torch.equal(f.isnan(), act.isnan())
            assert bool(torch.isfinite(maxima[:2]).all()) == bool(act.isfinite().all())


def test_update_reads_any_strides_last_step_first():
    T, B, H = 7, 3, 4
    base = torch.randn(B, 2 * T, H, dtype=torch.float64, device=DEV)
    d = base.transpose(0, 1)[::2]  # (T, B, H), not contiguous
    s = torch.randn(T, B, H, dtype=torch.float64, device=DEV)
    want = s + d.flip(0)
    maxima = fixed_point.maxima_buffer(torch.float64, s.device)
    fixed_point.update(d, s, maxima)
    assert torch.equal(s, want)
    assert maxima[2].item() == d.abs().max().item() and maxima[:2].tolist() == [0.0, 0.0]


def test_passes_write_strided_scan_inputs():
    """The reversed factor and residual go to any views with a unit last stride (a scan's input arenas): the
    same entries as into contiguous buffers, nothing else touched."""
    T, B, H = 5, 3, 4
    cell = cell_named("gru")
    params, gi, states = _guess("gru", T, B, H, torch.float64)
    scale = torch.full((1,), 0.5, dtype=torch.float64, device=DEV)
    plain = cell.fused_step(gi, states, params, H, {}, fixed_point.maxima_buffer(torch.float64, DEV), scale)
    arena = torch.full((B, 2 + T * 9 * H), -7.0, dtype=torch.float64, device=DEV)  # a gap, then T blocks of 9H
    block = arena[:, 2:].view(B, T, 9 * H)
    seeded = {"rv": block[..., H:5 * H].transpose(0, 1), "rr": block[..., 6 * H:7 * H].transpose(0, 1)}
    got = cell.fused_step(gi, states, params, H, seeded, fixed_point.maxima_buffer(torch.float64, DEV), scale)
    assert got.reversed_factor is seeded["rv"] and got.reversed_residual is seeded["rr"]
    assert torch.equal(seeded["rv"], plain.reversed_factor) and torch.equal(seeded["rr"], plain.reversed_residual)
    untouched = torch.ones_like(arena, dtype=torch.bool)
    untouched[:, 2:].view(B, T, 9 * H)[..., H:5 * H] = False
    untouched[:, 2:].view(B, T, 9 * H)[..., 6 * H:7 * H] = False
    assert (arena[untouched] == -7.0).all()


def test_passes_refuse_bad_buffers():
    T, B, H = 3, 2, 4
    z = lambda *shape, dtype=torch.float64: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    maxima, one = fixed_point.maxima_buffer(torch.float64, "cpu"), z(1)
    with pytest.raises(ValueError, match=r"rr: expected a torch.float64 tensor of shape \(3, 2, 4\) on cpu, with unit"):
        fixed_point.activation_eval(z(T, B, H), z(T, B, H), z(T, B, H), z(T, B, H), z(T, B, H), z(T, B, 5), maxima,
                                    one, relu=False)
    with pytest.raises(ValueError, match=r"s: expected .* contiguous; got \(3, 2, 4\) .* strides \(8, 1, 2\)"):
        fixed_point.activation_eval(z(T, B, H), z(T, H, B).transpose(1, 2), z(T, B, H), z(T, B, H), z(T, B, H),
                                    z(T, B, H), maxima, one, relu=False)
    with pytest.raises(ValueError, match="rv: .* unit stride in its last dimension"):
        fixed_point.activation_eval(z(T, B, H), z(T, B, H), z(T, B, H), z(T, B, H), z(T, H, B).transpose(1, 2),
                                    z(T, B, H), maxima, one, relu=False)
    with pytest.raises(ValueError, match=r"a: expected \(T, B, W\) pre-activations"):
        fixed_point.activation_eval(z(T, B * H), z(T, B * H), z(T, B * H), z(T, B * H), z(T, B * H), z(T, B * H),
                                    maxima, one, relu=False)
    with pytest.raises(ValueError, match=r"gh: expected .* shape \(3, 2, 12\)"):
        fixed_point.reset_gated_eval(z(T, B, 3 * H), z(T, B, 4 * H), z(T + 1, B, H), z(T, B, H), z(T, B, 4 * H),
                                     z(T, B, H), z(T, B, 4 * H), z(T, B, H), maxima, one)
    with pytest.raises(ValueError, match="update: expected a 3-d torch.float64 update"):
        fixed_point.update(z(T, B, H, dtype=torch.float32), z(T, B, H), maxima)
    with pytest.raises(TypeError, match="expected float32 or float64"):
        fixed_point.update(z(T, B, H), z(T, B, H), torch.zeros(3, dtype=torch.int64))


# --------------------------------------------------------------------------- whole Newton forwards


@pytest.mark.parametrize("kind", FUSED_KINDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_newton_forward_iterates_as_the_torch_loop(kind, dtype, bias):
    """On the Triton backend the cell is evaluated by the fused passes: the same iteration count and stopping
    reason as the torch-op loop, the module's outputs, and what the backward reuses."""
    m = _tame(make_module(kind, 3, 5, batch_first=False, bias=bias)).to(dtype)
    m, x, hx = _on_dev(m, *make_inputs(m, 24, 3, with_h0=True, dtype=dtype))
    got, saved, info, kernels = _newton(m, x, hx, "triton")
    ref, ref_saved, ref_info, ref_kernels = _newton(m, x, hx, "torch")
    assert (info.iterations, info.reason) == (ref_info.iterations, ref_info.reason) and info.converged
    # one evaluation per iteration and the one that confirms the result, one update per iteration: the next
    # evaluation is queued before the host reads an update's maxima, and none is wasted
    evaluation = EVALUATION[kind]
    assert kernels[evaluation] == info.iterations + 1 and kernels["update_kernel"] == info.iterations
    assert set(kernels) & PASSES == {evaluation, "update_kernel"} and not set(ref_kernels) & PASSES
    with torch.no_grad():
        want = _flat(m(x, hx))
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for a, b in zip(_flat(got), want):
        assert rel_err(a, b) <= tol
    for k in ref_saved.coefs:
        assert rel_err(saved.coefs[k], ref_saved.coefs[k]) <= 10 * tol, k
    for a, b in zip(saved.values, ref_saved.values):
        assert rel_err(a, b) <= 10 * tol


@pytest.mark.parametrize("kind", ["rnn_tanh", "gru", "lstm"])
def test_fused_newton_writes_the_scan_inputs_in_place(kind, monkeypatch):
    """The evaluation pass writes the forward scan's per-sample values and residual into the scan's own buffers:
    no iteration loads values or terms into them (on a GPU each load is a pass over the whole sequence)."""
    import spscan.runtime.bound as bound_mod

    loads = []
    real_load, real_feed = bound_mod._load_periodic, bound_mod.Feed
    monkeypatch.setattr(bound_mod, "_load_periodic", lambda *a, **k: loads.append("values") or real_load(*a, **k))
    monkeypatch.setattr(bound_mod, "Feed", lambda *a, **k: loads.append("extra") or real_feed(*a, **k))
    m = _tame(make_module(kind, 2, 4, batch_first=False, bias=True))
    m, x, hx = _on_dev(m, *make_inputs(m, 30, 2, with_h0=True, dtype=torch.float64))
    _, _, info, kernels = _newton(m, x, hx, "triton")
    assert info.iterations >= 2 and info.amplification is None and set(kernels) & PASSES and not loads


@pytest.mark.parametrize("kind", ["rnn_tanh", "gru", "lstm"])
def test_fused_newton_gradients_match_autograd(kind):
    """A wrapped module with the Newton forward on the Triton backend: loss.backward() fills every gradient as
    autograd does (the backward reuses the fused pass's coefficients and values), twice, batch size changing."""
    torch.manual_seed(3)
    m = _tame(make_module(kind, 2, 4, batch_first=True, bias=True)).to(DEV)
    ref = make_module(kind, 2, 4, batch_first=True, bias=True).to(DEV)
    ref.load_state_dict(m.state_dict())
    x0, _ = make_inputs(m, 16, 2, with_h0=False, dtype=torch.float64)
    w = spscan.wrap(m, x0.to(DEV), forward="newton", backend="triton", levels=0, backward="scan")
    for B in (2, 1):
        x = torch.randn(B, 16, 2, dtype=torch.float64, device=DEV, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", NewtonNotConverged)
            out, state = w(x)
        _loss(out, state).backward()
        _loss(*ref(xr)).backward()
        assert rel_err(x.grad, xr.grad) <= 1e-10
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            assert rel_err(p.grad, q.grad) <= 1e-10, name
            p.grad = None
            q.grad = None


def test_fused_newton_damped_and_single_step():
    """Damping scales the per-sample factor inside the pass (the same iterates as the torch loop); T = 1 and
    B = 1 solve in one iteration."""
    m = _tame(make_module("gru", 2, 3, batch_first=False, bias=True), 0.9)
    m, x, hx = _on_dev(m, *make_inputs(m, 12, 2, with_h0=True, dtype=torch.float64))
    opts = {"damping": 0.5}
    got, _, info, kernels = _newton(m, x, hx, "triton", newton=opts)
    _, _, ref_info, _ = _newton(m, x, hx, "torch", newton=opts)
    assert "reset_gated_eval_kernel" in kernels
    assert info.iterations == ref_info.iterations and info.deltas == pytest.approx(ref_info.deltas, rel=1e-9)
    with torch.no_grad():
        want = _flat(m(x, hx))
    assert all(rel_err(a, b) <= 1e-12 for a, b in zip(_flat(got), want))
    _, x1, hx1 = _on_dev(m, *make_inputs(m, 1, 1, with_h0=True, dtype=torch.float64))
    got1, _, info1, _ = _newton(m, x1, hx1, "triton")
    with torch.no_grad():
        want1 = _flat(m(x1, hx1))
    assert info1.iterations == 1 and all(rel_err(a, b) <= 1e-14 for a, b in zip(_flat(got1), want1))


def test_materialized_and_quasi_keep_the_torch_evaluation():
    """The materialized layout and the quasi method evaluate with torch ops on the Triton backend (their scans
    take other values than the fused passes write)."""
    m = _tame(make_module("lstm", 2, 3, batch_first=False, bias=True))
    m, x, hx = _on_dev(m, *make_inputs(m, 20, 2, with_h0=True, dtype=torch.float64))
    _, _, info, kernels = _newton(m, x, hx, "triton", layout="materialized")
    assert info.converged and not set(kernels) & PASSES
    m = _tame(make_module("rnn_tanh", 2, 3, batch_first=False, bias=True), 0.5)
    m, x, hx = _on_dev(m, *make_inputs(m, 20, 2, with_h0=True, dtype=torch.float64))
    _, _, info, kernels = _newton(m, x, hx, "triton", newton={"method": "quasi"})
    assert info.method == "quasi" and not set(kernels) & PASSES
