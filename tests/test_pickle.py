"""A wrapped model pickled (``torch.save`` of the whole module, ``copy.deepcopy``, what ``torch.multiprocessing``
sends a spawned process): it comes back as the same kind of wrapper around the unpickled model, planned again
where it is loaded, with the backward mode and train/eval flag it had, and trains as autograd does. (A plan
holds closures, device tables and recorded CUDA graphs: a chain, a CNN or a model with an opaque node could
not be pickled.)"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import spscan
from wrapper_models import Residual, output


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(11, 4), nn.Linear(4, 3)

    def forward(self, idx):
        return self.fc(self.emb(idx).mean(1))


#: name -> (make, example input)
MODELS = {
    "chain": (lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), lambda: torch.randn(4, 6)),
    "cnn": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                  nn.Linear(12, 3)), lambda: torch.randn(4, 2, 6, 6)),
    "residual": (Residual, lambda: torch.randn(4, 6)),
    "tokens": (_Tokens, lambda: torch.randint(0, 11, (4, 5))),
    "opaque_transformer": (lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                           lambda: torch.randn(4, 5, 8)),
    "gru": (lambda: nn.GRU(6, 5, batch_first=True), lambda: torch.randn(4, 7, 6)),
    "stacked_lstm": (lambda: nn.LSTM(6, 5, num_layers=2), lambda: torch.randn(7, 4, 6)),
}


_out = output


def _torch_save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("backward", ["scan", "auto"])
@pytest.mark.parametrize("how", ["torch.save", "deepcopy"])
def test_a_pickled_wrapper_is_wrapped_again(name, backward, how):
    make, example = MODELS[name]
    torch.manual_seed(0)
    model = make().double()
    x0 = example()
    x0 = x0.double() if x0.is_floating_point() else x0
    wrapped = spscan.wrap(model, x0, backward=backward)
    _out(wrapped(x0)).sum().backward()  # a trained wrapper: its plan holds buffers and step closures
    wrapped.eval()
    back = _torch_save_load(wrapped) if how == "torch.save" else copy.deepcopy(wrapped)
    assert type(back) is type(wrapped) and back.backward_mode == backward and not back.training
    inner = back.model if hasattr(back, "model") else back.module
    assert inner is not (wrapped.model if hasattr(wrapped, "model") else wrapped.module)
    assert [id(p) for p in back.parameters()] == [id(p) for p in inner.parameters()]  # shared, as wrap shares them
    ref = copy.deepcopy(model)
    for p, q in zip(inner.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    back.train()
    ref.train()
    for m in (inner, ref):
        m.zero_grad(set_to_none=True)
    x = example()
    x = x.double() if x.is_floating_point() else x
    ya, yb = back(x), ref(x)
    assert torch.allclose(_out(ya), _out(yb), rtol=1e-12, atol=1e-12)
    _out(ya).square().sum().backward()
    _out(yb).square().sum().backward()
    for p, q in zip(inner.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12)


def test_a_wrapper_made_without_spscan_wrap_pickles_as_a_module():
    """A front end's wrapper made directly (no record of how ``spscan.wrap`` made it) pickles field by field,
    as any module (the recurrent ones can)."""
    from spscan.recurrent.wrapper import wrap_recurrent

    w = wrap_recurrent(nn.RNN(3, 4).double(), torch.randn(5, 2, 3, dtype=torch.float64))
    assert w.wrapped_as is None
    back = _torch_save_load(w)
    assert type(back) is type(w) and back.plan is not w.plan
