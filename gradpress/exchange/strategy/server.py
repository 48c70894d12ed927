"""Parameter server and switch: the workers' packets meet at one rank (``root``), which combines the
arrivals' (all, or ⌈q·n⌉ with partial aggregation: THC Sections 6 and 8.4) and broadcasts the result —
the sums for the workers to decode (a switch adds integers only: THC Section 6, Natural paper App.
C.6), the mean, or the mean re-compressed by a master compressor C_M (bidirectional compression,
Natural paper Algorithm 1). The root forwards the fault flags it gathered in its broadcast."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from gradpress.core.packet import Packet, pack, packed_sizes, received_layout, unpack
from gradpress.exchange.protocol import (
    Broadcast,
    Gather,
    Protocol,
    Round,
    flagged_ranks,
    fold_sum,
    raise_flagged,
)
from gradpress.exchange.strategy.common import (
    by_dtype,
    by_item,
    collect,
    device_of,
    flattened,
    per_item,
    unflatten,
    wire,
)

if TYPE_CHECKING:
    from gradpress.exchange.strategy import Strategy


def sum_at_server(s: Strategy, packets, ctxs, timer, faulty) -> Protocol:
    """Parameter server / switch for summable packets: the workers upload to the root, which adds
    the arrivals' summands in rank order (integers only in switch mode) and broadcasts the sums, or
    C_M of the mean (and the sums too for a method whose decoding keeps state, e.g. PowerSGD's warm
    start, so that every rank's stays alike); every rank decodes with the count of arrivals.

    The upload is the packets themselves where their size is fixed and smaller than the summands
    (THC Fig. 4: b-bit table indices, which the server looks up); otherwise the summands (PowerSGD:
    Q alone, not P̂ and Q). Every rank computes its own summands first: their dtypes and shapes,
    widened as the overflow guard says, are the downstream layout and decide the upload, and a sum
    that cannot be formed raises on every rank before any collective."""
    own = [s.summands(p) for p in packets]
    upload_packets = uploads_packets(s, packets, own)
    local, fixed = wire(s, packets) if upload_packets else ([t for mine in own for t in mine], True)
    rows, flagged = yield from collect(s, local, fixed, device_of(packets), Gather, False, faulty)
    arrivals = [s.arrivals(ctx) for ctx in ctxs]
    totals = None
    if rows is not None:
        counts = [sum(1 for _ in p.wire()) if upload_packets else len(mine)
                  for p, mine in zip(packets, own, strict=True)]
        with timer():
            totals = [add(s, p, mine, parts, arrived, upload_packets) for p, mine, parts, arrived
                      in zip(packets, own, by_item(rows, counts), arrivals, strict=True)]
    if s.master is not None:
        if s.compressor.stateful_decode:  # every rank decodes the sums, to keep its state alike
            sums = yield from broadcast_sums(s, totals, own, False, flagged, faulty is not None)
            with timer():
                decoded = [s.compressor.decode_sum(p, summed, len(a))
                           for p, summed, a in zip(packets, sums, arrivals, strict=True)]
            means = decoded if totals is not None else None
        else:
            means = None
            if totals is not None:
                with timer():
                    means = [s.compressor.decode_sum(p, summed, len(a))
                             for p, summed, a in zip(packets, totals, arrivals, strict=True)]
        return (yield from master_broadcast(s, means, packets, ctxs, timer, flagged, faulty is not None))
    sums = yield from broadcast_sums(s, totals, own, True, flagged, faulty is not None)
    with timer():
        return [s.compressor.decode_sum(p, summed, len(a))
                for p, summed, a in zip(packets, sums, arrivals, strict=True)]


def broadcast_sums(s: Strategy, totals: list[list[torch.Tensor]] | None, own: list[list[torch.Tensor]],
                   final: bool, flagged: list[int] | None, carry: bool) -> Protocol:
    """The server's sums (``totals``, None on other ranks) broadcast to every rank, one collective
    per dtype, with the ranks it found flagged (``flagged``); each item's sums, shaped as its
    summands ``own``."""
    members, flats = by_dtype(own), []
    for group in members:
        if totals is not None:
            flats.append(torch.cat([flattened(totals[i][j]) for i, j in group]))
        else:  # a buffer for the root's sums
            (i, j), size = group[0], sum(own[i][j].numel() for i, j in group)
            flats.append(own[i][j].new_empty(size))
    if carry:
        flats[0] = forward_flags(s, flats[0], flagged)
    sums = yield Round([Broadcast(f, s.root) for f in flats], final=final)
    if carry:
        sums[0] = received_flags(s, sums[0])
    return unflatten(sums, members, own)


def forward_flags(s: Strategy, buffer: torch.Tensor, flagged: list[int] | None) -> torch.Tensor:
    """``buffer`` with n flag slots appended: the root's ``flagged`` ranks marked, or room for them."""
    n = s.world_size
    if flagged is None:
        return torch.cat([buffer, buffer.new_empty(n)])
    slots = buffer.new_zeros(n)
    slots[flagged] = 1
    return torch.cat([buffer, slots])


def received_flags(s: Strategy, buffer: torch.Tensor) -> torch.Tensor:
    """Raise if the root forwarded flagged ranks in ``buffer``'s slots; the buffer without them."""
    raise_flagged(flagged_ranks(buffer[-s.world_size:]))
    return buffer[:-s.world_size]


def uploads_packets(s: Strategy, packets: Sequence[Packet], own: Sequence[Sequence[torch.Tensor]]) -> bool:
    """Whether workers send the server their packets rather than their summands: when every
    packet's size is fixed and they are smaller in all. Decided from sizes, dtypes and the world
    size only, so every rank decides alike."""
    c = s.compressor
    sizes = [c.expected_nbytes(p.numel, p.dtype) for p in packets]
    known = [size for size in sizes if size is not None]
    if len(known) < len(sizes):
        return False
    return sum(known) < sum(t.numel() * t.element_size() for mine in own for t in mine)


def add(s: Strategy, packet: Packet, mine: list[torch.Tensor], parts: list[list[torch.Tensor]],
        arrived: Sequence[int], upload_packets: bool) -> list[torch.Tensor]:
    """One item's rank-order sums of the arrivals' summands. ``parts[j]``: what rank j uploaded (its
    wire tensors, whose summands the server computes, or its summands); ``mine``: this rank's own."""
    columns = []
    for j in arrived:
        if j == s.rank:
            columns.append(mine)
        else:
            columns.append(s.summands(packet.with_wire(parts[j])) if upload_packets else parts[j])
    return [fold_sum([column[k] for column in columns]) for k in range(len(mine))]


def gather_at_server(s: Strategy, packets, ctxs, timer, faulty) -> Protocol:
    """Parameter server for other packets: gather them at the root, decode and aggregate the
    arrivals' there, send back the dense mean or its C_M packet (Natural paper Algorithm 1, master
    side)."""
    rows, flagged = yield from collect(s, *wire(s, packets), device_of(packets), Gather, False, faulty)
    means = None
    if rows is not None:
        arrivals = [s.arrivals(ctx) for ctx in ctxs]
        with timer():
            means = [s.compressor.aggregate([item[j] for j in arrived])
                     for item, arrived in zip(per_item(s, packets, rows), arrivals, strict=True)]
    if s.master is not None:
        return (yield from master_broadcast(s, means, packets, ctxs, timer, flagged, faulty is not None))
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(packets):
        groups.setdefault((p.dtype, p.device), []).append(i)
    buffers = []
    for (dtype, device), items in groups.items():
        if means is not None:
            buffers.append(torch.cat([flattened(means[i]) for i in items]))
        else:
            buffers.append(torch.empty(sum(packets[i].numel for i in items), dtype=dtype, device=device))
    carry = faulty is not None
    if carry:
        buffers[0] = forward_flags(s, buffers[0], flagged)
    received = yield Round([Broadcast(b, s.root) for b in buffers], final=True)
    if carry:
        received[0] = received_flags(s, received[0])
    out: list[torch.Tensor] = [None] * len(packets)  # type: ignore[list-item]
    for items, sums in zip(groups.values(), received, strict=True):
        offset = 0
        for i in items:
            out[i] = sums[offset:offset + packets[i].numel].view(packets[i].shape)
            offset += packets[i].numel
    return out


def master_broadcast(s: Strategy, means, packets, ctxs, timer, flagged, carry) -> Protocol:
    """The root compresses each mean with C_M and broadcasts the packets; every rank (the root too)
    decodes the broadcast bytes, so all end with the same bits. Non-roots learn the packets'
    structure from C_M applied to zeros with the same context (structure and metadata depend on the
    context and the size, never on the values), their sizes from a header, which also carries the
    flagged ranks."""
    master = s.master
    assert master is not None
    device = device_of(packets)
    contexts = [ctx.with_key(ctx.key + "/master") for ctx in ctxs]
    sources = means if means is not None else [torch.zeros(p.shape, dtype=p.dtype, device=device) for p in packets]
    mpackets = [master.compress(x, ctx) for x, ctx in zip(sources, contexts, strict=True)]
    local = [t for p in mpackets for t in p.wire()]
    header = torch.tensor([t.numel() for t in local], dtype=torch.int64, device=device)
    (header,) = yield Round([Broadcast(forward_flags(s, header, flagged) if carry else header, s.root)])
    header = received_flags(s, header) if carry else header
    numels = header.tolist()
    layout = received_layout(numels, local)
    (size,) = packed_sizes([numels], [t.element_size() for t in local])
    buffer = pack(local, device, size) if means is not None else torch.empty(size, dtype=torch.uint8, device=device)
    (buffer,) = yield Round([Broadcast(buffer, s.root)], final=True)
    tensors = iter(unpack(buffer, layout))
    with timer():
        out = []
        for mp, p in zip(mpackets, packets, strict=True):
            received = mp.with_wire([next(tensors) for _ in mp.wire()])
            out.append(master.decompress(received).to(p.dtype).view(p.shape))
        return out
