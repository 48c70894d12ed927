"""Strategies: how the packets of the workers meet (GRACE Section 4.1, Algorithm 1 lines 7-14; the
Natural compression paper's Algorithm 1 in App. D.1; THC Algorithms 1-3). The only module that calls
``torch.distributed``.

An exchange is written once, as a *protocol*: a generator that yields rounds (:class:`Round`) of collective
requests (:class:`AllReduce`, :class:`ReduceScatter`, :class:`AllGather`, :class:`Broadcast`,
:class:`Gather`) and receives their results. A :class:`ProcessGroupExecutor` runs the rounds on a
process group; ``gradpress.simulate`` runs the very same protocols for n workers inside one process.
Every request has an exact, order-defined meaning, so a simulated run equals a real one bit for bit:
float sums over three or more ranks go through :class:`ReduceScatter`, which adds the ranks' values in
rank order (an all-to-all plus a local sum), because a ring all-reduce adds them in an order that
depends on each element's position (measured on Gloo with 3 ranks: 14 % of 10⁵ heavy-tailed fp32 sums
differ from the rank-order sum). Sums of two values, integer sums, max and min are exact in any order
and use the backend's all-reduce.

The :class:`Strategy` is chosen from the compressor's facts (DESIGN.md, "Strategy"):

* ``collective`` mode: summable → all-reduce of :meth:`Compressor.summands`, decoded once
  (:meth:`Compressor.decode_sum`); otherwise → all-gather of every worker's packet (variable sizes
  included), each decoded, combined by :meth:`Compressor.aggregate` (the mean, or e.g. a majority vote).
* ``ps`` mode: packets gathered at one rank (the parameter server), combined there, optionally
  re-compressed by a master compressor C_M (bidirectional compression, Natural paper Algorithm 1),
  and broadcast. Summable packets go up as their wire tensors where those are fixed in size and
  smaller than the summands (THC: the b-bit table indices), and the server computes each one's
  :meth:`Compressor.summands` (THC Fig. 4: it looks the table values up); otherwise as the summands
  (PowerSGD: Q, not P̂ and Q). The server adds them and sends the sums back.
* ``switch`` mode: like ``ps``, but the aggregator only adds integers (a programmable switch: THC
  Section 6, Natural paper App. C.6) and sends the sums back; workers decode.
* partial aggregation (``partial`` q < 1, ``ps`` and ``switch`` modes; THC Sections 6 and 8.4): the
  server combines the packets of ⌈q·n⌉ "first arrivals" only and every worker decodes with that count.
  A gather has no arrival order, so the arrivals are drawn per tensor from the stream shared by every
  rank for (seed, step, key), as Section 8.4's random stragglers: every rank knows the set and the
  count without a message, and ``simulate`` still equals a real run bit for bit.
* a preliminary exchange before compressing (:meth:`Compressor.prepare`): THC's largest norm (max),
  uniform THC's global min/max, ScaleCom's leader indices (broadcast), PowerSGD's P (sum).

Integer sums never wrap (DESIGN invariant 4): the strategy knows the largest summand
(:attr:`Compressor.max_summand`) and the number of workers, and sums in a dtype that holds their
product, widening the summands or raising :class:`OverflowError` (``overflow="raise"``).
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, ContextManager, Generator, Sequence

import torch

from gradpress.compressor import Compressor, NonFiniteError, Preliminary
from gradpress.packet import Packet
from gradpress.rng import Context

MODES = ("collective", "ps", "switch")
OVERFLOW = ("widen", "raise")


# -- collective requests ---------------------------------------------------------------------------
@dataclass
class AllReduce:
    """Every rank receives the element-wise ``op`` (sum, max or min) of all ranks' ``tensor``."""

    tensor: torch.Tensor
    op: str = "sum"


@dataclass
class ReduceScatter:
    """``tensor`` has shape (n, chunk); rank r receives ((x_0[r] + x_1[r]) + x_2[r]) + …, summed in rank
    order, bit-reproducible (an all-to-all, then a local sum)."""

    tensor: torch.Tensor


@dataclass
class AllGather:
    """Every rank receives the (n, *shape) stack of all ranks' ``tensor`` (equal shapes)."""

    tensor: torch.Tensor


@dataclass
class Broadcast:
    """Every rank receives rank ``src``'s ``tensor`` (the others pass a buffer of the same shape)."""

    tensor: torch.Tensor
    src: int


@dataclass
class Gather:
    """Rank ``dst`` receives the (n, *shape) stack of all ranks' ``tensor``; the others receive None."""

    tensor: torch.Tensor
    dst: int


Collective = AllReduce | ReduceScatter | AllGather | Broadcast | Gather


@dataclass
class Round:
    """Collectives issued together, in order. After a ``final`` round the protocol only computes (it
    decodes) and returns; the runtime may run that continuation asynchronously."""

    requests: list[Collective]
    final: bool = False


Protocol = Generator[Round, list, Any]


def traffic(request: Collective, rank: int, world_size: int) -> tuple[int, int]:
    """Bytes (sent, received) by ``rank`` for one collective, as the textbook algorithms move them:
    ring all-reduce 2(n−1)/n·S each way, ring reduce-scatter (n−1)/n·S, ring all-gather (n−1)·S, and
    star-shaped broadcast and gather (the parameter-server pattern: the root sends or receives
    (n−1)·S, every other rank S)."""
    n = world_size
    size = request.tensor.numel() * request.tensor.element_size()
    if n == 1:
        return 0, 0
    if isinstance(request, AllReduce):
        both = 2 * (n - 1) * size // n
        return both, both
    if isinstance(request, ReduceScatter):
        both = (n - 1) * size // n
        return both, both
    if isinstance(request, AllGather):
        return (n - 1) * size, (n - 1) * size
    if isinstance(request, Broadcast):
        return ((n - 1) * size, 0) if rank == request.src else (0, size)
    if isinstance(request, Gather):
        return (0, (n - 1) * size) if rank == request.dst else (size, 0)
    raise TypeError(f"unknown collective {request!r}")


# -- protocol building blocks -----------------------------------------------------------------------
def reduce_tensor(tensor: torch.Tensor, op: str, world_size: int, deterministic: bool, final: bool) -> Protocol:
    """The element-wise ``op`` of ``tensor`` over the workers; float sums over 3+ workers in rank order
    (reduce-scatter, then all-gather) unless ``deterministic`` is off."""
    n = world_size
    if op == "sum" and tensor.is_floating_point() and n > 2 and deterministic:
        numel = tensor.numel()
        chunk = -(-numel // n)
        flat = tensor.reshape(-1)
        if n * chunk != numel:
            flat = torch.cat([flat, flat.new_zeros(n * chunk - numel)])
        (mine,) = yield Round([ReduceScatter(flat.view(n, chunk))])
        (every,) = yield Round([AllGather(mine)], final)
        return every.reshape(-1)[:numel].view(tensor.shape)
    (reduced,) = yield Round([AllReduce(tensor, op)], final)
    return reduced


def parallel(protocols: Sequence[Protocol]) -> Protocol:
    """Run several protocols side by side: their k-th rounds are issued together (in list order), so
    the merged protocol issues the same collectives in the same order on every rank. Returns their
    results in order. A merged round is final only when every protocol still running is final."""
    if len(protocols) == 1:
        return [(yield from protocols[0])]
    results: list[Any] = [None] * len(protocols)
    current: dict[int, Round] = {}
    for i, protocol in enumerate(protocols):
        try:
            current[i] = next(protocol)
        except StopIteration as stop:
            results[i] = stop.value
    while current:
        order = sorted(current)
        merged = Round([r for i in order for r in current[i].requests], all(current[i].final for i in order))
        replies = yield merged
        position = 0
        for i in order:
            count = len(current[i].requests)
            mine, position = replies[position:position + count], position + count
            try:
                current[i] = protocols[i].send(mine)
            except StopIteration as stop:
                results[i] = stop.value
                del current[i]
    return results


def fold_sum(rows: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """((rows[0] + rows[1]) + rows[2]) + … in the rows' own dtype: the rank-order sum every strategy
    uses (bool rows add as a logical or, as torch.distributed's SUM does)."""
    total = rows[0].clone()
    for row in rows[1:]:
        total += row
    return total


def sum_dtype(dtype: torch.dtype, limit: int, overflow: str, where: str) -> torch.dtype:
    """The integer dtype in which sums up to ``limit`` in magnitude are formed (DESIGN invariant 4).

    Collective backends add uint8, int8, int32 and int64 (neither Gloo nor NCCL has int16); the
    summands keep their dtype if it is one of those and holds ``limit``. Otherwise they are widened
    to the narrowest one that does, with the same signedness; with ``overflow="raise"``, a dtype too
    narrow for ``limit`` raises instead. No dtype wider than int64 exists: beyond it, always raise.
    """
    ladder = [torch.int8, torch.int32, torch.int64] if dtype.is_signed else [torch.uint8, torch.int32, torch.int64]
    if dtype in ladder and torch.iinfo(dtype).max >= limit:
        return dtype
    if overflow == "raise" and torch.iinfo(dtype).max < limit:
        raise OverflowError(f"{where}: sums of up to {limit} do not fit {dtype}, and overflow='raise'")
    for candidate in ladder:
        if torch.iinfo(candidate).max >= limit:
            return candidate
    raise OverflowError(f"{where}: sums of up to {limit} do not fit any integer dtype (int64 at most)")


def check_partial(partial: float, mode: str) -> None:
    """``partial`` must be a number in (0, 1]; below 1 it needs a server (``ps`` or ``switch``)."""
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ValueError(f"partial (the fraction q of workers aggregated) must be a number in (0, 1], "
                         f"got {partial!r}")
    if partial < 1 and mode not in ("ps", "switch"):
        raise ValueError(f"partial aggregation (partial={partial}) needs a server that waits for the "
                         f"arrivals: mode='ps' or 'switch', not {mode!r}")


def arrival_count(partial: float, world_size: int) -> int:
    """⌈q·n⌉, at least one (q·n within 1e-9 of an integer counts as that integer: 0.7·10 is 7)."""
    return min(world_size, max(1, math.ceil(partial * world_size - 1e-9)))


_ALIGN = 8


def _offsets(nbytes: Sequence[int], element_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where :func:`pack` puts each tensor (a multiple of its element size, so that its slice views
    back as its dtype), and the buffer's size (a multiple of 8, so that buffers stack into rows)."""
    offsets, end = [], 0
    for size, element in zip(nbytes, element_sizes):
        start = -(-end // element) * element
        offsets.append(start)
        end = start + size
    return offsets, -(-end // _ALIGN) * _ALIGN


def pack(tensors: Sequence[torch.Tensor], device: torch.device, size: int | None = None) -> torch.Tensor:
    """Concatenate the bytes of ``tensors`` into one uint8 buffer, each starting at a multiple of its
    element size, zero-padded to a multiple of 8 bytes, or to ``size`` bytes if given."""
    offsets, total = _offsets([t.numel() * t.element_size() for t in tensors], [t.element_size() for t in tensors])
    buffer = torch.zeros(max(total, size or 0), dtype=torch.uint8, device=device)
    for t, offset in zip(tensors, offsets):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + raw.numel()] = raw
    return buffer


def unpack(buffer: torch.Tensor, layout: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Views of ``buffer`` as the tensors :func:`pack` put there (``layout``: dtype and shape of each)."""
    elements = [torch.empty((), dtype=dtype).element_size() for dtype, _ in layout]
    nbytes = [math.prod(shape) * e for (_, shape), e in zip(layout, elements)]
    offsets, _ = _offsets(nbytes, elements)
    return [buffer[o:o + b].view(dtype).view(shape) if b else buffer.new_empty(shape, dtype=dtype)
            for (dtype, shape), o, b in zip(layout, offsets, nbytes)]  # (an empty row's offset may be unaligned)


def packed_sizes(numels: torch.Tensor, element_sizes: Sequence[int]) -> torch.Tensor:
    """Bytes :func:`pack` needs for each row of ``numels`` (one row per rank, one column per tensor)."""
    return torch.tensor([_offsets([n * e for n, e in zip(row, element_sizes)], element_sizes)[1]
                         for row in numels.tolist()], dtype=torch.int64)


def received_layout(numels: Sequence[int], local: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Layout of another rank's wire tensors: the local dtypes, the local shapes where the sizes agree,
    1-D where a variable-size tensor differs."""
    layout = []
    for numel, mine in zip(numels, local, strict=True):
        if numel == mine.numel():
            layout.append((mine.dtype, tuple(mine.shape)))
        elif mine.dim() == 1:
            layout.append((mine.dtype, (int(numel),)))
        else:
            raise ValueError(f"a wire tensor of shape {tuple(mine.shape)} changes size between workers; "
                             "variable-size wire tensors must be 1-D")
    return layout


def adjacent(tensors: Sequence[torch.Tensor], writable: set[int]) -> torch.Tensor | None:
    """One flat view of ``tensors`` when they lie back to back, in order and of one dtype, in one
    storage the caller allows to overwrite (``writable``: storage pointers); None otherwise."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    if storage.data_ptr() not in writable:
        return None
    if len(tensors) == 1:
        return first.detach().view(-1) if first.is_contiguous() else None
    position = first.data_ptr()
    for t in tensors:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.data_ptr() != position
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        position += t.numel() * t.element_size()
    total = sum(t.numel() for t in tensors)
    return first.new_empty(0).set_(storage, first.storage_offset(), (total,))


def concat(tensors: Sequence[torch.Tensor], writable: set[int]) -> torch.Tensor:
    """One flat tensor holding ``tensors`` in order: a view where :func:`adjacent` finds one (a DDP
    bucket's uncompressed gradients are all-reduced in place, as DDP itself does), else a copy."""
    view = adjacent(tensors, writable)
    return view if view is not None else torch.cat([t.reshape(-1) for t in tensors])


def _split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1)


# -- fault flags, carried in-band ------------------------------------------------------------------
# A rank whose gradient holds NaN/Inf still takes part in the exchange (with a packet compressed from
# zeros) and sets its flag; every exchange carries every rank's flag in buffers it sends anyway, so all
# ranks learn the same set of faulty ranks at the same point of the protocol and raise the same
# NonFiniteError together, instead of the faulty rank raising alone while its peers wait out the
# timeout (DESIGN invariant 5). The carriers:
#
# * a float sum: the faulty rank r writes NaN at position r of the first float summand buffer holding
#   at least n values (no extra bytes; finite gradients never sum to NaN, overflow gives ±Inf);
# * any other sum, max or min: n flag slots appended to a buffer (slot r: rank r's flag);
# * an all-gather or gather of packed bytes: each rank's flag as a trailer of its buffer, or in the
#   sizes header when the layout is variable; a server forwards the flags it gathered in its broadcast.
def flag_slots(faulty: bool, rank: int, world_size: int, op: str, like: torch.Tensor) -> torch.Tensor:
    """``world_size`` slots in ``like``'s dtype that, combined by ``op`` over the ranks, are away from
    the neutral value exactly at the faulty ranks (sum and max: 1 at the own slot; min: 0 there)."""
    neutral, mark = (1, 0) if op == "min" else (0, 1)
    slots = torch.full((world_size,), neutral, dtype=like.dtype, device=like.device)
    if faulty:
        slots[rank] = mark
    return slots


def flagged_ranks(slots: torch.Tensor, op: str = "sum") -> list[int]:
    """The ranks whose combined :func:`flag_slots` are marked."""
    marked = slots == 0 if op == "min" else slots != 0
    return [int(r) for r in marked.nonzero().view(-1).tolist()]


def raise_flagged(ranks: Sequence[int]) -> None:
    """Raise the one error every rank raises when some rank's gradient held NaN/Inf."""
    if ranks:
        which = ", ".join(str(r) for r in ranks)
        error = NonFiniteError(f"NaN/Inf in the gradient of rank{'s' if len(ranks) > 1 else ''} {which}")
        error.ranks = list(ranks)
        raise error


# -- strategies -----------------------------------------------------------------------------------
Timer = Callable[[], ContextManager]


@dataclass
class Strategy:
    """How this worker's packets meet the others' (see the module docstring). Pure: it yields collective
    requests and never touches a process group itself."""

    compressor: Compressor
    rank: int
    world_size: int
    mode: str = "collective"
    root: int = 0
    master: Compressor | None = None
    overflow: str = "widen"
    deterministic: bool = True
    partial: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        check_partial(self.partial, self.mode)
        if self.overflow not in OVERFLOW:
            raise ValueError(f"overflow must be 'widen' or 'raise', got {self.overflow!r}")
        if not 0 <= self.root < self.world_size:
            raise ValueError(f"root {self.root} is not a rank of a world of {self.world_size}")
        if self.compressor.exchange not in ("allreduce", "allgather"):
            raise ValueError(f"{self.compressor.spec}: unknown exchange {self.compressor.exchange!r}")
        if self.compressor.exchange == "allreduce" and not self.compressor.summable:
            raise ValueError(f"{self.compressor.spec}: exchange 'allreduce' needs a summable compressor")
        if self.master is not None and self.mode == "collective":
            raise ValueError("a master compressor (bidirectional compression) needs mode='ps'")
        if self.mode == "switch":
            if not self.compressor.summable:
                raise ValueError(f"switch mode adds integers only; {self.compressor.spec} is not summable")
            if self.master is not None:
                raise ValueError("switch mode cannot re-compress at the switch: drop master, or use mode='ps'")

    @property
    def pattern(self) -> str:
        """The traffic pattern in words (for stats and reports)."""
        if self.mode == "collective":
            return self.compressor.exchange
        return self.mode + ("+master" if self.master is not None else "")

    def arrivals(self, ctx: Context) -> list[int]:
        """The ranks whose packets the server combines for the tensor of ``ctx``, in rank order: every
        rank, or with ``partial`` q < 1 the ⌈q·n⌉ "first arrivals" (THC Sections 6 and 8.4), drawn
        from the stream shared by every rank for (seed, step, key) (see the module docstring)."""
        n = self.world_size
        count = arrival_count(self.partial, n)
        if count == n:
            return list(range(n))
        order = torch.randperm(n, generator=ctx.shared_generator("cpu", "partial"))
        return sorted(order[:count].tolist())

    # -- preliminary exchange ---------------------------------------------------------------------
    def preliminary(self, prelims: Sequence[Preliminary | None], faulty: bool = False) -> Protocol:
        """Combine every item's :class:`Preliminary` over the workers; values of the same op, source and
        dtype travel in one collective. Returns each item's combined values (None where none), and
        whether the fault flags travelled with them.

        ``faulty``: this rank's gradient held NaN/Inf (its values come from zeros). The flags travel
        as slots of the first sum, max or min; when some rank is flagged, every rank raises
        :class:`NonFiniteError` here. A preliminary of broadcasts alone cannot carry them: the main
        exchange does."""
        groups: dict[tuple, list[int]] = {}
        for i, pre in enumerate(prelims):
            if pre is not None:
                src = pre.src if pre.op == "broadcast" else -1
                if pre.op == "broadcast" and not 0 <= src < self.world_size:
                    raise ValueError(f"preliminary broadcast from rank {src} in a world of {self.world_size}")
                groups.setdefault((pre.op, src, pre.values.dtype, pre.values.device), []).append(i)
        protocols, carrier = [], None
        for g, ((op, src, _, _), members) in enumerate(groups.items()):
            parts = [_flat(prelims[i].values) for i in members]  # type: ignore[union-attr]
            if op == "broadcast":
                protocols.append(_single(Broadcast(torch.cat(parts), src), final=False))
                continue
            if carrier is None:
                carrier = g
                parts.append(flag_slots(faulty, self.rank, self.world_size, op, parts[0]))
            protocols.append(reduce_tensor(torch.cat(parts), op, self.world_size, self.deterministic, final=False))
        combined = yield from parallel(protocols)
        if carrier is not None:
            flags = combined[carrier][-self.world_size:]
            raise_flagged(flagged_ranks(flags, list(groups)[carrier][0]))
            combined[carrier] = combined[carrier][:-self.world_size]
        out: list[torch.Tensor | None] = [None] * len(prelims)
        for members, flat in zip(groups.values(), combined):
            for i, values in zip(members, _split(flat, [prelims[i].values for i in members])):  # type: ignore[union-attr]
                out[i] = values
        return out, carrier is not None

    # -- main exchange ------------------------------------------------------------------------------
    def exchange(self, packets: Sequence[Packet], ctxs: Sequence[Context],
                 outputs: Sequence[torch.Tensor] | None = None, timer: Timer = nullcontext,
                 faulty: bool | None = False) -> Protocol:
        """The averaged tensor of every item (its packet's shape and dtype), the same bits on every rank.

        ``outputs``: the caller's gradients, which the exchange may overwrite (a DDP bucket's): the
        collectives work in their storage where they can, and averages are written into them where a
        method can (see :meth:`Compressor.aggregate`); None leaves every input alone. ``timer``: a
        context manager factory timing the decoding. ``faulty``: this rank's gradients held NaN/Inf
        (its packets are of zeros); the flag travels in-band (see "fault flags" above) and every rank
        raises :class:`NonFiniteError` naming the faulty ranks instead of decoding. None: no flag
        travels, as the preliminary exchange carried them already.
        """
        writable = {o.untyped_storage().data_ptr() for o in outputs} if outputs is not None else set()
        if all(p.numel == 0 for p in packets):
            return [self.compressor.decompress(p) for p in packets]
        if self.mode == "collective":
            if self.compressor.exchange == "allreduce":
                return (yield from self._allreduce(packets, writable, timer, faulty))
            return (yield from self._allgather(packets, outputs, timer, faulty))
        if self.compressor.summable:
            return (yield from self._server_sum(packets, ctxs, timer, faulty))
        return (yield from self._server_gather(packets, ctxs, timer, faulty))

    def _summands(self, packet: Packet) -> list[torch.Tensor]:
        """The packet's summands, integers widened so that n of them add without wrapping."""
        summands = self.compressor.summands(packet)
        out = []
        for t in summands:
            if self.mode == "switch" and (t.is_floating_point() or t.is_complex()):
                raise ValueError(f"switch mode adds integers only; {self.compressor.spec} sends {t.dtype} summands")
            if t.is_floating_point() or t.dtype == torch.bool:
                out.append(t)
                continue
            bound = self.compressor.max_summand
            if bound is None:
                raise ValueError(f"{self.compressor.spec}: integer summands need max_summand, the largest "
                                 "magnitude one worker sends, so that sums cannot wrap")
            dtype = sum_dtype(t.dtype, bound * self.world_size, self.overflow, self.compressor.spec)
            out.append(t if dtype == t.dtype else t.to(dtype))
        return out

    @staticmethod
    def _by_dtype(summands: Sequence[Sequence[torch.Tensor]]) -> list[list[tuple[int, int]]]:
        """(item, position) of every summand, grouped by dtype and device: one collective per group."""
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for i, tensors in enumerate(summands):
            for j, t in enumerate(tensors):
                groups.setdefault((t.dtype, t.device), []).append((i, j))
        return list(groups.values())

    @staticmethod
    def _unflatten(sums, members, summands) -> list[list[torch.Tensor]]:
        if len(summands) == 1 and len(summands[0]) == 1:  # one tensor (a bucket exchanged as one)
            return [[sums[0].view(summands[0][0].shape)]]
        per_item: list[list[torch.Tensor]] = [[None] * len(s) for s in summands]  # type: ignore[list-item]
        for flat, group in zip(sums, members):
            for (i, j), part in zip(group, _split(flat, [summands[i][j] for i, j in group])):
                per_item[i][j] = part
        return per_item

    def _allreduce(self, packets, writable, timer, faulty) -> Protocol:
        """GRACE Algorithm 1 lines 7-9: g = Q⁻¹(Allreduce(g̃)) / n."""
        summands = [self._summands(p) for p in packets]
        members = self._by_dtype(summands)
        flats = [concat([summands[i][j] for i, j in group], writable) for group in members]
        n = self.world_size
        carrier = next((g for g, f in enumerate(flats) if f.is_floating_point() and f.numel() >= n), None)
        if faulty is None:
            pass
        elif carrier is None:  # flag slots after the first buffer's values
            flats[0] = torch.cat([flats[0], flag_slots(faulty, self.rank, n, "sum", flats[0])])
        elif faulty:  # a NaN at position r marks rank r
            flats[carrier][self.rank] = math.nan
        sums = yield from parallel([reduce_tensor(f, "sum", n, self.deterministic, final=True) for f in flats])
        if faulty is None:
            pass
        elif carrier is None:
            raise_flagged(flagged_ranks(sums[0][-n:]))
            sums[0] = sums[0][:-n]
        else:
            raise_flagged(flagged_ranks(sums[carrier][:n].isnan()))
        per_item = self._unflatten(sums, members, summands)
        with timer():
            return [self.compressor.decode_sum(p, s, self.world_size) for p, s in zip(packets, per_item)]

    def _allgather(self, packets, outputs, timer, faulty) -> Protocol:
        """GRACE Algorithm 1 lines 10-13: every packet to every worker, decoded, then Agg (mean or rule).
        The received packets are copies (the gathered buffer), so an average may go into ``outputs``."""
        rows, flagged = yield from self._collect(*self._wire(packets), _device(packets), AllGather, True, faulty)
        raise_flagged(flagged)
        outs = outputs if outputs is not None else [None] * len(packets)
        with timer():
            return [self.compressor.aggregate(item, out=out) for item, out in zip(self._per_item(packets, rows), outs)]

    def _wire(self, packets: Sequence[Packet]) -> tuple[list[torch.Tensor], bool]:
        """This rank's wire tensors in order, and whether their layout is fixed (the compressor's
        ``expected_nbytes`` is not None for every packet: the same sizes on every rank)."""
        c = self.compressor
        return ([t for p in packets for t in p.wire()],
                all(c.expected_nbytes(p.numel, p.dtype) is not None for p in packets))

    def _collect(self, local: list[torch.Tensor], fixed: bool, device: torch.device, request: type,
                 final: bool, faulty: bool | None) -> Protocol:
        """All-gather (or gather at the root) every worker's ``local`` tensors as one byte buffer per
        worker, each rank's fault flag with them. A ``fixed`` layout goes in one round, the flag as a
        trailer of the buffer; otherwise the workers first exchange their tensors' sizes, and the flags
        in that header (``faulty`` None: no flag). Returns each rank's unpacked tensors (None where
        nothing is received), and the flagged ranks (None where they are not known: a gather's non-root
        ranks)."""
        gather = (lambda t: Gather(t, self.root)) if request is Gather else AllGather
        if faulty is None:
            rows = yield from self._collect_plain(local, fixed, device, gather, final)
            return rows, []
        flag = torch.tensor([int(faulty)], dtype=torch.uint8, device=device)
        if fixed:
            (stack,) = yield Round([gather(pack([*local, flag], device))], final)
            layouts = [[(t.dtype, tuple(t.shape)) for t in [*local, flag]]] * self.world_size
            if stack is None:
                return None, None
            rows = [unpack(stack[j], layouts[j]) for j in range(self.world_size)]
            return [row[:-1] for row in rows], flagged_ranks(torch.cat([row[-1] for row in rows]))
        header = torch.tensor([t.numel() for t in local] + [int(faulty)], dtype=torch.int64, device=device)
        (headers,) = yield Round([AllGather(header)])
        flagged = flagged_ranks(headers[:, -1])
        raise_flagged(flagged)  # every rank knows: no need to send the data
        headers = headers[:, :-1]
        sizes = packed_sizes(headers, [t.element_size() for t in local])
        (stack,) = yield Round([gather(pack(local, device, int(sizes.max())))], final)
        if stack is None:
            return None, flagged
        layouts = [received_layout(row, local) for row in headers.tolist()]
        return [unpack(stack[j], layouts[j]) for j in range(self.world_size)], flagged

    def _collect_plain(self, local, fixed, device, gather, final) -> Protocol:
        """:meth:`_collect` without flags."""
        if fixed:
            (stack,) = yield Round([gather(pack(local, device))], final)
            layouts = [[(t.dtype, tuple(t.shape)) for t in local]] * self.world_size
        else:
            header = torch.tensor([t.numel() for t in local], dtype=torch.int64, device=device)
            (headers,) = yield Round([AllGather(header)])
            sizes = packed_sizes(headers, [t.element_size() for t in local])
            (stack,) = yield Round([gather(pack(local, device, int(sizes.max())))], final)
            layouts = [received_layout(row, local) for row in headers.tolist()] if stack is not None else []
        if stack is None:
            return None
        return [unpack(stack[j], layouts[j]) for j in range(self.world_size)]

    def _server_sum(self, packets, ctxs, timer, faulty) -> Protocol:
        """Parameter server / switch for summable packets: the workers upload to the root, which adds
        the arrivals' summands in rank order (integers only in switch mode) and broadcasts the sums, or
        C_M of the mean (and the sums too for a method whose decoding keeps state, e.g. PowerSGD's warm
        start, so that every rank's stays alike); every rank decodes with the count of arrivals.

        The upload is the packets themselves where their size is fixed and smaller than the summands
        (THC Fig. 4: b-bit table indices, which the server looks up); otherwise the summands (PowerSGD:
        Q alone, not P̂ and Q). Every rank computes its own summands first: their dtypes and shapes,
        widened as the overflow guard says, are the downstream layout and decide the upload, and a sum
        that cannot be formed raises on every rank before any collective."""
        own = [self._summands(p) for p in packets]
        wire = self._uploads_packets(packets, own)
        local, fixed = self._wire(packets) if wire else ([t for mine in own for t in mine], True)
        rows, flagged = yield from self._collect(local, fixed, _device(packets), Gather, False, faulty)
        arrivals = [self.arrivals(ctx) for ctx in ctxs]
        totals = None
        if rows is not None:
            counts = [sum(1 for _ in p.wire()) if wire else len(mine) for p, mine in zip(packets, own)]
            with timer():
                totals = [self._add(p, mine, parts, arrived, wire) for p, mine, parts, arrived
                          in zip(packets, own, self._by_item(rows, counts), arrivals)]
        if self.master is not None:
            if self.compressor.stateful_decode:  # every rank decodes the sums, to keep its state alike
                per_item = yield from self._broadcast_sums(totals, own, False, flagged, faulty is not None)
                with timer():
                    decoded = [self.compressor.decode_sum(p, s, len(a))
                               for p, s, a in zip(packets, per_item, arrivals)]
                means = decoded if totals is not None else None
            else:
                means = None
                if totals is not None:
                    with timer():
                        means = [self.compressor.decode_sum(p, s, len(a))
                                 for p, s, a in zip(packets, totals, arrivals)]
            return (yield from self._master_broadcast(means, packets, ctxs, timer, flagged, faulty is not None))
        per_item = yield from self._broadcast_sums(totals, own, True, flagged, faulty is not None)
        with timer():
            return [self.compressor.decode_sum(p, s, len(a)) for p, s, a in zip(packets, per_item, arrivals)]

    def _broadcast_sums(self, totals: list[list[torch.Tensor]] | None, own: list[list[torch.Tensor]],
                        final: bool, flagged: list[int] | None, carry: bool) -> Protocol:
        """The server's sums (``totals``, None on other ranks) broadcast to every rank, one collective
        per dtype, with the ranks it found flagged (``flagged``); each item's sums, shaped as its
        summands ``own``."""
        members, flats = self._by_dtype(own), []
        for group in members:
            if totals is not None:
                flats.append(torch.cat([_flat(totals[i][j]) for i, j in group]))
            else:  # a buffer for the root's sums
                (i, j), size = group[0], sum(own[i][j].numel() for i, j in group)
                flats.append(own[i][j].new_empty(size))
        if carry:
            flats[0] = self._forward_flags(flats[0], flagged)
        sums = yield Round([Broadcast(f, self.root) for f in flats], final=final)
        if carry:
            sums[0] = self._received_flags(sums[0])
        return self._unflatten(sums, members, own)

    def _forward_flags(self, buffer: torch.Tensor, flagged: list[int] | None) -> torch.Tensor:
        """``buffer`` with n flag slots appended: the root's ``flagged`` ranks marked, or room for them."""
        n = self.world_size
        if flagged is None:
            return torch.cat([buffer, buffer.new_empty(n)])
        slots = buffer.new_zeros(n)
        slots[flagged] = 1
        return torch.cat([buffer, slots])

    def _received_flags(self, buffer: torch.Tensor) -> torch.Tensor:
        """Raise if the root forwarded flagged ranks in ``buffer``'s slots; the buffer without them."""
        raise_flagged(flagged_ranks(buffer[-self.world_size:]))
        return buffer[:-self.world_size]

    def _uploads_packets(self, packets: Sequence[Packet], own: Sequence[Sequence[torch.Tensor]]) -> bool:
        """Whether workers send the server their packets rather than their summands: when every
        packet's size is fixed and they are smaller in all. Decided from sizes, dtypes and the world
        size only, so every rank decides alike."""
        c = self.compressor
        sizes = [c.expected_nbytes(p.numel, p.dtype) for p in packets]
        if any(size is None for size in sizes):
            return False
        return sum(sizes) < sum(t.numel() * t.element_size() for mine in own for t in mine)

    def _add(self, packet: Packet, mine: list[torch.Tensor], parts: list[list[torch.Tensor]],
             arrived: Sequence[int], wire: bool) -> list[torch.Tensor]:
        """One item's rank-order sums of the arrivals' summands. ``parts[j]``: what rank j uploaded (its
        wire tensors, whose summands the server computes, or its summands); ``mine``: this rank's own."""
        columns = []
        for j in arrived:
            if j == self.rank:
                columns.append(mine)
            else:
                columns.append(self._summands(packet.with_wire(parts[j])) if wire else parts[j])
        return [fold_sum([column[k] for column in columns]) for k in range(len(mine))]

    def _server_gather(self, packets, ctxs, timer, faulty) -> Protocol:
        """Parameter server for other packets: gather them at the root, decode and aggregate the
        arrivals' there, send back the dense mean or its C_M packet (Natural paper Algorithm 1, master
        side)."""
        rows, flagged = yield from self._collect(*self._wire(packets), _device(packets), Gather, False, faulty)
        means = None
        if rows is not None:
            arrivals = [self.arrivals(ctx) for ctx in ctxs]
            with timer():
                means = [self.compressor.aggregate([item[j] for j in arrived])
                         for item, arrived in zip(self._per_item(packets, rows), arrivals)]
        if self.master is not None:
            return (yield from self._master_broadcast(means, packets, ctxs, timer, flagged, faulty is not None))
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(packets):
            groups.setdefault((p.dtype, p.device), []).append(i)
        buffers = []
        for (dtype, device), items in groups.items():
            if means is not None:
                buffers.append(torch.cat([_flat(means[i]) for i in items]))
            else:
                buffers.append(torch.empty(sum(packets[i].numel for i in items), dtype=dtype, device=device))
        carry = faulty is not None
        if carry:
            buffers[0] = self._forward_flags(buffers[0], flagged)
        received = yield Round([Broadcast(b, self.root) for b in buffers], final=True)
        if carry:
            received[0] = self._received_flags(received[0])
        out: list[torch.Tensor] = [None] * len(packets)  # type: ignore[list-item]
        for items, flat in zip(groups.values(), received):
            offset = 0
            for i in items:
                out[i] = flat[offset:offset + packets[i].numel].view(packets[i].shape)
                offset += packets[i].numel
        return out

    def _master_broadcast(self, means, packets, ctxs, timer, flagged, carry) -> Protocol:
        """The root compresses each mean with C_M and broadcasts the packets; every rank (the root too)
        decodes the broadcast bytes, so all end with the same bits. Non-roots learn the packets'
        structure from C_M applied to zeros with the same context (structure and metadata depend on the
        context and the size, never on the values), their sizes from a header, which also carries the
        flagged ranks."""
        master = self.master
        assert master is not None
        device = _device(packets)
        contexts = [ctx.with_key(ctx.key + "/master") for ctx in ctxs]
        sources = means if means is not None else [torch.zeros(p.shape, dtype=p.dtype, device=device) for p in packets]
        mpackets = [master.compress(x, ctx) for x, ctx in zip(sources, contexts)]
        local = [t for p in mpackets for t in p.wire()]
        header = torch.tensor([t.numel() for t in local], dtype=torch.int64, device=device)
        (header,) = yield Round([Broadcast(self._forward_flags(header, flagged) if carry else header, self.root)])
        header = self._received_flags(header) if carry else header
        numels = header.tolist()
        layout = received_layout(numels, local)
        size = int(packed_sizes(header.view(1, -1), [t.element_size() for t in local])[0])
        buffer = pack(local, device, size) if means is not None else torch.empty(size, dtype=torch.uint8, device=device)
        (buffer,) = yield Round([Broadcast(buffer, self.root)], final=True)
        wire = iter(unpack(buffer, layout))
        with timer():
            out = []
            for mp, p in zip(mpackets, packets):
                received = mp.with_wire([next(wire) for _ in mp.wire()])
                out.append(master.decompress(received).to(p.dtype).view(p.shape))
            return out

    def _per_item(self, packets: Sequence[Packet], rows: list[list[torch.Tensor]]) -> list[list[Packet]]:
        """For each item, its packet from every rank in rank order (this rank's own packet as it is)."""
        counts = [sum(1 for _ in p.wire()) for p in packets]
        return [[packet if j == self.rank else packet.with_wire(part) for j, part in enumerate(parts)]
                for packet, parts in zip(packets, self._by_item(rows, counts))]

    @staticmethod
    def _by_item(rows: list[list[torch.Tensor]], counts: Sequence[int]) -> list[list[list[torch.Tensor]]]:
        """Each rank's received tensors (``rows[j]``, items in order, ``counts[i]`` tensors each) split
        by item: ``[item][rank]`` -> that item's tensors from that rank."""
        out, start = [], 0
        for count in counts:
            out.append([row[start:start + count] for row in rows])
            start += count
        return out


def _single(request: Collective, final: bool) -> Protocol:
    (result,) = yield Round([request], final)
    return result


def _device(packets: Sequence[Packet]) -> torch.device:
    for p in packets:
        for t in p.wire():
            return t.device
    return torch.device("cpu")


# -- running protocols on a process group -----------------------------------------------------------
class Handle:
    """The collectives of one round, in flight."""

    def __init__(self, works: list, results: Callable[[], list], done: Callable[[float], None]) -> None:
        self._works, self._results, self._done = works, results, done
        self._started = time.perf_counter()

    def wait(self) -> list:
        """Block until the round completes; its results (raises if a collective failed or timed out)."""
        for work in self._works:
            work.wait()
        return self._finish()

    def future(self, then: Callable[[list], Any], failed: Callable[[BaseException], None] | None = None
               ) -> torch.futures.Future:
        """A future of ``then(the round's results)``, run by the backend thread that completes the
        round, in the same callback (one hold of the GIL). A failed collective (an error, a timeout)
        is handed to ``failed`` first, then reaches the future."""
        if not self._works:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(then(self._finish()))
            return future

        def finish(every: torch.futures.Future) -> Any:
            try:
                for sub in every.value() if len(self._works) > 1 else [every]:
                    sub.value()  # re-raises the error of a failed collective
            except BaseException as error:
                if failed is not None:
                    failed(error)
                raise
            return then(self._finish())

        if len(self._works) == 1:
            return self._works[0].get_future().then(finish)
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(finish)

    def _finish(self) -> list:
        results = self._results()
        self._done(time.perf_counter() - self._started)
        return results


class ProcessGroupExecutor:
    """Issues a protocol's rounds on a ``torch.distributed`` process group (Gloo, NCCL, …), async."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def issue(self, round_: Round, sent: Callable[[int, int], None], done: Callable[[float], None]) -> Handle:
        """Start every collective of ``round_`` in order; ``sent(bytes_sent, bytes_received)`` is called
        per collective, ``done(seconds)`` when the round completes."""
        works, builders = [], []
        for request in round_.requests:
            sent(*traffic(request, self.rank, self.world_size))
            work, build = self._start(request)
            if work is not None:
                works.append(work)
            builders.append(build)
        return Handle(works, lambda: [build() for build in builders], done)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else self._dist.get_global_rank(self.group, rank)

    def _start(self, request: Collective) -> tuple[Any, Callable[[], Any]]:
        dist, group, n = self._dist, self.group, self.world_size
        t = request.tensor
        if not t.is_contiguous():
            raise ValueError("collective requests take contiguous tensors")
        if isinstance(request, AllReduce):
            if n == 1:
                return None, lambda: t
            return dist.all_reduce(t, op=self._ops[request.op], group=group, async_op=True), lambda: t
        if isinstance(request, ReduceScatter):
            if n == 1:
                return None, lambda: t[0].clone()
            out = torch.empty_like(t)
            return dist.all_to_all_single(out, t, group=group, async_op=True), lambda: fold_sum(out)
        if isinstance(request, AllGather):
            if n == 1:
                return None, lambda: t.unsqueeze(0)
            out = torch.empty((n * t.numel(),), dtype=t.dtype, device=t.device)
            work = self._all_gather(out, t.reshape(-1), group=group, async_op=True)
            return work, lambda: out.view(n, *t.shape)
        if isinstance(request, Broadcast):
            if n == 1:
                return None, lambda: t
            return dist.broadcast(t, src=self._global(request.src), group=group, async_op=True), lambda: t
        if isinstance(request, Gather):
            if n == 1:
                return None, lambda: t.unsqueeze(0)
            mine = self.rank == request.dst
            out = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device) if mine else None
            work = dist.gather(t, list(out.unbind(0)) if mine else None, dst=self._global(request.dst),
                               group=group, async_op=True)
            return work, lambda: out
        raise TypeError(f"unknown collective {request!r}")


def rank_and_size(group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the default group) and the group's size."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (picklable), by rank, on every rank of ``group`` (collective)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def process_group(group: Any = None, timeout: float | timedelta | None = None) -> Any:
    """The process group gradpress talks on: ``group`` (default: the default group), or, with a
    ``timeout``, a new group over the same ranks whose collectives raise after ``timeout`` instead of
    waiting for the default's (30 minutes). Called by every member of ``group``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if timeout is None:
        return group
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, timeout=timeout, backend=dist.get_backend(group),
                          use_local_synchronization=True)
