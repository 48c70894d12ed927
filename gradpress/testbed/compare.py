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

from gradpress.registry import split_specs
from gradpress.testbed.report import write_report
from gradpress.testbed.results import REFERENCES, Run
from gradpress.testbed.train import TrainConfig, TrainFailed, add_arguments, config_from_args, train

#: the README's demo set (the issue's list); methods not registered in this version are reported, not run
DEMO_SET = ("none", "fp16", "topk:ratio=0.01", "qsgd", "natural", "thc", "powersgd", "torch-allreduce",
            "torch-powersgd", "noop")


def available(specs: list[str]) -> tuple[list[str], list[str]]:
    """Split ``specs`` into those this installation can run and those it can't (unknown methods)."""
    import gradpress

    runnable, missing = [], []
    for spec in specs:
        if spec in REFERENCES:
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
    """Train ``base`` once per spec; returns the report's path, the runs, and the failures by spec."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs, failures = [], {}
    for spec in specs:
        say(f"== {spec}")
        try:
            runs.append(train(replace(base, compressor=spec), out / f"run-{_slug(spec)}.json", progress))
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
    parser.add_argument("--compressors", default="demo",
                        help="comma-separated specs and references, or 'demo' for: " + ", ".join(DEMO_SET))
    parser.add_argument("--out", default="out/compare", help="directory for report.md, results.json and plots")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    wanted = list(DEMO_SET) if args.compressors == "demo" else split_specs(args.compressors)
    specs, missing = available(wanted)
    if missing:
        print(f"not in this version of gradpress, skipped: {', '.join(missing)}", file=sys.stderr)
    base = config_from_args(args, "none")
    report, runs, failures = compare(base, specs, args.out)
    where = f"over an emulated {base.bandwidth} star" if base.bandwidth else "over loopback"
    print(f"\n{len(runs)} runs {where}; report: {report}")
    for spec, why in failures.items():
        print(f"  {spec} failed: {why}")
    return 1 if failures else 0

