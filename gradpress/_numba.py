"""Numba CPU kernels' shared pieces: the JIT decorator, the ``mix32`` hash, and the on/off switch.

Element-wise compressors run a numba kernel on CPU tensors (one pass, fused randomness and bit
packing) and a torch implementation elsewhere; tests check that both give the same bits. Set
``GRADPRESS_NUMBA=0`` (or use :func:`numba_disabled`) to force the torch path on the CPU.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import numpy as np
import torch
from numba import njit

_enabled = os.environ.get("GRADPRESS_NUMBA", "1") != "0"

jit = njit(cache=True, nogil=True)


def use_numba(t: torch.Tensor) -> bool:
    """Whether the numba kernel should handle tensor ``t``."""
    return _enabled and t.device.type == "cpu"


@contextlib.contextmanager
def numba_disabled() -> Iterator[None]:
    """Run the torch implementations on the CPU too (for tests comparing both)."""
    global _enabled
    before, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = before


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """Zero-copy numpy view of a contiguous CPU tensor (bf16 has no numpy dtype: viewed as int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.detach().numpy()


@njit(cache=True, inline="always")
def mix32(i, seed):  # pragma: no cover - compiled
    """MurmurHash3 fmix32 of ``i * 0x9E3779B1 ^ seed`` (see :mod:`gradpress.rng`)."""
    h = (np.uint32(i) * np.uint32(0x9E3779B1)) ^ seed
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


@njit(cache=True, inline="always")
def uniform24(i, seed):  # pragma: no cover - compiled
    """Uniform float32 in [0, 1) with 24 random bits, equal to :func:`gradpress.rng.uniform24_torch`."""
    return np.float32(mix32(i, seed) >> np.uint32(8)) * np.float32(2.0**-24)
