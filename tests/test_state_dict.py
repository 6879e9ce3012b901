"""A wrapper's ``state_dict`` is the wrapped model's, key for key (:class:`spscan.runtime.model_keys.ModelKeys`): a checkpoint
saved before wrapping loads into the wrapper, one saved from the wrapper loads into the unwrapped model, also
where the wrapper is a submodule of the user's model (``model.rnn = spscan.wrap(model.rnn)``); strict mode's
reports name the model's keys; pickling, ``copy.deepcopy`` and ``torch.distributed.checkpoint`` keep working;
``parameters()`` are the model's own objects (``named_parameters()`` keeps the module tree's names)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spscan
from spscan.runtime.choices import NativeModule
from spscan.graph.plan import GraphSpscanModule
from spscan.chain.wrapper import SpscanModule
from spscan.recurrent.wrapper import RecurrentWrapper


class Residual(nn.Module):
    """A traced model with a skip and a BatchNorm (buffers, version metadata)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)

    def forward(self, x):
        return self.b(F.gelu(self.bn(self.a(x))) + x)


class Branchy(nn.Module):
    """Data-dependent control flow: fx cannot trace it, ``backward="auto"`` wraps it as a NativeModule."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(5, 5), nn.BatchNorm1d(5)

    def forward(self, x):
        y = self.bn(self.fc(x))
        return y.relu() if y.sum() > 0 else y.tanh()


#: name -> (make the model, an example input, the wrapper class spscan.wrap makes)
MODELS = {
    "chain": (lambda: nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)),
              lambda: torch.randn(4, 6, dtype=torch.float64), SpscanModule),
    "traced": (Residual, lambda: torch.randn(4, 6, dtype=torch.float64), GraphSpscanModule),
    "gru": (lambda: nn.GRU(3, 4), lambda: torch.randn(5, 2, 3, dtype=torch.float64), RecurrentWrapper),
    "stacked_bidirectional_lstm": (lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True),
                                   lambda: torch.randn(5, 2, 3, dtype=torch.float64), RecurrentWrapper),
    "native": (Branchy, lambda: torch.randn(4, 5, dtype=torch.float64), NativeModule),
}


def _make(name, seed):
    make, example, cls = MODELS[name]
    torch.manual_seed(seed)
    model = make().double()
    for t in model.state_dict().values():  # buffers too: a load must be seen to change them
        if t.is_floating_point():
            t.copy_(torch.randn_like(t))
    return model, example(), cls


def _wrap(model, x, cls):
    backward = "auto" if cls is NativeModule else "scan"
    if cls is NativeModule:
        with pytest.warns(UserWarning, match="autograd's own backward"):
            return spscan.wrap(model, x, backward=backward)
    return spscan.wrap(model, x, backward=backward)


def _same(a, b):
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _out(y):
    return y[0] if isinstance(y, tuple) else y


def _step_grads(module, params, x):
    """The input's and the parameters' gradients of one step (train mode)."""
    xi = x.clone().requires_grad_(True)
    for p in params:
        p.grad = None
    _out(module(xi)).square().sum().backward()
    return [xi.grad] + [p.grad for p in params]


@pytest.mark.parametrize("name", list(MODELS))
def test_keys_and_metadata_are_the_models(name):
    model, x, cls = _make(name, 0)
    before = model.state_dict()
    w = _wrap(model, x, cls)
    assert type(w) is cls
    after = w.state_dict()
    _same(after, before)
    assert list(after._metadata.items()) == list(before._metadata.items())  # versions (BatchNorm's 2) too
    kept = w.state_dict(keep_vars=True)
    assert all(kept[n] is p for n, p in model.named_parameters())
    assert list(w.state_dict(prefix="net.")) == ["net." + k for k in before]


@pytest.mark.parametrize("name", list(MODELS))
def test_a_checkpoint_loads_before_and_after_wrapping(name):
    """Saved before wrapping -> loaded into the wrapper (strict); saved from the wrapper -> loaded into the
    unwrapped model; the wrapper then trains as the checkpoint's model does under autograd."""
    model, x, cls = _make(name, 0)
    w = _wrap(model, x, cls)
    src, _, _ = _make(name, 1)
    ckpt = io.BytesIO()
    torch.save(src.state_dict(), ckpt)
    ckpt.seek(0)
    assert not torch.equal(next(iter(model.state_dict().values())), next(iter(src.state_dict().values())))
    result = w.load_state_dict(torch.load(ckpt))
    assert result.missing_keys == [] and result.unexpected_keys == []
    _same(w.state_dict(), src.state_dict())
    _same(model.state_dict(), src.state_dict())
    ref = copy.deepcopy(src)
    for g, want in zip(_step_grads(w, list(model.parameters()), x), _step_grads(ref, list(ref.parameters()), x)):
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12)
    # the other way: the wrapper's checkpoint into a fresh unwrapped model
    fresh, _, _ = _make(name, 2)
    buf = io.BytesIO()
    torch.save(w.state_dict(), buf)
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf))
    _same(fresh.state_dict(), w.state_dict())


def _load_error(module, sd) -> str:
    with pytest.raises(RuntimeError) as info:
        module.load_state_dict(sd)
    return str(info.value).split("\n", 1)[1]  # after "Error(s) in loading state_dict for <class>:"


@pytest.mark.parametrize("name", list(MODELS))
def test_strict_errors_name_the_models_keys(name):
    """Missing, unexpected and size-mismatched keys are reported as the unwrapped model reports them."""
    model, x, cls = _make(name, 0)
    unwrapped = copy.deepcopy(model)
    w = _wrap(model, x, cls)
    good = model.state_dict()
    first, last = list(good)[0], [k for k in good if not k.endswith("num_batches_tracked")][-1]
    sd = dict(good)
    del sd[last]
    sd["not_a_key"] = torch.zeros(1)
    sd[first] = torch.zeros(1, 1, 7)
    msg = _load_error(w, sd)
    assert msg == _load_error(unwrapped, sd)
    assert f'Missing key(s) in state_dict: "{last}"' in msg
    assert 'Unexpected key(s) in state_dict: "not_a_key"' in msg
    assert f"size mismatch for {first}:" in msg
    assert "model." not in msg and "module." not in msg
    del sd[first]
    got = w.load_state_dict(sd, strict=False)
    assert got.missing_keys == [first, last] and got.unexpected_keys == ["not_a_key"]
    assert got == unwrapped.load_state_dict(sd, strict=False)


class Net(nn.Module):
    """A user's model with a recurrent layer and a chain inside."""

    def __init__(self, bidirectional: bool = True) -> None:
        super().__init__()
        self.rnn = nn.GRU(3, 4, num_layers=2, bidirectional=bidirectional)
        self.head = nn.Sequential(nn.Linear(8 if bidirectional else 4, 5), nn.Tanh(), nn.Linear(5, 2))

    def forward(self, x):
        y = self.rnn(x)[0]
        return self.head(y.reshape(-1, y.shape[-1]))


def _net(seed, **kw):
    torch.manual_seed(seed)
    return Net(**kw).double()


@pytest.mark.parametrize("bidirectional", [True, False])
def test_a_wrapped_submodule_keeps_the_parents_keys(bidirectional):
    """``net.rnn = spscan.wrap(net.rnn)`` (and the head): the parent's keys are those it had, checkpoints load
    both ways, strict errors name the parent's keys, and the nested wrappers train as autograd does."""
    net = _net(0, bidirectional=bidirectional)
    before = net.state_dict()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    net.rnn = spscan.wrap(net.rnn, x, backward="scan")
    net.head = spscan.wrap(net.head, torch.randn(10, 8 if bidirectional else 4, dtype=torch.float64),
                           backward="scan")
    assert isinstance(net.rnn, RecurrentWrapper)
    after = net.state_dict()
    _same(after, before)
    assert list(after._metadata) == list(before._metadata)
    src = _net(1, bidirectional=bidirectional)
    assert net.load_state_dict(src.state_dict()).missing_keys == []
    _same(net.state_dict(), src.state_dict())
    fresh = _net(2, bidirectional=bidirectional)
    fresh.load_state_dict(net.state_dict())
    _same(fresh.state_dict(), src.state_dict())
    # strict reports: the parent's names, nothing of the wrappers'
    sd = dict(src.state_dict())
    del sd["rnn.bias_hh_l1"]
    sd["rnn.extra"] = torch.zeros(1)
    sd["head.0.weight"] = torch.zeros(3)
    with pytest.raises(RuntimeError) as info:
        net.load_state_dict(sd)
    msg = str(info.value)
    assert 'Missing key(s) in state_dict: "rnn.bias_hh_l1"' in msg
    assert 'Unexpected key(s) in state_dict: "rnn.extra"' in msg
    assert "size mismatch for head.0.weight:" in msg
    assert "rnn.module." not in msg and "head.model." not in msg
    # gradients: the loaded weights, through both wrappers
    net.load_state_dict(src.state_dict())
    for g, want in zip(_step_grads(net, list(net.parameters()), x), _step_grads(src, list(src.parameters()), x)):
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12)


def test_wrappers_nested_in_a_wrapper():
    """A wrapper around a model that holds wrappers (here a NativeModule: fx cannot trace into a wrapper): every
    level takes its name out once."""
    net = _net(0)
    before = net.state_dict()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    net.rnn = spscan.wrap(net.rnn, x, backward="scan")
    with pytest.warns(UserWarning, match="autograd's own backward"):
        outer = spscan.wrap(net, x, backward="auto")
    _same(outer.state_dict(), before)
    src = _net(3)
    outer.load_state_dict(src.state_dict())
    _same(outer.state_dict(), src.state_dict())
    sd = dict(src.state_dict())
    sd["rnn.weight_ih_l0"] = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"size mismatch for rnn\.weight_ih_l0:"):
        outer.load_state_dict(sd)


def test_a_checkpoint_of_an_earlier_wrapper_loads():
    """Keys under the wrapper's attribute name (``model.0.weight``, ``rnn.module.weight_ih_l0``: what a wrapper
    of an earlier spscan saved) load where the model has nothing of that name."""
    torch.manual_seed(0)
    chain = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    src = copy.deepcopy(chain)
    for p in src.parameters():
        p.data.normal_()
    w = spscan.wrap(chain, torch.randn(2, 4, dtype=torch.float64), backward="scan")
    w.load_state_dict({"model." + k: v for k, v in src.state_dict().items()})
    _same(w.state_dict(), src.state_dict())
    net, old = _net(0), _net(1)
    net.rnn = spscan.wrap(net.rnn, torch.randn(5, 2, 3, dtype=torch.float64), backward="scan")
    net.load_state_dict({k.replace("rnn.", "rnn.module.", 1): v for k, v in old.state_dict().items()})
    _same(net.state_dict(), old.state_dict())


def test_a_model_with_a_child_named_like_the_wrappers_attribute():
    """A model whose own child is called ``model``: its keys are its own (never read as an earlier wrapper's)."""

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(4, 3), nn.Tanh())
            self.out = nn.Linear(3, 2)

        def forward(self, x):
            return self.out(self.model(x))

    torch.manual_seed(0)
    m, src = Outer().double(), Outer().double()
    w = spscan.wrap(m, torch.randn(2, 4, dtype=torch.float64), backward="scan")
    assert list(w.state_dict()) == list(m.state_dict()) == ["model.0.weight", "model.0.bias", "out.weight",
                                                            "out.bias"]
    w.load_state_dict(src.state_dict())
    _same(w.state_dict(), src.state_dict())
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "model.model.0.weight"'):
        w.load_state_dict({**src.state_dict(), "model.model.0.weight": torch.zeros(3, 4)})


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_pickled_wrappers_keep_the_models_keys(name, how):
    model, x, cls = _make(name, 0)
    w = _wrap(model, x, cls)
    if how == "deepcopy":
        w2 = copy.deepcopy(w)
    else:
        buf = io.BytesIO()
        torch.save(w, buf)
        buf.seek(0)
        w2 = torch.load(buf, weights_only=False)
    assert type(w2) is cls
    _same(w2.state_dict(), model.state_dict())
    src, _, _ = _make(name, 4)
    w2.load_state_dict(src.state_dict())
    _same(w2.state_dict(), src.state_dict())
    inner = getattr(w2, w2._model_attr)
    for g, want in zip(_step_grads(w2, list(inner.parameters()), x), _step_grads(src, list(src.parameters()), x)):
        torch.testing.assert_close(g, want, rtol=1e-9, atol=1e-12)


def test_a_parent_with_a_wrapper_pickles():
    net = _net(0)
    before = net.state_dict()
    net.rnn = spscan.wrap(net.rnn, torch.randn(5, 2, 3, dtype=torch.float64), backward="scan")
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert isinstance(back.rnn, RecurrentWrapper)
    _same(back.state_dict(), before)
    _same(copy.deepcopy(net).state_dict(), before)


def test_parameters_are_the_models_for_optimizers():
    """``parameters()`` are the model's own objects in the model's order, so an optimizer's state dict (which
    indexes them by position) moves between the wrapped and the unwrapped model; ``named_parameters()`` keeps
    the module tree's names, each resolved by ``get_parameter``."""
    net = _net(0)
    ref = copy.deepcopy(net)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    net.rnn = spscan.wrap(net.rnn, x, backward="scan")
    assert [id(p) for p in net.parameters()] == [id(p) for p in net.rnn.module.parameters()] + \
        [id(p) for p in net.head.parameters()]
    for n, p in net.named_parameters():
        assert net.get_parameter(n) is p
    assert [n.replace("rnn.module.", "rnn.") for n, _ in net.named_parameters()] == \
        [n for n, _ in ref.named_parameters()]
    opt, opt_ref = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (net, ref))
    for _ in range(2):
        for m, o in ((net, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    a, b = net.state_dict(), ref.state_dict()
    assert list(a) == list(b)
    for k in a:  # the scan's gradients equal autograd's up to rounding
        torch.testing.assert_close(a[k], b[k], rtol=1e-9, atol=1e-12)
    again = _net(5)
    opt2 = torch.optim.Adam(again.parameters(), lr=1e-2)
    opt2.load_state_dict(opt.state_dict())  # the wrapped model's optimizer state into the unwrapped model's
    assert all(torch.equal(opt2.state_dict()["state"][i]["exp_avg"], s["exp_avg"])
               for i, s in opt.state_dict()["state"].items())


def test_distributed_checkpoint_state_dicts():
    """``torch.distributed.checkpoint.state_dict`` walks a state dict's keys through the module tree; a wrapper
    says (``_fqn_modifiers``) that its keys skip its attribute."""
    dcp = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    net = _net(0)
    before = net.state_dict()
    net.rnn = spscan.wrap(net.rnn, torch.randn(5, 2, 3, dtype=torch.float64), backward="scan")
    net.head = spscan.wrap(net.head, torch.randn(10, 8, dtype=torch.float64), backward="scan")
    got = dcp.get_model_state_dict(net)
    _same(got, before)
    src = _net(6)
    other = _net(7)
    other.rnn = spscan.wrap(other.rnn, torch.randn(5, 2, 3, dtype=torch.float64), backward="scan")
    dcp.set_model_state_dict(other, src.state_dict())
    _same(other.state_dict(), src.state_dict())
