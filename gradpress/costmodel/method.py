"""Each candidate's measured cost on the profiled buckets (see :mod:`gradpress.testbed.advise`): compress
and decompress times through :class:`gradpress.Simulator`, ``Packet.nbytes``, and the collectives that
carry each bucket."""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from gradpress.core.compressor import make
from gradpress.costmodel import network as costmodel
from gradpress.costmodel.network import BucketStep, Phase
from gradpress.costmodel.profile import ComputeProfile
from gradpress.simulation import Simulator

if TYPE_CHECKING:
    from gradpress.costmodel.nodes import Topology
    from gradpress.costmodel.quality import CompressionError

#: the row every speed-up is relative to: DDP's built-in all-reduce of the fp32 buckets
BASELINE = "torch-allreduce"


@dataclass(frozen=True)
class Transfer:
    """One collective of a bucket's exchange: ``strategy`` (:data:`~gradpress.costmodel.STRATEGIES`)
    on ``nbytes`` per worker. Integer summands of ``dtype`` whose largest value is ``bound`` widen as n
    workers' sums grow (:func:`gradpress.exchange.strategy.sum_dtype`); ``per_worker`` bytes are added per worker
    (the fault-flag slots of a preliminary reduction)."""

    strategy: str
    nbytes: float
    dtype: str | None = None
    bound: int | None = None
    per_worker: float = 0.0

    def phase(self, n: int) -> Phase:
        nbytes = self.nbytes
        if self.dtype is not None and self.bound is not None:
            from gradpress.exchange.strategy import sum_dtype

            narrow = getattr(torch, self.dtype)
            wide = sum_dtype(narrow, self.bound * n, "widen", "advise")
            nbytes *= _itemsize(wide) / _itemsize(narrow)
        return Phase(self.strategy, nbytes + self.per_worker * n)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(frozen=True)
class BucketCost:
    """A method's measured cost on one bucket: seconds on the hook's thread (``compress_s``) and decoding
    (``decompress_s``, among the method's ``measured_workers``), ``Packet.nbytes``, and its collectives."""

    compress_s: float
    decompress_s: float
    packet_bytes: float
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class LocalStep:
    """A method's real DDP step among ``workers`` processes of this machine over loopback (``advise
    --local-workers``, :mod:`~gradpress.testbed.advise.local`), measured as ``compare`` measures its steps
    (:func:`gradpress.testbed.train.metered_step`), medians in seconds at the local run's typical speed
    (:func:`~gradpress.testbed.advise.local.at_typical_speed`): ``step_s`` from one step's start to the
    next's, ``compute_s``, ``compression_s`` (compress and decompress: the runtime's statistics) and
    ``communication_s`` (time in the collectives, the loopback's)."""

    workers: int
    step_s: float
    compute_s: float
    compression_s: float
    communication_s: float

    def scaled(self, factor: float) -> LocalStep:
        """Every time of this step times ``factor``: the same step on a machine running that much slower."""
        return LocalStep(self.workers, self.step_s * factor, self.compute_s * factor, self.compression_s * factor,
                         self.communication_s * factor)

    @property
    def rest_s(self) -> float:
        """The step's time outside compute, compression and collectives: the hook's own work, its hand-offs
        between threads, the batch."""
        return max(0.0, self.step_s - self.compute_s - self.compression_s - self.communication_s)


@dataclass(frozen=True)
class MethodCost:
    """A method's measured per-bucket costs (in the profile's bucket order). ``decode_grows``: decoding
    handles one packet per worker (all-gather), so it scales with n / ``measured_workers``.
    ``sent_bytes``: what the Simulator counted as sent by worker 0 per step (its traffic pattern at
    ``measured_workers``), kept beside the priced bytes. ``local``: the method's real step with
    ``--local-workers`` (:func:`~gradpress.testbed.advise.ranking.calibrated`), or None."""

    spec: str
    exchange: str
    feedback: str
    buckets: tuple[BucketCost, ...]
    measured_workers: int = 2
    decode_grows: bool = False
    sent_bytes: float | None = None
    local: LocalStep | None = None

    @property
    def packet_bytes(self) -> float:
        """``Packet.nbytes`` per step and worker: GRACE's data volume."""
        return sum(b.packet_bytes for b in self.buckets)

    def decompress_at(self, bucket: BucketCost, n: int) -> float:
        return bucket.decompress_s * n / self.measured_workers if self.decode_grows else bucket.decompress_s

    def compression_at(self, n: int) -> float:
        """Seconds of compression and decoding per step among ``n`` workers."""
        return sum(b.compress_s + self.decompress_at(b, n) for b in self.buckets)

    def scaled(self, factor: float) -> MethodCost:
        """Each bucket's compression and decoding seconds times ``factor`` (its bytes and collectives as
        they are): the method's CPU work on a machine running ``factor`` times slower."""
        return replace(self, buckets=tuple(replace(b, compress_s=b.compress_s * factor,
                                                   decompress_s=b.decompress_s * factor) for b in self.buckets))

    def steps(self, profile: ComputeProfile, n: int) -> list[BucketStep]:
        """The buckets as the cost model takes them, among ``n`` workers."""
        if len(self.buckets) != len(profile.buckets):
            raise ValueError(f"{self.spec}: costs of {len(self.buckets)} buckets for a profile of "
                             f"{len(profile.buckets)}")
        return [BucketStep(b.ready_s, c.compress_s, tuple(t.phase(n) for t in c.transfers),
                           self.decompress_at(c, n))
                for b, c in zip(profile.buckets, self.buckets, strict=True)]

    def wire_bytes(self, n: int) -> float:
        """Bytes through each worker's link per step among ``n`` workers (the collectives' critical path)."""
        return sum(costmodel.communication_cost([t.phase(n) for t in c.transfers], n).nbytes
                   for c in self.buckets)

    def node_phases(self, bucket: BucketCost, topology: Topology) -> tuple[Phase, ...]:
        """The collectives that carry ``bucket`` on ``topology``: flat, among its N·k ranks; in two levels,
        those of a rank's 1/k shard among the N nodes (:mod:`~gradpress.costmodel.nodes`): its bytes
        divided by k (a method's packets in proportion to what it compresses), integer sums widened
        for the N nodes' sums (each node's mean is summed across nodes)."""
        if not topology.hierarchical:
            return tuple(t.phase(topology.workers) for t in bucket.transfers)
        k = topology.local_size
        return tuple(replace(t, nbytes=t.nbytes / k).phase(topology.nodes) for t in bucket.transfers)

    def node_steps(self, profile: ComputeProfile, topology: Topology) -> list[BucketStep]:
        """The buckets as the cost model takes them on ``topology`` (:mod:`~gradpress.costmodel.nodes`):
        flat, :meth:`steps` among its N·k ranks; in two levels, each rank compresses and decodes its 1/k
        shard of every bucket, priced in proportion (compression ÷ k; decoding ÷ k, and an all-gather's
        grown with the N packets it decodes), exchanges it among the N nodes (:meth:`node_phases`), and
        the bucket's bytes cross inside the node (``BucketStep.nbytes``)."""
        if len(self.buckets) != len(profile.buckets):
            raise ValueError(f"{self.spec}: costs of {len(self.buckets)} buckets for a profile of "
                             f"{len(profile.buckets)}")
        if not topology.hierarchical:
            return [replace(step, nbytes=float(b.nbytes))
                    for step, b in zip(self.steps(profile, topology.workers), profile.buckets, strict=True)]
        k = topology.local_size
        return [BucketStep(b.ready_s, c.compress_s / k, self.node_phases(c, topology),
                           self.decompress_at(c, topology.nodes) / k, float(b.nbytes))
                for b, c in zip(profile.buckets, self.buckets, strict=True)]

    def link_bytes(self, topology: Topology) -> float:
        """Bytes per step through a node's link on ``topology`` (the busiest node's, on the collectives'
        critical path: :func:`~gradpress.costmodel.nodes.node_link_bytes`); with one rank a node and flat,
        :meth:`wire_bytes`."""
        from gradpress.costmodel.nodes import node_link_bytes

        return sum(node_link_bytes(self.node_phases(c, topology), topology) for c in self.buckets)


def baseline_cost(profile: ComputeProfile, local: LocalStep | None = None) -> MethodCost:
    """``torch-allreduce``: DDP's own hook all-reduces each bucket's bytes and compresses nothing
    (``local``: its real step with ``--local-workers``)."""
    buckets = tuple(BucketCost(0.0, 0.0, b.nbytes, (Transfer("allreduce", b.nbytes),))
                    for b in profile.buckets)
    return MethodCost(BASELINE, "allreduce", "none", buckets, measured_workers=1, local=local)


def transfers_of(compressor: Any, items: Sequence[tuple[str, torch.Tensor]], workers: int, seed: int = 0,
                 packet_bytes: float | None = None) -> tuple[Transfer, ...]:
    """The collectives that carry one bucket of ``items`` (package doc): preliminary values grouped by op,
    source and dtype; then the summands of an all-reduce grouped by dtype, or an all-gather of the packed
    packets (``packet_bytes`` when measured, since their size may depend on the data and the memory),
    after a sizes header when their sizes are not fixed. One worker's packets are formed here to read
    their layout (rank 0, step 0)."""
    from gradpress.core.rng import Context

    items = [(key, t) for key, t in items if t.numel() > 0]
    contexts = [Context(seed, 0, key, 0) for key, _ in items]
    transfers: list[Transfer] = []
    if compressor.prepares:
        groups: dict[tuple, float] = {}
        for (_, tensor), ctx in zip(items, contexts, strict=True):
            pre = compressor.prepare(tensor.detach().contiguous(), ctx, workers)
            if pre is not None:
                group = (pre.op, pre.src if pre.op == "broadcast" else -1, pre.values.dtype)
                groups[group] = groups.get(group, 0.0) + pre.values.numel() * pre.values.element_size()
        flags_given = False
        for (op, _, dtype), nbytes in groups.items():
            if op == "broadcast":
                transfers.append(Transfer("broadcast", nbytes))
            else:
                flags = 0.0 if flags_given else _itemsize(dtype)
                transfers.append(Transfer("allreduce", nbytes, per_worker=flags))
                flags_given = True
    packets = [compressor.compress(tensor.detach(), ctx)
               for (_, tensor), ctx in zip(items, contexts, strict=True)]
    if compressor.exchange == "allreduce":
        summed: dict[torch.dtype, float] = {}
        for packet in packets:
            for t in compressor.summands(packet):
                summed[t.dtype] = summed.get(t.dtype, 0.0) + t.numel() * t.element_size()
        for dtype, nbytes in summed.items():
            widens = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
            bound = compressor.max_summand if widens else None
            name = str(dtype).removeprefix("torch.") if widens else None
            transfers.append(Transfer("allreduce", nbytes, name, bound))
    else:
        wires = [t for p in packets for t in p.wire()]
        fixed = all(compressor.expected_nbytes(p.numel, p.dtype) is not None for p in packets)
        if not fixed:
            transfers.append(Transfer("allgather", 8.0 * (len(wires) + 1)))  # int64 sizes and the fault flag
        own = sum(p.nbytes for p in packets) if packet_bytes is None else packet_bytes
        transfers.append(Transfer("allgather", own + (1 if fixed else 0)))  # + the fault-flag byte
    return tuple(transfers)


@functools.lru_cache(maxsize=256)
def _link_ratios(spec: str, n: int, seed: int = 0) -> tuple[tuple[str, float], ...]:
    """Bytes each strategy carries among ``n`` workers per byte of ``Packet.nbytes``, read from
    :func:`transfers_of` on one synthetic 256 × 256 gradient (the same rule the ranking prices)."""
    compressor = make(spec)
    grad = torch.randn(256, 256, generator=torch.Generator().manual_seed(seed))
    items = [("weight", grad)]
    from gradpress.core.rng import Context

    packet = compressor.compress(grad.clone(), Context(seed, 0, "weight", 0)).nbytes
    if compressor.exchange == "allgather":  # the packets travel as packed (headers: a few bytes a bucket)
        return (("allgather", 1.0),)
    ratios: dict[str, float] = {}
    for transfer in transfers_of(compressor, items, n, seed):
        phase = transfer.phase(n)
        ratios[phase.strategy] = ratios.get(phase.strategy, 0.0) + phase.nbytes / packet
    return tuple(ratios.items())


def link_phases(spec: str, packet_bytes: float, n: int) -> list[Phase]:
    """The collectives that carry ``packet_bytes`` of ``spec``'s packets per worker among ``n`` workers,
    by the rule the ranking prices measured buckets with (:func:`transfers_of`: summands widened for n
    workers' sums — THC's 4-bit indices travel as 8-bit table values, twice the packet —, an all-gather's
    packets and sizes, a preliminary exchange), in proportion to ``Packet.nbytes``: what ``sim cost``
    prices a measured run's bytes per step with."""
    return [Phase(strategy, ratio * packet_bytes) for strategy, ratio in _link_ratios(spec, n)]


def _step_costs(simulator: Simulator, grads: Sequence[Mapping[str, torch.Tensor]]
                ) -> tuple[tuple[float, float, float], float]:
    """One step of ``simulator`` on ``grads`` (a bucket's, per worker): worker 0's (compress seconds,
    decompress seconds, ``Packet.nbytes``) and the bytes it sent."""
    before = simulator.stats()[0]["total"]
    simulator.step(grads)
    after = simulator.stats()[0]["total"]
    costs = (after["compress_s"] - before["compress_s"], after["decompress_s"] - before["decompress_s"],
             after["packet_bytes"] - before["packet_bytes"])
    return costs, after["sent_bytes"] - before["sent_bytes"]


def measure_with_errors(spec: str, profile: ComputeProfile, grads: Mapping[str, torch.Tensor], *,
                        workers: int = 2, seed: int = 0,
                        feedback: str | None = None) -> tuple[MethodCost, tuple[CompressionError, ...]]:
    """``spec``'s costs and its :class:`~gradpress.costmodel.quality.CompressionError` on each of the
    profile's buckets of one worker's gradients ``grads``, in one pass (``auto``'s decision): one worker of
    :class:`gradpress.Simulator` with the runtime's ``feedback``; its first step on each bucket, memory
    empty, gives the bucket's error (as :func:`~gradpress.costmodel.quality.compression_errors`), its
    second step the compress and decompress times and ``Packet.nbytes`` (as :func:`measure_method`,
    with one packet decoded: an all-gather's decoding scales with n); the collectives are those among
    ``workers`` (:func:`transfers_of`)."""
    from gradpress.costmodel.quality import error_of, runs_unbiased

    compressor = make(spec)
    options = {} if feedback is None else {"feedback": feedback}
    simulator = Simulator(spec, 1, seed=seed, warm_up=False, **options)
    unbiased = runs_unbiased(spec, feedback)
    present = [{key: grads[key].detach() for key in bucket.keys if key in grads} for bucket in profile.buckets]
    errors = []
    for bucket in present:
        received = simulator.step([bucket]) if bucket else {}
        errors.append(error_of(bucket, received, unbiased))
    buckets, sent = [], 0.0
    for bucket in present:
        if not bucket:
            buckets.append(BucketCost(0.0, 0.0, 0.0, ()))
            continue
        (compress, decompress, nbytes), bytes_sent = _step_costs(simulator, [bucket])
        sent += bytes_sent
        buckets.append(BucketCost(compress, decompress, nbytes,
                                  transfers_of(compressor, list(bucket.items()), workers, seed, packet_bytes=nbytes)))
    cost = MethodCost(spec, compressor.exchange, compressor.default_feedback if feedback is None else feedback,
                      tuple(buckets), 1, decode_grows=compressor.exchange == "allgather", sent_bytes=sent)
    return cost, tuple(errors)


def measure_method(spec: str, profile: ComputeProfile, grads: Sequence[Mapping[str, torch.Tensor]], *,
                   repeats: int = 3, seed: int = 0) -> MethodCost:
    """``spec``'s costs on the profile's buckets through :class:`gradpress.Simulator` with ``len(grads)``
    workers (package doc): medians over ``repeats`` steps after one warm-up step."""
    workers = len(grads)
    compressor = make(spec)
    simulator = Simulator(spec, workers, seed=seed, warm_up=False)  # (its own warm-up step compiles)
    samples: list[list[tuple[float, float, float]]] = [[] for _ in profile.buckets]
    sent = 0.0
    present = [[key for key in bucket.keys if key in grads[0]] for bucket in profile.buckets]
    for step in range(1 + repeats):
        for b, keys in enumerate(present):
            if not keys:
                continue
            costs, bytes_sent = _step_costs(simulator, [{key: g[key] for key in keys} for g in grads])
            if step:
                samples[b].append(costs)
                sent += bytes_sent
    buckets = []
    for keys, rows in zip(present, samples, strict=True):
        if not rows:
            buckets.append(BucketCost(0.0, 0.0, 0.0, ()))
            continue
        compress, decompress, nbytes = (statistics.median(r[i] for r in rows) for i in range(3))
        items = [(key, grads[0][key]) for key in keys]
        buckets.append(BucketCost(compress, decompress, nbytes,
                                  transfers_of(compressor, items, workers, seed, packet_bytes=nbytes)))
    return MethodCost(spec, compressor.exchange, compressor.default_feedback, tuple(buckets), workers,
                      decode_grows=compressor.exchange == "allgather", sent_bytes=sent / repeats)
