"""Kernels' operations on 16 or 64 consecutive array elements at once, in LLVM vector IR: comparison masks
as 64-bit words, selects from them, compressed stores of the elements a comparison keeps, and a 16-lane
gather from a table.

LLVM lowers them per CPU (AVX-512 mask registers, ``vcompressps``/``vpcompressd``, ``vpgatherdd`` where the
CPU has them, equivalent scalar code elsewhere): the same results everywhere.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from gradpress.kernels import simd_types as V

_GATHER_LANES = 16


# stays: no numba spelling: vpgatherdd (numba does not vectorize a loop of table lookups)
@intrinsic
def gather16(typingctx, table, indices, out, start):  # pragma: no cover - compiled
    """``out[start + k] = table[indices[start + k]]`` for k < 16, as one vector gather.

    ``table`` and ``out`` hold 4-byte elements of the same type (uint32, int32 or float32), ``indices``
    unsigned integers; nothing is bounds-checked. Numba does not vectorize a loop of table lookups;
    LLVM's ``llvm.masked.gather`` is one ``vpgatherdd``/``vgatherdps`` on AVX-512 and AVX2 CPUs and is
    lowered lane by lane elsewhere (the same results everywhere)."""
    arrays = all(isinstance(a, types.Array) for a in (table, indices, out))
    if not (arrays and table.dtype == out.dtype and table.dtype in (types.uint32, types.int32, types.float32)
            and isinstance(indices.dtype, types.Integer) and not indices.dtype.signed):
        return None
    signature = types.void(table, indices, out, start)

    def codegen(context, builder, sig, args):
        lanes = _GATHER_LANES
        table_arr, index_arr, out_arr = (context.make_array(t)(context, builder, a)
                                         for t, a in zip(sig.args[:3], args[:3], strict=True))
        element = context.get_data_type(sig.args[0].dtype)
        size = context.get_abi_sizeof(element)
        i32, i64 = ir.IntType(32), ir.IntType(64)
        index_vector = ir.VectorType(context.get_data_type(sig.args[1].dtype), lanes)
        index_ptr = builder.bitcast(builder.gep(index_arr.data, [args[3]]), index_vector.as_pointer())
        index = builder.zext(builder.load(index_ptr, align=1), ir.VectorType(i64, lanes))
        wide = ir.VectorType(i64, lanes)
        base = builder.insert_element(ir.Constant(wide, None), builder.ptrtoint(table_arr.data, i64),
                                      ir.Constant(i32, 0))
        lane0 = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
        base = builder.shuffle_vector(base, ir.Constant(wide, None), lane0)  # the table's address in every lane
        address = builder.add(base, builder.mul(index, ir.Constant(wide, [size] * lanes)))
        pointers = builder.inttoptr(address, ir.VectorType(element.as_pointer(), lanes))
        values = ir.VectorType(element, lanes)
        kind = "f32" if isinstance(element, ir.FloatType) else "i32"
        mask = ir.VectorType(ir.IntType(1), lanes)
        gather = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(values, [pointers.type, i32, mask, values]),
            f"llvm.masked.gather.v{lanes}{kind}.v{lanes}p0{kind}")
        got = builder.call(gather, [pointers, ir.Constant(i32, size), ir.Constant(mask, [1] * lanes),
                                    ir.Constant(values, None)])
        out_ptr = builder.bitcast(builder.gep(out_arr.data, [args[3]]), values.as_pointer())
        builder.store(got, out_ptr, align=1)
        return context.get_dummy_value()

    return signature, codegen


# -- bit masks and compressed stores (LLVM vector IR, lowered per CPU: AVX-512 mask registers and
# vcompressps on CPUs that have them, equivalent scalar code elsewhere; the same results everywhere) ----
def _vector_pointer(context, builder, array_type, array, start, vector):  # noqa: ANN001, ANN202
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [start]), vector.as_pointer())


def _is(array, dtype) -> bool:  # noqa: ANN001
    return isinstance(array, types.Array) and array.dtype == dtype and array.layout == "C"


# stays: as a plain 64-step loop measured 1.2x slower (same process, 2^22)
@intrinsic
def sign_bits64(typingctx, bits, start):  # pragma: no cover - compiled
    """Bit j (j < 64) = [x ≥ 0] for the float32 at ``bits[start + j]`` (uint32 patterns): the sign bit
    clear or a zero of either sign, i.e. pattern ≤ 0x80000000. One vector compare per 16 values."""
    if not (_is(bits, types.uint32) and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.IntType(32), 64)
        values = builder.load(_vector_pointer(context, builder, signature.args[0], args[0], args[1], vector), align=4)
        mask = builder.icmp_unsigned("<=", values, ir.Constant(vector, [0x80000000] * 64))
        return builder.bitcast(mask, ir.IntType(64))

    return types.uint64(bits, start), codegen


# stays: as a plain 64-step loop measured 18x slower (same process, 2^22)
@intrinsic
def sign_flags64(typingctx, bits, start):  # pragma: no cover - compiled
    """(signs, non-finite, non-zero): three words for the float32 patterns ``bits[start:start + 64]``,
    from one load. Bit j of each: the sign bit of :func:`sign_bits64` ([x ≥ 0]); |x| is Inf or NaN
    (|pattern| ≥ 0x7F800000); x ≠ 0. A kernel or-s the last two over a tensor for its checks."""
    if not (_is(bits, types.uint32) and isinstance(start, types.Integer)):
        return None
    words = types.UniTuple(types.uint64, 3)

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.IntType(32), 64)
        values = builder.load(_vector_pointer(context, builder, signature.args[0], args[0], args[1], vector), align=4)
        magnitudes = builder.and_(values, ir.Constant(vector, [0x7FFFFFFF] * 64))
        masks = [builder.icmp_unsigned("<=", values, ir.Constant(vector, [0x80000000] * 64)),
                 builder.icmp_unsigned(">=", magnitudes, ir.Constant(vector, [0x7F800000] * 64)),
                 builder.icmp_unsigned("!=", magnitudes, ir.Constant(vector, [0] * 64))]
        return context.make_tuple(builder, words, [builder.bitcast(m, ir.IntType(64)) for m in masks])

    return words(bits, start), codegen


# stays: as a plain 64-step loop measured 19x slower (abs_above64, same process, 2^22)
def _abs_compare64(ordered: bool, op: str):  # noqa: ANN202
    """An intrinsic (x, start, threshold) -> uint64 whose bit j (j < 64) compares |x[start + j]| (float32)
    with ``threshold``: ``fcmp`` ordered (NaN: 0) or unordered (NaN: 1) with ``op``."""

    @intrinsic
    def compare(typingctx, x, start, threshold):  # pragma: no cover - compiled
        if not (_is(x, types.float32) and isinstance(start, types.Integer) and threshold == types.float32):
            return None

        def codegen(context, builder, signature, args):
            vector = ir.VectorType(ir.FloatType(), 64)
            values = builder.load(_vector_pointer(context, builder, signature.args[0], args[0], args[1], vector),
                                  align=4)
            fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector]),
                                                  "llvm.fabs.v64f32")
            splat = builder.shuffle_vector(
                builder.insert_element(ir.Constant(vector, None), args[2], ir.Constant(ir.IntType(32), 0)),
                ir.Constant(vector, None), ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64))
            fcmp = builder.fcmp_ordered if ordered else builder.fcmp_unordered
            return builder.bitcast(fcmp(op, builder.call(fabs, [values]), splat), ir.IntType(64))

        return types.uint64(x, start, threshold), codegen

    return compare


#: bit j (j < 64) = not |x[start + j]| < threshold: set for |x| ≥ threshold and for NaN
abs_not_below64 = _abs_compare64(False, ">=")
#: bit j (j < 64) = |x[start + j]| > threshold: clear for NaN
abs_above64 = _abs_compare64(True, ">")


# stays: as a plain 64-step loop measured 1.1x slower (same process, 2^22)
@intrinsic
def select_bits64(typingctx, word, low, high, out, start):  # pragma: no cover - compiled
    """out[start + j] = high if bit j of ``word`` is set, else low (j < 64; float32)."""
    if not (word == types.uint64 and low == types.float32 and high == types.float32 and _is(out, types.float32)
            and isinstance(start, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.FloatType(), 64)
        lanes0 = ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64)
        zero = ir.Constant(ir.IntType(32), 0)
        low_v = builder.shuffle_vector(builder.insert_element(ir.Constant(vector, None), args[1], zero),
                                       ir.Constant(vector, None), lanes0)
        high_v = builder.shuffle_vector(builder.insert_element(ir.Constant(vector, None), args[2], zero),
                                        ir.Constant(vector, None), lanes0)
        mask = builder.bitcast(args[0], ir.VectorType(ir.IntType(1), 64))
        pointer = _vector_pointer(context, builder, signature.args[3], args[3], args[4], vector)
        builder.store(builder.select(mask, high_v, low_v), pointer, align=4)
        return context.get_dummy_value()

    return types.void(word, low, high, out, start), codegen


# stays: no numba spelling: vpcompressd
def _compress16(predicate: str, doc: str):  # noqa: ANN202
    """An intrinsic writing those of the 16 float32 x[start:start + 16] (or of the 16 lanes of a
    :data:`~gradpress.kernels.simd.vf32` x, standing for those positions) for which ``fcmp predicate |x|,
    threshold`` holds (a leading "u": unordered, true for NaN), in order, to values[at:] and their
    positions (int32) to indices[at:], returning how many: compressed in registers
    (``vcompressps``/``vpcompressd`` with AVX-512, equivalent scalar code elsewhere), then one unaligned
    16-wide store each, so both outputs need 16 slots from ``at`` whatever the count."""

    @intrinsic
    def compress16(typingctx, x, start, threshold, values, indices, at):  # pragma: no cover - compiled
        if not ((_is(x, types.float32) or x == V.vf32) and _is(values, types.float32)
                and _is(indices, types.int32) and isinstance(start, types.Integer)
                and threshold == types.float32 and isinstance(at, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            floats, ints = ir.VectorType(ir.FloatType(), 16), ir.VectorType(i32, 16)
            mask_type = ir.VectorType(ir.IntType(1), 16)
            lanes0 = ir.Constant(ints, [0] * 16)
            module, kinds = builder.module, signature.args

            def splat(value, vector):  # noqa: ANN001, ANN202
                one = builder.insert_element(ir.Constant(vector, None), value, ir.Constant(i32, 0))
                return builder.shuffle_vector(one, ir.Constant(vector, None), lanes0)

            def function(name, result, arguments):  # noqa: ANN001, ANN202
                return cgutils.get_or_insert_function(module, ir.FunctionType(result, arguments), name)

            x_v = args[0] if kinds[0] == V.vf32 else \
                builder.load(_vector_pointer(context, builder, kinds[0], args[0], args[1], floats), align=4)
            magnitude = builder.call(function("llvm.fabs.v16f32", floats, [floats]), [x_v])
            t = splat(args[2], floats)
            mask = builder.fcmp_unordered(predicate[1:], magnitude, t) if predicate[0] == "u" \
                else builder.fcmp_ordered(predicate, magnitude, t)
            base = builder.trunc(args[1], i32) if args[1].type.width > 32 else args[1]
            positions = builder.add(splat(base, ints), ir.Constant(ints, list(range(16))))
            # the values compressed as their bits: LLVM's expansion of a float vector.compress for CPUs
            # without AVX-512 fails an assertion (SelectionDAG::getConstant, "Cannot create FP integer
            # constant") and aborts the process; the integer form compiles everywhere, to the same
            # vpcompressd where AVX-512 has it
            compress_i = function("llvm.experimental.vector.compress.v16i32", ints, [ints, mask_type, ints])
            builder.store(builder.call(compress_i, [builder.bitcast(x_v, ints), mask, ir.Constant(ints, None)]),
                          _vector_pointer(context, builder, kinds[3], args[3], args[5], ints), align=4)
            builder.store(builder.call(compress_i, [positions, mask, ir.Constant(ints, None)]),
                          _vector_pointer(context, builder, kinds[4], args[4], args[5], ints), align=4)
            ctpop = function("llvm.ctpop.i16", ir.IntType(16), [ir.IntType(16)])
            count = builder.call(ctpop, [builder.bitcast(mask, ir.IntType(16))])
            return builder.zext(count, ir.IntType(64))

        return types.int64(x, start, threshold, values, indices, at), codegen

    compress16.__doc__ = (f"Those of the 16 values x[start:start + 16] with {doc}, as :func:`_compress16` "
                          "writes them.")
    return compress16


compress_above16 = _compress16(">", "|x| > threshold, NaN not (threshold-v's selection)")
compress_at_least16 = _compress16("u>=", "not |x| < threshold: at or above it, and NaN (top-k's candidates)")
