"""Deep Gradient Compression (Lin et al., ICLR 2018; GRACE §3.2 and §4.3).

Four pieces, split between a compressor and its memory:

* **Sparsification** (Algorithm 1): send the elements of the accumulated velocity v with |v| > thr, thr
  chosen to keep a fraction ``ratio`` (0.1 % by default, i.e. 99.9 % sparsity). As the paper does in
  practice, thr is estimated from a random sample (``sample_ratio``, 1 %) by a top-k on the sample;
  there is no adjustment loop (GRACE §5.5: that loop, up to 20 passes, halves throughput). The sample
  is stratified (one position at random in each stratum of consecutive values:
  :func:`~gradpress.compressors.threshold.stratified_threshold`), so the CPU kernel reads it in the pass
  that checks the values for NaN/Inf, and the selection is a second pass.
* **Warm-up training**: the sparsity grows exponentially, 75 %, 93.75 %, 98.4375 %, 99.6 %, over four
  equal stages of ``warmup_steps`` steps in total (the paper's first four epochs), then stays at
  1 − ratio. The stage comes from ``ctx.step``.
* **Momentum correction** and **momentum factor masking** are the ``dgc`` feedback memory:
  u ← m·u + g, v ← v + u, and where an element was sent both u and v are zeroed. The optimizer then runs
  without momentum (GRACE §5.1 trains DGC with plain SGD).
* **Local gradient clipping**: the memory clips each tensor's gradient to the norm ``clip``
  before accumulating it. The paper clips the whole model's gradient to a threshold scaled by N^-1/2
  (N workers); a per-tensor pipeline sees one tensor at a time, so ``clip`` is a per-tensor bound and
  should already include the N^-1/2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from gradpress.compressors.onebit import as_float32
from gradpress.compressors.sparsify import Sparse
from gradpress.compressors.threshold import packet_above, stratified_threshold
from gradpress.core.compressor import check_finite, register
from gradpress.core.feedback import Feedback, feedback_registry
from gradpress.core.packet import Packet
from gradpress.core.registry import check_params_of, param
from gradpress.core.rng import Context

WARMUP_STAGES = 4      # the paper's four warm-up epochs
WARMUP_DENSITY = 0.25  # kept fraction in the first stage, then × 0.25 per stage


@register("dgc")
@dataclass(repr=False)
class DGC(Sparse):
    """Deep Gradient Compression (Lin et al., ICLR 2018): the elements above a sampled threshold, with
    int32 indices (variable size), the sparsity warmed up over ``warmup_steps``.

    Use it with the ``dgc`` memory (its default), whose spec keys are ``momentum`` (0.9), ``clip``
    (none) and ``masking`` (true).
    """

    ratio: float = param(0.001, "(0, 1]")
    sample_ratio: float = param(0.01, "(0, 1]")
    warmup_steps: int = param(0, "[0, inf)")
    kept = "values"
    examples = ("dgc:ratio=0.01", "dgc:ratio=0.01,warmup_steps=8")
    checks_finite = True  # the selecting pass keeps the largest |x|, which shows NaN/Inf

    @property
    def default_feedback(self) -> str:
        return "dgc"

    def density(self, step: int) -> float:
        """The fraction kept at ``step``: 0.25, 0.0625, 0.015625, 0.0039 in the four warm-up stages
        (never below ``ratio``), then ``ratio``."""
        if step >= self.warmup_steps:
            return self.ratio
        stage = step * WARMUP_STAGES // self.warmup_steps
        return max(self.ratio, WARMUP_DENSITY ** (stage + 1))

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        density = self.density(ctx.step)
        x = as_float32(flat)
        threshold, checked = stratified_threshold(x, self.sample_ratio, density, ctx.private_seed("dgc"))
        if threshold != threshold:  # NaN/Inf in x
            check_finite(x, self.spec)
        return packet_above(flat, threshold, self, expected=math.ceil(density * x.numel()), checked=checked)

    def sparse(self, packet: Packet) -> tuple[torch.Tensor, torch.Tensor]:
        return packet["indices"], packet["values"].float()


@feedback_registry.register("dgc")
@dataclass
class DGCMemory(Feedback):
    """DGC's momentum correction, momentum factor masking and local gradient clipping (Lin et al. 2018).

    ``compensate``: g ← g·min(1, clip/‖g‖₂); u ← m·u + g; v ← v + u; compress v.
    ``update``: where the transmitted tensor is non-zero (the sent elements: DGC only sends |v| > thr
    ≥ 0), v ← 0 and, with ``masking``, u ← 0. State in float32, per key.
    """

    momentum: float = param(0.9, "[0, 1)")
    clip: float | None = param(None, "(0, inf)")
    masking: bool = True
    _momentum: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _velocity: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _pending: dict[str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_params_of(self)  # also when built directly, not from a spec

    def compensate(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        g = grad.float()
        if self.clip is not None:  # torch.nn.utils.clip_grad_norm_'s rule, without a host sync
            g = g * (self.clip / (torch.linalg.vector_norm(g) + 1e-6)).clamp(max=1.0)
        u, v = self._momentum.get(key), self._velocity.get(key)
        for name, state in (("momentum", u), ("velocity", v)):
            if state is not None and state.shape != grad.shape:
                raise ValueError(f"dgc {name} for {key!r} has shape {tuple(state.shape)}, "
                                 f"the gradient {tuple(grad.shape)}")
        u = g.clone() if u is None else u * self.momentum + g  # never an alias of the caller's grad
        self._pending[key] = u
        return u if v is None else v + u

    def update(self, key: str, compensated: torch.Tensor, transmitted: torch.Tensor) -> None:
        if key not in self._pending:
            raise RuntimeError(f"dgc: update({key!r}) without a compensate({key!r}) before it")
        sent = transmitted.reshape(compensated.shape) != 0
        u = self._pending.pop(key)
        self._momentum[key] = u.masked_fill(sent, 0.0) if self.masking else u
        self._velocity[key] = compensated.float().masked_fill(sent, 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"momentum": {k: t.clone() for k, t in self._momentum.items()},
                "velocity": {k: t.clone() for k, t in self._velocity.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._momentum = {k: t.clone() for k, t in state.get("momentum", {}).items()}
        self._velocity = {k: t.clone() for k, t in state.get("velocity", {}).items()}
        self._pending = {}
