"""What :class:`~gradpress.auto.AutoPipeline` holds: a pipeline per candidate and level (built when first
chosen; ``spec@node`` a two-level one on several nodes), sharing the step counters, shapes and
statistics; the choice of a method per key; and the switch of a key from one method to another, which
carries or flushes its residual."""
from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any, Sequence

import torch

from gradpress.auto.options import MEASURE_WITH, NODE, UNCOMPRESSED, AutoOptions, level_of, method_of
from gradpress.core.compressor import make
from gradpress.exchange.hierarchy import HierarchicalPipeline, Layout, Split
from gradpress.exchange.pipeline import Options, Pipeline, Stats

if TYPE_CHECKING:
    from gradpress.auto.measure import _StepRecord


class AutoBase:
    """The pipelines and the choice (see the module docstring); the recording, the decisions and the
    state are :class:`~gradpress.auto.measure.Recorder`'s, :class:`~gradpress.auto.decision.Decider`'s
    and :class:`~gradpress.auto.state.AutoState`'s."""

    def __init__(self, auto: AutoOptions, options: Options, rank: int, world_size: int,
                 layout: Layout | None = None) -> None:
        self.auto, self.options, self.rank, self.world_size = auto, options, rank, world_size
        #: several nodes of several ranks (``layout.two_level``): the levels its candidates run on
        self.layout = layout if layout is not None and layout.two_level else None
        if self.layout is None:
            self.levels: tuple[bool, ...] = (False,)
        else:
            self.levels = (True,) if options.hierarchy is not None else (False, True)
        #: every name a bucket can run: a candidate's spec (flat), or with ``@node`` (two levels); and the
        #: measurement's (``measure_with``, on several nodes with ``@node`` too)
        names = [spec + (NODE if two else "") for two in self.levels for spec in auto.candidates]
        self.stats = Stats()
        self.steps: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        measure = self._measure_with(auto.measure_with)
        #: what the steps before the first decision run (on several nodes, one level and two)
        self.measuring = (measure,) + ((measure + NODE,) if self.layout is not None else ())
        self.names = tuple(dict.fromkeys([UNCOMPRESSED, *self.measuring, *names]))
        self._expected_shapes: dict[str, tuple[int, ...]] = {}
        self._pipelines: dict[str, Pipeline] = {}
        self.choice: dict[str, str] = {}  # key -> spec (absent: none)
        self.decided_at: int | None = None
        self.next_decision: float = auto.settle_steps + auto.measure_steps  # (math.inf: never)
        self.why: dict[str, Any] = {}
        self._flush: dict[str, torch.Tensor] = {}
        self._records: deque[_StepRecord] = deque(maxlen=auto.measure_steps + 1)
        self._arrivals: dict[tuple, deque[float]] = {}
        self._link_free = 0.0
        self._current_step = -1
        self._costs: dict[str, Any] | None = None  # rank 0: spec -> MethodCost, for _costs_layout
        self._errors: dict[str, Any] | None = None  # rank 0: spec -> a CompressionError per bucket
        self._costs_layout: tuple | None = None
        self._captured: dict[str, torch.Tensor] | None = None
        self._earlier: tuple[int, dict[str, torch.Tensor]] | None = None  # rank 0: (step, gradients) before
        #: rank 0: (step, [‖mean‖²]) of the captured step's exact averages (None: a step not uncompressed)
        self._mean: tuple[int, list[float] | None] | None = None
        self._signal = 0.0  # rank 0: the signal fraction of the last measurement
        self.skipped: dict[str, str] = {}  # rank 0: candidates that failed to measure, with why
        self.error: str | None = None  # rank 0: why the last decision kept the methods as they were
        self.pipeline(UNCOMPRESSED)

    def _measure_with(self, given: str | None) -> str:
        """``measure_with``: ``given`` (``ValueError`` when these options cannot run it), or by default
        :data:`~gradpress.auto.options.MEASURE_WITH` where they can, else ``none``."""
        try:
            self._fresh(given or MEASURE_WITH)
        except ValueError as error:
            if given is not None:
                raise ValueError(f"option measure_with={given!r}: {error}") from None
            return UNCOMPRESSED
        return given or MEASURE_WITH

    # -- the pipelines -----------------------------------------------------------------------------
    def pipeline(self, spec: str) -> Pipeline:
        """The pipeline of ``spec`` (built once; it shares this one's steps, shapes and statistics)."""
        pipeline = self._pipelines.get(spec)
        if pipeline is None:
            pipeline = self._pipelines[spec] = self._fresh(spec)
        return pipeline

    def _fresh(self, name: str) -> Pipeline:
        if level_of(name):
            if self.layout is None:
                raise ValueError(f"{name!r}: a two-level exchange needs several nodes of several ranks")
            node = NodePipeline(make(method_of(name)), self.options, self.layout)
            node.stats = node.inner.stats = self.stats
            node.steps = self.steps
            return node  # type: ignore[return-value]  # (Pipeline's interface)
        pipeline = Pipeline(make(name), self.options, self.rank, self.world_size)
        pipeline.stats, pipeline.steps, pipeline.shapes = self.stats, self.steps, self.shapes
        return pipeline

    def _agreed_on(self, spec: str) -> dict[str, str]:
        """What the ranks agree on beyond a chosen pipeline's own components: that the method is
        ``auto``'s choice, ``auto``'s options and its schedule (a rank that decides alone waits forever)."""
        decided = "not decided yet" if self.decided_at is None else f"decided at step {self.decided_at}"
        next_check = "never" if math.isinf(self.next_decision) else f"step {int(self.next_decision)}"
        levels = "one level" if self.layout is None else \
            f"{'two levels' if self.levels == (True,) else 'flat or two levels'}, {self.layout.text}"
        return {"the compressor": f"'auto' (now {spec!r})", "auto": self.auto.text(),
                "auto's schedule": f"{decided}, next decision at {next_check}", "auto's levels": levels}

    def _default(self) -> str:
        """What a key without a choice runs: before the first decision ``measure_with``, on several
        nodes every other measured step in two levels (its all-gathers inside the node time the rate
        there); after it, ``none`` (in two levels where only two-level candidates are chosen)."""
        if self.decided_at is None:
            measured = self._current_step - self.auto.settle_steps
            return self.measuring[-1] if measured >= 0 and measured % 2 else self.measuring[0]
        return UNCOMPRESSED if self.levels[0] is False or not self.choice else UNCOMPRESSED + NODE

    def _split(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int]]]:
        """The items' positions by chosen method, methods in order of first appearance."""
        by_spec: dict[str, list[int]] = {}
        for i, (key, _) in enumerate(items):
            by_spec.setdefault(self.choice.get(key) or self._default(), []).append(i)
        return list(by_spec.items())

    def _switch(self, key: str, old: str, new: str) -> None:
        """``key`` goes from ``old``'s pipeline to ``new``'s: its residual is carried or flushed.

        On one level the residual e moves into ``new``'s memory, or is added once to the key's next
        gradient. A two-level memory holds local rank j's residual of its node's mean shard j: between
        two-level methods it moves as it is; otherwise it becomes this rank's share of the whole, k·e
        on shard j and zero elsewhere (the node's reduce-scatter divides by k), which a one-level memory
        takes over or the next exchange sends once. A one-level residual entering two levels is sent
        once (a shard's memory holds the node's sum, which no rank has alone)."""
        self._gather_measured(key, old)
        self.choice[key] = new
        if old == new:
            return
        residual = self._pipelines[old].feedback.take(key) if old in self._pipelines else None
        pending = self._flush.pop(key, None)
        if residual is None and pending is None:
            return
        if residual is not None and pending is None and level_of(old) == level_of(new) \
                and self._carried(key, new, residual):
            return
        if residual is not None and level_of(old):
            residual = self._whole(key, residual)
        parts = [t for t in (residual, pending) if t is not None]
        self._pending(key, new, parts[0] if len(parts) == 1 else parts[0] + parts[1])

    def _gather_measured(self, key: str, old: str) -> None:
        """The measurement's residuals of ``key`` into ``old``'s memory, or to be sent once: on several
        nodes the measured steps alternate one level and two, each with a memory of its own."""
        for name in self.measuring:
            if name != old and name in self._pipelines:
                residual = self._pipelines[name].feedback.take(key)
                if residual is not None:
                    self._pending(key, old, self._whole(key, residual) if level_of(name) else residual)

    def _pending(self, key: str, name: str, residual: torch.Tensor) -> None:
        """``residual`` into ``name``'s memory of ``key`` (on one level), else added to what is sent once."""
        if level_of(name) or not self._carried(key, name, residual):
            pending = self._flush.get(key)
            self._flush[key] = residual if pending is None else pending + residual

    def _carried(self, key: str, name: str, residual: torch.Tensor) -> bool:
        """Whether ``name``'s memory took ``residual`` over (it compresses ``key`` and keeps a residual)."""
        target = self.pipeline(name)
        if isinstance(target, NodePipeline):
            shape = self.shapes.get(key)
            if shape is None:
                return False
            target.inner.whole.setdefault(key, math.prod(shape))
            part = target.split(key, shape)
            inner = target.inner
            meta = torch.empty(part.part_shape(target.layout.local), device="meta")
            return inner.compresses(key, meta) and inner.feedback.give(key, residual)
        shape = self.shapes.get(key, tuple(residual.shape))
        return target.compresses(key, torch.empty(shape, device="meta")) and target.feedback.give(key, residual)

    def _whole(self, key: str, shard: torch.Tensor) -> torch.Tensor:
        """A two-level residual of ``key``'s shard as this rank's share of the whole (k·e on its shard)."""
        assert self.layout is not None  # (a two-level memory exists)
        shape = self.shapes[key]
        split = Split.of(key, shape, self.layout.local_size)
        whole = torch.zeros(shape, dtype=shard.dtype, device=shard.device)
        j = self.layout.local
        split.part(whole, j).copy_(shard.reshape(split.part_shape(j)) * self.layout.local_size)
        return whole

    def _in_use(self) -> list[str]:
        return list(dict.fromkeys(self.choice.values())) or [UNCOMPRESSED]


class NodePipeline(HierarchicalPipeline):
    """A two-level pipeline of :class:`AutoBase`: its per-tensor step counters are ``auto``'s (shared
    with every level), and its shards' counters follow them, so a method chosen late continues the
    job's steps (warm-up, random streams) in two levels as on one."""

    def split(self, key: str, shape: tuple[int, ...]) -> Split:
        return self._split(key, shape)

    def _exchange(self, items: list[tuple[str, torch.Tensor]], writable: bool, step: int) -> Any:
        for key, _ in items:
            self.inner.steps[key] = self.steps[key] - 1  # (the outer count already includes this step)
        return super()._exchange(items, writable, step)
