"""Strategies: how the packets of the workers meet (GRACE Section 4.1, Algorithm 1 lines 7-14; the
Natural compression paper's Algorithm 1 in App. D.1; THC Algorithms 1-3), written as protocols
(:mod:`gradpress.exchange.protocol`) that never touch a process group themselves.

The :class:`Strategy` is chosen from the compressor's facts (docs/design.md, "The pieces"):

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

Integer sums never wrap (invariant: no silent integer wrap, docs/design.md): the strategy knows the largest
summand
(:attr:`Compressor.max_summand`) and the number of workers, and sums in a dtype that holds their
product, widening the summands or raising :class:`OverflowError` (``overflow="raise"``).

One module per way of meeting: :mod:`~gradpress.exchange.strategy.preliminary` (sums, maxima and the leader's
broadcast before compressing), :mod:`~gradpress.exchange.strategy.allreduce`, :mod:`~gradpress.exchange.strategy.allgather`
and :mod:`~gradpress.exchange.strategy.server` (parameter server, switch, bidirectional); the pieces they share
in :mod:`~gradpress.exchange.strategy.common`. Every exchange carries each rank's fault flag in buffers it sends
anyway (:mod:`gradpress.exchange.protocol`, "fault flags").
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch

from gradpress.core.compressor import Compressor, Preliminary
from gradpress.core.packet import Packet
from gradpress.core.rng import Context
from gradpress.exchange.protocol import Protocol
from gradpress.exchange.strategy import allgather, allreduce, server
from gradpress.exchange.strategy.preliminary import combine

MODES = ("collective", "ps", "switch")
OVERFLOW = ("widen", "raise")
Timer = Callable[[], ContextManager]


def sum_dtype(dtype: torch.dtype, limit: int, overflow: str, where: str) -> torch.dtype:
    """The integer dtype in which sums up to ``limit`` in magnitude are formed
    (invariant: no silent integer wrap, docs/design.md).

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


@dataclass
class Strategy:
    """How this worker's packets meet the others' (see the module docstring). Pure: it yields collective
    requests and never touches a process group itself; each mode's protocol lives in its own module."""

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
    def divides_first(self) -> bool:
        """Whether each worker may send its input divided by n (:attr:`Compressor.divides_first`): a sum
        over all n workers (an all-reduce, or a server without partial aggregation), which is then the
        mean."""
        return (self.compressor.divides_first and self.compressor.exchange == "allreduce"
                and self.mode != "switch" and self.partial == 1)

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

    def preliminary(self, prelims: Sequence[Preliminary | None], faulty: bool = False) -> Protocol:
        """The preliminary exchange (:func:`gradpress.exchange.strategy.preliminary.combine`): each item's
        combined values, and whether the fault flags travelled with them."""
        return combine(self, prelims, faulty)

    def exchange(self, packets: Sequence[Packet], ctxs: Sequence[Context],
                 outputs: Sequence[torch.Tensor] | None = None, timer: Timer = nullcontext,
                 faulty: bool | None = False) -> Protocol:
        """The averaged tensor of every item (its packet's shape and dtype), the same bits on every rank.

        ``outputs``: the caller's gradients, which the exchange may overwrite (a DDP bucket's): the
        collectives work in their storage where they can, and averages are written into them where a
        method can (see :meth:`Compressor.aggregate`); None leaves every input alone. ``timer``: a
        context manager factory timing the decoding. ``faulty``: this rank's gradients held NaN/Inf
        (its packets are of zeros); the flag travels in-band and every rank raises
        :class:`~gradpress.NonFiniteError` naming the faulty ranks instead of decoding. None: no flag
        travels, as the preliminary exchange carried them already.
        """
        writable = {o.untyped_storage().data_ptr() for o in outputs} if outputs is not None else set()
        if all(p.numel == 0 for p in packets):
            return [self.compressor.decompress(p) for p in packets]
        if self.mode == "collective":
            if self.compressor.exchange == "allreduce":
                return (yield from allreduce.exchange(self, packets, outputs, writable, timer, faulty))
            return (yield from allgather.exchange(self, packets, outputs, timer, faulty))
        if self.compressor.summable:
            return (yield from server.sum_at_server(self, packets, ctxs, timer, faulty))
        return (yield from server.gather_at_server(self, packets, ctxs, timer, faulty))

    def reduce_scatter(self, packets: Sequence[Packet], timer: Timer = nullcontext,
                       faulty: bool | None = False) -> Protocol:
        """The averages of this rank's row, where ``packets`` are n rows of equally many packets, row j
        the ones rank j decodes (each row's packets of the same structure): the rows' summands meet in
        one reduce-scatter and each rank decodes its own row
        (:func:`gradpress.exchange.strategy.allreduce.reduce_scatter`). Summable methods in
        ``collective`` mode only; ``faulty`` as in :meth:`exchange`."""
        if self.mode != "collective" or not self.compressor.summable:
            raise ValueError(f"a compressed reduce-scatter adds the packets' summands: it needs a summable "
                             f"method in mode 'collective', not {self.compressor.spec} in mode {self.mode!r}")
        if all(p.numel == 0 for p in packets):
            m = len(packets) // self.world_size
            return [self.compressor.decompress(p) for p in packets[self.rank * m:(self.rank + 1) * m]]
        return (yield from allreduce.reduce_scatter(self, packets, timer, faulty))

    def summands(self, packet: Packet) -> list[torch.Tensor]:
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
