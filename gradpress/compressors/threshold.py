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

from gradpress._numba import as_numpy, jit, use_numba
from gradpress.compressor import register
from gradpress.compressors.onebit import as_float32
from gradpress.compressors.sparsify import Sparse
from gradpress.packet import Packet
from gradpress.registry import param
from gradpress.rng import Context

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

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        return packet_above(flat, self.v)

    def sparse(self, packet: Packet) -> tuple[torch.Tensor, torch.Tensor]:
        return packet["indices"], packet["values"].float()


def sparse_packet(flat: torch.Tensor, indices: torch.Tensor) -> Packet:
    """Values at ``indices`` (in the input dtype) and the indices as int32."""
    return Packet({"values": flat[indices], "indices": indices.to(torch.int32)}, flat.shape, flat.dtype)


def packet_above(flat: torch.Tensor, threshold: float) -> Packet:
    """:func:`sparse_packet` of the elements with |x| > threshold, values and int32 indices gathered in
    the pass that finds them (numba); buffers are trimmed to the count found unless that keeps most."""
    x = as_float32(flat)
    if not use_numba(x) or x.numel() > torch.iinfo(torch.int32).max:
        return sparse_packet(flat, select_above(flat, threshold))
    n = x.numel()
    values, indices = torch.empty(n, dtype=torch.float32), torch.empty(n, dtype=torch.int32)
    count = _gather_above(as_numpy(x), np.float32(threshold), as_numpy(values), as_numpy(indices))
    values, indices = values[:count], indices[:count]
    if 2 * count < n:  # don't hold n-sized buffers for a few values
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


def sample_threshold(magnitudes: torch.Tensor, fraction: float) -> float:
    """The threshold t with ``ceil(fraction · s)`` of the s sampled magnitudes above it: the next
    largest sampled value (0 when all are to be kept, so that only zeros are dropped)."""
    s = magnitudes.numel()
    keep = math.ceil(fraction * s)
    if keep >= s:
        return 0.0
    return float(torch.kthvalue(magnitudes.float(), s - keep).values)


@jit
def _gather_above(x, threshold, values, indices):  # pragma: no cover - compiled
    count = 0
    for i in range(x.size):
        v = x[i]
        if abs(v) > threshold:
            values[count] = v
            indices[count] = i
            count += 1
    return count


@jit
def _collect_above(x, threshold, out):  # pragma: no cover - compiled
    count = 0
    for i in range(x.size):
        if abs(x[i]) > threshold:
            out[count] = i
            count += 1
    return count
