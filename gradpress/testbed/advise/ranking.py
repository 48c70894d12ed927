"""Prediction and ranking, pure functions of the profile and the candidates' costs (see
:mod:`gradpress.testbed.advise`): the bucketed α–β step, the ranking at one link speed, where a method
stops paying; on N nodes of k ranks, each method flat and in two levels (``SPEC@node``)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from gradpress import costmodel
from gradpress.costmodel import Breakdown, Topology
from gradpress.costmodel.method import BASELINE, MethodCost, baseline_cost
from gradpress.costmodel.predict import predict
from gradpress.testbed.advise.profile import ComputeProfile
from gradpress.testbed.advise.quality import QUALITY_REFERENCE
from gradpress.testbed.results import HIERARCHICAL as NODE

#: where crossings are searched (bits/s)
CROSSING_RANGE = (1e6, 1e12)


@dataclass(frozen=True)
class Ranked:
    """One method's place at one link speed. ``speedup``: ``torch-allreduce``'s predicted step over this
    one's (the ratio of samples/s); with quality, ``steps_to_target`` × the step is ``time_to_target_s``.
    ``wire_bytes``: bytes per step through each worker's link, or on N nodes through a node's link;
    ``packet_bytes``: ``Packet.nbytes`` a rank hands its exchange per step (in two levels, its shard's).
    ``hierarchy``: ``"node"`` for the two-level exchange (``spec`` ends in ``@node``), else None."""

    spec: str
    workers: int
    bandwidth: str
    predicted: Breakdown
    speedup: float
    wire_bytes: float
    packet_bytes: float
    steps_to_target: float | None = None
    time_to_target_s: float | None = None
    speedup_time_to_target: float | None = None
    rank: int = 0
    hierarchy: str | None = None


def variants(costs: Sequence[MethodCost], topology: Topology | None,
             baseline: MethodCost) -> list[tuple[str, MethodCost, Topology | None]]:
    """What is ranked: (label, cost, topology) for ``torch-allreduce`` and every method of ``costs``;
    on ``topology``'s nodes each method also in two levels, labelled ``SPEC@node`` (PyTorch's
    all-reduce stays flat: its hook has no hierarchy)."""
    methods = [c for c in costs if c.spec != BASELINE]
    if topology is None:
        return [(c.spec, c, None) for c in [baseline, *methods]]
    flat, two = topology.flat(), topology.two_level()
    return [(BASELINE, baseline, flat),
            *[row for c in methods for row in ((c.spec, c, flat), (c.spec + NODE, c, two))]]


def spec_of(label: str) -> str:
    """The method of a ranked label: ``topk@node`` -> ``topk``."""
    return label.removesuffix(NODE)


def _bytes_on_the_link(cost: MethodCost, n: int, topology: Topology | None) -> float:
    return cost.wire_bytes(n) if topology is None else cost.link_bytes(topology)


def _packet_bytes(cost: MethodCost, topology: Topology | None) -> float:
    return cost.packet_bytes / topology.local_size if topology is not None and topology.hierarchical \
        else cost.packet_bytes


def rank(profile: ComputeProfile, costs: Sequence[MethodCost], *, n: int, bandwidth: float | str,
         latency: float = costmodel.DEFAULT_LATENCY,
         steps_to_target: Mapping[str, float | None] | None = None, burst: float = 0.0,
         efficiency: Mapping[str, float] | None = None, baseline: MethodCost | None = None,
         topology: Topology | None = None) -> list[Ranked]:
    """Every method of ``costs`` and ``torch-allreduce``, best first, at ``n`` workers and ``bandwidth``.

    Without ``steps_to_target`` the order is by predicted step time (samples/s). With it (spec → steps
    to the target quality, None where not reached; ``torch-allreduce`` takes ``none``'s when it has no
    entry), by predicted time to target = steps × step; methods that do not reach it (or have no entry)
    come after those that do, by step time. ``baseline``: ``torch-allreduce``'s cost (default: priced
    from the profile, :func:`~gradpress.costmodel.method.baseline_cost`).

    ``topology``: the n workers on N nodes of k ranks (a link of ``bandwidth`` per node;
    :mod:`gradpress.costmodel.nodes`), each method ranked flat and in two levels (:func:`variants`;
    the two-level row takes the method's steps to target, which quality runs measure flat)."""
    base = baseline or baseline_cost(profile)
    link: dict[str, Any] = {"n": n, "bandwidth": bandwidth, "latency": latency, "burst": burst,
                            "efficiency": efficiency}
    steps = dict(steps_to_target or {})
    if steps_to_target is not None and BASELINE not in steps:
        steps[BASELINE] = steps.get(QUALITY_REFERENCE)
    label = bandwidth if isinstance(bandwidth, str) else f"{bandwidth:g}"
    rows = []
    base_s = 0.0
    for name, cost, where in variants(costs, topology, base):
        breakdown = predict(profile, cost, topology=where, **link)
        if name == BASELINE:
            base_s = breakdown.total
        to_target = steps.get(cost.spec) if steps_to_target is not None else None
        to_target_s = None if to_target is None else to_target * breakdown.total
        rows.append(Ranked(name, n, label, breakdown, base_s / breakdown.total,
                           _bytes_on_the_link(cost, n, where), _packet_bytes(cost, where), to_target,
                           to_target_s, hierarchy="node" if where is not None and where.hierarchical else None))
    base_ttt = next((r.time_to_target_s for r in rows if r.spec == BASELINE), None)
    if steps_to_target is not None:
        rows = [replace(r, speedup_time_to_target=base_ttt / r.time_to_target_s
                        if base_ttt and r.time_to_target_s else None) for r in rows]
        ordered = sorted(rows, key=lambda r: (r.time_to_target_s is None, r.time_to_target_s or 0.0,
                                              r.predicted.total))
    else:
        ordered = sorted(rows, key=lambda r: r.predicted.total)
    return [replace(r, rank=i) for i, r in enumerate(ordered, start=1)]


def speedup_at(profile: ComputeProfile, cost: MethodCost, bandwidth: float | str, *, n: int,
               latency: float = costmodel.DEFAULT_LATENCY, baseline: MethodCost | None = None,
               burst: float = 0.0, efficiency: Mapping[str, float] | None = None,
               topology: Topology | None = None) -> float:
    """Predicted samples/s of ``cost`` over ``torch-allreduce``'s at ``bandwidth`` (``topology``: ``cost``
    on those nodes, flat or in two levels; ``torch-allreduce`` flat on them)."""
    base = baseline or baseline_cost(profile)
    common: dict[str, Any] = {"n": n, "bandwidth": bandwidth, "latency": latency, "burst": burst,
                              "efficiency": efficiency}
    flat = None if topology is None else topology.flat()
    return predict(profile, base, topology=flat, **common).total / \
        predict(profile, cost, topology=topology, **common).total


def crossover(profile: ComputeProfile, cost: MethodCost, *, n: int,
              latency: float = costmodel.DEFAULT_LATENCY, baseline: MethodCost | None = None,
              burst: float = 0.0, efficiency: Mapping[str, float] | None = None,
              topology: Topology | None = None) -> float:
    """The link speed (bits/s) above which ``cost``'s predicted step is no shorter than
    ``torch-allreduce``'s (:func:`~gradpress.costmodel.bandwidth_crossing` in
    :data:`CROSSING_RANGE`; inf: it pays at every speed there, 0: at none); ``topology`` as in
    :func:`speedup_at`."""
    base = baseline or baseline_cost(profile)
    link: dict[str, Any] = {"n": n, "latency": latency, "burst": burst, "efficiency": efficiency}
    flat = None if topology is None else topology.flat()
    return costmodel.bandwidth_crossing(
        lambda bw: predict(profile, cost, bandwidth=bw, topology=topology, **link).total,
        lambda bw: predict(profile, base, bandwidth=bw, topology=flat, **link).total,
        low=CROSSING_RANGE[0], high=CROSSING_RANGE[1])


def register_line(spec: str) -> str:
    """What to paste into a DDP training script for ``spec`` (``torch-allreduce``: nothing to change;
    ``SPEC@node``: the two-level exchange)."""
    if spec == BASELINE:
        return "# no compression pays here: keep DDP's built-in all-reduce (no gradpress.register call)"
    if spec.endswith(NODE):
        return f'gradpress.register(model, "{spec_of(spec)}", hierarchy="node")'
    return f'gradpress.register(model, "{spec}")'
