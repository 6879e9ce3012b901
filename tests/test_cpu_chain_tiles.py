"""The compiled linear run's tiles (kernels/cpu/chain.py over kernels/cpu/simd.py): runs wide enough for the
register transposes (rows and entries >= LANES), CSR rows sharing one column list (four- and eight-row
blocks), diagonal bands of short rows,
full and partial tiles, per-sample values stored sample-major or entry-major; against a float64 loop,
sample by sample bitwise, and the intrinsics themselves against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp

from spscan.kernels.cpu import chain as cpu_chain

pytestmark = pytest.mark.skipif(not cpu_chain.available(), reason="numba not installed")

LANES = 16


def _pattern(rng, m: int, k: int) -> sp.csr_array:
    """Random CSR with empty rows, plus (often) a block of rows sharing one column list, like the LSTM
    weight element's ``W_hh^T`` rows."""
    mask = rng.random((m, k)) < 0.3
    if m >= 5 and rng.random() < 0.7:
        r0 = int(rng.integers(0, m - 4))
        cols = rng.random(k) < 0.6
        mask[r0:r0 + int(rng.integers(4, min(m - r0, 9) + 1))] = cols
    if m >= 3 and k >= 3 and rng.random() < 0.5:
        # a diagonal band of rows with one to three entries, like the LSTM gate element's blocks
        width = int(rng.integers(1, 4))
        length = int(rng.integers(2, m + 1))
        r0 = int(rng.integers(0, m - length + 1))
        cols = np.sort(rng.choice(k, size=min(width, k), replace=False))
        mask[r0:r0 + length] = False
        for r in range(length):
            mask[r0 + r, (cols + r) % k] = True
    if m > 2:
        mask[int(rng.integers(m))] = False  # an empty row
    return sp.csr_array(mask.astype(np.float64))


def _random_run(rng, steps: int, batch: int, dtype):
    dims = [int(rng.choice([1, 5, 16, 20, 37]))]
    steps_desc = []
    for _ in range(steps):
        k = dims[-1]
        kind = str(rng.choice(["diag", "dense", "csr", "csr"]))
        m = k if kind == "diag" else int(rng.choice([1, 4, 16, 19, 40]))
        pat = _pattern(rng, m, k) if kind == "csr" else None
        shared = bool(rng.random() < 0.5)
        n = m if kind == "diag" else (m * k if kind == "dense" else pat.nnz)
        steps_desc.append((kind, shared, pat, m, k, n))
        dims.append(m)
    size_s = sum(n + 1 for kind, sh, _, _, _, n in steps_desc if sh) + 3
    size_p = sum(n for kind, sh, _, _, _, n in steps_desc if not sh) + 2
    shared_src = rng.standard_normal(size_s)
    per_sample = rng.standard_normal((batch, size_p))
    pats = [p for _, _, p, _, _, _ in steps_desc if p is not None]
    starts = np.cumsum([0] + [p.shape[0] + 1 for p in pats])
    base = np.cumsum([0] + [p.nnz for p in pats])
    indptr = np.concatenate([p.indptr.astype(np.int64) + b for p, b in zip(pats, base)] or [np.zeros(1, np.int64)])
    indices = np.concatenate([p.indices.astype(np.int64) for p in pats] or [np.zeros(1, np.int64)])
    code, src, off, csr_ptr = [], [], [], []
    os_, op_, q = 2, 1, 0
    for kind, sh, pat, m, k, n in steps_desc:
        code.append({"diag": 0, "dense": 1, "csr": 3}[kind] + (0 if sh or kind == "diag" else 1))
        src.append(0 if sh else 1)
        if sh:
            off.append(os_)
            os_ += n + 1
        else:
            off.append(op_)
            op_ += n
        if pat is not None:
            csr_ptr.append(int(starts[q]))
            q += 1
        else:
            csr_ptr.append(-1)
    col = 3 + dims[0]
    add, out = [], []
    for m in dims[1:]:
        if rng.random() < 0.4:
            add.append(col)
            col += m
        else:
            add.append(-1)
        out.append(col)
        col += m
    vectors = rng.standard_normal((batch, col + 1)).astype(dtype)
    i64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    desc = dict(code=i64(code), src=i64(src), offset=i64(off), bstride=i64([size_p if s == 1 else 0 for s in src]),
                rows=i64(dims[1:]), cols=i64(dims[:-1]), add=i64(add), out=i64(out), vin0=3, csr_ptr=i64(csr_ptr),
                csr_indptr=indptr, csr_indices=indices)
    return desc, [shared_src.astype(dtype), per_sample.astype(dtype).reshape(-1)], vectors, steps_desc


def _reference(desc, sources, vectors, steps_desc):
    """The run in float64, one step at a time."""
    v = vectors.astype(np.float64).copy()
    batch = v.shape[0]
    s0 = sources[0].astype(np.float64)
    s1 = sources[1].astype(np.float64).reshape(batch, -1)
    y = v[:, desc["vin0"]:desc["vin0"] + desc["cols"][0]].copy()
    for j, (kind, sh, pat, m, k, n) in enumerate(steps_desc):
        o = int(desc["offset"][j])
        vals = np.broadcast_to(s0[o:o + n], (batch, n)) if sh else s1[:, o:o + n]
        if kind == "diag":
            y = vals * y
        elif kind == "dense":
            y = np.einsum("bik,bk->bi", vals.reshape(batch, m, k), y)
        else:
            y = np.stack([sp.csr_array((vals[b], pat.indices, pat.indptr), shape=pat.shape) @ y[b] for b in range(batch)])
        a = int(desc["add"][j])
        if a >= 0:
            y = y + v[:, a:a + m]
        v[:, desc["out"][j]:desc["out"][j] + m] = y
    return v


def _entry_major(desc, sources, batch):
    """The same run with the per-sample values stored entry-major: ``(n, B)`` per step."""
    per = sources[1].reshape(batch, -1)
    em = per.T.copy().reshape(-1)  # entry q of sample b at q * batch + b
    d = dict(desc)
    d["bstride"] = np.where(desc["src"] == 1, 1, 0).astype(np.int64)
    d["offset"] = np.where(desc["src"] == 1, desc["offset"] * batch, desc["offset"]).astype(np.int64)
    d["estride"] = np.where(desc["src"] == 1, batch, 1).astype(np.int64)
    return d, [sources[0], em]


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 3e-5)])
@pytest.mark.parametrize("batch", [1, 15, 16, 17, 33])
@pytest.mark.parametrize("seed", range(3))
def test_tiled_run_equals_reference_and_is_per_sample(dtype, tol, batch, seed):
    rng = np.random.default_rng(100 * seed + batch)
    desc, sources, vectors, steps_desc = _random_run(rng, int(rng.integers(1, 14)), batch, dtype)
    want = _reference(desc, sources, vectors, steps_desc)
    got = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=got, **desc)
    scale = np.abs(want).max() + 1e-30
    assert np.abs(got - want).max() <= tol * scale * len(steps_desc)
    written = np.zeros(got.shape[1], dtype=bool)
    for o, m in zip(desc["out"], desc["rows"]):
        written[o:o + m] = True
    assert np.array_equal(got[:, ~written], vectors[:, ~written])  # nothing else is touched
    # a sample's result does not depend on the batch or on its tile: bitwise
    per = sources[1].reshape(batch, -1)
    for b in sorted({0, batch - 1, batch // 2}):
        one = vectors[b:b + 1].copy()
        cpu_chain.run_chain(sources=[sources[0], per[b].copy()], vectors=one,
                            **{**desc, "bstride": np.where(desc["src"] == 1, per.shape[1], 0).astype(np.int64)})
        assert np.array_equal(one[0], got[b]), b
    # per-sample values stored entry-major (read in place by full tiles): bitwise the same
    d_em, s_em = _entry_major(desc, sources, batch)
    em = vectors.copy()
    cpu_chain.run_chain(sources=s_em, vectors=em, **d_em)
    assert np.array_equal(em, got)


def _run_and_order(seed: int, steps_range: tuple, batch: int, dtype):
    """A random run of a length in ``steps_range``, its result (``full``) and a random order of its steps."""
    rng = np.random.default_rng(seed)
    desc, sources, vectors, _ = _random_run(rng, int(rng.integers(*steps_range)), batch, dtype)
    full = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=full, **desc)
    return rng, desc, sources, vectors, full, rng.permutation(desc["code"].shape[0])


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("batch", [1, 16, 19, 33])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("ring", [None, 2])
def test_reducing_tap_equals_the_product_of_the_stored_rows(monkeypatch, dtype, tol, batch, seed, ring):
    """A tap with an operand hands back ``stacked rows @ operand^T`` over all its steps and samples (within
    float rounding of the same products in float64), besides a plain tap in the same run, with the
    run's outputs unchanged; rings of REDUCE_STEPS steps (and a tiny one: many flushes, a partial
    last one) give the same sums. Only one reducing tap, and not of the input."""
    if ring is not None:
        monkeypatch.setattr(cpu_chain, "REDUCE_STEPS", ring)
    rng, desc, sources, vectors, full, order = _run_and_order(3000 + 10 * seed + batch, (3, 40), batch, dtype)
    steps = order.size
    red_idx, plain_idx = order[: (steps + 1) // 2], np.sort(order[(steps + 1) // 2:])
    mmin = int(desc["rows"][red_idx].min())
    row0 = int(rng.integers(0, mmin))
    nrows = int(rng.integers(1, mmin - row0 + 1))
    C = int(rng.integers(1, 7))
    operand = rng.standard_normal((C, red_idx.size, batch)).astype(dtype)
    operand[:, :, 0] *= 1e3  # a sample's scale of its own: lanes do not mix
    reduced = np.full((nrows, C), np.nan, dtype=dtype)
    taps = [(red_idx, row0, nrows, reduced, operand)]
    if plain_idx.size:
        m2 = int(desc["rows"][plain_idx].min())
        taps.append((plain_idx, 0, m2, np.zeros((m2, plain_idx.size, batch), dtype=dtype)))
    got = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=got, taps=taps, **desc)
    assert np.array_equal(got, full)
    stacked = np.stack([full[:, int(desc["out"][j]) + row0:int(desc["out"][j]) + row0 + nrows].T for j in red_idx], 1)
    want = stacked.reshape(nrows, -1).astype(np.float64) @ operand.reshape(C, -1).T.astype(np.float64)
    bound = tol * (np.abs(stacked.reshape(nrows, -1)).astype(np.float64) @ np.abs(operand.reshape(C, -1)).T) + 1e-300
    assert (np.abs(reduced - want) <= bound).all()
    if plain_idx.size:
        for k, j in enumerate(plain_idx):
            o = int(desc["out"][j])
            assert np.array_equal(taps[1][3][:, k].T, full[:, o:o + taps[1][2]])
    with pytest.raises(ValueError, match="at most one tap reduces"):
        cpu_chain.run_chain(sources=sources, vectors=vectors.copy(),
                            taps=[(red_idx[:1], 0, 1, np.zeros((1, 1), dtype=dtype), operand[:1, :1].copy()),
                                  (red_idx[1:2], 0, 1, np.zeros((1, 1), dtype=dtype), operand[:1, :1].copy())], **desc)
    with pytest.raises(ValueError, match="not the input"):
        cpu_chain.run_chain(sources=sources, vectors=vectors.copy(),
                            taps=[(np.array([-1]), 0, 1, np.zeros((1, 1), dtype=dtype), operand[:1, :1].copy())],
                            **desc)
    with pytest.raises(ValueError, match="operand"):
        cpu_chain.run_chain(sources=sources, vectors=vectors.copy(),
                            taps=[(red_idx, 0, 1, np.zeros((2, C), dtype=dtype), operand)], **desc)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [1, 16, 19, 32])
@pytest.mark.parametrize("seed", range(3))
def test_taps_and_unstored_steps(dtype, batch, seed):
    """Taps hand out row ranges of chosen steps (and of the input) as (d, K, B) arrays (feature-major),
    bitwise what the run stores in ``vectors``; a step with ``out = -1`` leaves its columns untouched and
    changes nothing else."""
    rng, desc, sources, vectors, full, order = _run_and_order(1000 + 10 * seed + batch, (2, 14), batch, dtype)
    steps = order.size
    # the second in no particular order and with the run's input (step -1)
    groups = [np.sort(order[: steps // 2]), np.append(order[steps // 2:], -1)[rng.permutation(steps - steps // 2 + 1)]]
    sizes = np.append(desc["rows"], desc["cols"][0])  # rows of each step's vector, then the input's
    taps = []
    for idx in groups:
        if idx.size == 0:
            continue
        mmin = int(sizes[idx].min())
        row0 = int(rng.integers(0, mmin))
        nrows = int(rng.integers(1, mmin - row0 + 1))
        taps.append((idx, row0, nrows, np.full((nrows, idx.size, batch), np.nan, dtype=dtype)))
    skip = rng.random(steps) < 0.5
    d2 = dict(desc, out=np.where(skip, -1, desc["out"]).astype(np.int64))
    got = vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=got, taps=taps, **d2)
    for idx, row0, nrows, buf in taps:
        for k, j in enumerate(idx):
            o = int(desc["out"][j]) if j >= 0 else desc["vin0"]
            assert np.array_equal(buf[:, k].T, full[:, o + row0:o + row0 + nrows]), (j, row0, nrows)
    for j in range(steps):
        o, m = int(desc["out"][j]), int(desc["rows"][j])
        want = vectors[:, o:o + m] if skip[j] else full[:, o:o + m]
        assert np.array_equal(got[:, o:o + m], want), j
    with pytest.raises(ValueError, match="tapped at most once"):
        cpu_chain.run_chain(sources=sources, vectors=vectors.copy(),
                            taps=[(np.array([0, 0]), 0, 1, np.zeros((1, 2, batch), dtype=dtype))], **desc)
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu_chain.run_chain(sources=sources, vectors=vectors.copy(),
                            taps=[(np.array([0]), 0, 1, np.zeros((1, 1, batch + 1), dtype=dtype))], **desc)
    with pytest.raises(ValueError, match="within"):
        m0 = int(desc["rows"][0])
        cpu_chain.run_chain(sources=sources, vectors=vectors.copy(),
                            taps=[(np.array([0]), m0, 1, np.zeros((1, 1, batch), dtype=dtype))], **desc)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [1, 16, 19, 32])
@pytest.mark.parametrize("seed", range(3))
def test_feeds_equal_affine_terms_in_the_vectors(dtype, batch, seed):
    """Terms read where the caller holds them (feature-major, sample-major, any strides) give bitwise the
    run with the same terms as affine columns of ``vectors`` (zero outside the fed rows)."""
    rng = np.random.default_rng(2000 + 10 * seed + batch)
    desc, sources, vectors, _ = _random_run(rng, int(rng.integers(3, 14)), batch, dtype)
    free = np.flatnonzero(desc["add"] < 0)  # steps without an affine term of their own
    rng.shuffle(free)
    wide = free[desc["rows"][free] >= LANES]  # sample-major terms of wide steps: the register transposes
    rest = free[desc["rows"][free] < LANES]
    halves = np.array_split(rest, 2)
    groups = [g for g in (halves[0], wide, halves[1]) if g.size]
    extra_cols = []
    add2 = desc["add"].copy()
    width = vectors.shape[1]
    feeds = []
    for layout, idx in zip(("feature", "sample", "strided") if wide.size else ("feature", "strided"), groups):
        m = int(desc["rows"][idx].min())
        row0 = int(rng.integers(0, m))
        nrows = int(rng.integers(1, m - row0 + 1))
        if layout == "sample":  # whole rows: wide ones go through the register transposes
            row0, nrows = 0, m
        K = idx.size
        terms = rng.standard_normal((K, batch, nrows)).astype(dtype)
        if layout == "feature":  # (rows, K, B) memory
            mem = np.ascontiguousarray(terms.transpose(2, 0, 1)).reshape(-1)
            at, bs, fs = np.arange(K) * batch, 1, K * batch
        elif layout == "sample":  # (K, B, rows) memory
            mem = terms.reshape(-1).copy()
            at, bs, fs = np.arange(K) * batch * nrows, nrows, 1
        else:  # (B, rows, K) memory, with a gap: no unit stride
            mem = np.zeros(batch * nrows * K * 2 + 5, dtype=dtype)
            view = mem[5:5 + batch * nrows * K * 2].reshape(batch, nrows, K, 2)[..., 0]
            view[:] = terms.transpose(1, 2, 0)
            at, bs, fs = 5 + np.arange(K) * 2, nrows * K * 2, K * 2
        feeds.append((idx, row0, nrows, mem, at.astype(np.int64), bs, fs))
        for k, j in enumerate(idx):  # the same terms as affine columns, zero outside the fed rows
            col = np.zeros((batch, int(desc["rows"][j])), dtype=dtype)
            col[:, row0:row0 + nrows] = terms[k]
            extra_cols.append(col)
            add2[j] = width
            width += col.shape[1]
    want_vec = np.concatenate([vectors] + extra_cols, axis=1) if extra_cols else vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=want_vec, **dict(desc, add=add2))
    got = np.concatenate([vectors] + [np.zeros_like(c) for c in extra_cols], axis=1) if extra_cols else vectors.copy()
    cpu_chain.run_chain(sources=sources, vectors=got, feeds=feeds, **desc)
    assert np.array_equal(got[:, :vectors.shape[1]], want_vec[:, :vectors.shape[1]])
    # with a memo: the same feeds' tables are kept (same result), the buffers still checked every call
    memo = {}
    for _ in range(2):
        again = np.concatenate([vectors] + [np.zeros_like(c) for c in extra_cols], axis=1) if extra_cols \
            else vectors.copy()
        cpu_chain.run_chain(sources=sources, vectors=again, feeds=feeds, memo=memo, **desc)
        assert np.array_equal(again, got)
    if groups:
        idx, row0, nrows, mem, at, bs, fs = feeds[0]
        assert any(isinstance(k, tuple) and k[0] == "feeds" for k in memo)
        with pytest.raises(ValueError, match="past their buffer"):
            cpu_chain.run_chain(sources=sources, vectors=vectors.copy(),
                                feeds=[(idx, row0, nrows, mem[:-1], at, bs, fs)] + feeds[1:], memo=memo, **desc)
        with pytest.raises(ValueError, match="past their buffer"):
            cpu_chain.run_chain(sources=sources, vectors=vectors.copy(),
                                feeds=[(idx, row0, nrows, mem[:-1], at, bs, fs)], **desc)
        with pytest.raises(ValueError, match="at most once"):
            cpu_chain.run_chain(sources=sources, vectors=vectors.copy(),
                                feeds=[feeds[0], (idx[:1], row0, nrows, mem, at[:1], bs, fs)], **desc)


def test_shared_column_blocks_are_used_and_exact():
    """Rows sharing one column list (read once per column for four rows) give the plain row sums."""
    rng = np.random.default_rng(7)
    k, m, batch = 37, 23, 16
    mask = np.zeros((m, k), dtype=bool)
    mask[:20] = rng.random(k) < 0.7  # 20 identical rows: five blocks of four
    mask[20:] = rng.random((3, k)) < 0.5
    pat = sp.csr_array(mask.astype(np.float64))
    vals = rng.standard_normal(pat.nnz)
    vectors = rng.standard_normal((batch, k + m))
    i64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    desc = dict(code=i64([3]), src=i64([0]), offset=i64([0]), bstride=i64([0]), rows=i64([m]), cols=i64([k]),
                add=i64([-1]), out=i64([k]), vin0=0, csr_ptr=i64([0]), csr_indptr=pat.indptr.astype(np.int64),
                csr_indices=pat.indices.astype(np.int64))
    got = vectors.copy()
    cpu_chain.run_chain(sources=[vals], vectors=got, **desc)
    want = np.zeros((batch, m))
    for b in range(batch):  # summed in stored order, as the kernel does
        for i in range(m):
            acc = 0.0
            for p in range(pat.indptr[i], pat.indptr[i + 1]):
                acc = acc + vals[p] * vectors[b, pat.indices[p]]
            want[b, i] = acc
    assert np.array_equal(got[:, k:], want)


def _grid_of_diagonals(rng, H: int, blocks_r: int, blocks_c: int) -> sp.csr_array:
    """A ``(blocks_r H, blocks_c H)`` pattern of diagonal ``H x H`` blocks, one to three per block row (the
    LSTM gate element is 5 x 2 of them), with a block row that is not a band mixed in."""
    mask = np.zeros((blocks_r * H, blocks_c * H), dtype=bool)
    for r in range(blocks_r):
        for c in rng.choice(blocks_c, size=int(rng.integers(1, min(3, blocks_c) + 1)), replace=False):
            mask[r * H:(r + 1) * H, c * H:(c + 1) * H] |= np.eye(H, dtype=bool)
    if blocks_r > 2:
        mask[H:2 * H] = rng.random((H, blocks_c * H)) < 0.2
    return sp.csr_array(mask.astype(np.float64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [1, 16, 21])
def test_diagonal_bands_and_eight_row_blocks_are_exact(dtype, batch):
    """Banded rows (shared and per-sample, sample-major and entry-major values) and rows summed eight at a
    time (shared dense, shared CSR with one column list) give the plain row sums in stored order, bitwise."""
    rng = np.random.default_rng(batch)
    H = 7
    gate = _grid_of_diagonals(rng, H, 5, 2)  # per sample, (5H, 2H)
    wide = np.zeros((2 * H, 5 * H), dtype=bool)  # shared, (2H, 5H): a block of 2H rows with one column list
    wide[:] = rng.random(5 * H) < 0.8
    wide = sp.csr_array(wide.astype(np.float64))
    eye = sp.csr_array(np.eye(2 * H)[:, :2 * H])  # shared, one band of single entries
    assert cpu_chain.diagonal_bands(gate.indptr, gate.indices)[0] == H
    pats = [gate, wide, eye]
    base = np.cumsum([0] + [p.nnz for p in pats])
    starts = np.cumsum([0] + [p.shape[0] + 1 for p in pats])
    indptr = np.concatenate([p.indptr.astype(np.int64) + b for p, b in zip(pats, base)])
    indices = np.concatenate([p.indices.astype(np.int64) for p in pats])
    dense_w = rng.standard_normal((2 * H) * (2 * H))  # shared dense (2H, 2H): one 8-row block and more
    shared = np.concatenate([rng.standard_normal(wide.nnz), rng.standard_normal(eye.nnz), dense_w]).astype(dtype)
    per = rng.standard_normal((batch, gate.nnz)).astype(dtype)
    # steps: gate (per sample, CSR) -> wide (shared CSR) -> eye (shared CSR) -> dense (shared)
    i64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    D = 2 * H
    desc = dict(code=i64([4, 3, 3, 1]), src=i64([1, 0, 0, 0]), offset=i64([0, 0, wide.nnz, wide.nnz + eye.nnz]),
                bstride=i64([gate.nnz, 0, 0, 0]), rows=i64([5 * H, D, D, D]), cols=i64([D, 5 * H, D, D]),
                add=i64([-1, -1, -1, -1]), out=i64([D, 7 * H, 9 * H, 11 * H]), vin0=0,
                csr_ptr=i64([starts[0], starts[1], starts[2], -1]), csr_indptr=indptr, csr_indices=indices)
    vectors = rng.standard_normal((batch, 13 * H)).astype(dtype)
    got = vectors.copy()
    cpu_chain.run_chain(sources=[shared, per.reshape(-1)], vectors=got, **desc)
    em_desc, em_sources = _entry_major(desc, [shared, per.reshape(-1)], batch)
    got_em = vectors.copy()
    cpu_chain.run_chain(sources=em_sources, vectors=got_em, **em_desc)
    assert np.array_equal(got_em, got)

    def rows_in_order(pat, vals, y):  # sums in stored order, in the run's dtype
        out = np.zeros(pat.shape[0], dtype=dtype)
        for i in range(pat.shape[0]):
            acc = dtype(0)
            for p in range(pat.indptr[i], pat.indptr[i + 1]):
                acc = dtype(acc + dtype(vals[p] * y[pat.indices[p]]))
            out[i] = acc
        return out

    dense = sp.csr_array(np.ones((D, D)))
    for b in range(batch):
        y = vectors[b, :D]
        y = rows_in_order(gate, per[b], y)
        assert np.array_equal(got[b, D:7 * H], y)
        y = rows_in_order(wide, shared[:wide.nnz], y)
        assert np.array_equal(got[b, 7 * H:9 * H], y)
        y = rows_in_order(eye, shared[wide.nnz:wide.nnz + eye.nnz], y)
        assert np.array_equal(got[b, 9 * H:11 * H], y)
        y = rows_in_order(dense, shared[wide.nnz + eye.nnz:], y)
        assert np.array_equal(got[b, 11 * H:13 * H], y)


def test_vector_operations_compile_to_no_calls():
    """Every vector operation is inline arithmetic and memory access: no calls (a cast of the register
    transposes' array arguments once lowered to two calls of numba's np.take per transpose, ~7x the
    transpose's own cost)."""
    numba = pytest.importorskip("numba")
    from spscan.kernels.cpu import simd as cpu_simd

    ops = cpu_simd.intrinsics()
    vtranspose, vtranspose_add = ops["vtranspose"], ops["vtranspose_add"]
    vload, vstore, vstream, vzero = ops["vload"], ops["vstore"], ops["vstream"], ops["vzero"]
    vmuladd, vmuladdv, vscale = ops["vmuladd"], ops["vmuladdv"], ops["vscale"]
    prefetch, prefetch_read = ops["prefetch"], ops["prefetch_read"]

    @numba.njit
    def both(src, dst, n):
        for i in range(n):
            vtranspose(src, i, 16, dst, 512, 16)
            vtranspose_add(src, i, 16, dst, 1024, 16)
            x = vmuladd(vzero(src), src[i], vload(src, i))
            vstore(dst, i, vmuladdv(x, x, vscale(src[0], x)))
            vstream(dst, 64, x)
            prefetch(dst, i + 256)
            prefetch_read(src, i + 256)

    src, dst = np.zeros(2048, np.float32), np.zeros(4096, np.float32)
    both(src, dst, 1)
    asm = both.inspect_asm(both.signatures[0])
    assert "take" not in asm and "NRT_incref" not in asm


def test_get_reads_table_indices_without_wraparound():
    """``get(a, i)`` equals ``a[i]`` and, unlike indexing, emits no negative-index wraparound for an index
    read from a table (a CSR row's columns): numba adds ``len(a)`` to a possibly negative index, four
    integer instructions per load in the kernels' innermost loops."""
    numba = pytest.importorskip("numba")
    from spscan.kernels.cpu import simd as cpu_simd

    get = cpu_simd.intrinsics()["get"]

    @numba.njit
    def gathered(s, idx):
        acc = 0.0
        for i in range(idx.shape[0]):
            acc += get(s, get(idx, i) + 1)
        return acc

    @numba.njit
    def indexed(s, idx):
        acc = 0.0
        for i in range(idx.shape[0]):
            acc += s[idx[i] + 1]
        return acc

    rng = np.random.default_rng(3)
    s = rng.standard_normal(50)
    idx = rng.integers(0, 49, 40).astype(np.int64)
    assert gathered(s, idx) == indexed(s, idx) == sum(s[i + 1] for i in idx)
    # the wraparound's sign test and select (sar/and or cmp/cmov, as the compiler picks) per load
    size = [sum(line.startswith("\t") and not line.startswith("\t.") for line in
                f.inspect_asm(f.signatures[0]).splitlines()) for f in (gathered, indexed)]
    assert size[0] < size[1], size
    with pytest.raises((TypeError, numba.core.errors.TypingError), match="integer index"):
        numba.njit(lambda s: get(s, 1.5))(s)


def test_diagonal_bands_equal_a_row_by_row_check():
    """The band lengths (worked out once per run from the CSR tables) against a direct walk over the rows,
    on concatenated random patterns with bands, empty rows and repeated rows."""
    rng = np.random.default_rng(12)
    for _ in range(30):
        count = int(rng.integers(1, 4))
        pats = [_pattern(rng, int(rng.integers(1, 12)), int(rng.integers(1, 9))) for _ in range(count)]
        if rng.random() < 0.5:
            pats.append(_grid_of_diagonals(rng, int(rng.integers(1, 5)), 3, 2))
        base = np.cumsum([0] + [p.nnz for p in pats])
        indptr = np.concatenate([p.indptr.astype(np.int64) + b for p, b in zip(pats, base)])
        indices = np.concatenate([p.indices.astype(np.int64) for p in pats])
        got = cpu_chain.diagonal_bands(indptr, indices)
        R = indptr.shape[0] - 1
        row = [indices[indptr[r]:indptr[r + 1]] for r in range(R)]
        want = np.zeros(R + 1, dtype=np.int64)
        for r in range(R):
            if row[r].size == 0:
                continue
            d = 1
            while r + d < R and row[r + d].size == row[r].size and np.array_equal(row[r + d], row[r] + d):
                d += 1
            want[r] = d
        assert np.array_equal(got, want)


def test_simd_intrinsics_against_numpy():
    numba = pytest.importorskip("numba")
    from spscan.kernels.cpu import simd as cpu_simd

    ops = cpu_simd.intrinsics()
    vload, vstore, vzero = ops["vload"], ops["vstore"], ops["vzero"]
    vmuladd, vmuladdv, vmul, vscale, vadd = ops["vmuladd"], ops["vmuladdv"], ops["vmul"], ops["vscale"], ops["vadd"]
    vtranspose, vtranspose_add, prefetch = ops["vtranspose"], ops["vtranspose_add"], ops["prefetch"]
    vstream, prefetch_read = ops["vstream"], ops["prefetch_read"]

    @numba.njit
    def stream(a, out, i):
        prefetch_read(a, 0)
        vstream(out, i, vload(a, 0))

    @numba.njit
    def arith(a, b, out, w):
        x = vload(a, 3)
        y = vload(b, 5)
        vstore(out, 0, vmuladd(vzero(a), w, x))
        vstore(out, 16, vmuladdv(x, x, y))
        vstore(out, 32, vadd(vmul(x, y), vscale(w, y)))
        prefetch(out, 40)

    @numba.njit
    def transpose(src, sb, ss, dst, db, ds, accumulate):
        if accumulate:
            vtranspose_add(src, sb, ss, dst, db, ds)
        else:
            vtranspose(src, sb, ss, dst, db, ds)

    for dt in (np.float32, np.float64):
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal(40).astype(dt), rng.standard_normal(40).astype(dt)
        out = np.zeros(48, dtype=dt)
        w = dt(0.75)
        arith(a, b, out, w)
        x, y = a[3:19], b[5:21]
        assert np.array_equal(out[:16], dt(0) + w * x)
        assert np.array_equal(out[16:32], x + x * y)
        assert np.array_equal(out[32:48], x * y + w * y)
        for at in (0, LANES, 3):  # aligned (a non-temporal store) and not (a plain one)
            o2 = np.zeros(4 * LANES, dtype=dt)
            stream(a, o2, at)
            assert np.array_equal(o2[at:at + LANES], a[:LANES]) and not o2[:at].any() and not o2[at + LANES:].any()
        src = rng.standard_normal(40 * 37).astype(dt)
        dst = rng.standard_normal(30 * 41).astype(dt)
        block = np.stack([src[5 + r * 37:5 + r * 37 + LANES] for r in range(LANES)])
        for accumulate in (False, True):
            d = dst.copy()
            transpose(src, 5, 37, d, 7, 41, accumulate)
            want = dst.copy()
            for c in range(LANES):
                want[7 + c * 41:7 + c * 41 + LANES] = block[:, c] + (dst[7 + c * 41:7 + c * 41 + LANES] if accumulate else 0)
            assert np.array_equal(d, want), (dt, accumulate)
    with pytest.raises(Exception, match="1-D C-contiguous"):
        numba.njit(lambda a: vload(a, 0))(np.zeros((4, 4)))


def test_shared_column_blocks_equal_a_row_by_row_check():
    """The block flags (worked out once per run from the CSR tables) against a direct comparison of
    four consecutive rows, on concatenated random patterns with empty rows and repeated rows."""
    rng = np.random.default_rng(11)
    for _ in range(20):
        pats = [_pattern(rng, int(rng.integers(1, 12)), int(rng.integers(1, 9))) for _ in range(int(rng.integers(1, 4)))]
        base = np.cumsum([0] + [p.nnz for p in pats])
        indptr = np.concatenate([p.indptr.astype(np.int64) + b for p, b in zip(pats, base)])
        indices = np.concatenate([p.indices.astype(np.int64) for p in pats])
        got = cpu_chain.shared_column_blocks(indptr, indices)
        want = np.zeros(indptr.shape[0], dtype=bool)
        for r in range(indptr.shape[0] - 4):
            rows = [indices[indptr[r + d]:indptr[r + d + 1]] for d in range(4)]
            want[r] = rows[0].size > 0 and all(np.array_equal(rows[0], x) for x in rows[1:])
        assert np.array_equal(got, want)


@pytest.mark.parametrize("H", [1, 5, 20])
@pytest.mark.parametrize("batch", [3, 16, 21])
@pytest.mark.parametrize("entry_major", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lstm_gate_code_equals_its_csr_values(H, batch, entry_major, dtype):
    """Code 5 (the LSTM gate element from its 6H compact numbers) against the same run with the gate
    steps as per-sample CSR over the expanded 9H values (code 4) and a float64 loop: gate steps
    alternating with shared dense (2H x 5H) steps, the numbers stored sample-major (copied per tile)
    or entry-major (read in place where the tile is full), full and partial tiles, a tap on every
    gate step's output."""
    import torch

    from spscan.recurrent.cells import lstm_gate_encoding, lstm_gate_pattern

    rng = np.random.default_rng(H * 100 + batch)
    T = 5
    enc = lstm_gate_encoding(H)
    pat = lstm_gate_pattern(H)
    compact = rng.standard_normal((T, batch, 6 * H))
    csr = enc.expand(torch.from_numpy(compact)).numpy()  # (T, B, 9H)
    weights = rng.standard_normal((T, 2 * H, 5 * H)) * 0.5
    steps = 2 * T
    rows = np.array([5 * H, 2 * H] * T, dtype=np.int64)
    cols = np.array([2 * H, 5 * H] * T, dtype=np.int64)
    vin0, size_v = 0, 2 * H + sum(int(r) for r in rows)
    out = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64) + 2 * H
    add = np.full(steps, -1, dtype=np.int64)
    shared = np.concatenate([weights.reshape(-1), [0.0]]).astype(dtype)
    x0 = rng.standard_normal((batch, 2 * H))
    results = {}
    for form in ("compact", "csr"):
        vals = compact if form == "compact" else csr
        width = vals.shape[2]
        if entry_major:  # (T, width, B) memory
            store = np.ascontiguousarray(vals.transpose(0, 2, 1)).astype(dtype).reshape(-1)
            bst, est = 1, batch
            offs = [t * width * batch for t in range(T)]
        else:
            store = np.ascontiguousarray(vals).astype(dtype).reshape(-1)
            bst, est = width, 1
            offs = [t * batch * width for t in range(T)]
        code = np.array([5 if form == "compact" else 4, 1] * T, dtype=np.int64)
        src = np.array([1, 0] * T, dtype=np.int64)
        offset = np.array([v for t in range(T) for v in (offs[t], t * 10 * H * H)], dtype=np.int64)
        bstride = np.array([bst, 0] * T, dtype=np.int64)
        estride = np.array([est, 1] * T, dtype=np.int64)
        indptr, indices = pat.indptr.astype(np.int64), pat.indices.astype(np.int64)
        csr_ptr = np.zeros(steps, dtype=np.int64)
        vectors = np.zeros((batch, size_v), dtype=dtype)
        vectors[:, :2 * H] = x0
        tap = np.zeros((5 * H, T, batch), dtype=dtype)
        cpu_chain.run_chain(code, src, offset, bstride, rows, cols, add, out, vin0, [shared, store], vectors,
                            csr_ptr, indptr, indices, estride=estride,
                            taps=[(np.arange(0, steps, 2, dtype=np.int64), 0, 5 * H, tap)])
        results[form] = (vectors, tap)
    # float64 reference: y_{j} = M_j y_{j-1}
    y = x0.copy()
    want = []
    for t in range(T):
        dense = np.zeros((batch, 5 * H, 2 * H))
        for b in range(batch):
            dense[b] = sp.csr_array((csr[t, b], pat.indices, pat.indptr), shape=pat.shape).toarray()
        y = np.einsum("bij,bj->bi", dense, y)
        want.append(y)
        y = y @ weights[t].T
        want.append(y)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    for form, (vectors, tap) in results.items():
        for j in range(steps):
            got = vectors[:, out[j]:out[j] + rows[j]].astype(np.float64)
            scale = np.abs(want[j]).max() + 1e-300
            assert np.abs(got - want[j]).max() <= tol * scale, (form, j)
        for t in range(T):
            np.testing.assert_array_equal(tap[:, t].T, vectors[:, out[2 * t]:out[2 * t] + 5 * H])


def test_lstm_gate_code_refuses_other_shapes():
    """A code 5 step must map 2H to 5H."""
    rows = np.array([10], dtype=np.int64)
    cols = np.array([5], dtype=np.int64)
    z = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="code 5"):
        cpu_chain.run_chain(np.array([5], dtype=np.int64), z, z, z, rows, cols, np.array([-1]), np.array([5]), 0,
                            [np.zeros(64)], np.zeros((2, 20)))


def test_run_chain_memo_skips_only_unchanged_checks():
    """``memo``: a second call with the very same table arrays skips their checks and gives the same
    result; new arrays are checked again (a bad one raises), and tap buffers are checked every call."""
    rng = np.random.default_rng(5)
    H, batch, T = 3, 16, 4
    rows = np.array([2 * H] * T, dtype=np.int64)
    cols = rows.copy()
    out = (np.arange(T, dtype=np.int64) + 1) * 2 * H
    add = np.full(T, -1, dtype=np.int64)
    code = np.ones(T, dtype=np.int64)
    src = np.zeros(T, dtype=np.int64)
    offset = np.arange(T, dtype=np.int64) * 4 * H * H
    bstride = np.zeros(T, dtype=np.int64)
    values = rng.standard_normal(T * 4 * H * H)
    x = rng.standard_normal((batch, 2 * H * (T + 1)))
    steps = np.arange(T, dtype=np.int64)
    memo: dict = {}
    results = []
    for _ in range(3):
        v = x.copy()
        tap = np.zeros((2 * H, T, batch))
        cpu_chain.run_chain(code, src, offset, bstride, rows, cols, add, out, 0, [values], v,
                            taps=[(steps, 0, 2 * H, tap)], memo=memo)
        results.append((v, tap))
    assert "tables" in memo
    for v, tap in results[1:]:
        np.testing.assert_array_equal(v, results[0][0])
        np.testing.assert_array_equal(tap, results[0][1])
    for _ in range(40):  # new step arrays every call: the memo stays bounded
        cpu_chain.run_chain(code, src, offset, bstride, rows, cols, add, out, 0, [values], x.copy(),
                            taps=[(steps.copy(), 0, 2 * H, np.zeros((2 * H, T, batch)))], memo=memo)
    assert len(memo) <= 18 and "tables" in memo
    with pytest.raises(ValueError, match="taps\\[0\\]"):  # a wrong buffer, on a memo hit
        cpu_chain.run_chain(code, src, offset, bstride, rows, cols, add, out, 0, [values], x.copy(),
                            taps=[(steps, 0, 2 * H, np.zeros((2 * H, T + 1, batch)))], memo=memo)
    with pytest.raises(ValueError, match="offset"):  # a new, bad array is checked
        cpu_chain.run_chain(code, src, offset[:-1], bstride, rows, cols, add, out, 0, [values], x.copy(), memo=memo)
    with pytest.raises(ValueError, match="code"):
        cpu_chain.run_chain(code + 7, src, offset, bstride, rows, cols, add, out, 0, [values], x.copy(), memo=memo)
