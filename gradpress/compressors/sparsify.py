"""Sparsifiers: top-k (Aji & Heafield 2017; Alistarh et al. 2018) and random-k (Wangni et al. 2018;
Stich et al. 2018), as in GRACE Table 1.

Both send ``k = max(1, ceil(ratio · d))`` values. Top-k sends the values of largest magnitude and their
int32 indices (k·(b + 32) bits for b-bit values); random-k sends only values: its indices come from the
shared random stream (invariant: explicit randomness, docs/design.md), so every worker picks the same ones,
the receiver regenerates
them, and packets of different workers can be summed (``summable``).

Top-k's selection (a sampled threshold, one candidate pass, an exact selection among the candidates) is
in :mod:`gradpress.compressors.selection`, which other methods share; random-k's subsets are in
:mod:`gradpress.compressors.subsets`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradpress.compressors.selection import (
    SAMPLE,
    _sampled_top,
    kth_largest,
    named,
    sample_stride,
    topk_indices,
)
from gradpress.compressors.subsets import HASHED_LIMIT, _bitmap, _subset_gather, random_subset
from gradpress.core.compressor import (
    Compressor,
    check_finite,
    count_nonfinite,
    divide,
    float32_output,
    register,
    sum_addends,
)
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context, seed32
from gradpress.kernels.jit import as_numpy, finite, jit, use_numba, wide_vectors

#: what this module offers: its own names, and those of the selection and the subsets that other modules
#: import from here
__all__ = ["HASHED_LIMIT", "SAMPLE", "RandomK", "Sparse", "TopK", "float32_decompress", "keep_count",
           "kth_largest", "named", "random_subset", "sample_stride", "scatter", "topk_indices"]


def keep_count(numel: int, ratio: float) -> int:
    """k = max(1, ceil(ratio · d)), at most d."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def scatter(values: torch.Tensor, indices: torch.Tensor, numel: int,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Dense float32 vector of length ``numel`` with ``values`` at ``indices`` (distinct positions), in
    ``out`` (a flat float32 tensor of ``numel`` values on the values' device) if given.

    On the CPU one numba kernel zeroes the vector and writes the values, each index checked against
    the range first (one out of range sends the call to torch's indexed assignment, which raises
    IndexError)."""
    dense = torch.empty(numel, dtype=torch.float32, device=values.device) if out is None else out
    if use_numba(values) and values.is_contiguous() and indices.is_contiguous() and indices.device.type == "cpu" \
            and indices.dtype in (torch.int32, torch.int64) and use_numba(dense):
        if _scatter(dense.numpy(), values.detach().float().numpy(), indices.detach().numpy()):
            return dense
    dense.zero_()
    dense[indices.long()] = values.float()
    return dense


@jit
def _scatter(dense, values, indices):  # pragma: no cover - compiled
    """dense = 0 but dense[indices[j]] = values[j]; False, at the first index out of range."""
    wide_vectors()
    n = np.uint64(dense.size)
    for t in range(dense.size):
        dense[np.uint64(t)] = np.float32(0.0)
    for j in range(indices.size):
        i = np.uint64(indices[np.uint64(j)])  # a negative index wraps beyond every valid one
        if i >= n:
            return False
        dense[i] = values[np.uint64(j)]
    return True


def float32_decompress(compressor: Compressor, packet: Packet) -> torch.Tensor:
    """:meth:`Compressor.decompress` of a method whose ``_decompress`` gives float32, with a shortcut for a
    float32 packet: the decode as it is (reshaped if need be), without the base class's cast and view,
    which cost a visible share of a small tensor's decode. Other packets take the base class's way."""
    if packet.dtype is torch.float32 and packet.numel:
        flat = compressor._decompress(packet)
        if flat.dtype is torch.float32:
            return flat if flat.shape == packet.shape else flat.view(packet.shape)
    return Compressor.decompress(compressor, packet)


class Sparse(Compressor):
    """A method whose packet stands for a few values at known positions of a zero vector: decoding,
    summing into an aggregate and the error-feedback residual touch only those positions (O(k)).
    Subclasses give :meth:`sparse`."""

    def sparse(self, packet: Packet) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, float32 values) of the packet's non-zero part, positions distinct."""
        raise NotImplementedError

    def _decompress(self, packet: Packet) -> torch.Tensor:
        indices, values = self.sparse(packet)
        return scatter(values, indices, packet.numel)

    def decompress(self, packet: Packet) -> torch.Tensor:
        return float32_decompress(self, packet)

    def aggregate(self, packets: list[Packet], out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`Compressor.aggregate` of float32 packets on the CPU in one numba kernel
        (:func:`_sparse_mean`): the output zeroed, each packet's values added at its positions in packet order, and the sums
        divided by n at the positions sent (0 / n = +0 elsewhere), counting NaN/Inf as it goes: the same
        bits, in one pass over the output, without a division pass over all of it. Other packets, and a
        sum that overflowed, take the base class's way."""
        first = packets[0]
        if not (first.numel and first.dtype == torch.float32 and use_numba(first["values"])):
            return super().aggregate(packets, out)
        pairs = [self.sparse(packet) for packet in packets]
        if not all(p.numel == first.numel and i.device.type == "cpu" and i.dtype == pairs[0][0].dtype
                   and i.dtype in (torch.int32, torch.int64) and v.dtype == torch.float32
                   for p, (i, v) in zip(packets, pairs, strict=True)):
            return super().aggregate(packets, out)
        total = float32_output(out, first.numel)
        if total is None:
            total = torch.empty(first.numel, dtype=torch.float32)
        bounds = np.cumsum([0] + [i.numel() for i, _ in pairs], dtype=np.int64)
        for _ in range(2):  # (positions sorted, the second time, where a packet's were not ascending)
            indices = torch.cat([i.reshape(-1) for i, _ in pairs])
            values = torch.cat([v.reshape(-1) for _, v in pairs])
            nonfinite = _sparse_mean(as_numpy(total), as_numpy(indices.contiguous()),
                                     as_numpy(values.contiguous()), bounds, len(packets))
            if nonfinite != _UNORDERED:
                break
            orders = [i.reshape(-1).argsort() for i, _ in pairs]  # (positions are distinct)
            pairs = [(i.reshape(-1)[o], v.reshape(-1)[o]) for (i, v), o in zip(pairs, orders, strict=True)]
        if nonfinite != 0:  # a position out of range, or a sum that overflowed
            return super().aggregate(packets, out)
        return total.view(first.shape)

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """Adds the sent values only: x + 0 = x exactly, and a sum that starts at +0 is never −0."""
        indices, values = self.sparse(packet)
        total.index_add_(0, indices.long(), values)

    def residual(self, x: torch.Tensor, packet: Packet, owned: bool = False) -> torch.Tensor:
        """x with x[i] − v_i at the sent positions (x − 0 = x elsewhere, exactly); in x itself when owned."""
        if owned and x.dtype == torch.float32 and x.is_contiguous():
            e = x.view(-1)
        else:
            e = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True).view(-1)
        indices, values = self.sparse(packet)
        if packet.dtype != torch.float32:  # decompress() hands the values over in the packet's dtype
            values = values.to(packet.dtype).float()
        if (use_numba(e) and indices.device.type == "cpu" and indices.dtype in (torch.int32, torch.int64)
                and values.is_contiguous() and indices.is_contiguous()
                and _subtract_at(as_numpy(e), as_numpy(indices), as_numpy(values))):
            return e
        indices = indices.long()
        e[indices] = e[indices] - values
        return e


@jit
def _subtract_at(x, positions, values):  # pragma: no cover - compiled
    """x[positions[j]] −= values[j] (positions distinct); False, with nothing written, if one is out of
    range."""
    n = np.uint64(x.size)
    for j in range(positions.size):
        if np.uint64(positions[j]) >= n:  # a negative position wraps beyond every valid one
            return False
    for j in range(positions.size):
        x[positions[j]] -= values[j]
    return True


_UNORDERED = -2  # _sparse_mean: a packet's positions are not ascending
_MEAN_CHUNK = 2048  # values _sparse_mean finishes at a time (8 KiB: in L1)


@jit
def _sparse_mean(total, positions, values, bounds, count):  # pragma: no cover - compiled
    """total = the mean of ``count`` sparse vectors, packet p's positions and values at
    [bounds[p], bounds[p + 1]) of ``positions`` and ``values`` (its positions distinct and ascending):
    chunk by chunk of the output (in L1), zeros, each packet's values added at their positions in
    packet order, then each position sent divided by ``count`` once; how many of those means are
    NaN/Inf, −1 (nothing written) if a position is out of range, or _UNORDERED (nothing written) if a
    packet's positions are not ascending. The bits of zeroing the whole output, adding each packet in
    turn and dividing the positions sent: every position sums the same values in the same order."""
    n = total.size
    packets = bounds.size - 1
    for p in range(packets):
        previous = -1
        for j in range(bounds[p], bounds[p + 1]):
            i = np.int64(positions[j])
            if np.uint64(i) >= np.uint64(n):  # a negative position wraps beyond every valid one
                return -1
            if i <= previous:
                return _UNORDERED
            previous = i
    wide_vectors()
    start, stop = bounds[:-1].copy(), bounds[:-1].copy()  # each packet's positions in the chunk
    done = np.zeros(_MEAN_CHUNK, np.uint8)
    divisor = np.float32(count)
    nonfinite = 0
    for first in range(0, n, _MEAN_CHUNK):
        last = min(n, first + _MEAN_CHUNK)
        for i in range(np.uint64(first), np.uint64(last)):
            total[i] = np.float32(0.0)
        for p in range(packets):
            j = start[p]
            while j < bounds[p + 1] and positions[j] < last:
                total[positions[j]] += values[j]
                j += 1
            stop[p] = j
        for p in range(packets):
            for j in range(start[p], stop[p]):
                i = np.int64(positions[j])
                if not done[i - first]:
                    done[i - first] = 1
                    mean = np.float32(total[i] / divisor)
                    total[i] = mean
                    nonfinite += not abs(mean) < np.inf
        for p in range(packets):
            for j in range(start[p], stop[p]):
                done[np.int64(positions[j]) - first] = 0
            start[p] = stop[p]
    return nonfinite


@register("topk")
@dataclass(repr=False)
class TopK(Sparse):
    """Top-k sparsification: the k entries of largest |x| and their indices.

    On the CPU the selection avoids a full ``torch.topk``: a threshold is estimated from a sample
    of the values, one numba pass collects the candidates above it, and an exact top-k runs on those few
    (falling back to the full top-k when the estimate leaves fewer than k candidates). The result is
    the exact top-k either way.
    """

    ratio: float = param(0.01, "(0, 1]")
    kept = "values"
    examples = ("topk:ratio=0.1", "topk:ratio=1")
    checks_finite = True  # topk_indices sees every NaN/Inf among its candidates

    def kept_numel(self, numel: int) -> int:
        return keep_count(numel, self.ratio)

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return keep_count(numel, self.ratio) * (dtype.itemsize + 4)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        k = keep_count(flat.numel(), self.ratio)
        chosen = _sampled_top(flat, k, self) if flat.dtype == torch.float32 else None
        if chosen is None:
            indices = topk_indices(flat, k, self)
            chosen = indices.to(torch.int32), flat[indices], False
        return Packet({"values": chosen[1], "indices": chosen[0]}, flat.shape, flat.dtype)

    def sparse(self, packet: Packet) -> tuple[torch.Tensor, torch.Tensor]:
        return packet["indices"], packet["values"].float()

    def compress_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                     ctx: Context | None = None, beta: float = 1.0, gamma: float = 1.0) -> Packet:
        """Top-k of φ = m + g with the sum formed in the selection's candidate pass (see
        :meth:`Compressor.compress_sum`): the threshold's sample and that pass read m and g, write φ
        to ``out`` and collect the values at or above the threshold; the same bits as the sum, then
        :meth:`compress`. Other factors β, γ than 1 take the default."""
        chosen = self._fused(memory, grad, out, beta, gamma, residual=False)
        if chosen is None:
            return super().compress_sum(memory, grad, out, ctx, beta, gamma)
        return Packet({"values": chosen[1], "indices": chosen[0]}, out.shape, out.dtype)

    def compress_residual_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                              ctx: Context | None = None, beta: float = 1.0,
                              gamma: float = 1.0) -> tuple[Packet, bool]:
        """Top-k of φ = m + g and its residual e = φ − C⁻¹(C(φ)) in ``out`` (see
        :meth:`Compressor.compress_residual_sum`): the candidate pass writes φ with the candidates (the
        values at or above the sampled threshold) zeroed, and those the selection does not keep are
        written back from the candidates' list, so that ``out`` holds φ where nothing was sent and +0
        where it was (φ_i − φ_i), the bits of :meth:`compress_sum` then :meth:`residual`, without the
        residual's k scattered writes into 13 MB (a quarter as many, for a 1 % top-k of a sampled
        threshold). ``(packet, False)`` with φ in ``out`` where that does not apply (other factors, a
        threshold of 0, the rare fallbacks); on an error ``out`` holds φ."""
        chosen = self._fused(memory, grad, out, beta, gamma, residual=True)
        if chosen is None:
            return super().compress_residual_sum(memory, grad, out, ctx, beta, gamma)
        return Packet({"values": chosen[1], "indices": chosen[0]}, out.shape, out.dtype), chosen[2]

    def _fused(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, beta: float, gamma: float,
               residual: bool) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """:func:`_sampled_top` of φ = m + g formed in ``out`` (None: not on this path)."""
        addends = sum_addends(memory, grad, out) if beta == 1.0 and gamma == 1.0 else None
        if addends is None:
            return None
        return _sampled_top(out.view(-1), keep_count(out.numel(), self.ratio), self, addends[:2], residual)


@register("randomk")
@dataclass(repr=False)
class RandomK(Sparse):
    """Random-k sparsification: k entries chosen uniformly without replacement from the shared stream.

    With ``scale=true`` the kept values are multiplied by d/k, which makes it unbiased (Wangni et al.;
    the Natural compression paper's S^q, Def. 5, with ω = d/q − 1, Thm 10); GRACE's version does not
    scale and relies on error feedback. A scaled value beyond the dtype's range saturates at its
    largest (d/k·x is an estimate of x, which is within it); the mean of several workers' values is
    formed in float64 where d/k·Σx overflows float32.
    """

    ratio: float = param(0.01, "(0, 1]")
    scale: bool = False
    summable = True
    kept = "values"
    examples = ("randomk:scale=true", "randomk:ratio=0.5,scale=true")

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.scale

    def kept_numel(self, numel: int) -> int:
        return keep_count(numel, self.ratio)

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return keep_count(numel, self.ratio) * dtype.itemsize

    checks_finite = True  # by a pass of its own, faster than the base class's (a max, not a count)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        n = flat.numel()
        k = keep_count(n, self.ratio)
        seed = ctx.shared_seed("randomk")
        if not (use_numba(flat) and finite(flat)):  # (the message counts them: check_finite's pass)
            check_finite(flat, self.spec)
        if use_numba(flat) and n < HASHED_LIMIT:  # the subset drawn and its values gathered in one kernel
            indices, values = torch.empty(k, dtype=torch.int64), torch.empty(k, dtype=flat.dtype)
            bits = np.uint32 if flat.element_size() == 4 else np.uint16
            _subset_gather(n, k, np.uint32(seed32(seed)), _bitmap(n), as_numpy(flat).view(bits),
                           as_numpy(indices), as_numpy(values).view(bits))
        else:
            indices = random_subset(n, k, seed, flat.device)
            values = flat[indices]
        # every receiver regenerates the indices from the seed; the sender's packet keeps them as well
        meta = {"seed": seed, "indices": indices}
        return Packet({"values": values}, flat.shape, flat.dtype, meta)

    def sparse(self, packet: Packet) -> tuple[torch.Tensor, torch.Tensor]:
        """The values (scaled by d/k if ``scale``) at the k positions regenerated from the packet's seed."""
        n = packet.numel
        k = keep_count(n, self.ratio)
        values = packet["values"].float()
        if self.scale:
            values = _saturated(values * (n / k), packet.dtype)  # k values: finite, within the dtype
        return self._indices(packet, n, k), values

    def _indices(self, packet: Packet, n: int, k: int) -> torch.Tensor:
        indices = packet.meta.get("indices")
        if indices is None:
            indices = random_subset(n, k, packet.meta["seed"], packet.device)
        return indices

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean over ``count`` workers of their scaled values: (d/k·Σ)/count on the k values, the
        float32 operations (and bits) of the base class's dense decode; in float64 where d/k·Σ
        overflows float32 (values near its largest); saturated at the dtype's range. Scattered into
        ``out`` where it can take it (see :meth:`Compressor.decode_sum`)."""
        if not self.scale or packet.numel == 0:
            return super().decode_sum(packet, summed, count, out)
        n = packet.numel
        k = keep_count(n, self.ratio)
        total = summed[0].float()
        values = total * (n / k)
        divide(values, count, out=values)
        if count_nonfinite(values):  # every worker's values are finite: d/k·Σ overflowed float32
            values = (total.double() * (n / k) / count).clamp(-_F32_MAX, _F32_MAX).float()
        values = _saturated(values, packet.dtype)
        into = float32_output(out, n)
        return scatter(values, self._indices(packet, n, k), n, into).to(packet.dtype).view(packet.shape)


_F32_MAX = torch.finfo(torch.float32).max


def _saturated(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 ``values`` clamped in place to ±``finfo(dtype).max`` (±Inf of an overflow included)."""
    largest = torch.finfo(dtype).max
    return values.clamp_(-largest, largest)
