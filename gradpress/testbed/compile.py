"""``gradpress compile SPEC [SPEC ...]``: compile the CPU kernels of methods ahead of time
(:func:`gradpress.warm_up`), e.g. when a container image is built, so that training starts without compiling.

    gradpress compile thc topk:ratio=0.01 --dtypes float32,bfloat16
    gradpress compile all --jobs 4

Each spec runs a few steps in a :class:`gradpress.Simulator` of ``--workers`` ranks on small tensors of
each dtype (``auto``: every candidate of its default set). Prints what was compiled, how long it took and
where the kernels are kept (the README's "Compiled kernels"). numba compiles on one core: ``--jobs N``
shares the specs out among N processes (every method: ``all``), which write the same disk cache.
"""
from __future__ import annotations

import argparse
import functools
import logging
import signal
import sys

from gradpress.testbed import arguments
from gradpress.testbed.training.options import option

DTYPES = ("float32", "float16", "bfloat16")


def _dtypes(text: str) -> list[str]:
    names = [piece.strip() for piece in text.split(",") if piece.strip()]
    unknown = [name for name in names if name not in DTYPES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(DTYPES)} (comma-separated), "
                                         f"got {text!r}")
    return names


def _spec(text: str) -> str:
    """A compressor spec, or ``all`` (every registered method at its defaults)."""
    return text if text == "all" else arguments.compressor(text)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("compile", description=__doc__.split("\n\n")[0],
                                   help="compile methods' CPU kernels ahead of time (container builds)")
    parser.add_argument("specs", nargs="+", type=_spec, metavar="SPEC",
                        help="compressor specs (topk:ratio=0.01, thc, auto, ...), or all")
    parser.add_argument("--dtypes", type=_dtypes, default=list(DTYPES),
                        help="gradient dtypes, comma-separated (default: float32,float16,bfloat16)")
    parser.add_argument("--workers", type=arguments.integer(1), default=2,
                        help="ranks of the exchange (integer sums are widened by the rank count; default 2)")
    parser.add_argument("--jobs", type=arguments.integer(1), default=1,
                        help="processes that compile at once, each a share of the specs (default 1)")
    parser.add_argument("--option", type=option, action="append", default=[], metavar="KEY=VALUE",
                        help="a runtime option of the training (mode=ps, master=natural, ...), or auto's "
                             "(candidates=[...], measure_with=...), repeatable")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import torch

    import gradpress
    from gradpress.kernels.dispatch import numba_enabled
    from gradpress.kernels.jit import describe_cache
    from gradpress.log import logger
    from gradpress.testbed.train import parse_options

    if not numba_enabled():
        raise arguments.UsageError("GRADPRESS_NUMBA=0: no kernel runs, nothing to compile")
    specs = list(dict.fromkeys(name for spec in args.specs
                               for name in (arguments.all_methods() if spec == "all" else [spec])))
    if args.jobs > 1 and len(specs) > 1:
        return _in_processes(args, specs)
    level = logger.level
    handler = _log_to_stdout()
    try:
        gradpress.warm_up(*specs, dtypes=[getattr(torch, name) for name in args.dtypes],
                          workers=args.workers, **parse_options(args.option))
    except (ValueError, TypeError) as error:  # (TypeError: an option of auto's without "auto" among the specs)
        raise arguments.UsageError(arguments.one_line(error)) from None
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    print(f"kernels kept in {describe_cache()}")
    return 0


#: methods whose kernels take the longest to compile (measured on a 2-core machine, slowest first), handed
#: out first so that no process is left with one of them at the end
SLOWEST_FIRST = ("thc", "blocktopk", "inceptionn", "eightbit", "sketch", "powersgd", "dither", "natural")
#: methods that run kernels of another one (THC's): handed out last, when they load them from the disk
#: cache instead of compiling them a second time at the same moment in another process
SHARING_LAST = ("thc_uniform",)


def _in_processes(args: argparse.Namespace, specs: list[str]) -> int:
    """Compile ``specs`` in ``args.jobs`` processes that each take the next spec when done with one (the
    slowest to compile first, :data:`SLOWEST_FIRST`, and those that share another's kernels last); each
    logs its own line per spec. Status 1 if any spec failed."""
    import multiprocessing

    def order(spec: str) -> int:
        name = spec.partition(":")[0]
        if name in SHARING_LAST:
            return len(SLOWEST_FIRST) + 2
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST) + 1

    ordered = sorted(specs, key=order)
    compile_one = functools.partial(_compile_one, dtypes=args.dtypes, workers=args.workers,
                                    options=args.option)
    pool = multiprocessing.get_context("spawn").Pool(min(args.jobs, len(specs)), initializer=_child)
    try:
        failed = [f"{spec}: {error}" for spec, error in pool.imap_unordered(compile_one, ordered) if error]
        pool.close()
    finally:
        pool.terminate()  # (at once on an error or Ctrl-C; the children ignore SIGINT)
        pool.join()
    if failed:
        print(f"gradpress: error: compiling {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _child() -> None:
    """A compiling process: its lines on stdout, Ctrl-C left to the parent (which ends it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _log_to_stdout()


def _log_to_stdout() -> logging.Handler:
    """gradpress's INFO lines (a spec's kernels ready) printed on stdout as they are; the handler added."""
    from gradpress.log import logger

    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    return handler


def _compile_one(spec: str, dtypes: list[str], workers: int, options: list[str]) -> tuple[str, str | None]:
    """Warm ``spec`` up in this process: ``(spec, None)``, or ``(spec, the error)`` for one the method
    refuses."""
    import torch

    import gradpress
    from gradpress.testbed.train import parse_options

    try:
        gradpress.warm_up(spec, dtypes=[getattr(torch, name) for name in dtypes], workers=workers,
                          **parse_options(options))
    except ValueError as error:
        return spec, arguments.one_line(error)
    return spec, None
