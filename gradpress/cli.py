"""The ``gradpress`` command (also ``python -m gradpress``).

Each subcommand lives in its own module that exposes ``add_parser(subparsers)``; the parser it adds sets
``func`` to the function that runs it. Add a module to ``SUBCOMMANDS`` to add a subcommand.
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "gradpress.bench",
    "gradpress.testbed.data",
    "gradpress.testbed.train",
    "gradpress.testbed.compare",
    "gradpress.testbed.sim",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradpress", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the registered compressors and feedback memories").set_defaults(func=_list)
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def _list(args: argparse.Namespace) -> int:
    import gradpress
    from gradpress.compressor import registry

    for name in gradpress.compressor_names():
        cls = registry.get(name)
        summary = (cls.__doc__ or "").strip().splitlines()[0]
        print(f"{name:12s} {summary}")
    print("\nfeedback:", ", ".join(gradpress.feedback_names()))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
