"""A method's first use: compiling its CPU kernels on an empty disk cache, and loading them from a full one
(docs/performance.md, "First use: compiling kernels").

    gradpress bench firstuse --compressors thc,topk:ratio=0.01,qsgd,powersgd

For each spec, against a copy of the package with no compiled kernel in it (a temporary folder, which also
holds ``GRADPRESS_CACHE`` and ``XDG_CACHE_HOME``: no cache of the user's is read or written), four fresh
processes, one after another:

* ``cold``: ``Simulator(spec, 2)`` set up (its warm-up compiles the float32 kernels,
  :func:`gradpress.warm_up`), its first step on two workers' float32 gradients (a 256 × 1024 matrix and a
  vector of 1024), then ``gradpress.warm_up(spec, dtypes=[float16, bfloat16])``: what a ``Communicator``
  compiles besides;
* ``warm``: the same again, on the disk cache the first process wrote;
* ``cold, no warm-up`` and ``warm, no warm-up``: ``Simulator(spec, 2, warm_up=False)`` and its first step
  on a copy of its own (what the first step of a training compiled before front ends warmed up).

Each process imports gradpress and numba before its clocks start, and reports the seconds of the set-up,
of the first step and of the extra dtypes' warm-up, in wall time and in the process's CPU time
(``time.process_time``: numba compiles on one thread, so on a machine shared with other work this is
close to what the wall time of an idle one would be; the load average is printed), the kernel
specializations compiled and loaded from the disk cache (``gradpress.kernels.jit.compile_counts``), and
how long a second ``Simulator`` of the same setting takes to set up in that process (its warm-up is
skipped). ``--runs`` repeats the whole and reports medians.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from gradpress.bench import add_bench, run_as_script, write_json
from gradpress.testbed import arguments

DEFAULT_SPECS = "thc,topk:ratio=0.01,qsgd,powersgd"

#: one fresh process: argv = spec, "1" to warm up at set-up (else "0")
_CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    import gradpress
    from gradpress.kernels.jit import compile_counts  # numba loaded before the clock starts

    spec, warm_up = sys.argv[1], sys.argv[2] == "1"
    generator = torch.Generator().manual_seed(0)
    grads = [{"weight": torch.randn(256, 1024, generator=generator),
              "bias": torch.randn(1024, generator=generator)} for _ in range(2)]
    clocks = [(time.perf_counter(), time.process_time())]
    sim = gradpress.Simulator(spec, 2, warm_up=warm_up)
    clocks.append((time.perf_counter(), time.process_time()))
    sim.step(grads)
    clocks.append((time.perf_counter(), time.process_time()))
    first = compile_counts()
    out = {"compiled": first[0], "loaded": first[1]}
    if warm_up:
        gradpress.warm_up(spec, dtypes=[torch.float16, torch.bfloat16])
        clocks.append((time.perf_counter(), time.process_time()))
        total = compile_counts()
        out["other_dtypes_compiled"], out["other_dtypes_loaded"] = total[0] - first[0], total[1] - first[1]
    for name, (then, now) in zip(("set_up", "first_step", "other_dtypes"), zip(clocks, clocks[1:])):
        out[name + "_s"], out[name + "_cpu_s"] = now[0] - then[0], now[1] - then[1]
    again = time.perf_counter()
    gradpress.Simulator(spec, 2, warm_up=warm_up)
    out["again_s"] = time.perf_counter() - again
    print(json.dumps(out))
""")

VARIANTS = (("cold", True), ("warm", True), ("cold, no warm-up", False), ("warm, no warm-up", False))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compressors", type=arguments.compressor_list(), default=DEFAULT_SPECS,
                        help=f"the specs measured, comma-separated (default {DEFAULT_SPECS})")
    parser.add_argument("--runs", type=arguments.integer(1), default=1,
                        help="repetitions of the whole (each compiling from scratch; default 1): medians")
    parser.add_argument("--out", type=arguments.output_file, default=None,
                        help="also write the results as JSON here")


def _copy(folder: Path) -> Path:
    """A copy of the package (no compiled kernel, no bytecode) under ``folder``; returns the folder to put
    on ``PYTHONPATH``."""
    package = Path(__file__).resolve().parents[1]
    shutil.copytree(package, folder / "src" / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    return folder / "src"


def _one(root: Path, folder: Path, spec: str, warm_up: bool) -> dict[str, Any]:
    environment = {key: value for key, value in os.environ.items() if key not in ("NUMBA_CACHE_DIR",)}
    environment.update(PYTHONPATH=str(root), GRADPRESS_CACHE=str(folder / "cache"),
                       XDG_CACHE_HOME=str(folder / "xdg"), GRADPRESS_NUMBA="1")
    done = subprocess.run([sys.executable, "-c", _CHILD, spec, "1" if warm_up else "0"], env=environment,
                          cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{spec}: the measuring process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(spec: str) -> dict[str, dict[str, Any]]:
    """One run of the four processes for ``spec`` (see the module docstring)."""
    result: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gradpress-firstuse-") as tmp:
        for warm_up in (True, False):
            folder = Path(tmp) / ("warm-up" if warm_up else "plain")
            folder.mkdir()
            root = _copy(folder)
            for name, with_warm_up in VARIANTS:
                if with_warm_up == warm_up:
                    result[name] = _one(root, folder, spec, warm_up)
    return result


def main(args: argparse.Namespace) -> int:
    specs = list(args.compressors)  # (arguments.Specs)
    runs: dict[str, list[dict[str, dict[str, Any]]]] = {spec: [] for spec in specs}
    loads = []
    for _ in range(args.runs):
        for spec in specs:
            runs[spec].append(measure(spec))
            loads.append(os.getloadavg()[0])
    result: dict[str, Any] = {"runs": args.runs, "python": platform.python_version(), "nproc": os.cpu_count(),
                              "load_average": [min(loads), max(loads)], "specs": {}}
    print(f"medians of {args.runs} run(s), seconds of wall time / of the process's CPU time (nproc "
          f"{result['nproc']}, load average {min(loads):.1f}-{max(loads):.1f}):")
    heads = " ".join(f"{head:>13s}" for head in ("set-up", "first step", "f16 + bf16"))
    print(f"  {'spec':16s} {'variant':17s} {heads} {'again':>6s}  compiled/loaded")
    for spec, measured in runs.items():
        table: dict[str, dict[str, float]] = {}
        for name, _ in VARIANTS:
            keys = measured[0][name].keys()
            table[name] = {key: statistics.median(run[name][key] for run in measured) for key in keys}
            row = table[name]
            times = [f"{row[part + '_s']:6.2f} /{row[part + '_cpu_s']:6.2f}" if part + "_s" in row
                     else " " * 13 for part in ("set_up", "first_step", "other_dtypes")]
            counts = f"{row['compiled']:.0f}/{row['loaded']:.0f}"
            if "other_dtypes_s" in row:
                counts += f" (+{row['other_dtypes_compiled']:.0f}/{row['other_dtypes_loaded']:.0f})"
            print(f"  {spec:16s} {name:17s} {' '.join(times)} {row['again_s']:6.3f}  {counts}")
        warm, plain = table["warm"], table["warm, no warm-up"]
        table["warm_up_adds"] = {key: (warm[f"set_up{unit}"] + warm[f"first_step{unit}"])
                                 - (plain[f"set_up{unit}"] + plain[f"first_step{unit}"])
                                 for key, unit in (("wall_s", "_s"), ("cpu_s", "_cpu_s"))}
        result["specs"][spec] = table
    adds = {spec: table["warm_up_adds"] for spec, table in result["specs"].items()}
    print("  warm cache: set-up + first step with the warm-up minus without (wall / CPU): "
          + ", ".join(f"{spec} {s['wall_s']:+.2f} / {s['cpu_s']:+.2f} s" for spec, s in adds.items()))
    if args.out:
        write_json(args.out, result)
    return 0


def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench firstuse`` under the ``bench`` subcommand's subparsers."""
    add_bench(bench_subparsers, "firstuse", "a method's first use: kernels compiled, cold and warm cache",
              __doc__, add_arguments, main)


if __name__ == "__main__":
    run_as_script(__doc__, add_arguments, main)
