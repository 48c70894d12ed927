"""The edges of the front ends: what ``gradpress.register`` refuses (FSDP), statistics that survive a
checkpoint, and a checkpoint of one world size resumed at another (elastic restarts).

One 2-process Gloo run (spawning costs seconds) does every multi-process check: FSDP1 and FSDP2
(``fully_shard``) models refused by ``register`` with a ``TypeError``; a DDP state saved and loaded
again with its totals; and a real file of a world of 4 (written here by :class:`gradpress.Simulator`,
which runs the runtime's own protocols, equal to a real run) loaded by 2 ranks: refused by default,
loaded with ``on_world_size_change="reset"`` (step counters, statistics and PowerSGD's warm starts
kept, the error-feedback memory dropped with a ``UserWarning``), and trained on, every rank alike.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

import gradpress
from dist_utils import run_workers
from gradpress.auto import AutoOptions, AutoPipeline
from gradpress.core.compressor import Compressor
from gradpress.core.packet import Packet
from gradpress.exchange.pipeline import COUNTERS, Options
from gradpress.exchange.state import gathered

SPEC = "powersgd:rank=1"
BYTES = [name for name in COUNTERS if not name.endswith("_s")]  # the counters that are not timings


def _grads(workers: int, step: int, shapes: dict[str, tuple[int, ...]]) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [{key: torch.randn(shape, generator=generator) for key, shape in shapes.items()}
            for _ in range(workers)]


SHAPES = {"w": (32, 16), "b": (6,)}


def _resumed(spec: str | Compressor, saved: int, steps: int = 3,
             **options) -> tuple[gradpress.Simulator, list]:
    """A Simulator of ``saved`` workers after ``steps`` steps, and its state."""
    sim = gradpress.Simulator(spec, saved, seed=1, **options)
    for step in range(steps):
        sim.step(_grads(saved, step, SHAPES))
    return sim, sim.state_dict()


# -- statistics --------------------------------------------------------------------------------------
def test_statistics_totals_survive_a_save_and_load(tmp_path):
    """``stats()["total"]`` goes on from the checkpoint, as ``steps`` does: the report after loading equals
    the saved one, and after one more step the byte counters equal those of the run that never stopped,
    but for the resumed run's own agreement (once per set of tensors and process: ``control_bytes``)."""
    sim, state = _resumed("topk:ratio=0.3", 2)
    path = tmp_path / "state.pt"
    torch.save(state, path)
    restored = gradpress.Simulator("topk:ratio=0.3", 2, seed=1)
    restored.load_state_dict(torch.load(path, weights_only=False))
    assert restored.stats() == sim.stats()
    assert restored.stats()[0]["steps"] == 3 and restored.stats()[0]["total"]["raw_bytes"] > 0
    grads = _grads(2, 3, SHAPES)
    assert torch.equal(sim.step(grads)["w"], restored.step(grads)["w"])
    for a, b in zip(sim.stats(), restored.stats(), strict=True):
        assert a["steps"] == b["steps"] == 4
        assert {k: a["total"][k] for k in BYTES if k != "control_bytes"} \
            == {k: b["total"][k] for k in BYTES if k != "control_bytes"}
        assert b["total"]["control_bytes"] == 2 * a["total"]["control_bytes"] > 0
        assert a["total"]["raw_bytes"] == 4 * (32 * 16 + 6) * 4  # four steps of float32 gradients


def test_statistics_in_a_state_are_checked_before_anything_loads():
    sim, state = _resumed("topk:ratio=0.3", 2)
    fresh = gradpress.Simulator("topk:ratio=0.3", 2, seed=1)
    for bad, words in (({"total": {"sent_bytes": -1}, "steps": {}}, "finite number >= 0"),
                       ({"total": {"bogus": 1}, "steps": {}}, "names 'bogus'"),
                       ({"total": {}, "steps": {"3": {}}}, "step numbers")):
        broken = [{**s, "stats": bad} for s in state]
        with pytest.raises(ValueError, match=words):
            fresh.load_state_dict(broken)
        assert fresh.pipelines[0].steps == {} and fresh.stats()[0]["total"]["raw_bytes"] == 0
    older = [{k: v for k, v in s.items() if k != "stats"} for s in state]  # saved before statistics were
    fresh.load_state_dict(older)
    assert fresh.pipelines[0].steps == {"w": 3, "b": 3} and fresh.stats()[0]["total"]["raw_bytes"] == 0


def test_auto_state_keeps_its_statistics():
    auto = AutoOptions(candidates=("topk:ratio=0.5",))
    first = AutoPipeline(auto, Options(), 0, 1)
    first.stats.add(4, raw_bytes=100, sent_bytes=60, comm_s=0.5)
    state = first.state_dict()
    assert all("stats" not in sub for sub in state["auto"]["pipelines"].values())  # the auto state's alone
    second = AutoPipeline(auto, Options(), 0, 1)
    second.load_state_dict(state)
    assert second.report()["total"] == first.report()["total"] and second.report()["steps"] == 5
    assert all(p.stats is second.stats for p in second._pipelines.values())


# -- another world size --------------------------------------------------------------------------------
def test_a_state_of_another_world_size_is_refused_by_default_and_reset_on_request():
    sim, state = _resumed(SPEC, 4)
    saved_warm = sim.pipelines[0].compressor.state_dict()["warm"]
    assert set(saved_warm) == {"w"} and sim.pipelines[1].feedback.state_dict()["memory"]
    small = gradpress.Simulator(SPEC, 2, seed=1)
    with pytest.raises(ValueError, match="on_world_size_change='reset'"):
        small.load_state_dict(gathered(state))
    with pytest.raises(ValueError, match="on_world_size_change must be one of 'raise', 'reset'"):
        small.load_state_dict(gathered(state), on_world_size_change="keep")
    assert small.pipelines[0].steps == {}
    with pytest.warns(UserWarning) as caught:
        small.load_state_dict(gathered(state), on_world_size_change="reset")
    message = str(caught[0].message)
    assert "saved at world size 4 loads into a world of 2" in message
    assert "dropped the error-feedback memory (residual) of 2 tensors ('b', 'w')" in message
    assert "kept the step counters and shapes" in message and "powersgd" in message
    for rank, pipeline in enumerate(small.pipelines):
        assert pipeline.steps == {"w": 3, "b": 3} and pipeline.feedback.state_dict() == {"memory": {}}
        assert torch.equal(pipeline.compressor.state_dict()["warm"]["w"], saved_warm["w"])  # shared: kept
        assert pipeline.report() == sim.pipelines[rank].report()  # its own rank's statistics
    out = small.step(_grads(2, 3, SHAPES))
    assert out["w"].shape == (32, 16) and bool(torch.isfinite(out["w"]).all())
    assert small.pipelines[0].steps == {"w": 4, "b": 4}
    # a bigger world: ranks that were not saved take rank 0's shared parts, their statistics start at zero
    big = gradpress.Simulator(SPEC, 6, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        big.load_state_dict(state, on_world_size_change="reset")
    said = [str(w.message) for w in caught]
    assert len(said) == 6 and "rank 0's statistics (rank 5's start from zero)" in said[5]
    assert all("statistics (rank" not in message for message in said[:4])
    assert [p.report()["total"]["raw_bytes"] > 0 for p in big.pipelines] == [True] * 4 + [False] * 2
    assert all(torch.equal(p.compressor.state_dict()["warm"]["w"], saved_warm["w"]) for p in big.pipelines)


@dataclass(repr=False)
class Counted(Compressor):
    """Sends its input as it is and counts, per key, how often this rank compressed: a state of the rank's
    own (not formed by decoding what every rank receives), which another world size cannot keep."""

    name = "test_counted"
    _counts: dict = field(default_factory=dict, init=False, repr=False)

    def _compress(self, flat: torch.Tensor, ctx) -> Packet:  # noqa: ANN001
        self._counts[ctx.key] = self._counts.get(ctx.key, 0) + 1
        return Packet({"values": flat.float().clone()}, flat.shape, flat.dtype)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return packet["values"]

    def state_dict(self) -> dict:
        return {"calls": {key: torch.tensor(count) for key, count in self._counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._counts = {key: int(count) for key, count in state.get("calls", {}).items()}


def test_a_rank_own_compressor_state_is_dropped_with_the_memory():
    sim, state = _resumed(Counted(), 3, feedback="none")
    assert sim.pipelines[0].compressor.state_dict()["calls"]
    small = gradpress.Simulator(Counted(), 2, seed=1, feedback="none")
    with pytest.warns(UserWarning, match=r"dropped test_counted's own state \('calls'\)"):
        small.load_state_dict(state, on_world_size_change="reset")
    assert all(p.compressor.state_dict() == {"calls": {}} for p in small.pipelines)
    assert small.pipelines[1].steps == {"w": 3, "b": 3}


def test_an_auto_state_of_another_world_size_drops_the_residuals_and_decides_again():
    spec = "topk:ratio=0.5"
    auto = AutoOptions(candidates=(spec,))
    saved = AutoPipeline(auto, Options(), 0, 4)
    saved.choice, saved.next_decision, saved.decided_at = {"w": spec}, 507, 7
    saved.steps["w"], saved.shapes["w"] = 9, (3,)
    saved.pipeline(spec).feedback.update_residual("w", torch.ones(3))
    saved._flush["w"] = torch.ones(3)
    saved.stats.add(8, raw_bytes=12)
    state = gathered([{**saved.state_dict(), "rank": rank} for rank in range(4)])
    resumed = AutoPipeline(auto, Options(), 0, 2)
    with pytest.raises(ValueError, match="4 ranks cannot load into a world of 2"):
        resumed.load_state_dict(state)
    with pytest.warns(UserWarning) as caught:
        resumed.load_state_dict(state, on_world_size_change="reset")
    message = str(caught[0].message)
    assert "the residuals of 1 tensors waiting to be sent once" in message
    assert f"{spec}: the error-feedback memory (residual) of 1 tensor ('w')" in message
    assert resumed.choice == {"w": spec} and resumed.steps == {"w": 9} and resumed.next_decision == 0
    assert resumed._flush == {} and resumed.pipeline(spec).feedback.state_dict() == {"memory": {}}
    assert resumed.report()["total"]["raw_bytes"] == 12


# -- two processes ---------------------------------------------------------------------------------------
def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


NET_SHAPES = {name: tuple(p.shape) for name, p in _net().named_parameters()}


def _train(ddp: nn.Module, rank: int, steps: range) -> None:
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = nn.functional.mse_loss(ddp(x), x[:, :4])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _refused(make) -> str:  # noqa: ANN001
    try:
        gradpress.register(make(), SPEC)
    except TypeError as error:
        return str(error)
    return "accepted"


def _edges(rank: int, world_size: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    out: dict = {}

    def fsdp2() -> nn.Module:
        module = _net()
        fully_shard(module, mesh=init_device_mesh("cpu", (world_size,)))
        return module

    out["fsdp1"] = _refused(lambda: FullyShardedDataParallel(_net(), device_id=torch.device("cpu")))
    out["fsdp2"] = _refused(fsdp2)
    out["plain"] = _refused(_net)

    # statistics through a checkpoint: a gathered state, one file
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_net())
    state = gradpress.register(ddp, "topk:ratio=0.25", seed=2)
    _train(ddp, rank, range(3))
    saved = state.state_dict(gathered=True)
    out["before"] = state.stats()
    again = gradpress.register(nn.parallel.DistributedDataParallel(_net()), "topk:ratio=0.25", seed=2)
    again.load_state_dict(saved)
    out["after"] = again.stats()  # before the hook has run

    # a world of 4's file, loaded by 2 ranks
    checkpoint = torch.load(path, weights_only=False)
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_net())
    state = gradpress.register(ddp, SPEC, seed=1)
    try:
        state.load_state_dict(checkpoint)
        out["default"] = "loaded"
    except ValueError as error:
        out["default"] = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.load_state_dict(checkpoint, on_world_size_change="reset")
        # as Lightning and Accelerate load: the option given when registering
        framework = gradpress.register(nn.parallel.DistributedDataParallel(_net()), SPEC, seed=1,
                                       on_world_size_change="reset")
        framework.load_state_dict(checkpoint)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    out["loaded_stats"] = state.stats()
    out["loaded"] = state.state_dict()
    _train(ddp, rank, range(2))
    out["trained"] = state.state_dict()
    out["parameters"] = [p.detach().clone() for p in ddp.parameters()]
    return out


def test_register_refuses_fsdp_and_elastic_resume_in_two_processes(tmp_path):
    saved, state = _resumed_net(4)
    path = tmp_path / "world4.pt"
    torch.save(gathered(state), path)
    results = run_workers(_edges, 2, str(path), timeout=180)
    for rank, found in enumerate(results):
        for kind in ("fsdp1", "fsdp2"):
            assert "FSDP is not supported by register" in found[kind], found[kind]
            assert "use gradpress.fsdp.register(model, spec, mesh=mesh)" in found[kind], found[kind]
        assert "expected a torch.nn.parallel.DistributedDataParallel, got Sequential" in found["plain"]
        assert found["after"] == found["before"] and found["after"]["total"]["raw_bytes"] > 0
        assert "a gathered state of 4 ranks cannot load into a world of 2" in found["default"]
        assert "on_world_size_change='reset'" in found["default"]
        assert len(found["warnings"]) == 2, found["warnings"]
        for message in found["warnings"]:
            assert "saved at world size 4 loads into a world of 2" in message
            assert "dropped the error-feedback memory (residual) of 4 tensors" in message
        loaded = found["loaded"]
        assert loaded["world_size"] == 2 and loaded["rank"] == rank
        assert loaded["steps"] == {name: 3 for name in NET_SHAPES} and not any(loaded["feedback"].values())
        for key, warm in saved.pipelines[0].compressor.state_dict()["warm"].items():
            assert torch.equal(loaded["compressor"]["warm"][key], warm)
        assert found["loaded_stats"] == saved.pipelines[rank].report()  # this rank's own totals
        assert found["trained"]["steps"] == {name: 5 for name in NET_SHAPES}
        assert set(found["trained"]["feedback"]["memory"]) == set(NET_SHAPES)  # formed anew
        trained, loaded_total = found["trained"]["stats"]["total"], found["loaded"]["stats"]["total"]
        assert trained["raw_bytes"] > loaded_total["raw_bytes"]
    for a, b in zip(results[0]["parameters"], results[1]["parameters"], strict=True):
        assert torch.equal(a, b)


def _resumed_net(workers: int) -> tuple[gradpress.Simulator, list]:
    """The state of ``workers`` ranks training :func:`_net` under PowerSGD for 3 steps (simulated)."""
    sim = gradpress.Simulator(SPEC, workers, seed=1)
    for step in range(3):
        sim.step(_grads(workers, step, NET_SHAPES))
    return sim, sim.state_dict()
