"""``gradpress compile SPEC [SPEC ...]``: compile the CPU kernels of methods ahead of time
(:func:`gradpress.warm_up`), e.g. when a container image is built, so that training starts without compiling.

    gradpress compile thc topk:ratio=0.01 --dtypes float32,bfloat16

Each spec runs a few steps in a :class:`gradpress.Simulator` of ``--workers`` ranks on small tensors of
each dtype (``auto``: every candidate of its default set). Prints what was compiled, how long it took and
where the kernels are kept (the README's "Compiled kernels").
"""
from __future__ import annotations

import argparse
import logging
import sys

from gradpress import cli

DTYPES = ("float32", "float16", "bfloat16")


def _dtypes(text: str) -> list[str]:
    names = [piece.strip() for piece in text.split(",") if piece.strip()]
    unknown = [name for name in names if name not in DTYPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(DTYPES)} (comma-separated), "
                                         f"got {text!r}")
    return names


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("compile", description=__doc__.split("\n\n")[0],
                                   help="compile methods' CPU kernels ahead of time (container builds)")
    parser.add_argument("specs", nargs="+", type=cli.compressor, metavar="SPEC",
                        help="compressor specs (topk:ratio=0.01, thc, auto, ...)")
    parser.add_argument("--dtypes", type=_dtypes, default=list(DTYPES),
                        help="gradient dtypes, comma-separated (default: float32,float16,bfloat16)")
    parser.add_argument("--workers", type=cli.integer(1), default=2,
                        help="ranks of the exchange (integer sums are widened by the rank count; default 2)")
    parser.add_argument("--option", type=cli.option, action="append", default=[], metavar="KEY=VALUE",
                        help="a runtime option of the training (mode=ps, master=natural, ...), repeatable")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import torch

    import gradpress
    from gradpress.kernels.dispatch import numba_enabled
    from gradpress.kernels.jit import describe_cache
    from gradpress.log import logger
    from gradpress.testbed.train import parse_options

    if not numba_enabled():
        raise cli.UsageError("GRADPRESS_NUMBA=0: no kernel runs, nothing to compile")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        gradpress.warm_up(*args.specs, dtypes=[getattr(torch, name) for name in args.dtypes],
                          workers=args.workers, **parse_options(args.option))
    except ValueError as error:
        raise cli.UsageError(cli.one_line(error)) from None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    print(f"kernels kept in {describe_cache()}")
    return 0
