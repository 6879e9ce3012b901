"""CIFAR-10 for the convergence suite: the official python batches when present, else a synthetic stand-in.

The official archive (``cifar-10-python.tar.gz``, extracted to ``cifar-10-batches-py/``) stores
each batch as a pickled dict with ``b"data"`` (uint8, ``(10000, 3072)``) and ``b"labels"``. Only
those official files are unpickled; the directory comes from ``SPSCAN_CIFAR10`` or the usual
cache locations. Without them a deterministic, learnable stand-in of the same shape is used.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Optional

import numpy as np
import torch

_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)[:, None, None]
_STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)[:, None, None]


def find_cifar10() -> Optional[Path]:
    """The ``cifar-10-batches-py`` directory, or ``None``."""
    cands = []
    if os.environ.get("SPSCAN_CIFAR10"):
        cands.append(Path(os.environ["SPSCAN_CIFAR10"]).expanduser())
    home = Path.home()
    cands += [home / ".cache" / "cifar-10-batches-py", home / ".cache" / "cifar10" / "cifar-10-batches-py",
              home / "data" / "cifar-10-batches-py"]
    for c in cands:
        for d in (c, c / "cifar-10-batches-py"):
            if (d / "data_batch_1").is_file():
                return d
    return None


def _read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, "rb") as f:
        d = pickle.load(f, encoding="bytes")  # official CIFAR-10 batch file
    x = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    return x, np.asarray(d[b"labels"], dtype=np.int64)


def synthetic_cifar(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` CIFAR-shaped images ``(n, 3, 32, 32)`` (float32, normalized) with 10 learnable classes."""
    templates = np.random.default_rng(1234).standard_normal((10, 3, 8, 8)).astype(np.float32)
    templates = templates.repeat(4, axis=2).repeat(4, axis=3)  # smooth 4x4 blocks, as in natural images
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 10, size=n)
    x = 0.7 * templates[y] + rng.standard_normal((n, 3, 32, 32)).astype(np.float32)
    return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))


def cifar10_train(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, str]:
    """First ``n`` training images (normalized float32), labels and a description of the source."""
    root = find_cifar10()
    if root is None:
        x, y = synthetic_cifar(n, seed)
        return x, y, "synthetic CIFAR-shaped data (no local CIFAR-10 found; set SPSCAN_CIFAR10)"
    xs, ys = [], []
    for k in range(1, 6):
        x, y = _read_batch(root / f"data_batch_{k}")
        xs.append(x)
        ys.append(y)
        if sum(len(v) for v in ys) >= n:
            break
    x = np.concatenate(xs)[:n].astype(np.float32) / 255.0
    x = (x - _MEAN) / _STD
    return torch.from_numpy(x), torch.from_numpy(np.concatenate(ys)[:n]), f"CIFAR-10 ({root})"
