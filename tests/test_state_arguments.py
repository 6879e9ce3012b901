"""State arguments: a forward that takes its recurrent state after its input, ``forward(input, hidden)``, as
PyTorch's ``word_language_model`` does (the state detached between batches: truncated back-propagation through
time). ``spscan.wrap(model, (x, hidden))`` plans the model for its input and reads the state each step; the
recurrent layer runs through its scan, with autograd's gradients and the model's own outputs and new state
(float64, over steps of other lengths and batch sizes, with dropout). A call whose state needs a gradient, or
is of another structure, runs the model's own backward under ``backward="auto"`` and is refused under a forced
scan."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import spscan
from spscan.graph.recurrent import RecurrentNodeUnit
from zoo_models import WordLanguageModel


def WordLM(rnn_type: str, ntoken: int = 30, ninp: int = 8, nhid: int = 8, nlayers: int = 2, dropout: float = 0.2,
           tie_weights: bool = False) -> nn.Module:
    """``word_language_model``'s RNNModel as it is posted (:class:`zoo_models.WordLanguageModel`), small."""
    return WordLanguageModel(rnn_type, ntoken, ninp, nhid, nlayers, dropout, tie_weights)


class CellLoop(nn.Module):
    """A batch-first GRU cell stepped in Python, its state ``(B, H)`` passed in: ``forward(x, h)``."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.out = nn.GRUCell(3, 6), nn.Linear(6, 2)

    def forward(self, x, h):
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.out(h), h


def _detach(h):
    return tuple(t.detach() for t in h) if isinstance(h, tuple) else h.detach()


def _close(a, b, tol=1e-12):
    assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def _train(model, make_batch, init, schedule, backward, tie=False):
    """Steps of the wrapper and of autograd on a copy (SGD with momentum): the same outputs, new state and
    gradients at every step; the state carried over between steps of one batch size."""
    ref = copy.deepcopy(model)
    x0 = make_batch(*schedule[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, (x0, init(model, x0)), backward=backward)
    opt_w = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    h_w = h_r = None
    for step, shape in enumerate(schedule):
        x = make_batch(*shape)
        if h_w is None or torch.utils._pytree.tree_leaves(h_w)[0].shape != torch.utils._pytree.tree_leaves(
                init(model, x))[0].shape:
            h_w, h_r = init(model, x), init(ref, x)
        torch.manual_seed(100 + step)
        y_w, hn_w = w(x, h_w)
        torch.manual_seed(100 + step)
        y_r, hn_r = ref(x, h_r)
        _close(y_w, y_r)
        for a, b in zip(torch.utils._pytree.tree_leaves(hn_w), torch.utils._pytree.tree_leaves(hn_r)):
            _close(a, b)
        wt = torch.randn(y_r.shape, dtype=y_r.dtype, generator=torch.Generator().manual_seed(step))
        opt_w.zero_grad()
        opt_r.zero_grad()
        (y_w * wt).sum().backward()
        (y_r * wt).sum().backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if q.grad is not None:
                _close(p.grad, q.grad, 1e-10)
        opt_w.step()
        opt_r.step()
        h_w, h_r = _detach(hn_w), _detach(hn_r)
    return w


def _tokens(t, b):
    return torch.randint(0, 30, (t, b), generator=torch.Generator().manual_seed(7 * t + b))


def _lm_hidden(model, x):
    return model.init_hidden(x.shape[1])


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("rnn_type", ["LSTM", "GRU", "RNN_TANH"])
def test_word_language_model_with_its_hidden_state(rnn_type, backward):
    torch.manual_seed(0)
    model = WordLM(rnn_type).double()
    # lengths and batch sizes change (the last batch of an epoch is shorter; evaluation batches are others)
    w = _train(model, _tokens, _lm_hidden, [(6, 4), (6, 4), (6, 4), (4, 4), (6, 3)], backward)
    if backward == "scan":
        assert any(isinstance(u, RecurrentNodeUnit) for u in w.plan.units)
        assert w.decision.chosen.name == "scan"


def test_tied_weights_and_time_equal_to_batch():
    """Tied encoder/decoder weights; a batch the size of the layers and of the length (the state's batch dim is
    told by running the model one sample larger)."""
    torch.manual_seed(0)
    model = WordLM("LSTM", tie_weights=True, nlayers=2).double()
    _train(model, _tokens, _lm_hidden, [(2, 2), (2, 2), (3, 2)], "scan")


def test_batch_first_state():
    torch.manual_seed(0)
    model = CellLoop().double()

    def batch(t, b):
        return torch.randn(b, t, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(t + 10 * b))

    _train(model, batch, lambda m, x: torch.zeros(x.shape[0], 6, dtype=torch.float64), [(5, 4), (5, 4), (5, 2)],
           "scan")


def test_state_that_needs_a_gradient_runs_autograd_or_is_refused():
    """A state that requires a gradient (the first batch's learned state, or a state not detached): its
    gradient is autograd's under ``auto``; a forced scan refuses it, and a call without the state is the
    model's own error."""
    torch.manual_seed(0)
    model = WordLM("GRU", dropout=0.0).double()
    x = _tokens(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = spscan.wrap(model, (x, model.init_hidden(3)), backward="auto")
        forced = spscan.wrap(model, (x, model.init_hidden(3)), backward="scan")
    h = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    y, _ = auto(x, h)
    y.sum().backward()
    h_ref = h.detach().clone().requires_grad_()
    model(x, h_ref)[0].sum().backward()
    _close(h.grad, h_ref.grad)
    with pytest.raises(TypeError, match="requires a gradient"):
        forced(x, h)
    with pytest.raises(TypeError, match="of batch 2"):
        forced(x, model.init_hidden(2))
    with pytest.raises(TypeError, match="hidden"):
        forced(x)


def test_copied_and_saved_wrappers_keep_the_state_argument():
    torch.manual_seed(0)
    model = WordLM("LSTM", dropout=0.0).double()
    x = _tokens(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, (x, model.init_hidden(3)), backward="scan")
    assert list(w.state_dict()) == list(model.state_dict())
    w2 = copy.deepcopy(w)
    assert w2.plan.state is not None and w2.plan.state is not w.plan.state
    h = model.init_hidden(3)
    y, _ = w2(x, h)
    y_ref, _ = w2.model(x, h)
    _close(y, y_ref)
    y.sum().backward()


class TimeEmbedded(nn.Module):
    """``forward(x, t)``: integer time steps embedded, as a diffusion model takes them."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.t, self.o = nn.Linear(6, 16), nn.Linear(8, 16), nn.Linear(16, 6)

    def forward(self, x, t):
        f = torch.exp(-9.21 * torch.arange(4, dtype=x.dtype) / 4)
        e = t[:, None].to(x.dtype) * f[None]
        return self.o(torch.relu(self.a(x) + self.t(torch.cat([e.sin(), e.cos()], 1))))


class MaskedMean(nn.Module):
    """``forward(x, mask)``: a padding mask (bool or float) over the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x, mask):
        h = torch.tanh(self.a(x)) * mask[..., None]
        return self.o(h.sum(1) / mask.sum(1, keepdim=True).clamp(min=1))


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("case", ["time_steps", "bool_mask", "float_mask"])
def test_further_inputs_without_gradients(case, backward):
    """Inputs besides the first that carry no gradient, of any dtype, read each step: the gradients of the
    parameters and of the first input are autograd's, at several batch sizes."""
    torch.manual_seed(0)
    if case == "time_steps":
        model = TimeEmbedded().double()

        def example(b):
            return torch.randn(b, 6, dtype=torch.float64), torch.randint(0, 1000, (b,))
    else:
        model = MaskedMean().double()

        def example(b):
            m = torch.rand(b, 5) > 0.3
            return torch.randn(b, 5, 6, dtype=torch.float64), m if case == "bool_mask" else m.double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, example(4), backward=backward)
        assert w.plan.state is not None
        for b in (4, 3, 4):
            x, other = example(b)
            xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
            model.zero_grad()
            ref.zero_grad()
            ya, yb = w(xa, other), ref(xb, other)
            _close(ya, yb)
            ya.square().sum().backward()
            yb.square().sum().backward()
            _close(xa.grad, xb.grad)
            for p, q in zip(model.parameters(), ref.parameters()):
                _close(p.grad, q.grad)


class Streaming(nn.Module):
    """A memory updated in place by the forward (``mem.mul_(0.5).add_(...)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.o = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, mem):
        h = torch.tanh(self.a(x))
        mem.mul_(0.5).add_(h.detach())
        return self.o(h + mem)


def test_planning_leaves_the_callers_state_as_it_was():
    """Planning runs the forward on copies of the state: a forward that updates it in place (which the scan
    cannot trace: autograd's own step under ``auto``) left the caller's example changed."""
    torch.manual_seed(0)
    model = Streaming().double()
    ref = copy.deepcopy(model)
    x, mem = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    keep = mem.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, (x, mem), backward="auto")
    assert torch.equal(mem, keep)
    m_w, m_r = mem.clone(), mem.clone()
    for step in range(2):
        y_w, y_r = w(x, m_w), ref(x, m_r)
        _close(y_w, y_r)
        _close(m_w, m_r)
        y_w.sum().backward()
        y_r.sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            _close(p.grad, q.grad)


def test_state_by_keyword_and_after_a_dtype_conversion():
    """A state passed by keyword (``w(x, h=h)``) is read as one passed in order; a model converted after
    wrapping (``.float()``) takes a state of its new dtype, through the scan."""
    torch.manual_seed(0)
    model = CellLoop().double()
    ref = copy.deepcopy(model)
    x, h = torch.randn(3, 4, 3, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    w = spscan.wrap(model, (x, h), backward="scan")
    y, _ = w(x, h=h)
    y_ref, _ = ref(x, h=h)
    _close(y, y_ref)
    model.float()
    ref.float()
    y, _ = w(x.float(), h.float())
    assert y.dtype == torch.float32
    y.sum().backward()
    ref(x.float(), h.float())[0].sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        _close(p.grad, q.grad, 1e-5)


class TimeMajorAttention(nn.Module):
    """Time-major ``(T, B, D)`` attention with a key padding mask ``(B, T)``."""

    def __init__(self) -> None:
        super().__init__()
        self.m, self.f = nn.MultiheadAttention(8, 2), nn.Linear(8, 3)

    def forward(self, x, kpm):
        return self.f(self.m(x, x, x, key_padding_mask=kpm)[0])


def test_a_time_major_input_beside_a_batch_first_mask():
    """The mask's batch is its dim 0 and the input's its dim 1 (told from the example: both grown by one run, as
    growing the input in time and the mask along its dim 1 would); autograd's gradients under ``auto`` at
    every batch size."""
    from spscan.graph.state import state_batch_dims

    torch.manual_seed(0)
    model = TimeMajorAttention().double()
    x, kpm = torch.randn(5, 4, 8, dtype=torch.float64), torch.zeros(4, 5, dtype=torch.bool)
    assert state_batch_dims(model, x, (kpm,)) == (1, (0,))
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, (x, kpm), backward="auto")
    for b in (4, 3):
        x, kpm = torch.randn(5, b, 8, dtype=torch.float64), torch.rand(b, 5) > 0.7
        kpm[:, 0] = False
        model.zero_grad()
        ref.zero_grad()
        w(x, kpm).square().sum().backward()
        ref(x, kpm).square().sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            _close(p.grad, q.grad)
