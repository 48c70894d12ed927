"""The randomized Hadamard transform's vector stages (:mod:`gradpress.kernels.hadamard`): float32 blocks
of at least 16 values in 16-lane vectors (:mod:`gradpress.kernels.simd`), in two passes (A: every stage
within a row; B: the stages across rows), which THC's kernels (:mod:`gradpress.compressors.thc`) fuse with
their quantization and packing.
"""
from __future__ import annotations

import numpy as np

from gradpress.kernels import simd as V
from gradpress.kernels.jit import kernel, mix32

# -- the vector kernel (float32) ------------------------------------------------------------------------
# A block of P = 2^k ≥ 16 values is held as R rows of C = min(P, 2^12) values (16 KiB, in L1), each a run
# of C/16 vectors of 16 lanes (gradpress.kernels.simd): the stages h = 1, 2, 4, 8 act within a vector (V.wht16,
# lane shuffles), h = 16 … C/2 across the vectors of a row, h ≥ C across rows.
#
# Pass A loads a row (signs applied; or the decoder's centred table values or sums), runs wht16 on each
# vector, then the row's stages four at a time (V.radix16: 16 vectors in registers, 16 apart in the row).
# Pass B takes a panel of 128 lanes of every row at a time (R × 512 bytes: 128 KiB for R = 256, in L2) and
# runs the stages across rows, again four at a time, the last group scaled by 1/√P, into the caller's
# sink: the output (apply_rht), or the quantization and packing (THC), or D, the decoder's scale and the
# output row by row (the inverse). The rows lie C + 16 values apart in a work buffer on huge pages, so that
# a column's vectors neither fall into the same cache sets nor each miss the TLB. Every value meets the
# same butterflies, in the same order (h = 1, 2, 4, …), then the same multiplication by 1/√P, as in
# :func:`~gradpress.kernels.hadamard.fwht`: the same bits. Measured on one core of an AVX-512 EPYC (2^22
# values, 2^20 per block): about 1.4 ms for pass A, 0.7 ms for pass B, against 0.9 ms for a copy of the input.
_ROW = 1 << 12
_AHEAD = 1 << 10  # values: how far ahead pass A asks for the input (a prefetch per vector)
_PANEL = 128  # lanes of every row pass B works on at a time
ONE = np.float32(1.0)  # the kernels' run-time 1.0 (see gradpress.kernels.simd.radix16)
_STREAMED = 1 << 21  # values (8 MiB): outputs at least this large are written past the caches


@kernel(inline="always")
def _geometry(n):  # pragma: no cover - compiled
    """(values per row C, rows R, row stride) of a block of n = 2^k ≥ 16 values."""
    u = np.uint64
    c = min(n, u(_ROW))
    r = n // c
    return c, r, c + u(16) if r > u(1) else c


@kernel(inline="always")
def _log2(n):  # pragma: no cover - compiled
    k = np.uint64(0)
    while (np.uint64(1) << k) < n:
        k += np.uint64(1)
    return k


@kernel(inline="always")
def _radix_any(stages, src, src_at, src_stride, dst, dst_at, dst_stride, scale, one, scaled):  # pragma: no cover
    """``stages`` (1 to 4) butterfly stages on 2^stages vectors (gradpress.kernels.simd.radix*)."""
    if scaled:
        if stages == 4:
            V.radix16_scaled(src, src_at, src_stride, dst, dst_at, dst_stride, scale, one)
        elif stages == 3:
            V.radix8_scaled(src, src_at, src_stride, dst, dst_at, dst_stride, scale, one)
        elif stages == 2:
            V.radix4_scaled(src, src_at, src_stride, dst, dst_at, dst_stride, scale, one)
        else:
            V.radix2_scaled(src, src_at, src_stride, dst, dst_at, dst_stride, scale, one)
    elif stages == 4:
        V.radix16(src, src_at, src_stride, dst, dst_at, dst_stride, scale, one)
    elif stages == 3:
        V.radix8(src, src_at, src_stride, dst, dst_at, dst_stride, scale, one)
    elif stages == 2:
        V.radix4(src, src_at, src_stride, dst, dst_at, dst_stride, scale, one)
    elif stages == 1:
        V.radix2(src, src_at, src_stride, dst, dst_at, dst_stride, scale, one)


@kernel(inline="always")
def _row_rest(buf, at, vectors, one):  # pragma: no cover - compiled
    """The row stages after the first four (vector strides 16 … ``vectors``/2) on the row at buf[at:]."""
    u = np.uint64
    if vectors > u(16):
        stages = _log2(vectors) - u(4)  # 1 to 4 (a row of at most 2^12 values: 256 vectors)
        span = u(16) << stages
        for base in range(u(0), vectors, span):
            for m in range(base, base + u(16)):
                _radix_any(stages, buf, at + u(16) * m, u(256), buf, at + u(16) * m, u(256), one, one, False)


@kernel(inline="always")
def _row_small(buf, at, vectors, one):  # pragma: no cover - compiled
    """Every row stage of a row of fewer than 16 vectors (already loaded, wht16 applied)."""
    stages = _log2(vectors)
    if stages:
        _radix_any(stages, buf, at, np.uint64(16), buf, at, np.uint64(16), one, one, False)


@kernel(inline="always")
def _last_group(rows):  # pragma: no cover - compiled
    """(first row bit, stages) of the last group of stages across ``rows`` rows: four where there are
    as many (the groups before it take four each, the first one the rest)."""
    r = _log2(rows)
    last = min(np.uint64(4), r)
    return r - last, last


@kernel(inline="always")
def _columns_but_last(buf, panel, rows, stride, one):  # pragma: no cover - compiled
    """Every stage across rows but the last group's, on the 64 lanes at ``panel`` of every row, in
    order: first the row bits below the remainder modulo 4, then four at a time."""
    u = np.uint64
    end, _ = _last_group(rows)
    low = u(0)
    while low < end:
        stages = (end - low) % u(4) if low == u(0) and (end - low) % u(4) else u(4)
        step = u(1) << low
        for high in range(u(0), rows, step << stages):
            for base in range(high, high + step):
                for lane in range(panel, panel + u(_PANEL), u(16)):
                    at = lane + base * stride
                    if low == u(0):  # the first reads of these rows: ask for the next panel's lines
                        for m in range(u(1) << stages):
                            V.prefetch(buf, at + u(_PANEL) + m * step * stride)
                    _radix_any(stages, buf, at, step * stride, buf, at, step * stride, one, one, False)
        low += stages


@kernel(inline="always")
def _sign_bits(g, key):  # pragma: no cover - compiled
    """The sign bits (bit 31 of each lane; D_ii = −1 where set) of the 16 indices g … g + 15: bit i mod 32
    of mix32(⌊i/32⌋, key). Sixteen indices from a multiple of 16 share one word (one scalar hash, a
    shift per lane); others may straddle two."""
    u = np.uint64
    word = g >> u(5)
    offset = np.uint32(g & u(31))
    low = V.isplat(mix32(word, key))
    if offset == np.uint32(0):  # (constant shifts: the usual case, blocks starting at multiples of 32)
        flip = V.sub(V.isplat(np.uint32(31)), V.iota(np.uint32(0)))
    elif offset == np.uint32(16):
        flip = V.sub(V.isplat(np.uint32(15)), V.iota(np.uint32(0)))
    else:
        lanes = V.iota(offset)  # bit positions offset … offset + 15 of the words (word, word + 1)
        if offset > np.uint32(16):
            high = V.isplat(mix32(word + u(1), key))
            low = V.select(V.shr(lanes, V.isplat(np.uint32(5))), high, low)
        flip = V.sub(V.isplat(np.uint32(31)), V.and_(lanes, V.isplat(np.uint32(31))))
    return V.and_(V.shl(low, flip), V.isplat(np.uint32(0x80000000)))


@kernel(inline="always")
def _signed(x, first, count, j, m, key):  # pragma: no cover - compiled
    """wht16(D·x[first + j + 16m …]) (zero past ``count``)."""
    u = np.uint64
    at = j + u(16) * u(m)  # (m an int: keep the index unsigned, or numba computes it in float64)
    if at + u(16) <= count:
        v = V.load(x, first + at)
    else:
        v = V.load_first(x, first + at, np.int64(count) - np.int64(at))
    return V.wht16(V.bits(V.xor(V.bits(v), _sign_bits(first + at, key))))


@kernel(inline="always")
def _load_signed_rows(x, first, count, n, key, buf, one):  # pragma: no cover - compiled
    """Pass A of the forward transform of block x[first : first + count], padded to n: every stage
    within a row, into buf."""
    u = np.uint64
    c, rows, stride = _geometry(n)
    vectors = c // u(16)
    for r in range(rows):
        at = r * stride
        for m in range(vectors):
            V.prefetch(x, first + r * c + u(16) * m + u(_AHEAD))
            V.store(buf, at + u(16) * m, _signed(x, first, count, r * c, m, key))
            if m % u(16) == u(15):  # a group of 16 vectors loaded: its four stages while in L1
                V.radix16(buf, at + u(16) * (m - u(15)), u(16), buf, at + u(16) * (m - u(15)), u(16), one, one)
        if vectors < u(16):
            _row_small(buf, at, vectors, one)
        _row_rest(buf, at, vectors, one)


@kernel(inline="always")
def _inverse_store(out, first, j, count, v, key, factor, scaled, streamed, minuend, subtract):  # pragma: no cover
    """out[first + j + l] = D·v (times ``factor`` if ``scaled``) for the lanes with j + l < count, or
    minuend[first + j + l] − that if ``subtract`` (``minuend`` may be ``out`` itself); whole vectors of an
    output larger than the caches bypass them (V.store_stream)."""
    u = np.uint64
    v = V.bits(V.xor(V.bits(v), _sign_bits(first + j, key)))
    if scaled:
        v = V.mul(v, V.fsplat(factor))
    if j + u(16) <= count:
        if subtract:
            v = V.sub(V.load(minuend, first + j), v)
        if streamed:
            V.store_stream(out, first + j, v)
        else:
            V.store(out, first + j, v)
    elif j < count:
        if subtract:
            v = V.sub(V.load_first(minuend, first + j, np.int64(count - j)), v)
        V.store_first(out, first + j, v, np.int64(count - j))


@kernel(inline="always")
def inverse_columns(work, n, count, first, key, s, one, scratch, out, factor, scaled, streamed, minuend,
                    subtract):  # pragma: no cover - compiled
    """Pass B of the inverse transform of a block whose rows are done (pass A) in ``work``: the stages
    across rows, then 1/√P (``s``), D and ``factor`` (if ``scaled``), into out[first : first + count], or
    minuend[first : first + count] minus that where ``subtract`` (pointers; ``streamed``: whole vectors
    past the caches)."""
    u = np.uint64
    c, rows, stride = _geometry(n)
    if rows == u(1):
        for m in range(c // u(16)):
            _inverse_store(out, first, u(16) * m, count, V.mul(V.load(work, u(16) * m), V.fsplat(s)), key, factor,
                           scaled, streamed, minuend, subtract)
        return
    low, stages = _last_group(rows)
    step = u(1) << low
    for panel in range(u(0), c, u(_PANEL)):
        _columns_but_last(work, panel, rows, stride, one)
        for high in range(u(0), rows, step << stages):
            for base in range(high, high + step):
                for lane in range(panel, panel + u(_PANEL), u(16)):
                    at = lane + base * stride
                    _radix_any(stages, work, at, step * stride, work, at, step * stride, s, one, True)
    # then row by row into the output: written in order (a column's rows, 16 KiB apart, would each miss the
    # TLB of the output's 4 KiB pages), two vectors to a word of signs
    for r in range(rows):
        for m in range(c // u(16)):
            _inverse_store(out, first, r * c + u(16) * m, count, V.load(work, r * stride + u(16) * m), key, factor,
                           scaled, streamed, minuend, subtract)


@kernel(inline="always")
def _load_plain_rows(y, start, n, buf, one):  # pragma: no cover - compiled
    """Pass A of the inverse transform of y[start : start + n]: every stage within a row, into buf."""
    u = np.uint64
    c, rows, stride = _geometry(n)
    vectors = c // u(16)
    for r in range(rows):
        at = r * stride
        for m in range(vectors):
            V.store(buf, at + u(16) * m, V.wht16(V.load(y, start + r * c + u(16) * m)))
            if m % u(16) == u(15):
                V.radix16(buf, at + u(16) * (m - u(15)), u(16), buf, at + u(16) * (m - u(15)), u(16), one, one)
        if vectors < u(16):
            _row_small(buf, at, vectors, one)
        _row_rest(buf, at, vectors, one)
