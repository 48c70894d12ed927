"""The ``gradpress`` command (also ``python -m gradpress``).

Each subcommand lives in its own module that exposes ``add_parser(subparsers)``; the parser it adds sets
``func`` to the function that runs it. Add a module to ``SUBCOMMANDS`` to add a subcommand.

Bad arguments are answered in one line on stderr, ``gradpress: error: MESSAGE``, with exit status 2
(argparse's status for usage errors), before any worker, simulation or benchmark starts: each value is
checked as it is parsed by its ``type=`` converter (:mod:`gradpress.testbed.arguments`; model specs and
``--option KEY=VALUE``: :mod:`gradpress.testbed.train`), and what needs several arguments or the data (a
model for another task than the dataset's, a batch larger than a worker's shard, options that do not fit
the compressor) is checked by the subcommand before it starts anything, raising
:class:`~gradpress.testbed.arguments.UsageError`. argparse's own errors (unknown arguments, a missing
subcommand) take the same one-line form, without the usage text. Sizes are checked against the memory
available (:func:`~gradpress.testbed.arguments.check_memory`), and an allocation that fails all the same
is answered in one line too (exit status 2). Ctrl-C prints ``interrupted`` and exits with 130 (128 +
SIGINT), after the command's own cleanup (workers stopped, temporary files removed). Errors of the
program itself still end in a traceback.
"""
from __future__ import annotations

import _thread
import argparse
import contextlib
import copy
import importlib
import importlib.util
import os
import re
import signal
import sys
import textwrap
import threading
import types
from typing import Iterator, NoReturn

from gradpress.testbed.arguments import INTERRUPTED, PREFIX, UsageError, allocation_failure, one_line

SUBCOMMANDS = [
    "gradpress.bench",
    "gradpress.testbed.data",
    "gradpress.testbed.train",
    "gradpress.testbed.compare",
    "gradpress.testbed.sim",
    "gradpress.testbed.advise",
    "gradpress.testbed.compile",
]

#: what the testbed's commands need beyond the library: the ``[testbed]`` extra
TESTBED_LIBRARIES = ("matplotlib", "rich", "tqdm")
#: the commands that need the library alone
LIBRARY_COMMANDS = ("list", "compile")


_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]*\.)?([^`<]+?)(?: <[^>]+>)?`")  # :func:`gradpress.simulate`


def plain(text: str) -> str:
    """Docstring markup as a terminal shows it: ``x`` and :func:`a.b.x` (``~`` included) become x."""
    return _ROLE.sub(r"\1", text).replace("``", "")


_DEFAULT_ONLY = "\0"  # the help of an option that has none but a default to show


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help without reStructuredText markup, descriptions kept in their paragraphs (each filled
    to the terminal's width), and each option's default where it has one that its help does not already
    give (``(default: 2)``)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = (" ".join(paragraph.split()) for paragraph in plain(text).split("\n\n"))
        return "\n\n".join(textwrap.fill(paragraph, width, initial_indent=indent, subsequent_indent=indent)
                           for paragraph in paragraphs if paragraph)

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and _shows_default(action):  # (argparse prints no help line without help)
            action = copy.copy(action)
            action.help = _DEFAULT_ONLY
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = "" if action.help == _DEFAULT_ONLY else plain(action.help or "").strip()
        if _shows_default(action) and "default" not in text:
            default = action.default
            shown = ",".join(map(str, default)) if isinstance(default, list) else default
            text = f"{text} (default: {str(shown).replace('%', '%%')})".strip()
        return text


def _shows_default(action: argparse.Action) -> bool:
    """Whether the help gives ``action``'s default: an option that takes a value and has one."""
    default = action.default
    unset = default is None or default is False or default is argparse.SUPPRESS or default == []
    return not unset and bool(action.option_strings) and action.nargs != 0


class Parser(argparse.ArgumentParser):
    """argparse's parser answering usage errors in one line, ``gradpress: error: MESSAGE``, exit status 2,
    a mistyped choice with the closest one (subparsers are made of the same class), help through
    :class:`HelpFormatter`."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, PREFIX + one_line(message) + "\n")

    def _check_value(self, action: argparse.Action, value: object) -> None:
        if action.choices is not None and value not in action.choices:
            from gradpress.core.registry import did_you_mean

            choices = [str(choice) for choice in action.choices]
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{did_you_mean(str(value), choices)}"
                                                 f" (choose from {', '.join(map(repr, choices))})")


def build_parser() -> argparse.ArgumentParser:
    from gradpress._version import __version__

    parser = Parser(prog="gradpress", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"gradpress {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="list the registered compressors and feedback memories")
    listing.add_argument("--markdown", action="store_true",
                         help="the README's compressor table (bits per value measured on 2^20 N(0,1) fp32 values)")
    listing.set_defaults(func=_list)
    missing = _missing_testbed_library()  # (the testbed's modules import their libraries when they run)
    for module in SUBCOMMANDS:
        command = module.rsplit(".", 1)[-1]
        if missing is not None and command not in LIBRARY_COMMANDS:
            _unavailable(sub, command, missing)
            continue
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as error:
            library = (error.name or "").split(".")[0]
            if library not in TESTBED_LIBRARIES:
                raise
            _unavailable(sub, command, library)
    return parser


def _unavailable(subparsers: argparse._SubParsersAction, command: str, library: str) -> None:
    """``command`` as a stand-in that says which extra to install (its module needs ``library``)."""
    stand_in = subparsers.add_parser(command, help="(needs pip install 'gradpress[testbed]')", add_help=False)
    stand_in.set_defaults(unavailable=_needs_testbed(command, library))


def _needs_testbed(command: str | None, library: str) -> str:
    return (f"'gradpress {command}' needs the testbed's libraries ({library} is not installed): "
            f"pip install 'gradpress[testbed]'")


def _missing_testbed_library() -> str | None:
    """The first of :data:`TESTBED_LIBRARIES` that cannot be imported, or None."""
    return next((name for name in TESTBED_LIBRARIES if importlib.util.find_spec(name) is None), None)


def _list(args: argparse.Namespace) -> int:
    import gradpress
    from gradpress.core.compressor import registry
    from gradpress.core.table import summary

    if args.markdown:
        from gradpress.core.table import markdown_table

        print(markdown_table())
        return 0
    for name in gradpress.compressor_names():
        print(f"{name:12s} {summary(registry.get(name))}")
    print("\nfeedback:", ", ".join(gradpress.feedback_names()))
    return 0


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen ``func``; a :class:`~gradpress.testbed.arguments.UsageError`
    becomes ``gradpress: error: …`` and exit status 2 (argparse's own errors exit with 2 as they are
    found), and so does an allocation that failed (:func:`~gradpress.testbed.arguments.allocation_failure`);
    Ctrl-C becomes ``interrupted`` and status 130."""
    try:
        args, unknown = parser.parse_known_args(argv)
        command = getattr(args, "command", None)  # (None: a parser without subcommands)
        missing = None if command in LIBRARY_COMMANDS else _missing_testbed_library()
        unavailable = getattr(args, "unavailable", None)
        if not unavailable and missing is not None:
            unavailable = _needs_testbed(command, missing)
        if unavailable:
            print(PREFIX + unavailable, file=sys.stderr)
            return 2
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        try:
            return int(args.func(args) or 0)
        except UsageError as error:
            print(PREFIX + one_line(error), file=sys.stderr)
            return 2
        except (MemoryError, RuntimeError) as error:
            failure = allocation_failure(error)
            if failure is None:
                raise
            print(PREFIX + failure, file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        return interrupted()


def interrupted() -> int:
    """Report Ctrl-C in one line and return :data:`~gradpress.testbed.arguments.INTERRUPTED`. The interrupt
    may have landed inside a constructor (numba compiles kernels at set-up, through llvmlite objects): such
    a half-built object's finalizer fails when the interpreter collects it on the way out, and Python would
    print that "Exception ignored" traceback after the line; the process is ending, so those reports are
    dropped."""
    print("interrupted", file=sys.stderr)
    sys.unraisablehook = lambda unraisable: None
    return INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    with _ctrl_c_outside_finalizers():
        try:
            parser = build_parser()  # (imports every subcommand: seconds)
        except KeyboardInterrupt:
            return interrupted()
        return run(parser, argv)


@contextlib.contextmanager
def _ctrl_c_outside_finalizers() -> Iterator[None]:
    """Python raises Ctrl-C's KeyboardInterrupt in whatever code the main thread runs when the signal
    arrives. Where that is an object's finalizer (``__del__``, run by the garbage collector at any
    allocation) or a ctypes callback (llvmlite's, while numba compiles a kernel at set-up), the
    interpreter reports the exception as "ignored" and drops it, and the command would go on as if Ctrl-C
    had not been pressed. While the command runs, an interrupt that finds itself there is delivered again
    a moment later, outside it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def on_ctrl_c(signum: int, frame: types.FrameType | None) -> None:
        if _dropped_there(frame):
            threading.Timer(0.05, _thread.interrupt_main).start()
            return
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _dropped_there(frame: types.FrameType | None) -> bool:
    """Whether an exception raised in ``frame`` is dropped: a finalizer is on the stack, or ``frame`` is
    llvmlite's (whose functions in Python are called back by LLVM through ctypes)."""
    if frame is not None and f"{os.sep}llvmlite{os.sep}" in frame.f_code.co_filename:
        return True
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


__all__ = ["HelpFormatter", "Parser", "build_parser", "interrupted", "main", "plain", "run"]


if __name__ == "__main__":
    sys.exit(main())
