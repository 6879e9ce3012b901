"""Compiled CPU loop for a linear run (the linear-scan middle): the whole run in one call.

For steps ``j = 0 .. steps-1``::

    y_{-1} = vectors[:, vin0 : vin0 + cols[0]]
    y_j    = M_j y_{j-1}  (+ vectors[:, add[j] : add[j] + rows[j]]  if add[j] >= 0)
    vectors[:, out[j] : out[j] + rows[j]] = y_j

``M_j`` is diagonal (``code 0``: ``rows[j]`` values), dense (``code 1`` shared / ``2`` per sample:
a row-major ``(rows[j], cols[j])`` block) or CSR (``code 3`` shared / ``4`` per sample: ``nnz``
values in the order of its pattern, whose row starts are ``csr_indptr[csr_ptr[j] : csr_ptr[j] +
rows[j] + 1]`` and whose columns are ``csr_indices[csr_indptr[...]]``; the indptr entries are global
positions in ``csr_indices``, so a pattern shared by many steps is stored once). Its values for
sample ``b`` start at element ``offset[j] + b * bstride[j]`` of ``sources[src[j]]`` (``bstride 0``:
shared by the batch); entry ``p`` of a CSR step is at that start plus ``p - csr_indptr[csr_ptr[j]]``.

Why numba: the run is thousands of tiny dependent mat-vecs (the paper's RNN: 20x20, B = 16), so
NumPy's and torch's per-call overhead, not arithmetic, bounds it (~2 us per step against ~0.3 us
of work). A compiled loop over the whole run removes that overhead. ``numba`` (``@njit(cache=True)``)
compiles on first use, caches the machine code on disk, needs no compiler at install time (a torch
C++ extension would) and no tracing per chain length (``torch.compile`` would specialize or guard
on the step count). No ``fastmath`` and no ``parallel``: every output is summed in ascending inner
index (dense: column; CSR: stored position), so results are bitwise reproducible run to run. The
values of a step are read where they lie (arena or the caller's tensor), nothing is copied. A CSR
step costs O(nnz * B) multiply-adds, never O(rows * cols). Without numba the NumPy loop in
:mod:`spscan.kernels.torch_ops` runs instead (:func:`available`).

Loop order: the running vector is kept feature-major (``(k, B)``), so a shared dense or CSR step
is, per stored entry, a scalar-times-vector update over the batch (vectorizable without reordering
any sum); a per-sample dense step is a dot product per sample and row, and a per-sample CSR step
the same entry-outer update, its values first copied entry-major (``(nnz, B)``, read sample by
sample) so that both operands of the loop over the batch are contiguous. With at most
``CSR_SAMPLE_OUTER_MAX_BATCH`` samples a CSR step is a dot product per sample and row instead
(the same sums in the same order).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np

__all__ = ["available", "numba_module", "run_chain", "resolve_steps"]

_numba = None  # the numba module once imported; False if it is not installed


def _load():
    """Import numba on first use (it takes a while to import and most plans never need it)."""
    global _numba
    if _numba is None:
        try:
            import numba
        except ImportError:  # the NumPy loop is the fallback
            _numba = False
        else:
            _numba = numba
    return _numba


def available() -> bool:
    """Whether the compiled loop can run (numba importable)."""
    return bool(_load())


def numba_module():
    """The numba module (imported once, on first use), for the other compiled CPU kernels."""
    mod = _load()
    if not mod:
        raise RuntimeError("spscan's compiled CPU kernels need numba (pip install numba)")
    return mod


# Up to this batch a CSR step loops over samples outside its entries (measured on a 512x1024 conv
# pattern, 62k entries, one core: 40 us per sample that way vs 175 us flat for the entry-outer loop
# up to 16 samples, whose inner loop over the batch vectorizes).
CSR_SAMPLE_OUTER_MAX_BATCH = 4


def _chain_kernel(code, src, offset, bstride, rows, cols, add, out, vin0, sources, vectors, cur, nxt,
                  csr_ptr, csr_indptr, csr_indices, tv):  # pragma: no cover - compiled
    batch = vectors.shape[0]
    for kk in range(cols[0]):
        for b in range(batch):
            cur[kk, b] = vectors[b, vin0 + kk]
    for j in range(code.shape[0]):
        m = rows[j]
        k = cols[j]
        s = sources[src[j]]
        o = offset[j]
        bs = bstride[j]
        cj = code[j]
        if cj == 0:
            for i in range(m):
                for b in range(batch):
                    nxt[i, b] = s[o + b * bs + i] * cur[i, b]
        elif cj >= 3 and batch <= CSR_SAMPLE_OUTER_MAX_BATCH:
            # CSR, few samples: a scalar accumulator per output (a per-entry loop over 1-4 samples
            # costs more than the product); the same sum as below, entry by entry in stored order
            cp = csr_ptr[j]
            o -= csr_indptr[cp]  # value of global entry p: s[o + p + b * bs]
            for b in range(batch):
                ob = o + b * bs
                for i in range(m):
                    nxt[i, b] = 0
                    acc = nxt[i, b]  # zero of the vectors' dtype
                    for p in range(csr_indptr[cp + i], csr_indptr[cp + i + 1]):
                        acc += s[ob + p] * cur[csr_indices[p], b]
                    nxt[i, b] = acc
        elif cj >= 3:  # CSR: entries of row i in ascending stored order, each over the batch
            cp = csr_ptr[j]
            g0 = csr_indptr[cp]  # global position of the step's first entry
            if bs == 0:
                o -= g0  # value of global entry p: s[o + p]
                for i in range(m):
                    for b in range(batch):
                        nxt[i, b] = 0
                    p = csr_indptr[cp + i]
                    end = csr_indptr[cp + i + 1]
                    while p + 4 <= end:  # four entries per pass over the batch, added in stored order
                        w0, w1, w2, w3 = s[o + p], s[o + p + 1], s[o + p + 2], s[o + p + 3]
                        c0, c1, c2, c3 = csr_indices[p], csr_indices[p + 1], csr_indices[p + 2], csr_indices[p + 3]
                        for b in range(batch):
                            nxt[i, b] = (((nxt[i, b] + w0 * cur[c0, b]) + w1 * cur[c1, b]) + w2 * cur[c2, b]) \
                                + w3 * cur[c3, b]
                        p += 4
                    while p < end:
                        w = s[o + p]
                        c = csr_indices[p]
                        for b in range(batch):
                            nxt[i, b] += w * cur[c, b]
                        p += 1
            else:
                # per-sample values, read sample by sample (contiguous) into entry-major ``tv`` so the
                # loop over the batch below reads them contiguously too
                nnz = csr_indptr[cp + m] - g0
                for b in range(batch):
                    ob = o + b * bs
                    for q in range(nnz):
                        tv[q, b] = s[ob + q]
                for i in range(m):
                    for b in range(batch):
                        nxt[i, b] = 0
                    p = csr_indptr[cp + i]
                    end = csr_indptr[cp + i + 1]
                    while p + 4 <= end:
                        q = p - g0
                        c0, c1, c2, c3 = csr_indices[p], csr_indices[p + 1], csr_indices[p + 2], csr_indices[p + 3]
                        for b in range(batch):
                            nxt[i, b] = (((nxt[i, b] + tv[q, b] * cur[c0, b]) + tv[q + 1, b] * cur[c1, b])
                                         + tv[q + 2, b] * cur[c2, b]) + tv[q + 3, b] * cur[c3, b]
                        p += 4
                    while p < end:
                        c = csr_indices[p]
                        q = p - g0
                        for b in range(batch):
                            nxt[i, b] += tv[q, b] * cur[c, b]
                        p += 1
        elif bs == 0:
            for i in range(m):
                for b in range(batch):
                    nxt[i, b] = 0
                base = o + i * k
                kk = 0
                while kk + 4 <= k:  # four columns per pass over the batch, added in column order
                    w0, w1, w2, w3 = s[base + kk], s[base + kk + 1], s[base + kk + 2], s[base + kk + 3]
                    for b in range(batch):
                        nxt[i, b] = (((nxt[i, b] + w0 * cur[kk, b]) + w1 * cur[kk + 1, b]) + w2 * cur[kk + 2, b]) \
                            + w3 * cur[kk + 3, b]
                    kk += 4
                while kk < k:
                    w = s[base + kk]
                    for b in range(batch):
                        nxt[i, b] += w * cur[kk, b]
                    kk += 1
        else:
            for b in range(batch):
                base = o + b * bs
                for i in range(m):
                    nxt[i, b] = 0
                    for kk in range(k):
                        nxt[i, b] += s[base + i * k + kk] * cur[kk, b]
        a = add[j]
        if a >= 0:
            for i in range(m):
                for b in range(batch):
                    nxt[i, b] += vectors[b, a + i]
        oj = out[j]
        for b in range(batch):
            for i in range(m):
                vectors[b, oj + i] = nxt[i, b]
        cur, nxt = nxt, cur


_compiled = None


def _kernel():
    global _compiled
    if _compiled is None:
        _compiled = _load().njit(cache=True, nogil=True)(_chain_kernel)
    return _compiled


_NO_CSR = np.zeros(1, dtype=np.int64)


def run_chain(code: np.ndarray, src: np.ndarray, offset: np.ndarray, bstride: np.ndarray, rows: np.ndarray,
              cols: np.ndarray, add: np.ndarray, out: np.ndarray, vin0: int, sources: Sequence[np.ndarray],
              vectors: np.ndarray, csr_ptr: Optional[np.ndarray] = None, csr_indptr: Optional[np.ndarray] = None,
              csr_indices: Optional[np.ndarray] = None) -> None:
    """Run a whole linear run in place on ``vectors`` (see the module docstring for the math).

    Args:
        code, src, offset, bstride, rows, cols, add, out: ``(steps,)`` int64 arrays describing the
            steps (``code`` 0 diagonal, 1/2 dense, 3/4 CSR; ``add[j] = -1`` for no affine term).
        vin0: column of ``y_{-1}`` in ``vectors``.
        sources: 1-D C-contiguous arrays holding the matrices' values, of ``vectors``' dtype.
        vectors: ``(B, size_v)`` C-contiguous float32/float64 array, read and written in place.
        csr_ptr: ``(steps,)`` int64, where each CSR step's row starts begin in ``csr_indptr`` (any value
            for other steps); csr_indptr, csr_indices: the run's CSR tables (1-D int64, see
            :class:`~spscan.planner.program.LinearRun`). Needed only when a step is CSR.

    Raises ``RuntimeError`` without numba, ``TypeError``/``ValueError`` on mismatched arrays. Bounds
    are the caller's contract (the plan's offsets and patterns); they are not re-checked per element.
    """
    if not available():
        raise RuntimeError("spscan.kernels.cpu_chain needs numba (pip install numba); use the NumPy loop instead")
    if vectors.dtype not in (np.float32, np.float64) or vectors.ndim != 2 or not vectors.flags.c_contiguous:
        raise TypeError(f"vectors: expected a C-contiguous 2-D float32/float64 array, got {vectors.dtype} "
                        f"{vectors.ndim}-D (contiguous={vectors.flags.c_contiguous})")
    steps = int(code.shape[0])
    if steps == 0:
        return
    for name, arr in (("src", src), ("offset", offset), ("bstride", bstride), ("rows", rows), ("cols", cols),
                      ("add", add), ("out", out)):
        if arr.shape != (steps,) or arr.dtype != np.int64:
            raise ValueError(f"{name}: expected ({steps},) int64, got {arr.shape} {arr.dtype}")
    if code.dtype != np.int64 or code.min() < 0 or code.max() > 4:
        raise ValueError(f"code: expected int64 codes 0..4, got {code.dtype} in [{code.min()}, {code.max()}]")
    if code.max() >= 3:
        for name, arr, shape in (("csr_ptr", csr_ptr, (steps,)), ("csr_indptr", csr_indptr, None),
                                 ("csr_indices", csr_indices, None)):
            if (arr is None or arr.dtype != np.int64 or arr.ndim != 1 or not arr.flags.c_contiguous
                    or (shape is not None and arr.shape != shape)):
                got = "None" if arr is None else f"{arr.shape} {arr.dtype}"
                raise ValueError(f"{name}: a run with CSR steps needs a C-contiguous 1-D int64 array"
                                 f"{f' of shape {shape}' if shape else ''}, got {got}")
    else:
        csr_ptr = np.zeros(steps, dtype=np.int64)
        csr_indptr = csr_indices = _NO_CSR
    for i, s in enumerate(sources):
        if s.dtype != vectors.dtype or s.ndim != 1 or not s.flags.c_contiguous:
            raise TypeError(f"sources[{i}]: expected a C-contiguous 1-D {vectors.dtype} array, got {s.dtype} "
                            f"{s.ndim}-D")
    # a homogeneous tuple indexed at run time; padded to a power of two so few specializations compile
    n = 2
    while n < len(sources):
        n *= 2
    srcs = tuple(sources) + (sources[0],) * (n - len(sources))
    # the running vector and the next one: every y_j has rows[j] entries and y_{-1} has cols[0]
    width = int(max(rows.max(), cols[0]))
    batch = vectors.shape[0]
    cur = np.empty((width, batch), dtype=vectors.dtype)
    nxt = np.empty((width, batch), dtype=vectors.dtype)
    # entry-major copy of one per-sample CSR step's values (the entry-outer loop, more than
    # CSR_SAMPLE_OUTER_MAX_BATCH samples): as many rows as the largest such step has entries
    sample_csr = np.flatnonzero(code == 4) if batch > CSR_SAMPLE_OUTER_MAX_BATCH else np.zeros(0, dtype=np.int64)
    most = 0
    if sample_csr.size:
        starts = csr_ptr[sample_csr]
        most = int((csr_indptr[starts + rows[sample_csr]] - csr_indptr[starts]).max())
    tv = np.empty((max(most, 1), batch), dtype=vectors.dtype)
    _kernel()(code, src, offset, bstride, rows, cols, add, out, int(vin0), srcs, vectors, cur, nxt,
              csr_ptr, csr_indptr, csr_indices, tv)


MAX_SOURCES = 16


def resolve_steps(code: Sequence[int], shared: Sequence[bool], layers: Sequence[int], offsets: Sequence[int],
                  arena_s: np.ndarray, arena_p: np.ndarray, inputs: Optional[Callable], dtype) \
        -> Optional[tuple[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]]]:
    """Where each step's values lie: ``(src, offset, bstride, sources)`` for :func:`run_chain`, or ``None``
    when some input matrix is not a plain strided view of a contiguous CPU tensor of ``dtype``.

    Steps over products read the arenas (``arena_s`` 1-D, shared; ``arena_p`` ``(B, size_p)``);
    steps over input layers (``layers[j] >= 0`` and ``inputs`` given) read the caller's tensor
    ``inputs(layer)`` (``(nnz,)`` shared or ``(B, nnz)``) in place, through its base tensor.
    """
    import torch

    steps = len(code)
    if not arena_p.flags.c_contiguous or not arena_s.flags.c_contiguous:
        return None
    src = np.zeros(steps, dtype=np.int64)
    off = np.asarray(offsets, dtype=np.int64).copy()
    bst = np.zeros(steps, dtype=np.int64)
    lay = np.asarray(layers, dtype=np.int64)
    code_a = np.asarray(code, dtype=np.int64)
    per_sample = (code_a == 2) | (code_a == 4) | ((code_a == 0) & ~np.asarray(shared, dtype=bool))
    src[per_sample] = 1
    bst[per_sample] = arena_p.shape[1] if arena_p.ndim == 2 else 0
    sources = [arena_s.reshape(-1), arena_p.reshape(-1)]
    if inputs is None:
        return src, off, bst, sources
    from_input = np.flatnonzero(lay >= 0)
    if from_input.size == 0:
        return src, off, bst, sources
    owner = getattr(inputs, "__self__", None)
    if isinstance(owner, torch.Tensor) and owner.dim() in (2, 3):
        # stacked values: one tensor (n, nnz) or (n, B, nnz), layer i at row i
        if owner.dtype != dtype or owner.device.type != "cpu" or owner.stride(-1) != 1:
            return None
        base = owner if owner._base is None else owner._base
        if not base.is_contiguous():
            return None
        start = (owner.data_ptr() - base.data_ptr()) // owner.element_size()
        src[from_input] = len(sources)
        off[from_input] = start + lay[from_input] * owner.stride(0)
        bst[from_input] = owner.stride(1) if owner.dim() == 3 else 0
        sources.append(base.detach().numpy().reshape(-1))
        return src, off, bst, sources
    if hasattr(owner, "elements") and hasattr(owner, "periods"):
        return _resolve_periodic(owner, lay, from_input, src, off, bst, sources, dtype)
    get = owner.__getitem__ if isinstance(owner, (list, tuple)) else inputs
    tensors = [get(i) for i in lay[from_input].tolist()]
    # distinct tensors once (a shared matrix repeats along the run), then distinct base tensors once
    uniq_ids, first, inverse = np.unique(np.fromiter(map(id, tensors), dtype=np.int64, count=len(tensors)),
                                         return_index=True, return_inverse=True)
    uniq = [tensors[k] for k in first.tolist()]
    if not all(isinstance(t, torch.Tensor) for t in uniq):
        return None
    u_base = [t if t._base is None else t._base for t in uniq]
    slots: dict[int, int] = {}
    for base in {id(b): b for b in u_base}.values():
        if (base.dtype != dtype or base.device.type != "cpu" or not base.is_contiguous()
                or len(sources) >= MAX_SOURCES):
            return None
        slots[id(base)] = len(sources)
        sources.append(base.detach().numpy().reshape(-1))
    u_src = np.fromiter((slots[id(b)] for b in u_base), dtype=np.int64, count=len(uniq))
    u_ptr = np.fromiter((t.data_ptr() - b.data_ptr() for t, b in zip(uniq, u_base)), dtype=np.int64, count=len(uniq))
    layout = [(t.dim(), t.stride(-1), t.stride(0)) for t in uniq]  # (t.stride() with no argument is slow)
    if any(nd not in (1, 2) or last != 1 for nd, last, _ in layout):
        return None
    u_bst = np.fromiter((s0 if nd == 2 else 0 for nd, _, s0 in layout), dtype=np.int64, count=len(uniq))
    src[from_input] = u_src[inverse]
    off[from_input] = u_ptr[inverse] // sources[-1].itemsize
    bst[from_input] = u_bst[inverse]
    return src, off, bst, sources


def _resolve_periodic(owner, lay: np.ndarray, from_input: np.ndarray, src: np.ndarray, off: np.ndarray,
                      bst: np.ndarray, sources: list, dtype):
    """:func:`resolve_steps` for periodic values: element ``k`` (``(nnz,)`` shared or ``(T, B, nnz)``
    per sample) of period ``t`` starts at ``start_k + t * stride_k``, sample ``b`` ``b * bstride_k`` later."""
    elements = owner.elements
    per = len(elements)
    e_src = np.zeros(per, dtype=np.int64)
    e_start = np.zeros(per, dtype=np.int64)
    e_tstride = np.zeros(per, dtype=np.int64)
    e_bst = np.zeros(per, dtype=np.int64)
    slots: dict[int, int] = {}
    for k, e in enumerate(elements):
        base = e if e._base is None else e._base
        if (e.dtype != dtype or e.device.type != "cpu" or e.dim() not in (1, 3) or e.stride(-1) != 1
                or not base.is_contiguous()):
            return None
        slot = slots.get(id(base))
        if slot is None:
            if len(sources) >= MAX_SOURCES:
                return None
            slot = slots[id(base)] = len(sources)
            sources.append(base.detach().numpy().reshape(-1))
        e_src[k] = slot
        e_start[k] = (e.data_ptr() - base.data_ptr()) // e.element_size()
        if e.dim() == 3:
            e_tstride[k], e_bst[k] = e.stride(0), e.stride(1)
    which = lay[from_input]
    t, k = np.divmod(which, per)
    src[from_input] = e_src[k]
    off[from_input] = e_start[k] + t * e_tstride[k]
    bst[from_input] = e_bst[k]
    return src, off, bst, sources
