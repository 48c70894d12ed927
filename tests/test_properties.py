"""Properties every registered compressor keeps (the suite picks up new methods by itself)."""
from __future__ import annotations

import pytest
import torch

import gradpress
from gradpress.compressors.powersgd import PowerSGD
from gradpress.core.rng import Context
from gradpress.kernels.jit import numba_disabled
from numerics import eps, gamma, powersgd_step_error, unit_roundoff
from specs import SPECS, SUMMABLE, UNBIASED

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def gradient(shape=(37, 29), dtype=torch.float32, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1])
    return x.to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_keeps_shape_dtype_device(spec, dtype):
    c = gradpress.make(spec)
    x = gradient(dtype=dtype)
    y = c.decompress(c.compress(x))
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("spec", SPECS)
def test_non_contiguous_input_equals_contiguous_copy(spec):
    c = gradpress.make(spec)
    x = gradient((29, 37)).t()
    assert not x.is_contiguous()
    ctx = Context(seed=3, step=1, key="w")
    y = c.decompress(c.compress(x, ctx))
    z = c.decompress(c.compress(x.contiguous(), ctx))
    assert y.shape == x.shape
    torch.testing.assert_close(y, z, rtol=0, atol=0)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(0,), (3, 0), (1,), (1, 1)], ids=str)
def test_empty_and_one_element(spec, shape):
    c = gradpress.make(spec)
    x = torch.full(shape, -0.75)
    packet = c.compress(x)
    y = c.decompress(packet)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.numel() == 0:
        assert packet.nbytes == 0
    elif c.unbiased:
        # one element: the estimate keeps its sign and stays within the method's range
        assert (y <= 0).all()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_zero_input_gives_zero(spec, dtype):
    c = gradpress.make(spec)
    x = torch.zeros(1000, dtype=dtype)
    assert torch.equal(c.decompress(c.compress(x)), x)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("numel", [1, 7, 1000, 4099])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nbytes_is_the_wire_and_the_formula(spec, numel, dtype):
    c = gradpress.make(spec)
    packet = c.compress(gradient((numel,), dtype=dtype))
    wire = sum(t.numel() * t.element_size() for t in packet.wire())
    assert packet.nbytes == wire
    expected = c.expected_nbytes(numel, dtype)
    if expected is not None:
        assert packet.nbytes == expected


@pytest.mark.parametrize("spec", SPECS)
def test_wire_rebuild_round_trips(spec):
    """A receiver rebuilds a packet from the bare wire tensors plus what it knows statically."""
    c = gradpress.make(spec)
    packet = c.compress(gradient(), Context(step=2))
    rebuilt = packet.with_wire([t.clone() for t in packet.wire()])
    assert torch.equal(c.decompress(rebuilt), c.decompress(packet))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_input_raises(spec, bad, dtype):
    c = gradpress.make(spec)
    x = gradient(dtype=dtype)
    x[5, 7] = bad
    with pytest.raises(gradpress.NonFiniteError, match="NaN/Inf"):
        c.compress(x)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8], ids=str)
def test_wrong_dtype_raises(spec, dtype):
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        gradpress.make(spec).compress(torch.ones(10, dtype=dtype))


@pytest.mark.parametrize("spec", SPECS)
def test_same_context_same_bits_and_global_rng_untouched(spec):
    c = gradpress.make(spec)
    x = gradient()
    ctx = Context(seed=7, step=3, key="layer", rank=1)
    state = torch.get_rng_state()
    a = [t.clone() for t in c.compress(x, ctx).wire()]
    b = list(c.compress(x, ctx).wire())
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numba_and_torch_paths_agree(spec, dtype):
    """The numba kernels give the torch path's bits, except PowerSGD's matrix products: on the CPU its
    kernels add in an order of their own (tests/test_powersgd.py checks their bits against it), where torch's
    path calls BLAS, whose order is its own too. Both are float32 evaluations of the same step, each within
    numerics.powersgd_step_error of the exact one, then rounded to the gradient's dtype."""
    c = gradpress.make(spec)
    x = gradient((300, 300), dtype=dtype)
    ctx = Context(seed=5, step=2, key="k", rank=1)
    fast = c.decompress(c.compress(x, ctx))
    with numba_disabled():
        reference = c.decompress(c.compress(x, ctx))
    if c.name != "powersgd":
        torch.testing.assert_close(fast, reference, rtol=0, atol=0)
        return
    m, n, r = c.factors(x.shape)
    start = PowerSGD._fresh(ctx, n, r, x.device)  # a new compressor's Q: drawn from the shared stream
    bound = 2 * powersgd_step_error([x], start) + 2 * unit_roundoff(dtype) * float(reference.double().norm())
    assert float((fast.double() - reference.double()).norm()) <= bound


@pytest.mark.parametrize("spec", UNBIASED)
def test_unbiased_by_monte_carlo(spec):
    """E[decompress(compress(x))] = x: every element's sample mean within 5 standard errors.

    An outcome of probability ~1/samples may never occur in the draws, leaving a sample variance of 0
    and an error of about its probability times its size; each element is therefore also allowed
    7 · Δ / samples, the 99.9 % Poisson bound on that error, with Δ the element's largest outcome, or
    the largest of the whole tensor for an element never seen away from 0 (0.2 % of Δ: a real bias,
    like rounding always down, is far beyond it; each method's own tests probe its rare cases)."""
    c = gradpress.make(spec)
    x = gradient((64,), seed=4)
    samples = 4000
    total = torch.zeros(64, dtype=torch.float64)
    total_sq = torch.zeros(64, dtype=torch.float64)
    largest = torch.zeros(64, dtype=torch.float64)
    for step in range(samples):
        y = c.decompress(c.compress(x, Context(seed=11, step=step))).double()
        total += y
        total_sq += y * y
        largest = torch.maximum(largest, y.abs())
    mean = total / samples
    std = (total_sq / samples - mean**2).clamp_min(0).sqrt()
    stderr = std / samples**0.5
    error = (mean - x.double()).abs()
    outcome = torch.where(largest > 0, largest, largest.max())
    # and a float32 decode's own rounding: each outcome is rounded a few times (a level times a scale),
    # so its mean may be off by that much more: 4·eps of |x| (E|y| = |x| when y and x share their sign)
    allowed = 5 * stderr + 7 * outcome / samples + 4 * eps(x.dtype) * x.double().abs()
    assert (error <= allowed).all(), (error / allowed).max()


@pytest.mark.parametrize("spec", SUMMABLE)
def test_summable_packets_decode_to_the_sum(spec):
    """An aggregator adds the workers' summands element-wise and decodes once (all-reduce, PS, switch).

    For linear methods that gives the mean of what each worker sent; for the others (count sketches)
    it must at least decode to a finite tensor of the right shape and dtype (their own tests check the
    estimate)."""
    c = gradpress.make(spec)
    xs = [gradient(seed=s) for s in range(3)]
    ctxs = [Context(seed=1, step=4, key="b", rank=r) for r in range(len(xs))]
    packets = [c.compress(x, ctx, **_prepared(c, xs, ctxs)) for x, ctx in zip(xs, ctxs, strict=True)]
    summed = [_sum(ts) for ts in zip(*[c.summands(p) for p in packets], strict=True)]
    mean = c.decode_sum(packets[0], summed, len(packets))
    assert mean.shape == xs[0].shape and mean.dtype == xs[0].dtype and torch.isfinite(mean).all()
    if c.linear:
        decodes = [c.decompress(p).double() for p in packets]
        expected = sum(decodes) / len(packets)
        # In Frobenius norm (tests/numerics.py): the float sum is rounded once to the summands' own float
        # format, if they have one (u of n times the mean); each decode rounds each value a few times: THC
        # four, PowerSGD's P̂ Qᵀ γ_{r+1}·√r ≤ γ_10 for r ≤ 4 (P̂'s columns are orthonormal; elementwise it
        # may cancel), of the aggregate's and of each worker's own decode.
        fmt = [torch.finfo(t.dtype).eps for t in summed if t.dtype.is_floating_point]
        magnitude = float(mean.double().norm()) + sum(float(d.norm()) for d in decodes) / len(decodes)
        bound = 4 * max(fmt, default=0.0) * float(expected.norm()) + gamma(10) * magnitude
        assert float((mean.double() - expected).norm()) <= bound


def _prepared(c, xs, ctxs) -> dict:
    """The combined preliminary values every worker compresses with, as the runtime's preliminary
    exchange gives them (``{}`` for a method without one: each compresses alone)."""
    if not c.prepares:
        return {}
    prelims = [c.prepare(x, ctx, len(xs)) for x, ctx in zip(xs, ctxs, strict=True)]
    first = prelims[0]
    if first is None:
        return {"prepared": None}
    values = torch.stack([pre.values for pre in prelims])
    combine = {"sum": lambda v: v.sum(dim=0), "max": lambda v: v.amax(dim=0), "min": lambda v: v.amin(dim=0),
               "broadcast": lambda v: v[first.src]}
    return {"prepared": combine[first.op](values)}


def _sum(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if tensors[0].dtype == torch.bool:
        return torch.stack(tensors).any(dim=0)
    if not tensors[0].dtype.is_floating_point:
        return torch.stack([t.long() for t in tensors]).sum(dim=0)
    return torch.stack([t.double() for t in tensors]).sum(dim=0).to(tensors[0].dtype)


ELEMENTWISE = [s for s in SPECS if gradpress.make(s).elementwise]


def test_some_methods_are_elementwise():
    """The ``elementwise`` fact is declared by some methods (the casts and ``none``); each one declaring
    it is held to it by the test below."""
    assert ELEMENTWISE


@pytest.mark.parametrize("spec", ELEMENTWISE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_elementwise_packet_of_a_concatenation_is_the_concatenation(spec, dtype):
    """What lets the runtime exchange a DDP bucket's gradients as one tensor: the same wire bits and
    the same decoded sums, whatever the split and whatever the keys."""
    c = gradpress.make(spec)
    parts = [gradient((5, 7), dtype, seed=1), gradient((13,), dtype, seed=2), gradient((2, 3), dtype, seed=3)]
    whole = torch.cat([p.reshape(-1) for p in parts])
    one = c.compress(whole, Context(seed=1, step=0, key="bucket"))
    each = [c.compress(p, Context(seed=2, step=5, key=f"p{i}", rank=1)) for i, p in enumerate(parts)]
    for name, wire in one.tensors.items():
        assert torch.equal(wire, torch.cat([e[name].reshape(-1) for e in each])), name
    summed = [2 * t for t in c.summands(one)]
    mean = c.decode_sum(one, summed, 2)
    expected = [c.decode_sum(e, [2 * t for t in c.summands(e)], 2).reshape(-1) for e in each]
    assert torch.equal(mean, torch.cat(expected))


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trips(spec):
    c = gradpress.make(spec)
    assert gradpress.make(c.spec).spec == c.spec
    assert repr(c) == f"gradpress.make({c.spec!r})"


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_residual_and_accumulate_equal_their_dense_formulas(spec, dtype):
    """``residual`` (error feedback's x − C⁻¹(C(x))) and ``accumulate`` (the all-gather sum) give the
    bits of their dense formulas, whether or not ``x`` may be overwritten; an x not owned is left alone."""
    c = gradpress.make(spec)
    xs = [gradient(seed=s, dtype=dtype) for s in range(2)]
    ctxs = [Context(seed=1, step=2, key="r", rank=r) for r in range(len(xs))]
    packets = [c.compress(x, ctx, **_prepared(c, xs, ctxs)) for x, ctx in zip(xs, ctxs, strict=True)]
    x, packet = xs[0], packets[0]
    expected = x.float() - c.decompress(packet).float()
    kept = x.clone()
    assert torch.equal(c.residual(x, packet).view(x.shape), expected) and torch.equal(x, kept)
    assert torch.equal(c.residual(x.float().clone(), packet, owned=True).view(x.shape), expected)
    total, dense = torch.zeros(x.numel()), torch.zeros(x.numel())
    for p in packets:
        c.accumulate(total, p)
        dense += c._decompress(p).float().reshape(-1)  # as aggregate() decodes: before the cast to x.dtype
    assert torch.equal(total, dense)
