"""The recurrent front end's forward state and its compiled CPU forwards.

:class:`Saved` is what a recurrent module's backward needs from its forward. :class:`CompiledForwards`
holds the forwards of the factored RNN, GRU and LSTM that run in one compiled pass on a CPU
(:mod:`spscan.kernels.cpu.recurrence`), writing the chain's per-step values as they go; the plan
(:class:`~spscan.recurrent.plan.RecurrentPlan`) mixes them in and decides when they apply.
"""

from __future__ import annotations

from typing import Any

import torch

from spscan.kernels.backend import cpu_ops
from spscan.recurrent.cells import gru_weight_values, lstm_gate_encoding, lstm_weight_values, module_params
from spscan.runtime import PeriodicValues
from spscan.runtime.autograd import holds_tensors
from spscan.recurrent.backward import split_hx

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
    """The compiled CPU forwards of :class:`~spscan.recurrent.plan.RecurrentPlan` (a mixin: they read the plan's
    ``module``, ``kind``, ``layout``, ``hidden_size`` and recycled ``buffers``)."""

    def _compiled_forward_applies(self, x: torch.Tensor, hx) -> bool:
        """Whether the factored RNN's, GRU's or LSTM's forward runs in one compiled pass
        (:mod:`spscan.kernels.cpu.recurrence`): CPU, float32/float64 input and state of the parameters' dtype,
        well-formed shapes; anything else runs the module (whose own checks then speak)."""
        if self.kind not in ("lstm", "gru", "rnn_tanh", "rnn_relu") or self.layout != "factored" \
                or not cpu_ops.recurrence_available():
            return False
        m, p = self.module, self.module.weight_hh_l0
        if x.device.type != "cpu" or p.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) \
                or any(q.dtype != x.dtype for q in module_params(m)):
            return False
        unbatched = x.dim() == 2
        T = x.shape[1 if (m.batch_first and not unbatched) else 0]
        B = 1 if unbatched else x.shape[0 if m.batch_first else 1]
        if T == 0 or B == 0:
            return False
        if hx is not None:
            want = (1, self.hidden_size) if unbatched else (1, B, self.hidden_size)
            if self.kind != "lstm":
                return (isinstance(hx, torch.Tensor) and tuple(hx.shape) == want and hx.dtype == x.dtype
                        and hx.device.type == "cpu")
            if not (isinstance(hx, (tuple, list)) and len(hx) == 2 and all(
                    isinstance(h, torch.Tensor) and tuple(h.shape) == want and h.dtype == x.dtype
                    and h.device.type == "cpu" for h in hx)):
                return False
        return True

    def _compiled_inputs(self, x: torch.Tensor, hx):
        """What every compiled CPU forward starts from: the input ``(T, B, I)`` (detached), ``T``, ``B``,
        whether it was unbatched, the detached parameters and the initial ``h_0`` (and ``c_0``)."""
        m, H = self.module, self.hidden_size
        unbatched = x.dim() == 2
        xt = x.detach()
        xt = xt.unsqueeze(1) if unbatched else (xt.transpose(0, 1) if m.batch_first else xt)
        T, B, _ = xt.shape
        params = [q.detach() for q in module_params(m)]
        h0, c0 = split_hx(self.kind, hx, B, H, xt, unbatched)
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

    def _compiled_outputs(self, hs: torch.Tensor, unbatched: bool):
        """From the compiled forward's hidden states ``hs`` (``(B, T, H)`` for a batch-first module, as
        the forward wrote them, else ``(T, B, H)``): the module's output and ``h_n``."""
        batch_first = self.module.batch_first and not unbatched
        time_major = hs.transpose(0, 1) if batch_first else hs
        out = hs.squeeze(1) if unbatched else hs
        shape = (1, self.hidden_size) if unbatched else (1, time_major.shape[1], self.hidden_size)
        return out, time_major[-1].reshape(shape).clone()

    def _compiled_saved(self, xt: torch.Tensor, operands: torch.Tensor, coefs: dict, values, unbatched: bool,
                        params) -> Saved:
        """The backward's state after a compiled forward (``h_prev`` a view of ``operands``)."""
        T, B, _ = xt.shape
        return Saved(x=xt, h_prev=operands[: self.hidden_size].permute(1, 2, 0), operands=operands, coefs=coefs,
                      values=values, T=T, B=B, unbatched=unbatched, params=params, dtype=xt.dtype, device=xt.device)

    def _lstm_compiled_forward(self, x: torch.Tensor, hx):
        """The LSTM forward on CPU in one pass that also writes the gate element's values (the gates
        are evaluated once; ``c_t`` comes from the recurrence itself). Returns ``(outputs, saved)``."""
        m, H = self.module, self.hidden_size
        xt, T, B, unbatched, params, h0, c0 = self._compiled_inputs(x, hx)
        # both biases enter every gate pre-activation: added to the input part once
        z, xz = self._operands(xt)
        gi = cpu_ops.input_projection(xz, params[0], params[2] + params[3] if m.bias else None)
        hs, c_n, gate_values = cpu_ops.gated_cell_forward(gi, params[1], h0, c0,
                                                          batch_first=m.batch_first and not unbatched,
                                                          buffers=self.buffers, prev=z)
        shared = lstm_weight_values(params[1], H)
        # the gate element as its compact numbers: the compiled CPU linear scan applies them as they are,
        # every other path expands them to CSR values
        values = PeriodicValues([shared, gate_values], T, encodings=[None, lstm_gate_encoding(H)])
        out, h_n = self._compiled_outputs(hs, unbatched)
        saved = self._compiled_saved(xt, z, {}, values, unbatched, params)
        return (out, (h_n, c_n.reshape(h_n.shape))), saved

    def _rnn_compiled_forward(self, x: torch.Tensor, hx):
        """The RNN forward on CPU in one compiled pass that also writes the diagonal element's values
        (:func:`spscan.kernels.cpu.recurrence.activation_recurrence_forward`). Returns ``(outputs, saved)``."""
        m = self.module
        xt, T, B, unbatched, params, h0, _ = self._compiled_inputs(x, hx)
        # both biases enter the pre-activation: added to the input part once
        z, xz = self._operands(xt)
        gi = cpu_ops.input_projection(xz, params[0], params[2] + params[3] if m.bias else None)
        hs, d = cpu_ops.activation_recurrence_forward(gi, params[1], h0, relu=self.kind == "rnn_relu",
                                                      batch_first=m.batch_first and not unbatched,
                                                      buffers=self.buffers, prev=z)
        values = PeriodicValues([params[1].t().contiguous().reshape(-1), d], T)
        out, h_n = self._compiled_outputs(hs, unbatched)
        saved = self._compiled_saved(xt, z, {"d": d}, values, unbatched, params)
        return (out, h_n), saved

    def _gru_compiled_forward(self, x: torch.Tensor, hx):
        """The GRU forward on CPU in one compiled pass that also writes the diagonal element's values
        ``(dr, dz, dm, z)`` and ``dn`` (:func:`spscan.kernels.cpu.recurrence.reset_gated_forward`): the gates are
        evaluated once, not recomputed from the module's outputs. Returns ``(outputs, saved)``."""
        m, H = self.module, self.hidden_size
        xt, T, B, unbatched, params, h0, _ = self._compiled_inputs(x, hx)
        b_hn = None
        z, xz = self._operands(xt)
        if m.bias:  # b_hr, b_hz join the input part once; b_hn stays inside r * (W_hn h + b_hn)
            bias = torch.cat([params[2][: 2 * H] + params[3][: 2 * H], params[2][2 * H:]])
            gi = cpu_ops.input_projection(xz, params[0], bias)
            b_hn = params[3][2 * H:]
        else:
            gi = cpu_ops.input_projection(xz, params[0], None)
        hs, d, dn = cpu_ops.reset_gated_forward(gi, params[1], b_hn, h0, batch_first=m.batch_first and not unbatched,
                                                buffers=self.buffers, prev=z)
        values = PeriodicValues([gru_weight_values(params[1], H), d, torch.ones(4 * H, dtype=hs.dtype)], T)
        out, h_n = self._compiled_outputs(hs, unbatched)
        saved = self._compiled_saved(xt, z, {"dn": dn}, values, unbatched, params)
        return (out, h_n), saved
