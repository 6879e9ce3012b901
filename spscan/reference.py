"""Ground truth: plain sequential backprop with explicit transposed Jacobians, in float64.

Every backend and every layer generator is tested against this module. It is deliberately
simple (one SciPy SpMV per layer and sample, float64 throughout) and shares no code with the
planner or the kernels, so that a bug there cannot hide here.

>>> import numpy as np, scipy.sparse as sp, torch
>>> p = sp.csr_array(np.array([[1.0, 0.0], [2.0, 3.0]]))
>>> g = reference_backward([p], [torch.tensor([1.0, 2.0, 3.0])], torch.tensor([[1.0, 1.0]]))
>>> g[0].tolist()
[[1.0, 5.0]]
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch

__all__ = ["reference_backward", "transposed_jacobian", "to_scipy_pattern"]


def to_scipy_pattern(pattern) -> sp.csr_array:
    """A SciPy CSR array with the structure of ``pattern`` (SciPy CSR or torch sparse CSR)."""
    if isinstance(pattern, torch.Tensor):
        if pattern.layout != torch.sparse_csr:
            raise TypeError(f"expected a torch sparse CSR tensor, got layout {pattern.layout}")
        crow = pattern.crow_indices().cpu().numpy()
        col = pattern.col_indices().cpu().numpy()
        return sp.csr_array((np.ones(col.shape[0]), col, crow), shape=tuple(pattern.shape))
    return sp.csr_array(pattern)


def transposed_jacobian(pattern, values: torch.Tensor) -> sp.csr_array:
    """``J^T`` for one sample as a float64 SciPy CSR array: ``pattern`` filled with ``values`` (nnz,)."""
    p = to_scipy_pattern(pattern)
    data = values.detach().to("cpu", torch.float64).numpy().reshape(-1)
    return sp.csr_array((data, p.indices.copy(), p.indptr.copy()), shape=p.shape)


def reference_backward(
    patterns: Sequence,
    values: Sequence[torch.Tensor],
    grad: torch.Tensor,
    extra: Optional[Sequence[Optional[torch.Tensor]]] = None,
) -> list[torch.Tensor]:
    """Sequential backprop ``g_{i-1} = J_i^T g_i + extra[i-1]`` in float64.

    Args:
        patterns: ``n`` patterns in layer order, ``patterns[i-1]`` is ``J_i^T`` of shape ``(d_{i-1}, d_i)``.
        values: ``n`` tensors, ``(B, nnz_i)`` per sample or ``(nnz_i,)`` shared by the batch.
        grad: ``(B, d_n)``.
        extra: optional ``n+1`` entries, each ``None`` or ``(B, d_i)``, added to ``dl/dx_i``.

    Returns:
        ``n+1`` float64 CPU tensors, ``[i]`` = ``dl/dx_i`` of shape ``(B, d_i)``.
    """
    n = len(patterns)
    g = grad.detach().to("cpu", torch.float64).numpy().copy()
    batch = g.shape[0]
    if extra is not None and extra[n] is not None:
        g = g + extra[n].detach().to("cpu", torch.float64).numpy()
    out: list[Optional[np.ndarray]] = [None] * (n + 1)
    out[n] = g
    for i in range(n, 0, -1):
        v = values[i - 1]
        nxt = []
        for b in range(batch):
            vb = v if v.dim() == 1 else v[b]
            nxt.append(transposed_jacobian(patterns[i - 1], vb) @ g[b])
        g = np.stack(nxt) if nxt else np.zeros((0, to_scipy_pattern(patterns[i - 1]).shape[0]))
        if extra is not None and extra[i - 1] is not None:
            g = g + extra[i - 1].detach().to("cpu", torch.float64).numpy()
        out[i - 1] = g
    return [torch.from_numpy(np.ascontiguousarray(o)) for o in out]
