"""Multi-process tests of the runtime: Gloo on the CPU, 2-3 processes.

Few spawns, many checks each (spawning costs seconds on a loaded machine): one 3-process run trains a
small model under every registered compressor and the runtime's modes (parameter server, switch,
partial aggregation, bidirectional compression), and the parent checks that all ranks hold
bit-identical gradients and parameters, that they equal ``simulate`` on the same local gradients, and
that the loss falls. One 2-process run holds the others, in turn: PyTorch's PowerSGD-hook failure case
and the checkpoints, the planned exchange of an uncompressed bucket beside the general one, a NaN
gradient and, last, a dying worker; a second pair of fresh processes restores the checkpoints.
"""
from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradpress
from dist_utils import run_workers
from test_runtime_compressors import LeaderTopK, PowerIteration, UniformInt, WideInt

#: DDP rebuilds its buckets after step 0; "options" compresses from step 2 (warmup_steps=2): 4 steps
#: still carry a feedback memory (and PowerSGD's warm start) from one compressed step into the next
STEPS = 4


class Net(nn.Module):
    """Three linear layers of uneven sizes, a frozen layer (requires_grad=False) and a parameter the
    forward never uses (its gradient is absent: DDP needs find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 40)
        self.mid = nn.Linear(40, 24)
        self.out = nn.Linear(24, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.out(torch.relu(self.mid(torch.relu(self.inp(x))))))


def configs() -> list[tuple[str, Any, dict, dict]]:
    """(label, spec, runtime options, training variant) for the 3-process run: every registered
    compressor under its own strategy, then the modes and options."""
    runs = [(name, name, {}, {}) for name in gradpress.compressor_names()]
    runs += [
        ("ps topk", "topk:ratio=0.2", {"mode": "ps", "root": 1}, {}),
        ("ps randomk master topk", "randomk:ratio=0.5", {"mode": "ps", "master": "topk:ratio=0.5"}, {}),
        ("ps powersgd master natural", "powersgd:rank=2", {"mode": "ps", "master": "natural", "root": 1}, {}),
        ("switch uniform", UniformInt(), {"mode": "switch"}, {}),
        ("ps thc", "thc", {"mode": "ps", "root": 2}, {}),
        ("switch thc_uniform partial", "thc_uniform", {"mode": "switch", "partial": 0.6}, {}),
        ("ps topk partial", "topk:ratio=0.2", {"mode": "ps", "partial": 0.6, "root": 1}, {}),
        ("uniform prelim", UniformInt(levels=7), {}, {}),
        ("leader", LeaderTopK(), {}, {}),
        ("power iteration", PowerIteration(), {}, {}),
        ("switch widened", WideInt(bound=100), {"mode": "switch"}, {}),
        ("allreduce widened", WideInt(bound=100), {}, {}),
        ("options", "topk:ratio=0.1", {"exclude": ["inp.*"], "warmup_steps": 2, "min_numel": 30}, {}),
        ("bf16 grads", "topk:ratio=0.2", {}, {"dtype": torch.bfloat16}),
        ("fp16 grads", "none", {}, {"dtype": torch.float16}),
        # buckets of several gradients: element-wise methods exchange each as one tensor
        ("none big buckets", "none", {}, {"bucket_mb": 0.004}),
        ("bf16 big buckets", "bf16", {"feedback": "none"}, {"bucket_mb": 0.004}),
        ("fp16 big buckets", "fp16", {"feedback": "none"}, {"bucket_mb": 0.002, "dtype": torch.float16}),
        ("natural big buckets, small ones plain", "natural", {"min_numel": 100}, {"bucket_mb": 0.004}),
        ("no_sync", "randomk:ratio=0.3", {}, {"accumulate": 2}),
    ]
    return runs


def _batch(rank: int, step: int, micro: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x = torch.randn(16, 12, generator=g)
    teacher = torch.linspace(-1, 1, 36).view(12, 3)
    return x.to(dtype), (x @ teacher).to(dtype)


def _train(rank: int, spec: Any, options: dict, variant: dict, steps: int = STEPS) -> dict:
    """DDP with the gradpress hook; records each bucket's local gradients (what the hook received), the
    averaged gradients, the loss on a fixed batch before and after, and the final parameters."""
    dtype = variant.get("dtype", torch.float32)
    torch.manual_seed(0)
    model = Net().to(dtype)
    names = {id(p): n for n, p in model.named_parameters()}
    bucket_mb = variant.get("bucket_mb", 0.00025 * torch.finfo(dtype).bits / 8)
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb, find_unused_parameters=True)
    state, hook = gradpress.ddp_comm_hook(spec, model=model, seed=7, **options)
    local: list[dict] = []
    buckets: list[int] = []

    merged: list[int] = []  # gradients exchanged together as one flat view of their bucket

    def recording(state: Any, bucket):  # noqa: ANN001, ANN202 - annotations are checked by DDP
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            local[-1][names[id(p)]] = g.detach().clone()
        buckets[-1] += 1
        future = hook(state, bucket)
        pipeline = state._pipeline
        if "groups" not in vars(pipeline):  # count from the next bucket on
            def counting(*args: Any, **kwargs: Any) -> list:
                made = type(pipeline).groups(pipeline, *args, **kwargs)
                merged.append(sum(len(g.members) for g in made if g.flat is not None))
                return made
            pipeline.groups = counting
        return future

    ddp.register_comm_hook(state, recording)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    probe = _batch(99, 0, 0, torch.float64)

    def probe_loss() -> float:  # in float64, so a bf16 model's progress shows
        with torch.no_grad():
            return float(nn.functional.mse_loss(copy.deepcopy(model).double()(probe[0]), probe[1]))

    before = probe_loss()
    averaged = []
    for step in range(steps):
        local.append({})
        buckets.append(0)
        optimizer.zero_grad()
        for micro in range(variant.get("accumulate", 1) - 1):
            with ddp.no_sync():
                x, y = _batch(rank, step, micro, dtype)
                nn.functional.mse_loss(ddp(x), y).backward()
        x, y = _batch(rank, step, 99, dtype)
        nn.functional.mse_loss(ddp(x), y).backward()
        averaged.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
    after = probe_loss()
    return {"local": local, "averaged": averaged, "before": before, "after": after, "buckets": buckets,
            "merged": max(merged, default=0),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "stats": state.stats()}


def _every_config(rank: int, world_size: int) -> dict:
    return {label: _train(rank, spec, options, variant) for label, spec, options, variant in configs()}


@pytest.fixture(scope="module")
def three_ranks() -> list[dict]:
    return run_workers(_every_config, 3, timeout=240)


@pytest.mark.parametrize("label", [c[0] for c in configs()])
def test_ranks_identical_equal_simulate_and_loss_falls(three_ranks, label):
    spec, options, _ = next((s, o, v) for lbl, s, o, v in configs() if lbl == label)
    runs = [ranks[label] for ranks in three_ranks]
    # every rank ends every step with bit-identical averaged gradients and parameters (invariant 1)
    for other in runs[1:]:
        for mine, theirs in zip(runs[0]["averaged"], other["averaged"], strict=True):
            assert mine.keys() == theirs.keys()
            for name in mine:
                assert torch.equal(mine[name], theirs[name]), (label, name)
        for name, value in runs[0]["params"].items():
            assert torch.equal(value, other["params"][name]), (label, name)
    # the simulation of the same local gradients gives the same bits
    simulator = gradpress.Simulator(spec, 3, seed=7, warm_up=False, **options)  # (the ranks warmed up theirs)
    for step in range(STEPS):
        expected = simulator.step([run["local"][step] for run in runs])
        for name, value in runs[0]["averaged"][step].items():
            assert expected[name].dtype == value.dtype
            assert torch.equal(expected[name], value), (label, step, name)
    # several buckets (DDP rebuilds them after the first step), uneven, the loss falls
    assert min(runs[0]["buckets"][1:]) >= (2 if "big buckets" in label else 3)
    if "big buckets" in label:  # exchanged as one tensor (element-wise methods and plain tensors)
        assert runs[0]["merged"] >= 2, runs[0]["merged"]
    assert runs[0]["after"] < runs[0]["before"], (label, runs[0]["before"], runs[0]["after"])


def test_traffic_reflects_strategy(three_ranks):
    """Stats: packet bytes from Packet.nbytes; sent bytes from the pattern (integer sums widened)."""
    none = three_ranks[0]["none"]["stats"]["last"]
    assert none["packet_bytes"] == none["raw_bytes"] > 0
    # rank-order float sum over 3 ranks: reduce-scatter (n-1)/n·S plus all-gather (n-1)·S/n
    assert none["sent_bytes"] == pytest.approx(2 * 2 / 3 * none["raw_bytes"], rel=0.02)
    # a worker sends its uint8 codes to the switch (each of the 8 tensors' padded to 8 bytes in the
    # gather buffer) and receives int32 sums: 3·100 > 255 cannot be summed in 8 bits
    switch = three_ranks[1]["switch widened"]["stats"]["last"]
    assert switch["packet_bytes"] <= switch["sent_bytes"] < switch["packet_bytes"] + 8 * 8
    # (each exchange is a gather and a broadcast; the broadcast also carries the server's 3 fault-flag slots)
    assert switch["received_bytes"] == 4 * switch["packet_bytes"] + (switch["collectives"] // 2) * 3 * 4


# -- the plan of an uncompressed bucket (runtime.FlatAllReduce) -----------------------------------------
PLANNED_STEPS, FAULT_AT = 6, 4  # DDP rebuilds its buckets after step 0; the plans serve from step 2 on


def _planned(rank: int, world_size: int, label: str) -> dict:
    """DDP training with the buckets' plans (``label`` "planned") or with every bucket through the
    general exchange ("general": the plans are never kept); rank 1's gradient holds a NaN at step 4.
    (A process group of its own for each variant: after a failed exchange the ranks may be out of step.)"""
    import torch.distributed as dist

    from gradpress.exchange.pipeline import FlatAllReduce

    started = FlatAllReduce.start
    used = [0]

    def counted(plan: FlatAllReduce, *args: Any) -> Any:
        used[0] += 1
        return started(plan, *args)

    FlatAllReduce.start = counted  # (this process's class, until this variant is done)
    try:
        return _planned_steps(rank, label, dist.new_group(), used)
    finally:
        FlatAllReduce.start = started


def _planned_steps(rank: int, label: str, group: Any, used: list[int]) -> dict:
    from gradpress.exchange.pipeline import FlatAllReduce

    torch.manual_seed(0)
    model = _mlp()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01, process_group=group)
    state = gradpress.register(ddp, "none")
    if label == "general":
        state._plans = _Refusing()
    steps, error = [], None
    for step in range(PLANNED_STEPS):
        x = torch.randn(8, 20, generator=torch.Generator().manual_seed(100 * rank + step))
        if step == FAULT_AT and rank == 1:
            x[0, 0] = float("nan")
        ddp.zero_grad()
        try:
            nn.functional.mse_loss(ddp(x), x[:, :4]).backward()
        except Exception:  # noqa: BLE001 - compared across ranks and paths
            error = (type(state.error).__name__, str(state.error), state.error.ranks)
            break
        steps.append({"grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                      "stats": state.stats()["last"]})
    return {"steps": steps, "error": error, "used": used[0],
            "planned": sum(isinstance(plan, FlatAllReduce) for plan in state._plans.values())}


class _Refusing(dict):
    """A plan store that keeps nothing: every bucket goes through the general exchange."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def test_a_planned_bucket_exchange_is_the_general_one_bit_for_bit(two_ranks):
    for rank in range(2):
        planned, general = two_ranks["runs"][rank]["planned"], two_ranks["runs"][rank]["general"]
        assert planned["planned"] >= 2 and general["planned"] == 0, (planned["planned"], general["planned"])
        # steps 2 and 3 through the plans, every bucket of them, and step 4 up to its failure
        assert planned["used"] >= 2 * planned["planned"] and general["used"] == 0, (planned["used"], general["used"])
        assert len(planned["steps"]) == len(general["steps"]) == FAULT_AT
        for step, (mine, theirs) in enumerate(zip(planned["steps"], general["steps"], strict=True)):
            for name, grad in mine["grads"].items():
                assert torch.equal(grad, theirs["grads"][name]), (rank, step, name)
            counters = ("raw_bytes", "packet_bytes", "sent_bytes", "received_bytes", "collectives")
            assert {c: mine["stats"][c] for c in counters} == {c: theirs["stats"][c] for c in counters}, step
            assert mine["stats"]["compress_s"] > 0 and mine["stats"]["comm_s"] > 0
        # rank 1's NaN at step 4: every rank raises what the general exchange raises, naming rank 1 and
        # the gradients of a bucket (of whichever failing bucket completed first: Gloo's two threads race)
        for error in (planned["error"], general["error"]):
            kind, message, faulty = error
            assert kind == "NonFiniteError" and faulty == [1], error
            assert message.startswith("gradients '") and message.endswith(": NaN/Inf in the gradient of rank 1")


# -- PyTorch's PowerSGD failure case and save / restore ------------------------------------------------
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _mlp_steps(rank: int, ddp: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, 20, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), x[:, :4]).backward()
        optimizer.step()


RESUME_SPECS = ["topk:ratio=0.05", "randomk:ratio=0.2"]


def _uninterrupted(rank: int, world_size: int, path: str) -> dict:
    """PowerSGD-hook case (a plain 3-layer MLP, 2 processes, Gloo) for every compressor; then, per
    resume spec, 3 steps, a checkpoint, 3 more steps."""
    plain = {}
    for name in gradpress.compressor_names():
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(_mlp())
        gradpress.register(ddp, name)
        _mlp_steps(rank, ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), range(3))
        plain[name] = [p.detach().clone() for p in ddp.parameters()]
    resumed = {}
    for spec in RESUME_SPECS:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(_mlp())
        state = gradpress.register(ddp, spec, seed=3)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        _mlp_steps(rank, ddp, optimizer, range(3))
        torch.save({"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "gradpress": state.state_dict()}, f"{path}.{spec}.{rank}")
        _mlp_steps(rank, ddp, optimizer, range(3, 6))
        resumed[spec] = [p.detach().clone() for p in ddp.parameters()]
    return {"plain": plain, "resumed": resumed}


def _restored(rank: int, world_size: int, path: str) -> dict:
    out = {}
    for spec in RESUME_SPECS:
        torch.manual_seed(1)  # a different initialization: everything must come from the checkpoint
        model = _mlp()
        checkpoint = torch.load(f"{path}.{spec}.{rank}", weights_only=False)
        model.load_state_dict(checkpoint["model"])
        ddp = nn.parallel.DistributedDataParallel(model)
        state = gradpress.register(ddp, spec, seed=3)
        state.load_state_dict(checkpoint["gradpress"])
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        optimizer.load_state_dict(checkpoint["optimizer"])
        _mlp_steps(rank, ddp, optimizer, range(3, 6))
        out[spec] = [p.detach().clone() for p in ddp.parameters()]
    return out


def test_powersgd_case_and_bit_identical_resume(two_ranks):
    first = [ranks["uninterrupted"] for ranks in two_ranks["runs"]]
    for name in gradpress.compressor_names():
        for a, b in zip(first[0]["plain"][name], first[1]["plain"][name], strict=True):
            assert torch.equal(a, b), name
    second = two_ranks["restored"]
    for spec in RESUME_SPECS:
        for rank in range(2):
            for a, b in zip(first[rank]["resumed"][spec], second[rank][spec], strict=True):
                assert torch.equal(a, b), (spec, rank)


# -- failures: a NaN gradient, a dying worker -------------------------------------------------------
def _failures(rank: int, world_size: int, before: dict, folder: str) -> dict:
    """Last in its processes: rank 1 dies between steps, ``before`` (its results of the scenarios
    before) and its results here saved first, to ``folder``/rank1.pt."""
    out: dict[str, Any] = {}
    plain = gradpress.Communicator("none", timeout=3)  # checks the aggregate: every rank raises at once
    start = time.monotonic()
    try:
        plain.reduce(torch.full((8,), float("nan")) if rank == 1 else torch.ones(8), "v")
    except Exception as error:  # noqa: BLE001 - the test inspects it
        out["nan_sum"] = (type(error).__name__, time.monotonic() - start)
    comm = gradpress.Communicator("topk:ratio=0.5", timeout=3)
    comm.reduce(torch.ones(8), "w")
    start = time.monotonic()
    try:
        comm.reduce(torch.full((8,), float("nan")) if rank == 1 else torch.ones(8), "w")
    except Exception as error:  # noqa: BLE001 - the test inspects it
        out["nan"] = (type(error).__name__, time.monotonic() - start)
    if rank == 1:
        time.sleep(4)  # stay alive: rank 0 must give up by its own timeout, not by a closed socket
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_mlp())
    gradpress.register(ddp, "topk:ratio=0.1", timeout=20)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    _mlp_steps(rank, ddp, optimizer, range(2))
    if rank == 1:
        torch.save({**before, "failures": out}, str(Path(folder) / "rank1.pt"))
        os._exit(1)  # dies between steps: rank 0's next exchange must fail, not hang
    start = time.monotonic()
    try:
        _mlp_steps(rank, ddp, optimizer, range(2, 4))
    except Exception as error:  # noqa: BLE001
        out["dead"] = (type(error).__name__, time.monotonic() - start)
    return out


def _two_ranks(rank: int, world_size: int, folder: str) -> dict:
    """The 2-process scenarios, each on a DDP or a Communicator of its own (the planned exchanges on
    groups of their own), the one that ends rank 1 last."""
    out = {"uninterrupted": _uninterrupted(rank, world_size, str(Path(folder) / "ckpt"))}
    for label in ("planned", "general"):
        out[label] = _planned(rank, world_size, label)
    out["failures"] = _failures(rank, world_size, out, folder)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """``{"runs": each rank's results of _two_ranks, "restored": each rank's of _restored}``: the
    checkpoints restored into a second pair of fresh processes."""
    folder = tmp_path_factory.mktemp("two_ranks")
    runs = run_workers(_two_ranks, 2, str(folder), timeout=420, may_exit=frozenset({1}))
    runs[1] = torch.load(str(folder / "rank1.pt"), weights_only=False)
    restored = run_workers(_restored, 2, str(folder / "ckpt"), timeout=120)
    return {"runs": runs, "restored": restored}


def test_nan_and_dead_worker_raise_within_timeout(two_ranks):
    survivor = two_ranks["runs"][0]["failures"]
    assert survivor["nan_sum"][0] == "NonFiniteError"  # rank 1's NaN, seen in the sum
    assert survivor["nan_sum"][1] < 3  # at once, not at the timeout
    name, waited = survivor["nan"]
    assert waited < 3 + 15  # its peer raised NonFiniteError and skipped the exchange: a timeout here
    assert "dead" in survivor, "the survivor's exchange with a dead peer must raise"
    assert survivor["dead"][1] < 20 + 15
