"""Vectorized bit packing: ``n`` codes of ``b`` bits (1 <= b <= 8) in ``ceil(n*b/8)`` bytes.

Layout: a little-endian bit stream, code ``i`` at bits ``[i*b, (i+1)*b)``, bit ``k`` of the stream in
byte ``k // 8`` at position ``k % 8``. Every quantizer packs its codes with these two functions. CPU
tensors go through a numba loop; other devices through torch reshapes and shifts (no per-element
Python loop anywhere). Kernels that pack as they go (dithering's) inline :func:`pack_groups` and
:func:`unpack_groups`: the same layout, eight codes at a time in a uint64 word.
"""
from __future__ import annotations

import numpy as np
import torch

from gradpress.kernels.jit import as_numpy, jit, kernel, load64, store64, use_numba

# helpers inlined into other modules' kernels (a call per group would cost more than its work)
_inline = kernel(inline="always")


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits."""
    return (n * bits + 7) // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D uint8 tensor of codes in ``[0, 2**bits)`` into ``ceil(n*bits/8)`` bytes."""
    _check(codes, bits)
    n = codes.numel()
    if bits == 8:
        return codes.clone()
    if use_numba(codes):
        out = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8)
        _pack_numba(as_numpy(codes.contiguous()), bits, as_numpy(out))
        return out
    return _pack_torch(codes, bits)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``n`` uint8 codes."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise TypeError(f"packed codes must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    if packed.numel() != packed_nbytes(n, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits")
    if bits == 8:
        return packed.clone()
    if use_numba(packed):
        out = torch.empty(n, dtype=torch.uint8)
        _unpack_numba(as_numpy(packed.contiguous()), bits, as_numpy(out))
        return out
    return _unpack_torch(packed, bits, n)


def _check(codes: torch.Tensor, bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if codes.dtype != torch.uint8 or codes.dim() != 1:
        raise TypeError(f"codes must be a 1-D uint8 tensor, got {codes.dtype} {tuple(codes.shape)}")


def _pack_torch(codes: torch.Tensor, bits: int) -> torch.Tensor:
    n = codes.numel()
    device = codes.device
    if 8 % bits == 0:
        per_byte = 8 // bits
        padded = torch.zeros(-(-n // per_byte) * per_byte, dtype=torch.uint8, device=device)
        padded[:n] = codes
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        return (padded.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)
    shifts = torch.arange(bits, dtype=torch.uint8, device=device)
    stream = ((codes.unsqueeze(1) >> shifts) & 1).reshape(-1)
    padded = torch.zeros(packed_nbytes(n, bits) * 8, dtype=torch.uint8, device=device)
    padded[: stream.numel()] = stream
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=device)
    return (padded.view(-1, 8) << byte_shifts).sum(dim=1, dtype=torch.uint8)


def _unpack_torch(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    device = packed.device
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        return ((packed.unsqueeze(1) >> shifts) & mask).reshape(-1)[:n]
    byte_shifts = torch.arange(8, dtype=torch.uint8, device=device)
    stream = ((packed.unsqueeze(1) >> byte_shifts) & 1).reshape(-1)[: n * bits]
    weights = (1 << torch.arange(bits, device=device)).to(torch.uint8)
    return (stream.view(n, bits) * weights).sum(dim=1, dtype=torch.uint8)


@jit
def _pack_numba(codes, bits, out):  # pragma: no cover - compiled
    acc = np.uint32(0)
    filled = 0
    j = 0
    for i in range(codes.size):
        acc |= np.uint32(codes[i]) << np.uint32(filled)
        filled += bits
        if filled >= 8:
            out[j] = np.uint8(acc & np.uint32(0xFF))
            j += 1
            acc >>= np.uint32(8)
            filled -= 8
    if filled > 0:
        out[j] = np.uint8(acc & np.uint32(0xFF))


@jit
def _unpack_numba(packed, bits, out):  # pragma: no cover - compiled
    mask = np.uint32((1 << bits) - 1)
    acc = np.uint32(0)
    have = 0
    j = 0
    for i in range(out.size):
        if have < bits:
            acc |= np.uint32(packed[j]) << np.uint32(have)
            j += 1
            have += 8
        out[i] = np.uint8(acc & mask)
        acc >>= np.uint32(bits)
        have -= bits


# -- inside numba kernels: whole groups of 8 codes, one uint64 word each (SWAR: shifts and masks) ----------
@_inline
def _squeeze(v, bits):  # pragma: no cover - compiled
    """Eight bytes (codes < 2^bits) → the low 8·bits bits, code j at bits [j·bits, (j+1)·bits)."""
    b = np.uint64(bits)
    ones, pairs = np.uint64(0x00FF00FF00FF00FF), np.uint64(0x0000FFFF0000FFFF)  # every other byte, 16-bit lane
    v = (v & ones) | (((v >> np.uint64(8)) & ones) << b)  # codes 2m, 2m + 1 side by side in 16-bit lane m
    v = (v & pairs) | (((v >> np.uint64(16)) & pairs) << (b + b))  # four codes per 32-bit lane
    return (v & np.uint64(0xFFFFFFFF)) | ((v >> np.uint64(32)) << (np.uint64(4) * b))


@_inline
def _spread(v, bits):  # pragma: no cover - compiled
    """Inverse of :func:`_squeeze` (bits above 8·bits ignored)."""
    b = np.uint64(bits)
    if bits < 8:
        v &= (np.uint64(1) << (np.uint64(8) * b)) - np.uint64(1)
    quad = (np.uint64(1) << (np.uint64(4) * b)) - np.uint64(1)
    v = (v & quad) | ((v >> (np.uint64(4) * b)) << np.uint64(32))
    pair = np.uint64(0x0000000100000001) * ((np.uint64(1) << (b + b)) - np.uint64(1))
    v = (v & pair) | (((v >> (b + b)) & pair) << np.uint64(16))
    one = np.uint64(0x0001000100010001) * ((np.uint64(1) << b) - np.uint64(1))
    return (v & one) | (((v >> b) & one) << np.uint64(8))


@_inline
def pack_groups(codes, groups, bits, words, out, offset):  # pragma: no cover - compiled
    """Pack ``groups`` groups of 8 codes (``codes`` as uint64: code j of a group in byte j) at byte
    ``offset`` of ``out`` in :func:`gradpress.kernels.bits.pack_bits`' layout: a group's code j at bits
    [j·bits, (j+1)·bits) of its ``bits`` bytes. ``words`` is scratch for the packed groups."""
    for g in range(groups):  # vectorized over groups
        words[g] = _squeeze(codes[g], bits)
    if bits == 2 or bits == 4:  # whole 16- or 32-bit words: vectorized stores
        whole = min(groups, (out.size - offset) // bits)
        if bits == 2:
            _narrow_stores(out[offset:offset + 2 * whole].view(np.uint16), words, whole)
        else:
            _narrow_stores(out[offset:offset + 4 * whole].view(np.uint32), words, whole)
    else:  # one 8-byte store each; the next group overwrites the top 8 - bits bytes
        whole = max(0, min(groups, (out.size - offset - 8) // bits + 1))  # groups with 8 bytes of room
        for g in range(whole):
            store64(out, offset + g * bits, words[g])
    for g in range(whole, groups):
        at = offset + g * bits
        for q in range(min(bits, out.size - at)):
            out[at + q] = np.uint8(words[g] >> np.uint64(8 * q))


@_inline
def _narrow_stores(out, words, count):  # pragma: no cover - compiled
    for g in range(count):
        out[g] = words[g]


@_inline
def unpack_groups(packed, offset, groups, bits, codes):  # pragma: no cover - compiled
    """Inverse of :func:`pack_groups`, into ``codes`` (uint64 words of 8 byte codes)."""
    if bits == 2 or bits == 4:  # whole 16- or 32-bit words: vectorized loads
        whole = min(groups, (packed.size - offset) // bits)
        if bits == 2:
            _wide_loads(packed[offset:offset + 2 * whole].view(np.uint16), codes, whole)
        else:
            _wide_loads(packed[offset:offset + 4 * whole].view(np.uint32), codes, whole)
    else:  # one 8-byte load each
        whole = max(0, min(groups, (packed.size - offset - 8) // bits + 1))
        for g in range(whole):
            codes[g] = load64(packed, offset + g * bits)
    for g in range(whole, groups):
        at = offset + g * bits
        word = np.uint64(0)
        for q in range(min(bits, packed.size - at)):
            word |= np.uint64(packed[at + q]) << np.uint64(8 * q)
        codes[g] = word
    for g in range(groups):  # vectorized over groups
        codes[g] = _spread(codes[g], bits)


@_inline
def _wide_loads(packed, codes, count):  # pragma: no cover - compiled
    for g in range(count):
        codes[g] = np.uint64(packed[g])

