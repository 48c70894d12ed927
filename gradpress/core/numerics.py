"""The numeric passes the compressor contract stands on (docs/design.md, "Invariants"): error feedback's
sum φ = β·m + γ·g with torch's bits, the NaN/Inf checks and their error, the output range of a decode
(saturation to an fp16/bf16 dtype), and ``divide``, the one division by a worker count, correctly rounded
on every device. Each pass runs as a numba kernel on contiguous CPU tensors
(:mod:`gradpress.kernels.passes`, imported with the first call that runs one) and as torch elsewhere,
with the same bits.
"""
from __future__ import annotations

import numpy as np
import torch

from gradpress.kernels.dispatch import as_numpy, use_numba
from gradpress.kernels.warm import large_only

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class NonFiniteError(ValueError):
    """A gradient holds NaN or Inf: reported instead of spread into every worker
    (invariant: dtype/shape/device preserved; NaN/Inf reported, docs/design.md).

    ``ranks``: in a distributed exchange, the ranks whose gradients held them (the same list, and the
    same message, on every rank); None where a single process found them."""

    ranks: list[int] | None = None


# -- error feedback's sum φ = β·m + γ·g -------------------------------------------------------------
_STREAMED = 1 << 21  # values (8 MiB): sums at least this large are written past the caches


def add_into(memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``torch.add(memory, grad, out=out)``, the same bits (error feedback's φ = m + g); float32 CPU
    tensors larger than the caches in one numba pass whose stores bypass them (measured on the 13 MB
    gradient of ``mlp-wide``: 1.4 ms against torch's 1.7, the norm that reads the sum next included)."""
    if (out.numel() >= _STREAMED and memory.dtype == grad.dtype == out.dtype == torch.float32
            and memory.shape == grad.shape == out.shape and use_numba(memory) and use_numba(grad)
            and memory.is_contiguous() and grad.is_contiguous() and out.is_contiguous()):
        _kernels().add_streamed(as_numpy(memory.view(-1)), as_numpy(grad.view(-1)), as_numpy(out.view(-1)))
        return out
    return torch.add(memory, grad, out=out)


@large_only
def _compile_streamed_sum() -> None:
    """:func:`add_into`'s kernel, compiled on a few values (it runs on 2^21 and more)."""
    values = np.zeros(16, np.float32)
    _kernels().add_streamed(values, values, np.empty_like(values))


def scaled_sum(memory: torch.Tensor, grad: torch.Tensor, beta: float, gamma: float,
               out: torch.Tensor) -> torch.Tensor:
    """out = ``memory * beta + grad * gamma`` with torch's bits, fl32(fl32(m·β) + fl32(g·γ)) (β and γ
    rounded to float32; a factor of 1 is exact, so β = γ = 1 gives m + g): one numba pass for
    contiguous float32 CPU tensors, else torch's products and sum. Returns ``out``."""
    if beta == 1.0 and gamma == 1.0:
        return add_into(memory, grad, out)  # (past the caches for large tensors)
    if (use_numba(out) and memory.dtype == grad.dtype == out.dtype == torch.float32 and memory.is_contiguous()
            and grad.is_contiguous() and out.is_contiguous()):
        _kernels().scaled_sum(as_numpy(memory).reshape(-1), as_numpy(grad).reshape(-1), np.float32(beta),
                              np.float32(gamma), as_numpy(out).reshape(-1))
    else:
        torch.add(memory * beta if beta != 1.0 else memory, grad * gamma if gamma != 1.0 else grad, out=out)
    return out


def sum_addends(memory: torch.Tensor, grad: torch.Tensor, out: torch.Tensor, beta: float = 1.0,
                gamma: float = 1.0) -> tuple | None:
    """The ``addends`` (m, g, β, γ) a kernel takes to form φ = β·m + γ·g in its first pass (numpy views,
    β and γ as float32), or None where the kernels don't apply (then
    :meth:`~gradpress.core.fused.FusedPaths.compress_sum`'s default): contiguous float32 CPU tensors,
    non-empty."""
    if not (use_numba(out) and out.numel() and memory.dtype == grad.dtype == out.dtype == torch.float32
            and memory.is_contiguous() and grad.is_contiguous() and out.is_contiguous()):
        return None
    return as_numpy(memory).reshape(-1), as_numpy(grad).reshape(-1), np.float32(beta), np.float32(gamma)


# -- output range ---------------------------------------------------------------------------------
def float32_output(out: torch.Tensor | None, numel: int) -> torch.Tensor | None:
    """``out`` flattened where a float32 result of ``numel`` values can be written into it (a contiguous
    float32 tensor of that many values), else None: the ``out`` of
    :meth:`~gradpress.core.compressor.Compressor.aggregate` and
    :meth:`~gradpress.core.compressor.Compressor.decode_sum`."""
    if out is not None and out.dtype == torch.float32 and out.is_contiguous() and out.numel() == numel:
        return out.view(-1)
    return None


def saturate(flat: torch.Tensor, dtype: torch.dtype, inplace: bool = True) -> torch.Tensor:
    """``flat`` (a float32 decode) clamped to ±``finfo(dtype).max``: decoded values beyond the range of
    the gradient's dtype become its largest finite value (±Inf too; NaN stays NaN). ``flat`` itself for
    a float32 ``dtype``: nothing to do but for an overflow, which the caller reports or avoids."""
    if dtype == torch.float32 and flat.dtype == torch.float32:
        return flat
    if flat.dtype != torch.float32:
        if torch.finfo(flat.dtype).max <= torch.finfo(dtype).max:  # e.g. bf16 wire values, fp32 out
            return flat
        flat, inplace = flat.float(), True  # a copy of its own
    largest = torch.finfo(dtype).max
    return flat.clamp_(-largest, largest) if inplace else flat.clamp(-largest, largest)


# -- input checks ---------------------------------------------------------------------------------
def check_finite(flat: torch.Tensor, where: str) -> None:
    """Raise :class:`NonFiniteError` if ``flat`` holds NaN or Inf (one read-only pass; a second one
    counts them, only when there is something to count)."""
    if any_nonfinite(flat):
        raise nonfinite_error(where, count_nonfinite(flat), flat.numel())


def nonfinite_error(where: str, bad: int, numel: int) -> NonFiniteError:
    """The error for a gradient of ``numel`` values of which ``bad`` are NaN/Inf."""
    return NonFiniteError(f"{where}: the gradient holds {bad} NaN/Inf value(s) out of {numel}")


def _kernels():  # noqa: ANN202
    """The numba kernels of these passes (:mod:`gradpress.kernels.passes`), imported with the first call
    that runs one, so that importing the core loads no numba."""
    from gradpress.kernels import passes

    return passes


# exponent-field masks: a float is NaN or Inf exactly when its exponent bits are all ones
_EXPONENT_MASKS = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}


def count_nonfinite(flat: torch.Tensor) -> int:
    """Number of NaN/Inf entries of a 1-D contiguous float tensor."""
    if use_numba(flat):
        bits = as_numpy(flat).view("uint32" if flat.dtype == torch.float32 else "uint16")
        return int(_kernels().count_exponent_all_ones(bits, _EXPONENT_MASKS[flat.dtype]))
    return int((~torch.isfinite(flat)).sum())


def any_nonfinite(flat: torch.Tensor) -> bool:
    """Whether a 1-D contiguous float tensor holds a NaN or Inf: the largest exponent field of its values
    is all ones (an integer max vectorizes; a count costs about a third more, measured on 16 MB)."""
    if use_numba(flat) and flat.dtype in _EXPONENT_MASKS:
        bits = as_numpy(flat).view("uint32" if flat.dtype == torch.float32 else "uint16")
        mask = _EXPONENT_MASKS[flat.dtype]
        return int(_kernels().top_exponent(bits, mask)) == mask
    return not bool(torch.isfinite(flat).all())


def finish_fold(total: torch.Tensor, top: int, store: bool, count: int) -> int:
    """What :meth:`~gradpress.core.fused.FusedPaths.accumulate_into` returns after a fused decoder ran
    with ``fold_mode(store, count)`` and returned ``top`` (the largest exponent field it stored when
    finishing): how many results are NaN/Inf. A single packet (``store`` and ``count``) was only
    stored: divided here."""
    if store:
        return divide_counting_nonfinite(total, count) if count else 0
    return count_nonfinite(total) if count and top == _EXPONENT_MASKS[torch.float32] else 0


def divide(t: torch.Tensor, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t / count``, correctly rounded on every device (into ``out``, which may be ``t``): the same bits
    on a GPU as on the CPU. CUDA divides by a Python number as a product with its reciprocal, which is
    off by one unit in the last place now and then; by a 0-dim tensor on the device it divides. A
    power-of-two ``count``: the product is exact, and a number is passed as it is."""
    divisor: float | torch.Tensor = count
    if t.is_cuda and count & (count - 1):
        divisor = _device_number(float(count), t.device)
    return torch.div(t, divisor, out=out)


_DEVICE_NUMBERS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _device_number(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim float32 tensor holding ``value`` on ``device``, made once (a fill kernel, no copy)."""
    key = (value, device)
    number = _DEVICE_NUMBERS.get(key)
    if number is None:
        number = _DEVICE_NUMBERS[key] = torch.full((), value, dtype=torch.float32, device=device)
    return number


def divide_counting_nonfinite(flat: torch.Tensor, count: int, out: torch.Tensor | None = None) -> int:
    """``flat /= count`` in place (the same bits as ``flat.div_(count)``) for a 1-D contiguous float
    tensor, or into ``out`` (a tensor like it), returning how many results are NaN/Inf: one pass for the
    mean and the check (a second one counts, only when there is something to count). A power-of-two
    ``count`` multiplies by its reciprocal instead: both are the correctly rounded x/count, and a
    product is cheaper."""
    if out is not None and out.data_ptr() == flat.data_ptr():
        out = None
    if use_numba(flat) and flat.dtype == torch.float32:
        exact = count & (count - 1) == 0
        top = _kernels().divide_top_exponent(as_numpy(flat), None if out is None else as_numpy(out),
                                             np.float32(count), np.float32(1 / count), exact)
    else:
        divide(flat, count, out=flat if out is None else out)
        top = None
    result = flat if out is None else out
    if top is None:
        return count_nonfinite(result)
    return count_nonfinite(result) if top == _EXPONENT_MASKS[torch.float32] else 0
