"""The recurrent cells' math, shared by the backward (:mod:`spscan.recurrent.plan`) and the Newton forward
(:mod:`spscan.recurrent.newton`): which modules are supported (:func:`cell_kind`), the patterns of each time
step's transposed Jacobian in the factored and materialized layouts (:func:`recurrent_patterns`,
:func:`factored_layout`), the gates and their derivative coefficients for all steps at once
(:func:`gates`, :func:`coefficients`), one step of the cell (:func:`cell_step`) and the chain's
values from those coefficients (:func:`jacobian_values`, :func:`factored_step_values`).

Pure functions of the module's configuration and tensors: no plans, no engine state. The
front ends above build on them; nothing here imports them.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from spscan.runtime import PeriodicValues
from spscan.errors import NotPlannable
from spscan.kernels.backend import GATE_BANDS, ValueEncoding

__all__ = [
    "SCAN_DTYPES", "cell_kind", "cell_step", "check_cell_form", "coefficients", "factored_layout", "factored_step_values",
    "gates", "gru_weight_values", "jacobian_values", "lstm_cells", "lstm_gate_encoding", "lstm_gate_pattern",
    "lstm_weight_values",
    "module_params", "recurrent_patterns", "resolve_layout", "shared_flags", "state_size",
]

_KINDS = {nn.RNN: "rnn", nn.GRU: "gru", nn.LSTM: "lstm"}


# --------------------------------------------------------------------------- validation


#: the dtypes the scan computes in (a module in another is not plannable: its own backward runs)
SCAN_DTYPES = (torch.float32, torch.float64)


def check_cell_form(module: nn.Module) -> None:
    """Refuse, with :class:`~spscan.errors.NotPlannable`, a recurrent module of a form the scan cannot plan
    (LSTM projections, parameters in a dtype other than float32/float64): ``spscan.wrap(...,
    backward="auto")`` runs its own backward instead. Checked for stacked modules as for single layers."""
    if getattr(module, "proj_size", 0):
        raise NotPlannable(
            f"LSTM projections are not supported: expected proj_size=0, got {module.proj_size} (h_t = W_hr (o_t * "
            "tanh c_t) needs a projection element in the recurrence's chain, which the scan does not have)")
    if isinstance(module, nn.RNN) and module.nonlinearity not in ("tanh", "relu"):
        raise ValueError(f"expected nonlinearity 'tanh' or 'relu', got {module.nonlinearity!r}")
    dtype = module.weight_hh_l0.dtype
    if dtype not in SCAN_DTYPES:
        raise NotPlannable(f"{type(module).__name__} with {dtype} parameters: the scan computes in float32 or "
                           "float64 (for mixed precision keep the module in float32 and use torch.autocast)")


def cell_kind(module: nn.Module) -> str:
    """``"rnn_tanh" | "rnn_relu" | "gru" | "lstm"``; refuses what this module cannot do exactly."""
    kind = None
    for cls, name in _KINDS.items():
        if type(module) is cls:
            kind = name
    if kind is None:
        raise TypeError(f"expected nn.RNN, nn.GRU or nn.LSTM, got {type(module).__name__}")
    if module.num_layers != 1:
        raise ValueError(
            f"only single-layer recurrent modules are supported: expected num_layers=1, got "
            f"{module.num_layers} (stack single-layer modules and wrap each one)"
        )
    if module.bidirectional:
        raise ValueError("bidirectional recurrent modules are not supported: expected bidirectional=False, got True")
    check_cell_form(module)
    return "rnn_" + module.nonlinearity if kind == "rnn" else kind


def state_size(kind: str, hidden: int) -> int:
    """The size of the chain's state: ``h_t``, or for the LSTM the joint ``(h_t, c_t)``."""
    return 2 * hidden if kind == "lstm" else hidden


# --------------------------------------------------------------------------- patterns


def _dense_pattern(rows: int, cols: int) -> sp.csr_array:
    indptr = np.arange(rows + 1, dtype=np.int64) * cols
    indices = np.tile(np.arange(cols, dtype=np.int64), rows)
    return sp.csr_array((np.ones(rows * cols), indices, indptr), shape=(rows, cols))


def _diag_pattern(d: int) -> sp.csr_array:
    ar = np.arange(d, dtype=np.int64)
    return sp.csr_array((np.ones(d), ar, np.arange(d + 1, dtype=np.int64)), shape=(d, d))


def _gru_weight_pattern(hidden: int) -> sp.csr_array:
    """GRU element 1, ``(H, 4H)``, shared: ``[W_hh^T | I]`` stored sparse (``3H^2 + H`` entries): row ``i``
    holds ``3H`` entries of ``W_hh^T`` then the identity's ``1`` at column ``3H + i``."""
    H = hidden
    ar = np.arange(H, dtype=np.int64)
    indices = np.concatenate([np.tile(np.arange(3 * H, dtype=np.int64), (H, 1)), (3 * H + ar)[:, None]], axis=1)
    indptr = np.arange(H + 1, dtype=np.int64) * (3 * H + 1)
    return sp.csr_array((np.ones(H * (3 * H + 1)), indices.reshape(-1), indptr), shape=(H, 4 * H))


def _blocksum_pattern(blocks: int, d: int) -> sp.csr_array:
    """``(blocks*d, d)``: ``blocks`` identities stacked (one entry per row, values all ones).

    As a chain element it sums the ``blocks`` blocks of a ``blocks*d`` vector (its transpose
    replicates one): ``blocks*d`` multiply-adds per sample, not ``blocks*d^2`` as a dense block would.
    """
    rows = blocks * d
    return sp.csr_array((np.ones(rows), np.arange(rows, dtype=np.int64) % d, np.arange(rows + 1, dtype=np.int64)),
                        shape=(rows, d))


def _lstm_pattern(hidden: int) -> sp.csr_array:
    """``J_t^T`` of the LSTM joint state, ``(2H, 2H)``: rows of ``h_{t-1}`` dense, rows of ``c_{t-1}`` two entries."""
    H = hidden
    top_idx = np.tile(np.arange(2 * H, dtype=np.int64), H)
    ar = np.arange(H, dtype=np.int64)
    bot_idx = np.stack([ar, ar + H], axis=1).reshape(-1)
    indices = np.concatenate([top_idx, bot_idx])
    indptr = np.concatenate([np.arange(H + 1, dtype=np.int64) * 2 * H, 2 * H * H + 2 * np.arange(1, H + 1, dtype=np.int64)])
    return sp.csr_array((np.ones(indices.shape[0]), indices, indptr), shape=(2 * H, 2 * H))


def _lstm_weight_pattern(hidden: int) -> sp.csr_array:
    """LSTM element 1, ``(2H, 5H)``, shared: ``[[W_hh^T, 0], [0, I_H]]`` (``nnz = 4H^2 + H``).

    Maps the 5H vector ``(da_i, da_f, da_g, da_o, f*dc)`` to ``(dh_{t-1}, dc_{t-1})``.
    """
    H = hidden
    top = np.tile(np.arange(4 * H, dtype=np.int64), H)
    indices = np.concatenate([top, 4 * H + np.arange(H, dtype=np.int64)])
    indptr = np.concatenate([np.arange(H + 1, dtype=np.int64) * 4 * H, 4 * H * H + np.arange(1, H + 1, dtype=np.int64)])
    return sp.csr_array((np.ones(indices.shape[0]), indices, indptr), shape=(2 * H, 5 * H))


def lstm_gate_pattern(hidden: int) -> sp.csr_array:
    """LSTM element 2, ``(5H, 2H)``, per sample (``nnz = 9H``): ``(gh, gc) -> (da_i, da_f, da_g, da_o, f*dc)``.

    With ``dc = k*gh + gc``: rows ``da_q = c_q*dc`` (``q = i, f, g``) and ``f*dc`` read columns
    ``(j, H+j)``; row ``da_o = co*gh`` reads column ``j``. CSR values per unit ``j``:
    ``[c_i k, c_i]``, ``[c_f k, c_f]``, ``[c_g k, c_g]`` (blocks of ``2H``), ``co`` (``H``), ``[f k, f]`` (``2H``).
    """
    H = hidden
    ar = np.arange(H, dtype=np.int64)
    pair = np.stack([ar, ar + H], axis=1).reshape(-1)
    indices = np.concatenate([pair, pair, pair, ar, pair])
    lengths = np.concatenate([np.full(3 * H, 2), np.ones(H), np.full(H, 2)]).astype(np.int64)
    indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return sp.csr_array((np.ones(indices.shape[0]), indices, indptr), shape=(5 * H, 2 * H))


def _expand_lstm_gate(compact: torch.Tensor) -> torch.Tensor:
    """:func:`lstm_gate_pattern`'s CSR values ``(..., 9H)`` from the compact ``(..., 6H)`` numbers
    ``k, f, c_i, c_f, c_g, c_o`` (blocks of ``H``; any strides)."""
    return _lstm_gate_csr(*compact.unflatten(-1, (6, compact.shape[-1] // 6)).unbind(-2))


@functools.lru_cache(maxsize=None)
def lstm_gate_encoding(hidden: int) -> ValueEncoding:
    """The LSTM gate element's values as ``6H`` numbers per sample: ``k`` (``o (1 - tanh^2 c_t)``), ``f``,
    ``c_i``, ``c_f``, ``c_g``, ``c_o`` (blocks of ``H``), of which its ``9H`` CSR values are products
    (:func:`lstm_gate_pattern`). The compiled CPU forward writes these (a third fewer bytes than the
    CSR values) and the compiled linear scan applies them as they are (their form, ``GATE_BANDS``)."""
    return ValueEncoding(GATE_BANDS, 6 * hidden, _expand_lstm_gate)


# element kinds of a factored step: values shared by the batch ``(nnz,)`` or per sample ``(T, B, nnz)``
_SHARED_KINDS = ("shared", "lstm_weight", "blocksum", "gru_weight")


def factored_layout(kind: str, hidden: int) -> list[tuple[str, int, int]]:
    """Elements of one time step of the factored chain, as ``(element kind, rows, cols)``:
    ``"shared"`` dense shared by the batch, ``"diag"`` per-sample diagonal, ``"blocksum"``
    (:func:`_blocksum_pattern`, shared, all ones), ``"gru_weight"`` (:func:`_gru_weight_pattern`, shared),
    ``"lstm_weight"``
    (:func:`_lstm_weight_pattern`, shared) and ``"lstm_gate"`` (:func:`lstm_gate_pattern`, per
    sample). The gradients after element 1 are always the gate pre-activations' (first ``G*H`` entries).

    RNN: ``h -> a`` (``W_hh^T``), ``a -> h`` (diag). GRU: ``h -> (R, Z, M, h)`` (``[W_hh^T | I]``),
    scale by ``(dr, dz, dm, z)``, sum the four blocks. LSTM: ``(h, c) -> (a_i, a_f, a_g, a_o, c')``
    (``[[W_hh^T, 0], [0, I]]``), then the gate derivatives and the cell path in one sparse element.
    """
    H = hidden
    if kind.startswith("rnn"):
        return [("shared", H, H), ("diag", H, H)]
    if kind == "gru":
        return [("gru_weight", H, 4 * H), ("diag", 4 * H, 4 * H), ("blocksum", 4 * H, H)]
    return [("lstm_weight", 2 * H, 5 * H), ("lstm_gate", 5 * H, 2 * H)]


def shared_flags(kind: str, hidden: int) -> list[bool]:
    """Per element of one factored step: whether its values are shared by the batch."""
    return [k in _SHARED_KINDS for k, _, _ in factored_layout(kind, hidden)]


def _element_pattern(element: str, rows: int, cols: int, hidden: int) -> sp.csr_array:
    if element == "shared":
        return _dense_pattern(rows, cols)
    if element == "diag":
        return _diag_pattern(rows)
    if element == "gru_weight":
        return _gru_weight_pattern(cols // 4)
    if element == "blocksum":
        return _blocksum_pattern(rows // cols, cols)
    return _lstm_weight_pattern(hidden) if element == "lstm_weight" else lstm_gate_pattern(hidden)


def recurrent_patterns(module: nn.Module, seq_len: int, layout: str = "auto") -> list[sp.csr_array]:
    """The chain's transposed-Jacobian patterns for a sequence of ``seq_len`` steps, in layer order.

    Materialized: ``T`` patterns ``(D, D)`` (``D = H``, or ``2H`` for the LSTM). Factored: ``m*T``
    patterns, ``m`` per step as in ``factored_layout`` (2 RNN, 3 GRU, 2 LSTM). The same SciPy
    objects are repeated so the planner interns them.
    """
    kind = cell_kind(module)
    layout = resolve_layout(kind, layout, module.weight_hh_l0.device.type, module.hidden_size)
    H = module.hidden_size
    if layout == "factored":
        step = [_element_pattern(k, r, c, H) for k, r, c in factored_layout(kind, H)]
        return step * seq_len
    pat = _lstm_pattern(H) if kind == "lstm" else _dense_pattern(H, H)
    return [pat] * seq_len


def resolve_layout(kind: str, layout: str, device_type: str = "cpu", hidden: int = 0) -> str:
    """``layout`` (``"auto"``, ``"factored"`` or ``"materialized"``) as the chain of a ``kind`` cell of
    ``hidden`` units on a ``device_type`` device will be laid out (``"auto"`` resolved)."""
    if layout not in ("auto", "factored", "materialized"):
        raise ValueError(f"layout: expected 'auto', 'factored' or 'materialized', got {layout!r}")
    if layout != "auto":
        return layout
    # "auto": factored on every device. On a CUDA device the factored chain runs as a structured
    # recurrence (kernels.recurrence: the shared block held for the whole launch, only the per-step
    # diagonals read), which does less work and moves fewer bytes than the materialized chain's
    # per-sample H x H (LSTM 2H x 2H) blocks, formerly the faster choice on a GPU for small H
    return "factored"


def module_params(module: nn.Module) -> list[torch.Tensor]:
    """``[W_ih, W_hh]`` plus ``[b_ih, b_hh]`` when the module has biases: the module's own objects."""
    names = ["weight_ih_l0", "weight_hh_l0"] + (["bias_ih_l0", "bias_hh_l0"] if module.bias else [])
    return [getattr(module, n) for n in names]


def gates(kind: str, x: torch.Tensor, h_prev: torch.Tensor, params: Sequence[torch.Tensor]):
    """Pre-activations ``x W_ih^T + b_ih`` and ``h_{t-1} W_hh^T + b_hh`` for all ``T*B`` steps at once.

    ``x`` (T, B, I), ``h_prev`` (T, B, H) → two ``(T, B, G*H)`` tensors.
    """
    w_hh = params[1]
    b_hh = params[3] if len(params) > 2 else None
    T, B, _ = x.shape
    gi = _input_gates(x, params)
    gh = (
        torch.matmul(h_prev, w_hh.t())
        if b_hh is None
        else torch.addmm(b_hh, h_prev.reshape(T * B, -1), w_hh.t()).view(T, B, -1)
    )
    return gi, gh


def coefficients(kind: str, x, h_prev, c_prev, hs, params) -> dict[str, torch.Tensor]:
    """Elementwise derivative coefficients of one step, all ``(T, B, H)``.

    RNN: ``d`` = d h_t / d a_t. GRU: ``dr, dz, dn, dm`` = d h_t / d(R, Z, N, M)_t and ``z``.
    LSTM: ``ci, cf, cg, co`` (gate pre-activation derivatives of ``c_t`` resp. ``h_t``), ``k`` =
    d h_t / d c_t and ``f``.
    """
    if kind == "rnn_tanh":
        return {"d": 1.0 - hs * hs}
    if kind == "rnn_relu":
        return {"d": (hs > 0).to(hs.dtype)}
    H = h_prev.shape[-1]
    s_prev = h_prev if kind == "gru" else torch.cat([h_prev, c_prev], dim=-1)
    return cell_step(kind, _input_gates(x, params), s_prev, params, H)[1]


def _input_gates(x: torch.Tensor, params: Sequence[torch.Tensor]) -> torch.Tensor:
    """``x W_ih^T + b_ih`` for all ``T*B`` steps at once: ``(T, B, I) -> (T, B, G*H)``."""
    w_ih = params[0]
    b_ih = params[2] if len(params) > 2 else None
    T, B, _ = x.shape
    return torch.matmul(x, w_ih.t()) if b_ih is None else torch.addmm(b_ih, x.reshape(T * B, -1), w_ih.t()).view(T, B, -1)


def cell_step(kind: str, gi: torch.Tensor, s_prev: torch.Tensor, params: Sequence[torch.Tensor], H: int):
    """``F(s_{t-1}, x_t)`` and the derivative coefficients for all ``T*B`` steps at once.

    ``gi`` (T, B, G*H): ``x W_ih^T + b_ih`` (fixed across iterations); ``s_prev`` (T, B, D), ``D = H``
    (``2H`` for the LSTM, ``[h, c]``). Returns ``(s_new (T, B, D), coefs)`` with the coefficients of
    :func:`coefficients` (the one place their formulas live: the Newton forward's converged values
    are what the backward reuses).
    """
    w_hh = params[1]
    b_hh = params[3] if len(params) > 2 else None
    h_prev = s_prev[..., :H]
    T, B = s_prev.shape[:2]
    gh = torch.matmul(h_prev, w_hh.t()) if b_hh is None else \
        torch.addmm(b_hh, h_prev.reshape(T * B, H), w_hh.t()).view(T, B, -1)
    if kind.startswith("rnn"):
        a = gi + gh
        if kind == "rnn_tanh":
            h = torch.tanh(a)
            return h, {"d": 1.0 - h * h}
        h = torch.relu(a)
        return h, {"d": (h > 0).to(h.dtype)}
    if kind == "gru":
        ir, iz, in_ = gi.chunk(3, dim=-1)
        hr, hz, hn = gh.chunk(3, dim=-1)
        r = torch.sigmoid(ir + hr)
        z = torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        h = torch.lerp(n, h_prev, z)  # (1 - z) n + z h
        dn = (1.0 - z) * (1.0 - n * n)
        return h, {"dr": dn * hn * r * (1.0 - r), "dz": (h_prev - n) * z * (1.0 - z), "dn": dn, "dm": dn * r, "z": z}
    c_prev = s_prev[..., H:]
    pi, pf, pg, po = (gi + gh).chunk(4, dim=-1)
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




def _weighted_wt(out: torch.Tensor, w_blocks: torch.Tensor, coefs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out[..., j, i] = sum_g W_g[i, j] * c_g[..., i]``, written in place into ``out`` (T, B, H, H).

    ``w_blocks`` (G, H, H) are the gate blocks of ``W_hh``; coefs ``(T, B, H)``. Row ``j`` of
    ``out`` is row ``j`` of the transposed Jacobian ``sum_g W_g^T diag(c_g)``. ``out`` may be a
    strided view into the values buffer (no temporaries of size ``T*B*H*H``).
    """
    torch.mul(w_blocks[0].t(), coefs[0].unsqueeze(-2), out=out)
    for g in range(1, len(coefs)):
        out.addcmul_(w_blocks[g].t(), coefs[g].unsqueeze(-2))
    return out


def jacobian_values(kind: str, layout: str, coefs: dict, w_hh: torch.Tensor, H: int):
    """The chain's values: a list of ``2T`` tensors (factored) or one stacked ``(T, B, nnz)`` tensor."""
    if layout == "factored":
        step = factored_step_values(kind, coefs, w_hh, H)
        T = next(iter(coefs.values())).shape[0]
        # reads as the list of m*T tensors; the engine locates them per element, not per step
        return PeriodicValues(step, T)
    T, B = next(iter(coefs.values())).shape[:2]
    dt, dev = w_hh.dtype, w_hh.device
    if kind.startswith("rnn"):
        vals = torch.empty(T, B, H * H, dtype=dt, device=dev)
        torch.mul(w_hh.t(), coefs["d"].unsqueeze(-2), out=vals.view(T, B, H, H))
        return vals
    if kind == "gru":
        vals = torch.empty(T, B, H * H, dtype=dt, device=dev)
        jt = _weighted_wt(vals.view(T, B, H, H), w_hh.view(3, H, H), [coefs["dr"], coefs["dz"], coefs["dm"]])
        jt.diagonal(dim1=-2, dim2=-1).add_(coefs["z"])
        return vals
    # lstm: rows of h_{t-1}: [d h_t/d h_{t-1}^T | d c_t/d h_{t-1}^T]; rows of c_{t-1}: [k*f, f]
    w = w_hh.view(4, H, H)
    k, f = coefs["k"], coefs["f"]
    vals = torch.empty(T, B, 2 * H * H + 2 * H, dtype=dt, device=dev)
    top = vals[..., : 2 * H * H].view(T, B, H, 2 * H)
    dh, dc = top[..., :H], top[..., H:]
    _weighted_wt(dc, w, [coefs["ci"], coefs["cf"], coefs["cg"]])
    torch.mul(dc, k.unsqueeze(-2), out=dh)
    dh.addcmul_(w[3].t(), coefs["co"].unsqueeze(-2))
    bottom = vals[..., 2 * H * H :].view(T, B, H, 2)
    torch.mul(k, f, out=bottom[..., 0])
    bottom[..., 1].copy_(f)
    return vals


def factored_step_values(kind: str, coefs: dict, w_hh: torch.Tensor, H: int) -> list[torch.Tensor]:
    """Values of one step's elements (``factored_layout``): ``(nnz,)`` shared, ``(T, B, nnz)`` per sample."""
    dt, dev = w_hh.dtype, w_hh.device
    if kind.startswith("rnn"):
        return [w_hh.t().contiguous().reshape(-1), coefs["d"]]
    if kind == "gru":
        d = torch.cat([coefs["dr"], coefs["dz"], coefs["dm"], coefs["z"]], dim=-1)
        return [gru_weight_values(w_hh, H), d, torch.ones(4 * H, dtype=dt, device=dev)]
    return [lstm_weight_values(w_hh, H), _lstm_gate_values(coefs)]


def gru_weight_values(w_hh: torch.Tensor, H: int) -> torch.Tensor:
    """Values ``(3H^2 + H,)`` of :func:`_gru_weight_pattern`: row ``k`` of ``W_hh^T``, then its identity's one."""
    host = _host_weight_values(w_hh, H, 3 * H, interleaved=True)
    if host is not None:
        return host
    return torch.cat([w_hh.t(), torch.ones(H, 1, dtype=w_hh.dtype, device=w_hh.device)], dim=1).reshape(-1)


def _host_weight_values(w_hh: torch.Tensor, H: int, G: int, interleaved: bool):
    """:func:`gru_weight_values` / :func:`lstm_weight_values` of a float32/float64 CPU weight through NumPy
    (a few microseconds, where the torch ops' dispatch costs ~50): ``W_hh^T`` row by row with a one after
    each row (``interleaved``) or ``H`` ones after all of them; ``None`` for other weights."""
    if w_hh.device.type != "cpu" or w_hh.dtype not in (torch.float32, torch.float64):
        return None
    w = w_hh.detach().numpy()
    if interleaved:
        out = np.empty((H, G + 1), dtype=w.dtype)
        out[:, :G] = w.T
        out[:, G] = 1
    else:
        out = np.empty(G * H + H, dtype=w.dtype)
        out[: G * H].reshape(H, G)[:] = w.T
        out[G * H:] = 1
    return torch.from_numpy(out.reshape(-1))


def lstm_weight_values(w_hh: torch.Tensor, H: int) -> torch.Tensor:
    """Values ``(4H^2 + H,)`` of :func:`_lstm_weight_pattern`: row ``k`` of ``W_hh^T``, then ones."""
    host = _host_weight_values(w_hh, H, 4 * H, interleaved=False)
    if host is not None:
        return host
    return torch.cat([w_hh.t().reshape(-1), torch.ones(H, dtype=w_hh.dtype, device=w_hh.device)])


def _lstm_gate_values(coefs: dict) -> torch.Tensor:
    """Values ``(T, B, 9H)`` of :func:`lstm_gate_pattern` from the coefficients of :func:`cell_step`."""
    return _lstm_gate_csr(*(coefs[name] for name in ("k", "f", "ci", "cf", "cg", "co")))


def _lstm_gate_csr(k, f, ci, cf, cg, co) -> torch.Tensor:
    """:func:`lstm_gate_pattern`'s CSR values ``(..., 9H)`` from its coefficients, each ``(..., H)``: per
    unit ``[c_i k, c_i]``, ``[c_f k, c_f]``, ``[c_g k, c_g]`` (blocks of ``2H``), ``c_o``, ``[f k, f]``."""
    lead, H = k.shape[:-1], k.shape[-1]
    vals = torch.empty(*lead, 9 * H, dtype=k.dtype, device=k.device)
    gates = vals[..., : 6 * H].view(*lead, 3, H, 2)
    for q, c in enumerate((ci, cf, cg)):
        torch.mul(c, k, out=gates[..., q, :, 0])
        gates[..., q, :, 1].copy_(c)
    vals[..., 6 * H : 7 * H].copy_(co)
    cell = vals[..., 7 * H :].view(*lead, H, 2)
    torch.mul(f, k, out=cell[..., 0])
    cell[..., 1].copy_(f)
    return vals


def lstm_cells(x, h_prev, c0, params) -> torch.Tensor:
    """``c_1..c_T`` (T, B, H) from the batched gates.

    ``c_t = f_t c_{t-1} + i_t g_t`` is a diagonal affine recurrence, solved with ``ceil(log2 T)``
    whole-sequence doubling steps (Hillis-Steele) instead of a loop over time.
    """
    gi, gh = gates("lstm", x, h_prev, params)
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


# --------------------------------------------------------------------------- torch integration
