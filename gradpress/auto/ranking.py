"""The decision as a pure function (:func:`choose`): a method and a level per bucket for the shortest
predicted time to a quality target (or step), from a profile, the candidates' measured costs and, where
given, their measured compression errors."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

from gradpress.auto.options import FALLBACK_LATENCY, NODE, UNCOMPRESSED, level_of, method_of

if TYPE_CHECKING:
    from gradpress.costmodel import BucketStep, CompressionError, ComputeProfile, MethodCost, Topology


@dataclass(frozen=True)
class Decision:
    """What :func:`choose` decided: a name per bucket (a spec, ending in ``@node`` where the bucket runs
    in two levels), the predicted step with it (``predicted_s``), with every bucket uncompressed
    (``uncompressed_s``), with the methods in use before (``current_s``), with each bucket alone
    uncompressed (``bucket_uncompressed_s``), with each name on every bucket (``uniform_s``);
    ``factor``: the chosen methods' steps to the target over the exact mean's
    (:func:`gradpress.costmodel.steps_factor`; 1 ranking by step time); ``levels_s``: per bucket, the
    predicted step with its method flat and in two levels (empty on one node)."""

    specs: tuple[str, ...]
    predicted_s: float
    uncompressed_s: float
    current_s: float
    bucket_uncompressed_s: tuple[float, ...]
    uniform_s: dict[str, float] = field(default_factory=dict)
    factor: float = 1.0
    levels_s: tuple[tuple[float, float], ...] = ()

    @property
    def target_s(self) -> float:
        """The predicted time to the quality target, in uncompressed steps' units: step × factor."""
        return self.predicted_s * self.factor


class _Pricer:
    """Prices an assignment of names to buckets: its step (:func:`gradpress.costmodel.predict_levels`)
    and its steps factor (:func:`gradpress.costmodel.steps_factor`)."""

    def __init__(self, profile: ComputeProfile, costs: Sequence[MethodCost], n: int, bandwidth: float | str,
                 latency: float, topology: Topology | None,
                 errors: Mapping[str, Sequence[CompressionError]] | None, signal: float) -> None:
        from gradpress.costmodel import priced_steps

        self.profile, self.n, self.bandwidth, self.latency, self.topology = profile, n, bandwidth, latency, topology
        self.steps: dict[tuple[str, bool], list[BucketStep]] = priced_steps(profile, costs, n, topology)
        self.errors, self.signal = errors, signal
        self.local_size = topology.local_size if topology is not None else 1

    def step(self, names: Sequence[str]) -> float:
        from gradpress.costmodel import predict_levels

        levels = [level_of(name) for name in names]
        steps = [self.steps[(method_of(name), two)][b] for b, (name, two) in enumerate(zip(names, levels, strict=True))]
        return predict_levels(self.profile, steps, levels, n=self.n, bandwidth=self.bandwidth,
                              latency=self.latency, topology=self.topology).total

    def factor(self, names: Sequence[str]) -> float:
        from gradpress.costmodel import steps_factor

        if self.errors is None:
            return 1.0
        errors = [self.errors[method_of(name)][b] for b, name in enumerate(names)]
        sizes = [self.local_size if level_of(name) else 1 for name in names]  # a node compresses k ranks' sum
        return steps_factor(errors, signal=self.signal, local_sizes=sizes)

    def objective(self, names: Sequence[str]) -> float:
        return self.step(names) * self.factor(names)


def choose(profile: ComputeProfile, costs: Sequence[MethodCost], *, n: int, bandwidth: float | str,
           latency: float = FALLBACK_LATENCY, current: Sequence[str] | None = None,
           margin: float = 0.05, passes: int = 2,
           errors: Mapping[str, Sequence[CompressionError]] | None = None,
           topology: Topology | None = None, levels: Sequence[bool] | None = None,
           signal: float = 0.0) -> Decision:
    """The methods (and levels) per bucket for the shortest predicted time to a quality target among
    ``n`` workers on a link of ``bandwidth`` bits/s and ``latency`` s per message: the predicted step
    (:func:`gradpress.costmodel.predict_levels`) times the steps factor of the methods' measured
    ``errors`` (spec -> a :class:`~gradpress.costmodel.CompressionError` per bucket;
    :func:`gradpress.costmodel.steps_factor`: 1/δ for error feedback, 1 + ω/(1 − ρ) for unbiased methods,
    ρ the gradient's ``signal`` fraction, :func:`gradpress.costmodel.signal_fraction`). Without
    ``errors``: the shortest predicted step.

    ``topology`` (N nodes of k ranks, :class:`~gradpress.costmodel.Topology`): each method is priced flat
    and in two levels (the name ``spec@node``), ``levels`` restricting them (``(True,)``: two levels
    only); None: one level, a star of n links.

    Starts from the best single name, then changes one bucket's name at a time while that shortens
    the objective (``passes`` rounds over the buckets). ``current`` (a name per bucket; default: every
    bucket the reference, ``none`` on the first level) is kept unless the best is predicted faster by
    more than ``margin`` of its objective (timings on a shared machine vary: a switch must pay clearly).
    ``costs`` must include ``none``."""
    by_spec = {c.spec: c for c in costs}
    if UNCOMPRESSED not in by_spec:
        raise ValueError(f"choose needs the cost of {UNCOMPRESSED!r} (the reference)")
    nb = len(profile.buckets)
    for cost in costs:
        if len(cost.buckets) != nb:
            raise ValueError(f"{cost.spec}: costs of {len(cost.buckets)} buckets for a profile of {nb}")
    two_levels = topology is not None and topology.nodes > 1 and topology.local_size > 1
    allowed = tuple(levels) if levels is not None else ((False, True) if two_levels else (False,))
    if any(allowed) and not two_levels:
        raise ValueError("two-level candidates need a topology of several nodes of several ranks")
    names = [spec + (NODE if two else "") for two in allowed for spec in by_spec
             if errors is None or spec in errors]
    reference = UNCOMPRESSED + (NODE if allowed[0] else "")
    pricer = _Pricer(profile, costs, n, bandwidth, latency, topology, errors, signal)
    uniform = {name: pricer.step([name] * nb) for name in names}
    best = _improved(pricer, names, nb, reference, passes)
    best_t = pricer.objective(best)
    now = [s if s in names else reference for s in current] if current is not None else [reference] * nb
    if len(now) != nb:
        now = [reference] * nb
    if not best_t < pricer.objective(now) * (1 - margin):
        best = now
    alone = tuple(pricer.step([*best[:b], reference, *best[b + 1:]]) for b in range(nb))
    levels_s: tuple[tuple[float, float], ...] = ()
    if two_levels:
        levels_s = tuple((pricer.step([*best[:b], method_of(best[b]), *best[b + 1:]]),
                          pricer.step([*best[:b], method_of(best[b]) + NODE, *best[b + 1:]])) for b in range(nb))
    return Decision(tuple(best), pricer.step(best), uniform.get(reference, pricer.step([reference] * nb)),
                    pricer.step(now), alone, uniform, pricer.factor(best), levels_s)


def _improved(pricer: _Pricer, names: Sequence[str], nb: int, reference: str, passes: int) -> list[str]:
    """The best single name on every bucket, then one bucket's name changed at a time while the
    objective falls (``passes`` rounds)."""
    single = {name: pricer.objective([name] * nb) for name in names}
    best_name = min(single, key=lambda s: (single[s], s != reference))
    best, best_t = [best_name] * nb, single[best_name]
    for _ in range(passes):
        improved = False
        for b in range(nb):
            for name in names:
                if name == best[b]:
                    continue
                trial = [*best[:b], name, *best[b + 1:]]
                objective = pricer.objective(trial)
                if objective < best_t * (1 - 1e-9):
                    best, best_t, improved = trial, objective, True
        if not improved:
            break
    return best
