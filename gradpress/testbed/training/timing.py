"""The copy of a gradient, timed on a rank after training: the unit in which the reports state per-step
costs (:func:`gradient_copy_s`, :func:`copy_s`)."""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch


def gradient_copy_s(model: torch.nn.Module) -> float:
    """:func:`copy_s` of a tensor the size of ``model``'s trainable parameters, timed on this rank after
    training, in the same process and load as the steps: the unit in which the reports state per-step
    costs (compression, a step's excess over ``noop``'s)."""
    return copy_s(sum(p.numel() for p in model.parameters() if p.requires_grad))


def copy_s(numel: int, repeats: int = 21) -> float:
    """Median seconds of one copy of a float32 tensor of ``numel`` values from memory into memory
    (``dst.copy_(src)``), after one untimed round: into a kept buffer, so no page faults, and from and
    to tensors that the copies since their last use have evicted from the last-level cache (a rotation
    through pairs of buffers holding more than twice the cache), so neither end is cache-hot.

    A ``clone()`` is not that stable a unit: it lands in memory the allocator has just freed (for 13 MB
    here, read and written within the 32 MB L3: ~0.5 ms) or in fresh pages (page faults: ~10x), which
    moved a 13 MB clone between 0.48 and 1.24 ms in the runs of one ``compare``."""
    nbytes = 4 * max(1, numel)
    cache = last_level_cache_bytes()
    # (a tensor under 1/256 of the cache stays in it: its copy is mostly the call's overhead anyway)
    pairs = 1 if nbytes >= 2 * cache else min(256, 1 + math.ceil(cache / nbytes))
    pool = torch.randn(2 * pairs, numel)
    times = []
    for i in range(pairs + repeats):
        source, target = pool[i % pairs], pool[pairs + i % pairs]
        started = time.perf_counter()
        target.copy_(source)
        if i >= pairs:
            times.append(time.perf_counter() - started)
    return sorted(times)[repeats // 2]


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """The largest CPU cache's size that Linux reports (``/sys/devices/system/cpu/cpu0/cache``), else
    ``default``."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG"
                         else int(text))
        except (OSError, ValueError, KeyError):
            continue
    return max(sizes, default=default)
