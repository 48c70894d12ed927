"""The α–β cost model: closed forms on small cases, units, monotonicity, overlap, fitting, predictions
from a measured run."""
from __future__ import annotations

import math

import pytest

from gradpress import costmodel as C
from gradpress.testbed import results
from gradpress.testbed.results import Run, Step

MB = 1e6  # bytes
MBYTE_PER_S = 8e6  # bits/s: one megabyte per second


def seconds(strategy: str, n: int, nbytes: float, bandwidth: float = MBYTE_PER_S, latency: float = 0.0,
            **kw) -> float:
    return C.communication_time(C.Phase(strategy, nbytes, **kw), n, bandwidth, latency)


@pytest.mark.parametrize("strategy, n, messages, nbytes", [
    ("allreduce", 4, 6, 1.5 * MB),            # 2(n−1) steps of B/n: 2·3/4·B
    ("allreduce", 2, 2, 1.0 * MB),
    ("allreduce-rh", 8, 6, 1.75 * MB),        # 2·log2(8) messages, 2·7/8·B
    ("allgather", 4, 3, 3.0 * MB),            # (n−1) packets of B received by everyone
    ("allgather-rd", 8, 3, 7.0 * MB),
    ("broadcast", 5, 3, 3.0 * MB),            # ⌈log2 5⌉ = 3 rounds of B
    ("ps", 4, 2, 6.0 * MB),                   # 3 pushes of B in, 3 pulls of B out of the server's link
    ("ps-dedicated", 4, 2, 8.0 * MB),
    ("gather-broadcast", 5, 4, 7.0 * MB),     # 4 gathered into the root + 3 binomial rounds back
])
def test_closed_form_costs(strategy, n, messages, nbytes):
    cost = C.Phase(strategy, MB).cost(n)
    assert cost.messages == messages
    assert cost.nbytes == pytest.approx(nbytes)
    # 1 MB/s links, α = 1 ms: bytes in MB are seconds
    assert seconds(strategy, n, MB, latency=1e-3) == pytest.approx(nbytes / MB + messages * 1e-3)


def test_parameter_server_prices_the_down_direction_separately():
    # THC: 4-bit indices up, 8-bit sums down -> down is twice up
    assert seconds("ps", 4, MB, nbytes_down=2 * MB) == pytest.approx(3 * (1 + 2))
    assert seconds("gather-broadcast", 8, MB, nbytes_down=2 * MB) == pytest.approx(7 * 1 + 3 * 2)
    with pytest.raises(ValueError, match="parameter server"):
        C.Phase("allreduce", MB, nbytes_down=MB)


def test_one_worker_sends_nothing_except_to_a_dedicated_server():
    for strategy in ("allreduce", "allreduce-rh", "allgather", "allgather-rd", "broadcast", "ps",
                     "gather-broadcast"):
        assert seconds(strategy, 1, MB, latency=1.0) == 0.0, strategy
    assert seconds("ps-dedicated", 1, MB) == pytest.approx(2.0)


def test_units_are_bits_per_second_and_bytes():
    # 1 MB over 100 Mbit/s takes 0.08 s: 8e6 bits / 1e8 bits/s (not 0.01 s, not 0.64 s)
    assert C.Cost(0, MB).seconds(1e8, latency=0.0) == pytest.approx(0.08)
    assert C.Cost(0, MB).seconds("100mbit", latency=0.0) == pytest.approx(0.08)
    assert C.Cost(0, MB).seconds("1gbit", latency=0.0) == pytest.approx(0.008)
    assert C.Cost(3, 0).seconds("1gbit", latency=2e-4) == pytest.approx(6e-4)


@pytest.mark.parametrize("strategy", ["allreduce", "allgather", "allgather-rd", "broadcast", "ps",
                                      "ps-dedicated", "gather-broadcast"])
def test_monotonic_in_workers_and_bandwidth(strategy):
    times = [seconds(strategy, n, MB, latency=1e-4) for n in range(1, 65)]
    assert all(b >= a for a, b in zip(times, times[1:], strict=False)), strategy
    assert times[-1] > times[1]
    by_rate = [seconds(strategy, 8, MB, bandwidth=r, latency=1e-4) for r in (1e7, 1e8, 1e9, 1e10)]
    assert all(b < a for a, b in zip(by_rate, by_rate[1:], strict=False)), strategy
    # latency only ever adds
    assert seconds(strategy, 8, MB, latency=1e-3) > seconds(strategy, 8, MB, latency=0.0)


def test_allgather_grows_with_workers_while_allreduce_saturates():
    allreduce = [C.Phase("allreduce", MB).cost(n).nbytes for n in (2, 8, 64, 1024)]
    allgather = [C.Phase("allgather", MB).cost(n).nbytes for n in (2, 8, 64, 1024)]
    assert all(b > a for a, b in zip(allreduce, allreduce[1:], strict=False))
    assert all(x < 2 * MB for x in allreduce) and allreduce[-1] == pytest.approx(2 * MB, rel=1e-3)
    assert allgather == pytest.approx([(n - 1) * MB for n in (2, 8, 64, 1024)])
    # at 1024 workers, gathering 1/32-size packets moves ~16× more than all-reducing the full gradient
    gathered = C.Phase("allgather", MB / 32).cost(1024).nbytes
    assert gathered / allreduce[-1] == pytest.approx(1023 / 64, rel=1e-3)


def test_phases_add_up():
    clt_k = [C.Phase("broadcast", 0.1 * MB), C.Phase("allreduce", MB)]
    assert C.communication_time(clt_k, 4, MBYTE_PER_S, 1e-3) == pytest.approx(
        seconds("broadcast", 4, 0.1 * MB, latency=1e-3) + seconds("allreduce", 4, MB, latency=1e-3))
    assert C.communication_cost(clt_k, 4) == C.Cost(2 + 6, 0.2 * MB + 1.5 * MB)


def test_overlap_rule():
    comm_fast = C.Phase("allreduce", 0.2 * MB)  # n = 2: 2·1/2·B -> 0.2 s at 1 MB/s
    sequential = C.predict_step_time(0.3, 0.05, comm_fast, n=2, bandwidth=MBYTE_PER_S, latency=0.0)
    overlapped = C.predict_step_time(0.3, 0.05, comm_fast, n=2, bandwidth=MBYTE_PER_S, latency=0.0,
                                     overlap=True)
    assert sequential == C.Breakdown(0.3, 0.05, pytest.approx(0.2), pytest.approx(0.55))
    assert overlapped.total == pytest.approx(0.35)  # communication hidden behind compute
    comm_slow = C.Phase("allreduce", 0.5 * MB)
    slow = C.predict_step_time(0.3, 0.05, comm_slow, n=2, bandwidth=MBYTE_PER_S, latency=0.0, overlap=True)
    assert slow.total == pytest.approx(0.55)  # communication-bound: compute hidden instead
    assert sequential.samples_per_s(110) == pytest.approx(200.0)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="unknown strategy"):
        C.Phase("butterfly", MB)
    with pytest.raises(ValueError, match="bytes"):
        C.Phase("allreduce", -1)
    with pytest.raises(ValueError, match="workers"):
        C.Phase("allreduce", MB).cost(0)
    with pytest.raises(ValueError, match="power-of-two"):
        C.Phase("allreduce-rh", MB).cost(6)
    with pytest.raises(ValueError, match="bandwidth"):
        seconds("allreduce", 4, MB, bandwidth=0.0)
    with pytest.raises(ValueError, match="100mbit"):
        seconds("allreduce", 4, MB, bandwidth="100 megabit")
    with pytest.raises(ValueError, match="latency"):
        seconds("allreduce", 4, MB, latency=-1.0)
    with pytest.raises(ValueError, match="compute_s"):
        C.predict_step_time(math.nan, 0.0, C.Phase("allreduce", MB), n=2, bandwidth=1e8)


def test_fit_recovers_latency_and_bandwidth():
    alpha, rate = 3e-4, 2e8
    observations = [
        C.Observation(C.Phase(strategy, nbytes), n, C.Phase(strategy, nbytes).cost(n).seconds(rate, alpha))
        for strategy in ("allreduce", "allgather") for n in (2, 4, 8) for nbytes in (1e3, 1e5, 1e7)
    ]
    assert C.fit_latency(observations, rate) == pytest.approx(alpha, rel=1e-9)
    fitted_alpha, fitted_rate = C.fit_alpha_beta(observations)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-6)
    assert fitted_rate == pytest.approx(rate, rel=1e-6)
    with pytest.raises(ValueError, match="vary the bytes"):
        C.fit_alpha_beta(observations[:1])
    with pytest.raises(ValueError, match="n > 1"):
        C.fit_latency([C.Observation(C.Phase("allreduce", MB), 1, 0.0)], rate)


def _run(steps: list[tuple[float, float, float, int]]) -> Run:
    """A run from (step seconds, compute_s, compress_s, bytes) per step, 32 samples each."""
    wall, out = 0.0, []
    for i, (dt, compute, compress, nbytes) in enumerate(steps, start=1):
        wall += dt
        out.append(Step(i, 0, wall, compute, compress, dt - compute - compress, nbytes, 32))
    return Run("topk:ratio=0.01", "mlp", "fashion-mnist", 2, "100mbit", 0, tuple(out))


def test_predict_from_run_uses_steady_state_means():
    # the first step (warm-up: compilation, connection set-up) is slow and must not count
    run = _run([(5.0, 4.0, 0.9, 2_000_000)] + [(0.4, 0.1, 0.02, 1_000_000)] * 9)
    assert run.mean_compute_s == pytest.approx(0.1) and run.mean_compress_s == pytest.approx(0.02)
    # bytes: the mean over all steps (11e6 / 10)
    predicted = results.predict_from_run(run, bandwidth="10mbit", n=4, strategy="allgather", latency=0.0)
    assert predicted.compute == pytest.approx(0.1) and predicted.compression == pytest.approx(0.02)
    assert predicted.communication == pytest.approx(3 * 1.1e6 * 8 / 1e7)
    assert predicted.total == pytest.approx(0.12 + 3 * 1.1e6 * 8 / 1e7)
    measured = results.measured_breakdown(run)
    assert measured.total == pytest.approx(0.4) and measured.communication == pytest.approx(0.28)


def test_crossover_is_where_both_predicted_steps_are_equal():
    """A method saving bytes at a compression cost pays below B* and loses above it (sequential model)."""
    method, base = C.Phase("allgather", 0.1e6), C.Phase("allreduce", 13e6)
    b = C.crossover_bandwidth(0.008, method, 0.0, base, n=2, latency=1e-4)
    assert 0 < b < math.inf

    def step(compress, phase, bandwidth):
        return C.predict_step_time(0.02, compress, phase, n=2, bandwidth=bandwidth, latency=1e-4).total

    assert step(0.008, method, b) == pytest.approx(step(0.0, base, b), rel=1e-12)
    assert step(0.008, method, b / 2) < step(0.0, base, b / 2)  # a slower link: compression pays
    assert step(0.008, method, b * 2) > step(0.0, base, b * 2)  # a faster one: it does not
    assert C.crossover_bandwidth(0.0, method, 0.001, base, n=2) == math.inf  # cheaper and smaller: always
    assert C.crossover_bandwidth(0.001, base, 0.0, method, n=2) == 0.0  # dearer and larger: never
    faster = C.crossover_bandwidth(0.004, method, 0.0, base, n=2, latency=1e-4)
    assert faster > b  # halving the overhead moves the crossover to faster links


# -- a token-bucket link (tc tbf) and a rate per collective ---------------------------------------------
def test_a_transfer_draws_on_the_bucket_and_pays_the_rest_at_the_rate():
    # 1 MB/s; a ring all-reduce of 1 MB at n = 2 puts 1 MB on each link
    phase = C.Phase("allreduce", MB)
    assert C.transfer_seconds(phase, 2, MBYTE_PER_S, 0.0, tokens=0.25 * MB) == pytest.approx((0.75, 0.0))
    assert C.transfer_seconds(phase, 2, MBYTE_PER_S, 0.0, tokens=2 * MB) == pytest.approx((0.0, MB))
    # without tokens it is Hockney's α + m/β
    assert C.transfer_seconds(phase, 2, MBYTE_PER_S, 1e-3)[0] == pytest.approx(seconds("allreduce", 2, MB,
                                                                                        latency=1e-3))
    # phases back to back share the bucket: 0.1 MB broadcast from 0.3 MB, then 0.8 MB of 1 MB at the rate
    both = [C.Phase("broadcast", 0.1 * MB), phase]
    assert C.transfer_seconds(both, 2, MBYTE_PER_S, 0.0, tokens=0.3 * MB) == pytest.approx((0.8, 0.0))
    # a rate per strategy applies to the bytes beyond the bucket
    gather = C.Phase("allgather", MB)
    assert C.transfer_seconds(gather, 2, MBYTE_PER_S, 0.0, tokens=0.25 * MB,
                              efficiency={"allgather": 0.5})[0] == pytest.approx(1.5)
    other = {"allreduce": 0.5}  # another strategy's rate leaves the all-gather at the link's
    assert C.communication_time(gather, 2, MBYTE_PER_S, 0.0, efficiency=other) == pytest.approx(1.0)
    # tokens accrue at the rate while idle, up to the bucket
    assert C.refill(0.0, 0.1, MBYTE_PER_S, 0.25 * MB) == pytest.approx(0.1 * MB)
    assert C.refill(0.1 * MB, 0.2, MBYTE_PER_S, 0.25 * MB) == pytest.approx(0.25 * MB)
    with pytest.raises(ValueError, match="efficiency"):
        C.transfer_seconds(gather, 2, MBYTE_PER_S, efficiency={"allgather": 0.0})


@pytest.mark.parametrize("nbytes, burst, expected", [
    (1.0 * MB, 0.25 * MB, 0.85),   # a big transfer: the idle 0.15 s refill 0.15 MB, the rest at 1 MB/s
    (1.0 * MB, 0.10 * MB, 0.90),   # the bucket caps the refill
    (0.05 * MB, 0.25 * MB, 0.0),   # refilled within the step: always crosses from a full bucket
    (0.20 * MB, 0.25 * MB, 0.05),  # fits the bucket, but the step refills only 0.15 MB: drains to that
    (1.0 * MB, 0.0, 1.0),          # a plain link
])
def test_the_sequential_step_through_a_token_bucket_in_steady_state(nbytes, burst, expected):
    # compute 0.1 s + compression 0.05 s idle the link: max(0, 8m/R − min(8·burst/R, 0.15 s))
    step = C.predict_step_time(0.1, 0.05, C.Phase("allreduce", nbytes), n=2, bandwidth=MBYTE_PER_S,
                               latency=0.0, burst=burst)
    assert step.communication == pytest.approx(expected, abs=1e-6)
    assert step.total == pytest.approx(0.15 + expected, abs=1e-6)


def test_the_overlapped_step_refills_while_the_exchange_hides_behind_compute():
    phase = C.Phase("allreduce", 0.5 * MB)
    # long compute: the link idles 0.55 s of each 1.05 s step, the bucket is full: 0.25 s of sending
    hidden = C.predict_step_time(1.0, 0.05, phase, n=2, bandwidth=MBYTE_PER_S, latency=0.0, overlap=True,
                                 burst=0.25 * MB)
    assert (hidden.communication, hidden.total) == pytest.approx((0.25, 1.05), abs=1e-6)
    # short compute: the link idles 0.05 s per step, which refills 0.05 MB: 0.45 s of sending
    exposed = C.predict_step_time(0.1, 0.05, phase, n=2, bandwidth=MBYTE_PER_S, latency=0.0, overlap=True,
                                  burst=0.25 * MB)
    assert (exposed.communication, exposed.total) == pytest.approx((0.45, 0.5), abs=1e-6)


def test_one_bucket_at_the_end_of_backward_through_a_token_bucket_is_the_sequential_step():
    phases = (C.Phase("allreduce", MB), C.Phase("allgather", 0.2 * MB))
    kw = {"n": 2, "bandwidth": MBYTE_PER_S, "latency": 1e-3, "burst": 0.3 * MB,
          "efficiency": {"allgather": 0.6}}
    one = C.predict_bucketed_step(0.02, 0.1, [C.BucketStep(0.1, 0.01, phases, 0.02)], optimizer_s=0.03, **kw)
    seq = C.predict_step_time(0.15, 0.03, phases, **kw)
    assert one.total == pytest.approx(seq.total)
    # idle 0.18 s: 0.18 MB of tokens, 0.82 MB at the rate; the all-gather's 0.2 MB at 0.6 of it; 3 α
    assert one.communication == pytest.approx(0.82 + 0.2 / 0.6 + 3e-3)


def test_the_steady_state_is_the_greatest_fixed_point():
    assert C.steady_tokens(lambda t: 0.0, 100.0) == 0.0
    assert C.steady_tokens(lambda t: min(100.0, t + 1.0), 100.0) == 100.0
    # a slow drain (1 byte a step from a full bucket) settles where the step's refill no longer covers it
    fixed = C.steady_tokens(lambda t: min(100.0, t - 30.0 + 29.0) if t >= 30.0 else 29.0, 100.0)
    assert fixed == pytest.approx(29.0, abs=1e-2)
    assert C.steady_tokens(lambda t: 5.0, 0.0) == 0.0


@pytest.mark.parametrize("case", range(20))
def test_through_a_token_bucket_the_speedup_still_never_rises_with_link_speed(case):
    """The sequential model (module doc): a method with no more bytes than the baseline's all-reduce, at
    least its compression and messages, never gains on it from one link speed to a faster one, whatever
    the bucket."""
    import random

    import numpy as np

    rng = random.Random(case)
    n = rng.choice([2, 4, 8])
    compute, burst = rng.uniform(1e-3, 0.2), rng.choice([0.0, 64e3, 256e3, 4e6])
    base_bytes = rng.uniform(1e4, 5e7)
    base = C.Phase("allreduce", base_bytes)
    method = C.Phase(rng.choice(["allreduce", "allgather"]), 0.0)
    latency = rng.uniform(0, 1e-4) if method.strategy == "allreduce" else 0.0
    on_link = base.cost(n).nbytes * rng.uniform(0, 1)  # the method's bytes on the link, at most the base's
    method = C.Phase(method.strategy, on_link / C.Phase(method.strategy, 1.0).cost(n).nbytes)
    compress = rng.uniform(0, 0.05)
    grid = np.geomspace(1e6, 1e12, 80)
    speedups = []
    for bw in grid:
        kw = {"n": n, "bandwidth": float(bw), "latency": latency, "burst": burst}
        speedups.append(C.predict_step_time(compute, 0.0, base, **kw).total
                        / C.predict_step_time(compute, compress, method, **kw).total)
    rises = [(f"{grid[i]:.3g}", a, b) for i, (a, b) in enumerate(zip(speedups, speedups[1:], strict=False))
             if b > a * (1 + 1e-9)]
    assert not rises, rises[:3]


def _observed(truth: dict[str, float], cases, rate: float, alpha: float) -> list:
    """Observations of each strategy in ``truth`` (its rate) for each (bytes, tokens) case, priced exactly."""
    observations = []
    for strategy in truth:
        for nbytes, tokens in cases:
            phase = C.Phase(strategy, nbytes)
            seconds = C.transfer_seconds(phase, 2, rate, alpha, tokens, truth)[0]
            observations.append(C.Observation(phase, 2, seconds, tokens))
    return observations


def test_fit_efficiency_recovers_each_collectives_rate_beyond_the_bucket():
    rate, alpha, truth = 1e8, 1e-4, {"allreduce": 0.95, "allgather": 0.65}
    observations = _observed(truth, ((3e6, 256e3), (1e7, 100e3), (2e6, 0.0), (100e3, 256e3)), rate, alpha)
    fitted = C.fit_efficiency(observations, rate, alpha)
    assert fitted == pytest.approx(truth, rel=1e-9)
    with pytest.raises(ValueError, match="beyond the token bucket"):
        C.fit_efficiency([C.Observation(C.Phase("allreduce", 1e3), 2, 1e-3, 1e6)], rate)


def test_fit_link_recovers_the_latency_beside_the_rates():
    rate, alpha, truth = 1e8, 8e-4, {"allreduce": 0.95, "allgather": 0.65}
    observations = _observed(truth, ((3e6, 256e3), (1e7, 100e3), (50e3, 256e3), (200e3, 256e3)), rate, alpha)
    fitted_alpha, fitted = C.fit_link(observations, rate)
    assert fitted_alpha == pytest.approx(alpha, rel=1e-9) and fitted == pytest.approx(truth, rel=1e-9)
    # a remainder beyond the bucket smaller than it informs α only, priced at the rate: 0.05 MB of 0.3 MB
    small = C.Observation(C.Phase("allreduce", 0.3 * MB), 2, 2 * alpha + 8 * 0.05 * MB / rate, 0.25 * MB)
    assert C.fit_link([small], rate, min_excess=0.25 * MB) == (pytest.approx(alpha), {})
    with pytest.raises(ValueError, match="messages"):
        C.fit_link([C.Observation(C.Phase("allreduce", MB), 1, 0.0)], rate)
