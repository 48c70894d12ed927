"""INCEPTIONN's lossy gradient encoding (Li et al., MICRO 2018; GRACE §3.1).

Most gradient values lie in (−1, 1), and those close to 0 matter least. INCEPTIONN picks, by the range of
each value, one of four representations named by a 2-bit tag: 32 bits (|x| ≥ 1, sent as is), 16 bits,
8 bits, or 0 bits (|x| below the error bound ε: nothing is sent, it decodes to 0). The 16- and 8-bit
forms are fixed point, so a value below 1 keeps only the bits that matter at the bound. The paper does
this in the NIC's FPGA; here numba kernels do it on the CPU, torch elsewhere (same bytes). With ε = 2^-k:

==== ===================== ============================================= ===============
tag  range of |x|          payload                                       error
==== ===================== ============================================= ===============
0    |x| < ε               none                                          < ε
1    ε ≤ |x| < 128·ε       1 byte: sign, m = ⌊|x|/ε⌋ (7 bits) → (m + ½)·ε    ≤ ε/2
2    128·ε ≤ |x| < 1       2 bytes: sign, m = ⌊|x|·2^15⌋ → (m + ½)·2^-15    ≤ 2^-16 ≤ ε/2
3    |x| ≥ 1               4 bytes: the float32 value                    0
==== ===================== ============================================= ===============

ε = 2^-10 by default, the bound the paper found to keep accuracy; the error is below ε everywhere.

Wire: the tags packed 4 to a byte (element i at bits 2·(i mod 4)), and one byte stream with each
element's payload after the previous one's (multi-byte payloads little-endian): 2 + 8, 16 or 32 bits
per element, variable size. Deterministic, biased; GRACE Table 1 runs it without error feedback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from gradpress._numba import as_numpy, jit, use_numba
from gradpress.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.compressor import Compressor, register
from gradpress.compressors.onebit import as_float32
from gradpress.packet import Packet
from gradpress.rng import Context

FINE_STEP = 2.0**-15  # the 16-bit form's resolution
PAYLOAD_BYTES = (0, 1, 2, 4)  # by tag


@register("inceptionn")
@dataclass(repr=False)
class INCEPTIONN(Compressor):
    """INCEPTIONN (Li et al., MICRO 2018): a 2-bit tag per value selects a 0-, 8-, 16- or 32-bit form by
    its range, with error bound ε (a power of two in [2^-15, 2^-7]); the table is in the module
    docstring."""

    error_bound: float = 2.0**-10
    examples = ("inceptionn:error_bound=1/128", "inceptionn:error_bound=1/32768")

    def __post_init__(self) -> None:
        super().__post_init__()
        mantissa, exponent = math.frexp(self.error_bound)
        if mantissa != 0.5 or not -15 <= exponent - 1 <= -7:
            raise ValueError(f"inceptionn: error_bound must be a power of two in [2^-15, 2^-7], "
                             f"got {self.error_bound}")

    @property
    def default_feedback(self) -> str:
        return "none"

    def tags(self, x: torch.Tensor) -> torch.Tensor:
        """The 2-bit tag of each element (uint8, 0..3), by the range of |x|."""
        a = as_float32(x).abs()
        eps = self.error_bound
        return (a >= eps).to(torch.uint8) + (a >= 128 * eps).to(torch.uint8) + (a >= 1.0).to(torch.uint8)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = as_float32(flat)
        n = x.numel()
        if use_numba(x):
            tags = torch.empty(packed_nbytes(n, 2), dtype=torch.uint8)
            payload = torch.empty(4 * n + 4, dtype=torch.uint8)
            size = _encode(as_numpy(x), np.float32(self.error_bound), as_numpy(tags), as_numpy(payload))
            return Packet({"tags": tags, "payload": payload[:size].clone()}, flat.shape, flat.dtype)
        tag = self.tags(x)
        words = self._words(x, tag).view(torch.uint8).view(n, 4)  # little-endian bytes of each word
        keep = torch.arange(4, device=x.device) < _payload_bytes(tag).unsqueeze(1)
        return Packet({"tags": pack_bits(tag, 2), "payload": words[keep]}, flat.shape, flat.dtype)

    def _words(self, x: torch.Tensor, tag: torch.Tensor) -> torch.Tensor:
        """Each element's payload in the low bytes of an int32 (torch path)."""
        a, sign = x.abs().clamp(max=1.0), torch.signbit(x).to(torch.int32)
        small = (a / self.error_bound).to(torch.int32) & 0x7F | sign << 7
        fine = (a / FINE_STEP).to(torch.int32) & 0x7FFF | sign << 15
        return torch.where(tag == 3, x.view(torch.int32), torch.where(tag == 2, fine, small))

    def _decompress(self, packet: Packet) -> torch.Tensor:
        n = packet.numel
        payload = packet["payload"]
        if use_numba(payload):
            out = torch.empty(n, dtype=torch.float32)
            padded = np.zeros(payload.numel() + 4, dtype=np.uint8)  # words read past the end stay in bounds
            padded[:payload.numel()] = as_numpy(payload)
            _decode_kernel(as_numpy(packet["tags"]), _value_table(self.error_bound, 8),
                           _FINE_FLOATS, padded, as_numpy(out))
            return out
        tag = unpack_bits(packet["tags"], 2, n)
        size = _payload_bytes(tag)
        start = torch.cumsum(size, 0) - size
        padded = torch.cat([payload, payload.new_zeros(4)]).to(torch.int64)
        word = sum(padded[start + k] << (8 * k) for k in range(4))
        small = ((word & 0x7F).float() + 0.5) * self.error_bound
        fine = ((word & 0x7FFF).float() + 0.5) * FINE_STEP
        value = torch.where(tag == 1, _signed(small, word >> 7 & 1), _signed(fine, word >> 15 & 1))
        raw = (word & 0xFFFFFFFF).to(torch.int64).to(torch.int32).view(torch.float32)
        return torch.where(tag == 3, raw, torch.where(tag == 0, 0.0, value))


def _payload_bytes(tag: torch.Tensor) -> torch.Tensor:
    return torch.tensor(PAYLOAD_BYTES, device=tag.device)[tag.long()]


def _signed(magnitude: torch.Tensor, sign_bit: torch.Tensor) -> torch.Tensor:
    return torch.where(sign_bit.bool(), -magnitude, magnitude)


BLOCK = 4096  # elements per block: the kernels' scratch stays in the L1/L2 cache


@jit
def _encode(x, eps, tags, payload):  # pragma: no cover - compiled
    """Tags packed 4 per byte and payloads appended to one byte stream; returns the stream's length.

    Block by block: first every element's tag and payload word, then the words appended, each written
    as 4 bytes at the stream's end, which advances by the payload's size (0, 1, 2 or 4 bytes; no
    branch), then the block's tags packed.
    """
    n = x.size
    bits = x.view(np.int32)
    words = np.empty(BLOCK, dtype=np.int64)
    tag_of = np.empty(BLOCK, dtype=np.uint8)
    size = 0
    for start in range(0, n, BLOCK):
        count = min(BLOCK, n - start)
        _words(x[start:start + count], bits[start:start + count], eps, words, tag_of)
        for i in range(count):
            word = words[i]
            tag = np.int64(tag_of[i])
            payload[size] = word & 0xFF
            payload[size + 1] = (word >> 8) & 0xFF
            payload[size + 2] = (word >> 16) & 0xFF
            payload[size + 3] = (word >> 24) & 0xFF
            size += tag + (tag >> 1) * (tag & 1)  # 0, 1, 2, 4
        tag_of[count:(count + 3) // 4 * 4] = 0  # the last byte's unused slots
        for j in range((count + 3) // 4):
            tags[start // 4 + j] = (tag_of[4 * j] | (tag_of[4 * j + 1] << 2) | (tag_of[4 * j + 2] << 4)
                                    | (tag_of[4 * j + 3] << 6))
    return size


@jit
def _words(x, bits, eps, words, tag_of):  # pragma: no cover - compiled
    """Each element's tag and payload word (in its low bytes). Tags 0 and 1 (the bulk of a gradient)
    are told apart without a branch; the rare |x| ≥ 128·ε takes one, well predicted."""
    inverse = np.float32(1.0) / eps
    coarse_limit = np.float32(128.0) * eps
    for i in range(x.size):
        v = x[i]
        a = abs(v)
        sign = np.int64(v < 0)
        tag = np.int64(a >= eps)
        word = (np.int64(min(a, coarse_limit) * inverse) & 0x7F) | (sign << 7)
        if a >= coarse_limit:
            if a < np.float32(1.0):
                tag = 2
                word = np.int64(a * np.float32(32768.0)) | (sign << 15)
            else:
                tag = 3
                word = np.int64(bits[i]) & 0xFFFFFFFF
        words[i] = word
        tag_of[i] = tag


def _value_table(step: float, bits: int) -> np.ndarray:
    """±(m + ½)·step (float32) for every ``bits``-bit code, the sign in the top bit."""
    code = np.arange(2**bits)
    magnitude = ((code & (2 ** (bits - 1) - 1)) + 0.5) * step
    return np.where(code >> (bits - 1), -magnitude, magnitude).astype(np.float32)


_FINE_FLOATS = _value_table(FINE_STEP, 16)


@jit
def _decode_kernel(tags, small_table, fine_table, payload, out):  # pragma: no cover - compiled
    """Each element reads its payload at the running position (``payload`` is padded by 4); tags 0
    and 1 decode without a branch, the rare 2 and 3 take one; a float32 payload is written through the
    output's bit view."""
    n = out.size
    out_bits = out.view(np.uint32)
    tag_of = np.empty(BLOCK, dtype=np.uint8)
    position = 0
    for start in range(0, n, BLOCK):
        count = min(BLOCK, n - start)
        for j in range((count + 3) // 4):
            t = tags[start // 4 + j]
            tag_of[4 * j] = t & 3
            tag_of[4 * j + 1] = (t >> 2) & 3
            tag_of[4 * j + 2] = (t >> 4) & 3
            tag_of[4 * j + 3] = t >> 6
        for k in range(count):
            i = start + k
            tag = np.int64(tag_of[k])
            b0 = np.int64(payload[position])
            value = small_table[b0]
            out[i] = value if tag == 1 else np.float32(0.0)
            if tag >= 2:
                b1 = np.int64(payload[position + 1])
                if tag == 2:
                    out[i] = fine_table[b0 | (b1 << 8)]
                else:
                    out_bits[i] = (b0 | (b1 << 8) | (np.int64(payload[position + 2]) << 16)
                                   | (np.int64(payload[position + 3]) << 24))
            position += tag + (tag >> 1) * (tag & 1)  # 0, 1, 2, 4
