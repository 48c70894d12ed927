"""Protocols: an exchange written once, as a generator of rounds of collective requests.

An exchange is a *protocol*: a generator that yields rounds (:class:`Round`) of collective requests
(:class:`AllReduce`, :class:`ReduceScatter`, :class:`AllGather`, :class:`Broadcast`, :class:`Gather`)
and receives their results. :class:`gradpress.exchange.distributed.ProcessGroupExecutor` runs the rounds on a
process group; ``gradpress.simulate`` runs the very same protocols for n workers inside one process.
Every request has an exact, order-defined meaning, so a simulated run equals a real one bit for bit:
float sums over three or more ranks go through :class:`ReduceScatter`, which adds the ranks' values in
rank order (an all-to-all plus a local sum), because a ring all-reduce adds them in an order that
depends on each element's position (measured on Gloo with 3 ranks: 14 % of 10⁵ heavy-tailed fp32 sums
differ from the rank-order sum). Sums of two values, integer sums, max and min are exact in any order
and use the backend's all-reduce.

Nothing here talks to a process group: the strategies (:mod:`gradpress.exchange.strategy`) build protocols from
these pieces, and :mod:`gradpress.exchange.distributed` runs them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Sequence

import torch

from gradpress.core.compressor import NonFiniteError


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
    decodes) and returns; the runtime may run that continuation asynchronously. ``long_wait``: the
    other ranks wait here for one rank's long, one-off work (``auto``'s decision: rank 0 measures the
    candidates while the others wait in its broadcast), so the round runs on the process group
    gradpress was given, under that group's timeout, not under gradpress's ``timeout``, which bounds
    a wait for a peer that should be there within it. ``scope``: the group the round runs on, ``""`` the
    whole group gradpress talks on; a two-level exchange (:mod:`gradpress.exchange.hierarchy`) issues
    rounds on ``"node"`` (the ranks of this rank's node) and ``"cross"`` (the ranks of the same local
    index on every node), whose ranks and sizes the requests' ``src``, ``dst`` and rows then refer to."""

    requests: list[Collective]
    final: bool = False
    long_wait: bool = False
    scope: str = ""


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


def single(request: Collective, final: bool) -> Protocol:
    (result,) = yield Round([request], final)
    return result


# -- fault flags, carried in-band ------------------------------------------------------------------
# A rank whose gradient holds NaN/Inf still takes part in the exchange (with a packet compressed from
# zeros) and sets its flag; every exchange carries every rank's flag in buffers it sends anyway, so all
# ranks learn the same set of faulty ranks at the same point of the protocol and raise the same
# NonFiniteError together, instead of the faulty rank raising alone while its peers wait out the
# timeout (invariant: dtype/shape/device preserved; NaN/Inf reported, docs/design.md). The carriers:
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


def flagged_ranks(slots: torch.Tensor | Sequence[float], op: str = "sum") -> list[int]:
    """The ranks whose combined :func:`flag_slots` are marked (``op`` ``"nan"``: the NaN carriers of a
    float sum, see above). The n slots are read as Python numbers: one small copy, where a ``nonzero``
    costs more than the rest of an uncompressed bucket's bookkeeping (or given as numbers already read)."""
    values = slots.tolist() if isinstance(slots, torch.Tensor) else slots
    if op == "nan":
        return [r for r, value in enumerate(values) if value != value]
    if op == "min":
        return [r for r, value in enumerate(values) if value == 0]
    return [r for r, value in enumerate(values) if value != 0]


def raise_flagged(ranks: Sequence[int]) -> None:
    """Raise the one error every rank raises when some rank's gradient held NaN/Inf."""
    if ranks:
        which = ", ".join(str(r) for r in ranks)
        error = NonFiniteError(f"NaN/Inf in the gradient of rank{'s' if len(ranks) > 1 else ''} {which}")
        error.ranks = list(ranks)
        raise error
