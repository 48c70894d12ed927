"""The one library module that calls ``torch.distributed``: runs protocols on a process group.

:class:`ProcessGroupExecutor` issues a protocol's rounds (:mod:`gradpress.exchange.protocol`) on a Gloo, NCCL or
other process group, asynchronously; :class:`Handle` is a round in flight. :func:`process_group` gives
the group gradpress talks on (a new one with its own timeout when asked), :func:`rank_and_size` and
:func:`gather_objects` the little else the front ends need (a state's rank; a gathered checkpoint).
Everything else in the library builds protocols and never touches a process group, so
``gradpress.simulate`` can run them in one process. Drivers outside the library (the testbed's
training loop, the benchmarks) set up their own process groups.

Leaving the interpreter: a callback on a collective's future runs on the backend's thread (Gloo's
worker threads), and that thread takes the GIL again after the thread waiting on the future has woken
(to return from ``set_result``, to let go of the callback and of the future's value). A script that
returns right after its last step lets the interpreter finalize meanwhile, and CPython ends a thread
that asks for the GIL then (``pthread_exit``) inside a C++ destructor: "terminate called without an
active exception", SIGABRT. So every callback gradpress hands to a backend goes through :func:`chain`,
which counts it until the backend lets it go and keeps what it reaches (the round's works, their
tensors, the future of its result) referenced from Python; at exit gradpress waits, the GIL released,
until the backends have let every callback of its go, then destroys the groups it made
(:func:`process_group`), newest first. The same loop with PyTorch's own comm hook still leaves that
race to chance; ``torch.distributed.destroy_process_group()`` at the end of a script, as PyTorch
documents, is still what ends the backends' own work.
"""
from __future__ import annotations

import atexit
import functools
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, cast

import torch

from gradpress.exchange.protocol import (
    AllGather,
    AllReduce,
    Broadcast,
    Collective,
    Gather,
    ReduceScatter,
    Round,
    fold_sum,
    traffic,
)


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
            return chain(self._works[0].get_future(), finish, keep=self)
        return chain(torch.futures.collect_all([w.get_future() for w in self._works]), finish, keep=self)

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
            # (torch's stubs type ReduceOp.SUM as a RedOpType, which this ReduceOp attribute takes)
            options.reduceOp, options.asyncOp = cast(dist.ReduceOp, op), True
            self._allreduce_options[name] = options
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        _EXIT.adopt(self)

    def issue(self, round_: Round, sent: Callable[[int, int], None], done: Callable[[float], None]) -> Handle:
        """Start every collective of ``round_`` in order; ``sent(bytes_sent, bytes_received)`` is called
        per collective, ``done(seconds)`` when the round completes."""
        if self.group is _CLOSED:
            raise RuntimeError("gradpress: the interpreter is exiting; gradpress destroyed its process group")
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
            gathered = torch.empty((n, *t.shape), dtype=t.dtype, device=t.device) \
                if self.rank == request.dst else None
            work = dist.gather(t, list(gathered.unbind(0)) if gathered is not None else None,
                               dst=self._global(request.dst, group), group=group, async_op=True)
            return work, lambda: gathered
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
    made = dist.new_group(ranks=ranks, timeout=timeout, backend=dist.get_backend(group),
                          use_local_synchronization=True)
    _EXIT.made(made)
    return made


# -- two levels: the ranks of a node, and the ranks of one local index across nodes -------------------
def spans_world(group: Any = None) -> bool:
    """Whether ``group`` (None: the default group) holds every rank of the job in rank order, so that
    torchrun's per-node environment (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``) describes its ranks."""
    import torch.distributed as dist

    if group is None or group is dist.group.WORLD:
        return True
    return dist.get_process_group_ranks(group) == list(range(dist.get_world_size()))


def node_groups(group: Any, local_size: int, timeout: float | timedelta | None = None) -> tuple[Any, Any]:
    """``(node, cross)``: this rank's node group (the ``local_size`` ranks of ``group`` whose group ranks
    are ``node·local_size`` … ``node·local_size + local_size − 1``) and its cross-node group (the ranks of
    ``group`` with this rank's local index on every node), made with ``new_group``. Every rank of
    ``group`` calls it, and so calls every ``new_group`` in the same order: the node groups by node,
    then the cross-node groups by local index (each rank a member of one of each, so the ranks of a new
    group have made as many groups before it, and name it alike). ``timeout``: what their collectives
    wait (default: PyTorch's default for the backend). Destroyed at exit, as :func:`process_group`'s.

    The two-level exchange's reduce-scatter inside the node is an all-to-all and a rank-order sum
    (:class:`~gradpress.exchange.protocol.ReduceScatter`), as every gradpress sum over 3+ ranks: Gloo in
    torch 2.13 has ``reduce_scatter_tensor`` and ``all_gather_into_tensor``, but the order in which its
    reduce-scatter adds the ranks' values is its own, and simulate's sums are in rank order."""
    import torch.distributed as dist

    if timeout is not None and not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    rank = dist.get_rank(group)
    nodes = len(ranks) // local_size
    backend = dist.get_backend(group)
    layouts = ([ranks[n * local_size:(n + 1) * local_size] for n in range(nodes)]
               + [ranks[j::local_size] for j in range(local_size)])
    mine = [rank // local_size, nodes + rank % local_size]
    made = []
    for members in layouts:
        created = dist.new_group(ranks=members, timeout=timeout, backend=backend,
                                 use_local_synchronization=True)
        if created is not None and created is not dist.GroupMember.NON_GROUP_MEMBER:
            _EXIT.made(created)
        made.append(created)
    return made[mine[0]], made[mine[1]]


class NodeExecutor:
    """Issues a round on the group gradpress talks on, or by its ``scope``
    (:class:`~gradpress.exchange.protocol.Round`) on this rank's node group (``"node"``) or cross-node
    group (``"cross"``), made (:func:`node_groups`) when the first such round is issued: after the
    ranks' agreement, which checks that they see the same nodes (a rank that saw others would call
    ``new_group`` with other ranks and wait)."""

    def __init__(self, executor: ProcessGroupExecutor, local_size: int, timeout: float | None = None) -> None:
        self.talk, self.local_size, self.timeout = executor, local_size, timeout
        self.group, self.given = executor.group, executor.given
        self.rank, self.world_size = executor.rank, executor.world_size
        self._scoped: dict[str, ProcessGroupExecutor] | None = None

    def issue(self, round_: Round, sent: Callable[[int, int], None], done: Callable[[float], None]) -> Handle:
        if not round_.scope:
            return self.talk.issue(round_, sent, done)
        if self._scoped is None:
            node, cross = node_groups(self.talk.group, self.local_size, self.timeout)
            self._scoped = {"node": ProcessGroupExecutor(node), "cross": ProcessGroupExecutor(cross)}
        return self._scoped[round_.scope].issue(round_, sent, done)


# -- leaving the interpreter (see the module docstring) ------------------------------------------------
EXIT_WAIT_S = 10.0
"""At exit, how long gradpress waits for the backends to let its callbacks go (a collective still in
flight, a peer stuck or gone) before it leaves the rest to PyTorch; a healthy job waits microseconds."""


class _Closed:
    """The group of an executor whose group gradpress destroyed at exit."""

    def __repr__(self) -> str:
        return "<gradpress: process group destroyed at exit>"


_CLOSED: Any = _Closed()


def chain(future: torch.futures.Future, callback: Callable[[torch.futures.Future], Any],
          keep: Any = None) -> torch.futures.Future:
    """``future.then(callback)``, ``callback`` (run by the backend thread that completes ``future``)
    counted until the backend lets it go, and ``keep`` (what it reaches: a :class:`Handle`, its works
    and tensors), ``future`` and the returned future referenced until then, so that the backend's thread
    never holds their last reference: it would need the GIL to release them."""
    return _EXIT.chain(future, callback, keep)


def all_settled(futures: list[torch.futures.Future], devices: list[torch.device] | None = None
                ) -> torch.futures.Future:
    """A future completed (with None) once every one of ``futures`` has completed, with a result or an
    error. ``torch.futures.collect_all`` fails at the first error, while the others may still run: the
    caller would then meet whichever failed first, which differs between ranks, instead of the failure
    of the first exchange started (the same on every rank, see :class:`gradpress.exchange.driver.Driver`).
    ``devices``: those of the futures' tensors (CUDA)."""
    settled: torch.futures.Future[None] = torch.futures.Future(devices=[*devices]) if devices \
        else torch.futures.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_settled(_: torch.futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            settled.set_result(None)

    if not futures:
        settled.set_result(None)
    for future in futures:
        chain(future, one_settled)
    return settled


_THEN = torch._C.Future.then


class _Counted(functools.partial):
    """A callback handed to a backend: it tells :class:`_Exit` when the backend lets it go. A partial,
    called from C, is in no frame of a traceback (a Python function would be, and an error of the
    callback, kept by the driver, would keep it alive)."""

    __slots__ = ()
    registry: _Exit

    def __del__(self) -> None:
        self.registry.gone(id(self))


class _Exit:
    """The callbacks gradpress has handed to backend threads and the groups it made, for a clean exit.
    (Without a lock: each change is one operation on a dict or list, whole under the GIL.)"""

    def __init__(self) -> None:
        self.pending: dict[int, list] = {}  # id(callback) -> [keep, the future, the next]: not let go yet
        self.let_go: list[list] = []  # what callbacks let go reached, dropped by the next chain()
        self.groups: list[tuple[Any, weakref.WeakSet]] = []  # made groups and their executors, oldest first
        self._registered = False
        self._parents: list = []  # in a forked child, its parent's (never touched: see forked)

    def _register(self) -> None:
        if not self._registered:
            self._registered = True
            atexit.register(self.exit)

    def chain(self, future: torch.futures.Future, callback: Callable[[torch.futures.Future], Any],
              keep: Any) -> torch.futures.Future:
        if not self._registered:
            self._register()
        run = _Counted(callback)
        entry = [keep, future, None]
        self.pending[id(run)] = entry
        if self.let_go:
            self.let_go = []  # dropped here, on a Python thread
        # a future complete already runs ``run`` here; an error it raises keeps its frame and so its
        # callers' frames with their locals: ``run`` goes to the C method (torch's ``Future.then`` would
        # hold it in a local) and leaves this frame
        entry[2] = _THEN(future, run)
        del run
        return entry[2]

    def gone(self, key: int) -> None:
        """A backend let a callback go (on its thread, holding the GIL): what it reached is kept a while."""
        entry = self.pending.pop(key, None)
        if entry is not None:
            self.let_go.append(entry)

    def forked(self) -> None:
        """In a child forked from this process: the parent's callbacks and groups are not the child's to
        wait for or destroy (their backend threads did not fork), nor to release (their locks may be held)."""
        self._parents.append((self.pending, self.let_go, self.groups))
        self.pending, self.let_go, self.groups = {}, [], []

    def made(self, group: Any) -> None:
        """``group`` was made by gradpress: destroyed at exit."""
        self._register()
        self.groups.append((group, weakref.WeakSet()))

    def adopt(self, executor: ProcessGroupExecutor) -> None:
        for group, executors in self.groups:
            if group is executor.group:
                executors.add(executor)

    def settle(self, timeout: float) -> bool:
        """Wait, the GIL released, until the backends have let every callback go; whether they have."""
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.001)
        return not self.pending

    def exit(self) -> None:
        """At exit: settle, then destroy the groups gradpress made (a collective still in flight on one
        would hold up its destruction: they are left to PyTorch then). What the callbacks reached stays
        referenced until the interpreter's own teardown."""
        if self.settle(EXIT_WAIT_S):
            self.destroy_groups()

    def destroy_groups(self) -> None:
        """Destroy the groups gradpress made, newest first (the same order on every rank), and close the
        executors on them."""
        import torch.distributed as dist

        groups, self.groups = self.groups, []
        for group, executors in reversed(groups):
            for executor in list(executors):
                executor.group = _CLOSED
                if executor.given is group:
                    executor.given = _CLOSED
            if dist.is_available() and dist.is_initialized():
                try:
                    dist.destroy_process_group(group)
                except ValueError:  # destroyed already (with the default group)
                    pass
        del groups  # the groups' last references: their backends' threads end here


_EXIT = _Exit()
_Counted.registry = _EXIT
if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_EXIT.forked)
