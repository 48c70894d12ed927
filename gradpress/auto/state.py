"""``auto``'s state: the runtime's state format (:mod:`gradpress.exchange.state`) with ``spec``
``"auto"`` and an ``"auto"`` section (the choice, its schedule and reasons, the residuals waiting to be
sent, every built method's own pipeline state), checked whole before anything loads."""
from __future__ import annotations

import math
from typing import Any

from gradpress.auto.base import AutoBase, NodePipeline
from gradpress.auto.options import AUTO, UNCOMPRESSED, level_of, method_of
from gradpress.exchange.pipeline import Pipeline, Stats
from gradpress.exchange.state import FORMAT, _check_keyed, own_state, resized, shapes_of, warn_resized


class AutoState(AutoBase):
    """:meth:`state_dict`, :meth:`own_part` and :meth:`load_state_dict` of
    :class:`~gradpress.auto.AutoPipeline`."""

    def state_dict(self) -> dict[str, Any]:
        """The runtime's state format (:mod:`gradpress.exchange.state`) with ``spec`` ``"auto"`` and an ``"auto"``
        section: the choice, when it was made and when it is re-checked, the reasons, the residuals
        waiting to be flushed, and every built method's own pipeline state (memory, warm starts)."""
        return {
            "format": FORMAT, "spec": AUTO, "feedback_spec": self.options.feedback,
            "master_spec": self.options.master, "rank": self.rank, "world_size": self.world_size,
            "shapes": {key: list(shape) for key, shape in self.shapes.items()}, "steps": dict(self.steps),
            "feedback": {}, "compressor": {}, "stats": self.stats.state_dict(),
            "auto": {
                "candidates": list(self.auto.candidates), "choice": dict(self.choice),
                "decided_at": self.decided_at,
                "next_decision": None if math.isinf(self.next_decision) else int(self.next_decision),
                "why": _plain(self.why), "flush": {key: t.clone() for key, t in self._flush.items()},
                "pipelines": {spec: _without_stats(p.state_dict()) for spec, p in self._pipelines.items()},
            },
        }

    def own_part(self, state: Any, on_world_size_change: str = "raise") -> dict[str, Any]:
        """:meth:`gradpress.exchange.pipeline.Pipeline.own_part` for an ``"auto"`` state: with ``"reset"``, a state of
        another world size keeps the choice, the step counters, shapes, this rank's statistics and each
        method's shared state, drops every method's error-feedback memory and the residuals waiting to
        be sent, and decides again for this world (after measuring the next steps); one
        ``UserWarning`` says what was dropped."""
        part = own_state(state, self.rank, self.world_size, on_world_size_change)
        if on_world_size_change == "raise" or part["world_size"] == self.world_size:
            return part
        out, dropped, kept = resized(part, self.rank, self.world_size, {})
        section = part.get("auto")
        if isinstance(section, dict):
            section = dict(section)
            flush = section.get("flush")
            if isinstance(flush, dict) and flush:
                dropped.append(f"the residuals of {len(flush)} tensors waiting to be sent once")
            section["flush"] = {}
            saved = section.get("pipelines")
            if isinstance(saved, dict):
                pipelines = {}
                for spec, sub in saved.items():
                    if level_of(spec):  # a shard's memory, of a layout this world may not have
                        dropped.append(f"{spec}: the memory of a shard in two levels")
                        continue
                    if spec in self.auto.candidates:  # (else refused when loaded)
                        sub, lost, _ = resized(own_state(sub, self.rank, self.world_size), self.rank,
                                               self.world_size, self._fresh(spec).shared_sections())
                        dropped += [f"{spec}: {what}" for what in lost]
                    pipelines[spec] = sub
                section["pipelines"] = pipelines
            section["next_decision"] = 0  # the choice was made for another n: measure and decide again
            choice = section.get("choice")
            if isinstance(choice, dict):  # a level this world lacks: its method, flat, until then
                section["choice"] = {key: name if name in self.names or not isinstance(name, str)
                                     else method_of(name) for key, name in choice.items()}
            kept.append("the choice of methods until it is made again for this world")
            out["auto"] = section
        warn_resized(part["world_size"], self.world_size, dropped, kept)
        return out

    def load_state_dict(self, state: Any, on_world_size_change: str = "raise") -> None:
        """Restore :meth:`state_dict` (this rank's, or a gathered one); everything is checked first, and
        a ``ValueError`` names what does not fit (another method, rank or world size; a choice outside
        the candidates; a memory of the wrong shape or holding NaN/Inf). ``on_world_size_change``: see
        :meth:`own_part`."""
        state = self.own_part(state, on_world_size_change)
        section, shapes = self._checked_section(state)
        pipelines = self._loaded_pipelines(section.get("pipelines"))
        stats = state.get("stats")  # (absent from a state saved before statistics were: they start from zero)
        if stats is not None:
            Stats.check_state(stats)
        # everything checked: load
        self.steps.clear()
        self.steps.update(state["steps"])
        self.shapes.clear()
        self.shapes.update(shapes)
        self._expected_shapes = dict(shapes)
        self.stats.load_state_dict(stats if stats is not None else Stats().state_dict())
        for pipeline in pipelines.values():
            if isinstance(pipeline, NodePipeline):  # (its shards' own counters and shapes are its own)
                pipeline.steps = self.steps
                pipeline.stats = pipeline.inner.stats = self.stats
                continue
            pipeline.steps, pipeline.shapes, pipeline._expected_shapes = self.steps, self.shapes, {}
            pipeline.stats = self.stats
        self._pipelines = pipelines
        self.pipeline(UNCOMPRESSED)
        self.choice = dict(section["choice"])
        self._flush = {key: t.clone() for key, t in section.get("flush", {}).items()}
        self.decided_at = section.get("decided_at")
        next_decision = section.get("next_decision")
        self.next_decision = math.inf if next_decision is None else next_decision
        self.why = dict(section.get("why") or {})
        self._records.clear()
        self._arrivals.clear()
        self._current_step = -1
        self._costs, self._costs_layout, self._captured, self._errors = None, None, None, None
        self._earlier, self._mean = None, None

    def _checked_section(self, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
        """``state``'s ``"auto"`` section and its shapes, once its header, step counters, choice, residuals
        waiting to be sent and schedule are checked (``ValueError`` naming what does not fit)."""
        for name, value in (("spec", AUTO), ("world_size", self.world_size), ("rank", self.rank)):
            if state[name] != value:
                raise ValueError(f"gradpress state: {name} is {state[name]!r}, this runtime's is {value!r}")
        section = state.get("auto")
        if not isinstance(section, dict):
            raise ValueError("gradpress state: an 'auto' state needs its 'auto' section")
        shapes = shapes_of(state)
        steps = state["steps"]
        if not isinstance(steps, dict) or not all(isinstance(k, str) and isinstance(v, int) and v >= 0
                                                  and not isinstance(v, bool) for k, v in steps.items()):
            raise ValueError("gradpress state: steps must map each key to an integer >= 0")
        choice = section.get("choice")
        if not isinstance(choice, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in choice.items()):
            raise ValueError("gradpress state: auto.choice must map keys to specs")
        outside = sorted({v for v in choice.values() if v not in self.names})
        if outside:
            raise ValueError(f"gradpress state: auto.choice uses {', '.join(map(repr, outside))}, not among "
                             f"this runtime's candidates {list(self.names)}")
        _check_keyed("auto.flush", {"flush": section.get("flush", {})}, shapes)
        for name in ("decided_at", "next_decision"):
            given = section.get(name)
            if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 0):
                raise ValueError(f"gradpress state: auto.{name} must be a step (an integer >= 0) or None")
        return section, shapes

    def _loaded_pipelines(self, saved: Any) -> dict[str, Pipeline]:
        """A fresh pipeline per method of ``saved`` (the section's ``"pipelines"``), each loaded from its
        state (checked by :meth:`gradpress.exchange.pipeline.Pipeline.load_state_dict`: ``ValueError``)."""
        if not isinstance(saved, dict) or not all(isinstance(s, str) for s in saved):
            raise ValueError("gradpress state: auto.pipelines must map specs to pipeline states")
        pipelines = {}
        for spec, sub in saved.items():
            if spec not in self.names:
                raise ValueError(f"gradpress state: auto.pipelines holds {spec!r}, not among this runtime's "
                                 f"candidates {list(self.names)}")
            pipeline = self._fresh(spec)
            pipeline.stats = Stats()  # (the statistics are this state's own, loaded below)
            pipeline.load_state_dict(_without_stats(sub))  # checked (gradpress.exchange.state.check): ValueError
            pipelines[spec] = pipeline
        return pipelines


def _without_stats(state: Any) -> Any:
    """A method's pipeline state without its statistics (they are the ``"auto"`` state's, shared)."""
    return {k: v for k, v in state.items() if k != "stats"} if isinstance(state, dict) else state


def _plain(value: Any) -> Any:
    """``value`` with inf as None (a state dict of plain values)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
