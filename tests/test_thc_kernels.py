"""THC's fused CPU kernels: the numba path gives the torch path's bits, for every step of
both methods, on every shape of input and table the kernels treat apart."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gradpress
from gradpress.compressors.thc import _affine
from gradpress.core.rng import Context, mix32_torch, seed32
from gradpress.kernels import simd as _simd
from gradpress.kernels import simd_lanes
from gradpress.kernels.bits import unpack_bits
from gradpress.kernels.jit import numba_disabled
from kernels import path
from numerics import rht_residual_error

# the vector kernel (blocks ≥ 16 values: one row, rows of fewer than 16 vectors, 2-256 rows), the scalar
# kernel (blocks < 16), tails of 1-15 values, blocks off a multiple of 16 or 32, tables of at most 32 grid
# points (permutations) and more (gathers), 1 to 8 bits (the packing's fast and general paths)
SPECS = ["thc", "thc:partition=1000", "thc:partition=5", "thc:bits=1,granularity=1", "thc:bits=2,granularity=8",
         "thc:bits=3,granularity=12,p=1/512,partition=64", "thc:bits=5,granularity=31",
         "thc:bits=6,granularity=70,symmetric=false", "thc:bits=8,granularity=300,symmetric=false",
         "thc_uniform", "thc_uniform:bits=1", "thc_uniform:bits=3", "thc_uniform:bits=8"]
SIZES = [1, 5, 17, 300, 4096 + 3, 70_000]


def steps(c, x: torch.Tensor, ctx: Context, count: int = 3) -> dict[str, torch.Tensor]:
    packet = c.compress(x, ctx)
    summands = c.summands(packet)[0]
    out = {"codes": packet["codes"], "decompress": c.decompress(packet), "summands": summands}
    for dtype in (torch.uint8, torch.int32, torch.int64):
        total = (summands.to(torch.int64) * count).to(dtype) if dtype != torch.uint8 else summands
        out[f"decode_sum {dtype}"] = c.decode_sum(packet, [total], count if dtype != torch.uint8 else 1)
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_kernels_give_the_torch_paths_bits(spec):
    """Compression (codes), decompression, the aggregator's lookup and the decoding of sums of every
    integer dtype: numba == torch, bit for bit."""
    c = gradpress.make(spec)
    for numel in SIZES:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
        ctx = Context(seed=1, step=2, key="k", rank=1)
        fast = steps(c, x, ctx)
        with numba_disabled():
            reference = steps(c, x, ctx)
        for name, value in fast.items():
            assert value.dtype == reference[name].dtype and torch.equal(value, reference[name]), (spec, numel, name)


def test_uniform_codes_follow_the_documented_draw():
    """Uniform THC's code of x_i: z = min(⌊a⌋, top − 1) for a = clamp((x_i·pre − m·pre)·top/((M − m)·pre),
    0, top), plus one where (mix32(i, seed) >> 8) < (a − z)·2^24 in float32."""
    c = gradpress.make("thc_uniform:bits=3")
    x = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    ctx = Context(seed=4, key="w")
    packet = c.compress(x, ctx)
    lo, hi = float(x.min()), float(x.max())
    pre, origin, scale = (float(v) for v in _affine(lo, hi - lo, 7))
    a = (x * pre).sub_(origin).mul_(scale).clamp_(0, 7)
    z = a.long().clamp(max=6)
    r = (mix32_torch(torch.arange(1001), seed32(ctx.private_seed("thc_uniform"))) >> 8).float()
    expected = z + (r < (a - z.float()) * 2.0**24).long()
    assert torch.equal(unpack_bits(packet["codes"], 3, 1001).long(), expected)


@pytest.mark.parametrize("spec", ["thc", "thc:partition=100", "thc:partition=4", "thc_uniform"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("numba", [True, False], ids=["numba", "torch"])
def test_nonfinite_input_with_finite_prepared_values_raises(spec, bad, numba):
    """checks_finite: the kernels see NaN/Inf in the values they quantize (THC: a NaN/Inf makes every
    coordinate of its block NaN/Inf) even when the preliminary values were finite, and a NaN's grid index
    stays in the tables on every CPU (blocks of 16 and more, and the scalar blocks of 4)."""
    c = gradpress.make(spec)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    prepared = c.prepare(x, Context(), 1).values
    x[777] = bad
    with path(not numba), pytest.raises(gradpress.NonFiniteError, match="holds 1 NaN/Inf"):
        c.compress(x, Context(), prepared=prepared)


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "torch"])
def test_a_norm_too_small_for_the_values_overflows_clearly(numba):
    """A finite input whose transform overflows float32 under a too-small preliminary norm (given, not
    its own) raises an OverflowError on both paths, instead of quantizing Inf."""
    c = gradpress.make("thc")
    x = torch.full((4096,), 3e38)
    with path(not numba), pytest.raises(OverflowError, match="overflow"):
        c.compress(x, Context(), prepared=torch.tensor([1.0], dtype=torch.float64))


def test_checks_finite_skips_the_separate_pass(monkeypatch):
    """Both methods find NaN/Inf in their own passes (their preliminary values, their kernels): no
    check_finite pass over a finite input."""
    calls = []
    monkeypatch.setattr(gradpress.core.compressor, "check_finite", lambda flat, where: calls.append(where))
    for spec in ("thc", "thc_uniform"):
        assert gradpress.make(spec).checks_finite
        gradpress.make(spec).compress(torch.randn(5000))
    assert calls == []


def test_permute32_without_avx512_gathers_the_same_lanes(monkeypatch):
    """V.permute32's fallback (no AVX-512: a gather from a copy of the table on the stack)."""
    from numba import njit

    monkeypatch.setattr(simd_lanes, "AVX512", False)  # (permute32 reads it there)

    @njit
    def lookup(table, index, out):  # compiled now, with the fallback (not cached)
        low, high = _simd.load(table, 0), _simd.load(table, 16)
        for k in range(0, index.size, 16):
            _simd.store(out, k, _simd.permute32(low, high, _simd.load(index, k)))

    table = np.arange(32, dtype=np.float32) * 1.5 - 7
    index = np.random.default_rng(0).integers(0, 32, 64).astype(np.int32)
    out = np.empty(64, dtype=np.float32)
    lookup(table, index, out)
    assert np.array_equal(out, table[index])



# -- the residual memory's update (THC's error feedback without a decompressed temporary) ---------
THC_SPECS = [spec for spec in SPECS if not spec.startswith("thc_uniform")]


def fused_residual_bound(c, x: torch.Tensor, decoded: torch.Tensor) -> float:
    """:func:`numerics.rht_residual_error` for THC ``c``'s largest padded block."""
    return rht_residual_error(1 << max(0, min(x.numel(), c.partition) - 1).bit_length(), x, decoded)


@pytest.mark.parametrize("spec", THC_SPECS)
def test_residual_is_x_minus_the_decompression_bit_for_bit(spec):
    """THC.residual (the decoding's output pass subtracting from x, in x's storage when owned) gives
    x − decompress(packet)'s bits, on both paths."""
    c = gradpress.make(spec)
    for numel in SIZES:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
        ctx = Context(seed=1, step=2, key="k", rank=1)
        packet = c.compress(x, ctx)
        expected = x - c.decompress(packet)
        assert torch.equal(c.residual(x, packet), expected), (spec, numel)
        owned = x.clone()
        result = c.residual(owned, packet, owned=True)
        assert result.data_ptr() == owned.data_ptr() and torch.equal(result, expected), (spec, numel)
        with numba_disabled():
            assert torch.equal(c.residual(x, packet), expected), (spec, numel)


@pytest.mark.parametrize("spec", THC_SPECS)
def test_residual_formed_in_compression_is_within_the_transforms_rounding(spec):
    """compress(x, residual=target) sends the codes compress(x) sends and leaves x − decompress(packet) in
    ``target`` (x itself, or another tensor), which residual() returns: equal up to the rounding of
    2·log2(d) butterfly stages (:func:`fused_residual_bound`); the torch path ignores the target."""
    c = gradpress.make(spec)
    assert c.fuses_residual
    for numel in SIZES + [3 * 2**20 + 12_345]:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
        ctx = Context(seed=1, step=2, key="k", rank=1)
        shared = c.prepare(x, ctx, 1).values
        packet = c.compress(x, ctx, prepared=shared)
        decoded = c.decompress(packet)
        expected = (x.double() - decoded.double())
        bound = fused_residual_bound(c, x, decoded)
        for in_place in (True, False):
            given = x.clone()
            target = given if in_place else torch.empty(numel)
            fused = c.compress(given, ctx, prepared=shared, residual=target)
            assert torch.equal(fused["codes"], packet["codes"]), (spec, numel)
            result = c.residual(given, fused, owned=in_place)
            assert result.data_ptr() == target.data_ptr(), (spec, numel)
            assert float((result.double() - expected).norm()) <= bound, (spec, numel, in_place)
        with numba_disabled():
            given = x.clone()
            fused = c.compress(given, ctx, prepared=shared, residual=given)
            assert torch.equal(given, x) and "residual" not in fused.meta
            assert torch.equal(c.residual(given, fused), x - decoded)


def test_residual_target_is_left_alone_where_compression_cannot_form_it():
    """An fp16 input (its decompression is rounded to fp16) or a target of another size: not fused, the
    target untouched, residual() decoding as before."""
    c = gradpress.make("thc")
    x = torch.randn(5000, generator=torch.Generator().manual_seed(9))
    for given, target in ((x.half(), x.clone()), (x, torch.zeros(4999))):
        before = target.clone()
        packet = c.compress(given, Context(), residual=target)
        assert "residual" not in packet.meta and torch.equal(target, before)
        assert torch.equal(c.residual(given, packet), given.float() - c.decompress(packet).float())


def test_the_runtime_forms_thc_residuals_during_compression(monkeypatch):
    """With the residual memory, the steps after the first compress into the compensated tensor's storage
    (the first compensates to the gradient itself, which is not the memory's to overwrite)."""
    from gradpress.compressors import thc

    sim = gradpress.Simulator("thc", 2, seed=3)  # (its warm-up's own calls are not counted)
    calls = []
    kernel = thc._thc_compress

    def counted(*args):
        fused = args[20]  # (the kernel's run-time flag: the residual formed as it compresses)
        calls.extend([1] if fused else [])
        return kernel(*args)

    monkeypatch.setattr(thc, "_thc_compress", counted)
    for step in range(3):
        sim.step([torch.randn(3000, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)])
    assert len(calls) == 2 * 2
