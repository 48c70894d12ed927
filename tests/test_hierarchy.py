"""The two-level exchange (``hierarchy="node"``): 4 Gloo processes as 2 nodes × 2 ranks, and two real
``torchrun`` launches as two nodes running the README's DDP and HSDP scripts.

One spawn of 4 processes runs every multi-process scenario (spawning costs seconds on a loaded machine);
torchrun's variables (``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``LOCAL_RANK``) are set in the processes as
torchrun sets them, except where ``local_size=`` is given instead. A small model cut into several DDP
buckets (a small ``bucket_cap_mb``) trains a few steps under a representative set of methods, one level
and two; the parent checks:

* every rank ends every step with bit-identical gradients and parameters, equal to ``Simulator(…,
  hierarchy="node", local_size=2)`` on the same local gradients;
* the bytes between nodes per rank (``sent_bytes``, ``received_bytes``) are at most 1/k of the one-level
  exchange's, and the intra-node bytes are counted apart;
* ``none`` equals DDP's own average within the bound of two summation orders;
* ``local_size=2`` is torchrun's layout; one node (``local_size=4``) is the one-level exchange, bit for bit;
* the Communicator: bit-identical ranks, equal to simulate;
* a NaN/Inf on one rank: every rank raises the same NonFiniteError naming it, promptly; ranks that
  disagree on the hierarchy: every rank raises the agreement's ValueError; a dead rank: its peers raise
  within the timeout.
"""
from __future__ import annotations

import math
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradpress
from dist_utils import run_workers, without_warm_up
from gradpress.exchange.hierarchy import Split
from numerics import gamma

K, NODES = 2, 2  # ranks a node, nodes
N = K * NODES
STEPS = 3
TIMEOUT = 20.0  # gradpress's timeout in the fault scenarios; a healthy rank raises well before it
DEAD_TIMEOUT = 4.0
#: a representative set: one method of each strategy and kind (all-reduce of floats and of integers, a
#: preliminary exchange, all-gather of fixed and of variable sizes, a low-rank method)
METHODS = [spec for spec in ("none", "topk:ratio=0.1", "randomk:ratio=0.25", "qsgd", "powersgd", "thc",
                             "signsgd") if spec.partition(":")[0] in gradpress.compressor_names()]
FAULTY_SPECS = ("none", "topk:ratio=0.1", "thc")


class Net(nn.Module):
    """Layers whose weights split by rows (40 × 12), by columns (3 × 24, more columns than rows) and a
    one-element bias (only one rank of a node holds a part of it)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 40)
        self.mid = nn.Linear(40, 24)
        self.out = nn.Linear(24, 3)
        self.last = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.out(torch.relu(self.mid(torch.relu(self.inp(x))))))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + step)
    x = torch.randn(16, 12, generator=g)
    return x, x[:, :1] * 0.5


def _torchrun_env(rank: int) -> None:
    """The variables torchrun sets for 2 nodes of 2 ranks (``--nnodes 2 --nproc-per-node 2``)."""
    os.environ.update(LOCAL_WORLD_SIZE=str(K), GROUP_RANK=str(rank // K), LOCAL_RANK=str(rank % K))


def _no_torchrun_env() -> None:
    for name in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK"):
        os.environ.pop(name, None)


def _train(rank: int, spec: str, reference: bool = False, **options: Any) -> dict:
    """DDP (several buckets) with the gradpress hook; records what the hook received (the local
    gradients), the averaged gradients, the final parameters and the statistics. ``reference``: also
    DDP's own average of the same gradients, each step (a second DDP, no hook, the same parameters)."""
    torch.manual_seed(0)
    model = Net()
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    state, hook = gradpress.ddp_comm_hook(spec, model=model, seed=5, **options)
    local: list[dict] = []
    buckets: list[int] = []

    def recording(state, bucket):  # (no annotations: DDP checks them)
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            local[-1][names[id(p)]] = g.detach().clone()
        buckets[-1] += 1
        return hook(state, bucket)

    ddp.register_comm_hook(state, recording)
    plain = nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=0.0001) if reference else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    averaged, ddp_average = [], []
    for step in range(STEPS):
        local.append({})
        buckets.append(0)
        x, y = _batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        averaged.append({n: p.grad.clone() for n, p in model.named_parameters()})
        if plain is not None:
            plain.module.load_state_dict(model.state_dict())
            plain.zero_grad()
            nn.functional.mse_loss(plain(x), y).backward()
            ddp_average.append({n: p.grad.clone() for n, p in plain.module.named_parameters()})
        optimizer.step()
    return {"local": local, "averaged": averaged, "ddp": ddp_average, "buckets": buckets,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "stats": state.stats()}


def _tensors(rank: int, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * rank + step)
    return {"w": torch.randn(20, 8, generator=g), "wide": torch.randn(2, 30, generator=g),
            "b": torch.randn(5, generator=g), "one": torch.randn(1, generator=g)}


#: the Communicator's runs: ``exclude`` exchanges compressed and plain tensors side by side
COMMUNICATED = {"topk:ratio=0.2": {"exclude": ["b"]}, "qsgd": {"mode": "ps", "root": 1}, "powersgd": {}}


def _communicator(rank: int) -> dict:
    out = {}
    for spec, options in COMMUNICATED.items():
        comm = gradpress.Communicator(spec, seed=2, hierarchy="node", **options)
        out[spec] = [comm.reduce_many(_tensors(rank, step)) for step in range(2)]
        out[spec + " stats"] = comm.stats()
    return out


def _outcome(call) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - compared across ranks
        return type(error).__name__, str(error).split("\n")[0], time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _faults(rank: int) -> dict:
    out: dict[Any, Any] = {}
    for spec in FAULTY_SPECS:
        for faulty in (0, 3):
            torch.manual_seed(0)
            model = Net()
            ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
            state = gradpress.register(ddp, spec, hierarchy="node", timeout=TIMEOUT)
            for step in range(2):
                x, y = _batch(rank, step)
                nn.functional.mse_loss(ddp(x), y).backward()
            x, y = _batch(rank, 2)
            if rank == faulty:
                model.mid.weight.register_hook(lambda grad: grad.index_fill(0, torch.tensor([1]), math.nan))
            def step(ddp=ddp, x=x, y=y) -> None:
                nn.functional.mse_loss(ddp(x), y).backward()

            fault = _outcome(step)
            error = state.error
            later = _outcome(step)
            out[(spec, faulty)] = {"fault": fault, "later": later,
                                   "error": (type(error).__name__, str(error), getattr(error, "ranks", None))}
    # ranks that disagree: torchrun's node size on rank 3 says one node of 4; rank 3 without hierarchy
    os.environ["LOCAL_WORLD_SIZE"] = "4" if rank == 3 else str(K)
    ddp = nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=0.0001)
    gradpress.register(ddp, "topk:ratio=0.1", hierarchy="node", timeout=TIMEOUT)
    out["node size"] = _outcome(lambda: ddp(_batch(rank, 0)[0]).sum().backward())
    _torchrun_env(rank)
    comm = gradpress.Communicator("qsgd", timeout=TIMEOUT, **({} if rank == 3 else {"hierarchy": "node"}))
    out["hierarchy"] = _outcome(lambda: comm.reduce(torch.ones(8), "w"))
    return out


def _dead(rank: int, folder: str, results: dict) -> dict:
    """Last: rank 3 dies between steps (its results saved first); the others' next step must raise
    within the timeout, never hang."""
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Net(), bucket_cap_mb=0.0001)
    gradpress.register(ddp, "topk:ratio=0.1", hierarchy="node", timeout=DEAD_TIMEOUT)
    for step in range(2):
        nn.functional.mse_loss(ddp(_batch(rank, step)[0]), _batch(rank, step)[1]).backward()
    if rank == 3:
        torch.save(results, str(Path(folder) / "rank3.pt"))
        os._exit(1)
    x, y = _batch(rank, 2)
    return {"dead": _outcome(lambda: [nn.functional.mse_loss(ddp(x), y).backward() for _ in range(2)])}


def _scenarios(rank: int, world_size: int, folder: str) -> dict:
    without_warm_up()  # (a Simulator's run of 4 workers for each method and setting: a third of the CPU)
    _torchrun_env(rank)
    out: dict[str, Any] = {}
    for spec in METHODS:
        out[("flat", spec)] = _train(rank, spec)
        out[("two", spec)] = _train(rank, spec, hierarchy="node", reference=spec == "none")
    out["one node"] = _train(rank, "topk:ratio=0.1", hierarchy="node", local_size=N)
    out["communicator"] = _communicator(rank)
    _no_torchrun_env()
    out["explicit"] = _train(rank, "topk:ratio=0.1", hierarchy="node", local_size=K)
    _torchrun_env(rank)
    out["faults"] = _faults(rank)
    out.update(_dead(rank, folder, out))
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("hierarchy")
    warm = gradpress.Simulator  # the kernels compile here, once (cached on disk), not in 4 processes at once
    for spec in METHODS:
        simulator = warm(spec, N, hierarchy="node", local_size=K)
        for _ in range(2):
            simulator.step([{"w": torch.randn(40, 12), "b": torch.randn(40)} for _ in range(N)])
    ranks = run_workers(_scenarios, N, str(folder), timeout=400, group_timeout=60, may_exit=frozenset({3}))
    ranks[3] = torch.load(str(folder / "rank3.pt"), weights_only=False)
    return ranks


def _assert_identical(runs: list[dict], label: Any) -> None:
    for other in runs[1:]:
        for mine, theirs in zip(runs[0]["averaged"], other["averaged"], strict=True):
            for name in mine:
                assert torch.equal(mine[name], theirs[name]), (label, name)
        for name, value in runs[0]["params"].items():
            assert torch.equal(value, other["params"][name]), (label, name)


@pytest.mark.parametrize("spec", METHODS)
def test_every_rank_ends_bit_identical_and_equal_to_simulate(four_ranks, spec):
    runs = [ranks[("two", spec)] for ranks in four_ranks]
    assert min(runs[0]["buckets"][1:]) >= 3, runs[0]["buckets"]  # several buckets (DDP's, from step 1 on)
    _assert_identical(runs, spec)
    simulator = gradpress.Simulator(spec, N, seed=5, hierarchy="node", local_size=K, warm_up=False)
    for step in range(STEPS):
        expected = simulator.step([run["local"][step] for run in runs])
        for name, value in runs[0]["averaged"][step].items():
            assert torch.equal(expected[name], value), (spec, step, name)
    assert runs[0]["stats"]["pattern"].endswith("between nodes")


def test_bytes_between_nodes_are_at_most_one_kth_of_one_level(four_ranks):
    """Per rank and step, for every method of the set: what crosses between nodes (``sent_bytes`` and
    ``received_bytes`` of the two-level exchange) is at most 1/k of what a rank of the one-level
    exchange sends (all of which crosses a node's uplink in the issue's accounting); the node's own
    reduce-scatter and all-gather are counted as ``intra_node_*``."""
    table = []
    for spec in METHODS:
        flat = [ranks[("flat", spec)]["stats"]["total"] for ranks in four_ranks]
        two = [ranks[("two", spec)]["stats"]["total"] for ranks in four_ranks]
        for name in ("sent_bytes", "received_bytes"):
            assert max(t[name] for t in two) <= min(f[name] for f in flat) / K, (spec, name, flat, two)
        assert all(t["intra_node_sent_bytes"] > 0 for t in two) and all(f["intra_node_sent_bytes"] == 0
                                                                         for f in flat), spec
        table.append(f"{spec}: one level {min(f['sent_bytes'] for f in flat) / STEPS:.0f} B, two levels "
                     f"{max(t['sent_bytes'] for t in two) / STEPS:.0f} B between nodes "
                     f"(+{max(t['intra_node_sent_bytes'] for t in two) / STEPS:.0f} B inside)")
    print("\nsent per rank and step:\n" + "\n".join(table))


def test_none_equals_ddp_average_within_two_summation_orders(four_ranks):
    """DDP's average of N float32 gradients is off the exact mean by at most γ_{N+1}·Σ|g_i|/N (a sum in any
    order, a division); the two-level one adds k values in rank order, divides by k, divides by m and
    adds m values: at most γ_{k+m}·Σ|g_i|/N. So they differ by at most the sum of the two bounds."""
    runs = [ranks[("two", "none")] for ranks in four_ranks]
    bound_factor = gamma(N + 1) + gamma(K + NODES)
    for step in range(STEPS):
        for name, value in runs[0]["averaged"][step].items():
            magnitude = sum(run["local"][step][name].double().abs() for run in runs) / N
            difference = (value.double() - runs[0]["ddp"][step][name].double()).abs()
            assert bool((difference <= bound_factor * magnitude).all()), (step, name, float(difference.max()))


def test_explicit_local_size_is_torchruns_layout_and_one_node_is_one_level(four_ranks):
    explicit = [ranks["explicit"] for ranks in four_ranks]
    _assert_identical(explicit, "explicit")
    for ranks in four_ranks:
        for mine, theirs in zip(ranks["explicit"]["averaged"], ranks[("two", "topk:ratio=0.1")]["averaged"],
                                strict=True):
            assert all(torch.equal(mine[name], theirs[name]) for name in mine)
        for mine, theirs in zip(ranks["one node"]["averaged"], ranks[("flat", "topk:ratio=0.1")]["averaged"],
                                strict=True):
            assert all(torch.equal(mine[name], theirs[name]) for name in mine)
        one, flat = ranks["one node"]["stats"]["total"], ranks[("flat", "topk:ratio=0.1")]["stats"]["total"]
        assert one["sent_bytes"] == flat["sent_bytes"] and one["intra_node_sent_bytes"] == 0


def test_the_communicator_is_bit_identical_and_equals_simulate(four_ranks):
    for spec, options in COMMUNICATED.items():
        runs = [ranks["communicator"][spec] for ranks in four_ranks]
        simulator = gradpress.Simulator(spec, N, seed=2, hierarchy="node", local_size=K, warm_up=False, **options)
        for step in range(2):
            expected = simulator.step([_tensors(rank, step) for rank in range(N)])
            for run in runs:
                for name, value in run[step].items():
                    assert torch.equal(value, expected[name]), (spec, step, name)
        stats = four_ranks[0]["communicator"][spec + " stats"]["total"]
        assert stats["sent_bytes"] > 0 and stats["intra_node_sent_bytes"] > 0


def test_a_nan_on_one_rank_raises_the_same_error_naming_it_on_every_rank(four_ranks):
    found = [ranks["faults"] for ranks in four_ranks]
    for spec in FAULTY_SPECS:
        for faulty in (0, 3):
            cases = [f[(spec, faulty)] for f in found]
            for case in cases:
                kind, message, seconds = case["fault"]
                assert kind == "RuntimeError" and f"NaN/Inf in the gradient of rank {faulty}" in message, case
                assert "'mid.weight'" in message and seconds < TIMEOUT / 2, case
                assert case["error"][0] == "NonFiniteError" and case["error"][2] == [faulty], case
                assert "ExchangeFailed" in case["later"][1], case
            assert all(case["fault"][:2] == cases[0]["fault"][:2] for case in cases), cases
            assert all(case["error"] == cases[0]["error"] for case in cases), cases


def test_ranks_that_disagree_on_the_hierarchy_raise_one_clear_error(four_ranks):
    found = [ranks["faults"] for ranks in four_ranks]
    for case, says in (("node size", ("the hierarchy: ranks 0, 1, 2 have 'node', 2 ranks a node, rank 3 has "
                                       "'node', 4 ranks a node")),
                       ("hierarchy", ("the hierarchy: ranks 0, 1, 2 have 'node', 2 ranks a node, rank 3 has "
                                      "nothing"))):
        outcomes = [f[case] for f in found]
        for kind, message, seconds in outcomes:
            assert kind in ("ValueError", "RuntimeError") and "disagree" in message, message
            assert says in message, message
            assert seconds < TIMEOUT / 2
        assert len({o[:2] for o in outcomes}) == 1, outcomes


def test_a_dead_rank_makes_its_peers_raise_within_the_timeout(four_ranks):
    """Rank 3 exits between steps: rank 2 (its node) and rank 1 (its shard's peer) find the connection
    closed; rank 0 waits for rank 2 in the exchange between nodes and raises at the timeout."""
    for rank in range(3):
        kind, message, seconds = four_ranks[rank]["dead"]
        assert kind != "ok" and seconds < 2 * DEAD_TIMEOUT + 15, (rank, kind, message, seconds)


# -- the simulator and the shards, in this process --------------------------------------------------------
def test_a_split_covers_each_tensor_in_nearly_equal_contiguous_parts():
    for shape in [(40, 12), (3, 24), (1,), (5,), (7, 3, 2), (2, 2), ()]:
        for k in (2, 3, 4):
            split = Split.of("w", shape, k)
            t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
            parts = [split.part(t, j) for j in range(k)]
            assert sum(p.numel() for p in parts) == t.numel()
            assert max(split.sizes) - min(split.sizes) <= 1, (shape, k, split)
            assert all(tuple(p.shape) == split.part_shape(j) for j, p in enumerate(parts))
            seen = torch.cat([p.reshape(-1) for p in parts]).sort().values
            assert torch.equal(seen, t.reshape(-1).sort().values)


def test_simulated_bytes_between_nodes_for_every_method():
    """In the simulator (the same traffic model), every registered method in its own strategy, 3 nodes of
    2 ranks: each node's uplink (the bytes its ranks send between nodes) carries at most 1/k of what it
    carries in one level (per node: a leader's broadcast, CLT-k's, is one rank's in one level and one
    rank's per shard in two); ``none`` equals the exact mean within γ_{k+m}."""
    k, nodes = 2, 3
    n = k * nodes
    g = torch.Generator().manual_seed(0)
    grads = [{"w": torch.randn(48, 16, generator=g), "v": torch.randn(200, generator=g)} for _ in range(n)]
    for spec in gradpress.compressor_names():  # (no warm-up: a run of 6 workers for each method, the bytes alike)
        flat = gradpress.Simulator(spec, n, warm_up=False)
        two = gradpress.Simulator(spec, n, hierarchy="node", local_size=k, warm_up=False)
        flat.step(grads)
        result = two.step(grads)
        for node in range(nodes):
            ranks = range(node * k, node * k + k)
            one_level = sum(flat.stats()[r]["total"]["sent_bytes"] for r in ranks)
            assert sum(two.stats()[r]["total"]["sent_bytes"] for r in ranks) <= one_level / k, (spec, node)
        if spec == "none":
            for name in grads[0]:
                exact = sum(w[name].double() for w in grads) / n
                magnitude = sum(w[name].double().abs() for w in grads) / n
                assert bool(((result[name].double() - exact).abs() <= gamma(k + nodes) * magnitude).all())


def _worker_grads(step: int, n: int) -> list[dict[str, torch.Tensor]]:
    return [{"w": torch.randn(24, 8, generator=torch.Generator().manual_seed(10 * step + r)),
             "b": torch.randn(5, generator=torch.Generator().manual_seed(10 * step + r + 100)),
             "one": torch.full((1,), float(r))} for r in range(n)]


@pytest.mark.parametrize("spec,options", [
    ("topk:ratio=0.2", {"mode": "ps", "root": 1}),
    ("randomk:ratio=0.5", {"mode": "ps", "master": "topk:ratio=0.5"}),
    ("thc", {"mode": "ps", "root": 2}),
    ("thc_uniform", {"mode": "switch", "partial": 0.6}),
    ("cltk", {}),
    ("topk:ratio=0.1", {"exclude": ["b"], "warmup_steps": 1, "min_numel": 30}),
])
def test_simulated_modes_resume_bit_for_bit_and_name_the_faulty_rank(spec, options):
    """Every strategy between nodes (a server on node ``root``, a switch, partial aggregation,
    bidirectional compression, a leader's broadcast; compressed and plain tensors side by side): a saved
    state resumes bit for bit, and a NaN on any rank raises the NonFiniteError naming that rank."""
    n = 6
    sim = gradpress.Simulator(spec, n, hierarchy="node", local_size=2, seed=3, warm_up=False, **options)
    for step in range(3):
        sim.step(_worker_grads(step, n))
    again = gradpress.Simulator(spec, n, hierarchy="node", local_size=2, seed=3, warm_up=False, **options)
    again.load_state_dict(sim.state_dict())
    mine, theirs = sim.step(_worker_grads(5, n)), again.step(_worker_grads(5, n))
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)
    for faulty in (0, 3, 5):
        bad = _worker_grads(6, n)
        bad[faulty]["w"][2, 3] = math.nan
        with pytest.raises(gradpress.NonFiniteError) as raised:
            sim.step(bad)
        assert raised.value.ranks == [faulty] and f"gradient of rank {faulty}" in str(raised.value)


def test_min_numel_counts_the_whole_tensor_and_states_do_not_mix_levels():
    """A shard of half the tensor is compressed when the whole tensor reaches ``min_numel``; a state of
    one level does not load into two, nor one of another node size; ``auto`` is accepted (it chooses
    among two-level candidates: tests/test_auto.py)."""
    grads = _worker_grads(0, 4)
    compressed = gradpress.Simulator("topk:ratio=0.1", 4, hierarchy="node", local_size=2, min_numel=30)
    everything = gradpress.Simulator("topk:ratio=0.1", 4, hierarchy="node", local_size=2)
    assert torch.equal(compressed.step(grads)["w"], everything.step(grads)["w"])  # 192 values, shards of 96
    flat = gradpress.Simulator("topk:ratio=0.1", 4)
    flat.step(grads)
    with pytest.raises(ValueError, match="saved by a one-level exchange"):
        two = gradpress.Simulator("topk:ratio=0.1", 4, hierarchy="node", local_size=2)
        two.load_state_dict(flat.state_dict())
    with pytest.raises(ValueError, match="with 2 ranks a node"):
        gradpress.Simulator("topk:ratio=0.1", 8, hierarchy="node", local_size=4).load_state_dict(
            gradpress.Simulator("topk:ratio=0.1", 8, hierarchy="node", local_size=2).state_dict())
    with pytest.raises(ValueError, match="does not divide the world"):
        gradpress.Simulator("topk:ratio=0.1", 4, hierarchy="node", local_size=3).step(grads)
    with pytest.raises(ValueError, match="needs hierarchy='node'"):
        gradpress.Simulator("topk:ratio=0.1", 4, local_size=2)
    from gradpress.ddp import _check_options

    _check_options("auto", {"hierarchy": "node", "local_size": 2})


# -- the README's two-node runs: its two torchrun commands, its DDP and HSDP scripts -----------------------
README = Path(__file__).resolve().parents[1] / "README.md"

# appended to a README script: one write per line (the ranks share a pipe), after its destroy_process_group
# (no collective; the rank from torchrun)
DDP_EPILOGUE = """
import hashlib as _hashlib, os as _os, sys as _sys
_digest = _hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.module.parameters()))
_stats = state.stats()
_intra = _stats["total"]["intra_node_sent_bytes"] > 0
_sys.stdout.write(f"ddp rank {_os.environ['RANK']} of {_os.environ['WORLD_SIZE']}: {_stats['pattern']}; "
                  f"intra {_intra}; parameters {_digest.hexdigest()}\\n")
"""
HSDP_EPILOGUE = """
import hashlib as _hashlib, os as _os, sys as _sys
_local = [p.detach().to_local() for p in model.parameters()]  # this rank's shard of each parameter
_digest = _hashlib.sha256(b"".join(t.numpy().tobytes() for t in _local))
_sys.stdout.write(f"hsdp rank {_os.environ['RANK']} of {_os.environ['WORLD_SIZE']}: shard "
                  f"{sum(t.numel() for t in _local)} of {sum(p.numel() for p in model.parameters())}; sent "
                  f"{state.stats()['total']['sent_bytes']}; parameters {_digest.hexdigest()}\\n")
"""
# train.py: the two scripts one after the other in each process (starting 6 interpreters costs seconds
# each here), each in a folder of its own; the second on a store of its own, as the README harness does
# (the launcher's store hosts one group)
TRAIN = """
import os

def run(name):
    os.makedirs(name, exist_ok=True)
    os.chdir(name)
    with open(f"../{name}.py") as file:
        exec(compile(file.read(), f"{name}.py", "exec"), {"__name__": "__main__"})
    os.chdir("..")

run("ddp")
os.environ["MASTER_PORT"] = os.environ["GRADPRESS_TEST_PORT"]
os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
run("hsdp")
"""


def _section(title: str) -> str:
    text = README.read_text()
    found = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.DOTALL | re.MULTILINE)
    if found is None:
        pytest.fail(f"README.md has no section '## {title}'")
    return found.group(1)


def _readme_script(needle: str) -> str:
    """The one README example run in 2 processes (found as tests/frameworks_harness.py finds them) that
    holds ``needle``."""
    from frameworks_harness import readme_blocks

    found = [block for block in readme_blocks() if needle in block]
    if len(found) != 1:
        pytest.fail(f"README.md has {len(found)} examples marked '<!-- run: 2 processes -->' holding "
                    f"{needle!r}; expected one")
    return found[0]


def _ddp_on_nodes() -> str:
    """The README's DDP example with its register line replaced by the one of "Several nodes"."""
    script = _readme_script("DistributedDataParallel")
    register = re.findall(r"^state = gradpress\.register\(model, .*\)$", script, re.MULTILINE)
    if len(register) != 1:
        pytest.fail(f"README.md's DDP example has {len(register)} lines "
                    "`state = gradpress.register(model, …)`, not one")
    nodes = [line for block in re.findall(r"```python\n(.*?)```", _section("Several nodes"), re.DOTALL)
             for line in block.splitlines() if 'hierarchy="node"' in line]
    if len(nodes) != 1 or not nodes[0].startswith("state = gradpress.register(model, "):
        pytest.fail(f"README.md's 'Several nodes' shows no one line `state = gradpress.register(model, …, "
                    f"hierarchy=\"node\", …)`: {nodes}")
    return script.replace(register[0], nodes[0])


def _torchrun_commands(port: int) -> list[list[str]]:
    """The two ``torchrun`` commands of the README's "Several nodes", as written but for the address and
    port (this machine's, a free one) and ``python -m torch.distributed.run`` for ``torchrun``."""
    blocks = re.findall(r"```sh\n(.*?)```", _section("Several nodes"), re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines() if line.startswith("torchrun ")]
    if len(lines) != 2:
        pytest.fail(f"README.md's 'Several nodes' shows {len(lines)} torchrun commands, not one per node: "
                    f"{lines}")
    commands = []
    for line in lines:
        words = shlex.split(line)
        for option, value in (("--master-addr", "127.0.0.1"), ("--master-port", str(port))):
            if option not in words:
                pytest.fail(f"README.md's torchrun command has no {option}: {line}")
            words[words.index(option) + 1] = value
        commands.append([sys.executable, "-m", "torch.distributed.run", *words[1:]])
    return commands


@pytest.fixture(scope="module")
def readme_nodes(tmp_path_factory) -> dict[str, dict[int, str]]:
    """The README's DDP script (register line of "Several nodes") and its HSDP script as written, run
    by the README's two torchrun commands in ``train.py``: ``{"ddp": {rank: its epilogue line}, "hsdp":
    …}``, after both launches exited 0."""
    from frameworks_harness import _free_ports

    folder = tmp_path_factory.mktemp("nodes")
    (folder / "ddp.py").write_text(_ddp_on_nodes() + DDP_EPILOGUE)
    (folder / "hsdp.py").write_text(_readme_script("gradpress.fsdp.register") + HSDP_EPILOGUE)
    (folder / "train.py").write_text(TRAIN)
    root = Path(__file__).resolve().parents[1]
    paths = [str(root)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    master, second = _free_ports(2)
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADPRESS_NUMBA="0", PYTHONPATH=os.pathsep.join(paths),
               GRADPRESS_TEST_PORT=str(second))
    for name in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)
    runs = [subprocess.Popen(command, cwd=folder, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
            for command in _torchrun_commands(master)]
    outputs = []
    try:
        for run in runs:
            outputs.append(run.communicate(timeout=300)[0])
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, 9)  # the session this test started: the launcher and its workers
                run.communicate()
    for node, (run, output) in enumerate(zip(runs, outputs, strict=True)):
        assert run.returncode == 0, f"node {node}'s torchrun exited {run.returncode}:\n{output[-3000:]}"
    found: dict[str, dict[int, str]] = {"ddp": {}, "hsdp": {}}
    for script, rank, text in re.findall(r"(ddp|hsdp) rank (\d) of 4: ([^\n]*?parameters [0-9a-f]{64})",
                                         "\n".join(outputs)):
        found[script][int(rank)] = text
    for lines in found.values():
        assert sorted(lines) == [0, 1, 2, 3], outputs
    return found


def test_readme_ddp_script_on_two_torchrun_nodes_ends_with_identical_parameters(readme_nodes):
    """The README's DDP example with its register line replaced by the one of "Several nodes", launched
    by the README's two torchrun commands (2 nodes × 2 ranks): the two-level exchange ran (the
    hierarchical pattern, bytes inside the node) and every rank ends with the same parameters."""
    lines = readme_nodes["ddp"]
    assert len(set(lines.values())) == 1, lines
    assert "between nodes; intra True" in lines[0], lines


def test_readme_hsdp_script_on_two_torchrun_nodes_shards_in_a_node_and_replicas_agree(readme_nodes):
    """The README's FSDP2/HSDP example as written, on the README's two torchrun commands: its mesh from
    torchrun's variables is 2 replicas (the nodes) of 2 shards, every rank sends compressed bytes, and the
    replicas of a shard (ranks j and j + 2) end with the same parameters and bytes."""
    lines = readme_nodes["hsdp"]
    for rank, text in lines.items():
        local, whole = map(int, re.search(r"shard (\d+) of (\d+)", text).groups())
        assert 2 * local == whole, f"rank {rank} holds {local} of {whole} values, not half: {lines}"
        assert int(re.search(r"sent (\d+)", text).group(1)) > 0, lines
    assert lines[0] == lines[2] and lines[1] == lines[3], lines
    assert lines[0] != lines[1], lines  # the two shards differ
