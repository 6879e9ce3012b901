"""Instructions executed per training step, two checkouts of spscan on the same CPU rows (callgrind).

    python -m bench.instructions --side before=PYTHON:DIR --side after=PYTHON:DIR --out TABLE.md \
        [--rows gru-1000-step-last lenet5-step ...] [--reps 3]

Wall time on a shared or virtual machine moves between sittings by more than a few percent, so a
small regression between two trees cannot be told from the machine's drift (``bench/ab.py`` shows
that spread). The instructions a step executes, counted by valgrind's callgrind, do not drift: they
change with the code. This runs each row's wrapped step under callgrind, one thread, on each side
(the sides in parallel: the count does not depend on the load), and tabulates instructions per step
and after/before. A count is not a time (it ignores caches and memory), so a table from here
complements, not replaces, the timed rows: it shows whether the work a step does changed.

Rows, named like the timed rows: ``{rnn,gru,lstm}-T-{step,backward,forward}-{last,every}`` (the model,
input and loss of ``bench/test_recurrent_step.py``) and ``{lenet5,vgg_small,alexnet_like}-{step,backward,
forward}`` (``bench/test_cnn_step.py``'s), built by those modules' own set-ups: each side's checkout's
``bench/`` (the same models; a move of spscan's modules may change their imports) with that side's spscan.
Each side's process runs two warm-up steps (planning, lowering, allocator), then counts ``--reps`` steps
between two callgrind client requests (a four-line C shim compiled with the system's ``cc`` against
valgrind's ``callgrind.h``). Needs ``valgrind`` and a C compiler; Linux only.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["ROWS", "main"]

ROWS = [f"{c}-{t}-{m}-{loss}" for c in ("rnn", "gru", "lstm") for t in (1000, 3000)
        for m in ("step", "backward", "forward") for loss in ("last", "every")
        if c == "lstm" or (m != "forward" and loss == "last")]
ROWS += [f"{n}-{m}" for n in ("lenet5", "vgg_small", "alexnet_like") for m in ("forward", "backward", "step")]

_SHIM = """#include <valgrind/callgrind.h>
void spscan_count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_TOGGLE_COLLECT; }
void spscan_count_stop(const char *name) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS_AT(name); }
"""


# ----------------------------------------------------------------------------- the rows (child side)

def _bench_on_path() -> None:
    """This file's folder (``bench/``) on the import path, not the checkout's root: spscan stays each side's."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)


def _forward(row: str):
    """The row's ``forward()`` (zero_grad, forward, loss) and its mode, from the timed rows' own set-ups."""
    _bench_on_path()
    parts = row.split("-")
    if len(parts) == 4:
        from test_recurrent_step import _setup as recurrent

        return recurrent(parts[0], int(parts[1]), scan=True, loss=parts[3])[1], parts[2]
    from test_cnn_step import _setup as cnn

    return cnn(parts[0], scan=True)[1], parts[1]


def _child(rows: list[str], reps: int, shim: str) -> None:
    import ctypes

    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as the timed recurrent rows run
    os.environ.setdefault("SPSCAN_BACKWARD", "scan")  # the timed rows' setting: the scan, not the planner's choice
    lib = ctypes.CDLL(shim)
    for row in rows:
        forward, mode = _forward(row)
        # one thread for the counted steps: the rows' set-ups import bench/conftest.py, which sets the
        # timed rows' thread count; a second thread's barrier spins would be counted as instructions
        torch.set_num_threads(1)
        for _ in range(2):
            forward().backward()
        if mode == "backward":
            losses = [forward() for _ in range(reps)]
            lib.spscan_count_start()
            for loss in losses:
                loss.backward()
        elif mode == "forward":
            lib.spscan_count_start()
            losses = [forward() for _ in range(reps)]
        else:
            lib.spscan_count_start()
            for _ in range(reps):
                forward().backward()
        lib.spscan_count_stop(row.encode())
        if mode == "forward":
            for loss in losses:
                loss.backward()
        print(f"counted {row}", flush=True)


# ----------------------------------------------------------------------------- the driver

def _shim(folder: Path) -> Path:
    src, lib = folder / "shim.c", folder / "libspscan_count.so"
    src.write_text(_SHIM)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _counts(folder: Path, stem: str) -> dict[str, int]:
    """``{row: instructions}`` from the callgrind dumps ``stem.<pid>.<n>`` in ``folder``."""
    out = {}
    for f in folder.glob(f"{stem}.*.*"):
        text = f.read_text(errors="replace")
        name = re.search(r"^desc: Trigger: Client Request: (.+)$", text, re.M)
        total = re.search(r"^summary: (\d+)$", text, re.M)
        if name and total:
            out[name.group(1)] = int(total.group(1))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", action="append", default=[], help="NAME=PYTHON:DIR (twice)")
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shim", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.rows, args.reps, args.shim)
        return 0
    if len(args.side) != 2 or args.out is None:
        ap.error("two --side NAME=PYTHON:DIR and --out TABLE.md are needed")
    _bench_on_path()
    from ab import parse_sides

    sides = parse_sides(args.side)
    work = Path(tempfile.mkdtemp(prefix="spscan-instructions-"))
    shim = _shim(work)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", NUMBA_NUM_THREADS="1", PYTHONHASHSEED="0")
    procs = []
    t0 = time.perf_counter()
    for name, python, root in sides:
        # each side's rows are built by its own checkout's bench/ (the same models; module paths may differ
        # between the two trees), with that side's spscan (its PYTHON's install)
        script = root / "bench" / "instructions.py"
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--smc-check=all-non-file",
               f"--callgrind-out-file={work}/{name}.%p", python,
               str(script if script.exists() else Path(__file__).resolve()), "--child",
               "--shim", str(shim), "--reps", str(args.reps), "--rows", *args.rows]
        log = open(work / f"{name}.log", "w")
        procs.append((name, subprocess.Popen(cmd, cwd="/tmp", env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for name, p, log in procs:
        if p.wait() != 0:
            raise RuntimeError(f"{name}: callgrind run failed; see {work}/{name}.log")
        log.close()
    counts = {name: _counts(work, name) for name, _, _ in sides}
    a, b = (s[0] for s in sides)
    lines = [f"# Instructions per step: {a} against {b} (callgrind, one thread)", "",
             f"Each row: {args.reps} steps counted after 2 warm-up steps, divided by {args.reps}. "
             f"{time.perf_counter() - t0:.0f} s under valgrind. Produced by `python -m bench.instructions`.", "",
             f"| row | {a} | {b} | {b}/{a} |", "|---|---:|---:|---:|"]
    ratios = []
    for row in args.rows:
        ca, cb = counts[a].get(row), counts[b].get(row)
        if ca is None or cb is None:
            lines.append(f"| {row} | {'-' if ca is None else f'{ca / args.reps / 1e6:.2f} M'} | "
                         f"{'-' if cb is None else f'{cb / args.reps / 1e6:.2f} M'} | - |")
            continue
        ratios.append(cb / ca)
        lines.append(f"| {row} | {ca / args.reps / 1e6:.2f} M | {cb / args.reps / 1e6:.2f} M | {cb / ca:.3f} |")
    if ratios:
        import math

        geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        lines += ["", f"{len(ratios)} rows; geometric mean {b}/{a} {geo:.3f}; largest {max(ratios):.3f}; "
                      f"smallest {min(ratios):.3f}"]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
