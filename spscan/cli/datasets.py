"""The paper's recurrent workloads (§4.1, §4.2) as seeded, in-memory datasets.

* ``bitstream_dataset``: bitstream classification (eq. 8). Class ``c in 0..9``; every bit
  ``x_t ~ Bernoulli(0.05 + 0.1 c)``.
* ``load_irmas_mfcc``: real IRMAS MFCC features from an ``.npz`` file the user prepared.
* ``synthetic_irmas``: a seeded stand-in with the same S / M / L shapes and 11 classes, for
  when the IRMAS audio is not at hand (it is not redistributed with this package).
"""

from __future__ import annotations

import os
from typing import Union

import numpy as np
import torch

__all__ = [
    "IRMAS_CLASSES",
    "IRMAS_SHAPES",
    "bitstream_dataset",
    "load_irmas_mfcc",
    "synthetic_irmas",
]

#: frames x coefficients per preprocessed set (paper Table 3). The coefficient count is
#: ``2 * (n_mfcc - 1)``: the MFCCs without the first (average power) one, plus their deltas.
IRMAS_SHAPES: dict[str, tuple[int, int]] = {"S": (259, 38), "M": (517, 24), "L": (1034, 12)}
#: IRMAS' predominant-instrument classes.
IRMAS_CLASSES = 11


def bitstream_dataset(
    num_samples: int, seq_len: int, *, num_classes: int = 10, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bitstream classification (paper eq. 8), deterministic in ``seed``.

    Returns ``x`` float32 ``(N, T, 1)`` of 0/1 bits (batch-first) and ``labels`` int64 ``(N,)``
    with ``x[k, t] ~ Bernoulli(0.05 + 0.1 * labels[k])``. Classes are balanced (round-robin,
    then shuffled).
    """
    if num_samples < 1 or seq_len < 1:
        raise ValueError(f"expected num_samples >= 1 and seq_len >= 1, got {num_samples} and {seq_len}")
    if not 1 <= num_classes <= 10:
        raise ValueError(f"expected 1 <= num_classes <= 10 (p = 0.05 + 0.1 c must stay below 1), got {num_classes}")
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_samples) % num_classes
    labels = labels[torch.randperm(num_samples, generator=g)]
    p = 0.05 + 0.1 * labels.to(torch.float32)
    u = torch.rand(num_samples, seq_len, generator=g)
    x = (u < p[:, None]).to(torch.float32).unsqueeze(-1)
    return x, labels


def _normalize_frames(features: np.ndarray) -> np.ndarray:
    """Zero mean, unit variance of every coefficient across the frames of each sample: (N, F, C)."""
    mean = features.mean(axis=1, keepdims=True)
    std = features.std(axis=1, keepdims=True)
    return (features - mean) / np.maximum(std, 1e-8)


def load_irmas_mfcc(path: Union[str, os.PathLike], set_name: str = "S", *, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Load real IRMAS MFCC features prepared by the user.

    Expected file: an ``.npz`` with ``features`` float ``(N, F, C)`` and ``labels`` int ``(N,)``
    in ``0..10``, where ``(F, C)`` is ``IRMAS_SHAPES[set_name]`` — e.g. made with
    ``librosa.feature.mfcc(y, sr=44100, n_mfcc=20, n_fft=4096, hop_length=512)`` for S (13 /
    2048 / 256 for M, 7 / 1024 / 128 for L), dropping coefficient 0, appending the deltas and
    transposing to frames-first. ``path`` may also be a directory holding ``irmas_{S,M,L}.npz``.

    Returns ``features`` float32 ``(N, F, C)`` (normalized per coefficient across frames unless
    ``normalize=False``) and ``labels`` int64 ``(N,)``.
    """
    if set_name not in IRMAS_SHAPES:
        raise ValueError(f"expected set_name in {sorted(IRMAS_SHAPES)}, got {set_name!r}")
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, f"irmas_{set_name}.npz")
    with np.load(path) as data:
        if "features" not in data or "labels" not in data:
            raise ValueError(f"expected arrays 'features' and 'labels' in {path}, got {sorted(data.files)}")
        feats = np.asarray(data["features"], dtype=np.float64)
        labels = np.asarray(data["labels"]).astype(np.int64)
    F, C = IRMAS_SHAPES[set_name]
    if feats.ndim != 3 or feats.shape[1:] != (F, C):
        raise ValueError(f"expected features of shape (N, {F}, {C}) for set {set_name}, got {feats.shape}")
    if labels.shape != (feats.shape[0],):
        raise ValueError(f"expected labels of shape ({feats.shape[0]},), got {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= IRMAS_CLASSES):
        raise ValueError(f"expected labels in 0..{IRMAS_CLASSES - 1}, got {labels.min()}..{labels.max()}")
    if normalize:
        feats = _normalize_frames(feats)
    return torch.from_numpy(feats.astype(np.float32)), torch.from_numpy(labels)


def synthetic_irmas(set_name: str = "S", num_samples: int = 512, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable stand-in for IRMAS MFCCs with the paper's shapes (``IRMAS_SHAPES``), 11 classes.

    Each class owns a random per-coefficient temporal modulation (frequency and phase); a
    sample is its class' modulation with random amplitude plus noise, normalized like the real
    features. Returns float32 ``(N, F, C)`` and int64 labels ``(N,)``, deterministic in ``seed``.
    """
    if set_name not in IRMAS_SHAPES:
        raise ValueError(f"expected set_name in {sorted(IRMAS_SHAPES)}, got {set_name!r}")
    if num_samples < 1:
        raise ValueError(f"expected num_samples >= 1, got {num_samples}")
    F, C = IRMAS_SHAPES[set_name]
    rng = np.random.default_rng(seed)
    class_rng = np.random.default_rng(1234)  # class templates do not depend on the sample seed
    freq = class_rng.uniform(0.5, 6.0, size=(IRMAS_CLASSES, C))  # cycles per clip
    phase = class_rng.uniform(0.0, 2 * np.pi, size=(IRMAS_CLASSES, C))
    labels = rng.permutation(np.arange(num_samples) % IRMAS_CLASSES)
    t = np.linspace(0.0, 1.0, F)[None, :, None]
    amp = rng.uniform(0.5, 1.5, size=(num_samples, 1, C))
    signal = amp * np.sin(2 * np.pi * freq[labels][:, None, :] * t + phase[labels][:, None, :])
    feats = signal + 0.8 * rng.standard_normal((num_samples, F, C))
    return torch.from_numpy(_normalize_frames(feats).astype(np.float32)), torch.from_numpy(labels.astype(np.int64))
