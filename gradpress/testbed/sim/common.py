"""What the ``gradpress sim`` modes share (see :mod:`gradpress.testbed.sim`): argument checks, the
progress callback, a wide console and line plots against the number of workers."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

Progress = Callable[[str], None]


def quiet(_: str) -> None:
    pass


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def wide_console():  # noqa: ANN201 - rich's Console, imported when needed
    """Rich's console; 200 columns wide when writing to a file or pipe (the tables are wide)."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal or "COLUMNS" in os.environ else Console(width=200)


def plot_lines(series: dict[str, list[tuple[float, float]]], path: str | Path, xlabel: str, ylabel: str,
               title: str, logy: bool, guide: tuple[str, list[tuple[float, float]]] | None = None) -> Path:
    """Lines against n (log₂ axis) with matplotlib's object API (no pyplot, no global backend)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.4))
    axis = figure.subplots()
    for label, points in series.items():
        if points:
            axis.plot(*zip(*points, strict=True), marker="o", label=label)
    if guide is not None:
        axis.plot(*zip(*guide[1], strict=True), linestyle=":", color="gray", label=guide[0])
    axis.set_xscale("log", base=2)
    if logy:
        axis.set_yscale("log")
    counts = sorted({x for points in series.values() for x, _ in points})
    axis.set_xticks(counts, [str(int(n)) for n in counts])
    axis.set(xlabel=xlabel, ylabel=ylabel, title=title)
    axis.grid(True, which="major", alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
