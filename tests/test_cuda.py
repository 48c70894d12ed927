"""The GPU path: every registered method, composition and strategy on CUDA tensors against the CPU, and
the DDP hook with NCCL. Runs where CUDA is available and skips with the reason elsewhere (CI has no GPU).

What the design promises across devices, and what is checked:

* Every method runs on CUDA tensors and gives back the gradients' dtype, shape and device; feedback
  memory and warm starts live on the device (two steps of :class:`gradpress.Simulator`).
* Bit-identical to the CPU: the methods with no float reduction and no device random stream
  (``EXACT``: casts, signs and their majority vote, natural compression, whose stochastic rounding
  draws from the ``mix32`` hash, the same bits on every device; see :mod:`gradpress.core.rng`).
* Close to the CPU: every other method whose randomness is device-independent. A norm or a sum
  reduced in another order on the GPU may differ in its last bit and move the odd value across a
  quantization or selection boundary, so at most 0.1 % of the values (and 2) may differ beyond
  float32 round-off.
* Statistically alike: the methods that draw from a ``torch.Generator`` on the gradients' device
  (``DEVICE_RANDOM``: random-k indices, THC's Hadamard signs, PowerSGD's initial Q, DGC's and
  SketchML's samples, adaptive's draw): CUDA's generator gives other numbers than the CPU's for the
  same seed, so the error against the exact mean is compared instead of the values.
* Nothing made on the host (GPU only): a step of every method makes no tensor on the CPU; what the
  host reads of the device (a norm for a scale, a header's sizes, fault flags) arrives by a copy.
* The DDP hook with NCCL at world size 1 (and 2 where there are two GPUs): the hook runs, the averaged
  gradients equal ``Simulator`` fed with the same local gradients on the same device, bit for bit,
  and its steps make no tensor on the CPU either.

``GRADPRESS_CUDA_TESTS_ON_CPU=1`` runs the device comparisons with CPU tensors through the numba
kernels (the device the test is written for then being the CPU) against the torch path: a dry run of
this file's logic on a machine without a GPU.
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import gradpress
from gradpress.kernels.jit import numba_disabled
from specs import SPECS

if torch.cuda.is_available():
    DEVICE = torch.device("cuda")
elif os.environ.get("GRADPRESS_CUDA_TESTS_ON_CPU") == "1":
    DEVICE = torch.device("cpu")
else:
    DEVICE = None

pytestmark = pytest.mark.skipif(
    DEVICE is None, reason="CUDA is not available: the GPU path (every method on CUDA tensors, the DDP hook "
    "with NCCL) is tested only on a machine with a GPU; GRADPRESS_CUDA_TESTS_ON_CPU=1 dry-runs the "
    "comparisons on the CPU")

# no float reduction, no device random stream: the same bits on every device
EXACT = {"none", "fp16", "bf16", "signsgd", "natural"}
# draw from a torch.Generator on the gradients' device: other numbers on CUDA than on the CPU
DEVICE_RANDOM = {"randomk", "powersgd", "thc", "dgc", "sketchml", "adaptive"}

WORKERS = 3  # float sums over 3+ workers go in rank order: no backend order anywhere
MODES = [
    ("ps topk", "topk:ratio=0.2", {"mode": "ps", "root": 1}),
    ("ps randomk master topk", "randomk:ratio=0.5", {"mode": "ps", "master": "topk:ratio=0.5"}),
    ("ps powersgd master natural", "powersgd:rank=2", {"mode": "ps", "master": "natural", "root": 1}),
    ("ps thc", "thc", {"mode": "ps", "root": 2}),
    ("switch thc_uniform", "thc_uniform", {"mode": "switch"}),
    ("switch thc_uniform partial", "thc_uniform", {"mode": "switch", "partial": 0.6}),
    ("ps topk partial", "topk:ratio=0.2", {"mode": "ps", "partial": 0.6, "root": 1}),
    ("ps natural, switch-free", "natural", {"mode": "ps"}),
    ("options", "topk:ratio=0.1", {"exclude": ["c"], "warmup_steps": 1, "min_numel": 30}),
    ("backend order", "none", {"deterministic": False}),
]


def _names(spec: Any) -> set[str]:
    return {part.partition(":")[0] for part in spec.split("+")} if isinstance(spec, str) else set()


def _grads(step: int, dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    """Each worker's gradients at ``step``: a matrix, a long vector and a tiny one (on the CPU)."""
    out = []
    for rank in range(WORKERS):
        g = torch.Generator().manual_seed(100 * step + rank)
        out.append({"a": torch.randn(64, 48, generator=g).to(dtype),
                    "b": torch.randn(3000, generator=g).to(dtype),
                    "c": torch.randn(7, generator=g).to(dtype)})
    return out


def _run(spec: Any, device: torch.device, steps: int = 2, dtype: torch.dtype = torch.float32,
         **options: Any) -> list[dict[str, torch.Tensor]]:
    """What every worker receives at each of ``steps`` steps, gradients on ``device``."""
    sim = gradpress.Simulator(spec, WORKERS, seed=0, **options)
    received = []
    for step in range(steps):
        grads = [{k: t.to(device) for k, t in mine.items()} for mine in _grads(step, dtype)]
        out = sim.step(grads)
        for key, t in out.items():
            assert t.device.type == device.type, f"{key}: came back on {t.device}, sent on {device}"
            assert t.dtype == grads[0][key].dtype and t.shape == grads[0][key].shape
        for pipeline in sim.pipelines:  # memory and warm starts live on the gradients' device
            _assert_on(pipeline.state_dict(), device)
        received.append(out)
    return received


def _assert_on(value: Any, device: torch.device, where: str = "state") -> None:
    if isinstance(value, torch.Tensor):
        assert value.device.type == device.type, f"{where} is on {value.device}, the gradients on {device}"
    elif isinstance(value, dict):
        for k, v in value.items():
            _assert_on(v, device, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _assert_on(v, device, f"{where}[{i}]")


def _nmse(approx: dict[str, torch.Tensor], step: int, dtype: torch.dtype) -> float:
    exact = {k: torch.stack([w[k].double() for w in _grads(step, dtype)]).mean(0) for k in approx}
    error = sum(float((approx[k].cpu().double() - exact[k]).square().sum()) for k in approx)
    return error / sum(float(exact[k].square().sum()) for k in approx)


def _compare(spec: Any, device_out: list, cpu_out: list, dtype: torch.dtype = torch.float32) -> None:
    names = _names(spec)
    for step, (got, want) in enumerate(zip(device_out, cpu_out, strict=True)):
        got = {k: t.cpu() for k, t in got.items()}
        if all(torch.equal(got[k], want[k]) for k in want):
            continue
        assert not names <= EXACT, f"{spec} step {step}: differs from the CPU, which it must equal exactly"
        if names & DEVICE_RANDOM:
            ours, theirs = _nmse(got, step, dtype), _nmse(want, step, dtype)
            assert ours <= 2 * theirs + 1e-3, \
                f"{spec} step {step}: NMSE {ours:.3g} on the device, {theirs:.3g} on the CPU"
            continue
        total = sum(t.numel() for t in want.values())
        off = 0
        for k in want:
            a, b = got[k].float(), want[k].float()
            tolerance = 1e-5 * (1 + b.abs().max()) + 1e-4 * b.abs()
            off += int(((a - b).abs() > tolerance).sum())
        assert off <= max(2, total // 1000), f"{spec} step {step}: {off} of {total} values differ"


@pytest.mark.parametrize("spec", SPECS)
def test_method_on_device_matches_cpu(spec):
    with numba_disabled():
        cpu = _run(spec, torch.device("cpu"))
    _compare(spec, _run(spec, DEVICE), cpu)


@pytest.mark.parametrize("label, spec, options", MODES, ids=[m[0] for m in MODES])
def test_strategy_on_device_matches_cpu(label, spec, options):
    with numba_disabled():
        cpu = _run(spec, torch.device("cpu"), **options)
    _compare(spec, _run(spec, DEVICE, **options), cpu)


def _made_on_host(fn) -> list[str]:
    """The operators of ``fn()`` that made a tensor on the CPU, less the copies of device values to the
    host that the method reads (``_to_copy``)."""
    from gradpress.bench.ops import host_traffic

    return [op for op in host_traffic(fn)[1] if op != "_to_copy"]


@pytest.mark.skipif(DEVICE is None or DEVICE.type != "cuda", reason="needs a CUDA GPU (host and device "
                    "are one on the CPU)")
@pytest.mark.parametrize("spec", SPECS)
def test_a_step_on_device_makes_nothing_on_the_host(spec):
    sim = gradpress.Simulator(spec, WORKERS, seed=0)
    grads = [[{k: t.to(DEVICE) for k, t in mine.items()} for mine in _grads(step)] for step in range(2)]
    sim.step(grads[0])  # the first step agrees the keys and warms up
    assert _made_on_host(lambda: sim.step(grads[1])) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("spec", ["none", "topk:ratio=0.1", "qsgd", "natural", "thc_uniform",
                                  "powersgd:rank=2"])
def test_half_precision_gradients_on_device(spec, dtype):
    with numba_disabled():
        cpu = _run(spec, torch.device("cpu"), dtype=dtype)
    _compare(spec, _run(spec, DEVICE, dtype=dtype), cpu, dtype)


# -- the DDP hook with NCCL ------------------------------------------------------------------------------
HOOK_SPECS = ["none", "topk:ratio=0.1", "qsgd", "powersgd:rank=2", "thc", "natural"]


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(12, 40)
        self.out = torch.nn.Linear(40, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


def _nccl_worker(rank: int, world_size: int, specs: list[str], device_type: str = "cuda") -> dict[str, Any]:
    """Per spec: 3 steps of DDP with the gradpress hook on GPU ``rank``; every step, every rank's local
    gradients (from a twin model without DDP) are gathered and fed to ``Simulator`` on the same
    device, whose output the hook's averaged gradients must equal bit for bit. (``device_type="cpu"``:
    the same on Gloo, the dry run.)"""
    import torch.distributed as dist

    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    found = {}
    for spec in specs:
        torch.manual_seed(0)
        twin = _Net().to(device)
        model = _Net().to(device)
        model.load_state_dict(twin.state_dict())
        ids = [rank] if device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=0.001)
        state = gradpress.register(ddp, spec, seed=0)
        sim = gradpress.Simulator(spec, world_size, seed=0)
        mismatched = []
        for step in range(3):
            g = torch.Generator().manual_seed(1000 * rank + step)
            x = torch.randn(16, 12, generator=g).to(device)
            twin.zero_grad()
            twin(x).square().mean().backward()
            local = {name: p.grad.detach().clone() for name, p in twin.named_parameters()}
            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, {k: t.cpu() for k, t in local.items()})
            expected = sim.step([{k: t.to(device) for k, t in mine.items()} for mine in everyone])
            ddp.zero_grad()
            made_on_host = []
            if device.type == "cuda" and step == 2:  # (warm: the ranks agreed the keys on the first step)
                made_on_host = _made_on_host(lambda ddp=ddp, x=x: ddp(x).square().mean().backward())
            else:
                ddp(x).square().mean().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            mismatched += [f"step {step} {name}" for name, p in model.named_parameters()
                           if not torch.equal(p.grad, expected[name])]
            with torch.no_grad():  # both models take the same step from the averaged gradients
                for p, q in zip(model.parameters(), twin.parameters(), strict=True):
                    p -= 0.1 * p.grad
                    q.copy_(p)
            mismatched += [f"step {step}: made on the host: {made_on_host}"] if made_on_host else []
        total = state.stats()["total"]
        found[spec] = {"raw_bytes": total["raw_bytes"], "sent_bytes": total["sent_bytes"], "mismatched": mismatched,
                       "error": repr(state.error) if state.error is not None else None,
                       "parameters": {n: p.detach().cpu() for n, p in model.named_parameters()}}
        del ddp
    return found


def _check_nccl(results: list[dict[str, Any]]) -> None:
    for rank, found in enumerate(results):
        for spec, figures in found.items():
            assert figures["error"] is None, f"rank {rank}, {spec}: {figures['error']}"
            assert figures["raw_bytes"] > 0, f"rank {rank}, {spec}: the hook did not run"
            assert figures["sent_bytes"] > 0 or len(results) == 1, f"rank {rank}, {spec}: nothing sent"
            assert figures["mismatched"] == [], \
                f"rank {rank}, {spec}: differs from Simulator: {figures['mismatched']}"
            other = results[0][spec]["parameters"]
            assert all(torch.equal(p, other[n]) for n, p in figures["parameters"].items()), \
                f"rank {rank}, {spec}: parameters differ from rank 0's"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU")
def test_ddp_hook_with_nccl_world_size_1():
    from dist_utils import run_workers

    _check_nccl(run_workers(_nccl_worker, 1, HOOK_SPECS, timeout=300, backend="nccl"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for 2 NCCL ranks")
def test_ddp_hook_with_nccl_world_size_2():
    from dist_utils import run_workers

    _check_nccl(run_workers(_nccl_worker, 2, HOOK_SPECS, timeout=300, backend="nccl"))


@pytest.mark.skipif(DEVICE is None or DEVICE.type != "cpu", reason="the dry run of the NCCL test, on Gloo")
def test_ddp_hook_dry_run_on_gloo():
    from dist_utils import run_workers

    _check_nccl(run_workers(_nccl_worker, 2, HOOK_SPECS, "cpu", timeout=120))
