"""The pipeline every integration drives (GRACE Algorithm 1; docs/design.md, "What flows through it"):

    feedback.compensate → compressor.prepare (+ preliminary exchange) → compressor.compress
    → feedback.update → strategy.exchange → decode → averaged gradient (same shape, dtype, device)

The unit of compression is one tensor (a parameter's gradient), keyed by a stable name: its feedback
memory, step counter and random streams follow the name, so they survive DDP's bucket rebuild and a
restart into a fresh DDP, and methods that need a tensor's shape (PowerSGD's matrices, S2's rows) get
it. The unit of communication is a group of tensors (a DDP bucket, or the tensors handed to one
``Communicator.reduce_many`` call): their packets travel together, in as few collectives as the
strategy allows. Where compressing a group tensor by tensor and as a whole give the same bits (an
:attr:`~gradpress.core.compressor.Compressor.elementwise` method such as ``none``, with nothing keyed per
tensor), a DDP bucket's gradients travel as one flat view of the bucket: one packet, one decoding pass.

The :class:`~gradpress.exchange.driver.Driver` runs the protocols on a process group in an order that is the same
on every rank (invariant: collective order, docs/design.md); :mod:`gradpress.exchange.state` checks a saved
state before it loads. Beside this module: the steps of one group's exchange
(:mod:`gradpress.exchange.steps`), the options (:mod:`gradpress.exchange.options`), the statistics
(:mod:`gradpress.exchange.stats`) and a DDP bucket's plain exchange formed once
(:mod:`gradpress.exchange.flat`), all importable from here as well.
"""
from __future__ import annotations

import fnmatch
import functools
import time
from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch

from gradpress.core.compressor import Compressor, NonFiniteError, make
from gradpress.core.feedback import Feedback, make_feedback
from gradpress.core.packet import adjacent
from gradpress.exchange.agreement import agree
from gradpress.exchange.flat import FlatAllReduce
from gradpress.exchange.options import HIERARCHIES, Options, changed_options, describe
from gradpress.exchange.protocol import Protocol
from gradpress.exchange.state import FORMAT, check, own_part, shapes_of
from gradpress.exchange.stats import COUNTERS, Stats, flat_stats
from gradpress.exchange.steps import Batch, compensate, compress_all, named, prepare_all, unexchanged
from gradpress.exchange.strategy import Strategy

__all__ = ["Pipeline", "Group", "build",
           # the pieces it runs with, where the front ends have always found them
           "Options", "HIERARCHIES", "changed_options", "describe", "Stats", "COUNTERS", "flat_stats",
           "FlatAllReduce"]


# -- the pipeline ----------------------------------------------------------------------------------------
def build(spec: str | Compressor) -> Compressor:
    """The compressor a front end runs: built from a spec string (once), or the instance given, which
    the pipeline then owns (its per-key state, e.g. PowerSGD's warm starts, is this rank's)."""
    if isinstance(spec, str):
        return make(spec)
    if not isinstance(spec, Compressor):
        raise TypeError(f"expected a spec string or a Compressor, got {type(spec).__name__}")
    return spec


@dataclass
class Group:
    """Some of a group's items (their positions), the protocol exchanging them, and its step. The
    protocol returns each member's average; or, when the members travel as one ``flat`` tensor (a view
    of the bucket holding them, see :meth:`Pipeline._as_one`), a list holding the average of ``flat``."""

    members: list[int]
    protocol: Protocol
    step: int
    flat: torch.Tensor | None = None


class Pipeline:
    """One worker's side of the exchange: its compressor, feedback memory, per-key step counters and
    statistics, and the protocol that takes a group of gradients to their averages."""

    def __init__(self, compressor: Compressor, options: Options, rank: int, world_size: int,
                 master: Compressor | None = None) -> None:
        """``compressor`` (and ``master``, the C_M of ``options.master``, built here if not given): built
        once by the front end (:func:`build`), owned by this pipeline."""
        if not isinstance(compressor, Compressor):
            raise TypeError(f"a pipeline runs a Compressor (gradpress.make(spec)), got {type(compressor).__name__}")
        self.options, self.rank, self.world_size = options, rank, world_size
        self.compressor = compressor
        self.feedback = make_feedback(options.feedback or self.compressor.default_feedback)
        self.master = master if master is not None else make(options.master) if options.master else None
        strategy = functools.partial(Strategy, rank=rank, world_size=world_size, root=options.root,
                                     overflow=options.overflow, deterministic=options.deterministic,
                                     partial=options.partial)
        self.strategy = strategy(self.compressor, mode=options.mode, master=self.master)
        # uncompressed tensors meet like the rest, but a switch cannot add floats: the server does
        self.plain = strategy(make("none"), mode="collective" if options.mode == "collective" else "ps")
        self.no_feedback = make_feedback("none")
        self.steps: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._expected_shapes: dict[str, tuple[int, ...]] = {}  # from a loaded state, checked on first use
        self.stats = Stats()
        self._agreed: set[tuple] = set()  # (emptied by load_state_dict: a loaded state is agreed on again)

    def agreement(self, items: Sequence[tuple[str, torch.Tensor]],
                  more: dict[str, str] | None = None) -> Group | None:
        """The ranks' agreement on these items (see :mod:`gradpress.exchange.agreement`) the first time this set
        of keys, shapes and dtypes is exchanged, and the first time after :meth:`load_state_dict`; None
        otherwise. ``more``: further components (name -> text) the ranks must agree on (``"auto"``'s)."""
        signature = tuple((key, t.shape, t.dtype, t.get_device()) for key, t in items)  # (-1: the CPU)
        if signature in self._agreed:
            return None
        self._agreed.add(signature)
        parts = self.agreement_parts(items, self.world_size, self.steps)
        parts.update(more or {})
        device = items[0][1].device if items else torch.device("cpu")
        step = max((self.steps.get(key, 0) for key, _ in items), default=0)
        return Group(list(range(len(items))), agree(parts, self.world_size, device), step)

    def agreement_parts(self, items: Sequence[tuple[str, torch.Tensor]], world_size: int,
                        steps: dict[str, int], options: Options | None = None) -> dict[str, str]:
        """The components of :meth:`agreement` (name -> text) for ``items`` in a world of ``world_size``
        whose step counters are ``steps``, under ``options`` (default: this pipeline's)."""
        o = self.options if options is None else options
        settings = {f.name: getattr(o, f.name) for f in fields(o) if f.name != "timeout"}
        settings["feedback"] = self.feedback.spec
        return {
            "the compressor": repr(self.compressor.spec),
            "the options": ", ".join(f"{name}={value!r}" for name, value in settings.items()),
            "the world size": str(world_size),
            "the keys": repr([key for key, _ in items]),
            "the shapes": repr([tuple(t.shape) for _, t in items]),
            "the dtypes and devices": repr([f"{t.dtype} on {t.device.type}" for _, t in items]),
            # each tensor's step seeds its shared random streams and decides its warm-up
            "the steps": _steps_text([key for key, _ in items], steps),
        }

    def compresses(self, key: str, tensor: torch.Tensor, name: str | None = None) -> bool:
        """Whether ``key``'s next step is compressed (not excluded, not too small, past warm-up).
        ``name``: what ``exclude`` matches, where it is not the key (a row of a reduce-scatter)."""
        o = self.options
        if tensor.numel() < o.min_numel or self.steps.get(key, 0) < o.warmup_steps:
            return False
        return not any(fnmatch.fnmatchcase(key if name is None else name, pattern) for pattern in o.exclude)

    def groups(self, items: Sequence[tuple[str, torch.Tensor]], bucket: torch.Tensor | None = None,
               writable: bool = False) -> list[Group]:
        """The protocols exchanging ``items`` (key, gradient): the compressed ones, then the plain ones,
        then the empty ones, which no compressor, memory or collective sees (their average is empty).

        Starts the items' steps. ``bucket``: a flat tensor the gradients are views of, which the
        exchange may overwrite (a DDP bucket's buffer): collectives then work in it where they can.
        ``writable``: without a bucket, the gradients themselves may be overwritten (and receive the
        averages where a method can write them there: :meth:`Communicator.reduce_gradients`).
        """
        keys = [key for key, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate keys in one exchange: {sorted(k for k in set(keys) if keys.count(k) > 1)}")
        for key, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{key!r}: expected a tensor, got {type(tensor).__name__}")
            if key not in self.shapes or self._expected_shapes:
                self._record_shape(key, tuple(tensor.shape))
        o = self.options
        if o.min_numel or o.warmup_steps or o.exclude:
            flags = [self.compresses(key, tensor) for key, tensor in items]
        else:
            flags = [True] * len(items)
        steps = [self.steps.get(key, 0) for key in keys]
        for key, step in zip(keys, steps, strict=True):
            self.steps[key] = step + 1
        writable = writable or bucket is not None
        groups = []
        empty = [i for i, (_, tensor) in enumerate(items) if tensor.numel() == 0]
        for compressed in (True, False):
            members = [i for i, flag in enumerate(flags) if flag == compressed and items[i][1].numel()]
            if members:
                chosen = [items[i] for i in members]
                chosen_steps = [steps[i] for i in members]
                step = max(chosen_steps)
                flat = self._as_one(compressed, [t for _, t in chosen], bucket) if bucket is not None else None
                if flat is None:
                    protocol = self._protocol(chosen, chosen_steps, compressed, writable)
                else:
                    protocol = self._protocol([(chosen[0][0], flat)], [step], compressed, writable,
                                              members=[key for key, _ in chosen])
                groups.append(Group(members, protocol, step, flat))
        if empty:  # nothing to send: the same on every rank, whose shapes agree
            tensors = [items[i][1] for i in empty]
            groups.append(Group(empty, unexchanged(tensors), max(steps[i] for i in empty)))
        return groups

    def scatter_groups(self, rows: Sequence[Sequence[tuple[str, torch.Tensor]]],
                       names: Sequence[str]) -> list[Group]:
        """The protocols of a compressed reduce-scatter: ``rows[j]`` holds the items (key, tensor) whose
        average rank j receives (the same shapes and dtypes in every row, the i-th item of each row
        being the part of ``names[i]`` that rank j keeps; its key names the row, e.g. ``"w[j]"``, so that
        each row has its own feedback memory, step counter and random streams). Each rank compresses
        every row, as it would for an all-reduce (the preliminary exchange, if any, combines every
        row's values on every rank); the rows' summands then meet in one reduce-scatter
        (:meth:`gradpress.exchange.strategy.Strategy.reduce_scatter`) and each rank decodes its own
        row only. Each group's protocol returns the averages of this rank's row for its members
        (positions in a row); ``exclude`` matches ``names``. The rows may be overwritten."""
        n = self.world_size
        if len(rows) != n or len({len(row) for row in rows}) != 1 or len(rows[0]) != len(names):
            raise ValueError(f"a reduce-scatter takes {n} rows of {len(names)} items, one row per rank")
        items = [item for row in rows for item in row]
        keys = [key for key, _ in items]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate keys in one exchange: "
                             f"{sorted(k for k in set(keys) if keys.count(k) > 1)}")
        for key, tensor in items:
            if key not in self.shapes or self._expected_shapes:
                self._record_shape(key, tuple(tensor.shape))
        flags = [self.compresses(key, tensor, name)
                 for (key, tensor), name in zip(rows[0], names, strict=True)]
        steps = [self.steps.get(key, 0) for key in keys]
        for key, step in zip(keys, steps, strict=True):
            self.steps[key] = step + 1
        groups = []
        for compressed in (True, False):
            members = [i for i, flag in enumerate(flags) if flag == compressed]
            if members:
                positions = [j * len(names) + i for j in range(n) for i in members]
                chosen_steps = [steps[p] for p in positions]
                protocol = self._protocol([items[p] for p in positions], chosen_steps, compressed, True,
                                          scatter=True)
                groups.append(Group(members, protocol, max(chosen_steps)))
        return groups

    def flat_allreduce(self, items: Sequence[tuple[str, torch.Tensor]], bucket: torch.Tensor) -> FlatAllReduce | None:
        """The plan of ``items``' exchange where it is, every step, one in-place all-reduce of the whole
        ``bucket`` divided by n (``none``, summed by a single all-reduce: two workers, or more without
        ``deterministic``; no feedback memory, no exclusions, warm-up or minimum size); None otherwise.
        See :class:`FlatAllReduce`."""
        s, o, n = self.strategy, self.options, self.world_size
        if not (s.compressor.spec == "none" and s.mode == "collective" and s.divides_first and self.feedback.inert
                and not (o.min_numel or o.warmup_steps or o.exclude) and (n == 2 or n > 2 and not s.deterministic)):
            return None
        flat = bucket.detach().reshape(-1)
        whole = (flat.is_contiguous() and flat.is_floating_point() and flat.numel() >= n and bool(items)
                 and items[0][1].data_ptr() == flat.data_ptr() and items[0][1].dtype == flat.dtype
                 and sum(t.numel() for _, t in items) == flat.numel())
        return FlatAllReduce(self, tuple(key for key, _ in items), flat) if whole else None

    def _record_shape(self, key: str, shape: tuple[int, ...]) -> None:
        expected = self._expected_shapes.pop(key, None)
        if expected is not None and expected != shape:
            raise ValueError(f"{key!r} has shape {shape}; the loaded gradpress state was saved for {expected}")
        self.shapes[key] = shape

    def _as_one(self, compressed: bool, tensors: list[torch.Tensor], bucket: torch.Tensor) -> torch.Tensor | None:
        """The tensors as one flat view of ``bucket``, when exchanging them as one tensor gives the same
        result as one by one: an :attr:`~gradpress.core.compressor.Compressor.elementwise` method, no
        feedback memory (nothing keyed per tensor), no per-tensor draws (partial aggregation, a master
        compressor). None otherwise, or when they do not lie back to back in ``bucket``."""
        strategy = self.strategy if compressed else self.plain
        feedback = self.feedback if compressed else self.no_feedback
        if (len(tensors) < 2 or not strategy.compressor.elementwise or not feedback.inert
                or strategy.master is not None or strategy.partial != 1):
            return None
        flat = bucket.detach().reshape(-1)
        if (flat.is_contiguous() and tensors[0].data_ptr() == flat.data_ptr()
                and sum(t.numel() for t in tensors) == flat.numel() and tensors[0].dtype == flat.dtype):
            return flat  # the whole bucket (DDP's bucket gradients are views of it, in order)
        return adjacent(tensors, {flat.untyped_storage().data_ptr()})

    def _protocol(self, items, steps, compressed: bool, writable: bool,
                  members: Sequence[str] | None = None, scatter: bool = False) -> Protocol:
        """GRACE Algorithm 1 lines 4-14 for a group of tensors, THC's preliminary stage included, in the
        steps of :mod:`gradpress.exchange.steps`: compensate, prepare (and the preliminary exchange),
        compress and update the memory, exchange. ``members``: the keys of the tensors one flat item
        stands for (see :meth:`_as_one`), which errors name. ``scatter``: the items are n rows, row j
        averaged at rank j only (see :meth:`scatter_groups`).

        A gradient holding NaN/Inf does not end this rank's part: its input becomes zeros, its feedback
        memory is left as it was, and the exchange carries the rank's fault flag in-band, so every
        rank raises the same :class:`NonFiniteError`, naming the faulty ranks, at the same point. On
        any error the memory goes back to before the step (the step never happened)."""
        strategy = self.strategy if compressed else self.plain
        feedback = self.feedback if compressed else self.no_feedback
        keys = [key for key, _ in items]
        before = feedback.snapshot(keys) if feedback.updates else None
        start = time.perf_counter()
        batch = compensate(feedback, items, steps, self.options.seed, self.rank)
        try:
            return (yield from self._exchange(strategy, feedback, batch, max(steps), start, writable, scatter))
        except Exception as error:  # the step never happened: the memory goes back to before it
            if before is not None:
                feedback.restore(before)
            if not isinstance(error, NonFiniteError):
                raise
            raise named(error, members if members is not None else keys) from None

    def _exchange(self, strategy: Strategy, feedback: Feedback, batch: Batch, step: int, start: float,
                  writable: bool, scatter: bool) -> Protocol:
        """The steps after φ: the preliminary exchange (methods that have one), the packets and the
        memory's update, then the strategy's exchange of the packets."""
        compressor, stats, carried = strategy.compressor, self.stats, False
        if compressor.prepares:
            prelims = prepare_all(compressor, batch, self.world_size)
            stats.add(step, compress_s=time.perf_counter() - start)
            batch.prepared, carried = yield from strategy.preliminary(prelims, batch.faulty)
            start = time.perf_counter()
        # the mean's division by n in the pass that checks the input (a bucket this may overwrite)
        divided = self.world_size if feedback.inert and strategy.divides_first else None
        packets = compress_all(compressor, feedback, batch, divided, writable, carried)
        stats.add(step, compress_s=time.perf_counter() - start,
                  raw_bytes=sum(g.numel() * g.element_size() for g in batch.grads),
                  packet_bytes=sum(p.nbytes for p in packets))
        timer = lambda: stats.timer(step, "decompress_s")
        faulty = None if carried else batch.faulty
        if scatter:
            return (yield from strategy.reduce_scatter(packets, timer, faulty))
        return (yield from strategy.exchange(packets, batch.ctxs, batch.grads if writable else None, timer,
                                             faulty))

    def report(self) -> dict[str, Any]:
        """This worker's statistics (see :class:`Stats`), with the strategy's traffic pattern."""
        return self.stats.report(self.strategy.pattern)

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Feedback memory, per-key step counters and shapes, the compressors' own state (warm starts),
        and what they belong to: the specs, this rank and the world size (checked on loading)."""
        state = {"format": FORMAT, "spec": self.compressor.spec, "feedback_spec": self.feedback.spec,
                 "master_spec": self.master.spec if self.master is not None else None,
                 "rank": self.rank, "world_size": self.world_size,
                 "shapes": {key: list(shape) for key, shape in self.shapes.items()}, "steps": dict(self.steps),
                 "feedback": self.feedback.state_dict(), "compressor": self.compressor.state_dict(),
                 "stats": self.stats.state_dict()}
        if self.master is not None:
            state["master"] = self.master.state_dict()
        return state

    def shared_sections(self) -> dict[str, bool]:
        """Which compressor states of :meth:`state_dict` every rank holds alike, so that they carry over to
        another world size: those of a :attr:`~gradpress.core.compressor.Compressor.stateful_decode` method,
        whose state is what its decode of the ranks' sum keeps (PowerSGD's warm starts). Another method's
        state is its rank's own (DGC's momentum and velocity)."""
        return {"compressor": self.compressor.stateful_decode,
                "master": self.master is not None and self.master.stateful_decode}

    def own_part(self, state: Any, on_world_size_change: str = "raise") -> dict[str, Any]:
        """This rank's part of ``state`` (:func:`gradpress.exchange.state.own_part`)."""
        return own_part(state, self.rank, self.world_size, self.shared_sections(), on_world_size_change)

    def load_state_dict(self, state: Any, on_world_size_change: str = "raise") -> None:
        """Restore :meth:`state_dict`, or this rank's part of a gathered one (:func:`gradpress.exchange.state.gathered`).
        Everything is checked before anything is loaded (:func:`gradpress.exchange.state.check`): a ``ValueError``
        names the key at fault (a state of another method, memory, rank or world size; a tensor of the
        wrong shape or dtype, or holding NaN/Inf). ``on_world_size_change="reset"`` loads a state saved at
        another world size with error feedback started afresh (:meth:`own_part`)."""
        expected = {"spec": self.compressor.spec, "feedback_spec": self.feedback.spec,
                    "master_spec": self.master.spec if self.master is not None else None,
                    "world_size": self.world_size, "rank": self.rank}
        state = self.own_part(state, on_world_size_change)
        state = check(state, expected, {"compressor": self.compressor, "master": self.master})
        stats = state.get("stats")  # (absent from a state saved before statistics were: they start from zero)
        if stats is not None:
            Stats.check_state(stats)
        self.steps = dict(state["steps"])
        self._agreed.clear()  # the next exchange agrees on the loaded steps
        self.shapes = shapes_of(state)
        self._expected_shapes = dict(self.shapes)
        self.feedback.load_state_dict(state["feedback"])
        self.compressor.load_state_dict(state["compressor"])
        if self.master is not None and "master" in state:
            self.master.load_state_dict(state["master"])
        self.stats.load_state_dict(stats if stats is not None else Stats().state_dict())


def _steps_text(keys: Sequence[str], steps: dict[str, int]) -> str:
    """The keys' step counters as the agreement compares them: one number where they are all equal."""
    counts = [steps.get(key, 0) for key in keys]
    if len(set(counts)) <= 1:
        return str(counts[0]) if counts else "none"
    return ", ".join(f"{key!r} {count}" for key, count in zip(keys, counts, strict=True))

