"""Nothing silent: wherever autograd's own backward runs in place of the scan, the user is told.

* ``explain()`` of a wrapper names every node that runs its own call and autograd's backward inside the scan
  (:class:`spscan.layers.opaque.OpaqueUnit`: its ``label`` and ``reason``), and says when the whole model runs
  natively.
* A forced ``backward="scan"`` whose plan has such nodes warns once per wrapper (the first step that runs the
  scan), naming them; ``backward="auto"`` does not warn.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import spscan
from spscan.runtime.choices import OPAQUE_NAMED, opaque_nodes
from spscan.layers.opaque import OpaqueUnit


class Attn(nn.Module):
    """``n`` attention layers between two linear layers: ``n`` opaque nodes (no analytic unit for attention)."""

    def __init__(self, n: int = 1, d: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.attn = nn.ModuleList(nn.MultiheadAttention(d, 2, batch_first=True) for _ in range(n))
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.lin(x)
        for a in self.attn:
            x = a(x, x, x)[0]
        return self.out(self.drop(x)).sum(1)


def _x(batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, 4, 8, dtype=torch.float64)


def _opaque(w) -> list[OpaqueUnit]:
    return [u for u in w.plan.units if isinstance(u, OpaqueUnit)]


def _step(w, x) -> None:
    w(x.clone().requires_grad_(True)).square().sum().backward()


def _ours(caught) -> list:
    return [c for c in caught if "autograd's own backward inside the scan" in str(c.message)]


def test_an_opaque_unit_says_why():
    torch.manual_seed(0)
    w = spscan.wrap(Attn().double(), _x(), backward="auto")
    (u,) = _opaque(w)
    assert u.reason.startswith("no analytic unit for the module type torch.nn.modules.activation.MultiheadAttention")
    other = OpaqueUnit(0, u.module, u.in_shapes, u.out_shape, u.call, u.label, reason="a reason of its own")
    assert other.reason == "a reason of its own"


def test_explain_names_every_node_with_its_reason():
    torch.manual_seed(0)
    w = spscan.wrap(Attn(n=2).double(), _x(), backward="auto")
    units = _opaque(w)
    assert len(units) == 2
    units[1].reason = "no analytic unit for this module type"
    text = w.explain()
    for u in units:
        assert f"autograd's own backward inside the scan: {u.label}: {u.reason}" in text
        assert text.count(u.label) == 1
    assert "MultiheadAttention" in text
    # the same node's label and reason twice: one line with a count
    units[1].label, units[1].reason = units[0].label, units[0].reason
    assert opaque_nodes(w.plan) == [(units[0].label, units[0].reason, 2)]
    assert f"{units[0].label}: {units[0].reason} (x2)" in w.explain()


def test_explain_says_nothing_of_the_kind_without_such_nodes():
    torch.manual_seed(0)
    chain = spscan.wrap(nn.Sequential(nn.Linear(4, 3), nn.Tanh()).double(), torch.randn(2, 4, dtype=torch.float64),
                        backward="scan")
    rnn = spscan.wrap(nn.GRU(3, 4, num_layers=2).double(), torch.randn(5, 2, 3, dtype=torch.float64),
                      backward="scan")
    for w in (chain, rnn):
        assert "autograd's own backward inside the scan" not in w.explain()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            x = torch.randn(2, 4, dtype=torch.float64) if w is chain else torch.randn(5, 2, 3, dtype=torch.float64)
            y = w(x.requires_grad_(True))
            (y[0] if isinstance(y, tuple) else y).sum().backward()


def test_explain_says_when_the_whole_model_runs_natively():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 5)

        def forward(self, x):
            y = self.fc(x)
            return y.relu() if y.sum() > 0 else y.tanh()

    with pytest.warns(UserWarning, match="runs autograd's own backward"):
        w = spscan.wrap(Branchy(), torch.randn(3, 5), backward="auto")
    text = w.explain()
    assert text.splitlines()[0] == "NativeModule around Branchy: the whole model runs autograd's own backward"
    assert "not available: Branchy: torch.fx.symbolic_trace cannot capture its forward" in text
    native = spscan.wrap(nn.Sequential(nn.Linear(4, 3)), torch.randn(2, 4), backward="native")
    assert "backward (batch 2): native (forced" in native.explain()
    assert "the model's own autograd backward" in native.explain()


def test_a_forced_scan_warns_once_naming_the_nodes():
    """The first step that runs the scan warns (pointing at the caller's line); later steps, other batch sizes
    and the other mode's plan do not warn again."""
    torch.manual_seed(0)
    model = Attn(n=2, dropout=0.1).double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not at wrap time
        w = spscan.wrap(model, _x(), backward="scan")
        with torch.no_grad():  # the model's own forward: no backward runs, nothing to say
            w(_x())
    labels = [u.label for u in _opaque(w)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(w, _x())
        _step(w, _x())
        _step(w, _x(5))
        w.eval()
        _step(w, _x())  # the plan traced in eval mode, made now
        w.train()
        _step(w, _x())
    ours = _ours(caught)
    assert len(ours) == 1
    warning = ours[0]
    assert warning.category is UserWarning and warning.filename == __file__
    msg = str(warning.message)
    assert "backward='scan'" in msg and "2 nodes" in msg and "Attn" in msg
    for label in labels:
        assert label in msg
    assert "explain()" in msg and "backward='auto'" in msg


def test_the_warning_names_a_few_and_counts_the_rest():
    torch.manual_seed(0)
    n = OPAQUE_NAMED + 2
    w = spscan.wrap(Attn(n=n).double(), _x(), backward="scan")
    labels = [u.label for u in _opaque(w)]
    assert len(labels) == n
    with pytest.warns(UserWarning, match="autograd's own backward inside the scan") as caught:
        _step(w, _x())
    (msg,) = [str(c.message) for c in _ours(caught)]
    assert f"{n} nodes" in msg and "and 2 more" in msg
    assert all(label in msg for label in labels[:OPAQUE_NAMED])
    assert not any(label in msg for label in labels[OPAQUE_NAMED:])


def test_one_warning_per_wrapper():
    torch.manual_seed(0)
    w = spscan.wrap(Attn().double(), _x(), backward="scan")
    other = copy.deepcopy(w)  # wrapped again: a wrapper of its own
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            _step(w, _x())
            _step(other, _x())
    assert len(_ours(caught)) == 2


def test_auto_does_not_warn_and_explain_says_it():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = spscan.wrap(Attn(n=2).double(), _x(), backward="auto")
        for batch in (3, 64):
            _step(w, _x(batch))
    assert "autograd's own backward inside the scan: " in w.explain()


def test_gradients_are_unchanged_by_the_warning():
    torch.manual_seed(0)
    model = Attn(n=2).double()
    ref = copy.deepcopy(model)
    w = spscan.wrap(model, _x(), backward="scan")
    x = _x()
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    with pytest.warns(UserWarning, match="autograd's own backward inside the scan"):
        w(xa).square().sum().backward()
    ref(xb).square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-9, atol=1e-12)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)


class _WithRecurrent(nn.Module):
    """A recurrent layer and an attention layer inside a traced model."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        o, _ = self.rnn(x)
        return self.out(self.attn(o, o, o)[0][:, -1])


def test_a_node_that_runs_a_scan_of_its_own_is_named_as_it_runs():
    """A recurrent layer's node runs its own recurrent wrapper (``unit.recurrent``): it is not warned about as a
    node that runs autograd's backward (under a forced scan its wrapper is forced too); explain() lists it apart,
    with the decision its wrapper made. Other opaque nodes are named in both."""
    torch.manual_seed(0)
    x = _x()
    scan = spscan.wrap(_WithRecurrent().double(), x, backward="scan")
    auto = spscan.wrap(_WithRecurrent().double(), x, backward="auto")
    own = [u for u in _opaque(scan) if getattr(u, "recurrent", None) is not None]
    plain = [u for u in _opaque(scan) if getattr(u, "recurrent", None) is None]
    assert own and plain and all("MultiheadAttention" in u.label for u in plain)
    with pytest.warns(UserWarning, match="autograd's own backward inside the scan") as caught:
        _step(scan, x)
    (msg,) = [str(c.message) for c in _ours(caught)]
    assert all(u.label in msg for u in plain) and not any(u.label in msg for u in own)
    for w, mode in ((scan, "scan"), (auto, "auto")):
        text = w.explain()
        for u in own:
            assert f"recurrent layer inside the model: {u.label}: its own recurrent wrapper decides" in text
            assert f"autograd's own backward inside the scan: {u.label}" not in text
        assert f"backward (T {x.shape[1]}, batch {x.shape[0]}): " + ("scan (forced" if mode == "scan" else "") in text
        for u in _opaque(w):
            if getattr(u, "recurrent", None) is None:
                assert f"autograd's own backward inside the scan: {u.label}: {u.reason}" in text