"""Dettmers' 8-bit approximation (ICLR 2016), and the cell table that makes table lookups cheap.

Dettmers' *dynamic tree* data type (GRACE §3.1: 1 sign bit, a dynamic exponent of 0 to 6, mantissa):
after the sign bit, the number e of leading zero bits is a decimal exponent, the first one bit is an
indicator, and the remaining 6 − e bits bisect [0.1, 1] linearly; the value is 10^-e times the midpoint
of the bisected interval. Seven decades below 1, finer where the magnitude is larger; magnitude bits
0000000 mean 0. Each value is rounded to the nearest of the 256 codes after dividing by a scale, which
goes along: 8 bits per element plus one float32.

Dettmers divides by the largest magnitude; here the scale is the largest magnitude divided by the
largest table value (0.99297), so that the largest element lands exactly on the top code instead of
being rounded down by 0.7 %.

**Lookups without a per-element search.** A value's position among sorted edges is read from a table
indexed by the top 16 bits of its order-preserving bit pattern (a cell spans a 2^-7 relative range),
followed by a forward probe. The dynamic-tree edges are more than 2^-7 apart relative to their size, so
for them the probe is a single comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

from gradpress._numba import as_numpy, jit, use_numba
from gradpress.compressor import Compressor, register
from gradpress.compressors.onebit import as_float32, extreme
from gradpress.packet import Packet
from gradpress.rng import Context


def dynamic_tree_table() -> torch.Tensor:
    """The 256 values of Dettmers' dynamic tree type in [-1, 1], indexed by code (float32).

    Code = sign bit · 128 + magnitude bits; the magnitudes of codes 0..127 increase with the code
    (code 0 is 0, code 128 is −0).
    """
    codes = np.arange(1, 128)
    fraction_bits = np.floor(np.log2(codes)).astype(np.int64)  # bits after the indicator
    exponent = 6 - fraction_bits                               # leading zero bits
    fraction = codes - 2**fraction_bits
    magnitude = np.concatenate([[0.0], 10.0**-exponent * (0.1 + 0.9 * (fraction + 0.5) / 2.0**fraction_bits)])
    return torch.tensor(np.concatenate([magnitude, -magnitude]), dtype=torch.float32)


TABLE = dynamic_tree_table()
TOP = float(TABLE[127])
# nearest-magnitude edges: the midpoints between consecutive magnitudes (127 of them)
EDGES = ((TABLE[:127].double() + TABLE[1:128].double()) / 2).float()
_TINY, _LIFT = 2.0**-60, 2.0**64  # tiny scales: lift x by an exact power of two so edges stay normal


@register("eightbit")
@dataclass(repr=False)
class EightBit(Compressor):
    """Dettmers' 8-bit approximation (ICLR 2016): each x/s rounded to the nearest dynamic-tree value, with
    s = max|x| / 0.99297. Wire: one byte per element and s as float32. Deterministic and biased;
    GRACE Table 1 runs it with error feedback (the default ``residual``)."""

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel + 4

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = as_float32(flat)
        largest = abs(extreme(x))
        scale = torch.tensor([largest / TOP], dtype=torch.float32, device=x.device)
        if largest == 0.0:
            codes = torch.zeros(x.numel(), dtype=torch.uint8, device=x.device)
        else:
            lifted = scale * _LIFT if largest < _TINY else scale
            x = x * _LIFT if largest < _TINY else x
            codes = _encode(x, EDGES.to(x.device) * lifted)  # compare |x| with scaled edges: no division
        return Packet({"codes": codes, "scale": scale}, flat.shape, flat.dtype)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return lookup(TABLE.to(packet.device) * packet["scale"], packet["codes"])


def _encode(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Codes sign·128 + #{edges < |x|} (uint8)."""
    if use_numba(x):
        out = torch.empty(x.numel(), dtype=torch.uint8)
        edges_np = as_numpy(edges)
        cells, crowded = cell_table(edges_np)
        if crowded > 1:  # cannot happen for positive scales: edges are over 1 % apart
            raise AssertionError("eightbit: two table edges share a lookup cell")
        sentinel = np.append(edges_np.view(np.uint32), np.uint32(0xFFFFFFFF))  # above every magnitude
        _encode_kernel(as_numpy(x).view(np.uint32), sentinel, cells, as_numpy(out))
        return out
    magnitude_code = torch.searchsorted(edges, x.abs()).to(torch.uint8)
    return magnitude_code | (torch.signbit(x).to(torch.uint8) << 7)


def lookup(values: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``values[codes]`` for uint8 codes (float32 out)."""
    if use_numba(codes):
        out = torch.empty(codes.numel(), dtype=torch.float32)
        _lookup(as_numpy(values.float().contiguous()), as_numpy(codes), as_numpy(out))
        return out
    return values.float()[codes.long()]


# -- cell tables (shared with sketchml.py) ------------------------------------------------------------
def cell_table(edges: np.ndarray) -> tuple[np.ndarray, int]:
    """For each of the 65536 cells of the order key's top 16 bits, the number of ``edges`` (sorted
    float32, at most 255, none zero) below the cell; and the most edges any one cell holds."""
    if edges.size > 255:
        raise ValueError(f"a cell table takes at most 255 edges, got {edges.size}")
    table = np.empty(65536, dtype=np.uint8)
    crowded = _cell_table(edges.view(np.uint32), table)
    return table, crowded


@njit(cache=True, inline="always")
def order_key(bits):  # pragma: no cover - compiled
    """uint32 key increasing with the float32 value whose bits are ``bits`` (−0.0 just below +0.0)."""
    bits = np.uint32(bits)
    mask = np.uint32(0xFFFFFFFF) if bits >> np.uint32(31) else np.uint32(0x80000000)
    return np.uint32(bits ^ mask)


@jit
def _cell_table(edge_bits, table):  # pragma: no cover - compiled
    below = 0
    crowded = 0
    for cell in range(table.size):
        start = np.uint32(cell) << np.uint32(16)
        first = below
        while below < edge_bits.size and order_key(edge_bits[below]) < start:
            below += 1
        crowded = max(crowded, below - first)
        table[cell] = below
    return crowded


@jit
def _encode_kernel(bits, edge_bits, cells, out):  # pragma: no cover - compiled
    """Positive floats order like their bit patterns, so |x| is compared with the edges as integers;
    the cell gives the count below the cell, one comparison adds the edge inside it, if any (the last
    edge is a sentinel above every magnitude)."""
    for i in range(bits.size):
        b = bits[i]
        magnitude = b & np.uint32(0x7FFFFFFF)
        rank = cells[(magnitude | np.uint32(0x80000000)) >> np.uint32(16)]
        rank += np.uint8(magnitude > edge_bits[rank])
        out[i] = np.uint8(rank) | np.uint8((b >> np.uint32(24)) & np.uint32(0x80))


@jit
def _lookup(values, codes, out):  # pragma: no cover - compiled
    for i in range(out.size):
        out[i] = values[codes[i]]
