"""Which implementation runs, without loading numba: the numba kernels on CPU tensors (unless
``GRADPRESS_NUMBA=0`` or :func:`numba_disabled`), torch elsewhere; and the zero-copy numpy views the
kernels take.

The core (:mod:`gradpress.core.compressor`, :mod:`gradpress.core.feedback`) imports this module only, and
the kernel modules (:mod:`gradpress.kernels.jit` and those importing it) when a call needs a kernel, so
that ``import gradpress`` loads no numba: it loads with the first CPU tensor a kernel handles.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import numpy as np
import torch

_enabled = os.environ.get("GRADPRESS_NUMBA", "1") != "0"


def use_numba(t: torch.Tensor) -> bool:
    """Whether the numba kernel should handle tensor ``t``."""
    return _enabled and t.is_cpu


def numba_enabled() -> bool:
    """Whether CPU tensors go to the numba kernels (not under ``GRADPRESS_NUMBA=0`` nor
    :func:`numba_disabled`)."""
    return _enabled


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
