"""``gradpress sim cost``: the α–β model of :mod:`gradpress.costmodel` checked against measured
runs (``gradpress compare``'s results), carried to other n and link rates, and to N nodes of k ranks
flat and in two levels (:mod:`gradpress.costmodel.nodes`), and where each method stops paying (see
:mod:`gradpress.testbed.sim`)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradpress
from gradpress import costmodel
from gradpress.costmodel import DEFAULT_INTRA_BANDWIDTH, Breakdown, Observation, Phase, Topology
from gradpress.testbed.results import HIERARCHICAL, Run, load_runs

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
    the mean step of a ``noop`` run of the same model, data, workers and batch (preferably on as many
    nodes and over the same link), else ``run``'s step − compression − communication (package doc)."""
    same = [r for r in runs if r.compressor == "noop" and (r.model, r.data, r.workers) ==
            (run.model, run.data, run.workers) and r.info.get("batch_size") == run.info.get("batch_size")]
    same.sort(key=lambda r: (r.nodes != run.nodes, r.bandwidth != run.bandwidth))
    if same:
        return same[0].mean_step_s, "noop"
    return max(0.0, run.mean_step_s - run.mean_compress_s - run.mean_comm_s), "own"


def two_level(run: Run) -> bool:
    """Whether ``run`` exchanged in two levels: ``hierarchy="node"`` on several nodes of several ranks
    (otherwise the runtime runs one level, bit for bit; :mod:`gradpress.exchange.hierarchy`). Its bytes
    and compression are then those of a rank's 1/k shard."""
    return run.hierarchy == "node" and run.nodes > 1 and run.workers_per_node > 1


def topology_of(run: Run, intra_bandwidth: float | str = DEFAULT_INTRA_BANDWIDTH) -> Topology | None:
    """The nodes ``run``'s ranks were on, as the cost model takes them: None on one node (the testbed's
    star of a link per worker), else its N nodes of k ranks (a link per node; ``intra_bandwidth``
    inside, where the testbed's workers of a node talk through their namespace's loopback, unshaped),
    in two levels where its options say ``hierarchy="node"``."""
    if run.nodes == 1:
        return None
    return Topology(run.nodes, run.workers_per_node, intra_bandwidth, hierarchical=run.hierarchy == "node")


class UnknownGradientSize(ValueError):
    """A two-level prediction needs the uncompressed bytes a rank hands in per step, which no run at hand
    gives (:func:`raw_bytes`)."""


def raw_bytes(run: Run, runs: Sequence[Run]) -> tuple[float | None, str]:
    """The uncompressed bytes B_raw each rank hands in per step (its fp32 gradient) for ``run``'s model, and
    where the figure comes from. A run records its packets' bytes, not B_raw, so: the bytes of a
    ``torch-allreduce`` run of the same model and data (its fp32 buckets), else of a ``none`` run's
    packets (for a two-level one, its shard's times k), else, for a two-level run, its own bytes inside
    the node: its reduce-scatter and all-gather there send 2(k−1)/k · B_raw (the fault flags and the
    shards' padding, a few bytes, counted in), so B_raw ≈ that · k/(2(k−1)). (None, "") when none of them
    is at hand."""
    for name in ("torch-allreduce", "none"):
        same = [r for r in runs if r.compressor == name and (r.model, r.data) == (run.model, run.data)]
        same.sort(key=two_level)
        if same:
            return same[0].bytes_per_step * (same[0].workers_per_node if two_level(same[0]) else 1), name
    if two_level(run) and run.intra_node_bytes_per_step > 0:
        k = run.workers_per_node
        return run.intra_node_bytes_per_step * k / (2 * (k - 1)), "intra-node bytes"
    return None, ""


@dataclass(frozen=True)
class Prediction:
    """The α–β prediction for one run at ``workers`` workers and ``bandwidth``: ``sequential`` (compute,
    compression and communication one after the other) and ``overlapped`` (communication hidden behind
    compute), :func:`~gradpress.costmodel.predict_step_time`'s two bounds. ``nodes`` N of ``local_size``
    k ranks (``workers`` = N·k; the star of a link per worker is n nodes of one rank), ``hierarchical``
    (the two-level exchange, labelled ``SPEC@node``), ``intra_bandwidth`` (None on the star), and
    ``raw_bytes`` (B_raw, from ``raw_source``: :func:`raw_bytes`). ``nbytes``: what a rank hands its
    exchange per step (in two levels, its shard's packets); ``link_bytes``: the bytes per step through a
    node's link (each worker's on the star), on the collectives' critical path."""

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
    nodes: int = 1
    local_size: int = 1
    hierarchical: bool = False
    intra_bandwidth: str | None = None
    link_bytes: float = 0.0
    raw_bytes: float | None = None
    raw_source: str = ""

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


def _rescaled(value: float, measured_in: int, priced_in: int) -> float:
    """``value`` measured on a rank's 1/``measured_in`` of the gradient, for 1/``priced_in`` of it (in
    proportion; the value itself where the two are the same)."""
    return value if measured_in == priced_in else value * measured_in / priced_in


def predict(run: Run, runs: Sequence[Run], workers: int, bandwidth: str | float, latency: float,
            strategy: str | None = "auto", topology: Topology | None = None) -> Prediction:
    """``run``'s step at ``workers`` and ``bandwidth`` (``strategy``: ``"auto"`` = :func:`strategy_of`):
    on a star of a link per worker, or with a ``topology`` of N nodes of k ranks (N·k = ``workers``;
    :mod:`gradpress.costmodel.nodes`), flat or in two levels. A rank's packet bytes and compression time
    are the run's, in proportion to the share of the gradient it compresses: all of it flat, 1/k of it
    in two levels (a two-level run measured 1/k' of it). In two levels the bucket's uncompressed bytes
    cross inside the node (:func:`raw_bytes`; :class:`UnknownGradientSize` where no run gives them)."""
    strategy = strategy_of(run) if strategy == "auto" else strategy
    base, source = compute_time(run, runs)
    measured = run.workers_per_node if two_level(run) else 1
    priced = topology.local_size if topology is not None and topology.hierarchical else 1
    nbytes = _rescaled(run.bytes_per_step, measured, priced)
    compress = _rescaled(run.mean_compress_s, measured, priced)
    common: dict[str, Any] = {"n": workers, "bandwidth": bandwidth, "latency": latency,
                              "burst": burst_of(run)}
    raw, raw_source, among = None, "", workers
    if topology is not None:
        if topology.hierarchical and strategy is not None:
            among = topology.nodes
            raw, raw_source = raw_bytes(run, runs)
            if raw is None and topology.local_size > 1:
                raise UnknownGradientSize(
                    f"{run.compressor}@node: the uncompressed gradient's bytes, which cross inside the node, "
                    f"are in no run at hand (add a torch-allreduce or none run of {run.model} on {run.data})")
        else:
            topology = topology.flat()
        common.update(topology=topology, nbytes=raw or 0.0)
    phases = link_phases(run, strategy, nbytes, among)
    if topology is None:
        link = costmodel.communication_cost(phases, workers).nbytes
    else:
        link = costmodel.node_link_bytes(phases, topology)
    per_worker = run.steps[-1].samples / run.workers
    two = topology is not None and topology.hierarchical
    rate = bandwidth if isinstance(bandwidth, str) else f"{bandwidth:g}"
    return Prediction(run.compressor + (HIERARCHICAL if two else ""), workers, rate, strategy, source, nbytes,
                      latency, costmodel.predict_step_time(base, compress, phases, overlap=False, **common),
                      costmodel.predict_step_time(base, compress, phases, overlap=True, **common),
                      per_worker * workers, workers if topology is None else topology.nodes,
                      1 if topology is None else topology.local_size, two,
                      None if topology is None else str(topology.intra_bandwidth), link, raw, raw_source)


def check_runs(runs: Sequence[Run], latency: float,
               intra_bandwidth: float | str = DEFAULT_INTRA_BANDWIDTH) -> list[Check]:
    """Every run with an emulated link, predicted at its own n and rate, beside its measured step; a run
    on several nodes on its own nodes, flat or in two levels as it ran (:func:`topology_of`)."""
    return [Check(predict(run, runs, run.workers, run.bandwidth, latency,
                          topology=topology_of(run, intra_bandwidth)), run.mean_step_s, run.mean_comm_s)
            for run in runs if run.bandwidth is not None]


def _setting(run: Run) -> str:
    """``n=4, 100mbit``, or ``2 nodes × 2, 100mbit``."""
    ranks = f"{run.nodes} nodes × {run.workers_per_node}" if run.nodes > 1 else f"n={run.workers}"
    return f"{ranks}, {run.bandwidth or 'loopback'}"


def cross_checks(runs: Sequence[Run], latency: float,
                 intra_bandwidth: float | str = DEFAULT_INTRA_BANDWIDTH) -> list[Check]:
    """The what-if predictions checked: every run (over an emulated link) predicted from each other run
    of the same compressor (flat or ``@node`` alike), model, data and batch measured at another n, number
    of nodes or link rate, on the target's nodes (:func:`topology_of`)."""
    out = []
    for target in runs:
        if target.bandwidth is None:
            continue
        for source in runs:
            same = (source.label, source.model, source.data, source.info.get("batch_size")) == \
                (target.label, target.model, target.data, target.info.get("batch_size"))
            if same and (source.workers, source.nodes, source.bandwidth) != \
                    (target.workers, target.nodes, target.bandwidth):
                try:
                    prediction = predict(source, runs, target.workers, target.bandwidth, latency,
                                         topology=topology_of(target, intra_bandwidth))
                except UnknownGradientSize:
                    continue
                out.append(Check(prediction, target.mean_step_s, target.mean_comm_s, _setting(source)))
    return out


def fit_run_latency(runs: Sequence[Run]) -> float:
    """Least-squares α over the communicating runs with an emulated link: each run's exposed
    communication (step − compute − compression) minus its bytes' transfer time at its own rate (on the
    link, through its token bucket: :func:`link_phases`, :func:`burst_of`) is its messages' share, priced
    by :func:`~gradpress.costmodel.fit_latency` (the byte term is taken out first, so runs at
    different rates pool into one fit). Runs on several nodes are left out (the fit prices a star)."""
    observations = []
    for run in runs:
        strategy = strategy_of(run)
        if run.bandwidth is None or strategy is None or run.workers < 2 or run.nodes > 1:
            continue
        base, _ = compute_time(run, runs)
        exposed = run.mean_step_s - base - run.mean_compress_s
        phases = link_phases(run, strategy, run.bytes_per_step, run.workers)
        transfer = costmodel.predict_step_time(base, run.mean_compress_s, phases, n=run.workers,
                                               bandwidth=run.bandwidth, latency=0.0, burst=burst_of(run))
        observations.append(Observation([Phase(p.strategy, 0.0) for p in phases], run.workers,
                                        exposed - transfer.communication))
    if not observations:
        raise ValueError("fitting the latency needs a communicating run of 2+ workers on one node over an "
                         "emulated link")
    return costmodel.fit_latency(observations, bandwidth=1.0)


def what_if(runs: Sequence[Run], workers: Sequence[int] | None, bandwidths: Sequence[str] | None,
            latency: float, strategy: str = "auto", nodes: Sequence[int] | None = None,
            local_size: int | None = None, intra_bandwidth: float | str = DEFAULT_INTRA_BANDWIDTH,
            skipped: list[str] | None = None) -> list[Prediction]:
    """Every run's predicted step at every n in ``workers`` and rate in ``bandwidths`` (None: the run's
    own; runs over loopback without ``bandwidths`` are left out).

    With ``nodes`` (instead of ``workers``): on every N of ``nodes`` nodes of k ranks (``local_size``,
    default the run's own ranks a node, 1 for a run on one node) with ``intra_bandwidth`` inside a node,
    each run flat and in two levels (:func:`kinds`: PyTorch's hooks and ``noop`` flat only); a two-level
    row that needs the gradient's bytes no run gives is left out, and why is added to ``skipped``."""
    out = []
    for run in runs:
        rates = bandwidths or ([run.bandwidth] if run.bandwidth else [])
        communicates = strategy_of(run) is not None  # noop stays the compute-only bound
        chosen = strategy if communicates else None
        for rate in rates:
            if nodes is None:
                for n in workers or [run.workers]:
                    out.append(predict(run, runs, n, rate, latency, chosen))
                continue
            k = local_size or (run.workers_per_node if run.nodes > 1 else 1)
            for count in nodes:
                flat = Topology(count, k, intra_bandwidth)
                for hierarchical in kinds(run, runs):
                    try:
                        out.append(predict(run, runs, flat.workers, rate, latency, chosen,
                                           flat.two_level() if hierarchical else flat))
                    except UnknownGradientSize as error:
                        if skipped is not None and str(error) not in skipped:
                            skipped.append(str(error))
    return out


def kinds(run: Run, runs: Sequence[Run]) -> list[bool]:
    """Whether to price ``run`` flat (False) and in two levels (True) on several nodes: both for a gradpress
    method, but the other way where the results hold the same method, model, data and batch measured that
    way (that run gives it); flat only for PyTorch's hooks and ``noop``."""
    if run.compressor in REFERENCE_STRATEGIES:
        return [False]
    own = two_level(run)
    other = any(two_level(r) != own and (r.compressor, r.model, r.data, r.info.get("batch_size")) ==
                (run.compressor, run.model, run.data, run.info.get("batch_size")) for r in runs)
    return [own] if other else [False, True]


def load_results(*paths: str | Path) -> list[Run]:
    """Runs from ``results.json`` / run files, or from directories (their ``results.json``, else every
    ``*.json`` in them). Runs of a model sharded with FSDP2 (``torch-fsdp``, ``torch-hsdp``, ``SPEC@hsdp``,
    ``SPEC@fsdp``: :attr:`Run.sharding`) are left out: the cost model prices DDP's exchanges."""
    return [run for path in paths for run in _load_results(Path(path)) if run.sharding is None]


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


def crossovers(runs: Sequence[Run], latency: float,
               intra_bandwidth: float | str = DEFAULT_INTRA_BANDWIDTH) -> list[Crossover]:
    """For every run beside a ``torch-allreduce`` run of the same model, data, workers, nodes and batch:
    the link speed at which it stops beating that run, from its measured compression time and bytes (on
    several nodes, both on their nodes, :func:`topology_of`, numerically)."""
    out = []
    for run in runs:
        strategy = strategy_of(run)
        if strategy is None or run.compressor == "torch-allreduce":
            continue
        same = [r for r in runs if r.compressor == "torch-allreduce"
                and (r.model, r.data, r.workers, r.nodes) == (run.model, run.data, run.workers, run.nodes)
                and r.info.get("batch_size") == run.info.get("batch_size")]
        if not same:
            continue
        base = same[0]
        if run.nodes > 1:
            def step(r: Run) -> Callable[[float], float]:
                return lambda bandwidth: predict(r, runs, r.workers, bandwidth, latency,
                                                 topology=topology_of(r, intra_bandwidth)).sequential.total

            try:
                speed = costmodel.bandwidth_crossing(step(run), step(base))
            except UnknownGradientSize:
                continue
            out.append(Crossover(run.label, run.workers, run.mean_compress_s, run.bytes_per_step, speed))
            continue
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
        out.append(Crossover(run.label, run.workers, run.mean_compress_s, run.bytes_per_step, speed))
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
        table.add_row(p.label, c.basis, _ranks(p), p.bandwidth, p.strategy or "none", _bytes(p.nbytes),
                      f"{p.sequential.compute * 1e3:.1f}{source}", f"{p.sequential.compression * 1e3:.1f}",
                      f"{p.sequential.communication * 1e3:.1f}", f"{c.measured_comm_s * 1e3:.1f}",
                      f"{p.sequential.total * 1e3:.1f}", f"{p.overlapped.total * 1e3:.1f}",
                      f"{c.measured_s * 1e3:.1f}", f"{c.relative_error:+.1%}",
                      "yes" if c.within_bounds else "no")
    return table


def _ranks(p: Prediction) -> str:
    """``4`` on a star of a link per worker, ``2×2`` on 2 nodes of 2 ranks."""
    return str(p.workers) if p.intra_bandwidth is None else f"{p.nodes}×{p.local_size}"


def render_what_if(predictions: Sequence[Prediction]) -> Any:
    from rich.table import Table

    nodes = any(p.intra_bandwidth is not None for p in predictions)
    title = "what if: predicted step (ms, sequential; overlap bound in parentheses), samples/s"
    if nodes:
        title += (f"; N×k: N nodes of k ranks, {_intra(predictions)} inside a node, flat or in two levels "
                  "(@node); node link bytes: per step through a node's link")
    table = Table(title=title)
    columns = ["run", "N×k" if nodes else "n", "link", "strategy", "compute", "compr.", "comm.", "step",
               "samples/s", "vs torch-allreduce"]
    if nodes:
        columns.insert(4, "node link bytes")
    for column in columns:
        table.add_column(column, justify="left" if column in ("run", "strategy") else "right")
    baseline = {(p.workers, p.nodes, p.bandwidth): p for p in predictions if p.label == "torch-allreduce"}
    for p in predictions:
        ref = baseline.get((p.workers, p.nodes, p.bandwidth))
        speedup = "" if ref is None else f"{p.samples_per_s / ref.samples_per_s:.2f}×"
        cells = [p.label, _ranks(p), p.bandwidth, p.strategy or "none",
                 f"{p.sequential.compute * 1e3:.1f}", f"{p.sequential.compression * 1e3:.1f}",
                 f"{p.sequential.communication * 1e3:.1f}",
                 f"{p.sequential.total * 1e3:.1f} ({p.overlapped.total * 1e3:.1f})",
                 f"{p.samples_per_s:.0f}", speedup]
        if nodes:
            cells.insert(4, _bytes(p.link_bytes))
        table.add_row(*cells)
    return table


def _intra(predictions: Sequence[Prediction]) -> str:
    return ", ".join(sorted({p.intra_bandwidth for p in predictions if p.intra_bandwidth is not None}))


def _bytes(n: float) -> str:
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
