"""Single-process tests of the runtime: options, strategies and the overflow guard through
``simulate`` (which runs the real protocols in lockstep), the driver's ordering rule, state, stats, and
the Communicator and DDP hook on a one-process Gloo group."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import gradpress
from gradpress.core.compressor import NonFiniteError
from gradpress.core.packet import adjacent, concat, pack, unpack
from gradpress.core.rng import Context
from gradpress.exchange.driver import Driver, ExchangeFailed
from gradpress.exchange.pipeline import Options, Pipeline, Stats
from gradpress.exchange.protocol import AllReduce, Round, fold_sum, parallel
from gradpress.exchange.strategy import sum_dtype
from gradpress.exchange.strategy.allreduce import takes_out
from gradpress.kernels.jit import numba_disabled
from test_runtime_compressors import LeaderTopK, PowerIteration, UniformInt, WideInt


def grads(n: int, shapes=((6, 7), (13,)), seed: int = 0, dtype=torch.float32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{f"t{i}": torch.randn(s, generator=g).to(dtype) for i, s in enumerate(shapes)} for _ in range(n)]


# -- options -------------------------------------------------------------------------------------------
def test_options_are_checked():
    with pytest.raises(TypeError, match="unknown option.*bogus.*the options are"):
        Options.of(bogus=1)
    for bad in ({"mode": "mesh"}, {"min_numel": -1}, {"overflow": "wrap"}, {"timeout": 0},
                {"feedback": "nope"}, {"partial": 0.5}, {"mode": "ps", "partial": 0}):
        with pytest.raises(ValueError):
            Options.of(**bad)
    assert Options.of(exclude="conv1.*").exclude == ("conv1.*",)


# -- strategies through simulate -------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_uncompressed_average_is_the_rank_order_sum(n, dtype):
    """Each worker sends g / n in its own dtype (as PyTorch's DDP divides before its all-reduce), and
    the rank-order sum of those is the mean, bit for bit; a cast sums first and divides in float32."""
    workers = grads(n, dtype=dtype)
    out = gradpress.simulate("none", workers)
    for key in workers[0]:
        expected = fold_sum([w[key] / n for w in workers])
        assert out[key].dtype == dtype and torch.equal(out[key], expected)
    if dtype != torch.float32:
        cast = gradpress.simulate("fp16" if dtype == torch.float16 else "bf16", workers)
        for key in workers[0]:
            expected = (fold_sum([w[key] for w in workers]).float() / n).to(dtype)
            assert torch.equal(cast[key], expected)


def test_allgather_decodes_every_packet_in_rank_order():
    n, spec = 3, "topk:ratio=0.2"
    workers = grads(n)
    out = gradpress.simulate(spec, workers, seed=5)
    c = gradpress.make(spec)
    for key in workers[0]:
        packets = [c.compress(w[key], Context(5, 0, key, r)) for r, w in enumerate(workers)]
        assert torch.equal(out[key], c.aggregate(packets))


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize("spec", ["thc", "thc_uniform", "sketch", "powersgd:rank=2,min_compression_rate=0",
                                  "randomk:ratio=0.3,scale=true"])
def test_decode_sum_writes_the_mean_into_out(spec, numba):
    """Compressor.decode_sum's ``out`` (a DDP bucket, which then needs no copy): a method that decodes
    into a new float32 tensor writes the same bits into a contiguous float32 ``out`` and returns it, on
    the numba path and the torch one (what CUDA tensors take); an ``out`` it cannot take (another dtype
    or size) is left alone."""
    with contextlib.nullcontext() if numba else numba_disabled():
        _decode_sum_writes_the_mean_into_out(spec)


def _decode_sum_writes_the_mean_into_out(spec: str) -> None:
    c = gradpress.make(spec)
    x = torch.randn(96, 80, generator=torch.Generator().manual_seed(3))
    packet = c.compress(x, Context(0, 0, "w", 0))
    summed = [t if t.dtype == torch.bool else 2 * t for t in c.summands(packet)]  # two workers' alike
    expected = c.decode_sum(packet, [t.clone() for t in summed], 2)
    out = torch.full_like(x, float("nan"))
    mean = c.decode_sum(packet, [t.clone() for t in summed], 2, out=out)
    assert mean.data_ptr() == out.data_ptr() and mean.shape == x.shape
    assert torch.equal(mean, expected) and torch.equal(out, expected)
    for other in (torch.full_like(x, 7.0, dtype=torch.float64), torch.full((x.numel() + 1,), 7.0)):
        assert torch.equal(c.decode_sum(packet, [t.clone() for t in summed], 2, out=other), expected)
        assert bool((other == 7.0).all())
    half = c.compress(x.bfloat16(), Context(0, 0, "w", 0))  # a bf16 gradient's: cast from the float32 mean
    summed = [t if t.dtype == torch.bool else 2 * t for t in c.summands(half)]
    expected = c.decode_sum(half, [t.clone() for t in summed], 2)
    mean = c.decode_sum(half, [t.clone() for t in summed], 2, out=torch.empty_like(x))
    assert mean.dtype == torch.bfloat16 and torch.equal(mean, expected)


def test_decode_sum_without_out_still_serves_the_all_reduce():
    """A method whose decode_sum predates ``out`` is called without it (the 3-rank DDP test runs one)."""
    assert takes_out(gradpress.make("thc")) and takes_out(gradpress.make("none"))
    assert not takes_out(WideInt(bound=100))


def test_feedback_memory_carries_over_steps():
    n, spec = 2, "topk:ratio=0.1"
    sim = gradpress.Simulator(spec, n)
    c, memory = gradpress.make(spec), [torch.zeros(30), torch.zeros(30)]
    for step in range(3):
        workers = [torch.randn(30, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(n)]
        out = sim.step(workers)
        packets = []
        for r in range(n):
            x = workers[r] + memory[r]
            packets.append(c.compress(x, Context(0, step, "", r)))
            memory[r] = x - c.decompress(packets[-1])
        assert torch.equal(out, c.aggregate(packets))


def test_exclude_min_numel_and_warmup_leave_tensors_uncompressed():
    n = 3
    workers = [{"conv1.weight": torch.randn(40), "fc.weight": torch.randn(40), "fc.bias": torch.randn(4)}
               for _ in range(n)]
    exact = {k: fold_sum([w[k] / n for w in workers]) for k in workers[0]}  # uncompressed: g / n summed
    sim = gradpress.Simulator("topk:ratio=0.1", n, exclude=["conv1.*"], min_numel=10, warmup_steps=1)
    first, second = sim.step(workers), sim.step(workers)
    for key in exact:
        assert torch.equal(first[key], exact[key])  # warm-up step: all exact
    assert torch.equal(second["conv1.weight"], exact["conv1.weight"])
    assert torch.equal(second["fc.bias"], exact["fc.bias"])
    assert (second["fc.weight"] != 0).sum() <= 3 * 4  # top-4 of 40 from each of 3 workers


def test_a_thousand_workers():
    n, spec = 1024, "randomk:ratio=0.1,scale=true"
    workers = [torch.randn(64, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    out = gradpress.simulate(spec, workers)
    c = gradpress.make(spec)
    packets = [c.compress(w, Context(0, 0, "", r)) for r, w in enumerate(workers)]
    summed = fold_sum([p["values"] for p in packets])
    assert torch.equal(out, c.decode_sum(packets[0], [summed], n))


def test_parameter_server_equals_collectives_bitwise():
    workers = grads(3)
    for spec in ["none", "topk:ratio=0.2", "randomk:ratio=0.3"]:
        collective = gradpress.simulate(spec, workers, seed=1)
        for root in (0, 2):
            server = gradpress.simulate(spec, workers, seed=1, mode="ps", root=root)
            assert all(torch.equal(collective[k], server[k]) for k in workers[0]), (spec, root)


def test_master_recompresses_the_aggregate():
    """Bidirectional compression (Natural paper Algorithm 1): g = C_M(Σ Δ_i / n) broadcast."""
    workers = grads(3)
    mean = gradpress.simulate("randomk:ratio=0.5", workers, seed=2)
    out = gradpress.simulate("randomk:ratio=0.5", workers, seed=2, mode="ps", root=1, master="topk:ratio=0.25")
    master = gradpress.make("topk:ratio=0.25")
    for key in workers[0]:
        expected = master.decompress(master.compress(mean[key], Context(2, 0, key + "/master", 1)))
        assert torch.equal(out[key], expected)


def test_switch_adds_integers_only():
    workers = grads(3)
    collective = gradpress.simulate(UniformInt(), workers)
    switch = gradpress.simulate(UniformInt(), workers, mode="switch")
    assert all(torch.equal(collective[k], switch[k]) for k in workers[0])
    with pytest.raises(ValueError, match="integers only"):
        gradpress.simulate("none", workers, mode="switch")
    with pytest.raises(ValueError, match="not summable"):
        gradpress.simulate("topk", workers, mode="switch")
    with pytest.raises(ValueError, match="cannot re-compress"):
        gradpress.simulate(UniformInt(), workers, mode="switch", master="topk")


def test_preliminary_max_gives_every_worker_the_global_range():
    """THC Algorithm 1 lines 1-4: quantize on the global range; the sum of codes decodes once."""
    n = 3
    workers = grads(n)
    out = gradpress.simulate(UniformInt(), workers, seed=4)
    c = UniformInt()
    for key in workers[0]:
        bound = max(float(w[key].abs().max()) for w in workers)
        packets = [c.compress(w[key], Context(4, 0, key, r), prepared=torch.tensor([bound]))
                   for r, w in enumerate(workers)]
        summed = sum(p["codes"].to(torch.int32) for p in packets)
        assert torch.equal(out[key], c.decode_sum(packets[0], [summed], n))
        assert (out[key] - sum(w[key] for w in workers) / n).abs().max() <= 2 * bound / c.levels


def test_leader_broadcast_picks_the_leaders_indices():
    n = 3
    sim = gradpress.Simulator(LeaderTopK(ratio=0.1), n)
    for step in range(3):
        workers = [torch.randn(50, generator=torch.Generator().manual_seed(7 * step + r)) for r in range(n)]
        out = sim.step(workers)
        support = out.nonzero().squeeze(1)
        assert support.numel() <= 5  # one index set for everyone: k = 5 values in all
        if step == 0:  # no error-feedback memory yet: exactly the leader's (rank 0's) own top-5
            assert set(support.tolist()) == set(workers[0].abs().topk(5).indices.tolist())


def test_overflow_guard_widens_or_raises_never_wraps():
    workers = [torch.full((16,), 5.0) for _ in range(3)]  # every code at its bound: 100 each
    assert sum_dtype(torch.uint8, 2 * 100, "widen", "w") == torch.uint8
    assert sum_dtype(torch.uint8, 3 * 100, "widen", "w") == torch.int32
    assert sum_dtype(torch.int8, 127, "widen", "w") == torch.int8
    assert sum_dtype(torch.int16, 50, "raise", "w") == torch.int8  # backends lack int16; no overflow
    with pytest.raises(OverflowError, match="overflow='raise'"):
        sum_dtype(torch.uint8, 300, "raise", "w")
    with pytest.raises(OverflowError, match="int64 at most"):
        sum_dtype(torch.int64, 2**63, "widen", "w")
    for mode in ("collective", "switch"):
        sim = gradpress.Simulator(WideInt(bound=100), 3, mode=mode)
        out = sim.step(workers)  # 300 would wrap to 44 in uint8
        assert torch.equal(out, torch.full((16,), 5.0))
        assert sim.stats()[0]["last"]["sent_bytes"] >= 16 * 4  # summed as int32
        with pytest.raises(OverflowError):
            gradpress.simulate(WideInt(bound=100), workers, mode=mode, overflow="raise")
    with pytest.raises(ValueError, match="max_summand"):
        gradpress.simulate(WideInt.__new__(_Unbounded), workers)


class _Unbounded(WideInt):
    max_summand = None  # type: ignore[assignment]


class _Redundant(WideInt):
    """WideInt's codes plus a float32 side tensor on the wire that the sum does not need (as PowerSGD's
    P̂, the same on every worker): its packets are larger than its summands."""

    def expected_nbytes(self, numel, dtype=torch.float32):
        return 5 * numel

    def _compress(self, flat, ctx):
        packet = super()._compress(flat, ctx)
        packet.tensors["side"] = flat.float()
        return packet

    def summands(self, packet):
        return [packet["codes"]]


def test_server_uploads_the_smaller_of_packets_and_summands():
    """THC Fig. 4: workers upload their packets and the server computes the summands, when that is
    smaller (uint8 codes vs int32 sums of 3·100); otherwise the summands go up (Q alone, not P̂ and Q).
    The upload carries the worker's fault flag (one byte, padded to 8), the sums the server's n flag
    slots (in their dtype)."""
    xs = [torch.randn(16, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    for compressor, mode, upload, download in [(WideInt(bound=100), "switch", 16 + 8, 16 * 4 + 3 * 4),
                                               (_Redundant(bound=15), "ps", 16 + 8, 16 + 3)]:
        sim = gradpress.Simulator(compressor, 3, mode=mode)
        out = sim.step(xs)
        assert torch.equal(out, gradpress.simulate(compressor, xs))  # the same sums as an all-reduce
        worker = sim.stats()[1]["last"]
        assert (worker["sent_bytes"], worker["received_bytes"]) == (upload, download), compressor


def test_diverging_workers_are_caught():
    class Moody(UniformInt):
        def prepare(self, flat, ctx, world_size):
            mine = super().prepare(flat, ctx, world_size)
            return gradpress.Preliminary(mine.values, "min") if ctx.rank == 1 else mine

    with pytest.raises(RuntimeError, match="different collectives|diverged"):
        gradpress.simulate(Moody(), grads(2))


@pytest.mark.parametrize("mode", ["collective", "ps"])
def test_nonfinite_found_in_the_aggregate_of_uncompressed_sums(mode):
    """A bad value on one worker is flagged in-band and every worker raises naming that rank; a sum
    that overflows is found in the aggregate; and the mean is the same bits as ``div_``'s: of each
    worker's gradient before it is sent (``divides_first``, as PyTorch's DDP), at a server too."""
    workers = grads(3)
    workers[1]["t0"][2, 3] = float("inf")
    with pytest.raises(NonFiniteError, match=r"'t0'.*NaN/Inf in the gradient of rank 1$") as raised:
        gradpress.simulate("none", workers, mode=mode)
    assert raised.value.ranks == [1]
    big = [{"w": torch.full((5,), 40000.0, dtype=torch.float16)} for _ in range(2)]
    with pytest.raises(OverflowError, match="overflowed"):
        gradpress.simulate("fp16", big, feedback="none", mode=mode)
    top = [{"w": torch.full((5,), 65504.0, dtype=torch.float16)} for _ in range(3)]  # fp16's largest
    with pytest.raises(OverflowError, match="overflowed"):  # divided first or not, 3·65504/3 rounds to Inf
        gradpress.simulate("none", top, mode=mode)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):  # two halves of the largest: no overflow
        largest = torch.finfo(dtype).max
        pair = [{"w": torch.tensor([largest, -largest, largest], dtype=dtype)} for _ in range(2)]
        mean = gradpress.simulate("none", pair, mode=mode)["w"]
        assert torch.equal(mean, pair[0]["w"]), dtype  # the sum of the checked halves is checked no further
    clean = grads(3, shapes=((1000,),))
    expected = fold_sum([w["t0"] / 3 for w in clean])
    assert torch.equal(gradpress.simulate("none", clean, mode=mode)["t0"], expected)


@pytest.mark.parametrize("workers", [2, 4])
def test_dividing_first_gives_the_bits_of_dividing_the_sum_for_a_power_of_two(workers):
    """Scaling by 2⁻ᵏ is exact (no subnormals here), so g/n summed is Σg then /n, bit for bit."""
    clean = grads(workers, shapes=((3000,),))
    expected = fold_sum([w["t0"] for w in clean]).div_(workers)
    assert torch.equal(gradpress.simulate("none", clean)["t0"], expected)


def test_nonfinite_input_is_checked_before_a_memory_takes_it():
    sim = gradpress.Simulator("fp16", 2)  # residual feedback by default: the input is checked first
    sim.step(grads(2, shapes=((4,),)))
    memory = sim.state_dict()
    bad = grads(2, shapes=((4,),), seed=1)
    bad[0]["t0"][1] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN/Inf in the gradient of rank 0"):
        sim.step(bad)
    for before, after in zip(memory, sim.state_dict(), strict=True):
        for key, e in before["feedback"]["memory"].items():
            assert torch.equal(e, after["feedback"]["memory"][key])


def test_state_dict_resumes_bit_identically():
    steps = [grads(3, seed=s) for s in range(4)]
    whole = gradpress.Simulator("topk:ratio=0.2", 3)
    outs = [whole.step(s) for s in steps]
    first = gradpress.Simulator("topk:ratio=0.2", 3)
    for s in steps[:2]:
        first.step(s)
    resumed = gradpress.Simulator("topk:ratio=0.2", 3)
    resumed.load_state_dict(first.state_dict())
    for s, expected in zip(steps[2:], outs[2:], strict=True):
        out = resumed.step(s)
        assert all(torch.equal(out[k], expected[k]) for k in expected)
    with pytest.raises(ValueError, match="spec is 'topk:ratio=0.2'"):
        gradpress.Simulator("randomk", 3).load_state_dict(first.state_dict())


def test_stats_count_packets_and_traffic():
    n = 4
    sim = gradpress.Simulator("topk:ratio=0.25", n)
    sim.step([torch.randn(64) for _ in range(n)])  # k = 16: 64 bytes of values, 64 of indices
    last = sim.stats()[0]["last"]
    assert last["raw_bytes"] == 256 and last["packet_bytes"] == 128
    # ring all-gather of each worker's packet and its fault flag (one byte, padded to 8)
    assert last["sent_bytes"] == last["received_bytes"] == (n - 1) * (128 + 8)
    assert last["collectives"] == 1 and sim.stats()[0]["steps"] == 1
    assert sim.stats()[0]["pattern"] == "allgather"


# -- building blocks ---------------------------------------------------------------------------------------
def test_pack_unpack_round_trip_with_alignment():
    tensors = [torch.arange(3, dtype=torch.uint8), torch.randn(2, 3), torch.tensor([True, False]), torch.arange(5)]
    buffer = pack(tensors, torch.device("cpu"), size=200)
    assert buffer.numel() == 200
    back = unpack(buffer, [(t.dtype, tuple(t.shape)) for t in tensors])
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True))


def test_concat_views_adjacent_writable_tensors():
    base = torch.randn(10)
    parts = [base[:4], base[4:]]
    assert concat(parts, {base.untyped_storage().data_ptr()}).data_ptr() == base.data_ptr()
    copied = concat(parts, set())
    assert copied.data_ptr() != base.data_ptr() and torch.equal(copied, base)


def test_adjacent_needs_back_to_back_tensors_of_one_dtype():
    base = torch.randn(10)
    storage = {base.untyped_storage().data_ptr()}
    assert adjacent([base[:4], base[4:]], storage).data_ptr() == base.data_ptr()
    assert adjacent([base[:4], base[5:]], storage) is None  # a gap
    assert adjacent([base[4:], base[:4]], storage) is None  # out of order
    assert adjacent([base[:4], base[4:].view(torch.int32)], storage) is None  # another dtype
    assert adjacent([base[:4], base[4:]], set()) is None  # not writable


@pytest.mark.parametrize("spec, options, as_one", [
    ("none", {}, True),
    ("bf16", {"feedback": "none"}, True),
    ("bf16", {}, False),  # a residual memory is keyed per tensor
    ("natural", {}, False),  # per-tensor random streams
    ("none", {"mode": "ps", "partial": 0.5}, False),  # per-tensor arrivals
    ("topk:ratio=0.5", {"min_numel": 100}, True),  # the small, plain ones travel as one
])
def test_elementwise_exchanges_a_bucket_as_one_tensor(spec, options, as_one):
    """A DDP bucket's gradients (views of its buffer, back to back) travel as one flat view of the
    buffer when that gives the same result as tensor by tensor; results are checked against simulate
    by the 3-process tests."""
    bucket = torch.randn(4 + 6 + 5)
    items = [("a", bucket[:4].view(2, 2)), ("b", bucket[4:10].view(2, 3)), ("c", bucket[10:])]
    groups = Pipeline(gradpress.make(spec), Options(**options), 0, 2).groups(items, bucket=bucket)
    assert [g.flat is not None for g in groups] == [as_one]
    if as_one:
        assert groups[0].flat.data_ptr() == bucket.data_ptr() and groups[0].flat.numel() == bucket.numel()
    assert Pipeline(gradpress.make(spec), Options(**options), 0, 2).groups(items)[0].flat is None  # no bucket: no view


class _Later:
    """An executor whose collectives complete (or fail) when told to, on torch futures, as a process
    group's do."""

    def issue(self, round_, sent, done):
        from gradpress.exchange.distributed import Handle

        results = [r.tensor for r in round_.requests]

        class Work:  # what a process group's async collective returns
            def __init__(self):
                self.source = torch.futures.Future()

            def get_future(self):
                return self.source

        work = Work()
        self.complete = lambda: work.source.set_result(None)
        self.fail = lambda: work.source.set_exception(RuntimeError("Connection closed by peer"))
        return Handle([work], lambda: results, done)


def test_driver_decodes_and_assembles_in_one_callback_and_keeps_the_error():
    def decodes(fail):
        (total,) = yield Round([AllReduce(torch.ones(2))], final=True)
        if fail:
            raise NonFiniteError("the aggregate holds NaN")
        return total / 2

    executor = _Later()
    driver = Driver(executor, Stats())
    future = driver.start(decodes(False), 0, then=lambda mean: mean.sum())
    assert not future.done()
    executor.complete()
    assert float(driver.wait(future)) == 1.0

    future = driver.start(decodes(True), 1)
    executor.complete()
    with pytest.raises(RuntimeError):  # what a backend thread's callback error becomes in the future
        future.wait()
    with pytest.raises(NonFiniteError, match="holds NaN"):  # the driver re-raises the original
        driver.wait(future)
    with pytest.raises(ExchangeFailed):
        driver.check()

    driver = Driver(executor, Stats())  # a collective that fails (a dead peer) is recorded as well
    future = driver.start(decodes(False), 2)
    executor.fail()
    with pytest.raises(RuntimeError, match="Connection closed"):
        driver.wait(future)
    with pytest.raises(ExchangeFailed, match="Connection closed"):
        driver.check()


def _two_rounds(name, log):
    (a,) = yield Round([AllReduce(torch.ones(1), "max")])
    log.append(f"{name} resumed")
    (b,) = yield Round([AllReduce(torch.ones(1))], final=True)
    return name


class _Recorder:
    """An executor that completes every collective at once and records the order of issue."""

    def __init__(self, log):
        self.log = log

    def issue(self, round_, sent, done):
        self.log.append(("final" if round_.final else "first", len(round_.requests)))
        results = [r.tensor for r in round_.requests]

        class Handle:
            def wait(self):
                return results

            def future(self, then, failed=None):
                f = torch.futures.Future()
                f.set_result(then(results))
                return f

        return Handle()


def test_driver_issues_later_rounds_only_when_advanced():
    """DESIGN invariant 3: later rounds of in-flight groups are issued at advance(), in start order,
    never from a completion callback whose timing differs between ranks."""
    log: list = []
    driver = Driver(_Recorder(log), Stats())
    first = driver.start(_two_rounds("a", log), 0)
    second = driver.start(_two_rounds("b", log), 0)
    assert log == [("first", 1), ("first", 1)]
    driver.advance()
    assert log[2:] == ["a resumed", ("final", 1), "b resumed", ("final", 1)]
    assert first.wait() == "a" and second.wait() == "b"


def test_parallel_merges_rounds_in_order():
    def proto(rounds, tag):
        for i in range(rounds):
            yield Round([AllReduce(torch.tensor([tag]))], final=i == rounds - 1)
        return tag

    merged = parallel([proto(1, 1.0), proto(2, 2.0)])
    first = next(merged)
    assert [float(r.tensor) for r in first.requests] == [1.0, 2.0] and not first.final
    second = merged.send([None, None])
    assert [float(r.tensor) for r in second.requests] == [2.0] and second.final
    with pytest.raises(StopIteration) as stop:
        merged.send([None])
    assert stop.value.value == [1.0, 2.0]


# -- one-process Gloo group: Communicator and DDP hook ------------------------------------------------
@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_communicator_reduces_and_reports(world_of_one):
    comm = gradpress.Communicator("none", timeout=10)
    x = torch.randn(5, 3)
    kept = x.clone()
    assert torch.equal(comm.reduce(x, "x"), x) and torch.equal(x, kept)
    model = nn.Linear(4, 2)
    model.bias.requires_grad_(False)
    comm.reduce_gradients(model)  # no backward yet: gradients count as zeros
    assert torch.equal(model.weight.grad, torch.zeros(2, 4)) and model.bias.grad is None
    with pytest.raises(NonFiniteError, match="'bad'"):
        comm.reduce(torch.tensor([float("nan")]), "bad")
    with pytest.raises(ExchangeFailed):
        comm.reduce(x, "x")


@pytest.mark.parametrize("spec", ["thc", "topk:ratio=0.3", "fp16", "none"])
def test_communicator_averages_gradients_in_their_own_storage(world_of_one, spec):
    """reduce_gradients lets the exchange overwrite the gradients: they end as reduce_many's averages of the
    same values, in their own storage, THC's decode and top-k's mean written there by the method (no copy)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 5))
    model(torch.randn(8, 40)).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    expected = gradpress.Communicator(spec, timeout=10).reduce_many(grads)
    storage = {name: p.grad.data_ptr() for name, p in model.named_parameters()}
    gradpress.Communicator(spec, timeout=10).reduce_gradients(model)
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, expected[name]) and p.grad.data_ptr() == storage[name], name
    if spec in ("thc", "topk:ratio=0.3"):
        items = [(name, g.clone()) for name, g in grads.items()]
        averaged = gradpress.Communicator(spec, timeout=10)._reduce(items, writable=True)
        assert all(averaged[name].data_ptr() == g.data_ptr() for name, g in items)


def test_ddp_hook_and_register(world_of_one):
    assert gradpress.register_compressor is gradpress.core.compressor.register
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    state = gradpress.register(ddp, "topk:ratio=0.5", exclude=["0.*"])
    ddp(torch.randn(3, 6)).sum().backward()
    saved = state.state_dict()
    assert set(saved["steps"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert set(saved["feedback"]["memory"]) == {"2.weight", "2.bias"}  # 0.* excluded: uncompressed
    assert state.stats()["total"]["collectives"] >= 1
    with pytest.raises(ValueError, match="model="):
        gradpress.ddp_comm_hook("topk", exclude=["0.*"])


def test_two_round_method_with_warm_start():
    """PowerSGD's shape: P all-reduced (preliminary sum), then Q; the averaged Q is the next warm start,
    kept in the compressor's own state (saved and restored with the runtime's). With a warm start the
    steps are successive power iterations, so the rank-1 error falls to the best rank-1 error."""
    n = 3
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(8, 8, generator=g)).Q
    v = torch.linalg.qr(torch.randn(6, 6, generator=g)).Q
    target = 3.0 * torch.outer(u[:, 0], v[:, 0]) + 2.7 * torch.outer(u[:, 1], v[:, 1])
    workers = [{"w": target * (0.5 + 0.5 * r)} for r in range(n)]  # their mean is the target
    sim = gradpress.Simulator(PowerIteration(), n, feedback="none")
    errors = [float((sim.step(workers)["w"] - target).norm()) for _ in range(12)]
    assert all(later < earlier for earlier, later in zip(errors, errors[1:], strict=False))
    assert errors[0] > 2.8 and errors[-1] < 2.71  # best rank-1 error: 2.7
    warm = [p.compressor.state_dict()["warm"]["w"] for p in sim.pipelines]
    assert all(torch.equal(w, warm[0]) for w in warm)  # every worker holds the same warm start
    assert "warm" in sim.state_dict()[1]["compressor"]
