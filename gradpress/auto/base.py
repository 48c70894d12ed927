"""What :class:`~gradpress.auto.AutoPipeline` holds: a pipeline per candidate (built when first
chosen), sharing the step counters, shapes and statistics; the choice of a method per key; and the
switch of a key from one method to another, which carries or flushes its residual."""
from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any, Sequence

import torch

from gradpress.auto.options import UNCOMPRESSED, AutoOptions
from gradpress.core.compressor import make
from gradpress.exchange.pipeline import Options, Pipeline, Stats

if TYPE_CHECKING:
    from gradpress.auto.measure import _StepRecord


class AutoBase:
    """The pipelines and the choice (see the module docstring); the recording, the decisions and the
    state are :class:`~gradpress.auto.measure.Recorder`'s, :class:`~gradpress.auto.decision.Decider`'s
    and :class:`~gradpress.auto.state.AutoState`'s."""

    def __init__(self, auto: AutoOptions, options: Options, rank: int, world_size: int) -> None:
        self.auto, self.options, self.rank, self.world_size = auto, options, rank, world_size
        self.stats = Stats()
        self.steps: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
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
        self._costs_layout: tuple | None = None
        self._captured: dict[str, torch.Tensor] | None = None
        self.skipped: dict[str, str] = {}  # rank 0: candidates that failed to measure, with why
        self.error: str | None = None  # rank 0: why the last decision kept the methods as they were
        self.pipeline(UNCOMPRESSED)

    # -- the pipelines -----------------------------------------------------------------------------
    def pipeline(self, spec: str) -> Pipeline:
        """The pipeline of ``spec`` (built once; it shares this one's steps, shapes and statistics)."""
        pipeline = self._pipelines.get(spec)
        if pipeline is None:
            pipeline = self._pipelines[spec] = self._fresh(spec)
        return pipeline

    def _fresh(self, spec: str) -> Pipeline:
        pipeline = Pipeline(make(spec), self.options, self.rank, self.world_size)
        pipeline.stats, pipeline.steps, pipeline.shapes = self.stats, self.steps, self.shapes
        return pipeline

    def _agreed_on(self, spec: str) -> dict[str, str]:
        """What the ranks agree on beyond a chosen pipeline's own components: that the method is
        ``auto``'s choice, ``auto``'s options and its schedule (a rank that decides alone waits forever)."""
        decided = "not decided yet" if self.decided_at is None else f"decided at step {self.decided_at}"
        next_check = "never" if math.isinf(self.next_decision) else f"step {int(self.next_decision)}"
        return {"the compressor": f"'auto' (now {spec!r})", "auto": self.auto.text(),
                "auto's schedule": f"{decided}, next decision at {next_check}"}

    def _split(self, items: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int]]]:
        """The items' positions by chosen method, methods in order of first appearance."""
        by_spec: dict[str, list[int]] = {}
        for i, (key, _) in enumerate(items):
            by_spec.setdefault(self.choice.get(key, UNCOMPRESSED), []).append(i)
        return list(by_spec.items())

    def _switch(self, key: str, old: str, new: str) -> None:
        """``key`` goes from ``old``'s pipeline to ``new``'s: its residual is carried or flushed."""
        if old == new:
            return
        self.choice[key] = new
        residual = self._pipelines[old].feedback.take(key) if old in self._pipelines else None
        pending = self._flush.pop(key, None)
        if pending is not None:
            residual = pending if residual is None else residual + pending
        if residual is None:
            return
        target = self.pipeline(new)
        shape = self.shapes.get(key, tuple(residual.shape))
        compressed = target.compresses(key, torch.empty(shape, device="meta"))
        if not (compressed and target.feedback.give(key, residual)):
            self._flush[key] = residual

    def _in_use(self) -> list[str]:
        return list(dict.fromkeys(self.choice.values())) or [UNCOMPRESSED]
