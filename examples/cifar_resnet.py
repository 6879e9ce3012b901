"""CIFAR-style ResNet-20, trained with autograd and through ``spscan.wrap`` side by side.

The ResNet-20 of He et al. (2016) for 32x32 images: a 3x3 convolution, three stages of three basic
blocks (16, 32 and 64 channels; option-A shortcuts: subsample and pad channels with zeros), global
average pooling and a Linear head, batch norm in train mode; the model is the one of ``resnet.py``
beside this script, which the tests and benchmarks also train. The whole model is wrapped with
``spscan.wrap``, and an ordinary ``loss.backward()`` trains it. The images are synthetic (no
downloads): each of the 10 classes is a fixed random 3x32x32 template plus noise.

    python examples/cifar_resnet.py              # B = 32, 10 timed steps per side
    python examples/cifar_resnet.py --quick      # B = 8, a few seconds
    python examples/cifar_resnet.py --device cuda --steps 50
"""

from __future__ import annotations

import torch
from torch import nn

from _side_by_side import parse, parser, train_side_by_side
from resnet import ResNet20


def synthetic_images(n_batches: int, batch: int, device: str, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(images, labels)`` batches: a class's fixed random template plus noise, ``(B, 3, 32, 32)``."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 3, 32, 32, generator=g)
    out = []
    for _ in range(n_batches):
        y = torch.randint(0, 10, (batch,), generator=g)
        x = templates[y] + torch.randn(batch, 3, 32, 32, generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0], steps=10, quick_steps=4)
    p.add_argument("--batch", type=int, default=None, help="batch size (default 32; 8 with --quick)")
    args = parse(p)
    batch = args.batch or (8 if args.quick else 32)
    print(f"ResNet-20 (option-A shortcuts, train mode) on 3x32x32 images, batch {batch}, on {args.device}")
    model = ResNet20(shortcut="A").to(args.device)
    batches = synthetic_images(8, batch, args.device, args.seed)
    train_side_by_side(model, batches, nn.functional.cross_entropy, steps=args.steps,
                       warmup=1 if args.quick else 2, lr=1e-3)


if __name__ == "__main__":
    main()
