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

Here: the methods and the count-sketch's insert and query (the torch path, and the dispatch to numba);
the block layout and block top-K's selection are in :mod:`gradpress.compressors.sketch_blocks`, the
count-sketch's numba kernels in :mod:`gradpress.compressors.sketch_kernels`.
"""
from __future__ import annotations

import math
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradpress.compressors.selection import topk_indices
from gradpress.compressors.sketch_blocks import (
    _scatter_blocks,
    as_blocks,
    block_norms,
    element_indices,
    gather_blocks,
    select_blocks,
)
from gradpress.compressors.sketch_kernels import (
    _MAX_WIDTH,
    _find_nonzero,
    _insert,
    _nonzero_rows,
    _sketch_insert,
    _sketch_query,
)
from gradpress.compressors.sparsify import keep_count
from gradpress.core.compressor import (
    Compressor,
    check_finite,
    count_nonfinite,
    divide,
    float32_output,
    nonfinite_error,
    register,
)
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context, mix32_torch, seed32
from gradpress.kernels.jit import as_numpy, use_numba

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

    On the CPU (numba) one pass forms the block norms and keeps the candidates above a threshold
    estimated from a sample, a partial selection takes the exact K largest (:func:`select_blocks`), and
    the blocks are copied out whole; the decode writes the dense vector in one pass, zeros and blocks.
    Both give the bits of the torch path (:func:`block_norms`, ``topk_indices``).
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
        return kept * (size * dtype.itemsize + 4)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        size = self.block_size(flat.numel(), _ROWS.get())
        blocks = -(-flat.numel() // size)
        kept = self.kept_blocks(blocks)
        meta = {"block": size}
        if use_numba(flat) and kept < blocks:
            # one pass for the norms and the candidates, a partial selection, contiguous block copies
            chosen = select_blocks(flat if flat.dtype == torch.float32 else flat.float(), size, kept)
            values = gather_blocks(flat, chosen, size)
        else:
            padded = as_blocks(flat, size)
            chosen = topk_indices(block_norms(padded), kept)
            values = padded[chosen]
        return Packet({"values": values, "indices": chosen.to(torch.int32)}, flat.shape, flat.dtype, meta)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        size, numel = packet.meta["block"], packet.numel
        values, indices = packet["values"].float().reshape(-1, size), packet["indices"]
        if use_numba(values):
            dense = torch.empty(numel, dtype=torch.float32)
            flat = as_numpy(values.contiguous()).reshape(-1)
            if _scatter_blocks(flat, size, as_numpy(indices.contiguous()), as_numpy(dense)):
                return dense
        dense = torch.zeros(-(-numel // size), size, dtype=torch.float32, device=packet.device)
        dense[indices.long()] = values
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

    Hashes: h_j(i) and s_j(i) come from one counter hash per value and row, ``mix32(i, seed_j)`` of
    :mod:`gradpress.core.rng`, seeded per (step, key, row) from the shared stream: h_j(i) from its low 31
    bits by multiply-shift, floor(m·c / 2^31), s_j(i) from its top bit, so the sign is independent of
    the bucket (disjoint bits). They cost O(1) per inserted value (no draw over the whole tensor) and
    are identical on every rank; the table is rebuilt from zero every step (the authors' code keeps
    adding into the previous step's table). (Before 2026-11-25 the sign came from a second hash, and h
    from all 32 bits: the wire's bits changed then, not its layout or its statistics.)

    Speed (CPU, numba): compress is one pass that marks the non-zero blocks and inserts their values
    (hashes vectorized a chunk at a time, then the random table updates, each prefetched a little
    earlier), decode one pass of hashes, 16-lane table gathers, a stable sorting network for the
    median of r ≤ 5 rows and the division, clamp and scale; both give the torch path's bits.

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
    checks_finite = True  # the numba pass that inserts every sent value counts NaN/Inf; else checked
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
        size = self.block_size(numel, _ROWS.get())
        seeds = tuple(seed32(ctx.shared_seed(f"sketch/bucket/{j}")) for j in range(self.rows))
        exponent = self.table_exponent(numel, size, flat.dtype)
        width = self.width(numel, size)
        meta = {"block": size, "seeds": seeds, "exponent": exponent}
        if use_numba(flat) and width <= _MAX_WIDTH:
            table, marked = self._sketch_numba(flat, size, seeds, exponent, width)
            return Packet({"table": table, "bitmap": marked}, flat.shape, flat.dtype, meta)
        check_finite(flat, self.spec)
        blocks = as_blocks(flat, size)
        marked = self._marked_blocks(blocks)
        indices = element_indices(marked.nonzero().squeeze(1), size, numel)
        values = flat[indices].to(_TABLE_DTYPE)
        if exponent:
            values.mul_(math.ldexp(1.0, -exponent))  # exact, short of float32's subnormal range
        table = insert(indices, values, seeds, width)
        return Packet({"table": table, "bitmap": marked}, flat.shape, flat.dtype, meta)

    def _sketch_numba(
        self, flat: torch.Tensor, size: int, seeds: tuple[int, ...], exponent: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Algorithm 1 lines 2-7 on the CPU, the same bits as the torch path: with ``ratio = 1`` one pass
        marks the non-zero blocks, inserts their values and counts NaN/Inf (the input's only check);
        below 1 the input is checked, the K largest blocks chosen (:func:`select_blocks`), then inserted.

        The table is allocated by numpy, which backs arrays of 4 MB and more with transparent huge
        pages where the kernel allows: its random updates then miss no TLB."""
        values = flat if flat.dtype == torch.float32 else flat.float()  # exact; zeros stay zeros
        blocks = -(-flat.numel() // size)
        kept = self.kept_blocks(blocks)
        marked = torch.empty(blocks, dtype=torch.bool)
        table = torch.from_numpy(np.zeros((self.rows, width), dtype=np.float32))
        seeds_np = np.array(seeds, dtype=np.uint32)
        scale = np.float32(math.ldexp(1.0, -exponent))
        x, flags = as_numpy(values), as_numpy(marked).view(np.uint8)
        if kept >= blocks:  # every non-zero block is sent: find them while inserting
            bad = _sketch_insert(x, size, flags, True, seeds_np, scale, as_numpy(table))
            if bad:
                raise nonfinite_error(self.spec, bad, flat.numel())
            return table, marked
        check_finite(flat, self.spec)
        if _find_nonzero(x.view(np.uint32), size, 0, blocks, flags) > kept:
            chosen = select_blocks(values, size, kept)
            top = torch.zeros_like(marked)
            top[chosen] = marked[chosen]
            marked = top
        _sketch_insert(x, size, as_numpy(marked).view(np.uint8), False, seeds_np, scale, as_numpy(table))
        return table, marked

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

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The S2 estimate of the mean over ``count`` workers from their summed tables and OR-ed bitmaps:
        the median over rows, divided by ``count``, saturated at the input dtype's range, rescaled by
        2^s; into ``out`` where it can take it (see :meth:`Compressor.decode_sum`). Raises
        ``OverflowError`` if the summed table overflowed float32, which takes more than
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
        into = float32_output(out, packet.numel)
        return self._query(packet.with_wire(summed), count, into).to(packet.dtype).view(packet.shape)

    def _query(self, packet: Packet, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Estimates of the mean of ``count`` workers' values, float32, within the input dtype's range
        (the numba kernel's into ``out``, if given)."""
        exponent = packet.meta["exponent"]
        largest = math.ldexp(torch.finfo(packet.dtype).max, -exponent)  # exact: a float32 value scaled
        bitmap = packet["bitmap"]
        marked = bitmap if bitmap.dtype == torch.bool else bitmap != 0
        table, seeds = packet["table"].float(), packet.meta["seeds"]
        return query(marked, packet.meta["block"], packet.numel, table, seeds, count, largest,
                     math.ldexp(1.0, exponent), out)


# -- the count-sketch's insert and query: numba on the CPU (sketch_kernels), torch elsewhere (same bits) ---
def nonzero_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """Whether each row of ``blocks`` holds a non-zero value (−0.0 counts as zero), as bool."""
    if not use_numba(blocks) or not blocks.is_contiguous():
        return (blocks != 0).any(dim=1)
    out = torch.empty(blocks.shape[0], dtype=torch.bool)
    words = as_numpy(blocks).view(np.int32 if blocks.dtype == torch.float32 else np.int16)
    _nonzero_rows(words, 0x7FFFFFFF if blocks.dtype == torch.float32 else 0x7FFF, as_numpy(out))
    return out


def insert(
    indices: torch.Tensor, values: torch.Tensor, seeds: tuple[int, ...], width: int
) -> torch.Tensor:
    """Algorithm 1 lines 3-7: S[j, h_j(i)] += s_j(i)·g(i) into a zeroed r × c float32 table, values
    added in the order given (the compressor's numba path, :func:`_sketch_insert`, adds the same values
    in the same order, ascending index)."""
    table = torch.zeros(len(seeds), width, dtype=_TABLE_DTYPE, device=values.device)
    if use_numba(values):
        _insert(as_numpy(indices), as_numpy(values), np.array(seeds, dtype=np.uint32), as_numpy(table))
        return table
    for j, seed in enumerate(seeds):
        table[j].index_add_(0, _buckets(indices, seed, width), _signs(indices, seed) * values)
    return table


def query(
    marked: torch.Tensor, size: int, numel: int, table: torch.Tensor, seeds: tuple[int, ...],
    count: int = 1, largest: float = math.inf, scale: float = 1.0, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Algorithm 1 lines 9-15: for every value of a marked block, the median over rows of
    s_j(i)·S[j, h_j(i)], divided by ``count``, clamped to ±``largest`` and multiplied by ``scale``
    (float32 operations in that order); zero elsewhere. ``marked``: one bool per block. ``out``: a flat
    float32 tensor of ``numel`` values on the table's device that the result is written into (else a new
    one), by the numba kernel and the torch path alike."""
    if use_numba(table) and table.shape[1] <= _MAX_WIDTH:
        out = torch.empty(numel, dtype=torch.float32) if out is None else out
        table_np, seeds_np = as_numpy(table.contiguous()), np.array(seeds, dtype=np.uint32)
        inverse = 1 / count if count & (count - 1) == 0 else 0.0
        flags = as_numpy(marked.contiguous()).view(np.uint8)
        finish = (np.float32(count), np.float32(inverse), np.float32(largest), np.float32(scale))
        _sketch_query(flags, size, table_np, seeds_np, finish, as_numpy(out))
        return out
    out = torch.zeros(numel, dtype=torch.float32, device=table.device) if out is None else out.zero_()
    indices = element_indices(marked.nonzero().squeeze(1), size, numel)
    estimates = torch.stack([
        _signs(indices, seed) * table[j, _buckets(indices, seed, table.shape[1])]
        for j, seed in enumerate(seeds)
    ])
    mean = median_over_rows(estimates)
    if count != 1:
        mean = divide(mean, count)
    mean = mean.clamp(-largest, largest)
    if scale != 1.0:
        mean = mean * scale  # (a number is rounded to the float32 operand's type first)
    out[indices] = mean
    return out


def median_over_rows(estimates: torch.Tensor) -> torch.Tensor:
    """Median along dim 0; for an even count the mean of the two middle values (symmetric, so the
    median of symmetric estimates stays unbiased). The sort is stable, as the numba kernel's sorting
    networks are, so that +0 and −0 estimates (equal, different bits) take the same places."""
    r = estimates.shape[0]
    if r == 1:
        return estimates[0]
    ordered = estimates.sort(dim=0, stable=True).values
    if r % 2:
        return ordered[r // 2]
    return 0.5 * (ordered[r // 2 - 1] + ordered[r // 2])


def _buckets(indices: torch.Tensor, seed: int, width: int) -> torch.Tensor:
    """h(i) = floor(m · c / 2^31) for the low 31 bits m of mix32(i, seed): in [0, c)."""
    return ((mix32_torch(indices, seed) & 0x7FFFFFFF) * width) >> 31


def _signs(indices: torch.Tensor, seed: int) -> torch.Tensor:
    """s(i) = ±1 from the top bit of the same mix32(i, seed) (independent of h(i)'s bits), as float32."""
    return 1.0 - 2.0 * (mix32_torch(indices, seed) >> 31).to(_TABLE_DTYPE)
