"""No compression and plain casts (GRACE Table 1's baseline; fp16 as in PyTorch's ``fp16_compress_hook``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, NoReturn

import numpy as np
import torch

from gradpress.core.compressor import (
    Compressor,
    check_finite,
    count_nonfinite,
    register,
    scaled_sum,
    sum_addends,
)
from gradpress.core.packet import Packet
from gradpress.core.rng import Context
from gradpress.kernels.jit import (
    bits_of_f32,
    f16_bits_of_f32,
    f32_from_bits,
    f32_of_f16_bits,
    jit,
    use_numba,
    wide_vectors,
)


@register("none")
@dataclass(repr=False)
class NoCompression(Compressor):
    """Sends the gradient as it is: the uncompressed baseline (32 bits per fp32 element)."""

    unbiased = True
    summable = True
    kept = "values"
    propagates_nonfinite = True
    elementwise = True
    divides_first = True  # as PyTorch's DDP: each worker sends g / n, one pass that also checks g

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel * dtype.itemsize

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
    """A cast whose rounding may overflow the wire format: the wire values are checked, NaN/Inf of the
    input raising :class:`~gradpress.core.compressor.NonFiniteError`, finite values that round to ±Inf an
    ``OverflowError``.

    A float32 CPU tensor is cast by one numba pass that also keeps the largest exponent field of the
    16-bit results (all ones: an Inf or NaN among them), the bits of ``Tensor.to`` (round to nearest
    even; tests compare both paths); elsewhere the torch cast and a check pass over the 16-bit values."""

    checks_finite = True  # NaN/Inf input is NaN/Inf in the 16-bit values, which are checked anyway
    precision = ""
    #: the format's numba pass: float32 values (and the addends of a sum) -> its int16 bits, returning the
    #: largest exponent field; and that field's all-ones value (Inf or NaN among the results)
    _kernel: ClassVar[Callable[..., int]]
    _all_ones: ClassVar[int]

    def compress(self, x: torch.Tensor, ctx: Context | None = None, *,
                 prepared: torch.Tensor | None = None, residual: torch.Tensor | None = None) -> Packet:
        """The base class's :meth:`~gradpress.core.compressor.Compressor.compress`, with a shortcut for the
        common case (a non-empty contiguous float32 CPU tensor): a cast is a single memory pass, so the
        checks and calls around it are a visible part of its cost."""
        if type(x) is torch.Tensor and x.dtype is torch.float32 and prepared is None and x.is_contiguous() \
                and use_numba(x) and x.numel():
            return self._cast(x.detach(), x.shape)
        return super().compress(x, ctx, prepared=prepared, residual=residual)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        if flat.dtype == torch.float32 and use_numba(flat):
            return self._cast(flat, flat.shape)
        packet = super()._compress(flat, ctx)
        if count_nonfinite(packet["values"]):
            self._refuse(flat, packet["values"])
        return packet

    def _cast(self, x: torch.Tensor, shape: torch.Size) -> Packet:
        """One numba pass: the 16-bit values of contiguous float32 ``x`` (any shape, flattened), checked
        on the way."""
        bits = torch.empty(x.numel(), dtype=torch.int16)
        values = x.numpy()
        top = self._kernel(values if values.ndim == 1 else values.reshape(-1), bits.numpy())
        wire = bits.view(self.wire_dtype)
        if top == self._all_ones:
            self._refuse(x.reshape(-1), wire)
        return Packet({"values": wire}, shape, torch.float32)

    def compress_residual_sum(self, memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor,
                              ctx: Context | None = None, beta: float = 1.0,
                              gamma: float = 1.0) -> tuple[Packet, bool]:
        """The cast of φ = β·m + γ·g and its residual e = φ − float32(cast(φ)) in one numba pass (see
        :meth:`Compressor.compress_residual_sum`): φ is never stored, ``out`` receives e, the bits of
        :meth:`compress_sum` then :meth:`residual`. On NaN/Inf or overflow ``out`` holds φ when the
        error is raised."""
        addends = sum_addends(memory, grad, out, beta, gamma)
        if addends is None:
            return super().compress_residual_sum(memory, grad, out, ctx, beta, gamma)
        bits = torch.empty(out.numel(), dtype=torch.int16)
        x = out.view(-1)
        top = self._kernel(x.numpy(), bits.numpy(), addends)
        values = bits.view(self.wire_dtype)
        if top == self._all_ones:
            self._refuse(scaled_sum(memory, grad, beta, gamma, out).view(-1), values)  # with φ in out
        return Packet({"values": values}, out.shape, torch.float32), True

    def decompress(self, packet: Packet) -> torch.Tensor:
        """The wire values as the dtype compressed (the base class's, with its checks short-cut for a
        packet of this class's own float32 cast)."""
        values = packet.tensors.get("values")
        if packet.dtype is torch.float32 and type(values) is torch.Tensor and values.dtype is self.wire_dtype \
                and values.numel():
            out = values.float()
            return out if out.shape == packet.shape else out.view(packet.shape)
        return super().decompress(packet)

    def _refuse(self, flat: torch.Tensor, values: torch.Tensor) -> NoReturn:
        """Raise for wire values holding NaN/Inf: NonFiniteError if the input does, else OverflowError."""
        check_finite(flat, self.spec)  # NaN/Inf in the input itself: a NonFiniteError
        overflowed = count_nonfinite(values)
        limit = torch.finfo(self.wire_dtype).max
        raise OverflowError(f"{self.name}: {overflowed} value(s) beyond ±{limit:g} cannot be sent in "
                            f"{self.precision}")


#: elements per block of the cast kernels: the largest exponent field is kept per block of a fixed trip
#: count, which LLVM vectorizes with its max reduction (over the whole loop the reduction made the cast
#: 12 % slower than ``Tensor.half()``; blocked, 5 % faster)
_BLOCK = 4096


def _blocked_cast(at):
    """A cast kernel ``(x, bits, addends=None) -> largest exponent field`` applying ``at(x, out, i,
    addends)`` (which writes out[i] and returns its exponent field) to every i < x.size, in blocks of
    ``_BLOCK`` and then the tail."""

    @jit
    def kernel(x, bits, addends=None):  # pragma: no cover - compiled
        wide_vectors()
        out = bits.view(np.uint16)
        top = np.uint16(0)
        whole = x.size - x.size % _BLOCK
        for start in range(0, whole, _BLOCK):
            block_top = np.uint16(0)
            for j in range(_BLOCK):
                block_top = max(block_top, at(x, out, start + j, addends))
            top = max(top, block_top)
        for i in range(whole, x.size):
            top = max(top, at(x, out, i, addends))
        return top

    return kernel


@jit
def _f16_at(x, out, i, addends):  # pragma: no cover - compiled
    """out[i] = fp16 bits of x[i] (or of φ_i, x[i] receiving the residual: see :func:`_to_f16`); its
    exponent field."""
    if addends is None:
        h = f16_bits_of_f32(x[i])
    else:
        v = addends[0][i] * addends[2] + addends[1][i] * addends[3]
        h = f16_bits_of_f32(v)
        x[i] = v - f32_of_f16_bits(h)
    out[i] = h
    return np.uint16(h & np.uint16(0x7C00))


_to_f16 = _blocked_cast(_f16_at)
_to_f16.__doc__ = """bits = fp16 bits of float32 x (``Tensor.to(torch.float16)``'s); the largest exponent field.
    ``addends`` (m, g, β, γ) or None: x is not read but written: the value cast is φ = fl32(fl32(m·β) +
    fl32(g·γ)), and x_i = φ_i − float32(half(φ_i)), what the cast dropped (fused error feedback; numba
    prunes the branch for None)."""


@jit
def _bf16_at(x, out, i, addends):  # pragma: no cover - compiled
    """out[i] = bf16 bits of x[i] (or of φ_i, x[i] receiving the residual: see :func:`_to_bf16`); its
    exponent field."""
    u = np.uint32
    if addends is None:
        b = bits_of_f32(x[i])
    else:
        v = addends[0][i] * addends[2] + addends[1][i] * addends[3]
        b = bits_of_f32(v)
    rounded = np.uint16(u(b + u(0x7FFF) + u(u(b >> u(16)) & u(1))) >> u(16))
    h = np.uint16(0x7FC0) if u(b & u(0x7FFFFFFF)) > u(0x7F800000) else rounded
    if addends is not None:
        x[i] = v - f32_from_bits(u(h) << u(16))
    out[i] = h
    return np.uint16(h & np.uint16(0x7F80))


_to_bf16 = _blocked_cast(_bf16_at)
_to_bf16.__doc__ = """bits = bf16 bits of float32 x, as c10::BFloat16 rounds (to nearest even; NaN to 0x7FC0); the
    largest exponent field. ``addends`` (m, g, β, γ) or None: as :func:`_to_f16`'s, x_i receives
    φ_i − float32(bf16(φ_i))."""


@register("fp16")
@dataclass(repr=False)
class FP16(_CheckedCast):
    """IEEE half precision: 16 bits per element; values beyond ±65504 raise ``OverflowError`` (they would
    be Inf), small ones lose precision below 2^-24."""

    wire_dtype = torch.float16
    precision = "half precision"
    _kernel = staticmethod(_to_f16)
    _all_ones = 0x7C00  # the exponent field of Inf and NaN


@register("bf16")
@dataclass(repr=False)
class BF16(_CheckedCast):
    """bfloat16: fp32's exponent range with an 8-bit mantissa; 16 bits per element. fp32 values that
    round beyond bf16's largest (±3.39e38) raise ``OverflowError``; an fp16 gradient's ±65504 rounds to
    ±65536 and decodes saturated at ±65504."""

    wire_dtype = torch.bfloat16
    precision = "bfloat16"
    _kernel = staticmethod(_to_bf16)
    _all_ones = 0x7F80
    saturates = True  # fp16 gradients: 65504 rounds to bf16's 65536
