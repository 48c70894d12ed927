"""``advise --check``: measured runs (``gradpress compare``) beside the prediction for their method, n and
link rate (see :mod:`gradpress.testbed.advise`)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from gradpress.testbed.advise.advice import Advice
from gradpress.testbed.advise.costs import BASELINE, baseline_cost
from gradpress.testbed.advise.profile import ComputeProfile
from gradpress.testbed.advise.ranking import predict


@dataclass(frozen=True)
class Checked:
    """A measured run (``gradpress compare``) beside the prediction for its method, n and link rate.
    ``noop`` is checked against the profile's compute (forward + backward + optimizer)."""

    spec: str
    workers: int
    bandwidth: str
    predicted_s: float
    measured_s: float
    predicted_rank: int | None
    measured_rank: int | None
    with_noop_s: float | None = None

    @property
    def relative_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s

    @property
    def with_noop_error(self) -> float | None:
        return None if self.with_noop_s is None else (self.with_noop_s - self.measured_s) / self.measured_s


def scaled(profile: ComputeProfile, compute_s: float) -> ComputeProfile:
    """``profile`` with forward, backward, optimizer and ready times scaled to a step of ``compute_s``."""
    k = compute_s / profile.compute_s
    return replace(profile, forward_s=profile.forward_s * k, backward_s=profile.backward_s * k,
                   optimizer_s=profile.optimizer_s * k,
                   buckets=tuple(replace(b, ready_s=b.ready_s * k) for b in profile.buckets))


def check_against(advice: Advice, runs: Sequence[Any]) -> list[Checked]:
    """Every run of ``runs`` (:class:`~gradpress.testbed.results.Run`) over an emulated link whose method
    the advice priced (and ``noop``), predicted at the run's n and rate; ranks by samples/s among the
    checked runs (``torch-allreduce`` included). Where a ``noop`` run of the same n and link is among them,
    ``with_noop_s`` is the prediction with the profile's compute scaled to that run's step (``sim cost``'s
    compute): it separates the communication and compression model from a machine that computed at
    another speed while ``compare`` ran."""
    by_spec = {c.spec: c for c in advice.costs}
    base = baseline_cost(advice.profile)
    noop = {(run.workers, run.bandwidth): run.mean_step_s for run in runs if run.compressor == "noop"}
    rows = []
    for run in runs:
        priced = run.compressor in by_spec or run.compressor in (BASELINE, "noop")
        if run.bandwidth is None or not priced:
            continue
        compute = noop.get((run.workers, run.bandwidth))
        if run.compressor == "noop":
            predicted, with_noop = advice.profile.compute_s, None
        else:
            cost = base if run.compressor == BASELINE else by_spec[run.compressor]
            common = {"n": run.workers, "bandwidth": run.bandwidth, "latency": advice.latency}
            predicted = predict(advice.profile, cost, **common).total
            with_noop = (None if compute is None
                         else predict(scaled(advice.profile, compute), cost, **common).total)
        rows.append((run.compressor, run.workers, run.bandwidth, predicted, run.mean_step_s, with_noop))
    ranked = [r for r in rows if r[0] != "noop"]
    by_prediction = {r[:3]: i for i, r in enumerate(sorted(ranked, key=lambda r: r[3]), start=1)}
    by_measurement = {r[:3]: i for i, r in enumerate(sorted(ranked, key=lambda r: r[4]), start=1)}
    return [Checked(*r[:5], by_prediction.get(r[:3]), by_measurement.get(r[:3]), r[5]) for r in rows]


def render_checks(checks: Sequence[Checked]) -> Any:
    from rich.table import Table

    table = Table(title="predicted against measured (compare's mean steady-state step; ranks by samples/s "
                        "among these runs; noop: the profile's compute)")
    noop = any(c.with_noop_s is not None for c in checks)
    columns = ["method", "n", "link", "predicted ms", "measured ms", "error", "rank pred.", "rank meas."]
    if noop:
        columns += ["pred. with noop's compute", "error"]
    for column in columns:
        table.add_column(column, justify="left" if column == "method" else "right",
                         no_wrap=column == "method")
    for c in checks:
        cells = [c.spec, str(c.workers), c.bandwidth, f"{c.predicted_s * 1e3:.1f}",
                 f"{c.measured_s * 1e3:.1f}", f"{c.relative_error:+.1%}", str(c.predicted_rank or ""),
                 str(c.measured_rank or "")]
        if noop:
            cells += ["", ""] if c.with_noop_s is None else [f"{c.with_noop_s * 1e3:.1f}",
                                                             f"{c.with_noop_error:+.1%}"]
        table.add_row(*cells)
    return table
