"""numba == torch: what the kernel tests share.

Every CPU kernel has a torch twin (the path of every other device, and of the CPU under
:func:`gradpress.kernels.jit.numba_disabled`); both must give the same bits, the wire tensors and the decoded
values alike (the sign of zero too). Tolerances, where a result is only as exact as its summation order,
are in :mod:`numerics`.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import gradpress
from gradpress.core.packet import Packet
from gradpress.core.rng import Context
from gradpress.kernels.jit import numba_disabled

#: both implementations on the CPU: ``@pytest.mark.parametrize("torch_only", PATHS)``
PATHS = [pytest.param(False, id="numba"), pytest.param(True, id="torch")]

_SAME_SIZE_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def path(torch_only: bool) -> contextlib.AbstractContextManager:
    """The torch implementation on the CPU, or the default numba kernels."""
    return numba_disabled() if torch_only else contextlib.nullcontext()


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns (an integer view of the same size: −0.0 and 0.0 differ, NaNs compare)."""
    return t if not t.is_floating_point() else t.view(_SAME_SIZE_INT[t.element_size()])


def both_paths(compressor: str | gradpress.Compressor, x: torch.Tensor,
               ctx: Context | None = None) -> tuple[Packet, torch.Tensor]:
    """The numba path's packet and decoding, after checking that the torch path gives the same bits:
    every wire tensor (dtype and bytes) and the decoded values."""
    c = gradpress.make(compressor) if isinstance(compressor, str) else compressor
    fast = c.compress(x, ctx)
    with numba_disabled():
        slow = c.compress(x, ctx)
        slow_values = c.decompress(slow)
    fast_wire, slow_wire = list(fast.wire()), list(slow.wire())
    assert [t.dtype for t in fast_wire] == [t.dtype for t in slow_wire], c.spec
    assert all(torch.equal(a, b) for a, b in zip(fast_wire, slow_wire, strict=True)), c.spec
    values = c.decompress(fast)
    assert values.dtype == slow_values.dtype and torch.equal(bits(values), bits(slow_values)), c.spec
    return fast, values


def accumulate_both_paths(compressor: str | gradpress.Compressor, xs: list[torch.Tensor]) -> torch.Tensor:
    """The all-gather sum of the workers' packets of ``xs`` (one per rank), after checking that the
    numba path's fused decode-add (:meth:`~gradpress.Compressor.accumulate`), the torch path's, and the
    dense formula ``total += _decompress(packet).float()`` (what :meth:`~gradpress.Compressor.aggregate`
    did before the fused kernels) give the same bits, packets added in rank order into a float32
    total that starts non-zero and holds −0.0 (the sign of a zero sum shows too)."""
    c = gradpress.make(compressor) if isinstance(compressor, str) else compressor
    packets = [c.compress(x, Context(seed=3, step=1, key="sum", rank=r)) for r, x in enumerate(xs)]
    n = xs[0].numel()
    start = torch.randn(n, generator=torch.Generator().manual_seed(9))
    start[::5] = -0.0
    dense = start.clone()
    for p in packets:
        dense += c._decompress(p).float().reshape(-1)
    for torch_only in (False, True):
        total = start.clone()
        with path(torch_only):
            for p in packets:
                c.accumulate(total, p)
        assert torch.equal(bits(total), bits(dense)), (c.spec, "torch" if torch_only else "numba")
    accumulate_into_both_paths(c, packets, start)
    return dense


def accumulate_into_both_paths(c: gradpress.Compressor, packets: list[Packet], start: torch.Tensor) -> None:
    """:meth:`~gradpress.Compressor.accumulate_into` on both paths, every mode, the same bits as the
    steps one by one (what :meth:`~gradpress.Compressor.aggregate` did before the fused modes): ``store``
    is ``0.0 + decode`` (a decoded −0.0 stored as +0.0) whatever the total held, ``count`` then divides
    by it (1, a power of two, and not), and the NaN/Inf count it returns is that of the result."""
    for p in packets:
        decoded = c._decompress(p).float().reshape(-1)
        for store in (False, True):
            summed = (torch.zeros_like(start) if store else start.clone()).add_(decoded)
            for count in (0, 1, 2, 3):
                expected = summed.div(count) if count else summed
                bad = int((~expected.isfinite()).sum()) if count else 0
                for torch_only in (False, True):
                    total = start.clone()
                    with path(torch_only):
                        got = c.accumulate_into(total, p, store=store, count=count)
                    where = (c.spec, store, count, "torch" if torch_only else "numba")
                    assert torch.equal(bits(total), bits(expected)), where
                    assert got == bad, where
