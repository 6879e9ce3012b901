"""What each rank of a real run executes: one step of a ``torch.distributed.pipelining`` schedule or
of spscan's model-parallel scan (each traced call by call), the calibration measurements taken
between the timed steps, and the worker that interleaves them all (:func:`compare_worker`, run in
the processes :func:`spscan.parallel.pipeline.realrun.compare` starts)."""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from spscan.parallel.pipeline.mlp import (
    MULTI_STAGE, batch_data, build_mlp, chain_patterns, dims_at, forward_with_values, stage_bounds, stage_key,
    stage_owner, weight_grads,
)
from spscan.parallel.pipeline.probes import (
    Trace, TracedComms, burst_share, clear_peak_rss, fit_link, median, opt_sample, ping_pong, proc_status, schedstat,
    time_stage,
)


class TorchRunner:
    """One ``torch.distributed.pipelining`` schedule on this rank (its own copy of the model)."""

    def __init__(self, name: str, rank: int, world: int, cfg: dict, x: torch.Tensor, y: torch.Tensor) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        self.name, self.rank, self.x, self.y = name, rank, x, y
        model = build_mlp(cfg["dims"], cfg.get("seed", 0), cfg.get("dtype", torch.float32))
        self.n_stages, owner = stage_owner(name, world)
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
        self.trace = Trace()
        for st in self.stages:
            st.forward_one_chunk = self.trace.wrap(action_label(st.stage_index, "F"), st.forward_one_chunk)
            st.backward_one_chunk = self.trace.wrap(action_label(st.stage_index, "B"), st.backward_one_chunk)
            st.backward_weight_one_chunk = self.trace.wrap(action_label(st.stage_index, "W"),
                                                           st.backward_weight_one_chunk)
        self.sched._compute_loss = self.trace.wrap("loss", self.sched._compute_loss)
        dims = dims_at(model, cfg["dims"][0])
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
        with TracedComms(self.trace):
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


def action_label(stage: int, kind: str) -> Any:
    """Label of a traced stage call in torch's action form ``"{stage}{kind}{microbatch}"`` (``B`` with
    ``full_backward=False`` is torch's ``I``)."""

    def label(args: tuple, kwargs: dict) -> str:
        mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id", ""))
        k = "I" if kind == "B" and not kwargs.get("full_backward", True) else kind
        return f"{stage}{k}{mb}"

    return label


class ScanRunner:
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
        self.dims = dims_at(model, cfg["dims"][0])
        self.batch = cfg["batch"]
        self.bytes_sent = 0
        self.trace = Trace()
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
        inputs, values, h = forward_with_values(self.mods, h)
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
                for p_, gp in zip(m.parameters(), weight_grads(m, inputs[k], g[k + 1])):
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
        inputs, vals, h = forward_with_values(self.mods, h)
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
                weight_grads(m, inputs[k], g[k + 1])
        tw = time.thread_time() - t0
        return {"F": tf, "loss": tl, "I": ti, "W": tw}


class Calibration:
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
                self.stages[stage_key(rn.bounds, s)] = (lo, hi, s == 0, s == rn.n_stages - 1)
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
            st[key] = time_stage(list(self.model)[lo:hi], self.h_mb[lo], self.y_mb if last else None, first)
        self.samples["stage"].append(st)
        if self.local is not None:
            self.samples["scan"].append(self.runners["scan"].slice_sample(self.local))
        lr = self.cfg.get("lr", 0.01)
        self.samples["opt"].append({n: opt_sample(rn.params(), lr) for n, rn in self.runners.items()})
        self.samples["share"].append((time.thread_time() - c0, time.perf_counter() - t0))
        lo, hi, _, _ = next(iter(self.stages.values())) if self.stages else (0, len(self.model), True, True)
        self.samples["burst"].append(burst_share(list(self.model)[lo:hi], self.h_mb[lo]))
        if self.world > 1:
            self.samples["async"].append(ping_pong(self.rank, self.sizes, reps, blocking=False))
            if "scan" in self.runners:
                self.samples["blocking"].append(ping_pong(self.rank, self.sizes, reps, blocking=True))

    def result(self) -> dict:
        def med(rows: list[dict]) -> dict:
            return {k: median([r[k] for r in rows]) for k in rows[0]} if rows else {}

        out: dict[str, Any] = {"sizes": self.sizes}
        out["stage"] = {k: med([r[k] for r in self.samples["stage"]]) for k in self.stages} \
            if self.samples["stage"] else {}
        out["stage_spread"] = {k: {a: [float(np.percentile([r[k][a] for r in self.samples["stage"]], q))
                                       for q in (10, 90)] for a in "FBIW"} for k in self.stages} \
            if self.samples["stage"] else {}
        out["scan"] = med(self.samples["scan"])
        # per round: (CPU s, wall s) of the compute probes, and one-way seconds per message size
        out["rounds"] = {"share": self.samples["share"], "burst": self.samples["burst"],
                         "async": [None if r is None else {n: median(v) for n, v in r.items()}
                                   for r in self.samples["async"]],
                         "blocking": [None if r is None else {n: median(v) for n, v in r.items()}
                                      for r in self.samples["blocking"]]}
        out["opt"] = med(self.samples["opt"])
        for kind in ("async", "blocking"):
            rows = [r for r in self.samples[kind] if r is not None]
            # the fastest message of each size: the link itself, as little of the machine's load as seen
            out[kind] = {n: float(min(t for r in rows for t in r[n])) for n in self.sizes} if rows else None
            out[kind + "_median"] = {n: median([t for r in rows for t in r[n]]) for n in self.sizes} \
                if rows else None
        return out


def compare_worker(rank: int, world: int, cfg: dict) -> dict:
    import torch.distributed as dist

    x, y = batch_data(cfg)
    runners = {name: (ScanRunner(rank, world, cfg, x, y) if name == "scan" else
                      TorchRunner(name, rank, world, cfg, x, y)) for name in cfg["methods"]}
    calib = Calibration(rank, world, cfg, runners, x, y)
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
            cpu0, wait0 = schedstat()
            t0, tc0 = time.perf_counter(), time.thread_time()
            rn.step()
            t1 = time.perf_counter()
            cpu1, wait1 = schedstat()
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
        base = clear_peak_rss()
        runners[name].step()
        hwm = proc_status("VmHWM")
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
