"""1-bit SGD (Seide et al., INTERSPEECH 2014), and the exact group means its descendants share.

GRACE §3.1: every element below a threshold τ (0 by default) is quantized to '0', every other to '1';
Q⁻¹ decodes '0' and '1' to the mean of the local values below τ and of those at or above τ. The method
comes with its memory, m_k = g_k − Q⁻¹(Q(g_k + m_k)) (GRACE Table 1: EF on), which is the ``residual``
feedback. Seide et al. quantize column by column of a weight matrix; GRACE, and this module, use one pair
of means per tensor.

**Exact group means.** Adaptive threshold SGD (one mean per side), SketchML (one mean per bucket) and
EF-signSGD (the mean magnitude) also send means of groups of elements. A float sum depends on the order
of its additions, so a numba loop and a torch reduction would send different bits. Here every element is
turned into a fixed-point integer, ``trunc(x · 2^s)`` with ``2^s`` chosen from the largest magnitude so
that no sum can overflow an int64; integer sums do not depend on the order, so every path and device
gets the same means (to about 2^-39 of the largest magnitude for 2^22 elements).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradpress.core.compressor import Compressor, check_finite, finish_fold, register, sum_addends
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context
from gradpress.kernels.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.kernels.jit import (
    ADD,
    FINISH,
    FINISH_POW2,
    STORE,
    as_numpy,
    fold,
    fold_mode,
    fold_top,
    fused,
    jit,
    kernel,
    select_bits64,
    use_numba,
    wide_vectors,
)
from gradpress.kernels.passes import scaled_into_bits


# -- exact group means (shared with sign.py, adaptive.py, sketchml.py) -----------------------------
def as_float32(flat: torch.Tensor) -> torch.Tensor:
    """The float32 tensor the kernels work on (fp16/bf16 values convert exactly)."""
    return flat if flat.dtype == torch.float32 else flat.float()


def extreme(x: torch.Tensor) -> float:
    """The element of ``x`` (float32) of largest magnitude, with its sign (a positive one wins a tie)."""
    return extreme_and_nonzeros(x)[0]


def extreme_and_nonzeros(x: torch.Tensor) -> tuple[float, int]:
    """:func:`extreme`, and the number of non-zero elements, in one pass."""
    if use_numba(x):
        top, top_abs, nonzeros = _max_bits(as_numpy(x).view(np.int32))
        value = float(np.array([top_abs], dtype=np.int32).view(np.float32)[0])
        return (value if top == top_abs else -value), int(nonzeros)
    low, high = torch.aminmax(x)  # one read by the host (one wait on a GPU); the count exact in float64
    low, high, nonzeros = torch.stack([low.double(), high.double(), torch.count_nonzero(x).double()]).tolist()
    return (high if high >= -low else low), int(nonzeros)


def max_magnitude(x: torch.Tensor) -> float:
    """max |x| of ``x`` (float32), one reduction (NaN/Inf give a non-finite result)."""
    if use_numba(x):
        top = _max_magnitude_bits(as_numpy(x).view(np.uint32))
        return float(np.array([top], dtype=np.uint32).view(np.float32)[0])
    return float(x.abs().max())


def checked_max_magnitude(x: torch.Tensor, where: str) -> float:
    """:func:`max_magnitude`, serving as the NaN/Inf check of a ``checks_finite`` method (see
    :func:`checked_extreme_and_nonzeros`)."""
    largest = max_magnitude(x)
    if not math.isfinite(largest):
        check_finite(x, where)
    return largest


def checked_extreme_and_nonzeros(x: torch.Tensor, where: str) -> tuple[float, int]:
    """:func:`extreme_and_nonzeros` that also serves as the NaN/Inf check of a ``checks_finite`` method:
    a NaN or Inf has the largest magnitude (its bit pattern, or torch's NaN-propagating min/max), so the
    extreme is finite exactly when every element is; when it is not, :func:`check_finite` raises (one
    more pass, counting them for its message)."""
    largest, nonzeros = extreme_and_nonzeros(x)
    if not math.isfinite(largest):
        check_finite(x, where)
    return largest, nonzeros


def fixed_point_scale(bound: float, count: int) -> float:
    """2^s such that ``count`` values of magnitude at most ``bound``, each times 2^s and truncated to an
    integer, sum to less than 2^62 in magnitude."""
    if bound == 0.0:
        return 1.0
    exponent = math.frexp(bound)[1]  # bound < 2^exponent
    return math.ldexp(1.0, 62 - max(count, 1).bit_length() - exponent)


def checked_fixed_point_scale(x: torch.Tensor, where: str) -> float:
    """:func:`fixed_point_scale` for the elements of ``x`` (float32), from its largest magnitude
    (:func:`checked_max_magnitude`: the pass serves as the NaN/Inf check of a ``checks_finite`` method)."""
    return fixed_point_scale(checked_max_magnitude(x, where), x.numel())


def to_fixed(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``trunc(x · scale)`` as int64 (torch path; the kernels compute the same per element)."""
    return (x.double() * scale).to(torch.int64)


def mean_of(total: int, count: int, scale: float) -> float:
    """A group's mean from its fixed-point sum (0 for an empty group)."""
    return float(total) / scale / count if count else 0.0


@jit
def _max_magnitude_bits(bits, addends=None):  # pragma: no cover - compiled
    """Largest float32 magnitude's bit pattern (uint32; NaN/Inf patterns are above every finite one).
    ``addends`` (m, g, β, γ) or None: bits are not read but written, x = fl32(fl32(m·β) + fl32(g·γ))
    (fused error feedback: :func:`~gradpress.kernels.passes.scaled_into_bits`)."""
    if addends is not None:
        return scaled_into_bits(addends, bits, 0, bits.size)
    top = np.uint32(0)
    for i in range(bits.size):
        top = max(top, bits[i] & np.uint32(0x7FFFFFFF))
    return top


@jit
def minus_levels(x, tau, low, high):  # pragma: no cover - compiled
    """x_i ← x_i − (high if x_i ≥ τ else low) in float32 (finite x; τ, low, high as float32): the
    residual of a two-level quantizer whose bit i is [x_i ≥ τ] (1-bit SGD; EF-signSGD with τ = 0, where
    −0.0 ≥ 0 as its sign bit says)."""
    wide_vectors()
    tau, low, high = np.float32(tau), np.float32(low), np.float32(high)
    for i in range(x.size):
        j = np.uint64(i)
        v = x[j]
        x[j] = v - (high if v >= tau else low)


@jit
def _max_bits(bits):  # pragma: no cover - compiled
    """Largest float32 bit pattern as int32, the largest magnitude's pattern, and the count of non-zero
    magnitudes (integer reductions vectorize)."""
    top = np.int32(-(2**31))
    top_abs = np.int32(0)
    nonzeros = 0
    for i in range(bits.size):
        b = bits[i]
        magnitude = b & np.int32(0x7FFFFFFF)
        top = max(top, b)
        top_abs = max(top_abs, magnitude)
        nonzeros += magnitude != 0
    return top, top_abs, nonzeros


# -- 1-bit SGD ------------------------------------------------------------------------------------
@register("onebit")
@dataclass(repr=False)
class OneBit(Compressor):
    """1-bit SGD (Seide et al. 2014; GRACE §3.1): bit = [x ≥ τ], decoded to the mean of its side.

    Wire: the bits packed (ceil(d/8) bytes) and the two means as float32 (mean below τ, mean at or
    above τ): d + 64 bits. Deterministic and biased; used with residual error feedback, as in the paper.
    """

    tau: float = param(0.0, "[0, inf)")  # Seide et al. split at 0; τ > 0 sends small positives with the negatives
    examples = ("onebit:tau=0.5",)
    checks_finite = True  # the pass for the fixed-point scale shows NaN/Inf

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return packed_nbytes(numel, 1) + 8

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = as_float32(flat)
        packet = self._encode(x, checked_fixed_point_scale(x, self.spec))
        packet.shape, packet.dtype = flat.shape, flat.dtype
        return packet

    def _encode(self, x: torch.Tensor, scale: float) -> Packet:
        """The packet of float32 ``x`` (finite), given its fixed-point scale."""
        n = x.numel()
        tau = np.float32(self.tau)
        if use_numba(x):
            bits = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8)
            high_sum, low_sum, high_count = _encode(as_numpy(x), tau, scale, as_numpy(bits))
        else:
            high = x >= float(tau)  # (a float32 number, exact)
            fixed = to_fixed(x, scale)
            zero = fixed.new_zeros(())
            high_sum, low_sum, high_count = torch.stack([  # one read by the host (one wait on a GPU)
                torch.where(high, fixed, zero).sum(), torch.where(high, zero, fixed).sum(), high.sum()]).tolist()
            bits = pack_mask(high)
        means = [mean_of(low_sum, n - high_count, scale), mean_of(high_sum, high_count, scale)]
        return Packet({"bits": bits, "means": torch.tensor(means, dtype=torch.float32, device=x.device)},
                      x.shape, torch.float32)

    def compress_residual_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                              ctx: Context | None = None, beta: float = 1.0,
                              gamma: float = 1.0) -> tuple[Packet, bool]:
        """1-bit SGD of φ = β·m + γ·g and its residual e = φ − Q⁻¹(Q(φ)) written into ``out`` (see
        :meth:`Compressor.compress_residual_sum`): φ formed in the pass that finds the largest |φ| (the
        fixed-point scale), the encoding pass as :meth:`compress`'s, then e in place: no full-size
        temporary, the bits of :meth:`compress_sum` then :meth:`residual`. On NaN/Inf ``out`` holds φ."""
        addends = sum_addends(memory, grad, out, beta, gamma)
        if addends is None:
            return super().compress_residual_sum(memory, grad, out, ctx, beta, gamma)
        x = as_numpy(out).reshape(-1)
        largest = float(np.array([_max_magnitude_bits(x.view(np.uint32), addends)], dtype=np.uint32)
                        .view(np.float32)[0])
        if not math.isfinite(largest):
            check_finite(out, self.spec)
        packet = self._encode(out.view(-1), fixed_point_scale(largest, x.size))
        low, high = packet["means"].numpy()
        minus_levels(x, np.float32(self.tau), low, high)
        packet.shape = out.shape
        return packet, True

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return decode_two_levels(packet["bits"], packet["means"], packet.numel)

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """``total += decompress(packet)``, decoded and added in one pass on the CPU (the same bits)."""
        bits, means = packet["bits"], packet["means"]
        if not (use_numba(bits) and add_two_levels(bits, float(means[0]), float(means[1]), total)):
            super().accumulate(total, packet)

    def accumulate_into(self, total: torch.Tensor, packet: Packet, store: bool = False,
                        count: int = 0) -> int:
        """:meth:`Compressor.accumulate_into` in the decode's one pass on the CPU."""
        bits, means = packet["bits"], packet["means"]
        done = None
        if use_numba(bits):
            done = fold_two_levels(bits, float(means[0]), float(means[1]), total, store, count)
        return super().accumulate_into(total, packet, store, count) if done is None else done


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask as packed bits (the :func:`gradpress.kernels.bits.pack_bits` layout)."""
    return pack_bits(mask.to(torch.uint8), 1)


def decode_two_levels(bits: torch.Tensor, levels: torch.Tensor, n: int) -> torch.Tensor:
    """``levels[bit]`` for each of the ``n`` packed bits (float32)."""
    if use_numba(bits):
        out = torch.empty(n, dtype=torch.float32)
        _decode(as_numpy(bits), float(levels[0]), float(levels[1]), as_numpy(out))
        return out
    mask = unpack_bits(bits, 1, n).bool()
    return torch.where(mask, levels[1], levels[0])


def add_two_levels(bits: torch.Tensor, low: float, high: float, total: torch.Tensor) -> bool:
    """``total += decode_two_levels(bits, [low, high])`` on a flat float32 ``total``, decoded and added in
    one numba pass (no decoded temporary: an all-gather's sum); ``low`` and ``high`` are float32 values.
    False, with nothing done, where the numba path does not apply (the caller then adds the decode)."""
    if not (use_numba(bits) and use_numba(total)):
        return False
    _add_two_levels(as_numpy(bits), np.float32(low), np.float32(high), as_numpy(total), ADD, 0)
    return True


def fold_two_levels(bits: torch.Tensor, low: float, high: float, total: torch.Tensor, store: bool,
                    count: int) -> int | None:
    """:meth:`Compressor.accumulate_into` of ``decode_two_levels(bits, [low, high])`` in one numba pass
    (what it returns); None, with nothing done, where the numba path does not apply."""
    if not (use_numba(bits) and use_numba(total)):
        return None
    top = _add_two_levels(as_numpy(bits), np.float32(low), np.float32(high), as_numpy(total),
                          fold_mode(store, count), count)
    return finish_fold(total, top, store, count)


@kernel(inline="always")
def _fold_two_levels(packed, low, high, total, mode, count, reciprocal):  # pragma: no cover - compiled
    """:func:`gradpress.kernels.jit.fold` of (high if bit i is set, else low) into total_i (float32): 64 values
    per word of bits, one vector select into a 64-value scratch, then one vectorized fold; the largest
    exponent field stored when finishing."""
    n = total.size
    full = n - n % 64
    words = packed[:full // 8].view(np.uint64)
    scratch = np.empty(64, dtype=np.float32)
    largest = np.int32(0)
    for w in range(full // 64):
        select_bits64(words[np.uint64(w)], low, high, scratch, 0)
        for k in range(64):
            v = fold(total[np.uint64(64 * w + k)], scratch[np.uint64(k)], mode, count, reciprocal)
            total[np.uint64(64 * w + k)] = v
            largest = fold_top(largest, mode, v)
    for i in range(full, n):
        v = fold(total[i], high if (packed[i // 8] >> np.uint8(i % 8)) & np.uint8(1) else low, mode, count,
                 reciprocal)
        total[i] = v
        largest = fold_top(largest, mode, v)
    return largest


@fused
def _add_two_levels(packed, low, high, total, mode, count):  # pragma: no cover - compiled
    """total_i += high if bit i is set, else low (or another :data:`gradpress.kernels.jit.ADD` mode: a constant
    in each call of :func:`_fold_two_levels`)."""
    wide_vectors()
    c, r = np.float32(count), np.float32(1.0 / max(count, 1))
    if mode == STORE:
        return _fold_two_levels(packed, low, high, total, STORE, c, r)
    if mode == FINISH:
        return _fold_two_levels(packed, low, high, total, FINISH, c, r)
    if mode == FINISH_POW2:
        return _fold_two_levels(packed, low, high, total, FINISH_POW2, c, r)
    return _fold_two_levels(packed, low, high, total, ADD, c, r)


@jit
def _encode(x, tau, scale, out):  # pragma: no cover - compiled
    """Pack bit i = [x_i ≥ τ] (byte i//8, position i%8); return the fixed-point sums of each side and
    the count at or above τ. Whole 64-element words are stored as one uint64 (the same bytes on the
    little-endian CPUs numba compiles for), the rest byte by byte."""
    n = x.size
    words = n // 64
    out_words = out[: 8 * words].view(np.uint64)
    total = high_sum = high_count = np.int64(0)
    for j in range(words):
        out_words[j], t, h, c = _encode_word(x, 64 * j, tau, scale)
        total += t
        high_sum += h
        high_count += c
    for j in range(8 * words, (n + 7) // 8):
        out[j], t, h, c = _encode_byte(x, 8 * j, min(8, n - 8 * j), tau, scale)
        total += t
        high_sum += h
        high_count += c
    return high_sum, total - high_sum, high_count


@kernel(inline="always")
def _encode_word(x, start, tau, scale):  # pragma: no cover - compiled
    word = np.uint64(0)
    total = high_sum = high_count = np.int64(0)
    for k in range(64):
        v = x[start + k]
        q = np.int64(np.float64(v) * scale)
        high = v >= tau
        word |= np.uint64(high) << np.uint64(k)
        total += q
        high_sum += q if high else np.int64(0)
        high_count += np.int64(high)
    return word, total, high_sum, high_count


@kernel(inline="always")
def _encode_byte(x, start, count, tau, scale):  # pragma: no cover - compiled
    byte = np.uint8(0)
    total = high_sum = high_count = np.int64(0)
    for k in range(count):
        v = x[start + k]
        q = np.int64(np.float64(v) * scale)
        high = v >= tau
        byte |= np.uint8(high) << np.uint8(k)
        total += q
        high_sum += q * np.int64(high)
        high_count += np.int64(high)
    return byte, total, high_sum, high_count


@jit
def _decode(bits, low, high, out):  # pragma: no cover - compiled
    """out_i = high if bit i is set else low."""
    n = out.size
    full = n // 8
    for j in range(full):
        _decode_byte(bits[j], np.float32(low), np.float32(high), out, 8 * j, 8)
    if n > 8 * full:
        _decode_byte(bits[full], np.float32(low), np.float32(high), out, 8 * full, n - 8 * full)


@kernel(inline="always")
def _decode_byte(byte, low, high, out, start, count):  # pragma: no cover - compiled
    byte = np.uint32(byte)
    for k in range(count):
        out[start + k] = high if (byte >> np.uint32(k)) & np.uint32(1) else low
