"""The randomized Hadamard transform's scalar stages (:mod:`gradpress.kernels.hadamard`): float64 input and
blocks of fewer than 16 values; the THC kernels use its loading and stage passes for their small blocks.
"""
from __future__ import annotations

import numpy as np

from gradpress.kernels.jit import jit, kernel, mix32

# -- the scalar CPU kernel (float64 input, and blocks of fewer than 16 values) --------------------------
# Each block of P = 2^k values is transformed in place. Loading applies D (or copies) and the stages
# h = 1, 2 to every quad; then, chunk by chunk of _CHUNK values (8 KiB of float32, in L1), the stages
# up to _CHUNK/2; then the rest over the whole block. Stages go three at a time (radix 8: eight values
# at distance h, combined by the butterflies of stages h, 2h, 4h in registers), so the block crosses
# memory a few times instead of once per stage; the last pass also scales. The inverse transforms a
# copy and applies D as it drops the padding. Every value goes through the same butterflies as in
# :func:`~gradpress.kernels.hadamard.fwht`, then the same multiplication by 1/√P (and ±1), so the bits are
# the same.
# Indices are uint64 throughout: numba checks signed indices for wrap-around (negative indices count
# from the end), and that check keeps LLVM from vectorizing the butterflies (about 10× slower).
_CHUNK = 1 << 11


@kernel(inline="always")
def _inverse_block(y, start, n, s, first, count, key, work, out):  # pragma: no cover - compiled
    """The scalar kernel's block: out[first : first + count] = D·H·y[start : start + n]·s, in ``work``."""
    u = np.uint64
    if n < u(4):
        for i in range(n):
            work[i] = y[start + i]
    else:
        for q in range(u(0), n, u(4)):
            _quad(work, q, y[start + q], y[start + q + u(1)], y[start + q + u(2)], y[start + q + u(3)])
    _stages(work, u(0), n, s)
    one = s / s
    for i in range(count):
        out[first + i] = work[i] * (-one if _negative(first + i, key) else one)


@jit
def _stages(v, o, n, scale):  # pragma: no cover - compiled
    """The stages after loading (h ≥ 4, or all of them for n < 4) on v[o : o + n], then the scaling:
    chunk by chunk of _CHUNK values, then across the chunks."""
    u = np.uint64
    chunk = min(n, u(_CHUNK))
    first = u(4) if n >= u(4) else u(1)
    for c in range(o, o + n, chunk):
        _butterflies(v, c, chunk, first, scale if chunk == n else scale / scale)
    if chunk < n:
        _butterflies(v, o, n, chunk, scale)


@jit
def _negative(i, key):  # pragma: no cover - compiled
    """Whether D_ii = −1: bit i mod 32 of mix32(⌊i/32⌋, key)."""
    i = np.uint64(i)
    return (mix32(i >> np.uint64(5), key) >> np.uint32(i & np.uint64(31))) & np.uint32(1) != np.uint32(0)


@jit
def _load_signed(x, first, count, n, key, out, o):  # pragma: no cover - compiled
    """out[o : o + n] = D·x[first : first + count], zero-padded, with the stages h = 1, 2 applied to
    every quad when n ≥ 4."""
    u = np.uint64
    one = out.dtype.type(1.0)
    zero = out.dtype.type(0.0)
    if n < u(4):
        for i in range(n):
            out[o + i] = x[first + i] * (-one if _negative(first + i, key) else one) if i < count else zero
        return
    whole = count - count % u(4)
    for q in range(u(0), whole, u(4)):
        g = first + q
        _quad(out, o + q,
              x[g] * (-one if _negative(g, key) else one),
              x[g + u(1)] * (-one if _negative(g + u(1), key) else one),
              x[g + u(2)] * (-one if _negative(g + u(2), key) else one),
              x[g + u(3)] * (-one if _negative(g + u(3), key) else one))
    a = np.zeros(4, dtype=out.dtype)
    for q in range(whole, n, u(4)):  # the last values and the padding
        for k in range(u(4)):
            g = first + q + k
            a[k] = x[g] * (-one if _negative(g, key) else one) if q + k < count else zero
        _quad(out, o + q, a[0], a[1], a[2], a[3])


@jit
def _quad(out, o, a0, a1, a2, a3):  # pragma: no cover - compiled
    """Stages h = 1 and h = 2 on four consecutive values, written to out[o : o + 4]."""
    u = np.uint64
    b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
    out[o], out[o + u(1)], out[o + u(2)], out[o + u(3)] = b0 + b2, b1 + b3, b0 - b2, b1 - b3


@jit
def _butterflies(v, o, n, h, scale):  # pragma: no cover - compiled
    """Stages h, 2h, … n/2 on v[o : o + n] in place, three at a time where three remain; the pass that
    ends at n multiplies by ``scale``."""
    u = np.uint64
    if h >= n:  # no stage left: the scale alone
        for i in range(o, o + n):
            v[i] = v[i] * scale
        return
    one = scale / scale
    while h < n:
        if h * u(8) <= n:
            s = scale if h * u(8) == n else one
            for i in range(o, o + n, h * u(8)):
                for j in range(i, i + h):
                    a0, a1, a2, a3 = v[j], v[j + h], v[j + u(2) * h], v[j + u(3) * h]
                    a4, a5, a6, a7 = v[j + u(4) * h], v[j + u(5) * h], v[j + u(6) * h], v[j + u(7) * h]
                    b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
                    b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
                    c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
                    c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
                    v[j], v[j + h] = (c0 + c4) * s, (c1 + c5) * s
                    v[j + u(2) * h], v[j + u(3) * h] = (c2 + c6) * s, (c3 + c7) * s
                    v[j + u(4) * h], v[j + u(5) * h] = (c0 - c4) * s, (c1 - c5) * s
                    v[j + u(6) * h], v[j + u(7) * h] = (c2 - c6) * s, (c3 - c7) * s
            h *= u(8)
        elif h * u(4) <= n:
            s = scale if h * u(4) == n else one
            for i in range(o, o + n, h * u(4)):
                for j in range(i, i + h):
                    a0, a1, a2, a3 = v[j], v[j + h], v[j + u(2) * h], v[j + u(3) * h]
                    b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
                    v[j], v[j + h] = (b0 + b2) * s, (b1 + b3) * s
                    v[j + u(2) * h], v[j + u(3) * h] = (b0 - b2) * s, (b1 - b3) * s
            h *= u(4)
        else:
            s = scale if h + h == n else one
            for i in range(o, o + n, h + h):
                for j in range(i, i + h):
                    a, b = v[j], v[j + h]
                    v[j], v[j + h] = (a + b) * s, (a - b) * s
            h += h
