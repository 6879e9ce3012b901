"""pytest plugin: append each benchmark row to a JSON-lines file as soon as its test has run.

pytest-benchmark writes ``--benchmark-json`` only when the session ends, so a suite stopped at
its time limit loses every row it had measured. With ``-p rowlog`` (this folder on
``PYTHONPATH``) and ``SPSCAN_BENCH_ROWS=/path/rows.jsonl`` set, every row is also appended to
that file, in the JSON form of ``--benchmark-json``'s ``benchmarks`` entries (without the raw
timings), right after its test's call phase; ``bench/gpu/driver.py`` reads it back for a suite
whose JSON was never written. Without the variable the plugin does nothing.
"""

from __future__ import annotations

import json
import os

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield  # makereport is a first-result hook: wrap it to see every call phase
    path = os.environ.get("SPSCAN_BENCH_ROWS")
    if not path or call.when != "call":
        return report
    fixture = getattr(item, "funcargs", {}).get("benchmark")
    stats = getattr(fixture, "stats", None)
    if stats is None or getattr(fixture, "has_error", False):
        return report
    row = stats.as_dict(include_data=False)
    row["outcome"] = report.outcome
    with open(path, "a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")
    return report
