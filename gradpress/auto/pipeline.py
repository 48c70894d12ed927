"""The pipeline front ends drive with spec ``"auto"`` (:class:`AutoPipeline`, see :mod:`gradpress.auto`)."""
from __future__ import annotations

import math
import time
from typing import Any, Sequence

import torch

from gradpress.auto.decision import Decider
from gradpress.auto.measure import _BucketRecord
from gradpress.auto.options import AUTO, NODE, UNCOMPRESSED
from gradpress.auto.state import AutoState
from gradpress.exchange.pipeline import Group
from gradpress.exchange.protocol import AllReduce, Protocol, Round

#: what exchanges the exact average (the signal fraction reads it where the last measured step ran one)
EXACT = (UNCOMPRESSED, UNCOMPRESSED + NODE)
#: the probe of the last measured step: every this many values of each gradient, summed uncompressed
PROBE_STRIDE = 8


class AutoPipeline(Decider, AutoState):
    """A pipeline per candidate (built when first chosen) behind :class:`gradpress.exchange.pipeline.Pipeline`'s
    interface (``agreement``, ``groups``, ``stats``, ``report``, ``state_dict``): every key goes to its
    chosen method's pipeline, and the decisions are made as the module docstring says. The pipelines
    share the step counters, shapes and statistics."""

    spec = AUTO
    compressor = None

    # -- the interface the front ends drive -----------------------------------------------------------
    def agreement(self, items: Sequence[tuple[str, torch.Tensor]]) -> Group | None:
        """The control exchange before these items' exchange: at a decision point, rank 0's choice
        (broadcast) then the chosen pipelines' agreement; otherwise their agreement the first time
        (:meth:`gradpress.exchange.pipeline.Pipeline.agreement`), or None."""
        step = max((self.steps.get(key, 0) for key, _ in items), default=0)
        new = step > self._current_step
        if new:
            self._begin(step)
        if new and step >= self.next_decision:
            if any(r.gap is not None for r in self._records):
                device = items[0][1].device if items else torch.device("cpu")
                return Group([], self._decide(items, step, device), step)
            self.next_decision = step + self.auto.measure_steps  # (after a resume: nothing measured yet)
        protocols = []
        for spec, positions in self._split(items):
            group = self.pipeline(spec).agreement([items[i] for i in positions], self._agreed_on(spec))
            if group is not None:
                protocols.append(group.protocol)
        return Group([], _chain(protocols), step) if protocols else None

    def _capture(self, step: int, items: Sequence[tuple[str, torch.Tensor]], exact: bool) -> list[float] | None:
        """Rank 0, before a decision that measures: this worker's gradients of the step before it (the
        candidates are measured on them) and of the step before that, and the squared norm of the first's
        exact average over the ranks (``exact``: these items are exchanged uncompressed): the signal
        fraction of the quality model is read from them (:meth:`_signal_fraction`). Returns the tally of
        ‖average‖² that these items' exchange adds to, or None."""
        measuring = self._costs is None or self._captured is not None
        if step == self.next_decision - 2 and self._costs is None:
            earlier = self._earlier if self._earlier is not None and self._earlier[0] == step else (step, {})
            earlier[1].update((key, tensor.detach().clone()) for key, tensor in items)
            self._earlier = earlier
        elif step == self.next_decision - 1 and measuring:
            captured = self._captured = self._captured or {}
            for key, tensor in items:
                captured[key] = tensor.detach().clone()
            if self._earlier is not None and self._earlier[0] != step - 1:
                self._earlier = None  # (not the step just before: no pair to read the signal from)
            if self._mean is None or self._mean[0] != step:
                self._mean = (step, [0.0])
            if not exact:
                self._mean = (step, None)
            return self._mean[1]
        return None

    def groups(self, items: Sequence[tuple[str, torch.Tensor]], bucket: torch.Tensor | None = None,
               writable: bool = False) -> list[Group]:
        """:meth:`gradpress.exchange.pipeline.Pipeline.groups`, each key by its chosen method's pipeline."""
        start = time.perf_counter()
        for key, tensor in items:
            expected = self._expected_shapes.pop(key, None)
            if expected is not None and expected != tuple(tensor.shape):
                raise ValueError(f"{key!r} has shape {tuple(tensor.shape)}; the loaded gradpress state was "
                                 f"saved for {expected}")
        step = max((self.steps.get(key, 0) for key, _ in items), default=0)
        split = self._split(items)
        sample = self._sample(items, step)
        tally = None
        if self.rank == 0:
            tally = self._capture(step, items, sample is not None or all(spec in EXACT for spec, _ in split))
        writable = writable or bucket is not None
        items = list(items)
        for i, (key, tensor) in enumerate(items):
            pending = self._flush.pop(key, None)
            if pending is not None:  # a residual left by a method without memory: sent once, now
                if writable:
                    tensor.add_(pending.to(tensor.device))
                else:
                    items[i] = (key, (tensor + pending.to(tensor.device)).to(tensor.dtype))
        record = _BucketRecord(tuple(key for key, _ in items),
                               sum(t.numel() for _, t in items), sum(t.numel() * t.element_size() for _, t in items),
                               start)
        if self._records and self._records[-1].step == self._current_step:
            self._records[-1].buckets.append(record)
        out = []
        for spec, positions in split:
            chosen = [items[i] for i in positions]
            for group in self.pipeline(spec).groups(chosen, bucket=bucket if len(split) == 1 else None,
                                                    writable=writable):
                out.append(Group([positions[i] for i in group.members],
                                 self._timed(group.protocol, record, tally if sample is None else None),
                                 group.step, group.flat))
        if sample is not None:
            numel = sum(t.numel() for _, t in items)
            out.append(Group([], self._timed(self._probe(sample, numel, tally), record), step))
        return out

    def _sample(self, items: Sequence[tuple[str, torch.Tensor]], step: int) -> torch.Tensor | None:
        """At the last measured step before the first decision, when the measured steps are compressed:
        every :data:`PROBE_STRIDE`-th value of these gradients (from position ``step`` mod the stride:
        the same on every rank), float32, taken before the exchange may overwrite them; else None."""
        if self.decided_at is not None or step != self.next_decision - 1 or self.measuring[0] in EXACT:
            return None
        offset = step % PROBE_STRIDE
        parts = [t.detach().reshape(-1)[offset::PROBE_STRIDE].float() for _, t in items]
        return torch.cat(parts) if parts and sum(p.numel() for p in parts) else None

    def _probe(self, sample: torch.Tensor, numel: int, tally: list[float] | None) -> Protocol:
        """One uncompressed all-reduce of ``sample`` (of a bucket of ``numel`` values), which the link's
        fit times: transfers within a token bucket's burst (the measured steps' compressed packets) do
        not tell the sustained rate, an eighth of the gradient beyond it does. ``tally``: rank 0 adds
        ‖average‖² of the whole bucket, estimated as numel / len(sample) times the sample's (the signal
        fraction's estimate from the exact average, :meth:`_signal_fraction`). Returns no averages."""
        from gradpress.costmodel.quality import squares

        (summed,) = yield Round([AllReduce(sample)], final=True)
        if tally is not None:
            tally[0] += squares(summed / self.world_size) * numel / sample.numel()
        return []

    def report(self) -> dict[str, Any]:
        """The statistics of :class:`gradpress.exchange.pipeline.Stats`, and ``"auto"``: what was chosen and why."""
        used = {spec: self.pipeline(spec).strategy.pattern for spec in self._in_use()}
        pattern = "auto: " + ", ".join(f"{spec} {p}" for spec, p in used.items())
        report = self.stats.report(pattern)
        report["auto"] = self._explain()
        return report

    def _explain(self) -> dict[str, Any]:
        phase = "measuring" if self.decided_at is None else "decided"
        explained = {"phase": phase, "decided_at": self.decided_at,
                     "next_check": None if math.isinf(self.next_decision) else int(self.next_decision),
                     "candidates": list(self.auto.candidates), **self.why}
        if self.skipped:
            explained["skipped"] = dict(self.skipped)
        if self.error:
            explained["error"] = self.error
        explained["reason"] = self._reason(explained)
        return explained

    def _reason(self, explained: dict[str, Any]) -> str:
        if explained["phase"] == "measuring":
            return (f"measuring with {self.measuring[0]} until step {explained['next_check']} "
                    f"(from step {self.auto.settle_steps}, {self.auto.measure_steps} steps)")
        buckets = explained.get("buckets") or []
        link = explained.get("link") or {}
        predicted = explained.get("predicted_s") or {}
        counts: dict[str, int] = {}
        for b in buckets:
            counts[b["spec"]] = counts.get(b["spec"], 0) + 1
        chosen = ", ".join(f"{spec} on {count} of {len(buckets)} bucket{'s' if len(buckets) > 1 else ''}"
                           for spec, count in counts.items()) or UNCOMPRESSED
        if not explained.get("decided"):
            return f"kept {chosen} at step {explained['decided_at']}: no candidate costs to decide with"
        factor = _number(explained.get("steps_factor", 1.0))
        quality = (f", ×{factor:.2f} the steps to a quality target" if explained.get("rank_by") == "quality"
                   else " (ranked by step time)")
        inside = ""
        if "intra_bits_per_second" in link:
            inside = f", {_number(link['intra_bits_per_second']) / 1e9:.1f} Gbit/s inside a node"
        return (f"{chosen} at step {explained['decided_at']}: predicted step "
                f"{_number(predicted.get('chosen')) * 1e3:.2f} ms{quality}, against "
                f"{_number(predicted.get(UNCOMPRESSED)) * 1e3:.2f} ms uncompressed (link "
                f"{_number(link.get('bits_per_second')) / 1e6:.0f} Mbit/s{inside}, "
                f"{_number(link.get('latency_s')) * 1e6:.0f} µs per message; compute "
                f"{_number(explained.get('compute_s')) * 1e3:.2f} ms)")


def _chain(protocols: Sequence[Protocol]) -> Protocol:
    for protocol in protocols:
        yield from protocol


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
