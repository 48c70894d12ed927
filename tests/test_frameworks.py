"""Lightning, Accelerate and plain DDP as their users run them: 2 Gloo processes, real packages.

The processes are shared with the README's multi-process examples (``frameworks_harness.py``): every
check here reads what one 2-process run recorded. Lightning and Accelerate each train 6 steps,
checkpoint at step 3 through the framework's own mechanism (ModelCheckpoint; ``save_state``) and
resume in a fresh trainer / accelerator: the resumed run must equal the uninterrupted one bit for bit on
every rank, which holds only if each rank got its own compression state back.
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

import gradpress
from frameworks_harness import needs, result, shared_run


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lightning_strategy_trains_through_gradpress_and_resumes_bit_identically():
    needs("lightning")
    rank0, rank1 = result(shared_run(), "lightning")
    for found in (rank0, rank1):
        assert found["sent_bytes"] > 0 and found["resumed_sent_bytes"] > 0  # the hook ran, on the CPU
    assert _identical(rank0["whole"], rank1["whole"]), "ranks ended with different parameters"
    assert rank0["saved_ranks"] == [0, 1], "Lightning's checkpoint lacks a rank's gradpress state"
    assert all(steps and set(steps.values()) == {3} for steps in rank0["saved_steps"])
    for rank, found in enumerate((rank0, rank1)):
        assert _identical(found["whole"], found["resumed"]), f"rank {rank}: resumed run differs"
        # the control: without the compression state, the same checkpoint resumes differently, with a warning
        assert not _identical(found["whole"], found["fresh"])
        assert any("holds no gradpress state" in w for w in found["fresh_warnings"])


def test_lightning_stock_ddp_strategy_on_cpu_warns_instead_of_silently_skipping_the_hook():
    needs("lightning")
    for found in result(shared_run(), "lightning"):
        assert found["stock_sent_bytes"] == 0
        assert len(found["stock_warnings"]) == 1
        assert "no gradient bucket has gone through the gradpress hook" in found["stock_warnings"][0]
        assert "registers comm hooks only on CUDA" in found["stock_warnings"][0]


def test_accelerate_registers_and_resumes_every_rank_bit_identically():
    needs("accelerate")
    rank0, rank1 = result(shared_run(), "accelerate")
    for found in (rank0, rank1):
        assert found["whole"]["processes"] == 2 and found["whole"]["distributed_type"].endswith("MULTI_CPU")
        assert found["whole"]["sent_bytes"] > 0 and found["resumed"]["sent_bytes"] > 0
    assert _identical(rank0["whole"]["parameters"], rank1["whole"]["parameters"])
    for rank, found in enumerate((rank0, rank1)):
        assert _identical(found["whole"]["parameters"], found["resumed"]["parameters"]), \
            f"rank {rank}: resumed run differs from the whole one"


def test_ddp_model_whose_hook_never_runs_warns_once():
    for found in result(shared_run(), "noop"):
        assert found["unregistered"]["sent_bytes"] == 0
        assert len(found["unregistered"]["warnings"]) == 1  # once, over 4 steps
        assert "ddp.register_comm_hook" in found["unregistered"]["warnings"][0]
        assert found["registered"]["warnings"] == [] and found["registered"]["sent_bytes"] > 0
        # gradient accumulation under no_sync(): the hook runs only at the last micro-step, no warning
        for case in ("no_sync", "pair_no_sync"):  # the DDP, or the module inside it, watched
            assert found[case]["warnings"] == [] and found[case]["sent_bytes"] > 0


def test_lightning_strategy_refuses_a_second_comm_hook_and_checks_options_at_once():
    pytest.importorskip("lightning")
    from gradpress.lightning import GradpressStrategy

    with pytest.raises(TypeError, match="ddp_comm_hook"):
        GradpressStrategy("topk:ratio=0.1", ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError):
        GradpressStrategy("topk:ratio=2")
    strategy = GradpressStrategy("topk:ratio=0.1", seed=3, find_unused_parameters=True,
                                 process_group_timeout=90)
    assert strategy._gradpress_options == {"seed": 3}
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy._timeout.total_seconds() == 90


def test_accelerate_register_in_one_process_warns_and_refuses_an_unwrapped_model_in_several():
    pytest.importorskip("accelerate")
    import gradpress.accelerate

    model = torch.nn.Linear(4, 2)
    with pytest.warns(RuntimeWarning, match="single process"):
        assert gradpress.accelerate.register(SimpleNamespace(num_processes=1), model, "topk:ratio=0.5") \
            is None
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        gradpress.accelerate.register(SimpleNamespace(num_processes=2), model, "topk:ratio=0.5")


def test_the_no_op_watch_does_not_break_copies_or_pickles_of_the_model():
    import copy
    import io

    model = torch.nn.Linear(4, 2)
    state, _ = gradpress.ddp_comm_hook("topk:ratio=0.5", model=model)
    twin = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for m in (twin, loaded):
            m(torch.randn(3, 4)).sum().backward()
            m(torch.randn(3, 4))  # a copy's hook is inert: no warning, no reference to the state
    assert record == [] and state._sync_forwards == 0
