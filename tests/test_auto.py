"""``auto`` (:mod:`gradpress.auto`): the decision as a pure function, its options and
state checks in one process, and two 2-process Gloo runs: a Communicator whose rank 0 forces a plan of
switches (residual memory carried between methods that keep one and flushed into the next exchange of
one that does not: the sum of what was averaged plus the memory left equals the sum of the gradients,
to fp32 rounding; every rank follows rank 0; a NaN still raises on every rank), and DDP measuring and
deciding for real, saved and resumed with its choice. No timing is asserted: which method wins on this
machine is the measurement's business."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gradpress
from dist_utils import run_workers
from gradpress.auto import AUTO, DECIDED, MEASURE_WITH, AutoOptions, AutoPipeline, Decision, choose
from gradpress.exchange.pipeline import Options, Pipeline
from gradpress.testbed.advise import Bucket, BucketCost, ComputeProfile, MethodCost, Transfer

EPS = torch.finfo(torch.float32).eps


# -- the decision, a pure function --------------------------------------------------------------------
def _profile() -> ComputeProfile:
    buckets = (Bucket(0, ("small",), 1_000, 4_000, 0.001), Bucket(1, ("big",), 1_000_000, 4_000_000, 0.006))
    return ComputeProfile(0.004, 0.006, 0.0, buckets, "measured", 0, 1, 1_001_000)


def _costs(profile: ComputeProfile) -> list[MethodCost]:
    none = MethodCost("none", "allreduce", "none", tuple(
        BucketCost(1e-5, 0.0, float(b.nbytes), (Transfer("allreduce", float(b.nbytes)),)) for b in profile.buckets))
    topk = MethodCost("topk:ratio=0.01", "allgather", "residual", tuple(
        BucketCost(2e-3, 2e-4, b.nbytes / 50, (Transfer("allgather", 16.0), Transfer("allgather", b.nbytes / 50)))
        for b in profile.buckets), decode_grows=True)
    return [none, topk]


def test_a_slow_link_picks_the_compressor_a_fast_one_none_and_between_each_bucket_its_own() -> None:
    profile = _profile()
    costs = _costs(profile)
    slow = choose(profile, costs, n=8, bandwidth="100mbit", latency=1e-4)
    assert slow.specs[1] == "topk:ratio=0.01"
    assert slow.predicted_s < slow.uncompressed_s == slow.current_s
    assert slow.bucket_uncompressed_s[1] > slow.predicted_s
    fast = choose(profile, costs, n=8, bandwidth="400gbit", latency=1e-6)
    assert fast.specs == ("none", "none") and fast.predicted_s == fast.uncompressed_s
    # 1 Gbit/s: the 4 kB bucket's exchange hides under the backward pass, compressing it only costs
    mixed = choose(profile, costs, n=8, bandwidth="1gbit", latency=1e-4)
    assert mixed.specs == ("none", "topk:ratio=0.01")
    assert mixed.predicted_s < min(mixed.uniform_s.values())


def test_a_switch_must_pay_more_than_the_margin() -> None:
    profile = _profile()
    costs = _costs(profile)
    best = choose(profile, costs, n=8, bandwidth="100mbit", latency=1e-4)
    stay = choose(profile, costs, n=8, bandwidth="100mbit", latency=1e-4, current=best.specs, margin=0.5)
    assert stay.specs == best.specs
    # from none, a margin larger than the gain keeps none
    gain = 1 - best.predicted_s / best.uncompressed_s
    kept = choose(profile, costs, n=8, bandwidth="100mbit", latency=1e-4, margin=min(0.999, gain + 0.001))
    assert kept.specs == ("none", "none") and kept.predicted_s == kept.uncompressed_s


# -- options and state, one process ----------------------------------------------------------------------
def test_options_are_checked_before_any_exchange() -> None:
    assert AutoOptions(candidates=("qsgd",)).candidates == ("none", "qsgd")
    assert AutoOptions().candidates[0] == "none"
    for bad in ({"candidates": ("nosuch",)}, {"candidates": ("auto",)}, {"measure_steps": 0},
                {"settle_steps": -1}, {"recheck_every": 1.5}, {"margin": 1.0}, {"candidates": (3,)}):
        with pytest.raises(ValueError):
            AutoOptions(**bad)
    with pytest.raises(ValueError, match="nosuch"):
        gradpress.ddp_comm_hook("auto", candidates=["topk:ratio=0.01", "nosuch"])
    with pytest.raises(ValueError, match="measure_steps"):
        gradpress.ddp_comm_hook("auto", measure_steps=0)
    with pytest.raises(TypeError, match="unknown option"):
        gradpress.ddp_comm_hook("auto", measure=3)
    with pytest.raises(TypeError, match="unknown option"):  # auto's options belong to auto alone
        gradpress.ddp_comm_hook("topk:ratio=0.01", measure_steps=3)
    state, _ = gradpress.ddp_comm_hook("auto", recheck_every=0, seed=3)
    assert state.spec == AUTO and state.auto.recheck_every == 0 and state.options.seed == 3


def test_an_auto_state_loads_only_into_auto_and_is_checked() -> None:
    auto = AutoPipeline(AutoOptions(candidates=("topk:ratio=0.1",)), Options(), 0, 1)
    auto.pipeline("topk:ratio=0.1")
    state = auto.state_dict()
    again = AutoPipeline(AutoOptions(candidates=("topk:ratio=0.1",)), Options(), 0, 1)
    again.load_state_dict(copy.deepcopy(state))
    assert set(again.state_dict()["auto"]["pipelines"]) == {"none", "topk:ratio=0.1"}
    with pytest.raises(ValueError, match="spec is 'auto'"):
        Pipeline(gradpress.make("topk:ratio=0.1"), Options(), 0, 1).load_state_dict(state)
    with pytest.raises(ValueError, match="spec is 'qsgd'"):
        auto.load_state_dict(Pipeline(gradpress.make("qsgd"), Options(), 0, 1).state_dict())
    outside = copy.deepcopy(state)
    outside["auto"]["choice"] = {"w": "qsgd"}
    with pytest.raises(ValueError, match="candidates"):
        auto.load_state_dict(outside)
    nan = copy.deepcopy(state)
    nan["shapes"]["w"] = [3]
    nan["auto"]["flush"] = {"w": torch.tensor([0.0, math.nan, 1.0])}
    with pytest.raises(ValueError, match="NaN"):
        auto.load_state_dict(nan)
    with pytest.raises(ValueError, match="world_size"):
        AutoPipeline(AutoOptions(), Options(), 1, 2).load_state_dict(state)


# -- 2 ranks: a plan of switches forced by rank 0 ----------------------------------------------------------
PLAN = {1: "topk:ratio=0.1", 3: "topk:ratio=0.3", 5: "none", 7: "topk:ratio=0.1", 9: "none", 11: "topk:ratio=0.3"}
SHAPES = {"w": (30, 20), "b": (20,)}


def _left(auto: AutoPipeline, key: str) -> torch.Tensor:
    """What ``key`` has not sent yet: every method's residual memory and a pending flush."""
    total = torch.zeros(SHAPES[key], dtype=torch.float64)
    for pipeline in auto._pipelines.values():
        memory = getattr(pipeline.feedback, "_memory", {}).get(key)
        if memory is not None:
            total += memory.double()
    if key in auto._flush:
        total += auto._flush[key].double()
    return total


def _run_plan(rank: int, plan: dict, left) -> dict:  # noqa: ANN001
    """11 steps of ``auto`` with rank 0 forcing ``plan`` (step -> spec) at its decision points, the sums
    of what was averaged and given, and what the memory holds (``left``) after each; at step 11 rank 1's
    gradient holds a NaN."""
    comm = gradpress.Communicator("auto", candidates=["topk:ratio=0.1", "topk:ratio=0.3"], settle_steps=0,
                                  measure_steps=1, recheck_every=2, seed=0)
    auto = comm._pipeline
    if rank == 0:  # rank 0 decides (here: by plan); the others follow what it broadcasts
        def forced(layout):  # noqa: ANN001, ANN202
            specs = tuple(plan[auto._current_step] for _ in layout)
            return auto._payload(layout, DECIDED, Decision(specs, 1.0, 2.0, 2.0, tuple(2.0 for _ in layout)))

        auto._rank0_payload = forced
    generator = torch.Generator().manual_seed(100 + rank)
    averaged = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    given = {k: torch.zeros(s, dtype=torch.float64) for k, s in SHAPES.items()}
    rows = []
    for step in range(11):
        grads = {k: torch.randn(s, generator=generator) * (1 + step % 3) for k, s in SHAPES.items()}
        out = comm.reduce_many(grads)
        for k in SHAPES:
            averaged[k] += out[k].double()
            given[k] += grads[k].double()
        rows.append({"spec": auto.choice.get("w") or auto._default(),
                     "averaged": {k: v.clone() for k, v in averaged.items()},
                     "given": {k: v.clone() for k, v in given.items()},
                     "left": {k: left(auto, k) for k in SHAPES}})
    report = comm.stats()["auto"]
    grads = {k: torch.randn(s, generator=generator) for k, s in SHAPES.items()}
    if rank == 1:
        grads["w"][3, 4] = math.nan
    try:  # step 11: rank 0 switches by the plan, and rank 1's gradient holds a NaN
        comm.reduce_many(grads)
        raised = None
    except gradpress.NonFiniteError as error:
        raised = error.ranks
    return {"rows": rows, "report": report, "raised": raised, "spec11": auto.choice.get("w")}


def _forced_worker(rank: int, world_size: int) -> dict:
    return {**_run_plan(rank, PLAN, _left), "kept": _keeps_measure_with(rank), "probed nan": _nan_at_probe(rank)}


def _nan_at_probe(rank: int) -> list[int] | None:
    """Rank 1's gradient holds a NaN at the last measured step, the one with the probe's extra collective:
    the ranks that raise ``NonFiniteError`` say which rank had it (None: nothing raised)."""
    comm = gradpress.Communicator("auto", candidates=["topk:ratio=0.1"], measure_with="topk:ratio=0.1",
                                  settle_steps=0, measure_steps=2, recheck_every=0, seed=0)
    generator = torch.Generator().manual_seed(rank)
    comm.reduce_many({k: torch.randn(s, generator=generator) for k, s in SHAPES.items()})
    grads = {k: torch.randn(s, generator=generator) for k, s in SHAPES.items()}
    if rank == 1:
        grads["w"][2, 3] = math.nan
    try:
        comm.reduce_many(grads)
    except gradpress.NonFiniteError as error:
        return error.ranks
    return None


def _keeps_measure_with(rank: int) -> list[tuple[float, float]]:
    """Each step's (raw, packet) bytes and collectives when rank 0 chooses the method the measurement ran."""
    comm = gradpress.Communicator("auto", candidates=["topk:ratio=0.1"], measure_with="topk:ratio=0.1",
                                  settle_steps=1, measure_steps=2, recheck_every=0, seed=0)
    auto = comm._pipeline
    if rank == 0:
        auto._rank0_payload = lambda layout: auto._payload(  # noqa: ARG005
            layout, DECIDED, Decision(("topk:ratio=0.1",), 1.0, 2.0, 2.0, (2.0,)))
    generator = torch.Generator().manual_seed(rank)
    sizes = []
    for _ in range(6):
        comm.reduce_many({k: torch.randn(s, generator=generator) for k, s in SHAPES.items()})
        last = comm.stats()["last"]
        sizes.append((last["raw_bytes"], last["packet_bytes"], last["collectives"]))
    return sizes


def test_forced_switches_carry_or_flush_the_residual_exactly_on_every_rank() -> None:
    results = run_workers(_forced_worker, 2, timeout=120)
    expected = [MEASURE_WITH, *[PLAN[max(s for s in PLAN if s <= step)] for step in range(1, 11)]]
    for result in results:
        assert [row["spec"] for row in result["rows"]] == expected
        assert result["raised"] == [1] and result["spec11"] == PLAN[11]
        # measured with top-k 10 % (and at step 2, the last measured, a probe: one collective more),
        # decided at step 3 for top-k 10 %, kept after it
        raw = 4 * (600 + 20)
        assert all(size == raw and 0 < packet < raw / 4 for size, packet, _ in result["kept"])
        collectives = [count for _, _, count in result["kept"]]
        assert collectives[2] == collectives[1] + 1 and collectives[3:] == collectives[:1] * 3
        assert result["probed nan"] == [1]  # (every rank raises, naming rank 1)
        report = result["report"]
        assert report["phase"] == "decided" and report["decided_at"] == 9 and report["next_check"] == 11
        assert [b["spec"] for b in report["buckets"]] == ["none"]
        assert report["predicted_s"] == {"chosen": 1.0, "none": 2.0}
    assert results[0]["report"] == results[1]["report"]
    rows = zip(*(r["rows"] for r in results), strict=True)
    for step, (mine, theirs) in enumerate(rows):
        for key in SHAPES:
            # Σ averaged + mean of what the ranks have left = Σ mean of the gradients, to fp32 rounding
            lhs = mine["averaged"][key] + (mine["left"][key] + theirs["left"][key]) / 2
            rhs = (mine["given"][key] + theirs["given"][key]) / 2
            scale = max(1.0, float(rhs.abs().max()), float(mine["left"][key].abs().max()))
            torch.testing.assert_close(lhs, rhs, rtol=0, atol=16 * (step + 1) * EPS * scale)
            assert torch.equal(mine["averaged"][key], theirs["averaged"][key])
        if mine["spec"] == "none":  # flushed: nothing left
            assert all(float(mine["left"][k].abs().max()) == 0.0 for k in SHAPES)
        if step in (3, 4):  # carried from topk:ratio=0.1 into topk:ratio=0.3, not flushed
            assert float(mine["left"]["w"].abs().max()) > 0


# -- 2 ranks: DDP measures, decides, saves and resumes ----------------------------------------------------
OPTIONS = {"settle_steps": 1, "measure_steps": 2, "recheck_every": 4, "seed": 0, "measure_with": "none"}


def _train(ddp: nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(16, 20, generator=generator)
        loss = nn.functional.mse_loss(ddp(x), x[:, :4])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _ddp_worker(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DDP(model)
    state = gradpress.register(ddp, "auto", **OPTIONS)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    _train(ddp, optimizer, generator, 3)
    measuring = state.stats()["auto"]
    _train(ddp, optimizer, generator, 3)  # decides at step 3
    decided = state.stats()
    signal = state._pipeline._signal  # rank 0: ρ of steps 1 and 2 (the others: never measured, 0)
    saved = state.state_dict()
    resumed_model = copy.deepcopy(model)
    resumed = DDP(resumed_model)
    again = gradpress.register(resumed, "auto", **OPTIONS)
    again.load_state_dict(saved)
    loaded = again.stats()["auto"]
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.05)
    _train(resumed, optimizer, generator, 1)  # step 6: the loaded choice, nothing measured
    continued = again.stats()["auto"]
    _train(resumed, optimizer, generator, 3)  # step 7: re-checks (on gradients rank 0 kept at step 6)
    rechecked = again.stats()["auto"]
    # the defaults: steps 0 to 6 run PowerSGD at rank 4 (steps 2 to 6 measured; step 6 also probes the
    # link), the decision at step 7's first bucket; rank 0 reads ρ from its gradients of steps 5 and 6
    # and from its gradient of step 6 against the ranks' average of the probed eighth
    torch.manual_seed(0)
    fresh = DDP(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
    default = gradpress.register(fresh, "auto", candidates=["topk:ratio=0.1"], seed=0)
    optimizer = torch.optim.SGD(fresh.parameters(), lr=0.05)
    _train(fresh, optimizer, generator, 6)
    measured = default.stats()
    _train(fresh, optimizer, generator, 1)
    captured = default.stats()
    _train(fresh, optimizer, generator, 1)
    return {"measuring": measuring, "decided": decided, "loaded": loaded, "continued": continued,
            "rechecked": rechecked, "signal": signal, "params": [p.detach().clone() for p in resumed_model.parameters()],
            "default measuring": measured, "default captured": captured, "default": default.stats()["auto"],
            "default signal": default._pipeline._signal}


def test_ddp_measures_decides_the_same_on_every_rank_and_resumes_with_its_choice() -> None:
    results = run_workers(_ddp_worker, 2, timeout=150)
    for result in results:
        assert result["measuring"]["phase"] == "measuring" and result["measuring"]["next_check"] == 3
        decided = result["decided"]["auto"]
        assert decided["phase"] == "decided" and decided["decided"] and decided["decided_at"] == 3
        assert decided["next_check"] == 7
        assert result["decided"]["pattern"].startswith("auto: ")
        assert decided["buckets"] and all(b["spec"] in decided["candidates"] for b in decided["buckets"])
        link = decided["link"]
        assert link["seconds_per_byte"] > 0 and link["bits_per_second"] == pytest.approx(8 / link["seconds_per_byte"])
        assert decided["compute_s"] > 0 and decided["predicted_s"]["chosen"] > 0
        assert decided["predicted_s"]["chosen"] <= decided["predicted_s"]["none"]
        assert "predicted step" in decided["reason"]
        for view in ("loaded", "continued"):
            assert result[view]["buckets"] == decided["buckets"] and result[view]["decided_at"] == 3
            assert result[view]["next_check"] == 7
        assert result["rechecked"]["decided_at"] == 7 and result["rechecked"]["decided"]
        assert result["default"]["decided_at"] == 7 and result["default"]["decided"], result["default"]
        assert result["measuring"]["reason"].startswith("measuring with none until step 3")
        measuring = result["default measuring"]
        assert measuring["auto"]["reason"].startswith("measuring with powersgd:rank=4 until step 7")
        # PowerSGD at rank 4: the 64 × 20 weight as 64 × 4 and 20 × 4 factors, the rest as it is (the
        # 4 × 64 weight has rank 4 already): 1,344 + 4 × (64 + 256 + 4) bytes, not the 6.4 kB of the gradient
        assert measuring["last"]["raw_bytes"] == 4 * 1604
        assert 0 < measuring["last"]["packet_bytes"] <= 4 * (64 * 4 + 20 * 4) + 4 * (64 + 256 + 4)
        # the last measured step: PowerSGD again, and the probe of an eighth of the gradient, uncompressed
        captured = result["default captured"]["last"]
        assert captured["packet_bytes"] == measuring["last"]["packet_bytes"]
        assert captured["collectives"] == measuring["last"]["collectives"] + 1
    first, second = results
    # the quality model's signal fraction, read on rank 0 (measured with none: also from its gradient and
    # the exact average of the last measured step)
    assert 0 < first["signal"] < 1 and second["signal"] == 0
    assert 0 < first["default signal"] < 1 and second["default signal"] == 0
    assert first["decided"]["auto"]["buckets"] == second["decided"]["auto"]["buckets"]
    assert first["rechecked"]["buckets"] == second["rechecked"]["buckets"]
    for mine, theirs in zip(first["params"], second["params"], strict=True):
        assert torch.equal(mine, theirs)


# -- the decision by time to a quality target, and on several nodes (pure functions) -----------------------
def _aggressive(profile: ComputeProfile, ratio: float, spec: str) -> MethodCost:
    return MethodCost(spec, "allgather", "residual", tuple(
        BucketCost(2e-3, 2e-4, b.nbytes * ratio, (Transfer("allgather", 16.0), Transfer("allgather", b.nbytes * ratio)))
        for b in profile.buckets), decode_grows=True)


def test_the_decisions_one_pass_measures_what_the_separate_measurements_do() -> None:
    """``measure_with_errors`` (one simulated worker, two steps a bucket) gives each bucket the error of
    ``compression_errors`` and the bytes and collectives of ``measure_method``; the errors' float32
    sums agree with float64 ones to float32's rounding over the summed values."""
    from gradpress.costmodel import compression_errors, measure_method, measure_with_errors

    generator = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(64, 48, generator=generator), "b": torch.randn(48, generator=generator) * 1e-3,
             "v": torch.randn(300, generator=generator)}
    buckets = (Bucket(0, ("w", "b"), 64 * 48 + 48, 4 * (64 * 48 + 48), 0.0), Bucket(1, ("v",), 300, 1200, 0.001))
    profile = ComputeProfile(0.004, 0.006, 0.0, buckets, "measured", 0, 1, 64 * 48 + 48 + 300)
    for spec in ("topk:ratio=0.1", "qsgd", "powersgd:rank=2", "thc", "none"):
        cost, errors = measure_with_errors(spec, profile, grads, seed=0)
        assert errors == compression_errors(spec, [{k: grads[k] for k in b.keys} for b in buckets], seed=0)
        separate = measure_method(spec, profile, [grads, grads], repeats=1, seed=0)
        assert [(b.packet_bytes, b.transfers) for b in cost.buckets] == \
            [(b.packet_bytes, b.transfers) for b in separate.buckets], spec
        assert all(b.compress_s > 0 for b in cost.buckets) and cost.measured_workers == 1
        received = gradpress.Simulator(spec, 1, seed=0, warm_up=False).step([{k: grads[k] for k in ("w", "b")}])
        exact = sum(float((grads[k].double() - received[k].double()).square().sum()) for k in ("w", "b"))
        bound = 64 * 48 * torch.finfo(torch.float32).eps * max(exact, 1e-30)
        assert errors[0].squared_error == pytest.approx(exact, rel=0, abs=bound), spec


def test_the_quality_model_prefers_the_gentler_method_when_the_aggressive_one_is_slower_to_the_target() -> None:
    from gradpress.costmodel import CompressionError, signal_fraction, signal_fraction_of_mean, steps_factor

    profile = _profile()
    none = _costs(profile)[0]
    costs = [none, _aggressive(profile, 1 / 50, "topk:ratio=0.01"), _aggressive(profile, 1 / 500, "topk:ratio=0.001")]
    # the measured errors: top 1 % keeps half the gradient's energy, top 0.1 % a twentieth (δ = 0.5, 0.05)
    # (the small bucket holds a thousandth of the gradient's energy)
    errors = {spec: [CompressionError(1e-3 * e, 1e-3, spec == "none"), CompressionError(e, 1.0, spec == "none")]
              for spec, e in (("none", 0.0), ("topk:ratio=0.01", 0.5), ("topk:ratio=0.001", 0.95))}
    by_step = choose(profile, costs, n=8, bandwidth="100mbit", latency=1e-4)  # the step alone (rank_by="step")
    assert by_step.specs[1] == "topk:ratio=0.001" and by_step.factor == 1.0
    by_quality = choose(profile, costs, n=8, bandwidth="100mbit", latency=1e-4, errors=errors)
    assert by_quality.specs[1] == "topk:ratio=0.01"
    assert by_quality.predicted_s > by_step.predicted_s  # a slower step, but fewer of them to the target
    assert by_quality.factor == pytest.approx(2.0, rel=1e-2) and by_quality.target_s < by_step.predicted_s * 19
    # the model: 1/δ for error feedback, 1 + ω/(1 − ρ) for an unbiased method without memory (ρ the
    # gradient's signal fraction; 1 + ω·(1 + k·ρ/(1 − ρ)) for a node's sum of k), their product mixed
    assert steps_factor([CompressionError(0.75, 1.0, False)]) == pytest.approx(4.0)
    assert steps_factor([CompressionError(0.75, 1.0, False)], signal=0.5) == pytest.approx(4.0)
    assert steps_factor([CompressionError(2.0, 1.0, True)]) == pytest.approx(3.0)
    assert steps_factor([CompressionError(2.0, 1.0, True)], signal=0.5) == pytest.approx(5.0)
    assert steps_factor([CompressionError(2.0, 1.0, True)], signal=0.5, local_sizes=[4]) == pytest.approx(11.0)
    assert steps_factor([CompressionError(0.5, 1.0, False), CompressionError(2.0, 1.0, True)], signal=0.5) == \
        pytest.approx((1 / (1 - 0.25)) * (1 + 2.0 * 2 / 2))  # (errors over the norm of both buckets, 2)
    with pytest.raises(ValueError, match="local_sizes"):
        steps_factor([CompressionError(2.0, 1.0, True)], local_sizes=[0])
    # ρ from two gradients: their inner product over their mean square, clamped to [0, 1)
    generator = torch.Generator().manual_seed(0)
    mean, noise = torch.randn(200_000, generator=generator), [torch.randn(200_000, generator=generator) for _ in range(2)]
    # ‖∇f‖² = ‖mean‖², σ² = 3²·‖noise‖²: ρ = 1/10 within the sampling error of 200,000 coordinates
    rho = signal_fraction({"w": mean + 3 * noise[0], "b": torch.zeros(3)}, {"w": mean + 3 * noise[1], "x": torch.ones(2)})
    assert rho == pytest.approx(0.1, abs=0.01)
    assert signal_fraction({"w": mean}, {"w": -mean}) == 0.0 and signal_fraction({"w": mean}, {"v": mean}) == 0.0
    assert signal_fraction({"w": mean}, {"w": mean}) == pytest.approx(1 - 1e-3)
    # ρ from one worker's gradient and the exact average of n = 4 (the same ρ = 1/10)
    workers = [mean + 3 * torch.randn(200_000, generator=generator) for _ in range(4)]
    average = torch.stack(workers).mean(0)
    squares = [float(t.double().square().sum()) for t in (workers[0], average)]
    assert signal_fraction_of_mean(*squares, 4) == pytest.approx(0.1, abs=0.02)
    assert signal_fraction_of_mean(squares[0], squares[0], 1) == 0.0  # one worker: no second batch size
    assert signal_fraction_of_mean(1.0, 0.1, 4) == 0.0 and signal_fraction_of_mean(1.0, 5.0, 4) == pytest.approx(1 - 1e-3)
    assert AutoOptions().rank_by == "quality" and AutoOptions(rank_by="step").rank_by == "step"
    with pytest.raises(ValueError, match="rank_by"):
        AutoOptions(rank_by="loss")
    with pytest.raises(ValueError, match="intra_bandwidth"):
        AutoOptions(intra_bandwidth="fast")


def test_on_several_nodes_each_method_is_priced_flat_and_in_two_levels() -> None:
    from gradpress.costmodel import Topology

    profile = _profile()
    costs = [_costs(profile)[0], _aggressive(profile, 1 / 50, "topk:ratio=0.01")]
    nodes = Topology(4, 2, "100gbit")
    both = choose(profile, costs, n=8, bandwidth="100mbit", latency=1e-4, topology=nodes)
    # a slow node link: the all-gather crosses it k times less in two levels (costmodel.nodes)
    assert both.specs[1] == "topk:ratio=0.01@node"
    assert len(both.levels_s) == 2 and both.levels_s[1][1] < both.levels_s[1][0]
    assert "none@node" in both.uniform_s and "topk:ratio=0.01" in both.uniform_s
    only = choose(profile, costs, n=8, bandwidth="100mbit", latency=1e-4, topology=nodes, levels=(True,))
    assert all(name.endswith("@node") for name in only.specs) and all(s.endswith("@node") for s in only.uniform_s)
    one = choose(profile, costs, n=8, bandwidth="100mbit", latency=1e-4)
    assert one.levels_s == () and not any(s.endswith("@node") for s in one.specs)
    with pytest.raises(ValueError, match="two-level"):
        choose(profile, costs, n=8, bandwidth="100mbit", levels=(True,))


# -- 4 ranks, 2 nodes of 2: two-level candidates, switches between levels ----------------------------------
LEVEL_PLAN = {1: "topk:ratio=0.1", 3: "topk:ratio=0.1@node", 5: "topk:ratio=0.3@node", 7: "topk:ratio=0.1",
              9: "none@node", 11: "topk:ratio=0.3@node"}


def _left_levels(auto: AutoPipeline, key: str) -> torch.Tensor:
    """What ``key`` has not sent yet, as this rank's share of the whole (a shard's memory k·e on it)."""
    total = torch.zeros(SHAPES[key], dtype=torch.float64)
    for name, pipeline in auto._pipelines.items():
        memory = getattr(pipeline.feedback, "_memory", {}).get(key)
        if memory is not None:
            total += auto._whole(key, memory.double()) if name.endswith("@node") else memory.double()
    if key in auto._flush:
        total += auto._flush[key].double()
    return total


def _levels_plan(rank: int) -> dict:
    """The mixed levels (torchrun's layout) with rank 0 forcing ``LEVEL_PLAN``; a NaN at the last step."""
    return _run_plan(rank, LEVEL_PLAN, _left_levels)


def _levels_decided(rank: int, **options: object) -> dict:
    comm = gradpress.Communicator("auto", candidates=["topk:ratio=0.1"], settle_steps=0, measure_steps=3,
                                  recheck_every=0, seed=0, **options)
    generator = torch.Generator().manual_seed(7 + rank)
    outs = [comm.reduce_many({k: torch.randn(s, generator=generator) for k, s in SHAPES.items()})
            for _ in range(5)]
    auto = comm._pipeline
    held = {name for name, pipeline in auto._pipelines.items() for key in SHAPES
            if key in getattr(pipeline.feedback, "_memory", {})}
    return {"report": comm.stats()["auto"], "outs": outs, "held": held, "chosen": set(auto.choice.values())}


def _levels_worker(rank: int, world_size: int) -> dict:
    import os

    os.environ.update(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2), LOCAL_RANK=str(rank % 2))
    return {"plan": _levels_plan(rank), "mixed": _levels_decided(rank),
            "node": _levels_decided(rank, hierarchy="node", local_size=2, intra_bandwidth="10gbit")}


def test_two_level_auto_on_two_nodes_decides_alike_switches_levels_exactly_and_stays_bit_identical() -> None:
    results = run_workers(_levels_worker, 4, timeout=180)
    plans = [r["plan"] for r in results]
    expected = [MEASURE_WITH, *[LEVEL_PLAN[max(s for s in LEVEL_PLAN if s <= step)] for step in range(1, 11)]]
    for plan in plans:
        assert [row["spec"] for row in plan["rows"]] == expected
        assert plan["raised"] == [1]
        assert [b["level"] for b in plan["report"]["buckets"]] == ["two levels"]
    for step, rows in enumerate(zip(*(p["rows"] for p in plans), strict=True)):
        for key in SHAPES:
            # Σ averaged + mean of what the ranks have left = Σ mean of the gradients, to fp32 rounding
            lhs = rows[0]["averaged"][key] + sum(row["left"][key] for row in rows) / 4
            rhs = sum(row["given"][key] for row in rows) / 4
            scale = max(1.0, float(rhs.abs().max()), max(float(row["left"][key].abs().max()) for row in rows))
            torch.testing.assert_close(lhs, rhs, rtol=0, atol=32 * (step + 1) * EPS * scale)
            assert all(torch.equal(rows[0]["averaged"][key], row["averaged"][key]) for row in rows)
    for run in ("mixed", "node"):
        reports = [r[run]["report"] for r in results]
        assert reports[0]["phase"] == "decided" and reports[0]["decided"]
        assert all(report["buckets"] == reports[0]["buckets"] for report in reports)
        for bucket in reports[0]["buckets"]:
            assert bucket["level"] in ("flat", "two levels") and set(bucket["levels_s"]) == {"flat", "two levels"}
        assert reports[0]["link"]["intra_bits_per_second"] > 0 and "steps to a quality target" in reports[0]["reason"]
        # the measured steps ran top-k flat, in two levels, flat: both residuals went to the chosen method
        assert all(r[run]["held"] <= r[run]["chosen"] for r in results)
        for outs in zip(*(r[run]["outs"] for r in results), strict=True):
            assert all(torch.equal(outs[0][k], out[k]) for out in outs for k in SHAPES)
    assert all(b["spec"].endswith("@node") for b in results[0]["node"]["report"]["buckets"])
    assert results[0]["node"]["report"]["link"]["intra_bits_per_second"] == pytest.approx(1e10)


def test_a_two_level_memory_is_saved_loaded_and_moves_to_one_level_as_its_share_of_the_whole() -> None:
    from gradpress.exchange.hierarchy import Layout

    two_nodes = Layout(1, 4, 2)

    def fresh(rank: int = 1, world: int = 4, layout: Layout | None = two_nodes) -> AutoPipeline:
        return AutoPipeline(AutoOptions(candidates=("topk:ratio=0.1",)), Options(), rank, world, layout)

    auto = fresh()
    measure = MEASURE_WITH
    assert auto.names == ("none", measure, f"{measure}@node", "topk:ratio=0.1", "none@node", "topk:ratio=0.1@node")
    auto.shapes["w"] = (30, 20)
    auto.pipeline("topk:ratio=0.1@node").inner.feedback.give("w", torch.ones(15, 20))  # local rank 1's shard
    auto.choice["w"] = "topk:ratio=0.1@node"
    state = auto.state_dict()
    again = fresh()
    again.load_state_dict(copy.deepcopy(state))
    node = again._pipelines["topk:ratio=0.1@node"]
    assert node.steps is again.steps and node.stats is again.stats and node.inner.stats is again.stats
    again._switch("w", "topk:ratio=0.1@node", "topk:ratio=0.1")  # k·e on this rank's shard, carried
    whole = again._pipelines["topk:ratio=0.1"].feedback._memory["w"]
    assert float(whole.sum()) == 2 * 15 * 20 and float(whole.abs().sum()) == 2 * 15 * 20
    with pytest.warns(UserWarning):
        flat = fresh(1, 2, None)
        flat.load_state_dict(copy.deepcopy(state), on_world_size_change="reset")
    assert flat.choice == {"w": "topk:ratio=0.1"} and "topk:ratio=0.1@node" not in flat._pipelines
