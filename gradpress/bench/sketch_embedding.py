"""S2 Reducer on an embedding gradient: the sparse-sketch all-reduce against all-gathering the rows.

S2 Reducer's case (Section 2.2, Section 4 "Sparse Gradient from Embedding Layers"): an ``nn.Embedding``
gradient [V, D] in which a step touches a few rows. The lossless baseline all-gathers every worker's
non-zero rows and their int32 row indices; ``sketch`` all-reduces an r × c count-sketch plus a bitmap
of rows instead. :func:`run` builds n workers' gradients with ``nn.Embedding`` itself, then reports
per worker

* the packet bytes (``Packet.nbytes``) of each method,
* the bytes each worker receives under ring collectives: all-reduce of S bytes receives 2·(n−1)/n·S,
  all-gather receives the other n − 1 workers' packets,
* compress time (per worker) and decode time (the sketch decodes the summed packet once; the all-gather
  scatters n workers' rows into a dense gradient), medians over repeats,
* the NMSE ‖ĝ − Σg‖²/‖Σg‖² of the sketch's estimate of the summed gradient (the all-gather is exact).

The touched rows are drawn uniformly and independently per worker, the worst case for the union the
sketch must hold; real token streams overlap more (Zipf).
"""
from __future__ import annotations

import argparse
import functools
from dataclasses import asdict, dataclass

import torch

import gradpress
from gradpress.bench.ops import median_ms
from gradpress.core.packet import Packet
from gradpress.core.rng import Context
from gradpress.testbed import arguments


@dataclass
class SketchEmbeddingResult:
    """What :func:`run` measures (times in milliseconds, bytes per worker)."""

    vocab: int
    dim: int
    rows_touched: int
    workers: int
    spec: str
    dense_bytes: int
    sketch_bytes: int
    gather_bytes: int
    sketch_received: int
    gather_received: int
    sketch_compress_ms: float
    sketch_decode_ms: float
    gather_compress_ms: float
    gather_decode_ms: float
    sketch_nmse: float
    union_rows: int

    def as_dict(self) -> dict:
        return asdict(self)


def embedding_gradients(
    vocab: int, dim: int, rows_touched: int, workers: int, seed: int = 0
) -> list[torch.Tensor]:
    """Each worker's gradient of ``nn.Embedding(vocab, dim)`` for a batch of ``rows_touched`` distinct
    random tokens (weighted by a random upstream gradient)."""
    generator = torch.Generator().manual_seed(seed)
    embedding = torch.nn.Embedding(vocab, dim)
    grads = []
    for _ in range(workers):
        tokens = torch.randperm(vocab, generator=generator)[:rows_touched]
        embedding.zero_grad()
        upstream = torch.randn(rows_touched, dim, generator=generator)
        (embedding(tokens) * upstream).sum().backward()
        grad = embedding.weight.grad
        assert grad is not None  # (after backward)
        grads.append(grad.detach().clone())
    return grads


def gather_compress(grad: torch.Tensor) -> Packet:
    """The all-gather baseline's packet: the non-zero rows and their int32 indices (found by the same
    row scan as the sketch's bitmap)."""
    from gradpress.compressors.sketch import nonzero_blocks  # (compiles the sketch's kernels: when run)

    rows = nonzero_blocks(grad).nonzero().squeeze(1)
    return Packet({"rows": grad[rows], "indices": rows.to(torch.int32)}, grad.shape, grad.dtype)


def gather_decode(packets: list[Packet]) -> torch.Tensor:
    """Sum of the gathered rows, scattered into a dense gradient."""
    first = packets[0]
    total = torch.zeros(first.shape, dtype=torch.float32)
    for packet in packets:
        total.index_add_(0, packet["indices"].long(), packet["rows"].float())
    return total


def run(
    vocab: int = 50_000,
    dim: int = 64,
    rows_touched: int = 500,
    workers: int = 8,
    lam: float = 0.5,
    sketch_rows: int = 1,
    repeats: int = 5,
    seed: int = 0,
) -> SketchEmbeddingResult:
    """Measure ``sketch`` against the all-gather of non-zero rows (see the module docstring).

    The sketch is sized for one worker's rows: ``ratio = rows_touched / vocab`` (K = rows_touched
    blocks, so nothing is dropped) and ``lam`` (c = λ·K·D / r).
    """
    grads = embedding_gradients(vocab, dim, rows_touched, workers, seed)
    spec = f"sketch:rows={sketch_rows},lam={lam},ratio={rows_touched / vocab!r}"
    sketch = gradpress.make(spec)
    contexts = [Context(seed=seed, step=0, key="embedding", rank=r) for r in range(workers)]
    packets = [sketch.compress(g, c) for g, c in zip(grads, contexts, strict=True)]
    per_tensor = zip(*[sketch.summands(p) for p in packets], strict=True)
    summed = [functools.reduce(torch.add, ts) for ts in per_tensor]  # what the all-reduce adds (bool: or)
    estimate = sketch.decode_sum(packets[0], [t.clone() for t in summed], 1)  # the sum, not the mean
    gathered = [gather_compress(g) for g in grads]
    exact = gather_decode(gathered).double()
    assert torch.allclose(exact, sum(grads[1:], grads[0]).double(), rtol=1e-5, atol=1e-6)

    n = workers
    sketch_bytes = packets[0].nbytes
    gather_bytes = [p.nbytes for p in gathered]
    return SketchEmbeddingResult(
        vocab=vocab,
        dim=dim,
        rows_touched=rows_touched,
        workers=n,
        spec=sketch.spec,
        dense_bytes=vocab * dim * 4,
        sketch_bytes=sketch_bytes,
        gather_bytes=gather_bytes[0],
        sketch_received=round(2 * (n - 1) / n * sketch_bytes),
        gather_received=sum(gather_bytes[1:]),
        sketch_compress_ms=median_ms(lambda: sketch.compress(grads[0], contexts[0]), repeats),
        sketch_decode_ms=median_ms(lambda: sketch.decode_sum(packets[0], [t.clone() for t in summed], 1), repeats),
        gather_compress_ms=median_ms(lambda: gather_compress(grads[0]), repeats),
        gather_decode_ms=median_ms(lambda: gather_decode(gathered), repeats),
        sketch_nmse=float((estimate.double() - exact).square().sum() / exact.square().sum()),
        union_rows=int(exact.ne(0).any(dim=1).sum()),
    )


def format_result(result: SketchEmbeddingResult) -> str:
    """A small text table of one :func:`run`."""
    r = result
    header = ("method", "packet kB", "received kB", "compress ms", "decode ms", "NMSE")
    lines = [
        (f"nn.Embedding({r.vocab}, {r.dim}) gradient, {r.rows_touched} rows per worker, {r.workers} workers "
         f"({r.union_rows} rows in the union); dense {r.dense_bytes / 1e3:.0f} kB"),
        "{:28s} {:>10s} {:>12s} {:>12s} {:>10s} {:>8s}".format(*header),
        (f"{r.spec:28s} {r.sketch_bytes / 1e3:10.1f} {r.sketch_received / 1e3:12.1f} "
         f"{r.sketch_compress_ms:12.2f} {r.sketch_decode_ms:10.2f} {r.sketch_nmse:8.3f}"),
        (f"{'all-gather rows+indices':28s} {r.gather_bytes / 1e3:10.1f} {r.gather_received / 1e3:12.1f} "
         f"{r.gather_compress_ms:12.2f} {r.gather_decode_ms:10.2f} {0.0:8.3f}"),
    ]
    return "\n".join(lines)



def add_bench_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Adds ``gradpress bench sketch``."""
    parser = bench_subparsers.add_parser("sketch", help="S2 sketch vs all-gathering an embedding's non-zero rows",
                                         description=__doc__)
    parser.add_argument("--vocab", type=arguments.positive_int, default=50_000)
    parser.add_argument("--dim", type=arguments.positive_int, default=64)
    parser.add_argument("--rows-touched", type=arguments.positive_int, default=500,
                        help="non-zero rows per worker per step")
    parser.add_argument("--workers", type=arguments.int_list(1), default="2,8,32", help="comma-separated worker counts")
    parser.add_argument("--lam", type=arguments.positive_float, default=0.5, help="sketch size / non-zeros (S2's λ)")
    parser.add_argument("--sketch-rows", type=arguments.positive_int, default=1)
    parser.add_argument("--threads", type=arguments.positive_int, default=1)
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.rows_touched > args.vocab:
        raise arguments.UsageError(f"--rows-touched {args.rows_touched}: more rows than --vocab {args.vocab}")
    try:  # the sketch run() builds for these arguments
        gradpress.make(f"sketch:rows={args.sketch_rows},lam={args.lam},ratio={args.rows_touched / args.vocab!r}")
    except ValueError as error:
        raise arguments.UsageError(f"--lam {args.lam}, --sketch-rows {args.sketch_rows}: {error}") from None
    torch.set_num_threads(args.threads)
    for workers in args.workers:
        print(format_result(run(args.vocab, args.dim, args.rows_touched, workers, args.lam, args.sketch_rows)))
        print()
    return 0
