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
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spscan
from layer_checks import run_errors
from spscan.graph.plan import GraphPlan
from test_graph_models import _grads, _init, _loss, _rel

_EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")  # the reference ResNet-20: examples/resnet.py
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
from resnet import BasicBlock, ResNet20  # noqa: E402


# ----------------------------------------------------------------------------- option-A ResNet-20


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
    model = _init(ResNet20(width=2, classes=5, shortcut="A"), 21).double().train()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(22), dtype=torch.float64)
    wrapped = _check_float64(model, x)
    plan = wrapped.plan
    assert isinstance(plan, GraphPlan) and plan.levels == 0
    assert sum(u.name in ("getitem", "pad") for u in plan.units) == 4  # two downsampling shortcuts
    _check_float32(_init(ResNet20(width=2, classes=5, shortcut="A"), 23).train(), (4, 3, 8, 8), 24)
    _check_sgd(model, (4, 3, 8, 8), 25)


def test_resnet20_option_a_eval_full_depth():
    """Eval mode: the shortcut's slice and pad have CSR values, so every block depth works."""
    model = _init(ResNet20(width=2, classes=5, shortcut="A"), 26).double()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(27), dtype=torch.float64)
    _check_float64(model, x, levels="full", operators=False)
    # the same series-parallel graph as a live-set chain (dag="live"): one step per node
    for kw in ({"levels": 0}, {"levels": 2, "operators": False}):
        plan = _check_float64(model, x, dag="live", **kw).plan
        assert len(plan) == sum(1 for _ in plan.segments) > len(plan.units)
    run_errors(lambda: spscan.plan(model, x, dag="sp"), ValueError, "dag", "'auto' or 'live'", "'sp'")


@pytest.mark.parametrize("op", [
    ("slice", (slice(None), slice(None), slice(None, None, 2), slice(None, None, 2)), (2, 5, 4)),
    ("slice", (slice(None), 1, slice(1, None, 3)), (3, 7)),
    ("slice", (Ellipsis, slice(0, 2)), (2, 3, 3)),
    ("slice", (slice(None), None, slice(None, None, -1 + 3)), (5,)),
    ("pad", (0, 0, 0, 0, 1, 2), (2, 3, 3)),
    ("pad", (1, -1, 2, 0), (3, 4)),
    ("pad", (2, 1), (2, 3, 2)),
    ("permute", (0, 2, 1), (5, 3)),
    ("permute", (0, 3, 1, 2), (2, 3, 4)),
    ("permute", (0, 1), (7,)),
])
def test_selection_unit_is_the_jacobian(op):
    """The slice/pad/permute unit's pattern is exactly the nonzeros of autograd's Jacobian (all ones), and
    its operator (scatter / crop) equals the pattern times a vector."""
    from spscan.layers.shape import SelectionUnit, _Selection

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

    run_errors(lambda: spscan.wrap(Batch(), torch.zeros(3, 4)), spscan.NotPlannable, "nothing to scan", "Batch")
    with pytest.warns(UserWarning, match="nothing to scan"):  # a model the scan cannot plan: auto runs it natively
        assert spscan.wrap(Batch(), torch.zeros(3, 4), backward="auto").decision.chosen.name == "native"
    with pytest.raises(ValueError, match="batch dim must be kept whole and first"):
        from spscan.layers.shape import SelectionUnit, _Selection
        SelectionUnit(0, _Selection("permute", (1, 0, 2)), (2, 2), (2, 2))
    # reflection padding has no selection unit: it runs as its own backward (opaque)
    assert "opaque: torch.nn.functional.pad(x" in spscan.wrap(Reflect(), torch.zeros(3, 2, 4, 4)).plan.summary()


class Permutes(nn.Module):
    """Token mixing (an MLP-Mixer block) and every form of a per-sample permutation of dims."""

    def __init__(self) -> None:
        super().__init__()
        self.n1 = nn.LayerNorm(6)
        self.tok = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 5))
        self.ch = nn.Linear(6, 6)
        self.conv = nn.Conv1d(5, 4, 3, padding=1)

    def forward(self, x):  # (B, 5, 6)
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(-1, -2)
        x = self.ch(torch.transpose(x, 2, 1).swapaxes(1, 2))
        x = x.permute(0, 2, 1).permute([0, 2, 1])
        x = torch.permute(x.unsqueeze(1), (0, 1, 3, 2)).movedim(1, 3).squeeze(3)  # (B, 6, 5)
        return self.conv(x.movedim(2, 1)).swapdims(1, 2).flatten(1)


@pytest.mark.parametrize("kw", [{}, {"levels": "full", "operators": False}, {"levels": 1}])
def test_permutations_are_analytic_selections(kw):
    """Permutations of per-sample dims (``transpose``, ``swapaxes``, ``swapdims``, ``permute``, ``movedim``,
    method and function forms, negative dims) are selection units with a 0/1 J^T, at any depth."""
    torch.manual_seed(5)
    model = Permutes().double()
    for b in (3, 1):
        x = torch.randn(b, 5, 6, dtype=torch.float64)
        plan = _check_float64(model, x, **kw).plan
        text = plan.summary()
        assert "opaque" not in text and "permute" in text


def test_transpose_of_the_batch_dim_is_its_own_backward():
    """A transpose that moves the batch dim is no per-sample map: it is recomputed inside the node that reads
    it (an opaque node), and gradients still equal autograd's."""
    class SeqFirst(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):  # (B, T, 4) -> (T, B, 4) -> back
            return self.fc(x.transpose(0, 1).relu().transpose(0, 1))

    torch.manual_seed(6)
    wrapped = _check_float64(SeqFirst().double(), torch.randn(3, 2, 4, dtype=torch.float64))
    assert "opaque" in wrapped.plan.summary()


class MovedAndBack(nn.Module):
    """Entries moved through a tensor whose batch dim is not first (heads split the way attention code does),
    then selected; one chain also scales its values on the way (not a selection)."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g = nn.Linear(6, 12), nn.Linear(4, 3)

    def forward(self, x):  # (B, 5, 6)
        b, t, _ = x.shape
        h = self.f(x).reshape(b, t, 3, 2, 2).permute(2, 0, 3, 1, 4)  # (3, B, 2, T, 2): batch moved
        q, k, v = h.unbind(0)
        a = torch.cat([q, k[:, :, 1:]], 2)  # (B, 2, 2T - 1, 2)
        c = v.transpose(0, 1)[1]  # (B, T, 2): moved twice more
        scaled = (x.transpose(0, 1) * 2.0).transpose(0, 1)  # arithmetic on a moved tensor: opaque
        return self.g(a.flatten(1)[:, :4]) + self.g(scaled[:, 0, :4]) + self.g(c.flatten(1)[:, 2:6])


def test_chains_of_moves_are_selections():
    """A node computed from one graph tensor through reshapes, permutations (the batch dim moved and back) and
    indexing is a selection unit (a gather found by probing the chain with indices); a chain that also computes
    values stays opaque; gradients equal autograd's either way."""
    torch.manual_seed(14)
    model = MovedAndBack().double()
    for b in (3, 1):
        w = _check_float64(model, torch.randn(b, 5, 6, dtype=torch.float64))
    text = w.plan.summary()
    assert text.count("(selection)") >= 3 and "opaque: mul.transpose(0, 1)" in text


def test_tensor_attributes_mT_and_T():
    """``x.mT`` is a tensor of the graph, a selection, not a shape query; so are ``flip`` and ``roll``. ``x.T``
    applied twice (the batch dim moved and back) keeps every entry in its place: a reshape, no gather."""
    class Attrs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f, self.g = nn.Linear(4, 4), nn.Linear(3, 2)

        def forward(self, x):
            return torch.roll(self.g(self.f(x).mT).T.T.flip(1), 1, dims=2)

    torch.manual_seed(19)
    with pytest.warns(UserWarning, match="x.T"):
        w = _check_float64(Attrs().double(), torch.randn(2, 3, 4, dtype=torch.float64))
    summary = w.plan.summary()
    assert summary.count("selection") == 3 and "opaque" not in summary
    assert sum(type(u).__name__ == "PerSampleReshapeUnit" for u in w.plan.units) == 1


# ----------------------------------------------------------------------------- general DAGs


class TwoJoins(nn.Module):
    """``t`` feeds two later joins, ``x`` three branches: not series-parallel."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.f, self.g, self.h = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(2 * d, 3)

    def forward(self, x):
        t = torch.tanh(self.f(x))
        a = self.g(x) + t
        b = F.gelu(self.h(x)) + t
        return self.out(torch.cat([a, b], 1))


class ThreeWayAdd(nn.Module):
    """``f(x) + g(x) + x`` and a join reading one tensor twice (``u + u``)."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.f, self.g, self.h = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)

    def forward(self, x):
        u = torch.sigmoid(self.f(x)) + self.g(x) + x
        return self.h(u + u)


class Crossing(nn.Module):
    """Crossing skips: ``y = f(x); z = g(y) + x; w = h(z) + y``."""

    def __init__(self, d: int = 4) -> None:
        super().__init__()
        self.f, self.g, self.h = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        y = torch.tanh(self.f(x))
        z = self.g(y) + x
        return self.h(z) + y


class ConvCrossing(nn.Module):
    """Crossing skips over convolutions with BatchNorm, a concatenation of three tensors, one of which
    (``y``) is also read by a later add."""

    def __init__(self, c: int = 2) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.conv3, self.bn3 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.mix = nn.Conv2d(3 * c, c, 1)
        self.fc = nn.Linear(c * 4 * 4, 3)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        z = self.conv2(y) + x
        w = self.bn3(self.conv3(z)) + y
        m = self.mix(torch.cat([w, y, z], 1)) + y
        return self.fc(torch.flatten(F.relu(m), 1))


DAGS = {
    "two_joins": (TwoJoins, (3, 4)),
    "three_way_add": (ThreeWayAdd, (3, 4)),
    "crossing": (Crossing, (3, 4)),
    "conv_crossing": (ConvCrossing, (3, 2, 4, 4)),
}


@pytest.mark.parametrize("name", list(DAGS))
def test_dag_gradients_float64(name):
    make, shape = DAGS[name]
    model = _init(make(), 31).double()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(32), dtype=torch.float64)
    for kw in ({}, {"levels": "full", "operators": False}, {"levels": 1}):
        plan = _check_float64(model, x, **kw).plan
        assert isinstance(plan, GraphPlan)
    if name != "three_way_add":  # nested binary adds of one fork are series-parallel blocks
        assert any(type(s).__name__ == "LiveStep" for s in plan.segments), plan.summary()


@pytest.mark.parametrize("name", list(DAGS))
def test_dag_float32_and_sgd(name):
    make, shape = DAGS[name]
    _check_float32(_init(make(), 33), shape, 34)
    _check_sgd(_init(make(), 35).double(), shape, 36)


def test_dag_train_mode_batchnorm():
    """Train-mode BatchNorm in a non-series-parallel graph: matrix-free live-set steps at depth 0."""
    model = _init(ConvCrossing(), 37).double().train()
    x = torch.randn(4, 2, 4, 4, generator=torch.Generator().manual_seed(38), dtype=torch.float64)
    assert _check_float64(model, x).plan.levels == 0
    _check_sgd(model, (4, 2, 4, 4), 39)
    run_errors(lambda: spscan.wrap(model, x, levels="full"), ValueError, "bn1", "block depth 0")


def test_dag_explicit_api_and_pattern():
    """spscan.forward/backward/param_grads over a live-set chain, and its J^T against autograd's
    dense Jacobian of each step (identity blocks, the node's block, dropped tensors)."""
    model = _init(Crossing(), 40).double()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(41), dtype=torch.float64)
    plan = spscan.plan(model, x, levels=0)
    y, jac = spscan.forward(plan, x)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(42), dtype=torch.float64)
    gs = spscan.backward(plan, jac, grad)
    pg = spscan.param_grads(plan, jac, gs)
    xi = x.clone().requires_grad_(True)
    model.zero_grad()
    (model(xi) * grad).sum().backward()
    assert _rel(gs[0], xi.grad) <= 1e-9
    for n, p in model.named_parameters():
        assert _rel(pg[n], p.grad) <= 1e-9, n
    # the step over live [x, tanh] producing g: rows (x, tanh), columns (x, tanh, g)
    step = plan.segments[2]
    dense = torch.zeros(step.d_in, step.d_out, dtype=torch.float64)
    pat = step.pattern
    rows = torch.repeat_interleave(torch.arange(pat.shape[0]), torch.tensor(pat.indptr).diff())
    dense[rows, torch.tensor(pat.indices)] = jac[2]
    w = model.g.weight.detach()
    expect = torch.zeros(8, 12, dtype=torch.float64)
    expect[:4, :4] = torch.eye(4)
    expect[4:, 4:8] = torch.eye(4)
    expect[4:, 8:] = w.T
    assert torch.equal(dense, expect)
    # the operator applies the same matrix
    g = torch.randn(2, 12, dtype=torch.float64)
    op = plan._values(jac.saved, jac.tensors)[2]
    assert torch.allclose(op.apply(g), g @ expect.T, rtol=0, atol=1e-14)


def test_live_state_limit_refusal():
    """A graph whose live set keeps growing (every tensor read again by the last node) is refused
    with the numbers, naming the node; a product of two graph tensors plans (a product step)."""
    from spscan.graph.plan import LIVE_STATE_LIMIT

    n = 2 * LIVE_STATE_LIMIT + 4

    class Fan(nn.Module):
        def forward(self, x):
            hs = [x]
            for _ in range(n):
                hs.append(torch.tanh(hs[-1]))
            out = hs[-1]
            for h in hs[:-1]:  # oldest first: every hs[i] stays live to the end (not series-parallel)
                out = out + h
            return out

    run_errors(lambda: spscan.wrap(Fan(), torch.zeros(2, 3)), spscan.NotPlannable, "Fan", "live-set chain",
               f"more than {LIVE_STATE_LIMIT}x", "values per sample", "test_graph_dags.py")
    with pytest.warns(UserWarning, match="live-set chain"):  # auto runs it natively
        assert spscan.wrap(Fan(), torch.zeros(2, 3), backward="auto").decision.chosen.name == "native"

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Linear(3, 3)

        def forward(self, x):
            y = self.f(x)
            z = torch.tanh(y) + x
            return z * y  # a product of two graph tensors: one live-set step with an operator per input

    assert "mul (product) over live [f, add]" in spscan.wrap(Scaled(), torch.zeros(2, 3)).plan.summary()


# ----------------------------------------------------------------------------- random DAGs


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_UNITS = ["linear", "tanh", "relu", "layernorm", "sigmoid", "subsample"]


@st.composite
def _dags(draw):
    """A recipe: each node reads earlier tensors (0 is the input) with no series-parallel constraint:
    a unit of one tensor, an add of two (possibly the same one twice) or a concatenation of 2-3
    (then a Linear back to the width). The output adds up every tensor nothing else reads."""
    ops = []
    for i in range(draw(st.integers(1, 7))):
        n = i + 1  # tensors available: the input and the i nodes so far
        kind = draw(st.sampled_from(["unit", "unit", "add", "cat"]))
        if kind == "unit":
            ops.append(("unit", draw(st.sampled_from(_UNITS)), draw(st.integers(0, n - 1))))
        elif kind == "add":
            ops.append(("add", draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))))
        else:
            k = draw(st.integers(2, 3))
            ops.append(("cat", draw(st.lists(st.integers(0, n - 1), min_size=k, max_size=k))))
    return ops


class DrawnDAG(nn.Module):
    def __init__(self, ops, d: int) -> None:
        super().__init__()
        self.ops = ops
        self.mods = nn.ModuleList()
        self.index = []
        for op in ops:
            m = None
            if op[0] == "unit" and op[1] == "linear":
                m = nn.Linear(d, d)
            elif op[0] == "unit" and op[1] == "layernorm":
                m = nn.LayerNorm(d)
            elif op[0] == "cat":
                m = nn.Linear(len(op[1]) * d, d)
            self.index.append(len(self.mods) if m is not None else None)
            if m is not None:
                self.mods.append(m)
        read = {s for op in ops for s in (op[2:] if op[0] == "unit" else op[1:] if op[0] == "add" else op[1])}
        self.sinks = [i for i in range(len(ops) + 1) if i not in read]

    def forward(self, x):
        hs = [x]
        for op, k in zip(self.ops, self.index):
            if op[0] == "unit":
                h = hs[op[2]]
                if k is not None:
                    h = self.mods[k](h)
                elif op[1] == "subsample":
                    h = F.pad(h[:, ::2], (0, 1))  # 3 -> 2 -> 3 features
                else:
                    h = {"tanh": torch.tanh, "relu": F.relu, "sigmoid": torch.sigmoid}[op[1]](h)
            elif op[0] == "add":
                h = hs[op[1]] + hs[op[2]]
            else:
                h = self.mods[k](torch.cat([hs[j] for j in op[1]], 1))
            hs.append(h)
        out = hs[self.sinks[-1]]
        for i in self.sinks[-2::-1]:
            out = out + hs[i]
        return out


@settings(max_examples=15, deadline=None)
@given(ops=_dags(), seed=st.integers(0, 2**16), operators=st.booleans())
def test_random_dags_equal_autograd(ops, seed, operators):
    torch.manual_seed(seed)
    model = DrawnDAG(ops, 3).double()
    if model.sinks == [0] or all(op[0] == "add" for op in ops):
        return  # the input alone, or sums of it: no layer to plan (refused)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    wrapped = spscan.wrap(model, x, levels=[0, 1, "full"][seed % 3], operators=operators)
    y_ref, g_ref, gx_ref = _grads(model, x)
    y, g, gx = _grads(wrapped, x)
    assert torch.equal(y, y_ref)
    assert _rel(gx, gx_ref) <= 1e-9
    for n in g_ref:
        assert _rel(g[n], g_ref[n]) <= 1e-9, n


def test_block_union_against_dense():
    """Placed blocks (row and column offsets, overlapping ones summed) against dense arithmetic."""
    import numpy as np
    import scipy.sparse as sp

    from spscan.planner.blocks import block_union, identity_pattern

    rng = np.random.default_rng(0)
    blocks = [(0, 0, identity_pattern(3)), (3, 2, sp.csr_array(sp.random(4, 5, density=0.4, random_state=1,
                                                                         format="csr"))),
              (1, 1, identity_pattern(3)), (0, 4, sp.csr_array((rng.random((3, 3)) < 0.5).astype(float)))]
    for _, _, p in blocks:
        p.data[:] = 1.0
    pat, maps = block_union((7, 7), blocks)
    vals = [rng.standard_normal(p.nnz) for _, _, p in blocks]
    dense = np.zeros((7, 7))
    for (r, c, p), v in zip(blocks, vals):
        q = p.copy()
        q.data = v
        dense[r:r + p.shape[0], c:c + p.shape[1]] += q.toarray()
    data = np.zeros(pat.nnz)
    for m, v in zip(maps, vals):
        np.add.at(data, m, v)
    got = sp.csr_array((data, pat.indices, pat.indptr), shape=(7, 7)).toarray()
    assert np.allclose(got, dense, rtol=0, atol=1e-15)
    assert pat.has_canonical_format
    run_errors(lambda: block_union((3, 3), [(1, 1, identity_pattern(3))]), ValueError, "blocks[0]", "does not fit")


def test_reference_resnet_shortcut_arguments():
    """``examples/resnet.py``: the shortcut is 'A' or 'B'; option A needs stride 2 and an even channel growth."""

    with pytest.raises(ValueError, match="shortcut: expected 'A' or 'B', got 'C'"):
        ResNet20(width=2, shortcut="C")
    with pytest.raises(ValueError, match="option-A shortcut needs stride 2"):
        BasicBlock(2, 5, 2, shortcut="A")
    y = ResNet20(width=2, classes=3, shortcut="A")(torch.randn(2, 3, 8, 8))
    assert y.shape == (2, 3)
