"""One rank of ``gradpress train``: a plain DDP training loop through the hook under test (or, for the
sharded rows, the model sharded with FSDP2: :mod:`.sharded`), each step timed and metered
(:func:`metered_step`), evaluations on rank 0 on a wall-clock that stands still while they run
(:class:`_Clock`), and the time budget (``--seconds``)."""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from gradpress.auto import is_auto
from gradpress.testbed import netem
from gradpress.testbed.results import REFERENCES, Eval, Run, Step
from gradpress.testbed.training import sharded
from gradpress.testbed.training.config import TrainConfig, simulated_options
from gradpress.testbed.training.hooks import Spent, _Meter, install_hook
from gradpress.testbed.training.timing import gradient_copy_s


def worker(config: TrainConfig, rank: int, address: str, port: int, result: Path) -> None:
    """One rank of ``train``: join the group, set the run up, train, and (rank 0) save the run."""
    import torch.distributed as dist

    torch.set_num_threads(config.threads)
    dist.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                            world_size=config.world_size, timeout=timedelta(seconds=config.timeout))
    try:
        run = _Training(config, rank, _setup(config, rank)).run()
        if rank == 0:
            run.save(result)
    finally:
        dist.destroy_process_group()


@dataclass
class _Setup:
    """What one rank trains with: its shard of the data, the model in DDP with the hook under test (``ddp``;
    a sharded run: the model itself, sharded, and on rank 0 ``plain``, an unsharded copy that evaluates
    its gathered parameters), the optimizer and loss, and the training settings (the model's own unless
    the config gives them)."""

    dataset: Any
    shard: Any
    settings: Any
    model: torch.nn.Module
    ddp: Any
    meter: _Meter
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    lr: float
    batch_size: int
    plain: torch.nn.Module | None = None


def _setup(config: TrainConfig, rank: int) -> _Setup:
    from torch.nn.parallel import DistributedDataParallel

    from gradpress.testbed import data as datasets
    from gradpress.testbed.models import criterion, model_config

    dataset = datasets.load(config.data)
    settings = model_config(config.model, dataset)
    torch.manual_seed(config.seed)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    model = settings.build()
    plain = None
    if config.sharding is None:
        ddp: Any = DistributedDataParallel(model)
        meter = install_hook(ddp, config)
    else:
        ddp, meter = model, sharded.install(model, config)
        plain = settings.build() if rank == 0 else None
    lr = config.lr if config.lr is not None else settings.lr
    return _Setup(dataset, dataset.shard(rank, config.world_size, seed=config.seed), settings, model, ddp,
                  meter, _optimizer(settings.optimizer, model.parameters(), lr),
                  criterion(dataset), lr, config.batch_size or settings.batch_size, plain)


def warm_up(config: TrainConfig) -> None:
    """Run ``config``'s method in this process on a small synthetic gradient (a :class:`gradpress.Simulator`
    of its workers and options, two steps: its error feedback's path too), so that numba compiles its
    kernels — or loads them from its on-disk cache — before the training clock starts. On a fresh machine
    the compilation takes up to a minute or two per method (THC's kernels), which would otherwise be charged
    to the first steps and to the method's time to target. ``auto`` warms each of its candidates and its
    ``measure_with`` alike (it runs the one and measures the others). The global random state is left as it
    was; PyTorch's own hooks have nothing to warm."""
    if config.compressor in REFERENCES:
        return
    import gradpress
    from gradpress.auto import AutoOptions

    options = simulated_options(config)
    specs = [config.compressor]
    if is_auto(config.compressor):
        from gradpress.auto.measure import preload

        preload()
        specs = list(AutoOptions.pop_from(options).methods)
    with torch.random.fork_rng():
        for spec in specs:
            try:
                sim = gradpress.Simulator(spec, config.world_size, **options)
            except ValueError:  # a candidate these options cannot run: auto leaves it out, saying why
                continue
            generator = torch.Generator().manual_seed(config.seed)
            for _ in range(2):
                sim.step([{"warm-up": torch.randn(70_000, generator=generator)}
                          for _ in range(config.world_size)])


class _Training:
    """One rank's training loop: steps timed and metered, evaluations on rank 0 at ``eval_every``
    steps, a wall-clock that stands still while they run, and the time budget (``--seconds``)."""

    def __init__(self, config: TrainConfig, rank: int, setup: _Setup) -> None:
        from gradpress.testbed.models import QUALITY

        self.config, self.rank, self.s = config, rank, setup
        self.metric, self.higher_is_better = QUALITY[setup.dataset.task]
        self.steps: list[Step] = []
        self.evals: list[Eval] = []
        self.clock = _Clock()
        self.bytes_total = 0
        # over the emulated network, rank 0 reads its node's link counter around each step
        self.link = rank == 0 and config.bandwidth is not None

    def run(self) -> Run:
        config, s = self.config, self.s
        per_epoch = len(s.shard.train) // s.batch_size
        if per_epoch == 0:
            raise ValueError(f"a shard of {len(s.shard.train)} samples holds no batch of {s.batch_size}")
        total = (config.steps if config.steps is not None else per_epoch * config.epochs
                 if config.epochs is not None else math.inf)
        eval_every = config.eval_every or per_epoch
        bar = _progress_bar(total, self.rank, config)
        step, epoch = 0, 0
        warm_up(config)
        self.measure(0, 0)
        self.clock.start()
        while step < total:
            generator = torch.Generator().manual_seed(config.seed * 100_003 + epoch * 1009 + self.rank)
            for x, y in s.shard.training_set(generator).batches(s.batch_size, generator, drop_last=True):
                loss = self.step(x, y, step + 1, epoch)
                step += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
                if (step % eval_every == 0 or step == total) and self.measure(epoch, step):
                    total = step  # the time budget is spent
                if step == total:
                    break
            epoch += 1
        if bar is not None:
            bar.close()
        copy_s = gradient_copy_s(s.model)
        return Run(compressor=config.compressor, model=config.model, data=config.data,
                   workers=config.world_size, nodes=config.nodes, bandwidth=config.bandwidth,
                   seed=config.seed, steps=tuple(self.steps), evals=tuple(self.evals),
                   info={"batch_size": s.batch_size, "lr": s.lr, "optimizer": s.settings.optimizer,
                         "torch": torch.__version__, "options": config.options, "threads": config.threads,
                         "copy_s": copy_s, **({"sharding": config.sharding} if config.sharding else {}),
                         **({"auto": s.meter.choice()} if s.meter.choice is not None else {})})

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int, epoch: int) -> torch.Tensor:
        """One training step, recorded: its compute (the training thread's time outside the hooks and the
        wait for the exchange), compression, communication and bytes, as the meter saw them, and over
        the emulated network the bytes that left rank 0's node over its link."""
        s = self.s
        link = netem.link_sent_bytes() if self.link else None
        loss, compute_s, spent = metered_step(s.ddp, s.meter, s.optimizer, s.loss_fn, x, y, s.settings.grad_clip)
        if link is not None:
            link = netem.link_sent_bytes() - link
        self.bytes_total += int(spent.bytes)
        self.steps.append(Step(step=step, epoch=epoch, wall_s=self.clock.elapsed(), compute_s=compute_s,
                               compress_s=spent.compress_s, comm_s=spent.comm_s, bytes_sent=int(spent.bytes),
                               samples=len(y) * self.config.world_size,
                               intra_node_bytes=int(spent.intra_node), link_bytes=link))
        return loss

    def measure(self, epoch: int, step: int) -> bool:
        """Evaluate (rank 0); whether the time budget is spent (rank 0 decides for every rank).

        The evaluation is stamped with the training wall-clock at the moment it begins: the clock
        stands still from here on (:meth:`_Clock.paused`), so neither this evaluation nor any earlier
        one is counted, and an evaluation slower than the steps between two of them cannot make
        ``wall_s`` go backwards."""
        import torch.distributed as dist

        from gradpress.testbed import models

        with self.clock.paused():
            wall_s = self.clock.elapsed()
            model = self.s.model
            if self.config.sharding is not None:  # every rank gathers the parameters; rank 0 evaluates them
                sharded.gather_parameters(model, self.s.plain)
                model = self.s.plain if self.s.plain is not None else model
            if self.rank == 0:
                quality = models.evaluate(model, self.s.dataset)
                self.evals.append(Eval(epoch=epoch, step=step, wall_s=wall_s, bytes_total=self.bytes_total,
                                       metric=self.metric, value=quality[self.metric],
                                       higher_is_better=self.higher_is_better, loss=quality["loss"]))
            if self.config.seconds is None:
                dist.barrier()
                return False
            spent = torch.tensor([self.rank == 0 and wall_s >= self.config.seconds], dtype=torch.uint8)
            dist.broadcast(spent, 0)
            return bool(spent)


def metered_step(ddp: Any, meter: _Meter, optimizer: torch.optim.Optimizer, loss_fn: Callable, x: Any, y: Any,
                 grad_clip: float | None = None) -> tuple[torch.Tensor, float, Spent]:
    """One DDP training step on batch ``(x, y)`` through the hook ``meter`` watches (or a sharded model's
    step, ``ddp`` the model: its reductions add their time to ``meter.in_hooks``): the loss (detached),
    the step's compute (its time less the time inside hooks and the wait for the exchange after the last
    bucket was handed off) and what the hooks spent (:class:`Spent`)."""
    started = time.perf_counter()
    before, hooked = meter.snapshot(), meter.in_hooks
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(ddp(x), y)
    loss.backward()
    waited = max(0.0, time.perf_counter() - meter.handed_off) if meter.handed_off > started else 0.0
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(getattr(ddp, "module", ddp).parameters(), grad_clip)
    optimizer.step()
    elapsed = time.perf_counter() - started
    return loss.detach(), max(0.0, elapsed - (meter.in_hooks - hooked) - waited), meter.snapshot() - before


class _Clock:
    """Training wall-clock that stops while the model is evaluated.

    :meth:`elapsed` is the time since :meth:`start` less every pause. Inside :meth:`paused` it stands
    still at the moment the pause began, so what is read there (an evaluation's ``wall_s``, the time
    budget) is the training time before the pause, whether it is read before or after the evaluation.
    ``now`` is the time source (a test hands in a controlled one).
    """

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self._now = now
        self._start: float | None = None
        self._paused = 0.0  # the length of every finished pause after start()
        self._since: float | None = None  # when the pause under way began

    def start(self) -> None:
        self._start = self._now()

    def elapsed(self) -> float:
        if self._start is None:
            return 0.0
        now = self._now() if self._since is None else max(self._since, self._start)
        return now - self._start - self._paused

    def paused(self):  # noqa: ANN201
        import contextlib

        @contextlib.contextmanager
        def pause():
            if self._since is not None:  # nested: the pause under way already stops the clock
                yield
                return
            self._since = self._now()
            try:
                yield
            finally:
                if self._start is not None:
                    self._paused += self._now() - max(self._since, self._start)
                self._since = None

        return pause()


def _optimizer(name: str, parameters: Any, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(parameters, lr=lr)
    raise ValueError(f"unknown optimizer {name!r} (sgd, adam)")


def _progress_bar(total: float, rank: int, config: TrainConfig):  # noqa: ANN202
    if rank != 0 or os.environ.get("GRADPRESS_PROGRESS", "1") == "0":
        return None
    from tqdm import tqdm

    workers = f"{config.workers} workers"
    if config.nodes > 1:
        workers = f"{config.nodes} nodes × {workers}"
    return tqdm(total=total if math.isfinite(total) else None,
                desc=f"{config.compressor} · {config.model} · {workers}",
                unit="step", file=sys.stderr, dynamic_ncols=True)
