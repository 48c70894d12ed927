"""The decision: a pure function of a profile and the candidates' measured costs (:func:`choose`), and
how rank 0 makes it at a decision point and every rank follows it (:class:`Decider`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from gradpress.auto.measure import Recorder
from gradpress.auto.options import DECIDED, FALLBACK_LATENCY, KEPT, NEED_GRADIENTS, UNCOMPRESSED
from gradpress.exchange.protocol import Broadcast, Protocol, Round

if TYPE_CHECKING:
    from gradpress.costmodel import ComputeProfile, MethodCost


@dataclass(frozen=True)
class Decision:
    """What :func:`choose` decided: a spec per bucket, the predicted step with it (``predicted_s``), with
    every bucket uncompressed (``uncompressed_s``), with the methods in use before (``current_s``), with
    each bucket alone uncompressed (``bucket_uncompressed_s``), and with each candidate on every bucket
    (``uniform_s``)."""

    specs: tuple[str, ...]
    predicted_s: float
    uncompressed_s: float
    current_s: float
    bucket_uncompressed_s: tuple[float, ...]
    uniform_s: dict[str, float] = field(default_factory=dict)


def _mixed(by_spec: Mapping[str, MethodCost], specs: Sequence[str], n: int) -> MethodCost:
    """One bucket's cost of each bucket's method (decoding already scaled to ``n`` workers)."""
    from gradpress.costmodel import BucketCost, MethodCost

    buckets = []
    for b, spec in enumerate(specs):
        cost = by_spec[spec]
        c = cost.buckets[b]
        buckets.append(BucketCost(c.compress_s, cost.decompress_at(c, n), c.packet_bytes, c.transfers))
    return MethodCost("+".join(sorted(set(specs))), "mixed", "mixed", tuple(buckets), measured_workers=1)


def choose(profile: ComputeProfile, costs: Sequence[MethodCost], *, n: int, bandwidth: float | str,
           latency: float = FALLBACK_LATENCY, current: Sequence[str] | None = None,
           margin: float = 0.05, passes: int = 2) -> Decision:
    """The methods per bucket for the shortest predicted step (:func:`gradpress.costmodel.predict`)
    among ``n`` workers on a link of ``bandwidth`` bits/s and ``latency`` s per message.

    Starts from the best single method, then changes one bucket's method at a time while that shortens
    the prediction (``passes`` rounds over the buckets). ``current`` (a spec per bucket; default: every
    bucket ``none``) is kept unless the best is predicted faster by more than ``margin`` of its step
    (timings on a shared machine vary: a switch must pay clearly). ``costs`` must include ``none``."""
    from gradpress.costmodel import predict

    by_spec = {c.spec: c for c in costs}
    if UNCOMPRESSED not in by_spec:
        raise ValueError(f"choose needs the cost of {UNCOMPRESSED!r} (the reference)")
    nb = len(profile.buckets)
    for cost in costs:
        if len(cost.buckets) != nb:
            raise ValueError(f"{cost.spec}: costs of {len(cost.buckets)} buckets for a profile of {nb}")

    def step_of(specs: Sequence[str]) -> float:
        return predict(profile, _mixed(by_spec, specs, n), n=n, bandwidth=bandwidth, latency=latency).total

    uniform = {spec: step_of([spec] * nb) for spec in by_spec}
    best_spec = min(uniform, key=lambda s: (uniform[s], s != UNCOMPRESSED))
    best, best_s = [best_spec] * nb, uniform[best_spec]
    for _ in range(passes):
        improved = False
        for b in range(nb):
            for spec in by_spec:
                if spec == best[b]:
                    continue
                trial = [*best[:b], spec, *best[b + 1:]]
                seconds = step_of(trial)
                if seconds < best_s * (1 - 1e-9):
                    best, best_s, improved = trial, seconds, True
        if not improved:
            break
    now = [s if s in by_spec else UNCOMPRESSED for s in current] if current is not None else [UNCOMPRESSED] * nb
    if len(now) != nb:
        now = [UNCOMPRESSED] * nb
    current_s = step_of(now)
    if not best_s < current_s * (1 - margin):
        best, best_s = now, current_s
    alone = tuple(step_of([*best[:b], UNCOMPRESSED, *best[b + 1:]]) for b in range(nb))
    return Decision(tuple(best), best_s, uniform[UNCOMPRESSED], current_s, alone, uniform)


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
        """Each candidate's cost on the captured gradients (rank 0), as ``advise`` measures it."""
        from gradpress.costmodel import measure_method

        grads = self._captured or {}
        costs, skipped = {}, {}
        for spec in self.auto.candidates:
            try:
                self.pipeline(spec)  # a method these options cannot run (a mode it lacks) is left out
                costs[spec] = measure_method(spec, profile, [grads, grads], repeats=2, seed=self.options.seed)
            except Exception as error:  # noqa: BLE001 - one method that fails is left out, with its reason
                skipped[spec] = f"{type(error).__name__}: {error}"[:200]
        return costs, skipped

    def _payload(self, layout: tuple[tuple[str, ...], ...], status: float, decision: Decision | None = None,
                 link: tuple[float, float] = (0.0, 0.0), compute: float = 0.0) -> torch.Tensor:
        """What rank 0 broadcasts: [candidate index per bucket, predicted step with each bucket alone
        uncompressed, predicted step, uncompressed step, α, seconds per byte, compute, status]."""
        nb = len(layout)
        if decision is None:
            specs = [self.choice.get(keys[0], UNCOMPRESSED) if keys else UNCOMPRESSED for keys in layout]
            alone, predicted, uncompressed = [0.0] * nb, 0.0, 0.0
        else:
            specs, alone = list(decision.specs), list(decision.bucket_uncompressed_s)
            predicted, uncompressed = decision.predicted_s, decision.uncompressed_s
        indices = [float(self.auto.candidates.index(s)) if s in self.auto.candidates else 0.0 for s in specs]
        alpha, bandwidth = link
        per_byte = 8.0 / bandwidth if bandwidth > 0 else 0.0
        return torch.tensor([*indices, *alone, predicted, uncompressed, alpha, per_byte, compute, status],
                            dtype=torch.float64)

    def _rank0_payload(self, layout: tuple[tuple[str, ...], ...]) -> torch.Tensor:
        current = [self.choice.get(keys[0], UNCOMPRESSED) if keys else UNCOMPRESSED for keys in layout]
        link = self._link()
        profile = self.profile(layout)
        compute = profile.forward_s + profile.backward_s
        if self._costs is None or self._costs_layout != layout:
            captured = self._captured
            self._captured, self._costs = None, None
            if captured is None or not all(k in captured for keys in layout for k in keys):
                return self._payload(layout, NEED_GRADIENTS, link=link, compute=compute)
            self._captured = captured
            self._costs, self.skipped = self._measure(profile)
            self._costs_layout, self._captured = layout, None
        if UNCOMPRESSED not in self._costs:
            return self._payload(layout, KEPT, link=link, compute=compute)
        decision = choose(profile, list(self._costs.values()), n=self.world_size, bandwidth=link[1],
                          latency=link[0], current=current, margin=self.auto.margin)
        return self._payload(layout, DECIDED, decision, link, compute)

    def _apply(self, payload: torch.Tensor, layout: tuple[tuple[str, ...], ...], step: int) -> None:
        """Every rank: follow rank 0's choice from now on, moving the memory of every key that changes
        method (module docstring), and keep the reasons for :meth:`report`."""
        nb = len(layout)
        values = payload.tolist()
        specs = [self.auto.candidates[int(round(v))] for v in values[:nb]]
        alone = values[nb:2 * nb]
        predicted, uncompressed, alpha, per_byte, compute, status = values[2 * nb:]
        if status == NEED_GRADIENTS:  # rank 0 has no costs yet: it keeps this step's gradients, decides next
            self.next_decision = step + 1
            return
        for keys, spec in zip(layout, specs, strict=True):
            for key in keys:
                self._switch(key, self.choice.get(key, UNCOMPRESSED), spec)
        self.decided_at = step
        self.next_decision = step + self.auto.recheck_every if self.auto.recheck_every else math.inf
        decided = status == DECIDED
        self.why = {
            "decided": decided,
            "predicted_s": {"chosen": predicted, UNCOMPRESSED: uncompressed} if decided else {},
            "link": {"seconds_per_byte": per_byte, "latency_s": alpha,
                     "bits_per_second": 8.0 / per_byte if per_byte > 0 else math.inf},
            "compute_s": compute,
            "buckets": [{"keys": list(keys), "spec": spec,
                         "predicted_s": {"chosen": predicted, UNCOMPRESSED: a} if decided else {}}
                        for keys, spec, a in zip(layout, specs, alone, strict=True)],
        }
