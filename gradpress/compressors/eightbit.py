"""Dettmers' 8-bit approximation (ICLR 2016), and the cell table that makes table lookups cheap.

Dettmers' *dynamic tree* data type (GRACE §3.1: 1 sign bit, a dynamic exponent of 0 to 6, mantissa):
after the sign bit, the number e of leading zero bits is a decimal exponent, the first one bit is an
indicator, and the remaining 6 − e bits bisect [0.1, 1] linearly; the value is 10^-e times the midpoint
of the bisected interval. Seven decades below 1, finer where the magnitude is larger; magnitude bits
0000000 mean 0. Each value is rounded to the nearest of the 256 codes after dividing by a scale, which
goes along: 8 bits per element plus one float32.

Dettmers divides by the largest magnitude; here the scale is the largest magnitude divided by the
largest table value (0.99297), so that the largest element lands exactly on the top code instead of
being rounded down by 0.7 %. Where that quotient is beyond float32 (a largest magnitude within 0.7 % of
float32's largest value) the scale is Dettmers' own, the largest magnitude.

**Lookups without a per-element search.** A value's position among sorted edges is read from a table
indexed by the top 16 bits of its order-preserving bit pattern (a cell spans a 2^-7 relative range).
Each entry holds the number of edges below its cell and the low 16 bits of the edge inside it, if any,
so one table read and one comparison place a value; the numba kernels read the table 16 values at a
time (:func:`gradpress.kernels.jit.gather16`). The dynamic-tree edges are more than 2^-7 apart relative to
their size, so no cell holds two of them (SketchML's quantiles may: its kernel probes those cells).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradpress.compressors.onebit import as_float32, checked_max_magnitude
from gradpress.core.compressor import Compressor, finish_fold, register
from gradpress.core.packet import Packet
from gradpress.core.rng import Context
from gradpress.kernels.jit import (
    ADD,
    FINISH,
    FINISH_POW2,
    STORE,
    as_numpy,
    fold,
    fold_mode,
    fold_top,
    fused,
    gather16,
    jit,
    kernel,
    use_numba,
)


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

    checks_finite = True  # the pass for max |x| shows NaN/Inf

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel + 4

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = as_float32(flat)
        largest = checked_max_magnitude(x, self.spec)
        scale = torch.tensor([largest / TOP], dtype=torch.float32, device=x.device)
        if not torch.isfinite(scale * TOP).all():  # near float32's largest: Dettmers' scale, max |x|
            scale = torch.tensor([largest], dtype=torch.float32, device=x.device)
        if largest == 0.0:
            codes = torch.zeros(x.numel(), dtype=torch.uint8, device=x.device)
        else:
            lifted = scale * _LIFT if largest < _TINY else scale
            x = x * _LIFT if largest < _TINY else x
            codes = _encode(x, EDGES.to(x.device) * lifted)  # compare |x| with scaled edges: no division
        return Packet({"codes": codes, "scale": scale}, flat.shape, flat.dtype)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return lookup(TABLE.to(packet.device) * packet["scale"], packet["codes"])

    def accumulate(self, total: torch.Tensor, packet: Packet) -> None:
        """``total += decompress(packet)``, looked up and added in one pass on the CPU (the same bits)."""
        if not (use_numba(packet["codes"]) and lookup_add(TABLE * packet["scale"], packet["codes"], total)):
            super().accumulate(total, packet)

    def accumulate_into(self, total: torch.Tensor, packet: Packet, store: bool = False,
                        count: int = 0) -> int:
        """:meth:`Compressor.accumulate_into` in the lookup's one pass on the CPU."""
        done = None
        if use_numba(packet["codes"]):
            done = lookup_fold(TABLE * packet["scale"], packet["codes"], total, store, count)
        return super().accumulate_into(total, packet, store, count) if done is None else done


def _encode(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Codes sign·128 + #{edges < |x|} (uint8)."""
    if use_numba(x):
        out = torch.empty(x.numel(), dtype=torch.uint8)
        cells, crowded = cell_table(as_numpy(edges))
        if crowded > 1:  # cannot happen for positive scales: edges are over 1 % apart
            raise AssertionError("eightbit: two table edges share a lookup cell")
        _encode_kernel(as_numpy(x).view(np.uint32), cells, as_numpy(out))
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


def lookup_add(values: torch.Tensor, codes: torch.Tensor, total: torch.Tensor) -> bool:
    """``total += values[codes]`` on a flat float32 ``total`` (uint8 codes, float32 ``values``), in one
    numba pass (no looked-up temporary: an all-gather's sum). False, with nothing done, where the numba
    path does not apply (the caller then adds the decode)."""
    if not (use_numba(codes) and use_numba(total)):
        return False
    _lookup_add(as_numpy(values.float().contiguous()), as_numpy(codes), as_numpy(total), ADD, 0)
    return True


def lookup_fold(values: torch.Tensor, codes: torch.Tensor, total: torch.Tensor, store: bool,
                count: int) -> int | None:
    """:meth:`Compressor.accumulate_into` of the decode ``values[codes]`` in one numba pass (what it
    returns); None, with nothing done, where the numba path does not apply."""
    if not (use_numba(codes) and use_numba(total)):
        return None
    top = _lookup_add(as_numpy(values.float().contiguous()), as_numpy(codes), as_numpy(total),
                      fold_mode(store, count), count)
    return finish_fold(total, top, store, count)


# -- cell tables (shared with sketchml.py) ------------------------------------------------------------
BLOCK = 256  # elements per block of the table-reading kernels (a multiple of gather16's 16 lanes)
CROWDED = np.uint32(1 << 31)  # cell-table flag: two or more edges inside the cell
NO_EDGE = 0xFFFF  # low bits stored for a cell without an edge: no key in the cell is above it


def cell_table(edges: np.ndarray) -> tuple[np.ndarray, int]:
    """For each of the 65536 cells of the order key's top 16 bits (uint32 entries): the number of
    ``edges`` (sorted float32, at most 255, none zero) below the cell in bits 16-23, the low 16 bits of
    the key of the edge inside the cell in bits 0-15 (:data:`NO_EDGE` if none) and :data:`CROWDED` if
    the cell holds more than one edge; and the most edges any one cell holds.

    For a key k in a cell with at most one edge e: #{edges < k} = below + (low16(k) > low16(e)) (an edge
    whose low bits are all ones is exceeded by no key of its cell, just as no edge is).
    """
    if edges.size > 255:
        raise ValueError(f"a cell table takes at most 255 edges, got {edges.size}")
    table = np.empty(65536, dtype=np.uint32)
    crowded = _cell_table(edges.view(np.uint32), table)
    return table, crowded


@kernel(inline="always")
def order_key(bits):  # pragma: no cover - compiled
    """uint32 key increasing with the float32 value whose bits are ``bits`` (−0.0 just below +0.0)."""
    bits = np.uint32(bits)
    mask = np.uint32(0xFFFFFFFF) if bits >> np.uint32(31) else np.uint32(0x80000000)
    return np.uint32(bits ^ mask)


@kernel(inline="always")
def rank_in_cell(key, entry):  # pragma: no cover - compiled
    """#{edges < key} from the cell-table ``entry`` of ``key``'s cell (a cell with at most one edge)."""
    below = (entry >> np.uint32(16)) & np.uint32(0xFF)
    return below + np.uint32((key & np.uint32(0xFFFF)) > (entry & np.uint32(0xFFFF)))


@jit
def _cell_table(edge_bits, table):  # pragma: no cover - compiled
    """Fills the table run by run: the cells between two cells holding edges hold none."""
    n = edge_bits.size
    crowded = 0
    cell = 0  # the first cell not filled yet
    first = 0  # the first edge not placed yet
    while first < n:
        key = order_key(edge_bits[first])
        home = np.int64(key >> np.uint32(16))
        last = first + 1
        while last < n and np.int64(order_key(edge_bits[last]) >> np.uint32(16)) == home:
            last += 1
        below = np.uint32(first) << np.uint32(16)
        table[cell:home] = below | np.uint32(NO_EDGE)
        table[home] = below | (key & np.uint32(0xFFFF)) | (CROWDED if last - first > 1 else np.uint32(0))
        crowded = max(crowded, last - first)
        cell = home + 1
        first = last
    table[cell:] = (np.uint32(n) << np.uint32(16)) | np.uint32(NO_EDGE)
    return crowded


@jit
def _encode_kernel(bits, cells, out):  # pragma: no cover - compiled
    """Codes of :func:`_encode`, a block at a time: the cell-table entries of the magnitudes' keys are
    gathered into ``entries``, then each magnitude is placed with one comparison (no cell is crowded)."""
    n = bits.size
    entries = np.empty(BLOCK, dtype=np.uint32)
    for start in range(0, n - n % BLOCK, BLOCK):
        for k in range(BLOCK):
            entries[k] = ((bits[start + k] | np.uint32(0x80000000)) >> np.uint32(16))
        for k in range(0, BLOCK, 16):
            gather16(cells, entries, entries, k)
        for k in range(BLOCK):
            out[start + k] = _code(bits[start + k], entries[k])
    for i in range(n - n % BLOCK, n):
        out[i] = _code(bits[i], cells[(bits[i] | np.uint32(0x80000000)) >> np.uint32(16)])


@kernel(inline="always")
def _code(b, entry):  # pragma: no cover - compiled
    """sign·128 + #{edges < |x|} for x with bits ``b`` (positive floats order as their bit patterns: the
    order key of |x| is its bits with the top bit set)."""
    rank = rank_in_cell(b | np.uint32(0x80000000), entry)
    return np.uint8(rank) | np.uint8((b >> np.uint32(24)) & np.uint32(0x80))


@jit
def _lookup(values, codes, out):  # pragma: no cover - compiled
    n = codes.size
    for start in range(0, n - n % 16, 16):
        gather16(values, codes, out, start)
    for i in range(n - n % 16, n):
        out[i] = values[codes[i]]


@kernel(inline="always")
def _lookup_fold_loop(values, codes, total, mode, count, reciprocal):  # pragma: no cover - compiled
    """:func:`gradpress.kernels.jit.fold` of values[codes] into ``total``, BLOCK values at a time: gathered 16
    at a time into a scratch block, then folded (one vectorized loop); the largest exponent field stored
    when finishing."""
    n = codes.size
    scratch = np.empty(BLOCK, dtype=np.float32)
    largest = np.int32(0)
    for start in range(0, n - n % BLOCK, BLOCK):
        block = codes[start:start + BLOCK]
        for k in range(0, BLOCK, 16):
            gather16(values, block, scratch, k)
        for k in range(BLOCK):  # (unsigned indices: no wraparound check, so the loop vectorizes)
            v = fold(total[np.uint64(start + k)], scratch[np.uint64(k)], mode, count, reciprocal)
            total[np.uint64(start + k)] = v
            largest = fold_top(largest, mode, v)
    for i in range(n - n % BLOCK, n):
        v = fold(total[i], values[codes[i]], mode, count, reciprocal)
        total[i] = v
        largest = fold_top(largest, mode, v)
    return largest


@fused
def _lookup_add(values, codes, total, mode, count):  # pragma: no cover - compiled
    """total += values[codes] (or another :data:`gradpress.kernels.jit.ADD` mode: a constant in each call of
    :func:`_lookup_fold_loop`)."""
    c, r = np.float32(count), np.float32(1.0 / max(count, 1))
    if mode == STORE:
        return _lookup_fold_loop(values, codes, total, STORE, c, r)
    if mode == FINISH:
        return _lookup_fold_loop(values, codes, total, FINISH, c, r)
    if mode == FINISH_POW2:
        return _lookup_fold_loop(values, codes, total, FINISH_POW2, c, r)
    return _lookup_fold_loop(values, codes, total, ADD, c, r)
