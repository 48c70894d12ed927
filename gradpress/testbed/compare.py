"""``gradpress compare``: train the same model with several compressors and write a report.

GRACE's Section 5 question on one machine: for this model on this network, which compressor pays off?
Each compressor (or reference row) is trained with the same settings by :func:`gradpress.testbed.train.train`;
the runs go to ``DIR/results.json`` and :func:`gradpress.testbed.report.write_report` writes
``DIR/report.md`` with the table and plots (quality against wall-clock and against data volume,
throughput with the ``noop`` upper bound).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from gradpress import cli
from gradpress.core.registry import split_specs
from gradpress.testbed.report import write_report
from gradpress.testbed.results import REFERENCES, Run
from gradpress.testbed.train import (
    TrainConfig, TrainFailed, add_arguments, check_exchange, checked_config, train,
)

#: the README's demo set; methods not registered in this version are reported, not run
DEMO_SET = ("none", "fp16", "topk:ratio=0.01", "qsgd", "natural", "thc", "powersgd", "torch-allreduce",
            "torch-powersgd", "noop")


def available(specs: list[str]) -> tuple[list[str], list[str]]:
    """Split ``specs`` into those this installation can run and those it can't (unknown methods)."""
    import gradpress
    from gradpress.auto import is_auto

    runnable, missing = [], []
    for spec in specs:
        if spec in REFERENCES or is_auto(spec):
            runnable.append(spec)
            continue
        try:
            gradpress.make(spec)
            runnable.append(spec)
        except ValueError:
            missing.append(spec)
    return runnable, missing


def compare(base: TrainConfig, specs: list[str], out_dir: str | Path, progress: bool = True,
            say=print) -> tuple[Path, list[Run], dict[str, str]]:  # noqa: ANN001
    """Train ``base`` once per spec; returns the report's path, the runs, and the failures by spec.

    A spec that cannot run with ``base``'s options and workers (:func:`~gradpress.testbed.train.check_exchange`)
    fails before its workers start; every failure is reported with its reason, and
    :class:`~gradpress.testbed.train.TrainFailed` names every reason if no run is left."""
    if not specs:
        raise ValueError("no compressor to compare")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs, failures = [], {}
    for spec in specs:
        say(f"== {spec}")
        try:
            config = replace(base, compressor=spec)
            check_exchange(config)
        except ValueError as error:
            failures[spec] = cli.one_line(error)
            say(f"   failed: {failures[spec]}")
            continue
        try:
            runs.append(train(config, out / f"run-{_slug(spec)}.json", progress))
        except TrainFailed as error:
            failures[spec] = str(error).splitlines()[0]
            say(f"   failed: {failures[spec]}")
    if not runs:
        raise TrainFailed("every run failed: " + "; ".join(f"{k}: {v}" for k, v in failures.items()))
    return write_report(runs, out), runs, failures


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("compare", help="train with several compressors and write a report",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--compressors", type=cli.compressor_list(references=True, keywords=("demo",)),
                        default="demo",
                        help="comma-separated specs and references, or 'demo' for: " + ", ".join(DEMO_SET))
    parser.add_argument("--out", type=cli.output_dir, default="out/compare",
                        help="directory for report.md, results.json and plots")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    base = checked_config(args, "none")
    demo = args.compressors == "demo"
    specs, skipped = [], {}
    for spec in DEMO_SET if demo else split_specs(args.compressors):
        try:
            check_exchange(replace(base, compressor=spec))
            specs.append(spec)
        except ValueError as error:
            if not demo:  # the user's own list: every run must be able to start
                raise cli.UsageError(f"--compressors: {spec}: {cli.one_line(error)}") from None
            skipped[spec] = cli.one_line(error)
    for spec, why in skipped.items():
        print(f"skipped {spec}: {why}", file=sys.stderr)
    if not specs:
        raise cli.UsageError("--compressors demo: no method of the demo set can run here (see above)")
    try:
        report, runs, failures = compare(base, specs, args.out)
    except TrainFailed as error:
        print(f"{cli.PREFIX}{error}", file=sys.stderr)
        return 1
    where = f"over an emulated {base.bandwidth} star" if base.bandwidth else "over loopback"
    print(f"\n{len(runs)} runs {where}; report: {report}")
    for spec, why in failures.items():
        print(f"  {spec} failed: {why}")
    return 1 if failures else 0

