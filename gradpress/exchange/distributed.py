"""The one library module that calls ``torch.distributed``: runs protocols on a process group.

:class:`ProcessGroupExecutor` issues a protocol's rounds (:mod:`gradpress.exchange.protocol`) on a Gloo, NCCL or
other process group, asynchronously; :class:`Handle` is a round in flight. :func:`process_group` gives
the group gradpress talks on (a new one with its own timeout when asked), :func:`rank_and_size` and
:func:`gather_objects` the little else the front ends need (a state's rank; a gathered checkpoint).
Everything else in the library builds protocols and never touches a process group, so
``gradpress.simulate`` can run them in one process. Drivers outside the library (the testbed's
training loop, the benchmarks) set up their own process groups.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

import torch

from gradpress.exchange.protocol import (AllGather, AllReduce, Broadcast, Collective, Gather, ReduceScatter, Round,
                                fold_sum, traffic)


class Handle:
    """The collectives of one round, in flight."""

    def __init__(self, works: list, results: Callable[[], list], done: Callable[[float], None]) -> None:
        self._works, self._results, self._done = works, results, done
        self._started = time.perf_counter()

    def wait(self) -> list:
        """Block until the round completes; its results (raises if a collective failed or timed out)."""
        for work in self._works:
            work.wait()
        return self._finish()

    def future(self, then: Callable[[list], Any], failed: Callable[[BaseException], None] | None = None
               ) -> torch.futures.Future:
        """A future of ``then(the round's results)``, run by the backend thread that completes the
        round, in the same callback (one hold of the GIL). A failed collective (an error, a timeout)
        is handed to ``failed`` first, then reaches the future."""
        if not self._works:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(then(self._finish()))
            return future

        def finish(every: torch.futures.Future) -> Any:
            try:
                for sub in every.value() if len(self._works) > 1 else [every]:
                    sub.value()  # re-raises the error of a failed collective
            except BaseException as error:
                if failed is not None:
                    failed(error)
                raise
            return then(self._finish())

        if len(self._works) == 1:
            return self._works[0].get_future().then(finish)
        return torch.futures.collect_all([w.get_future() for w in self._works]).then(finish)

    def _finish(self) -> list:
        results = self._results()
        self._done(time.perf_counter() - self._started)
        return results


_SAME = object()


class ProcessGroupExecutor:
    """Issues a protocol's rounds on a ``torch.distributed`` process group (Gloo, NCCL, …), async."""

    def __init__(self, group: Any = None, given: Any = _SAME) -> None:
        """``group``: the group gradpress talks on (None: the default group); ``given``: the group it was
        made from (None: the default group), under whose own timeout rounds marked ``long_wait`` run
        (:class:`gradpress.exchange.protocol.Round`). Default: ``group``."""
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.given = group if given is _SAME else given
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        # an all-reduce is issued on the group itself, with its options made once: what dist.all_reduce
        # does for a real tensor, less ~7 µs of Python per call (one call per DDP bucket)
        self._allreduce_options = {}
        for name, op in self._ops.items():
            options = dist.AllreduceOptions()
            options.reduceOp, options.asyncOp = op, True
            self._allreduce_options[name] = options
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def issue(self, round_: Round, sent: Callable[[int, int], None], done: Callable[[float], None]) -> Handle:
        """Start every collective of ``round_`` in order; ``sent(bytes_sent, bytes_received)`` is called
        per collective, ``done(seconds)`` when the round completes."""
        works, builders = [], []
        group = self.given if round_.long_wait else self.group
        for request in round_.requests:
            sent(*traffic(request, self.rank, self.world_size))
            work, build = self._start(request, group)
            if work is not None:
                works.append(work)
            builders.append(build)
        return Handle(works, lambda: [build() for build in builders], done)

    def _global(self, rank: int, group: Any) -> int:
        return rank if group is None else self._dist.get_global_rank(group, rank)

    def _start(self, request: Collective, group: Any) -> tuple[Any, Callable[[], Any]]:
        dist, n = self._dist, self.world_size
        t = request.tensor
        if not t.is_contiguous():
            raise ValueError("collective requests take contiguous tensors")
        if isinstance(request, AllReduce):
            if n == 1:
                return None, lambda: t
            if t.is_complex():
                return dist.all_reduce(t, op=self._ops[request.op], group=group, async_op=True), lambda: t
            pg = group if group is not None else dist.group.WORLD  # (the default group now, as dist's calls)
            return pg.allreduce([t], self._allreduce_options[request.op]), lambda: t
        if isinstance(request, ReduceScatter):
            if n == 1:
                return None, lambda: t[0].clone()
            out = torch.empty_like(t)
            return dist.all_to_all_single(out, t, group=group, async_op=True), lambda: fold_sum(out)
        if isinstance(request, AllGather):
            if n == 1:
                return None, lambda: t.unsqueeze(0)
            out = torch.empty((n * t.numel(),), dtype=t.dtype, device=t.device)
            work = self._all_gather(out, t.reshape(-1), group=group, async_op=True)
            return work, lambda: out.view(n, *t.shape)
        if isinstance(request, Broadcast):
            if n == 1:
                return None, lambda: t
            src = self._global(request.src, group)
            return dist.broadcast(t, src=src, group=group, async_op=True), lambda: t
        if isinstance(request, Gather):
            if n == 1:
                return None, lambda: t.unsqueeze(0)
            mine = self.rank == request.dst
            out = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device) if mine else None
            work = dist.gather(t, list(out.unbind(0)) if mine else None, dst=self._global(request.dst, group),
                               group=group, async_op=True)
            return work, lambda: out
        raise TypeError(f"unknown collective {request!r}")


def rank_and_size(group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` (default: the default group) and the group's size."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    return dist.get_rank(group), dist.get_world_size(group)


def gather_objects(value: Any, group: Any = None) -> list[Any]:
    """Every rank's ``value`` (picklable), by rank, on every rank of ``group`` (collective)."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def process_group(group: Any = None, timeout: float | timedelta | None = None) -> Any:
    """The process group gradpress talks on: ``group`` (default: the default group), or, with a
    ``timeout``, a new group over the same ranks whose collectives raise after ``timeout`` instead of
    waiting for the default's (30 minutes). Called by every member of ``group``."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    if timeout is None:
        return group
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, timeout=timeout, backend=dist.get_backend(group),
                          use_local_synchronization=True)
