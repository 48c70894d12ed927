"""INCEPTIONN's lossy gradient encoding (Li et al., MICRO 2018; GRACE §3.1).

Most gradient values lie in (−1, 1), and those close to 0 matter least. INCEPTIONN picks, by the range of
each value, one of four representations named by a 2-bit tag: 32 bits (|x| ≥ 1, sent as is), 16 bits,
8 bits, or 0 bits (|x| below the error bound ε: nothing is sent, it decodes to 0). The 16- and 8-bit
forms are fixed point, so a value below 1 keeps only the bits that matter at the bound. The paper does
this in the NIC's FPGA; here numba kernels do it on the CPU (in 512-bit vectors of 16 elements where
the CPU has AVX-512 VBMI2's byte compress/expand, see :mod:`.inceptionn_simd`, portable loops
elsewhere), torch on other devices, all writing the same bytes. With ε = 2^-k:

==== ===================== ============================================= ===============
tag  range of |x|          payload                                       error
==== ===================== ============================================= ===============
0    |x| < ε               none                                          < ε
1    ε ≤ |x| < 128·ε       1 byte: sign, m = ⌊|x|/ε⌋ (7 bits) → (m + ½)·ε    ≤ ε/2
2    128·ε ≤ |x| < 1       2 bytes: sign, m = ⌊|x|·2^15⌋ → (m + ½)·2^-15    ≤ 2^-16 ≤ ε/2
3    |x| ≥ 1               4 bytes: the float32 value                    0
==== ===================== ============================================= ===============

ε = 2^-10 by default, the bound the paper found to keep accuracy; the error is below ε everywhere.

Wire: the tags packed 4 to a byte (element i at bits 2·(i mod 4), unused slots 0), and one byte
stream with each element's payload after the previous one's (multi-byte payloads little-endian): 2 + 8,
16 or 32 bits per element, variable size. The encoder first finds the stream's size from the tags, so
it allocates it exactly; the decoder rejects a stream whose size the tags do not call for.
Deterministic, biased; GRACE Table 1 runs it without error feedback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from gradpress.compressors import inceptionn_simd as simd
from gradpress.compressors.onebit import as_float32
from gradpress.core.compressor import Compressor, check_finite, register
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context
from gradpress.kernels.bits import pack_bits, packed_nbytes, unpack_bits
from gradpress.kernels.jit import as_numpy, f32_from_bits, jit, kernel, use_numba

FINE_STEP = 2.0**-15  # the 16-bit form's resolution
PAYLOAD_BYTES = (0, 1, 2, 4)  # by tag


@register("inceptionn")
@dataclass(repr=False)
class INCEPTIONN(Compressor):
    """INCEPTIONN (Li et al., MICRO 2018): a 2-bit tag per value selects a 0-, 8-, 16- or 32-bit form by
    its range, with error bound ε (a power of two in [2^-15, 2^-7]); the table is in the module
    docstring."""

    error_bound: float = param(2.0**-10, "[2^-15, 2^-7]")  # and a power of two
    examples = ("inceptionn:error_bound=1/128", "inceptionn:error_bound=1/32768")
    checks_finite = True  # the numba kernel's first pass spots NaN/Inf; the torch path checks first

    def __post_init__(self) -> None:
        super().__post_init__()  # checks the declared range
        if math.frexp(self.error_bound)[0] != 0.5:
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
            return self._compress_numba(flat, x)
        check_finite(flat, self.spec)
        tag = self.tags(x)
        words = self._words(x, tag).view(torch.uint8).view(n, 4)  # little-endian bytes of each word
        keep = torch.arange(4, device=x.device) < _payload_bytes(tag).unsqueeze(1)
        return Packet({"tags": pack_bits(tag, 2), "payload": words[keep]}, flat.shape, flat.dtype)

    def _compress_numba(self, flat: torch.Tensor, x: torch.Tensor) -> Packet:
        """The numba kernels' two passes: the tags and the payload's size (NaN/Inf show there), then
        the payload."""
        bits = as_numpy(x).view(np.uint32)
        eps_bits, coarse_bits = _limits(self.error_bound)
        tags = torch.empty(packed_nbytes(x.numel(), 2), dtype=torch.uint8)
        size = KERNELS.encode_tags(bits, eps_bits, coarse_bits, as_numpy(tags))
        if size < 0:
            check_finite(flat, self.spec)
            raise AssertionError("the encoder saw NaN/Inf that check_finite does not")
        payload = torch.empty(size, dtype=torch.uint8)
        KERNELS.encode_payload(bits, eps_bits, coarse_bits, as_numpy(payload))
        return Packet({"tags": tags, "payload": payload}, flat.shape, flat.dtype)

    def _words(self, x: torch.Tensor, tag: torch.Tensor) -> torch.Tensor:
        """Each element's payload in the low bytes of an int32 (torch path)."""
        a, sign = x.abs().clamp(max=1.0), torch.signbit(x).to(torch.int32)
        small = (a / self.error_bound).to(torch.int32) & 0x7F | sign << 7
        fine = (a / FINE_STEP).to(torch.int32) & 0x7FFF | sign << 15
        return torch.where(tag == 3, x.view(torch.int32), torch.where(tag == 2, fine, small))

    def _decompress(self, packet: Packet) -> torch.Tensor:
        n = packet.numel
        tags, payload = packet["tags"], packet["payload"]
        if tags.numel() != packed_nbytes(n, 2):
            raise ValueError(f"{self.spec}: {tags.numel()} tag bytes cannot hold {n} tags")
        if use_numba(payload):
            out = torch.empty(n, dtype=torch.float32)
            read = KERNELS.decode(as_numpy(tags), as_numpy(payload), np.float32(self.error_bound),
                                  as_numpy(out).view(np.uint32))
            self._check_payload(read, payload)
            return out
        tag = unpack_bits(tags, 2, n)
        size = _payload_bytes(tag)
        self._check_payload(int(size.sum()), payload)
        start = torch.cumsum(size, 0) - size
        padded = torch.cat([payload, payload.new_zeros(4)]).to(torch.int64)
        word = sum((padded[start + k] << (8 * k) for k in range(1, 4)), padded[start])
        small = ((word & 0x7F).float() + 0.5) * self.error_bound
        fine = ((word & 0x7FFF).float() + 0.5) * FINE_STEP
        value = torch.where(tag == 1, _signed(small, word >> 7 & 1), _signed(fine, word >> 15 & 1))
        raw = (word & 0xFFFFFFFF).to(torch.int64).to(torch.int32).view(torch.float32)
        return torch.where(tag == 3, raw, torch.where(tag == 0, 0.0, value))

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """``total += decompress(packet)``, decoded and added in one pass on the CPU (the same bits). A
        payload the tags do not call for raises, as :meth:`decompress` does, after ``total`` was written."""
        n = packet.numel
        tags, payload = packet["tags"], packet["payload"]
        if not (use_numba(payload) and use_numba(total)):
            super().accumulate(total, packet)
            return
        if tags.numel() != packed_nbytes(n, 2):
            raise ValueError(f"{self.spec}: {tags.numel()} tag bytes cannot hold {n} tags")
        read = KERNELS.decode_add(as_numpy(tags), as_numpy(payload), np.float32(self.error_bound),
                                  as_numpy(total))
        self._check_payload(read, payload)

    def _check_payload(self, expected: int, payload: torch.Tensor) -> None:
        if expected != payload.numel():
            raise ValueError(f"{self.spec}: the tags call for {expected} payload bytes, the packet has "
                             f"{payload.numel()}")


def _payload_bytes(tag: torch.Tensor) -> torch.Tensor:
    return torch.tensor(PAYLOAD_BYTES, device=tag.device)[tag.long()]


def _signed(magnitude: torch.Tensor, sign_bit: torch.Tensor) -> torch.Tensor:
    return torch.where(sign_bit.bool(), -magnitude, magnitude)


# -- portable numba kernels ------------------------------------------------------------------------
# Pass 1 writes the packed tags and sums the payload's size (and spots NaN/Inf), so the payload is
# allocated at its exact size; pass 2 writes the payloads one after another. Both go block by block:
# branch-free loops that the compiler vectorizes (tags and payload words by selects on comparisons
# of the magnitude bits, never a branch on data) fill small scratch arrays, and a scalar loop moves
# the variable-size payloads, two elements' as one 8-byte store at the running position, which then
# advances by their size. Decoding mirrors it. Integers are cast back to their width after every
# operation (numba widens to 64 bits) so the loops vectorize over 32-bit lanes.
BLOCK = 4096  # elements per block, a multiple of 4 (a tag byte never straddles two blocks)
U8, U32, U64 = np.uint8, np.uint32, np.uint64
ONE = U32(0x3F800000)  # the bits of 1.0f: |x| ≥ 1 exactly when its magnitude bits are at least this
NON_FINITE = U32(0x7F800000)  # magnitude bits from here up: Inf or NaN
MAGNITUDE = U32(0x7FFFFFFF)
SIGN = U32(0x80000000)
inline = kernel(inline="always")


def _limits(eps: float) -> tuple[np.uint32, np.uint32]:
    """The bits of ε and 128·ε: comparing magnitude bits (|x|'s bits) orders the magnitudes."""
    eps_bits, coarse_bits = np.array([eps, 128 * eps], dtype=np.float32).view(np.uint32)
    return eps_bits, coarse_bits


@inline
def _tag(m, e, c):  # pragma: no cover - compiled
    """The tag (uint8) of magnitude bits ``m``."""
    return U8(3) if m >= ONE else (U8(2) if m >= c else (U8(1) if m >= e else U8(0)))


@inline
def _size(tag):  # pragma: no cover - compiled
    """Payload bytes of a tag: 0, 1, 2, 4."""
    return U8(4) if tag == U8(3) else tag


@jit
def _encode_tags(bits, e, c, tags):  # pragma: no cover - compiled
    """Pass 1: the packed tags; returns the payload's bytes, or -1 if an element is NaN or Inf."""
    n = bits.size
    tag_of = np.zeros(BLOCK, dtype=np.uint8)
    bad = False
    total = 0
    for start in range(0, n, BLOCK):
        count = min(BLOCK, n - start)
        groups = (count + 3) // 4
        bad |= _tag_block(bits[start:start + count], e, c, tag_of)
        tag_of[count:4 * groups] = 0  # the last byte's unused slots
        total += _pack_tags(tag_of[:4 * groups], tags[start // 4:start // 4 + groups])
    return -1 if bad else total


@jit
def _tag_block(bits, e, c, tag_of):  # pragma: no cover - compiled
    """Each element's tag; True if one is NaN or Inf."""
    bad = False
    for i in range(bits.size):
        m = U32(bits[i] & MAGNITUDE)
        tag_of[i] = _tag(m, e, c)
        bad |= m >= NON_FINITE
    return bad


@jit
def _pack_tags(tag_of, tags):  # pragma: no cover - compiled
    """Four tags a byte (element 4j + k at bits 2k of byte j); returns their payload bytes."""
    total = U32(0)
    for j in range(tags.size):
        t0, t1, t2, t3 = tag_of[4 * j], tag_of[4 * j + 1], tag_of[4 * j + 2], tag_of[4 * j + 3]
        tags[j] = U8(t0 | U8(t1 << U8(2)) | U8(t2 << U8(4)) | U8(t3 << U8(6)))
        total += U32(U8(U8(_size(t0) + _size(t1)) + U8(_size(t2) + _size(t3))))
    return total


@inline
def _word(b, e, c, inverse):  # pragma: no cover - compiled
    """An element's payload word (uint32, zero above its size) and its size, from its bits ``b``."""
    m = U32(b & MAGNITUDE)
    clamped = U32(min(m, ONE)).view(np.float32)  # ≤ 1: the conversions below never overflow
    sign = U32(b & SIGN)
    small = U32(U32(np.int32(clamped * inverse)) | U32(sign >> U32(24)))
    fine = U32(U32(np.int32(clamped * np.float32(32768.0))) | U32(sign >> U32(16)))
    word = b if m >= ONE else (fine if m >= c else (small if m >= e else U32(0)))
    size = U8(4) if m >= ONE else (U8(2) if m >= c else (U8(1) if m >= e else U8(0)))
    return word, size


@jit
def _encode_payload(bits, e, c, payload):  # pragma: no cover - compiled
    """Pass 2: every element's payload, in order, block by block."""
    n = bits.size
    inverse = np.float32(1.0) / np.uint32(e).view(np.float32)  # 1/ε, a power of two
    words = np.zeros(BLOCK + 1, dtype=np.uint32)  # one more: an odd block's last pair
    sizes = np.zeros(BLOCK + 1, dtype=np.uint8)
    position = 0
    for start in range(0, n, BLOCK):
        count = min(BLOCK, n - start)
        _word_block(bits[start:start + count], e, c, inverse, words, sizes)
        words[count], sizes[count] = 0, 0
        end = position + _total(sizes[:count])
        if end + 8 <= payload.size:
            _store_pairs(words[:count + 1], sizes[:count + 1], payload[position:])
        else:  # near the payload's end: byte by byte
            _store_bytes(words[:count], sizes[:count], payload[position:end])
        position = end


@jit
def _total(sizes):  # pragma: no cover - compiled
    """The sum of payload sizes."""
    total = 0
    for i in range(sizes.size):
        total += U32(sizes[i])
    return total


@jit
def _word_block(bits, e, c, inverse, words, sizes):  # pragma: no cover - compiled
    """Every element's payload word and size."""
    for i in range(bits.size):
        words[i], sizes[i] = _word(bits[i], e, c, inverse)


@jit
def _store_pairs(words, sizes, payload):  # pragma: no cover - compiled
    """Elements 2p and 2p + 1's payloads as one word, stored as 8 bytes at the running position,
    which then advances by the two payloads' size (``payload`` has 8 bytes to spare)."""
    position = U64(0)
    for p in range(words.size // 2):
        first = U64(sizes[2 * p])
        pair = U64(words[2 * p]) | (U64(words[2 * p + 1]) << (first * U64(8)))
        for k in range(8):  # merged into one store
            payload[position + U64(k)] = U8(pair >> U64(8 * k))
        position += first + U64(sizes[2 * p + 1])


@jit
def _store_bytes(words, sizes, payload):  # pragma: no cover - compiled
    """The payloads byte by byte (``payload`` holds exactly them)."""
    position = U64(0)
    for i in range(words.size):
        for k in range(sizes[i]):
            payload[position + U64(k)] = U8(words[i] >> U32(8 * k))
        position += U64(sizes[i])


@inline
def _value(tag, word, eps):  # pragma: no cover - compiled
    """The float32 bits an element decodes to from its tag and payload word (table in the docstring)."""
    small = (np.float32(U32(word & U32(0x7F))) + np.float32(0.5)) * eps
    fine = (np.float32(U32(word & U32(0x7FFF))) + np.float32(0.5)) * np.float32(FINE_STEP)
    small_bits = U32(np.float32(small).view(np.uint32) | U32(U32(word << U32(24)) & SIGN))
    fine_bits = U32(np.float32(fine).view(np.uint32) | U32(U32(word << U32(16)) & SIGN))
    return word if tag == U8(3) else (fine_bits if tag == U8(2) else (small_bits if tag == U8(1) else U32(0)))


@inline
def _decode_blocks(tags, payload, eps, add, out):  # pragma: no cover - compiled
    """Every element from its tag and payload, block by block, into ``out`` (float32 bits) or (``add``)
    added to float32 ``out``; returns the payload bytes the tags call for (reads never pass the
    payload's end)."""
    n = out.size
    tag_of = np.zeros(BLOCK, dtype=np.uint8)
    sizes = np.zeros(BLOCK, dtype=np.uint8)
    words = np.zeros(BLOCK, dtype=np.uint32)
    position = 0
    for start in range(0, n, BLOCK):
        count = min(BLOCK, n - start)
        groups = (count + 3) // 4
        _unpack_tags(tags[start // 4:start // 4 + groups], tag_of, sizes)
        total = _total(sizes[:count])
        if position + total + 4 <= payload.size:
            _load_words(payload[position:], sizes[:count], words)
        elif position <= payload.size:  # near the payload's end: byte by byte
            _load_bytes(payload[position:], sizes[:count], words)
        if add:
            _add_values(tag_of[:count], words, eps, out[start:start + count])
        else:
            _values(tag_of[:count], words, eps, out[start:start + count])
        position += total
    return position


@jit
def _decode(tags, payload, eps, out_bits):  # pragma: no cover - compiled
    """Inverse of the two passes; returns the payload bytes the tags call for (the caller checks it
    is all of them; reads never pass the payload's end)."""
    return _decode_blocks(tags, payload, eps, False, out_bits)


@jit
def _decode_add(tags, payload, eps, total):  # pragma: no cover - compiled
    """total += the decoded elements (float32), in the same pass as :func:`_decode`; returns the same."""
    return _decode_blocks(tags, payload, eps, True, total)


@jit
def _unpack_tags(tags, tag_of, sizes):  # pragma: no cover - compiled
    """Tags and payload sizes of the elements of ``tags``' bytes."""
    for j in range(tags.size):
        t = tags[j]
        for k in range(4):
            tag = U8(U8(t >> U8(2 * k)) & U8(3))
            tag_of[4 * j + k] = tag
            sizes[4 * j + k] = _size(tag)


@jit
def _load_words(payload, sizes, words):  # pragma: no cover - compiled
    """Each element's word, read as 4 bytes at the running position (``payload`` has 4 to spare)."""
    position = U64(0)
    for i in range(sizes.size):
        words[i] = U32(U32(payload[position]) | U32(U32(payload[position + U64(1)]) << U32(8))
                       | U32(U32(payload[position + U64(2)]) << U32(16))
                       | U32(U32(payload[position + U64(3)]) << U32(24)))
        position += U64(sizes[i])


@jit
def _load_bytes(payload, sizes, words):  # pragma: no cover - compiled
    """Each element's word byte by byte, never past the payload's end."""
    position = U64(0)
    for i in range(sizes.size):
        word = U32(0)
        for k in range(sizes[i]):
            if position + U64(k) < payload.size:
                word |= U32(U32(payload[position + U64(k)]) << U32(8 * k))
        words[i] = word
        position += U64(sizes[i])


@jit
def _values(tag_of, words, eps, out_bits):  # pragma: no cover - compiled
    """Every element's float32 bits."""
    for i in range(out_bits.size):
        out_bits[i] = _value(tag_of[i], words[i], eps)


@jit
def _add_values(tag_of, words, eps, total):  # pragma: no cover - compiled
    """total += every element's float32 value."""
    for i in range(total.size):
        total[i] += f32_from_bits(_value(tag_of[i], words[i], eps))


class Kernels(NamedTuple):
    """One implementation of the numba coding, on float32 bits (uint32 arrays):
    ``encode_tags(bits, eps_bits, coarse_bits, tags)`` packs the tags and returns the payload's bytes
    (-1 if an element is NaN or Inf), ``encode_payload(bits, eps_bits, coarse_bits, payload)`` fills
    the payload, ``decode(tags, payload, ε, out_bits)`` returns the payload bytes the tags call for,
    ``decode_add(tags, payload, ε, total)`` adds the decoded elements into float32 ``total`` in the
    same pass, and returns the same."""

    encode_tags: Callable[..., int]
    encode_payload: Callable[..., None]
    decode: Callable[..., int]
    decode_add: Callable[..., int]


PORTABLE = Kernels(_encode_tags, _encode_payload, _decode, _decode_add)
VECTOR = Kernels(simd.encode_tags, simd.encode_payload, simd.decode, simd.decode_add)
KERNELS = VECTOR if simd.AVAILABLE else PORTABLE  # the same bytes; VECTOR needs AVX-512 VBMI2
