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
  (:mod:`gradpress.hadamard`: partitions of at most ``partition`` values, each zero-padded to a power of
  two, the ±1 diagonal D from the stream shared by every worker per (step, key)); the preliminary max of
  the workers' L2 norms ℓ (lines 6-8); M = t_p·ℓ/√d, m = −M, t_p = Φ⁻¹(1 − p/2) (line 11), with d the
  number of transformed coordinates (the padded length, so that ℓ/√d is exactly their root mean
  square); truncation to [−M, M] (line 12); stochastic quantization onto the grid m + i·(M − m)/g
  restricted to the lookup table's values T[z] (lines 13-14, Algorithm 2 lines 1-4); the b-bit table
  indices z on the wire (line 15). The aggregator looks up T[z] ∈ {0..g} and adds (line 17,
  ``max_summand`` = g); decoding divides by the count, maps back (lines 18-19) and inverts the
  transform (line 20). The table is :func:`gradpress.thc_table`'s default (the paper's App. B solver
  restricted to tables symmetric under T ↦ g − T), which reproduces the authors' published tables,
  e.g. (b, g, p) = (4, 30, 1/32) → 0,3,5,7,9,11,13,14,16,17,19,21,23,25,27,30; the spec key
  ``symmetric=false`` takes the unrestricted optimum instead (never worse; much better for some even
  g, where the reflection excludes the midpoint g/2).
  Truncation biases ``thc``, so its default feedback is ``residual``: Algorithm 3 line 21 sets
  e_i ← x_i − RHT⁻¹(X_i), X_i this worker's own truncated and quantized vector — exactly what the
  runtime's residual memory stores, x minus the decompression of the worker's own packet (it keeps
  the rounding noise as well as the truncation error, as line 21 does).

Rounding noise comes from the *private* stream (the counter hash of :mod:`gradpress.rng`), so the
workers' errors are independent and the error of the mean falls as 1/n; the authors' code draws it
from a seed shared by all workers, which correlates the errors (a defect we do not copy).

Wire and downstream cost (per coordinate): upstream, ``Packet.nbytes`` = ⌈b·c/8⌉ bytes for c coded
coordinates (``thc``: c is the padded length, up to 2× the tensor's for sizes just past a power of two;
``thc_uniform``: c = numel). Downstream, a sum of n table values needs ⌈log2(g·n + 1)⌉ bits
(:meth:`THC.downstream_bits`; 8 bits for g = 30 up to n = 8, the paper's prototype); the runtime adds
the summands in the narrowest collective dtype that holds g·n (uint8, else int32), never wrapping.
The all-reduce strategy sends those summands, not the packed b-bit indices; in parameter-server and
switch modes the server receives the b-bit indices and looks them up itself (Section 6, Fig. 4).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from scipy.stats import norm

from gradpress._numba import as_numpy, jit, uniform24, use_numba
from gradpress.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.compressor import Compressor, Preliminary, register, saturate
from gradpress.hadamard import DEFAULT_PARTITION, apply_rht, inverse_rht, rht_layout
from gradpress.packet import Packet
from gradpress.registry import param
from gradpress.rng import Context, seed32, uniform24_torch
from gradpress.thc_table import thc_table

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


# -- the grid: stochastic rounding onto table values -----------------------------------------------------
@dataclass(frozen=True)
class Grid:
    """Integer grid points 0..top of which the 2^b values of a table T may be sent (Algorithm 2).

    A value a ∈ [0, top] (in grid units) lies in the gap T[z] ≤ a < T[z+1] with z = ``gap[⌊a⌋]`` and is
    rounded up to T[z+1] with probability (a − T[z])/(T[z+1] − T[z]), down to T[z] otherwise: unbiased
    stochastic quantization between the two nearest table values, which App. B (citing [7]) shows
    optimal for a given table. ``values`` are the table values as the integers an aggregator adds.
    """

    table: np.ndarray  # float32, 2^b increasing values 0 = T[0] < … < T[2^b − 1] = top
    values: np.ndarray  # the same as uint8 (top ≤ 255) or int32 summands
    gap: np.ndarray  # int64, top + 1 entries: the z with T[z] ≤ i < T[z+1] (2^b − 2 at i = top)
    inv_gap: np.ndarray  # float32, 1 / (T[z+1] − T[z])

    @classmethod
    def of(cls, table: Sequence[int]) -> Grid:
        t = np.asarray(table, dtype=np.int64)
        if t.size < 2 or t[0] != 0 or np.any(np.diff(t) <= 0):
            raise ValueError(f"a THC table must increase from 0, got {tuple(table)}")
        top = int(t[-1])
        gap = np.clip(np.searchsorted(t, np.arange(top + 1), side="right") - 1, 0, t.size - 2)
        return cls(t.astype(np.float32), t.astype(np.uint8 if top <= 255 else np.int32), gap,
                   (1.0 / np.diff(t)).astype(np.float32))

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
        z = torch.from_numpy(self.gap).to(device)[a.long()]
        table, inv_gap = (torch.from_numpy(t).to(device) for t in (self.table, self.inv_gap))
        frac = (a - table[z]).mul_(inv_gap[z])
        up = uniform24_torch(x.numel(), seed, device) < frac
        return (z + up).to(torch.uint8)

    def lookup(self, packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
        """T[z] for the ``n`` packed b-bit indices z, as integer summands (Algorithm 2 line 6: the
        aggregator's lookup); on the CPU unpacking and lookup are one numba pass."""
        if use_numba(packed):
            if packed.numel() != packed_nbytes(n, bits):
                raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits")
            out = torch.empty(n, dtype=self.dtype)
            _lookup_numba(as_numpy(packed.contiguous()), bits, self.values, as_numpy(out))
            return out
        codes = unpack_bits(packed, bits, n)
        return torch.from_numpy(self.values).to(packed.device)[codes.long()]


def _affine(origin: float, width: float, top: int) -> tuple[np.float32, np.float32, np.float32]:
    """float32 (pre, origin·pre, top/(width·pre)): a = (x·pre − origin·pre)·scale.

    ``pre`` is the power of two that brings width·pre into [0.5, 1) (at most 2^126), so neither the
    difference nor the scale can overflow float32 for any finite range, however wide or narrow;
    multiplying by it is exact. A zero width maps everything to grid point 0."""
    if width <= 0.0:
        return np.float32(1.0), np.float32(origin), np.float32(0.0)
    pre = math.ldexp(1.0, min(126, -math.frexp(width)[1]))
    return np.float32(pre), np.float32(np.float32(origin) * np.float32(pre)), np.float32(top / (width * pre))


@jit
def _quantize_numba(x, pre, origin, scale, top, gap, table, inv_gap, seed, codes):  # pragma: no cover
    zero = np.float32(0.0)
    for i in range(x.size):
        a = min(max((x[i] * pre - origin) * scale, zero), top)
        z = gap[np.int64(a)]
        up = uniform24(i, seed) < (a - table[z]) * inv_gap[z]
        codes[i] = np.uint8(z + up)


@jit
def _lookup_numba(packed, bits, values, out):  # pragma: no cover - compiled
    """Unpack b-bit codes (gradpress.bits' layout) and write their table values."""
    mask = np.uint32((1 << bits) - 1)
    acc = np.uint32(0)
    have = 0
    j = 0
    for i in range(out.size):
        if have < bits:
            acc |= np.uint32(packed[j]) << np.uint32(have)
            j += 1
            have += 8
        out[i] = values[acc & mask]
        acc >>= np.uint32(bits)
        have -= bits


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

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int) -> torch.Tensor:
        """The mean over ``count`` workers from the sum of their table values (any integer dtype).

        ``count`` may be smaller than the world size (partial aggregation, Section 6): the sum of the
        values that arrived, divided by how many arrived, is the mean of those workers' decodes."""
        if packet.numel == 0:
            return self.decompress(packet)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{self.spec}: count must be a positive integer, got {count!r}")
        return saturate(self._decode(packet, summed[0], count), packet.dtype).to(packet.dtype).view(packet.shape)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return self._decode(packet, self.summands(packet)[0], 1)

    def _decode(self, packet: Packet, total: torch.Tensor, count: int) -> torch.Tensor:
        raise NotImplementedError


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
    examples = ("thc_uniform:bits=1", "thc_uniform:bits=8")

    def __post_init__(self) -> None:
        super().__post_init__()  # checks the declared ranges
        self.grid = Grid.of(range(1 << self.bits))

    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary:
        """Algorithm 1 lines 1-4: (−min, max), combined by max over the workers."""
        lo, hi = torch.aminmax(x.reshape(-1))
        return Preliminary(torch.stack([-lo, hi]).float(), "max")

    def _compress(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor) -> Packet:
        """Algorithm 1 line 5: X_i = USQ(∇_i, m, M, b)."""
        if prepared.numel() != 2:
            raise ValueError(f"{self.spec}: expected the prepared (−min, max), got {prepared.numel()} values")
        lo, hi = -float(prepared[0]), float(prepared[1])
        if not lo <= hi:
            raise ValueError(f"{self.spec}: the prepared range [{lo}, {hi}] is empty")
        codes = self.grid.quantize(flat.float(), lo, hi - lo, ctx.private_seed("thc_uniform"))
        return Packet({"codes": pack_bits(codes, self.bits)}, flat.shape, flat.dtype, {"lo": lo, "hi": hi})

    def _decode(self, packet: Packet, total: torch.Tensor, count: int) -> torch.Tensor:
        """Algorithm 1 line 9: m + (X/n)·(M − m)/(2^b − 1), in float64 (then float32)."""
        lo, hi = packet.meta["lo"], packet.meta["hi"]
        step = (hi - lo) / (self.grid.top * count)
        return total.double().mul_(step).add_(lo).float()


# -- THC ---------------------------------------------------------------------------------------------------
@register("thc")
@dataclass(repr=False)
class THC(_Homomorphic):
    """THC (THC paper, Algorithm 3 with Algorithm 2): randomized Hadamard transform, preliminary max
    L2 norm, truncation at M = t_p·ℓ/√d, stochastic quantization to the optimal lookup table's values;
    b-bit table indices on the wire, table values summed as integers.

    ``bits`` b (4), ``granularity`` g (30), ``p`` (1/32: t_p = Φ⁻¹(1 − p/2) = 2.1539), ``partition``
    (2^20 values per Hadamard block): the authors' configuration. ``symmetric`` (true): the table of
    the paper's solver, as published; false: :func:`gradpress.thc_table`'s global optimum, better where
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
    examples = ("thc:bits=2,granularity=8", "thc:bits=3,granularity=12,p=1/512,partition=64",
                "thc:granularity=16,symmetric=false")

    def __post_init__(self) -> None:
        super().__post_init__()  # checks the declared ranges
        # checks g >= 2^b − 1 (and the symmetric solver's size)
        self.table = thc_table(self.bits, self.granularity, self.p, symmetric=self.symmetric)
        self.grid = Grid.of(self.table)
        self.t_p = float(norm.isf(self.p / 2))

    def coded(self, numel: int) -> int:
        """Transformed coordinates: every partition zero-padded to a power of two (Section 5.1)."""
        full, tail = divmod(numel, self.partition)
        return full * _power_of_two(self.partition) + (_power_of_two(tail) if tail else 0)

    def downstream_bits(self, workers: int) -> int:
        """Bits per coordinate of the sum of ``workers`` table values: ⌈log2(g·n + 1)⌉ (Section 8.4)."""
        return math.ceil(math.log2(self.granularity * workers + 1))

    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary:
        """Algorithm 3 lines 6-8: this worker's ‖x‖₂ (sent as float64), combined by max into ℓ.

        Summed in float32 (one fast pass), again in float64 where float32 squares may have overflowed
        or underflowed (a norm outside [1e-18, ∞))."""
        flat = x.reshape(-1)
        ell = torch.linalg.vector_norm(flat, dtype=torch.float32).double()
        if not 1e-18 <= float(ell) < math.inf:
            ell = torch.linalg.vector_norm(flat, dtype=torch.float64)
        return Preliminary(ell.view(1), "max")

    def _compress(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor) -> Packet:
        """Algorithm 3 lines 9-15."""
        if prepared.numel() != 1:
            raise ValueError(f"{self.spec}: expected the prepared largest norm, got {prepared.numel()} "
                             "values")
        ell = float(prepared[0])
        if ell * math.sqrt(_power_of_two(min(flat.numel(), self.partition))) >= FLOAT32_MAX:
            raise OverflowError(f"{self.spec}: an L2 norm of {ell:.3g} overflows the float32 Hadamard "
                                "transform")
        signs = ctx.shared_generator(flat.device, "thc/rht")
        layout = rht_layout(flat.numel(), signs, self.partition, flat.device)
        rotated = apply_rht(flat, layout)  # line 9: R_i = H·D·x_i (orthonormal per partition)
        bound = float(np.float32(self.t_p * ell / math.sqrt(rotated.numel())))  # line 11: M; m = −M
        codes = self.grid.quantize(rotated, -bound, 2 * bound, ctx.private_seed("thc"))  # lines 12-14
        meta = {"M": bound, "rht": layout}
        return Packet({"codes": pack_bits(codes, self.bits)}, flat.shape, flat.dtype, meta)

    def _decode(self, packet: Packet, total: torch.Tensor, count: int) -> torch.Tensor:
        """Algorithm 3 lines 18-20: Y_avg = Y/n, x̂' = m + Y_avg·(M − m)/g, ∇̂ = RHT⁻¹(x̂'); with m = −M,
        by linearity ∇̂ = (2M/(g·n)) · RHT⁻¹(Y − g·n/2).

        That order keeps the transform's butterflies on integers and half-integers, exact in float32
        while partial sums stay below 2^23 in magnitude (after k stages at most 2^k·g·n/2, typically
        √(2^k) times less), so the result is rounded about twice: decoding the sum agrees with the
        mean of the workers' decodes to a few ulps, Definition 3's homomorphism up to float rounding
        (the affine map first, then a float32 transform, is about ten times less accurate)."""
        centered = torch.sub(total, self.granularity * count / 2,
                             out=torch.empty(total.shape, dtype=torch.float32, device=total.device))
        scale = float(np.float32(2.0 * packet.meta["M"] / (self.granularity * count)))
        return inverse_rht(centered, packet.meta["rht"]).mul_(scale)


def _power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
