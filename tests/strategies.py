"""Hypothesis strategies for canonical CSR patterns and chains."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from hypothesis import strategies as st


@st.composite
def pattern(draw, rows: int, cols: int):
    """A canonical pattern: empty, diagonal, dense or random (empty rows/columns allowed)."""
    kind = draw(st.sampled_from(["random", "random", "dense", "diag", "empty_rows", "empty"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if kind == "dense":
        mask = np.ones((rows, cols), dtype=bool)
    elif kind == "diag":
        mask = np.eye(rows, cols, dtype=bool)
    elif kind == "empty":
        mask = np.zeros((rows, cols), dtype=bool)
    else:
        density = draw(st.sampled_from([0.05, 0.2, 0.5, 0.9]))
        mask = rng.random((rows, cols)) < density
        if kind == "empty_rows":
            mask[rng.random(rows) < 0.5] = False
    return sp.csr_array(mask.astype(np.float64))


@st.composite
def chain(draw, max_n: int = 12, max_dim: int = 7):
    n = draw(st.integers(1, max_n))
    dims = draw(st.lists(st.integers(1, max_dim), min_size=n + 1, max_size=n + 1))
    return [draw(pattern(dims[i], dims[i + 1])) for i in range(n)]
