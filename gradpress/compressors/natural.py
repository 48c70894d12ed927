"""Natural compression C_nat (Horváth et al., *Natural Compression for Distributed Deep Learning*, Def. 1).

C_nat rounds every value t ≠ 0 at random to one of the two nearest powers of two,
``sign(t)·2^⌊log2|t|⌋`` or ``sign(t)·2^⌈log2|t|⌉``, with the probabilities that make it unbiased
(Eq. 2); on binary32 it keeps sign and exponent and rounds up with probability equal to the mantissa m
(Section 2, "From 32 to 9 bits"). Its variance is ω = 1/8 (Thm 1), reached at |t| = (4/3)·2^a.

Wire: one byte per value plus a one-byte header.

* ``top`` (int8): the exponent T of the window's top power, the smallest power of two ≥ max|x|, raised
  if needed so that the window's bottom is not below the smallest positive power the *input* dtype
  holds (fp32 2^-149 including subnormals, bf16 2^-133, fp16 2^-24). The window is the 127 powers
  2^(T-126) … 2^T, so rounding up at the top never leaves it and every decoded power is representable.
* ``codes`` (uint8, one per value): bit 7 the sign, bits 0–6 the exponent code c; c = 0 is zero, and
  c ≥ 1 names the power 2^e of the window with c = (e + 126 mod 127) + 1 — for |t| < 2^128 that is
  the float32 biased exponent wrapped into 1..127, so a value is coded without knowing the window;
  127 consecutive exponents have 127 distinct codes, and the header tells the receiver which. (-0 keeps
  its sign bit, code 0x80, and reads as 0.)

A value below the window's smallest power P = 2^(T-126) is rounded *unbiasedly* to 0 or P (probability
|t|/P), never flushed: C_nat first rounds it to 2^e (e < log2 P), which is then sent as P with
probability 2^e/P, decided by e − log2 P fresh hash bits all being zero, so it is exact at any depth.

``deterministic=true`` is the paper's variant without randomness, "deterministic rounding to the nearest
power of 2" (Section 5 and App. B). We read *nearest* in value: round up iff the first mantissa bit is
set (|t| ≥ 1.5·2^⌊log2|t|⌋, ties up), and below the window to P iff |t| ≥ P/2. It is biased.

The random bits are the counter hash of :mod:`gradpress.core.rng` (``mix32``) of the element index under the
rank's private seed: the top 23 bits decide the mantissa rounding (up iff they are < m: probability
exactly m·2^-23), the low 9 bits, and further hash words if needed, the below-window step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradpress.core.compressor import Compressor, check_finite, finish_fold, register
from gradpress.core.packet import Packet
from gradpress.core.rng import Context, mix32_torch, seed32
from gradpress.kernels.jit import (
    ADD,
    FINISH,
    FINISH_POW2,
    GOLDEN,
    STORE,
    as_numpy,
    bits_of_f32,
    f32_from_bits,
    fold,
    fold_mode,
    fold_top,
    fused,
    jit,
    kernel,
    mix32,
    mix32_from,
    mul32,
    use_numba,
    wide_vectors,
)

U = np.uint32
WINDOW = 127  # powers of two a 7-bit code names (code 0 is zero)
MANTISSA = 23
EXTRA_SEED = 0x85EBCA77  # the w-th extra hash word of element i is mix32(i, seed ^ (w · EXTRA_SEED))
BLOCK = 4096  # elements per block of the numba encoder; a block holding a special value is redone exactly
NON_FINITE = 0x7F800000  # |x| bit patterns from here up are Inf and NaN


# -- the window -----------------------------------------------------------------------------------------
def smallest_power(dtype: torch.dtype) -> int:
    """Exponent of the smallest positive power of two ``dtype`` holds, subnormals included."""
    info = torch.finfo(dtype)
    return round(math.log2(info.tiny) + math.log2(info.eps))


def largest_power(dtype: torch.dtype) -> int:
    """Exponent of the largest power of two ``dtype`` holds."""
    return math.floor(math.log2(torch.finfo(dtype).max))


def window_top(max_abs: float, dtype: torch.dtype) -> int:
    """The window's top exponent T for a tensor of ``dtype`` whose largest magnitude is ``max_abs``."""
    lowest_top = smallest_power(dtype) + WINDOW - 1
    if max_abs == 0.0:
        return lowest_top
    fraction, exponent = math.frexp(max_abs)  # max_abs = fraction · 2^exponent, fraction in [0.5, 1)
    ceil_log2 = exponent - 1 if fraction == 0.5 else exponent
    if ceil_log2 > largest_power(dtype):
        raise OverflowError(
            f"natural: |x| up to {max_abs:g} may round up to 2^{ceil_log2}, beyond the largest power of two "
            f"{dtype} holds (2^{largest_power(dtype)})"
        )
    return max(ceil_log2, lowest_top)


def exponent_code(exponent: int | torch.Tensor) -> int | torch.Tensor:
    """The 7-bit code of the power 2^exponent: (exponent + 126 mod 127) + 1."""
    return (exponent + WINDOW - 1) % WINDOW + 1


def decode_table(top: int | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 value of each of the 256 code bytes under window top ``top`` (a number, or the
    packet's header tensor, read on its device: no wait for the GPU, no tensor made on the host)."""
    top = top.reshape(()).long() if isinstance(top, torch.Tensor) else top
    exponents = torch.arange(WINDOW, dtype=torch.int64, device=device) + (top - WINDOW + 1)
    powers = torch.zeros(WINDOW + 1, dtype=torch.float32, device=device)
    powers[exponent_code(exponents)] = torch.ldexp(torch.ones(WINDOW, dtype=torch.float64, device=device),
                                                   exponents).float()
    table = torch.cat([powers, powers.neg()])
    table[WINDOW + 1:WINDOW + 2].zero_()  # code 128 (a sign without a power) is never sent; it reads as zero
    return table


# -- numba kernels ------------------------------------------------------------------------------------------
@jit
def _keep_power(i, seed, word, depth):  # pragma: no cover - compiled
    """True with probability 2^-depth: ``depth`` hash bits all zero (the low 9 of ``word``, then 32 from
    each extra hash word)."""
    take = min(depth, 9)
    if word & U((1 << take) - 1):
        return False
    depth -= take
    w = 1
    while depth > 0:
        take = min(depth, 32)
        mask = U(0xFFFFFFFF) if take == 32 else U((1 << take) - 1)
        if mix32(i, U(seed ^ mul32(U(w), U(EXTRA_SEED)))) & mask:
            return False
        depth -= take
        w += 1
    return True


@jit
def _encode_exact(w, i, seed, bottom, deterministic):  # pragma: no cover - compiled
    """The code byte of one float32 bit pattern ``w``, whatever it is (zero, subnormal, below the window)."""
    magnitude = w & U(0x7FFFFFFF)
    if magnitude == 0:
        return np.uint8(U(w >> U(24)) & U(0x80))  # ±0: code 0, with the sign (-0 reads as 0)
    biased = np.int64(magnitude >> U(MANTISSA))
    mantissa = U(magnitude & U(0x7FFFFF))
    if biased > 0:  # |t| = 2^e (1 + fraction · 2^-23)
        e = biased - 127
        fraction = mantissa
    else:  # subnormal, |t| = mantissa · 2^-149
        k = 0
        while (mantissa >> U(k + 1)) != 0:
            k += 1
        e = k - 149
        fraction = U(U(mantissa - U(1 << k)) << U(MANTISSA - k))
    word = mix32(i, seed)
    if deterministic:
        up = fraction >= U(1 << (MANTISSA - 1))
    else:
        up = U(word >> U(9)) < fraction
    rounded = e + np.int64(up)
    if rounded < bottom:
        keep = (e == bottom - 1) if deterministic else _keep_power(i, seed, word, bottom - rounded)
        if not keep:
            return np.uint8(0)
        rounded = bottom
    return np.uint8(U(U(w >> U(24)) & U(0x80)) | U((rounded + WINDOW - 1) % WINDOW + 1))


@kernel(inline="always")
def _encode_block(bits, start, stop, seed, deterministic, out):  # pragma: no cover - compiled
    """Branch-free (vectorized) coding of normal values, before the window is known.

    Returns (largest magnitude, smallest nonzero magnitude - 1) of the block as bit patterns; values too
    small for this path (subnormal, or maybe below the window) are recoded by :func:`_encode_exact`.
    """
    largest = U(0)
    least = U(0xFFFFFFFF)
    h = mul32(U(start), GOLDEN)  # for mix32(i, seed)
    for i in range(start, stop):
        w = bits[np.uint64(i)]
        magnitude = U(w & U(0x7FFFFFFF))
        mantissa = U(w & U(0x7FFFFF))
        if deterministic:
            up = U(mantissa >> U(MANTISSA - 1))
        else:
            up = U(U(mix32_from(h, seed) >> U(9)) < mantissa)
        h = U(h + GOLDEN)
        code = U(U(magnitude >> U(MANTISSA)) + up)  # biased exponent of the result, 0 for zero
        code = U(code - U(WINDOW & -U(code > U(WINDOW))))  # ... wrapped into 1..127
        largest = max(largest, magnitude)
        least = min(least, U(magnitude - U(1)))
        out[np.uint64(i)] = np.uint8(U(U(U(w >> U(24)) & U(0x80)) | code))
    return largest, least


@jit
def _encode_blocks(bits, seed, deterministic, out, least):  # pragma: no cover - compiled
    """First pass: every block by the fast path; returns max |x| as bits (NaN/Inf: ≥ NON_FINITE),
    ``least`` per block."""
    wide_vectors()
    largest = U(0)
    for b in range(least.size):
        block_largest, block_least = _encode_block(
            bits, b * BLOCK, min(bits.size, (b + 1) * BLOCK), seed, deterministic, out
        )
        least[b] = block_least
        largest = max(largest, block_largest)
    return largest


@jit
def _recode_blocks(bits, seed, bottom, deterministic, out, least):  # pragma: no cover - compiled
    """Second pass, only over blocks holding a nonzero magnitude with biased exponent ≤ bottom + 126
    (a subnormal, or a value that may round below the window)."""
    wide_vectors()
    limit = U(max(bottom + 127, 1) << MANTISSA)
    for b in range(least.size):
        if least[b] < limit:
            for i in range(b * BLOCK, min(bits.size, (b + 1) * BLOCK)):
                out[i] = _encode_exact(bits[i], i, seed, bottom, deterministic)


@kernel(inline="always")
def _decode_one(c, bottom, scale):  # pragma: no cover - compiled
    """The value of code ``c`` (see :func:`_decode_numba`)."""
    d = U(U(c & U(0x7F)) - U(1) - bottom)
    d = U(d + U(WINDOW)) if d >= U(0x80000000) else d  # mod 127
    magnitude = f32_from_bits(U(U(d + U(1)) << U(MANTISSA))) * scale
    signed = f32_from_bits(U(bits_of_f32(magnitude) | U(U(c & U(0x80)) << U(24))))
    return signed if U(c & U(0x7F)) != U(0) else np.float32(0.0)


@jit
def _decode_numba(codes, top, out):  # pragma: no cover - compiled
    """``decode_table(top)[codes]``, computed (a table lookup would be a slow gather). The code c ≥ 1 of
    the power 2^e of the window 2^(top-126) … 2^top is (e + 126 mod 127) + 1, so d = e - (top - 126) =
    (c - 1 - (top mod 127)) mod 127, and 2^e = 2^(d-126)·2^top: both factors normal float32, the product
    exact even where subnormal. Bit 7 is the sign; codes 0 and 0x80 read as +0.0."""
    wide_vectors()
    bottom = U(top % WINDOW)  # the bottom power's code - 1
    scale = np.float32(2.0**top)
    for i in range(codes.size):
        out[np.uint64(i)] = _decode_one(U(codes[np.uint64(i)]), bottom, scale)


@kernel(inline="always")
def _decode_fold(codes, top, total, mode, count, reciprocal):  # pragma: no cover - compiled
    """:func:`gradpress.kernels.jit.fold` of each decoded value into ``total`` (``mode`` a constant)."""
    bottom = U(top % WINDOW)
    scale = np.float32(2.0**top)
    largest = np.int32(0)
    for i in range(codes.size):
        value = _decode_one(U(codes[np.uint64(i)]), bottom, scale)
        s = fold(total[np.uint64(i)], value, mode, count, reciprocal)
        total[np.uint64(i)] = s
        largest = fold_top(largest, mode, s)
    return largest


@fused
def _decode_add_numba(codes, top, total, mode, count):  # pragma: no cover - compiled
    """``total += decode(codes)`` in one pass (an all-gather's sum: no decoded temporary per worker), or
    another :data:`gradpress.kernels.jit.ADD` mode; the largest exponent field stored when finishing."""
    wide_vectors()
    c, r = np.float32(count), np.float32(1.0 / max(count, 1))
    if mode == STORE:
        return _decode_fold(codes, top, total, STORE, c, r)
    if mode == FINISH:
        return _decode_fold(codes, top, total, FINISH, c, r)
    if mode == FINISH_POW2:
        return _decode_fold(codes, top, total, FINISH_POW2, c, r)
    return _decode_fold(codes, top, total, ADD, c, r)


# -- the torch implementation --------------------------------------------------------------------------------
def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(negative, nonzero, e, fraction) of float32 ``x``: |x| = 2^e (1 + fraction · 2^-23), as int64."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    magnitude = bits & 0x7FFFFFFF
    biased = magnitude >> MANTISSA
    mantissa = magnitude & 0x7FFFFF
    top_bit = (torch.frexp(mantissa.to(torch.float64)).exponent.to(torch.int64) - 1).clamp_min(0)
    normal = biased > 0
    e = torch.where(normal, biased - 127, top_bit - 149)
    fraction = torch.where(normal, mantissa, (mantissa - (1 << top_bit)) << (MANTISSA - top_bit))
    return bits >> 31 == 1, magnitude != 0, e, fraction


def _round_up(fraction: torch.Tensor, words: torch.Tensor | None) -> torch.Tensor:
    """Whether C_nat rounds up: with probability fraction · 2^-23, or (deterministic) iff fraction ≥ 1/2."""
    if words is None:
        return fraction >= 1 << (MANTISSA - 1)
    return (words >> 9) < fraction


def natural_round(values: torch.Tensor, words: torch.Tensor | None) -> torch.Tensor:
    """C_nat (Def. 1) of float32 ``values``: each becomes sign·2^⌊log2|t|⌋ or sign·2^⌈log2|t|⌉.

    ``words`` holds 32 random bits per value as int64 (``gradpress.core.rng.mix32_torch``); a value rounds up
    iff the top 23 bits are below its mantissa, so E[C_nat(t)] = t exactly. ``words=None`` rounds to the
    nearest power in value instead (the paper's deterministic variant). Subnormals round like any value.
    Raises OverflowError if a value could round up to 2^128, beyond float32.
    """
    if values.dtype != torch.float32:
        raise TypeError(f"natural_round expects float32 values, got {values.dtype}")
    negative, nonzero, e, fraction = _split(values)
    rounded = e + _round_up(fraction, words).to(torch.int64)
    if bool((nonzero & (rounded > largest_power(torch.float32))).any()):
        raise OverflowError("natural_round: a value ≥ 2^127 could round up to 2^128, beyond float32")
    powers = torch.ldexp(torch.ones_like(values, dtype=torch.float64), rounded.clamp_max(127)).float()
    powers = torch.where(nonzero, powers, 0.0)
    return torch.where(negative, -powers, powers)


def _keep_power_torch(index: torch.Tensor, seed: int, words: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Vectorized :func:`_keep_power`: true with probability 2^-depth per element."""
    take = depth.clamp_max(9)
    keep = (words & ((1 << take) - 1)) == 0
    depth = depth - take
    w = 1
    while bool(((depth > 0) & keep).any()):
        take = depth.clamp(0, 32)
        extra = mix32_torch(index, seed32(seed) ^ ((w * EXTRA_SEED) & 0xFFFFFFFF))
        keep &= (extra & ((1 << take) - 1)) == 0
        depth = depth - take
        w += 1
    return keep


def _encode_torch(x: torch.Tensor, seed: int, bottom: int, deterministic: bool) -> torch.Tensor:
    """Code bytes of float32 ``x`` (the same bits as the numba kernels)."""
    index = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    words = None if deterministic else mix32_torch(index, seed)
    rounded = natural_round(x, words)
    negative, nonzero, exponent, _ = _split(rounded)
    below = nonzero & (exponent < bottom)
    if bool(below.any()):  # 0 or the window's smallest power P, unbiased (or nearest)
        if words is None:  # (deterministic)
            keep = _split(x[below])[2] == bottom - 1
        else:
            keep = _keep_power_torch(index[below], seed, words[below], bottom - exponent[below])
        nonzero[below] = keep
        exponent[below] = bottom
    code = torch.where(nonzero, exponent_code(exponent), 0) | (negative.to(torch.int64) << 7)
    return torch.where(nonzero | (x == 0), code, 0).to(torch.uint8)


# -- the compressor ---------------------------------------------------------------------------------------
@register("natural")
@dataclass(repr=False)
class Natural(Compressor):
    """Natural compression C_nat (Def. 1; ω = 1/8 by Thm 1): 8 bits per value + an 8-bit window header.

    The paper counts 9 bits per float32 (sign + the 8 exponent bits); a window of the 127 powers below
    the tensor's largest magnitude needs 7, plus the header byte per tensor.
    """

    deterministic: bool = False
    examples = ("natural:deterministic=true",)
    checks_finite = True  # the encoder's max |x| shows NaN/Inf

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return not self.deterministic

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel + 1

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = flat if flat.dtype == torch.float32 else flat.float()
        seed = ctx.private_seed("natural")
        if use_numba(x):
            codes = torch.empty(x.numel(), dtype=torch.uint8)
            bits = as_numpy(x).view(np.uint32)
            least = np.empty(-(-x.numel() // BLOCK), dtype=np.uint32)
            largest = _encode_blocks(bits, U(seed32(seed)), self.deterministic, as_numpy(codes), least)
            if largest >= NON_FINITE:
                check_finite(flat, self.spec)
                raise AssertionError("the encoder saw NaN/Inf that check_finite does not")
            top = window_top(float(np.array(largest, dtype=np.uint32).view(np.float32)), flat.dtype)
            _recode_blocks(bits, U(seed32(seed)), top - WINDOW + 1, self.deterministic, as_numpy(codes), least)
        else:
            largest = float(x.abs().max())  # one read of the device: the window, and NaN/Inf show in it
            if not math.isfinite(largest):
                check_finite(flat, self.spec)
            top = window_top(largest, flat.dtype)
            codes = _encode_torch(x, seed, top - WINDOW + 1, self.deterministic)
        header = torch.tensor([top], dtype=torch.int8, device=x.device)
        return Packet({"top": header, "codes": codes}, flat.shape, flat.dtype)

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """``total += decompress(packet)``, decoded and added in one pass (the same bits)."""
        codes = packet["codes"]
        if use_numba(codes) and use_numba(total):
            _decode_add_numba(as_numpy(codes), int(packet["top"][0]), as_numpy(total), ADD, 0)
        else:
            super().accumulate(total, packet)

    def accumulate_into(self, total: torch.Tensor, packet: Packet, store: bool = False,
                        count: int = 0) -> int:
        """:meth:`Compressor.accumulate_into` in the decode's one pass on the CPU."""
        codes = packet["codes"]
        if use_numba(codes) and use_numba(total):
            top = _decode_add_numba(as_numpy(codes), int(packet["top"][0]), as_numpy(total),
                                    fold_mode(store, count), count)
            return finish_fold(total, top, store, count)
        return super().accumulate_into(total, packet, store, count)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        codes = packet["codes"]
        if use_numba(codes):
            out = torch.empty(codes.numel(), dtype=torch.float32)
            _decode_numba(as_numpy(codes), int(packet["top"][0]), as_numpy(out))
            return out
        return decode_table(packet["top"], codes.device)[codes.long()]
