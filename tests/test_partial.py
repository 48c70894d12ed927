"""Partial aggregation for stragglers (THC Sections 6 and 8.4; option ``partial``): the server combines
⌈q·n⌉ workers' packets per tensor, drawn from the shared stream, and every worker divides by that count.

Hand computations through ``simulate`` for the summing server (THC, uniform THC, uncompressed tensors),
the gathering server (top-k), bidirectional compression; one 4-process Gloo run equal to ``simulate``.
"""
from __future__ import annotations

import math

import pytest
import torch

import gradpress
from dist_utils import run_workers
from gradpress.core.rng import Context
from gradpress.exchange.pipeline import Options
from gradpress.exchange.protocol import fold_sum
from gradpress.exchange.strategy import Strategy, arrival_count
from numerics import gamma

SEED = 5


def arrived(n: int, q: float, key: str, step: int = 0, seed: int = SEED) -> list[int]:
    """The documented rule: ⌈q·n⌉ ranks of a permutation drawn from the shared stream of (seed, step, key)."""
    order = torch.randperm(n, generator=Context(seed, step, key).shared_generator("cpu", "partial"))
    return sorted(order[: math.ceil(round(q * n, 9))].tolist())


def workers(n: int, shapes=((40, 30), (257,)), seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{f"t{i}": torch.randn(s, generator=g) + r for i, s in enumerate(shapes)} for r in range(n)]


def packets_of(c, xs: list[torch.Tensor], key: str, step: int = 0) -> list:
    """Every worker's packet as the runtime makes it (combined preliminary values where there are any)."""
    ctxs = [Context(SEED, step, key, r) for r in range(len(xs))]
    if not c.prepares:
        return [c.compress(x, ctx) for x, ctx in zip(xs, ctxs, strict=True)]
    prelims = [c.prepare(x, ctx, len(xs)) for x, ctx in zip(xs, ctxs, strict=True)]
    assert all(p.op == "max" for p in prelims)
    shared = torch.stack([p.values for p in prelims]).amax(dim=0)
    return [c.compress(x, ctx, prepared=shared) for x, ctx in zip(xs, ctxs, strict=True)]


# -- the arrivals ---------------------------------------------------------------------------------------
def test_arrivals_are_shared_counted_and_drawn_per_tensor_and_step():
    n, q = 10, 0.7
    strategies = [Strategy(gradpress.make("none"), rank, n, mode="ps", partial=q) for rank in range(n)]
    sets = [s.arrivals(Context(SEED, 3, "w", s.rank)) for s in strategies]
    assert all(mine == sets[0] for mine in sets)  # every rank knows the set without a message
    assert len(sets[0]) == 7 == arrival_count(0.7, 10)  # ⌈0.7·10⌉ = 7, although 0.7·10 = 7.000000000000001
    assert sets[0] == arrived(n, q, "w", step=3) and sets[0] == sorted(set(sets[0]))
    others = {tuple(strategies[0].arrivals(Context(SEED, step, key))) for step in range(4) for key in "wvu"}
    assert len(others) > 6  # a different straggler set per step and tensor
    assert arrival_count(0.01, 10) == 1 and arrival_count(0.91, 10) == 10 and arrival_count(1.0, 3) == 3
    assert Strategy(gradpress.make("none"), 0, n, mode="ps").arrivals(Context(SEED, 3, "w")) == list(range(n))


def test_partial_needs_a_server_and_a_fraction():
    xs = workers(3)
    for bad in (0, 0.0, 1.5, -0.2, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            Options.of(mode="ps", partial=bad)
    with pytest.raises(ValueError, match="mode='ps' or 'switch'"):
        gradpress.simulate("thc", xs, partial=0.5)  # collective all-reduce: no server to wait
    with pytest.raises(ValueError, match="mode='ps' or 'switch'"):
        Strategy(gradpress.make("thc"), 0, 3, partial=0.5)
    assert Options.of(partial=1).partial == 1  # q = 1 is fine in every mode


# -- the summing server: THC's partial aggregation -----------------------------------------------------
@pytest.mark.parametrize(("spec", "mode"), [("thc", "ps"), ("thc", "switch"), ("thc_uniform", "switch")])
def test_summing_server_divides_the_arrivals_sum_by_their_count(spec, mode):
    """The result is decode_sum(Σ_{arrivals} T[z], count), bit for bit, which is the mean of the arrivals'
    own decodes up to float rounding (Definition 3); the stragglers' packets leave no trace."""
    n, q = 4, 0.75
    xs = workers(n)
    out = gradpress.simulate(spec, xs, seed=SEED, mode=mode, partial=q, root=1)
    c = gradpress.make(spec)
    for key in xs[0]:
        packets = packets_of(c, [x[key] for x in xs], key)
        ranks = arrived(n, q, key)
        assert len(ranks) == 3
        total = fold_sum([c.summands(packets[r])[0].long() for r in ranks])
        assert torch.equal(out[key], c.decode_sum(packets[0], [total], 3))
        own = [c.decompress(packets[r]).double() for r in ranks]
        mean = sum(own) / 3
        # equal in exact arithmetic; each float32 decode is rounded at most four times (THC: exact
        # butterflies on integers and half-integers, then 1/√n and 2M/(g·n) and their products; uniform
        # THC: float64, then once), γ_4 of each (tests/numerics.py)
        rounding = gamma(4) * (out[key].double().abs() + sum(d.abs() for d in own) / 3)
        assert ((out[key].double() - mean).abs() <= rounding).all()
        straggler = next(r for r in range(n) if r not in ranks)
        far = (xs[straggler][key].double() - mean).abs().max()
        assert (out[key].double() - mean).abs().max() < 0.01 * far


def test_uncompressed_tensors_meet_at_the_same_server():
    """min_numel / exclude / warm-up tensors go uncompressed, to the same server, partially too."""
    n, q = 5, 0.6
    xs = workers(n)
    out = gradpress.simulate("thc", xs, seed=SEED, mode="ps", partial=q, exclude=["t1"])
    ranks = arrived(n, q, "t1")
    assert len(ranks) == 3
    assert torch.equal(out["t1"], fold_sum([xs[r]["t1"] for r in ranks]) / 3)


def test_full_participation_is_unchanged():
    xs = workers(4)
    for spec, mode in [("thc", "ps"), ("thc", "switch"), ("topk:ratio=0.1", "ps")]:
        full = gradpress.simulate(spec, xs, seed=SEED, mode=mode)
        same = gradpress.simulate(spec, xs, seed=SEED, mode=mode, partial=1.0)
        assert all(torch.equal(full[k], same[k]) for k in xs[0])
        if gradpress.make(spec).summable:  # and equal to the all-reduce: the full sum, over n
            collective = gradpress.simulate(spec, xs, seed=SEED)
            assert all(torch.equal(full[k], collective[k]) for k in xs[0])


# -- the gathering server and bidirectional compression -------------------------------------------------
def test_gathering_server_aggregates_the_arrivals_packets():
    n, q = 4, 0.5
    xs = workers(n)
    out = gradpress.simulate("topk:ratio=0.1", xs, seed=SEED, mode="ps", partial=q)
    c = gradpress.make("topk:ratio=0.1")
    for key in xs[0]:
        packets = packets_of(c, [x[key] for x in xs], key)
        ranks = arrived(n, q, key)
        assert torch.equal(out[key], c.aggregate([packets[r] for r in ranks]))


def test_master_recompresses_the_partial_mean():
    n, q, root = 4, 0.75, 2
    xs = workers(n)
    out = gradpress.simulate("thc", xs, seed=SEED, mode="ps", partial=q, root=root, master="topk:ratio=0.25")
    c, master = gradpress.make("thc"), gradpress.make("topk:ratio=0.25")
    for key in xs[0]:
        packets = packets_of(c, [x[key] for x in xs], key)
        ranks = arrived(n, q, key)
        total = fold_sum([c.summands(packets[r])[0].long() for r in ranks])
        mean = c.decode_sum(packets[0], [total], len(ranks))
        expected = master.decompress(master.compress(mean, Context(SEED, 0, key + "/master", root)))
        assert torch.equal(out[key], expected)


# -- a real run: 4 Gloo processes equal simulate ----------------------------------------------------------
CONFIGS = [
    ("thc", {"mode": "ps", "partial": 0.75}),
    ("thc_uniform", {"mode": "switch", "partial": 0.5, "root": 3}),
    ("topk:ratio=0.1", {"mode": "ps", "partial": 0.75, "root": 1}),
    ("thc", {"mode": "ps", "partial": 0.5, "master": "randomk:ratio=0.5", "min_numel": 100}),
]
STEPS = 2


def _local(rank: int, step: int) -> dict[str, torch.Tensor]:
    mine = {key: x + step for key, x in workers(4, seed=10 + step)[rank].items()}
    return mine | {"b": torch.full((7,), rank + 0.5)}  # "b": below min_numel in one config


def _exchanges(rank: int, world_size: int) -> list:
    results = []
    for spec, options in CONFIGS:
        comm = gradpress.Communicator(spec, seed=SEED, **options)
        results.append([comm.reduce_many(_local(rank, step)) for step in range(STEPS)])
    return results


def test_gloo_run_equals_simulate():
    ranks = run_workers(_exchanges, 4, timeout=180)
    for (spec, options), *runs in zip(CONFIGS, *ranks, strict=True):
        sim = gradpress.Simulator(spec, 4, seed=SEED, **options)
        for step in range(STEPS):
            expected = sim.step([_local(r, step) for r in range(4)])
            for run in runs:
                for key, value in expected.items():
                    assert torch.equal(run[step][key], value), (spec, options, step, key)
