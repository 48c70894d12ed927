"""The randomized Hadamard transform (THC paper, Section 5.1)."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from gradpress.core.rng import Context, mix32_torch
from gradpress.kernels.hadamard import apply_rht, fwht, inverse_rht, rht, rht_layout
from gradpress.kernels.jit import numba_disabled
from numerics import gamma, log2ceil, unit_roundoff


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def transform_error(x: torch.Tensor, n: int) -> float:
    """Bound on each output's rounding error for an orthonormal Hadamard transform of size n of ``x``
    (rows, in x's dtype), and for the same transform as a matrix product: log2 n stages of sums and
    differences then a product with a rounded 1/√n, γ_{log2 n + 2}; n products with entries ±1/√n,
    γ_{n+2}; each times Σ|x| (Higham Eq. 3.5, any order of the additions)."""
    l1 = float(x.abs().sum(dim=-1).max())
    return (gamma(log2ceil(n) + 2, x.dtype) + gamma(n + 2, x.dtype)) * l1


def rht_norm_error(layout, dtype: torch.dtype) -> float:
    """Relative bound, in 2-norm, on a float RHT's rounding: each butterfly stage (a, b) → (a + b, a − b)
    rounds both with ‖δ‖₂ ≤ u·‖(a + b, a − b)‖₂ = √2·u·‖(a, b)‖₂, i.e. u of the (√2 times larger) vector,
    for log2 of the padded partition stages, then the scaling (a rounded 1/√n, and the product): 2u.
    The transform is orthonormal, so the inverse costs as much again. Independent of the size."""
    sizes = ([layout.partition] if layout.full_blocks else []) + ([layout.tail] if layout.tail else [])
    return (log2ceil(max(sizes, default=1)) + 2) * unit_roundoff(dtype)


def _explicit(layout, x: torch.Tensor) -> torch.Tensor:
    """The RHT as an explicit block-diagonal matrix: one normalized Hadamard block per partition."""
    sizes = [layout.partition] * layout.full_blocks + ([layout.tail] if layout.tail else [])
    out, start = [], 0
    for size in sizes:
        padded = 1 << max(0, size - 1).bit_length()
        h = torch.tensor(scipy.linalg.hadamard(padded), dtype=torch.float64) / padded**0.5
        block = torch.zeros(padded, dtype=torch.float64)
        block[:size] = x[start : start + size] * layout.signs[start : start + size].double()
        out.append(h @ block)
        start += size
    return torch.cat(out)


@pytest.mark.parametrize("log2", range(8))
def test_fwht_is_the_normalized_sylvester_hadamard_matrix(log2):
    n = 1 << log2
    x = torch.randn(3, n, dtype=torch.float64, generator=_generator(log2))
    h = torch.tensor(scipy.linalg.hadamard(n), dtype=torch.float64)
    torch.testing.assert_close(fwht(x), x @ h.T / n**0.5, rtol=0, atol=transform_error(x, n))


@pytest.mark.parametrize(
    ("numel", "partition"), [(1, 16), (5, 16), (16, 16), (64, 16), (55, 16), (40, 12), (3, 1)]
)
def test_rht_matches_the_explicit_block_diagonal_matrix(numel, partition):
    x = torch.randn(numel, dtype=torch.float64, generator=_generator(numel))
    y, layout = rht(x, _generator(7), partition)
    assert y.dtype == torch.float64 and y.numel() == layout.padded_numel
    padded = 1 << max(0, layout.partition - 1).bit_length()
    torch.testing.assert_close(y, _explicit(layout, x), rtol=0, atol=transform_error(x, padded))


def test_padding_and_partition_sizes():
    _, layout = rht(torch.ones(3 * 16 + 7), _generator(), 16)
    assert (layout.full_blocks, layout.tail, layout.padded_numel) == (3, 7, 3 * 16 + 8)
    _, layout = rht(torch.ones(25), _generator(), 12)  # partitions of 12 are padded to 16
    assert (layout.full_blocks, layout.tail, layout.padded_numel) == (2, 1, 16 + 16 + 1)
    _, layout = rht(torch.ones(1000), _generator())
    assert (layout.full_blocks, layout.tail, layout.padded_numel) == (0, 1000, 1024)


@pytest.mark.parametrize(("numel", "partition"), [(1000, 1 << 20), (4099, 1024), (300, 100), (2**12, 2**10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_orthonormal_norm_kept_and_inverse_recovers(numel, partition, dtype):
    x = (torch.randn(numel, generator=_generator(1)) * torch.logspace(-3, 2, numel)).to(dtype)
    y, layout = rht(x, _generator(2), partition)
    tol = rht_norm_error(layout, dtype)  # the norms themselves are taken in float64: no rounding of theirs
    norm = float(x.double().norm())
    assert float(y.double().norm()) == pytest.approx(norm, rel=tol, abs=0)
    back = inverse_rht(y, layout)
    assert back.shape == x.shape
    torch.testing.assert_close(back, x, rtol=0, atol=2 * tol * norm)  # |each element| ≤ the 2-norm


def test_low_precision_input_is_transformed_in_float32():
    x = torch.randn(100, generator=_generator(3)).to(torch.bfloat16)
    y, layout = rht(x, _generator(4))
    assert y.dtype == torch.float32
    atol = 2 * rht_norm_error(layout, torch.float32) * float(x.double().norm())
    torch.testing.assert_close(inverse_rht(y, layout), x.float(), rtol=0, atol=atol)


def test_a_spike_is_spread_evenly():
    """The point of the rotation: a one-hot vector becomes ±1/√d everywhere (Section 5.1)."""
    x = torch.zeros(256)
    x[17] = 1.0
    y, _ = rht(x, _generator(5))
    torch.testing.assert_close(y.abs(), torch.full((256,), 1 / 16.0))


def test_same_shared_seed_same_transform_on_every_rank():
    x = torch.randn(3000, generator=_generator(6))
    contexts = [Context(seed=9, step=4, key="w", rank=r) for r in range(3)]
    outputs = [rht(x, c.shared_generator(stream="rht"), 1024)[0] for c in contexts]
    assert all(torch.equal(outputs[0], o) for o in outputs[1:])
    other = rht(x, Context(seed=9, step=5, key="w").shared_generator(stream="rht"), 1024)[0]
    assert not torch.equal(outputs[0], other)


def test_a_rebuilt_layout_inverts_another_workers_transform():
    x = torch.randn(777, generator=_generator(8))
    y, _ = rht(x, Context(seed=1, step=2).shared_generator(stream="rht"), 256)
    layout = rht_layout(777, Context(seed=1, step=2, rank=5).shared_generator(stream="rht"), 256)
    atol = 2 * rht_norm_error(layout, torch.float32) * float(x.double().norm())
    torch.testing.assert_close(inverse_rht(y, layout), x, rtol=0, atol=atol)
    torch.testing.assert_close(apply_rht(x, layout), y, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("numel", "partition"),
    [(1, 16), (2, 16), (3, 16), (4, 4), (6, 4), (55, 16), (40, 12), (3, 1), (7, 2), (300, 100),
     (2**12, 2**12), (2**14 + 5, 2**14), (2**16, 2**16), (70_000, 2**17), (3 * 2**13 + 7, 2**13),
     (40_000, 5000), (2**15 + 2**10, 2**15), (2**18 + 33, 2**18), (2**16, 2**24)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_numba_kernel_gives_the_torch_paths_bits(numel, partition, dtype):
    """The CPU kernels and the torch path (one reshape per stage) agree bit for bit, forward and inverse.
    float32 (and bf16, transformed in float32) blocks of at least 16 values go through the vector kernel:
    one row (up to 2^12 values, and fewer than 16 vectors: 2^7), 2 to 8 rows (the stages across rows in
    one group of 1 to 3), 16, 32 and 64 rows (a group of 4 after 0, 1 or 2 stages), blocks starting off a
    multiple of 16 or 32 (their signs straddle two hashes), a last block of 1 to 8 values (the scalar
    kernel's), a partition larger than the vector; float64 goes through the scalar kernel (loading with
    signs and padding, stages chunk by chunk, then radix-8/4/2 passes across chunks, scaling fused)."""
    x = (torch.randn(numel, generator=_generator(numel)) * 100).to(dtype)
    layout = rht_layout(numel, _generator(3), partition)
    forward = apply_rht(x, layout)
    backward = inverse_rht(forward, layout)
    with numba_disabled():
        assert torch.equal(apply_rht(x, layout), forward)
        assert torch.equal(inverse_rht(forward, layout), backward)


def test_signs_come_from_the_counter_hash_of_one_shared_key():
    """D_ii = −1 exactly where bit i mod 32 of mix32(⌊i/32⌋, key) is set (32 signs per hash); the key is
    drawn from the shared generator (the same seed gives the same key on every rank) or given (modulo
    2^32)."""
    layout = rht_layout(5000, _generator(11), 1024)
    assert layout.key == rht_layout(5000, _generator(11), 1024).key
    assert layout.key != rht_layout(5000, _generator(12), 1024).key
    i = torch.arange(5000)
    bit = (mix32_torch(i // 32, layout.key) >> (i % 32)) & 1
    assert torch.equal(layout.signs, 1.0 - 2.0 * bit.float())
    given = rht_layout(5000, layout.key + (7 << 32), 1024)
    assert given.key == layout.key and torch.equal(given.signs, layout.signs)
    x = torch.randn(5000, generator=_generator(13))
    assert torch.equal(rht(x, layout.key, 1024)[0], apply_rht(x, layout))
    with pytest.raises(TypeError, match="Generator or an integer"):
        rht_layout(10, 1.5)  # type: ignore[arg-type]


def test_signs_are_balanced_and_global_rng_untouched():
    state = torch.get_rng_state()
    _, layout = rht(torch.ones(100_000), _generator(10))
    assert torch.equal(torch.get_rng_state(), state)
    assert set(layout.signs.unique().tolist()) == {-1.0, 1.0}
    assert abs(float(layout.signs.mean())) < 0.02  # 6+ standard deviations of a fair ±1 mean


def test_empty_vector():
    y, layout = rht(torch.zeros(0), _generator())
    assert y.numel() == 0 and inverse_rht(y, layout).numel() == 0


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: rht(torch.ones(2, 3), _generator()), "1-D"),
        (lambda: rht(torch.ones(4, dtype=torch.int32), _generator()), "floating"),
        (lambda: rht(torch.ones(4), _generator(), 0), "partition"),
        (lambda: fwht(torch.ones(6)), "power of two"),
        (lambda: inverse_rht(torch.ones(5), rht(torch.ones(5), _generator())[1]), "expects 8"),
        (lambda: apply_rht(torch.ones(6), rht(torch.ones(5), _generator())[1]), "layout is for 5"),
    ],
)
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_work_buffer_is_aligned_and_kept():
    """The vector kernel's work buffer: 64-byte aligned (no vector straddles two cache lines; 2 MiB where
    huge pages are granted), large enough for the rows (C + 16 apart) and one radix, this thread's own and
    kept between calls."""
    from gradpress.kernels.hadamard import work_buffer

    layout = rht_layout(3 * 2**20 + 5, 1, 2**20)
    work = work_buffer(layout)
    assert work.dtype == np.float32 and work.ctypes.data % 64 == 0
    assert work.size >= 256 * (4096 + 16) + 256
    assert work_buffer(rht_layout(1000, 2, 2**20)) is work  # a smaller one fits in it
