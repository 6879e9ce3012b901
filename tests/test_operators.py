"""Structured operators: layers apply J^T matrix-free in the scan; CSR values only where products need them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import spscan
from spscan.planner.program import Apply


def _lenet_small():
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(3, 4, 3, padding="same"),
                         nn.Tanh(), nn.BatchNorm2d(4).eval(), nn.Dropout(0.2), nn.Flatten(), nn.Linear(4 * 4 * 4, 5),
                         nn.GELU(), nn.Linear(5, 3))


def _grads(model, w, x, seed=0):
    torch.manual_seed(seed)
    xr = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    w(xr).pow(2).sum().backward()
    return [xr.grad] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("levels", [0, 1, "full"])
@pytest.mark.parametrize("train", [False, True])
def test_operators_equal_csr_values_and_autograd(levels, train):
    torch.manual_seed(0)
    net = _lenet_small().double()
    net[6].train(train)  # dropout masks: per-sample diagonal operators
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    with_ops = spscan.wrap(net, x, levels=levels)
    without = spscan.wrap(net, x, levels=levels, operators=False)
    assert any(with_ops.plan.operator_flags) and not any(without.plan.operator_flags)
    a, b, c = _grads(net, with_ops, x), _grads(net, without, x), _grads(net, net, x)
    for u, v, r in zip(a, b, c):
        torch.testing.assert_close(u, r, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(v, r, rtol=1e-10, atol=1e-12)


def test_linear_scan_with_operators_forms_no_csr_values():
    torch.manual_seed(0)
    net = _lenet_small().double()
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    w = spscan.wrap(net, x, levels=0)
    bound = w.plan.core.bind([u.shared for u in w.plan.units], None, None, w.plan.operator_flags)
    ops = [op for st in bound.program.steps for op in st.ops]
    applied = {op.layer for op in ops if isinstance(op, Apply)}
    flagged = {i for i, f in enumerate(w.plan.operator_flags) if f}
    assert applied == flagged  # every operator layer is applied, and nothing else is needed for it
    assert all(off < 0 for i, off in enumerate(bound.program.input_offsets) if i in flagged)
    filled = []
    for u in w.plan.units:
        orig = u.fill
        u.fill = lambda *a, _orig=orig, _u=u: filled.append(_u.index) or _orig(*a)
    _grads(net, w, x)
    assert set(filled) <= {i for i, f in enumerate(w.plan.operator_flags) if not f} | \
        {i for i, u in enumerate(w.plan.units) if type(u).__name__ in ("ElementwiseUnit", "BatchNormUnit")}


def test_input_gradient_skipped_when_not_needed():
    torch.manual_seed(0)
    net = _lenet_small().double()
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    w = spscan.wrap(net, x, levels=0)
    want = _grads(net, net, x)[1:]
    net.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout mask as the reference step
    w(x).pow(2).sum().backward()  # x needs no gradient: the scan's last mat-vec is left out
    for p, r in zip(net.parameters(), want):
        torch.testing.assert_close(p.grad, r, rtol=1e-10, atol=1e-12)
    first = w.plan.core.bind([u.shared for u in w.plan.units], None, None, w.plan.operator_flags, False)
    full = w.plan.core.bind([u.shared for u in w.plan.units], None, None, w.plan.operator_flags, True)
    count = lambda b: sum(len(st.ops) for st in b.program.steps)  # noqa: E731
    assert first.program.skipped_first and count(first) == count(full) - 1


@pytest.mark.parametrize("levels", [0, 1, "full"])
def test_overlapping_max_pool_is_an_operator_with_csr_values(levels):
    """Overlapping windows: the pool's operator is ATen's pooling backward (an input's gradients summed
    in the kernel's order), its CSR values serve the planned products; both agree with autograd."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True),
                        nn.Flatten(), nn.Linear(2 * 3 * 3, 3)).double()
    x = torch.randn(2, 1, 7, 7, dtype=torch.float64)
    w = spscan.wrap(net, x, levels=levels)
    assert w.plan.operator_flags == [True] * 5
    for u, r in zip(_grads(net, w, x), _grads(net, net, x)):
        torch.testing.assert_close(u, r, rtol=0, atol=1e-12)


def test_operators_on_the_triton_backend():
    torch.manual_seed(0)
    net = _lenet_small().double()
    x = torch.randn(2, 1, 8, 8, dtype=torch.float64)
    w = spscan.wrap(net, x, levels=1, backend="triton")
    for u, r in zip(_grads(net, w, x), _grads(net, net, x)):
        torch.testing.assert_close(u, r, rtol=1e-10, atol=1e-12)


def test_operator_chain_runs_without_the_vector_arena():
    """A depth-0 scan of operators only calls them on their own tensors; the arena path gives the same."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                        nn.Linear(3 * 4 * 4, 4)).double()
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    w = spscan.wrap(net, x, levels=0)
    bound = w.plan.core.bind([u.shared for u in w.plan.units], None, None, w.plan.operator_flags)
    assert bound._operator_chain == [4, 3, 2, 1, 0]
    fast = _grads(net, w, x)
    for b in w.plan.core.bindings():
        b._operator_chain = None  # force the arena path
    slow = _grads(net, w, x)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    for a, r in zip(fast, _grads(net, net, x)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)
