"""The whole advice (see :mod:`gradpress.testbed.advise`): the candidates, then profile, costs, quality
runs and rankings at every link speed in one :class:`Advice`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

from gradpress import costmodel
from gradpress.costmodel.method import BASELINE, LocalStep, MethodCost, baseline_cost, measure_method
from gradpress.testbed import arguments
from gradpress.testbed.advise.profile import ComputeProfile, profile_compute
from gradpress.testbed.advise.quality import (
    QUALITY_REFERENCE,
    QualityCurve,
    quality_curve,
    quality_target,
    steps_to_reach,
)
from gradpress.testbed.advise.ranking import Ranked, crossover, rank, variants
from gradpress.testbed.advise.workload import Workload

#: besides every registered method at its defaults, these fractions of the sparsifiers
RATIO_VARIANTS: dict[str, tuple[str, ...]] = {"topk": ("0.1", "0.001"), "randomk": ("0.1", "0.001")}
#: the README's demo set (``gradpress compare --compressors demo``), without PyTorch's own hooks
DEMO = ("none", "fp16", "topk:ratio=0.01", "qsgd", "natural", "thc", "powersgd")
Progress = Callable[[str], None]
#: measures the real local steps of the specs given: (spec -> step, spec -> why it was not measured)
LocalSteps = Callable[[Sequence[str]], tuple[Mapping[str, LocalStep], Mapping[str, str]]]


def _quiet(_: str) -> None:
    pass


def default_candidates() -> list[str]:
    """Every registered method at its default spec, and :data:`RATIO_VARIANTS`."""
    import gradpress

    specs = []
    for name in gradpress.compressor_names():
        specs.append(name)
        specs += [f"{name}:ratio={ratio}" for ratio in RATIO_VARIANTS.get(name, ())]
    return specs


def demo_candidates() -> list[str]:
    return list(DEMO)


#: the keywords of advise's ``--compressors`` list
KEYWORDS = {"default": default_candidates, "demo": demo_candidates}


def candidates(specs: list[str]) -> list[str]:
    """The methods to rank: ``specs`` but the baseline (it is measured anyway)."""
    return [spec for spec in specs if spec != BASELINE]


@dataclass
class Advice:
    """Everything ``advise`` found: the profile, each method's costs, the rankings per link speed,
    where each method stops paying (by ranked label), and the quality runs (if any). ``topology``: the
    ``workers`` on N nodes of k ranks, where each method is ranked flat and in two levels
    (:func:`~gradpress.testbed.advise.ranking.variants`); None: a star of a link per worker."""

    workload: str
    source: str
    workers: int
    latency: float
    bandwidths: list[str]
    profile: ComputeProfile
    costs: list[MethodCost]
    rankings: dict[str, list[Ranked]]
    crossovers: dict[str, float]
    skipped: dict[str, str] = field(default_factory=dict)
    quality: list[QualityCurve] = field(default_factory=list)
    target: float | None = None
    steps_to_target: dict[str, float | None] | None = None
    quality_note: str | None = None
    measure_seconds: float = 0.0
    burst: float = 0.0
    efficiency: dict[str, float] = field(default_factory=dict)
    baseline: MethodCost | None = None
    local_noop: LocalStep | None = None
    topology: costmodel.Topology | None = None

    @property
    def reference(self) -> MethodCost:
        """``torch-allreduce``'s cost: with its local step where one was measured."""
        return self.baseline or baseline_cost(self.profile)

    def best(self, bandwidth: str) -> Ranked:
        return self.rankings[bandwidth][0]

    def relinked(self, *, latency: float, burst: float = 0.0,
                 efficiency: Mapping[str, float] | None = None) -> Advice:
        """The same measurements priced through other links (α ``latency``, a token bucket of ``burst``
        bytes, ``efficiency`` per strategy): the rankings at every bandwidth and where each method stops
        paying, anew (a pure function of what was measured)."""
        link: dict[str, Any] = {"latency": latency, "burst": burst, "efficiency": dict(efficiency or {})}
        rankings = {bw: rank(self.profile, self.costs, n=self.workers, bandwidth=bw,
                             steps_to_target=self.steps_to_target, baseline=self.reference,
                             topology=self.topology, **link)
                    for bw in self.bandwidths}
        crossings = {label: crossover(self.profile, cost, n=self.workers, baseline=self.reference,
                                      topology=where, **link)
                     for label, cost, where in variants(self.costs, self.topology, self.reference)
                     if label != BASELINE}
        return replace(self, rankings=rankings, crossovers=crossings, **link)

    def variants(self) -> list[tuple[str, MethodCost, costmodel.Topology | None]]:
        """What is ranked (:func:`~gradpress.testbed.advise.ranking.variants`), ``torch-allreduce`` first."""
        return variants(self.costs, self.topology, self.reference)


def advise(workload: Workload, specs: Sequence[str], *, workers: int = 2,
           bandwidths: Sequence[str] = ("100mbit",), latency: float = costmodel.DEFAULT_LATENCY,
           repeats: int = 5, quality_steps: int | None = None, quality_workers: int | None = None,
           tolerance: float | None = None, bucket_cap_mb: float = 25.0, seed: int = 0, threads: int = 1,
           progress: Progress = _quiet, use_ddp: bool = True, burst: float = 0.0,
           efficiency: Mapping[str, float] | None = None, local: LocalSteps | None = None,
           topology: costmodel.Topology | None = None) -> Advice:
    """Profile ``workload``, measure every spec, rank them at every bandwidth (package doc) through links
    with a token bucket of ``burst`` bytes and ``efficiency`` per strategy
    (:mod:`~gradpress.costmodel`; default: a plain link at its rate); with a ``topology`` (its
    ``workers`` = ``workers``), on N nodes of k ranks, flat and in two levels. A spec that fails to
    measure is left out with its reason (``Advice.skipped``). ``local``: measures the real local steps of
    the specs it is given (``--local-workers``, :func:`~gradpress.testbed.advise.local.measure_local_steps`),
    which then price each method, ``torch-allreduce`` and ``noop`` included
    (:func:`~gradpress.testbed.advise.ranking.calibrated`); a method it could not measure is priced
    as measured here, with the reason in ``skipped``."""
    if topology is not None and topology.workers != workers:
        raise ValueError(f"{workers} workers on {topology.nodes} nodes of {topology.local_size}: "
                         f"{topology.workers} ranks")
    started = time.perf_counter()
    simulated = min(2, workers)
    progress("profiling compute and DDP's buckets")
    profile, grads = profile_compute(workload, repeats=repeats, workers=simulated,
                                     bucket_cap_mb=bucket_cap_mb, seed=seed, threads=threads, use_ddp=use_ddp)
    costs, skipped = [], {}
    for spec in specs:
        progress(f"measuring {spec}")
        try:
            costs.append(measure_method(spec, profile, grads, repeats=max(1, repeats - 2), seed=seed))
        except Exception as error:  # noqa: BLE001 - one method that fails is reported, the others ranked
            skipped[spec] = f"{type(error).__name__}: {arguments.one_line(error)}"[:300]
    curves, target, to_target, note = [], None, None, None
    if quality_steps:
        if workload.quality_unavailable is not None or workload.evaluate is None:
            note = (f"--quality-steps skipped: {workload.quality_unavailable}; "
                    "ranked by predicted step time alone")
        else:
            curves = _quality_runs(workload, [c.spec for c in costs], quality_steps,
                                   quality_workers or min(workers, 4), seed, skipped, progress)
            target = quality_target(curves[0], tolerance)
            to_target = {c.spec: steps_to_reach(c, target) for c in curves}
            to_target[BASELINE] = to_target[QUALITY_REFERENCE]
            costs = [c for c in costs if c.spec in to_target]
    base, noop = baseline_cost(profile), None
    if local is not None:
        progress("measuring each method's real step with the local workers")
        steps, failed = local([c.spec for c in costs] + [BASELINE, "noop"])
        costs = [replace(c, local=steps.get(c.spec)) for c in costs]
        base, noop = baseline_cost(profile, steps.get(BASELINE)), steps.get("noop")
        skipped.update({spec: f"priced without its local step: {why}" for spec, why in failed.items()})
    measured = Advice(workload.label, workload.source, workers, latency, list(bandwidths), profile, costs, {}, {},
                      skipped, curves, target, to_target, note, time.perf_counter() - started, baseline=base,
                      local_noop=noop, topology=topology)
    return measured.relinked(latency=latency, burst=burst, efficiency=efficiency)


def _quality_runs(workload: Workload, measured: Sequence[str], steps: int, workers: int, seed: int,
                  skipped: dict[str, str], progress: Progress) -> list[QualityCurve]:
    """:func:`quality_curve` of ``none`` (first: the reference) and of every measured method; a method
    whose run fails is left out with its reason in ``skipped`` (the reference's failure is raised)."""
    curves = []
    for spec in [QUALITY_REFERENCE] + [s for s in measured if s != QUALITY_REFERENCE]:
        progress(f"training {spec} for {steps} steps with {workers} simulated workers")
        try:
            curves.append(quality_curve(workload, spec, workers=workers, steps=steps, seed=seed))
        except Exception as error:  # noqa: BLE001 - e.g. NonFiniteError: the run diverged
            if spec == QUALITY_REFERENCE:
                raise
            skipped[spec] = f"quality run failed: {type(error).__name__}: {arguments.one_line(error)}"[:300]
    return curves
