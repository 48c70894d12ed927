"""``gradpress compare``: train the same model with several compressors and write a report.

GRACE's Section 5 question on one machine: for this model on this network, which compressor pays off?
Each compressor (or reference row) is trained with the same settings by :func:`gradpress.testbed.train.train`;
the runs go to ``DIR/results.json`` and :func:`gradpress.testbed.report.write_report` writes
``DIR/report.md`` with the table and plots (quality against wall-clock and against data volume,
throughput with the ``noop`` upper bound). ``DIR`` must be new or empty: a second run into it would
leave a mix of both runs' files that its report does not describe; ``--overwrite`` removes an earlier
run's files there (:data:`OUTPUTS`) when the new run starts, and leaves any other file alone.

With ``--nodes``, a spec in ``--compressors`` may end in ``@node``: that run exchanges in two levels
(``hierarchy="node"``, :mod:`gradpress.exchange.hierarchy`), so the flat and the hierarchical exchange
of one method are two rows of one report (``topk:ratio=0.01,topk:ratio=0.01@node``). A spec ending in
``@hsdp`` or ``@fsdp`` trains the model sharded with FSDP2's ``fully_shard`` instead of DDP, with
``gradpress.fsdp.register`` on an HSDP mesh (replicas the nodes, shards a node's workers) or on a 1-D
mesh; ``torch-hsdp`` and ``torch-fsdp`` are FSDP2's own reduction on the same meshes
(:mod:`gradpress.testbed.training.rows`, :mod:`gradpress.testbed.training.sharded`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradpress.testbed import arguments
from gradpress.testbed.report import write_report
from gradpress.testbed.results import HIERARCHICAL, REFERENCES, SHARDED_REFERENCES, Run
from gradpress.testbed.train import (
    TrainConfig,
    TrainFailed,
    add_arguments,
    check_exchange,
    checked_config,
    train,
)
from gradpress.testbed.training.rows import checked_ending, run_config, split_run

__all__ = ["DEMO_SET", "OUTPUTS", "add_parser", "available", "check_out", "compare", "demo_set", "run_config",
           "run_list", "split_run"]

#: the README's demo set; methods not registered in this version are reported, not run
DEMO_SET = ("none", "fp16", "topk:ratio=0.01", "qsgd", "natural", "thc", "powersgd", "torch-allreduce",
            "torch-powersgd", "noop")


#: what a compare run writes into its directory: the report, its plots, the results and each run's record
OUTPUTS = ("report.md", "results.json", "quality_vs_time.png", "quality_vs_bytes.png", "throughput.png",
           "run-*.json")


def run_list(text: str) -> arguments.Specs:
    """The ``--compressors`` converter: :func:`gradpress.testbed.arguments.compressor_list`'s list
    (references and the ``demo`` keyword included), where a spec may end in ``@node``, ``@hsdp`` or
    ``@fsdp`` (:func:`~gradpress.testbed.training.rows.split_run`)."""
    return arguments.compressor_list(references=REFERENCES, keywords={"demo": demo_set},
                                     suffix=checked_ending)(text)


def check_out(out_dir: str | Path, overwrite: bool = False) -> Path:
    """``out_dir`` as a Path; ValueError if it holds anything and ``overwrite`` is not given."""
    out = Path(out_dir)
    if out.is_dir() and not overwrite:
        held = sorted(path.name for path in out.iterdir())
        if held:
            listed = ", ".join(held[:4]) + (", …" if len(held) > 4 else "")
            raise ValueError(f"--out {out} is not empty ({listed}): give a new directory, or --overwrite to "
                             "replace an earlier compare run's files")
    return out


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
            say=print, overwrite: bool = False) -> tuple[Path, list[Run], dict[str, str]]:  # noqa: ANN001
    """Train ``base`` once per spec; returns the report's path, the runs, and the failures by spec.

    A spec that cannot run with ``base``'s options and workers (:func:`~gradpress.testbed.train.check_exchange`)
    fails before its workers start; every failure is reported with its reason, and
    :class:`~gradpress.testbed.train.TrainFailed` names every reason if no run is left. ``out_dir`` must
    be new or empty (ValueError), unless ``overwrite``: an earlier run's :data:`OUTPUTS` there are removed."""
    if not specs:
        raise ValueError("no compressor to compare")
    out = check_out(out_dir, overwrite)
    for pattern in OUTPUTS if out.is_dir() else ():
        for path in out.glob(pattern):
            if path.is_file():
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)
    runs, failures = [], {}
    for spec in specs:
        say(f"== {spec}")
        try:
            config = compared_config(base, spec)
            check_exchange(config)
        except ValueError as error:
            failures[spec] = arguments.one_line(error)
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


def demo_set() -> list[str]:
    return list(DEMO_SET)


def _slug(spec: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("compare", help="train with several compressors and write a report",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--compressors", type=run_list, default="demo",
                        help="comma-separated specs and references; 'demo' stands for: " + ", ".join(DEMO_SET)
                             + f"; a spec ending in {HIERARCHICAL} runs the two-level exchange "
                             "(--option hierarchy=node for that run alone), e.g. topk:ratio=0.01,"
                             "topk:ratio=0.01@node with --nodes 2; on a model sharded with FSDP2 "
                             f"instead of DDP: {', '.join(SHARDED_REFERENCES)} (FSDP2's own reduction on "
                             "an HSDP mesh of (--nodes, --workers), or (--workers, 1) on one node, and on "
                             "a 1-D mesh of every rank), SPEC@hsdp (gradpress between the replicas) and "
                             "SPEC@fsdp (gradpress's reduce-scatter: fsdp.scatter_methods() only), e.g. "
                             "torch-hsdp,topk:ratio=0.01@hsdp")
    parser.add_argument("--out", type=arguments.output_dir, default="out/compare",
                        help="directory for report.md, results.json, the plots and each run's record; it "
                             "must be new or empty, so that it holds one run's files")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out: an earlier compare run's files there are removed "
                             "when this run starts (other files are left alone)")
    parser.set_defaults(func=_main)


def compared_config(base: TrainConfig, item: str) -> TrainConfig:
    """:func:`run_config` for one run of ``--compressors``: ``auto``'s own options (``--option
    measure_with=...``) go to the ``auto`` run alone."""
    from dataclasses import replace

    from gradpress.auto import AutoOptions, is_auto

    config = run_config(base, item)
    if is_auto(config.compressor):
        return config
    return replace(config, options={k: v for k, v in config.options.items() if k not in AutoOptions.names()})


def _main(args: argparse.Namespace) -> int:
    try:
        check_out(args.out, args.overwrite)
    except ValueError as error:
        raise arguments.UsageError(str(error)) from None
    base = checked_config(args, "none")
    specs, skipped = [], {}
    for spec in args.compressors:
        try:
            check_exchange(compared_config(base, spec))
            specs.append(spec)
        except ValueError as error:
            if spec not in args.compressors.expanded:  # the user's own: every run must be able to start
                raise arguments.UsageError(f"--compressors: {spec}: {arguments.one_line(error)}") from None
            skipped[spec] = arguments.one_line(error)
    for spec, why in skipped.items():
        print(f"skipped {spec}: {why}", file=sys.stderr)
    if not specs:
        raise arguments.UsageError("--compressors: no method of the demo set can run here (see above)")
    try:
        report, runs, failures = compare(base, specs, args.out, overwrite=args.overwrite)
    except TrainFailed as error:
        print(f"{arguments.PREFIX}{error}", file=sys.stderr)
        return 1
    where = f"over an emulated {base.bandwidth} star" if base.bandwidth else "over loopback"
    if base.nodes > 1:
        where += f", {base.nodes} nodes of {base.workers} workers"
    print(f"\n{len(runs)} runs {where}; report: {report}")
    for spec, why in failures.items():
        print(f"  {spec} failed: {why}")
    return 1 if failures else 0

