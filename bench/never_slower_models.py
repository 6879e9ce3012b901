"""The models of the "never slower" suite (``bench/test_never_slower.py``), each with its batch, its
input and output shapes and the loss of its training step.

A :class:`Case` builds a fresh model (seeded, so two calls give identical weights), a batch of
inputs and labels on a device, and the loss of one step from the model's output. The model passed
to ``spscan.wrap`` is :attr:`Case.make`'s module; a recurrent case's linear head (on the last
output) stays outside it on both sides, as in ``bench/test_recurrent_step.py``.

Families: ``cnn`` (LeNet-5 and the small VGG of ``bench/test_cnn_step.py``, an AlexNet-like CNN with
overlapping 3/2 max-pools and dropout, ResNet-20 of ``examples/resnet.py``, a depthwise-separable
MobileNet-like stack, an MLP with LayerNorm, a GroupNorm CNN, an EfficientNet-like block with
squeeze-and-excitation), ``recurrent`` (``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM``, input 32, hidden 64,
T = 100 and 1000, B = 1 and 16) and ``transformer`` (``nn.TransformerEncoderLayer``, an MLP-Mixer
block, a one-block ViT, a GPT-style block on token ids). Every model is in train mode (BatchNorm with batch
statistics, dropout on).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from test_cnn_step import lenet5, vgg_small

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")  # the reference ResNet-20: examples/resnet.py
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from resnet import ResNet20  # noqa: E402

__all__ = ["Case", "CASES", "CASE_NAMES", "alexnet_like", "mobilenet_like", "groupnorm_cnn", "efficientnet_like",
           "layernorm_mlp", "MixerBlock", "TinyViT", "GPTBlock", "transformer_encoder_layer", "recurrent"]

SEED = 0
RNN_INPUT, RNN_HIDDEN = 32, 64


def alexnet_like() -> nn.Sequential:
    """AlexNet's shape at a small width: an 11x11 stride-4 stem, overlapping 3/2 max-pools, dropout
    before both linear layers; ``(B, 3, 127, 127) -> (B, 10)``."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),  # 31 -> 15
        nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),  # 15 -> 7
        nn.Conv2d(32, 48, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),  # 7 -> 3
        nn.Flatten(), nn.Dropout(0.5), nn.Linear(48 * 3 * 3, 64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 10),
    )


def mobilenet_like() -> nn.Sequential:
    """A 3x3 stride-2 stem, then depthwise-separable blocks (3x3 depthwise ``groups=C`` + BatchNorm + ReLU,
    1x1 pointwise + BatchNorm + ReLU), average pooling and a linear classifier; ``(B, 3, 32, 32) -> (B, 10)``
    (the stack of ``bench/test_planning.py``, here trained: batch statistics)."""
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU()]
    c = 16
    for out, stride in [(32, 1), (64, 2), (64, 1), (128, 2)]:
        layers += [nn.Conv2d(c, c, 3, stride=stride, padding=1, groups=c), nn.BatchNorm2d(c), nn.ReLU(),
                   nn.Conv2d(c, out, 1), nn.BatchNorm2d(out), nn.ReLU()]
        c = out
    return nn.Sequential(*layers, nn.AvgPool2d(4), nn.Flatten(), nn.Linear(c, 10))


def groupnorm_cnn() -> nn.Sequential:
    """Three 3x3 convolutions with GroupNorm(8) and ReLU, a max-pool, global average pooling and a linear
    classifier; ``(B, 3, 32, 32) -> (B, 10)``."""
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.GroupNorm(8, 64), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


class SqueezeExcite(nn.Module):
    """EfficientNet's squeeze-and-excitation: ``x * sigmoid(fc2(silu(fc1(mean_hw(x)))))`` (a product of two
    activations, broadcast over the pixels)."""

    def __init__(self, c: int, r: int = 4) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c, c // r), nn.Linear(c // r, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.sigmoid(self.fc2(F.silu(self.fc1(x.mean((2, 3))))))
        return x * w[:, :, None, None]


def efficientnet_like() -> nn.Sequential:
    """A stem, one MBConv-like block (depthwise 3x3, BatchNorm, SiLU, squeeze-and-excitation, 1x1 projection)
    and a classifier; ``(B, 3, 32, 32) -> (B, 10)``."""
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.SiLU(),
                         nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.BatchNorm2d(32), nn.SiLU(), SqueezeExcite(32),
                         nn.Conv2d(32, 64, 1), nn.BatchNorm2d(64), nn.SiLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def layernorm_mlp(width: int = 256, depth: int = 4) -> nn.Sequential:
    """``depth`` x [Linear(width, width), LayerNorm(width), GELU], then Linear(width, 10)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def transformer_encoder_layer() -> nn.Module:
    """``nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)`` (dropout 0.1)."""
    return nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128, batch_first=True)


class MixerBlock(nn.Module):
    """One MLP-Mixer block on ``(B, tokens, channels)``: a token-mixing MLP across the tokens, then a
    channel-mixing MLP, each after a LayerNorm and with a residual connection."""

    def __init__(self, tokens: int = 16, channels: int = 64, token_hidden: int = 32, channel_hidden: int = 128):
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.token_fc1 = nn.Linear(tokens, token_hidden)
        self.token_fc2 = nn.Linear(token_hidden, tokens)
        self.norm2 = nn.LayerNorm(channels)
        self.channel_fc1 = nn.Linear(channels, channel_hidden)
        self.channel_fc2 = nn.Linear(channel_hidden, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x).transpose(1, 2)
        x = x + self.token_fc2(F.gelu(self.token_fc1(y))).transpose(1, 2)
        return x + self.channel_fc2(F.gelu(self.channel_fc1(self.norm2(x))))


class TinyViT(nn.Module):
    """A one-block ViT on ``(B, 3, 32, 32)``: an 8x8 patch-embedding conv (16 patches), a cls token and a
    learned positional embedding, one pre-norm attention block written with ``matmul`` and ``softmax``,
    one MLP block, and a linear head on the cls token; ``-> (B, 10)``."""

    def __init__(self, dim: int = 64, heads: int = 4, patch: int = 8, image: int = 32, hidden: int = 128,
                 classes: int = 10):
        super().__init__()
        self.heads = heads
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # (B, N, D)
        b, n, d = x.shape
        x = torch.cat([self.cls.expand(b, -1, -1), x], dim=1) + self.pos
        h = self.heads
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n + 1, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d // h), dim=-1)
        x = x + self.proj(torch.matmul(att, v).transpose(1, 2).reshape(b, n + 1, d))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.head(self.norm(x[:, 0]))


class GPTBlock(nn.Module):
    """A decoder-only language model's first block: token and position embeddings, pre-norm causal
    self-attention (``F.scaled_dot_product_attention(is_causal=True)``), a GELU MLP and the vocabulary head;
    token ids ``(B, T) -> (B, T, vocab)``."""

    def __init__(self, vocab: int = 512, dim: int = 64, tokens: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(tokens, dim) * 0.02)
        self.norm1, self.qkv, self.proj = nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm2, self.fc1, self.fc2 = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return self.head(x)


def recurrent(cell: str) -> Callable[[], nn.Module]:
    kind = {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}[cell]
    return lambda: kind(RNN_INPUT, RNN_HIDDEN, batch_first=True)


@dataclass(frozen=True)
class Case:
    """One row's model: ``make()`` builds it (untrained, seeded), ``input_shape`` / ``output_shape`` are
    per sample (a recurrent case's output is its sequence output ``(T, hidden)``), ``loss`` is
    ``"ce"`` (cross-entropy on ``classes`` random labels) or ``"square"`` (``out.square().mean()``);
    ``head`` is a recurrent case's linear head on the last output (outside the wrapped module)."""

    name: str
    family: str
    batch: int
    make: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    loss: str = "ce"
    classes: int = 10
    head: Optional[int] = None
    vocab: Optional[int] = None  # token ids in [0, vocab) instead of a float input

    def build(self, device: str = "cpu") -> tuple[nn.Module, Optional[nn.Module]]:
        """A fresh model in train mode and its head (or None), identical on every call."""
        torch.manual_seed(SEED)
        model = self.make().train().to(device)
        head = nn.Linear(self.head, self.classes).to(device) if self.head else None
        return model, head

    def data(self, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(SEED + 1)
        if self.vocab:
            x = torch.randint(0, self.vocab, (self.batch, *self.input_shape), generator=g)
        else:
            x = torch.randn(self.batch, *self.input_shape, generator=g)
        y = torch.randint(0, self.classes, (self.batch,), generator=g)
        return x.to(device), y.to(device)

    def step_loss(self, out, head: Optional[nn.Module], y: torch.Tensor) -> torch.Tensor:
        """The loss of one step from the model's output (a recurrent module's ``(output, state)``)."""
        if isinstance(out, tuple):
            out = out[0]
        if head is not None:
            out = head(out[:, -1])
        if self.loss == "square":
            return out.square().mean()
        return F.cross_entropy(out, y)


def _cases() -> list[Case]:
    cases = [
        Case("lenet5", "cnn", 64, lenet5, (3, 32, 32), (10,)),
        Case("vgg_small", "cnn", 32, vgg_small, (3, 32, 32), (10,)),
        Case("alexnet_like", "cnn", 32, alexnet_like, (3, 127, 127), (10,)),
        Case("resnet20", "cnn", 16, ResNet20, (3, 32, 32), (10,)),
        Case("mobilenet_like", "cnn", 32, mobilenet_like, (3, 32, 32), (10,)),
        Case("layernorm_mlp", "cnn", 64, layernorm_mlp, (256,), (10,)),
        Case("groupnorm_cnn", "cnn", 32, groupnorm_cnn, (3, 32, 32), (10,)),
        Case("efficientnet_like", "cnn", 32, efficientnet_like, (3, 32, 32), (10,)),
    ]
    for cell in ("rnn", "gru", "lstm"):
        for T in (100, 1000):
            for B in (1, 16):
                cases.append(Case(f"{cell}_T{T}_B{B}", "recurrent", B, recurrent(cell), (T, RNN_INPUT),
                                  (T, RNN_HIDDEN), head=RNN_HIDDEN))
    cases += [
        Case("transformer_encoder", "transformer", 16, transformer_encoder_layer, (32, 64), (32, 64), loss="square"),
        Case("mlp_mixer", "transformer", 16, MixerBlock, (16, 64), (16, 64), loss="square"),
        Case("vit_tiny", "transformer", 16, TinyViT, (3, 32, 32), (10,)),
        Case("gpt_block", "transformer", 16, GPTBlock, (32,), (32, 512), loss="square", vocab=512),
    ]
    return cases


CASES: list[Case] = _cases()
CASE_NAMES: dict[str, Case] = {c.name: c for c in CASES}
