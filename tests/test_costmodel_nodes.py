"""Several nodes in the α–β model (``gradpress.costmodel.nodes``): the reductions to one level (a rank a
node is the star of links bit for bit; one node runs at the rate inside it), hand-computed costs of a
small case, the traffic between nodes flat against two levels, monotonicity in the rate inside a node,
the bucketed prediction with a topology, and the checks of the input."""
from __future__ import annotations

import itertools
import math

import pytest

from gradpress import costmodel as C

MB = 1e6
MBYTE_PER_S = 8e6  # bits/s: one megabyte per second
#: float64's unit roundoff: a sum of a few terms is exact to a few of them
U = 2.0 ** -53


def phase(strategy: str, nbytes: float = MB) -> C.Phase:
    return C.Phase(strategy, nbytes, 2 * nbytes if strategy in C.TWO_WAY else None)


def counts(strategy: str, values=(1, 2, 3, 4, 8, 1024)):
    """Node counts (or ranks a node) a strategy takes: recursive halving and doubling need powers of two."""
    return [v for v in values if strategy not in ("allreduce-rh", "allgather-rd") or not v & (v - 1)]


# -- the reductions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", list(C.STRATEGIES))
def test_one_rank_a_node_is_the_star_of_links_bit_for_bit(strategy):
    """k = 1: flat on N nodes, and in two levels, are the one-level model among N (exactly: the same
    floating-point operations), tokens and efficiency included; the node link carries the star's bytes."""
    efficiency = {strategy: 0.7}
    for nodes in counts(strategy):
        for tokens in (0.0, 0.3 * MB, 50 * MB):
            star = C.transfer_seconds(phase(strategy), nodes, "1gbit", 1e-4, tokens, efficiency)
            for topology in (C.Topology(nodes), C.Topology(nodes, 1, "1mbit", hierarchical=True)):
                got = C.node_transfer_seconds(phase(strategy), topology, "1gbit", 1e-4, tokens, efficiency,
                                              nbytes=7 * MB)
                assert got == star, (strategy, nodes, tokens, topology)
        assert C.node_link_bytes(phase(strategy), C.Topology(nodes)) == \
            C.communication_cost(phase(strategy), nodes).nbytes


@pytest.mark.parametrize("strategy", [s for s in C.STRATEGIES if s != "ps-dedicated"])
def test_one_node_runs_at_the_rate_inside_it(strategy):
    """N = 1: flat, nothing crosses a node's link and the strategy among k runs at β_in; in two levels,
    only the reduce-scatter and the all-gather inside the node are left."""
    for local in counts(strategy, (1, 2, 3, 4, 8)):
        flat = C.Topology(1, local, 4 * MBYTE_PER_S)
        assert C.node_link_bytes(phase(strategy), flat) == 0.0
        inside = C.transfer_seconds(phase(strategy), local, 4 * MBYTE_PER_S, 1e-3)[0]
        assert C.node_transfer_seconds(phase(strategy), flat, MBYTE_PER_S, 1e-3)[0] == \
            pytest.approx(inside, rel=8 * U, abs=0.0)
        two = C.node_exchange(phase(strategy), flat.two_level(), MBYTE_PER_S, latency=1e-3, nbytes=10 * MB)
        assert two.link_bytes == 0.0 and two.messages == 2 * (local - 1)
        # (k−1)/k · 10 MB each way at 4 MB/s, 2(k−1) messages of 1 ms
        assert two.seconds == pytest.approx(2 * (local - 1) * 1e-3 + 2 * (local - 1) / local * 10 / 4,
                                            rel=8 * U, abs=0.0)


def test_a_dedicated_server_is_reached_through_its_own_link_even_from_one_node():
    cost = C.flat_cost(phase("ps-dedicated"), C.Topology(1, 4))
    assert (cost.messages, cost.link_bytes, cost.intra_bytes) == (2, 4 * 3 * MB, 0.0)


def test_without_a_topology_the_bucketed_step_is_todays_and_with_one_rank_a_node_the_same():
    buckets = [C.BucketStep(0.001, 0.002, (C.Phase("allgather", 2e5),), 0.001, nbytes=4e6),
               C.BucketStep(0.02, 0.001, (C.Phase("broadcast", 1e4), C.Phase("allreduce", 3e5)), 0.0005,
                            nbytes=8e6)]
    common = dict(n=8, bandwidth="100mbit", latency=1e-4, optimizer_s=0.003, burst=256 * 1024.0)
    star = C.predict_bucketed_step(0.01, 0.03, buckets, **common)
    assert C.predict_bucketed_step(0.01, 0.03, buckets, topology=None, **common) == star
    assert C.predict_bucketed_step(0.01, 0.03, buckets, topology=C.Topology(8), **common) == star
    two = C.Topology(8, 1, hierarchical=True)
    assert C.predict_bucketed_step(0.01, 0.03, buckets, topology=two, **common) == star
    # predict_step_time likewise
    flat = C.predict_step_time(0.04, 0.003, buckets[1].phases, n=8, bandwidth="100mbit", burst=1e5)
    assert C.predict_step_time(0.04, 0.003, buckets[1].phases, n=8, bandwidth="100mbit", burst=1e5,
                               topology=C.Topology(8), nbytes=8e6) == flat


# -- a small case by hand ---------------------------------------------------------------------------------
def test_two_nodes_of_two_ranks_by_hand():
    """N = 2, k = 2 (n = 4), β = 1 MB/s between nodes, β_in = 10 MB/s inside, α = 1 ms, B = 1 MB."""
    topology = C.Topology(2, 2, 10 * MBYTE_PER_S)

    def flat(strategy: str, nbytes: float = MB) -> float:
        return C.node_transfer_seconds(phase(strategy, nbytes), topology, MBYTE_PER_S, 1e-3)[0]

    # ring all-gather: 3 steps of 1 MB, the node link's hop sets each (1 s) over the hop inside (0.1 s)
    assert flat("allgather") == pytest.approx(3 * 1e-3 + 3.0)
    # ring all-reduce: 6 steps of 0.25 MB: 1.5 MB through the link
    assert flat("allreduce") == pytest.approx(6 * 1e-3 + 1.5)
    # recursive halving: link 2·k(N−1)/N·B = 2 MB (both ranks of a node send half a MB each way at
    # distance 2), inside 2(k−1)/n·B = 0.5 MB at 10 MB/s; 2·log2(4) messages
    assert flat("allreduce-rh") == pytest.approx(4 * 1e-3 + 2.0 + 0.05)
    # recursive doubling: distance 1 inside (1 MB), distance 2 through the link (2 ranks × 2 MB)
    assert flat("allgather-rd") == pytest.approx(2 * 1e-3 + 4.0 + 0.1)
    # binomial broadcast: one step between the nodes, one inside
    assert flat("broadcast") == pytest.approx(2 * 1e-3 + 1.0 + 0.1)
    # parameter server on rank 0 (down = 2 MB): the 2 ranks of node 1 push 1 MB and pull 2 MB through
    # node 0's link (6 MB), rank 1 inside the node (3 MB at 10 MB/s)
    assert flat("ps") == pytest.approx(2 * 1e-3 + 6.0 + 0.3)
    # gather-broadcast: gather 2 MB through the link and 1 MB inside, then 2 MB down the tree through it
    # (1 step) and 2 MB inside (1 step)
    assert flat("gather-broadcast") == pytest.approx(3 * 1e-3 + 4.0 + 0.3)
    # a dedicated server: all 4 ranks through its link, 1 + 2 MB each
    assert flat("ps-dedicated") == pytest.approx(2 * 1e-3 + 12.0)
    # two levels, a bucket of 10 MB whose shard's packet is 0.5 MB: reduce-scatter 5 MB inside (0.5 s),
    # the 2 shards' all-gathers between the nodes share the link (2 × 0.5 MB: 1 s), all-gather inside
    two = C.node_exchange(C.Phase("allgather", 0.5 * MB), topology.two_level(), MBYTE_PER_S, latency=1e-3,
                          nbytes=10 * MB)
    assert two.seconds == pytest.approx(3 * 1e-3 + 0.5 + 1.0 + 0.5)
    assert (two.messages, two.link_bytes, two.intra_bytes) == (3, 1 * MB, 10 * MB)


def test_a_ring_is_paced_by_its_slowest_hop():
    """A ring's step waits for its slowest hop: where the inside of a node is slower than its link, the
    inside sets the ring's time (min(β, β_in)); other algorithms add the two."""
    slow_inside = C.Topology(2, 2, 0.5 * MBYTE_PER_S)
    assert C.node_transfer_seconds(C.Phase("allgather", MB), slow_inside, MBYTE_PER_S, 0.0)[0] == \
        pytest.approx(3.0 / 0.5)
    assert C.node_transfer_seconds(C.Phase("broadcast", MB), slow_inside, MBYTE_PER_S, 0.0)[0] == \
        pytest.approx(1.0 + 1.0 / 0.5)


# -- the traffic between nodes ---------------------------------------------------------------------------
@pytest.mark.parametrize("nodes, local", [(2, 2), (2, 8), (4, 4), (16, 8), (1024, 8), (3, 5)])
def test_an_all_gather_method_sends_k_times_less_between_nodes_in_two_levels(nodes, local):
    """A packet of P bytes for the bucket (P/k for a shard): a node's link carries (n−1)·P flat and
    k·(N−1)·P/k = (N−1)·P in two levels, (Nk−1)/(N−1) ≥ k times less."""
    packet = 12_345.0
    topology = C.Topology(nodes, local)
    flat = C.node_link_bytes(C.Phase("allgather", packet), topology)
    two = C.node_link_bytes(C.shard_phases(C.Phase("allgather", packet), local), topology.two_level())
    assert flat == pytest.approx((nodes * local - 1) * packet, rel=4 * U)
    assert two == pytest.approx((nodes - 1) * packet, rel=4 * U)
    assert flat / two == pytest.approx((nodes * local - 1) / (nodes - 1), rel=8 * U)
    assert flat / two >= local * (1 - 8 * U)


def test_a_methods_link_bytes_flat_and_in_two_levels():
    """``MethodCost.link_bytes``: its buckets' collectives on a node's link; a shard's bytes are 1/k of
    the bucket's, its integer sums widened for the N nodes' sums."""
    profile = C.ComputeProfile(0.01, 0.03, 0.002, (C.Bucket(0, ("w",), 250_000, 1_000_000, 0.03),), "ddp", 32,
                               1, 250_000)
    gather = C.MethodCost("g", "allgather", "residual", (C.BucketCost(0.004, 0.001, 10_000.0,
                                                                      (C.Transfer("allgather", 10_000.0),)),),
                          2, True)
    topology = C.Topology(4, 8)
    assert gather.link_bytes(topology) == pytest.approx(31 * 10_000.0)
    assert gather.link_bytes(topology.two_level()) == pytest.approx(3 * 10_000.0)
    assert gather.link_bytes(C.Topology(16)) == gather.wire_bytes(16)
    steps = gather.node_steps(profile, topology.two_level())
    assert steps[0].compress_s == pytest.approx(0.004 / 8)
    assert steps[0].decompress_s == pytest.approx(0.001 * 4 / 2 / 8)  # 4 packets decoded, not 32; a shard
    assert steps[0].phases == (C.Phase("allgather", 10_000.0 / 8),) and steps[0].nbytes == 1_000_000.0
    # a rank a node: the method among the N nodes, bit for bit
    assert C.predict(profile, gather, n=4, bandwidth="1gbit", topology=C.Topology(4, 1, hierarchical=True)) == \
        C.predict(profile, gather, n=4, bandwidth="1gbit")


# -- monotonicity and scale ---------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", list(C.STRATEGIES))
def test_a_faster_rate_inside_a_node_never_slows_an_exchange(strategy):
    rates = [10 ** e for e in range(6, 13)]
    for nodes, local in itertools.product(counts(strategy, (1, 2, 4)), counts(strategy, (1, 2, 8))):
        for hierarchical in (False, True):
            times = [C.node_transfer_seconds(phase(strategy), C.Topology(nodes, local, rate, hierarchical),
                                             "1gbit", 1e-4, 1e5, nbytes=8 * MB)[0] for rate in rates]
            assert all(b <= a for a, b in zip(times, times[1:], strict=False)), (nodes, local, hierarchical, times)


def test_a_faster_rate_inside_a_node_never_slows_a_step():
    buckets = [C.BucketStep(0.0, 0.001, (C.Phase("allgather", 1e5),), 0.0005, 4e6),
               C.BucketStep(0.02, 0.001, (C.Phase("allreduce", 1e6),), 0.0, 8e6)]
    for hierarchical in (False, True):
        totals = [C.predict_bucketed_step(0.01, 0.03, buckets, n=32, bandwidth="1gbit",
                                          topology=C.Topology(4, 8, 10.0 ** e, hierarchical)).total
                  for e in range(7, 13)]
        assert all(b <= a for a, b in zip(totals, totals[1:], strict=False)), totals


@pytest.mark.parametrize("strategy", list(C.STRATEGIES))
def test_1024_nodes_are_priced(strategy):
    topology = C.Topology(1024, 8)
    flat = C.node_exchange(phase(strategy), topology, "10gbit")
    two = C.node_exchange(C.shard_phases(phase(strategy), 8), topology.two_level(), "10gbit", nbytes=100 * MB)
    assert math.isfinite(flat.seconds) and flat.seconds > 0 and math.isfinite(two.seconds) and two.seconds > 0


# -- what is refused ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"nodes": 0}, "Topology.nodes must be an integer ≥ 1, got 0"),
    ({"nodes": 2.0}, "Topology.nodes must be an integer"),
    ({"nodes": True}, "Topology.nodes must be an integer"),
    ({"nodes": 2, "local_size": 0}, "Topology.local_size must be an integer ≥ 1, got 0"),
    ({"nodes": 2, "intra_bandwidth": 0.0}, "bandwidth must be a positive number"),
    ({"nodes": 2, "intra_bandwidth": "fast"}, "expected a number and a unit"),
    ({"nodes": 2, "hierarchical": "yes"}, "Topology.hierarchical must be True or False"),
])
def test_a_bad_topology_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        C.Topology(**kwargs)


def test_bad_input_on_a_topology_is_refused():
    with pytest.raises(ValueError, match="power-of-two"):
        C.node_exchange(C.Phase("allreduce-rh", MB), C.Topology(3, 2), "1gbit")
    with pytest.raises(ValueError, match="nbytes must be a finite number of bytes"):
        C.node_exchange(C.Phase("allgather", MB), C.Topology(2, 2, hierarchical=True), "1gbit", nbytes=-1.0)
    with pytest.raises(ValueError, match="the topology has 2 nodes of 2: 4 ranks"):
        C.predict_bucketed_step(0.0, 0.01, [], n=8, bandwidth="1gbit", topology=C.Topology(2, 2))
    with pytest.raises(ValueError, match="BucketStep.nbytes"):
        C.BucketStep(0.0, 0.0, (), 0.0, -5.0)
    with pytest.raises(ValueError, match="bandwidth must be a positive number"):
        C.node_exchange(C.Phase("allgather", MB), C.Topology(2, 2), -1.0)
    with pytest.raises(ValueError, match="local_size must be an integer"):
        C.shard_phases(C.Phase("allgather", MB), 0)
