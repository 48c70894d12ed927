"""``gradpress sim``: NMSE against the number of workers, training with simulated workers, the α–β model
checked against runs, and the command line."""
from __future__ import annotations

import json
import math

import pytest
import torch

from gradpress.cli import main
from gradpress.costmodel import Phase
from gradpress.testbed import data as D
from gradpress.testbed import sim as S
from gradpress.testbed.results import Eval, Run, Step, save_runs
from gradpress.testbed.sim.quality import _endless_batches
from numerics import eps
from synthetic import synthetic_images

SMALL = {"numel": 1 << 12, "trials": 2, "seed": 0}


def by_workers(points):
    return {p.workers: p.nmse for p in points}


# -- NMSE --------------------------------------------------------------------------------------------
def test_none_is_exact_up_to_fp32_rounding_for_every_n():
    points = S.nmse_vs_workers(["none"], [1, 4, 16, 64], **SMALL)
    assert [p.workers for p in points] == [1, 4, 16, 64]
    assert all(p.nmse <= S.ROUNDING for p in points), points
    assert points[0].nmse == 0.0  # one worker: the mean is its own vector


def test_unbiased_errors_average_out_like_one_over_n_but_top_k_bias_does_not():
    points = S.nmse_vs_workers(["qsgd", "natural", "topk:ratio=0.01"], [4, 64], **SMALL)
    nmse = {(p.spec.partition(":")[0], p.workers): p.nmse for p in points}
    # σ = 1: NMSE ≈ 2ω/(n + 1), so going from n = 4 to 64 divides it by 65/5 = 13
    for unbiased in ("qsgd", "natural"):
        assert 9 < nmse[unbiased, 4] / nmse[unbiased, 64] < 18, nmse
    assert nmse["topk", 4] / nmse["topk", 64] < 1.5, nmse
    assert nmse["topk", 64] > 0.1  # what top-k drops of the mean stays dropped


def test_shared_random_k_is_unbiased_but_its_error_does_not_average_out():
    # every worker keeps the same k of d coordinates (shared stream), so NMSE = d/k − 1 for any n
    points = by_workers(S.nmse_vs_workers(["randomk:ratio=0.25,scale=true"], [2, 32], **SMALL))
    for value in points.values():
        assert value == pytest.approx(3.0, rel=0.15)


def test_loglog_slope():
    line = [S.NMSEPoint("x", True, n, 0.5 / n) for n in (4, 16, 64)]
    flat = [S.NMSEPoint("x", False, n, 0.3) for n in (4, 16, 64)]
    assert S.loglog_slope(line) == pytest.approx(-1.0)
    assert S.loglog_slope(flat) == pytest.approx(0.0, abs=1e-12)
    assert S.loglog_slope([S.NMSEPoint("none", True, n, 1e-14) for n in (4, 16)]) is None


def test_nmse_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown distribution"):
        S.nmse_vs_workers(["none"], [2], numel=8, dist="cauchy")
    with pytest.raises(ValueError, match="workers"):
        S.nmse_vs_workers(["none"], [0], numel=8)
    with pytest.raises(ValueError):
        S.nmse_vs_workers(["nosuchcompressor"], [2], numel=8)


# -- quality -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("workers, spec", [(1, "none"), (4, "none"), (4, "topk:ratio=0.1")])
def test_training_with_simulated_workers_lowers_the_test_loss(workers, spec):
    data = synthetic_images()
    point = S.train_simulated("mlp:hidden=16,depth=1", data, workers, spec, steps=30, batch_size=16, lr=0.05)
    assert point.final_loss < 0.7 * point.initial_loss, point
    assert point.final > point.initial and point.metric == "accuracy"
    assert len(point.train_losses) == 30
    assert point.bytes_per_step > 0


def test_a_step_with_none_applies_the_mean_of_the_workers_gradients():
    # 2 workers of batch 8 exchanging with `none` take the SGD step of the mean of their gradients (the
    # mean of two batch means: in exact arithmetic the step of one batch holding both)
    data = synthetic_images(n_train=64)
    simulated, reference = _model(data), _model(data)
    S.train_simulated("mlp:hidden=8,depth=1", data, 2, "none", steps=1, batch_size=8, lr=0.1, net=simulated)
    grads = []
    for rank in range(2):  # each worker's gradient, from the same float32 computation as the simulator's
        x, y = _first_batch(data, rank, 2, 8)
        reference.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        grads.append([p.grad.clone() for p in reference.parameters()])
    bounds = []
    with torch.no_grad():
        for p, *worker_grads in zip(reference.parameters(), *grads, strict=True):
            mean = sum(worker_grads) / 2
            p -= 0.1 * mean  # SGD with momentum: the first step is plain SGD
            # the mean of two is rounded once (u of it); p − lr·g twice here and at most twice in the
            # optimizer (a product and a difference, or one fused multiply-add): u of each
            bounds.append(eps() * (p.abs() + 2 * 0.1 * mean.abs()))
    for (name, got), want, bound in zip(simulated.named_parameters(), reference.parameters(), bounds,
                                        strict=True):
        assert ((got - want).abs() <= bound).all(), name
    assert not torch.equal(simulated.net[1].weight, _model(data).net[1].weight)


def _model(data):
    from gradpress.testbed.models import model_config

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return model_config("mlp:hidden=8,depth=1", data).build()


def _first_batch(data, rank, n, batch):
    return next(_endless_batches(data.shard(rank, n, seed=0), batch, 0, rank))


def test_training_leaves_the_global_rng_alone_and_rejects_tiny_shards():
    data = synthetic_images(n_train=64)
    state = torch.get_rng_state()
    S.train_simulated("mlp:hidden=8,depth=1", data, 2, "none", steps=1, batch_size=8)
    assert torch.equal(state, torch.get_rng_state())
    with pytest.raises(ValueError, match="holds no batch"):
        S.train_simulated("mlp:hidden=8,depth=1", data, 16, "none", steps=1, batch_size=8)


# -- the cost model against runs ---------------------------------------------------------------------
def run(compressor: str, step_s: float, compress_s: float = 0.0, comm_s: float = 0.0, nbytes: int = 0,
        workers: int = 2, bandwidth: str | None = "100mbit", count: int = 11, batch: int = 32,
        burst: float = 0.0) -> Run:
    """A run of ``count`` equal steps of ``step_s`` seconds (mean_step_s == step_s exactly) over links
    with a token bucket of ``burst`` bytes (0: a plain link)."""
    steps = [Step(step=i + 1, epoch=0, wall_s=(i + 1) * step_s, compute_s=step_s - compress_s,
                  compress_s=compress_s, comm_s=comm_s, bytes_sent=nbytes, samples=batch * workers)
             for i in range(count)]
    evals = [Eval(epoch=0, step=count, wall_s=count * step_s, bytes_total=nbytes * count, metric="accuracy",
                  value=0.5, higher_is_better=True, loss=1.0)]
    return Run(compressor, "mlp-wide", "fashion-mnist", workers, bandwidth, 0, tuple(steps), tuple(evals),
               {"batch_size": batch, "network": {"burst_bytes": burst}})


NOOP = run("noop", 0.05)
ALLREDUCE = run("torch-allreduce", 0.14, comm_s=0.09, nbytes=1_000_000)
TOPK = run("topk:ratio=0.01", 0.07, compress_s=0.01, comm_s=0.01, nbytes=20_000)
RUNS = [ALLREDUCE, TOPK, NOOP]


def test_strategies_of_runs():
    assert [S.strategy_of(r) for r in RUNS] == ["allreduce", "allgather", None]
    assert S.strategy_of(run("randomk:ratio=0.01", 0.1)) == "allreduce"  # summable
    ps = Run("qsgd", "mlp", "fashion-mnist", 2, None, 0, NOOP.steps, (), {"options": {"mode": "ps"}})
    assert S.strategy_of(ps) == "gather-broadcast"


def test_checks_give_the_closed_form_numbers():
    checks = {c.prediction.label: c for c in S.check_runs(RUNS, latency=0.0)}
    # all-reduce of 1 MB over two workers: each link carries 2·(1/2)·1 MB = 8e6 bits at 1e8 bit/s
    a = checks["torch-allreduce"].prediction
    assert a.compute_source == "noop" and a.sequential.compute == pytest.approx(0.05)
    assert a.sequential.communication == pytest.approx(0.08)
    assert a.sequential.total == pytest.approx(0.13)
    assert a.overlapped.total == pytest.approx(0.08)
    assert checks["torch-allreduce"].relative_error == pytest.approx((0.13 - 0.14) / 0.14)
    # all-gather of 20 kB: (n − 1)·B = 1.6e5 bits -> 1.6 ms, + compression 10 ms + compute 50 ms
    t = checks["topk:ratio=0.01"].prediction
    assert t.sequential.communication == pytest.approx(0.0016)
    assert t.sequential.total == pytest.approx(0.0616)
    assert checks["topk:ratio=0.01"].relative_error == pytest.approx((0.0616 - 0.07) / 0.07)
    assert checks["noop"].relative_error == pytest.approx(0.0)
    # α counts per message: 2(n−1) = 2 for the ring, n − 1 = 1 for the all-gather
    with_latency = {c.prediction.label: c.prediction for c in S.check_runs(RUNS, latency=1e-3)}
    assert with_latency["torch-allreduce"].sequential.total == pytest.approx(0.132)
    assert with_latency["topk:ratio=0.01"].sequential.total == pytest.approx(0.0626)


def test_runs_are_priced_at_their_bytes_on_the_link_through_their_token_bucket():
    # THC's packet holds 4-bit indices; its all-reduce carries them as 8-bit table sums: twice the bytes
    thc = run("thc", 0.2, compress_s=0.01, nbytes=1_000_000)
    phases = S.link_phases(thc, "allreduce", thc.bytes_per_step, 2)
    assert sum(p.nbytes for p in phases) == pytest.approx(2_000_000, rel=0.01)
    priced = S.check_runs([thc, NOOP], latency=0.0)[0].prediction
    assert priced.sequential.communication == pytest.approx(0.16, rel=0.01)  # 2 MB each way at 100 Mbit/s
    # an all-gather's packets travel as they are; PyTorch's hooks at their own bytes
    assert S.link_phases(TOPK, "allgather", 20_000, 2) == [Phase("allgather", 20_000)]
    assert S.link_phases(ALLREDUCE, "allreduce", 1e6, 2) == [Phase("allreduce", 1e6)]
    # the bucket a run recorded; the testbed's tbf (256kb = 262144 B) for an emulated run that recorded
    # none; none over loopback
    assert S.burst_of(run("noop", 0.1, burst=1000.0)) == 1000.0
    old = Run("noop", "mlp", "fashion-mnist", 2, "100mbit", 0, NOOP.steps, (), {})
    assert S.burst_of(old) == 262144.0
    assert S.burst_of(run("noop", 0.1, bandwidth=None, burst=5.0)) == 0.0
    # through it: compute 50 ms idles the link long enough to fill the bucket, so 1 MB − 262144 B wait
    # for the rate (100 Mbit/s)
    bursty = run("torch-allreduce", 0.14, comm_s=0.09, nbytes=1_000_000, burst=262144.0)
    p = S.check_runs([bursty, NOOP], latency=0.0)[0].prediction
    assert p.sequential.communication == pytest.approx(8 * (1_000_000 - 262144) / 1e8)
    assert p.sequential.total == pytest.approx(0.05 + 8 * (1_000_000 - 262144) / 1e8)


def test_without_a_noop_run_compute_is_step_minus_compression_and_communication():
    alone = S.check_runs([TOPK], latency=0.0)[0].prediction
    assert alone.compute_source == "own"
    assert alone.sequential.compute == pytest.approx(0.07 - 0.01 - 0.01)
    loopback = run("torch-allreduce", 0.1, bandwidth=None)
    # a run over loopback has no link rate to check against
    assert [c.prediction.label for c in S.check_runs([loopback, NOOP], latency=0.0)] == ["noop"]


def test_cross_checks_carry_a_run_to_the_other_runs_settings():
    four = run("torch-allreduce", 0.2, nbytes=1_000_000, workers=4)
    crossed = S.cross_checks([ALLREDUCE, four, NOOP, TOPK], latency=0.0)
    # only the two all-reduce runs pair up (same compressor, model, data and batch; another n)
    pairs = sorted((c.basis, c.prediction.workers) for c in crossed)
    assert pairs == [("n=2, 100mbit", 4), ("n=4, 100mbit", 2)]
    to_four = next(c for c in crossed if c.prediction.workers == 4)
    # from the n = 2 run: noop compute 0.05 + ring all-reduce of 1 MB over 4: 2·3/4·8e6 bits at 1e8 bit/s
    assert to_four.prediction.sequential.total == pytest.approx(0.05 + 0.12)
    assert to_four.measured_s == pytest.approx(0.2)
    assert to_four.relative_error == pytest.approx((0.17 - 0.2) / 0.2)


def test_fitted_latency_recovers_the_messages_share():
    alpha = 2e-3
    # measured = compute 0.05 + compression + bytes term + messages·α
    allreduce = run("torch-allreduce", 0.05 + 0.08 + 2 * alpha, nbytes=1_000_000)
    topk = run("topk:ratio=0.01", 0.05 + 0.01 + 0.0016 + alpha, compress_s=0.01, nbytes=20_000)
    four = run("torch-allreduce", 0.05 + 0.12 + 6 * alpha, nbytes=1_000_000, workers=4, bandwidth="100mbit")
    noop4 = run("noop", 0.05, workers=4)
    assert S.fit_run_latency([allreduce, topk, NOOP, four, noop4]) == pytest.approx(alpha)
    with pytest.raises(ValueError, match="needs a communicating run"):
        S.fit_run_latency([NOOP])


def test_what_if_other_workers_and_links():
    predictions = S.what_if(RUNS, [16], ["1gbit"], latency=1e-4)
    p = {x.label: x for x in predictions}
    # ring all-reduce of 1 MB over 16 workers at 1 Gbit/s: 2·15/16·8e6 bits / 1e9 + 30 α
    assert p["torch-allreduce"].sequential.communication == pytest.approx(2 * 15 / 16 * 8e6 / 1e9 + 30e-4)
    # all-gather of 20 kB: 15 packets of 1.6e5 bits + 15 α
    assert p["topk:ratio=0.01"].sequential.communication == pytest.approx(15 * 1.6e5 / 1e9 + 15e-4)
    assert p["noop"].sequential.total == pytest.approx(0.05)
    assert p["noop"].samples_per_s == pytest.approx(16 * 32 / 0.05)
    # the run's own link when none is given; a strategy override leaves noop alone
    own = S.what_if(RUNS, [4], None, latency=0.0, strategy="ps")
    assert {x.bandwidth for x in own} == {"100mbit"}
    assert {x.label: x.strategy for x in own} == {"torch-allreduce": "ps", "topk:ratio=0.01": "ps",
                                                  "noop": None}


# -- the command line --------------------------------------------------------------------------------
def test_cli_nmse(tmp_path, capsys):
    out, png = tmp_path / "nmse.json", tmp_path / "nmse.png"
    assert main(["sim", "nmse", "--compressors", "none,topk:ratio=0.1,qsgd", "--workers", "2,8",
                 "--numel", "512", "--trials", "1", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "topk:ratio=0.1" in text and "n=8" in text
    points = json.loads(out.read_text())["points"]
    assert len(points) == 6 and {p["workers"] for p in points} == {2, 8}
    assert png.stat().st_size > 1000


def test_cli_quality(tmp_path, monkeypatch, capsys):
    fake = D.Source(fetch=lambda **_: "synthetic", load=lambda **_: synthetic_images(n_train=128, n_test=32))
    monkeypatch.setitem(D.DATASETS, "fashion-mnist", fake)
    out = tmp_path / "quality.json"
    assert main(["sim", "quality", "--model", "mlp:hidden=8,depth=1", "--workers", "1,2", "--compressor",
                 "none,topk:ratio=0.5", "--steps", "3", "--batch-size", "8", "--json", str(out)]) == 0
    assert "accuracy" in capsys.readouterr().out
    points = json.loads(out.read_text())
    assert [(p["spec"], p["workers"]) for p in points] == [("none", 1), ("none", 2), ("topk:ratio=0.5", 1),
                                                            ("topk:ratio=0.5", 2)]


def test_cli_cost(tmp_path, capsys):
    save_runs(RUNS, tmp_path / "results.json")
    out = tmp_path / "cost.json"
    assert main(["sim", "cost", "--results", str(tmp_path), "--workers", "2,16", "--bandwidth", "1gbit",
                 "--latency", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "torch-allreduce" in text and "what if" in text
    result = json.loads(out.read_text())
    assert len(result["checks"]) == 3 and len(result["what_if"]) == 6 and result["cross_checks"] == []
    check = next(c for c in result["checks"] if c["label"] == "torch-allreduce")
    assert check["relative_error"] == pytest.approx((0.13 - 0.14) / 0.14)
    assert main(["sim", "cost", "--results", str(tmp_path / "results.json"), "--latency", "fit"]) == 0
    assert "fitted latency" in capsys.readouterr().out
    save_runs([NOOP], tmp_path / "results.json")
    assert main(["sim", "cost", "--results", str(tmp_path), "--latency", "fit"]) == 2
    assert "needs a communicating run" in capsys.readouterr().err
    assert main(["sim", "cost", "--results", str(tmp_path / "missing")]) == 2


def test_cli_rejects_bad_lists(capsys):
    with pytest.raises(SystemExit):
        main(["sim", "nmse", "--workers", "4,x"])
    assert "expected comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sim", "cost", "--results", ".", "--bandwidth", "fast"])
    assert "expected a number and a unit" in capsys.readouterr().err


# -- several nodes -----------------------------------------------------------------------------------------
def on_nodes(r: Run, nodes: int, hierarchy: str | None = None, intra: int = 0) -> Run:
    """``r`` on ``nodes`` nodes (its workers shared among them), ``hierarchy="node"`` where given, each step
    having sent ``intra`` bytes inside the node."""
    import dataclasses

    steps = tuple(dataclasses.replace(s, intra_node_bytes=intra) for s in r.steps)
    info = {**r.info, **({"options": {"hierarchy": hierarchy}} if hierarchy else {})}
    return dataclasses.replace(r, nodes=nodes, steps=steps, info=info)


def test_what_if_on_nodes_flat_and_in_two_levels():
    """N nodes of k ranks, a 1 Gbit/s link each, 100 Gbit/s inside: every run flat and, for a gradpress
    method, in two levels (PyTorch's hooks and noop flat only), with the bytes through a node's link."""
    predictions = S.what_if(RUNS, None, ["1gbit"], latency=0.0, nodes=[2, 1024], local_size=4)
    p = {(x.label, x.nodes): x for x in predictions}
    assert sorted(p) == sorted((label, nodes) for nodes in (2, 1024) for label in
                               ("torch-allreduce", "topk:ratio=0.01", "topk:ratio=0.01@node", "noop"))
    flat, two = p["topk:ratio=0.01", 2], p["topk:ratio=0.01@node", 2]
    assert (flat.workers, flat.local_size, flat.hierarchical, two.hierarchical) == (8, 4, False, True)
    # flat: a ring all-gather of 20 kB among 8, node 0's link carries one hop: 7 · 20 kB
    assert flat.link_bytes == pytest.approx(7 * 20_000)
    assert flat.sequential.communication == pytest.approx(8 * 7 * 20_000 / 1e9)
    assert flat.sequential.total == pytest.approx(0.05 + 0.01 + 8 * 7 * 20_000 / 1e9)
    # two levels: a shard of 1/4 (packet 5 kB, compression 2.5 ms); the torch-allreduce run's 1 MB
    # reduce-scattered and all-gathered inside the node, 4 shards' all-gathers between the 2 nodes
    assert (two.nbytes, two.raw_bytes, two.raw_source) == (5_000, 1_000_000, "torch-allreduce")
    assert two.link_bytes == pytest.approx(4 * 5_000)
    assert flat.link_bytes / two.link_bytes == pytest.approx((2 * 4 - 1) / (2 - 1))
    inside = 8 * 3 / 4 * 1e6 / 1e11
    assert two.sequential.communication == pytest.approx(2 * inside + 8 * 4 * 5_000 / 1e9)
    assert two.sequential.compression == pytest.approx(0.01 / 4)
    # 1024 nodes: priced, the all-gather method's link (n−1)/(N−1) ≈ k times the two-level one's
    big, big_two = p["topk:ratio=0.01", 1024], p["topk:ratio=0.01@node", 1024]
    assert big.workers == 4096 and big.link_bytes / big_two.link_bytes == pytest.approx(4095 / 1023)
    assert math.isfinite(big_two.sequential.total) and big_two.sequential.total < big.sequential.total
    # k defaults to the run's own ranks a node (1 for a run on one node)
    assert {x.local_size for x in S.what_if(RUNS, None, ["1gbit"], 0.0, nodes=[4])} == {1}
    four = on_nodes(run("topk:ratio=0.01", 0.07, compress_s=0.01, nbytes=20_000, workers=4), 2)
    mine = S.what_if([four, ALLREDUCE], None, ["1gbit"], 0.0, nodes=[8])
    assert {(x.label, x.nodes, x.local_size) for x in mine} == {
        ("topk:ratio=0.01", 8, 2), ("topk:ratio=0.01@node", 8, 2), ("torch-allreduce", 8, 1)}


def test_a_run_on_several_nodes_is_checked_on_its_nodes():
    """A run of 2 nodes × 2 (100 Mbit/s between them) is priced on its nodes, flat or in two levels as it
    ran; the two-level run's bytes and compression are a shard's as measured."""
    noop = on_nodes(run("noop", 0.05, workers=4), 2)
    allreduce = on_nodes(run("torch-allreduce", 0.2, nbytes=1_000_000, workers=4), 2)
    flat = on_nodes(run("topk:ratio=0.01", 0.07, compress_s=0.01, nbytes=20_000, workers=4), 2)
    two = on_nodes(run("topk:ratio=0.01", 0.06, compress_s=0.005, nbytes=10_000, workers=4), 2, "node",
                   intra=1_000_000)
    checks = {c.prediction.label: c.prediction for c in S.check_runs([noop, allreduce, flat, two], 0.0)}
    assert set(checks) == {"noop", "torch-allreduce", "topk:ratio=0.01", "topk:ratio=0.01@node"}
    p, q = checks["topk:ratio=0.01"], checks["topk:ratio=0.01@node"]
    assert (p.nodes, p.local_size, p.hierarchical, q.hierarchical) == (2, 2, False, True)
    # flat: a ring all-gather among 4, node 0's link one hop of 3 · 20 kB
    assert p.sequential.communication == pytest.approx(8 * 3 * 20_000 / 1e8)
    # two levels: the 1 MB (the torch-allreduce run's) half each way inside at 100 Gbit/s, the 2 shards'
    # all-gathers of 10 kB between the 2 nodes through the link; the compression as measured
    assert q.sequential.communication == pytest.approx(2 * 8 * 0.5e6 / 1e11 + 8 * 2 * 10_000 / 1e8)
    assert q.sequential.total == pytest.approx(0.05 + 0.005 + q.sequential.communication)
    # the ring all-reduce of the reference: 2·3/4 MB through the link
    assert checks["torch-allreduce"].sequential.communication == pytest.approx(8 * 1.5e6 / 1e8)
    # without a torch-allreduce or none run, B_raw from the run's own bytes inside the node:
    # 2(k−1)/k · B_raw = 1 MB with k = 2
    assert S.raw_bytes(two, [two]) == (1_000_000, "intra-node bytes")
    assert S.raw_bytes(flat, [flat]) == (None, "")
    alone = S.check_runs([noop, two], 0.0, intra_bandwidth="10gbit")[1].prediction
    assert alone.raw_source == "intra-node bytes" and alone.intra_bandwidth == "10gbit"
    assert alone.sequential.communication == pytest.approx(2 * 8 * 0.5e6 / 1e10 + 8 * 2 * 10_000 / 1e8)
    # what if: each method from its own run, the other kind only where none was measured that way
    rows = S.what_if([noop, allreduce, flat, two], None, None, 0.0, nodes=[4])
    assert sorted(x.label for x in rows) == ["noop", "topk:ratio=0.01", "topk:ratio=0.01@node", "torch-allreduce"]
    by = {x.label: x for x in rows}
    assert by["topk:ratio=0.01"].nbytes == 20_000 and by["topk:ratio=0.01@node"].nbytes == 10_000
    assert S.kinds(flat, [flat]) == [False, True] and S.kinds(allreduce, [allreduce]) == [False]
    # the runs on several nodes stay out of the latency fit (it prices a star)
    with pytest.raises(ValueError, match="on one node"):
        S.fit_run_latency([noop, allreduce, flat, two])
    # a run on one node carried to the same ranks on 2 nodes, and back
    star = run("topk:ratio=0.01", 0.065, compress_s=0.01, nbytes=20_000, workers=4)
    crossed = {c.basis: c.prediction for c in S.cross_checks([noop, allreduce, flat, star], 0.0)
               if c.prediction.label == "topk:ratio=0.01"}
    assert set(crossed) == {"n=4, 100mbit", "2 nodes × 2, 100mbit"}
    assert (crossed["n=4, 100mbit"].nodes, crossed["n=4, 100mbit"].local_size) == (2, 2)
    assert crossed["n=4, 100mbit"].sequential.communication == pytest.approx(p.sequential.communication)
    assert crossed["2 nodes × 2, 100mbit"].intra_bandwidth is None  # the star of a link per worker
    # where each stops paying against the torch-allreduce run of the same nodes, on those nodes
    paying = {c.label: c.bandwidth for c in S.crossovers([noop, allreduce, flat, two], 0.0)}
    assert set(paying) == {"topk:ratio=0.01", "topk:ratio=0.01@node"}
    assert all(speed > 1e8 for speed in paying.values())


def test_a_two_level_row_needs_the_gradients_bytes():
    skipped: list[str] = []
    rows = S.what_if([TOPK, NOOP], None, ["1gbit"], 0.0, nodes=[2], local_size=2, skipped=skipped)
    assert [x.label for x in rows] == ["topk:ratio=0.01", "noop"]
    assert len(skipped) == 1 and "add a torch-allreduce or none run of mlp-wide" in skipped[0]
    # one rank a node needs none: nothing crosses inside a node
    assert len(S.what_if([TOPK, NOOP], None, ["1gbit"], 0.0, nodes=[2], local_size=1)) == 3


def test_cli_cost_on_nodes(tmp_path, capsys):
    save_runs(RUNS, tmp_path / "results.json")
    out = tmp_path / "cost.json"
    assert main(["sim", "cost", "--results", str(tmp_path), "--nodes", "2,1024", "--local-size", "4",
                 "--bandwidth", "1gbit", "--latency", "0", "--intra-bandwidth", "50gbit", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "topk:ratio=0.01@node" in text and "1024×4" in text and "node link bytes" in text
    rows = json.loads(out.read_text())["what_if"]
    assert len(rows) == 8
    two = [r for r in rows if r["label"] == "topk:ratio=0.01@node"]
    assert [(r["nodes"], r["local_size"], r["hierarchical"], r["intra_bandwidth"]) for r in two] == \
        [(2, 4, True, "50gbit"), (1024, 4, True, "50gbit")]
    flat = next(r for r in rows if r["label"] == "topk:ratio=0.01" and r["nodes"] == 2)
    assert flat["link_bytes"] / two[0]["link_bytes"] == pytest.approx(7)
    with pytest.raises(SystemExit):
        main(["sim", "cost", "--results", str(tmp_path), "--nodes", "1025"])
    assert "argument --nodes: '1025': expected numbers of nodes in 1..1024" in capsys.readouterr().err
    assert main(["sim", "cost", "--results", str(tmp_path), "--nodes", "2", "--workers", "4"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["sim", "cost", "--results", str(tmp_path), "--local-size", "4"]) == 2
    assert "needs --nodes" in capsys.readouterr().err
