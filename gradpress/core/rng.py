"""Explicit randomness (invariant: explicit randomness, docs/design.md).

Two kinds of streams, both derived from a :class:`Context` and never from the global torch RNG:

* **shared** streams are identical on every rank for a given (seed, step, key): random-k indices, RHT
  signs, sketch hashes. Every worker draws the same values without communicating.
* **private** streams also depend on the rank: stochastic rounding noise, so that the workers' rounding
  errors are independent and average out (THC's authors' code shares this noise across workers, which
  correlates the errors; we don't).

Element-wise stochastic rounding draws its noise from a counter-based hash, ``mix32(i, seed)``: the
MurmurHash3 32-bit finalizer applied to ``i * 0x9E3779B1 ^ seed`` for element index ``i``. It needs no
state, costs a few integer operations per element, and gives the same bits in the numba CPU kernels and
in the torch implementation used on other devices.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, replace

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B1
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any parts, the same in every process (unlike Python's salted ``hash``)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return struct.unpack("<Q", digest)[0] >> 1


@dataclass(frozen=True)
class Context:
    """Where a compression happens: which tensor (``key``), which step, which rank, under which seed.

    The runtime builds one per (step, key) on every rank; a bare ``compressor.compress(x)`` builds its
    own from a per-compressor call counter, so repeated calls draw independent noise.
    """

    seed: int = 0
    step: int = 0
    key: str = ""
    rank: int = 0

    def shared_seed(self, stream: str = "") -> int:
        """Seed of a stream identical on every rank for this (seed, step, key)."""
        return derive_seed("shared", self.seed, self.step, self.key, stream)

    def private_seed(self, stream: str = "") -> int:
        """Seed of a stream that differs between ranks."""
        return derive_seed("private", self.seed, self.step, self.key, self.rank, stream)

    def shared_generator(self, device: torch.device | str = "cpu", stream: str = "") -> torch.Generator:
        return _generator(self.shared_seed(stream), device)

    def private_generator(self, device: torch.device | str = "cpu", stream: str = "") -> torch.Generator:
        return _generator(self.private_seed(stream), device)

    def with_key(self, key: str) -> Context:
        return replace(self, key=key)


def _generator(seed: int, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def seed32(seed: int) -> int:
    """The 32-bit seed the element-wise kernels take."""
    return seed & MASK32


def mix32_torch(index: torch.Tensor, seed: int) -> torch.Tensor:
    """``mix32`` of int64 ``index`` (any device): 32 random bits per element, as int64 in [0, 2^32)."""
    h = ((index * GOLDEN32) & MASK32) ^ seed32(seed)
    h = h ^ (h >> 16)
    h = (h * FMIX_C1) & MASK32
    h = h ^ (h >> 13)
    h = (h * FMIX_C2) & MASK32
    return h ^ (h >> 16)


def uniform24_torch(n: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """n uniforms in [0, 1) with 24 random bits each (float32), element i from ``mix32(i, seed)``."""
    index = torch.arange(n, dtype=torch.int64, device=device)
    return (mix32_torch(index, seed) >> 8).to(torch.float32) * (2.0**-24)


def uniform24_numpy(n: int, seed: int) -> np.ndarray:
    """Same values as :func:`uniform24_torch`, for numpy-side checks."""
    return uniform24_torch(n, seed, "cpu").numpy()
