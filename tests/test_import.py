"""Importing spscan has no side effects: no environment variable, no Triton or torch setting changes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

_USER_KERNEL = """
import triton, triton.language as tl

@triton.jit
def user_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)
"""

_CHECKS = """
import os, torch, scipy.sparse as sp, triton
assert "TRITON_INTERPRET" not in os.environ, os.environ.get("TRITON_INTERPRET")
assert isinstance(user_kernel, triton.runtime.JITFunction), type(user_kernel)  # not turned into an interpreted one
assert torch.get_num_threads() == THREADS and torch.get_default_dtype() == torch.float32
eye = sp.csr_array(sp.eye(3))
g = spscan.backward(spscan.plan([eye, eye]), [torch.ones(3), 2 * torch.ones(3)], torch.ones(1, 3))
assert g[0].tolist() == [[2.0, 2.0, 2.0]]
try:
    spscan.plan([eye, eye], backend="triton")
except ValueError as e:
    assert "CUDA" in str(e) and "TRITON_INTERPRET" in str(e), e
else:
    raise AssertionError("compiled Triton kernels on the CPU were accepted")
print("ok")
"""


def _run(code: str, tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    script = tmp_path / "user_script.py"  # @triton.jit needs its source in a file
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.parametrize("order", ["triton first", "spscan first"])
def test_import_changes_nothing(order, tmp_path):
    threads = "import torch; THREADS = torch.get_num_threads()\n"
    if order == "triton first":
        code = threads + _USER_KERNEL + "import spscan\n" + _CHECKS
    else:
        code = threads + "import spscan\n" + _USER_KERNEL + _CHECKS
    res = _run(textwrap.dedent(code), tmp_path)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_every_package_folder_is_installed():
    """pyproject's package list names every folder of the library (a wheel would leave out one it misses)."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, folder in config["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder).parts
            found.add(".".join((name, *rel)) if rel else name)
    assert found <= listed, f"not installed: {sorted(found - listed)}"
