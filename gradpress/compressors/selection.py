"""Exact top-k selection on the CPU, shared by the sparsifiers (top-k, CLT-k) and S2 Reducer's block
top-K (:mod:`gradpress.compressors.sparsify`, :mod:`gradpress.compressors.cltk`,
:mod:`gradpress.compressors.sketch`).

:func:`topk_indices` finds the k values of largest magnitude without a full sort: a threshold estimated
from a strided sample (:func:`sample_stride`), one numba pass that collects the candidates at or above
it, 16 at a time (:func:`_collect_at_least`), and an exact selection among those few (:func:`kth_largest`,
a radix select on the float bits, then :func:`select_largest`); elsewhere, or where the estimate falls
short, torch's top-k on keys that break ties towards the lower position (:func:`_largest`). Both give
the same positions.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch

from gradpress.core.compressor import Compressor, check_finite
from gradpress.kernels import simd as V
from gradpress.kernels.jit import (
    as_numpy,
    bits_of_f32,
    compress_at_least16,
    jit,
    kernel,
    use_numba,
    wide_vectors,
)


def named(where: str | Compressor) -> str:
    """The name errors give: ``where`` itself, or a compressor's spec (formed only when needed: forming
    a spec costs microseconds, a visible share of a small tensor's compression)."""
    return where if isinstance(where, str) else where.spec


def topk_indices(flat: torch.Tensor, k: int, where: str | Compressor = "top-k") -> torch.Tensor:
    """Indices (int64, ascending) of the k largest |flat|, exact, ties going to the lower index.

    Raises :class:`~gradpress.core.compressor.NonFiniteError` if ``flat`` holds NaN/Inf: on the sampled
    path every NaN/Inf passes the candidate threshold, so checking the candidates costs O(k), not a
    pass of its own."""
    chosen = _sampled_top(flat if flat.dtype == torch.float32 else flat.float(), k, where)
    if chosen is not None:
        return chosen[0].long()
    check_finite(flat, named(where))
    if k >= flat.numel():
        return torch.arange(flat.numel(), device=flat.device)
    return _largest(flat.float().abs(), k)


SAMPLE = 16384  # about this many values, at a stride, estimate top-k's threshold
#: from SAMPLED[0] values on the threshold is sampled (below, every value is a candidate), up to SAMPLED[1]
#: (int32 positions, 16-wide stores); larger tensors take torch's top-k
SAMPLED = (4096, 2**31 - 64)


def _sampled_top(values: torch.Tensor, k: int, where: str | Compressor,
                 addends: tuple[np.ndarray, np.ndarray] | None = None, residual: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """(positions (int32, ascending), values, whether ``values`` holds the residual) of the k largest
    |values| of a float32 CPU tensor, exact, ties to the lower position, without a full sort; None where
    it does not apply (another device, k = 0, 2^31 values or more) or where the sampled threshold leaves
    fewer than k candidates (rare): the caller then takes the full top-k. Below 4096 values every value
    is a candidate.

    The k-th magnitude is estimated from a sample of ~16k values at a prime stride (:func:`sample_stride`),
    one numba pass collects the values at or above it with their positions (16 at a time, compressed in
    registers), and an exact selection among those few finds the k largest (:func:`kth_largest`). A
    threshold of 0 (a sample mostly zeros) makes every value a candidate. The estimate keeps ~3 standard
    deviations of margin, so it almost always leaves at least k candidates; if not, a threshold with
    twice the margin is tried. Every NaN/Inf is a candidate (or lies in the sample): seen there,
    :func:`check_finite` raises, so there is no check pass of its own.

    ``addends`` (m, g): ``values`` is to become m + g (float32, fused error feedback), formed by the
    candidate pass, which reads every element and writes the sum into ``values`` whatever it returns
    (a raise included); the sample reads the sums at its positions. ``residual`` too: where the
    threshold is above 0, that pass writes the candidates as zeros, and the candidates not chosen are
    written back (:func:`_restore_unchosen`): ``values`` then holds the residual of top-k (the third
    element True); on every other way out the sum is formed again in full (:func:`_add`), so that
    ``values`` holds it.
    """
    n = values.numel()
    if not (use_numba(values) and 1 <= k <= n <= SAMPLED[1] and values.is_contiguous()):
        return None
    x = as_numpy(values).reshape(-1)
    if n < SAMPLED[0] or k == n:  # every value a candidate
        if addends is not None:
            _add(*addends, x)
        return (*_chosen(x, np.arange(n, dtype=np.int32), k, values, where), False)
    stride = sample_stride(n)
    sample = np.empty(-(-n // stride), dtype=np.float32)
    expected = k / stride
    for margin in (3.0, 6.0):
        want = min(sample.size, math.ceil(1.05 * expected + margin * math.sqrt(expected) + 8))
        threshold = float(_sampled_kth(*(addends or (x, None)), stride, want, sample))
        if not math.isfinite(threshold):  # NaN/Inf in the sample: raises
            if addends is not None:
                _add(*addends, x)
            check_finite(values, named(where))
        # about want·stride candidates: room for twice that (then for all n, if more are found; with
        # a threshold of 0, the sample mostly zeros, every value is one)
        room = min(n, 2 * want * stride + 1024) if threshold > 0.0 else n
        zeroed = addends is not None and residual and threshold > 0.0
        kept, positions, count, zeroed = _candidates(x, addends, threshold, room, k, zeroed)
        addends = None  # (x holds the sum now)
        if count >= k:
            chosen, chosen_values = _chosen(kept[:count], positions[:count], k, values, where)
            if zeroed:
                _restore_unchosen(x, kept, positions, count, as_numpy(chosen))
            return chosen, chosen_values, zeroed
        if not _all_finite(kept[:count]):
            check_finite(values, named(where))
    return None


def _candidates(x: np.ndarray, addends: tuple[np.ndarray, np.ndarray] | None, threshold: float, room: int,
                k: int, zeroed: bool) -> tuple[np.ndarray, np.ndarray, int, bool]:
    """(kept, positions, count, zeroed) of :func:`_sampled_top`'s candidate pass at ``threshold``
    (:func:`_collect_at_least`): room for ``room`` candidates, then for all of x if more are found. With
    ``addends`` the pass forms x = m + g; where it wrote the candidates as zeros (``zeroed``) but they will
    not make the residual (fewer than k, or a NaN/Inf among them), the sum is formed again in full and
    ``zeroed`` comes back False."""
    for capacity in dict.fromkeys((room, x.size)):
        kept = np.empty(capacity + 16, dtype=np.float32)
        positions = np.empty(capacity + 16, dtype=np.int32)
        # (with addends: the sum's one pass, written in full even when the room runs out)
        count = _collect_at_least(x, addends, np.float32(threshold), kept, positions, zeroed)
        # (count −1: the room ran out)
        if zeroed and addends is not None and (count < k or not _all_finite(kept[:count])):
            _add(*addends, x)  # the sum in full, candidates included, for what follows
            zeroed = False
        addends = None
        if count >= 0:
            break
    return kept, positions, count, zeroed


def _chosen(candidates: np.ndarray, positions: np.ndarray, k: int, values: torch.Tensor,
            where: str | Compressor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, values) of the k ``candidates`` of largest magnitude (:func:`_keep_largest`); a NaN/Inf
    among them raises :class:`~gradpress.core.compressor.NonFiniteError`, counting those of ``values``."""
    chosen, chosen_values = torch.empty(k, dtype=torch.int32), torch.empty(k, dtype=torch.float32)
    if not _keep_largest(candidates, positions, k, as_numpy(chosen_values), as_numpy(chosen)):
        check_finite(values, named(where))
    return chosen, chosen_values


@jit
def _sampled_kth(x, addend, stride, want, sample):  # pragma: no cover - compiled
    """The ``want``-th largest |x| over x[0], x[stride], … (of x + addend where ``addend`` is an array,
    read at those positions only); NaN if one of those is NaN or Inf."""
    top = np.uint32(0)
    for j in range(sample.size):
        m = abs(x[j * stride]) if addend is None else abs(x[j * stride] + addend[j * stride])
        sample[j] = m
        top = max(top, bits_of_f32(m))
    if top >= np.uint32(0x7F800000):
        return np.float32(np.nan)
    return kth_largest(sample, want)


@functools.lru_cache(maxsize=256)
def sample_stride(n: int) -> int:
    """The stride of top-k's sample of a vector of n values: the smallest prime at or above n / 16384.
    A stride sharing a factor with the rows of a weight matrix would see a few of its columns only
    (3211264 values at stride 196 see 4 columns of 784, all zero where the input's corner pixels are);
    a prime one visits every column of any row length it does not divide, in a pattern the hardware
    prefetcher follows (a random position per window took 2.5× longer from memory)."""
    stride = max(2, n // SAMPLE)
    while any(stride % d == 0 for d in range(2, math.isqrt(stride) + 1)):
        stride += 1
    return stride


@jit
def _add(m, g, x):  # pragma: no cover - compiled
    """x = m + g (float32)."""
    wide_vectors()
    for i in range(x.size):
        x[i] = m[i] + g[i]


@jit
def _all_finite(values):  # pragma: no cover - compiled
    top = np.uint32(0)
    for j in range(values.size):
        top = max(top, bits_of_f32(abs(values[j])))
    return top < np.uint32(0x7F800000)


def _largest(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest values (float32, ≥ 0), ascending; among equal values the lower
    positions win. Each value and its position make one int64 key, bits·2^32 + (n − 1 − position)
    (a non-negative float orders as its bits), so the top k keys are the answer, ties included, with
    no count read by the host (on a GPU: no wait) — below 2^32 values; beyond, the k-th largest value
    and the positions above and at it."""
    n = magnitudes.numel()
    if n <= 1 << 32:
        keys = (magnitudes.view(torch.int32).long() << 32) | (n - 1 - torch.arange(n, device=magnitudes.device))
        top = torch.topk(keys, k, sorted=False).values
        return (n - 1 - (top & 0xFFFFFFFF)).sort().values
    kth = torch.topk(magnitudes, k, sorted=False).values.min()
    above = (magnitudes > kth).nonzero().squeeze(1)
    ties = (magnitudes == kth).nonzero().squeeze(1)[: k - above.numel()]
    return torch.cat([above, ties]).sort().values


@jit
def _collect_at_least(x, addends, threshold, kept, positions, zeroed=False):  # pragma: no cover - compiled
    """The values v of x with not |v| < threshold (at or above it, and NaN), in order, into ``kept``
    and their positions (int32) into ``positions``, 16 values at a time (:func:`compress_at_least16`);
    their count, or −1 if more than fit (both outputs have 16 slots of room beyond that).

    ``addends`` (m, g), or None: x = m + g is formed in the same pass (fused error feedback), and the
    candidates taken from the sums in registers; in full even when the outputs overflow. ``zeroed``
    (with addends, and a threshold above 0): the candidates are written to x as +0 instead (top-k's
    residual, :func:`_restore_unchosen`)."""
    n = x.size
    capacity = kept.size - 16
    count = 0
    full = n - n % 16
    if addends is not None:
        m, g, phi = V.pointer(addends[0]), V.pointer(addends[1]), V.pointer(x)
        limit, magnitude = V.isplat(bits_of_f32(threshold)), V.isplat(np.uint32(0x7FFFFFFF))
        zero = V.fsplat(np.float32(0))
        for start in range(0, full, 16):
            v = V.add(V.load(m, start), V.load(g, start))
            if zeroed:  # lanes below the threshold (|v|'s pattern below the threshold's: NaN is not) keep v
                below = V.shr(V.sub(V.and_(V.bits(v), magnitude), limit), V.isplat(np.uint32(31)))
                V.store(phi, start, V.select(below, v, zero))
            else:
                V.store(phi, start, v)
            count += compress_at_least16(v, start, threshold, kept, positions, min(count, capacity))
    else:
        for start in range(0, full, 16):
            count += compress_at_least16(x, start, threshold, kept, positions, min(count, capacity))
    for i in range(full, n):
        v = x[i] if addends is None else addends[0][i] + addends[1][i]
        candidate = not abs(v) < threshold
        if addends is not None:
            x[i] = np.float32(0.0) if zeroed and candidate else v
        if candidate:
            if count < capacity:
                kept[count] = v
                positions[count] = i
            count += 1
    return count if count <= capacity else -1


@jit
def _restore_unchosen(x, kept, positions, count, chosen):  # pragma: no cover - compiled
    """x[positions[j]] = kept[j] for the candidates j < count not among the ``chosen`` positions (both
    ascending, ``chosen`` a subset): top-k's residual after a candidate pass that wrote every candidate
    as +0."""
    c = 0
    for j in range(count):
        if c < chosen.size and chosen[c] == positions[j]:
            c += 1
        else:
            x[positions[j]] = kept[j]


@jit
def _keep_largest(values, positions, k, out_values, out_positions):  # pragma: no cover - compiled
    """The k of the candidates (``values`` at ascending ``positions``) of largest |value|, ties to the
    lower position, in order, into ``out_values`` and ``out_positions``; False (and nothing written) if a
    candidate is NaN or Inf."""
    magnitudes = np.empty(values.size, np.float32)
    top = np.uint32(0)
    for j in range(values.size):
        m = abs(values[j])
        magnitudes[j] = m
        top = max(top, bits_of_f32(m))
    if top >= np.uint32(0x7F800000):
        return False
    select_largest(magnitudes, positions, k, out_positions, values, out_values)
    return True


@kernel(inline="always")
def select_largest(values, positions, k, out, kept=None, out_kept=None):  # pragma: no cover - compiled
    """out[:k] = the ``k`` of ``positions`` whose ``values`` (float32, ≥ 0) are largest, in their given
    order, ties to the earlier ones: the k-th largest value (:func:`kth_largest`), then one pass; with
    ``kept``, out_kept[:k] = the entries of ``kept`` at the same places (top-k's signed values)."""
    kth = kth_largest(values.copy(), k)
    ties_left = k
    for j in range(values.size):
        ties_left -= values[j] > kth
    filled = 0
    for j in range(values.size):
        v = values[j]
        if v > kth or (v == kth and ties_left > 0):
            if v == kth:
                ties_left -= 1
            out[filled] = positions[j]
            if kept is not None:
                out_kept[filled] = kept[j]
            filled += 1


RADIX = 16  # the first digit of kth_largest: the sign, the exponent and 7 bits of the mantissa
PARTITIONED = 2048  # up to this many values, kth_largest partitions them as they are


@kernel(inline="always")
def kth_largest(values, k):  # pragma: no cover - compiled
    """The k-th largest (1 ≤ k ≤ size) of float32 ``values`` ≥ 0 (NaN: above +Inf), reordering them: a
    radix select on their bit patterns (a non-negative float orders as its bits). One pass counts the
    values per leading 16 bits, which places the k-th in one of 65536 ranges; the values in it (few,
    unless many share those bits) are moved to the front and partitioned (``np.partition``, which takes
    up to 2048 values without the count)."""
    if values.size <= PARTITIONED:
        return np.partition(values, values.size - k)[values.size - k]
    bits = values.view(np.uint32)
    shift = np.uint32(32 - RADIX)
    counts = np.zeros(1 << RADIX, np.int32)
    digit = 0  # the largest seen
    for j in range(bits.size):
        d = np.int64(bits[j] >> shift)
        counts[d] += 1
        digit = max(digit, d)
    above = 0
    while above + counts[digit] < k:
        above += counts[digit]
        digit -= 1
    within = 0
    for j in range(bits.size):
        if np.int64(bits[j] >> shift) == digit:
            bits[within] = bits[j]
            within += 1
    rank = k - above  # the rank-th largest of the first ``within`` values
    return np.partition(values[:within], within - rank)[within - rank]
