"""16-lane vector values for numba kernels: a float32 and a 32-bit integer vector type, and the LLVM
operations on them that the THC kernels (:mod:`gradpress.kernels.hadamard`, :mod:`gradpress.compressors.thc`)
are written in.

Numba vectorizes plain loops well, but not the shapes a fast Walsh–Hadamard transform needs: butterflies
between 16-lane groups at a runtime stride (every such loop carries run-time alias checks, which cost more
than the butterflies at short strides) and within one group (lane shuffles). These types let a kernel hold
a group of 16 values in a register, as ``<16 x float>`` or ``<16 x i32>``: every operation here is one LLVM
vector instruction (or a few), IEEE-exact as its scalar counterpart (no fast-math flags), so a kernel
written with them gives the bits of the same scalar arithmetic. LLVM lowers the vectors to the widest
registers the CPU has (one zmm register with AVX-512, two ymm with AVX2, four xmm with SSE) and is correct
on all of them; only the table lookup :func:`permute32` uses an AVX-512 instruction, where the CPU has it,
and a gather elsewhere.

Integer lanes are unsigned where it matters (shifts are logical, comparisons unsigned). Kernels pass
:func:`pointer` s, not arrays, to the functions they inline: numba reference-counts an array handed to an
inlined function wherever it cannot pair the updates up, and those atomic updates (each with a
``vzeroupper``) cost more than a loop body.

The operations live in four modules by what they do, all importable from here (``from gradpress.kernels
import simd as V``): :mod:`~gradpress.kernels.simd_types` (the vector types),
:mod:`~gradpress.kernels.simd_memory` (loads, stores, pointers, prefetches),
:mod:`~gradpress.kernels.simd_math` (lane-by-lane arithmetic, conversions, reductions) and
:mod:`~gradpress.kernels.simd_lanes` (Walsh–Hadamard butterflies, table lookups, gathers, packing). A kernel
inlines them into its machine code; its disk cache is keyed on every module it imports
(:func:`gradpress.kernels.jit.kernel`), so editing one of them compiles the kernels that use it again.
"""
from __future__ import annotations

from gradpress.kernels.simd_lanes import (
    AVX512,
    gather,
    load_nibbles,
    pack_high,
    pack_low,
    permute32,
    radix2,
    radix2_scaled,
    radix4,
    radix4_scaled,
    radix8,
    radix8_scaled,
    radix16,
    radix16_scaled,
    store_nibbles,
    unpack16,
    wht16,
)
from gradpress.kernels.simd_math import (
    add,
    add_squares64,
    affine64,
    and_,
    bits,
    clamp,
    fsplat,
    hmax,
    hsum,
    iota,
    isplat,
    keep_first,
    mul,
    select,
    shl,
    shr,
    sign_mask16,
    step_up,
    sub,
    to_float,
    to_int,
    umax,
    umin,
    xor,
    zeros64,
)
from gradpress.kernels.simd_memory import (
    advance,
    load,
    load_affine64,
    load_bytes,
    load_first,
    load_float,
    load_word,
    pointer,
    prefetch,
    store,
    store_first,
    store_ints,
    store_stream,
    store_word,
)
from gradpress.kernels.simd_types import (
    LANES,
    Vec,
    vf32,
    vf64,
    vi32,
)

__all__ = [
    "AVX512", "LANES", "Vec", "add", "add_squares64", "advance", "affine64", "and_", "bits", "clamp",
    "fsplat", "gather", "hmax", "hsum", "iota", "isplat", "keep_first", "load", "load_affine64",
    "load_bytes", "load_first", "load_float", "load_nibbles", "load_word", "mul", "pack_high", "pack_low",
    "permute32", "pointer", "prefetch", "radix16", "radix16_scaled", "radix2", "radix2_scaled", "radix4",
    "radix4_scaled", "radix8", "radix8_scaled", "select", "shl", "shr", "sign_mask16", "step_up", "store",
    "store_first", "store_ints", "store_nibbles", "store_stream", "store_word", "sub", "to_float", "to_int",
    "umax", "umin", "unpack16", "vf32", "vf64", "vi32", "wht16", "xor", "zeros64",
]
