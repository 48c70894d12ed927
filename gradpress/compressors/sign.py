"""Sign compressors: signSGD, SIGNUM (Bernstein et al. 2018, 2019) and EF-signSGD (Karimireddy et al. 2019).

GRACE §3.1: signSGD quantizes negative elements to −1 and the others to +1 (one bit each); SIGNUM sends
the sign of a momentum z ← (1 − δ)·g + δ·z; the workers' signs are combined by a majority vote,
sign(Σ_i sign(z_i)) (Bernstein et al. 2019, Algorithm 1). EF-signSGD sends (‖x‖₁/d)·sign(x) with error
feedback (Karimireddy et al. 2019, Algorithm 1).

Bits are packed as :func:`gradpress.bits.pack_bits` lays them out: bit i = [x_i ≥ 0].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from gradpress._numba import as_numpy, jit, use_numba
from gradpress.bits import packed_nbytes, unpack_bits
from gradpress.compressor import Compressor, register
from gradpress.compressors.onebit import (as_float32, checked_max_magnitude, decode_two_levels,
                                          fixed_point_scale, mean_of, pack_mask, to_fixed)
from gradpress.feedback import KeyedMemory, feedback_registry
from gradpress.packet import Packet
from gradpress.registry import check_params_of, param
from gradpress.rng import Context


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

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        signs, nonzero = pack_signs(as_float32(flat))
        flag = torch.tensor([nonzero], dtype=torch.uint8, device=flat.device)
        return Packet({"signs": signs, "nonzero": flag}, flat.shape, flat.dtype)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        one = packet["nonzero"].float()[0]
        return decode_two_levels(packet["signs"], torch.stack([-one, one]), packet.numel)

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
        scale = fixed_point_scale(checked_max_magnitude(x, self.spec), n)
        if use_numba(x):
            signs = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8)
            total = _pack_signs_l1(as_numpy(x), scale, as_numpy(signs))
        else:
            signs = pack_mask(x >= 0)
            total = int(to_fixed(x, scale).abs().sum())
        magnitude = torch.tensor([mean_of(total, n, scale)], dtype=torch.float32, device=x.device)
        return Packet({"signs": signs, "scale": magnitude}, flat.shape, flat.dtype)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        scale = packet["scale"][0]
        return decode_two_levels(packet["signs"], torch.stack([-scale, scale]), packet.numel)


def pack_signs(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Packed bits [x_i ≥ 0] of a float32 tensor, and whether any element is non-zero."""
    if use_numba(x):
        out = torch.empty(packed_nbytes(x.numel(), 1), dtype=torch.uint8)
        nonzero = _pack_signs(as_numpy(x).view(np.uint32), as_numpy(out))
        return out, bool(nonzero)
    return pack_mask(x >= 0), bool(x.any())


@jit
def _pack_signs(bits, out):  # pragma: no cover - compiled
    """bit i = [x_i ≥ 0]: sign bit clear, or a zero of either sign (IEEE compares −0.0 ≥ 0 true)."""
    n = bits.size
    full = n // 8
    nonzero = np.uint32(0)
    for j in range(full):
        out[j], any_set = _signs_byte(bits, 8 * j, 8)
        nonzero |= any_set
    if n > 8 * full:
        out[full], any_set = _signs_byte(bits, 8 * full, n - 8 * full)
        nonzero |= any_set
    return nonzero != 0


@njit(cache=True, inline="always")
def _signs_byte(bits, start, count):  # pragma: no cover - compiled
    byte = np.uint8(0)
    nonzero = np.uint32(0)
    for k in range(count):
        b = bits[start + k]
        magnitude = b & np.uint32(0x7FFFFFFF)
        nonzero |= magnitude
        byte |= np.uint8((b >> np.uint32(31)) == 0 or magnitude == 0) << np.uint8(k)
    return byte, nonzero


@jit
def _pack_signs_l1(x, scale, out):  # pragma: no cover - compiled
    """Sign bits [x_i ≥ 0] as :func:`_pack_signs`, and Σ|trunc(x_i · scale)| (the fixed-point ‖x‖₁)."""
    n = x.size
    full = n // 8
    total = np.int64(0)
    for j in range(full):
        out[j], part = _signs_l1_byte(x, 8 * j, 8, scale)
        total += part
    if n > 8 * full:
        out[full], part = _signs_l1_byte(x, 8 * full, n - 8 * full, scale)
        total += part
    return total


@njit(cache=True, inline="always")
def _signs_l1_byte(x, start, count, scale):  # pragma: no cover - compiled
    byte = np.uint8(0)
    total = np.int64(0)
    for k in range(count):
        v = x[start + k]
        total += abs(np.int64(np.float64(v) * scale))
        byte |= np.uint8(v >= 0) << np.uint8(k)
    return byte, total


# -- SIGNUM's momentum ------------------------------------------------------------------------------
@feedback_registry.register("signum")
@dataclass
class SignumMomentum(KeyedMemory):
    """SIGNUM's momentum (Bernstein et al. 2018, Algorithm 3; GRACE §3.1): the worker compresses
    z ← δ·z + (1 − δ)·g, z₀ = 0, kept in float32 per key. δ = 0 is plain signSGD."""

    momentum: float = param(0.9, "[0, 1)")
    state_name = "momentum"

    def __post_init__(self) -> None:
        check_params_of(self)  # also when built directly, not from a spec

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        z = self._stored_for(key, grad)
        fresh = grad.float() * (1.0 - self.momentum)
        return fresh if z is None else z * self.momentum + fresh

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        self._memory[key] = compensated.to(torch.float32, copy=True)
