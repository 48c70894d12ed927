"""S2 Reducer: the sparse-sketch (Algorithm 1, Thm 1, Thm 2) and block-wise top-K."""
from __future__ import annotations

import functools
import math

import pytest
import torch

import gradpress
from gradpress.compressors.sketch import _buckets, _signs, element_indices
from gradpress.core.rng import Context
from gradpress.kernels.jit import numba_disabled
from kernels import bits, both_paths
from numerics import gamma


def sparse_rows(vocab: int = 12, dim: int = 6, touched=(1, 4, 5, 9), seed: int = 0) -> torch.Tensor:
    """An embedding-like gradient: a few non-zero rows of heavy-tailed values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.zeros(vocab, dim)
    x[list(touched)] = torch.randn(len(touched), dim, generator=g) * torch.logspace(-1, 1, dim)
    return x


def all_reduce(packets):
    """What the runtime does for a summable method: sum every wire tensor elementwise."""
    per_tensor = zip(*[list(p.wire()) for p in packets], strict=True)
    return packets[0].with_wire([functools.reduce(torch.add, ts) for ts in per_tensor])  # bool adds as or


def monte_carlo(estimate, samples: int):
    """Sample mean and standard error of ``estimate(step)`` over steps (fresh shared hashes each step)."""
    total = total_sq = None
    for step in range(samples):
        y = estimate(step).double()
        total = y if total is None else total + y
        total_sq = y * y if total_sq is None else total_sq + y * y
    mean = total / samples
    stderr = ((total_sq / samples - mean**2).clamp_min(0) / samples).sqrt()
    return mean, stderr


# -- Thm 1: unbiasedness ----------------------------------------------------------------------------
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_thm1_queried_gradient_is_unbiased(rows):
    """E[ĝ] = g (Thm 1), for one row as proved and for the median of r rows (see Sketch's docstring).
    λ = 0.5 puts about two values in every bucket, so collisions are the rule, not the exception."""
    c = gradpress.make(f"sketch:rows={rows},lam=0.5")
    assert c.unbiased
    x = sparse_rows()
    mean, stderr = monte_carlo(lambda s: c.decompress(c.compress(x, Context(seed=3, step=s))), 3000)
    assert (mean[x.eq(0).all(1)] == 0).all()  # rows outside the bitmap are exactly zero, always
    assert (stderr[x != 0] > 0).all()  # the estimates do vary: collisions happen
    assert ((mean - x.double()).abs() <= 5 * stderr + 1e-6).all(), ((mean - x.double()).abs() / stderr).max()


def test_the_lower_median_would_be_biased():
    """The Monte Carlo check can fail: for two rows, torch.median's lower median is min(ĝ_1, ĝ_2),
    biased downwards; the mean of the two middle estimates (what the sketch uses) is not."""
    c = gradpress.make("sketch:rows=2,lam=0.5")
    x = sparse_rows()

    def lower_median(step):
        packet = c.compress(x, Context(seed=3, step=step))
        indices = torch.arange(x.numel())
        table = packet["table"]
        rows = [_signs(indices, seed) * table[j, _buckets(indices, seed, table.shape[1])]
                for j, seed in enumerate(packet.meta["seeds"])]
        scale = 2.0 ** packet.meta["exponent"]  # the table holds the sums times 2^-s
        return torch.stack(rows).median(dim=0).values.view_as(x) * x.ne(0).any(1, keepdim=True) * scale

    mean, stderr = monte_carlo(lower_median, 1000)
    assert ((mean - x.double()) / stderr.clamp_min(1e-12)).min() < -10


def test_the_aggregate_of_several_workers_is_unbiased_for_their_sum():
    c = gradpress.make("sketch:rows=3,lam=0.5")
    xs = [sparse_rows(touched=t, seed=i) for i, t in enumerate([(1, 4), (4, 7, 8), (0, 11)])]

    def aggregate(step):
        packets = [c.compress(x, Context(seed=5, step=step, rank=r)) for r, x in enumerate(xs)]
        return c.decompress(all_reduce(packets))

    mean, stderr = monte_carlo(aggregate, 1500)
    assert ((mean - sum(xs).double()).abs() <= 5 * stderr + 1e-6).all()


def test_error_matches_the_count_sketch_variance():
    """One row: E‖ĝ − g‖² = (M − 1)‖g‖²/c for M decoded values in c buckets (each of the other
    values lands in a value's bucket with probability 1/c). Checks that the hashes spread evenly."""
    c = gradpress.make("sketch:lam=0.5")
    x = sparse_rows(vocab=40, dim=8, touched=range(0, 40, 3))  # 14 rows, M = 112 values
    width = c.width(x.numel(), 8)
    errors = [float((c.decompress(c.compress(x, Context(step=s))) - x).square().sum()) for s in range(600)]
    expected = (14 * 8 - 1) * float(x.square().sum()) / width
    assert abs(sum(errors) / len(errors) / expected - 1) < 0.1


# -- all-reduce -------------------------------------------------------------------------------------
def test_summed_wire_is_the_sketch_of_the_summed_gradient():
    """Section 3.1: A^T Σ g_k = Σ A^T g_k, and the summed (OR-ed) bitmap marks the union of blocks."""
    c = gradpress.make("sketch:rows=3,lam=0.5")
    xs = [sparse_rows(touched=t, seed=i) for i, t in enumerate([(1, 4), (4, 7, 8), (0, 11)])]
    ctx = [Context(seed=2, step=7, key="emb", rank=r) for r in range(3)]
    summed = all_reduce([c.compress(x, k) for x, k in zip(xs, ctx, strict=True)])
    direct = c.compress(sum(xs), ctx[0])
    assert summed["bitmap"].dtype == torch.bool
    assert torch.equal(summed["bitmap"], direct["bitmap"])
    # the same signed terms added in two orders (float32, tests/numerics.py): a bucket sums at most all N
    # of them, within γ_N·Σ|terms| ≤ γ_N·Σ_k ‖g_k‖₁ each way (times the table's power-of-two scale, exact);
    # the median over rows and the unscaling move an estimate by no more than its buckets moved
    terms = sum(int(x.count_nonzero()) for x in xs) + len(xs)
    atol = 2 * gamma(terms) * sum(float(x.abs().sum()) for x in xs)
    scale = math.ldexp(1.0, -direct.meta.get("exponent", 0))
    torch.testing.assert_close(summed["table"], direct["table"], rtol=0, atol=atol * scale)
    torch.testing.assert_close(c.decompress(summed), c.decompress(direct), rtol=0, atol=atol)


def test_width_is_agreed_whatever_each_worker_holds():
    c = gradpress.make("sketch:ratio=0.25,lam=0.5")
    few, many = sparse_rows(touched=(3,)), sparse_rows(touched=range(12))
    a, b = c.compress(few, Context(rank=0)), c.compress(many, Context(rank=1))
    assert a["table"].shape == b["table"].shape == (1, 9)  # K = 3 blocks of 6 values, λ = 0.5
    assert a.meta == b.meta
    assert a.nbytes == b.nbytes == 9 * 4 + 12  # the table and one bool per row


def test_table_starts_from_zero_every_step():
    c = gradpress.make("sketch")
    x, y = sparse_rows(seed=1), sparse_rows(touched=(0, 2), seed=2)
    c.compress(x, Context(step=0))
    fresh = gradpress.make("sketch").compress(y, Context(step=1))
    assert torch.equal(c.compress(y, Context(step=1))["table"], fresh["table"])


# -- layout -----------------------------------------------------------------------------------------
def test_bitmap_marks_the_non_zero_rows_of_an_embedding_gradient():
    c = gradpress.make("sketch:lam=8")
    x = sparse_rows(vocab=30, dim=4, touched=(2, 17, 29))
    packet = c.compress(x, Context(step=1))
    assert packet["bitmap"].shape == (30,) and packet["bitmap"].nonzero().squeeze(1).tolist() == [2, 17, 29]
    y = c.decompress(packet)
    assert (y[x.eq(0).all(1)] == 0).all()
    # the same layout from a flat tensor with the row length as the block size
    flat = gradpress.make("sketch:lam=8,block=4")
    packet_flat = flat.compress(x.reshape(-1), Context(step=1))
    assert torch.equal(packet_flat["bitmap"], packet["bitmap"])
    assert torch.equal(flat.decompress(packet_flat), y.reshape(-1))


def test_a_last_shorter_block_and_one_dimensional_tensors():
    x = torch.zeros(23)
    x[[0, 21, 22]] = torch.tensor([1.0, -2.0, 3.0])
    packet = gradpress.make("sketch:block=5,lam=8").compress(x)
    assert packet["bitmap"].tolist() == [True, False, False, False, True]
    packet = gradpress.make("sketch").compress(x)  # 1-D, block=0: one block per value
    assert packet["bitmap"].nonzero().squeeze(1).tolist() == [0, 21, 22]


def test_ratio_below_one_keeps_the_largest_blocks():
    c = gradpress.make("sketch:ratio=0.25,lam=0.5")
    assert not c.unbiased and c.default_feedback == "residual"
    x = sparse_rows(touched=range(12))
    packet = c.compress(x)
    norms = x.square().sum(1)
    assert packet["bitmap"].nonzero().squeeze(1).tolist() == sorted(norms.topk(3).indices.tolist())
    assert (c.decompress(packet)[~packet["bitmap"]] == 0).all()


@pytest.mark.parametrize("spec", ["sketch:rows=3", "sketch:rows=2,ratio=0.5", "sketch:lam=4,block=5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_numba_and_torch_paths_give_the_same_bits(spec, dtype):
    c = gradpress.make(spec)
    x = sparse_rows(vocab=300, dim=10, touched=range(0, 300, 7)).to(dtype)
    both_paths(c, x, Context(seed=4, step=1, key="e", rank=2))


# -- Thm 2: block-wise top-K, alone and sketched ------------------------------------------------------
def test_sketch_of_block_top_k_is_delta_approximate_only_above_lambda_one():
    """Thm 2's proof takes E‖U(y)‖² = ‖y‖², but the sketch adds ≈ (M − 1)/c·‖y‖² of noise, so
    E‖x − U(sparse(x))‖² ≈ ‖x − y‖² + ‖y‖²/λ: below ‖x‖² (δ-approximate) only for λ > 1 with one row."""
    x = torch.randn(200, 16, generator=torch.Generator().manual_seed(0))

    def one_shot(spec):
        c = gradpress.make(spec)
        errors = [float((c.decompress(c.compress(x, Context(step=s))) - x).square().sum()) for s in range(40)]
        return sum(errors) / len(errors) / float(x.square().sum())

    assert one_shot("sketch:ratio=0.25,lam=0.5") > 1.2
    assert one_shot("sketch:ratio=0.25,lam=8") < 0.75


def test_error_feedback_keeps_the_residual_bounded_for_lambda_above_one():
    c = gradpress.make("sketch:ratio=0.25,lam=4")
    feedback = gradpress.make_feedback(c.default_feedback)
    g = torch.randn(100, 8, generator=torch.Generator().manual_seed(1))
    sent = torch.zeros_like(g)
    for step in range(150):
        x = feedback.compensate("w", g)
        y = c.decompress(c.compress(x, Context(step=step)))
        feedback.update("w", x, y)
        sent += y
    assert float(feedback.memory("w").norm()) < 5 * float(g.norm())
    assert float((sent / 150 - g).norm()) < 0.05 * float(g.norm())  # = ‖m_T‖/T: the bias is paid back


def test_blocktopk_sends_the_k_largest_blocks():
    c = gradpress.make("blocktopk:ratio=0.25")
    x = torch.randn(20, 7, generator=torch.Generator().manual_seed(2))
    packet = c.compress(x)
    chosen = sorted(x.square().sum(1).topk(5).indices.tolist())
    assert packet["indices"].tolist() == chosen and packet["indices"].dtype == torch.int32
    assert torch.equal(packet["values"], x[chosen])
    expected = torch.zeros_like(x)
    expected[chosen] = x[chosen]
    assert torch.equal(c.decompress(packet), expected)
    assert packet.nbytes == 5 * (7 * 4 + 4)


def test_blocktopk_ties_padding_and_dtype():
    x = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.5], dtype=torch.float16)
    c = gradpress.make("blocktopk:ratio=0.5,block=3")  # blocks [1,0,0] [1,0,0] [0.5 + padding]
    packet = c.compress(x)
    assert packet["indices"].tolist() == [0, 1]  # a tie goes to the lower block
    assert packet["values"].dtype == torch.float16 and packet["values"].shape == (2, 3)
    y = c.decompress(packet)
    assert y.dtype == torch.float16 and y.tolist() == [1.0, 0, 0, 1.0, 0, 0, 0]
    packet = gradpress.make("blocktopk:ratio=1,block=3").compress(x)
    assert packet["values"][2].tolist() == [0.5, 0.0, 0.0]  # the short last block, zero-padded


def test_blocktopk_then_sketch_composes():
    """``blocktopk+sketch``: the sketch compresses the [K, B] values, one bitmap entry per kept block;
    the block indices still travel, so the packets are all-gathered (not summable)."""
    c = gradpress.make("blocktopk:ratio=0.25,block=8+sketch:lam=4")
    x = torch.randn(160, generator=torch.Generator().manual_seed(3))
    packet = c.compress(x, Context(step=0))
    inner = packet.tensors["values"]
    assert isinstance(inner, gradpress.Packet) and inner["bitmap"].shape == (5,)
    assert packet.nbytes == 5 * 4 + 4 * inner["table"].numel() + 5
    assert not c.summable and not c.unbiased
    kept = gradpress.make("blocktopk:ratio=0.25,block=8")
    selected = kept.decompress(kept.compress(x))
    mean, stderr = monte_carlo(lambda s: c.decompress(c.compress(x, Context(step=s))), 800)
    assert (mean[selected == 0] == 0).all()
    assert ((mean - selected.double()).abs() <= 5 * stderr + 1e-6).all()  # unbiased given the blocks


# -- arguments --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    ["sketch:rows=0", "sketch:lam=0", "sketch:lam=-1", "sketch:lam=inf", "sketch:ratio=0", "sketch:ratio=1.5",
     "sketch:block=-1", "blocktopk:ratio=0", "blocktopk:ratio=2", "blocktopk:block=-3"],
)
def test_bad_parameters_raise(spec):
    with pytest.raises(ValueError, match=spec.partition(":")[0]):
        gradpress.make(spec)


def test_element_indices_skip_padding():
    assert element_indices(torch.tensor([0, 2]), 4, 10).tolist() == [0, 1, 2, 3, 8, 9]
    assert element_indices(torch.tensor([], dtype=torch.int64), 4, 10).tolist() == []


def test_embedding_benchmark_runs_and_counts_bytes():
    from gradpress.bench.sketch_embedding import format_result, run

    result = run(vocab=2000, dim=8, rows_touched=20, workers=3, repeats=1)
    assert result.gather_bytes == 20 * (8 * 4 + 4)
    assert result.sketch_bytes == 80 * 4 + 2000  # c = λ·K·D = 0.5·20·8 buckets, one bool per row
    assert result.gather_received == 2 * result.gather_bytes
    assert result.sketch_received == round(2 * 2 / 3 * result.sketch_bytes)
    assert 0 < result.sketch_nmse and 20 <= result.union_rows <= 60
    assert "all-gather" in format_result(result)


# -- finite in, finite out --------------------------------------------------------
def test_sketch_of_values_near_the_float32_limit_stays_finite():
    """Measured before the scale: 2141 of 4096 decoded values Inf (3336 through simulate)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)).sign() * 3e38
    c = gradpress.make("sketch")
    y = c.decompress(c.compress(x))
    assert torch.isfinite(y).all() and y.abs().max() <= torch.finfo(torch.float32).max
    assert torch.isfinite(gradpress.simulate("sketch", [x, x])).all()
    b = (torch.randn(2112, generator=torch.Generator().manual_seed(1)).sign() * 1e38).to(torch.bfloat16)
    assert torch.isfinite(c.decompress(c.compress(b))).all()  # was: 111 of 2112 Inf


def test_the_table_scale_is_a_power_of_two_every_worker_derives():
    """s = ⌈log2(N·1024)⌉ + 1 for fp32 and bf16 (inputs below 2^128), 0 for fp16: the fp16 wire is as it
    always was; for fp32 the table is exactly 2^-s times the plain count-sketch, the decode the same bits."""
    from gradpress.compressors.sketch import SUM_WORKERS, insert

    c = gradpress.make("sketch")
    x = sparse_rows(vocab=64, dim=8, touched=range(0, 64, 2))  # N = 512 values
    assert c.table_exponent(512, 8, torch.float16) == 0
    assert c.table_exponent(512, 8, torch.float32) == c.table_exponent(512, 8, torch.bfloat16) == 9 + 10 + 1
    assert SUM_WORKERS == 1024
    ctx = Context(seed=1, step=3, key="e")
    packet = c.compress(x, ctx)
    s = packet.meta["exponent"]
    assert s == 20
    indices = torch.nonzero(x.reshape(-1) != 0).squeeze(1)
    plain = insert(indices, x.reshape(-1)[indices], packet.meta["seeds"], packet["table"].shape[1])
    assert torch.equal(packet["table"] * 2.0**s, plain)
    assert c.compress(x.half(), ctx).meta["exponent"] == 0


def test_a_sum_beyond_the_workers_the_scale_covers_is_an_overflow_error():
    c = gradpress.make("sketch")
    x = torch.full((8, 4), 3e38)
    packet = c.compress(x)
    summed = [packet["table"] * 2.0**40, packet["bitmap"]]  # as if 2^40 workers had sent it
    with pytest.raises(OverflowError, match="overflowed float32"):
        c.decode_sum(packet, summed, 2**40)
    mean = c.decode_sum(packet, [packet["table"] * 1024, packet["bitmap"]], 1024)  # 1024: in range
    assert torch.isfinite(mean).all()


def test_fp16_estimates_saturate_at_the_fp16_range():
    """A count-sketch estimate is the value plus its collisions: beyond ±65504 it saturates (the true mean
    lies within the range, so clamping only moves the estimate towards it)."""
    c = gradpress.make("sketch:lam=0.25")
    x = torch.full((64, 33), 60000.0, dtype=torch.float16)
    y = c.decompress(c.compress(x))
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    assert (y.abs() == 65504).any()  # collisions pushed some beyond: saturated, not Inf


def test_blocktopk_ranks_blocks_whose_squared_norms_overflow():
    """torch.full((64, 33), 1e30) used to raise NonFiniteError ('64 NaN/Inf'): its squared norms overflow."""
    c = gradpress.make("blocktopk")
    x = torch.full((64, 33), 1e30)
    x[5] *= 2.0
    x[40] *= 3.0
    packet = c.compress(x)
    assert packet["indices"].tolist() == [5, 40]  # K = 2 of 64 rows: the two largest, in order of index
    assert torch.equal(c.decompress(packet)[[5, 40]], x[[5, 40]])
    y = (x / 1e30).to(torch.bfloat16) * 3e30  # bf16 too
    assert gradpress.make("blocktopk").compress(y)["indices"].tolist() == [5, 40]
    sketched = gradpress.make("sketch:ratio=1/32,block=33")  # the sketch's block top-K as well: K = 2
    assert sketched.compress(x)["bitmap"].nonzero().squeeze(1).tolist() == [5, 40]


# -- the numba kernels: the torch path's bits, on every layout they take apart ----------------
def _mixed(shape, dtype=torch.float32, seed=0, zero_rows=0.5, zero_values=0.1):
    """Blocks that are all zero, partly zero and full, -0.0 among the zeros: runs of every kind."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[torch.rand(shape, generator=g) < zero_values] = -0.0
    if x.dim() == 2:
        x[torch.rand(shape[0], generator=g) < zero_rows] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("spec", ["sketch", "sketch:rows=2,lam=2", "sketch:rows=4", "sketch:rows=5,lam=4",
                                  "sketch:rows=7,lam=8", "sketch:block=3", "sketch:block=1500,rows=3",
                                  "sketch:ratio=0.1,block=2", "sketch:ratio=0.02,rows=3"])
@pytest.mark.parametrize("shape", [(70001,), (5003, 7), (3, 2000)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_sketch_kernels_give_the_torch_paths_bits(spec, shape, dtype):
    """One pass per side: bitmap + insertion (all-marked chunks, runs, single blocks, a last shorter block,
    block top-K with the sampled threshold) and query (the sorting networks of r = 2..5, the insertion
    sort beyond), for decompress and for decode_sum of several workers, bit for bit (sign of zero too)."""
    c = gradpress.make(spec)
    xs = [_mixed(shape, dtype, seed=s) for s in range(3)]
    packets = [c.compress(x, Context(seed=9, step=4, key="w", rank=r)) for r, x in enumerate(xs)]
    with numba_disabled():
        slow = [c.compress(x, Context(seed=9, step=4, key="w", rank=r)) for r, x in enumerate(xs)]
    for fast, reference in zip(packets, slow, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(fast.wire(), reference.wire(), strict=True))
    summed = list(all_reduce(packets).wire())
    decoded = [c.decompress(packets[0]), c.decode_sum(packets[0], [t.clone() for t in summed], 3)]
    with numba_disabled():
        expected = [c.decompress(packets[0]), c.decode_sum(packets[0], [t.clone() for t in summed], 3)]
    for y, z in zip(decoded, expected, strict=True):
        assert y.dtype == z.dtype == dtype and torch.equal(bits(y), bits(z))


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 6])
def test_medians_of_signed_zeros_match_the_stable_sort(rows):
    """Estimates +0 and −0 compare equal: the sorting networks keep their order, as the torch path's
    stable sort does, so the median's sign bit is the same on both paths."""
    from gradpress.compressors.sketch import query

    g = torch.Generator().manual_seed(rows)
    width, numel = 8, 4096
    table = torch.randn(rows, width, generator=g)
    table[:, ::2] = 0.0  # half the buckets hold +0: s_j(i)·S[j, h] is then +0 or −0
    seeds = tuple(int(seed) for seed in torch.randint(0, 2**32, (rows,), generator=g))
    marked = torch.rand(numel, generator=g) < 0.9
    fast = query(marked, 1, numel, table, seeds)
    with numba_disabled():
        slow = query(marked, 1, numel, table, seeds)
    assert torch.equal(bits(fast), bits(slow))
    assert (bits(fast) == -(2**31)).any()  # −0 medians occur: the check above looked at signs


def test_sketch_counts_nan_and_inf_in_its_own_pass():
    """``checks_finite``: the numba pass that inserts every non-zero block counts NaN/Inf exactly (the
    message says how many), ``ratio < 1`` and the torch path check first, and a NaN in a block that is
    otherwise zero marks it (its bits are not zero)."""
    x = torch.zeros(300, 40)
    x[7, 3], x[7, 9], x[200, 0], x[299, 39] = math.nan, math.inf, -math.inf, math.nan
    x[5] = 1.0
    for spec in ("sketch", "sketch:ratio=0.1", "sketch:block=7,rows=3"):
        c = gradpress.make(spec)
        assert c.checks_finite
        with pytest.raises(gradpress.NonFiniteError, match="holds 4 NaN/Inf value.s. out of 12000"):
            c.compress(x)
        with numba_disabled(), pytest.raises(gradpress.NonFiniteError, match="holds 4 NaN/Inf"):
            c.compress(x)


def test_sketch_table_is_the_plain_insert_of_the_marked_values():
    """The fused kernel adds the same values in the same order as :func:`insert` given the indices of
    the marked blocks, so the tables are equal bit for bit (collisions included: λ = 1/4)."""
    from gradpress.compressors.sketch import insert

    c = gradpress.make("sketch:rows=3,lam=0.25,block=5")
    x = _mixed((40003,), seed=4, zero_values=0.5)
    packet = c.compress(x, Context(seed=1, step=1))
    indices = element_indices(packet["bitmap"].nonzero().squeeze(1), 5, x.numel())
    values = x[indices] * 2.0 ** -packet.meta["exponent"]
    with numba_disabled():
        plain = insert(indices, values, packet.meta["seeds"], packet["table"].shape[1])
    assert torch.equal(packet["table"], plain)


@pytest.mark.parametrize("size", [1, 3, 64])
@pytest.mark.parametrize("ratio", [0.001, 0.03, 0.5])
def test_block_selection_equals_topk_of_block_norms(size, ratio):
    """:func:`select_blocks` (sampled threshold, one pass, partial selection) returns exactly the blocks
    of ``topk_indices(block_norms(...))``, ties to the lower block, with many tied norms as well."""
    from gradpress.compressors.sketch import as_blocks, block_norms, select_blocks
    from gradpress.compressors.sparsify import keep_count, topk_indices

    numel = 40 * 16384 * size // 8 + 5  # enough blocks for the sampled threshold at every size
    g = torch.Generator().manual_seed(size)
    for x in (torch.randn(numel, generator=g), torch.randint(-3, 4, (numel,), generator=g).float()):
        blocks = -(-numel // size)
        kept = keep_count(blocks, ratio)
        expected = topk_indices(block_norms(as_blocks(x, size)), kept)
        assert torch.equal(select_blocks(x, size, kept), expected)


def test_block_norms_sum_pairwise():
    """The squares of a block are added as a halving tree over the block padded to a power of two."""
    from gradpress.compressors.sketch import block_norms

    x = torch.tensor([[1e8, 1.0, -1e8, 1.0, 3.0], [2.0, 0.0, 0.0, 0.0, 0.0]])
    squares = x.square()
    tree = ((squares[:, 0] + squares[:, 4]) + squares[:, 2]) + (squares[:, 1] + squares[:, 3])
    assert torch.equal(block_norms(x), tree)


@pytest.mark.parametrize("spec", ["blocktopk", "blocktopk:ratio=0.01,block=3",
                                  "blocktopk:ratio=0.2,block=100"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_blocktopk_kernels_give_the_torch_paths_bits(spec, dtype):
    c = gradpress.make(spec)
    x = _mixed((600011,), dtype, seed=2, zero_values=0.3)
    fast, _ = both_paths(c, x)
    assert fast["values"].dtype == dtype


def test_blocktopk_overflowing_norms_on_the_sampled_path():
    """Squares beyond float32 among many blocks: the sampled path sees an infinite norm and ranks all
    norms scaled, as block_norms does."""
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(5))
    x[[17, 123_456, 199_999]] = torch.tensor([3e30, -2e30, 1e30])
    c = gradpress.make("blocktopk:ratio=0.001")
    packet = c.compress(x)
    with numba_disabled():
        assert torch.equal(packet["indices"], c.compress(x)["indices"])
    assert {17, 123_456, 199_999} <= set(packet["indices"].tolist())


def test_blocktopk_decodes_indices_in_any_order():
    """The dense decode copies blocks in one ascending pass; a packet whose indices are not ascending
    (not one of ours) is decoded by the general path, with the same meaning."""
    c = gradpress.make("blocktopk:ratio=0.25,block=4")
    x = torch.randn(64, generator=torch.Generator().manual_seed(6))
    packet = c.compress(x)
    order = torch.randperm(packet["indices"].numel(), generator=torch.Generator().manual_seed(0))
    shuffled = packet.with_wire([packet["values"][order], packet["indices"][order]])
    assert torch.equal(c.decompress(shuffled), c.decompress(packet))
