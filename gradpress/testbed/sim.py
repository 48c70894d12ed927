"""``gradpress sim``: many workers in one process (:func:`gradpress.simulate`), and an α–β cost model.

Three questions the multi-process testbed cannot afford to ask at scale:

``gradpress sim nmse``
    How far is the aggregate from the true mean as the number of workers n grows (THC Section 8.4 and
    Figure 10's question, asked of the aggregate directly)? Every worker holds its own vector,
    x_i = s + σ·ξ_i: a signal s shared by all (``normal`` N(0, 1) or ``lognormal`` LogNormal(0, 1), THC
    App. D.4's stand-in for a gradient) plus private noise ξ_i ~ N(0, 1) (σ = ``spread``), as the
    mini-batch gradients of data-parallel workers differ around the full gradient. The NMSE
    ‖x̂ − x̄‖² / ‖x̄‖² (THC Section 2's definition) of what :func:`gradpress.simulate` returns, against
    the exact mean x̄ = (1/n)·Σ x_i, is averaged over ``trials`` draws with fixed seeds. An unbiased
    compressor whose workers round with private randomness (DESIGN invariant 2) has independent errors
    of variance ω‖x_i‖², so NMSE ≈ ω(1 + σ²)/(n + σ²): it falls like 1/n (slope −1 on the log-log
    plot). A biased one (top-k) keeps its bias however many workers average (slope ≈ 0), and so does an
    unbiased one whose errors are shared: random-k with ``scale=true`` draws its indices from the
    shared stream to stay summable, so every worker drops the same coordinates and
    NMSE = d/k − 1 for every n. ``none`` is exact up to fp32 rounding of the sum (≈ 1e-13).

``gradpress sim quality``
    Synchronous data-parallel SGD with n simulated workers: at every step each worker computes the
    gradient of its own mini-batch from its shard (``dataset.shard(rank, n)``), a
    :class:`gradpress.Simulator` exchanges them (keyed by parameter name, feedback memory carried over
    steps) and the optimizer applies the aggregate; the test-set quality
    (:func:`gradpress.testbed.models.evaluate`) before and after, against n. The learning rate is the
    model's and is not scaled with n (the global batch is n times the per-worker batch). Buffers
    (batch-norm statistics) follow rank 0's batches, as DDP's ``broadcast_buffers`` makes them.

``gradpress sim cost``
    The α–β model of :mod:`gradpress.testbed.costmodel` checked against measured runs
    (``gradpress compare``'s ``results.json``): a run's step is predicted as its compute time, plus its
    compression time, plus the exchange of its bytes per step by its strategy (summable → ring
    all-reduce, else all-gather; ``ps``/``switch`` modes → gather and broadcast; the reference rows
    ``torch-*`` → all-reduce, ``noop`` → nothing) over the run's link rate. The compute time is the
    ``noop`` run's mean step (same model, data, workers and batch: compute, data loading and optimizer
    without any communication), because a communicating run's own compute time includes waiting for
    the network; without a ``noop`` run it is estimated as step − compression − communication. Each
    run is checked at its own n and link rate, and carried to the setting of every other run of the
    same compressor and model (``--results DIR_N2 DIR_N4``: predicted at n = 4 from the n = 2 run and
    back). Then the same breakdown at other n and link rates ("what if I had 16 workers on
    1 Gbit/s?", ``--workers 16 --bandwidth 1gbit``). The latency α is a parameter (default
    :data:`~gradpress.testbed.costmodel.DEFAULT_LATENCY`) or fitted to the runs' exposed communication
    (step − compute − compression) by least squares (:func:`~gradpress.testbed.costmodel.fit_latency`,
    ``--latency fit``).

    How well it matches: ``gradpress compare --model mlp-wide --bandwidth 100mbit --compressors
    torch-allreduce,topk:ratio=0.01,noop`` with 2 workers (30 steps) and with 4 (20 steps), then
    ``gradpress sim cost --results DIR2 DIR4``, on a 2-core machine shared with other jobs:

    ==================================  ======  =========  ========  =======
    run                                 n       predicted  measured  error
    ==================================  ======  =========  ========  =======
    torch-allreduce (13 MB, ring)       2       1174 ms    1165 ms   +0.8 %
    torch-allreduce                     4       1648 ms    1834 ms   −10.1 %
    topk:ratio=0.01 (261 kB, gather)    2       266 ms     238 ms    +11.4 %
    topk:ratio=0.01                     4       265 ms     268 ms    −1.3 %
    torch-allreduce                     2 → 4   1696 ms    1834 ms   −7.5 %
    topk:ratio=0.01                     2 → 4   307 ms     268 ms    +14.6 %
    ==================================  ======  =========  ========  =======

    So within about ±15 %, mostly under-predicting the communication-bound step: the all-reduce's
    measured communication is 7–11 % above the α–β figure, about half of it the TCP/IP and Ethernet
    headers that tc's rate counts and ``Packet.nbytes`` does not (≈ 4.5 % at a 1500-byte MTU), the
    rest Gloo and the 4 workers' scheduling on 2 cores. The compute-bound top-k step is as good as the
    compute time it is given: the same ``noop`` step measured 132 ms in one run and 84 ms in the
    other. α is not identifiable at this scale: ``--latency fit`` gives 0 on the 2-worker runs and
    21.7 ms with the 4-worker ones, where it only soaks up the all-reduce's shortfall (all-reduce
    errors −3 % … +5 %) and overcharges the all-gather (top-k +20 % … +39 %); keep the default α here.

    Known limits: the all-gather decodes n packets, so its decompression time grows with n, but a run
    records compression and decompression as one time, which the prediction keeps fixed at other n
    (an underestimate for all-gather methods at large n); bytes are the packets' (``Packet.nbytes``),
    not widened integer sums (THC past 8 workers) or TCP/IP headers; a multi-phase method (CLT-k's
    broadcast, then all-reduce) is priced as one strategy.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import gradpress
from gradpress import cli
from gradpress.registry import split_specs
from gradpress.testbed import costmodel
from gradpress.testbed.costmodel import Breakdown, Observation, Phase
from gradpress.testbed.data import Dataset
from gradpress.testbed.results import Run, load_runs

DEFAULT_WORKERS = (4, 16, 64, 256, 1024)
DISTRIBUTIONS = ("normal", "lognormal")
#: NMSE below this is fp32 rounding of the sum, not compression error
ROUNDING = 1e-10
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# ==================================================================================================
# NMSE against the number of workers
# ==================================================================================================
def worker_vectors(n: int, numel: int, dist: str, generator: torch.Generator,
                   spread: float = 1.0) -> list[torch.Tensor]:
    """``n`` workers' vectors x_i = s + spread·ξ_i (module doc): s from ``dist``, ξ_i ~ N(0, 1)."""
    if dist not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {dist!r}; known: {', '.join(DISTRIBUTIONS)}")
    shared = torch.randn(numel, generator=generator)
    if dist == "lognormal":
        shared = shared.exp_()
    return [shared + spread * torch.randn(numel, generator=generator) for _ in range(n)]


def exact_mean(vectors: Sequence[torch.Tensor]) -> torch.Tensor:
    """(1/n)·Σ x_i in float64 (the reference the aggregate is measured against)."""
    total = torch.zeros(vectors[0].shape, dtype=torch.float64)
    for v in vectors:
        total += v
    return total / len(vectors)


def nmse(estimate: torch.Tensor, target: torch.Tensor) -> float:
    """‖estimate − target‖² / ‖target‖² (THC Section 2), in float64."""
    target = target.double()
    return float((estimate.double() - target).square().sum() / target.square().sum())


@dataclass(frozen=True)
class NMSEPoint:
    """The mean NMSE of ``spec``'s aggregate over ``workers`` workers (``trials`` draws)."""

    spec: str
    unbiased: bool
    workers: int
    nmse: float


def nmse_vs_workers(specs: Sequence[str], workers: Sequence[int] = DEFAULT_WORKERS, numel: int = 1 << 14,
                    dist: str = "normal", trials: int = 3, seed: int = 0, spread: float = 1.0,
                    progress: Progress = _quiet) -> list[NMSEPoint]:
    """NMSE of :func:`gradpress.simulate`'s aggregate for every spec and n (module doc).

    Trial t of every spec and n draws its vectors from a generator seeded with ``seed`` and runs the
    compressors with seed ``seed + t``, so compressors are compared on the same vectors.
    """
    _check_positive(numel=numel, trials=trials)
    for n in workers:
        _check_positive(workers=n)
    if not (math.isfinite(spread) and spread >= 0):
        raise ValueError(f"spread must be a finite number ≥ 0, got {spread}")
    compressors = {spec: gradpress.make(spec) for spec in specs}  # unknown specs fail before any work
    points = []
    for spec, compressor in compressors.items():
        for n in workers:
            progress(f"{spec}, {n} workers")
            generator = torch.Generator().manual_seed(seed)
            errors = []
            for trial in range(trials):
                xs = worker_vectors(n, numel, dist, generator, spread)
                errors.append(nmse(gradpress.simulate(spec, xs, seed=seed + trial), exact_mean(xs)))
            points.append(NMSEPoint(spec, bool(compressor.unbiased), n, statistics.fmean(errors)))
    return points


def loglog_slope(points: Sequence[NMSEPoint]) -> float | None:
    """Least-squares slope of log NMSE against log n: −1 when errors average out, 0 when they don't.
    None with fewer than two different n, or when some NMSE is only fp32 rounding (≤ :data:`ROUNDING`)."""
    if len({p.workers for p in points}) < 2 or any(p.nmse <= ROUNDING for p in points):
        return None
    x, y = [math.log(p.workers) for p in points], [math.log(p.nmse) for p in points]
    return statistics.linear_regression(x, y).slope


def _rounding_only(points: Sequence[NMSEPoint]) -> bool:
    return all(p.nmse <= ROUNDING for p in points)


def _by_spec(points: Sequence[NMSEPoint]) -> dict[str, list[NMSEPoint]]:
    out: dict[str, list[NMSEPoint]] = {}
    for p in points:
        out.setdefault(p.spec, []).append(p)
    return out


def render_nmse(points: Sequence[NMSEPoint], title: str) -> Any:
    from rich.table import Table

    workers = sorted({p.workers for p in points})
    table = Table(title=title)
    table.add_column("compressor")
    table.add_column("unbiased")
    for n in workers:
        table.add_column(f"n={n}", justify="right")
    table.add_column("slope", justify="right")
    for spec, mine in _by_spec(points).items():
        cells = {p.workers: f"{p.nmse:.3g}" for p in mine}
        slope = loglog_slope(mine)
        shown = "rounding" if _rounding_only(mine) else "" if slope is None else f"{slope:+.2f}"
        table.add_row(spec, "yes" if mine[0].unbiased else "no", *(cells.get(n, "") for n in workers), shown)
    return table


def plot_nmse(points: Sequence[NMSEPoint], path: str | Path, title: str) -> Path:
    """NMSE against n, log-log, one line per compressor, with a dotted 1/n guide."""
    series = {}
    for spec, mine in _by_spec(points).items():
        label = spec + (" (fp32 rounding)" if _rounding_only(mine) else "")
        series[label] = [(p.workers, p.nmse) for p in mine if p.nmse > 0]
    unbiased = [mine for mine in _by_spec(points).values() if mine[0].unbiased and mine[0].nmse > ROUNDING]
    guide = unbiased[0] if unbiased else None
    extra = None
    if guide:
        n0, e0 = guide[0].workers, guide[0].nmse
        extra = ("∝ 1/n", [(p.workers, e0 * n0 / p.workers) for p in guide])
    return _plot(series, path, "workers n", "NMSE of the aggregate", title, logy=True, guide=extra)


# ==================================================================================================
# Quality against the number of workers
# ==================================================================================================
@dataclass(frozen=True)
class QualityPoint:
    """One simulated training run: ``workers`` workers, ``steps`` steps of ``spec``."""

    spec: str
    model: str
    data: str
    workers: int
    steps: int
    batch_size: int
    lr: float
    metric: str
    higher_is_better: bool
    initial: float
    final: float
    initial_loss: float
    final_loss: float
    bytes_per_step: float
    seconds: float
    train_losses: list[float] = field(default_factory=list)


def train_simulated(model: str, data: Dataset, workers: int, spec: str, steps: int,
                    batch_size: int | None = None, lr: float | None = None, seed: int = 0,
                    options: dict[str, Any] | None = None,
                    net: torch.nn.Module | None = None) -> QualityPoint:
    """Train ``model`` on ``data`` (a :class:`~gradpress.testbed.data.Dataset`) with ``workers`` simulated
    workers exchanging through ``spec`` for ``steps`` steps (module doc); quality before and after.

    The model is built from ``seed``, or ``net``, an instance of ``model``, is trained in place; the
    global torch RNG is left as it was (initialization and dropout draw from a fork seeded by ``seed``).
    """
    from gradpress.testbed.models import QUALITY, criterion, evaluate, model_config
    from gradpress.testbed.train import _optimizer

    _check_positive(workers=workers, steps=steps)
    settings = model_config(model, data)
    batch_size = batch_size or settings.batch_size
    lr = settings.lr if lr is None else lr
    shards = [data.shard(rank, workers, seed=seed) for rank in range(workers)]
    if len(shards[0].train) < batch_size:
        raise ValueError(f"a shard of {len(shards[0].train)} samples (of {len(data.train)} over {workers} "
                         f"workers) holds no batch of {batch_size}: use fewer workers or a smaller "
                         "--batch-size")
    metric, higher_is_better = QUALITY[data.task]
    loss_fn = criterion(data)
    simulator = gradpress.Simulator(spec, workers, **{"seed": seed, **(options or {})})  # --option seed wins
    batches = [_endless_batches(shard, batch_size, seed, rank) for rank, shard in enumerate(shards)]
    with torch.random.fork_rng(devices=[]):  # initialization and dropout from ``seed``, not the caller's RNG
        torch.manual_seed(seed)
        net = settings.build() if net is None else net
        optimizer = _optimizer(settings.optimizer, net.parameters(), lr)
        before = evaluate(net, data)
        started = time.perf_counter()
        losses = []
        for _ in range(steps):
            grads, step_losses = _worker_gradients(net, batches, loss_fn)
            mean = simulator.step(grads)
            for name, parameter in net.named_parameters():
                if parameter.requires_grad:
                    parameter.grad = mean[name]
            if settings.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(net.parameters(), settings.grad_clip)
            optimizer.step()
            losses.append(statistics.fmean(step_losses))
        seconds = time.perf_counter() - started
        after = evaluate(net, data)
    sent = simulator.stats()[0]["total"]["packet_bytes"]
    return QualityPoint(spec, model, data.name, workers, steps, batch_size, lr, metric, higher_is_better,
                        before[metric], after[metric], before["loss"], after["loss"], sent / steps, seconds,
                        losses)


def _endless_batches(shard: Dataset, batch_size: int, seed: int, rank: int) -> Iterator[tuple]:
    """Rank ``rank``'s mini-batches, epoch after epoch, shuffled as ``gradpress train`` shuffles them."""
    epoch = 0
    while True:
        generator = torch.Generator().manual_seed(seed * 100_003 + epoch * 1009 + rank)
        yield from shard.training_set(generator).batches(batch_size, generator, drop_last=True)
        epoch += 1


def _worker_gradients(net: torch.nn.Module, batches: list[Iterator[tuple]],
                      loss_fn: Callable) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """Every worker's gradients (name -> tensor) on its next batch, from the same parameters. Buffers
    start each worker from the step's state and end with rank 0's update (DDP's broadcast_buffers)."""
    saved = [b.detach().clone() for b in net.buffers()]
    grads: list[dict[str, torch.Tensor]] = [{} for _ in batches]
    losses = []
    for rank in [*range(1, len(batches)), 0]:
        for buffer, value in zip(net.buffers(), saved):
            buffer.copy_(value)
        x, y = next(batches[rank])
        net.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        grads[rank] = {name: p.grad if p.grad is not None else torch.zeros_like(p)
                       for name, p in net.named_parameters() if p.requires_grad}
        losses.append(loss.item())
    return grads, losses


def render_quality(points: Sequence[QualityPoint]) -> Any:
    from rich.table import Table

    first = points[0]
    table = Table(title=f"quality vs workers: {first.model} on {first.data}, {first.steps} steps of "
                        f"{first.batch_size} samples per worker, lr {first.lr:g}")
    for column in ("compressor", "workers", "global batch", f"{first.metric} before", f"{first.metric} after",
                   "test loss before → after", "MB/step/worker", "seconds"):
        table.add_column(column, justify="left" if column == "compressor" else "right")
    for p in points:
        table.add_row(p.spec, str(p.workers), str(p.workers * p.batch_size), f"{p.initial:.4g}",
                      f"{p.final:.4g}", f"{p.initial_loss:.4f} → {p.final_loss:.4f}",
                      f"{p.bytes_per_step / 1e6:.4f}", f"{p.seconds:.1f}")
    return table


def plot_quality(points: Sequence[QualityPoint], path: str | Path) -> Path:
    series: dict[str, list[tuple[float, float]]] = {}
    for p in points:
        series.setdefault(p.spec, []).append((p.workers, p.final))
    first = points[0]
    return _plot(series, path, "workers n", f"{first.metric} after {first.steps} steps",
                 f"{first.model} on {first.data}", logy=False)


# ==================================================================================================
# The α–β cost model against measured runs
# ==================================================================================================
#: the strategy of each reference row of ``gradpress train`` (None: no communication)
REFERENCE_STRATEGIES: dict[str, str | None] = {"torch-allreduce": "allreduce", "torch-fp16": "allreduce",
                                               "torch-powersgd": "allreduce", "noop": None}


def strategy_of(run: Run) -> str | None:
    """How ``run``'s bytes travel (:data:`~gradpress.testbed.costmodel.STRATEGIES`), None for ``noop``."""
    if run.compressor in REFERENCE_STRATEGIES:
        return REFERENCE_STRATEGIES[run.compressor]
    mode = (run.info.get("options") or {}).get("mode", "collective")
    if mode in ("ps", "switch"):
        return "gather-broadcast"  # the runtime's server modes on Gloo: gather at the root, tree broadcast
    return gradpress.make(run.compressor).exchange


def _phases(strategy: str | None, nbytes: float) -> list[Phase]:
    return [] if strategy is None else [Phase(strategy, nbytes)]


def compute_time(run: Run, runs: Sequence[Run]) -> tuple[float, str]:
    """Seconds of ``run``'s step without communication or compression, and where the figure comes from:
    the mean step of a ``noop`` run of the same model, data, workers and batch (preferably over the same
    link), else ``run``'s step − compression − communication (module doc)."""
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
    compute), :func:`~gradpress.testbed.costmodel.predict_step_time`'s two bounds."""

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
    phases = _phases(strategy, run.bytes_per_step)
    common = {"n": workers, "bandwidth": bandwidth, "latency": latency}
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
    communication (step − compute − compression) minus its bytes' transfer time at its own rate is
    its messages' share, priced by :func:`~gradpress.testbed.costmodel.fit_latency` (the byte term is
    taken out first, so runs at different rates pool into one fit)."""
    observations = []
    for run in runs:
        strategy = strategy_of(run)
        if run.bandwidth is None or strategy is None or run.workers < 2:
            continue
        base, _ = compute_time(run, runs)
        exposed = run.mean_step_s - base - run.mean_compress_s
        transfer = costmodel.Cost(0, Phase(strategy, run.bytes_per_step).cost(run.workers).nbytes)
        observations.append(Observation(Phase(strategy, 0.0), run.workers,
                                        exposed - transfer.seconds(run.bandwidth, 0.0)))
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
    than ``torch-allreduce``'s of the same setting (:func:`~gradpress.testbed.costmodel.crossover_bandwidth`)."""

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
        speed = costmodel.crossover_bandwidth(run.mean_compress_s, _phases(strategy, run.bytes_per_step),
                                              base.mean_compress_s, _phases("allreduce", base.bytes_per_step),
                                              n=run.workers, latency=latency)
        out.append(Crossover(run.compressor, run.workers, run.mean_compress_s, run.bytes_per_step, speed))
    return out


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


# ==================================================================================================
# Shared helpers
# ==================================================================================================
def _plot(series: dict[str, list[tuple[float, float]]], path: str | Path, xlabel: str, ylabel: str,
          title: str, logy: bool, guide: tuple[str, list[tuple[float, float]]] | None = None) -> Path:
    """Lines against n (log₂ axis) with matplotlib's object API (no pyplot, no global backend)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.4))
    axis = figure.subplots()
    for label, points in series.items():
        if points:
            axis.plot(*zip(*points), marker="o", label=label)
    if guide is not None:
        axis.plot(*zip(*guide[1]), linestyle=":", color="gray", label=guide[0])
    axis.set_xscale("log", base=2)
    if logy:
        axis.set_yscale("log")
    counts = sorted({x for points in series.values() for x, _ in points})
    axis.set_xticks(counts, [str(int(n)) for n in counts])
    axis.set(xlabel=xlabel, ylabel=ylabel, title=title)
    axis.grid(True, which="major", alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 4,16") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _rates(text: str) -> list[str]:
    from gradpress.testbed.netem import rate_bits_per_second

    rates = [v.strip() for v in text.split(",") if v.strip()]
    for rate in rates:
        try:
            rate_bits_per_second(rate)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return rates


def _latency(text: str) -> float | str:
    if text == "fit":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds (e.g. 1e-4) or 'fit'") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"latency must be seconds ≥ 0, got {text}")
    return value


# ==================================================================================================
# Command line
# ==================================================================================================
def add_parser(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser("sim", help="many simulated workers in one process; the α–β cost model",
                                description=__doc__.split("\n\n")[0])
    modes = sim.add_subparsers(dest="sim", required=True)

    p = modes.add_parser("nmse", help="NMSE of the aggregate against the number of workers (THC §8.4)")
    p.add_argument("--compressors", type=cli.compressor_list(), default="none,topk:ratio=0.01,qsgd,natural",
                   help="comma-separated compressor specs")
    p.add_argument("--workers", type=_ints, default=list(DEFAULT_WORKERS), help="numbers of workers: 4,16,64")
    p.add_argument("--numel", type=cli.size, default=1 << 14, help="elements per worker vector (2^14 allowed)")
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="normal", help="the shared signal's distribution")
    p.add_argument("--spread", type=cli.non_negative_float, default=1.0,
                   help="scale σ of each worker's private N(0,1) noise")
    p.add_argument("--trials", type=cli.positive_int, default=3)
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--json", type=cli.output_file, help="write the points here")
    p.add_argument("--plot", type=cli.output_file, help="write a log-log plot of NMSE against n here (PNG)")
    p.set_defaults(func=_reporting_errors(_main_nmse))

    from gradpress.testbed.data import dataset_names

    p = modes.add_parser("quality", help="train with n simulated workers; quality against n")
    p.add_argument("--model", type=cli.model, default="mlp", help="model spec (gradpress.testbed.models)")
    p.add_argument("--data", choices=dataset_names(), help="dataset (default: the model's)")
    p.add_argument("--workers", type=_ints, default=[1, 4, 16], help="numbers of workers, e.g. 1,4,16")
    p.add_argument("--compressor", "--compressors", dest="compressors", type=cli.compressor_list(),
                   default="none", help="compressor spec(s), comma-separated")
    p.add_argument("--steps", type=cli.positive_int, default=100)
    p.add_argument("--batch-size", type=cli.positive_int, help="per-worker batch size (default: the model's)")
    p.add_argument("--lr", type=cli.positive_float, help="learning rate (default: the model's)")
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--option", type=cli.option, action="append", default=[], metavar="KEY=VALUE",
                   help="gradpress runtime option (feedback, min_numel, warmup_steps, ...)")
    p.add_argument("--json", type=cli.output_file, help="write the runs here")
    p.add_argument("--plot", type=cli.output_file, help="write a plot of final quality against n here (PNG)")
    p.set_defaults(func=_reporting_errors(_main_quality))

    p = modes.add_parser("cost", help="α–β step-time model checked against measured runs; what-if")
    p.add_argument("--results", required=True, nargs="+", metavar="PATH",
                   help="compare output directories, results.json or run files")
    p.add_argument("--workers", type=_ints, help="predict at these numbers of workers (e.g. 16,64)")
    p.add_argument("--bandwidth", type=_rates, help="predict at these link rates (e.g. 1gbit,10gbit)")
    p.add_argument("--latency", type=_latency, default=costmodel.DEFAULT_LATENCY,
                   help=f"per-message latency α in seconds, or 'fit' to fit it to the runs "
                        f"(default {costmodel.DEFAULT_LATENCY:g})")
    p.add_argument("--strategy", default="auto", choices=["auto", *costmodel.STRATEGIES],
                   help="price what-if predictions with this strategy (default: each run's own)")
    p.add_argument("--json", type=cli.output_file, help="write the checks and predictions here")
    p.set_defaults(func=_reporting_errors(_main_cost))


def _reporting_errors(main: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``main`` with bad input found while it runs (ValueError: unusable results, a too small shard)
    reported as a :class:`~gradpress.cli.UsageError` (``gradpress: error: sim MODE: …``, exit status 2)
    instead of a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return main(args)
        except ValueError as error:
            raise cli.UsageError(f"sim {args.sim}: {error}") from None

    return run


def _console():
    """Rich's console; 200 columns wide when writing to a file or pipe (the tables are wide)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal or "COLUMNS" in os.environ else Console(width=200)


def _main_nmse(args: argparse.Namespace) -> int:
    from rich.console import Console

    specs = split_specs(args.compressors)
    with Console(stderr=True).status("simulating") as status:
        points = nmse_vs_workers(specs, args.workers, args.numel, args.dist, args.trials, args.seed,
                                 args.spread, progress=lambda what: status.update(f"simulating {what}"))
    title = (f"NMSE of the aggregate vs workers: x_i = {args.dist} signal + {args.spread:g}·N(0,1), "
             f"d = {args.numel}, mean of {args.trials} trials")
    _console().print(render_nmse(points, title))
    if args.json:
        setting = {"numel": args.numel, "dist": args.dist, "spread": args.spread, "trials": args.trials,
                   "seed": args.seed}
        record = {**setting, "points": [asdict(p) for p in points]}
        cli.writable_parent(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_nmse(points, args.plot, f'{args.dist} signal, d = {args.numel}')}")
    return 0


def _main_quality(args: argparse.Namespace) -> int:
    from gradpress.registry import parse_spec
    from gradpress.testbed import data as datasets
    from gradpress.testbed.models import models
    from gradpress.testbed.train import parse_options

    name = args.data or models.get(parse_spec(args.model)[0]).dataset
    try:
        dataset = datasets.load(name)
    except datasets.DataUnavailable as error:
        raise cli.UsageError(f"--data {name} is not available: {error}") from None
    options = parse_options(args.option)
    _check_quality(args, dataset, options)
    points = []
    from rich.console import Console

    with Console(stderr=True).status("training") as status:
        for spec in split_specs(args.compressors):
            for n in args.workers:
                status.update(f"training {spec} with {n} simulated workers")
                points.append(train_simulated(args.model, dataset, n, spec, args.steps, args.batch_size,
                                              args.lr, args.seed, options))
    _console().print(render_quality(points))
    if args.json:
        cli.writable_parent(args.json).write_text(json.dumps([asdict(p) for p in points], indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_quality(points, args.plot)}")
    return 0


def _check_quality(args: argparse.Namespace, dataset: Dataset, options: dict[str, Any]) -> None:
    """Before training anything: the model for the data, a batch in the smallest shard, every
    compressor with the options at every number of workers (UsageError)."""
    from gradpress.runtime import Options
    from gradpress.testbed.train import check_model

    try:  # the options alone (with each compressor: below)
        Options.of(**{"seed": args.seed, **options})
    except ValueError as error:
        raise cli.UsageError(f"--option: {error}") from None
    try:
        settings = check_model(args.model, dataset)
    except ValueError as error:
        raise cli.UsageError(f"--model {args.model}: {error}") from None
    batch_size, most = args.batch_size or settings.batch_size, max(args.workers)
    if len(dataset.train) // most < batch_size:
        raise cli.UsageError(f"--batch-size {batch_size}: a shard of {dataset.name} for {most} workers holds "
                             f"{len(dataset.train) // most} samples, not one batch")
    for spec in split_specs(args.compressors):
        for n in sorted(set(args.workers)):
            try:
                gradpress.Simulator(spec, n, **{"seed": args.seed, **options})
            except ValueError as error:
                raise cli.UsageError(f"--compressors {spec} with {n} worker{'s' if n > 1 else ''}: {error}") from None


def _main_cost(args: argparse.Namespace) -> int:
    runs = load_results(*args.results)
    latency = fit_run_latency(runs) if args.latency == "fit" else args.latency
    console = _console()
    if args.latency == "fit":
        console.print(f"fitted latency α = {latency * 1e3:.3g} ms per message (least squares over the runs' "
                      "exposed communication)")
    checks, crossed = check_runs(runs, latency), cross_checks(runs, latency)
    for found, title in ((checks, "α–β model vs measured"),
                         (crossed, "α–β model carried to another n or link rate vs measured there")):
        if found:
            console.print(render_checks(found, title))
            if any(c.prediction.compute_source != "noop" for c in found):
                console.print("* no noop run of this setting: compute = step − compression − communication")
            errors = [abs(c.relative_error) for c in found if c.prediction.strategy is not None]
            if errors:
                console.print(f"communicating runs: mean |relative error| {statistics.fmean(errors):.1%}, "
                              f"largest {max(errors):.1%}")
    if not checks:
        console.print("no run over an emulated link (--bandwidth) to check the model against")
    paying = crossovers(runs, latency)
    if paying:
        console.print(render_crossovers(paying))
    predictions = []
    if args.workers or args.bandwidth:
        predictions = what_if(runs, args.workers, args.bandwidth, latency, args.strategy)
        if predictions:
            console.print(render_what_if(predictions))
        else:
            console.print("no prediction: the runs are over loopback; give --bandwidth")
    if args.json:
        out = {"latency": latency, "checks": [_check_dict(c) for c in checks],
               "cross_checks": [_check_dict(c) for c in crossed],
               "what_if": [_prediction_dict(p) for p in predictions],
               "crossovers": [asdict(c) for c in paying]}
        cli.writable_parent(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _check_dict(c: Check) -> dict[str, Any]:
    return {**_prediction_dict(c.prediction), "basis": c.basis, "measured_s": c.measured_s,
            "relative_error": c.relative_error, "within_bounds": c.within_bounds}


def _prediction_dict(p: Prediction) -> dict[str, Any]:
    out = asdict(p)
    out["samples_per_s"] = p.samples_per_s
    return out
