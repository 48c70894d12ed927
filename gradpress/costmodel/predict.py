"""A method's predicted step on a network: the bucketed α–β model
(:func:`~gradpress.costmodel.network.predict_bucketed_step`) fed with a compute profile and the method's
measured costs."""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from gradpress.costmodel import network as costmodel
from gradpress.costmodel.method import MethodCost
from gradpress.costmodel.network import Breakdown
from gradpress.costmodel.nodes import Topology
from gradpress.costmodel.profile import ComputeProfile


def predict(profile: ComputeProfile, cost: MethodCost, *, n: int, bandwidth: float | str,
            latency: float = costmodel.DEFAULT_LATENCY, burst: float = 0.0,
            efficiency: Mapping[str, float] | None = None, topology: Topology | None = None) -> Breakdown:
    """``cost``'s step among ``n`` workers at ``bandwidth`` (bits/s or a tc rate):
    :func:`~gradpress.costmodel.predict_bucketed_step` on the profile's buckets, through a link
    with a token bucket of ``burst`` bytes and ``efficiency`` per strategy (both off by default); with
    the method's real local step where one was measured (:func:`calibrated`). ``topology``: the n
    workers on N nodes of k, flat or in two levels (:meth:`MethodCost.node_steps`, a link of
    ``bandwidth`` per node; :mod:`~gradpress.costmodel.nodes`); None: a star of n links."""
    profile, cost, rest = calibrated(profile, cost)
    steps = cost.steps(profile, n) if topology is None else cost.node_steps(profile, topology)
    return costmodel.predict_bucketed_step(profile.forward_s, profile.backward_s, steps,
                                           n=n, bandwidth=bandwidth, latency=latency,
                                           optimizer_s=profile.optimizer_s + rest, burst=burst,
                                           efficiency=efficiency, topology=topology)


def calibrated(profile: ComputeProfile, cost: MethodCost) -> tuple[ComputeProfile, MethodCost, float]:
    """The profile and costs to price ``cost`` with, and seconds per step the model adds after the
    backward pass. Without a local step: as measured, and nothing added.

    With one (``advise --local-workers K``: the method's real DDP step among K processes of this machine
    over loopback, :class:`~gradpress.costmodel.method.LocalStep`), the host's parts of the step are
    taken from it and only the link is modelled: the compute is the local step's (the profile scaled to
    it, ready times included), each bucket's compression and decoding are scaled so that their sum among
    K workers is the local step's, and the rest of the local step — the time outside compute, compression
    and the loopback's collectives: the hook's own work, its hand-offs between threads, the batch — is
    added once per step. Where the workers share one machine, as ``compare``'s do, what they do to each
    other's compute and compression is measured rather than assumed (a kernel timed alone on an idle core
    runs faster than beside another worker)."""
    local = cost.local
    if local is None:
        return profile, cost, 0.0
    modeled = cost.compression_at(local.workers)
    factor = local.compression_s / modeled if modeled > 0 else 1.0
    rest = local.rest_s + (local.compression_s if modeled <= 0 else 0.0)
    return profile.scaled(local.compute_s), replace(cost.scaled(factor), local=None), rest
