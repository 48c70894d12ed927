"""``gradpress data``: fetch and check the testbed's datasets (see :mod:`gradpress.testbed.data`)."""
from __future__ import annotations

import argparse

from gradpress.testbed import arguments
from gradpress.testbed.data.dataset import CACHE_ENV, DataUnavailable, cache_dir
from gradpress.testbed.data.registry import DATASETS, dataset_names, fetch, load


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="fetch and check the testbed's datasets (offline sources)",
                                   description=arguments.package_summary(__package__))
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"datasets (default: all of {', '.join(DATASETS)})")
    parser.add_argument("--no-install", action="store_true", help="only check: never run apt-get or pip")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    names = args.names or dataset_names()
    unknown = [name for name in names if name not in DATASETS]
    if unknown:
        from gradpress.core.registry import did_you_mean

        raise arguments.UsageError(f"unknown dataset {unknown[0]!r}{did_you_mean(unknown[0], DATASETS)}; "
                         f"known: {', '.join(DATASETS)}")
    print(f"cache: {cache_dir()}  (${CACHE_ENV})")
    failed = 0
    for name in names:
        try:
            where = fetch(name, install=not args.no_install, say=lambda text: print(f"  {text}"))
            data = load(name)
        except (DataUnavailable, ValueError) as error:
            failed += 1
            print(f"{name}: NOT AVAILABLE: {error}")
            continue
        print(f"{name}: {where}\n  {data.summary()}")
    return 1 if failed else 0
