"""``gradpress bench``: benchmarks. Each module in ``BENCHES`` adds its own ``gradpress bench NAME``
with ``add_bench_parser(bench_subparsers)``. Timings live here, never in test assertions."""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

from gradpress import cli

Main = Callable[[argparse.Namespace], int]

BENCHES = [
    "gradpress.bench.ops",
    "gradpress.bench.ddp_overhead",
    "gradpress.bench.sketch_embedding",
    "gradpress.bench.thc_nmse",
    "gradpress.bench.powersgd",
    "gradpress.bench.faults",
    "gradpress.bench.step",
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (ops, ddp, sketch, ...)")
    benches = bench.add_subparsers(dest="bench", required=True)
    for module in BENCHES:
        importlib.import_module(module).add_bench_parser(benches)


def add_bench(bench_subparsers: argparse._SubParsersAction, name: str, help: str, doc: str | None,
              add_arguments: Callable[[argparse.ArgumentParser], None], main: Main) -> None:
    """``gradpress bench NAME``: a subparser described by the module's ``doc``, its arguments, its ``main``."""
    parser = bench_subparsers.add_parser(name, help=help, description=doc,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=main)


def run_as_script(doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None], main: Main) -> None:
    """``python -m gradpress.bench.MODULE …``: the same arguments as its ``gradpress bench`` subcommand,
    and the same one-line answers to bad ones (:mod:`gradpress.cli`)."""
    parser = cli.Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=main)
    sys.exit(cli.run(parser))
