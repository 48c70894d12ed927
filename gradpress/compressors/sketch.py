"""S2 Reducer (Ge et al.): sparse sketches that all-reduce, and block-wise top-K.

A sparse gradient, e.g. an embedding layer's with a few touched rows per step, cannot be all-reduced
as (indices, values): every worker's indices differ. S2 Reducer's *sparse-sketch* (Section 3.1,
Algorithm 1) sends instead

* a **bitmap** of the non-zero blocks (a block is one row of a 2-D gradient, e.g. an embedding row),
* an r × c **count-sketch** of the non-zero values: value g(i) is added, times a random sign s_j(i),
  to bucket h_j(i) of every row j,

and both can be summed elementwise across workers: the bucket hashes and signs come from the shared
stream, so the summed table is the sketch of the summed gradient (Section 3.1, "Collecting
Sparse-Sketch with AllReduce": A^T Σ_k g_k = Σ_k A^T g_k), and the summed bitmap marks the union of
the workers' non-zero blocks. Decoding reads, for every element of a marked block, the median over
rows of s_j(i)·S[j, h_j(i)].

``blocktopk`` is block-wise top-K sparsification (Section 2.2): the K blocks of largest L2 norm,
sent as their values and block indices; ``sketch:ratio=…`` applies it before sketching, which is S2
Reducer with block sparsification (Thm 2), still all-reducible.

Finite in, finite out: block norms are ranked without overflowing (:func:`block_norms`), and the
sketch's table holds its sums scaled by a power of two that every worker derives from the tensor's
size and dtype alone, so that neither one worker's bucket sums nor the all-reduced sum of up to
:data:`SUM_WORKERS` workers' tables can overflow float32 (:meth:`Sketch.table_exponent`); estimates
beyond the input dtype's range saturate at its largest value.
"""
from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradpress._numba import as_numpy, jit, mix32, use_numba
from gradpress.compressor import Compressor, count_nonfinite, register
from gradpress.compressors.sparsify import keep_count, topk_indices
from gradpress.packet import Packet
from gradpress.registry import param
from gradpress.rng import Context, mix32_torch, seed32

# How many rows the tensor being compressed has (None: 1-D, or unknown). ``Compressor.compress``
# flattens before ``_compress`` sees the tensor, so the public entry point records the shape here.
_ROWS: ContextVar[int | None] = ContextVar("gradpress_sketch_rows", default=None)

_TABLE_DTYPE = torch.float32
SUM_WORKERS = 1 << 10  # the table's scale leaves room for the all-reduced sum of this many workers' tables
MAX_BLOCK = 1 << 20  # a block is padded to its full size: the most values a block may hold


class _Blocks(Compressor):
    """Shared block layout of ``sketch`` and ``blocktopk``.

    ``block > 0``: blocks of that many consecutive values of the flattened tensor (the last one
    shorter, zero-padded). ``block = 0``: one block per row, ``x.reshape(x.shape[0], -1)``, so an
    embedding gradient [V, D] has V blocks of D values; a 1-D tensor then has one block per element.
    The row count is read from the tensor given to :meth:`compress`; a caller that hands a flat tensor
    straight to ``_compress`` (a composition's first stage) gets the 1-D layout.
    """

    block: int
    ratio: float

    def compress(self, x: torch.Tensor, ctx: Context | None = None, **options: Any) -> Packet:
        """As :meth:`Compressor.compress`, noting the row count of ``x`` for the block layout."""
        rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() >= 2 else None
        token = _ROWS.set(rows)
        try:
            return super().compress(x, ctx, **options)
        finally:
            _ROWS.reset(token)

    def block_size(self, numel: int, rows: int | None = None) -> int:
        """Values per block for a tensor of ``numel`` values and ``rows`` rows (None: 1-D)."""
        if self.block:
            return self.block
        return numel // rows if rows else 1

    def kept_blocks(self, blocks: int) -> int:
        """K = max(1, ceil(ratio · blocks)), at most ``blocks``."""
        return keep_count(blocks, self.ratio)

    def _layout(self, flat: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(block size B, the values as a zero-padded [blocks, B] tensor)."""
        size = self.block_size(flat.numel(), _ROWS.get())
        return size, as_blocks(flat, size)


def as_blocks(flat: torch.Tensor, size: int) -> torch.Tensor:
    """``flat`` as [ceil(numel / size), size] (a view when size divides numel, else a padded copy)."""
    blocks = -(-flat.numel() // size)
    if blocks * size == flat.numel():
        return flat.view(blocks, size)
    return torch.nn.functional.pad(flat, (0, blocks * size - flat.numel())).view(blocks, size)


def block_norms(blocks: torch.Tensor) -> torch.Tensor:
    """The ranking of Section 2.2's block top-K: every block's squared L2 norm in float32, finite for
    any finite input.

    Squares of values beyond 2^64 (fp32, bf16) overflow float32; when a norm comes out infinite, every
    block is first scaled by the same power of two 2^-e, with 2^e > max|x|, so that each square is below
    1 and each sum below B, and ranked by those: the order of blocks whose norms did not overflow is
    kept (scaling by a power of two is exact, short of underflow for blocks below 2^-75 of the largest,
    which then tie). Without overflow the result is the plain sum of squares, the same bits as ever."""
    values = blocks if blocks.dtype == torch.float32 else blocks.float()
    norms = values.square().sum(dim=1)
    if norms.numel() and not math.isfinite(float(norms.max())):  # blocks are finite: the squares overflowed
        exponent = math.frexp(float(values.abs().max()))[1]  # max|x| < 2^exponent
        norms = (values * math.ldexp(1.0, -exponent)).square_().sum(dim=1)
    return norms


def element_indices(blocks: torch.Tensor, size: int, numel: int) -> torch.Tensor:
    """Flat indices (int64) of every value of the given blocks, padding beyond ``numel`` left out."""
    indices = (blocks.unsqueeze(1) * size + torch.arange(size, device=blocks.device)).reshape(-1)
    return indices if blocks.numel() == 0 or int(indices[-1]) < numel else indices[indices < numel]


# -- block-wise top-K -------------------------------------------------------------------------------
@register("blocktopk")
@dataclass(repr=False)
class BlockTopK(_Blocks):
    """Block-wise top-K (S2 Reducer, Section 2.2): the K = ceil(ratio · blocks) blocks of largest L2
    norm, sent as their values, shaped [K, B] in the input dtype, and their int32 block indices
    (K·(B·b + 32) bits for b-bit values). Ties go to the lower block index; a last, shorter block is
    zero-padded to B values.

    The values keep their [K, B] shape, so in ``blocktopk+sketch`` the sketch sees K rows, one per
    selected block.
    """

    ratio: float = param(1 / 32, "(0, 1]")
    block: int = param(0, "[0, 2^20]")  # MAX_BLOCK; 0: one block per row
    kept = "values"
    examples = ("blocktopk:ratio=0.25", "blocktopk:ratio=1,block=8", "blocktopk:ratio=0.5,block=5")

    def kept_numel(self, numel: int) -> int:
        size = self.block_size(numel)
        return self.kept_blocks(-(-numel // size)) * size

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        size = self.block_size(numel)
        kept = self.kept_blocks(-(-numel // size))
        return kept * (size * torch.empty((), dtype=dtype).element_size() + 4)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        size, blocks = self._layout(flat)
        chosen = topk_indices(block_norms(blocks), self.kept_blocks(blocks.shape[0]))
        meta = {"block": size}
        tensors = {"values": blocks[chosen], "indices": chosen.to(torch.int32)}
        return Packet(tensors, flat.shape, flat.dtype, meta)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        size, numel = packet.meta["block"], packet.numel
        dense = torch.zeros(-(-numel // size), size, dtype=torch.float32, device=packet.device)
        dense[packet["indices"].long()] = packet["values"].float().view(-1, size)
        return dense.view(-1)[:numel]


# -- the sparse sketch ------------------------------------------------------------------------------
@register("sketch")
@dataclass(repr=False)
class Sketch(_Blocks):
    """S2 Reducer's sparse-sketch (Algorithm 1): an r × c count-sketch of the non-zero values plus a
    bitmap of the non-zero blocks, both summed across workers; decoded by the median over rows.

    Spec keys:

    * ``rows`` — r, the sketch rows (the authors' code uses 1, which is also the case Thm 1's proof
      treats).
    * ``lam`` — λ = sketch size / non-zeros (App. B.3: 0.5 is best). The width c must be the same on
      every worker, so it cannot follow a worker's own non-zero count, which the others do not know
      before the all-reduce. It follows a bound every worker knows: N = min(numel, K·B), the most
      values one worker inserts (K blocks of B values), and c = ceil(λ·N / r).
    * ``ratio`` — K = ceil(ratio · blocks), the most blocks one worker sends. With ``ratio = 1`` every
      non-zero block is sent (the embedding case of Section 3). Below 1, a worker with more non-zero
      blocks keeps the K of largest L2 norm (block-wise top-K, S2 with block sparsification, Thm 2),
      which drops values: biased, so error feedback applies. For an embedding set ``ratio`` to the
      fraction of rows a step touches: it sizes the sketch and drops nothing while the bound holds.
    * ``block`` — the block layout (see :class:`_Blocks`): 0 = one block per row.

    Ranges: ``rows`` 1..64 (r rows cost r hashes per value; count-sketches use a handful), ``lam``
    in (0, 64] (λ = 1 already sends as many table entries as the values it holds), ``ratio`` in (0, 1],
    ``block`` 0..2^20 (blocks are zero-padded to their full size).

    Error: with one row, each decoded value collects the other M − 1 decoded values' collisions with
    probability 1/c each, so E‖ĝ − g‖² = (M − 1)/c·‖g‖², an NMSE of about 1/λ for one worker. The
    sketch holds the *sum* of the workers' values in the union of their blocks, so n workers touching
    disjoint rows put up to n·N values in c buckets per row: NMSE ≈ n/λ (measured: 15 for n = 8,
    λ = 0.5). Size λ for the union.

    Thm 2 (block top-K then sketch is δ-approximate with δ = K/b) rests on E‖U(y)‖² = ‖y‖², which a
    count-sketch does not satisfy: E‖U(y)‖² ≈ (1 + 1/λ)·‖y‖² with one row, so
    E‖x − U(sparse(x))‖² ≈ ‖x − y‖² + ‖y‖²/λ, below ‖x‖² only for λ > 1. With λ = 0.5 and error
    feedback the residual grows without bound (tests/test_sketch.py shows both sides).

    Wire: the r × c table in float32 (sums of many values need its range and precision whatever the
    gradient's dtype), then the bitmap as one bool per block. Summing bools elementwise is an OR, which
    is what the union needs and never wraps: ``torch.distributed`` all-reduces bool tensors with SUM as
    a logical or (Gloo; NCCL maps it to MAX), where a uint8 count would wrap at 256 workers. Bit-packing
    the bitmap would cut it 8× but bits cannot be summed: it needs a bitwise-OR reduction (Gloo has
    ReduceOp.BOR, NCCL does not).

    Range: the table holds the sums times 2^-s, s = :meth:`table_exponent`, a power of two every worker
    derives from N and the input dtype alone (packet metadata, not sent): one bucket sums at most N
    values of one worker, each below 2^E (E = 128 for fp32 and bf16, 16 for fp16), so the all-reduced
    sum of up to W = :data:`SUM_WORKERS` = 1024 workers' tables stays below 2^(⌈log2(N·W)⌉ + E − s) ≤
    2^127 and cannot overflow float32. s = 0 for fp16 gradients (65504·N·W fits float32 for any
    N < 2^32): their table bits are what they always were. For fp32 and bf16 s = ⌈log2(N·W)⌉ + 1 (e.g.
    34 for N = 2^23): scaling by a power of two is exact, so the decoded estimates keep their bits, but
    the wire values are 2^-s times the plain count-sketch, and inputs below 2^(s-126) in magnitude lose
    precision to float32's subnormal range (below 2^(s-149): flushed to 0) — for N = 2^23 that is below
    about 2e-28, far below the noise of any sketch of gradients with a norm of that size or more. A sum
    of more than W workers' tables of near-overflow values can still overflow: :meth:`decode_sum` then
    raises ``OverflowError``. An estimate (the value plus collision noise) beyond the input dtype's range
    saturates at ±its largest value (the true mean lies within that range, so this only moves the
    estimate towards it).

    Hashes: h_j(i) and s_j(i) come from the counter hash ``mix32(i, seed)`` of :mod:`gradpress.rng`
    (h from the high bits by multiply-shift, s from the top bit of a second hash),
    seeded per (step, key, row) from the shared stream, so they cost O(1) per inserted value (no draw
    over the whole tensor) and are identical on every rank; the table is rebuilt from zero every step
    (the authors' code keeps adding into the previous step's table).

    Unbiasedness (Thm 1, E[ĝ] = g): the paper proves it for one row, where ĝ(i) = g(i) + s(i)·Σ_{j≠i,
    h(j)=h(i)} s(j)g(j) is linear and the cross terms have mean zero. For r rows and the median it holds
    too: flipping s_j(i) in every row maps the row estimates g(i) + N_j to g(i) − N_j and leaves their
    joint law unchanged, and the median is equivariant under that reflection, so its law is symmetric
    about g(i). The median of an even r is the mean of the two middle estimates (torch.median's lower
    one would be biased). Both rest on the hashes behaving as independent uniform draws, which the
    counter hash approximates. Hence ``unbiased`` is true when nothing is dropped, ``ratio = 1``.

    ``summable``: the runtime sums the wire tensors and decodes once, which is S2's all-reduce. The
    decode is not linear, though: the bitmap masks to the union of blocks and the median of r > 1
    rows is not additive, so decode(Σ packets) is the S2 estimate of Σ g, not Σ decode(packet); the
    two agree for r ≤ 2 (the mean of two) when every worker marks the same blocks.
    """

    rows: int = param(1, "[1, 64]")
    lam: float = param(0.5, "(0, 64]")
    ratio: float = param(1.0, "(0, 1]")
    block: int = param(0, "[0, 2^20]")  # MAX_BLOCK; 0: one block per row
    summable = True
    linear = False
    examples = ("sketch:lam=2", "sketch:block=4", "sketch:lam=0.25,block=16", "sketch:rows=2,lam=1",
                "sketch:rows=3", "sketch:ratio=0.25,block=8")

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.ratio == 1.0

    def inserted(self, numel: int, size: int) -> int:
        """N = min(numel, K·B): the most values one worker inserts into each row."""
        return min(numel, self.kept_blocks(-(-numel // size)) * size)

    def width(self, numel: int, size: int) -> int:
        """c = ceil(λ · N / r), N = min(numel, K·B): the same on every worker."""
        return max(1, math.ceil(self.lam * self.inserted(numel, size) / self.rows))

    def table_exponent(self, numel: int, size: int, dtype: torch.dtype) -> int:
        """s, the table holding the bucket sums times 2^-s: s = max(0, ⌈log2(N·W)⌉ + 1 + E − 128) for
        N inserted values per row, W = :data:`SUM_WORKERS` and inputs below 2^E in magnitude. Then
        |Σ of W tables| < N·W·2^(E−s) ≤ 2^127 (see the class docstring)."""
        top = math.frexp(torch.finfo(dtype).max)[1]  # every finite value of dtype is below 2^top
        bound = self.inserted(numel, size) * SUM_WORKERS
        return max(0, (bound - 1).bit_length() + 1 + top - 128)

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        size = self.block_size(numel)
        return self.rows * self.width(numel, size) * _TABLE_DTYPE.itemsize + -(-numel // size)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        numel = flat.numel()
        if numel >= 1 << 32:
            raise ValueError(f"sketch: the element hashes take 32-bit indices; {numel} values are too many")
        size, blocks = self._layout(flat)
        marked = self._marked_blocks(blocks)
        seeds = tuple(
            (seed32(ctx.shared_seed(f"sketch/bucket/{j}")), seed32(ctx.shared_seed(f"sketch/sign/{j}")))
            for j in range(self.rows)
        )
        indices = element_indices(marked.nonzero().squeeze(1), size, numel)
        exponent = self.table_exponent(numel, size, flat.dtype)
        values = flat[indices].to(_TABLE_DTYPE)
        if exponent:
            values.mul_(math.ldexp(1.0, -exponent))  # exact, short of float32's subnormal range
        table = insert(indices, values, seeds, self.width(numel, size))
        meta = {"block": size, "seeds": seeds, "exponent": exponent}
        return Packet({"table": table, "bitmap": marked}, flat.shape, flat.dtype, meta)

    def _marked_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Algorithm 1 line 2: C[x] = 1 if block x is non-zero; at most K blocks, the largest."""
        nonzero = nonzero_blocks(blocks)
        kept = self.kept_blocks(blocks.shape[0])
        if kept >= blocks.shape[0] or int(nonzero.sum()) <= kept:
            return nonzero
        marked = torch.zeros_like(nonzero)
        chosen = topk_indices(block_norms(blocks), kept)
        marked[chosen] = nonzero[chosen]
        return marked

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return self._query(packet, 1)

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int) -> torch.Tensor:
        """The S2 estimate of the mean over ``count`` workers from their summed tables and OR-ed bitmaps:
        the median over rows, divided by ``count``, saturated at the input dtype's range, rescaled by
        2^s. Raises ``OverflowError`` if the summed table overflowed float32, which takes more than
        :data:`SUM_WORKERS` workers with values near their dtype's largest (every worker's input is
        checked finite before it is sketched, so a NaN/Inf in the sum can only be an overflow)."""
        if packet.numel == 0:
            return self.decompress(packet)
        bad = count_nonfinite(summed[0].reshape(-1))
        if bad:
            raise OverflowError(
                f"{self.spec}: the sum of {count} workers' sketches overflowed float32 in {bad} of "
                f"{summed[0].numel()} buckets (the table's scale 2^-{packet.meta['exponent']} leaves room "
                f"for {SUM_WORKERS} workers' {packet.dtype} values)")
        return self._query(packet.with_wire(summed), count).to(packet.dtype).view(packet.shape)

    def _query(self, packet: Packet, count: int) -> torch.Tensor:
        """Estimates of the mean of ``count`` workers' values, float32, within the input dtype's range."""
        exponent = packet.meta["exponent"]
        largest = math.ldexp(torch.finfo(packet.dtype).max, -exponent)  # exact: a float32 value scaled
        return query(packet["bitmap"] != 0, packet.meta["block"], packet.numel, packet["table"].float(),
                     packet.meta["seeds"], count, largest, math.ldexp(1.0, exponent))


# -- the sketch's element-wise work: numba on the CPU, torch elsewhere (same bits) -------------------
def nonzero_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Whether each row of ``blocks`` holds a non-zero value (−0.0 counts as zero), as bool."""
    if not use_numba(blocks) or not blocks.is_contiguous():
        return (blocks != 0).any(dim=1)
    out = torch.empty(blocks.shape[0], dtype=torch.bool)
    words = as_numpy(blocks).view(np.int32 if blocks.dtype == torch.float32 else np.int16)
    _nonzero_rows(words, 0x7FFFFFFF if blocks.dtype == torch.float32 else 0x7FFF, as_numpy(out))
    return out


def insert(
    indices: torch.Tensor, values: torch.Tensor, seeds: tuple[tuple[int, int], ...], width: int
) -> torch.Tensor:
    """Algorithm 1 lines 3-7: S[j, h_j(i)] += s_j(i)·g(i) into a zeroed r × c float32 table, values
    added in the order given."""
    table = torch.zeros(len(seeds), width, dtype=_TABLE_DTYPE, device=values.device)
    if use_numba(values):
        _insert(as_numpy(indices), as_numpy(values), np.array(seeds, dtype=np.uint32), as_numpy(table))
        return table
    for j, (bucket_seed, sign_seed) in enumerate(seeds):
        table[j].index_add_(0, _buckets(indices, bucket_seed, width), _signs(indices, sign_seed) * values)
    return table


def query(
    marked: torch.Tensor, size: int, numel: int, table: torch.Tensor, seeds: tuple[tuple[int, int], ...],
    count: int = 1, largest: float = math.inf, scale: float = 1.0,
) -> torch.Tensor:
    """Algorithm 1 lines 9-15: for every value of a marked block, the median over rows of
    s_j(i)·S[j, h_j(i)], divided by ``count``, clamped to ±``largest`` and multiplied by ``scale``
    (float32 operations in that order); zero elsewhere."""
    out = torch.zeros(numel, dtype=torch.float32, device=table.device)
    if use_numba(table):
        table_np, seeds_np = as_numpy(table.contiguous()), np.array(seeds, dtype=np.uint32)
        _query(as_numpy(marked), size, table_np, seeds_np, np.float32(count), np.float32(largest),
               np.float32(scale), as_numpy(out))
        return out
    indices = element_indices(marked.nonzero().squeeze(1), size, numel)
    estimates = torch.stack([
        _signs(indices, sign_seed) * table[j, _buckets(indices, bucket_seed, table.shape[1])]
        for j, (bucket_seed, sign_seed) in enumerate(seeds)
    ])
    mean = median_over_rows(estimates)
    if count != 1:
        mean = mean / torch.tensor(count, dtype=torch.float32, device=mean.device)
    mean = mean.clamp(-largest, largest)
    if scale != 1.0:
        mean = mean * torch.tensor(scale, dtype=torch.float32, device=mean.device)
    out[indices] = mean
    return out


def median_over_rows(estimates: torch.Tensor) -> torch.Tensor:
    """Median along dim 0; for an even count the mean of the two middle values (symmetric, so the
    median of symmetric estimates stays unbiased)."""
    r = estimates.shape[0]
    if r == 1:
        return estimates[0]
    ordered = estimates.sort(dim=0).values
    if r % 2:
        return ordered[r // 2]
    return 0.5 * (ordered[r // 2 - 1] + ordered[r // 2])


def _buckets(indices: torch.Tensor, seed: int, width: int) -> torch.Tensor:
    """h(i) = floor(mix32(i, seed) · c / 2^32), in [0, c)."""
    return (mix32_torch(indices, seed) * width) >> 32


def _signs(indices: torch.Tensor, seed: int) -> torch.Tensor:
    """s(i) = ±1 from the top bit of mix32(i, seed), as float32."""
    return 1.0 - 2.0 * (mix32_torch(indices, seed) >> 31).to(_TABLE_DTYPE)


@jit
def _nonzero_rows(words, mask, out):  # pragma: no cover - compiled
    size = words.shape[1]
    for b in range(words.shape[0]):
        found = False
        for e in range(size):
            if words[b, e] & mask:
                found = True
                break
        out[b] = found


@jit
def _bucket_and_sign(i, seeds, j, width):  # pragma: no cover - compiled
    """h_j(i) = floor(mix32(i, bucket seed) · c / 2^32) and s_j(i) = ±1 from the top bit of
    mix32(i, sign seed), as :func:`_buckets` and :func:`_signs` compute them."""
    bucket = (np.uint64(mix32(i, seeds[j, 0])) * width) >> np.uint64(32)
    sign = np.float32(1.0) - np.float32(2.0) * np.float32(mix32(i, seeds[j, 1]) >> np.uint32(31))
    return bucket, sign


@jit
def _insert(indices, values, seeds, table):  # pragma: no cover - compiled
    width = np.uint64(table.shape[1])
    for j in range(table.shape[0]):
        for k in range(indices.size):
            bucket, sign = _bucket_and_sign(indices[k], seeds, j, width)
            table[j, bucket] += sign * values[k]


@jit
def _query(marked, size, table, seeds, count, largest, scale, out):  # pragma: no cover - compiled
    rows = table.shape[0]
    width = np.uint64(table.shape[1])
    numel = out.size
    estimates = np.empty(rows, dtype=np.float32)
    for b in range(marked.size):
        if not marked[b]:
            continue
        for i in range(b * size, min((b + 1) * size, numel)):
            for j in range(rows):
                bucket, sign = _bucket_and_sign(i, seeds, j, width)
                estimates[j] = sign * table[j, bucket]
            if rows == 1:
                out[i] = _finish(estimates[0], count, largest, scale)
                continue
            for j in range(1, rows):  # insertion sort: r is small
                value = estimates[j]
                k = j - 1
                while k >= 0 and estimates[k] > value:
                    estimates[k + 1] = estimates[k]
                    k -= 1
                estimates[k + 1] = value
            if rows % 2:
                median = estimates[rows // 2]
            else:
                median = np.float32(0.5) * (estimates[rows // 2 - 1] + estimates[rows // 2])
            out[i] = _finish(median, count, largest, scale)


@jit
def _finish(median, count, largest, scale):  # pragma: no cover - compiled
    """(median / count) clamped to ±largest, times scale: :func:`query`'s torch steps, in float32."""
    mean = median / count
    mean = -largest if mean < -largest else mean
    mean = largest if mean > largest else mean
    return mean * scale
