"""Patterns as people post them, each of which once broke a wrapped model (crashes under ``auto``, a planner
that changed the model): autograd's outputs, gradients, parameters and buffers over steps, float64."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.parametrizations import orthogonal

import spscan


def _steps(model, batches, backward, loss=lambda y: y.square().sum(), atol=1e-12):
    """Wrap ``model`` with the first batch and train it and a copy under autograd on ``batches`` (SGD with
    momentum and weight decay): the same outputs, gradients (None-ness too), parameters and buffers."""
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, batches[0], backward=backward)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b), "wrapping changed a parameter"
    opt_w = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01)
    for step, x in enumerate(batches):
        opt_w.zero_grad()
        opt_r.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ya = w(x)
        yb = ref(x)
        torch.testing.assert_close(ya, yb, rtol=1e-12, atol=atol)
        loss(ya).backward()
        loss(yb).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=atol, msg=f"step {step}: {n}")
        opt_w.step()
        opt_r.step()
        for a, b in zip(model.buffers(), ref.buffers()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, msg=f"step {step}: a buffer differs")
    return w


class CharRNNHead(nn.Module):
    """char-rnn's head: ``fc(out.contiguous().view(-1, H)).view(B, T, -1)`` on a batch-first LSTM's output."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.fc = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x):
        out, _ = self.lstm(x)
        b, t, h = out.shape
        return self.fc(out.contiguous().view(-1, h)).view(b, t, -1)


class LastValidStep(nn.Module):
    """A GRU over padded token ids read at each sample's last valid step (``gather(lengths - 1)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.gru = nn.Embedding(10, 4, padding_idx=0), nn.GRU(4, 5, batch_first=True)
        self.fc = nn.Linear(5, 2)

    def forward(self, ids):
        lengths = (ids != 0).sum(1)
        out, _ = self.gru(self.emb(ids))
        last = out.gather(1, (lengths - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, out.shape[2]))
        return self.fc(last.squeeze(1))


class OpaqueIds(nn.Module):
    """Token ids into an opaque first node (a functional embedding of a module's weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.body = nn.Embedding(10, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))

    def forward(self, ids):
        return self.body(F.embedding(ids, self.e.weight).mean(1))


class MaxNormEmbedding(nn.Module):
    """``nn.Embedding(max_norm=1.0)``, which renormalizes the rows it reads in place in its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.fc = nn.Embedding(12, 5, max_norm=1.0), nn.Linear(5, 2)

    def forward(self, ids):
        return self.fc(self.e(ids).mean(1))


class Counter(nn.Module):
    """A step counter in a buffer, updated by the forward (``self.count += 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.count += 1
        return self.b(torch.tanh(self.a(x)))


def _ids(b, t, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 10, (b, t), generator=g)
    ids[:, t - 1 - seed % 2:] = 0  # padding at the end
    return ids


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_char_rnn_head_views_the_recurrent_output(backward):
    torch.manual_seed(0)
    _steps(CharRNNHead().double(), [torch.randn(b, 6, 3, dtype=torch.float64) for b in (4, 3, 4)], backward,
           loss=lambda y: y.sin().sum())


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_a_new_length_is_planned_from_the_callers_input(backward):
    """A sequence of a new length is planned from the call's own token ids: a zero batch (all padding) made
    ``lengths - 1`` negative in the model's gather, which raised under ``auto``."""
    torch.manual_seed(0)
    _steps(LastValidStep().double(), [_ids(4, 6, 0), _ids(3, 9, 1), _ids(4, 6, 2)], backward)


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_token_ids_into_an_opaque_first_node(backward):
    torch.manual_seed(0)
    _steps(OpaqueIds().double(), [_ids(4, 5, s) for s in range(3)], backward)


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_planning_leaves_an_embeddings_max_norm_rows(backward):
    torch.manual_seed(0)
    model = MaxNormEmbedding().double()
    with torch.no_grad():
        model.e.weight.mul_(3)  # rows above max_norm: the forward renormalizes those it reads
    _steps(model, [_ids(4, 5, s) for s in range(3)], backward)


def test_a_forward_that_counts_its_calls_in_a_buffer():
    """``self.count += 1`` on a buffer: the scan's step would not run it (refused under a forced scan; autograd's
    own step under ``auto``), and planning leaves the count as it was."""
    torch.manual_seed(0)
    model = Counter().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(spscan.NotPlannable):
        spscan.wrap(model, x, backward="scan")
    assert int(model.count) == 0
    _steps(model, [torch.randn(b, 4, dtype=torch.float64) for b in (3, 2, 3)], "auto")
    assert int(model.count) == 3


class _GRUHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.fc = nn.GRU(3, 5, batch_first=True), nn.Linear(5, 2)

    def forward(self, x):
        return self.fc(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("bare", [False, True])
def test_features_made_under_inference_mode(bare, backward):
    """Features from a frozen backbone run under ``torch.inference_mode()`` into a trainable recurrent head: the
    scan saved and marked its input, which inference tensors refuse."""
    torch.manual_seed(0)
    model = (nn.GRU(3, 5, batch_first=True) if bare else _GRUHead()).double()
    ref = copy.deepcopy(model)
    with torch.inference_mode():
        x = torch.randn(4, 30, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(model, x.clone(), backward=backward)
    ya, yb = w(x), ref(x.clone())
    ya, yb = (ya[0], yb[0]) if bare else (ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-13)


def test_a_parametrized_recurrent_module_wrapped_alone():
    """``orthogonal(nn.GRU(...), "weight_hh_l0")`` is a ``ParametrizedGRU``: not the recurrent front end's module
    (it was refused with a TypeError under ``auto``); wrapped as a traced model, it runs its own call."""
    torch.manual_seed(0)
    gru = orthogonal(nn.GRU(3, 3, batch_first=True).double(), "weight_hh_l0")
    ref = copy.deepcopy(gru)
    x = torch.randn(4, 7, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = spscan.wrap(gru, x, backward="auto")
    w(x)[0].square().sum().backward()
    ref(x)[0].square().sum().backward()
    for p, q in zip(gru.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_imagenet_size_convolutions_run_as_their_own_call():
    """A ResNet stem and 3x3 convolution at ImageNet size: their ``J^T`` would hold 10^8 entries each (planning
    took gigabytes and was killed); each runs as its own call and autograd backward, with autograd's gradients."""
    from spscan.layers.opaque import OpaqueUnit

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                          nn.MaxPool2d(3, 2, 1), nn.Conv2d(64, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64),
                          nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)).double()
    x = torch.randn(2, 3, 224, 224, dtype=torch.float64)
    w = _steps(model, [x, x.flip(0)], "scan", atol=1e-10)
    big = [u for u in w.plan.units if isinstance(u, OpaqueUnit) and "entries" in u.reason]
    assert len(big) == 2, [(type(u).__name__, getattr(u, "reason", "")) for u in w.plan.units]


class _Rotary(nn.Module):
    """An HF-style rotary cache grown in the forward when a sequence is longer than it (``register_buffer``)."""

    def __init__(self, dim: int, cached: int = 4) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).double() / dim)), persistent=False)
        self._set_cache(cached)

    def _set_cache(self, n: int) -> None:
        self.max_seq_len_cached = n
        freqs = torch.outer(torch.arange(n, dtype=self.inv_freq.dtype), self.inv_freq)
        self.register_buffer("cos_cached", torch.cat((freqs, freqs), -1).cos(), persistent=False)

    def forward(self, x, seq_len):
        if seq_len > self.max_seq_len_cached:
            self._set_cache(seq_len)
        return self.cos_cached[:seq_len].to(x.dtype)


class RotaryNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.rot, self.o = nn.Linear(8, 8), _Rotary(8), nn.Linear(8, 3)

    def forward(self, x):
        return self.o(self.q(x) * self.rot(x, x.shape[1]))


@pytest.mark.parametrize("backward", ["scan", "auto"])
def test_a_cache_the_forward_grows(backward):
    """Planning's own run of the forward grew the cache, then planning put the short one back under a plan
    traced with the long one (a size mismatch at the first step): the cache is left as it was for the trace,
    which sees the forward grow it (refused under a forced scan, autograd's step under ``auto``)."""
    torch.manual_seed(0)
    model = RotaryNet().double()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    if backward == "scan":
        with pytest.raises(spscan.NotPlannable):
            spscan.wrap(model, x, backward="scan")
        return
    _steps(model, [x, x * 0.5], backward)


class _SqueezeFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).squeeze(0))


def test_squeeze_of_dim_zero_at_batch_one():
    torch.manual_seed(0)
    model = _SqueezeFirst().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    forced = spscan.wrap(model, x, backward="scan")
    auto = spscan.wrap(model, x, backward="auto")
    one = torch.randn(1, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="squeeze"):
        forced(one)
    assert auto(one).shape == model(one).shape == (2,)


@pytest.mark.parametrize("norm", ["group", "layer", "softmax"])
def test_normalizations_too_large_for_dense_blocks(norm):
    """A GroupNorm at 64x64 (a diffusion U-Net's), a LayerNorm over (C, H, W), a softmax over 16384 entries:
    their dense J^T blocks hold 10^8-10^9 entries (planning ran out of memory under ``auto``). They are never
    built: the scan refuses such a chain at the depth it would run it (0, the blocks), and ``auto`` runs
    autograd's own step."""
    layer = {"group": nn.GroupNorm(8, 32), "layer": nn.LayerNorm([32, 16, 16]), "softmax": nn.Softmax(-1)}[norm]
    size = 64 if norm == "group" else 16
    tail = [nn.Flatten(1), layer] if norm == "softmax" else [layer, nn.SiLU(), nn.Conv2d(32, 2, 1)]
    model = nn.Sequential(nn.Conv2d(3, 32 if norm != "softmax" else 64, 3, padding=1), *tail).double()
    x = torch.randn(2, 3, size, size, dtype=torch.float64)
    with pytest.raises(spscan.NotPlannable, match=r"dense J\^T blocks would hold"):
        spscan.wrap(model, x, backward="scan")
    _steps(model, [x], "auto", atol=1e-10)
