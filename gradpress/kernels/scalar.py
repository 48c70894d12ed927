"""Scalar helpers that numba kernels inline: 32-bit products, bit casts between floats and their IEEE 754
patterns, the half-precision casts, the ``mix32`` counter hash and the uniforms drawn from it, unaligned
64-bit words of a byte array, and the widest vectors for a kernel (:func:`wide_vectors`).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from gradpress.kernels.cache import kernel


@kernel(inline="always")
def mul32(a, b):  # pragma: no cover - compiled
    """a × b mod 2^32 as a uint32 (``a`` and ``b`` taken as uint32). Numba types the product of two uint32
    as a uint64; LLVM narrows the truncated product of two zero-extended values to one 32-bit multiply
    (``vpmulld`` where the loop vectorizes). A plain expression: the intrinsic it replaced measured no
    faster (docs/performance.md, "Hand-written intrinsics")."""
    return np.uint32(np.uint32(a) * np.uint32(b))


# bit casts between floats and their IEEE 754 patterns, for kernels that work on exponents and mantissas:
# numba's scalar ``view``, one LLVM ``bitcast`` (no instruction in the machine code), as fast as the
# intrinsics they replaced (docs/performance.md, "Hand-written intrinsics")
@kernel(inline="always")
def f32_from_bits(value):  # pragma: no cover - compiled
    """The float32 whose IEEE 754 pattern is ``value`` (taken as a uint32)."""
    return np.uint32(value).view(np.float32)


@kernel(inline="always")
def bits_of_f32(value):  # pragma: no cover - compiled
    """The IEEE 754 pattern (uint32) of ``value`` taken as a float32."""
    return np.float32(value).view(np.uint32)


@kernel(inline="always")
def f64_from_bits(value):  # pragma: no cover - compiled
    """The float64 whose IEEE 754 pattern is ``value`` (taken as a uint64)."""
    return np.uint64(value).view(np.float64)


@kernel(inline="always")
def bits_of_f64(value):  # pragma: no cover - compiled
    """The IEEE 754 pattern (uint64) of ``value`` taken as a float64."""
    return np.float64(value).view(np.uint64)


# stays: no numba spelling: numba has no float16 scalar (fptrunc, vcvtps2ph)
@intrinsic
def f16_bits_of_f32(typingctx, value):  # pragma: no cover - compiled
    """The IEEE half-precision bit pattern (uint16) of float32 ``value``, rounded to nearest even as
    ``torch.Tensor.to(torch.float16)`` rounds (subnormals, overflow to ±Inf, NaN to a NaN): LLVM's
    ``fptrunc``, one ``vcvtps2ph`` per 16 values on CPUs with F16C/AVX-512, exact software elsewhere."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


# stays: no numba spelling: numba has no float16 scalar (fpext, vcvtph2ps)
@intrinsic
def f32_of_f16_bits(typingctx, value):  # pragma: no cover - compiled
    """The float32 value of IEEE half-precision bit pattern ``value`` (uint16), exact, as
    ``Tensor.float()`` of a float16 tensor: LLVM's ``fpext`` (``vcvtph2ps``)."""
    if value != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


GOLDEN = np.uint32(0x9E3779B1)  # mix32's multiplier of the index


@kernel(inline="always")
def mix32_from(h, seed):  # pragma: no cover - compiled
    """``mix32(i, seed)``, bit for bit, given h = i·GOLDEN mod 2^32.

    A loop over consecutive i advances h by adding GOLDEN: one vectorized multiply (of three) fewer per
    hash, which is the largest cost of natural compression's and dithering's kernels (measured 0.39 →
    0.25 ms per 2^21 hashes). The numba-vs-torch tests check the bits against
    :func:`gradpress.core.rng.mix32_torch`.
    """
    u = np.uint32
    h = u(h ^ u(seed))
    h = u(h ^ u(h >> u(16)))
    h = mul32(h, u(0x85EBCA6B))
    h = u(h ^ u(h >> u(13)))
    h = mul32(h, u(0xC2B2AE35))
    return u(h ^ u(h >> u(16)))


@kernel(inline="always")
def mix32(i, seed):  # pragma: no cover - compiled
    """MurmurHash3 fmix32 of ``i * GOLDEN ^ seed``, bit for bit :func:`gradpress.core.rng.mix32_torch`."""
    return mix32_from(mul32(np.uint32(i), GOLDEN), seed)


# stays: no numba spelling: a function attribute
@intrinsic
def wide_vectors(typingctx):  # pragma: no cover - compiled
    """Let LLVM vectorize the calling kernel at the widest width the CPU has (AVX-512: 16 float32 lanes).

    LLVM's x86 tuning prefers 256-bit vectors on AVX-512 CPUs; for the integer-heavy loops of natural
    compression and dithering (hashing, quantizing, packing) 512 bits measured 1.3-1.7× faster. This
    sets the function attribute clang's ``-mprefer-vector-width=512`` sets, on the calling kernel only
    (no process-wide setting); it changes no result, and nothing on CPUs without wider vectors.
    llvmlite's attribute set accepts flag attributes only, so this key-value one is added as its IR text.
    """
    sig = types.void()

    def codegen(context, builder, signature, args):
        set.add(builder.function.attributes, '"prefer-vector-width"="512"')
        return context.get_dummy_value()

    return sig, codegen


@kernel(inline="always")
def uniform24(i, seed):  # pragma: no cover - compiled
    """Uniform float32 in [0, 1) with 24 random bits, equal to :func:`gradpress.core.rng.uniform24_torch`."""
    return np.float32(mix32(i, seed) >> np.uint32(8)) * np.float32(2.0**-24)


# -- unaligned 64-bit words of a byte array (the packing of gradpress.kernels.bits' whole groups) -------------------
def _byte_pointer(context, builder, array_type, array, offset):  # pragma: no cover - compiled
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), ir.IntType(64).as_pointer())


# stays: as a plain byte loop (load/shift/or) measured 1.6x slower (same process, 2^22)
@intrinsic
def load64(typingctx, array, offset):  # pragma: no cover - compiled
    """The 8 bytes of a uint8 array at byte ``offset`` as a uint64 (any alignment; numba's hosts are all
    little-endian, the layout of :mod:`gradpress.kernels.bits`)."""
    sig = types.uint64(array, types.intp)

    def codegen(context, builder, signature, args):
        return builder.load(_byte_pointer(context, builder, signature.args[0], args[0], args[1]), align=1)

    return sig, codegen


# stays: as a plain byte loop (load/shift/or) measured 1.6x slower (same process, 2^22)
@intrinsic
def store64(typingctx, array, offset, value):  # pragma: no cover - compiled
    """Write ``value`` as 8 (little-endian) bytes at byte ``offset`` of a uint8 array (any alignment)."""
    sig = types.void(array, types.intp, types.uint64)

    def codegen(context, builder, signature, args):
        builder.store(args[2], _byte_pointer(context, builder, signature.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()

    return sig, codegen
