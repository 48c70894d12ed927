"""Samples, shards and datasets (see :mod:`gradpress.testbed.data`): a :class:`Split` of inputs and targets,
the disjoint, equally large shard of each rank, and the :class:`Dataset` every family's data derives from;
the cache directory and :class:`DataUnavailable`."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Iterator, TypeVar

import torch

CACHE_ENV = "GRADPRESS_DATA"
Say = Callable[[str], None]
D = TypeVar("D", bound="Dataset")


class DataUnavailable(RuntimeError):
    """A dataset's source is not on this machine (the message says how to get it)."""


def cache_dir() -> Path:
    """``$GRADPRESS_DATA``, or ``~/.cache/gradpress``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "gradpress")


def quiet(_: str) -> None:
    pass


def shard_indices(n: int, rank: int, world_size: int, seed: int | None = 0) -> torch.Tensor:
    """Indices of rank ``rank``'s shard of ``n`` samples split over ``world_size`` workers.

    The samples are permuted with a generator seeded by ``seed`` (the same on every rank; ``None``
    keeps their order) and cut into ``world_size`` contiguous pieces of ``n // world_size``: the shards
    are disjoint and equally large, so every rank takes the same number of steps per epoch; the
    ``n % world_size`` samples left over are dropped.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} workers")
    per_rank = n // world_size
    if per_rank == 0:
        raise ValueError(f"cannot give each of {world_size} workers a sample: there are only {n}")
    if seed is None:
        order = torch.arange(n)
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[rank * per_rank:(rank + 1) * per_rank].clone()


@dataclass
class Split:
    """``len(x)`` samples: inputs ``x[i]`` with targets ``y[i]``."""

    x: torch.Tensor
    y: torch.Tensor

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{len(self.x)} inputs but {len(self.y)} targets")

    def __len__(self) -> int:
        return len(self.x)

    def subset(self, index: torch.Tensor) -> Split:
        return Split(self.x[index], self.y[index])

    def shard(self, rank: int, world_size: int, seed: int | None = 0) -> Split:
        """Rank ``rank``'s disjoint, equally large shard (:func:`shard_indices`)."""
        return self.subset(shard_indices(len(self), rank, world_size, seed))

    def batches(self, batch_size: int, generator: torch.Generator | None = None,
                drop_last: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Mini-batches ``(x, y)``, shuffled by ``generator`` (in order when it is None)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        n = len(self)
        order = torch.arange(n) if generator is None else torch.randperm(n, generator=generator)
        stop = n - n % batch_size if drop_last else n
        for start in range(0, stop, batch_size):
            index = order[start:start + batch_size]
            yield self.x[index], self.y[index]


@dataclass
class Dataset:
    """A training and a test :class:`Split` of one task; subclasses add what their models need."""

    name: str
    train: Split
    test: Split
    task: ClassVar[str] = ""

    def shard(self: D, rank: int, world_size: int, seed: int | None = 0) -> D:
        """The same dataset with rank ``rank``'s shard of the training set (the test set is whole)."""
        return dataclasses.replace(self, train=self.train.shard(rank, world_size, seed))

    def training_set(self, generator: torch.Generator) -> Split:
        """The samples of one training epoch (recommendation draws fresh negatives each epoch)."""
        return self.train

    def model_kwargs(self) -> dict[str, int]:
        """Sizes a model of this task takes from the data (``make_model(name, data=...)``)."""
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError
