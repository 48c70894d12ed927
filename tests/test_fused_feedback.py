"""Issue 12's fused error feedback: φ = β·m + γ·g formed by the compressor's first pass
(:meth:`gradpress.core.compressor.Compressor.compress_sum`, or :meth:`~gradpress.core.compressor.Compressor.prepare_sum`
for a method with a preliminary exchange) gives the bits of the sum, then ``compress``, and leaves φ in
the buffer the memory's update reads, on every path of top-k's sampled selection, in signSGD's packing
pass (SIGNUM's momentum) and in THC's norm."""
from __future__ import annotations

import math

import pytest
import torch

import gradpress
from gradpress.compressors.sparsify import sample_stride
from gradpress.core.compressor import NonFiniteError, scaled_sum
from gradpress.core.feedback import compress_with
from gradpress.core.rng import Context
from gradpress.kernels.jit import numba_disabled


def _pair(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 0.1, torch.randn(n, generator=g)


def _both(spec: str, memory: torch.Tensor, grad: torch.Tensor, beta: float = 1.0, gamma: float = 1.0):
    c = gradpress.make(spec)
    ctx = Context(3, 1, "w", 0)
    out = torch.full_like(memory, float("nan"))
    fused = c.compress_sum(memory, grad, out, ctx, beta, gamma)
    expected_sum = memory * beta + grad * gamma
    plain = c.compress(expected_sum, ctx)
    return fused, plain, out, expected_sum


def _same(a, b) -> None:
    assert a.tensors.keys() == b.tensors.keys() and a.shape == b.shape and a.dtype == b.dtype
    for name in a.tensors:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("n", [65536, 100_003, 1 << 20])
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.001", "topk:ratio=0.3"])
def test_topk_of_the_sum_formed_in_its_pass_is_topk_of_the_sum(spec, n):
    memory, grad = _pair(n, n)
    fused, plain, out, expected_sum = _both(spec, memory, grad)
    _same(fused, plain)
    assert torch.equal(out, expected_sum)


def test_every_fallback_leaves_the_sum_formed():
    n = 1 << 17
    # (a) the sample misses the large values (none at a multiple of the stride): more candidates than the
    # first buffer holds, so the fused pass overflows it, sums to the end, and the plain pass retries
    memory, grad = _pair(n, 1)
    spots = torch.arange(n) % sample_stride(n) == 1
    grad[spots] *= 1000
    fused, plain, out, expected_sum = _both("topk:ratio=0.05", memory, grad)
    _same(fused, plain)
    assert torch.equal(out, expected_sum)
    # (b) a sum that is zero almost everywhere: the sampled threshold is 0, the full top-k runs on φ
    memory = -grad.clone()
    memory[:100] += 1.0
    fused, plain, out, expected_sum = _both("topk:ratio=0.01", memory, grad)
    _same(fused, plain)
    assert torch.equal(out, expected_sum)


@pytest.mark.parametrize("where", [0, 5, 77_777])  # in the sample (stride 11), or not
def test_nonfinite_in_the_gradient_raises_with_the_sum_formed(where):
    memory, grad = _pair(1 << 17, 2)
    grad[where] = float("inf")
    out = torch.empty_like(memory)
    with pytest.raises(NonFiniteError, match="NaN/Inf"):
        gradpress.make("topk:ratio=0.01").compress_sum(memory, grad, out, Context())
    assert torch.equal(out, memory + grad)


def test_the_default_adds_then_compresses():
    memory, grad = _pair(1000, 3)
    fused, plain, out, expected_sum = _both("efsignsgd", memory, grad)
    _same(fused, plain)
    assert torch.equal(out, expected_sum)


FACTORS = [(1.0, 1.0), (0.9, 1.0 - 0.9), (0.5, 1.0), (1.0, 0.3), (0.99, 2.5)]


@pytest.mark.parametrize("beta, gamma", FACTORS)
@pytest.mark.parametrize("numba", [True, False])
def test_the_scaled_sum_has_torchs_bits(beta, gamma, numba):
    memory, grad = _pair(100_003, 4)
    out = torch.full_like(memory, float("nan"))
    if numba:
        scaled_sum(memory, grad, beta, gamma, out)
    else:
        with numba_disabled():
            scaled_sum(memory, grad, beta, gamma, out)
    assert torch.equal(out, memory * beta + grad * gamma)


@pytest.mark.parametrize("n", [1, 63, 64, 1000, 4096 + 65, 100_003])
@pytest.mark.parametrize("beta, gamma", FACTORS)
@pytest.mark.parametrize("spec", ["signsgd", "signum"])
def test_signs_of_the_sum_formed_in_the_packing_pass_are_the_signs_of_the_sum(spec, beta, gamma, n):
    memory, grad = _pair(n, n)
    fused, plain, out, expected_sum = _both(spec, memory, grad, beta, gamma)
    _same(fused, plain)
    assert torch.equal(out, expected_sum)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "efsignsgd", "fp16"])
def test_other_factors_fall_back_to_the_scaled_sum(spec):
    memory, grad = _pair(100_003, 6)
    fused, plain, out, expected_sum = _both(spec, memory, grad, 0.9, 0.5)
    _same(fused, plain)
    assert torch.equal(out, expected_sum)


@pytest.mark.parametrize("where", [0, 4096 + 3, 100_002])  # first block, a later one, the tail
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_in_the_momentum_raises_with_the_sum_formed(where, bad):
    memory, grad = _pair(100_003, 7)
    grad[where] = bad
    out = torch.empty_like(memory)
    with pytest.raises(NonFiniteError, match="NaN/Inf"):
        gradpress.make("signum").compress_sum(memory, grad, out, Context(), 0.9, 0.1)
    torch.testing.assert_close(out, memory * 0.9 + grad * 0.1, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("spec, memory_spec", [("signum", "signum"), ("signum", "signum:momentum=0.5"),
                                               ("topk:ratio=0.01", "residual"), ("efsignsgd", "residual"),
                                               ("randomk:ratio=0.05", "residual"),
                                               ("topk:ratio=0.01", "residual:beta=0.9"),
                                               ("efsignsgd", "residual:beta=0.5,gamma=2")])
def test_the_runtime_with_scaled_feedback_equals_compensate_compress_update(spec, memory_spec):
    """Three steps of 2 simulated workers with a memory whose φ = β·m + γ·g, against the memory's own
    compensate / compress / update_from on each worker (and :func:`compress_with`, the runtime's order)."""
    n, workers, steps = 70_000, 2, 3
    sim = gradpress.Simulator(spec, workers, seed=5, feedback=memory_spec)
    memories = [gradpress.make_feedback(memory_spec) for _ in range(workers)]
    fused = [gradpress.make_feedback(memory_spec) for _ in range(workers)]
    c = gradpress.make(spec)
    for step in range(steps):
        grads = [{"w": _pair(n, 10 * step + r)[1]} for r in range(workers)]
        averaged = sim.step(grads)
        packets = []
        for r in range(workers):
            phi = memories[r].compensate("w", grads[r]["w"])
            packet = c.compress(phi, Context(5, step, "w", r))
            memories[r].update_from("w", phi, packet, c, owned=phi is not grads[r]["w"])
            packets.append(packet)
            _same(compress_with(fused[r], c, "w", grads[r]["w"], Context(5, step, "w", r)), packet)
            assert torch.equal(fused[r].memory("w"), memories[r].memory("w"))
        assert torch.equal(averaged["w"], c.aggregate(packets)), step


# -- the residual formed in the compressor's pass (element-wise methods) ----------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _awkward(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m, g whose sums hit the casts' corners: zeros of both signs, fp16 subnormals and underflow, values
    near fp16's largest, bf16 rounding ties."""
    memory, grad = _pair(n, seed)
    corners = torch.tensor([0.0, -0.0, 1e-8, -3e-5, 6e-8, 2.9e-8, 65504.0, -65519.0, 1.0 + 2**-8, -(1.0 + 3 * 2**-8),
                            1e-40, -1e-39, 1.0e38, 2**-24, 2**-25])
    k = min(n, corners.numel())
    grad[:k], memory[:k] = corners[:k], 0.0
    return memory, grad


@pytest.mark.parametrize("n", [1, 15, 1000, 100_003])
@pytest.mark.parametrize("beta, gamma", FACTORS)
@pytest.mark.parametrize("spec", ["fp16", "bf16", "efsignsgd", "onebit", "onebit:tau=0.5"])
def test_the_residual_formed_in_the_compressors_passes_is_compress_then_residual(spec, beta, gamma, n):
    memory, grad = _awkward(n, n)
    if spec != "bf16":
        grad[grad.abs() > 65000] = 1.0  # φ = 3e38 overflows fp16: that path has a test of its own
    c = gradpress.make(spec)
    out = torch.full_like(memory, float("nan"))
    packet, formed = c.compress_residual_sum(memory, grad, out, Context(), beta, gamma)
    phi = memory * beta + grad * gamma
    plain = c.compress(phi)
    assert formed
    _same(packet, plain)
    assert torch.equal(_bits(out), _bits(c.residual(phi, plain)))


@pytest.mark.parametrize("n", [65536, 100_003, 1 << 20])
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.001", "topk:ratio=0.3"])
def test_topks_residual_formed_in_its_candidate_pass_is_compress_then_residual(spec, n):
    memory, grad = _pair(n, n + 1)
    c = gradpress.make(spec)
    out = torch.full_like(memory, float("nan"))
    packet, formed = c.compress_residual_sum(memory, grad, out, Context(3, 1, "w", 0))
    phi = memory + grad
    plain = c.compress(phi, Context(3, 1, "w", 0))
    assert formed
    _same(packet, plain)
    assert torch.equal(_bits(out), _bits(c.residual(phi, plain)))
    assert int((out == 0).sum()) == packet["values"].numel()  # +0 where sent (nothing else is 0 here)


def test_topks_residual_falls_back_to_the_sum_where_the_sample_misleads():
    """(a) more candidates than the first room holds; (b) a threshold of 0; (c) NaN/Inf outside the sample:
    φ in ``out`` (formed again in full after a pass that zeroed candidates), the packet of the sum."""
    n = 1 << 17
    memory, grad = _pair(n, 1)
    spots = torch.arange(n) % sample_stride(n) == 1  # never sampled
    grad[spots] *= 1000
    c = gradpress.make("topk:ratio=0.05")
    out = torch.full_like(memory, float("nan"))
    packet, formed = c.compress_residual_sum(memory, grad, out, Context())
    assert not formed and torch.equal(out, memory + grad)
    _same(packet, c.compress(memory + grad, Context()))
    memory = -grad.clone()
    memory[:100] += 1.0
    packet, formed = c.compress_residual_sum(memory, grad, out, Context())
    assert not formed and torch.equal(out, memory + grad)
    _same(packet, c.compress(memory + grad, Context()))
    memory, grad = _pair(n, 2)
    grad[77_777] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN/Inf"):
        c.compress_residual_sum(memory, grad, out, Context())
    torch.testing.assert_close(out, memory + grad, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "signum", "qsgd"])
def test_other_methods_leave_the_sum_formed(spec):
    memory, grad = _pair(100_003, 8)
    c = gradpress.make(spec)
    out = torch.full_like(memory, float("nan"))
    packet, formed = c.compress_residual_sum(memory, grad, out, Context(3, 1, "w", 0), 0.9, 1.0)
    assert not formed and torch.equal(out, memory * 0.9 + grad)
    _same(packet, c.compress(out, Context(3, 1, "w", 0)))


_BAD_SUMS = [(spec, bad, error) for spec in ("fp16", "bf16", "efsignsgd", "onebit")
             for bad, error in ((float("nan"), NonFiniteError), (float("inf"), NonFiniteError), (1e5, OverflowError))
             if error is not OverflowError or spec in ("fp16", "bf16")]  # (the sign methods send any finite φ)


@pytest.mark.parametrize("spec, bad, error", _BAD_SUMS)
@pytest.mark.parametrize("where", [0, 4096 + 3, 100_002])
def test_nonfinite_or_overflowing_sums_raise_with_the_sum_formed(spec, where, bad, error):
    if spec == "bf16" and error is OverflowError:
        bad = 3.4e38  # rounds beyond bf16's largest
    memory, grad = _pair(100_003, 9)
    grad[where], memory[where] = bad, 0.0
    out = torch.empty_like(memory)
    with pytest.raises(error):
        gradpress.make(spec).compress_residual_sum(memory, grad, out, Context())
    torch.testing.assert_close(out, memory + grad, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("spec, memory_spec", [("fp16", "residual"), ("bf16", "residual"),
                                               ("bf16", "residual:beta=0.9,gamma=0.5"),
                                               ("signum", "signum:momentum=0.8"), ("topk:ratio=0.02", "residual"),
                                               ("efsignsgd", "residual"), ("efsignsgd", "residual:beta=0.5"),
                                               ("onebit", "residual"), ("onebit:tau=0.5", "residual:gamma=0.5"),
                                               ("threshold:v=1", "residual"), ("threshold", "residual:beta=0.9"),
                                               ("thc", "residual"), ("thc", "residual:beta=0.9,gamma=0.5"),
                                               ("thc_uniform", "residual"), ("powersgd", "residual"),
                                               ("cltk", "residual")])
def test_the_runtime_fused_equals_the_runtime_unfused(spec, memory_spec, monkeypatch):
    """Three steps of 2 simulated workers, and two tensors each, against the same runtime with fusion
    off (every memory's :meth:`sum_parts` None: compensate, compress, update_from): the same means and
    memories, bit for bit."""
    n, workers, steps = 70_000, 2, 3
    runs = []
    for fused in (False, True):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(gradpress.core.feedback.Residual, "sum_parts", lambda self, key, grad: None)
                patch.setattr(gradpress.compressors.sign.SignumMomentum, "sum_parts", lambda self, key, grad: None)
            sim = gradpress.Simulator(spec, workers, seed=5, feedback=memory_spec)
            means = [sim.step([{"w": _pair(n, 10 * step + r)[1], "v": _pair(n, 10 * step + r + 5)[0]}
                               for r in range(workers)]) for step in range(steps)]
            runs.append((means, [p.feedback.state_dict() for p in sim.pipelines]))
    (plain, plain_state), (fused, fused_state) = runs
    for a, b in zip(plain, fused, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for a, b in zip(plain_state, fused_state, strict=True):
        (name, memory), = a.items()
        assert all(torch.equal(_bits(memory[k]), _bits(b[name][k])) for k in memory)


@pytest.mark.parametrize("spec, bad, error", [("fp16", float("nan"), NonFiniteError),
                                              ("efsignsgd", float("inf"), NonFiniteError),
                                              ("onebit", float("nan"), NonFiniteError),
                                              ("fp16", 1e5, OverflowError), ("bf16", float("inf"), NonFiniteError)])
def test_a_failed_step_leaves_the_memory_as_it_was(spec, bad, error):
    """The residual is formed in the key's spare buffer, never in the memory: a step that raises leaves
    the memory of the rank that raised as it was, also for the key compressed before the failing one.
    NaN/Inf (flagged in-band, every rank raises) leave every rank's memory so, and the next steps go on
    as if the failed one had never happened. (The simulator does not unwind the other ranks on an
    ``OverflowError``: rank 0 has updated its memory then, fused or not.)"""
    n, workers = 70_000, 2
    sim, clean = (gradpress.Simulator(spec, workers, seed=5, feedback="residual") for _ in range(2))
    first = [{"w": _pair(n, r)[1], "v": _pair(n, r + 7)[1]} for r in range(workers)]
    sim.step(first), clean.step(first)
    before = [{k: t.clone() for k, t in p.feedback.state_dict()["memory"].items()} for p in sim.pipelines]
    failing = [{"w": _pair(n, 20 + r)[1], "v": _pair(n, 30 + r)[1]} for r in range(workers)]
    failing[1]["v"][123] = bad
    with pytest.raises(error):
        sim.step(failing)
    ranks = range(workers) if error is NonFiniteError else [1]
    for rank in ranks:
        for key, e in before[rank].items():
            assert torch.equal(_bits(sim.pipelines[rank].feedback.memory(key)), _bits(e)), (rank, key)
    if error is not NonFiniteError:
        return
    for step in range(2):
        later = [{"w": _pair(n, 40 + 2 * step + r)[1], "v": _pair(n, 50 + r)[1]} for r in range(workers)]
        got, expected = sim.step(later), clean.step(later)
        assert all(torch.equal(got[k], expected[k]) for k in expected)


# -- threshold-v: the sum formed in the selecting pass ----------------------------------------------------
@pytest.mark.parametrize("n", [1, 1000, 4096 + 70, 100_003])
@pytest.mark.parametrize("beta, gamma", [(1.0, 1.0), (0.9, 0.5)])
@pytest.mark.parametrize("spec", ["threshold", "threshold:v=1", "threshold:v=2.5", "threshold:v=0"])
def test_threshold_of_the_sum_formed_in_its_pass_is_threshold_of_the_sum(spec, beta, gamma, n):
    memory, grad = _pair(n, n + 1)
    grad[::7] = 0.0
    fused, plain, out, expected_sum = _both(spec, memory, grad, beta, gamma)
    _same(fused, plain)
    assert torch.equal(out, expected_sum)


@pytest.mark.parametrize("where", [0, 4096 + 3, 100_002])
def test_nonfinite_in_the_thresholds_sum_raises_with_the_sum_formed(where):
    memory, grad = _pair(100_003, 11)
    grad[where] = float("nan")
    out = torch.empty_like(memory)
    with pytest.raises(NonFiniteError, match="NaN/Inf"):
        gradpress.make("threshold:v=0.5").compress_sum(memory, grad, out, Context())
    torch.testing.assert_close(out, memory + grad, rtol=0, atol=0, equal_nan=True)


# -- THC: the sum formed in the pass that takes its norm (Compressor.prepare_sum) ---------------------------
@pytest.mark.parametrize("n", [1, 17, 4096 + 70, 100_003, (1 << 21) + 5])  # the last stored past the caches
@pytest.mark.parametrize("beta, gamma", [(1.0, 1.0), (0.9, 0.5)])
def test_thcs_norm_of_the_sum_formed_in_its_pass_is_the_norm_of_the_sum(n, beta, gamma):
    memory, grad = _pair(n, n)
    c = gradpress.make("thc")
    ctx = Context(3, 1, "w", 0)
    out = torch.full_like(memory, float("nan"))
    fused = c.prepare_sum(memory, grad, out, ctx, 2, beta, gamma)
    expected_sum = scaled_sum(memory, grad, beta, gamma, torch.empty_like(memory))
    assert torch.equal(_bits(out), _bits(expected_sum))
    plain = c.prepare(expected_sum, ctx, 2)
    assert fused.op == plain.op == "max" and torch.equal(fused.values, plain.values)  # the same bits
    exact = math.fsum(float(v) ** 2 for v in expected_sum.double()) if n < 200_000 else None
    ell = float(fused.values[0])
    if exact is not None:
        assert ell == pytest.approx(math.sqrt(exact), rel=4 * n * 2.0**-53)
    with numba_disabled():  # torch's float64 norm: another order, within float64 rounding
        assert float(c.prepare(expected_sum, ctx, 2).values[0]) == pytest.approx(ell, rel=4 * n * 2.0**-53)


def test_thcs_norm_needs_no_float64_copy_to_be_exact_at_float32s_extremes():
    """Squares of float32 values overflow or underflow float32, never float64: ℓ is right for a tensor of
    3e38s and one of 1e-30s, and NaN/Inf give a NaN/Inf ℓ (the runtime's flag)."""
    c = gradpress.make("thc")
    ctx = Context(3, 1, "w", 0)
    for value in (3e38, 1e-30, -2.5e-42):
        x = torch.full((1000,), value)
        assert float(c.prepare(x, ctx, 1).values[0]) == pytest.approx(abs(float(x[0])) * math.sqrt(1000), rel=1e-12)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1000)
        x[7] = bad
        assert not math.isfinite(float(c.prepare(x, ctx, 1).values[0]))


@pytest.mark.parametrize("where", [0, 69_999])
def test_a_thc_step_that_fails_in_the_norms_pass_leaves_every_memory_as_it_was(where):
    """The sum formed in THC's norm pass goes into the key's spare buffer: NaN in one rank's gradient
    (flagged by its norm, every rank raises) leaves every rank's memory of both keys as it was."""
    n, workers = 70_000, 2
    sim = gradpress.Simulator("thc", workers, seed=5, feedback="residual")
    sim.step([{"w": _pair(n, r)[1], "v": _pair(n, r + 7)[1]} for r in range(workers)])
    before = [{k: t.clone() for k, t in p.feedback.state_dict()["memory"].items()} for p in sim.pipelines]
    failing = [{"w": _pair(n, 20 + r)[1], "v": _pair(n, 30 + r)[1]} for r in range(workers)]
    failing[1]["v"][where] = float("nan")
    with pytest.raises(NonFiniteError):
        sim.step(failing)
    for rank in range(workers):
        for key, e in before[rank].items():
            assert torch.equal(_bits(sim.pipelines[rank].feedback.memory(key)), _bits(e)), (rank, key)
