"""Many workers in one process: the runtime's own protocols, run in lockstep without a process group.

Each simulated worker has its own :class:`~gradpress.exchange.pipeline.Pipeline` (compressor, feedback memory,
step counters, rank-specific private randomness), exactly as a real rank has. At every round the
workers' collective requests are checked to match (a mismatch would hang or corrupt a real run) and
carried out with the same order-defined meaning the process-group executor gives them: sums of two
values, integer sums, max, min, broadcasts and gathers are exact in any order, and float sums over
three or more workers go through a rank-order reduce-scatter in both. So ``simulate`` returns, bit
for bit, what a real run returns for the same seeds.

After a final round every rank decodes the same received bytes in the same order
(invariant: bit-identical ranks, docs/design.md), so the simulation decodes once, on worker 0, and copies
worker 0's compressor state (e.g. warm
starts) to the others; that keeps n = 1024 workers affordable.

With ``hierarchy="node"`` and ``local_size=k`` (:mod:`gradpress.exchange.hierarchy`) the workers are
nodes of k ranks: worker r is local rank r mod k of node ⌊r / k⌋. A round's ``scope`` says which workers
meet in it (those of a node, or those of one local index on every node); a group's round is carried
out when all its workers have reached it, and every worker decodes its own shard.
"""
from __future__ import annotations

import copy
import functools
from dataclasses import fields, replace
from typing import Any, Mapping, Sequence, overload

import torch

from gradpress.core.compressor import Compressor, make
from gradpress.exchange.hierarchy import HierarchicalPipeline, check_options, make_pipeline
from gradpress.exchange.pipeline import Options, Pipeline, build
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
from gradpress.exchange.state import gathered
from gradpress.kernels.warm import warm

WorkerGrads = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]


class Simulator:
    """``workers`` simulated ranks sharing one spec and options; :meth:`step` exchanges one step's
    gradients and keeps feedback memory, step counters and warm starts for the next. With
    ``hierarchy="node", local_size=k``: nodes of k workers, the two-level exchange
    (:mod:`gradpress.exchange.hierarchy`)."""

    def __init__(self, spec: str | Compressor, workers: int, *, warm_up: bool = True, **options: Any) -> None:
        """``warm_up``: compile the method's kernels now, for float32 CPU tensors (:func:`warm_kernels`),
        rather than in the first steps."""
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self.options = Options.of(**options)
        self.world_size = workers
        build(spec)  # a bad spec or object raises once, here
        check_options(self.options, False)
        if self.options.hierarchy is not None and self.options.local_size is None:
            raise ValueError("simulating hierarchy='node' needs the ranks of a node: pass local_size=")
        self.pipelines: list[Pipeline | HierarchicalPipeline] = [
            make_pipeline(_own(spec), self.options, rank, workers, env={}) for rank in range(workers)]
        first = self.pipelines[0]
        self.hierarchical = isinstance(first, HierarchicalPipeline)
        self.layout = first.layout if isinstance(first, HierarchicalPipeline) else None
        if warm_up:
            warm_kernels([self.pipelines[0].compressor], workers, self.options, (torch.float32,))

    @overload
    def step(self, worker_grads: Sequence[torch.Tensor], *, writable: bool = False) -> torch.Tensor: ...
    @overload
    def step(self, worker_grads: Sequence[Mapping[str, torch.Tensor]], *,
             writable: bool = False) -> dict[str, torch.Tensor]: ...
    @overload
    def step(self, worker_grads: Sequence[Sequence[torch.Tensor]], *,
             writable: bool = False) -> list[torch.Tensor]: ...
    @overload
    def step(self, worker_grads: Sequence[WorkerGrads], *, writable: bool = False) -> WorkerGrads: ...

    def step(self, worker_grads: Sequence[WorkerGrads], *, writable: bool = False) -> WorkerGrads:
        """Exchange one step: ``worker_grads[r]`` is rank r's gradients (a tensor, a list of tensors or a
        dict name -> tensor; keys ``"0"``, ``"1"``, … for a list, ``""`` for a tensor). Returns what every
        rank receives (the same on all), in the same structure, shapes and dtypes. ``writable``: the
        gradients may be overwritten, as a DDP bucket's are (methods that can then work in place do; the
        result is the same)."""
        if len(worker_grads) != self.world_size:
            raise ValueError(f"expected the gradients of {self.world_size} workers, got {len(worker_grads)}")
        items = [_items(grads) for grads in worker_grads]
        for rank, mine in enumerate(items[1:], start=1):
            if [(k, t.shape, t.dtype) for k, t in mine] != [(k, t.shape, t.dtype) for k, t in items[0]]:
                raise ValueError(f"worker {rank}'s gradients differ in keys, shapes or dtypes from worker 0's")
        agreements = [p.agreement(mine) for p, mine in zip(self.pipelines, items, strict=True)]
        if agreements[0] is not None:
            self._lockstep(agreements, control=True)
        groups = [p.groups(mine, writable=writable) for p, mine in zip(self.pipelines, items, strict=True)]
        out: list[torch.Tensor] = [None] * len(items[0])  # type: ignore[list-item]
        for g, first in enumerate(groups[0]):
            if self.hierarchical:
                results = self._scoped([worker_groups[g] for worker_groups in groups])
            else:
                results = self._lockstep([worker_groups[g] for worker_groups in groups])
            for i, result in zip(first.members, results, strict=True):
                out[i] = result
        if not self.hierarchical:  # (every worker decoded its own shard)
            self._share_compressor_state()
        return _restore(worker_grads[0], out)

    def stats(self) -> list[dict[str, Any]]:
        """Every worker's :class:`~gradpress.exchange.pipeline.Stats` report, by rank."""
        return [p.report() for p in self.pipelines]

    def state_dict(self) -> list[dict[str, Any]]:
        """Every worker's state (a list by rank; :func:`gradpress.exchange.state.gathered` makes it the dict a
        real run's ``state_dict(gathered=True)`` returns)."""
        return [p.state_dict() for p in self.pipelines]

    def load_state_dict(self, state: Sequence[dict[str, Any]] | dict[str, Any],
                        on_world_size_change: str = "raise") -> None:
        """Restore :meth:`state_dict` (a list by rank) or a gathered state. A state of another number of
        workers raises ``ValueError`` unless ``on_world_size_change="reset"`` (see
        :meth:`gradpress.exchange.pipeline.Pipeline.own_part`: error feedback starts afresh)."""
        if not isinstance(state, dict):
            if len(state) != self.world_size and on_world_size_change != "reset":
                raise ValueError(f"a state of {len(state)} workers cannot load into {self.world_size} (load "
                                 f"with on_world_size_change='reset' to start error feedback afresh)")
            state = gathered(list(state))
        for pipeline in self.pipelines:  # every worker takes its own part
            pipeline.load_state_dict(state, on_world_size_change)

    # -- lockstep ------------------------------------------------------------------------------------
    def _lockstep(self, groups, control: bool = False) -> Any:
        """Drive every worker's protocol for one group; worker 0's result. ``control``: the ranks'
        agreement, whose traffic counts as ``control_bytes``."""
        protocols = [g.protocol for g in groups]
        rounds = _send_all(protocols, [None] * self.world_size)
        while isinstance(rounds[0], Round):
            _check_same(rounds)
            for rank, round_ in enumerate(rounds):
                stats = self.pipelines[rank].stats
                for request in round_.requests:
                    sent, received = traffic(request, rank, self.world_size)
                    if control:
                        stats.add(groups[rank].step, control_bytes=sent + received)
                    else:
                        stats.add_traffic(groups[rank].step, round_.scope, sent, received)
            if rounds[0].final:
                replies = _results([r.requests for r in rounds], self.world_size, only=0)
                try:
                    protocols[0].send(replies)
                except StopIteration as stop:
                    for other in protocols[1:]:
                        other.close()
                    return stop.value
                except Exception:  # every worker meets the error (and undoes its step), as in a real run
                    everyone = _results([r.requests for r in rounds], self.world_size, only=None)
                    for other, reply in zip(protocols[1:], everyone[1:], strict=True):
                        try:
                            other.send(reply)
                        except Exception:  # noqa: BLE001 - the same error as worker 0's
                            pass
                    raise
                raise RuntimeError("a protocol issued collectives after its final round")
            replies = _results([r.requests for r in rounds], self.world_size, only=None)
            rounds = _send_all(protocols, replies)
        return rounds[0]

    def _scoped(self, groups) -> Any:
        """Drive every worker's protocol for one group of the two-level exchange, each round among the
        workers of its scope, once they have all reached it; worker 0's result. A worker whose protocol
        raises stops there, as a real rank does; the lowest rank's error is raised once no group can go
        on (a real run's other ranks raise too, or, waiting for it, time out)."""
        layout = self.layout
        assert layout is not None
        protocols = [g.protocol for g in groups]
        waiting: dict[int, Round] = {}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}

        def resume(rank: int, reply: Any) -> None:
            try:
                waiting[rank] = protocols[rank].send(reply)
            except StopIteration as stop:
                results[rank] = stop.value
            except Exception as error:  # noqa: BLE001 - raised below, as every real rank raises
                errors[rank] = error

        for rank in range(self.world_size):
            resume(rank, None)
        moved = True
        while waiting and moved:
            moved = False
            for rank in sorted(waiting):
                round_ = waiting.get(rank)
                if round_ is None:
                    continue
                members = layout.members(rank, round_.scope)
                if not all(m in waiting and waiting[m].scope == round_.scope for m in members):
                    continue
                rounds = [waiting.pop(m) for m in members]
                _check_same(rounds)
                for position, (member, mine) in enumerate(zip(members, rounds, strict=True)):
                    for request in mine.requests:
                        sent, received = traffic(request, position, len(members))
                        stats = self.pipelines[member].stats
                        stats.add_traffic(groups[member].step, mine.scope, sent, received)
                replies = _results([r.requests for r in rounds], len(members), only=None)
                for member, reply in zip(members, replies, strict=True):
                    resume(member, reply)
                moved = True
        if errors:
            raise errors[min(errors)]
        if waiting:
            raise RuntimeError(f"workers diverged: workers {sorted(waiting)} wait in collectives their "
                               "groups' other workers never issue")
        return results[0]

    def _share_compressor_state(self) -> None:
        state = self.pipelines[0].compressor.state_dict()
        if state:
            for pipeline in self.pipelines[1:]:
                pipeline.compressor.load_state_dict(state)


@overload
def simulate(spec: str | Compressor, worker_grads: Sequence[torch.Tensor],
             **options: Any) -> torch.Tensor: ...
@overload
def simulate(spec: str | Compressor, worker_grads: Sequence[Mapping[str, torch.Tensor]],
             **options: Any) -> dict[str, torch.Tensor]: ...
@overload
def simulate(spec: str | Compressor, worker_grads: Sequence[Sequence[torch.Tensor]],
             **options: Any) -> list[torch.Tensor]: ...
@overload
def simulate(spec: str | Compressor, worker_grads: Sequence[WorkerGrads], **options: Any) -> WorkerGrads: ...


def simulate(spec: str | Compressor, worker_grads: Sequence[WorkerGrads], **options: Any) -> WorkerGrads:
    """One step of ``len(worker_grads)`` workers exchanging their gradients under ``spec``: what every
    worker receives. The same pipeline as the DDP hook and the Communicator, in one process (n up to
    1024 and more); for several steps with feedback carried over, use :class:`Simulator`."""
    return Simulator(spec, len(worker_grads), **options).step(worker_grads)


# -- compiling the kernels before the first step -----------------------------------------------------------
#: the tensors each simulated worker of :func:`warm_kernels` exchanges: a matrix (PowerSGD's products on the
#: CPU take one from 2^15 values), a vector, and a vector that the options leave uncompressed
_WARM_SHAPES = {"matrix": (64, 520), "vector": (37,), "plain": (37,)}


def warm_kernels(compressors: Sequence[Compressor], workers: int, options: Options,
                 dtypes: Sequence[torch.dtype]) -> None:
    """Compile the numba kernels that each of ``compressors`` needs with ``options`` on ``workers`` ranks
    for gradients of ``dtypes`` — or load them from the disk cache —, once per process, logging one line
    (:func:`gradpress.kernels.warm.warm`): each runs for four steps in a :class:`Simulator` on small CPU
    tensors of each dtype, through what an exchange does (compression, feedback memory, aggregation,
    decoding, an uncompressed tensor; gradients that may and may not be overwritten), and compresses and
    decompresses one tensor alone."""
    # (one level: a node's shard runs the same kernels as the whole tensor)
    exercised = replace(options, min_numel=0, warmup_steps=0, exclude=("plain",), timeout=None, seed=0,
                        hierarchy=None, local_size=None)
    runs = [((c.spec, exercised, workers, dtype), c.spec, str(dtype).removeprefix("torch."),
             functools.partial(_exercise, c, workers, exercised, dtype))
            for c in compressors for dtype in dtypes]
    mode = "" if options.mode == "collective" else f", {options.mode} mode"
    warm(runs, f"{workers} worker{'s' if workers > 1 else ''}{mode}")


def _exercise(compressor: Compressor, workers: int, options: Options, dtype: torch.dtype) -> bool:
    settings = {f.name: getattr(options, f.name) for f in fields(options)}
    try:
        sim = Simulator(compressor, workers, warm_up=False, **settings)
    except ValueError:
        return False  # a setting the method refuses (a switch adds integers only): its front end says so
    generator = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        for writable in (False, True, False, True):
            grads = [{key: torch.randn(shape, generator=generator).to(dtype)
                      for key, shape in _WARM_SHAPES.items()} for _ in range(workers)]
            sim.step(grads, writable=writable)
        alone = copy.deepcopy(compressor)  # the compressor's own API: compress, decompress (one worker)
        x = torch.randn(_WARM_SHAPES["matrix"], generator=generator).to(dtype)
        alone.decompress(alone.compress(x))
    return True


# -- helpers ------------------------------------------------------------------------------------------
def _own(spec: str | Compressor) -> Compressor:
    """A simulated rank's own compressor (its per-key state is its own, as a real rank's is)."""
    return make(spec) if isinstance(spec, str) else copy.deepcopy(spec)

def _items(grads: WorkerGrads) -> list[tuple[str, torch.Tensor]]:
    if isinstance(grads, torch.Tensor):
        return [("", grads)]
    if isinstance(grads, Mapping):
        return [(str(k), v) for k, v in grads.items()]
    return [(str(i), t) for i, t in enumerate(grads)]


def _restore(like: WorkerGrads, out: list[torch.Tensor]) -> WorkerGrads:
    if isinstance(like, torch.Tensor):
        return out[0]
    if isinstance(like, Mapping):
        return dict(zip(like.keys(), out, strict=True))
    return list(out)


def _send_all(protocols, replies) -> list:
    """Resume every worker's protocol; their next rounds, or their results if all finished."""
    rounds, finished, error = [], [], None
    for protocol, reply in zip(protocols, replies, strict=True):
        try:
            rounds.append(protocol.send(reply))
            finished.append(False)
        except StopIteration as stop:
            rounds.append(stop.value)
            finished.append(True)
        except Exception as raised:  # noqa: BLE001 - every worker meets it (and undoes its step) first
            error = error or raised
    if error is not None:
        raise error
    if any(finished) and not all(finished):
        raise RuntimeError("workers diverged: some finished their exchange while others issued collectives")
    return rounds


def _describe(request: Collective) -> tuple:
    t = request.tensor
    return (type(request).__name__, tuple(t.shape), t.dtype, getattr(request, "op", None),
            getattr(request, "src", None), getattr(request, "dst", None))


def _check_same(rounds: list[Round]) -> None:
    first = [_describe(r) for r in rounds[0].requests], rounds[0].final, rounds[0].scope
    for rank, round_ in enumerate(rounds[1:], start=1):
        mine = [_describe(r) for r in round_.requests], round_.final, round_.scope
        if mine != first:
            raise RuntimeError(f"workers issued different collectives: worker 0 {first}, worker {rank} {mine}")


def _results(requests: list[list[Collective]], n: int, only: int | None) -> list:
    """Carry out one round: per worker, the list of its requests' results (``only``: just that worker's,
    the others' are not needed)."""
    ranks = range(n) if only is None else [only]
    replies: list[list] = [[] for _ in range(n)]
    for k in range(len(requests[0])):
        column = [requests[r][k] for r in range(n)]
        first = column[0]
        if isinstance(first, AllReduce):
            tensors = [c.tensor for c in column]
            if first.op == "sum":
                total = fold_sum(tensors)
            else:
                combine = torch.maximum if first.op == "max" else torch.minimum
                total = tensors[0].clone()
                for t in tensors[1:]:
                    total = combine(total, t)
            shared: list[torch.Tensor | None] = [total if r == ranks[0] else total.clone() for r in ranks]
        elif isinstance(first, ReduceScatter):
            total = fold_sum([c.tensor for c in column])  # (n, chunk): row r is rank r's sum
            shared = [total[r] for r in ranks]
        elif isinstance(first, AllGather):
            stack = torch.stack([c.tensor for c in column])
            shared = [stack for _ in ranks]
        elif isinstance(first, Broadcast):
            source = column[first.src].tensor
            shared = [source.clone() for _ in ranks]
        elif isinstance(first, Gather):
            stack = torch.stack([c.tensor for c in column])
            shared = [stack if r == first.dst else None for r in ranks]
        else:
            raise TypeError(f"unknown collective {first!r}")
        for r, value in zip(ranks, shared, strict=True):
            replies[r].append(value)
    return replies if only is None else replies[only]
