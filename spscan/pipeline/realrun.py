"""Real model-parallel training steps on one machine: ``torch.distributed.pipelining`` schedules and
spscan's model-parallel scan, as Gloo CPU processes, on the same MLP chain.

The model is ``Linear(d_0, d_1), ReLU, Linear(d_1, d_2), ReLU, ..., Linear(d_{L-1}, d_L)``; every
module is one layer of the chain (its transposed Jacobian: ``W`` for a linear layer, shared by the
batch; ``diag(x > 0)`` per sample for a ReLU). A method cuts it into stages of whole modules.

:func:`compare` runs ``torch.distributed.pipelining`` schedule classes and spscan's scan in one
set of processes, interleaved step by step. spscan's step: forward of the whole batch slice by
slice, the model-parallel scan (:func:`spscan.distributed.backward`) for every ``dl/dx_i``, then
each layer's weight gradient from its own ``dl/dx_i`` (``g^T x`` for a linear layer).

It returns, per rank and method, the measured step times, the bytes sent per step, the peak
resident memory growth during a step and the parameter gradients of the last step as NumPy
arrays keyed like ``model.named_parameters()`` (to compare against single-process autograd),
plus per-module costs measured in the same processes, to calibrate the simulator.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn

from spscan.pipeline.simulator import LayerCosts, Link, Timeline

__all__ = ["build_mlp", "chain_patterns", "chain_values", "stage_bounds", "compare", "reference_grads",
           "calibrated_costs", "predicted_timeline", "SINGLE_STAGE", "MULTI_STAGE"]

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


def _time_modules(mods: Sequence[nn.Module], x: torch.Tensor, reps: int) -> tuple[list[float], list[float], list[float]]:
    """Median seconds of ``F``, ``I`` (autograd input gradient) and ``W`` of each module on input ``x``."""
    f, i_, w = [], [], []
    h = x
    for mod in mods:
        xin = h.detach().requires_grad_(True)
        tf, ti, tw = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            with torch.no_grad():
                mod(xin)
            tf.append(time.perf_counter() - t0)
            yv = mod(xin)
            gy = torch.ones_like(yv)
            t0 = time.perf_counter()
            torch.autograd.grad(yv, xin, gy)
            ti.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            with torch.no_grad():
                _weight_grads(mod, xin, gy)
            tw.append(time.perf_counter() - t0)
        f.append(float(np.median(tf)))
        i_.append(float(np.median(ti)))
        w.append(float(np.median(tw)) if list(mod.parameters()) else 0.0)
        with torch.no_grad():
            h = mod(h)
    return f, i_, w


def _ping_pong(rank: int, world: int, reps: int = 10) -> Optional[tuple[float, float]]:
    """One-way ``(latency s, bandwidth B/s)`` between ranks 0 and 1 (measured on both)."""
    import torch.distributed as dist

    if world < 2 or rank > 1:
        return None
    out = []
    for numel in (1, 1 << 18):
        buf = torch.zeros(numel)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            ts.append((time.perf_counter() - t0) / 2)
        out.append(float(np.median(ts)))
    lat = out[0]
    bw = (4 * (1 << 18)) / max(out[1] - lat, 1e-9)
    return lat, bw


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
        # time every compute action the schedule runs (this process's stage objects only)
        self.timing = False
        self.action_times: dict[str, list[float]] = {}
        for st in self.stages:
            for attr in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                self._wrap(st, attr)
        dims = _dims_at(model, cfg["dims"][0])
        elem = x.element_size()
        # per step, every cut between stages on different ranks carries the activations of all
        # micro-batches forward and their gradients back
        self.bytes_sent = 0
        for st in range(self.n_stages - 1):
            if owner[st] != owner[st + 1]:
                act = cfg["batch"] * dims[self.bounds[st + 1]] * elem
                self.bytes_sent += act * ((owner[st] == rank) + (owner[st + 1] == rank))

    def _wrap(self, stage: Any, attr: str) -> None:
        orig = getattr(stage, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            if self.timing:
                if attr == "forward_one_chunk":
                    kind = "F"
                elif attr == "backward_weight_one_chunk":
                    kind = "W"
                else:
                    kind = "B" if kwargs.get("full_backward", True) else "I"
                self.action_times.setdefault(f"{kind}{stage.stage_index}", []).append(time.perf_counter() - t0)
            return out

        setattr(stage, attr, timed)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        args = (self.x,) if 0 in self.mine else ()
        kw: dict[str, Any] = {"target": self.y, "losses": []} if self.n_stages - 1 in self.mine else {}
        self.sched.step(*args, **kw)
        if self.update:
            self.opt.step()

    def grads(self) -> dict[str, np.ndarray]:
        return {f"{self.bounds[s] + int(k.split('.')[0])}.{k.split('.', 1)[1]}": q.grad.detach().numpy().copy()
                for st, s in zip(self.stages, self.mine) for k, q in st.submod.named_parameters()}


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
        self.phases: dict[str, list[float]] = {}

    def step(self) -> None:
        import torch.distributed as dist

        t0 = time.perf_counter()
        if self.rank == 0:
            h = self.x
        else:
            h = torch.empty(self.batch, self.dims[self.lo], dtype=self.dtype)
            dist.recv(h, self.rank - 1)
        t1 = time.perf_counter()
        inputs, values = [], []
        with torch.no_grad():
            for m in self.mods:
                inputs.append(h)
                values.append(chain_values(m, h))
                h = m(h)
        fwd_sent, grad = 0, None
        if self.rank < self.world - 1:
            dist.send(h.contiguous(), self.rank + 1)
            fwd_sent = h.numel() * h.element_size()
        else:
            out = h.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(nn.functional.cross_entropy(out, self.y), out)
        t2 = time.perf_counter()
        g = self.D.backward(self.dplan, values, grad)
        t3 = time.perf_counter()
        for p_ in self.opt.param_groups[0]["params"]:
            p_.grad = None
        with torch.no_grad():
            for k, m in enumerate(self.mods):  # g[k + 1] is dl/dx at module k's output
                for p_, gp in zip(m.parameters(), _weight_grads(m, inputs[k], g[k + 1])):
                    p_.grad = gp
        t4 = time.perf_counter()
        if self.update:
            self.opt.step()
        self.bytes_sent = fwd_sent + g.stats.bytes_sent
        # the slice's own backward inside the scan: the spine on the last rank, the finish elsewhere
        own = g.stats.seconds.get("local" if self.rank == self.world - 1 else "finish", float("nan"))
        for key, val in (("recv_wait", t1 - t0), ("forward", t2 - t1), ("scan", t3 - t2), ("weight_grads", t4 - t3),
                         ("slice_backward", own)):
            self.phases.setdefault(key, []).append(val)

    def grads(self) -> dict[str, np.ndarray]:
        return {f"{self.lo + k}.{n}": q.grad.detach().numpy().copy() for k, m in enumerate(self.mods)
                for n, q in m.named_parameters()}

    def slice_costs(self, reps: int) -> dict:
        """This slice's ``F``/``I``/``W`` per module on the whole batch and its local scan backward."""
        import spscan

        with torch.no_grad():
            h = self.x
            for m in list(self.model)[:self.lo]:
                h = m(h)
        f, i_, w = _time_modules(self.mods, h, reps)
        local = spscan.plan(self.pats[self.lo:self.hi], levels=0, backend="torch")
        with torch.no_grad():
            vals = []
            for m in self.mods:
                vals.append(chain_values(m, h))
                h = m(h)
        gy = torch.ones_like(h)
        spscan.backward(local, vals, gy)  # first call binds the plan
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            spscan.backward(local, vals, gy)
            ts.append(time.perf_counter() - t0)
        return {"forward": f, "backward_input": i_, "backward_weight": w, "local_backward": float(np.median(ts))}


def _compare_worker(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist

    x, y = _data(cfg)
    runners = {name: (_ScanRunner(rank, world, cfg, x, y) if name == "scan" else
                      _TorchRunner(name, rank, world, cfg, x, y)) for name in cfg["methods"]}
    reps = cfg.get("cost_reps", 5)
    dist.barrier()  # every rank has built its runners: the ping-pong times the link, not set-up
    link = _ping_pong(rank, world)
    # per-module costs of one micro-batch, measured here under the same load as the steps
    model = build_mlp(cfg["dims"], cfg.get("seed", 0), cfg.get("dtype", torch.float32))
    mb_costs = _time_modules(list(model), x[: cfg["batch"] // cfg["microbatches"]], reps)
    scan_costs = runners["scan"].slice_costs(reps) if "scan" in runners else None
    times: dict[str, list[float]] = {n: [] for n in runners}
    peak: dict[str, Optional[int]] = {}
    names = list(runners)
    for it in range(cfg["warmup"] + cfg["steps"]):
        # rotate the order every round so that no method always runs first
        for j in range(len(names)):
            name = names[(it + j) % len(names)]
            base = _clear_peak()
            if hasattr(runners[name], "timing"):
                runners[name].timing = it >= cfg["warmup"]
            dist.barrier()
            t0 = time.perf_counter()
            runners[name].step()
            dist.barrier()
            dt = time.perf_counter() - t0
            hwm = _status("VmHWM")
            if it >= cfg["warmup"]:
                times[name].append(dt)
                if base is not None and hwm is not None:
                    peak[name] = max(peak.get(name) or 0, hwm - base)
    out = {"rank": rank, "link": link, "microbatch_costs": mb_costs, "scan_costs": scan_costs, "methods": {}}
    for name, rn in runners.items():
        out["methods"][name] = {
            "times": times[name], "bytes_sent": rn.bytes_sent, "peak_rss_growth": peak.get(name),
            "bounds": rn.bounds, "stages": getattr(rn, "mine", [rank]),
            "grads": rn.grads() if cfg.get("return_grads") else None,
            "action_costs": {k: float(np.median(v)) for k, v in getattr(rn, "action_times", {}).items()},
            "phases": {k: float(np.median(v)) for k, v in getattr(rn, "phases", {}).items()}}
    return out


def compare(cfg: dict, methods: Sequence[str], world: int = 2, timeout: float = 600.0) -> list[dict]:
    """Train the MLP with every method in ``methods`` (torch schedule class names and ``"scan"``) on
    ``world`` Gloo processes, interleaved round by round (each round runs one step of every
    method, in a rotating order), so that all methods see the same machine load.

    ``cfg``: ``dims`` (layer widths), ``batch``, ``microbatches``, ``warmup``, ``steps``; optional
    ``seed``, ``lr``, ``update`` (default True: SGD step after each step), ``return_grads``,
    ``dtype``, ``threads`` (per process, default 1), ``cost_reps``, ``levels`` (scan).

    Returns, per rank: ``link`` (one-way latency s, bandwidth B/s between ranks 0 and 1),
    ``microbatch_costs`` (``F``, ``I``, ``W`` seconds of every module on one micro-batch),
    ``scan_costs`` (the rank's slice on the whole batch and its local scan backward) and
    ``methods[name]``: ``times`` (seconds per step), ``bytes_sent`` per step, ``peak_rss_growth``
    (bytes; the process's peak resident memory over one step minus its size before it),
    ``bounds``/``stages`` and ``grads`` (of the last step).
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


def calibrated_costs(results: Sequence[dict], cfg: dict) -> tuple[LayerCosts, Link]:
    """Per-module ``F``/``I``/``W`` of one micro-batch (median over the ranks' in-situ timings) and the
    measured link, as simulator inputs. Activations and boundary bytes are per micro-batch."""
    f = np.median([r["microbatch_costs"][0] for r in results], axis=0)
    i_ = np.median([r["microbatch_costs"][1] for r in results], axis=0)
    w = np.median([r["microbatch_costs"][2] for r in results], axis=0)
    model = build_mlp(cfg["dims"], cfg.get("seed", 0))
    elem = torch.empty((), dtype=cfg.get("dtype", torch.float32)).element_size()
    mb = cfg["batch"] // cfg["microbatches"]
    dims = _dims_at(model, cfg["dims"][0])
    bb = tuple(float(mb * d * elem) for d in dims)
    links = [r["link"] for r in results if r.get("link")]
    link = Link(float(np.median([lk[0] for lk in links])), float(np.median([lk[1] for lk in links]))) if links else Link()
    return LayerCosts(tuple(f), tuple(i_), tuple(w), bb[1:], bb), link


def _stage_scaled(costs: LayerCosts, bounds: Sequence[int], actions: dict[str, float]) -> LayerCosts:
    """Scale the per-module costs so that every stage's ``F``, ``I`` and ``W`` sum to the times its
    actions took inside the steps (``"F3"``, ``"B3"`` or ``"I3"``/``"W3"`` -> seconds)."""
    f, i_, w = np.array(costs.forward), np.array(costs.backward_input), np.array(costs.backward_weight)
    i_[0] = 0.0  # the simulator never runs layer 1's input gradient
    for s_ in range(len(bounds) - 1):
        sl = slice(bounds[s_], bounds[s_ + 1])
        if f"F{s_}" in actions and f[sl].sum() > 0:
            f[sl] *= actions[f"F{s_}"] / f[sl].sum()
        if f"B{s_}" in actions:
            tot = i_[sl].sum() + w[sl].sum()
            if tot > 0:
                i_[sl] *= actions[f"B{s_}"] / tot
                w[sl] *= actions[f"B{s_}"] / tot
        for kind, arr in (("I", i_), ("W", w)):
            if f"{kind}{s_}" in actions and arr[sl].sum() > 0:
                arr[sl] *= actions[f"{kind}{s_}"] / arr[sl].sum()
    return LayerCosts(tuple(f), tuple(i_), tuple(w), costs.activation, costs.boundary_bytes)


def predicted_timeline(results: Sequence[dict], cfg: dict, method: str, in_step: bool = False) -> Timeline:
    """The simulator's timeline of ``method`` with the costs :func:`compare` measured.

    torch schedules replay torch's own action lists (:func:`~spscan.pipeline.simulator.torch_schedule`;
    ``1F1B`` uses :func:`~spscan.pipeline.simulator.one_f_one_b`, the same order); the scan uses the
    real :class:`~spscan.distributed.DistributedPlan` with each slice's measured whole-batch costs,
    its ``I`` scaled to the slice's backward as timed inside the scan's steps (``CommStats.seconds``).
    ``in_step``: for torch schedules, scale each stage's costs to its actions' times measured inside
    the steps (what the runtime's own F/B/I/W calls took), instead of the separately timed modules.
    """
    from spscan.pipeline import simulator as S

    world = len(results)
    costs, link = calibrated_costs(results, cfg)
    bounds = results[0]["methods"][method]["bounds"]
    if method == "scan":
        import spscan.distributed as D

        model = build_mlp(cfg["dims"], cfg.get("seed", 0))
        pats = chain_patterns(model)
        f, i_, w = [], [], []
        for r in results:
            sc = r["scan_costs"]
            ai = np.array(sc["backward_input"])
            # the slice's backward as the scan ran it in the steps (spine or finish), else the
            # separately timed local scan backward
            own = r["methods"]["scan"]["phases"].get("slice_backward", float("nan"))
            local = own if np.isfinite(own) else sc["local_backward"]
            scale = local / ai.sum() if ai.sum() > 0 else 0.0
            f += list(sc["forward"])
            i_ += list(ai * scale)
            w += list(sc["backward_weight"])
        elem = torch.empty((), dtype=cfg.get("dtype", torch.float32)).element_size()
        dims = _dims_at(model, cfg["dims"][0])
        bb = tuple(float(cfg["batch"] * d * elem) for d in dims)
        full = LayerCosts(tuple(f), tuple(i_), tuple(w), bb[1:], bb)
        dplan = D.plan(pats, world, slices=bounds)
        # composite products: time per multiply pair from the local backward's rate
        nnz = sum(p.nnz for p in pats)
        pair_time = float(np.median([r["scan_costs"]["local_backward"] for r in results])) / max(
            1.0, nnz * cfg["batch"] / world)
        return S.bppsa_scan(dplan, pats, full, 1, cfg["batch"], pair_time, link,
                            element_bytes=elem)
    if in_step:
        actions: dict[str, float] = {}
        for r in results:
            actions.update(r["methods"][method].get("action_costs", {}))
        costs = _stage_scaled(costs, bounds, actions)
    if method == "1F1B":
        return S.one_f_one_b(costs, world, cfg["microbatches"], link, bounds=bounds)
    spr = 2 if method in MULTI_STAGE else None
    return S.torch_schedule(method, costs, world, cfg["microbatches"], link, stages_per_rank=spr, bounds=bounds)
