"""The "never slower" suite's harness: one training step of a model through ``spscan.wrap`` against
plain autograd, the choice the wrapper made, and the table of all rows.

Run the suite and write its table::

    python -m bench.never_slower --out bench/results/<device>/never-slower.md [--quick] [--strict] [-- PYTEST ARGS]

which runs ``python -m pytest bench/test_never_slower.py`` with ``NEVER_SLOWER_OUT`` set (the test
module writes the table, and the rows as JSON next to it, when its last row has run), or
``python -m bench.never_slower --from-json ROWS.json --out TABLE.md`` to write a table again from
the JSON of an earlier run.

A row (:func:`measure_row`) times, after a seeded step on every side whose gradients must agree with
autograd's and after warm-up, interleaved rounds of one step each (``zero_grad``, forward, loss,
``loss.backward()``): plain autograd on a deep copy of the model, the wrapped model
(``backward="auto"`` where ``spscan.wrap`` has that option, its default otherwise), and, where the
option exists, the candidate the wrapper did not choose, forced (``backward="scan"`` or
``"native"``), the sides taking turns going first. On CUDA the device is synchronized before and after
each timed step. The row's
ratio is the median over rounds of ``autograd_time / wrapped_time`` (> 1: the wrapped step is
faster). The choice comes from ``wrapped.decision`` (``.chosen.name``, ``.chosen.predicted_s``,
``.candidates``); without it the choice is reported as ``"scan"``. A model ``spscan.wrap``
refuses is recorded as ``refused: <first line of the error>`` (one that refuses only
``backward="auto"`` is wrapped without it, the refusal in its note); a row whose wrapped gradients
differ from autograd's is recorded as such and not timed.

Environment: ``NEVER_SLOWER_OUT`` (write the table there), ``NEVER_SLOWER_STRICT=1`` (a row
whose ratio is below :data:`BAR` fails), ``SPSCAN_BENCH_QUICK=1`` (fewer rounds per row).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["BAR", "LOST_BY", "Row", "Decision", "median_ratio", "quartiles", "backward_option_supported",
           "read_decision", "refusal", "grad_error", "rounds_for", "choice_lost", "row_notes", "graph_failures",
           "measure_row", "format_table",
           "summary_line", "write_table", "rows_from_json", "strict_failures", "main"]

BAR = 0.97  #: the acceptance bar: autograd time / wrapped time of a row at least this
LOST_BY = 0.03  #: a choice "lost" when the chosen candidate measured slower than the other by more than this
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Row:
    """One row of the table: a model on a device at a thread count. Times in seconds (None: not
    measured or not predicted); ``ratio`` is the median over rounds of autograd / chosen."""

    model: str
    device: str
    threads: int
    batch: int
    family: str = ""
    threads_label: str = ""
    choice: str = "scan"
    option: bool = False  # spscan.wrap had backward=: the choice is the wrapper's
    refused: Optional[str] = None
    ratio: Optional[float] = None
    ratio_q25: Optional[float] = None
    ratio_q75: Optional[float] = None
    rounds: int = 0
    autograd_s: Optional[float] = None
    chosen_s: Optional[float] = None
    predicted_chosen_s: Optional[float] = None
    other: Optional[str] = None
    other_s: Optional[float] = None
    predicted_other_s: Optional[float] = None
    other_refused: Optional[str] = None
    # the further candidates not chosen (three on a GPU: scan, native, graph), each forced and timed too:
    # [{"name", "predicted_s", "measured_s"}]
    more: list = field(default_factory=list)
    option_refused: Optional[str] = None  # wrap(..., backward="auto") refused, wrap(...) did not
    grad_rel_diff: Optional[float] = None
    wrong: Optional[str] = None  # the wrapped gradients differ from autograd's: not timed
    load_1min: Optional[float] = None
    # a side whose steps from CUDA graphs could not all be recorded (those steps ran eagerly, so its time
    # is partly the eager step's): why, as the recording said it
    graph_failed: Optional[str] = None
    # the peer a user would pick for launch-bound steps: torch.compile(model, mode="reduce-overhead") on an
    # identical copy, timed in the same rounds (``--peer-compile``); None: not measured
    compiled_s: Optional[float] = None
    ratio_vs_compiled: Optional[float] = None  # median over rounds of compiled time / wrapped time
    compiled_failed: Optional[str] = None
    explain: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ran(self) -> bool:
        return self.refused is None and self.wrong is None and self.ratio is not None

    def label(self) -> str:
        return f"{self.model} ({self.device}, {self.threads} thread{'s' if self.threads != 1 else ''})"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Row":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class Decision:
    """What the wrapper chose: ``chosen`` ("scan" or "native"), its predicted seconds of one step,
    the other candidate and its prediction, and the wrapper's explanation (empty without one)."""

    chosen: str = "scan"
    predicted_s: Optional[float] = None
    other: Optional[str] = None
    other_predicted_s: Optional[float] = None
    explain: str = ""
    more: list = field(default_factory=list)  # further candidates not chosen: (name, predicted seconds)


# ----------------------------------------------------------------------------- pure functions


def median_ratio(pairs: Sequence[Sequence[float]]) -> float:
    """Median over rounds of ``autograd / wrapped``: each round's first two times."""
    if not pairs:
        raise ValueError("median_ratio: no rounds")
    return statistics.median(p[0] / p[1] for p in pairs)


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The lower and upper quartile (nearest rank) of ``values``."""
    v = sorted(values)
    return v[len(v) // 4], v[(3 * len(v)) // 4]


def backward_option_supported(wrap: Optional[Callable] = None) -> bool:
    """Whether ``spscan.wrap`` (or ``wrap``) takes ``backward=`` ("auto" / "scan" / "native")."""
    if wrap is None:
        import spscan

        wrap = spscan.wrap
    try:
        return "backward" in inspect.signature(wrap).parameters
    except (TypeError, ValueError):
        return False


def read_decision(wrapped: Any) -> Decision:
    """The wrapper's ``decision`` (chosen candidate, predictions, explanation) as a :class:`Decision`;
    ``Decision()`` (the scan, no prediction) for a wrapper without one."""
    dec = getattr(wrapped, "decision", None)
    if dec is None:
        return Decision()
    chosen = getattr(dec, "chosen", None)
    name = str(getattr(chosen, "name", "scan"))
    out = Decision(chosen=name, predicted_s=getattr(chosen, "predicted_s", None))
    for c in getattr(dec, "candidates", None) or ():
        if getattr(c, "name", None) == name:
            continue
        if out.other is None:
            out.other, out.other_predicted_s = str(c.name), getattr(c, "predicted_s", None)
        else:
            out.more.append((str(c.name), getattr(c, "predicted_s", None)))
    explain = getattr(dec, "explain", None)
    if callable(explain):
        try:
            out.explain = str(explain())
        except Exception as e:  # an explanation must not cost the row
            out.explain = f"(explain() raised {type(e).__name__}: {e})"
    return out


def refusal(exc: BaseException, limit: int = 160) -> str:
    """``refused: <first line of the error>`` (the exception's type where its message is empty), file
    paths relative to the checkout, cut to ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = re.sub(r"(?<![\w.])/\S*?/(?=(?:bench|spscan|tests|kernels|planner)/)", "",
                  lines[0] if lines else type(exc).__name__)
    return "refused: " + (text if len(text) <= limit else text[:limit - 3].rstrip() + "...")


def rounds_for(round_s: float, budget_s: float, lo: int, hi: int) -> int:
    """Rounds that fit ``budget_s`` at ``round_s`` seconds each, within ``[lo, hi]``, odd (a true median)."""
    n = int(budget_s / round_s) if round_s > 0 else hi
    n = max(lo, min(hi, n))
    if n % 2 == 0:
        n = n - 1 if n > lo else n + 1
    return n


def choice_lost(chosen_s: Optional[float], other_s: Optional[float], by: float = LOST_BY) -> bool:
    """The chosen candidate measured slower than the other by more than ``by`` (both measured)."""
    return chosen_s is not None and other_s is not None and chosen_s > other_s * (1 + by)


def row_notes(row: Row, bar: float = BAR) -> list[str]:
    """The note column: refusal, a native backward chosen, a lost choice, a ratio under the bar."""
    if row.refused:
        return [row.refused]
    if row.wrong:
        return [row.wrong]
    notes = []
    if row.option_refused:
        notes.append(f"backward='auto' {row.option_refused}")
    if row.choice == "native":
        notes.append("native backward chosen")
    if row.other_refused:
        notes.append(f"{row.other} {row.other_refused}")
    for name, measured in [(row.other, row.other_s)] + [(m["name"], m.get("measured_s")) for m in row.more]:
        if choice_lost(row.chosen_s, measured):
            notes.append(f"choice lost ({name} {_ms(measured)} ms)")
    if row.ratio is not None and row.ratio < bar:
        notes.append(f"below {bar:g}")
    if row.graph_failed:
        notes.append(f"graph partly eager ({row.graph_failed})")
    return notes


def graph_failures(wrapped) -> list[str]:
    """Why a wrapped model's whole-step CUDA-graph recordings failed, one entry per failed signature (none where
    it has no step graphs or all recorded)."""
    steps = getattr(getattr(wrapped, "plan", None), "step_graphs", None)
    entries = getattr(steps, "entries", None) or {}
    return [e.error or "failed" for e in entries.values() if e.failed or e.backward_eager]


def strict_failures(rows: Sequence[Row], bar: float = BAR) -> list[Row]:
    """Rows that ran with a ratio under ``bar``."""
    return [r for r in rows if r.ran and r.ratio < bar]


# ----------------------------------------------------------------------------- measuring a row


def device_clock(device: str) -> Callable[[], float]:
    """``time.perf_counter``, after synchronizing ``device`` where it is a CUDA one (a time then covers every
    kernel the timed work launched)."""
    if device.startswith("cuda"):
        import torch

        def synced() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return synced
    return time.perf_counter


def grad_error(ref: Sequence, other: Sequence) -> float:
    """Largest ``max|g_ref - g|`` over matching parameters, each relative to its own ``max|g_ref|`` or a
    hundredth of the model's largest gradient, whichever is larger: a parameter whose gradient is
    zero up to rounding (a conv's bias before a train-mode BatchNorm: float32 noise of about 1e-3 of
    the model's largest gradient on either side) is not compared by its noise.
    ``inf`` where one side has a gradient and the other none."""
    pairs = [(p.grad, q.grad) for p, q in zip(ref, other, strict=True) if p.grad is not None or q.grad is not None]
    if any(a is None or b is None for a, b in pairs):
        return math.inf
    floor = 1e-2 * max((float(a.abs().max()) for a, _ in pairs), default=0.0)
    worst = 0.0
    for a, b in pairs:
        scale = max(float(a.abs().max()), floor, 1e-30)
        worst = max(worst, float((a - b).abs().max()) / scale)
    return worst


def measure_row(case, device: str = "cpu", threads: Optional[int] = None, threads_label: str = "",
                budget_s: float = 6.0, min_rounds: int = 5, max_rounds: int = 41, warmup: int = 2,
                grad_tol: float = 1e-3, wrap: Optional[Callable] = None, run_rounds: Optional[Callable] = None,
                compile_peer: Optional[Callable] = None) -> Row:
    """One row for ``case`` (a :class:`never_slower_models.Case`) on ``device`` at ``threads`` torch
    threads (None: as set). ``wrap`` replaces ``spscan.wrap``; ``run_rounds(fn, n)`` runs the timed
    rounds (the benchmark fixture's ``pedantic``; default a loop). A wrapped side whose gradients
    differ from autograd's by ``grad_tol`` or more (:func:`grad_error`) sets ``row.wrong`` and
    nothing is timed. ``compile_peer(module)``: a compiled module (:func:`compile_reduce_overhead`) timed as
    one more side on an identical copy (``row.compiled_s``, ``row.ratio_vs_compiled``); a peer that fails to
    compile or run is recorded in ``row.compiled_failed`` and the row goes on without it."""
    import torch

    if wrap is None:
        import spscan

        wrap = spscan.wrap
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        row = Row(model=case.name, device=device, threads=torch.get_num_threads(), batch=case.batch,
                  family=case.family, threads_label=threads_label or str(torch.get_num_threads()),
                  option=backward_option_supported(wrap))
        _measure(row, case, device, wrap, torch, budget_s, min_rounds, max_rounds, warmup, grad_tol, run_rounds,
                 compile_peer)
    finally:
        torch.set_num_threads(before)
    row.load_1min = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    row.notes = row_notes(row)
    return row


def fresh_copy(module: Any) -> Any:
    """A deep copy of ``module`` (None stays None) whose recurrent layers are told to hold their weights in one
    block (``flatten_parameters``): a weight of an ``nn.RNN``/``GRU``/``LSTM`` in memory of its own makes cuDNN
    pack them into one block on every call (torch warns "not part of single contiguous chunk"), which
    would slow that copy's steps (autograd's side of a row) and not the wrapped model's. On an H100 the
    recurrent rows, timed against unflattened copies, had the `native` choice (the module's own backward)
    at 1.12-1.36x autograd's step."""
    if module is None:
        return None
    out = copy.deepcopy(module)
    for m in out.modules():
        if callable(getattr(m, "flatten_parameters", None)):
            m.flatten_parameters()
    return out


def compile_reduce_overhead(module: Any) -> Any:
    """``torch.compile(module, mode="reduce-overhead")``: the peer of a step replayed from CUDA graphs (inductor's
    kernels, recorded as CUDA graphs by torch)."""
    import torch

    return torch.compile(module, mode="reduce-overhead")


def _measure(row: Row, case, device, wrap, torch, budget_s, min_rounds, max_rounds, warmup, grad_tol, run_rounds,
             compile_peer=None):
    model, head = case.build(device)
    x, y = case.data(device)
    plain, plain_head = fresh_copy(model), fresh_copy(head)
    try:
        wrapped = wrap(model, x, backward="auto") if row.option else wrap(model, x)
    except Exception as e:  # noqa: BLE001 - any refusal is the row's result
        row.refused = refusal(e)
        if not row.option:
            return
        # a model kind that does not take backward= (yet) is still a row: wrapped without it
        model = fresh_copy(plain)
        try:
            wrapped = wrap(model, x)
        except Exception:  # noqa: BLE001 - the refusal of backward="auto" stands
            return
        row.option, row.refused = False, None
        row.option_refused = refusal(e)
    dec = read_decision(wrapped)
    row.choice, row.predicted_chosen_s, row.explain = dec.chosen, dec.predicted_s, dec.explain
    sides = [(plain, plain_head, plain), (wrapped, head, model)]
    if row.option:
        row.other = dec.other or ("native" if dec.chosen == "scan" else "scan")
        row.predicted_other_s = dec.other_predicted_s
        other_model, other_head = fresh_copy(plain), fresh_copy(plain_head)
        try:
            sides.append((wrap(other_model, x, backward=row.other), other_head, other_model))
        except Exception as e:  # noqa: BLE001
            row.other_refused = refusal(e)
        if len(sides) == 3:
            for name, predicted in dec.more:
                more_model, more_head = fresh_copy(plain), fresh_copy(plain_head)
                try:
                    sides.append((wrap(more_model, x, backward=name), more_head, more_model))
                except Exception:  # noqa: BLE001 - an alternative that cannot run is not timed
                    continue
                row.more.append({"name": name, "predicted_s": predicted, "measured_s": None})

    def stepper(net, hd, mod):  # the parameters are the unwrapped module's (the wrapper shares them)
        params = list(mod.parameters()) + (list(hd.parameters()) if hd is not None else [])

        def step() -> None:
            for p in params:
                p.grad = None
            case.step_loss(net(x), hd, y).backward()

        return step

    compiled_at = None
    if compile_peer is not None:
        peer_model, peer_head = fresh_copy(plain), fresh_copy(plain_head)
        try:
            peer = compile_peer(peer_model)
            peer_step = stepper(peer, peer_head, peer_model)
            for _ in range(3):  # compiled, then recorded (reduce-overhead records from its second or third call)
                peer_step()
            sides.append((peer, peer_head, peer_model))
            compiled_at = len(sides) - 1
        except Exception as e:  # noqa: BLE001 - a peer that cannot compile is noted, the row goes on
            row.compiled_failed = refusal(e)
    steps = [stepper(*side) for side in sides]

    # one seeded step on every side from the same weights, in full float32 (no TF32 on CUDA): the
    # gradients must agree with autograd's
    def grads(mod, hd):
        return list(mod.parameters()) + (list(hd.parameters()) if hd is not None else [])

    worst = 0.0
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # rounding order only
    try:
        for k, step in enumerate(steps):
            torch.manual_seed(1234)
            step()
            if k and k != compiled_at:  # the peer's own gradients are torch.compile's affair, not the row's
                worst = max(worst, grad_error(grads(plain, plain_head), grads(sides[k][2], sides[k][1])))
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    row.grad_rel_diff = worst
    if not worst < grad_tol:  # a wrong backward is not timed
        row.wrong = f"gradients differ from autograd's by {worst:.3g} (relative, limit {grad_tol:g})"
        return

    clock = device_clock(device)
    times: list[tuple[float, ...]] = []

    def one_round() -> None:
        # the sides take turns going first (round r starts at side r mod n): a step that follows another
        # inherits its state (freed buffers, caches), so each side follows each other side equally often
        t = [0.0] * len(steps)
        first = len(times) % len(steps)
        for k in [*range(first, len(steps)), *range(first)]:
            t0 = clock()
            steps[k]()
            t[k] = clock() - t0
        times.append(tuple(t))

    for _ in range(max(1, warmup)):  # at least one: it sizes the timed rounds
        one_round()
    n = rounds_for(sum(times[-1]), budget_s, min_rounds, max_rounds)
    times.clear()
    if run_rounds is None:
        for _ in range(n):
            one_round()
    else:
        run_rounds(one_round, n)
    row.rounds = len(times)
    ratios = [t[0] / t[1] for t in times]
    row.ratio = median_ratio(times)
    row.ratio_q25, row.ratio_q75 = quartiles(ratios)
    row.autograd_s = statistics.median(t[0] for t in times)
    row.chosen_s = statistics.median(t[1] for t in times)
    if len(steps) > 2 and compiled_at != 2:  # the forced other candidate's side, where it exists
        row.other_s = statistics.median(t[2] for t in times)
    for k, m in enumerate(row.more):
        m["measured_s"] = statistics.median(t[3 + k] for t in times)
    if compiled_at is not None:
        row.compiled_s = statistics.median(t[compiled_at] for t in times)
        row.ratio_vs_compiled = statistics.median(t[compiled_at] / t[1] for t in times)
    failed = [f for net, _, _ in sides[1:] for f in graph_failures(net)]
    row.graph_failed = "; ".join(sorted(set(failed))) or None


# ----------------------------------------------------------------------------- the table


def _ms(s: Optional[float]) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}" if s < 0.1 else f"{s * 1e3:.1f}"


def _ratio(r: Row) -> str:
    if r.ratio is None:
        return "-"
    return f"{r.ratio:.2f} ({r.ratio_q25:.2f}-{r.ratio_q75:.2f})" if r.ratio_q25 is not None else f"{r.ratio:.2f}"


COLUMNS = ["model", "device", "threads", "batch", "choice", "ratio vs autograd (IQR)", "autograd (ms)",
           "predicted chosen (ms)", "measured chosen (ms)", "predicted other / measured other (ms)", "note"]


def _vs_compiled(r: Row) -> str:
    if r.compiled_failed:
        return "failed"
    return "-" if r.ratio_vs_compiled is None else f"{r.ratio_vs_compiled:.2f} ({_ms(r.compiled_s)} ms)"


def format_row(r: Row, compiled: bool = False) -> str:
    other = "-" if r.other is None else "; ".join(
        f"{name}: {_ms(p)} / {_ms(m)}" for name, p, m in
        [(r.other, r.predicted_other_s, r.other_s)] + [(d["name"], d.get("predicted_s"), d.get("measured_s"))
                                                       for d in r.more])
    choice = "-" if r.refused else r.choice
    notes = "; ".join(r.notes or row_notes(r)).replace("|", "\\|")
    cells = [r.model, r.device, r.threads_label or str(r.threads), str(r.batch), choice, _ratio(r),
             _ms(r.autograd_s), _ms(r.predicted_chosen_s), _ms(r.chosen_s), other, notes]
    if compiled:
        cells.insert(6, _vs_compiled(r))
    return "| " + " | ".join(cells) + " |"


def format_table(rows: Sequence[Row]) -> str:
    """The markdown table; with a column *vs compile* (torch.compile's reduce-overhead step time over the
    wrapped one, and its time) where any row timed that peer."""
    compiled = any(r.compiled_s is not None or r.compiled_failed for r in rows)
    cols = COLUMNS[:6] + ["vs torch.compile reduce-overhead (its ms)"] + COLUMNS[6:] if compiled else COLUMNS
    align = ["---"] * 5 + ["---:"] * (len(cols) - 7) + ["---"] * 2
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + [format_row(r, compiled) for r in rows])


def summary_line(rows: Sequence[Row], bar: float = BAR) -> str:
    """One line: rows run and refused, rows at or above ``bar`` (the ones below listed), lost choices."""
    ran = [r for r in rows if r.ran]
    refused = [r for r in rows if r.refused]
    wrong = [r for r in rows if r.wrong]
    below = strict_failures(rows, bar)
    lost = [r for r in ran if choice_lost(r.chosen_s, r.other_s)]
    parts = [f"{len(ran)} rows ran, {len(refused)} refused"]
    if wrong:
        parts[0] += ", wrong gradients: " + ", ".join(r.label() for r in wrong)
    if ran:
        geo = math.exp(sum(math.log(r.ratio) for r in ran) / len(ran))
        parts.append(f"ratio >= {bar:g} in {len(ran) - len(below)} of {len(ran)} (geometric mean {geo:.2f})")
    parts.append("below " + f"{bar:g}: " + (", ".join(f"{r.label()} {r.ratio:.2f}" for r in below) or "none"))
    if any(r.option for r in rows):
        parts.append("choice lost: " + (", ".join(r.label() for r in lost) or "none"))
    return "; ".join(parts)


def write_table(rows: Sequence[Row], out: Path, header: Sequence[str] = ()) -> None:
    """``out`` (markdown: header lines, the table, the summary line) and ``out`` with ``.json`` (the rows)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = list(header) + ([""] if header else []) + [format_table(rows), "", summary_line(rows)]
    loads = [r.load_1min for r in rows if r.load_1min is not None]
    if loads:
        text[-1] += f" (load average over 1 min at the rows' ends: {min(loads):.1f} to {max(loads):.1f})"
    explained = [r for r in rows if r.explain]
    if explained:
        text += ["", "## The wrapper's explanations", ""]
        for r in explained:
            text += [f"**{r.label()}**", "", "```text", r.explain.rstrip(), "```", ""]
    out.write_text("\n".join(text).rstrip() + "\n")
    out.with_suffix(".json").write_text(json.dumps({"header": list(header), "rows": [r.to_dict() for r in rows]},
                                                   indent=1) + "\n")


def rows_from_json(path: Path) -> tuple[list[str], list[Row]]:
    data = json.loads(Path(path).read_text())
    return list(data.get("header", [])), [Row.from_dict(d) for d in data["rows"]]


def default_header(device_name: str, date: Optional[str] = None) -> list[str]:
    import torch

    date = date or time.strftime("%Y-%m-%d", time.gmtime())
    return [
        "# Never slower: a training step through `spscan.wrap` against autograd",
        "",
        f"{device_name}, torch {torch.__version__}, {date}. Each row times one training step (zero_grad, forward, "
        "loss, `loss.backward()`) of the wrapped model against plain autograd on an identical copy, in "
        "interleaved rounds after warm-up, the sides taking turns going first (wall time; CUDA synchronized "
        "around each step). **ratio** = median "
        "over rounds of autograd time / wrapped time (> 1: the wrapped step is faster), with its interquartile "
        f"range; the bar is {BAR:g}. *choice*: the backward the wrapper chose (`scan` where `spscan.wrap` has "
        "no `backward=` option); *other*: the candidate it did not choose, forced and timed in the same rounds. "
        "Run: `python -m bench.never_slower --out <this file>`.",
    ]


# ----------------------------------------------------------------------------- command line


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m bench.never_slower",
                                description="Run bench/test_never_slower.py and write its table.")
    p.add_argument("--out", required=True, help="the markdown table to write (the rows go to the same name, .json)")
    p.add_argument("--quick", action="store_true", help="fewer rounds per row (SPSCAN_BENCH_QUICK=1)")
    p.add_argument("--strict", action="store_true", help=f"a row with a ratio under {BAR:g} fails")
    p.add_argument("--date", default=None, help="the date in the header (default: today, UTC)")
    p.add_argument("--note", action="append", default=[], help="a line added to the header (repeatable)")
    p.add_argument("--from-json", default=None, help="write the table from an earlier run's rows, run nothing")
    p.add_argument("--peer-compile", action="store_true",
                   help='also time torch.compile(model, mode="reduce-overhead") on each row (NEVER_SLOWER_PEER_COMPILE=1)')
    ns = p.parse_args(argv)
    if ns.from_json:
        header, rows = rows_from_json(Path(ns.from_json))
        write_table(rows, Path(ns.out), header + ns.note)
        print(summary_line(rows))
        return 0
    env = dict(os.environ, NEVER_SLOWER_OUT=str(Path(ns.out).resolve()))
    if ns.quick:
        env["SPSCAN_BENCH_QUICK"] = "1"
    if ns.strict:
        env["NEVER_SLOWER_STRICT"] = "1"
    if ns.date:
        env["NEVER_SLOWER_DATE"] = ns.date
    if ns.note:
        env["NEVER_SLOWER_NOTE"] = "\n".join(ns.note)
    if ns.peer_compile:
        env["NEVER_SLOWER_PEER_COMPILE"] = "1"
    cmd = [sys.executable, "-m", "pytest", str(ROOT / "bench" / "test_never_slower.py"), "-p", "no:cacheprovider",
           *passthrough]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
