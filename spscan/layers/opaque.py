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

from spscan.layers.base import LayerUnit, UnitCapabilities

__all__ = ["OpaqueUnit"]


class OpaqueUnit(LayerUnit):
    """A node planned as its own forward and its own autograd backward.

    ``call(x)`` is the node's computation of its one graph tensor (the module's own call for a
    module node, so dropout draws its random numbers as the module does). ``roles`` are the module's
    parameters (qualified names; none for a function node).
    """

    capabilities = UnitCapabilities(structured_operator=True, fused_param_grads=True)

    def __init__(self, index: int, module: nn.Module, in_shape: tuple, out_shape: tuple,
                 call: Callable[[torch.Tensor], torch.Tensor], label: str) -> None:
        super().__init__(index, module, in_shape, out_shape)
        self._params = [(n, p) for n, p in module.named_parameters()]
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

    def parameters_for_roles(self) -> list[tuple[nn.Parameter, Optional[torch.Tensor]]]:
        return [(p, None) for _, p in self._params]

    def run(self, x, tensors):
        with torch.enable_grad():
            xi = x.detach()
            if xi.is_floating_point() or xi.is_complex():
                xi.requires_grad_(True)
            y = self.call(xi.reshape((x.shape[0],) + self.in_shape))
        return y.detach(), (xi, y)

    def fill(self, saved, tensors):
        raise ValueError(f"layer {self.index} ({self.name}): an opaque node has no J^T values; it runs only as its "
                         "own autograd backward (levels=0)")

    def _grad(self, saved, g: torch.Tensor, want_input: bool, needed: Sequence[bool]):
        xi, y = saved
        inputs = ([xi] if want_input and xi.requires_grad else [])
        params = [p for (_, p), n in zip(self._params, needed) if n and p.requires_grad]
        gi = None
        got: list = []
        if (inputs or params) and y.requires_grad:
            got = list(torch.autograd.grad(y, inputs + params, g.reshape(y.shape), retain_graph=True,
                                           allow_unused=True))
        if want_input:
            gi = got.pop(0) if inputs else None
            if gi is None:
                gi = g.new_zeros((g.shape[0], self.d_in))
            gi = gi.reshape(g.shape[0], self.d_in)
        out: list[Optional[torch.Tensor]] = []
        for (_, p), n in zip(self._params, needed):
            if n and p.requires_grad:
                v = got.pop(0)
                out.append(torch.zeros_like(p) if v is None else v)
            else:
                out.append(None)
        return gi, out

    def apply_transposed(self, saved, tensors, g):
        return self._grad(saved, g, True, [False] * len(self.roles))[0]

    def apply_transposed_and_param_grads(self, saved, tensors, g, needed):
        return self._grad(saved, g, True, needed)

    def param_grads(self, saved, tensors, g_out, needed=None):
        needed = [True] * len(self.roles) if needed is None else needed
        return self._grad(saved, g_out, False, needed)[1]
