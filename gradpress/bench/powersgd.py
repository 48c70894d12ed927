"""``gradpress bench powersgd``: gradpress's PowerSGD beside PyTorch's own ``powerSGD_hook`` (Vogels et
al. 2019, Algorithm 1 with error feedback and warm start), and the cost of one matrix.

    gradpress bench powersgd --rank 1 --steps 300 --workers 2

**Training.** ``--workers`` CPU processes in one Gloo group train the testbed's ``mlp`` on Fashion-MNIST
(``--dataset synthetic``: a linear teacher's labels on Gaussian inputs, when the data is not installed)
under three hooks, from the same weights on the same batches, steps interleaved so that drift in
machine load hits all alike: PyTorch's ``allreduce_hook`` (the exact mean, for reference), PyTorch's
``powerSGD_hook`` (rank r, ``start_powerSGD_iter = --start``, ``min_compression_rate = 2``, error feedback
and warm start on) and the gradpress hook with ``powersgd:rank=r`` (``warmup_steps = --start``, its
default residual feedback). Every hook is a Python hook, so step times compare like with like. Each
DDP model keeps all its gradients in one bucket (``--bucket-cap-mb``): with several buckets PyTorch's
hook aborts or hangs on Gloo (``tests/test_powersgd.py``). Reported per hook: the NMSE
‖ĝ − ḡ‖²/‖ḡ‖² of the aggregated gradient ĝ against the exact mean ḡ of the workers' gradients (at the
first and the last ``--nmse-steps`` compressed steps; those steps are not timed), the median step time
on rank 0 (forward, backward with the exchange, SGD step), and the test accuracy after ``--steps``.
The optimizer is SGD without momentum by default, as GRACE Section 5 trains PowerSGD on image
classification ("vanilla SGD ... as it gets better quality"); with rank 1, lr 0.1 and momentum 0.9 both
PowerSGD hooks lose the MLP within 300 steps. The two hooks compute the same aggregate from the same
sum of the workers' error-compensated gradients (their error-feedback rules differ per worker, not in
the sum), so their figures differ by the random initial Q and by rounding.

**One matrix.** On one thread, compress + decompress of a ``--matrix`` (default 2048×2048 = 2^22)
float32 matrix by ``powersgd:rank=r`` as a world of one, beside the two matrix products of its
compression, P = M Q and Q = Mᵀ P̂, and the product of its decompression, P̂ Qᵀ, timed in the same run
in the form the compressor computes them (Pᵀ = Qᵀ Mᵀ, Qᵀ = P̂ᵀ M: on the CPU up to rank 4 its numba kernels,
one pass over M each, else BLAS's products). Compression makes
no NaN/Inf pass over M of its own: it looks for them in the r × m values of P (``checks_finite``). The
decompression writes the dense m × n matrix, a cost of the order of a copy's, so ``ratio`` cannot be
less than 1 + (P̂ Qᵀ)/products; ``ratio_all`` sets compress + decompress beside all three products.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, cast

import torch
from torch import nn

from gradpress.bench import add_bench, run_as_script, spawn
from gradpress.testbed import arguments
from gradpress.testbed.train import model_spec

VARIANTS = ("torch-allreduce", "torch-powersgd", "gradpress-powersgd")


@dataclass
class MatrixRecord:
    """Single-tensor cost (milliseconds, medians): ``ratio`` = (compress + decompress) / products, where
    ``products`` times P = M Q and Q = Mᵀ P̂; ``ratio_all`` adds the decompression's P̂ Qᵀ to them."""

    spec: str
    rows: int
    cols: int
    threads: int
    products_ms: float
    decompress_product_ms: float
    compress_ms: float
    decompress_ms: float
    copy_ms: float
    ratio: float
    ratio_all: float
    kind: str = "matrix"


@dataclass
class TrainingRecord:
    """One hook's figures from the training run (see the module docstring)."""

    variant: str
    rank: int
    workers: int
    steps: int
    start: int
    dataset: str
    model: str
    nmse_steps: list[int]
    nmse: list[float]
    nmse_first: float
    nmse_last: float
    step_ms: float
    accuracy: float
    test_loss: float
    kind: str = "training"


Record = MatrixRecord | TrainingRecord


# -- one matrix -----------------------------------------------------------------------------------------
def _interleaved_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each function, timed in turn within every repetition, so that drift in
    machine load hits all alike (their ratios are what the benchmark reports)."""
    for fn in fns.values():
        fn()  # warm up (allocator, lazy initialization)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def bench_matrix(rows: int = 2048, cols: int = 2048, rank: int = 1, repeats: int = 21, threads: int = 1,
                 seed: int = 0) -> MatrixRecord:
    """Time ``powersgd:rank=rank`` on one float32 matrix beside its matrix products (module docstring)."""
    import gradpress
    from gradpress.compressors.powersgd import PowerSGD, _product, orthonormal_rows, p_product, q_product
    from gradpress.core.rng import Context

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compressor = gradpress.make(f"powersgd:rank={rank}")
        assert isinstance(compressor, PowerSGD)
        generator = torch.Generator().manual_seed(seed)
        matrix = torch.randn(rows, cols, generator=generator)
        dims = compressor.factors(matrix.shape)
        if dims is None:
            raise ValueError(f"a {rows}×{cols} matrix is not compressed at rank {rank}")
        r = dims[2]
        # the factors as the compressor holds them, Qᵀ (r × n) and P̂ᵀ (r × m), and its products' forms
        qt = torch.randn(r, cols, generator=generator)
        pt = orthonormal_rows(torch.randn(r, rows, generator=generator))
        ctx = Context(seed=seed, key="bench")
        packet = compressor.compress(matrix, ctx)
        ms = _interleaved_ms({
            "products": lambda: (p_product(qt, matrix), q_product(pt, matrix)),
            "outer": lambda: _product(pt, qt),
            "compress": lambda: compressor.compress(matrix, ctx),
            "decompress": lambda: compressor.decompress(packet),
            "copy": matrix.clone,
        }, repeats)
    finally:
        torch.set_num_threads(previous)
    both = ms["compress"] + ms["decompress"]
    return MatrixRecord(compressor.spec, rows, cols, threads, ms["products"], ms["outer"], ms["compress"],
                        ms["decompress"], ms["copy"], both / ms["products"], both / (ms["products"] + ms["outer"]))


# -- training -------------------------------------------------------------------------------------------
def _dataset(name: str, seed: int) -> Any:
    from gradpress.testbed.data import ImageData, Split, load

    if name != "synthetic":
        return load(name)
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(784, 10, generator=generator)
    x = torch.randn(14_000, 1, 28, 28, generator=generator)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    return ImageData("synthetic", Split(x[:12_000], y[:12_000]), Split(x[12_000:], y[12_000:]),
                     tuple(str(c) for c in range(10)))


class _Recorder:
    """Wraps a hook; on measured steps keeps each parameter's local gradient as the hook receives it."""

    def __init__(self) -> None:
        self.active = False
        self.local: dict[int, torch.Tensor] = {}

    def wrap(self, inner: Callable) -> Callable:
        def hook(state, bucket):  # noqa: ANN001, ANN202 - DDP checks hook annotations literally
            if self.active:
                for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
                    self.local[id(p)] = g.detach().clone()
            return inner(state, bucket)

        return hook

    def nmse(self, model: nn.Module) -> float:
        """‖ĝ − ḡ‖²/‖ḡ‖² over all parameters: ĝ what the hook returned, ḡ the exact mean (all-reduced here,
        after the step's exchange has finished, so no collective interleaves with the hook's)."""
        import torch.distributed as dist

        params = [p for p in model.parameters() if p.requires_grad]
        exact = torch.cat([self.local[id(p)].reshape(-1) for p in params]).double()
        dist.all_reduce(exact)
        exact /= dist.get_world_size()
        got = torch.cat([cast(torch.Tensor, p.grad).reshape(-1) for p in params]).double()  # (after backward)
        self.local.clear()
        return float((got - exact).square().sum() / exact.square().sum())


def _install(variant: str, ddp: nn.parallel.DistributedDataParallel, recorder: _Recorder,
             args: dict[str, Any]) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import gradpress

    if variant == "torch-allreduce":
        ddp.register_comm_hook(None, recorder.wrap(default_hooks.allreduce_hook))
    elif variant == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args["rank"],
                                            start_powerSGD_iter=args["start"], min_compression_rate=2,
                                            use_error_feedback=True, warm_start=True, random_seed=args["seed"])
        ddp.register_comm_hook(state, recorder.wrap(powerSGD_hook.powerSGD_hook))
    elif variant == "gradpress-powersgd":
        ours, hook = gradpress.ddp_comm_hook(f"powersgd:rank={args['rank']}", model=ddp.module,
                                             warmup_steps=args["start"], seed=args["seed"])
        ddp.register_comm_hook(ours, recorder.wrap(hook))
    else:
        raise ValueError(f"unknown variant {variant!r}; variants: {', '.join(VARIANTS)}")


def _worker(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from gradpress.testbed.models import criterion, evaluate, make_model, model_config

    data = _dataset(args["dataset"], args["seed"])
    shard = data.train.shard(rank, world, seed=args["seed"])
    loss_fn = criterion(data)
    lr = args["lr"] if args["lr"] is not None else model_config(args["model"], data).lr
    torch.manual_seed(args["seed"])
    initial = make_model(args["model"], data=data).state_dict()
    runs: dict[str, tuple[nn.parallel.DistributedDataParallel, torch.optim.Optimizer, _Recorder]] = {}
    for variant in VARIANTS:
        model = make_model(args["model"], data=data)
        model.load_state_dict(initial)
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args["bucket_cap_mb"])
        recorder = _Recorder()
        _install(variant, ddp, recorder, args)
        runs[variant] = (ddp, torch.optim.SGD(ddp.parameters(), lr=lr, momentum=args["momentum"]), recorder)
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randint(len(shard), (args["batch"],), generator=generator) for _ in range(args["steps"])]
    k, start, steps = args["nmse_steps"], args["start"], args["steps"]
    measured = sorted(set(range(start, min(start + k, steps))) | set(range(max(start, steps - k), steps)))
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    errors: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for step, index in enumerate(batches):
        x, y = shard.x[index], shard.y[index]
        for variant, (ddp, optimizer, recorder) in runs.items():
            recorder.active = step in measured
            dist.barrier()
            began = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(ddp(x), y).backward()
            if recorder.active:
                errors[variant].append(recorder.nmse(ddp.module))
            else:
                times[variant].append(time.perf_counter() - began)
            optimizer.step()
    quality = {variant: evaluate(ddp.module, data) for variant, (ddp, _, _) in runs.items()} if rank == 0 else {}
    return {"times": times, "errors": errors, "measured": measured, "quality": quality}


def bench_training(rank: int = 1, steps: int = 300, workers: int = 2, start: int = 2, batch: int = 64,
                   nmse_steps: int = 5, dataset: str = "fashion-mnist", model: str = "mlp", lr: float | None = None,
                   momentum: float = 0.0, bucket_cap_mb: float = 1000.0, threads: int = 1, seed: int = 0,
                   timeout: float = 600.0) -> list[TrainingRecord]:
    """Train with each hook of :data:`VARIANTS` on ``workers`` Gloo processes (module docstring)."""
    if start < 2:
        raise ValueError("start must be >= 2: PyTorch's hook needs start_powerSGD_iter > 1 with error feedback")
    args = dict(rank=rank, steps=steps, start=start, batch=batch, nmse_steps=nmse_steps, dataset=dataset,
                model=model, lr=lr, momentum=momentum, bucket_cap_mb=bucket_cap_mb, threads=threads, seed=seed,
                timeout=timeout)
    result = spawn(_worker, workers, args, timeout=timeout, threads=threads)[0]
    measured = result["measured"]
    first = [i for i, step in enumerate(measured) if step < start + nmse_steps]
    last = [i for i, step in enumerate(measured) if step >= steps - nmse_steps]
    records = []
    for variant in VARIANTS:
        errors, quality = result["errors"][variant], result["quality"][variant]
        records.append(TrainingRecord(
            variant=variant, rank=rank, workers=workers, steps=steps, start=start, dataset=dataset, model=model,
            nmse_steps=measured, nmse=errors,
            nmse_first=statistics.fmean(errors[i] for i in first) if first else float("nan"),
            nmse_last=statistics.fmean(errors[i] for i in last) if last else float("nan"),
            step_ms=statistics.median(result["times"][variant]) * 1e3,
            accuracy=quality["accuracy"], test_loss=quality["loss"]))
    return records


def run(rank: int = 1, steps: int = 300, workers: int = 2, start: int = 2, batch: int = 64, nmse_steps: int = 5,
        dataset: str = "fashion-mnist", model: str = "mlp", lr: float | None = None, momentum: float = 0.0,
        bucket_cap_mb: float = 1000.0, threads: int = 1, seed: int = 0, matrix: tuple[int, int] | None = (2048, 2048),
        repeats: int = 21, training: bool = True) -> list[Record]:
    """Both parts: the single-matrix record (unless ``matrix`` is None), then one training record per hook."""
    records: list[Record] = []
    if matrix is not None:
        records.append(bench_matrix(*matrix, rank=rank, repeats=repeats, threads=threads, seed=seed))
    if training:
        records += bench_training(rank, steps, workers, start, batch, nmse_steps, dataset, model, lr, momentum,
                                  bucket_cap_mb, threads, seed)
    return records


# -- command line -----------------------------------------------------------------------------------------
def render(records: list[Record]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for r in records:
        if isinstance(r, MatrixRecord):
            console.print(f"{r.spec} on a {r.rows}×{r.cols} float32 matrix, {r.threads} thread(s), medians: "
                          f"compress {r.compress_ms:.2f} ms + decompress {r.decompress_ms:.2f} ms; products "
                          f"M·Q + Mᵀ·P̂ {r.products_ms:.2f} ms, P̂·Qᵀ {r.decompress_product_ms:.2f} ms; copy "
                          f"{r.copy_ms:.2f} ms. Ratio to the two products {r.ratio:.2f}×, to all three "
                          f"{r.ratio_all:.2f}×")
    training = [r for r in records if isinstance(r, TrainingRecord)]
    if training:
        first = training[0]
        table = Table(title=f"{first.model} on {first.dataset}, {first.workers} Gloo workers, rank {first.rank}, "
                            f"{first.steps} steps ({first.start} uncompressed)")
        for column in ("hook", "NMSE first", "NMSE last", "step ms (median)", "test accuracy", "test loss"):
            table.add_column(column, justify="left" if column == "hook" else "right", no_wrap=column == "hook")
        for r in training:
            table.add_row(r.variant, f"{r.nmse_first:.3g}", f"{r.nmse_last:.3g}", f"{r.step_ms:.2f}",
                          f"{r.accuracy:.4f}", f"{r.test_loss:.4f}")
        console.print(table)


def parse_matrix(text: str) -> tuple[int, int] | None:
    if text.lower() in ("", "none", "off"):
        return None
    rows, sep, cols = text.lower().partition("x")
    try:
        shape = int(rows), int(cols)
    except ValueError:
        shape = (0, 0)
    if not sep or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS of positive integers (e.g. 2048x2048) or 'none', "
                                         f"got {text!r}")
    return shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=arguments.positive_int, default=1,
                        help="PowerSGD rank r for both hooks (default 1)")
    parser.add_argument("--steps", type=arguments.positive_int, default=300, help="training steps")
    parser.add_argument("--workers", type=arguments.positive_int, default=2, help="Gloo processes")
    parser.add_argument("--start", type=arguments.integer(2), default=2,
                        help="uncompressed first steps (torch's start_powerSGD_iter, gradpress's warmup_steps); >= 2")
    parser.add_argument("--batch", type=arguments.positive_int, default=64, help="batch size per worker")
    parser.add_argument("--nmse-steps", type=arguments.positive_int, default=5,
                        help="NMSE at the first and the last N compressed steps")
    parser.add_argument("--dataset", default="fashion-mnist", choices=("fashion-mnist", "synthetic"),
                        help="fashion-mnist or synthetic")
    parser.add_argument("--model", type=model_spec, default="mlp",
                        help="a testbed classification model spec (default mlp)")
    parser.add_argument("--lr", type=arguments.positive_float,
                        help="SGD learning rate (default: the model's)")
    parser.add_argument("--momentum", type=arguments.non_negative_float, default=0.0,
                        help="SGD momentum (default 0: GRACE §5 trains PowerSGD with vanilla SGD)")
    parser.add_argument("--bucket-cap-mb", type=arguments.positive_float, default=1000.0,
                        help="DDP bucket size (default: one bucket; several make torch's hook fail on Gloo)")
    parser.add_argument("--threads", type=arguments.positive_int, default=1,
                        help="torch threads (per worker)")
    parser.add_argument("--seed", type=arguments.seed, default=0)
    parser.add_argument("--matrix", type=parse_matrix, default=(2048, 2048),
                        help="ROWSxCOLS of the single-matrix timing, or 'none' (default 2048x2048)")
    parser.add_argument("--repeats", type=arguments.positive_int, default=21,
                        help="timed repetitions of the single-matrix timing")
    parser.add_argument("--no-training", action="store_true", help="only the single-matrix timing")
    parser.add_argument("--json", type=arguments.output_file, help="write the records to this file")


def _check(args: argparse.Namespace) -> None:
    """What the arguments together must allow, before any process starts (UsageError)."""
    import gradpress
    from gradpress.compressors.powersgd import PowerSGD
    from gradpress.testbed.data import DataUnavailable
    from gradpress.testbed.train import check_model

    if args.matrix is not None:
        compressor = gradpress.make(f"powersgd:rank={args.rank}")
        assert isinstance(compressor, PowerSGD)
        if compressor.factors(args.matrix) is None:
            rows, cols = args.matrix
            raise arguments.UsageError(f"--matrix {rows}x{cols}: not compressed at --rank {args.rank} "
                                       "(too small a saving)")
    if args.no_training:
        return
    if args.start >= args.steps:
        raise arguments.UsageError(f"--start {args.start}: no compressed step in --steps {args.steps}")
    try:
        dataset = _dataset(args.dataset, args.seed)
    except DataUnavailable as error:
        raise arguments.UsageError(f"--dataset {args.dataset}: {error}") from None
    try:
        check_model(args.model, dataset)
    except ValueError as error:
        raise arguments.UsageError(f"--model {args.model}: {error}") from None
    if len(dataset.train) < args.workers:
        raise arguments.UsageError(f"--workers {args.workers}: {args.dataset} has {len(dataset.train)} training samples, "
                                   "fewer than one per worker")


def main(args: argparse.Namespace) -> int:
    _check(args)
    records = run(args.rank, args.steps, args.workers, args.start, args.batch, args.nmse_steps, args.dataset,
                  args.model, args.lr, args.momentum, args.bucket_cap_mb, args.threads, args.seed, args.matrix,
                  args.repeats, training=not args.no_training)
    render(records)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([asdict(r) for r in records], indent=1))
    return 0


def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench powersgd`` under the ``bench`` subcommand's subparsers."""
    add_bench(bench_subparsers, "powersgd", "PowerSGD beside torch's powerSGD_hook", __doc__, add_arguments, main)


if __name__ == "__main__":
    run_as_script(__doc__, add_arguments, main)
