"""The fault suite: what gradpress does when one rank goes wrong (bounded in time: every multi-process
run has a deadline and a process-group timeout, so a hang fails the test instead of blocking CI).

* NaN/Inf on any rank, for every registered method under every strategy: every rank raises the same
  NonFiniteError naming the faulty rank(s), and no feedback memory takes the bad step in;
* ranks that disagree (spec, options, shapes): every rank raises one ValueError saying what differs;
* corrupt or foreign state dicts: a ValueError naming the key, nothing loaded;
* a worker killed mid-step: its peers raise (ExchangeFailed or the backend's error), never hang.
"""
from __future__ import annotations

import copy
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradpress
from dist_utils import run_workers, without_warm_up
from gradpress.core.compressor import NonFiniteError
from gradpress.exchange.state import gathered
from specs import COMPOSITIONS

STRATEGIES = {
    "allreduce/allgather": {},
    "ps": {"mode": "ps", "root": 1},
    "switch": {"mode": "switch"},
    "bidirectional": {"mode": "ps", "master": "natural"},
}


def _gradients(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"a": torch.randn(64, 16, generator=g), "b": torch.randn(96, generator=g)} for _ in range(n)]


def _applicable(spec: str, options: dict) -> bool:
    """Whether ``spec`` runs under ``options`` at all (a switch adds integers only). (Without the kernels'
    warm-up: this runs at import, also in every spawned rank.)"""
    try:
        gradpress.Simulator(spec, 2, warm_up=False, **options).step(_gradients(2))
    except ValueError as error:
        if "switch" in str(error):
            return False
        raise
    return True


CASES = [(spec, name) for spec in gradpress.compressor_names() + COMPOSITIONS for name in STRATEGIES
         if _applicable(spec, STRATEGIES[name])]


def _memory(sim: gradpress.Simulator) -> list[dict]:
    return [copy.deepcopy(state["feedback"]) for state in sim.state_dict()]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_same(x, y)
                                                                for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("spec,strategy", CASES)
def test_a_faulty_rank_is_named_by_every_rank_and_no_memory_takes_the_step(spec, strategy):
    n = 3
    for faulty in ([0], [2], [0, 2]):
        sim = gradpress.Simulator(spec, n, seed=1, warm_up=False, **STRATEGIES[strategy])  # (kernels: on first use)
        sim.step(_gradients(n, seed=1))
        before = _memory(sim)
        bad = _gradients(n, seed=2)
        for r in faulty:
            bad[r]["b"][5] = float("nan") if r == 0 else float("inf")
        with pytest.raises(NonFiniteError) as raised:
            sim.step(bad)
        assert raised.value.ranks == faulty, (spec, strategy, str(raised.value))
        assert f"of rank{'s' if len(faulty) > 1 else ''} {', '.join(map(str, faulty))}" in str(raised.value)
        assert _same(before, _memory(sim)), "a memory took in the step that failed"


def test_the_fault_flag_rides_in_buffers_the_exchange_sends_anyway():
    """A healthy step issues no collective for the flags: as many as the method's rounds need (a sketch
    sums its bitmap and its counters apart: two dtypes)."""
    for spec, collectives in [("none", 1), ("topk:ratio=0.1", 1), ("qsgd", 1), ("randomk", 1), ("thc", 2),
                              ("powersgd", 2), ("cltk", 2), ("sketch", 2)]:
        sim = gradpress.Simulator(spec, 2, warm_up=False)
        sim.step(_gradients(2))
        assert sim.stats()[0]["last"]["collectives"] == collectives, spec


# -- ranks that disagree, faults under real Gloo processes ------------------------------------------
def _nan_on(rank: int, faulty: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if rank == faulty:
        tensors["b"] = tensors["b"].clone()
        tensors["b"][3] = float("nan")
    return tensors


def _outcome(call) -> tuple[str, str, Any]:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test compares them across ranks
        return type(error).__name__, str(error), getattr(error, "ranks", None)
    return "ok", "", None


def _faults(rank: int, world_size: int) -> dict:
    out: dict[str, Any] = {}
    for spec in gradpress.compressor_names():
        for name, options in STRATEGIES.items():
            if (spec, name) not in CASES:
                continue
            for faulty in range(world_size):
                comm = gradpress.Communicator(spec, seed=3, **options)
                comm.reduce_many(_gradients(1, seed=rank)[0])
                tensors = _nan_on(rank, faulty, _gradients(1, seed=10 + rank)[0])
                out[("comm", spec, name, faulty)] = _outcome(
                    lambda comm=comm, tensors=tensors: comm.reduce_many(tensors))
    for spec in ("none", "topk:ratio=0.1", "natural", "qsgd", "signsgd", "thc", "sketch", "cltk", "powersgd"):
        for faulty in range(world_size):
            torch.manual_seed(0)
            ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
            x = torch.randn(8, 16)
            if rank == faulty:
                x[2, 3] = float("inf")
            state = gradpress.register(ddp, spec)
            kind, message, _ = _outcome(lambda ddp=ddp, x=x: ddp(x).square().sum().backward())
            out[("ddp", spec, faulty)] = (kind, message, getattr(state.error, "ranks", None))
    # ranks that disagree
    specs = ["topk:ratio=0.1", "topk:ratio=0.2"]
    out["spec"] = _outcome(lambda: gradpress.Communicator(specs[rank]).reduce(torch.ones(8), "w"))
    out["seed"] = _outcome(lambda: gradpress.Communicator("randomk", seed=rank).reduce(torch.ones(8), "w"))
    out["shape"] = _outcome(lambda: gradpress.Communicator("qsgd").reduce(torch.ones(8 + rank), "w"))
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
    gradpress.register(ddp, ["topk:ratio=0.1", "qsgd"][rank])
    out["ddp spec"] = _outcome(lambda: ddp(torch.randn(8, 16)).sum().backward())
    return out


def _scenarios(rank: int, world_size: int, folder: str) -> dict:
    """Every multi-process scenario of this module in one pair of processes, each on a Communicator or a
    DDP of its own: the faults and disagreements, then the one that kills rank 1 (its results of the
    others saved first, to ``folder``/rank1.pt)."""
    without_warm_up()  # (a Simulator's run for each of ~100 Communicators' settings and dtypes)
    out = _faults(rank, world_size)
    out["killed"] = _killed(rank, world_size, out, folder)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("faults")
    ranks = run_workers(_scenarios, 2, str(folder), timeout=420, group_timeout=20, may_exit=frozenset({1}))
    ranks[1] = torch.load(str(folder / "rank1.pt"), weights_only=False)
    return ranks


def test_every_rank_raises_the_same_nonfinite_error_for_every_method_and_strategy(two_ranks):
    zero, one = two_ranks
    cases = [key for key in zero if key[0] in ("comm", "ddp")]
    assert len(cases) > 2 * len(gradpress.compressor_names())
    for key in cases:
        faulty = key[-1]
        kind, message, ranks = zero[key]
        assert (kind, message, ranks) == one[key], (key, zero[key], one[key])
        if key[0] == "comm":
            assert kind == "NonFiniteError" and ranks == [faulty], (key, zero[key])
        else:  # DDP hands the hook's error on from backward() (as a RuntimeError quoting it, if async)
            assert kind in ("NonFiniteError", "RuntimeError") and f"of rank {faulty}" in message, (key, message)
            assert ranks == [faulty], (key, ranks)  # state.error: the NonFiniteError itself


@pytest.mark.parametrize("case,says", [
    ("spec", "the compressor: rank 0 has 'topk:ratio=0.1', rank 1 has 'topk:ratio=0.2'"),
    ("seed", "seed=0"),
    ("shape", "the shapes: rank 0 has [(8,)], rank 1 has [(9,)]"),
    ("ddp spec", "the compressor: rank 0 has 'topk:ratio=0.1', rank 1 has 'qsgd'"),
])
def test_ranks_that_disagree_raise_one_clear_error(two_ranks, case, says):
    zero, one = two_ranks
    assert zero[case] == one[case], (zero[case], one[case])
    kind, message, _ = zero[case]
    assert kind in ("ValueError", "RuntimeError") and "disagree" in message and says in message, message


# -- state dicts ----------------------------------------------------------------------------------------
def _trained(spec: str = "topk:ratio=0.25", workers: int = 2, **options) -> gradpress.Simulator:
    sim = gradpress.Simulator(spec, workers, **options)
    for s in range(2):
        sim.step(_gradients(workers, seed=s))
    return sim


def test_corrupt_and_foreign_states_raise_naming_the_key():
    sim = _trained()
    good = sim.state_dict()[0]
    fresh = lambda **options: gradpress.Simulator("topk:ratio=0.25", 2, **options).pipelines[0]  # noqa: E731
    cases = {
        "expected the dict": None,
        "got list": [good],
        "missing 'steps'": {k: v for k, v in good.items() if k != "steps"},
        "feedback_spec is 'residual'": (good, {"feedback": "none"}),
    }
    for says, state in cases.items():
        options = {}
        if isinstance(state, tuple):
            state, options = state
        with pytest.raises(ValueError, match=says):
            fresh(**options).load_state_dict(state)
    nan = copy.deepcopy(good)
    nan["feedback"]["memory"]["a"][0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"feedback\['memory'\]\['a'\] holds NaN/Inf"):
        fresh().load_state_dict(nan)
    wrong = copy.deepcopy(good)
    wrong["feedback"]["memory"]["b"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"\['b'\] has shape \(5,\)"):
        fresh().load_state_dict(wrong)
    no_memory = _trained(feedback="none").state_dict()[0]
    with pytest.raises(ValueError, match="feedback_spec is 'none'"):
        fresh().load_state_dict(no_memory)
    with pytest.raises(ValueError, match="spec is 'topk:ratio=0.25'"):
        gradpress.Simulator("randomk", 2).pipelines[0].load_state_dict(good)


def test_a_powersgd_warm_start_of_the_wrong_shape_is_refused():
    sim = _trained("powersgd")
    state = copy.deepcopy(sim.state_dict()[0])
    assert tuple(state["compressor"]["warm"]["a"].shape) == (1, 16)
    state["compressor"]["warm"]["a"] = torch.zeros(1, 5)
    with pytest.raises(ValueError, match=r"warm start of 'a' is \(1, 5\), expected \(1, 16\)"):
        gradpress.Simulator("powersgd", 2).pipelines[0].load_state_dict(state)


def test_another_ranks_state_is_refused_and_a_gathered_state_gives_each_rank_its_own():
    sim = _trained()
    states = sim.state_dict()
    with pytest.raises(ValueError, match="rank is 0, this runtime's is 1.*gathered=True"):
        gradpress.Simulator("topk:ratio=0.25", 2).pipelines[1].load_state_dict(states[0])
    with pytest.raises(ValueError, match="world_size"):
        gradpress.Simulator("topk:ratio=0.25", 3).pipelines[0].load_state_dict(states[0])
    resumed = gradpress.Simulator("topk:ratio=0.25", 2)
    resumed.load_state_dict(gathered(states))
    later = _gradients(2, seed=9)
    assert torch.equal(resumed.step(later)["a"], sim.step(later)["a"])


def test_a_loaded_state_must_fit_the_tensors_it_meets():
    sim = _trained()
    resumed = gradpress.Simulator("topk:ratio=0.25", 2)
    resumed.load_state_dict(sim.state_dict())
    other = [{"a": torch.randn(64, 8), "b": torch.randn(96)} for _ in range(2)]
    with pytest.raises(ValueError, match=r"'a' has shape \(64, 8\); the loaded gradpress state was saved for \(64, 16\)"):
        resumed.step(other)


# -- a worker killed mid-step -------------------------------------------------------------------------
def _killed(rank: int, world_size: int, before: dict, folder: str) -> dict:
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    gradpress.register(ddp, "topk:ratio=0.1", timeout=5)
    ddp(torch.randn(8, 16)).sum().backward()  # a healthy step
    if rank == 1:  # killed in the middle of the next backward pass
        torch.save(before, str(Path(folder) / "rank1.pt"))
        ddp.module[2].weight.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
    start = time.monotonic()
    kind, message, _ = _outcome(lambda: (ddp(torch.randn(8, 16)).sum().backward(),
                                         ddp(torch.randn(8, 16)).sum().backward()))
    return {"raised": kind, "message": message, "seconds": time.monotonic() - start}


def test_a_worker_killed_mid_step_makes_its_peer_raise(two_ranks):
    survivor = two_ranks[0]["killed"]
    assert survivor["raised"] != "ok", "the survivor's exchange with a dead peer must raise"
