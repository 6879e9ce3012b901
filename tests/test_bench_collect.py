"""Every benchmark module imports and its tests collect, in quick and full mode.

The benchmark suites are not run by the test suite (they time things), so a broken import in one
of them would only show on the machine that runs it (a GPU run, a report regeneration).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("quick", ["1", "0"])
def test_every_bench_module_collects(quick):
    env = dict(os.environ, SPSCAN_BENCH_QUICK=quick)
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "bench"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "error" not in out.lower().splitlines()[-1], out[-3000:]
    assert " tests collected" in out or " test collected" in out, out[-1000:]
