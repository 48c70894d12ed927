"""The 16-lane vector types of :mod:`gradpress.kernels.simd` (``<16 x float>``, ``<16 x i32>``, and
``<16 x double>`` as an accumulator) and the LLVM IR helpers its operations are generated with: splats,
element pointers into an array or a :func:`~gradpress.kernels.simd.pointer`, lane masks, the LLVM
intrinsics' declarations.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import models, register_model

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


def _llvm_vec(t: Vec) -> ir.VectorType:
    return _F if t.kind == "f32" else _I


def _element_pointer(context, builder, arytype, ary, index, element: ir.Type):  # noqa: ANN001, ANN202
    """A pointer to ``ary[index]`` (an array or a :func:`pointer`), typed as a pointer to ``element``
    (a vector or a wider integer)."""
    data = ary if isinstance(arytype, types.CPointer) else context.make_array(arytype)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [index]), element.as_pointer())


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


def _lane_mask(builder, count):  # noqa: ANN001, ANN202
    """Lanes l < count (count any integer; ≤ 0: none)."""
    wide = builder.sext(count, _i64) if count.type.width < 64 else count
    return builder.icmp_signed("<", ir.Constant(_Q, list(range(LANES))), _splat(builder, wide, _Q))


def _splat_n(builder, value, vector_type):  # noqa: ANN001, ANN202
    undef = ir.Constant(vector_type, None)
    one = builder.insert_element(undef, value, ir.Constant(_i32, 0))
    return builder.shuffle_vector(one, undef, ir.Constant(ir.VectorType(_i32, vector_type.count),
                                                          [0] * vector_type.count))
