"""Threshold-v (Dutta et al., AAAI 2020; GRACE §3.2), and the threshold selection DGC and Adaptive share.

Threshold-v sends the elements whose magnitude exceeds a fixed v, with their int32 indices: a variable
number of elements, so the wire size depends on the data. GRACE notes that a good v depends on the model
and is hard to pick.

Shared pieces: :func:`select_above` (one pass collecting the indices of |x| > t) and
:func:`sample_threshold` (DGC's estimate of the threshold that keeps a given fraction from a random
sample, Lin et al. 2018 sampling 0.1 %–1 % of the gradients; no iterative adjustment, so no host round
trip per adjustment).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradpress.compressors.onebit import as_float32
from gradpress.compressors.sparsify import Sparse, named
from gradpress.core.compressor import Compressor, check_finite, register, scaled_sum, sum_addends
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context, mix32_torch, seed32
from gradpress.kernels.jit import abs_above64, as_numpy, compress_above16, jit, mix32, use_numba, wide_vectors
from gradpress.kernels.passes import scaled_into_bits

MIN_SAMPLE = 4096  # below this many elements the threshold comes from the whole tensor, exactly
MIN_KEPT = 50      # a sample large enough to hold this many kept elements (±14 % on the count)


@register("threshold")
@dataclass(repr=False)
class Threshold(Sparse):
    """Threshold-v: the elements with |x| > v and their int32 indices (GRACE §3.2; Dutta et al. 2020).

    Deterministic, biased, data-dependent size (``expected_nbytes`` is None). ``v`` has no universal
    default (it depends on the model); 0.01 is ours. GRACE Table 1 runs it with error feedback.
    """

    v: float = param(0.01, "[0, inf)")
    kept = "values"
    examples = ("threshold:v=0.001", "threshold:v=0")
    checks_finite = True  # the selecting pass keeps the largest |x|, which shows NaN/Inf

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        return packet_above(flat, self.v, self)

    def sparse(self, packet: Packet) -> tuple[torch.Tensor, torch.Tensor]:
        return packet["indices"], packet["values"].float()

    def compress_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                     ctx: Context | None = None, beta: float = 1.0, gamma: float = 1.0) -> Packet:
        """Threshold-v of φ = β·m + γ·g with the sum formed in the selecting pass (see
        :meth:`Compressor.compress_sum`): per block, φ is written to ``out`` (keeping the largest |φ|)
        and its elements above v gathered from L1; the same bits as the sum, then :meth:`compress`. The
        residual memory's update then touches only the k sent (:meth:`Sparse.residual`)."""
        addends = sum_addends(memory, grad, out, beta, gamma)
        if addends is None:
            return super().compress_sum(memory, grad, out, ctx, beta, gamma)
        packet = packet_above(out.view(-1), self.v, self, addends=addends)
        packet.shape = out.shape
        return packet


def sparse_packet(flat: torch.Tensor, indices: torch.Tensor) -> Packet:
    """Values at ``indices`` (in the input dtype) and the indices as int32."""
    return Packet({"values": flat[indices], "indices": indices.to(torch.int32)}, flat.shape, flat.dtype)


def packet_above(flat: torch.Tensor, threshold: float, where: str | Compressor = "threshold", expected: int | None = None,
                 checked: bool = False, addends: tuple | None = None) -> Packet:
    """:func:`sparse_packet` of the elements with |x| > threshold, values and int32 indices gathered in
    the pass that finds them (numba: 16 values at a time, compressed in registers), which also keeps
    the largest |x|: NaN/Inf in ``flat`` raise :class:`~gradpress.core.compressor.NonFiniteError` (as
    ``where``'s), so the caller needs no check pass (``checked``: the caller's own pass has found x
    finite). ``expected``: about how many will be kept (DGC's estimate): buffers of twice that, and a
    second pass with whole-size ones if more are found. Buffers are trimmed to the count found unless
    that keeps most. ``addends`` (m, g, β, γ), or None: ``flat`` (float32) is to become
    fl32(fl32(m·β) + fl32(g·γ)), formed in the first pass (fused error feedback), whatever happens."""
    x = as_float32(flat)
    if not use_numba(x) or x.numel() > torch.iinfo(torch.int32).max - 64:
        if addends is not None:
            m, g, beta, gamma = addends
            scaled_sum(torch.from_numpy(m), torch.from_numpy(g), float(beta), float(gamma), x)
        if not checked:
            check_finite(x, named(where))
        return sparse_packet(flat, select_above(flat, threshold))
    n = x.numel()
    for capacity in ((2 * expected + 1024, n) if expected is not None and 2 * expected + 1024 < n else (n,)):
        values = torch.empty(capacity + 64, dtype=torch.float32)
        indices = torch.empty(capacity + 64, dtype=torch.int32)
        count, top = _gather_above(as_numpy(x), np.float32(threshold), values.numpy(), indices.numpy(),
                                   not checked or addends is not None, addends)
        addends = None  # formed, in full: a second try reads x
        if top >= NON_FINITE:
            check_finite(x, named(where))
        if count >= 0:
            break
    values, indices = values[:count], indices[:count]
    if 2 * count + 1024 < capacity:  # don't hold large buffers for a few values
        values, indices = values.clone(), indices.clone()
    return Packet({"values": values.to(flat.dtype), "indices": indices}, flat.shape, flat.dtype)


def select_above(flat: torch.Tensor, threshold: float) -> torch.Tensor:
    """Ascending int64 indices of the elements with |x| > threshold (so never a zero when t ≥ 0)."""
    x = as_float32(flat)
    t = np.float32(threshold)
    if use_numba(x):
        out = torch.empty(x.numel(), dtype=torch.int64)
        count = _collect_above(as_numpy(x), t, as_numpy(out))
        return out[:count].clone()
    return (x.abs() > torch.tensor(t, device=x.device)).nonzero().squeeze(1)


def draw_sample(x: torch.Tensor, ratio: float, generator: torch.Generator, fraction: float = 1.0) -> torch.Tensor:
    """About ``ratio`` of the elements of ``x`` drawn at random with replacement, at least
    :data:`MIN_SAMPLE` and enough to hold :data:`MIN_KEPT` elements of a kept ``fraction``; the whole
    tensor when that is no smaller."""
    n = x.numel()
    size = max(math.ceil(ratio * n), MIN_SAMPLE, math.ceil(MIN_KEPT / fraction))
    if size >= n:
        return x
    return x[torch.randint(n, (size,), generator=generator, device=x.device)]


def stratified_threshold(x: torch.Tensor, ratio: float, fraction: float, seed: int) -> tuple[float, bool]:
    """DGC's threshold: :func:`sample_threshold` of |x| over a sample of about the size
    :func:`draw_sample` takes (or the whole tensor), drawn by stratified sampling: the tensor is cut
    into strata of w = ⌊d/size⌋ values (the last one shorter) and one position is drawn uniformly in
    each (mix32(t, seed) times the stratum's width, high word: a bias below w/2^32). Each position is as
    likely to be drawn as with sampling at random (but in the last, shorter stratum), and a quantile of
    the sample varies no more; the positions ascend, so the CPU kernel reads them in the pass that also
    finds the largest |x|: a NaN or Inf anywhere makes the threshold NaN, with no pass of its own.
    Returns (threshold, checked): whether that pass saw the whole tensor finite (the numba path)."""
    n = x.numel()
    size = max(math.ceil(ratio * n), MIN_SAMPLE, math.ceil(MIN_KEPT / fraction))
    width = max(1, n // size)
    strata = -(-n // width)
    keep = math.ceil(fraction * strata)
    rank = keep + 1 if keep < strata else 0  # the (keep + 1)-th largest; 0: every value is kept
    if use_numba(x) and n < 2**31:
        threshold = float(_stratified_kth(as_numpy(x), width, np.uint32(seed32(seed)), rank))
        return threshold, True
    if not rank:
        return 0.0, False
    if width == 1:
        return sample_threshold(x.abs(), fraction), False
    return sample_threshold(x[_strata_positions(n, width, seed32(seed), x.device)].abs(), fraction), False


def _strata_positions(n: int, width: int, seed: int, device: torch.device) -> torch.Tensor:
    """The sample's positions (torch twin of :func:`_stratified_kth`'s), int64, ascending."""
    starts = torch.arange(0, n, width, dtype=torch.int64, device=device)
    widths = (n - starts).clamp(max=width)
    return starts + ((mix32_torch(starts // width, seed) * widths) >> 32)


@jit
def _stratified_kth(x, width, seed, rank):  # pragma: no cover - compiled
    """The ``rank``-th largest |x| over the stratified sample (x itself when width is 1; rank 0: 0.0), or
    NaN if x holds NaN or Inf. STRATA strata at a time: the largest |x| of their values and their
    positions (both vectorized), then the values at those positions: with few kept, a list of the
    largest seen (sorted, descending; most values fail the first compare), else all of them for a
    partition."""
    wide_vectors()
    n = x.size
    bits = x.view(np.uint32)
    strata = (n + width - 1) // width if rank else 0  # (rank 0: no sample; the pass checks x only)
    few = rank <= 512
    best = np.full(rank if few else 0, -np.inf, dtype=np.float32)
    sample = np.empty(0 if few else strata, dtype=np.float32)
    positions = np.empty(STRATA, dtype=np.int64)
    top = np.uint32(0)
    if not rank:
        for i in range(n):
            top = max(top, bits[np.uint64(i)] & np.uint32(0x7FFFFFFF))
    for t0 in range(0, strata, STRATA):
        t1 = min(strata, t0 + STRATA)
        for i in range(t0 * width, min(n, t1 * width)):
            top = max(top, bits[np.uint64(i)] & np.uint32(0x7FFFFFFF))
        for t in range(t0, t1):
            start = t * width
            span = np.uint64(min(width, n - start))
            positions[t - t0] = start + np.int64((np.uint64(mix32(np.uint32(t), seed)) * span) >> np.uint64(32))
        for t in range(t0, t1):
            m = abs(x[positions[t - t0]])
            if not few:
                sample[t] = m
            elif m > best[rank - 1]:
                k = rank - 1
                while k > 0 and m > best[k - 1]:
                    best[k] = best[k - 1]
                    k -= 1
                best[k] = m
    if top >= np.uint32(0x7F800000):
        return np.float32(np.nan)
    if rank == 0:
        return np.float32(0.0)
    if few:
        return best[rank - 1]
    return np.partition(sample, strata - rank)[strata - rank]


STRATA = 512  # strata per step of _stratified_kth


def sample_threshold(magnitudes: torch.Tensor, fraction: float) -> float:
    """The threshold t with ``ceil(fraction · s)`` of the s sampled magnitudes above it: the next
    largest sampled value (0 when all are to be kept, so that only zeros are dropped)."""
    s = magnitudes.numel()
    keep = math.ceil(fraction * s)
    if keep >= s:
        return 0.0
    return float(torch.kthvalue(magnitudes.float(), s - keep).values)


@jit
def _gather_above(x, threshold, values, indices, check, addends=None):  # pragma: no cover - compiled
    """(count, largest |x| as bits): values[:count] and indices[:count] are the elements with
    |x| > threshold and their positions, ascending (the buffers hold 64 slots more than their
    capacity: a word of 64 values is written 16 at a time, 16 wide, before the count is checked);
    count −1 if more than the capacity are found (the largest |x| is still the whole tensor's). Block
    by block: the largest magnitude (vectorized), then per word of 64 a mask of |x| > threshold (a
    sparse selection skips most words on it) and the word's values 16 at a time, compressed.
    ``addends`` (m, g, β, γ) or None (numba prunes the branch): x = fl32(fl32(m·β) + fl32(g·γ)) is
    written in the max pass of each block, in full even when the buffers overflow (``check`` must be
    true)."""
    wide_vectors()
    n = x.size
    capacity = values.size - 64
    bits = x.view(np.uint32)
    count = 0
    top = np.uint32(0)
    full = n - n % 64
    for start in range(0, full, BLOCK):
        stop = min(full, start + BLOCK)
        if addends is not None:
            top = max(top, scaled_into_bits(addends, bits, start, stop))
        elif check:
            for i in range(start, stop):
                top = max(top, bits[np.uint64(i)] & np.uint32(0x7FFFFFFF))
        if count < 0:
            if check:
                continue
            break
        for w in range(start, stop, 64):
            if abs_above64(x, w, threshold) == 0:  # (sparse selections skip most words here)
                continue
            for i in range(w, w + 64, 16):
                count += compress_above16(x, i, threshold, values, indices, count)
            if count > capacity:
                count = -1
                break
    if addends is not None:
        top = max(top, scaled_into_bits(addends, bits, full, n))
    for i in range(full, n):
        top = max(top, bits[i] & np.uint32(0x7FFFFFFF))
        if count >= 0 and abs(x[i]) > threshold:
            if count == capacity:
                count = -1
            else:
                values[count] = x[i]
                indices[count] = i
                count += 1
    return count, top


BLOCK = 4096  # values per block of _gather_above: the max pass and the gathering pass read them from L1
NON_FINITE = 0x7F800000  # |x| bit patterns from here up are Inf and NaN


@jit
def _collect_above(x, threshold, out):  # pragma: no cover - compiled
    count = 0
    for i in range(x.size):
        if abs(x[i]) > threshold:
            out[count] = i
            count += 1
    return count
