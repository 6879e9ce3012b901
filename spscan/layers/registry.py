"""The one registry from what a model computes to the unit that stands for it.

:data:`NODE_UNITS` maps

* an ``nn.Module`` type (a chain's layers; a traced graph's ``call_module`` nodes) to its unit
  class, built as ``unit_class(index, module, in_shape, out_shape, prune_zeros=...)``; exact types
  only (a subclass with its own ``forward`` is refused: the unit would not know what it computes);
* a function (``call_function``: ``F.relu``, ``torch.flatten``, ``operator.getitem``, ...) or
  ``("method", name)`` (``call_method``: ``x.view(...)``) to a builder
  ``(index, args, kwargs, in_shape, out_shape, prune_zeros) -> LayerUnit`` (most build the module
  the call stands for and its unit);
* the targets that join branches to :data:`JOIN_ADD` or :data:`JOIN_CAT`;
* the products of two graph tensors to :data:`PRODUCT_MATMUL` or :data:`PRODUCT_MUL`
  (a :class:`~spscan.layers.products.ProductUnit`), softmax attention to :data:`ATTENTION`
  (an :class:`~spscan.layers.products.AttentionUnit`).

Adding a layer type: its unit class in its family module (declaring its capabilities) and one
``_modules`` line here, plus a ``_targets`` line for each functional form.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from spscan.layers.base import LayerUnit, UnitCapabilities
from spscan.errors import NotPlannable
from spscan.layers.elementwise import (DropoutUnit, ElementwiseMoreUnit, ElementwiseUnit, PReLUUnit, ScaleUnit,
                                       SoftmaxUnit, _Scale)
from spscan.layers.linear import (ConvTransposeUnit, ConvUnit, EmbeddingUnit, LinearUnit, ReductionUnit,
                                  SeparableResampleUnit, _Reduction)
from spscan.layers.normalization import BatchNormUnit, GroupNormUnit, LayerNormUnit
from spscan.layers.pooling import AvgPoolUnit, MaxPoolUnit
from spscan.layers.shape import (PerSampleReshapeUnit, ReshapeUnit, SelectionUnit, UnflattenUnit, _PerSampleReshape,
                                 _Selection)

__all__ = ["NODE_UNITS", "JOIN_ADD", "JOIN_CAT", "PRODUCT_MATMUL", "PRODUCT_MUL", "ATTENTION",
           "SCALAR_FORMS", "scalar_unit", "make_unit", "supported_layer_types", "supported_node_targets",
           "unit_class", "unit_capabilities"]

#: what a join target maps to: ``y = a + b`` of two branches, or their concatenation along dim 1
JOIN_ADD = "add"
JOIN_CAT = "cat"
#: what a product target maps to: ``a @ b`` or ``a * b`` of two graph tensors (``ProductUnit`` kinds)
PRODUCT_MATMUL = "matmul"
PRODUCT_MUL = "mul"
#: what ``F.scaled_dot_product_attention`` maps to: softmax attention of three graph tensors
ATTENTION = "attention"

NodeBuilder = Callable[[int, Sequence[Any], dict, tuple, tuple, bool], LayerUnit]

#: module type -> unit class; function or ``("method", name)`` -> builder; join target -> join kind
NODE_UNITS: dict[Any, Any] = {}


def _modules(unit: type[LayerUnit], *module_types: type) -> None:
    for t in module_types:
        NODE_UNITS[t] = unit


def _targets(builder: Any, *targets: Any) -> None:
    for t in targets:
        NODE_UNITS[t] = builder


# ----------------------------------------------------------------------------- module types

_modules(LinearUnit, nn.Linear)
_modules(ConvUnit, nn.Conv1d, nn.Conv2d)
_modules(ElementwiseUnit, nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.GELU)
_modules(MaxPoolUnit, nn.MaxPool1d, nn.MaxPool2d)
_modules(AvgPoolUnit, nn.AvgPool1d, nn.AvgPool2d)
_modules(BatchNormUnit, nn.BatchNorm1d, nn.BatchNorm2d)
_modules(DropoutUnit, nn.Dropout, nn.Dropout1d, nn.Dropout2d)
_modules(ElementwiseUnit, nn.SiLU, nn.ELU, nn.Softplus, nn.Hardtanh, nn.ReLU6)
_modules(ReshapeUnit, nn.Flatten, nn.Identity)
_modules(UnflattenUnit, nn.Unflatten)
_modules(LayerNormUnit, nn.LayerNorm)
_modules(GroupNormUnit, nn.GroupNorm)
_modules(SoftmaxUnit, nn.Softmax, nn.LogSoftmax)
_modules(PReLUUnit, nn.PReLU)
_modules(ElementwiseMoreUnit, nn.Hardswish, nn.Hardsigmoid, nn.Mish, nn.SELU, nn.CELU, nn.Softsign)
_modules(SeparableResampleUnit, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.Upsample, nn.UpsamplingNearest2d,
         nn.UpsamplingBilinear2d, nn.ZeroPad1d, nn.ZeroPad2d, nn.ReflectionPad1d, nn.ReflectionPad2d,
         nn.ReplicationPad1d, nn.ReplicationPad2d)
_modules(ConvTransposeUnit, nn.ConvTranspose1d, nn.ConvTranspose2d)
_modules(EmbeddingUnit, nn.Embedding)


def supported_layer_types() -> tuple[type, ...]:
    """The ``nn.Module`` types the layer library has a unit for (exact types, not subclasses)."""
    return tuple(k for k in NODE_UNITS if isinstance(k, type))


def unit_class(module_type: type) -> Optional[type[LayerUnit]]:
    """The unit class registered for ``module_type`` (exactly that type), or ``None``."""
    got = NODE_UNITS.get(module_type) if isinstance(module_type, type) else None
    return got if isinstance(got, type) and issubclass(got, LayerUnit) else None


def unit_capabilities(module: nn.Module) -> UnitCapabilities:
    """What the unit of ``module`` (a supported layer) declares before it is built."""
    unit = unit_class(type(module))
    if unit is None:
        raise NotPlannable(f"unsupported layer type {type(module).__module__}.{type(module).__name__}")
    return unit.capabilities_for(module)


def make_unit(index: int, module: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
              prune_zeros: bool = False) -> LayerUnit:
    """The unit for ``module`` at chain position ``index`` mapping per-sample ``in_shape`` to ``out_shape``.

    Raises ``TypeError`` for a layer type without a unit (subclasses with their own ``forward``
    are refused: the unit would not know what they compute).
    """
    unit = unit_class(type(module))
    if unit is None:
        names = ", ".join(t.__name__ for t in supported_layer_types())
        raise NotPlannable(f"layer {index}: unsupported layer type {type(module).__module__}.{type(module).__name__}; "
                        f"supported: {names}")
    return unit(index, module, tuple(in_shape), tuple(out_shape), prune_zeros=prune_zeros)


# ----------------------------------------------------------------------------- functions and methods


def _arg(args: Sequence[Any], kwargs: dict, i: int, name: str, default: Any) -> Any:
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _module_builder(mod_from_args: Callable[[Sequence[Any], dict], nn.Module]) -> NodeBuilder:
    """A call that computes what a module does: build that module from the call's arguments, then its unit."""
    def build(index, args, kwargs, in_shape, out_shape, prune_zeros):
        return make_unit(index, mod_from_args(args, kwargs), in_shape, out_shape, prune_zeros=prune_zeros)
    return build


def _positional(cls: type, *params: tuple[str, Any]) -> NodeBuilder:
    """``f(x, p1, p2, ...)`` as the module ``cls(p1, p2, ...)`` (an ``inplace`` flag is dropped: the plan
    runs its own forward out of place, with the same values)."""
    return _module_builder(lambda args, kwargs: cls(*[_arg(args, kwargs, 1 + i, n, d)
                                                      for i, (n, d) in enumerate(params)]))


def _softmax(cls: type) -> NodeBuilder:
    def make(args, kwargs):
        if _arg(args, kwargs, 2, "_stacklevel", 3) not in (3,) or kwargs.get("dtype") is not None:
            raise ValueError("a dtype argument is not supported")
        return cls(dim=_arg(args, kwargs, 1, "dim", None))
    return _module_builder(make)


def _reshape_builder(index, args, kwargs, in_shape, out_shape, prune_zeros):
    return PerSampleReshapeUnit(index, _PerSampleReshape(out_shape), in_shape, out_shape)


def _squeeze_builder(how: str) -> NodeBuilder:
    """``x.unsqueeze(d)`` / ``x.squeeze(d)`` of a per-sample dim (``d`` given, not the batch dim: ``x.squeeze()``
    would drop the batch dim of a batch of one): ``J^T = I``."""
    def build(index, args, kwargs, in_shape, out_shape, prune_zeros):
        d = _arg(args, kwargs, 1, "dim", None)
        nd = len(in_shape) + 1 + (how == "unsqueeze")
        dims = d if isinstance(d, (tuple, list)) else (d,)
        if not dims or not all(isinstance(v, int) and not isinstance(v, bool) and -nd <= v < nd and v % nd != 0
                               for v in dims):
            raise ValueError(f"{how}: per-sample dims (not the batch dim, not all dims) expected, got {d!r}")
        return _reshape_builder(index, args, kwargs, in_shape, out_shape, prune_zeros)
    return build


def _reduction_builder(kind: str) -> NodeBuilder:
    """``x.mean(dims)`` / ``x.sum(dims, keepdim)`` over per-sample dims (no ``dtype``): a :class:`ReductionUnit`."""
    def build(index, args, kwargs, in_shape, out_shape, prune_zeros):
        d = _arg(args, kwargs, 1, "dim", None)
        keepdim = _arg(args, kwargs, 2, "keepdim", False)
        nd = len(in_shape) + 1
        dims = d if isinstance(d, (tuple, list)) else (d,)
        if kwargs.get("dtype") is not None or len(args) > 3 or not isinstance(keepdim, bool) or not dims \
                or not all(isinstance(v, int) and not isinstance(v, bool) and -nd <= v < nd for v in dims):
            raise ValueError(f"{kind}: integer per-sample dims expected, got dim={d!r}")
        dims = tuple(sorted({v % nd for v in dims}))
        if 0 in dims:
            raise ValueError(f"{kind} over the batch dim")
        return ReductionUnit(index, _Reduction(kind, dims, keepdim), in_shape, out_shape)
    return build


def _pad_builder(index, args, kwargs, in_shape, out_shape, prune_zeros):
    """``F.pad`` with zeros: ``nn.ZeroPad1d/2d``'s unit for the last dims of a ``(B, C, L)`` / ``(B, C, H, W)``
    input, else (e.g. channel padding, as in the option-A shortcut) a :class:`SelectionUnit`."""
    pad = tuple(int(p) for p in _arg(args, kwargs, 1, "pad", None))
    mode = _arg(args, kwargs, 2, "mode", "constant")
    value = _arg(args, kwargs, 3, "value", None)
    if mode != "constant" or value not in (None, 0, 0.0):
        raise ValueError(f"F.pad: zero padding (mode='constant', value=0) expected, got mode={mode!r}, value={value!r}")
    nd = len(in_shape) + 1
    if len(pad) % 2 or not 2 <= len(pad) <= 2 * len(in_shape):
        raise ValueError(f"F.pad: an even number of padding values for at most the {len(in_shape)} per-sample dims "
                         f"expected, got {len(pad)}")
    if len(pad) == 2 and nd == 3:
        return make_unit(index, nn.ZeroPad1d(pad), in_shape, out_shape, prune_zeros=prune_zeros)
    if len(pad) == 4 and nd == 4:
        return make_unit(index, nn.ZeroPad2d(pad), in_shape, out_shape, prune_zeros=prune_zeros)
    return SelectionUnit(index, _Selection("pad", pad), in_shape, out_shape)


def _slice_builder(index, args, kwargs, in_shape, out_shape, prune_zeros):
    """``x[key]`` with basic indexing (slices with any step, integers, ``...``, ``None``), batch dim kept whole."""
    key = args[1] if len(args) > 1 else None
    items = key if isinstance(key, tuple) else (key,)
    if kwargs or not all(k is None or k is Ellipsis or isinstance(k, (slice, int)) and not isinstance(k, bool)
                         for k in items):
        raise TypeError(f"indexing with {key!r}: only basic indexing (slices, integers, '...', None) is supported, "
                        "not tensors, lists or masks")
    for k in items:
        if isinstance(k, slice) and not all(v is None or isinstance(v, int) for v in (k.start, k.stop, k.step)):
            raise TypeError(f"indexing with {key!r}: slice bounds must be Python integers")
    return SelectionUnit(index, _Selection("slice", key), in_shape, out_shape)


def _dims_permutation(nd: int, args: Sequence[Any], kwargs: dict, how: str) -> tuple[int, ...]:
    """The permutation of ``nd`` dims that ``permute``/``transpose``/``swapaxes``/``movedim`` make."""
    def dim(d: Any) -> int:
        if isinstance(d, bool) or not isinstance(d, int) or not -nd <= d < nd:
            raise TypeError(f"{how}: integer dims in [-{nd}, {nd}) expected, got {d!r}")
        return d % nd

    if how == "permute":
        dims = list(args[1:]) or list(kwargs.get("dims", ()))
        if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
            dims = list(dims[0])
        perm = tuple(dim(d) for d in dims)
        if sorted(perm) != list(range(nd)):
            raise TypeError(f"permute: {dims!r} is not a permutation of {nd} dims")
        return perm
    if how == "movedim":
        src, dst = _arg(args, kwargs, 1, "source", None), _arg(args, kwargs, 2, "destination", None)
        src, dst = ([src], [dst]) if isinstance(src, int) else (list(src), list(dst))
        src, dst = [dim(d) for d in src], [dim(d) for d in dst]
        if len(src) != len(dst) or len(set(src)) != len(src) or len(set(dst)) != len(dst):
            raise TypeError("movedim: source and destination of the same length, without repeats, expected")
        rest = iter(d for d in range(nd) if d not in src)
        at = dict(zip(dst, src))
        return tuple(at[i] if i in at else next(rest) for i in range(nd))
    names = ("axis0", "axis1") if how == "swapaxes" else ("dim0", "dim1")
    a, b = dim(_arg(args, kwargs, 1, names[0], None)), dim(_arg(args, kwargs, 2, names[1], None))
    perm = list(range(nd))
    perm[a], perm[b] = perm[b], perm[a]
    return tuple(perm)


def _permute_builder(how: str) -> NodeBuilder:
    """``x.permute(...)``, ``x.transpose(a, b)``, ``x.swapaxes(a, b)``, ``x.movedim(s, d)`` keeping the batch dim
    first: a :class:`SelectionUnit` (``J^T`` is the inverse permutation). One that moves the batch dim is not a
    per-sample map (refused here; the graph front end then treats it as it treats any such tensor)."""
    def build(index, args, kwargs, in_shape, out_shape, prune_zeros):
        perm = _dims_permutation(len(in_shape) + 1, args, kwargs, how)
        if perm[0] != 0:
            raise ValueError(f"{how}: the permutation {perm} moves the batch dim")
        return SelectionUnit(index, _Selection("permute", perm), in_shape, out_shape)
    return build


def _interpolate(args, kwargs) -> nn.Module:
    return nn.Upsample(size=_arg(args, kwargs, 1, "size", None), scale_factor=_arg(args, kwargs, 2, "scale_factor", None),
                       mode=_arg(args, kwargs, 3, "mode", "nearest"),
                       align_corners=_arg(args, kwargs, 4, "align_corners", None),
                       recompute_scale_factor=_arg(args, kwargs, 5, "recompute_scale_factor", None))


_MAX_POOL_ARGS = (("kernel_size", None), ("stride", None), ("padding", 0), ("dilation", 1), ("ceil_mode", False))
_AVG_POOL_ARGS = (("kernel_size", None), ("stride", None), ("padding", 0), ("ceil_mode", False),
                  ("count_include_pad", True))

_targets(_positional(nn.ReLU), F.relu, torch.relu, ("method", "relu"))
_targets(_positional(nn.ReLU6), F.relu6)
_targets(_positional(nn.LeakyReLU, ("negative_slope", 0.01)), F.leaky_relu)
_targets(_positional(nn.Tanh), torch.tanh, F.tanh, ("method", "tanh"))
_targets(_positional(nn.Sigmoid), torch.sigmoid, F.sigmoid, ("method", "sigmoid"))
_targets(_module_builder(lambda a, k: nn.GELU(approximate=k.get("approximate", "none"))), F.gelu)
_targets(_positional(nn.SiLU), F.silu)
_targets(_positional(nn.ELU, ("alpha", 1.0)), F.elu)
_targets(_positional(nn.SELU), F.selu, torch.selu)
_targets(_positional(nn.CELU, ("alpha", 1.0)), F.celu)
_targets(_positional(nn.Softplus, ("beta", 1.0), ("threshold", 20.0)), F.softplus)
_targets(_positional(nn.Hardtanh, ("min_val", -1.0), ("max_val", 1.0)), F.hardtanh)
_targets(_positional(nn.Hardswish), F.hardswish)
_targets(_positional(nn.Hardsigmoid), F.hardsigmoid)
_targets(_positional(nn.Mish), F.mish)
_targets(_positional(nn.Softsign), F.softsign)
_targets(_softmax(nn.Softmax), F.softmax, torch.softmax, ("method", "softmax"))
_targets(_softmax(nn.LogSoftmax), F.log_softmax, torch.log_softmax, ("method", "log_softmax"))
_targets(_positional(nn.MaxPool2d, *_MAX_POOL_ARGS), F.max_pool2d)
_targets(_positional(nn.MaxPool1d, *_MAX_POOL_ARGS), F.max_pool1d)
_targets(_positional(nn.AvgPool2d, *_AVG_POOL_ARGS, ("divisor_override", None)), F.avg_pool2d)
_targets(_positional(nn.AvgPool1d, *_AVG_POOL_ARGS), F.avg_pool1d)
_targets(_positional(nn.AdaptiveAvgPool2d, ("output_size", None)), F.adaptive_avg_pool2d)
_targets(_positional(nn.AdaptiveAvgPool1d, ("output_size", None)), F.adaptive_avg_pool1d)
_targets(_pad_builder, F.pad)
_targets(_slice_builder, operator.getitem)
_targets(_module_builder(_interpolate), F.interpolate)
_targets(_permute_builder("permute"), torch.permute, ("method", "permute"))
_targets(_permute_builder("transpose"), torch.transpose, ("method", "transpose"))
_targets(_permute_builder("swapaxes"), torch.swapaxes, ("method", "swapaxes"))
_targets(_permute_builder("swapdims"), torch.swapdims, ("method", "swapdims"))
_targets(_permute_builder("movedim"), torch.movedim, torch.moveaxis, ("method", "movedim"), ("method", "moveaxis"))
_targets(_reduction_builder("mean"), torch.mean, ("method", "mean"))
_targets(_reduction_builder("sum"), torch.sum, ("method", "sum"))
_targets(_squeeze_builder("unsqueeze"), torch.unsqueeze, ("method", "unsqueeze"))
_targets(_squeeze_builder("squeeze"), torch.squeeze, ("method", "squeeze"))
_targets(_reshape_builder, torch.flatten, torch.reshape, ("method", "flatten"), ("method", "view"),
         ("method", "reshape"), ("method", "contiguous"), ("method", "unflatten"), torch.unflatten)
_targets(JOIN_ADD, operator.add, operator.iadd, torch.add, ("method", "add"))
_targets(PRODUCT_MATMUL, operator.matmul, torch.matmul, torch.bmm, ("method", "matmul"), ("method", "bmm"))
_targets(PRODUCT_MUL, operator.mul, torch.mul, ("method", "mul"))
_targets(ATTENTION, F.scaled_dot_product_attention)
_targets(JOIN_CAT, torch.cat, torch.concat, torch.concatenate)


# ----------------------------------------------------------------------------- scalar arithmetic

#: calls that are an affine map of one graph tensor when their other operand is a Python number:
#: target -> ``"mul"``, ``"div"``, ``"add"``, ``"sub"`` or ``"neg"`` (the same targets join or multiply two
#: graph tensors through :data:`NODE_UNITS`)
SCALAR_FORMS: dict[Any, str] = {}
for _form, _ts in (("mul", (operator.mul, torch.mul, ("method", "mul"))),
                   ("div", (operator.truediv, torch.div, torch.true_divide, ("method", "div"))),
                   ("add", (operator.add, torch.add, ("method", "add"))),
                   ("sub", (operator.sub, torch.sub, ("method", "sub"))),
                   ("neg", (operator.neg, torch.neg, ("method", "neg")))):
    SCALAR_FORMS.update(dict.fromkeys(_ts, _form))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalar_unit(index: int, form: str, args: Sequence[Any], kwargs: dict, x_first: bool, in_shape: tuple,
                out_shape: tuple) -> Optional[LayerUnit]:
    """The :class:`ScaleUnit` of ``x op c`` (``x_first``) or ``c op x``, ``args`` with the graph tensor and the number;
    ``None`` for any other form (keyword arguments, ``alpha``, rounding modes, tensors on both sides)."""
    if kwargs:
        return None
    if form == "neg":
        return ScaleUnit(index, _Scale("neg", -1.0), in_shape, out_shape) if len(args) == 1 else None
    if len(args) != 2 or not _number(args[1 if x_first else 0]):
        return None
    c = args[1 if x_first else 0]
    if form == "div" and (not x_first or c == 0):
        return None  # c / x is not affine; x / 0 is left to autograd
    kind = {"mul": "mul", "div": "div", "add": "add", "sub": "sub" if x_first else "rsub"}[form]
    return ScaleUnit(index, _Scale(kind, c), in_shape, out_shape)


def supported_node_targets() -> list[str]:
    """Readable names of every supported node target (module types, functions, methods)."""
    out = []
    for k in NODE_UNITS:
        if isinstance(k, type):
            out.append(k.__name__)
        elif isinstance(k, tuple):
            out.append(f"Tensor.{k[1]}")
        else:
            out.append(f"{getattr(k, '__module__', '') or ''}.{getattr(k, '__name__', repr(k))}".lstrip("."))
    return out
