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
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.cpython.unsafe.numbers import trailing_zeros
from numba.extending import intrinsic

from gradpress.compressors.sparsify import keep_count, select_largest, topk_indices
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
from gradpress.kernels.jit import (
    as_numpy,
    bits_of_f32,
    f32_from_bits,
    gather16,
    jit,
    kernel,
    mix32,
    use_numba,
    wide_vectors,
)

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

    The squares of a block are summed pairwise in a fixed order, the block zero-padded to a power of
    two P and halved log2(P) times (first half plus second half), so that the numba kernel
    (:func:`select_blocks`) forms the same bits on the CPU as this function anywhere (a torch
    ``sum(dim=1)`` may add in any order); for one value per block the norm is its square.

    Squares of values beyond 2^64 (fp32, bf16) overflow float32; when a norm comes out infinite, every
    block is first scaled by the same power of two 2^-e, with 2^e > max|x|, so that each square is below
    1 and each sum below B, and ranked by those: the order of blocks whose norms did not overflow is
    kept (scaling by a power of two is exact, short of underflow for blocks below 2^-75 of the largest,
    which then tie)."""
    values = blocks if blocks.dtype == torch.float32 else blocks.float()
    norms = _pairwise_squares(values)
    if norms.numel() and not math.isfinite(float(norms.max())):  # blocks are finite: the squares overflowed
        norms = _pairwise_squares(values * _overflow_scale(float(values.abs().max())))
    return norms


def _overflow_scale(largest: float) -> float:
    """2^-e with 2^e > ``largest`` (max|x|): every scaled square below 1."""
    return math.ldexp(1.0, -math.frexp(largest)[1])


def _pairwise_squares(values: torch.Tensor) -> torch.Tensor:
    """Row sums of ``values``' squares, pairwise: padded to a power of two, then halved (see
    :func:`block_norms`)."""
    squares = values.square()
    width = squares.shape[1]
    padded = 1 << (width - 1).bit_length()
    if padded != width:
        squares = torch.nn.functional.pad(squares, (0, padded - width))
    while squares.shape[1] > 1:
        half = squares.shape[1] // 2
        squares = squares[:, :half] + squares[:, half:]
    return squares[:, 0]


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


# -- block top-K's selection: numba on the CPU, the same blocks as topk_indices(block_norms(...)) ---
_SAMPLE = 16384  # blocks whose norms estimate the K-th largest norm
_CHUNK = 1024  # values block top-K's decode zeroes at a time (then copies the blocks that start there: in L1)


def select_blocks(values: torch.Tensor, size: int, kept: int) -> torch.Tensor:
    """Indices (int64, ascending) of the ``kept`` blocks of ``size`` values of flat float32 ``values``
    with the largest :func:`block_norms`, ties going to the lower block: the blocks of
    ``topk_indices(block_norms(as_blocks(values, size)), kept)``, without a full sort or a norms tensor.

    With many blocks the K-th largest norm is estimated from a strided sample of :data:`_SAMPLE`
    blocks, with about 3 standard deviations of margin (6 on a second try); one pass then forms every
    norm and keeps the blocks at or above the estimate, and an exact partial selection
    (``np.partition``) takes the K largest of those. Every block that ties with the K-th largest is among
    them, so the result is exact whatever the estimate; one that leaves fewer than K candidates, or a
    norm that overflowed float32, sends the caller to all the norms. ``values`` must be finite."""
    numel = values.numel()
    blocks = -(-numel // size)
    if not use_numba(values) or kept >= blocks:
        return topk_indices(block_norms(as_blocks(values, size)), kept)
    x = as_numpy(values)
    squares = np.empty(1 << (size - 1).bit_length(), dtype=np.float32)  # one block, padded
    if blocks >= 2 * _SAMPLE:
        stride = blocks // _SAMPLE
        sample = np.empty(-(-blocks // stride), dtype=np.float32)
        _strided_norms(x, size, stride, np.float32(1.0), squares, sample)
        if np.isfinite(sample.max()):
            expected = kept / stride
            positions = np.empty(blocks, dtype=np.int64)  # pages are only touched up to the count found
            norms = np.empty(blocks, dtype=np.float32)
            for margin in (3.0, 6.0):
                want = min(sample.size, math.ceil(1.05 * expected + margin * math.sqrt(expected) + 8))
                threshold = np.partition(sample, sample.size - want)[sample.size - want]
                if threshold <= 0:
                    break
                found = _collect_norms(x, size, threshold, squares, positions, norms)
                if not np.isfinite(norms[:found].max(initial=0)):
                    break  # an overflow: all norms, scaled
                if found >= kept:
                    return torch.from_numpy(_keep_top(norms[:found], positions[:found], kept))
    norms = np.empty(blocks, dtype=np.float32)
    _strided_norms(x, size, 1, np.float32(1.0), squares, norms)
    if not np.isfinite(norms.max()):  # finite values whose squares overflowed: as block_norms scales them
        scale = np.float32(_overflow_scale(float(values.abs().max())))
        _strided_norms(x, size, 1, scale, squares, norms)
    positions = np.arange(blocks, dtype=np.int64)
    return torch.from_numpy(_keep_top(norms, positions, kept))


def gather_blocks(flat: torch.Tensor, chosen: torch.Tensor, size: int) -> torch.Tensor:
    """``as_blocks(flat, size)[chosen]``: the chosen blocks as [K, size] in ``flat``'s dtype, the last
    one zero-padded, by contiguous copies (CPU, numba)."""
    out = torch.empty(chosen.numel(), size, dtype=flat.dtype)
    bits = np.uint32 if flat.dtype == torch.float32 else np.uint16
    _gather_blocks(as_numpy(flat).view(bits), size, as_numpy(chosen), as_numpy(out).view(bits).reshape(-1))
    return out


@kernel(inline="always")
def _block_norm(x, lo, hi, scale, squares):  # pragma: no cover - compiled
    """:func:`block_norms` of x[lo:hi] times ``scale``: squares, zero-padded to ``squares.size`` (a power
    of two), halved pairwise."""
    if squares.size == 1:
        v = x[lo] * scale
        return v * v
    block = x[lo:hi]  # loops from 0 over views: no negative-index wraparound, so they vectorize
    for e in range(block.size):
        v = block[e] * scale
        squares[e] = v * v
    for e in range(block.size, squares.size):
        squares[e] = np.float32(0.0)
    half = squares.size // 2
    while half:
        for e in range(half):
            squares[e] += squares[e + half]
        half //= 2
    return squares[0]


@jit
def _strided_norms(x, size, stride, scale, squares, out):  # pragma: no cover - compiled
    """out[j] = the norm of block j·stride."""
    numel = x.size
    for j in range(out.size):
        lo = j * stride * size
        out[j] = _block_norm(x, lo, min(lo + size, numel), scale, squares)


@jit
def _collect_norms(x, size, threshold, squares, positions, norms):  # pragma: no cover - compiled
    """The blocks whose norm is at least ``threshold``, ascending, and their norms; how many."""
    numel = x.size
    found = 0
    if size == 1:  # 64 squares compared at a time into a bit mask (vectorized), then its set bits
        wide_vectors()
        whole = numel - numel % 64
        for start in range(0, whole, 64):
            mask = np.uint64(0)
            for k in range(64):
                v = x[start + k]
                mask |= np.uint64(v * v >= threshold) << np.uint64(k)
            while mask:
                i = start + trailing_zeros(mask)
                positions[found] = i
                norms[found] = x[i] * x[i]
                found += 1
                mask &= mask - np.uint64(1)
        for i in range(whole, numel):
            v = x[i] * x[i]
            positions[found] = i  # written always, kept if v qualifies
            norms[found] = v
            found += v >= threshold
        return found
    for b in range(positions.size):
        lo = b * size
        v = _block_norm(x, lo, min(lo + size, numel), np.float32(1.0), squares)
        if v >= threshold:
            positions[found] = b
            norms[found] = v
            found += 1
    return found


@jit
def _keep_top(norms, positions, kept):  # pragma: no cover - compiled
    """The ``kept`` positions of largest norm (ties: the earlier ones), in the given (ascending) order."""
    out = np.empty(kept, dtype=np.int64)
    select_largest(norms, positions, kept, out)
    return out


@jit
def _gather_blocks(bits, size, chosen, out):  # pragma: no cover - compiled
    if size == 1:
        for j in range(chosen.size):
            out[j] = bits[chosen[j]]
        return
    for j in range(chosen.size):
        lo = chosen[j] * size
        block, into = bits[lo:lo + size], out[j * size:(j + 1) * size]
        for e in range(block.size):
            into[e] = block[e]
        for e in range(block.size, size):
            into[e] = 0


@jit
def _scatter_blocks(values, size, indices, out):  # pragma: no cover - compiled
    """The dense vector of block top-K's packet: the blocks at ``indices`` (ascending), zeros between,
    written _CHUNK values at a time (zeroed, then the blocks that start there copied in, all in L1);
    False (``out`` then unusable) if the indices are not ascending or out of range."""
    numel = out.size
    done = 0  # out[:done] is final
    j = 0
    for lo in range(0, numel, _CHUNK):
        hi = min(lo + _CHUNK, numel)
        zeros = out[max(lo, done):hi]
        for e in range(zeros.size):
            zeros[e] = np.float32(0.0)
        while j < indices.size:
            start = np.int64(indices[j]) * size
            if start >= hi:
                break
            if start < done:
                return False
            if size == 1:
                out[start] = values[j]
                done = start + 1
            else:
                into, block = out[start:start + size], values[j * size:(j + 1) * size]
                for e in range(into.size):
                    into[e] = block[e]
                done = start + into.size
            j += 1
        done = max(done, hi)
    return j == indices.size


# -- the sketch's element-wise work: numba on the CPU, torch elsewhere (same bits) -------------------
_MAX_WIDTH = 1 << 32  # the kernels keep bucket numbers in uint32
_HASHED = 16384  # values the sketch kernels hash at a time (their bucket buffers stay in L2)
_AHEAD = 128  # the insert prefetches the table entry it will update this many values later


def _prefetch(write: int):  # noqa: ANN202
    """An intrinsic ``prefetch(array, index)``: a hint that ``array[index]`` will be read (``write`` 0)
    or written (1) soon (``llvm.prefetch``, kept in all cache levels). Changes no result.

    A table larger than L2 takes one random update per inserted value; the out-of-order window overlaps
    only a few of their cache misses, and prefetches issued :data:`_AHEAD` values earlier overlap more
    (2^22 values into 2^21 buckets, CPU time, median of 7: 8.8–11.6 ms without, 8.2–8.7 ms with;
    32 or 512 values ahead were slower). The query's gathers gained nothing from them."""

    @intrinsic
    def prefetch(typingctx, array, index):  # pragma: no cover - compiled
        if not isinstance(array, types.Array) or not isinstance(index, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            offset = args[1]
            if signature.args[1].bitwidth < 64:
                widen = builder.sext if signature.args[1].signed else builder.zext
                offset = widen(offset, ir.IntType(64))
            pointer = builder.bitcast(builder.gep(data, [offset]), ir.IntType(8).as_pointer())
            i32 = ir.IntType(32)
            signature_ir = ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, signature_ir, "llvm.prefetch.p0i8")
            builder.call(fn, [pointer, ir.Constant(i32, write), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    return prefetch


_prefetch_for_write = _prefetch(1)


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


@kernel(inline="always")
def _bucket(hashed, width):  # pragma: no cover - compiled
    """h(i) from hashed = mix32(i, seed), as :func:`_buckets` computes it: the low 31 bits, shifted to
    the top, times c, the high half of the product; as uint32."""
    return np.uint32((np.uint64(np.uint32(hashed << np.uint32(1))) * width) >> np.uint64(32))


@kernel(inline="always")
def _signed(value, hashed):  # pragma: no cover - compiled
    """s(i)·value for s(i) = ±1 from the top bit of hashed = mix32(i, seed), the product's bits: a
    multiplication by ±1 is exact and only sets the sign bit (``value`` is not NaN), so that bit is
    XOR-ed into value's."""
    return f32_from_bits(bits_of_f32(value) ^ (hashed & np.uint32(0x80000000)))


@jit
def _insert(indices, values, seeds, table):  # pragma: no cover - compiled
    """:func:`insert`'s kernel: the given values at the given indices, in order."""
    width = np.uint64(table.shape[1])
    for j in range(table.shape[0]):
        for k in range(indices.size):
            hashed = mix32(indices[k], seeds[j])
            table[j, _bucket(hashed, width)] += _signed(values[k], hashed)


@kernel(inline="always")
def _count(flags):  # pragma: no cover - compiled
    """How many of the uint8 ``flags`` are set (each 0 or 1)."""
    total = 0
    for b in range(flags.size):
        total += flags[b]
    return total


@kernel(inline="always")
def _find_nonzero(words, size, first, end, flags):  # pragma: no cover - compiled
    """flags[b] = whether block b (of ``size`` float32 values, as bits) holds a non-zero value (−0.0 and
    +0.0 are zero), for blocks first..end-1; how many do."""
    numel = words.size
    found = 0
    mask = np.uint32(0x7FFFFFFF)
    if size == 1:
        block, into = words[first:end], flags[first:end]
        for b in range(block.size):
            nonzero = (block[b] & mask) != np.uint32(0)
            into[b] = nonzero
            found += nonzero
        return found
    for b in range(first, end):
        block = words[b * size:min((b + 1) * size, numel)]
        nonzero = False
        for start in range(0, block.size, 16):  # 16 at a time: the inner loop vectorizes
            part = block[start:start + 16]
            seen = np.uint32(0)
            for i in range(part.size):
                seen |= part[i] & mask
            if seen:
                nonzero = True
                break
        flags[b] = nonzero
        found += nonzero
    return found


@jit
def _sketch_insert(values, size, flags, find, seeds, scale, table):  # pragma: no cover - compiled
    """Algorithm 1 lines 2-7 for the blocks flagged in ``flags`` (or, with ``find``, for the non-zero
    blocks, which it flags): S[j, h_j(i)] += s_j(i)·(g(i)·scale), values in ascending index order, as
    :func:`insert` adds them. Blocks are visited _HASHED values at a time: flagged, then hashed (one
    hash per value and row, a vectorized loop into L2-resident buffers), then added (a scalar loop of
    random updates, each prefetched _AHEAD values earlier). Returns how many of the inserted values are
    NaN/Inf."""
    rows = table.shape[0]
    width = np.uint64(table.shape[1])
    words = values.view(np.uint32)
    numel = values.size
    blocks = flags.size
    group = max(1, _HASHED // size)
    buckets = np.empty((rows, _HASHED), dtype=np.uint32)
    signed = np.empty((rows, _HASHED), dtype=np.float32)
    bad = 0
    for first in range(0, blocks, group):
        end = min(first + group, blocks)
        if find:
            flagged = _find_nonzero(words, size, first, end, flags)
        else:
            flagged = _count(flags[first:end])
        if flagged == end - first:
            bad += _insert_range(values, first * size, min(end * size, numel), seeds, scale, table, width,
                                 buckets, signed)
            continue
        b = first
        while flagged and b < end:
            if not flags[b]:
                b += 1
                continue
            run = b + 1
            while run < end and flags[run]:
                run += 1
            bad += _insert_range(values, b * size, min(run * size, numel), seeds, scale, table, width,
                                 buckets, signed)
            b = run
    return bad


@kernel(inline="always")
def _insert_range(values, lo, hi, seeds, scale, table, width, buckets, signed):  # pragma: no cover - compiled
    rows = table.shape[0]
    bad = 0
    for start in range(lo, hi, _HASHED):
        count = min(_HASHED, hi - start)
        chunk = values[start:start + count]
        bad += _hash_values(chunk, start, seeds, scale, width, buckets, signed)
        for j in range(rows):
            row = table[j]
            for k in range(count):
                if k + _AHEAD < count:
                    _prefetch_for_write(row, buckets[j, k + _AHEAD])
                row[buckets[j, k]] += signed[j, k]
    return bad


@kernel(inline="always")
def _hash_values(chunk, start, seeds, scale, width, buckets, signed):  # pragma: no cover - compiled
    """buckets[j, k] = h_j(i), signed[j, k] = s_j(i)·(g(i)·scale) for i = start + k (vectorized); how
    many of the chunk's values are NaN/Inf (their exponent bits all ones)."""
    wide_vectors()
    words = chunk.view(np.uint32)
    bad = 0
    for k in range(chunk.size):
        hashed = mix32(start + k, seeds[0])
        buckets[0, k] = _bucket(hashed, width)
        signed[0, k] = _signed(chunk[k] * scale, hashed)
        bad += (words[k] & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    for j in range(1, buckets.shape[0]):
        seed = seeds[j]
        for k in range(chunk.size):
            hashed = mix32(start + k, seed)
            buckets[j, k] = _bucket(hashed, width)
            signed[j, k] = _signed(chunk[k] * scale, hashed)
    return bad


@jit
def _sketch_query(flags, size, table, seeds, finish, out):  # pragma: no cover - compiled
    """Algorithm 1 lines 9-15: every value of a flagged block gets :func:`query`'s estimate, every other
    value 0 (``out`` need not be zeroed). _HASHED values at a time: their buckets and signs (one hash
    each, vectorized), the table entries (16-lane gathers), the signs applied, the median over rows by a
    stable sorting network (r ≤ 5) and the division, clamp and scale (vectorized). ``finish`` = (count,
    1/count if that is a power of two else 0, largest, scale)."""
    rows = table.shape[0]
    width = np.uint64(table.shape[1])
    numel = out.size
    blocks = flags.size
    group = max(1, _HASHED // size)
    buckets = np.empty((rows, _HASHED), dtype=np.uint32)
    estimates = np.empty((rows, _HASHED), dtype=np.float32)
    signs = np.empty(_HASHED, dtype=np.uint32)
    for first in range(0, blocks, group):
        end = min(first + group, blocks)
        flagged = _count(flags[first:end])
        lo, hi = first * size, min(end * size, numel)
        if flagged == end - first:
            _query_range(lo, hi, table, seeds, finish, width, buckets, estimates, signs, out)
            continue
        zeros = out[lo:hi]
        for i in range(zeros.size):
            zeros[i] = np.float32(0.0)
        b = first
        while flagged and b < end:
            if not flags[b]:
                b += 1
                continue
            run = b + 1
            while run < end and flags[run]:
                run += 1
            stop = min(run * size, numel)
            _query_range(b * size, stop, table, seeds, finish, width, buckets, estimates, signs, out)
            b = run


@kernel(inline="always")
def _query_range(lo, hi, table, seeds, finish, width, buckets, estimates, signs, out):  # pragma: no cover
    """out[lo:hi] = the estimates of values lo..hi-1, ``finish`` = (count, 1/count or 0, largest, scale)."""
    count, inverse, largest, scale = finish
    rows = table.shape[0]
    if rows == 1:  # 64 values at a time, hashed, gathered and finished in one loop (hashing overlaps gathers)
        row, seed = table[0], seeds[0]
        numbers, hashes, found = buckets[0, :64], signs[:64], estimates[0, :64]
        whole = hi - (hi - lo) % 64
        for start in range(lo, whole, 64):
            for t in range(64):
                hashed = mix32(start + t, seed)
                numbers[t] = _bucket(hashed, width)
                hashes[t] = hashed
            for t in range(0, 64, 16):
                gather16(row, numbers, found, t)
            into = out[start:start + 64]
            if inverse:
                for t in range(64):
                    into[t] = _clamped(_signed(found[t], hashes[t]) * inverse, largest, scale)
            else:
                for t in range(64):
                    into[t] = _clamped(_signed(found[t], hashes[t]) / count, largest, scale)
        lo = whole
    for start in range(lo, hi, _HASHED):
        m = min(_HASHED, hi - start)
        into = out[start:start + m]
        for j in range(rows):
            found = into if rows == 1 else estimates[j, :m]  # one row: its estimates are the medians
            _bucket_numbers(start, seeds[j], width, buckets[j, :m], signs[:m])
            _load(table[j], buckets[j, :m], found)
            _apply_signs(signs[:m], found)
        if rows == 2:
            _median_two(estimates, into)
        elif rows == 3:
            _median_three(estimates, into)
        elif rows == 4:
            _median_four(estimates, into)
        elif rows == 5:
            _median_five(estimates, into)
        elif rows > 5:
            _median_sorted(estimates, into)
        if inverse:
            _finish_multiplying(into, inverse, largest, scale)
        else:
            _finish_dividing(into, count, largest, scale)


@kernel(inline="always")
def _load(row, numbers, found):  # pragma: no cover - compiled
    """found[k] = row[numbers[k]], 16 at a time by vector gathers (prefetches measured no faster here:
    the table was read by the previous query or written by the insert)."""
    m = numbers.size
    whole = m - m % 16
    for k in range(0, whole, 16):
        gather16(row, numbers, found, k)
    for k in range(whole, m):
        found[k] = row[numbers[k]]


@kernel(inline="always")
def _bucket_numbers(start, seed, width, buckets, signs):  # pragma: no cover - compiled
    """buckets[k] = h(i) and signs[k] = the hash with s(i) in its top bit, for i = start + k: one hash
    each (vectorized)."""
    wide_vectors()
    for k in range(buckets.size):
        hashed = mix32(start + k, seed)
        buckets[k] = _bucket(hashed, width)
        signs[k] = hashed


@kernel(inline="always")
def _apply_signs(signs, estimates):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(estimates.size):
        estimates[k] = _signed(estimates[k], signs[k])


@kernel(inline="always")
def _ordered(a, b):  # pragma: no cover - compiled
    """A stable compare-exchange: (b, a) if a > b, else (a, b) (equal values, +0 and −0 among them, keep
    their order, as an insertion sort keeps it)."""
    swap = a > b
    return (b if swap else a), (a if swap else b)


@kernel(inline="always")
def _clamped(mean, largest, scale):  # pragma: no cover - compiled
    mean = -largest if mean < -largest else mean
    mean = largest if mean > largest else mean
    return mean * scale


@kernel(inline="always")
def _finish_dividing(out, count, largest, scale):  # pragma: no cover - compiled
    """out = (median / count) clamped to ±largest, times scale: :func:`query`'s torch steps, in float32."""
    wide_vectors()
    for k in range(out.size):
        out[k] = _clamped(out[k] / count, largest, scale)


@kernel(inline="always")
def _finish_multiplying(out, inverse, largest, scale):  # pragma: no cover - compiled
    """:func:`_finish_dividing` for a power-of-two count, ``inverse`` = 1/count: x·inverse is x/count (both
    the correctly rounded quotient), and a product is cheaper than a division."""
    wide_vectors()
    for k in range(out.size):
        out[k] = _clamped(out[k] * inverse, largest, scale)


@kernel(inline="always")
def _median_two(estimates, out):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(out.size):  # the mean of the two (an addition commutes: their order does not matter)
        out[k] = np.float32(0.5) * (estimates[0, k] + estimates[1, k])


@kernel(inline="always")
def _median_three(estimates, out):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(out.size):  # odd-even transposition: (0,1) (1,2) (0,1)
        e0, e1 = _ordered(estimates[0, k], estimates[1, k])
        e1, e2 = _ordered(e1, estimates[2, k])
        e0, e1 = _ordered(e0, e1)
        out[k] = e1


@kernel(inline="always")
def _median_four(estimates, out):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(out.size):  # odd-even transposition, 4 rounds: (0,1)(2,3) (1,2) (0,1)(2,3) (1,2)
        e0, e1 = _ordered(estimates[0, k], estimates[1, k])
        e2, e3 = _ordered(estimates[2, k], estimates[3, k])
        e1, e2 = _ordered(e1, e2)
        e0, e1 = _ordered(e0, e1)
        e2, e3 = _ordered(e2, e3)
        e1, e2 = _ordered(e1, e2)
        out[k] = np.float32(0.5) * (e1 + e2)


@kernel(inline="always")
def _median_five(estimates, out):  # pragma: no cover - compiled
    wide_vectors()
    for k in range(out.size):  # odd-even transposition, 5 rounds: (0,1)(2,3) (1,2)(3,4) ×2, then (0,1)(2,3)
        e0, e1 = _ordered(estimates[0, k], estimates[1, k])
        e2, e3 = _ordered(estimates[2, k], estimates[3, k])
        e4 = estimates[4, k]
        e1, e2 = _ordered(e1, e2)
        e3, e4 = _ordered(e3, e4)
        e0, e1 = _ordered(e0, e1)
        e2, e3 = _ordered(e2, e3)
        e1, e2 = _ordered(e1, e2)
        e3, e4 = _ordered(e3, e4)
        e0, e1 = _ordered(e0, e1)
        e2, e3 = _ordered(e2, e3)
        out[k] = e2


@kernel(inline="always")
def _median_sorted(estimates, out):  # pragma: no cover - compiled
    rows = estimates.shape[0]
    column = np.empty(rows, dtype=np.float32)
    for k in range(out.size):
        for j in range(rows):  # insertion sort: stable, r is small
            value = estimates[j, k]
            i = j - 1
            while i >= 0 and column[i] > value:
                column[i + 1] = column[i]
                i -= 1
            column[i + 1] = value
        if rows % 2:
            out[k] = column[rows // 2]
        else:
            out[k] = np.float32(0.5) * (column[rows // 2 - 1] + column[rows // 2])
