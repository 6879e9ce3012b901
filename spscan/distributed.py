"""Model-parallel BPPSA over ``torch.distributed``: each rank owns a contiguous slice of the chain.

The chain ``x_i = f_i(x_{i-1})``, ``i = 1..n``, is cut at boundaries ``0 = b_0 < b_1 < ... < b_p = n``;
rank ``r`` owns layers ``b_r+1 .. b_{r+1}`` (their patterns ``patterns[b_r : b_{r+1}]`` and values) and
the gradients ``dl/dx_i`` for ``i = b_r .. b_{r+1}``. The backward runs in three phases:

1. **Reduce.** Every rank except the first and the last reduces its slice to one affine map
   ``g_{b_r} = M_r g_{b_{r+1}} + v_r`` (``M_r = J_{b_r+1}^T ... J_{b_{r+1}}^T``, shape
   ``(d_{b_r}, d_{b_{r+1}})``, sparse or dense as its density says; ``v_r`` from the slice's
   ``extra`` terms) with a pairwise product tree. The last rank runs its whole slice's backward
   with ``spscan.backward`` at once: its element holds the gradient (the *spine*), a vector.
2. **Scan across ranks** in ``ceil(log2 p)`` rounds of recursive doubling over the ranks in
   reverse order (rank ``p-1`` first). In round ``k`` rank ``r`` sends its partial composite to
   rank ``r - 2^k`` and receives one from rank ``r + 2^k``: one message per peer per round, the
   CSR values of the planned composite pattern (``(nnz,)`` if every layer in its range has shared
   values, else ``(B, nnz)``) followed by its ``(B, d)`` vector. A partial that contains the
   gradient is a vector, so the spine only ever carries vectors. Each rank keeps the pieces it
   received and applies them to the spine vector (SpMV only) to get its boundary gradient
   ``dl/dx_{b_{r+1}}``: an exclusive scan, with no final shift round.
3. **Finish.** Each rank runs ``spscan.backward`` on its local plan with that boundary gradient.

Only values travel: every rank plans the same composite patterns from all patterns
(deterministic), so patterns and pair lists never cross the wire. Before the rounds, one
all-reduce of a small status table (error flag, batch size, dtype, extras and shared flags per
rank) makes a rank with bad input fail on *every* rank at once instead of leaving peers hanging.

The plan (slices, peers, composite patterns, each rank's plans) lives in
:mod:`spscan.parallel.plan`; this module runs it over a process group.

>>> import scipy.sparse as sp
>>> dplan = plan([sp.csr_array(sp.eye(3))] * 5, world_size=2, slices=[0, 2, 5])
>>> dplan.slices, dplan.rounds
([(0, 2), (2, 5)], 1)
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from spscan.api import backward as _scan_backward
from spscan.parallel.plan import DistributedPlan, RankPlan, balanced_slices, plan
from spscan.parallel.plan import layer_costs as _layer_costs  # noqa: F401  (the slice cost per layer, read by tests)
from spscan.runtime import check_inputs

__all__ = ["DistributedPlan", "RankPlan", "CommStats", "SliceGrads", "PeerError", "plan", "backward",
           "balanced_slices", "run_local"]

_DTYPES = {torch.float32: 1, torch.float64: 2}
_STATUS = 5  # status columns: failed, batch, dtype code, has extra, all shared


class PeerError(RuntimeError):
    """Another rank failed (bad input, crash or timeout); this rank computed no gradients."""


# ----------------------------------------------------------------------------- run time


@dataclass
class CommStats:
    """Communication of one rank in one backward.

    Attributes:
        rank, world_size: who counted.
        rounds: the scan rounds this rank sent or received in (``ceil(log2 p)`` at most).
        messages_sent, messages_received: point-to-point messages (at most one per peer per round).
        bytes_sent, bytes_received: payload bytes of those messages.
        planned_bytes_sent, planned_bytes_received: what the plan says they must be.
        collectives: all-reduces outside the rounds (the status check).
        log: per round ``(round, send peer, bytes sent, receive peer, bytes received)``.
        seconds: host wall time per phase: ``"status"``, ``"local"`` (reduce or spine backward),
            ``"rounds"`` (waits included) and ``"finish"`` (device work may still be queued on GPUs).
    """

    rank: int
    world_size: int
    rounds: list[int] = field(default_factory=list)
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    planned_bytes_sent: int = 0
    planned_bytes_received: int = 0
    collectives: int = 0
    log: list[tuple[int, Optional[int], int, Optional[int], int]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


class SliceGrads(list):
    """The gradients of one rank's slice: ``self[k]`` is ``dl/dx_{start+k}``, ``(B, d_{start+k})``.

    ``start = b_r`` (the slice's input boundary: its gradient is returned) and ``stop = b_{r+1} + 1``;
    the last entry, ``dl/dx_{b_{r+1}}``, equals the next rank's first entry (for the last rank it is
    ``grad + extra``). ``stats`` is the rank's :class:`CommStats`.
    """

    def __init__(self, grads: list[torch.Tensor], start: int, stats: CommStats) -> None:
        super().__init__(grads)
        self.start = start
        self.stop = start + len(grads)
        self.stats = stats


class _Comm:
    """Point-to-point and status collectives of one backward, counted into :class:`CommStats`."""

    def __init__(self, group, stats: CommStats, timeout: Optional[float]) -> None:
        self.group = group
        self.stats = stats
        self.timeout = None if timeout is None else timedelta(seconds=float(timeout))
        # Gloo's send/recv take CPU tensors only: device messages go through host copies (so ranks
        # on GPUs can use Gloo, e.g. several processes on one GPU, which NCCL refuses)
        self.host_staged = dist.get_backend(group) == "gloo"

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _wait(self, work, what: str) -> None:
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(self.timeout)
        except Exception as exc:  # gloo/nccl raise RuntimeError subclasses with backend text
            raise PeerError(f"rank {self.stats.rank}: {what} failed: a peer crashed, raised before "
                            f"communicating or timed out ({type(exc).__name__}: {exc})") from exc

    def all_reduce(self, t: torch.Tensor, what: str) -> None:
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._wait(work, what)
        self.stats.collectives += 1

    def exchange(self, k: int, send_to: Optional[int], payload: Optional[torch.Tensor], recv_from: Optional[int],
                 buf: Optional[torch.Tensor]) -> None:
        """One round: at most one message to ``send_to`` and one from ``recv_from``, posted together."""
        ops = []
        out, into = payload, buf
        if self.host_staged:
            if out is not None and out.device.type != "cpu":
                out = out.cpu()
            if into is not None and into.device.type != "cpu":
                into = torch.empty(into.shape, dtype=into.dtype)
        if send_to is not None:
            ops.append(dist.P2POp(dist.isend, out, self._global(send_to), self.group))
        if recv_from is not None:
            ops.append(dist.P2POp(dist.irecv, into, self._global(recv_from), self.group))
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        for w in works:
            self._wait(w, f"round {k} (send to {send_to}, receive from {recv_from})")
        if into is not buf and recv_from is not None:
            buf.copy_(into)
        sent = payload.numel() * payload.element_size() if send_to is not None else 0
        got = buf.numel() * buf.element_size() if recv_from is not None else 0
        st = self.stats
        st.rounds.append(k)
        st.messages_sent += send_to is not None
        st.messages_received += recv_from is not None
        st.bytes_sent += sent
        st.bytes_received += got
        st.log.append((k, send_to, sent, recv_from, got))


def _comm_device(group, local: torch.device) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return local if local.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _infer_batch(values: Sequence[Any], extra: Optional[Sequence[Any]], grad: Optional[torch.Tensor]) -> int:
    if isinstance(grad, torch.Tensor) and grad.dim() == 2:
        return int(grad.shape[0])
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim() == 2:
            return int(v.shape[0])
    for e in extra or ():
        if isinstance(e, torch.Tensor) and e.dim() == 2:
            return int(e.shape[0])
    return 0


def _check_local(dplan: DistributedPlan, rp: RankPlan, values: Any, grad: Optional[torch.Tensor],
                 extra: Optional[Sequence[Optional[torch.Tensor]]]
                 ) -> tuple[int, torch.dtype, torch.device, list, list]:
    """Validate this rank's inputs alone; returns (batch or 0, dtype, device, values list, extras list)."""
    r, p = rp.rank, dplan.world_size
    n_r = rp.hi - rp.lo
    where = f"rank {r} (layers {rp.lo + 1}..{rp.hi})"
    if isinstance(values, (str, bytes, torch.Tensor)) or not hasattr(values, "__len__"):
        raise TypeError(f"{where}: local_values: expected a sequence of {n_r} tensors, got {type(values).__name__}")
    values = list(values)
    if len(values) != n_r:
        raise ValueError(f"{where}: local_values: expected {n_r} tensors (one per owned layer), got {len(values)}")
    if r == p - 1:
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"{where}: grad: the last rank needs dl/dx_{dplan.n} as a tensor of shape "
                            f"(B, {dplan.dims[-1]}), got {type(grad).__name__}")
    elif grad is not None:
        raise ValueError(f"{where}: grad: only rank {p - 1} (owner of layer {dplan.n}) takes grad; expected None, "
                         f"got {type(grad).__name__}")
    if extra is None:
        extra = [None] * (n_r + 1)
    elif isinstance(extra, torch.Tensor) or not hasattr(extra, "__len__") or len(extra) != n_r + 1:
        got = len(extra) if hasattr(extra, "__len__") and not isinstance(extra, torch.Tensor) else type(extra).__name__
        raise ValueError(f"{where}: extra: expected {n_r + 1} entries (None or (B, d_i) for i = {rp.lo}..{rp.hi}), "
                         f"got {got}")
    extra = list(extra)
    if r != p - 1 and extra[-1] is not None:
        raise ValueError(f"{where}: extra[{n_r}] (index {rp.hi}) belongs to rank {r + 1}, whose slice starts at "
                         f"x_{rp.hi}; expected None here")
    batch = _infer_batch(values, extra, grad)
    first = next((t for t in [grad] + values if isinstance(t, torch.Tensor)), None)
    if first is None:
        raise TypeError(f"{where}: local_values: expected tensors, got {type(values[0]).__name__}")
    dtype, device = first.dtype, first.device
    dummy = grad if r == p - 1 else torch.empty(max(batch, 1), dplan.dims[rp.hi], dtype=dtype, device=device)
    try:
        local = rp.local
        check_inputs(local.n, local.nnz, local.dims, local.dtype, local.device, values, dummy, extra, False)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{where}: {exc}") from exc
    return batch, dtype, device, values, extra


def _signature(values: Sequence[torch.Tensor], extra: Sequence[Optional[torch.Tensor]]) -> tuple[tuple, tuple]:
    return tuple(v.dim() == 1 for v in values), tuple(e is not None for e in extra)


def _reduce_slice(rp: RankPlan, values: list, extra: list) -> tuple:
    """The slice's element ``(M_r values, v_r or None)`` from its composite plan."""
    ext = list(extra[:-1]) + [None]
    shared, has_extra = _signature(values, ext)
    res = rp.reduce.bind(shared, has_extra, values[0].device).run(values, extra=ext if any(has_extra) else None,
                                                                   check=False)
    v = res.composite_vector
    return res.composite, (None if v is None else v.clone())


def _compose(rp: RankPlan, k: int, partial: tuple, piece: tuple) -> tuple:
    """``(M_own, v_own) ∘ (M_got, v_got) = (M_own M_got, M_own v_got + v_own)``; a piece ``(None, g)`` is a vector."""
    (mo, vo), (mg, vg) = partial, piece
    plan = rp.compose[k]
    if mg is None:  # the piece holds the gradient: one mat-vec, g = M_own g_got + v_own
        ext = [vo, None]
        res = plan.bind((mo.dim() == 1,), (vo is not None, False), mo.device).run([mo], vg, ext, check=False)
        return None, res[0].clone()
    ext = [vo, vg, None]
    shared, has_extra = _signature([mo, mg], ext)
    res = plan.bind(shared, has_extra, mo.device).run([mo, mg], extra=ext if any(has_extra) else None, check=False)
    v = res.composite_vector
    return res.composite, (None if v is None else v.clone())


def _boundary(rp: RankPlan, received: list) -> torch.Tensor:
    """``dl/dx_hi`` from the pieces received: matrices in round order, the last one the gradient."""
    _, (m_last, g) = received[-1]
    assert m_last is None, "the last piece a rank receives contains the gradient"
    mats = [m for _, (m, _) in received[:-1]]
    if not mats:
        return g
    ext = [v for _, (_, v) in received[:-1]] + [None]
    shared, has_extra = _signature(mats, ext)
    res = rp.boundary.bind(shared, has_extra, g.device).run(mats, g, ext if any(has_extra) else None, check=False)
    return res[0].clone()


def backward(dplan: DistributedPlan, local_values: Sequence[torch.Tensor], grad: Optional[torch.Tensor] = None,
             group=None, extra: Optional[Sequence[Optional[torch.Tensor]]] = None,
             timeout: Optional[float] = None) -> SliceGrads:
    """Model-parallel backward: this rank's ``dl/dx_i`` for ``i = b_r .. b_{r+1}``.

    Every rank of ``group`` (default: the world) calls it once per step with its own slice.

    Args:
        dplan: from :func:`plan` (same arguments on every rank); ``group.size()`` must be ``p``.
        local_values: ``b_{r+1} - b_r`` tensors, the values of ``J_i^T`` for the owned layers
            ``i = b_r+1 .. b_{r+1}`` in CSR order, ``(B, nnz_i)`` or ``(nnz_i,)``.
        grad: ``(B, d_n)`` on the last rank; ``None`` elsewhere.
        extra: optional ``b_{r+1} - b_r + 1`` entries, ``None`` or ``(B, d_i)`` for
            ``i = b_r .. b_{r+1}``, added to ``dl/dx_i`` (affine scan). The last entry
            (index ``b_{r+1}``) belongs to the next rank and must be ``None`` except on the last rank.
        timeout: seconds to wait for any one communication step before raising :class:`PeerError`
            (default: the process group's timeout).

    Returns:
        :class:`SliceGrads`: ``b_{r+1} - b_r + 1`` tensors ``(B, d_i)``, ``[0]`` being the slice's
        input boundary ``dl/dx_{b_r}``; ``.stats`` counts the communication.

    Raises:
        ValueError/TypeError on the rank whose input is bad (naming the rank, expected and actual),
        and :class:`PeerError` on every other rank, after one status all-reduce (no hang).
    """
    if not isinstance(dplan, DistributedPlan):
        raise TypeError(f"dplan: expected a spscan.distributed.DistributedPlan, got {type(dplan).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call dist.init_process_group first")
    p = dplan.world_size
    size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if size != p:
        raise ValueError(f"rank {rank}: the plan is for world_size={p}, the process group has {size} ranks")
    stats = CommStats(rank, p)
    comm = _Comm(group, stats, timeout)
    t0 = time.perf_counter()

    # 1. local validation, then one status all-reduce so that a bad rank fails everywhere
    status_err: Optional[BaseException] = None
    batch, dtype, device = 0, torch.float32, torch.device("cpu")
    try:
        rp = dplan.rank_plan(rank)
        batch, dtype, device, values, extra_l = _check_local(dplan, rp, local_values, grad, extra)
    except Exception as exc:  # any local failure must still reach the status all-reduce, or peers hang
        status_err = exc
        if isinstance(grad, torch.Tensor):
            device = grad.device
        elif isinstance(local_values, (list, tuple)) and local_values and isinstance(local_values[0], torch.Tensor):
            device = local_values[0].device
    status = torch.zeros(p, _STATUS, dtype=torch.int64)
    if status_err is not None:
        status[rank, 0] = 1
    else:
        shared = all(v.dim() == 1 for v in values)
        has = any(e is not None for e in extra_l[:-1])
        status[rank] = torch.tensor([0, batch, _DTYPES[dtype], int(has), int(shared)], dtype=torch.int64)
    status = status.to(_comm_device(group, device))
    comm.all_reduce(status, "status all-reduce before the scan rounds")
    grad_batch, has_extra, shared_r = _read_status(status.cpu(), rank, status_err)
    stats.planned_bytes_sent, stats.planned_bytes_received = dplan.planned_bytes(rank, grad_batch, dtype, shared_r,
                                                                                   has_extra)

    last = p - 1
    t1 = time.perf_counter()
    with torch.no_grad():
        # 2. the rank's element: the spine vector (last rank) or its slice's affine composite
        local_grads = None
        if rank == last:
            local_grads = _scan_backward(rp.local, values, grad, extra=extra_l)
            partial: tuple = (None, local_grads[0])
        elif dplan.sends(rank, 0):
            partial = _reduce_slice(rp, values, extra_l)
        else:
            partial = (None, None)  # rank 0 of p > 1 only receives
        t2 = time.perf_counter()
        # 3. recursive doubling
        received = _scan_rounds(dplan, rp, comm, partial, grad_batch, shared_r, has_extra, dtype, device)
        t3 = time.perf_counter()
        # 4. boundary gradient: apply the received pieces to the spine vector, innermost first
        if rank != last:
            local_grads = _scan_backward(rp.local, values, _boundary(rp, received), extra=extra_l)
    stats.seconds = {"status": t1 - t0, "local": t2 - t1, "rounds": t3 - t2, "finish": time.perf_counter() - t3}
    return SliceGrads(list(local_grads), rp.lo, stats)


def _read_status(status: torch.Tensor, rank: int, status_err: Optional[BaseException]
                 ) -> tuple[int, list[bool], list[bool]]:
    """Check the all-reduced status table (the same on every rank): ``(the gradient's batch, has
    extra per rank, all shared per rank)``. Raises this rank's own error if it failed, else
    :class:`PeerError` if another did, and ``ValueError`` on dtypes or batch sizes that differ."""
    p = status.shape[0]
    failed = [r for r in range(p) if status[r, 0]]
    if failed:
        if status_err is not None:
            raise status_err
        raise PeerError(f"rank {rank}: no gradients computed: rank(s) {failed} rejected their inputs "
                        "(their own errors say why)")
    grad_batch = int(status[p - 1, 1])
    codes = {int(c) for c in status[:, 2]}
    if len(codes) != 1:
        names = {v: k for k, v in _DTYPES.items()}
        got = [str(names[int(c)]).replace("torch.", "") for c in status[:, 2]]
        raise ValueError(f"rank {rank}: dtypes differ across ranks: expected one dtype, got {got} (by rank)")
    wrong = [(r, int(status[r, 1])) for r in range(p) if int(status[r, 1]) not in (0, grad_batch)]
    if wrong:
        raise ValueError(f"rank {rank}: batch sizes differ: rank {p - 1}'s grad has batch {grad_batch}, "
                         f"got {wrong} as (rank, batch)")
    return grad_batch, [bool(status[r, 3]) for r in range(p)], [bool(status[r, 4]) for r in range(p)]


def _scan_rounds(dplan: DistributedPlan, rp: RankPlan, comm: _Comm, partial: tuple, batch: int,
                 shared: Sequence[bool], has_extra: Sequence[bool], dtype: torch.dtype, device: torch.device
                 ) -> list[tuple]:
    """The rounds of recursive doubling: round ``k`` pairs rank ``r`` with ``r - 2^k`` (send) and
    ``r + 2^k`` (receive). Returns the pieces received, ``(round, (matrix or None, vector or None))``."""
    rank = rp.rank
    received: list[tuple] = []
    for k in range(dplan.rounds):
        dst, src = dplan.send_peer(rank, k), dplan.recv_peer(rank, k)
        payload = buf = None
        if dst is not None:
            m, v = partial
            parts = ([] if m is None else [m.reshape(-1)]) + ([] if v is None else [v.reshape(-1)])
            payload = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
        if src is not None:
            numel = dplan.message_numel(src, k, batch, shared, has_extra)
            buf = torch.empty(numel, dtype=dtype, device=device)
        comm.exchange(k, dst, payload, src, buf)
        if src is None:
            continue
        piece = _unpack(dplan, src, k, buf, batch, shared, has_extra)
        received.append((k, piece))
        if k + 1 < dplan.rounds and dplan.sends(rank, k + 1):
            partial = _compose(rp, k, partial, piece)
    return received


def _unpack(dplan: DistributedPlan, src: int, k: int, buf: torch.Tensor, batch: int, shared: Sequence[bool],
            has_extra: Sequence[bool]) -> tuple:
    """Split a received message into ``(matrix values or None, vector or None)``."""
    pat = dplan.partial_pattern(src, k)
    rows = dplan.dims[dplan.bounds[src]]
    if pat is None:
        return None, buf.view(batch, rows)
    first, last = dplan.partial_range(src, k)
    if all(shared[first: last + 1]):
        m, off = buf[: pat.nnz], pat.nnz
    else:
        m, off = buf[: batch * pat.nnz].view(batch, pat.nnz), batch * pat.nnz
    v = buf[off:].view(batch, rows) if any(has_extra[first: last + 1]) else None
    return m, v


# ----------------------------------------------------------------------------- local launcher


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _local_worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, pg_timeout: float,
                  threads: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    result: tuple = (rank, False, "no result")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        try:
            result = (rank, True, fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which re-raises per rank
        import traceback

        result = (rank, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    queue.put(result)
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # the result is delivered: skip the interpreter teardown, which is slow with torch loaded
    os._exit(0)


def run_local(fn: Callable, world_size: int, args: tuple = (), timeout: float = 120.0, pg_timeout: float = 30.0,
              threads: int = 1) -> list[tuple[bool, Any]]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh CPU processes (Gloo, 127.0.0.1).

    For tests and CPU benchmarks. ``fn`` must be importable (module level). Each process joins a
    process group on a free localhost port with a ``pg_timeout``-second timeout and destroys it
    at the end. Returns, per rank, ``(True, fn's return value)`` or ``(False, error text)``; a
    rank that reports nothing within ``timeout`` seconds is killed and reported as failed.
    """
    import queue as _queue

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_local_worker, args=(r, world_size, port, fn, args, q, pg_timeout, threads),
                         daemon=True) for r in range(world_size)]
    for pr in procs:
        pr.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            r, ok, out = q.get(timeout=min(left, 1.0))
        except _queue.Empty:
            if all(not pr.is_alive() for pr in procs) and q.empty():
                break
            continue
        results[r] = (ok, out)
    for pr in procs:
        pr.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
        if pr.is_alive():
            pr.kill()
            pr.join()
    return [results.get(r, (False, f"rank {r}: no result within {timeout:.0f}s (killed)")) for r in range(world_size)]
