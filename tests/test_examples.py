"""The training examples run: each ``examples/*.py`` script with ``--quick --steps 3 --device cpu`` exits 0, prints the losses of
both sides, equal at the first step (the same initial weights and batch), and prints its speed ratio
against autograd. Nothing here reads the ratio's value (tests never time); each script runs in its own
interpreter on one thread, so that the three stay within a minute on a busy 2-core machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SCRIPTS = ["pixel_gru.py", "char_lm.py", "cifar_resnet.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs_quick_and_prints_a_ratio(script, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(EXAMPLES / script), "--quick", "--steps", "3", "--device", "cpu"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, f"{script} exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    out = run.stdout
    assert re.search(r"^speed: \d+\.\d+x autograd$", out, flags=re.M), out
    first = re.search(r"^step +1  loss  autograd (\S+)  spscan (\S+)$", out, flags=re.M)
    assert first is not None, out
    assert abs(float(first.group(1)) - float(first.group(2))) <= 1e-3 * abs(float(first.group(1))), first.group(0)

