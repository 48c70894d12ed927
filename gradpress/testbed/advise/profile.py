"""The compute of a step without communication and DDP's bucket layout (``advise``'s profile, see
:mod:`gradpress.testbed.advise`): read from a real DDP over a one-process Gloo group, or replicated."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import replace
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from gradpress.costmodel.profile import FIRST_BUCKET_BYTES, Bucket, ComputeProfile, assign_buckets
from gradpress.testbed import arguments
from gradpress.testbed.advise.workload import Workload, _optimizer


class _NoDDP(RuntimeError):
    pass


def profile_compute(workload: Workload, *, repeats: int = 5, workers: int = 2, bucket_cap_mb: float = 25.0,
                    seed: int = 0, threads: int = 1, warmup: int = 8,
                    use_ddp: bool = True) -> tuple[ComputeProfile, list[dict[str, torch.Tensor]]]:
    """Time ``workload``'s steps and find its buckets (package doc); also returns ``workers`` gradients
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


@contextlib.contextmanager
def _one_process_group() -> Iterator[None]:
    """A one-process Gloo group while the block runs (:class:`_NoDDP` where none can be made)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise _NoDDP("torch.distributed is not available")
    if dist.is_initialized():
        raise _NoDDP("a process group already exists in this process")
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    except Exception as error:  # noqa: BLE001 - any failure to make the group: replicate the layout
        raise _NoDDP(f"no one-process Gloo group ({type(error).__name__}: "
                     f"{arguments.one_line(error)})") from None
    try:
        yield
    finally:
        dist.destroy_process_group()


def _ddp_profile(model, generator, workload, repeats, warmup, workers, cap_mb,  # noqa: ANN001, ANN202
                 threads):
    with _one_process_group():
        names = _names(model)
        try:
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
        except Exception as error:  # noqa: BLE001 - DDP refuses the model: replicate the layout
            raise _NoDDP(f"DDP refused the model ({type(error).__name__}: "
                         f"{arguments.one_line(error)})") from None
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
            raise _NoDDP(f"DDP could not train the model ({arguments.one_line(error)})") from None
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
