"""PowerSGD (Vogels et al. 2019): the power iteration and its warm start, error feedback, the two
all-reduces through the runtime (``simulate`` against the step computed by hand), state round trips,
and PyTorch's own ``powerSGD_hook`` beside ours on Gloo."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import gradpress
from dist_utils import run_workers
from gradpress.compressors.powersgd import PowerSGD, orthonormal_rows
from gradpress.core.rng import Context
from numerics import gamma, powersgd_step_error, unit_roundoff


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def nmse(estimate: torch.Tensor, exact: torch.Tensor) -> float:
    return float((estimate.double() - exact.double()).square().sum() / exact.double().square().sum())


def set_warm_start(sim: gradpress.Simulator, key: str, q: torch.Tensor) -> None:
    """Every worker starts ``key``'s next power iteration from ``q`` (through the saved state)."""
    state = sim.state_dict()
    for worker in state:
        worker["compressor"] = {"warm": {key: q}}
    sim.load_state_dict(state)


def warm_start(sim: gradpress.Simulator, key: str = "") -> list[torch.Tensor]:
    return [s["compressor"]["warm"][key] for s in sim.state_dict()]


@pytest.fixture
def drawn(monkeypatch) -> list[torch.Tensor]:
    """Every Qᵀ PowerSGD draws from the shared stream, in order (the error bounds depend on Q)."""
    draws: list[torch.Tensor] = []
    fresh = PowerSGD._fresh

    def spy(ctx: Context, n: int, r: int, device: torch.device) -> torch.Tensor:
        qt = fresh(ctx, n, r, device)
        draws.append(qt.clone())
        return qt

    monkeypatch.setattr(PowerSGD, "_fresh", staticmethod(spy))
    return draws


def starting_q(sim: gradpress.Simulator, key: str = "") -> torch.Tensor | None:
    """The Qᵀ the next step starts from, when it is a warm start (None: it will be drawn)."""
    return sim.state_dict()[0]["compressor"]["warm"].get(key)


# -- float32 error bounds -----------------------------------------------------------------------------
def recovery_bound(workers: list[torch.Tensor], qt: torch.Tensor) -> float:
    """A first-order bound on ‖M̂ − M‖_F / ‖M‖_F for one float32 step on workers whose mean M has rank r:
    exact in exact arithmetic (M = P̂ P̂ᵀ M once span(P) = span(M Q) is M's column space). The float32
    inputs have rank r only up to their own rounding: the tail T beyond σ_r (measured in float64) is lost by
    any rank-r projection and turns span(M Q) by ‖T‖₂‖Q‖₂ / σ_r(M Q); the rest is
    :func:`numerics.powersgd_step_error`."""
    mean = sum(x.double() for x in workers) / len(workers)
    q = qt.double().t()
    r = q.shape[1]
    singular = torch.linalg.svdvals(mean)
    tail = float(singular[r:].square().sum().sqrt())
    turned = tail * float(torch.linalg.matrix_norm(q, 2)) / float(torch.linalg.svdvals(mean @ q)[r - 1])
    exact_step_error = tail + turned * float(singular[0])
    return (powersgd_step_error(workers, qt) + exact_step_error) / float(mean.norm())


# -- the power iteration ------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [1, 3])
def test_rank_r_mean_is_recovered_exactly(rank, drawn):
    """Workers' matrices U V_wᵀ of rank r: their mean lies in span(U), which P = M Q finds at once
    (exactly up to float32 rounding: :func:`recovery_bound`, from the Q each step starts from)."""
    u = randn(48, rank, seed=1)
    workers = [u @ randn(rank, 40, seed=10 + w) for w in range(3)]
    mean = sum(w.double() for w in workers) / 3
    sim = gradpress.Simulator(f"powersgd:rank={rank}", 3, feedback="none")
    for _ in range(3):
        qt = starting_q(sim)
        out = sim.step(workers)
        bound = recovery_bound(workers, drawn[-1] if qt is None else qt)
        assert nmse(out, mean) <= bound**2, bound


def test_warm_start_converges_to_the_best_rank_r_approximation():
    """Algorithm 1 with warm start is subspace iteration across steps: on a fixed matrix it reaches the
    Eckart-Young optimum ‖M − M_r‖ (singular values halving: the subspace error halves per step),
    which one power iteration from a fresh random Q does not."""
    m, n, r = 40, 30, 2
    u = orthonormal_rows(randn(m, n, seed=2).t()).t()
    v = orthonormal_rows(randn(n, n, seed=3).t()).t()
    s = 2.0 ** -torch.arange(n, dtype=torch.float32)
    matrix = u @ torch.diag(s) @ v.t()
    singular = torch.linalg.svdvals(matrix.double())  # the float32 matrix's own (u, v are orthonormal to ~u)
    best = float(singular[r:].square().sum() / singular.square().sum())
    # float32 rounding: the products after the subspace (Q = Mᵀ P̂, m; P̂ Qᵀ, r) and QR's orthogonality
    # (γ_{2mr}, Higham Thm 19.4) move M̂ by δ·‖M‖_F, which moves the error by at most 2·√best·δ + δ² (the
    # error is ‖M − M̂‖_F ≥ √best·‖M‖_F, Eckart-Young); the subspace's own rounding costs only its
    # square (the optimum is stationary in it), again below δ² with a warm start's well-conditioned M Q.
    delta = gamma(2 * m * r) + gamma(m + r + 2) * r**0.5
    rel = (2 * best**0.5 * delta + 2 * delta**2) / best
    warm = gradpress.Simulator(f"powersgd:rank={r}", 1, feedback="none")
    cold = gradpress.Simulator(f"powersgd:rank={r},warm_start=false", 1, feedback="none")
    for _ in range(25):
        warm_error, cold_error = nmse(warm.step([matrix]), matrix), nmse(cold.step([matrix]), matrix)
        assert warm_error >= best * (1 - rel) and cold_error >= best * (1 - rel)
    assert warm_error == pytest.approx(best, rel=rel)  # the subspace error halved 25 times: 2^-50 of it left
    assert cold_error > best * 1.01


def test_error_feedback_solves_least_squares():
    """Gradient descent on Σ_w ‖A_w X − B_w‖² / 2 with rank-1 PowerSGD and error feedback (Algorithm 2)
    reaches the least-squares solution X*."""
    a = [randn(30, 8, seed=20 + w) for w in range(2)]
    b = [randn(30, 12, seed=30 + w) for w in range(2)]
    solution = torch.linalg.lstsq(torch.cat(a).double(), torch.cat(b).double()).solution
    sim = gradpress.Simulator("powersgd", 2)  # the default feedback: residual
    assert sim.pipelines[0].feedback.spec == "residual"
    x = torch.zeros(8, 12)
    for _ in range(300):
        x = x - 0.3 * sim.step([aw.t() @ (aw @ x - bw) / 30 for aw, bw in zip(a, b, strict=True)])
    # a convergence threshold, not a rounding one: float32's own floor, about (κ(AᵀA)·γ_30)² ≈ 5e-11 for
    # cond(A) ≈ 1.9 (the gradient's products have 30 terms; tests/numerics.py), lies far below it
    assert nmse(x, solution) < 1e-8


# -- the runtime: two all-reduces, by hand -----------------------------------------------------------
def test_simulate_is_the_powersgd_step_by_hand():
    """Three workers, two steps with error feedback, each against Algorithm 1 and 2 in float64 from the
    simulator's own state (its warm start and memories, so that each comparison carries one step's
    float32 rounding: :func:`powersgd_step_error`):
    Δ_w = M_w + e_w, P = Σ Δ_w Q, P̂ = orth(P), Q' = mean(Δ_wᵀ) P̂, M̂ = P̂ Q'ᵀ, e_w = Δ_w − P̂ P̂ᵀ Δ_w."""
    workers, (m, n), r = 3, (24, 18), 2
    sim = gradpress.Simulator(f"powersgd:rank={r}", workers, seed=5)
    set_warm_start(sim, "w", randn(n, r, seed=40).t().contiguous())  # the state holds Qᵀ
    memory = [torch.zeros(m, n, dtype=torch.float64) for _ in range(workers)]
    for step in range(2):
        qt = warm_start(sim, "w")[0]
        q = qt.double().t()
        grads = [randn(m, n, seed=100 * step + w) for w in range(workers)]
        deltas = [g.double() + e for g, e in zip(grads, memory, strict=True)]
        p_hat = torch.linalg.qr(sum(d @ q for d in deltas)).Q
        q = sum(d.t() @ p_hat for d in deltas) / workers
        expected = p_hat @ q.t()
        memory = [d - p_hat @ (p_hat.t() @ d) for d in deltas]
        atol = powersgd_step_error(deltas, qt)
        got = sim.step([{"w": g} for g in grads])["w"]
        torch.testing.assert_close(got.double(), expected, rtol=0, atol=atol)
        for rank, pipeline in enumerate(sim.pipelines):
            torch.testing.assert_close(pipeline.feedback.memory("w").double(), memory[rank], rtol=0, atol=atol)
        # the next warm start: the same bits on every worker, the mean Q (up to the sign of P̂'s columns)
        first, *others = warm_start(sim, "w")
        assert all(torch.equal(first, other) for other in others)
        torch.testing.assert_close(p_hat @ first.double(), expected, rtol=0, atol=atol)
        memory = [pipeline.feedback.memory("w").double() for pipeline in sim.pipelines]


@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (256, 384)])
def test_rank_one_decompression_is_the_matrix_products_bits(shape):
    """M̂ = P̂ Qᵀ at rank 1 is an outer product: each entry one product p_i·q_j, as the matrix product of
    inner dimension 1 computes it (float32, no sum to round), so both give the same bits, here and through
    decompress and decode_sum."""
    from gradpress.compressors.powersgd import _product

    m, n = shape
    pt, qt = randn(1, m, seed=m), randn(1, n, seed=n + 1)
    assert torch.equal(_product(pt, qt), torch.mm(pt.t(), qt))
    c = gradpress.make("powersgd:rank=1,min_compression_rate=0")
    x = randn(m, n, seed=3) if min(m, n) > 1 else randn(4, 5, seed=3)
    packet = c.compress(x, Context(seed=0, step=0, key="w"))
    expected = torch.mm(packet["p"].t(), packet["q"]).view(x.shape)
    assert torch.equal(c.decompress(packet), expected)
    assert torch.equal(c.decode_sum(packet, [packet["q"] * 2], 2), expected)


def test_two_rounds_p_then_q_and_their_bytes():
    """Per compressed tensor: a preliminary all-reduce of P (m×r), then one of Q (n×r); for two workers a
    ring all-reduce sends each worker's bytes once, so sent bytes = the packet's (m + n)·r·4."""
    sim = gradpress.Simulator("powersgd:rank=2", 2)
    grads = {"w": randn(64, 32, seed=1), "b": randn(64, seed=2)}
    sim.step([grads, {k: v * 2 for k, v in grads.items()}])
    last = sim.stats()[0]["last"]
    c = gradpress.make("powersgd:rank=2")
    assert last["packet_bytes"] == c.nbytes_for((64, 32)) + c.nbytes_for((64,)) == (64 + 32) * 2 * 4 + 64 * 4
    assert last["collectives"] == 2  # P; then Q and the bias's values, concatenated in one all-reduce
    assert last["sent_bytes"] == last["packet_bytes"] + 2 * 4  # and P's two fault-flag slots (float32)


@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("scale", [1.0, 2.0**-120, 2.0**110, 5.0e37])
def test_orthogonalization_keeps_p_directions_at_any_scale(rank, scale):
    """P̂ is orthonormal and spans P's columns for P of any finite scale: at rank 1 P / ‖P‖ (the paper's
    normalization; in float32 where ‖P‖ lies in NORM_RANGE, else in float64), at rank 3 Householder QR
    of P scaled by a power of two where |P| lies outside QR_RANGE (MKL's QR returns NaN for a column
    whose norm exceeds float32's largest, as P's does at 5e37). Checked against float64: ‖P̂ᵀP̂ − I‖
    and the projection P̂ P̂ᵀ to float32's rounding of m terms, whatever P̂'s signs."""
    from gradpress.compressors.powersgd import NORM_RANGE, magnitude

    m = 500
    pt = (randn(rank, m, seed=8).double() * scale).float()
    assert bool(pt.isfinite().all()) and bool(pt.abs().min() > 0)  # (5e37: ‖P‖ beyond float32's largest)
    basis = torch.linalg.qr(pt.double().t()).Q  # m × r, float64
    got = orthonormal_rows(pt)
    assert got.shape == (rank, m) and got.is_contiguous() and got.dtype == torch.float32
    tolerance = 2 * gamma(m + 2) * rank
    torch.testing.assert_close(got.double() @ got.double().t(), torch.eye(rank, dtype=torch.float64),
                               rtol=0, atol=tolerance)
    torch.testing.assert_close(got.double().t() @ got.double(), basis @ basis.t(), rtol=0, atol=tolerance)
    if rank == 1:
        norm = magnitude(pt)
        assert norm == pytest.approx(float(pt.double().norm()), rel=gamma(m + 2))
        inside = NORM_RANGE[0] <= norm <= NORM_RANGE[1]
        assert inside == (scale == 1.0)
        assert torch.equal(got, pt / norm if inside else (pt.double() / norm).float())  # the division, not QR
        # the same bits wherever ΣP lies (a view into the preliminary exchange's buffer, at any offset; MKL's
        # dot, for one, sums in an order that depends on the address)
        for offset in range(1, 17):
            buffer = torch.zeros(m + offset)
            buffer[offset:] = pt[0]
            assert torch.equal(orthonormal_rows(buffer[offset:].view(1, m)), got), offset
    # a zero P: QR's completion by unit vectors, no NaN
    assert torch.equal(orthonormal_rows(torch.zeros(rank, m)).abs(), torch.eye(rank, m))


# -- the products on the CPU: one pass over M (numba), bits set by the shapes alone --------------------
STREAMED_SHAPES = [(1024, 1024, 1), (257, 131, 2), (130, 300, 3), (64, 512, 4), (9, 4099, 1)]


def _reference_products(qt: torch.Tensor, pt: torch.Tensor, matrix: torch.Tensor):
    """The kernels' documented orders in float32 torch operations (one rounding each, no fused
    multiply-add): Pᵀ[k, i] as 16 partial sums (lane l: j ≡ l mod 16, in order) added lane by lane in
    order; Qᵀ[k] as the rows of M scaled and added in order."""
    (r, n), m = qt.shape, matrix.shape[0]
    padded = -(-n // 16) * 16
    products = torch.zeros(r, m, padded)
    products[:, :, :n] = qt[:, None, :] * matrix[None, :, :]  # float32 products, exact as the kernel's
    lanes = torch.zeros(r, m, 16)
    for chunk in products.view(r, m, padded // 16, 16).unbind(2):
        lanes = lanes + chunk
    p = lanes[..., 0].clone()
    for lane in range(1, 16):
        p = p + lanes[..., lane]
    q = torch.zeros(r, n)
    for i in range(m):
        q = q + pt[:, i:i + 1] * matrix[i]
    return p, q


@pytest.mark.parametrize("m, n, r", STREAMED_SHAPES)
def test_streamed_products_have_their_documented_bits_at_any_address(m, n, r):
    """Pᵀ = Qᵀ Mᵀ and Qᵀ = P̂ᵀ M through the numba kernels (rows four at a time and one by one, n not a
    multiple of 16, ranks 1 to STREAMED_RANK) give the bits of their documented summation orders, whatever
    the address of M (MKL's may not), and lie within the dot product's bound γ_n·|Qᵀ|·|Mᵀ| of the exact
    products, as torch.mm does (numba disabled)."""
    from gradpress.compressors.powersgd import STREAMED_NUMEL, STREAMED_RANK, p_product, q_product
    from gradpress.kernels.jit import numba_disabled

    assert r <= STREAMED_RANK and m * n >= STREAMED_NUMEL  # the kernels' path
    matrix, qt, pt = randn(m, n, seed=m), randn(r, n, seed=n), randn(r, m, seed=r)
    expected_p, expected_q = _reference_products(qt, pt, matrix)
    for offset in (0, 1, 5, 16):
        storage = torch.zeros(m * n + offset)
        storage[offset:] = matrix.reshape(-1)
        shifted = storage[offset:].view(m, n)
        assert torch.equal(p_product(qt, shifted), expected_p), offset
        assert torch.equal(q_product(pt, shifted), expected_q), offset
    exact_p = qt.double() @ matrix.double().t()
    bound_p = gamma(n) * (qt.double().abs() @ matrix.double().abs().t())
    exact_q, bound_q = pt.double() @ matrix.double(), gamma(m) * (pt.double().abs() @ matrix.double().abs())
    with numba_disabled():
        blas_p, blas_q = p_product(qt, matrix), q_product(pt, matrix)
    for got in (expected_p, blas_p):
        assert bool(((got.double() - exact_p).abs() <= bound_p).all())
    for got in (expected_q, blas_q):
        assert bool(((got.double() - exact_q).abs() <= bound_q).all())


def test_all_zero_gradient_gives_zeros_and_the_iteration_recovers(drawn):
    """A zero gradient decodes to zeros (not NaN) and leaves a zero mean Q; the next step redraws it,
    so a rank-1 gradient whose first row is zero (where QR's completion e₁ would find nothing) is still
    recovered: exactly, up to float32 rounding (not stuck at zero: an NMSE of 1)."""
    c = gradpress.make("powersgd")
    zeros = torch.zeros(30, 20)
    assert torch.equal(c.decompress(c.compress(zeros)), zeros)
    sim = gradpress.Simulator("powersgd", 2, feedback="none")
    assert torch.equal(sim.step([zeros, zeros]), zeros)
    assert not warm_start(sim)[0].any()
    u = randn(30, 1, seed=3)
    u[0] = 0
    matrix = u @ randn(1, 20, seed=4)
    drawn.clear()
    out = sim.step([matrix, matrix])
    assert drawn  # the zero warm start was redrawn (from the shared stream: the same Q on every worker)
    # The bound is eps·(n·κ + O(m)): κ = |v|·|q| / |v·q| is the cancellation in P = M q = u (v·q), large
    # when the drawn q is nearly orthogonal to v (here κ ≈ 344: about 5e-4 relative, 2e-7 in NMSE; one
    # CPU's BLAS measured 5e-11, the other order of its additions may cost more, never past the bound).
    bound = recovery_bound([matrix, matrix], drawn[-1])
    assert nmse(out, matrix) <= bound**2, bound


def test_state_round_trip_keeps_the_warm_start():
    grads = [[{"w": randn(20, 16, seed=10 * s + w)} for w in range(2)] for s in range(4)]
    sim = gradpress.Simulator("powersgd:rank=2", 2, seed=1)
    for step in grads[:2]:
        sim.step(step)
    saved = sim.state_dict()
    assert saved[0]["compressor"]["warm"]["w"].shape == (2, 16)  # Qᵀ: r × n
    expected = [sim.step(step)["w"] for step in grads[2:]]
    resumed = gradpress.Simulator("powersgd:rank=2", 2, seed=1)
    resumed.load_state_dict(saved)
    assert all(torch.equal(resumed.step(step)["w"], e) for step, e in zip(grads[2:], expected, strict=True))
    # without the warm start the same steps give other bits: the state carried something
    fresh = gradpress.Simulator("powersgd:rank=2", 2, seed=1)
    fresh.load_state_dict([{**s, "compressor": {"warm": {}}} for s in saved])
    assert not torch.equal(fresh.step(grads[2])["w"], expected[0])
    with pytest.raises(ValueError, match="float32 matrix"):
        PowerSGD().load_state_dict({"warm": {"w": torch.ones(3)}})


# -- shapes, dtypes, parameters -----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_shapes_dtypes_and_what_goes_uncompressed(dtype):
    c = gradpress.make("powersgd")
    conv = randn(16, 3, 3, 3, seed=1).to(dtype)  # a 16 × 27 matrix
    packet = c.compress(conv, Context(key="conv"))
    assert [t.dtype for t in packet.wire()] == [torch.float32, torch.float32]
    assert packet.nbytes == c.nbytes_for(conv.shape, dtype) == (16 + 27) * 4
    out = c.decompress(packet)
    assert out.shape == conv.shape and out.dtype == dtype
    # 1-D, and a matrix too small to gain min_compression_rate = 2: sent as they are
    for small in (randn(50, seed=2).to(dtype), randn(3, 4, seed=3).to(dtype)):
        packet = c.compress(small)
        assert packet.nbytes == c.nbytes_for(small.shape, dtype) == small.numel() * small.element_size()
        assert torch.equal(c.decompress(packet), small)
    forced = gradpress.make("powersgd:min_compression_rate=0,rank=5")
    assert forced.factors((3, 4)) == (3, 4, 3)  # r lowered to min(m, n): exact
    small = randn(3, 4, seed=3)
    # P̂ spans all of R^m whatever P's conditioning: Householder QR's orthogonality γ_{2mr} (Higham
    # Thm 19.4) and the products Q = Mᵀ P̂ (m) and P̂ Qᵀ (r), γ·√r each relative to ‖M‖_F (tests/numerics.py)
    m, r = 3, 3
    atol = (gamma(2 * m * r) + (gamma(m + 1) + gamma(r + 1)) * r**0.5 + unit_roundoff()) * float(small.norm())
    torch.testing.assert_close(forced.decompress(forced.compress(small)), small, rtol=0, atol=atol)


def test_parameters_are_checked():
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        gradpress.make("powersgd:rank=0")
    with pytest.raises(ValueError, match="min_compression_rate"):
        gradpress.make("powersgd:min_compression_rate=-1")
    assert gradpress.make("powersgd:rank=2,warm_start=false").spec == "powersgd:rank=2,warm_start=false"
    assert gradpress.make("powersgd").default_feedback == "residual"


# -- NaN/Inf: found in the summed P, not by a pass over M ---------------------------------------------
@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_entry_anywhere_reaches_p_and_raises(rank, bad):
    """checks_finite: PowerSGD reads no pass over M for NaN/Inf but looks at P = M Q. One bad entry at any
    position raises, also in a column where the warm-start Q is zero (Inf·0 = NaN·0 = NaN) and in a
    row of M that is otherwise zero."""
    m, n = 24, 20
    q = randn(rank, n, seed=7)
    q[:, 3] = 0.0  # every column of Q is zero at position 3
    q[0, 11] = 0.0
    assert PowerSGD.checks_finite
    for i, j in [(0, 0), (m - 1, n - 1), (5, 3), (17, 11), (9, 3), (0, n - 1), (m - 1, 0)]:
        c = PowerSGD(rank=rank)
        c.load_state_dict({"warm": {"w": q}})
        x = randn(m, n, seed=i * n + j)
        x[9] = 0.0
        x[i, j] = bad
        with pytest.raises(gradpress.NonFiniteError, match="NaN/Inf"):
            c.compress(x, Context(key="w"))
    # the uncompressed tensors are checked as they are
    for small in (randn(30, seed=1), randn(3, 4, seed=2)):
        small[1] = bad
        with pytest.raises(gradpress.NonFiniteError, match="NaN/Inf"):
            PowerSGD(rank=rank).compress(small)


def test_one_workers_nan_raises_on_every_worker():
    """Through the runtime: the bad value of one worker reaches the P all workers share, so the step
    raises (rather than decoding NaN into every worker's gradient)."""
    sim = gradpress.Simulator("powersgd", 2, feedback="none")
    good = randn(24, 20, seed=1)
    bad = good.clone()
    bad[4, 6] = float("nan")
    with pytest.raises(gradpress.NonFiniteError, match="NaN/Inf"):
        sim.step([good, bad])


def _overflow_on_rank_one(rank: int, world_size: int) -> list:
    comm = gradpress.Communicator("powersgd", seed=3, feedback="none")
    good = randn(24, 20, seed=rank)
    huge = good.clone()
    huge[3] = 3e38  # finite, but P = M Q overflows float32
    outcomes = []
    for grad in (good, huge if rank == 1 else good):
        try:
            outcomes.append(("ok", comm.reduce_many({"w": grad})["w"]))
        except (OverflowError, gradpress.NonFiniteError) as error:
            outcomes.append((type(error).__name__, str(error)))
    return outcomes


def test_a_p_that_overflows_on_one_worker_raises_on_every_worker():
    """A finite gradient whose P overflows float32 on one worker: the Inf reaches the summed P every worker
    holds, so every worker raises an OverflowError at the same point — that worker saying its own M Q
    overflowed, the others that another worker's did (never a NonFiniteError: every gradient is finite)
    — rather than that worker alone raising before the preliminary exchange while the others wait in it."""
    first, second = run_workers(_overflow_on_rank_one, 2, timeout=60, group_timeout=30)
    assert first[0][0] == second[0][0] == "ok" and torch.equal(first[0][1], second[0][1])
    assert first[1][0] == "OverflowError" and "another worker's M Q" in first[1][1]
    assert second[1][0] == "OverflowError" and "this worker's M Q overflowed" in second[1][1]


# -- PyTorch's powerSGD_hook beside ours on Gloo ------------------------------------------------------
WIDTHS = (784, 512, 512, 10)
STEPS = 8
TORCH_DEADLINE = 10.0  # seconds for PyTorch's hook to take its STEPS steps (it needs well under 1 s)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _train(rank: int, ddp: nn.Module, averaged: list | None = None, local: list | None = None) -> None:
    """SGD steps on fixed batches; ``local`` gets a new dict per step (the hook fills it), ``averaged`` the
    gradients each step ends with."""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(STEPS):
        x = randn(8, WIDTHS[0], seed=100 * rank + step)
        optimizer.zero_grad()
        if local is not None:
            local.append({})
        ddp(x).square().mean().backward()
        if averaged is not None:
            averaged.append({n: p.grad.clone() for n, p in ddp.module.named_parameters()})
        optimizer.step()


def _give_up(path: str) -> None:
    torch.save(f"hung for {TORCH_DEADLINE} s", path)
    os._exit(0)


def _ours_then_torchs(rank: int, world_size: int, path: str) -> None:
    """Ours on a 3-layer MLP in several DDP buckets, recording each bucket's local gradients and the
    averages, saved before PyTorch's hook runs on the same model and buckets (it may abort the process)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    model = _model()
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    state, hook = gradpress.ddp_comm_hook("powersgd", model=model, seed=3)
    local: list[dict] = []

    def recording(state, bucket):  # noqa: ANN001, ANN202 - DDP checks the hook's annotations
        for p, g in zip(bucket.parameters(), bucket.gradients(), strict=True):
            local[-1][names[id(p)]] = g.detach().clone()
        local[-1].setdefault("buckets", 0)
        local[-1]["buckets"] += 1
        return hook(state, bucket)

    ddp.register_comm_hook(state, recording)
    averaged: list[dict] = []
    _train(rank, ddp, averaged, local)
    buckets = [step.pop("buckets") for step in local]
    torch.save({"local": local, "averaged": averaged, "buckets": buckets}, f"{path}.ours.{rank}")

    # a hook blocked in Gloo's callbacks can wait forever (no thread left to run the collective it
    # waits for), below any timeout: a watchdog records that and ends the process
    watchdog = threading.Timer(TORCH_DEADLINE, _give_up, (f"{path}.torch.{rank}",))
    watchdog.daemon = True
    watchdog.start()
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1)
    # start_powerSGD_iter=2: the earliest PyTorch allows with error feedback and warm start
    torch_state = torch_powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                               start_powerSGD_iter=2)
    ddp.register_comm_hook(torch_state, torch_powersgd.powerSGD_hook)
    try:
        _train(rank, ddp)
        outcome = "completed"
    except Exception as error:  # noqa: BLE001 - the test reports it
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    torch.save(outcome, f"{path}.torch.{rank}")
    os._exit(0)  # a failed hook can leave Gloo threads blocked in its callbacks: do not wait for them


def test_torchs_hook_fails_on_gloo_where_ours_runs(tmp_path):
    """A plain 3-layer MLP, 2 Gloo processes, DDP buckets of at most 1 MB (two, once DDP has rebuilt
    them). PyTorch's hook issues its P and Q all-reduces from completion callbacks on Gloo's threads, so
    the ranks' collectives of different buckets interleave in different orders, or every Gloo thread
    blocks in a callback. Measured: one process aborts with "Received data size doesn't match expected
    size" and its peer fails with a connection error, or both hang; with 4 steps it completed in 3 of 19
    runs, hence 8 steps (if it completes all the same, this test xfails). Ours issues its rounds at points that are the same on every rank:
    bit-identical on both ranks and equal to ``simulate``."""
    path = str(tmp_path / "run")
    run_workers(_ours_then_torchs, 2, path, timeout=120, group_timeout=6, may_exit=frozenset({0, 1}))
    ours = [torch.load(f"{path}.ours.{r}", weights_only=False) for r in range(2)]
    assert min(ours[0]["buckets"][1:]) >= 2  # several buckets once DDP has rebuilt them
    simulator = gradpress.Simulator("powersgd", 2, seed=3)
    for step in range(STEPS):
        expected = simulator.step([run["local"][step] for run in ours])
        for name, value in ours[0]["averaged"][step].items():
            assert torch.equal(ours[1]["averaged"][step][name], value), (step, name)
            assert torch.equal(expected[name], value), (step, name)
    files = [Path(f"{path}.torch.{r}") for r in range(2)]
    outcomes = [torch.load(f, weights_only=False) if f.exists() else "died (no outcome written)" for f in files]
    if outcomes == ["completed", "completed"]:
        pytest.xfail("PyTorch's hook completed this time: its failure is a race between Gloo threads")
