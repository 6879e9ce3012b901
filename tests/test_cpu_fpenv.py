"""Subnormals flushed to zero inside the compiled CPU loops (kernels/cpu/fpenv.py): the flags are set only
while a loop runs, and a decaying run gives zeros where gradual underflow would give subnormals, the
normal values unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from spscan.kernels.cpu import chain as cpu_chain

from spscan.kernels.cpu import fpenv as cpu_fpenv

pytestmark = pytest.mark.skipif(not cpu_fpenv.supported(), reason="needs x86-64 and numba")

TINY32 = np.finfo(np.float32).tiny  # smallest normal float32, 1.18e-38


def _subnormal_product() -> np.float32:
    return np.float32(1e-30) * np.float32(1e-10)  # 1e-40: subnormal under gradual underflow


def test_flags_are_set_inside_and_restored_after():
    before = _subnormal_product()
    assert 0 < before < TINY32
    with cpu_fpenv.flushing_subnormals():
        assert _subnormal_product() == 0
        with cpu_fpenv.flushing_subnormals():  # nested: the inner exit keeps the outer's flags
            pass
        assert _subnormal_product() == 0
    assert _subnormal_product() == before
    with pytest.raises(RuntimeError):  # restored on an exception too
        with cpu_fpenv.flushing_subnormals():
            raise RuntimeError("body failed")
    assert _subnormal_product() == before


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_decaying_run_flushes_only_what_underflows(dtype, batch):
    """A run of shared diagonals scaling by 1e-4: the values fall through the subnormal range. Normal
    results are those of the float64 product; a result below the smallest normal number is 0."""
    m, steps = 5, 12 if dtype == np.float32 else 80
    rng = np.random.default_rng(0)
    scale = rng.uniform(0.5e-4, 2e-4, size=(steps, m))
    vin0 = 0
    outs = vin0 + m + np.arange(steps, dtype=np.int64) * m
    vectors = np.zeros((batch, vin0 + m * (steps + 1)), dtype=dtype)
    vectors[:, :m] = rng.uniform(0.5, 2.0, size=(batch, m))
    y0 = vectors[:, :m].astype(np.float64)
    ones = np.ones(steps, dtype=np.int64)
    cpu_chain.run_chain(code=np.zeros(steps, dtype=np.int64), src=np.zeros(steps, dtype=np.int64),
                        offset=np.arange(steps, dtype=np.int64) * m, bstride=np.zeros(steps, dtype=np.int64),
                        rows=ones * m, cols=ones * m, add=-ones, out=outs, vin0=vin0,
                        sources=[scale.reshape(-1).astype(dtype)], vectors=vectors)
    tiny = np.finfo(dtype).tiny
    y = y0
    saw_flushed = saw_normal = False
    for j in range(steps):
        y = y * scale[j].astype(dtype).astype(np.float64)
        got = vectors[:, outs[j]:outs[j] + m]
        normal = np.abs(y) >= tiny * 1.01
        flushed = np.abs(y) < tiny * 0.99
        np.testing.assert_allclose(got[normal], y[normal], rtol=1e-5 if dtype == np.float32 else 1e-12)
        assert np.all(got[flushed] == 0)
        saw_flushed |= bool(flushed.any())
        saw_normal |= bool(normal.any())
    assert saw_flushed and saw_normal
    assert 0 < _subnormal_product() < TINY32  # the caller's flags are back
