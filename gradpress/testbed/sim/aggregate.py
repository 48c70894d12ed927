"""``gradpress sim nmse``: how far the aggregate of n simulated workers is from the true mean, against n
(see :mod:`gradpress.testbed.sim`)."""
from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import gradpress
from gradpress.testbed.sim.common import Progress, check_positive, plot_lines, quiet

DEFAULT_WORKERS = (4, 16, 64, 256, 1024)
DISTRIBUTIONS = ("normal", "lognormal")
#: NMSE below this is fp32 rounding of the sum, not compression error
ROUNDING = 1e-10


def worker_vectors(n: int, numel: int, dist: str, generator: torch.Generator,
                   spread: float = 1.0) -> list[torch.Tensor]:
    """``n`` workers' vectors x_i = s + spread·ξ_i (package doc): s from ``dist``, ξ_i ~ N(0, 1)."""
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
                    progress: Progress = quiet) -> list[NMSEPoint]:
    """NMSE of :func:`gradpress.simulate`'s aggregate for every spec and n (package doc).

    Trial t of every spec and n draws its vectors from a generator seeded with ``seed`` and runs the
    compressors with seed ``seed + t``, so compressors are compared on the same vectors.
    """
    check_positive(numel=numel, trials=trials)
    for n in workers:
        check_positive(workers=n)
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
    series: dict[str, list[tuple[float, float]]] = {}
    for spec, mine in _by_spec(points).items():
        label = spec + (" (fp32 rounding)" if _rounding_only(mine) else "")
        series[label] = [(p.workers, p.nmse) for p in mine if p.nmse > 0]
    unbiased = [mine for mine in _by_spec(points).values() if mine[0].unbiased and mine[0].nmse > ROUNDING]
    guide = unbiased[0] if unbiased else None
    extra: tuple[str, list[tuple[float, float]]] | None = None
    if guide:
        n0, e0 = guide[0].workers, guide[0].nmse
        extra = ("∝ 1/n", [(p.workers, e0 * n0 / p.workers) for p in guide])
    return plot_lines(series, path, "workers n", "NMSE of the aggregate", title, logy=True, guide=extra)
