"""Step time of DDP with the gradpress hook against DDP's built-in all-reduce, same model and data.

    python -m gradpress.bench.ddp_overhead --workers 2 --rounds 5 --steps 5

Spawns ``--workers`` CPU processes in one Gloo group. Each builds one DDP model per variant (built-in
all-reduce; PyTorch's own ``allreduce_hook``, the same all-reduce driven from Python, for reference;
the gradpress hook with each ``--specs`` entry, ``none`` by default) from the same
weights, and times training steps (forward, backward with the exchange, SGD step) on the same batches,
variants interleaved round by round so drift in machine load hits all alike. Reports each variant's
median step time and its ratio to the built-in one (the target for ``none``: at most 1.1×).

``--model`` picks a preset MLP (``mlp-4m``: 4 × 1024, 4.2 M parameters, the default; ``mlp-1m``:
4 × 512, 1.05 M parameters, where Python's fixed cost per bucket weighs more); ``--width``/``--depth``
give any other square MLP.

``--device cuda`` runs the workers on GPUs with NCCL (rank r on GPU r; one worker per GPU), each step
timed to its completion (``torch.cuda.synchronize``), and audits one more step of each variant: how
many times the host waits for the GPU in it, and how many tensors its operators make on the CPU
(:func:`gradpress.bench.ops.host_traffic`).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time
from typing import Any

import torch
from torch import nn

from gradpress.bench import add_bench, run_as_script, spawn, write_json
from gradpress.testbed import arguments

# preset MLPs of ``--model``: (width, depth)
MODELS = {"mlp-4m": (1024, 4), "mlp-1m": (512, 4)}


def _model(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import gradpress

    device = torch.device("cuda", rank) if args["device"] == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    base = _model(args["width"], args["depth"])
    variants: dict[str, tuple[nn.parallel.DistributedDataParallel, torch.optim.Optimizer]] = {}
    for name in ["ddp", "torch-hook", *args["specs"]]:
        model = _model(args["width"], args["depth"])
        model.load_state_dict(base.state_dict())
        model.to(device)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
        if name == "torch-hook":  # the same all-reduce through a Python hook, for reference
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(None, allreduce_hook)
        elif name != "ddp":
            gradpress.register(ddp, name)
        variants[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(rank)
    batch = torch.randn(args["batch"], args["width"], generator=g).to(device)

    def step(ddp: nn.Module, optimizer: torch.optim.Optimizer, wait: bool = True) -> None:
        optimizer.zero_grad(set_to_none=False)
        ddp(batch).square().mean().backward()
        optimizer.step()
        if wait:
            sync()

    times: dict[str, list[float]] = {name: [] for name in variants}
    for ddp, optimizer in variants.values():  # warm-up: DDP's bucket rebuild, numba, allocator
        for _ in range(2):
            step(ddp, optimizer)
    for _ in range(args["rounds"]):
        for name, (ddp, optimizer) in variants.items():
            dist.barrier()
            sync()
            for _ in range(args["steps"]):
                start = time.perf_counter()
                step(ddp, optimizer)
                times[name].append(time.perf_counter() - start)
    audit = {}
    if device.type == "cuda":
        from gradpress.bench.ops import host_traffic

        for name, (ddp, optimizer) in variants.items():
            dist.barrier()
            sync()
            syncs, host_ops = host_traffic(functools.partial(step, ddp, optimizer, wait=False))
            sync()
            audit[name] = {"syncs": syncs, "host_tensors": len(host_ops)}
    return {"times": times, "audit": audit}


def run(specs: list[str], workers: int = 2, width: int = 1024, depth: int = 4, batch: int = 32,
        rounds: int = 5, steps: int = 5, threads: int = 1, device: str = "cpu") -> dict[str, dict[str, float]]:
    """Median step time (seconds, rank 0) per variant and its ratio to DDP's built-in all-reduce (on
    CUDA also ``syncs`` and ``host_tensors``: the host's waits for the GPU and the CPU tensors made in
    one step)."""
    args = dict(specs=specs, width=width, depth=depth, batch=batch, rounds=rounds, steps=steps, threads=threads,
                device=device)
    found = spawn(_worker, workers, args, threads=threads, backend="nccl" if device == "cuda" else "gloo")[0]
    times = found["times"]
    baseline = statistics.median(times["ddp"])
    return {name: {"median_s": statistics.median(t), "ratio": statistics.median(t) / baseline,
                   **found["audit"].get(name, {})} for name, t in times.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--specs", type=arguments.compressor_list(), default="none",
                        help="comma-separated gradpress specs to time (default: none)")
    parser.add_argument("--workers", type=arguments.positive_int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="preset MLP: " + ", ".join(f"{name} = {d} × {w}" for name, (w, d) in MODELS.items())
                        + " (default mlp-4m; or give --width/--depth)")
    parser.add_argument("--width", type=arguments.positive_int, default=None,
                        help="width of the MLP's square layers (default 1024)")
    parser.add_argument("--depth", type=arguments.positive_int, default=None, help="number of linear layers (default 4)")
    parser.add_argument("--batch", type=arguments.positive_int, default=32)
    parser.add_argument("--rounds", type=arguments.positive_int, default=5)
    parser.add_argument("--steps", type=arguments.positive_int, default=5,
                        help="timed steps per variant per round")
    parser.add_argument("--threads", type=arguments.positive_int, default=1, help="torch threads per worker")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: Gloo workers; cuda: NCCL workers, one per GPU")
    parser.add_argument("--json", type=arguments.output_file, help="write the figures to this file")


def main(args: argparse.Namespace) -> int:

    specs = list(args.specs)
    if args.model is not None and (args.width is not None or args.depth is not None):
        raise arguments.UsageError("give either --model or --width/--depth, not both")
    width, depth = MODELS[args.model] if args.model is not None else MODELS["mlp-4m"]
    args.width = args.width if args.width is not None else width
    args.depth = args.depth if args.depth is not None else depth
    if args.device == "cuda" and torch.cuda.device_count() < args.workers:
        raise arguments.UsageError(f"--device cuda --workers {args.workers}: this machine has "
                                   f"{torch.cuda.device_count()} CUDA GPU(s), one per worker needed")
    result = run(specs, args.workers, args.width, args.depth, args.batch, args.rounds, args.steps, args.threads,
                 args.device)
    params = args.depth * (args.width * args.width + args.width)
    where = (f"NCCL workers on {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "Gloo workers")
    print(f"{args.workers} {where}, MLP {args.depth}×{args.width} ({params / 1e6:.1f} M parameters), "
          f"batch {args.batch}, {args.threads} thread(s); median of {args.rounds}×{args.steps} steps")
    for name, figures in result.items():
        label = {"ddp": "DDP built-in all-reduce", "torch-hook": "torch's allreduce_hook (Python)"}.get(
            name, f"gradpress hook, {name}")
        audit = (f"   {figures['syncs']:3d} host syncs, {figures['host_tensors']} CPU tensors per step"
                 if "syncs" in figures else "")
        print(f"  {label:32s} {1e3 * figures['median_s']:8.1f} ms   {figures['ratio']:.3f}×{audit}")
    if args.json:
        write_json(args.json, {"config": vars(args), "result": result})
    return 0


def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench ddp`` under the ``bench`` subcommand's subparsers."""
    add_bench(bench_subparsers, "ddp", "DDP step time: gradpress hook vs built-in all-reduce", __doc__, add_arguments, main)


if __name__ == "__main__":
    run_as_script(__doc__, add_arguments, main)
