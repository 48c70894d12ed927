"""No compression and plain casts (GRACE Table 1's baseline; fp16 as in PyTorch's ``fp16_compress_hook``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gradpress.compressor import Compressor, check_finite, count_nonfinite, register
from gradpress.packet import Packet
from gradpress.rng import Context


@register("none")
@dataclass(repr=False)
class NoCompression(Compressor):
    """Sends the gradient as it is: the uncompressed baseline (32 bits per fp32 element)."""

    unbiased = True
    summable = True
    kept = "values"
    propagates_nonfinite = True
    elementwise = True

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * torch.empty((), dtype=dtype).element_size()

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        return Packet({"values": flat}, flat.shape, flat.dtype)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return packet["values"]


@dataclass(repr=False)
class _Cast(Compressor):
    """Round to a 16-bit float format (round-to-nearest-even, deterministic, so biased by < 1 ulp)."""

    wire_dtype = torch.float16
    summable = True
    kept = "values"
    propagates_nonfinite = True  # NaN stays NaN, Inf (and overflow) becomes Inf
    elementwise = True

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * numel

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        return Packet({"values": flat.to(self.wire_dtype)}, flat.shape, flat.dtype)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return packet["values"]


@dataclass(repr=False)
class _CheckedCast(_Cast):
    """A cast whose rounding may overflow the wire format: the wire values are checked (one pass over
    16-bit values), NaN/Inf of the input raising :class:`~gradpress.compressor.NonFiniteError`, finite
    values that round to ±Inf an ``OverflowError``."""

    checks_finite = True  # NaN/Inf input is NaN/Inf in the 16-bit values, which are checked anyway
    precision = ""

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        packet = super()._compress(flat, ctx)
        overflowed = count_nonfinite(packet["values"])
        if overflowed:
            check_finite(flat, self.spec)  # NaN/Inf in the input itself: a NonFiniteError
            limit = torch.finfo(self.wire_dtype).max
            raise OverflowError(f"{self.name}: {overflowed} value(s) beyond ±{limit:g} cannot be sent in "
                                f"{self.precision}")
        return packet


@register("fp16")
@dataclass(repr=False)
class FP16(_CheckedCast):
    """IEEE half precision: 16 bits per element; values beyond ±65504 raise ``OverflowError`` (they would
    be Inf), small ones lose precision below 2^-24."""

    wire_dtype = torch.float16
    precision = "half precision"


@register("bf16")
@dataclass(repr=False)
class BF16(_CheckedCast):
    """bfloat16: fp32's exponent range with an 8-bit mantissa; 16 bits per element. fp32 values that
    round beyond bf16's largest (±3.39e38) raise ``OverflowError``; an fp16 gradient's ±65504 rounds to
    ±65536 and decodes saturated at ±65504."""

    wire_dtype = torch.bfloat16
    precision = "bfloat16"
    saturates = True  # fp16 gradients: 65504 rounds to bf16's 65536
