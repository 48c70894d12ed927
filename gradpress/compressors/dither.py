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
(which is also TernGrad's clipping). Standard: k = ⌊t⌋ >> 24, rounded up iff the 24-bit uniform of the
counter hash (:mod:`gradpress.rng`) is below t's 24 fraction bits. Natural: at or above 2^(1-s), y = 2^e (1
+ m) rounds up to 2^(e+1) iff the hash's top 23 bits are below the 23-bit mantissa m (C_nat itself);
below, to 2^(1-s) iff the 24-bit uniform is below y·2^(s-1). Probabilities are exact to 2^-24 of a level
gap. Decoding: fl32(fl32(ν/s)·k), or fl32(ν·2^(k-s)).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from gradpress._numba import as_numpy, jit, mix32, mul32, use_numba
from gradpress.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.compressor import Compressor, register
from gradpress.compressors.natural import Natural
from gradpress.packet import Packet
from gradpress.rng import Context, mix32_torch, seed32

U = np.uint32
Norm = Literal["1", "2", "inf"]
Partition = Literal["natural", "standard"]
CHUNK = 256  # the norm's summation order: a halves tree over each chunk, then over the chunk sums
BLOCK = 2048  # values quantized (and packed) per step of the numba kernels; a multiple of 8


# -- float32 bit casts (numba) ---------------------------------------------------------------------------------
@intrinsic
def _f32(typingctx, bits):  # pragma: no cover - compiled
    """The float32 with bit pattern ``bits`` (uint32)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def _bits(typingctx, value):  # pragma: no cover - compiled
    """The bit pattern of a float32, as uint32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


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


@jit
def _term(x, i, scale, power):  # pragma: no cover - compiled
    """(|x_i|·scale)^power in float32."""
    a = abs(x[np.uint64(i)]) * scale
    return a * a if power == 2 else a


@jit
def _term_before(x, i, stop, scale, power):  # pragma: no cover - compiled
    """(|x_i|·scale)^power in float32, 0 at or past ``stop``."""
    return _term(x, i, scale, power) if i < stop else np.float32(0.0)


@jit
def _levels_1_to_3(t0, t1, t2, t3, t4, t5, t6, t7):  # pragma: no cover - compiled
    """Levels 1-3 of a chunk's halves tree for its values j + 32q, q = 0..7 (level 1 adds values j
    and j + 128, level 2 entries j and j + 64, level 3 entries j and j + 32)."""
    return ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7))


@jit
def _chunk_sum(x, start, stop, power, scratch):  # pragma: no cover - compiled
    """∑|x|^power over x[start:stop] zero-padded to CHUNK = 256 values, as float64.

    The chunk is first scaled by the power of two 2^-e that brings its largest |x| to [1, 4) (e from its
    biased exponent E, clamped to 1..253), which is exact and keeps the float32 terms in range; then a
    halves tree in float32 (levels 1-3 in registers, 4-8 over ``scratch``); the sum is scaled back by
    2^(power·e) in float64.
    """
    bits = x.view(np.uint32)
    largest = U(0)
    for i in range(start, stop):
        largest = max(largest, U(bits[np.uint64(i)] & U(0x7FFFFFFF)))
    biased = min(max(np.int64(largest >> U(23)), 1), 253)
    scale = _f32(U(U(254 - biased) << U(23)))  # 2^(127 - E)
    if stop - start == CHUNK:  # the common case, without bounds checks (vectorized over j)
        for j in range(start, start + 32):
            scratch[j - start] = _levels_1_to_3(
                _term(x, j, scale, power), _term(x, j + 32, scale, power), _term(x, j + 64, scale, power),
                _term(x, j + 96, scale, power), _term(x, j + 128, scale, power),
                _term(x, j + 160, scale, power), _term(x, j + 192, scale, power),
                _term(x, j + 224, scale, power))
    else:
        for j in range(start, start + 32):
            scratch[j - start] = _levels_1_to_3(
                _term_before(x, j, stop, scale, power), _term_before(x, j + 32, stop, scale, power),
                _term_before(x, j + 64, stop, scale, power), _term_before(x, j + 96, stop, scale, power),
                _term_before(x, j + 128, stop, scale, power), _term_before(x, j + 160, stop, scale, power),
                _term_before(x, j + 192, stop, scale, power), _term_before(x, j + 224, stop, scale, power))
    width = 32
    while width > 1:  # levels 4-8
        width //= 2
        for j in range(width):
            scratch[j] = scratch[j] + scratch[j + width]
    total = scratch[0]
    return math.ldexp(np.float64(total), power * (biased - 127))


@jit
def _bucket_norm(x, start, stop, power, sums, scratch):  # pragma: no cover - compiled
    """‖x[start:stop]‖_p as float32 (power 0: the max norm, exact). For p = 1, 2: a halves tree over each
    chunk of CHUNK values, then one over the chunk sums zero-padded to a power of two (adding +0.0
    changes nothing, so those adds are skipped); ``sums`` holds at least the chunk count."""
    if power == 0:  # on the bit patterns: non-negative floats order like them (and this vectorizes)
        bits = x.view(np.uint32)
        best = U(0)
        for i in range(start, stop):
            best = max(best, U(bits[np.uint64(i)] & U(0x7FFFFFFF)))
        return _f32(best)
    count = -(-(stop - start) // CHUNK)
    for c in range(count):
        sums[c] = _chunk_sum(x, start + c * CHUNK, min(stop, start + (c + 1) * CHUNK), power, scratch)
    size = 1
    while size < count:
        size *= 2
    while size > 1:
        size //= 2
        for j in range(size):
            if j + size < count:
                sums[j] = sums[j] + sums[j + size]
        count = min(count, size)
    return np.float32(sums[0] if power == 1 else math.sqrt(sums[0]))


@jit
def _norm_scratch(bucket):  # pragma: no cover - compiled
    return np.zeros(-(-bucket // CHUNK)), np.empty(32, dtype=np.float32)


@jit
def _bucket_norms_numba(x, power, bucket, out):  # pragma: no cover - compiled
    sums, scratch = _norm_scratch(bucket)
    for b in range(out.size):
        out[b] = _bucket_norm(x, b * bucket, min(x.size, (b + 1) * bucket), power, sums, scratch)


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


# -- quantizing ------------------------------------------------------------------------------------------------
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


@jit
def _split_scale(norm, c):  # pragma: no cover - compiled
    """:func:`bucket_scales` for one bucket: (P, S) of c/ν (math.frexp and ldexp are exact, like torch's)."""
    if not norm > 0:
        return np.float32(1.0), np.float32(0.0)
    scale = c / np.float64(norm)
    exponent = min(max(math.frexp(scale)[1] - 1, -126), 127)
    return np.float32(math.ldexp(1.0, exponent)), np.float32(math.ldexp(scale, -exponent))


@jit
def _quantize_standard(bits, start, stop, p, s, top, seed, codes, base):  # pragma: no cover - compiled
    """Codes of one bucket's values: T = min(fl32(|x|·P·S), s·2^24), k = T >> 24 rounded up iff the
    24-bit uniform of the hash is below T's 24 fraction bits; code = 2k + sign. Returns the largest
    code (a reduction, which also lets LLVM interleave the loop and hide the hash's multiply latency)."""
    largest = U(0)
    for i in range(start, stop):
        w = bits[np.uint64(i)]
        t = U(min(_f32(U(w & U(0x7FFFFFFF))) * p * s, top))
        up = U(U(mix32(i, seed) >> U(8)) < U(t & U(0xFFFFFF)))
        code = U(U(U(U(t >> U(24)) + up) << U(1)) | U(w >> U(31)))
        largest = max(largest, code)
        codes[np.uint64(i - base)] = np.uint8(code)
    return largest


@jit
def _quantize_natural(bits, start, stop, p, s, low, shift, scale, lift, seed, codes, base):  # pragma: no cover - compiled
    """Codes of one bucket's values: y = min(fl32(|x|·P·S), 1). At or above 2^(1-s) (biased exponent ≥
    ``low``), y = 2^e (1 + m) is C_nat-rounded between 2^e and 2^(e+1): up iff the hash's top 23 bits are
    below the mantissa, k = s + e (+1); below, between 0 and 2^(1-s): up iff the 24-bit uniform is below
    F = ⌊y·2^(s+23)⌋, computed as ⌊y·scale⌋·lift (see :func:`_below_factors`). code = 2k + sign.
    Returns the largest code (see _quantize_standard)."""
    largest = U(0)
    for i in range(start, stop):
        w = bits[np.uint64(i)]
        y = min(_f32(U(w & U(0x7FFFFFFF))) * p * s, np.float32(1.0))
        r = mix32(i, seed)
        biased = U(_bits(y) >> U(23))
        inside = U(U(biased + shift) + U(U(r >> U(9)) < U(_bits(y) & U(0x7FFFFF))))
        outside = U(U(r >> U(8)) < mul32(U(min(y * scale, np.float32(2.0**24))), lift))
        k = inside if biased >= low else outside
        code = U(U(k << U(1)) | U(w >> U(31)))
        largest = max(largest, code)
        codes[np.uint64(i - base)] = np.uint8(code)
    return largest


def _below_factors(levels: int) -> tuple[float, int]:
    """(scale, lift) with ⌊y·scale⌋·lift = ⌊y·2^(s+23)⌋ for y < 2^(1-s): one float32 multiply (for
    s > 104, where 2^(s+23) exceeds float32, lift = 2^(s-104) drops the probability's last bits)."""
    shift = max(0, levels - 104)
    return 2.0 ** (levels + 23 - shift), 1 << shift


@jit
def _pack(codes, groups, bits, words, out, offset):  # pragma: no cover - compiled
    """Pack ``groups`` groups of 8 codes (``codes`` as uint64: code j of a group in byte j) at byte
    ``offset`` of ``out`` in :func:`gradpress.bits.pack_bits`' layout: a group's code j at bits
    [j·bits, (j+1)·bits) of its ``bits`` bytes. ``words`` is scratch for the packed groups."""
    mask = np.uint64((1 << bits) - 1)
    for g in range(groups):  # vectorized over groups
        v = codes[np.uint64(g)]
        word = np.uint64(0)
        for j in range(8):
            word |= ((v >> np.uint64(8 * j)) & mask) << np.uint64(bits * j)
        words[np.uint64(g)] = word
    whole = max(0, min(groups, (out.size - offset - 8) // bits + 1))  # groups with 8 bytes of room
    for g in range(whole):  # one 8-byte store each; the next group overwrites the top 8 - bits bytes
        word = words[np.uint64(g)]
        at = offset + g * bits
        for q in range(8):
            out[np.uint64(at + q)] = np.uint8(word >> np.uint64(8 * q))
    for g in range(whole, groups):
        word = words[g]
        at = offset + g * bits
        for q in range(min(bits, out.size - at)):
            out[at + q] = np.uint8(word >> np.uint64(8 * q))


@jit
def _unpack(packed, offset, groups, bits, words, codes):  # pragma: no cover - compiled
    """Inverse of :func:`_pack`."""
    mask = np.uint64((1 << bits) - 1)
    whole = max(0, min(groups, (packed.size - offset - 8) // bits + 1))
    for g in range(whole):  # one 8-byte load each
        at = offset + g * bits
        word = np.uint64(0)
        for q in range(8):
            word |= np.uint64(packed[np.uint64(at + q)]) << np.uint64(8 * q)
        words[np.uint64(g)] = word
    for g in range(whole, groups):
        at = offset + g * bits
        word = np.uint64(0)
        for q in range(min(bits, packed.size - at)):
            word |= np.uint64(packed[at + q]) << np.uint64(8 * q)
        words[g] = word
    for g in range(groups):  # vectorized over groups
        word = words[np.uint64(g)]
        v = np.uint64(0)
        for j in range(8):
            v |= ((word >> np.uint64(bits * j)) & mask) << np.uint64(8 * j)
        codes[np.uint64(g)] = v


@jit
def _encode_numba(x, power, cap, bucket, levels, natural, seed, code_bits, out, norms):  # pragma: no cover - compiled
    """Quantize and pack ``x`` block by block; each bucket's norm (capped at ``cap``) is computed into
    ``norms`` just before its first values are quantized, so a small bucket is read from cache."""
    n = x.size
    bits = x.view(np.uint32)
    sums, scratch = _norm_scratch(bucket)
    codes = np.zeros(BLOCK // 8, dtype=np.uint64)  # a block's codes, 8 per word
    codes8 = codes.view(np.uint8)
    words = np.empty(BLOCK // 8, dtype=np.uint64)
    c = 1.0 if natural else levels * 2.0**24
    top = np.float32(levels * 2.0**24)
    low = U(128 - levels)  # biased exponent of 2^(1-s)
    shift = U(levels - 127)  # k = biased exponent + s - 127 (mod 2^32)
    scale = np.float32(2.0 ** (levels + 23 - max(0, levels - 104)))  # _below_factors
    lift = U(1 << max(0, levels - 104))
    done = -1
    for start in range(0, n, BLOCK):
        stop = min(n, start + BLOCK)
        if stop - start < BLOCK:
            codes[:] = 0
        i = start
        while i < stop:
            b = i // bucket
            end = min(stop, (b + 1) * bucket)
            if b > done:
                norms[b] = min(_bucket_norm(x, b * bucket, min(n, (b + 1) * bucket), power, sums, scratch), cap)
                done = b
            p, s = _split_scale(norms[b], c)
            if natural:
                _quantize_natural(bits, i, end, p, s, low, shift, scale, lift, seed, codes8, start)
            else:
                _quantize_standard(bits, i, end, p, s, top, seed, codes8, start)
            i = end
        _pack(codes, (stop - start + 7) // 8, code_bits, words, out, start * code_bits // 8)


@jit
def _decode_segment(codes, base, start, stop, scale, levels, natural, out):  # pragma: no cover - compiled
    """±fl32(scale · k) (standard, scale = fl32(ν/s)) or ±ν·2^(k-s) (natural, scale = ν) per code."""
    for i in range(start, stop):
        c = U(codes[np.uint64(i - base)])
        k = U(c >> U(1))
        if natural:
            level = _f32(U(U(k + U(127 - levels)) << U(23))) if k != U(0) else np.float32(0.0)
        else:  # float32(k), exactly, in 32-bit lanes (2^23 + k has k as its mantissa)
            level = _f32(U(k | U(0x4B000000))) - np.float32(2.0**23)
        value = scale * level
        out[np.uint64(i)] = -value if c & U(1) else value


@jit
def _decode_numba(packed, scales, bucket, levels, natural, code_bits, out):  # pragma: no cover - compiled
    n = out.size
    codes = np.zeros(BLOCK // 8, dtype=np.uint64)
    codes8 = codes.view(np.uint8)
    words = np.empty(BLOCK // 8, dtype=np.uint64)
    for start in range(0, n, BLOCK):
        stop = min(n, start + BLOCK)
        _unpack(packed, start * code_bits // 8, (stop - start + 7) // 8, code_bits, words, codes)
        i = start
        while i < stop:
            b = i // bucket
            end = min(stop, (b + 1) * bucket)
            _decode_segment(codes8, start, i, end, scales[b], levels, natural, out)
            i = end


def _codes_torch(x: torch.Tensor, p: torch.Tensor, s: torch.Tensor, levels: int, natural: bool,
                 seed: int) -> torch.Tensor:
    """Code (2k + sign) of every value: the torch twin of :func:`_quantize_standard` / ``_natural``."""
    words = mix32_torch(torch.arange(x.numel(), dtype=torch.int64, device=x.device), seed)
    t = x.abs() * p * s
    if natural:
        y = t.clamp_max(1.0)
        bits = y.view(torch.int32).long()
        biased = bits >> 23
        inside = biased + (levels - 127) + ((words >> 9) < (bits & 0x7FFFFF)).long()
        scale, lift = _below_factors(levels)
        outside = ((words >> 8) < ((y * scale).clamp_max(2.0**24).long() * lift)).long()
        k = torch.where(biased >= 128 - levels, inside, outside)
    else:
        t = t.clamp_max(levels * 2.0**24).long()
        k = (t >> 24) + ((words >> 8) < (t & 0xFFFFFF)).long()
    return (k << 1) | (x.view(torch.int32) < 0).long()


def _values_torch(codes: torch.Tensor, scales: torch.Tensor, levels: int, natural: bool) -> torch.Tensor:
    """The torch twin of :func:`_decode_segment` (``scales`` per value)."""
    k = codes >> 1
    if natural:
        level = torch.where(k > 0, torch.ldexp(torch.ones_like(scales), k - levels), 0.0)
    else:
        level = k.float()
    values = scales * level
    return torch.where(codes & 1 == 1, -values, values)


# -- the mechanism ------------------------------------------------------------------------------------------------
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

    def compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = flat if flat.dtype == torch.float32 else flat.float()
        size, count = self.buckets(x.numel())
        # TernGrad clips |x_i| at c·σ: the clipped values' max norm is min(max|x|, c·σ), and the
        # encoder's clamp to the top level then clips every larger |x_i|
        cap = self._threshold(x) if self.clip else math.inf
        natural = self.partition == "natural"
        seed = ctx.private_seed("dither")
        if use_numba(x):
            norms = torch.empty(count, dtype=torch.float32)
            codes = torch.empty(packed_nbytes(x.numel(), self.code_bits), dtype=torch.uint8)
            _encode_numba(as_numpy(x), _power(self.norm), np.float32(cap), size, self.levels, natural,
                          U(seed32(seed)), self.code_bits, as_numpy(codes), as_numpy(norms))
            _check_norms(norms, self.norm)
        else:
            n = x.numel()
            norms = bucket_norms(x, self.norm, size).clamp_max(cap)
            p, s = bucket_scales(norms, self.levels, natural)
            k = _codes_torch(x, p.repeat_interleave(size)[:n], s.repeat_interleave(size)[:n], self.levels,
                             natural, seed)
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
        scales = norms if natural else (norms.double() / self.levels).float()
        codes = packet["codes"]
        if use_numba(codes):
            out = torch.empty(n, dtype=torch.float32)
            _decode_numba(as_numpy(codes), as_numpy(scales.contiguous()), size, self.levels, natural,
                          self.code_bits, as_numpy(out))
            return out
        codes = unpack_bits(codes, self.code_bits, n).long()
        return _values_torch(codes, scales.repeat_interleave(size)[:n], self.levels, natural)

    def _threshold(self, x: torch.Tensor) -> float:
        """TernGrad's clipping threshold c·σ (σ: the standard deviation of the tensor's values)."""
        if x.numel() == 1:
            return 0.0
        sigma = float(x.std(correction=0))
        if not math.isfinite(sigma):  # x² overflowed float32
            sigma = float(x.double().std(correction=0))
        return float(np.float32(self.clip * sigma))


# -- the compressors --------------------------------------------------------------------------------------------
class _Dithered(Compressor):
    """A registered method that is one instance of :class:`Dithering` (built from its spec keys)."""

    unbiased = True
    mechanism: Dithering

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return self.mechanism.nbytes(numel)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        return self.mechanism.compress(flat, ctx)

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

    levels: int = 8
    norm: Norm = "2"
    partition: Partition = "natural"
    natural_norm: bool = False
    bucket: int | None = 0
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

    levels: int = 16
    bucket: int | None = 512
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

    clip: float = 0.0
    examples = ("terngrad:clip=2.5",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.mechanism = Dithering(1, "inf", "standard", 0, clip=self.clip)

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return not self.clip
