"""The numba kernels of the compressor contract's passes over a tensor (:mod:`gradpress.core.compressor`):
error feedback's sums, the NaN/Inf checks and the mean's division; and the scaled sum a compressor's
kernel fuses into its first pass (:func:`scaled_into_bits`). The core imports this module when a call first
runs one of them, so that importing it loads no numba."""
from __future__ import annotations

import numpy as np

from gradpress.kernels import simd as V
from gradpress.kernels.jit import bits_of_f32, jit, kernel, wide_vectors


@jit
def add_streamed(a, b, out):  # pragma: no cover - compiled
    """out = a + b (float32), whole vectors stored past the caches (V.store_stream): the large sums of
    :func:`gradpress.core.compressor.add_into`."""
    u = np.uint64
    n = u(out.size)
    whole = n - n % u(16)
    ap, bp, op = V.pointer(a), V.pointer(b), V.pointer(out)
    for k in range(u(0), whole, u(16)):
        V.store_stream(op, k, V.add(V.load(ap, k), V.load(bp, k)))
    for k in range(whole, n):
        out[k] = a[k] + b[k]


@jit
def scaled_sum(m, g, beta, gamma, out):  # pragma: no cover - compiled
    """out = fl32(fl32(m·β) + fl32(g·γ)), β and γ given as float32."""
    wide_vectors()
    for i in range(out.size):
        j = np.uint64(i)
        out[j] = m[j] * beta + g[j] * gamma


@kernel(inline="always")
def scaled_into_bits(addends, bits, start, stop):  # pragma: no cover - compiled
    """bits[i] = the float32 pattern of fl32(fl32(m_i·β) + fl32(g_i·γ)) for i in [start, stop), where
    (m, g, β, γ) = ``addends`` (fused error feedback, in the first pass of a kernel); returns the largest
    |pattern| (≥ 0x7F800000: NaN/Inf)."""
    m, g, beta, gamma = addends
    top = np.uint32(0)
    for i in range(start, stop):
        j = np.uint64(i)
        b = bits_of_f32(m[j] * beta + g[j] * gamma)
        bits[j] = b
        top = max(top, b & np.uint32(0x7FFFFFFF))
    return top


@kernel(error_model="numpy")  # numpy's division: no zero check per element
def divide_top_exponent(values, out, count, reciprocal, exact):  # pragma: no cover - compiled
    """out = values / count, or in place where ``out`` is None (one array: no possible aliasing, so the
    loop vectorizes; with two, LLVM cannot tell that they do not overlap and keeps it scalar, 8x slower
    measured); the largest exponent field seen (all ones: a NaN or Inf). An integer max vectorizes,
    where a count of NaN/Inf costs a third more time."""
    top = np.int32(0)
    for i in range(values.size):
        v = values[i] * reciprocal if exact else values[i] / count
        if out is None:
            values[i] = v
        else:
            out[i] = v
        top = max(top, np.int32(bits_of_f32(v) & np.uint32(0x7F800000)))
    return top


@jit
def top_exponent(bits, mask):  # pragma: no cover - compiled
    """The largest ``bits[i] & mask`` (as in :func:`divide_top_exponent`, an int32 max vectorizes)."""
    top = np.int32(0)
    for i in range(bits.size):
        top = max(top, np.int32(bits[i] & mask))
    return top


@jit
def count_exponent_all_ones(bits, mask):  # pragma: no cover - compiled
    bad = 0
    for i in range(bits.size):
        bad += (bits[i] & mask) == mask
    return bad
