"""THC: Tensor Homomorphic Compression (Li et al., NSDI'24): ``thc_uniform`` (Algorithm 1) and ``thc``
(Algorithm 3, whose main stage is Algorithm 2).

Both quantize every worker's values onto one grid that the workers agree on in a light preliminary
exchange, so an aggregator (all-reduce, parameter server or switch) only adds integers and the sum
decodes once into the mean (Definitions 2 and 3, "uniform homomorphic compression"):

    (1/n) · Σ_i D(T(C(∇_i)))  =  D((1/n) · Σ_i T(C(∇_i))),   D(Y) = m + Y · (M − m)/g.

* ``thc_uniform`` (Section 4.2, Algorithm 1): the preliminary stage is the global minimum m and maximum
  M (lines 1-4: every worker sends (−m_i, M_i), combined by max); values are stochastically rounded to
  the 2^b uniformly spaced points m + k·(M − m)/(2^b − 1) (line 5); the wire holds the b-bit codes k,
  which are also what the aggregator adds (lines 7-8; ``max_summand`` = 2^b − 1); decoding is line 9,
  m + (X/n)·(M − m)/(2^b − 1). Unbiased; no error feedback.
* ``thc`` (Sections 5.1-5.3, Algorithm 3): the randomized Hadamard transform R = H·D·x/√d
  (:mod:`gradpress.kernels.hadamard`: partitions of at most ``partition`` values, each zero-padded to a power of
  two, the ±1 diagonal D from the stream shared by every worker per (step, key)); the preliminary max of
  the workers' L2 norms ℓ (lines 6-8); M = t_p·ℓ/√d, m = −M, t_p = Φ⁻¹(1 − p/2) (line 11), with d the
  number of transformed coordinates (the padded length, so that ℓ/√d is exactly their root mean
  square); truncation to [−M, M] (line 12); stochastic quantization onto the grid m + i·(M − m)/g
  restricted to the lookup table's values T[z] (lines 13-14, Algorithm 2 lines 1-4); the b-bit table
  indices z on the wire (line 15). The aggregator looks up T[z] ∈ {0..g} and adds (line 17,
  ``max_summand`` = g); decoding divides by the count, maps back (lines 18-19) and inverts the
  transform (line 20). The table is :func:`gradpress.compressors.thc_table`'s default (the paper's App. B solver
  restricted to tables symmetric under T ↦ g − T), which reproduces the authors' published tables,
  e.g. (b, g, p) = (4, 30, 1/32) → 0,3,5,7,9,11,13,14,16,17,19,21,23,25,27,30; the spec key
  ``symmetric=false`` takes the unrestricted optimum instead (never worse; much better for some even
  g, where the reflection excludes the midpoint g/2).
  Truncation biases ``thc``, so its default feedback is ``residual``: Algorithm 3 line 21 sets
  e_i ← x_i − RHT⁻¹(X_i), X_i this worker's own truncated and quantized vector — exactly what the
  runtime's residual memory stores, x minus the decompression of the worker's own packet (it keeps
  the rounding noise as well as the truncation error, as line 21 does).

Rounding noise comes from the *private* stream (the counter hash of :mod:`gradpress.core.rng`), so the
workers' errors are independent and the error of the mean falls as 1/n; the authors' code draws it
from a seed shared by all workers, which correlates the errors (a defect we do not copy).

Wire and downstream cost (per coordinate): upstream, ``Packet.nbytes`` = ⌈b·c/8⌉ bytes for c coded
coordinates (``thc``: c is the padded length, up to 2× the tensor's for sizes just past a power of two;
``thc_uniform``: c = numel). Downstream, a sum of n table values needs ⌈log2(g·n + 1)⌉ bits
(:meth:`THC.downstream_bits`; 8 bits for g = 30 up to n = 8, the paper's prototype); the runtime adds
the summands in the narrowest collective dtype that holds g·n (uint8, else int32), never wrapping.
The all-reduce strategy sends those summands, not the packed b-bit indices; in parameter-server and
switch modes the server receives the b-bit indices and looks them up itself (Section 6, Fig. 4).

Speed: on CPU tensors each method is a few numba passes (the vector kernels of
:mod:`gradpress.compressors.thc_kernels` and :mod:`gradpress.compressors.thc_codes`, on
:mod:`gradpress.kernels.simd`): ``thc`` compresses in two passes per Hadamard block (the transform's pass A;
pass B fused with the scaling, the quantization and the packing) after the preliminary norm, and decodes
a packet or a sum in two passes (unpacking and table lookup fused into pass A; D, the scale and the
output into pass B); ``thc_uniform`` quantizes and packs in one pass after its min/max, and decodes in
one. With the residual memory (Algorithm 3 line 21) the runtime has the compression form e = x − RHT⁻¹(X)
as well, in the compensated tensor's own storage: r' = v − (T[z] − g/2)·2M/g for each rotated value v as
it is quantized, the inverse stages across rows on each panel of pass B while it is in the cache, then
one more pass per block (the stages within rows, D, 1/√P, the output): no decompressed temporary, no
subtraction pass, no new tensor; equal to x − decompress(packet) up to the rounding of 2·log2(d)
butterfly stages (the rotation changes every step, so the memory cannot stay in the rotated domain).
Without it (the first step, whose compensated tensor is the gradient itself), :meth:`THC.residual`
decodes and subtracts in one kernel, the same bits. The torch path (other devices, or
``GRADPRESS_NUMBA=0``) does the same float32 operations in the same order and gives the same bits (its
residual: x minus the decoding, as the base class's). The kernels of 2026-11-25 changed two bits that reach
the wire (its layout does not change): the RHT signs come 32 to a hash (:mod:`gradpress.kernels.hadamard`), and a
step up is drawn as (mix32(i, seed) >> 8) < (a − T[z])·2^24/(T[z+1] − T[z]) in float32, the old
comparison of r·2^-24 with the probability less one multiplication (they differ only where the
probability is below float32's normal range); the same inputs, seeds and keys therefore give other codes
than before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from scipy.special import ndtri

from gradpress.compressors.thc_codes import (
    _MASK,
    _lookup_fast,
    _quantize_numba,
    _uniform_compress,
    _uniform_decode_packed,
    _uniform_decode_sums,
)
from gradpress.compressors.thc_kernels import (
    _thc_compress,
    _thc_decode,
    _thc_decode_sums,
)
from gradpress.compressors.thc_table import thc_table
from gradpress.core.compressor import (
    Compressor,
    Preliminary,
    check_finite,
    float32_output,
    register,
    saturate,
    sum_addends,
)
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context, mix32_torch, seed32
from gradpress.kernels.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.kernels.hadamard import (
    DEFAULT_PARTITION,
    ONE,
    _STREAMED,
    _kernel_args,
    apply_rht,
    inverse_rht,
    rht_layout,
    work_buffer,
)
from gradpress.kernels.jit import as_numpy, squares, use_numba

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


# -- the grid: stochastic rounding onto table values -----------------------------------------------------
@dataclass(frozen=True)
class Grid:
    """Integer grid points 0..top of which the 2^b values of a table T may be sent (Algorithm 2).

    A value a ∈ [0, top] (in grid units) lies in the gap T[z] ≤ a < T[z+1] with z = ``gap[⌊a⌋]`` and is
    rounded up to T[z+1] with probability (a − T[z])/(T[z+1] − T[z]), down to T[z] otherwise: unbiased
    stochastic quantization between the two nearest table values, which App. B (citing [7]) shows
    optimal for a given table. ``values`` are the table values as the integers an aggregator adds.

    The draw: up exactly when r < (a − T[z])·2^24/(T[z+1] − T[z]) in float32, r = mix32(i, seed) >> 8 the
    24-bit integer of the counter hash (gradpress.core.rng) for coordinate i: r·2^-24 < the probability, but
    without a multiplication by 2^-24 per value (the power of two is in ``inv_gap``).
    """

    table: np.ndarray  # float32, 2^b increasing values 0 = T[0] < … < T[2^b − 1] = top
    values: np.ndarray  # the same as uint8 (top ≤ 255) or int32 summands
    gap: np.ndarray  # int64, top + 1 entries: the z with T[z] ≤ i < T[z+1] (2^b − 2 at i = top)
    inv_gap: np.ndarray  # float32, 2^24 / (T[z+1] − T[z]): the step probability in units of the uniforms'
    # per grid point i (the vector kernels' lookups, zero-padded to at least 32 entries for V.permute32):
    point_gap: np.ndarray  # int32, gap[i]
    point_low: np.ndarray  # float32, T[gap[i]]
    point_inv: np.ndarray  # float32, inv_gap[gap[i]]
    values32: np.ndarray  # int32, the table values, padded to at least 32
    # the torch path's copies of table, values, gap and inv_gap on each device, made once per device
    _on_device: dict[torch.device, tuple[torch.Tensor, ...]] = field(default_factory=dict, compare=False, repr=False)

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(table, values, gap, inv_gap) as tensors on ``device``, copied there once."""
        tensors = self._on_device.get(device)
        if tensors is None:
            tensors = self._on_device[device] = tuple(
                torch.from_numpy(a).to(device) for a in (self.table, self.values, self.gap, self.inv_gap))
        return tensors  # type: ignore[return-value]

    @classmethod
    def of(cls, table: Sequence[int]) -> Grid:
        t = np.asarray(table, dtype=np.int64)
        if t.size < 2 or t[0] != 0 or np.any(np.diff(t) <= 0):
            raise ValueError(f"a THC table must increase from 0, got {tuple(table)}")
        top = int(t[-1])
        gap = np.clip(np.searchsorted(t, np.arange(top + 1), side="right") - 1, 0, t.size - 2)
        inv_gap = (1.0 / np.diff(t)).astype(np.float32) * np.float32(2.0**24)  # (exact: a power of two)
        table32 = t.astype(np.float32)

        def padded(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a, np.zeros(max(0, 32 - a.size), dtype=a.dtype)])

        return cls(table32, t.astype(np.uint8 if top <= 255 else np.int32), gap, inv_gap,
                   padded(gap.astype(np.int32)), padded(table32[gap]), padded(inv_gap[gap]),
                   padded(t.astype(np.int32)))

    @property
    def top(self) -> int:
        return int(self.table[-1])

    @property
    def dtype(self) -> torch.dtype:
        """The summands' dtype: uint8 while the table's values fit, else int32."""
        return torch.uint8 if self.values.dtype == np.uint8 else torch.int32

    def quantize(self, x: torch.Tensor, origin: float, width: float, seed: int) -> torch.Tensor:
        """uint8 table indices of float32 ``x`` on the grid origin + i·width/top, i ∈ 0..top: x is mapped
        to a = clamp((x − origin)·top/width, 0, top) (clamping is THC's truncation) and rounded to a
        table value with the 24-bit uniforms of the counter hash seeded with ``seed``.

        The numba and torch paths do the same float32 operations (:func:`_affine`), so they give the
        same bits.
        """
        pre, origin32, scale = _affine(origin, width, self.top)
        if use_numba(x):
            codes = torch.empty(x.numel(), dtype=torch.uint8)
            _quantize_numba(as_numpy(x), pre, origin32, scale, np.float32(self.top), self.gap, self.table,
                            self.inv_gap, np.uint32(seed32(seed)), as_numpy(codes))
            return codes
        device = x.device
        a = (x * float(pre)).sub_(float(origin32)).mul_(float(scale)).clamp_(0.0, float(self.top))
        table, _, gap, inv_gap = self.on(device)
        z = gap[a.long()]
        frac = (a - table[z]).mul_(inv_gap[z])
        index = torch.arange(x.numel(), dtype=torch.int64, device=device)
        up = (mix32_torch(index, seed) >> 8).to(torch.float32) < frac
        return (z + up).to(torch.uint8)

    def lookup(self, packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
        """T[z] for the ``n`` packed b-bit indices z, as integer summands (Algorithm 2 line 6: the
        aggregator's lookup); on the CPU unpacking and lookup are one numba pass."""
        if use_numba(packed):
            if packed.numel() != packed_nbytes(n, bits):
                raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits")
            out = torch.empty(n, dtype=self.dtype)
            _lookup_fast(as_numpy(packed.contiguous()), bits, self.values32, as_numpy(out))
            return out
        codes = unpack_bits(packed, bits, n)
        return self.on(packed.device)[1][codes.long()]


def _affine(origin: float, width: float, top: int) -> tuple[np.float32, np.float32, np.float32]:
    """float32 (pre, origin·pre, top/(width·pre)): a = (x·pre − origin·pre)·scale.

    ``pre`` is the power of two that brings width·pre into [0.5, 1) (at most 2^126), so neither the
    difference nor the scale can overflow float32 for any finite range, however wide or narrow;
    multiplying by it is exact. A zero width maps everything to grid point 0."""
    if width <= 0.0:
        return np.float32(1.0), np.float32(origin), np.float32(0.0)
    pre = math.ldexp(1.0, min(126, -math.frexp(width)[1]))
    return np.float32(pre), np.float32(np.float32(origin) * np.float32(pre)), np.float32(top / (width * pre))


# -- the shared mechanism ----------------------------------------------------------------------------------
class _Homomorphic(Compressor):
    """Packed b-bit table indices on the wire, table values as summands, an affine decode of their sum."""

    summable = True
    saturates = True  # the inverse Hadamard transform of quantized values may exceed fp16's range
    bits: int
    grid: Grid

    @property
    def max_summand(self) -> int:  # type: ignore[override]
        """The largest value one worker adds: 2^b − 1 (uniform) or g (the table's last value)."""
        return self.grid.top

    def coded(self, numel: int) -> int:
        """How many coordinates are quantized and sent for a tensor of ``numel`` values."""
        return numel

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """⌈b · coded(numel) / 8⌉: b bits per coordinate upstream (the downstream sum is wider)."""
        return packed_nbytes(self.coded(numel), self.bits) if numel else 0

    def summands(self, packet: Packet) -> list[torch.Tensor]:
        """The table values T[z] of the packet's indices (uint8 while g ≤ 255)."""
        if packet.numel == 0:
            return []
        return [self.grid.lookup(packet["codes"], self.bits, self.coded(packet.numel))]

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean over ``count`` workers from the sum of their table values (any integer dtype),
        into ``out`` where it can take it (see :meth:`Compressor.decode_sum`).

        ``count`` may be smaller than the world size (partial aggregation, Section 6): the sum of the
        values that arrived, divided by how many arrived, is the mean of those workers' decodes."""
        if packet.numel == 0:
            return self.decompress(packet)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{self.spec}: count must be a positive integer, got {count!r}")
        into = float32_output(out, packet.numel)
        mean = self._decode(packet, summed[0], count, into)
        return saturate(mean, packet.dtype).to(packet.dtype).view(packet.shape)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        if use_numba(packet["codes"]):  # unpacking, the lookup and the decoding in one kernel
            return self._decode_codes(packet, packet["codes"].contiguous())
        return self._decode(packet, self.summands(packet)[0], 1)

    def _decode(self, packet: Packet, total: torch.Tensor, count: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 mean from the integer sums ``total``, written into ``out`` (flat, float32, on the
        sums' device) when one is given, by the numba kernels and the torch path alike."""
        raise NotImplementedError

    def _decode_codes(self, packet: Packet, packed: torch.Tensor) -> torch.Tensor:
        """The numba kernel's :meth:`_decode` of one packet's own table values (count 1)."""
        raise NotImplementedError

    def _nonfinite(self, flat: torch.Tensor) -> None:
        """The values to quantize hold NaN/Inf: the input does (check_finite raises NonFiniteError with
        their count), or its transform overflowed float32 (a given norm far below its own)."""
        check_finite(flat, self.spec)
        raise OverflowError(f"{self.spec}: the transformed values overflow float32 (a preliminary norm smaller "
                            "than this tensor's own?)")


def _kernel_source(total: torch.Tensor, numel: int) -> bool:
    """Whether the numba kernels can decode the integer sums ``total`` of ``numel`` values."""
    return (use_numba(total) and total.dim() == 1 and total.numel() == numel
            and total.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))


# -- uniform THC -----------------------------------------------------------------------------------------
@register("thc_uniform")
@dataclass(repr=False)
class UniformTHC(_Homomorphic):
    """Uniform THC (THC paper, Section 4.2, Algorithm 1): stochastic rounding to 2^b uniform levels on
    the workers' global [min, max] (a preliminary max of (−min, max)); b-bit codes, summed as integers.

    ``bits`` b ∈ 1..8. Unbiased. Wire: ⌈b·d/8⌉ bytes; the range is known to every worker from the
    preliminary exchange (two floats each way) and is not part of the packet.
    """

    bits: int = param(4, "[1, 8]")
    unbiased = True
    checks_finite = True  # NaN/Inf input makes the preliminary (−min, max) NaN/Inf; the kernel sees them too
    examples = ("thc_uniform:bits=1", "thc_uniform:bits=8")

    def __post_init__(self) -> None:
        super().__post_init__()  # checks the declared ranges
        self.grid = Grid.of(range(1 << self.bits))

    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary:
        """Algorithm 1 lines 1-4: (−min, max), combined by max over the workers."""
        lo, hi = torch.aminmax(x.reshape(-1))
        return Preliminary(torch.stack([-lo, hi]).float(), "max")

    def _compress(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor | None = None) -> Packet:
        """Algorithm 1 line 5: X_i = USQ(∇_i, m, M, b)."""
        if prepared is None or prepared.numel() != 2:
            raise ValueError(f"{self.spec}: expected the prepared (−min, max), got "
                             f"{0 if prepared is None else prepared.numel()} values")
        lo, hi = -float(prepared[0]), float(prepared[1])
        if not (math.isfinite(lo) and math.isfinite(hi)):
            check_finite(flat, self.spec)  # (NaN/Inf input: its own range is NaN/Inf)
            raise ValueError(f"{self.spec}: the prepared range [{lo}, {hi}] is not finite")
        if not lo <= hi:
            raise ValueError(f"{self.spec}: the prepared range [{lo}, {hi}] is empty")
        seed = ctx.private_seed("thc_uniform")
        meta = {"lo": lo, "hi": hi}
        if use_numba(flat):  # quantization and packing in one pass
            x = flat.float().contiguous()
            codes = torch.empty(packed_nbytes(x.numel(), self.bits), dtype=torch.uint8)
            pre, origin, scale = _affine(lo, hi - lo, self.grid.top)
            exponent = _uniform_compress(as_numpy(x), pre, origin, scale, np.float32(self.grid.top),
                                         np.uint32(seed32(seed)), self.bits, as_numpy(codes))
            if exponent == _MASK:
                self._nonfinite(flat)
            return Packet({"codes": codes}, flat.shape, flat.dtype, meta)
        check_finite(flat, self.spec)
        codes = self.grid.quantize(flat.float(), lo, hi - lo, seed)
        return Packet({"codes": pack_bits(codes, self.bits)}, flat.shape, flat.dtype, meta)

    def _decode(self, packet: Packet, total: torch.Tensor, count: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Algorithm 1 line 9: m + (X/n)·(M − m)/(2^b − 1), in float64 (then float32)."""
        lo, hi = packet.meta["lo"], packet.meta["hi"]
        step = (hi - lo) / (self.grid.top * count)
        if _kernel_source(total, packet.numel):
            out = torch.empty(packet.numel, dtype=torch.float32) if out is None else out
            _uniform_decode_sums(as_numpy(total.contiguous()), step, float(lo), as_numpy(out))
            return out
        mean = total.double().mul_(step).add_(lo)
        return mean.float() if out is None else out.copy_(mean)  # (the same rounding to float32)

    def _decode_codes(self, packet: Packet, packed: torch.Tensor) -> torch.Tensor:
        lo, hi = packet.meta["lo"], packet.meta["hi"]
        if packed.numel() != packed_nbytes(packet.numel, self.bits):
            raise ValueError(f"{packed.numel()} bytes cannot hold {packet.numel} codes of {self.bits} bits")
        out = torch.empty(packet.numel, dtype=torch.float32)
        _uniform_decode_packed(as_numpy(packed), self.bits, (hi - lo) / self.grid.top, float(lo), as_numpy(out))
        return out


# -- THC ---------------------------------------------------------------------------------------------------
@register("thc")
@dataclass(repr=False)
class THC(_Homomorphic):
    """THC (THC paper, Algorithm 3 with Algorithm 2): randomized Hadamard transform, preliminary max
    L2 norm, truncation at M = t_p·ℓ/√d, stochastic quantization to the optimal lookup table's values;
    b-bit table indices on the wire, table values summed as integers.

    ``bits`` b (4), ``granularity`` g (30), ``p`` (1/32: t_p = Φ⁻¹(1 − p/2) = 2.1539), ``partition``
    (2^20 values per Hadamard block): the authors' configuration. ``symmetric`` (true): the table of
    the paper's solver, as published; false: :func:`gradpress.compressors.thc_table`'s global optimum, better where
    the reflection T ↦ g − T excludes the midpoint g/2 (even g; b = 4, g = 16: half the table error).

    Biased by truncation: error feedback ``residual`` (Algorithm 3 line 21). Upstream ⌈b·d'/8⌉ bytes
    for d' transformed coordinates (each partition padded to a power of two); downstream
    ⌈log2(g·n + 1)⌉ bits per coordinate for n workers (:meth:`downstream_bits`).
    """

    bits: int = param(4, "[1, 8]")
    granularity: int = param(30, "[1, 4096]")  # and >= 2^b - 1; the table solver is O(2^b · g²)
    p: float = param(1 / 32, "(0, 1)")
    partition: int = param(DEFAULT_PARTITION, "[1, inf)")
    symmetric: bool = True
    checks_finite = True  # NaN/Inf input makes the preliminary norm NaN/Inf; the kernel sees them too
    fuses_residual = True
    examples = ("thc:bits=2,granularity=8", "thc:bits=3,granularity=12,p=1/512,partition=64",
                "thc:granularity=16,symmetric=false")

    def __post_init__(self) -> None:
        super().__post_init__()  # checks the declared ranges
        # checks g >= 2^b − 1 (and the symmetric solver's size)
        self.table = thc_table(self.bits, self.granularity, self.p, symmetric=self.symmetric)
        self.grid = Grid.of(self.table)
        self.t_p = float(-ndtri(self.p / 2))  # Φ⁻¹(1 − p/2): the bits of scipy.stats.norm.isf(p / 2)

    def coded(self, numel: int) -> int:
        """Transformed coordinates: every partition zero-padded to a power of two (Section 5.1)."""
        full, tail = divmod(numel, self.partition)
        return full * _power_of_two(self.partition) + (_power_of_two(tail) if tail else 0)

    def downstream_bits(self, workers: int) -> int:
        """Bits per coordinate of the sum of ``workers`` table values: ⌈log2(g·n + 1)⌉ (Section 8.4)."""
        return math.ceil(math.log2(self.granularity * workers + 1))

    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary:
        """Algorithm 3 lines 6-8: this worker's ‖x‖₂ (sent as float64), combined by max into ℓ.

        In float64, whose squares of float32 values are exact and never overflow nor underflow: on the
        CPU one numba pass (:func:`~gradpress.kernels.jit.squares`), elsewhere torch's float64 norm. The two
        sum in different orders, ~1e-16 apart, below what M = t_p·ℓ/√d keeps once rounded to float32."""
        flat = x.reshape(-1)
        if flat.dtype == torch.float32 and flat.is_contiguous() and use_numba(flat):
            return _norm_of_squares(squares(as_numpy(flat)))
        return Preliminary(torch.linalg.vector_norm(flat, dtype=torch.float64).view(1), "max")

    def prepare_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, ctx: Context,
                    world_size: int, beta: float = 1.0, gamma: float = 1.0) -> Preliminary | None:
        """:meth:`prepare` of φ = β·m + γ·g with φ formed in ``out`` in the pass that sums its squares
        (see :meth:`Compressor.prepare_sum`): Algorithm 3 line 5's error feedback and line 6's norm in one
        pass, ℓ's bits those of :meth:`prepare` of φ."""
        addends = sum_addends(memory, grad, out, beta, gamma)
        if addends is None:
            return super().prepare_sum(memory, grad, out, ctx, world_size, beta, gamma)
        return _norm_of_squares(squares(as_numpy(out).reshape(-1), addends, out.numel() >= _STREAMED))

    def _compress(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None) -> Packet:
        """Algorithm 3 lines 9-15; on the CPU, with ``residual`` (:meth:`Compressor.compress`), also line 21's
        e = x − RHT⁻¹(X), formed from the rotated values as they are quantized (:func:`_thc_compress` with ``fused``)."""
        if prepared is None or prepared.numel() != 1:
            raise ValueError(f"{self.spec}: expected the prepared largest norm, got "
                             f"{0 if prepared is None else prepared.numel()} values")
        ell = float(prepared[0])
        if not math.isfinite(ell):
            check_finite(flat, self.spec)  # (NaN/Inf input: its own norm is NaN/Inf)
        if ell * math.sqrt(_power_of_two(min(flat.numel(), self.partition))) >= FLOAT32_MAX:
            raise OverflowError(f"{self.spec}: an L2 norm of {ell:.3g} overflows the float32 Hadamard "
                                "transform")
        if self.t_p * ell >= FLOAT32_MAX:  # a decoded value reaches √d·M = t_p·ℓ (d = 1: M itself)
            raise OverflowError(f"{self.spec}: the truncation range ±M = ±t_p·ℓ/√d (t_p = {self.t_p:.4g}, "
                                f"the largest L2 norm ℓ = {ell:.3g}) holds decoded values beyond float32's "
                                "range")
        signs = ctx.shared_generator(flat.device, "thc/rht")
        layout = rht_layout(flat.numel(), signs, self.partition, flat.device)
        bound = float(np.float32(self.t_p * ell / math.sqrt(layout.padded_numel)))  # line 11: M; m = −M
        seed = ctx.private_seed("thc")
        meta = {"M": bound, "rht": layout}
        if use_numba(flat):  # lines 9-15 in two passes per partition (the RHT, quantization and packing)
            x = flat.float().contiguous()
            pre, origin, scale = _affine(-bound, 2 * bound, self.grid.top)
            coded = layout.padded_numel
            # blocks of fewer than 16 values OR their codes into a zeroed stream; the others write whole bytes
            tiny = _power_of_two(layout.partition) < 16 or 0 < layout.tail and _power_of_two(layout.tail) < 16
            codes = (torch.zeros if tiny else torch.empty)(packed_nbytes(coded, self.bits), dtype=torch.uint8)
            g = self.grid
            args = (as_numpy(x), *_kernel_args(layout, torch.float32), ONE, work_buffer(layout), pre, origin, scale,
                    np.float32(g.top), g.point_gap, g.point_low, g.point_inv, np.uint32(seed32(seed)),
                    np.uint64(self.bits), as_numpy(codes))
            fused = (residual is not None and flat.dtype == torch.float32 and residual.dtype == torch.float32
                     and residual.numel() == flat.numel() and residual.is_contiguous() and use_numba(residual))
            if fused and residual is not None:
                factor = np.float32(2.0 * bound / self.granularity)  # the decoder's scale (count 1)
                centred = self.grid.values32.astype(np.float32) - np.float32(self.granularity / 2)
                exponent = _thc_compress(*args, True, as_numpy(residual.view(-1)), centred, factor)
            else:  # (the residual's arguments unread)
                exponent = _thc_compress(*args, False, args[0], g.point_low, np.float32(0.0))
            if exponent == _MASK:
                self._nonfinite(flat)
            if fused:
                meta["residual"] = residual
            return Packet({"codes": codes}, flat.shape, flat.dtype, meta)
        check_finite(flat, self.spec)
        rotated = apply_rht(flat, layout)  # line 9: R_i = H·D·x_i (orthonormal per partition)
        if not bool(torch.isfinite(rotated).all()):  # (a given norm too small for x: as the kernel raises)
            self._nonfinite(flat)
        codes = self.grid.quantize(rotated, -bound, 2 * bound, seed)  # lines 12-14
        return Packet({"codes": pack_bits(codes, self.bits)}, flat.shape, flat.dtype, meta)

    def _decode(self, packet: Packet, total: torch.Tensor, count: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Algorithm 3 lines 18-20: Y_avg = Y/n, x̂' = m + Y_avg·(M − m)/g, ∇̂ = RHT⁻¹(x̂'); with m = −M,
        by linearity ∇̂ = (2M/(g·n)) · RHT⁻¹(Y − g·n/2).

        That order keeps the transform's butterflies on integers and half-integers, exact in float32
        while partial sums stay below 2^23 in magnitude (after k stages at most 2^k·g·n/2, typically
        √(2^k) times less), so the result is rounded about twice: decoding the sum agrees with the
        mean of the workers' decodes to a few ulps, Definition 3's homomorphism up to float rounding
        (the affine map first, then a float32 transform, is about ten times less accurate)."""
        scale = float(np.float32(2.0 * packet.meta["M"] / (self.granularity * count)))
        layout = packet.meta["rht"]
        if _kernel_source(total, layout.padded_numel):
            return self._kernel_decode(False, total.contiguous(), layout, count, scale, out=out)
        centered = torch.sub(total, self.granularity * count / 2,
                             out=torch.empty(total.shape, dtype=torch.float32, device=total.device))
        transformed = inverse_rht(centered, layout)
        return transformed.mul_(scale) if out is None else torch.mul(transformed, scale, out=out)

    def _decode_codes(self, packet: Packet, packed: torch.Tensor) -> torch.Tensor:
        layout = packet.meta["rht"]
        if packed.numel() != packed_nbytes(layout.padded_numel, self.bits):
            raise ValueError(f"{packed.numel()} bytes cannot hold {layout.padded_numel} codes of {self.bits} bits")
        scale = float(np.float32(2.0 * packet.meta["M"] / self.granularity))
        return self._kernel_decode(True, packed, layout, 1, scale)

    def residual(self, x: torch.Tensor, packet: Packet, owned: bool = False) -> torch.Tensor:
        """x − decompress(packet), the residual memory's update (Algorithm 3 line 21): the one the compression
        formed, if it was asked to (up to float rounding); else, on the CPU, the same bits as the base
        class's, the decoding's output pass subtracting its values from x as it writes them (into x's own
        storage when ``owned``), with no decompressed temporary nor a separate pass."""
        formed = packet.meta.pop("residual", None)  # by the compression (its ``residual`` argument)
        if formed is not None:
            return formed.view(x.shape)
        flat = x.reshape(-1) if x.dtype == torch.float32 else None
        if (flat is None or packet.numel == 0 or packet.dtype != torch.float32 or flat.numel() != packet.numel
                or not flat.is_contiguous() or not use_numba(packet["codes"]) or not use_numba(flat)):
            return super().residual(x, packet, owned)
        layout = packet.meta["rht"]
        packed = packet["codes"].contiguous()
        if packed.numel() != packed_nbytes(layout.padded_numel, self.bits):
            raise ValueError(f"{packed.numel()} bytes cannot hold {layout.padded_numel} codes of {self.bits} bits")
        scale = float(np.float32(2.0 * packet.meta["M"] / self.granularity))
        out = flat if owned else torch.empty(flat.numel(), dtype=torch.float32)
        self._kernel_decode(True, packed, layout, 1, scale, minuend=flat, out=out)
        return out.view(x.shape)

    def _kernel_decode(self, packed: bool, source: torch.Tensor, layout, count: int, scale: float,  # noqa: ANN001
                       minuend: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """:func:`_thc_decode` of packed codes (``packed``; ``minuend``: subtracted from, the residual's x)
        or :func:`_thc_decode_sums` of sums, into ``out`` or a new float32 tensor: lines 18-20 in two
        passes per partition."""
        if out is None:
            out = torch.empty(layout.numel, dtype=torch.float32)
        centre = np.float32(self.granularity * count / 2)
        centred = self.grid.values32.astype(np.float32) - centre  # float32 T[z] − centre: the kernel's own bits
        target = as_numpy(out)
        args = (as_numpy(source), target, *_kernel_args(layout, torch.float32), ONE, work_buffer(layout),
                np.uint64(self.bits), centred, centre, np.float32(scale))
        if packed:
            _thc_decode(*args, target if minuend is None else as_numpy(minuend), minuend is not None)
        else:
            _thc_decode_sums(*args)
        return out


def _norm_of_squares(total: float) -> Preliminary:
    """THC's preliminary ℓ from a float64 sum of squares."""
    return Preliminary(torch.tensor([math.sqrt(total)], dtype=torch.float64), "max")


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
