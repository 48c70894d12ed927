"""THC's numba kernels over each Hadamard block (THC paper, Algorithm 3; :mod:`gradpress.compressors.thc`
holds the method and its torch path, :mod:`gradpress.compressors.thc_codes` the quantization and packing
of 16 values these call).

THC in two passes over each Hadamard block (:mod:`gradpress.kernels.hadamard`'s vector kernel). Compressing
(lines 9-15), pass A loads the block with its signs and runs the stages within a row; pass B runs the
stages across rows, the last four of them straight into 16 vectors of scratch, which the quantizer
scales, rounds and packs (a NaN/Inf input shows in any vector of its block); with the residual memory
(line 21) it also forms r' = v − (T[z] − g/2)·2M/g for each rotated value v, and inverts the transform of
r' into the compensated tensor (:func:`_thc_compress` with ``fused``). Decoding (lines 18-20), pass A unpacks the
codes and looks up their centred table values (or reads the sums and centres them) and runs the row
stages; pass B the rest, then D, the scales and the output, row by row. Every value goes through the
float32 operations of the torch path, in its order: the same bits (tests/test_thc_kernels.py).
"""
from __future__ import annotations

import numpy as np

from gradpress.compressors.thc_codes import (
    _GOLDEN16,
    _MASK,
    _code_at,
    _exponent,
    _golden,
    _or_code,
    _quantize_store,
    _read_codes,
)
from gradpress.kernels import simd as V
from gradpress.kernels.hadamard import (
    _PANEL,
    _STREAMED,
    _columns_but_last,
    _geometry,
    _inverse_store,
    _last_group,
    _load_signed,
    _load_signed_rows,
    _negative,
    _quad,
    _radix_any,
    _row_rest,
    _row_small,
    _stages,
    inverse_columns,
)
from gradpress.kernels.jit import GOLDEN, bits_of_f32, jit, kernel, mix32


@jit
def _thc_compress(x, numel, partition, size, tail, scale, tail_scale, key, one, work, pre, origin, qscale, top,
                  point_gap, point_low, point_inv, seed, bits, codes, fused, res, centred,
                  factor):  # pragma: no cover - compiled
    """THC's compression (Algorithm 3 lines 9-15) of float32 ``x``: the RHT (gradpress.kernels.hadamard's layout
    arguments and work buffer), Grid.quantize on the grid (pre, origin, qscale, top) and the packing of
    the b-bit codes into ``codes`` (zeroed where a block has fewer than 16 values). Returns the largest
    exponent field of the transformed values (all ones: x held NaN or Inf).

    With ``fused`` (line 21), also the residual x − C⁻¹(C(x)) into ``res`` (float32, x's length; may be x
    itself): in the rotated domain r' = v − (T[z] − g/2)·factor for each transformed value v and its code
    z (``centred``: float32 T[z] − g/2, at least 32 entries; factor = 2M/g, the decoder's), then
    res = RHT⁻¹(r') — the stages across rows on each panel of pass B while it is in the cache, those
    within a row, D and 1/√P in one more pass per block. Equal to x − decompress(packet) up to float
    rounding (the decoder transforms T[z] − g/2 and subtracts the result from x). Without it, ``res``,
    ``centred`` and ``factor`` are not read (any float32 arrays and number). ``fused`` is a run-time
    flag, not a compile-time one: one compiled kernel serves both."""
    return _compress(x, numel, partition, size, tail, scale, tail_scale, key, one, work, pre, origin, qscale, top,
                     point_gap, point_low, point_inv, seed, bits, codes, fused, res, centred, factor)


@kernel(inline="always")
def _dequantized(code, bits, centred):  # pragma: no cover - compiled
    """(T[z] − g/2) of the 16 codes z (``centred``: its two vectors and the array)."""
    low, high, table = centred
    return V.permute32(low, high, code) if bits <= np.uint64(5) else V.gather(table, code)


@kernel(inline="always")
def _rows_inverse(work, n, count, first, key, s, one, out, streamed):  # pragma: no cover - compiled
    """The residual's last pass over a block whose stages across rows are done in ``work``: the stages
    within each row, then D and 1/√P (``s``), into out[first : first + count] (pointers)."""
    u = np.uint64
    c, rows, stride = _geometry(n)
    vectors = c // u(16)
    for r in range(rows):
        at = r * stride
        for m in range(vectors):
            V.store(work, at + u(16) * m, V.wht16(V.load(work, at + u(16) * m)))
            if m % u(16) == u(15):
                V.radix16(work, at + u(16) * (m - u(15)), u(16), work, at + u(16) * (m - u(15)), u(16), one, one)
        if vectors < u(16):
            _row_small(work, at, vectors, one)
        _row_rest(work, at, vectors, one)
        for m in range(vectors):
            _inverse_store(out, first, r * c + u(16) * m, count, V.load(work, at + u(16) * m), key, s, True, streamed,
                           out, False)


@kernel(inline="always")
def _compress(x, numel, partition, size, tail, scale, tail_scale, key, one, work, pre, origin, qscale, top,
              point_gap, point_low, point_inv, seed, bits, codes, fused, res, centred_values,
              factor):  # pragma: no cover - compiled
    """:func:`_thc_compress`, and with ``fused`` the residual into ``res``:
    block by block, the scalar way for fewer than 16 values (:func:`_compress_tiny`), else pass A (the
    signs and the stages within a row) then pass B, over one row (:func:`_quantize_row`) or panel by panel
    (:func:`_quantize_panels`), then the residual's last pass (:func:`_rows_inverse`). Returns the largest
    exponent field of the transformed values."""
    u = np.uint64
    start = u(0)
    exponent = V.isplat(np.uint32(0))
    xp, wp, cp = V.pointer(x), V.pointer(work), V.pointer(codes)
    gp, lp, ip = V.pointer(point_gap), V.pointer(point_low), V.pointer(point_inv)
    tables = (V.load(gp, 0), V.load(gp, 16), V.load(lp, 0), V.load(lp, 16), V.load(ip, 0), V.load(ip, 16), gp, lp, ip)
    quantizer = (pre, origin, qscale, top, tables, seed, bits, cp)
    rp, cvp = V.pointer(res), V.pointer(centred_values)
    centred = (V.load(cvp, 0), V.load(cvp, 16), cvp)
    fac = V.fsplat(factor)
    streamed = res.size >= _STREAMED
    scratch = V.advance(wp, work.size - 256)
    for first in range(u(0), numel, partition):
        count = min(partition, numel - first)
        n, s = (size, scale) if count == partition else (tail, tail_scale)
        if n < u(16):  # the scalar way (a partition of at most 8 values, or such a last one)
            exponent = _compress_tiny(x, first, count, n, s, key, work[:16], start, pre, origin, qscale,
                                      top, point_gap, point_low, point_inv, seed, bits, codes, exponent,
                                      fused, res, centred_values, factor)
            start += n
            continue
        _load_signed_rows(xp, first, count, n, key, wp, one)
        c, rows, stride = _geometry(n)
        if rows == u(1):
            exponent = _quantize_row(wp, c, s, start, exponent, quantizer, fused, centred, fac)
        else:
            exponent = _quantize_panels(wp, scratch, c, rows, stride, s, one, start, exponent, quantizer,
                                        fused, centred, fac)
        if fused:
            _rows_inverse(wp, n, count, first, key, s, one, rp, streamed)
        start += n
    return V.hmax(exponent)


@kernel(inline="always")
def _compress_tiny(x, first, count, n, s, key, tiny, start, pre, origin, qscale, top, point_gap, point_low,
                   point_inv, seed, bits, codes, exponent, fused, res, centred_values,
                   factor):  # pragma: no cover - compiled
    """A block of n < 16 values (x[first : first + count], zero-padded) one value at a time in ``tiny``:
    the RHT, Grid.quantize, the codes OR-ed into ``codes`` from coordinate ``start``; with ``fused``, the
    residual's r', its inverse transform and res[first : first + count]. Returns ``exponent``, all ones
    if a transformed value is NaN or Inf."""
    u = np.uint64
    _load_signed(x, first, count, n, key, tiny, u(0))
    _stages(tiny, u(0), n, s)
    for i in range(n):
        a = (tiny[i] * pre - origin) * qscale
        a = min(a if a > np.float32(0.0) else np.float32(0.0), top)  # (NaN: 0, an index in range)
        z = np.int64(a)
        up = np.float32(mix32(start + i, seed) >> np.uint32(8)) < (a - point_low[z]) * point_inv[z]
        _or_code(codes, start + i, bits, point_gap[z] + up)
        if bits_of_f32(tiny[i]) & _MASK == _MASK:
            exponent = V.isplat(_MASK)
        if fused:
            tiny[i] = tiny[i] - centred_values[point_gap[z] + up] * factor
    if fused:
        if n >= u(4):
            for q in range(u(0), n, u(4)):
                _quad(tiny, q, tiny[q], tiny[q + u(1)], tiny[q + u(2)], tiny[q + u(3)])
        _stages(tiny, u(0), n, s)
        one_ = s / s
        for i in range(count):
            res[first + i] = tiny[i] * (-one_ if _negative(first + i, key) else one_)
    return exponent


@kernel(inline="always")
def _quantize_row(wp, c, s, start, exponent, quantizer, fused, centred, fac):  # pragma: no cover - compiled
    """Pass B of a block of one row (c values in ``work``, its stages done): each vector scaled by s,
    quantized and packed from coordinate ``start``; with ``fused``, r' stored in its place. Returns the
    running largest exponent field."""
    u = np.uint64
    pre, origin, qscale, top, tables, seed, bits, cp = quantizer
    h = _golden(start)
    for m in range(c // u(16)):
        v = V.mul(V.load(wp, u(16) * m), V.fsplat(s))
        exponent = _exponent(exponent, v)
        code = _quantize_store(v, start + u(16) * m, h, pre, origin, qscale, top, tables, seed, bits, cp)
        if fused:
            V.store(wp, u(16) * m, V.sub(v, V.mul(_dequantized(code, bits, centred), fac)))
        h = V.add(h, V.isplat(_GOLDEN16))
    return exponent


@kernel(inline="always")
def _quantize_panels(wp, scratch, c, rows, stride, s, one, start, exponent, quantizer, fused, centred,
                     fac):  # pragma: no cover - compiled
    """Pass B of a block of several rows, panel by panel: the stages across rows, the last group of them
    into ``scratch``, whose vectors are quantized and packed (coordinates k + m·d); with ``fused``, r'
    stored where each value came from, then the residual's stages across rows on the panel while it is in
    the cache. Returns the running largest exponent field."""
    u = np.uint64
    pre, origin, qscale, top, tables, seed, bits, cp = quantizer
    low, stages = _last_group(rows)
    step = u(1) << low
    golden_d = np.uint32((step * c * u(GOLDEN)) & u(0xFFFFFFFF))  # the hashes' step from k to k + d
    for panel in range(u(0), c, u(_PANEL)):
        _columns_but_last(wp, panel, rows, stride, one)
        for high in range(u(0), rows, step << stages):
            for base in range(high, high + step):
                for lane in range(panel, panel + u(_PANEL), u(16)):
                    at = lane + base * stride
                    k = start + base * c + lane
                    d = step * c
                    _radix_any(stages, wp, at, step * stride, scratch, u(0), u(16), s, one, True)
                    # the coordinates are k + m·d: a NaN/Inf input makes every coordinate of its block
                    # NaN/Inf (each is a ± sum of all its values), so one vector of each radix shows it
                    exponent = _exponent(exponent, V.load(scratch, u(0)))
                    h = _golden(k)
                    for m in range(u(1) << stages):
                        v = V.load(scratch, u(16) * m)
                        code = _quantize_store(v, k + m * d, h, pre, origin, qscale, top, tables, seed, bits, cp)
                        if fused:  # r' where v came from (the panel is in the cache)
                            V.store(wp, at + m * step * stride, V.sub(v, V.mul(_dequantized(code, bits, centred),
                                                                               fac)))
                        h = V.add(h, V.isplat(golden_d))
        if fused:  # the residual's stages across rows, on this panel while it is in the cache
            _columns_but_last(wp, panel, rows, stride, one)
            for high in range(u(0), rows, step << stages):
                for base in range(high, high + step):
                    for lane in range(panel, panel + u(_PANEL), u(16)):
                        at = lane + base * stride
                        _radix_any(stages, wp, at, step * stride, wp, at, step * stride, one, one, False)
    return exponent


@kernel(inline="always")
def _centred_code(packed, k, bits, centred):  # pragma: no cover - compiled
    """wht16(T[z] − centre) of the 16 packed codes z at coordinates k … (k a multiple of 16), from the
    float32 table of T[z] − centre (``centred``: its two vectors and the array)."""
    z = _read_codes(packed, k * bits // np.uint64(8), bits)
    low, high, table = centred
    return V.wht16(V.permute32(low, high, z) if bits <= np.uint64(5) else V.gather(table, z))


@kernel(inline="always")
def _centred_sum(total, k, centre):  # pragma: no cover - compiled
    """wht16(Y − centre) of the 16 sums Y at total[k …]."""
    return V.wht16(V.sub(V.load_float(total, k), V.fsplat(centre)))


@kernel(inline="always")
def _centred(source, packed, k, bits, values, centre):  # pragma: no cover - compiled
    if packed:
        v = _centred_code(source, k, bits, values)
    else:
        v = _centred_sum(source, k, centre)
    return v


@kernel(inline="always")
def _decode_rows(source, packed, start, n, bits, values, centre, buf, one):  # pragma: no cover - compiled
    """Pass A of the decoding: the centred values of coordinates start … start + n (packed codes, or sums),
    every stage within a row, into buf."""
    u = np.uint64
    c, rows, stride = _geometry(n)
    vectors = c // u(16)
    for r in range(rows):
        at = r * stride
        for m in range(vectors):
            V.store(buf, at + u(16) * m, _centred(source, packed, start + r * c + u(16) * m, bits, values, centre))
            if m % u(16) == u(15):  # a group of 16 vectors loaded: its four stages while in L1
                V.radix16(buf, at + u(16) * (m - u(15)), u(16), buf, at + u(16) * (m - u(15)), u(16), one, one)
        if vectors < u(16):
            _row_small(buf, at, vectors, one)
        _row_rest(buf, at, vectors, one)


@kernel(inline="always")
def _decode(source, packed, out, numel, partition, size, tail, scale, tail_scale, key, one, work, bits, values,
            centre, factor, minuend, subtract):  # pragma: no cover - compiled
    """THC's decoding (Algorithm 3 lines 18-20): RHT⁻¹(Y − centre)·factor per block into ``out``, Y the
    table values of packed codes (``packed``; ``values``: float32 T[z] − centre, at least 32 entries) or
    the workers' summed values; where ``subtract``, minuend − that instead (the residual x − C⁻¹(C(x)) in
    the decoding's output pass: ``minuend`` may be ``out``)."""
    u = np.uint64
    start = u(0)
    sp, op, wp, vp, mp = V.pointer(source), V.pointer(out), V.pointer(work), V.pointer(values), V.pointer(minuend)
    centred = (V.load(vp, 0), V.load(vp, 16), vp)
    scratch = V.advance(wp, work.size - 256)
    streamed = out.size >= _STREAMED
    for first in range(u(0), numel, partition):
        count = min(partition, numel - first)
        n, s = (size, scale) if count == partition else (tail, tail_scale)
        if n < u(16):  # the scalar way (a partition of at most 8 values, or such a last one)
            tiny = work[:16]
            for i in range(n):
                if packed:
                    y = values[_code_at(source, start + i, bits)]
                else:
                    y = np.float32(source[start + i]) - centre
                tiny[i] = y
            if n >= u(4):
                for q in range(u(0), n, u(4)):
                    _quad(tiny, q, tiny[q], tiny[q + u(1)], tiny[q + u(2)], tiny[q + u(3)])
            _stages(tiny, u(0), n, s)
            one_ = s / s
            for i in range(count):
                y = (tiny[i] * (-one_ if _negative(first + i, key) else one_)) * factor
                out[first + i] = minuend[first + i] - y if subtract else y
            start += n
            continue
        _decode_rows(sp, packed, start, n, bits, centred, centre, wp, one)
        inverse_columns(wp, n, count, first, key, s, one, scratch, op, factor, True, streamed, mp, subtract)
        start += n


@jit
def _thc_decode(packed, out, numel, partition, size, tail, scale, tail_scale, key, one, work, bits, values, centre,
                factor, minuend, subtract):  # pragma: no cover - compiled
    """:func:`_decode` of one packet's codes into ``out``; with ``subtract``, out = minuend − the decoding
    (the residual memory's update; ``out`` may be ``minuend``). ``subtract`` is a run-time flag: one
    compiled kernel serves both."""
    _decode(packed, True, out, numel, partition, size, tail, scale, tail_scale, key, one, work, bits, values,
            centre, factor, minuend, subtract)


@jit
def _thc_decode_sums(total, out, numel, partition, size, tail, scale, tail_scale, key, one, work, bits, values,
                     centre, factor):  # pragma: no cover - compiled
    """:func:`_decode` of the workers' summed codes (one kernel per dtype of the sums)."""
    _decode(total, False, out, numel, partition, size, tail, scale, tail_scale, key, one, work, bits, values,
            centre, factor, out, False)
