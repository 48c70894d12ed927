"""Small, unregistered compressors that exercise the runtime hooks the seed methods need, so the
runtime's tests cover them before THC, CLT-k and PowerSGD exist:

* :class:`UniformInt`: uniform THC's shape (THC Algorithm 1): a preliminary max exchange, integer codes
  on the global range, uint8 summands with ``max_summand``, ``decode_sum`` with the offset times count.
* :class:`LeaderTopK`: CLT-k's shape (ScaleCom App. D): the leader t mod n broadcasts its top-k indices,
  every worker sends its values there, summed.
* :class:`PowerIteration`: PowerSGD's shape (Vogels et al. 2019, Algorithm 1): P = M Q all-reduced as a
  preliminary sum, Q = Mᵀ P̂ all-reduced as the packet, the averaged Q kept as the next warm start.
* :class:`WideInt`: integer summands that overflow uint8 for a few workers (the overflow guard).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradpress.compressors.sparsify import keep_count, scatter, topk_indices
from gradpress.core.compressor import Compressor, Preliminary
from gradpress.core.packet import Packet
from gradpress.core.rng import Context, uniform24_torch


@dataclass(repr=False)
class UniformInt(Compressor):
    """Stochastic rounding of x to ``levels + 1`` equally spaced values on [−M, M], M = max over the
    workers of max|x| (a preliminary max exchange); codes are uint8 and sum as integers."""

    levels: int = 15
    name = "test_uniform"
    unbiased = True
    summable = True

    @property
    def max_summand(self) -> int:  # type: ignore[override]
        return self.levels

    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary:
        return Preliminary(x.abs().max().float().view(1), "max")

    def _compress(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor) -> Packet:
        bound = float(prepared[0])
        if bound == 0.0:
            codes = torch.full_like(flat, self.levels // 2, dtype=torch.uint8)
            return Packet({"codes": codes}, flat.shape, flat.dtype, {"bound": 0.0})
        scaled = (flat.float() + bound) * (self.levels / (2 * bound))
        noise = uniform24_torch(flat.numel(), ctx.private_seed("test_uniform"), flat.device)
        codes = torch.floor(scaled + noise).clamp_(0, self.levels).to(torch.uint8)
        return Packet({"codes": codes}, flat.shape, flat.dtype, {"bound": bound})

    def _decompress(self, packet: Packet) -> torch.Tensor:
        bound = packet.meta["bound"]
        return packet["codes"].float() * (2 * bound / self.levels) - bound

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int) -> torch.Tensor:
        bound = packet.meta["bound"]
        mean = summed[0].double() * (2 * bound / self.levels / count) - bound
        return mean.to(packet.dtype).view(packet.shape)


@dataclass(repr=False)
class LeaderTopK(Compressor):
    """The leader (step mod n) picks the top-k indices of its own tensor and broadcasts them; every worker
    sends its values at those indices; the values are summed (a summable packet)."""

    ratio: float = 0.25
    name = "test_leader"
    summable = True

    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary:
        k = keep_count(x.numel(), self.ratio)
        leader = ctx.step % world_size
        mine = topk_indices(x.reshape(-1), k).to(torch.int32) if ctx.rank == leader else torch.zeros(k, dtype=torch.int32)
        return Preliminary(mine, "broadcast", src=leader)

    def _compress(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor) -> Packet:
        return Packet({"values": flat[prepared.long()]}, flat.shape, flat.dtype, {"indices": prepared})

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return scatter(packet["values"], packet.meta["indices"], packet.numel)


@dataclass(repr=False)
class PowerIteration(Compressor):
    """One power iteration of rank ``rank`` with warm start: M (the gradient as rows × rest) ≈ P̂ Qᵀ."""

    rank: int = 1
    name = "test_power"
    summable = True
    _warm: dict = field(default_factory=dict, init=False, repr=False)

    @staticmethod
    def _matrix(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1) if x.dim() >= 2 else x.reshape(-1, 1)

    def prepare(self, x: torch.Tensor, ctx: Context, world_size: int) -> Preliminary:
        m = self._matrix(x).float()
        q = self._warm.get(ctx.key)
        if q is None:
            q = torch.randn(m.shape[1], self.rank, generator=ctx.shared_generator(x.device, "q"), device=x.device)
        return Preliminary(m @ q, "sum")

    def _compress(self, flat: torch.Tensor, ctx: Context, prepared: torch.Tensor) -> Packet:
        p = torch.linalg.qr(prepared.double()).Q.float() if prepared.abs().max() > 0 else prepared
        q = flat.float().view(p.shape[0], -1).t() @ p
        return Packet({"q": q}, flat.shape, flat.dtype, {"p": p, "key": ctx.key})

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return (packet.meta["p"] @ packet["q"].t()).reshape(-1)

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int) -> torch.Tensor:
        q = summed[0] / count
        self._warm[packet.meta["key"]] = q.clone()
        return (packet.meta["p"] @ q.t()).to(packet.dtype).view(packet.shape)

    def state_dict(self) -> dict:
        return {"warm": {k: v.clone() for k, v in self._warm.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._warm = {k: v.clone() for k, v in state["warm"].items()}


@dataclass(repr=False)
class WideInt(Compressor):
    """Deterministic rounding of x·scale to integers in [0, bound], sent as uint8 (no preliminary)."""

    bound: int = 100
    scale: float = 10.0
    name = "test_wide"
    summable = True

    @property
    def max_summand(self) -> int:  # type: ignore[override]
        return self.bound

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return numel  # one uint8 code per value: a fixed wire layout

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        codes = torch.round(flat.float() * self.scale + self.bound / 2).clamp_(0, self.bound).to(torch.uint8)
        return Packet({"codes": codes}, flat.shape, flat.dtype)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return (packet["codes"].float() - self.bound / 2) / self.scale

    def decode_sum(self, packet: Packet, summed: list[torch.Tensor], count: int) -> torch.Tensor:
        mean = (summed[0].double() / count - self.bound / 2) / self.scale
        return mean.to(packet.dtype).view(packet.shape)


# -- the hooks themselves (single process) -----------------------------------------------------------
import pytest  # noqa: E402

import gradpress  # noqa: E402
from gradpress.core.compressor import NonFiniteError  # noqa: E402


def test_prepare_alone_is_a_world_of_one():
    x = torch.randn(50)
    c = UniformInt()
    ctx = Context(seed=1, step=0, key="k", rank=0)
    alone = c.compress(x, ctx)
    given = c.compress(x, ctx, prepared=x.abs().max().view(1))
    assert torch.equal(alone["codes"], given["codes"]) and alone.meta == given.meta
    assert c.prepares and not gradpress.make("topk").prepares


def test_prepared_values_need_a_preparing_compressor():
    with pytest.raises(TypeError, match="no preliminary exchange"):
        gradpress.make("topk").compress(torch.randn(8), prepared=torch.ones(1))


def test_preliminary_op_is_checked():
    with pytest.raises(ValueError, match="sum, max, min or broadcast"):
        gradpress.Preliminary(torch.ones(1), "mean")  # type: ignore[arg-type]


def test_default_hooks_follow_the_facts():
    none, topk = gradpress.make("none"), gradpress.make("topk:ratio=0.5")
    assert none.exchange == "allreduce" and topk.exchange == "allgather"
    x = torch.randn(6, 5)
    packet = none.compress(x)
    assert [t.data_ptr() for t in none.summands(packet)] == [t.data_ptr() for t in packet.wire()]
    # decode_sum of n identical packets' sum is the packet itself
    assert torch.equal(none.decode_sum(packet, [t * 4 for t in packet.wire()], 4), x)
    assert none.state_dict() == {}


def test_nan_is_reported_before_the_preliminary_exchange():
    with pytest.raises(NonFiniteError):
        UniformInt().compress(torch.tensor([1.0, float("inf")]))
