"""The recurrent front end's forward state and its compiled CPU forwards.

:class:`Saved` is what a recurrent module's backward needs from its forward. :class:`CompiledForwards`
holds the forward of a factored cell that runs in one compiled pass on a CPU (each cell's kernel,
:meth:`spscan.recurrent.cells.Cell.compiled_forward`), writing the chain's per-step values as they go; the plan
(:class:`~spscan.recurrent.plan.RecurrentPlan`) mixes them in and decides when they apply.
"""

from __future__ import annotations

from typing import Any

import torch

from spscan.kernels.backend import cpu_ops
from spscan.recurrent.cells import module_params, sequence_dims, time_major
from spscan.runtime import PeriodicValues
from spscan.runtime.autograd import holds_tensors

__all__ = ["Saved", "CompiledForwards"]


@holds_tensors
class Saved:
    """What the backward needs from one forward: time-major tensors and the chain's values.

    ``x`` (T, B, I), ``h_prev`` (T, B, H) = ``h_0..h_{T-1}`` (a copy, not a view of the outputs, which
    the caller may change in place), gate coefficients per kind, ``values`` (the chain's Jacobian
    values) and the sizes. The compiled CPU forwards also keep ``operands``: ``(H + I + 1, T, B)``,
    rows ``h_{t-1}``, ``x_t`` and ones, feature-major (``h_prev`` is a view of its first rows), the
    weight gradients' operand (:func:`~spscan.recurrent.backward.operand_weight_grads`); otherwise ``None``.
    Through autograd its tensors are kept by ``ctx.save_for_backward`` (:mod:`spscan.runtime.autograd`).
    """

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class CompiledForwards:
    """The compiled CPU forward of :class:`~spscan.recurrent.plan.RecurrentPlan` (a mixin: it reads the plan's
    ``module``, ``cell``, ``layout``, ``hidden_size`` and recycled ``buffers``)."""

    def _compiled_forward_applies(self, x: torch.Tensor, hx) -> bool:
        """Whether the factored cell's forward runs in one compiled pass
        (:meth:`~spscan.recurrent.cells.Cell.compiled_forward`, :mod:`spscan.kernels.cpu.recurrence`): CPU,
        float32/float64 input and state of the parameters' dtype, well-formed shapes; anything else runs the
        module (whose own checks then speak)."""
        if self.layout != "factored" or not cpu_ops.recurrence_available():
            return False
        m, p = self.module, self.module.weight_hh_l0
        if x.device.type != "cpu" or p.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) \
                or any(q.dtype != x.dtype for q in module_params(m)):
            return False
        unbatched = x.dim() == 2
        T, B = sequence_dims(x, m.batch_first)
        if T == 0 or B == 0:
            return False
        if hx is not None:
            want = (1, self.hidden_size) if unbatched else (1, B, self.hidden_size)
            parts = self.cell.hx_parts(hx)
            return parts is not None and all(isinstance(h, torch.Tensor) and tuple(h.shape) == want
                                             and h.dtype == x.dtype and h.device.type == "cpu" for h in parts)
        return True

    def _compiled_inputs(self, x: torch.Tensor, hx):
        """What every compiled CPU forward starts from: the input ``(T, B, I)`` (detached), ``T``, ``B``,
        whether it was unbatched, the detached parameters and the initial ``h_0`` (and ``c_0``)."""
        m, H = self.module, self.hidden_size
        unbatched = x.dim() == 2
        xt = time_major(x.detach(), m.batch_first, unbatched)
        T, B, _ = xt.shape
        params = [q.detach() for q in module_params(m)]
        h0, c0 = self.cell.initial_state(hx, B, H, xt)
        return xt, T, B, unbatched, params, h0, c0

    def _operands(self, xt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight gradients' operand for a compiled forward of ``xt`` ``(T, B, I)``: ``(H + I + 1, T, B)``
        from the plan's recycled buffers, rows ``H ..`` filled here (``x_t``, then ones); the forward
        writes rows ``0 .. H-1`` (``h_{t-1}``) as it goes. Also its ``x`` rows viewed ``(T, B, I)``: the
        input the forward reads (feature-major memory, as its tiles read it: no second copy)."""
        T, B, I = xt.shape
        H = self.hidden_size
        z = self.buffers.take("operands", (H + I + 1, T, B), xt.dtype)
        zn = z.numpy()  # CPU float32/float64 (the compiled forwards'): NumPy's copies dispatch faster
        zn[H: H + I] = xt.numpy().transpose(2, 0, 1)
        zn[H + I] = 1
        return z, z[H: H + I].permute(1, 2, 0)

    def _compiled_forward(self, x: torch.Tensor, hx):
        """The forward on CPU in one compiled pass that also writes the factored step's per-sample values
        (:meth:`~spscan.recurrent.cells.Cell.compiled_forward`: the gates are evaluated once, not recomputed
        from the module's outputs; the LSTM's ``c_t`` comes from the recurrence itself). Returns
        ``(outputs, saved)``: the module's outputs and the backward's state (``h_prev`` a view of the operands)."""
        m, H = self.module, self.hidden_size
        xt, T, B, unbatched, params, h0, c0 = self._compiled_inputs(x, hx)
        z, xz = self._operands(xt)
        batch_first = m.batch_first and not unbatched
        hs, c_n, coefs, step, encodings = self.cell.compiled_forward(xz, params, h0, c0, m.bias, batch_first,
                                                                     self.buffers, z)
        values = PeriodicValues(step, T, encodings=encodings)
        # hs in the module's layout: (B, T, H) for a batch-first module (a view of (T, B, H) memory), else (T, B, H)
        out = hs.squeeze(1).clone() if unbatched else hs  # a tensor of its own (the caller may change it in place)
        shape = (1, H) if unbatched else (1, B, H)
        h_n = time_major(hs, batch_first)[-1].reshape(shape).clone()
        saved = Saved(x=xt, h_prev=z[:H].permute(1, 2, 0), operands=z, coefs=coefs, values=values, T=T, B=B,
                      unbatched=unbatched, params=params, dtype=xt.dtype, device=xt.device)
        return self.cell.module_outputs((out, h_n, None if c_n is None else c_n.reshape(shape))), saved
