"""``gradpress bench ops``: micro-benchmarks of each compressor (GRACE Section 5's compression overhead
and data volume, per method and tensor size).

For every (compressor, size) it reports bits per element (from ``Packet.nbytes``), the NMSE
‖x̂ − x‖²/‖x‖² of one worker, the NMSE of the aggregate of n workers that compress the same vector with
independent private randomness (``compressor.aggregate``, so unbiased methods average their errors out
and biased ones don't), and the median compress and decompress times beside the median time of a plain
copy of the same tensor (``x.clone()``, which allocates its output as every compressor does), measured
in the same run so ratios stay meaningful on a noisy machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

import gradpress
from gradpress import cli
from gradpress.registry import split_specs
from gradpress.rng import Context

DEFAULT_SIZES = (2**20, 2**22)


@dataclass
class OpsRecord:
    """One row of ``bench ops`` (the fields of ``--json``)."""

    name: str
    spec: str
    numel: int
    bits_per_element: float
    nmse: float
    nmse_avg_n: float
    workers: int
    compress_ms: float
    decompress_ms: float
    copy_ms: float


def resolve_compressors(text: str) -> list[str]:
    """``all`` (every registered method with its defaults) or a comma-separated list of specs."""
    if text == "all":
        return gradpress.compressor_names()
    specs = split_specs(text)
    for spec in specs:
        gradpress.make(spec)  # fail early with the registry's message
    return specs


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up (numba compile, allocator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def nmse(estimate: torch.Tensor, x: torch.Tensor) -> float:
    x64 = x.double()
    return float((estimate.double() - x64).square().sum() / x64.square().sum())


def bench_one(spec: str, numel: int, workers: int, repeats: int, seed: int) -> OpsRecord:
    compressor = gradpress.make(spec)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    ctx = Context(seed=seed, step=0, key="bench")
    packet = compressor.compress(x, ctx)
    packets = [compressor.compress(x, Context(seed=seed, step=0, key="bench", rank=r)) for r in range(workers)]
    return OpsRecord(
        name=compressor.name or spec,
        spec=compressor.spec,
        numel=numel,
        bits_per_element=packet.nbytes * 8 / numel,
        nmse=nmse(compressor.decompress(packet), x),
        nmse_avg_n=nmse(compressor.aggregate(packets), x),
        workers=workers,
        compress_ms=median_ms(lambda: compressor.compress(x, ctx), repeats),
        decompress_ms=median_ms(lambda: compressor.decompress(packet), repeats),
        copy_ms=median_ms(x.clone, repeats),
    )


def run(specs: list[str], sizes: list[int], workers: int, repeats: int, seed: int,
        progress: Callable[[str], None] = lambda _: None) -> list[OpsRecord]:
    records = []
    for spec in specs:
        for numel in sizes:
            progress(f"{spec} @ {numel}")
            records.append(bench_one(spec, numel, workers, repeats, seed))
    return records


def render(records: list[OpsRecord]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gradpress bench ops (times: median ms; ratio = (compress + decompress) / copy)")
    for column in ("spec", "numel", "bits/elem", "NMSE", "NMSE avg n", "compress", "decompress", "copy", "ratio"):
        table.add_column(column, justify="left" if column == "spec" else "right")
    for r in records:
        table.add_row(r.spec, f"{r.numel:,}", f"{r.bits_per_element:.3f}", f"{r.nmse:.3g}",
                      f"{r.nmse_avg_n:.3g} (n={r.workers})", f"{r.compress_ms:.2f}", f"{r.decompress_ms:.2f}",
                      f"{r.copy_ms:.2f}", f"{(r.compress_ms + r.decompress_ms) / r.copy_ms:.1f}×")
    Console(width=shutil.get_terminal_size((150, 40)).columns).print(table)


def parse_size(text: str) -> int:
    from gradpress.registry import convert

    return convert(text, int, "size")


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    specs = resolve_compressors(args.compressors)
    sizes = args.sizes  # a list: checked as it was parsed (cli.sizes)
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("benchmarking") as status:
        records = run(specs, sizes, args.workers, args.repeats, args.seed,
                      progress=lambda what: status.update(f"benchmarking {what}"))
    render(records)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([asdict(r) for r in records], indent=1))
        console.print(f"wrote {len(records)} records to {path}")
    return 0


def add_bench_parser(bench: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench ops``."""
    ops = bench.add_parser("ops", help="bits, NMSE and speed of each compressor on one tensor",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ops.add_argument("--compressors", type=cli.compressor_list(keywords=("all",)), default="all",
                     help="'all' or a comma-separated list of specs (e.g. topk:ratio=0.01,qsgd:levels=16,bucket=512)")
    ops.add_argument("--sizes", type=cli.sizes, default=",".join(map(str, DEFAULT_SIZES)),
                     help="comma-separated sizes, 2^22 allowed")
    ops.add_argument("--workers", type=cli.positive_int, default=4,
                     help="workers whose packets are aggregated for 'NMSE avg n'")
    ops.add_argument("--repeats", type=cli.positive_int, default=7,
                     help="timed repetitions (the median is reported)")
    ops.add_argument("--threads", type=cli.positive_int, default=1,
                     help="torch threads (default 1, as in the README's table)")
    ops.add_argument("--seed", type=cli.seed, default=0)
    ops.add_argument("--json", type=cli.output_file, help="write one record per (compressor, size) to this file")
    ops.set_defaults(func=main)


__all__ = ["OpsRecord", "add_bench_parser", "bench_one", "median_ms", "run"]
