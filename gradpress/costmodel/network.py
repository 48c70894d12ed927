"""An α–β cost model of a training step: predicted step time from measured compute and compression.

Hockney's model prices one message of m bytes between two nodes at α + m/β (α: latency per message,
β: bandwidth). Thakur, Rabenseifner & Gropp (2005, "Optimization of collective communication operations
in MPICH") give the costs of the collectives built from such messages; GRACE (Xu et al.) Section 3 names
the strategies a compressor needs: all-reduce for summable packets, all-gather (or broadcast) for the rest,
and a parameter server as the alternative to collectives. With B = bytes each worker contributes and
n workers (the reduction's arithmetic, Thakur's γ term, is left out):

====================  ===========  =====================  ==============================================
strategy              α terms      bytes, critical path   algorithm
====================  ===========  =====================  ==============================================
``allreduce``         2(n−1)       2(n−1)/n · B           ring: reduce-scatter, then all-gather
``allreduce-rh``      2⌈log₂n⌉     2(n−1)/n · B           Rabenseifner: recursive halving, then doubling
                                                          (n a power of two)
``allgather``         n−1          (n−1) · B              ring: everyone receives every other packet
``allgather-rd``      ⌈log₂n⌉      (n−1) · B              recursive doubling
``broadcast``         ⌈log₂n⌉      ⌈log₂n⌉ · B            binomial tree (CLT-k's leader indices)
``ps``                2            (n−1) · (B + B↓)       parameter server on one of the workers
``ps-dedicated``      2            n · (B + B↓)           parameter server on its own node
``gather-broadcast``  1 + ⌈log₂n⌉  (n−1)·B + ⌈log₂n⌉·B↓   gradpress's ``ps``/``switch`` modes on Gloo:
                                                          gather at the root, binomial-tree broadcast
====================  ===========  =====================  ==============================================

The network is the testbed's emulated star (:mod:`gradpress.testbed.netem`): every worker has its own
link to a bridge, rate-limited to the same β in each direction (full duplex: sending and receiving do
not compete). So in a ring every step costs one message on every link at once, while a parameter
server's link is the star's bottleneck: the other workers' pushes arrive through it one after the other
(B each), and the pull sends the aggregate (B↓ bytes, default B; THC sends 8-bit sums for 4-bit
indices) back through it to each of them. With n = 1 nothing is sent, except to a dedicated server.
The testbed's own parameter-server modes (:mod:`gradpress.exchange.strategy`) gather at rank 0 and send the
result back with ``torch.distributed.broadcast``, which Gloo runs as a binomial tree: there the root's
link carries ⌈log₂n⌉ copies of the result, not n−1 (``gather-broadcast``).

**Units**: ``bandwidth`` is in *bits* per second (tc's ``100mbit`` = 1e8, as
:func:`rate_bits_per_second` reads it; a tc rate string is accepted too) and
``nbytes`` in *bytes*: the time of m bytes is 8·m / bandwidth.

**A step**: :func:`predict_step_time` bounds it (everything in sequence, or the exchange entirely hidden
behind compute); :func:`predict_bucketed_step` follows DDP's buckets through the backward pass (each
bucket's hook compresses on the backward thread, its exchange waits for the link, its decoding for the
exchange), which ``gradpress advise`` prices measured profiles with. Where a method sends no more bytes
than the uncompressed all-reduce and its fixed costs (compression, decoding, latency) are no smaller,
its predicted speed-up over it never rises with link speed in the sequential model (a ratio
(a₀ + k₀/B)/(a + k/B) with a ≥ a₀, k ≤ k₀), and in the bucketed one while its buckets reach the hook at
the end of the backward pass. Buckets ready earlier can break that: where the all-reduce of an early
bucket already hides under the backward pass while the method's, started later behind its compression,
does not, a faster link still shortens the method's step and no longer the all-reduce's.

**Several nodes**: the star above has a link per worker. :mod:`~gradpress.costmodel.nodes` prices N
nodes of k ranks, a link per node and a faster rate inside a node, with the exchange flat among the N·k
ranks or in two levels (``hierarchy="node"``); :func:`predict_step_time` and
:func:`predict_bucketed_step` take such a ``topology`` (default None: the star, as above).

**Two properties of real links** beyond Hockney's α + m/β, both off by default (a plain link):

- **A token bucket** (``burst`` bytes). The testbed's links are Linux ``tc … tbf rate R burst S`` queues
  on the egress of each veth end (tc-tbf(8): tokens accrue at R up to the bucket size S; a packet leaves
  at once while tokens cover it, then waits for tokens). After an idle moment up to S bytes cross at the
  speed of the device behind the filter, far faster than R. The model: a link holds ``tokens`` ≤ burst,
  filled at R/8 bytes per second whenever the link is idle; a transfer of m bytes with b tokens takes
  messages·α + 8·max(0, m − b)/R and leaves max(0, b − m) tokens (:func:`transfer_seconds`). Each byte
  passes two filters in series (its sender's veth end and the bridge's port to its receiver) that see the
  same traffic, so one bucket per direction stands for both. A step is priced in its steady state: the
  tokens at its start are those its own idle time leaves at its end (the largest such fixed point,
  :func:`steady_tokens`; the first step after a pause sees a full bucket).
  For one transfer per step in the sequential model this is a transfer time of
  max(0, 8·m/R − min(8·S/R, g)) with g the link's idle time per step (compute and compression): the
  bucket is full at every step while R·g/8 ≥ S, and otherwise the link is the bottleneck and long-run
  throughput is R. The speed-up statement above still holds (tested): with m ≤ m₀, at least the
  baseline's compression and messages, both steps' transfer times are convex, piecewise-linear and
  non-decreasing in 1/R, and on every piece the ratio does not rise with R.
- **A rate per collective** (``efficiency``: strategy → fraction of R its bytes beyond the bucket
  achieve, default 1). A ring all-reduce reaches ~0.94–0.96·R of payload over TCP through tbf (1448
  payload bytes per 1514-byte Ethernet frame, which tbf counts, is 0.956), while the testbed's
  all-gathers of megabyte packets measured ~0.63–0.70·R on the same star. Why is not identified (a
  candidate, unmeasured: a whole packet sent as one message overflows tbf's queue, which ``latency 50ms``
  bounds at S + R·50 ms, and TCP's loss recovery idles the link; the all-reduce's chunked pipeline would
  not). So it is not guessed: :func:`fit_efficiency` fits it per strategy from measured exchanges
  (``advise --check`` fits it from ``compare``'s runs, each run predicted from the others').
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from gradpress.costmodel.nodes import Topology

_RATE = re.compile(r"^(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)$", re.I)
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def rate_bits_per_second(rate: str) -> float:
    """``"100mbit"`` -> 1e8 (tc's units: bit, kbit, mbit, gbit, tbit; decimal prefixes)."""
    match = _RATE.match(rate.strip())
    if not match:
        raise ValueError(f"bandwidth {rate!r}: expected a number and a unit, e.g. 100mbit or 1gbit")
    return float(match[1]) * _UNITS[match[2].lower()]


#: per-message latency α (s) used when none is given: an order-of-magnitude guess for TCP between local
#: processes; fit the testbed's with :func:`fit_latency` or :func:`fit_alpha_beta` on measured runs
DEFAULT_LATENCY = 1e-4


@dataclass(frozen=True)
class Cost:
    """A collective's α–β cost: time = ``messages`` · α + 8 · ``nbytes`` / bandwidth (bits/s)."""

    messages: float
    nbytes: float

    def seconds(self, bandwidth: float | str, latency: float = DEFAULT_LATENCY) -> float:
        return self.messages * _check_latency(latency) + 8.0 * self.nbytes / _bits_per_second(bandwidth)

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.messages + other.messages, self.nbytes + other.nbytes)


def _log2_ceil(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


STRATEGIES: dict[str, Callable[[int, float, float], Cost]] = {
    # (n, B, B_down) -> Cost; the table in the module doc
    "allreduce": lambda n, b, down: Cost(2 * (n - 1), 2 * (n - 1) / n * b),
    "allreduce-rh": lambda n, b, down: Cost(2 * _log2_ceil(n), 2 * (n - 1) / n * b),
    "allgather": lambda n, b, down: Cost(n - 1, (n - 1) * b),
    "allgather-rd": lambda n, b, down: Cost(_log2_ceil(n), (n - 1) * b),
    "broadcast": lambda n, b, down: Cost(_log2_ceil(n), _log2_ceil(n) * b),
    "ps": lambda n, b, down: Cost(2 if n > 1 else 0, (n - 1) * (b + down)),
    "ps-dedicated": lambda n, b, down: Cost(2, n * (b + down)),
    "gather-broadcast": lambda n, b, down: Cost(1 + _log2_ceil(n) if n > 1 else 0,
                                                (n - 1) * b + _log2_ceil(n) * down),
}
#: strategies whose result comes back with its own size (``Phase.nbytes_down``)
TWO_WAY = ("ps", "ps-dedicated", "gather-broadcast")


@dataclass(frozen=True)
class Phase:
    """One exchange of a step: ``strategy`` (:data:`STRATEGIES`) on ``nbytes`` per worker; for a parameter
    server, ``nbytes_down`` bytes come back (default ``nbytes``). CLT-k's step is two phases:
    ``Phase("broadcast", index bytes), Phase("allreduce", value bytes)``."""

    strategy: str
    nbytes: float
    nbytes_down: float | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; known: {', '.join(STRATEGIES)}")
        for name in ("nbytes", "nbytes_down"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Phase.{name} must be a finite number of bytes ≥ 0, got {value}")
        if self.nbytes_down is not None and self.strategy not in TWO_WAY:
            raise ValueError(f"nbytes_down is for a parameter server ({', '.join(TWO_WAY)}), "
                             f"not {self.strategy!r}")

    def cost(self, n: int) -> Cost:
        """The α–β cost of this phase among ``n`` workers."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"the number of workers must be an integer ≥ 1, got {n!r}")
        if self.strategy == "allreduce-rh" and n & (n - 1):
            raise ValueError(f"recursive halving needs a power-of-two number of workers, got {n}")
        down = self.nbytes if self.nbytes_down is None else self.nbytes_down
        return STRATEGIES[self.strategy](n, float(self.nbytes), float(down))


def communication_cost(phases: Phase | Sequence[Phase], n: int) -> Cost:
    """The summed cost of a step's phases (they run one after the other)."""
    phases = [phases] if isinstance(phases, Phase) else list(phases)
    total = Cost(0.0, 0.0)
    for phase in phases:
        total = total + phase.cost(n)
    return total


def communication_time(phases: Phase | Sequence[Phase], n: int, bandwidth: float | str,
                       latency: float = DEFAULT_LATENCY,
                       efficiency: Mapping[str, float] | None = None) -> float:
    """Seconds a step's exchange takes among ``n`` workers at ``bandwidth`` bits/s per link (no token
    bucket; ``efficiency``: each strategy's fraction of the rate, default 1)."""
    if not efficiency:
        return communication_cost(phases, n).seconds(bandwidth, latency)
    return transfer_seconds(phases, n, bandwidth, latency, efficiency=efficiency)[0]


def _phases(phases: Phase | Sequence[Phase]) -> list[Phase]:
    return [phases] if isinstance(phases, Phase) else list(phases)


def _efficiency(efficiency: Mapping[str, float] | None, strategy: str) -> float:
    value = 1.0 if not efficiency else float(efficiency.get(strategy, 1.0))
    if not (math.isfinite(value) and 0 < value):
        raise ValueError(f"efficiency of {strategy!r} must be a positive fraction of the link rate, "
                         f"got {value}")
    return value


def transfer_seconds(phases: Phase | Sequence[Phase], n: int, bandwidth: float | str,
                     latency: float = DEFAULT_LATENCY, tokens: float = 0.0,
                     efficiency: Mapping[str, float] | None = None) -> tuple[float, float]:
    """Seconds the ``phases`` take back to back through a token-bucket link (module doc, tc-tbf(8)) that
    holds ``tokens`` bytes when they start, and the tokens left: each phase of M messages and m bytes on
    the critical path (:meth:`Phase.cost`) with b tokens takes M·α + 8·max(0, m − b)/(e·R) and leaves
    max(0, b − m); e is its strategy's ``efficiency`` (default 1). With no tokens it is Hockney's
    α–β time (divided by e)."""
    rate = _bits_per_second(bandwidth)
    alpha = _check_latency(latency)
    if not (math.isfinite(tokens) and tokens >= 0):
        raise ValueError(f"tokens must be a finite number of bytes ≥ 0, got {tokens}")
    seconds = 0.0
    for phase in _phases(phases):
        cost = phase.cost(n)
        seconds += cost.messages * alpha + 8.0 * max(0.0, cost.nbytes - tokens) / (
            rate * _efficiency(efficiency, phase.strategy))
        tokens = max(0.0, tokens - cost.nbytes)
    return seconds, tokens


#: (phases, bandwidth, latency, tokens, efficiency, B_raw) -> (seconds, tokens left) of one exchange
_Exchange = Callable[[Phase | Sequence[Phase], float | str, float, float, Mapping[str, float] | None, float],
                    tuple[float, float]]


def _transfer(n: int, topology: Topology | None) -> _Exchange:
    """How an exchange among ``n`` ranks is priced: :func:`transfer_seconds` on a star of n links, or
    :meth:`~gradpress.costmodel.nodes.Topology.transfer_seconds` on ``topology`` (whose ranks must be
    n; the nodes' module builds on this one)."""
    if topology is None:
        return lambda phases, bandwidth, latency, tokens, efficiency, nbytes: transfer_seconds(
            phases, n, bandwidth, latency, tokens, efficiency)
    if n != topology.workers:
        raise ValueError(f"n = {n} ranks, but the topology has {topology.nodes} nodes of {topology.local_size}: "
                         f"{topology.workers} ranks")
    return topology.transfer_seconds


def refill(tokens: float, idle_s: float, bandwidth: float | str, burst: float) -> float:
    """The tokens of a bucket of ``burst`` bytes after ``idle_s`` seconds idle at ``bandwidth`` bits/s:
    min(burst, tokens + R/8 · idle) (tc-tbf(8): tokens accrue at the rate, up to the bucket size)."""
    return min(float(burst), tokens + _bits_per_second(bandwidth) / 8.0 * max(0.0, idle_s))


def steady_tokens(tokens_after_step: Callable[[float], float], burst: float,
                  tolerance: float = 1e-6) -> float:
    """The tokens a step starts with in steady state: a t in [0, ``burst``] with
    ``tokens_after_step(t)`` = t, the state a link settles in from a full bucket (an idle start). T is
    non-decreasing (more tokens at the start never leave fewer at the end), so iterating it from ``burst``
    descends to its greatest fixed point (Tarski); since a drain of a few bytes per step would take many
    steps, bisection keeps T(lo) ≥ lo and T(hi) < hi instead, which brackets that fixed point wherever
    T(t) − t changes sign once (a plain link: T ≡ 0; one transfer per step: T is constant, or t minus the
    bytes plus a refill, until it reaches the cap)."""
    burst = float(burst)
    if not (math.isfinite(burst) and burst >= 0):
        raise ValueError(f"burst must be a finite number of bytes ≥ 0, got {burst}")
    if burst == 0.0:
        return 0.0
    if tokens_after_step(burst) >= burst - tolerance:
        return burst
    lo, hi = 0.0, burst
    while hi - lo > tolerance:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if tokens_after_step(mid) >= mid else (lo, mid)
    return lo


@dataclass(frozen=True)
class Breakdown:
    """Where a step's time goes (seconds): ``total`` follows the overlap rule of :func:`predict_step_time`."""

    compute: float
    compression: float
    communication: float
    total: float

    def samples_per_s(self, samples_per_step: float) -> float:
        """Throughput at ``samples_per_step`` global samples per step."""
        return samples_per_step / self.total


def predict_step_time(compute_s: float, compress_s: float, phases: Phase | Sequence[Phase], *, n: int,
                      bandwidth: float | str, latency: float = DEFAULT_LATENCY,
                      overlap: bool = False, burst: float = 0.0,
                      efficiency: Mapping[str, float] | None = None, topology: Topology | None = None,
                      nbytes: float = 0.0) -> Breakdown:
    """Predicted step time from measured compute and compression times and the α–β exchange cost.

    ``overlap=False``: compute, compression and communication run one after the other (sum).
    ``overlap=True``: DDP starts a bucket's exchange while backward is still running, so at best the
    exchange hides behind computation: total = max(compute, communication) + compression (compression
    stays on the critical path). The truth lies between the two; they bound it.

    With a ``burst`` (module doc) the exchange draws on the bucket in its steady state: sequentially the
    link idles through compute and compression before the exchange; overlapped, it idles for the rest of
    the step after it.

    ``topology``: the n ranks on N nodes of k (:class:`~gradpress.costmodel.nodes.Topology`, its
    ``workers`` = ``n``), the exchange flat or in two levels on it (:mod:`~gradpress.costmodel.nodes`:
    ``phases`` are then a shard's, ``nbytes`` the uncompressed bytes B_raw each rank reduce-scatters
    inside its node); None: a star of n links (the module doc).
    """
    for name, value in (("compute_s", compute_s), ("compress_s", compress_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number of seconds ≥ 0, got {value}")
    transfer = _transfer(n, topology)

    def step(tokens: float) -> tuple[Breakdown, float]:
        if overlap:
            comm, left = transfer(phases, bandwidth, latency, tokens, efficiency, nbytes)
            total = max(compute_s, comm) + compress_s
            return Breakdown(compute_s, compress_s, comm, total), refill(left, total - comm, bandwidth, burst)
        start = refill(tokens, compute_s + compress_s, bandwidth, burst)
        comm, left = transfer(phases, bandwidth, latency, start, efficiency, nbytes)
        return Breakdown(compute_s, compress_s, comm, compute_s + compress_s + comm), left

    return step(steady_tokens(lambda t: step(t)[1], burst))[0]


def crossover_bandwidth(compress_s: float, phases: Phase | Sequence[Phase], baseline_compress_s: float,
                        baseline_phases: Phase | Sequence[Phase], *, n: int,
                        latency: float = DEFAULT_LATENCY) -> float:
    """The link speed (bits/s) at which a method stops beating a baseline (GRACE's lesson: compression
    pays only while the communication it saves outweighs its overhead), in the sequential model of
    :func:`predict_step_time` (the same compute on both sides cancels):

        compress + α·M + 8·b/B  =  compress₀ + α·M₀ + 8·b₀/B   ⇔   B* = 8·(b₀ − b) / (compress − compress₀ + α·(M − M₀))

    with M messages and b bytes on the critical path (:func:`communication_cost`). Below B* the method
    is faster. ``math.inf``: it is faster at every speed (less overhead and fewer bytes); 0: at none.
    """
    method, base = communication_cost(phases, n), communication_cost(baseline_phases, n)
    saved_bytes = base.nbytes - method.nbytes
    overhead = compress_s - baseline_compress_s + _check_latency(latency) * (method.messages - base.messages)
    if overhead <= 0:
        return math.inf if saved_bytes >= 0 else 0.0
    return 8.0 * saved_bytes / overhead if saved_bytes > 0 else 0.0


@dataclass(frozen=True)
class BucketStep:
    """One DDP bucket's part of a step, for :func:`predict_bucketed_step`.

    ``ready_s``: seconds into the backward pass at which DDP hands the bucket to its communication hook
    (its last gradient is computed); ``compress_s``: what the hook spends on the backward thread (error
    feedback, preliminary values, compression); ``phases``: the collectives that carry it, one after the
    other; ``decompress_s``: decoding what arrives and averaging it, on the backend's thread; ``nbytes``:
    its uncompressed bytes B_raw, which a two-level exchange reduce-scatters and all-gathers inside the
    node (:mod:`~gradpress.costmodel.nodes`; unused on one level)."""

    ready_s: float
    compress_s: float
    phases: tuple[Phase, ...] = ()
    decompress_s: float = 0.0
    nbytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ready_s", "compress_s", "decompress_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"BucketStep.{name} must be a finite number of seconds ≥ 0, got {value}")
        if not (math.isfinite(self.nbytes) and self.nbytes >= 0):
            raise ValueError(f"BucketStep.nbytes must be a finite number of bytes ≥ 0, got {self.nbytes}")
        object.__setattr__(self, "phases", tuple(self.phases))


def predict_bucketed_step(forward_s: float, backward_s: float, buckets: Sequence[BucketStep], *, n: int,
                          bandwidth: float | str, latency: float = DEFAULT_LATENCY,
                          optimizer_s: float = 0.0, burst: float = 0.0,
                          efficiency: Mapping[str, float] | None = None,
                          topology: Topology | None = None) -> Breakdown:
    """A step whose exchange overlaps the backward pass bucket by bucket, as DDP's buckets overlap it.

    The backward pass computes gradients for ``backward_s`` seconds; bucket b is ready ``ready_s`` into
    it and DDP calls the hook for the buckets in order. The hook compresses on the backward thread, so
    every later gradient is computed that much later: hook b starts at
    max(ready_b + Σ_{k<b} compress_k, end of hook b−1). Each worker has one link, so the buckets'
    exchanges go one after the other (α–β cost of each bucket's :class:`Phase` s among ``n`` workers):
    exchange b starts when its hook ends and the link is free. Its decoding starts when it has arrived
    and the decoding of b−1 is done. ``backward()`` returns when both the gradient computation
    (``backward_s`` + Σ compress) and the last decoding are done; the optimizer follows.

    total = forward + max(backward + Σ compress, end of the last decoding) + optimizer

    With one bucket ready at the end of the backward pass this is :func:`predict_step_time`'s sequential
    sum (compression = compress + decompress); the more of the exchange fits under the backward pass,
    the closer it comes to the overlapped bound. ``Breakdown.compression`` is Σ (compress + decompress),
    ``Breakdown.communication`` the exchanges' α–β time, ``Breakdown.compute`` forward + backward +
    optimizer.

    With a ``burst`` (module doc) each exchange draws on the link's token bucket, refilled while the link
    idles (from the step's start, between exchanges, and after the last one until the step ends); the
    step is priced in its steady state (:func:`steady_tokens`). ``efficiency``: each strategy's fraction
    of the link rate beyond the bucket (default 1).

    ``topology`` (:class:`~gradpress.costmodel.nodes.Topology`, its ``workers`` = ``n``): each bucket's
    exchange on N nodes of k ranks, flat or in two levels (:mod:`~gradpress.costmodel.nodes`; then each
    bucket's ``phases`` are a shard's and its ``nbytes`` cross inside the node), the link being a node's
    (its exchanges one after the other, its token bucket); None: a star of n links.
    """
    for name, value in (("forward_s", forward_s), ("backward_s", backward_s), ("optimizer_s", optimizer_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number of seconds ≥ 0, got {value}")
    transfer = _transfer(n, topology)

    def exchange(bucket: BucketStep, tokens: float) -> tuple[float, float]:
        return transfer(bucket.phases, bandwidth, latency, tokens, efficiency, bucket.nbytes)

    step = functools.partial(_overlapped_step, forward_s, backward_s, optimizer_s, list(buckets), exchange,
                             lambda tokens, idle_s: refill(tokens, idle_s, bandwidth, burst))
    return step(steady_tokens(lambda tokens: step(tokens)[1], burst))[0]


def _overlapped_step(forward_s: float, backward_s: float, optimizer_s: float, buckets: Sequence[BucketStep],
                     exchange: Callable[[BucketStep, float], tuple[float, float]],
                     refilled: Callable[[float, float], float], tokens: float) -> tuple[Breakdown, float]:
    """A step of :func:`predict_bucketed_step` from ``tokens`` in the link's bucket: its breakdown and the
    tokens left. ``exchange``: a bucket's seconds and tokens after; ``refilled``: the tokens after an idle."""
    compressing = hook_end = link_free = decoded = compression = communication = 0.0
    for bucket in buckets:
        start = max(bucket.ready_s + compressing, hook_end)
        hook_end = start + bucket.compress_s
        compressing += bucket.compress_s
        if bucket.phases:
            sending = max(hook_end, link_free)
            comm, tokens = exchange(bucket, refilled(tokens, sending - link_free))
            link_free = sending + comm
            communication += comm
        decoded = max(link_free, decoded) + bucket.decompress_s
        compression += bucket.compress_s + bucket.decompress_s
    compute = forward_s + backward_s + optimizer_s
    total = forward_s + max(backward_s + compressing, decoded) + optimizer_s
    return Breakdown(compute, compression, communication, total), refilled(tokens, total - link_free)


def bandwidth_crossing(step_time: Callable[[float], float], baseline_time: Callable[[float], float], *,
                       low: float = 1e6, high: float = 1e12, points: int = 61) -> float:
    """The link speed (bits/s) above which ``step_time`` stops being shorter than ``baseline_time`` (both
    functions of the bandwidth in bits/s): the first speed on a logarithmic grid of ``points`` speeds
    from ``low`` to ``high`` where it is no longer shorter, refined by bisection (in log space) against
    the speed before it. For any model, :func:`crossover_bandwidth` is the closed form of the sequential
    one. ``math.inf``: shorter over the whole range; 0: not shorter even at ``low``."""
    if not (0 < low < high and math.isfinite(high)) or points < 2:
        raise ValueError(f"need 0 < low < high < inf and points ≥ 2, got {low}, {high}, {points}")

    def pays(bits_per_second: float) -> bool:
        return step_time(bits_per_second) < baseline_time(bits_per_second)

    grid = np.geomspace(low, high, points)
    if not pays(float(grid[0])):
        return 0.0
    for below, above in zip(grid[:-1], grid[1:], strict=True):
        if not pays(float(above)):
            lo, hi = math.log(below), math.log(above)
            for _ in range(40):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if pays(math.exp(mid)) else (lo, mid)
            return math.exp(0.5 * (lo + hi))
    return math.inf


# -------------------------------------------------------------------------------------------------
# Fitting α (and β) to measured communication times
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Observation:
    """A measured exchange: ``seconds`` spent on ``phases`` among ``n`` workers (``tokens``: bytes in the
    link's token bucket when it began, for :func:`fit_efficiency`)."""

    phases: Phase | Sequence[Phase]
    n: int
    seconds: float
    tokens: float = 0.0


def fit_latency(observations: Sequence[Observation], bandwidth: float | str) -> float:
    """Least-squares α ≥ 0 given a known bandwidth: minimizes Σ (messages·α + bytes term − seconds)².

    Observations without messages (n = 1) carry no information about α and are ignored.
    """
    bits_per_second = _bits_per_second(bandwidth)
    costs = [(communication_cost(o.phases, o.n), o.seconds) for o in observations]
    num = sum(c.messages * (s - 8.0 * c.nbytes / bits_per_second) for c, s in costs)
    den = sum(c.messages ** 2 for c, _ in costs)
    if den == 0:
        raise ValueError("fit_latency needs at least one observation with messages (n > 1)")
    return max(0.0, num / den)


def fit_alpha_beta(observations: Sequence[Observation]) -> tuple[float, float]:
    """Non-negative least squares for (α, bandwidth in bits/s) over observations of different sizes.

    time = α·messages + (1/bandwidth)·(8·bytes) is linear in (α, 1/bandwidth); scipy's ``nnls`` keeps
    both ≥ 0. Needs observations that differ in bytes per message, or the two are not identifiable.
    """
    from scipy.optimize import nnls  # (scipy.optimize: half a second to import)

    costs = [communication_cost(o.phases, o.n) for o in observations]
    a = np.array([[c.messages, 8.0 * c.nbytes] for c in costs], dtype=float)
    b = np.array([o.seconds for o in observations], dtype=float)
    if len(costs) < 2 or np.linalg.matrix_rank(a) < 2:
        raise ValueError("fit_alpha_beta needs at least two observations whose message counts and bytes "
                         "are not proportional (vary the bytes)")
    (alpha, seconds_per_bit), _ = nnls(a, b)
    if seconds_per_bit <= 0:
        raise ValueError("the fitted bandwidth is unbounded: the measured times do not grow with bytes")
    return float(alpha), float(1.0 / seconds_per_bit)


def fit_efficiency(observations: Sequence[Observation], bandwidth: float | str,
                   latency: float = DEFAULT_LATENCY) -> dict[str, float]:
    """Each strategy's rate beyond the token bucket as a fraction of ``bandwidth`` (the module doc's
    ``efficiency``), fitted by non-negative least squares: an observation's seconds − messages·α =
    Σ over its strategies of 8·(bytes beyond its tokens)/R · 1/e, linear in 1/e (the bytes beyond the
    bucket as :func:`transfer_seconds` draws on it, phase by phase, from ``Observation.tokens``).
    Strategies whose bytes all fit the bucket carry no information about their rate and are left out,
    as are those the fit cannot bound."""
    from scipy.optimize import nnls  # (scipy.optimize: half a second to import)

    rate, alpha = _bits_per_second(bandwidth), _check_latency(latency)
    strategies: list[str] = []
    rows, times = [], []
    for o in observations:
        messages, row = _beyond_tokens(o, rate)
        row = {k: v for k, v in row.items() if v > 0}
        if not row:
            continue
        strategies += [k for k in row if k not in strategies]
        rows.append(row)
        times.append(o.seconds - messages * alpha)
    if not rows:
        raise ValueError("fit_efficiency needs an observation with bytes beyond the token bucket")
    a = np.array([[row.get(k, 0.0) for k in strategies] for row in rows], dtype=float)
    inverse, _ = nnls(a, np.array(times, dtype=float))
    return {k: float(1.0 / x) for k, x in zip(strategies, inverse, strict=True) if x > 0}


def fit_link(observations: Sequence[Observation], bandwidth: float | str,
             min_excess: float = 0.0) -> tuple[float, dict[str, float]]:
    """α and each strategy's rate beyond the token bucket (as :func:`fit_efficiency`), fitted together by
    non-negative least squares: seconds = α·messages + Σ 8·(bytes beyond the tokens)/R · 1/e. Through a
    bucket, exchanges that fit it cost messages only, which makes α identifiable beside the rates.
    Observations with fewer than ``min_excess`` bytes beyond their tokens inform α only: their few
    bytes beyond are priced at R (their time is mostly what else the exchange waits for, not a rate).
    Raises without an observation with messages."""
    from scipy.optimize import nnls  # (scipy.optimize: half a second to import)

    rate = _bits_per_second(bandwidth)
    strategies: list[str] = []
    rows, times = [], []
    for o in observations:
        messages, row = _beyond_tokens(o, rate)
        seconds = o.seconds
        if sum(row.values()) * rate / 8.0 < min_excess:
            seconds -= sum(row.values())
            row = {}
        row = {k: v for k, v in row.items() if v > 0}
        strategies += [k for k in row if k not in strategies]
        rows.append((messages, row))
        times.append(seconds)
    if not any(messages for messages, _ in rows):
        raise ValueError("fit_link needs an observation with messages (n > 1)")
    a = np.array([[messages] + [row.get(k, 0.0) for k in strategies] for messages, row in rows], dtype=float)
    solution, _ = nnls(a, np.array(times, dtype=float))
    return float(solution[0]), {k: float(1.0 / x)
                                for k, x in zip(strategies, solution[1:], strict=True) if x > 0}


def _beyond_tokens(o: Observation, rate: float) -> tuple[float, dict[str, float]]:
    """An observation's messages, and per strategy the seconds at ``rate`` of its bytes beyond the
    tokens it starts with (drawn on phase by phase)."""
    tokens, messages = float(o.tokens), 0.0
    row: dict[str, float] = {}
    for phase in _phases(o.phases):
        cost = phase.cost(o.n)
        messages += cost.messages
        row[phase.strategy] = row.get(phase.strategy, 0.0) + 8.0 * max(0.0, cost.nbytes - tokens) / rate
        tokens = max(0.0, tokens - cost.nbytes)
    return messages, row


def _bits_per_second(bandwidth: float | str) -> float:
    value = rate_bits_per_second(bandwidth) if isinstance(bandwidth, str) else float(bandwidth)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"bandwidth must be a positive number of bits/s (or a tc rate), got {bandwidth!r}")
    return value


def _check_latency(latency: float) -> float:
    if not (math.isfinite(latency) and latency >= 0):
        raise ValueError(f"latency must be a finite number of seconds ≥ 0, got {latency}")
    return float(latency)
