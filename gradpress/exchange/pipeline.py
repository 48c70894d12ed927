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
state before it loads.
"""
from __future__ import annotations

import fnmatch
import functools
import math
import threading
import time
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Sequence

import torch

from gradpress.core.compressor import (
    Compressor,
    NonFiniteError,
    any_nonfinite,
    divide_counting_nonfinite,
    make,
    saturate,
    scaled_sum,
)
from gradpress.core.feedback import SumParts, make_feedback
from gradpress.core.packet import Packet, adjacent
from gradpress.core.rng import Context
from gradpress.exchange.agreement import agree
from gradpress.exchange.protocol import AllReduce, Protocol, Round, flagged_ranks, raise_flagged
from gradpress.exchange.state import FORMAT, check, own_part, shapes_of
from gradpress.exchange.strategy import MODES, OVERFLOW, Strategy, check_partial


# -- options ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """Options shared by the DDP hook, the Communicator and ``simulate`` (keyword arguments).

    * ``feedback``: error-feedback memory spec (default: the compressor's ``default_feedback``:
      ``residual`` for biased methods, ``none`` for unbiased ones).
    * ``min_numel``: tensors with fewer elements go uncompressed.
    * ``exclude``: name patterns (``fnmatch``, e.g. ``"conv1.*"``, ``"*.bias"``) left uncompressed.
    * ``warmup_steps``: the first steps of each tensor go uncompressed.
    * ``seed``: seed of the shared and private random streams (invariant: explicit randomness,
      docs/design.md).
    * ``timeout``: seconds (or a timedelta) a collective waits for its peers before it raises;
      gradpress then talks on its own process group with that timeout: every round of every
      exchange, the ranks' agreement and a gathered state (``state_dict(gathered=True)``). Not bounded
      by it: ``auto``'s decision, where the other ranks wait for rank 0 to measure the candidates
      (once per decision; on the process group gradpress was given, under that group's timeout), the
      group's creation, and DDP's own collectives. Default: the process group's own.
    * ``mode``: ``"collective"`` (all-reduce / all-gather), ``"ps"`` (parameter server at ``root``) or
      ``"switch"`` (integer-only aggregation at ``root``, as a programmable switch).
    * ``master``: spec of the master compressor C_M re-compressing the aggregate in ``ps`` mode
      (bidirectional compression, Natural compression paper Algorithm 1).
    * ``root``: rank of the parameter server / switch.
    * ``overflow``: ``"widen"`` integer sums to a dtype that holds them, or ``"raise"``; never wrap.
    * ``partial``: q ∈ (0, 1], ``ps`` and ``switch`` modes only: partial aggregation for stragglers
      (THC Sections 6 and 8.4). The server combines ⌈q·n⌉ workers' packets per tensor and every
      worker divides by that count, not n. The "first arrivals" are drawn per tensor and step from
      the stream shared by every rank (Section 8.4's random stragglers), not timed, so every rank
      knows them and ``simulate`` equals a real run; the others' contributions are dropped for that
      step (their error-feedback memory is updated as if sent). Uncompressed tensors (``exclude``,
      ``min_numel``, warm-up) meet at the same server and are aggregated partially too.
    * ``deterministic``: float sums over 3+ workers in rank order (bit-reproducible, equal to
      ``simulate``); ``False`` uses the backend's all-reduce, whose order depends on the algorithm.
    * ``hierarchy``: ``None`` (one level: every rank exchanges its compressed gradients with every
      other) or ``"node"``: a two-level exchange that compresses only what crosses between nodes
      (:mod:`gradpress.exchange.hierarchy`); ``root`` then names the node of the servers.
    * ``local_size``: with ``hierarchy="node"``, the ranks of one node (default: torchrun's
      ``LOCAL_WORLD_SIZE``).
    """

    feedback: str | None = None
    min_numel: int = 0
    exclude: tuple[str, ...] = ()
    warmup_steps: int = 0
    seed: int = 0
    timeout: float | None = None
    mode: str = "collective"
    master: str | None = None
    root: int = 0
    overflow: str = "widen"
    deterministic: bool = True
    partial: float = 1.0
    hierarchy: str | None = None
    local_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        else:
            object.__setattr__(self, "exclude", tuple(self.exclude))
        if isinstance(self.timeout, timedelta):
            object.__setattr__(self, "timeout", self.timeout.total_seconds())
        for name in ("min_numel", "warmup_steps", "root", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"option {name} must be an integer >= 0, got {value!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"option timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.mode not in MODES:
            raise ValueError(f"option mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.overflow not in OVERFLOW:
            raise ValueError(f"option overflow must be 'widen' or 'raise', got {self.overflow!r}")
        check_partial(self.partial, self.mode)
        if self.feedback is not None:
            make_feedback(self.feedback)  # unknown names raise here, listing the known ones
        if self.hierarchy not in HIERARCHIES:
            raise ValueError(f"option hierarchy must be None or 'node', got {self.hierarchy!r}")
        if self.local_size is not None:
            size = self.local_size
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"option local_size must be an integer >= 1, got {self.local_size!r}")
            if self.hierarchy is None:
                raise ValueError("option local_size (the ranks of a node) needs hierarchy='node'")

    @classmethod
    def of(cls, **options: Any) -> Options:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are: {', '.join(known)}")
        return cls(**options)


#: the values of the ``hierarchy`` option
HIERARCHIES = (None, "node")


# -- statistics ----------------------------------------------------------------------------------------
COUNTERS = ("raw_bytes", "packet_bytes", "sent_bytes", "received_bytes", "collectives",
            "compress_s", "decompress_s", "comm_s", "control_bytes",
            "intra_node_sent_bytes", "intra_node_received_bytes")


class Stats:
    """Per-step and cumulative figures of one rank (thread-safe: decoding runs on backend threads).

    * ``raw_bytes``: bytes of the gradients handed in; ``packet_bytes``: ``Packet.nbytes`` of this
      rank's packets (the compressor's output, GRACE's "data volume").
    * ``sent_bytes`` / ``received_bytes``: what the strategy's collectives move for this rank, from
      their traffic pattern (:func:`gradpress.exchange.strategy.traffic`): headers, widened integer sums and
      the downstream direction included.
    * ``control_bytes``: bytes sent and received for the ranks' agreement on what they exchange
      (:mod:`gradpress.exchange.agreement`, once per set of keys), not counted in the figures above.
    * with ``hierarchy="node"`` (:mod:`gradpress.exchange.hierarchy`): ``sent_bytes`` and
      ``received_bytes`` are the exchange between nodes (the compressed shards), and
      ``intra_node_sent_bytes`` / ``intra_node_received_bytes`` the uncompressed reduce-scatter and
      all-gather inside the node (zero in a one-level exchange); ``raw_bytes`` and ``packet_bytes``
      are those of this rank's shard.
    * ``compress_s`` (compensate, prepare, compress, feedback update), ``decompress_s`` (decoding and
      aggregation), ``comm_s`` (from issuing each round of collectives to its completion; rounds of
      different buckets overlap, so this is not wall time).

    The figures are saved with the pipeline's state (:meth:`state_dict`): after a resume ``total`` goes on
    from where it was, as the step counters do, so ``total`` over ``steps`` stays a mean per step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._steps: dict[int, dict[str, float]] = {}

    def add(self, step: int, **values: float) -> None:
        with self._lock:
            current = self._steps.get(step)
            if current is None:
                current = self._steps[step] = dict.fromkeys(COUNTERS, 0)
                while len(self._steps) > 2:
                    del self._steps[min(self._steps)]
            total = self._total
            for name, value in values.items():
                current[name] += value
                total[name] += value

    def add_traffic(self, step: int, scope: str, sent: int, received: int) -> None:
        """One collective's bytes, as :func:`gradpress.exchange.protocol.traffic` counts them, issued in a
        round of ``scope`` (:class:`gradpress.exchange.protocol.Round`): inside the node, or not."""
        if scope == "node":
            self.add(step, intra_node_sent_bytes=sent, intra_node_received_bytes=received, collectives=1)
        else:
            self.add(step, sent_bytes=sent, received_bytes=received, collectives=1)

    def timer(self, step: int, name: str) -> _Timer:
        """A context manager adding the seconds it encloses to ``name``."""
        return _Timer(self, step, name)

    def report(self, pattern: str = "") -> dict[str, Any]:
        """``{"pattern": traffic pattern, "steps": count, "step": index of the latest step, "last": its
        figures, "total": cumulative figures}``."""
        with self._lock:
            latest = max(self._steps) if self._steps else None
            return {
                "pattern": pattern,
                "steps": 0 if latest is None else latest + 1,
                "step": latest,
                "last": dict(self._steps[latest]) if latest is not None else dict.fromkeys(COUNTERS, 0),
                "total": dict(self._total),
            }


    def state_dict(self) -> dict[str, Any]:
        """``{"total": cumulative figures, "steps": {step: its figures}}`` (the latest steps kept)."""
        with self._lock:
            return {"total": dict(self._total), "steps": {step: dict(f) for step, f in self._steps.items()}}

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` is a :meth:`state_dict`: figures named as :data:`COUNTERS`,
        each a finite number >= 0, and steps numbered by integers >= 0."""
        if not isinstance(state, dict) or not isinstance(state.get("total"), dict) \
                or not isinstance(state.get("steps"), dict):
            raise ValueError("gradpress state: stats must be a dict of 'total' and 'steps'")
        tables = [("stats['total']", state["total"])]
        for step, figures in state["steps"].items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 0 \
                    or not isinstance(figures, dict):
                raise ValueError(f"gradpress state: stats['steps'] must map step numbers to figures, "
                                 f"got {step!r}")
            tables.append((f"stats['steps'][{step}]", figures))
        for where, figures in tables:
            for name, value in figures.items():
                if name not in COUNTERS:
                    raise ValueError(f"gradpress state: {where} names {name!r}, not one of "
                                     f"{', '.join(COUNTERS)}")
                if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                        or value < 0):
                    raise ValueError(f"gradpress state: {where}[{name!r}] must be a finite number >= 0, "
                                     f"got {value!r}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked by :meth:`check_state` first)."""
        self.check_state(state)
        with self._lock:
            self._total = {**dict.fromkeys(COUNTERS, 0), **state["total"]}
            self._steps = {step: {**dict.fromkeys(COUNTERS, 0), **figures}
                           for step, figures in sorted(state["steps"].items())[-2:]}


_SECONDS = ("compress_s", "decompress_s", "comm_s")


def flat_stats(report: dict[str, Any], prefix: str = "gradpress/") -> dict[str, float]:
    """A :meth:`Stats.report` (or a front end's ``stats()``) as one flat dict of numbers, ready for a
    metrics logger (TensorBoard, Weights & Biases, Lightning's ``log_dict``): the latest step's figures as
    ``<prefix><name>`` and the cumulative ones as ``<prefix>total/<name>``, times in milliseconds
    (``compress_ms``, ``decompress_ms``, ``comm_ms``), byte counts and ``collectives`` as counted, and
    ``compression_ratio``: the gradients' bytes over the packets' (``raw_bytes / packet_bytes``, the
    compressor's ratio; left out while nothing was compressed), plus ``<prefix>steps``."""
    flat: dict[str, float] = {f"{prefix}steps": float(report.get("steps", 0))}
    for part, head in (("last", prefix), ("total", f"{prefix}total/")):
        figures = report.get(part) or {}
        for name in COUNTERS:
            value = float(figures.get(name, 0))
            if name in _SECONDS:
                flat[f"{head}{name[:-2]}_ms"] = value * 1e3
            else:
                flat[f"{head}{name}"] = value
        if figures.get("packet_bytes"):
            flat[f"{head}compression_ratio"] = float(figures["raw_bytes"]) / float(figures["packet_bytes"])
    return flat


def changed_options(*option_sets: Any) -> dict[str, Any]:
    """The fields of option dataclasses (:class:`Options`, :class:`gradpress.auto.AutoOptions`) whose value
    differs from the class's default, in field order: what a front end's ``repr`` shows."""
    out: dict[str, Any] = {}
    for options in option_sets:
        if options is None:
            continue
        default = type(options)()
        out.update({f.name: getattr(options, f.name) for f in fields(options)
                    if getattr(options, f.name) != getattr(default, f.name)})
    return out


def describe(spec: Any, *option_sets: Any) -> str:
    """``'spec', name=value, …`` (the non-default options): the inside of a front end's ``repr``."""
    changed = changed_options(*option_sets)
    return ", ".join([repr(spec), *(f"{name}={value!r}" for name, value in changed.items())])


class _Timer:
    def __init__(self, stats: Stats, step: int, name: str) -> None:
        self.stats, self.step, self.name = stats, step, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *_: Any) -> None:
        self.stats.add(self.step, **{self.name: time.perf_counter() - self.start})


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
            groups.append(Group(empty, _unexchanged(tensors), max(steps[i] for i in empty)))
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
        """GRACE Algorithm 1 lines 4-14 for a group of tensors, THC's preliminary stage included.
        ``members``: the keys of the tensors one flat item stands for (see :meth:`_as_one`), which
        errors name. ``scatter``: the items are n rows, row j averaged at rank j only (see
        :meth:`scatter_groups`).

        A gradient holding NaN/Inf does not end this rank's part: its input becomes zeros, its feedback
        memory is left as it was, and the exchange carries the rank's fault flag in-band, so every
        rank raises the same :class:`NonFiniteError`, naming the faulty ranks, at the same point."""
        strategy = self.strategy if compressed else self.plain
        feedback = self.feedback if compressed else self.no_feedback
        compressor, stats, step = strategy.compressor, self.stats, max(steps)
        ctxs = [Context(self.options.seed, s, key, self.rank)
                for (key, _), s in zip(items, steps, strict=True)]
        grads = [grad.detach() for _, grad in items]
        keys = [key for key, _ in items]
        before = feedback.snapshot(keys) if feedback.updates else None
        start = time.perf_counter()
        # φ = β·m + γ·g formed by the compressor's first pass (its preliminary one, if it has one) where
        # the memory and the method allow it
        sums = ([feedback.sum_parts(key, grad) for key, grad in zip(keys, grads, strict=True)]
                if feedback.updates else [None] * len(items))
        xs = [feedback.compensate(key, grad) if parts is None else parts.out
              for (key, _), grad, parts in zip(items, grads, sums, strict=True)]
        inputs = [x if x.dtype == grad.dtype else x.to(grad.dtype) for x, grad in zip(xs, grads, strict=True)]
        faulty, carried = False, False
        prepared: list[torch.Tensor | None] = [None] * len(items)
        try:
            if compressor.prepares:
                prelims = []
                for i, (x, ctx, grad, parts) in enumerate(zip(inputs, ctxs, grads, sums, strict=True)):
                    pre = _prepare(compressor, x, ctx, self.world_size, grad, parts)
                    if pre is _FAULTY:  # the gradient's NaN/Inf, or φ's own overflow (then saturated)
                        saturated = _saturated(xs[i], grad)
                        pre = _FAULTY if saturated is None else _prepare(compressor, saturated, ctx,
                                                                         self.world_size)
                        if saturated is None or pre is _FAULTY:
                            faulty, saturated = True, torch.zeros_like(x)
                            pre = _prepare(compressor, saturated, ctx, self.world_size)
                        inputs[i] = saturated
                    prelims.append(pre)
                sums = [None] * len(items)  # φ is formed
                stats.add(step, compress_s=time.perf_counter() - start)
                prepared, carried = yield from strategy.preliminary(prelims, faulty)
                start = time.perf_counter()
            # the mean's division by n in the pass that checks the input (a bucket this may overwrite)
            divided = self.world_size if feedback.inert and strategy.divides_first else None
            packets, formed = [], [False] * len(items)  # formed: out holds the residual, not φ
            # a method with a preliminary exchange forms the residual in φ's own storage where φ is the
            # memory's (not the gradient) and is what is compressed (no cast): THC
            fuse = feedback.updates and feedback.keeps_residual and compressor.fuses_residual
            for i, (given, x, ctx, ready, grad, parts) in enumerate(zip(inputs, xs, ctxs, prepared, grads, sums, strict=True)):
                target = x if fuse and given is x and x is not grad and x.dtype == torch.float32 else None
                try:
                    if parts is not None and feedback.keeps_residual:
                        packet, formed[i] = compressor.compress_residual_sum(parts.memory, grad, parts.out, ctx,
                                                                             parts.beta, parts.gamma)
                    elif parts is not None:
                        packet = compressor.compress_sum(parts.memory, grad, parts.out, ctx, parts.beta, parts.gamma)
                    else:
                        packet = _compress(compressor, given, ctx, ready, divided, writable, target)
                except NonFiniteError:
                    if carried:  # not seen before the preliminary exchange: no flag can travel now
                        raise
                    retried: Packet | None = None
                    saturated = _saturated(x, grad)  # φ (out holds it after an error) overflowed?
                    if saturated is not None:
                        try:
                            retried = _compress(compressor, saturated, ctx, ready, divided, writable)
                        except NonFiniteError:  # (a flag then travels: no rank waits for this one)
                            retried = None
                    if retried is None:
                        faulty = True
                        retried = _compress(compressor, torch.zeros_like(given), ctx, ready, divided, True)
                    packet = retried
                packets.append(packet)
            if feedback.updates and not faulty:
                for (key, _), grad, x, packet, done in zip(items, grads, xs, packets, formed, strict=True):
                    if done:
                        feedback.update_residual(key, x)
                    else:
                        feedback.update_from(key, x, packet, compressor, owned=x is not grad)
            stats.add(step, compress_s=time.perf_counter() - start,
                      raw_bytes=sum(g.numel() * g.element_size() for g in grads),
                      packet_bytes=sum(p.nbytes for p in packets))
            timer = lambda: stats.timer(step, "decompress_s")
            if scatter:
                return (yield from strategy.reduce_scatter(packets, timer, None if carried else faulty))
            return (yield from strategy.exchange(packets, ctxs, grads if writable else None, timer,
                                                 None if carried else faulty))
        except Exception as error:  # the step never happened: the memory goes back to before it
            if before is not None:
                feedback.restore(before)
            if not isinstance(error, NonFiniteError):
                raise
            raise _named(error, members if members is not None else keys) from None

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


def _names(keys: Sequence[str]) -> str:
    return ", ".join(repr(key) for key in keys)


def _named(error: NonFiniteError, keys: Sequence[str]) -> NonFiniteError:
    """``error`` (the ranks whose gradients held NaN/Inf) naming the gradients of the exchange."""
    named = NonFiniteError(f"gradients {_names(keys)}: {error}")
    named.ranks = error.ranks
    return named


class FlatAllReduce:
    """A DDP bucket's exchange formed once (:meth:`Pipeline.flat_allreduce`): each step divides the bucket
    by n in place in the pass that checks it (a rank whose gradient holds NaN/Inf sends zeros with a NaN
    at its own position, as :mod:`gradpress.exchange.strategy.allreduce` carries the flag), all-reduces it in
    place, reads the n flags and decodes the sum (``none``'s :meth:`~gradpress.core.compressor.Compressor.
    decode_sum`: the mean as summed, checked for overflow over three or more workers) — the steps of
    :meth:`Pipeline._protocol` for this case, the same bits, statistics and errors, without forming the
    per-step keys, groups, contexts, packets and protocol around them (about 0.4 ms of Python per bucket,
    which a small model's step feels: the hook's own cost)."""

    def __init__(self, pipeline: Pipeline, keys: tuple[str, ...], flat: torch.Tensor) -> None:
        self.pipeline, self.keys, self.flat = pipeline, keys, flat
        self.pointer, self.nbytes = flat.data_ptr(), flat.numel() * flat.element_size()
        self.packet = Packet({"values": flat}, flat.shape, flat.dtype, meta={"divided": pipeline.world_size})

    def fits(self, bucket: torch.Tensor) -> bool:
        """Whether ``bucket`` is the buffer this plan was formed for (DDP keeps a bucket's buffer)."""
        return bucket.data_ptr() == self.pointer and bucket.numel() == self.flat.numel() and bucket.dtype == self.flat.dtype

    def start(self, driver: Any, then: Any) -> torch.futures.Future:
        """Start this step's exchange on ``driver``; a future of ``then(the bucket's mean)``."""
        p, flat, n = self.pipeline, self.flat, self.pipeline.world_size
        steps = p.steps
        step = max(steps.get(key, 0) for key in self.keys)
        for key in self.keys:
            steps[key] = steps.get(key, 0) + 1
        started = time.perf_counter()
        faulty = divide_counting_nonfinite(flat, n) > 0
        if faulty:  # the step's packet is of zeros; the flag travels as a NaN at this rank's position
            flat.zero_()
            flat[p.rank] = float("nan")
        p.stats.add(step, compress_s=time.perf_counter() - started, raw_bytes=self.nbytes, packet_bytes=self.nbytes)

        def finish(results: list) -> Any:
            (summed,) = results
            try:
                raise_flagged(flagged_ranks(summed[:n], "nan"))
            except NonFiniteError as error:
                raise _named(error, self.keys) from None
            with p.stats.timer(step, "decompress_s"):
                return then(p.strategy.compressor.decode_sum(self.packet, [summed], n))

        return driver.start_round(Round([AllReduce(flat)], final=True), step, finish)


def _saturated(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor | None:
    """What to compress in place of φ = β·m + γ·g (``x``, formed by the feedback memory) when φ, or its
    cast to the gradient's dtype, holds NaN/Inf: None when the finite gradient is not the cause (``x``
    is the gradient itself, or the gradient holds NaN/Inf: a fault the exchange reports), else φ
    saturated. A finite memory and gradient overflow only to ±Inf, with the sign of the exact sum: ``x``
    is clamped in place to its dtype's largest finite value (what lies beyond float32's range is lost:
    the memory cannot hold it), and the input is ``x`` cast to the gradient's dtype saturating at that
    dtype's largest value; the memory's update keeps what this leaves unsent (an fp16/bf16 φ beyond the
    gradient's range stays in the float32 memory for later steps: error feedback, GRACE Eq. 5)."""
    if x is grad or any_nonfinite(grad.reshape(-1).contiguous()):
        return None
    largest = torch.finfo(x.dtype).max
    x.clamp_(-largest, largest)
    if x.dtype == grad.dtype:
        return x
    return saturate(x.reshape(-1), grad.dtype, inplace=False).to(grad.dtype).view(grad.shape)


def _unexchanged(tensors: list[torch.Tensor]) -> Protocol:
    """The protocol of empty tensors: no round, their averages empty tensors like them."""
    return [torch.empty_like(t) for t in tensors]
    yield  # (a generator: a protocol that issues no round)


_FAULTY = object()


def _prepare(compressor: Compressor, x: torch.Tensor, ctx: Context, world_size: int,
             grad: torch.Tensor | None = None, parts: SumParts | None = None) -> Any:
    """This worker's :class:`~gradpress.core.compressor.Preliminary` for ``x`` (None for an empty tensor or
    a method that sends none for it), or ``_FAULTY`` when ``x`` holds NaN/Inf: found by a check pass,
    or, for a method that finds them in its own passes, in its preliminary values (a max norm, P = MQ).
    Preliminary values that are not finite although ``x`` is (PowerSGD's P of values near float32's
    largest) travel as they are: every rank then holds the combined values and the method raises its
    ``OverflowError`` (naming this worker or another) on every rank at the same point. ``parts``: x is
    ``parts.out``, where φ = β·m + γ·``grad`` is formed first — by the method's own preliminary pass
    (:meth:`~gradpress.core.compressor.Compressor.prepare_sum`) where it finds NaN/Inf itself."""
    if parts is not None and not compressor.checks_finite:
        assert grad is not None  # (the parts of φ come with its gradient)
        scaled_sum(parts.memory, grad, parts.beta, parts.gamma, x)
        parts = None
    flat = x.reshape(-1).contiguous()
    if flat.numel() == 0:
        return None
    if not compressor.checks_finite and any_nonfinite(flat):
        return _FAULTY
    if parts is None:
        pre = compressor.prepare(flat.view(x.shape), ctx, world_size)
    else:
        assert grad is not None  # (the parts of φ come with its gradient)
        pre = compressor.prepare_sum(parts.memory, grad, x, ctx, world_size, parts.beta, parts.gamma)
    if pre is None and compressor.checks_finite and any_nonfinite(flat):
        return _FAULTY  # (a tensor the method sends as it is: PowerSGD's vectors)
    if (pre is not None and pre.op != "broadcast" and pre.values.is_floating_point()
            and not bool(torch.isfinite(pre.values).all()) and any_nonfinite(flat)):
        return _FAULTY
    return pre


def _compress(compressor: Compressor, x: torch.Tensor, ctx: Context, prepared: torch.Tensor | None,
              divided: int | None = None, writable: bool = False,
              residual: torch.Tensor | None = None) -> Packet:
    if divided is not None:
        return compressor.compress_divided(x, divided, ctx, inplace=writable)
    if not compressor.prepares:
        return compressor.compress(x, ctx)
    if residual is None:  # (a method that overrides compress need not know the argument)
        return compressor.compress(x, ctx, prepared=prepared)
    return compressor.compress(x, ctx, prepared=prepared, residual=residual)
