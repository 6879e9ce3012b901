"""Plan files are untrusted input: a corrupted or edited file raises ``ValueError`` or loads a plan
that gives the original plan's gradients; it never yields a plan that computes something else.

Two kinds of damage: bytes of the saved file changed at random (accidental corruption; the zip
CRCs and the file's SHA-256 digest catch it), and fields or arrays edited in range and out of range
and written back with a *recomputed* digest (a hostile or careless edit; only the structural
checks stand between it and a kernel).
"""

from __future__ import annotations

import io
import json
import os
import tempfile

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import spscan
from spscan.planner import serialize
from spscan.reference import reference_backward

B = 2


def _chain() -> list[sp.csr_array]:
    """Sparse, dense (a dense pair gives a GEMM product), diagonal and rectangular layers."""
    rng = np.random.default_rng(3)

    def rand(r, c, d):
        m = (rng.random((r, c)) < d).astype(float)
        m[np.arange(r), rng.integers(0, c, r)] = 1.0
        return sp.csr_array(m)

    return [rand(5, 5, 0.3), sp.csr_array(np.ones((5, 5))), sp.csr_array(np.ones((5, 4))), rand(4, 4, 0.5),
            sp.csr_array(np.eye(4)), rand(4, 6, 0.2), sp.csr_array(np.ones((6, 6))), rand(6, 3, 0.4),
            rand(3, 3, 0.3)]


def _values(patterns, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    vals = [torch.randn(B, p.nnz, generator=g, dtype=torch.float64) for p in patterns]
    grad = torch.randn(B, patterns[-1].shape[1], generator=g, dtype=torch.float64)
    return vals, grad


_PLANS: dict[str, tuple] = {}


def _original(levels):
    """(file bytes, plan, values, grad, gradients) of the saved plan, made once per depth."""
    key = str(levels)
    if key not in _PLANS:
        plan = spscan.plan(_chain(), levels=levels, dtype=torch.float64)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "plan.npz")
            plan.save(path)
            with open(path, "rb") as f:
                data = f.read()
        vals, grad = _values(plan.patterns)
        _PLANS[key] = (data, plan, vals, grad, spscan.backward(plan, vals, grad))
    return _PLANS[key]


def _same_patterns(a, b) -> bool:
    return len(a.patterns) == len(b.patterns) and all(
        x.shape == y.shape and np.array_equal(x.indptr, y.indptr) and np.array_equal(x.indices, y.indices)
        for x, y in zip(a.patterns, b.patterns))


def _options(plan) -> tuple:
    return plan.backend, plan.device, plan.dtype, plan.max_memory, plan.requested_levels


def _check_outcome(path, levels) -> str:
    """Load ``path``: a ``ValueError``, or a plan whose gradients are the original plan's."""
    _, plan, vals, grad, want = _original(levels)
    try:
        loaded = spscan.load_plan(path)
    except ValueError as exc:
        assert str(path) in str(exc)
        return "refused"
    if not _same_patterns(loaded, plan):
        # An edit that keeps every cross-check consistent describes another valid chain (nothing in
        # a file can tell it from an honest plan of that chain): it must compute exactly that chain.
        if max(max(p.shape) for p in loaded.patterns) > 1000:
            return "another valid chain (too wide to run here)"  # e.g. the last layer's width edited
        v, g = _values(loaded.patterns, seed=1)
        got = spscan.backward(loaded, v, g)
        ref = reference_backward(loaded.patterns, v, g)
        for x, y in zip(got, ref):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
        return "another valid chain"
    assert loaded.levels == plan.levels
    if _options(loaded) != _options(plan):
        # Options edited to other valid values: a plan for other settings, which either refuses these
        # inputs loudly or computes the same gradients.
        try:
            got = spscan.backward(loaded, vals, grad)
        except ValueError:
            return "other valid options, refuses the inputs"
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14)
        return "other valid options, same gradients"
    got = spscan.backward(loaded, vals, grad)
    for x, y in zip(got, want):
        assert torch.equal(x, y)
    return "loaded, identical gradients"


def _arrays(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data)) as z:
        return {k: z[k].copy() for k in z.files}


LEVELS = st.sampled_from(["full", 1])
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_round_trip_identical(tmp_path):
    for levels in ("full", 1, 0):
        data, plan, vals, grad, want = _original(levels)
        path = tmp_path / "plan.npz"
        path.write_bytes(data)
        assert _check_outcome(path, levels) == "loaded, identical gradients"


@SETTINGS
@given(levels=LEVELS, data=st.data())
def test_mutated_bytes(tmp_path_factory, levels, data):
    raw = bytearray(_original(levels)[0])
    kind = data.draw(st.sampled_from(["flip", "overwrite", "truncate", "insert"]), label="kind")
    if kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="keep")]
    elif kind == "insert":
        at = data.draw(st.integers(0, len(raw)), label="at")
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=16), label="bytes")
    else:
        for _ in range(data.draw(st.integers(1, 8), label="count")):
            at = data.draw(st.integers(0, len(raw) - 1), label="at")
            if kind == "flip":
                raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
            else:
                raw[at] = data.draw(st.integers(0, 255), label="byte")
    path = tmp_path_factory.mktemp("bytes") / "plan.npz"
    path.write_bytes(bytes(raw))
    event(_check_outcome(path, levels))


_BAD_VALUES = [None, True, -1, 0, 1, 2, 3, 10**12, 2.5, float("nan"), "x", "full", "auto", [], {}, [1, 2]]


def _header_paths(header: dict) -> list[tuple[str, ...]]:
    out = [(k,) for k in sorted(header)]
    out += [("options", k) for k in sorted(header["options"])]
    out += [("profile", k) for k in sorted(header["profile"])]
    out += [("candidates", k) for k in sorted(header["candidates"])]
    return out


@settings(SETTINGS, max_examples=150)
@given(levels=LEVELS, data=st.data())
def test_edited_fields_with_recomputed_digest(tmp_path_factory, levels, data):
    arrays = _arrays(_original(levels)[0])
    header = json.loads(arrays["header"].tobytes().decode())
    names = sorted(k for k in arrays if k not in ("header", "digest"))
    target = data.draw(st.one_of(st.just("header"), st.sampled_from(names)), label="field")
    if target == "header":
        path_ = data.draw(st.sampled_from(_header_paths(header)), label="header field")
        node = header
        for k in path_[:-1]:
            node = node[k]
        action = data.draw(st.sampled_from(["set", "delete", "add"]), label="action")
        if action == "delete":
            del node[path_[-1]]
        elif action == "add":
            node[path_[-1] + "_extra"] = 1
        else:
            new = data.draw(st.sampled_from(_BAD_VALUES + ["torch", "triton", "cpu", "cuda", "float32", "float64", 4, 8,
                                                          1e-9, 0.5, 1.5]), label="value")
            assume(not (type(new) is type(node[path_[-1]]) and new == node[path_[-1]]))
            node[path_[-1]] = new
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    else:
        a = arrays[target]
        flat = a.reshape(-1).copy()
        action = data.draw(st.sampled_from(["set_in_range", "set_out_of_range", "swap", "drop", "append",
                                            "dtype", "reshape", "delete"]), label="action")
        if action == "delete":
            del arrays[target]
        elif action == "dtype":
            arrays[target] = a.astype(data.draw(st.sampled_from([np.int32, np.float64, np.uint64]), label="dtype"))
        elif action == "reshape":
            arrays[target] = flat.reshape(1, -1) if a.ndim == 1 else flat
        elif action in ("drop", "append"):
            if action == "drop":
                assume(flat.size > 0)
                flat = flat[:-1]
            else:
                flat = np.append(flat, flat[-1] if flat.size else 0)
            arrays[target] = flat if a.ndim == 1 or flat.size % a.shape[-1] else flat.reshape(-1, a.shape[-1])
        else:
            assume(flat.size > 0)
            i = data.draw(st.integers(0, flat.size - 1), label="index")
            if action == "swap":
                j = data.draw(st.integers(0, flat.size - 1), label="other")
                assume(flat[i] != flat[j])
                flat[i], flat[j] = flat[j], flat[i]
            elif action == "set_in_range":
                lo, hi = int(flat.min()), int(flat.max())
                v = data.draw(st.integers(max(lo - 1, -1), hi + 1), label="value")
                assume(v != flat[i])
                flat[i] = v
            else:
                flat[i] = data.draw(st.sampled_from([-(2**62), -2, 2**31, 2**62]), label="value")
            arrays[target] = flat.reshape(a.shape)
    path = tmp_path_factory.mktemp("fields") / "plan.npz"
    serialize._write(path, arrays)  # a consistent digest: only the structural checks can refuse it
    where = ".".join(path_[:2]) if target == "header" else target.split("_")[0]
    event(f"{where}: {_check_outcome(path, levels)}")


@pytest.mark.parametrize("edit", ["pattern", "pairs", "pair_order", "storage", "option_type", "levels", "digest"])
def test_named_edits_are_refused(tmp_path, edit):
    """The edits the issue names (a stored pattern or pair list changed in range, a storage flag flipped,
    an option of the wrong type) and a stale digest, each refused with a message naming the field."""
    arrays = _arrays(_original("full")[0])
    header = json.loads(arrays["header"].tobytes().decode())
    sym = next(k[: -len("_ptr")] for k in sorted(arrays) if k.endswith("_ptr")
               and np.diff(arrays[k]).max() >= 2)
    products = arrays["products"]
    if edit == "pattern":  # move one stored entry to another in-range column, still canonical
        pat = next(k for k in sorted(arrays) if k.endswith("_indices") and k.startswith("pat")
                   and arrays[k.replace("indices", "shape")][1] > arrays[k.replace("indices", "indptr")][1])
        ind = arrays[pat]
        cols = arrays[pat.replace("indices", "shape")][1]
        row0 = arrays[pat.replace("indices", "indptr")][1]
        free = sorted(set(range(cols)) - set(ind[:row0].tolist()))
        ind[row0 - 1] = free[-1]
        ind[:row0] = np.sort(ind[:row0])
        match = "product|pair"
    elif edit == "pairs":  # one pair points at another (in-range) entry of the left operand
        a = arrays[f"{sym}_a"]
        a[0] = (a[0] + 1) % max(2, a.max() + 1)
        match = "pair"
    elif edit == "pair_order":  # swap two pairs of one entry: the sum order changes
        ptr, a, b = arrays[f"{sym}_ptr"], arrays[f"{sym}_a"], arrays[f"{sym}_b"]
        e = int(np.argmax(np.diff(ptr) >= 2))
        s = ptr[e]
        a[s], a[s + 1] = a[s + 1], a[s]
        b[s], b[s + 1] = b[s + 1], b[s]
        match = "order"
    elif edit == "storage":  # flip a product between GEMM and pair-list storage
        products[:, 2] = 1 - products[:, 2]
        match = "product"
    elif edit == "option_type":
        header["options"]["max_memory"] = "lots"
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        match = "max_memory"
    elif edit == "levels":
        header["levels"] = header["levels"] - 1
        arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
        match = "requested_levels|products|candidates"
    path = tmp_path / "plan.npz"
    if edit == "digest":  # an edit written back by plain numpy: the digest no longer matches
        arrays["layers"] = arrays["layers"][::-1].copy()
        with open(path, "wb") as f:
            np.savez(f, **arrays)
        match = "digest"
    else:
        serialize._write(path, arrays)
    with pytest.raises(ValueError, match=match):
        spscan.load_plan(path)


def test_version_1_file_is_refused_with_advice(tmp_path):
    arrays = _arrays(_original("full")[0])
    header = json.loads(arrays["header"].tobytes().decode())
    header["version"] = 1
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    path = tmp_path / "plan.npz"
    serialize._write(path, arrays)
    with pytest.raises(ValueError, match="version"):
        spscan.load_plan(path)


def _rowwise_plan():
    """A plan whose sparse products run row-wise (the profile's pair-list limit set to 1 byte)."""
    from spscan.runtime.plan import Plan
    from spscan.planner.cost import profile_for
    from spscan.planner.patterns import as_chain
    from spscan.planner.planning import plan_scan

    scan = plan_scan(as_chain(_chain()), "full", profile_for("cpu", {"pair_list_max_bytes": 1.0}), elem_bytes=8)
    assert {m.algo for m in scan.mats.values()} >= {"rows", "gemm"}
    return Plan(scan, "torch", None, torch.float64, None, "full")


def test_rowwise_products_round_trip_and_are_checked(tmp_path):
    plan = _rowwise_plan()
    path = tmp_path / "plan.npz"
    plan.save(path)
    loaded = spscan.load_plan(path)
    assert [m.algo for _, m in sorted(loaded._scan.mats.items())] == [m.algo for _, m in sorted(plan._scan.mats.items())]
    vals, grad = _values(plan.patterns)
    for x, y in zip(spscan.backward(plan, vals, grad), spscan.backward(loaded, vals, grad)):
        assert torch.equal(x, y)
    # a row-wise product's stored pattern swapped for another stored pattern of the same shape
    arrays = _arrays(path.read_bytes())
    prod = arrays["products"]
    rw = [i for i, r in enumerate(prod.tolist()) if r[2] == 2]
    shapes = {k: tuple(arrays[f"pat{k}_shape"]) for k in range(sum(n.endswith("_shape") for n in arrays))}
    sparse = {k for k, sh in shapes.items() if arrays[f"pat{k}_indices"].size < sh[0] * sh[1]}  # dense is valid
    swaps = [(i, k) for i in rw for k in sparse if shapes[k] == shapes[prod[i, 1]] and k != prod[i, 1]]
    assert swaps, "the chain has no two stored patterns of one shape"
    i, k = swaps[0]
    prod[i, 1] = k
    serialize._write(path, arrays)
    with pytest.raises(ValueError, match="product"):
        spscan.load_plan(path)


def _densified_plan(threshold=None):
    """A plan in which the storage rule densifies some products (the level-1 products, ~0.3 dense,
    read only by mat-vecs) and keeps others sparse (the level-0 products the level-1 products read)."""
    from spscan.runtime.plan import Plan
    from spscan.planner.cost import profile_for
    from spscan.planner.patterns import as_chain
    from spscan.planner.planning import plan_scan

    rng = np.random.default_rng(7)
    chain = [sp.csr_array((rng.random((20, 20)) < 0.12).astype(float)) if i % 2 else sp.csr_array(np.eye(20))
             for i in range(20)]
    prof = profile_for("cpu", None if threshold is None else {"dense_threshold": threshold})
    scan = plan_scan(as_chain(chain), 2, prof, batch_hint=1, elem_bytes=8)
    return Plan(scan, "torch", None, torch.float64, None, 2)


def test_storage_decisions_round_trip_and_are_checked(tmp_path):
    plan = _densified_plan()
    flags = {m: i.densified for m, i in plan._scan.mats.items() if i.algo != "input"}
    assert any(flags.values()) and not all(flags.values())
    path = tmp_path / "plan.npz"
    plan.save(path)
    loaded = spscan.load_plan(path)
    assert {m: i.densified for m, i in loaded._scan.mats.items() if i.algo != "input"} == flags
    assert {m: i.pattern.key for m, i in loaded._scan.mats.items()} == {m: i.pattern.key for m, i in plan._scan.mats.items()}
    vals, grad = _values(plan.patterns)
    for x, y in zip(spscan.backward(plan, vals, grad), spscan.backward(loaded, vals, grad)):
        assert torch.equal(x, y)
    # a densified product recorded as stored with its own pattern: its stored (full) pattern disagrees
    arrays = _arrays(path.read_bytes())
    prod = arrays["products"]
    row = int(np.flatnonzero(prod[:, 5] == 1)[0])
    prod[row, 5] = 0
    serialize._write(path, arrays)
    with pytest.raises(ValueError, match=f"product {prod[row, 0]}"):
        spscan.load_plan(path)
    # a sparse product recorded as densified and stored densely (pairs rewritten to the dense layout):
    # consistent in itself, but not the storage rule's decision
    plan2 = _densified_plan(threshold=1e-9)  # every product densified by the explicit override
    plan2.save(path)
    arrays2 = _arrays(path.read_bytes())
    header = json.loads(arrays2["header"].tobytes().decode())
    assert header["profile"]["dense_threshold"] == 1e-9
    assert spscan.load_plan(path).levels == 2  # the override is recorded and the decisions follow it
    header["profile"]["dense_threshold"] = None  # the same products under the cost rule: some must differ
    arrays2["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    serialize._write(path, arrays2)
    with pytest.raises(ValueError, match="storage rule"):
        spscan.load_plan(path)


def test_version_2_file_is_refused_naming_the_version(tmp_path):
    arrays = _arrays(_original("full")[0])
    header = json.loads(arrays["header"].tobytes().decode())
    header["version"] = 2
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    arrays["products"] = arrays["products"][:, :5].copy()
    path = tmp_path / "plan.npz"
    serialize._write(path, arrays)
    with pytest.raises(ValueError, match="version 2 files store pair-list products by a fixed density"):
        spscan.load_plan(path)


def test_loads_a_plan_file_written_by_an_earlier_release():
    """A plan file written by spscan 0.1 (commit c7b9444, before the engine and layer library were
    restructured) still loads and gives the gradients it gave then and the reference's."""
    data = os.path.join(os.path.dirname(__file__), "data")
    plan = spscan.load_plan(os.path.join(data, "plan-v0.1-levels2.npz"))
    case = np.load(os.path.join(data, "plan-v0.1-levels2-case.npz"))
    n = plan.n
    vals = [torch.from_numpy(case[f"v{i}"]) for i in range(n)]
    grad = torch.from_numpy(case["grad"])
    out = spscan.backward(plan, vals, grad)
    ref = spscan.reference_backward(plan.patterns, vals, grad)
    assert plan.levels == 2 and len(out) == n + 1
    for i in range(n + 1):
        assert torch.allclose(out[i], torch.from_numpy(case[f"g{i}"]), rtol=1e-12, atol=1e-12)
        assert torch.allclose(out[i], ref[i], rtol=1e-10, atol=1e-12)
