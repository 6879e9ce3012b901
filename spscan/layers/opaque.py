"""Opaque units: a traced node without an analytic unit (a function, a tensor method or a module
type the registry does not know, such as ``nn.MultiheadAttention`` or ``nn.TransformerEncoderLayer``
used as a submodule) runs its own call with autograd recording on its detached input, and its
``J^T g`` and its parameter gradients come from its own autograd backward
(``torch.autograd.grad``). It has no CSR values (``has_csr_values`` is ``False``): the scan runs at
depth 0 around it, as it does around train-mode BatchNorm.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from spscan.layers.base import LayerUnit, UnitCapabilities

__all__ = ["OpaqueUnit", "counted_call"]

# the step-profile families whose fitted costs price an opaque node's operations (StepProfile.layers_time)
_PRODUCT_FAMILY, _CONV_FAMILY, _ELEMENT_FAMILY = "LinearUnit", "ConvUnit", "ElementwiseUnit"


def _numel(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel()
    if isinstance(out, (tuple, list)):
        return sum(_numel(o) for o in out)
    return 0


def _attention_macs(func: Any, args: Sequence[Any]) -> float:
    """Multiply-adds of a fused attention call torch's counter has no formula for (CPU's flash attention):
    ``q k^T`` and ``P v`` for ``q (..., L, E)``, ``k (..., S, E)``, ``v (..., S, Ev)``; 0 for other operations."""
    if "scaled_dot_product" not in func.name() or len(args) < 3:
        return 0.0
    q, k, v = args[:3]
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return 0.0
    return float(q.shape[:-2].numel()) * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])


def counted_call(call: Callable[..., Any], xs: Sequence[torch.Tensor]) -> tuple[Any, Optional[tuple]]:
    """``call(*xs)``, and what its operations cost per sample as ``(family, work)`` terms: a product (a
    matrix product, attention: an operation with multiply-adds) is a ``LinearUnit`` of its multiply-adds,
    a convolution a ``ConvUnit``, any other operation that is not a view an ``ElementwiseUnit`` of three
    times the elements it writes (what a unit of that family counts for a layer that reads and writes
    them). Per sample: divided by ``xs[0]``'s batch. ``None`` for the terms where torch cannot count
    (no ``FlopCounterMode``): the node is then priced as a default layer."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:  # pragma: no cover - torch older than the supported range
        return call(*xs), None
    batch = max(int(xs[0].shape[0]), 1) if xs and xs[0].dim() else 1
    terms: list[tuple[str, float]] = []

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = flops.get_total_flops()
            out = func(*args, **(kwargs or {}))
            macs = (flops.get_total_flops() - before) / 2 or _attention_macs(func, args)
            if macs > 0:
                family = _CONV_FAMILY if "convolution" in func.name() else _PRODUCT_FAMILY
                terms.append((family, macs + _numel(out)))
            elif not func.is_view:
                terms.append((_ELEMENT_FAMILY, 3.0 * _numel(out)))
            return out

    try:
        with FlopCounterMode(display=False) as flops, _Count():
            y = call(*xs)
    except Exception:
        # torch's counter does not follow every call (its module tracker asks for the gradient function of a
        # module's input that needs one but was made under no_grad): uncounted, priced as a default layer; a
        # call that fails on its own fails again here, with its own error
        return call(*xs), None
    return y, tuple((f, w / batch) for f, w in terms)


def _capturing(xs: Sequence[torch.Tensor]) -> bool:
    """Whether this call is being recorded in a CUDA graph."""
    return bool(xs) and xs[0].is_cuda and torch.cuda.is_current_stream_capturing()


def _substituted(a: Any, swap: dict) -> Any:
    if isinstance(a, torch.Tensor):
        return swap.get(id(a), a)
    if type(a) in (list, tuple):
        return type(a)(_substituted(v, swap) for v in a)
    return a


class _Aliased(TorchFunctionMode):
    """Every torch function called inside gets the tensors ``swap`` names (by ``id``) replaced by theirs:
    a module's parameters by aliases, as its code reads them (``F.linear(x, self.weight)``, ``w.t()``)."""

    def __init__(self, swap: dict) -> None:
        super().__init__()
        self.swap = swap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args = _substituted(tuple(args), self.swap)
        kwargs = {k: _substituted(v, self.swap) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


class OpaqueUnit(LayerUnit):
    """A node planned as its own forward and its own autograd backward.

    ``call(x)`` is the node's computation of its one graph tensor (the module's own call for a
    module node, so dropout draws its random numbers as the module does). ``roles`` are the module's
    parameters (qualified names; none for a function node). ``label`` names the call and ``reason`` says why it
    has no analytic unit (a wrapper's ``explain()`` lists both, and a forced scan warns once).
    """

    capabilities = UnitCapabilities(structured_operator=True, fused_param_grads=True)
    operator_only_because = "it is an opaque node, run as its own autograd backward"
    integer_input = True  # its own call takes what it takes (an nn.Embedding its token ids)

    def __init__(self, index: int, module: nn.Module, in_shapes: Sequence[tuple], out_shape: tuple,
                 call: Callable[..., torch.Tensor], label: str,
                 params: Optional[Sequence[tuple[str, nn.Parameter]]] = None,
                 own_cost: Optional[Sequence[tuple[str, float]]] = None,
                 reason: str = "no analytic unit for this call", constant_inputs: Sequence[bool] = ()) -> None:
        super().__init__(index, module, in_shapes[0], out_shape)
        # per input: a constant of the step (a tensor autograd records no gradient for in the model, such as
        # ``x.new_empty(shape)``), given to the call without one, as the model's call gets it
        self.constant_inputs = tuple(constant_inputs) + (False,) * (len(in_shapes) - len(constant_inputs))
        self.reason = reason  # why the node runs autograd's own backward (the wrapper's explain() says it)
        self.own_cost = None if own_cost is None else tuple(own_cost)  # (family, work per sample): counted_call
        self.in_shapes = [tuple(s) for s in in_shapes]
        self._params = list(module.named_parameters() if params is None else params)
        self.roles = tuple(n for n, _ in self._params)
        self.call, self.label = call, label
        self.pattern = sp.csr_array((self.d_in, self.d_out), dtype=np.float64)

    @property
    def name(self) -> str:
        return f"opaque: {self.label}"

    @property
    def has_csr_values(self) -> bool:  # type: ignore[override]
        return False

    def tensors(self) -> list[torch.Tensor]:
        return [p for _, p in self._params]

    def cost_terms(self, batch: int) -> list[tuple]:
        """Its own operations (:func:`counted_call`), the same in both regimes (native constants), and one
        layer of this family (the default layer's, as no profile fits one) for the call's wrapping: the
        scan runs the node's call on a detached input and asks autograd for its vector-Jacobian product."""
        wrapping = super().cost_terms(batch)  # no J^T entries: a layer of its input and output elements
        if self.own_cost is None:  # torch could not count its operations: that layer alone
            return wrapping
        return [(f, batch * w, "native") for f, w in self.own_cost] + wrapping

    def parameters_for_roles(self) -> list[tuple[nn.Parameter, Optional[torch.Tensor]]]:
        return [(p, None) for _, p in self._params]

    def run(self, x, tensors):
        return self.run_inputs([x], tensors)

    def run_inputs(self, xs: Sequence[torch.Tensor], tensors) -> tuple[torch.Tensor, Any]:
        """The node's own call on its graph tensors ``xs`` (detached, recorded); what its backward needs.

        Recorded in a CUDA graph, the call reads its parameters through aliases (new leaves on the same
        memory, :class:`_Aliased`), and its backward asks for their gradients: a parameter's own leaf
        node was made on the default stream by the training step's autograd graph (the previous step's,
        kept alive by the caller's ``loss``), and a gradient handed to it from the capture stream makes
        the recording join the default stream, which fails the capture."""
        with torch.enable_grad():
            xis = []
            for x, shape, constant in zip(xs, self.in_shapes, self.constant_inputs):
                xi = x.detach().reshape((x.shape[0],) + shape)
                if not constant and (xi.is_floating_point() or xi.is_complex()):
                    xi.requires_grad_(True)
                xis.append(xi)
            aliases = None
            if self._params and _capturing(xs):
                aliases = [p.detach().requires_grad_(p.requires_grad) for _, p in self._params]
                with _Aliased({id(p): a for (_, p), a in zip(self._params, aliases)}):
                    y = self.call(*xis)
            else:
                y = self.call(*xis)
        return y.detach(), (xis, y, aliases)

    def fill(self, saved, tensors):
        raise ValueError(f"layer {self.index} ({self.name}): an opaque node has no J^T values; it runs only as its "
                         "own autograd backward (levels=0)")

    def vjp(self, saved, g: torch.Tensor, inputs: Sequence[bool], needed: Sequence[bool]):
        """``([J_i^T g for the inputs asked, (B, d_i) each], parameter gradients per role)`` from one
        autograd backward of the node's recorded call (kept for later calls)."""
        xis, y, aliases = saved
        own = [p for _, p in self._params] if aliases is None else aliases
        want = [x for x, w in zip(xis, inputs) if w and x.requires_grad]
        params = [p for p, n in zip(own, needed) if n and p.requires_grad]
        # a call whose result does not depend on what it is asked about (``x.detach()``, ``x > 0``): None each,
        # zeros below, as autograd gives a graph tensor's gradient through a constant
        got: list = [None] * (len(want) + len(params))
        if (want or params) and y.requires_grad:
            got = list(torch.autograd.grad(y, want + params, g.reshape(y.shape), retain_graph=True, allow_unused=True))
        gis: list[Optional[torch.Tensor]] = []
        for x, w in zip(xis, inputs):
            if not w:
                gis.append(None)
                continue
            gi = got.pop(0) if x.requires_grad else None
            gis.append((g.new_zeros(x.shape) if gi is None else gi).reshape(g.shape[0], -1))
        out: list[Optional[torch.Tensor]] = []
        for p, n in zip(own, needed):
            if n and p.requires_grad:
                # None where autograd has none (a parameter the call reads only through ``.detach()``): autograd
                # leaves its gradient None, and an optimizer then skips it
                out.append(got.pop(0))
            else:
                out.append(None)
        return gis, out

    def apply_transposed(self, saved, tensors, g):
        return self.vjp(saved, g, [True], [False] * len(self.roles))[0][0]

    def apply_transposed_and_param_grads(self, saved, tensors, g, needed):
        gis, out = self.vjp(saved, g, [True], needed)
        return gis[0], out

    def param_grads(self, saved, tensors, g_out, needed=None):
        needed = [True] * len(self.roles) if needed is None else needed
        return self.vjp(saved, g_out, [False] * len(self.in_shapes), needed)[1]
