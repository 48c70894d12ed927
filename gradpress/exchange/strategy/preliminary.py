"""The preliminary exchange before compressing (:meth:`Compressor.prepare`): THC's largest norm (a max),
uniform THC's global min/max, PowerSGD's P (a sum), and ScaleCom's leader (CLT-k, App. E) broadcasting
its top-k indices to every worker."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from gradpress.core.compressor import Preliminary
from gradpress.exchange.protocol import (
    Broadcast,
    Protocol,
    flag_slots,
    flagged_ranks,
    parallel,
    raise_flagged,
    reduce_tensor,
    single,
)
from gradpress.exchange.strategy.common import flattened, split

if TYPE_CHECKING:
    from gradpress.exchange.strategy import Strategy


def combine(s: Strategy, prelims: Sequence[Preliminary | None], faulty: bool = False) -> Protocol:
    """Combine every item's :class:`Preliminary` over the workers; values of the same op, source and
    dtype travel in one collective. Returns each item's combined values (None where none), and
    whether the fault flags travelled with them.

    ``faulty``: this rank's gradient held NaN/Inf (its values come from zeros). The flags travel
    as slots of the first sum, max or min; when some rank is flagged, every rank raises
    :class:`NonFiniteError` here. A preliminary of broadcasts alone cannot carry them: the main
    exchange does."""
    groups: dict[tuple, list[int]] = {}
    for i, pre in enumerate(prelims):
        if pre is not None:
            src = pre.src if pre.op == "broadcast" else -1
            if pre.op == "broadcast" and not 0 <= src < s.world_size:
                raise ValueError(f"preliminary broadcast from rank {src} in a world of {s.world_size}")
            groups.setdefault((pre.op, src, pre.values.dtype, pre.values.device), []).append(i)
    protocols, carrier = [], None
    for g, ((op, src, _, _), members) in enumerate(groups.items()):
        parts = [flattened(prelims[i].values) for i in members]  # type: ignore[union-attr]
        if op == "broadcast":
            protocols.append(single(Broadcast(torch.cat(parts), src), final=False))
            continue
        if carrier is None:
            carrier = g
            parts.append(flag_slots(faulty, s.rank, s.world_size, op, parts[0]))
        protocols.append(reduce_tensor(torch.cat(parts), op, s.world_size, s.deterministic, final=False))
    combined = yield from parallel(protocols)
    if carrier is not None:
        flags = combined[carrier][-s.world_size:]
        raise_flagged(flagged_ranks(flags, list(groups)[carrier][0]))
        combined[carrier] = combined[carrier][:-s.world_size]
    out: list[torch.Tensor | None] = [None] * len(prelims)
    for members, values_flat in zip(groups.values(), combined, strict=True):
        shapes = [prelims[i].values for i in members]  # type: ignore[union-attr]
        for i, values in zip(members, split(values_flat, shapes), strict=True):
            out[i] = values
    return out, carrier is not None
