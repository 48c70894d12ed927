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
The testbed's own parameter-server modes (:mod:`gradpress.strategy`) gather at rank 0 and send the
result back with ``torch.distributed.broadcast``, which Gloo runs as a binomial tree: there the root's
link carries ⌈log₂n⌉ copies of the result, not n−1 (``gather-broadcast``).

**Units**: ``bandwidth`` is in *bits* per second (tc's ``100mbit`` = 1e8, as
:func:`~gradpress.testbed.netem.rate_bits_per_second` reads it; a tc rate string is accepted too) and
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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from scipy.optimize import nnls

from gradpress.testbed.netem import rate_bits_per_second
from gradpress.testbed.results import Run

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
                       latency: float = DEFAULT_LATENCY) -> float:
    """Seconds a step's exchange takes among ``n`` workers at ``bandwidth`` bits/s per link."""
    return communication_cost(phases, n).seconds(bandwidth, latency)


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
                      overlap: bool = False) -> Breakdown:
    """Predicted step time from measured compute and compression times and the α–β exchange cost.

    ``overlap=False``: compute, compression and communication run one after the other (sum).
    ``overlap=True``: DDP starts a bucket's exchange while backward is still running, so at best the
    exchange hides behind computation: total = max(compute, communication) + compression (compression
    stays on the critical path). The truth lies between the two; they bound it.
    """
    for name, value in (("compute_s", compute_s), ("compress_s", compress_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number of seconds ≥ 0, got {value}")
    comm = communication_time(phases, n, bandwidth, latency)
    total = max(compute_s, comm) + compress_s if overlap else compute_s + compress_s + comm
    return Breakdown(compute_s, compress_s, comm, total)


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
    other; ``decompress_s``: decoding what arrives and averaging it, on the backend's thread."""

    ready_s: float
    compress_s: float
    phases: tuple[Phase, ...] = ()
    decompress_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("ready_s", "compress_s", "decompress_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"BucketStep.{name} must be a finite number of seconds ≥ 0, got {value}")
        object.__setattr__(self, "phases", tuple(self.phases))


def predict_bucketed_step(forward_s: float, backward_s: float, buckets: Sequence[BucketStep], *, n: int,
                          bandwidth: float | str, latency: float = DEFAULT_LATENCY,
                          optimizer_s: float = 0.0) -> Breakdown:
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
    """
    for name, value in (("forward_s", forward_s), ("backward_s", backward_s), ("optimizer_s", optimizer_s)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number of seconds ≥ 0, got {value}")
    compressing = hook_end = link_free = decoded = 0.0
    compression = communication = 0.0
    for bucket in buckets:
        start = max(bucket.ready_s + compressing, hook_end)
        hook_end = start + bucket.compress_s
        compressing += bucket.compress_s
        comm = communication_time(bucket.phases, n, bandwidth, latency) if bucket.phases else 0.0
        link_free = max(hook_end, link_free) + comm
        decoded = max(link_free, decoded) + bucket.decompress_s
        compression += bucket.compress_s + bucket.decompress_s
        communication += comm
    backward = max(backward_s + compressing, decoded)
    compute = forward_s + backward_s + optimizer_s
    return Breakdown(compute, compression, communication, forward_s + backward + optimizer_s)


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
    for below, above in zip(grid[:-1], grid[1:]):
        if not pays(float(above)):
            lo, hi = math.log(below), math.log(above)
            for _ in range(40):
                mid = 0.5 * (lo + hi)
                lo, hi = (mid, hi) if pays(math.exp(mid)) else (lo, mid)
            return math.exp(0.5 * (lo + hi))
    return math.inf


def predict_from_run(run: Run, *, bandwidth: float | str, n: int, strategy: str,
                     latency: float = DEFAULT_LATENCY, overlap: bool = False,
                     nbytes_down: float | None = None) -> Breakdown:
    """Predict the step time of ``run``'s compressor at another ``bandwidth`` and ``n``.

    Uses the run's steady-state mean compute and compression times and its mean bytes per step
    (GRACE's data volume: the input size of the collectives, one worker's B) — per-worker batch and
    packet size do not depend on n. A multi-phase method's bytes are priced as one ``strategy``.
    """
    phase = Phase(strategy, run.bytes_per_step, nbytes_down)
    return predict_step_time(run.mean_compute_s, run.mean_compress_s, phase, n=n, bandwidth=bandwidth,
                             latency=latency, overlap=overlap)


def measured_breakdown(run: Run) -> Breakdown:
    """The run's own steady-state means, in the same shape as a prediction (total = mean step time)."""
    return Breakdown(run.mean_compute_s, run.mean_compress_s, run.mean_comm_s, run.mean_step_s)


# -------------------------------------------------------------------------------------------------
# Fitting α (and β) to measured communication times
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Observation:
    """A measured exchange: ``seconds`` spent on ``phases`` among ``n`` workers."""

    phases: Phase | Sequence[Phase]
    n: int
    seconds: float


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


def _bits_per_second(bandwidth: float | str) -> float:
    value = rate_bits_per_second(bandwidth) if isinstance(bandwidth, str) else float(bandwidth)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"bandwidth must be a positive number of bits/s (or a tc rate), got {bandwidth!r}")
    return value


def _check_latency(latency: float) -> float:
    if not (math.isfinite(latency) and latency >= 0):
        raise ValueError(f"latency must be a finite number of seconds ≥ 0, got {latency}")
    return float(latency)
