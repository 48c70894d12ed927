"""``gradpress sim cost``: the α–β model of :mod:`gradpress.costmodel` checked against measured
runs (``gradpress compare``'s results), carried to other n and link rates, and where each method stops
paying (see :mod:`gradpress.testbed.sim`)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradpress
from gradpress import costmodel
from gradpress.costmodel import Breakdown, Observation, Phase
from gradpress.testbed.results import Run, load_runs

#: the strategy of each reference row of ``gradpress train`` (None: no communication)
REFERENCE_STRATEGIES: dict[str, str | None] = {"torch-allreduce": "allreduce", "torch-fp16": "allreduce",
                                               "torch-powersgd": "allreduce", "noop": None}


def strategy_of(run: Run) -> str | None:
    """How ``run``'s bytes travel (:data:`~gradpress.costmodel.STRATEGIES`), None for ``noop``."""
    if run.compressor in REFERENCE_STRATEGIES:
        return REFERENCE_STRATEGIES[run.compressor]
    mode = (run.info.get("options") or {}).get("mode", "collective")
    if mode in ("ps", "switch"):
        return "gather-broadcast"  # the runtime's server modes on Gloo: gather at the root, tree broadcast
    return gradpress.make(run.compressor).exchange


def _phases(strategy: str | None, nbytes: float) -> list[Phase]:
    return [] if strategy is None else [Phase(strategy, nbytes)]


def link_phases(run: Run, strategy: str | None, nbytes: float, workers: int) -> list[Phase]:
    """What carries ``nbytes`` of ``run``'s packets per worker among ``workers``: for a gradpress method
    in its collective mode, the bytes on the link by the rule ``advise`` prices with
    (:func:`gradpress.costmodel.method.link_phases`: THC's 4-bit packet is all-reduced as 8-bit sums,
    twice its bytes); otherwise (PyTorch's hooks, a server mode, another ``strategy``) one
    :class:`Phase` of ``strategy`` on the packet bytes."""
    if (strategy is not None and run.compressor not in REFERENCE_STRATEGIES
            and strategy == strategy_of(run) and strategy in ("allreduce", "allgather")):
        from gradpress.costmodel.method import link_phases as priced

        return priced(run.compressor, nbytes, workers)
    return _phases(strategy, nbytes)


def burst_of(run: Run) -> float:
    """The token bucket (bytes) of ``run``'s links: what it recorded (``info["network"]["burst_bytes"]``,
    :meth:`gradpress.testbed.netem.Star.settings`), else, for a run over the emulated star, the tbf burst
    the testbed has always built it with (:data:`gradpress.testbed.netem.BURST`); 0 over loopback."""
    from gradpress.testbed import netem

    if run.bandwidth is None:
        return 0.0
    network = run.info.get("network") or {}
    if "burst_bytes" in network:
        return float(network["burst_bytes"])
    return netem.size_bytes(network.get("burst", netem.BURST))


def compute_time(run: Run, runs: Sequence[Run]) -> tuple[float, str]:
    """Seconds of ``run``'s step without communication or compression, and where the figure comes from:
    the mean step of a ``noop`` run of the same model, data, workers and batch (preferably over the same
    link), else ``run``'s step − compression − communication (package doc)."""
    same = [r for r in runs if r.compressor == "noop" and (r.model, r.data, r.workers) ==
            (run.model, run.data, run.workers) and r.info.get("batch_size") == run.info.get("batch_size")]
    same.sort(key=lambda r: r.bandwidth != run.bandwidth)
    if same:
        return same[0].mean_step_s, "noop"
    return max(0.0, run.mean_step_s - run.mean_compress_s - run.mean_comm_s), "own"


@dataclass(frozen=True)
class Prediction:
    """The α–β prediction for one run at ``workers`` workers and ``bandwidth``: ``sequential`` (compute,
    compression and communication one after the other) and ``overlapped`` (communication hidden behind
    compute), :func:`~gradpress.costmodel.predict_step_time`'s two bounds."""

    label: str
    workers: int
    bandwidth: str
    strategy: str | None
    compute_source: str
    nbytes: float
    latency: float
    sequential: Breakdown
    overlapped: Breakdown
    samples_per_step: float

    @property
    def samples_per_s(self) -> float:
        return self.sequential.samples_per_s(self.samples_per_step)


@dataclass(frozen=True)
class Check:
    """A prediction beside a measured mean step: a run's at its own n and link rate (``basis``
    ``"itself"``), or another run's of the same compressor and model carried over to this one's n and
    link rate (``basis`` names the setting it was measured in)."""

    prediction: Prediction
    measured_s: float
    measured_comm_s: float
    basis: str = "itself"

    @property
    def relative_error(self) -> float:
        """(predicted − measured) / measured, of the sequential prediction."""
        return (self.prediction.sequential.total - self.measured_s) / self.measured_s

    @property
    def within_bounds(self) -> bool:
        return self.prediction.overlapped.total <= self.measured_s <= self.prediction.sequential.total


def predict(run: Run, runs: Sequence[Run], workers: int, bandwidth: str, latency: float,
            strategy: str | None = "auto") -> Prediction:
    """``run``'s step at ``workers`` and ``bandwidth`` (``strategy``: ``"auto"`` = :func:`strategy_of`)."""
    strategy = strategy_of(run) if strategy == "auto" else strategy
    base, source = compute_time(run, runs)
    phases = link_phases(run, strategy, run.bytes_per_step, workers)
    common: dict[str, Any] = {"n": workers, "bandwidth": bandwidth, "latency": latency,
                              "burst": burst_of(run)}
    per_worker = run.steps[-1].samples / run.workers
    return Prediction(run.compressor, workers, bandwidth, strategy, source, run.bytes_per_step, latency,
                      costmodel.predict_step_time(base, run.mean_compress_s, phases, overlap=False, **common),
                      costmodel.predict_step_time(base, run.mean_compress_s, phases, overlap=True, **common),
                      per_worker * workers)


def check_runs(runs: Sequence[Run], latency: float) -> list[Check]:
    """Every run with an emulated link, predicted at its own n and rate, beside its measured step."""
    return [Check(predict(run, runs, run.workers, run.bandwidth, latency), run.mean_step_s, run.mean_comm_s)
            for run in runs if run.bandwidth is not None]


def cross_checks(runs: Sequence[Run], latency: float) -> list[Check]:
    """The what-if predictions checked: every run (over an emulated link) predicted from each other run
    of the same compressor, model, data and batch measured at another n or link rate."""
    out = []
    for target in runs:
        if target.bandwidth is None:
            continue
        for source in runs:
            same = (source.compressor, source.model, source.data, source.info.get("batch_size")) == \
                (target.compressor, target.model, target.data, target.info.get("batch_size"))
            if same and (source.workers, source.bandwidth) != (target.workers, target.bandwidth):
                basis = f"n={source.workers}, {source.bandwidth or 'loopback'}"
                prediction = predict(source, runs, target.workers, target.bandwidth, latency)
                out.append(Check(prediction, target.mean_step_s, target.mean_comm_s, basis))
    return out


def fit_run_latency(runs: Sequence[Run]) -> float:
    """Least-squares α over the communicating runs with an emulated link: each run's exposed
    communication (step − compute − compression) minus its bytes' transfer time at its own rate (on the
    link, through its token bucket: :func:`link_phases`, :func:`burst_of`) is its messages' share, priced
    by :func:`~gradpress.costmodel.fit_latency` (the byte term is taken out first, so runs at
    different rates pool into one fit)."""
    observations = []
    for run in runs:
        strategy = strategy_of(run)
        if run.bandwidth is None or strategy is None or run.workers < 2:
            continue
        base, _ = compute_time(run, runs)
        exposed = run.mean_step_s - base - run.mean_compress_s
        phases = link_phases(run, strategy, run.bytes_per_step, run.workers)
        transfer = costmodel.predict_step_time(base, run.mean_compress_s, phases, n=run.workers,
                                               bandwidth=run.bandwidth, latency=0.0, burst=burst_of(run))
        observations.append(Observation([Phase(p.strategy, 0.0) for p in phases], run.workers,
                                        exposed - transfer.communication))
    if not observations:
        raise ValueError("fitting the latency needs a communicating run of 2+ workers over an emulated link")
    return costmodel.fit_latency(observations, bandwidth=1.0)


def what_if(runs: Sequence[Run], workers: Sequence[int] | None, bandwidths: Sequence[str] | None,
            latency: float, strategy: str = "auto") -> list[Prediction]:
    """Every run's predicted step at every n in ``workers`` and rate in ``bandwidths`` (None: the run's
    own; runs over loopback without ``bandwidths`` are left out)."""
    out = []
    for run in runs:
        rates = bandwidths or ([run.bandwidth] if run.bandwidth else [])
        for rate in rates:
            for n in workers or [run.workers]:
                communicates = strategy_of(run) is not None  # noop stays the compute-only bound
                out.append(predict(run, runs, n, rate, latency, strategy if communicates else None))
    return out


def load_results(*paths: str | Path) -> list[Run]:
    """Runs from ``results.json`` / run files, or from directories (their ``results.json``, else every
    ``*.json`` in them)."""
    return [run for path in paths for run in _load_results(Path(path))]


def _load_results(path: Path) -> list[Run]:
    if path.is_file():
        return load_runs(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such file or directory")
    if (path / "results.json").is_file():
        return load_runs(path / "results.json")
    files = sorted(path.glob("*.json"))
    if not files:
        raise ValueError(f"{path}: holds no results.json and no run files (*.json)")
    return [run for file in files for run in load_runs(file)]


@dataclass(frozen=True)
class Crossover:
    """Where ``label`` stops paying: the link speed (bits/s) above which its predicted step is slower
    than ``torch-allreduce``'s of the same setting (:func:`~gradpress.costmodel.crossover_bandwidth`)."""

    label: str
    workers: int
    compress_s: float
    nbytes: float
    bandwidth: float


def crossovers(runs: Sequence[Run], latency: float) -> list[Crossover]:
    """For every run beside a ``torch-allreduce`` run of the same model, data, workers and batch: the
    link speed at which it stops beating that run, from its measured compression time and bytes."""
    out = []
    for run in runs:
        strategy = strategy_of(run)
        if strategy is None or run.compressor == "torch-allreduce":
            continue
        same = [r for r in runs if r.compressor == "torch-allreduce" and (r.model, r.data, r.workers) ==
                (run.model, run.data, run.workers) and r.info.get("batch_size") == run.info.get("batch_size")]
        if not same:
            continue
        base = same[0]
        phases = link_phases(run, strategy, run.bytes_per_step, run.workers)
        base_phases = _phases("allreduce", base.bytes_per_step)
        burst = burst_of(run)
        if burst:  # no closed form through a token bucket: the sequential steps' crossing, numerically
            compute, _ = compute_time(run, runs)
            common = {"n": run.workers, "latency": latency, "burst": burst}
            speed = costmodel.bandwidth_crossing(
                _step_time(compute, run.mean_compress_s, phases, common),
                _step_time(compute, base.mean_compress_s, base_phases, common))
        else:
            speed = costmodel.crossover_bandwidth(run.mean_compress_s, phases, base.mean_compress_s,
                                                  base_phases, n=run.workers, latency=latency)
        out.append(Crossover(run.compressor, run.workers, run.mean_compress_s, run.bytes_per_step, speed))
    return out


def _step_time(compute: float, compress_s: float, phases: Any,
               common: dict[str, Any]) -> Callable[[float], float]:
    """The step time as a function of the link's bandwidth (bits/s), the rest fixed."""
    return lambda bandwidth: costmodel.predict_step_time(compute, compress_s, phases, bandwidth=bandwidth,
                                                         **common).total


def render_crossovers(found: Sequence[Crossover]) -> Any:
    from rich.table import Table

    table = Table(title="where each method stops paying: the link speed above which torch-allreduce's "
                        "predicted step is faster (sequential α–β model)")
    for column in ("run", "n", "compression ms", "bytes/step", "stops paying above"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for c in found:
        speed = ("every speed" if c.bandwidth == math.inf else "never pays" if c.bandwidth == 0
                 else _rate(c.bandwidth))
        table.add_row(c.label, str(c.workers), f"{c.compress_s * 1e3:.1f}", _bytes(c.nbytes), speed)
    return table


def _rate(bits_per_second: float) -> str:
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second / 1e3:.3g} kbit/s"


def render_checks(checks: Sequence[Check], title: str) -> Any:
    from rich.table import Table

    latency = checks[0].prediction.latency
    table = Table(title=f"{title} (α = {latency * 1e3:.3g} ms; times in ms per step; predicted = compute + "
                        "compression + communication, overlap bound = max(compute, comm.) + compr.)")
    for column in ("run", "from", "n", "link", "strategy", "bytes/step", "compute", "compr.", "comm. pred.",
                   "comm. meas.", "predicted", "overlap bound", "measured", "rel. error", "in bounds"):
        table.add_column(column, justify="left" if column in ("run", "from", "strategy") else "right")
    for c in checks:
        p = c.prediction
        source = "" if p.compute_source == "noop" else "*"
        table.add_row(p.label, c.basis, str(p.workers), p.bandwidth, p.strategy or "none", _bytes(p.nbytes),
                      f"{p.sequential.compute * 1e3:.1f}{source}", f"{p.sequential.compression * 1e3:.1f}",
                      f"{p.sequential.communication * 1e3:.1f}", f"{c.measured_comm_s * 1e3:.1f}",
                      f"{p.sequential.total * 1e3:.1f}", f"{p.overlapped.total * 1e3:.1f}",
                      f"{c.measured_s * 1e3:.1f}", f"{c.relative_error:+.1%}",
                      "yes" if c.within_bounds else "no")
    return table


def render_what_if(predictions: Sequence[Prediction]) -> Any:
    from rich.table import Table

    table = Table(title="what if: predicted step (ms, sequential; overlap bound in parentheses), samples/s")
    for column in ("run", "n", "link", "strategy", "compute", "compr.", "comm.", "step", "samples/s",
                   "vs torch-allreduce"):
        table.add_column(column, justify="left" if column in ("run", "strategy") else "right")
    baseline = {(p.workers, p.bandwidth): p for p in predictions if p.label == "torch-allreduce"}
    for p in predictions:
        ref = baseline.get((p.workers, p.bandwidth))
        speedup = "" if ref is None else f"{p.samples_per_s / ref.samples_per_s:.2f}×"
        table.add_row(p.label, str(p.workers), p.bandwidth, p.strategy or "none",
                      f"{p.sequential.compute * 1e3:.1f}", f"{p.sequential.compression * 1e3:.1f}",
                      f"{p.sequential.communication * 1e3:.1f}",
                      f"{p.sequential.total * 1e3:.1f} ({p.overlapped.total * 1e3:.1f})",
                      f"{p.samples_per_s:.0f}", speedup)
    return table


def _bytes(n: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
