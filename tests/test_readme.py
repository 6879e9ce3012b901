"""Every ``python`` code block of the README runs as written (each on its own, in a fresh namespace
and a temporary working directory, as a reader would paste it; a block that is a program, with an
``if __name__ == "__main__":`` entry point such as the two-process model-parallel example, runs as
a script in its own interpreter). The ``bash`` blocks are set-up commands (virtual environment,
pip, torchrun) and are not run here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(index, tmp_path, monkeypatch):
    code = BLOCKS[index]
    monkeypatch.chdir(tmp_path)
    if 'if __name__ == "__main__":' in code:
        (tmp_path / "block.py").write_text(code)
        run = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"README.md python block {index} exited {run.returncode}:\n{run.stderr[-3000:]}"
        assert "rank 0: dl/dx_0" in run.stdout, run.stdout
        return
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})


def test_readme_first_example_shows_a_real_scan_in_a_compact_summary(tmp_path, monkeypatch, capsys):
    """The first example forces a depth >= 1 (saying why "auto" picks the linear scan on a CPU), and
    its summary is a few lines per level that name the batch planned for."""
    monkeypatch.chdir(tmp_path)
    ns = {"__name__": "__readme__"}
    exec(compile(BLOCKS[0], "README.md python block 0", "exec"), ns)
    assert ns["plan"].levels >= 1
    summary = ns["plan"].summary()
    assert len(summary.splitlines()) <= 15 and "planned for batch 8" in summary
    assert "on a CPU" in BLOCKS[0]
