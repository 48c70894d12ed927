"""``advise --check``: measured runs (``gradpress compare``) beside the prediction for their method, n and
link rate (see :mod:`gradpress.testbed.advise`)."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from gradpress import costmodel
from gradpress.costmodel.method import BASELINE, MethodCost
from gradpress.testbed.advise.advice import Advice
from gradpress.testbed.advise.profile import ComputeProfile
from gradpress.testbed.advise.ranking import predict
from gradpress.testbed.results import HIERARCHICAL


@dataclass(frozen=True)
class Checked:
    """A measured method (``gradpress compare``: one run, or the median of its repeated runs) beside the
    prediction for its method, n and link rate. ``noop`` is checked against the profile's compute
    (forward + backward + optimizer), or its local step with ``--local-workers``.
    ``measured_low``/``measured_high``: the fastest and slowest of the ``runs`` runs' mean steps.
    ``overhead_s``: a run's mean step less its own mean compute (what the method adds: exposed
    communication, compression; the median over the runs), ``overhead_rank`` its rank among the methods:
    where the compute drifts between runs by more than the methods differ, this orders what the methods
    change. ``nodes``: the runs' nodes (``workers`` ranks in all); ``spec`` ends in ``@node`` for runs
    that exchanged in two levels on several nodes."""

    spec: str
    workers: int
    bandwidth: str
    predicted_s: float
    measured_s: float
    predicted_rank: int | None
    measured_rank: int | None
    with_noop_s: float | None = None
    burst: float = 0.0
    efficiency: dict[str, float] = field(default_factory=dict)
    latency: float | None = None
    runs: int = 1
    measured_low: float | None = None
    measured_high: float | None = None
    overhead_s: float | None = None
    overhead_rank: int | None = None
    nodes: int = 1

    @property
    def relative_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def with_noop_error(self) -> float | None:
        return None if self.with_noop_s is None else (self.with_noop_s - self.measured_s) / self.measured_s


def scaled(profile: ComputeProfile, compute_s: float) -> ComputeProfile:
    """``profile`` with forward, backward, optimizer and ready times scaled to a step of ``compute_s``."""
    return profile.scaled(compute_s)


def scaled_cost(cost: MethodCost, factor: float) -> MethodCost:
    """``cost`` as measured (its local step, if any, set aside) with each bucket's compression and decoding
    seconds times ``factor``: the method's CPU work on a machine running ``factor`` times slower."""
    return replace(cost.scaled(factor), local=None)


def check_against(advice: Advice, runs: Sequence[Any], fit_link: bool = True) -> list[Checked]:
    """Every method of ``runs`` (:class:`~gradpress.testbed.results.Run`) run over an emulated link that
    the advice priced (and ``noop``), predicted at the run's n and rate; ranks by samples/s among the
    checked methods (``torch-allreduce`` included). Runs of one method at one n and link (``compare``
    repeated, e.g. ``--check DIR1 DIR2 DIR3``) are one row: the median of their mean steps (as the
    benchmarks take the median of repeated runs: a run slowed throughout by other load on the machine
    moves it least), with the fastest and slowest. Where ``noop`` runs of the same n and link are among
    them, ``with_noop_s`` is the prediction with the profile's compute scaled to their median step
    (``sim cost``'s compute), and each method's compression and decoding by the same factor — or, with
    local steps, each local step scaled by that median over the local ``noop``'s (:func:`_at_noops_speed`):
    it separates the model from a machine that ran its CPU work at another speed while ``compare`` ran
    (another load; its workers sharing the cores, where ``advise`` measured each part alone on an idle one).

    The links are the runs' own (:mod:`~gradpress.costmodel`'s two link terms): the token bucket
    the run recorded (:func:`gradpress.testbed.sim.cost.burst_of`; the testbed's tbf for runs from before
    it was recorded), unless ``advise --burst`` gave one; and, with ``fit_link``, the latency α and each
    strategy's rate beyond the bucket fitted from the runs of the *other* methods on the same n and link
    (:func:`link_from_runs`), so no run of a method enters its prediction (``advise --latency`` where no
    other method communicated); ``advise --efficiency`` overrides the fitted rates per strategy.

    Runs on several nodes are priced on their nodes (:func:`gradpress.testbed.sim.cost.topology_of`: a
    link per node, the advice's intra-node rate inside), flat or in two levels as they ran (a method's
    flat and ``@node`` runs are two rows), with the advice's α: the link fit prices a star of a link per
    worker, so only runs on one node enter it."""
    from gradpress.testbed.sim.cost import burst_of, topology_of

    methods = _methods_run(advice, runs)
    noop = {(workers, bandwidth, nodes): statistics.median(r.mean_step_s for r in repeats)
            for (spec, workers, bandwidth, nodes), repeats in methods.items() if spec == "noop"}
    intra = costmodel.DEFAULT_INTRA_BANDWIDTH if advice.topology is None else advice.topology.intra_bandwidth
    rows = []
    for (label, workers, bandwidth, nodes), repeats in methods.items():
        steps = [r.mean_step_s for r in repeats]
        burst = advice.burst or burst_of(repeats[0])
        latency, overhead = advice.latency, None
        rates: dict[str, float] = {}
        if label == "noop":  # the local noop's step where one was measured, else the profile's compute
            local = advice.local_noop
            predicted, with_noop = (advice.profile.compute_s if local is None else local.step_s), None
        else:
            if fit_link:
                latency, rates = _link_of_others(advice, runs, label, repeats[0], burst)
            rates.update(advice.efficiency)
            common: dict[str, Any] = {"n": workers, "bandwidth": bandwidth, "latency": latency,
                                      "burst": burst, "efficiency": rates,
                                      "topology": topology_of(repeats[0], intra)}
            noop_step_s = noop.get((workers, bandwidth, nodes))
            predicted, with_noop = _predicted(advice, repeats[0].compressor, noop_step_s, common)
            overhead = statistics.median(r.mean_step_s - r.mean_compute_s for r in repeats)
        rows.append(Checked(label, workers, bandwidth, predicted, statistics.median(steps), None, None,
                            with_noop, burst, rates, latency, len(steps), min(steps), max(steps), overhead,
                            nodes=nodes))
    return _ranked(rows)


def _methods_run(advice: Advice, runs: Sequence[Any]) -> dict[tuple[str, int, str, int], list[Any]]:
    """The runs over an emulated link of a method the advice priced (and ``noop``'s), by row: (its label,
    n, link rate, nodes) -> its repeated runs."""
    cost_of = _priced(advice).get
    methods: dict[tuple[str, int, str, int], list[Any]] = {}
    for run in runs:
        if run.bandwidth is not None and (cost_of(run.compressor) is not None or run.compressor == "noop"):
            methods.setdefault((_label(run), run.workers, run.bandwidth, run.nodes), []).append(run)
    return methods


def _link_of_others(advice: Advice, runs: Sequence[Any], label: str, run: Any,
                    burst: float) -> tuple[float, dict[str, float]]:
    """α and each strategy's rate for the row ``label`` of ``run``'s n, link and nodes, fitted from the runs
    of the *other* methods there (:func:`link_from_runs`); the advice's α and no rates where none fits."""
    cost_of = _priced(advice).get
    where = (run.workers, run.bandwidth, run.nodes)
    others = [(r, theirs) for r in runs
              if _label(r) != label and (r.workers, r.bandwidth, r.nodes) == where
              and (theirs := cost_of(r.compressor)) is not None]
    fitted = link_from_runs(advice.profile, others, burst=burst)
    return fitted if fitted is not None else (advice.latency, {})


def _predicted(advice: Advice, spec: str, noop_step_s: float | None,
               common: dict[str, Any]) -> tuple[float, float | None]:
    """The step predicted for method ``spec`` on the link ``common`` describes, and where ``noop`` ran there
    (its median step ``noop_step_s``) the step predicted at the speed it ran at (:func:`_at_noops_speed`)."""
    cost = _priced(advice).get(spec)
    assert cost is not None  # (a method is checked where it was priced)
    predicted = predict(advice.profile, cost, **common).total
    if noop_step_s is None:
        return predicted, None
    return predicted, predict(*_at_noops_speed(advice, cost, noop_step_s), **common).total


def _ranked(rows: list[Checked]) -> list[Checked]:
    """``rows`` with their ranks among the methods (``noop`` is not ranked): by predicted step, by measured
    step and by overhead (a measured step less its compute)."""
    methods = [i for i, row in enumerate(rows) if row.spec != "noop"]

    def ranks(key: Callable[[Checked], float]) -> dict[int, int]:
        return {i: rank for rank, i in enumerate(sorted(methods, key=lambda i: key(rows[i])), start=1)}

    by_prediction = ranks(lambda row: row.predicted_s)
    by_measurement = ranks(lambda row: row.measured_s)
    # (only noop's overhead is None)
    by_overhead = ranks(lambda row: row.overhead_s if row.overhead_s is not None else math.inf)
    return [replace(row, predicted_rank=by_prediction.get(i), measured_rank=by_measurement.get(i),
                    overhead_rank=by_overhead.get(i)) for i, row in enumerate(rows)]


def _label(run: Any) -> str:
    """A run's row: its spec, ``@node`` added where it exchanged in two levels on several nodes."""
    return run.compressor + (HIERARCHICAL if run.nodes > 1 and run.hierarchy == "node" else "")


@dataclass(frozen=True)
class RunsLink:
    """The link a set of ``compare`` runs went through, as the cost model prices it: α ``latency``, the
    token bucket they recorded (``burst`` bytes) and each strategy's rate beyond it (``efficiency``),
    fitted from ``runs`` runs of ``workers`` workers at ``bandwidth``."""

    latency: float
    burst: float
    efficiency: dict[str, float]
    runs: int
    workers: int
    bandwidth: str


def runs_link(advice: Advice, runs: Sequence[Any]) -> RunsLink | None:
    """The link of ``runs`` (``advise --check``'s) for the ranking itself: the token bucket they recorded
    (:func:`gradpress.testbed.sim.cost.burst_of`) and α and the rates fitted from all of them
    (:func:`link_from_runs`; ``advice.latency`` where no rate or α could be fitted), so that the pick is
    made for the link the runs measured and agrees with :func:`check_against`'s predictions (each of
    which leaves its own method's runs out of the fit). None unless every run over an emulated link of a
    method priced here (``torch-allreduce`` included) shares one n, one number of nodes, one link rate and
    one bucket."""
    from gradpress.testbed.sim.cost import burst_of

    costs = _priced(advice)
    priced = [(run, costs[run.compressor]) for run in runs
              if run.bandwidth is not None and run.compressor in costs]
    if not priced or len({(run.workers, run.nodes, run.bandwidth, burst_of(run)) for run, _ in priced}) != 1:
        return None
    first = priced[0][0]
    burst = burst_of(first)
    fitted = link_from_runs(advice.profile, priced, burst=burst)
    latency, rates = fitted if fitted is not None else (advice.latency, {})
    return RunsLink(latency, burst, dict(rates), len(priced), first.workers, first.bandwidth)


def _priced(advice: Advice) -> dict[str, MethodCost]:
    """Each method the advice priced by its spec, ``torch-allreduce`` (its reference) included."""
    return {**{c.spec: c for c in advice.costs}, BASELINE: advice.reference}


def _at_noops_speed(advice: Advice, cost: MethodCost, noop_step_s: float) -> tuple[ComputeProfile, MethodCost]:
    """The profile and ``cost`` of a machine running as fast as it ran ``compare``'s ``noop`` (its mean
    step ``noop_step_s``): with a local step (``--local-workers``), every time of it scaled by the ratio of
    that step to the local ``noop``'s; without one, the profile's compute scaled to that step and the
    method's compression and decoding by the same factor."""
    if cost.local is not None and advice.local_noop is not None:
        return advice.profile, replace(cost, local=cost.local.scaled(noop_step_s / advice.local_noop.step_s))
    slower = noop_step_s / advice.profile.compute_s
    return scaled(advice.profile, noop_step_s), scaled_cost(cost, slower)


def link_from_runs(profile: ComputeProfile, runs: Sequence[tuple[Any, MethodCost]], *,
                   burst: float) -> tuple[float, dict[str, float]] | None:
    """α and each strategy's rate beyond the token bucket, as a fraction of the link's, fitted from
    measured runs of one link, each with the method's priced costs
    (:func:`~gradpress.costmodel.fit_link`): a run's mean time in collectives per step against
    its collectives' messages and the bytes they carry beyond the tokens its idle time per step
    (step − communication) refilled. Only runs whose bytes beyond the bucket are at least the bucket
    inform the rates: a rate shows in bytes that wait for tokens, and the few milliseconds of a smaller
    remainder are lost among what else a measured collective waits for (the other rank's compute and
    compression). None without a run of 2+ workers on one node that communicated (the fit prices a star of
    a link per worker)."""
    observations, bandwidths = [], set()
    for run, cost in runs:
        if run.workers < 2 or run.bandwidth is None or run.mean_comm_s <= 0 or run.nodes > 1:
            continue
        phases = [phase for step in cost.steps(profile, run.workers) for phase in step.phases]
        if not phases:
            continue
        idle = max(0.0, run.mean_step_s - run.mean_comm_s)
        tokens = costmodel.refill(0.0, idle, run.bandwidth, burst)
        observations.append(costmodel.Observation(phases, run.workers, run.mean_comm_s, tokens))
        bandwidths.add(run.bandwidth)
    if len(bandwidths) != 1:
        return None
    try:
        return costmodel.fit_link(observations, bandwidths.pop(), min_excess=burst)
    except ValueError:
        return None


def render_checks(checks: Sequence[Checked]) -> Any:
    from rich.table import Table

    table = Table(title="predicted against measured (compare's mean steady-state step, the median over repeated "
                        "runs; ranks by samples/s among these methods; noop: the profile's compute or its local step)")
    noop = any(c.with_noop_s is not None for c in checks)
    columns = ["method", "n", "link", "bucket", "α ms, rates (others' fit)", "predicted ms", "measured ms",
               "error", "rank pred.", "rank meas.", "meas. step − compute ms (rank)"]
    if noop:
        columns += ["pred. with noop's compute", "error"]
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right",
                         no_wrap=column == "method")
    for c in checks:
        rates = ", ".join([f"{(c.latency or 0.0) * 1e3:.2g}",
                           *(f"{k} {v:.2f}" for k, v in sorted(c.efficiency.items()))])
        ranks = str(c.workers) if c.nodes == 1 else f"{c.nodes}×{c.workers // c.nodes}"
        cells = [c.spec, ranks, c.bandwidth, f"{c.burst / 1024:.0f} KiB" if c.burst else "none",
                 rates if c.spec != "noop" else "", f"{c.predicted_s * 1e3:.1f}",
                 _measured(c), f"{c.relative_error:+.1%}", str(c.predicted_rank or ""),
                 str(c.measured_rank or ""),
                 "" if c.overhead_s is None else f"{c.overhead_s * 1e3:.1f} ({c.overhead_rank})"]
        if noop:
            cells += ["", ""] if c.with_noop_s is None else [f"{c.with_noop_s * 1e3:.1f}",
                                                             f"{c.with_noop_error:+.1%}"]
        table.add_row(*cells)
    return table


def _measured(c: Checked) -> str:
    """The measured step in ms (the median run's), with the fastest and slowest run's where there were several."""
    if c.runs < 2 or c.measured_low is None or c.measured_high is None:
        return f"{c.measured_s * 1e3:.1f}"
    return f"{c.measured_s * 1e3:.1f} ({c.measured_low * 1e3:.1f}–{c.measured_high * 1e3:.1f}, {c.runs} runs)"
