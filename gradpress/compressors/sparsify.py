"""Sparsifiers: top-k (Aji & Heafield 2017; Alistarh et al. 2018) and random-k (Wangni et al. 2018;
Stich et al. 2018), as in GRACE Table 1.

Both send ``k = max(1, ceil(ratio · d))`` values. Top-k sends the values of largest magnitude and their
int32 indices (k·(b + 32) bits for b-bit values); random-k sends only values: its indices come from the
shared random stream (invariant: explicit randomness, docs/design.md), so every worker picks the same ones,
the receiver regenerates
them, and packets of different workers can be summed (``summable``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros

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
from gradpress.core.rng import Context, mix32_torch, seed32
from gradpress.kernels import simd as V
from gradpress.kernels.jit import (
    as_numpy,
    bits_of_f32,
    compress_at_least16,
    finite,
    jit,
    kernel,
    mix32,
    use_numba,
    wide_vectors,
)


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
        for capacity in dict.fromkeys((room, n)):
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
        if count >= k:
            chosen, chosen_values = _chosen(kept[:count], positions[:count], k, values, where)
            if zeroed:
                _restore_unchosen(x, kept, positions, count, as_numpy(chosen))
            return chosen, chosen_values, zeroed
        if not _all_finite(kept[:count]):
            check_finite(values, named(where))
    return None


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
