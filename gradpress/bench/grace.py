"""``gradpress bench grace``: each method GRACE also implements, beside GRACE's own PyTorch version
(github.com/sands-lab/grace, ``grace_dl/dist/compressor``), on the same tensor in one process.

    gradpress bench grace --grace-path /tmp/grace

GRACE's source is not part of gradpress: point ``--grace-path`` at a checkout (the folder holding
``grace_dl``); without it, or when its modules cannot be imported, the benchmark says so and stops.
Modules that a GRACE compressor imports but does not use on the CPU (``horovod``, ``cupy``) are stubbed
while it is imported, here only; PowerSGD's ``dist.all_reduce`` is replaced by the identity (a world of
one worker, which is what it computes then). GRACE's CUDA-only methods (natural compression with cupy)
and its TensorFlow-only ones (SketchML, adaptive, InceptionN, 8-bit) are listed as skipped.

For each pair, both sides compress and decompress the same float32 tensor (``--size`` values from
N(0, 1), one matrix of that many for PowerSGD), with the same parameters; the rounds interleave
gradpress, GRACE and a copy (``x.clone()``) of the tensor, ``--repeats`` times, and the table gives the
medians. Each timed call follows an untimed one of the same side, so that each finds its own data in
the caches (as a training step finds the gradient it has just written); ``--clock cpu`` times this
thread's CPU time instead of the wall clock. glibc is asked to keep the memory it frees (this process
only; ``--glibc-defaults`` does not), so that neither side's times include page faults that depend on
the other's allocations. *speed-up* is GRACE's time over gradpress's; *GRACE
copies* GRACE's time in copies of the tensor. The targets: gradpress at least as fast as
GRACE, and at least 5× faster where GRACE's takes 5 copies or more. GRACE's SIGNUM updates its
momentum inside ``compress``: its gradpress row includes the ``signum`` memory's compensate and update.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from gradpress.bench import add_bench, add_glibc_defaults, keep_freed_memory, run_as_script
from gradpress.testbed import arguments

#: modules a GRACE compressor module may import at import time without needing them on the CPU
STUBBABLE = ("horovod", "cupy", "tensorflow", "cnat_cuda", "qsgd_cuda", "rdxtopk")


@dataclass(frozen=True)
class Pair:
    """A gradpress spec and the GRACE class (``grace_dl.dist.compressor.MODULE.CLASS(**kwargs)``) it is
    compared with; ``matrix``: both get the tensor as a square matrix; ``memory``: a gradpress feedback
    memory whose compensate and update are timed too (GRACE's compress does the same work)."""

    method: str
    spec: str
    module: str
    cls: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    matrix: bool = False
    memory: str | None = None
    targeted: bool = True  # False: shown, with no target (GRACE's side does no work)


PAIRS = [
    Pair("none", "none", "none", "NoneCompressor", targeted=False),  # gradpress's reads the gradient for NaN/Inf
    Pair("fp16", "fp16", "fp16", "FP16Compressor"),
    Pair("random-k", "randomk:ratio=0.01", "randomk", "RandomKCompressor", {"compress_ratio": 0.01}),
    Pair("top-k", "topk:ratio=0.01", "topk", "TopKCompressor", {"compress_ratio": 0.01}),
    Pair("DGC", "dgc:ratio=0.001", "dgc", "DgcCompressor", {"compress_ratio": 0.001}),
    Pair("threshold", "threshold:v=0.01", "threshold", "ThresholdCompressor", {"threshold": 0.01}),
    Pair("QSGD", "qsgd:levels=16,bucket=512", "qsgd", "QSGDCompressor", {"quantum_num": 16, "bucket_size": 512}),
    Pair("QSGD (GRACE's defaults)", "qsgd:levels=127,bucket=128", "qsgd", "QSGDCompressor",
         {"quantum_num": 127, "bucket_size": 128}),
    Pair("TernGrad", "terngrad:clip=2.5", "terngrad", "TernGradCompressor"),
    Pair("signSGD", "signsgd", "signsgd", "SignSGDCompressor"),
    Pair("SIGNUM", "signum", "signum", "SignumCompressor", {"momentum": 0.9}, memory="signum:momentum=0.9"),
    Pair("EF-signSGD", "efsignsgd", "efsignsgd", "EFSignSGDCompressor", {"lr": 1.0}),
    Pair("1-bit SGD", "onebit", "onebit", "OneBitCompressor"),
    Pair("PowerSGD", "powersgd:rank=1", "powersgd", "PowerSGDCompressor", {"rank": 1}, matrix=True),
]

SKIPPED = {
    "natural": "GRACE's PyTorch version needs cupy on a CUDA device",
    "SketchML, adaptive, InceptionN, 8-bit": "GRACE implements them in TensorFlow only (grace_dl/tensorflow)",
}


@dataclass
class GraceRecord:
    """One row of ``bench grace`` (the fields of ``--json``)."""

    method: str
    spec: str
    grace: str
    numel: int
    gradpress_ms: float
    grace_ms: float
    copy_ms: float
    targeted: bool = True

    @property
    def speedup(self) -> float:
        return self.grace_ms / self.gradpress_ms

    @property
    def grace_copies(self) -> float:
        return self.grace_ms / self.copy_ms

    @property
    def target(self) -> float | None:
        """The speed-up asked for: 5× where GRACE takes 5 copies or more, else 1× (None: no target)."""
        if not self.targeted:
            return None
        return 5.0 if self.grace_copies >= 5.0 else 1.0


class GraceUnavailable(Exception):
    """GRACE's source is not given or cannot be imported (the benchmark says why and stops)."""


def _import(name: str, stubs: list[str]) -> types.ModuleType:
    """Import ``name``, stubbing (in ``sys.modules``, names recorded in ``stubs``) each missing module of
    :data:`STUBBABLE` that its import needs."""
    for _ in range(len(STUBBABLE) + 1):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as error:
            missing = (error.name or "").split(".")[0]
            if missing not in STUBBABLE or missing in sys.modules:
                raise
            stub: Any = types.ModuleType(missing)  # (with a module __getattr__, PEP 562)
            stub.__getattr__ = lambda attribute, _m=missing: _unavailable(_m, attribute)
            sys.modules[missing] = stub
            stubs.append(missing)
    return importlib.import_module(name)


def _unavailable(module: str, attribute: str) -> Any:
    raise AttributeError(f"{module}.{attribute}: a stub of gradpress bench grace ({module} is not installed)")


def load_grace(path: str | None, pairs: list[Pair]) -> dict[str, Any]:
    """GRACE's compressor classes for ``pairs`` (by ``module.cls``), imported from the checkout at ``path``."""
    if not path:
        raise GraceUnavailable("no GRACE source given: pass --grace-path DIR, DIR holding grace_dl "
                               "(git clone https://github.com/sands-lab/grace DIR)")
    if not (Path(path) / "grace_dl" / "dist" / "compressor").is_dir():
        raise GraceUnavailable(f"{path}: no grace_dl/dist/compressor there (expected a checkout of "
                               "github.com/sands-lab/grace)")
    classes: dict[str, Any] = {}
    stubs: list[str] = []
    for name in [name for name in sys.modules if name == "grace_dl" or name.startswith("grace_dl.")]:
        del sys.modules[name]  # (another checkout's, imported before)
    root = str(Path(path).resolve())
    sys.path.insert(0, root)
    try:
        for pair in pairs:
            name = f"grace_dl.dist.compressor.{pair.module}"
            try:
                module: Any = _import(name, stubs)  # (GRACE's own code, as it is)
            except Exception as error:  # noqa: BLE001 - reported, as the benchmark's one message
                raise GraceUnavailable(f"cannot import {name} from {path}: {type(error).__name__}: {error}") from None
            if pair.module == "powersgd":  # a world of one worker: all_reduce is the identity
                module.dist = types.SimpleNamespace(all_reduce=lambda tensor, *args, **kwargs: None)
            if not hasattr(module, pair.cls):
                raise GraceUnavailable(f"{name} from {path} has no {pair.cls}")
            classes[f"{pair.module}.{pair.cls}"] = getattr(module, pair.cls)
    finally:
        sys.path.remove(root)
        for name in stubs:  # the modules imported keep their reference; nothing else sees the stubs
            sys.modules.pop(name, None)
    return classes


def _gradpress_call(pair: Pair, x: torch.Tensor) -> Callable[[], object]:
    import gradpress
    from gradpress.core.feedback import compress_with
    from gradpress.core.rng import Context

    compressor = gradpress.make(pair.spec)
    steps = iter(range(1 << 62))
    if pair.memory is None:
        def call() -> object:
            ctx = Context(seed=0, step=next(steps), key="bench")
            return compressor.decompress(compressor.compress(x, ctx))
        return call
    memory = gradpress.make_feedback(pair.memory)

    def call_with_memory() -> object:
        ctx = Context(seed=0, step=next(steps), key="bench")
        packet = compress_with(memory, compressor, "bench", x, ctx)  # as the runtime does
        return compressor.decompress(packet)
    return call_with_memory


def _grace_call(pair: Pair, cls: Any, x: torch.Tensor) -> Callable[[], object]:
    compressor = cls(**pair.kwargs)

    def call() -> object:
        compressed, ctx = compressor.compress(x, "bench")
        return compressor.decompress(compressed, ctx)
    return call


def _tensor(pair: Pair, numel: int, seed: int) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    if pair.matrix:
        side = int(numel ** 0.5)
        rows = side if side * side == numel else numel // max(1, side)
        x = x[: rows * (numel // rows)].view(rows, numel // rows)
    return x


def bench_pair(pair: Pair, cls: Any, numel: int, repeats: int, seed: int, cpu: bool = False) -> GraceRecord:
    """Median ms of gradpress's and GRACE's compress + decompress and of a copy, interleaved round by round
    (each timed call after an untimed one of its own); ``cpu``: this thread's CPU time instead of the
    wall clock (on a machine shared with other work)."""
    clock = time.thread_time if cpu else time.perf_counter
    x = _tensor(pair, numel, seed)
    ours, theirs = _gradpress_call(pair, x), _grace_call(pair, cls, x)
    times: dict[str, list[float]] = {"gradpress": [], "grace": [], "copy": []}
    with torch.random.fork_rng():  # GRACE's random-k reseeds torch's global generator
        for call in (ours, theirs, x.clone):  # warm up (numba compiles, the allocator)
            call()
            call()
        for _ in range(repeats):
            for name, call in (("gradpress", ours), ("grace", theirs), ("copy", x.clone)):
                call()  # untimed: the timed call then finds its own data in the caches, as the other side's did
                start = clock()
                call()
                times[name].append(clock() - start)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    grace = f"{pair.cls}({', '.join(f'{k}={v}' for k, v in pair.kwargs.items())})"
    return GraceRecord(pair.method, pair.spec, grace, x.numel(), ms["gradpress"], ms["grace"], ms["copy"],
                       pair.targeted)


def run(grace_path: str | None, numel: int, repeats: int, seed: int, methods: list[str] | None = None,
        progress: Callable[[str], None] = lambda _: None, cpu: bool = False) -> list[GraceRecord]:
    """Every pair of :data:`PAIRS` (or those whose method or spec is in ``methods``)."""
    pairs = [p for p in PAIRS if methods is None or p.method in methods or p.spec in methods]
    classes = load_grace(grace_path, pairs)
    records = []
    for pair in pairs:
        progress(pair.method)
        records.append(bench_pair(pair, classes[f"{pair.module}.{pair.cls}"], numel, repeats, seed, cpu))
    return records


def render(records: list[GraceRecord], clock: str = "wall") -> None:
    print(f"gradpress vs GRACE (grace_dl/dist), compress + decompress of {records[0].numel:,} float32 values, "
          f"{torch.get_num_threads()} thread(s); medians in ms ({clock} clock); speed-up = GRACE ms / gradpress ms")
    header = (f"  {'method':24s} {'gradpress spec':28s} {'GRACE':48s} {'gradpress':>9s} {'GRACE':>9s} "
              f"{'copy':>6s} {'GRACE copies':>12s} {'speed-up':>8s} {'target':>6s}")
    print(header)
    for r in records:
        if r.target is None:
            target, verdict = "   n/a", "(GRACE's does nothing)"
        else:
            target, verdict = f"{r.target:5.0f}×", "ok" if r.speedup >= r.target else "MISSED"
        print(f"  {r.method:24s} {r.spec:28s} {r.grace:48s} {r.gradpress_ms:9.3f} {r.grace_ms:9.3f} "
              f"{r.copy_ms:6.3f} {r.grace_copies:11.1f}× {r.speedup:7.2f}× {target} {verdict}")
    for methods, why in SKIPPED.items():
        print(f"  skipped: {methods}: {why}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--grace-path", help="a checkout of github.com/sands-lab/grace (the folder holding grace_dl)")
    parser.add_argument("--size", type=arguments.size, default=2**20, help="values per tensor (2^20 allowed)")
    parser.add_argument("--repeats", type=arguments.positive_int, default=21, help="timed rounds (medians reported)")
    parser.add_argument("--threads", type=arguments.positive_int, default=1, help="torch threads (default 1)")
    parser.add_argument("--methods", help="comma-separated methods or specs of the table (default: all)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall clock (default) or this thread's CPU time (steadier on a shared machine)")
    add_glibc_defaults(parser)
    parser.add_argument("--seed", type=arguments.seed, default=0)
    parser.add_argument("--json", type=arguments.output_file, help="write one record per method to this file")


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",")] if args.methods else None
    unknown = [m for m in methods or [] if not any(m in (p.method, p.spec) for p in PAIRS)]
    if unknown:
        raise arguments.UsageError(f"--methods: {', '.join(unknown)}: not among {', '.join(p.method for p in PAIRS)}")
    if not args.glibc_defaults and not keep_freed_memory():
        print("gradpress bench grace: glibc's mallopt is not available: allocator defaults kept")
    try:
        records = run(args.grace_path, args.size, args.repeats, args.seed, methods, cpu=args.clock == "cpu")
    except GraceUnavailable as why:
        print(f"gradpress bench grace: skipped: {why}")
        return 0
    render(records, args.clock)
    if args.json:
        rows = [dict(asdict(r), speedup=r.speedup, grace_copies=r.grace_copies, target=r.target) for r in records]
        arguments.writable_parent(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench grace``."""
    add_bench(bench_subparsers, "grace", "each method beside GRACE's PyTorch version (needs GRACE's source)",
              __doc__, add_arguments, main)


if __name__ == "__main__":
    run_as_script(__doc__, add_arguments, main)
