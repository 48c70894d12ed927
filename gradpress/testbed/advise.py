"""``gradpress advise``: which compression method pays off for this model on that network, in a minute.

GRACE's lesson (Xu et al., Section 6) is that no compressor wins everywhere: whether one pays off
depends on the model, the network and the compression overhead, so profile first. ``advise`` profiles
on this machine, without training across processes, and prices every candidate with the α–β model of
:mod:`gradpress.testbed.costmodel` (the model ``gradpress sim cost`` checks against ``compare``'s runs):

**Compute** (:func:`profile_compute`). The model is wrapped in a real
:class:`~torch.nn.parallel.DistributedDataParallel` over a one-process Gloo group with a hook that returns
each bucket as it is (the testbed's ``noop`` row: no communication), and trained on the workload's
batches (``--batch-size`` per worker, ``--threads`` torch threads as each testbed worker has) for
``--repeats`` timed steps after two warm-up steps: the medians of the forward pass, of ``backward()``
and of the optimizer step are the compute of a step. The hook records when DDP hands it each bucket:
the bucket's *ready time* into the backward pass, and, from its parameters, **DDP's bucket layout** —
after DDP's rebuild at the second step, which orders parameters by when their gradients became
ready and caps buckets at 1 MiB (the first) and ``--bucket-cap-mb`` (25 MB). Why a real DDP rather than
a replica of its rule: the rebuilt order follows the autograd graph, not ``parameters()``, and the caps
and rules are whatever the installed PyTorch does; ``torch.distributed._compute_bucket_assignment_by_size``
is a private binding whose signature has changed between versions. Where no such group can be made (a
process group already exists, Gloo is missing, DDP refuses the model) the layout is replicated instead
(:func:`assign_buckets`: gradient-ready order from per-parameter hooks, the same caps), and the output
says so.

**Each candidate** (:func:`measure_method`). The runtime's own pipeline, :class:`gradpress.Simulator`
with 2 workers (1 if ``--workers 1``) and the method's default error-feedback memory, exchanges the real
gradients of two of the profiled batches (one per simulated worker), bucket by bucket in DDP's order,
for ``--repeats`` steps after a warm-up step (memory carried over, as in training); worker 0's
statistics give each bucket's median **compress** time (feedback, preliminary values, compression,
feedback update), **decompress** time (decoding and averaging) and ``Packet.nbytes``. Decoding an
all-gather handles one packet per worker, so its time is scaled by n / 2 (an all-reduce decodes one sum
whatever n). The **bytes each rank sends** per bucket are the strategy's collectives: the summands of
an all-reduce (integers widened to hold n workers' sums, as the strategy widens them — THC's 4-bit
indices travel as 8-bit table values), the packed packets of an all-gather (after a sizes header
where packet sizes vary), and a preliminary exchange (THC's norm, PowerSGD's P, CLT-k's leader indices)
before it; they are priced among n workers by :data:`~gradpress.testbed.costmodel.STRATEGIES` (ring
all-reduce, ring all-gather, binomial broadcast). The reference row ``torch-allreduce`` (DDP's own hook)
compresses nothing and all-reduces each bucket's fp32 bytes; every speed-up is relative to it.

**Prediction** (:func:`predict`, :func:`rank`): :func:`~gradpress.testbed.costmodel.predict_bucketed_step`
— compression on the backward thread as the hook runs it, each bucket's exchange starting when its hook
returns and the link is free, decoding when it arrives, ``backward()`` returning when both the
gradients and the last decoding are done — at every ``--bandwidth`` for ``--workers`` n (1–1024) and
latency α per message. :func:`rank` is a pure function of the profile and the candidates' measured
per-bucket costs (``auto`` can call it with costs measured in a running job). Where a method stops
paying is :func:`~gradpress.testbed.costmodel.bandwidth_crossing` of the same model against
``torch-allreduce``.

**Quality** (``--quality-steps K``, :func:`quality_curve`). Each candidate, and ``none`` (the exact mean,
what ``torch-allreduce`` computes), trains the model for K steps of synchronous SGD with
``--quality-workers`` simulated workers (default min(n, 4)) on the testbed's real data
(``gradpress sim quality``'s loop), or on the user's ``--batch`` factory; quality is evaluated at about ten
checkpoints. The target is ``none``'s best quality minus the report's tolerance (1 point of accuracy or
hit rate, 5 of perplexity; 1 % of the loss for a factory model's held-out loss), as ``compare``'s report
sets it; a method's *steps to target* is the first crossing of its curve, interpolated between
checkpoints. The ranking is then by predicted **time to target** = steps to target × predicted step
time; a method that does not reach it in K steps is ranked after those that do.

The checks against measurement (``gradpress compare`` on the emulated network beside ``advise`` with the
same link) are commands in the README.
"""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from gradpress import cli
from gradpress.testbed import costmodel
from gradpress.testbed.costmodel import Breakdown, BucketStep, Phase

#: the row every speed-up is relative to: DDP's built-in all-reduce of the fp32 buckets
BASELINE = "torch-allreduce"
#: the method whose quality sets the target (the exact mean, as torch-allreduce computes it)
QUALITY_REFERENCE = "none"
#: besides every registered method at its defaults, these fractions of the sparsifiers
RATIO_VARIANTS: dict[str, tuple[str, ...]] = {"topk": ("0.1", "0.001"), "randomk": ("0.1", "0.001")}
#: the README's demo set (``gradpress compare --compressors demo``), without PyTorch's own hooks
DEMO = ("none", "fp16", "topk:ratio=0.01", "qsgd", "natural", "thc", "powersgd")
DEFAULT_BANDWIDTHS = "100mbit,1gbit,10gbit"
#: the plot's link speeds, bits/s: 10 Mbit/s to 400 Gbit/s
PLOT_RANGE = (1e7, 4e11)
#: where crossings are searched (bits/s)
CROSSING_RANGE = (1e6, 1e12)
#: DDP's cap of its first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)
FIRST_BUCKET_BYTES = 1024 * 1024
#: methods drawn in the plot at most (the best at the requested link speeds)
PLOTTED = 10
#: predictions this close to the best are named beside it (timings on a shared machine vary this much)
NEAR = 0.05
Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# ==================================================================================================
# The workload: a model, its batches, its loss (and, for quality, data and a metric)
# ==================================================================================================
@dataclass
class Workload:
    """What is profiled: ``build()`` makes the model (the caller seeds it), ``sample(generator)`` one
    worker's batch ``(inputs, targets)``, ``loss(outputs, targets)`` the training loss. For
    ``--quality-steps``: ``train_batches(rank, workers, seed)`` an endless iterator of rank ``rank``'s
    batches, ``evaluate(model)`` the quality ``metric``; ``quality_unavailable`` says why there is none."""

    label: str
    build: Callable[[], nn.Module]
    sample: Callable[[torch.Generator], tuple[Any, Any]]
    loss: Callable[[torch.Tensor, Any], torch.Tensor]
    batch_size: int
    source: str
    optimizer: str = "sgd"
    lr: float = 0.01
    grad_clip: float | None = None
    train_batches: Callable[[int, int, int], Iterator[tuple[Any, Any]]] | None = None
    evaluate: Callable[[nn.Module], float] | None = None
    metric: str | None = None
    higher_is_better: bool = True
    quality_unavailable: str | None = None
    shard_size: Callable[[int], int] | None = None


_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_factory(model: str) -> bool:
    """``package.module:factory`` (not a testbed model spec such as ``mlp-wide:width=8192``)."""
    from gradpress.registry import parse_spec
    from gradpress.testbed.models import model_names

    if not _FACTORY.match(model.strip()):
        return False
    try:
        return parse_spec(model)[0] not in model_names()
    except ValueError:
        return True


def load_object(reference: str) -> Any:
    """The object ``package.module:name`` names (the current directory is searched too, as
    ``python -m`` searches it). ValueError says what is missing."""
    module_name, _, attribute = reference.strip().partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{reference!r}: expected package.module:name")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name) or os.getcwd() in sys.path:
            raise ValueError(f"{reference!r}: importing {module_name} failed: {error}") from None
        sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as again:
            raise ValueError(f"{reference!r}: no module {again.name!r} "
                             f"(searched sys.path and {os.getcwd()})") from None
    except Exception as error:  # noqa: BLE001 - the user's module failed to import: say so in one line
        raise ValueError(f"{reference!r}: importing {module_name} failed: "
                         f"{type(error).__name__}: {error}") from None
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ValueError(f"{reference!r}: {module_name} has no {attribute!r}")
        value = getattr(value, part)
    if not callable(value):
        raise ValueError(f"{reference!r}: {attribute} is not callable")
    return value


def testbed_workload(spec: str, batch_size: int | None = None, data_name: str | None = None,
                     lr: float | None = None) -> Workload:
    """A testbed model (:mod:`gradpress.testbed.models`) on its dataset's batches, or on random batches of
    the same shapes when the dataset is not on this machine (then quality cannot be estimated)."""
    from gradpress.registry import parse_spec
    from gradpress.testbed import data as datasets
    from gradpress.testbed.models import LOSSES, QUALITY, evaluate, model_config, models

    cls = models.get(parse_spec(spec)[0])
    name = data_name or cls.dataset
    try:
        dataset = datasets.load(name)
        why = None
    except datasets.DataUnavailable as error:
        dataset, why = None, f"{name} is not available: {cli.one_line(error)}"
    settings = model_config(spec, dataset)
    settings.build()  # bad sizes fail here
    batch = batch_size or settings.batch_size
    task = cls.task
    if dataset is not None:
        train = dataset.training_set(torch.Generator().manual_seed(0))

        def sample(generator: torch.Generator) -> tuple[Any, Any]:
            index = torch.randint(len(train), (batch,), generator=generator)
            return train.x[index], train.y[index]

        source = f"{name} batches"
    else:
        sample = _random_batches(task, settings, batch)
        source = f"random batches of {name}'s shapes ({name} is not on this machine)"
    metric, higher = QUALITY[task]
    workload = Workload(spec, settings.build, sample, LOSSES[task], batch, source, settings.optimizer,
                        settings.lr if lr is None else lr, settings.grad_clip, metric=metric,
                        higher_is_better=higher, quality_unavailable=why)
    if dataset is not None:
        from gradpress.testbed.sim import _endless_batches

        workload.train_batches = lambda rank, workers, seed: _endless_batches(
            dataset.shard(rank, workers, seed=seed), batch, seed, rank)
        workload.evaluate = lambda model: evaluate(model, dataset)[metric]
        workload.shard_size = lambda workers: len(dataset.train) // workers
    return workload


def _random_batches(task: str, settings: Any, batch: int) -> Callable[[torch.Generator], tuple[Any, Any]]:
    """Random inputs and targets of the shapes and ranges ``task``'s data has (timing only)."""
    if task == "classification":
        size = getattr(settings, "image_size", 28)
        shape = (batch, getattr(settings, "in_channels", 1), size, size)
        classes = getattr(settings, "num_classes", 10)
        return lambda g: (torch.randn(shape, generator=g), torch.randint(classes, (batch,), generator=g))
    if task == "language-model":
        vocab = settings.vocab_size
        return lambda g: (torch.randint(vocab, (batch, 35), generator=g),
                          torch.randint(vocab, (batch, 35), generator=g))
    if task == "recommendation":
        def pairs(g: torch.Generator) -> tuple[Any, Any]:
            x = torch.stack([torch.randint(settings.num_users, (batch,), generator=g),
                             torch.randint(settings.num_items, (batch,), generator=g)], 1)
            return x, torch.randint(2, (batch,), generator=g).float()
        return pairs
    raise ValueError(f"no random batches for task {task!r}")


def factory_workload(reference: str, input_shape: Sequence[int] | None = None,
                     batch_reference: str | None = None, batch_size: int | None = None,
                     lr: float | None = None) -> Workload:
    """The user's model: ``factory()`` returns an ``nn.Module``. Batches come from
    ``batch_factory(batch_size)`` returning ``(inputs, targets)`` (loss: cross-entropy for integer
    targets, else mean squared error; quality: that loss on four held-out batches), or are random inputs
    of ``input_shape`` per sample with the mean square of the output as a stand-in loss (only its time
    counts)."""
    factory = load_object(reference)
    batch = batch_size or 32

    def build() -> nn.Module:
        model = factory()
        if not isinstance(model, nn.Module):
            raise ValueError(f"{reference} returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    if batch_reference is None:
        if input_shape is None:
            raise ValueError("a factory model needs --input-shape (random inputs) or --batch (its batches)")
        shape = (batch, *input_shape)
        return Workload(reference, build, lambda g: (torch.randn(shape, generator=g), None),
                        lambda out, _: out.float().square().mean(), batch,
                        f"random inputs of shape {tuple(input_shape)}", lr=0.01 if lr is None else lr,
                        quality_unavailable="--quality-steps needs --batch: random inputs have no quality")
    batch_factory = load_object(batch_reference)

    def draw(seed: int) -> tuple[Any, Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drawn = batch_factory(batch)
        if not (isinstance(drawn, (tuple, list)) and len(drawn) == 2):
            raise ValueError(f"{batch_reference}({batch}) must return (inputs, targets), "
                             f"got {type(drawn).__name__}")
        return drawn[0], drawn[1]

    def loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not targets.is_floating_point():
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), targets.reshape(-1))
        return nn.functional.mse_loss(out.float(), targets.float().view_as(out))

    def train_batches(rank: int, workers: int, seed: int) -> Iterator[tuple[Any, Any]]:
        step = 0
        while True:
            yield draw(hash((seed, rank, workers, step)) & 0x7FFF_FFFF)
            step += 1

    held_out = [draw(1_000_003 + k) for k in range(4)]

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        was = model.training
        model.eval()
        try:
            return statistics.fmean(float(loss(model(x), y)) for x, y in held_out)
        finally:
            model.train(was)

    def sample(generator: torch.Generator) -> tuple[Any, Any]:
        return draw(int(torch.randint(2**31 - 1, (1,), generator=generator)))

    return Workload(reference, build, sample, loss, batch, f"{batch_reference} batches",
                    lr=0.01 if lr is None else lr, train_batches=train_batches, evaluate=evaluate,
                    metric="loss", higher_is_better=False)


def _optimizer(name: str, parameters: Any, lr: float) -> torch.optim.Optimizer:
    from gradpress.testbed.train import _optimizer as testbed_optimizer

    return testbed_optimizer(name, parameters, lr)


# ==================================================================================================
# Profile: compute per step and DDP's buckets
# ==================================================================================================
@dataclass(frozen=True)
class Bucket:
    """One DDP bucket: its parameters' names, size, and when DDP hands it to the hook (seconds into the
    backward pass, the median over the timed steps)."""

    index: int
    keys: tuple[str, ...]
    numel: int
    nbytes: int
    ready_s: float


@dataclass(frozen=True)
class ComputeProfile:
    """A step without communication (medians, seconds) and the bucket layout; ``layout`` is ``"ddp"``
    (read from DDP's hook) or ``"replicated"`` (:func:`assign_buckets`)."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    buckets: tuple[Bucket, ...]
    layout: str
    batch_size: int
    threads: int
    parameters: int
    note: str = ""

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def assign_buckets(sizes: Sequence[tuple[str, int, str]], limits: Sequence[int]) -> list[list[str]]:
    """DDP's bucketing rule (``compute_bucket_assignment_by_size``): tensors ``(name, nbytes, dtype)`` in
    the given order fill a bucket per dtype until it reaches the current limit (``limits[0]`` for the
    first bucket of a dtype, then each next limit, the last one repeating); a tensor is never split."""
    if not limits or min(limits) <= 0:
        raise ValueError(f"bucket limits must be positive, got {list(limits)}")
    open_: dict[str, list[str]] = {}
    filled: dict[str, int] = {}
    closed_count: dict[str, int] = {}
    done: list[list[str]] = []
    for name, nbytes, dtype in sizes:
        bucket = open_.setdefault(dtype, [])
        bucket.append(name)
        filled[dtype] = filled.get(dtype, 0) + nbytes
        limit = limits[min(closed_count.get(dtype, 0), len(limits) - 1)]
        if filled[dtype] >= limit:
            done.append(bucket)
            open_[dtype], filled[dtype] = [], 0
            closed_count[dtype] = closed_count.get(dtype, 0) + 1
    done += [bucket for bucket in open_.values() if bucket]
    order = {name: i for i, (name, _, _) in enumerate(sizes)}
    return sorted(done, key=lambda bucket: min(order[name] for name in bucket))


class _NoDDP(RuntimeError):
    pass


def profile_compute(workload: Workload, *, repeats: int = 5, workers: int = 2, bucket_cap_mb: float = 25.0,
                    seed: int = 0, threads: int = 1, warmup: int = 2,
                    use_ddp: bool = True) -> tuple[ComputeProfile, list[dict[str, torch.Tensor]]]:
    """Time ``workload``'s steps and find its buckets (module doc); also returns ``workers`` gradients
    (name → tensor) of different batches, for the candidates' simulated workers."""
    def fresh() -> tuple[nn.Module, torch.Generator]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return workload.build(), torch.Generator().manual_seed(seed)

    note = ""
    if use_ddp:
        try:
            return _ddp_profile(*fresh(), workload, repeats, warmup, workers, bucket_cap_mb, threads)
        except _NoDDP as error:
            note = f"layout replicated: {error}"
    return _hooked_profile(*fresh(), workload, repeats, warmup, workers, bucket_cap_mb, threads, note)


def _names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters() if p.requires_grad}


def _step(model: nn.Module, workload: Workload, optimizer: torch.optim.Optimizer, batch: tuple[Any, Any],
          params: Sequence[nn.Parameter]) -> tuple[float, float, float, float]:
    """One training step; (start of backward, forward s, backward s, optimizer s)."""
    x, y = batch
    optimizer.zero_grad(set_to_none=False)
    started = time.perf_counter()
    loss = workload.loss(model(x), y)
    backward = time.perf_counter()
    loss.backward()
    stepped = time.perf_counter()
    if workload.grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(params, workload.grad_clip)
    optimizer.step()
    done = time.perf_counter()
    return backward, backward - started, stepped - backward, done - stepped


def _ddp_profile(model, generator, workload, repeats, warmup, workers, cap_mb,  # noqa: ANN001, ANN202
                 threads):
    import torch.distributed as dist

    if not dist.is_available():
        raise _NoDDP("torch.distributed is not available")
    if dist.is_initialized():
        raise _NoDDP("a process group already exists in this process")
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except Exception as error:  # noqa: BLE001 - any failure to make the group: replicate the layout
        raise _NoDDP(f"no one-process Gloo group ({type(error).__name__}: {cli.one_line(error)})") from None
    try:
        names = _names(model)
        try:
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        except Exception as error:  # noqa: BLE001 - DDP refuses the model: replicate the layout
            raise _NoDDP(f"DDP refused the model ({type(error).__name__}: {cli.one_line(error)})") from None
        calls: list[tuple[float, int, tuple[str, ...], int, int]] = []

        def record(state, bucket):  # noqa: ANN001, ANN202 - DDP checks hook annotations literally
            buffer = bucket.buffer()
            keys = tuple(names[id(p)] for p in bucket.parameters())
            calls.append((time.perf_counter(), bucket.index(), keys, buffer.numel(),
                          buffer.numel() * buffer.element_size()))
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(buffer)
            return future

        ddp.register_comm_hook(None, record)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = _optimizer(workload.optimizer, params, workload.lr)
        rows, ready, grads = [], [], []
        try:
            for step in range(warmup + repeats):
                calls.clear()
                began, *times = _step(ddp, workload, optimizer, workload.sample(generator), params)
                if step >= warmup:
                    rows.append(times)
                    ready.append({index: (at - began, keys, numel, nbytes)
                                  for at, index, keys, numel, nbytes in calls})
                if step >= warmup and len(grads) < workers:
                    grads.append(_gradients(params, names))
        except RuntimeError as error:  # e.g. unused parameters: DDP's reducer refuses the second step
            raise _NoDDP(f"DDP could not train the model ({cli.one_line(error)})") from None
    finally:
        dist.destroy_process_group()
    while len(grads) < workers:
        grads.append(grads[len(grads) % max(1, len(grads))])
    last = ready[-1]
    buckets = tuple(Bucket(index, keys, numel, nbytes,
                           statistics.median(r[index][0] for r in ready if index in r))
                    for index, (_, keys, numel, nbytes) in sorted(last.items()))
    return _profile(rows, buckets, "ddp", workload, threads, model), grads


def _gradients(params: Sequence[nn.Parameter], names: Mapping[int, str]) -> dict[str, torch.Tensor]:
    return {names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None}


def _hooked_profile(model, generator, workload, repeats, warmup, workers, cap_mb,  # noqa: ANN001, ANN202
                    threads, note):
    names = _names(model)
    params = [p for p in model.parameters() if p.requires_grad]
    stamps: dict[str, float] = {}

    def stamp(parameter: nn.Parameter) -> None:
        stamps[names[id(parameter)]] = time.perf_counter()

    handles = [p.register_post_accumulate_grad_hook(stamp) for p in params]
    optimizer = _optimizer(workload.optimizer, params, workload.lr)
    rows, ready, grads = [], [], []
    try:
        for step in range(warmup + repeats):
            stamps.clear()
            began, *times = _step(model, workload, optimizer, workload.sample(generator), params)
            if step >= warmup:
                rows.append(times)
                ready.append({name: at - began for name, at in stamps.items()})
                if len(grads) < workers:
                    grads.append(_gradients(params, names))
    finally:
        for handle in handles:
            handle.remove()
    while len(grads) < workers:
        grads.append(grads[len(grads) % max(1, len(grads))])
    when = {name: statistics.median(r.get(name, 0.0) for r in ready) for name in names.values()}
    by_name = {names[id(p)]: p for p in params}
    ordered = sorted(by_name, key=lambda name: when[name])  # gradient-ready order, as DDP's rebuild
    size = {name: p.numel() * p.element_size() for name, p in by_name.items()}
    sizes = [(name, size[name], str(by_name[name].dtype)) for name in ordered]
    groups = assign_buckets(sizes, [FIRST_BUCKET_BYTES, int(cap_mb * 1024 * 1024)])
    buckets = tuple(Bucket(i, tuple(keys), sum(by_name[k].numel() for k in keys), sum(size[k] for k in keys),
                           max(when[k] for k in keys)) for i, keys in enumerate(groups))
    return replace(_profile(rows, buckets, "replicated", workload, threads, model), note=note), grads


def _profile(rows, buckets, layout, workload, threads, model) -> ComputeProfile:  # noqa: ANN001
    forward, backward, optimizer = (statistics.median(r[i] for r in rows) for i in range(3))
    return ComputeProfile(forward, backward, optimizer, buckets, layout, workload.batch_size, threads,
                          sum(p.numel() for p in model.parameters() if p.requires_grad))


# ==================================================================================================
# Each candidate's cost on the buckets
# ==================================================================================================
@dataclass(frozen=True)
class Transfer:
    """One collective of a bucket's exchange: ``strategy`` (:data:`~gradpress.testbed.costmodel.STRATEGIES`)
    on ``nbytes`` per worker. Integer summands of ``dtype`` whose largest value is ``bound`` widen as n
    workers' sums grow (:func:`gradpress.strategy.sum_dtype`); ``per_worker`` bytes are added per worker
    (the fault-flag slots of a preliminary reduction)."""

    strategy: str
    nbytes: float
    dtype: str | None = None
    bound: int | None = None
    per_worker: float = 0.0

    def phase(self, n: int) -> Phase:
        nbytes = self.nbytes
        if self.dtype is not None and self.bound is not None:
            from gradpress.strategy import sum_dtype

            narrow = getattr(torch, self.dtype)
            wide = sum_dtype(narrow, self.bound * n, "widen", "advise")
            nbytes *= _itemsize(wide) / _itemsize(narrow)
        return Phase(self.strategy, nbytes + self.per_worker * n)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class BucketCost:
    """A method's measured cost on one bucket: seconds on the hook's thread (``compress_s``) and decoding
    (``decompress_s``, among the method's ``measured_workers``), ``Packet.nbytes``, and its collectives."""

    compress_s: float
    decompress_s: float
    packet_bytes: float
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class MethodCost:
    """A method's measured per-bucket costs (in the profile's bucket order). ``decode_grows``: decoding
    handles one packet per worker (all-gather), so it scales with n / ``measured_workers``.
    ``sent_bytes``: what the Simulator counted as sent by worker 0 per step (its traffic pattern at
    ``measured_workers``), kept beside the priced bytes."""

    spec: str
    exchange: str
    feedback: str
    buckets: tuple[BucketCost, ...]
    measured_workers: int = 2
    decode_grows: bool = False
    sent_bytes: float | None = None

    @property
    def packet_bytes(self) -> float:
        """``Packet.nbytes`` per step and worker: GRACE's data volume."""
        return sum(b.packet_bytes for b in self.buckets)

    def decompress_at(self, bucket: BucketCost, n: int) -> float:
        return bucket.decompress_s * n / self.measured_workers if self.decode_grows else bucket.decompress_s

    def steps(self, profile: ComputeProfile, n: int) -> list[BucketStep]:
        """The buckets as the cost model takes them, among ``n`` workers."""
        if len(self.buckets) != len(profile.buckets):
            raise ValueError(f"{self.spec}: costs of {len(self.buckets)} buckets for a profile of "
                             f"{len(profile.buckets)}")
        return [BucketStep(b.ready_s, c.compress_s, tuple(t.phase(n) for t in c.transfers),
                           self.decompress_at(c, n)) for b, c in zip(profile.buckets, self.buckets)]

    def wire_bytes(self, n: int) -> float:
        """Bytes through each worker's link per step among ``n`` workers (the collectives' critical path)."""
        return sum(costmodel.communication_cost([t.phase(n) for t in c.transfers], n).nbytes
                   for c in self.buckets)


def baseline_cost(profile: ComputeProfile) -> MethodCost:
    """``torch-allreduce``: DDP's own hook all-reduces each bucket's bytes and compresses nothing."""
    buckets = tuple(BucketCost(0.0, 0.0, b.nbytes, (Transfer("allreduce", b.nbytes),))
                    for b in profile.buckets)
    return MethodCost(BASELINE, "allreduce", "none", buckets, measured_workers=1)


def transfers_of(compressor: Any, items: Sequence[tuple[str, torch.Tensor]], workers: int, seed: int = 0,
                 packet_bytes: float | None = None) -> tuple[Transfer, ...]:
    """The collectives that carry one bucket of ``items`` (module doc): preliminary values grouped by op,
    source and dtype; then the summands of an all-reduce grouped by dtype, or an all-gather of the packed
    packets (``packet_bytes`` when measured, since their size may depend on the data and the memory),
    after a sizes header when their sizes are not fixed. One worker's packets are formed here to read
    their layout (rank 0, step 0)."""
    from gradpress.rng import Context

    items = [(key, t) for key, t in items if t.numel() > 0]
    contexts = [Context(seed, 0, key, 0) for key, _ in items]
    transfers: list[Transfer] = []
    if compressor.prepares:
        groups: dict[tuple, float] = {}
        for (key, tensor), ctx in zip(items, contexts):
            pre = compressor.prepare(tensor.detach().contiguous(), ctx, workers)
            if pre is not None:
                group = (pre.op, pre.src if pre.op == "broadcast" else -1, pre.values.dtype)
                groups[group] = groups.get(group, 0.0) + pre.values.numel() * pre.values.element_size()
        flags_given = False
        for (op, _, dtype), nbytes in groups.items():
            if op == "broadcast":
                transfers.append(Transfer("broadcast", nbytes))
            else:
                flags = 0.0 if flags_given else _itemsize(dtype)
                transfers.append(Transfer("allreduce", nbytes, per_worker=flags))
                flags_given = True
    packets = [compressor.compress(tensor.detach(), ctx) for (_, tensor), ctx in zip(items, contexts)]
    if compressor.exchange == "allreduce":
        summed: dict[torch.dtype, float] = {}
        for packet in packets:
            for t in compressor.summands(packet):
                summed[t.dtype] = summed.get(t.dtype, 0.0) + t.numel() * t.element_size()
        for dtype, nbytes in summed.items():
            widens = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
            bound = compressor.max_summand if widens else None
            name = str(dtype).removeprefix("torch.") if widens else None
            transfers.append(Transfer("allreduce", nbytes, name, bound))
    else:
        wires = [t for p in packets for t in p.wire()]
        fixed = all(compressor.expected_nbytes(p.numel, p.dtype) is not None for p in packets)
        if not fixed:
            transfers.append(Transfer("allgather", 8.0 * (len(wires) + 1)))  # int64 sizes and the fault flag
        own = sum(p.nbytes for p in packets) if packet_bytes is None else packet_bytes
        transfers.append(Transfer("allgather", own + (1 if fixed else 0)))  # + the fault-flag byte
    return tuple(transfers)


def measure_method(spec: str, profile: ComputeProfile, grads: Sequence[Mapping[str, torch.Tensor]], *,
                   repeats: int = 3, seed: int = 0) -> MethodCost:
    """``spec``'s costs on the profile's buckets through :class:`gradpress.Simulator` with ``len(grads)``
    workers (module doc): medians over ``repeats`` steps after one warm-up step."""
    import gradpress

    workers = len(grads)
    compressor = gradpress.make(spec)
    simulator = gradpress.Simulator(spec, workers, seed=seed)
    samples: list[list[tuple[float, float, float]]] = [[] for _ in profile.buckets]
    sent = 0.0
    present = [[key for key in bucket.keys if key in grads[0]] for bucket in profile.buckets]
    for step in range(1 + repeats):
        for b, keys in enumerate(present):
            if not keys:
                continue
            before = simulator.stats()[0]["total"]
            simulator.step([{key: g[key] for key in keys} for g in grads])
            after = simulator.stats()[0]["total"]
            if step:
                samples[b].append(tuple(after[k] - before[k]
                                        for k in ("compress_s", "decompress_s", "packet_bytes")))
                sent += after["sent_bytes"] - before["sent_bytes"]
    buckets = []
    for keys, rows in zip(present, samples):
        if not rows:
            buckets.append(BucketCost(0.0, 0.0, 0.0, ()))
            continue
        compress, decompress, nbytes = (statistics.median(r[i] for r in rows) for i in range(3))
        items = [(key, grads[0][key]) for key in keys]
        buckets.append(BucketCost(compress, decompress, nbytes,
                                  transfers_of(compressor, items, workers, seed, packet_bytes=nbytes)))
    return MethodCost(spec, compressor.exchange, compressor.default_feedback, tuple(buckets), workers,
                      decode_grows=compressor.exchange == "allgather", sent_bytes=sent / repeats)


# ==================================================================================================
# Prediction and ranking (pure functions of the profile and the costs)
# ==================================================================================================
def predict(profile: ComputeProfile, cost: MethodCost, *, n: int, bandwidth: float | str,
            latency: float = costmodel.DEFAULT_LATENCY) -> Breakdown:
    """``cost``'s step among ``n`` workers at ``bandwidth`` (bits/s or a tc rate):
    :func:`~gradpress.testbed.costmodel.predict_bucketed_step` on the profile's buckets."""
    return costmodel.predict_bucketed_step(profile.forward_s, profile.backward_s, cost.steps(profile, n),
                                           n=n, bandwidth=bandwidth, latency=latency,
                                           optimizer_s=profile.optimizer_s)


@dataclass(frozen=True)
class Ranked:
    """One method's place at one link speed. ``speedup``: ``torch-allreduce``'s predicted step over this
    one's (the ratio of samples/s); with quality, ``steps_to_target`` × the step is ``time_to_target_s``."""

    spec: str
    workers: int
    bandwidth: str
    predicted: Breakdown
    speedup: float
    wire_bytes: float
    packet_bytes: float
    steps_to_target: float | None = None
    time_to_target_s: float | None = None
    speedup_time_to_target: float | None = None
    rank: int = 0


def rank(profile: ComputeProfile, costs: Sequence[MethodCost], *, n: int, bandwidth: float | str,
         latency: float = costmodel.DEFAULT_LATENCY,
         steps_to_target: Mapping[str, float | None] | None = None) -> list[Ranked]:
    """Every method of ``costs`` and ``torch-allreduce``, best first, at ``n`` workers and ``bandwidth``.

    Without ``steps_to_target`` the order is by predicted step time (samples/s). With it (spec → steps
    to the target quality, None where not reached; ``torch-allreduce`` takes ``none``'s when it has no
    entry), by predicted time to target = steps × step; methods that do not reach it (or have no entry)
    come after those that do, by step time."""
    base = baseline_cost(profile)
    methods = [base, *[c for c in costs if c.spec != BASELINE]]
    base_s = predict(profile, base, n=n, bandwidth=bandwidth, latency=latency).total
    steps = dict(steps_to_target or {})
    if steps_to_target is not None and BASELINE not in steps:
        steps[BASELINE] = steps.get(QUALITY_REFERENCE)
    label = bandwidth if isinstance(bandwidth, str) else f"{bandwidth:g}"
    rows = []
    for cost in methods:
        breakdown = predict(profile, cost, n=n, bandwidth=bandwidth, latency=latency)
        to_target = steps.get(cost.spec) if steps_to_target is not None else None
        to_target_s = None if to_target is None else to_target * breakdown.total
        rows.append(Ranked(cost.spec, n, label, breakdown, base_s / breakdown.total, cost.wire_bytes(n),
                           cost.packet_bytes, to_target, to_target_s))
    base_ttt = next((r.time_to_target_s for r in rows if r.spec == BASELINE), None)
    if steps_to_target is not None:
        rows = [replace(r, speedup_time_to_target=base_ttt / r.time_to_target_s
                        if base_ttt and r.time_to_target_s else None) for r in rows]
        ordered = sorted(rows, key=lambda r: (r.time_to_target_s is None, r.time_to_target_s or 0.0,
                                              r.predicted.total))
    else:
        ordered = sorted(rows, key=lambda r: r.predicted.total)
    return [replace(r, rank=i) for i, r in enumerate(ordered, start=1)]


def speedup_at(profile: ComputeProfile, cost: MethodCost, bandwidth: float | str, *, n: int,
               latency: float = costmodel.DEFAULT_LATENCY, baseline: MethodCost | None = None) -> float:
    """Predicted samples/s of ``cost`` over ``torch-allreduce``'s at ``bandwidth``."""
    base = baseline or baseline_cost(profile)
    common = {"n": n, "bandwidth": bandwidth, "latency": latency}
    return predict(profile, base, **common).total / predict(profile, cost, **common).total


def crossover(profile: ComputeProfile, cost: MethodCost, *, n: int,
              latency: float = costmodel.DEFAULT_LATENCY, baseline: MethodCost | None = None) -> float:
    """The link speed (bits/s) above which ``cost``'s predicted step is no shorter than
    ``torch-allreduce``'s (:func:`~gradpress.testbed.costmodel.bandwidth_crossing` in
    :data:`CROSSING_RANGE`; inf: it pays at every speed there, 0: at none)."""
    base = baseline or baseline_cost(profile)
    return costmodel.bandwidth_crossing(
        lambda bw: predict(profile, cost, n=n, bandwidth=bw, latency=latency).total,
        lambda bw: predict(profile, base, n=n, bandwidth=bw, latency=latency).total,
        low=CROSSING_RANGE[0], high=CROSSING_RANGE[1])


def register_line(spec: str) -> str:
    """What to paste into a DDP training script for ``spec`` (``torch-allreduce``: nothing to change)."""
    if spec == BASELINE:
        return "# no compression pays here: keep DDP's built-in all-reduce (no gradpress.register call)"
    return f'gradpress.register(model, "{spec}")'


# ==================================================================================================
# Quality after K steps, and steps to the uncompressed quality
# ==================================================================================================
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
    from gradpress.testbed.sim import _worker_gradients

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


# ==================================================================================================
# The whole advice
# ==================================================================================================
def default_candidates() -> list[str]:
    """Every registered method at its default spec, and :data:`RATIO_VARIANTS`."""
    import gradpress

    specs = []
    for name in gradpress.compressor_names():
        specs.append(name)
        specs += [f"{name}:ratio={ratio}" for ratio in RATIO_VARIANTS.get(name, ())]
    return specs


def candidates(text: str) -> list[str]:
    """``default`` (:func:`default_candidates`), ``demo`` (:data:`DEMO`) or comma-separated specs."""
    from gradpress.registry import split_specs

    if text == "default":
        return default_candidates()
    if text == "demo":
        return list(DEMO)
    return [spec for spec in split_specs(text) if spec != BASELINE]


@dataclass
class Advice:
    """Everything ``advise`` found: the profile, each method's costs, the rankings per link speed,
    where each method stops paying, and the quality runs (if any)."""

    workload: str
    source: str
    workers: int
    latency: float
    bandwidths: list[str]
    profile: ComputeProfile
    costs: list[MethodCost]
    rankings: dict[str, list[Ranked]]
    crossovers: dict[str, float]
    skipped: dict[str, str] = field(default_factory=dict)
    quality: list[QualityCurve] = field(default_factory=list)
    target: float | None = None
    steps_to_target: dict[str, float | None] | None = None
    quality_note: str | None = None
    measure_seconds: float = 0.0

    def best(self, bandwidth: str) -> Ranked:
        return self.rankings[bandwidth][0]


def advise(workload: Workload, specs: Sequence[str], *, workers: int = 2,
           bandwidths: Sequence[str] = ("100mbit",), latency: float = costmodel.DEFAULT_LATENCY,
           repeats: int = 5, quality_steps: int | None = None, quality_workers: int | None = None,
           tolerance: float | None = None, bucket_cap_mb: float = 25.0, seed: int = 0, threads: int = 1,
           progress: Progress = _quiet, use_ddp: bool = True) -> Advice:
    """Profile ``workload``, measure every spec, rank them at every bandwidth (module doc). A spec that
    fails to measure is left out with its reason (``Advice.skipped``)."""
    started = time.perf_counter()
    simulated = min(2, workers)
    progress("profiling compute and DDP's buckets")
    profile, grads = profile_compute(workload, repeats=repeats, workers=simulated,
                                     bucket_cap_mb=bucket_cap_mb, seed=seed, threads=threads, use_ddp=use_ddp)
    costs, skipped = [], {}
    for spec in specs:
        progress(f"measuring {spec}")
        try:
            costs.append(measure_method(spec, profile, grads, repeats=max(1, repeats - 2), seed=seed))
        except Exception as error:  # noqa: BLE001 - one method that fails is reported, the others ranked
            skipped[spec] = f"{type(error).__name__}: {cli.one_line(error)}"[:300]
    curves, target, to_target, note = [], None, None, None
    if quality_steps:
        if workload.quality_unavailable is not None or workload.evaluate is None:
            note = (f"--quality-steps skipped: {workload.quality_unavailable}; "
                    "ranked by predicted step time alone")
        else:
            q_workers = quality_workers or min(workers, 4)
            measured = [c.spec for c in costs]
            runs = [QUALITY_REFERENCE] + [s for s in measured if s != QUALITY_REFERENCE]
            for spec in runs:
                progress(f"training {spec} for {quality_steps} steps with {q_workers} simulated workers")
                try:
                    curves.append(quality_curve(workload, spec, workers=q_workers, steps=quality_steps,
                                                seed=seed))
                except Exception as error:  # noqa: BLE001 - e.g. NonFiniteError: the run diverged
                    if spec == QUALITY_REFERENCE:
                        raise
                    skipped[spec] = f"quality run failed: {type(error).__name__}: {cli.one_line(error)}"[:300]
            reference = curves[0]
            target = quality_target(reference, tolerance)
            to_target = {c.spec: steps_to_reach(c, target) for c in curves}
            to_target[BASELINE] = to_target[QUALITY_REFERENCE]
            costs = [c for c in costs if c.spec in to_target]
    rankings = {bw: rank(profile, costs, n=workers, bandwidth=bw, latency=latency, steps_to_target=to_target)
                for bw in bandwidths}
    base = baseline_cost(profile)
    crossings = {c.spec: crossover(profile, c, n=workers, latency=latency, baseline=base) for c in costs}
    return Advice(workload.label, workload.source, workers, latency, list(bandwidths), profile, costs,
                  rankings, crossings, skipped, curves, target, to_target, note,
                  time.perf_counter() - started)


# ==================================================================================================
# Output: table, JSON, plot
# ==================================================================================================
def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _rate(bits_per_second: float) -> str:
    if bits_per_second == math.inf:
        return "every speed"
    if bits_per_second == 0:
        return "never"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second / 1e3:.3g} kbit/s"


def _pays(crossing: float) -> str:
    if crossing == math.inf:
        return "pays at every speed"
    return "never pays" if crossing == 0 else f"pays below {_rate(crossing)}"


def describe_profile(advice: Advice) -> str:
    p = advice.profile
    ready = ", ".join(f"{b.ready_s * 1e3:.1f}" for b in p.buckets)
    layout = "read from DDP (one-process Gloo)" if p.layout == "ddp" else f"replicated ({p.note})"
    return (f"{advice.workload}: {p.parameters / 1e6:.3g} M parameters, {_bytes(p.nbytes)} of gradient in "
            f"{len(p.buckets)} DDP bucket{'s' if len(p.buckets) != 1 else ''} (layout {layout}); "
            f"batch {p.batch_size} per worker from {advice.source}, "
            f"{p.threads} thread{'s' if p.threads > 1 else ''}: "
            f"forward {p.forward_s * 1e3:.1f} ms, backward {p.backward_s * 1e3:.1f} ms, optimizer "
            f"{p.optimizer_s * 1e3:.1f} ms; buckets ready at {ready} ms into the backward pass")


def render(advice: Advice) -> Any:
    from rich.table import Table

    first = advice.bandwidths[0]
    quality = advice.steps_to_target is not None
    by = "predicted time to target" if quality else "predicted step time"
    table = Table(title=f"gradpress advise: {advice.workers} workers, α = {advice.latency * 1e3:.3g} ms; "
                        f"ranked by {by} at {first} (speed-up: over {BASELINE}'s samples/s"
                        f"{'; time to target' if quality else ''})")
    for column in ("#", "method", "exchange", "bytes/step", "sent/link", "compr. ms"):
        table.add_column(column, justify="left" if column in ("method", "exchange") else "right",
                         no_wrap=column == "method")
    if quality:
        table.add_column("steps to target", justify="right")
    for bw in advice.bandwidths:
        table.add_column(f"step ms @{bw}", justify="right")
        table.add_column(f"× @{bw}" + (" (to target)" if quality else ""), justify="right")
    table.add_column("pays below", justify="right")
    at = {bw: {r.spec: r for r in rows} for bw, rows in advice.rankings.items()}
    for row in advice.rankings[first]:
        cells = [str(row.rank), row.spec, _exchange(advice, row.spec), _bytes(row.packet_bytes),
                 _bytes(row.wire_bytes), f"{row.predicted.compression * 1e3:.1f}"]
        if quality:
            cells.append("not reached" if row.steps_to_target is None else f"{row.steps_to_target:.0f}")
        for bw in advice.bandwidths:
            mine = at[bw][row.spec]
            speed = f"{mine.speedup:.2f}×"
            if quality:
                to_target = mine.speedup_time_to_target
                speed += f" ({to_target:.2f}×)" if to_target else " (n/a)"
            cells += [f"{mine.predicted.total * 1e3:.1f}", f"{speed} #{mine.rank}"]
        cells.append("" if row.spec == BASELINE else _rate(advice.crossovers[row.spec]))
        table.add_row(*cells)
    return table


def _exchange(advice: Advice, spec: str) -> str:
    if spec == BASELINE:
        return "allreduce (DDP)"
    cost = next(c for c in advice.costs if c.spec == spec)
    return cost.exchange


def summary_lines(advice: Advice) -> list[str]:
    """The pick at each link speed and the line to paste."""
    lines = []
    for bw in advice.bandwidths:
        rows = advice.rankings[bw]
        best = rows[0]
        why = (f"time to target {best.time_to_target_s:.3g} s" if best.time_to_target_s is not None
               else f"step {best.predicted.total * 1e3:.1f} ms")
        lines.append(f"at {bw}: {best.spec} ({why}, {best.speedup:.2f}× {BASELINE}'s samples/s)  →  "
                     f"{register_line(best.spec)}")
        close = [r.spec for r in rows[1:] if (r.time_to_target_s is None) == (best.time_to_target_s is None)
                 and _key(r) <= _key(best) * (1 + NEAR)]
        if close:
            lines.append(f"  within {NEAR:.0%} of it (a tie within measurement noise): {', '.join(close)}")
    return lines


def _key(row: Ranked) -> float:
    return row.time_to_target_s if row.time_to_target_s is not None else row.predicted.total


def to_json(advice: Advice, setting: Mapping[str, Any] | None = None) -> dict[str, Any]:
    def number(x: float | None) -> float | str | None:
        return "inf" if x == math.inf else x

    def ranked(r: Ranked) -> dict[str, Any]:
        out = asdict(r)
        out["samples_per_s"] = advice.profile.batch_size * advice.workers / r.predicted.total
        return out

    return {
        "setting": dict(setting or {}),
        "workload": advice.workload, "data": advice.source, "workers": advice.workers,
        "latency": advice.latency, "bandwidths": advice.bandwidths,
        "profile": {**asdict(advice.profile), "compute_s": advice.profile.compute_s},
        "methods": [{**asdict(c), "packet_bytes_per_step": c.packet_bytes,
                     "wire_bytes_per_step": c.wire_bytes(advice.workers),
                     "pays_below_bits_per_second": number(advice.crossovers.get(c.spec))}
                    for c in advice.costs],
        "rankings": {bw: [ranked(r) for r in rows] for bw, rows in advice.rankings.items()},
        "best": {bw: advice.best(bw).spec for bw in advice.bandwidths},
        "register": {bw: register_line(advice.best(bw).spec) for bw in advice.bandwidths},
        "skipped": advice.skipped,
        "quality": None if not advice.quality else {
            "target": advice.target, "steps_to_target": advice.steps_to_target,
            "curves": [asdict(c) for c in advice.quality]},
        "quality_note": advice.quality_note,
        "seconds": advice.measure_seconds,
    }


def plot(advice: Advice, path: str | Path, limit: int = PLOTTED) -> Path:
    """Predicted speed-up over ``torch-allreduce`` against link speed (10 Mbit/s to 400 Gbit/s, log axes),
    one line per method (the ``limit`` best at the requested speeds), each method's crossing marked."""
    import numpy as np
    from matplotlib.figure import Figure

    from gradpress.testbed.netem import rate_bits_per_second

    profile, n = advice.profile, advice.workers
    base = baseline_cost(profile)
    best = {}
    for rows in advice.rankings.values():
        for r in rows:
            best[r.spec] = max(best.get(r.spec, 0.0), r.speedup)
    chosen = sorted((c for c in advice.costs), key=lambda c: -best.get(c.spec, 0.0))[:limit]
    grid = np.geomspace(*PLOT_RANGE, 90)
    figure = Figure(figsize=(7.5, 4.8))
    axis = figure.subplots()
    for cost in chosen:
        ys = [speedup_at(profile, cost, float(bw), n=n, latency=advice.latency, baseline=base) for bw in grid]
        cross = advice.crossovers.get(cost.spec, 0.0)
        (line,) = axis.plot(grid, ys, label=f"{cost.spec} ({_pays(cross)})")
        if PLOT_RANGE[0] <= cross <= PLOT_RANGE[1]:
            axis.plot([cross], [1.0], marker="o", color=line.get_color(), markersize=6)
    axis.axhline(1.0, color="gray", linewidth=0.8, label=f"{BASELINE}")
    for bw in advice.bandwidths:
        axis.axvline(rate_bits_per_second(bw), color="gray", linestyle=":", linewidth=0.8)
        axis.annotate(bw, (rate_bits_per_second(bw), 0.0), xycoords=("data", "axes fraction"),
                      textcoords="offset points", xytext=(2, 4), fontsize=7, color="gray")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set(xlabel="link speed (bits/s)", ylabel=f"predicted speed-up over {BASELINE} (samples/s)",
             title=f"{advice.workload}, {n} workers: where compression pays (● = stops paying)")
    axis.grid(True, which="major", alpha=0.3)
    axis.legend(fontsize="x-small", loc="upper right")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


# ==================================================================================================
# Checked against measurement: compare's runs beside the prediction
# ==================================================================================================
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


# ==================================================================================================
# Command line
# ==================================================================================================
def _model(text: str) -> str:
    """A testbed model spec, or ``package.module:factory`` (importable, callable)."""
    if is_factory(text):
        try:
            load_object(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(cli.one_line(error)) from None
        return text
    return cli.model(text)


def _reference(text: str) -> str:
    """``package.module:function``, importable and callable."""
    try:
        load_object(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(cli.one_line(error)) from None
    return text


def _shape(text: str) -> tuple[int, ...]:
    """A per-sample input shape: comma-separated positive integers (``3,32,32``)."""
    return tuple(cli.int_list(1)(text))


def _rates(text: str) -> list[str]:
    """Comma-separated link rates in tc's units (``100mbit,1gbit``)."""
    rates = [piece.strip() for piece in text.split(",")]
    if not all(rates):
        raise argparse.ArgumentTypeError(f"expected comma-separated link rates (e.g. 100mbit,1gbit), "
                                         f"got {text!r}")
    return [cli.rate(rate) for rate in rates]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from gradpress.testbed.data import dataset_names

    p = subparsers.add_parser("advise", help="which compressor pays off for a model on a network: profile, "
                                             "then the α–β model", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=_model, default="mlp-wide",
                   help="a testbed model spec (mlp-wide, resnet:width=32, …) or package.module:factory "
                        "returning an nn.Module (default mlp-wide)")
    p.add_argument("--input-shape", type=_shape,
                   help="a factory model's input shape per sample, e.g. 3,32,32 (random inputs, timing only)")
    p.add_argument("--batch", type=_reference, metavar="PACKAGE.MODULE:FUNCTION",
                   help="a factory model's batches: FUNCTION(batch_size) returns (inputs, targets)")
    p.add_argument("--batch-size", type=cli.positive_int, help="per-worker batch (default: the model's; 32)")
    p.add_argument("--workers", type=cli.integer(1, 1024), default=2, help="workers n to price (1..1024)")
    p.add_argument("--bandwidth", type=_rates, default=DEFAULT_BANDWIDTHS,
                   help=f"link rates per worker, comma-separated (default {DEFAULT_BANDWIDTHS})")
    p.add_argument("--latency", type=cli.non_negative_float, default=costmodel.DEFAULT_LATENCY,
                   help=f"per-message latency α in seconds (default {costmodel.DEFAULT_LATENCY:g})")
    p.add_argument("--compressors", type=cli.compressor_list(keywords=("default", "demo")), default="default",
                   help="comma-separated specs; 'default': every registered method at its defaults and "
                        "top-k/random-k at ratios 0.1 and 0.001; 'demo': " + ",".join(DEMO))
    p.add_argument("--quality-steps", type=cli.positive_int, metavar="K",
                   help="also train K steps per method (simulated workers) and rank by time to the "
                        "uncompressed quality")
    p.add_argument("--quality-workers", type=cli.integer(1, 1024),
                   help="simulated workers of the quality runs (default min(n, 4))")
    p.add_argument("--data", choices=dataset_names(), help="a testbed model's dataset (default: the model's)")
    p.add_argument("--tolerance", type=cli.non_negative_float,
                   help="target = uncompressed best − tolerance (default: compare's, per metric)")
    p.add_argument("--lr", type=cli.positive_float, help="learning rate (default: the model's; 0.01)")
    p.add_argument("--repeats", type=cli.positive_int, default=5,
                   help="timed steps of the profile (medians); each method: repeats − 2, at least 1")
    p.add_argument("--threads", type=cli.positive_int, default=1,
                   help="torch threads (default 1, as each testbed worker)")
    p.add_argument("--bucket-cap-mb", type=cli.positive_float, default=25.0, help="DDP's bucket_cap_mb")
    p.add_argument("--seed", type=cli.seed, default=0)
    p.add_argument("--check", nargs="+", metavar="PATH",
                   help="compare output directories or results.json: their runs' measured steps beside the "
                        "prediction at their n and link rate")
    p.add_argument("--json", type=cli.output_file, help="write the profile, costs and rankings here")
    p.add_argument("--plot", type=cli.output_file, help="write the speed-up against link speed here (PNG)")
    p.set_defaults(func=_main)


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload the arguments name; :class:`~gradpress.cli.UsageError` for what does not hold together."""
    factory = is_factory(args.model)
    if not factory:
        if args.input_shape is not None or args.batch is not None:
            raise cli.UsageError(f"--input-shape and --batch are for a package.module:factory model; "
                                 f"{args.model} is a testbed model and knows its inputs")
        try:
            workload = testbed_workload(args.model, args.batch_size, args.data, args.lr)
        except ValueError as error:
            raise cli.UsageError(f"--model {args.model}: {cli.one_line(error)}") from None
    else:
        if args.data is not None:
            raise cli.UsageError("--data is for a testbed model; a factory model's batches come from --batch")
        if args.input_shape is None and args.batch is None:
            raise cli.UsageError(f"--model {args.model}: a factory model needs --input-shape (random inputs) "
                                 "or --batch (a function returning (inputs, targets))")
        try:
            workload = factory_workload(args.model, args.input_shape, args.batch, args.batch_size, args.lr)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(args.seed)
                model = workload.build()
            x, y = workload.sample(torch.Generator().manual_seed(0))
            workload.loss(model(x), y).backward()
        except (ValueError, TypeError, RuntimeError) as error:
            raise cli.UsageError(f"--model {args.model}: {type(error).__name__}: "
                                 f"{cli.one_line(error)}") from None
    if args.quality_steps and workload.shard_size is not None:
        q_workers = args.quality_workers or min(args.workers, 4)
        if workload.shard_size(q_workers) < workload.batch_size:
            raise cli.UsageError(f"--batch-size {workload.batch_size}: a shard for {q_workers} quality "
                                 f"workers holds {workload.shard_size(q_workers)} samples, not one batch")
    if args.quality_steps and workload.quality_unavailable is not None and factory:
        raise cli.UsageError(f"--quality-steps: {workload.quality_unavailable}")
    return workload


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

    workload = workload_of(args)
    specs = candidates(args.compressors)
    runs = []
    if args.check:
        from gradpress.testbed.sim import load_results

        try:
            runs = load_results(*args.check)
        except ValueError as error:
            raise cli.UsageError(f"--check: {cli.one_line(error)}") from None
    import gradpress

    for spec in specs:
        try:
            gradpress.Simulator(spec, min(2, args.workers))
        except ValueError as error:
            raise cli.UsageError(f"--compressors {spec}: {cli.one_line(error)}") from None
    quality = bool(args.quality_steps) and workload.quality_unavailable is None
    total = 1 + len(specs) + (len(specs) + 1 if quality else 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    stderr = Console(stderr=True)
    try:
        with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 console=stderr, transient=True) as bar:
            task = bar.add_task("advise", total=total)
            seen = [0]

            def progress(what: str) -> None:
                if seen[0]:
                    bar.advance(task)
                seen[0] += 1
                bar.update(task, description=what[:70])

            advice = advise(workload, specs, workers=args.workers, bandwidths=args.bandwidth,
                            latency=args.latency, repeats=args.repeats, quality_steps=args.quality_steps,
                            quality_workers=args.quality_workers, tolerance=args.tolerance,
                            bucket_cap_mb=args.bucket_cap_mb, seed=args.seed, threads=args.threads,
                            progress=progress)
    finally:
        torch.set_num_threads(threads)
    from gradpress.testbed.sim.common import wide_console

    console = wide_console()
    console.print(describe_profile(advice))
    if advice.quality_note:
        stderr.print(advice.quality_note)
    if advice.target is not None:
        first = advice.quality[0]
        console.print(f"quality: {args.quality_steps} steps with {first.workers} simulated workers; target "
                      f"{first.metric} {'≥' if first.higher_is_better else '≤'} {advice.target:.4g} "
                      f"(`{QUALITY_REFERENCE}`'s best {first.best:.4g})")
    console.print(render(advice))
    for spec, why in advice.skipped.items():
        console.print(f"left out {spec}: {why}")
    for line in summary_lines(advice):
        console.print(line, highlight=False, markup=False)
    console.print(f"measured in {advice.measure_seconds:.0f} s")
    checks = check_against(advice, runs) if runs else []
    if checks:
        console.print(render_checks(checks))
        errors = [abs(c.relative_error) for c in checks if c.spec != "noop"]
        if errors:
            console.print(f"largest |error| {max(errors):.1%}, mean {statistics.fmean(errors):.1%}")
        errors = [abs(c.with_noop_error) for c in checks if c.with_noop_error is not None]
        if errors:
            console.print(f"with noop's compute: largest |error| {max(errors):.1%}, "
                          f"mean {statistics.fmean(errors):.1%}")
        top = [c for c in checks if c.predicted_rank == 1]
        if top:
            console.print(f"top pick {top[0].spec}: measured rank {top[0].measured_rank} by samples/s")
    elif runs:
        console.print("--check: no run over an emulated link of a method priced here")
    if args.json:
        setting = {k: v for k, v in vars(args).items() if k != "func"}
        record = to_json(advice, setting)
        record["checks"] = [{**asdict(c), "relative_error": c.relative_error,
                             "with_noop_error": c.with_noop_error} for c in checks]
        cli.writable_parent(args.json).write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot(advice, args.plot)}")
    return 0


__all__ = ["Advice", "Bucket", "BucketCost", "Checked", "ComputeProfile", "MethodCost", "QualityCurve",
           "Ranked", "Transfer", "Workload", "add_parser", "advise", "assign_buckets", "baseline_cost",
           "check_against", "crossover", "factory_workload", "measure_method", "predict", "profile_compute",
           "quality_curve", "rank", "register_line", "steps_to_reach", "testbed_workload", "transfers_of"]
