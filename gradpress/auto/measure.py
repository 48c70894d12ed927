"""What the running job records for ``auto``'s decisions: each step's buckets and the compute between
steps (:class:`Recorder`), each round of collectives as the cost model's phases (:func:`phases_of`),
and the link's α and β fitted to the fastest arrivals (:func:`fit_link`)."""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

import torch

from gradpress.auto.base import AutoBase
from gradpress.auto.options import FALLBACK_LATENCY, KEPT_ARRIVALS
from gradpress.exchange.protocol import (
    AllGather,
    AllReduce,
    Broadcast,
    Gather,
    Protocol,
    ReduceScatter,
    Round,
)

if TYPE_CHECKING:
    from gradpress.costmodel import ComputeProfile


# -- the link: rounds of collectives as the cost model's phases, and the fit ------------------------
def phases_of(round_: Round) -> tuple[tuple[str, float], ...]:
    """A round's collectives as (strategy, bytes per worker) of :data:`gradpress.costmodel.STRATEGIES`."""
    out = []
    for r in round_.requests:
        size = float(r.tensor.numel() * r.tensor.element_size())
        if isinstance(r, AllReduce):
            out.append(("allreduce", size))
        elif isinstance(r, ReduceScatter):  # (n−1) messages of 1/n of it: an all-gather of one chunk
            out.append(("allgather", size / max(1, r.tensor.shape[0])))
        elif isinstance(r, Broadcast):
            out.append(("broadcast", size))
        elif isinstance(r, (AllGather, Gather)):
            out.append(("allgather", size))
    return tuple(out)


def fit_link(arrivals: Mapping[tuple, float], n: int,
             fallback: tuple[float, float] | None = None) -> tuple[float, float]:
    """(α seconds per message, bandwidth bits/s) from the fastest arrival of each kind of round
    (phases -> seconds). Both by non-negative least squares where the sizes allow
    (:func:`~gradpress.costmodel.fit_alpha_beta`); otherwise α = :data:`FALLBACK_LATENCY` (at most
    half of the smallest round) and the bandwidth of the largest round, or ``fallback``."""
    from gradpress.costmodel import Observation, Phase, communication_cost, fit_alpha_beta

    observations = []
    for phases, seconds in arrivals.items():
        cost_phases = [Phase(strategy, nbytes) for strategy, nbytes in phases]
        if seconds > 0 and communication_cost(cost_phases, n).messages > 0:
            observations.append(Observation(cost_phases, n, seconds))
    if not observations:
        return fallback if fallback is not None else (0.0, 1e13)
    try:
        alpha, bandwidth = fit_alpha_beta(observations)
        if math.isfinite(bandwidth) and bandwidth > 0:
            return alpha, min(bandwidth, 1e13)
    except ValueError:
        pass
    costs = [(communication_cost(o.phases, n), o.seconds) for o in observations]
    alpha = min([FALLBACK_LATENCY] + [0.5 * s / c.messages for c, s in costs])
    cost, seconds = max(costs, key=lambda cs: cs[0].nbytes)
    remaining = seconds - alpha * cost.messages
    if cost.nbytes <= 0 or remaining <= 0:
        return fallback if fallback is not None else (alpha, 1e13)
    return alpha, min(8.0 * cost.nbytes / remaining, 1e13)


def preload() -> None:
    """Import what a decision needs that the training does not: scipy's optimizers (:func:`fit_link`'s
    non-negative least squares), a third of a second on a fresh interpreter, which the front ends'
    warm-up pays at set-up instead of the first decision."""
    import scipy.optimize  # noqa: F401


# -- what the running job records -------------------------------------------------------------------
@dataclass
class _BucketRecord:
    keys: tuple[str, ...]
    numel: int
    nbytes: int
    start: float
    hook_end: float = 0.0
    done: float = 0.0


@dataclass
class _StepRecord:
    step: int
    first: float
    buckets: list[_BucketRecord] = field(default_factory=list)
    gap: float | None = None  # from the end of this step's exchange to the next step's first bucket

    @property
    def layout(self) -> tuple[tuple[str, ...], ...]:
        return tuple(b.keys for b in self.buckets)

    def end(self) -> float:
        return max([self.first] + [max(b.done, b.hook_end) for b in self.buckets])

    def ready(self) -> list[float]:
        """When each bucket reached the hook, after the first, less the hook's time on earlier buckets."""
        out, spent = [], 0.0
        for b in self.buckets:
            out.append(max(0.0, b.start - self.first - spent))
            spent += max(0.0, b.hook_end - b.start)
        return out


def _add_squares(tally: list[float] | None, averages: list[torch.Tensor]) -> None:
    if tally is not None:
        from gradpress.costmodel.quality import squares

        tally[0] += sum(squares(t.detach()) for t in averages)


class Recorder(AutoBase):
    """The recording side of :class:`~gradpress.auto.AutoPipeline`: when each bucket reaches the hook
    and is decoded, each round's time on the link, and the profile and link a decision reads."""

    def _begin(self, step: int) -> None:
        now = time.perf_counter()
        if self._records and self._records[-1].step == self._current_step:
            last = self._records[-1]
            last.gap = max(0.0, now - last.end())
        self._current_step = step
        self._records.append(_StepRecord(step, now))

    def _timed(self, protocol: Protocol, record: _BucketRecord, tally: list[float] | None = None) -> Protocol:
        """``protocol``, recording when its compression ends (its first round is issued), each round's
        time on the link, and when it has decoded; the squared norm of the averages it returns is added
        to ``tally[0]`` when one is given."""
        try:
            round_ = next(protocol)
        except StopIteration as stop:
            record.hook_end = record.done = time.perf_counter()
            _add_squares(tally, stop.value)
            return stop.value
        record.hook_end = max(record.hook_end, time.perf_counter())
        while True:
            issued = time.perf_counter()
            results = yield round_
            arrived = time.perf_counter()
            if round_.final:  # (a non-final round is resumed later, at a point the same on every rank)
                self._observe(round_, issued, arrived)
            try:
                round_ = protocol.send(results)
            except StopIteration as stop:
                record.done = max(record.done, time.perf_counter())
                _add_squares(tally, stop.value)
                return stop.value

    def _observe(self, round_: Round, issued: float, arrived: float) -> None:
        """One round's time on the link: from its issue, or the arrival of the round before (rounds
        share one link and queue), to its arrival."""
        began = max(issued, self._link_free)
        self._link_free = max(self._link_free, arrived)
        kind = phases_of(round_)
        if kind and arrived > began:  # (keyed by the group it ran on: "" all ranks, "node" inside a node)
            key = (round_.scope, kind)
            kept = self._arrivals.get(key)
            if kept is None:
                kept = self._arrivals[key] = deque(maxlen=KEPT_ARRIVALS)
            kept.append(arrived - began)

    def _layout(self) -> tuple[tuple[str, ...], ...]:
        complete = [r for r in self._records if r.gap is not None]
        return complete[-1].layout

    def _link(self) -> tuple[float, float]:
        arrivals = {kind: min(kept) for (scope, kind), kept in self._arrivals.items() if kept and not scope}
        previous = self.why.get("link") or {}
        latency, bandwidth = previous.get("latency_s"), previous.get("bits_per_second")
        fallback = None
        if isinstance(latency, float) and isinstance(bandwidth, float) and math.isfinite(bandwidth):
            fallback = (latency, bandwidth)
        return fit_link(arrivals, self.world_size, fallback)

    def _intra_link(self) -> float:
        """The rate inside a node (bits/s): the ``intra_bandwidth`` option, else fitted to the fastest
        all-gathers inside the node (:func:`fit_link` among its k ranks), else the last one measured,
        else :data:`gradpress.costmodel.DEFAULT_INTRA_BANDWIDTH`."""
        from gradpress.costmodel import DEFAULT_INTRA_BANDWIDTH
        from gradpress.costmodel.network import _bits_per_second

        if self.auto.intra_bandwidth is not None:
            return _bits_per_second(self.auto.intra_bandwidth)
        arrivals = {kind: min(kept) for (scope, kind), kept in self._arrivals.items() if kept and scope == "node"}
        previous = (self.why.get("link") or {}).get("intra_bits_per_second")
        default = previous if isinstance(previous, float) and math.isfinite(previous) and previous > 0 \
            else _bits_per_second(DEFAULT_INTRA_BANDWIDTH)
        if not arrivals or self.layout is None:
            return default
        _, bandwidth = fit_link(arrivals, self.layout.local_size, (FALLBACK_LATENCY, default))
        return bandwidth if bandwidth < 1e13 else default

    def profile(self, layout: tuple[tuple[str, ...], ...]) -> ComputeProfile:
        """The compute and buckets of the recorded steps of ``layout`` (medians), as ``advise`` profiles
        them: ``forward_s`` is the time from the end of a step's exchange to the next step's first bucket
        (optimizer, forward, backward up to the first bucket), the least of the recorded steps' (of any
        layout: an evaluation or a checkpoint between two steps only lengthens one), ``ready_s`` counts
        from the first bucket."""
        from gradpress.costmodel import Bucket, ComputeProfile

        same = [r for r in self._records if r.gap is not None and r.layout == layout]
        readies = [r.ready() for r in same]
        ready = [statistics.median(row[b] for row in readies) for b in range(len(layout))]
        last = same[-1]
        buckets = tuple(Bucket(b, keys, rec.numel, rec.nbytes, ready[b])
                        for b, (keys, rec) in enumerate(zip(layout, last.buckets, strict=True)))
        forward = min(r.gap for r in self._records if r.gap is not None)  # (same[-1]'s at least)
        return ComputeProfile(forward, ready[-1] if ready else 0.0, 0.0, buckets, "measured", 0,
                              torch.get_num_threads(), sum(b.numel for b in buckets))
