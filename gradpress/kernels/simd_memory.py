"""Memory operations of the 16-lane vectors (:mod:`gradpress.kernels.simd`): loads and stores of whole,
partial (masked) and narrower-typed vectors, unaligned words of a byte array, non-temporal stores,
prefetches, and the raw data pointers kernels pass to the functions they inline.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from gradpress.kernels.simd_types import (
    LANES,
    _F,
    _FLOAT_ARRAY,
    _I,
    _M,
    _WORD_ARRAY,
    _element_pointer,
    _i8,
    _i32,
    _i64,
    _intrinsic_function,
    _is_array,
    _lane_mask,
    _llvm_vec,
    _splat,
    vf32,
    vi32,
)


# -- pointers -------------------------------------------------------------------------------------------
# stays: no numba spelling: an array's data pointer (no reference counts in inlined calls)
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


# stays: no numba spelling: pointer arithmetic
@intrinsic
def advance(typingctx, pointer_, count):  # pragma: no cover - compiled
    """``pointer_ + count`` elements."""
    if not (isinstance(pointer_, types.CPointer) and isinstance(count, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.gep(args[0], [args[1]])

    return pointer_(pointer_, count), codegen


# stays: no numba spelling: llvm.prefetch
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


# -- loads and stores ------------------------------------------------------------------------------------
# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
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


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
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


# stays: no numba spelling: a masked load (llvm.masked.load), safe at an array's end
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


# stays: no numba spelling: a masked store (llvm.masked.store)
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


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
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


# stays: unaligned words; as a plain byte loop, load64/store64 ran 1.6x slower
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


# stays: unaligned words; as a plain byte loop, load64/store64 ran 1.6x slower
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


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
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


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
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


# stays: an operation on Vec values (vector kernels); as plain loops, norms.squares ran 3.9x slower
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


# stays: no numba spelling: non-temporal stores
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
