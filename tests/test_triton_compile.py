"""Every Triton kernel compiles ahead of time for CUDA sm_80 and sm_90, with the launches we really make.

The launch specs (argument types, constexprs, warps) are recorded from the one launch-config
path (``spscan.kernels.triton.launch``) in its GPU mode, over the shapes of the interpreter tests and
the paper's RNN cases (H = 20 and 64, B = 16), each int argument equal to 1 compiled as the
constant the JIT makes of it (Triton 3.6 failed to compile the chunked carry loop with a bound of
1 on a GPU; ``kernels.aot.specialized``). Compilation runs in a subprocess with
``TRITON_INTERPRET=0``: under the interpreter ``@triton.jit`` yields interpreted functions,
which ``triton.compile`` cannot lower. No GPU is needed; what a GPU would reject (``tl.dot``
below 16, unsupported dtypes, too much shared memory) fails here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

import spscan
from spscan.kernels.triton import launch
from spscan.kernels.triton.aot import specs_to_json
from spscan.kernels.triton.backend import _compiled

DEVICE = torch.device("cuda") if _compiled() else torch.device("cpu")  # recording launches nothing

KERNELS = {"spgemm_kernel", "spmv_kernel", "gemm_kernel", "gemv_kernel", "linear_run_kernel",
           "run_compose_kernel", "run_carry_kernel", "run_expand_kernel",
           "diag_chunk_kernel", "diag_carry_kernel", "recurrence_chunk_kernel", "recurrence_carry_kernel"}
RECURRENCE = {"recurrence_chunk_kernel", "recurrence_carry_kernel"}
# the Newton forward's fused elementwise passes (spscan.kernels.triton.fixed_point): one pass each, no spills
FIXED_POINT = {"activation_eval_kernel", "reset_gated_eval_kernel", "gated_cell_eval_kernel", "update_kernel"}
KERNELS |= FIXED_POINT
# the structured recurrence's kernels at the paper RNN's shape (H = 20), with the default float32 scheme or
# in float64, are the hot path: no spills there; the GRU's and LSTM's float32 compose kernels hold more
# blocks and spill a little (0.3-0.6 KB, measured on an H100 with it): their stack frame stays under a bound
HOT_SPILL_LIMIT, RECURRENCE_STACK_LIMIT = 0, 1024
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes of shared memory per block


def _csr(mask: np.ndarray) -> sp.csr_array:
    m = sp.csr_array(mask.astype(np.float64))
    m.sort_indices()
    return m


def _full(r: int, c: int) -> sp.csr_array:
    return _csr(np.ones((r, c), dtype=bool))


def _cases():
    """(patterns, shared flags, levels, batch, extra every k-th or None) for every shape we launch."""
    rng = np.random.default_rng(11)
    dims = [13, 29, 31, 17, 29, 23, 9]
    sparse = [_csr(rng.random((dims[i], dims[i + 1])) < 0.22) for i in range(6)]
    wide = [_csr((rng.random((300, 300)) < 0.01) | (np.arange(300)[:, None] == 150)) for _ in range(3)]
    i = np.arange(12)
    band = _csr(np.abs(i[:, None] - i[None, :]) <= 1)
    cases = [
        (sparse, [False] * 6, "full", 3, 2), (sparse, [True] * 6, "full", 3, 2),
        (sparse, [True, False, True, True, False, False], "full", 3, 2), (sparse, [False] * 6, 0, 3, None),
        (wide, [False, True, False], 1, 2, None), ([band] * 6, [False, True] * 3, "full", 2, None),
        ([_full(d, e) for d, e in zip([7, 3, 5, 11, 2, 9], [3, 5, 11, 2, 9, 6])],
         [False, True, True, False, False, True], "full", 3, 2),
        ([_full(d, e) for d, e in zip([17, 70, 33, 70, 19], [70, 33, 70, 19, 21])],
         [False, True, False, False, True], "full", 2, 2),
        ([_full(70, 70)] * 5, [True] * 5, 0, 3, 2), ([_full(70, 70)] * 4, [False] * 4, 0, 3, None),
        ([_full(5, 5)] * 6, [False] * 5 + [True], 0, 3, 3),
    ]
    # the LSTM step as two sparse elements (shared [[W_hh^T, 0], [0, I]] and a per-sample 9H-entry
    # factor): a linear run of CSR steps, B = 16
    h = 20
    lstm_shared = _csr(np.block([[np.ones((h, 4 * h), dtype=bool), np.zeros((h, h), dtype=bool)],
                                 [np.zeros((h, 4 * h), dtype=bool), np.eye(h, dtype=bool)]]))
    eye = np.eye(h, dtype=bool)
    lstm_sample = _csr(np.block([[eye, eye], [eye, eye], [eye, eye], [eye, np.zeros((h, h), dtype=bool)],
                                 [eye, eye]]))
    cases.append(([lstm_shared, lstm_sample] * 4, [True, False] * 4, 0, 16, None))
    cases.append(([lstm_shared, lstm_sample] * 4, [True, False] * 4, 0, 16, 2))
    for h in (20, 64):  # the paper's RNN: a chain of dense per-sample Jacobians, B = 16 (configs do not depend on T)
        for levels in ("auto", "full", 0, 2):
            cases.append(([_full(h, h)] * 16, [False] * 16, levels, 16, None))
            cases.append(([_full(h, h)] * 16, [False] * 16, levels, 16, 1))
        cases.append(([_full(h, h)] * 16, [True] * 16, "full", 16, None))
        cases.append(([_full(h, h)] * 16, [False, True] * 8, "full", 16, 2))
    # long uniform runs go parallel over their steps (chunked): the factored RNN step (shared W_hh^T,
    # per-sample diagonal) at m = 20 and 50 (64-wide tiles), and per-sample dense blocks
    for h in (20, 50):
        cases.append(([_full(h, h), _csr(np.eye(h, dtype=bool))] * 40, [True, False] * 40, 0, 16, None))
        cases.append(([_full(h, h), _csr(np.eye(h, dtype=bool))] * 40, [True, False] * 40, 0, 16, 2))
    cases.append(([_full(20, 20)] * 70, [False] * 70, 0, 16, 1))
    # m = 1 and batch 1: int arguments equal to 1 are compiled as the constant 1, as the JIT does
    cases.append(([_full(1, 1), _csr(np.eye(1, dtype=bool))] * 40, [True, False] * 40, 0, 1, 2))
    # runs of diagonals only (the quasi-Newton forward's J_t) go parallel per lane, any m: H = 20, 64
    # and 300, per sample, with a shared one and extra terms; batch 1 (a 1 x 1 step is a dense block)
    eye = [_csr(np.eye(h, dtype=bool)) for h in (3, 20, 64, 300)]
    cases.append(([eye[1]] * 70, [False] * 70, 0, 16, None))
    cases.append(([eye[2]] * 70, [False] * 69 + [True], 0, 16, 2))
    cases.append(([eye[3]] * 70, [False] * 70, 0, 3, 1))
    cases.append(([eye[0]] * 70, [False] * 70, 0, 1, 2))
    return cases


def _recurrence_specs() -> list:
    """Launches of the structured-recurrence kernels as the recurrent front end binds its chains (B = 16; the
    RNN at H = 20 with and without a loss on every step and at H = 64, the GRU and the LSTM at H = 20 with
    one; both dtypes, float32 with FMA, 3xTF32 and TF32 products), kernels not run; each spec carries its
    cell and H as an annotation (``_tag``; ``hot``: the RNN at H = 20)."""
    from torch import nn

    from spscan.recurrent.cells import CELLS, recurrent_patterns
    from spscan.runtime import PeriodicValues

    specs = []
    T, B = 20, 16
    for cell, kind, hidden, losses in ((nn.RNN, "rnn_tanh", 20, (False, True)), (nn.RNN, "rnn_tanh", 64, (True,)),
                                       (nn.GRU, "gru", 20, (True,)), (nn.LSTM, "lstm", 20, (True,))):
        pats = recurrent_patterns(cell(1, hidden), T, "factored")
        per = len(CELLS[kind].factored_layout(hidden))
        plan = spscan.plan(pats, levels=0, backend="triton")
        shared = CELLS[kind].shared_flags(hidden)
        for every in losses:
            has_extra = [every and i % per == 0 and 0 < i < per * T for i in range(per * T + 1)]
            bound = plan.bind(shared * T, has_extra, DEVICE, period=per)
            for dtype, precisions in ((torch.float64, ("exact",)), (torch.float32, ("exact", "ieee", "tf32"))):
                elements = [torch.zeros(p.nnz, dtype=dtype, device=DEVICE) if sh else
                            torch.zeros(T, B, p.nnz, dtype=dtype, device=DEVICE)
                            for p, sh in zip(plan.patterns[:per], shared)]
                dims = [p.shape[0] for p in pats] + [pats[-1].shape[1]]
                extra = [torch.zeros(B, d, dtype=dtype, device=DEVICE) if e else None
                         for d, e in zip(dims, has_extra)] if every else None
                for precision in precisions:
                    launch.set_dot_precision(precision)
                    with launch.recording(dry_run=True) as rec:
                        bound.run(PeriodicValues(elements, T), torch.zeros(B, dims[-1], dtype=dtype,
                                                                             device=DEVICE), extra)
                    tag = {"cell": kind, "hidden": hidden, "hot": kind == "rnn_tanh" and hidden == 20,
                           "dtype": str(dtype).replace("torch.float", "fp")}
                    specs += [dataclasses.replace(r, constexprs=r.constexprs + (("_tag", json.dumps(tag)),))
                              for r in rec if r.kernel in RECURRENCE]
    launch.set_dot_precision("exact")
    return specs


def _fixed_point_specs() -> list:
    """Launches of the Newton forward's fused passes (float64 first: its maxima are int64 bits), the activation
    pass for both activations, T = 1 as the constant the JIT makes of it, a strided update."""
    from spscan.kernels.triton import fixed_point

    with launch.recording(dry_run=True) as rec:
        for dtype in (torch.float64, torch.float32):
            for T, B, H in ((7, 3, 5), (1, 2, 4)):
                z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=DEVICE)  # noqa: E731
                maxima, scale = fixed_point.maxima_buffer(dtype, DEVICE), z(1)
                for relu in (False, True):
                    fixed_point.activation_eval(z(T, B, H), z(T, B, H), z(T, B, H), z(T, B, H), z(T, B, H), z(T, B, H),
                                                maxima, scale, relu)
                fixed_point.reset_gated_eval(z(T, B, 3 * H), z(T, B, 3 * H), z(T + 1, B, H), z(T, B, H), z(T, B, 4 * H),
                                             z(T, B, H), z(T, B, 4 * H), z(T, B, H), maxima, scale)
                fixed_point.gated_cell_eval(z(T, B, 4 * H), z(T, B, 4 * H), z(T + 1, B, 2 * H), z(T, B, 2 * H),
                                            z(T, B, 6 * H), z(B, T, 9 * H).transpose(0, 1), z(T, B, 2 * H), maxima,
                                            scale)
                fixed_point.update(z(B, 2 * T, H).transpose(0, 1)[::2], z(T, B, H), maxima)
    # passes of 2**31 entries or more index in 64 bits (too large to allocate here: the constexpr alone)
    wide = {r.kernel: dataclasses.replace(r, constexprs=tuple((k, True if k == "WIDE" else v) for k, v in r.constexprs))
            for r in rec}
    return list(rec) + list(wide.values())


def record_specs() -> list:
    """Launch specs of every case in both dtypes, GPU configurations, kernels not run."""
    saved = launch.mode
    saved_precision = launch.dot_precision
    launch.mode = "device"
    specs = []
    try:
        specs += _fixed_point_specs()
        specs += _recurrence_specs()
        for pats, shared, levels, batch, every in _cases():
            plan = spscan.plan(pats, levels=levels, backend="triton")
            for dtype in (torch.float32, torch.float64):
                vals = [torch.zeros(p.nnz if s else (batch, p.nnz), dtype=dtype, device=DEVICE)
                        for p, s in zip(pats, shared)]
                grad = torch.zeros(batch, pats[-1].shape[1], dtype=dtype, device=DEVICE)
                dims = [p.shape[0] for p in pats] + [pats[-1].shape[1]]
                extra = None if every is None else \
                    [torch.zeros(batch, d, dtype=dtype, device=DEVICE) if k % every == 1 or every == 1 else None
                     for k, d in enumerate(dims)]
                with launch.recording(dry_run=True) as rec:
                    spscan.backward(plan, vals, grad, extra)
                specs += rec
            for precision in ("tf32x3", "tf32"):  # float32 tl.dot with tensor-core products compiles too
                launch.set_dot_precision(precision)
                try:
                    vals = [torch.zeros(p.nnz if s else (batch, p.nnz), device=DEVICE) for p, s in zip(pats, shared)]
                    with launch.recording(dry_run=True) as rec:
                        spscan.backward(plan, vals, torch.zeros(batch, pats[-1].shape[1], device=DEVICE))
                    specs += [s for s in rec if s.kernel in ("gemm_kernel", "run_compose_kernel")]
                finally:
                    launch.set_dot_precision(saved_precision)
    finally:
        launch.mode = saved
        launch.set_dot_precision(saved_precision)
    # arenas past 2**31 entries switch index tables (and sizes) to int64: compile one of each kernel so
    wide, seen = [], set()
    for spec in specs:
        if spec.kernel not in seen:
            seen.add(spec.kernel)
            sig = tuple((k, {"*i32": "*i64", "i32": "i64"}.get(t, t)) for k, t in spec.signature)
            wide.append(dataclasses.replace(spec, signature=sig))
    return specs + wide


@pytest.fixture(scope="module")
def specs_file(tmp_path_factory) -> Path:
    specs = record_specs()
    path = tmp_path_factory.mktemp("aot") / "specs.json"
    path.write_text(specs_to_json(specs))
    return path


def test_specs_cover_every_kernel(specs_file):
    specs = json.loads(specs_file.read_text())
    # some launches pass an int equal to 1, which the JIT specializes: those variants compile too
    specialized = {s["kernel"] for s in specs if "i32:1" in dict(s["signature"]).values()}
    assert specialized >= {"run_expand_kernel", "gemm_kernel"}
    assert {s["kernel"] for s in specs} == KERNELS
    assert any(dict(s["constexprs"]).get("USE_DOT") for s in specs)
    assert any(dict(s["constexprs"]).get("USE_DOT") is False for s in specs)
    # every kernel that reads an index table has an int64-table variant (the carry kernels read none; the
    # fixed-point passes merge float64 maxima as int64 bits)
    assert {s["kernel"] for s in specs if "*i64" in dict(s["signature"]).values()} \
        == KERNELS - {"run_carry_kernel", "diag_carry_kernel"} - RECURRENCE
    assert {dict(s["signature"])["v_ptr" if "v_ptr" in dict(s["signature"]) else "c_ptr"] for s in specs
            if s["kernel"] not in FIXED_POINT} == {"*fp32", "*fp64"}
    assert {dict(s["signature"])["s_ptr"] for s in specs if s["kernel"] in {"activation_eval_kernel", "update_kernel"}} \
        == {"*fp32", "*fp64"}


@pytest.fixture(scope="module")
def compiled(specs_file) -> dict[int, subprocess.CompletedProcess]:
    """Both targets compiled concurrently, each in a fresh interpreter with TRITON_INTERPRET=0."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    procs = {cap: subprocess.Popen([sys.executable, "-m", "spscan.kernels.triton.aot", str(specs_file), str(cap)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for cap in (80, 90)}
    out = {}
    for cap, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        out[cap] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


def _default_scheme(consts: dict, line: str) -> str:
    """The ``tl.dot`` scheme a recurrence launch uses by default: float32-exact as tuned, FMA/DMMA in float64."""
    if json.loads(consts.get("_tag", "{}")).get("dtype") == "fp64":
        return "ieee"
    return launch.RECURRENCE_EXACT_DOT["expand" if consts.get("EXPAND") else "compose"]


def _report(line: str) -> tuple[dict, dict]:
    """An ``ok`` line of ``spscan.kernels.triton.aot``: its resource fields and its constexprs."""
    head, consts = line.split(" {", 1)
    fields = dict(kv.split("=", 1) for kv in head.split()[3:])
    return fields, json.loads("{" + consts)


@pytest.mark.parametrize("capability", [80, 90])
def test_compile_for_cuda(specs_file, compiled, capability):
    proc = compiled[capability]
    lines = proc.stdout.splitlines()
    failures = [ln for ln in lines if ln.startswith("FAIL")]
    assert proc.returncode == 0 and not failures, "\n".join(failures) or proc.stderr[-4000:]
    specs = json.loads(specs_file.read_text())
    ok = [ln for ln in lines if ln.startswith("ok")]
    assert len(ok) == len(specs)
    for ln in ok:
        fields, consts = _report(ln)
        assert int(fields["shared"]) <= SHARED_LIMIT[capability], ln
        assert int(fields["regs"]) > 0, ln  # ptxas reported
        if ln.split()[2] in FIXED_POINT and not consts["WIDE"]:  # elementwise: a few registers per entry (the
            # 64-bit variant's divisions are calls, which save a few registers on the stack)
            assert int(fields["spill_stores"]) + int(fields["spill_loads"]) == 0, f"fixed-point pass spills: {ln}"
        if ln.split()[2] in RECURRENCE:
            tag = json.loads(consts["_tag"])
            spilled = int(fields["spill_stores"]) + int(fields["spill_loads"])
            default = consts.get("PRECISION") in (None, _default_scheme(consts, ln))
            if tag["hot"] and default and capability == 90:
                assert spilled <= HOT_SPILL_LIMIT, f"hot kernel spills: {ln}"
            if tag["hidden"] == 20 and tag["dtype"] == "fp32" and default and capability == 90:
                assert int(fields["stack"]) <= RECURRENCE_STACK_LIMIT, f"stack frame over the limit: {ln}"
    # tensor-core schemes compile to matrix instructions (float32 recurrences and dense nodes)
    tc = {}
    for ln, spec in zip(ok, specs):
        fields, consts = _report(ln)
        if consts.get("PRECISION") in ("tf32x3", "tf32") and dict(spec["signature"]).get("v_ptr", dict(
                spec["signature"]).get("c_ptr")) == "*fp32" and "USE_DOT" not in consts:
            tc.setdefault(ln.split()[2], set()).add(fields["tc"])
    assert tc and all("none" not in v for v in tc.values()), tc


def test_resource_report_lists_every_recurrence_kernel(specs_file, compiled):
    """The sm_90 report of the structured recurrence's kernels, one line each: what a reader checks for
    spills and matrix instructions without a GPU (``-s`` shows it)."""
    lines = [ln for ln in compiled[90].stdout.splitlines() if ln.startswith("ok") and ln.split()[2] in RECURRENCE]
    assert lines
    seen = set()
    for ln in lines:
        fields, consts = _report(ln)
        tag = json.loads(consts["_tag"])
        key = (ln.split()[2], tag["cell"], tag["hidden"], tag["dtype"], consts.get("EXPAND"), consts.get("PRECISION"))
        if key not in seen:
            seen.add(key)
            print(" ".join(map(str, key)), {k: fields[k] for k in ("regs", "spill_stores", "stack", "shared", "tc")})


def test_interpreted_kernels_are_not_compilable_objects():
    """Why the subprocess: with TRITON_INTERPRET=1 at decoration time, kernels are interpreted functions."""
    code = ("import triton, spscan.kernels.triton.spgemm as k; "
            "print(type(k.spgemm_kernel).__name__, isinstance(k.spgemm_kernel, triton.runtime.JITFunction))")
    out = {}
    for flag in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, TRITON_INTERPRET=flag))
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[flag] = proc.stdout.split()
    assert out["0"][1] == "True"
    assert out["1"][0] != "JITFunction"
