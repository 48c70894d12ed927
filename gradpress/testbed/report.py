"""The ``gradpress compare`` report: a table, plots and the raw results of several runs.

GRACE (Xu et al.) Section 5 judges a compressor by throughput, data volume and quality together:
quality against wall-clock (Figure 1b), quality against data volume (Figure 7), throughput with an
upper bound (Figure 8's gray bars; here the ``noop`` run, which communicates nothing). ``write_report``
writes ``report.md`` with

* a table: final and best quality, samples/s, bytes per step, time to reach the *target quality* and
  the speed-ups over ``torch-allreduce`` (its samples/s and time to target relative to each run's);
* ``quality_vs_time.png``, ``quality_vs_bytes.png``, ``throughput.png``;
* "where the time goes": mean compute, compression and communication per step of each run;
* "does compression pay off?": the best gradpress run against the goal (≥ 3× ``torch-allreduce``'s
  samples/s, ≥ 0.8× ``noop``'s, first to the target), and where its time goes when it falls short;

and ``results.json`` (the runs, :mod:`gradpress.testbed.results`' schema).

Target quality: the uncompressed run's best (``torch-allreduce``, else ``none``) minus a tolerance, or
plus it for a lower-is-better metric such as perplexity. Without such a run (or with a diverged one)
there is no target and its columns read n/a, unless a target is given.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from gradpress.testbed.results import REFERENCES, WARMUP_FRACTION, Run, save_runs

#: runs whose best quality sets the target, in order of preference
UNCOMPRESSED = ("torch-allreduce", "none")
#: the run every speed-up is relative to
BASELINE = "torch-allreduce"
#: the run drawn as the throughput upper bound (no communication at all)
UPPER_BOUND = "noop"
#: absolute tolerance per metric when none is given: 1 point of accuracy or hit rate, 5 of perplexity
DEFAULT_TOLERANCE = {"accuracy": 0.01, "hit_rate@10": 0.01, "perplexity": 5.0}
PLOTS = {"quality_vs_time.png": "quality vs wall-clock", "quality_vs_bytes.png": "quality vs data volume",
         "throughput.png": "throughput"}
if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_DECIMALS = {"accuracy": 4, "hit_rate@10": 4, "perplexity": 2}


@dataclass(frozen=True)
class Target:
    """Quality to reach: ``value`` in ``metric``; set by ``reference``'s best ± ``tolerance``, or given."""

    metric: str
    higher_is_better: bool
    value: float
    reference: str | None = None
    reference_best: float | None = None
    tolerance: float | None = None

    def describe(self) -> str:
        sign = "≥" if self.higher_is_better else "≤"
        text = f"{self.metric} {sign} {_quality(self.value, self.metric)}"
        if self.reference is None:
            return text + " (given)"
        op = "−" if self.higher_is_better else "+"
        return (f"{text} = `{self.reference}`'s best {_quality(self.reference_best, self.metric)} {op} "
                f"tolerance {self.tolerance:g}")


@dataclass(frozen=True)
class Row:
    """One run's line of the table; None where a value does not exist (printed n/a)."""

    label: str
    run: Run
    final_quality: float | None
    best_quality: float | None
    samples_per_s: float
    bytes_per_step: float
    time_to_target: float | None
    speedup_samples_per_s: float | None
    speedup_time_to_target: float | None


def find_run(runs: Sequence[Run], name: str) -> Run | None:
    """The first run whose compressor name (parameters aside) is ``name``."""
    return next((run for run in runs if run.name == name), None)


def quality_metric(runs: Sequence[Run]) -> tuple[str, bool] | None:
    """The metric the runs share (and whether higher is better); None when no run was evaluated."""
    metrics = {(run.evals[0].metric, run.evals[0].higher_is_better) for run in runs if run.evals}
    if len(metrics) > 1:
        raise ValueError(f"the runs measure different quality metrics: {sorted(m for m, _ in metrics)}")
    return metrics.pop() if metrics else None


def quality_target(runs: Sequence[Run], tolerance: float | None = None,
                   target: float | None = None) -> Target | None:
    """The target quality (module doc); ``target`` overrides; ``tolerance`` defaults per metric."""
    metric = quality_metric(runs)
    if metric is None:
        return None
    name, higher = metric
    if target is not None:
        if not math.isfinite(target):
            raise ValueError(f"the target quality must be finite, got {target}")
        return Target(name, higher, float(target))
    tolerance = DEFAULT_TOLERANCE[name] if tolerance is None else tolerance
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"the tolerance must be a finite number ≥ 0, got {tolerance}")
    for ref_name in UNCOMPRESSED:
        ref = find_run(runs, ref_name)
        if ref is not None and ref.best_quality is not None:
            value = ref.best_quality - tolerance if higher else ref.best_quality + tolerance
            return Target(name, higher, value, ref.compressor, ref.best_quality, tolerance)
    return None


def summarize(runs: Sequence[Run], tolerance: float | None = None,
              target: float | None = None) -> tuple[Target | None, list[Row]]:
    """The target and the table's rows (numbers, not text), in the order of ``runs``."""
    if not runs:
        raise ValueError("a report needs at least one run")
    goal = quality_target(runs, tolerance, target)
    baseline = find_run(runs, BASELINE)
    base_ttt = baseline.time_to_target(goal.value) if baseline is not None and goal is not None else None
    rows = []
    for label, run in zip(labels(runs), runs, strict=True):
        ttt = run.time_to_target(goal.value) if goal is not None else None
        rows.append(Row(
            label=label, run=run, final_quality=run.final_quality, best_quality=run.best_quality,
            samples_per_s=run.samples_per_s, bytes_per_step=run.bytes_per_step, time_to_target=ttt,
            speedup_samples_per_s=None if baseline is None else run.samples_per_s / baseline.samples_per_s,
            speedup_time_to_target=base_ttt / ttt if base_ttt is not None and ttt else None,
        ))
    return goal, rows


def labels(runs: Sequence[Run]) -> list[str]:
    """Row labels: the compressor (:attr:`Run.label`: ``@node`` for the two-level exchange), plus the
    settings that tell apart runs of the same compressor."""
    out = []
    for run in runs:
        twins = [other for other in runs if other.label == run.label]
        differing = [key for key in ("model", "data", "workers", "nodes", "bandwidth", "seed")
                     if len({getattr(other, key) for other in twins}) > 1]
        suffix = ", ".join(f"{key}={getattr(run, key)}" for key in differing)
        out.append(f"{run.label} [{suffix}]" if suffix else run.label)
    counts = {label: out.count(label) for label in out}
    seen: dict[str, int] = {}
    for i, label in enumerate(out):  # identical settings too: number them
        if counts[label] > 1:
            seen[label] = seen.get(label, 0) + 1
            out[i] = f"{label} #{seen[label]}"
    return out


# -------------------------------------------------------------------------------------------------
# Writing
# -------------------------------------------------------------------------------------------------
def write_report(runs: Sequence[Run], out_dir: str | Path, tolerance: float | None = None,
                 target: float | None = None) -> Path:
    """Write ``out_dir/report.md``, ``out_dir/results.json`` and the plots; returns the report's path."""
    goal, rows = summarize(runs, tolerance, target)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_runs(runs, out_dir / "results.json")
    plot_quality_vs_time(rows, goal, out_dir / "quality_vs_time.png")
    plot_quality_vs_bytes(rows, goal, out_dir / "quality_vs_bytes.png")
    plot_throughput(rows, out_dir / "throughput.png")
    path = out_dir / "report.md"
    path.write_text(render_markdown(runs, goal, rows))
    return path


def render_markdown(runs: Sequence[Run], goal: Target | None, rows: Sequence[Row]) -> str:
    metric = goal.metric if goal is not None else (quality_metric(runs) or ("quality", True))[0]
    lines = [f"# gradpress compare: {_setting(runs, 'model')} on {_setting(runs, 'data')}", "",
             f"{_workers(runs)} workers, link: {_setting(runs, 'bandwidth')}, "
             f"seed {_setting(runs, 'seed')}.", ""]
    if goal is not None:
        lines += [f"Target quality: {goal.describe()}.", ""]
    else:
        lines += [f"No target quality: neither {' nor '.join(f'`{n}`' for n in UNCOMPRESSED)} was run "
                  "(or it has no finite quality), so times to target read n/a.", ""]
    traffic = _traffic_columns(rows)
    lines += _table(
        ["compressor", f"final {metric}", f"best {metric}", "samples/s", "bytes/step", *traffic,
         "time to target", "speed-up (samples/s)", "speed-up (time to target)"],
        [[f"`{r.label}`", _quality(r.final_quality, metric), _quality(r.best_quality, metric),
          f"{r.samples_per_s:.1f}", _bytes(r.bytes_per_step), *(cell(r.run) for cell in traffic.values()),
          _time_to_target(r, goal), _ratio(r.speedup_samples_per_s), _ratio(r.speedup_time_to_target)]
         for r in rows],
        align="l" + "r" * (7 + len(traffic)))
    lines += ["", _NOTES.format(warmup=f"{WARMUP_FRACTION:.0%}", base=BASELINE, noop=UPPER_BOUND)]
    notes = _traffic_notes(rows, traffic)
    if notes:
        lines += ["", notes]
    lines += ["", "## Plots", ""]
    lines += [f"![{title}]({name})" for name, title in PLOTS.items()]
    lines += ["", "## Where the time goes", "",
              "Mean per steady-state step, rank 0, milliseconds. compute: forward, backward, optimizer; "
              "compress: compression, decompression, feedback; communication: time in collectives. "
              "DDP communicates while backward runs, so the parts may add up to more than the step. "
              "copy: the median time of one copy of the model's float32 gradient, timed by the run "
              "after training on the same machine, from memory into memory (neither end in the CPU's cache, "
              "no page faults): the unit of the two columns in copies.", ""]
    lines += _time_table(rows)
    lines += ["", "## Does compression pay off?", "", *payoff(rows)]
    return "\n".join(lines) + "\n"


def _time_table(rows: Sequence[Row]) -> list[str]:
    """"Where the time goes": each run's step and its parts in ms; where the runs timed a copy of the
    model's gradient (``info["copy_s"]``, :func:`gradpress.testbed.train.gradient_copy_s`), that copy
    and, in copies of it, the compression and the step's excess over ``noop``'s."""
    header = ["compressor", "step", "compute", "compress", "communication", "communication share"]
    body = [[f"`{r.label}`", _ms(r.run.mean_step_s), _ms(r.run.mean_compute_s), _ms(r.run.mean_compress_s),
             _ms(r.run.mean_comm_s), _share(r.run)] for r in rows]
    if any(r.run.info.get("copy_s") for r in rows):
        noop = next((r.run for r in rows if r.run.name == UPPER_BOUND), None)
        header += ["copy", "compress (copies)", "step over `noop` (copies)"]
        for line, r in zip(body, rows, strict=True):
            copy_s = r.run.info.get("copy_s")
            if not copy_s:
                line += ["n/a"] * 3
                continue
            compress, over = _in_copies(r.run, noop, copy_s)
            line += [f"{copy_s * 1e3:.2f}", f"{compress:.1f}", "n/a" if over is None else f"{over:.1f}"]
    return _table(header, body, align="l" + "r" * (len(header) - 1))


#: the goal a gradpress compressor is held to: step rate against the references, and first to target
PAYOFF_STEP_RATE = 3.0  # × torch-allreduce's samples/s
PAYOFF_NOOP_SHARE = 0.8  # × noop's samples/s
PAYOFF_RIVALS = ("torch-allreduce", "torch-powersgd")


def payoff(rows: Sequence[Row]) -> list[str]:
    """Lines judging the best gradpress compressor against the goal: at least 3× ``torch-allreduce``'s
    samples/s, at least 0.8× ``noop``'s, and the target reached sooner than ``torch-allreduce`` and
    ``torch-powersgd``; for each criterion missed, where the time goes (compression or communication
    beyond ``noop``'s step). The best is the one meeting most criteria, then the fastest to target,
    then the fastest."""
    by_name = {r.run.name: r for r in rows}
    ours = [r for r in rows if r.run.compressor not in REFERENCES]
    base, noop = by_name.get(BASELINE), by_name.get(UPPER_BOUND)
    if not ours or base is None or noop is None:
        return [f"Needs `{BASELINE}`, `{UPPER_BOUND}` and a gradpress compressor among the runs."]
    rivals = [by_name[n] for n in PAYOFF_RIVALS if n in by_name]

    def criteria(r: Row) -> dict[str, bool]:
        first = r.time_to_target is not None and all(
            o.time_to_target is None or r.time_to_target < o.time_to_target for o in rivals)
        return {f"≥ {PAYOFF_STEP_RATE:g}× `{BASELINE}`'s samples/s": r.samples_per_s >= PAYOFF_STEP_RATE * base.samples_per_s,
                f"≥ {PAYOFF_NOOP_SHARE:g}× `{UPPER_BOUND}`'s samples/s": r.samples_per_s >= PAYOFF_NOOP_SHARE * noop.samples_per_s,
                "first to the target (" + ", ".join(f"`{o.label}`" for o in rivals) + ")": first}

    def rank(r: Row) -> tuple:
        return (-sum(criteria(r).values()), r.time_to_target if r.time_to_target is not None else math.inf,
                -r.samples_per_s)

    best = min(ours, key=rank)
    met = criteria(best)
    reached = "not reached" if best.time_to_target is None else f"{best.time_to_target:.1f} s"
    lines = [f"Best gradpress run: `{best.label}` ({best.samples_per_s / base.samples_per_s:.2f}× `{BASELINE}`'s "
             f"samples/s, {best.samples_per_s / noop.samples_per_s:.2f}× `{UPPER_BOUND}`'s; time to target "
             f"{reached}).", ""]
    lines += [f"- {'met' if ok else '**not met**'}: {name}" for name, ok in met.items()]
    if all(met.values()):
        return lines
    run, floor = best.run, noop.run
    extra = run.mean_step_s - floor.mean_step_s
    lines += ["", f"Where the time goes: its step takes {_ms(run.mean_step_s)} ms against `{UPPER_BOUND}`'s "
              f"{_ms(floor.mean_step_s)} ms ({_ms(extra)} ms more): compression {_ms(run.mean_compress_s)} ms, "
              f"communication {_ms(run.mean_comm_s)} ms, compute {_ms(run.mean_compute_s)} ms (`{UPPER_BOUND}`: "
              f"{_ms(floor.mean_compute_s)} ms)."]
    copy_s = run.info.get("copy_s")
    if copy_s:
        compress, over = _in_copies(run, floor, copy_s)
        lines[-1] += (f" In copies of the model's gradient ({copy_s * 1e3:.2f} ms each, timed in the run): "
                      f"{over:.1f} over `{UPPER_BOUND}`'s step, compression {compress:.1f}.")
    return lines


def _in_copies(run: Run, noop: Run | None, copy_s: float) -> tuple[float, float | None]:
    """``run``'s compression and its step's excess over ``noop``'s (None without it), in copies."""
    over = None if noop is None else (run.mean_step_s - noop.mean_step_s) / copy_s
    return run.mean_compress_s / copy_s, over


_NOTES = (
    "samples/s: global samples per second of training at steady state (the first {warmup} of each run's "
    "steps, rounded up and at least one, left out). bytes/step: what one worker hands to the collectives "
    "per step (GRACE's data volume). Time to target: training wall-clock, evaluation excluded. Speed-ups "
    "over `{base}`: the run's samples/s over `{base}`'s, and `{base}`'s time to target over the run's "
    "(> 1 = faster); n/a without `{base}` or when a run never reaches the target. `{noop}` communicates "
    "nothing: the compute-only upper bound on throughput, not a way to train."
)


_TWO_LEVELS_NOTE = (
    "`@node`: the two-level exchange (`hierarchy=node`): a node's ranks sum their gradients inside the "
    "node, uncompressed, and each exchanges a compressed 1/k of the sum with the other nodes; its "
    "bytes/step are those of that share."
)
_SHARDED_NOTE = (
    "`torch-fsdp`, `torch-hsdp`, `@fsdp`, `@hsdp`: the model sharded with FSDP2's `fully_shard` instead of "
    "DDP, on a 1-D mesh of every rank or an HSDP mesh (replicas the nodes, shards a node's workers); "
    "their bytes/step count the gradients' reduction only, not FSDP's all-gathers of the parameters: the "
    "reduce-scatter's input on the 1-D mesh (gradpress: its packets), the shard exchanged between the "
    "replicas on the HSDP mesh (gradpress: its packets), and as intra-node bytes what FSDP's "
    "reduce-scatter sends inside the node, (k−1)/k of its input; the link bytes hold all of it, the all-gathers "
    "included."
)
_INTRA_NODE_NOTE = "intra-node bytes/step: what one worker sends inside its node (0 in one level)."
_LINK_NOTE = (
    "link bytes/step: what left {who} over its emulated link per step, as the kernel counted it "
    "({what}headers and the collectives' own traffic included){between}."
)


def _traffic_notes(rows: Sequence[Row], columns: dict[str, Callable[[Run], str]]) -> str:
    """What the traffic columns of the table hold, ``@node`` where a run used two levels, and what the
    sharded runs count: only the sentences about what the runs show."""
    notes = [_TWO_LEVELS_NOTE] if any(r.run.hierarchy == "node" for r in rows) else []
    if any(r.run.sharding is not None for r in rows):
        notes.append(_SHARDED_NOTE)
    if "intra-node bytes/step" in columns:
        notes.append(_INTRA_NODE_NOTE)
    if "link bytes/step" in columns:
        nodes = any(r.run.nodes > 1 for r in rows)
        notes.append(_LINK_NOTE.format(who="node 0" if nodes else "rank 0's namespace",
                                       what="all its workers, " if nodes else "",
                                       between=": the traffic between nodes, for every run alike" if nodes
                                       else ""))
    return " ".join(notes)


def _traffic_columns(rows: Sequence[Row]) -> dict[str, Callable[[Run], str]]:
    """The table's columns of traffic inside and between nodes, where the runs have any: intra-node
    bytes per step with several nodes, and the bytes on node 0's link where a run measured them."""
    columns: dict[str, Callable[[Run], str]] = {}
    if any(r.run.nodes > 1 or r.run.intra_node_bytes_per_step > 0 for r in rows):
        columns["intra-node bytes/step"] = lambda run: _bytes(run.intra_node_bytes_per_step)
    if any(r.run.link_bytes_per_step is not None for r in rows):
        columns["link bytes/step"] = lambda run: ("n/a" if run.link_bytes_per_step is None
                                                  else _bytes(run.link_bytes_per_step))
    return columns


def _workers(runs: Sequence[Run]) -> str:
    """The runs' workers: ``4``, or ``2 nodes × 2`` for several nodes (each different one once)."""
    values: list[str] = []
    for run in runs:
        text = f"{run.nodes} nodes × {run.workers_per_node}" if run.nodes > 1 else str(run.workers)
        if text not in values:
            values.append(text)
    return ", ".join(values)


def _table(header: list[str], body: list[list[str]], align: str) -> list[str]:
    rule = ["---:" if a == "r" else "---" for a in align]
    return ["| " + " | ".join(cells) + " |" for cells in (header, rule, *body)]


def _setting(runs: Sequence[Run], key: str) -> str:
    values = []
    for run in runs:
        value = getattr(run, key)
        text = "loopback" if key == "bandwidth" and value is None else str(value)
        if text not in values:
            values.append(text)
    return ", ".join(values)


def _quality(value: float | None, metric: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{_DECIMALS.get(metric, 4)}f}" if math.isfinite(value) else str(value)


def _time_to_target(row: Row, goal: Target | None) -> str:
    if goal is None or row.run.metric is None:
        return "n/a"
    return "not reached" if row.time_to_target is None else f"{row.time_to_target:.1f} s"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _share(run: Run) -> str:
    parts = run.mean_compute_s + run.mean_compress_s + run.mean_comm_s
    return f"{100 * run.mean_comm_s / parts:.0f} %" if parts > 0 else "n/a"


def _bytes(n: float) -> str:
    for scale, unit in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


# -------------------------------------------------------------------------------------------------
# Plots (matplotlib's object API on the Agg canvas: no pyplot, no global backend change)
# -------------------------------------------------------------------------------------------------
def _figure() -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure  # (matplotlib: a second to import, for the plots only)

    fig = Figure(figsize=(7.5, 4.5), layout="constrained")
    return fig, fig.subplots()


def _color(index: int) -> str:
    """The run's colour, the same in every plot."""
    return f"C{index % 10}"


def _target_line(ax: Axes, goal: Target | None) -> None:
    if goal is not None:
        ax.axhline(goal.value, color="gray", linestyle=":",
                   label=f"target {_quality(goal.value, goal.metric)}")


def _quality_axes(ax: Axes, rows: Sequence[Row], goal: Target | None) -> None:
    metric = next((r.run.metric for r in rows if r.run.metric), "quality")
    ax.set_ylabel(metric + ("" if goal is None or goal.higher_is_better else " (lower is better)"))
    _target_line(ax, goal)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _save(fig: Figure, path: Path) -> None:
    """Write the PNG. Log-scale tick labels are set with mathtext, whose Computer Modern and STIX fonts a
    minimal system lacks: matplotlib then logs a "findfont" warning per font and falls back to DejaVu
    Sans, which draws them correctly; those warnings are kept out of the console."""
    font_log = logging.getLogger("matplotlib.font_manager")
    level = font_log.level
    font_log.setLevel(logging.ERROR)
    try:
        fig.savefig(path, dpi=110)
    finally:
        font_log.setLevel(level)


def plot_quality_vs_time(rows: Sequence[Row], goal: Target | None, path: Path) -> Path:
    """Quality against training wall-clock, one line per run (GRACE Figure 1b)."""
    fig, ax = _figure()
    for i, row in enumerate(rows):
        if row.run.evals:
            ax.plot([e.wall_s for e in row.run.evals], [e.value for e in row.run.evals], marker="o",
                    markersize=3, color=_color(i), label=row.label)
    ax.set_xlabel("training wall-clock (s)")
    ax.set_title("Quality vs wall-clock")
    _quality_axes(ax, rows, goal)
    _save(fig, path)
    return path


def plot_quality_vs_bytes(rows: Sequence[Row], goal: Target | None, path: Path) -> Path:
    """Quality against the data volume one worker has sent (GRACE Figure 7), log-scaled bytes.

    Points at 0 bytes (the evaluation before training, ``noop``) cannot sit on a log axis and are left out.
    """
    fig, ax = _figure()
    for i, row in enumerate(rows):
        points = [(e.bytes_total, e.value) for e in row.run.evals if e.bytes_total > 0]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", markersize=3, color=_color(i), label=row.label)
            ax.set_xscale("log")
    ax.set_xlabel("bytes sent by one worker (log scale)")
    ax.set_title("Quality vs data volume")
    _quality_axes(ax, rows, goal)
    _save(fig, path)
    return path


def plot_throughput(rows: Sequence[Row], path: Path) -> Path:
    """Samples/s per run as bars, ``noop`` as the upper-bound line (GRACE Figure 8)."""
    fig, ax = _figure()
    bars = [(i, r) for i, r in enumerate(rows) if r.run.name != UPPER_BOUND]
    drawn = ax.bar(range(len(bars)), [r.samples_per_s for _, r in bars], color=[_color(i) for i, _ in bars])
    ax.bar_label(drawn, fmt="%.0f", fontsize="small")
    ax.set_xticks(range(len(bars)), [r.label for _, r in bars], rotation=30, ha="right", fontsize="small")
    for i, row in enumerate(rows):
        if row.run.name == UPPER_BOUND:
            ax.axhline(row.samples_per_s, color=_color(i), linestyle="--",
                       label=f"{row.label}: no communication (upper bound)")
    ax.set_ylim(0, 1.15 * max(r.samples_per_s for r in rows))  # room for the legend above the line
    ax.set_ylabel("samples/s")
    ax.set_title("Throughput (steady state)")
    ax.grid(axis="y", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    _save(fig, path)
    return path
