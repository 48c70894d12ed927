"""``gradpress advise``: the bucketed cost model, the ranking as a pure function of measured
costs, the priced bytes against the runtime's own traffic, DDP's bucket layout, and the command end to
end on tiny models (a testbed model on synthetic data, and a ``package.module:factory`` model)."""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import random

import numpy as np
import pytest
import torch
from torch import nn

import gradpress
from gradpress import costmodel as C
from gradpress.cli import main
from gradpress.costmodel import BucketStep, Phase
from gradpress.testbed import advise as A
from gradpress.testbed import data as D
from synthetic import synthetic_images

MS = 1e-3


# -- a factory model for --model test_advise:tiny_model (tests/ is on sys.path) -------------------------
def tiny_model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def tiny_model_only_here() -> nn.Module:
    """The tiny model in this process; a failure in any process it spawns (``--local-workers``' DDP run)."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        raise RuntimeError("this model is not available to spawned processes")
    return tiny_model()


def tiny_batches(batch_size: int):
    x = torch.randn(batch_size, 6)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


@pytest.fixture
def synthetic_data(monkeypatch):
    fake = D.Source(fetch=lambda **_: "synthetic", load=lambda **_: synthetic_images(n_train=256, n_test=64))
    monkeypatch.setitem(D.DATASETS, "fashion-mnist", fake)


# -- the bucketed cost model ---------------------------------------------------------------------------
def test_one_bucket_at_the_end_of_backward_is_the_sequential_model():
    phases = (Phase("allgather", 2e6),)
    one = C.predict_bucketed_step(0.01, 0.03, [BucketStep(0.03, 0.004, phases, 0.002)], n=4,
                                  bandwidth="1gbit", latency=1e-4, optimizer_s=0.005)
    seq = C.predict_step_time(0.045, 0.006, phases, n=4, bandwidth="1gbit", latency=1e-4)
    assert one.total == pytest.approx(seq.total)
    assert (one.compute, one.compression, one.communication) == pytest.approx((seq.compute, seq.compression,
                                                                               seq.communication))


def test_an_early_bucket_hides_behind_the_backward_pass_and_compression_delays_it():
    comm = Phase("allreduce", 1e6)  # 8e6 bits over 1e8 bits/s per message pair at n = 2: 80 ms
    early = [BucketStep(0.0, 0.0, (comm,)), BucketStep(0.1, 0.0, ())]
    def total(backward, buckets):
        return C.predict_bucketed_step(0.0, backward, buckets, n=2, bandwidth=1e8, latency=0.0).total

    step = C.predict_bucketed_step(0.0, 0.1, early, n=2, bandwidth=1e8, latency=0.0)
    assert step.communication == pytest.approx(0.08)
    assert step.total == pytest.approx(0.1)  # hidden under the 100 ms backward pass
    late = [BucketStep(0.0, 0.0, ()), BucketStep(0.1, 0.0, (comm,))]
    assert total(0.1, late) == pytest.approx(0.18)
    # 50 ms of compression in the first hook: the gradients after it come 50 ms later, so does the exchange
    slow = [BucketStep(0.0, 0.05, (comm,)), BucketStep(0.1, 0.0, ())]
    assert total(0.1, slow) == pytest.approx(0.15)
    # the link carries one bucket at a time; decoding follows arrival
    two = [BucketStep(0.0, 0.0, (comm,), 0.01), BucketStep(0.01, 0.0, (comm,), 0.01)]
    assert total(0.01, two) == pytest.approx(0.17)


def test_the_numeric_crossing_is_the_closed_form_one_in_the_sequential_case():
    base, method = (Phase("allreduce", 13e6),), (Phase("allgather", 2.6e5),)
    closed = C.crossover_bandwidth(0.02, method, 0.0, base, n=2, latency=1e-4)

    def step(phases, compress):
        return lambda bw: C.predict_bucketed_step(0.01, 0.02, [BucketStep(0.02, compress, phases)], n=2,
                                                  bandwidth=bw, latency=1e-4).total

    assert C.bandwidth_crossing(step(method, 0.02), step(base, 0.0)) == pytest.approx(closed, rel=1e-6)
    assert C.bandwidth_crossing(step(base, 0.0), step(base, 0.0)) == 0.0  # never shorter
    assert C.bandwidth_crossing(step(method, 0.0), step(base, 0.001)) == math.inf


# -- the ranking, a pure function of measured costs -----------------------------------------------------
def profile(buckets=((0.01, 4e6), (0.03, 8e6)), forward=0.01, backward=0.03,
            optimizer=0.002) -> A.ComputeProfile:
    return A.ComputeProfile(forward, backward, optimizer,
                            tuple(A.Bucket(i, (f"p{i}",), int(nbytes // 4), int(nbytes), ready)
                                  for i, (ready, nbytes) in enumerate(buckets)),
                            "ddp", 32, 1, int(sum(b for _, b in buckets) // 4))


def method(spec: str, prof: A.ComputeProfile, ratio: float, compress: float, decompress: float = 0.0,
           exchange: str = "allgather") -> A.MethodCost:
    """A method sending ``ratio`` of each bucket's bytes, at a measured cost per bucket."""
    buckets = tuple(A.BucketCost(compress, decompress, b.nbytes * ratio,
                                 (A.Transfer(exchange, b.nbytes * ratio),)) for b in prof.buckets)
    return A.MethodCost(spec, exchange, "residual", buckets, 2, exchange == "allgather")


def test_at_a_slow_link_the_fewest_bytes_win_and_at_a_fast_one_uncompressed_does():
    prof = profile()
    costs = [method("tiny", prof, 0.001, 8 * MS), method("small", prof, 0.05, 3 * MS),
             method("half", prof, 0.5, 1 * MS, exchange="allreduce")]
    slow = A.rank(prof, costs, n=8, bandwidth="10mbit")
    assert [r.spec for r in slow][0] == "tiny"
    assert [r.rank for r in slow] == [1, 2, 3, 4]
    assert slow[-1].spec == A.BASELINE and slow[0].speedup > 10
    fast = A.rank(prof, costs, n=8, bandwidth="400gbit")
    assert fast[0].spec == A.BASELINE and fast[0].speedup == 1.0
    assert all(r.speedup < 1 for r in fast[1:])
    # the baseline row compresses nothing and all-reduces the fp32 buckets
    assert fast[0].packet_bytes == prof.nbytes
    assert fast[0].wire_bytes == pytest.approx(2 * 7 / 8 * prof.nbytes)


def test_time_to_target_outranks_throughput():
    prof = profile()
    costs = [method("fast-but-lossy", prof, 0.001, 1 * MS), method("slower-but-exact", prof, 0.05, 1 * MS)]
    steps = {"fast-but-lossy": None, "slower-but-exact": 120.0, A.QUALITY_REFERENCE: 100.0}
    ranked = A.rank(prof, costs, n=4, bandwidth="100mbit", steps_to_target=steps)
    assert [r.spec for r in ranked] == ["slower-but-exact", A.BASELINE, "fast-but-lossy"]
    first = ranked[0]
    assert first.time_to_target_s == pytest.approx(120 * first.predicted.total)
    assert first.speedup_time_to_target == pytest.approx(ranked[1].time_to_target_s / first.time_to_target_s)
    assert ranked[-1].time_to_target_s is None and ranked[-1].speedup_time_to_target is None
    # by throughput alone the lossy one would lead
    assert A.rank(prof, costs, n=4, bandwidth="100mbit")[0].spec == "fast-but-lossy"


def test_a_local_step_prices_the_host_and_leaves_the_link_to_the_model():
    """``--local-workers``: the host's part of the step is the real local step's, only the link modelled.
    One bucket ready at the end of the backward pass, an all-reduce (whose decoding does not grow with n):
    the prediction is the local step less the loopback's collectives plus the modelled link, at every
    speed and worker count."""
    prof = profile(buckets=((0.03, 8e6),))
    plain = method("tiny", prof, 0.01, 2 * MS, 1 * MS, exchange="allreduce")
    local = A.LocalStep(workers=2, step_s=0.080, compute_s=0.050, compression_s=0.009, communication_s=0.004)
    cost = dataclasses.replace(plain, local=local)
    for n, bandwidth in ((2, "100mbit"), (16, "1gbit"), (256, "10gbit")):
        link = A.predict(prof, plain, n=n, bandwidth=bandwidth, latency=1e-4).communication
        got = A.predict(prof, cost, n=n, bandwidth=bandwidth, latency=1e-4)
        assert got.total == pytest.approx(local.step_s - local.communication_s + link)
        assert got.communication == pytest.approx(link)
    assert local.rest_s == pytest.approx(0.080 - 0.050 - 0.009 - 0.004)
    # the parts: compute scaled to the local one (ready times too), compression to its sum among 2 workers
    scaled_profile, scaled_cost, rest = A.calibrated(prof, cost)
    assert scaled_profile.compute_s == pytest.approx(local.compute_s)
    assert scaled_profile.buckets[0].ready_s == pytest.approx(0.03 * local.compute_s / prof.compute_s)
    assert scaled_cost.compression_at(2) == pytest.approx(local.compression_s) and scaled_cost.local is None
    assert rest == pytest.approx(local.rest_s)
    # an all-gather's decoding still grows with n from the local step's share of it
    gather = dataclasses.replace(method("tiny", prof, 0.01, 2 * MS, 1 * MS), local=local)
    decode = A.calibrated(prof, gather)[1].buckets[0].decompress_s
    assert decode == pytest.approx(local.compression_s / 3)
    grow = [A.predict(prof, gather, n=n, bandwidth="400gbit", latency=0.0).compression for n in (2, 16)]
    assert grow[1] - grow[0] == pytest.approx(7 * decode)
    # torch-allreduce compresses nothing: its local step prices it the same way
    base = A.baseline_cost(prof, dataclasses.replace(local, compression_s=0.0))
    link = A.predict(prof, A.baseline_cost(prof), n=2, bandwidth="100mbit", latency=1e-4).communication
    assert A.predict(prof, base, n=2, bandwidth="100mbit", latency=1e-4).total == pytest.approx(
        local.step_s - local.communication_s + link)


def test_local_steps_are_scaled_to_the_runs_typical_speed():
    """The noop runs around each method say how fast the machine ran while it was measured: a method
    measured while noop took 1.5× its median is scaled by 1/1.5, one at the median is kept."""
    from gradpress.testbed.advise.local import at_typical_speed

    noops = [(0.020, 0.018, 0.0, 0.0), (0.020, 0.018, 0.0, 0.0), (0.040, 0.036, 0.0, 0.0), (0.020, 0.018, 0.0, 0.0)]
    measured = {"a": (0.030, 0.020, 0.005, 0.002), "b": (0.045, 0.030, 0.009, 0.003), "c": (0.050, 0.0, 0.0, 0.0)}
    got = at_typical_speed(measured, noops)
    assert got["a"] == pytest.approx(measured["a"])  # noop at its median before and after
    assert got["b"] == pytest.approx(tuple(t / 1.5 for t in measured["b"]))  # noop 0.020 then 0.040
    assert got["c"] == pytest.approx(tuple(t / 1.5 for t in measured["c"]))  # 0.040 then 0.020
    assert got["noop"] == noops[0]
    with pytest.raises(ValueError, match="3 methods need 4 noop runs"):
        at_typical_speed(measured, noops[:3])


def test_advise_prices_each_method_and_the_reference_with_its_local_step(synthetic_data):
    """:func:`advise` with a ``local`` measurement: every method, ``torch-allreduce`` and ``noop`` asked for;
    the rankings and crossings priced with the steps returned, and a method it could not measure priced
    as measured alone, with the reason."""
    workload = A.testbed_workload("mlp:hidden=8,depth=1,image_size=8", 8, None, None)
    asked = []
    fast = A.LocalStep(workers=2, step_s=0.004, compute_s=0.002, compression_s=0.001, communication_s=0.0005)

    def local(specs):
        asked.extend(specs)
        return {"topk:ratio=0.1": fast, A.BASELINE: dataclasses.replace(fast, compression_s=0.0),
                "noop": dataclasses.replace(fast, compression_s=0.0, communication_s=0.0)}, {"none": "Boom: no"}

    advice = A.advise(workload, ["none", "topk:ratio=0.1"], workers=4, bandwidths=["1gbit"], repeats=1,
                      local=local)
    assert asked == ["none", "topk:ratio=0.1", A.BASELINE, "noop"]
    costs = {c.spec: c for c in advice.costs}
    assert costs["topk:ratio=0.1"].local == fast and costs["none"].local is None
    assert "Boom: no" in advice.skipped["none"]
    assert advice.reference.local.compression_s == 0.0 and advice.local_noop.communication_s == 0.0
    rows = {r.spec: r for r in advice.rankings["1gbit"]}
    for spec, cost in [*costs.items(), (A.BASELINE, advice.reference)]:
        assert rows[spec].predicted.total == pytest.approx(
            A.predict(advice.profile, cost, n=4, bandwidth="1gbit", latency=advice.latency).total)
    assert rows["topk:ratio=0.1"].predicted.compute == pytest.approx(fast.compute_s + fast.rest_s)
    assert advice.crossovers["topk:ratio=0.1"] == A.crossover(advice.profile, costs["topk:ratio=0.1"], n=4,
                                                              latency=advice.latency, baseline=advice.reference)


@functools.lru_cache(maxsize=None)
def wire_ratio(name: str) -> float:
    """Bytes on the wire per fp32 byte: the method's declared size of a 4096-vector, else its packet's."""
    compressor = gradpress.make(name)
    nbytes = compressor.expected_nbytes(4096)
    if nbytes is None:
        nbytes = compressor.compress(torch.randn(4096, generator=torch.Generator().manual_seed(0))).nbytes
    return nbytes / (4 * 4096)


def realistic_methods(prof: A.ComputeProfile, rng: random.Random, n: int) -> list[A.MethodCost]:
    """Every registered method's wire size and exchange, with compression and decoding times drawn from
    1 to 50 ms per bucket."""
    out = []
    for name in gradpress.compressor_names():
        ratio, exchange = wire_ratio(name), gradpress.make(name).exchange
        if exchange == "allgather":  # (n − 1)·b per link: no more than the all-reduce's 2(n − 1)/n·B
            ratio = min(ratio, 2 / n)
        out.append(method(name, prof, ratio, rng.uniform(1, 50) * MS, rng.uniform(0, 50) * MS, exchange))
    return out


@pytest.mark.parametrize("burst", [0.0, 256 * 1024])
@pytest.mark.parametrize("case", range(12))
def test_predicted_speedup_never_rises_with_link_speed(case, burst):
    """Over every method (its bytes, at most the uncompressed all-reduce's; compression and decoding ≥ 1 ms,
    more than the latency an all-gather's fewer messages save at n ≤ 8), on profiles whose buckets
    reach the hook at the end of the backward pass (one or several, the link and the decoding pipelined),
    the speed-up over torch-allreduce never rises from one link speed to a faster one, on a plain link
    and through the testbed's token bucket (tbf burst 256kb). Through a bucket, a step bound by the link
    hides compression in the bucket's refill, so only bytes and messages count there and an all-gather's
    fewer messages may gain α·(n − 1) (a few parts per million here): that variant prices α = 0."""
    rng = random.Random(case)
    n = rng.choice([2, 3, 4, 8])
    backward = rng.uniform(1, 100) * MS
    buckets = [(backward, rng.uniform(1e4, 5e7)) for _ in range(rng.randint(1, 4))]
    prof = profile(buckets, forward=rng.uniform(0, 50) * MS, backward=backward,
                   optimizer=rng.uniform(0, 10) * MS)
    grid = np.geomspace(*A.PLOT_RANGE, 60)
    base = A.baseline_cost(prof)
    for cost in realistic_methods(prof, rng, n):
        speedups = [A.speedup_at(prof, cost, float(bw), n=n, latency=0.0 if burst else 1e-4, baseline=base,
                                 burst=burst)
                    for bw in grid]
        rises = [(f"{grid[i]:.3g}", a, b)
                 for i, (a, b) in enumerate(zip(speedups, speedups[1:], strict=False))
                 if b > a * (1 + (1e-9 if burst else 1e-12))]  # bisection of the tokens: 1e-6 bytes
        assert not rises, (cost.spec, rises[:3])


# -- what is measured ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", gradpress.compressor_names())
def test_priced_bytes_are_what_the_runtime_sends(name):
    """At n = 2 every collective moves its input once each way (ring all-reduce 2(n−1)/n·S, all-gather
    (n−1)·S, a broadcast S to the other rank), so the priced transfers must add up to what the Simulator's
    traffic counts (sent + received by worker 0), all-gather padding and fault flags aside."""
    generator = torch.Generator().manual_seed(1)
    shapes = {"w": (96, 40), "b": (96,), "head": (3, 96)}
    grads = [{k: torch.randn(s, generator=generator) * 1e-2 for k, s in shapes.items()} for _ in range(2)]
    simulator = gradpress.Simulator(name, 2)
    simulator.step(grads)
    before = simulator.stats()[0]["total"]
    simulator.step(grads)
    after = simulator.stats()[0]["total"]
    counted = sum(after[k] - before[k] for k in ("sent_bytes", "received_bytes"))
    packets = after["packet_bytes"] - before["packet_bytes"]
    transfers = A.transfers_of(gradpress.make(name), list(grads[0].items()), 2, packet_bytes=packets)
    priced = sum((1 if t.strategy == "broadcast" else 2) * t.phase(2).nbytes for t in transfers)
    assert priced == pytest.approx(counted, rel=0.1, abs=64), transfers


def test_ddp_and_the_replicated_rule_give_the_same_layout():
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    def sample(g):
        return torch.randn(8, 64, generator=g), torch.randint(10, (8,), generator=g)

    workload = A.Workload("seq", lambda: model, sample, nn.functional.cross_entropy, 8, "random")
    common = dict(repeats=1, warmup=2, workers=2, bucket_cap_mb=0.5)
    ddp, grads = A.profile_compute(workload, use_ddp=True, **common)
    replica, _ = A.profile_compute(workload, use_ddp=False, **common)
    assert ddp.layout == "ddp" and replica.layout == "replicated"
    assert [b.keys for b in ddp.buckets] == [b.keys for b in replica.buckets]
    assert len(ddp.buckets) >= 2 and ddp.buckets[0].keys[0] == "4.bias"  # the last layer's come first
    assert [b.nbytes for b in ddp.buckets] == [b.nbytes for b in replica.buckets]
    assert all(0 <= b.ready_s <= ddp.backward_s * 1.5 for b in ddp.buckets)
    assert len(grads) == 2 and set(grads[0]) == {name for name, _ in model.named_parameters()}


def test_assign_buckets_follows_ddps_caps():
    mib = 1024 * 1024
    sizes = [("a", mib // 2, "f32"), ("b", mib // 2, "f32"), ("c", 10 * mib, "f32"), ("d", 20 * mib, "f32"),
             ("e", 1, "f16"), ("f", 30 * mib, "f32")]
    # the first bucket closes at 1 MiB, the next ones at 25 MiB; a tensor is never split; dtypes apart
    assert A.assign_buckets(sizes, [mib, 25 * mib]) == [["a", "b"], ["c", "d"], ["e"], ["f"]]


def test_quality_steps_to_target_interpolate_between_checkpoints():
    curve = A.QualityCurve("x", 2, "accuracy", True, ((0, 0.1), (10, 0.5), (20, 0.9)), 0.0)
    assert A.steps_to_reach(curve, 0.7) == pytest.approx(15.0)
    assert A.steps_to_reach(curve, 0.95) is None
    loss = A.QualityCurve("x", 2, "loss", False, ((0, 2.0), (5, 1.0)), 0.0)
    assert A.quality_target(loss) == pytest.approx(1.01)
    assert A.checkpoints(7) == [1, 2, 3, 4, 5, 6, 7] and A.checkpoints(100)[-1] == 100


def measured_run(compressor: str, step_s: float, bandwidth: str | None = "100mbit", workers: int = 2,
                 comm_s: float = 0.0, burst: float = 0.0):
    from gradpress.testbed.results import Run, Step

    steps = tuple(Step(step=i + 1, epoch=0, wall_s=(i + 1) * step_s, compute_s=step_s - comm_s,
                       compress_s=0.0, comm_s=comm_s, bytes_sent=0, samples=32 * workers) for i in range(11))
    return Run(compressor, "mlp-wide", "fashion-mnist", workers, bandwidth, 0, steps, (),
               {"batch_size": 32, "network": {"burst_bytes": burst}})


def test_on_nodes_each_method_is_ranked_flat_and_in_two_levels():
    """4 nodes of 8 ranks, a 1 Gbit/s link each: every method flat and as SPEC@node (PyTorch's all-reduce
    flat only), the bytes through a node's link; one rank a node is the star of links, bit for bit."""
    prof = profile()
    costs = [method("tiny", prof, 0.001, 8 * MS), method("half", prof, 0.5, 1 * MS, exchange="allreduce")]
    topology = C.Topology(4, 8)
    rows = {r.spec: r for r in A.rank(prof, costs, n=32, bandwidth="1gbit", topology=topology)}
    assert set(rows) == {A.BASELINE, "tiny", "tiny@node", "half", "half@node"}
    assert [r.rank for r in sorted(rows.values(), key=lambda r: r.rank)] == [1, 2, 3, 4, 5]
    assert rows["tiny@node"].hierarchy == "node" and rows["tiny"].hierarchy is None
    assert rows[A.BASELINE].hierarchy is None and rows[A.BASELINE].speedup == 1.0
    # the all-gather method: 31 packets through a node's link flat, 3 nodes' × 8 shards of 1/8 in two levels
    tiny = costs[0].packet_bytes
    assert rows["tiny"].wire_bytes == pytest.approx(31 * tiny)
    assert rows["tiny@node"].wire_bytes == pytest.approx(3 * tiny)
    assert rows["tiny@node"].packet_bytes == pytest.approx(tiny / 8)
    assert rows["tiny@node"].predicted.total == pytest.approx(
        C.predict(prof, costs[0], n=32, bandwidth="1gbit", topology=topology.two_level()).total)
    # a rank a node: the flat rows are the star's
    star = {r.spec: r for r in A.rank(prof, costs, n=8, bandwidth="1gbit")}
    single = {r.spec: r for r in A.rank(prof, costs, n=8, bandwidth="1gbit", topology=C.Topology(8))}
    for spec, r in star.items():
        assert (single[spec].predicted, single[spec].speedup, single[spec].wire_bytes) == \
            (r.predicted, r.speedup, r.wire_bytes)
    advice = A.Advice("m", "random", 32, 1e-4, ["1gbit"], prof, costs, {}, {}, topology=topology).relinked(
        latency=1e-4)
    assert set(advice.crossovers) == {"tiny", "tiny@node", "half", "half@node"}
    assert A.register_line("tiny@node") == 'gradpress.register(model, "tiny", hierarchy="node")'
    record = A.to_json(advice)
    assert record["nodes"] == {"nodes": 4, "local_size": 8, "intra_bandwidth": "100gbit"}
    tiny_json = next(m for m in record["methods"] if m["spec"] == "tiny")
    assert tiny_json["node_link_bytes_per_step"] / tiny_json["two_level"]["node_link_bytes_per_step"] == \
        pytest.approx(31 / 3)


def test_checked_against_measured_runs():
    prof = profile()
    costs = [method("tiny", prof, 0.001, 8 * MS), method("half", prof, 0.5, 1 * MS, exchange="allreduce")]
    advice = A.Advice("m", "random", 2, 1e-4, ["100mbit"], prof, costs, {}, {})
    predicted = {c.spec: A.predict(prof, c, n=2, bandwidth="100mbit", latency=1e-4).total
                 for c in [*costs, A.baseline_cost(prof)]}
    runs = [measured_run("tiny", predicted["tiny"] * 1.1), measured_run("half", predicted["half"] * 0.5),
            measured_run(A.BASELINE, predicted[A.BASELINE]), measured_run("noop", prof.compute_s * 2),
            measured_run("tiny", 1.0, bandwidth=None), measured_run("torch-powersgd", 0.01)]
    checks = {c.spec: c for c in A.check_against(advice, runs)}
    assert set(checks) == {"tiny", "half", A.BASELINE, "noop"}  # loopback and unpriced runs left out
    assert checks["tiny"].relative_error == pytest.approx(1 / 1.1 - 1)
    assert checks["half"].relative_error == pytest.approx(1.0)
    assert checks["noop"].relative_error == pytest.approx(-0.5) and checks["noop"].predicted_rank is None
    # with the compute scaled to the measured noop step (twice the profile's): every part of it doubles
    slower = A.scaled(prof, 2 * prof.compute_s)
    assert slower.compute_s == pytest.approx(2 * prof.compute_s)
    assert [b.ready_s for b in slower.buckets] == pytest.approx([2 * b.ready_s for b in prof.buckets])
    # and the method's compression and decoding likewise: the whole machine ran at half the speed
    assert [b.compress_s for b in A.scaled_cost(costs[0], 2.0).buckets] == pytest.approx(
        [2 * b.compress_s for b in costs[0].buckets])
    assert checks["tiny"].with_noop_s == pytest.approx(
        A.predict(slower, A.scaled_cost(costs[0], 2.0), n=2, bandwidth="100mbit", latency=1e-4).total)
    assert checks["noop"].with_noop_s is None
    ranked = [c for c in checks.values() if c.spec != "noop"]
    assert [c.spec for c in sorted(ranked, key=lambda c: c.predicted_rank)] == ["tiny", "half", A.BASELINE]
    assert [c.measured_rank for c in sorted(ranked, key=lambda c: c.measured_s)] == [1, 2, 3]


def test_runs_on_several_nodes_are_checked_on_their_nodes():
    """compare --nodes 2 --workers 2 with topk and topk@node: two rows, each predicted on 2 nodes of 2 ranks,
    flat or in two levels as it ran (the advice's α: the link fit prices runs on one node only)."""
    prof = profile()
    costs = [method("tiny", prof, 0.001, 8 * MS)]
    advice = A.Advice("m", "random", 2, 1e-4, ["100mbit"], prof, costs, {}, {})

    def on_two_nodes(run, hierarchy=None):
        info = {**run.info, **({"options": {"hierarchy": hierarchy}} if hierarchy else {})}
        return dataclasses.replace(run, nodes=2, info=info)

    runs = [on_two_nodes(measured_run("tiny", 0.1, workers=4, comm_s=0.01)),
            on_two_nodes(measured_run("tiny", 0.09, workers=4, comm_s=0.01), "node"),
            on_two_nodes(measured_run(A.BASELINE, 0.2, workers=4, comm_s=0.1))]
    checks = {c.spec: c for c in A.check_against(advice, runs)}
    assert set(checks) == {"tiny", "tiny@node", A.BASELINE}
    topology = C.Topology(2, 2)
    for spec, where in (("tiny", topology), ("tiny@node", topology.two_level()), (A.BASELINE, topology)):
        cost = costs[0] if spec != A.BASELINE else A.baseline_cost(prof)
        assert checks[spec].nodes == 2 and checks[spec].latency == 1e-4
        assert checks[spec].predicted_s == pytest.approx(
            A.predict(prof, cost, n=4, bandwidth="100mbit", latency=1e-4, topology=where).total)


def test_repeated_runs_of_a_method_are_checked_as_their_median():
    """compare run several times (``--check DIR1 DIR2 …``): each method is one row, its measured step the
    median of its runs' with the fastest and slowest beside it, ranked by that median; noop's compute too."""
    prof = profile()
    costs = [method("tiny", prof, 0.001, 8 * MS), method("half", prof, 0.5, 1 * MS, exchange="allreduce")]
    advice = A.Advice("m", "random", 2, 1e-4, ["100mbit"], prof, costs, {}, {})
    # "tiny" loses one of three runs to a slow machine (0.130), which would make it lose on the mean
    runs = [measured_run("tiny", 0.100), measured_run("half", 0.104), measured_run("noop", 0.08),
            measured_run("tiny", 0.130), measured_run("half", 0.103), measured_run("noop", 0.09),
            measured_run("tiny", 0.095), measured_run("half", 0.110), measured_run("noop", 0.10)]
    checks = {c.spec: c for c in A.check_against(advice, runs)}
    assert set(checks) == {"tiny", "half", "noop"}
    tiny, half = checks["tiny"], checks["half"]
    assert (tiny.runs, tiny.measured_low, tiny.measured_high) == (3, 0.095, 0.130)
    assert tiny.measured_s == pytest.approx(0.100) and half.measured_s == pytest.approx(0.104)
    assert (tiny.measured_rank, half.measured_rank) == (1, 2)
    expected = A.predict(A.scaled(prof, 0.09), A.scaled_cost(costs[0], 0.09 / prof.compute_s), n=2,
                         bandwidth="100mbit", latency=1e-4).total
    assert tiny.with_noop_s == pytest.approx(expected)  # the median noop step, 90 ms
    from rich.console import Console

    console = Console(record=True, width=400)
    console.print(A.render_checks([tiny, half]))
    assert "100.0 (95.0–130.0, 3 runs)" in console.export_text()
    # what the method adds beyond the run's own compute, ranked apart from the compute's drift
    drifting = [measured_run("tiny", 0.110, comm_s=0.010), measured_run("half", 0.105, comm_s=0.015)]
    checks = {c.spec: c for c in A.check_against(advice, drifting)}
    assert (checks["tiny"].measured_rank, checks["half"].measured_rank) == (2, 1)
    assert checks["tiny"].overhead_s == pytest.approx(0.010) and checks["half"].overhead_s == pytest.approx(0.015)
    assert (checks["tiny"].overhead_rank, checks["half"].overhead_rank) == (1, 2)


def runs_through_the_bucket(prof, costs, burst: float, efficiency: dict[str, float]) -> list:
    """A run of each method and of ``torch-allreduce`` whose step is the model's prediction through a
    100 Mbit/s link with a token bucket of ``burst`` bytes and collectives at ``efficiency`` of its rate."""
    link = {"n": 2, "bandwidth": "100mbit", "latency": 1e-4, "burst": burst, "efficiency": efficiency}
    steps = {cost.spec: A.predict(prof, cost, **link) for cost in [*costs, A.baseline_cost(prof)]}
    return [measured_run(spec, step.total, comm_s=step.communication, burst=burst) for spec, step in steps.items()]


def test_the_check_prices_each_runs_link_with_rates_fitted_from_the_other_runs():
    """Runs through the testbed's token bucket whose collectives ran at 0.6 (all-gather) and 0.95
    (all-reduce) of the link's rate: each run is predicted with α and the rates fitted from the others
    (its own step left out), which recover them, so every prediction is the measurement."""
    burst, truth = 262144.0, {"allgather": 0.6, "allreduce": 0.95}
    prof = profile(buckets=((0.03, 12e6),))
    costs = [method("quarter", prof, 0.25, 8 * MS), method("half", prof, 0.5, 4 * MS),
             method("tenth", prof, 0.1, 2 * MS)]
    runs = runs_through_the_bucket(prof, costs, burst, truth)
    advice = A.Advice("m", "random", 2, 1e-4, ["100mbit"], prof, costs, {}, {})
    checks = {c.spec: c for c in A.check_against(advice, runs)}
    assert checks["quarter"].efficiency == pytest.approx(truth)
    assert checks[A.BASELINE].efficiency == pytest.approx({"allgather": 0.6})  # no other all-reduce run
    for c in checks.values():
        assert c.burst == burst
        if c.spec != A.BASELINE:
            assert c.relative_error == pytest.approx(0.0, abs=1e-9), c.spec
    # a plain link at the full rate is off by the rates, and the bucket's bytes
    assert checks["quarter"].latency == pytest.approx(1e-4)  # α fitted beside the rates
    plain = {c.spec: c for c in A.check_against(advice, runs, fit_link=False)}
    assert plain["half"].relative_error < -0.2
    # --burst and --efficiency override what the runs recorded and the fit
    forced = A.Advice("m", "random", 2, 1e-4, ["100mbit"], prof, costs, {}, {}, burst=1.0,
                      efficiency={"allgather": 1.0})
    assert {c.burst for c in A.check_against(forced, runs)} == {1.0}
    assert A.check_against(forced, runs)[0].efficiency["allgather"] == 1.0


def test_the_ranking_takes_the_link_of_the_runs_it_is_checked_against():
    """A method whose 240 kB fit the testbed's 256 KiB token bucket loses to one sending 12 kB on a plain
    100 Mbit/s link and wins through the bucket: priced through the link the runs recorded
    (:func:`runs_link`: their bucket, α and rates fitted from all of them), the pick is the check's own
    first prediction; runs of two links give no one link."""
    burst, truth = 262144.0, {"allgather": 0.6, "allreduce": 0.95}
    prof = profile(buckets=((0.03, 12e6),))
    costs = [method("fits", prof, 0.02, 8 * MS), method("tiny", prof, 0.001, 12 * MS),
             method("half", prof, 0.5, 4 * MS)]
    runs = runs_through_the_bucket(prof, costs, burst, truth)
    plain = A.Advice("m", "random", 2, 1e-4, ["100mbit"], prof, costs, {}, {}).relinked(latency=1e-4)
    assert plain.best("100mbit").spec == "tiny"
    found = A.runs_link(plain, runs)
    assert (found.burst, found.runs, found.workers, found.bandwidth) == (burst, 4, 2, "100mbit")
    assert found.efficiency == pytest.approx(truth) and found.latency == pytest.approx(1e-4)
    through = plain.relinked(latency=found.latency, burst=found.burst, efficiency=found.efficiency)
    assert (through.burst, through.efficiency) == (burst, found.efficiency)
    assert through.best("100mbit").spec == "fits"
    checks = {c.spec: c for c in A.check_against(plain, runs)}
    assert checks["fits"].predicted_rank == 1 and checks["fits"].measured_rank == 1
    for r in through.rankings["100mbit"]:  # the ranking's steps are the runs' (the link recovered)
        assert r.predicted.total == pytest.approx(checks[r.spec].measured_s, rel=1e-6), r.spec
    assert A.runs_link(plain, runs + [measured_run("tiny", 0.05, bandwidth="1gbit")]) is None
    assert A.runs_link(plain, [measured_run("torch-powersgd", 0.05)]) is None  # no run priced here


# -- the command --------------------------------------------------------------------------------------
def test_advise_end_to_end(tmp_path, synthetic_data, capsys):
    out, png = tmp_path / "advice.json", tmp_path / "speedup.png"
    assert main(["advise", "--model", "mlp:hidden=8,depth=1,image_size=8", "--workers", "16",
                 "--compressors", "none,topk:ratio=0.1,qsgd,fp16", "--bandwidth", "10mbit,10gbit",
                 "--batch-size", "8", "--repeats", "3", "--json", str(out), "--plot", str(png),
                 "--burst", "256kb", "--efficiency", "allgather=0.65"]) == 0
    text = capsys.readouterr().out
    assert "gradpress.register(model" in text or "keep DDP's built-in all-reduce" in text
    assert "token bucket 262144 B" in text and "allgather 0.65×" in text
    assert "topk:ratio=0.1" in text and "pays below" in text
    advice = json.loads(out.read_text())
    assert advice["workers"] == 16 and advice["bandwidths"] == ["10mbit", "10gbit"]
    assert advice["burst"] == 262144 and advice["efficiency"] == {"allgather": 0.65}
    assert advice["profile"]["layout"] in ("ddp", "replicated") and advice["profile"]["buckets"]
    assert {m["spec"] for m in advice["methods"]} == {"none", "topk:ratio=0.1", "qsgd", "fp16"}
    for bandwidth in ("10mbit", "10gbit"):
        ranked = advice["rankings"][bandwidth]
        assert [r["rank"] for r in ranked] == [1, 2, 3, 4, 5]
        assert {r["spec"] for r in ranked} == {"none", "topk:ratio=0.1", "qsgd", "fp16", A.BASELINE}
        assert advice["best"][bandwidth] == ranked[0]["spec"]
    topk = next(m for m in advice["methods"] if m["spec"] == "topk:ratio=0.1")
    assert topk["decode_grows"] and topk["measured_workers"] == 2
    # all-gather: 15 of 16 packets reach every worker's link
    assert topk["wire_bytes_per_step"] >= 15 * topk["packet_bytes_per_step"]
    assert png.stat().st_size > 5000


def test_advise_with_local_workers_prices_each_method_with_its_real_local_step(tmp_path, capsys):
    """--local-workers 2: real DDP steps among 2 Gloo processes over loopback, for every method, the
    reference and noop, as compare times its steps."""
    import multiprocessing

    out = tmp_path / "advice.json"
    assert main(["advise", "--model", "test_advise:tiny_model", "--input-shape", "6", "--compressors",
                 "none,topk:ratio=0.1", "--bandwidth", "1gbit", "--batch-size", "8", "--repeats", "2",
                 "--local-workers", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "priced with each method's real DDP step among 2 processes of this machine" in text
    advice = json.loads(out.read_text())
    steps = [m["local"] for m in advice["methods"]] + list(advice["local"].values())
    assert len(steps) == 4 and advice["skipped"] == {}
    for step in steps:
        assert step["workers"] == 2
        assert step["step_s"] >= step["compute_s"] > 0 and step["step_s"] >= step["compression_s"] >= 0
    topk = next(m for m in advice["methods"] if m["spec"] == "topk:ratio=0.1")
    assert topk["local"]["compression_s"] > 0 and topk["local"]["communication_s"] > 0
    assert advice["local"]["noop"]["communication_s"] == 0.0
    # the prediction starts from the local step: its compute (the profile scaled to it) and the rest
    row = next(r for r in advice["rankings"]["1gbit"] if r["spec"] == "topk:ratio=0.1")
    local = topk["local"]
    rest = max(0.0, local["step_s"] - local["compute_s"] - local["compression_s"] - local["communication_s"])
    assert row["predicted"]["compute"] == pytest.approx(local["compute_s"] + rest)
    assert multiprocessing.active_children() == []  # the measuring processes are gone


def test_advise_on_nodes(tmp_path, capsys):
    """--nodes N --local-size k: N·k ranks, each method flat and in two levels (up to 1024 nodes)."""
    out = tmp_path / "advice.json"
    assert main(["advise", "--model", "test_advise:tiny_model", "--input-shape", "6", "--compressors",
                 "topk:ratio=0.1", "--bandwidth", "1gbit", "--batch-size", "8", "--repeats", "1",
                 "--nodes", "1024", "--local-size", "2", "--intra-bandwidth", "50gbit", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1024 nodes × 2 ranks (2048 workers, a link per node, 50gbit inside" in text
    assert "topk:ratio=0.1@node" in text and "node link" in text
    advice = json.loads(out.read_text())
    assert advice["workers"] == 2048 and advice["setting"]["workers"] == 2048
    assert advice["nodes"] == {"nodes": 1024, "local_size": 2, "intra_bandwidth": "50gbit"}
    ranked = {r["spec"]: r for r in advice["rankings"]["1gbit"]}
    assert set(ranked) == {A.BASELINE, "topk:ratio=0.1", "topk:ratio=0.1@node"}
    assert ranked["topk:ratio=0.1@node"]["hierarchy"] == "node"
    # the all-gather's packets: (n−1) through a node's link flat, (N−1) in two levels (headers aside)
    ratio = ranked["topk:ratio=0.1"]["wire_bytes"] / ranked["topk:ratio=0.1@node"]["wire_bytes"]
    assert ratio == pytest.approx(2047 / 1023, rel=0.05)


def test_a_local_run_that_fails_is_one_clear_line(tmp_path, capsys):
    import multiprocessing

    assert main(["advise", "--model", "test_advise:tiny_model_only_here", "--input-shape", "6", "--compressors",
                 "none", "--bandwidth", "1gbit", "--batch-size", "8", "--repeats", "1",
                 "--local-workers", "2"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("gradpress: error: --local-workers 2: the local DDP run failed")
    assert "without --local-workers advise prices from the profile alone" in last
    assert multiprocessing.active_children() == []


def test_advise_checks_against_compare_results(tmp_path, synthetic_data, capsys):
    from gradpress.testbed.results import save_runs

    save_runs([measured_run("topk:ratio=0.1", 0.05, "1gbit", 4, burst=262144.0),
               measured_run(A.BASELINE, 0.08, "1gbit", 4, burst=262144.0)], tmp_path / "results.json")
    out = tmp_path / "advice.json"
    assert main(["advise", "--model", "mlp:hidden=8,depth=1,image_size=8", "--workers", "4", "--compressors",
                 "topk:ratio=0.1", "--bandwidth", "1gbit", "--batch-size", "8", "--repeats", "1",
                 "--check", str(tmp_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "predicted against measured" in printed
    assert "priced through the link of the --check runs (2 runs of 4 workers at 1gbit)" in printed
    record = json.loads(out.read_text())
    assert {c["spec"] for c in record["checks"]} == {"topk:ratio=0.1", A.BASELINE}
    assert record["burst"] == 262144.0  # the testbed's tbf, which these runs recorded
    assert main(["advise", "--model", "mlp:hidden=8,depth=1,image_size=8", "--workers", "4", "--compressors",
                 "topk:ratio=0.1", "--bandwidth", "1gbit", "--batch-size", "8", "--repeats", "1",
                 "--check", str(tmp_path), "--burst", "0", "--json", str(out)]) == 0
    assert "priced through the link" not in capsys.readouterr().out  # a link of the user's own
    assert json.loads(out.read_text())["burst"] == 0.0
    assert main(["advise", "--check", str(tmp_path / "nothing-here")]) == 2
    assert "--check" in capsys.readouterr().err


def test_advise_with_quality_ranks_by_time_to_target(tmp_path, synthetic_data, capsys):
    out = tmp_path / "advice.json"
    assert main(["advise", "--model", "mlp:hidden=8,depth=1,image_size=8", "--workers", "2", "--compressors",
                 "topk:ratio=0.1", "--bandwidth", "100mbit", "--batch-size", "8", "--repeats", "2",
                 "--quality-steps", "6", "--lr", "0.05", "--json", str(out)]) == 0
    assert "steps to target" in capsys.readouterr().out
    quality = json.loads(out.read_text())["quality"]
    assert [c["spec"] for c in quality["curves"]] == ["none", "topk:ratio=0.1"]
    assert quality["steps_to_target"]["none"] is not None  # the reference reaches its own best − tolerance
    assert len(quality["curves"][0]["points"]) == 7  # before the first step and at steps 1..6


def test_advise_a_factory_model(tmp_path, capsys):
    out = tmp_path / "advice.json"
    assert main(["advise", "--model", "test_advise:tiny_model", "--input-shape", "6", "--compressors",
                 "natural", "--bandwidth", "1gbit", "--repeats", "2", "--json", str(out)]) == 0
    advice = json.loads(out.read_text())
    assert advice["profile"]["parameters"] == 6 * 16 + 16 + 16 * 3 + 3
    assert advice["profile"]["batch_size"] == 32
    assert main(["advise", "--model", "test_advise:tiny_model", "--batch", "test_advise:tiny_batches",
                 "--compressors", "natural", "--bandwidth", "1gbit", "--repeats", "2",
                 "--quality-steps", "3"]) == 0
    assert "quality: 3 steps" in capsys.readouterr().out


def test_missing_data_skips_quality_with_a_clear_message(monkeypatch, capsys):
    def missing(**_):
        raise D.DataUnavailable("not here; run `gradpress data fashion-mnist`")

    monkeypatch.setitem(D.DATASETS, "fashion-mnist", D.Source(fetch=missing, load=missing))
    assert main(["advise", "--model", "mlp:hidden=8,depth=1", "--compressors", "topk", "--bandwidth", "1gbit",
                 "--batch-size", "4", "--repeats", "1", "--quality-steps", "3"]) == 0
    captured = capsys.readouterr()
    assert "--quality-steps skipped: fashion-mnist is not available" in captured.err
    assert "random batches" in captured.out


class Started(Exception):
    pass


@pytest.mark.parametrize("argv, expected", [
    (["--workers", "0"], "expected an integer in 1..1024"),
    (["--workers", "1025"], "expected an integer in 1..1024"),
    (["--bandwidth", "fast"], "fast"),
    (["--bandwidth", "100mbit,,"], None),
    (["--compressors", "topk:ratio=2"], "topk:ratio must be in (0, 1]"),
    (["--model", "nosuch_module_x:build"], "nosuch_module_x"),
    (["--model", "test_advise:missing_factory"], "has no 'missing_factory'"),
    (["--model", "mlp", "--input-shape", "3"], "testbed model and knows its inputs"),
    (["--model", "test_advise:tiny_model"], "needs --input-shape"),
    (["--model", "test_advise:tiny_model", "--input-shape", "5"], "--model test_advise:tiny_model"),
    (["--model", "test_advise:tiny_model", "--input-shape", "6", "--quality-steps", "3"], "needs --batch"),
    (["--input-shape", "3,x"], "expected"),
    (["--latency", "-1"], "non-negative"),
    (["--burst", "lots"], "tc size"),
    (["--efficiency", "allgather=1.5"], "F in (0, 1]"),
    (["--efficiency", "ring=0.5"], "STRATEGY one of"),
    (["--nodes", "1025"], "expected an integer in 1..1024"),
    (["--nodes", "0"], "expected an integer in 1..1024"),
    (["--local-size", "2"], "--local-size 2: the ranks of a node and the rate between them are for --nodes N"),
    (["--intra-bandwidth", "10gbit"], "are for --nodes N"),
    (["--nodes", "4", "--workers", "6"], "not the same number of ranks on every node"),
    (["--nodes", "2", "--local-size", "2", "--workers", "8"], "--workers 8 contradicts --nodes 2 × --local-size 2"),
])
def test_bad_arguments_are_one_line_and_measure_nothing(argv, expected, monkeypatch, capsys):
    # advise() looks profile_compute up in its own module, gradpress.testbed.advise.advice
    monkeypatch.setattr(A.advice, "profile_compute", lambda *a, **k: (_ for _ in ()).throw(Started()))
    try:
        code = main(["advise", *argv])
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2, err
    assert out == "" and err.startswith("gradpress: error: ") and err.count("\n") == 1, err
    if expected:
        assert expected in err
