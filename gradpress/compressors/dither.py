"""General dithering (Horváth et al., *Natural Compression*, Def. 3) and the quantizers built on it:
``dither`` (natural or standard dithering, Def. 3 / Thm 4 / Thm 5), ``qsgd`` (Alistarh et al., as GRACE
Section 3.1 describes it: standard dithering D_sta^{2,s}) and ``terngrad`` (Wen et al.: D_sta^{∞,1}).

One mechanism, :class:`Dithering`: split the tensor into buckets of ``bucket`` values (the whole tensor
when 0); for each, y_i = |x_i| / ‖x‖_p, and ξ(y_i) rounds y_i at random to one of its two neighbouring
levels 0 = l_s < … < l_0 = 1 so that E[ξ(y_i)] = y_i; the receiver decodes ‖x‖_p · sign(x_i) · ξ(y_i).
Standard partition: l = k/s; natural partition: l = 2^(k-s) for k = 1..s, and 0 (Def. 3; Fig. 3).
C(‖x‖_p) may be natural compression (``natural_norm``), as Def. 3 allows and App. B uses for in-network
aggregation; it is independent of ξ, so the estimate stays unbiased with second moment ×9/8 (Thm 3).

Wire: ``codes`` — one packed stream of 1 + ⌈log2(s+1)⌉ bits per value in :mod:`gradpress.kernels.bits`' layout,
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

Randomness, from the counter hash of :mod:`gradpress.core.rng` under the rank's private seed: one 32-bit hash
word serves two values, element i taking half i & 1 of mix32(i >> 1) as a 16-bit uniform u. The value
rounds up iff u < ⌊F / 2^8⌋, or, when u = ⌊F / 2^8⌋ (probability 2^-16), iff the top 8 bits of a second
hash of i under a tie seed are below F mod 2^8: P(up) = ⌊F/2^8⌋·2^-16 + 2^-16·(F mod 2^8)·2^-8 = F·2^-24,
exactly as with a 24-bit uniform, for half the hashing (the encoder's largest cost). Decoding:
fl32(fl32(ν/s)·k), or fl32(ν·2^(k-s)).

The numba kernels (CPU, :mod:`gradpress.compressors.dither_kernels`) make one pass over the values, or
two when a bucket is too large for the cache (the norm's, then the encoder's), in blocks of values: the
block's hash words, its bucket segments quantized into byte codes, which are then packed 8 at a time (SWAR:
shifts and masks in 64-bit words, :func:`gradpress.kernels.bits.pack_groups`); decoding unpacks the same way and
computes ±scale·level per code, which an all-gather's sum adds straight into its float32 total
(:meth:`Dithering.accumulate`: no decoded temporary per worker). NaN/Inf: the encoder sees them in each
bucket's largest |x| (computed for the norm anyway) and stops; the compressors raise NonFiniteError then,
so they skip the base class's separate check pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from gradpress.compressors.dither_kernels import (
    CHUNK,
    U,
    _bucket_norms_numba,
    _decode_add_numba,
    _decode_numba,
    _encode_numba,
)
from gradpress.compressors.natural import Natural
from gradpress.compressors.onebit import fixed_point_scale, mean_of, to_fixed
from gradpress.core.compressor import Compressor, check_finite, finish_fold, register
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context, mix32_torch, seed32
from gradpress.kernels.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.kernels.jit import ADD, as_numpy, fold_mode, jit, use_numba, wide_vectors

Norm = Literal["1", "2", "inf"]
Partition = Literal["natural", "standard"]


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
    """∑|x_i|^power per bucket in float64, in the order of the kernels' ``_bucket_norm``."""
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


def _below_factors(levels: int) -> tuple[float, int]:
    """(scale, lift) with ⌊y·scale⌋·2^lift = ⌊y·2^(s+23)⌋ for y < 2^(1-s): one float32 multiply (for
    s > 104, where 2^(s+23) exceeds float32, lift = s - 104 drops the probability's last bits)."""
    lift = max(0, levels - 104)
    return 2.0 ** (levels + 23 - lift), lift


# -- the torch implementation --------------------------------------------------------------------------------
def _uniforms_torch(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """Element i's 16-bit uniform, half i & 1 of mix32(i >> 1, seed) (as the kernels' ``_hash_words``),
    int64."""
    words = mix32_torch(torch.arange((n + 1) // 2, dtype=torch.int64, device=device), seed)
    return torch.stack([words & 0xFFFF, words >> 16], dim=1).reshape(-1)[:n]


def _codes_torch(x: torch.Tensor, p: torch.Tensor, s: torch.Tensor, levels: int, natural: bool,
                 seed: int, tie_seed: int) -> torch.Tensor:
    """Code (2k + sign) of every value: the torch twin of the kernels' ``_level``, ``_quantize`` and
    ``_settle_ties`` (``p``, ``s`` per value)."""
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


def _values_torch(codes: torch.Tensor, scales: torch.Tensor, levels: int, natural: bool,
                  norms: torch.Tensor | None = None) -> torch.Tensor:
    """The torch twin of the kernels' ``_decode_segment`` (``scales`` per value, and for the standard
    partition the ``norms`` ν that bound its magnitudes)."""
    k = codes >> 1
    if natural:
        level = torch.where(k > 0, torch.ldexp(torch.ones_like(scales), k - levels), 0.0)
        values = scales * level
    else:
        assert norms is not None  # (the standard partition's decoding passes them)
        values = torch.minimum(scales * k.float(), norms)
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

    def _norms(self, packet: Packet) -> torch.Tensor:
        norms = packet.tensors["norms"]
        return Natural().decompress(norms) if isinstance(norms, Packet) else norms

    def decompress(self, packet: Packet) -> torch.Tensor:
        n = packet.numel
        size, _ = self.buckets(n)
        norms = self._norms(packet)
        natural = self.partition == "natural"
        codes = packet["codes"]
        if use_numba(codes):
            out = torch.empty(n, dtype=torch.float32)
            _decode_numba(as_numpy(codes), as_numpy(norms.contiguous()), size, self.levels, natural,
                          self.code_bits, as_numpy(out))
            return out
        scales = norms if natural else (norms.double() / self.levels).float()
        codes = unpack_bits(codes, self.code_bits, n).long()
        bounds = None if natural else norms.float().repeat_interleave(size)[:n]
        return _values_torch(codes, scales.repeat_interleave(size)[:n], self.levels, natural, bounds)

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """``total += decompress(packet)`` on a flat float32 ``total``, the same bits: on the CPU decoded
        and added in one pass (no decoded temporary), elsewhere by the torch decoder."""
        codes = packet["codes"]
        if use_numba(codes) and use_numba(total):
            size, _ = self.buckets(packet.numel)
            _decode_add_numba(as_numpy(codes), as_numpy(self._norms(packet).contiguous()), size, self.levels,
                              self.partition == "natural", self.code_bits, as_numpy(total), ADD, 0)
        else:
            total += self.decompress(packet)

    def accumulate_into(self, total: torch.Tensor, packet: Packet, store: bool, count: int) -> int | None:
        """:meth:`Compressor.accumulate_into` in the decode's one pass on the CPU; None where that does
        not apply (the caller then takes the default)."""
        codes = packet["codes"]
        if not (use_numba(codes) and use_numba(total)):
            return None
        size, _ = self.buckets(packet.numel)
        norms = as_numpy(self._norms(packet).contiguous())
        top = _decode_add_numba(as_numpy(codes), norms, size, self.levels, self.partition == "natural",
                                self.code_bits, as_numpy(total), fold_mode(store, count), count)
        return finish_fold(total, top, store, count)

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

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """``total += decompress(packet)``, decoded and added in one pass on the CPU (the same bits)."""
        self.mechanism.accumulate(total, packet)

    def accumulate_into(self, total: torch.Tensor, packet: Packet, store: bool = False,
                        count: int = 0) -> int:
        """:meth:`Compressor.accumulate_into` in the decode's one pass on the CPU."""
        done = self.mechanism.accumulate_into(total, packet, store, count)
        return super().accumulate_into(total, packet, store, count) if done is None else done


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
