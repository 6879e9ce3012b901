"""The elements of a recurrent cell's chain: the sparse patterns of each time step's transposed Jacobian
(materialized, and the factored step's elements by their element kind: ``"shared"``, ``"diag"``,
``"blocksum"``, ``"gru_weight"``, ``"lstm_weight"``, ``"lstm_gate"``) and the layouts of their values (the
shared weight elements' values from ``W_hh``, the LSTM gate element's CSR values and its compact encoding).

Structure only: which cell uses which element is its cell object's (:mod:`spscan.recurrent.cells`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np
import scipy.sparse as sp
import torch

from spscan.kernels.backend import GATE_BANDS, ValueEncoding

__all__ = ["SHARED_ELEMENTS", "element_pattern", "gru_weight_values", "lstm_gate_encoding", "lstm_gate_pattern",
           "lstm_gate_values", "lstm_joint_pattern", "lstm_weight_values", "weighted_wt"]

#: element kinds of a factored step whose values are shared by the batch ``(nnz,)`` (the others: per sample
#: ``(T, B, nnz)``)
SHARED_ELEMENTS = ("shared", "lstm_weight", "blocksum", "gru_weight")


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


def lstm_joint_pattern(hidden: int) -> sp.csr_array:
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


def element_pattern(element: str, rows: int, cols: int, hidden: int) -> sp.csr_array:
    """The pattern of one factored element ``(element kind, rows, cols)`` of a cell of ``hidden`` units."""
    if element == "shared":
        return _dense_pattern(rows, cols)
    if element == "diag":
        return _diag_pattern(rows)
    if element == "gru_weight":
        return _gru_weight_pattern(cols // 4)
    if element == "blocksum":
        return _blocksum_pattern(rows // cols, cols)
    return _lstm_weight_pattern(hidden) if element == "lstm_weight" else lstm_gate_pattern(hidden)


# --------------------------------------------------------------------------- values


def weighted_wt(out: torch.Tensor, w_blocks: torch.Tensor, coefs: Sequence[torch.Tensor]) -> torch.Tensor:
    """``out[..., j, i] = sum_g W_g[i, j] * c_g[..., i]``, written in place into ``out`` (T, B, H, H).

    ``w_blocks`` (G, H, H) are the gate blocks of ``W_hh``; coefs ``(T, B, H)``. Row ``j`` of
    ``out`` is row ``j`` of the transposed Jacobian ``sum_g W_g^T diag(c_g)``. ``out`` may be a
    strided view into the values buffer (no temporaries of size ``T*B*H*H``).
    """
    torch.mul(w_blocks[0].t(), coefs[0].unsqueeze(-2), out=out)
    for g in range(1, len(coefs)):
        out.addcmul_(w_blocks[g].t(), coefs[g].unsqueeze(-2))
    return out


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


def lstm_gate_values(coefs: dict) -> torch.Tensor:
    """Values ``(T, B, 9H)`` of :func:`lstm_gate_pattern` from the coefficients of the LSTM's step
    (:meth:`spscan.recurrent.cells.Cell.step`)."""
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
