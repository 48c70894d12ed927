"""``--option KEY=VALUE``: the runtime options of ``train`` and ``compare``, parsed (:func:`parse_options`),
typed (:func:`check_options`) and checked against the compressor and the workers (:func:`check_exchange`)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from gradpress.auto import is_auto
from gradpress.testbed import arguments
from gradpress.testbed.results import REFERENCES
from gradpress.testbed.training.config import TrainConfig, simulated_options

#: the runtime options that ``train`` and ``compare`` take as flags of their own, not as ``--option``
DEDICATED = {"seed": "--seed", "timeout": "--timeout"}


def parse_options(items: list[str], dedicated: dict[str, str] | None = None) -> dict[str, Any]:
    """``["min_numel=1024", "exclude=net.0.*", "feedback=none"]`` -> typed runtime options. A key given
    twice, or one of ``dedicated`` (key -> the command's own flag for it; default :data:`DEDICATED`),
    raises ValueError: neither value would be sure to be the one used."""
    dedicated = DEDICATED if dedicated is None else dedicated
    options: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--option {item!r}: expected KEY=VALUE")
        if key in dedicated:
            raise ValueError(f"--option {item}: give {dedicated[key]} instead (the command's own flag)")
        if key in options:
            first = next(i for i in items if i.partition("=")[0] == key)
            raise ValueError(f"--option {key} is given twice ({first!r}, {item!r}); give it once")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def check_options(options: dict[str, Any], auto: bool = True) -> None:
    """Raise ValueError unless every key is a runtime option (a field of :class:`gradpress.exchange.pipeline.Options`),
    or with ``auto`` one of ``auto``'s (:class:`gradpress.auto.AutoOptions`, for the ``auto`` run alone),
    and its value has the option's type; ranges and combinations are :func:`check_exchange`'s."""
    import dataclasses
    import typing

    from gradpress.auto import AutoOptions
    from gradpress.exchange.pipeline import Options

    hints = {**typing.get_type_hints(Options), **typing.get_type_hints(AutoOptions)}
    known = [f.name for f in dataclasses.fields(Options) if f.init] + (list(AutoOptions.names()) if auto else [])
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"unknown option {key!r}; the options are: {', '.join(known)}")
        if not _fits(value, hints[key]):
            raise ValueError(f"option {key}={value!r}: expected {_type_words(hints[key])}")


def _fits(value: Any, annotation: Any) -> bool:
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is typing.Literal:
        return value in args
    if origin in (tuple, list):  # one item, or a JSON list of them (Options turns a str into a tuple)
        return _fits(value, args[0]) or (isinstance(value, list) and all(_fits(v, args[0]) for v in value))
    return True  # a type not described here: Options checks it


def _type_words(annotation: Any) -> str:
    import types
    import typing

    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_words(a) for a in args)
    if origin in (tuple, list):
        return f"{_type_words(args[0])} or a JSON list of them"
    return {type(None): "null", bool: "true or false", int: "an integer", float: "a number",
            str: "a string"}.get(annotation, str(annotation))


def runtime_option(text: str, auto: bool = False) -> str:
    """``KEY=VALUE``: a runtime option (:class:`gradpress.exchange.pipeline.Options`; with ``auto`` also
    one of :class:`gradpress.auto.AutoOptions`) with a value of its type (:func:`parse_options`,
    :func:`check_options`)."""
    if "=" not in text or not text.partition("=")[0].strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        check_options(parse_options([text]), auto)
    except ValueError as error:
        raise argparse.ArgumentTypeError(arguments.one_line(error)) from None
    return text


def option(text: str) -> str:
    """``KEY=VALUE`` of a command that runs ``auto`` too (``train``, ``compare``, ``compile``): a runtime
    option or one of ``auto``'s (:func:`runtime_option`)."""
    return runtime_option(text, auto=True)


def check_exchange(config: TrainConfig) -> None:
    """Raise ValueError unless ``config``'s compressor, options and number of workers fit together: the
    runtime's own checks, run in this process by :class:`gradpress.Simulator` (no worker starts), and
    a sharded run's (:func:`~.sharded.check_sharding`)."""
    import gradpress
    from gradpress.auto import AutoOptions
    from gradpress.exchange.hierarchy import Layout
    from gradpress.exchange.hierarchy import check_options as check_levels
    from gradpress.exchange.pipeline import Options
    from gradpress.testbed.training.sharded import check_sharding, exchange_size

    check_options(config.options)
    given = sorted(set(config.options) & set(AutoOptions.names()))
    if given and not is_auto(config.compressor):
        raise ValueError(f"option {', '.join(given)}: an option of --compressor auto, not of {config.compressor!r}")
    check_sharding(config)
    options = simulated_options(config)
    if config.compressor in REFERENCES:
        Options.of(**options)
    elif is_auto(config.compressor):  # its pipelines are built, and checked, per chosen method
        AutoOptions.pop_from(options)
        check_levels(Options.of(**options), auto=True)
    else:  # a sharded run's exchange is among the replicas (HSDP) or every rank (the reduce-scatter)
        ranks = config.world_size if config.sharding is None else exchange_size(config)
        sim = gradpress.Simulator(config.compressor, ranks, **options)
        if sim.options.hierarchy is not None:  # (the ranks would find a bad layout at their first step)
            problem = Layout(0, config.world_size, options["local_size"]).problem
            if problem is not None:
                raise ValueError(problem)
