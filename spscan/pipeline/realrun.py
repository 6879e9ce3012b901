"""Real model-parallel training steps on one machine: ``torch.distributed.pipelining`` schedules and
spscan's model-parallel scan, as Gloo CPU processes, on the same MLP chain.

The model is ``Linear(d_0, d_1), ReLU, Linear(d_1, d_2), ReLU, ..., Linear(d_{L-1}, d_L)``; every
module is one layer of the chain (its transposed Jacobian: ``W`` for a linear layer, shared by the
batch; ``diag(x > 0)`` per sample for a ReLU). A method cuts it into stages of whole modules.

:func:`compare` runs ``torch.distributed.pipelining`` schedule classes and spscan's scan in one
set of processes, interleaved step by step. spscan's step: forward of the whole batch slice by
slice, the model-parallel scan (:func:`spscan.distributed.backward`) for every ``dl/dx_i``, then
each layer's weight gradient from its own ``dl/dx_i`` (``g^T x`` for a linear layer).

It returns, per rank and method, the measured step times with a trace of every call the step
made (wall and CPU time: compute actions, message posts and waits, loss, optimizer), the bytes
sent per step, the peak resident memory growth during a step and the parameter gradients of the
last step as NumPy arrays keyed like ``model.named_parameters()`` (to compare against
single-process autograd), plus the calibration measurements of the simulator, taken in the same
processes between the timed steps: isolated stage costs, optimizer steps and Gloo ping-pong.

:func:`predicted_timeline` turns the calibration (and :func:`runtime_overheads` of a run of a
negligible-compute model) into the simulator's prediction of each method's step;
:func:`step_times` gives the measured ones.
"""

from __future__ import annotations

import re
import time
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from spscan.pipeline.simulator import LayerCosts, Link, Overheads, Timeline

__all__ = ["build_mlp", "chain_patterns", "chain_values", "stage_bounds", "compare", "reference_grads", "fit_link",
           "step_times", "step_breakdown", "runtime_overheads", "calibrated_link", "calibrated_costs",
           "calibrated_overheads", "round_loads", "busy_per_device", "measured_cpu", "step_cpu_shares",
           "explained_step_times", "predicted_step_times",
           "predicted_timeline", "SINGLE_STAGE", "MULTI_STAGE"]

SINGLE_STAGE = ("GPipe", "1F1B")
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def build_mlp(dims: Sequence[int], seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """``Linear(d_0, d_1), ReLU, ..., Linear(d_{L-1}, d_L)``: ``2L - 1`` modules, one chain layer each."""
    if len(dims) < 2:
        raise ValueError(f"dims: expected at least 2 sizes (input, output), got {list(dims)}")
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for i in range(len(dims) - 1):
        mods.append(nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods).to(dtype)


def chain_patterns(model: nn.Sequential) -> list[sp.csr_array]:
    """Transposed-Jacobian pattern of every module: dense ``(in, out)`` for ``Linear``, diagonal for ``ReLU``."""
    pats = []
    for i, mod in enumerate(model):
        if isinstance(mod, nn.Linear):
            d_in, d_out = mod.in_features, mod.out_features
            pats.append(sp.csr_array(np.ones((d_in, d_out))))
        elif isinstance(mod, nn.ReLU):
            d = pats[-1].shape[1] if pats else None
            if d is None:
                raise ValueError(f"module {i}: a ReLU first has no known width")
            pats.append(sp.csr_array(sp.eye(d, format="csr")))
        else:
            raise TypeError(f"module {i}: expected nn.Linear or nn.ReLU, got {type(mod).__name__}")
    for p in pats:
        p.sort_indices()
    return pats


def chain_values(mod: nn.Module, x_in: torch.Tensor) -> torch.Tensor:
    """Values of the module's ``J^T`` in its pattern's CSR order: ``W^T`` row-major ``(nnz,)`` (shared)
    for ``Linear``, ``(B, d)`` of ``x_in > 0`` for ``ReLU``."""
    if isinstance(mod, nn.Linear):
        return mod.weight.detach().t().contiguous().reshape(-1)
    if isinstance(mod, nn.ReLU):
        return (x_in > 0).to(x_in.dtype)
    raise TypeError(f"expected nn.Linear or nn.ReLU, got {type(mod).__name__}")


def stage_bounds(n_modules: int, stages: int) -> list[int]:
    """Cut ``n_modules`` into ``stages`` contiguous groups of near-equal size: ``[0, ..., n]``."""
    if not 1 <= stages <= n_modules:
        raise ValueError(f"stages: expected 1..{n_modules}, got {stages}")
    return [round(s * n_modules / stages) for s in range(stages + 1)]


def reference_grads(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Single-process autograd gradients of ``cross_entropy(model(x), y)`` (mean), in parameter order."""
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _data(cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.get("data_seed", 1))
    dims = cfg["dims"]
    x = torch.randn(cfg["batch"], dims[0], generator=g, dtype=cfg.get("dtype", torch.float32))
    y = torch.randint(0, dims[-1], (cfg["batch"],), generator=g)
    return x, y


def _clear_peak() -> Optional[int]:
    """Reset this process's peak RSS (Linux ``clear_refs``); returns the current RSS in bytes, or None."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return _status("VmRSS")
    except OSError:
        return None


def _status(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _weight_grads(mod: nn.Module, x_in: torch.Tensor, g_out: torch.Tensor) -> list[torch.Tensor]:
    """``W`` of one module: ``dl/dW = g^T x``, ``dl/db = sum_rows g`` for ``Linear``; none for ``ReLU``."""
    if isinstance(mod, nn.Linear):
        gw = g_out.t() @ x_in
        return [gw, g_out.sum(0)] if mod.bias is not None else [gw]
    return []


def _schedstat() -> tuple[Optional[int], Optional[int]]:
    """This thread's ``(cpu ns, run-queue wait ns)`` from ``/proc/thread-self/schedstat``, or Nones."""
    try:
        with open("/proc/thread-self/schedstat") as fh:
            cpu, wait = fh.read().split()[:2]
        return int(cpu), int(wait)
    except (OSError, ValueError):
        return None, None


class _Trace:
    """Wall and CPU time of the calls a step makes, while ``on``: ``(label, start, end, cpu, cpu_start)``
    with ``start``/``end`` on the system-wide monotonic clock (comparable between the processes),
    ``cpu`` the calling thread's CPU seconds in the call and ``cpu_start`` its CPU clock at the start."""

    def __init__(self) -> None:
        self.on = False
        self.events: list[tuple[str, float, float, float, float]] = []

    def wrap(self, label: Any, fn: Any) -> Any:
        def traced(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = fn(*args, **kwargs)
            if self.on:
                name = label(args, kwargs) if callable(label) else label
                self.events.append((name, t0, time.perf_counter(), time.thread_time() - c0, c0))
            return out

        return traced

    def mark(self, label: str, t0: float, c0: float) -> None:
        if self.on:
            self.events.append((label, t0, time.perf_counter(), time.thread_time() - c0, c0))


class _TracedComms:
    """Within the block, ``torch.distributed.pipelining``'s point-to-point helpers record into ``trace``
    (``post``: posting ``isend``/``irecv``; ``wait``: waiting for them); restored on exit. Used only in
    the worker processes :func:`compare` starts."""

    def __init__(self, trace: _Trace) -> None:
        self.trace = trace

    def __enter__(self) -> "_TracedComms":
        from torch.distributed.pipelining import schedules as sch

        self.saved = (sch._wait_batch_p2p, sch._batch_p2p)
        sch._wait_batch_p2p = self.trace.wrap("wait", self.saved[0])
        sch._batch_p2p = self.trace.wrap("post", self.saved[1])
        return self

    def __exit__(self, *exc: Any) -> None:
        from torch.distributed.pipelining import schedules as sch

        sch._wait_batch_p2p, sch._batch_p2p = self.saved


def _median(ts: Sequence[float]) -> float:
    return float(np.median(ts)) if len(ts) else float("nan")


def _time_stage(mods: Sequence[nn.Module], x: torch.Tensor, y: Optional[torch.Tensor], first: bool
                ) -> dict[str, float]:
    """One sample (CPU seconds of this thread) of a pipeline stage's actions on micro-batch input ``x``,
    made with the functions ``torch.distributed.pipelining`` runs for them: ``F`` the forward with
    autograd recording (plus the loss on the last stage, ``y`` given), ``B`` its full backward
    (``stage_backward``), ``I`` its input step (``stage_backward_input``; none on the first stage, whose
    input needs no gradient) and ``W`` its weight step (``stage_backward_weight``, from what ``I`` kept)."""
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight

    sub = nn.Sequential(*mods)
    inp = x.detach().requires_grad_(not first)
    clock = time.thread_time

    def fwd() -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
        out = sub(inp)
        if y is not None:
            return nn.functional.cross_entropy(out, y), None
        return out, [torch.ones_like(out)]

    t0 = clock()
    out, g = fwd()
    tf = clock() - t0
    t0 = clock()
    stage_backward(out if g is None else [out], g, [inp])
    tb = clock() - t0
    ti = tw = 0.0
    if not first:
        out, g = fwd()
        t0 = clock()
        _, groups = stage_backward_input([out], g, [inp], sub.parameters())
        ti = clock() - t0
        t0 = clock()
        stage_backward_weight(sub.parameters(), groups)
        tw = clock() - t0
    for q in sub.parameters():
        q.grad = None
    return {"F": tf, "B": tb, "I": ti, "W": tw}


def _burst_share(mods: Sequence[nn.Module], x: torch.Tensor, bursts: int = 8, pause: float = 5e-4
                 ) -> tuple[float, float]:
    """``(CPU s, wall s)`` of ``bursts`` forwards of ``mods`` on ``x``, each after a ``pause`` asleep: the
    share of a core a thread gets when, like a pipeline rank, it computes for a millisecond or two at a
    time between waits (a scheduler favours such threads over ones that never sleep)."""
    cpu = wall = 0.0
    for _ in range(bursts):
        time.sleep(pause)
        t0, c0 = time.perf_counter(), time.thread_time()
        with torch.no_grad():
            h = x
            for m_ in mods:
                h = m_(h)
        cpu += time.thread_time() - c0
        wall += time.perf_counter() - t0
    return cpu, wall


def _ping_pong(rank: int, sizes: Sequence[int], reps: int, blocking: bool) -> Optional[dict[int, list[float]]]:
    """One-way seconds per message of ``n`` bytes between ranks 0 and 1 (``reps`` round trips / 2), with
    ``isend``/``irecv`` + ``wait`` (as torch's schedules) or blocking ``send``/``recv`` (as spscan's
    scan). Ranks above 1 return None."""
    import torch.distributed as dist

    if rank > 1:
        return None
    peer = 1 - rank
    out = {}
    for n in sizes:
        buf = torch.zeros(max(1, n // 4))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if blocking:
                if rank == 0:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
            else:
                if rank == 0:
                    dist.isend(buf, peer).wait()
                    dist.irecv(buf, peer).wait()
                else:
                    dist.irecv(buf, peer).wait()
                    dist.isend(buf, peer).wait()
            ts.append((time.perf_counter() - t0) / 2)
        out[int(n)] = ts
    return out


def fit_link(one_way: dict[int, float], blocking: bool = False) -> Link:
    """``latency + bytes / bandwidth`` fitted to ping-pong one-way times ``{bytes: seconds}``: the line
    through the smallest message's time (mostly latency) closest, in least squares, to the larger
    messages' (Hockney's model; a free intercept goes negative on noisy timings)."""
    n = np.array(sorted(one_way), dtype=np.float64)
    t = np.array([one_way[int(k)] for k in n])
    dn, dt = n[1:] - n[0], t[1:] - t[0]
    slope = float(dn @ dt / (dn @ dn)) if len(n) > 1 and dn @ dn > 0 else 0.0
    if slope <= 1e-15:  # no measurable size dependence (above a petabyte per second): latency only
        return Link(float(max(t[0], 0.0)), blocking=blocking)
    return Link(float(max(t[0] - slope * n[0], 0.0)), float(1.0 / slope), blocking=blocking)


def _dims_at(model: nn.Sequential, d0: int) -> list[int]:
    """``d_0 .. d_n``: the width after every module."""
    dims = [d0]
    for mod in model:
        dims.append(mod.out_features if isinstance(mod, nn.Linear) else dims[-1])
    return dims


def _stage_owner(name: str, world: int) -> tuple[int, dict[int, int]]:
    """Number of stages and ``stage -> rank`` for a torch schedule class name."""
    if name in ("ZBVZeroBubble", "DualPipeV"):
        return 2 * world, {**{r: r for r in range(world)}, **{2 * world - 1 - r: r for r in range(world)}}
    if name in MULTI_STAGE:
        return 2 * world, {s: s % world for s in range(2 * world)}
    if name in SINGLE_STAGE:
        return world, {r: r for r in range(world)}
    raise ValueError(f"schedule: expected one of {SINGLE_STAGE + MULTI_STAGE} or 'scan', got {name!r}")


class _TorchRunner:
    """One ``torch.distributed.pipelining`` schedule on this rank (its own copy of the model)."""

    def __init__(self, name: str, rank: int, world: int, cfg: dict, x: torch.Tensor, y: torch.Tensor) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        self.name, self.rank, self.x, self.y = name, rank, x, y
        model = build_mlp(cfg["dims"], cfg.get("seed", 0), cfg.get("dtype", torch.float32))
        self.n_stages, owner = _stage_owner(name, world)
        self.bounds = stage_bounds(len(model), self.n_stages)
        self.mine = [s for s in range(self.n_stages) if owner[s] == rank]
        self.stages = [PipelineStage(nn.Sequential(*list(model)[self.bounds[s]:self.bounds[s + 1]]), s, self.n_stages,
                                     torch.device("cpu")) for s in self.mine]
        cls = schedules.get_schedule_class(name)
        multi = name in MULTI_STAGE
        self.sched = cls(self.stages if multi else self.stages[0], cfg["microbatches"],
                         loss_fn=nn.functional.cross_entropy)
        self.opt = torch.optim.SGD([q for st in self.stages for q in st.submod.parameters()], lr=cfg.get("lr", 0.01))
        self.update = cfg.get("update", True)
        # every compute action the schedule runs, every p2p post and wait, the loss and the optimizer
        self.trace = _Trace()
        for st in self.stages:
            st.forward_one_chunk = self.trace.wrap(_action_label(st.stage_index, "F"), st.forward_one_chunk)
            st.backward_one_chunk = self.trace.wrap(_action_label(st.stage_index, "B"), st.backward_one_chunk)
            st.backward_weight_one_chunk = self.trace.wrap(_action_label(st.stage_index, "W"),
                                                           st.backward_weight_one_chunk)
        self.sched._compute_loss = self.trace.wrap("loss", self.sched._compute_loss)
        dims = _dims_at(model, cfg["dims"][0])
        elem = x.element_size()
        # per step, every cut between stages on different ranks carries the activations of all
        # micro-batches forward and their gradients back
        self.bytes_sent = 0
        self.message_bytes = set()
        for st in range(self.n_stages - 1):
            if owner[st] != owner[st + 1]:
                act = cfg["batch"] * dims[self.bounds[st + 1]] * elem
                self.bytes_sent += act * ((owner[st] == rank) + (owner[st + 1] == rank))
                self.message_bytes.add(act // cfg["microbatches"])

    def step(self) -> None:
        with _TracedComms(self.trace):
            self.opt.zero_grad(set_to_none=True)
            args = (self.x,) if 0 in self.mine else ()
            kw: dict[str, Any] = {"target": self.y, "losses": []} if self.n_stages - 1 in self.mine else {}
            self.sched.step(*args, **kw)
            if self.update:
                t0, c0 = time.perf_counter(), time.thread_time()
                self.opt.step()
                self.trace.mark("opt", t0, c0)

    def params(self) -> list[torch.Tensor]:
        return [q for st in self.stages for q in st.submod.parameters()]

    def grads(self) -> dict[str, np.ndarray]:
        return {f"{self.bounds[s] + int(k.split('.')[0])}.{k.split('.', 1)[1]}": q.grad.detach().numpy().copy()
                for st, s in zip(self.stages, self.mine) for k, q in st.submod.named_parameters()}


def _action_label(stage: int, kind: str) -> Any:
    """Label of a traced stage call in torch's action form ``"{stage}{kind}{microbatch}"`` (``B`` with
    ``full_backward=False`` is torch's ``I``)."""

    def label(args: tuple, kwargs: dict) -> str:
        mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", ""))
        k = "I" if kind == "B" and not kwargs.get("full_backward", True) else kind
        return f"{stage}{k}{mb}"

    return label


class _ScanRunner:
    """spscan's model-parallel step on this rank: forward slice by slice, the scan, per-layer ``W``."""

    def __init__(self, rank: int, world: int, cfg: dict, x: torch.Tensor, y: torch.Tensor) -> None:
        import spscan.distributed as D

        self.D, self.rank, self.world, self.x, self.y = D, rank, world, x, y
        self.dtype = cfg.get("dtype", torch.float32)
        model = build_mlp(cfg["dims"], cfg.get("seed", 0), self.dtype)
        self.pats = chain_patterns(model)
        self.bounds = stage_bounds(len(model), world)
        self.dplan = D.plan(self.pats, world, slices=self.bounds, rank=rank, levels=cfg.get("levels", 0),
                            backend="torch")
        self.lo, self.hi = self.bounds[rank], self.bounds[rank + 1]
        self.mods = list(model)[self.lo:self.hi]
        self.model = model
        self.opt = torch.optim.SGD([q for m in self.mods for q in m.parameters()], lr=cfg.get("lr", 0.01))
        self.update = cfg.get("update", True)
        self.dims = _dims_at(model, cfg["dims"][0])
        self.batch = cfg["batch"]
        self.bytes_sent = 0
        self.trace = _Trace()
        self.seconds: list[dict] = []
        elem = x.element_size()
        self.message_bytes = {self.batch * self.dims[b] * elem for b in self.bounds[1:-1]}

    def step(self) -> None:
        import torch.distributed as dist

        tr = self.trace
        t0, c0 = time.perf_counter(), time.thread_time()
        if self.rank == 0:
            h = self.x
        else:
            h = torch.empty(self.batch, self.dims[self.lo], dtype=self.dtype)
            dist.recv(h, self.rank - 1)
            tr.mark("wait", t0, c0)
        t0, c0 = time.perf_counter(), time.thread_time()
        inputs, values = [], []
        with torch.no_grad():
            for m in self.mods:
                inputs.append(h)
                values.append(chain_values(m, h))
                h = m(h)
        tr.mark(f"{self.rank}F", t0, c0)
        fwd_sent, grad = 0, None
        t0, c0 = time.perf_counter(), time.thread_time()
        if self.rank < self.world - 1:
            dist.send(h.contiguous(), self.rank + 1)
            fwd_sent = h.numel() * h.element_size()
            tr.mark("send", t0, c0)
        else:
            out = h.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(nn.functional.cross_entropy(out, self.y), out)
            tr.mark("loss", t0, c0)
        t0, c0 = time.perf_counter(), time.thread_time()
        g = self.D.backward(self.dplan, values, grad)
        tr.mark(f"{self.rank}S", t0, c0)
        t0, c0 = time.perf_counter(), time.thread_time()
        for p_ in self.opt.param_groups[0]["params"]:
            p_.grad = None
        with torch.no_grad():
            for k, m in enumerate(self.mods):  # g[k + 1] is dl/dx at module k's output
                for p_, gp in zip(m.parameters(), _weight_grads(m, inputs[k], g[k + 1])):
                    p_.grad = gp
        tr.mark(f"{self.rank}W", t0, c0)
        if self.update:
            t0, c0 = time.perf_counter(), time.thread_time()
            self.opt.step()
            tr.mark("opt", t0, c0)
        self.bytes_sent = fwd_sent + g.stats.bytes_sent
        if tr.on:
            self.seconds.append(dict(g.stats.seconds))

    def params(self) -> list[torch.Tensor]:
        return [q for m in self.mods for q in m.parameters()]

    def grads(self) -> dict[str, np.ndarray]:
        return {f"{self.lo + k}.{n}": q.grad.detach().numpy().copy() for k, m in enumerate(self.mods)
                for n, q in m.named_parameters()}

    def slice_sample(self, local: Any) -> dict[str, float]:
        """One sample (CPU seconds of this thread) of this slice's costs on the whole batch, made with
        the step's own calls:
        ``F`` the forward with the Jacobian values, ``loss`` (last rank), ``I`` the slice's local scan
        backward (``local``: a one-rank plan of the slice), ``W`` every layer's ``g^T x``."""
        import spscan

        with torch.no_grad():
            h = self.x
            for m in list(self.model)[:self.lo]:
                h = m(h)
        t0 = time.thread_time()
        inputs, vals = [], []
        with torch.no_grad():
            for m in self.mods:
                inputs.append(h)
                vals.append(chain_values(m, h))
                h = m(h)
        tf = time.thread_time() - t0
        tl = 0.0
        gy = torch.ones_like(h)
        if self.rank == self.world - 1:
            t0 = time.thread_time()
            out = h.detach().requires_grad_(True)
            (gy,) = torch.autograd.grad(nn.functional.cross_entropy(out, self.y), out)
            tl = time.thread_time() - t0
        t0 = time.thread_time()
        g = spscan.backward(local, vals, gy)
        ti = time.thread_time() - t0
        t0 = time.thread_time()
        with torch.no_grad():
            for k, m in enumerate(self.mods):
                _weight_grads(m, inputs[k], g[k + 1])
        tw = time.thread_time() - t0
        return {"F": tf, "loss": tl, "I": ti, "W": tw}


def _opt_sample(params: Sequence[torch.Tensor], lr: float) -> float:
    """One SGD step (and gradient reset) over copies of ``params`` with gradients: CPU seconds."""
    qs = [q.detach().clone().requires_grad_(True) for q in params]
    for q in qs:
        q.grad = torch.ones_like(q)
    opt = torch.optim.SGD(qs, lr=lr)
    t0 = time.thread_time()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.thread_time() - t0


class _Calibration:
    """The measurements that calibrate the simulator, taken between the timed steps (one sample per
    round) and never from the steps themselves: every owned pipeline stage's ``F``/``B``/``I``/``W``
    on one micro-batch, the scan slice's costs on the whole batch and the optimizer step of every
    method, in CPU seconds of the calling thread (what they cost on a core of their own, whatever
    else the machine runs), and Gloo ping-pong at the run's message sizes (wall time)."""

    def __init__(self, rank: int, world: int, cfg: dict, runners: dict, x: torch.Tensor, y: torch.Tensor) -> None:
        import spscan

        self.rank, self.world, self.cfg, self.runners = rank, world, cfg, runners
        self.model = build_mlp(cfg["dims"], cfg.get("seed", 0), cfg.get("dtype", torch.float32))
        mb = cfg["batch"] // cfg["microbatches"]
        self.x_mb, self.y_mb = x[:mb], y[:mb]
        with torch.no_grad():
            hs = [self.x_mb]
            for m in self.model:
                hs.append(m(hs[-1]))
        self.h_mb = hs
        self.stages: dict[str, tuple[int, int, bool, bool]] = {}
        for name, rn in runners.items():
            if name == "scan":
                continue
            for s in rn.mine:
                lo, hi = rn.bounds[s], rn.bounds[s + 1]
                self.stages[_stage_key(rn.bounds, s)] = (lo, hi, s == 0, s == rn.n_stages - 1)
        sizes = {4}
        for rn in runners.values():
            sizes |= {int(b) for b in rn.message_bytes}
        self.sizes = sorted(sizes)
        self.local = None
        if "scan" in runners:
            sc = runners["scan"]
            self.local = spscan.plan(sc.pats[sc.lo:sc.hi], levels=0, backend="torch")
        self.samples: dict[str, list] = {"stage": [], "scan": [], "opt": [], "async": [], "blocking": [], "share": [],
                                         "burst": []}

    def sample(self, reps: int = 3) -> None:
        # the compute probes also give this round's CPU share: their CPU time over their wall time
        t0, c0 = time.perf_counter(), time.thread_time()
        st = {}
        for key, (lo, hi, first, last) in self.stages.items():
            st[key] = _time_stage(list(self.model)[lo:hi], self.h_mb[lo], self.y_mb if last else None, first)
        self.samples["stage"].append(st)
        if self.local is not None:
            self.samples["scan"].append(self.runners["scan"].slice_sample(self.local))
        lr = self.cfg.get("lr", 0.01)
        self.samples["opt"].append({n: _opt_sample(rn.params(), lr) for n, rn in self.runners.items()})
        self.samples["share"].append((time.thread_time() - c0, time.perf_counter() - t0))
        lo, hi, _, _ = next(iter(self.stages.values())) if self.stages else (0, len(self.model), True, True)
        self.samples["burst"].append(_burst_share(list(self.model)[lo:hi], self.h_mb[lo]))
        if self.world > 1:
            self.samples["async"].append(_ping_pong(self.rank, self.sizes, reps, blocking=False))
            if "scan" in self.runners:
                self.samples["blocking"].append(_ping_pong(self.rank, self.sizes, reps, blocking=True))

    def result(self) -> dict:
        def med(rows: list[dict]) -> dict:
            return {k: _median([r[k] for r in rows]) for k in rows[0]} if rows else {}

        out: dict[str, Any] = {"sizes": self.sizes}
        out["stage"] = {k: med([r[k] for r in self.samples["stage"]]) for k in self.stages} \
            if self.samples["stage"] else {}
        out["stage_spread"] = {k: {a: [float(np.percentile([r[k][a] for r in self.samples["stage"]], q))
                                       for q in (10, 90)] for a in "FBIW"} for k in self.stages} \
            if self.samples["stage"] else {}
        out["scan"] = med(self.samples["scan"])
        # per round: (CPU s, wall s) of the compute probes, and one-way seconds per message size
        out["rounds"] = {"share": self.samples["share"], "burst": self.samples["burst"],
                         "async": [None if r is None else {n: _median(v) for n, v in r.items()}
                                   for r in self.samples["async"]],
                         "blocking": [None if r is None else {n: _median(v) for n, v in r.items()}
                                      for r in self.samples["blocking"]]}
        out["opt"] = med(self.samples["opt"])
        for kind in ("async", "blocking"):
            rows = [r for r in self.samples[kind] if r is not None]
            # the fastest message of each size: the link itself, as little of the machine's load as seen
            out[kind] = {n: float(min(t for r in rows for t in r[n])) for n in self.sizes} if rows else None
            out[kind + "_median"] = {n: _median([t for r in rows for t in r[n]]) for n in self.sizes} \
                if rows else None
        return out


def _stage_key(bounds: Sequence[int], s: int) -> str:
    """``"0,4,8,11,15/2"``: stage ``s`` of the cut ``bounds``."""
    return ",".join(str(b) for b in bounds) + f"/{s}"


def _compare_worker(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist

    x, y = _data(cfg)
    runners = {name: (_ScanRunner(rank, world, cfg, x, y) if name == "scan" else
                      _TorchRunner(name, rank, world, cfg, x, y)) for name in cfg["methods"]}
    calib = _Calibration(rank, world, cfg, runners, x, y)
    dist.barrier()  # every rank has built its runners
    steps: dict[str, list[dict]] = {n: [] for n in runners}
    names = list(runners)
    for it in range(cfg["warmup"] + cfg["steps"]):
        timed = it >= cfg["warmup"]
        # rotate the order every round so that no method always runs first
        for j in range(len(names)):
            name = names[(it + j) % len(names)]
            rn = runners[name]
            rn.trace.events = []
            rn.trace.on = timed
            dist.barrier()
            cpu0, wait0 = _schedstat()
            t0, tc0 = time.perf_counter(), time.thread_time()
            rn.step()
            t1 = time.perf_counter()
            cpu1, wait1 = _schedstat()
            rn.trace.on = False
            dist.barrier()
            if timed:
                steps[name].append({"start": t0, "end": t1, "cpu_start": tc0, "events": rn.trace.events,
                                    "cpu": (cpu1 - cpu0) * 1e-9 if cpu0 is not None else None,
                                    "run_wait": (wait1 - wait0) * 1e-9 if wait0 is not None else None})
        if timed:
            dist.barrier()
            calib.sample()
    if not calib.samples["opt"]:
        calib.sample()
    # peak memory: one more step of every method, untimed (the RSS reset stays out of the timed steps)
    peak: dict[str, Optional[int]] = {}
    for name in names:
        dist.barrier()
        base = _clear_peak()
        runners[name].step()
        hwm = _status("VmHWM")
        peak[name] = hwm - base if base is not None and hwm is not None else None
    dist.barrier()
    cal = calib.result()
    link = None
    if cal.get("async"):
        lk = fit_link(cal["async"])
        link = (lk.latency, lk.bandwidth)
    out = {"rank": rank, "link": link, "calibration": cal, "methods": {}}
    for name, rn in runners.items():
        out["methods"][name] = {
            "times": [s["end"] - s["start"] for s in steps[name]], "steps": steps[name],
            "bytes_sent": rn.bytes_sent, "peak_rss_growth": peak.get(name),
            "bounds": rn.bounds, "stages": getattr(rn, "mine", [rank]),
            "scan_seconds": getattr(rn, "seconds", None),
            "grads": rn.grads() if cfg.get("return_grads") else None}
    return out


def compare(cfg: dict, methods: Sequence[str], world: int = 2, timeout: float = 600.0) -> list[dict]:
    """Train the MLP with every method in ``methods`` (torch schedule class names and ``"scan"``) on
    ``world`` Gloo processes, interleaved round by round (each round runs one step of every
    method, in a rotating order, then one sample of every calibration measurement), so that all
    methods and the calibration see the same machine load.

    ``cfg``: ``dims`` (layer widths), ``batch``, ``microbatches``, ``warmup``, ``steps``; optional
    ``seed``, ``lr``, ``update`` (default True: SGD step after each step), ``return_grads``,
    ``dtype``, ``threads`` (per process, default 1), ``levels`` (scan).

    Returns, per rank: ``link`` (one-way latency s, bandwidth B/s between ranks 0 and 1, fitted to
    the ``isend``/``irecv`` ping-pong), ``calibration`` (medians over the rounds, CPU seconds:
    ``stage``: every owned pipeline stage's ``F``/``B``/``I``/``W`` on one micro-batch keyed by
    ``"bounds/stage"``; ``scan``: the scan slice's ``F``/``loss``/``I``/``W`` on the whole batch;
    ``opt``: each method's optimizer step; ``async``/``blocking``: one-way wall seconds per message
    size, the fastest, and ``async_median``/``blocking_median``; ``rounds``: per round, ``share``
    and ``burst`` ``(CPU s, wall s)`` of the compute probes and the ping-pong medians) and
    ``methods[name]``: ``times`` (this rank's seconds per step), ``steps`` (per step: ``start``/``end``
    on the monotonic clock shared by the processes, ``cpu_start`` this thread's CPU clock then,
    ``events`` ``(label, start, end, cpu, cpu_start)`` of every traced call (torch's actions as
    ``"{stage}{kind}{microbatch}"``, ``post``, ``wait``, ``loss``, ``opt``; the scan's ``"{rank}F"``,
    ``"{rank}S"`` (its distributed backward), ``"{rank}W"``, ``send``, ``wait``, ``loss``, ``opt``),
    ``cpu`` and ``run_wait``: this rank's main-thread CPU time and run-queue wait in the step),
    ``bytes_sent`` per step, ``peak_rss_growth`` (bytes, from one extra untimed step),
    ``bounds``/``stages``, ``scan_seconds`` (the scan's phases per step) and ``grads`` (last step).
    """
    from spscan.distributed import run_local

    if cfg["batch"] % cfg["microbatches"]:
        raise ValueError(f"batch: expected a multiple of microbatches={cfg['microbatches']}, got {cfg['batch']}")
    cfg = dict(cfg, methods=list(methods))
    out = run_local(_compare_worker, world, (cfg,), timeout=timeout, threads=cfg.get("threads", 1))
    bad = [msg for ok, msg in out if not ok]
    if bad:
        raise RuntimeError(f"model-parallel comparison: a rank failed:\n{bad[0]}")
    return [res for _, res in out]


# ----------------------------------------------------------------------------- measured step times


_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


def step_times(results: Sequence[dict], method: str) -> np.ndarray:
    """Seconds of every timed step of ``method``: from the first rank's start to the last rank's end
    (all ranks read one monotonic clock)."""
    steps = [r["methods"][method]["steps"] for r in results]
    return np.array([max(s[k]["end"] for s in steps) - min(s[k]["start"] for s in steps)
                     for k in range(len(steps[0]))])


def step_breakdown(results: Sequence[dict], method: str) -> list[dict]:
    """Per rank, medians over the timed steps of where the rank's step time went (seconds):
    ``compute`` (the schedule's F/B/I/W calls, or the scan step's forward, scan and weight phases),
    ``wait`` (blocked on a receive), ``post`` (posting sends and receives), ``loss``, ``opt``, ``other``
    (the rest: the runtime between the calls), ``cpu`` (the main thread's CPU time) and ``run_wait``
    (time it was ready to run but waited for a core), plus ``actions``: calls per step."""
    out = []
    for r in results:
        rows = []
        for st in r["methods"][method]["steps"]:
            acc = {"compute": 0.0, "wait": 0.0, "post": 0.0, "loss": 0.0, "opt": 0.0, "send": 0.0, "actions": 0}
            for label, t0, t1, *_ in st["events"]:
                if _ACTION.match(label) or re.match(r"^\d+[FSW]$", label):
                    acc["compute"] += t1 - t0
                    acc["actions"] += 1
                elif label in acc:
                    acc[label] += t1 - t0
            acc["wall"] = st["end"] - st["start"]
            acc["other"] = acc["wall"] - sum(acc[k] for k in ("compute", "wait", "post", "loss", "opt", "send"))
            acc["cpu"] = st["cpu"] if st["cpu"] is not None else float("nan")
            acc["run_wait"] = st["run_wait"] if st["run_wait"] is not None else float("nan")
            rows.append(acc)
        out.append({k: _median([row[k] for row in rows]) for k in rows[0]} if rows else {})
    return out


def runtime_overheads(results: Sequence[dict], method: str) -> dict:
    """The runtime's costs outside the compute, in CPU seconds of each rank's main thread, from a run
    of a model so narrow that its compute is negligible (e.g. 8 wide), per call of its trace (never
    from step times):

    * ``in_action[kind]``: over the calls of kind ``F``/``B``/``I``/``W``, the call's CPU time minus the
      same stage's isolated cost in that run's calibration (torch's bookkeeping inside the call); for
      the scan ``F``/``S``/``W`` (forward, distributed backward, weight phase);
    * ``gap``: per call, the rank's CPU time in the step outside every traced call but the message
      posts, divided by its calls (the schedule executor between the calls, posting messages);
    * ``start``: per rank, its CPU time from the step's start to its first traced call.

    Each is the median over a rank's steps (and calls), then (but ``start``) the median over the ranks.
    """
    per_rank: list[dict[str, float]] = []
    gaps, starts = [], []
    for r in results:
        kinds: dict[str, list[float]] = {}
        cal = r["calibration"]
        bounds = r["methods"][method]["bounds"]
        g_r, s_r = [], []
        for st in r["methods"][method]["steps"]:
            ev = sorted(st["events"], key=lambda e: e[1])
            n_act, traced = 0, 0.0
            for label, t0, t1, cpu, _ in ev:
                m_ = _ACTION.match(label)
                if m_:
                    stage, kind = int(m_.group(1)), m_.group(2)
                    iso = cal["stage"].get(_stage_key(bounds, stage), {})
                    base = iso.get("B" if kind == "W" and stage == 0 else kind, 0.0)
                    kinds.setdefault(kind, []).append(max(0.0, cpu - base))
                    n_act += 1
                    traced += cpu
                elif re.match(r"^\d+[FSW]$", label):
                    kind = label[-1]
                    base = cal["scan"].get({"S": "I"}.get(kind, kind), 0.0)
                    kinds.setdefault(kind, []).append(max(0.0, cpu - base))
                    n_act += 1
                    traced += cpu
                elif label != "post":
                    traced += cpu
            first = ev[0][4] - st["cpu_start"] if ev else 0.0
            s_r.append(max(0.0, first))
            if n_act and st["cpu"] is not None:
                g_r.append(max(0.0, st["cpu"] - traced - first) / n_act)
        gaps.append(_median(g_r))
        starts.append(_median(s_r))
        per_rank.append({k: _median(v) for k, v in kinds.items()})
    in_action = {k: _median([d[k] for d in per_rank if k in d]) for k in sorted({k for d in per_rank for k in d})}
    return {"in_action": in_action, "gap": _median(gaps), "start": starts}


# ----------------------------------------------------------------------------- predictions


def calibrated_link(results: Sequence[dict], blocking: bool = False) -> Link:
    """The link fitted to the ping-pong one-way times (median over ranks 0 and 1), ``latency + bytes /
    bandwidth``; ``blocking``: the blocking ``send``/``recv`` ping-pong (spscan's scan) instead of
    ``isend``/``irecv`` (torch's schedules)."""
    kind = "blocking" if blocking else "async"
    rows = [r["calibration"][kind] for r in results if r["calibration"].get(kind)]
    if not rows:
        return Link(blocking=blocking)
    sizes = rows[0].keys()
    return fit_link({int(n): _median([row[n] for row in rows]) for n in sizes}, blocking=blocking)


def calibrated_costs(results: Sequence[dict], cfg: dict, method: str) -> LayerCosts:
    """Per-layer costs of one micro-batch for a torch schedule, from the isolated stage timings
    (:func:`compare`'s calibration, the runtime's own functions on every stage): each stage's ``F``,
    ``I`` and ``W`` on its last layer (stage-level schedules only use the sums), the first stage's
    ``I`` zero and its ``W`` its whole backward (torch runs nothing in the first stage's input step);
    without a split (``GPipe``, ``1F1B``, ``Interleaved1F1B``) ``I + W`` is the measured ``B``."""
    bounds = results[0]["methods"][method]["bounds"]
    stage: dict[str, dict] = {}
    for r in results:
        stage.update(r["calibration"]["stage"])
    n = bounds[-1]
    f, i_, w = np.zeros(n), np.zeros(n), np.zeros(n)
    split = method in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
    for s in range(len(bounds) - 1):
        c = stage[_stage_key(bounds, s)]
        last = bounds[s + 1] - 1
        f[last] = c["F"]
        if s == 0:
            w[last] = c["B"]
        elif split:
            i_[last], w[last] = c["I"], c["W"]
        else:
            # B split in the measured I : W proportion
            tot = c["I"] + c["W"]
            i_[last] = c["B"] * c["I"] / tot if tot > 0 else c["B"]
            w[last] = c["B"] - i_[last]
    model = build_mlp(cfg["dims"], cfg.get("seed", 0))
    elem = torch.empty((), dtype=cfg.get("dtype", torch.float32)).element_size()
    mb = cfg["batch"] // cfg["microbatches"]
    bb = tuple(float(mb * d * elem) for d in _dims_at(model, cfg["dims"][0]))
    return LayerCosts(tuple(f), tuple(i_), tuple(w), bb[1:], bb)


def calibrated_overheads(results: Sequence[dict], method: str, floor: Optional[dict] = None) -> Overheads:
    """:class:`~spscan.pipeline.simulator.Overheads` of ``method``: per action, ``floor``'s
    (:func:`runtime_overheads` of a negligible-compute run) in-call overhead plus its per-call gap;
    per rank, ``floor``'s time to the first event before the step, and the isolated optimizer step
    (``results``' calibration) after it. Without ``floor`` only the optimizer step."""
    world = len(results)
    end = [r["calibration"]["opt"][method] for r in results]
    if floor is None:
        return Overheads(step_end=end)
    act = {k: v + floor["gap"] for k, v in floor["in_action"].items()}
    return Overheads(action=act, step_start=[float(v) for v in floor["start"][:world]], step_end=end)


def _slowed(costs: LayerCosts, ov: Overheads, factor: float) -> tuple[LayerCosts, Overheads]:
    """Compute and runtime costs ``factor`` times longer (a CPU share of ``1 / factor``)."""
    c = LayerCosts(tuple(v * factor for v in costs.forward), tuple(v * factor for v in costs.backward_input),
                   tuple(v * factor for v in costs.backward_weight), costs.activation, costs.boundary_bytes)

    def sc(v: Any) -> Any:
        return [x * factor for x in v] if isinstance(v, (list, tuple)) else v * factor

    return c, Overheads({k: v * factor for k, v in ov.action.items()}, sc(ov.step_start), sc(ov.step_end))


def round_loads(results: Sequence[dict], blocking: bool = False, probe: str = "burst") -> list[tuple[float, Link]]:
    """Per calibration round: the CPU share a computing rank got (a probe's CPU time over its wall time,
    summed over the ranks; ``probe="burst"``: short forwards between short sleeps, as a pipeline rank
    computes; ``"share"``: the calibration's long uninterrupted compute) and the link fitted to that
    round's ping-pong (median one-way times: what a message took under that round's load, the
    receiver's wake-up included)."""
    kind = "blocking" if blocking else "async"
    n = len(results[0]["calibration"]["rounds"][probe])
    out = []
    for k in range(n):
        cpu = sum(r["calibration"]["rounds"][probe][k][0] for r in results)
        wall = sum(r["calibration"]["rounds"][probe][k][1] for r in results)
        rows = [r["calibration"]["rounds"][kind][k] for r in results
                if len(r["calibration"]["rounds"][kind]) > k and r["calibration"]["rounds"][kind][k]]
        lk = fit_link({int(sz): _median([row[sz] for row in rows]) for sz in rows[0]}, blocking) if rows \
            else Link(blocking=blocking)
        out.append((min(1.0, cpu / wall) if wall > 0 else 1.0, lk))
    return out


def predicted_step_times(results: Sequence[dict], cfg: dict, method: str, floor: Optional[dict] = None
                         ) -> tuple[float, np.ndarray]:
    """``(dedicated, loaded)``: the simulated step of ``method`` on a machine running nothing else
    (CPU costs, least-contended link), and one simulated step per calibration round under that
    round's measured load (:func:`round_loads`: every compute and runtime cost divided by the CPU
    share, the link as measured then). Their median predicts the median measured step."""
    dedicated = predicted_timeline(results, cfg, method, floor).step_time
    loaded = [predicted_timeline(results, cfg, method, floor, share=a, link=lk).step_time
              for a, lk in round_loads(results, blocking=method == "scan")]
    return dedicated, np.array(loaded)


def step_cpu_shares(results: Sequence[dict], method: str) -> np.ndarray:
    """Per timed step of ``method``, the CPU share its ranks got: the mean over the ranks of the main
    thread's CPU time over its CPU time plus its run-queue wait in that step (1: never waited for a
    core). Read from the scheduler's counters, not from the step times."""
    steps = [r["methods"][method]["steps"] for r in results]
    out = []
    for k in range(len(steps[0])):
        sh = [s[k]["cpu"] / (s[k]["cpu"] + s[k]["run_wait"]) for s in steps
              if s[k]["cpu"] is not None and s[k]["run_wait"] is not None and s[k]["cpu"] > 0]
        out.append(float(np.mean(sh)) if sh else 1.0)
    return np.array(out)


def explained_step_times(results: Sequence[dict], cfg: dict, method: str, floor: Optional[dict] = None
                         ) -> np.ndarray:
    """Per timed step, the dedicated-machine simulation (:func:`predicted_timeline`) with every compute
    and runtime cost divided by the CPU share the ranks got in that step (:func:`step_cpu_shares`).
    Not an independent prediction (the share is read from the steps themselves), but no parameter is
    fitted to a step time: it tests whether the cost model plus the machine's load explain the steps."""
    return np.array([predicted_timeline(results, cfg, method, floor, share=a).step_time
                     for a in step_cpu_shares(results, method)])


def busy_per_device(tl: Timeline) -> list[float]:
    """Time each device of a simulated step spends in its actions (overheads included): on a machine
    running nothing else, the CPU time each rank's main thread spends in the step."""
    return [float(sum(a.end - a.start for a in acts)) for acts in tl.actions]


def measured_cpu(results: Sequence[dict], method: str) -> list[float]:
    """Per rank, the median over the timed steps of its main thread's CPU seconds in the step."""
    return [_median([s["cpu"] for s in r["methods"][method]["steps"] if s["cpu"] is not None]) for r in results]


def predicted_timeline(results: Sequence[dict], cfg: dict, method: str, floor: Optional[dict] = None,
                       link: Any = True, share: float = 1.0) -> Timeline:
    """The simulator's timeline of ``method`` calibrated with measurements other than its step times:

    * compute: the isolated stage costs of :func:`calibrated_costs` (torch), or for the scan each
      slice's isolated forward (with the Jacobian values, and the loss on the last rank), local scan
      backward (as the spine's ``I`` on the last rank, as the finish's ``I`` elsewhere) and ``g^T x``
      weight gradients, all on the whole batch;
    * link (``link=True``): ``latency + bytes / bandwidth`` fitted to the ping-pong at the run's message
      sizes (the fastest of each size: the least-contended messages), overlapped for torch (``isend``/
      ``irecv``), blocking the sender for the scan (``send``); ``False``: none; a :class:`Link`: that one;
    * ``share``: the CPU share a busy rank gets (1: a core of its own); costs are divided by it;
    * ``floor``: :func:`runtime_overheads` of the same method on a negligible-compute model, the
      per-action and per-step runtime costs (without it, only the optimizer step is added).
    """
    from spscan.pipeline import simulator as S

    world = len(results)
    bounds = results[0]["methods"][method]["bounds"]
    ov = calibrated_overheads(results, method, floor)
    if method == "scan":
        import spscan.distributed as D

        model = build_mlp(cfg["dims"], cfg.get("seed", 0))
        pats = chain_patterns(model)
        n = len(pats)
        f, i_, w = np.zeros(n), np.zeros(n), np.zeros(n)
        for r in results:
            sc = r["calibration"]["scan"]
            last = bounds[r["rank"] + 1] - 1
            f[last] = sc["F"] + sc["loss"]
            i_[last] = sc["I"]
            w[last] = sc["W"]
        elem = torch.empty((), dtype=cfg.get("dtype", torch.float32)).element_size()
        bb = tuple(float(cfg["batch"] * d * elem) for d in _dims_at(model, cfg["dims"][0]))
        full = LayerCosts(tuple(f), tuple(i_), tuple(w), bb[1:], bb)
        dplan = D.plan(pats, world, slices=bounds)
        # composite products (p > 2): time per multiply pair from the local backward's rate
        nnz = sum(p.nnz for p in pats)
        pair_time = float(np.median([r["calibration"]["scan"]["I"] for r in results])) / max(
            1.0, nnz * cfg["batch"] / world)
        lk = link if isinstance(link, Link) else calibrated_link(results, blocking=True) if link \
            else Link(blocking=True)
        if floor is not None:
            # the scan's step is one action of each kind per rank: its overheads are per step
            ov = Overheads(action={{"S": "I"}.get(k, k): v for k, v in ov.action.items()},
                           step_start=ov.step_start, step_end=ov.step_end)
        full, ov = _slowed(full, ov, 1.0 / share)
        return S.bppsa_scan(dplan, pats, full, 1, cfg["batch"], pair_time, lk, element_bytes=elem, overheads=ov)
    costs, ov = _slowed(calibrated_costs(results, cfg, method), ov, 1.0 / share)
    lk = link if isinstance(link, Link) else calibrated_link(results) if link else Link()
    if method == "1F1B":
        return S.one_f_one_b(costs, world, cfg["microbatches"], lk, bounds=bounds, overheads=ov)
    spr = 2 if method in MULTI_STAGE else None
    return S.torch_schedule(method, costs, world, cfg["microbatches"], lk, stages_per_rank=spr, bounds=bounds,
                            overheads=ov)
