"""``gradpress train`` and ``compare``: real worker processes, on Fashion-MNIST when it is installed."""
from __future__ import annotations

import os

import pytest

from gradpress.testbed import data
from gradpress.testbed.compare import available, compare
from gradpress.testbed.train import TrainConfig, TrainFailed, parse_options, train

needs_data = pytest.mark.skipif(not data.FASHION_MNIST_DIR.exists(),
                                reason="Fashion-MNIST is not installed (gradpress data fashion-mnist, as root)")
MLP = "mlp:hidden=32,depth=1"
PARAMETERS = (784 * 32 + 32) + (32 * 10 + 10)


def config(**changes) -> TrainConfig:
    return TrainConfig(**{"model": MLP, "workers": 2, "steps": 12, "eval_every": 6, "batch_size": 32,
                          "timeout": 60, **changes})


@needs_data
def test_gradpress_hook_trains_and_records_every_step(tmp_path):
    run = train(config(compressor="qsgd"), tmp_path / "run.json", progress=False)
    assert (tmp_path / "run.json").exists()
    assert [s.step for s in run.steps] == list(range(1, 13))
    assert all(s.samples == 64 and s.bytes_sent > 0 and s.compute_s >= 0 for s in run.steps)
    # the first steps also pay for connecting and loading compiled kernels, booked as compression
    assert all(s.compute_s > 0 for s in run.steady_steps)
    assert [e.step for e in run.evals] == [0, 6, 12]
    assert run.metric == "accuracy" and run.evals[-1].value > run.evals[0].value
    # qsgd: 6 bits per value + 4 bytes per bucket of 512, for each parameter tensor
    assert run.steps[-1].bytes_sent < PARAMETERS * 4 / 4
    assert run.evals[-1].bytes_total == sum(s.bytes_sent for s in run.steps)


@needs_data
@pytest.mark.parametrize("name, expected", [("noop", 0), ("torch-allreduce", PARAMETERS * 4),
                                            ("torch-fp16", PARAMETERS * 2)])
def test_reference_rows_count_what_their_hooks_send(name, expected):
    run = train(config(compressor=name, steps=3, eval_every=3), progress=False)
    assert {s.bytes_sent for s in run.steps} == {expected}


@needs_data
def test_a_time_budget_ends_at_the_first_evaluation_past_it():
    run = train(config(compressor="none", steps=None, seconds=1e-3, eval_every=3), progress=False)
    assert [s.step for s in run.steps] == [1, 2, 3] and [e.step for e in run.evals] == [0, 3]
    capped = train(config(compressor="none", steps=4, seconds=3600, eval_every=3), progress=False)
    assert [e.step for e in capped.evals] == [0, 3, 4]  # --steps ends it first


@needs_data
def test_a_failing_worker_stops_the_run_with_its_error():
    with pytest.raises(TrainFailed, match="worker . exited with status"):
        train(config(compressor="topk", options={"min_numel": -1}), progress=False)


@needs_data
@pytest.mark.skipif(os.geteuid() != 0, reason="the emulated network needs root")
def test_training_over_the_emulated_network_cleans_up():
    from gradpress.testbed import netem

    run = train(config(compressor="topk:ratio=0.1", steps=4, eval_every=4, bandwidth="1gbit"), progress=False)
    assert run.bandwidth == "1gbit" and len(run.steps) == 4
    assert netem.namespaces_of(os.getpid()) == []


@needs_data
def test_compare_writes_the_report(tmp_path):
    report, runs, failures = compare(config(steps=4, eval_every=2), ["torch-allreduce", "randomk:ratio=0.1"],
                                     tmp_path, progress=False, say=lambda _: None)
    assert failures == {} and [r.compressor for r in runs] == ["torch-allreduce", "randomk:ratio=0.1"]
    text = report.read_text()
    assert "`randomk:ratio=0.1`" in text and (tmp_path / "results.json").exists()
    assert (tmp_path / "throughput.png").stat().st_size > 0


def test_config_and_options_are_checked():
    assert available(["topk", "no-such-method", "noop"]) == (["topk", "noop"], ["no-such-method"])
    assert parse_options(["min_numel=1024", "exclude=[\"net.0.*\"]", "feedback=none"]) == {
        "min_numel": 1024, "exclude": ["net.0.*"], "feedback": "none"}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_options(["min_numel"])
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(epochs=1, steps=3)
    with pytest.raises(ValueError, match="--seconds"):
        TrainConfig(seconds=0)
    assert TrainConfig(seconds=5).epochs is None and TrainConfig().epochs == 1
    with pytest.raises(ValueError, match="unknown compressor"):
        TrainConfig(compressor="no-such-method")
    with pytest.raises(ValueError, match="100mbit"):
        TrainConfig(bandwidth="fast")
