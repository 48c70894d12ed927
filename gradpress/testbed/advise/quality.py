"""Quality after K simulated steps, and the steps each method takes to the uncompressed quality
(``advise --quality-steps``, see :mod:`gradpress.testbed.advise`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from gradpress.testbed.advise.workload import Workload, _optimizer

#: the method whose quality sets the target (the exact mean, as torch-allreduce computes it)
QUALITY_REFERENCE = "none"


@dataclass(frozen=True)
class QualityCurve:
    """``spec``'s quality at checkpoints (step, value) of a simulated run with ``workers`` workers."""

    spec: str
    workers: int
    metric: str
    higher_is_better: bool
    points: tuple[tuple[int, float], ...]
    seconds: float

    @property
    def best(self) -> float:
        values = [v for _, v in self.points if math.isfinite(v)]
        if not values:
            return math.nan
        return max(values) if self.higher_is_better else min(values)


def checkpoints(steps: int, count: int = 10) -> list[int]:
    """About ``count`` evaluation steps from 1 to ``steps`` (``steps`` included), evenly spaced."""
    every = max(1, round(steps / count))
    return sorted({*range(every, steps + 1, every), steps})


def quality_curve(workload: Workload, spec: str, *, workers: int, steps: int, seed: int = 0) -> QualityCurve:
    """Train with ``workers`` simulated workers exchanging through ``spec`` (``gradpress sim quality``'s loop:
    each worker's gradient of its own batch, :class:`gradpress.Simulator`, the workload's optimizer),
    evaluating at :func:`checkpoints` (and before the first step). A run whose gradients turn NaN/Inf
    ends there with a NaN point (it reaches no target)."""
    import gradpress
    from gradpress.testbed.sim.quality import _worker_gradients

    if workload.train_batches is None or workload.evaluate is None or workload.metric is None:
        raise ValueError(workload.quality_unavailable or "this workload has no quality to measure")
    at = set(checkpoints(steps))
    batches = [workload.train_batches(rank, workers, seed) for rank in range(workers)]
    simulator = gradpress.Simulator(spec, workers, seed=seed)
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        net = workload.build()
        params = [p for p in net.parameters() if p.requires_grad]
        optimizer = _optimizer(workload.optimizer, params, workload.lr)
        points = [(0, float(workload.evaluate(net)))]
        for step in range(1, steps + 1):
            grads, _ = _worker_gradients(net, batches, workload.loss)
            try:
                mean = simulator.step(grads)
            except gradpress.NonFiniteError:  # diverged: it reaches no target from here on
                points.append((step, math.nan))
                break
            for name, parameter in net.named_parameters():
                if parameter.requires_grad:
                    parameter.grad = mean[name]
            if workload.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, workload.grad_clip)
            optimizer.step()
            if step in at:
                points.append((step, float(workload.evaluate(net))))
    return QualityCurve(spec, workers, workload.metric, workload.higher_is_better, tuple(points),
                        time.perf_counter() - started)


def default_tolerance(metric: str, reference_best: float) -> float:
    """``compare``'s report tolerance for a testbed metric; 1 % of the reference's best for a loss."""
    from gradpress.testbed.report import DEFAULT_TOLERANCE

    return DEFAULT_TOLERANCE.get(metric, 0.01 * abs(reference_best))


def quality_target(reference: QualityCurve, tolerance: float | None = None) -> float:
    """The reference's best quality, less (higher is better) or plus ``tolerance``."""
    best = reference.best
    tolerance = default_tolerance(reference.metric, best) if tolerance is None else tolerance
    return best - tolerance if reference.higher_is_better else best + tolerance


def steps_to_reach(curve: QualityCurve, target: float) -> float | None:
    """The step at which ``curve`` first reaches ``target``, linearly interpolated between the checkpoints
    around the crossing; None if it never does."""
    def reached(value: float) -> bool:
        return math.isfinite(value) and (value >= target if curve.higher_is_better else value <= target)

    previous = None
    for step, value in curve.points:
        if reached(value):
            if previous is None or not math.isfinite(previous[1]) or previous[1] == value:
                return float(step)
            (s0, v0) = previous
            return s0 + (target - v0) / (value - v0) * (step - s0)
        previous = (step, value)
    return None
