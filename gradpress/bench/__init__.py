"""``gradpress bench``: benchmarks. Each module in ``BENCHES`` adds its own ``gradpress bench NAME``
with ``add_bench_parser(bench_subparsers)``. Timings live here, never in test assertions."""
from __future__ import annotations

import argparse
import importlib

BENCHES = [
    "gradpress.bench.ops",
    "gradpress.bench.ddp_overhead",
    "gradpress.bench.sketch_embedding",
    "gradpress.bench.thc_nmse",
    "gradpress.bench.powersgd",
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (ops, ddp, sketch, ...)")
    benches = bench.add_subparsers(dest="bench", required=True)
    for module in BENCHES:
        importlib.import_module(module).add_bench_parser(benches)
