"""Sign compressors: signSGD, SIGNUM (Bernstein et al. 2018, 2019) and EF-signSGD (Karimireddy et al. 2019).

GRACE §3.1: signSGD quantizes negative elements to −1 and the others to +1 (one bit each); SIGNUM sends
the sign of a momentum z ← (1 − δ)·g + δ·z; the workers' signs are combined by a majority vote,
sign(Σ_i sign(z_i)) (Bernstein et al. 2019, Algorithm 1). EF-signSGD sends (‖x‖₁/d)·sign(x) with error
feedback (Karimireddy et al. 2019, Algorithm 1).

Bits are packed as :func:`gradpress.kernels.bits.pack_bits` lays them out: bit i = [x_i ≥ 0].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numba.cpython.unsafe.numbers import leading_zeros

from gradpress.compressors.onebit import (
    add_two_levels,
    as_float32,
    checked_fixed_point_scale,
    decode_two_levels,
    fold_two_levels,
    mean_of,
    minus_levels,
    pack_mask,
    to_fixed,
)
from gradpress.compressors.sparsify import float32_decompress
from gradpress.core.compressor import Compressor, check_finite, register, scaled_sum, sum_addends
from gradpress.core.feedback import KeyedMemory, SumParts, feedback_registry, spare_for
from gradpress.core.packet import Packet
from gradpress.core.registry import check_params_of, param
from gradpress.core.rng import Context
from gradpress.kernels import simd as V
from gradpress.kernels.bits import packed_nbytes, unpack_bits
from gradpress.kernels.jit import (
    as_numpy,
    f64_from_bits,
    jit,
    kernel,
    select_bits64,
    sign_bits64,
    sign_flags64,
    use_numba,
    wide_vectors,
)
from gradpress.kernels.passes import scaled_into_bits


@register("signsgd")
@dataclass(repr=False)
class SignSGD(Compressor):
    """signSGD with majority vote (Bernstein et al., ICML 2018; ICLR 2019, Algorithm 1).

    One bit per element, [x ≥ 0], decoded to ±1; :meth:`aggregate` is the majority vote
    sign(Σ_i sign(x_i)), 0 where the votes tie. One more byte says whether the tensor is non-zero: an
    all-zero gradient (a frozen layer) decodes to zeros and casts no vote, instead of +1 everywhere.

    No error feedback by default: GRACE Table 1 runs signSGD and SIGNUM without it (§5.3: EF harms
    them); EF-signSGD is the variant built for it.
    """

    @property
    def default_feedback(self) -> str:
        return "none"

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return packed_nbytes(numel, 1) + 1

    checks_finite = True  # the packing pass keeps the largest magnitude, which shows NaN/Inf

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = as_float32(flat)
        if use_numba(x):
            signs = torch.empty(packed_nbytes(x.numel(), 1), dtype=torch.uint8)
            flag = torch.empty(1, dtype=torch.uint8)
            if _pack_signs(x.numpy().view(np.uint32), signs.numpy(), flag.numpy()) >= NON_FINITE:
                check_finite(x, self.spec)
        else:
            signs, nonzero = pack_signs(x, self.spec)
            flag = torch.tensor([nonzero], dtype=torch.uint8, device=flat.device)
        return Packet({"signs": signs, "nonzero": flag}, flat.shape, flat.dtype)

    def compress_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                     ctx: Context | None = None, beta: float = 1.0, gamma: float = 1.0) -> Packet:
        """The signs of φ = β·m + γ·g with the sum formed in the packing pass (see
        :meth:`Compressor.compress_sum`; SIGNUM's momentum z ← δ·z + (1 − δ)·g): per block, φ is written
        to ``out`` and packed from L1, the same bits as the sum, then :meth:`compress`."""
        addends = sum_addends(memory, grad, out, beta, gamma)
        if addends is None:
            return super().compress_sum(memory, grad, out, ctx, beta, gamma)
        x = out.view(-1)
        signs = torch.empty(packed_nbytes(x.numel(), 1), dtype=torch.uint8)
        flag = torch.empty(1, dtype=torch.uint8)
        if _pack_signs(x.numpy().view(np.uint32), signs.numpy(), flag.numpy(), addends) >= NON_FINITE:
            check_finite(x, self.spec)
        return Packet({"signs": signs, "nonzero": flag}, out.shape, torch.float32)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        one = float(packet["nonzero"].item())
        return decode_signs(packet["signs"], -one, one, packet.numel)

    def decompress(self, packet: Packet) -> torch.Tensor:
        return float32_decompress(self, packet)

    def aggregate(self, packets: list[Packet], out: torch.Tensor | None = None) -> torch.Tensor:
        """Majority vote (Bernstein et al. 2019, Algorithm 1): sign(Σ_i sign(x_i)); a tie gives 0
        (a new tensor: ``out`` is only a permission)."""
        first = packets[0]
        if first.numel == 0:
            return self.decompress(first)
        votes = torch.zeros(first.numel, dtype=torch.int32, device=first.device)
        for packet in packets:
            if int(packet["nonzero"][0]):
                votes += unpack_bits(packet["signs"], 1, packet.numel).to(torch.int32) * 2 - 1
        return votes.sign().to(first.dtype).view(first.shape)


@register("signum")
@dataclass(repr=False)
class Signum(SignSGD):
    """SIGNUM with majority vote (Bernstein et al. 2018, Algorithm 3; 2019, Algorithm 1).

    The compressor is signSGD's; the momentum z ← δ·z + (1 − δ)·g is per-tensor state, kept by the
    ``signum`` feedback memory (its spec key ``momentum`` is δ = 0.9), which is this method's default.
    Weight decay λ enters the update after the vote, x ← x − η·(sign(Σ_i sign(z_i)) + λ·x): that is
    exactly ``torch.optim.SGD(lr=η, momentum=0, weight_decay=λ)`` applied to the aggregated gradient, so
    it is the optimizer's job; a gradient-only pipeline never sees x.
    """

    @property
    def default_feedback(self) -> str:
        return "signum"


@register("efsignsgd")
@dataclass(repr=False)
class EFSignSGD(Compressor):
    """EF-signSGD (Karimireddy et al., ICML 2019, Algorithm 1): C(p) = (‖p‖₁/d)·sign(p).

    Wire: the sign bits and one float32 scale ‖p‖₁/d (d + 32 bits). With the ``residual`` memory
    (the default) the runtime compresses p = g + e and keeps e ← p − C(p), from the first step on
    (e₀ = 0). Karimireddy et al. put the learning rate γ inside p = γ·g + e; C is positively
    homogeneous, so with a constant γ the two are the same up to that factor (``residual:gamma=γ``
    reproduces the paper's scaling exactly when the optimizer's learning rate is 1).
    """

    checks_finite = True  # the max |x| that sets the fixed-point scale is NaN/Inf exactly when x holds one

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return packed_nbytes(numel, 1) + 4

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = as_float32(flat)
        n = x.numel()
        if use_numba(x):
            signs = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8)
            magnitude = torch.empty(1, dtype=torch.float32)
            if not _scaled_signs(x.numpy().view(np.uint32), signs.numpy(), magnitude.numpy()):
                check_finite(x, self.spec)
        else:
            scale = checked_fixed_point_scale(x, self.spec)
            signs = pack_mask(x >= 0)
            total = int(to_fixed(x, scale).abs().sum())
            magnitude = torch.tensor([mean_of(total, n, scale)], dtype=torch.float32, device=x.device)
        return Packet({"signs": signs, "scale": magnitude}, flat.shape, flat.dtype)

    def compress_residual_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                              ctx: Context | None = None, beta: float = 1.0,
                              gamma: float = 1.0) -> tuple[Packet, bool]:
        """EF-signSGD of φ = β·m + γ·g and its residual e = φ − (‖φ‖₁/d)·sign(φ) written into ``out``
        (see :meth:`Compressor.compress_residual_sum`): φ formed in the pass that finds the largest |φ|
        (the fixed-point scale), the sign and L1 pass as :meth:`compress`'s, then e in place; the bits
        of :meth:`compress_sum` then :meth:`residual`. On NaN/Inf ``out`` holds φ."""
        addends = sum_addends(memory, grad, out, beta, gamma)
        if addends is None:
            return super().compress_residual_sum(memory, grad, out, ctx, beta, gamma)
        x = out.view(-1)
        signs = torch.empty(packed_nbytes(x.numel(), 1), dtype=torch.uint8)
        magnitude = torch.empty(1, dtype=torch.float32)
        if not _scaled_signs(x.numpy().view(np.uint32), signs.numpy(), magnitude.numpy(), addends):
            check_finite(x, self.spec)
        scale = magnitude.numpy()[0]
        minus_levels(x.numpy(), np.float32(0.0), -scale, scale)  # bit i is [φ_i ≥ 0]
        return Packet({"signs": signs, "scale": magnitude}, out.shape, torch.float32), True

    def _decompress(self, packet: Packet) -> torch.Tensor:
        scale = float(packet["scale"].item())
        return decode_signs(packet["signs"], -scale, scale, packet.numel)

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """``total += decompress(packet)``, decoded and added in one pass on the CPU (the same bits)."""
        scale = float(packet["scale"].item())
        if not add_two_levels(packet["signs"], -scale, scale, total):
            super().accumulate(total, packet)

    def accumulate_into(self, total: torch.Tensor, packet: Packet, store: bool = False,
                        count: int = 0) -> int:
        """:meth:`Compressor.accumulate_into` in the decode's one pass on the CPU."""
        done = None
        if use_numba(packet["signs"]):
            scale = float(packet["scale"].item())
            done = fold_two_levels(packet["signs"], -scale, scale, total, store, count)
        return super().accumulate_into(total, packet, store, count) if done is None else done

    def decompress(self, packet: Packet) -> torch.Tensor:
        return float32_decompress(self, packet)


def pack_signs(x: torch.Tensor, where: str = "signsgd") -> tuple[torch.Tensor, bool]:
    """Packed bits [x_i ≥ 0] of a float32 tensor, and whether any element is non-zero; NaN/Inf in x
    raise :class:`~gradpress.core.compressor.NonFiniteError` (as ``where``'s)."""
    if use_numba(x):
        out, flag = torch.empty(packed_nbytes(x.numel(), 1), dtype=torch.uint8), np.empty(1, dtype=np.uint8)
        top = _pack_signs(as_numpy(x).view(np.uint32), as_numpy(out), flag)
        if top >= NON_FINITE:
            check_finite(x, where)
        return out, bool(top)
    check_finite(x, where)
    return pack_mask(x >= 0), bool(x.any())


def decode_signs(signs: torch.Tensor, low: float, high: float, n: int) -> torch.Tensor:
    """float32 ``high`` where bit i is set, ``low`` elsewhere, for the ``n`` packed bits (the values of
    :func:`~gradpress.compressors.onebit.decode_two_levels`: one numba pass on the CPU)."""
    if use_numba(signs):
        out = torch.empty(n, dtype=torch.float32)
        _decode_signs(signs.numpy(), low, high, out.numpy())
        return out
    levels = torch.tensor([low, high], dtype=torch.float32, device=signs.device)
    return decode_two_levels(signs, levels, n)


# -- kernels: per block of BLOCK values (read from L1 by each loop), a vectorized loop for the reduction (the
# largest magnitude, the fixed-point L1 sum), then 64 sign bits at a time as one vector compare
# (:func:`~gradpress.kernels.jit.sign_bits64`); decoding selects 64 values per word of bits. Indices are unsigned:
# numba then drops its negative-index wraparound, which would keep LLVM from vectorizing.
BLOCK = 4096  # a multiple of 64
NON_FINITE = 0x7F800000  # |x| bit patterns from here up are Inf and NaN
_U32, _U64 = np.uint32, np.uint64


@jit
def top_magnitude(bits):  # pragma: no cover - compiled
    """The largest |x| of float32 bit patterns ``bits``, as a bit pattern (≥ NON_FINITE: NaN/Inf)."""
    wide_vectors()
    top = _U32(0)
    for i in range(bits.size):
        top = max(top, bits[_U64(i)] & _U32(0x7FFFFFFF))
    return top


@kernel(inline="always")
def _sign_words(bits, start, stop, words):  # pragma: no cover - compiled
    """words[w] = bits [x_i ≥ 0] of x[64w:64w + 64], for the whole words in [start, stop)."""
    for w in range(start // 64, stop // 64):
        words[_U64(w)] = sign_bits64(bits, w * 64)


@kernel(inline="always")
def _sign_tail(bits, out):  # pragma: no cover - compiled
    """The bytes of ``out`` after the whole 64-bit words, bit by bit."""
    n = bits.size
    for i in range(n - n % 64, n):
        if i % 8 == 0:
            out[i // 8] = 0
        out[i // 8] |= np.uint8(bits[i] <= _U32(0x80000000)) << np.uint8(i % 8)


@jit
def _pack_signs(bits, out, nonzero, addends=None):  # pragma: no cover - compiled
    """bit i = [x_i ≥ 0]: sign bit clear, or a zero of either sign (IEEE compares −0.0 ≥ 0 true), i.e.
    pattern ≤ 0x80000000; nonzero[0] = whether some x_i ≠ 0. Returns 0 when every x_i is zero, at least
    NON_FINITE when some x_i is NaN/Inf, a value in between otherwise. ``addends`` (m, g, β, γ) or None:
    x = fl32(fl32(m·β) + fl32(g·γ)) is formed 16 values at a time in registers, packed from there and
    written around the caches (fused error feedback, SIGNUM's momentum; numba prunes the branch for
    None), and the value returned is the largest |x| as a bit pattern. Streamed, the 4 MB of a 2^20
    momentum took 0.31 ms against 0.47 ms written through the cache and read back per block, all of it
    from memory.

    Without addends each word of 64 values is loaded once, for its sign bits and both flags
    (:func:`~gradpress.kernels.jit.sign_flags64`): a running maximum of the magnitudes, as the addends' pass
    keeps, took 1.1× the time."""
    wide_vectors()
    n = bits.size
    full = n - n % 64
    words = out[:full // 8].view(np.uint64)
    top = _U32(0)
    if addends is not None:
        m, g, x = V.pointer(addends[0]), V.pointer(addends[1]), V.pointer(bits.view(np.float32))
        beta, gamma, magnitude = V.fsplat(addends[2]), V.fsplat(addends[3]), V.isplat(_U32(0x7FFFFFFF))
        tops = V.isplat(_U32(0))
        for w in range(full // 64):
            word = _U64(0)
            for q in range(4):
                i = w * 64 + q * 16
                v = V.add(V.mul(V.load(m, i), beta), V.mul(V.load(g, i), gamma))
                V.store_stream(x, i, v)
                word |= V.sign_mask16(v) << _U64(16 * q)
                tops = V.umax(tops, V.and_(V.bits(v), magnitude))
            words[_U64(w)] = word
        top = max(V.hmax(tops), scaled_into_bits(addends, bits, full, n))
    else:
        bad, some = _U64(0), _U64(0)
        for w in range(full // 64):
            signs, nonfinite, nonzeros = sign_flags64(bits, w * 64)
            words[_U64(w)] = signs
            bad |= nonfinite
            some |= nonzeros
        top = _U32(NON_FINITE) if bad else _U32(1) if some else _U32(0)
    for i in range(full, n):
        top = max(top, bits[i] & _U32(0x7FFFFFFF))
    _sign_tail(bits, out)
    nonzero[0] = top != 0
    return top


@jit
def _pack_signs_l1(bits, scale, out, mean):  # pragma: no cover - compiled
    """Sign bits [x_i ≥ 0] as :func:`_pack_signs` (x finite), and mean[0] = ‖x‖₁/d (float32) from the
    exact fixed-point sum Σ|trunc(x_i · scale)| (int64: see
    :func:`~gradpress.compressors.onebit.fixed_point_scale`), formed as :func:`~gradpress.compressors.onebit.mean_of`
    does (float64 of the sum, / scale, / d)."""
    wide_vectors()
    n = bits.size
    x = bits.view(np.float32)
    full = n - n % 64
    words = out[:full // 8].view(np.uint64)
    total = np.int64(0)
    narrow = scale <= 2.0**127  # then |x|·2^s is exact in float32 too (or below 2^-126, truncated to 0 alike)
    scale32 = np.float32(scale if narrow else 1.0)
    for start in range(0, full, BLOCK):
        stop = min(full, start + BLOCK)
        if narrow:  # trunc(|x|·2^s) = |trunc(x·2^s)|, formed without a float64 conversion
            for i in range(start, stop):
                total += np.int64(abs(x[_U64(i)]) * scale32)
        else:
            for i in range(start, stop):
                total += np.int64(np.float64(abs(x[_U64(i)])) * scale)
        _sign_words(bits, start, stop, words)
    for i in range(full, n):
        total += np.int64(np.float64(abs(x[i])) * scale)
    _sign_tail(bits, out)
    mean[0] = np.float32(np.float64(total) / scale / np.float64(n)) if n else np.float32(0.0)
    return total


@jit
def _scaled_signs(bits, out, mean, addends=None):  # pragma: no cover - compiled
    """EF-signSGD's encoder in one call: the largest |x| (False at once if it is NaN/Inf), the fixed-point
    scale :func:`~gradpress.compressors.onebit.fixed_point_scale` gives for it (the same power of two,
    from its bits), then :func:`_pack_signs_l1`. ``addends`` (m, g, β, γ) or None: x = fl32(fl32(m·β) +
    fl32(g·γ)) is written in the pass that finds the largest (fused error feedback)."""
    if addends is None:
        top = top_magnitude(bits)
    else:
        top = scaled_into_bits(addends, bits, 0, bits.size)
    if top >= _U32(NON_FINITE):
        return False
    scale = 1.0
    if top:  # frexp's exponent of the largest: E − 126 for a normal float32, bit length − 149 for a subnormal
        biased = np.int64(top >> _U32(23))
        exponent = biased - 126 if biased else _bit_length(np.int64(top)) - 149
        scale = f64_from_bits(np.uint64(62 - _bit_length(max(bits.size, 1)) - exponent + 1023) << np.uint64(52))
    _pack_signs_l1(bits, scale, out, mean)
    return True


@kernel(inline="always")
def _bit_length(v):  # pragma: no cover - compiled
    """Python's int.bit_length for 0 ≤ v < 2^63."""
    return 64 - np.int64(leading_zeros(np.uint64(v)))


@jit
def _decode_signs(packed, low, high, out):  # pragma: no cover - compiled
    """out_i = high if bit i is set, else low (both rounded to float32): 64 values per word of bits, one
    vector select."""
    low, high = np.float32(low), np.float32(high)
    n = out.size
    full = n - n % 64
    words = packed[:full // 8].view(np.uint64)
    for w in range(full // 64):
        select_bits64(words[_U64(w)], low, high, out, w * 64)
    for i in range(full, n):
        out[i] = high if (packed[i // 8] >> np.uint8(i % 8)) & np.uint8(1) else low


# -- SIGNUM's momentum ------------------------------------------------------------------------------
@feedback_registry.register("signum")
@dataclass
class SignumMomentum(KeyedMemory):
    """SIGNUM's momentum (Bernstein et al. 2018, Algorithm 3; GRACE §3.1): the worker compresses
    z ← δ·z + (1 − δ)·g, z₀ = 0, kept in float32 per key. δ = 0 is plain signSGD."""

    momentum: float = param(0.9, "[0, 1)")
    state_name = "momentum"
    _spare: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_params_of(self)  # also when built directly, not from a spec

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """z·δ + g·(1 − δ) in float32: one numba pass on the CPU (in the key's spare buffer, the storage
        of the z before last), the same bits as torch's two products and sum (float32 operations in the
        same order, δ and 1 − δ rounded to float32: :func:`~gradpress.core.compressor.scaled_sum`)."""
        z = self._stored_for(key, grad)
        g = grad.float()
        if z is None:
            return g * (1.0 - self.momentum)
        spare = self._spare.pop(key, None)
        if spare is None or spare.shape != z.shape or spare.device != z.device:
            spare = torch.empty_like(z)
        return scaled_sum(z, g, self.momentum, 1.0 - self.momentum, spare)

    def sum_parts(self, key: str, grad: torch.Tensor) -> SumParts | None:
        """(z, the key's spare buffer, δ, 1 − δ) for a float32 gradient beside a stored z on its device
        (see :meth:`Feedback.sum_parts`): signSGD's packing pass forms the momentum."""
        z = self._stored_for(key, grad)
        if z is None or grad.dtype != torch.float32 or z.device != grad.device:
            return None
        return SumParts(z, spare_for(self._spare, key, z), self.momentum, 1.0 - self.momentum)

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        self._memory[key] = compensated.to(torch.float32, copy=True)

    def update_from(self, key: str, compensated: torch.Tensor, packet: Packet, compressor: Compressor,
                    owned: bool = False) -> None:
        """z is kept as it was compressed (what was sent plays no part): no decoding, and no copy of a
        float32 z that :meth:`compensate` made (``owned``); the previous z becomes the key's spare buffer."""
        previous = self._memory.get(key)
        if owned and compensated.dtype == torch.float32:
            self._memory[key] = compensated
        else:
            self.update(key, compensated, compensated)
        if previous is not None and previous.data_ptr() != self._memory[key].data_ptr():
            self._spare[key] = previous
