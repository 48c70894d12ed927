"""The ranks' agreement under real Gloo processes (:mod:`gradpress.exchange.agreement`): ranks whose sides have
different components (``"auto"`` against a fixed method), ranks resumed from states of different steps,
and a DDP hook's state keyed another way than the hook keys its parameters. Every case must end in the
same clear ``ValueError`` on every rank: no abort (SIGABRT of a size mismatch), no hang, no silent
divergence. One 2-process run holds every case (spawning costs seconds on a loaded machine)."""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import gradpress
from dist_utils import run_workers
from gradpress.auto import MEASURE_WITH

FIXED = ("none", "topk:ratio=0.1", "qsgd", "thc")
#: (spec, options): methods whose shared random streams (randomk, thc) or schedule (warm-up) follow the steps
STALE = {
    "randomk": ("randomk:ratio=0.25", {}),
    "thc": ("thc", {}),
    "topk warmup": ("topk:ratio=0.1", {"warmup_steps": 2}),
    "auto": ("auto", {}),
}
SAVED_AT = (1, 3)  # steps after which each rank saves its state; rank 1 resumes from the older one


def _grads(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    return {"a": torch.randn(64, 16, generator=g), "b": torch.randn(96, generator=g)}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _backward(ddp: nn.Module, rank: int, step: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + step)
    ddp(torch.randn(8, 16, generator=g)).square().sum().backward()


def _outcome(call) -> tuple[str, str]:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test compares them across ranks
        return type(error).__name__, str(error)
    return "ok", ""


def _mine(rank: int, path: str) -> str:
    """The file this rank resumes from: rank 0 its latest, rank 1 an older one left on its node."""
    return f"{path}.{SAVED_AT[-1] if rank == 0 else SAVED_AT[0]}.{rank}"


def _worker(rank: int, world_size: int, folder: str) -> dict:
    out: dict[Any, Any] = {}
    # -- auto against a fixed method, on either rank --------------------------------------------------
    for fixed in FIXED:
        for auto_rank in (0, 1):
            spec = "auto" if rank == auto_rank else fixed
            comm = gradpress.Communicator(spec)
            out[("comm", fixed, auto_rank)] = _outcome(lambda comm=comm: comm.reduce_many(_grads(rank, 0)))
            ddp = nn.parallel.DistributedDataParallel(_net())
            gradpress.register(ddp, spec)
            out[("ddp", fixed, auto_rank)] = _outcome(lambda ddp=ddp: _backward(ddp, rank, 0))
    # -- ranks resumed from states of different steps ------------------------------------------------
    for label, (spec, options) in STALE.items():
        path = os.path.join(folder, label.replace(" ", "_"))
        comm = gradpress.Communicator(spec, seed=1, **options)
        ddp = nn.parallel.DistributedDataParallel(_net())
        state = gradpress.register(ddp, spec, seed=1, **options)
        for step in range(SAVED_AT[-1]):
            comm.reduce_many(_grads(rank, step))
            _backward(ddp, rank, step)
            if step + 1 in SAVED_AT:
                torch.save(comm.state_dict(), f"{path}.comm.{step + 1}.{rank}")
                torch.save(state.state_dict(), f"{path}.ddp.{step + 1}.{rank}")
        later = _grads(rank, SAVED_AT[-1])
        # into the running communicator and hook (they agreed long ago: the load makes them agree again)
        comm.load_state_dict(torch.load(_mine(rank, f"{path}.comm"), weights_only=False))
        out[("stale comm live", label)] = _outcome(lambda comm=comm, later=later: comm.reduce_many(later))
        state.load_state_dict(torch.load(_mine(rank, f"{path}.ddp"), weights_only=False))
        out[("stale ddp live", label)] = _outcome(lambda ddp=ddp: _backward(ddp, rank, SAVED_AT[-1]))
        # into fresh ones, as after a restart
        fresh = gradpress.Communicator(spec, seed=1, **options)
        fresh.load_state_dict(torch.load(_mine(rank, f"{path}.comm"), weights_only=False))
        out[("stale comm fresh", label)] = _outcome(lambda fresh=fresh, later=later: fresh.reduce_many(later))
        ddp = nn.parallel.DistributedDataParallel(_net())
        gradpress.register(ddp, spec, seed=1, **options).load_state_dict(
            torch.load(_mine(rank, f"{path}.ddp"), weights_only=False))
        out[("stale ddp fresh", label)] = _outcome(lambda ddp=ddp: _backward(ddp, rank, SAVED_AT[-1]))
        # the ranks resumed from the same step exchange as before
        same = gradpress.Communicator(spec, seed=1, **options)
        same.load_state_dict(torch.load(f"{path}.comm.{SAVED_AT[0]}.{rank}", weights_only=False))
        out[("same step", label)] = same.reduce_many(later)
    # -- a state keyed another way than the hook keys the parameters ---------------------------------
    named_ddp = nn.parallel.DistributedDataParallel(_net())
    named = gradpress.register(named_ddp, "topk:ratio=0.25")
    _backward(named_ddp, rank, 0)
    plain_ddp = nn.parallel.DistributedDataParallel(_net())
    plain, hook = gradpress.ddp_comm_hook("topk:ratio=0.25")
    plain_ddp.register_comm_hook(plain, hook)
    _backward(plain_ddp, rank, 0)
    by_name, by_position = named.state_dict(), plain.state_dict()
    fresh_plain = gradpress.ddp_comm_hook("topk:ratio=0.25")[0]
    fresh_named = gradpress.register(nn.parallel.DistributedDataParallel(_net()), "topk:ratio=0.25")
    given_model = gradpress.ddp_comm_hook("topk:ratio=0.25", model=named_ddp.module)[0]
    out["named into plain"] = _outcome(lambda: fresh_plain.load_state_dict(by_name))
    out["named into running plain"] = _outcome(lambda: plain.load_state_dict(by_name))
    out["plain into named"] = _outcome(lambda: fresh_named.load_state_dict(by_position))
    out["named into model="] = _outcome(lambda: given_model.load_state_dict(by_name))
    out["plain into plain"] = _outcome(lambda: fresh_plain.load_state_dict(by_position))
    out["keys"] = (sorted(by_name["steps"]), sorted(by_position["steps"]))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    folder = str(tmp_path_factory.mktemp("agreement"))
    return run_workers(_worker, 2, folder, timeout=240, group_timeout=30)


@pytest.mark.parametrize("front", ["comm", "ddp"])
@pytest.mark.parametrize("fixed", FIXED)
def test_auto_against_a_fixed_method_raises_the_same_error_on_every_rank(two_ranks, front, fixed):
    zero, one = two_ranks
    for auto_rank in (0, 1):
        key = (front, fixed, auto_rank)
        assert zero[key] == one[key], (key, zero[key], one[key])
        kind, message = zero[key]
        # (DDP hands the hook's error on from backward(), as a RuntimeError quoting it where it is async)
        assert kind in ("ValueError", "RuntimeError") and "the ranks disagree" in message, (key, message)
        fixed_rank = 1 - auto_rank
        assert f"rank {auto_rank} has 'auto' (now {MEASURE_WITH!r})" in message, message  # (measuring)
        assert f"rank {fixed_rank} has {fixed!r}" in message, message
        assert "; auto: rank " in message and f"rank {auto_rank} has candidates=" in message, message
        assert f"rank {fixed_rank} has nothing" in message, message


@pytest.mark.parametrize("label", list(STALE))
@pytest.mark.parametrize("case", ["stale comm live", "stale ddp live", "stale comm fresh", "stale ddp fresh"])
def test_ranks_resumed_from_different_steps_raise_naming_the_steps(two_ranks, case, label):
    zero, one = two_ranks
    key = (case, label)
    assert zero[key] == one[key], (key, zero[key], one[key])
    kind, message = zero[key]
    assert kind in ("ValueError", "RuntimeError") and "the ranks disagree" in message, (key, message)
    assert f"the steps: rank 0 has {SAVED_AT[-1]}, rank 1 has {SAVED_AT[0]}" in message, (key, message)


@pytest.mark.parametrize("label", list(STALE))
def test_ranks_resumed_from_the_same_step_exchange_bit_identically(two_ranks, label):
    zero, one = two_ranks
    averaged = zero[("same step", label)]
    assert averaged.keys() == {"a", "b"}
    for key, tensor in averaged.items():
        assert torch.equal(tensor, one[("same step", label)][key]), (label, key)


def test_a_state_keyed_another_way_than_the_hook_is_refused_saying_how_to_fix(two_ranks):
    for ranks in two_ranks:
        names, positions = ranks["keys"]
        assert names == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert positions == [f"param{i}" for i in range(4)]
        for case in ("named into plain", "named into running plain"):
            kind, message = ranks[case]
            assert kind == "ValueError" and "'0.weight'" in message, (case, message)
            assert "pass model=<the module> to ddp_comm_hook" in message, (case, message)
        kind, message = ranks["plain into named"]
        assert kind == "ValueError" and "keys 'param0'" in message and "model=" in message, message
        assert ranks["named into model="] == ("ok", "") and ranks["plain into plain"] == ("ok", "")
