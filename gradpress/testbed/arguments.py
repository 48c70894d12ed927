"""The arguments of the ``gradpress`` command's subcommands (:mod:`gradpress.cli`), in one module that
imports nothing else of the lab, so that the testbed, the benchmarks and the command each import it.

Each value is checked as it is parsed by the ``type=`` converters below (numbers and their ranges, sizes
such as ``2^22``, link rates, compressor specs, output paths), which raise ``argparse.ArgumentTypeError``:
argparse reports it as ``gradpress: error: argument --NAME: MESSAGE``, exit status 2. The converters of
the testbed's own values (model specs, ``--option KEY=VALUE``) are :mod:`gradpress.testbed.train`'s.
What needs several arguments or the data is checked by the subcommand before it starts anything, raising
:class:`UsageError`; sizes are checked against the memory available (:func:`check_memory`).
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path
from typing import Callable, Collection

PREFIX = "gradpress: error: "
#: the exit status after Ctrl-C (128 + SIGINT, as a shell reports a process that SIGINT ended)
INTERRUPTED = 130


class UsageError(Exception):
    """A mistake in the command line found after parsing: reported as ``gradpress: error: MESSAGE``,
    exit status 2, by :func:`gradpress.cli.main`."""


def package_summary(package: str) -> str:
    """The first paragraph of the docstring of ``package`` (a command's package, imported before the module
    that builds the command's parser): the command's description."""
    return (sys.modules[package].__doc__ or "").split("\n\n")[0]


def one_line(message: object) -> str:
    """``message`` on one line: its non-empty lines joined by ``; ``."""
    return "; ".join(line.strip() for line in str(message).splitlines() if line.strip())


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
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for unit in units:
        count /= 1024
        if count < 1024 or unit == units[-1]:
            break
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
    from gradpress.costmodel import rate_bits_per_second

    try:
        bits = rate_bits_per_second(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not bits > 0:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r}: expected a positive rate, e.g. 100mbit")
    return text


def _check_spec(spec: str, references: Collection[str], name_it: bool = True) -> None:
    import gradpress

    if spec.strip() in references:
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
    _check_spec(text, (), name_it=False)
    return text


def compressor_or_reference(references: Collection[str]) -> Callable[[str], str]:
    """A converter to a compressor spec or one of ``references`` (the testbed's reference rows: ``noop``,
    ``torch-allreduce``, …, :data:`gradpress.testbed.results.REFERENCES`)."""

    def convert(text: str) -> str:
        _check_spec(text, references, name_it=False)
        return text

    convert.__name__ = "compressor_or_reference"
    return convert


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


def compressor_list(references: Collection[str] = (),
                    keywords: dict[str, Callable[[], list[str]]] | None = None,
                    suffix: Callable[[str], tuple[str, str]] | None = None) -> Callable[[str], Specs]:
    """A converter of a comma-separated list of specs, the one rule of every command's lists: spaces
    around the commas do not matter (``"topk, qsgd"`` is ``"topk,qsgd"``), a spec's own parameters
    continue it (:func:`gradpress.core.registry.split_specs`), and a keyword (``demo``, ``all``) stands
    for its specs, alone or beside others (``demo,topk:ratio=0.1``). Each spec is checked (the names in
    ``references`` pass as they are); ``suffix`` splits an item into its spec and an ending kept on it
    (``compare``'s ``topk@node``; ValueError for a wrong one), which a keyword does not take. Returns
    the :class:`Specs`."""
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
            try:
                spec, ending = suffix(piece) if suffix is not None else (piece, "")
            except ValueError as error:
                raise argparse.ArgumentTypeError(str(error)) from None
            if spec in keywords:
                if ending:
                    raise argparse.ArgumentTypeError(f"{piece}: {ending} follows a spec, not a keyword")
                members = keywords[spec]()
                expanded.update(member for member in members if member not in specs)
            else:
                _check_spec(spec, references)
                expanded.discard(spec + ending)
                members = [spec + ending]
            specs += [member for member in members if member not in specs]
        if not specs:
            raise argparse.ArgumentTypeError(f"expected at least one compressor spec, got {text!r}")
        return Specs(specs, expanded)

    convert.__name__ = "specs"
    return convert




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



__all__ = ["INTERRUPTED", "PREFIX", "Specs", "UsageError", "all_methods", "allocation_failure",
           "available_memory", "check_memory", "check_writable", "compressor", "compressor_list",
           "compressor_or_reference", "int_list", "integer", "memory_words", "non_negative_float",
           "non_negative_int", "number", "one_line", "output_dir", "output_file", "package_summary",
           "positive_float", "positive_int", "rate", "seed", "size", "sizes", "writable_parent"]
