"""Ahead-of-time compilation of recorded launches for CUDA targets, with no GPU present.

``python -m spscan.kernels.triton.aot specs.json 80 90`` compiles every :class:`~spscan.kernels.triton.launch.LaunchSpec`
in ``specs.json`` for each compute capability and prints one line per kernel: ``ok`` with what it uses
(registers, spills and stack per thread, shared memory, matrix instructions: :func:`resources`) or
``FAIL`` with the reason (exit status 1 if any). It must run with ``TRITON_INTERPRET=0``: under the interpreter ``@triton.jit`` returns
an interpreted function that ``triton.compile`` cannot lower.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any, Sequence

__all__ = ["ast_source", "specialized", "compile_spec", "resources", "specs_to_json", "main"]


def ast_source(fn, signature: dict[str, str], constexprs: dict[str, Any]):
    """A ``triton.compiler.ASTSource`` for ``fn`` on triton 3.3 through 3.7.

    Since 3.3 the signature lists every argument (constexprs typed ``"constexpr"``) and
    ``constexprs`` is keyed by name; older releases took ``constants=`` and a signature
    without them.
    """
    from triton.compiler import ASTSource

    names = list(fn.arg_names)
    missing = [n for n in names if n not in signature and n not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or value for arguments {missing}")
    full = {n: ("constexpr" if n in constexprs else signature[n]) for n in names}
    try:
        return ASTSource(fn=fn, signature=full, constexprs=dict(constexprs))
    except TypeError:  # triton < 3.3
        runtime = {n: t for n, t in full.items() if t != "constexpr"}
        return ASTSource(fn=fn, signature=runtime, constants=dict(constexprs))


def specialized(fn, signature: dict[str, str], constexprs: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """The signature the JIT would compile: an int argument recorded as ``"i32:1"`` (its value was 1)
    becomes the constant 1, as Triton specializes it at run time, unless the kernel lists it in
    ``do_not_specialize``."""
    keep = {p.name for p in fn.params if getattr(p, "do_not_specialize", False)}
    sig, const = {}, dict(constexprs)
    for name, t in signature.items():
        if t == "i32:1":
            if name in keep:
                sig[name] = "i32"
            else:
                const[name] = 1
        else:
            sig[name] = t
    return sig, const


def compile_spec(spec: dict, capability: int):
    """Compile one recorded launch (``dict`` form of a ``LaunchSpec``) for ``sm_<capability>``."""
    import triton
    from triton.backends.compiler import GPUTarget

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_spec: TRITON_INTERPRET is set; kernels are interpreted functions")
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    # tuple constexprs (the recurrence kernels' block grids) come back from JSON as lists; names starting
    # with "_" are annotations of the spec (carried to the report), not kernel arguments
    consts = {k: tuple(v) if isinstance(v, list) else v for k, v in dict(spec["constexprs"]).items()
              if not k.startswith("_")}
    signature, constexprs = specialized(fn, dict(spec["signature"]), consts)
    src = ast_source(fn, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": spec["num_warps"]})


def resources(ck, capability: int) -> dict:
    """What the compiled kernel ``ck`` uses, read off its PTX by Triton's own ``ptxas -v`` (no GPU needed):
    registers, spill stores and loads and stack frame (bytes) per thread, shared memory (bytes), and
    the matrix instructions in it (``"wgmma"``, ``"mma"`` or ``"none"``)."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptx = ck.asm["ptx"]
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
    arch = target.group(1) if target else f"sm_{capability}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run([get_ptxas(capability).path, "-v", f"--gpu-name={arch}", f.name, "-o", os.devnull],
                             capture_output=True, text=True, timeout=600).stderr
    finally:
        os.unlink(f.name)

    def num(pattern: str) -> int:
        hit = re.search(pattern, out)
        return int(hit.group(1)) if hit else -1

    tc = "wgmma" if "wgmma.mma_async" in ptx else ("mma" if re.search(r"\bmma\.sync", ptx) else "none")
    return {"regs": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads"), "stack": num(r"(\d+) bytes stack frame"),
            "shared": int(ck.metadata.shared), "tc": tc}


def specs_to_json(specs: Sequence) -> str:
    """Distinct launch specs as JSON (input of :func:`main`)."""
    seen, out = set(), []
    for s in specs:
        key = (s.module, s.kernel, s.signature, s.constexprs, s.num_warps)
        if key not in seen:
            seen.add(key)
            out.append({"module": s.module, "kernel": s.kernel, "signature": list(map(list, s.signature)),
                        "constexprs": list(map(list, s.constexprs)), "num_warps": s.num_warps})
    return json.dumps(out)


def main(argv: Sequence[str]) -> int:
    if len(argv) < 2:
        print("usage: python -m spscan.kernels.triton.aot SPECS.json CAPABILITY [CAPABILITY ...]", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        specs = json.load(f)
    failures = 0
    for cap in map(int, argv[1:]):
        for spec in specs:
            try:
                ck = compile_spec(spec, cap)
                res = resources(ck, cap)
                print(f"ok sm_{cap} {spec['kernel']} warps={spec['num_warps']} shared={res['shared']} "
                      f"regs={res['regs']} spill_stores={res['spill_stores']} spill_loads={res['spill_loads']} "
                      f"stack={res['stack']} tc={res['tc']} {json.dumps(dict(spec['constexprs']))}")
            except Exception as exc:  # report every failing kernel, not only the first
                failures += 1
                msg = " ".join(str(exc).split())[:400]
                print(f"FAIL sm_{cap} {spec['kernel']} {dict(spec['constexprs'])} "
                      f"{dict(spec['signature'])}: {type(exc).__name__}: {msg}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
