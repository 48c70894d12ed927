"""S2 Reducer's blocks (:mod:`gradpress.compressors.sketch`): the block layout and block-wise top-K's
selection (Ge et al., Section 2.2), numba on the CPU and torch elsewhere, the same bits.

:func:`block_norms` ranks the blocks by their squared L2 norms, summed pairwise in a fixed order, without
overflowing; :func:`select_blocks` finds the K largest of them on the CPU in one pass (a threshold
estimated from a strided sample, then an exact selection among the blocks at or above it), the blocks of
``topk_indices(block_norms(...))``; :func:`gather_blocks` and :func:`_scatter_blocks` copy blocks out of a
tensor and back into a zeroed one.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros

from gradpress.compressors.selection import select_largest, topk_indices
from gradpress.kernels.jit import as_numpy, jit, kernel, use_numba, wide_vectors


def as_blocks(flat: torch.Tensor, size: int) -> torch.Tensor:
    """``flat`` as [ceil(numel / size), size] (a view when size divides numel, else a padded copy)."""
    blocks = -(-flat.numel() // size)
    if blocks * size == flat.numel():
        return flat.view(blocks, size)
    return torch.nn.functional.pad(flat, (0, blocks * size - flat.numel())).view(blocks, size)


def block_norms(blocks: torch.Tensor) -> torch.Tensor:
    """The ranking of Section 2.2's block top-K: every block's squared L2 norm in float32, finite for
    any finite input.

    The squares of a block are summed pairwise in a fixed order, the block zero-padded to a power of
    two P and halved log2(P) times (first half plus second half), so that the numba kernel
    (:func:`select_blocks`) forms the same bits on the CPU as this function anywhere (a torch
    ``sum(dim=1)`` may add in any order); for one value per block the norm is its square.

    Squares of values beyond 2^64 (fp32, bf16) overflow float32; when a norm comes out infinite, every
    block is first scaled by the same power of two 2^-e, with 2^e > max|x|, so that each square is below
    1 and each sum below B, and ranked by those: the order of blocks whose norms did not overflow is
    kept (scaling by a power of two is exact, short of underflow for blocks below 2^-75 of the largest,
    which then tie)."""
    values = blocks if blocks.dtype == torch.float32 else blocks.float()
    norms = _pairwise_squares(values)
    if norms.numel() and not math.isfinite(float(norms.max())):  # blocks are finite: the squares overflowed
        norms = _pairwise_squares(values * _overflow_scale(float(values.abs().max())))
    return norms


def _overflow_scale(largest: float) -> float:
    """2^-e with 2^e > ``largest`` (max|x|): every scaled square below 1."""
    return math.ldexp(1.0, -math.frexp(largest)[1])


def _pairwise_squares(values: torch.Tensor) -> torch.Tensor:
    """Row sums of ``values``' squares, pairwise: padded to a power of two, then halved (see
    :func:`block_norms`)."""
    squares = values.square()
    width = squares.shape[1]
    padded = 1 << (width - 1).bit_length()
    if padded != width:
        squares = torch.nn.functional.pad(squares, (0, padded - width))
    while squares.shape[1] > 1:
        half = squares.shape[1] // 2
        squares = squares[:, :half] + squares[:, half:]
    return squares[:, 0]


def element_indices(blocks: torch.Tensor, size: int, numel: int) -> torch.Tensor:
    """Flat indices (int64) of every value of the given blocks, padding beyond ``numel`` left out."""
    indices = (blocks.unsqueeze(1) * size + torch.arange(size, device=blocks.device)).reshape(-1)
    return indices if blocks.numel() == 0 or int(indices[-1]) < numel else indices[indices < numel]


# -- block top-K's selection: numba on the CPU, the same blocks as topk_indices(block_norms(...)) ---
_SAMPLE = 16384  # blocks whose norms estimate the K-th largest norm
_CHUNK = 1024  # values block top-K's decode zeroes at a time (then copies the blocks that start there: in L1)


def select_blocks(values: torch.Tensor, size: int, kept: int) -> torch.Tensor:
    """Indices (int64, ascending) of the ``kept`` blocks of ``size`` values of flat float32 ``values``
    with the largest :func:`block_norms`, ties going to the lower block: the blocks of
    ``topk_indices(block_norms(as_blocks(values, size)), kept)``, without a full sort or a norms tensor.

    With many blocks the K-th largest norm is estimated from a strided sample of :data:`_SAMPLE`
    blocks, with about 3 standard deviations of margin (6 on a second try); one pass then forms every
    norm and keeps the blocks at or above the estimate, and an exact partial selection
    (``np.partition``) takes the K largest of those. Every block that ties with the K-th largest is among
    them, so the result is exact whatever the estimate; one that leaves fewer than K candidates, or a
    norm that overflowed float32, sends the caller to all the norms. ``values`` must be finite."""
    numel = values.numel()
    blocks = -(-numel // size)
    if not use_numba(values) or kept >= blocks:
        return topk_indices(block_norms(as_blocks(values, size)), kept)
    x = as_numpy(values)
    squares = np.empty(1 << (size - 1).bit_length(), dtype=np.float32)  # one block, padded
    if blocks >= 2 * _SAMPLE:
        stride = blocks // _SAMPLE
        sample = np.empty(-(-blocks // stride), dtype=np.float32)
        _strided_norms(x, size, stride, np.float32(1.0), squares, sample)
        if np.isfinite(sample.max()):
            expected = kept / stride
            positions = np.empty(blocks, dtype=np.int64)  # pages are only touched up to the count found
            norms = np.empty(blocks, dtype=np.float32)
            for margin in (3.0, 6.0):
                want = min(sample.size, math.ceil(1.05 * expected + margin * math.sqrt(expected) + 8))
                threshold = np.partition(sample, sample.size - want)[sample.size - want]
                if threshold <= 0:
                    break
                found = _collect_norms(x, size, threshold, squares, positions, norms)
                if not np.isfinite(norms[:found].max(initial=0)):
                    break  # an overflow: all norms, scaled
                if found >= kept:
                    return torch.from_numpy(_keep_top(norms[:found], positions[:found], kept))
    norms = np.empty(blocks, dtype=np.float32)
    _strided_norms(x, size, 1, np.float32(1.0), squares, norms)
    if not np.isfinite(norms.max()):  # finite values whose squares overflowed: as block_norms scales them
        scale = np.float32(_overflow_scale(float(values.abs().max())))
        _strided_norms(x, size, 1, scale, squares, norms)
    positions = np.arange(blocks, dtype=np.int64)
    return torch.from_numpy(_keep_top(norms, positions, kept))


def gather_blocks(flat: torch.Tensor, chosen: torch.Tensor, size: int) -> torch.Tensor:
    """``as_blocks(flat, size)[chosen]``: the chosen blocks as [K, size] in ``flat``'s dtype, the last
    one zero-padded, by contiguous copies (CPU, numba)."""
    out = torch.empty(chosen.numel(), size, dtype=flat.dtype)
    bits = np.uint32 if flat.dtype == torch.float32 else np.uint16
    _gather_blocks(as_numpy(flat).view(bits), size, as_numpy(chosen), as_numpy(out).view(bits).reshape(-1))
    return out


@kernel(inline="always")
def _block_norm(x, lo, hi, scale, squares):  # pragma: no cover - compiled
    """:func:`block_norms` of x[lo:hi] times ``scale``: squares, zero-padded to ``squares.size`` (a power
    of two), halved pairwise."""
    if squares.size == 1:
        v = x[lo] * scale
        return v * v
    block = x[lo:hi]  # loops from 0 over views: no negative-index wraparound, so they vectorize
    for e in range(block.size):
        v = block[e] * scale
        squares[e] = v * v
    for e in range(block.size, squares.size):
        squares[e] = np.float32(0.0)
    half = squares.size // 2
    while half:
        for e in range(half):
            squares[e] += squares[e + half]
        half //= 2
    return squares[0]


@jit
def _strided_norms(x, size, stride, scale, squares, out):  # pragma: no cover - compiled
    """out[j] = the norm of block j·stride."""
    numel = x.size
    for j in range(out.size):
        lo = j * stride * size
        out[j] = _block_norm(x, lo, min(lo + size, numel), scale, squares)


@jit
def _collect_norms(x, size, threshold, squares, positions, norms):  # pragma: no cover - compiled
    """The blocks whose norm is at least ``threshold``, ascending, and their norms; how many."""
    numel = x.size
    found = 0
    if size == 1:  # 64 squares compared at a time into a bit mask (vectorized), then its set bits
        wide_vectors()
        whole = numel - numel % 64
        for start in range(0, whole, 64):
            mask = np.uint64(0)
            for k in range(64):
                v = x[start + k]
                mask |= np.uint64(v * v >= threshold) << np.uint64(k)
            while mask:
                i = start + trailing_zeros(mask)
                positions[found] = i
                norms[found] = x[i] * x[i]
                found += 1
                mask &= mask - np.uint64(1)
        for i in range(whole, numel):
            v = x[i] * x[i]
            positions[found] = i  # written always, kept if v qualifies
            norms[found] = v
            found += v >= threshold
        return found
    for b in range(positions.size):
        lo = b * size
        v = _block_norm(x, lo, min(lo + size, numel), np.float32(1.0), squares)
        if v >= threshold:
            positions[found] = b
            norms[found] = v
            found += 1
    return found


@jit
def _keep_top(norms, positions, kept):  # pragma: no cover - compiled
    """The ``kept`` positions of largest norm (ties: the earlier ones), in the given (ascending) order."""
    out = np.empty(kept, dtype=np.int64)
    select_largest(norms, positions, kept, out)
    return out


@jit
def _gather_blocks(bits, size, chosen, out):  # pragma: no cover - compiled
    if size == 1:
        for j in range(chosen.size):
            out[j] = bits[chosen[j]]
        return
    for j in range(chosen.size):
        lo = chosen[j] * size
        block, into = bits[lo:lo + size], out[j * size:(j + 1) * size]
        for e in range(block.size):
            into[e] = block[e]
        for e in range(block.size, size):
            into[e] = 0


@jit
def _scatter_blocks(values, size, indices, out):  # pragma: no cover - compiled
    """The dense vector of block top-K's packet: the blocks at ``indices`` (ascending), zeros between,
    written _CHUNK values at a time (zeroed, then the blocks that start there copied in, all in L1);
    False (``out`` then unusable) if the indices are not ascending or out of range."""
    numel = out.size
    done = 0  # out[:done] is final
    j = 0
    for lo in range(0, numel, _CHUNK):
        hi = min(lo + _CHUNK, numel)
        zeros = out[max(lo, done):hi]
        for e in range(zeros.size):
            zeros[e] = np.float32(0.0)
        while j < indices.size:
            start = np.int64(indices[j]) * size
            if start >= hi:
                break
            if start < done:
                return False
            if size == 1:
                out[start] = values[j]
                done = start + 1
            else:
                into, block = out[start:start + size], values[j * size:(j + 1) * size]
                for e in range(into.size):
                    into[e] = block[e]
                done = start + into.size
            j += 1
        done = max(done, hi)
    return j == indices.size
