"""``gradpress bench thc``: THC's NMSE against granularity (App. D.4, Figure 15) and against the
number of workers beside top-k and QSGD at the same bits (Section 8.4's scalability claim).

* **Granularity** (App. D.4): "A gradient is first drawn from a lognormal distribution ... and then
  copied multiple times to match the number of simulated workers. We run THC on the copies ... and
  compute the NMSE", ‖x̂ − x‖²/‖x‖², averaged over repetitions, for b = 2, 3, 4 bits, 10 workers and
  p = 1/1024. Each repetition draws a new vector and runs ``gradpress.simulate`` (the runtime's own
  protocol: the preliminary max norm, private rounding per worker, integer sums) with a new seed.
* **Workers** (Section 8.4, n = 4 … 64): every worker holds its own vector, x_i = s + ξ_i with a
  lognormal s shared by all and ξ_i ~ N(0, 1) private, and the NMSE is taken against the true mean
  (1/n)·Σ x_i. THC (b = 4; with the authors' p = 1/32 and with p = 1/1024) runs beside top-k and
  QSGD configured to the same 4 bits per coordinate upstream (top-k: 1/16 of the values, 32-bit value
  + 32-bit index each; QSGD: 7 levels, 1 + 3 bits, plus a float32 norm per 512 values). Private
  rounding noise averages out over the workers; what does not is bias: top-k's dropped values and
  THC's truncation (the larger p, the more of it; in training, error feedback carries it over).
  Besides the upstream bits (``Packet.nbytes``) it reports the bytes each worker receives per value
  (the runtime's traffic statistics): THC's integer
  sums widen past 8 workers (downstream ⌈log2(g·n + 1)⌉ bits, carried in uint8 then int32), an
  all-gather receives n − 1 packets.

    gradpress bench thc --repeats 10 --json thc.json --plot thc.png
"""
from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

import gradpress
from gradpress.bench import add_bench
from gradpress.testbed import arguments

DEFAULT_BITS = (2, 3, 4)
DEFAULT_GRANULARITIES = (3, 7, 8, 12, 15, 16, 20, 24, 30, 36, 44, 51)
DEFAULT_WORKERS = (4, 8, 16, 32, 64)
SAME_BITS = ("thc", "thc:p=1/1024", "topk:ratio=1/16", "qsgd:levels=7,bucket=512")  # 4 bits per value each


@dataclass
class GranularityRecord:
    """One point of Figure 15: THC with ``bits`` and ``granularity`` over ``workers`` copies."""

    bits: int
    granularity: int
    p: float
    workers: int
    dim: int
    repeats: int
    nmse: float
    table: tuple[int, ...]
    symmetric: bool = True


@dataclass
class WorkersRecord:
    """NMSE of the aggregate of ``workers`` workers' vectors under ``spec``."""

    spec: str
    workers: int
    dim: int
    repeats: int
    nmse: float
    upstream_bits: float  # Packet.nbytes · 8 / dim, per worker
    received_bytes_per_value: float  # what one worker receives per value (runtime traffic statistics)


def lognormal(dim: int, generator: torch.Generator) -> torch.Tensor:
    """``dim`` i.i.d. LogNormal(0, 1) values (App. D.4's stand-in for a gradient)."""
    return torch.randn(dim, generator=generator).exp_()


def nmse(estimate: torch.Tensor, x: torch.Tensor) -> float:
    x64 = x.double()
    return float((estimate.double() - x64).square().sum() / x64.square().sum())


def nmse_vs_granularity(
    bits: Sequence[int] = DEFAULT_BITS,
    granularities: Sequence[int] = DEFAULT_GRANULARITIES,
    workers: int = 10,
    p: float = 1 / 1024,
    dim: int = 1 << 14,
    repeats: int = 10,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _: None,
    symmetric: bool = True,
) -> list[GranularityRecord]:
    """App. D.4: mean NMSE of THC over ``repeats`` lognormal vectors copied to ``workers`` workers, for
    every b in ``bits`` and every granularity g ≥ 2^b − 1 in ``granularities`` (``symmetric``: the
    published tables, or the unrestricted optimum)."""
    from gradpress.compressors.thc import THC

    records = []
    for b in bits:
        for g in granularities:
            if g < (1 << b) - 1:
                continue
            spec = f"thc:bits={b},granularity={g},p={p!r},symmetric={str(symmetric).lower()}"
            progress(spec)
            compressor = gradpress.make(spec)
            assert isinstance(compressor, THC)
            generator = torch.Generator().manual_seed(seed)
            errors = []
            for rep in range(repeats):
                x = lognormal(dim, generator)
                errors.append(nmse(gradpress.simulate(spec, [x] * workers, seed=seed + rep), x))
            records.append(GranularityRecord(b, g, p, workers, dim, repeats, statistics.fmean(errors),
                                             tuple(compressor.table), symmetric))
    return records


def nmse_vs_workers(
    specs: Sequence[str] = SAME_BITS,
    workers: Sequence[int] = DEFAULT_WORKERS,
    dim: int = 1 << 14,
    repeats: int = 3,
    seed: int = 0,
    progress: Callable[[str], None] = lambda _: None,
) -> list[WorkersRecord]:
    """Section 8.4: NMSE of the aggregate against the true mean of n heterogeneous workers (see the
    module docstring), mean over ``repeats`` draws, for every spec and n."""
    records = []
    for spec in specs:
        compressor = gradpress.make(spec)
        for n in workers:
            progress(f"{spec}, {n} workers")
            generator = torch.Generator().manual_seed(seed)
            errors, received = [], []
            for rep in range(repeats):
                shared = lognormal(dim, generator)
                xs = [shared + torch.randn(dim, generator=generator) for _ in range(n)]
                simulator = gradpress.Simulator(spec, n, seed=seed + rep)
                errors.append(nmse(simulator.step(xs), sum(xs[1:], xs[0]) / n))
                received.append(simulator.stats()[-1]["total"]["received_bytes"] / dim)
            upstream = compressor.compress(xs[0]).nbytes * 8 / dim
            records.append(WorkersRecord(compressor.spec, n, dim, repeats, statistics.fmean(errors), upstream,
                                         statistics.fmean(received)))
    return records


# -- output ------------------------------------------------------------------------------------------------
def render(by_granularity: list[GranularityRecord], by_workers: list[WorkersRecord]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if by_granularity:
        first = by_granularity[0]
        table = Table(title=f"THC NMSE vs granularity (App. D.4 / Fig. 15): lognormal d={first.dim}, "
                            f"{first.workers} workers, p={first.p:.6g}, mean of {first.repeats}"
                            f"{'' if first.symmetric else ', unrestricted tables'}")
        bits = sorted({r.bits for r in by_granularity})
        table.add_column("g", justify="right")
        for b in bits:
            table.add_column(f"b={b}", justify="right")
        for g in sorted({r.granularity for r in by_granularity}):
            cells = {r.bits: f"{r.nmse:.3g}" for r in by_granularity if r.granularity == g}
            table.add_row(str(g), *(cells.get(b, "") for b in bits))
        console.print(table)
    if by_workers:
        head = by_workers[0]
        table = Table(title=f"NMSE of the aggregate vs workers (Section 8.4): x_i = lognormal + N(0,1), "
                            f"d={head.dim}, mean of {head.repeats}")
        for column in ("spec", "workers", "upstream bits/value", "received B/value", "NMSE"):
            table.add_column(column, justify="left" if column == "spec" else "right")
        for r in by_workers:
            table.add_row(r.spec, str(r.workers), f"{r.upstream_bits:.3f}",
                          f"{r.received_bytes_per_value:.2f}", f"{r.nmse:.3g}")
        console.print(table)


def plot(by_granularity: list[GranularityRecord], by_workers: list[WorkersRecord], path: str) -> None:
    """Both sweeps as one figure (log-scale NMSE, like Figure 15)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for b in sorted({r.bits for r in by_granularity}):
        points = [(r.granularity, r.nmse) for r in by_granularity if r.bits == b]
        left.plot(*zip(*points, strict=True), marker="o", label=f"THC b={b}")
    left.set(xlabel="granularity g", ylabel="NMSE", yscale="log", title="THC vs granularity (App. D.4)")
    for spec in dict.fromkeys(r.spec for r in by_workers):
        points = [(r.workers, r.nmse) for r in by_workers if r.spec == spec]
        right.plot(*zip(*points, strict=True), marker="o", label=spec)
    right.set(xlabel="workers", ylabel="NMSE of the mean", yscale="log", title="4 bits/value upstream")
    right.set_xscale("log", base=2)
    counts = sorted({r.workers for r in by_workers})
    right.set_xticks(counts, [str(n) for n in counts])
    for axis in (left, right):
        if axis.lines:
            axis.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _check(args: argparse.Namespace) -> None:
    """Every THC of the granularity sweep can be built (bits, granularity, p), before anything runs."""
    symmetric = str(not args.asymmetric).lower()
    for b in args.bits:
        for g in args.granularities:
            if g >= (1 << b) - 1 or not 1 <= b <= 8:  # the sweep skips g < 2^b - 1
                try:
                    gradpress.make(f"thc:bits={b},granularity={g},p={args.p!r},symmetric={symmetric}")
                except ValueError as error:
                    raise arguments.UsageError(f"--bits {b}, --granularities {g}, --p {args.p!r}: {error}") from None


def main(args: argparse.Namespace) -> int:
    _check(args)
    torch.set_num_threads(args.threads)
    from rich.console import Console

    with Console(stderr=True).status("benchmarking") as status:
        update = lambda what: status.update(f"benchmarking {what}")  # noqa: E731
        by_granularity = nmse_vs_granularity(args.bits, args.granularities, args.workers, args.p,
                                             args.dim, args.repeats, args.seed, update, not args.asymmetric)
        by_workers = nmse_vs_workers(list(args.specs), args.workers_list,
                                     args.dim, args.worker_repeats, args.seed, update)
    render(by_granularity, by_workers)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"granularity": [asdict(r) for r in by_granularity],
                                    "workers": [asdict(r) for r in by_workers]}, indent=1))
    if args.plot:
        plot(by_granularity, by_workers, args.plot)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bits", type=arguments.int_list(1), default=",".join(map(str, DEFAULT_BITS)),
                        help="bit budgets b (Figure 15: 2,3,4)")
    parser.add_argument("--granularities", type=arguments.int_list(1),
                        default=",".join(map(str, DEFAULT_GRANULARITIES)),
                        help="granularities g (those below 2^b − 1 are skipped for that b)")
    parser.add_argument("--workers", type=arguments.positive_int, default=10,
                        help="workers of the granularity sweep (App. D.4: 10)")
    parser.add_argument("--p", type=arguments.positive_float, default="1/1024",
                        help="THC's p of the granularity sweep (App. D.4: 1/1024)")
    parser.add_argument("--asymmetric", action="store_true",
                        help="granularity sweep with the unrestricted optimal tables (thc:symmetric=false)")
    parser.add_argument("--dim", type=arguments.size, default=1 << 14,
                        help="values per vector (2^14 allowed)")
    parser.add_argument("--repeats", type=arguments.positive_int, default=10,
                        help="vectors per granularity point (the paper: 100)")
    parser.add_argument("--workers-list", type=arguments.int_list(1),
                        default=",".join(map(str, DEFAULT_WORKERS)),
                        help="numbers of workers of the scalability sweep")
    parser.add_argument("--specs", type=arguments.compressor_list(), default=",".join(SAME_BITS),
                        help="comma-separated specs of the scalability sweep (default: 4 bits per value each)")
    parser.add_argument("--worker-repeats", type=arguments.positive_int, default=3,
                        help="draws per (spec, workers) point")
    parser.add_argument("--threads", type=arguments.positive_int, default=1)
    parser.add_argument("--seed", type=arguments.seed, default=0)
    parser.add_argument("--json", type=arguments.output_file, help="write every record to this file")
    parser.add_argument("--plot", type=arguments.output_file,
                        help="write both sweeps as a PNG figure to this file")


def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench thc`` under the ``bench`` subcommand's subparsers."""
    add_bench(bench_subparsers, "thc", "THC's NMSE vs granularity and vs workers (App. D.4, §8.4)", __doc__,
              add_arguments, main)


__all__ = ["GranularityRecord", "WorkersRecord", "add_bench_parser", "nmse_vs_granularity", "nmse_vs_workers"]
