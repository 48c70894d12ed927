"""The ranks agree on what they exchange before they exchange it.

Gloo and NCCL match collectives by order and size only: ranks that run different compressors, options
or tensor shapes meet in collectives of different sizes, and the process group aborts the process
(``gloo::EnforceNotMet ... Received data size doesn't match``, SIGABRT) or, worse, adds unrelated bytes.
So before the first exchange of a set of tensors, every rank all-gathers a fingerprint of its side:
one 64-bit digest per component (the compressor's spec, the options and seed, the world size, the keys,
their shapes, their dtypes and devices). Equal digests cost one small all-gather, once per set of keys.
Where they differ, the ranks gather the differing components' text and every rank raises the same
``ValueError`` saying what differs on which rank.

A rank whose set of keys changes while another's does not cannot be caught this way (only one of them
runs the agreement); the process group's own error reports that case.
"""
from __future__ import annotations

import hashlib
import json
from typing import Mapping, Sequence

import torch

from gradpress.exchange.protocol import AllGather, Protocol, Round


def fingerprint(parts: Mapping[str, str]) -> torch.Tensor:
    """One signed 64-bit BLAKE2b digest per component, in the mapping's order."""
    digests = [int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
               for text in parts.values()]
    return torch.tensor(digests, dtype=torch.int64)


def agree(parts: Mapping[str, str], world_size: int, device: torch.device | str = "cpu") -> Protocol:
    """All-gather the :func:`fingerprint` of ``parts`` (component name -> canonical text); raise a
    ``ValueError`` naming every differing component and each rank's value of it, on every rank.
    ``device``: where the collectives' tensors live (the gradients' device, for NCCL)."""
    (table,) = yield Round([AllGather(fingerprint(parts).to(device))])
    names = list(parts)
    differing = [name for c, name in enumerate(names) if not bool((table[:, c] == table[0, c]).all())]
    if not differing:
        return None
    text = torch.frombuffer(bytearray(json.dumps([parts[name] for name in differing]).encode()), dtype=torch.uint8)
    (sizes,) = yield Round([AllGather(torch.tensor([text.numel()], dtype=torch.int64, device=device))])
    padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
    padded[:text.numel()] = text
    (texts,) = yield Round([AllGather(padded.to(device))])
    texts, sizes = texts.cpu(), sizes.cpu()
    values = [json.loads(bytes(texts[r, :int(sizes[r, 0])].tolist()).decode()) for r in range(world_size)]
    raise ValueError("gradpress: the ranks disagree on what they exchange: " + "; ".join(
        _difference(name, [row[i] for row in values]) for i, name in enumerate(differing)))


def _difference(name: str, by_rank: Sequence[str]) -> str:
    """``name``: rank 0 has X, ranks 1, 2 have Y (ranks grouped by value)."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(by_rank):
        groups.setdefault(value, []).append(rank)
    said = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            f"{'have' if len(ranks) > 1 else 'has'} {value}"
            for value, ranks in groups.items()]
    return f"{name}: " + ", ".join(said)
