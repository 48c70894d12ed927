"""What ``gradpress advise`` prints and writes (see :mod:`gradpress.testbed.advise`): the profile in one
line, the ranked table, the pick at each link speed, the JSON record and the plot of speed-up against link
speed."""
from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping

from gradpress.costmodel.method import BASELINE
from gradpress.testbed.advise.advice import Advice
from gradpress.testbed.advise.ranking import NODE, Ranked, register_line, spec_of, speedup_at

#: the plot's link speeds, bits/s: 10 Mbit/s to 400 Gbit/s
PLOT_RANGE = (1e7, 4e11)
#: methods drawn in the plot at most (the best at the requested link speeds)
PLOTTED = 10
#: predictions this close to the best are named beside it (timings on a shared machine vary this much)
NEAR = 0.05


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _rate(bits_per_second: float) -> str:
    if bits_per_second == math.inf:
        return "every speed"
    if bits_per_second == 0:
        return "never"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6)):
        if bits_per_second >= scale:
            return f"{bits_per_second / scale:.3g} {unit}"
    return f"{bits_per_second / 1e3:.3g} kbit/s"


def _pays(crossing: float) -> str:
    if crossing == math.inf:
        return "pays at every speed"
    return "never pays" if crossing == 0 else f"pays below {_rate(crossing)}"


def describe_profile(advice: Advice) -> str:
    p = advice.profile
    ready = ", ".join(f"{b.ready_s * 1e3:.1f}" for b in p.buckets)
    layout = "read from DDP (one-process Gloo)" if p.layout == "ddp" else f"replicated ({p.note})"
    return (f"{advice.workload}: {p.parameters / 1e6:.3g} M parameters, {_bytes(p.nbytes)} of gradient in "
            f"{len(p.buckets)} DDP bucket{'s' if len(p.buckets) != 1 else ''} (layout {layout}); "
            f"batch {p.batch_size} per worker from {advice.source}, "
            f"{p.threads} thread{'s' if p.threads > 1 else ''}: "
            f"forward {p.forward_s * 1e3:.1f} ms, backward {p.backward_s * 1e3:.1f} ms, optimizer "
            f"{p.optimizer_s * 1e3:.1f} ms; buckets ready at {ready} ms into the backward pass")


def render(advice: Advice) -> Any:
    from rich.table import Table

    first = advice.bandwidths[0]
    quality = advice.steps_to_target is not None
    by = "predicted time to target" if quality else "predicted step time"
    link = f"α = {advice.latency * 1e3:.3g} ms"
    if advice.burst:
        link += f", token bucket {advice.burst:.0f} B"
    if advice.efficiency:
        link += ", rate " + ", ".join(f"{k} {v:.2f}×" for k, v in sorted(advice.efficiency.items()))
    table = Table(title=f"gradpress advise: {_workers(advice)}, {link}; "
                        f"ranked by {by} at {first} (speed-up: over {BASELINE}'s samples/s"
                        f"{'; time to target' if quality else ''})")
    for column in ("#", "method", "exchange", "bytes/step", "sent/link" if advice.topology is None else
                   "node link", "compr. ms"):
        table.add_column(column, justify="left" if column in ("method", "exchange") else "right",
                         no_wrap=column == "method")
    if quality:
        table.add_column("steps to target", justify="right")
    for bw in advice.bandwidths:
        table.add_column(f"step ms @{bw}", justify="right")
        table.add_column(f"× @{bw}" + (" (to target)" if quality else ""), justify="right")
    table.add_column("pays below", justify="right")
    at = {bw: {r.spec: r for r in rows} for bw, rows in advice.rankings.items()}
    for row in advice.rankings[first]:
        cells = [str(row.rank), row.spec, _exchange(advice, row.spec), _bytes(row.packet_bytes),
                 _bytes(row.wire_bytes), f"{row.predicted.compression * 1e3:.1f}"]
        if quality:
            cells.append("not reached" if row.steps_to_target is None else f"{row.steps_to_target:.0f}")
        for bw in advice.bandwidths:
            mine = at[bw][row.spec]
            speed = f"{mine.speedup:.2f}×"
            if quality:
                to_target = mine.speedup_time_to_target
                speed += f" ({to_target:.2f}×)" if to_target else " (n/a)"
            cells += [f"{mine.predicted.total * 1e3:.1f}", f"{speed} #{mine.rank}"]
        cells.append("" if row.spec == BASELINE else _rate(advice.crossovers[row.spec]))
        table.add_row(*cells)
    return table


def _workers(advice: Advice) -> str:
    """``16 workers``, or ``4 nodes × 4 ranks (16 workers, a link per node, 100gbit inside)``."""
    where = advice.topology
    if where is None:
        return f"{advice.workers} workers"
    return (f"{where.nodes} node{'s' if where.nodes > 1 else ''} × {where.local_size} "
            f"rank{'s' if where.local_size > 1 else ''} ({where.workers} workers, a link per node, "
            f"{where.intra_bandwidth} inside; {NODE}: in two levels)")


def _exchange(advice: Advice, spec: str) -> str:
    if spec == BASELINE:
        return "allreduce (DDP)"
    cost = next(c for c in advice.costs if c.spec == spec_of(spec))
    return f"{cost.exchange}, 2 levels" if spec.endswith(NODE) else cost.exchange


def summary_lines(advice: Advice) -> list[str]:
    """The pick at each link speed and the line to paste."""
    lines = []
    for bw in advice.bandwidths:
        rows = advice.rankings[bw]
        best = rows[0]
        why = (f"time to target {best.time_to_target_s:.3g} s" if best.time_to_target_s is not None
               else f"step {best.predicted.total * 1e3:.1f} ms")
        lines.append(f"at {bw}: {best.spec} ({why}, {best.speedup:.2f}× {BASELINE}'s samples/s)  →  "
                     f"{register_line(best.spec)}")
        close = [r.spec for r in rows[1:] if (r.time_to_target_s is None) == (best.time_to_target_s is None)
                 and _key(r) <= _key(best) * (1 + NEAR)]
        if close:
            lines.append(f"  within {NEAR:.0%} of it (a tie within measurement noise): {', '.join(close)}")
    return lines


def _key(row: Ranked) -> float:
    return row.time_to_target_s if row.time_to_target_s is not None else row.predicted.total


def to_json(advice: Advice, setting: Mapping[str, Any] | None = None) -> dict[str, Any]:
    def number(x: float | None) -> float | str | None:
        return "inf" if x == math.inf else x

    def ranked(r: Ranked) -> dict[str, Any]:
        out = asdict(r)
        out["samples_per_s"] = advice.profile.batch_size * advice.workers / r.predicted.total
        return out

    where = advice.topology

    def method(c: Any) -> dict[str, Any]:
        out = {**asdict(c), "packet_bytes_per_step": c.packet_bytes,
               "wire_bytes_per_step": c.wire_bytes(advice.workers),
               "pays_below_bits_per_second": number(advice.crossovers.get(c.spec))}
        if where is not None:  # a node's link, flat and in two levels
            out["node_link_bytes_per_step"] = c.link_bytes(where.flat())
            out["two_level"] = {"label": c.spec + NODE,
                                "packet_bytes_per_step": c.packet_bytes / where.local_size,
                                "node_link_bytes_per_step": c.link_bytes(where.two_level()),
                                "pays_below_bits_per_second": number(advice.crossovers.get(c.spec + NODE))}
        return out

    return {
        "setting": dict(setting or {}),
        "workload": advice.workload, "data": advice.source, "workers": advice.workers,
        "nodes": None if where is None else {"nodes": where.nodes, "local_size": where.local_size,
                                             "intra_bandwidth": where.intra_bandwidth},
        "latency": advice.latency, "bandwidths": advice.bandwidths, "burst": advice.burst,
        "efficiency": advice.efficiency,
        "profile": {**asdict(advice.profile), "compute_s": advice.profile.compute_s},
        "methods": [method(c) for c in advice.costs],
        "rankings": {bw: [ranked(r) for r in rows] for bw, rows in advice.rankings.items()},
        "best": {bw: advice.best(bw).spec for bw in advice.bandwidths},
        "register": {bw: register_line(advice.best(bw).spec) for bw in advice.bandwidths},
        "skipped": advice.skipped,
        "quality": None if not advice.quality else {
            "target": advice.target, "steps_to_target": advice.steps_to_target,
            "curves": [asdict(c) for c in advice.quality]},
        "quality_note": advice.quality_note,
        "seconds": advice.measure_seconds,
        "local": None if advice.baseline is None or advice.baseline.local is None else {
            BASELINE: asdict(advice.baseline.local),
            "noop": None if advice.local_noop is None else asdict(advice.local_noop)},
    }


def plot(advice: Advice, path: str | Path, limit: int = PLOTTED) -> Path:
    """Predicted speed-up over ``torch-allreduce`` against link speed (10 Mbit/s to 400 Gbit/s, log axes),
    one line per method (the ``limit`` best at the requested speeds), each method's crossing marked."""
    import numpy as np
    from matplotlib.figure import Figure

    from gradpress.testbed.netem import rate_bits_per_second

    profile, n = advice.profile, advice.workers
    base = advice.reference
    best: dict[str, float] = {}
    for rows in advice.rankings.values():
        for r in rows:
            best[r.spec] = max(best.get(r.spec, 0.0), r.speedup)
    chosen = sorted((v for v in advice.variants() if v[0] != BASELINE),
                    key=lambda v: -best.get(v[0], 0.0))[:limit]
    grid = np.geomspace(*PLOT_RANGE, 90)
    figure = Figure(figsize=(7.5, 4.8))
    axis = figure.subplots()
    for label, cost, where in chosen:
        ys = [speedup_at(profile, cost, float(bw), n=n, latency=advice.latency, baseline=base,
                         burst=advice.burst, efficiency=advice.efficiency, topology=where) for bw in grid]
        cross = advice.crossovers.get(label, 0.0)
        (line,) = axis.plot(grid, ys, label=f"{label} ({_pays(cross)})")
        if PLOT_RANGE[0] <= cross <= PLOT_RANGE[1]:
            axis.plot([cross], [1.0], marker="o", color=line.get_color(), markersize=6)
    axis.axhline(1.0, color="gray", linewidth=0.8, label=f"{BASELINE}")
    for bw in advice.bandwidths:
        axis.axvline(rate_bits_per_second(bw), color="gray", linestyle=":", linewidth=0.8)
        axis.annotate(bw, (rate_bits_per_second(bw), 0.0), xycoords=("data", "axes fraction"),
                      textcoords="offset points", xytext=(2, 4), fontsize=7, color="gray")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set(xlabel="link speed (bits/s)", ylabel=f"predicted speed-up over {BASELINE} (samples/s)",
             title=f"{advice.workload}, {_plotted_workers(advice)}: where compression pays (● = stops paying)")
    axis.grid(True, which="major", alpha=0.3)
    axis.legend(fontsize="x-small", loc="upper right")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path


def _plotted_workers(advice: Advice) -> str:
    where = advice.topology
    return f"{advice.workers} workers" if where is None else f"{where.nodes} nodes × {where.local_size}"
