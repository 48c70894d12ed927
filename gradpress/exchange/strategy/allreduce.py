"""All-reduce: summable packets (GRACE Algorithm 1 lines 7-9). Each rank's summands, grouped by dtype
into as few buffers as possible (in place in a DDP bucket where they lie in it), are summed over the
ranks (in rank order for floats over 3+ ranks) and decoded once. The fault flag rides in a float sum as
a NaN at position r (no extra bytes), else as n flag slots after the first buffer."""
from __future__ import annotations

import functools
import inspect
import math
from typing import TYPE_CHECKING

import torch

from gradpress.core.packet import concat
from gradpress.exchange.protocol import Protocol, flag_slots, flagged_ranks, parallel, raise_flagged, reduce_tensor
from gradpress.exchange.strategy.common import by_dtype, unflatten

if TYPE_CHECKING:
    from gradpress.core.compressor import Compressor
    from gradpress.exchange.strategy import Strategy


def exchange(s: Strategy, packets, outputs, writable, timer, faulty) -> Protocol:
    """GRACE Algorithm 1 lines 7-9: g = Q⁻¹(Allreduce(g̃)) / n, decoded into ``outputs`` (the gradients,
    ``writable`` their storages) where the method can and no sum lies in them."""
    summands = [s.summands(p) for p in packets]
    if len(summands) == 1 and len(summands[0]) == 1:  # one tensor (a DDP bucket exchanged as one): no grouping
        members = [[(0, 0)]]
        flats = [concat(summands[0], writable)]
    else:
        members = by_dtype(summands)
        flats = [concat([summands[i][j] for i, j in group], writable) for group in members]
    n = s.world_size
    carrier = next((g for g, f in enumerate(flats) if f.is_floating_point() and f.numel() >= n), None)
    if faulty is None:
        pass
    elif carrier is None:  # flag slots after the first buffer's values
        flats[0] = torch.cat([flats[0], flag_slots(faulty, s.rank, n, "sum", flats[0])])
    elif faulty:  # a NaN at position r marks rank r
        flats[carrier][s.rank] = math.nan
    sums = yield from parallel([reduce_tensor(f, "sum", n, s.deterministic, final=True) for f in flats])
    if faulty is None:
        pass
    elif carrier is None:
        raise_flagged(flagged_ranks(sums[0][-n:]))
        sums[0] = sums[0][:-n]
    else:
        raise_flagged(flagged_ranks(sums[carrier][:n], "nan"))
    per_item = unflatten(sums, members, summands)
    if (outputs is None or not takes_out(s.compressor)
            or any(t.untyped_storage().data_ptr() in writable for t in sums)):
        outputs = [None] * len(packets)
    with timer():
        return [s.compressor.decode_sum(p, summed, s.world_size, out) if out is not None
                else s.compressor.decode_sum(p, summed, s.world_size)
                for p, summed, out in zip(packets, per_item, outputs)]


@functools.cache
def _takes_out(method: type) -> bool:
    return "out" in inspect.signature(method.decode_sum).parameters


def takes_out(compressor: Compressor) -> bool:
    """Whether ``compressor``'s :meth:`~gradpress.core.compressor.Compressor.decode_sum` takes an ``out`` (a
    method written before it had one may not)."""
    return _takes_out(type(compressor))
