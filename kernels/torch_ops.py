"""Torch backend: the planned numeric primitives as vectorized gather-multiply-segment-sum.

Each work table of a :class:`~spscan.planner.program.Program` becomes a few torch ops: a
power-of-two bin of segments is ``(a[..., idx_a] * b[..., idx_b]).sum(-1)`` written to unique
output slots (a fixed-order reduction: deterministic on CPU and CUDA, no atomics, no
``index_add_``); a GEMM/GEMV group is one batched ``matmul`` over same-shaped blocks viewed in
place. This backend is the CPU default and the baseline the Triton kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import numpy as np
import torch

from spscan.planner.program import Apply, BlockRef, Gemm, LinearRun, Program, RowSpGEMM, SpMM, SpMV

from spscan.kernels.spgemm_rows_torch import rows_torch_table, spgemm_rows_torch

from spscan.kernels.cpu import chain as cpu_chain
from spscan.kernels.backend import Backend, Capabilities, Feed, Tables, Tap, load_feeds, run_apply

__all__ = ["TorchTables", "TorchBackend", "run_program"]

Index = Union[torch.Tensor, slice]


def _progression(arr: np.ndarray) -> Optional[slice]:
    """``arr`` as a slice if it is an increasing arithmetic progression (a view, no gather)."""
    if arr.ndim != 1 or arr.size == 0:
        return None
    if arr.size == 1:
        return slice(int(arr[0]), int(arr[0]) + 1)
    step = int(arr[1] - arr[0])
    if step <= 0 or not np.all(np.diff(arr) == step):
        return None
    return slice(int(arr[0]), int(arr[-1]) + 1, step)


def _as_index(arr: np.ndarray, device: torch.device) -> Index:
    """A slice when ``arr`` is a regular run (no gather needed), else a device index tensor."""
    run = _progression(arr)
    if run is not None:
        return run
    return torch.as_tensor(np.ascontiguousarray(arr), dtype=torch.int64, device=device)


@dataclass
class _Blocks:
    rows: int
    cols: int
    base: int  # >= 0: view path
    block: Optional[Index]
    flat: Optional[torch.Tensor]  # (nodes, rows*cols) gather index when offsets are unaligned
    reverse: bool = False  # ``block`` lists the blocks in ascending order; the op wants them reversed


def _blocks(ref: BlockRef, device: torch.device) -> _Blocks:
    if ref.base >= 0:
        blk = ref.block
        if blk.size > 1 and _progression(blk[::-1]) is not None and _progression(blk) is None:
            # descending runs (a chain walked from the last layer) stay views, read in reverse
            return _Blocks(ref.rows, ref.cols, ref.base, _progression(blk[::-1]), None, True)
        return _Blocks(ref.rows, ref.cols, ref.base, _as_index(blk, device), None)
    size = ref.rows * ref.cols
    flat = ref.offsets[:, None] + np.arange(size, dtype=np.int64)
    return _Blocks(ref.rows, ref.cols, -1, None, torch.as_tensor(flat, device=device))


def _view_blocks(arena: torch.Tensor, b: _Blocks) -> torch.Tensor:
    """``(nodes, rows, cols)`` (shared) or ``(B, nodes, rows, cols)`` (per sample)."""
    size = b.rows * b.cols
    if b.base >= 0:
        nb = (arena.shape[-1] - b.base) // size
        view = arena[..., b.base : b.base + nb * size].unflatten(-1, (nb, b.rows, b.cols))
        view = view[..., b.block, :, :]
        return view.flip(-3) if b.reverse else view
    return arena[..., b.flat].unflatten(-1, (b.rows, b.cols))


def _as_add(arr: np.ndarray, zero: int, device: torch.device) -> Optional[Index]:
    """``None`` when every segment adds the zero slot (no affine term in this launch)."""
    return None if np.all(arr == zero) else _as_index(arr.reshape(-1), device)


class TorchTables(Tables):
    """Device copies of a program's index tables, made once per (program, device).

    ``reads_arena_inputs`` is False when every op that reads input matrices is a linear run
    over inputs: those read the caller's tensors directly, so the engine skips loading them.
    """

    def __init__(self, program: Program, device: torch.device, memo: Optional[dict] = None):
        self.program = program
        self.device = device
        self.steps = []
        ops_all = [op for st in program.steps for op in st.ops]
        # a composite read back from the arena (a one-layer reduction is its input) needs it loaded too
        self.reads_arena_inputs = program.root_mat is not None or not all(
            isinstance(op, LinearRun) and bool(np.all(op.layers >= 0)) for op in ops_all)
        self.run_scratch = program.run_scratch  # linear runs write through arenas["C"]
        zero_v = program.zero_v
        memo = {} if memo is None else memo  # id(op) -> (op, its tables): ops shared with other programs
        for st in program.steps:
            ops = []
            for op in st.ops:
                hit = memo.get(id(op))
                if hit is not None and hit[0] is op:
                    ops.append(hit)
                    continue
                if isinstance(op, (SpMM, SpMV)):
                    bins = [
                        (
                            torch.as_tensor(b.a, device=device),
                            torch.as_tensor(b.b, device=device),
                            _as_index(b.out, device),
                            None if b.add is None else _as_add(b.add, zero_v, device),
                        )
                        for b in op.bins
                    ]
                    ops.append((op, bins))
                elif isinstance(op, Gemm):
                    ops.append((op, (_blocks(op.a, device), _blocks(op.b, device))))
                elif isinstance(op, RowSpGEMM):
                    ops.append((op, [rows_torch_table(pr.a, pr.b, pr.c, device) for pr in op.products]))
                elif isinstance(op, LinearRun):
                    ops.append((op, _run_plan(op, device)))
                elif isinstance(op, Apply):
                    ops.append((op, None))
                else:
                    ops.append((op, (_blocks(op.mats, device), _as_index(op.vin.reshape(-1), device),
                                     _as_add(op.add, zero_v, device))))
                memo[id(op)] = ops[-1]
            self.steps.append(ops)


def _gather(arena: torch.Tensor, idx: Index) -> torch.Tensor:
    return arena[..., idx]


def _batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over node blocks; a shared operand is ``(nodes, m, k)``, a per-sample one ``(B, nodes, m, k)``.

    Operands are made contiguous and folded into one ``bmm``: ``matmul`` on strided arena views
    can fall back to a path that is orders of magnitude slower.
    """
    if a.dim() == 3 and b.dim() == 3:
        return torch.bmm(a.contiguous(), b.contiguous())
    if a.dim() == 4 and b.dim() == 4:
        batch, nodes, m, k = a.shape
        p = b.shape[-1]
        c = torch.bmm(a.contiguous().view(batch * nodes, m, k), b.contiguous().view(batch * nodes, k, p))
        return c.view(batch, nodes, m, p)
    if a.dim() == 3:  # shared left factor: fold the batch into the columns of b
        nodes, m, k = a.shape
        batch, _, _, p = b.shape
        bb = b.permute(1, 2, 0, 3).contiguous().view(nodes, k, batch * p)
        c = torch.bmm(a.contiguous(), bb).view(nodes, m, batch, p)
        return c.permute(2, 0, 1, 3)
    batch, nodes, m, k = a.shape  # shared right factor: fold the batch into the rows of a
    p = b.shape[-1]
    aa = a.permute(1, 0, 2, 3).contiguous().view(nodes, batch * m, k)
    c = torch.bmm(aa, b.contiguous()).view(nodes, batch, m, p)
    return c.permute(1, 0, 2, 3)


def _store(dst: torch.Tensor, idx: Index, value: torch.Tensor) -> None:
    """Write ``value`` to unique slots ``idx`` of the last dimension (deterministic)."""
    dst[..., idx] = value


def _segment_sum(x: torch.Tensor, dst: torch.Tensor, idx: Index) -> None:
    """``dst[..., idx] = x.sum(-1)``; straight into the arena when ``idx`` is a contiguous run."""
    if isinstance(idx, slice):
        torch.sum(x, -1, out=dst[..., idx])
    else:
        dst[..., idx] = x.sum(-1)


@dataclass
class _CsrSteps:
    """One CSR pattern of a linear run as gather tables: ``y_out[:, rows] = (vals * y[:, cols])[:, idx].sum(-1)``.

    Rows are grouped by padded length (:func:`~spscan.planner.cost.bin_widths`: at most 2x padding);
    ``idx`` pads with ``nnz``, the zero column after the products, so the sum of a row is over its
    stored entries only (empty rows sum to zero). O(nnz) work per step, no atomics.
    """

    nnz: int
    cols: Index  # (nnz,) column of each stored entry
    bins: list[tuple[Index, Index]]  # (output rows, (rows_in_bin, width) positions in the products)


def _csr_steps(indptr: np.ndarray, indices: np.ndarray, torch_device: Optional[torch.device]) -> _CsrSteps:
    """Gather tables of one pattern, as NumPy arrays (``torch_device=None``) or index tensors."""
    from spscan.planner.cost import bin_widths

    lengths = np.diff(indptr)
    nnz = int(indptr[-1] - indptr[0])
    widths = bin_widths(lengths.copy())
    bins = []
    for w in sorted(np.unique(widths).tolist(), reverse=True):
        sel = np.flatnonzero(widths == w)
        t = np.arange(w, dtype=np.int64)
        pos = (indptr[sel] - indptr[0])[:, None] + t[None, :]
        pos = np.where(t[None, :] < lengths[sel][:, None], pos, nnz)
        if torch_device is None:
            rows = _progression(sel)
            bins.append((rows if rows is not None else sel, pos))
        else:
            bins.append((_as_index(sel, torch_device), torch.as_tensor(pos, device=torch_device)))
    cols = np.asarray(indices, dtype=np.int64)
    return _CsrSteps(nnz, cols if torch_device is None else torch.as_tensor(cols, device=torch_device), bins)


@dataclass
class _RunPlan:
    """A :class:`LinearRun` unpacked into Python lists once (the per-step loop is overhead bound)."""

    code: list[int]  # 0 diagonal, 1 shared dense, 2 per-sample dense, 3 shared CSR, 4 per-sample CSR
    layer: list[int]
    offset: list[int]
    rows: list[int]
    cols: list[int]
    add: list[int]
    uniform_out: bool
    max_dense: int  # largest block (rows*cols) of a dense step (1 if none)
    period: int  # outputs are contiguous and their sizes repeat every ``period`` steps (0: neither)
    pattern: list[int]  # index of a CSR step's pattern in ``csr_np``/``csr_dev``, -1 otherwise
    csr_np: list[_CsrSteps]  # per distinct pattern: NumPy gather tables (the NumPy loop)
    csr_dev: list[_CsrSteps]  # the same as index tensors on the tables' device (the torch loop)
    nnz: list[int]  # stored entries of each step's matrix
    csr_blocks: Optional[np.ndarray] = None  # the compiled CPU loop's shared_column_blocks, made on first use
    csr_bands: Optional[np.ndarray] = None  # and its diagonal_bands
    out_step: Optional[dict] = None  # output column -> step, for taps (made on first use)
    add_step: Optional[dict] = None  # affine-term column -> step, for feeds (made on first use)
    lookups: dict = field(default_factory=dict)  # per request key: steps of taps and feeds, outputs minus skip
    codes: Optional[np.ndarray] = None  # the compiled CPU loop's step codes (_run_codes), made on first use
    resolved: dict = field(default_factory=dict)  # cpu_chain.resolve_steps' memo: step tables per values layout
    checked: dict = field(default_factory=dict)  # cpu_chain.run_chain's memo: the tables it last checked


def _run_codes(op: LinearRun) -> np.ndarray:
    """``(steps,)`` int64 step codes of :mod:`.cpu.chain` (0 diagonal, 1/2 dense, 3/4 CSR; shared/per sample)."""
    shared = np.asarray(op.shared, dtype=bool)
    return np.where(op.sparse, np.where(shared, 3, 4),
                    np.where(op.dense, np.where(shared, 1, 2), 0)).astype(np.int64)


def _out_period(rows: np.ndarray, out: np.ndarray) -> int:
    """Smallest ``P`` with ``rows`` ``P``-periodic and ``out`` one contiguous run; 0 if none."""
    steps = rows.shape[0]
    if steps == 0 or not np.array_equal(out[1:], out[:-1] + rows[:-1]):
        return 0
    for p in range(1, min(steps, 16) + 1):
        if steps % p == 0 and np.array_equal(rows[p:], rows[:-p]):
            return p
    return 0


def _run_plan(op: LinearRun, device: Optional[torch.device] = None) -> _RunPlan:
    code = _run_codes(op).tolist()
    rows = op.rows.tolist()
    period = _out_period(op.rows, op.out)
    nnz = op.nnz
    block = np.where(np.isin(np.asarray(code), (1, 2)), nnz, 0)  # dense steps
    bounds = [(int(op.csr_indptr[s]), int(op.csr_indptr[s + p.rows])) for s, p in
              zip(np.cumsum([0] + [p.rows + 1 for p in op.csr]).tolist(), op.csr)]
    ptrs = [op.csr_indptr[s : s + p.rows + 1] for s, p in
            zip(np.cumsum([0] + [p.rows + 1 for p in op.csr]).tolist(), op.csr)]
    idxs = [op.csr_indices[a:b] for a, b in bounds]
    dev = torch.device("cpu") if device is None else torch.device(device)
    return _RunPlan(code, op.layers.tolist(), op.mat_offset.tolist(), rows, op.cols.tolist(), op.add.tolist(),
                    period == 1, max(1, int(block.max())) if block.size else 1, period, op.pattern.tolist(),
                    [_csr_steps(p, i, None) for p, i in zip(ptrs, idxs)],
                    [_csr_steps(p, i, dev) for p, i in zip(ptrs, idxs)], nnz.tolist())


# A CPU linear-run step is a few microseconds of call overhead around a tiny product. NumPy's calls cost
# less than eager torch's and the compiled loop (kernels/cpu/chain.py) removes them, so CPU linear runs go
# through NumPy views of the same buffers unless a dense step's product is big enough for torch's BLAS to
# spread over its threads: above this many multiply-adds per step (all samples) times torch's thread
# count (bench/results/calibration.md).
NUMPY_RUN_MAX_WORK = 1 << 23


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return (t.detach() if t.requires_grad else t).numpy()


def uses_numpy(cp: _RunPlan, vectors: torch.Tensor) -> bool:
    """Whether this linear run goes through NumPy (the compiled loop where available): CPU tensors and
    dense steps small enough that a BLAS call per step would not pay. CSR steps do not count: eager
    torch has no better way through them than NumPy's gathers, and the compiled loop has a much
    better one."""
    return (vectors.device.type == "cpu"
            and vectors.shape[0] * cp.max_dense * torch.get_num_threads() <= NUMPY_RUN_MAX_WORK)


def _run_compiled(op: LinearRun, cp: _RunPlan, arenas: dict[str, torch.Tensor], vectors: torch.Tensor,
                  inputs, taps: Sequence[Tap] = (), skip: Optional[np.ndarray] = None,
                  feeds: Sequence[Feed] = ()) -> Optional[bool]:
    """The whole run in one call of the compiled CPU loop (:mod:`.cpu.chain`); ``None`` where it does not
    apply (no numba, or an input matrix that is not a strided view of a contiguous tensor: nothing
    ran, the feeds are not loaded), else whether it took ``taps`` and ``skip`` (when every tapped
    column is an output of this run). Feeds are read in place where each slot is a step's affine
    term and the terms' strides allow, else loaded into the vectors first."""
    if not cpu_chain.available() or vectors.dtype not in (torch.float32, torch.float64) or not vectors.is_contiguous():
        return None
    if cp.codes is None:
        cp.codes = _run_codes(op)
    where = cpu_chain.resolve_steps(cp.codes, op.shared, op.layers, op.mat_offset, _as_numpy(arenas["S"]),
                                    _as_numpy(arenas["P"]), inputs, vectors.dtype, memo=cp.resolved)
    if where is None:
        return None
    code, src, off, bst, est, sources = where
    i64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    indptr, indices = i64(op.csr_indptr), i64(op.csr_indices)
    if cp.csr_blocks is None and indptr.size:
        cp.csr_blocks = cpu_chain.shared_column_blocks(indptr, indices)
        cp.csr_bands = cpu_chain.diagonal_bands(indptr, indices)
    out = i64(op.out)
    add = i64(op.add)
    fed = _feed_steps(op, cp, feeds, vectors) if feeds else []
    if fed is None:
        load_feeds(vectors, feeds)
        fed = []
    elif fed:
        # the terms are read where the caller holds them, not from their slots (the same array for the
        # same fed steps, so the loop's checks of it are kept)
        steps_fed = np.concatenate([f[0] for f in fed])
        add = _lookup(cp, ("fed", steps_fed.tobytes()),
                      lambda: np.where(np.isin(np.arange(add.size), steps_fed), -1, add))
    steps = _tap_steps(op, cp, taps) if taps else []
    taken = steps is not None and bool(taps or skip is not None)
    if taken and skip is not None and skip.size:
        out = _lookup(cp, ("skip", skip.tobytes()), lambda: np.where(np.isin(out, skip), -1, out))
    cpu_chain.run_chain(code, src, off, bst, i64(op.rows), i64(op.cols), add, out, op.vin0,
                        sources, _as_numpy(vectors), i64(op.csr_ptr), indptr, indices, estride=est,
                        csr_blocks=cp.csr_blocks, csr_bands=cp.csr_bands,
                        taps=[(st, t.row0, t.rows, t.out.numpy()) + (() if t.operand is None else (t.operand.numpy(),))
                              for st, t in zip(steps, taps)] if taken else (),
                        feeds=fed, memo=cp.checked)
    return taken


def _lookup(cp: _RunPlan, key: tuple, make):
    """``cp.lookups[key]``, made by ``make()`` the first time (the same requests come back every call; a
    bounded cache, cleared when it grows past 64 entries)."""
    hit = cp.lookups.get(key)
    if hit is None:
        if len(cp.lookups) > 64:
            cp.lookups.clear()
        hit = cp.lookups[key] = make()
    return hit


def _feed_steps(op: LinearRun, cp: _RunPlan, feeds: Sequence[Feed], vectors: torch.Tensor) -> Optional[list]:
    """:func:`~.cpu.chain.run_chain`'s ``feeds`` for ``feeds`` (each slot the affine term of one step of
    ``op``), or ``None`` where one is not (or its terms are not a CPU tensor of the vectors' dtype with
    non-negative strides): then the caller loads them into the vectors."""
    if cp.add_step is None:
        cp.add_step = {int(a): j for j, a in enumerate(op.add) if a >= 0}
    fed = []
    for f in feeds:
        t = f.terms
        if (t.device.type != "cpu" or t.dtype != vectors.dtype or t.requires_grad or t.dim() != 3
                or min(t.stride()) < 0 or f.row0 + t.shape[2] > f.size):
            return None
        st = _lookup(cp, ("feed", f.cols.tobytes()),
                     lambda: np.asarray([cp.add_step.get(int(c), -1) for c in f.cols], dtype=np.int64))
        if st.size and st.min() < 0:
            return None
        K, B, r = t.shape
        sk, sb, sf = t.stride()
        span = (K - 1) * sk + (B - 1) * sb + (r - 1) * sf + 1
        flat = t.as_strided((span,), (1,), t.storage_offset()).numpy()
        fed.append((st, f.row0, r, flat, np.arange(K, dtype=np.int64) * sk, sb, sf))
    return fed


def _tap_steps(op: LinearRun, cp: _RunPlan, taps: Sequence[Tap]) -> Optional[list[np.ndarray]]:
    """Each tap's step indices in ``op`` (the steps whose outputs start at its columns; ``-1``: the run's
    input), or ``None`` if a column is neither, two taps share a step, or a tap's buffer is not a plain
    CPU array. Step lookups are kept per column set (the same taps come back every call)."""
    if cp.out_step is None:
        cp.out_step = {int(o): j for j, o in enumerate(op.out)}
        cp.out_step.setdefault(int(op.vin0), -1)  # the run's input y_{-1} (the top gradient)
    steps = []
    if sum(t.operand is not None for t in taps) > 1:  # the loop reduces against one operand per run
        return None
    for t in taps:
        if t.out.device.type != "cpu" or not t.out.is_contiguous() or (
                t.operand is not None and (t.operand.device.type != "cpu" or not t.operand.is_contiguous())):
            return None
        # -2: not one of this run's columns
        st = _lookup(cp, ("tap", t.cols.tobytes()),
                     lambda: np.asarray([cp.out_step.get(int(c), -2) for c in t.cols], dtype=np.int64))
        if st.size and st.min() < (-1 if t.operand is None else 0):  # the input is not reduced in the loop
            return None
        steps.append(st)
    if len(steps) > 1:
        every = np.concatenate(steps)
        if np.unique(every).size != every.size:  # the loop taps a step once
            return None
    return steps


def _csr_step(y, vals, out, tab: _CsrSteps, prod, use_np: bool) -> None:
    """``out = M y`` for a CSR ``M``: ``prod[:, :nnz] = vals * y[:, cols]`` (``prod[:, nnz]`` stays zero),
    then each bin of rows sums its gathered products (stored order; padding reads the zero)."""
    if use_np:
        np.multiply(y[:, tab.cols], vals, out=prod[:, : tab.nnz])
        for sel, pos in tab.bins:
            if isinstance(sel, slice):
                np.sum(prod[:, pos], axis=-1, out=out[:, sel])
            else:
                out[:, sel] = prod[:, pos].sum(-1)
    else:
        torch.mul(y[:, tab.cols], vals, out=prod[:, : tab.nnz])
        for sel, pos in tab.bins:
            if isinstance(sel, slice):
                torch.sum(prod[:, pos], -1, out=out[:, sel])
            else:
                out[:, sel] = prod[:, pos].sum(-1)


def _run_linear(op: LinearRun, cp: _RunPlan, arenas: dict[str, torch.Tensor], vectors: torch.Tensor,
                inputs, taps: Sequence[Tap] = (), skip: Optional[np.ndarray] = None,
                feeds: Sequence[Feed] = ()) -> bool:
    """The linear-scan middle: one ``mm`` / ``bmm`` / ``mul`` per step (fused with its affine term), or
    for a CSR step one gather-multiply and a padded gather-sum per row bin (:class:`_CsrSteps`).

    Vectors are ``(B, m)`` blocks of one contiguous buffer written with ``out=``: the least
    per-step overhead eager torch allows on a sequential run (NumPy's, on the CPU, when the
    steps are small: :func:`uses_numpy`). Matrices of input layers are the caller's tensors
    (no arena load); a tensor repeated along the run is reshaped once. Returns whether ``taps`` and
    ``skip`` were taken (by the compiled loop; see :meth:`Backend.run`).
    """
    batch, steps = vectors.shape[0], op.steps
    use_np = uses_numpy(cp, vectors)
    if use_np:
        done = _run_compiled(op, cp, arenas, vectors, inputs, taps, skip, feeds)
        if done is not None:
            return done
    load_feeds(vectors, feeds)
    rows, cols, code = cp.rows, cp.cols, cp.code
    scratch = arenas.get("C")
    if scratch is not None and scratch.numel() >= batch * sum(rows):
        buf = scratch[: batch * sum(rows)]  # kept by the plan between calls: no page faults per call
    else:
        buf = torch.empty(batch * sum(rows), dtype=vectors.dtype, device=vectors.device)
    if use_np:
        nbuf = buf.numpy()
        if cp.uniform_out:
            ys = list(nbuf.reshape(steps, batch, rows[0]))
        else:
            ends = np.cumsum([batch * m for m in rows]).tolist()
            ys = [nbuf[e - batch * m : e].reshape(batch, m) for e, m in zip(ends, rows)]
        vec = vectors.numpy()
        conv = _as_numpy
        arena = {k: arenas[k].numpy() for k in ("S", "P")}
    else:
        if cp.uniform_out:
            ys = buf.view(steps, batch, rows[0]).unbind(0)
        else:
            ys = [piece.view(batch, m) for piece, m in zip(buf.split([batch * m for m in rows]), rows)]
        vec = vectors
        conv = None
        arena = arenas
    seen: dict[int, tuple] = {}
    mats = []
    for j in range(steps):
        m, k, c = rows[j], cols[j], code[j]
        if cp.layer[j] >= 0 and inputs is not None:
            raw = inputs(cp.layer[j])
            hit = seen.get(id(raw))
            if hit is None:  # shared dense blocks are kept transposed: the step is y @ M^T
                r = conv(raw) if use_np else raw
                if c == 0 or c >= 3:
                    mat = r
                elif c == 1:
                    mat = r.reshape(m, k).T if use_np else r.view(m, k).t()
                else:
                    mat = r.reshape(r.shape[0], m, k) if use_np else r.unflatten(-1, (m, k))
                hit = (raw, mat)
                seen[id(raw)] = hit  # holding ``raw`` keeps its id from being reused by a temporary
            mats.append(hit[1])
        else:
            off = cp.offset[j]
            src = arena["S"] if op.shared[j] else arena["P"]
            vals = src[..., off : off + cp.nnz[j]]
            if c == 0 or c >= 3:
                mats.append(vals)
            elif c == 1:
                mats.append(vals.reshape(m, k).T if use_np else vals.view(m, k).t())
            else:
                mats.append(vals.reshape(batch, m, k) if use_np else vals.unflatten(-1, (m, k)))
    y = vec[:, op.vin0 : op.vin0 + cols[0]]
    adds = [None if a < 0 else vec[:, a : a + rows[j]] for j, a in enumerate(cp.add)]
    no_adds = all(a is None for a in adds)
    # per CSR pattern: the products of a step and one zero column the padded gathers read
    tabs = cp.csr_np if use_np else cp.csr_dev
    if use_np:
        prods = [np.empty((batch, t.nnz + 1), dtype=nbuf.dtype) for t in tabs]
    else:
        prods = [torch.empty(batch, t.nnz + 1, dtype=vectors.dtype, device=vectors.device) for t in tabs]
    for prod in prods:
        prod[:, -1] = 0
    if use_np:
        dot, mul, matmul, add_ = np.dot, np.multiply, np.matmul, np.add
        with np.errstate(all="ignore"):  # inf/NaN propagate silently, as in torch
            for c, mat, out, a, pat in zip(code, mats, ys, adds, cp.pattern):
                if c == 1:
                    dot(y, mat, out=out)
                elif c == 0:
                    mul(y, mat, out=out)
                elif c == 2:  # per-sample dense: (B, m, k) @ (B, k, 1)
                    matmul(mat, y[:, :, None], out=out[:, :, None])
                else:
                    _csr_step(y, mat, out, tabs[pat], prods[pat], True)
                if a is not None:
                    add_(out, a, out=out)
                y = out
    elif no_adds and all(c in (0, 1) for c in code):
        # the common middle (shared dense and diagonal steps, no affine terms): the tightest loop
        mm, mul = torch.mm, torch.mul
        for c, mat, out in zip(code, mats, ys):
            if c:
                mm(y, mat, out=out)
            else:
                mul(y, mat, out=out)
            y = out
    else:
        for c, mat, out, add, pat in zip(code, mats, ys, adds, cp.pattern):
            if c == 0:
                torch.mul(y, mat, out=out) if add is None else torch.addcmul(add, y, mat, out=out)
            elif c == 1:
                torch.mm(y, mat, out=out) if add is None else torch.addmm(add, y, mat, out=out)
            elif c >= 3:
                _csr_step(y, mat, out, tabs[pat], prods[pat], False)
                if add is not None:
                    out.add_(add)
            elif add is None:  # per-sample dense
                torch.bmm(mat, y.unsqueeze(-1), out=out.unsqueeze(-1))
            else:
                torch.baddbmm(add.unsqueeze(-1), mat, y.unsqueeze(-1), out=out.unsqueeze(-1))
            y = out
    first = int(op.out[0])
    if cp.period:
        # one strided copy per position in the period: (steps/P, B, m_k) blocks -> (B, steps/P, S) columns
        p = cp.period
        sizes = rows[:p]
        width = sum(sizes)
        reps = steps // p
        src = buf.view(reps, batch * width)
        dst = vectors[:, first : first + reps * width].view(batch, reps, width)
        c = 0
        for m in sizes:
            dst[:, :, c : c + m] = src[:, batch * c : batch * (c + m)].view(reps, batch, m).transpose(0, 1)
            c += m
    else:
        pieces = buf.split([batch * m for m in rows])
        for j in range(steps):
            o = int(op.out[j])
            vectors[:, o : o + rows[j]] = pieces[j].view(batch, rows[j])
    return False


def run_program(tables: TorchTables, arenas: dict[str, torch.Tensor], vectors: torch.Tensor,
                inputs=None, taps: Sequence[Tap] = (), skip: Optional[np.ndarray] = None,
                feeds: Sequence[Feed] = ()) -> bool:
    """Run every step of the program in order, in place on the arenas.

    ``inputs``: ``layer_index -> the caller's values tensor`` (``(B, nnz)`` or ``(nnz,)``), read
    directly by linear runs over input matrices. ``taps``, ``skip``, ``feeds``: as :meth:`Backend.run`;
    taps and skip taken (returns ``True``), and feeds read in place, where the program is one linear
    run on the compiled CPU loop (a linear scan: no later step reads its outputs).
    """
    if (taps or skip is not None or feeds) and len(tables.steps) == 1 and len(tables.steps[0]) == 1:
        op, t = tables.steps[0][0]
        if isinstance(op, LinearRun):
            return _run_linear(op, t, arenas, vectors, inputs, taps, skip, feeds)
    load_feeds(vectors, feeds)
    batch = vectors.shape[0]
    for ops in tables.steps:
        for op, t in ops:
            if isinstance(op, SpMM):
                src_a, src_b, dst = arenas[op.kind_a], arenas[op.kind_b], arenas[op.kind_out]
                for off, size in op.clear:  # dense outputs: unreached positions are zero, the bins write the rest
                    dst[..., off : off + size].zero_()
                for ia, ib, out, _ in t:
                    _segment_sum(_gather(src_a, ia) * _gather(src_b, ib), dst, out)
            elif isinstance(op, RowSpGEMM):
                src_a, src_b, dst = arenas[op.kind_a], arenas[op.kind_b], arenas[op.kind_out]
                for pr, table in zip(op.products, t):
                    spgemm_rows_torch(table, src_a[..., pr.a_offset : pr.a_offset + pr.a.nnz],
                                      src_b[..., pr.b_offset : pr.b_offset + pr.b.nnz],
                                      out=dst[..., pr.c_offset : pr.c_offset + pr.c.nnz])
            elif isinstance(op, Gemm):
                ba, bb = t
                c = _batched_matmul(_view_blocks(arenas[op.kind_a], ba), _view_blocks(arenas[op.kind_b], bb))
                n, m, p = op.nodes, ba.rows, bb.cols
                dst = arenas[op.kind_out]
                dst[..., op.out_offset : op.out_offset + n * m * p] = c.flatten(-3)
            elif isinstance(op, SpMV):
                src = arenas[op.kind_m]
                for ia, ib, out, add in t:
                    prod = _gather(src, ia) * vectors[:, ib]
                    if add is None:
                        _segment_sum(prod, vectors, out)
                    else:
                        _store(vectors, out, prod.sum(-1) + vectors[:, add])
            elif isinstance(op, LinearRun):
                _run_linear(op, t, arenas, vectors, inputs)
            elif isinstance(op, Apply):
                run_apply(op, vectors, inputs)
            else:  # Gemv: memory bound, so one strided multiply + sum beats copying blocks for bmm
                bm, vin, add = t
                m, k, n = bm.rows, bm.cols, op.nodes
                x = vectors[:, vin].reshape(batch, n, 1, k)
                prod = _view_blocks(arenas[op.kind_m], bm) * x
                out = vectors[:, op.out_offset : op.out_offset + n * m].view(batch, n, m)
                if add is None:
                    torch.sum(prod, -1, out=out)
                else:
                    torch.add(prod.sum(-1), vectors[:, add].view(batch, n, m), out=out)
    return False

class TorchBackend(Backend):
    """The torch/NumPy backend (see the module docstring)."""

    name = "torch"
    capabilities = Capabilities(reads_caller_inputs=True, graph_capturable=False, device_types=("cpu", "cuda"))

    def make_tables(self, program: Program, device: torch.device, memo: Optional[dict] = None) -> TorchTables:
        return TorchTables(program, device, memo)

    def run(self, tables, arenas, vectors, inputs=None, taps=(), skip=None, feeds=()) -> bool:
        return run_program(tables, arenas, vectors, inputs, taps, skip, feeds)
