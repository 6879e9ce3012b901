"""Small models of every wrapper kind (a chain, a CNN, a traced graph with a skip, single-layer and stacked
recurrent modules), shared by the tests of what a wrapped model meets in a training script: autocast,
``no_grad``, ``torch.compile``, pickling."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Residual(nn.Module):
    """A traced model with a skip (a block-level plan)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.c(F.gelu(self.b(torch.relu(self.a(x))) + x))


#: name -> (make, per-sample input shape; a recurrent module's is (T, I), batch first)
MODELS = {
    "chain": (lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)), (6,)),
    "cnn": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 3)),
            (2, 6, 6)),
    "residual": (Residual, (6,)),
    "rnn": (lambda: nn.RNN(6, 5, batch_first=True), (7, 6)),
    "gru": (lambda: nn.GRU(6, 5, batch_first=True), (7, 6)),
    "stacked_gru": (lambda: nn.GRU(6, 5, num_layers=2, batch_first=True), (7, 6)),
    "lstm": (lambda: nn.LSTM(6, 5, batch_first=True), (7, 6)),
    "stacked_lstm": (lambda: nn.LSTM(6, 5, num_layers=2, batch_first=True), (7, 6)),
}


def output(y):
    """A wrapper's (or module's) main output: a recurrent module's sequence output."""
    return y[0] if isinstance(y, tuple) else y
