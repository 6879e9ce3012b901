"""Pixel-by-pixel GRU classifier, trained with autograd and through ``spscan.wrap`` side by side.

A 28x28 image is read one pixel at a time (T = 784 steps of one feature) by ``nn.GRU(1, 32)``; a Linear
head classifies the last hidden state. The whole model is wrapped with ``spscan.wrap``, and an ordinary
``loss.backward()`` trains it. The data is synthetic (no downloads): each of the 10 classes is a fixed
random template plus noise.

    python examples/pixel_gru.py                 # T = 784, B = 16, 20 timed steps per side
    python examples/pixel_gru.py --quick         # 14x14 images (T = 196), B = 16, a few seconds
    python examples/pixel_gru.py --device cuda --steps 50
"""

from __future__ import annotations

import torch
from torch import nn

from _side_by_side import parse, parser, train_side_by_side


class PixelGRU(nn.Module):
    def __init__(self, hidden: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.rnn = nn.GRU(1, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (B, T, 1), one pixel per step
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])


def synthetic_images(n_batches: int, batch: int, side: int, device: str, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(pixels, labels)`` batches: a class's fixed random template plus noise, flattened to ``(B, side*side, 1)``."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.rand(10, side * side, generator=g)
    out = []
    for _ in range(n_batches):
        y = torch.randint(0, 10, (batch,), generator=g)
        x = templates[y] + 0.3 * torch.randn(batch, side * side, generator=g)
        out.append((x.unsqueeze(-1).to(device), y.to(device)))
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=20, quick_steps=4)
    p.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    p.add_argument("--side", type=int, default=None, help="image side, T = side^2 (default 28; 14 with --quick)")
    args = parse(p)
    side = args.side or (14 if args.quick else 28)
    print(f"pixel GRU: nn.GRU(1, 32) over T = {side * side} pixels, batch {args.batch}, on {args.device}")
    model = PixelGRU().to(args.device)
    batches = synthetic_images(8, args.batch, side, args.device, args.seed)
    train_side_by_side(model, batches, nn.functional.cross_entropy, steps=args.steps,
                       warmup=1 if args.quick else 2, lr=3e-3)


if __name__ == "__main__":
    main()
