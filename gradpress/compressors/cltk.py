"""ScaleCom's cyclic local top-k, CLT-k (Chen et al., *ScaleCom*, App. D and E, Figure A2), and its
low-pass filtered error-feedback memory.

At step t the leading worker is rank t mod n. It picks k indices from its own error-feedback
gradient x = m + g and broadcasts them (a preliminary exchange); every worker sends its own values of
x at those indices, and the values are summed by an all-reduce (App. E: "the selected gradients are
averaged across workers through all-reduce"). Because the index set is the same on every worker, a
worker sends k values and receives k sums whatever the number of workers n: unlike local top-k, whose
union of indices grows with n, the traffic per worker does not grow with n (the "scalable" of the
title). The leader's broadcast of its k indices adds, averaged over a cycle of n steps in which every
worker leads once, (n − 1)/n·k indices per worker and step (star-shaped broadcast, the traffic model
of :func:`gradpress.exchange.protocol.traffic`): per step a worker sends at most 2k values + k indices.

Selection (``select``):

* ``"chunk"``: chunk-wise quasi-sorting, as in Figure A2 ("select 1 index from chunk of 4":
  ``chunk_size`` 4, ``num_send`` 1): the tensor is cut into chunks of ``chunk`` consecutive values
  and the ``per_chunk`` values of largest magnitude of each chunk are kept (ties to the lower
  index; a last, shorter chunk keeps min(per_chunk, its length)). In Figure A2 the leader keeps
  index 0 of the first chunk and index 1 of the second. One pass, no global sort.
* ``"exact"``: the exact top-k of |x| with the same k, for comparison.

k = per_chunk·⌊d/chunk⌋ + min(per_chunk, d mod chunk) in both cases (compression chunk/per_chunk;
App. E's 92×–400× rates correspond to e.g. ``chunk=100``), fixed by d, so every rank's broadcast
buffer and packet have the same shape.

Memory (``lowpass``, the default feedback): m ← (1 − β)·m + β·(x − CLT_k(x)), x = m + g (App. D,
Lemma 3's sequence; Table A1: β the "discounting factor of low-pass filter"). β = 1 is plain error
feedback; App. E uses β = 0.1 for large batches, raised to 1 late in training. E.1's "without applying
low-pass filtering (β = 0)" contradicts the formula (β = 0 would freeze the memory at zero, i.e. no
error feedback at all); we follow the formula, where no filtering is β = 1.

Warm-up (App. E: the first epochs uncompressed; "the first convolution layer is not compressed"): use
the runtime's options ``warmup_steps`` and ``exclude`` — during warm-up the memory is neither read nor
written, and the leader rotation follows each tensor's own step counter.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from gradpress.compressors.sparsify import scatter, topk_indices
from gradpress.core.compressor import Compressor, Preliminary, register
from gradpress.core.feedback import KeyedMemory, feedback_registry
from gradpress.core.packet import Packet
from gradpress.core.registry import check_params_of, param
from gradpress.core.rng import Context
from gradpress.kernels.jit import as_numpy, jit, use_numba, wide_vectors

Select = Literal["chunk", "exact"]


@register("cltk")
@dataclass(repr=False)
class CLTK(Compressor):
    """ScaleCom's cyclic local top-k (App. D, E; Figure A2): the leader t mod n picks k indices of its
    error-feedback gradient by chunk-wise quasi-sorting (or exact top-k) and broadcasts them; every
    worker sends its values there; summed by all-reduce. k = per_chunk per chunk of ``chunk`` values.

    Wire: the k values in the input dtype (``Packet.nbytes``). The leader's k int32 indices travel in
    the preliminary broadcast, counted by the runtime's traffic statistics, not in the packet.
    """

    chunk: int = param(4, "[1, 2^20]")  # the torch path pads to whole chunks: bounded, not absurd
    per_chunk: int = param(1, "[1, 2^20]")  # and at most chunk
    select: Select = "chunk"
    summable = True
    examples = ("cltk:chunk=16,per_chunk=3", "cltk:chunk=10,select=exact", "cltk:chunk=1")

    def __post_init__(self) -> None:
        super().__post_init__()  # checks the declared ranges
        if self.per_chunk > self.chunk:
            raise ValueError(f"cltk: per_chunk ({self.per_chunk}) cannot exceed chunk ({self.chunk})")

    @property
    def default_feedback(self) -> str:
        """ScaleCom's low-pass filtered memory; β = 1 (its default) is plain error feedback."""
        return "lowpass"

    def kept_count(self, numel: int) -> int:
        """k = per_chunk·⌊d/chunk⌋ + min(per_chunk, d mod chunk)."""
        return chunk_kept(numel, self.chunk, self.per_chunk)

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return self.kept_count(numel) * dtype.itemsize

    def indices(self, flat: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """The k selected positions of a 1-D tensor (ascending; int64 or ``dtype``)."""
        if self.select == "exact":
            return topk_indices(flat, self.kept_count(flat.numel())).to(dtype)
        return chunk_top(flat, self.chunk, self.per_chunk, dtype)

    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary:
        """The leader t mod n broadcasts its indices (ScaleCom App. E); the others pass a buffer of the
        same shape (int32, or int64 past 2^31 values), which they need not fill."""
        leader = ctx.step % world_size
        numel = x.numel()
        dtype = torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64
        if world_size == 1 or ctx.rank == leader:
            mine = self.indices(x.reshape(-1), dtype)
        else:
            mine = torch.zeros(self.kept_count(numel), dtype=dtype, device=x.device)
        return Preliminary(mine, "broadcast", src=leader)

    def _compress(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor | None = None) -> Packet:
        """This worker's values at the leader's indices (its own error-feedback gradient, Figure A2)."""
        k = self.kept_count(flat.numel())
        if prepared is None:
            raise ValueError(f"{self.spec}: expected {k} integer indices from the leader, got none")
        if prepared.dim() != 1 or prepared.numel() != k or prepared.is_floating_point():
            raise ValueError(f"{self.spec}: expected {k} integer indices from the leader, got "
                             f"{prepared.dtype} {tuple(prepared.shape)}")
        if use_numba(flat) and prepared.device.type == "cpu" and prepared.is_contiguous():
            bits = np.uint32 if flat.element_size() == 4 else np.uint16
            values = torch.empty(k, dtype=flat.dtype)
            if _gather(as_numpy(flat).view(bits), as_numpy(prepared), as_numpy(values).view(bits)):
                return Packet({"values": values}, flat.shape, flat.dtype, {"indices": prepared})
        return Packet({"values": flat[prepared.long()]}, flat.shape, flat.dtype, {"indices": prepared})

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return scatter(packet["values"], packet.meta["indices"], packet.numel)


def chunk_kept(numel: int, chunk: int, per_chunk: int) -> int:
    """How many values chunk-wise selection keeps: per_chunk of every chunk, fewer of a short last one."""
    full, tail = divmod(numel, chunk)
    return full * per_chunk + min(per_chunk, tail)


def chunk_top(flat: torch.Tensor, chunk: int, per_chunk: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Chunk-wise quasi-sorting: from every ``chunk`` consecutive values the ``per_chunk`` of largest
    magnitude (ties to the lower index); positions ascending, int64 (or ``dtype``). A last, shorter
    chunk keeps min(per_chunk, its length). One numba pass on the CPU (one vectorized comparison of the
    four magnitudes per chunk for the default chunk of 4 with one kept; an integer max of keys
    |x|·2^20 + (chunk − 1 − j) per chunk for other sizes keeping one); torch elsewhere (the same
    positions)."""
    numel = flat.numel()
    if per_chunk >= chunk:
        return torch.arange(numel, device=flat.device, dtype=dtype)
    k = chunk_kept(numel, chunk, per_chunk)
    if use_numba(flat):
        out = torch.empty(k, dtype=dtype)
        values = flat if flat.dtype == torch.float32 else flat.float()
        if per_chunk > 1:
            _chunk_top_numba(as_numpy(values), chunk, per_chunk, as_numpy(out))
        elif chunk == 4:
            _chunk_argmax4(as_numpy(values).view(np.uint32), as_numpy(out))
        else:
            _chunk_argmax(as_numpy(values).view(np.uint32), chunk, as_numpy(out))
        return out
    chunks = -(-numel // chunk)
    magnitudes = flat.abs()
    if chunks * chunk != numel:  # pad with −1, below every magnitude, so padding is never kept
        magnitudes = torch.nn.functional.pad(magnitudes, (0, chunks * chunk - numel), value=-1.0)
    rows = magnitudes.view(chunks, chunk)
    if per_chunk == 1:
        within = rows.argmax(dim=1, keepdim=True)  # the first of equal maxima
    else:
        within = rows.sort(dim=1, descending=True, stable=True).indices[:, :per_chunk].sort(dim=1).values
    positions = within + torch.arange(0, chunks * chunk, chunk, device=flat.device).unsqueeze(1)
    return positions.reshape(-1)[:k].to(dtype)


_MAGNITUDE = np.uint32(0x7FFFFFFF)


@jit
def _chunk_argmax4(bits, out):  # pragma: no cover - compiled
    """Per chunk of 4 the position of the largest magnitude, the first of equal ones (magnitudes compared
    as bit patterns, which order like the values): a tournament of selects, vectorized over chunks."""
    wide_vectors()
    n = bits.size
    u = np.uint64
    for c in range(n // 4):
        b = u(4 * c)
        m0, m1 = bits[b] & _MAGNITUDE, bits[b + u(1)] & _MAGNITUDE
        m2, m3 = bits[b + u(2)] & _MAGNITUDE, bits[b + u(3)] & _MAGNITUDE
        low = np.int64(1) if m1 > m0 else np.int64(0)
        high = np.int64(3) if m3 > m2 else np.int64(2)
        out[u(c)] = 4 * c + (high if max(m2, m3) > max(m0, m1) else low)
    if n % 4:
        _argmax_tail(bits, n - n % 4, n, out)


@jit
def _chunk_argmax(bits, chunk, out):  # pragma: no cover - compiled
    """Per chunk the position of the largest magnitude, the first of equal ones: the largest key
    |x|·2^20 + (chunk − 1 − j) (integer max, vectorized within the chunk; chunk ≤ 2^20)."""
    wide_vectors()
    n = bits.size
    u = np.uint64
    for c in range(n // chunk):
        start = c * chunk
        best = u(0)
        for j in range(chunk):
            best = max(best, (u(bits[u(start + j)] & _MAGNITUDE) << u(20)) | u(chunk - 1 - j))
        out[u(c)] = start + chunk - 1 - np.int64(best & u(0xFFFFF))
    if n % chunk:
        _argmax_tail(bits, n - n % chunk, n, out)


@jit
def _argmax_tail(bits, start, stop, out):  # pragma: no cover - compiled
    best = start
    for i in range(start + 1, stop):
        if bits[i] & _MAGNITUDE > bits[best] & _MAGNITUDE:
            best = i
    out[out.size - 1] = best


@jit
def _gather(x, indices, out):  # pragma: no cover - compiled
    """out[j] = x[indices[j]] (raw bits); False, and out unfinished, if an index is out of range (each is
    clamped before its load, so none reads beyond x)."""
    n = np.uint64(x.size)
    last = n - np.uint64(1)
    bad = False
    for j in range(indices.size):
        i = np.uint64(indices[np.uint64(j)])  # a negative index wraps beyond every valid one
        bad |= i > last
        out[np.uint64(j)] = x[min(i, last)]
    return not bad


@jit
def _chunk_top_numba(x, chunk, per_chunk, out):  # pragma: no cover - compiled
    """Per chunk, keep a list of the largest magnitudes seen (descending; an equal one goes after, so
    the lower index wins), then write its positions in ascending order. No allocation per chunk."""
    best = np.empty(per_chunk, np.float32)
    where = np.empty(per_chunk, np.int64)
    filled = 0
    for start in range(0, x.size, chunk):
        kept = 0
        for i in range(start, min(start + chunk, x.size)):
            m = abs(x[i])
            if kept == per_chunk and not m > best[kept - 1]:
                continue
            j = min(kept, per_chunk - 1)  # the slot it enters from (the last one is dropped when full)
            while j > 0 and m > best[j - 1]:
                best[j] = best[j - 1]
                where[j] = where[j - 1]
                j -= 1
            best[j] = m
            where[j] = i
            kept = min(kept + 1, per_chunk)
        for a in range(kept):  # insertion sort of the few positions, straight into out
            position = where[a]
            b = filled + a
            while b > filled and out[b - 1] > position:
                out[b] = out[b - 1]
                b -= 1
            out[b] = position
        filled += kept


@feedback_registry.register("lowpass")
@dataclass
class LowPass(KeyedMemory):
    """ScaleCom's low-pass filtered error feedback (App. D): x = m + g is compressed, then
    m ← (1 − β)·m + β·(x − C(x)). β = 1 is plain error feedback (GRACE Eq. 5 with β = γ = 1).

    The memory is float32 whatever the gradient's dtype.
    """

    beta: float = param(1.0, "[0, 1]")

    def __post_init__(self) -> None:
        check_params_of(self)  # also when built directly, not from a spec

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """x = m + g."""
        memory = self._stored_for(key, grad)
        return grad if memory is None else memory + grad

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """m ← (1 − β)·m + β·(x − C(x))."""
        self._filter(key, compensated.float() - transmitted.float())

    def update_from(self, key: str, compensated: torch.Tensor, packet: Packet, compressor: Compressor,
                    owned: bool = False) -> None:
        self._filter(key, compressor.residual(compensated, packet, owned).view(compensated.shape))

    def _filter(self, key: str, residual: torch.Tensor) -> None:
        memory = self._memory.get(key)
        if self.beta != 1.0:
            residual.mul_(self.beta)
            if memory is not None:
                residual.add_(memory, alpha=1.0 - self.beta)
        self._memory[key] = residual
