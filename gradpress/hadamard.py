"""The randomized Hadamard transform (THC paper, Section 5.1): RHT(x) = H·D·x / √d.

H is the d×d Hadamard matrix in Sylvester order (``scipy.linalg.hadamard``), D a diagonal of
independent ±1 signs drawn from a stream shared by every worker (DESIGN invariant 2), so all workers
rotate alike and their transformed vectors can be summed. Dividing by √d makes H·D/√d orthonormal: it
preserves norms and its inverse is its transpose, D·H/√d (Section 5.1's RHT⁻¹).

As in the THC authors' code, a long vector is cut into partitions of at most ``partition`` values
(2^20 by default), each zero-padded to a power of two and transformed on its own: the transform is
block diagonal, one Hadamard block per partition. The fast Walsh–Hadamard transform runs in
O(d log d): log2(d) butterfly stages, each one vectorized reshape over the whole batch of partitions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_PARTITION = 1 << 20


@dataclass(frozen=True)
class RHTLayout:
    """How a vector of ``numel`` values is partitioned, padded and signed.

    Attributes:
        numel: length of the original vector.
        partition: the most values one Hadamard block takes.
        signs: the diagonal D, ``numel`` values ±1 (float32); padding needs no signs (it is zero).
    """

    numel: int
    partition: int
    signs: torch.Tensor

    @property
    def full_blocks(self) -> int:
        """Number of partitions holding exactly ``partition`` values."""
        return self.numel // self.partition

    @property
    def tail(self) -> int:
        """Values in the last, shorter partition (0 if there is none)."""
        return self.numel - self.full_blocks * self.partition

    @property
    def padded_numel(self) -> int:
        """Length of the transformed vector: every partition padded to a power of two."""
        tail = _next_power_of_two(self.tail) if self.tail else 0
        return self.full_blocks * _next_power_of_two(self.partition) + tail


def rht_layout(
    numel: int,
    signs_generator: torch.Generator,
    partition: int = DEFAULT_PARTITION,
    device: torch.device | str = "cpu",
) -> RHTLayout:
    """The layout of an RHT of ``numel`` values, drawing the ±1 diagonal from ``signs_generator``.

    A receiver that did not compress rebuilds the same layout from the same shared seed.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"rht: numel must be a non-negative integer, got {numel!r}")
    if isinstance(partition, bool) or not isinstance(partition, int) or partition < 1:
        raise ValueError(f"rht: partition must be a positive integer, got {partition!r}")
    bits = torch.randint(0, 2, (numel,), generator=signs_generator, device=device, dtype=torch.int8)
    signs = (1 - 2 * bits).to(torch.float32)
    return RHTLayout(numel, partition, signs)


def rht(
    flat: torch.Tensor, signs_generator: torch.Generator, partition: int = DEFAULT_PARTITION
) -> tuple[torch.Tensor, RHTLayout]:
    """RHT of a 1-D tensor: ``(H·D·x/√P per partition, concatenated; the layout to invert it)``.

    The result is float32 (float64 input stays float64) and has ``layout.padded_numel`` values.
    """
    _check_flat(flat)
    layout = rht_layout(flat.numel(), signs_generator, partition, flat.device)
    return apply_rht(flat, layout), layout


def apply_rht(flat: torch.Tensor, layout: RHTLayout) -> torch.Tensor:
    """The forward transform with a given layout (same signs, same partitions)."""
    _check_flat(flat)
    if flat.numel() != layout.numel:
        raise ValueError(f"rht: the layout is for {layout.numel} values, got {flat.numel()}")
    x = flat.to(_work_dtype(flat)) * layout.signs.to(_work_dtype(flat))
    return torch.cat([fwht(block).reshape(-1) for block in _split(x, layout)])


def inverse_rht(transformed: torch.Tensor, layout: RHTLayout) -> torch.Tensor:
    """RHT⁻¹(y) = D·H·y/√P per partition, padding dropped: ``layout.numel`` values."""
    _check_flat(transformed)
    if transformed.numel() != layout.padded_numel:
        raise ValueError(
            f"inverse_rht: the layout expects {layout.padded_numel} values, got {transformed.numel()}"
        )
    y = transformed.to(_work_dtype(transformed))
    full = layout.full_blocks * _next_power_of_two(layout.partition)
    pieces = []
    if layout.full_blocks:
        blocks = fwht(y[:full].view(layout.full_blocks, -1))
        pieces.append(blocks[:, : layout.partition].reshape(-1))
    if layout.tail:
        pieces.append(fwht(y[full:].view(1, -1))[0, : layout.tail])
    if not pieces:
        return y[:0]
    return torch.cat(pieces) * layout.signs.to(y.dtype)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh–Hadamard transform along the last dimension (a power of two).

    Equals ``x @ scipy.linalg.hadamard(n) / √n`` (Sylvester order): stage h combines entries i and
    i + h of every block of 2h entries into their sum and difference, for h = 1, 2, 4, …, n/2.
    """
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht: the last dimension must be a power of two, got {n}")
    y = x.reshape(-1, n).clone()
    out = torch.empty_like(y)  # two buffers, swapped after every stage
    h = 1
    while h < n:
        pairs, sums = y.view(-1, n // (2 * h), 2, h), out.view(-1, n // (2 * h), 2, h)
        torch.add(pairs[:, :, 0], pairs[:, :, 1], out=sums[:, :, 0])
        torch.sub(pairs[:, :, 0], pairs[:, :, 1], out=sums[:, :, 1])
        y, out = out, y
        h *= 2
    return y.mul_(n**-0.5).view(x.shape)


def _split(x: torch.Tensor, layout: RHTLayout) -> list[torch.Tensor]:
    """The partitions of ``x`` as zero-padded [batch, power of two] tensors."""
    full = layout.full_blocks * layout.partition
    blocks = []
    if layout.full_blocks:
        blocks.append(_pad(x[:full].view(layout.full_blocks, layout.partition)))
    if layout.tail:
        blocks.append(_pad(x[full:].view(1, layout.tail)))
    return blocks or [x.view(0, 1)]


def _pad(block: torch.Tensor) -> torch.Tensor:
    width = block.shape[1]
    return torch.nn.functional.pad(block, (0, _next_power_of_two(width) - width))


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_flat(t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        raise ValueError(f"rht: expected a 1-D tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if not t.dtype.is_floating_point:
        raise ValueError(f"rht: expected a floating-point tensor, got {t.dtype}")
