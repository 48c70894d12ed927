"""What ``gradpress advise`` profiles: a model, its batches and its loss (and, for quality, data and a
metric), from a testbed model spec or the user's ``package.module:factory`` (see
:mod:`gradpress.testbed.advise`)."""
from __future__ import annotations

import argparse
import importlib
import os
import re
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from gradpress.testbed import arguments


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
    from gradpress.core.registry import parse_spec
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
    from gradpress.core.registry import parse_spec
    from gradpress.testbed import data as datasets
    from gradpress.testbed.models import LOSSES, QUALITY, evaluate, model_config, models

    cls = models.get(parse_spec(spec)[0])
    name = data_name or cls.dataset
    try:
        dataset = datasets.load(name)
        why = None
    except datasets.DataUnavailable as error:
        dataset, why = None, f"{name} is not available: {arguments.one_line(error)}"
    settings = model_config(spec, dataset)
    settings.build()  # bad sizes fail here
    batch = batch_size or settings.batch_size
    task = cls.task
    sample: Callable[[torch.Generator], tuple[Any, Any]]
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
        from gradpress.testbed.sim.quality import _endless_batches

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
    build = _factory_builder(reference)
    batch = batch_size or 32
    lr = 0.01 if lr is None else lr
    if batch_reference is None:
        return _random_inputs_workload(reference, build, input_shape, batch, lr)
    return _factory_batches_workload(reference, build, batch_reference, batch, lr)


def _factory_builder(reference: str) -> Callable[[], nn.Module]:
    """What builds the model of ``reference`` (``package.module:factory``), checked to be an ``nn.Module``."""
    factory = load_object(reference)

    def build() -> nn.Module:
        model = factory()
        if not isinstance(model, nn.Module):
            raise ValueError(f"{reference} returned a {type(model).__name__}, not a torch.nn.Module")
        return model

    return build


def _random_inputs_workload(reference: str, build: Callable[[], nn.Module], input_shape: Sequence[int] | None,
                            batch: int, lr: float) -> Workload:
    """A factory model on random inputs of ``input_shape`` per sample: timing only (no quality)."""
    if input_shape is None:
        raise ValueError("a factory model needs --input-shape (random inputs) or --batch (its batches)")
    shape = (batch, *input_shape)
    return Workload(reference, build, lambda g: (torch.randn(shape, generator=g), None),
                    lambda out, _: out.float().square().mean(), batch,
                    f"random inputs of shape {tuple(input_shape)}", lr=lr,
                    quality_unavailable="--quality-steps needs --batch: random inputs have no quality")


def _factory_batches_workload(reference: str, build: Callable[[], nn.Module], batch_reference: str,
                              batch: int, lr: float) -> Workload:
    """A factory model on the batches of ``batch_reference`` (``FUNCTION(batch_size)`` returns ``(inputs,
    targets)``), each drawn under a seed of its own; its quality: the loss on four held-out batches."""
    batch_factory = load_object(batch_reference)

    def draw(seed: int) -> tuple[Any, Any]:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drawn = batch_factory(batch)
        if not (isinstance(drawn, (tuple, list)) and len(drawn) == 2):
            raise ValueError(f"{batch_reference}({batch}) must return (inputs, targets), "
                             f"got {type(drawn).__name__}")
        return drawn[0], drawn[1]

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
            return statistics.fmean(float(_factory_loss(model(x), y)) for x, y in held_out)
        finally:
            model.train(was)

    def sample(generator: torch.Generator) -> tuple[Any, Any]:
        return draw(int(torch.randint(2**31 - 1, (1,), generator=generator)))

    return Workload(reference, build, sample, _factory_loss, batch, f"{batch_reference} batches",
                    lr=lr, train_batches=train_batches, evaluate=evaluate,
                    metric="loss", higher_is_better=False)


def _factory_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for integer targets, else mean squared error."""
    if not targets.is_floating_point():
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), targets.reshape(-1))
    return nn.functional.mse_loss(out.float(), targets.float().view_as(out))


def _optimizer(name: str, parameters: Any, lr: float) -> torch.optim.Optimizer:
    from gradpress.testbed.train import _optimizer as testbed_optimizer

    return testbed_optimizer(name, parameters, lr)


def workload_of(args: argparse.Namespace) -> Workload:
    """The workload the arguments name; :class:`~gradpress.testbed.arguments.UsageError` for what does not
    hold together."""
    factory = is_factory(args.model)
    if not factory:
        if args.input_shape is not None or args.batch is not None:
            raise arguments.UsageError(f"--input-shape and --batch are for a package.module:factory model; "
                                       f"{args.model} is a testbed model and knows its inputs")
        try:
            workload = testbed_workload(args.model, args.batch_size, args.data, args.lr)
        except ValueError as error:
            raise arguments.UsageError(f"--model {args.model}: {arguments.one_line(error)}") from None
    else:
        if args.data is not None:
            raise arguments.UsageError("--data is for a testbed model; a factory model's batches come from "
                                       "--batch")
        if args.input_shape is None and args.batch is None:
            raise arguments.UsageError(f"--model {args.model}: a factory model needs --input-shape (random "
                                       "inputs) or --batch (a function returning (inputs, targets))")
        try:
            workload = factory_workload(args.model, args.input_shape, args.batch, args.batch_size, args.lr)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(args.seed)
                model = workload.build()
            x, y = workload.sample(torch.Generator().manual_seed(0))
            workload.loss(model(x), y).backward()
        except (ValueError, TypeError, RuntimeError) as error:
            raise arguments.UsageError(f"--model {args.model}: {type(error).__name__}: "
                                       f"{arguments.one_line(error)}") from None
    if args.quality_steps and workload.shard_size is not None:
        q_workers = args.quality_workers or min(args.workers, 4)
        if workload.shard_size(q_workers) < workload.batch_size:
            raise arguments.UsageError(f"--batch-size {workload.batch_size}: a shard for {q_workers} quality "
                                       f"workers holds {workload.shard_size(q_workers)} samples, not one batch")
    if args.quality_steps and workload.quality_unavailable is not None and factory:
        raise arguments.UsageError(f"--quality-steps: {workload.quality_unavailable}")
    return workload
