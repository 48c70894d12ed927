"""``gradpress sim quality``: synchronous data-parallel SGD with n simulated workers, and the quality it
reaches against n (see :mod:`gradpress.testbed.sim`)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import gradpress
from gradpress.testbed.data import Dataset
from gradpress.testbed.sim.common import check_positive, plot_lines


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
    workers exchanging through ``spec`` for ``steps`` steps (package doc); quality before and after.

    The model is built from ``seed``, or ``net``, an instance of ``model``, is trained in place; the
    global torch RNG is left as it was (initialization and dropout draw from a fork seeded by ``seed``).
    """
    from gradpress.testbed.models import QUALITY, criterion, evaluate, model_config
    from gradpress.testbed.train import _optimizer

    check_positive(workers=workers, steps=steps)
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
        for buffer, value in zip(net.buffers(), saved, strict=True):
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
    return plot_lines(series, path, "workers n", f"{first.metric} after {first.steps} steps",
                      f"{first.model} on {first.data}", logy=False)
