"""A model changed after it was wrapped, as training code changes it: hooks registered on a layer (forward,
forward-pre, full backward, full backward-pre; on a recurrent layer inside the model too), a parametrization
registered, a parameter given anew (a recurrent layer's too). The units would not follow such a change (the
scan does not call the modules, and a unit holding a parameter object would give its gradient to the old one),
so the wrapper plans the model again as it is now, with a warning, and gives autograd's results. Hooks on the
model itself, or registered for every module, run the model's own step under ``backward="auto"`` and are
refused under a forced scan."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook
import torch.nn.utils.prune as prune
from torch.nn.utils.parametrizations import weight_norm

import spscan


class GRUHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = nn.GRU(3, 6, batch_first=True), nn.Linear(6, 2)

    def forward(self, x):
        return self.fc(torch.tanh(self.rnn(x)[0][:, -1]))


def _hook(kind):
    def add(model):
        m = getattr(model, "rnn" if kind.endswith("rnn") else "fc")
        if kind.startswith("forward"):
            return m.register_forward_hook(lambda mod, i, o: (o[0] * 1.5, o[1]) if isinstance(o, tuple) else o * 1.5)
        if kind.startswith("pre"):
            return m.register_forward_pre_hook(lambda mod, i: (i[0] * 0.5,))
        if kind.startswith("backward_pre"):
            return m.register_full_backward_pre_hook(lambda mod, g: (g[0] * 3,))
        return m.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 2,))
    return add


def _change(what):
    def change(model):
        if what == "parametrization":
            weight_norm(model.fc)
        elif what == "rnn_parametrization":
            weight_norm(model.rnn, "weight_hh_l0")
        elif what == "rnn_parameter":
            model.rnn.weight_hh_l0 = nn.Parameter(model.rnn.weight_hh_l0.detach() * 0.5)
        elif what == "parameter":
            model.fc.weight = nn.Parameter(model.fc.weight.detach() * 2)
        else:
            _hook(what)(model)
    return change


CHANGES = ["forward", "pre", "backward", "backward_pre", "forward_rnn", "pre_rnn", "parametrization",
           "rnn_parametrization", "rnn_parameter", "parameter"]


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("what", CHANGES)
def test_a_change_after_wrapping_is_planned_again(what, backward):
    torch.manual_seed(0)
    model = GRUHead().double()
    x = torch.randn(3, 7, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, x, backward=backward)
        w(x).sum().backward()
    _change(what)(model)
    ref = copy.deepcopy(model)
    opt_w = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step, b in enumerate((3, 2, 3)):
        x = torch.randn(b, 7, 3, dtype=torch.float64)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        opt_w.zero_grad()
        opt_r.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ya = w(xa)
        if step == 0 and backward == "scan":
            assert any("planned again" in str(c.message) for c in caught), [str(c.message) for c in caught]
        yb = ref(xb)
        torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-14)
        ya.square().sum().backward()
        yb.square().sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-14)
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=n)
        opt_w.step()
        opt_r.step()


@pytest.mark.parametrize("where", ["model", "every module"])
def test_hooks_the_scan_would_not_run(where):
    torch.manual_seed(0)
    model = GRUHead().double()
    x = torch.randn(3, 7, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = spscan.wrap(model, x, backward="auto")
        forced = spscan.wrap(model, x, backward="scan")
    ref = copy.deepcopy(model)
    calls = []
    handle = (model.register_forward_hook(lambda m, i, o: o * 2) if where == "model"
              else register_module_forward_hook(lambda m, i, o: calls.append(type(m).__name__)))
    try:
        if where == "model":
            ref.register_forward_hook(lambda m, i, o: o * 2)
        with pytest.raises(ValueError, match="the scan does not call the modules"):
            forced(x.clone().requires_grad_())
        calls.clear()
        xa = x.clone().requires_grad_()
        ya = auto(xa)
        seen = list(calls)
        calls.clear()
        yb = ref(x)
        torch.testing.assert_close(ya, yb)
        assert [c for c in seen if c != type(auto).__name__] == calls  # (the wrapper is a module too)
    finally:
        handle.remove()


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 2)

    def forward(self, x):
        return self.head(self.block(x) * 0.5)


def _pruned_lstm():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn, self.fc = nn.LSTM(3, 5, batch_first=True), nn.Linear(5, 2)

        def forward(self, x):
            return self.fc(self.rnn(x)[0][:, -1])
    return Net()


def _sequential_container():
    return nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(6, 2))


MORE = {
    # a hook on a nested container of a plain Sequential (the chain planner flattened it, hook unseen)
    "container_hook": (_sequential_container, (3, 4), lambda m: m[0].register_forward_hook(lambda mod, i, o: o * 2)),
    # forward replaced on an instance: the old traced forward kept running
    "instance_forward": (_Nested, (3, 4), lambda m: setattr(m.block, "forward", lambda x: torch.sin(m.block[0](x)))),
    # pruning applied to a recurrent layer inside the model: its own call runs the pruning pre-hook
    "prune_rnn": (_pruned_lstm, (3, 7, 3), lambda m: prune.l1_unstructured(m.rnn, "weight_hh_l0", 0.5)),
    # pruning made permanent (the parameter objects the same, their names not)
    "prune_remove": (_sequential_container, (3, 4), lambda m: prune.remove(m[1], "weight")),
    # dynamic sparse training: pruned weights regrown through the mask
    "regrow": (_sequential_container, (3, 4), lambda m: (m[1].weight_mask.__setitem__((0, slice(0, 3)), 1.0),
                                                          torch.nn.init.ones_(m[1].weight_orig.data[0:1, 0:3]))),
}


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("what", list(MORE))
def test_more_changes_after_wrapping(what, backward):
    make, shape, change = MORE[what]
    torch.manual_seed(0)
    model, ref = make().double(), make().double()
    ref.load_state_dict(model.state_dict())
    if what in ("prune_remove", "regrow"):
        for m in (model, ref):
            prune.l1_unstructured(m[1], "weight", 0.5)
    x = torch.randn(*shape, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, x, backward=backward)
        w(x).sum().backward()
    model.zero_grad()
    change(model)
    change(ref)
    for step in range(2):
        model.zero_grad()
        ref.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ya = w(x)
        yb = ref(x)
        torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-14)
        ya.square().sum().backward()
        yb.square().sum().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=n)


def test_a_model_no_longer_plannable_after_a_change_runs_autograd():
    """The model's own forward replaced on the instance after wrapping (fx traces its class's forward, so the
    plan made again would not be the model's): where ``auto`` runs the scan, it warns once and runs autograd's
    own steps from then on; a forced scan refuses."""
    torch.manual_seed(0)
    model = GRUHead().double()
    x = torch.randn(8, 300, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = spscan.wrap(model, x, backward="auto")
        forced = spscan.wrap(model, x, backward="scan")
    if auto.decision.chosen.name != "scan":
        pytest.skip("this machine's profile runs this model natively")
    model.forward = lambda t: model.fc(torch.sin(model.rnn(t)[0][:, -1]))
    with pytest.raises(spscan.NotPlannable):
        forced(x)
    with pytest.warns(UserWarning, match="runs autograd's own steps from now on"):
        y = auto(x)
    want = model.fc(torch.sin(model.rnn(x)[0][:, -1]))
    torch.testing.assert_close(y, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # planned once: no warning, no planning again
        torch.testing.assert_close(auto(x), want)
