"""Analytic floors of the GPU benchmark rows: the fewest bytes and multiply-adds a row's work needs.

Every CUDA row of the recurrent suites records, in ``extra_info``, ``floor_bytes`` (each input read
once, each output written once, float32), ``floor_macs`` (the multiply-adds a parallel scan cannot
avoid), ``floor_ms`` (the larger of the bytes at the device's copy bandwidth and the multiply-adds at
its FP32 FMA rate) and ``fraction_of_floor`` (floor time over measured time: 1 is the floor).

A recurrent backward of ``T`` steps, ``B`` samples, ``G`` gate blocks of ``H`` units and state size
``m`` (``H``; ``2H`` for the LSTM): it reads the per-step Jacobian factors (``v`` numbers per step and
sample: RNN ``H``, GRU ``4H``, LSTM ``6H``), the per-step losses' gradients (``H``) and the forward's
``h_{t-1}`` (``H``), and writes the gate pre-activation gradients (``G H``) and the input gradient
(``I``). A scan composes ``m x m`` maps: ``m^3`` multiply-adds per step and sample; the weight
gradients are ``G H (H + I + 1)`` more. A training step adds the forward: ``G H (H + I)`` multiply-adds
per step and sample, ``I`` read and ``H`` plus the factors written.
"""

from __future__ import annotations

import torch

# (bytes per second of a device copy, read plus write; FP32 multiply-adds per second) by device name
_DEVICES = {"H100": (2.7e12, 33.5e12), "H200": (3.6e12, 33.5e12), "A100": (1.6e12, 9.7e12)}
_DEFAULT = _DEVICES["H100"]
_GATES = {"rnn": 1, "gru": 3, "lstm": 4}
_FACTORS = {"rnn": 1, "gru": 4, "lstm": 6}


def device_rates() -> tuple[float, float]:
    """(copy bytes per second, FP32 multiply-adds per second) of the current CUDA device (H100 if unknown)."""
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return next((v for k, v in _DEVICES.items() if k in name), _DEFAULT)


def recurrent_floor(cell: str, T: int, B: int, H: int, inputs: int, mode: str, measured_s: float) -> dict:
    """The floor fields of a recurrent row (``cell`` rnn/gru/lstm, ``mode`` backward/step/forward)."""
    G, v = _GATES[cell], _FACTORS[cell] * H
    m = 2 * H if cell == "lstm" else H
    nbytes = macs = 0
    if mode in ("backward", "step"):
        nbytes += 4 * T * B * (v + H + H + G * H + inputs)
        macs += T * B * (m ** 3 + G * H * (H + inputs + 1))
    if mode in ("forward", "step"):
        nbytes += 4 * T * B * (inputs + H + v)
        macs += T * B * G * H * (H + inputs)
    bw, fma = device_rates()
    floor_s = max(nbytes / bw, macs / fma)
    return dict(floor_bytes=nbytes, floor_macs=macs, floor_ms=floor_s * 1e3,
                fraction_of_floor=floor_s / measured_s if measured_s > 0 else None)
