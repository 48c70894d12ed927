"""The ``gradpress advise`` command line (see :mod:`gradpress.testbed.advise`): its arguments, the
workload they name, and the run that prints the advice."""
from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict
from typing import Any, Callable, Sequence

import torch

from gradpress import costmodel
from gradpress.testbed import arguments, netem
from gradpress.testbed.advise.advice import DEMO, KEYWORDS, Advice, advise, candidates
from gradpress.testbed.advise.check import Checked, check_against, render_checks, runs_link
from gradpress.testbed.advise.local import measure_local_steps
from gradpress.testbed.advise.output import describe_profile, plot, render, summary_lines, to_json
from gradpress.testbed.advise.quality import QUALITY_REFERENCE
from gradpress.testbed.advise.workload import Workload, is_factory, load_object, workload_of
from gradpress.testbed.sim.common import wide_console
from gradpress.testbed.sim.cost import load_results
from gradpress.testbed.train import model_spec

DEFAULT_BANDWIDTHS = "100mbit,1gbit,10gbit"
#: the most nodes ``--nodes`` prices
MOST_NODES = 1024


def _model(text: str) -> str:
    """A testbed model spec, or ``package.module:factory`` (importable, callable)."""
    if is_factory(text):
        try:
            load_object(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(arguments.one_line(error)) from None
        return text
    return model_spec(text)


def _reference(text: str) -> str:
    """``package.module:function``, importable and callable."""
    try:
        load_object(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(arguments.one_line(error)) from None
    return text


def _shape(text: str) -> tuple[int, ...]:
    """A per-sample input shape: comma-separated positive integers (``3,32,32``)."""
    return tuple(arguments.int_list(1)(text))


def _rates(text: str) -> list[str]:
    """Comma-separated link rates in tc's units (``100mbit,1gbit``)."""
    rates = [piece.strip() for piece in text.split(",")]
    if not all(rates):
        raise argparse.ArgumentTypeError(f"expected comma-separated link rates (e.g. 100mbit,1gbit), "
                                         f"got {text!r}")
    return [arguments.rate(rate) for rate in rates]


def _burst(text: str) -> float:
    try:
        return netem.size_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _efficiency(text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        try:
            fraction = float(value)
        except ValueError:
            fraction = math.nan
        if name not in costmodel.STRATEGIES or not (0 < fraction <= 1):
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected STRATEGY=F with F in (0, 1] and STRATEGY one of "
                f"{', '.join(costmodel.STRATEGIES)}")
        out[name] = fraction
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("advise", help="which compressor pays off for a model on a network: profile, "
                                             "then the α–β model",
                              description=arguments.package_summary(__package__))
    _add_model_arguments(p)
    _add_network_arguments(p)
    _add_method_arguments(p)
    _add_profile_arguments(p)
    _add_output_arguments(p)
    p.set_defaults(func=_main)


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model profiled: a testbed spec or a factory, and a factory's inputs."""
    p.add_argument("--model", type=_model, default="mlp-wide",
                   help="a testbed model spec (mlp-wide, resnet:width=32, …) or package.module:factory "
                        "returning an nn.Module (default mlp-wide)")
    p.add_argument("--input-shape", type=_shape,
                   help="a factory model's input shape per sample, e.g. 3,32,32 (random inputs, timing only)")
    p.add_argument("--batch", type=_reference, metavar="PACKAGE.MODULE:FUNCTION",
                   help="a factory model's batches: FUNCTION(batch_size) returns (inputs, targets)")
    p.add_argument("--batch-size", type=arguments.positive_int,
                   help="per-worker batch (default: the model's; 32)")


def _add_network_arguments(p: argparse.ArgumentParser) -> None:
    """The workers and nodes priced, and their links."""
    p.add_argument("--workers", type=arguments.integer(1, 1024),
                   help="workers n to price (1..1024; default 2), each with its own link; with --nodes, "
                        "every rank of every node (N·k)")
    p.add_argument("--nodes", type=arguments.integer(1, MOST_NODES), metavar="N",
                   help=f"price N nodes (1..{MOST_NODES}) of --local-size ranks, a link of --bandwidth per node, "
                        "each method flat and in two levels (SPEC@node)")
    p.add_argument("--local-size", type=arguments.integer(1, 1024), metavar="K",
                   help="ranks a node with --nodes (default: --workers / N, else 1)")
    p.add_argument("--intra-bandwidth", type=arguments.rate, metavar="RATE",
                   help=f"the rate between the ranks of a node with --nodes (default "
                        f"{costmodel.DEFAULT_INTRA_BANDWIDTH})")
    p.add_argument("--bandwidth", type=_rates, default=DEFAULT_BANDWIDTHS,
                   help=f"link rates per worker (per node with --nodes), comma-separated "
                        f"(default {DEFAULT_BANDWIDTHS})")
    p.add_argument("--latency", type=arguments.non_negative_float, metavar="SECONDS",
                   help=f"per-message latency α in seconds (default {costmodel.DEFAULT_LATENCY:g}; with "
                        "--check, fitted from the runs)")
    p.add_argument("--burst", type=_burst, metavar="SIZE",
                   help="the links' token bucket, e.g. 256kb (a tc size or bytes; tc tbf's burst): up to "
                        "this many bytes cross at once after an idle moment (default 0: a plain link; "
                        "--check takes each run's recorded one unless given)")
    p.add_argument("--efficiency", type=_efficiency, metavar="STRATEGY=F[,...]",
                   help="a collective's rate beyond the bucket as a fraction of the link's, e.g. "
                        "allgather=0.65 (default 1; --check fits it from the other runs)")


def _add_method_arguments(p: argparse.ArgumentParser) -> None:
    """The methods priced, and the quality runs that rank them by time to a target."""
    from gradpress.testbed.data import dataset_names

    p.add_argument("--compressors", type=arguments.compressor_list(keywords=KEYWORDS), default="default",
                   help="comma-separated specs; 'default': every registered method at its defaults and "
                        "top-k/random-k at ratios 0.1 and 0.001; 'demo': " + ",".join(DEMO))
    p.add_argument("--quality-steps", type=arguments.positive_int, metavar="K",
                   help="also train K steps per method (simulated workers) and rank by time to the "
                        "uncompressed quality")
    p.add_argument("--quality-workers", type=arguments.integer(1, 1024),
                   help="simulated workers of the quality runs (default min(n, 4))")
    p.add_argument("--data", choices=dataset_names(), help="a testbed model's dataset (default: the model's)")
    p.add_argument("--tolerance", type=arguments.non_negative_float,
                   help="target = uncompressed best − tolerance (default: compare's, per metric)")
    p.add_argument("--lr", type=arguments.positive_float, help="learning rate (default: the model's; 0.01)")


def _add_profile_arguments(p: argparse.ArgumentParser) -> None:
    """How the profile and each method's costs are measured on this machine."""
    p.add_argument("--repeats", type=arguments.positive_int, default=5,
                   help="timed steps of the profile (medians); each method: repeats − 2, at least 1")
    p.add_argument("--threads", type=arguments.positive_int, default=1,
                   help="torch threads (default 1, as each testbed worker)")
    p.add_argument("--bucket-cap-mb", type=arguments.positive_float, default=25.0, help="DDP's bucket_cap_mb")
    p.add_argument("--local-workers", type=arguments.integer(1, 64), default=1, metavar="K",
                   help="workers that will share this machine's cores and memory, as compare's do: each "
                        "method's real DDP step is also measured among K processes over loopback and "
                        "prices the host's part of its step, the link modelled (default 1: one worker per "
                        "machine, the profile alone)")
    p.add_argument("--seed", type=arguments.seed, default=0)


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    """Measured runs to check the prediction against, and the files written."""
    p.add_argument("--check", nargs="+", metavar="PATH",
                   help="compare output directories or results.json: their runs' measured steps beside the "
                        "prediction at their n and link rate (a method run several times: the median of its runs)")
    p.add_argument("--json", type=arguments.output_file, help="write the profile, costs and rankings here")
    p.add_argument("--plot", type=arguments.output_file,
                   help="write the speed-up against link speed here (PNG)")


def nodes_of(args: argparse.Namespace) -> costmodel.Topology | None:
    """``--nodes``, ``--local-size``, ``--intra-bandwidth`` and ``--workers`` together, and ``args.workers``
    set to the ranks priced: without ``--nodes``, n = ``--workers`` (default 2), each with its own link
    (None); with it, N nodes of k ranks, k = ``--local-size``, else ``--workers`` / N, else 1, and
    n = N·k (``--workers``, where given too, must be N·k). UsageError for what does not fit."""
    nodes, local, workers = args.nodes, args.local_size, args.workers
    if nodes is None:
        for option, value in (("--local-size", local), ("--intra-bandwidth", args.intra_bandwidth)):
            if value is not None:
                raise arguments.UsageError(f"{option} {value}: the ranks of a node and the rate between them "
                                           "are for --nodes N (without it each worker has its own link)")
        args.workers = 2 if workers is None else workers
        return None
    if local is None:
        if workers is not None and workers % nodes:
            raise arguments.UsageError(f"--workers {workers} on --nodes {nodes}: not the same number of ranks on "
                                       "every node (give --local-size k: n = N·k)")
        local = 1 if workers is None else workers // nodes
    elif workers is not None and workers != nodes * local:
        raise arguments.UsageError(f"--workers {workers} contradicts --nodes {nodes} × --local-size {local} "
                                   f"= {nodes * local} ranks (give two of them)")
    args.workers = nodes * local
    return costmodel.Topology(nodes, local, args.intra_bandwidth or costmodel.DEFAULT_INTRA_BANDWIDTH)


def _main(args: argparse.Namespace) -> int:
    topology = nodes_of(args)
    workload = workload_of(args)
    specs = candidates(args.compressors)
    runs = _runs_to_check(args.check)
    _check_specs(specs, args.workers)
    advice = _measure(args, workload, specs, topology)
    console = wide_console()
    checks = check_against(advice, runs) if runs else []
    shown = advice if _link_given(args) else _through_runs_link(console, advice, runs)
    _print_advice(console, shown, args.quality_steps, args.local_workers)
    if checks:
        _print_checks(console, checks)
    elif runs:
        console.print("--check: no run over an emulated link of a method priced here")
    if args.json:
        setting = {k: v for k, v in vars(args).items() if k != "func"}
        record = to_json(shown, setting)
        record["checks"] = [{**asdict(c), "relative_error": c.relative_error,
                             "with_noop_error": c.with_noop_error} for c in checks]
        arguments.writable_parent(args.json).write_text(json.dumps(record, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        print(f"wrote {plot(shown, args.plot)}")
    return 0


def _link_given(args: argparse.Namespace) -> bool:
    """Whether --latency, --burst or --efficiency was given on the command line."""
    return any(getattr(args, option) is not None for option in ("latency", "burst", "efficiency"))


def _through_runs_link(console: Any, advice: Advice, runs: Sequence[Any]) -> Advice:
    """``advice`` priced through the link of ``--check``'s runs (:func:`runs_link`: their token bucket, α
    and rates fitted from them) where they share one, so that the ranking and the pick are for the link
    they measured; ``advice`` itself otherwise (without runs, or runs of several links)."""
    link = runs_link(advice, runs) if runs else None
    if link is None:
        return advice
    rates = "".join(f", {name} at {rate:.2f}× the rate" for name, rate in sorted(link.efficiency.items()))
    console.print(f"priced through the link of the --check runs ({link.runs} runs of {link.workers} workers at "
                  f"{link.bandwidth}): token bucket {link.burst / 1024:.0f} KiB, α = {link.latency * 1e3:.2g} ms"
                  f"{rates} (--latency, --burst or --efficiency price a link of your own instead)",
                  highlight=False, markup=False)
    return advice.relinked(latency=link.latency, burst=link.burst, efficiency=link.efficiency)


def _runs_to_check(paths: list[str] | None) -> list[Any]:
    """``--check``'s runs (:func:`gradpress.testbed.sim.load_results`); none without it."""
    if not paths:
        return []
    try:
        return load_results(*paths)
    except ValueError as error:
        raise arguments.UsageError(f"--check: {arguments.one_line(error)}") from None


def _check_specs(specs: list[str], workers: int) -> None:
    """Every candidate builds a :class:`gradpress.Simulator` (before anything is measured)."""
    import gradpress

    for spec in specs:
        try:
            gradpress.Simulator(spec, min(2, workers))
        except ValueError as error:
            raise arguments.UsageError(f"--compressors {spec}: {arguments.one_line(error)}") from None


def _measure(args: argparse.Namespace, workload: Workload, specs: list[str],
             topology: costmodel.Topology | None = None) -> Advice:
    """:func:`~gradpress.testbed.advise.advise` with ``--threads`` torch threads and a progress bar on
    stderr (one step per profile, measured method and quality run)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.progress import Progress as Bar

    quality = bool(args.quality_steps) and workload.quality_unavailable is None
    total = 1 + len(specs) + (len(specs) + 1 if quality else 0) + (args.local_workers > 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                 console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("advise", total=total)
            seen = [0]

            def progress(what: str) -> None:
                if seen[0]:
                    bar.advance(task)
                seen[0] += 1
                bar.update(task, description=what[:70])

            local = _local_steps(args) if args.local_workers > 1 else None
            return advise(workload, specs, **_measuring(args), quality_steps=args.quality_steps,
                          quality_workers=args.quality_workers, tolerance=args.tolerance, progress=progress,
                          local=local, topology=topology)
    finally:
        torch.set_num_threads(threads)


def _measuring(args: argparse.Namespace) -> dict[str, Any]:
    """What :func:`~gradpress.testbed.advise.advise` measures and prices with (the quality runs aside)."""
    latency = costmodel.DEFAULT_LATENCY if args.latency is None else args.latency
    return dict(workers=args.workers, bandwidths=args.bandwidth, latency=latency, burst=args.burst or 0.0,
                efficiency=args.efficiency or {}, repeats=args.repeats, bucket_cap_mb=args.bucket_cap_mb,
                seed=args.seed, threads=args.threads)


def _local_steps(args: argparse.Namespace) -> Callable[[Sequence[str]], Any]:
    """``--local-workers K``: what measures the real local steps of the specs :func:`advise` gives it, in K
    processes that build the workload from these arguments."""
    settings = {k: v for k, v in vars(args).items() if k != "func"}

    def measure(specs: Sequence[str]) -> Any:
        try:
            return measure_local_steps(settings, specs, args.local_workers, steps=max(20, 2 * args.repeats))
        except RuntimeError as error:  # a process died (its traceback is above): say so in one line
            raise arguments.UsageError(f"--local-workers {args.local_workers}: the local DDP run failed "
                                       f"({arguments.one_line(error)}); without --local-workers advise "
                                       "prices from the profile alone") from None

    return measure


def _print_advice(console: Any, advice: Advice, quality_steps: int | None, local_workers: int = 1) -> None:
    """The profile, the quality target, the ranked table, what was left out and the pick at each speed."""
    from rich.console import Console

    console.print(describe_profile(advice))
    noop = advice.local_noop
    if local_workers > 1 and noop is not None:
        console.print(f"priced with each method's real DDP step among {local_workers} processes of this machine "
                      f"over loopback (--local-workers {local_workers}; the link modelled): noop step "
                      f"{noop.step_s * 1e3:.1f} ms, compute {noop.compute_s * 1e3:.1f} ms")
    if advice.quality_note:
        Console(stderr=True).print(advice.quality_note)
    if advice.target is not None:
        first = advice.quality[0]
        console.print(f"quality: {quality_steps} steps with {first.workers} simulated workers; target "
                      f"{first.metric} {'≥' if first.higher_is_better else '≤'} {advice.target:.4g} "
                      f"(`{QUALITY_REFERENCE}`'s best {first.best:.4g})")
    console.print(render(advice))
    for spec, why in advice.skipped.items():
        console.print(f"left out {spec}: {why}")
    for line in summary_lines(advice):
        console.print(line, highlight=False, markup=False)
    console.print(f"measured in {advice.measure_seconds:.0f} s")


def _print_checks(console: Any, checks: list[Checked]) -> None:
    """``--check``'s table and its largest and mean errors, and where the top pick ranked when measured."""
    console.print(render_checks(checks))
    errors = [abs(c.relative_error) for c in checks if c.spec != "noop"]
    if errors:
        console.print(f"largest |error| {max(errors):.1%}, mean {statistics.fmean(errors):.1%}")
    errors = [abs(c.with_noop_error) for c in checks if c.with_noop_error is not None]
    if errors:
        console.print(f"with noop's compute: largest |error| {max(errors):.1%}, "
                      f"mean {statistics.fmean(errors):.1%}")
    top = [c for c in checks if c.predicted_rank == 1]
    if top:
        runs = f" (the median of {top[0].runs} runs)" if top[0].runs > 1 else ""
        console.print(f"top pick {top[0].spec}: measured rank {top[0].measured_rank} by samples/s{runs}; "
                      f"rank {top[0].overhead_rank} by the measured step less its own compute")
    scaled = sorted((c for c in checks if c.with_noop_s is not None),
                    key=lambda c: c.with_noop_s if c.with_noop_s is not None else math.inf)
    if scaled:
        console.print(f"top pick with noop's compute {scaled[0].spec}: measured rank "
                      f"{scaled[0].measured_rank} by samples/s")
