"""Subnormal numbers flushed to zero while a compiled CPU loop runs (:func:`flushing_subnormals`).

A gradient carried back through many steps of a contracting recurrence (an LSTM with a loss on its
last output, over a thousand steps) decays geometrically. Long before it reaches zero it passes
through the subnormal range (below ``1.2e-38`` in float32, ``2.2e-308`` in float64), where every
multiply and add that reads or makes one takes a microcode assist on x86: about a hundred times a
normal one. Measured on a T = 1000 LSTM scan (forced, B = 1, two threads): 89 ms with gradual
underflow, 22 ms with these loops flushed.

So the compiled loops of :mod:`.chain` and :mod:`.nt` run with the x86 ``MXCSR`` flags
flush-to-zero (FTZ: a subnormal result is 0) and denormals-are-zero (DAZ: a subnormal operand reads
as 0) set, as GPUs run float32 arithmetic, and put the caller's flags back when they return. What
changes: a value whose magnitude is below the smallest normal number is 0 instead of a subnormal,
an absolute change of at most ``1.2e-38`` (float32) or ``2.2e-308`` (float64) per element. The
loops are single-threaded and the flags are per thread, so the result does not depend on the thread
count, and no other code in the process sees the flags (torch's worker threads keep theirs).

The flags are read and written by two tiny compiled functions (LLVM's ``stmxcsr``/``ldmxcsr``
intrinsics). On other architectures, or where numba is not installed, :func:`flushing_subnormals`
changes nothing.
"""

from __future__ import annotations

import contextlib
import platform
from typing import Any, Iterator, Optional

import numpy as np

from spscan.kernels.cpu.jit import available, numba_module

__all__ = ["FLUSH_BITS", "flushing_subnormals", "supported"]

FLUSH_BITS = 0x8040  # MXCSR: FTZ (bit 15) | DAZ (bit 6)

_fns: Optional[tuple[Any, Any]] = None  # (enter, leave), compiled on first use


def supported() -> bool:
    """Whether this process can set the flags (x86-64 with numba)."""
    return platform.machine().lower() in ("x86_64", "amd64") and available()


def _build() -> tuple[Any, Any]:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    numba = numba_module()
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)

    def _mxcsr(builder, name, slot):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p]), name)
        builder.call(fn, [builder.bitcast(slot, i8p)])

    @intrinsic
    def _read(typingctx):
        def codegen(context, builder, sig, args):
            slot = cgutils.alloca_once(builder, i32)
            _mxcsr(builder, "llvm.x86.sse.stmxcsr", slot)
            return builder.load(slot)

        return types.uint32(), codegen

    @intrinsic
    def _write(typingctx, value):
        def codegen(context, builder, sig, args):
            slot = cgutils.alloca_once(builder, i32)
            builder.store(args[0], slot)
            _mxcsr(builder, "llvm.x86.sse.ldmxcsr", slot)
            return context.get_dummy_value()

        return types.void(types.uint32), codegen

    # not cached on disk: two instructions each, compiled in milliseconds
    bits = np.uint32(FLUSH_BITS)

    @numba.njit(nogil=True)
    def enter():
        old = _read()
        _write(old | bits)
        return old

    @numba.njit(nogil=True)
    def leave(old):
        _write(old)

    return enter, leave


@contextlib.contextmanager
def flushing_subnormals() -> Iterator[None]:
    """Run the body with this thread's FTZ and DAZ flags set (see the module docstring), then restore the
    flags as they were. Nothing changes where :func:`supported` is false."""
    global _fns
    if _fns is None:
        _fns = _build() if supported() else (None, None)
    enter, leave = _fns
    if enter is None:
        yield
        return
    old = enter()
    try:
        yield
    finally:
        leave(old)
