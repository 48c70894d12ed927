"""gradpress.fsdp: compressed gradient reduction for models sharded with FSDP2's ``fully_shard``.

Two spawns of real Gloo processes, many checks each (a spawn costs seconds on a loaded machine): four
processes on a 2×2 ("replicate", "shard") mesh (HSDP) and two on a 1-D mesh. The model: a small MLP
whose three layers are each ``fully_shard``-ed, plus the root, which holds a parameter of its own; the
first layer's 21 rows shard unevenly (FSDP pads them). One test runs in-process: the compressed
reduce-scatter's protocol against ``simulate``'s all-reduce of the same rows.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

import gradpress
import gradpress.fsdp
from dist_utils import run_workers
from gradpress.exchange.pipeline import Options, Pipeline
from gradpress.exchange.protocol import Round
from gradpress.simulation import _check_same, _results, _send_all

EPS32 = torch.finfo(torch.float32).eps
EPS16 = torch.finfo(torch.float16).eps


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(12, 21), nn.Linear(21, 16), nn.Linear(16, 4)])
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))  # the root's own parameter
        self.poison = False  # a NaN in the output's first column (this rank's gradients of it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        out = self.layers[-1](x) * self.scale
        if self.poison:
            out = out + torch.tensor([float("nan"), 0.0, 0.0, 0.0])
        return out


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 12, generator=g)
    return x, x[:, :4] * 0.5 - x[:, 4:8]


def _sharded(mesh, seed: int = 0) -> MLP:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = MLP()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return nn.functional.mse_loss(model(x), y)


def _train(model: nn.Module, rank: int, steps: range, lr: float = 0.1) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = _loss(model, rank, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to_local().clone() for name, p in model.named_parameters()}


def _abs_sum(rank: int, steps: list[int], each: bool = False) -> dict[str, torch.Tensor]:
    """Σ over the ranks of |this rank's local gradient| (summed over ``steps``' micro-batches, or with
    ``each`` the sum of their magnitudes), from an unsharded copy of the model: what bounds the rounding
    of the ranks' average."""
    import torch.distributed as dist

    torch.manual_seed(0)
    plain = MLP()
    totals: dict[str, torch.Tensor] = {}
    for step in steps:
        _loss(plain, rank, step).backward()
        if each:
            for name, p in plain.named_parameters():
                totals[name] = totals.get(name, 0) + p.grad.abs()
            plain.zero_grad()
    out = {}
    for name, p in plain.named_parameters():
        total = totals[name] if each else p.grad.abs()
        dist.all_reduce(total)
        out[name] = total
    return out


def _sum_bound(abs_sum: torch.Tensor, summands: int, ranks: int = 4) -> torch.Tensor:
    """|native mean − gradpress mean| where both add ``summands`` float32 values in some order (each sum
    within (summands−1)·u·Σ|g| of the exact one, u = eps/2) and divide by ``ranks`` (a power of two:
    exact)."""
    return 2 * (summands - 1) * (EPS32 / 2) * abs_sum / ranks


# -- in one process (first: it compiles the kernels the processes then load) ------------------------------
def test_reduce_scatter_protocol_equals_simulated_allreduce_of_rows():
    """Each rank's row from the compressed reduce-scatter is, bit for bit, what ``simulate``'s all-reduce
    gives for that row (the same keys, steps and random streams): two steps, 3 workers, uneven shapes."""
    names, shapes, n = ["a.weight", "a.bias", "b.weight"], [(5, 4), (7,), (2, 3, 2)], 3
    for spec, options in [("thc", {}), ("fp16", {}), ("randomk:ratio=0.3", {"exclude": ["a.b*"]})]:
        pipelines = [Pipeline(gradpress.make(spec), Options.of(**options), r, n) for r in range(n)]
        simulator = gradpress.Simulator(spec, n, **options)
        for step in range(2):
            g = torch.Generator().manual_seed(step)
            local = [[[torch.randn(s, generator=g) for s in shapes] for _ in range(n)] for _ in range(n)]
            groups = [p.scatter_groups([[(f"{k}[{j}]", local[r][j][i].clone()) for i, k in enumerate(names)]
                                        for j in range(n)], names) for r, p in enumerate(pipelines)]
            got = [[None] * len(names) for _ in range(n)]
            for index in range(len(groups[0])):
                protocols = [groups[r][index].protocol for r in range(n)]
                rounds = _send_all(protocols, [None] * n)
                while isinstance(rounds[0], Round):
                    _check_same(rounds)
                    rounds = _send_all(protocols, _results([r.requests for r in rounds], n, only=None))
                for r in range(n):
                    for i, value in zip(groups[r][index].members, rounds[r], strict=True):
                        got[r][i] = value
            want = simulator.step([{f"{k}[{j}]": local[r][j][i].clone() for j in range(n)
                                    for i, k in enumerate(names)} for r in range(n)])
            for r in range(n):
                for i, k in enumerate(names):
                    assert torch.equal(got[r][i], want[f"{k}[{r}]"]), (spec, step, r, k)


def test_register_refuses_what_is_not_fully_shard():
    with pytest.raises(TypeError, match="fully_shard"):
        gradpress.fsdp.register(MLP(), "none")
    with pytest.raises(ValueError, match="does not run 'auto'"):
        gradpress.fsdp.register(MLP(), "auto")


# -- HSDP: 4 processes on a 2×2 mesh ----------------------------------------------------------------------
def _faulty_backward(model, rank: int, poisoned: int, seed: int) -> tuple[str, float]:
    """A backward pass with a NaN gradient on rank ``poisoned``: what it raised here, and after how long."""
    import torch.distributed as dist

    model.poison = rank == poisoned
    dist.barrier()
    start = time.monotonic()
    try:
        _loss(model, rank, seed).backward()
        fault = "no error"
    except Exception as error:  # noqa: BLE001 - reported to the parent
        fault = f"{type(error).__name__}: {error}"
    return fault, time.monotonic() - start


def _hsdp(rank: int, world_size: int, path: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out: dict = {}

    # 'none' equals native HSDP's gradients, and FSDP's all-reduce over the replicas no longer runs
    native, ours = _sharded(mesh), _sharded(mesh)
    state = gradpress.fsdp.register(ours, "none", mesh=mesh)
    out["repr"] = repr(state)
    replicate = mesh.get_group("replicate")
    all_reduce, counted = dist.all_reduce, []

    def counting(tensor, *args, **kwargs):  # FSDP's all-reduce, counted
        if kwargs.get("group") is replicate:
            counted.append(tensor.numel())
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        for model in (native, ours):
            _loss(model, rank, 0).backward()
            out.setdefault("fsdp_all_reduces", []).append(len(counted))
    finally:
        dist.all_reduce = all_reduce
    out["native_grads"], out["none_grads"] = _full_grads(native), _full_grads(ours)
    out["abs_sum"] = _abs_sum(rank, [0])
    out["none_stats"] = state.stats()

    # accumulation: a micro-batch under set_requires_gradient_sync(False), then a synchronized one
    native, ours = _sharded(mesh), _sharded(mesh)
    state = gradpress.fsdp.register(ours, "none")
    for model in (native, ours):
        model.set_requires_gradient_sync(False)
        _loss(model, rank, 0).backward()
    out["unsynced_steps"] = state.pipeline.steps.copy()
    for model in (native, ours):
        model.set_requires_gradient_sync(True)
        _loss(model, rank, 1).backward()
    out["acc_native"], out["acc_ours"] = _full_grads(native), _full_grads(ours)
    out["acc_abs_sum"] = _abs_sum(rank, [0, 1])
    out["acc_steps"] = state.pipeline.steps.copy()
    # HSDP's set_requires_all_reduce(False): reduce-scattered, averaged over the replicas at the next step
    native, ours = _sharded(mesh), _sharded(mesh)
    state = gradpress.fsdp.register(ours, "none")
    for all_reduce in (False, True):
        for model in (native, ours):
            model.set_requires_all_reduce(all_reduce)
            _loss(model, rank, int(all_reduce)).backward()
    out["rs_native"], out["rs_ours"] = _full_grads(native), _full_grads(ours)
    out["rs_abs_sum"] = _abs_sum(rank, [0, 1], each=True)
    out["rs_steps"] = state.pipeline.steps.copy()

    # top-k trains with the replicas bit-identical; a DCP checkpoint resumes bit for bit
    model = _sharded(mesh)
    state = gradpress.fsdp.register(model, "topk:ratio=0.25", mesh=mesh, seed=3)
    out["topk_losses"] = _train(model, rank, range(2))
    dcp.save({"model": model.state_dict(), "gradpress": state}, checkpoint_id=path)
    out["topk_losses"] += _train(model, rank, range(2, 5))
    out["topk_params"] = _locals(model)
    out["topk_memory"] = {k: v.clone() for k, v in state.pipeline.feedback.state_dict()["memory"].items()}
    for with_state in (True, False):
        resumed = _sharded(mesh, seed=7)  # other initial values: the checkpoint's must replace them
        again = gradpress.fsdp.register(resumed, "topk:ratio=0.25", mesh=mesh, seed=3)
        target = {"model": resumed.state_dict(), **({"gradpress": again} if with_state else {})}
        dcp.load(target, checkpoint_id=path)
        resumed.load_state_dict(target["model"])
        _train(resumed, rank, range(2, 5))
        out["resumed" if with_state else "resumed_without_state"] = _locals(resumed)
    out["entries"] = sorted(again.state_dict())

    # a NaN gradient on rank 1 raises on every rank, at once
    model = _sharded(mesh)
    gradpress.fsdp.register(model, "topk:ratio=0.25", timeout=20)
    out["fault"], out["fault_s"] = _faulty_backward(model, rank, poisoned=1, seed=9)
    return out


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory):
    return run_workers(_hsdp, 4, str(tmp_path_factory.mktemp("dcp")), timeout=240)


def test_hsdp_none_equals_native_hsdp(hsdp):
    for found in hsdp:
        assert "hsdp=True" in found["repr"]
        for name, native in found["native_grads"].items():
            bound = _sum_bound(found["abs_sum"][name], 4)
            assert ((found["none_grads"][name] - native).abs() <= bound).all(), name
        # FSDP all-reduced the native model's 4 parameter groups over the replicas, not gradpress's model
        assert found["fsdp_all_reduces"] == [4, 4], found["fsdp_all_reduces"]
        assert found["none_stats"]["steps"] == 1 and found["none_stats"]["total"]["raw_bytes"] > 0


def test_hsdp_accumulation_compresses_only_the_synchronized_step(hsdp):
    for found in hsdp:
        assert found["unsynced_steps"] == {}
        assert set(found["acc_steps"].values()) == {1} and len(found["acc_steps"]) == 7
        for name, native in found["acc_native"].items():
            bound = _sum_bound(found["acc_abs_sum"][name], 4)
            assert ((found["acc_ours"][name] - native).abs() <= bound).all(), name
        assert set(found["rs_steps"].values()) == {1} and len(found["rs_steps"]) == 7
        for name, native in found["rs_native"].items():  # 8 summands: 2 micro-batches of 4 ranks
            bound = _sum_bound(found["rs_abs_sum"][name], 8)
            assert ((found["rs_ours"][name] - native).abs() <= bound).all(), name


def test_hsdp_topk_replicas_bit_identical_and_dcp_resume(hsdp):
    for shard in (0, 1):  # ranks shard and shard + 2 hold the same shard (replicas)
        a, b = hsdp[shard], hsdp[shard + 2]
        for name in a["topk_params"]:
            assert torch.equal(a["topk_params"][name], b["topk_params"][name]), name
        # each rank's error feedback is its own shard's
        assert any(v.abs().sum() > 0 for v in a["topk_memory"].values())
    for rank, found in enumerate(hsdp):
        losses = found["topk_losses"]
        assert all(map(math.isfinite, losses)), losses
        assert found["entries"] == [f"rank{rank}"]
        for name, value in found["topk_params"].items():
            assert torch.equal(found["resumed"][name], value), (rank, name)
    # without the error-feedback memory the resumed run differs: the checkpoint's state is what matters
    assert any(not torch.equal(found["resumed_without_state"][n], v)
               for found in hsdp for n, v in found["topk_params"].items())


def test_hsdp_nan_on_one_rank_raises_on_every_rank(hsdp):
    for found in hsdp:
        assert found["fault"].startswith("NonFiniteError"), found["fault"]
        assert "NaN/Inf" in found["fault"]
        assert found["fault_s"] < 15, found["fault_s"]  # at once, well before the 20 s timeout


# -- 1-D: 2 processes ------------------------------------------------------------------------------------
def _one_d(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    out: dict = {}
    try:
        gradpress.fsdp.register(_sharded(mesh), "topk:ratio=0.1", mesh=mesh)
        out["topk"] = "accepted"
    except ValueError as error:
        out["topk"] = str(error)

    # fp16 (no feedback): one step's gradients within fp16's rounding of native FSDP's
    native, ours = _sharded(mesh), _sharded(mesh)
    state = gradpress.fsdp.register(ours, "fp16", mesh=mesh, feedback="none")
    out["repr"] = repr(state)
    for model in (native, ours):
        _loss(model, rank, 0).backward()
    out["native_grads"], out["fp16_grads"] = _full_grads(native), _full_grads(ours)
    out["abs_sum"] = _abs_sum(rank, [0])
    out["fp16_keys"] = sorted(state.pipeline.steps)

    # THC trains (the same batches every step: the loss must fall), then a NaN on rank 0
    model = _sharded(mesh)
    state = gradpress.fsdp.register(model, "thc", mesh=mesh, timeout=20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out["thc_losses"] = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = _loss(model, rank, 0)
        loss.backward()
        optimizer.step()
        out["thc_losses"].append(loss.item())
    out["thc_stats"] = state.stats()
    out["fault"], out["fault_s"] = _faulty_backward(model, rank, poisoned=0, seed=1)
    return out


@pytest.fixture(scope="module")
def one_d():
    return run_workers(_one_d, 2, timeout=240)


def test_one_d_refuses_methods_whose_summands_do_not_add(one_d):
    for found in one_d:
        message = found["topk"]
        assert "topk" in message and "methods that can:" in message, message
        for name in ("fp16", "bf16", "thc", "thc_uniform", "none"):
            assert name in message.split("methods that can:")[1], message
        assert "powersgd" not in message.split("methods that can:")[1]


def test_one_d_fp16_reduce_scatter_within_fp16_rounding(one_d):
    u16, u32 = EPS16 / 2, EPS32 / 2
    for found in one_d:
        assert "hsdp=False" in found["repr"]
        assert "layers.0.weight[1]" in found["fp16_keys"] and "scale[0]" in found["fp16_keys"]
        for name, native in found["native_grads"].items():
            # each rank's value rounded to fp16, their fp16 sum rounded once more, then halved (exact);
            # native: a float32 sum; plus half fp16's subnormal spacing per rounding
            total = found["abs_sum"][name]
            bound = (2 * u16 * (1 + u16) + 2 * u32) * total / 2 + 2 * 2.0 ** -25
            assert ((found["fp16_grads"][name] - native).abs() <= bound).all(), name
        assert any(not torch.equal(found["fp16_grads"][n], g) for n, g in found["native_grads"].items())


def test_one_d_thc_trains_and_nan_raises_on_every_rank(one_d):
    for found in one_d:
        losses = found["thc_losses"]
        assert losses[-1] < losses[0], losses
        assert found["thc_stats"]["total"]["collectives"] > 0
        assert found["fault"].startswith("NonFiniteError"), found["fault"]
        assert found["fault_s"] < 15, found["fault_s"]
