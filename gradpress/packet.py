"""The wire format: what one worker sends for one tensor.

A :class:`Packet` holds the tensors that cross the wire (bit-packed codes, scales, indices, bitmaps) and
the static metadata the receiver already knows (shape, dtype, the compressor's parameters). Its
:attr:`Packet.nbytes` is the exact number of bytes sent, the figure every benchmark reports as data
volume (GRACE Section 5.1 "data volume"), never an estimate.

Packets nest: a composition ``A+B`` (Natural compression paper, Thm 3) replaces the tensor of values
that ``A`` keeps by ``B``'s packet of those values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

Wire = "torch.Tensor | Packet"


@dataclass
class Packet:
    """Tensors on the wire plus static metadata.

    Attributes:
        tensors: name -> wire tensor or nested packet, in the order they are sent.
        shape: shape of the tensor that was compressed.
        dtype: dtype of the tensor that was compressed (and of the decompressed result).
        meta: static facts the receiver knows without being sent them (not counted in ``nbytes``).
    """

    tensors: dict[str, torch.Tensor | Packet]
    shape: torch.Size
    dtype: torch.dtype
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def device(self) -> torch.device:
        for t in self.wire():
            return t.device
        return torch.device("cpu")

    @property
    def nbytes(self) -> int:
        """Exact bytes on the wire: the sum of every wire tensor's size."""
        return sum(t.numel() * t.element_size() for t in self.wire())

    def wire(self) -> Iterator[torch.Tensor]:
        """The wire tensors in send order, nested packets flattened depth-first."""
        for value in self.tensors.values():
            if isinstance(value, Packet):
                yield from value.wire()
            else:
                yield value

    def with_wire(self, tensors: list[torch.Tensor] | Iterator[torch.Tensor]) -> Packet:
        """A packet of the same structure and metadata whose wire tensors are ``tensors`` (in order).

        This is how a receiver rebuilds a packet from the tensors a collective delivered.
        """
        source = iter(tensors)
        rebuilt: dict[str, torch.Tensor | Packet] = {}
        for name, value in self.tensors.items():
            rebuilt[name] = value.with_wire(source) if isinstance(value, Packet) else next(source)
        return Packet(rebuilt, self.shape, self.dtype, dict(self.meta))

    def to(self, device: torch.device | str) -> Packet:
        return self.with_wire(t.to(device) for t in self.wire())

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.tensors[name]
        if isinstance(value, Packet):
            raise TypeError(f"wire entry {name!r} is a nested packet; use .tensors[{name!r}]")
        return value
