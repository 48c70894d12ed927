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
from gradpress.kernels.hadamard_scalar import (
    _inverse_block,
    _load_signed,
    _negative,
    _quad,
    _stages,
)
from gradpress.kernels.hadamard_vector import (
    ONE,
    _PANEL,
    _ROW,
    _STREAMED,
    _columns_but_last,
    _geometry,
    _inverse_store,
    _last_group,
    _load_plain_rows,
    _load_signed_rows,
    _radix_any,
    _row_rest,
    _row_small,
    inverse_columns,
)
from gradpress.kernels.jit import as_numpy, jit, use_numba

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


# -- the drivers: a block at a time through the stages of hadamard_scalar (float64, blocks of fewer than
# 16 values) or hadamard_vector (float32: pass A into a work buffer, pass B into the output) ---------------
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


_WORK_CACHED = 1 << 23  # values (32 MiB): larger work buffers are not kept between calls
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


__all__ = [
    "DEFAULT_PARTITION", "ONE", "RHTLayout", "apply_rht", "fwht", "inverse_columns", "inverse_rht", "rht",
    "rht_layout", "work_buffer",
    # the stages THC's fused kernels (gradpress.compressors.thc) run themselves
    "_PANEL", "_STREAMED", "_columns_but_last", "_geometry", "_inverse_store", "_kernel_args", "_last_group",
    "_load_signed", "_load_signed_rows", "_negative", "_quad", "_radix_any", "_row_rest", "_row_small",
    "_stages",
]
