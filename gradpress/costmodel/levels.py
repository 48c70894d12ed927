"""A step whose buckets each run a method of their own, flat or in two levels: what ``auto`` ranks on
several nodes (:mod:`gradpress.auto`).

:func:`level_steps` prices one method's buckets on one level (:meth:`MethodCost.node_steps` on the
topology, flat or ``hierarchical``; on one node, :meth:`MethodCost.steps` on a star of n links), and
:func:`predict_levels` puts a bucket of each, with its level, through the bucketed overlap model of
:func:`~gradpress.costmodel.predict_bucketed_step` (one link a node: the buckets' exchanges queue on
it whichever level they run; no token bucket). With every bucket on one level it is
:func:`~gradpress.costmodel.predict` on that topology, bucket for bucket.
"""
from __future__ import annotations

from typing import Sequence

from gradpress.costmodel.method import MethodCost
from gradpress.costmodel.network import (
    DEFAULT_LATENCY,
    Breakdown,
    BucketStep,
    _overlapped_step,
    _transfer,
)
from gradpress.costmodel.nodes import Topology
from gradpress.costmodel.profile import ComputeProfile


def level_steps(profile: ComputeProfile, cost: MethodCost, n: int, topology: Topology | None,
                hierarchical: bool) -> list[BucketStep]:
    """``cost``'s buckets as the overlap model takes them among ``n`` ranks: on ``topology`` flat or
    in two levels (``hierarchical``), or on a star of n links without a topology (one level only)."""
    if topology is None:
        if hierarchical:
            raise ValueError("a two-level exchange needs the topology of its nodes")
        return cost.steps(profile, n)
    return cost.node_steps(profile, topology.two_level() if hierarchical else topology.flat())


def predict_levels(profile: ComputeProfile, steps: Sequence[BucketStep], hierarchical: Sequence[bool], *,
                   n: int, bandwidth: float | str, latency: float = DEFAULT_LATENCY,
                   topology: Topology | None = None) -> Breakdown:
    """The step of buckets ``steps`` (bucket b's, from :func:`level_steps` of its method and level),
    bucket b's exchange flat or in two levels by ``hierarchical[b]``, among ``n`` ranks on ``topology``
    (None: a star of n links, one level), a link of ``bandwidth`` a node, ``latency`` per message."""
    if len(steps) != len(hierarchical) or len(steps) != len(profile.buckets):
        raise ValueError(f"{len(steps)} bucket steps and {len(hierarchical)} levels for a profile of "
                         f"{len(profile.buckets)} buckets")
    if topology is None and any(hierarchical):
        raise ValueError("a two-level exchange needs the topology of its nodes")
    flat = _transfer(n, None if topology is None else topology.flat())
    nodes = _transfer(n, topology.two_level()) if topology is not None else flat
    level = {id(step): two for step, two in zip(steps, hierarchical, strict=True)}

    def exchange(bucket: BucketStep, tokens: float) -> tuple[float, float]:
        transfer = nodes if level[id(bucket)] else flat
        return transfer(bucket.phases, bandwidth, latency, tokens, None, bucket.nbytes)

    return _overlapped_step(profile.forward_s, profile.backward_s, profile.optimizer_s, list(steps), exchange,
                            lambda tokens, idle_s: 0.0, 0.0)[0]


def priced_steps(profile: ComputeProfile, costs: Sequence[MethodCost], n: int,
                 topology: Topology | None) -> dict[tuple[str, bool], list[BucketStep]]:
    """Every method's buckets on every level the topology has: (spec, two-level) -> bucket steps."""
    levels = (False, True) if topology is not None and topology.nodes > 1 and topology.local_size > 1 \
        else (False,)
    return {(cost.spec, two): level_steps(profile, cost, n, topology, two) for cost in costs for two in levels}


__all__ = ["level_steps", "predict_levels", "priced_steps"]
