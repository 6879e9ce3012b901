"""Bad input gives a ValueError/TypeError that names the place and the expected vs actual."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan


def _chain():
    p1 = sp.csr_array(np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))  # J_1^T: (2, 3), nnz 3
    p2 = sp.csr_array(np.ones((3, 2)))  # J_2^T: (3, 2), nnz 6
    return [p1, p2]


def _ok(batch=2, dtype=torch.float64):
    return [torch.randn(batch, 3, dtype=dtype), torch.randn(batch, 6, dtype=dtype)], torch.randn(batch, 2, dtype=dtype)


def _unsorted():
    m = sp.csr_array(np.ones((2, 2)))
    m.indices[:2] = m.indices[:2][::-1].copy()
    m.has_sorted_indices = False
    return m


def _duplicated():
    return sp.csr_array((np.ones(2), np.array([0, 0]), np.array([0, 2, 2])), shape=(2, 2))


PLAN_CASES = [
    ("empty chain", lambda: spscan.plan([]), ValueError, "at least one"),
    ("not a sequence", lambda: spscan.plan(3), TypeError, "sequence"),
    ("dense numpy pattern", lambda: spscan.plan([np.ones((2, 2))]), TypeError, r"patterns\[0\].*ndarray"),
    ("COO pattern", lambda: spscan.plan([sp.coo_array(np.ones((2, 2)))]), TypeError, "coo"),
    ("strided torch tensor", lambda: spscan.plan([torch.ones(2, 2)]), TypeError, "layout"),
    ("unsorted indices", lambda: spscan.plan([_unsorted()]), ValueError, r"patterns\[0\].*unsorted"),
    ("duplicate indices", lambda: spscan.plan([_duplicated()]), ValueError, r"patterns\[0\].*duplicated"),
    ("non-chaining shapes", lambda: spscan.plan([sp.csr_array(np.ones((2, 3))), sp.csr_array(np.ones((2, 2)))]),
     ValueError, r"patterns\[1\].*\(2, 2\).*3 rows"),
    ("bad levels string", lambda: spscan.plan(_chain(), levels="deep"), ValueError, "levels"),
    ("negative levels", lambda: spscan.plan(_chain(), levels=-1), ValueError, "levels"),
    ("bad backend", lambda: spscan.plan(_chain(), backend="cuda"), ValueError, "backend"),
    ("bad dtype", lambda: spscan.plan(_chain(), dtype=torch.int32), TypeError, "dtype"),
    ("bad max_memory", lambda: spscan.plan(_chain(), max_memory=-5), ValueError, "max_memory"),
    ("bad device", lambda: spscan.plan(_chain(), device="nope"), ValueError, "device"),
    ("unknown keyword", lambda: spscan.plan(_chain(), level=2), TypeError, "level"),
]


@pytest.mark.parametrize("name,call,exc,match", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_bad_plan_input(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def _bw(values=None, grad=None, extra=None, plan_kw=None, **kw):
    plan = spscan.plan(_chain(), **(plan_kw or {}))
    v, g = _ok()
    return spscan.backward(plan, v if values is None else values, g if grad is None else grad, extra, **kw)


BACKWARD_CASES = [
    ("too few values", lambda: _bw(values=_ok()[0][:1]), ValueError, r"expected 2 tensors.*got 1"),
    ("values not tensors", lambda: _bw(values=[np.ones((2, 3)), np.ones((2, 6))]), TypeError, r"values\[0\].*ndarray"),
    ("wrong nnz", lambda: _bw(values=[torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)]),
     ValueError, r"values\[0\] \(layer 1\).*\(2, 3\).*got \(2, 4\)"),
    ("wrong batch", lambda: _bw(values=[torch.randn(3, 3, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)]),
     ValueError, r"values\[0\].*got \(3, 3\)"),
    ("mixed dtype", lambda: _bw(values=[torch.randn(2, 3), torch.randn(2, 6, dtype=torch.float64)]),
     TypeError, r"values\[0\].*float32.*float64"),
    ("integer grad", lambda: _bw(grad=torch.ones(2, 2, dtype=torch.int64)), TypeError, "grad.*dtype"),
    ("grad wrong width", lambda: _bw(grad=torch.randn(2, 5, dtype=torch.float64)), ValueError, r"grad.*\(B, 2\).*\(2, 5\)"),
    ("grad 1-D", lambda: _bw(grad=torch.randn(2, dtype=torch.float64)), ValueError, "grad"),
    ("sparse values", lambda: _bw(values=[torch.randn(2, 3, dtype=torch.float64).to_sparse(), torch.randn(2, 6, dtype=torch.float64)]),
     TypeError, "layout"),
    ("plan dtype mismatch", lambda: _bw(plan_kw={"dtype": torch.float32}), TypeError, "plan was made for torch.float32"),
    ("plan device mismatch", lambda: _bw(plan_kw={"device": "meta"}), ValueError, "device"),
    ("extra wrong length", lambda: _bw(extra=[None]), ValueError, r"extra.*3 entries.*got 1"),
    ("extra wrong shape", lambda: _bw(extra=[torch.randn(2, 5, dtype=torch.float64), None, None]), ValueError, r"extra\[0\].*\(2, 2\)"),
    ("extra wrong dtype", lambda: _bw(extra=[None, torch.randn(2, 3), None]), TypeError, r"extra\[1\]"),
    ("NaN with check_finite", lambda: _bw(values=[torch.full((2, 3), float("nan"), dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)],
                                           check_finite=True), ValueError, r"values\[0\].*NaN"),
    ("not a plan", lambda: spscan.backward("plan", *_ok()), TypeError, "Plan"),
    ("stacked with unequal nnz", lambda: _bw(values=torch.randn(2, 2, 6, dtype=torch.float64)), ValueError, "same nnz"),
]


@pytest.mark.parametrize("name,call,exc,match", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES])
def test_bad_backward_input(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_nan_propagates_by_default():
    v, g = _ok()
    v[1] = v[1].clone()
    v[1][0, 0] = float("nan")
    out = spscan.backward(spscan.plan(_chain()), v, g)
    assert torch.isnan(out[1][0]).any() and not torch.isnan(out[1][1]).any()


def test_failed_call_leaves_plan_usable():
    plan = spscan.plan(_chain())
    v, g = _ok()
    with pytest.raises(ValueError):
        spscan.backward(plan, v[:1], g)
    assert len(spscan.backward(plan, v, g)) == 3


@pytest.mark.parametrize("corrupt", ["truncate", "garbage", "bad_header", "bad_pairs", "missing_layers"])
def test_corrupted_plan_file(tmp_path, corrupt):
    rng = np.random.default_rng(0)
    pats = [sp.csr_array((rng.random((4, 4)) < 0.5).astype(float)) for _ in range(6)]
    path = tmp_path / "p.npz"
    spscan.plan(pats, levels="full").save(path)
    if corrupt == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif corrupt == "garbage":
        path.write_bytes(b"not a plan at all")
    else:
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        if corrupt == "bad_header":
            arrays["header"] = np.frombuffer(b'{"format": "other"}', dtype=np.uint8)
        elif corrupt == "bad_pairs":
            key = next(k for k in arrays if k.startswith("sym") and k.endswith("_a"))
            arrays[key] = arrays[key] + 1000
        else:
            del arrays["layers"]
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    with pytest.raises(ValueError, match="plan"):
        spscan.load_plan(path)


def test_first_hour_messages_name_the_object_and_what_to_do():
    """The messages a new user meets first: a missing batch dimension, a module reconfigured after
    wrapping, and a supported layer subclassed with its own forward."""
    from torch import nn

    mlp = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))
    with pytest.raises(ValueError, match=r"layer 0 \(0: Linear\).*needs a batch dimension; pass x.unsqueeze\(0\)"):
        spscan.wrap(mlp, torch.randn(32))
    gru = nn.GRU(2, 3)
    wrapped = spscan.wrap(gru, torch.randn(5, 1, 2))
    gru.bidirectional = True
    with pytest.raises(ValueError, match=r"GRU: num_layers / bidirectional changed after wrapping .* wrap the module again"):
        wrapped(torch.randn(5, 1, 2))

    class MyReLU(nn.ReLU):
        def forward(self, x):
            return torch.relu(x) * 2

    # traced op by op: relu, then the product with a Python number (a scale unit)
    net = nn.Sequential(nn.Linear(4, 4), MyReLU(), nn.Linear(4, 2)).double()
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    wrapped = spscan.wrap(net, x)
    assert "mul 2" in wrapped.plan.summary() and "opaque" not in wrapped.plan.summary()
    wrapped(x).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    net(x2).sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=0, atol=1e-12)
