"""Numba CPU kernels' shared pieces, under the one name the compressors import them from: the JIT
decorator and its disk cache (:mod:`gradpress.kernels.cache`), scalar helpers — 32-bit products, bit
casts, the fp16 cast, the ``mix32`` hash, unaligned 64-bit words (:mod:`gradpress.kernels.scalar`) —, 16-
and 64-element masks, selects, compressed stores and gathers (:mod:`gradpress.kernels.masks`), the sum of
squares and the finiteness check (:mod:`gradpress.kernels.norms`) and the fused all-gather sum
(:mod:`gradpress.kernels.fold`).

Element-wise compressors run a numba kernel on CPU tensors (one pass, fused randomness and bit
packing) and a torch implementation elsewhere; tests check that both give the same bits. Set
``GRADPRESS_NUMBA=0`` (or use :func:`numba_disabled`) to force the torch path on the CPU
(:mod:`gradpress.kernels.dispatch`, which decides without loading numba).
"""
from __future__ import annotations

from gradpress.kernels.cache import (
    KERNELS,
    PACKAGE,
    KernelCache,
    cache_folders,
    chosen_cache,
    compile_counts,
    dependencies,
    describe_cache,
    jit,
    kernel,
    sources_digest,
    user_cache,
)
from gradpress.kernels.dispatch import as_numpy, numba_disabled, use_numba
from gradpress.kernels.fold import ADD, FINISH, FINISH_POW2, STORE, fold, fold_mode, fold_top, fused
from gradpress.kernels.masks import (
    abs_above64,
    abs_not_below64,
    compress_above16,
    compress_at_least16,
    gather16,
    select_bits64,
    sign_bits64,
    sign_flags64,
)
from gradpress.kernels.norms import finite, squares
from gradpress.kernels.scalar import (
    GOLDEN,
    bits_of_f32,
    bits_of_f64,
    f16_bits_of_f32,
    f32_from_bits,
    f32_of_f16_bits,
    f64_from_bits,
    load64,
    mix32,
    mix32_from,
    mul32,
    store64,
    uniform24,
    wide_vectors,
)

__all__ = [
    "ADD", "FINISH", "FINISH_POW2", "GOLDEN", "KERNELS", "PACKAGE", "STORE", "KernelCache", "abs_above64",
    "abs_not_below64", "as_numpy", "bits_of_f32", "bits_of_f64", "cache_folders", "chosen_cache",
    "compile_counts", "compress_above16", "compress_at_least16", "dependencies", "describe_cache",
    "f16_bits_of_f32", "f32_from_bits", "f32_of_f16_bits", "f64_from_bits", "finite", "fold", "fold_mode",
    "fold_top", "fused", "gather16", "jit", "kernel", "load64", "mix32", "mix32_from", "mul32",
    "numba_disabled", "select_bits64", "sign_bits64", "sign_flags64", "sources_digest", "squares", "store64",
    "uniform24", "use_numba", "user_cache", "wide_vectors",
]
