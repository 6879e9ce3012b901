"""Input validation and small helpers shared by the engine and the front ends."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from operator import attrgetter
from typing import Any, Optional

import torch

from spscan.kernels.backend import StructuredOperator

__all__ = ["ModuleAttributes", "attributes_kept", "buffers_kept", "canonical_device", "check_inputs", "fmt_bytes"]

_FLOATS = (torch.float32, torch.float64)


@contextlib.contextmanager
def buffers_kept(module: torch.nn.Module) -> Iterator[None]:
    """Run a block that may update ``module``'s buffers (the planner runs the model: a train-mode BatchNorm
    updates its running statistics) and put their values back after it, without making a new version of any
    (written through ``.data``): a forward the user recorded before (a training batch, then a validation
    batch planned for its new shape) still runs its backward, whose BatchNorm saved its statistics, as a
    BatchNorm's own update of them leaves it. An embedding's weight with ``max_norm`` is kept likewise."""
    saved = [(t, t.clone()) for t in module.buffers()]
    # and the weights an embedding with ``max_norm`` renormalizes in place in its forward (the rows the
    # example's tokens read): the model's first step should find them as the user left them
    saved += [(m.weight, m.weight.detach().clone()) for m in module.modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None]
    try:
        yield
    finally:
        for t, v in saved:
            t.data.copy_(v)


#: what every module's ``__dict__`` holds of its own (parameters, buffers, submodules, hooks): not attributes
_MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__)


class ModuleAttributes:
    """Every module's own attributes and buffer objects of ``model`` as they are now, and the contents of its
    lists and dicts (:meth:`changed`, :meth:`restore`): what a forward run by the planner may set
    (``self.h = h.detach()``, ``self.kl = ...``, a counter, a buffer assigned anew, ``self.feats.append(x)``,
    ``self.cache["h"] = h``) and a training step would set otherwise."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.saved = []
        for name, m in model.named_modules():
            attrs = {k: v for k, v in m.__dict__.items() if k not in _MODULE_INTERNALS}
            held = {k: (v, list(v) if type(v) is list else dict(v))
                    for k, v in attrs.items() if type(v) in (list, dict)}
            self.saved.append((name, m, attrs, dict(m._buffers), held))

    def changed(self) -> list[tuple[str, Any]]:
        """``(module path.attribute, new value)`` of each attribute or buffer set or made since, and of each
        list or dict whose contents changed."""
        out = []
        for name, m, attrs, bufs, held in self.saved:
            where = name + "." if name else ""
            now = {k: v for k, v in m.__dict__.items() if k not in _MODULE_INTERNALS}
            for d, was in ((now, attrs), (m._buffers, bufs)):
                out += [(where + k, v) for k, v in d.items() if k not in was or was[k] is not v]
            out += [(where + k, v) for k, (v, c) in held.items() if _contents_differ(v, c)]
        return out

    def restore(self) -> None:
        for _, m, attrs, bufs, held in self.saved:
            d = m.__dict__
            for k in [k for k in d if k not in _MODULE_INTERNALS and (k not in attrs or attrs[k] is not d[k])]:
                if k in attrs:
                    d[k] = attrs[k]
                else:
                    del d[k]
            for k, v in attrs.items():
                if k not in d:
                    d[k] = v
            if len(m._buffers) != len(bufs) or any(k not in bufs or bufs[k] is not v for k, v in m._buffers.items()):
                m._buffers.clear()
                m._buffers.update(bufs)
            for v, c in held.values():
                if _contents_differ(v, c):
                    if type(v) is list:
                        v[:] = c
                    else:
                        v.clear()
                        v.update(c)


def _contents_differ(v: Any, c: Any) -> bool:
    if len(v) != len(c):
        return True
    if type(v) is list:
        return any(a is not b for a, b in zip(v, c))
    return any(k not in c or c[k] is not x for k, x in v.items())


@contextlib.contextmanager
def attributes_kept(module: torch.nn.Module) -> Iterator[ModuleAttributes]:
    """Run a block that may run ``module``'s forward (the planner's runs and traces) and put every module's
    attributes and buffer objects back after it (:class:`ModuleAttributes`): planning leaves no trace of its
    example batches, nor a tracer's proxies, in the model."""
    saved = ModuleAttributes(module)
    try:
        yield saved
    finally:
        saved.restore()


def canonical_device(device) -> torch.device:
    """``device`` with its index filled in: ``cuda`` means the current CUDA device, as a tensor's
    ``.device`` would name it (``cuda:0``), so plan and tensor devices compare equal."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def fmt_bytes(b: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024
    return str(b)


def _fail(kind, msg: str):
    raise kind(msg)


@functools.lru_cache(maxsize=64)
def uniform_flags(flag: bool, n: int) -> tuple[bool, ...]:
    """``(flag,) * n``, one object per ``(flag, n)``: a signature of a long chain made once, so its
    binding is found by identity (:meth:`spscan.Plan.bind`) rather than by hashing ``n`` flags."""
    return (bool(flag),) * n


# a list of at least this many value tensors is checked and run as one stacked tensor (a copy): per
# layer, host checks and the run's per-tensor lookups cost more than copying a layer's values
LIST_STACK_MIN = 64

_DTYPE = attrgetter("dtype")


def _list_as_stacked(values: Sequence, nnz: int, batch: int, dtype, device) -> Optional[torch.Tensor]:
    """A long list of value tensors as one ``(n, B, nnz)`` / ``(n, nnz)`` tensor, checked in a few
    vectorised passes: the entries' types and dtypes compared as sets, ``torch.stack`` for their
    shapes and devices (it refuses unequal ones), the result's shape, layout and device against the
    call's. ``None`` where any check fails (the per-layer checks then name the layer) or the list is
    short. The stack runs in the caller's grad mode: a result that requires grad tells the caller
    some entry does."""
    if (type(values) not in (list, tuple) or len(values) < LIST_STACK_MIN
            or set(map(type, values)) != {torch.Tensor} or set(map(_DTYPE, values)) != {dtype}):
        return None
    try:
        out = torch.stack(values)
    except (RuntimeError, TypeError):
        return None
    if out.layout != torch.strided or out.device != device or tuple(out.shape[1:]) not in ((nnz,), (batch, nnz)):
        return None
    return out


def check_inputs(n: int, nnzs: Sequence[int], dims: Sequence[int], plan_dtype, plan_device, values: Any,
                 grad: Optional[torch.Tensor], extra, check_finite: bool, *, needs_grad: bool = True,
                 uniform_nnz: Optional[bool] = None):
    """Validate one call's inputs; returns ``(items, stacked, shared, has_extra, batch, dtype, device, operators)``.

    ``nnzs[i]``: nnz of ``J_{i+1}^T``; ``dims``: ``d_0 .. d_n``. Never copies or mutates the caller's
    tensors. ``needs_grad=False`` (a reduction) takes ``grad=None`` and the batch from the values.
    ``uniform_nnz``: whether every ``nnzs[i]`` is ``nnzs[0]``, where the caller knows it (a plan's, made
    once; ``None``: counted here, O(n)).
    """
    d_n = dims[n]
    if needs_grad or grad is not None:
        if not isinstance(grad, torch.Tensor):
            _fail(TypeError, f"grad: expected a torch.Tensor of shape (B, {d_n}), got {type(grad).__name__}")
        if grad.dtype not in _FLOATS:
            _fail(TypeError, f"grad: expected dtype float32 or float64, got {grad.dtype}")
        if grad.dim() != 2 or grad.shape[1] != d_n:
            _fail(ValueError, f"grad: expected shape (B, {d_n}) for layer {n}'s output, got {tuple(grad.shape)}")
        batch, dtype, device = grad.shape[0], grad.dtype, grad.device
        if batch < 1:
            _fail(ValueError, "grad: batch size must be at least 1, got 0")
    else:
        first = values if isinstance(values, torch.Tensor) else next(iter(values), None) if hasattr(values, "__iter__") else None
        if not isinstance(first, torch.Tensor):
            _fail(TypeError, f"values: expected a sequence of {n} tensors, got {type(values).__name__}")
        dtype, device = first.dtype, first.device
        if dtype not in _FLOATS:
            _fail(TypeError, f"values[0] (layer 1): expected dtype float32 or float64, got {dtype}")
        batch = None  # taken from the first per-sample value or extra
    if plan_dtype is not None and dtype != plan_dtype:
        _fail(TypeError, f"{'grad' if grad is not None else 'values'}: the plan was made for {plan_dtype}, got {dtype}")
    if plan_device is not None and device != plan_device:
        _fail(ValueError, f"{'grad' if grad is not None else 'values'}: the plan was made for device {plan_device}, "
                          f"got {device}")

    stacked = isinstance(values, torch.Tensor)
    if uniform_nnz is None:
        uniform_nnz = n > 0 and list(nnzs).count(nnzs[0]) == n
    uniform_nnz = n > 0 and bool(uniform_nnz)
    if stacked:
        if values.dim() not in (2, 3) or values.shape[0] != n:
            _fail(ValueError, f"values: a stacked tensor must be (n={n}, B, nnz) or (n, nnz), got {tuple(values.shape)}")
        if not uniform_nnz:
            _fail(ValueError, "values: a stacked tensor needs every layer to have the same nnz; pass a list")
        items: Sequence[torch.Tensor] = [values]
    else:
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            _fail(TypeError, f"values: expected a sequence of {n} tensors, got {type(values).__name__}")
        if len(values) != n:
            _fail(ValueError, f"values: expected {n} tensors (one per layer), got {len(values)}")
        items = values
        if uniform_nnz and n >= LIST_STACK_MIN:
            per = batch if batch is not None else next(  # (values all (nnz,) where none is 2-d: any batch fits)
                (int(v.shape[0]) for v in values if isinstance(v, torch.Tensor) and v.dim() == 2), 1)
            as_one = _list_as_stacked(values, nnzs[0], per, dtype, device)
            if as_one is not None:
                stacked, items = True, [as_one]
    if batch is None:
        for v in items:
            if isinstance(v, torch.Tensor) and v.dim() == (3 if stacked else 2):
                batch = int(v.shape[1 if stacked else 0])
                break
        else:
            for e in extra or ():
                if isinstance(e, torch.Tensor) and e.dim() == 2:
                    batch = int(e.shape[0])
                    break
            else:
                batch = 1
    checked: dict[int, bool] = {}  # a tensor repeated along the chain is checked once per shape
    shared: Any = []
    operators: Any = uniform_flags(False, n)
    for i, v in enumerate(items):
        nnz = nnzs[0] if stacked else nnzs[i]
        key = id(v)
        hit = checked.get(key)
        if hit is not None and v.shape[-1] == nnz:  # (operators are never recorded here)
            shared.append(hit)
            continue
        layer = f"layer {i + 1}" if not stacked else "values"
        if isinstance(v, StructuredOperator) and not stacked:
            if tuple(v.shape) != (dims[i], dims[i + 1]):
                _fail(ValueError, f"values[{i}] ({layer}): a structured operator of shape {tuple(v.shape)}, expected "
                                  f"({dims[i]}, {dims[i + 1]})")
            shared.append(bool(v.shared))
            if not isinstance(operators, list):
                operators = list(operators)
            operators[i] = True
            continue
        if not isinstance(v, torch.Tensor):
            _fail(TypeError, f"values[{i}] ({layer}): expected a torch.Tensor, got {type(v).__name__}")
        if v.layout != torch.strided:
            _fail(TypeError, f"values[{i}] ({layer}): expected a dense strided tensor of CSR values, got layout {v.layout}")
        if v.dtype != dtype:
            _fail(TypeError, f"values[{i}] ({layer}): dtype {v.dtype} differs from {'grad' if grad is not None else 'values[0]'}'s {dtype}")
        if v.device != device:
            _fail(ValueError, f"values[{i}] ({layer}): on {v.device}, {'grad' if grad is not None else 'values[0]'} is on {device}")
        shape = tuple(v.shape[1:]) if stacked else tuple(v.shape)
        if shape == (nnz,):
            is_shared = True
        elif shape == (batch, nnz):
            is_shared = False
        else:
            _fail(ValueError, f"values[{i}] ({layer}): expected shape ({batch}, {nnz}) or ({nnz},) "
                              f"for a ({dims[i if not stacked else 0]}, {dims[(i if not stacked else 0) + 1]}) "
                              f"pattern with nnz={nnz}, got {tuple(v.shape)}")
        checked[key] = is_shared
        shared.append(is_shared)
    if stacked:
        shared = uniform_flags(shared[0], n)
    has_extra: Any = uniform_flags(False, n + 1)
    if extra is not None:
        has_extra = list(has_extra)
        if isinstance(extra, torch.Tensor) or not hasattr(extra, "__len__") or len(extra) != n + 1:
            got = len(extra) if hasattr(extra, "__len__") and not isinstance(extra, torch.Tensor) else type(extra).__name__
            _fail(ValueError, f"extra: expected a sequence of n+1={n + 1} entries (None or (B, d_i)), got {got}")
        for i, e in enumerate(extra):
            if e is None:
                continue
            d = dims[i]
            if not isinstance(e, torch.Tensor):
                _fail(TypeError, f"extra[{i}]: expected None or a tensor of shape ({batch}, {d}), got {type(e).__name__}")
            if e.dtype != dtype:
                _fail(TypeError, f"extra[{i}]: dtype {e.dtype} differs from the values' {dtype}")
            if e.device != device:
                _fail(ValueError, f"extra[{i}]: on {e.device}, the values are on {device}")
            if tuple(e.shape) != (batch, d):
                _fail(ValueError, f"extra[{i}]: expected shape ({batch}, {d}) (dl/dx_{i}), got {tuple(e.shape)}")
            if i == n and not needs_grad:
                _fail(ValueError, f"extra[{n}]: a composite covers dl/dx_0 .. dl/dx_{n - 1} only; expected None")
            has_extra[i] = True
    if check_finite:
        tensors = ([("grad", grad)] if grad is not None else []) + [(f"values[{i}]", v) for i, v in enumerate(items)]
        if extra is not None:
            tensors += [(f"extra[{i}]", e) for i, e in enumerate(extra) if e is not None]
        for name, t in tensors:
            if not bool(torch.isfinite(t).all()):
                _fail(ValueError, f"{name}: contains NaN or Inf (check_finite=True)")
    flags = [f if isinstance(f, tuple) else tuple(f) for f in (shared, has_extra, operators)]
    return items, stacked, *flags[:2], batch, dtype, device, flags[2]
