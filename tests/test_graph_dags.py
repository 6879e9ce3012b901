"""Traced models beyond series-parallel blocks, and He et al.'s option-A shortcut.

* A CIFAR ResNet-20 whose shortcuts are option A (stride-2 subsampling ``x[:, :, ::2, ::2]`` and
  zero-padded channels ``F.pad``, in a ``LambdaLayer``), in train mode.
* General DAGs (a tensor feeding two later joins, a three-way add, crossing skips, random DAGs
  drawn by hypothesis) planned as the live-set chain.

Every case: float64 gradients of every parameter and the input within 1e-9 of autograd's, float32
within 2x autograd's own error against a float64 reference, five SGD steps landing on the same
parameters (and running statistics)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spscan
from layer_checks import run_errors
from spscan.graph import GraphPlan
from test_graph_models import _grads, _init, _loss, _rel


# ----------------------------------------------------------------------------- option-A ResNet-20


class LambdaLayer(nn.Module):
    """The wrapper the CIFAR ResNet code uses for its option-A shortcut; fx traces through it."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class BlockA(nn.Module):
    """BasicBlock with the option-A shortcut: identity, or subsample by 2 and pad channels with zeros."""

    def __init__(self, cin: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != planes:
            pad = (planes - cin) // 2
            self.shortcut = LambdaLayer(lambda x: F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, pad, pad), "constant", 0))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.shortcut(x)
        return F.relu(out)


class ResNet20A(nn.Module):
    """CIFAR ResNet-20 (widths w, 2w, 4w; w = 16 in the paper) with option-A shortcuts."""

    def __init__(self, width: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        layers, cin = [], width
        for stage, w in enumerate((width, 2 * width, 4 * width)):
            for b in range(3):
                layers.append(BlockA(cin, w, 2 if (stage > 0 and b == 0) else 1))
                cin = w
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        x = self.layers(x)
        x = F.adaptive_avg_pool2d(x, 1)
        x = x.view(x.size(0), -1)
        return self.fc(x)


def _check_float64(model: nn.Module, x: torch.Tensor, **kw) -> spscan.SpscanModule:
    wrapped = spscan.wrap(copy.deepcopy(model), x, **kw)
    ref = copy.deepcopy(model)
    y_ref, g_ref, gx_ref = _grads(ref, x)
    y, g, gx = _grads(wrapped, x)
    assert torch.equal(y, y_ref)
    assert _rel(gx, gx_ref) <= 1e-9
    assert set(g) == set(g_ref)
    for n in g_ref:
        assert _rel(g[n], g_ref[n]) <= 1e-9, n
    return wrapped


def _check_float32(base: nn.Module, shape: tuple[int, ...], seed: int, **kw) -> None:
    x64 = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    _, g64, gx64 = _grads(copy.deepcopy(base).double(), x64)
    x32 = x64.float()
    _, ga, gxa = _grads(copy.deepcopy(base).float(), x32)
    m32 = copy.deepcopy(base).float()
    _, gs, gxs = _grads(spscan.wrap(m32, x32, **kw), x32)

    def check(got, auto, ref, what):
        err_s = float((got.double() - ref).abs().max())
        err_a = float((auto.double() - ref).abs().max())
        floor = 4 * torch.finfo(torch.float32).eps * float(ref.abs().max())
        assert err_s <= 2 * err_a + floor, f"{what}: {err_s} vs autograd's {err_a}"

    check(gxs, gxa, gx64, "input")
    for n in g64:
        check(gs[n], ga[n], g64[n], n)


def _check_sgd(model: nn.Module, shape: tuple[int, ...], seed: int, **kw) -> None:
    ref = model
    mine = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(5)]
    wrapped = spscan.wrap(mine, xs[0], **kw)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt_mine = torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9)
    for x in xs:
        for m, opt in ((ref, opt_ref), (wrapped, opt_mine)):
            opt.zero_grad()
            _loss(m(x)).backward()
            opt.step()
    for (n, p), (_, q) in zip(ref.named_parameters(), mine.named_parameters()):
        assert _rel(q.detach(), p.detach()) <= 1e-9, n
    for (n, a), (_, b) in zip(ref.named_buffers(), mine.named_buffers()):
        assert torch.equal(a, b) if not a.dtype.is_floating_point else _rel(b, a) <= 1e-9, n


def test_resnet20_option_a_train_mode():
    """Train-mode BatchNorm and option-A shortcuts: gradients, float32 error, 5 SGD steps, running stats."""
    model = _init(ResNet20A(width=2), 21).double().train()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    wrapped = _check_float64(model, x)
    plan = wrapped.plan
    assert isinstance(plan, GraphPlan) and plan.levels == 0
    assert sum(u.name in ("getitem", "pad") for u in plan.units) == 4  # two downsampling shortcuts
    _check_float32(_init(ResNet20A(width=2), 23).train(), (4, 3, 8, 8), 24)
    _check_sgd(model, (4, 3, 8, 8), 25)


def test_resnet20_option_a_eval_full_depth():
    """Eval mode: the shortcut's slice and pad have CSR values, so every block depth works."""
    model = _init(ResNet20A(width=2), 26).double()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(27), dtype=torch.float64)
    _check_float64(model, x, levels="full", operators=False)


@pytest.mark.parametrize("op", [
    ("slice", (slice(None), slice(None), slice(None, None, 2), slice(None, None, 2)), (2, 5, 4)),
    ("slice", (slice(None), 1, slice(1, None, 3)), (3, 7)),
    ("slice", (Ellipsis, slice(0, 2)), (2, 3, 3)),
    ("slice", (slice(None), None, slice(None, None, -1 + 3)), (5,)),
    ("pad", (0, 0, 0, 0, 1, 2), (2, 3, 3)),
    ("pad", (1, -1, 2, 0), (3, 4)),
    ("pad", (2, 1), (2, 3, 2)),
])
def test_selection_unit_is_the_jacobian(op):
    """The slice/pad unit's pattern is exactly the nonzeros of autograd's Jacobian (all ones), and
    its operator (scatter / crop) equals the pattern times a vector."""
    from spscan.graph import SelectionUnit, _Selection

    kind, arg, shape = op
    mod = _Selection(kind, arg)
    x = torch.randn((3,) + shape, dtype=torch.float64)
    y = mod(x)
    unit = SelectionUnit(0, mod, shape, tuple(y.shape[1:]))
    jac = torch.autograd.functional.jacobian(lambda v: mod(v.reshape((1,) + shape)).reshape(-1),
                                             x[0].reshape(-1))  # (d_out, d_in)
    dense = torch.from_numpy(unit.pattern.toarray())
    assert torch.equal(dense, jac.T)
    out, saved = unit.run(x, [])
    assert torch.equal(out, y)
    assert torch.equal(unit.fill(saved, []), torch.ones(unit.nnz, dtype=torch.float64))
    g = torch.randn(3, unit.d_out, dtype=torch.float64)
    assert torch.equal(unit.apply_transposed(saved, [], g), g @ dense.T)


def test_selection_refusals_name_the_node():
    class Batch(nn.Module):
        def forward(self, x):
            return x[1:]  # drops samples

    class Reflect(nn.Module):
        def forward(self, x):
            return F.pad(x, (0, 0, 1, 1), mode="reflect")

    run_errors(lambda: spscan.wrap(Batch(), torch.zeros(3, 4)), ValueError, "getitem", "batch dim", "Batch")
    run_errors(lambda: spscan.wrap(Reflect(), torch.zeros(3, 2, 4, 4)), ValueError, "pad", "mode='reflect'",
               "test_graph_dags.py")
