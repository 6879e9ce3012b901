"""The recurrent wrapper's run through the autograd bridge (:func:`run_wrapped`), its backward beyond the
scan: its replay from a CUDA graph
(:class:`GraphedBackward`) and the weight-gradient rules (compiled on CPU, batched GEMMs elsewhere).

Used by :class:`spscan.recurrent.plan.RecurrentPlan`; imports no front end.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from spscan.runtime.autograd import apply as autograd_apply
from spscan.runtime.graphed import GraphedCall
from spscan.kernels.backend import cpu_ops

__all__ = ["GraphedBackward", "any_nonzero", "compiled_weight_grads", "reduce_in_scan", "run_wrapped",
           "split_hx", "weight_grad",
           "weight_grads_compile"]


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


#: the reduction in the scan pays for every lane of a tile, used or not: it is taken where at least this
#: share of the batch's tiles is samples
REDUCE_MIN_FILL = 0.75


def reduce_in_scan(wanted: Optional[frozenset], batch: int) -> bool:
    """Whether a backward of ``batch`` samples reduces its weight gradients in the scan
    (:class:`~spscan.runtime.Collect` with an operand) instead of from stored pre-activation gradients.

    Only where it wants parameter gradients but not the input's (which needs the stored gradients), and
    where the batch fills the compiled scan's tiles: the reduction multiplies every lane of a tile with
    the operands, so a batch of one does sixteen samples' work where the stored gradients' one GEMM
    over all steps does one (an LSTM, H = 64, T = 1000, B = 1, one thread: 29.9 ms against 17.2; at
    B = 16 the reduction is 8 % faster)."""
    if wanted is None or "input" in wanted or not any(n.startswith(("weight_", "bias_")) for n in wanted):
        return False
    lanes = cpu_ops.tile_samples()
    return batch >= lanes and batch / (-(-batch // lanes) * lanes) >= REDUCE_MIN_FILL


def weight_grads_compile(saved: Any, a_ih: torch.Tensor, a_hh: torch.Tensor) -> bool:
    """Whether :func:`compiled_weight_grads` applies: a compiled forward kept the operands, and the
    pre-activation gradients have contiguous rows (as the factored scan collects them)."""
    return getattr(saved, "operands", None) is not None and all(
        a.shape[1] < 2 or a.stride(1) == 1 for a in (a_ih, a_hh))


def compiled_weight_grads(saved: Any, a_ih: torch.Tensor, a_hh: torch.Tensor, bias: bool):
    """``(W_ih, W_hh, b_ih, b_hh)`` gradients (biases ``None`` without ``bias``) from the pre-activation
    gradients ``(G, T*B)`` and the forward's operands (rows ``h_{t-1}``, ``x_t``, ones), by
    :func:`spscan.kernels.cpu.nt.matmul_nt`: one compiled pass over ``a`` for all of them where
    both sides share it (RNN, LSTM), one per side otherwise (GRU). On CPU it replaces two GEMMs and
    a sum, each reading ``a``."""
    weight_gradients = cpu_ops.matmul_nt
    z = saved.operands
    H, I = saved.h_prev.shape[-1], saved.x.shape[-1]
    z = z.view(z.shape[0], -1)
    if a_ih is a_hh:
        both = weight_gradients(a_hh, z)
        hh, ih, b_hh = both[:, :H], both[:, H:H + I], both[:, H + I]
        b_ih = b_hh
    else:
        hh_all = weight_gradients(a_hh, z, [*range(H), H + I])
        ih_all = weight_gradients(a_ih, z, [*range(H, H + I + 1)])
        hh, b_hh, ih, b_ih = hh_all[:, :H], hh_all[:, H], ih_all[:, :I], ih_all[:, I]
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


def split_hx(kind: str, hx, B: int, H: int, like: torch.Tensor, unbatched: bool):
    """Initial ``h_0`` (B, H) and ``c_0`` (B, H) (LSTM) from the module's ``hx`` (zeros when None)."""
    dt, dev = like.dtype, like.device
    if hx is None:
        z = torch.zeros(B, H, dtype=dt, device=dev)
        return z, (z if kind == "lstm" else None)
    if kind == "lstm":
        h0, c0 = hx
        return h0.detach().reshape(B, H), c0.detach().reshape(B, H)
    return hx.detach().reshape(B, H), None


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
    empty = x.dim() == 3 and x.shape[0 if module.batch_first else 1] == 0
    if empty or x.shape[-2 if x.dim() == 2 else (1 if module.batch_first else 0)] == 0:
        return module(x, hx)  # nothing to scan (an empty batch or no time steps): plain torch
    if not grad_on:
        with torch.no_grad():
            return plan.run_forward(x, hx, need_saved=False)[0]
    outs = plan.run_step(x, h0, c0, params) if graph else None
    if outs is None:
        outs = autograd_apply(plan, x, h0, c0, *params)
    if plan.kind == "lstm":
        return outs[0], (outs[1], outs[2])
    return outs[0], outs[1]
