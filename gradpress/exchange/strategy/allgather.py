"""All-gather: packets that cannot be summed (GRACE Algorithm 1 lines 10-13). Every rank's wire tensors
travel as one byte buffer (variable sizes after a sizes header) with its fault flag; every rank decodes
every packet and combines them (:meth:`Compressor.aggregate`: the mean, or e.g. a majority vote)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from gradpress.exchange.protocol import AllGather, Protocol, raise_flagged
from gradpress.exchange.strategy.common import collect, device_of, per_item, wire

if TYPE_CHECKING:
    from gradpress.exchange.strategy import Strategy


def exchange(s: Strategy, packets, outputs, timer, faulty) -> Protocol:
    """GRACE Algorithm 1 lines 10-13: every packet to every worker, decoded, then Agg (mean or rule).
    The received packets are copies (the gathered buffer), so an average may go into ``outputs``."""
    rows, flagged = yield from collect(s, *wire(s, packets), device_of(packets), AllGather, True, faulty)
    raise_flagged(flagged)
    outs = outputs if outputs is not None else [None] * len(packets)
    with timer():
        return [s.compressor.aggregate(item, out=out)
                for item, out in zip(per_item(s, packets, rows), outs, strict=True)]
