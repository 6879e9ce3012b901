"""The "never slower" suite's harness (``bench/never_slower.py``, ``bench/never_slower_models.py``),
without timing anything that is asserted: the models have their declared shapes, a row's ratio is
the median of per-round ratios, refused models and the wrapper's choice are recorded, and the table
and its summary are written as the suite writes them. Rows here run a tiny model with fake
``wrap`` functions (today's API, ``backward=`` with a ``decision``, a refusal, wrong gradients).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _import_bench(name: str):
    """A ``bench/`` module, imported with ``bench/conftest.py`` as the ``conftest`` its imports name
    (this directory's conftest is ``conftest`` while the tests run)."""
    saved = sys.modules.get("conftest")
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("conftest", BENCH / "conftest.py")
        bench_conftest = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench_conftest)
        sys.modules["conftest"] = bench_conftest
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))
        if saved is not None:
            sys.modules["conftest"] = saved
        else:
            sys.modules.pop("conftest", None)


ns = _import_bench("never_slower")
models = _import_bench("never_slower_models")
TINY = models.Case("tiny", "cnn", 4, lambda: nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 5)), (3,), (5,),
                   classes=5)
FAST = dict(budget_s=0.0, min_rounds=3, max_rounds=3, warmup=1)


@pytest.fixture
def one_thread():
    """One torch thread: a 1000-step recurrent forward on two threads of a loaded 2-core machine
    waits at a thread barrier every step (seconds instead of milliseconds)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", models.CASES, ids=[c.name for c in models.CASES])
def test_models_have_their_declared_shapes(case, one_thread):
    model, head = case.build()
    x, y = case.data()
    assert tuple(x.shape) == (case.batch, *case.input_shape) and tuple(y.shape) == (case.batch,)
    assert model.training
    with torch.no_grad():
        out = model(x)
        seq = out[0] if isinstance(out, tuple) else out
        assert tuple(seq.shape) == (case.batch, *case.output_shape)
        loss = case.step_loss(out, head, y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    again, _ = case.build()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_the_rows_cover_the_brief():
    names = set(models.CASE_NAMES)
    assert {"lenet5", "vgg_small", "alexnet_like", "resnet20", "mobilenet_like", "layernorm_mlp",
            "transformer_encoder", "mlp_mixer", "vit_tiny"} <= names
    assert {f"{c}_T{T}_B{B}" for c in ("rnn", "gru", "lstm") for T in (100, 1000) for B in (1, 16)} <= names
    assert sum(isinstance(m, nn.Dropout) for m in models.alexnet_like().modules()) == 2
    assert sum(isinstance(m, nn.MaxPool2d) and m.kernel_size == 3 and m.stride == 2
               for m in models.alexnet_like().modules()) == 3
    assert any(isinstance(m, nn.Conv2d) and m.groups == m.in_channels > 1 for m in models.mobilenet_like().modules())


def test_suite_parametrizes_threads_and_devices():
    suite = _import_bench("test_never_slower")
    combos = {(p.values[1], p.values[2]) for p in suite.PARAMS}
    assert combos == {("default", "cpu"), (1, "cpu"), ("default", "cuda"), (1, "cuda")}
    assert all(p.marks for p in suite.PARAMS if p.values[2] == "cuda")
    assert not any(p.marks for p in suite.PARAMS if p.values[2] == "cpu")


def test_ratio_is_the_median_of_per_round_ratios():
    pairs = [(1.0, 2.0), (3.0, 1.0), (10.0, 10.0)]  # ratios 0.5, 3, 1; medians' ratio would be 3 / 2
    assert ns.median_ratio(pairs) == 1.0
    assert ns.median_ratio([(2.0, 1.0, 9.0)]) == 2.0  # a third side (the other candidate) is not in it
    with pytest.raises(ValueError):
        ns.median_ratio([])
    assert ns.quartiles([4, 1, 3, 2]) == (2, 4)


def test_rounds_fit_the_budget_and_are_odd():
    assert ns.rounds_for(0.1, 6.0, 5, 41) == 59 - 18  # capped, odd
    assert ns.rounds_for(1.0, 6.0, 5, 41) == 5
    assert ns.rounds_for(0.2, 6.0, 5, 41) == 29
    assert ns.rounds_for(0.0, 6.0, 5, 41) == 41
    assert all(ns.rounds_for(t, 6.0, 5, 41) % 2 for t in (0.01, 0.15, 0.5, 2.0))


def test_backward_option_is_detected_from_the_signature():
    assert not ns.backward_option_supported(lambda model, x, *, levels="auto": model)
    assert ns.backward_option_supported(lambda model, x, *, backward="auto": model)
    import spscan

    assert ns.backward_option_supported() == ("backward" in __import__("inspect").signature(spscan.wrap).parameters)


def test_a_refused_model_is_recorded_not_raised():
    def refuse(model, x):
        raise TypeError("Tiny: unsupported op at /somewhere/checkout/spscan/graph.py:12\nsecond line")

    row = ns.measure_row(TINY, wrap=refuse, **FAST)
    assert row.refused == "refused: Tiny: unsupported op at spscan/graph.py:12"
    assert not row.ran and row.ratio is None and row.notes == [row.refused]
    line = ns.format_row(row)
    assert "refused: Tiny" in line and line.count(" | ") == len(ns.COLUMNS) - 1
    assert ns.summary_line([row]).startswith("0 rows ran, 1 refused")
    assert ns.strict_failures([row]) == []


def test_todays_wrap_reports_the_scan_and_one_candidate():
    row = ns.measure_row(TINY, wrap=lambda model, x: model, threads=1, threads_label="1", **FAST)
    assert row.ran and not row.option and row.choice == "scan" and row.other is None
    assert row.rounds == 3 and row.threads == 1 and row.grad_rel_diff == 0.0
    assert row.predicted_chosen_s is None and row.other_s is None


class _Decided(nn.Module):
    """A wrapper with the decision API: ``chosen`` (name, predicted_s), ``candidates``, ``explain()``."""

    def __init__(self, model, chosen: str):
        super().__init__()
        self.model = model
        cands = [types.SimpleNamespace(name="scan", predicted_s=2e-3, detail="levels=0"),
                 types.SimpleNamespace(name="native", predicted_s=1e-3, detail="autograd")]
        self.decision = types.SimpleNamespace(chosen=next(c for c in cands if c.name == chosen), candidates=cands,
                                              explain=lambda: f"{chosen}: cheaper")

    def forward(self, x):
        return self.model(x)


def test_the_decision_api_is_read_and_the_other_candidate_timed():
    calls = []

    def wrap(model, x, *, backward="auto"):
        calls.append(backward)
        return _Decided(model, "native" if backward == "auto" else backward)

    row = ns.measure_row(TINY, wrap=wrap, **FAST)
    assert calls == ["auto", "scan"]
    assert row.option and row.choice == "native" and row.other == "scan"
    assert row.predicted_chosen_s == 1e-3 and row.predicted_other_s == 2e-3 and row.other_s is not None
    assert row.explain == "native: cheaper" and "native backward chosen" in row.notes
    text = ns.format_row(row)
    assert "| native |" in text and "scan: 2.00 / " in text


def test_a_compiled_peer_is_timed_as_one_more_side():
    """``compile_peer``: torch.compile's step (a stand-in here) timed in the same rounds on an identical copy,
    apart from the chosen and the other candidate; its own gradients do not make the row wrong, and a peer
    that fails to compile is noted while the row goes on. The table gets a column for it."""
    calls = []

    def wrap(model, x, *, backward="auto"):
        return _Decided(model, "native" if backward == "auto" else backward)

    def peer(module):
        calls.append(module)
        return module

    row = ns.measure_row(TINY, wrap=wrap, compile_peer=peer, **FAST)
    assert len(calls) == 1 and row.ran and row.other == "scan" and row.other_s is not None
    assert row.compiled_s is not None and row.ratio_vs_compiled > 0 and row.compiled_failed is None
    assert "vs torch.compile" in ns.format_table([row]) and f"{row.ratio_vs_compiled:.2f} (" in ns.format_row(row, True)

    def bad_peer(module):
        raise RuntimeError("no compiler here")

    row = ns.measure_row(TINY, wrap=wrap, compile_peer=bad_peer, **FAST)
    assert row.ran and row.compiled_s is None and "no compiler here" in row.compiled_failed
    assert "| failed |" in ns.format_table([row])

    def wrong_peer(module):  # a compiled step whose gradients differ: the row is still spscan's
        return lambda x: 2 * module(x)

    row = ns.measure_row(TINY, wrap=lambda model, x: model, compile_peer=wrong_peer, **FAST)
    assert row.ran and row.wrong is None and row.other_s is None and row.compiled_s is not None


def test_a_model_refusing_the_backward_option_is_wrapped_without_it():
    def wrap(model, x, *, backward=None):
        if backward is not None:
            raise TypeError("backward= does not apply to this model")
        return model

    row = ns.measure_row(TINY, wrap=wrap, **FAST)
    assert row.ran and not row.option and row.choice == "scan" and row.other is None
    # the row's other notes depend on its timing (two identical models: "below 0.97" is noise); not checked
    assert row.notes[0] == "backward='auto' refused: backward= does not apply to this model"


def test_a_lost_choice_is_flagged_beyond_three_percent():
    assert ns.choice_lost(1.04, 1.0) and not ns.choice_lost(1.02, 1.0)
    assert not ns.choice_lost(None, 1.0) and not ns.choice_lost(1.0, None)
    row = ns.Row("m", "cpu", 2, 8, choice="scan", option=True, ratio=0.9, ratio_q25=0.8, ratio_q75=1.0, rounds=5,
                 autograd_s=0.9e-3, chosen_s=1e-3, other="native", other_s=0.9e-3)
    assert ns.row_notes(row) == ["choice lost (native 0.90 ms)", "below 0.97"]
    assert "choice lost: m (cpu, 2 threads)" in ns.summary_line([row])


def test_a_graph_step_that_ran_eagerly_is_noted(monkeypatch):
    """A side whose whole-step CUDA graphs could not all be recorded ran (partly) eagerly: the row says so,
    with the recording's own reason, as its time is not the graph's."""
    import spscan
    from spscan.runtime.graphed import GraphedStep

    def failing_record(fn, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    w = spscan.wrap(nn.GRU(3, 4), torch.randn(5, 2, 3), backward="scan")
    assert ns.graph_failures(w) == []
    monkeypatch.setattr(w, "_choice", lambda key: "graph")
    w.plan.step_graphs = GraphedStep(w.plan, failing_record)
    for _ in range(3):
        w(torch.randn(5, 2, 3))[0].sum().backward()
    why = "forward: RuntimeError: operation not permitted when stream is capturing"
    (got,) = ns.graph_failures(w)
    assert got.startswith(why + " (at graphed.py:")
    assert ns.graph_failures(nn.Linear(2, 2)) == []  # no step graphs at all
    row = ns.Row("m", "cuda", 2, 8, choice="graph", option=True, ratio=1.2, rounds=5, autograd_s=1.2e-3,
                 chosen_s=1e-3, graph_failed=why)
    assert ns.row_notes(row) == [f"graph partly eager ({why})"]


def test_wrong_gradients_are_recorded_and_not_timed():
    class Doubled(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            return 2 * self.model(x)

    row = ns.measure_row(TINY, wrap=lambda model, x: Doubled(model), **FAST)
    assert not row.ran and row.rounds == 0 and row.chosen_s is None
    assert row.notes == [row.wrong] and row.wrong.startswith("gradients differ from autograd's by ")
    assert "wrong gradients: tiny" in ns.summary_line([row])


def test_gradient_error_ignores_rounding_noise_of_zero_gradients():
    def params(*grads):
        out = []
        for g in grads:
            p = nn.Parameter(torch.zeros(len(g)))
            p.grad = torch.tensor(g)
            out.append(p)
        return out

    # a bias before a train-mode BatchNorm: gradient zero, both sides' values rounding noise
    assert ns.grad_error(params([1.0, -2.0], [1e-9, 0.0]), params([1.0, -2.0], [-3e-9, 1e-10])) < 1e-5
    assert ns.grad_error(params([1.0, -2.0], [0.5, 0.1]), params([1.0, -2.0], [0.6, 0.1])) == pytest.approx(0.2)
    assert ns.grad_error(params([1.0]), [nn.Parameter(torch.zeros(1))]) == float("inf")


def test_table_and_summary(tmp_path):
    rows = [
        ns.Row("lenet5", "cpu", 2, 64, threads_label="2 (default)", ratio=1.21, ratio_q25=1.1, ratio_q75=1.3,
               rounds=9, autograd_s=0.02, chosen_s=0.0165, load_1min=1.5),
        ns.Row("lstm_T100_B1", "cpu", 1, 1, ratio=0.5, ratio_q25=0.4, ratio_q75=0.6, rounds=9, autograd_s=1.5e-3,
               chosen_s=3e-3, load_1min=2.5),
        ns.Row("vit_tiny", "cpu", 1, 16, refused="refused: TinyViT: transpose | unsupported"),
    ]
    for r in rows:
        r.notes = ns.row_notes(r)
    table = ns.format_table(rows).splitlines()
    assert len(table) == 5 and all(line.count("|") - line.count("\\|") == len(ns.COLUMNS) + 1 for line in table)
    assert "| lenet5 | cpu | 2 (default) | 64 | scan | 1.21 (1.10-1.30) | 20.00 | - | 16.50 | - |  |" == table[2]
    summary = ns.summary_line(rows)
    assert summary.startswith("2 rows ran, 1 refused; ratio >= 0.97 in 1 of 2")
    assert "below 0.97: lstm_T100_B1 (cpu, 1 thread) 0.50" in summary and "choice lost" not in summary
    assert [r.model for r in ns.strict_failures(rows)] == ["lstm_T100_B1"]
    out = tmp_path / "t" / "never-slower.md"
    ns.write_table(rows, out, ["# title", "header line"])
    text = out.read_text()
    assert text.startswith("# title\nheader line\n\n| model |") and "load average over 1 min" in text
    header, again = ns.rows_from_json(out.with_suffix(".json"))
    assert header == ["# title", "header line"] and [r.to_dict() for r in again] == [r.to_dict() for r in rows]
    assert ns.main(["--from-json", str(out.with_suffix(".json")), "--out", str(tmp_path / "again.md")]) == 0
    assert (tmp_path / "again.md").read_text() == text


def test_instruction_counts_harness(tmp_path):
    """``bench/instructions.py``: its rows name the timed rows, and the counts are read from callgrind's dumps
    by the trigger name (dumps of other triggers are ignored)."""
    ins = _import_bench("instructions")
    rec = _import_bench("test_recurrent_step")
    cnn = _import_bench("test_cnn_step")
    timed = {"-".join(map(str, r)) for r in rec.ROWS} | {f"{n}-{m}" for n in cnn.MODELS
                                                         for m in ("forward", "backward", "step")}
    assert set(ins.ROWS) <= timed and "gru-3000-step-last" in ins.ROWS and "alexnet_like-step" in ins.ROWS
    for n, (name, total) in enumerate([("gru-1000-step-last", 300), ("lenet5-step", 12), (None, 99)]):
        trigger = f"Client Request: {name}" if name else "Program termination"
        (tmp_path / f"after.123.{n + 1}").write_text(f"version: 1\ndesc: Trigger: {trigger}\nsummary: {total}\n")
    (tmp_path / "before.9.1").write_text("desc: Trigger: Client Request: lenet5-step\nsummary: 10\n")
    assert ins._counts(tmp_path, "after") == {"gru-1000-step-last": 300, "lenet5-step": 12}
    assert ins._counts(tmp_path, "before") == {"lenet5-step": 10}


def test_rounds_take_turns_going_first():
    """Each timed round starts at the next side, so no side always follows the same other one (a step
    inherits the state the step before it leaves: freed buffers, caches)."""
    calls = []

    class Logged(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, x):
            calls.append("wrapped")
            return self.model(x)

    class Plain(nn.Sequential):
        def forward(self, x):
            calls.append("layer")
            return super().forward(x)

    case = models.Case("tiny", "cnn", 4, lambda: Plain(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 5)), (3,), (5,),
                       loss="square")
    row = ns.measure_row(case, wrap=lambda model, x: Logged(model), **dict(FAST, min_rounds=4, max_rounds=4))
    assert row.rounds >= 4
    # a plain step logs "layer"; a wrapped one "wrapped", "layer": per round, which side went first
    steps, k = [], 0
    while k < len(calls):
        steps.append("wrapped" if calls[k] == "wrapped" else "plain")
        k += 2 if calls[k] == "wrapped" else 1
    rounds = [steps[i:i + 2] for i in range(0, len(steps), 2)][-row.rounds:]  # the timed rounds
    assert [r[0] for r in rounds] == ["plain", "wrapped"] * (row.rounds // 2) + ["plain"] * (row.rounds % 2)


def test_the_rows_copies_hold_their_recurrent_weights_in_one_block(monkeypatch):
    """Every copy a row times (autograd's side, the forced candidates) re-packs its recurrent layers' weights:
    a deep copy leaves each weight in its own memory, which cuDNN re-packs on every call of that copy alone."""
    import torch.nn as nn

    flattened = []
    real = nn.RNNBase.flatten_parameters

    def spy(self):
        flattened.append(self)
        return real(self)

    monkeypatch.setattr(nn.RNNBase, "flatten_parameters", spy)
    model = nn.Sequential(nn.Linear(3, 4))
    lstm = nn.LSTM(4, 5)
    wrapper = nn.ModuleDict({"head": model, "rnn": lstm})
    copy = ns.fresh_copy(wrapper)
    assert copy is not wrapper and copy["rnn"] is not lstm
    assert any(m is copy["rnn"] for m in flattened)
    assert ns.fresh_copy(None) is None
