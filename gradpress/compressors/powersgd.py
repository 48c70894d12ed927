"""PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019): rank-r gradient compression by one step of
power iteration with a warm start (GRACE Table 1, low-rank row: "PowerSGD, (m+L)r, Det, EF").

A gradient of shape (m, …) is read as the matrix M ∈ R^{m×n}, its first dimension by the rest (as
PyTorch's ``powerSGD_hook`` does). Algorithm 1 of the paper, for W workers with matrices M_w and a
shared Q ∈ R^{n×r}:

    P ← M_w Q;   P ← ALLREDUCE-MEAN(P)          (the runtime's preliminary "sum" exchange, :meth:`prepare`)
    P̂ ← ORTHOGONALIZE(P)
    Q ← M_wᵀ P̂;  Q ← ALLREDUCE-MEAN(Q)          (the packet's summand, all-reduced by the strategy)
    M̂ = P̂ Qᵀ                                    (:meth:`decode_sum`)

so M̂ = P̂ P̂ᵀ mean(M_w): the aggregate is the projection of the mean gradient onto the r columns of P̂.
P is all-reduced before Q on every rank (invariant: collective order, docs/design.md: the runtime issues the
two rounds from
points that are the same on every rank). The mean Q is kept per tensor and starts the next step's power
iteration (the paper's "warm start"): one iteration per step then tracks the top-r subspace across
steps. Scaling P by 1/W changes nothing after orthogonalization, so it is summed, not averaged.

Error feedback (Algorithm 2) is the runtime's ``residual`` memory, applied around the compression:
e_w ← Δ_w − DECOMPRESS(C(Δ_w)) with this worker's own packet (P̂, Q_w), i.e. e_w = Δ_w − P̂ P̂ᵀ Δ_w.
(PyTorch's hook and the authors' code subtract the aggregate P̂ P̂ᵀ mean(Δ) instead. The workers'
errors then differ but their sum does not, and P, Q and M̂ depend on the workers' Δ_w only through
their sum: both rules give the same aggregates.)

Choices beyond the paper, each stated where it is made: orthogonalization by Householder QR, which
returns orthonormal columns (identity columns for a zero P) and never divides by a vanishing norm, so
an all-zero gradient gives zeros, not NaN (at rank 1, the paper's normalization P / ‖P‖ wherever ‖P‖ is
safely away from zero and from float32's largest); a warm-start column that has become all zero (after an
all-zero gradient) is drawn afresh, or the power iteration would stay at zero; P and Q are float32
whatever the gradient's dtype (P scales with the square of the gradient and overflows fp16); 1-D
tensors and matrices for which (m + n)·r·``min_compression_rate`` ≥ m·n are sent uncompressed (PyTorch's
``_should_compress``).

Layout: the factors are held transposed, Pᵀ, P̂ᵀ (r × m) and Qᵀ (r × n), each row one of the r columns,
so that the products P = M Q and Q = Mᵀ P̂ are computed as Qᵀ Mᵀ and P̂ᵀ M with the thin factor on the
left: the row-major M is streamed once (with MKL on one thread at 2048 × 2048, rank 2: 0.6 ms against
1.4-2.3 ms for ``M @ Q`` and ``M.t() @ P̂``). On the CPU, up to rank 4, two numba kernels do it in place of
BLAS (:func:`p_product`, :func:`q_product`): four rows of M at a time, in an order of additions fixed by the
shapes alone; at 1024 × 1024, rank 1, one thread, 57-63 against 75-78 µs each for MKL's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradpress.core.compressor import (
    Compressor,
    Preliminary,
    check_finite,
    divide,
    float32_output,
    register,
    saturate,
)
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context
from gradpress.kernels import simd as V
from gradpress.kernels.jit import jit, use_numba


@register("powersgd")
@dataclass(repr=False)
class PowerSGD(Compressor):
    """PowerSGD (Vogels et al. 2019, Algorithm 1): rank-r power iteration with warm start, P then Q.

    Spec keys:

    * ``rank``: r, the rank of the approximation (default 1, the default of GRACE's and PyTorch's
      implementations; the paper compares ranks 1, 2 and 4); it is lowered to min(m, n) for small
      matrices. At most 1024 (``MAX_RANK``): the paper's largest rank is 4 (32 in PyTorch's hook
      examples), and a rank-r packet only pays off for matrices of both sides well beyond 2r, i.e.
      beyond any layer's at r = 1024; a larger rank would silently send every tensor uncompressed.
    * ``min_compression_rate``: a matrix is compressed only if (m + n)·r·rate < m·n (default 2, as in
      PyTorch's ``PowerSGDState``); 0 compresses every tensor of two or more dimensions.
    * ``warm_start``: start each step's power iteration from the previous step's mean Q (the paper's
      warm start); ``false`` draws a fresh Q from the shared stream every step.

    The packet is the paper's compressed representation (P̂, Q), as ``p`` = P̂ᵀ (r × m) and ``q`` = Qᵀ
    (r × n) in float32: ``nbytes`` = (m + n)·r·4 bytes, the data volume of GRACE's Table 1. P̂'s values
    cross the wire as P in the preliminary all-reduce (the runtime's ``sent_bytes`` counts both rounds
    by their traffic pattern); only Q is a summand of the second all-reduce. The size depends on the
    shape, not only on the number of elements, so :meth:`expected_nbytes` is None and
    :meth:`nbytes_for` gives the formula. Uncompressed tensors send their values in their own dtype.
    """

    rank: int = param(1, "[1, 1024]")  # MAX_RANK
    min_compression_rate: float = param(2.0, "[0, inf)")
    warm_start: bool = True
    summable = True
    checks_finite = True  # NaN/Inf of any worker's M reach the summed P (see _compress)
    stateful_decode = True  # decode_sum keeps the mean Q as the next step's warm start
    examples = ("powersgd:rank=2", "powersgd:rank=4,min_compression_rate=0,warm_start=false")
    _warm: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    # -- the matrix view -----------------------------------------------------------------------------
    def factors(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int] | None:
        """(m, n, r) of the matrix a tensor of ``shape`` is compressed as, or None if it is sent
        uncompressed (fewer than two dimensions, or compression would save less than
        ``min_compression_rate``: PyTorch's ``_should_compress``)."""
        if len(shape) < 2:
            return None
        m = int(shape[0])
        n = math.prod(int(s) for s in shape[1:])
        r = min(self.rank, m, n)
        if r == 0 or (m + n) * r * self.min_compression_rate >= m * n:
            return None
        return m, n, r

    def nbytes_for(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        """``Packet.nbytes`` for a tensor of ``shape``: (m + n)·r float32 factors, or the tensor itself."""
        dims = self.factors(shape)
        if dims is None:
            return math.prod(shape) * dtype.itemsize
        m, n, r = dims
        return (m + n) * r * 4

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
        """None: the size depends on the tensor's shape (see :meth:`nbytes_for`)."""
        return None

    # -- Algorithm 1 -----------------------------------------------------------------------------------
    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary | None:
        """Algorithm 1, P ← M Q, summed over the workers (sent as Pᵀ = Qᵀ Mᵀ; None when uncompressed).

        Nothing is raised here: NaN/Inf in M, or a finite M whose P overflows float32 (values near its
        largest, times √n), reach the summed P every worker holds, and every worker raises in
        :meth:`_compress`, at the same point (the runtime flags a worker whose M itself holds NaN/Inf)."""
        dims = self.factors(x.shape)
        if dims is None:
            return None
        m, n, r = dims
        return Preliminary(p_product(self._start(ctx, n, r, x.device), _float32(x).reshape(m, n)), "sum")

    def _start(self, ctx: Context, n: int, r: int, device: torch.device) -> torch.Tensor:
        """The Qᵀ (r × n) this step's power iteration starts from: the previous mean (warm start, the
        same on every rank), else one drawn from the shared stream; a factor that has become all zero
        is drawn afresh, since P = M·0 would keep it at zero for good."""
        qt = self._warm.get(ctx.key) if self.warm_start else None
        if qt is not None and qt.shape != (r, n):
            raise ValueError(f"powersgd: the warm start of {ctx.key!r} is {tuple(qt.shape)}, a tensor of this "
                             f"shape needs ({r}, {n}) (a state saved for another model?)")
        if qt is not None and qt.device == device:
            dead = ~qt.any(dim=1, keepdim=True)
            if not bool(dead.any()):
                return qt
            return torch.where(dead, self._fresh(ctx, n, r, device), qt)
        return self._fresh(ctx, n, r, device)

    @staticmethod
    def _fresh(ctx: Context, n: int, r: int, device: torch.device) -> torch.Tensor:
        generator = ctx.shared_generator(device, "powersgd.q")
        return torch.randn(r, n, generator=generator, device=device, dtype=torch.float32)

    def _compress(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor | None = None) -> Packet:
        """Algorithm 1, P̂ ← ORTHOGONALIZE(ΣP) and Q ← Mᵀ P̂ (this worker's), from ``prepared`` = ΣPᵀ.

        NaN/Inf (``checks_finite``): uncompressed tensors are checked here. A compressed one is not read
        for them: every entry M_ij of every worker enters the summed P_i = Σ_j M_ij Q_j, and IEEE
        arithmetic carries NaN/Inf through it (NaN·q = NaN, Inf·0 = NaN, Inf·q = ±Inf, and a sum with a
        NaN or with both infinities is NaN), so the r × m values of ΣP are finite only if every worker's
        M is (or the sum overflowed: then P̂ would be NaN anyway). Every worker holds the same ΣP, so all
        of them raise together, before the second all-reduce: :class:`NonFiniteError` if its own M holds
        NaN/Inf, else ``OverflowError``: its own P, another worker's or their sum overflowed float32
        (values near float32's largest, |M_ij|·√n beyond it; the runtime flags a NaN/Inf gradient in the
        preliminary exchange, before ΣP is formed, so finite gradients never raise a NonFiniteError here).
        A Q = Mᵀ P̂ beyond float32 (|M_ij|·√m beyond its range) raises ``OverflowError`` as well.
        """
        if prepared is None:
            check_finite(flat, self.spec)
            return Packet({"values": flat}, flat.shape, flat.dtype)
        m = prepared.shape[-1]
        if prepared.dim() != 2 or flat.numel() % m:
            raise ValueError(f"powersgd: prepared Pᵀ of shape {tuple(prepared.shape)} does not fit a tensor "
                             f"of {flat.numel()} elements")
        size = magnitude(prepared)  # the one reduction that tells a finite ΣP, which ORTHOGONALIZE needs too
        if not math.isfinite(size):
            self._raise_for_summed_p(flat, ctx, prepared, int((~torch.isfinite(prepared)).sum()))
        pt = orthonormal_rows(prepared, size)  # P̂ᵀ
        qt = q_product(pt, _float32(flat).view(m, -1))
        if not math.isfinite(float(qt.sum())) and not bool(torch.isfinite(qt).all()):  # M is finite (its P was)
            raise OverflowError(f"{self.spec}: Q = Mᵀ P̂ overflows float32: the gradient's values (up to "
                                f"{float(flat.abs().max()):.3g}) are too close to float32's largest")
        return Packet({"p": pt, "q": qt}, flat.shape, flat.dtype, {"key": ctx.key})

    def _raise_for_summed_p(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor, bad: int) -> None:
        """ΣP holds NaN/Inf: tell NaN/Inf in this worker's M from an overflow of its P or of the sum
        (a rare path: one check of M and one product)."""
        where = f"the summed P = M Q holds {bad} NaN/Inf value(s) out of {prepared.numel()}"
        check_finite(flat, f"{self.spec}: {where}; this worker's gradient")  # its own NaN/Inf
        (r, m), n = prepared.shape, flat.numel() // prepared.shape[-1]
        own = p_product(self._start(ctx, n, r, flat.device), _float32(flat).view(m, n))  # its own Pᵀ
        if not bool(torch.isfinite(own).all()):
            raise OverflowError(f"{self.spec}: {where}: this worker's M Q overflowed float32 (its gradient "
                                f"is finite, with values up to {float(flat.abs().max()):.3g})")
        raise OverflowError(f"{self.spec}: {where}: another worker's M Q, or the sum of the workers' P, "
                            "overflowed float32 (a gradient's values too close to float32's largest)")

    def _decompress(self, packet: Packet) -> torch.Tensor:
        """Algorithm 1, DECOMPRESS: M̂ = P̂ Qᵀ."""
        if "values" in packet.tensors:
            return packet["values"]
        return _product(packet["p"], packet["q"]).view(-1)

    # -- runtime hooks ---------------------------------------------------------------------------------
    def summands(self, packet: Packet) -> list[torch.Tensor]:
        """Q (P̂ is already the same on every worker), or the uncompressed values."""
        return [packet["values"] if "values" in packet.tensors else packet["q"]]

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Algorithm 1, Q ← ALLREDUCE-MEAN(Q) = ΣQ / W, then M̂ = P̂ Qᵀ (into ``out`` where it can take it:
        see :meth:`Compressor.decode_sum`); the mean Q is kept as the next step's warm start for this
        tensor (the same bits on every rank)."""
        if "values" in packet.tensors or packet.numel == 0:
            return super().decode_sum(packet, summed, count, out)
        qt = summed[0].float()
        divide(qt, count, out=qt)
        if not math.isfinite(float(qt.abs().max())):  # every worker's Q was finite: their sum overflowed
            raise OverflowError(f"{self.spec}: the sum of {count} workers' Q overflowed float32")
        if self.warm_start:
            self._warm[packet.meta["key"]] = qt.clone()
        into = float32_output(out, packet.numel)
        return saturate(_product(packet["p"], qt, into), packet.dtype).to(packet.dtype).view(packet.shape)

    def state_dict(self) -> dict[str, Any]:
        """The warm start of every tensor: key -> the mean Qᵀ, a float32 (r, n) tensor."""
        return {"warm": {key: qt.clone() for key, qt in dict(self._warm).items()}}

    def check_state(self, state: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
        """Each warm start is the (r, n) Qᵀ of its tensor's matrix view (:meth:`factors`), where the
        state knows the tensor's shape (else :meth:`_start` checks it when the tensor arrives)."""
        for key, q in state.get("warm", {}).items():
            if key not in shapes:
                continue
            dims = self.factors(shapes[key])
            expected = None if dims is None else (dims[2], dims[1])
            if not isinstance(q, torch.Tensor) or tuple(q.shape) != expected:
                got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
                raise ValueError(f"powersgd: warm start of {key!r} is {got}, expected "
                                 f"{expected if expected else 'none (not a compressed matrix)'}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        warm = state.get("warm", {})
        for key, q in warm.items():
            if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.dtype != torch.float32:
                raise ValueError(f"powersgd: warm start of {key!r} must be a float32 matrix, got {q!r}")
        self._warm = {key: q.clone() for key, q in warm.items()}


#: where a rank-1 P's float32 norm is trusted: within [2^-45, 2^50] no square overflowed and the squares
#: that underflowed (|p| < 2^-75) weigh less than m·2^-60 of the sum; there P / ‖P‖ is formed in float32;
#: outside it (or for NaN/Inf) the norm is summed in float64 instead
NORM_RANGE = (2.0**-45, 2.0**50)
#: the largest |P| Householder QR is handed as it is; outside it P is first scaled by a power of two
#: (exactly), since MKL's float32 QR returns NaN for a column whose norm exceeds float32's largest
QR_RANGE = (2.0**-60, 2.0**60)


def magnitude(pt: torch.Tensor) -> float:
    """What :func:`orthonormal_rows` scales P by, finite exactly when P is: at rank 1 ‖P‖ (torch's float32
    norm where it lies in :data:`NORM_RANGE`, else summed in float64, where no square of a float32 value
    over- or underflows), at higher ranks max |P|. torch's reductions, whose order of additions does not
    depend on the tensor's address (BLAS's dot's does, with MKL), so that every path to the same ΣP gives
    the same P̂."""
    if pt.numel() == 0:
        return 0.0
    if pt.shape[0] != 1:
        return float(pt.abs().max())
    norm = float(torch.linalg.vector_norm(pt))
    if NORM_RANGE[0] <= norm <= NORM_RANGE[1]:
        return norm
    return float(torch.linalg.vector_norm(pt, dtype=torch.float64))


def orthonormal_rows(pt: torch.Tensor, size: float | None = None) -> torch.Tensor:
    """ORTHOGONALIZE of Algorithm 1 on the transposed factor: P̂ᵀ (r × m, contiguous), whose rows are an
    orthonormal basis of Pᵀ's rows (the columns of P), for a finite P; ``size``: :func:`magnitude` of
    ``pt``, if the caller has it.

    At rank 1 and P ≠ 0, P̂ = P / ‖P‖ (Gram-Schmidt of one column, as the paper's code and GRACE's), in
    float64 where ‖P‖ lies outside :data:`NORM_RANGE`. At every higher rank, and for a zero P,
    Householder QR's Q factor: unlike Gram-Schmidt with a norm in the denominator (PyTorch's hook, whose
    default epsilon 0 turns an all-zero column into NaN), it always returns orthonormal columns: for a
    rank-deficient or zero P the missing directions are completed by unit vectors, so P̂ P̂ᵀ stays an
    orthogonal projection and nothing is divided by zero. (The two may give P̂ opposite signs; P̂ P̂ᵀ,
    and M̂ = P̂ P̂ᵀ M, are the same.)
    """
    size = magnitude(pt) if size is None else size
    if pt.shape[0] == 1 and size > 0:
        return pt / size if NORM_RANGE[0] <= size <= NORM_RANGE[1] else (pt.double() / size).float()
    if size > 0 and not QR_RANGE[0] <= size <= QR_RANGE[1]:
        pt = (pt.double() * 2.0 ** -math.frexp(size)[1]).float()  # a power of two: exact
    return torch.linalg.qr(pt.t()).Q.t().contiguous()  # (QR's factor is column-major: its transpose a view)


#: the largest rank, and the fewest values of M, for which the products stream M through the numba
#: kernels below (beyond that rank BLAS's matrix products, whose arithmetic then outweighs the one pass
#: over M; below that size the calls' fixed cost outweighs the pass)
STREAMED_RANK, STREAMED_NUMEL = 4, 1 << 15


def p_product(qt: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Pᵀ = Qᵀ Mᵀ (r × m) for Qᵀ (r × n) and float32 M (m × n): on the CPU, up to :data:`STREAMED_RANK`,
    one pass over M (:func:`_row_dots`), else ``torch.mm``."""
    if _streams(matrix, qt):
        return _streamed(_row_dots, qt, matrix, matrix.shape[0])
    return torch.mm(qt, matrix.t())


def q_product(pt: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Qᵀ = P̂ᵀ M (r × n) for P̂ᵀ (r × m) and float32 M (m × n): on the CPU, up to :data:`STREAMED_RANK`,
    one pass over M (:func:`_row_sums`), else ``torch.mm``."""
    if _streams(matrix, pt):
        return _streamed(_row_sums, pt, matrix, matrix.shape[1])
    return torch.mm(pt, matrix)


def _streamed(kernel: Any, factor: torch.Tensor, matrix: torch.Tensor, columns: int) -> torch.Tensor:
    """The r × ``columns`` product of the thin factor (r rows) and M that ``kernel`` computes."""
    out = torch.empty(factor.shape[0], columns, dtype=torch.float32)
    (m, n), r = matrix.shape, factor.shape[0]
    kernel(matrix.numpy().reshape(-1), factor.numpy().reshape(-1), out.numpy().reshape(-1), m, n, r)
    return out


def _streams(matrix: torch.Tensor, factor: torch.Tensor) -> bool:
    return (use_numba(matrix) and factor.shape[0] <= STREAMED_RANK and factor.device == matrix.device
            and matrix.dtype == torch.float32 and factor.dtype == torch.float32
            and matrix.numel() >= STREAMED_NUMEL and matrix.is_contiguous() and factor.is_contiguous())


# The products as matrix-vector products that read M once, four rows at a time, in 16-lane vectors
# (gradpress.kernels.simd: IEEE operations, no fused multiply-add): their bits depend on the shapes only, not on
# the CPU's vector width nor on where the tensors lie (MKL's may round differently at another address).
@jit
def _row_dots(matrix, qt, out, m, n, r):  # pragma: no cover - compiled
    """out[k·m + i] = Σ_j M[i, j]·Qᵀ[k, j] (flat M: m × n, Qᵀ: r × n): each dot product in one 16-lane
    partial sum (lane l takes the j ≡ l mod 16, in order), then its lanes in order; four rows at a time,
    each vector of Qᵀ loaded once for the four, every k while the rows are in the cache."""
    u = np.uint64
    whole, left = u(n - n % 16), np.int64(n % 16)
    for i in range(u(0), u(m - m % 4), u(4)):
        a, b, c, d = i * u(n), (i + u(1)) * u(n), (i + u(2)) * u(n), (i + u(3)) * u(n)
        for k in range(u(r)):
            q = k * u(n)
            s0 = s1 = s2 = s3 = V.fsplat(np.float32(0))
            for j in range(u(0), whole, u(16)):
                v = V.load(qt, q + j)
                s0 = V.add(s0, V.mul(V.load(matrix, a + j), v))
                s1 = V.add(s1, V.mul(V.load(matrix, b + j), v))
                s2 = V.add(s2, V.mul(V.load(matrix, c + j), v))
                s3 = V.add(s3, V.mul(V.load(matrix, d + j), v))
            if left:
                v = V.load_first(qt, q + whole, left)
                s0 = V.add(s0, V.mul(V.load_first(matrix, a + whole, left), v))
                s1 = V.add(s1, V.mul(V.load_first(matrix, b + whole, left), v))
                s2 = V.add(s2, V.mul(V.load_first(matrix, c + whole, left), v))
                s3 = V.add(s3, V.mul(V.load_first(matrix, d + whole, left), v))
            at = k * u(m) + i
            out[at], out[at + u(1)] = V.hsum(s0), V.hsum(s1)
            out[at + u(2)], out[at + u(3)] = V.hsum(s2), V.hsum(s3)
    for i in range(u(m - m % 4), u(m)):
        a = i * u(n)
        for k in range(u(r)):
            q = k * u(n)
            s0 = V.fsplat(np.float32(0))
            for j in range(u(0), whole, u(16)):
                s0 = V.add(s0, V.mul(V.load(matrix, a + j), V.load(qt, q + j)))
            if left:
                v = V.load_first(qt, q + whole, left)
                s0 = V.add(s0, V.mul(V.load_first(matrix, a + whole, left), v))
            out[k * u(m) + i] = V.hsum(s0)


@jit
def _row_sums(matrix, pt, out, m, n, r):  # pragma: no cover - compiled
    """out[k·n + j] = Σ_i P̂ᵀ[k, i]·M[i, j] (flat M: m × n, P̂ᵀ: r × m), the rows of M added in order (each
    output value the sequential float32 sum), 16 columns at a time, kept in a register across four rows,
    every k while the rows are in the cache."""
    u = np.uint64
    whole, left = u(n - n % 16), np.int64(n % 16)
    out[:] = 0
    for i in range(u(0), u(m - m % 4), u(4)):
        a, b, c, d = i * u(n), (i + u(1)) * u(n), (i + u(2)) * u(n), (i + u(3)) * u(n)
        for k in range(u(r)):
            o, p = k * u(n), k * u(m) + i
            f0, f1 = V.fsplat(pt[p]), V.fsplat(pt[p + u(1)])
            f2, f3 = V.fsplat(pt[p + u(2)]), V.fsplat(pt[p + u(3)])
            for j in range(u(0), whole, u(16)):
                v = V.add(V.load(out, o + j), V.mul(f0, V.load(matrix, a + j)))
                v = V.add(v, V.mul(f1, V.load(matrix, b + j)))
                v = V.add(v, V.mul(f2, V.load(matrix, c + j)))
                V.store(out, o + j, V.add(v, V.mul(f3, V.load(matrix, d + j))))
            if left:
                j = whole
                v = V.add(V.load_first(out, o + j, left), V.mul(f0, V.load_first(matrix, a + j, left)))
                v = V.add(v, V.mul(f1, V.load_first(matrix, b + j, left)))
                v = V.add(v, V.mul(f2, V.load_first(matrix, c + j, left)))
                V.store_first(out, o + j, V.add(v, V.mul(f3, V.load_first(matrix, d + j, left))), left)
    for i in range(u(m - m % 4), u(m)):
        a = i * u(n)
        for k in range(u(r)):
            o, f = k * u(n), V.fsplat(pt[k * u(m) + i])
            for j in range(u(0), whole, u(16)):
                V.store(out, o + j, V.add(V.load(out, o + j), V.mul(f, V.load(matrix, a + j))))
            if left:
                v = V.add(V.load_first(out, o + whole, left), V.mul(f, V.load_first(matrix, a + whole, left)))
                V.store_first(out, o + whole, v, left)


def _product(pt: torch.Tensor, qt: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """M̂ = P̂ Qᵀ from the transposed factors P̂ᵀ (r × m) and Qᵀ (r × n), into ``out`` (m·n values, flat)
    if given. At rank 1 an outer product, the same bits as the matrix product (each entry is one product
    p_i·q_j either way) in one streaming pass, where BLAS's product of inner dimension 1 took 1.6× as
    long (1024 × 1024, one thread)."""
    into = None if out is None or out.device != pt.device else out.view(pt.shape[1], qt.shape[1])
    if pt.shape[0] == 1:
        return torch.outer(pt[0], qt[0], out=into)
    return torch.mm(pt.t(), qt, out=into)


def _float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()
