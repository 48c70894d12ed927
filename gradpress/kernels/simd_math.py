"""Lane-by-lane arithmetic of the 16-lane vectors (:mod:`gradpress.kernels.simd`): splats, IEEE float and
modulo-2^32 integer operations, comparisons and selects, conversions, and the reductions (a maximum, float32
and float64 sums in one fixed order).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from gradpress.kernels.simd_types import (
    LANES,
    _D,
    _F,
    _I,
    Vec,
    _as_i32,
    _i32,
    _i64,
    _intrinsic_function,
    _lane_mask,
    _llvm_vec,
    _splat,
    vf32,
    vf64,
    vi32,
)


# -- building vectors ------------------------------------------------------------------------------------
# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def fsplat(typingctx, value):  # pragma: no cover - compiled
    """Every lane ``value`` (a float32; a float64 is rounded to float32 first)."""
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, sig, args):
        v = args[0] if sig.args[0] == types.float32 else builder.fptrunc(args[0], ir.FloatType())
        return _splat(builder, v, _F)

    return vf32(value), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def isplat(typingctx, value):  # pragma: no cover - compiled
    """Every lane the low 32 bits of the integer ``value``."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, _as_i32(builder, args[0]), _I)

    return vi32(value), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def iota(typingctx, start):  # pragma: no cover - compiled
    """Lanes ``start + l`` for l = 0..15, modulo 2^32."""
    if not isinstance(start, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(_splat(builder, _as_i32(builder, args[0]), _I), ir.Constant(_I, list(range(LANES))))

    return vi32(start), codegen


# -- arithmetic (IEEE, lane by lane) ------------------------------------------------------------------------
# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
def _binary(name: str, float_op: str | None, int_op: str | None):  # noqa: ANN202
    @intrinsic
    def op(typingctx, a, b):  # pragma: no cover - compiled
        if not (isinstance(a, Vec) and a == b) or (float_op if a.kind == "f32" else int_op) is None:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, float_op if sig.args[0].kind == "f32" else int_op)(args[0], args[1])

        return a(a, b), codegen

    op.__name__ = op.__qualname__ = name
    return op


add = _binary("add", "fadd", "add")
sub = _binary("sub", "fsub", "sub")
mul = _binary("mul", "fmul", "mul")  # integer: modulo 2^32
xor = _binary("xor", None, "xor")
and_ = _binary("and_", None, "and_")
shr = _binary("shr", None, "lshr")  # logical
shl = _binary("shl", None, "shl")


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def clamp(typingctx, v, low, high):  # pragma: no cover - compiled
    """min(max(v, low), high), with NaN lanes set to ``low``: an index computed from the result is in
    range whatever the input held (callers that must see NaN/Inf test the unclamped values)."""
    if not (v == low == high == vf32):
        return None

    def codegen(context, builder, sig, args):
        x, lo, hi = args
        x = builder.select(builder.fcmp_unordered("<", x, lo), lo, x)
        return builder.select(builder.fcmp_ordered(">", x, hi), hi, x)

    return vf32(v, low, high), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def umin(typingctx, a, b):  # pragma: no cover - compiled
    """Unsigned minimum of integer lanes."""
    if not (a == b == vi32):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.icmp_unsigned("<", args[0], args[1]), args[0], args[1])

    return vi32(a, b), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def umax(typingctx, a, b):  # pragma: no cover - compiled
    """Unsigned maximum of integer lanes."""
    if not (a == b == vi32):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.icmp_unsigned(">", args[0], args[1]), args[0], args[1])

    return vi32(a, b), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def hmax(typingctx, v):  # pragma: no cover - compiled
    """The largest lane (unsigned) as a uint32."""
    if v != vi32:
        return None

    def codegen(context, builder, sig, args):
        return builder.call(_intrinsic_function(builder, "llvm.vector.reduce.umax.v16i32", _i32, [_I]), [args[0]])

    return types.uint32(v), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def to_int(typingctx, v):  # pragma: no cover - compiled
    """float32 lanes truncated towards zero to int32 (⌊v⌋ for v ≥ 0; v within int32's range)."""
    if v != vf32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fptosi(args[0], _I)

    return vi32(v), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def to_float(typingctx, v):  # pragma: no cover - compiled
    """Signed int32 lanes as float32 (exact below 2^24 in magnitude)."""
    if v != vi32:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _F)

    return vf32(v), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def bits(typingctx, v):  # pragma: no cover - compiled
    """The same 16 × 32 bits as the other kind (float32 ↔ uint32 bit patterns)."""
    if v not in (vf32, vi32):
        return None
    result = vi32 if v.kind == "f32" else vf32

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _llvm_vec(sig.return_type))

    return result(v), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def sign_mask16(typingctx, v):  # pragma: no cover - compiled
    """Bit l (l < 16) = [v_l ≥ 0] for float32 lanes: the sign bit clear, or a zero of either sign (IEEE
    compares −0.0 ≥ 0 true), i.e. pattern ≤ 0x80000000; as a uint64 (the 48 high bits 0)."""
    if v != vf32:
        return None

    def codegen(context, builder, sig, args):
        patterns = builder.bitcast(args[0], _I)
        nonnegative = builder.icmp_unsigned("<=", patterns, ir.Constant(_I, [0x80000000] * LANES))
        return builder.zext(builder.bitcast(nonnegative, ir.IntType(LANES)), _i64)

    return types.uint64(v), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def affine64(typingctx, v, step, origin):  # pragma: no cover - compiled
    """float32(float64(v)·step + origin) for signed int32 lanes ``v`` and float64 ``step``, ``origin``:
    the products and sums in float64 (as ``v.double().mul_(step).add_(origin).float()``)."""
    if not (v == vi32 and step == types.float64 and origin == types.float64):
        return None

    def codegen(context, builder, sig, args):
        d = ir.VectorType(ir.DoubleType(), LANES)
        wide = builder.sitofp(args[0], d)
        wide = builder.fadd(builder.fmul(wide, _splat(builder, args[1], d)), _splat(builder, args[2], d))
        return builder.fptrunc(wide, _F)

    return vf32(v, step, origin), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def keep_first(typingctx, v, count):  # pragma: no cover - compiled
    """The integer lanes l < ``count`` of ``v``, the others 0."""
    if not (v == vi32 and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(_lane_mask(builder, args[1]), args[0], ir.Constant(_I, [0] * LANES))

    return vi32(v, count), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def select(typingctx, mask, a, b):  # pragma: no cover - compiled
    """Lanes of ``a`` where the integer ``mask`` lane is nonzero, else of ``b``."""
    if not (mask == vi32 and isinstance(a, Vec) and a == b):
        return None

    def codegen(context, builder, sig, args):
        nonzero = builder.icmp_unsigned("!=", args[0], ir.Constant(_I, [0] * LANES))
        return builder.select(nonzero, args[1], args[2])

    return a(mask, a, b), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def step_up(typingctx, z, a, b):  # pragma: no cover - compiled
    """z + 1 in the lanes where a < b (float32, ordered), else z: one masked addition."""
    if not (z == vi32 and a == b == vf32):
        return None

    def codegen(context, builder, sig, args):
        less_ = builder.fcmp_ordered("<", args[1], args[2])
        return builder.select(less_, builder.add(args[0], ir.Constant(_I, [1] * LANES)), args[0])

    return vi32(z, a, b), codegen


# -- float64 sums of squares ------------------------------------------------------------------------------
# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def zeros64(typingctx):  # pragma: no cover - compiled
    """16 float64 lanes of +0.0: an accumulator for :func:`add_squares64`."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_D, [0.0] * LANES)

    return vf64(), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def add_squares64(typingctx, acc, v):  # pragma: no cover - compiled
    """acc + float64(v)² lane by lane: each square exact (a float32's 24-bit significand squared fits
    float64's 53), each sum rounded once."""
    if not (acc == vf64 and v == vf32):
        return None

    def codegen(context, builder, sig, args):
        wide = builder.fpext(args[1], _D)
        return builder.fadd(args[0], builder.fmul(wide, wide))

    return vf64(acc, v), codegen


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
@intrinsic
def hsum(typingctx, v):  # pragma: no cover - compiled
    """The sum of the 16 lanes of a float32 or float64 vector, in lane order (one fixed rounding order), in
    the lanes' precision."""
    if v not in (vf32, vf64):
        return None

    def codegen(context, builder, sig, args):
        total = builder.extract_element(args[0], ir.Constant(_i32, 0))
        for lane in range(1, LANES):
            total = builder.fadd(total, builder.extract_element(args[0], ir.Constant(_i32, lane)))
        return total

    return (types.float32 if v == vf32 else types.float64)(v), codegen
