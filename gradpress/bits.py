"""Vectorized bit packing: ``n`` codes of ``b`` bits (1 <= b <= 8) in ``ceil(n*b/8)`` bytes.

Layout: a little-endian bit stream, code ``i`` at bits ``[i*b, (i+1)*b)``, bit ``k`` of the stream in
byte ``k // 8`` at position ``k % 8``. Every quantizer packs its codes with these two functions. CPU
tensors go through a numba loop; other devices through torch reshapes and shifts (no per-element
Python loop anywhere).
"""
from __future__ import annotations

import numpy as np
import torch

from gradpress._numba import as_numpy, jit, use_numba


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
