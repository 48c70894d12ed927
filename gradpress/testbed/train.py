"""``gradpress train``: one model trained by N local worker processes with DDP and a gradient hook.

The launcher fetches the data once, optionally builds the emulated network (:mod:`.netem`), starts one
process per worker (``python -m gradpress.testbed.train --worker``), and returns rank 0's
:class:`~gradpress.testbed.results.Run`. If any worker fails the others are stopped and the error
says which rank failed and why; the network is deleted in every case. ``--nodes M`` emulates M nodes
of ``--workers`` k processes each (world size M·k): every worker gets the variables torchrun would set
on its node (:func:`torchrun_environment`), so ``hierarchy="node"`` finds k ranks a node; with
``--bandwidth``, the workers of a node share a namespace and only the links between nodes are limited.

The worker is a plain DDP training loop. The hook is the gradpress compressor named by the spec, or one
of the reference rows (GRACE Section 5's baselines): ``noop`` (no communication: the compute-only upper
bound), ``torch-allreduce`` (PyTorch's all-reduce hook), ``torch-fp16`` (``fp16_compress_hook``),
``torch-powersgd`` (``powerSGD_hook``, Vogels et al. 2019, rank 1).

Per step it records wall-clock (evaluation excluded), compute time, compression time, communication
time and the bytes this rank handed to collectives (``Packet.nbytes``; for the reference rows, the
sizes of the tensors their hooks communicate). Compression runs inside the backward pass, and after the
last bucket is handed to the hook, ``backward()`` only waits for communication: compute time is the
step's time minus compression time minus that wait. Communication overlaps the backward pass and is
reported as measured from issue to completion.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

from gradpress.auto import is_auto
from gradpress.testbed import arguments, netem
from gradpress.testbed.results import REFERENCES, Eval, Run, Step

PORT = 29511


class TrainFailed(RuntimeError):
    """A worker process failed; the message carries its exit status and the end of its output."""


@dataclass
class TrainConfig:
    """What ``gradpress train`` runs (also what the launcher hands every worker, as JSON)."""

    model: str = "mlp"
    data: str = "fashion-mnist"
    workers: int = 2  # per node
    compressor: str = "none"
    bandwidth: str | None = None
    epochs: int | None = None
    steps: int | None = None
    seconds: float | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    eval_every: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    timeout: float = 300.0
    threads: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("workers", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.epochs is not None and self.steps is not None:
            raise ValueError("give --epochs or --steps, not both")
        if self.seconds is not None and not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"--seconds must be a positive number, got {self.seconds}")
        for name in ("epochs", "steps", "batch_size", "eval_every", "threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        for name in ("lr", "timeout"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and not (number and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.epochs is None and self.steps is None and self.seconds is None:
            self.epochs = 1
        if self.bandwidth is not None:
            netem.rate_bits_per_second(self.bandwidth)
        if self.compressor not in REFERENCES and not is_auto(self.compressor):
            import gradpress

            gradpress.make(self.compressor)  # unknown specs fail here, in the launcher

    @property
    def world_size(self) -> int:
        """The ranks of the run: ``nodes`` × ``workers`` (a node's)."""
        return self.nodes * self.workers


# -- the launcher --------------------------------------------------------------------------------------
def train(config: TrainConfig, json_path: str | Path | None = None, progress: bool = True) -> Run:
    """Run ``config`` on local worker processes and return rank 0's record (also saved to ``json_path``)."""
    from gradpress.testbed import data

    data.fetch(config.data)  # once, here: workers only load
    with tempfile.TemporaryDirectory(prefix="gradpress-train-") as scratch:
        result = Path(scratch) / "run.json"
        network = None
        if config.bandwidth is None:
            _launch(config, result, progress, address="127.0.0.1", port=_free_port(), star=None)
        else:
            # one node: every worker on a link of its own; several: the workers of a node share its link
            shape = (config.nodes, config.workers) if config.nodes > 1 else (config.workers, 1)
            with netem.emulated_star(shape[0], config.bandwidth, workers_per_node=shape[1]) as star:
                _launch(config, result, progress, address=star.addresses[0], port=PORT, star=star)
            network = star.settings()
        run = Run.from_json(result.read_text())
        if network is not None:  # the links' tbf settings, for the cost model's token bucket
            run = replace(run, info={**run.info, "network": network})
    if json_path is not None:
        run.save(json_path)
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_environment(rank: int, nodes: int, workers_per_node: int, address: str,
                         port: int) -> dict[str, str]:
    """The variables torchrun sets for worker ``rank`` of ``nodes`` nodes of ``workers_per_node``
    processes each (``--nnodes``, ``--nproc-per-node``; ranks numbered node by node)."""
    node, local = divmod(rank, workers_per_node)
    world = nodes * workers_per_node
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(workers_per_node), "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": address, "MASTER_PORT": str(port)}


def _launch(config: TrainConfig, result: Path, progress: bool, address: str, port: int,
            star: netem.Star | None) -> None:
    payload = json.dumps(asdict(config))
    processes = []
    for rank in range(config.world_size):
        argv = [sys.executable, "-m", "gradpress.testbed.train", "--worker", payload, str(rank), address,
                str(port), str(result)]
        env = {**os.environ, "OMP_NUM_THREADS": str(config.threads), "GRADPRESS_PROGRESS": str(int(progress)),
               **torchrun_environment(rank, config.nodes, config.workers, address, port)}
        if star is not None:
            argv = star.command(rank, argv)
            env.update(star.environment(rank))
            # no reverse DNS inside the namespaces: c10d would warn about it at every connection
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        else:
            env["GLOO_SOCKET_IFNAME"] = "lo"
        stderr = None if rank == 0 else subprocess.PIPE
        processes.append(subprocess.Popen(argv, env=env, stderr=stderr, stdin=subprocess.DEVNULL))
    try:
        _wait(processes, deadline=time.monotonic() + 24 * 3600, result=result)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def _wait(processes: list[subprocess.Popen], deadline: float, result: Path | None = None) -> None:
    """Wait for every worker; the first failure stops the others and raises :class:`TrainFailed`.

    ``result``: the run's result path, beside which a failing worker records its exception
    (:func:`_record_failure`). The message's first line names the worker and why it failed (the
    earliest recorded exception among the failed workers: a worker that fails first makes the others
    fail on the broken connection after it); the end of that worker's stderr follows, where captured."""
    while True:
        codes = [p.poll() for p in processes]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            reasons = {rank: _failure(result, rank) for rank, _ in failed} if result is not None else {}
            recorded = [(reason[0], rank, code) for rank, code in failed if (reason := reasons.get(rank))]
            rank, code = min(recorded)[1:] if recorded else failed[0]
            for p in processes:
                if p.poll() is None:
                    p.terminate()
            tail, stderr = "", processes[rank].stderr
            if stderr is not None:
                tail = stderr.read().decode(errors="replace")[-3000:]
            why = found[1] if (found := reasons.get(rank)) else ""
            raise TrainFailed(f"worker {rank} exited with status {code}" + (f": {why}" if why else "")
                              + (f"\n{tail}" if tail else ""))
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            raise TrainFailed("training did not finish in time")
        time.sleep(0.05)


def _failure_path(result: Path, rank: int) -> Path:
    return result.with_name(f"error-{rank}.txt")


def _record_failure(result: Path, rank: int, error: BaseException) -> None:
    """Leave ``error`` beside the result for the launcher (:func:`_wait` puts it in TrainFailed)."""
    try:
        _failure_path(result, rank).write_text(arguments.one_line(f"{type(error).__name__}: {error}")[:1000])
    except OSError:
        pass


def _failure(result: Path, rank: int) -> tuple[int, str] | None:
    """(when, why) worker ``rank`` failed, as it recorded it; None if it recorded nothing."""
    path = _failure_path(result, rank)
    try:
        return path.stat().st_mtime_ns, path.read_text().strip()
    except OSError:
        return None


# -- the worker -----------------------------------------------------------------------------------------
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
    """What one rank trains with: its shard of the data, the model in DDP with the hook under test, the
    optimizer and loss, and the training settings (the model's own unless the config gives them)."""

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


def _setup(config: TrainConfig, rank: int) -> _Setup:
    from torch.nn.parallel import DistributedDataParallel

    from gradpress.testbed import data as datasets
    from gradpress.testbed.models import criterion, model_config

    dataset = datasets.load(config.data)
    settings = model_config(config.model, dataset)
    torch.manual_seed(config.seed)  # the same initial model on every rank (DDP also broadcasts rank 0's)
    model = settings.build()
    ddp = DistributedDataParallel(model)
    lr = config.lr if config.lr is not None else settings.lr
    return _Setup(dataset, dataset.shard(rank, config.world_size, seed=config.seed), settings, model, ddp,
                  install_hook(ddp, config), _optimizer(settings.optimizer, model.parameters(), lr),
                  criterion(dataset), lr, config.batch_size or settings.batch_size)


def warm_up(config: TrainConfig) -> None:
    """Run ``config``'s method in this process on a small synthetic gradient (a :class:`gradpress.Simulator`
    of its workers and options, two steps: its error feedback's path too), so that numba compiles its
    kernels — or loads them from its on-disk cache — before the training clock starts. On a fresh
    machine the compilation takes up to a minute or two per method (THC's kernels), which would otherwise be
    charged to the first steps and to the method's time to target. The global random state is left as
    it was; PyTorch's own hooks and ``auto`` (whose methods are chosen later) have nothing to warm."""
    if config.compressor in REFERENCES or is_auto(config.compressor):
        return
    import gradpress

    with torch.random.fork_rng():
        sim = gradpress.Simulator(config.compressor, config.world_size, **simulated_options(config))
        generator = torch.Generator().manual_seed(config.seed)
        for _ in range(2):
            sim.step([{"warm-up": torch.randn(70_000, generator=generator)}
                      for _ in range(config.world_size)])


def simulated_options(config: TrainConfig) -> dict[str, Any]:
    """The runtime options of ``config``'s workers for a :class:`gradpress.Simulator` of its world: its
    seed, and with ``hierarchy``, the node size the workers read from torchrun's ``LOCAL_WORLD_SIZE``
    (unless the options give ``local_size``)."""
    options = {"seed": config.seed, **config.options}
    if options.get("hierarchy") is not None:
        options.setdefault("local_size", config.workers)
    return options


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
                         "copy_s": copy_s,
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
            if self.rank == 0:
                quality = models.evaluate(self.s.model, self.s.dataset)
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
    """One DDP training step on batch ``(x, y)`` through the hook ``meter`` watches: the loss (detached),
    the step's compute (its time less the time inside hooks and the wait for the exchange after the last
    bucket was handed off) and what the hooks spent (:class:`Spent`)."""
    started = time.perf_counter()
    before, hooked = meter.snapshot(), meter.in_hooks
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(ddp(x), y)
    loss.backward()
    waited = max(0.0, time.perf_counter() - meter.handed_off) if meter.handed_off > started else 0.0
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), grad_clip)
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


def gradient_copy_s(model: torch.nn.Module) -> float:
    """:func:`copy_s` of a tensor the size of ``model``'s trainable parameters, timed on this rank after
    training, in the same process and load as the steps: the unit in which the reports state per-step
    costs (compression, a step's excess over ``noop``'s)."""
    return copy_s(sum(p.numel() for p in model.parameters() if p.requires_grad))


def copy_s(numel: int, repeats: int = 21) -> float:
    """Median seconds of one copy of a float32 tensor of ``numel`` values from memory into memory
    (``dst.copy_(src)``), after one untimed round: into a kept buffer, so no page faults, and from and
    to tensors that the copies since their last use have evicted from the last-level cache (a rotation
    through pairs of buffers holding more than twice the cache), so neither end is cache-hot.

    A ``clone()`` is not that stable a unit: it lands in memory the allocator has just freed (for 13 MB
    here, read and written within the 32 MB L3: ~0.5 ms) or in fresh pages (page faults: ~10x), which
    moved a 13 MB clone between 0.48 and 1.24 ms in the runs of one ``compare``."""
    nbytes = 4 * max(1, numel)
    cache = last_level_cache_bytes()
    # (a tensor under 1/256 of the cache stays in it: its copy is mostly the call's overhead anyway)
    pairs = 1 if nbytes >= 2 * cache else min(256, 1 + math.ceil(cache / nbytes))
    pool = torch.randn(2 * pairs, numel)
    times = []
    for i in range(pairs + repeats):
        source, target = pool[i % pairs], pool[pairs + i % pairs]
        started = time.perf_counter()
        target.copy_(source)
        if i >= pairs:
            times.append(time.perf_counter() - started)
    return sorted(times)[repeats // 2]


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """The largest CPU cache's size that Linux reports (``/sys/devices/system/cpu/cpu0/cache``), else
    ``default``."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20, "G": 30}[text[-1]] if text[-1] in "KMG"
                         else int(text))
        except (OSError, ValueError, KeyError):
            continue
    return max(sizes, default=default)


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


# -- hooks and what they cost -------------------------------------------------------------------------
@dataclass
class Spent:
    compress_s: float = 0.0
    comm_s: float = 0.0
    bytes: float = 0.0
    intra_node: float = 0.0  # bytes sent inside the node (hierarchy="node"'s uncompressed exchange)

    def __sub__(self, other: Spent) -> Spent:
        return Spent(self.compress_s - other.compress_s, self.comm_s - other.comm_s, self.bytes - other.bytes,
                     self.intra_node - other.intra_node)


class _Meter:
    """Cumulative compression time, communication time and bytes, read before and after each step; the
    time the training thread spent inside hooks, and when the last bucket of the step was handed to its
    hook (after which DDP's backward only waits)."""

    def __init__(self, read: Callable[[], Spent]) -> None:
        self.snapshot = read
        self.handed_off = 0.0
        self.in_hooks = 0.0
        self.choice: Callable[[], dict[str, Any]] | None = None  # auto: what it chose and why

    def stamped(self, hook: Callable) -> Callable:
        """``hook`` recording how long it runs and when it returns: the exposed communication of a step
        is the time from the last bucket's hand-off to the end of ``backward()``."""

        def stamped_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks hook annotations literally
            began = time.perf_counter()
            future = hook(state, bucket)
            self.handed_off = time.perf_counter()
            self.in_hooks += self.handed_off - began
            return future

        return stamped_hook


def install_hook(ddp: Any, config: TrainConfig) -> _Meter:
    """Register ``config.compressor``'s hook on ``ddp`` (a gradpress spec, or a reference row of
    :data:`~gradpress.testbed.results.REFERENCES`) and return the meter that reads what it spends."""
    if config.compressor not in REFERENCES:
        import gradpress

        options = {"seed": config.seed, "process_group": ddp.process_group, **config.options}
        state, hook = gradpress.ddp_comm_hook(config.compressor, model=ddp.module, **options)

        def read() -> Spent:
            total = state.stats()["total"]
            return Spent(total["compress_s"] + total["decompress_s"], total["comm_s"], total["packet_bytes"],
                         total["intra_node_sent_bytes"])

        meter = _Meter(read)
        ddp.register_comm_hook(state, meter.stamped(hook))
        if is_auto(config.compressor):
            def choice() -> dict[str, Any]:
                said = state.stats()["auto"]
                return {"reason": said["reason"], "decided_at": said["decided_at"],
                        "specs": [b["spec"] for b in said.get("buckets") or []]}

            meter.choice = choice
        return meter
    return _install_reference_hook(ddp, config.compressor)


def _install_reference_hook(ddp: Any, name: str) -> _Meter:
    """PyTorch's own hooks, wrapped to count the bytes they hand to collectives and their duration."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    spent = Spent()
    meter = _Meter(lambda: Spent(spent.compress_s, spent.comm_s, spent.bytes))

    def timed(inner: Callable, nbytes: Callable[[Any], int]) -> Callable:
        def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks hook annotations literally
            spent.bytes += nbytes(bucket)
            began = time.perf_counter()

            def done(future: torch.futures.Future) -> torch.Tensor:
                spent.comm_s += time.perf_counter() - began
                return future.value()

            return inner(state, bucket).then(done)

        return hook

    if name == "noop":
        def noop(state, bucket):  # noqa: ANN001, ANN202 - DDP checks hook annotations literally
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future

        ddp.register_comm_hook(None, meter.stamped(noop))
    elif name == "torch-allreduce":
        ddp.register_comm_hook(dist.group.WORLD, meter.stamped(timed(default_hooks.allreduce_hook, _buffer_bytes)))
    elif name == "torch-fp16":
        half = timed(default_hooks.fp16_compress_hook, lambda b: _buffer_bytes(b) // 2)
        ddp.register_comm_hook(dist.group.WORLD, meter.stamped(half))
    elif name == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, min_compression_rate=2)
        power = timed(powerSGD_hook.powerSGD_hook, lambda b: _powersgd_bytes(state, b))
        ddp.register_comm_hook(state, meter.stamped(power))
    else:
        raise ValueError(f"unknown reference {name!r}; references: {', '.join(REFERENCES)}")
    return meter


def _buffer_bytes(bucket: Any) -> int:
    buffer = bucket.buffer()
    return buffer.numel() * buffer.element_size()


def _powersgd_bytes(state: Any, bucket: Any) -> int:
    """What ``powerSGD_hook`` all-reduces for a bucket: the whole bucket before ``start_powerSGD_iter``;
    afterwards 1-D gradients and matrices not worth compressing in full, and P (m×r) and Q (n×r) for the
    others (torch's ``_should_compress`` rule)."""
    if state.iter < state.start_powerSGD_iter:
        return _buffer_bytes(bucket)
    rank, total = state.matrix_approximation_rank, 0
    for gradient in bucket.gradients():
        size = gradient.element_size()
        if gradient.dim() <= 1:
            total += gradient.numel() * size
            continue
        rows, cols = gradient.shape[0], gradient.numel() // gradient.shape[0]
        compressed = (rows + cols) * min(rank, rows, cols)
        total += (compressed if compressed * state.min_compression_rate < rows * cols else rows * cols) * size
    return total


# -- command line -----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``gradpress train`` and ``compare``, each checked as it is parsed
    (:mod:`gradpress.testbed.arguments`, and :func:`model_spec`, :func:`runtime_option` below)."""
    from gradpress.testbed.data import dataset_names

    parser.add_argument("--model", type=model_spec, default="mlp",
                        help="model spec (gradpress.testbed.models), e.g. mlp-wide:width=8192")
    parser.add_argument("--data", default="fashion-mnist", choices=dataset_names(), help="dataset")
    parser.add_argument("--workers", type=arguments.positive_int, default=2,
                        help="local worker processes per node: the run has --nodes × --workers ranks")
    parser.add_argument("--nodes", type=arguments.positive_int, default=1,
                        help="emulated nodes, each of --workers processes with torchrun's variables "
                             "(LOCAL_WORLD_SIZE, LOCAL_RANK, GROUP_RANK, ...), so that --option "
                             "hierarchy=node makes a node of each")
    parser.add_argument("--bandwidth", type=arguments.rate,
                        help="emulate a star network with this rate per link (e.g. 100mbit, 1gbit; root): "
                             "with one node, a link per worker; with --nodes, a link per node, its workers "
                             "talking to each other inside it, unlimited")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=arguments.positive_int)
    length.add_argument("--steps", type=arguments.positive_int)
    parser.add_argument("--seconds", type=arguments.positive_float,
                        help="train for this much wall-clock (evaluation excluded), ending at the first "
                             "evaluation past it; with --steps or --epochs, whichever ends first")
    parser.add_argument("--batch-size", type=arguments.positive_int,
                        help="per-worker batch size (default: the model's)")
    parser.add_argument("--lr", type=arguments.positive_float, help="learning rate (default: the model's)")
    parser.add_argument("--seed", type=arguments.seed, default=0)
    parser.add_argument("--eval-every", type=arguments.positive_int,
                        help="evaluate every this many steps (default: each epoch)")
    parser.add_argument("--option", type=runtime_option, action="append", default=[], metavar="KEY=VALUE",
                        help="gradpress runtime option (feedback, min_numel, warmup_steps, mode, master, "
                             "...), each key once; the seed and timeout are --seed and --timeout")
    parser.add_argument("--timeout", type=arguments.positive_float, default=300.0,
                        help="seconds before a stuck collective raises")
    parser.add_argument("--threads", type=arguments.positive_int, default=1, help="torch threads per worker")


def config_from_args(args: argparse.Namespace, compressor: str) -> TrainConfig:
    return TrainConfig(model=args.model, data=args.data, workers=args.workers, nodes=args.nodes,
                       compressor=compressor,
                       bandwidth=args.bandwidth, epochs=args.epochs, steps=args.steps, seconds=args.seconds,
                       batch_size=args.batch_size,
                       lr=args.lr, seed=args.seed, eval_every=args.eval_every,
                       options=parse_options(args.option), timeout=args.timeout, threads=args.threads)


#: the runtime options that ``train`` and ``compare`` take as flags of their own, not as ``--option``
DEDICATED = {"seed": "--seed", "timeout": "--timeout"}


def parse_options(items: list[str], dedicated: dict[str, str] | None = None) -> dict[str, Any]:
    """``["min_numel=1024", "exclude=net.0.*", "feedback=none"]`` -> typed runtime options. A key given
    twice, or one of ``dedicated`` (key -> the command's own flag for it; default :data:`DEDICATED`),
    raises ValueError: neither value would be sure to be the one used."""
    dedicated = DEDICATED if dedicated is None else dedicated
    options: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--option {item!r}: expected KEY=VALUE")
        if key in dedicated:
            raise ValueError(f"--option {item}: give {dedicated[key]} instead (the command's own flag)")
        if key in options:
            first = next(i for i in items if i.partition("=")[0] == key)
            raise ValueError(f"--option {key} is given twice ({first!r}, {item!r}); give it once")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


# -- checks before any worker starts ------------------------------------------------------------------------
def check_options(options: dict[str, Any]) -> None:
    """Raise ValueError unless every key is a runtime option (a field of :class:`gradpress.exchange.pipeline.Options`)
    and its value has the option's type; ranges and combinations are :func:`check_exchange`'s."""
    import dataclasses
    import typing

    from gradpress.exchange.pipeline import Options

    hints = typing.get_type_hints(Options)
    known = [f.name for f in dataclasses.fields(Options) if f.init]
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"unknown option {key!r}; the options are: {', '.join(known)}")
        if not _fits(value, hints[key]):
            raise ValueError(f"option {key}={value!r}: expected {_type_words(hints[key])}")


def _fits(value: Any, annotation: Any) -> bool:
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return value in args
    if origin in (tuple, list):  # one item, or a JSON list of them (Options turns a str into a tuple)
        return _fits(value, args[0]) or (isinstance(value, list) and all(_fits(v, args[0]) for v in value))
    return True  # a type not described here: Options checks it


def _type_words(annotation: Any) -> str:
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_words(a) for a in args)
    if origin in (tuple, list):
        return f"{_type_words(args[0])} or a JSON list of them"
    return {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
            str: "a string"}.get(annotation, str(annotation))


def check_model(spec: str, dataset: Any = None) -> Any:
    """The configuration of model ``spec`` (:func:`~gradpress.testbed.models.model_config`), checked: a known
    name and keys, ``dataset``'s task, values the model accepts (it is built on the meta device: no
    memory, no time). Raises ValueError."""
    from gradpress.testbed.models import model_config

    settings = model_config(spec, dataset)
    try:
        with torch.device("meta"):
            settings.build()
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - an operation the meta device lacks: the workers build it for real
        pass
    return settings


# -- argument types of the testbed's own values, as those of gradpress.testbed.arguments --------------------
def model_spec(text: str) -> str:
    """A testbed model spec (``mlp-wide:width=8192``): known name and keys, values the model accepts
    (:func:`check_model`)."""
    try:
        check_model(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(arguments.one_line(error)) from None
    return text


def runtime_option(text: str) -> str:
    """``KEY=VALUE``: a runtime option (:class:`gradpress.exchange.pipeline.Options`) with a value of its
    type (:func:`parse_options`, :func:`check_options`)."""
    if "=" not in text or not text.partition("=")[0].strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        check_options(parse_options([text]))
    except ValueError as error:
        raise argparse.ArgumentTypeError(arguments.one_line(error)) from None
    return text


def check_exchange(config: TrainConfig) -> None:
    """Raise ValueError unless ``config``'s compressor, options and number of workers fit together: the
    runtime's own checks, run in this process by :class:`gradpress.Simulator` (no worker starts)."""
    import gradpress
    from gradpress.auto import AutoOptions
    from gradpress.exchange.hierarchy import Layout
    from gradpress.exchange.hierarchy import check_options as check_levels
    from gradpress.exchange.pipeline import Options

    check_options(config.options)
    options = simulated_options(config)
    if config.compressor in REFERENCES:
        Options.of(**options)
    elif is_auto(config.compressor):  # its pipelines are built, and checked, per chosen method
        AutoOptions.pop_from(options)
        check_levels(Options.of(**options), auto=True)
    else:
        sim = gradpress.Simulator(config.compressor, config.world_size, **options)
        if sim.options.hierarchy is not None:  # (the ranks would find a bad layout at their first step)
            problem = Layout(0, config.world_size, options["local_size"]).problem
            if problem is not None:
                raise ValueError(problem)


def check_launch(config: TrainConfig) -> Any:
    """What ``gradpress train`` and ``compare`` check before any worker starts, beyond each argument
    (:mod:`gradpress.testbed.arguments`): the data (fetched, as :func:`train` does, and loaded), the model for it, a
    batch that a worker's shard holds, the emulated network's needs. Raises
    :class:`~gradpress.testbed.arguments.UsageError`; returns the loaded dataset."""
    from gradpress.testbed import data

    try:
        data.fetch(config.data)
        dataset = data.load(config.data)
    except (data.DataUnavailable, ValueError) as error:
        raise arguments.UsageError(f"--data {config.data}: {error}") from None
    try:
        settings = check_model(config.model, dataset)
    except ValueError as error:
        raise arguments.UsageError(f"--model {config.model}: {error}") from None
    batch_size = config.batch_size or settings.batch_size
    shard = len(dataset.train) // config.world_size
    if shard < batch_size:
        raise arguments.UsageError(f"--batch-size {batch_size}: a worker's shard of {config.data} holds {shard} "
                                   f"samples ({len(dataset.train)} over {config.world_size} workers), "
                                   "not one batch")
    if config.bandwidth is not None:
        links = config.nodes if config.nodes > 1 else config.workers
        if links > netem.MAX_NODES:
            what = "nodes" if config.nodes > 1 else "workers"
            raise arguments.UsageError(f"--bandwidth {config.bandwidth}: the emulated network holds at most "
                                       f"{netem.MAX_NODES} {what}, got {links}")
        try:
            netem.check_available()
        except netem.NetworkUnavailable as error:
            raise arguments.UsageError(f"--bandwidth {config.bandwidth}: {error}") from None
    return dataset


def checked_config(args: argparse.Namespace, compressor: str) -> TrainConfig:
    """:func:`config_from_args` with :func:`check_launch`'s checks (UsageError)."""
    from gradpress.exchange.pipeline import Options

    try:
        config = config_from_args(args, compressor)
    except ValueError as error:
        raise arguments.UsageError(str(error)) from None
    try:  # the options alone (with a compressor: check_exchange)
        Options.of(**{"seed": config.seed, **config.options})
    except ValueError as error:
        raise arguments.UsageError(f"--option: {error}") from None
    check_launch(config)
    return config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train a model on local workers with a compressor",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--compressor", type=arguments.compressor_or_reference(REFERENCES), default="none",
                        help=f"gradpress spec or a reference: {', '.join(REFERENCES)}")
    parser.add_argument("--json", type=arguments.output_file, help="write the run's record here")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = checked_config(args, args.compressor)
    try:
        check_exchange(config)
    except ValueError as error:
        raise arguments.UsageError(f"--compressor {config.compressor}: {error}") from None
    try:
        run = train(config, args.json)
    except TrainFailed as error:
        print(f"{arguments.PREFIX}{error}", file=sys.stderr)
        return 1
    final = run.final_quality
    link = run.link_bytes_per_step
    print(f"{run.label}: {run.samples_per_s:.0f} samples/s, {run.bytes_per_step / 1e6:.3f} MB/step"
          + (f" ({link / 1e6:.3f} MB/step over node 0's link)" if link is not None else "")
          + f", {run.metric} {final:.4f}" + (f"; wrote {args.json}" if args.json else ""))
    return 0


def _exit(code: int) -> None:
    """End a worker process without Python's finalization.

    Gloo's worker threads release a finished collective's tensors after the waiting thread has moved
    on; when that tensor's Python object was already dropped, the release takes the GIL. During
    interpreter finalization that ends the thread with a forced unwind through a noexcept destructor,
    and the process aborts ("terminate called without an active exception", exit -6) after a run that
    succeeded: seen about once in 15 two-worker runs of a few steps. The worker has saved what it had
    to and flushed its output, so nothing is lost by skipping finalization (as multiprocessing's forked
    children do)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    import traceback

    _, _, payload, rank_text, address_text, port_text, result_text = sys.argv
    try:
        worker(TrainConfig(**json.loads(payload)), int(rank_text), address_text, int(port_text),
               Path(result_text))
    except KeyboardInterrupt:  # Ctrl-C reaches the workers too: the launcher says "interrupted", once
        _exit(arguments.INTERRUPTED)
    except Exception as error:
        _record_failure(Path(result_text), int(rank_text), error)  # the launcher's TrainFailed says why
        traceback.print_exc()
        _exit(1)
    _exit(0)
