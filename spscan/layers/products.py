"""Products of two graph tensors: ``a @ b`` (``matmul``/``bmm`` per sample: attention's scores
``q @ k^T`` and its mixing ``softmax(s) @ v``) and ``a * b`` of equal shapes (a gate: GLU, SwiGLU).

``y`` is bilinear in ``(a, b)``, so its transposed Jacobians are the other factor:

* ``y = a @ b``: ``J_a^T g = g @ b^T``, ``J_b^T g = a^T @ g`` (per sample and per leading dim);
* ``y = a * b``: ``J_a^T g = g * b``, ``J_b^T g = g * a``.

A product reads two tensors of the graph, so it is one step of the live-set chain with an
operator per input; its values depend on both inputs (it has no CSR values of its own here), so
the scan runs at depth 0 around it, as it does around an opaque node.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn

from spscan.layers.base import LayerUnit, UnitCapabilities

__all__ = ["ProductUnit"]

KINDS = ("matmul", "mul")


class _Product(nn.Module):
    """``a @ b`` or ``a * b`` of two graph tensors (both with the batch dim first)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown product kind {kind!r}")
        self.kind = kind

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b) if self.kind == "matmul" else a * b

    def extra_repr(self) -> str:
        return self.kind


class ProductUnit(LayerUnit):
    """The product of two graph tensors, its two ``J^T`` applied matrix-free (see the module docstring).

    ``in_shapes`` are the two per-sample shapes. ``matmul`` takes ``(..., n, k)`` and ``(..., k, m)``
    with equal leading dims (no broadcasting, no 1-D factor); ``mul`` takes two equal shapes. Other
    forms raise ``ValueError`` (the graph front end then plans the node as an opaque node).
    """

    capabilities = UnitCapabilities(structured_operator=True)

    def __init__(self, index: int, kind: str, in_shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...]):
        a, b = (tuple(s) for s in in_shapes)
        if kind == "matmul":
            if len(a) < 2 or len(b) != len(a) or a[:-2] != b[:-2] or a[-1] != b[-2]:
                raise ValueError(f"matmul of per-sample shapes {a} and {b}: (..., n, k) @ (..., k, m) with equal "
                                 "leading dims expected")
        elif a != b:
            raise ValueError(f"product of per-sample shapes {a} and {b}: equal shapes expected (no broadcasting)")
        super().__init__(index, _Product(kind), a, out_shape)
        self.kind = kind
        self.in_shapes = [a, b]
        self.pattern = sp.csr_array((self.d_in, self.d_out), dtype=np.float64)

    @property
    def name(self) -> str:
        return "matmul" if self.kind == "matmul" else "product"

    @property
    def has_csr_values(self) -> bool:  # type: ignore[override]
        return False

    def run(self, x, tensors):
        raise ValueError(f"layer {self.index} ({self.name}): a product reads two graph tensors (run_inputs)")

    def run_inputs(self, xs: Sequence[torch.Tensor], tensors) -> tuple[torch.Tensor, Any]:
        """``y`` from the two graph tensors (flat or shaped); the factors are what the backward needs."""
        a, b = (x.reshape((x.shape[0],) + s) for x, s in zip(xs, self.in_shapes))
        return self.module(a, b), (a, b)

    def fill(self, saved, tensors):
        raise ValueError(f"layer {self.index} ({self.name}): a product of two graph tensors has no J^T values of "
                         "its own; it runs as its operator (levels=0)")

    def vjp(self, saved, g: torch.Tensor, inputs: Sequence[bool], needed: Sequence[bool]):
        """``([J_a^T g, J_b^T g] for the inputs asked (else None), (B, d_i) each], [])``."""
        a, b = saved
        bsz = g.shape[0]
        gy = g.reshape((bsz,) + self.out_shape)
        if self.kind == "matmul":
            ga = torch.matmul(gy, b.transpose(-1, -2)) if inputs[0] else None
            gb = torch.matmul(a.transpose(-1, -2), gy) if inputs[1] else None
        else:
            ga = gy * b if inputs[0] else None
            gb = gy * a if inputs[1] else None
        return [None if t is None else t.reshape(bsz, -1) for t in (ga, gb)], []

    def apply_transposed(self, saved, tensors, g):
        return self.vjp(saved, g, [True, False], [])[0][0]
