"""All-reduce: summable packets (GRACE Algorithm 1 lines 7-9). Each rank's summands, grouped by dtype
into as few buffers as possible (in place in a DDP bucket where they lie in it), are summed over the
ranks (in rank order for floats over 3+ ranks) and decoded once. The fault flag rides in a float sum as
a NaN at position r (no extra bytes), else as n flag slots after the first buffer."""
from __future__ import annotations

import functools
import inspect
import math
from typing import TYPE_CHECKING, Callable

import torch

from gradpress.core.packet import concat
from gradpress.exchange.protocol import (
    Protocol,
    ReduceScatter,
    flag_slots,
    flagged_ranks,
    parallel,
    raise_flagged,
    reduce_tensor,
    single,
)
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
    _raise_flagged(sums, faulty, carrier, n)
    per_item = unflatten(sums, members, summands)
    if (outputs is None or not takes_out(s.compressor)
            or any(t.untyped_storage().data_ptr() in writable for t in sums)):
        outputs = [None] * len(packets)
    with timer():
        return [s.compressor.decode_sum(p, summed, s.world_size, out) if out is not None
                else s.compressor.decode_sum(p, summed, s.world_size)
                for p, summed, out in zip(packets, per_item, outputs, strict=True)]


def _raise_flagged(sums: list[torch.Tensor], faulty: bool | None, carrier: int | None, n: int) -> None:
    """Read the fault flags that rode in ``sums`` (a NaN at position r of buffer ``carrier``, or n flag
    slots after the first buffer's values, which are cut off here) and raise for the flagged ranks."""
    if faulty is None:
        return
    if carrier is None:
        raise_flagged(flagged_ranks(sums[0][-n:]))
        sums[0] = sums[0][:-n]
    else:
        raise_flagged(flagged_ranks(sums[carrier][:n], "nan"))


def reduce_scatter(s: Strategy, packets, timer, faulty) -> Protocol:
    """The reduce-scatter of summable packets (a sharded model's gradient reduction, as FSDP's): n rows
    of packets, row j to be averaged at rank j. Each row's summands are grouped by dtype as for the
    all-reduce (the rows alike), the rows stacked into one (n, length) buffer per dtype and
    reduce-scattered (summed in rank order, bit-reproducible); rank r decodes row r with its own packets
    of that row (GRACE Algorithm 1 line 9 on one shard). The fault flag rides in every row: a NaN at
    position r of each row of the first float buffer of n values or more, else n flag slots after each
    row of the first buffer, so that every rank reads every rank's flag."""
    n, rank = s.world_size, s.rank
    m = len(packets) // n
    summands = [s.summands(p) for p in packets]
    mine = packets[rank * m:(rank + 1) * m]
    own = summands[rank * m:(rank + 1) * m]
    members = by_dtype(own)
    stacks = [torch.cat([summands[j * m + i][k].reshape(-1) for j in range(n) for i, k in group]).view(n, -1)
              for group in members]
    carrier = next((g for g, t in enumerate(stacks) if t.is_floating_point() and t.shape[1] >= n), None)
    if faulty is None:
        pass
    elif carrier is None:
        slots = flag_slots(faulty, rank, n, "sum", stacks[0])
        stacks[0] = torch.cat([stacks[0], slots.expand(n, n)], dim=1)
    elif faulty:
        stacks[carrier][:, rank] = math.nan
    sums = yield from parallel([single(ReduceScatter(t), final=True) for t in stacks])
    _raise_flagged(sums, faulty, carrier, n)
    per_item = unflatten(sums, members, own)
    with timer():
        return [s.compressor.decode_sum(p, summed, n) for p, summed in zip(mine, per_item, strict=True)]


@functools.cache
def _takes_out(decode_sum: Callable[..., object]) -> bool:
    return "out" in inspect.signature(decode_sum).parameters


def takes_out(compressor: Compressor) -> bool:
    """Whether ``compressor``'s :meth:`~gradpress.core.compressor.Compressor.decode_sum` takes an ``out`` (a
    method written before it had one may not)."""
    return _takes_out(type(compressor).decode_sum)
