"""The sharded rows of ``gradpress train`` and ``compare``: FSDP2's own (``torch-fsdp``, ``torch-hsdp``) and
gradpress on its meshes (``SPEC@fsdp``, ``SPEC@hsdp``), parsed in this process and run in real workers."""
from __future__ import annotations

import os

import pytest

from gradpress.testbed import data
from gradpress.testbed.compare import run_config, run_list
from gradpress.testbed.report import write_report
from gradpress.testbed.results import Eval, Run, Step
from gradpress.testbed.train import TrainConfig, check_exchange, train
from gradpress.testbed.training.sharded import mesh_shape

needs_data = pytest.mark.skipif(not data.FASHION_MNIST_DIR.exists(),
                                reason="Fashion-MNIST is not installed (gradpress data fashion-mnist, as root)")
MLP = "mlp:hidden=32,depth=1"
#: the MLP's gradient in fp32: every tensor's first dimension is even, so FSDP pads nothing over 2 ranks
GRADIENT = ((784 * 32 + 32) + (32 * 10 + 10)) * 4
ROOT = os.geteuid() == 0


def config(**changes) -> TrainConfig:
    return TrainConfig(**{"model": MLP, "workers": 2, "steps": 3, "eval_every": 3, "batch_size": 32,
                          "timeout": 60, **changes})


def test_the_suffixes_and_references_of_the_sharded_rows_are_parsed():
    """``@hsdp``/``@fsdp`` set the run's mesh, as ``@node`` sets its option; FSDP2's own rows set theirs;
    a suffix on a reference, an unknown one, or a mesh for DDP's hooks is refused."""
    items = run_list("torch-fsdp, torch-hsdp, topk:ratio=0.1@hsdp, fp16@fsdp, topk:ratio=0.1@node")
    assert list(items) == ["torch-fsdp", "torch-hsdp", "topk:ratio=0.1@hsdp", "fp16@fsdp",
                           "topk:ratio=0.1@node"]
    base = TrainConfig(model=MLP, nodes=2, options={"min_numel": 16})
    runs = [run_config(base, item) for item in items]
    assert [(r.compressor, r.sharding) for r in runs] == [
        ("torch-fsdp", "fsdp"), ("torch-hsdp", "hsdp"), ("topk:ratio=0.1", "hsdp"), ("fp16", "fsdp"),
        ("topk:ratio=0.1", None)]
    assert runs[2].options == {"min_numel": 16} and runs[4].options["hierarchy"] == "node"
    assert [mesh_shape(r) for r in runs[:2]] == [(4,), (2, 2)]
    assert mesh_shape(config(compressor="torch-hsdp")) == (2, 1)  # one node: each worker a replica
    for bad, said in [("torch-hsdp@hsdp", "takes no suffix"), ("topk@ddp", "expected SPEC@node"),
                      ("topk@", "SPEC@hsdp")]:
        with pytest.raises(Exception, match=said):
            run_list(bad)
    with pytest.raises(ValueError, match="DDP's"):
        TrainConfig(compressor="torch-allreduce", sharding="hsdp")
    with pytest.raises(ValueError, match="sharding must be one of fsdp, hsdp"):
        TrainConfig(sharding="zero3")


def test_what_a_sharded_run_cannot_do_is_refused_before_any_worker_starts():
    """On the 1-D mesh only methods whose summands add (gradpress.fsdp.scatter_methods) compress the
    reduce-scatter; ``auto`` and ``hierarchy`` have no sharded run."""
    check_exchange(config(compressor="fp16", sharding="fsdp"))
    check_exchange(config(compressor="topk:ratio=0.1", sharding="hsdp", nodes=2))
    check_exchange(config(compressor="torch-hsdp", nodes=2))
    refused = [(config(compressor="topk:ratio=0.1", sharding="fsdp"),
                "@fsdp compresses FSDP's reduce-scatter, whose summands must add element-wise over the ranks; "
                "topk:ratio=0.1 cannot \\(methods that can: .*fp16"),
               (config(compressor="fp16", sharding="fsdp", options={"mode": "ps"}), "mode 'collective'"),
               (config(compressor="auto", sharding="hsdp"), "does not run 'auto'"),
               (config(compressor="topk", sharding="hsdp", options={"hierarchy": "node"}), "no hierarchy")]
    for run, said in refused:
        with pytest.raises(ValueError, match=said):
            check_exchange(run)


@needs_data
def test_compare_refuses_a_method_that_cannot_scatter_on_the_1d_mesh(tmp_path, monkeypatch, capsys):
    from gradpress.cli import main
    from gradpress.testbed import compare as compare_module

    monkeypatch.setattr(compare_module, "compare", lambda *a, **k: pytest.fail("a run started"))
    try:
        code = main(["compare", "--model", MLP, "--compressors", "torch-fsdp,topk:ratio=0.1@fsdp",
                     "--out", str(tmp_path / "out")])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "--compressors: topk:ratio=0.1@fsdp: @fsdp compresses FSDP's reduce-scatter" in err


@needs_data
def test_fsdp2s_own_rows_train_evaluate_and_count_their_reduction():
    """One node of 2 workers: ``torch-fsdp`` reduce-scatters the whole fp32 gradient, ``torch-hsdp`` (2
    replicas of 1 shard) all-reduces it; both evaluate (rank 0, on the gathered parameters) and learn."""
    for name in ("torch-fsdp", "torch-hsdp"):
        run = train(config(compressor=name), progress=False)
        assert (run.label, run.sharding) == (name, name[-4:])
        assert [s.step for s in run.steps] == [1, 2, 3]
        assert {(s.bytes_sent, s.intra_node_bytes) for s in run.steps} == {(GRADIENT, 0)}, name
        assert all(s.comm_s > 0 and s.compute_s > 0 and s.compress_s == 0 for s in run.steps)
        assert [e.step for e in run.evals] == [0, 3] and run.evals[-1].value > run.evals[0].value


def test_the_report_says_what_the_sharded_rows_count(tmp_path):
    """A sharded run keeps its mesh in its record (``info["sharding"]``) and its row name; the report's
    notes say that its bytes are the gradients' reduction, the parameters' all-gathers left out."""
    steps = tuple(Step(i, 0, 0.1 * i, 0.05, 0.01, 0.02, 1000, 64) for i in range(1, 5))
    evals = (Eval(0, 4, 0.4, 4000, "accuracy", 0.8, True, loss=0.5),)
    runs = [Run(name, MLP, "fashion-mnist", 2, None, 0, steps, evals, info={"sharding": mesh})
            for name, mesh in [("torch-hsdp", "hsdp"), ("fp16", "fsdp"), ("torch-allreduce", None)]]
    assert [r.label for r in runs] == ["torch-hsdp", "fp16@fsdp", "torch-allreduce"]
    assert Run.from_json(runs[1].to_json()).sharding == "fsdp"
    text = write_report(runs, tmp_path).read_text()
    assert "`fp16@fsdp`" in text and "not FSDP's all-gathers of the parameters" in text
    assert "all-gathers" not in write_report(runs[2:], tmp_path).read_text()


@needs_data
def test_gradpress_between_the_replicas_of_two_nodes(tmp_path, capsys):
    """``train --nodes 2 --workers 2 --compressor topk:ratio=0.1@hsdp``: a (2, 2) mesh, each node's 2
    workers the shards. A rank's packets are top-k of its half of the gradient, and inside its node
    FSDP's reduce-scatter sends the other half. As root, over the emulated network: node 0's link carries
    the packets between the replicas, and not the exchange inside the node."""
    from gradpress.cli import main
    from gradpress.testbed import netem

    network = ["--bandwidth", "1gbit"] if ROOT else []
    argv = ["train", "--model", MLP, "--nodes", "2", "--workers", "2", "--compressor", "topk:ratio=0.1@hsdp",
            "--steps", "3", "--batch-size", "32", "--eval-every", "3", "--timeout", "60", *network,
            "--json", str(tmp_path / "run.json")]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("topk:ratio=0.1@hsdp: ")
    run = Run.from_json((tmp_path / "run.json").read_text())
    assert (run.workers, run.nodes, run.sharding, run.label) == (4, 2, "hsdp", "topk:ratio=0.1@hsdp")
    assert [e.step for e in run.evals] == [0, 3] and all(s.samples == 4 * 32 for s in run.steps)
    assert {s.intra_node_bytes for s in run.steps} == {GRADIENT // 2}
    assert all(0 < s.bytes_sent < GRADIENT // 2 * 0.3 for s in run.steps)  # 10 %: values and indices
    if ROOT:
        # node 0's link carries both of its ranks' packets and nothing of the exchange inside the node.
        # Its bytes are counted over rank 0's steps: rank 1's packet of a step goes out after that step's
        # reduce-scatter inside the node began (rank 0 is in it), but may still be on its way when rank
        # 0's step ends, so it can fall into the next step's count, and the last step's out of them all
        assert all(s.bytes_sent <= s.link_bytes < GRADIENT // 2 for s in run.steps), run.steps
        sent = [s.bytes_sent for s in run.steps]
        assert sum(s.link_bytes for s in run.steps) >= 2 * sum(sent) - sent[-1], run.steps
        assert netem.namespaces_of(os.getpid()) == []
