"""The recurrent cells: one object per kind (:class:`Cell`: ``nn.RNN`` with ``tanh`` or ``relu``, ``nn.GRU``,
``nn.LSTM``) that owns what differs between them, so the front ends above ask the cell instead of switching on
its name: which module it reads and how (:func:`cell_for`, :func:`check_cell_form`, :meth:`Cell.new_module`,
:func:`module_params`), its state (the LSTM's joint ``(h, c)``: :meth:`Cell.split_hx`, :meth:`Cell.join_hx`,
:meth:`Cell.initial_state`), the patterns of each time step's transposed Jacobian in the factored and
materialized layouts and of the quasi-Newton step (built from :mod:`spscan.recurrent.elements`), one step
of the cell for all steps at once with its derivative coefficients (:meth:`Cell.step`), the chain's values
from those coefficients, the gate pre-activation gradients, and the compiled CPU forward's kernel and its
arguments (:meth:`Cell.compiled_forward`). A cell's :attr:`~Cell.name` (``"rnn_tanh"``, ``"rnn_relu"``,
``"gru"``, ``"lstm"``) is a single-layer plan's ``kind``; its :attr:`~Cell.family` (``"rnn"``, ``"gru"``,
``"lstm"``) keys the step profiles' recurrent constants (``planner/data/*.json``).

Also the one conversion of a module's sequences to time-major and back (:func:`time_major`,
:func:`module_layout`, :func:`sequence_dims`).

Pure functions of the module's configuration and tensors: no plans, no engine state. The front ends above
build on them; nothing here imports them.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from spscan.errors import NotPlannable
from spscan.kernels.backend import cpu_ops, fixed_point_ops
from spscan.recurrent.elements import (SHARED_ELEMENTS, element_pattern, gru_weight_values, lstm_gate_encoding,
                                       lstm_gate_pattern, lstm_gate_values, lstm_joint_pattern, lstm_weight_values,
                                       weighted_wt)
from spscan.runtime import PeriodicValues

__all__ = [
    "CELLS", "Cell", "FusedStep", "MODULE_TYPES", "SCAN_DTYPES", "cell_for", "cell_named", "check_cell_form", "gates",
    "gru_weight_values", "lstm_cells", "lstm_gate_encoding", "lstm_gate_pattern", "lstm_weight_values",
    "module_layout", "module_params", "recurrent_patterns", "resolve_layout", "sequence_dims", "time_major",
]


#: the dtypes the scan computes in (a module in another is not plannable: its own backward runs)
SCAN_DTYPES = (torch.float32, torch.float64)


# --------------------------------------------------------------------------- the cells


class FusedStep(NamedTuple):
    """One evaluation of a cell at every step of a Newton guess by the fused kernels (:meth:`Cell.fused_step`).

    Attributes:
        f: ``F(s_{t-1}, x_t)`` ``(T, B, D)``.
        coefs: the derivative coefficients, as :meth:`Cell.step` returns them.
        values: the factored step's element values, as :meth:`Cell.factored_values` returns them.
        reversed_factor: the factored step's one per-sample element transposed (its values in the transposed
            pattern's CSR order) times the scale, last step first ``(T, B, nnz)``: the forward scan's per-sample
            values.
        reversed_residual: ``F(s_{t-1}, x_t) - s_t``, last step first ``(T, B, D)``.
        encodings: per element of ``values``, ``None`` or the :class:`~spscan.kernels.backend.ValueEncoding` of a
            per-sample element given as its compact numbers (the LSTM's gate element); ``None``: all plain.
    """

    f: torch.Tensor
    coefs: dict
    values: list
    reversed_factor: torch.Tensor
    reversed_residual: torch.Tensor
    encodings: Optional[list] = None


class Cell:
    """One kind of recurrent cell: what its module, state, chain and kernels are. One instance per kind
    (:data:`CELLS`), stateless and shared by every plan.

    Attributes:
        name: ``"rnn_tanh"``, ``"rnn_relu"``, ``"gru"`` or ``"lstm"``: a single-layer plan's ``kind``.
        family: ``"rnn"``, ``"gru"`` or ``"lstm"``: the module class's kind, a stacked plan's ``kind`` and the
            key of the step profiles' recurrent constants (``planner/data/*.json``, the cost model).
        module_type: the ``nn`` class (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``).
        nonlinearity: the module's ``nonlinearity`` (``nn.RNN``), else ``None``.
        gates: gate blocks ``G`` of ``W_ih`` / ``W_hh`` (``G*H`` rows).
        state_parts: 1 (``h_t``), or 2 for the LSTM: the chain's state is the joint ``(h_t, c_t)``.
        input_grads_from_state: the input GEMMs' gate gradients are the hidden ones' but for one block read
            from ``dl/dh_t`` (the GRU's ``n`` gate, whose input part is outside ``r * (...)``).
    """

    name: str = ""
    family: str = ""
    module_type: type = nn.Module
    nonlinearity: Optional[str] = None
    gates: int = 1
    state_parts: int = 1
    input_grads_from_state: bool = False

    def __repr__(self) -> str:
        return f"Cell({self.name!r})"

    def __reduce__(self):
        return cell_named, (self.name,)  # one instance per kind, also after pickling a plan

    # -- the torch module and its state

    def state_size(self, hidden: int) -> int:
        """The size of the chain's state: ``h_t``, or for the LSTM the joint ``(h_t, c_t)``."""
        return self.state_parts * hidden

    def new_module(self, input_size: int, hidden_size: int, **kwargs: Any) -> nn.Module:
        """A module of this kind (``kwargs`` as its class takes them; an RNN's nonlinearity is this cell's)."""
        return self.module_type(input_size, hidden_size, **kwargs)

    def split_hx(self, hx: Any) -> tuple[Any, Any]:
        """``(h_0, c_0)`` of a module's ``hx`` that is not None (``c_0`` None but for the LSTM)."""
        return hx, None

    def join_hx(self, h: Any, c: Any = None) -> Any:
        """The module's form of a state from ``h`` (and the LSTM's ``c``): ``h``, or ``(h, c)``."""
        return h

    def hx_parts(self, hx: Any) -> Optional[tuple]:
        """The parts of a module's ``hx`` (``(h,)`` or ``(h, c)``), or None where it is not of the cell's form."""
        return (hx,)

    def state_tensors(self, hx: Any) -> tuple:
        """:meth:`hx_parts` of an ``hx`` that is not None; refuses one not of the cell's form (an LSTM's not a pair)."""
        parts = self.hx_parts(hx)
        if parts is None:
            raise TypeError(f"hx: expected a tuple (h_0, c_0) for nn.{self.module_type.__name__}")
        return parts

    def flat_outputs(self, out: torch.Tensor, state: Any) -> tuple:
        """The module's ``(output, state)`` as one flat tuple ``(output, h_n[, c_n])``."""
        return out, state

    def module_outputs(self, outs: Sequence[torch.Tensor]) -> tuple:
        """What the module returns from :meth:`flat_outputs`' form: ``(output, h_n)`` or ``(output, (h_n, c_n))``."""
        return outs[0], outs[1]

    def initial_state(self, hx: Any, B: int, H: int, like: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Initial ``h_0`` (B, H) and the LSTM's ``c_0`` (B, H) (else None) from the module's ``hx`` (zeros
        when None), detached."""
        if hx is None:
            return torch.zeros(B, H, dtype=like.dtype, device=like.device), None
        return hx.detach().reshape(B, H), None

    def joint(self, h: torch.Tensor, c: Any) -> torch.Tensor:
        """The chain's state ``s`` from ``h`` (and the LSTM's ``c``), last axis ``D``."""
        return h

    def split_joint(self, s: torch.Tensor, H: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(h, c)`` of a chain state ``s`` (last axis ``D``): ``c`` None but for the LSTM."""
        return s[..., :H], None

    # -- the chain's structure

    def factored_layout(self, hidden: int) -> list[tuple[str, int, int]]:
        """Elements of one time step of the factored chain, as ``(element kind, rows, cols)``: ``"shared"``
        dense shared by the batch, ``"diag"`` per-sample diagonal, ``"blocksum"``, ``"gru_weight"``,
        ``"lstm_weight"`` (shared) and ``"lstm_gate"`` (per sample): :mod:`spscan.recurrent.elements`. The
        gradients after element 1 are always the gate pre-activations' (first ``G*H`` entries)."""
        raise NotImplementedError

    def factored_patterns(self, hidden: int) -> list[sp.csr_array]:
        """The patterns of one factored step's elements, in layer order."""
        return [element_pattern(k, r, c, hidden) for k, r, c in self.factored_layout(hidden)]

    def shared_flags(self, hidden: int) -> list[bool]:
        """Per element of one factored step: whether its values are shared by the batch."""
        return [k in SHARED_ELEMENTS for k, _, _ in self.factored_layout(hidden)]

    def materialized_pattern(self, hidden: int) -> sp.csr_array:
        """``J_t^T`` of one step, materialized: ``(D, D)``."""
        return element_pattern("shared", hidden, hidden, hidden)

    def quasi_pattern(self, hidden: int) -> sp.csr_array:
        """Pattern of the quasi-Newton ``J_t``: its diagonal ``(H, H)`` (the LSTM: per-unit 2x2 blocks of
        ``(h, c)``)."""
        return element_pattern("diag", hidden, hidden, hidden)

    # -- the values

    def step(self, gi: torch.Tensor, s_prev: torch.Tensor, params: Sequence[torch.Tensor], H: int):
        """``F(s_{t-1}, x_t)`` and the derivative coefficients for all ``T*B`` steps at once.

        ``gi`` (T, B, G*H): ``x W_ih^T + b_ih`` (fixed across iterations); ``s_prev`` (T, B, D). Returns
        ``(s_new (T, B, D), coefs)``, the coefficients all ``(T, B, H)`` (the one place their formulas live:
        the Newton forward's converged values are what the backward reuses). RNN: ``d`` = d h_t / d a_t.
        GRU: ``dr, dz, dn, dm`` = d h_t / d(R, Z, N, M)_t and ``z``. LSTM: ``ci, cf, cg, co`` (gate
        pre-activation derivatives of ``c_t`` resp. ``h_t``), ``k`` = d h_t / d c_t and ``f``.
        """
        raise NotImplementedError

    def coefficients(self, x, h_prev, c0, hs, params) -> dict[str, torch.Tensor]:
        """The coefficients of :meth:`step` after the module's own forward: from ``x`` (T, B, I), ``h_prev``
        (T, B, H) = ``h_0..h_{T-1}``, the LSTM's ``c_0`` (B, H) and ``hs`` (T, B, H) = ``h_1..h_T``; ``T > 0``."""
        return self.step(input_gates(x, params), h_prev, params, h_prev.shape[-1])[1]

    def factored_values(self, coefs: dict, w_hh: torch.Tensor, H: int) -> list[torch.Tensor]:
        """Values of one factored step's elements: ``(nnz,)`` shared, ``(T, B, nnz)`` per sample."""
        raise NotImplementedError

    def materialized_values(self, coefs: dict, w_hh: torch.Tensor, H: int) -> torch.Tensor:
        """The materialized chain's values, stacked ``(T, B, nnz)``."""
        raise NotImplementedError

    def jacobian_values(self, layout: str, coefs: dict, w_hh: torch.Tensor, H: int):
        """The chain's values in ``layout`` (:func:`resolve_layout`'s): the factored step's as one
        :class:`~spscan.runtime.PeriodicValues` (read as the list of ``m*T`` tensors; the engine locates
        them per element, not per step), or the materialized chain's one stacked ``(T, B, nnz)`` tensor."""
        if layout == "factored":
            return PeriodicValues(self.factored_values(coefs, w_hh, H), next(iter(coefs.values())).shape[0])
        return self.materialized_values(coefs, w_hh, H)

    def quasi_values(self, coefs: dict, w_hh: torch.Tensor, H: int) -> torch.Tensor:
        """Values ``(T, B, nnz)`` of the quasi-Newton ``J_t`` in :meth:`quasi_pattern`'s CSR order."""
        raise NotImplementedError

    def fused_step(self, gi: torch.Tensor, states: torch.Tensor, params: Sequence[torch.Tensor], H: int,
                   buffers: dict, maxima: torch.Tensor, scale: torch.Tensor) -> FusedStep:
        """:meth:`step` at every step in one GEMM and one fused pass (:data:`spscan.kernels.backend.fixed_point_ops`),
        with the forward scan's per-sample values and residual, for a Newton iteration.

        ``gi`` as for :meth:`step`; ``states`` ``(T+1, B, D)``: ``s_0`` then the guess ``s_1..s_T``; ``buffers``: a
        dict the outputs live in (filled on the first call, reused after; the result views it; a caller may put
        ``"rv"``, the reversed factor, and ``"rr"``, the reversed residual, there first: any views with a unit last
        stride, such as a scan's input buffers); ``maxima``: three contiguous entries of the values' dtype, zeroed
        (``max|f|`` and ``max|f - s|`` are merged into entries 0 and 1; an update merges ``max|δ|`` into entry 2);
        ``scale``: one entry, the factor of the scan's per-sample values."""
        raise NotImplementedError

    def pre_activation_grads(self, Gs: torch.Tensor, coefs: dict, H: int):
        """Gate pre-activation gradients ``(T, B, G*H)`` of the input and the hidden GEMMs from ``dl/ds_t``
        ``Gs`` (T, B, D) (the same tensor where the two sides share them)."""
        raise NotImplementedError

    def input_side_grads(self, pre: torch.Tensor, dh: torch.Tensor, coefs: dict, out: torch.Tensor) -> torch.Tensor:
        """With :attr:`input_grads_from_state`: the input GEMMs' gate gradients ``(G*H, T*B)`` from the hidden
        ones ``pre`` (G*H, T, B) and ``dl/dh_t`` ``dh`` (H, T, B, overwritten), written into ``out`` (G*H, T, B)."""
        raise NotImplementedError

    # -- the compiled CPU forward

    def compiled_forward(self, xz, params: Sequence[torch.Tensor], h0: torch.Tensor, c0: Any, bias: bool,
                         batch_first: bool, buffers: Any, prev: torch.Tensor):
        """The forward on CPU in one compiled pass (:data:`spscan.kernels.backend.cpu_ops`) that also writes the
        factored step's per-sample values. ``xz`` (T, B, I): the input; ``params`` detached; ``bias``: whether
        the module has biases; ``buffers``/``prev`` as the kernels take them. Returns ``(hs, c_n, coefs,
        step values, encodings)``: ``hs`` in the module's layout (``batch_first``), the LSTM's ``c_n`` (else
        None), the coefficients the backward reads, the step's element values and their encodings (None:
        plain CSR values)."""
        raise NotImplementedError


def _hidden_gates(h_prev: torch.Tensor, params: Sequence[torch.Tensor], H: int) -> torch.Tensor:
    """``h_{t-1} W_hh^T + b_hh`` for all ``T*B`` steps at once: ``(T, B, H) -> (T, B, G*H)``."""
    w_hh = params[1]
    T, B = h_prev.shape[:2]
    if len(params) <= 2:
        return torch.matmul(h_prev, w_hh.t())
    return torch.addmm(params[3], h_prev.reshape(T * B, H), w_hh.t()).view(T, B, -1)


def _outputs(buffers: dict, like: torch.Tensor, names: Sequence[tuple[str, int]]) -> None:
    """The output buffers of :meth:`Cell.fused_step` that ``buffers`` does not hold yet (the caller may have put
    some there, e.g. views of a scan's input buffers): ``(T, B, width)`` each, ``like``'s dtype and device."""
    for name, width in names:
        if name not in buffers:
            buffers[name] = torch.empty(*like.shape[:2], width, dtype=like.dtype, device=like.device)


def _summed_bias(params: Sequence[torch.Tensor], bias: bool) -> Optional[torch.Tensor]:
    """Both biases, added to the input part once (they enter every gate pre-activation together)."""
    return params[2] + params[3] if bias else None


class _RNNCell(Cell):
    """``h_t = act(x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh)``. Factored: ``h -> a`` (``W_hh^T``), ``a -> h``
    (diag)."""

    family, module_type = "rnn", nn.RNN
    relu = False  #: the compiled forward's activation code (the kernel takes a flag)

    def activation(self, a: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def derivative(self, h: torch.Tensor) -> torch.Tensor:
        """``d h / d a`` from ``h = act(a)``."""
        raise NotImplementedError

    def new_module(self, input_size: int, hidden_size: int, **kwargs: Any) -> nn.Module:
        return self.module_type(input_size, hidden_size, nonlinearity=self.nonlinearity, **kwargs)

    def factored_layout(self, hidden: int) -> list[tuple[str, int, int]]:
        return [("shared", hidden, hidden), ("diag", hidden, hidden)]

    def step(self, gi, s_prev, params, H):
        h = self.activation(gi + _hidden_gates(s_prev, params, H))
        return h, {"d": self.derivative(h)}

    def coefficients(self, x, h_prev, c0, hs, params):
        return {"d": self.derivative(hs)}

    def factored_values(self, coefs, w_hh, H):
        return [w_hh.t().contiguous().reshape(-1), coefs["d"]]

    def materialized_values(self, coefs, w_hh, H):
        d = coefs["d"]
        T, B = d.shape[:2]
        vals = torch.empty(T, B, H * H, dtype=w_hh.dtype, device=w_hh.device)
        torch.mul(w_hh.t(), d.unsqueeze(-2), out=vals.view(T, B, H, H))
        return vals

    def quasi_values(self, coefs, w_hh, H):
        return coefs["d"] * torch.diagonal(w_hh, dim1=-2, dim2=-1)

    def fused_step(self, gi, states, params, H, buffers, maxima, scale):
        T, B = gi.shape[:2]
        if "gi" not in buffers:  # b_hh joins the fixed input part once: a = (gi + b_hh) + s_{t-1} W_hh^T is one GEMM
            buffers["gi"] = (gi + params[3] if len(params) > 2 else gi).reshape(T * B, H).contiguous()
        _outputs(buffers, gi, (("a", H), ("f", H), ("d", H), ("rv", H), ("rr", H)))
        a, f, d = buffers["a"], buffers["f"], buffers["d"]
        torch.addmm(buffers["gi"], states[:-1].reshape(T * B, H), params[1].t(), out=a.view(T * B, H))
        fixed_point_ops.activation_eval(a, states[1:], f, d, buffers["rv"], buffers["rr"], maxima, scale, self.relu)
        if "w" not in buffers:  # the shared element: the weights do not change between evaluations
            buffers["w"] = self.factored_values({"d": d}, params[1], H)[0]
        return FusedStep(f, {"d": d}, [buffers["w"], d], buffers["rv"], buffers["rr"])

    def pre_activation_grads(self, Gs, coefs, H):
        p = Gs * coefs["d"]
        return p, p

    def compiled_forward(self, xz, params, h0, c0, bias, batch_first, buffers, prev):
        gi = cpu_ops.input_projection(xz, params[0], _summed_bias(params, bias))
        hs, d = cpu_ops.activation_recurrence_forward(gi, params[1], h0, relu=self.relu, batch_first=batch_first,
                                                      buffers=buffers, prev=prev)
        return hs, None, {"d": d}, [params[1].t().contiguous().reshape(-1), d], None


class TanhRNNCell(_RNNCell):
    name, nonlinearity = "rnn_tanh", "tanh"

    def activation(self, a):
        return torch.tanh(a)

    def derivative(self, h):
        return 1.0 - h * h


class ReluRNNCell(_RNNCell):
    name, nonlinearity, relu = "rnn_relu", "relu", True

    def activation(self, a):
        return torch.relu(a)

    def derivative(self, h):
        return (h > 0).to(h.dtype)


class GRUCell(Cell):
    """Reset and update gates. Factored: ``h -> (R, Z, M, h)`` (``[W_hh^T | I]``), scale by ``(dr, dz, dm, z)``,
    sum the four blocks (eq. 11 as a product; the sum is sparse, ``4H`` entries, one per row)."""

    name = family = "gru"
    module_type, gates, input_grads_from_state = nn.GRU, 3, True

    def factored_layout(self, hidden):
        H = hidden
        return [("gru_weight", H, 4 * H), ("diag", 4 * H, 4 * H), ("blocksum", 4 * H, H)]

    def step(self, gi, s_prev, params, H):
        gh = _hidden_gates(s_prev, params, H)
        ir, iz, in_ = gi.chunk(3, dim=-1)
        hr, hz, hn = gh.chunk(3, dim=-1)
        r = torch.sigmoid(ir + hr)
        z = torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        h = torch.lerp(n, s_prev, z)  # (1 - z) n + z h
        dn = (1.0 - z) * (1.0 - n * n)
        return h, {"dr": dn * hn * r * (1.0 - r), "dz": (s_prev - n) * z * (1.0 - z), "dn": dn, "dm": dn * r, "z": z}

    def factored_values(self, coefs, w_hh, H):
        d = torch.cat([coefs["dr"], coefs["dz"], coefs["dm"], coefs["z"]], dim=-1)
        return [gru_weight_values(w_hh, H), d, torch.ones(4 * H, dtype=w_hh.dtype, device=w_hh.device)]

    def materialized_values(self, coefs, w_hh, H):
        T, B = coefs["z"].shape[:2]
        vals = torch.empty(T, B, H * H, dtype=w_hh.dtype, device=w_hh.device)
        jt = weighted_wt(vals.view(T, B, H, H), w_hh.view(3, H, H), [coefs["dr"], coefs["dz"], coefs["dm"]])
        jt.diagonal(dim1=-2, dim2=-1).add_(coefs["z"])
        return vals

    def quasi_values(self, coefs, w_hh, H):
        wd = torch.diagonal(w_hh.view(3, H, H), dim1=-2, dim2=-1)
        return coefs["dr"] * wd[0] + coefs["dz"] * wd[1] + coefs["dm"] * wd[2] + coefs["z"]

    def fused_step(self, gi, states, params, H, buffers, maxima, scale):
        T, B = gi.shape[:2]
        if "gi" not in buffers:
            buffers["gi"] = gi.contiguous()
        _outputs(buffers, gi, (("gh", 3 * H), ("f", H), ("c", 4 * H), ("dn", H), ("rv", 4 * H), ("rr", H)))
        gh, c, dn = buffers["gh"], buffers["c"], buffers["dn"]
        h_prev = states[:-1].reshape(T * B, H)
        if len(params) > 2:  # b_hn stays inside r * (W_hn h + b_hn): the hidden part keeps its bias
            torch.addmm(params[3], h_prev, params[1].t(), out=gh.view(T * B, 3 * H))
        else:
            torch.mm(h_prev, params[1].t(), out=gh.view(T * B, 3 * H))
        fixed_point_ops.reset_gated_eval(buffers["gi"], gh, states, buffers["f"], c, dn, buffers["rv"], buffers["rr"],
                                         maxima, scale)
        coefs = {"dr": c[..., :H], "dz": c[..., H:2 * H], "dn": dn, "dm": c[..., 2 * H:3 * H], "z": c[..., 3 * H:]}
        if "w" not in buffers:  # the shared elements: the weights do not change between evaluations
            buffers["w"] = gru_weight_values(params[1], H)
            buffers["ones"] = torch.ones(4 * H, dtype=c.dtype, device=c.device)
        return FusedStep(buffers["f"], coefs, [buffers["w"], c, buffers["ones"]], buffers["rv"], buffers["rr"])

    def pre_activation_grads(self, Gs, coefs, H):
        gr, gz = Gs * coefs["dr"], Gs * coefs["dz"]
        return torch.cat([gr, gz, Gs * coefs["dn"]], dim=-1), torch.cat([gr, gz, Gs * coefs["dm"]], dim=-1)

    def input_side_grads(self, pre, dh, coefs, out):
        # the input side of the n gate is not on the chain: dl/dN_t = dl/dh_t * dn_t
        H = dh.shape[0]
        dh.mul_(coefs["dn"].permute(2, 0, 1))
        return torch.cat([pre[: 2 * H], dh], out=out).view(3 * H, -1)

    def compiled_forward(self, xz, params, h0, c0, bias, batch_first, buffers, prev):
        H = h0.shape[-1]
        b_hn = None
        if bias:  # b_hr, b_hz join the input part once; b_hn stays inside r * (W_hn h + b_hn)
            gi = cpu_ops.input_projection(xz, params[0], torch.cat([params[2][: 2 * H] + params[3][: 2 * H],
                                                                    params[2][2 * H:]]))
            b_hn = params[3][2 * H:]
        else:
            gi = cpu_ops.input_projection(xz, params[0], None)
        hs, d, dn = cpu_ops.reset_gated_forward(gi, params[1], b_hn, h0, batch_first=batch_first, buffers=buffers,
                                                prev=prev)
        values = [gru_weight_values(params[1], H), d, torch.ones(4 * H, dtype=hs.dtype)]
        return hs, None, {"dn": dn}, values, None


class LSTMCell(Cell):
    """Four gates and a cell state; the chain's state is the joint ``(h_t, c_t)``. Factored: ``(h, c) ->
    (a_i, a_f, a_g, a_o, c')`` (``[[W_hh^T, 0], [0, I]]``), then the gate derivatives and the cell path in one
    sparse element (:func:`~spscan.recurrent.elements.lstm_gate_pattern`)."""

    name = family = "lstm"
    module_type, gates, state_parts = nn.LSTM, 4, 2

    def split_hx(self, hx):
        return self.state_tensors(hx)

    def join_hx(self, h, c=None):
        return h, c

    def hx_parts(self, hx):
        return tuple(hx) if isinstance(hx, (tuple, list)) and len(hx) == 2 else None

    def flat_outputs(self, out, state):
        return out, state[0], state[1]

    def module_outputs(self, outs):
        return outs[0], (outs[1], outs[2])

    def initial_state(self, hx, B, H, like):
        if hx is None:
            z = torch.zeros(B, H, dtype=like.dtype, device=like.device)
            return z, z
        h0, c0 = hx
        return h0.detach().reshape(B, H), c0.detach().reshape(B, H)

    def joint(self, h, c):
        return torch.cat([h, c], dim=-1)

    def split_joint(self, s, H):
        return s[..., :H], s[..., H:]

    def factored_layout(self, hidden):
        H = hidden
        return [("lstm_weight", 2 * H, 5 * H), ("lstm_gate", 5 * H, 2 * H)]

    def materialized_pattern(self, hidden):
        return lstm_joint_pattern(hidden)

    def quasi_pattern(self, hidden):
        H = hidden
        ar = np.arange(H, dtype=np.int64)
        row = np.stack([ar, ar + H], axis=1).reshape(-1)  # row j and row H+j both read columns (j, H+j)
        indices = np.concatenate([row, row])
        indptr = 2 * np.arange(2 * H + 1, dtype=np.int64)
        return sp.csr_array((np.ones(4 * H), indices, indptr), shape=(2 * H, 2 * H))

    def step(self, gi, s_prev, params, H):
        h_prev, c_prev = s_prev[..., :H], s_prev[..., H:]
        pi, pf, pg, po = (gi + _hidden_gates(h_prev, params, H)).chunk(4, dim=-1)
        i, f, g, o = torch.sigmoid(pi), torch.sigmoid(pf), torch.tanh(pg), torch.sigmoid(po)
        c = torch.addcmul(f * c_prev, i, g)
        tc = torch.tanh(c)
        s = torch.cat([o * tc, c], dim=-1)
        coefs = {
            "ci": g * i * (1.0 - i),
            "cf": c_prev * f * (1.0 - f),
            "cg": i * (1.0 - g * g),
            "co": tc * o * (1.0 - o),
            "k": o * (1.0 - tc * tc),
            "f": f,
        }
        return s, coefs

    def coefficients(self, x, h_prev, c0, hs, params):
        # the module returns only c_T: recompute c_1..c_T from the batched gates (no time loop on h)
        cs = lstm_cells(x, h_prev, c0, params)
        c_prev = torch.cat([c0.unsqueeze(0), cs[:-1]], dim=0)
        return self.step(input_gates(x, params), torch.cat([h_prev, c_prev], dim=-1), params, h_prev.shape[-1])[1]

    def factored_values(self, coefs, w_hh, H):
        return [lstm_weight_values(w_hh, H), lstm_gate_values(coefs)]

    def materialized_values(self, coefs, w_hh, H):
        # rows of h_{t-1}: [d h_t/d h_{t-1}^T | d c_t/d h_{t-1}^T]; rows of c_{t-1}: [k*f, f]
        w = w_hh.view(4, H, H)
        k, f = coefs["k"], coefs["f"]
        T, B = k.shape[:2]
        vals = torch.empty(T, B, 2 * H * H + 2 * H, dtype=w_hh.dtype, device=w_hh.device)
        top = vals[..., : 2 * H * H].view(T, B, H, 2 * H)
        dh, dc = top[..., :H], top[..., H:]
        weighted_wt(dc, w, [coefs["ci"], coefs["cf"], coefs["cg"]])
        torch.mul(dc, k.unsqueeze(-2), out=dh)
        dh.addcmul_(w[3].t(), coefs["co"].unsqueeze(-2))
        bottom = vals[..., 2 * H * H:].view(T, B, H, 2)
        torch.mul(k, f, out=bottom[..., 0])
        bottom[..., 1].copy_(f)
        return vals

    def quasi_values(self, coefs, w_hh, H):
        wd = torch.diagonal(w_hh.view(4, H, H), dim1=-2, dim2=-1)
        jch = coefs["ci"] * wd[0] + coefs["cf"] * wd[1] + coefs["cg"] * wd[2]
        k, f = coefs["k"], coefs["f"]
        jhh = k * jch + coefs["co"] * wd[3]
        top = torch.stack([jhh, k * f], dim=-1).flatten(-2)
        bottom = torch.stack([jch, f], dim=-1).flatten(-2)
        return torch.cat([top, bottom], dim=-1)

    def fused_step(self, gi, states, params, H, buffers, maxima, scale):
        T, B = gi.shape[:2]
        if "gi" not in buffers:
            buffers["gi"] = gi.contiguous()
        _outputs(buffers, gi, (("gh", 4 * H), ("f", 2 * H), ("c", 6 * H), ("rv", 9 * H), ("rr", 2 * H)))
        gh, c = buffers["gh"], buffers["c"]
        h_prev = states[:-1].view(T * B, 2 * H)[:, :H]  # rows 2H apart: the GEMM reads them where they lie
        if len(params) > 2:
            torch.addmm(params[3], h_prev, params[1].t(), out=gh.view(T * B, 4 * H))
        else:
            torch.mm(h_prev, params[1].t(), out=gh.view(T * B, 4 * H))
        fixed_point_ops.gated_cell_eval(buffers["gi"], gh, states, buffers["f"], c, buffers["rv"], buffers["rr"],
                                        maxima, scale)
        # the coefficients in the gate element's compact order (lstm_gate_encoding): k, f, ci, cf, cg, co
        coefs = {name: c[..., q * H:(q + 1) * H] for q, name in enumerate(("k", "f", "ci", "cf", "cg", "co"))}
        if "w" not in buffers:  # the shared element: the weights do not change between evaluations
            buffers["w"] = lstm_weight_values(params[1], H)
        return FusedStep(buffers["f"], coefs, [buffers["w"], c], buffers["rv"], buffers["rr"],
                         [None, lstm_gate_encoding(H)])

    def pre_activation_grads(self, Gs, coefs, H):
        gh, gc = Gs[..., :H], Gs[..., H:]
        gc_tot = gc + gh * coefs["k"]
        p = torch.cat([gc_tot * coefs["ci"], gc_tot * coefs["cf"], gc_tot * coefs["cg"], gh * coefs["co"]], dim=-1)
        return p, p

    def compiled_forward(self, xz, params, h0, c0, bias, batch_first, buffers, prev):
        gi = cpu_ops.input_projection(xz, params[0], _summed_bias(params, bias))
        hs, c_n, gate_values = cpu_ops.gated_cell_forward(gi, params[1], h0, c0, batch_first=batch_first,
                                                          buffers=buffers, prev=prev)
        H = h0.shape[-1]
        # the gate element as its compact numbers: the compiled CPU linear scan applies them as they are,
        # every other path expands them to CSR values
        return hs, c_n, {}, [lstm_weight_values(params[1], H), gate_values], [None, lstm_gate_encoding(H)]


#: every cell, by name
CELLS: dict[str, Cell] = {c.name: c for c in (TanhRNNCell(), ReluRNNCell(), GRUCell(), LSTMCell())}
# by (module class, nonlinearity): how a module is read
_BY_MODULE = {(c.module_type, c.nonlinearity): c for c in CELLS.values()}
#: the module classes of the cells
MODULE_TYPES = tuple(dict.fromkeys(c.module_type for c in CELLS.values()))


def cell_named(name: str) -> Cell:
    """The cell of a :attr:`Cell.name` (``"rnn_tanh"``, ``"rnn_relu"``, ``"gru"``, ``"lstm"``)."""
    try:
        return CELLS[name]
    except KeyError:
        raise ValueError(f"expected a cell kind of {sorted(CELLS)}, got {name!r}") from None


# --------------------------------------------------------------------------- reading a module


def _check_type(module: nn.Module) -> None:
    if type(module) not in MODULE_TYPES:
        raise TypeError(f"expected nn.RNN, nn.GRU or nn.LSTM, got {type(module).__name__}")


def check_cell_form(module: nn.Module) -> Cell:
    """The cell of an ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` of any depth; refuses, with
    :class:`~spscan.errors.NotPlannable`, a form the scan cannot plan (LSTM projections, parameters in a dtype
    other than float32/float64): ``spscan.wrap(..., backward="auto")`` runs its own backward instead. Checked
    for stacked modules as for single layers."""
    _check_type(module)
    if getattr(module, "proj_size", 0):
        raise NotPlannable(
            f"LSTM projections are not supported: expected proj_size=0, got {module.proj_size} (h_t = W_hr (o_t * "
            "tanh c_t) needs a projection element in the recurrence's chain, which the scan does not have)")
    cell = _BY_MODULE.get((type(module), getattr(module, "nonlinearity", None)))
    if cell is None:
        raise ValueError(f"expected nonlinearity 'tanh' or 'relu', got {module.nonlinearity!r}")
    dtype = module.weight_hh_l0.dtype
    if dtype not in SCAN_DTYPES:
        raise NotPlannable(f"{type(module).__name__} with {dtype} parameters: the scan computes in float32 or "
                           "float64 (for mixed precision keep the module in float32 and use torch.autocast)")
    return cell


def cell_for(module: nn.Module) -> Cell:
    """The cell of a single-layer, unidirectional recurrent module; refuses what this module cannot do exactly."""
    _check_type(module)
    if module.num_layers != 1:
        raise ValueError(
            f"only single-layer recurrent modules are supported: expected num_layers=1, got "
            f"{module.num_layers} (stack single-layer modules and wrap each one)"
        )
    if module.bidirectional:
        raise ValueError("bidirectional recurrent modules are not supported: expected bidirectional=False, got True")
    return check_cell_form(module)


def module_params(module: nn.Module) -> list[torch.Tensor]:
    """``[W_ih, W_hh]`` plus ``[b_ih, b_hh]`` when the module has biases: the module's own objects."""
    names = ["weight_ih_l0", "weight_hh_l0"] + (["bias_ih_l0", "bias_hh_l0"] if module.bias else [])
    return [getattr(module, n) for n in names]


def sequence_dims(x: torch.Tensor, batch_first: bool) -> tuple[int, int]:
    """``(T, B)`` of a module's input or output: ``(T, B, ...)``, ``(B, T, ...)`` if ``batch_first``, or
    unbatched ``(T, I)`` (``B = 1``)."""
    if x.dim() == 2:
        return x.shape[0], 1
    return (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])


def time_major(t: torch.Tensor, batch_first: bool, unbatched: bool = False) -> torch.Tensor:
    """A sequence in a module's layout (``(T, B, ...)``, ``(B, T, ...)`` if ``batch_first``, ``(T, ...)``
    ``unbatched``) as a time-major view ``(T, B, ...)``; :func:`module_layout` turns it back."""
    if unbatched:
        return t.unsqueeze(1)
    return t.transpose(0, 1) if batch_first else t


def module_layout(t: torch.Tensor, batch_first: bool, unbatched: bool = False) -> torch.Tensor:
    """A time-major ``(T, B, ...)`` sequence in a module's layout: the inverse of :func:`time_major`."""
    if unbatched:
        return t.squeeze(1)
    return t.transpose(0, 1) if batch_first else t


def module_output(t: torch.Tensor, batch_first: bool, unbatched: bool = False) -> torch.Tensor:
    """:func:`module_layout` of ``t`` as a tensor of its own, laid out as torch's modules lay their output out:
    time-major memory, a batch-first output a ``(B, T, ...)`` view of it (what reads it in memory order, dropout's
    random mask, then reads it as after the module itself), and not a view of ``t`` (the caller may change it in
    place, which autograd refuses for a function's outputs that are views)."""
    if not batch_first and not unbatched and t._base is None and t.is_contiguous():
        return t  # already so
    lay = module_layout(torch.empty(t.shape, dtype=t.dtype, device="meta"), batch_first, unbatched)
    out = torch.empty_strided(lay.shape, lay.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(module_layout(t, batch_first, unbatched))


# --------------------------------------------------------------------------- patterns and gates


def recurrent_patterns(module: nn.Module, seq_len: int, layout: str = "auto") -> list[sp.csr_array]:
    """The chain's transposed-Jacobian patterns for a sequence of ``seq_len`` steps, in layer order.

    Materialized: ``T`` patterns ``(D, D)`` (``D = H``, or ``2H`` for the LSTM). Factored: ``m*T``
    patterns, ``m`` per step as in :meth:`Cell.factored_layout` (2 RNN, 3 GRU, 2 LSTM). The same SciPy
    objects are repeated so the planner interns them.
    """
    cell = cell_for(module)
    H = module.hidden_size
    if resolve_layout(layout) == "factored":
        return cell.factored_patterns(H) * seq_len
    return [cell.materialized_pattern(H)] * seq_len


def resolve_layout(layout: str) -> str:
    """``layout`` (``"auto"``, ``"factored"`` or ``"materialized"``) as a cell's chain is laid out: ``"auto"``
    is factored for every cell, size and device."""
    if layout not in ("auto", "factored", "materialized"):
        raise ValueError(f"layout: expected 'auto', 'factored' or 'materialized', got {layout!r}")
    if layout != "auto":
        return layout
    # "auto": factored on every device. On a CUDA device the factored chain runs as a structured
    # recurrence (kernels.recurrence: the shared block held for the whole launch, only the per-step
    # diagonals read), which does less work and moves fewer bytes than the materialized chain's
    # per-sample H x H (LSTM 2H x 2H) blocks, formerly the faster choice on a GPU for small H
    return "factored"


def input_gates(x: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``x W_ih^T + b_ih`` for all ``T*B`` steps at once: ``(T, B, I) -> (T, B, G*H)``."""
    w_ih = params[0]
    T, B, _ = x.shape
    if len(params) <= 2:
        return torch.matmul(x, w_ih.t())
    return torch.addmm(params[2], x.reshape(T * B, -1), w_ih.t()).view(T, B, -1)


def gates(x: torch.Tensor, h_prev: torch.Tensor, params: Sequence[torch.Tensor]):
    """Pre-activations ``x W_ih^T + b_ih`` and ``h_{t-1} W_hh^T + b_hh`` for all ``T*B`` steps at once.

    ``x`` (T, B, I), ``h_prev`` (T, B, H) → two ``(T, B, G*H)`` tensors.
    """
    return input_gates(x, params), _hidden_gates(h_prev, params, h_prev.shape[-1])


def lstm_cells(x, h_prev, c0, params) -> torch.Tensor:
    """``c_1..c_T`` (T, B, H) from the batched gates.

    ``c_t = f_t c_{t-1} + i_t g_t`` is a diagonal affine recurrence, solved with ``ceil(log2 T)``
    whole-sequence doubling steps (Hillis-Steele) instead of a loop over time.
    """
    gi, gh = gates(x, h_prev, params)
    pi, pf, pg, _ = (gi + gh).chunk(4, dim=-1)
    a = torch.sigmoid(pf)
    b = torch.sigmoid(pi) * torch.tanh(pg)
    T = x.shape[0]
    k = 1
    while k < T:
        # (a_t, b_t) <- (a_t, b_t) o (a_{t-k}, b_{t-k}) for t >= k
        b = torch.cat([b[:k], torch.addcmul(b[k:], a[k:], b[:-k])], dim=0)
        a = torch.cat([a[:k], a[k:] * a[:-k]], dim=0)
        k *= 2
    return torch.addcmul(b, a, c0.unsqueeze(0))
