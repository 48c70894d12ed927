"""The randomized Hadamard transform (THC paper, Section 5.1): RHT(x) = H·D·x / √d.

H is the d×d Hadamard matrix in Sylvester order (``scipy.linalg.hadamard``), D a diagonal of
independent ±1 signs shared by every worker (DESIGN invariant 2), so all workers rotate alike and
their transformed vectors can be summed. Dividing by √d makes H·D/√d orthonormal: it preserves norms
and its inverse is its transpose, D·H/√d (Section 5.1's RHT⁻¹).

The signs come from the counter hash of :mod:`gradpress.rng`: D_ii = −1 exactly when the top bit of
``mix32(i, s)`` is set, for one 32-bit key ``s`` drawn from the shared stream (as S2's sketch signs).
A sign is a function of its index, so the CPU kernel computes each one where it multiplies, without a
separate full-size pass, and every rank and device gets the same diagonal from the same key.

As in the THC authors' code, a long vector is cut into partitions of at most ``partition`` values
(2^20 by default), each zero-padded to a power of two and transformed on its own: the transform is
block diagonal, one Hadamard block per partition. The fast Walsh–Hadamard transform runs in
O(d log d): log2(d) butterfly stages. On CPU tensors a numba kernel applies them in place, a chunk
that fits the L1 cache at a time for the first stages and a few stages per pass over memory for the
rest, fused with the signs, the zero padding and the 1/√d scaling; on other devices every stage is one
vectorized reshape over the whole batch of partitions. Both evaluate the same butterflies (lower + upper,
lower − upper) on the same values, then scale by the same float, so they give the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from gradpress._numba import as_numpy, jit, mix32, use_numba
from gradpress.rng import MASK32, mix32_torch

DEFAULT_PARTITION = 1 << 20


@dataclass(frozen=True)
class RHTLayout:
    """How a vector of ``numel`` values is partitioned, padded and signed.

    Attributes:
        numel: length of the original vector.
        partition: the most values one Hadamard block takes.
        key: the 32-bit key of the ±1 diagonal: D_ii = −1 where ``mix32(i, key)`` has its top bit set.
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
        return 1.0 - 2.0 * (mix32_torch(index, self.key) >> 31).to(torch.float32)

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
        out = torch.empty(layout.padded_numel, dtype=x.dtype)
        _forward_numba(as_numpy(x.contiguous()), as_numpy(out), *_kernel_args(layout, x.dtype))
        return out
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
        out = torch.empty(layout.numel, dtype=y.dtype)
        _inverse_numba(as_numpy(y.contiguous()), as_numpy(out), *_kernel_args(layout, y.dtype))
        return out
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


# -- the CPU kernel ------------------------------------------------------------------------------------
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
        start += n


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
    """Whether D_ii = −1: the top bit of mix32(i, key)."""
    return (mix32(i, key) >> np.uint32(31)) != np.uint32(0)


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
