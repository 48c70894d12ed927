"""``auto``: the job measures itself and picks a method per bucket.

GRACE's lesson (Xu et al., Section 6) is that no compressor wins everywhere: whether one pays off
depends on the model, the network and the compression overhead. ``gradpress advise`` answers that before
a run, on this machine; ``gradpress.register(model, "auto")`` (or ``ddp_comm_hook("auto")``,
``Communicator("auto")``) answers it inside the run, with the run's own link, compute and gradients:

1. **Measure** (``settle_steps`` steps, then ``measure_steps`` steps, exchanged uncompressed with
   ``none``). Each bucket's layout (keys, size), when it reached the hook (seconds after the step's first
   bucket, less the hook's own time on the buckets before it), the compute between the end of a step's
   exchange and the next step's first bucket (the optimizer, the forward pass and the backward pass up to
   the first bucket), and every round of collectives: from its issue, or the end of the round before it
   (one link: rounds queue), to its arrival. The link's α (seconds per message) and β (bits/s) are fitted
   to the fastest arrival of each size (:func:`gradpress.costmodel.fit_alpha_beta`).
2. **Decide** (rank 0, at the first bucket of step ``settle_steps + measure_steps``). Each candidate's
   compress and decompress times, packet bytes and collectives on the last measured step's real bucket
   gradients (:func:`gradpress.costmodel.measure_method`), then the step each assignment of methods
   to buckets would take (:func:`gradpress.costmodel.predict`: the bucketed α–β model of ``advise``
   and ``gradpress sim cost``). :func:`choose` starts from the best single method and improves bucket by
   bucket; a change must be predicted to shorten the step by more than ``margin``. Rank 0 broadcasts
   the choice (one small collective at decision points only; a steady-state step pays none) and every
   rank follows it from this bucket on. The others wait in that broadcast while rank 0 measures, on the
   process group gradpress was given, under its own timeout: the ``timeout`` option bounds a wait for
   a peer that should be there within it, not this one-off work (:class:`gradpress.exchange.protocol.Round`).
3. **Re-check** every ``recheck_every`` steps: the link and compute from the latest steps' running
   records, the candidates' costs measured once (again after a resume or a change of buckets), and the
   same rule. Switches happen only there, at the same step on every rank.

On a switch a key's error-feedback residual e (what compression dropped and has not been sent yet) is
not lost: a new method with a residual memory takes e over; one without adds e to the key's gradient at
its next exchange, once, so the sum of what is sent over the steps equals the sum of the gradients.
Memories whose state is not such a residual (DGC's momentum, ScaleCom's filter) restart.

``stats()["auto"]`` says what was chosen and why (per bucket: the spec and the predicted step with it
and with the bucket uncompressed; the link's time per byte and latency; the compute; the step of the
last decision); ``state_dict()`` keeps the choice, every method's memory and when to re-check, so a
resumed run continues with the same choice without measuring again until then.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from gradpress.core.compressor import make
from gradpress.exchange.pipeline import Group, Options, Pipeline, Stats
from gradpress.exchange.protocol import (
    AllGather,
    AllReduce,
    Broadcast,
    Gather,
    Protocol,
    ReduceScatter,
    Round,
)
from gradpress.exchange.state import FORMAT, own_state, resized, shapes_of, warn_resized

if TYPE_CHECKING:
    from gradpress.costmodel import ComputeProfile, MethodCost

#: the spec that selects this module
AUTO = "auto"
#: the uncompressed method: what the measurement steps run, and the reference of every prediction
UNCOMPRESSED = "none"
#: methods that pay in different regimes (GRACE Section 6; the README's demo set and sparser top-k)
DEFAULT_CANDIDATES = ("none", "fp16", "natural", "qsgd", "thc", "topk:ratio=0.01", "topk:ratio=0.001",
                      "powersgd")
#: seconds per message when the observed sizes cannot separate it from the bandwidth
FALLBACK_LATENCY = 1e-4
#: arrivals kept per size of round (the fastest of them is the link's time for that size)
KEPT_ARRIVALS = 8
#: what rank 0 broadcasts at a decision point (the payload's last value)
NEED_GRADIENTS, DECIDED, KEPT = 0.0, 1.0, 2.0


def is_auto(spec: Any) -> bool:
    return isinstance(spec, str) and spec.strip() == AUTO


@dataclass(frozen=True)
class AutoOptions:
    """``auto``'s own options (keyword arguments beside :class:`gradpress.exchange.pipeline.Options`).

    * ``candidates``: the specs it chooses among (``none`` is always one: it measures with it).
    * ``settle_steps``: steps before measuring (DDP rebuilds its buckets after the first step).
    * ``measure_steps``: steps measured before the first decision.
    * ``recheck_every``: steps between decisions after the first (0: never re-check).
    * ``margin``: a change of methods must be predicted to shorten the step by more than this fraction.
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    settle_steps: int = 2
    measure_steps: int = 5
    recheck_every: int = 500
    margin: float = 0.05

    def __post_init__(self) -> None:
        given = (self.candidates,) if isinstance(self.candidates, str) else self.candidates
        if not isinstance(given, Iterable) or not all(isinstance(c, str) for c in given):
            raise ValueError(f"option candidates must be spec strings, got {self.candidates!r}")
        specs: list[str] = []
        for text in [UNCOMPRESSED, *given]:
            if is_auto(text):
                raise ValueError("option candidates: 'auto' cannot be its own candidate")
            spec = make(text).spec  # an unknown spec raises ValueError here
            if spec not in specs:
                specs.append(spec)
        object.__setattr__(self, "candidates", tuple(specs))
        for name, low in (("settle_steps", 0), ("measure_steps", 1), ("recheck_every", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"option {name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise ValueError(f"option margin must be a number in [0, 1), got {self.margin!r}")

    @classmethod
    def pop_from(cls, options: dict[str, Any]) -> AutoOptions:
        """The auto options among ``options``, removed from it (the rest are the runtime's)."""
        names = [f.name for f in fields(cls)]
        return cls(**{name: options.pop(name) for name in names if name in options})

    def text(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


# ==================================================================================================
# The decision: a pure function of a profile and the candidates' measured costs
# ==================================================================================================
@dataclass(frozen=True)
class Decision:
    """What :func:`choose` decided: a spec per bucket, the predicted step with it (``predicted_s``), with
    every bucket uncompressed (``uncompressed_s``), with the methods in use before (``current_s``), with
    each bucket alone uncompressed (``bucket_uncompressed_s``), and with each candidate on every bucket
    (``uniform_s``)."""

    specs: tuple[str, ...]
    predicted_s: float
    uncompressed_s: float
    current_s: float
    bucket_uncompressed_s: tuple[float, ...]
    uniform_s: dict[str, float] = field(default_factory=dict)


def _mixed(by_spec: Mapping[str, MethodCost], specs: Sequence[str], n: int) -> MethodCost:
    """One bucket's cost of each bucket's method (decoding already scaled to ``n`` workers)."""
    from gradpress.costmodel import BucketCost, MethodCost

    buckets = []
    for b, spec in enumerate(specs):
        cost = by_spec[spec]
        c = cost.buckets[b]
        buckets.append(BucketCost(c.compress_s, cost.decompress_at(c, n), c.packet_bytes, c.transfers))
    return MethodCost("+".join(sorted(set(specs))), "mixed", "mixed", tuple(buckets), measured_workers=1)


def choose(profile: ComputeProfile, costs: Sequence[MethodCost], *, n: int, bandwidth: float | str,
           latency: float = FALLBACK_LATENCY, current: Sequence[str] | None = None,
           margin: float = 0.05, passes: int = 2) -> Decision:
    """The methods per bucket for the shortest predicted step (:func:`gradpress.costmodel.predict`)
    among ``n`` workers on a link of ``bandwidth`` bits/s and ``latency`` s per message.

    Starts from the best single method, then changes one bucket's method at a time while that shortens
    the prediction (``passes`` rounds over the buckets). ``current`` (a spec per bucket; default: every
    bucket ``none``) is kept unless the best is predicted faster by more than ``margin`` of its step
    (timings on a shared machine vary: a switch must pay clearly). ``costs`` must include ``none``."""
    from gradpress.costmodel import predict

    by_spec = {c.spec: c for c in costs}
    if UNCOMPRESSED not in by_spec:
        raise ValueError(f"choose needs the cost of {UNCOMPRESSED!r} (the reference)")
    nb = len(profile.buckets)
    for cost in costs:
        if len(cost.buckets) != nb:
            raise ValueError(f"{cost.spec}: costs of {len(cost.buckets)} buckets for a profile of {nb}")

    def step_of(specs: Sequence[str]) -> float:
        return predict(profile, _mixed(by_spec, specs, n), n=n, bandwidth=bandwidth, latency=latency).total

    uniform = {spec: step_of([spec] * nb) for spec in by_spec}
    best_spec = min(uniform, key=lambda s: (uniform[s], s != UNCOMPRESSED))
    best, best_s = [best_spec] * nb, uniform[best_spec]
    for _ in range(passes):
        improved = False
        for b in range(nb):
            for spec in by_spec:
                if spec == best[b]:
                    continue
                trial = [*best[:b], spec, *best[b + 1:]]
                seconds = step_of(trial)
                if seconds < best_s * (1 - 1e-9):
                    best, best_s, improved = trial, seconds, True
        if not improved:
            break
    now = [s if s in by_spec else UNCOMPRESSED for s in current] if current is not None else [UNCOMPRESSED] * nb
    if len(now) != nb:
        now = [UNCOMPRESSED] * nb
    current_s = step_of(now)
    if not best_s < current_s * (1 - margin):
        best, best_s = now, current_s
    alone = tuple(step_of([*best[:b], UNCOMPRESSED, *best[b + 1:]]) for b in range(nb))
    return Decision(tuple(best), best_s, uniform[UNCOMPRESSED], current_s, alone, uniform)


# ==================================================================================================
# Link: rounds of collectives as the cost model's phases, and the fit
# ==================================================================================================
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


# ==================================================================================================
# What the running job records
# ==================================================================================================
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


# ==================================================================================================
# The pipeline front ends drive
# ==================================================================================================
class AutoPipeline:
    """A pipeline per candidate (built when first chosen) behind :class:`gradpress.exchange.pipeline.Pipeline`'s
    interface (``agreement``, ``groups``, ``stats``, ``report``, ``state_dict``): every key goes to its
    chosen method's pipeline, and the decisions are made as the module docstring says. The pipelines
    share the step counters, shapes and statistics."""

    spec = AUTO
    compressor = None

    def __init__(self, auto: AutoOptions, options: Options, rank: int, world_size: int) -> None:
        self.auto, self.options, self.rank, self.world_size = auto, options, rank, world_size
        self.stats = Stats()
        self.steps: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._expected_shapes: dict[str, tuple[int, ...]] = {}
        self._pipelines: dict[str, Pipeline] = {}
        self.choice: dict[str, str] = {}  # key -> spec (absent: none)
        self.decided_at: int | None = None
        self.next_decision: float = auto.settle_steps + auto.measure_steps  # (math.inf: never)
        self.why: dict[str, Any] = {}
        self._flush: dict[str, torch.Tensor] = {}
        self._records: deque[_StepRecord] = deque(maxlen=auto.measure_steps + 1)
        self._arrivals: dict[tuple, deque[float]] = {}
        self._link_free = 0.0
        self._current_step = -1
        self._costs: dict[str, Any] | None = None  # rank 0: spec -> MethodCost, for _costs_layout
        self._costs_layout: tuple | None = None
        self._captured: dict[str, torch.Tensor] | None = None
        self.skipped: dict[str, str] = {}  # rank 0: candidates that failed to measure, with why
        self.error: str | None = None  # rank 0: why the last decision kept the methods as they were
        self.pipeline(UNCOMPRESSED)

    # -- the pipelines -----------------------------------------------------------------------------
    def pipeline(self, spec: str) -> Pipeline:
        """The pipeline of ``spec`` (built once; it shares this one's steps, shapes and statistics)."""
        pipeline = self._pipelines.get(spec)
        if pipeline is None:
            pipeline = self._pipelines[spec] = self._fresh(spec)
        return pipeline

    def _fresh(self, spec: str) -> Pipeline:
        pipeline = Pipeline(make(spec), self.options, self.rank, self.world_size)
        pipeline.stats, pipeline.steps, pipeline.shapes = self.stats, self.steps, self.shapes
        return pipeline

    def _agreed_on(self, spec: str) -> dict[str, str]:
        """What the ranks agree on beyond a chosen pipeline's own components: that the method is
        ``auto``'s choice, ``auto``'s options and its schedule (a rank that decides alone waits forever)."""
        decided = "not decided yet" if self.decided_at is None else f"decided at step {self.decided_at}"
        next_check = "never" if math.isinf(self.next_decision) else f"step {int(self.next_decision)}"
        return {"the compressor": f"'auto' (now {spec!r})", "auto": self.auto.text(),
                "auto's schedule": f"{decided}, next decision at {next_check}"}

    def _split(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int]]]:
        """The items' positions by chosen method, methods in order of first appearance."""
        by_spec: dict[str, list[int]] = {}
        for i, (key, _) in enumerate(items):
            by_spec.setdefault(self.choice.get(key, UNCOMPRESSED), []).append(i)
        return list(by_spec.items())

    # -- the interface the front ends drive -----------------------------------------------------------
    def agreement(self, items: Sequence[tuple[str, torch.Tensor]]) -> Group | None:
        """The control exchange before these items' exchange: at a decision point, rank 0's choice
        (broadcast) then the chosen pipelines' agreement; otherwise their agreement the first time
        (:meth:`gradpress.exchange.pipeline.Pipeline.agreement`), or None."""
        step = max((self.steps.get(key, 0) for key, _ in items), default=0)
        new = step > self._current_step
        if new:
            self._begin(step)
        if new and step >= self.next_decision:
            if any(r.gap is not None for r in self._records):
                device = items[0][1].device if items else torch.device("cpu")
                return Group([], self._decide(items, step, device), step)
            self.next_decision = step + self.auto.measure_steps  # (after a resume: nothing measured yet)
        protocols = []
        for spec, positions in self._split(items):
            group = self.pipeline(spec).agreement([items[i] for i in positions], self._agreed_on(spec))
            if group is not None:
                protocols.append(group.protocol)
        return Group([], _chain(protocols), step) if protocols else None

    def groups(self, items: Sequence[tuple[str, torch.Tensor]], bucket: torch.Tensor | None = None,
               writable: bool = False) -> list[Group]:
        """:meth:`gradpress.exchange.pipeline.Pipeline.groups`, each key by its chosen method's pipeline."""
        start = time.perf_counter()
        for key, tensor in items:
            expected = self._expected_shapes.pop(key, None)
            if expected is not None and expected != tuple(tensor.shape):
                raise ValueError(f"{key!r} has shape {tuple(tensor.shape)}; the loaded gradpress state was "
                                 f"saved for {expected}")
        step = max((self.steps.get(key, 0) for key, _ in items), default=0)
        if (self.rank == 0 and step == self.next_decision - 1
                and (self._costs is None or self._captured is not None)):
            captured = self._captured = self._captured or {}
            for key, tensor in items:
                captured[key] = tensor.detach().clone()
        writable = writable or bucket is not None
        items = list(items)
        for i, (key, tensor) in enumerate(items):
            pending = self._flush.pop(key, None)
            if pending is not None:  # a residual left by a method without memory: sent once, now
                if writable:
                    tensor.add_(pending.to(tensor.device))
                else:
                    items[i] = (key, (tensor + pending.to(tensor.device)).to(tensor.dtype))
        record = _BucketRecord(tuple(key for key, _ in items),
                               sum(t.numel() for _, t in items), sum(t.numel() * t.element_size() for _, t in items),
                               start)
        if self._records and self._records[-1].step == self._current_step:
            self._records[-1].buckets.append(record)
        split = self._split(items)
        out = []
        for spec, positions in split:
            chosen = [items[i] for i in positions]
            for group in self.pipeline(spec).groups(chosen, bucket=bucket if len(split) == 1 else None,
                                                    writable=writable):
                out.append(Group([positions[i] for i in group.members], self._timed(group.protocol, record),
                                 group.step, group.flat))
        return out

    def report(self) -> dict[str, Any]:
        """The statistics of :class:`gradpress.exchange.pipeline.Stats`, and ``"auto"``: what was chosen and why."""
        used = {spec: self.pipeline(spec).strategy.pattern for spec in self._in_use()}
        pattern = "auto: " + ", ".join(f"{spec} {p}" for spec, p in used.items())
        report = self.stats.report(pattern)
        report["auto"] = self._explain()
        return report

    # -- recording -----------------------------------------------------------------------------------
    def _begin(self, step: int) -> None:
        now = time.perf_counter()
        if self._records and self._records[-1].step == self._current_step:
            last = self._records[-1]
            last.gap = max(0.0, now - last.end())
        self._current_step = step
        self._records.append(_StepRecord(step, now))

    def _timed(self, protocol: Protocol, record: _BucketRecord) -> Protocol:
        """``protocol``, recording when its compression ends (its first round is issued), each round's
        time on the link, and when it has decoded."""
        try:
            round_ = next(protocol)
        except StopIteration as stop:
            record.hook_end = record.done = time.perf_counter()
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
                return stop.value

    def _observe(self, round_: Round, issued: float, arrived: float) -> None:
        """One round's time on the link: from its issue, or the arrival of the round before (rounds
        share one link and queue), to its arrival."""
        began = max(issued, self._link_free)
        self._link_free = max(self._link_free, arrived)
        kind = phases_of(round_)
        if kind and arrived > began:
            kept = self._arrivals.get(kind)
            if kept is None:
                kept = self._arrivals[kind] = deque(maxlen=KEPT_ARRIVALS)
            kept.append(arrived - began)

    # -- deciding ------------------------------------------------------------------------------------
    def _layout(self) -> tuple[tuple[str, ...], ...]:
        complete = [r for r in self._records if r.gap is not None]
        return complete[-1].layout

    def _decide(self, items: Sequence[tuple[str, torch.Tensor]], step: int, device: torch.device) -> Protocol:
        """Rank 0's choice, broadcast (every rank applies it at the same point); then the chosen
        pipelines' agreement on these items."""
        layout = self._layout()
        payload = self._payload(layout, NEED_GRADIENTS)
        if self.rank == 0:
            try:
                payload = self._rank0_payload(layout)
            except Exception as error:  # noqa: BLE001 - the others wait in the broadcast: never leave them
                self.error = f"{type(error).__name__}: {error}"[:300]
                payload = self._payload(layout, KEPT)
        (received,) = yield Round([Broadcast(payload.to(device), 0)], long_wait=True)  # (rank 0 measured)
        self._apply(received.cpu(), layout, step)
        if self._records:  # this step's buckets are timed from now, not from before the decision
            self._records[-1].first = time.perf_counter()
        for spec, positions in self._split(items):
            group = self.pipeline(spec).agreement([items[i] for i in positions], self._agreed_on(spec))
            if group is not None:
                yield from group.protocol

    def _link(self) -> tuple[float, float]:
        arrivals = {kind: min(kept) for kind, kept in self._arrivals.items() if kept}
        previous = self.why.get("link") or {}
        latency, bandwidth = previous.get("latency_s"), previous.get("bits_per_second")
        fallback = None
        if isinstance(latency, float) and isinstance(bandwidth, float) and math.isfinite(bandwidth):
            fallback = (latency, bandwidth)
        return fit_link(arrivals, self.world_size, fallback)

    def profile(self, layout: tuple[tuple[str, ...], ...]) -> ComputeProfile:
        """The compute and buckets of the recorded steps of ``layout`` (medians), as ``advise`` profiles
        them: ``forward_s`` is the time from the end of a step's exchange to the next step's first bucket
        (optimizer, forward, backward up to the first bucket), ``ready_s`` counts from the first bucket."""
        from gradpress.costmodel import Bucket, ComputeProfile

        same = [r for r in self._records if r.gap is not None and r.layout == layout]
        readies = [r.ready() for r in same]
        ready = [statistics.median(row[b] for row in readies) for b in range(len(layout))]
        last = same[-1]
        buckets = tuple(Bucket(b, keys, rec.numel, rec.nbytes, ready[b])
                        for b, (keys, rec) in enumerate(zip(layout, last.buckets, strict=True)))
        forward = statistics.median(r.gap for r in same if r.gap is not None)  # (all of them)
        return ComputeProfile(forward, ready[-1] if ready else 0.0, 0.0, buckets, "measured", 0,
                              torch.get_num_threads(), sum(b.numel for b in buckets))

    def _measure(self, profile: ComputeProfile) -> tuple[dict[str, Any], dict[str, str]]:
        """Each candidate's cost on the captured gradients (rank 0), as ``advise`` measures it."""
        from gradpress.costmodel import measure_method

        grads = self._captured or {}
        costs, skipped = {}, {}
        for spec in self.auto.candidates:
            try:
                self.pipeline(spec)  # a method these options cannot run (a mode it lacks) is left out
                costs[spec] = measure_method(spec, profile, [grads, grads], repeats=2, seed=self.options.seed)
            except Exception as error:  # noqa: BLE001 - one method that fails is left out, with its reason
                skipped[spec] = f"{type(error).__name__}: {error}"[:200]
        return costs, skipped

    def _payload(self, layout: tuple[tuple[str, ...], ...], status: float, decision: Decision | None = None,
                 link: tuple[float, float] = (0.0, 0.0), compute: float = 0.0) -> torch.Tensor:
        """What rank 0 broadcasts: [candidate index per bucket, predicted step with each bucket alone
        uncompressed, predicted step, uncompressed step, α, seconds per byte, compute, status]."""
        nb = len(layout)
        if decision is None:
            specs = [self.choice.get(keys[0], UNCOMPRESSED) if keys else UNCOMPRESSED for keys in layout]
            alone, predicted, uncompressed = [0.0] * nb, 0.0, 0.0
        else:
            specs, alone = list(decision.specs), list(decision.bucket_uncompressed_s)
            predicted, uncompressed = decision.predicted_s, decision.uncompressed_s
        indices = [float(self.auto.candidates.index(s)) if s in self.auto.candidates else 0.0 for s in specs]
        alpha, bandwidth = link
        per_byte = 8.0 / bandwidth if bandwidth > 0 else 0.0
        return torch.tensor([*indices, *alone, predicted, uncompressed, alpha, per_byte, compute, status],
                            dtype=torch.float64)

    def _rank0_payload(self, layout: tuple[tuple[str, ...], ...]) -> torch.Tensor:
        current = [self.choice.get(keys[0], UNCOMPRESSED) if keys else UNCOMPRESSED for keys in layout]
        link = self._link()
        profile = self.profile(layout)
        compute = profile.forward_s + profile.backward_s
        if self._costs is None or self._costs_layout != layout:
            captured = self._captured
            self._captured, self._costs = None, None
            if captured is None or not all(k in captured for keys in layout for k in keys):
                return self._payload(layout, NEED_GRADIENTS, link=link, compute=compute)
            self._captured = captured
            self._costs, self.skipped = self._measure(profile)
            self._costs_layout, self._captured = layout, None
        if UNCOMPRESSED not in self._costs:
            return self._payload(layout, KEPT, link=link, compute=compute)
        decision = choose(profile, list(self._costs.values()), n=self.world_size, bandwidth=link[1],
                          latency=link[0], current=current, margin=self.auto.margin)
        return self._payload(layout, DECIDED, decision, link, compute)

    def _apply(self, payload: torch.Tensor, layout: tuple[tuple[str, ...], ...], step: int) -> None:
        """Every rank: follow rank 0's choice from now on, moving the memory of every key that changes
        method (module docstring), and keep the reasons for :meth:`report`."""
        nb = len(layout)
        values = payload.tolist()
        specs = [self.auto.candidates[int(round(v))] for v in values[:nb]]
        alone = values[nb:2 * nb]
        predicted, uncompressed, alpha, per_byte, compute, status = values[2 * nb:]
        if status == NEED_GRADIENTS:  # rank 0 has no costs yet: it keeps this step's gradients, decides next
            self.next_decision = step + 1
            return
        for keys, spec in zip(layout, specs, strict=True):
            for key in keys:
                self._switch(key, self.choice.get(key, UNCOMPRESSED), spec)
        self.decided_at = step
        self.next_decision = step + self.auto.recheck_every if self.auto.recheck_every else math.inf
        decided = status == DECIDED
        self.why = {
            "decided": decided,
            "predicted_s": {"chosen": predicted, UNCOMPRESSED: uncompressed} if decided else {},
            "link": {"seconds_per_byte": per_byte, "latency_s": alpha,
                     "bits_per_second": 8.0 / per_byte if per_byte > 0 else math.inf},
            "compute_s": compute,
            "buckets": [{"keys": list(keys), "spec": spec,
                         "predicted_s": {"chosen": predicted, UNCOMPRESSED: a} if decided else {}}
                        for keys, spec, a in zip(layout, specs, alone, strict=True)],
        }

    def _switch(self, key: str, old: str, new: str) -> None:
        """``key`` goes from ``old``'s pipeline to ``new``'s: its residual is carried or flushed."""
        if old == new:
            return
        self.choice[key] = new
        residual = self._pipelines[old].feedback.take(key) if old in self._pipelines else None
        pending = self._flush.pop(key, None)
        if pending is not None:
            residual = pending if residual is None else residual + pending
        if residual is None:
            return
        target = self.pipeline(new)
        shape = self.shapes.get(key, tuple(residual.shape))
        compressed = target.compresses(key, torch.empty(shape, device="meta"))
        if not (compressed and target.feedback.give(key, residual)):
            self._flush[key] = residual

    def _in_use(self) -> list[str]:
        return list(dict.fromkeys(self.choice.values())) or [UNCOMPRESSED]

    def _explain(self) -> dict[str, Any]:
        phase = "measuring" if self.decided_at is None else "decided"
        explained = {"phase": phase, "decided_at": self.decided_at,
                     "next_check": None if math.isinf(self.next_decision) else int(self.next_decision),
                     "candidates": list(self.auto.candidates), **self.why}
        if self.skipped:
            explained["skipped"] = dict(self.skipped)
        if self.error:
            explained["error"] = self.error
        explained["reason"] = self._reason(explained)
        return explained

    def _reason(self, explained: dict[str, Any]) -> str:
        if explained["phase"] == "measuring":
            return (f"measuring with {UNCOMPRESSED} until step {explained['next_check']} "
                    f"(from step {self.auto.settle_steps}, {self.auto.measure_steps} steps)")
        buckets = explained.get("buckets") or []
        link = explained.get("link") or {}
        predicted = explained.get("predicted_s") or {}
        counts: dict[str, int] = {}
        for b in buckets:
            counts[b["spec"]] = counts.get(b["spec"], 0) + 1
        chosen = ", ".join(f"{spec} on {count} of {len(buckets)} bucket{'s' if len(buckets) > 1 else ''}"
                           for spec, count in counts.items()) or UNCOMPRESSED
        if not explained.get("decided"):
            return f"kept {chosen} at step {explained['decided_at']}: no candidate costs to decide with"
        return (f"{chosen} at step {explained['decided_at']}: predicted step "
                f"{_number(predicted.get('chosen')) * 1e3:.2f} ms against "
                f"{_number(predicted.get(UNCOMPRESSED)) * 1e3:.2f} ms uncompressed (link "
                f"{_number(link.get('bits_per_second')) / 1e6:.0f} Mbit/s, "
                f"{_number(link.get('latency_s')) * 1e6:.0f} µs per message; compute "
                f"{_number(explained.get('compute_s')) * 1e3:.2f} ms)")

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The runtime's state format (:mod:`gradpress.exchange.state`) with ``spec`` ``"auto"`` and an ``"auto"``
        section: the choice, when it was made and when it is re-checked, the reasons, the residuals
        waiting to be flushed, and every built method's own pipeline state (memory, warm starts)."""
        return {
            "format": FORMAT, "spec": AUTO, "feedback_spec": self.options.feedback,
            "master_spec": self.options.master, "rank": self.rank, "world_size": self.world_size,
            "shapes": {key: list(shape) for key, shape in self.shapes.items()}, "steps": dict(self.steps),
            "feedback": {}, "compressor": {}, "stats": self.stats.state_dict(),
            "auto": {
                "candidates": list(self.auto.candidates), "choice": dict(self.choice),
                "decided_at": self.decided_at,
                "next_decision": None if math.isinf(self.next_decision) else int(self.next_decision),
                "why": _plain(self.why), "flush": {key: t.clone() for key, t in self._flush.items()},
                "pipelines": {spec: _without_stats(p.state_dict()) for spec, p in self._pipelines.items()},
            },
        }

    def own_part(self, state: Any, on_world_size_change: str = "raise") -> dict[str, Any]:
        """:meth:`gradpress.exchange.pipeline.Pipeline.own_part` for an ``"auto"`` state: with ``"reset"``, a state of
        another world size keeps the choice, the step counters, shapes, this rank's statistics and each
        method's shared state, drops every method's error-feedback memory and the residuals waiting to
        be sent, and decides again for this world (after measuring the next steps); one
        ``UserWarning`` says what was dropped."""
        part = own_state(state, self.rank, self.world_size, on_world_size_change)
        if on_world_size_change == "raise" or part["world_size"] == self.world_size:
            return part
        out, dropped, kept = resized(part, self.rank, self.world_size, {})
        section = part.get("auto")
        if isinstance(section, dict):
            section = dict(section)
            flush = section.get("flush")
            if isinstance(flush, dict) and flush:
                dropped.append(f"the residuals of {len(flush)} tensors waiting to be sent once")
            section["flush"] = {}
            saved = section.get("pipelines")
            if isinstance(saved, dict):
                pipelines = {}
                for spec, sub in saved.items():
                    if spec in self.auto.candidates:  # (else refused when loaded)
                        sub, lost, _ = resized(own_state(sub, self.rank, self.world_size), self.rank,
                                               self.world_size, self._fresh(spec).shared_sections())
                        dropped += [f"{spec}: {what}" for what in lost]
                    pipelines[spec] = sub
                section["pipelines"] = pipelines
            section["next_decision"] = 0  # the choice was made for another n: measure and decide again
            kept.append("the choice of methods until it is made again for this world")
            out["auto"] = section
        warn_resized(part["world_size"], self.world_size, dropped, kept)
        return out

    def load_state_dict(self, state: Any, on_world_size_change: str = "raise") -> None:
        """Restore :meth:`state_dict` (this rank's, or a gathered one); everything is checked first, and
        a ``ValueError`` names what does not fit (another method, rank or world size; a choice outside
        the candidates; a memory of the wrong shape or holding NaN/Inf). ``on_world_size_change``: see
        :meth:`own_part`."""
        from gradpress.exchange.state import _check_keyed

        state = self.own_part(state, on_world_size_change)
        for name, value in (("spec", AUTO), ("world_size", self.world_size), ("rank", self.rank)):
            if state[name] != value:
                raise ValueError(f"gradpress state: {name} is {state[name]!r}, this runtime's is {value!r}")
        section = state.get("auto")
        if not isinstance(section, dict):
            raise ValueError("gradpress state: an 'auto' state needs its 'auto' section")
        shapes = shapes_of(state)
        steps = state["steps"]
        if not isinstance(steps, dict) or not all(isinstance(k, str) and isinstance(v, int) and v >= 0
                                                  and not isinstance(v, bool) for k, v in steps.items()):
            raise ValueError("gradpress state: steps must map each key to an integer >= 0")
        choice = section.get("choice")
        if not isinstance(choice, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in choice.items()):
            raise ValueError("gradpress state: auto.choice must map keys to specs")
        outside = sorted({v for v in choice.values() if v not in self.auto.candidates})
        if outside:
            raise ValueError(f"gradpress state: auto.choice uses {', '.join(map(repr, outside))}, not among "
                             f"this runtime's candidates {list(self.auto.candidates)}")
        flush = section.get("flush", {})
        _check_keyed("auto.flush", {"flush": flush}, shapes)
        decided_at, next_decision = section.get("decided_at"), section.get("next_decision")
        for name, given in (("decided_at", decided_at), ("next_decision", next_decision)):
            if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 0):
                raise ValueError(f"gradpress state: auto.{name} must be a step (an integer >= 0) or None")
        saved = section.get("pipelines")
        if not isinstance(saved, dict) or not all(isinstance(s, str) for s in saved):
            raise ValueError("gradpress state: auto.pipelines must map specs to pipeline states")
        pipelines = {}
        for spec, sub in saved.items():
            if spec not in self.auto.candidates:
                raise ValueError(f"gradpress state: auto.pipelines holds {spec!r}, not among this runtime's "
                                 f"candidates {list(self.auto.candidates)}")
            pipeline = self._fresh(spec)
            pipeline.stats = Stats()  # (the statistics are this state's own, loaded below)
            pipeline.load_state_dict(_without_stats(sub))  # checked (gradpress.exchange.state.check): ValueError
            pipelines[spec] = pipeline
        stats = state.get("stats")  # (absent from a state saved before statistics were: they start from zero)
        if stats is not None:
            Stats.check_state(stats)
        # everything checked: load
        self.steps.clear()
        self.steps.update(steps)
        self.shapes.clear()
        self.shapes.update(shapes)
        self._expected_shapes = dict(shapes)
        self.stats.load_state_dict(stats if stats is not None else Stats().state_dict())
        for pipeline in pipelines.values():
            pipeline.steps, pipeline.shapes, pipeline._expected_shapes = self.steps, self.shapes, {}
            pipeline.stats = self.stats
        self._pipelines = pipelines
        self.pipeline(UNCOMPRESSED)
        self.choice = dict(choice)
        self._flush = {key: t.clone() for key, t in flush.items()}
        self.decided_at = decided_at
        self.next_decision = math.inf if next_decision is None else next_decision
        self.why = dict(section.get("why") or {})
        self._records.clear()
        self._arrivals.clear()
        self._current_step = -1
        self._costs, self._costs_layout, self._captured = None, None, None


def _without_stats(state: Any) -> Any:
    """A method's pipeline state without its statistics (they are the ``"auto"`` state's, shared)."""
    return {k: v for k, v in state.items() if k != "stats"} if isinstance(state, dict) else state


def _chain(protocols: Sequence[Protocol]) -> Protocol:
    for protocol in protocols:
        yield from protocol


def _plain(value: Any) -> Any:
    """``value`` with inf as None (a state dict of plain values)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
