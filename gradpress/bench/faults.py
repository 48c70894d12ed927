"""How long every rank takes to raise when one rank goes wrong (the README's "Under faults" figures).

    gradpress bench faults --workers 2 --timeout 30

Spawns ``--workers`` CPU processes in one Gloo group. For every ``--compressors`` entry under each
strategy (all-reduce / all-gather, parameter server, switch where the method sums integers, and
bidirectional compression with a ``natural`` master), a fresh ``Communicator(spec, timeout=…)`` makes
one healthy exchange, then the last rank's gradient gets a NaN: each rank times its exchange until it
raises, and reports what it raised. Then the last rank kills itself (SIGKILL) in the middle of a DDP
backward pass, and the others time how long their exchange takes to fail. Before gradpress carried
the fault flag in-band, the ranks without the NaN waited out the ``timeout``.
"""
from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import time
from typing import Any

import torch
from torch import nn

from gradpress.bench import add_bench, run_as_script, spawn, write_json
from gradpress.testbed import arguments

STRATEGIES = {
    "collective": {},
    "ps": {"mode": "ps"},
    "switch": {"mode": "switch"},
    "ps+master": {"mode": "ps", "master": "natural"},
}


def _timed(call) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        call()
    except Exception as error:  # noqa: BLE001 - reported
        return type(error).__name__, time.perf_counter() - start
    return "ok", time.perf_counter() - start


def _nan(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """Each spec under each strategy: one healthy exchange, then a NaN on the last rank, timed."""
    import gradpress

    results: dict[str, Any] = {}
    g = torch.Generator().manual_seed(rank)
    for spec in args["specs"]:
        for name, options in STRATEGIES.items():
            try:
                comm = gradpress.Communicator(spec, timeout=args["timeout"], **options)
                comm.reduce_many({"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)})
            except ValueError:  # not applicable (a switch adds integers only): every rank alike
                continue
            grads = {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}
            if rank == world - 1:
                grads["w"][3, 5] = float("nan")
            results[f"{spec} {name}"] = _timed(functools.partial(comm.reduce_many, grads))
    return results


def _kill(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """A healthy DDP step, then the last rank kills itself (SIGKILL) in the middle of a backward pass."""
    import gradpress

    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
    gradpress.register(ddp, "topk:ratio=0.01", timeout=args["timeout"])
    ddp(torch.randn(32, 64)).sum().backward()
    if rank == world - 1:
        ddp.module[2].weight.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
    return {"SIGKILL mid-step (DDP, topk)": _timed(lambda: (ddp(torch.randn(32, 64)).sum().backward(),
                                                              ddp(torch.randn(32, 64)).sum().backward()))}


def run(specs: list[str], workers: int = 2, timeout: float = 30.0) -> list[dict[str, Any]]:
    """Per case, what each rank raised and after how many seconds (the last rank is the faulty one)."""
    args = dict(specs=specs, timeout=timeout)
    nan = spawn(_nan, workers, args, timeout=60 + len(specs) * len(STRATEGIES) * (timeout + 5))
    killed = [r or {} for r in spawn(_kill, workers, args, timeout=60 + timeout, may_die=frozenset({workers - 1}))]
    results = [{**a, **b} for a, b in zip(nan, killed, strict=True)]
    rows = []
    for case in results[0]:
        row: dict[str, Any] = {"case": case}
        for r, result in enumerate(results):
            if case in result:
                row[f"rank {r}"] = {"raised": result[case][0], "seconds": result[case][1]}
        rows.append(row)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compressors", type=arguments.compressor_list(keywords={"all": arguments.all_methods}), default="all",
                        help="comma-separated specs, or 'all' (default)")
    parser.add_argument("--workers", type=arguments.positive_int, default=2)
    parser.add_argument("--timeout", type=arguments.positive_float, default=30.0,
                        help="the process group's timeout in seconds (what peers would wait without the flag)")
    parser.add_argument("--json", type=arguments.output_file, help="write the figures to this file")


def main(args: argparse.Namespace) -> int:
    specs = list(args.compressors)
    rows = run(specs, args.workers, args.timeout)
    print(f"{args.workers} Gloo workers, timeout {args.timeout:g} s; rank {args.workers - 1} is the faulty one")
    for row in rows:
        ranks = [row.get(f"rank {r}") for r in range(args.workers)]
        said = "  ".join(f"{r['raised']} {r['seconds']:.3f} s" if r else "(died)" for r in ranks)
        print(f"  {row['case']:40s} {said}")
    nan = [max(r["seconds"] for k, r in row.items() if k != "case") for row in rows if "SIGKILL" not in row["case"]]
    if nan:
        print(f"NaN on one rank: every rank raised within {max(nan):.3f} s (median {statistics.median(nan):.3f} s) "
              f"over {len(nan)} cases")
    if args.json:
        write_json(args.json, rows)
    return 0


def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench faults`` under the ``bench`` subcommand's subparsers."""
    add_bench(bench_subparsers, "faults", "seconds until every rank raises when one rank fails", __doc__,
              add_arguments, main)


if __name__ == "__main__":
    run_as_script(__doc__, add_arguments, main)
