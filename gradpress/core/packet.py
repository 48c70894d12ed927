"""The wire format: what one worker sends for one tensor.

A :class:`Packet` holds the tensors that cross the wire (bit-packed codes, scales, indices, bitmaps) and
the static metadata the receiver already knows (shape, dtype, the compressor's parameters). Its
:attr:`Packet.nbytes` is the exact number of bytes sent, the figure every benchmark reports as data
volume (GRACE Section 5.1 "data volume"), never an estimate.

Packets nest: a composition ``A+B`` (Natural compression paper, Thm 3) replaces the tensor of values
that ``A`` keeps by ``B``'s packet of those values.

Several packets' wire tensors travel in one byte buffer (:func:`pack`, :func:`unpack`), and tensors
lying back to back in one storage travel as one view of it (:func:`adjacent`, :func:`concat`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

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


# -- wire buffers ----------------------------------------------------------------------------------
_ALIGN = 8


def _offsets(nbytes: Sequence[int], element_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where :func:`pack` puts each tensor (a multiple of its element size, so that its slice views
    back as its dtype), and the buffer's size (a multiple of 8, so that buffers stack into rows)."""
    offsets, end = [], 0
    for size, element in zip(nbytes, element_sizes, strict=True):
        start = -(-end // element) * element
        offsets.append(start)
        end = start + size
    return offsets, -(-end // _ALIGN) * _ALIGN


def pack(tensors: Sequence[torch.Tensor], device: torch.device, size: int | None = None) -> torch.Tensor:
    """Concatenate the bytes of ``tensors`` into one uint8 buffer, each starting at a multiple of its
    element size, zero-padded to a multiple of 8 bytes, or to ``size`` bytes if given."""
    offsets, total = _offsets([t.numel() * t.element_size() for t in tensors], [t.element_size() for t in tensors])
    buffer = torch.zeros(max(total, size or 0), dtype=torch.uint8, device=device)
    for t, offset in zip(tensors, offsets, strict=True):
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset:offset + raw.numel()] = raw
    return buffer


def unpack(buffer: torch.Tensor, layout: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Views of ``buffer`` as the tensors :func:`pack` put there (``layout``: dtype and shape of each)."""
    elements = [dtype.itemsize for dtype, _ in layout]
    nbytes = [math.prod(shape) * e for (_, shape), e in zip(layout, elements, strict=True)]
    offsets, _ = _offsets(nbytes, elements)
    return [buffer[o:o + b].view(dtype).view(shape) if b else buffer.new_empty(shape, dtype=dtype)
            for (dtype, shape), o, b in zip(layout, offsets, nbytes, strict=True)]  # (an empty row's offset may be unaligned)


def packed_sizes(numels: Sequence[Sequence[int]], element_sizes: Sequence[int]) -> list[int]:
    """Bytes :func:`pack` needs for each row of ``numels`` (one row per rank, one column per tensor;
    numbers on the host, read once from the exchanged header)."""
    return [_offsets([n * e for n, e in zip(row, element_sizes, strict=True)], element_sizes)[1]
            for row in numels]


def received_layout(numels: Sequence[int], local: Sequence[torch.Tensor]) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Layout of another rank's wire tensors: the local dtypes, the local shapes where the sizes agree,
    1-D where a variable-size tensor differs."""
    layout = []
    for numel, mine in zip(numels, local, strict=True):
        if numel == mine.numel():
            layout.append((mine.dtype, tuple(mine.shape)))
        elif mine.dim() == 1:
            layout.append((mine.dtype, (int(numel),)))
        else:
            raise ValueError(f"a wire tensor of shape {tuple(mine.shape)} changes size between workers; "
                             "variable-size wire tensors must be 1-D")
    return layout


def adjacent(tensors: Sequence[torch.Tensor], writable: set[int]) -> torch.Tensor | None:
    """One flat view of ``tensors`` when they lie back to back, in order and of one dtype, in one
    storage the caller allows to overwrite (``writable``: storage pointers); None otherwise."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage()
    if storage.data_ptr() not in writable:
        return None
    if len(tensors) == 1:
        return first.detach().view(-1) if first.is_contiguous() else None
    position = first.data_ptr()
    for t in tensors:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.data_ptr() != position
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        position += t.numel() * t.element_size()
    total = sum(t.numel() for t in tensors)
    return first.new_empty(0).set_(storage, first.storage_offset(), (total,), (1,))


def concat(tensors: Sequence[torch.Tensor], writable: set[int]) -> torch.Tensor:
    """One flat tensor holding ``tensors`` in order: a view where :func:`adjacent` finds one (a DDP
    bucket's uncompressed gradients are all-reduced in place, as DDP itself does), else a copy."""
    view = adjacent(tensors, writable)
    return view if view is not None else torch.cat([t.reshape(-1) for t in tensors])
