"""THC's per-value numba kernels (:mod:`gradpress.compressors.thc` holds the methods and their torch path,
:mod:`gradpress.compressors.thc_kernels` the two passes over each Hadamard block that use these).

* Stochastic rounding onto the lookup table's values (THC paper, Algorithm 2 lines 1-4; ``Grid.quantize``):
  16 coordinates at a time on :mod:`gradpress.kernels.simd`, the uniforms from the counter hash
  (:func:`_uniforms`), the table's gaps by one permutation of two vectors or by gathers
  (:func:`_quantize16`); and one value at a time (:func:`_quantize_numba`).
* The packing of b-bit codes in :mod:`gradpress.kernels.bits`' layout, 16 at a time or one at any position
  (:func:`_write_codes`, :func:`_read_codes`, :func:`_code_at`, :func:`_or_code`), and the aggregator's
  table lookup (Algorithm 2 line 6, :func:`_lookup_fast`).
* Uniform THC (Algorithm 1) in one pass each way: quantization and packing (line 5), the decoding of a
  packet or of the workers' sums (line 9).

Every value goes through the float32 operations of the torch path, in its order: the same bits
(tests/test_thc_kernels.py).
"""
from __future__ import annotations

import numpy as np

from gradpress.kernels import simd as V
from gradpress.kernels.hadamard import _STREAMED
from gradpress.kernels.jit import GOLDEN, jit, kernel, mix32

_MASK = np.uint32(0x7F800000)  # a float's exponent field: all ones for NaN and Inf
_GOLDEN16 = np.uint32((int(GOLDEN) * 16) & 0xFFFFFFFF)
_U24 = np.float32(2.0**24)  # Grid's inv_gap of a gap of width 1 (uniform THC's)


@kernel(inline="always")
def _uniforms(h, seed):  # pragma: no cover - compiled
    """float32(mix32(k, seed) >> 8) for the 16 lanes' indices k (the 24-bit integers of Grid's draw),
    given h = k·GOLDEN mod 2^32 (a loop over indices a fixed step apart adds to it instead of multiplying)."""
    h = V.xor(h, V.isplat(seed))
    h = V.xor(h, V.shr(h, V.isplat(np.uint32(16))))
    h = V.mul(h, V.isplat(np.uint32(0x85EBCA6B)))
    h = V.xor(h, V.shr(h, V.isplat(np.uint32(13))))
    h = V.mul(h, V.isplat(np.uint32(0xC2B2AE35)))
    h = V.xor(h, V.shr(h, V.isplat(np.uint32(16))))
    return V.to_float(V.shr(h, V.isplat(np.uint32(8))))


@kernel(inline="always")
def _golden(k):  # pragma: no cover - compiled
    """k·GOLDEN, …, (k + 15)·GOLDEN mod 2^32."""
    return V.mul(V.iota(k), V.isplat(GOLDEN))


@kernel(inline="always")
def _write_codes(codes, byte, v, bits, valid):  # pragma: no cover - compiled
    """The 16 codes of ``v`` (below 2^bits) packed into the 2·bits bytes at codes[byte:], or only their
    first ``valid`` bytes (gradpress.kernels.bits' layout)."""
    u = np.uint64
    whole = valid >= u(2) * bits
    if whole and bits == u(4):
        V.store_nibbles(codes, byte, v)
    elif whole and bits == u(8):
        V.store_ints(codes, byte, v)
    else:
        low = V.pack_low(v, bits)
        high = V.pack_high(v, bits)
        if whole and bits == u(2):
            V.store_word(codes, byte, low | (high << u(16)), 4)
        elif whole and bits == u(1):
            V.store_word(codes, byte, low | (high << u(8)), 2)
        else:
            for k in range(min(valid, u(2) * bits)):
                word = low if k < bits else high
                codes[byte + k] = np.uint8((word >> (u(8) * (k % bits))) & u(0xFF))


@kernel(inline="always")
def _read_codes(packed, byte, bits):  # pragma: no cover - compiled
    """The 16 codes of ``bits`` bits packed in the 2·bits bytes at packed[byte:]."""
    u = np.uint64
    if bits == u(4):
        v = V.load_nibbles(packed, byte)
    elif bits == u(8):
        v = V.load_bytes(packed, byte)
    else:
        if bits == u(2):
            low, high = V.load_word(packed, byte, 2), V.load_word(packed, byte + u(2), 2)
        elif bits == u(1):
            low, high = V.load_word(packed, byte, 1), V.load_word(packed, byte + u(1), 1)
        else:
            low = u(0)
            high = u(0)
            for k in range(bits):
                low |= u(packed[byte + k]) << (u(8) * k)
                high |= u(packed[byte + bits + k]) << (u(8) * k)
        v = V.unpack16(low, high, bits)
    return v


@kernel(inline="always")
def _code_at(packed, k, bits):  # pragma: no cover - compiled
    """Code k of a packed stream of ``bits``-bit codes (any position)."""
    u = np.uint64
    bit = k * bits
    byte = bit >> u(3)
    word = u(packed[byte])
    if (bit & u(7)) + bits > u(8):
        word |= u(packed[byte + u(1)]) << u(8)
    return (word >> (bit & u(7))) & ((u(1) << bits) - u(1))


@kernel(inline="always")
def _or_code(codes, k, bits, code):  # pragma: no cover - compiled
    """OR code k of ``bits`` bits into a zeroed packed stream (any position)."""
    u = np.uint64
    bit = k * bits
    byte = bit >> u(3)
    word = u(code) << (bit & u(7))
    codes[byte] |= np.uint8(word & u(0xFF))
    if (bit & u(7)) + bits > u(8):
        codes[byte + u(1)] |= np.uint8(word >> u(8))


@kernel(inline="always")
def _quantize16(v, h, pre, origin, scale, top, tables, seed):  # pragma: no cover - compiled
    """Grid.quantize of 16 values at coordinates k … (h = k·GOLDEN …): a = clamp((v·pre − origin)·scale,
    0, top), the gap z of ⌊a⌋ and a step up with probability (a − T[z])·inv[z]; ``tables``: the per-point
    tables (their vectors where the grid has at most 32 points, for one permutation each; else the
    arrays, for gathers)."""
    a = V.clamp(V.mul(V.sub(V.mul(v, V.fsplat(pre)), V.fsplat(origin)), V.fsplat(scale)),
                V.fsplat(np.float32(0.0)), V.fsplat(top))
    i = V.to_int(a)
    gap0, gap1, low0, low1, inv0, inv1, point_gap, point_low, point_inv = tables
    if top < np.float32(32.0):
        z = V.permute32(gap0, gap1, i)
        low = V.permute32(low0, low1, i)
        inv = V.permute32(inv0, inv1, i)
    else:
        z = V.gather(point_gap, i)
        low = V.gather(point_low, i)
        inv = V.gather(point_inv, i)
    return V.step_up(z, _uniforms(h, seed), V.mul(V.sub(a, low), inv))


@kernel(inline="always")
def _quantize_store(v, k, h, pre, origin, scale, top, tables, seed, bits, codes):  # pragma: no cover - compiled
    """Quantize and pack the 16 coordinates k … (k a multiple of 16, h = k·GOLDEN …)."""
    code = _quantize16(v, h, pre, origin, scale, top, tables, seed)
    _write_codes(codes, k * bits // np.uint64(8), code, bits, np.uint64(2) * bits)
    return code


@kernel(inline="always")
def _exponent(exponent, v):  # pragma: no cover - compiled
    """The running largest exponent field, with v's."""
    return V.umax(exponent, V.and_(V.bits(v), V.isplat(_MASK)))


@jit
def _quantize_numba(x, pre, origin, scale, top, gap, table, inv_gap, seed, codes):  # pragma: no cover
    zero = np.float32(0.0)
    for i in range(x.size):
        a = (x[i] * pre - origin) * scale
        a = min(a if a > zero else zero, top)  # (NaN: 0, an index in range)
        z = gap[np.int64(a)]
        up = np.float32(mix32(i, seed) >> np.uint32(8)) < (a - table[z]) * inv_gap[z]
        codes[i] = np.uint8(z + up)


@jit
def _lookup_fast(packed, bits, values, out):  # pragma: no cover - compiled
    """out[i] = values[code i] for the b-bit codes packed in ``packed`` (uint8 or int32 ``out``)."""
    u = np.uint64
    bits = u(bits)
    n = u(out.size)
    whole = n - n % u(16)
    pp, vp, op = V.pointer(packed), V.pointer(values), V.pointer(out)
    low, high = V.load(vp, 0), V.load(vp, 16)
    for k in range(u(0), whole, u(16)):
        z = _read_codes(pp, k * bits // u(8), bits)
        t = V.permute32(low, high, z) if bits <= u(5) else V.gather(vp, z)
        V.store_ints(op, k, t)
    for k in range(whole, n):
        out[k] = values[_code_at(packed, k, bits)]


@jit
def _uniform_compress(x, pre, origin, scale, top, seed, bits, codes):  # pragma: no cover - compiled
    """Uniform THC's quantization (Algorithm 1 line 5) and packing in one pass: Grid.quantize on the
    identity table 0 … top (the gap of ⌊a⌋ is min(⌊a⌋, top − 1), its width 1). Returns the largest
    exponent field of x (all ones: NaN or Inf)."""
    u = np.uint64
    n = u(x.size)
    bits = u(bits)
    total = (n * bits + u(7)) // u(8)
    xp, cp = V.pointer(x), V.pointer(codes)
    exponent = V.isplat(np.uint32(0))
    zero = V.fsplat(np.float32(0.0))
    last = V.isplat(np.uint32(top) - np.uint32(1))
    h = _golden(u(0))
    for j in range(u(0), n, u(16)):
        whole = j + u(16) <= n
        v = V.load(xp, j) if whole else V.load_first(xp, j, np.int64(n - j))
        exponent = V.umax(exponent, V.and_(V.bits(v), V.isplat(_MASK)))
        a = V.clamp(V.mul(V.sub(V.mul(v, V.fsplat(pre)), V.fsplat(origin)), V.fsplat(scale)), zero, V.fsplat(top))
        z = V.umin(V.to_int(a), last)
        code = V.step_up(z, _uniforms(h, seed), V.mul(V.sub(a, V.to_float(z)), V.fsplat(_U24)))
        h = V.add(h, V.isplat(_GOLDEN16))
        byte = j * bits // u(8)
        if whole:
            _write_codes(cp, byte, code, bits, u(2) * bits)
        else:
            _write_codes(cp, byte, V.keep_first(code, np.int64(n - j)), bits, total - byte)
    return V.hmax(exponent)


@jit
def _uniform_decode_packed(packed, bits, step, origin, out):  # pragma: no cover - compiled
    """out[i] = float32(code_i·step + origin) in float64 (Algorithm 1 line 9 for one packet)."""
    u = np.uint64
    bits = u(bits)
    n = u(out.size)
    whole = n - n % u(16)
    streamed = out.size >= _STREAMED
    pp, op = V.pointer(packed), V.pointer(out)
    for k in range(u(0), whole, u(16)):
        v = V.affine64(_read_codes(pp, k * bits // u(8), bits), step, origin)
        if streamed:
            V.store_stream(op, k, v)
        else:
            V.store(op, k, v)
    for k in range(whole, n):
        out[k] = np.float32(np.float64(_code_at(packed, k, bits)) * step + origin)


@jit
def _uniform_decode_sums(total, step, origin, out):  # pragma: no cover - compiled
    """out[i] = float32(total_i·step + origin) in float64 (Algorithm 1 line 9)."""
    u = np.uint64
    n = u(out.size)
    whole = n - n % u(16)
    streamed = out.size >= _STREAMED
    tp, op = V.pointer(total), V.pointer(out)
    for k in range(u(0), whole, u(16)):
        v = V.load_affine64(tp, k, step, origin)
        if streamed:
            V.store_stream(op, k, v)
        else:
            V.store(op, k, v)
    for k in range(whole, n):
        out[k] = np.float32(np.float64(total[k]) * step + origin)
