"""Recurrent layers inside models as people write them: an ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` anywhere in a
traced model is one node run by its recurrent wrapper (its ``J^T g`` and parameter gradients from the recurrent
scan), with autograd's gradients (float64) in every layout: ``batch_first`` or time-major, stacked,
bidirectional, ``h_0`` given, ``(h_n, c_n)`` read, the output or the last state read."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import spscan
from spscan.graph.recurrent import RecurrentNodeUnit
from spscan.layers.opaque import OpaqueUnit


class PixelGRU(nn.Module):
    """A pixel-by-pixel classifier: the last layer's final state into a linear head."""

    def __init__(self, hidden=6):
        super().__init__()
        self.rnn = nn.GRU(1, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, 4)

    def forward(self, x):
        out, h = self.rnn(x.view(x.size(0), -1, 1))
        return self.fc(h[-1])


class AddingRNN(nn.Module):
    """The adding problem's model: the last time step of the output sequence."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(2, 5, batch_first=True)
        self.fc = nn.Linear(5, 1)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, -1, :])


class Tagger(nn.Module):
    """A bi-LSTM tagger: a tag for every token."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 4)
        self.lstm = nn.LSTM(4, 5, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(10, 3)

    def forward(self, ids):
        out, (h, c) = self.lstm(self.emb(ids))
        return self.fc(out)


class CharLM(nn.Module):
    """A character language model: a stacked LSTM, logits for every step."""

    def __init__(self, cell=nn.LSTM):
        super().__init__()
        self.emb = nn.Embedding(13, 5)
        self.rnn = cell(5, 6, num_layers=2, batch_first=True)
        self.head = nn.Linear(6, 13)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out)


class TimeMajor(nn.Module):
    """A time-major GRU (the input transposed in the forward), both the output and the final state read."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 5, num_layers=2)
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        out, h = self.rnn(x.transpose(0, 1))
        return self.fc(out[-1]) + self.fc(h[0])


class BothStates(nn.Module):
    """An LSTM given ``(h_0, c_0)`` made from the batch size, its ``h_n`` and ``c_n`` both read."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        h0 = torch.zeros(1, x.size(0), 4, dtype=x.dtype, device=x.device)
        c0 = x.new_zeros(1, x.size(0), 4) + 0.5
        _, (h, c) = self.lstm(x, (h0, c0))
        return self.fc(torch.cat([h[-1], c[-1]], 1))


class LearnedState(nn.Module):
    """A learned initial state, expanded to the batch."""

    def __init__(self):
        super().__init__()
        self.h0 = nn.Parameter(torch.randn(1, 1, 4))
        self.rnn = nn.RNN(3, 4, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        out, h = self.rnn(x, self.h0.expand(1, x.size(0), 4).contiguous())
        return self.fc(out.mean(1))


class Encoder(nn.Module):
    """An encoder GRU whose final state starts a decoder GRU; a shared layer called twice."""

    def __init__(self):
        super().__init__()
        self.enc = nn.GRU(3, 4, batch_first=True)
        self.dec = nn.GRU(3, 4, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        _, h = self.enc(x)
        out, _ = self.dec(x.flip(1), h)
        out2, _ = self.dec(x)
        return self.fc(out[:, -1] + out2[:, 0])


MODELS = {
    "pixel_gru": (PixelGRU, lambda b: torch.randn(b, 3, 4)),
    "adding_rnn": (AddingRNN, lambda b: torch.randn(b, 9, 2)),
    "bilstm_tagger": (Tagger, lambda b: torch.randint(0, 11, (b, 7))),
    "lstm_lm": (CharLM, lambda b: torch.randint(0, 13, (b, 8))),
    "gru_lm": (lambda: CharLM(nn.GRU), lambda b: torch.randint(0, 13, (b, 8))),
    "time_major": (TimeMajor, lambda b: torch.randn(b, 6, 3)),
    "both_states": (BothStates, lambda b: torch.randn(b, 5, 3)),
    "learned_state": (LearnedState, lambda b: torch.randn(b, 5, 3)),
    "encoder_decoder": (Encoder, lambda b: torch.randn(b, 5, 3)),
}


def _step(model, x, wt):
    for p in model.parameters():
        p.grad = None
    xi = x.clone().requires_grad_(x.is_floating_point())
    y = model(xi)
    (y * wt).sum().backward()
    return y.detach(), xi.grad


def _rel(a, b):
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


def _same_step(w, model, ref, x, step, seed=None):
    """One step of the wrapper ``w`` (of ``model``) and of ``ref`` on ``x`` (the same random numbers where
    ``seed`` is given): the same output, input gradient and parameter gradients (None where autograd's is)."""
    with torch.no_grad():
        wt = torch.randn_like(ref(x))
    if seed is not None:
        torch.manual_seed(seed)
    y, gx = _step(w, x, wt)
    if seed is not None:
        torch.manual_seed(seed)
    y_ref, gx_ref = _step(ref, x, wt)
    assert _rel(y, y_ref) <= 1e-12
    if gx_ref is not None:
        assert _rel(gx, gx_ref) <= 1e-9
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            assert _rel(p.grad, q.grad) <= 1e-9, f"step {step}: {n}"


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("name", list(MODELS))
def test_recurrent_layers_in_models_give_autograds_gradients(name, backward):
    make, example = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    x0 = example(3)
    x0 = x0.double() if x0.is_floating_point() else x0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, x0, backward=backward)
    units = w.plan.units
    recurrent = [u for u in units if isinstance(u, RecurrentNodeUnit)]
    assert recurrent and not [u for u in units if type(u) is OpaqueUnit], [u.name for u in units]
    for step, b in enumerate((3, 2)):
        torch.manual_seed(10 + step)
        x = example(b)
        x = x.double() if x.is_floating_point() else x
        _same_step(w, model, ref, x, step)


def test_a_forced_scan_runs_each_node_through_its_scan():
    """Under ``backward="scan"`` the node's wrapper runs its scan (not the layer's own backward), and the
    model wrapper does not warn about it as a node that runs autograd's backward."""
    torch.manual_seed(0)
    model = PixelGRU().double()
    x = torch.randn(3, 3, 4, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = spscan.wrap(model, x, backward="scan")
        (node,) = [u for u in w.plan.units if isinstance(u, RecurrentNodeUnit)]
        inner = node.recurrent.wrapper()
        assert inner.backward_mode == "scan"
        ran = []
        real = type(inner)._scan_step

        def spy(self, *a, **k):
            ran.append(a[1])
            return real(self, *a, **k)

        type(inner)._scan_step = spy
        try:
            w(x.requires_grad_()).sum().backward()
        finally:
            type(inner)._scan_step = real
    assert ran == ["scan"]


def test_the_node_is_priced_by_its_own_decision():
    """The model's scan-or-native decision prices the recurrent node at what the node's own decision predicts:
    a long pixel sequence, where the scan is far faster, makes the model's ``auto`` choose the scan."""
    torch.manual_seed(0)
    model = PixelGRU(32)
    x = torch.randn(16, 28, 28)
    w = spscan.wrap(model, x, backward="auto")
    (node,) = [u for u in w.plan.units if isinstance(u, RecurrentNodeUnit)]
    inner = node.recurrent.decision(16)
    assert inner.question.startswith("backward (T 784, batch 16)")
    assert inner.chosen.name == "scan"
    assert w.decision.chosen.name == "scan"
    native = next(c.predicted_s for c in inner.candidates if c.name == "native")
    outer_native = next(c.predicted_s for c in w.decision.candidates if c.name == "native")
    assert outer_native >= native
    assert "self.rnn (GRU)" in w.explain()


def test_a_state_pair_the_model_passes_on_whole_keeps_both_layers_recurrent_nodes():
    """An LSTM whose ``(h_n, c_n)`` the model passes to another LSTM whole (an encoder-decoder): the pair is
    rebuilt from its two unpacked tensors, so both layers are recurrent nodes, the decoder's ``h_0``/``c_0``
    read from the encoder's node."""

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.dec = nn.LSTM(3, 4, batch_first=True), nn.LSTM(3, 4, batch_first=True)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            _, state = self.enc(x)
            out, _ = self.dec(x, state)
            return self.fc(out[:, -1])

    torch.manual_seed(0)
    model = Seq2Seq().double()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 5, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, x, backward="scan")
    assert sorted(u.label for u in w.plan.units if isinstance(u, RecurrentNodeUnit)) == ["self.dec (LSTM)",
                                                                                          "self.enc (LSTM)"]
    assert not [u for u in w.plan.units if type(u) is OpaqueUnit]
    wt = torch.randn(3, 2, dtype=torch.float64)
    y, gx = _step(w, x, wt)
    y_ref, gx_ref = _step(ref, x, wt)
    assert _rel(y, y_ref) <= 1e-12 and _rel(gx, gx_ref) <= 1e-9
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) <= 1e-9


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_a_language_model_returning_its_lstm_state_keeps_the_layer_a_recurrent_node(backward):
    """char-rnn's ``return logits, hidden``: the LSTM's ``(h_n, c_n)`` returned whole is rebuilt from its two
    unpacked tensors, so the LSTM is still a recurrent node; a loss on the logits and on both states gives
    autograd's gradients, at the planned batch and another."""

    class CharRNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6)
            self.rnn = nn.LSTM(6, 5, num_layers=2, batch_first=True)
            self.fc = nn.Linear(5, 11)

        def forward(self, x, hidden=None):
            out, hidden = self.rnn(self.emb(x), hidden)
            return self.fc(out.contiguous().view(-1, 5)), hidden

    torch.manual_seed(0)
    model = CharRNN().double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, torch.randint(0, 11, (3, 7)), backward=backward)
    units = w.plan.units
    assert [u for u in units if isinstance(u, RecurrentNodeUnit)] and not [u for u in units if type(u) is OpaqueUnit]
    for b in (3, 2):
        x = torch.randint(0, 11, (b, 7))
        got = []
        for mod in (w, ref):
            for p in mod.parameters():
                p.grad = None
            logits, (h, c) = mod(x)
            assert h.shape == c.shape == (2, b, 5)
            (logits.sin().sum() + (h ** 2).sum() + (c * torch.linspace(-1, 1, 5, dtype=c.dtype)).sum()).backward()
            got.append((logits.detach(), h.detach(), c.detach(), [p.grad for p in mod.parameters()]))
        (y, h, c, gs), (y_ref, h_ref, c_ref, gs_ref) = got
        assert _rel(y, y_ref) <= 1e-12 and _rel(h, h_ref) <= 1e-12 and _rel(c, c_ref) <= 1e-12
        for g, g_ref in zip(gs, gs_ref):
            assert _rel(g, g_ref) <= 1e-9


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_each_sequence_length_is_planned_for_that_length(backward):
    """A model wrapped with one length and called with others: each length is planned on first use (its
    recurrent node planned for that length), never run some other way in silence; autograd's gradients."""
    torch.manual_seed(0)
    model = AddingRNN().double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, torch.randn(3, 9, 2, dtype=torch.float64), backward=backward)
    for steps in (9, 14, 9, 5):
        x = torch.randn(3, steps, 2, dtype=torch.float64)
        wt = torch.randn(3, 1, dtype=torch.float64)
        y, gx = _step(w, x, wt)
        y_ref, gx_ref = _step(ref, x, wt)
        assert _rel(y, y_ref) <= 1e-12 and _rel(gx, gx_ref) <= 1e-9
        for p, q in zip(model.parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) <= 1e-9
        (node,) = [u for u in w.plan.units if isinstance(u, RecurrentNodeUnit)]
        assert w.plan.in_shape == (steps, 2) and node.recurrent.seq_len == steps
    assert {key[1] for key in w._plans} == {(9, 2), (14, 2), (5, 2)}  # (mode, per-sample shape, attributes)


class CellLoop(nn.Module):
    """A cell unrolled in Python, its state passed on whole: ``st = self.cell(x[:, t], st)``. An ``LSTMCell``'s
    ``(h, c)`` is a tuple, which the graph does not take apart: one opaque node recomputes the calls before it."""

    def __init__(self, cell: type, steps: int):
        super().__init__()
        self.cell, self.steps, self.pair = cell(3, 4), steps, cell is nn.LSTMCell

    def forward(self, x):
        st, outs = None, []
        for t in range(self.steps):
            st = self.cell(x[:, t], st)
            outs.append(st[0] if self.pair else st)
        return torch.stack(outs, 1)


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("cell,steps", [(nn.LSTMCell, 2), (nn.LSTMCell, 3), (nn.GRUCell, 3), (nn.RNNCell, 2)])
def test_a_cell_unrolled_in_python_gives_autograds_gradients(cell, steps, backward):
    """The opaque node that recomputes a shared cell's earlier calls asks autograd for each parameter's gradient
    once (it was listed once per call, and its gradient, the sum over all of them, counted that many times)."""
    torch.manual_seed(0)
    model = CellLoop(cell, steps).double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, torch.randn(3, steps, 3, dtype=torch.float64), backward=backward)
    for step, b in enumerate((3, 2)):
        torch.manual_seed(10 + step)
        x = torch.randn(b, steps, 3, dtype=torch.float64)
        wt = torch.randn(b, steps, 4, dtype=torch.float64)
        y, gx = _step(w, x, wt)
        y_ref, gx_ref = _step(ref, x, wt)
        assert _rel(y, y_ref) <= 1e-12 and _rel(gx, gx_ref) <= 1e-12
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) <= 1e-12, f"step {step}: {n}"


class WordLM(nn.Module):
    """PyTorch's word-language-model pattern: dropout on the embeddings and on the layer's whole output."""

    def __init__(self, cell: type, batch_first: bool):
        super().__init__()
        self.emb, self.drop, self.dec = nn.Embedding(20, 6), nn.Dropout(0.3), nn.Linear(5, 20)
        self.rnn, self.batch_first = cell(6, 5, batch_first=batch_first), batch_first

    def forward(self, ids):
        e = self.drop(self.emb(ids))
        out, _ = self.rnn(e if self.batch_first else e.transpose(0, 1))
        out = self.drop(out)
        return self.dec(out if self.batch_first else out.transpose(0, 1))


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_dropout_on_a_recurrent_output_draws_the_models_mask(cell, batch_first):
    """In train mode the graph's recurrent output is laid out as the layer's (time-major memory), so dropout on
    it draws the model's mask from the same seed: the model is planned (it was refused as computing another
    output than its forward), and outputs and gradients are autograd's, step after step."""
    torch.manual_seed(0)
    model = WordLM(cell, batch_first).double()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, torch.randint(0, 20, (4, 9)), backward="scan")
    assert any(isinstance(u, RecurrentNodeUnit) for u in w.plan.units)
    for step, b in enumerate((4, 3)):
        ids = torch.randint(0, 20, (b, 9), generator=torch.Generator().manual_seed(step))
        wt = torch.randn(b, 9, 20, dtype=torch.float64)
        torch.manual_seed(5 + step)
        y, _ = _step(w, ids, wt)
        torch.manual_seed(5 + step)
        y_ref, _ = _step(ref, ids, wt)
        assert _rel(y, y_ref) <= 1e-12
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert _rel(p.grad, q.grad) <= 1e-11, f"step {step}: {n}"


class TimeMajorClassifier(nn.Module):
    """Time-major as ``nn.GRU`` takes it by default: ``x`` is ``(T, B, I)``, the last layer's final state read."""

    def __init__(self, bidirectional=False):
        super().__init__()
        self.rnn = nn.GRU(3, 5, num_layers=2, bidirectional=bidirectional)
        self.fc = nn.Linear(10 if bidirectional else 5, 2)

    def forward(self, x):
        _, h = self.rnn(x)
        return self.fc(torch.cat([h[-2], h[-1]], 1) if self.rnn.bidirectional else h[-1])


class TimeMajorWordLM(nn.Module):
    """PyTorch's word-language-model example as written: token ids ``(T, B)``, dropout on the embeddings and on
    the LSTM's output, an initial state made from ``input.size(1)``, the logits flattened ``(T * B, V)``."""

    def __init__(self):
        super().__init__()
        self.emb, self.drop, self.dec = nn.Embedding(20, 6), nn.Dropout(0.3), nn.Linear(5, 20)
        self.rnn = nn.LSTM(6, 5, num_layers=2)

    def forward(self, ids):
        h0 = torch.zeros(2, ids.size(1), 5, dtype=self.dec.weight.dtype)
        out, _ = self.rnn(self.drop(self.emb(ids)), (h0, h0))
        return self.dec(self.drop(out)).view(-1, 20)


class TimeMajorSizes(nn.Module):
    """A forward that reads its input's sizes as numbers (``T, B, _ = x.shape``), an RNN's output mean over time."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(3, 4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        T, B, _ = x.shape
        out, _ = self.rnn(x)
        return self.fc(out.sum(0) / T)


TIME_MAJOR = {
    "classifier": (TimeMajorClassifier, lambda t, b: torch.randn(t, b, 3)),
    "bidirectional": (lambda: TimeMajorClassifier(True), lambda t, b: torch.randn(t, b, 3)),
    "word_lm": (TimeMajorWordLM, lambda t, b: torch.randint(0, 20, (t, b))),
    "sizes": (TimeMajorSizes, lambda t, b: torch.randn(t, b, 3)),
}


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("example", [(6, 3), (2, 2), (1, 1)])
@pytest.mark.parametrize("name", list(TIME_MAJOR))
def test_a_model_that_reads_its_input_time_major(name, example, backward):
    """A model whose input is ``(T, B, ...)`` (the recurrent layers' default layout) is planned with its batch on
    dim 1: the plan takes the input batch first (a view of the caller's memory) and hands the model its own
    layout, so the layer is a recurrent node (it was planned with the time steps as the batch, the recurrent
    layer then recomputed inside an opaque node, or refused as "nothing to scan" where ``h_n`` was read).
    Outputs and gradients are autograd's in train mode (dropout draws the model's masks), as the sequence length
    and the batch size change, from examples where they are equal or 1."""
    make, example_of = TIME_MAJOR[name]
    torch.manual_seed(0)
    model = make().double()
    ref = copy.deepcopy(model)
    x0 = example_of(*example)
    x0 = x0.double() if x0.is_floating_point() else x0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, x0, backward=backward)
    if backward == "scan":
        assert w.plan.input_batch_dim == 1
        assert any(isinstance(u, RecurrentNodeUnit) for u in w.plan.units)
        # the layer is not recomputed inside another node (what reads its results may run as its own call:
        # ``out.sum(0) / T``)
        names = [u.name for u in w.plan.units]
        assert not [u for u in w.plan.units if type(u) is OpaqueUnit and "rnn" in u.name], names
    for step, (t, b) in enumerate([(6, 3), (6, 2), (4, 3), (2, 2)]):
        x = example_of(t, b)
        x = x.double() if x.is_floating_point() else x
        _same_step(w, model, ref, x, step, seed=7 + step)


def test_a_batch_first_model_feeding_a_time_major_layer_stays_batch_first():
    """A model that transposes its batch-first input for a time-major layer is batch first, also where the
    example's batch and length are equal (the layer's time steps, not its batch, follow the input's dim 1)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for x in (torch.randn(4, 4, 3), torch.randn(3, 6, 3)):
            w = spscan.wrap(TimeMajor(), x, backward="scan")
            assert w.plan.input_batch_dim == 0
            w2 = spscan.wrap(TimeMajorClassifier(), x, backward="scan")
            assert w2.plan.input_batch_dim == 1


def test_a_cell_wrapped_alone_says_why_there_is_nothing_to_scan():
    """``nn.LSTMCell`` returns ``(h, c)``: the whole forward is one call. A forced scan says so (it said the
    result was "its input moved or copied by no layer"); ``auto`` runs the cell's own backward."""
    from spscan.runtime.choices import NativeModule

    x = torch.randn(3, 4)
    with pytest.raises(spscan.NotPlannable, match="the whole forward would be one call of its own"):
        spscan.wrap(nn.LSTMCell(4, 8), x, backward="scan")
    with pytest.warns(UserWarning, match="one call of its own"):
        assert isinstance(spscan.wrap(nn.LSTMCell(4, 8), x, backward="auto"), NativeModule)


class _SqueezedState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = nn.GRU(3, 5, batch_first=True), nn.Linear(5, 2)

    def forward(self, x):
        _, h = self.rnn(x)
        return self.fc(h.squeeze())


def test_squeeze_of_every_size_one_dim_at_batch_one():
    """``fc(h_n.squeeze())``: at batch 1 the model's forward drops the batch dim too (its output is ``(C,)``);
    the plan, traced at a batch of 2, keeps it. ``auto`` runs a batch of 1 as the model's own step (the model's
    output shape), a forced scan refuses it; other batches run the scan."""
    torch.manual_seed(0)
    model = _SqueezedState().double()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 6, 3, dtype=torch.float64)
    auto = spscan.wrap(model, x, backward="auto")
    forced = spscan.wrap(model, x, backward="scan")
    one = torch.randn(1, 6, 3, dtype=torch.float64)
    assert auto(one).shape == ref(one).shape == (2,)
    with pytest.raises(ValueError, match=r"squeeze\(\) without a dim"):
        forced(one)
    _same_step(forced, model, ref, torch.randn(3, 6, 3, dtype=torch.float64), 0)
