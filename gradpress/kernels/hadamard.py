"""The randomized Hadamard transform (THC paper, Section 5.1): RHT(x) = H·D·x / √d.

H is the d×d Hadamard matrix in Sylvester order (``scipy.linalg.hadamard``), D a diagonal of
independent ±1 signs shared by every worker (invariant: explicit randomness, docs/design.md), so all workers
rotate alike and
their transformed vectors can be summed. Dividing by √d makes H·D/√d orthonormal: it preserves norms
and its inverse is its transpose, D·H/√d (Section 5.1's RHT⁻¹).

The signs come from the counter hash of :mod:`gradpress.core.rng`: D_ii = −1 exactly when bit i mod 32 of
``mix32(⌊i/32⌋, s)`` is set, for one 32-bit key ``s`` drawn from the shared stream: 32 signs per hash
(one hash per sign, its top bit, before 2026-11-25: the hash was a fifth of the transform's time). A sign
is a function of its index, so the CPU kernels compute each one where they multiply, without a separate
full-size pass, and every rank and device gets the same diagonal from the same key.

As in the THC authors' code, a long vector is cut into partitions of at most ``partition`` values
(2^20 by default), each zero-padded to a power of two and transformed on its own: the transform is
block diagonal, one Hadamard block per partition. The fast Walsh–Hadamard transform runs in
O(d log d): log2(d) butterfly stages. On CPU tensors, float32 blocks of at least 16 values go through
the vector kernel below (two passes over each block, fused with the signs, the zero padding, the 1/√d
scaling and, for THC, the quantization: :mod:`gradpress.compressors.thc`), float64 and smaller blocks
through a scalar numba kernel; on other devices every stage is one vectorized reshape over the whole
batch of partitions. All of them evaluate the same butterflies (lower + upper, lower − upper) on the same
values in the same order of stages, then scale by the same float, so they give the same bits.
"""
from __future__ import annotations

import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from gradpress.core.rng import MASK32, mix32_torch
from gradpress.kernels import simd as V
from gradpress.kernels.jit import as_numpy, jit, kernel, mix32, use_numba

DEFAULT_PARTITION = 1 << 20


@dataclass(frozen=True)
class RHTLayout:
    """How a vector of ``numel`` values is partitioned, padded and signed.

    Attributes:
        numel: length of the original vector.
        partition: the most values one Hadamard block takes.
        key: the 32-bit key of the ±1 diagonal: D_ii = −1 where bit i mod 32 of ``mix32(⌊i/32⌋, key)`` is set.
        device: where :attr:`signs` is materialized.
    """

    numel: int
    partition: int
    key: int
    device: torch.device = torch.device("cpu")

    @cached_property
    def signs(self) -> torch.Tensor:
        """The diagonal D: ``numel`` values ±1 (float32); padding needs no signs (it is zero)."""
        index = torch.arange(self.numel, dtype=torch.int64, device=self.device)
        return 1.0 - 2.0 * ((mix32_torch(index >> 5, self.key) >> (index & 31)) & 1).to(torch.float32)

    @property
    def full_blocks(self) -> int:
        """Number of partitions holding exactly ``partition`` values."""
        return self.numel // self.partition

    @property
    def tail(self) -> int:
        """Values in the last, shorter partition (0 if there is none)."""
        return self.numel - self.full_blocks * self.partition

    @property
    def padded_numel(self) -> int:
        """Length of the transformed vector: every partition padded to a power of two."""
        tail = _next_power_of_two(self.tail) if self.tail else 0
        return self.full_blocks * _next_power_of_two(self.partition) + tail

    def blocks(self) -> list[tuple[int, int, int, int]]:
        """Every partition as (first value, values, first transformed coordinate, padded size)."""
        size = _next_power_of_two(self.partition)
        out = [(b * self.partition, self.partition, b * size, size) for b in range(self.full_blocks)]
        if self.tail:
            out.append((self.full_blocks * self.partition, self.tail, self.full_blocks * size,
                        _next_power_of_two(self.tail)))
        return out


def rht_layout(
    numel: int,
    signs: torch.Generator | int,
    partition: int = DEFAULT_PARTITION,
    device: torch.device | str = "cpu",
) -> RHTLayout:
    """The layout of an RHT of ``numel`` values; the diagonal's key is drawn from the generator
    ``signs`` (a stream shared by every worker) or given as an integer (used modulo 2^32).

    A receiver that did not compress rebuilds the same layout from the same shared seed.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"rht: numel must be a non-negative integer, got {numel!r}")
    if isinstance(partition, bool) or not isinstance(partition, int) or partition < 1:
        raise ValueError(f"rht: partition must be a positive integer, got {partition!r}")
    if isinstance(signs, torch.Generator):
        key = int(torch.randint(0, 1 << 32, (1,), generator=signs, device=signs.device, dtype=torch.int64))
    elif isinstance(signs, int) and not isinstance(signs, bool):
        key = signs & MASK32
    else:
        raise TypeError(f"rht: signs must be a torch.Generator or an integer key, got {type(signs).__name__}")
    return RHTLayout(numel, partition, key, torch.device(device))


def rht(
    flat: torch.Tensor, signs: torch.Generator | int, partition: int = DEFAULT_PARTITION
) -> tuple[torch.Tensor, RHTLayout]:
    """RHT of a 1-D tensor: ``(H·D·x/√P per partition, concatenated; the layout to invert it)``.

    The result is float32 (float64 input stays float64) and has ``layout.padded_numel`` values.
    """
    _check_flat(flat)
    layout = rht_layout(flat.numel(), signs, partition, flat.device)
    return apply_rht(flat, layout), layout


def apply_rht(flat: torch.Tensor, layout: RHTLayout) -> torch.Tensor:
    """The forward transform with a given layout (same signs, same partitions)."""
    _check_flat(flat)
    if flat.numel() != layout.numel:
        raise ValueError(f"rht: the layout is for {layout.numel} values, got {flat.numel()}")
    x = flat.to(_work_dtype(flat))
    if use_numba(x) and layout.numel:
        return _numba_transform(_forward_fast, _forward_numba, x, layout.padded_numel, layout)
    x = x * layout.signs.to(x.dtype)
    return torch.cat([fwht(block).reshape(-1) for block in _split(x, layout)])


def inverse_rht(transformed: torch.Tensor, layout: RHTLayout) -> torch.Tensor:
    """RHT⁻¹(y) = D·H·y/√P per partition, padding dropped: ``layout.numel`` values."""
    _check_flat(transformed)
    if transformed.numel() != layout.padded_numel:
        raise ValueError(
            f"inverse_rht: the layout expects {layout.padded_numel} values, got {transformed.numel()}"
        )
    y = transformed.to(_work_dtype(transformed))
    if use_numba(y) and layout.numel:
        return _numba_transform(_inverse_fast, _inverse_numba, y, layout.numel, layout)
    full = layout.full_blocks * _next_power_of_two(layout.partition)
    pieces = []
    if layout.full_blocks:
        blocks = fwht(y[:full].view(layout.full_blocks, -1))
        pieces.append(blocks[:, : layout.partition].reshape(-1))
    if layout.tail:
        pieces.append(fwht(y[full:].view(1, -1))[0, : layout.tail])
    if not pieces:
        return y[:0]
    return torch.cat(pieces) * layout.signs.to(y.dtype)


def _numba_transform(fast: Callable[..., None], scalar: Callable[..., None], x: torch.Tensor, numel: int,
                     layout: RHTLayout) -> torch.Tensor:
    """``numel`` values out of a numba kernel: ``fast`` (the vector kernel) for float32 ``x``, ``scalar``
    for float64."""
    out = torch.empty(numel, dtype=x.dtype)
    if x.dtype == torch.float32:
        fast(as_numpy(x.contiguous()), as_numpy(out), *_kernel_args(layout, x.dtype), ONE,
             work_buffer(layout))
    else:
        scalar(as_numpy(x.contiguous()), as_numpy(out), *_kernel_args(layout, x.dtype))
    return out


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh–Hadamard transform along the last dimension (a power of two).

    Equals ``x @ scipy.linalg.hadamard(n) / √n`` (Sylvester order): stage h combines entries i and
    i + h of every block of 2h entries into their sum and difference, for h = 1, 2, 4, …, n/2.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht: the last dimension must be a power of two, got {n}")
    y = x.reshape(-1, n).clone()
    out = torch.empty_like(y)  # two buffers, swapped after every stage
    h = 1
    while h < n:
        pairs, sums = y.view(-1, n // (2 * h), 2, h), out.view(-1, n // (2 * h), 2, h)
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=sums[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=sums[:, :, 1])
        y, out = out, y
        h *= 2
    return y.mul_(n**-0.5).view(x.shape)


def _split(x: torch.Tensor, layout: RHTLayout) -> list[torch.Tensor]:
    """The partitions of ``x`` as zero-padded [batch, power of two] tensors."""
    full = layout.full_blocks * layout.partition
    blocks = []
    if layout.full_blocks:
        blocks.append(_pad(x[:full].view(layout.full_blocks, layout.partition)))
    if layout.tail:
        blocks.append(_pad(x[full:].view(1, layout.tail)))
    return blocks or [x.view(0, 1)]


def _pad(block: torch.Tensor) -> torch.Tensor:
    width = block.shape[1]
    return torch.nn.functional.pad(block, (0, _next_power_of_two(width) - width))


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_flat(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"rht: expected a 1-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"rht: expected a floating-point tensor, got {t.dtype}")


# -- the scalar CPU kernel (float64 input, and blocks of fewer than 16 values) --------------------------
# Each block of P = 2^k values is transformed in place. Loading applies D (or copies) and the stages
# h = 1, 2 to every quad; then, chunk by chunk of _CHUNK values (8 KiB of float32, in L1), the stages
# up to _CHUNK/2; then the rest over the whole block. Stages go three at a time (radix 8: eight values
# at distance h, combined by the butterflies of stages h, 2h, 4h in registers), so the block crosses
# memory a few times instead of once per stage; the last pass also scales. The inverse transforms a
# copy and applies D as it drops the padding. Every value goes through the same butterflies as in
# :func:`fwht`, then the same multiplication by 1/√P (and ±1), so the bits are the same.
# Indices are uint64 throughout: numba checks signed indices for wrap-around (negative indices count
# from the end), and that check keeps LLVM from vectorizing the butterflies (about 10× slower).
_CHUNK = 1 << 11


def _kernel_args(layout: RHTLayout, dtype: torch.dtype) -> tuple:
    """(numel, partition, padded partition, padded tail, their scales 1/√size in the work dtype,
    rounded as :func:`fwht` rounds them, the signs' key)."""
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    size, tail = _next_power_of_two(layout.partition), _next_power_of_two(max(layout.tail, 1))
    u = np.uint64
    return (u(layout.numel), u(layout.partition), u(size), u(tail),
            np_dtype(size**-0.5), np_dtype(tail**-0.5), np.uint32(layout.key))


@jit
def _forward_numba(x, out, numel, partition, size, tail, scale, tail_scale, key):  # pragma: no cover
    """out = H·D·x/√P per partition (zero-padded), for ``x`` and ``out`` of the work dtype."""
    u = np.uint64
    start = u(0)
    for first in range(u(0), numel, partition):
        count = min(partition, numel - first)
        n, s = (size, scale) if count == partition else (tail, tail_scale)
        _load_signed(x, first, count, n, key, out, start)
        _stages(out, start, n, s)
        start += n


@jit
def _inverse_numba(y, out, numel, partition, size, tail, scale, tail_scale, key):  # pragma: no cover
    """out = D·H·y/√P per partition, padding dropped."""
    u = np.uint64
    work = np.empty(max(size, tail) if numel >= partition else tail, dtype=y.dtype)
    start = u(0)
    for first in range(u(0), numel, partition):
        count = min(partition, numel - first)
        n, s = (size, scale) if count == partition else (tail, tail_scale)
        _inverse_block(y, start, n, s, first, count, key, work, out)
        start += n


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
# :func:`fwht`: the same bits. Measured on one core of an AVX-512 EPYC (2^22 values, 2^20 per block):
# about 1.4 ms for pass A, 0.7 ms for pass B, against 0.9 ms for a copy of the input.
_ROW = 1 << 12
_AHEAD = 1 << 10  # values: how far ahead pass A asks for the input (a prefetch per vector)
_PANEL = 128  # lanes of every row pass B works on at a time
ONE = np.float32(1.0)  # the kernels' run-time 1.0 (see gradpress.kernels.simd.radix16)
_WORK_CACHED = 1 << 23  # values (32 MiB): larger work buffers are not kept between calls
_STREAMED = 1 << 21  # values (8 MiB): outputs at least this large are written past the caches
_local = threading.local()


def work_buffer(layout: RHTLayout) -> np.ndarray:
    """A float32 scratch buffer for the vector kernels on ``layout``'s blocks: this thread's own, kept
    between calls (a fresh one per call costs a page fault per 4 KiB of it, on every call)."""
    size = _next_power_of_two(layout.partition if layout.full_blocks else max(layout.tail, 1))
    if size < 16:
        values = 16 + 256
    else:
        row = min(size, _ROW)
        rows = size // row
        values = rows * (row + 16 if rows > 1 else row) + 256
    cached = getattr(_local, "work", None)
    if cached is not None and cached.size >= values:
        return cached
    work = _huge_pages(values)
    if values <= _WORK_CACHED:
        _local.work = work
    return work


_HUGE = 1 << 21


def _huge_pages(values: int) -> np.ndarray:
    """``values`` float32 on transparent huge pages where the system grants them (``madvise``), 2 MiB
    aligned; else 64-byte aligned (a vector never straddles two cache lines). Pass B reads a column of
    every row of a 4 MiB block: on 4 KiB pages each of those reads misses the first-level TLB, which
    cost more than half of the pass (measured 7.5 → 4.7 ms for THC's compression of 2^22 values)."""
    try:
        region = mmap.mmap(-1, values * 4 + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError, ValueError):  # pragma: no cover - no mmap.madvise or MADV_HUGEPAGE
        raw = np.empty(values + 16, dtype=np.float32)
        skip = (-raw.ctypes.data % 64) // 4
        return raw[skip : skip + values]
    raw = np.frombuffer(region, dtype=np.float32)  # (keeps the mapping alive)
    skip = (-raw.ctypes.data % _HUGE) // 4
    return raw[skip : skip + values]


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


@jit
def _forward_fast(x, out, numel, partition, size, tail, scale, tail_scale, key, one, work):  # pragma: no cover
    """out = H·D·x/√P per partition (zero-padded), float32: the vector kernel for blocks of at least 16
    values, the scalar one below; ``work`` from :func:`work_buffer`."""
    u = np.uint64
    start = u(0)
    xp, outp, wp = V.pointer(x), V.pointer(out), V.pointer(work)
    for first in range(u(0), numel, partition):
        count = min(partition, numel - first)
        n, s = (size, scale) if count == partition else (tail, tail_scale)
        if n < u(16):
            _load_signed(x, first, count, n, key, out, start)
            _stages(out, start, n, s)
            start += n
            continue
        _load_signed_rows(xp, first, count, n, key, wp, one)
        c, rows, stride = _geometry(n)
        if rows == u(1):
            for m in range(c // u(16)):
                V.store(outp, start + u(16) * m, V.mul(V.load(wp, u(16) * m), V.fsplat(s)))
            start += n
            continue
        low, stages = _last_group(rows)
        step = u(1) << low
        for panel in range(u(0), c, u(_PANEL)):
            _columns_but_last(wp, panel, rows, stride, one)
            for high in range(u(0), rows, step << stages):
                for base in range(high, high + step):
                    for lane in range(panel, panel + u(_PANEL), u(16)):
                        at = lane + base * stride
                        _radix_any(stages, wp, at, step * stride, outp, start + base * c + lane, step * c, s, one,
                                   True)
        start += n


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


@jit
def _inverse_fast(y, out, numel, partition, size, tail, scale, tail_scale, key, one, work):  # pragma: no cover
    """out = D·H·y/√P per partition, padding dropped, float32: the vector kernel for blocks of at least
    16 values, the scalar one below; ``work`` from :func:`work_buffer`."""
    u = np.uint64
    start = u(0)
    small = work[:16]
    yp, outp, wp = V.pointer(y), V.pointer(out), V.pointer(work)
    scratch = V.advance(wp, work.size - 256)
    streamed = out.size >= _STREAMED
    for first in range(u(0), numel, partition):
        count = min(partition, numel - first)
        n, s = (size, scale) if count == partition else (tail, tail_scale)
        if n < u(16):
            _inverse_block(y, start, n, s, first, count, key, small, out)
            start += n
            continue
        _load_plain_rows(yp, start, n, wp, one)
        inverse_columns(wp, n, count, first, key, s, one, scratch, outp, np.float32(1.0), False, streamed, outp, False)
        start += n
