"""The compiled linear run on a narrow batch (kernels/cpu/chain_narrow.py: one sample at a time, the lanes
along the features): bitwise the tiled loop's results (which the per-sample checks of
test_cpu_chain_tiles.py compare with batches of 15 to 33), with taps, feeds, entry-major values and the
LSTM gate code; the row blocks it reads shared steps by (narrow_tables), on the patterns recurrences
make; and the batches it takes."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from spscan.kernels.cpu import chain as cpu_chain
from spscan.kernels.cpu.chain_tables import narrow_tables

from test_cpu_chain_tiles import _entry_major, _random_run, _reference

pytestmark = pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")


@pytest.fixture
def narrow_calls(monkeypatch):
    """How many runs went through the narrow loop."""
    calls = []
    real = cpu_chain._run_narrow

    def counted(*args, **kwargs):
        calls.append(args[4].shape[0])  # the vectors' batch (_run_narrow(nt, st, drun, srcs, vectors, ...))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_chain, "_run_narrow", counted)
    return calls


@pytest.fixture
def any_reuse(monkeypatch):
    """The narrow loop for every batch it takes, however few times the run reads its shared values."""
    monkeypatch.setattr(cpu_chain, "NARROW_MIN_REUSE", 0)


def _tiled(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setattr(cpu_chain, "NARROW_MAX_BATCH", 0)
        return fn()


def _taps_and_feeds(rng, desc, batch, dtype):
    steps = desc["code"].shape[0]
    sizes = np.append(desc["rows"], desc["cols"][0])
    idx = np.append(rng.permutation(steps)[: max(1, steps // 2)], -1)
    mmin = int(sizes[idx].min())
    tap = (idx, 0, mmin, np.full((mmin, idx.size, batch), np.nan, dtype=dtype))
    free = np.setdiff1d(np.flatnonzero(desc["add"] < 0), idx)
    feeds = []
    if free.size:
        m = int(desc["rows"][free].min())
        terms = rng.standard_normal((free.size, batch, m)).astype(dtype)  # (K, B, rows): sample-major
        feeds.append((free, 0, m, terms.reshape(-1).copy(), np.arange(free.size, dtype=np.int64) * batch * m, m, 1))
    return [tap], feeds


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 3e-5)])
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", range(4))
def test_narrow_run_equals_the_tiled_run_bitwise(monkeypatch, narrow_calls, any_reuse, dtype, tol, batch, seed):
    rng = np.random.default_rng(7000 + 10 * seed + batch)
    desc, sources, vectors, steps_desc = _random_run(rng, int(rng.integers(1, 14)), batch, dtype)
    taps, feeds = _taps_and_feeds(rng, desc, batch, dtype)

    def run(d=desc, s=sources):
        v = vectors.copy()
        tp = [(i, r0, n, np.full_like(buf, np.nan)) for i, r0, n, buf in taps]
        cpu_chain.run_chain(sources=s, vectors=v, taps=tp, feeds=feeds, **d)
        return v, [t[3] for t in tp]

    got, got_taps = run()
    assert narrow_calls == [batch]
    want, want_taps = _tiled(monkeypatch, run)
    assert narrow_calls == [batch]
    np.testing.assert_array_equal(got, want)
    for a, b in zip(got_taps, want_taps):
        np.testing.assert_array_equal(a, b)
    # the values stored entry-major: the same
    d_em, s_em = _entry_major(desc, sources, batch)
    np.testing.assert_array_equal(run(d_em, s_em)[0], got)
    # and the sums are right (without the feeds: the float64 loop has none)
    plain = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=plain, **desc)
    ref = _reference(desc, sources, vectors, steps_desc)
    assert np.abs(plain - ref).max() <= tol * (np.abs(ref).max() + 1e-30) * len(steps_desc)


def _recurrent_pattern(rng, H: int, kind: str) -> sp.csr_array:
    """Shared patterns of the recurrences' factored steps: ``gru`` (H rows of a 3H-column weight block and
    the identity entry H further on, 3H + u), ``lstm`` (H rows of a 4H weight block over H rows of one
    identity entry each), ``mixed`` (a weight block, then rows whose entries shift by 0 and 1 in turn, so
    they are no block, an empty row, a lone row)."""
    if kind == "gru":
        dense = np.zeros((H, 4 * H))
        dense[:, :3 * H] = 1
        dense[np.arange(H), 3 * H + np.arange(H)] = 1
    elif kind == "lstm":
        dense = np.zeros((2 * H, 5 * H))
        dense[:H, :4 * H] = 1
        dense[H + np.arange(H), 4 * H + np.arange(H)] = 1
    else:
        dense = np.zeros((3 * H + 2, 2 * H + 2))
        dense[:H, : H] = rng.random((1, H)) < 0.7
        for r in range(2 * H):
            dense[H + r, (r // 2) % (2 * H)] = 1
            dense[H + r, 2 * H] = 1
        dense[3 * H + 1, 2 * H + 1] = 1
    return sp.csr_array(dense)


@pytest.mark.parametrize("kind", ["gru", "lstm", "mixed"])
@pytest.mark.parametrize("H", [5, 16, 37, 64])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_recurrent_patterns_run_as_row_blocks(monkeypatch, narrow_calls, any_reuse, kind, H, dtype):
    """A recurrence's shared step between per-sample steps (a diagonal before it, a dense step back to its
    columns after it), T times, one sample: its weight rows (and the identity entries beside them) form
    row blocks, one copy of its values serves every step, and the run equals the tiled one bitwise."""
    rng = np.random.default_rng(H)
    pat = _recurrent_pattern(rng, H, kind)
    m, k = pat.shape
    T = 4
    code = np.array([0, 3, 2] * T, dtype=np.int64)
    rows = np.array([k, m, k] * T, dtype=np.int64)
    cols = np.array([k, k, m] * T, dtype=np.int64)
    per_step = k + m * k  # the sample's values of one period: the diagonal's, then the dense step's
    shared = rng.standard_normal(pat.nnz + 3).astype(dtype)
    per = (rng.standard_normal((1, per_step * T)) / np.sqrt(m)).astype(dtype)
    offset = np.array([v for t in range(T) for v in (t * per_step, 2, t * per_step + k)], dtype=np.int64)
    src = np.array([1, 0, 1] * T, dtype=np.int64)
    bstride = np.array([per_step * T, 0, per_step * T] * T, dtype=np.int64)
    out = np.cumsum(np.concatenate([[k], rows[:-1]])).astype(np.int64)
    add = np.full(3 * T, -1, dtype=np.int64)
    vectors = np.zeros((1, int(out[-1] + rows[-1])), dtype=dtype)
    vectors[0, :k] = rng.standard_normal(k)
    indptr, indices = pat.indptr.astype(np.int64), pat.indices.astype(np.int64)
    csr_ptr = np.zeros(3 * T, dtype=np.int64)
    args = (code, src, offset, bstride, rows, cols, add, out, 0, [shared, per.reshape(-1)])

    def run():
        v = vectors.copy()
        cpu_chain.run_chain(*args, v, csr_ptr, indptr, indices)
        return v

    got = run()
    assert narrow_calls == [1]
    np.testing.assert_array_equal(got, _tiled(monkeypatch, run))
    # the float64 product, step by step
    y = vectors[0, :k].astype(np.float64)
    A = sp.csr_array((shared[2:2 + pat.nnz].astype(np.float64), pat.indices, pat.indptr), shape=pat.shape)
    for t in range(T):
        p0 = t * per_step
        y = A @ (per[0, p0:p0 + k].astype(np.float64) * y)
        o = int(out[3 * t + 1])
        np.testing.assert_allclose(got[0, o:o + m], y, rtol=1e-4 if dtype == np.float32 else 1e-11, atol=1e-5)
        y = per[0, p0 + k:p0 + per_step].astype(np.float64).reshape(k, m) @ y
    nt = narrow_tables(code, src, offset, rows, cols, csr_ptr, indptr, indices)
    blocks = list(zip(nt.blk_r0.tolist(), nt.blk_rows.tolist(), nt.blk_n.tolist()))
    assert sum(R for _, R, _ in blocks) == m and [r0 for r0, _, _ in blocks] == np.cumsum(
        [0] + [R for _, R, _ in blocks[:-1]]).tolist()
    if kind == "gru":  # one block: the weight columns shared, the identity slot one column further per row
        assert blocks == [(0, H, 3 * H + 1)]
        assert nt.col_step[nt.blk_col[0]:nt.blk_col[0] + 3 * H + 1].tolist() == [0] * (3 * H) + [1]
    elif kind == "lstm":  # the weight rows, then the identity band
        assert blocks == [(0, H, 4 * H), (H, H, 1)]
        assert nt.col_step[nt.blk_col[1]] == 1
    else:  # no block mixes rows whose shifts differ
        for r0, R, n in blocks:
            if R > 1:
                cols_of = [indices[indptr[r]:indptr[r + 1]] for r in range(r0, r0 + R)]
                d = [cols_of[i + 1] - cols_of[i] for i in range(R - 1)]
                assert all(np.array_equal(x, d[0]) and set(x.tolist()) <= {0, 1} for x in d)
    # one copy of the shared values for all T steps
    assert nt.size == pat.nnz


def _shared_dense_run(rng, steps: int, reuse: int, batch: int, m: int = 20):
    """Per-sample diagonals alternating with shared dense ``m x m`` steps whose values change every ``reuse``
    steps (``reuse = steps``: one weight for the whole run, as a recurrence's)."""
    code = np.array([0, 1] * steps, dtype=np.int64)
    rows = np.full(2 * steps, m, dtype=np.int64)
    shared = rng.standard_normal(-(-steps // reuse) * m * m) / m
    per = rng.standard_normal(batch * steps * m)
    offset = np.array([v for t in range(steps) for v in (t * m, (t // reuse) * m * m)], dtype=np.int64)
    desc = dict(code=code, src=np.array([1, 0] * steps, dtype=np.int64), offset=offset,
                bstride=np.array([steps * m, 0] * steps, dtype=np.int64), rows=rows, cols=rows.copy(),
                add=np.full(2 * steps, -1, dtype=np.int64), out=m * np.arange(1, 2 * steps + 1, dtype=np.int64),
                vin0=0)
    return desc, [shared, per], rng.standard_normal((batch, m * (2 * steps + 1)))


def test_which_runs_take_the_narrow_loop(narrow_calls):
    """A batch of at most NARROW_MAX_BATCH, without a reducing tap, whose samples read the run's shared dense
    and CSR values at least NARROW_MIN_REUSE times over (their transposed copy pays): a recurrence's
    weight, or no such values at all; a CNN-like run that reads each layer's weight once stays tiled."""
    rng = np.random.default_rng(3)
    limit, reuse = cpu_chain.NARROW_MAX_BATCH, cpu_chain.NARROW_MIN_REUSE
    cases = [(1, 12, 12), (limit, 12, 12), (limit + 1, 12, 12), (1, 12, 1), (1, 12, reuse),
             (2, 12, 2 * reuse - 1)]
    for batch, steps, every in cases:
        desc, sources, vectors = _shared_dense_run(rng, steps, every, batch)
        cpu_chain.run_chain(sources=sources, vectors=vectors, **desc)
    assert narrow_calls == [1, limit, 1]
    # no shared dense or CSR step (here per-sample diagonals and dense steps): narrow
    desc, sources, vectors = _shared_dense_run(rng, 5, 1, 2)
    m = int(desc["rows"][0])
    per = rng.standard_normal(2 * 5 * (m + m * m))
    desc = dict(desc, code=np.array([0, 2] * 5, dtype=np.int64), src=np.ones(10, dtype=np.int64),
                offset=np.array([v for t in range(5) for v in (t * (m + m * m), t * (m + m * m) + m)], dtype=np.int64),
                bstride=np.full(10, 5 * (m + m * m), dtype=np.int64))
    cpu_chain.run_chain(sources=[sources[0], per], vectors=vectors, **desc)
    assert narrow_calls == [1, limit, 1, 2]
    # a reducing tap (a weight gradient summed over the batch's lanes) runs tiled at any batch
    calls = len(narrow_calls)
    desc, sources, vectors = _shared_dense_run(rng, 6, 6, 1)
    m = int(desc["rows"][0])
    operand = rng.standard_normal((2, 1, 1))
    target = np.zeros((m, 2))
    cpu_chain.run_chain(sources=sources, vectors=vectors, taps=[(np.array([0]), 0, m, target, operand)], **desc)
    assert len(narrow_calls) == calls
    np.testing.assert_allclose(target, vectors[0, m:2 * m, None] * operand[:, 0, 0][None, :], rtol=1e-12)


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_recurrence_like_run_in_the_narrow_loop_equals_tiled(monkeypatch, narrow_calls, batch):
    """Without forcing: one shared weight over 40 steps takes the narrow loop, bitwise the tiled result."""
    rng = np.random.default_rng(batch)
    desc, sources, vectors = _shared_dense_run(rng, 40, 40, batch, m=37)
    got, want = vectors.copy(), vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=got, **desc)
    _tiled(monkeypatch, lambda: cpu_chain.run_chain(sources=sources, vectors=want, **desc))
    assert narrow_calls == [batch]
    np.testing.assert_array_equal(got, want)
