"""How long ``import gradpress`` takes, against ``import torch`` (docs/performance.md, "Import time").

    gradpress bench import --runs 7

Runs ``python -X importtime -c "import torch"`` and ``python -X importtime -c "import gradpress"`` in
``--runs`` fresh processes each, alternated, and reports the median of each: the import's own time (the
cumulative microseconds of the top-level imports that ``-X importtime`` writes, interpreter start-up
excluded), the process's wall time and its CPU time (user + system: less sensitive to other processes
sharing the cores). Also the time of the modules that importing torch alone does not import (the sum of
their own times: what gradpress adds, less sensitive to the variation of torch's own import than the
difference of the two medians), the modules besides torch's that take the longest in the median
gradpress run, and which of numba, scipy, matplotlib, tqdm, rich and the lab gradpress loads beyond
torch's own.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gradpress.bench import add_bench, run_as_script, write_json
from gradpress.testbed import arguments

_LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|( *)(\S+)\s*$")
WATCHED = ("numba", "scipy", "scipy.stats", "matplotlib", "tqdm", "rich", "gradpress.testbed",
           "gradpress.bench")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=arguments.integer(1), default=7,
                        help="fresh processes per import (default 7)")
    parser.add_argument("--out", type=arguments.output_file, default=None,
                        help="also write the results as JSON here")


def _one(statement: str) -> dict[str, Any]:
    """One fresh interpreter running ``statement`` under ``-X importtime``."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    check = (f"{statement}; import json, resource, sys; usage = resource.getrusage(resource.RUSAGE_SELF); "
             f"print(json.dumps([[m for m in {WATCHED!r} if m in sys.modules], "
             "usage.ru_utime + usage.ru_stime]))")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", check], env=env, capture_output=True,
                          text=True, check=True)
    wall = time.perf_counter() - start
    matches = (_LINE.match(line) for line in done.stderr.splitlines())
    rows = [(int(own), int(total), len(indent), name)
            for own, total, indent, name in (m.groups() for m in matches if m)]
    top = min(indent for _, _, indent, _ in rows)
    loaded, cpu = json.loads(done.stdout.strip().splitlines()[-1])
    return {"import_s": sum(total for _, total, indent, _ in rows if indent == top) / 1e6, "wall_s": wall,
            "cpu_s": cpu, "loaded": loaded, "own": {name: own / 1e6 for own, _, _, name in rows},
            "slowest": sorted(((own / 1e6, name) for own, _, _, name in rows
                               if name.partition(".")[0] not in ("torch", "torchgen")), reverse=True)[:8]}


def main(args: argparse.Namespace) -> int:
    runs: dict[str, list[dict[str, Any]]] = {"torch": [], "gradpress": []}
    for _ in range(args.runs):
        for name in runs:
            runs[name].append(_one(f"import {name}"))
    result: dict[str, Any] = {"runs": args.runs, "python": platform.python_version(), "nproc": os.cpu_count(),
                              "load_average": os.getloadavg()}
    for name, measured in runs.items():
        result[name] = {key: statistics.median(run[key] for run in measured)
                        for key in ("import_s", "wall_s", "cpu_s")}
    median_run = sorted(runs["gradpress"], key=lambda run: run["import_s"])[len(runs["gradpress"]) // 2]
    by_torch = set(runs["torch"][0]["loaded"])
    result["gradpress"]["loaded"] = [name for name in median_run["loaded"] if name not in by_torch]
    result["torch"]["loaded"] = sorted(by_torch)
    result["gradpress"]["slowest"] = median_run["slowest"]
    by_torch_alone = {name for run in runs["torch"] for name in run["own"]}
    result["gradpress"]["beyond_torch_s"] = statistics.median(
        sum(own for name, own in run["own"].items() if name not in by_torch_alone)
        for run in runs["gradpress"])
    result["added_s"] = result["gradpress"]["import_s"] - result["torch"]["import_s"]
    result["added_cpu_s"] = result["gradpress"]["cpu_s"] - result["torch"]["cpu_s"]
    print(f"median of {args.runs} fresh processes each (nproc {result['nproc']}, load average "
          f"{result['load_average'][0]:.2f}):")
    for name in runs:
        print(f"  import {name:9s} {result[name]['import_s']:.3f} s (process: wall "
              f"{result[name]['wall_s']:.3f} s, CPU {result[name]['cpu_s']:.3f} s)")
    print(f"  gradpress adds {result['added_s']:.3f} s ({result['added_cpu_s']:.3f} s of CPU) to torch's "
          "import and loads "
          f"{', '.join(result['gradpress']['loaded']) or 'none'} of {', '.join(WATCHED)} "
          f"(torch itself loads {', '.join(result['torch']['loaded']) or 'none'})")
    print("  the modules that import torch alone does not import: "
          f"{result['gradpress']['beyond_torch_s']:.3f} s (sum of their own times, median)")
    print("  slowest modules besides torch's (own time): "
          + ", ".join(f"{name} {s * 1e3:.0f} ms" for s, name in median_run["slowest"]))
    if args.out:
        write_json(args.out, result)
    return 0


def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench import`` under the ``bench`` subcommand's subparsers."""
    add_bench(bench_subparsers, "import", "import gradpress's time against torch's", __doc__, add_arguments,
              main)


if __name__ == "__main__":
    run_as_script(__doc__, add_arguments, main)
