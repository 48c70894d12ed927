"""Method-specific behaviour of GRACE's Table 1 compressors; the shared properties are in
test_properties.py."""
from __future__ import annotations

import math

import pytest
import torch

import gradpress
from gradpress.compressors import inceptionn
from gradpress.compressors.dgc import DGCMemory
from gradpress.compressors.eightbit import BLOCK, CROWDED, EDGES, NO_EDGE, TABLE, cell_table
from gradpress.compressors.onebit import fixed_point_scale, to_fixed
from gradpress.core.compressor import check_finite
from gradpress.core.rng import Context
from kernels import PATHS, accumulate_both_paths, both_paths, path
from numerics import eps, unit_roundoff


def exact_mean_error(group: torch.Tensor, x: torch.Tensor) -> float:
    """How far a mean from exact fixed-point sums (onebit.py), rounded once to float32, may lie from the
    mean of ``group`` (elements of ``x``): u of it, plus the truncation of each element to a multiple of
    1/2^s (2^s: the fixed-point scale of x's largest magnitude and size). Independent of summation order."""
    mean = float(group.double().mean())
    truncation = 1 / fixed_point_scale(float(x.abs().max()), x.numel())
    return unit_roundoff() * abs(mean) + truncation


def _vote_packet(c, signs):
    return c.compress(torch.tensor(signs, dtype=torch.float32))


# -- signSGD / SIGNUM: majority vote ------------------------------------------------------------
@pytest.mark.parametrize("torch_only", PATHS)
def test_majority_vote_on_crafted_signs(torch_only):
    with path(torch_only):
        c = gradpress.make("signsgd")
        workers = [[0.3, 2.0, -1.0, 5.0, -0.1], [0.1, -2.0, -1.0, -5.0, 0.0], [-0.2, 1.0, -3.0, -1.0, 0.0]]
        vote = c.aggregate([_vote_packet(c, w) for w in workers])
        assert vote.tolist() == [1.0, 1.0, -1.0, -1.0, 1.0]  # 0 counts as +1, as GRACE §3.1 says
        tie = c.aggregate([_vote_packet(c, workers[0]), _vote_packet(c, workers[1])])
        assert tie.tolist() == [1.0, 0.0, -1.0, 0.0, 0.0]  # a tie gives 0
        # an all-zero gradient casts no vote; alone it aggregates to zeros
        abstain = c.aggregate([_vote_packet(c, workers[2]), _vote_packet(c, [0.0] * 5)])
        assert abstain.tolist() == [-1.0, 1.0, -1.0, -1.0, 1.0]
        assert c.aggregate([_vote_packet(c, [0.0] * 5)]).tolist() == [0.0] * 5


def test_single_worker_vote_is_the_decompressed_sign():
    c = gradpress.make("signsgd")
    x = torch.randn(77)
    p = c.compress(x)
    assert torch.equal(c.aggregate([p]), c.decompress(p))
    assert torch.equal(c.decompress(p), torch.where(x >= 0, 1.0, -1.0))
    assert p.nbytes == math.ceil(77 / 8) + 1


def test_sign_methods_name_their_feedback():
    assert gradpress.make("signsgd").default_feedback == "none"
    assert gradpress.make("signum").default_feedback == "signum"
    assert gradpress.make("efsignsgd").default_feedback == "residual"
    assert gradpress.make("signum").aggregate.__func__ is gradpress.make("signsgd").aggregate.__func__


def test_signum_momentum_and_state_dict_round_trip():
    fb = gradpress.make_feedback("signum:momentum=0.75")
    g1, g2, g3 = torch.randn(10), torch.randn(10), torch.randn(10)
    z1 = fb.compensate("w", g1)
    torch.testing.assert_close(z1, 0.25 * g1)  # z0 = 0
    fb.update("w", z1, torch.sign(z1))
    z2 = fb.compensate("w", g2.half())
    assert z2.dtype == torch.float32
    torch.testing.assert_close(z2, 0.75 * z1 + 0.25 * g2.half().float())
    fb.update("w", z2, torch.sign(z2))
    restored = gradpress.make_feedback("signum:momentum=0.75")
    restored.load_state_dict(fb.state_dict())
    assert torch.equal(restored.compensate("w", g3), fb.compensate("w", g3))
    assert torch.equal(restored.memory("w"), z2)
    with pytest.raises(ValueError, match="shape"):
        fb.compensate("w", torch.ones(3))
    with pytest.raises(ValueError, match="momentum"):
        gradpress.make_feedback("signum:momentum=1")


def test_signum_memory_does_not_alias_the_gradient():
    fb = gradpress.make_feedback("signum:momentum=0")
    g = torch.randn(6)
    z = fb.compensate("w", g)
    fb.update("w", z, z)
    g.zero_()
    z.zero_()
    assert fb.memory("w").abs().sum() > 0


# -- EF-signSGD ----------------------------------------------------------------------------------
def test_efsignsgd_is_scaled_sign():
    c = gradpress.make("efsignsgd")
    x = torch.tensor([3.0, -1.0, 0.0, -2.0])
    assert c.decompress(c.compress(x)).tolist() == [1.5, -1.5, 1.5, -1.5]  # ‖x‖₁/d = 6/4


def test_efsignsgd_error_feedback_from_the_first_step():
    """Karimireddy et al. Algorithm 1: e₀ = 0, p = g + e, e ← p − C(p), starting at step 0."""
    c = gradpress.make("efsignsgd")
    fb = gradpress.make_feedback(c.default_feedback)
    grads = [torch.randn(300) * (step + 1) for step in range(5)]
    sent = torch.zeros(300)
    rounded = torch.zeros(300, dtype=torch.float64)
    for step, g in enumerate(grads):
        p = fb.compensate("w", g)
        if step == 0:
            assert torch.equal(p, g)  # nothing to add yet, nothing lost
        out = c.decompress(c.compress(p, Context(step=step)))
        fb.update("w", p, out)
        if step == 0:
            # the scale is the exact mean |g| rounded to float32 (u; its product with ±1 is exact), then g − it (u)
            scale = float(g.double().abs().mean())
            exact = g.double() - scale * torch.where(g >= 0, 1.0, -1.0).double()
            bound = 2 * eps() * (g.double().abs() + scale)
            assert ((fb.memory("w").double() - exact).abs() <= bound).all()
        sent += out
        rounded += p.double().abs() + fb.memory("w").double().abs() + sent.double().abs()
    # the telescoping identity is linear: its float32 error is the sum of the roundings of p = g + e,
    # e = p − C(p), the running sum and the last sum, each at most u of the value rounded
    total = sent + fb.memory("w")
    bound = unit_roundoff() * (rounded + total.double().abs())
    assert ((total.double() - sum(g.double() for g in grads)).abs() <= bound).all()


# -- 1-bit SGD -----------------------------------------------------------------------------------
@pytest.mark.parametrize("torch_only", PATHS)
def test_onebit_decodes_each_side_to_its_mean(torch_only):
    x = torch.tensor([3.0, 1.0, -2.0, -4.0, 0.0, 0.5, -0.25, 2.0, 7.0])
    with path(torch_only):
        c = gradpress.make("onebit")
        p = c.compress(x)
        low, high = torch.tensor([-6.25 / 3, 13.5 / 6]).tolist()  # the means, rounded to float32
        assert p.nbytes == 2 + 8 and p["means"].tolist() == [low, high]
        y = c.decompress(p)
        assert y.tolist() == [high if v >= 0 else low for v in x.tolist()]
        shifted = gradpress.make("onebit:tau=1.5")
        low = torch.tensor(-4.75 / 6).item()
        assert shifted.decompress(shifted.compress(x)).tolist() == [4.0, low, low, low, low, low, low, 4.0, 4.0]


def test_onebit_means_are_exact_for_large_tensors():
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(3)) * 1e-4
    y = gradpress.make("onebit").decompress(gradpress.make("onebit").compress(x))
    high = x >= 0
    for side in (high, ~high):
        assert abs(float(y[side][0]) - float(x[side].double().mean())) <= exact_mean_error(x[side], x)


def test_fixed_point_sums_cannot_overflow():
    bound, count = 3.0e38, 2**20 + 1
    scale = fixed_point_scale(bound, count)
    q = int(to_fixed(torch.tensor([bound]), scale))
    assert q * count < 2**62 and q > 2**30
    assert fixed_point_scale(0.0, 5) == 1.0


# -- 8-bit -----------------------------------------------------------------------------------------
def test_eightbit_table_has_256_monotone_entries():
    assert TABLE.shape == (256,) and TABLE.dtype == torch.float32
    positive = TABLE[:128]
    assert positive[0] == 0 and (positive[1:] > positive[:-1]).all() and positive[127] < 1
    assert torch.equal(TABLE[128:], -positive)
    # 7 decades: 1 value in [1e-7, 1e-6), 2 in the next decade, ..., 64 in [0.1, 1)
    decade = torch.floor(torch.log10(positive[1:].double())).long()
    assert torch.bincount(-decade - 1).tolist() == [64, 32, 16, 8, 4, 2, 1]
    assert (EDGES[1:] > EDGES[:-1]).all()


def test_eightbit_edges_never_share_a_cell():
    """The one-comparison probe needs at most one edge per cell, for any scale."""
    for scale in [1e-30, 3.7e-8, 0.5, 1.0, 123.456, 1e30]:
        _, crowded = cell_table((EDGES * scale).numpy())
        assert crowded <= 1, scale


@pytest.mark.parametrize("torch_only", PATHS)
def test_eightbit_error_bound_per_decade(torch_only):
    """Nearest-value rounding: at most half a step of the decade, 0.45·10^-e / 2^(6-e) of the scale."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_000, generator=g) * torch.logspace(-8, 0, 20_000)
    x[123] = -4.0
    with path(torch_only):
        c = gradpress.make("eightbit")
        p = c.compress(x)
        y = c.decompress(p)
    scale = float(p["scale"][0])
    # the scale is a float32 quotient (a rounding or two: ≤ eps); the top code decodes to TABLE[127]·scale
    assert scale == pytest.approx(4.0 / float(TABLE[127]), rel=eps())
    assert y[123] == pytest.approx(-4.0, rel=2 * eps())  # the largest element lands on the top code
    v = (x.abs() / scale).double()
    e = torch.clamp(torch.floor(-torch.log10(v.clamp_min(1e-300))), 0, 6)
    bound = torch.where(v >= 1e-7, 0.45 * 10**-e / 2 ** (6 - e), 5.5e-7) * scale
    # plus the float32 roundings of the decoded value TABLE[c]·scale (and of the scale in it): 2u of |y|
    assert ((y - x).abs().double() <= bound + 2 * eps() * y.abs().double()).all()
    rel = ((y - x).abs() / x.abs())[v >= 0.1]
    assert rel.max() < 0.071


def test_eightbit_tiny_values_keep_their_relative_precision():
    x = torch.tensor([1e-40, -3e-39, 2.5e-40, 0.0])
    c = gradpress.make("eightbit")
    y = c.decompress(c.compress(x))
    assert y[1] == pytest.approx(-3e-39, rel=1e-2) and y[3] == 0


# -- INCEPTIONN ------------------------------------------------------------------------------------
@pytest.mark.parametrize("torch_only", PATHS)
def test_inceptionn_tags_by_range(torch_only):
    eps = 2.0**-10
    x = torch.tensor([0.0, 5e-4, -2e-3, 0.05, -0.2, 0.5, -0.9999, 1.0, -3.5, 1e-30])
    with path(torch_only):
        c = gradpress.make("inceptionn")
        assert c.tags(x).tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 3, 0]
        p = c.compress(x)
        y = c.decompress(p)
    assert p["payload"].numel() == 2 * 1 + 3 * 2 + 2 * 4  # 8, 16 and 32 bits for tags 1, 2, 3
    assert p.nbytes == math.ceil(10 / 4) + p["payload"].numel()
    assert p["payload"][-4:].view(torch.float32).item() == -3.5  # the raw float, little-endian
    assert y[[0, 1, 9]].tolist() == [0.0, 0.0, 0.0]
    assert y[[7, 8]].tolist() == [1.0, -3.5]
    assert ((y - x).abs()[2:7] <= eps / 2).all() and (torch.sign(y[2:7]) == torch.sign(x[2:7])).all()
    torch.testing.assert_close(y[2], torch.tensor(-(2 + 0.5) * eps))  # ⌊2e-3 / 2^-10⌋ = 2


def test_inceptionn_error_is_below_the_bound():
    x = torch.randn(50_000) * torch.logspace(-6, 0.5, 50_000)
    for bound in (2.0**-7, 2.0**-10, 2.0**-15):
        c = gradpress.make("inceptionn", error_bound=bound)
        assert ((c.decompress(c.compress(x)) - x).abs() < bound).all()
    with pytest.raises(ValueError, match="power of two"):
        gradpress.make("inceptionn:error_bound=0.001")


def _inceptionn_kernels():
    """The numba kernel sets: the portable loops, and the AVX-512 ones where the CPU has them."""
    vector = pytest.param(inceptionn.VECTOR, id="vector", marks=pytest.mark.skipif(
        not inceptionn.simd.AVAILABLE, reason="needs AVX-512 VBMI2"))
    return [pytest.param(inceptionn.PORTABLE, id="portable"), vector]


def _inceptionn_edges(n: int, bound: float) -> torch.Tensor:
    """Every range's edges (ε, 128·ε, 1 and their neighbours, ±0, subnormals, huge values) among
    random magnitudes from 1e-7 to 10, both signs, n of them."""
    edges = torch.tensor([bound, 128 * bound, 1.0, 0.0, 1e-45, 3e38, 2.0**-15, 1 - 2.0**-24])
    edges = torch.cat([edges, torch.nextafter(edges, torch.zeros(())), torch.nextafter(edges, edges + 1)])
    edges = torch.cat([edges, -edges])
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-7, 1, n)
    x[torch.randperm(n, generator=g)[:min(n, edges.numel())]] = edges[:n]
    return x


@pytest.mark.parametrize("kernels", _inceptionn_kernels())
@pytest.mark.parametrize("n", [1, 3, 15, 16, 17, 64, 4099, 10_007])
@pytest.mark.parametrize("bound", [2.0**-7, 2.0**-10, 2.0**-15])
def test_inceptionn_kernels_write_the_torch_bytes(monkeypatch, kernels, n, bound):
    """Both numba kernel sets (their 16-element chunks, blocks and tails) give the torch path's
    packet and decode it as torch does."""
    monkeypatch.setattr(inceptionn, "KERNELS", kernels)
    c = gradpress.make("inceptionn", error_bound=bound)
    x = _inceptionn_edges(n, bound)
    _, values = both_paths(c, x)
    assert ((values - x).abs() < bound).all()


@pytest.mark.parametrize("kernels", [*_inceptionn_kernels(), pytest.param(None, id="torch")])
def test_inceptionn_rejects_a_payload_the_tags_do_not_call_for(monkeypatch, kernels):
    c = gradpress.make("inceptionn")
    x = torch.randn(1001) * 0.1  # tags 1 and 2: payloads of 1 and 2 bytes
    packet = c.compress(x)
    if kernels is not None:
        monkeypatch.setattr(inceptionn, "KERNELS", kernels)
    payload = packet["payload"]
    for wrong in (payload[:-1], torch.cat([payload, payload[:1]]), payload[:-100]):
        with path(kernels is None), pytest.raises(ValueError, match="payload bytes"):
            c.decompress(packet.with_wire([packet["tags"], wrong]))
    with path(kernels is None), pytest.raises(ValueError, match="tag bytes"):
        c.decompress(packet.with_wire([packet["tags"][:-1], payload]))


@pytest.mark.parametrize("kernels", _inceptionn_kernels())
@pytest.mark.parametrize("n", [1, 17, 1000, 4099, 10_007])
def test_inceptionn_decode_add_equals_torch_and_the_dense_sum(monkeypatch, kernels, n):
    """The all-gather sum decodes each packet straight into the total: the same bits as the torch path
    and the dense sum, across 16-element chunks, blocks and tails."""
    monkeypatch.setattr(inceptionn, "KERNELS", kernels)
    accumulate_both_paths("inceptionn", [_inceptionn_edges(n, 2.0**-10) * s for s in (1.0, 0.01, -0.5)])
    c = gradpress.make("inceptionn")
    packet = c.compress(torch.randn(n) * 0.1)
    for wrong in (packet["payload"][:-1], torch.cat([packet["payload"], packet["payload"][:1]])):
        with pytest.raises(ValueError, match="payload bytes"):
            c.accumulate(torch.zeros(n), packet.with_wire([packet["tags"], wrong]))


@pytest.mark.parametrize("kernels", _inceptionn_kernels())
@pytest.mark.parametrize("where", [[0], [16, 17], [4098], [5000]])
def test_inceptionn_kernels_find_nan_and_inf(monkeypatch, kernels, where):
    """The first pass reports NaN/Inf anywhere (chunks, blocks, the tail) as check_finite does."""
    monkeypatch.setattr(inceptionn, "KERNELS", kernels)
    x = torch.randn(5001)
    x[where] = torch.tensor([float("nan"), float("-inf")])[:len(where)]
    with pytest.raises(gradpress.NonFiniteError, match=f"holds {len(where)} NaN/Inf value"):
        gradpress.make("inceptionn").compress(x)


# -- Threshold-v ---------------------------------------------------------------------------------
def test_threshold_keeps_exactly_the_values_above_v():
    x = torch.tensor([0.5, -0.02, 0.01, -0.3, 0.0, 0.011])
    p = gradpress.make("threshold:v=0.01").compress(x)
    assert p["indices"].tolist() == [0, 1, 3, 5] and p.nbytes == 4 * 8
    assert torch.equal(gradpress.make("threshold:v=0.01").decompress(p), torch.where(x.abs() > 0.01, x, 0.0))


# -- DGC -------------------------------------------------------------------------------------------
def test_dgc_warmup_schedule():
    c = gradpress.make("dgc:warmup_steps=400")
    densities = [c.density(s) for s in (0, 99, 100, 199, 200, 300, 399, 400, 10_000)]
    assert densities == [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.00390625, 0.00390625, 0.001, 0.001]
    assert gradpress.make("dgc").density(0) == 0.001  # no warm-up by default
    assert gradpress.make("dgc:ratio=0.01,warmup_steps=4").density(3) == 0.01  # never below ratio


def test_dgc_sends_about_the_scheduled_fraction():
    x = torch.randn(2**18, generator=torch.Generator().manual_seed(5))
    c = gradpress.make("dgc:warmup_steps=40")
    for step, density in [(0, 0.25), (15, 0.0625), (25, 0.015625), (50, 0.001)]:
        counts = [c.compress(x, Context(step=step, seed=s))["indices"].numel() for s in range(4)]
        assert 0.75 < sum(counts) / (4 * density * x.numel()) < 1.3, (step, counts)


def test_dgc_momentum_correction_and_factor_masking():
    c = gradpress.make("dgc:ratio=0.1")
    fb = gradpress.make_feedback(c.default_feedback)
    assert isinstance(fb, DGCMemory) and fb.momentum == 0.9 and fb.masking
    g1, g2 = torch.randn(1000), torch.randn(1000)
    v1 = fb.compensate("w", g1)
    assert torch.equal(v1, g1)  # u = g, v = u on the first step
    out = c.decompress(c.compress(v1, Context(step=0)))
    fb.update("w", v1, out)
    sent = out != 0
    assert 50 < int(sent.sum()) < 200 and torch.equal(out[sent], g1[sent])
    v2 = fb.compensate("w", g2)
    # unsent: u = 0.9·g1 + g2, v = g1 + u; sent: u and v were zeroed, so v = u = g2
    torch.testing.assert_close(v2[~sent], g1[~sent] + 0.9 * g1[~sent] + g2[~sent])
    torch.testing.assert_close(v2[sent], g2[sent])
    unmasked = gradpress.make_feedback("dgc:masking=false")
    unmasked.update("w", unmasked.compensate("w", g1), out)
    torch.testing.assert_close(unmasked.compensate("w", g2)[sent], 0.9 * g1[sent] + g2[sent])


def test_dgc_clipping_and_state_dict():
    fb = gradpress.make_feedback("dgc:clip=1,momentum=0.5")
    g = torch.full((4,), 10.0)  # norm 20
    v = fb.compensate("k", g)
    # clipped to norm 1: the norm of 4 values (γ_4 for the sum of squares, u for the root, u for the quotient
    # clip/‖g‖ and u for each product) measured again in float64: well within 4·eps
    assert float(torch.linalg.vector_norm(v.double())) == pytest.approx(1.0, rel=4 * eps(), abs=0)
    fb.update("k", v, torch.zeros(4))
    restored = gradpress.make_feedback("dgc:clip=1,momentum=0.5")
    restored.load_state_dict(fb.state_dict())
    assert torch.equal(restored.compensate("k", g), fb.compensate("k", g))
    with pytest.raises(RuntimeError, match="without a compensate"):
        gradpress.make_feedback("dgc").update("k", g, g)


# -- Adaptive threshold --------------------------------------------------------------------------
@pytest.mark.parametrize("torch_only", PATHS)
def test_adaptive_sends_alpha_of_each_side_with_its_mean(torch_only):
    g = torch.Generator().manual_seed(2)
    x = torch.cat([torch.rand(70_000, generator=g), -3 * torch.rand(30_000, generator=g)])
    x = x[torch.randperm(x.numel(), generator=g)]
    with path(torch_only):
        c = gradpress.make("adaptive:alpha=0.05,sample_ratio=0.1")
        p = c.compress(x, Context(step=1))
        y = c.decompress(p)
    positive, negative = p["positive"].long(), p["negative"].long()
    assert 0.85 < positive.numel() / (0.05 * 70_000) < 1.15
    assert 0.85 < negative.numel() / (0.05 * 30_000) < 1.15
    # the largest of each side, decoded to that side's mean
    assert x[positive].min() > x[(x > 0) & (y == 0)].max()
    assert x[negative].max() < x[(x < 0) & (y == 0)].min()
    for side in (positive, negative):  # each side's exact mean, the same for all its elements
        assert torch.equal(y[side], y[side][:1].expand(side.numel()))
        assert abs(float(y[side][0]) - float(x[side].double().mean())) <= exact_mean_error(x[side], x)
    assert p.nbytes == 4 * (positive.numel() + negative.numel()) + 8


# -- SketchML --------------------------------------------------------------------------------------
def test_sketchml_dense_buckets_are_equal_frequency_with_exact_means():
    x = torch.randn(40_000, generator=torch.Generator().manual_seed(9))
    c = gradpress.make("sketchml:bits=4,sample_ratio=1")
    p = c.compress(x)
    assert p["indices"].numel() == 0 and p["means"].numel() == 15
    codes = gradpress.unpack_bits(p["codes"], 4, x.numel()).long()
    counts = torch.bincount(codes, minlength=16)
    assert counts[0] == 0 and (counts[1:] - 40_000 / 15).abs().max() <= 2
    for b in range(1, 16):
        assert abs(float(p["means"][b - 1]) - float(x[codes == b].double().mean())) <= exact_mean_error(x[codes == b], x)
    y = c.decompress(p)
    assert torch.equal(y, p["means"][codes - 1])


@pytest.mark.parametrize("torch_only", PATHS)
def test_sketchml_sends_the_positions_of_sparse_input(torch_only):
    x = torch.zeros(10_000)
    x[::97] = torch.linspace(-1, 1, len(range(0, 10_000, 97)))
    x[5] = 0.0  # an exact zero among the kept positions' neighbours
    with path(torch_only):
        c = gradpress.make("sketchml")
        p = c.compress(x)
        y = c.decompress(p)
    nonzero = x.nonzero().squeeze(1)
    assert torch.equal(p["indices"].long(), nonzero)
    assert p.nbytes == nonzero.numel() * (4 + 1) + 4 * p["means"].numel()
    assert torch.equal(y == 0, x == 0)
    assert (y - x).abs().max() < 0.05


def test_sketchml_keeps_exact_zeros_in_dense_mode():
    x = torch.randn(5000)
    x[:100] = 0.0
    c = gradpress.make("sketchml")
    p = c.compress(x)
    y = c.decompress(p)
    assert p["indices"].numel() == 0 and (y[:100] == 0).all() and (y[100:] != 0).all()


# -- the table-reading kernels and the fused NaN/Inf checks (eightbit, onebit, sketchml) -------------
def test_cell_table_entries_against_their_definition():
    """Each entry: the edges below the cell, the low key bits of the one edge inside it (NO_EDGE if
    none), CROWDED if two or more share it; crowded quantiles and repeated edges included."""
    g = torch.Generator().manual_seed(3)
    crowd = 1 + 1e-4 * torch.randn(40, generator=g)  # 40 edges within 2^-7 of 1: a few cells
    edges = torch.cat([torch.randn(100, generator=g), crowd, crowd[:5], -torch.rand(20, generator=g) * 1e-30])
    edges = edges[edges != 0].sort().values.numpy()
    table, crowded = cell_table(edges)
    keys = edges.view("uint32").astype("int64")
    keys = torch.tensor(((keys ^ (((keys >> 31) * 0x7FFFFFFF) | 0x80000000)) & 0xFFFFFFFF).tolist())
    table = torch.tensor(table.astype("int64"))
    cells = torch.arange(65536)
    below = torch.searchsorted(keys, cells << 16)
    inside = torch.searchsorted(keys, (cells + 1) << 16) - below
    assert torch.equal((table >> 16) & 0xFF, below) and crowded == int(inside.max()) > 1
    assert torch.equal(table & CROWDED != 0, inside > 1)
    single = inside == 1
    assert torch.equal(table[single] & 0xFFFF, keys[below[single]] & 0xFFFF)
    assert (table[inside == 0] & 0xFFFF == NO_EDGE).all()


@pytest.mark.parametrize("spec", ["eightbit", "onebit", "onebit:tau=0.5", "sketchml", "sketchml:bits=4"])
@pytest.mark.parametrize("n", [1, 15, 63, 65, BLOCK - 1, BLOCK, 3 * BLOCK + 17])
def test_quantizer_kernels_write_the_torch_bits_at_block_edges(spec, n):
    """The numba kernels work in 64-element words and BLOCK-element blocks, then the tail: every split
    gives the torch path's bits."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    x[::7] = 0.0
    c = gradpress.make(spec)
    both_paths(c, x, Context(seed=1))


@pytest.mark.parametrize("torch_only", PATHS)
def test_sketchml_crowded_quantiles_are_probed(torch_only):
    """Values crowding within 2^-7 of each other (and repeated ones) put several quantile edges in one
    cell of the table: the kernel probes those cells and still codes every value as the torch path."""
    g = torch.Generator().manual_seed(5)
    crowd = 1 + 1e-5 * torch.randn(3000, generator=g)
    x = torch.cat([crowd, torch.full((700,), 1.5), torch.randn(1300, generator=g)])
    c = gradpress.make("sketchml:sample_ratio=1")
    edges = c.edges(x, Context())
    assert cell_table(edges.numpy())[1] > 1  # crowded cells: the probe runs
    with path(torch_only):
        packet = c.compress(x, Context())
    codes = packet["codes"].long()
    expected = torch.searchsorted(edges, x) + 1
    assert torch.equal(codes, expected)
    for b in expected.unique():
        assert packet["means"][b - 1] == x[expected == b].double().mean().float()


@pytest.mark.parametrize("spec", ["eightbit", "onebit", "sketchml"])
@pytest.mark.parametrize("torch_only", PATHS)
def test_quantizers_find_non_finite_values_in_their_max_pass(spec, torch_only, monkeypatch):
    """checks_finite: the pass for max |x| (which these methods make anyway) shows NaN/Inf anywhere, in
    the first word, a later block or the tail; the error is check_finite's, with its count. No separate
    check pass runs on finite input."""
    c = gradpress.make(spec)
    assert c.checks_finite
    for where in ([0], [300, 999], [BLOCK + 3, 1000, 1001]):
        x = torch.randn(1002, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        x[where] = torch.tensor([float("nan"), float("inf"), -float("inf")][: len(where)], dtype=x.dtype)
        with pytest.raises(gradpress.NonFiniteError) as raised:
            check_finite(x, c.spec)
        with path(torch_only), pytest.raises(gradpress.NonFiniteError) as error:
            c.compress(x)
        assert str(error.value) == str(raised.value) and f"holds {len(where)} NaN/Inf" in str(error.value)
    calls = []
    monkeypatch.setattr(gradpress.core.compressor, "check_finite", lambda flat, where: calls.append(where))
    with path(torch_only):
        c.compress(torch.randn(1002))
    assert calls == []


# -- Qsparse ---------------------------------------------------------------------------------------
def test_qsparse_is_the_composition_with_error_feedback():
    c = gradpress.make("qsparse:ratio=0.1,levels=4")
    assert c.composition == "topk:ratio=0.1+qsgd:levels=4" and c.default_feedback == "residual"
    x = torch.randn(1000)
    ctx = Context(seed=1, step=2, key="w")
    reference = gradpress.make(c.composition)
    assert torch.equal(c.decompress(c.compress(x, ctx)), reference.decompress(reference.compress(x, ctx)))
    assert c.expected_nbytes(1000) == reference.expected_nbytes(1000)
    assert gradpress.make("qsparse:sparsifier=randomk").composition == "randomk+qsgd"
    with pytest.raises(ValueError, match="levels"):
        gradpress.make("qsparse:quantizer=efsignsgd,levels=4")
