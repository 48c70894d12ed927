"""The pieces every aggregation mode shares: summands grouped by dtype, wire tensors packed into one
byte buffer per rank and gathered (with each rank's fault flag), and the received buffers split back
into each item's packet from each rank."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from gradpress.core.packet import Packet, pack, packed_sizes, received_layout, unpack
from gradpress.exchange.protocol import AllGather, Gather, Protocol, Round, flagged_ranks, raise_flagged

if TYPE_CHECKING:
    from gradpress.exchange.strategy import Strategy


def split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset:offset + t.numel()].view(t.shape))
        offset += t.numel()
    return out


def flattened(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1)


def device_of(packets: Sequence[Packet]) -> torch.device:
    for p in packets:
        for t in p.wire():
            return t.device
    return torch.device("cpu")


def by_dtype(summands: Sequence[Sequence[torch.Tensor]]) -> list[list[tuple[int, int]]]:
    """(item, position) of every summand, grouped by dtype and device: one collective per group."""
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for i, tensors in enumerate(summands):
        for j, t in enumerate(tensors):
            groups.setdefault((t.dtype, t.device), []).append((i, j))
    return list(groups.values())


def unflatten(sums, members, summands) -> list[list[torch.Tensor]]:
    if len(summands) == 1 and len(summands[0]) == 1:  # one tensor (a bucket exchanged as one)
        return [[sums[0].view(summands[0][0].shape)]]
    per_item: list[list[torch.Tensor]] = [[None] * len(s) for s in summands]  # type: ignore[list-item]
    for summed, group in zip(sums, members, strict=True):
        for (i, j), part in zip(group, split(summed, [summands[i][j] for i, j in group]), strict=True):
            per_item[i][j] = part
    return per_item


def wire(s: Strategy, packets: Sequence[Packet]) -> tuple[list[torch.Tensor], bool]:
    """This rank's wire tensors in order, and whether their layout is fixed (the compressor's
    ``expected_nbytes`` is not None for every packet: the same sizes on every rank)."""
    c = s.compressor
    return ([t for p in packets for t in p.wire()],
            all(c.expected_nbytes(p.numel, p.dtype) is not None for p in packets))


def collect(s: Strategy, local: list[torch.Tensor], fixed: bool, device: torch.device, request: type,
             final: bool, faulty: bool | None) -> Protocol:
    """All-gather (or gather at the root) every worker's ``local`` tensors as one byte buffer per
    worker, each rank's fault flag with them. A ``fixed`` layout goes in one round, the flag as a
    trailer of the buffer; otherwise the workers first exchange their tensors' sizes, and the flags
    in that header (``faulty`` None: no flag). Returns each rank's unpacked tensors (None where
    nothing is received), and the flagged ranks (None where they are not known: a gather's non-root
    ranks)."""
    gather = (lambda t: Gather(t, s.root)) if request is Gather else AllGather
    if faulty is None:
        rows = yield from collect_plain(s, local, fixed, device, gather, final)
        return rows, []
    flag = torch.tensor([int(faulty)], dtype=torch.uint8, device=device)
    if fixed:
        (stack,) = yield Round([gather(pack([*local, flag], device))], final)
        layouts = [[(t.dtype, tuple(t.shape)) for t in [*local, flag]]] * s.world_size
        if stack is None:
            return None, None
        rows = [unpack(stack[j], layouts[j]) for j in range(s.world_size)]
        return [row[:-1] for row in rows], flagged_ranks(torch.cat([row[-1] for row in rows]))
    header = torch.tensor([t.numel() for t in local] + [int(faulty)], dtype=torch.int64, device=device)
    (headers,) = yield Round([AllGather(header)])
    numels = headers.tolist()  # the one read of the header by the host: flags, sizes and layouts
    flagged = flagged_ranks([row[-1] for row in numels])
    raise_flagged(flagged)  # every rank knows: no need to send the data
    numels = [row[:-1] for row in numels]
    sizes = packed_sizes(numels, [t.element_size() for t in local])
    (stack,) = yield Round([gather(pack(local, device, max(sizes)))], final)
    if stack is None:
        return None, flagged
    layouts = [received_layout(row, local) for row in numels]
    return [unpack(stack[j], layouts[j]) for j in range(s.world_size)], flagged


def collect_plain(s: Strategy, local, fixed, device, gather, final) -> Protocol:
    """:meth:`_collect` without flags."""
    if fixed:
        (stack,) = yield Round([gather(pack(local, device))], final)
        layouts = [[(t.dtype, tuple(t.shape)) for t in local]] * s.world_size
    else:
        header = torch.tensor([t.numel() for t in local], dtype=torch.int64, device=device)
        (headers,) = yield Round([AllGather(header)])
        numels = headers.tolist()
        sizes = packed_sizes(numels, [t.element_size() for t in local])
        (stack,) = yield Round([gather(pack(local, device, max(sizes)))], final)
        layouts = [received_layout(row, local) for row in numels] if stack is not None else []
    if stack is None:
        return None
    return [unpack(stack[j], layouts[j]) for j in range(s.world_size)]


def per_item(s: Strategy, packets: Sequence[Packet], rows: list[list[torch.Tensor]]) -> list[list[Packet]]:
    """For each item, its packet from every rank in rank order (this rank's own packet as it is)."""
    counts = [sum(1 for _ in p.wire()) for p in packets]
    return [[packet if j == s.rank else packet.with_wire(part) for j, part in enumerate(parts)]
            for packet, parts in zip(packets, by_item(rows, counts), strict=True)]


def by_item(rows: list[list[torch.Tensor]], counts: Sequence[int]) -> list[list[list[torch.Tensor]]]:
    """Each rank's received tensors (``rows[j]``, items in order, ``counts[i]`` tensors each) split
    by item: ``[item][rank]`` -> that item's tensors from that rank."""
    out, start = [], 0
    for count in counts:
        out.append([row[start:start + count] for row in rows])
        start += count
    return out
