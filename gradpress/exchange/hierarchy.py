"""Two levels for several nodes (``hierarchy="node"``): compress the slow link only.

In a one-level exchange every rank compresses its whole gradient and exchanges it with every other
rank, so a node's uplink carries the packets of each of its k ranks. With ``hierarchy="node"`` the k
ranks of a node first sum their gradients inside the node, uncompressed (the fast link), each rank
compresses 1/k of that sum, and only those shards cross between nodes: the hierarchical all-reduce
(Horovod's; BlueConnect, Cho et al., SysML 2019: reduce-scatter inside, all-reduce across, all-gather
inside), with the compressed exchange of GRACE Algorithm 1 in its middle phase. Per exchange (a DDP
bucket, one ``reduce_many`` call):

1. **Inside the node**, a reduce-scatter (sum, in rank order: :class:`~gradpress.exchange.protocol.
   ReduceScatter`): local rank j receives the node's sum of shard j, and divides it by k.
2. **Between nodes**, local rank j exchanges its shard with local rank j of every other node by the
   method's own strategy (all-reduce, all-gather, parameter server, switch, with its preliminary
   exchange), through a :class:`~gradpress.exchange.pipeline.Pipeline` of the m nodes: its feedback
   memory, step counters and random streams are those of the shard (each rank keeps the memory of its
   shard only), and ``root`` names the node of the servers. The mean over the nodes of the node means
   is the mean over all ranks.
3. **Inside the node**, an all-gather of the averaged shards: every rank holds the whole average.

Shards: each tensor is cut into k nearly equal contiguous parts (:class:`Split`), along the longer
side of the matrix it is read as (its first dimension by the rest, as PowerSGD reads it; a vector
along its length), the part a rank gets one row or column more chosen from the key (so the parts do
not depend on which tensors share a bucket, which DDP changes after its first step); local rank j's
shard is the j-th part of every tensor, back to back. Only the shards cross between nodes (a shard is
padded to the longest inside the node only). So a tensor's shard keeps its key (feedback memory and
``exclude`` follow the name; ``min_numel`` is compared with the whole tensor), and a matrix's shard is
a matrix (PowerSGD still compresses it).

Invariants, as in one level (docs/design.md): every rank issues the same rounds in the same order
on each group (the rounds carry a ``scope``, run by :class:`gradpress.exchange.distributed.NodeExecutor`
on the node's group or the cross-node group); every rank ends with the same bits (the shards' exchanges
are bit-identical across nodes, the all-gather copies them); a NaN/Inf on any rank raises the same
:class:`~gradpress.NonFiniteError` naming it on every rank: the reduce-scatter carries each rank's
flag to its node (a rank with a NaN/Inf sends zeros), every rank of a flagged node marks its shard
faulty, so the exchange between nodes of every shard raises naming the node, and the nodes' flags
then travel in one more all-gather between nodes (only after a fault) to name the rank. A failure of
one shard's exchange alone (an overflow of the sum, a method's error) travels in the all-gather inside
the node, and every rank raises. One node, or one rank a node, is the one-level exchange, bit for bit.
"""
from __future__ import annotations

import fnmatch
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from gradpress.core.compressor import Compressor, NonFiniteError, any_nonfinite
from gradpress.core.rng import derive_seed
from gradpress.exchange.agreement import agree
from gradpress.exchange.pipeline import Group, Options, Pipeline
from gradpress.exchange.protocol import AllGather, Protocol, ReduceScatter, Round, parallel, raise_flagged
from gradpress.exchange.state import own_part


# -- which ranks share a node ------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """The nodes of a world of ``world_size`` ranks, ``local_size`` a node: rank r is local rank
    r mod k of node ⌊r / k⌋ (torchrun numbers the ranks so). ``placed``: where torchrun's
    environment puts this rank otherwise (the ranks then disagree, and the agreement says so)."""

    rank: int
    world_size: int
    local_size: int
    placed: str = ""

    @property
    def nodes(self) -> int:
        return max(1, self.world_size // self.local_size)

    @property
    def node(self) -> int:
        return self.rank // self.local_size

    @property
    def local(self) -> int:
        return self.rank % self.local_size

    @property
    def problem(self) -> str | None:
        """Why this layout cannot run (every rank that agrees on it finds the same), or None."""
        if self.world_size % self.local_size:
            return (f"hierarchy='node': a node of {self.local_size} ranks does not divide the world of "
                    f"{self.world_size} ranks (every node must hold the same number of ranks)")
        return None

    @property
    def two_level(self) -> bool:
        """Whether the exchange has two levels: several nodes of several ranks each."""
        return self.problem is None and self.local_size > 1 and self.nodes > 1

    @property
    def text(self) -> str:
        """What the ranks agree on (:mod:`gradpress.exchange.agreement`: the hierarchy and node size)."""
        return f"'node', {self.local_size} ranks a node{self.placed}"

    def members(self, rank: int, scope: str) -> list[int]:
        """The ranks of the group of ``scope`` (:class:`~gradpress.exchange.protocol.Round`) holding
        ``rank``, by their rank in that group."""
        k = self.local_size
        if scope == "node":
            return list(range(rank // k * k, rank // k * k + k))
        if scope == "cross":
            return list(range(rank % k, self.world_size, k))
        return list(range(self.world_size))


def layout(options: Options, rank: int, world_size: int, whole_world: bool = True,
           env: Mapping[str, str] | None = None) -> Layout | None:
    """The :class:`Layout` of ``options`` (None without ``hierarchy``): the node size ``local_size``, or
    torchrun's ``LOCAL_WORLD_SIZE`` (``env``: default ``os.environ``), whose ``GROUP_RANK`` and
    ``LOCAL_RANK`` must place the rank as the layout does. ``whole_world``: the ranks are the job's
    (torchrun's variables describe the job's ranks, not those of a group of some of them)."""
    if options.hierarchy is None:
        return None
    env = os.environ if env is None else env
    size, placed = options.local_size, ""
    if size is None:
        given = env.get("LOCAL_WORLD_SIZE")
        if given is None:
            raise ValueError("hierarchy='node' needs the number of ranks of a node: run under torchrun "
                             "(which sets LOCAL_WORLD_SIZE), or pass local_size=")
        if not whole_world:
            raise ValueError("hierarchy='node' on a process group of some of the job's ranks: torchrun's "
                             "LOCAL_WORLD_SIZE describes the job's ranks; pass local_size= (the group's "
                             "ranks i·k … i·k + k − 1 then make node i)")
        size = int(given)
        if size < 1:
            raise ValueError(f"hierarchy='node': LOCAL_WORLD_SIZE is {given!r}, not a number of ranks")
        node, local = env.get("GROUP_RANK"), env.get("LOCAL_RANK")
        if node is not None and local is not None and (int(node), int(local)) != divmod(rank, size):
            placed = (f" (torchrun places rank {rank} on node {node} as local rank {local}, not on node "
                      f"{rank // size} as local rank {rank % size})")
    return Layout(rank, world_size, size, placed)


def make_pipeline(compressor: Compressor, options: Options, rank: int, world_size: int,
                  master: Compressor | None = None, whole_world: bool = True,
                  env: Mapping[str, str] | None = None) -> Pipeline | HierarchicalPipeline:
    """The pipeline of rank ``rank`` under ``options``: one level, or two with ``hierarchy="node"`` over
    several nodes of several ranks (:class:`HierarchicalPipeline`); one node, or one rank a node, is the
    one-level pipeline, whose agreement also covers the hierarchy."""
    found = layout(options, rank, world_size, whole_world, env)
    if found is None:
        return Pipeline(compressor, options, rank, world_size, master)
    if found.two_level:
        return HierarchicalPipeline(compressor, options, found, master)
    return OneLevel(compressor, options, found, master)


def check_options(options: Options, auto: bool) -> None:
    """Raise ``ValueError`` for what the two-level exchange does not run: nothing now (``"auto"`` with
    ``hierarchy="node"`` chooses among two-level candidates, :mod:`gradpress.auto`)."""
    del options, auto


def auto_layout(options: Options, rank: int, world_size: int, whole_world: bool = True,
                env: Mapping[str, str] | None = None) -> Layout | None:
    """The nodes ``"auto"`` ranks flat against two-level exchanges on (:mod:`gradpress.auto`): with
    ``hierarchy="node"``, :func:`layout` (a node size that does not divide the world raises
    ``ValueError``); without, torchrun's ``LOCAL_WORLD_SIZE`` where it describes these ranks (``env``:
    default ``os.environ``), else None (one level)."""
    if options.hierarchy is not None:
        found = layout(options, rank, world_size, whole_world, env)
        if found is not None and found.problem is not None:
            raise ValueError(found.problem)
        return found
    env = os.environ if env is None else env
    if not whole_world or "LOCAL_WORLD_SIZE" not in env:
        return None
    try:
        found = layout(replace(options, hierarchy="node"), rank, world_size, whole_world, env)
    except ValueError:
        return None
    return found if found is not None and found.problem is None and not found.placed else None


def _agreed(parts: dict[str, str], world_size: int, device: torch.device, found: Layout) -> Protocol:
    """The ranks' agreement on ``parts`` (the hierarchy among them), then the layout's own check: the
    ranks that agree on it find the same problem, and raise together."""
    yield from agree(parts, world_size, device)
    if found.problem is not None:
        raise ValueError(found.problem)
    return None


class OneLevel(Pipeline):
    """``hierarchy="node"`` on one node, or with one rank a node: the one-level exchange, whose
    agreement also covers the hierarchy and the node size."""

    def __init__(self, compressor: Compressor, options: Options, found: Layout,
                 master: Compressor | None = None) -> None:
        super().__init__(compressor, options, found.rank, found.world_size, master)
        self.layout = found

    def agreement(self, items: Sequence[tuple[str, torch.Tensor]],
                  more: dict[str, str] | None = None) -> Group | None:
        signature = tuple((key, t.shape, t.dtype, t.get_device()) for key, t in items)
        if signature in self._agreed:
            return None
        self._agreed.add(signature)
        parts = self.agreement_parts(items, self.world_size, self.steps)
        parts["the hierarchy"] = self.layout.text
        parts.update(more or {})
        device = items[0][1].device if items else torch.device("cpu")
        step = max((self.steps.get(key, 0) for key, _ in items), default=0)
        return Group(list(range(len(items))), _agreed(parts, self.world_size, device, self.layout), step)


# -- shards -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """How one tensor of ``shape`` is cut into k parts: read as the matrix ``rows`` × ``cols`` (its first
    dimension by the rest; a vector as a column), along the longer side (``by_rows``), ``sizes[j]``
    rows or columns going to local rank j, in rank order."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    by_rows: bool
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, key: str, shape: tuple[int, ...], k: int) -> Split:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else numel
        cols = numel // rows if rows else 0
        by_rows = rows >= cols or len(shape) < 2
        length = rows if by_rows else cols
        base, extra = divmod(length, k)
        first = derive_seed("node shard", key) % k  # the first of the parts one row or column longer
        sizes = tuple(base + (1 if (j - first) % k < extra else 0) for j in range(k))
        return cls(tuple(shape), rows, cols, by_rows, sizes)

    def numel(self, j: int) -> int:
        return self.sizes[j] * (self.cols if self.by_rows else self.rows)

    def part_shape(self, j: int) -> tuple[int, ...]:
        if not self.by_rows:
            return (self.rows, self.sizes[j])
        return (self.sizes[j], *self.shape[1:]) if len(self.shape) >= 2 else (self.sizes[j],)

    def part(self, tensor: torch.Tensor, j: int) -> torch.Tensor:
        """Local rank j's part of ``tensor`` (a view where ``tensor`` is contiguous)."""
        start = sum(self.sizes[:j])
        if self.by_rows:
            return tensor.reshape(self.rows, self.cols)[start:start + self.sizes[j]].view(self.part_shape(j))
        return tensor.reshape(self.rows, self.cols)[:, start:start + self.sizes[j]]


class ShardPipeline(Pipeline):
    """The exchange of one local index's shards between nodes: a :class:`Pipeline` of the m nodes whose
    tensors are parts of the exchanged ones: ``min_numel`` is compared with the whole tensor's size."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.whole: dict[str, int] = {}  # key -> the whole tensor's number of elements

    def compresses(self, key: str, tensor: torch.Tensor, name: str | None = None) -> bool:
        o = self.options
        if self.whole.get(key, tensor.numel()) < o.min_numel or self.steps.get(key, 0) < o.warmup_steps:
            return False
        return not any(fnmatch.fnmatchcase(key, pattern) for pattern in o.exclude)


# status of a shard's exchange between nodes, sent in the all-gather inside the node
_OK, _NONFINITE, _OVERFLOW, _FAILED = 0, 1, 2, 3


class HierarchicalPipeline:
    """One rank's side of the two-level exchange (see the module docstring): the same interface as
    :class:`Pipeline` (agreement, groups, state, statistics), for rank ``found.rank`` of the world."""

    def __init__(self, compressor: Compressor, options: Options, found: Layout,
                 master: Compressor | None = None) -> None:
        self.layout, self.options = found, options
        self.rank, self.world_size = found.rank, found.world_size
        # the shards of different local indices draw from streams of their own
        seed = derive_seed("node shard", options.seed, found.local_size, found.local)
        self.inner = ShardPipeline(compressor, replace(options, seed=seed), found.node, found.nodes, master)
        self.compressor, self.master = self.inner.compressor, self.inner.master
        self.feedback = self.inner.feedback
        self.strategy, self.stats = self.inner.strategy, self.inner.stats
        self.steps: dict[str, int] = {}  # per tensor, alike on every rank (a shard's: the inner pipeline's)
        self._splits: dict[tuple[str, tuple[int, ...]], Split] = {}
        self._agreed: set[tuple] = set()

    # -- the ranks' agreement -------------------------------------------------------------------------
    def agreement(self, items: Sequence[tuple[str, torch.Tensor]],
                  more: dict[str, str] | None = None) -> Group | None:
        """The ranks' agreement (all of them, on the group gradpress talks on) on the whole tensors and
        the hierarchy, the first time this set of tensors is exchanged (see :meth:`Pipeline.agreement`)."""
        signature = tuple((key, t.shape, t.dtype, t.get_device()) for key, t in items)
        if signature in self._agreed:
            return None
        self._agreed.add(signature)
        parts = self.inner.agreement_parts(items, self.world_size, self.steps, self.options)
        parts["the hierarchy"] = self.layout.text
        parts.update(more or {})
        device = items[0][1].device if items else torch.device("cpu")
        step = max((self.steps.get(key, 0) for key, _ in items), default=0)
        return Group(list(range(len(items))), _agreed(parts, self.world_size, device, self.layout), step)

    # -- the exchange --------------------------------------------------------------------------------
    def groups(self, items: Sequence[tuple[str, torch.Tensor]], bucket: torch.Tensor | None = None,
               writable: bool = False) -> list[Group]:
        """The protocols exchanging ``items`` (key, tensor): one per dtype and device, each returning its
        members' averages (written into the tensors where ``bucket`` or ``writable`` allows)."""
        keys = [key for key, _ in items]
        if len(set(keys)) != len(keys):
            twice = sorted(k for k in set(keys) if keys.count(k) > 1)
            raise ValueError(f"duplicate keys in one exchange: {twice}")
        for key, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{key!r}: expected a tensor, got {type(tensor).__name__}")
        steps = [self.steps.get(key, 0) for key in keys]
        for key, step in zip(keys, steps, strict=True):
            self.steps[key] = step + 1
        writable = writable or bucket is not None
        kinds: dict[tuple, list[int]] = {}
        for i, (_, tensor) in enumerate(items):
            kinds.setdefault((tensor.dtype, tensor.device), []).append(i)
        groups = []
        for members in kinds.values():
            step = max(steps[i] for i in members)
            groups.append(Group(members, self._exchange([items[i] for i in members], writable, step), step))
        return groups

    def _split(self, key: str, shape: tuple[int, ...]) -> Split:
        split = self._splits.get((key, shape))
        if split is None:
            split = self._splits[(key, shape)] = Split.of(key, shape, self.layout.local_size)
        return split

    def _exchange(self, items: list[tuple[str, torch.Tensor]], writable: bool, step: int) -> Protocol:
        """Lay out the shards of ``items`` and start their step (the inner pipeline's too); the protocol."""
        k, j = self.layout.local_size, self.layout.local
        splits = [self._split(key, tuple(t.shape)) for key, t in items]
        offsets, totals = [], []
        for rank in range(k):
            position, starts = 0, []
            for split in splits:
                starts.append(position)
                position += split.numel(rank)
            offsets.append(starts)
            totals.append(position)
        chunk = max(totals)
        like = items[0][1]
        mine = torch.zeros(chunk + 1, dtype=like.dtype, device=like.device)  # the averaged shard, its status
        shard = mine[:totals[j]]
        parts = [(i, key, shard[offsets[j][i]:offsets[j][i] + split.numel(j)].view(split.part_shape(j)))
                 for i, ((key, _), split) in enumerate(zip(items, splits, strict=True)) if split.numel(j)]
        for i, key, _ in parts:
            self.inner.whole[key] = items[i][1].numel()
        inner = self.inner.groups([(key, part) for _, key, part in parts], bucket=shard, writable=True) \
            if parts else []
        return self._protocol(items, splits, offsets, chunk, mine, parts, inner, writable, step)

    def _protocol(self, items, splits, offsets, chunk, mine, parts, inner, writable, step) -> Protocol:
        """The three steps of a two-level exchange: sum inside the node, exchange this rank's shard
        between nodes, gather the averaged shards inside the node."""
        flagged = yield from self._sum_in_node(items, splits, offsets, chunk, mine, parts, step)
        mine[chunk], failure = yield from self._across_nodes(items, flagged, parts, inner)
        stack = yield from self._gather_in_node(items, mine, chunk, failure)
        with self.stats.timer(step, "decompress_s"):
            return self._averages(items, splits, offsets, stack, writable)

    def _sum_in_node(self, items, splits, offsets, chunk, mine, parts, step) -> Protocol:
        """1. Inside the node: the sum of every rank's parts, local rank j receiving shard j (divided by
        k into ``mine``), and the node's fault flags (slot i: local rank i's gradients held NaN/Inf; it
        sends zeros). Returns the flagged local ranks."""
        k, j = self.layout.local_size, self.layout.local
        like = items[0][1]
        with self.stats.timer(step, "compress_s"):
            send = torch.zeros(k, chunk + k, dtype=like.dtype, device=like.device)
            faulty = any(t.is_floating_point() and t.numel() and any_nonfinite(t.detach().reshape(-1))
                         for _, t in items)
            if faulty:
                send[:, chunk + j] = 1
            else:
                for i, ((_, tensor), split) in enumerate(zip(items, splits, strict=True)):
                    for rank in range(k):
                        n = split.numel(rank)
                        if n:
                            send[rank, offsets[rank][i]:offsets[rank][i] + n].view(
                                split.part_shape(rank)).copy_(split.part(tensor.detach(), rank))
        (row,) = yield Round([ReduceScatter(send)], scope="node")
        flagged = [i for i, value in enumerate(row[chunk:].tolist()) if value != 0]
        shard = mine[:sum(part.numel() for _, _, part in parts)]
        torch.div(row[:shard.numel()], k, out=shard)
        return flagged

    def _across_nodes(self, items, flagged, parts, inner) -> Protocol:
        """2. Between nodes: this shard, by the method's own strategy, its averages written into the
        shard. Returns this rank's status (:data:`_OK`, or what failed), which travels with the shard,
        and its error (None if it did not fail), the cause of the error every rank raises after the
        gather."""
        like = items[0][1]
        if not inner:  # no part of any tensor here: the nodes' flags travel alone
            ranks = yield from self._faulty_ranks(flagged, like.device)
            if ranks:
                raise self._nonfinite(items, ranks) from None
            return _OK, None
        if flagged:  # every rank of this node marks its shard: every shard's exchange flags the node
            for _, _, part in parts:
                part.view(-1)[0] = math.nan
        try:
            averages = yield from _between_nodes(parallel([group.protocol for group in inner]))
        except NonFiniteError as error:
            ranks = yield from self._faulty_ranks(flagged, like.device)
            if ranks:
                raise self._nonfinite(items, ranks) from None
            return _NONFINITE, error  # a sum of finite gradients that overflowed
        except OverflowError as error:
            return _OVERFLOW, error
        except Exception as error:  # noqa: BLE001 - every rank of the node raises it after the all-gather
            return _FAILED, error
        views = [part for _, _, part in parts]
        for group, averaged in zip(inner, averages, strict=True):
            outputs = [group.flat] if group.flat is not None else [views[i] for i in group.members]
            for output, average in zip(outputs, averaged, strict=True):
                if average.data_ptr() != output.data_ptr() or average.dtype != output.dtype:
                    output.copy_(average.view(output.shape))
        return _OK, None

    def _gather_in_node(self, items, mine, chunk, failure: Exception | None) -> Protocol:
        """3. Inside the node: every rank's averaged shard and status; every rank raises the same error
        if a shard's exchange between nodes failed (``failure``: this rank's own, its cause). Returns
        the (k, chunk + 1) stack."""
        (stack,) = yield Round([AllGather(mine)], final=True, scope="node")
        statuses = [int(value) for value in stack[:, chunk].tolist()]
        if any(statuses):
            raise self._failed(items, statuses) from failure
        return stack

    @staticmethod
    def _averages(items, splits, offsets, stack, writable) -> list[torch.Tensor]:
        """Each tensor's average, assembled from the gathered shards (into the tensor where ``writable``
        and it is contiguous)."""
        out = []
        for i, ((_, tensor), split) in enumerate(zip(items, splits, strict=True)):
            target = tensor.detach() if writable and tensor.is_contiguous() else torch.empty(
                tensor.shape, dtype=tensor.dtype, device=tensor.device)
            for rank in range(len(offsets)):
                n = split.numel(rank)
                if n:
                    split.part(target, rank).copy_(
                        stack[rank, offsets[rank][i]:offsets[rank][i] + n].view(split.part_shape(rank)))
            out.append(target)
        return out

    def _faulty_ranks(self, flagged: list[int], device: torch.device) -> Protocol:
        """Every node's flagged local ranks (one all-gather between nodes): the faulty ranks."""
        k = self.layout.local_size
        slots = torch.zeros(k, dtype=torch.uint8, device=device)
        for local in flagged:
            slots[local] = 1
        (table,) = yield Round([AllGather(slots)], scope="cross")
        values = table.reshape(-1).tolist()
        return [rank for rank, value in enumerate(values) if value]

    @staticmethod
    def _nonfinite(items: Sequence[tuple[str, torch.Tensor]], ranks: list[int]) -> NonFiniteError:
        try:
            raise_flagged(ranks)
        except NonFiniteError as error:
            named = NonFiniteError(f"gradients {', '.join(repr(key) for key, _ in items)}: {error}")
            named.ranks = error.ranks
            return named
        raise AssertionError("no rank flagged")

    def _failed(self, items: Sequence[tuple[str, torch.Tensor]], statuses: list[int]) -> Exception:
        """The error every rank raises when the exchange between nodes of some shards failed (the same
        on every rank: the failing ranks' own errors are its cause)."""
        names = ", ".join(repr(key) for key, _ in items)
        which = [j for j, status in enumerate(statuses) if status]
        shards = f"the shard{'s' if len(which) > 1 else ''} of local rank{'s' if len(which) > 1 else ''} " \
                 f"{', '.join(map(str, which))}"
        worst = max(statuses)
        if worst == _NONFINITE:
            error = NonFiniteError(f"gradients {names}: the sum over a node's ranks of {shards} is not "
                                   "finite (no rank's gradient held NaN/Inf: the sum overflowed)")
            error.ranks = []
            return error
        if worst == _OVERFLOW:
            return OverflowError(f"gradients {names}: the exchange between nodes of {shards} overflowed")
        return RuntimeError(f"gradients {names}: the exchange between nodes of {shards} failed (see the "
                            "error of those ranks)")

    # -- statistics and state -----------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """This rank's statistics (:class:`~gradpress.exchange.pipeline.Stats`: between nodes as
        ``sent_bytes``, inside the node as ``intra_node_*``), with the traffic pattern."""
        return self.stats.report(f"{self.strategy.pattern} between nodes")

    def state_dict(self) -> dict[str, Any]:
        """The shard pipeline's state (this shard's feedback memory, step counters, shapes, compressor
        state), as this rank's of the world, and the hierarchy: the node size and each tensor's step."""
        state = self.inner.state_dict()
        state.update(rank=self.rank, world_size=self.world_size,
                     hierarchy={"local_size": self.layout.local_size, "steps": dict(self.steps)})
        return state

    def shared_sections(self) -> dict[str, bool]:
        return self.inner.shared_sections()

    def own_part(self, state: Any, on_world_size_change: str = "raise") -> dict[str, Any]:
        """This rank's part of ``state`` (:func:`gradpress.exchange.state.own_part`)."""
        return own_part(state, self.rank, self.world_size, self.shared_sections(), on_world_size_change)

    def load_state_dict(self, state: Any, on_world_size_change: str = "raise") -> None:
        """Restore :meth:`state_dict` (checked as :meth:`Pipeline.load_state_dict` checks it); a state
        saved by a one-level exchange, or with another node size, raises ``ValueError``."""
        part = self.own_part(state, on_world_size_change)
        saved = part.get("hierarchy")
        k = self.layout.local_size
        if not isinstance(saved, dict) or saved.get("local_size") != k:
            was = ("a one-level exchange (hierarchy=None)" if not isinstance(saved, dict)
                   else f"hierarchy='node' with {saved.get('local_size')!r} ranks a node")
            raise ValueError(f"gradpress state: saved by {was}; this runtime's is hierarchy='node' with {k} "
                             "ranks a node (its memory is that of another shard of the gradients)")
        steps = saved.get("steps")
        if not isinstance(steps, dict) or not all(isinstance(key, str) and isinstance(v, int)
                                                  and not isinstance(v, bool) and v >= 0
                                                  for key, v in steps.items()):
            raise ValueError("gradpress state: hierarchy['steps'] must map each key to an integer >= 0")
        self.inner.load_state_dict({**part, "rank": self.layout.node, "world_size": self.layout.nodes})
        self.steps = dict(steps)
        self._agreed.clear()


def _between_nodes(protocol: Protocol) -> Protocol:
    """``protocol`` (a shard's exchange) with its rounds issued between nodes, none final (the
    all-gather inside the node follows)."""
    try:
        round_ = next(protocol)
        while True:
            replies = yield replace(round_, scope="cross", final=False)
            round_ = protocol.send(replies)
    except StopIteration as stop:
        return stop.value
