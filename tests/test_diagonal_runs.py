"""Diagonal steps back to back in the narrow compiled loop (kernels/cpu/chain_narrow.py): a stretch of them
runs through one tight loop (kernels.cpu.chain.diagonal_runs) up to the first step with an affine term, a
feed or a tap. Its results are bitwise the tiled loop's (and the general narrow step's), with stretches of
shared and per-sample diagonals, entry-major values (not a stretch), dense steps between them, and adds,
taps and feeds on any step."""

from __future__ import annotations

import numpy as np
import pytest

from spscan.kernels.cpu import chain as cpu_chain

from test_cpu_chain_tiles import _reference

pytestmark = pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")


def _run_desc(rng, kinds, m: int, batch: int, dtype, add_p: float):
    """A run over ``kinds`` (``"diag"`` per sample, ``"sdiag"`` shared, ``"dense"`` shared m x m) of width ``m``."""
    steps_desc, code, src, off, bst = [], [], [], [], []
    os_, op_ = 1, 2
    for kind in kinds:
        n = m * m if kind == "dense" else m
        shared = kind != "diag"
        steps_desc.append(("dense" if kind == "dense" else "diag", shared, None, m, m, n))
        code.append(1 if kind == "dense" else 0)
        src.append(0 if shared else 1)
        if shared:
            off.append(os_)
            os_ += n + 1
        else:
            off.append(op_)
            op_ += n
    size_p = op_ + 1
    bst = [0 if s == 0 else size_p for s in src]
    shared_src = rng.standard_normal(os_ + 2) * 0.9
    per_sample = rng.standard_normal((batch, size_p)) * 0.9
    col = 3 + m
    add, out = [], []
    for _ in kinds:
        if rng.random() < add_p:
            add.append(col)
            col += m
        else:
            add.append(-1)
        out.append(col)
        col += m
    vectors = rng.standard_normal((batch, col + 1)).astype(dtype)
    i64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    steps = len(kinds)
    desc = dict(code=i64(code), src=i64(src), offset=i64(off), bstride=i64(bst), rows=i64([m] * steps),
                cols=i64([m] * steps), add=i64(add), out=i64(out), vin0=3, csr_ptr=i64([-1] * steps),
                csr_indptr=np.zeros(1, np.int64), csr_indices=np.zeros(1, np.int64))
    return desc, [shared_src.astype(dtype), per_sample.astype(dtype).reshape(-1)], vectors, steps_desc


def _kinds(rng, steps: int) -> list[str]:
    out: list[str] = []
    while len(out) < steps:
        kind = str(rng.choice(["diag", "sdiag", "dense"], p=[0.55, 0.3, 0.15]))
        out += [kind] * int(rng.integers(1, 9))  # stretches of one kind
    return out[:steps]


def _narrow_and_tiled(monkeypatch, run):
    monkeypatch.setattr(cpu_chain, "NARROW_MIN_REUSE", 0)  # the narrow loop for any run it takes
    calls = []
    real = cpu_chain._run_narrow

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_chain, "_run_narrow", counted)
    got = run()
    assert calls == [1]
    with monkeypatch.context() as mp:
        mp.setattr(cpu_chain, "NARROW_MAX_BATCH", 0)
        want = run()
    assert calls == [1]
    return got, want


def test_diagonal_runs_table():
    i64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    # steps: 3 per-sample diagonals, a dense step, 2 shared diagonals of another source, 1 diagonal of
    # another size, 1 entry-major diagonal (estride 4), 2 diagonals
    code = i64([0, 0, 0, 1, 0, 0, 0, 0, 0, 0])
    src = i64([1, 1, 1, 0, 0, 0, 0, 1, 1, 1])
    bstride = i64([9, 9, 9, 0, 0, 0, 0, 1, 9, 9])
    estride = i64([1, 1, 1, 1, 1, 1, 1, 4, 1, 1])
    rows = i64([5, 5, 5, 5, 5, 5, 3, 3, 3, 3])
    runs = cpu_chain.diagonal_runs(code, src, bstride, estride, rows)
    assert runs.tolist() == [3, 2, 1, 0, 2, 1, 1, 0, 2, 1]
    assert cpu_chain.diagonal_runs(i64([0]), i64([0]), i64([0]), i64([1]), i64([4])).tolist() == [1]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [1, 3, 4])
@pytest.mark.parametrize("m", [1, 4, 16, 21])
@pytest.mark.parametrize("seed", range(3))
def test_diagonal_stretches_equal_the_tiled_run_bitwise(monkeypatch, dtype, batch, m, seed):
    rng = np.random.default_rng(900 + 97 * seed + 7 * m + batch)
    steps = int(rng.integers(1, 60))
    desc, sources, vectors, steps_desc = _run_desc(rng, _kinds(rng, steps), m, batch, dtype, add_p=0.15)
    # taps on some steps (and the input), feeds on some steps without an affine term
    idx = np.append(rng.permutation(steps)[: max(1, steps // 4)], -1)
    taps = [(idx, 0, m, np.full((m, idx.size, batch), np.nan, dtype=dtype))]
    free = np.setdiff1d(np.flatnonzero(desc["add"] < 0), idx)[: max(0, steps // 5)]
    feeds = []
    if free.size:
        terms = rng.standard_normal((free.size, batch, m)).astype(dtype)
        feeds.append((free, 0, m, terms.reshape(-1).copy(), np.arange(free.size, dtype=np.int64) * batch * m, m, 1))

    def run():
        v = vectors.copy()
        tp = [(i, r0, n, np.full_like(buf, np.nan)) for i, r0, n, buf in taps]
        cpu_chain.run_chain(sources=sources, vectors=v, taps=tp, feeds=feeds, **desc)
        return v, tp[0][3]

    (got, got_tap), (want, want_tap) = _narrow_and_tiled(monkeypatch, run)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_tap, want_tap)
    if not feeds:  # the float64 step-by-step reference (no feeds there)
        ref = _reference(desc, sources, vectors, steps_desc)
        scale = np.abs(ref).max() + 1e-30
        tol = 1e-12 if dtype == np.float64 else 3e-5
        assert np.abs(got - ref).max() <= tol * scale * steps


@pytest.mark.parametrize("batch", [1, 4])
def test_a_long_diagonal_chain_repeated_with_a_memo(monkeypatch, batch):
    """The stretches are worked out once per step tables (the memo) and the same every call."""
    rng = np.random.default_rng(31 + batch)
    desc, sources, vectors, _ = _run_desc(rng, ["diag"] * 500 + ["sdiag"] * 300, 4, batch, np.float32, add_p=0.0)
    memo: dict = {}

    def run():
        v = vectors.copy()
        cpu_chain.run_chain(sources=sources, vectors=v, memo=memo, **desc)
        return v

    first, want = _narrow_and_tiled(monkeypatch, run)
    np.testing.assert_array_equal(first, want)
    monkeypatch.setattr(cpu_chain, "diagonal_runs", None)  # not worked out again
    for _ in range(2):
        np.testing.assert_array_equal(run(), want)
