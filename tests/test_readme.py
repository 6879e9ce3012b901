"""Every ``python`` code block of the README and of the pages in ``docs/`` runs as written (each on its own,
in a fresh namespace and a temporary working directory, as a reader would paste it; a block that is a
program, with an ``if __name__ == "__main__":`` entry point such as the two-process model-parallel example,
runs as a script in its own interpreter). The ``bash`` blocks are set-up commands (virtual environment,
pip, torchrun) and are not run here; what is checked of them is that the README has exactly the two
set-up-and-run commands of a fresh machine. Every relative link of these pages names a committed file."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(page: Path, lang: str = "python") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", page.read_text(), flags=re.S | re.M)


BLOCKS = [(page, i, code) for page in PAGES for i, code in enumerate(_blocks(page))]
README_BLOCKS = _blocks(README)
TEST_COMMAND = ('python3 -m venv .venv-test && . .venv-test/bin/activate && pip install torch==2.13.0 && '
                'pip install -e ".[test]" && python -m pytest -q')


def _core_api_block() -> str:
    """The README's example of the core contract: patterns planned once, values per step."""
    (block,) = [b for b in README_BLOCKS if "spscan.backward(plan, values, grad)" in b]
    return block


def test_readme_has_python_blocks():
    assert len(README_BLOCKS) >= 2


@pytest.mark.parametrize("page,index,code", BLOCKS,
                         ids=[f"{p.relative_to(ROOT)}-block{i}" for p, i, _ in BLOCKS])
def test_block_runs(page, index, code, tmp_path, monkeypatch):
    name = f"{page.relative_to(ROOT)} python block {index}"
    monkeypatch.chdir(tmp_path)
    if 'if __name__ == "__main__":' in code:
        (tmp_path / "block.py").write_text(code)
        run = subprocess.run([sys.executable, "block.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"{name} exited {run.returncode}:\n{run.stderr[-3000:]}"
        assert "rank 0: dl/dx_0" in run.stdout, run.stdout
        return
    exec(compile(code, name, "exec"), {"__name__": "__readme__"})


def test_readme_first_example_is_the_model_wrapper():
    """The README shows ``spscan.wrap`` on a model before the core API."""
    assert "spscan.wrap(" in README_BLOCKS[0] and "loss.backward()" in README_BLOCKS[0]
    assert README_BLOCKS.index(_core_api_block()) > 0


def test_readme_core_api_example_shows_a_real_scan_in_a_compact_summary(tmp_path, monkeypatch, capsys):
    """The core-API example forces a depth >= 1 (saying why "auto" picks the linear scan on a CPU), and
    its summary is a few lines per level that name the batch planned for."""
    monkeypatch.chdir(tmp_path)
    block = _core_api_block()
    ns = {"__name__": "__readme__"}
    exec(compile(block, "README.md core API block", "exec"), ns)
    assert ns["plan"].levels >= 1
    summary = ns["plan"].summary()
    assert len(summary.splitlines()) <= 15 and "planned for batch 8" in summary
    assert "on a CPU" in block


def test_readme_is_short_and_has_exactly_two_setup_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    commands = [b.strip() for b in _blocks(README, "bash")]
    assert len(commands) == 2, commands
    demo, tests = commands
    assert demo.startswith("python3 -m venv ") and demo.endswith("python -m spscan demo")
    assert tests == TEST_COMMAND
    assert "python -m spscan demo --quick" in text


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_name_committed_files(page):
    """A link to a results file, a page or an example resolves (anchors are not checked)."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"
