"""Error-feedback memory (GRACE Section 3.2, Eq. 5), keyed per tensor.

GRACE writes memory compensation and update as

    φ_t = β·m_t + γ·g_t             (compensate)
    m_{t+1} = φ_t − C⁻¹(C(φ_t))      (update: what compression dropped)

``none`` leaves gradients alone; ``residual`` is Eq. 5 with β = γ = 1 by default (the error-feedback
SGD of Seide et al. and Karimireddy et al.). The memory is a ``state_dict()`` that saves and loads like
an optimizer's.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

from gradpress.core.compressor import add_into
from gradpress.core.registry import Registry, check_params_of, format_spec, param

if TYPE_CHECKING:
    from gradpress.core.compressor import Compressor
    from gradpress.core.packet import Packet


_MISSING = object()


class SumParts(NamedTuple):
    """What :meth:`Feedback.sum_parts` hands the runtime: φ = β·m + γ·g is to be formed in ``out``."""

    memory: torch.Tensor
    out: torch.Tensor
    beta: float = 1.0
    gamma: float = 1.0


class Feedback:
    """Base class: per-key memory with ``compensate`` before compression and ``update`` after.

    A memory keeps its state in dict fields keyed by tensor name and replaces an entry on update,
    never writing into a stored tensor: then :meth:`snapshot` and :meth:`restore` put the entries of
    an exchange that failed back as they were (references, no copies)."""

    name: ClassVar[str] = ""
    #: the update keeps what compression dropped, :meth:`~gradpress.core.compressor.Compressor.residual` of φ
    #: and its packet, and reads φ for nothing else: a compressor may then form it in its own pass, into
    #: the buffer φ is formed in (:meth:`~gradpress.core.compressor.Compressor.compress_residual_sum`, handed to
    #: :meth:`update_residual`), or, for a method with a preliminary exchange, which needs φ formed first,
    #: into φ's own storage (:attr:`~gradpress.core.compressor.Compressor.fuses_residual`: THC)
    keeps_residual: ClassVar[bool] = False

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """The tensor to compress in place of ``grad``."""
        return grad

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        """Record what compression dropped: ``compensated`` went in, ``transmitted`` came out."""

    def sum_parts(self, key: str, grad: torch.Tensor) -> SumParts | None:
        """``(m, out, β, γ)`` when :meth:`compensate` would return φ = β·m + γ·g (torch's bits of
        ``m * β + g * γ``) formed in ``out`` (a float32 buffer of the key's that nobody else holds): the
        runtime then lets the compressor form that sum in the pass that reads the input anyway
        (:meth:`~gradpress.core.compressor.Compressor.compress_sum`) and hands ``out``, then holding φ, to
        :meth:`update_from` as an owned tensor. None (the default): call :meth:`compensate`."""
        return None

    def update_from(self, key: str, compensated: torch.Tensor, packet: Packet, compressor: Compressor,
                    owned: bool = False) -> None:
        """:meth:`update` from ``packet = compressor.compress(compensated)`` (what the runtime calls).
        ``owned``: ``compensated`` is a tensor :meth:`compensate` made, which nobody else holds. By
        default it decompresses the packet; a memory that needs only the difference asks the
        compressor for it (:meth:`Compressor.residual`), which sparse methods form in O(k)."""
        self.update(key, compensated, compressor.decompress(packet))

    def update_residual(self, key: str, residual: torch.Tensor) -> None:
        """The update of a memory that :attr:`keeps_residual`, from the residual e = φ − C⁻¹(C(φ))
        itself (float32, in the ``out`` buffer :meth:`sum_parts` gave, which it may keep)."""
        raise TypeError(f"{self.name or type(self).__name__}: keeps no residual")

    @property
    def updates(self) -> bool:
        """Whether this memory keeps anything (``none`` does not)."""
        cls = type(self)
        return cls.update is not Feedback.update or cls.update_from is not Feedback.update_from

    @property
    def inert(self) -> bool:
        """Whether this memory leaves gradients as they are and keeps nothing (``none``): then the
        keys it is called with do not matter."""
        return not self.updates and type(self).compensate is Feedback.compensate

    def snapshot(self, keys: list[str]) -> list[tuple[dict, dict]]:
        """The current entries of ``keys`` in every per-key dict of this memory."""
        keyed: list[Any] = [getattr(self, f.name) for f in fields(self)] if is_dataclass(self) else []
        return [(d, {key: d.get(key, _MISSING) for key in keys}) for d in keyed if isinstance(d, dict)]

    def restore(self, snapshot: list[tuple[dict, dict]]) -> None:
        """Put back the entries :meth:`snapshot` saw (an exchange failed: its step never happened)."""
        for keyed, entries in snapshot:
            for key, value in entries.items():
                if value is _MISSING:
                    keyed.pop(key, None)
                else:
                    keyed[key] = value

    def take(self, key: str) -> torch.Tensor | None:
        """Remove ``key``'s state; return its residual e (float32: what compression dropped and no step has
        sent yet) when this memory keeps one, else None. ``auto`'s switch of methods carries e to the
        next method's memory or sends it once (:mod:`gradpress.auto`). Memories whose state is not such a
        residual (a momentum, a filter) drop it."""
        for keyed, _ in self.snapshot([key]):
            keyed.pop(key, None)
        return None

    def give(self, key: str, residual: torch.Tensor) -> bool:
        """Add ``residual`` (from :meth:`take` of another memory) to what ``key`'s next steps send;
        False when this memory keeps no residual (the caller then sends it at once)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    @property
    def spec(self) -> str:
        return format_spec(self)


def compress_with(feedback: Feedback, compressor: Compressor, key: str, grad: torch.Tensor,
                  ctx: Any = None) -> Packet:
    """One worker's compensate, compress and memory update for ``key``, as the runtime makes them
    (:meth:`gradpress.exchange.pipeline.Pipeline._protocol`, less its NaN/Inf protocol): φ formed in the
    compressor's pass where :meth:`Feedback.sum_parts` allows it. Returns the packet."""
    parts = feedback.sum_parts(key, grad) if feedback.updates and not compressor.prepares else None
    formed = False
    if parts is None:
        x = feedback.compensate(key, grad)
        packet = compressor.compress(x if x.dtype == grad.dtype else x.to(grad.dtype), ctx)
    elif feedback.keeps_residual:
        x = parts.out
        packet, formed = compressor.compress_residual_sum(parts.memory, grad, x, ctx, parts.beta, parts.gamma)
    else:
        x = parts.out
        packet = compressor.compress_sum(parts.memory, grad, x, ctx, parts.beta, parts.gamma)
    if formed:
        feedback.update_residual(key, x)
    elif feedback.updates:
        feedback.update_from(key, x, packet, compressor, owned=x is not grad)
    return packet


feedback_registry: Registry[Feedback] = Registry("feedback")


def make_feedback(spec: str, **overrides: Any) -> Feedback:
    """Build a feedback memory from a spec: ``"none"``, ``"residual"``, ``"residual:beta=0.9"``."""
    return feedback_registry.make(spec, **overrides)


def feedback_names() -> list[str]:
    return feedback_registry.names()


@feedback_registry.register("none")
@dataclass
class NoFeedback(Feedback):
    """No memory: what compression drops is lost (right for unbiased compressors)."""


@dataclass
class KeyedMemory(Feedback):
    """Base of the memories that keep one float32 tensor per key (the residual, a momentum): lookup
    with a shape check, and the ``state_dict`` under :attr:`state_name`."""

    state_name: ClassVar[str] = "memory"
    _memory: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def memory(self, key: str) -> torch.Tensor | None:
        """The tensor stored for ``key`` (None before its first update)."""
        return self._memory.get(key)

    def _stored_for(self, key: str, grad: torch.Tensor) -> torch.Tensor | None:
        memory = self._memory.get(key)
        if memory is not None and memory.shape != grad.shape:
            raise ValueError(f"{self.name} memory for {key!r} has shape {tuple(memory.shape)}, "
                             f"the gradient {tuple(grad.shape)}")
        return memory

    def state_dict(self) -> dict[str, Any]:
        return {self.state_name: {key: value.clone() for key, value in self._memory.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._memory = {key: value.clone() for key, value in state.get(self.state_name, {}).items()}


def spare_for(spares: dict[str, torch.Tensor], key: str, like: torch.Tensor) -> torch.Tensor:
    """``spares[key]``, made anew (like ``like``) when missing or of another shape or device."""
    spare = spares.get(key)
    if spare is None or spare.shape != like.shape or spare.device != like.device:
        spare = spares[key] = torch.empty_like(like)
    return spare


@feedback_registry.register("residual")
@dataclass
class Residual(KeyedMemory):
    """GRACE Eq. 5: φ = β·m + γ·g; m ← φ − decompress(compress(φ)).

    The memory is kept in float32 whatever the gradient's dtype, so fp16/bf16 residuals don't lose
    the small values they exist to keep.
    """

    beta: float = param(1.0, "[0, 1]")
    gamma: float = param(1.0, "(0, inf)")
    keeps_residual = True
    _spare: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_params_of(self)  # also when built directly, not from a spec

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """φ = β·m + γ·g, a new float32 tensor (the memory's dtype wins the promotion). With β = γ = 1
        it is formed in a spare buffer of the key's, the previous memory's storage once an update has
        taken φ over (see :meth:`update_from`): no large allocation per step."""
        memory = self._stored_for(key, grad)
        scaled = grad if self.gamma == 1.0 else grad * self.gamma
        if memory is None:
            return scaled
        if self.beta == 1.0 and self.gamma == 1.0:
            spare = self._spare.pop(key, None)
            if spare is None or spare.shape != memory.shape:
                spare = torch.empty_like(memory)
            return add_into(memory, grad, spare)
        phi = memory * self.beta if self.beta != 1.0 else memory
        return phi + scaled

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        self._memory[key] = compensated.float() - transmitted.float()

    def sum_parts(self, key: str, grad: torch.Tensor) -> SumParts | None:
        """(m, the key's spare buffer, β, γ), a float32 gradient beside a stored memory on its device:
        see :meth:`Feedback.sum_parts`."""
        memory = self._stored_for(key, grad)
        if memory is None or grad.dtype != torch.float32 or memory.device != grad.device:
            return None
        return SumParts(memory, spare_for(self._spare, key, memory), self.beta, self.gamma)

    def update_from(self, key: str, compensated: torch.Tensor, packet: Packet, compressor: Compressor,
                    owned: bool = False) -> None:
        """m ← φ − C⁻¹(C(φ)), asked of the compressor (O(k) for sparse methods, in φ's storage when
        ``owned``); the previous memory becomes the key's spare buffer."""
        self.update_residual(key, compressor.residual(compensated, packet, owned).view(compensated.shape))

    def update_residual(self, key: str, residual: torch.Tensor) -> None:
        """m ← e (kept as it is); the previous memory becomes the key's spare buffer."""
        previous = self._memory.get(key)
        self._memory[key] = residual
        if previous is not None and previous.data_ptr() != residual.data_ptr():
            self._spare[key] = previous

    def take(self, key: str) -> torch.Tensor | None:
        """Remove and return m, the residual not sent yet (float32; None before the key's first update)."""
        self._spare.pop(key, None)
        memory = self._memory.pop(key, None)
        return None if memory is None else memory.float()

    def give(self, key: str, residual: torch.Tensor) -> bool:
        """m ← m + ``residual``: the next step compensates with it (a new entry, as every update)."""
        memory = self._memory.get(key)
        residual = residual.float()
        self._memory[key] = residual if memory is None else memory + residual.to(memory.device)
        return True
