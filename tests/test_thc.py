"""THC (Li et al., NSDI'24): uniform THC (Algorithm 1) and THC (Algorithms 2 and 3)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

import gradpress
from gradpress.compressors.thc_table import table_error
from gradpress.core.rng import Context
from gradpress.kernels.bits import unpack_bits
from numerics import eps, gamma, rht_residual_error, unit_roundoff

PUBLISHED = (0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30)  # (b, g, p) = (4, 30, 1/32)


def vectors(n: int, numel: int = 3000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * torch.logspace(-2, 1, numel) for _ in range(n)]


def prepared(c, xs, ctxs) -> torch.Tensor:
    """The combined preliminary values (both methods combine by max)."""
    prelims = [c.prepare(x, ctx, len(xs)) for x, ctx in zip(xs, ctxs, strict=True)]
    assert all(p.op == "max" for p in prelims)
    return torch.stack([p.values for p in prelims]).amax(dim=0)


def compress_all(c, xs, seed=0, step=0, key="w"):
    """Every worker's packet, compressed with the combined preliminary values, as the runtime does."""
    ctxs = [Context(seed, step, key, r) for r in range(len(xs))]
    shared = prepared(c, xs, ctxs)
    return [c.compress(x, ctx, prepared=shared) for x, ctx in zip(xs, ctxs, strict=True)]


def server(c, packets, arrived) -> torch.Tensor:
    """A parameter server that looks up and adds the summands of the workers in ``arrived`` only (THC
    Section 6's partial aggregation) and decodes with their count."""
    total = sum(c.summands(packets[r])[0].long() for r in arrived)
    return c.decode_sum(packets[0], [total], len(arrived))


def nmse(estimate: torch.Tensor, x: torch.Tensor) -> float:
    return float((estimate.double() - x.double()).square().sum() / x.double().square().sum())


def decode_rounding(out: torch.Tensor, decodes: list[torch.Tensor]) -> torch.Tensor:
    """How far decoding a sum may lie from the mean of the workers' own decodes, elementwise: they agree in
    exact arithmetic (Definition 3), and each float32 decode is its exact value rounded at most four times
    (THC: the butterflies on integers and half-integers are exact, then a rounded 1/√n and 2M/(g·n) and
    their products; uniform THC: float64, then one rounding), γ_4 of each (tests/numerics.py)."""
    return gamma(4) * (out.double().abs() + sum(d.double().abs() for d in decodes) / len(decodes))


# -- facts -------------------------------------------------------------------------------------------------
def test_facts_and_the_published_table():
    c = gradpress.make("thc")
    assert (c.bits, c.granularity, c.p, c.partition) == (4, 30, 1 / 32, 2**20)
    assert c.table == PUBLISHED and c.max_summand == 30
    assert c.t_p == pytest.approx(2.1539, abs=1e-4)
    assert c.summable and c.linear and not c.unbiased and c.default_feedback == "residual"
    assert c.downstream_bits(8) == 8 and c.downstream_bits(9) == 9  # ⌈log2(g·n + 1)⌉
    u = gradpress.make("thc_uniform")
    assert u.unbiased and u.summable and u.max_summand == 15 and u.default_feedback == "none"


@pytest.mark.parametrize("spec", ["thc:bits=0", "thc:bits=9", "thc:granularity=14", "thc:p=0", "thc:p=1",
                                  "thc:partition=0", "thc_uniform:bits=0", "thc_uniform:bits=9"])
def test_bad_parameters_raise(spec):
    with pytest.raises(ValueError):
        gradpress.make(spec)


# -- uniform THC ---------------------------------------------------------------------------------------------
def test_uniform_thc_is_algorithm_1():
    """Global min/max (lines 1-4), codes on 2^b uniform levels (line 5), their sum decoded (line 9)."""
    n, c = 3, gradpress.make("thc_uniform:bits=3")
    xs = vectors(n)
    lo, hi = min(float(x.min()) for x in xs), max(float(x.max()) for x in xs)
    assert prepared(c, xs, [Context(rank=r) for r in range(n)]).tolist() == [-lo, hi]
    packets = compress_all(c, xs, seed=4, key="")
    codes = [unpack_bits(p["codes"], 3, 3000).long() for p in packets]
    assert all(torch.equal(c.summands(p)[0].long(), k) for p, k in zip(packets, codes, strict=True))
    step = (hi - lo) / 7
    # decoded in float64 (a few roundings of its u, γ_4 of the terms), then rounded once to float32 (u)
    def rounding(level: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return unit_roundoff() * level.abs() + gamma(4, torch.float64) * (abs(lo) + k.double() * step)

    for x, k, p in zip(xs, codes, packets, strict=True):
        own = c.decompress(p).double()
        level = lo + k.double() * step
        assert ((own - level).abs() <= rounding(level, k)).all()
        assert ((own - x.double()).abs() <= step + rounding(level, k)).all()  # rounded to a neighbouring level
    out = gradpress.simulate("thc_uniform:bits=3", xs, seed=4)
    expected = lo + sum(codes).double() / n * step
    assert ((out.double() - expected).abs() <= rounding(expected, sum(codes) / n)).all()
    assert (out.double() - sum(xs).double() / n).abs().max() <= step


# -- THC -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("numel", "partition", "padded"),
                         [(3000, 2**20, 4096), (4096, 2**20, 4096), (5000, 1024, 5 * 1024), (1, 2**20, 1)])
def test_wire_holds_b_bit_table_indices_of_the_padded_transform(numel, partition, padded):
    c = gradpress.make(f"thc:partition={partition}")
    x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    # ℓ: the float32 norm the worker sends (Algorithm 3 line 8), summed in the order of this CPU's kernel
    ell = float(torch.linalg.vector_norm(x, dtype=torch.float32))
    packet = c.compress(x, Context(seed=2))
    assert c.coded(numel) == padded == packet.meta["rht"].padded_numel
    assert packet.nbytes == math.ceil(4 * padded / 8) == c.expected_nbytes(numel)
    z = unpack_bits(packet["codes"], 4, padded).long()
    assert torch.equal(c.summands(packet)[0].long(), torch.tensor(PUBLISHED)[z])
    assert packet.meta["M"] == pytest.approx(c.t_p * ell / math.sqrt(padded), rel=eps())  # rounded to float32


def _truncation_error(t: float) -> float:
    """E[(|a| − t)²; |a| > t] for a standard normal a."""
    return 2 * ((1 + t * t) * norm.sf(t) - t * norm.pdf(t))


@pytest.mark.parametrize(("spec", "workers"),
                         [("thc", 1), ("thc", 4), ("thc:bits=2,granularity=8,p=1/512", 1)])
def test_error_is_the_tables_error_plus_truncation(spec, workers):
    """Section 5.2: after the RHT a coordinate is ~ N(0, ‖x‖²/d); quantized on [−t_p, t_p]·σ it costs
    the table's error, truncated outside it (a bias, which does not average out); the workers'
    private rounding errors are independent, so n workers divide the first part by n."""
    c = gradpress.make(spec)
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3))
    packets = compress_all(c, [x] * workers, seed=5)
    estimate = server(c, packets, range(workers))
    expected = table_error(c.table, c.granularity, c.p) / workers + _truncation_error(c.t_p)
    assert nmse(estimate, x) == pytest.approx(expected, rel=0.05)


def test_decoding_the_sum_is_the_mean_of_the_decodes():
    """Definition 3 (homomorphism), up to float32 rounding, for all workers and for any subset."""
    c = gradpress.make("thc:partition=1024")
    xs = vectors(5)
    packets = compress_all(c, xs, seed=1)
    decodes = [c.decompress(p).double() for p in packets]
    for arrived in ([0, 1, 2, 3, 4], [1, 3], [4]):
        mean = sum(decodes[r] for r in arrived) / len(arrived)
        out = server(c, packets, arrived)
        assert ((out.double() - mean).abs() <= decode_rounding(out, [decodes[r] for r in arrived])).all()


def test_signs_shared_rounding_private():
    c = gradpress.make("thc")
    x = vectors(1)[0]
    a, b = (c.compress(x, Context(seed=1, step=2, key="w", rank=r)) for r in (0, 1))
    assert torch.equal(a.meta["rht"].signs, b.meta["rht"].signs)  # the shared ±1 diagonal
    assert not torch.equal(a["codes"], b["codes"])  # independent rounding noise
    again = c.compress(x, Context(seed=1, step=2, key="w", rank=0))
    assert torch.equal(a["codes"], again["codes"])
    other_step = c.compress(x, Context(seed=1, step=3, key="w", rank=0))
    assert not torch.equal(a.meta["rht"].signs, other_step.meta["rht"].signs)


@pytest.mark.parametrize("spec", ["thc", "thc_uniform"])
def test_runtime_equals_the_algorithm_in_every_mode(spec):
    """simulate (all-reduce, parameter server, switch) gives bit for bit the decoded sum of the table
    values of packets compressed with the combined preliminary values."""
    n = 3
    xs = vectors(n)
    c = gradpress.make(spec)
    expected = server(c, compress_all(c, xs, seed=7, key=""), range(n))
    for mode in ("collective", "ps", "switch"):
        assert torch.equal(gradpress.simulate(spec, xs, seed=7, mode=mode), expected), mode


def test_sums_of_more_than_8_workers_widen_or_raise():
    """g·n = 270 > 255 for 9 workers: the switch sums in int32 (downstream ⌈log2 271⌉ = 9 bits), never
    wrapping the uint8 table values; overflow="raise" refuses. Upstream, the switch receives the packed
    4-bit indices and looks the table values up itself (Fig. 4)."""
    xs = vectors(9, numel=512)
    sim = gradpress.Simulator("thc", 9, mode="switch")
    out = sim.step(xs)
    c = gradpress.make("thc")
    assert torch.equal(out, server(c, compress_all(c, xs, key=""), range(9)))
    stats = sim.stats()[1]["last"]
    norm = 2 * 8 * (1 + 9) * 8 // 9  # the preliminary max of one float64 and 9 fault-flag slots (ring all-reduce)
    assert stats["packet_bytes"] == 256  # 4 bits per value ...
    assert stats["sent_bytes"] == 256 + norm  # ... is what a worker sends to the switch
    assert stats["received_bytes"] == 512 * 4 + norm  # int32 sums come back
    with pytest.raises(OverflowError):
        gradpress.simulate("thc", xs, mode="switch", overflow="raise")


@pytest.mark.parametrize("mode", ["ps", "switch"])
def test_the_server_receives_b_bit_indices_and_sends_sums(mode):
    """THC Fig. 4: workers send the packed 4-bit table indices (not the 8-bit table values), the server
    looks them up and adds; 30·4 = 120 fits uint8, so the sums come back in 8 bits per value."""
    n, numel, root = 4, 1024, 2
    sim = gradpress.Simulator("thc", n, mode=mode, root=root)
    sim.step(vectors(n, numel=numel))
    norm = 2 * 3 * (1 + n) * 8 // 4  # the preliminary max of one float64 and n fault-flag slots (ring all-reduce)
    for rank, report in enumerate(sim.stats()):
        last = report["last"]
        assert last["packet_bytes"] == numel // 2
        traffic = (last["sent_bytes"] - norm, last["received_bytes"] - norm)
        assert traffic == (((n - 1) * numel, (n - 1) * numel // 2) if rank == root else (numel // 2, numel))


def test_error_feedback_is_algorithm_3_line_21():
    """e_i ← x_i − RHT⁻¹(X_i): the residual memory holds x minus the decode of the worker's own packet
    (from the second step formed during compression, in the compensated tensor's storage: the same up
    to the transforms' rounding)."""
    n, c = 2, gradpress.make("thc")
    steps = [vectors(n, seed=s) for s in range(2)]
    sim = gradpress.Simulator("thc", n, seed=3)
    memory = [torch.zeros(3000) for _ in range(n)]
    for step, xs in enumerate(steps):
        sim.step(xs)
        compensated = [x + m for x, m in zip(xs, memory, strict=True)]
        packets = compress_all(c, compensated, seed=3, step=step, key="")
        decoded = [c.decompress(p).double() for p in packets]
        for r in range(n):
            held = sim.pipelines[r].feedback.memory("").double()
            expected = compensated[r].double() - decoded[r]
            if step == 0:  # compensated is the gradient: the decoding's output pass subtracts, the same bits
                assert torch.equal(held, (compensated[r] - c.decompress(packets[r])).double())
            else:  # formed in the compression from the rotated values: 2·log2(d) stages' rounding
                bound = rht_residual_error(4096, compensated[r], decoded[r])
                assert float((held - expected).norm()) <= bound
        # the next step from the simulator's own memories: each comparison carries one step's rounding
        memory = [pipeline.feedback.memory("").clone() for pipeline in sim.pipelines]


@pytest.mark.parametrize(("spec", "bound"), [("thc", 0.03), ("thc_uniform", 0.1)])
def test_partial_aggregation_normalizes_by_the_count_received(spec, bound):
    """Section 6 / 8.4: a server that broadcasts once ⌈q·n⌉ = 9 of 10 workers arrived, divided by 9,
    estimates the mean of those 9 (and equals the full aggregate when all arrive)."""
    n, q = 10, 0.9
    c = gradpress.make(spec)
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(4096, generator=g) + 1 for _ in range(n)]
    packets = compress_all(c, xs, seed=8, key="")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))  # who arrives first
    arrived = sorted(order[: math.ceil(q * n)].tolist())
    partial = server(c, packets, arrived)
    target = sum(xs[r] for r in arrived) / len(arrived)
    own = [c.decompress(packets[r]).double() for r in arrived]
    decodes = sum(own) / len(arrived)
    assert ((partial.double() - decodes).abs() <= decode_rounding(partial, own)).all()
    assert nmse(partial, target) < bound
    wrong = c.decode_sum(packets[0], [sum(c.summands(packets[r])[0].long() for r in arrived)], n)
    assert nmse(wrong, target) > 5 * nmse(partial, target)  # normalizing by n instead of the count
    assert torch.equal(server(c, packets, range(n)), gradpress.simulate(spec, xs, seed=8, mode="ps"))


def test_extreme_scales_cost_nothing_or_raise():
    """The grid arithmetic is scale-free (powers of two): from subnormal to huge values the error is
    the same; THC's float32 transform refuses norms it cannot hold instead of spreading Inf."""
    x = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    for spec in ("thc", "thc_uniform"):
        c = gradpress.make(spec)
        reference = nmse(c.decompress(c.compress(x, Context())), x)
        for scale, rel in ((2.0**-120, 1e-9), (2.0**-70, 1e-9), (2.0**100, 1e-9), (2.0**-140, 0.05)):
            y = x * scale  # exact down to 2^-126; subnormal below, where y itself has fewer digits
            error = nmse(c.decompress(c.compress(y, Context())), y)
            assert error == pytest.approx(reference, rel=rel), (spec, scale)
    with pytest.raises(OverflowError, match="float32"):
        gradpress.make("thc").compress(x * 1e37)


def test_grid_rounds_unbiasedly_between_table_values():
    """Stochastic quantization to the two nearest table values (App. B): the mean code value of many
    draws of one a ∈ [0, g] is a."""
    c = gradpress.make("thc")
    a = torch.tensor([0.0, 0.4, 2.9, 13.5, 14.0, 15.2, 29.99, 30.0])
    values = c.grid.values.astype(np.float64)
    draws = torch.stack([torch.from_numpy(values[c.grid.quantize(a, 0.0, 30.0, seed).numpy()])
                         for seed in range(4000)])
    assert torch.allclose(draws.mean(dim=0), a.double(), atol=0.06)
    for value, row in zip(a.tolist(), draws.t(), strict=True):  # only the two table values around a
        below = max(t for t in PUBLISHED if t <= value)
        assert set(row.tolist()) <= {below, min(t for t in PUBLISHED if t >= value)}


def test_benchmark_sweeps():
    """``gradpress bench thc`` (App. D.4, Section 8.4) on small vectors."""
    from gradpress.bench.thc_nmse import nmse_vs_granularity, nmse_vs_workers

    points = nmse_vs_granularity(bits=(2, 4), granularities=(7, 30), workers=4, dim=1 << 12, repeats=2)
    assert [(r.bits, r.granularity) for r in points] == [(2, 7), (2, 30), (4, 30)]  # g >= 2^b − 1 only
    error = {(r.bits, r.granularity): r.nmse for r in points}
    assert error[(4, 30)] < error[(2, 30)] / 4  # each bit divides the error (Figure 15)
    assert points[-1].table == gradpress.make("thc:p=1/1024").table
    records = nmse_vs_workers(("thc:p=1/1024", "topk:ratio=1/16"), workers=(2, 16), dim=1 << 12, repeats=1)
    assert all(r.upstream_bits == 4 for r in records)
    thc, topk = ([r.nmse for r in records if r.spec.startswith(name)] for name in ("thc", "topk"))
    assert thc[1] < thc[0] / 3  # independent rounding errors average out over the workers
    assert topk[1] > topk[0] / 2  # top-k's bias does not
    # summands all-reduced in uint8 for 2 workers, in int32 for 16 (g·n = 480), plus the norm's exchange
    # (a ring all-reduce of one float64 and n fault-flag slots)
    received = [r.received_bytes_per_value for r in records[:2]]
    norm = [2 * (n - 1) / n * (1 + n) * 8 / (1 << 12) for n in (2, 16)]
    assert received == pytest.approx([1.0 + norm[0], 2 * 15 / 16 * 4 + norm[1]], abs=1e-3)
