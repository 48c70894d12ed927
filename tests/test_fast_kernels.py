"""The CPU kernels (random-k's hashed subset, the fused casts, top-k's sampled threshold, CLT-k's
chunk maxima, the sign packers, threshold/DGC gathering, TernGrad's σ) against their torch twins, bit for
bit, at sizes that cross their blocks; and the properties the faster algorithms keep (uniform subsets,
ranks agreeing, NaN/Inf raising, indices out of range refused). Timings live in ``gradpress bench``."""
from __future__ import annotations

import collections
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import gradpress
from gradpress.compressors import selection
from gradpress.compressors.cltk import chunk_top
from gradpress.compressors.dither import standard_deviation
from gradpress.compressors.sparsify import (
    SAMPLE,
    kth_largest,
    random_subset,
    sample_stride,
    scatter,
    topk_indices,
)
from gradpress.compressors.threshold import _strata_positions, packet_above, stratified_threshold
from gradpress.core.compressor import NonFiniteError
from gradpress.core.rng import Context
from gradpress.kernels.jit import (
    abs_above64,
    abs_not_below64,
    compress_above16,
    finite,
    jit,
    numba_disabled,
    select_bits64,
    sign_bits64,
)
from kernels import PATHS, accumulate_both_paths, bits, both_paths, path


# -- random-k: the hashed subset -------------------------------------------------------------------------
@pytest.mark.parametrize("n, k", [(1, 1), (3, 1), (10, 3), (10, 7), (100, 50), (100, 51), (1000, 999),
                                  (12345, 6000), (2**20, 10486), (2**22 + 3, 41944)])
def test_random_subset_numba_equals_torch(n, k):
    fast = random_subset(n, k, 987654321012)
    with numba_disabled():
        slow = random_subset(n, k, 987654321012)
    assert torch.equal(fast, slow)
    assert fast.numel() == k and fast.dtype == torch.int64
    assert bool((fast[1:] > fast[:-1]).all()) and 0 <= int(fast[0]) and int(fast[-1]) < n


@pytest.mark.parametrize("n, k", [(6, 2), (6, 4), (5, 1)])
def test_random_subset_is_uniform_over_k_subsets(n, k):
    """Sampling without replacement: every k-subset equally likely (so each position with probability k/n)."""
    counts = collections.Counter(tuple(random_subset(n, k, seed).tolist()) for seed in range(12000))
    assert len(counts) == math.comb(n, k)
    assert chisquare(list(counts.values())).pvalue > 1e-4


def test_randomk_indices_are_shared_and_values_gathered():
    """Every rank draws the same indices (the shared stream), and the packet holds x at them."""
    c = gradpress.make("randomk:ratio=0.05,scale=true")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.randn(100_003).to(dtype)
        packets = [c.compress(x + r, Context(seed=4, step=2, key="w", rank=r)) for r in range(3)]
        indices = [p.meta["indices"] for p in packets]
        assert all(torch.equal(i, indices[0]) for i in indices)
        assert torch.equal(packets[0]["values"], x[indices[0]])
        both_paths("randomk:ratio=0.05,scale=true", x, Context(seed=4, step=2, key="w"))


def test_randomk_raises_on_non_finite_anywhere():
    c = gradpress.make("randomk:ratio=0.01")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for bad in (float("nan"), float("inf")):
            x = torch.randn(70_001).to(dtype)
            x[54_321] = bad
            with pytest.raises(NonFiniteError, match="1 NaN/Inf"):
                c.compress(x)
            assert not finite(x)


# -- fp16 / bf16: cast and check in one pass ---------------------------------------------------------------
def _awkward_floats(n: int = 1 << 18) -> torch.Tensor:
    """Random finite bit patterns (every exponent), values at the 16-bit formats' rounding ties and edges."""
    g = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).clone()
    x[~torch.isfinite(x)] = 1.0
    edges = torch.tensor([0.0, -0.0, 65504.0, 65519.99, -65519.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 5.960464477539063e-08,
                          1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 3.389e38, -3.3895e38, 1e-40, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8])
    x[: edges.numel()] = edges
    return x


@pytest.mark.parametrize("spec, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_cast_kernels_round_as_torch(spec, dtype):
    x = _awkward_floats()
    limit = torch.finfo(dtype).max
    x = x[x.to(dtype).float().abs() <= limit]  # values that round within the format
    c = gradpress.make(spec)
    packet = c.compress(x)
    assert torch.equal(packet["values"].view(torch.int16), x.to(dtype).view(torch.int16))
    with numba_disabled():
        assert torch.equal(c.compress(x)["values"].view(torch.int16), packet["values"].view(torch.int16))
    assert torch.equal(c.decompress(packet), x.to(dtype).float())
    y = x[:1000].reshape(10, 100)  # the shortcut keeps shapes
    assert c.decompress(c.compress(y)).shape == (10, 100)


@pytest.mark.parametrize("torch_only", PATHS)
@pytest.mark.parametrize("spec, big", [("fp16", 65520.0), ("bf16", 3.4e38)])
@pytest.mark.parametrize("where", [17, 4095, 4321, 8999])  # the kernel's first block, its end, the tail's
def test_casts_raise_on_overflow_and_non_finite(torch_only, spec, big, where):
    with path(torch_only):
        c = gradpress.make(spec)
        x = torch.randn(9000)
        x[where] = big
        with pytest.raises(OverflowError, match="1 value"):
            c.compress(x)
        for bad in (float("nan"), float("-inf")):
            x[where] = bad
            with pytest.raises(NonFiniteError, match="1 NaN/Inf"):
                c.compress(x)


# -- top-k ------------------------------------------------------------------------------------------------
def _exact_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest |x|, ties to the lower index, ascending: by torch's sort."""
    expected = torch.topk(x.abs(), k).values.min()
    above = (x.abs() > expected).nonzero().squeeze(1)
    ties = (x.abs() == expected).nonzero().squeeze(1)[: k - above.numel()]
    return torch.cat([above, ties]).sort().values


@pytest.mark.parametrize("n, k", [(10, 1), (10, 10), (4095, 41), (4096, 41), (65536, 1), (65536, 655),
                                  (300_001, 3000), (300_001, 300_001), (2**20, 10486), (2**20, 2**19)])
def test_sampled_topk_is_the_exact_topk(n, k):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, generator=g)
    x[::97] = 0.5  # many ties
    x[::13] = 0.0
    got = topk_indices(x, k)
    assert torch.equal(got, _exact_topk(x, k))
    with numba_disabled():
        assert torch.equal(topk_indices(x, k), got)
    packet = gradpress.make(f"topk:ratio={k / n}").compress(x)  # the values sent: those at the indices
    assert torch.equal(packet["indices"].long(), got) and torch.equal(packet["values"], x[got])


@pytest.mark.parametrize("shape, zero_columns", [
    ((4096, 784), slice(0, 784, 28)), ((4096, 784), slice(0, 300)), ((1000, 256), slice(0, 256, 2))])
def test_topk_of_a_weight_gradient_with_zero_columns_is_exact(shape, zero_columns):
    """A weight gradient whose columns for dark input pixels are zero: a sample at a stride sharing a
    factor with the row length would see only such columns (threshold 0); the selection stays exact."""
    g = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=g)
    x[:, zero_columns] = 0.0
    for ratio in (0.001, 0.01, 0.3):
        flat = x.reshape(-1)
        k = max(1, math.ceil(ratio * flat.numel()))
        assert torch.equal(topk_indices(flat, k), _exact_topk(flat, k))


def test_topk_of_a_mostly_zero_vector_takes_every_value_as_a_candidate():
    x = torch.zeros(200_000)
    x[[5, 70_000, 199_999]] = torch.tensor([1.0, -3.0, 2.0])
    assert topk_indices(x, 2).tolist() == [70_000, 199_999]
    assert topk_indices(x, 5).tolist() == [0, 1, 5, 70_000, 199_999]  # ties at 0: the lowest positions


@pytest.mark.parametrize("mode", ["plain", "fused", "zeroed"])
@pytest.mark.parametrize("n", [15, 16, 1000, 4099])
def test_candidates_are_every_value_at_or_above_the_threshold_and_overflow_says_so(mode, n):
    """The candidate pass (16 at a time, a scalar tail): every value with not |v| < t (NaN included), in
    order, with its position; −1 when more than fit, the fused sum formed in full all the same (with the
    candidates written as +0 where they are to be zeroed: top-k's residual)."""
    g = torch.Generator().manual_seed(n)
    m, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m[n // 2] = float("nan")
    m[n // 3], grad[n // 3] = 1.0, 0.0  # a value at the threshold: a candidate
    x = (m + grad) if mode != "plain" else m.clone()
    expected = (~(x.abs() < 1.0)).nonzero().squeeze(1)
    count = expected.numel()
    formed = x.clone()
    if mode == "zeroed":
        formed[expected] = 0.0
    for capacity in (count, count - 1):
        out = torch.empty(n) if mode != "plain" else x.clone()
        kept, positions = np.empty(capacity + 16, np.float32), np.empty(capacity + 16, np.int32)
        addends = (m.numpy(), grad.numpy()) if mode != "plain" else None
        zeroed = mode == "zeroed"
        got = selection._collect_at_least(out.numpy(), addends, np.float32(1.0), kept, positions, zeroed)
        assert torch.equal(bits(out), bits(formed))  # the sum, bit for bit (NaN where m is), or +0
        if capacity < count:
            assert got == -1
        else:
            assert got == count and positions[:count].tolist() == expected.tolist()
            assert torch.equal(bits(torch.from_numpy(kept[:count])), bits(x[expected]))


def test_sample_strides_are_primes_at_or_above_n_over_the_sample_size():
    for n in (4096, 65536, 3_211_264, 10**8, 2**31 - 64):
        stride = sample_stride(n)
        assert stride >= n // SAMPLE and all(stride % d for d in range(2, math.isqrt(stride) + 1))
    assert sample_stride(3_211_264) == 197  # not 196 = 784 / 4


@pytest.mark.parametrize("size", [1, 2, 100, 2048, 2049, 50_000])
def test_kth_largest_is_the_kth_of_the_sorted_values(size):
    """The radix select's answer for every kind of input: distinct, tied in its first 16 bits, all equal,
    zeros, +Inf, subnormals."""
    g = np.random.default_rng(size)
    cases = [g.random(size, dtype=np.float32) * 10,
             # one leading 16-bit digit for all of them
             (1.0 + g.integers(0, 64, size).astype(np.float32) * 2.0**-20).astype(np.float32),
             np.full(size, 3.5, np.float32),
             np.where(g.random(size) < 0.5, 0.0, g.random(size)).astype(np.float32),
             np.where(g.random(size) < 0.01, np.inf, g.random(size)).astype(np.float32),
             (g.random(size) * 1e-40).astype(np.float32)]
    for values in cases:
        ordered = np.sort(values)[::-1]
        for k in sorted({1, 2, size // 3 + 1, size}):
            if k <= size:
                assert _kth(values.copy(), k) == ordered[k - 1]


@jit
def _kth(values, k):  # pragma: no cover - compiled
    return kth_largest(values, k)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.5", "threshold:v=1.5", "dgc:ratio=0.01"])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_sparse_aggregate_divides_only_the_positions_sent(spec, workers):
    """Sparse methods' aggregate (zeros, the values added where sent, each such sum divided once, a chunk of
    the output at a time) gives the bits of the dense mean, into an ``out`` that held anything, whatever the
    order of the positions sent; positions out of range are refused."""
    c = gradpress.make(spec)
    g = torch.Generator().manual_seed(workers)
    xs = [torch.randn(50_000, generator=g) for _ in range(workers)]
    xs[0][:1000] = xs[-1][:1000]  # the same positions sent by several workers
    packets = [c.compress(x, Context(seed=1, step=0, key="s", rank=r)) for r, x in enumerate(xs)]
    total = torch.zeros(50_000)
    for p in packets:
        total += c._decompress(p).float()
    expected = total / workers
    got = c.aggregate(packets, out=torch.full((50_000,), -7.0))
    assert torch.equal(bits(got), bits(expected))
    for p in packets:  # positions sent in another order than ascending (the kernel's): sorted first
        p.tensors["indices"], p.tensors["values"] = p["indices"].flip(0), p["values"].flip(0)
    assert torch.equal(bits(c.aggregate(packets, out=torch.full((50_000,), -7.0))), bits(expected))
    packets[-1].tensors["indices"] = packets[-1]["indices"].clone()
    packets[-1]["indices"][-1] = 50_000
    with pytest.raises(IndexError):
        c.aggregate(packets)


# -- scatter (every sparse decode) ------------------------------------------------------------------------
def test_scatter_matches_torch_and_refuses_indices_out_of_range():
    values = torch.randn(5)
    for indices in (torch.tensor([7, 0, 3, 9, 4]), torch.tensor([7, 0, 3, 9, 4], dtype=torch.int32)):
        expected = torch.zeros(10)
        expected[indices.long()] = values
        assert torch.equal(scatter(values, indices, 10), expected)
    for bad in (torch.tensor([1, 10]), torch.tensor([3, 2**40]), torch.tensor([-11, 2])):
        with pytest.raises(IndexError):
            scatter(torch.ones(2), bad, 10)
    assert torch.equal(scatter(torch.ones(2), torch.tensor([-1, 2]), 4), torch.tensor([0.0, 0, 1, 1]))  # torch's rule


# -- CLT-k ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk, per_chunk", [(4, 1), (2, 1), (3, 1), (7, 1), (100, 1), (16, 3), (10, 2)])
@pytest.mark.parametrize("n", [1, 5, 4097, 100_003])
def test_chunk_top_numba_equals_torch(chunk, per_chunk, n):
    g = torch.Generator().manual_seed(n + chunk)
    x = torch.randn(n, generator=g)
    x[::5] = 0.25  # ties within chunks: the lower index wins
    x[1::7] = -0.25
    with numba_disabled():
        slow = chunk_top(x, chunk, per_chunk)
    assert torch.equal(chunk_top(x, chunk, per_chunk), slow)
    assert torch.equal(chunk_top(x, chunk, per_chunk, torch.int32), slow.int())


def test_cltk_refuses_leader_indices_out_of_range():
    c = gradpress.make("cltk")
    x = torch.randn(400)
    good = c.prepare(x, Context(), 1).values
    for bad in (400, 10**6, -401):
        indices = good.clone()
        indices[17] = bad
        with pytest.raises(IndexError):
            c.compress(x, Context(), prepared=indices)
    both_paths("cltk", torch.randn(100_001), Context(step=3))
    both_paths("cltk:chunk=100", torch.randn(100_001), Context(step=3))


# -- signSGD, EF-signSGD, SIGNUM --------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["signsgd", "efsignsgd", "signum"])
@pytest.mark.parametrize("n", [1, 63, 64, 65, 4095, 4097, 100_003])
def test_sign_kernels_equal_torch_across_blocks(spec, n):
    for scale in (1.0, 1e-30, 1e30):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * scale
        x[::5] = 0.0
        x[1::7] = -0.0
        both_paths(spec, x, Context())
    both_paths(spec, torch.zeros(n), Context())


@pytest.mark.parametrize("spec", ["signsgd", "efsignsgd"])
def test_sign_methods_raise_on_non_finite_anywhere(spec):
    for position in (0, 4096, 99_999):
        x = torch.randn(100_000)
        x[position] = float("nan")
        with pytest.raises(NonFiniteError, match="1 NaN/Inf"):
            gradpress.make(spec).compress(x)


def test_signum_momentum_kernel_equals_torch_and_keeps_owned_tensors():
    g1, g2 = torch.randn(10_001), torch.randn(10_001)
    fast, slow = gradpress.make_feedback("signum:momentum=0.7"), gradpress.make_feedback("signum:momentum=0.7")
    c = gradpress.make("signum")
    for g in (g1, g2, g1):
        z = fast.compensate("w", g)
        with numba_disabled():
            w = slow.compensate("w", g)
        assert torch.equal(z, w)
        fast.update_from("w", z, c.compress(z), c, owned=True)
        slow.update("w", w, c.decompress(c.compress(w)))
        assert fast.memory("w") is z and torch.equal(fast.memory("w"), slow.memory("w"))
    g = torch.randn(10_001)
    z = fast.compensate("w", g)
    fast.update_from("w", z, c.compress(z), c, owned=False)  # not owned: a copy
    assert fast.memory("w") is not z and torch.equal(fast.memory("w"), z)


# -- threshold and DGC ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["threshold", "threshold:v=1", "threshold:v=0", "dgc", "dgc:ratio=0.01",
                                  "dgc:ratio=0.01,warmup_steps=8"])
@pytest.mark.parametrize("n", [1000, 4097, 100_003, 2**18])
def test_threshold_and_dgc_numba_equal_torch(spec, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[::11] = 0.0
    for step in (0, 3):
        both_paths(spec, x, Context(seed=1, step=step, key="k", rank=1))


def test_stratified_sample_positions():
    """One position per stratum of ⌊d/size⌋ values (the last one shorter), uniform within it; the numba
    kernel reads the same positions (its threshold equals torch's)."""
    positions = _strata_positions(1000, 7, 12345, torch.device("cpu"))
    assert positions.numel() == 143 and bool(((positions // 7) == torch.arange(143)).all()) and int(positions[-1]) < 1000
    counts = torch.bincount(torch.cat([_strata_positions(70, 7, seed, torch.device("cpu")) % 7 for seed in range(2000)]))
    assert chisquare(counts.tolist()).pvalue > 1e-4
    x = torch.randn(300_001)
    for fraction in (0.001, 0.3, 1.0):
        fast = stratified_threshold(x, 0.01, fraction, 99)[0]
        with numba_disabled():
            assert stratified_threshold(x, 0.01, fraction, 99)[0] == fast


def test_gathering_past_an_estimate_takes_a_second_pass():
    """DGC's buffers hold twice the expected count: more found than that gathers again, the same packet."""
    x = torch.randn(200_000)
    small = packet_above(x, 0.5, expected=10)
    whole = packet_above(x, 0.5)
    assert all(torch.equal(a, b) for a, b in zip(small.wire(), whole.wire(), strict=True))
    assert small["values"].numel() == int((x.abs() > 0.5).sum())
    x[123_456] = float("inf")
    with pytest.raises(NonFiniteError):
        packet_above(x, 0.5, expected=10)


# -- TernGrad's σ -----------------------------------------------------------------------------------------
def test_standard_deviation_is_path_independent_and_accurate():
    g = torch.Generator().manual_seed(5)
    for x in (torch.randn(1 << 20, generator=g), torch.randn(5000, generator=g) + 1000, torch.randn(999, generator=g) * 1e-30,
              torch.tensor([3e38, -3e38, 1.0]), torch.zeros(17), torch.tensor([2.5])):
        fast = standard_deviation(x)
        with numba_disabled():
            assert standard_deviation(x) == fast
        assert fast == pytest.approx(float(x.double().std(correction=0)), rel=1e-9, abs=1e-300)
    assert math.isnan(standard_deviation(torch.tensor([1.0, float("nan")])))


# -- the LLVM helpers ---------------------------------------------------------------------------------------
@jit
def _helpers(x, threshold, words, high, low, selected, values, indices):  # pragma: no cover - compiled
    count = 0
    for w in range(x.size // 64):
        words[0, w] = sign_bits64(x.view(np.uint32), w * 64)
        words[1, w] = abs_not_below64(x, w * 64, threshold)
        words[2, w] = abs_above64(x, w * 64, threshold)
        select_bits64(words[0, w], low, high, selected, w * 64)
        for q in range(4):
            count += compress_above16(x, w * 64 + 16 * q, threshold, values, indices, count)
    return count


def test_vector_helpers_equal_numpy():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)).numpy()
    x[::9] = 0.5
    x[1::9] = -0.5
    x[::31] = -0.0
    x[5] = np.nan
    words = np.zeros((3, 64), dtype=np.uint64)
    selected = np.empty(4096, dtype=np.float32)
    values, indices = np.empty(4096 + 16, dtype=np.float32), np.empty(4096 + 16, dtype=np.int32)
    count = _helpers(x, np.float32(0.5), words, np.float32(2.0), np.float32(-3.0), selected, values, indices)

    def unpack(row):
        return np.unpackbits(row.view(np.uint8), bitorder="little").astype(bool)

    with np.errstate(invalid="ignore"):
        assert np.array_equal(unpack(words[0]), ~(x < 0) | (x == 0))
        assert np.array_equal(unpack(words[1]), ~(np.abs(x) < 0.5))
        assert np.array_equal(unpack(words[2]), np.abs(x) > 0.5)
        assert np.array_equal(selected, np.where(unpack(words[0]), 2.0, -3.0).astype(np.float32))
        above = np.nonzero(np.abs(x) > 0.5)[0]
    assert count == above.size and np.array_equal(indices[:count], above) and np.array_equal(values[:count], x[above])


# -- the GRACE benchmark ----------------------------------------------------------------------------------
def test_bench_grace_without_grace_says_so(capsys, tmp_path):
    from gradpress.bench import grace

    assert grace.main(grace.argparse.Namespace(grace_path=None, size=1024, repeats=1, threads=1, methods=None,
                                               seed=0, json=None, clock="wall", glibc_defaults=True)) == 0
    assert "skipped: no GRACE source given" in capsys.readouterr().out
    with pytest.raises(grace.GraceUnavailable, match="no grace_dl"):
        grace.load_grace(str(tmp_path), grace.PAIRS)


def test_bench_grace_runs_against_a_stand_in(tmp_path, capsys):
    """The benchmark's own code (imports, stubs, timing, table) on a stand-in package with GRACE's layout and
    interface (written here: no GRACE code), whose compressors need a stubbed module to import."""
    from gradpress.bench import grace

    package = tmp_path / "grace_dl" / "dist" / "compressor"
    package.mkdir(parents=True)
    (tmp_path / "grace_dl" / "__init__.py").write_text("")
    (tmp_path / "grace_dl" / "dist" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "fp16.py").write_text(
        "import horovod  # noqa: F401  (stubbed by the benchmark)\nimport torch\n\n\n"
        "class FP16Compressor:\n"
        "    def compress(self, tensor, name):\n        return [tensor.half()], tensor.dtype\n\n"
        "    def decompress(self, tensors, dtype):\n        return tensors[0].to(dtype)\n")
    args = grace.argparse.Namespace(grace_path=str(tmp_path), size=4096, repeats=3, threads=1, methods="fp16",
                                    seed=0, json=str(tmp_path / "out.json"), clock="cpu", glibc_defaults=True)
    assert grace.main(args) == 0
    out = capsys.readouterr().out
    assert "FP16Compressor()" in out and "speed-up" in out
    assert "horovod" not in __import__("sys").modules


# -- all-gather sums: each packet decoded and added into the float32 total in one pass --------------------
@pytest.mark.parametrize("spec", ["natural", "qsgd", "qsgd:levels=127,bucket=100", "terngrad", "terngrad:clip=2.5",
                                  "dither", "dither:partition=standard,levels=5,norm=1",
                                  "dither:natural_norm=true,bucket=100,norm=inf", "dither:levels=3,bucket=128",
                                  "onebit", "onebit:tau=0.5", "efsignsgd", "eightbit", "sketchml", "sketchml:bits=4",
                                  "sketchml:bits=1", "inceptionn"])
@pytest.mark.parametrize("n", [1, 7, 1000, 8193, 20_001])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_decode_add_equals_torch_and_the_dense_sum(spec, n, dtype):
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(s)).mul_(10.0**s).to(dtype) for s in range(3)]
    accumulate_both_paths(spec, xs)


@pytest.mark.parametrize("spec", ["natural", "qsgd", "terngrad", "dither:partition=natural", "eightbit",
                                  "onebit", "efsignsgd", "sketchml", "topk:ratio=0.5"])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [5, 8193])
def test_aggregate_folds_the_mean_into_the_decode(spec, workers, n):
    """aggregate (first packet stored, last added and divided in the decode's pass) gives the bits of
    zeroing a float32 total, adding every decode and dividing by the count; a sum that overflows float32
    where the decodes are finite falls back to the float64 mean (those bits too); a decode of −0.0 stored
    first reads +0.0, as 0.0 + (−0.0) does. Into an ``out`` that held anything, on both paths."""
    c = gradpress.make(spec)
    g = torch.Generator().manual_seed(n + workers)
    for scale in (1.0, 1.0e30):
        xs = [torch.rand(n, generator=g).mul_(2).sub_(1).mul_(scale) for _ in range(workers)]  # |x| ≤ scale
        for x in xs:
            x[::3] = -0.0
        if scale > 1:
            for x in xs:
                x[1:3] = 1.69e38  # every decode finite, their float32 sum not (natural: 2^127 each)
        packets = [c.compress(x, Context(seed=1, step=0, key="agg", rank=r)) for r, x in enumerate(xs)]
        decoded = [c._decompress(p).float().reshape(-1) for p in packets]
        total = torch.zeros(n)
        for d in decoded:
            total += d
        expected = total.div(workers)
        if not bool(expected.isfinite().all()):
            wide = torch.zeros(n, dtype=torch.float64)
            for d in decoded:
                wide += d.double()
            expected = wide.div_(workers).float()
        for torch_only in (False, True):
            out = torch.full((n,), -7.0)
            with path(torch_only):
                got = c.aggregate(packets, out=out)
                fresh = c.aggregate(packets)
            assert torch.equal(bits(got), bits(expected)), torch_only
            assert torch.equal(bits(fresh), bits(expected)), torch_only
