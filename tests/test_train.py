"""``gradpress train`` and ``compare``: real worker processes, on Fashion-MNIST when it is installed."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from gradpress.testbed import data
from gradpress.testbed import train as train_module
from gradpress.testbed.compare import available, compare, run_config, run_list
from gradpress.testbed.results import Run
from gradpress.testbed.train import TrainConfig, TrainFailed, _Clock, parse_options, train
from gradpress.testbed.training import launch, timing
from gradpress.testbed.training import worker as training_worker

needs_data = pytest.mark.skipif(not data.FASHION_MNIST_DIR.exists(),
                                reason="Fashion-MNIST is not installed (gradpress data fashion-mnist, as root)")
MLP = "mlp:hidden=32,depth=1"
PARAMETERS = (784 * 32 + 32) + (32 * 10 + 10)
ROOT = os.geteuid() == 0


def config(**changes) -> TrainConfig:
    return TrainConfig(**{"model": MLP, "workers": 2, "steps": 12, "eval_every": 6, "batch_size": 32,
                          "timeout": 60, **changes})


@pytest.mark.parametrize("compressor", ["thc", "topk:ratio=0.01", "torch-allreduce", "auto"])
def test_the_methods_kernels_are_warmed_before_the_clock_and_the_random_state_kept(compressor, monkeypatch):
    """``warm_up`` runs the method (numba compiles or loads its kernels) on a synthetic gradient before a
    worker starts its training clock, leaving torch's global random state as it was; ``auto`` each of its
    candidates and its ``measure_with``; PyTorch's hooks are left alone."""
    import torch

    import gradpress
    from gradpress.auto import DEFAULT_CANDIDATES

    stepped = []
    real_step = gradpress.Simulator.step
    monkeypatch.setattr(gradpress.Simulator, "step", lambda self, grads: stepped.append(len(grads)) or
                        real_step(self, grads))
    state = torch.get_rng_state()
    options = {"measure_with": "topk:ratio=0.1"} if compressor == "auto" else {}  # (not a candidate)
    train_module.warm_up(config(compressor=compressor, workers=3, options=options))
    assert torch.equal(torch.get_rng_state(), state)
    runs = {"torch-allreduce": 0, "auto": len(DEFAULT_CANDIDATES) + 1}.get(compressor, 1)
    assert stepped == [3, 3] * runs


#: the runs of one ``compare`` that several tests read (each run starts 2 worker processes): gradpress's
#: hook (qsgd) and two reference rows, 12 steps with an evaluation every 5 and a time budget that the
#: steps end long before
COMPARED = ["qsgd", "noop", "torch-allreduce"]


@dataclass
class _Compared:
    """What ``compare`` returned, and the folder it wrote into."""

    out: Path
    report: Path
    runs: list[Run]
    failures: dict[str, str]

    def run(self, compressor: str) -> Run:
        return next(r for r in self.runs if r.compressor == compressor)


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> _Compared:
    if not data.FASHION_MNIST_DIR.exists():
        pytest.skip("Fashion-MNIST is not installed (gradpress data fashion-mnist, as root)")
    out = tmp_path_factory.mktemp("compare")
    report, runs, failures = compare(config(steps=12, eval_every=5, seconds=3600), COMPARED, out,
                                     progress=False, say=lambda _: None)
    return _Compared(out, report, runs, failures)


@needs_data
def test_gradpress_hook_trains_and_records_every_step(compared):
    run = compared.run("qsgd")
    assert (compared.out / "run-qsgd.json").exists()
    assert [s.step for s in run.steps] == list(range(1, 13))
    assert all(s.samples == 64 and s.bytes_sent > 0 and s.compute_s >= 0 for s in run.steps)
    # the first steps also pay for connecting and loading compiled kernels, booked as compression
    assert all(s.compute_s > 0 for s in run.steady_steps)
    assert [e.step for e in run.evals] == [0, 5, 10, 12]
    assert run.metric == "accuracy" and run.evals[-1].value > run.evals[0].value
    # qsgd: 6 bits per value + 4 bytes per bucket of 512, for each parameter tensor
    assert run.steps[-1].bytes_sent < PARAMETERS * 4 / 4
    assert run.evals[-1].bytes_total == sum(s.bytes_sent for s in run.steps)
    assert run.info["copy_s"] > 0  # the copy of the gradient that costs are stated in (report)


def test_gradient_copy_is_timed_on_a_tensor_of_the_gradients_size(monkeypatch):
    """gradient_copy_s copies a float32 tensor of the trainable parameters' count: the median of its runs,
    each from and into buffers the copies between have evicted from the cache (a rotation over more
    than twice its size)."""
    sizes = []
    real_copy_s = timing.copy_s
    monkeypatch.setattr(timing, "copy_s", lambda n: sizes.append(n) or real_copy_s(n))
    model = timing.torch.nn.Sequential(timing.torch.nn.Linear(10, 5), timing.torch.nn.Linear(5, 2))
    model[1].weight.requires_grad_(False)
    assert timing.gradient_copy_s(model) > 0
    assert sizes == [55 + 2]
    copies = []
    real_copy = timing.torch.Tensor.copy_
    monkeypatch.setattr(timing, "last_level_cache_bytes", lambda: 1 << 20)  # a 1 MiB cache
    monkeypatch.setattr(timing.torch.Tensor, "copy_",
                        lambda dst, src: copies.append((dst.data_ptr(), src.data_ptr(), dst.numel())) or
                        real_copy(dst, src))
    assert real_copy_s(100_000, repeats=5) > 0  # 400 kB: 1 + ⌈1 MiB / 400 kB⌉ = 4 pairs, 3.2 MB in turn
    assert len(copies) == 4 + 5 and {n for *_, n in copies} == {100_000}
    assert len({dst for dst, _, _ in copies[:4]} | {src for _, src, _ in copies[:4]}) == 8
    assert copies[4:8] == copies[:4]  # the same pair again only after the other three


@needs_data
@pytest.mark.parametrize("name, expected", [("noop", 0), ("torch-allreduce", PARAMETERS * 4),
                                            ("torch-fp16", PARAMETERS * 2)])
def test_reference_rows_count_what_their_hooks_send(name, expected, compared, on_a_budget):
    run = on_a_budget if name == on_a_budget.compressor else compared.run(name)
    assert {s.bytes_sent for s in run.steps} == {expected}


#: one run of the third reference row that a time budget ends after 3 steps, over the emulated network
#: as root (loopback otherwise): the reference rows' test, the time budget's and the emulated network's
#: read it
ON_A_BUDGET = config(compressor="torch-fp16", steps=None, seconds=1e-3, eval_every=3,
                     bandwidth="1gbit" if ROOT else None)


@pytest.fixture(scope="module")
def on_a_budget() -> Run:
    if not data.FASHION_MNIST_DIR.exists():
        pytest.skip("Fashion-MNIST is not installed (gradpress data fashion-mnist, as root)")
    return train(ON_A_BUDGET, progress=False)


@needs_data
def test_a_time_budget_ends_at_the_first_evaluation_past_it(on_a_budget, compared):
    assert [s.step for s in on_a_budget.steps] == [1, 2, 3] and [e.step for e in on_a_budget.evals] == [0, 3]
    capped = compared.run("torch-allreduce")  # 12 steps of a 3600 s budget: --steps ends it first
    assert [e.step for e in capped.evals] == [0, 5, 10, 12]


@needs_data
def test_a_failing_worker_stops_the_run_with_its_error():
    # one worker: every rank fails alike on the option, and the launcher's way from a failed worker to
    # TrainFailed is the same for one process as for each of several
    with pytest.raises(TrainFailed, match="worker . exited with status"):
        train(config(compressor="topk", workers=1, options={"min_numel": -1}), progress=False)


@needs_data
@pytest.mark.skipif(not ROOT, reason="the emulated network needs root")
def test_training_over_the_emulated_network_cleans_up(on_a_budget):
    from gradpress.testbed import netem

    assert on_a_budget.bandwidth == "1gbit" and len(on_a_budget.steps) == 3
    assert netem.namespaces_of(os.getpid()) == []


def test_the_training_clock_stands_still_while_an_evaluation_runs():
    """Inside a pause the clock reads the training time at which the pause began, also after the
    evaluation ran (a controlled time source: no sleeping, no thresholds on machine speed)."""
    now = [100.0]
    clock = _Clock(now=lambda: now[0])
    with clock.paused():  # the evaluation before training: nothing to count, nothing subtracted later
        now[0] += 5.0
        assert clock.elapsed() == 0.0
    clock.start()
    now[0] += 2.0  # two seconds of steps
    with clock.paused():
        assert clock.elapsed() == 2.0
        now[0] += 30.0  # an evaluation far longer than the steps between two evaluations
        assert clock.elapsed() == 2.0  # read after it: still the training time before it
    now[0] += 1.0
    assert clock.elapsed() == 3.0
    with clock.paused():
        now[0] += 0.5
        with clock.paused():  # a nested pause is part of the outer one
            now[0] += 4.0
        assert clock.elapsed() == 3.0
    now[0] += 1.0
    assert clock.elapsed() == 4.0


@needs_data
def test_evaluations_are_stamped_with_the_training_time_before_them(tmp_path, monkeypatch):
    """An evaluation's wall_s is the training wall-clock when it begins, never its own duration: it lies
    between the wall_s of the step before it and of the step after it, also when an evaluation takes
    far longer than the steps between two evaluations (here 1000 s of a controlled clock, then none:
    counting each evaluation in its own wall_s made wall_s go backwards, "Run.evals[2]: step, wall_s
    and bytes_total must not decrease"). One worker, in this process."""
    from gradpress.testbed import models

    offset, durations = [0.0], iter([0.0, 1000.0, 0.0, 1000.0])  # evaluations at steps 0, 2, 4, 6
    evaluate = models.evaluate

    def slow_evaluate(model, dataset, batch_size=None):
        offset[0] += next(durations)  # the evaluation "takes" this long on the training clock's source
        return evaluate(model, dataset, batch_size)

    monkeypatch.setattr(models, "evaluate", slow_evaluate)
    monkeypatch.setattr(training_worker, "_Clock", lambda: _Clock(now=lambda: time.perf_counter() + offset[0]))
    monkeypatch.setenv("GRADPRESS_PROGRESS", "0")
    result = tmp_path / "run.json"
    train_module.worker(config(compressor="none", workers=1, steps=6, eval_every=2), 0, "127.0.0.1",
                        launch._free_port(), result)
    run = Run.from_json(result.read_text())
    assert [e.step for e in run.evals] == [0, 2, 4, 6] and run.evals[0].wall_s == 0.0
    walls = [s.wall_s for s in run.steps]
    for e in run.evals[1:]:
        assert walls[e.step - 1] <= e.wall_s, e
        assert e.step == len(walls) or e.wall_s <= walls[e.step], e
    assert all(a.wall_s <= b.wall_s for a, b in zip(run.evals, run.evals[1:], strict=False))


@needs_data
def test_compare_writes_the_report(compared):
    assert compared.failures == {} and [r.compressor for r in compared.runs] == COMPARED
    text = compared.report.read_text()
    assert "`qsgd`" in text and (compared.out / "results.json").exists()
    assert (compared.out / "throughput.png").stat().st_size > 0


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


# -- several emulated nodes -------------------------------------------------------------------------------
#: hierarchy="node" with 2 ranks a node, one DDP bucket: every tensor of MLP splits in two equal halves, so
#: a rank's packets (``none``: 4 bytes a value) are half the gradient, and inside its node it sends the
#: other half with the k = 2 fault flags (reduce-scatter) and its averaged half with its status (all-gather)
HALF, INSIDE = PARAMETERS * 4 // 2, PARAMETERS * 4 + 4 * (2 + 1)
NODES = ["--model", MLP, "--nodes", "2", "--workers", "2", "--option", "hierarchy=node", "--steps", "3",
         "--batch-size", "32", "--eval-every", "3", "--timeout", "60"]


def test_workers_get_torchruns_variables_node_by_node():
    env = [train_module.torchrun_environment(rank, 2, 3, "10.213.0.1", 29511) for rank in range(6)]
    assert [(e["GROUP_RANK"], e["LOCAL_RANK"], e["RANK"]) for e in env] == [
        ("0", "0", "0"), ("0", "1", "1"), ("0", "2", "2"), ("1", "0", "3"), ("1", "1", "4"), ("1", "2", "5")]
    assert {(e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["MASTER_ADDR"],
             e["MASTER_PORT"]) for e in env} == {("3", "6", "2", "10.213.0.1", "29511")}
    with pytest.raises(ValueError, match="nodes must be a positive integer"):
        TrainConfig(nodes=0)


def _check_two_levels(run: Run) -> None:
    assert (run.workers, run.nodes, run.workers_per_node) == (4, 2, 2)
    assert run.label == "none@node" and run.hierarchy == "node"
    assert all(s.samples == 4 * 32 for s in run.steps)  # 4 ranks' batches
    assert {(s.bytes_sent, s.intra_node_bytes) for s in run.steps} == {(HALF, INSIDE)}


@needs_data
def test_two_nodes_of_two_workers_exchange_in_two_levels(tmp_path, capsys):
    """``gradpress train --nodes 2 --workers 2 --option hierarchy=node``: 4 ranks, each node's 2 told so
    by torchrun's variables (LOCAL_WORLD_SIZE; GROUP_RANK and LOCAL_RANK agree with the layout, else the
    ranks' agreement fails): the record's bytes are the two levels'. As root (one run of 4 processes is
    the test's cost: the emulated network where it can be built, loopback otherwise), with --bandwidth:
    the 2 workers of a node share its namespace, and node 0's link carries its ranks' packets between
    nodes (at least both halves: an all-reduce of 2 sends all of its input), and not their exchange inside
    the node (which would add 2 × INSIDE); the namespaces are gone afterwards."""
    from gradpress.cli import main
    from gradpress.testbed import netem

    network = ["--bandwidth", "1gbit"] if ROOT else []
    assert main(["train", *NODES, *network, "--json", str(tmp_path / "run.json")]) == 0
    run = Run.from_json((tmp_path / "run.json").read_text())
    _check_two_levels(run)
    assert capsys.readouterr().out.startswith("none@node: ")
    if not ROOT:
        assert all(s.link_bytes is None for s in run.steps) and run.link_bytes_per_step is None
        return
    assert run.bandwidth == "1gbit" and run.info["network"]["rate"] == "1gbit"
    assert all(2 * HALF <= s.link_bytes < 2 * HALF + INSIDE for s in run.steps), run.steps
    assert netem.namespaces_of(os.getpid()) == []


def test_compare_runs_a_spec_flat_and_in_two_levels():
    """``--compressors`` items ending in ``@node`` run with ``hierarchy="node"``, each item once (a spec
    continued by its parameters keeps its suffix); the other runs keep the shared options."""
    items = run_list("topk:ratio=0.1, topk:ratio=0.1@node, qsgd:levels=16,bucket=512@node,"
                     "topk:ratio=0.1@node")
    assert list(items) == ["topk:ratio=0.1", "topk:ratio=0.1@node", "qsgd:levels=16,bucket=512@node"]
    base = TrainConfig(model=MLP, nodes=2, options={"min_numel": 16})
    assert run_config(base, items[0]).options == {"min_numel": 16}
    two_levels = run_config(base, items[2])
    assert (two_levels.compressor, two_levels.options) == ("qsgd:levels=16,bucket=512",
                                                           {"min_numel": 16, "hierarchy": "node"})
    assert "torch-allreduce" in run_list("demo") and run_list("demo").expanded == set(run_list("demo"))


def test_autos_options_go_to_the_auto_run_alone() -> None:
    """``compare --option measure_with=none``: the ``auto`` run takes it, the fixed methods' runs do not
    (``train`` with a fixed method refuses it: tests/test_cli_errors.py)."""
    from gradpress.testbed.compare import compared_config

    base = config(options={"measure_with": "none", "min_numel": 16})
    assert compared_config(base, "auto").options == {"measure_with": "none", "min_numel": 16}
    assert compared_config(base, "topk:ratio=0.01").options == {"min_numel": 16}
    assert compared_config(base, "torch-allreduce").options == {"min_numel": 16}
