"""``gradpress bench ops``: micro-benchmarks of each compressor (GRACE Section 5's compression overhead
and data volume, per method and tensor size).

For every (compressor, size) it reports bits per element (from ``Packet.nbytes``), the NMSE
‖x̂ − x‖²/‖x‖² of one worker, the NMSE of the aggregate of n workers that compress the same vector with
independent private randomness (``compressor.aggregate``, so unbiased methods average their errors out
and biased ones don't), and the median compress and decompress times beside the median time of a plain
copy of the same tensor (``x.clone()``, which allocates its output as every compressor does), the three
timed round by round (:func:`interleaved_ms`) with glibc keeping the memory it frees
(:func:`~gradpress.bench.keep_freed_memory`; ``--glibc-defaults`` leaves it), so that ratios stay
meaningful on a noisy machine.

``--device cuda`` runs the same on a GPU (the torch implementations every method has beside its numba
CPU kernels): each timed call is bracketed by ``torch.cuda.synchronize()``, so a time is the call's
kernels run to completion, and two columns audit one call of each: its synchronizations with the host
(Python reading a device value, e.g. ``.item()``, ``nonzero()``; caught with
``torch.cuda.set_sync_debug_mode``) and the tensors its operators made on the CPU (caught with a
``TorchDispatchMode``; the operators are named in ``--json``).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

import gradpress
from gradpress.bench import add_glibc_defaults, keep_freed_memory
from gradpress.core.rng import Context
from gradpress.testbed import arguments

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
    device: str = "cpu"
    compress_syncs: int | None = None  # host synchronizations per call (CUDA only)
    decompress_syncs: int | None = None
    compress_host_ops: list[str] | None = None  # operators that made a CPU tensor (CUDA only)
    decompress_host_ops: list[str] | None = None


def median_ms(fn: Callable[[], object], repeats: int, sync: Callable[[], None] = lambda: None) -> float:
    """The median wall time of ``fn()`` over ``repeats`` calls after one warm-up (numba compile,
    allocator); ``sync`` (``torch.cuda.synchronize`` on a GPU) runs before and inside each timing, so
    a call's queued kernels count towards it."""
    return interleaved_ms({"fn": fn}, repeats, sync)["fn"]


def interleaved_ms(calls: dict[str, Callable[[], object]], repeats: int,
                   sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """:func:`median_ms` of each of ``calls``, timed round by round (one call of each per round, after
    one warm-up of each), so that the machine's drift (the copy of 16 MB took 0.7–2.2 ms within one run)
    reaches all of them alike and their ratios hold."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def host_traffic(fn: Callable[[], object]) -> tuple[int, list[str]]:
    """What one call of ``fn()`` on GPU tensors does on the host: how many times it waits for the GPU
    (one warning each under CUDA's sync debug mode) and the operators that made a CPU tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    host_ops: list[str] = []

    class Audit(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tree_leaves(out)):
                host_ops.append(str(func.overloadpacket.__name__))
            return out

    with warnings.catch_warnings(record=True) as caught, Audit():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught), host_ops


def nmse(estimate: torch.Tensor, x: torch.Tensor) -> float:
    x64 = x.double()
    return float((estimate.double() - x64).square().sum() / x64.square().sum())


def bench_one(spec: str, numel: int, workers: int, repeats: int, seed: int,
              device: torch.device | str = "cpu") -> OpsRecord:
    device = torch.device(device)
    compressor = gradpress.make(spec)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(device)
    ctx = Context(seed=seed, step=0, key="bench")
    packet = compressor.compress(x, ctx)
    packets = [compressor.compress(x, Context(seed=seed, step=0, key="bench", rank=r)) for r in range(workers)]
    on_gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    compress_audit = host_traffic(lambda: compressor.compress(x, ctx)) if on_gpu else (None, None)
    decompress_audit = host_traffic(lambda: compressor.decompress(packet)) if on_gpu else (None, None)
    ms = interleaved_ms({"compress": lambda: compressor.compress(x, ctx),
                         "decompress": lambda: compressor.decompress(packet), "copy": x.clone}, repeats, sync)
    return OpsRecord(
        name=compressor.name or spec,
        spec=compressor.spec,
        numel=numel,
        bits_per_element=packet.nbytes * 8 / numel,
        nmse=nmse(compressor.decompress(packet), x),
        nmse_avg_n=nmse(compressor.aggregate(packets), x),
        workers=workers,
        compress_ms=ms["compress"],
        decompress_ms=ms["decompress"],
        copy_ms=ms["copy"],
        device=str(device),
        compress_syncs=compress_audit[0], compress_host_ops=compress_audit[1],
        decompress_syncs=decompress_audit[0], decompress_host_ops=decompress_audit[1],
    )


def run(specs: list[str], sizes: list[int], workers: int, repeats: int, seed: int,
        progress: Callable[[str], None] = lambda _: None, device: torch.device | str = "cpu") -> list[OpsRecord]:
    records = []
    for spec in specs:
        for numel in sizes:
            progress(f"{spec} @ {numel}")
            records.append(bench_one(spec, numel, workers, repeats, seed, device))
    return records


def render(records: list[OpsRecord]) -> None:
    from rich.console import Console
    from rich.table import Table

    on_gpu = any(r.compress_syncs is not None for r in records)
    device = records[0].device if records else "cpu"
    table = Table(title=f"gradpress bench ops on {device} (times: median ms; ratio = (compress + decompress) / copy"
                        + ("; syncs, CPU tensors: per compress / decompress)" if on_gpu else ")"))
    columns = ["spec", "numel", "bits/elem", "NMSE", "NMSE avg n", "compress", "decompress", "copy", "ratio"]
    for column in columns + (["syncs", "CPU tensors"] if on_gpu else []):
        table.add_column(column, justify="left" if column == "spec" else "right")
    for r in records:
        row = [r.spec, f"{r.numel:,}", f"{r.bits_per_element:.3f}", f"{r.nmse:.3g}",
               f"{r.nmse_avg_n:.3g} (n={r.workers})", f"{r.compress_ms:.3f}", f"{r.decompress_ms:.3f}",
               f"{r.copy_ms:.3f}", f"{(r.compress_ms + r.decompress_ms) / r.copy_ms:.1f}×"]
        audit = [f"{r.compress_syncs} / {r.decompress_syncs}",
                 f"{len(r.compress_host_ops or [])} / {len(r.decompress_host_ops or [])}"] if on_gpu else []
        table.add_row(*row, *audit)
    Console(width=shutil.get_terminal_size((150, 40)).columns).print(table)


def parse_size(text: str) -> int:
    from gradpress.core.registry import convert

    return convert(text, int, "size")


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise arguments.UsageError("--device cuda: CUDA is not available on this machine")
    specs = list(args.compressors)
    sizes = args.sizes  # a list: checked as it was parsed (arguments.sizes)
    # the tensor, its copy, its decompression
    arguments.check_memory(f"--sizes {max(sizes)}", 3 * 4 * max(sizes))
    from rich.console import Console

    console = Console(stderr=True)
    if not args.glibc_defaults and not keep_freed_memory():
        console.print("gradpress bench ops: glibc's mallopt is not available: allocator defaults kept")
    with console.status("benchmarking") as status:
        records = run(specs, sizes, args.workers, args.repeats, args.seed,
                      progress=lambda what: status.update(f"benchmarking {what}"), device=args.device)
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
                           description=__doc__)
    ops.add_argument("--compressors", type=arguments.compressor_list(keywords={"all": arguments.all_methods}), default="all",
                     help="'all' or a comma-separated list of specs (e.g. topk:ratio=0.01,qsgd:levels=16,bucket=512)")
    ops.add_argument("--sizes", type=arguments.sizes, default=",".join(map(str, DEFAULT_SIZES)),
                     help="comma-separated sizes, 2^22 allowed")
    ops.add_argument("--workers", type=arguments.positive_int, default=4,
                     help="workers whose packets are aggregated for 'NMSE avg n'")
    ops.add_argument("--repeats", type=arguments.positive_int, default=7,
                     help="timed repetitions (the median is reported)")
    ops.add_argument("--threads", type=arguments.positive_int, default=1,
                     help="torch threads (default 1, as in the README's table)")
    ops.add_argument("--seed", type=arguments.seed, default=0)
    ops.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                     help="where the tensor lives (cuda: the torch path on a GPU, timed to completion)")
    ops.add_argument("--json", type=arguments.output_file, help="write one record per (compressor, size) to this file")
    add_glibc_defaults(ops)
    ops.set_defaults(func=main)


__all__ = ["OpsRecord", "add_bench_parser", "bench_one", "interleaved_ms", "median_ms", "run"]
