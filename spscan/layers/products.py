"""Products of graph tensors: ``a @ b`` (``matmul``/``bmm`` per sample: attention's scores
``q @ k^T`` and its mixing ``softmax(s) @ v``), ``a * b`` of equal shapes (a gate: GLU, SwiGLU), and
softmax attention ``F.scaled_dot_product_attention(q, k, v)`` (:class:`AttentionUnit`).

``y`` is bilinear in ``(a, b)``, so its transposed Jacobians are the other factor:

* ``y = a @ b``: ``J_a^T g = g @ b^T``, ``J_b^T g = a^T @ g`` (per sample and per leading dim);
* ``y = a * b``: ``J_a^T g = g * b``, ``J_b^T g = g * a``.

A product reads two tensors of the graph, so it is one step of the live-set chain with an
operator per input; its values depend on both inputs (it has no CSR values of its own here), so
the scan runs at depth 0 around it, as it does around an opaque node.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn as nn
import torch.nn.functional as F

from spscan.layers.base import LayerUnit, UnitCapabilities, _prod

__all__ = ["ProductUnit", "AttentionUnit"]

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


class _GraphProduct(LayerUnit):
    """What the units of this module share: they read graph tensors ``in_shapes`` (``run_inputs``), their
    ``J^T`` depends on those tensors' values, so they have no CSR values of their own and run as their
    operator at depth 0 (``vjp`` gives every input's ``J^T g``); read through one tensor only, they are a plain
    unit (``run``, ``apply_transposed``)."""

    capabilities = UnitCapabilities(structured_operator=True)
    operator_only_because = "its J^T depends on the values of the tensors it multiplies"

    def __init__(self, index: int, module: nn.Module, in_shapes: Sequence[tuple[int, ...]],
                 out_shape: tuple[int, ...]) -> None:
        super().__init__(index, module, tuple(in_shapes[0]), out_shape)
        self.in_shapes = [tuple(s) for s in in_shapes]
        self.pattern = sp.csr_array((self.d_in, self.d_out), dtype=np.float64)

    @property
    def has_csr_values(self) -> bool:  # type: ignore[override]
        return False

    def run(self, x, tensors):
        if len(self.in_shapes) != 1:
            raise ValueError(f"layer {self.index} ({self.name}): it reads {len(self.in_shapes)} graph tensors "
                             "(run_inputs)")
        return self.run_inputs([x], tensors)

    @abc.abstractmethod
    def run_inputs(self, xs: Sequence[torch.Tensor], tensors) -> tuple[torch.Tensor, Any]:
        """``(y, saved)`` from the graph tensors ``xs``, ``(B, d_i)`` each."""

    def fill(self, saved, tensors):
        raise ValueError(f"layer {self.index} ({self.name}): {self.operator_only_because}: it has no J^T values of "
                         "its own and runs as its operator (levels=0)")

    @abc.abstractmethod
    def vjp(self, saved, g: torch.Tensor, inputs: Sequence[bool], needed: Sequence[bool]):
        """``([J_i^T g for the inputs asked (else None), (B, d_i) each], [])``."""

    def apply_transposed(self, saved, tensors, g):
        return self.vjp(saved, g, [True] + [False] * (len(self.in_shapes) - 1), [])[0][0]


class ProductUnit(_GraphProduct):
    """The product of two graph tensors, its two ``J^T`` applied matrix-free (see the module docstring).

    ``in_shapes`` are the two per-sample shapes. ``matmul`` takes ``(..., n, k)`` and ``(..., k, m)``
    with equal leading dims (no broadcasting, no 1-D factor); ``mul`` takes two equal shapes. Other
    forms raise ``ValueError`` (the graph front end then plans the node as an opaque node).
    """

    def __init__(self, index: int, kind: str, in_shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...]):
        a, b = (tuple(s) for s in in_shapes)
        if kind == "matmul":
            if len(a) < 2 or len(b) != len(a) or a[:-2] != b[:-2] or a[-1] != b[-2]:
                raise ValueError(f"matmul of per-sample shapes {a} and {b}: (..., n, k) @ (..., k, m) with equal "
                                 "leading dims expected")
        elif a != b:
            raise ValueError(f"product of per-sample shapes {a} and {b}: equal shapes expected (no broadcasting)")
        super().__init__(index, _Product(kind), [a, b], out_shape)
        self.kind = kind

    @property
    def name(self) -> str:
        return "matmul" if self.kind == "matmul" else "product"

    def cost_terms(self, batch: int) -> list[tuple]:
        """A matrix product is priced as a linear layer of its multiply-adds (its forward and two
        backward products are a Linear's); an elementwise product as an elementwise layer."""
        elements = self.d_in + _prod(self.in_shapes[1]) + self.d_out
        if self.kind != "matmul":
            return [("ElementwiseUnit", float(batch) * elements)]
        a, b = self.in_shapes
        macs = _prod(a) * b[-1]
        return [("LinearUnit", float(batch) * (macs + elements))]

    def run_inputs(self, xs: Sequence[torch.Tensor], tensors) -> tuple[torch.Tensor, Any]:
        """``y`` from the two graph tensors (flat or shaped); the factors are what the backward needs."""
        a, b = (x.reshape((x.shape[0],) + s) for x, s in zip(xs, self.in_shapes))
        return self.module(a, b), (a, b)

    def vjp(self, saved, g: torch.Tensor, inputs: Sequence[bool], needed: Sequence[bool]):
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


class _Attention(nn.Module):
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=..., scale=...)`` without dropout.
    ``mask`` is a tensor the batch does not change (boolean: keep where true; floating: added to the scores),
    held by reference: a model's buffer stays the model's."""

    def __init__(self, is_causal: bool, scale: Optional[float], mask: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.is_causal, self.scale, self.mask = bool(is_causal), scale, mask

    def mask_on(self, device: torch.device) -> Optional[torch.Tensor]:
        return None if self.mask is None else self.mask.to(device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask_on(q.device), is_causal=self.is_causal,
                                              scale=self.scale)

    def extra_repr(self) -> str:
        mask = "" if self.mask is None else f", mask {self.mask.dtype} {tuple(self.mask.shape)}"
        return f"is_causal={self.is_causal}, scale={self.scale}{mask}"


# softmax that gives a row masked everywhere zeros (as the attention's own forward and backward do), not NaN
_safe_softmax = getattr(torch.ops.aten, "_safe_softmax", None)


class AttentionUnit(_GraphProduct):
    """Softmax attention ``y = P v``, ``P = softmax(s q k^T)`` (rows masked above the diagonal when
    causal, or by a constant mask), per sample and per leading dim (heads), its three ``J^T`` applied matrix-free:

    ``J_v^T g = P^T g``; with ``dP = g v^T`` and ``dS = P ⊙ (dP − rowsum(dP ⊙ P))`` (softmax's backward),
    ``J_q^T g = s dS k`` and ``J_k^T g = s dS^T q``.

    The forward is torch's own call (the model's output bit for bit) and keeps ``q``, ``k``, ``v``
    only: ``P`` is recomputed in the backward, as flash attention does, so the saved memory is the
    inputs' and not ``L x S`` per head. ``slots[i]`` is the graph input that argument ``i`` (q, k, v) reads
    (``sdpa(x, x, x)`` reads one tensor three times: its three ``J^T g`` add up).
    """

    def __init__(self, index: int, module: _Attention, in_shapes: Sequence[tuple[int, ...]], slots: Sequence[int],
                 out_shape: tuple[int, ...]):
        shapes = [tuple(in_shapes[i]) for i in slots]
        q, k, v = shapes
        if len(slots) != 3 or len(q) < 2 or not (len(q) == len(k) == len(v)) or q[:-2] != k[:-2] \
                or k[:-2] != v[:-2] or q[-1] != k[-1] or k[-2] != v[-2]:
            raise ValueError(f"attention of per-sample shapes q {q}, k {k}, v {v}: (..., L, E), (..., S, E), (..., S, Ev) "
                             "with equal leading dims expected")
        super().__init__(index, module, in_shapes, out_shape)
        self.slots = tuple(slots)

    @property
    def name(self) -> str:
        return "attention"

    def cost_terms(self, batch: int) -> list[tuple]:
        """Its products priced as a linear layer of their multiply-adds (``q k^T`` and ``P v``; the
        backward's four, with ``q k^T`` again to recompute ``P``) and its softmax as a normalization of
        the ``L x S`` scores."""
        q, k, v = (self.in_shapes[i] for i in self.slots)
        lead = _prod(q[:-2])
        scores = lead * q[-2] * k[-2]
        macs = scores * (q[-1] + v[-1])
        elements = sum(_prod(s) for s in self.in_shapes) + self.d_out
        return [("LinearUnit", float(batch) * (macs + elements)), ("LayerNormUnit", float(batch) * 3 * scores)]

    def run_inputs(self, xs: Sequence[torch.Tensor], tensors) -> tuple[torch.Tensor, Any]:
        ts = [x.reshape((x.shape[0],) + s) for x, s in zip(xs, self.in_shapes)]
        q, k, v = (ts[i] for i in self.slots)
        return self.module(q, k, v), (q, k, v)

    def _probabilities(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, float]:
        scale = self.module.scale if self.module.scale is not None else 1.0 / math.sqrt(q.shape[-1])
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        if self.module.is_causal:
            L, S = s.shape[-2:]
            keep = torch.ones(L, S, dtype=torch.bool, device=s.device).tril()
            s = s.masked_fill(~keep, float("-inf"))
        mask = self.module.mask_on(s.device)
        if mask is None:
            return torch.softmax(s, dim=-1), scale
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
        return (_safe_softmax(s, -1) if _safe_softmax is not None else torch.softmax(s, dim=-1)), scale

    def vjp(self, saved, g: torch.Tensor, inputs: Sequence[bool], needed: Sequence[bool]):
        """``([J^T g for each graph input asked (else None), (B, d_i) each], [])``."""
        q, k, v = saved
        bsz = g.shape[0]
        gy = g.reshape((bsz,) + self.out_shape)
        p, scale = self._probabilities(q, k)
        want = [inputs[i] for i in self.slots]  # per argument: q, k, v
        dv = torch.matmul(p.transpose(-1, -2), gy) if want[2] else None
        dq = dk = None
        if want[0] or want[1]:
            ds = torch.ops.aten._softmax_backward_data(torch.matmul(gy, v.transpose(-1, -2)), p, -1, p.dtype) * scale
            dq = torch.matmul(ds, k) if want[0] else None
            dk = torch.matmul(ds.transpose(-1, -2), q) if want[1] else None
        out: list[Optional[torch.Tensor]] = [None] * len(self.in_shapes)
        for i, d in zip(self.slots, (dq, dk, dv)):
            if d is not None and inputs[i]:
                d = d.reshape(bsz, -1)
                out[i] = d if out[i] is None else out[i] + d
        return out, []
