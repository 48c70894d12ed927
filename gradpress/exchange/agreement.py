"""The ranks agree on what they exchange before they exchange it.

Gloo and NCCL match collectives by order and size only: ranks that run different compressors, options
or tensor shapes meet in collectives of different sizes, and the process group aborts the process
(``gloo::EnforceNotMet ... Received data size doesn't match``, SIGABRT) or, worse, adds unrelated bytes.
So before the first exchange of a set of tensors, every rank all-gathers a fingerprint of its side: one
64-bit digest of all its components (the compressor's spec, the options and seed, the world size, the
keys, their shapes, dtypes and devices, and the step counters that seed the shared random streams and
the schedules; with ``hierarchy="node"``, the hierarchy and the node size each rank found:
:mod:`gradpress.exchange.hierarchy`), whatever their number: ranks whose sides have different components
(``"auto"`` adds its own) still meet in collectives of the same sizes. Equal digests cost one all-gather of 8 bytes a
rank, once per set of keys (and again after a state is loaded). Where they differ, the ranks gather
every component's text (a size, then the texts padded to the longest) and every rank raises the same
``ValueError`` saying what differs on which rank.

A rank whose set of keys changes while another's does not, or that loads a state while another does
not, cannot be caught this way (only one of them runs the agreement); the process group's own error
reports that case.
"""
from __future__ import annotations

import hashlib
import json
from typing import Mapping, Sequence

import torch

from gradpress.exchange.protocol import AllGather, Protocol, Round

#: how a component that a rank does not have reads in the error
ABSENT = "nothing"


def fingerprint(parts: Mapping[str, str]) -> torch.Tensor:
    """One signed 64-bit BLAKE2b digest of every component (its name and text, in the mapping's order):
    a tensor of one element, whatever the number of components."""
    text = json.dumps(list(parts.items())).encode()
    digest = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)
    return torch.tensor([digest], dtype=torch.int64)


def agree(parts: Mapping[str, str], world_size: int, device: torch.device | str = "cpu") -> Protocol:
    """All-gather the :func:`fingerprint` of ``parts`` (component name -> canonical text); where they
    differ, raise a ``ValueError`` naming every differing component and each rank's value of it, on
    every rank. ``device``: where the collectives' tensors live (the gradients' device, for NCCL)."""
    (table,) = yield Round([AllGather(fingerprint(parts).to(device))])
    if bool((table == table[0]).all()):
        return None
    text = torch.frombuffer(bytearray(json.dumps(list(parts.items())).encode()), dtype=torch.uint8)
    (sizes,) = yield Round([AllGather(torch.tensor([text.numel()], dtype=torch.int64, device=device))])
    sizes = sizes.cpu()
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[:text.numel()] = text
    (texts,) = yield Round([AllGather(padded.to(device))])
    texts = texts.cpu()
    by_rank = [dict(json.loads(bytes(texts[r, :int(sizes[r, 0])].tolist()).decode()))
               for r in range(world_size)]
    names = list(dict.fromkeys(name for side in by_rank for name in side))  # rank 0's order, then the others'
    differing = [name for name in names if len({side.get(name, ABSENT) for side in by_rank}) > 1]
    raise ValueError("gradpress: the ranks disagree on what they exchange: " + "; ".join(
        _difference(name, [side.get(name, ABSENT) for side in by_rank]) for name in differing))


def _difference(name: str, by_rank: Sequence[str]) -> str:
    """``name``: rank 0 has X, ranks 1, 2 have Y (ranks grouped by value)."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(by_rank):
        groups.setdefault(value, []).append(rank)
    said = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            f"{'have' if len(ranks) > 1 else 'has'} {value}"
            for value, ranks in groups.items()]
    return f"{name}: " + ", ".join(said)
