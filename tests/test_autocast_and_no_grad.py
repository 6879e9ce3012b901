"""A wrapped model under ``torch.autocast`` (mixed precision) and with nothing to differentiate (``torch.no_grad``,
``torch.inference_mode``, a frozen model).

* ``backward="auto"`` under autocast runs the model's own forward and backward: outputs and gradients are
  autograd's under autocast, bit for bit (the scan computes in the module's float32/float64, and used to fail
  with a dtype mismatch there).
* A forced ``scan`` or ``graph`` under autocast runs as a custom function without reduced-precision support
  does (``torch.amp.custom_fwd(cast_inputs=...)``): autocast off, the inputs cast to the module's dtype. Its
  results are the wrapped module's own on the cast input, and the gradient flows back into a reduced-precision
  producer.
* With gradients off, or nothing that needs one, a model wrapper runs the model's own forward (nothing is
  recorded, so nothing of the scan's forward is needed); a recurrent wrapper runs its plan's forward without
  saving (the module's own, or Newton's where chosen).

CPU autocast (bfloat16) runs everywhere; the GPU's (float16, with the whole-step CUDA graph) is the same code.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spscan
from spscan.runtime.graphed import GraphedCall, GraphedStep
from wrapper_models import MODELS as ALL_MODELS, output


def fake_record(fn, device):
    """A stand-in for ``torch.cuda.graph`` (as in ``test_graphed.py``): a replay runs the recorded call again."""
    return fn, None


MODELS = {k: ALL_MODELS[k] for k in ("chain", "cnn", "residual", "rnn", "stacked_gru", "lstm")}


_out = output


def _loss(y):
    return _out(y).float().square().sum()


def _pair(name, backward):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    x = torch.randn(4, *shape)
    return model, ref, spscan.wrap(model, x, backward=backward), shape


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


def _skip_without_bf16_kernels(model, shape):
    """Skip where the model itself cannot run under bfloat16 autocast on this CPU (oneDNN builds without a
    bfloat16 LSTM: plain ``nn.LSTM`` fails the same way there, so there is nothing to compare with)."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(2, *shape))
    except RuntimeError as e:
        pytest.skip(f"{type(model).__name__} does not run under bfloat16 autocast on this CPU: "
                    f"{str(e).splitlines()[0][:120]}")


@pytest.mark.parametrize("name", list(MODELS))
def test_auto_under_autocast_is_the_models_own_step(name, monkeypatch):
    """Where ``auto`` would run the scan, a call under autocast runs the model's own step instead: every
    output and gradient equal autograd's under autocast; outside autocast the scan runs again."""
    model, ref, w, shape = _pair(name, "auto")
    _skip_without_bf16_kernels(copy.deepcopy(ref), shape)
    monkeypatch.setattr(w, "_choice", lambda key: "scan")  # as if the profile chose the scan
    assert "under torch.autocast or a torch.func transform: native" in w.explain()
    ran = []
    monkeypatch.setattr(w.plan, "run_step" if hasattr(w.plan, "units") else "run_forward",
                        lambda *a, **k: ran.append(1) or pytest.fail("the scan ran under autocast"))
    for batch in (4, 3):
        x = torch.randn(batch, *shape)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ya, yb = w(xa), ref(xb)
        assert _out(ya).dtype == _out(yb).dtype
        assert torch.equal(_out(ya), _out(yb))
        _loss(ya).backward()
        _loss(yb).backward()
        assert torch.equal(xa.grad, xb.grad)
        for a, b in zip(_grads(model), _grads(ref)):
            assert torch.equal(a, b)
    assert not ran


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("backward", ["scan", "graph"])
def test_forced_scan_under_autocast_computes_in_the_modules_dtype(name, backward, monkeypatch):
    """A forced scan (or whole-step graph, here with the stand-in recorder) under autocast: its input comes
    from a bfloat16 producer; the wrapped module computes in float32 on that input cast up, and the producer
    gets its gradient back in bfloat16. Equal, bit for bit, to the same steps with the cast written out and
    autocast off around the wrapped module."""
    model, ref, w, shape = _pair(name, "scan")
    if backward == "graph":
        monkeypatch.setattr(w, "_choice", lambda key: "graph")
        if hasattr(w.plan, "units"):
            w.plan._graphed = GraphedCall(fake_record)
        w.plan.step_graphs = GraphedStep(w.plan, fake_record)
    w_ref = spscan.wrap(ref, torch.randn(4, *shape), backward="scan")
    torch.manual_seed(1)
    producer = nn.Linear(shape[-1], shape[-1])
    producer_ref = copy.deepcopy(producer)
    for batch in (4, 4, 4, 3, 3, 3):
        x = torch.randn(batch, *shape)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = producer(x)
            assert h.dtype == torch.bfloat16
            y = w(h)
            h_ref = producer_ref(x)
        y_ref = w_ref(h_ref.float())
        assert _out(y).dtype == torch.float32
        assert torch.equal(_out(y), _out(y_ref))
        _loss(y).backward()
        _loss(y_ref).backward()
        for a, b in zip(_grads(model) + _grads(producer), _grads(ref) + _grads(producer_ref)):
            assert torch.equal(a, b)
    if backward == "graph":
        assert w.plan.step_graphs.entries  # the step was recorded: autocast is off inside


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "frozen"])
def test_nothing_to_differentiate_runs_the_forward_alone(name, mode, monkeypatch):
    """With gradients off (or no input or parameter needing one) a wrapper returns the model's own outputs,
    bit for bit, without recording the scan's forward; a training step afterwards is autograd's."""
    model, ref, w, shape = _pair(name, "scan")
    recurrent = not hasattr(w.plan, "units")
    x = torch.randn(3, *shape)
    if not recurrent:  # the model's own forward: the scan's step must not run
        monkeypatch.setattr(w.plan, "run_step", lambda *a, **k: pytest.fail("the scan's step ran"))
    if mode == "frozen":
        for p in (*model.parameters(), *ref.parameters()):
            p.requires_grad_(False)
        ya, yb = w(x), ref(x)
        assert _out(ya).grad_fn is None
    else:
        ctx = torch.no_grad if mode == "no_grad" else torch.inference_mode
        with ctx():
            ya, yb = w(x), ref(x)
    assert torch.equal(_out(ya), _out(yb)) if not recurrent else torch.allclose(_out(ya), _out(yb), atol=1e-6)
    monkeypatch.undo()
    for p in (*model.parameters(), *ref.parameters()):
        p.requires_grad_(True)
    _loss(w(x)).backward()
    _loss(ref(x)).backward()
    for a, b in zip(_grads(model), _grads(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- on a GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", ["cnn", "residual", "stacked_gru"])
@pytest.mark.gpu
@gpu
def test_cuda_autocast_float16_auto_and_forced_graph(name, monkeypatch):
    """On a GPU, AMP as people write it (float16 autocast): ``auto`` is autograd's step bit for bit; a forced
    ``graph`` records its whole step with autocast off inside and equals the same recorded step run on the
    cast input without autocast (cuDNN's deterministic algorithms)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().cuda()
    ref = copy.deepcopy(model)
    auto = spscan.wrap(model, torch.randn(4, *shape, device="cuda"), backward="auto")
    monkeypatch.setattr(auto, "_choice", lambda key: "graph")  # what auto runs outside autocast
    for _ in range(3):
        x = torch.randn(4, *shape, device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            ya, yb = auto(x), ref(x)
        assert torch.equal(_out(ya), _out(yb))
        _loss(ya).backward()
        _loss(yb).backward()
        for a, b in zip(_grads(model), _grads(ref)):
            assert torch.equal(a, b)
    forced = spscan.wrap(model, torch.randn(4, *shape, device="cuda"), backward="graph")
    plain = spscan.wrap(ref, torch.randn(4, *shape, device="cuda"), backward="graph")
    for _ in range(4):
        x = torch.randn(4, *shape, device="cuda", dtype=torch.float16)
        with torch.autocast("cuda", dtype=torch.float16):
            y = forced(x)
        y_ref = plain(x.float())
        assert _out(y).dtype == torch.float32 and torch.equal(_out(y), _out(y_ref))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
        _loss(y).backward()
        _loss(y_ref).backward()
        for a, b in zip(_grads(model), _grads(ref)):
            assert torch.equal(a, b)
    assert forced.plan.step_graphs.entries


@pytest.mark.parametrize("name", ["cnn", "residual", "rnn", "stacked_gru", "lstm"])
@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.gpu
@gpu
def test_cuda_wrapped_on_the_cpu_then_moved(name, backward):
    """The order people write: wrap with a CPU example batch, then ``.cuda()`` the wrapper (or the model):
    float64 gradients on the GPU equal autograd's there."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model).cuda()
    w = spscan.wrap(model, torch.randn(4, *shape, dtype=torch.float64), backward=backward).cuda()
    for batch in (4, 3):
        x = torch.randn(batch, *shape, dtype=torch.float64, device="cuda")
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = w(xa), ref(xb)
        _loss(ya).backward()
        _loss(yb).backward()
        assert float((_out(ya) - _out(yb)).abs().max()) <= 1e-12 * max(1.0, float(_out(yb).abs().max()))
        for a, b in zip([xa.grad, *_grads(model)], [xb.grad, *_grads(ref)]):
            assert float((a - b).abs().max()) <= 1e-9 * max(1.0, float(b.abs().max()))
        for m in (model, ref):
            m.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", ["chain", "cnn", "residual"])  # (vmap cannot batch nn.RNN itself)
def test_auto_inside_torch_func_is_the_models_own_step(name, monkeypatch):
    """Per-sample gradients the torch.func way (``vmap(grad(functional_call))``) through a wrapper whose
    ``auto`` would run the scan: the model's own step runs, and the gradients are those of the model alone.
    A forced scan is refused there, saying why."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    w = spscan.wrap(model, torch.randn(4, *shape, dtype=torch.float64), backward="auto")
    monkeypatch.setattr(w, "_choice", lambda key: "scan")
    inner = "model." if hasattr(w, "model") else "module."
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(module, prefix):
        def f(p, x):
            return output(torch.func.functional_call(module, {prefix + k: v for k, v in p.items()},
                                                     (x.unsqueeze(0),))).square().sum()
        return f

    x = torch.randn(3, *shape, dtype=torch.float64)
    got = torch.func.vmap(torch.func.grad(loss(w, inner)), in_dims=(None, 0))(params, x)
    want = torch.func.vmap(torch.func.grad(loss(model, "")), in_dims=(None, 0))(params, x)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    forced = spscan.wrap(make().double(), torch.randn(4, *shape, dtype=torch.float64), backward="scan")
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.grad(loss(forced, inner))({k: v for k, v in params.items()}, x[0])


@pytest.mark.parametrize("make", [lambda: nn.GRU(3, 4), lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True)],
                         ids=["gru", "stacked_bidirectional_lstm"])
def test_auto_with_packed_sequences_is_the_modules_own_step(make):
    """Variable-length batches as ``nn.utils.rnn.pack_padded_sequence`` makes them: ``auto`` runs the module's
    own step on them (its padded batches still go through its decision); a forced scan says to pad instead."""
    torch.manual_seed(0)
    module = make().double()
    ref = copy.deepcopy(module)
    w = spscan.wrap(module, torch.randn(6, 3, 3, dtype=torch.float64), backward="auto")
    x = torch.randn(6, 3, 3, dtype=torch.float64)
    packed = nn.utils.rnn.pack_padded_sequence(x, [6, 4, 2])
    out, ref_out = w(packed)[0], ref(packed)[0]
    assert torch.equal(out.data, ref_out.data)
    out.data.square().sum().backward()
    ref_out.data.square().sum().backward()
    for p, q in zip(module.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
    forced = spscan.wrap(make().double(), torch.randn(6, 3, 3, dtype=torch.float64), backward="scan")
    with pytest.raises(TypeError, match="PackedSequence"):
        forced(packed)


def test_forced_scan_under_autocast_of_a_model_without_parameters():
    """Nothing to cast to: the inputs keep their dtype."""
    w = spscan.wrap(nn.Sequential(nn.Tanh(), nn.ReLU()), torch.randn(3, 4), backward="scan")
    x = torch.randn(3, 4, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = w(x)
    y.sum().backward()
    ref = x.detach().clone().requires_grad_()
    torch.relu(torch.tanh(ref)).sum().backward()
    assert y.dtype == torch.float32 and torch.equal(x.grad, ref.grad)
