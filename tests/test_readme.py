"""Every ``python`` code block of the README runs as written (each on its own, in a fresh namespace
and a temporary working directory, as a reader would paste it). The ``bash`` blocks are set-up
commands (virtual environment, pip, torchrun) and are not run here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)

#: blocks that cannot run in CI, keyed by a line they contain, with the reason
SKIP = {
    "spscan.distributed.backward(": "a per-rank fragment: it needs one process per rank under torch.distributed "
                                    "(torchrun); examples/distributed_chain.py is the runnable program",
}


def _skip_reason(code: str):
    hits = [why for key, why in SKIP.items() if key in code]
    return hits[0] if hits else None


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 3
    assert all(any(key in b for b in BLOCKS) for key in SKIP), "a skip rule matches no README block: remove it"


@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_block_runs(index, tmp_path, monkeypatch):
    code = BLOCKS[index]
    reason = _skip_reason(code)
    if reason:
        pytest.skip(reason)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
