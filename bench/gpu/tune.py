"""Tune the structured-recurrence kernels on a GPU: variants and launch configurations, headline shapes.

``python bench/gpu/tune.py [--out DIR] [--quick] [--cases rnn30000,gru10000,...]``

For each headline recurrence (the paper's RNN at T = 30000 and 1000, a GRU and an LSTM at T = 10000;
H = 20, B = 16, float32) it builds the factored backward chain exactly as the recurrent front end
does (``spscan.plan`` at depth 0, a periodic binding), fills it with one step's values computed by
the cells' own formulas at random states, and then, on the arenas the engine loaded:

1. times each phase of :func:`spscan.kernels.triton.recurrence.run_recurrence` under several variants
   (compose: ``tl.dot`` scheme x lanes per program x warps; expand: scheme x warps; carry: warps),
   each from a CUDA graph of 20 launches, median of 5 replays;
2. times the whole run with the best of each phase at several chunk lengths, and checks each
   combination's outputs against the same run in float64 (``err``: max abs error over max abs value);
3. times cuDNN's backward of the same module (autograd, loss on the last output) in the same process.

Prints one table per case and the winners last; writes ``tune.json`` into ``--out``. The winners
are what ``spscan.kernels.triton.launch.RECURRENCE_TABLE``, ``RECURRENCE_EXACT_DOT`` and
``RECURRENCE_CHUNK_SCALE`` should say for this device. A float32-exact scheme wins only if its
error stays within 2x the FMA variant's. Every row carries the floor of the case: the bytes that
must move (per-step values read once, every output written once) at the measured copy bandwidth,
and the chunk maps' multiply-adds at the FP32 FMA peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import spscan
from spscan.recurrent.cells import cell_for, recurrent_patterns
from spscan.runtime import PeriodicValues
from spscan.kernels.triton import launch
from spscan.kernels.triton.recurrence import recurrence_scratch, run_recurrence

DEV = torch.device("cuda")
H, B = 20, 16
CASES = {"rnn30000": ("rnn", 30000), "rnn1000": ("rnn", 1000), "gru10000": ("gru", 10000),
         "lstm10000": ("lstm", 10000)}
FP32_FMA_PER_S = {"H100": 33.5e12, "H200": 33.5e12}  # datasheet FP32 (non-tensor) multiply-adds per second


def _graph_ms(fn, calls: int = 20, replays: int = 5) -> float:
    """Median time of one ``fn()`` from a CUDA graph of ``calls`` launches of it (after a warm-up)."""
    if DEV.type != "cuda":  # the interpreter smoke run: one wall-clock call
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / calls)
    return statistics.median(times)


def events_ms(fn, reps: int = 5, warmup: bool = True) -> float:
    """Median milliseconds of ``fn()`` between CUDA events (``warmup``: one untimed call first)."""
    if DEV.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if warmup:
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    x = torch.empty((256 if DEV.type == "cuda" else 1) << 20, dtype=torch.uint8, device=DEV)
    y = torch.empty_like(x)
    ms = events_ms(lambda: y.copy_(x), reps=10)
    return 2 * x.numel() / (ms * 1e-3)


def _module(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"rnn": nn.RNN, "gru": nn.GRU, "lstm": nn.LSTM}[kind](1, H).to(DEV)


def _values(kind: str, mod: nn.Module, T: int) -> PeriodicValues:
    """One step's factored values from the cells' formulas at random states (the backward's inputs)."""
    ck = cell_for(mod)
    params = [p.detach() for p in (mod.weight_ih_l0, mod.weight_hh_l0, mod.bias_ih_l0, mod.bias_hh_l0)]
    g = torch.Generator(device=DEV.type).manual_seed(1)
    x = torch.randn(T, B, 1, device=DEV, generator=g)
    gi = torch.addmm(params[2], x.view(T * B, 1), params[0].t()).view(T, B, -1)
    D = ck.state_size(H)
    s_prev = torch.randn(T, B, D, device=DEV, generator=g)
    s_prev[..., :H] = torch.tanh(s_prev[..., :H])
    _, coefs = ck.step(gi, s_prev, params, H)
    return ck.jacobian_values("factored", coefs, params[1], H)


class Case:
    """A recurrent backward chain bound as the front end binds it, its arenas loaded once."""

    def __init__(self, name: str, kind: str, T: int) -> None:
        self.name, self.kind, self.T = name, kind, T
        self.module = _module(kind)
        ck = cell_for(self.module)
        per = len(ck.factored_layout(H))
        pats = recurrent_patterns(self.module, T, "factored")
        self.plan = spscan.plan(pats, levels=0, backend="triton", device=DEV, dtype=torch.float32)
        bound = self.plan.bind(ck.shared_flags(H) * T, None, DEV, period=per)
        values = _values(kind, self.module, T)
        D = ck.state_size(H)
        top = torch.randn(B, D, device=DEV)
        bound.run(values, top, check=False, scratch=True)  # loads the arenas
        items = [i for st in bound.tables.steps for i in st if hasattr(i, "rec")]
        if len(items) != 1:
            raise RuntimeError(f"{name}: expected one structured recurrence in the program, got {len(items)}")
        self.rec = items[0].rec
        self.default = items[0].config
        self.S, self.P = bound.values_buffer(B, torch.float32).arenas
        prog = bound.program
        self.V0 = torch.zeros(B, prog.size_v, device=DEV)
        self.V0[:, prog.grad_slot:prog.grad_slot + D] = top
        self.V = self.V0.clone()
        # every gradient the run computes (dl/dx_n, the last, is its input)
        self.outputs = torch.as_tensor(sorted({c for off, d in prog.outputs[:-1] if off >= 0
                                               for c in range(off, off + d)}), device=DEV)
        # float64 reference: the same run on float64 copies of the arenas (exact products)
        S64, P64, V64 = self.S.double(), self.P.double(), self.V0.double()
        cfg = self.default
        run_recurrence(self.rec, S64, P64, V64, torch.empty(B, recurrence_scratch(self.rec, cfg), dtype=torch.float64,
                                                             device=DEV), cfg)
        self.ref = V64[:, self.outputs]
        self.ref_scale = float(self.ref.abs().max())
        # the floor: per-sample values read once, every output written once (float32); the chunk maps' work
        per_sample_values = sum(int(op_n) for op_n, sh in zip(self._period_nnz(), ck.shared_flags(H)) if not sh)
        outputs_per_step = sum(p.shape[0] for p in self.plan.patterns[:per])
        self.bytes = 4 * B * T * (per_sample_values + outputs_per_step)
        vec, compose = self.rec.flops_per_step()
        self.macs = B * T * compose
        self.vec_macs = B * T * vec

    def _period_nnz(self):
        return [p.nnz for p in self.plan.patterns[: len(cell_for(self.module).factored_layout(H))]]

    def scratch(self, cfg) -> torch.Tensor:
        return torch.empty(B, recurrence_scratch(self.rec, cfg), device=DEV)

    def time_phase(self, cfg, phase: str) -> float:
        scratch = self.scratch(cfg)
        V = self.V0.clone()
        run_recurrence(self.rec, self.S, self.P, V, scratch, cfg)  # every phase's inputs in place
        return _graph_ms(lambda: run_recurrence(self.rec, self.S, self.P, V, scratch, cfg, phases=phase))

    def time_run(self, cfg) -> tuple[float, float]:
        scratch = self.scratch(cfg)
        V = self.V0.clone()
        V[:, self.outputs] = float("nan")  # every output must be written
        run_recurrence(self.rec, self.S, self.P, V, scratch, cfg)
        got = V[:, self.outputs].double()
        err = float((got - self.ref).abs().max()) / self.ref_scale
        if not math.isfinite(err):
            err = float("inf")
        return _graph_ms(lambda: run_recurrence(self.rec, self.S, self.P, V, scratch, cfg)), err

    def cudnn_backward_ms(self) -> float:
        x = torch.randn(self.T, B, 1, device=DEV, requires_grad=True)
        params = list(self.module.parameters())
        out = self.module(x)[0]
        loss = (out[-1] ** 2).sum()
        grads = lambda: torch.autograd.grad(loss, [x] + params, retain_graph=True)  # noqa: E731
        return events_ms(grads, reps=5)


def _cfg(base, **kw):
    return dataclasses.replace(base, **kw)


def tune_case(case: Case, quick: bool, bw: float, fma: float, log) -> dict:
    base = case.default
    rows = []
    # (64, 4) is the default; (32, 4) and (64, 8) halve the registers a thread holds: the GRU's and LSTM's
    # float32 compose programs spill 0.3-0.6 KB at (64, 4) in the sm_90 compile report, and neither was timed
    compose_variants = [("tf32x3", 64, 4), ("tf32x3", 32, 4), ("tf32x3", 64, 8), ("tf32x3", 128, 8), ("ieee", 32, 4)]
    if not quick:
        compose_variants += [("tf32x3", 128, 4), ("tf32x3", 256, 8), ("ieee", 64, 8), ("ieee", 16, 2)]
    expand_variants = [("ieee", 4), ("tf32x3", 4), ("ieee", 2)] + ([] if quick else [("ieee", 8), ("tf32x3", 2)])
    carry_variants = [1, 2, 4]
    best = {}
    for phase, variants in (("compose", compose_variants), ("expand", expand_variants), ("carry", carry_variants)):
        for v in variants:
            if phase == "compose":
                cfg = _cfg(base, compose_dot=v[0], compose_rows=v[1], compose_warps=v[2])
            elif phase == "expand":
                cfg = _cfg(base, expand_dot=v[0], expand_warps=v[1])
            else:
                cfg = _cfg(base, carry_warps=v)
            t0 = time.perf_counter()
            try:
                ms = case.time_phase(cfg, phase)
            except Exception as exc:  # a variant the compiler or the device refuses: reported, not fatal
                log(f"  {phase:8s} {str(v):24s} FAILED {type(exc).__name__}: {' '.join(str(exc).split())[:160]}")
                continue
            log(f"  {phase:8s} {str(v):24s} {ms:8.4f} ms   (compile+time {time.perf_counter() - t0:.1f} s)")
            rows.append({"phase": phase, "variant": list(v) if isinstance(v, tuple) else v, "ms": ms})
            if phase not in best or ms < best[phase][1]:
                best[phase] = (v, ms)
    # the whole run with the best compose/expand/carry at several chunk lengths; float32-exact schemes only
    cv, ev, kv = best["compose"][0], best["expand"][0], best["carry"][0]
    tuned = _cfg(base, compose_dot=cv[0], compose_rows=cv[1], compose_warps=cv[2], expand_dot=ev[0],
                 expand_warps=ev[1], carry_warps=kv)
    F = case.rec.steps
    runs = []
    for scale in ((0.7, 1.4) if quick else (0.35, 0.7, 1.4, 2.8)):
        chunk = max(8, int(round(scale * math.sqrt(F))))
        cfg = _cfg(tuned, chunk=chunk, chunks=-(-F // chunk))
        ms, err = case.time_run(cfg)
        runs.append({"scale": scale, "chunk": chunk, "ms": ms, "err": err})
        log(f"  run      scale {scale:4.2f} chunk {chunk:5d} {ms:8.4f} ms  err {err:.2e}")
    # the same at the best chunk with FMA products in both phases: the accuracy baseline of the schemes
    top = min(runs, key=lambda r: r["ms"])
    fma_cfg = _cfg(tuned, compose_dot="ieee", expand_dot="ieee", chunk=top["chunk"], chunks=-(-F // top["chunk"]))
    fma_ms, fma_err = case.time_run(fma_cfg)
    log(f"  run      fma-only chunk {top['chunk']:5d} {fma_ms:8.4f} ms  err {fma_err:.2e}")
    default_ms, default_err = case.time_run(base)
    log(f"  run      current defaults  {default_ms:8.4f} ms  err {default_err:.2e}")
    cudnn = case.cudnn_backward_ms()
    floor_ms = max(case.bytes / bw, case.macs / fma) * 1e3
    exact_ok = top["err"] <= 2 * max(fma_err, 1e-7)
    pick = top if exact_ok else {"ms": fma_ms, "err": fma_err, "chunk": top["chunk"], "scale": top["scale"]}
    log(f"  cuDNN backward {cudnn:.3f} ms; scan {pick['ms']:.4f} ms ({cudnn / pick['ms']:.1f}x the whole cuDNN "
        f"backward); floor {floor_ms:.4f} ms (bytes {case.bytes / 1e6:.0f} MB, chunk-map MACs {case.macs:.2e}), "
        f"fraction of floor {floor_ms / pick['ms']:.2f}")
    return {"case": case.name, "kind": case.kind, "T": case.T, "B": B, "H": H, "phases": rows, "runs": runs,
            "fma_only": {"ms": fma_ms, "err": fma_err}, "defaults": {"ms": default_ms, "err": default_err},
            "best": {"compose": list(cv), "expand": list(ev), "carry_warps": kv, "scale": pick["scale"],
                     "chunk": pick["chunk"], "ms": pick["ms"], "err": pick["err"], "schemes_exact": exact_ok},
            "cudnn_backward_ms": cudnn, "bytes": case.bytes, "chunk_map_macs": case.macs, "vector_macs": case.vec_macs,
            "floor_ms": floor_ms, "fraction_of_floor": floor_ms / pick["ms"], "m": case.rec.m}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--interpret-smoke", action="store_true",
                    help="check this script on a CPU in Triton's interpreter (TRITON_INTERPRET=1), tiny shapes")
    args = ap.parse_args(argv)
    global DEV
    if args.interpret_smoke:
        DEV = torch.device("cpu")
        for key in CASES:
            CASES[key] = (CASES[key][0], 40)
        launch.mode = "device"  # the GPU's configurations, run by the interpreter
    elif not torch.cuda.is_available():
        print("tune.py: needs a CUDA device")
        return 3
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter smoke run)"
    fma = next((v for k, v in FP32_FMA_PER_S.items() if k in name), 33.5e12)
    bw = copy_bandwidth()
    lines = []

    def log(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    log(f"device {name}; torch {torch.__version__}; copy {bw / 1e12:.2f} TB/s; FP32 FMA peak {fma:.2e}/s")
    results = []
    for key in args.cases.split(","):
        kind, T = CASES[key]
        t0 = time.perf_counter()
        case = Case(key, kind, T)
        log(f"== {key}: m {case.rec.m}, fused steps {case.rec.steps}, defaults {case.default} "
            f"(setup {time.perf_counter() - t0:.1f} s)")
        results.append(tune_case(case, args.quick, bw, fma, log))
        del case
        torch.cuda.empty_cache()
    log("")
    log("| case | cuDNN bwd ms | scan ms | ratio | err | floor ms | of floor | compose | expand | carry | chunk |")
    log("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        b = r["best"]
        log(f"| {r['case']} | {r['cudnn_backward_ms']:.3f} | {b['ms']:.4f} | {r['cudnn_backward_ms'] / b['ms']:.1f}x | "
            f"{b['err']:.1e} | {r['floor_ms']:.4f} | {r['fraction_of_floor']:.2f} | {b['compose']} | {b['expand']} | "
            f"{b['carry_warps']} | {b['chunk']} ({b['scale']}) |")
    log(f"tune.py: {time.perf_counter() - start:.0f} s")
    (out / "tune.json").write_text(json.dumps({"device": name, "copy_bytes_per_s": bw, "fp32_fma_per_s": fma,
                                               "torch": torch.__version__, "cases": results}, indent=1))
    (out / "tune.log").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
