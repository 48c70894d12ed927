"""Issue 12's fused error feedback: φ = m + g formed by the compressor's first pass
(:meth:`gradpress.compressor.Compressor.compress_sum`) gives the bits of the sum, then ``compress``,
and leaves φ in the buffer the memory's update reads, on every path of top-k's sampled selection."""
from __future__ import annotations

import pytest
import torch

import gradpress
from gradpress.compressor import NonFiniteError
from gradpress.rng import Context


def _pair(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * 0.1, torch.randn(n, generator=g)


def _both(spec: str, memory: torch.Tensor, grad: torch.Tensor):
    c = gradpress.make(spec)
    ctx = Context(3, 1, "w", 0)
    out = torch.full_like(memory, float("nan"))
    fused = c.compress_sum(memory, grad, out, ctx)
    expected_sum = memory + grad
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
    stride = n // 16384
    spots = torch.arange(n) % stride == 1
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


@pytest.mark.parametrize("where", [0, 5, 77_777])  # in the sample (stride 8), or not
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


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "efsignsgd", "randomk:ratio=0.05"])
def test_the_runtime_with_fused_feedback_equals_compensate_compress_update(spec):
    """Three steps of 2 simulated workers with the residual memory, against the memory's own
    compensate / compress / update_from on each worker and the mean of the decoded packets."""
    n, workers, steps = 70_000, 2, 3
    sim = gradpress.Simulator(spec, workers, seed=5, feedback="residual")
    memories = [gradpress.make_feedback("residual") for _ in range(workers)]
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
        assert torch.equal(averaged["w"], c.aggregate(packets)), step
