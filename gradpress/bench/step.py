"""Per-step compression cost in a real DDP step: compress and decompress milliseconds per method.

    gradpress bench step --model mlp-wide --compressors topk:ratio=0.01,natural,qsgd,thc

Spawns ``--workers`` CPU processes (one thread each) in one Gloo group over loopback. For every
``--compressors`` entry, with its default error-feedback memory and with ``feedback=none``, each builds
the testbed ``--model`` (random weights, random batches of the model's input shape) in DDP with the
gradpress hook, trains ``--warmup`` steps, then times ``--steps`` steps and reads the hook's own
statistics: ``compress_s`` (feedback compensation, compression, feedback update) and ``decompress_s``
(decoding and summing into the bucket), per step. A copy of a tensor the size of the model's gradient
from memory into memory (:func:`gradpress.testbed.train.copy_s`: a kept buffer, neither end in cache) is
timed in the same process between variants, so the figures also read in copies:
machines of this kind differ, ratios to a copy much less.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn

from gradpress.bench import add_bench, run_as_script, spawn, write_json
from gradpress.testbed import arguments
from gradpress.testbed.train import copy_s, model_spec


def _worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import gradpress
    from gradpress.testbed.models import make_model, model_config

    config = model_config(args["model"])
    shape = (args["batch"], getattr(config, "in_channels", 1), getattr(config, "image_size", 28),
             getattr(config, "image_size", 28))
    classes = getattr(config, "num_classes", 10)
    g = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(shape, generator=g), torch.randint(classes, (args["batch"],), generator=g))
               for _ in range(4)]
    results: dict[str, Any] = {"runs": []}
    numel = None
    for spec in args["specs"]:
        default = gradpress.make(spec).default_feedback
        for feedback in args["feedbacks"]:
            if feedback == "none" and default == "none" and "default" in args["feedbacks"]:
                continue  # the same run twice
            torch.manual_seed(0)
            model = make_model(args["model"])
            numel = sum(p.numel() for p in model.parameters())
            ddp = nn.parallel.DistributedDataParallel(model)
            options = {} if feedback == "default" else {"feedback": feedback}
            state = gradpress.register(ddp, spec, **options)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
            rows = []
            for step in range(args["warmup"] + args["steps"]):
                x, y = batches[step % len(batches)]
                dist.barrier()
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=False)
                nn.functional.cross_entropy(ddp(x), y).backward()
                optimizer.step()
                wall = time.perf_counter() - start
                last = state.stats()["last"]
                if step >= args["warmup"]:
                    rows.append((wall, last["compress_s"], last["decompress_s"], last["sent_bytes"]))
            results["runs"].append({
                "spec": spec, "feedback": default if feedback == "default" else feedback,
                "step_ms": 1e3 * statistics.median(r[0] for r in rows),
                "compress_ms": 1e3 * statistics.median(r[1] for r in rows),
                "decompress_ms": 1e3 * statistics.median(r[2] for r in rows),
                "sent_bytes": statistics.median(r[3] for r in rows),
                "copy_ms": 1e3 * copy_s(numel),
            })
    results["numel"] = numel
    return results


def run(specs: list[str], model: str = "mlp-wide", workers: int = 2, batch: int = 64, steps: int = 20,
        warmup: int = 3, feedbacks: tuple[str, ...] = ("default", "none")) -> dict[str, Any]:
    """Rank 0's medians per (spec, feedback): step, compress and decompress ms, and the copy ms."""
    args = dict(specs=specs, model=model, batch=batch, steps=steps, warmup=warmup, feedbacks=list(feedbacks))
    return spawn(_worker, workers, args)[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compressors", type=arguments.compressor_list(), default="topk:ratio=0.01,natural,qsgd,thc",
                        help="comma-separated gradpress specs")
    parser.add_argument("--model", type=model_spec, default="mlp-wide", help="a testbed model spec")
    parser.add_argument("--workers", type=arguments.positive_int, default=2)
    parser.add_argument("--batch", type=arguments.positive_int, default=64)
    parser.add_argument("--steps", type=arguments.positive_int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=arguments.positive_int, default=3)
    parser.add_argument("--feedback", choices=("both", "default", "none"), default="both",
                        help="the method's default memory, none, or both (default)")
    parser.add_argument("--json", type=arguments.output_file, help="write the figures to this file")


def main(args: argparse.Namespace) -> int:
    feedbacks = ("default", "none") if args.feedback == "both" else (args.feedback,)
    result = run(list(args.compressors), args.model, args.workers, args.batch, args.steps, args.warmup,
                 feedbacks)
    runs = result["runs"]
    print(f"{args.workers} Gloo workers (loopback), {args.model} ({result['numel'] / 1e6:.2f} M parameters), "
          f"batch {args.batch}, one thread each; medians of {args.steps} steps, rank 0")
    print(f"  {'spec':28s} {'feedback':9s} {'compress':>14s} {'decompress':>14s} {'step':>9s}   copy")
    for r in runs:
        copies = lambda ms, r=r: f"{ms:6.2f} ms {ms / r['copy_ms']:4.1f}×"  # noqa: E731
        print(f"  {r['spec']:28s} {r['feedback']:9s} {copies(r['compress_ms'])} {copies(r['decompress_ms'])} "
              f"{r['step_ms']:6.1f} ms   {r['copy_ms']:.2f} ms")
    if args.json:
        write_json(args.json, {"config": vars(args), "result": result})
    return 0


def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench step`` under the ``bench`` subcommand's subparsers."""
    add_bench(bench_subparsers, "step", "per-step compress/decompress ms of a method in a DDP step", __doc__,
              add_arguments, main)


if __name__ == "__main__":
    run_as_script(__doc__, add_arguments, main)
