"""The ``gradpress sim`` command line (see :mod:`gradpress.testbed.sim`): its three modes' arguments,
their checks before anything runs, and what each prints and writes."""
from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import gradpress
from gradpress import costmodel
from gradpress.testbed import arguments
from gradpress.testbed.data import Dataset
from gradpress.testbed.sim.aggregate import (
    DEFAULT_WORKERS,
    DISTRIBUTIONS,
    nmse_vs_workers,
    plot_nmse,
    render_nmse,
)
from gradpress.testbed.sim.common import wide_console
from gradpress.testbed.sim.cost import (
    Check,
    Prediction,
    check_runs,
    cross_checks,
    crossovers,
    fit_run_latency,
    load_results,
    render_checks,
    render_crossovers,
    render_what_if,
    what_if,
)
from gradpress.testbed.sim.quality import plot_quality, render_quality, train_simulated
from gradpress.testbed.train import model_spec, runtime_option


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 4,16") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


#: the most nodes ``sim cost --nodes`` prices
MOST_NODES = 1024


def _nodes(text: str) -> list[int]:
    """Comma-separated numbers of nodes, each in 1..:data:`MOST_NODES`."""
    values = _ints(text)
    if max(values) > MOST_NODES:
        raise argparse.ArgumentTypeError(f"{text!r}: expected numbers of nodes in 1..{MOST_NODES}")
    return values


def _rates(text: str) -> list[str]:
    from gradpress.testbed.netem import rate_bits_per_second

    rates = [v.strip() for v in text.split(",") if v.strip()]
    for rate in rates:
        try:
            rate_bits_per_second(rate)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return rates


def _latency(text: str) -> float | str:
    if text == "fit":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds (e.g. 1e-4) or 'fit'") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"latency must be seconds ≥ 0, got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser("sim", help="many simulated workers in one process; the α–β cost model",
                                description=arguments.package_summary(__package__))
    modes = sim.add_subparsers(dest="sim", required=True)
    _add_nmse_parser(modes)
    _add_quality_parser(modes)
    _add_cost_parser(modes)


def _add_nmse_parser(modes: argparse._SubParsersAction) -> None:
    """``sim nmse``: the aggregate's error against the number of simulated workers."""
    p = modes.add_parser("nmse", help="NMSE of the aggregate against the number of workers (THC §8.4)")
    p.add_argument("--compressors", type=arguments.compressor_list(),
                   default="none,topk:ratio=0.01,qsgd,natural",
                   help="comma-separated compressor specs")
    p.add_argument("--workers", type=_ints, default=list(DEFAULT_WORKERS), help="numbers of workers: 4,16,64")
    p.add_argument("--numel", type=arguments.size, default=1 << 14, help="elements per worker vector (2^14 allowed)")
    p.add_argument("--dist", choices=DISTRIBUTIONS, default="normal", help="the shared signal's distribution")
    p.add_argument("--spread", type=arguments.non_negative_float, default=1.0,
                   help="scale σ of each worker's private N(0,1) noise")
    p.add_argument("--trials", type=arguments.positive_int, default=3)
    p.add_argument("--seed", type=arguments.seed, default=0)
    p.add_argument("--json", type=arguments.output_file, help="write the points here")
    p.add_argument("--plot", type=arguments.output_file,
                   help="write a log-log plot of NMSE against n here (PNG)")
    p.set_defaults(func=_reporting_errors(_main_nmse))


def _add_quality_parser(modes: argparse._SubParsersAction) -> None:
    """``sim quality``: a model trained by n simulated workers, its quality against n."""
    from gradpress.testbed.data import dataset_names

    p = modes.add_parser("quality", help="train with n simulated workers; quality against n")
    p.add_argument("--model", type=model_spec, default="mlp", help="model spec (gradpress.testbed.models)")
    p.add_argument("--data", choices=dataset_names(), help="dataset (default: the model's)")
    p.add_argument("--workers", type=_ints, default=[1, 4, 16], help="numbers of workers, e.g. 1,4,16")
    p.add_argument("--compressor", "--compressors", dest="compressors", type=arguments.compressor_list(),
                   default="none", help="compressor spec(s), comma-separated")
    p.add_argument("--steps", type=arguments.positive_int, default=100)
    p.add_argument("--batch-size", type=arguments.positive_int,
                   help="per-worker batch size (default: the model's)")
    p.add_argument("--lr", type=arguments.positive_float, help="learning rate (default: the model's)")
    p.add_argument("--seed", type=arguments.seed, default=0)
    p.add_argument("--option", type=runtime_option, action="append", default=[], metavar="KEY=VALUE",
                   help="gradpress runtime option (feedback, min_numel, warmup_steps, ...), each key once; "
                        "the seed is --seed")
    p.add_argument("--json", type=arguments.output_file, help="write the runs here")
    p.add_argument("--plot", type=arguments.output_file,
                   help="write a plot of final quality against n here (PNG)")
    p.set_defaults(func=_reporting_errors(_main_quality))


def _add_cost_parser(modes: argparse._SubParsersAction) -> None:
    """``sim cost``: the α–β step-time model against measured runs, and what-if predictions."""
    p = modes.add_parser("cost", help="α–β step-time model checked against measured runs; what-if")
    p.add_argument("--results", required=True, nargs="+", metavar="PATH",
                   help="compare output directories, results.json or run files")
    p.add_argument("--workers", type=_ints, help="predict at these numbers of workers (e.g. 16,64)")
    p.add_argument("--bandwidth", type=_rates, help="predict at these link rates (e.g. 1gbit,10gbit)")
    p.add_argument("--latency", type=_latency, default=costmodel.DEFAULT_LATENCY,
                   help=f"per-message latency α in seconds, or 'fit' to fit it to the runs "
                        f"(default {costmodel.DEFAULT_LATENCY:g})")
    p.add_argument("--strategy", default="auto", choices=["auto", *costmodel.STRATEGIES],
                   help="price what-if predictions with this strategy (default: each run's own)")
    p.add_argument("--nodes", type=_nodes, metavar="N[,N...]",
                   help=f"predict on N nodes (1..{MOST_NODES}) of --local-size ranks, a link each, flat and in "
                        "two levels (SPEC@node); instead of --workers")
    p.add_argument("--local-size", type=arguments.positive_int, metavar="K",
                   help="ranks a node with --nodes (default: each run's own, 1 for a run on one node)")
    p.add_argument("--intra-bandwidth", type=arguments.rate, metavar="RATE",
                   help=f"the rate between the ranks of a node (default {costmodel.DEFAULT_INTRA_BANDWIDTH}), "
                        "for --nodes and for runs on several nodes")
    p.add_argument("--json", type=arguments.output_file, help="write the checks and predictions here")
    p.set_defaults(func=_reporting_errors(_main_cost))


def _reporting_errors(main: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``main`` with bad input found while it runs (ValueError: unusable results, a too small shard)
    reported as a :class:`~gradpress.testbed.arguments.UsageError` (``gradpress: error: sim MODE: …``,
    exit status 2) instead of a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return main(args)
        except ValueError as error:
            raise arguments.UsageError(f"sim {args.sim}: {error}") from None

    return run


def _main_nmse(args: argparse.Namespace) -> int:
    from rich.console import Console

    most = max(args.workers)  # n + 1 float32 vectors (the signal and each worker's) and the float64 mean
    arguments.check_memory(f"--numel {args.numel} with {most} workers", ((most + 1) * 4 + 8) * args.numel)
    specs = args.compressors
    with Console(stderr=True).status("simulating") as status:
        points = nmse_vs_workers(specs, args.workers, args.numel, args.dist, args.trials, args.seed,
                                 args.spread, progress=lambda what: status.update(f"simulating {what}"))
    title = (f"NMSE of the aggregate vs workers: x_i = {args.dist} signal + {args.spread:g}·N(0,1), "
             f"d = {args.numel}, mean of {args.trials} trials")
    wide_console().print(render_nmse(points, title))
    if args.json:
        setting = {"numel": args.numel, "dist": args.dist, "spread": args.spread, "trials": args.trials,
                   "seed": args.seed}
        record = {**setting, "points": [asdict(p) for p in points]}
        arguments.writable_parent(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_nmse(points, args.plot, f'{args.dist} signal, d = {args.numel}')}")
    return 0


def _main_quality(args: argparse.Namespace) -> int:
    from gradpress.core.registry import parse_spec
    from gradpress.testbed import data as datasets
    from gradpress.testbed.models import models
    from gradpress.testbed.train import parse_options

    try:
        options = parse_options(args.option, dedicated={"seed": "--seed"})
    except ValueError as error:
        raise arguments.UsageError(str(error)) from None
    name = args.data or models.get(parse_spec(args.model)[0]).dataset
    try:
        dataset = datasets.load(name)
    except datasets.DataUnavailable as error:
        raise arguments.UsageError(f"--data {name} is not available: {error}") from None
    _check_quality(args, dataset, options)
    points = []
    from rich.console import Console

    with Console(stderr=True).status("training") as status:
        for spec in args.compressors:
            for n in args.workers:
                status.update(f"training {spec} with {n} simulated workers")
                points.append(train_simulated(args.model, dataset, n, spec, args.steps, args.batch_size,
                                              args.lr, args.seed, options))
    wide_console().print(render_quality(points))
    if args.json:
        record = json.dumps([asdict(p) for p in points], indent=1) + "\n"
        arguments.writable_parent(args.json).write_text(record)
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot_quality(points, args.plot)}")
    return 0


def _check_quality(args: argparse.Namespace, dataset: Dataset, options: dict[str, Any]) -> None:
    """Before training anything: the model for the data, a batch in the smallest shard, every
    compressor with the options at every number of workers (UsageError)."""
    from gradpress.exchange.pipeline import Options
    from gradpress.testbed.train import check_model

    try:  # the options alone (with each compressor: below)
        Options.of(**{"seed": args.seed, **options})
    except ValueError as error:
        raise arguments.UsageError(f"--option: {error}") from None
    try:
        settings = check_model(args.model, dataset)
    except ValueError as error:
        raise arguments.UsageError(f"--model {args.model}: {error}") from None
    batch_size, most = args.batch_size or settings.batch_size, max(args.workers)
    if len(dataset.train) // most < batch_size:
        raise arguments.UsageError(f"--batch-size {batch_size}: a shard of {dataset.name} for {most} workers "
                                   f"holds {len(dataset.train) // most} samples, not one batch")
    for spec in args.compressors:
        for n in sorted(set(args.workers)):
            try:
                gradpress.Simulator(spec, n, **{"seed": args.seed, **options})
            except ValueError as error:
                raise arguments.UsageError(f"--compressors {spec} with {n} worker{'s' if n > 1 else ''}: {error}") from None


def _check_cost(args: argparse.Namespace) -> None:
    """``--nodes`` against ``--workers`` and ``--local-size`` (UsageError), before any run is read."""
    if args.nodes is not None and args.workers is not None:
        raise arguments.UsageError("sim cost: give --workers n (a link per worker) or --nodes N with "
                                   "--local-size k (N nodes of k ranks, a link per node: n = N·k), not both")
    if args.local_size is not None and args.nodes is None:
        raise arguments.UsageError(f"sim cost: --local-size {args.local_size} is the ranks of a node: it "
                                   "needs --nodes")


def _main_cost(args: argparse.Namespace) -> int:
    _check_cost(args)
    runs = load_results(*args.results)
    latency = fit_run_latency(runs) if args.latency == "fit" else args.latency
    intra = args.intra_bandwidth or costmodel.DEFAULT_INTRA_BANDWIDTH
    console = wide_console()
    if args.latency == "fit":
        console.print(f"fitted latency α = {latency * 1e3:.3g} ms per message (least squares over the runs' "
                      "exposed communication)")
    checks, crossed = check_runs(runs, latency, intra), cross_checks(runs, latency, intra)
    for found, title in ((checks, "α–β model vs measured"),
                         (crossed, "α–β model carried to another n or link rate vs measured there")):
        if found:
            console.print(render_checks(found, title))
            if any(c.prediction.compute_source != "noop" for c in found):
                console.print("* no noop run of this setting: compute = step − compression − communication")
            errors = [abs(c.relative_error) for c in found if c.prediction.strategy is not None]
            if errors:
                console.print(f"communicating runs: mean |relative error| {statistics.fmean(errors):.1%}, "
                              f"largest {max(errors):.1%}")
    if not checks:
        console.print("no run over an emulated link (--bandwidth) to check the model against")
    paying = crossovers(runs, latency, intra)
    if paying:
        console.print(render_crossovers(paying))
    predictions: list[Prediction] = []
    skipped: list[str] = []
    if args.workers or args.bandwidth or args.nodes:
        predictions = what_if(runs, args.workers, args.bandwidth, latency, args.strategy, nodes=args.nodes,
                              local_size=args.local_size, intra_bandwidth=intra, skipped=skipped)
        if predictions:
            console.print(render_what_if(predictions))
        elif not skipped:
            console.print("no prediction: the runs are over loopback; give --bandwidth")
        for why in skipped:
            console.print(f"left out: {why}", highlight=False, markup=False)
    if args.json:
        out = {"latency": latency, "intra_bandwidth": intra, "checks": [_check_dict(c) for c in checks],
               "cross_checks": [_check_dict(c) for c in crossed],
               "what_if": [_prediction_dict(p) for p in predictions], "skipped": skipped,
               "crossovers": [asdict(c) for c in paying]}
        arguments.writable_parent(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def _check_dict(c: Check) -> dict[str, Any]:
    return {**_prediction_dict(c.prediction), "basis": c.basis, "measured_s": c.measured_s,
            "relative_error": c.relative_error, "within_bounds": c.within_bounds}


def _prediction_dict(p: Prediction) -> dict[str, Any]:
    out = asdict(p)
    out["samples_per_s"] = p.samples_per_s
    return out
