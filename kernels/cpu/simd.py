"""Fixed-width SIMD vectors for the compiled CPU kernels: ``LANES`` samples of a batch in one register value.

Why this exists: the compiled loops (:mod:`.chain`, :mod:`.recurrence`) work on a
tile of ``LANES`` samples at a time, and numba leaves such short loops scalar: it turns off LLVM's
SLP vectorizer by default (a loop of constant count 16 is unrolled into scalar code), and a loop
of 16 iterations with a run-time count ran at scalar speed too (the vectorized body covers more
iterations than that; the remainder is scalar). Measured on one core (AMD EPYC, AVX-512): a
20x80 matrix times 16 columns took 4.1 us as a numba loop over the 16 samples, 0.95 us through
``np.dot`` (OpenBLAS), and 0.30 us with the accumulators below (float64: 0.41 us).

A :class:`VecType` value is an LLVM ``<LANES x float|double>``: LLVM maps it to the widest vector
registers the CPU has (one AVX-512 register of float32, two of float64, twice as many with AVX2)
and keeps it in registers across a loop, so a row of a matrix-vector product over a tile is one
accumulator that lives in a register for the whole row. The operations are plain IEEE ``fmul`` and
``fadd`` in the order written (no contraction into FMA, no reassociation), so a kernel written with
them computes, lane by lane, exactly the scalar sums in the same order: results equal the scalar
loop's bit for bit and are reproducible run to run.

Every operation is an ``@intrinsic`` (inlined LLVM IR); ``vload``/``vstore`` address
``LANES`` consecutive elements of a 1-D C-contiguous array from an element index, unchecked (the
callers' tiles are sized by construction). Kernels using them compile with ``cache=True`` like any
other numba function; numba keys that on-disk cache by each kernel's own source file, so after a
change here clear the caches (``__pycache__/*.nbi``, ``*.nbc``) or the kernels keep the old code
(an installed release replaces every file, which invalidates them).
"""

from __future__ import annotations

import functools
import glob
from typing import Any, Sequence

__all__ = ["LANES", "bind", "intrinsics", "last_level_cache_bytes"]

LANES = 16  # samples per tile: one AVX-512 register of float32

_ops: dict[str, Any] = {}

_CACHE_FALLBACK = 8 << 20  # bytes, where the OS does not say


@functools.lru_cache(maxsize=None)
def last_level_cache_bytes() -> int:
    """The size of the CPU's largest data cache in bytes (Linux ``sysfs``; 8 MiB where it is not readable).

    The compiled forwards decide from it whether the chain values they write will still be in the
    cache when the backward reads them (plain stores) or not (non-temporal stores, which leave the
    cache to the data that stays; :func:`intrinsics`' ``vstream``).
    """
    best = 0
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(d + "/type") as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(d + "/size") as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale > 1 else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or _CACHE_FALLBACK


def bind(namespace: dict, names: Sequence[str]) -> None:
    """Bind the vector operations ``names`` (of :func:`intrinsics`) into a kernel module's ``namespace``
    (its ``globals()``): the names its kernels call, set before the first of them compiles."""
    ops = intrinsics()
    namespace.update({name: ops[name] for name in names})


def intrinsics() -> dict[str, Any]:
    """The vector operations as numba intrinsics (built on first use: importing numba is slow).

    ``get(a, i)``: ``a[i]`` of any 1-D C-contiguous array, unchecked and without numba's wraparound of
    negative indices (which costs four integer instructions per load where the compiler cannot prove
    ``i >= 0``: an index read from a table, as a CSR row's entries); ``vload(a, i)``:
    ``a[i : i + LANES]``; ``vstore(a, i, v)``; ``vstream(a, i, v)``: ``vstore`` with a
    non-temporal hint where the address is aligned (data written once and read much later, which
    need not be read into the cache first); ``vzero(a)``: zeros of ``a``'s dtype;
    ``vscale(w, x)``: ``w * x`` for a scalar ``w``; ``vmul(a, x)``: ``a * x``; ``vadd(a, x)``; ``vabs(x)``: ``|x|``;
    ``vmuladd(acc, w, x)``: ``acc + w * x`` for a scalar ``w``; ``vmuladdv(acc, a, x)``: ``acc + a * x``;
    ``vtranspose(src, sb, ss, dst, db, ds)``: the ``LANES x LANES`` block whose row ``r`` is
    ``src[sb + r * ss :][:LANES]`` is written transposed, column ``c`` to ``dst[db + c * ds :][:LANES]``
    (``log2(LANES)`` rounds of perfect shuffles in registers, instead of ``LANES^2`` scalar moves);
    ``vtranspose_add`` adds it there instead; ``prefetch(a, i)`` / ``prefetch_read(a, i)``: a hint
    that ``a[i]`` will be written / read soon.
    """
    if not _ops:
        _ops.update(_build())
    return _ops


def _build() -> dict[str, Any]:
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic, models, register_model

    class VecType(types.Type):
        """``LANES`` elements of ``dtype`` in one LLVM vector value."""

        def __init__(self, dtype):
            self.dtype = dtype
            super().__init__(name=f"spscan.Vec{LANES}({dtype})")

    @register_model(VecType)
    class _VecModel(models.PrimitiveModel):
        def __init__(self, dmm, fe_type):
            super().__init__(dmm, fe_type, ir.VectorType(dmm.lookup(fe_type.dtype).get_value_type(), LANES))

    def _pointer(context, builder, aryty, ary, idx, vty):
        data = context.make_array(aryty)(context, builder, ary).data
        return builder.bitcast(builder.gep(data, [idx]), vty.as_pointer())

    def _splat(builder, vty, x):
        one = builder.insert_element(ir.Constant(vty, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                                      ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))

    def _check_array(arr):
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C"
                and arr.dtype in (types.float32, types.float64)):
            raise TypeError(f"expected a 1-D C-contiguous float32/float64 array, got {arr}")

    @intrinsic
    def vload(typingctx, arr, idx):
        _check_array(arr)

        def codegen(context, builder, sig, args):
            vty = context.get_value_type(sig.return_type)
            return builder.load(_pointer(context, builder, sig.args[0], args[0], args[1], vty), align=1)

        return VecType(arr.dtype)(arr, idx), codegen

    def _check_store(name, arr, v):
        _check_array(arr)
        if not isinstance(v, VecType) or v.dtype != arr.dtype:
            raise TypeError(f"{name}: expected a vector of {arr.dtype}, got {v}")

    @intrinsic
    def vstore(typingctx, arr, idx, v):
        _check_store("vstore", arr, v)

        def codegen(context, builder, sig, args):
            builder.store(args[2], _pointer(context, builder, sig.args[0], args[0], args[1], args[2].type), align=1)
            return context.get_dummy_value()

        return types.void(arr, idx, v), codegen

    @intrinsic
    def vstream(typingctx, arr, idx, v):
        """``vstore`` with a non-temporal hint where the address is aligned to the vector's size."""
        _check_store("vstream", arr, v)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], args[1], args[2].type)
            size = context.get_abi_sizeof(args[2].type)
            i64 = ir.IntType(64)
            aligned = builder.icmp_unsigned("==", builder.and_(builder.ptrtoint(ptr, i64), ir.Constant(i64, size - 1)),
                                            ir.Constant(i64, 0))
            with builder.if_else(aligned) as (then, otherwise):
                with then:
                    st = builder.store(args[2], ptr, align=size)
                    st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
                with otherwise:
                    builder.store(args[2], ptr, align=1)
            return context.get_dummy_value()

        return types.void(arr, idx, v), codegen

    @intrinsic
    def get(typingctx, arr, idx):
        if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == "C"):
            raise TypeError(f"get: expected a 1-D C-contiguous array, got {arr}")
        if not isinstance(idx, types.Integer):
            raise TypeError(f"get: expected an integer index, got {idx}")

        def codegen(context, builder, sig, args):
            data = context.make_array(sig.args[0])(context, builder, args[0]).data
            return builder.load(builder.gep(data, [context.cast(builder, args[1], sig.args[1], types.int64)]))

        return arr.dtype(arr, idx), codegen

    @intrinsic
    def vzero(typingctx, arr):
        _check_array(arr)

        def codegen(context, builder, sig, args):
            return ir.Constant(context.get_value_type(sig.return_type), None)

        return VecType(arr.dtype)(arr), codegen

    @intrinsic
    def vabs(typingctx, x):
        if not isinstance(x, VecType):
            raise TypeError(f"vabs: expected a vector, got {x}")

        def codegen(context, builder, sig, args):
            vty = args[0].type
            name = f"llvm.fabs.v{LANES}{'f32' if x.dtype == types.float32 else 'f64'}"
            fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(vty, [vty]), name)
            return builder.call(fn, [args[0]])

        return x(x), codegen

    def _binary(name, op, scalar_first: bool):
        def typer(typingctx, a, x):
            if not isinstance(x, VecType) or (not scalar_first and a != x):
                raise TypeError(f"{name}: bad operands {a}, {x}")

            def codegen(context, builder, sig, args):
                a_v, x_v = args
                if scalar_first:
                    a_v = _splat(builder, x_v.type, context.cast(builder, a_v, sig.args[0], x.dtype))
                return getattr(builder, op)(a_v, x_v)

            return x(a, x), codegen

        typer.__name__ = name
        return intrinsic(typer)

    def _muladd(name, scalar_w: bool):
        def typer(typingctx, acc, w, x):
            if not isinstance(acc, VecType) or acc != x or (not scalar_w and w != x):
                raise TypeError(f"{name}: bad operands {acc}, {w}, {x}")

            def codegen(context, builder, sig, args):
                acc_v, w_v, x_v = args
                if scalar_w:
                    w_v = _splat(builder, x_v.type, context.cast(builder, w_v, sig.args[1], x.dtype))
                return builder.fadd(acc_v, builder.fmul(w_v, x_v))

            return acc(acc, w, x), codegen

        typer.__name__ = name
        return intrinsic(typer)

    def _transpose(name, accumulate: bool):
        def typer(typingctx, src, sbase, sstride, dst, dbase, dstride):
            _check_array(src)
            _check_array(dst)
            if src.dtype != dst.dtype:
                raise TypeError(f"{name}: src {src.dtype} and dst {dst.dtype} differ")
            for t in (sbase, sstride, dbase, dstride):
                if not isinstance(t, types.Integer):
                    raise TypeError(f"{name}: expected integer offsets, got {t}")

            def codegen(context, builder, sig, args):
                i64 = ir.IntType(64)
                # the offsets and strides only: a cast of the array arguments to int64 lowers to a call
                # (numba's array-to-integer conversion runs np.take on it) twice per transpose, ~70 ns
                idx = {k: context.cast(builder, args[k], sig.args[k], types.int64) for k in (1, 2, 4, 5)}
                s_data = context.make_array(sig.args[0])(context, builder, args[0]).data
                d_data = context.make_array(sig.args[3])(context, builder, args[3]).data
                vty = ir.VectorType(s_data.type.pointee, LANES)

                def at(data, base, stride, r):
                    off = builder.add(base, builder.mul(stride, ir.Constant(i64, r)))
                    return builder.bitcast(builder.gep(data, [off]), vty.as_pointer())

                rows = [builder.load(at(s_data, idx[1], idx[2], r), align=1) for r in range(LANES)]
                lo = ir.Constant(ir.VectorType(ir.IntType(32), LANES), [v for q in range(LANES // 2) for v in (q, q + LANES)])
                hi = ir.Constant(ir.VectorType(ir.IntType(32), LANES),
                                 [v for q in range(LANES // 2, LANES) for v in (q, q + LANES)])
                half = LANES // 2
                for _ in range(LANES.bit_length() - 1):  # log2(LANES) perfect shuffles transpose the tile
                    new = []
                    for q in range(half):
                        new.append(builder.shuffle_vector(rows[q], rows[q + half], lo))
                        new.append(builder.shuffle_vector(rows[q], rows[q + half], hi))
                    rows = new
                for c in range(LANES):
                    ptr = at(d_data, idx[4], idx[5], c)
                    val = builder.fadd(builder.load(ptr, align=1), rows[c]) if accumulate else rows[c]
                    builder.store(val, ptr, align=1)
                return context.get_dummy_value()

            return types.void(src, sbase, sstride, dst, dbase, dstride), codegen

        typer.__name__ = name
        return intrinsic(typer)

    def _prefetch(name: str, write: int):
        def typer(typingctx, arr, idx):
            _check_array(arr)

            def codegen(context, builder, sig, args):
                data = context.make_array(sig.args[0])(context, builder, args[0]).data
                ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(8).as_pointer())
                i32 = ir.IntType(32)
                # named by llvmlite from the pointer type (".p0i8"; LLVM with opaque pointers reads it as ".p0")
                fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
                fn = builder.module.declare_intrinsic("llvm.prefetch", [ptr.type], fnty)
                builder.call(fn, [ptr, ir.Constant(i32, write), ir.Constant(i32, 3), ir.Constant(i32, 1)])
                return context.get_dummy_value()

            return types.void(arr, idx), codegen

        typer.__name__ = name
        return intrinsic(typer)

    return {
        "VecType": VecType,
        "prefetch": _prefetch("prefetch", 1),
        "prefetch_read": _prefetch("prefetch_read", 0),
        "vtranspose": _transpose("vtranspose", False),
        "vtranspose_add": _transpose("vtranspose_add", True),
        "get": get,
        "vload": vload,
        "vstore": vstore,
        "vstream": vstream,
        "vzero": vzero,
        "vabs": vabs,
        "vscale": _binary("vscale", "fmul", True),
        "vmul": _binary("vmul", "fmul", False),
        "vadd": _binary("vadd", "fadd", False),
        "vmuladd": _muladd("vmuladd", True),
        "vmuladdv": _muladd("vmuladdv", False),
    }
