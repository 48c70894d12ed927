"""The command line's conventions: one rule for lists, keywords combinable with specs, the closest name
for a mistyped method, parameter, model or dataset, and help text without docstring markup that gives
every option's default."""
from __future__ import annotations

import argparse

import pytest

from gradpress import cli
from gradpress.core.registry import did_you_mean
from gradpress.testbed import arguments
from gradpress.testbed.compare import DEMO_SET
from gradpress.testbed.results import REFERENCES
from test_cli_errors import assert_one_line_error, nothing_runs, run_cli  # noqa: F401 (a fixture)


def test_spaces_around_commas_do_not_matter():
    convert = arguments.compressor_list()
    assert convert("topk, qsgd") == convert("topk,qsgd") == convert(" topk ,qsgd ") == ["topk", "qsgd"]
    assert convert("topk:ratio=0.1, qsgd:levels=16, bucket=512") == ["topk:ratio=0.1", "qsgd:levels=16,bucket=512"]


def test_a_keyword_stands_for_its_specs_beside_others():
    convert = arguments.compressor_list(references=REFERENCES, keywords={"demo": lambda: list(DEMO_SET)})
    specs = convert("demo, topk:ratio=0.1")
    assert specs == [*DEMO_SET, "topk:ratio=0.1"]
    assert specs.expanded == set(DEMO_SET)
    named = convert("topk:ratio=0.01,demo")  # named first: the user's own, kept once
    assert named == ["topk:ratio=0.01", *(s for s in DEMO_SET if s != "topk:ratio=0.01")]
    assert "topk:ratio=0.01" not in named.expanded
    assert convert("demo").expanded == set(DEMO_SET)


def test_a_list_without_commas_says_the_rule():
    with pytest.raises(argparse.ArgumentTypeError, match="lists are comma-separated: 'topk,qsgd'"):
        arguments.compressor_list()("topk qsgd")


@pytest.mark.parametrize("typed, known, expected", [
    ("tpok", ["topk", "randomk", "qsgd"], " (did you mean 'topk'?)"),
    ("ratoi", ["ratio"], " (did you mean 'ratio'?)"),
    ("xyz", ["topk", "qsgd"], ""),
])
def test_did_you_mean(typed, known, expected):
    assert did_you_mean(typed, known) == expected


@pytest.mark.parametrize("argv, expected", [
    ("train --compressor tpok", "unknown compressor 'tpok' (did you mean 'topk'?); known: "),
    ("train --compressor topk:ratoi=0.1", "has no parameter 'ratoi' (did you mean 'ratio'?)"),
    ("train --model mpl", "unknown model 'mpl' (did you mean 'mlp'?); known: "),
    ("train --data fashion", "invalid choice: 'fashion' (did you mean 'fashion-mnist'?) (choose from "),
    ("data fashoin-mnist", "unknown dataset 'fashoin-mnist' (did you mean 'fashion-mnist'?)"),
    ("compare --compressors topk,qsdg", "unknown compressor 'qsdg' (did you mean 'qsgd'?)"),
])
def test_a_mistyped_name_gets_the_closest_one(argv, expected, nothing_runs, capsys):  # noqa: F811
    assert_one_line_error(*run_cli(argv.split(), capsys), expected)


def _parsers(parser: argparse.ArgumentParser, path: str = "gradpress"):
    """(command, parser) of every command and subcommand."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_help_has_no_markup_and_gives_the_defaults():
    commands = dict(_parsers(cli.build_parser()))
    assert len(commands) > 10
    for command, parser in commands.items():
        text = parser.format_help()
        for markup in ("``", ":func:`", ":class:`", ":mod:`", ":meth:`", ":data:`"):
            assert markup not in text, (command, markup)
        for action in parser._actions:
            if cli._shows_default(action) and action.default != "":
                assert "(default:" in " ".join(cli.HelpFormatter(command)._get_help_string(action).split()) or \
                    "default" in (action.help or ""), (command, action.dest)
    train = " ".join(commands["gradpress train"].format_help().split())
    assert "--seed SEED (default: 0)" in train and "--nodes NODES emulated nodes" in train
    assert "--workers WORKERS local worker processes per node: the run has --nodes × --workers ranks (default: 2)" \
        in train
