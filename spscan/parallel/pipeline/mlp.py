"""The MLP chain that every method of a real run trains: the model, its transposed-Jacobian
patterns and values, its cuts into stages, the run's batch and single-process reference gradients.

The model is ``Linear(d_0, d_1), ReLU, Linear(d_1, d_2), ReLU, ..., Linear(d_{L-1}, d_L)``; every
module is one layer of the chain (its transposed Jacobian: ``W`` for a linear layer, shared by the
batch; ``diag(x > 0)`` per sample for a ReLU). A method cuts it into stages of whole modules.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

__all__ = ["build_mlp", "chain_patterns", "chain_values", "stage_bounds", "reference_grads", "SINGLE_STAGE",
           "MULTI_STAGE"]

SINGLE_STAGE = ("GPipe", "1F1B")
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def build_mlp(dims: Sequence[int], seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """``Linear(d_0, d_1), ReLU, ..., Linear(d_{L-1}, d_L)``: ``2L - 1`` modules, one chain layer each."""
    if len(dims) < 2:
        raise ValueError(f"dims: expected at least 2 sizes (input, output), got {list(dims)}")
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i in range(len(dims) - 1):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods).to(dtype)


def chain_patterns(model: nn.Sequential) -> list[sp.csr_array]:
    """Transposed-Jacobian pattern of every module: dense ``(in, out)`` for ``Linear``, diagonal for ``ReLU``."""
    pats = []
    for i, mod in enumerate(model):
        if isinstance(mod, nn.Linear):
            d_in, d_out = mod.in_features, mod.out_features
            pats.append(sp.csr_array(np.ones((d_in, d_out))))
        elif isinstance(mod, nn.ReLU):
            d = pats[-1].shape[1] if pats else None
            if d is None:
                raise ValueError(f"module {i}: a ReLU first has no known width")
            pats.append(sp.csr_array(sp.eye(d, format="csr")))
        else:
            raise TypeError(f"module {i}: expected nn.Linear or nn.ReLU, got {type(mod).__name__}")
    for p in pats:
        p.sort_indices()
    return pats


def chain_values(mod: nn.Module, x_in: torch.Tensor) -> torch.Tensor:
    """Values of the module's ``J^T`` in its pattern's CSR order: ``W^T`` row-major ``(nnz,)`` (shared)
    for ``Linear``, ``(B, d)`` of ``x_in > 0`` for ``ReLU``."""
    if isinstance(mod, nn.Linear):
        return mod.weight.detach().t().contiguous().reshape(-1)
    if isinstance(mod, nn.ReLU):
        return (x_in > 0).to(x_in.dtype)
    raise TypeError(f"expected nn.Linear or nn.ReLU, got {type(mod).__name__}")


def stage_bounds(n_modules: int, stages: int) -> list[int]:
    """Cut ``n_modules`` into ``stages`` contiguous groups of near-equal size: ``[0, ..., n]``."""
    if not 1 <= stages <= n_modules:
        raise ValueError(f"stages: expected 1..{n_modules}, got {stages}")
    return [round(s * n_modules / stages) for s in range(stages + 1)]


def reference_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Single-process autograd gradients of ``cross_entropy(model(x), y)`` (mean), in parameter order."""
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def batch_data(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's batch ``(x, labels)``, ``(B, d_0)`` and ``(B,)``, the same in every process (``data_seed``)."""
    g = torch.Generator().manual_seed(cfg.get("data_seed", 1))
    dims = cfg["dims"]
    x = torch.randn(cfg["batch"], dims[0], generator=g, dtype=cfg.get("dtype", torch.float32))
    y = torch.randint(0, dims[-1], (cfg["batch"],), generator=g)
    return x, y


def weight_grads(mod: nn.Module, x_in: torch.Tensor, g_out: torch.Tensor) -> list[torch.Tensor]:
    """``W`` of one module: ``dl/dW = g^T x``, ``dl/db = sum_rows g`` for ``Linear``; none for ``ReLU``."""
    if isinstance(mod, nn.Linear):
        gw = g_out.t() @ x_in
        return [gw, g_out.sum(0)] if mod.bias is not None else [gw]
    return []


def dims_at(model: nn.Sequential, d0: int) -> list[int]:
    """``d_0 .. d_n``: the width after every module."""
    dims = [d0]
    for mod in model:
        dims.append(mod.out_features if isinstance(mod, nn.Linear) else dims[-1])
    return dims


def stage_owner(name: str, world: int) -> tuple[int, dict[int, int]]:
    """Number of stages and ``stage -> rank`` for a torch schedule class name."""
    if name in ("ZBVZeroBubble", "DualPipeV"):
        return 2 * world, {**{r: r for r in range(world)}, **{2 * world - 1 - r: r for r in range(world)}}
    if name in MULTI_STAGE:
        return 2 * world, {s: s % world for s in range(2 * world)}
    if name in SINGLE_STAGE:
        return world, {r: r for r in range(world)}
    raise ValueError(f"schedule: expected one of {SINGLE_STAGE + MULTI_STAGE} or 'scan', got {name!r}")


def stage_key(bounds: Sequence[int], s: int) -> str:
    """``"0,4,8,11,15/2"``: stage ``s`` of the cut ``bounds``."""
    return ",".join(str(b) for b in bounds) + f"/{s}"


def forward_with_values(mods: Sequence[nn.Module], h: torch.Tensor
                        ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Run ``mods`` on ``h`` without autograd: ``(input of each module, its Jacobian values, output)``."""
    inputs, values = [], []
    with torch.no_grad():
        for m in mods:
            inputs.append(h)
            values.append(chain_values(m, h))
            h = m(h)
    return inputs, values, h
