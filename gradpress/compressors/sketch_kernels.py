"""S2 Reducer's count-sketch on the CPU (:mod:`gradpress.compressors.sketch`): the numba kernels of the
sketch's element-wise work, the same bits as its torch path.

Compressing (Algorithm 1 lines 2-7) is one pass that marks the non-zero blocks and inserts their values
(:func:`_sketch_insert`): a chunk of values hashed at a time, vectorized, into buffers that stay in L2, then
the random table updates, each prefetched a little earlier (:func:`_prefetch`). Decoding (lines 9-15) is
one pass of hashes, 16-lane table gathers, the signs applied, a stable sorting network for the median of
r ≤ 5 rows and the division, clamp and scale (:func:`_sketch_query`).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from gradpress.kernels.jit import bits_of_f32, f32_from_bits, gather16, jit, kernel, mix32, wide_vectors

_MAX_WIDTH = 1 << 32  # the kernels keep bucket numbers in uint32
_HASHED = 16384  # values the sketch kernels hash at a time (their bucket buffers stay in L2)
_AHEAD = 128  # the insert prefetches the table entry it will update this many values later


def _prefetch(write: int):  # noqa: ANN202
    """An intrinsic ``prefetch(array, index)``: a hint that ``array[index]`` will be read (``write`` 0)
    or written (1) soon (``llvm.prefetch``, kept in all cache levels). Changes no result.

    A table larger than L2 takes one random update per inserted value; the out-of-order window overlaps
    only a few of their cache misses, and prefetches issued :data:`_AHEAD` values earlier overlap more
    (2^22 values into 2^21 buckets, CPU time, median of 7: 8.8–11.6 ms without, 8.2–8.7 ms with;
    32 or 512 values ahead were slower). The query's gathers gained nothing from them."""

    @intrinsic
    def prefetch(typingctx, array, index):  # pragma: no cover - compiled
        if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            offset = args[1]
            if signature.args[1].bitwidth < 64:
                widen = builder.sext if signature.args[1].signed else builder.zext
                offset = widen(offset, ir.IntType(64))
            pointer = builder.bitcast(builder.gep(data, [offset]), ir.IntType(8).as_pointer())
            i32 = ir.IntType(32)
            signature_ir = ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, signature_ir, "llvm.prefetch.p0i8")
            builder.call(fn, [pointer, ir.Constant(i32, write), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    return prefetch


_prefetch_for_write = _prefetch(1)


@jit
def _nonzero_rows(words, mask, out):  # pragma: no cover - compiled
    size = words.shape[1]
    for b in range(words.shape[0]):
        found = False
        for e in range(size):
            if words[b, e] & mask:
                found = True
                break
        out[b] = found


@kernel(inline="always")
def _bucket(hashed, width):  # pragma: no cover - compiled
    """h(i) from hashed = mix32(i, seed), as :func:`_buckets` computes it: the low 31 bits, shifted to
    the top, times c, the high half of the product; as uint32."""
    return np.uint32((np.uint64(np.uint32(hashed << np.uint32(1))) * width) >> np.uint64(32))


@kernel(inline="always")
def _signed(value, hashed):  # pragma: no cover - compiled
    """s(i)·value for s(i) = ±1 from the top bit of hashed = mix32(i, seed), the product's bits: a
    multiplication by ±1 is exact and only sets the sign bit (``value`` is not NaN), so that bit is
    XOR-ed into value's."""
    return f32_from_bits(bits_of_f32(value) ^ (hashed & np.uint32(0x80000000)))


@jit
def _insert(indices, values, seeds, table):  # pragma: no cover - compiled
    """:func:`insert`'s kernel: the given values at the given indices, in order."""
    width = np.uint64(table.shape[1])
    for j in range(table.shape[0]):
        for k in range(indices.size):
            hashed = mix32(indices[k], seeds[j])
            table[j, _bucket(hashed, width)] += _signed(values[k], hashed)


@kernel(inline="always")
def _count(flags):  # pragma: no cover - compiled
    """How many of the uint8 ``flags`` are set (each 0 or 1)."""
    total = 0
    for b in range(flags.size):
        total += flags[b]
    return total


@kernel(inline="always")
def _find_nonzero(words, size, first, end, flags):  # pragma: no cover - compiled
    """flags[b] = whether block b (of ``size`` float32 values, as bits) holds a non-zero value (−0.0 and
    +0.0 are zero), for blocks first..end-1; how many do."""
    numel = words.size
    found = 0
    mask = np.uint32(0x7FFFFFFF)
    if size == 1:
        block, into = words[first:end], flags[first:end]
        for b in range(block.size):
            nonzero = (block[b] & mask) != np.uint32(0)
            into[b] = nonzero
            found += nonzero
        return found
    for b in range(first, end):
        block = words[b * size:min((b + 1) * size, numel)]
        nonzero = False
        for start in range(0, block.size, 16):  # 16 at a time: the inner loop vectorizes
            part = block[start:start + 16]
            seen = np.uint32(0)
            for i in range(part.size):
                seen |= part[i] & mask
            if seen:
                nonzero = True
                break
        flags[b] = nonzero
        found += nonzero
    return found


@jit
def _sketch_insert(values, size, flags, find, seeds, scale, table):  # pragma: no cover - compiled
    """Algorithm 1 lines 2-7 for the blocks flagged in ``flags`` (or, with ``find``, for the non-zero
    blocks, which it flags): S[j, h_j(i)] += s_j(i)·(g(i)·scale), values in ascending index order, as
    :func:`insert` adds them. Blocks are visited _HASHED values at a time: flagged, then hashed (one
    hash per value and row, a vectorized loop into L2-resident buffers), then added (a scalar loop of
    random updates, each prefetched _AHEAD values earlier). Returns how many of the inserted values are
    NaN/Inf."""
    rows = table.shape[0]
    width = np.uint64(table.shape[1])
    words = values.view(np.uint32)
    numel = values.size
    blocks = flags.size
    group = max(1, _HASHED // size)
    buckets = np.empty((rows, _HASHED), dtype=np.uint32)
    signed = np.empty((rows, _HASHED), dtype=np.float32)
    bad = 0
    for first in range(0, blocks, group):
        end = min(first + group, blocks)
        if find:
            flagged = _find_nonzero(words, size, first, end, flags)
        else:
            flagged = _count(flags[first:end])
        if flagged == end - first:
            bad += _insert_range(values, first * size, min(end * size, numel), seeds, scale, table, width,
                                 buckets, signed)
            continue
        b = first
        while flagged and b < end:
            if not flags[b]:
                b += 1
                continue
            run = b + 1
            while run < end and flags[run]:
                run += 1
            bad += _insert_range(values, b * size, min(run * size, numel), seeds, scale, table, width,
                                 buckets, signed)
            b = run
    return bad


@kernel(inline="always")
def _insert_range(values, lo, hi, seeds, scale, table, width, buckets, signed):  # pragma: no cover - compiled
    rows = table.shape[0]
    bad = 0
    for start in range(lo, hi, _HASHED):
        count = min(_HASHED, hi - start)
        chunk = values[start:start + count]
        bad += _hash_values(chunk, start, seeds, scale, width, buckets, signed)
        for j in range(rows):
            row = table[j]
            for k in range(count):
                if k + _AHEAD < count:
                    _prefetch_for_write(row, buckets[j, k + _AHEAD])
                row[buckets[j, k]] += signed[j, k]
    return bad


@kernel(inline="always")
def _hash_values(chunk, start, seeds, scale, width, buckets, signed):  # pragma: no cover - compiled
    """buckets[j, k] = h_j(i), signed[j, k] = s_j(i)·(g(i)·scale) for i = start + k (vectorized); how
    many of the chunk's values are NaN/Inf (their exponent bits all ones)."""
    wide_vectors()
    words = chunk.view(np.uint32)
    bad = 0
    for k in range(chunk.size):
        hashed = mix32(start + k, seeds[0])
        buckets[0, k] = _bucket(hashed, width)
        signed[0, k] = _signed(chunk[k] * scale, hashed)
        bad += (words[k] & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    for j in range(1, buckets.shape[0]):
        seed = seeds[j]
        for k in range(chunk.size):
            hashed = mix32(start + k, seed)
            buckets[j, k] = _bucket(hashed, width)
            signed[j, k] = _signed(chunk[k] * scale, hashed)
    return bad


@jit
def _sketch_query(flags, size, table, seeds, finish, out):  # pragma: no cover - compiled
    """Algorithm 1 lines 9-15: every value of a flagged block gets :func:`query`'s estimate, every other
    value 0 (``out`` need not be zeroed). _HASHED values at a time: their buckets and signs (one hash
    each, vectorized), the table entries (16-lane gathers), the signs applied, the median over rows by a
    stable sorting network (r ≤ 5) and the division, clamp and scale (vectorized). ``finish`` = (count,
    1/count if that is a power of two else 0, largest, scale)."""
    rows = table.shape[0]
    width = np.uint64(table.shape[1])
    numel = out.size
    blocks = flags.size
    group = max(1, _HASHED // size)
    buckets = np.empty((rows, _HASHED), dtype=np.uint32)
    estimates = np.empty((rows, _HASHED), dtype=np.float32)
    signs = np.empty(_HASHED, dtype=np.uint32)
    for first in range(0, blocks, group):
        end = min(first + group, blocks)
        flagged = _count(flags[first:end])
        lo, hi = first * size, min(end * size, numel)
        if flagged == end - first:
            _query_range(lo, hi, table, seeds, finish, width, buckets, estimates, signs, out)
            continue
        zeros = out[lo:hi]
        for i in range(zeros.size):
            zeros[i] = np.float32(0.0)
        b = first
        while flagged and b < end:
            if not flags[b]:
                b += 1
                continue
            run = b + 1
            while run < end and flags[run]:
                run += 1
            stop = min(run * size, numel)
            _query_range(b * size, stop, table, seeds, finish, width, buckets, estimates, signs, out)
            b = run


@kernel(inline="always")
def _query_range(lo, hi, table, seeds, finish, width, buckets, estimates, signs, out):  # pragma: no cover
    """out[lo:hi] = the estimates of values lo..hi-1, ``finish`` = (count, 1/count or 0, largest, scale)."""
    count, inverse, largest, scale = finish
    rows = table.shape[0]
    if rows == 1:  # 64 values at a time, hashed, gathered and finished in one loop (hashing overlaps gathers)
        row, seed = table[0], seeds[0]
        numbers, hashes, found = buckets[0, :64], signs[:64], estimates[0, :64]
        whole = hi - (hi - lo) % 64
        for start in range(lo, whole, 64):
            for t in range(64):
                hashed = mix32(start + t, seed)
                numbers[t] = _bucket(hashed, width)
                hashes[t] = hashed
            for t in range(0, 64, 16):
                gather16(row, numbers, found, t)
            into = out[start:start + 64]
            if inverse:
                for t in range(64):
                    into[t] = _clamped(_signed(found[t], hashes[t]) * inverse, largest, scale)
            else:
                for t in range(64):
                    into[t] = _clamped(_signed(found[t], hashes[t]) / count, largest, scale)
        lo = whole
    for start in range(lo, hi, _HASHED):
        m = min(_HASHED, hi - start)
        into = out[start:start + m]
        for j in range(rows):
            found = into if rows == 1 else estimates[j, :m]  # one row: its estimates are the medians
            _bucket_numbers(start, seeds[j], width, buckets[j, :m], signs[:m])
            _load(table[j], buckets[j, :m], found)
            _apply_signs(signs[:m], found)
        if rows == 2:
            _median_two(estimates, into)
        elif rows == 3:
            _median_three(estimates, into)
        elif rows == 4:
            _median_four(estimates, into)
        elif rows == 5:
            _median_five(estimates, into)
        elif rows > 5:
            _median_sorted(estimates, into)
        if inverse:
            _finish_multiplying(into, inverse, largest, scale)
        else:
            _finish_dividing(into, count, largest, scale)


@kernel(inline="always")
def _load(row, numbers, found):  # pragma: no cover - compiled
    """found[k] = row[numbers[k]], 16 at a time by vector gathers (prefetches measured no faster here:
    the table was read by the previous query or written by the insert)."""
    m = numbers.size
    whole = m - m % 16
    for k in range(0, whole, 16):
        gather16(row, numbers, found, k)
    for k in range(whole, m):
        found[k] = row[numbers[k]]


@kernel(inline="always")
def _bucket_numbers(start, seed, width, buckets, signs):  # pragma: no cover - compiled
    """buckets[k] = h(i) and signs[k] = the hash with s(i) in its top bit, for i = start + k: one hash
    each (vectorized)."""
    wide_vectors()
    for k in range(buckets.size):
        hashed = mix32(start + k, seed)
        buckets[k] = _bucket(hashed, width)
        signs[k] = hashed


@kernel(inline="always")
def _apply_signs(signs, estimates):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(estimates.size):
        estimates[k] = _signed(estimates[k], signs[k])


@kernel(inline="always")
def _ordered(a, b):  # pragma: no cover - compiled
    """A stable compare-exchange: (b, a) if a > b, else (a, b) (equal values, +0 and −0 among them, keep
    their order, as an insertion sort keeps it)."""
    swap = a > b
    return (b if swap else a), (a if swap else b)


@kernel(inline="always")
def _clamped(mean, largest, scale):  # pragma: no cover - compiled
    mean = -largest if mean < -largest else mean
    mean = largest if mean > largest else mean
    return mean * scale


@kernel(inline="always")
def _finish_dividing(out, count, largest, scale):  # pragma: no cover - compiled
    """out = (median / count) clamped to ±largest, times scale: :func:`query`'s torch steps, in float32."""
    wide_vectors()
    for k in range(out.size):
        out[k] = _clamped(out[k] / count, largest, scale)


@kernel(inline="always")
def _finish_multiplying(out, inverse, largest, scale):  # pragma: no cover - compiled
    """:func:`_finish_dividing` for a power-of-two count, ``inverse`` = 1/count: x·inverse is x/count (both
    the correctly rounded quotient), and a product is cheaper than a division."""
    wide_vectors()
    for k in range(out.size):
        out[k] = _clamped(out[k] * inverse, largest, scale)


@kernel(inline="always")
def _median_two(estimates, out):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(out.size):  # the mean of the two (an addition commutes: their order does not matter)
        out[k] = np.float32(0.5) * (estimates[0, k] + estimates[1, k])


@kernel(inline="always")
def _median_three(estimates, out):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(out.size):  # odd-even transposition: (0,1) (1,2) (0,1)
        e0, e1 = _ordered(estimates[0, k], estimates[1, k])
        e1, e2 = _ordered(e1, estimates[2, k])
        e0, e1 = _ordered(e0, e1)
        out[k] = e1


@kernel(inline="always")
def _median_four(estimates, out):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(out.size):  # odd-even transposition, 4 rounds: (0,1)(2,3) (1,2) (0,1)(2,3) (1,2)
        e0, e1 = _ordered(estimates[0, k], estimates[1, k])
        e2, e3 = _ordered(estimates[2, k], estimates[3, k])
        e1, e2 = _ordered(e1, e2)
        e0, e1 = _ordered(e0, e1)
        e2, e3 = _ordered(e2, e3)
        e1, e2 = _ordered(e1, e2)
        out[k] = np.float32(0.5) * (e1 + e2)


@kernel(inline="always")
def _median_five(estimates, out):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(out.size):  # odd-even transposition, 5 rounds: (0,1)(2,3) (1,2)(3,4) ×2, then (0,1)(2,3)
        e0, e1 = _ordered(estimates[0, k], estimates[1, k])
        e2, e3 = _ordered(estimates[2, k], estimates[3, k])
        e4 = estimates[4, k]
        e1, e2 = _ordered(e1, e2)
        e3, e4 = _ordered(e3, e4)
        e0, e1 = _ordered(e0, e1)
        e2, e3 = _ordered(e2, e3)
        e1, e2 = _ordered(e1, e2)
        e3, e4 = _ordered(e3, e4)
        e0, e1 = _ordered(e0, e1)
        e2, e3 = _ordered(e2, e3)
        out[k] = e2


@kernel(inline="always")
def _median_sorted(estimates, out):  # pragma: no cover - compiled
    rows = estimates.shape[0]
    column = np.empty(rows, dtype=np.float32)
    for k in range(out.size):
        for j in range(rows):  # insertion sort: stable, r is small
            value = estimates[j, k]
            i = j - 1
            while i >= 0 and column[i] > value:
                column[i + 1] = column[i]
                i -= 1
            column[i + 1] = value
        if rows % 2:
            out[k] = column[rows // 2]
        else:
            out[k] = np.float32(0.5) * (column[rows // 2 - 1] + column[rows // 2])
