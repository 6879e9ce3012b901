"""Never slower: one training step of every model through ``spscan.wrap`` against plain autograd.

Run: ``python -m pytest bench/test_never_slower.py`` (``-s`` shows nothing more: the summary line
comes at the end of the run), or ``python -m bench.never_slower --out FILE.md`` to write the table
as well (``NEVER_SLOWER_OUT=FILE.md`` does the same for a plain pytest run).

Rows (``bench/never_slower_models.py``): LeNet-5 (B = 64), the small VGG (B = 32), an AlexNet-like
CNN (3x127x127, overlapping 3/2 max-pools, dropout; B = 32), ResNet-20 (B = 16, as
``bench/test_resnet_step.py``), a MobileNet-like depthwise-separable stack (B = 32), an MLP with
LayerNorm (4 x 256, B = 64), a GroupNorm CNN and an EfficientNet-like block with squeeze-and-excitation
(B = 32), ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` (input 32, hidden 64, a linear
head on the last output) at T = 100 and 1000 and B = 1 and 16, ``nn.TransformerEncoderLayer``
(d_model 64, 4 heads), an MLP-Mixer block, a one-block ViT and a GPT-style block on token ids
(embeddings, causal attention; B = 16); all in train mode. Each at
the default torch thread count and at one thread, on the CPU and (skipped without one) on CUDA.

Each row (``never_slower.measure_row``) first takes one seeded step on every side and checks the
wrapped gradients against autograd's (``never_slower.grad_error`` below 1e-3; a row whose
gradients differ is recorded, not timed, and fails), then times
interleaved rounds (autograd, wrapped, and where ``spscan.wrap`` has ``backward=`` the candidate it
did not choose, forced; each round starts at the next side) after two warm-up rounds, as many as fit about 12 s (5 to 81; 1 s and 3 to 9
with ``SPSCAN_BENCH_QUICK=1``). The pytest-benchmark statistics are those of one round (all sides);
``extra_info`` carries the row: the ratio (median over rounds of autograd / wrapped, > 1: faster),
both medians, the choice and its predictions. A model the library refuses is recorded as
``refused: <first line>`` and fails. The bar (ratio >= 0.97) is reported, not asserted, unless
``NEVER_SLOWER_STRICT=1``. The whole suite takes about 4 minutes on a quiet 2-core CPU (10 under load).
"""

from __future__ import annotations

import os
import platform

import pytest
import torch

import never_slower as ns
from never_slower_models import CASES

QUICK = os.environ.get("SPSCAN_BENCH_QUICK") == "1"
STRICT = os.environ.get("NEVER_SLOWER_STRICT") == "1"
PEER_COMPILE = os.environ.get("NEVER_SLOWER_PEER_COMPILE") == "1"
TIMING = dict(budget_s=1.0, min_rounds=3, max_rounds=9) if QUICK else dict(budget_s=12.0, min_rounds=5, max_rounds=81)
DEFAULT_THREADS = torch.get_num_threads()  # as bench/conftest.py sets it

RECORDED: list[ns.Row] = []

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
PARAMS = [pytest.param(case, threads, device, id=f"{case.name}-{device}-{threads}-threads",
                       marks=[needs_cuda] if device == "cuda" else [])
          for device in ("cpu", "cuda") for threads in ("default", 1) for case in CASES]


def _machine() -> str:
    cpu = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    devices = {r.device for r in RECORDED}
    if "cuda" in devices:
        cpu += f"; GPU: {torch.cuda.get_device_name(0)}"
    return cpu


class _Summary:
    """Prints the summary line at the end of the terminal report."""

    def pytest_terminal_summary(self, terminalreporter):
        if RECORDED:
            terminalreporter.write_sep("-", "never slower")
            terminalreporter.write_line(ns.summary_line(RECORDED))


@pytest.fixture(scope="module", autouse=True)
def _table(request):
    """Prints the summary line at the end; writes the table (``NEVER_SLOWER_OUT``) once more."""
    plugin = _Summary()
    request.config.pluginmanager.register(plugin, "never-slower-summary")
    yield
    _write()


def _write() -> None:
    """The table of the rows so far (``NEVER_SLOWER_OUT``): written after every row, so a run stopped
    at a time limit keeps what it measured."""
    out = os.environ.get("NEVER_SLOWER_OUT")
    if out and RECORDED:
        header = ns.default_header(_machine(), os.environ.get("NEVER_SLOWER_DATE"))
        note = os.environ.get("NEVER_SLOWER_NOTE")
        ns.write_table(RECORDED, out, header + ([""] + note.splitlines() if note else []))


@pytest.mark.parametrize("case,threads,device", PARAMS)
def test_never_slower(benchmark, case, threads, device):
    benchmark.group = f"never-slower-{case.name}-{device}"
    n = None if threads == "default" else threads
    label = f"{DEFAULT_THREADS} (default)" if n is None else str(n)

    def run_rounds(one_round, rounds):
        benchmark.pedantic(one_round, rounds=rounds, iterations=1)

    row = ns.measure_row(case, device, threads=n, threads_label=label, run_rounds=run_rounds,
                         compile_peer=ns.compile_reduce_overhead if PEER_COMPILE else None, **TIMING)
    RECORDED.append(row)
    _write()
    # spscan.wrap with backward="auto" refuses no model (what the scan cannot plan runs autograd's backward): a
    # refusal is recorded in the table and fails the row
    assert not row.refused, f"{row.label()}: {row.refused}"
    assert row.wrong is None, f"{row.label()}: {row.wrong}"
    benchmark.extra_info.update(row.to_dict(), median_ratio_of_pairs=row.ratio, clock="wall")
    assert row.rounds > 0 and row.chosen_s > 0 and row.autograd_s > 0
    if STRICT:
        assert row.ratio >= ns.BAR, f"{row.label()}: autograd / wrapped = {row.ratio:.3f} < {ns.BAR:g}"
