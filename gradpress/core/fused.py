"""The fused fast paths of the compressor contract: an optional layer a method may override.

:class:`~gradpress.core.compressor.Compressor` inherits :class:`FusedPaths`, whose defaults compose the
contract's own steps (form error feedback's sum φ = β·m + γ·g, then :meth:`compress` it; decode, then
add; divide, then compress), with the same bits as those steps one by one. A method whose first pass
reads every element of its input overrides one to do the work of two passes in one:

* :meth:`FusedPaths.compress_sum` / :meth:`FusedPaths.compress_residual_sum` /
  :meth:`FusedPaths.prepare_sum`: φ formed in the method's first pass (its preliminary one, if it has
  one), and the residual e = φ − C⁻¹(C(φ)) too where the method can (the fused error feedback, GRACE
  Eq. 5).
* :meth:`FusedPaths.compress_divided`: a :attr:`~gradpress.core.compressor.Compressor.divides_first`
  method's packet of ``x / n``, divided in the pass that checks ``x`` for NaN/Inf (the DDP hook's mean).
* :meth:`FusedPaths.accumulate_into`: one step of an all-gather's mean folded into the decode's pass
  (:func:`gradpress.kernels.jit.fold_mode`, :func:`gradpress.core.numerics.finish_fold`).

Nothing here is needed to write a method: the contract (``_compress``, ``_decompress`` and the facts)
is :class:`~gradpress.core.compressor.Compressor`'s.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from gradpress.core.numerics import (
    FLOAT_DTYPES,
    any_nonfinite,
    count_nonfinite,
    divide_counting_nonfinite,
    nonfinite_error,
    scaled_sum,
)
from gradpress.core.packet import Packet
from gradpress.core.rng import Context

if TYPE_CHECKING:
    from gradpress.core.compressor import Preliminary


class FusedPaths:
    """The fused fast paths of :class:`~gradpress.core.compressor.Compressor` and their defaults (see
    the module docstring): each default gives the bits of the contract's steps one by one; a method
    overrides one to do them in fewer passes, with the same bits."""

    if TYPE_CHECKING:  # the contract these defaults are written in (gradpress.core.compressor.Compressor)
        divides_first: ClassVar[bool]

        @property
        def spec(self) -> str: ...

        def compress(self, x: torch.Tensor, ctx: Context | None = None, *,
                     prepared: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> Packet: ...

        def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary | None: ...

        def accumulate(self, total: torch.Tensor, packet: Packet) -> None: ...

        def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet: ...

        def _decompress(self, packet: Packet) -> torch.Tensor: ...

    def compress_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                     ctx: Context | None = None, beta: float = 1.0, gamma: float = 1.0) -> Packet:
        """``compress(memory * beta + grad * gamma)`` with that sum φ = β·m + γ·g (GRACE Eq. 5; torch's
        bits, :func:`scaled_sum`) formed in ``out`` (float32, contiguous, their shape), which holds φ
        afterwards whatever happens (the memory's update reads it). The default forms the sum, then
        compresses; a method whose first pass reads every element of its input forms the sum in that pass
        instead (one pass over the gradient fewer: the fused error feedback), with the same bits."""
        scaled_sum(memory, grad, beta, gamma, out)
        return self.compress(out, ctx)

    def compress_residual_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                              ctx: Context | None = None, beta: float = 1.0,
                              gamma: float = 1.0) -> tuple[Packet, bool]:
        """:meth:`compress_sum`, for a memory whose update is :meth:`residual` of φ and the packet (the
        ``residual`` memory, :attr:`~gradpress.core.feedback.Feedback.keeps_residual`): ``(packet, True)``
        when ``out`` holds that residual e = φ − C⁻¹(C(φ)) afterwards in place of φ, the same bits
        (an element-wise method forms it in its one pass: the memory's update has nothing left to do),
        ``(packet, False)`` when it holds φ (the default: :meth:`compress_sum`). On an error ``out``
        holds φ, as :meth:`compress_sum` leaves it."""
        return self.compress_sum(memory, grad, out, ctx, beta, gamma), False

    def compress_divided(self, x: torch.Tensor, count: int, ctx: Context | None = None, *,
                         inplace: bool = False) -> Packet:
        """The packet of ``x / count`` for a :attr:`divides_first` method, formed in the pass that checks
        ``x`` for NaN/Inf (which raise :class:`NonFiniteError`); ``inplace``: ``x`` may be overwritten
        (a DDP bucket), and is divided in place where it is contiguous (left divided in part on a
        raise). :meth:`decode_sum` of such packets' sum checks it and divides no more
        (``meta["divided"]``)."""
        if not self.divides_first:
            raise TypeError(f"{self.spec}: its summands cannot be divided before the exchange")
        if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{self.spec}: expected a float32, float16 or bfloat16 tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        flat = x.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if flat.numel():
            divided = flat if inplace and flat.data_ptr() == x.data_ptr() else torch.empty_like(flat)
            bad = divide_counting_nonfinite(flat, count, out=divided)
            if bad:
                raise nonfinite_error(self.spec, bad, flat.numel())
            flat = divided
        packet = self._compress(flat, ctx or Context()) if flat.numel() else Packet({}, x.shape, x.dtype)
        packet.shape, packet.dtype = x.shape, x.dtype
        packet.meta["divided"] = count
        return packet

    def _divided_mean(self, packet: Packet, summed: list[torch.Tensor], count: int) -> torch.Tensor:
        """:meth:`decode_sum` of the sum of :meth:`compress_divided`'s packets: already the mean (in the
        gradient's own dtype, as DDP's), checked for an overflow of the sum."""
        if packet.meta["divided"] != count:
            raise ValueError(f"{self.spec}: the summands were divided by {packet.meta['divided']} before "
                             f"the exchange, but the sum is of {count} workers")
        mean = self._decompress(packet.with_wire(summed))
        # two halves of finite values add to at most the format's largest exactly (x / 2 is exact, but for
        # subnormals), so rounding cannot overflow: only a mean over three or more is checked
        if count > 2 and any_nonfinite(mean.reshape(-1)):
            flat = mean.reshape(-1)
            raise OverflowError(f"{self.spec}: the sum of the workers' values overflowed: the aggregate holds "
                                f"{count_nonfinite(flat)} Inf/NaN value(s) out of {flat.numel()} (a worker's "
                                "NaN/Inf gradient is flagged before it is sent)")
        if mean.dtype != packet.dtype:
            mean = mean.to(packet.dtype)
        return mean if mean.shape == packet.shape else mean.view(packet.shape)

    def prepare_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, ctx: Context,
                    world_size: int, beta: float = 1.0, gamma: float = 1.0) -> Preliminary | None:
        """:meth:`prepare` of φ = β·m + γ·g (GRACE Eq. 5; torch's bits, :func:`scaled_sum`) formed in
        ``out`` (float32, contiguous, their shape), which holds φ afterwards whatever happens (it is what
        is compressed next): :meth:`compress_sum` for a method with a preliminary exchange. The default
        forms the sum, then prepares; a method whose preliminary pass reads every element forms φ in that
        pass instead (THC's norm: one pass over the gradient fewer)."""
        scaled_sum(memory, grad, beta, gamma, out)
        return self.prepare(out, ctx, world_size)

    def accumulate_into(self, total: torch.Tensor, packet: Packet, store: bool = False,
                        count: int = 0) -> int:
        """One step of :meth:`aggregate`'s sum on a flat float32 ``total``: ``total += decompress(packet)``,
        or (``store``, the first packet) ``total = 0.0 + decompress(packet)`` whatever ``total`` held, then
        (``count`` > 0, the last packet) ``total /= count``, the same bits as those steps one by one; returns
        how many of the results are NaN/Inf when ``count`` (else 0). This default zeroes, accumulates and
        divides in passes of their own; the fused decoders (natural, the dithering family, 8-bit, 1-bit)
        take :func:`gradpress.kernels.jit.fold_mode` and do it all in the decode's one pass
        (:func:`finish_fold` reads their result)."""
        if store:
            total.zero_()
        self.accumulate(total, packet)
        return divide_counting_nonfinite(total, count) if count else 0
