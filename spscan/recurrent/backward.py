"""The recurrent wrapper's run through the autograd bridge (:func:`run_wrapped`), its backward beyond the
scan: its replay from a CUDA graph
(:class:`GraphedBackward`) and the weight-gradient rules (compiled on CPU, batched GEMMs elsewhere).

Used by :class:`spscan.recurrent.plan.RecurrentPlan`; imports no front end.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn

from spscan.recurrent.cells import sequence_dims
from spscan.runtime.autograd import apply as autograd_apply
from spscan.runtime.graphed import GraphedCall

__all__ = ["GraphedBackward", "any_nonzero", "check_input", "has_operands", "operand_weight_grads", "run_wrapped",
           "weight_grad"]


class GraphedBackward:
    """A recurrent backward's device work replayed from one CUDA graph per input signature: a
    :class:`~spscan.runtime.graphed.GraphedCall` of :meth:`RecurrentPlan._backward` whose signature also holds
    which gradients are wanted and the sequence's shape, and which keeps the engine's buffers the graph
    reads (a later batch size makes the engine hold new ones, and a replay must not write into memory
    handed to something else).

    The wrapper's backward on a GPU is many small launches (the values' and gradients' loads, the
    scan, the gathers of the gate gradients, the parameter GEMMs), and their host cost exceeded their
    device time. The weights are inputs too, so a parameter replaced by a new tensor is read where it is."""

    def __init__(self, record=None) -> None:
        self.call = GraphedCall(record)

    @property
    def entries(self) -> dict:
        return self.call.entries

    def __call__(self, plan, saved, args: tuple, wanted) -> dict:
        def backward(s_saved, s_args):
            return plan._backward(s_saved, *s_args, wanted)

        def hold() -> list:
            return [b.held_buffers() for b in plan.bindings_for(saved.T, saved.device, saved.dtype)]

        return self.call(backward, (saved, args), (wanted, saved.T, saved.B, saved.unbatched), hold)


def check_input(module: nn.Module, x: Any) -> None:
    """Refuse what a recurrent module's scan cannot take, naming it: a ``PackedSequence`` (with what to do
    instead), a non-tensor, a tensor of other than 2 or 3 dims, another feature size than ``module``'s."""
    if isinstance(x, nn.utils.rnn.PackedSequence):
        raise TypeError("PackedSequence inputs are not supported: pad them (torch.nn.utils.rnn.pad_packed_sequence) "
                        "and mask the loss of the padding steps instead")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a tensor input, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(f"expected input of 2 or 3 dims (T, I) / (T, B, I) / (B, T, I), got shape {tuple(x.shape)}")
    if x.shape[-1] != module.input_size:
        raise ValueError(f"expected input feature size {module.input_size}, got {x.shape[-1]}")


def has_operands(saved: Any) -> bool:
    """Whether :func:`operand_weight_grads` applies: a compiled forward kept the operands."""
    return getattr(saved, "operands", None) is not None


def operand_weight_grads(saved: Any, a_ih: torch.Tensor, a_hh: torch.Tensor, bias: bool):
    """``(W_ih, W_hh, b_ih, b_hh)`` gradients (biases ``None`` without ``bias``) from the pre-activation
    gradients ``(G, T*B)`` and the forward's operands ``z`` (rows ``h_{t-1}``, ``x_t``, ones: ``(H + I + 1,
    T*B)``): one BLAS GEMM ``z a^T`` for all of them where both sides share ``a`` (RNN, LSTM; the row of
    ones gives the bias), one per side otherwise (GRU: ``z``'s hidden rows against ``a_hh``, its input
    rows and ones against ``a_ih``). Each GEMM reads ``a`` once; the operands' rows are contiguous, as the
    compiled forward stores them, so no transposed copy is made.

    The BLAS GEMM, not a compiled reduction over ``T*B``: on a 2-core AVX-512 CPU it ran 2.5-3x faster at
    every size measured (G = 20..512, K = 23..259, N = 16000..480000; ``bench/results/cpu-2core/weight-grads.md``),
    and it uses the threads torch is given."""
    z = saved.operands
    H, I = saved.h_prev.shape[-1], saved.x.shape[-1]
    z = z.view(z.shape[0], -1)
    if a_ih is a_hh:
        both = z.mm(a_hh.t()).t()  # (G, H + I + 1)
        hh, ih, b_hh = both[:, :H], both[:, H:H + I], both[:, H + I]
        b_ih = b_hh
    else:
        hh = z[:H].mm(a_hh.t()).t()
        ih_all = z[H:].mm(a_ih.t()).t()  # (G, I + 1): the input rows and the row of ones
        ih, b_ih = ih_all[:, :I], ih_all[:, I]
        b_hh = a_hh.sum(1) if bias else None
    biases = (b_ih.clone(), b_hh.clone()) if bias else (None, None)  # separate tensors, each contiguous
    return (ih.contiguous(), hh.contiguous()) + biases


def weight_grad(pre: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    """``pre^T inp`` (``(G, K)`` from ``(N, G)`` and ``(N, K)``, ``N = T*B`` rows), computed as ``(inp^T pre)^T``:
    with ``K < G`` (the hidden and input sides) the BLAS GEMM runs faster that way round on CPU."""
    return inp.t().mm(pre).t()


def any_nonzero(t: torch.Tensor) -> bool:
    """``bool(t.any())`` for a CPU tensor (NaN counts, -0.0 does not), through NumPy for float32/float64:
    its reduction over a strided view is faster than torch's (a recurrent module's output gradients
    arrive as time-major views of batch-first memory)."""
    if t.dtype in (torch.float32, torch.float64):
        a = t.detach().numpy()
        # a loss on every step: its first step answers (NumPy's any reads everything)
        return bool(a.size and np.any(a[0])) or bool(np.any(a))
    return bool(t.any())


def run_wrapped(plan, module: nn.Module, x: torch.Tensor, hx, h0, c0, params: Sequence[torch.Tensor],
                graph: bool = False):
    """A recurrent wrapper's forward once its inputs are checked: the module's own outputs.

    An empty batch or sequence runs the module itself (nothing to scan); without anything needing a
    gradient the plan's forward runs without saving; otherwise, with ``graph``, the whole step replays
    from CUDA graphs where it can (``plan.run_step``), and else the autograd bridge records the plan's
    scan backward. Shared by the single-layer and the stacked wrappers.
    """
    grad_on = torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for p in params)
        or (h0 is not None and h0.requires_grad) or (c0 is not None and c0.requires_grad)
    )
    T, B = sequence_dims(x, module.batch_first)
    if T == 0 or B == 0:
        return module(x, hx)  # nothing to scan (an empty batch or no time steps): plain torch
    if not grad_on:
        with torch.no_grad():
            return plan.run_forward(x, hx, need_saved=False)[0]
    outs = plan.run_step(x, h0, c0, params) if graph else None
    if outs is None:
        outs = autograd_apply(plan, x, h0, c0, *params)
    return plan.cell.module_outputs(outs)
