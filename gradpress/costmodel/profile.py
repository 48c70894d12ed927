"""What the cost model knows of a training step without communication: its compute (forward, backward,
optimizer) and DDP's buckets with the time each is ready (measured by ``gradpress advise``'s profile or by
``auto``'s first steps)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

#: DDP's cap of its first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)
FIRST_BUCKET_BYTES = 1024 * 1024


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

    def scaled(self, compute_s: float) -> ComputeProfile:
        """This profile with forward, backward, optimizer and ready times scaled to a step of ``compute_s``."""
        k = compute_s / self.compute_s
        return replace(self, forward_s=self.forward_s * k, backward_s=self.backward_s * k,
                       optimizer_s=self.optimizer_s * k,
                       buckets=tuple(replace(b, ready_s=b.ready_s * k) for b in self.buckets))


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
