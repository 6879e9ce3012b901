"""Fitting the step-cost profile of the machine at hand (:class:`spscan.planner.step_profile.StepProfile`).

``spscan.calibrate()`` (or ``python -m spscan calibrate``) times one training step of small models,
each run through the scan and through plain autograd (``native``) and, on a GPU, the scan's whole step
from CUDA graphs (``graph``), fits the profile's constants (non-negative least squares) and caches them
for this machine configuration. On a CPU each layer family is fitted from one-layer models; on a GPU,
where a one-layer step is launches and Python and its median moves by more than a layer costs, every
family gets the same constants, fitted to whole small models (:func:`fit_whole_models`). Planning reads the
cache and never times anything itself: a machine that was not calibrated plans with the reference
profile of its device class. It takes a few seconds to a minute, once per machine, torch build and
thread count.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn
from scipy.optimize import nnls

from spscan.api import wrap
from spscan.runtime.choices import current_key, device_label
from spscan.chain.planning import plan_model
from spscan.recurrent.cells import CELLS
from spscan.planner.step_profile import (OPTIONAL_REGIMES, REGIMES, REPLAYED_REGIMES, StepProfile, cache_dir,
                                         forget_loaded, recurrent_features, reference_profile)

__all__ = ["calibrate", "fit_recurrent", "fit_whole_models", "layer_features"]


# --------------------------------------------------------------------------- what is timed

# family -> [(module factory, per-sample input shape, batch)]: two sizes each, the first small
_FAMILIES: dict[str, list[tuple[Callable[[], nn.Module], tuple[int, ...], int]]] = {
    "ConvUnit": [(lambda: nn.Conv2d(4, 8, 3, padding=1), (4, 12, 12), 8),
                 (lambda: nn.Conv2d(16, 32, 3, padding=1), (16, 16, 16), 16)],
    "LinearUnit": [(lambda: nn.Linear(32, 32), (32,), 8), (lambda: nn.Linear(256, 256), (256,), 64)],
    "ElementwiseUnit": [(nn.ReLU, (8, 8, 8), 8), (nn.ReLU, (32, 16, 16), 32)],
    # the windows with a compiled CPU forward (2x2 and 3x3), then one without (ATen's forward in every regime)
    "MaxPoolUnit": [(lambda: nn.MaxPool2d(2), (4, 12, 12), 8), (lambda: nn.MaxPool2d(2), (16, 32, 32), 32),
                    (lambda: nn.MaxPool2d(3, 2), (16, 31, 31), 32)],
    "MaxPoolUnit/window": [(lambda: nn.MaxPool2d(4, 2), (4, 14, 14), 8),
                           (lambda: nn.MaxPool2d(4, 2), (16, 32, 32), 32)],
    "csr": [(nn.Tanh, (8, 8, 8), 8), (nn.Tanh, (32, 16, 16), 32)],  # timed with operators=False
    "AvgPoolUnit": [(lambda: nn.AvgPool2d(2), (4, 12, 12), 8), (lambda: nn.AvgPool2d(2), (16, 32, 32), 32)],
    "BatchNormUnit": [(lambda: nn.BatchNorm2d(4), (4, 8, 8), 8), (lambda: nn.BatchNorm2d(32), (32, 16, 16), 32)],
    "DropoutUnit": [(nn.Dropout, (256,), 8), (nn.Dropout, (4096,), 32)],
    # and a third, larger size: the per-element cost of a normalization (its O(d) operator) is below the
    # noise of two small points at two threads
    "LayerNormUnit": [(lambda: nn.LayerNorm(32), (32,), 8), (lambda: nn.LayerNorm(256), (256,), 64),
                      (lambda: nn.LayerNorm(512), (16, 512), 32)],
    "ReshapeUnit": [(nn.Flatten, (4, 4, 4), 8), (nn.Flatten, (32, 16, 16), 32)],
}
# one cell per family (the profile's key, Cell.family): nn.RNN's default tanh, nn.GRU, nn.LSTM
_CELLS = tuple(CELLS[name] for name in ("rnn_tanh", "gru", "lstm"))
# (input, hidden, T, B): short and long sequences, one sample and a batch (a long sequence's activations
# leave the caches), narrow and wide cells (a one-feature input runs other kernels than a wide one), and
# hidden sizes up to 256, where the multiply-adds outweigh the per-step costs (fitted on H <= 64 alone, an
# RNN of H = 128 was predicted 62 ms a step under autograd, measured ~100 ms)
_RECURRENT_POINTS = ((16, 32, 16, 1), (16, 32, 256, 1), (16, 32, 1000, 1), (16, 32, 128, 8), (16, 32, 1000, 16),
                     (16, 32, 2000, 16), (1, 20, 100, 16), (1, 20, 1000, 16), (1, 20, 3000, 16), (32, 64, 100, 16),
                     (32, 64, 1000, 16), (2, 128, 1000, 16), (32, 128, 300, 16), (16, 256, 200, 16))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_step(step: Callable[[], None], device: torch.device, reps: int) -> float:
    for _ in range(2):  # warm-up: lowering for this shape, allocator, compiled loops
        step()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _step_of(net: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        x.grad = None
        out = net(x)
        out = out[0] if isinstance(out, tuple) else out
        out.square().sum().backward()

    return step


def _wrapped(model: nn.Module, x: torch.Tensor, regime: str, **options: Any) -> nn.Module:
    return model if regime == "native" else wrap(model, x, backward=regime, **options)


def _regimes(device: torch.device) -> tuple[str, ...]:
    """The regimes a layer's step is timed in: on a GPU also the scan replayed from a CUDA graph."""
    return REGIMES + OPTIONAL_REGIMES if device.type == "cuda" else REGIMES


def _layer_time(make, in_shape, batch, regime, device, dtype, reps, csr: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(make()).to(device=device, dtype=dtype)
    x = torch.randn((batch, *in_shape), device=device, dtype=dtype, requires_grad=True)
    work = plan_model(model, x, levels=0).units[0].cost_work(batch)
    net = _wrapped(model, x, regime, **({"operators": False} if csr else {}))
    return work, _median_step(_step_of(net, x), device, reps)


def _fit(rows: list[list[float]], times: list[float], steps: Optional[list[float]] = None) -> list[float]:
    """Non-negative least squares in relative error (each measurement weighted by ``1 / step``, the measured
    step ``times`` is part of; default: ``times`` themselves): a choice compares two predictions, so a short
    step's error counts as much as a long one's."""
    a, t = np.asarray(rows, dtype=np.float64), np.asarray(times, dtype=np.float64)
    w = 1.0 / np.maximum(np.asarray(times if steps is None else steps, dtype=np.float64), 1e-9)
    coef, _ = nnls(a * w[:, None], t * w)
    return [float(c) for c in coef]


def _fit_families(device, dtype, reps) -> tuple[dict, dict]:
    base: dict[str, float] = {}
    regimes = _regimes(device)
    for regime in regimes:
        x = torch.randn((8, 4), device=device, dtype=dtype, requires_grad=True)
        base[regime] = _median_step(_step_of(_wrapped(nn.Sequential(nn.Identity()).to(device, dtype), x, regime), x),
                                    device, reps)
    families: dict[str, dict[str, tuple[float, float]]] = {}
    for family, samples in _FAMILIES.items():
        families[family] = {}
        for regime in regimes:
            rows, times = [], []
            for make, shape, batch in samples:
                work, t = _layer_time(make, shape, batch, regime, device, dtype, reps, family == "csr")
                rows.append([1.0, work])
                times.append(max(t - base[regime], 0.0))
            fixed, per = _fit(rows, times)
            families[family][regime] = (fixed, per)
    # a layer of a family not timed here costs what the costliest timed elementwise family does per element
    generic = ("ElementwiseUnit", "LayerNormUnit", "MaxPoolUnit/window")
    families["default"] = {r: max((families[f][r] for f in generic), key=lambda v: v[0] + v[1] * 1e5)
                           for r in regimes}
    return base, families


# whole models for a GPU's layer fit (see fit_models): small CNNs, a residual stack with batch-norm, a
# depthwise stack and a LayerNorm MLP with dropout, (module factory, per-sample input shape, batch)
def _lenet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84),
                         nn.ReLU(), nn.Linear(84, 10))


def _vgg() -> nn.Module:
    layers: list[nn.Module] = []
    c = 3
    for w in (16, 32, 64):
        layers += [nn.Conv2d(c, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c = w
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(64 * 16, 10))


def _bn_stack() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1)]
    for _ in range(6):
        layers += [nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=4)]
    return nn.Sequential(*layers, nn.AvgPool2d(8), nn.Flatten(), nn.Linear(16 * 4 * 4, 10))


def _ln_mlp() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(128, 256)]
    for _ in range(4):
        layers += [nn.LayerNorm(256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 256)]
    return nn.Sequential(*layers, nn.Linear(256, 10))


_MODELS = ((_lenet, (3, 32, 32), 64), (_vgg, (3, 32, 32), 32), (_bn_stack, (3, 32, 32), 16), (_ln_mlp, (128,), 64),
           (_lenet, (3, 32, 32), 8))


def layer_features(terms: list[tuple], regime: str) -> tuple[list[float], list[float]]:
    """What a profile that prices every family alike multiplies for ``regime``: ``[1, layers, work]`` of the
    cost terms its constants price, and ``[0, layers, work]`` of the terms priced as ``native`` in the other
    regimes (an opaque node's own operations), as :meth:`StepProfile.layers_time` prices them."""
    replayed = regime in REPLAYED_REGIMES
    own = [t for t in terms if len(t) < 3 or t[2] == regime or replayed]
    native = [t for t in terms if len(t) >= 3 and t[2] == "native" and regime != "native" and not replayed]
    return ([1.0, float(len(own)), float(sum(t[1] for t in own))],
            [0.0, float(len(native)), float(sum(t[1] for t in native))])


def fit_whole_models(samples: list[tuple[list[tuple], str, float]]) -> dict[str, list[float]]:
    """``{regime: [base, per layer, per work]}`` fitted to whole models' measured steps ``(cost terms,
    regime, seconds)``, the same constants for every family (non-negative least squares in relative
    error, each step weighted by its measured time); ``native`` first, as it also prices the scan's
    native terms."""
    regimes = sorted({r for _, r, _ in samples}, key=lambda r: (r != "native", r))
    coef: dict[str, list[float]] = {}
    for regime in regimes:
        rows, rest, steps = [], [], []
        for terms, r, t in samples:
            if r != regime:
                continue
            own, nat = layer_features(terms, regime)
            rows.append(own)
            rest.append(t - sum(c * x for c, x in zip(coef.get("native", [0.0] * 3), nat)))
            steps.append(t)
        coef[regime] = _fit(rows, rest, steps)
    return coef


def _fit_models(device, dtype, reps) -> tuple[dict, dict]:
    """A GPU's layer constants from whole small models (:data:`_MODELS`): a one-layer step there is launches
    and Python, and its median moves by more than a layer costs, so per-family fits are noise; every
    family gets the same constants (:func:`fit_whole_models`)."""
    samples = []
    for make, shape, batch in _MODELS:
        torch.manual_seed(0)
        model = make().to(device=device, dtype=dtype)
        x = torch.randn((batch, *shape), device=device, dtype=dtype, requires_grad=True)
        terms = [t for u in plan_model(model, x, levels=0).units for t in u.cost_terms(batch)]
        for regime in _regimes(device):
            t = _median_step(_step_of(_wrapped(model, x, regime), x), device, reps)
            samples.append((terms, regime, t))
    coef = fit_whole_models(samples)
    base = {r: c[0] for r, c in coef.items()}
    families = {f: {r: (c[1], c[2]) for r, c in coef.items()} for f in (*_FAMILIES, "default")}
    return base, families


def fit_recurrent(samples: list[tuple[str, str, list[float], float]]) -> dict[str, dict[str, tuple[float, ...]]]:
    """``{cell: {regime: (fixed, per step, per mac, per state)}}`` fitted to measured recurrent steps
    ``(cell, regime, features, seconds)``; ``features`` the sum of :func:`recurrent_features` over the
    module's (layer, direction)s (non-negative least squares in relative error)."""
    grouped: dict[tuple[str, str], tuple[list, list]] = {}
    for cell, regime, features, t in samples:
        rows, times = grouped.setdefault((cell, regime), ([], []))
        rows.append(list(features))
        times.append(t)
    out: dict[str, dict[str, tuple[float, ...]]] = {}
    for (cell, regime), (rows, times) in grouped.items():
        out.setdefault(cell, {})[regime] = tuple(_fit(rows, times))
    return out


def _fit_recurrent(device, dtype, reps) -> dict:
    samples = []
    for cell in _CELLS:
        for regime in _regimes(device):  # on a GPU also the whole step from CUDA graphs
            for n_in, hidden, seq_len, batch in _RECURRENT_POINTS:
                torch.manual_seed(0)
                module = cell.new_module(n_in, hidden).to(device=device, dtype=dtype)
                x = torch.randn((seq_len, batch, n_in), device=device, dtype=dtype, requires_grad=True)
                t = _median_step(_step_of(_wrapped(module, x, regime), x), device, reps)
                features = recurrent_features(cell.family, seq_len, batch, n_in, hidden)
                samples.append((cell.family, regime, features, t))
    return fit_recurrent(samples)


def calibrate(device: Any = None, *, reps: int = 7, save: bool = True, recurrent: bool = True,
              log: Optional[Callable[[str], None]] = None) -> StepProfile:
    """Fit this machine's step-cost profile (see the module docstring) at the current torch thread count.

    Args:
        device: the device to calibrate (default: CUDA when available, else the CPU).
        reps: timed steps per measurement (their median is fitted).
        save: cache the profile for this machine configuration (:func:`current_key`); planning reads it.
        recurrent: also fit the recurrent cells (``nn.RNN``/``GRU``/``LSTM``).
        log: called with one line per fitted family.

    Returns:
        the fitted :class:`~spscan.planner.step_profile.StepProfile`.
    """
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32
    key = current_key(dev)
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        # a CPU's one-layer steps are long enough to tell the families apart; a GPU's are not
        base, families = (_fit_models if dev.type == "cuda" else _fit_families)(dev, dtype, reps)
        cells = _fit_recurrent(dev, dtype, reps) if recurrent else {}
    label = f"{device_label(dev)}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    prof = StepProfile(key, dev.type, base, families, cells, "calibrated", label)
    if not recurrent:
        prof.recurrent = reference_profile(dev.type, torch.get_num_threads()).recurrent
    if log is not None:
        for f, regs in families.items():
            log(f"{f:<16} " + "  ".join(f"{r}: {a * 1e6:8.1f} us + {b * 1e9:7.3f} ns/work" for r, (a, b) in regs.items()))
        for c, regs in prof.recurrent.items():
            log(f"{c:<16} " + "  ".join(f"{r}: {v[0] * 1e6:8.1f} us + {v[1] * 1e6:6.2f} us/step + {v[2] * 1e12:6.2f} "
                                        f"ps/mac + {v[3] * 1e9:6.2f} ns/state" for r, v in regs.items()))
        log(f"fitted in {time.perf_counter() - t0:.1f} s ({label})")
    if save:
        prof.save(cache_dir() / f"{key}.json")
        forget_loaded()
    return prof
