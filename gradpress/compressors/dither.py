"""General dithering (Horváth et al., *Natural Compression*, Def. 3) and the quantizers built on it:
``dither`` (natural or standard dithering, Def. 3 / Thm 4 / Thm 5), ``qsgd`` (Alistarh et al., as GRACE
Section 3.1 describes it: standard dithering D_sta^{2,s}) and ``terngrad`` (Wen et al.: D_sta^{∞,1}).

One mechanism, :class:`Dithering`: split the tensor into buckets of ``bucket`` values (the whole tensor
when 0); for each, y_i = |x_i| / ‖x‖_p, and ξ(y_i) rounds y_i at random to one of its two neighbouring
levels 0 = l_s < … < l_0 = 1 so that E[ξ(y_i)] = y_i; the receiver decodes ‖x‖_p · sign(x_i) · ξ(y_i).
Standard partition: l = k/s; natural partition: l = 2^(k-s) for k = 1..s, and 0 (Def. 3; Fig. 3).
C(‖x‖_p) may be natural compression (``natural_norm``), as Def. 3 allows and App. B uses for in-network
aggregation; it is independent of ξ, so the estimate stays unbiased with second moment ×9/8 (Thm 3).

Wire: ``codes`` — one packed stream of 1 + ⌈log2(s+1)⌉ bits per value in :mod:`gradpress.bits`' layout,
each 2k + sign (the sign in bit 0, the level number k ∈ 0..s above it) — and ``norms``: one float32 per
bucket, or natural compression's 1 byte per bucket + 1 header byte.

Numerics, the same bits on the numba and torch paths: ‖x‖_p sums |x_i|^p in float64 in a fixed order (a
halves tree over chunks of 256 values, then over a bucket's chunk sums) and is sent as float32 ν; the
encoder scales by that ν, splitting c/ν (c = s·2^24, or 1 for the natural partition) into float32 factors
P = 2^k and S so that t_i = fl32(fl32(|x_i|·P)·S) stays finite for any ν, and clamps t_i to the top level
(which is also TernGrad's clipping). Each value then lies between two levels and rounds up with
probability F·2^-24, F a 24-bit integer. Standard: k = ⌊t⌋ >> 24 and F = t's 24 fraction bits. Natural: at
or above 2^(1-s), y = 2^e (1 + m·2^-23) rounds up to 2^(e+1) with F = 2m (C_nat itself); below, to
2^(1-s) with F = ⌊y·2^(s+23)⌋. Probabilities are exact to 2^-24 of a level gap.

Randomness, from the counter hash of :mod:`gradpress.rng` under the rank's private seed: one 32-bit hash
word serves two values, element i taking half i & 1 of mix32(i >> 1) as a 16-bit uniform u. The value
rounds up iff u < ⌊F / 2^8⌋, or, when u = ⌊F / 2^8⌋ (probability 2^-16), iff the top 8 bits of a second
hash of i under a tie seed are below F mod 2^8: P(up) = ⌊F/2^8⌋·2^-16 + 2^-16·(F mod 2^8)·2^-8 = F·2^-24,
exactly as with a 24-bit uniform, for half the hashing (the encoder's largest cost). Decoding:
fl32(fl32(ν/s)·k), or fl32(ν·2^(k-s)).

The numba kernels (CPU) make one pass over the values, or two when a bucket is too large for the cache
(the norm's, then the encoder's), in blocks of BLOCK values: the block's hash words, its bucket
segments quantized into byte codes, which are then packed 8 at a time (SWAR: shifts and masks in
64-bit words); decoding unpacks the same way and computes ±scale·level per code. The helpers are
inlined (``inline``) and each kernel asks for the CPU's widest vectors (``wide_vectors``). NaN/Inf: the
encoder sees them in each bucket's largest |x| (computed for the norm anyway) and stops; the
compressors raise NonFiniteError then, so they skip the base class's separate check pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from gradpress._numba import (GOLDEN, as_numpy, bits_of_f32, bits_of_f64, f32_from_bits, f64_from_bits, jit, mix32,
                              mix32_from, mul32, use_numba, wide_vectors)
from gradpress.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.compressor import Compressor, check_finite, register
from gradpress.compressors.natural import Natural
from gradpress.compressors.onebit import fixed_point_scale, mean_of, to_fixed
from gradpress.packet import Packet
from gradpress.registry import param
from gradpress.rng import Context, mix32_torch, seed32

U = np.uint32
Norm = Literal["1", "2", "inf"]
Partition = Literal["natural", "standard"]
CHUNK = 256  # the norm's summation order: a halves tree over each chunk, then over the chunk sums
BLOCK = 2048  # values quantized (and packed) per step of the encoder; a multiple of 8
DECODE_BLOCK = 8192  # values unpacked (and decoded) per step of the decoder; a multiple of 8
NON_FINITE = U(0x7F800000)  # |x| bit patterns from here up are Inf and NaN

STANDARD, NATURAL, BELOW = 0, 1, 2  # how _level rounds (BELOW: natural, every value below the first level)

# helpers inlined into the kernels (a call per bucket would cost more than its work: reference counts)
inline = njit(cache=True, nogil=True, inline="always")


# -- unaligned words (numba) ----------------------------------------------------------------------------------
def _byte_pointer(context, builder, array_type, array, offset):  # pragma: no cover - compiled
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [offset]), ir.IntType(64).as_pointer())


@intrinsic
def _load64(typingctx, array, offset):  # pragma: no cover - compiled
    """The 8 bytes of a uint8 array at byte ``offset`` as a uint64 (any alignment; numba's hosts are all
    little-endian, the layout of :mod:`gradpress.bits`)."""
    sig = types.uint64(array, types.intp)

    def codegen(context, builder, signature, args):
        return builder.load(_byte_pointer(context, builder, signature.args[0], args[0], args[1]), align=1)

    return sig, codegen


@intrinsic
def _store64(typingctx, array, offset, value):  # pragma: no cover - compiled
    """Write ``value`` as 8 (little-endian) bytes at byte ``offset`` of a uint8 array (any alignment)."""
    sig = types.void(array, types.intp, types.uint64)

    def codegen(context, builder, signature, args):
        builder.store(args[2], _byte_pointer(context, builder, signature.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()

    return sig, codegen


@inline
def _pow2(exponent):  # pragma: no cover - compiled
    """2^exponent as float64, exactly, for a normal exponent (-1022..1023)."""
    return f64_from_bits(np.uint64(exponent + 1023) << np.uint64(52))


# -- the norm ------------------------------------------------------------------------------------------------
def _halves(sums: torch.Tensor) -> torch.Tensor:
    """Sum the last dimension (zero-padded to a power of two) by adding its halves until one is left."""
    width = 1 << max(0, (sums.shape[-1] - 1).bit_length())
    sums = torch.nn.functional.pad(sums, (0, width - sums.shape[-1]))
    while sums.shape[-1] > 1:
        half = sums.shape[-1] // 2
        sums = sums[..., :half] + sums[..., half:]
    return sums[..., 0]


def _power_sums_torch(x: torch.Tensor, power: int, bucket: int) -> torch.Tensor:
    """∑|x_i|^power per bucket in float64, in the order of :func:`_bucket_norm`."""
    full = x.numel() // bucket * bucket
    rows = [x[:full].view(-1, bucket)] if full else []
    if full < x.numel():
        rows.append(x[full:].view(1, -1))
    sums = []
    for row in rows:
        chunks = -(-row.shape[1] // CHUNK)
        padded = torch.nn.functional.pad(row, (0, chunks * CHUNK - row.shape[1])).view(row.shape[0], chunks, CHUNK)
        largest = padded.abs().amax(dim=2, keepdim=True).view(torch.int32) >> 23
        exponent = largest.clamp(1, 253) - 127  # the chunk is scaled by 2^-exponent (exactly)
        terms = padded.abs() * torch.ldexp(torch.ones_like(padded[..., :1]), -exponent)
        if power == 2:
            terms = terms * terms
        chunk_sums = torch.ldexp(_halves(terms).double(), power * exponent[..., 0])
        sums.append(_halves(chunk_sums))
    return torch.cat(sums)


@inline
def _largest(bits, start, stop):  # pragma: no cover - compiled
    """max |x_i| over [start, stop) as a bit pattern: non-negative floats order like their bits (and this
    vectorizes); a pattern ≥ NON_FINITE is NaN or Inf."""
    largest = U(0)
    for i in range(start, stop):
        largest = max(largest, U(bits[np.uint64(i)] & U(0x7FFFFFFF)))
    return largest


@inline
def _term(bits, i, scale, power):  # pragma: no cover - compiled
    """(|x_i|·scale)^power in float32, x_i given by its bit pattern."""
    a = f32_from_bits(U(bits[np.uint64(i)] & U(0x7FFFFFFF))) * scale
    return a * a if power == 2 else a


@inline
def _tree16(t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12, t13, t14, t15):  # pragma: no cover - compiled
    """Four levels of a halves tree over 16 values: level 1 adds t_q and t_(q+8), level 2 the results q
    and q + 4, level 3 q and q + 2, level 4 q and q + 1."""
    return ((((t0 + t8) + (t4 + t12)) + ((t2 + t10) + (t6 + t14)))
            + (((t1 + t9) + (t5 + t13)) + ((t3 + t11) + (t7 + t15))))


@inline
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


@inline
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


@inline
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


@inline
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


def _power(norm: str) -> int:
    return 0 if norm == "inf" else int(norm)


def bucket_norms(x: torch.Tensor, norm: str, bucket: int) -> torch.Tensor:
    """‖x‖_p of each bucket of float32 ``x`` as float32 (see the module doc for the summation order)."""
    if use_numba(x):
        norms = torch.empty(-(-x.numel() // bucket), dtype=torch.float32)
        _bucket_norms_numba(as_numpy(x), _power(norm), bucket, as_numpy(norms))
    elif norm == "inf":
        full = x.numel() // bucket * bucket
        parts = [x[:full].view(-1, bucket).abs().amax(dim=1)] if full else []
        if full < x.numel():
            parts.append(x[full:].abs().amax().view(1))
        norms = torch.cat(parts)
    else:
        sums = _power_sums_torch(x, int(norm), bucket)
        norms = (sums if norm == "1" else sums.sqrt()).float()
    _check_norms(norms, norm)
    return norms


def _check_norms(norms: torch.Tensor, norm: str) -> None:
    if not bool(torch.isfinite(norms).all()):
        raise OverflowError(f"dither: a bucket's L{norm} norm exceeds the float32 range")


# -- quantizing ----------------------------------------------------------------------------------------------
def bucket_scales(norms: torch.Tensor, levels: int, natural: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per bucket, float32 factors (P, S) with y·s·2^24 (standard) or y (natural) = fl32(fl32(|x|·P)·S).

    The scale c/ν (c = s·2^24 or 1) is split into P = 2^k, a normal float32, and S = c/ν/2^k ∈ [1, 2)
    where possible, so it stays finite in float32 even for tiny norms; |x|·P is exact. A zero norm
    gives P = 1, S = 0.
    """
    scale = torch.where(norms > 0, (1.0 if natural else levels * 2.0**24) / norms.double(), 0.0)
    exponent = torch.frexp(scale).exponent.long().sub(1).clamp(-126, 127)
    exponent = torch.where(scale > 0, exponent, 0)
    return torch.ldexp(torch.ones_like(scale), exponent).float(), torch.ldexp(scale, -exponent).float()


@inline
def _split_scale(norm, c):  # pragma: no cover - compiled
    """:func:`bucket_scales` for one bucket, on the float64 bits of c/ν (normal: ν ≥ 2^-149, c < 2^31)."""
    if not 0 < norm < np.inf:
        return np.float32(1.0), np.float32(0.0)
    scale = c / np.float64(norm)
    exponent = min(max(np.int64(bits_of_f64(scale) >> np.uint64(52)) - 1023, -126), 127)
    return np.float32(_pow2(exponent)), np.float32(scale * _pow2(-exponent))


def _below_factors(levels: int) -> tuple[float, int]:
    """(scale, lift) with ⌊y·scale⌋·2^lift = ⌊y·2^(s+23)⌋ for y < 2^(1-s): one float32 multiply (for
    s > 104, where 2^(s+23) exceeds float32, lift = s - 104 drops the probability's last bits)."""
    lift = max(0, levels - 104)
    return 2.0 ** (levels + 23 - lift), lift


@inline
def _level_constants(levels, natural):  # pragma: no cover - compiled
    """What :func:`_level` needs besides the bucket's (P, S): the clamp (s·2^24 standard, 1 natural),
    the bit pattern of 2^(1-s), the exponent-to-level shift and :func:`_below_factors`."""
    lift = max(0, levels - 104)
    top = np.float32(1.0) if natural else np.float32(levels * 2.0**24)
    low = U(U(128 - levels) << U(23))
    return top, low, U(levels - 127), np.float32(2.0 ** (levels + 23 - lift)), U(lift)


@inline
def _level(w, p, s, partition, constants):  # pragma: no cover - compiled
    """(k, F) for the float32 bit pattern ``w``: ξ rounds |x|/ν up from level k to the next with
    probability F·2^-24 (F < 2^24).

    STANDARD: t = min(fl32(fl32(|x|·P)·S), s·2^24) = (k + F·2^-24)·2^24. NATURAL: y = min(fl32(|x|·P·S),
    1); at or above 2^(1-s), y = 2^e (1 + m·2^-23) lies between the levels 2^e (k = s + e) and 2^(e+1),
    F = 2m (the C_nat step); below, between 0 (k = 0) and 2^(1-s), F = ⌊y·2^(s+23)⌋ (via
    :func:`_below_factors`). BELOW: the same for a bucket whose every y is below 2^(1-s) (its largest
    |x| shows it: large buckets, ν ≫ max |x|), without the other case's work.
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


@inline
def _all_below(largest, p, s, constants):  # pragma: no cover - compiled
    """Whether a bucket whose largest |x| has bit pattern ``largest`` has every y below 2^(1-s)."""
    top, low = constants[0], constants[1]
    return bits_of_f32(min(f32_from_bits(largest) * p * s, top)) < low


@inline
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


@inline
def _settle_ties(bits, start, stop, p, s, partition, constants, u16, codes, base, tie_seed):  # pragma: no cover - compiled
    """Where u equals F's top 16 bits (probability 2^-16), round up iff the top 8 bits of the hash of i
    under ``tie_seed`` are below F's low 8 bits: P(up) = F·2^-24 exactly."""
    for i in range(start, stop):
        w = bits[i]
        k, f = _level(w, p, s, partition, constants)
        if U(u16[i - base]) == U(f >> U(8)):
            up = U(U(mix32(i, tie_seed) >> U(24)) < U(f & U(0xFF)))
            codes[i - base] = np.uint8(U(U(U(k + up) << U(1)) | U(w >> U(31))))


@inline
def _hash_words(first, count, seed, words):  # pragma: no cover - compiled
    """words[j] = mix32(first + j, seed): two 16-bit uniforms each (element i's: half i & 1 of word
    i >> 1), the index's multiply by GOLDEN carried along (:func:`mix32_from`)."""
    h = mul32(U(first), GOLDEN)
    for j in range(count):
        words[j] = mix32_from(h, seed)
        h = U(h + GOLDEN)


# -- bit packing (8 codes per uint64 word, gradpress.bits' layout) -------------------------------------------
@inline
def _squeeze(v, bits):  # pragma: no cover - compiled
    """Eight bytes (codes < 2^bits) → the low 8·bits bits, code j at bits [j·bits, (j+1)·bits)."""
    b = np.uint64(bits)
    ones, pairs = np.uint64(0x00FF00FF00FF00FF), np.uint64(0x0000FFFF0000FFFF)  # every other byte, 16-bit lane
    v = (v & ones) | (((v >> np.uint64(8)) & ones) << b)  # codes 2m, 2m + 1 side by side in 16-bit lane m
    v = (v & pairs) | (((v >> np.uint64(16)) & pairs) << (b + b))  # four codes per 32-bit lane
    return (v & np.uint64(0xFFFFFFFF)) | ((v >> np.uint64(32)) << (np.uint64(4) * b))


@inline
def _spread(v, bits):  # pragma: no cover - compiled
    """Inverse of :func:`_squeeze` (bits above 8·bits ignored)."""
    b = np.uint64(bits)
    if bits < 8:
        v &= (np.uint64(1) << (np.uint64(8) * b)) - np.uint64(1)
    quad = (np.uint64(1) << (np.uint64(4) * b)) - np.uint64(1)
    v = (v & quad) | ((v >> (np.uint64(4) * b)) << np.uint64(32))
    pair = np.uint64(0x0000000100000001) * ((np.uint64(1) << (b + b)) - np.uint64(1))
    v = (v & pair) | (((v >> (b + b)) & pair) << np.uint64(16))
    one = np.uint64(0x0001000100010001) * ((np.uint64(1) << b) - np.uint64(1))
    return (v & one) | (((v >> b) & one) << np.uint64(8))


@inline
def _pack(codes, groups, bits, words, out, offset):  # pragma: no cover - compiled
    """Pack ``groups`` groups of 8 codes (``codes`` as uint64: code j of a group in byte j) at byte
    ``offset`` of ``out`` in :func:`gradpress.bits.pack_bits`' layout: a group's code j at bits
    [j·bits, (j+1)·bits) of its ``bits`` bytes. ``words`` is scratch for the packed groups."""
    for g in range(groups):  # vectorized over groups
        words[g] = _squeeze(codes[g], bits)
    if bits == 2 or bits == 4:  # whole 16- or 32-bit words: vectorized stores
        whole = min(groups, (out.size - offset) // bits)
        if bits == 2:
            _narrow_stores(out[offset:offset + 2 * whole].view(np.uint16), words, whole)
        else:
            _narrow_stores(out[offset:offset + 4 * whole].view(np.uint32), words, whole)
    else:  # one 8-byte store each; the next group overwrites the top 8 - bits bytes
        whole = max(0, min(groups, (out.size - offset - 8) // bits + 1))  # groups with 8 bytes of room
        for g in range(whole):
            _store64(out, offset + g * bits, words[g])
    for g in range(whole, groups):
        at = offset + g * bits
        for q in range(min(bits, out.size - at)):
            out[at + q] = np.uint8(words[g] >> np.uint64(8 * q))


@inline
def _narrow_stores(out, words, count):  # pragma: no cover - compiled
    for g in range(count):
        out[g] = words[g]


@inline
def _unpack(packed, offset, groups, bits, codes):  # pragma: no cover - compiled
    """Inverse of :func:`_pack`, into ``codes`` (uint64 words of 8 byte codes)."""
    if bits == 2 or bits == 4:  # whole 16- or 32-bit words: vectorized loads
        whole = min(groups, (packed.size - offset) // bits)
        if bits == 2:
            _wide_loads(packed[offset:offset + 2 * whole].view(np.uint16), codes, whole)
        else:
            _wide_loads(packed[offset:offset + 4 * whole].view(np.uint32), codes, whole)
    else:  # one 8-byte load each
        whole = max(0, min(groups, (packed.size - offset - 8) // bits + 1))
        for g in range(whole):
            codes[g] = _load64(packed, offset + g * bits)
    for g in range(whole, groups):
        at = offset + g * bits
        word = np.uint64(0)
        for q in range(min(bits, packed.size - at)):
            word |= np.uint64(packed[at + q]) << np.uint64(8 * q)
        codes[g] = word
    for g in range(groups):  # vectorized over groups
        codes[g] = _spread(codes[g], bits)


@inline
def _wide_loads(packed, codes, count):  # pragma: no cover - compiled
    for g in range(count):
        codes[g] = np.uint64(packed[g])


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
        _pack(codes, (stop - start + 7) // 8, code_bits, packed, out, start * code_bits // 8)
    return True


@inline
def _decode_segment(codes, base, start, stop, scale, levels, natural, out):  # pragma: no cover - compiled
    """±fl32(scale · k) (standard, scale = fl32(ν/s)) or ±ν·2^(k-s) (natural, scale = ν) per code."""
    for i in range(start, stop):
        c = U(codes[np.uint64(i - base)])
        k = U(c >> U(1))
        if natural:  # (the sign or-ed into the bits, which measured faster here, slower below)
            level = f32_from_bits(U(U(k + U(127 - levels)) << U(23))) if k != U(0) else np.float32(0.0)
            out[np.uint64(i)] = f32_from_bits(U(bits_of_f32(scale * level) | U(c << U(31))))
        else:  # float32(k), exactly, in 32-bit lanes (2^23 + k has k as its mantissa)
            value = scale * (f32_from_bits(U(k | U(0x4B000000))) - np.float32(2.0**23))
            out[np.uint64(i)] = -value if c & U(1) else value


@jit
def _decode_numba(packed, norms, bucket, levels, natural, code_bits, out):  # pragma: no cover - compiled
    """Unpack and decode block by block, bucket segment by bucket segment (:func:`_decode_segment`)."""
    wide_vectors()
    n = out.size
    codes = np.empty(DECODE_BLOCK // 8, dtype=np.uint64)
    codes8 = codes.view(np.uint8)
    scales = norms if natural else np.empty(norms.size, dtype=np.float32)
    if not natural:
        for b in range(norms.size):  # fl32(ν/s), as the torch path has it
            scales[b] = np.float32(np.float64(norms[b]) / levels)
    for start in range(0, n, DECODE_BLOCK):
        stop = min(n, start + DECODE_BLOCK)
        _unpack(packed, start * code_bits // 8, (stop - start + 7) // 8, code_bits, codes)
        i, b = start, start // bucket
        while i < stop:
            end = min(stop, (b + 1) * bucket)
            if natural:
                _decode_segment(codes8, start, i, end, scales[b], levels, True, out)
            else:
                _decode_segment(codes8, start, i, end, scales[b], levels, False, out)
            i, b = end, b + 1


# -- the torch implementation --------------------------------------------------------------------------------
def _uniforms_torch(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """Element i's 16-bit uniform, half i & 1 of mix32(i >> 1, seed) (as :func:`_hash_words`), int64."""
    words = mix32_torch(torch.arange((n + 1) // 2, dtype=torch.int64, device=device), seed)
    return torch.stack([words & 0xFFFF, words >> 16], dim=1).reshape(-1)[:n]


def _codes_torch(x: torch.Tensor, p: torch.Tensor, s: torch.Tensor, levels: int, natural: bool,
                 seed: int, tie_seed: int) -> torch.Tensor:
    """Code (2k + sign) of every value: the torch twin of :func:`_level`, :func:`_quantize` and
    :func:`_settle_ties` (``p``, ``s`` per value)."""
    t = x.abs() * p * s
    if natural:
        y = t.clamp_max(1.0)
        bits = y.view(torch.int32).long()
        biased = bits >> 23
        inside = biased >= 128 - levels
        scale, lift = _below_factors(levels)
        k = torch.where(inside, biased + (levels - 127), 0)
        f = torch.where(inside, (bits & 0x7FFFFF) << 1, (y * scale).clamp_max(2.0**24).long() << lift)
    else:
        t = t.clamp_max(levels * 2.0**24).long()
        k, f = t >> 24, t & 0xFFFFFF
    u = _uniforms_torch(x.numel(), seed, x.device)
    up = u < f >> 8
    tie = u == f >> 8
    if bool(tie.any()):
        index = tie.nonzero()[:, 0]
        up[index] = (mix32_torch(index, tie_seed) >> 24) < (f[index] & 0xFF)
    return ((k + up.long()) << 1) | (x.view(torch.int32) < 0).long()


def _values_torch(codes: torch.Tensor, scales: torch.Tensor, levels: int, natural: bool) -> torch.Tensor:
    """The torch twin of :func:`_decode_segment` (``scales`` per value)."""
    k = codes >> 1
    if natural:
        level = torch.where(k > 0, torch.ldexp(torch.ones_like(scales), k - levels), 0.0)
    else:
        level = k.float()
    values = scales * level
    return torch.where(codes & 1 == 1, -values, values)


# -- the mechanism -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dithering:
    """General dithering D_gen^{C,p,s} (Def. 3) with buckets; shared by ``dither``, ``qsgd``, ``terngrad``.

    ``clip`` > 0 first clips |x_i| at clip·σ (σ the standard deviation of the tensor's values), as
    TernGrad does (its c = 2.5); the result is then biased.
    """

    levels: int
    norm: str
    partition: str
    bucket: int = 0
    natural_norm: bool = False
    clip: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.levels <= 127:
            raise ValueError(f"levels must be in 1..127 (1 + ceil(log2(s+1)) ≤ 8 bits), got {self.levels}")
        if self.norm not in ("1", "2", "inf"):
            raise ValueError(f"norm must be 1, 2 or inf, got {self.norm!r}")
        if self.partition not in ("natural", "standard"):
            raise ValueError(f"partition must be natural or standard, got {self.partition!r}")
        if self.bucket < 0:
            raise ValueError(f"bucket must be ≥ 0 (0: the whole tensor), got {self.bucket}")
        if not self.clip >= 0:
            raise ValueError(f"clip must be ≥ 0 (0: no clipping), got {self.clip}")
        if self.clip and self.norm != "inf":
            raise ValueError("clipping (TernGrad) is defined for the max norm only")

    @property
    def level_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.levels + 1)))

    @property
    def code_bits(self) -> int:
        """1 sign bit + ⌈log2(s+1)⌉ bits for the level (GRACE Fig. 3: s = 4 → 3 bits + sign)."""
        return 1 + self.level_bits

    def buckets(self, numel: int) -> tuple[int, int]:
        """(bucket size, number of buckets) for a tensor of ``numel`` values."""
        size = self.bucket if 0 < self.bucket < numel else numel
        return size, -(-numel // size)

    def nbytes(self, numel: int) -> int:
        count = self.buckets(numel)[1]
        return packed_nbytes(numel, self.code_bits) + (count + 1 if self.natural_norm else 4 * count)

    def compress(self, flat: torch.Tensor, ctx: Context, where: str | Compressor = "dither") -> Packet:
        """Encode ``flat``; NaN or Inf in it raise NonFiniteError, reported as ``where``'s."""
        x = flat if flat.dtype == torch.float32 else flat.float()
        size, count = self.buckets(x.numel())
        numba = use_numba(x)
        if not numba:
            check_finite(flat, where if isinstance(where, str) else where.spec)
        # TernGrad clips |x_i| at c·σ: the clipped values' max norm is min(max|x|, c·σ), and the
        # encoder's clamp to the top level then clips every larger |x_i|
        cap = self._threshold(x) if self.clip else math.inf
        natural = self.partition == "natural"
        seed, tie_seed = ctx.private_seed("dither"), ctx.private_seed("dither/ties")
        if numba:
            norms = torch.empty(count, dtype=torch.float32)
            codes = torch.empty(packed_nbytes(x.numel(), self.code_bits), dtype=torch.uint8)
            finite = _encode_numba(as_numpy(x), _power(self.norm), np.float32(cap), size, self.levels,
                                   natural, U(seed32(seed)), U(seed32(tie_seed)), self.code_bits,
                                   as_numpy(codes), as_numpy(norms))
            if not finite:
                check_finite(flat, where if isinstance(where, str) else where.spec)
                raise AssertionError("the encoder saw NaN/Inf that check_finite does not")
            _check_norms(norms, self.norm)
        else:
            n = x.numel()
            norms = bucket_norms(x, self.norm, size).clamp_max(cap)
            p, s = bucket_scales(norms, self.levels, natural)
            k = _codes_torch(x, p.repeat_interleave(size)[:n], s.repeat_interleave(size)[:n], self.levels,
                             natural, seed, tie_seed)
            codes = pack_bits(k.to(torch.uint8), self.code_bits)
        wire_norms: torch.Tensor | Packet = norms
        if self.natural_norm:
            wire_norms = Natural().compress(norms, ctx.with_key(ctx.key + "/norms"))
        return Packet({"codes": codes, "norms": wire_norms}, flat.shape, flat.dtype)

    def decompress(self, packet: Packet) -> torch.Tensor:
        n = packet.numel
        size, _ = self.buckets(n)
        norms = packet.tensors["norms"]
        norms = Natural().decompress(norms) if isinstance(norms, Packet) else norms
        natural = self.partition == "natural"
        codes = packet["codes"]
        if use_numba(codes):
            out = torch.empty(n, dtype=torch.float32)
            _decode_numba(as_numpy(codes), as_numpy(norms.contiguous()), size, self.levels, natural,
                          self.code_bits, as_numpy(out))
            return out
        scales = norms if natural else (norms.double() / self.levels).float()
        codes = unpack_bits(codes, self.code_bits, n).long()
        return _values_torch(codes, scales.repeat_interleave(size)[:n], self.levels, natural)

    def _threshold(self, x: torch.Tensor) -> float:
        """TernGrad's clipping threshold c·σ (σ: :func:`standard_deviation` of the tensor's values)."""
        if x.numel() == 1:
            return 0.0
        # beyond float32's largest, c·σ clips nothing: say so without an overflowing cast
        return float(np.float32(min(self.clip * standard_deviation(x), float(np.finfo(np.float32).max))))


def standard_deviation(x: torch.Tensor) -> float:
    """σ of float32 ``x``'s values, correction 0, the same float64 on every path (NaN if x holds NaN or
    Inf): μ from the exact fixed-point sum of the values (:mod:`gradpress.compressors.onebit`'s exact
    means), then σ² = Σ (x_i − μ)²/d with each float64 square (x_i − μ)² truncated to fixed point 2^-s
    and summed exactly (2^s from the largest square, max(max x − μ, μ − min x)², and d, so no sum
    overflows an int64). No summation order: the numba kernels (three vectorized passes: min and max,
    Σx, Σ(x − μ)²) and torch agree bit for bit. Truncation costs at most 2^-s per square, about 2^-40
    of the largest square for 2^20 values: far below the float32 rounding of c·σ."""
    n = x.numel()
    numba = use_numba(x)
    low, high = _extremes(as_numpy(x)) if numba else (float(v) for v in torch.aminmax(x))
    if not (math.isfinite(low) and math.isfinite(high)):
        return math.nan
    scale = fixed_point_scale(max(-low, high), n)
    total = int(_fixed_sum(as_numpy(x), scale)) if numba else int(to_fixed(x, scale).sum())
    mean = mean_of(total, n, scale)
    square_scale = fixed_point_scale(2 * max(high - mean, mean - low) ** 2, n)
    if numba:
        squares = int(_fixed_squares(as_numpy(x), mean, square_scale))
    else:
        squares = int(((x.double() - mean).square() * square_scale).to(torch.int64).sum())
    return math.sqrt(mean_of(squares, n, square_scale))


@jit
def _extremes(x):  # pragma: no cover - compiled
    """(min x, max x) as float64: an Inf or NaN of x shows as a non-finite one. Integer reductions,
    which vectorize: a float32 pattern b as int32 orders like the float once the magnitude bits of
    negative values are flipped (b ^ ((b >> 31) & 0x7FFFFFFF)); NaN patterns lie beyond ±Inf's."""
    wide_vectors()
    bits = x.view(np.int32)
    low, high = np.int32(2**31 - 1), np.int32(-(2**31))
    for i in range(x.size):
        b = bits[np.uint64(i)]
        key = b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))
        low = min(low, key)
        high = max(high, key)
    keys = np.array([low, high], dtype=np.int32)
    keys ^= (keys >> np.int32(31)) & np.int32(0x7FFFFFFF)
    values = keys.view(np.float32)
    return np.float64(values[0]), np.float64(values[1])


@jit
def _fixed_sum(x, scale):  # pragma: no cover - compiled
    """Σ trunc(x_i · scale) in int64 (exact: ``scale`` from :func:`fixed_point_scale`)."""
    total = np.int64(0)
    for i in range(x.size):
        total += np.int64(np.float64(x[np.uint64(i)]) * scale)
    return total


@jit
def _fixed_squares(x, mean, scale):  # pragma: no cover - compiled
    """Σ trunc((x_i − mean)² · scale) in int64, each square in float64 as torch forms it."""
    total = np.int64(0)
    for i in range(x.size):
        d = np.float64(x[np.uint64(i)]) - mean
        total += np.int64(d * d * scale)
    return total


# -- the compressors -----------------------------------------------------------------------------------------
class _Dithered(Compressor):
    """A registered method that is one instance of :class:`Dithering` (built from its spec keys)."""

    unbiased = True
    checks_finite = True
    saturates = True  # a value rounds up to the next level, up to the norm: possibly beyond fp16's range
    mechanism: Dithering

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return self.mechanism.nbytes(numel)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        return self.mechanism.compress(flat, ctx, self)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return self.mechanism.decompress(packet)


def _bucket(value: int | None) -> int:
    return 0 if value is None else value


@register("dither")
@dataclass(repr=False)
class Dither(_Dithered):
    """General dithering D_gen^{C,p,s} (Def. 3): natural (Thm 4: ω = 1/8 + d^{1/r} 2^{1-s}
    min{1, d^{1/r} 2^{1-s}}, r = min{p, 2}) or standard partition, with C = identity or C_nat on the norm.

    Defaults as in the paper's experiments (App. A.5, Figs. 19-20: natural dithering with s = 8 and the
    second norm; App. A.4 leaves the norm uncompressed); bucket 0 = the whole tensor, as in Def. 3.
    """

    levels: int = param(8, "[1, 127]")  # 1 + ceil(log2(s+1)) <= 8 bits
    norm: Norm = "2"
    partition: Partition = "natural"
    natural_norm: bool = False
    bucket: int | None = param(0, "[0, inf)")  # 0 (or none): the whole tensor
    examples = ("dither:partition=standard,levels=5,norm=1", "dither:natural_norm=true,bucket=100,norm=inf",
                "dither:levels=3,bucket=128")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mechanism = Dithering(self.levels, self.norm, self.partition, _bucket(self.bucket), self.natural_norm)


@register("qsgd")
@dataclass(repr=False)
class QSGD(_Dithered):
    """QSGD (Alistarh et al. 2017; GRACE Section 3.1): standard dithering D_sta^{2,s} per bucket.

    ``levels`` s = 16 and ``bucket`` = 512 (QSGD's experiments quantize buckets of 512 values; GRACE's
    text fixes no s, its code defaults to 127 levels: ``qsgd:levels=127``, 8 bits). Each value costs
    1 + ⌈log2(s+1)⌉ bits (GRACE Fig. 3), plus one float32 norm per bucket.
    """

    levels: int = param(16, "[1, 127]")  # 1 + ceil(log2(s+1)) <= 8 bits
    bucket: int | None = param(512, "[0, inf)")  # 0 (or none): the whole tensor
    norm: Norm = "2"
    examples = ("qsgd:levels=4,bucket=0,norm=inf", "qsgd:levels=127,bucket=100")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mechanism = Dithering(self.levels, self.norm, "standard", _bucket(self.bucket))


@register("terngrad")
@dataclass(repr=False)
class TernGrad(_Dithered):
    """TernGrad (Wen et al. 2017; GRACE Section 3.1): D_sta^{∞,1}, values in {-1, 0, 1} · max|x|.

    2-bit codes and one float32 scalar per tensor. ``clip`` = c clips at c·σ first (TernGrad's c = 2.5),
    which makes it biased; 0 (the default) keeps it unbiased.
    """

    clip: float = param(0.0, "[0, inf)")  # 0: no clipping
    examples = ("terngrad:clip=2.5",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mechanism = Dithering(1, "inf", "standard", 0, clip=self.clip)

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return not self.clip
