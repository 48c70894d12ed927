"""The communication hooks under test, and what they cost: the gradpress compressor named by the spec, or
one of the reference rows (GRACE Section 5's baselines: ``noop``, ``torch-allreduce``, ``torch-fp16``,
``torch-powersgd``), each wrapped so that a :class:`_Meter` reads the compression time, communication time
and bytes it spends (:class:`Spent`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from gradpress.auto import is_auto
from gradpress.testbed.results import REFERENCES
from gradpress.testbed.training.config import TrainConfig


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
