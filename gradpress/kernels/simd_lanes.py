"""Operations that move values between the lanes of the 16-lane vectors (:mod:`gradpress.kernels.simd`):
the Walsh–Hadamard butterflies within a vector and across vectors at a stride, the 32-entry table lookup,
gathers from a table, and the packing of small codes into bit streams and nibbles.
"""
from __future__ import annotations

from llvmlite import binding as _llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic

from gradpress.kernels.simd_types import (
    LANES,
    _F,
    _FLOAT_ARRAY,
    _I,
    _M,
    _Q,
    _WORD_ARRAY,
    Vec,
    _as_i32,
    _element_pointer,
    _i8,
    _i32,
    _i64,
    _intrinsic_function,
    _is_array,
    _llvm_vec,
    _splat,
    _splat_n,
    vf32,
    vi32,
)


def _avx512() -> bool:
    """Whether numba compiles for this machine's CPU and the CPU has AVX-512F (vpermi2ps)."""
    if config.CPU_NAME or config.CPU_FEATURES:
        return False
    try:
        return bool(_llvm_binding.get_host_cpu_features().get("avx512f", False))
    except RuntimeError:  # pragma: no cover - features unknown
        return False


AVX512 = _avx512()


# -- the Walsh–Hadamard butterflies ----------------------------------------------------------------------
# stays: Hadamard lane shuffles, no numba spelling
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


# stays: Hadamard butterflies at a run-time stride: plain loops carry alias checks (module docstring)
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


# stays: no numba spelling: vpermi2ps (a 32-entry table in two registers)
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


# stays: no numba spelling: a vector gather (numba does not vectorize table lookups)
@intrinsic
def gather(typingctx, table, index):  # pragma: no cover - compiled
    """``table[index]`` lane by lane (float32 or int32 table, unsigned indices; not bounds-checked)."""
    if not (index == vi32 and _is_array(table, _FLOAT_ARRAY + _WORD_ARRAY)):
        return None
    result = vf32 if table.dtype == types.float32 else vi32

    def codegen(context, builder, sig, args):
        return _gather(context, builder, sig.args[0], args[0], args[1], _llvm_vec(sig.return_type))

    return result(table, index), codegen


# stays: packing across the lanes of a Vec (shuffle, or-reduction), no numba spelling
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


# stays: spreading two words over the lanes of a Vec, no numba spelling
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


# stays: packing across the lanes of a Vec, no numba spelling
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


# stays: spreading bytes over the lanes of a Vec, no numba spelling
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
