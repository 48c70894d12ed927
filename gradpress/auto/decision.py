"""The decision: how rank 0 makes it at a decision point (:func:`~gradpress.auto.ranking.choose`, a pure
function of a profile, the candidates' measured costs and compression errors) and every rank follows
it (:class:`Decider`)."""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from gradpress.auto.measure import Recorder
from gradpress.auto.options import DECIDED, KEPT, NEED_GRADIENTS, UNCOMPRESSED, level_of
from gradpress.auto.ranking import Decision, choose
from gradpress.exchange.protocol import Broadcast, Protocol, Round

if TYPE_CHECKING:
    from gradpress.costmodel import ComputeProfile, Topology

__all__ = ["Decision", "choose", "Decider"]


class Decider(Recorder):
    """The decision points of :class:`~gradpress.auto.AutoPipeline`: rank 0 measures the candidates on
    the captured gradients and decides (:func:`choose`), broadcasts the choice, and every rank applies
    it at the same point."""

    def _decide(self, items: Sequence[tuple[str, torch.Tensor]], step: int, device: torch.device) -> Protocol:
        """Rank 0's choice, broadcast (every rank applies it at the same point); then the chosen
        pipelines' agreement on these items."""
        layout = self._layout()
        payload = self._payload(layout, NEED_GRADIENTS)
        if self.rank == 0:
            try:
                payload = self._rank0_payload(layout)
            except Exception as error:  # noqa: BLE001 - the others wait in the broadcast: never leave them
                self.error = f"{type(error).__name__}: {error}"[:300]
                payload = self._payload(layout, KEPT)
        (received,) = yield Round([Broadcast(payload.to(device), 0)], long_wait=True)  # (rank 0 measured)
        self._apply(received.cpu(), layout, step)
        if self._records:  # this step's buckets are timed from now, not from before the decision
            self._records[-1].first = time.perf_counter()
        for spec, positions in self._split(items):
            group = self.pipeline(spec).agreement([items[i] for i in positions], self._agreed_on(spec))
            if group is not None:
                yield from group.protocol

    def _measure(self, profile: ComputeProfile) -> tuple[dict[str, Any], dict[str, str]]:
        """Each candidate's cost on the captured gradients (rank 0), as ``advise`` measures it, and
        (``rank_by="quality"``) its compression error on each bucket (kept in ``_errors``)."""
        from gradpress.costmodel import measure_with_errors

        grads = self._captured or {}
        costs, skipped, errors = {}, {}, {}
        for spec in self.auto.candidates:
            try:
                self.pipeline(spec)  # a method these options cannot run (a mode it lacks) is left out
                costs[spec], errors[spec] = measure_with_errors(spec, profile, grads, workers=self.world_size,
                                                                seed=self.options.seed, feedback=self.options.feedback)
            except Exception as error:  # noqa: BLE001 - one method that fails is left out, with its reason
                costs.pop(spec, None)
                errors.pop(spec, None)
                skipped[spec] = f"{type(error).__name__}: {error}"[:200]
        self._errors = errors if self.auto.rank_by == "quality" else None
        self._signal = self._signal_fraction(grads)
        self._earlier, self._mean = None, None
        return costs, skipped

    def _signal_fraction(self, grads: dict[str, torch.Tensor]) -> float:
        """ρ of the quality model (rank 0): the mean of its estimates from the captured step's gradient and
        the exact average of the ranks' (:func:`~gradpress.costmodel.signal_fraction_of_mean`) and from
        the captured step's and the step before's gradients (:func:`~gradpress.costmodel.signal_fraction`),
        where they were kept; 0 without either."""
        from gradpress.costmodel import signal_fraction, signal_fraction_of_mean
        from gradpress.costmodel.quality import squares

        estimates = []
        mean = self._mean[1] if self._mean is not None else None
        if mean is not None and self.world_size > 1:
            own = sum(squares(t) for t in grads.values())
            estimates.append(signal_fraction_of_mean(own, mean[0], self.world_size))
        if self._earlier is not None:
            estimates.append(signal_fraction(self._earlier[1], grads))
        return sum(estimates) / len(estimates) if estimates else 0.0

    def _payload(self, layout: tuple[tuple[str, ...], ...], status: float, decision: Decision | None = None,
                 link: tuple[float, float] = (0.0, 0.0), compute: float = 0.0, intra: float = 0.0) -> torch.Tensor:
        """What rank 0 broadcasts: [name index per bucket (:attr:`names`), predicted step with each
        bucket alone uncompressed, with each bucket's method flat, in two levels, predicted step,
        uncompressed step, α, seconds per byte, compute, seconds per byte inside a node, steps factor,
        status]."""
        nb = len(layout)
        flat, node = [0.0] * nb, [0.0] * nb
        if decision is None:
            specs = [self.choice.get(keys[0], UNCOMPRESSED) if keys else UNCOMPRESSED for keys in layout]
            alone, predicted, uncompressed, factor = [0.0] * nb, 0.0, 0.0, 1.0
        else:
            specs, alone = list(decision.specs), list(decision.bucket_uncompressed_s)
            predicted, uncompressed, factor = decision.predicted_s, decision.uncompressed_s, decision.factor
            if decision.levels_s:
                flat, node = [f for f, _ in decision.levels_s], [t for _, t in decision.levels_s]
        indices = [float(self.names.index(s)) if s in self.names else 0.0 for s in specs]
        alpha, bandwidth = link
        per_byte = 8.0 / bandwidth if bandwidth > 0 else 0.0
        intra_per_byte = 8.0 / intra if intra > 0 else 0.0
        return torch.tensor([*indices, *alone, *flat, *node, predicted, uncompressed, alpha, per_byte, compute,
                             intra_per_byte, factor, status], dtype=torch.float64)

    def _topology(self, intra: float) -> Topology | None:
        from gradpress.costmodel import Topology

        if self.layout is None:
            return None
        return Topology(self.layout.nodes, self.layout.local_size, intra)

    def _rank0_payload(self, layout: tuple[tuple[str, ...], ...]) -> torch.Tensor:
        current = [self.choice.get(keys[0], UNCOMPRESSED) if keys else UNCOMPRESSED for keys in layout]
        link = self._link()
        intra = self._intra_link() if self.layout is not None else 0.0
        profile = self.profile(layout)
        compute = profile.forward_s + profile.backward_s
        if self._costs is None or self._costs_layout != layout:
            captured = self._captured
            self._captured, self._costs = None, None
            if captured is None or not all(k in captured for keys in layout for k in keys):
                return self._payload(layout, NEED_GRADIENTS, link=link, compute=compute, intra=intra)
            self._captured = captured
            self._costs, self.skipped = self._measure(profile)
            self._costs_layout, self._captured = layout, None
        if UNCOMPRESSED not in self._costs:
            return self._payload(layout, KEPT, link=link, compute=compute, intra=intra)
        decision = choose(profile, list(self._costs.values()), n=self.world_size, bandwidth=link[1],
                          latency=link[0], current=current, margin=self.auto.margin, errors=self._errors,
                          topology=self._topology(intra), levels=self.levels, signal=self._signal)
        return self._payload(layout, DECIDED, decision, link, compute, intra)

    def _apply(self, payload: torch.Tensor, layout: tuple[tuple[str, ...], ...], step: int) -> None:
        """Every rank: follow rank 0's choice from now on, moving the memory of every key that changes
        method (module docstring), and keep the reasons for :meth:`report`."""
        nb = len(layout)
        values = payload.tolist()
        specs = [self.names[int(round(v))] for v in values[:nb]]
        alone, flat, node = values[nb:2 * nb], values[2 * nb:3 * nb], values[3 * nb:4 * nb]
        predicted, uncompressed, alpha, per_byte, compute, intra_per_byte, factor, status = values[4 * nb:]
        if status == NEED_GRADIENTS:  # rank 0 has no costs yet: it keeps this step's gradients, decides next
            self.next_decision = step + 1
            return
        for keys, spec in zip(layout, specs, strict=True):
            for key in keys:
                self._switch(key, self.choice.get(key) or self._default(), spec)
        self.decided_at = step
        self.next_decision = step + self.auto.recheck_every if self.auto.recheck_every else math.inf
        decided = status == DECIDED
        link = {"seconds_per_byte": per_byte, "latency_s": alpha,
                "bits_per_second": 8.0 / per_byte if per_byte > 0 else math.inf}
        if self.layout is not None:
            link["intra_bits_per_second"] = 8.0 / intra_per_byte if intra_per_byte > 0 else math.inf
        buckets = []
        for keys, spec, a, f, t in zip(layout, specs, alone, flat, node, strict=True):
            bucket = {"keys": list(keys), "spec": spec,
                      "predicted_s": {"chosen": predicted, UNCOMPRESSED: a} if decided else {}}
            if self.layout is not None:
                bucket["level"] = "two levels" if level_of(spec) else "flat"
                bucket["levels_s"] = {"flat": f, "two levels": t} if decided else {}
            buckets.append(bucket)
        self.why = {
            "decided": decided, "rank_by": self.auto.rank_by,
            "predicted_s": {"chosen": predicted, UNCOMPRESSED: uncompressed} if decided else {},
            "steps_factor": factor if decided else 1.0,
            "link": link, "compute_s": compute, "buckets": buckets,
        }
