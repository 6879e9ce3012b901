"""The reference CIFAR ResNet-20 (He et al. 2016): the model of ``cifar_resnet.py``, and the one the
benchmarks (``bench/``) and tests (``tests/``) train.

Plain PyTorch modules with nothing spscan-specific: ``spscan.wrap(ResNet20(), x)`` plans them like
any model ``torch.fx`` traces. One definition, so the example, the benchmark rows and the exactness
tests run the same architecture. It lives here, beside the example, rather than in the library; the
tests and benchmarks put this folder on ``sys.path`` and ``from resnet import ResNet20``.

* :class:`BasicBlock`: ``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``; where the shape
  changes the shortcut is option B (a 1x1 strided conv + BatchNorm) or option A (subsample by 2
  and zero-pad the channels, ``F.pad(x[:, :, ::2, ::2], ...)`` in a :class:`LambdaLayer`, as the
  common CIFAR code writes it: parameter-free).
* :class:`ResNet20`: a 3x3 stem, 3 stages of 3 blocks with ``width, 2*width, 4*width`` channels
  (16/32/64 in the paper), global average pooling and a linear classifier.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LambdaLayer", "BasicBlock", "ResNet20"]

_SHORTCUTS = ("A", "B")


class LambdaLayer(nn.Module):
    """A module around a function (the CIFAR ResNet code's option-A shortcut); fx traces through it."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


def _check_shortcut(shortcut: str) -> None:
    if shortcut not in _SHORTCUTS:
        raise ValueError(f"shortcut: expected 'A' or 'B', got {shortcut!r}")


class BasicBlock(nn.Module):
    """He et al. 2016 CIFAR BasicBlock, ``(B, cin, H, W) -> (B, cout, H/stride, W/stride)``.

    ``shortcut="B"``: a 1x1 conv + BatchNorm where the shape changes; ``"A"``: subsample by 2 and
    zero-pad ``(cout - cin) / 2`` channels on each side (needs ``stride == 2`` and an even
    ``cout - cin`` where the shape changes).
    """

    def __init__(self, cin: int, cout: int, stride: int, shortcut: str = "B") -> None:
        super().__init__()
        _check_shortcut(shortcut)
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Sequential()
        if stride != 1 or cin != cout:
            if shortcut == "B":
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            else:
                if stride != 2 or (cout - cin) % 2 or cout < cin:
                    raise ValueError(f"an option-A shortcut needs stride 2 and cout - cin even and >= 0, got "
                                     f"stride={stride}, cin={cin}, cout={cout}")
                pad = (cout - cin) // 2
                self.shortcut = LambdaLayer(lambda x: F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, pad, pad), "constant", 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return F.relu(out)


class ResNet20(nn.Module):
    """CIFAR ResNet-20, ``(B, 3, H, W) -> (B, classes)`` logits: widths ``width, 2*width, 4*width``."""

    def __init__(self, width: int = 16, classes: int = 10, shortcut: str = "B") -> None:
        super().__init__()
        _check_shortcut(shortcut)
        self.conv = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        layers, cin = [], width
        for stage, w in enumerate((width, 2 * width, 4 * width)):
            for b in range(3):
                layers.append(BasicBlock(cin, w, 2 if (stage > 0 and b == 0) else 1, shortcut))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.conv(x)))
        x = self.layers(x)
        x = F.adaptive_avg_pool2d(x, 1)
        x = x.view(x.size(0), -1)
        return self.fc(x)
