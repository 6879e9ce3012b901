"""Recurrences on CPU in one compiled pass: the outputs and the chain's per-step Jacobian values.

Three forms, each a function named by its math (the caller lowers its own model into one):

* :func:`activation_recurrence_forward`: ``h_t = act(gi_t + h_{t-1} W^T)`` (``act`` tanh or relu) and
  the diagonal ``dh_t/da_t``, the values of the factored chain's diagonal element.
* :func:`gated_cell_forward`: four gates and a cell state, one product with ``W`` per step::

      a_t = gi_t + h_{t-1} W^T                      (blocks i, f, g, o of H)
      i, f, o = sigmoid(a_i, a_f, a_o),  g = tanh(a_g),  c_t = f c_{t-1} + i g,  h_t = o tanh(c_t)

  and the step's gate element ``(5H, 2H)`` as its ``6H`` compact numbers per sample
  ``k, f, c_i, c_f, c_g, c_o`` (``k = o (1 - tanh^2 c_t)``, ``c_i = g i (1 - i)``, ``c_f = c_{t-1} f
  (1 - f)``, ``c_g = i (1 - g^2)``, ``c_o = tanh(c_t) o (1 - o)``), the form
  :data:`spscan.kernels.backend.GATE_BANDS` the compiled linear scan applies directly.
* :func:`reset_gated_forward`: gates ``r, z`` and a candidate ``n`` whose hidden product the reset
  gate scales: ``r = sigmoid(gi_r + h W_r^T)``, ``z = sigmoid(gi_z + h W_z^T)``, ``M = b_n + h W_n^T``,
  ``n = tanh(gi_n + r M)``, ``h' = (h - n) z + n``; the values ``(dr, dz, dm, z)`` of the factored
  chain's diagonal element plus ``dn`` (the input side of ``n``, for its input weights' gradient).

The gates are evaluated once, in the forward; the backward does not recompute them from the outputs.

Tiles: from ``TILE_MIN_BATCH`` samples up each forward runs the batch in tiles of ``LANES`` samples,
feature-major (unit ``j`` of a tile is one vector of ``LANES`` samples, :mod:`.simd`), so the
hidden-state product is four register accumulators per pass over ``h`` and the elementwise work
runs over whole tiles; the input part of the gates is computed in the time loop for inputs of at
most ``FUSED_MAX_INPUT`` features (:class:`InputProjection`), else read from ``(G, T, B)`` memory
made by one GEMM before the loop (:func:`gate_inputs`), and the chain values are written
entry-major (``(T, nnz, B)`` memory, returned as ``(T, B, nnz)`` views), which the linear scan reads
in place. Below ``TILE_MIN_BATCH`` a loop per sample runs (same sums).

Why compiled: the step is tiny (``B x G x H`` multiply-adds, a few transcendentals per unit), so a
loop of torch calls is bound by per-call overhead. ``sigmoid`` and ``tanh`` come from an ``expm1`` made
of arithmetic only (:mod:`.recurrence_steps`), which vectorizes where libm's does not. The
loops themselves are :mod:`.recurrence_loops`. Every sum runs in a fixed order: results are
bitwise reproducible run to run. No ``fastmath``, no ``parallel``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from spscan.kernels.cpu.jit import available
from spscan.kernels.cpu.recurrence_loops import compiled
from spscan.kernels.cpu.recurrence_steps import expm1_consts, int_type
from spscan.kernels.cpu.simd import LANES, last_level_cache_bytes

__all__ = ["FUSED_MAX_INPUT", "InputProjection", "TILE_MIN_BATCH", "activation_recurrence_forward", "available",
           "gate_inputs", "gated_cell_forward", "input_projection", "reset_gated_forward"]

# From this batch size up the forwards run in tiles of LANES samples (vector registers across the batch,
# kernels/cpu/simd.py); below it, a loop per sample wastes less of each tile
TILE_MIN_BATCH = 8


def _checked(name: str, gi, tensors: tuple, names: tuple):
    """``(np_dt, itype, cst, icst)`` of a forward whose input part is ``gi`` and whose other tensors are
    ``tensors`` (``None`` for one not given; ``names`` for the message), after the checks every forward makes."""
    if not available():
        raise RuntimeError("spscan.kernels.cpu.recurrence needs numba (pip install numba)")
    dt = gi.dtype
    if dt not in (torch.float32, torch.float64) or any(
            t is not None and (t.dtype != dt or t.device.type != "cpu") for t in (gi,) + tensors
            + _projection_operands(gi)):
        rest = ", ".join(f"{n} {t.dtype}" for n, t in zip(names, tensors) if t is not None)
        raise TypeError(f"{name}: expected float32/float64 CPU tensors of one dtype, got gi {gi.dtype} on "
                        f"{gi.device}, {rest}")
    np_dt = np.float32 if dt == torch.float32 else np.float64
    cst, icst = expm1_consts(np_dt)
    return np_dt, int_type(np_dt), cst, icst


def activation_recurrence_forward(gi: torch.Tensor, w_hh: torch.Tensor, h0: torch.Tensor, relu: bool,
                                  batch_first: bool = False, buffers=None, prev: Optional[torch.Tensor] = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``h_t = act(gi_t + h_{t-1} W^T)`` (tanh, or relu) on CPU in one compiled pass.

    Args:
        gi: ``(T, B, H)`` input part of the pre-activations, or an :class:`InputProjection` of it
            (:func:`input_projection`).
        w_hh: ``(H, H)`` the recurrent matrix ``W``.
        h0: ``(B, H)`` initial state.
        relu: ``act`` is relu (else tanh, through the same ``expm1`` as the gated forms').
        batch_first: return ``hs`` as ``(B, T, H)``, a view of ``(T, B, H)`` memory (as torch's modules do).
        buffers: an object whose ``take(name, shape, dtype)`` hands out the tensors the chain values
            are written to (a caller that runs every step keeps one and gets last step's back: fresh
            multi-MB tensors page-fault on first touch), or ``None``: new tensors.
        prev: ``None``, or a C-contiguous ``(K, T, B)`` tensor (``K >= H``) whose rows ``0 .. H-1``
            receive the previous states feature-major: ``prev[:H, t] = h_{t-1}^T`` (``h_0`` at
            ``t = 0``), the operand of the weight gradients (one BLAS GEMM over all steps);
            the tiles write it as they go, one vector store per row and step. Its other rows are left as
            they are.
    Returns:
        ``(hs (T, B, H) or (B, T, H), d (T, B, H))``: the outputs ``h_1..h_T`` and the diagonal of each step's
        ``dh_t/da_t`` (tanh: ``1 - h_t^2``; relu: ``1`` where ``h_t > 0``), a view of ``(T, H, B)`` memory
        (entry-major, which the linear scan reads in place). Of ``gi``'s dtype.

    Raises ``RuntimeError`` without numba, ``TypeError`` for other dtypes or non-CPU tensors.
    """
    np_dt, itype, cst, icst = _checked("activation_recurrence_forward", gi, (w_hh, h0), ("w_hh", "h0"))
    T, B, H = gi.shape
    dt = gi.dtype
    # the diagonal element's values entry-major ((T, H, B) memory): the linear scan reads a tile of
    # them in place (kernels/cpu/chain.py)
    d = _values_tensor(buffers, "d", (T, H, B), dt)
    if B >= TILE_MIN_BATCH:
        gif, wi, bt, xv = _tile_input_operands(gi, np_dt)
        n = H * LANES
        bits = np.empty(n, dtype=itype)
        hs, hf, hts, hbs = _outputs(T, B, H, dt, batch_first)
        compiled("activation_tile")(
            gif, T * B, B, wi, bt, xv, w_hh.detach().contiguous().numpy(),
            h0.detach().contiguous().numpy(), cst, icst, bool(relu), hf, hts, hbs, d.numpy(), np.empty(n, dtype=np_dt),
            np.empty(n, dtype=np_dt), np.empty(n, dtype=np_dt), np.empty(n, dtype=np_dt), bits, bits.view(np_dt),
            _streams(d), *_prev_rows(prev, T, B, H, np_dt))
        return hs, d.transpose(1, 2)
    if isinstance(gi, InputProjection):
        gi = gi.materialize()
    out, hs = _time_major_outputs(T, B, H, dt, batch_first)
    acc = np.empty((B, H), dtype=np_dt)
    e = np.empty(B * H, dtype=np_dt)
    bits = np.empty(B * H, dtype=itype)
    compiled("activation")(gi.detach().contiguous().numpy(), w_hh.detach().t().contiguous().numpy(),
                           h0.detach().contiguous().numpy(), cst, icst, bool(relu), hs.numpy(), d.numpy(),
                           np.empty((B, H), dtype=np_dt), acc, e, bits, bits.view(np_dt))
    _fill_prev(prev, hs, h0)
    return out, d.transpose(1, 2)


def gated_cell_forward(gi: torch.Tensor, w_hh: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor,
                       batch_first: bool = False, buffers=None, prev: Optional[torch.Tensor] = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Four gates and a cell state (module docstring) on CPU in one compiled pass.

    Args:
        gi: ``(T, B, 4H)`` input part of the gate pre-activations (blocks ``i, f, g, o``), or an
            :class:`InputProjection` of it (:func:`input_projection`).
        w_hh: ``(4H, H)`` the recurrent matrix ``W``.
        h0, c0: ``(B, H)`` initial state and cell state.
        batch_first, buffers, prev: as :func:`activation_recurrence_forward`'s.
    Returns:
        ``(hs (T, B, H) or (B, T, H), c_T (B, H), values (T, B, 6H))``: the outputs ``h_1..h_T``, the last
        cell state and the gate element's compact numbers (module docstring; from ``TILE_MIN_BATCH``
        samples a view of ``(T, 6H, B)`` memory: entry-major, which the linear scan reads in place;
        the forward then runs in tiles of ``LANES`` samples). All of ``gi``'s dtype (float32 or
        float64). ``gi`` is read fastest as a view of ``(4H, T, B)`` memory (:func:`gate_inputs`); any
        other layout is copied once.

    Raises ``RuntimeError`` without numba, ``TypeError`` for other dtypes or non-CPU tensors.
    """
    np_dt, itype, cst, icst = _checked("gated_cell_forward", gi, (w_hh, h0, c0), ("w_hh", "h0", "c0"))
    T, B, G = gi.shape
    H = G // 4
    dt = gi.dtype
    c = torch.empty(B, H, dtype=dt)
    h0n, c0n = h0.detach().contiguous().numpy(), c0.detach().contiguous().numpy()
    if B < TILE_MIN_BATCH:
        if isinstance(gi, InputProjection):
            gi = gi.materialize()
        out, hs = _time_major_outputs(T, B, H, dt, batch_first)
        vals = _values_tensor(buffers, "values", (T, B, 6 * H), dt)
        acc = np.empty((B, G), dtype=np_dt)
        e = np.empty((5, B * H), dtype=np_dt)
        w = np.empty((4, B * H), dtype=np_dt)
        bits = np.empty(4 * B * H, dtype=itype)
        compiled("gated_cell")(gi.detach().contiguous().numpy(), w_hh.detach().t().contiguous().numpy(), h0n, c0n,
                               cst, icst, hs.numpy(), vals.numpy(), c.numpy().reshape(-1), acc, e, w, bits,
                               bits.view(np_dt))
        _fill_prev(prev, hs, h0)
        return out, c, vals
    gif, wi, bt, xv = _tile_input_operands(gi, np_dt)
    # the gate element's compact numbers entry-major, (T, 6H, B) memory viewed as (T, B, 6H): the
    # linear scan reads a tile of them in place (kernels/cpu/chain.py)
    vals = _values_tensor(buffers, "values", (T, 6 * H, B), dt)
    n = H * LANES
    bits = np.empty(4 * n, dtype=itype)
    hs, hf, hts, hbs = _outputs(T, B, H, dt, batch_first)
    compiled("gated_cell_tile")(
        gif, T * B, B, wi, bt, xv, w_hh.detach().contiguous().numpy(), h0n, c0n, cst, icst, hf, hts, hbs, vals.numpy(),
        c.numpy(),
        np.empty(n, dtype=np_dt), np.empty(n, dtype=np_dt), np.empty(G * LANES, dtype=np_dt),
        np.empty(6 * n, dtype=np_dt), np.empty((5, n), dtype=np_dt), np.empty((4, n), dtype=np_dt), bits,
        bits.view(np_dt), _streams(vals), *_prev_rows(prev, T, B, H, np_dt))
    return hs, c, vals.transpose(1, 2)


def reset_gated_forward(gi: torch.Tensor, w_hh: torch.Tensor, b_hn: Optional[torch.Tensor],
                        h0: torch.Tensor, batch_first: bool = False, buffers=None,
                        prev: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reset and update gates (module docstring; blocks ``r, z, n``) on CPU in one compiled pass.

    Per step, with ``(W_r; W_z; W_n) = W``::

        r = sigmoid(gi_r + h W_r^T),  z = sigmoid(gi_z + h W_z^T),  M = b_hn + h W_n^T
        n = tanh(gi_n + r * M),        h' = (h - n) * z + n            (= (1 - z) n + z h)

    Args:
        gi: ``(T, B, 3H)`` (or an :class:`InputProjection` of it) input part of the pre-activations
            (every bias but ``b_hn``, which sits inside ``r * M``).
        w_hh: ``(3H, H)`` the recurrent matrix ``W``.
        b_hn: ``(H,)`` the bias inside ``M``, or ``None`` (zero).
        h0: ``(B, H)`` initial state.
        batch_first, buffers, prev: as :func:`activation_recurrence_forward`'s.
    Returns:
        ``(hs (T, B, H) or (B, T, H), d (T, B, 4H), dn (T, B, H))``: the outputs ``h_1..h_T``; the per-sample values
        of the factored chain's diagonal element, ``(dr, dz, dm, z)`` per step (``dn = (1 - z)(1 - n^2)``,
        ``dr = dn M r (1 - r)``, ``dz = (h - n) z (1 - z)``, ``dm = dn r``: ``dh'`` with respect to the
        pre-activations of ``r``, ``z`` and to ``M``); and ``dn`` (``dh'`` with respect to the input side
        of ``n``, which the input-weight gradients need). ``d`` is a view of ``(T, 4H, B)`` memory
        (entry-major, as :func:`activation_recurrence_forward`'s); from ``TILE_MIN_BATCH`` samples ``dn``
        is a view of ``(H, T, B)`` memory (feature-major, as the backward holds the gradients it
        multiplies). All of ``gi``'s dtype (float32 or float64).

    Raises ``RuntimeError`` without numba, ``TypeError`` for other dtypes or non-CPU tensors.
    """
    np_dt, itype, cst, icst = _checked("reset_gated_forward", gi, (w_hh, h0, b_hn), ("w_hh", "h0", "b_hn"))
    T, B, G = gi.shape
    H = G // 3
    dt = gi.dtype
    if G != 3 * H or tuple(w_hh.shape) != (3 * H, H) or tuple(h0.shape) != (B, H) or (
            b_hn is not None and tuple(b_hn.shape) != (H,)):
        raise ValueError(f"reset_gated_forward: expected gi (T, B, 3H), w_hh (3H, H), h0 (B, H), b_hn (H,), got gi "
                         f"{tuple(gi.shape)}, w_hh {tuple(w_hh.shape)}, h0 {tuple(h0.shape)}"
                         + ("" if b_hn is None else f", b_hn {tuple(b_hn.shape)}"))
    d = _values_tensor(buffers, "d", (T, 4 * H, B), dt)  # entry-major, as activation_recurrence_forward's
    bhn = np.zeros(H, dtype=np_dt) if b_hn is None else b_hn.detach().contiguous().numpy()
    if B >= TILE_MIN_BATCH:
        dn = _values_tensor(buffers, "dn", (H, T, B), dt)
        gif, wi, bt, xv = _tile_input_operands(gi, np_dt)
        n = H * LANES
        bits = np.empty(2 * n, dtype=itype)
        hs, hf, hts, hbs = _outputs(T, B, H, dt, batch_first)
        compiled("reset_gated_tile")(
            gif, T * B, B, wi, bt, xv, w_hh.detach().contiguous().numpy(), bhn,
            h0.detach().contiguous().numpy(), cst, icst, hf, hts, hbs, d.numpy(), dn.numpy(), np.empty(n, dtype=np_dt),
            np.empty(G * LANES, dtype=np_dt), np.empty((3, n), dtype=np_dt), np.empty(n, dtype=np_dt), bits,
            bits.view(np_dt), _streams(d), *_prev_rows(prev, T, B, H, np_dt))
        return hs, d.transpose(1, 2), dn.permute(1, 2, 0)
    if isinstance(gi, InputProjection):
        gi = gi.materialize()
    out, hs = _time_major_outputs(T, B, H, dt, batch_first)
    dn = _values_tensor(buffers, "dn", (T, B, H), dt)
    acc = np.empty((B, G), dtype=np_dt)
    e = np.empty((3, B * H), dtype=np_dt)
    w = np.empty(B * H, dtype=np_dt)
    bits = np.empty(2 * B * H, dtype=itype)
    compiled("reset_gated")(gi.detach().contiguous().numpy(), w_hh.detach().t().contiguous().numpy(), bhn,
                            h0.detach().contiguous().numpy(), cst, icst, hs.numpy(), d.numpy(),
                            np.empty((B, 4 * H), dtype=np_dt), dn.numpy(), acc, e, w, bits, bits.view(np_dt))
    _fill_prev(prev, hs, h0)
    return out, d.transpose(1, 2), dn


class InputProjection(NamedTuple):
    """The input part of the gate pre-activations, ``x W_ih^T + bias``, not yet computed: the tiled
    forwards compute it per step from ``x`` when the input is narrow (at most ``FUSED_MAX_INPUT``
    features), instead of reading a ``(T, B, G)`` tensor made by a GEMM before the loop; that tensor is
    as large as the gate values the forward writes, and at ``I = 1`` the GEMM and the reads of its
    output cost more than the ``G * I`` multiply-adds per sample and step.

    ``x``: ``(T, B, I)``; ``w_ih``: ``(G, I)``; ``bias``: ``(G,)`` or ``None``.
    """

    x: torch.Tensor
    w_ih: torch.Tensor
    bias: Optional[torch.Tensor]

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.x.shape[0], self.x.shape[1], self.w_ih.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    @property
    def device(self) -> torch.device:
        return self.x.device

    def materialize(self) -> torch.Tensor:
        """The ``(T, B, G)`` gate inputs (:func:`gate_inputs`)."""
        return gate_inputs(self.x, self.w_ih, self.bias)


# widest input computed inside the tiled forwards (each feature adds G multiply-adds per sample and step)
FUSED_MAX_INPUT = 4


def input_projection(x: torch.Tensor, w_ih: torch.Tensor, bias: Optional[torch.Tensor]):
    """The gate inputs for the compiled forwards: an :class:`InputProjection` the tiles compute from
    ``x`` when ``x`` has at most ``FUSED_MAX_INPUT`` features, else :func:`gate_inputs` (one GEMM)."""
    if x.shape[-1] <= FUSED_MAX_INPUT:
        return InputProjection(x.detach(), w_ih.detach(), None if bias is None else bias.detach())
    return gate_inputs(x, w_ih, bias)


def _projection_operands(gi) -> tuple:
    """The tensors of an :class:`InputProjection` besides ``x`` (for the dtype/device checks); ``()`` for a tensor."""
    if isinstance(gi, InputProjection):
        return (gi.w_ih,) + (() if gi.bias is None else (gi.bias,))
    return ()


def _tile_input_operands(gi, np_dt):
    """``(gif, wi, bt, xv)`` of the tiled kernels' ``_tile_inputs``: from a ``(T, B, G)`` tensor, its
    ``(G, T, B)`` memory flat and an empty ``wi``; from an :class:`InputProjection`, ``x`` as ``(I, T, B)``
    memory flat, ``W_ih``, the bias repeated over a tile and the tile's input scratch."""
    if isinstance(gi, InputProjection):
        x, w_ih, bias = gi
        G, I = w_ih.shape
        bt = np.zeros(G * LANES, dtype=np_dt) if bias is None else np.repeat(bias.to(x.dtype).numpy(), LANES)
        return (x.permute(2, 0, 1).contiguous().numpy().reshape(-1), w_ih.contiguous().numpy(), bt,
                np.empty(I * LANES, dtype=np_dt))
    G = gi.shape[2]
    return (_gate_major(gi).permute(2, 0, 1).numpy().reshape(-1), np.empty((G, 0), dtype=np_dt),
            np.empty(0, dtype=np_dt), np.empty(0, dtype=np_dt))


def _streams(values: torch.Tensor) -> bool:
    """Whether a tiled forward writes ``values`` with non-temporal stores: where they outgrow half the
    last-level cache, so would be evicted before the backward reads them, and plain stores would only
    evict the data that stays; below it they are still cached when the linear scan reads them, and
    plain stores leave them there."""
    return values.numel() * values.element_size() > last_level_cache_bytes() // 2


def _prev_rows(prev: Optional[torch.Tensor], T: int, B: int, H: int, np_dt) -> tuple:
    """``(hz, row_stride)`` of the tiled kernels for a forward's ``prev`` (an empty array: not wanted), checked."""
    if prev is None:
        return np.empty(0, dtype=np_dt), 0
    if (prev.dim() != 3 or prev.shape[0] < H or tuple(prev.shape[1:]) != (T, B) or not prev.is_contiguous()
            or prev.numpy().dtype != np_dt):
        raise ValueError(f"prev: expected a contiguous (K >= {H}, {T}, {B}) {np.dtype(np_dt)} CPU tensor, got "
                         f"{tuple(prev.shape)} {prev.dtype}")
    return prev.numpy().reshape(-1), T * B


def _fill_prev(prev: Optional[torch.Tensor], hs: torch.Tensor, h0: torch.Tensor) -> None:
    """The per-sample loops' ``prev`` rows (the tiles write them as they go): ``h_0 .. h_{T-1}`` feature-major
    from ``hs`` ``(T, B, H)``."""
    if prev is None:
        return
    T, B, H = hs.shape
    _prev_rows(prev, T, B, H, hs.numpy().dtype)
    prev[:H, 0].copy_(h0.t())
    prev[:H, 1:].copy_(hs[:-1].permute(2, 0, 1))


def _values_tensor(buffers, name: str, shape: tuple, dt: torch.dtype) -> torch.Tensor:
    """A tensor the forward fills with chain values: ``buffers.take(name, shape, dt)`` (which may hand back
    last step's once nothing uses it), or new without ``buffers``."""
    return torch.empty(shape, dtype=dt) if buffers is None else buffers.take(name, shape, dt)


def _time_major_outputs(T: int, B: int, H: int, dt: torch.dtype, batch_first: bool):
    """``(out, hs)``: the outputs in the caller's layout, ``(T, B, H)`` or for ``batch_first`` ``(B, T, H)``, in
    ``(T, B, H)`` memory either way (a tensor of its own with those strides, not a view: a caller may change it
    in place), and ``hs``, its ``(T, B, H)`` view the forward writes. torch's own CPU modules lay a batch-first
    output out so, and what reads it in memory order (dropout's random mask, drawn into a tensor of the
    output's strides) then sees the order it sees after the module itself."""
    if not batch_first:
        hs = torch.empty(T, B, H, dtype=dt)
        return hs, hs
    out = torch.empty_strided((B, T, H), (H, B * H, 1), dtype=dt)
    return out, out.transpose(0, 1)


def _outputs(T: int, B: int, H: int, dt: torch.dtype, batch_first: bool):
    """``(out, flat, time_stride, sample_stride)``: the outputs (:func:`_time_major_outputs`) and their memory
    as the tiles write it."""
    out, hs = _time_major_outputs(T, B, H, dt, batch_first)
    return out, hs.numpy().reshape(-1), B * H, H


def _gate_major(gi: torch.Tensor) -> torch.Tensor:
    """``gi`` ``(T, B, G)`` as a view of ``(G, T, B)`` memory, the layout the tiles read (each gate row's
    samples contiguous): as it is when it already is (:func:`gate_inputs`), else one copy."""
    T, B, G = gi.shape
    gi = gi.detach()
    if gi.stride(1) != 1 or gi.stride(0) != B or gi.stride(2) != T * B:
        gi = gi.permute(2, 0, 1).contiguous().permute(1, 2, 0)
    return gi


def gate_inputs(x: torch.Tensor, w_ih: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x W_ih^T + bias`` as a ``(T, B, G)`` view of ``(G, T, B)`` memory, the layout the tiled forwards read.

    ``x``: ``(T, B, I)``; ``w_ih``: ``(G, I)``; ``bias``: ``(G,)`` or ``None``. One GEMM,
    ``W_ih (G, I) @ x (I, T*B)``.
    """
    T, B, I = x.shape
    xs = x.detach().permute(2, 0, 1).reshape(I, T * B)
    w = w_ih.detach()
    out = torch.mm(w, xs) if bias is None else torch.addmm(bias.detach().unsqueeze(1), w, xs)
    return out.view(-1, T, B).permute(1, 2, 0)
