"""How a decoder adds its packet into the running all-gather sum (``Compressor.accumulate_into``): the
fold modes, the kernel decorator for such decoders and the fold itself.
"""
from __future__ import annotations

import numpy as np

from gradpress.kernels.cache import kernel
from gradpress.kernels.scalar import bits_of_f32

#: how a decode-add kernel folds a decoded value into the float32 total: ``ADD`` total += v; ``STORE`` (the
#: first packet) total = v + 0.0, the bits of 0.0 + v (a −0.0 stored as +0.0) without reading the total;
#: ``FINISH`` (the last packet) total = (total + v) / count, ``FINISH_POW2`` the same for a power-of-two
#: count as a product with its reciprocal (both the correctly rounded quotient). Kernels take the mode and
#: the count as arguments and dispatch on the mode once, outside their loops, to code compiled for it
#: (:func:`fold` with a constant mode: its other branches and the exponent max compile away).
ADD, STORE, FINISH, FINISH_POW2 = 0, 1, 2, 3
fused = kernel(error_model="numpy")  # numpy's division: no zero check per element


def fold_mode(store: bool, count: int) -> int:
    """The kernel mode of one step (``count`` > 0: the last packet, divided by ``count``)."""
    if store:
        return STORE
    if count:
        return FINISH_POW2 if count & (count - 1) == 0 else FINISH
    return ADD


@kernel(inline="always")
def fold(old, value, mode, count, reciprocal):  # pragma: no cover - compiled
    """The total's new value (see :data:`ADD`); ``count`` and ``reciprocal`` float32."""
    if mode == STORE:
        return value + np.float32(0.0)
    if mode == FINISH:
        return (old + value) / count
    if mode == FINISH_POW2:
        return (old + value) * reciprocal
    return old + value


@kernel(inline="always")
def fold_top(top, mode, value):  # pragma: no cover - compiled
    """``top`` raised to ``value``'s exponent field in the finishing modes (all ones: a NaN or Inf)."""
    if mode >= FINISH:
        return max(top, np.int32(bits_of_f32(value) & np.uint32(0x7F800000)))
    return top
