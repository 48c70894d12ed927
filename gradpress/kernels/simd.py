"""16-lane vector values for numba kernels: a float32 and a 32-bit integer vector type, and the LLVM
operations on them that the THC kernels (:mod:`gradpress.kernels.hadamard`, :mod:`gradpress.compressors.thc`)
are written in.

Numba vectorizes plain loops well, but not the shapes a fast Walsh–Hadamard transform needs: butterflies
between 16-lane groups at a runtime stride (every such loop carries run-time alias checks, which cost more
than the butterflies at short strides) and within one group (lane shuffles). These types let a kernel hold
a group of 16 values in a register, as ``<16 x float>`` or ``<16 x i32>``: every operation here is one LLVM
vector instruction (or a few), IEEE-exact as its scalar counterpart (no fast-math flags), so a kernel
written with them gives the bits of the same scalar arithmetic. LLVM lowers the vectors to the widest
registers the CPU has (one zmm register with AVX-512, two ymm with AVX2, four xmm with SSE) and is correct
on all of them; only the table lookup :func:`permute32` uses an AVX-512 instruction, where the CPU has it,
and a gather elsewhere.

Integer lanes are unsigned where it matters (shifts are logical, comparisons unsigned). Kernels pass
:func:`pointer` s, not arrays, to the functions they inline: numba reference-counts an array handed to an
inlined function wherever it cannot pair the updates up, and those atomic updates (each with a
``vzeroupper``) cost more than a loop body.

A kernel inlines these operations into its machine code; its disk cache is keyed on every source file
of the package (:func:`gradpress.kernels.jit.kernel`), so editing this module compiles the kernels that use it
again.
"""
from __future__ import annotations

from llvmlite import binding as _llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic, models, register_model

LANES = 16


class Vec(types.Type):
    """A numba type for 16 lanes held in one LLVM vector value: ``kind`` is "f32", "i32" or "f64" (the
    last only as an accumulator: :func:`zeros64`, :func:`add_squares64`, :func:`hsum`)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        super().__init__(name=f"vec16{kind}")


vf32 = Vec("f32")
vi32 = Vec("i32")
vf64 = Vec("f64")


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):  # noqa: ANN001
        lane = {"f32": ir.FloatType(), "i32": ir.IntType(32), "f64": ir.DoubleType()}[fe_type.kind]
        super().__init__(dmm, fe_type, ir.VectorType(lane, LANES))


_i1, _i8, _i16, _i32, _i64 = (ir.IntType(w) for w in (1, 8, 16, 32, 64))
_F = ir.VectorType(ir.FloatType(), LANES)
_I = ir.VectorType(_i32, LANES)
_Q = ir.VectorType(_i64, LANES)
_M = ir.VectorType(_i1, LANES)
_D = ir.VectorType(ir.DoubleType(), LANES)


def _avx512() -> bool:
    """Whether numba compiles for this machine's CPU and the CPU has AVX-512F (vpermi2ps)."""
    if config.CPU_NAME or config.CPU_FEATURES:
        return False
    try:
        return bool(_llvm_binding.get_host_cpu_features().get("avx512f", False))
    except RuntimeError:  # pragma: no cover - features unknown
        return False


AVX512 = _avx512()


def _llvm_vec(t: Vec) -> ir.VectorType:
    return _F if t.kind == "f32" else _I


def _element_pointer(context, builder, arytype, ary, index, element: ir.Type):  # noqa: ANN001, ANN202
    """A pointer to ``ary[index]`` (an array or a :func:`pointer`), typed as a pointer to ``element``
    (a vector or a wider integer)."""
    data = ary if isinstance(arytype, types.CPointer) else context.make_array(arytype)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [index]), element.as_pointer())


@intrinsic
def pointer(typingctx, array):  # pragma: no cover - compiled
    """The data pointer of a contiguous 1-D array, for the kernels' inner functions: an array passed on
    to an inlined function is reference-counted (atomic updates, and a ``vzeroupper`` each) wherever numba
    cannot pair the updates up, which cost more than a kernel's whole loop body; a pointer is a plain
    value. Indexing it is not bounds-checked (neither is an array's)."""
    if not (isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        return context.make_array(sig.args[0])(context, builder, args[0]).data

    return types.CPointer(array.dtype)(array), codegen


def _as_i32(builder, value):  # noqa: ANN001, ANN202
    width = value.type.width
    return value if width == 32 else (builder.trunc(value, _i32) if width > 32 else builder.zext(value, _i32))


def _splat(builder, value, vector_type: ir.VectorType):  # noqa: ANN001, ANN202
    undef = ir.Constant(vector_type, None)
    one = builder.insert_element(undef, value, ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(_I, [0] * LANES))


def _intrinsic_function(builder, name: str, result: ir.Type, arguments: list[ir.Type]):  # noqa: ANN202
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(result, arguments), name)


def _is_array(t, dtypes) -> bool:  # noqa: ANN001
    """Whether ``t`` is memory the intrinsics read or write: a 1-D array or a pointer of those dtypes."""
    return ((isinstance(t, types.Array) and t.ndim == 1) or isinstance(t, types.CPointer)) and t.dtype in dtypes


_FLOAT_ARRAY = (types.float32,)
_WORD_ARRAY = (types.int32, types.uint32)


# -- memory ---------------------------------------------------------------------------------------------
@intrinsic
def load(typingctx, array, index):  # pragma: no cover - compiled
    """``array[index : index + 16]`` (float32 → vf32; int32/uint32 → vi32). Not bounds-checked."""
    if _is_array(array, _FLOAT_ARRAY):
        result = vf32
    elif _is_array(array, _WORD_ARRAY):
        result = vi32
    else:
        return None

    def codegen(context, builder, sig, args):
        vector = _llvm_vec(sig.return_type)
        return builder.load(_element_pointer(context, builder, sig.args[0], args[0], args[1], vector), align=4)

    return result(array, index), codegen


@intrinsic
def store(typingctx, array, index, value):  # pragma: no cover - compiled
    """``array[index : index + 16] = value`` (the array's lanes the vector's kind). Not bounds-checked."""
    if not (value in (vf32, vi32) and _is_array(array, _FLOAT_ARRAY if value.kind == "f32" else _WORD_ARRAY)):
        return None

    def codegen(context, builder, sig, args):
        pointer = _element_pointer(context, builder, sig.args[0], args[0], args[1], _llvm_vec(sig.args[2]))
        builder.store(args[2], pointer, align=4)
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


def _lane_mask(builder, count):  # noqa: ANN001, ANN202
    """Lanes l < count (count any integer; ≤ 0: none)."""
    wide = builder.sext(count, _i64) if count.type.width < 64 else count
    return builder.icmp_signed("<", ir.Constant(_Q, list(range(LANES))), _splat(builder, wide, _Q))


@intrinsic
def load_first(typingctx, array, index, count):  # pragma: no cover - compiled
    """Lanes l < ``count`` from ``array[index + l]``, the others 0.0 (float32 arrays); reads nothing past
    them (a masked load), so it may stand at the end of an array."""
    if not _is_array(array, _FLOAT_ARRAY):
        return None

    def codegen(context, builder, sig, args):
        pointer = _element_pointer(context, builder, sig.args[0], args[0], args[1], _F)
        masked = _intrinsic_function(builder, "llvm.masked.load.v16f32.p0", _F, [_F.as_pointer(), _i32, _M, _F])
        return builder.call(masked, [pointer, ir.Constant(_i32, 4), _lane_mask(builder, args[2]),
                                     ir.Constant(_F, [0.0] * LANES)])

    return vf32(array, index, count), codegen


@intrinsic
def store_first(typingctx, array, index, value, count):  # pragma: no cover - compiled
    """``array[index + l] = value[l]`` for the lanes l < ``count`` only (a masked store)."""
    if not (value == vf32 and _is_array(array, _FLOAT_ARRAY)):
        return None

    def codegen(context, builder, sig, args):
        pointer = _element_pointer(context, builder, sig.args[0], args[0], args[1], _F)
        masked = _intrinsic_function(builder, "llvm.masked.store.v16f32.p0", ir.VoidType(),
                                     [_F, _F.as_pointer(), _i32, _M])
        builder.call(masked, [args[2], pointer, ir.Constant(_i32, 4), _lane_mask(builder, args[3])])
        return context.get_dummy_value()

    return types.void(array, index, value, count), codegen


@intrinsic
def load_float(typingctx, array, index):  # pragma: no cover - compiled
    """16 integers from ``array[index:]`` (uint8, int8, int16, int32, uint32 or int64) as float32, each
    correctly rounded (as numpy's and torch's conversions)."""
    if not (_is_array(array, types.integer_domain)):
        return None

    def codegen(context, builder, sig, args):
        dtype = sig.args[0].dtype
        vector = ir.VectorType(ir.IntType(dtype.bitwidth), LANES)
        raw = builder.load(_element_pointer(context, builder, sig.args[0], args[0], args[1], vector),
                           align=dtype.bitwidth // 8)
        return builder.sitofp(raw, _F) if dtype.signed else builder.uitofp(raw, _F)

    return vf32(array, index), codegen


@intrinsic
def load_word(typingctx, array, index, nbytes):  # pragma: no cover - compiled
    """The ``nbytes`` ∈ {1, 2, 4, 8} bytes at ``array[index]`` (a uint8 array) as a little-endian uint64
    (zero-extended). ``nbytes`` must be a compile-time literal."""
    if not (_is_array(array, (types.uint8,)) and isinstance(nbytes, types.IntegerLiteral)
            and nbytes.literal_value in (1, 2, 4, 8)):
        return None
    width = 8 * nbytes.literal_value

    def codegen(context, builder, sig, args):
        word = ir.IntType(width)
        value = builder.load(_element_pointer(context, builder, sig.args[0], args[0], args[1], word), align=1)
        return value if width == 64 else builder.zext(value, _i64)

    return types.uint64(array, index, nbytes), codegen


@intrinsic
def store_word(typingctx, array, index, word, nbytes):  # pragma: no cover - compiled
    """The low ``nbytes`` ∈ {1, 2, 4, 8} bytes of ``word`` to ``array[index:]`` (a uint8 array),
    little-endian. ``nbytes`` must be a compile-time literal."""
    if not (_is_array(array, (types.uint8,)) and isinstance(nbytes, types.IntegerLiteral)
            and nbytes.literal_value in (1, 2, 4, 8)):
        return None
    width = 8 * nbytes.literal_value

    def codegen(context, builder, sig, args):
        target = ir.IntType(width)
        value = args[2] if args[2].type.width == 64 else builder.zext(args[2], _i64)
        value = value if width == 64 else builder.trunc(value, target)
        builder.store(value, _element_pointer(context, builder, sig.args[0], args[0], args[1], target), align=1)
        return context.get_dummy_value()

    return types.void(array, index, word, nbytes), codegen


# -- building vectors ------------------------------------------------------------------------------------
@intrinsic
def fsplat(typingctx, value):  # pragma: no cover - compiled
    """Every lane ``value`` (a float32; a float64 is rounded to float32 first)."""
    if not isinstance(value, types.Float):
        return None

    def codegen(context, builder, sig, args):
        v = args[0] if sig.args[0] == types.float32 else builder.fptrunc(args[0], ir.FloatType())
        return _splat(builder, v, _F)

    return vf32(value), codegen


@intrinsic
def isplat(typingctx, value):  # pragma: no cover - compiled
    """Every lane the low 32 bits of the integer ``value``."""
    if not isinstance(value, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _splat(builder, _as_i32(builder, args[0]), _I)

    return vi32(value), codegen


@intrinsic
def iota(typingctx, start):  # pragma: no cover - compiled
    """Lanes ``start + l`` for l = 0..15, modulo 2^32."""
    if not isinstance(start, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.add(_splat(builder, _as_i32(builder, args[0]), _I), ir.Constant(_I, list(range(LANES))))

    return vi32(start), codegen


# -- arithmetic (IEEE, lane by lane) ------------------------------------------------------------------------
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


@intrinsic
def umin(typingctx, a, b):  # pragma: no cover - compiled
    """Unsigned minimum of integer lanes."""
    if not (a == b == vi32):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.icmp_unsigned("<", args[0], args[1]), args[0], args[1])

    return vi32(a, b), codegen


@intrinsic
def umax(typingctx, a, b):  # pragma: no cover - compiled
    """Unsigned maximum of integer lanes."""
    if not (a == b == vi32):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(builder.icmp_unsigned(">", args[0], args[1]), args[0], args[1])

    return vi32(a, b), codegen


@intrinsic
def hmax(typingctx, v):  # pragma: no cover - compiled
    """The largest lane (unsigned) as a uint32."""
    if v != vi32:
        return None

    def codegen(context, builder, sig, args):
        return builder.call(_intrinsic_function(builder, "llvm.vector.reduce.umax.v16i32", _i32, [_I]), [args[0]])

    return types.uint32(v), codegen


@intrinsic
def to_int(typingctx, v):  # pragma: no cover - compiled
    """float32 lanes truncated towards zero to int32 (⌊v⌋ for v ≥ 0; v within int32's range)."""
    if v != vf32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fptosi(args[0], _I)

    return vi32(v), codegen


@intrinsic
def to_float(typingctx, v):  # pragma: no cover - compiled
    """Signed int32 lanes as float32 (exact below 2^24 in magnitude)."""
    if v != vi32:
        return None

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _F)

    return vf32(v), codegen


@intrinsic
def bits(typingctx, v):  # pragma: no cover - compiled
    """The same 16 × 32 bits as the other kind (float32 ↔ uint32 bit patterns)."""
    if v not in (vf32, vi32):
        return None
    result = vi32 if v.kind == "f32" else vf32

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _llvm_vec(sig.return_type))

    return result(v), codegen


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


# -- float64 sums of squares ------------------------------------------------------------------------------
@intrinsic
def zeros64(typingctx):  # pragma: no cover - compiled
    """16 float64 lanes of +0.0: an accumulator for :func:`add_squares64`."""

    def codegen(context, builder, sig, args):
        return ir.Constant(_D, [0.0] * LANES)

    return vf64(), codegen


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


# -- the Walsh–Hadamard butterflies ----------------------------------------------------------------------
@intrinsic
def wht16(typingctx, v):  # pragma: no cover - compiled
    """The butterfly stages h = 1, 2, 4, 8 within the 16 lanes, in that order: lanes i and i + h (bit h of
    i clear) become (a + b, a − b). Each stage is a lane shuffle s (lane i ↦ lane i xor h) and
    fma(v, ±1, s): the product is exact, so the one rounding is that of a + b or a − b."""
    if v != vf32:
        return None

    def codegen(context, builder, sig, args):
        fma_ = _intrinsic_function(builder, "llvm.fma.v16f32", _F, [_F, _F, _F])
        x = args[0]
        for h in (1, 2, 4, 8):
            swapped = builder.shuffle_vector(x, ir.Constant(_F, None), ir.Constant(_I, [i ^ h for i in range(LANES)]))
            signs = ir.Constant(_F, [-1.0 if i & h else 1.0 for i in range(LANES)])
            x = builder.call(fma_, [x, signs, swapped])  # lower lanes: a + b; upper lanes: −b + a
        return x

    return vf32(v), codegen


def _radix(stages: int, scaled: bool):  # noqa: ANN202
    count = 1 << stages

    @intrinsic
    def radix(typingctx, src, src_at, src_stride, dst, dst_at, dst_stride, scale, one):  # pragma: no cover
        """Load the 2^k vectors src[src_at + m·src_stride] (m < 2^k), apply k butterfly stages across them
        (stage s pairs m and m + 2^s, in the order s = 0, 1, …), multiply by ``scale`` (the ``*_scaled``
        variants; the others ignore it) and store them to dst[dst_at + m·dst_stride]. The differences are
        formed as fma(b, −one, a) with the run-time ``one`` = 1.0: the same bits (b·−1 is exact), but LLVM
        cannot fold a value it does not know into a subtraction, so they run on the multiply-add units
        while the sums run on the adders (AVX-512 on Zen 4: one 512-bit addition per cycle each)."""
        if not (_is_array(src, _FLOAT_ARRAY) and _is_array(dst, _FLOAT_ARRAY) and scale == types.float32
                and one == types.float32):
            return None

        def codegen(context, builder, sig, args):
            a_src, a_at, a_stride, a_dst, d_at, d_stride, a_scale, a_one = args
            fma_ = _intrinsic_function(builder, "llvm.fma.v16f32", _F, [_F, _F, _F])

            def pointer(array_type, array, at, stride, m):  # noqa: ANN001, ANN202
                index = builder.add(at, builder.mul(stride, ir.Constant(at.type, m)))
                return _element_pointer(context, builder, array_type, array, index, _F)

            values = [builder.load(pointer(sig.args[0], a_src, a_at, a_stride, m), align=4) for m in range(count)]
            minus = builder.fneg(_splat(builder, a_one, _F))
            for s in range(stages):
                h = 1 << s
                for m in range(count):
                    if not m & h:
                        a, b = values[m], values[m + h]
                        values[m], values[m + h] = builder.fadd(a, b), builder.call(fma_, [b, minus, a])
            factor = _splat(builder, a_scale, _F)
            for m in range(count):
                v = builder.fmul(values[m], factor) if scaled else values[m]
                builder.store(v, pointer(sig.args[3], a_dst, d_at, d_stride, m), align=4)
            return context.get_dummy_value()

        return types.void(src, src_at, src_stride, dst, dst_at, dst_stride, scale, one), codegen

    radix.__name__ = radix.__qualname__ = f"radix{count}" + ("_scaled" if scaled else "")
    return radix


radix2, radix4, radix8, radix16 = (_radix(k, False) for k in (1, 2, 3, 4))
radix2_scaled, radix4_scaled, radix8_scaled, radix16_scaled = (_radix(k, True) for k in (1, 2, 3, 4))


# -- table lookups, packing -------------------------------------------------------------------------------
def _gather(context, builder, arytype, ary, index, vector):  # noqa: ANN001, ANN202
    element = vector.element
    data = _element_pointer(context, builder, arytype, ary, ir.Constant(_i64, 0), element)
    base = _splat(builder, builder.ptrtoint(data, _i64), _Q)
    address = builder.add(base, builder.mul(builder.zext(index, _Q), ir.Constant(_Q, [4] * LANES)))
    pointers = builder.inttoptr(address, ir.VectorType(element.as_pointer(), LANES))
    kind = "f32" if isinstance(element, ir.FloatType) else "i32"
    gather_ = _intrinsic_function(builder, f"llvm.masked.gather.v16{kind}.v16p0", vector,
                                  [pointers.type, _i32, _M, vector])
    return builder.call(gather_, [pointers, ir.Constant(_i32, 4), ir.Constant(_M, [1] * LANES),
                                  ir.Constant(vector, None)])


@intrinsic
def gather(typingctx, table, index):  # pragma: no cover - compiled
    """``table[index]`` lane by lane (float32 or int32 table, unsigned indices; not bounds-checked)."""
    if not (index == vi32 and _is_array(table, _FLOAT_ARRAY + _WORD_ARRAY)):
        return None
    result = vf32 if table.dtype == types.float32 else vi32

    def codegen(context, builder, sig, args):
        return _gather(context, builder, sig.args[0], args[0], args[1], _llvm_vec(sig.return_type))

    return result(table, index), codegen


def _pack(high: bool):  # noqa: ANN202
    @intrinsic
    def pack(typingctx, codes, bits):  # pragma: no cover - compiled
        """The codes of lanes 0-7 (``pack_low``) or 8-15 (``pack_high``), each below 2^bits (bits ≤ 8), as
        one bit stream Σ code_l << (bits·l), a uint64 (gradpress.kernels.bits' layout: the first in the lowest
        bits)."""
        if not (codes == vi32 and isinstance(bits, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            v, b = args
            eight = ir.VectorType(_i64, 8)
            lanes = builder.shuffle_vector(v, ir.Constant(_I, None),
                                           ir.Constant(ir.VectorType(_i32, 8), list(range(8, 16) if high else range(8))))
            width = builder.zext(_as_i32(builder, b), _i64)
            shifts = builder.mul(_splat_n(builder, width, eight), ir.Constant(eight, list(range(8))))
            shifted = builder.shl(builder.zext(lanes, eight), shifts)
            return builder.call(_intrinsic_function(builder, "llvm.vector.reduce.or.v8i64", _i64, [eight]), [shifted])

        return types.uint64(codes, bits), codegen

    pack.__name__ = pack.__qualname__ = "pack_high" if high else "pack_low"
    return pack


pack_low, pack_high = _pack(False), _pack(True)


def _splat_n(builder, value, vector_type):  # noqa: ANN001, ANN202
    undef = ir.Constant(vector_type, None)
    one = builder.insert_element(undef, value, ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_i32, vector_type.count),
                                                          [0] * vector_type.count))


@intrinsic
def unpack16(typingctx, low, high, bits):  # pragma: no cover - compiled
    """16 codes of ``bits`` bits: lanes 0-7 from the bit stream ``low``, lanes 8-15 from ``high``
    (the inverse of :func:`pack_low` and :func:`pack_high`)."""
    if not (low == types.uint64 and high == types.uint64 and isinstance(bits, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        lo, hi, b = args
        both = builder.insert_element(ir.Constant(ir.VectorType(_i64, 2), None), lo, ir.Constant(_i32, 0))
        both = builder.insert_element(both, hi, ir.Constant(_i32, 1))
        words = builder.shuffle_vector(both, ir.Constant(ir.VectorType(_i64, 2), None),
                                       ir.Constant(_I, [0] * 8 + [1] * 8))
        width = builder.zext(_as_i32(builder, b), _i64)
        shifts = builder.mul(_splat(builder, width, _Q), ir.Constant(_Q, [i % 8 for i in range(LANES)]))
        mask = builder.sub(builder.shl(ir.Constant(_i64, 1), width), ir.Constant(_i64, 1))
        codes = builder.and_(builder.lshr(words, shifts), _splat(builder, mask, _Q))
        return builder.trunc(codes, _I)

    return vi32(low, high, bits), codegen


@intrinsic
def store_ints(typingctx, array, index, v):  # pragma: no cover - compiled
    """``array[index : index + 16] = v`` for a uint8 (the low byte of each lane), int32 or uint32 array."""
    if not (v == vi32 and _is_array(array, (types.uint8, types.int32, types.uint32))):
        return None

    def codegen(context, builder, sig, args):
        vector = ir.VectorType(ir.IntType(sig.args[0].dtype.bitwidth), LANES)
        value = args[2] if vector.element.width == 32 else builder.trunc(args[2], vector)
        builder.store(value, _element_pointer(context, builder, sig.args[0], args[0], args[1], vector),
                      align=vector.element.width // 8)
        return context.get_dummy_value()

    return types.void(array, index, v), codegen


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


@intrinsic
def store_stream(typingctx, array, index, value):  # pragma: no cover - compiled
    """``array[index : index + 16] = value`` (float32), as a non-temporal store where the 64 bytes are
    64-byte aligned (a whole cache line: written to memory without being read first, nor kept in the
    caches), else as :func:`store`. For outputs far larger than the caches."""
    if not (value == vf32 and _is_array(array, _FLOAT_ARRAY)):
        return None

    def codegen(context, builder, sig, args):
        pointer = _element_pointer(context, builder, sig.args[0], args[0], args[1], _F)
        aligned = builder.icmp_unsigned("==", builder.and_(builder.ptrtoint(pointer, _i64), ir.Constant(_i64, 63)),
                                        ir.Constant(_i64, 0))
        with builder.if_else(aligned) as (then, otherwise):
            with then:
                streamed = builder.store(args[2], pointer, align=64)
                streamed.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_i32, 1)]))
            with otherwise:
                builder.store(args[2], pointer, align=4)
        return context.get_dummy_value()

    return types.void(array, index, value), codegen


@intrinsic
def load_affine64(typingctx, array, index, step, origin):  # pragma: no cover - compiled
    """float32(float64(array[index + l])·step + origin) for 16 integers of any integer dtype: the
    products and sums in float64, as ``t.double().mul_(step).add_(origin).float()``."""
    if not (_is_array(array, types.integer_domain) and step == types.float64 and origin == types.float64):
        return None

    def codegen(context, builder, sig, args):
        dtype = sig.args[0].dtype
        vector = ir.VectorType(ir.IntType(dtype.bitwidth), LANES)
        raw = builder.load(_element_pointer(context, builder, sig.args[0], args[0], args[1], vector),
                           align=dtype.bitwidth // 8)
        d = ir.VectorType(ir.DoubleType(), LANES)
        wide = builder.sitofp(raw, d) if dtype.signed else builder.uitofp(raw, d)
        wide = builder.fadd(builder.fmul(wide, _splat(builder, args[2], d)), _splat(builder, args[3], d))
        return builder.fptrunc(wide, _F)

    return vf32(array, index, step, origin), codegen


@intrinsic
def keep_first(typingctx, v, count):  # pragma: no cover - compiled
    """The integer lanes l < ``count`` of ``v``, the others 0."""
    if not (v == vi32 and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.select(_lane_mask(builder, args[1]), args[0], ir.Constant(_I, [0] * LANES))

    return vi32(v, count), codegen


@intrinsic
def store_nibbles(typingctx, array, index, v):  # pragma: no cover - compiled
    """16 codes below 16 (integer lanes) packed two to a byte, the first in the low half (gradpress.kernels.bits'
    layout for 4 bits), into the 8 bytes at ``array[index:]`` (uint8): lane pairs as 64-bit lanes,
    x | x >> 28, the low bytes."""
    if not (v == vi32 and _is_array(array, (types.uint8,))):
        return None

    def codegen(context, builder, sig, args):
        q = ir.VectorType(_i64, 8)
        x = builder.bitcast(args[2], q)
        x = builder.or_(x, builder.lshr(x, ir.Constant(q, [28] * 8)))
        b = ir.VectorType(_i8, 8)
        builder.store(builder.trunc(x, b), _element_pointer(context, builder, sig.args[0], args[0], args[1], b),
                      align=1)
        return context.get_dummy_value()

    return types.void(array, index, v), codegen


@intrinsic
def load_nibbles(typingctx, array, index):  # pragma: no cover - compiled
    """The 16 four-bit codes packed in the 8 bytes at ``array[index:]`` (the inverse of
    :func:`store_nibbles`)."""
    if not _is_array(array, (types.uint8,)):
        return None

    def codegen(context, builder, sig, args):
        b = ir.VectorType(_i8, 8)
        q = ir.VectorType(_i64, 8)
        x = builder.zext(builder.load(_element_pointer(context, builder, sig.args[0], args[0], args[1], b), align=1), q)
        low = builder.and_(x, ir.Constant(q, [15] * 8))
        high = builder.shl(builder.lshr(x, ir.Constant(q, [4] * 8)), ir.Constant(q, [32] * 8))
        return builder.bitcast(builder.or_(low, high), _I)

    return vi32(array, index), codegen


@intrinsic
def load_bytes(typingctx, array, index):  # pragma: no cover - compiled
    """The 16 bytes at ``array[index:]`` (uint8) as integer lanes."""
    if not _is_array(array, (types.uint8,)):
        return None

    def codegen(context, builder, sig, args):
        b = ir.VectorType(_i8, LANES)
        return builder.zext(builder.load(_element_pointer(context, builder, sig.args[0], args[0], args[1], b),
                                         align=1), _I)

    return vi32(array, index), codegen


@intrinsic
def advance(typingctx, pointer_, count):  # pragma: no cover - compiled
    """``pointer_ + count`` elements."""
    if not (isinstance(pointer_, types.CPointer) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.gep(args[0], [args[1]])

    return pointer_(pointer_, count), codegen


@intrinsic
def select(typingctx, mask, a, b):  # pragma: no cover - compiled
    """Lanes of ``a`` where the integer ``mask`` lane is nonzero, else of ``b``."""
    if not (mask == vi32 and isinstance(a, Vec) and a == b):
        return None

    def codegen(context, builder, sig, args):
        nonzero = builder.icmp_unsigned("!=", args[0], ir.Constant(_I, [0] * LANES))
        return builder.select(nonzero, args[1], args[2])

    return a(mask, a, b), codegen


@intrinsic
def permute32(typingctx, low, high, index):  # pragma: no cover - compiled
    """Lane l: entry index[l] mod 32 of the 32-entry table held in two vectors (``low``: entries 0-15,
    ``high``: 16-31), of either kind: one AVX-512 ``vpermi2ps`` where the CPU has it (which reads the
    index's low five bits), else a gather from a copy on the stack at the index's low five bits (so no
    index reads outside the copy). Load the table once, outside the loop (:func:`load`)."""
    if not (isinstance(low, Vec) and low == high and index == vi32):
        return None

    def codegen(context, builder, sig, args):
        vector = _llvm_vec(sig.args[0])
        lo, hi = (args[0], args[1]) if vector is _F else (builder.bitcast(args[0], _F), builder.bitcast(args[1], _F))
        if AVX512:
            permute = _intrinsic_function(builder, "llvm.x86.avx512.vpermi2var.ps.512", _F, [_F, _I, _F])
            got = builder.call(permute, [lo, args[2], hi])
        else:
            both = ir.VectorType(ir.FloatType(), 2 * LANES)
            table = cgutils.alloca_once(builder, both)
            builder.store(builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_i32, 2 * LANES),
                                                                     list(range(2 * LANES)))), table)
            base = builder.bitcast(table, ir.FloatType().as_pointer())
            index = builder.and_(args[2], ir.Constant(_I, [2 * LANES - 1] * LANES))
            address = builder.add(_splat(builder, builder.ptrtoint(base, _i64), _Q),
                                  builder.mul(builder.zext(index, _Q), ir.Constant(_Q, [4] * LANES)))
            pointers = builder.inttoptr(address, ir.VectorType(ir.FloatType().as_pointer(), LANES))
            gather_ = _intrinsic_function(builder, "llvm.masked.gather.v16f32.v16p0", _F,
                                          [pointers.type, _i32, _M, _F])
            got = builder.call(gather_, [pointers, ir.Constant(_i32, 4), ir.Constant(_M, [1] * LANES),
                                         ir.Constant(_F, None)])
        return got if vector is _F else builder.bitcast(got, _I)

    return low(low, high, index), codegen


@intrinsic
def prefetch(typingctx, array, index):  # pragma: no cover - compiled
    """Hint that ``array[index]`` will be read soon (``llvm.prefetch``, into all cache levels); any index,
    no fault."""
    if not (isinstance(array, (types.Array, types.CPointer)) and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        pointer = _element_pointer(context, builder, sig.args[0], args[0], args[1], _i8)
        function = _intrinsic_function(builder, "llvm.prefetch.p0", ir.VoidType(), [_i8.as_pointer(), _i32, _i32, _i32])
        builder.call(function, [pointer, ir.Constant(_i32, 0), ir.Constant(_i32, 3), ir.Constant(_i32, 1)])
        return context.get_dummy_value()

    return types.void(array, index), codegen


@intrinsic
def step_up(typingctx, z, a, b):  # pragma: no cover - compiled
    """z + 1 in the lanes where a < b (float32, ordered), else z: one masked addition."""
    if not (z == vi32 and a == b == vf32):
        return None

    def codegen(context, builder, sig, args):
        less_ = builder.fcmp_ordered("<", args[1], args[2])
        return builder.select(less_, builder.add(args[0], ir.Constant(_I, [1] * LANES)), args[0])

    return vi32(z, a, b), codegen
