"""Dithering's numba CPU kernels (:mod:`gradpress.compressors.dither` holds the method, its numerics and
the torch path they match bit for bit).

One pass over the values, or two when a bucket is too large for the cache (the norm's, then the
encoder's), in blocks of BLOCK values: the block's hash words, its bucket segments quantized into byte
codes, which are then packed 8 at a time (:func:`gradpress.kernels.bits.pack_groups`); decoding unpacks the same
way and computes ±scale·level per code. The helpers are inlined (``inline``) and each kernel asks for
the CPU's widest vectors (``wide_vectors``). NaN/Inf: the encoder sees them in each bucket's largest |x|
(computed for the norm anyway) and stops.
"""
from __future__ import annotations

import math

import numpy as np

from gradpress.kernels.bits import pack_groups, unpack_groups
from gradpress.kernels.jit import (
    ADD,
    FINISH,
    FINISH_POW2,
    GOLDEN,
    STORE,
    bits_of_f32,
    bits_of_f64,
    f32_from_bits,
    f64_from_bits,
    fold,
    fold_top,
    fused,
    jit,
    mix32,
    mix32_from,
    mul32,
    wide_vectors,
)

U = np.uint32
CHUNK = 256  # the norm's summation order: a halves tree over each chunk, then over the chunk sums
BLOCK = 2048  # values quantized (and packed) per step of the encoder; a multiple of 8
DECODE_BLOCK = 8192  # values unpacked (and decoded) per step of the decoder; a multiple of 8
NON_FINITE = U(0x7F800000)  # |x| bit patterns from here up are Inf and NaN

STANDARD, NATURAL, BELOW = 0, 1, 2  # how _level rounds (BELOW: natural, every value below the first level)

# the helpers are compiled functions of their own: LLVM inlines the per-element ones (_term, _level,
# _pow2, ...) and calls the others once per chunk of CHUNK values or per block at the finest; numba's own
# IR inlining (inline="always") of them all cost a third more compile time for no speed (compress and
# decompress at 2^20 alike)


@jit
def _pow2(exponent):  # pragma: no cover - compiled
    """2^exponent as float64, exactly, for a normal exponent (-1022..1023)."""
    return f64_from_bits(np.uint64(exponent + 1023) << np.uint64(52))


# -- the norm ------------------------------------------------------------------------------------------------
@jit
def _largest(bits, start, stop):  # pragma: no cover - compiled
    """max |x_i| over [start, stop) as a bit pattern: non-negative floats order like their bits (and this
    vectorizes); a pattern ≥ NON_FINITE is NaN or Inf."""
    largest = U(0)
    for i in range(start, stop):
        largest = max(largest, U(bits[np.uint64(i)] & U(0x7FFFFFFF)))
    return largest


@jit
def _term(bits, i, scale, power):  # pragma: no cover - compiled
    """(|x_i|·scale)^power in float32, x_i given by its bit pattern."""
    a = f32_from_bits(U(bits[np.uint64(i)] & U(0x7FFFFFFF))) * scale
    return a * a if power == 2 else a


@jit
def _tree16(t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15):  # pragma: no cover - compiled
    """Four levels of a halves tree over 16 values: level 1 adds t_q and t_(q+8), level 2 the results q
    and q + 4, level 3 q and q + 2, level 4 q and q + 1."""
    return ((((t0 + t8) + (t4 + t12)) + ((t2 + t10) + (t6 + t14)))
            + (((t1 + t9) + (t5 + t13)) + ((t3 + t11) + (t7 + t15))))


@jit
def _chunk_sum(bits, start, power, scratch):  # pragma: no cover - compiled
    """(∑|x|^power over the CHUNK = 256 values from ``start`` as float64, max |x| as bits).

    The chunk is first scaled by the power of two 2^-e that brings its largest |x| to [1, 4) (e from its
    biased exponent E, clamped to 1..253), which is exact and keeps the float32 terms in range; then a
    halves tree in float32: levels 1-4 for the 16 positions j (values j + 16q, vectorized over j) into
    ``scratch``, levels 5-8 over those; the sum is scaled back by 2^(power·e) in float64 (exactly).
    """
    largest = _largest(bits, start, start + CHUNK)
    biased = min(max(np.int64(largest >> U(23)), 1), 253)
    scale = f32_from_bits(U(U(254 - biased) << U(23)))  # 2^(127 - E)
    for j in range(start, start + 16):
        scratch[j - start] = _tree16(
            _term(bits, j, scale, power), _term(bits, j + 16, scale, power),
            _term(bits, j + 32, scale, power), _term(bits, j + 48, scale, power),
            _term(bits, j + 64, scale, power), _term(bits, j + 80, scale, power),
            _term(bits, j + 96, scale, power), _term(bits, j + 112, scale, power),
            _term(bits, j + 128, scale, power), _term(bits, j + 144, scale, power),
            _term(bits, j + 160, scale, power), _term(bits, j + 176, scale, power),
            _term(bits, j + 192, scale, power), _term(bits, j + 208, scale, power),
            _term(bits, j + 224, scale, power), _term(bits, j + 240, scale, power))
    total = _tree16(scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], scratch[5], scratch[6],
                    scratch[7], scratch[8], scratch[9], scratch[10], scratch[11], scratch[12], scratch[13],
                    scratch[14], scratch[15])
    return np.float64(total) * _pow2(power * (biased - 127)), largest


@jit
def _half_chunk_sum(bits, power, scratch):  # pragma: no cover - compiled
    """:func:`_chunk_sum` of a zero-padded chunk whose values beyond CHUNK/2 are all +0.0: level 1 of the
    tree then adds +0.0 to each term (exactly the term), so it is left out, and the rest is the same."""
    largest = _largest(bits, 0, CHUNK // 2)
    biased = min(max(np.int64(largest >> U(23)), 1), 253)
    scale = f32_from_bits(U(U(254 - biased) << U(23)))  # 2^(127 - E)
    for j in range(16):  # _tree16 without its level 1 (t_(q+8) = 0): ((t0+t4)+(t2+t6)) + ((t1+t5)+(t3+t7))
        scratch[j] = (((_term(bits, j, scale, power) + _term(bits, j + 64, scale, power))
                       + (_term(bits, j + 32, scale, power) + _term(bits, j + 96, scale, power)))
                      + ((_term(bits, j + 16, scale, power) + _term(bits, j + 80, scale, power))
                         + (_term(bits, j + 48, scale, power) + _term(bits, j + 112, scale, power))))
    total = _tree16(scratch[0], scratch[1], scratch[2], scratch[3], scratch[4], scratch[5], scratch[6],
                    scratch[7], scratch[8], scratch[9], scratch[10], scratch[11], scratch[12], scratch[13],
                    scratch[14], scratch[15])
    return np.float64(total) * _pow2(power * (biased - 127)), largest


@jit
def _bucket_norm(bits, start, stop, power, sums, scratch):  # pragma: no cover - compiled
    """(‖x[start:stop]‖_p as float32, max |x| as bits) (power 0: the max norm, exact). For p = 1, 2: a
    halves tree over each chunk of CHUNK values (the last zero-padded), then one over the chunk sums
    zero-padded to a power of two (adding +0.0 changes nothing, so those adds are skipped); ``sums``
    holds at least the chunk count, ``scratch`` is :func:`_norm_scratch`'s."""
    if power == 0:
        largest = _largest(bits, start, stop)
        return f32_from_bits(largest), largest
    full = (stop - start) // CHUNK
    largest = U(0)
    for c in range(full):
        sums[c], chunk_largest = _chunk_sum(bits, start + c * CHUNK, power, scratch)
        largest = max(largest, chunk_largest)
    count = full
    if start + full * CHUNK < stop:  # the partial last chunk, zero-padded
        last = start + full * CHUNK
        padded = scratch[16:16 + CHUNK].view(np.uint32)
        length = stop - last
        for i in range(length):
            padded[np.uint64(i)] = bits[np.uint64(last + i)]
        dirty = np.int64(scratch[16 + CHUNK])  # beyond this, padded holds zeros from an earlier call
        for i in range(length, dirty):
            padded[np.uint64(i)] = U(0)
        scratch[16 + CHUNK] = np.float32(length)
        if length <= CHUNK // 2:
            sums[full], chunk_largest = _half_chunk_sum(padded, power, scratch)
        else:
            sums[full], chunk_largest = _chunk_sum(padded, 0, power, scratch)
        largest = max(largest, chunk_largest)
        count += 1
    size = 1
    while size < count:
        size *= 2
    while size > 1:
        size //= 2
        for j in range(size):
            if j + size < count:
                sums[j] = sums[j] + sums[j + size]
        count = min(count, size)
    return np.float32(sums[0] if power == 1 else math.sqrt(sums[0])), largest


@jit
def _norm_scratch(bucket):  # pragma: no cover - compiled
    """``sums`` (a bucket's chunk sums) and ``scratch`` (16 positions, then a padded chunk's bits, then
    how many of those may be non-zero: the padding is zeroed only where an earlier chunk wrote)."""
    return np.zeros(-(-bucket // CHUNK)), np.zeros(16 + CHUNK + 1, dtype=np.float32)


@jit
def _bucket_norms_numba(x, power, bucket, out):  # pragma: no cover - compiled
    bits = x.view(np.uint32)
    sums, scratch = _norm_scratch(bucket)
    for b in range(out.size):
        out[b] = _bucket_norm(bits, b * bucket, min(x.size, (b + 1) * bucket), power, sums, scratch)[0]


# -- quantizing ----------------------------------------------------------------------------------------------
@jit
def _split_scale(norm, c):  # pragma: no cover - compiled
    """:func:`~gradpress.compressors.dither.bucket_scales` for one bucket, on the float64 bits of c/ν
    (normal: ν ≥ 2^-149, c < 2^31)."""
    if not 0 < norm < np.inf:
        return np.float32(1.0), np.float32(0.0)
    scale = c / np.float64(norm)
    exponent = min(max(np.int64(bits_of_f64(scale) >> np.uint64(52)) - 1023, -126), 127)
    return np.float32(_pow2(exponent)), np.float32(scale * _pow2(-exponent))


@jit
def _level_constants(levels, natural):  # pragma: no cover - compiled
    """What :func:`_level` needs besides the bucket's (P, S): the clamp (s·2^24 standard, 1 natural),
    the bit pattern of 2^(1-s), the exponent-to-level shift and
    :func:`~gradpress.compressors.dither._below_factors`."""
    lift = max(0, levels - 104)
    top = np.float32(1.0) if natural else np.float32(levels * 2.0**24)
    low = U(U(128 - levels) << U(23))
    return top, low, U(levels - 127), np.float32(2.0 ** (levels + 23 - lift)), U(lift)


@jit
def _level(w, p, s, partition, constants):  # pragma: no cover - compiled
    """(k, F) for the float32 bit pattern ``w``: ξ rounds |x|/ν up from level k to the next with
    probability F·2^-24 (F < 2^24).

    STANDARD: t = min(fl32(fl32(|x|·P)·S), s·2^24) = (k + F·2^-24)·2^24. NATURAL: y = min(fl32(|x|·P·S),
    1); at or above 2^(1-s), y = 2^e (1 + m·2^-23) lies between the levels 2^e (k = s + e) and 2^(e+1),
    F = 2m (the C_nat step); below, between 0 (k = 0) and 2^(1-s), F = ⌊y·2^(s+23)⌋ (via
    :func:`~gradpress.compressors.dither._below_factors`). BELOW: the same for a bucket whose every y is
    below 2^(1-s) (its largest |x| shows it: large buckets, ν ≫ max |x|), without the other case's work.
    """
    top, low, shift, scale, lift = constants
    magnitude = f32_from_bits(U(w & U(0x7FFFFFFF))) * p * s
    if partition == STANDARD:
        t = U(min(magnitude, top))
        return U(t >> U(24)), U(t & U(0xFFFFFF))
    if partition == BELOW:  # magnitude < 2^(1-s): magnitude·scale < 2^24
        return U(0), U(U(magnitude * scale) << lift)
    y = bits_of_f32(min(magnitude, top))
    inside = y >= low
    k = U(U(y >> U(23)) + shift) if inside else U(0)
    below = U(U(min(f32_from_bits(y) * scale, np.float32(2.0**24))) << lift)  # (clamped where inside)
    f = U(U(y & U(0x7FFFFF)) << U(1)) if inside else below
    return k, f


@jit
def _all_below(largest, p, s, constants):  # pragma: no cover - compiled
    """Whether a bucket whose largest |x| has bit pattern ``largest`` has every y below 2^(1-s)."""
    top, low = constants[0], constants[1]
    return bits_of_f32(min(f32_from_bits(largest) * p * s, top)) < low


@jit
def _quantize(bits, start, stop, p, s, partition, constants, u16, codes, base):  # pragma: no cover - compiled
    """Codes 2(k + up) + sign of x[start:stop] (at ``codes[i - base]``), up iff the element's 16-bit
    uniform u is below F's top 16 bits. Returns whether some u equalled them: :func:`_settle_ties`
    then decides those."""
    closest = U(1)
    for i in range(start, stop):
        w = bits[np.uint64(i)]
        k, f = _level(w, p, s, partition, constants)
        gap = U(U(u16[np.uint64(i - base)]) - U(f >> U(8)))  # ≥ 2^31 iff u < F / 2^8 (both < 2^16); 0: a tie
        closest = min(closest, gap)
        codes[np.uint64(i - base)] = np.uint8(U(U(U(k + U(gap >> U(31))) << U(1)) | U(w >> U(31))))
    return closest == U(0)


@jit
def _settle_ties(bits, start, stop, p, s, partition, constants, u16, codes, base, tie_seed):  # pragma: no cover - compiled
    """Where u equals F's top 16 bits (probability 2^-16), round up iff the top 8 bits of the hash of i
    under ``tie_seed`` are below F's low 8 bits: P(up) = F·2^-24 exactly."""
    for i in range(start, stop):
        w = bits[i]
        k, f = _level(w, p, s, partition, constants)
        if U(u16[i - base]) == U(f >> U(8)):
            up = U(U(mix32(i, tie_seed) >> U(24)) < U(f & U(0xFF)))
            codes[i - base] = np.uint8(U(U(U(k + up) << U(1)) | U(w >> U(31))))


@jit
def _hash_words(first, count, seed, words):  # pragma: no cover - compiled
    """words[j] = mix32(first + j, seed): two 16-bit uniforms each (element i's: half i & 1 of word
    i >> 1), the index's multiply by GOLDEN carried along (:func:`mix32_from`)."""
    h = mul32(U(first), GOLDEN)
    for j in range(count):
        words[j] = mix32_from(h, seed)
        h = U(h + GOLDEN)


# -- the kernels ---------------------------------------------------------------------------------------------
@jit
def _encode_numba(x, power, cap, bucket, levels, natural, seed, tie_seed, code_bits, out, norms):  # pragma: no cover - compiled
    """Quantize and pack ``x`` block by block: a block's hash words, then its values bucket segment by
    bucket segment, then its codes. Each bucket's norm (capped at ``cap``) is computed into ``norms``
    just before its first values are quantized, so a small bucket is read from cache. Returns False, at
    once, if a bucket holds NaN or Inf (its largest |x| shows it)."""
    wide_vectors()
    n = x.size
    bits = x.view(np.uint32)
    sums, scratch = _norm_scratch(bucket)
    codes = np.zeros(BLOCK // 8, dtype=np.uint64)  # a block's codes, 8 per word
    codes8 = codes.view(np.uint8)
    words = np.empty(BLOCK // 2, dtype=np.uint32)  # a block's hash words
    u16 = words.view(np.uint16)
    packed = np.empty(BLOCK // 8, dtype=np.uint64)
    c = 1.0 if natural else levels * 2.0**24
    constants = _level_constants(levels, natural)
    done, largest = -1, U(0)  # the last bucket whose norm is known, its largest |x|
    for start in range(0, n, BLOCK):
        stop = min(n, start + BLOCK)
        if stop - start < BLOCK:
            codes[:] = 0
        _hash_words(start >> 1, (stop - start + 1) >> 1, seed, words)
        i, b = start, start // bucket
        while i < stop:
            end = min(stop, (b + 1) * bucket)
            if b > done:
                norm, largest = _bucket_norm(bits, b * bucket, min(n, (b + 1) * bucket), power, sums, scratch)
                if largest >= NON_FINITE:
                    return False
                norms[b] = min(norm, cap)
                done = b
            p, s = _split_scale(norms[b], c)
            # each call with a constant partition, so that _level's other branches compile away
            if not natural:
                if _quantize(bits, i, end, p, s, STANDARD, constants, u16, codes8, start):
                    _settle_ties(bits, i, end, p, s, STANDARD, constants, u16, codes8, start, tie_seed)
            elif _all_below(largest, p, s, constants):
                if _quantize(bits, i, end, p, s, BELOW, constants, u16, codes8, start):
                    _settle_ties(bits, i, end, p, s, BELOW, constants, u16, codes8, start, tie_seed)
            elif _quantize(bits, i, end, p, s, NATURAL, constants, u16, codes8, start):
                _settle_ties(bits, i, end, p, s, NATURAL, constants, u16, codes8, start, tie_seed)
            i, b = end, b + 1
        pack_groups(codes, (stop - start + 7) // 8, code_bits, packed, out, start * code_bits // 8)
    return True


DECODE = -1  # _decode_segment's mode that stores the decoded values as they are (decompress)


@jit
def _decode_segment(codes, base, start, stop, scale, norm, levels, natural, mode, count, reciprocal,
                    out):  # pragma: no cover - compiled
    """±min(fl32(scale · k), ν) (standard, scale = fl32(ν/s): ν·k/s ≤ ν, which a scale rounded up would
    pass, to Inf for ν near float32's largest) or ±ν·2^(k-s) (natural, scale = ν) per code, stored into
    ``out`` (``mode`` :data:`DECODE`) or folded into it in float32 (:func:`gradpress.kernels.jit.fold`);
    the largest exponent field stored when finishing."""
    largest = np.int32(0)
    for i in range(start, stop):
        c = U(codes[np.uint64(i - base)])
        k = U(c >> U(1))
        if natural:  # (the sign or-ed into the bits, which measured faster here, slower below)
            level = f32_from_bits(U(U(k + U(127 - levels)) << U(23))) if k != U(0) else np.float32(0.0)
            value = f32_from_bits(U(bits_of_f32(scale * level) | U(c << U(31))))
        else:  # float32(k), exactly, in 32-bit lanes (2^23 + k has k as its mantissa)
            magnitude = min(scale * (f32_from_bits(U(k | U(0x4B000000))) - np.float32(2.0**23)), norm)
            value = -magnitude if c & U(1) else magnitude
        if mode == DECODE:
            out[np.uint64(i)] = value
        else:
            v = fold(out[np.uint64(i)], value, mode, count, reciprocal)
            out[np.uint64(i)] = v
            largest = fold_top(largest, mode, v)
    return largest


@jit
def _decode_blocks(packed, norms, bucket, levels, natural, code_bits, mode, count,
                   out):  # pragma: no cover - compiled
    """Unpack and decode block by block, bucket segment by bucket segment (:func:`_decode_segment`)."""
    n = out.size
    codes = np.empty(DECODE_BLOCK // 8, dtype=np.uint64)
    codes8 = codes.view(np.uint8)
    scales = norms if natural else np.empty(norms.size, dtype=np.float32)
    c, r = np.float32(count), np.float32(1.0 / max(count, 1))
    largest = np.int32(0)
    if not natural:
        for b in range(norms.size):  # fl32(ν/s), as the torch path has it
            scales[b] = np.float32(np.float64(norms[b]) / levels)
    for start in range(0, n, DECODE_BLOCK):
        stop = min(n, start + DECODE_BLOCK)
        unpack_groups(packed, start * code_bits // 8, (stop - start + 7) // 8, code_bits, codes)
        i, b = start, start // bucket
        while i < stop:
            end = min(stop, (b + 1) * bucket)
            # each call with constant flags, so that _decode_segment's other branches compile away
            if natural:
                top = _decode_segment(codes8, start, i, end, scales[b], norms[b], levels, True, mode, c, r,
                                      out)
            else:
                top = _decode_segment(codes8, start, i, end, scales[b], norms[b], levels, False, mode, c, r,
                                      out)
            largest = max(largest, top)
            i, b = end, b + 1
    return largest


@jit
def _decode_numba(packed, norms, bucket, levels, natural, code_bits, out):  # pragma: no cover - compiled
    """``out`` = the decoded values (:func:`_decode_blocks`)."""
    wide_vectors()
    _decode_blocks(packed, norms, bucket, levels, natural, code_bits, DECODE, 0, out)


@fused
def _decode_add_numba(packed, norms, bucket, levels, natural, code_bits, total, mode,
                      count):  # pragma: no cover - compiled
    """``total += decode(packed)`` in float32, in one pass (an all-gather's sum: no decoded temporary per
    worker; the same bits as adding :func:`_decode_numba`'s output), or another
    :data:`gradpress.kernels.jit.ADD` mode; the largest exponent field stored when finishing."""
    wide_vectors()
    if mode == STORE:
        return _decode_blocks(packed, norms, bucket, levels, natural, code_bits, STORE, count, total)
    if mode == FINISH:
        return _decode_blocks(packed, norms, bucket, levels, natural, code_bits, FINISH, count, total)
    if mode == FINISH_POW2:
        return _decode_blocks(packed, norms, bucket, levels, natural, code_bits, FINISH_POW2, count, total)
    return _decode_blocks(packed, norms, bucket, levels, natural, code_bits, ADD, count, total)
