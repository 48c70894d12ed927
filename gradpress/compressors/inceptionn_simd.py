"""INCEPTIONN's coding 16 elements at a time in explicit 512-bit vectors (LLVM IR through numba).

Li et al., MICRO 2018 (GRACE §3.1); the format is in :mod:`gradpress.compressors.inceptionn`.

The variable-size payloads are moved by byte compaction: an element's payload word is 4 bytes in a
vector of 16 words, a 64-bit mask keeps its first ``size`` bytes, and LLVM's
``llvm.experimental.vector.compress`` packs the kept bytes together (``llvm.masked.expandload``
spreads them back when decoding); BMI2's ``pdep``/``pext`` turn the tags into that mask. On a CPU
with AVX-512 VBMI2 these are single instructions (``vpcompressb``/``vpexpandb``), which makes the
whole coding a few vector instructions per element; elsewhere LLVM would lower them lane by lane (and
``pdep`` is x86's), so :data:`AVAILABLE` is false there and the compressor keeps its portable numba
kernels. Both write the same bytes (tests compare them).

Each kernel is a numba intrinsic working on 16 elements starting at index ``i`` (a multiple of 16)
and the drivers below loop over them; the last ``n mod 16`` elements go through a zero-padded copy
(zero bits have tag 0 and no payload).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, config, types
from numba.core.codegen import get_host_cpu_features
from numba.extending import intrinsic

from gradpress.kernels.jit import jit

LANES = 16  # elements per vector: 16 float32 = 512 bits


def _target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with ``feature``: the host's features, as numba reads them
    (NUMBA_ENABLE_AVX=0 drops AVX), unless NUMBA_CPU_FEATURES names others."""
    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    return f"+{feature}" in features.split(",")


AVAILABLE = all(_target_has(f) for f in ("avx512f", "avx512bw", "avx512vbmi", "avx512vbmi2", "bmi2"))

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
WORDS, FLOATS, BYTES = ir.VectorType(I32, LANES), ir.VectorType(F32, LANES), ir.VectorType(I8, 4 * LANES)
ONE = 0x3F800000  # the bits of 1.0f
NON_FINITE = 0x7F800000  # magnitude bits from here up: Inf or NaN
SIZE_BITS = np.uint64(2**63 - 1)  # _tags16's result without its NaN/Inf flag


def _words(value: int) -> ir.Constant:
    """``value`` in all 16 lanes."""
    return ir.Constant(WORDS, [value] * LANES)


def _splat(builder: ir.IRBuilder, scalar: ir.Value, vector_type: ir.VectorType) -> ir.Value:
    """``scalar`` in every lane."""
    lane0 = builder.insert_element(ir.Constant(vector_type, None), scalar, ir.Constant(I32, 0))
    return builder.shuffle_vector(lane0, ir.Constant(vector_type, None),
                                  ir.Constant(ir.VectorType(I32, vector_type.count), [0] * vector_type.count))


def _call(builder: ir.IRBuilder, name: str, result: ir.Type, *args: ir.Value) -> ir.Value:
    """A call of the LLVM intrinsic ``name``."""
    signature = ir.FunctionType(result, [a.type for a in args])
    function = cgutils.get_or_insert_function(builder.module, signature, name)
    return builder.call(function, args)


def _element(builder: ir.IRBuilder, data: ir.Value, index: ir.Value, vector_type: ir.Type) -> ir.Value:
    """Pointer to ``vector_type`` at ``data[index]``."""
    return builder.bitcast(builder.gep(data, [index]), vector_type.as_pointer())


def _deposit(builder: ir.IRBuilder, value: ir.Value, mask: int) -> ir.Value:
    """BMI2 ``pdep``: the low bits of ``value`` (i64) moved, in order, to the set bits of ``mask``."""
    return _call(builder, "llvm.x86.bmi.pdep.64", I64, value, ir.Constant(I64, mask))


def _extract(builder: ir.IRBuilder, value: ir.Value, mask: int) -> ir.Value:
    """BMI2 ``pext``: the bits of ``value`` (i32) at the set bits of ``mask``, packed low (i16)."""
    return builder.trunc(_call(builder, "llvm.x86.bmi.pext.32", I32, value, ir.Constant(I32, mask)), I16)


def _byte_mask(builder: ir.IRBuilder, coarse: ir.Value, fine: ir.Value, raw: ir.Value) -> ir.Value:
    """The 64-lane mask keeping the payload bytes of 16 words (bytes 4j..4j+3 are word j's): its first
    byte if |x_j| ≥ ε, its second if |x_j| ≥ 128·ε, its last two if |x_j| ≥ 1 (masks as i16)."""
    def spread(bits: ir.Value, mask: int) -> ir.Value:
        return _deposit(builder, builder.zext(bits, I64), mask)

    both = spread(raw, 0x4444444444444444)
    mask = builder.or_(builder.or_(spread(coarse, 0x1111111111111111), spread(fine, 0x2222222222222222)),
                       builder.or_(both, builder.shl(both, ir.Constant(I64, 1))))
    return builder.bitcast(mask, ir.VectorType(I1, 4 * LANES))


def _count(builder: ir.IRBuilder, mask: ir.Value) -> ir.Value:
    """Number of set lanes of a 16- or 64-lane mask, or set bits of an i16 (i64)."""
    width = ir.IntType(mask.type.count) if isinstance(mask.type, ir.VectorType) else mask.type
    value = builder.bitcast(mask, width) if isinstance(mask.type, ir.VectorType) else mask
    return builder.zext(_call(builder, f"llvm.ctpop.i{width.width}", width, value), I64)


def _bits(builder: ir.IRBuilder, mask: ir.Value) -> ir.Value:
    """A 16-lane mask as an i16 (lane j at bit j)."""
    return builder.bitcast(mask, I16)


def _lanes(builder: ir.IRBuilder, bits: ir.Value) -> ir.Value:
    """An i16 as a 16-lane mask."""
    return builder.bitcast(bits, ir.VectorType(I1, LANES))


def _ranges(builder: ir.IRBuilder, magnitude: ir.Value, eps_bits: ir.Value,
            coarse_bits: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """The masks |x| ≥ ε, |x| ≥ 128·ε, |x| ≥ 1 (magnitude bits compare as the magnitudes do)."""
    return (builder.icmp_unsigned(">=", magnitude, _splat(builder, eps_bits, WORDS)),
            builder.icmp_unsigned(">=", magnitude, _splat(builder, coarse_bits, WORDS)),
            builder.icmp_unsigned(">=", magnitude, _words(ONE)))


@intrinsic
def _tags16(typingctx, bits, tags, i, eps_bits, coarse_bits):  # pragma: no cover - compiled
    """Pass 1 for bits[i:i+16]: their tags into tags[i/4:i/4+4]; returns their payload bytes, plus
    2^63 if one of them is NaN or Inf."""
    signature = types.uint64(bits, tags, i, eps_bits, coarse_bits)

    def codegen(context, builder, sig, args):
        bits_data = context.make_array(sig.args[0])(context, builder, args[0]).data
        tags_data = context.make_array(sig.args[1])(context, builder, args[1]).data
        i = args[2]
        x = builder.load(_element(builder, bits_data, i, WORDS), align=4)
        magnitude = builder.and_(x, _words(0x7FFFFFFF))
        coarse, fine, raw = _ranges(builder, magnitude, args[3], args[4])
        non_finite = _bits(builder, builder.icmp_unsigned(">=", magnitude, _words(NON_FINITE)))
        bad = builder.icmp_unsigned("!=", non_finite, ir.Constant(I16, 0))
        c, f, r = (_bits(builder, mask) for mask in (coarse, fine, raw))
        low_bit = builder.xor(builder.xor(c, f), r)  # tag 1 or 3; the high bit: tag 2 or 3
        packed = builder.trunc(builder.or_(_deposit(builder, builder.zext(low_bit, I64), 0x55555555),
                                           _deposit(builder, builder.zext(f, I64), 0xAAAAAAAA)), I32)
        quarter = builder.lshr(i, ir.Constant(i.type, 2))
        builder.store(packed, _element(builder, tags_data, quarter, I32), align=1)
        total = builder.add(builder.add(_count(builder, c), _count(builder, f)),
                            builder.shl(_count(builder, r), ir.Constant(I64, 1)))
        return builder.or_(total, builder.shl(builder.zext(bad, I64), ir.Constant(I64, 63)))

    return signature, codegen


@intrinsic
def _encode16(typingctx, bits, i, eps_bits, coarse_bits, shift, payload, position):  # pragma: no cover
    """Pass 2 for bits[i:i+16]: their payloads packed at payload[position:], as a 64-byte store (the
    caller leaves 64 bytes of room); returns the payloads' bytes. ``shift``: 15 - k for ε = 2^-k."""
    signature = types.uint64(bits, i, eps_bits, coarse_bits, shift, payload, position)

    def codegen(context, builder, sig, args):
        bits_data = context.make_array(sig.args[0])(context, builder, args[0]).data
        payload_data = context.make_array(sig.args[5])(context, builder, args[5]).data
        x = builder.load(_element(builder, bits_data, args[1], WORDS), align=4)
        magnitude = builder.and_(x, _words(0x7FFFFFFF))
        coarse, fine, raw = _ranges(builder, magnitude, args[2], args[3])
        clamped = builder.bitcast(_call(builder, "llvm.umin.v16i32", WORDS, magnitude, _words(ONE)), FLOATS)
        sign = builder.and_(x, _words(0x80000000))
        fine_code = builder.fptosi(builder.fmul(clamped, ir.Constant(FLOATS, [32768.0] * LANES)), WORDS)
        # ⌊|x|/ε⌋ = ⌊|x|·2^15⌋ >> (15 - k)
        small_code = builder.lshr(fine_code, _splat(builder, args[4], WORDS))
        small = builder.or_(small_code, builder.lshr(sign, _words(24)))
        fine_word = builder.or_(fine_code, builder.lshr(sign, _words(16)))
        word = builder.select(raw, x, builder.select(fine, fine_word, small))
        mask = _byte_mask(builder, *(_bits(builder, m) for m in (coarse, fine, raw)))
        packed = _call(builder, "llvm.experimental.vector.compress.v64i8", BYTES,
                       builder.bitcast(word, BYTES), mask, ir.Constant(BYTES, None))
        builder.store(packed, _element(builder, payload_data, args[6], BYTES), align=1)
        return _count(builder, mask)

    return signature, codegen


def _decoder16(add: bool):  # noqa: ANN202
    """The intrinsic decoding 16 elements: stored as float32 bits, or (``add``) added to float32."""

    @intrinsic
    def decode16(typingctx, tags, i, payload, position, eps, out):  # pragma: no cover - compiled
        """Elements i..i+15 from their tags and the payloads at payload[position:] (reads only those
        bytes) into ``out`` (float32 bits), or added to ``out`` (float32); returns the payloads' bytes."""
        signature = types.uint64(tags, i, payload, position, eps, out)

        def codegen(context, builder, sig, args):
            tags_data = context.make_array(sig.args[0])(context, builder, args[0]).data
            payload_data = context.make_array(sig.args[2])(context, builder, args[2]).data
            out_data = context.make_array(sig.args[5])(context, builder, args[5]).data
            i = args[1]
            quarter = builder.lshr(i, ir.Constant(i.type, 2))
            packed = builder.load(_element(builder, tags_data, quarter, I32), align=1)
            low, high = _extract(builder, packed, 0x55555555), _extract(builder, packed, 0xAAAAAAAA)
            raw_bits = builder.and_(low, high)
            mask = _byte_mask(builder, builder.or_(low, high), high, raw_bits)
            is_raw = _lanes(builder, raw_bits)
            is_small = _lanes(builder, builder.and_(low, builder.not_(high)))
            is_zero = _lanes(builder, builder.not_(builder.or_(low, high)))
            source = builder.gep(payload_data, [args[3]])
            zeros = ir.Constant(BYTES, [0] * 4 * LANES)
            loaded = _call(builder, "llvm.masked.expandload.v64i8", BYTES, source, mask, zeros)
            word = builder.bitcast(loaded, WORDS)  # zero above each payload
            # ±(m + ½)·step: m = the word's low 7 (tag 1, step ε) or 15 (tag 2, step 2^-15) bits
            code = builder.and_(word, builder.select(is_small, _words(0x7F), _words(0x7FFF)))
            step = builder.select(is_small, _splat(builder, args[4], FLOATS),
                                  ir.Constant(FLOATS, [2.0**-15] * LANES))
            half_step = builder.fmul(step, ir.Constant(FLOATS, [0.5] * LANES))
            magnitude = _call(builder, "llvm.fma.v16f32", FLOATS, builder.uitofp(code, FLOATS), step, half_step)
            sign = builder.and_(builder.shl(word, builder.select(is_small, _words(24), _words(16))),
                                _words(0x80000000))
            coded = builder.or_(builder.bitcast(magnitude, WORDS), sign)
            value = builder.select(is_raw, word, builder.select(is_zero, _words(0), coded))
            if add:  # out[i..i+15] += the values (float32)
                target = _element(builder, out_data, i, FLOATS)
                value = builder.fadd(builder.load(target, align=4), builder.bitcast(value, FLOATS))
            else:
                target = _element(builder, out_data, i, WORDS)
            builder.store(value, target, align=4)
            return _count(builder, mask)

        return signature, codegen

    return decode16


_decode16 = _decoder16(False)
_decode16_add = _decoder16(True)


@jit
def encode_tags(bits, eps_bits, coarse_bits, tags):  # pragma: no cover - compiled
    """Pass 1: the packed tags; returns the payload's bytes, or -1 if an element is NaN or Inf."""
    n = bits.size
    full = n - n % LANES
    total = np.uint64(0)
    flags = np.uint64(0)
    for i in range(0, full, LANES):
        result = _tags16(bits, tags, i, eps_bits, coarse_bits)
        total += result & SIZE_BITS
        flags |= result
    if full < n:
        rest = np.zeros(LANES, dtype=np.uint32)  # zero bits: tag 0, no payload
        rest[:n - full] = bits[full:]
        rest_tags = np.zeros(LANES // 4, dtype=np.uint8)
        result = _tags16(rest, rest_tags, 0, eps_bits, coarse_bits)
        total += result & SIZE_BITS
        flags |= result
        tags[full // 4:] = rest_tags[:tags.size - full // 4]
    return -1 if flags >> np.uint64(63) else np.int64(total)


@jit
def encode_payload(bits, eps_bits, coarse_bits, payload):  # pragma: no cover - compiled
    """Pass 2: every element's payload, in order. Where fewer than 64 bytes remain, and for the last
    ``n mod 16`` elements, the chunk goes through a 64-byte scratch."""
    n = bits.size
    shift = np.uint32((eps_bits >> np.uint32(23)) - np.uint32(112))  # 15 - k (ε = 2^-k: exponent 127 - k)
    position = 0
    i = 0
    while i + LANES <= n and position + 4 * LANES <= payload.size:
        position += np.int64(_encode16(bits, i, eps_bits, coarse_bits, shift, payload, position))
        i += LANES
    rest = np.zeros(LANES, dtype=np.uint32)
    scratch = np.empty(4 * LANES, dtype=np.uint8)
    while i < n:
        count = min(LANES, n - i)
        rest[:] = 0
        rest[:count] = bits[i:i + count]
        size = np.int64(_encode16(rest, 0, eps_bits, coarse_bits, shift, scratch, 0))
        payload[position:position + size] = scratch[:size]
        position += size
        i += LANES


@jit
def decode(tags, payload, eps, out_bits):  # pragma: no cover - compiled
    """Every element from its tag and payload; returns the payload bytes the tags call for (the
    caller checks it is all of them). Where fewer than 64 bytes remain, and for the last ``n mod 16``
    elements, the chunk reads a zero-padded copy, so no read passes the payload's end."""
    n = out_bits.size
    position = 0
    i = 0
    while i + LANES <= n and position + 4 * LANES <= payload.size:
        position += np.int64(_decode16(tags, i, payload, position, eps, out_bits))
        i += LANES
    rest = np.empty(LANES, dtype=np.uint32)
    while i < n:
        count = min(LANES, n - i)
        position = _decode_padded(tags, i, count, payload, position, eps, rest)
        out_bits[i:i + count] = rest[:count]
        i += LANES
    return position


@jit
def _decode_padded(tags, i, count, payload, position, eps, rest):  # pragma: no cover - compiled
    """The ``count`` ≤ 16 elements from ``i`` into ``rest``, from zero-padded copies of their tags and of
    the payload from ``position`` (no read past either's end); returns the position after them."""
    rest_tags = np.zeros(LANES // 4, dtype=np.uint8)
    rest_tags[:(count + 3) // 4] = tags[i // 4:(i + count + 3) // 4]
    for k in range(count, LANES):  # unused slots of the last tag byte: tag 0
        rest_tags[k // 4] &= np.uint8(~(3 << (2 * (k % 4))) & 0xFF)
    available = max(0, min(4 * LANES, payload.size - position))
    scratch = np.zeros(4 * LANES, dtype=np.uint8)
    scratch[:available] = payload[position:position + available]
    return position + np.int64(_decode16(rest_tags, 0, scratch, 0, eps, rest))


@jit
def decode_add(tags, payload, eps, total):  # pragma: no cover - compiled
    """total += every element (float32), in the one pass of :func:`decode`; returns the same."""
    n = total.size
    position = 0
    i = 0
    while i + LANES <= n and position + 4 * LANES <= payload.size:
        position += np.int64(_decode16_add(tags, i, payload, position, eps, total))
        i += LANES
    rest = np.empty(LANES, dtype=np.uint32)
    values = rest.view(np.float32)
    while i < n:
        count = min(LANES, n - i)
        position = _decode_padded(tags, i, count, payload, position, eps, rest)
        for k in range(count):
            total[i + k] += values[k]
        i += LANES
    return position
