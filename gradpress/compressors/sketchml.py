"""SketchML (Jiang, Fu, Yang and Cui, SIGMOD 2018; GRACE §3.3).

SketchML keeps the non-zero elements of a gradient (sparse gradients are its target), builds a quantile
sketch of their values (Greenwald–Khanna, GRACE ref. [26]) and splits them into equal-frequency buckets;
each value is sent as its bucket's index and decoded to the bucket's mean. The paper further compresses
the bucket indices with a MinMaxSketch (hashing, lossy) and the keys with delta-binary encoding; GRACE's
implementation, like this one, stops at the quantile buckets.

Here:

* the bucket edges are quantiles of a random sample of the non-zero values (``sample_ratio``, at least
  4096 values; a quantile sketch is an approximation too), sorted once, no per-element search: a cell
  table (see :mod:`gradpress.compressors.eightbit`) places each value with one comparison, a short
  forward probe where quantiles crowd into one cell;
* codes are ``bits`` wide (8 by default): code 0 is an exact zero, codes 1 .. 2^bits − 1 the buckets;
  the means are exact (fixed-point sums, see :mod:`gradpress.compressors.onebit`);
* the positions of the non-zeros are sent as int32 indices only when that is cheaper than coding every
  element (d·bits > nnz·(32 + bits)); otherwise every element gets a code and the index list is empty.

Wire: ``codes`` (packed), ``means`` (float32, one per bucket), ``indices`` (int32, possibly empty).
Variable size; biased; GRACE Table 1 runs it with error feedback (the ``residual`` default).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradpress.compressors.eightbit import (
    BLOCK,
    CROWDED,
    cell_table,
    lookup,
    lookup_add,
    order_key,
    rank_in_cell,
)
from gradpress.compressors.onebit import as_float32, checked_extreme_and_nonzeros, fixed_point_scale, to_fixed
from gradpress.compressors.threshold import draw_sample, select_above
from gradpress.core.compressor import Compressor, register
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context
from gradpress.kernels.bits import pack_bits, unpack_bits
from gradpress.kernels.jit import as_numpy, gather16, jit, kernel, use_numba


@register("sketchml")
@dataclass(repr=False)
class SketchML(Compressor):
    """SketchML (Jiang et al., SIGMOD 2018): the non-zero values in equal-frequency quantile buckets,
    sent as packed bucket codes plus the buckets' means (see the module docstring)."""

    bits: int = param(8, "[1, 8]")
    sample_ratio: float = param(0.01, "(0, 1]")
    examples = ("sketchml:bits=4", "sketchml:bits=1")
    checks_finite = True  # the pass for the fixed-point scale shows NaN/Inf

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = as_float32(flat)
        n = x.numel()
        largest, nnz = checked_extreme_and_nonzeros(x, self.spec)
        sparse = nnz * (32 + self.bits) < n * self.bits
        indices = select_above(x, 0.0) if sparse else torch.empty(0, dtype=torch.int64, device=x.device)
        values = x[indices] if sparse else x
        if nnz == 0:
            values = values[:0]
        edges = self.edges(values, ctx)
        codes, means = encode(values, edges, fixed_point_scale(abs(largest), n))
        packed = codes if self.bits == 8 else pack_bits(codes, self.bits)  # (8 bits: already one per byte)
        return Packet({"codes": packed, "means": means,
                       "indices": indices.to(torch.int32)}, flat.shape, flat.dtype)

    def edges(self, values: torch.Tensor, ctx: Context) -> torch.Tensor:
        """B − 1 sorted float32 edges splitting a sample of the non-zero ``values`` into B equal-frequency
        buckets, B = min(2^bits − 1, non-zero sample size)."""
        generator = ctx.private_generator(values.device, "sketchml")
        sample = sort(draw_sample(values, self.sample_ratio, generator))
        zero = sample.new_zeros(1)  # the zeros (±0) of the sorted sample lie in [below, above): skip them
        below, above = torch.cat([torch.searchsorted(sample, zero, right=right) for right in (False, True)]).tolist()
        nonzero = sample.numel() - (above - below)
        buckets = min(2**self.bits - 1, nonzero)
        if buckets <= 1:
            return sample[:0]
        ranks = torch.arange(1, buckets, device=sample.device) * nonzero // buckets
        return sample[ranks + (ranks >= below) * (above - below)].contiguous()

    def _decompress(self, packet: Packet) -> torch.Tensor:
        indices, packed = packet["indices"], packet["codes"]
        count = indices.numel() or (packet.numel if packed.numel() else 0)
        table = torch.cat([packet["means"].new_zeros(1), packet["means"]])
        whole = self.bits == 8 and packed.numel() == count  # one code a byte: read them in place
        codes = packed if whole else unpack_bits(packed, self.bits, count)
        values = lookup(table, codes)
        if not indices.numel():
            return values if count else torch.zeros(packet.numel, device=packet.device)
        out = torch.zeros(packet.numel, dtype=torch.float32, device=packet.device)
        out[indices.long()] = values
        return out

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """``total += decompress(packet)``: a dense packet's codes looked up and added in one numba pass
        (no decoded temporary; the same bits), a sparse one's values added at their positions only
        (x + 0 = x exactly, and a sum that starts at +0 is never −0, as
        :class:`~gradpress.compressors.sparsify.Sparse` adds)."""
        indices, packed = packet["indices"], packet["codes"]
        if indices.numel():
            count = indices.numel()
        elif packed.numel() and packet.numel:
            count = packet.numel
        else:  # an all-zero tensor (rare): its zeros added as the dense formula adds them
            super().accumulate(total, packet)
            return
        table = torch.cat([packet["means"].new_zeros(1), packet["means"]])
        whole = self.bits == 8 and packed.numel() == count
        codes = packed if whole else unpack_bits(packed, self.bits, count)
        if indices.numel():
            total.index_add_(0, indices.long(), lookup(table, codes))
        elif not lookup_add(table, codes, total):
            total += lookup(table, codes)


def sort(values: torch.Tensor) -> torch.Tensor:
    """Sorted copy (numpy's sort on the CPU, many times faster than torch's there; same result)."""
    if values.device.type == "cpu":
        return torch.from_numpy(np.sort(values.numpy()))
    return values.sort().values


def encode(values: torch.Tensor, edges: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 codes (0 for a zero, 1 + #{edges < v} otherwise) and each bucket's mean (float32, one per
    bucket, 0 for an empty one), the sums taken in fixed point so both paths agree exactly."""
    buckets = edges.numel() + 1
    if values.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device), values.new_zeros(0)
    if use_numba(values):
        codes = torch.empty(values.numel(), dtype=torch.uint8)
        sums_np = np.zeros(buckets + 1, dtype=np.int64)
        counts_np = np.zeros(buckets + 1, dtype=np.int64)
        edges_np = as_numpy(edges)
        cells, crowded = cell_table(edges_np)
        _encode(as_numpy(values), edges_np, cells, crowded > 1, scale, as_numpy(codes), sums_np, counts_np)
        sums, counts = torch.from_numpy(sums_np), torch.from_numpy(counts_np)
    else:  # (on the gradients' device: the means are formed there, with no round trip to the host)
        codes = torch.where(values == 0, 0, torch.searchsorted(edges, values) + 1)
        sums = torch.zeros(buckets + 1, dtype=torch.int64, device=values.device)
        sums = sums.index_add_(0, codes, to_fixed(values, scale))
        counts = torch.bincount(codes, minlength=buckets + 1)
        codes = codes.to(torch.uint8)
    # each mean in float64 (s / scale / c, the fixed-point sum's exact value rounded once, then divided), 0 if empty
    sums, counts = sums[1:].double(), counts[1:].double()
    means = torch.where(counts > 0, sums / scale / counts.clamp_min(1.0), 0.0)
    return codes, means.float()


@jit
def _encode(values, edges, cells, probe, scale, codes, sums, counts):  # pragma: no cover - compiled
    """Code and fixed-point bucket sums of each value, a block at a time: the cell-table entries of the
    values' order keys are gathered, one comparison places a value in a cell with at most one edge, a
    forward probe over the sorted edges one in a crowded cell (looked for only if ``probe``: some cell
    is). The sums and counts are kept in four interleaved copies (element i in copy i mod 4), which
    breaks the chains of additions to one bucket."""
    bits = values.view(np.uint32)
    padded = np.empty(edges.size + 1, dtype=np.float32)
    padded[:-1] = edges
    padded[-1] = np.inf  # a sentinel above every value
    n = values.size
    m = sums.size
    entries = np.empty(BLOCK, dtype=np.uint32)
    fixed = np.empty(BLOCK, dtype=np.int64)
    sums4 = np.zeros(4 * m, dtype=np.int64)  # copy c of bucket j at c·m + j
    counts4 = np.zeros(4 * m, dtype=np.int64)
    for start in range(0, n - n % BLOCK, BLOCK):
        for k in range(BLOCK):
            entries[k] = order_key(bits[start + k]) >> np.uint32(16)
        for k in range(BLOCK):
            fixed[k] = np.int64(np.float64(values[start + k]) * scale)
        for k in range(0, BLOCK, 16):
            gather16(cells, entries, entries, k)
        for k in range(BLOCK):
            codes[start + k] = _code(bits[start + k], entries[k])
        if probe:
            for k in range(BLOCK):
                if entries[k] & CROWDED:
                    codes[start + k] = _probe(values[start + k], bits[start + k], cells, padded)
        for k in range(0, BLOCK, 4):
            _add(sums4, counts4, codes[start + k], fixed[k])
            _add(sums4, counts4, m + codes[start + k + 1], fixed[k + 1])
            _add(sums4, counts4, 2 * m + codes[start + k + 2], fixed[k + 2])
            _add(sums4, counts4, 3 * m + codes[start + k + 3], fixed[k + 3])
    for i in range(n - n % BLOCK, n):
        entry = cells[order_key(bits[i]) >> np.uint32(16)]
        code = _probe(values[i], bits[i], cells, padded) if entry & CROWDED else _code(bits[i], entry)
        codes[i] = code
        _add(sums4, counts4, code, np.int64(np.float64(values[i]) * scale))
    for copy in range(4):
        sums += sums4[copy * m:(copy + 1) * m]
        counts += counts4[copy * m:(copy + 1) * m]


@kernel(inline="always")
def _add(sums, counts, at, fixed):  # pragma: no cover - compiled
    sums[at] += fixed
    counts[at] += 1


@kernel(inline="always")
def _code(b, entry):  # pragma: no cover - compiled
    """1 + #{edges < v} for v with bits ``b`` in a cell with at most one edge; 0 for ±0."""
    rank = rank_in_cell(order_key(b), entry)
    return np.uint8((rank + np.uint32(1)) * np.uint32((b & np.uint32(0x7FFFFFFF)) != 0))


@kernel(inline="always")
def _probe(v, b, cells, padded):  # pragma: no cover - compiled
    """:func:`_code` for v (bits ``b``) in a crowded cell: a forward probe over the sorted edges from
    the first edge of the cell."""
    rank = np.int64((cells[order_key(b) >> np.uint32(16)] >> np.uint32(16)) & np.uint32(0xFF))
    while padded[rank] < v:
        rank += 1
    return np.uint8((rank + 1) * (v != 0))
