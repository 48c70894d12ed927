"""The compressor API (GRACE Section 3: compress / decompress, with the facts the runtime relies on).

A compressor is pure math on tensors, no communication. Subclasses are dataclasses registered under
the paper's name; their fields are the spec keys. They implement ``_compress(flat, ctx)`` on a 1-D
tensor of the input dtype and ``_decompress(packet)`` returning a 1-D tensor; the base class checks
input (dtype, NaN/Inf), flattens non-contiguous tensors, handles empty ones, and restores shape, dtype
and device.

This module is the contract a method author reads: :class:`Compressor` (the two methods to write, the
class-level facts :data:`FACTS`, the runtime hooks with their defaults), :class:`Preliminary`, the
registry (:func:`register`, :func:`make`) and the composition ``A+B``. Beside it: the fused fast paths
a method may override (:mod:`gradpress.core.fused`, which :class:`Compressor` inherits), the numeric
passes (:mod:`gradpress.core.numerics`: NaN/Inf checks, error feedback's sum, saturation, the division
by a worker count, importable from here as well) and the README's methods table
(:mod:`gradpress.core.table`).
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal

import torch

from gradpress.core.fused import FusedPaths
from gradpress.core.numerics import (
    FLOAT_DTYPES,
    NonFiniteError,
    add_into,
    any_nonfinite,
    check_finite,
    count_nonfinite,
    divide,
    divide_counting_nonfinite,
    finish_fold,
    float32_output,
    nonfinite_error,
    saturate,
    scaled_sum,
    sum_addends,
)
from gradpress.core.packet import Packet
from gradpress.core.registry import Registry, check_params_of, format_spec
from gradpress.core.rng import Context

__all__ = [
    # the contract
    "Compressor", "Preliminary", "PreliminaryOp", "FACTS", "Compose",
    # the registry of methods
    "registry", "register", "make", "compressor_names",
    # the numeric passes (gradpress.core.numerics), where the methods have always found them
    "FLOAT_DTYPES", "NonFiniteError", "add_into", "any_nonfinite", "check_finite", "count_nonfinite",
    "divide", "divide_counting_nonfinite", "finish_fold", "float32_output", "nonfinite_error", "saturate",
    "scaled_sum", "sum_addends",
]

PreliminaryOp = Literal["sum", "max", "min", "broadcast"]


@dataclass
class Preliminary:
    """What one worker contributes to a preliminary exchange before compressing (runtime hook).

    ``values`` (a small 1-D tensor) is combined over the workers with ``op``: ``"max"``, ``"min"`` or
    ``"sum"`` element-wise (THC Algorithm 1 lines 1-4: the global min and max; Algorithm 3 lines 6-8:
    the largest L2 norm; a min travels as the max of its negation), or ``"broadcast"``: every worker
    receives rank ``src``'s values (ScaleCom's CLT-k: the leader t mod n sends its top-k indices). For
    ``"broadcast"`` every rank returns a tensor of the same shape and dtype; only ``src``'s are read.
    Whether :meth:`Compressor.prepare` returns one, and its shape and dtype, may depend on the tensor's
    shape, the step and the world size, never on the values or the rank.
    """

    values: torch.Tensor
    op: PreliminaryOp
    src: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("sum", "max", "min", "broadcast"):
            raise ValueError(f"preliminary op must be sum, max, min or broadcast, got {self.op!r}")


class Compressor(FusedPaths):
    """Base class of every compressor.

    Class-level facts (an instance may refine them from its parameters):

    * ``unbiased``: E[decompress(compress(x))] = x.
    * ``summable``: packets of different workers can be added wire tensor by wire tensor and decoded
      once: ``decompress(sum of packets) == sum of decompress(packet)``.
    * ``kept``: the wire tensor holding the float values this method keeps, which a composition
      ``A+B`` hands to ``B`` (None when there is no such tensor).
    * ``examples``: further specs the shared property suite runs besides the bare name.
    * ``default_feedback``: the error-feedback memory the runtime uses unless told otherwise:
      ``residual`` for biased methods, ``none`` for unbiased ones; a method with its own memory rule
      (DGC's momentum correction, ScaleCom's low-pass filter) names it.
    * ``checks_finite``: the method itself raises :class:`NonFiniteError` (with :func:`check_finite`'s
      message) on NaN/Inf input, e.g. seen in a pass its kernel makes anyway, so neither
      :meth:`compress` nor the runtime makes a read-only check pass of its own. A method with a
      preliminary exchange may instead let NaN/Inf through :meth:`prepare` into its preliminary
      values (a norm, P = MQ): the runtime looks for them there, on the worker's own small values,
      before they are combined (a finite input must then give finite preliminary values, or
      :meth:`prepare` raises ``OverflowError``).
    * ``propagates_nonfinite`` (summable methods): every NaN/Inf of the input reaches the summed wire
      tensors at its own position (no compression, or a cast), and :meth:`decode_sum` checks the
      mean it forms, in the pass that divides by n. The runtime checks every rank's input before it is
      sent (a NaN/Inf gradient is flagged in-band: see :mod:`gradpress.exchange.protocol`), so a non-finite
      mean there means that the sum overflowed: an ``OverflowError`` on every rank.
    * ``divides_first`` (summable, linear methods whose wire values are their input's, no compression):
      each worker may send ``x / n`` instead of ``x``, so that the sum is the mean (as PyTorch's DDP
      divides before its all-reduce). The runtime then divides a writable input in place, in the pass
      that checks it for NaN/Inf (:meth:`compress_divided`), and :meth:`decode_sum` only checks the
      sum for overflow: one pass over the gradient before the exchange instead of a check there and a
      division after it. For n a power of two the bits are those of dividing the sum (scaling by 2⁻ᵏ
      is exact), for other n each summand is rounded once more.
    * ``saturates``: decoded float32 values may lie beyond the range of an fp16/bf16 input dtype
      although the input did not (an unbiased estimate's support, as QSGD's norm·l/s; a rounding up, as
      65504 to bf16's 65536): where the base class casts a decoded mean back to such a dtype it first
      clamps it to ±``finfo(dtype).max`` (:func:`saturate`), so finite input gives finite output. Only
      such outliers move, towards the range the true mean lies in. A float32 decode is never clamped:
      a method whose float32 arithmetic may overflow (random-k's d/k·x, the sketch's sums) deals with
      it itself; methods that decode themselves (THC, PowerSGD, the sketch) saturate in their decode.
    * ``stateful_decode``: :meth:`decode_sum` updates per-key state that every rank must keep alike
      (PowerSGD's warm start). In ``ps`` mode with a master compressor the server then broadcasts the
      sums as well, and every rank decodes them. Such a method's :meth:`state_dict` is that state alone:
      it carries over to a world of another size (``on_world_size_change="reset"``).
    * ``elementwise``: compress and decode map each element alone, with no per-tensor statistics,
      randomness or state (no compression, a cast): the packet of a concatenation is the
      concatenation of the packets. The runtime then exchanges tensors that lie back to back in one
      storage (a DDP bucket's gradients) as one tensor, with the same result bit for bit.
    * ``fuses_residual``: :meth:`compress` can form the residual x − decompress(packet) while it
      compresses (its ``residual`` argument), which the runtime then uses for the error-feedback memory.

    Runtime hooks (all optional, with defaults that fit single-round methods; see :mod:`gradpress.exchange.strategy`):

    * :attr:`exchange`: ``"allreduce"`` (summable) or ``"allgather"``: how the packets meet.
    * :meth:`prepare`: a preliminary exchange of a few values before compressing (THC's max norm,
      uniform THC's min/max, CLT-k's leader indices, PowerSGD's P); its result reaches
      ``_compress(flat, ctx, prepared)``.
    * :meth:`summands` / :meth:`decode_sum` / :attr:`max_summand`: what an aggregator adds element-wise
      (THC: the table values T[z], not the packed indices) and how the sum decodes; integer summands
      declare their largest magnitude so sums never wrap (invariant: no silent integer wrap, docs/design.md).
    * :meth:`state_dict` / :meth:`load_state_dict`: per-key state of the method itself (warm starts).
    * :attr:`linear` (summable methods): decoding the sum equals summing the decodes, so the all-reduce
      gives exactly the mean of what each worker sent (THC's homomorphism, random-k with shared
      indices). S2's count sketches are summable but not linear: the median over rows and the bitmap
      mask make the decoded sum an estimate of the summed gradient, not the sum of the estimates.

    Fused fast paths (optional, inherited from :class:`gradpress.core.fused.FusedPaths`, whose defaults
    compose the steps above): ``compress_sum``, ``compress_residual_sum``, ``prepare_sum``,
    ``compress_divided`` and ``accumulate_into``, which a method overrides to do two passes in one.
    """

    name: ClassVar[str] = ""
    unbiased: ClassVar[bool] = False
    summable: ClassVar[bool] = False
    kept: ClassVar[str | None] = None
    examples: ClassVar[tuple[str, ...]] = ()
    checks_finite: ClassVar[bool] = False
    max_summand: ClassVar[int | None] = None
    linear: ClassVar[bool] = True
    propagates_nonfinite: ClassVar[bool] = False
    elementwise: ClassVar[bool] = False
    stateful_decode: ClassVar[bool] = False
    saturates: ClassVar[bool] = False
    divides_first: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_params_of(self)  # the declared ranges (gradpress.core.registry.param), also when built directly
        self._calls = itertools.count()

    @property
    def default_feedback(self) -> str:
        return "none" if self.unbiased else "residual"

    # -- public API -------------------------------------------------------------------------------
    def compress(self, x: torch.Tensor, ctx: Context | None = None, *,
                 prepared: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> Packet:
        """Compress ``x`` (fp32, fp16 or bf16, any shape, contiguous or not) into a :class:`Packet`.

        ``prepared``: the combined result of the preliminary exchange, for a method that has one
        (:meth:`prepare`); without it the method prepares alone, as a world of one worker.
        ``residual``: a float32 tensor of x's size, possibly x itself, into which a method that
        :attr:`fuses_residual` may write x − decompress(packet) as it compresses (up to float rounding),
        for :meth:`residual` to return; x given as its own target no longer holds its values afterwards.
        Other methods ignore it.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.spec}: expected a tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{self.spec}: expected a float32, float16 or bfloat16 tensor, got {x.dtype}")
        if ctx is None:
            ctx = Context(step=next(self._calls))
        flat = x.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if flat.numel() == 0:
            return Packet({}, x.shape, x.dtype)
        if not self.checks_finite:
            check_finite(flat, self.spec)
        if self.prepares:
            if prepared is None:
                own = self.prepare(flat.view(x.shape), ctx, 1)
                prepared = None if own is None else own.values
            if residual is not None and self.fuses_residual:
                packet = self._compress(flat, ctx, prepared, residual=residual)  # type: ignore[call-arg]
            else:
                packet = self._compress(flat, ctx, prepared)  # type: ignore[call-arg]
        else:
            if prepared is not None:
                raise TypeError(f"{self.spec}: has no preliminary exchange, but got prepared values")
            packet = self._compress(flat, ctx)
        packet.shape, packet.dtype = x.shape, x.dtype
        return packet

    def decompress(self, packet: Packet) -> torch.Tensor:
        """The tensor a packet stands for, with the shape and dtype that were compressed."""
        if packet.numel == 0:
            return torch.zeros(packet.shape, dtype=packet.dtype, device=packet.device)
        flat = self._decompress(packet)
        if self.saturates and packet.dtype != torch.float32:
            storage = flat.untyped_storage().data_ptr()  # a wire tensor itself is not clamped in place
            owned = all(t.untyped_storage().data_ptr() != storage for t in packet.wire())
            flat = saturate(flat, packet.dtype, inplace=owned)
        return flat.to(packet.dtype).view(packet.shape)

    def aggregate(self, packets: list[Packet], out: torch.Tensor | None = None) -> torch.Tensor:
        """Combine every worker's packet into the averaged gradient (all-gather strategy).

        The mean of the decoded packets, accumulated in float32 (:meth:`accumulate_into`: the first
        packet stored into the total, the last added and divided by their count, so that a fused decoder
        makes no pass of its own for the zeros or the division); methods with their own rule (e.g. a
        majority vote) override this. ``out``: a tensor of the packets' shape that may be overwritten
        (the gradient being averaged); a contiguous float32 one receives the mean in place of a new
        tensor (the runtime hands over received copies, never views of ``out``).
        """
        first = packets[0]
        if first.numel == 0:
            return self.decompress(first)
        total = float32_output(out, first.numel)
        if total is None:
            total = torch.empty(first.numel, dtype=torch.float32, device=first.device)
        n = len(packets)
        for i, packet in enumerate(packets):  # the first stored, the last added and divided by n
            nonfinite = self.accumulate_into(total, packet, store=i == 0, count=n if i == n - 1 else 0)
        if nonfinite:  # finite decodes whose float32 sum overflowed?
            wide = torch.zeros(first.numel, dtype=torch.float64, device=first.device)
            for packet in packets:  # the mean in float64 (rare: only near float32's largest values)
                wide += self._decompress(packet).double()
            total.copy_(divide(wide, n, out=wide))
        if self.saturates and first.dtype != torch.float32:
            saturate(total, first.dtype)
        return total.to(first.dtype).view(first.shape)

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """``total += decompress(packet)`` on a flat float32 ``total``, the same bits (:meth:`aggregate`
        sums the workers' packets with it). Sparse methods override it to add only what they sent;
        element-wise quantizers (natural, the dithering family, 8-bit, 1-bit, EF-sign, INCEPTIONN,
        SketchML) to decode into ``total`` in one pass on the CPU, without a decoded temporary."""
        total += self._decompress(packet).float()

    def residual(self, x: torch.Tensor, packet: Packet, owned: bool = False) -> torch.Tensor:
        """``x − decompress(packet)`` in float32, what compression dropped (GRACE Eq. 5's memory update),
        the same bits. ``packet`` is ``compress(x)`` (or of ``x`` cast to the gradient's dtype);
        ``owned``: the caller no longer needs ``x``, which may then hold the result. Sparse methods
        override it to touch only what they sent."""
        return x.float() - self.decompress(packet).float()

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
        """The paper's wire cost in bytes for a tensor of ``numel`` elements (None if data-dependent).

        The runtime reads a non-None answer as "the wire layout depends only on numel and dtype" and
        all-gathers such packets without first exchanging their sizes.
        """
        return None

    # -- runtime hooks ------------------------------------------------------------------------------
    fuses_residual: ClassVar[bool] = False
    """Whether :meth:`compress` can form the residual x − decompress(packet) while compressing (its
    ``residual`` argument, used by the runtime when the memory updates from :meth:`residual`); for
    now only methods with a preliminary exchange (THC)."""

    @property
    def exchange(self) -> str:
        """How packets meet (GRACE Algorithm 1 lines 7-14): ``"allreduce"`` sums :meth:`summands` and
        decodes once; ``"allgather"`` decodes every worker's packet and combines them with :meth:`aggregate`.
        A summable method may still choose ``"allgather"`` (e.g. when its summands are much wider than
        its packet); parameter-server and switch modes use the summands of any summable method."""
        return "allreduce" if self.summable else "allgather"

    @property
    def prepares(self) -> bool:
        """Whether this method has a preliminary exchange (overrides :meth:`prepare`)."""
        return type(self).prepare is not Compressor.prepare

    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary | None:
        """Values to combine over the workers before compressing ``x`` (the tensor being compressed,
        with its own shape: contiguous, finite, non-empty; ``x.reshape(-1)`` is what ``_compress`` gets).

        A method that overrides this implements ``_compress(flat, ctx, prepared)``, where ``prepared``
        is the combined ``values``, in the shape ``values`` had (THC Algorithm 1 "Preliminary stage";
        ScaleCom's leader broadcast; PowerSGD's P = M Q, all-reduced before Q = Mᵀ P̂ is computed).
        It may run on one thread while another decodes an earlier tensor: keep state per key.
        """
        return None

    def summands(self, packet: Packet) -> list[torch.Tensor]:
        """The tensors an aggregator adds element-wise over the workers (default: the wire tensors).

        Integer summands (THC's table values, natural compression's fixed-point integers) require
        :attr:`max_summand`; the runtime then sums them in a dtype that holds ``max_summand · n``.
        Bool summands add as a logical or (torch.distributed's SUM on bool), which never wraps.
        """
        return list(packet.wire())

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean over ``count`` workers from the element-wise sum of their :meth:`summands`.

        ``packet`` is this worker's own packet (its structure and metadata); integer sums may arrive
        in a wider dtype than :meth:`summands` produced. The summed tensors belong to the runtime: this
        may overwrite them. ``out``: a tensor of the packet's shape that may be overwritten and shares
        no storage with ``summed`` (the gradient being averaged, a DDP bucket's): a method that decodes
        into a new float32 tensor (THC, S2's sketch, PowerSGD's P̂ Qᵀ) writes that float32 mean into a
        contiguous float32 ``out`` instead (:func:`float32_output`), so that it need not be copied
        there (a packet of another dtype is then cast from it). Default: decompress the summed packet
        and divide by ``count`` in float32 (GRACE Algorithm 1 line 9: g = Q⁻¹(Allreduce(g̃)) / n), in
        place where the dtype allows, in the pass that checks the mean: the workers' values are finite,
        so an Inf/NaN there means that their sum overflowed the wire's dtype (two fp16 values of 40000,
        two float32 ones of 3e38, whose mean is in range): an ``OverflowError`` on every rank, which
        all hold the same sums.
        """
        if packet.numel == 0:
            return self.decompress(packet)
        if "divided" in packet.meta:  # the mean already: each worker sent x / count
            return self._divided_mean(packet, summed, count)
        flat = self._decompress(packet.with_wire(summed)).float()
        bad = divide_counting_nonfinite(flat, count)  # (one pass for both on the CPU)
        if bad:  # every worker's values were finite (a NaN/Inf gradient is flagged before it is sent)
            wire = summed[0].dtype if summed else "its dtype"
            raise OverflowError(f"{self.spec}: the sum of the workers' values overflowed {wire}: the "
                                f"aggregate holds {bad} Inf/NaN value(s) out of {flat.numel()}")
        if self.saturates and packet.dtype != torch.float32:
            saturate(flat, packet.dtype)
        return flat.to(packet.dtype).view(packet.shape)

    def state_dict(self) -> dict[str, Any]:
        """Per-key state of the method itself (e.g. PowerSGD's warm-start Q), saved with the runtime's."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def check_state(self, state: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> None:
        """Raise ``ValueError`` naming the key if :meth:`state_dict`'s ``state`` does not fit tensors of
        ``shapes`` (key -> shape); the runtime calls it before loading (finiteness is checked there)."""

    @property
    def spec(self) -> str:
        """Canonical spec string that :func:`make` turns back into this compressor."""
        return format_spec(self)

    def __repr__(self) -> str:
        return f"gradpress.make({self.spec!r})"

    # -- to implement -------------------------------------------------------------------------------
    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        raise NotImplementedError

    def _decompress(self, packet: Packet) -> torch.Tensor:
        raise NotImplementedError


registry: Registry[Compressor] = Registry("compressor")

#: The class-level facts a method may declare (each documented in :class:`Compressor`): plain class
#: attributes (``examples = ("topk:ratio=0.1",)``), never annotated fields, which would be spec keys.
FACTS = ("unbiased", "summable", "kept", "examples", "default_feedback", "checks_finite", "max_summand",
         "linear", "propagates_nonfinite", "elementwise", "stateful_decode", "saturates", "divides_first",
         "fuses_residual")


def register(name: str) -> Callable[[type[Compressor]], type[Compressor]]:
    """``@register("name")`` on a ``@dataclass`` subclass of :class:`Compressor` (its fields are the
    spec keys) adds a method: ``make("name:key=value")`` builds it, and the property suite, the
    multi-process suite and ``gradpress list --markdown`` (the README's table) pick it up. A plain
    ``@dataclass``'s generated ``__repr__`` gives way to the compressor's own (``gradpress.make(spec)``,
    which round-trips); a fact of :data:`FACTS` declared as an annotated field is refused, saying so."""
    def decorate(cls: type[Compressor]) -> type[Compressor]:
        if dataclasses.is_dataclass(cls):
            facts = [f.name for f in dataclasses.fields(cls) if f.name in FACTS]
            if facts:
                raise TypeError(f"{cls.__name__}: {', '.join(facts)} is a class-level fact, not a spec parameter: "
                                f"write it without a type annotation (e.g. `examples = (...)`) or as ClassVar[...]")
            if cls.__dataclass_params__.repr:
                cls.__repr__ = Compressor.__repr__
        return registry.register(name)(cls)

    return decorate


def make(spec: str, **overrides: Any) -> Compressor:
    """Build a compressor from a spec: ``"topk:ratio=0.01"``, or a composition ``"topk:ratio=0.01+natural"``.

    ``A+B`` applies ``B`` to the values ``A`` keeps (Natural compression paper, Table 1 row
    C_nat∘S^q and Thm 3). Keyword overrides apply to a single (not composed) spec.
    """
    if "+" in spec:
        if overrides:
            raise ValueError(f"overrides {sorted(overrides)} are ambiguous for the composition {spec!r}")
        head, _, tail = spec.partition("+")
        return Compose(make(head), make(tail))
    return registry.make(spec, **overrides)


def compressor_names() -> list[str]:
    """Names of every registered compressor."""
    return registry.names()


@dataclass(repr=False)
class Compose(Compressor):
    """``A+B``: compress with ``A``, then compress the values ``A`` keeps with ``B``.

    Natural compression paper, Thm 3: if A ∈ B(ω1) and B ∈ B(ω2) then B∘A ∈ B(ω1ω2 + ω1 + ω2); e.g.
    natural compression of random-k values (Table 1, row C_nat∘S^q) costs a factor 9/8 in variance for a
    3.6× smaller value stream.
    """

    first: Compressor
    second: Compressor

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.first.kept is None:
            raise ValueError(f"{self.first.spec!r} keeps no value tensor for {self.second.spec!r} to compress")
        if self.first.expected_nbytes(1 << 16) is None:
            # a receiver rebuilds the second stage's packet with its own count of kept values
            raise ValueError(f"{self.first.spec!r} keeps a data-dependent number of values, which a second stage "
                             f"({self.second.spec!r}) cannot be decoded for on another worker yet: compose a "
                             "fixed-size first stage (topk, randomk, blocktopk, or a cast)")

    @property
    def kept(self) -> str:  # type: ignore[override]
        assert self.first.kept is not None  # (checked as it is built)
        return self.first.kept

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self.first.unbiased and self.second.unbiased

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.first.summable and self.second.summable

    @property
    def saturates(self) -> bool:  # type: ignore[override]
        return self.first.saturates or self.second.saturates

    @property
    def spec(self) -> str:
        return f"{self.first.spec}+{self.second.spec}"

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
        whole = self.first.expected_nbytes(numel, dtype)
        kept = self.first.kept_numel(numel) if hasattr(self.first, "kept_numel") else None
        if whole is None or kept is None:
            return None
        inner = self.second.expected_nbytes(kept, dtype)
        if inner is None:
            return None
        value_bytes = kept * dtype.itemsize
        return whole - value_bytes + inner

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        packet = self.first._compress(flat, ctx)
        packet.shape, packet.dtype = flat.shape, flat.dtype
        values = packet[self.kept]
        packet.tensors[self.kept] = self.second.compress(values, ctx.with_key(ctx.key + "/" + self.kept))
        return packet

    def _decompress(self, packet: Packet) -> torch.Tensor:
        inner = packet.tensors[self.kept]
        assert isinstance(inner, Packet)
        tensors = dict(packet.tensors)
        tensors[self.kept] = self.second.decompress(inner)
        return self.first._decompress(Packet(tensors, packet.shape, packet.dtype, packet.meta))
