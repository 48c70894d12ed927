"""The pipeline every integration drives (GRACE Algorithm 1; DESIGN.md "What flows through it"):

    feedback.compensate → compressor.prepare (+ preliminary exchange) → compressor.compress
    → feedback.update → strategy.exchange → decode → averaged gradient (same shape, dtype, device)

The unit of compression is one tensor (a parameter's gradient), keyed by a stable name: its feedback
memory, step counter and random streams follow the name, so they survive DDP's bucket rebuild and a
restart into a fresh DDP, and methods that need a tensor's shape (PowerSGD's matrices, S2's rows) get
it. The unit of communication is a group of tensors (a DDP bucket, or the tensors handed to one
``Communicator.reduce_many`` call): their packets travel together, in as few collectives as the
strategy allows. Where compressing a group tensor by tensor and as a whole give the same bits (an
:attr:`~gradpress.compressor.Compressor.elementwise` method such as ``none``, with nothing keyed per
tensor), a DDP bucket's gradients travel as one flat view of the bucket: one packet, one decoding pass.

The :class:`Driver` issues the rounds of many groups' protocols so that every rank issues the same
collectives in the same order (DESIGN invariant 3), also with several DDP buckets in flight: a final
round (the last collectives of a group) completes asynchronously, and its continuation only decodes;
a non-final round is waited for and its protocol resumed only in :meth:`Driver.advance`, which the
integrations call at points that are the same on every rank (before starting the next bucket, after
the last one). PyTorch's own PowerSGD hook issues its second all-reduce from a completion callback,
whose timing differs between ranks, so with several buckets the ranks' collectives can interleave in
different orders; Gloo matches messages by order and aborts.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch

from gradpress.agreement import agree
from gradpress.compressor import Compressor, NonFiniteError, count_nonfinite, make
from gradpress.feedback import make_feedback
from gradpress.rng import Context
from gradpress.packet import adjacent
from gradpress.protocol import Protocol, Round
from gradpress.strategy import MODES, OVERFLOW, Strategy, check_partial

FORMAT = 2


# -- options ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """Options shared by the DDP hook, the Communicator and ``simulate`` (keyword arguments).

    * ``feedback``: error-feedback memory spec (default: the compressor's ``default_feedback``:
      ``residual`` for biased methods, ``none`` for unbiased ones).
    * ``min_numel``: tensors with fewer elements go uncompressed.
    * ``exclude``: name patterns (``fnmatch``, e.g. ``"conv1.*"``, ``"*.bias"``) left uncompressed.
    * ``warmup_steps``: the first steps of each tensor go uncompressed.
    * ``seed``: seed of the shared and private random streams (DESIGN invariant 2).
    * ``timeout``: seconds (or a timedelta) after which a stuck collective raises; gradpress then
      talks on its own process group with that timeout. Default: the process group's own.
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

    @classmethod
    def of(cls, **options: Any) -> Options:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are: {', '.join(known)}")
        return cls(**options)


# -- statistics ----------------------------------------------------------------------------------------
COUNTERS = ("raw_bytes", "packet_bytes", "sent_bytes", "received_bytes", "collectives",
            "compress_s", "decompress_s", "comm_s", "control_bytes")


class Stats:
    """Per-step and cumulative figures of one rank (thread-safe: decoding runs on backend threads).

    * ``raw_bytes``: bytes of the gradients handed in; ``packet_bytes``: ``Packet.nbytes`` of this
      rank's packets (the compressor's output, GRACE's "data volume").
    * ``sent_bytes`` / ``received_bytes``: what the strategy's collectives move for this rank, from
      their traffic pattern (:func:`gradpress.strategy.traffic`): headers, widened integer sums and
      the downstream direction included.
    * ``control_bytes``: bytes sent and received for the ranks' agreement on what they exchange
      (:mod:`gradpress.agreement`, once per set of keys), not counted in the figures above.
    * ``compress_s`` (compensate, prepare, compress, feedback update), ``decompress_s`` (decoding and
      aggregation), ``comm_s`` (from issuing each round of collectives to its completion; rounds of
      different buckets overlap, so this is not wall time).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = dict.fromkeys(COUNTERS, 0)
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


class _Timer:
    def __init__(self, stats: Stats, step: int, name: str) -> None:
        self.stats, self.step, self.name = stats, step, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *_: Any) -> None:
        self.stats.add(self.step, **{self.name: time.perf_counter() - self.start})


# -- the pipeline ----------------------------------------------------------------------------------------
def compressor_of(spec: str | Compressor) -> Compressor:
    """A fresh compressor: from a spec string, or a copy of an instance (each rank, simulated or not,
    owns its compressor's state)."""
    if isinstance(spec, str):
        return make(spec)
    if not isinstance(spec, Compressor):
        raise TypeError(f"expected a spec string or a Compressor, got {type(spec).__name__}")
    try:
        made = make(spec.spec)
    except ValueError:
        made = None
    if type(made) is type(spec):
        return made  # type: ignore[return-value]
    return dataclasses.replace(spec) if dataclasses.is_dataclass(spec) else copy.deepcopy(spec)


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

    def __init__(self, spec: str | Compressor, options: Options, rank: int, world_size: int) -> None:
        self.options, self.rank, self.world_size = options, rank, world_size
        self.compressor = compressor_of(spec)
        self.feedback = make_feedback(options.feedback or self.compressor.default_feedback)
        self.master = compressor_of(options.master) if options.master else None
        common = dict(rank=rank, world_size=world_size, root=options.root, overflow=options.overflow,
                      deterministic=options.deterministic, partial=options.partial)
        self.strategy = Strategy(self.compressor, mode=options.mode, master=self.master, **common)
        # uncompressed tensors meet like the rest, but a switch cannot add floats: the server does
        self.plain = Strategy(make("none"), mode="collective" if options.mode == "collective" else "ps", **common)
        self.no_feedback = make_feedback("none")
        self.steps: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._expected_shapes: dict[str, tuple[int, ...]] = {}  # from a loaded state, checked on first use
        self.stats = Stats()
        self._agreed: set[tuple] = set()

    def agreement(self, items: Sequence[tuple[str, torch.Tensor]]) -> Group | None:
        """The ranks' agreement on these items (see :mod:`gradpress.agreement`) the first time this set
        of keys, shapes and dtypes is exchanged; None after that."""
        signature = tuple((key, tuple(t.shape), t.dtype, t.device.type) for key, t in items)
        if signature in self._agreed:
            return None
        self._agreed.add(signature)
        o = self.options
        settings = {f.name: getattr(o, f.name) for f in fields(o) if f.name != "timeout"}
        settings["feedback"] = self.feedback.spec
        parts = {
            "the compressor": repr(self.compressor.spec),
            "the options": ", ".join(f"{name}={value!r}" for name, value in settings.items()),
            "the world size": str(self.world_size),
            "the keys": repr([key for key, _ in items]),
            "the shapes": repr([tuple(t.shape) for _, t in items]),
            "the dtypes and devices": repr([f"{t.dtype} on {t.device.type}" for _, t in items]),
        }
        device = items[0][1].device if items else torch.device("cpu")
        step = max((self.steps.get(key, 0) for key, _ in items), default=0)
        return Group(list(range(len(items))), agree(parts, self.world_size, device), step)

    def compresses(self, key: str, tensor: torch.Tensor) -> bool:
        """Whether ``key``'s next step is compressed (not excluded, not too small, past warm-up)."""
        o = self.options
        if tensor.numel() < o.min_numel or self.steps.get(key, 0) < o.warmup_steps:
            return False
        return not any(fnmatch.fnmatchcase(key, pattern) for pattern in o.exclude)

    def groups(self, items: Sequence[tuple[str, torch.Tensor]], bucket: torch.Tensor | None = None) -> list[Group]:
        """The protocols exchanging ``items`` (key, gradient): the compressed ones, then the plain ones.

        Starts the items' steps. ``bucket``: a flat tensor the gradients are views of, which the
        exchange may overwrite (a DDP bucket's buffer): collectives then work in it where they can.
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
        for key, step in zip(keys, steps):
            self.steps[key] = step + 1
        writable = bucket is not None
        groups = []
        for compressed in (True, False):
            members = [i for i, flag in enumerate(flags) if flag == compressed]
            if members:
                chosen = [items[i] for i in members]
                chosen_steps = [steps[i] for i in members]
                step = max(chosen_steps)
                flat = self._as_one(compressed, [t for _, t in chosen], bucket) if writable else None
                if flat is None:
                    protocol = self._protocol(chosen, chosen_steps, compressed, writable)
                else:
                    protocol = self._protocol([(chosen[0][0], flat)], [step], compressed, writable,
                                              members=[key for key, _ in chosen])
                groups.append(Group(members, protocol, step, flat))
        return groups

    def _record_shape(self, key: str, shape: tuple[int, ...]) -> None:
        expected = self._expected_shapes.pop(key, None)
        if expected is not None and expected != shape:
            raise ValueError(f"{key!r} has shape {shape}; the loaded gradpress state was saved for {expected}")
        self.shapes[key] = shape

    def _as_one(self, compressed: bool, tensors: list[torch.Tensor], bucket: torch.Tensor) -> torch.Tensor | None:
        """The tensors as one flat view of ``bucket``, when exchanging them as one tensor gives the same
        result as one by one: an :attr:`~gradpress.compressor.Compressor.elementwise` method, no
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
                  members: Sequence[str] | None = None) -> Protocol:
        """GRACE Algorithm 1 lines 4-14 for a group of tensors, THC's preliminary stage included.
        ``members``: the keys of the tensors one flat item stands for (see :meth:`_as_one`), which
        errors name.

        A gradient holding NaN/Inf does not end this rank's part: its input becomes zeros, its feedback
        memory is left as it was, and the exchange carries the rank's fault flag in-band, so every
        rank raises the same :class:`NonFiniteError`, naming the faulty ranks, at the same point."""
        strategy = self.strategy if compressed else self.plain
        feedback = self.feedback if compressed else self.no_feedback
        compressor, stats, step = strategy.compressor, self.stats, max(steps)
        ctxs = [Context(self.options.seed, s, key, self.rank) for (key, _), s in zip(items, steps)]
        grads = [grad.detach() for _, grad in items]
        names = _names(members if members is not None else [key for key, _ in items])
        keys = [key for key, _ in items]
        before = feedback.snapshot(keys) if feedback.updates else None
        start = time.perf_counter()
        xs = [feedback.compensate(key, grad) for (key, _), grad in zip(items, grads)]
        inputs = [x if x.dtype == grad.dtype else x.to(grad.dtype) for x, grad in zip(xs, grads)]
        faulty, carried = False, False
        prepared: list[torch.Tensor | None] = [None] * len(items)
        try:
            if compressor.prepares:
                prelims = []
                for i, (x, ctx) in enumerate(zip(inputs, ctxs)):
                    pre = _prepare(compressor, x, ctx, self.world_size)
                    if pre is _FAULTY:
                        faulty, inputs[i] = True, torch.zeros_like(x)
                        pre = _prepare(compressor, inputs[i], ctx, self.world_size)
                    prelims.append(pre)
                stats.add(step, compress_s=time.perf_counter() - start)
                prepared, carried = yield from strategy.preliminary(prelims, faulty)
                start = time.perf_counter()
            packets = []
            for given, ctx, ready in zip(inputs, ctxs, prepared):
                try:
                    packet = _compress(compressor, given, ctx, ready)
                except NonFiniteError:
                    if carried:  # not seen before the preliminary exchange: no flag can travel now
                        raise
                    faulty = True
                    packet = _compress(compressor, torch.zeros_like(given), ctx, ready)
                packets.append(packet)
            if feedback.updates and not faulty:
                for (key, _), grad, x, packet in zip(items, grads, xs, packets):
                    feedback.update_from(key, x, packet, compressor, owned=x is not grad)
            stats.add(step, compress_s=time.perf_counter() - start,
                      raw_bytes=sum(g.numel() * g.element_size() for g in grads),
                      packet_bytes=sum(p.nbytes for p in packets))
            return (yield from strategy.exchange(packets, ctxs, grads if writable else None,
                                                 lambda: stats.timer(step, "decompress_s"),
                                                 None if carried else faulty))
        except Exception as error:  # the step never happened: the memory goes back to before it
            if before is not None:
                feedback.restore(before)
            if not isinstance(error, NonFiniteError):
                raise
            named = NonFiniteError(f"gradients {names}: {error}")
            named.ranks = error.ranks
            raise named from None

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
                 "feedback": self.feedback.state_dict(), "compressor": self.compressor.state_dict()}
        if self.master is not None:
            state["master"] = self.master.state_dict()
        return state

    def load_state_dict(self, state: Any) -> None:
        """Restore :meth:`state_dict`, or this rank's part of a gathered one (see :func:`gathered`).
        Everything is checked before anything is loaded: a ``ValueError`` names the key at fault (a
        state of another method, memory, rank or world size; a tensor of the wrong shape or dtype, or
        holding NaN/Inf)."""
        state = own_state(state, self.rank, self.world_size)
        expected = {"spec": self.compressor.spec, "feedback_spec": self.feedback.spec,
                    "master_spec": self.master.spec if self.master is not None else None,
                    "world_size": self.world_size, "rank": self.rank}
        for name, value in expected.items():
            if state[name] != value:
                hint = (" (a framework that saves one file from rank 0 needs every rank's state: save "
                        "state_dict(gathered=True))" if name == "rank" else "")
                raise ValueError(f"gradpress state: {name} is {state[name]!r}, this runtime's is {value!r}{hint}")
        shapes = _shapes(state["shapes"])
        steps = state["steps"]
        if not isinstance(steps, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                                  and v >= 0 for k, v in steps.items()):
            raise ValueError("gradpress state: steps must map each key to an integer >= 0")
        _check_keyed("feedback", state["feedback"], shapes)
        for name, compressor in (("compressor", self.compressor), ("master", self.master)):
            if compressor is None:
                continue
            section = state.get(name, {})
            _check_tensors(name, section)
            compressor.check_state(section, shapes)
        self.steps = dict(steps)
        self.shapes = dict(shapes)
        self._expected_shapes = dict(shapes)
        self.feedback.load_state_dict(state["feedback"])
        self.compressor.load_state_dict(state["compressor"])
        if self.master is not None and "master" in state:
            self.master.load_state_dict(state["master"])


_STATE_KEYS = ("format", "spec", "feedback_spec", "master_spec", "rank", "world_size", "shapes", "steps",
               "feedback", "compressor")


def gathered(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's :meth:`Pipeline.state_dict` in one dict (by rank), the form a framework that writes
    one checkpoint file from rank 0 saves; each rank's :meth:`Pipeline.load_state_dict` takes its own."""
    return {"format": FORMAT, "gathered": True, "world_size": len(states), "ranks": list(states)}


def own_state(state: Any, rank: int, world_size: int) -> dict[str, Any]:
    """``state`` checked for the keys a runtime state has: itself, or rank ``rank``'s part of a
    :func:`gathered` state (whose world size must be ``world_size``)."""
    if not isinstance(state, dict):
        raise ValueError(f"gradpress state: expected the dict state_dict() returned, got {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(f"gradpress state: not a state of this version (format {state.get('format')!r}, "
                         f"expected {FORMAT})")
    if state.get("gathered"):
        ranks = state.get("ranks")
        if not isinstance(ranks, list) or len(ranks) != world_size or state.get("world_size") != world_size:
            raise ValueError(f"gradpress state: a gathered state of {state.get('world_size')!r} ranks cannot "
                             f"load into a world of {world_size}")
        return own_state(ranks[rank], rank, world_size)
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"gradpress state: missing {', '.join(repr(k) for k in missing)}")
    return state


def _shapes(recorded: Any) -> dict[str, tuple[int, ...]]:
    if not isinstance(recorded, dict):
        raise ValueError("gradpress state: shapes must map each key to its shape")
    shapes = {}
    for key, shape in recorded.items():
        if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"gradpress state: shapes[{key!r}] must be a list of sizes, got {shape!r}")
        shapes[key] = tuple(shape)
    return shapes


def _check_tensors(where: str, value: Any) -> None:
    """Every tensor in ``value`` (nested dicts and lists) is finite; the error names where one is not."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"gradpress state: {where} holds NaN/Inf")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_tensors(f"{where}[{key!r}]", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_tensors(f"{where}[{i}]", item)


def _check_keyed(where: str, sections: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    """A feedback memory's state: sections of float32 tensors keyed by tensor name, each of its key's
    shape where the state recorded one, finite."""
    if not isinstance(sections, dict):
        raise ValueError(f"gradpress state: {where} must be a dict, got {type(sections).__name__}")
    for name, keyed in sections.items():
        if not isinstance(keyed, dict):
            raise ValueError(f"gradpress state: {where}[{name!r}] must map keys to tensors")
        for key, tensor in keyed.items():
            at = f"{where}[{name!r}][{key!r}]"
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
                raise ValueError(f"gradpress state: {at} must be a float32 tensor, got {_kind(tensor)}")
            if key in shapes and tuple(tensor.shape) != shapes[key]:  # (else checked where it is used)
                raise ValueError(f"gradpress state: {at} has shape {tuple(tensor.shape)}, the tensor {shapes[key]}")
            _check_tensors(at, tensor)


def _kind(value: Any) -> str:
    return f"{value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def _names(keys: Sequence[str]) -> str:
    return ", ".join(repr(key) for key in keys)


_FAULTY = object()


def _prepare(compressor: Compressor, x: torch.Tensor, ctx: Context, world_size: int) -> Any:
    """This worker's :class:`~gradpress.compressor.Preliminary` for ``x`` (None for an empty tensor or
    a method that sends none for it), or ``_FAULTY`` when ``x`` holds NaN/Inf: found by a check pass,
    or, for a method that finds them in its own passes, in its preliminary values (a max norm, P = MQ)."""
    flat = x.reshape(-1).contiguous()
    if flat.numel() == 0:
        return None
    if not compressor.checks_finite and count_nonfinite(flat):
        return _FAULTY
    pre = compressor.prepare(flat.view(x.shape), ctx, world_size)
    if pre is None and compressor.checks_finite and count_nonfinite(flat):
        return _FAULTY  # (a tensor the method sends as it is: PowerSGD's vectors)
    if (pre is not None and pre.op != "broadcast" and pre.values.is_floating_point()
            and not bool(torch.isfinite(pre.values).all())):
        return _FAULTY
    return pre


def _compress(compressor: Compressor, x: torch.Tensor, ctx: Context, prepared: torch.Tensor | None) -> Any:
    return compressor.compress(x, ctx, prepared=prepared) if compressor.prepares else compressor.compress(x, ctx)


# -- the driver --------------------------------------------------------------------------------------------
class ExchangeFailed(RuntimeError):
    """An earlier exchange failed, so the ranks may be out of step: no further exchange is attempted."""


@dataclass
class _Run:
    protocol: Protocol
    step: int
    then: Callable[[Any], Any]
    future: torch.futures.Future | None = None
    handle: Any = None
    control: bool = False


def _same(value: Any) -> Any:
    return value


class Driver:
    """Runs protocols on an executor in the order DESIGN invariant 3 needs (see the module docstring).

    A protocol whose first round is its last (most methods) completes in one callback on the
    backend's thread: the round's results, the decoding and ``then``, holding the GIL once. Python
    threads hand the GIL over at most every few milliseconds, so each further callback in a chain can
    wait that long behind the training loop's own Python (DDP's backward thread).
    """

    def __init__(self, executor: Any, stats: Stats) -> None:
        self.executor, self.stats = executor, stats
        self._pending: deque[_Run] = deque()
        self.failure: BaseException | None = None

    def check(self) -> None:
        if self.failure is not None:
            raise ExchangeFailed(f"gradpress: an earlier exchange failed ({type(self.failure).__name__}: "
                                 f"{self.failure}); the ranks may be out of step") from self.failure

    def start(self, protocol: Protocol, step: int, devices: list[torch.device] | None = None,
              then: Callable[[Any], Any] = _same, control: bool = False) -> torch.futures.Future:
        """Run ``protocol`` up to its first round and issue it; a future of ``then(its result)``
        (``then`` runs where the result is formed, on a backend thread for asynchronous rounds).
        ``control``: its traffic is the ranks' agreement, counted as ``control_bytes``."""
        self.check()
        run = _Run(protocol, step, then, control=control)
        round_ = self._resume(run, None)
        if isinstance(round_, Round) and round_.final:
            return self._issue(run, round_).future(lambda results: self._finish(run, results), self._record)
        run.future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        if isinstance(round_, Round):
            run.handle = self._issue(run, round_)
            self._pending.append(run)
        else:
            self._complete(run, round_.value)
        return run.future

    def advance(self) -> None:
        """Wait for every pending non-final round, in start order, and issue what follows it."""
        while self._pending:
            run = self._pending.popleft()
            while run.handle is not None:
                handle, run.handle = run.handle, None
                try:
                    results = handle.wait()
                except BaseException as error:
                    self._fail(run, error)
                    raise
                round_ = self._resume(run, results)
                if not isinstance(round_, Round):
                    self._complete(run, round_.value)
                elif round_.final:
                    self._issue(run, round_).future(lambda results, run=run: self._settle(run, results),
                                                    lambda error, run=run: self._abandon(run, error))
                else:
                    run.handle = self._issue(run, round_)

    def run(self, protocol: Protocol, step: int, control: bool = False) -> Any:
        """Run ``protocol`` to its end (blocking) and return its result."""
        future = self.start(protocol, step, control=control)
        self.advance()
        return self.wait(future)

    def wait(self, future: torch.futures.Future) -> Any:
        """``future.wait()``, raising the exchange's own error: one raised in a backend callback
        reaches the future as a RuntimeError that only quotes it."""
        try:
            return future.wait()
        except RuntimeError as error:
            if self.failure is None or self.failure is error:
                raise
            raise self.failure from None

    def _resume(self, run: _Run, results: list | None) -> Round | StopIteration:
        """The protocol's next round, or its StopIteration (whose ``value`` is the protocol's result)."""
        try:
            return run.protocol.send(results)
        except StopIteration as stop:
            return stop
        except BaseException as error:
            self._fail(run, error)
            raise

    def _issue(self, run: _Run, round_: Round) -> Any:
        step = run.step
        if run.control:
            return self.executor.issue(round_, lambda sent, received: self.stats.add(
                step, control_bytes=sent + received), lambda seconds: None)
        return self.executor.issue(
            round_,
            lambda sent, received: self.stats.add(step, sent_bytes=sent, received_bytes=received, collectives=1),
            lambda seconds: self.stats.add(step, comm_s=seconds))

    def _record(self, error: BaseException) -> None:
        self.failure = self.failure or error

    def _complete(self, run: _Run, value: Any) -> None:
        """Complete ``run.future`` with ``run.then(value)`` (on the calling thread)."""
        try:
            result = run.then(value)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
            run.future.set_exception(error)
            return
        run.future.set_result(result)

    def _finish(self, run: _Run, results: list) -> Any:
        """Continuation of a final round (on a backend thread): decode, then ``run.then``."""
        try:
            try:
                run.protocol.send(results)
            except StopIteration as stop:
                return run.then(stop.value)
            raise RuntimeError("a protocol issued collectives after its final round")
        except BaseException as error:
            self._record(error)
            raise

    def _settle(self, run: _Run, results: list) -> None:
        """:meth:`_finish` for a run that started with a non-final round: completes its future."""
        try:
            value = self._finish(run, results)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
            self._abandon(run, error)
            return
        run.future.set_result(value)

    def _abandon(self, run: _Run, error: BaseException) -> None:
        """A run's final round failed (on a backend thread): record it, fail the run's future."""
        self._record(error)
        if not run.future.done():
            run.future.set_exception(error)

    def _fail(self, run: _Run, error: BaseException) -> None:
        self._record(error)
        for other in [run, *self._pending]:
            if other.future is not None and not other.future.done():
                other.future.set_exception(error)
        self._pending.clear()
