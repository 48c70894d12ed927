"""The ``gradpress`` command (also ``python -m gradpress``).

Each subcommand lives in its own module that exposes ``add_parser(subparsers)``; the parser it adds sets
``func`` to the function that runs it. Add a module to ``SUBCOMMANDS`` to add a subcommand.

Bad arguments are answered in one line on stderr, ``gradpress: error: MESSAGE``, with exit status 2
(argparse's status for usage errors), before any worker, simulation or benchmark starts. Each value is
checked as it is parsed by the ``type=`` converters below (numbers and their ranges, sizes such as
``2^22``, link rates, compressor and model specs, ``--option KEY=VALUE``, output paths), which raise
``argparse.ArgumentTypeError``; what needs several arguments or the data (a model for another task than
the dataset's, a batch larger than a worker's shard, options that do not fit the compressor) is checked
by the subcommand before it starts anything, raising :class:`UsageError`. argparse's own errors
(unknown arguments, a missing subcommand) take the same one-line form, without the usage text. Sizes are
checked against the memory available (:func:`check_memory`), and an allocation that fails all the same
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
import math
import re
import signal
import sys
import tempfile
import textwrap
import threading
import types
from pathlib import Path
from typing import Callable, Iterator, NoReturn

SUBCOMMANDS = [
    "gradpress.bench",
    "gradpress.testbed.data",
    "gradpress.testbed.train",
    "gradpress.testbed.compare",
    "gradpress.testbed.sim",
    "gradpress.testbed.advise",
    "gradpress.testbed.compile",
]

PREFIX = "gradpress: error: "
#: what the testbed's commands need beyond the library: the ``[testbed]`` extra
TESTBED_LIBRARIES = ("matplotlib", "rich", "tqdm")
#: the commands that need the library alone
LIBRARY_COMMANDS = ("list", "compile")


class UsageError(Exception):
    """A mistake in the command line found after parsing: reported as ``gradpress: error: MESSAGE``,
    exit status 2, by :func:`main`."""


def package_summary(package: str) -> str:
    """The first paragraph of the docstring of ``package`` (a command's package, imported before the module
    that builds the command's parser): the command's description."""
    return (sys.modules[package].__doc__ or "").split("\n\n")[0]


def one_line(message: object) -> str:
    """``message`` on one line: its non-empty lines joined by ``; ``."""
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


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


def _needs_testbed(command: str, library: str) -> str:
    return (f"'gradpress {command}' needs the testbed's libraries ({library} is not installed): "
            f"pip install 'gradpress[testbed]'")


def _missing_testbed_library() -> str | None:
    """The first of :data:`TESTBED_LIBRARIES` that cannot be imported, or None."""
    return next((name for name in TESTBED_LIBRARIES if importlib.util.find_spec(name) is None), None)


def _list(args: argparse.Namespace) -> int:
    import gradpress
    from gradpress.core.compressor import registry, summary

    if args.markdown:
        from gradpress.core.compressor import markdown_table

        print(markdown_table())
        return 0
    for name in gradpress.compressor_names():
        print(f"{name:12s} {summary(registry.get(name))}")
    print("\nfeedback:", ", ".join(gradpress.feedback_names()))
    return 0


#: the exit status after Ctrl-C (128 + SIGINT, as a shell reports a process that SIGINT ended)
INTERRUPTED = 130


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen ``func``; a :class:`UsageError` becomes ``gradpress: error: …``
    and exit status 2 (argparse's own errors exit with 2 as they are found), and so does an allocation
    that failed (:func:`allocation_failure`); Ctrl-C becomes ``interrupted`` and status 130."""
    try:
        args, unknown = parser.parse_known_args(argv)
        command = getattr(args, "command", None)  # (None: a parser without subcommands)
        missing = None if command in LIBRARY_COMMANDS else _missing_testbed_library()
        if getattr(args, "unavailable", None) or missing is not None:
            print(PREFIX + (getattr(args, "unavailable", None) or _needs_testbed(command, missing)),
                  file=sys.stderr)
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
    """Report Ctrl-C in one line and return :data:`INTERRUPTED`. The interrupt may have landed inside a
    constructor (numba compiles kernels at set-up, through llvmlite objects): such a half-built object's
    finalizer fails when the interpreter collects it on the way out, and Python would print that
    "Exception ignored" traceback after the line; the process is ending, so those reports are dropped."""
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
    arrives; if that is an object's finalizer (``__del__``, run by the garbage collector at any
    allocation), the interpreter reports the exception as "ignored" and drops it, and the command goes on
    as if Ctrl-C had not been pressed. While the command runs, an interrupt that finds a finalizer on the
    stack is delivered again a moment later, outside it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)

    def on_ctrl_c(signum: int, frame: types.FrameType | None) -> None:
        while frame is not None:
            if frame.f_code.co_name == "__del__":
                threading.Timer(0.05, _thread.interrupt_main).start()
                return
            frame = frame.f_back
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# -- memory ---------------------------------------------------------------------------------------------
_ALLOCATION = re.compile(r"can't allocate memory|not enough memory|out of memory|"
                         r"cannot allocate memory|std::bad_alloc", re.IGNORECASE)


def allocation_failure(error: BaseException) -> str | None:
    """The one line that reports ``error`` if it is an allocation that failed (``MemoryError``, or torch's
    ``RuntimeError`` from its allocator: "DefaultCPUAllocator: can't allocate memory", CUDA's out of
    memory); None for any other error."""
    if isinstance(error, MemoryError):
        return "out of memory" + (f": {one_line(error)}" if str(error) else "") + f" ({memory_words()})"
    text = str(error)
    if type(error).__name__ == "OutOfMemoryError" or _ALLOCATION.search(text):
        found = re.search(r"you tried to allocate (\d+) bytes", text)
        what = f"an allocation of {_bytes(int(found[1]))} failed" if found else one_line(text)[:300]
        return f"out of memory: {what} ({memory_words()}); try smaller sizes"
    return None


def available_memory() -> tuple[int, int] | None:
    """(bytes available now, bytes of physical memory) from ``/proc/meminfo`` (Linux), or None."""
    try:
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def memory_words() -> str:
    memory = available_memory()
    if memory is None:
        return "memory available unknown"
    return f"{_bytes(memory[0])} of this machine's {_bytes(memory[1])} are available"


def _bytes(count: float) -> str:
    """``count`` bytes in words: ``512 bytes``, ``3.5 GiB``."""
    if count < 1024:
        return f"{count:.0f} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        count /= 1024
        if count < 1024:
            break
    else:
        count /= 1024
        unit = "EiB"
    return f"{count:.1f} {unit}"


def check_memory(what: str, nbytes: int) -> None:
    """Raise :class:`UsageError` when ``nbytes`` (what a command will hold at once, at least: its
    largest tensors) exceeds the memory available now: ``what`` names the arguments that ask for it."""
    memory = available_memory()
    if memory is not None and nbytes > memory[0]:
        raise UsageError(f"{what}: needs at least {_bytes(nbytes)} of memory; {memory_words()}")


# -- argument types: each raises argparse.ArgumentTypeError, which argparse reports as
# -- "gradpress: error: argument --NAME: MESSAGE" -------------------------------------------------------
_POWER = re.compile(r"^\s*(\d+)\s*(?:\^|\*\*)\s*(\d+)\s*$")


def _words(low: float | None, high: float | None, noun: str, strict: bool = False) -> str:
    """``a positive integer``, ``a non-negative number``, ``an integer in 0..9``, ``an integer >= 2``."""
    article = "an" if noun[0] in "aeiou" else "a"
    if low == 0 and high is None:
        return f"a positive {noun}" if strict else f"a non-negative {noun}"
    if low == 1 and high is None and noun == "integer":
        return "a positive integer"
    if low is None and high is None:
        return f"{article} {noun}"
    if high is None:
        return f"{article} {noun} {'>' if strict else '>='} {low}"
    return f"{article} {noun} in {low}..{high}"


def integer(low: int | None = None, high: int | None = None, powers: bool = False) -> Callable[[str], int]:
    """A converter to an integer in ``low..high`` (``powers``: ``2^22`` and ``2**22`` allowed too)."""
    what = _words(low, high, "integer") + (" (2^k allowed)" if powers else "")

    def convert(text: str) -> int:
        power = _POWER.match(text) if powers else None
        try:
            if power and int(power[2]) > 64:  # not a size: refuse before computing it
                raise ValueError(text)
            value = int(power[1]) ** int(power[2]) if power else int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if (low is not None and value < low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    convert.__name__ = "integer"
    return convert


def number(low: float | None = None, strict: bool = False) -> Callable[[str], float]:
    """A converter to a finite float ``>= low`` (``strict``: ``> low``); fractions such as ``1/32`` allowed."""
    what = _words(low, None, "finite number", strict)

    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            from fractions import Fraction

            try:
                value = float(Fraction(text.strip()))
            except (ValueError, ZeroDivisionError):
                raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or (low is not None and (value <= low if strict else value < low)):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    convert.__name__ = "number"
    return convert


positive_int = integer(1)
non_negative_int = integer(0)
seed = integer(0, 2**32 - 1)
size = integer(1, powers=True)
positive_float = number(0, strict=True)
non_negative_float = number(0)


def int_list(low: int = 1, powers: bool = False) -> Callable[[str], list[int]]:
    """A converter of comma-separated integers ``>= low`` (e.g. ``4,16,64``; ``powers``: ``2^20`` too)."""
    one = integer(low, powers=powers)

    def convert(text: str) -> list[int]:
        pieces = [piece for piece in text.split(",") if piece.strip()]
        if not pieces:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        values = []
        for piece in pieces:
            try:
                values.append(one(piece))
            except argparse.ArgumentTypeError as error:
                raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
        return values

    convert.__name__ = "integers"
    return convert


sizes = int_list(1, powers=True)


def rate(text: str) -> str:
    """A link rate in tc's units (``100mbit``, ``1gbit``), kept as written."""
    from gradpress.testbed.netem import rate_bits_per_second

    try:
        bits = rate_bits_per_second(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not bits > 0:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r}: expected a positive rate, e.g. 100mbit")
    return text


def _check_spec(spec: str, references: bool, name_it: bool = True) -> None:
    import gradpress

    if references:
        from gradpress.testbed.results import REFERENCES

        if spec.strip() in REFERENCES:
            return
    from gradpress.auto import is_auto

    if is_auto(spec):  # "auto": chooses among methods as it trains (gradpress.auto)
        return
    try:
        gradpress.make(spec)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{spec}: {one_line(error)}" if name_it else one_line(error)) from None


def compressor(text: str) -> str:
    """A gradpress compressor spec (``topk:ratio=0.01``), checked by :func:`gradpress.make`."""
    _check_spec(text, references=False, name_it=False)
    return text


def compressor_or_reference(text: str) -> str:
    """A compressor spec or one of the testbed's reference rows (``noop``, ``torch-allreduce``, …)."""
    _check_spec(text, references=True, name_it=False)
    return text


def all_methods() -> list[str]:
    """Every registered method at its defaults (the ``all`` of a ``--compressors`` list)."""
    import gradpress

    return gradpress.compressor_names()


class Specs(list):
    """The specs of a ``--compressors`` list, expanded and in order, each once; ``expanded``: those that
    came from a keyword (``demo``, ``all``) rather than being named."""

    def __init__(self, specs: list[str], expanded: set[str]) -> None:
        super().__init__(specs)
        self.expanded = expanded


def compressor_list(references: bool = False,
                    keywords: dict[str, Callable[[], list[str]]] | None = None) -> Callable[[str], Specs]:
    """A converter of a comma-separated list of specs, the one rule of every command's lists: spaces
    around the commas do not matter (``"topk, qsgd"`` is ``"topk,qsgd"``), a spec's own parameters
    continue it (:func:`gradpress.core.registry.split_specs`), and a keyword (``demo``, ``all``) stands
    for its specs, alone or beside others (``demo,topk:ratio=0.1``). Each spec is checked; returns the
    :class:`Specs`."""
    keywords = keywords or {}

    def convert(text: str) -> Specs:
        from gradpress.core.registry import split_specs

        try:
            pieces = split_specs(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        specs: list[str] = []
        expanded: set[str] = set()
        for piece in pieces:
            if piece in keywords:
                members = keywords[piece]()
                expanded.update(spec for spec in members if spec not in specs)
            else:
                _check_spec(piece, references)
                expanded.discard(piece)
                members = [piece]
            specs += [spec for spec in members if spec not in specs]
        if not specs:
            raise argparse.ArgumentTypeError(f"expected at least one compressor spec, got {text!r}")
        return Specs(specs, expanded)

    convert.__name__ = "specs"
    return convert


def model(text: str) -> str:
    """A testbed model spec (``mlp-wide:width=8192``): known name and keys, values the model accepts."""
    from gradpress.testbed.train import check_model

    try:
        check_model(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(one_line(error)) from None
    return text


def option(text: str) -> str:
    """``KEY=VALUE``: a runtime option (:class:`gradpress.exchange.pipeline.Options`) with a value of its type."""
    from gradpress.testbed.train import check_options, parse_options

    if "=" not in text or not text.partition("=")[0].strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        check_options(parse_options([text]))
    except ValueError as error:
        raise argparse.ArgumentTypeError(one_line(error)) from None
    return text


def _probe(directory: Path) -> None:
    """Raise OSError unless a file can be created in ``directory`` (nothing is left behind)."""
    with tempfile.TemporaryFile(dir=directory):
        pass


def check_writable(path: str | Path, directory: bool = False) -> None:
    """Raise ValueError unless ``path`` can be written: a file (``directory``: a directory, created with
    its parents) that exists and is writable, or whose nearest existing ancestor is a directory in which
    files can be created. Nothing is created."""
    path = Path(path).expanduser().absolute()
    try:
        if path.exists():
            if directory and not path.is_dir():
                raise ValueError(f"{path} is not a directory")
            if not directory and path.is_dir():
                raise ValueError(f"{path} is a directory")
            if directory:
                _probe(path)
            else:
                with open(path, "a"):
                    pass
            return
        ancestor = path.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise ValueError(f"cannot create {path}: {ancestor} is not a directory")
        try:
            _probe(ancestor)
        except OSError as error:
            raise ValueError(f"cannot create {path}: no file can be created in {ancestor} "
                             f"({error.strerror or error})") from None
    except OSError as error:
        raise ValueError(f"cannot write {path}: {error.strerror or error}") from None


def output_file(text: str) -> str:
    """A file to write at the end: checked now, so that a long run does not fail at its end."""
    try:
        check_writable(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def output_dir(text: str) -> str:
    """A directory to write into (created if missing), checked now."""
    try:
        check_writable(text, directory=True)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def writable_parent(path: str | Path) -> Path:
    """``path`` with its parent directory created (for writers of ``--json`` and ``--plot``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


__all__ = ["Parser", "UsageError", "build_parser", "check_writable", "compressor", "compressor_list",
           "compressor_or_reference", "int_list", "integer", "main", "model", "non_negative_float",
           "non_negative_int", "number", "one_line", "option", "output_dir", "output_file", "positive_float",
           "positive_int", "rate", "run", "seed", "size", "sizes", "writable_parent"]


if __name__ == "__main__":
    sys.exit(main())
