"""Sparsifiers: top-k (Aji & Heafield 2017; Alistarh et al. 2018) and random-k (Wangni et al. 2018;
Stich et al. 2018), as in GRACE Table 1.

Both send ``k = max(1, ceil(ratio · d))`` values. Top-k sends the values of largest magnitude and their
int32 indices (k·(b + 32) bits for b-bit values); random-k sends only values: its indices come from the
shared random stream (DESIGN invariant 2), so every worker picks the same ones, the receiver regenerates
them, and packets of different workers can be summed (``summable``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradpress._numba import as_numpy, jit, use_numba
from gradpress.compressor import Compressor, check_finite, count_nonfinite, nonfinite_error, register
from gradpress.packet import Packet
from gradpress.registry import param
from gradpress.rng import Context


def keep_count(numel: int, ratio: float) -> int:
    """k = max(1, ceil(ratio · d)), at most d."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def scatter(values: torch.Tensor, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Dense float32 vector of length ``numel`` with ``values`` at ``indices`` (distinct positions)."""
    dense = torch.zeros(numel, dtype=torch.float32, device=values.device)
    if use_numba(dense) and values.is_contiguous() and indices.is_contiguous():
        _scatter(as_numpy(dense), as_numpy(values.float()), as_numpy(indices))
    else:
        dense[indices.long()] = values.float()
    return dense


@jit
def _scatter(dense, values, indices):  # pragma: no cover - compiled
    for j in range(indices.size):
        dense[indices[j]] = values[j]


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
        indices = indices.long()
        e[indices] = e[indices] - values
        return e


@register("topk")
@dataclass(repr=False)
class TopK(Sparse):
    """Top-k sparsification: the k entries of largest |x| and their indices.

    On the CPU the selection avoids a full ``torch.topk``: a threshold is estimated from a strided
    sample, one numba pass collects the candidates above it, and an exact top-k runs on those few
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
        return keep_count(numel, self.ratio) * (_element_bytes(dtype) + 4)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        k = keep_count(flat.numel(), self.ratio)
        indices = topk_indices(flat, k, self.spec)
        return Packet({"values": flat[indices], "indices": indices.to(torch.int32)}, flat.shape, flat.dtype)

    def sparse(self, packet: Packet) -> tuple[torch.Tensor, torch.Tensor]:
        return packet["indices"], packet["values"].float()


def topk_indices(flat: torch.Tensor, k: int, where: str = "top-k") -> torch.Tensor:
    """Indices (int64, ascending) of the k largest |flat|, exact, ties going to the lower index.

    Raises :class:`~gradpress.compressor.NonFiniteError` if ``flat`` holds NaN/Inf: on the sampled
    path every NaN/Inf passes the candidate threshold, so checking the candidates costs O(k), not a
    pass of its own."""
    n = flat.numel()
    if use_numba(flat) and 65536 <= n and k < n:
        values = flat if flat.dtype == torch.float32 else flat.float()
        indices = _topk_by_sampled_threshold(values, k, where)
        if indices is not None:
            return indices
    check_finite(flat, where)
    if k >= n:
        return torch.arange(n, device=flat.device)
    return _largest(flat.float().abs(), k)


def _topk_by_sampled_threshold(values: torch.Tensor, k: int, where: str) -> torch.Tensor | None:
    """CPU top-k without a full sort: estimate the k-th magnitude from a strided sample of ~65k values,
    collect the candidates at or above it in one numba pass, then take the exact top-k among them.

    The estimate keeps ~3 standard deviations of margin, so it almost always leaves at least k
    candidates; if not, a threshold with twice the margin is tried, and None sends the caller to the
    full top-k. Either way the result is exact.
    """
    n = values.numel()
    stride = max(1, n // 65536)
    sample = values[::stride].abs()
    expected = k / stride
    candidates = torch.empty(n, dtype=torch.int64)  # pages are only touched up to the count found
    for margin in (3.0, 6.0):
        want = min(sample.numel(), math.ceil(1.05 * expected + margin * math.sqrt(expected) + 8))
        threshold = float(torch.topk(sample, want, sorted=False).values.min())
        if threshold <= 0.0:
            return None
        count = _collect_at_least(as_numpy(values), threshold, as_numpy(candidates))
        bad = count_nonfinite(values[candidates[:count]])  # NaN/Inf are always candidates
        if bad:
            raise nonfinite_error(where, bad, n)
        if count >= k:
            chosen = torch.empty(k, dtype=torch.int64)
            _keep_largest(as_numpy(values), as_numpy(candidates[:count]), k, as_numpy(chosen))
            return chosen
    return None


def _largest(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest values, ascending; among equal values the lower positions win."""
    kth = torch.topk(magnitudes, k, sorted=False).values.min()
    above = (magnitudes > kth).nonzero().squeeze(1)
    ties = (magnitudes == kth).nonzero().squeeze(1)[: k - above.numel()]
    return torch.cat([above, ties]).sort().values


@jit
def _collect_at_least(x, threshold, out):  # pragma: no cover - compiled
    """Positions of |x| ≥ threshold, and of NaN (a comparison with NaN is false, its negation true)."""
    count = 0
    for i in range(x.size):
        if not abs(x[i]) < threshold:
            out[count] = i
            count += 1
    return count


@jit
def _keep_largest(x, candidates, k, out):  # pragma: no cover - compiled
    """The k candidates (ascending positions) of largest |x|, ties to the lower position, written to out."""
    magnitudes = np.empty(candidates.size, np.float32)
    for j in range(candidates.size):
        magnitudes[j] = abs(x[candidates[j]])
    kth = np.partition(magnitudes, candidates.size - k)[candidates.size - k]
    above = 0
    for j in range(candidates.size):
        above += magnitudes[j] > kth
    ties_left = k - above
    filled = 0
    for j in range(candidates.size):
        m = magnitudes[j]
        if m > kth or (m == kth and ties_left > 0):
            if m == kth:
                ties_left -= 1
            out[filled] = candidates[j]
            filled += 1


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
        return keep_count(numel, self.ratio) * _element_bytes(dtype)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        k = keep_count(flat.numel(), self.ratio)
        indices = random_indices(flat.numel(), k, ctx.shared_generator(flat.device, "randomk"), flat.device)
        # every receiver regenerates the indices from the seed; the sender's packet keeps them as well
        meta = {"seed": ctx.shared_seed("randomk"), "indices": indices}
        return Packet({"values": flat[indices]}, flat.shape, flat.dtype, meta)

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
            generator = torch.Generator(device=packet.device)
            generator.manual_seed(packet.meta["seed"])
            indices = random_indices(n, k, generator, packet.device)
        return indices

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int) -> torch.Tensor:
        """The mean over ``count`` workers of their scaled values: (d/k·Σ)/count on the k values, the
        float32 operations (and bits) of the base class's dense decode; in float64 where d/k·Σ
        overflows float32 (values near its largest); saturated at the dtype's range."""
        if not self.scale or packet.numel == 0:
            return super().decode_sum(packet, summed, count)
        n = packet.numel
        k = keep_count(n, self.ratio)
        total = summed[0].float()
        values = (total * (n / k)).div_(count)
        if count_nonfinite(values):  # every worker's values are finite: d/k·Σ overflowed float32
            values = (total.double() * (n / k) / count).clamp(-_F32_MAX, _F32_MAX).float()
        values = _saturated(values, packet.dtype)
        return scatter(values, self._indices(packet, n, k), n).to(packet.dtype).view(packet.shape)


_F32_MAX = torch.finfo(torch.float32).max


def _saturated(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 ``values`` clamped in place to ±``finfo(dtype).max`` (±Inf of an overflow included)."""
    largest = torch.finfo(dtype).max
    return values.clamp_(-largest, largest)


def random_indices(n: int, k: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """A uniformly random k-subset of range(n), sorted (int64).

    For k ≤ n/2, draws with replacement until k distinct values are seen (which is sampling without
    replacement), costing O(k log k) instead of a permutation of all n.
    """
    if k >= n:
        return torch.arange(n, device=device)
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
