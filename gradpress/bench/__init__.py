"""``gradpress bench``: benchmarks. Each module in ``BENCHES`` adds its own ``gradpress bench NAME``
with ``add_bench_parser(bench_subparsers)``. Timings live here, never in test assertions."""
from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from gradpress import cli
from gradpress.testbed import arguments

Main = Callable[[argparse.Namespace], int]


def keep_freed_memory() -> bool:
    """Ask glibc (this process only) to keep the memory it frees: no trimming of the heap's top, no mmap for
    large blocks. A benchmark's calls allocate and free tensors of the tensor's size, and glibc's dynamic
    thresholds otherwise hand some of them back to the kernel between calls, so that a call pays page
    faults (microseconds per 4 KiB page on a virtual machine) depending on the other calls' pattern of
    allocations (``bench ops`` measured a 16 MB copy at 7 ms in one row, 1.0–1.6 ms in the others).
    False where mallopt is not available (not glibc); ``bench grace`` and ``bench ops`` call it unless
    given ``--glibc-defaults``."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 1 << 30)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def add_glibc_defaults(parser: argparse.ArgumentParser) -> None:
    """The ``--glibc-defaults`` flag of a benchmark that calls :func:`keep_freed_memory` by default."""
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="leave glibc's allocator thresholds as they are (by default freed memory is kept, "
                             "so that no call's time includes page faults that depend on the other calls' "
                             "allocations)")


BENCHES = [
    "gradpress.bench.ops",
    "gradpress.bench.ddp_overhead",
    "gradpress.bench.sketch_embedding",
    "gradpress.bench.thc_nmse",
    "gradpress.bench.powersgd",
    "gradpress.bench.faults",
    "gradpress.bench.step",
    "gradpress.bench.grace",
    "gradpress.bench.importtime",
    "gradpress.bench.firstuse",
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (ops, ddp, sketch, ...)")
    benches = bench.add_subparsers(dest="bench", required=True)
    for module in BENCHES:
        importlib.import_module(module).add_bench_parser(benches)


def add_bench(bench_subparsers: argparse._SubParsersAction, name: str, help: str, doc: str | None,
              add_arguments: Callable[[argparse.ArgumentParser], None], main: Main) -> None:
    """``gradpress bench NAME``: a subparser described by the module's ``doc``, its arguments, its ``main``."""
    parser = bench_subparsers.add_parser(name, help=help, description=doc)
    add_arguments(parser)
    parser.set_defaults(func=main)


def run_as_script(doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None], main: Main) -> None:
    """``python -m gradpress.bench.MODULE …``: the same arguments as its ``gradpress bench`` subcommand,
    and the same one-line answers to bad ones (:mod:`gradpress.cli`)."""
    parser = cli.Parser(description=doc)
    add_arguments(parser)
    parser.set_defaults(func=main)
    sys.exit(cli.run(parser))


# -- benchmarks on several processes --------------------------------------------------------------------
Worker = Callable[[int, int, dict[str, Any]], Any]


def spawn(worker: Worker, workers: int, args: dict[str, Any], timeout: float | None = None,
          may_die: frozenset[int] = frozenset(), threads: int = 1, backend: str = "gloo") -> list[Any]:
    """``worker(rank, workers, args)`` in ``workers`` fresh processes (``spawn``; ``threads`` torch
    threads each) that share one process group (Gloo; ``backend="nccl"``: NCCL, rank r on GPU r),
    joined through a FileStore (no port to race for), with
    ``timeout`` as the group's timeout too. Each rank's return value, by rank: None for a rank of
    ``may_die`` that returned nothing (a benchmark that kills it); processes still running after
    ``timeout`` seconds are killed, and a rank that failed otherwise raises ``RuntimeError``.
    ``worker`` must be a module-level function."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store, out = str(Path(tmp) / "store"), str(Path(tmp) / "result")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(worker, r, workers, store, f"{out}{r}", args, timeout, threads, backend))
                 for r in range(workers)]
        for p in procs:
            p.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for p in procs:
            p.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results = []
        for r, p in enumerate(procs):
            if os.path.exists(f"{out}{r}"):
                import torch

                results.append(torch.load(f"{out}{r}", weights_only=False))
            elif r in may_die:
                results.append(None)
            else:
                raise RuntimeError(f"benchmark worker {r} failed: exit code {p.exitcode}")
        return results


def _entry(worker: Worker, rank: int, workers: int, store: str, out: str, args: dict[str, Any],
           timeout: float | None, threads: int, backend: str = "gloo") -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=workers,
                            timeout=datetime.timedelta(seconds=timeout or 300))
    result = worker(rank, workers, args)
    torch.save(result, out)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a group with a dead member: the result is saved
        pass


def write_json(path: str, value: Any) -> None:
    """``value`` as JSON at ``path`` (its folder made if need be; values JSON lacks written as text)."""

    arguments.writable_parent(path).write_text(json.dumps(value, indent=2, default=str) + "\n")
