"""Several nodes in the α–β model: N nodes of k ranks, exchanging flat (one level) or in two levels.

**The topology** (:class:`Topology`): n = N·k ranks on N nodes of k ranks each, numbered node by node
as torchrun numbers them (rank r on node ⌊r / k⌋). Every node has one full-duplex link of rate β (the
``bandwidth``, bits/s, as on one level) to the star between the nodes; inside a node the ranks exchange
at β_in (``intra_bandwidth``, default :data:`DEFAULT_INTRA_BANDWIDTH`: NVLink or shared memory is
faster than any NIC). Each phase of an exchange is priced as M messages, the bytes on its critical path
through the busiest node's link (l, at β) and the bytes on its critical path inside a node (i, at β_in)
(:class:`LevelCost`); one α for every message.

**Flat (one level)**: the strategy among all n ranks. With B bytes per rank (B↓ back from a server)
and the costs of Thakur, Rabenseifner & Gropp (2005) that :mod:`~gradpress.costmodel.network` prices a
star of n links with, what crosses a node's link:

====================  ======================  =====================  =====================
strategy              l (busiest node link)   i (inside a node)      M
====================  ======================  =====================  =====================
``allreduce``         2(n−1)/n·B  if N > 1    2(n−1)/n·B  if k > 1   2(n−1), paced
``allgather``         (n−1)·B     if N > 1    (n−1)·B     if k > 1   n−1, paced
``allreduce-rh``      2k(N−1)/N·B             2(k−1)/n·B             2⌈log₂n⌉
``allgather-rd``      k(n−k)·B                (k−1)·B                ⌈log₂n⌉
``broadcast``         ⌈log₂N⌉·B               ⌈log₂k⌉·B              ⌈log₂N⌉ + ⌈log₂k⌉
``ps``                (n−k)·(B + B↓)          (k−1)·(B + B↓)         2
``ps-dedicated``      n·(B + B↓)              0                      2
``gather-broadcast``  (n−k)·B + ⌈log₂N⌉·B↓    (k−1)·B + ⌈log₂k⌉·B↓   1 + ⌈log₂N⌉ + ⌈log₂k⌉
====================  ======================  =====================  =====================

(With n = 1 nothing is sent, but to a dedicated server.)

- A **ring** (``allreduce``, ``allgather``) on ranks ordered node by node passes each node boundary
  once per direction: of its n hops, N go through node links (one out of and one into each node) and
  the others stay inside nodes. In each of its steps every hop carries one chunk at once, so a node's
  link carries one hop's bytes (the ring's critical path) and the step is set by its slowest hop:
  *paced*, max(8·l/β, 8·i/β_in) — at min(β, β_in) where it has hops of both kinds.
- **Recursive halving and doubling** (``allreduce-rh``, ``allgather-rd``; N and k powers of two) pair
  ranks at distances 1, 2, 4, …: the log₂k steps at distances below k stay inside the node, the log₂N
  others cross between nodes with all k ranks of a node sending through its link at once (k times a
  rank's bytes of that step).
- The **binomial broadcast** (Thakur et al.: the root sends to the rank n/2 away first, then n/4, …)
  on node-contiguous ranks is a tree over the nodes, one sender a node in each of its ⌈log₂N⌉ steps
  between nodes, then a tree inside each node (⌈log₂k⌉ steps) (exact for powers of two).
- A **parameter server** on rank 0 receives the pushes of the n − k ranks outside its node through its
  node's link, and those of its own node's k − 1 other ranks inside it (the pull likewise); its own
  node's and the link's shares are charged one after the other (a bound: they could overlap), as are the
  steps of every algorithm but the ring. ``gather-broadcast`` (gradpress's ``ps``/``switch`` modes on
  Gloo) gathers so and broadcasts the result down the binomial tree. A dedicated server is a node of
  its own: all n ranks reach it through its link, with N = 1 too.

With k = 1 (a rank a node) this is :mod:`~gradpress.costmodel.network`'s star of n links, bit for bit;
with N = 1 (one node) nothing crosses a node link (but to a dedicated server) and the strategy runs at
β_in.

**Two levels** (``hierarchy="node"``, :mod:`gradpress.exchange.hierarchy`; ``Topology(...,
hierarchical=True)``), per exchange of a bucket of B_raw uncompressed bytes a rank:

1. a reduce-scatter inside the node: k − 1 messages, (k−1)/k · B_raw bytes at β_in;
2. k concurrent exchanges of the shards among the N nodes, local rank j with local rank j of every other
   node, by the method's own phases on its packet bytes for B_raw/k (the ``phases`` given): they share
   the node's link, so each phase costs the strategy's messages among N and k times its bytes among N
   (:data:`~gradpress.costmodel.STRATEGIES` at N), at β;
3. an all-gather inside the node of the averaged shards: k − 1 messages, (k−1)/k · B_raw at β_in.

With k = 1 this is the flat model among N, bit for bit; with N = 1 only the two phases inside the node
remain (the runtime itself runs one level there, and with k = 1: see
:mod:`gradpress.exchange.hierarchy`). For an all-gather method whose packet for B_raw is P bytes (P/k
for a shard), a node's link carries (n−1)·P flat and k·(N−1)·P/k = (N−1)·P in two levels: (Nk−1)/(N−1)
≥ k times less.

**Time** of a phase with b tokens in the node link's bucket (:mod:`~gradpress.costmodel.network`'s token
bucket and ``efficiency`` e are the node link's): M·α + 8·max(0, l − b)/(e·β) ⊕ 8·i/β_in, where ⊕ is max
for a paced ring and + otherwise; the phases of an exchange run one after the other, and the tokens
refill between exchanges, not within one. A faster β_in never slows a step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence

from gradpress.costmodel.network import (
    DEFAULT_LATENCY,
    STRATEGIES,
    Phase,
    _bits_per_second,
    _check_latency,
    _efficiency,
    _log2_ceil,
    _phases,
)

#: the rate between the ranks of one node (bits/s, tc's units) when none is given: NVLink and shared
#: memory move hundreds of Gbit/s, more than any node's NIC
DEFAULT_INTRA_BANDWIDTH = "100gbit"


@dataclass(frozen=True)
class Topology:
    """``nodes`` N nodes of ``local_size`` k ranks (rank r on node r // k), one link of the ``bandwidth``
    each to the star between them and ``intra_bandwidth`` (bits/s, or a tc rate) inside a node;
    ``hierarchical``: the exchange runs in two levels (module doc), else flat among the N·k ranks."""

    nodes: int
    local_size: int = 1
    intra_bandwidth: float | str = DEFAULT_INTRA_BANDWIDTH
    hierarchical: bool = False

    def __post_init__(self) -> None:
        for name in ("nodes", "local_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology.{name} must be an integer ≥ 1, got {value!r}")
        try:
            _bits_per_second(self.intra_bandwidth)
        except ValueError as error:
            raise ValueError(f"Topology.intra_bandwidth: {error}") from None
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"Topology.hierarchical must be True or False, got {self.hierarchical!r}")

    @property
    def workers(self) -> int:
        """n = N·k: every rank of every node."""
        return self.nodes * self.local_size

    @property
    def intra_bits_per_second(self) -> float:
        return _bits_per_second(self.intra_bandwidth)

    def transfer_seconds(self, phases: Phase | Sequence[Phase], bandwidth: float | str,
                         latency: float = DEFAULT_LATENCY, tokens: float = 0.0,
                         efficiency: Mapping[str, float] | None = None,
                         nbytes: float = 0.0) -> tuple[float, float]:
        """:func:`node_transfer_seconds` on these nodes."""
        return node_transfer_seconds(phases, self, bandwidth, latency, tokens, efficiency, nbytes)

    def flat(self) -> Topology:
        """The same nodes, exchanging in one level."""
        return replace(self, hierarchical=False)

    def two_level(self) -> Topology:
        """The same nodes, exchanging in two levels (``hierarchy="node"``)."""
        return replace(self, hierarchical=True)


@dataclass(frozen=True)
class LevelCost:
    """One phase of an exchange on a :class:`Topology`: ``messages`` (α each), ``link_bytes`` on its
    critical path through the busiest node's link (at β, drawing on its token bucket, at ``strategy``'s
    efficiency), ``intra_bytes`` on its critical path inside a node (at β_in). ``paced``: a ring, whose
    steps take the longer of the two; otherwise they add up."""

    strategy: str
    messages: float
    link_bytes: float
    intra_bytes: float
    paced: bool = False

    def seconds(self, bandwidth: float | str, intra_bandwidth: float | str,
                latency: float = DEFAULT_LATENCY, tokens: float = 0.0, efficiency: float = 1.0) -> float:
        """M·α + 8·max(0, l − b)/(e·β) ⊕ 8·i/β_in (module doc) with b = ``tokens``."""
        link = 8.0 * max(0.0, self.link_bytes - tokens) / (_bits_per_second(bandwidth) * efficiency)
        inside = 8.0 * self.intra_bytes / _bits_per_second(intra_bandwidth)
        return self.messages * _check_latency(latency) + (max(link, inside) if self.paced else link + inside)


def _ring(strategy: str, nodes: int, local: int, b: float, down: float) -> LevelCost:
    cost = STRATEGIES[strategy](nodes * local, b, down)
    return LevelCost(strategy, cost.messages, cost.nbytes if nodes > 1 else 0.0,
                     cost.nbytes if local > 1 else 0.0, paced=True)


def _power_of_two(strategy: str, n: int) -> None:
    if n & (n - 1):
        raise ValueError(f"{strategy}: recursive halving and doubling need a power-of-two number of ranks, "
                         f"got {n}")


def _halving(nodes: int, local: int, b: float, down: float) -> LevelCost:
    n = nodes * local
    _power_of_two("allreduce-rh", n)
    return LevelCost("allreduce-rh", 2 * _log2_ceil(n), 2 * local * (nodes - 1) / nodes * b,
                     2 * (local - 1) / n * b)


def _doubling(nodes: int, local: int, b: float, down: float) -> LevelCost:
    n = nodes * local
    _power_of_two("allgather-rd", n)
    return LevelCost("allgather-rd", _log2_ceil(n), local * (n - local) * b, (local - 1) * b)


def _gather_broadcast(nodes: int, local: int, b: float, down: float) -> LevelCost:
    n = nodes * local
    return LevelCost("gather-broadcast", 1 + _log2_ceil(nodes) + _log2_ceil(local) if n > 1 else 0,
                     (n - local) * b + _log2_ceil(nodes) * down, (local - 1) * b + _log2_ceil(local) * down)


#: (N, k, B, B↓) -> the phase among the N·k ranks of N nodes (the module doc's table)
FLAT: dict[str, Callable[[int, int, float, float], LevelCost]] = {
    "allreduce": lambda nodes, local, b, down: _ring("allreduce", nodes, local, b, down),
    "allreduce-rh": _halving,
    "allgather": lambda nodes, local, b, down: _ring("allgather", nodes, local, b, down),
    "allgather-rd": _doubling,
    "broadcast": lambda nodes, local, b, down: LevelCost(
        "broadcast", _log2_ceil(nodes) + _log2_ceil(local), _log2_ceil(nodes) * b, _log2_ceil(local) * b),
    "ps": lambda nodes, local, b, down: LevelCost(
        "ps", 2 if nodes * local > 1 else 0, (nodes * local - local) * (b + down), (local - 1) * (b + down)),
    "ps-dedicated": lambda nodes, local, b, down: LevelCost(
        "ps-dedicated", 2, nodes * local * (b + down), 0.0),
    "gather-broadcast": _gather_broadcast,
}


def flat_cost(phase: Phase, topology: Topology) -> LevelCost:
    """``phase`` among all N·k ranks of ``topology``, one level (module doc's table)."""
    down = phase.nbytes if phase.nbytes_down is None else phase.nbytes_down
    return FLAT[phase.strategy](topology.nodes, topology.local_size, float(phase.nbytes), float(down))


def level_costs(phases: Phase | Sequence[Phase], topology: Topology, nbytes: float = 0.0) -> list[LevelCost]:
    """The phases of one exchange on ``topology``, in order. Flat: each of ``phases`` among the N·k ranks.
    In two levels: the reduce-scatter inside the node of the ``nbytes`` (B_raw) a rank hands in, each of
    ``phases`` — the exchange of one shard's packets (those for B_raw/k, :func:`shard_phases`) — among
    the N nodes with k of them sharing the link, and the all-gather inside the node (module doc)."""
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"nbytes must be a finite number of bytes ≥ 0, got {nbytes}")
    if not topology.hierarchical:
        return [flat_cost(phase, topology) for phase in _phases(phases)]
    nodes, local = topology.nodes, topology.local_size
    inside = (local - 1) / local * float(nbytes)
    between = []
    for phase in _phases(phases):
        cost = phase.cost(nodes)
        between.append(LevelCost(phase.strategy, cost.messages, local * cost.nbytes, 0.0))
    return [LevelCost("reducescatter", local - 1, 0.0, inside), *between,
            LevelCost("allgather", local - 1, 0.0, inside)]


def node_transfer_seconds(phases: Phase | Sequence[Phase], topology: Topology, bandwidth: float | str,
                          latency: float = DEFAULT_LATENCY, tokens: float = 0.0,
                          efficiency: Mapping[str, float] | None = None,
                          nbytes: float = 0.0) -> tuple[float, float]:
    """Seconds one exchange takes on ``topology`` (:func:`level_costs`, its phases one after the other)
    with ``tokens`` bytes in the node link's bucket when it starts, and the tokens left (as
    :func:`~gradpress.costmodel.transfer_seconds` on one level; ``efficiency`` per strategy applies to
    the node link's bytes)."""
    rate = _bits_per_second(bandwidth)
    inner = topology.intra_bits_per_second
    alpha = _check_latency(latency)
    if not (math.isfinite(tokens) and tokens >= 0):
        raise ValueError(f"tokens must be a finite number of bytes ≥ 0, got {tokens}")
    seconds = 0.0
    for cost in level_costs(phases, topology, nbytes):
        seconds += cost.seconds(rate, inner, alpha, tokens, _efficiency(efficiency, cost.strategy))
        tokens = max(0.0, tokens - cost.link_bytes)
    return seconds, tokens


@dataclass(frozen=True)
class NodeExchange:
    """One exchange on a :class:`Topology`: its ``seconds`` (plain links), its ``messages``, the bytes on
    its critical path through the busiest node's link (``link_bytes``: the traffic between nodes) and
    inside a node (``intra_bytes``)."""

    seconds: float
    messages: float
    link_bytes: float
    intra_bytes: float


def node_exchange(phases: Phase | Sequence[Phase], topology: Topology, bandwidth: float | str, *,
                  latency: float = DEFAULT_LATENCY, efficiency: Mapping[str, float] | None = None,
                  nbytes: float = 0.0) -> NodeExchange:
    """The time and the traffic of one exchange (a step's, or a bucket's) on ``topology``, flat or in two
    levels by ``topology.hierarchical``: ``phases`` are what a rank hands its exchange (flat: its packets;
    in two levels: its shard's, :func:`shard_phases`), ``nbytes`` the uncompressed bytes B_raw a rank
    reduce-scatters inside its node in two levels."""
    costs = level_costs(phases, topology, nbytes)
    seconds, _ = node_transfer_seconds(phases, topology, bandwidth, latency, efficiency=efficiency,
                                       nbytes=nbytes)
    return NodeExchange(seconds, sum((c.messages for c in costs), 0.0),
                        sum((c.link_bytes for c in costs), 0.0), sum((c.intra_bytes for c in costs), 0.0))


def node_link_bytes(phases: Phase | Sequence[Phase], topology: Topology, nbytes: float = 0.0) -> float:
    """Bytes of one exchange through the busiest node's link (on its critical path), on ``topology``."""
    return sum((c.link_bytes for c in level_costs(phases, topology, nbytes)), 0.0)


def shard_phases(phases: Phase | Sequence[Phase], local_size: int) -> list[Phase]:
    """``phases`` for 1/``local_size`` of the bytes (``nbytes`` and ``nbytes_down`` divided by k): a
    shard's exchange in two levels where a method's packets are in proportion to what it compresses."""
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        raise ValueError(f"local_size must be an integer ≥ 1, got {local_size!r}")
    return [Phase(p.strategy, p.nbytes / local_size,
                  None if p.nbytes_down is None else p.nbytes_down / local_size) for p in _phases(phases)]
