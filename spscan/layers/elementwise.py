"""Layers acting on each element (activations, PReLU, dropout: a diagonal ``J^T``) or on each
slice along one dim (softmax: a dense block per slice, or its low-rank factors)."""

from __future__ import annotations

import math
from typing import Optional
from dataclasses import replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from spscan.layers.base import LayerUnit, PerDevice, UnitCapabilities, _identity_pattern
from spscan.layers.normalization import LowRankFactors

__all__ = ["ElementwiseUnit", "ElementwiseMoreUnit", "PReLUUnit", "DropoutUnit", "SoftmaxUnit", "ScaleUnit",
           "ParamAffineUnit"]


def _gelu_derivative(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """d gelu(x)/dx, written as torch's gelu_backward computes it."""
    if approximate == "tanh":
        k_beta = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
        k_kappa = 0.044715
        x_sq = x * x
        inner = k_beta * (x + k_kappa * x_sq * x)
        t = torch.tanh(inner)
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * (k_beta * (1 + 3 * k_kappa * x_sq))
    cdf = 0.5 * (1 + torch.erf(x * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


def _hardswish_derivative(x: torch.Tensor) -> torch.Tensor:
    """As torch's hardswish_backward: 0 up to -3, x/3 + 1/2 on (-3, 3), 1 from 3."""
    return torch.where(x <= -3, torch.zeros_like(x), torch.where(x < 3, x / 3 + 0.5, torch.ones_like(x)))


def _mish_derivative(x: torch.Tensor) -> torch.Tensor:
    """As torch's mish_backward: tanh(softplus(x)) + x * sigmoid(x) * (1 - tanh(softplus(x))^2)."""
    sig = torch.sigmoid(x)
    t = torch.tanh(F.softplus(x))
    return t + x * sig * (1 - t * t)


class ElementwiseUnit(LayerUnit):
    """ReLU, LeakyReLU, Tanh, Sigmoid, GELU, SiLU, ELU, Softplus, Hardtanh, ReLU6: diagonal ``J^T``,
    per-sample values ``f'(x)`` written as torch's backward formulas compute them."""

    shared = False
    capabilities = UnitCapabilities(shape_preserving=True, structured_operator=True)

    @classmethod
    def capabilities_for(cls, module):
        return replace(cls.capabilities, relu_mask=isinstance(module, nn.ReLU))

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        if isinstance(module, nn.GELU) and module.approximate not in ("none", "tanh"):
            raise ValueError(f"layer {index} (GELU): approximate 'none' or 'tanh' expected, got {module.approximate!r}")
        self.pattern = _identity_pattern(self.d_in)

    def run(self, x, tensors):
        m = self.module
        if isinstance(m, nn.ReLU):
            y = F.relu(x)
            return y, y
        if isinstance(m, nn.LeakyReLU):
            return F.leaky_relu(x, m.negative_slope), x
        if isinstance(m, nn.Tanh):
            y = torch.tanh(x)
            return y, y
        if isinstance(m, nn.Sigmoid):
            y = torch.sigmoid(x)
            return y, y
        if isinstance(m, nn.GELU):
            return F.gelu(x, approximate=m.approximate), x
        if isinstance(m, nn.SiLU):
            return F.silu(x), x
        if isinstance(m, nn.ELU):
            return F.elu(x, m.alpha), x
        if isinstance(m, nn.Softplus):
            return F.softplus(x, m.beta, m.threshold), x
        return F.hardtanh(x, m.min_val, m.max_val), x  # Hardtanh, ReLU6

    def fill(self, saved, tensors):
        m = self.module
        s = saved.detach().reshape(saved.shape[0], -1)
        if isinstance(m, nn.ReLU):
            return (s > 0).to(s.dtype)
        if isinstance(m, nn.LeakyReLU):
            return torch.where(s > 0, torch.ones_like(s), torch.full_like(s, m.negative_slope))
        if isinstance(m, nn.Tanh):
            return 1 - s * s
        if isinstance(m, nn.Sigmoid):
            return (1 - s) * s
        if isinstance(m, nn.GELU):
            return _gelu_derivative(s, m.approximate)
        if isinstance(m, nn.SiLU):
            sig = torch.sigmoid(s)
            return sig * (1 + s * (1 - sig))
        if isinstance(m, nn.ELU):
            return torch.where(s <= 0, m.alpha * torch.exp(s), torch.ones_like(s))
        if isinstance(m, nn.Softplus):
            z = torch.exp(s * m.beta)
            return torch.where(s * m.beta > m.threshold, torch.ones_like(s), z / (z + 1))
        return ((s > m.min_val) & (s < m.max_val)).to(s.dtype)

    def _aten_backward(self, g: torch.Tensor, saved: torch.Tensor, out: Optional[torch.Tensor] = None):
        """``J^T g`` by the ATen backward autograd calls for this activation, on the saved tensor (the output
        for ReLU, Tanh, Sigmoid; the input otherwise): one fused pass, no ``f'`` tensor; into ``out`` if given."""
        m, A, s = self.module, torch.ops.aten, saved.reshape(saved.shape[0], -1)
        kw: dict = {}
        if isinstance(m, nn.ReLU):
            op, args = A.threshold_backward, (g, s, 0)
        elif isinstance(m, nn.LeakyReLU):
            op, args = A.leaky_relu_backward, (g, s, m.negative_slope, False)
        elif isinstance(m, nn.Tanh):
            op, args = A.tanh_backward, (g, s)
        elif isinstance(m, nn.Sigmoid):
            op, args = A.sigmoid_backward, (g, s)
        elif isinstance(m, nn.GELU):
            op, args, kw = A.gelu_backward, (g, s), {"approximate": m.approximate}
        elif isinstance(m, nn.SiLU):
            op, args = A.silu_backward, (g, s)
        elif isinstance(m, nn.ELU):
            op, args = A.elu_backward, (g, m.alpha, 1, 1, False, s)
        elif isinstance(m, nn.Softplus):
            op, args = A.softplus_backward, (g, s, m.beta, m.threshold)
        else:  # Hardtanh, ReLU6
            op, args = A.hardtanh_backward, (g, s, m.min_val, m.max_val)
        return op(*args, **kw) if out is None else op.grad_input(*args, **kw, grad_input=out)

    def apply_transposed(self, saved, tensors, g):
        return self._aten_backward(g, saved)

    def apply_transposed_into(self, saved, tensors, g, out):
        return self._aten_backward(g, saved, out)

    @property
    def is_relu(self) -> bool:
        return isinstance(self.module, nn.ReLU)

    def chain_step(self, needed=None, masked_above: bool = False):
        """``masked_above``: the max-pool above applied this ReLU's mask at its pooled resolution
        (:meth:`MaxPoolUnit.chain_step` with ``relu_below``): the step passes ``g`` on unchanged."""
        if masked_above:
            if not self.is_relu:
                raise ValueError(f"layer {self.index} ({self.name}): masked_above applies to a ReLU only")
            return lambda saved, tensors, g: (g, None)
        if not self.is_relu:
            return super().chain_step(needed)
        threshold_backward = torch.ops.aten.threshold_backward

        def step(saved, tensors, g):  # autograd's own op on the saved output
            if g.shape != saved.shape:
                g = g.reshape(saved.shape)
            return threshold_backward(g, saved, 0), None

        return step


class ElementwiseMoreUnit(LayerUnit):
    """Hardswish, Hardsigmoid, Mish, SELU, CELU, Softsign: diagonal ``J^T``, per-sample ``f'(x)``
    as torch's backward formulas compute it."""

    shared = False
    capabilities = UnitCapabilities(structured_operator=True)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        self.pattern = _identity_pattern(self.d_in)

    def run(self, x, tensors):
        # the function itself, never the module's call: a module made with ``inplace=True`` would overwrite ``x``,
        # the input its derivative is evaluated at
        m = self.module
        if isinstance(m, nn.Hardswish):
            y = F.hardswish(x)
        elif isinstance(m, nn.Hardsigmoid):
            y = F.hardsigmoid(x)
        elif isinstance(m, nn.Mish):
            y = F.mish(x)
        elif isinstance(m, nn.SELU):
            y = F.selu(x)
        elif isinstance(m, nn.CELU):
            y = F.celu(x, m.alpha)
        else:
            y = F.softsign(x)
        return y, x

    def apply_transposed(self, saved, tensors, g):
        """``f'(x) g`` by the ATen backward kernel autograd calls for the layer (Softsign, which torch writes
        as a formula of other operations, as its diagonal times ``g``)."""
        m, x = self.module, saved.detach()
        b = g.shape[0]
        gy = g.reshape(x.shape)
        aten = torch.ops.aten
        if isinstance(m, nn.Hardswish):
            gi = aten.hardswish_backward(gy, x)
        elif isinstance(m, nn.Hardsigmoid):
            gi = aten.hardsigmoid_backward(gy, x)
        elif isinstance(m, nn.Mish):
            gi = aten.mish_backward(gy, x)
        elif isinstance(m, nn.SELU):
            gi = aten.elu_backward(gy, 1.6732632423543772848170429916717, 1.0507009873554804934193349852946, 1.0,
                                   False, x)
        elif isinstance(m, nn.CELU):
            inv = 1.0 / float(np.float32(m.alpha))  # as autograd: alpha rounded to float32
            if m.inplace:  # autograd differentiates celu_ from its output (another rounding of alpha)
                gi = aten.elu_backward(gy, m.alpha, 1.0, inv, True, F.celu(x, m.alpha))
            else:
                gi = aten.elu_backward(gy, m.alpha, 1.0, inv, False, x)
        else:
            return self.fill(saved, tensors).mul_(g.reshape(b, -1))
        return gi.reshape(b, -1)

    def fill(self, saved, tensors):
        m = self.module
        s = saved.detach().reshape(saved.shape[0], -1)
        if isinstance(m, nn.Hardswish):
            return _hardswish_derivative(s)
        if isinstance(m, nn.Hardsigmoid):
            # torch's kernel multiplies by 1.0f / 6.0f, a float32 constant, in every dtype
            return ((s > -3) & (s < 3)).to(s.dtype) * float(np.float32(1.0) / np.float32(6.0))
        if isinstance(m, nn.Mish):
            return _mish_derivative(s)
        if isinstance(m, nn.SELU):
            scale, alpha = 1.0507009873554804934193349852946, 1.6732632423543772848170429916717
            return torch.where(s <= 0, scale * alpha * torch.exp(s), torch.full_like(s, scale))
        if isinstance(m, nn.CELU):
            # torch differentiates celu as elu with input scale 1.0 / alpha.toFloat(): alpha rounded to float32
            inv = 1.0 / float(np.float32(m.alpha))
            if m.inplace:  # celu_ from its output y: (y + alpha) / alpha_f
                return torch.where(s <= 0, inv * (F.celu(s, m.alpha) + m.alpha), torch.ones_like(s))
            return torch.where(s <= 0, inv * m.alpha * torch.exp(s * inv), torch.ones_like(s))
        d = 1 + s.abs()  # Softsign: 1 / (1 + |x|)^2
        return 1 / (d * d)


class PReLUUnit(LayerUnit):
    """``nn.PReLU`` (one slope, or one per channel = per-sample dim 0): diagonal ``J^T``,
    ``1`` where ``x > 0`` else the channel's slope (per sample); ``dl/dw = sum g x [x <= 0]``."""

    shared = False
    roles = ("weight",)
    capabilities = UnitCapabilities(structured_operator=True)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        k = module.num_parameters
        if len(in_shape) < 1:
            raise ValueError(f"layer {index} (PReLU): expected per-sample input (C, ...), got {tuple(in_shape)}")
        if k != 1 and k != in_shape[0]:
            raise ValueError(f"layer {index} (PReLU): num_parameters 1 or {in_shape[0]} (channels) expected, "
                             f"got {k}")
        self.pattern = _identity_pattern(self.d_in)
        self.per_channel = k != 1
        per = self.d_in // in_shape[0]
        ch = np.repeat(np.arange(in_shape[0], dtype=np.int64), per) if self.per_channel else np.zeros(self.d_in, np.int64)
        self.channel_of = PerDevice.index(ch)

    def run(self, x, tensors):
        return F.prelu(x, tensors[0]), x

    def fill(self, saved, tensors):
        s = saved.detach().reshape(saved.shape[0], -1)
        slope = torch.index_select(tensors[0].detach().reshape(-1), 0, self.channel_of.on(s.device))
        return torch.where(s > 0, torch.ones_like(s), slope.expand_as(s))

    def apply_transposed(self, saved, tensors, g):
        """The diagonal times ``g``: ``g`` where ``x > 0``, else the channel's slope times ``g``."""
        return self.fill(saved, tensors).mul_(g.reshape(g.shape[0], -1))

    def param_grads(self, saved, tensors, g_out, needed=None):
        if needed is not None and not needed[0]:
            return [None]
        x = saved
        c = self.in_shape[0]
        contrib = torch.where(x > 0, torch.zeros_like(x), x) * g_out.reshape(x.shape)
        per_channel = contrib.reshape(x.shape[0], c, -1).sum((0, 2))
        return [per_channel if self.per_channel else per_channel.sum().reshape(1)]


class _Scale(nn.Module):
    """A traced ``x * c``, ``c * x``, ``x / c``, ``-x``, ``x + c``, ``c + x``, ``x - c`` or ``c - x`` with ``c`` a Python
    number: ``form`` is ``mul``, ``div``, ``neg``, ``add``, ``sub`` or ``rsub``."""

    def __init__(self, form: str, c: float) -> None:
        super().__init__()
        if form not in ("mul", "div", "neg", "add", "sub", "rsub"):
            raise ValueError(f"unknown scalar form {form!r}")
        self.form, self.c = form, c

    @property
    def scale(self) -> float:
        """The derivative: ``c``, ``1/c``, ``-1`` or ``1``."""
        return {"mul": self.c, "div": 1.0 / self.c if self.c else float("inf"), "neg": -1.0,
                "rsub": -1.0}.get(self.form, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the expression as written (bit for bit)
        f, c = self.form, self.c
        return x * c if f == "mul" else x / c if f == "div" else -x if f == "neg" else x + c if f == "add" \
            else x - c if f == "sub" else c - x

    def backward(self, g: torch.Tensor) -> torch.Tensor:
        """``J^T g`` as autograd computes it for the form (``g / c`` for a division, not ``g * (1/c)``)."""
        f = self.form
        return g * self.c if f == "mul" else g / self.c if f == "div" else -g if f in ("neg", "rsub") else g

    def extra_repr(self) -> str:
        return f"{self.form}, {self.c}"


class ScaleUnit(LayerUnit):
    """An affine map of every entry by Python numbers (``x * c``, ``x / c``, ``-x``, ``x + c``, ``c - x``):
    ``J^T = c I``, shared; the operator is one multiply (none for a shift)."""

    shared = True
    capabilities = UnitCapabilities(shape_preserving=True, structured_operator=True)

    def __init__(self, index: int, module: _Scale, in_shape: tuple[int, ...], out_shape: tuple[int, ...]):
        super().__init__(index, module, in_shape, out_shape)
        if tuple(in_shape) != tuple(out_shape):
            raise ValueError(f"layer {index} (scale): shape-preserving expected, got {in_shape} -> {out_shape}")
        self.pattern = _identity_pattern(self.d_in)
        c = float(module.scale)
        self._values = PerDevice(lambda dtype, device: torch.full((self.d_in,), c, dtype=dtype, device=device))

    @property
    def name(self) -> str:
        return f"{self.module.form} {self.module.c:g}" if self.module.form != "neg" else "neg"

    def run(self, x, tensors):
        return self.module(x), (x.dtype, x.device)

    def fill(self, saved, tensors):
        return self._values.get(*saved)

    def apply_transposed(self, saved, tensors, g):
        return self.module.backward(g)


class ParamAffineUnit(LayerUnit):
    """``x + p`` or ``x * p`` with ``p`` a parameter read functionally (``get_attr``) that broadcasts over the
    batch and to ``x``'s per-sample shape without enlarging it: a ViT's ``x + self.pos_embed``, a LayerScale's
    ``x * self.gamma``. ``J^T = I`` (add) or ``diag(p)`` broadcast (mul), shared by the batch; the parameter's
    gradient is ``g`` (add) or ``g ⊙ x`` (mul) summed over the dims ``p`` broadcasts along, as autograd sums it.
    ``roles`` is the parameter's qualified name in the model."""

    shared = True
    capabilities = UnitCapabilities(shape_preserving=True, structured_operator=True)

    def __init__(self, index: int, form: str, name: str, param: nn.Parameter, in_shape: tuple[int, ...],
                 out_shape: tuple[int, ...]):
        if form not in ("add", "mul"):
            raise ValueError(f"unknown parameter form {form!r}")
        super().__init__(index, nn.Module(), in_shape, out_shape)
        full = (1,) + tuple(in_shape)
        shape = (1,) * (len(full) - param.dim()) + tuple(param.shape)
        if tuple(in_shape) != tuple(out_shape) or len(shape) != len(full) or shape[0] != 1 \
                or any(a not in (1, b) for a, b in zip(shape, full)):
            raise ValueError(f"parameter of shape {tuple(param.shape)} does not broadcast to the batch's (B, *{in_shape})")
        self.form, self.param, self.roles = form, param, (name,)
        self._shape = shape  # p as it broadcasts against (B, *in_shape)
        self._sum_dims = tuple(i for i, (a, b) in enumerate(zip(shape, (2,) + tuple(in_shape))) if a == 1 and b != 1)
        self.pattern = _identity_pattern(self.d_in)
        self._ones = PerDevice(lambda dtype, device: torch.ones(self.d_in, dtype=dtype, device=device))

    @property
    def name(self) -> str:
        return f"{self.form} {self.roles[0]}"

    def tensors(self) -> list[torch.Tensor]:
        return [self.param]

    def parameters_for_roles(self) -> list[tuple[nn.Parameter, Optional[torch.Tensor]]]:
        return [(self.param, None)]

    def run(self, x, tensors):
        p = tensors[0]
        y = x + p if self.form == "add" else x * p
        return y, (x if self.form == "mul" else None, x.dtype, x.device)

    def fill(self, saved, tensors):
        _, dtype, device = saved
        if self.form == "add":
            return self._ones.get(dtype, device)
        d = tensors[0].detach().reshape(self._shape).expand((1,) + self.in_shape)
        return d.reshape(-1).to(dtype)

    def apply_transposed(self, saved, tensors, g):
        if self.form == "add":
            return g
        b = g.shape[0]
        return (g.reshape((b,) + self.in_shape) * tensors[0].reshape(self._shape)).reshape(b, self.d_in)

    def param_grads(self, saved, tensors, g_out, needed=None):
        if needed is not None and not needed[0]:
            return [None]
        x, _, _ = saved
        b = g_out.shape[0]
        g = g_out.reshape((b,) + self.in_shape)
        if self.form == "mul":
            g = g * x.reshape((b,) + self.in_shape)
        p = tensors[0]
        return [g.sum(self._sum_dims, keepdim=True).reshape(p.shape) if self._sum_dims else g.reshape(p.shape)]


class DropoutUnit(LayerUnit):
    """``nn.Dropout`` / ``nn.Dropout1d`` / ``nn.Dropout2d``: diagonal ``J^T``. Eval: ones (shared).
    Train: the sampled mask scaled by ``1/(1-p)`` (per sample; for the channel-wise kinds one
    draw per channel, spread over its elements), sampled exactly as ``F.dropout*`` samples it."""

    capabilities = UnitCapabilities(shape_preserving=True, structured_operator=True, mode_dependent=True)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        self.feature_dims = {nn.Dropout1d: 1, nn.Dropout2d: 2}.get(type(module), 0)
        if self.feature_dims and len(in_shape) != self.feature_dims + 1:
            raise ValueError(f"layer {index} ({self.name}): expected per-sample input (C, "
                             f"{'L' if self.feature_dims == 1 else 'H, W'}), got {tuple(in_shape)}")
        self.pattern = _identity_pattern(self.d_in)

    @property
    def shared(self) -> bool:  # type: ignore[override]
        return not self.module.training

    def run(self, x, tensors):
        p = float(self.module.p)
        if not self.module.training or p == 0.0:
            return x.clone() if self.module.training else x, ("ones", x.shape[0], x.dtype, x.device, self.module.training)
        if p == 1.0:
            scale = torch.zeros_like(x)
        elif self.feature_dims:
            # as torch's feature dropout: one bernoulli_(1-p) per (sample, channel), / (1-p), broadcast
            noise = x.new_empty(x.shape[:2] + (1,) * self.feature_dims).bernoulli_(1 - p).div_(1 - p)
            return x * noise, ("mask", noise.expand_as(x))
        elif x.device.type == "cuda":
            # F.dropout uses the fused kernel on CUDA: same call, same mask; its backward is grad*mask/(1-p)
            y, mask = torch.native_dropout(x, p, True)
            return y, ("mask", mask.to(x.dtype) * (1.0 / (1.0 - p)))
        else:
            # same RNG call and arithmetic as F.dropout on CPU: bernoulli_(1-p), then / (1-p)
            scale = torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)
        return x * scale, ("mask", scale)

    def fill(self, saved, tensors):
        if saved[0] == "ones":
            _, b, dtype, device, training = saved
            ones = torch.ones(self.d_in, dtype=dtype, device=device)
            return ones.expand(b, -1) if training else ones
        return saved[1].reshape(saved[1].shape[0], -1)  # expanded channel masks materialize here

    def apply_transposed(self, saved, tensors, g):
        if saved[0] == "ones":
            return g
        return g * saved[1].reshape(saved[1].shape[0], -1)


class SoftmaxUnit(LowRankFactors):
    """``nn.Softmax`` / ``nn.LogSoftmax`` along ``dim`` (not the batch dim). Per slice along ``dim``
    (``N`` its length, ``s`` the softmax): Softmax ``J^T = diag(s) - s s^T``, LogSoftmax
    ``J^T = I - s 1^T`` (``J^T[j, i] = δ_ij - s_j``), a diagonal minus rank 1.

    * Structured operator: ``J^T g = s⊙(g - <s, g>)`` (Softmax) or ``g - s Σg`` (LogSoftmax) per
      slice, O(N), through the layer's own backward kernel (``_softmax_backward_data`` /
      ``_log_softmax_backward_data``, which autograd calls).
    * CSR values (up-sweep products only): one dense ``N x N`` block per slice, per sample.
    """

    shared = False
    capabilities = UnitCapabilities(structured_operator=True, low_rank_factors=True)

    def __init__(self, index, module, in_shape, out_shape, prune_zeros: bool = False):
        super().__init__(index, module, in_shape, out_shape)
        nd = len(in_shape) + 1
        if module.dim is None:
            raise ValueError(f"layer {index} ({self.name}): an explicit dim expected (dim=None picks one "
                             "implicitly), got dim=None")
        dim = int(module.dim)
        if not -nd <= dim < nd or dim % nd == 0:
            raise ValueError(f"layer {index} ({self.name}): dim in 1..{nd - 1} (or its negative) expected "
                             f"for per-sample input {tuple(in_shape)}; the batch dim 0 couples samples, got {dim}")
        self.dim = dim % nd
        self.log = isinstance(module, nn.LogSoftmax)
        flat = np.arange(self.d_in, dtype=np.int64).reshape(in_shape)
        slices = np.moveaxis(flat, self.dim - 1, -1).reshape(-1, in_shape[self.dim - 1])
        self.slices = PerDevice.index(slices.reshape(-1))
        self.n_slice = slices.shape[1]
        self.rank, self.factor_groups = 1, np.ascontiguousarray(slices)

    def run(self, x, tensors):
        fn = F.log_softmax if self.log else F.softmax
        y = fn(x, self.dim)
        return y, y

    def _slices(self, saved) -> tuple[torch.Tensor, torch.Tensor]:
        """The saved output ``(B, d)`` and the softmax ``s`` per slice ``(B, slices, N)``."""
        y = saved.detach().reshape(saved.shape[0], -1)
        s = torch.index_select(y, 1, self.slices.on(y.device)).reshape(y.shape[0], -1, self.n_slice)
        return y, (torch.exp(s) if self.log else s)

    def fill(self, saved, tensors):
        y, s = self._slices(saved)
        if self.log:
            eye = torch.eye(self.n_slice, dtype=y.dtype, device=y.device)
            v = eye - s.unsqueeze(3)  # [b, slice, j, i] = δ_ij - s_j
        else:
            v = torch.diag_embed(s) - s.unsqueeze(3) * s.unsqueeze(2)
        v = v.reshape(y.shape[0], -1)
        order = self.dense_order
        return v if order is None else torch.index_select(v, 1, order.on(y.device))

    def factor_shared(self):
        return False, self.log  # LogSoftmax's R = [I ; 1^T] is a constant

    def _factor_parts(self, saved, tensors):
        # Softmax: L = [diag(s) | -s], R = [I ; s^T]; LogSoftmax: L = [I | -s], R = [I ; 1^T] (per slice)
        _, s = self._slices(saved)
        if self.log:
            ones = torch.ones_like(s)
            return torch.stack([ones, -s], 1), torch.ones((2,) + s.shape[1:], dtype=s.dtype, device=s.device)
        return torch.stack([s, -s], 1), torch.stack([torch.ones_like(s), s], 1)

    def apply_transposed(self, saved, tensors, g):
        y = saved.detach()
        back = torch.ops.aten._log_softmax_backward_data if self.log else torch.ops.aten._softmax_backward_data
        return back(g.reshape(y.shape), y, self.dim, y.dtype).reshape(g.shape[0], -1)
