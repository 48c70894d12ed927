"""Whole-tensor reductions of the contract's passes: the float64 sum of squares in one fixed order
(:func:`squares`, THC's norm) and the check that a tensor holds no NaN or Inf (:func:`finite`).
"""
from __future__ import annotations

import numpy as np
import torch

from gradpress.kernels import simd as V
from gradpress.kernels.cache import jit
from gradpress.kernels.dispatch import as_numpy
from gradpress.kernels.scalar import wide_vectors


@jit
def _top_exponent(bits, mask):  # pragma: no cover - compiled
    wide_vectors()
    top = bits.dtype.type(0)
    for i in range(bits.size):
        top = max(top, bits[np.uint64(i)] & mask)
    return top


_EXPONENT = {torch.float32: (np.uint32, 0x7F800000), torch.float16: (np.uint16, 0x7C00),
             torch.bfloat16: (np.uint16, 0x7F80)}


def finite(t: torch.Tensor) -> bool:
    """Whether a contiguous CPU float32/fp16/bf16 tensor holds no NaN or Inf: one vectorized pass for
    the largest exponent field (all ones: NaN or Inf), half the time of counting them."""
    dtype, mask = _EXPONENT[t.dtype]
    bits = as_numpy(t).reshape(-1).view(dtype)
    return int(_top_exponent(bits, dtype(mask))) != mask


@jit
def squares(x, addends=None, streamed=False):  # pragma: no cover - compiled
    """Σ x_i² in float64 for float32 ``x``: every square exact in float64, summed per lane of 16 (lane
    k mod 16), the lanes in order, then the last x.size mod 16 values in order — one fixed order, so a
    given x always gives the same bits. ``addends`` (m, g, β, γ) or None: x is not read but written, the
    value squared being φ = fl32(fl32(m·β) + fl32(g·γ)) (:func:`~gradpress.core.compressor.scaled_sum`'s bits;
    error feedback's sum formed in the pass that takes its norm), stored past the caches if ``streamed``."""
    u = np.uint64
    n = u(x.size)
    whole = n - n % u(16)
    xp = V.pointer(x)
    acc = V.zeros64()
    if addends is None:
        for k in range(u(0), whole, u(16)):
            acc = V.add_squares64(acc, V.load(xp, k))
    else:
        mp, gp = V.pointer(addends[0]), V.pointer(addends[1])
        bs, gs = V.fsplat(addends[2]), V.fsplat(addends[3])
        for k in range(u(0), whole, u(16)):
            v = V.add(V.mul(V.load(mp, k), bs), V.mul(V.load(gp, k), gs))
            if streamed:
                V.store_stream(xp, k, v)
            else:
                V.store(xp, k, v)
            acc = V.add_squares64(acc, v)
    total = V.hsum(acc)
    for k in range(whole, n):
        if addends is not None:
            x[k] = addends[0][k] * addends[2] + addends[1][k] * addends[3]
        total += np.float64(x[k]) * np.float64(x[k])
    return total
