"""Hugging Face Trainer, Lightning Fabric and metrics logging as their users run them, and what an IDE
or a REPL shows of the front ends (reprs, the options in the docstrings, the error classes exported).

The multi-process checks read what the shared 2-process run recorded (``frameworks_harness.py``):
the Trainer (through :class:`gradpress.huggingface.GradpressCallback`) and Fabric (through
:class:`gradpress.lightning.GradpressFabricStrategy`) each train 6 steps with a checkpoint at step 3
written by the framework's own mechanism, resume from it in a fresh Trainer / Fabric, and must end
with the uninterrupted run's parameters bit for bit on every rank, which holds only if each rank got
its own compression state back (the control, the same checkpoint without it, ends elsewhere).
"""
from __future__ import annotations

import builtins
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch

import gradpress
from frameworks_harness import doc_blocks, framework_of, needs, result, shared_run
from gradpress.auto import AutoOptions
from gradpress.exchange.pipeline import Options

README = Path(__file__).resolve().parents[1] / "README.md"


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- Hugging Face Trainer -------------------------------------------------------------------------------
def test_huggingface_trainer_callback_resumes_every_rank_bit_identically():
    needs("transformers")
    rank0, rank1 = result(shared_run(), "huggingface")
    assert _identical(rank0["whole"]["parameters"], rank1["whole"]["parameters"])
    for rank, found in enumerate((rank0, rank1)):
        assert found["whole"]["sent_bytes"] > 0 and found["resumed"]["sent_bytes"] > 0  # the hook ran
        # every rank's own state in the Trainer's checkpoint folder, taken at step 3
        files = set(found["whole"]["files"])
        assert {"gradpress_rank0.pt", "gradpress_rank1.pt", "trainer_state.json"} <= files
        assert found["saved_rank"] == rank and set(found["saved_steps"].values()) == {3}
        assert _identical(found["whole"]["parameters"], found["resumed"]["parameters"]), \
            f"rank {rank}: the run resumed with train(resume_from_checkpoint=…) differs"
        # the control: without the gradpress files the same checkpoint resumes differently, and warns
        assert not _identical(found["whole"]["parameters"], found["fresh"])
        assert any(f"holds no gradpress state for rank {rank}" in w for w in found["fresh_warnings"])


def test_huggingface_callback_logs_flat_figures_at_the_trainers_logging_steps_and_checks_options():
    needs("transformers")
    for found in result(shared_run(), "huggingface"):
        assert found["whole"]["logged_steps"] == [2, 4, 6]  # logging_steps=2
        assert found["whole"]["logged_total"] == found["whole"]["sent_bytes"]
        assert found["whole"]["repr"] == "GradpressState('topk:ratio=0.05')"  # (seed=0 is the default)
        assert found["callback_repr"] == "GradpressCallback('topk:ratio=0.05', seed=0, log_stats=True)"
        assert [r.split(":")[0] for r in found["refused"]] == ["ValueError", "ValueError", "TypeError"]
        assert "bogus" in found["refused"][2]


# -- Lightning Fabric ------------------------------------------------------------------------------------
def test_fabric_strategy_saves_every_rank_and_resumes_bit_identically():
    needs("lightning")
    rank0, rank1 = result(shared_run(), "fabric")
    assert _identical(rank0["whole"], rank1["whole"])
    assert rank0["saved_ranks"] == [[0, 1]], "Fabric's checkpoint lacks a rank's gradpress state"
    for rank, found in enumerate((rank0, rank1)):
        assert found["sent_bytes"] > 0 and found["resumed_sent_bytes"] > 0
        assert found["remainder_keys"] == ["step"]  # fabric.load returns the rest, not "gradpress"
        assert _identical(found["whole"], found["resumed"]), f"rank {rank}: the loaded run differs"
        assert not _identical(found["whole"], found["fresh"])
        assert any("holds no gradpress state" in w for w in found["fresh_warnings"])


def test_register_takes_the_module_fabric_set_up_with_its_own_ddp_strategy():
    needs("lightning")
    for found in result(shared_run(), "fabric"):
        # the same hook, seed and data as through GradpressFabricStrategy: the same training, bit for bit
        assert found["plain_sent_bytes"] == found["sent_bytes"] > 0
        assert _identical(found["plain"], found["whole"])
        assert found["repr"] == "GradpressState('topk:ratio=0.05')"


def test_register_refuses_a_fabric_module_without_ddp_saying_so():
    pytest.importorskip("lightning")
    from lightning.fabric.wrappers import _FabricModule

    with pytest.raises(TypeError, match="Fabric module wraps a Linear, not a DistributedDataParallel"):
        gradpress.register(_FabricModule(torch.nn.Linear(4, 2), strategy=None), "topk:ratio=0.5")


def test_fabric_and_lightning_strategies_take_exclude_and_check_options_at_once():
    pytest.importorskip("lightning")
    from gradpress.lightning import GradpressFabricStrategy, GradpressStrategy

    # exclude matches the parameter names of the model the strategy is given later
    strategy = GradpressStrategy("topk:ratio=0.1", exclude=["*.bias"], seed=2)
    assert strategy._gradpress_options == {"exclude": ["*.bias"], "seed": 2}
    assert repr(strategy) == "GradpressStrategy('topk:ratio=0.1', exclude=['*.bias'], seed=2)"
    fabric = GradpressFabricStrategy("topk:ratio=0.1", exclude="*.bias", find_unused_parameters=True,
                                     process_group_timeout=90)
    assert fabric._ddp_kwargs == {"find_unused_parameters": True} and fabric._timeout.total_seconds() == 90
    for bad in ({"spec": "topk:ratio=2"}, {"spec": "topk", "seed": -1}, {"spec": "auto", "margin": 2}):
        with pytest.raises(ValueError):
            GradpressFabricStrategy(**bad)


# -- logging the figures ----------------------------------------------------------------------------------
def test_lightning_strategy_log_stats_reaches_the_trainers_logger():
    needs("lightning")
    for found in result(shared_run(), "lightning"):
        logged, flat = found["logged"], found["flat"]
        for key in ("gradpress/sent_bytes", "gradpress/compression_ratio", "gradpress/compress_ms",
                    "gradpress/total/sent_bytes", "gradpress/total/comm_ms"):
            assert key in logged
        # the last logged step is the last step (log_every_n_steps=3, 6 steps); Lightning logs float32
        as_logged = float(torch.tensor(flat["gradpress/total/sent_bytes"], dtype=torch.float32))
        assert logged["gradpress/total/sent_bytes"] == as_logged > 0


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_flat_stats_of_a_real_exchange(world_of_one):
    comm = gradpress.Communicator("topk:ratio=0.25", seed=1, timeout=30)
    for _ in range(2):
        comm.reduce_many({"a": torch.randn(64), "b": torch.randn(8, 8)})
    report, flat = comm.stats(), comm.stats(flat=True)
    assert flat == gradpress.flat_stats(report)
    assert flat["gradpress/steps"] == 2
    last, total = report["last"], report["total"]
    assert flat["gradpress/sent_bytes"] == last["sent_bytes"]
    assert flat["gradpress/total/sent_bytes"] == total["sent_bytes"]
    assert flat["gradpress/total/collectives"] == total["collectives"]
    assert flat["gradpress/compress_ms"] == last["compress_s"] * 1e3
    assert flat["gradpress/total/comm_ms"] == total["comm_s"] * 1e3
    assert flat["gradpress/compression_ratio"] == last["raw_bytes"] / last["packet_bytes"] > 1
    assert all(isinstance(value, float) for value in flat.values())
    assert not any(key.endswith("_s") for key in flat)  # times in milliseconds only
    assert repr(comm) == "Communicator('topk:ratio=0.25', seed=1, timeout=30)"
    # nothing exchanged yet: zeros, and no ratio
    fresh = gradpress.Communicator("none").stats(flat=True)
    assert fresh["gradpress/total/sent_bytes"] == 0 and "gradpress/compression_ratio" not in fresh


# -- Accelerate under a launcher it did not set up for --------------------------------------------------
def test_accelerate_register_raises_when_the_launcher_started_processes_accelerate_runs_alone():
    needs("accelerate")
    for found in result(shared_run(), "accelerate"):
        assert found["alone_type"].endswith("NO")  # Accelerator() without cpu=True on a CPU machine
        error = found["alone_error"]
        assert error is not None and "the launcher started 2 processes" in error
        assert "did not set up distributed training" in error
        assert "Accelerator(cpu=True)" in error and "ACCELERATE_USE_CPU=1" in error


# -- docs/integrations.md's examples ----------------------------------------------------------------------
DOCS = doc_blocks()


def test_integrations_doc_has_runnable_examples():
    assert len(DOCS) >= 5  # Lightning Trainer, Accelerate, Hugging Face Trainer, Fabric, logging


@pytest.mark.parametrize("index", range(len(DOCS)))
def test_integrations_doc_example_runs_in_2_processes(index):
    module = framework_of(DOCS[index])
    if module is not None:
        needs(module)
    rank0, rank1 = result(shared_run(), f"docs{index}")
    for found in (rank0, rank1):
        assert found.get("sent_bytes", 0) > 0, "the example's gradpress state sent nothing: no hook ran"
    assert "parameters" in rank0, "the example leaves no `model` (or `trainer`) to compare"
    assert _identical(rank0["parameters"], rank1["parameters"])


# -- what an IDE and a REPL show ---------------------------------------------------------------------------
def test_reprs_show_the_spec_and_the_options_not_at_their_default():
    model = torch.nn.Linear(4, 2)
    state, _ = gradpress.ddp_comm_hook("topk:ratio=0.05", model=model, seed=3, exclude="*.bias", timeout=60)
    assert repr(state) == "GradpressState('topk:ratio=0.05', exclude=('*.bias',), seed=3, timeout=60)"
    assert repr(gradpress.ddp_comm_hook("qsgd")[0]) == "GradpressState('qsgd')"
    auto = gradpress.ddp_comm_hook("auto", measure_steps=3)[0]
    assert repr(auto) == "GradpressState('auto', measure_steps=3)"


@pytest.mark.parametrize("documented", [gradpress.register, gradpress.ddp_comm_hook, gradpress.Communicator],
                         ids=lambda f: f.__name__)
def test_every_option_is_documented_in_the_front_ends_own_docstring(documented):
    text = documented.__doc__
    missing = [f.name for f in (*fields(Options), *fields(AutoOptions)) if f"``{f.name}``" not in text]
    assert not missing, f"{documented.__name__}'s docstring does not document {missing}"


def test_every_error_class_the_readme_names_is_exported():
    named = set(re.findall(r"\b([A-Z]\w*(?:Error|Failed))\b", README.read_text()))
    ours = sorted(name for name in named if not hasattr(builtins, name))
    assert ours, "the README names no gradpress error class"
    missing = [name for name in ours if not isinstance(getattr(gradpress, name, None), type)]
    assert not missing, f"gradpress does not export {missing}"
    assert all(name in gradpress.__all__ for name in ours)
    assert issubclass(gradpress.ExchangeFailed, RuntimeError)
    assert issubclass(gradpress.NonFiniteError, ValueError)
