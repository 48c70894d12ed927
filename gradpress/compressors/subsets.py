"""Random-k's shared random subsets (:mod:`gradpress.compressors.sparsify`): a uniformly random k-subset
of range(n), the same on every rank for the same shared seed (invariant: explicit randomness,
docs/design.md), drawn from the counter hash (:func:`gradpress.kernels.jit.mix32`) by sequential sampling
without replacement — a numba kernel with a bitmap on the CPU, the same draws vectorized in torch
elsewhere (:func:`random_subset`).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros

from gradpress.core.rng import mix32_torch, seed32
from gradpress.kernels.jit import as_numpy, jit, mix32, use_numba

#: random-k's subsets come from the counter hash for tensors below 2^32 values (:func:`random_subset`)
HASHED_LIMIT = 2**32


def random_subset(n: int, k: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A uniformly random k-subset of range(n), ascending (int64): the same on every rank and device
    for the same shared ``seed`` (invariant: explicit randomness, docs/design.md).

    Sequential sampling without replacement from a counter stream: draw j (j = 0, 1, …) is
    mix32(j, seed) mapped to [0, n) by Lemire's multiply-shift with rejection (exactly uniform: a hash
    whose low product word falls below 2^32 mod n is skipped), and a value already drawn is skipped;
    the first m = min(k, n − k) distinct values are the subset, or, when k > n/2, its complement. Every
    k-subset is equally likely (each draw is uniform over the values not yet drawn), so each position is
    kept with probability k/n. O(k + n/64) on the CPU: a bitmap of n bits marks the values drawn, and
    a scan of its words lists them in order (numba); elsewhere, the same draws vectorized (torch).
    Tensors of 2^32 values or more use torch's generator seeded with ``seed`` (device-specific draws).
    """
    if k >= n:
        return torch.arange(n, device=device)
    if n >= HASHED_LIMIT:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        return _generator_subset(n, k, generator, device)
    seed = seed32(seed)
    if use_numba(torch.empty(0, device=device)):
        out = torch.empty(k, dtype=torch.int64)
        _subset_gather(n, k, np.uint32(seed), _bitmap(n), _NO_VALUES, as_numpy(out), _NO_VALUES)
        return out
    return _subset_torch(n, k, seed, torch.device(device))


def _bitmap(n: int) -> np.ndarray:
    return np.zeros((n + 63) // 64, dtype=np.uint64)


_NO_VALUES = np.empty(0, dtype=np.uint32)


def _lemire_threshold(n: int) -> int:
    """Products h·n whose low 32 bits fall below this are rejected: 2^32 mod n of them, which leaves
    every value of [0, n) exactly ⌊2^32/n⌋ accepted hashes."""
    return (2**32 - n) % n


@jit
def _subset_gather(n, k, seed, bitmap, x, out, values):  # pragma: no cover - compiled
    """:func:`random_subset` into ``out`` (``bitmap``: zeroed, n bits); with ``values`` non-empty, also
    values[j] = x[out[j]] (raw bits: gathered in the same scan)."""
    m = min(k, n - k)
    threshold = np.uint64((np.uint64(2**32) - np.uint64(n)) % np.uint64(n))
    modulus = np.uint64(n)
    low = np.uint64(0xFFFFFFFF)
    j = np.uint32(0)
    count = 0
    while count < m:
        product = np.uint64(mix32(j, seed)) * modulus
        j = np.uint32(j + np.uint32(1))
        if product & low < threshold:
            continue
        v = product >> np.uint64(32)
        word = v >> np.uint64(6)
        bit = np.uint64(1) << (v & np.uint64(63))
        if bitmap[word] & bit:
            continue
        bitmap[word] |= bit
        count += 1
    gather = values.size > 0
    filled = 0
    last = bitmap.size - 1
    for w in range(bitmap.size):
        b = bitmap[w]
        if m < k:  # k > n/2: the complement of the values drawn
            b = ~b
            if w == last and n % 64:
                b &= (np.uint64(1) << np.uint64(n % 64)) - np.uint64(1)
        while b:
            i = w * 64 + trailing_zeros(b)
            out[filled] = i
            if gather:
                values[filled] = x[i]
            filled += 1
            b &= b - np.uint64(1)


def _subset_torch(n: int, k: int, seed: int, device: torch.device) -> torch.Tensor:
    """The torch twin of :func:`_subset_gather` (the same draws, vectorized): the first m distinct
    accepted values of the stream, found among the first ``draws`` hashes (more if they hold fewer)."""
    m = min(k, n - k)
    threshold = _lemire_threshold(n)
    # m distinct among n: about n·ln(n/(n−m)) draws are needed, a few more are drawn
    draws = int(n * (math.log(n) - math.log(n - m)) * 1.1) + 64
    while True:
        h = mix32_torch(torch.arange(draws, dtype=torch.int64, device=device), seed)
        # h·n = A·2^16 + B (A, B < 2^48: h's 16-bit halves times n), exactly in int64 (n < 2^32): its
        # low word is that of S = (A mod 2^16)·2^16 + B, its high word ⌊A/2^16⌋ + ⌊S/2^32⌋
        a, b = (h >> 16) * n, (h & 0xFFFF) * n
        s = ((a & 0xFFFF) << 16) + b
        accepted = ((a >> 16) + (s >> 32))[(s & 0xFFFFFFFF) >= threshold]
        distinct, inverse = torch.unique(accepted, return_inverse=True)
        if distinct.numel() >= m:
            break
        draws *= 2
    first = torch.full((distinct.numel(),), accepted.numel(), dtype=torch.int64, device=device)
    first.scatter_reduce_(0, inverse, torch.arange(accepted.numel(), device=device), "amin")
    chosen = distinct[first.argsort()[:m]]  # the first m distinct values in draw order
    if m == k:
        return chosen.sort().values
    kept = torch.ones(n, dtype=torch.bool, device=device)
    kept.index_fill_(0, chosen, False)  # (not kept[chosen] = False: that makes the False a host tensor)
    return kept.nonzero().squeeze(1)


def _generator_subset(n: int, k: int, generator: torch.Generator, device: torch.device | str) -> torch.Tensor:
    """A uniformly random k-subset of range(n), sorted (int64), from torch's generator (huge tensors).

    For k ≤ n/2, draws with replacement until k distinct values are seen (which is sampling without
    replacement), costing O(k log k) instead of a permutation of all n.
    """
    if 2 * k > n:
        return torch.randperm(n, generator=generator, device=device)[:k].sort().values
    draws = k + 2 * k * k // n + 16
    distinct = torch.randint(n, (draws,), generator=generator, device=device).unique()
    while distinct.numel() < k:
        more = torch.randint(n, (draws,), generator=generator, device=device)
        distinct = torch.cat([distinct, more]).unique()
    if distinct.numel() > k:
        keep = torch.randperm(distinct.numel(), generator=generator, device=device)[:k]
        distinct = distinct[keep].sort().values
    return distinct
