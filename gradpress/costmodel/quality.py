"""What a method costs in steps: a slowdown in steps to a quality target, from its measured compression
error on real gradients (``auto``'s ranking by time to a target, :mod:`gradpress.auto`).

**The measure.** On each bucket's gradients g (one worker's, as the job produced them), a method's
relative compression error ε = ‖g − C(g)‖² / ‖g‖², C(g) being what one worker's exchange returns
(:class:`gradpress.Simulator` with one worker: the method's compression, decoding and, for a method
with error feedback, its first step, memory empty). Over several buckets, or a bucket per method, the
errors add: ε = Σ_b ‖g_b − C_b(g_b)‖² / Σ_b ‖g_b‖² (:class:`CompressionError` per bucket).

**The model** (:func:`steps_factor`): how many times more steps the method needs than the exact mean.

* An **unbiased** method without memory (QSGD, natural compression; E[C(g)] = g, E‖C(g) − g‖² ≤ ω‖g‖²)
  adds ω‖g‖² to the variance of each worker's estimate; the mean of n workers' independent estimates
  has n times less of it. SGD's steps to a target grow with the variance bound: the factor is
  **1 + ω/n** (Alistarh et al., "QSGD", NeurIPS 2017, Theorem 3.4 and its corollaries), ω estimated
  by the measured ε.
* A **biased** method (top-k, PowerSGD, THC, fp16), or any method run with error feedback, is read as
  a δ-contraction, ‖C(g) − g‖² ≤ (1 − δ)‖g‖², with δ = 1 − ε measured: error-feedback SGD converges
  at the rate of SGD with the compression's effect scaled by **1/δ** (Stich & Karimireddy, "The
  error-feedback framework", 2019; Karimireddy et al., "Error feedback fixes SignSGD and other
  gradient compression schemes", ICML 2019, Theorem II); δ is floored at :data:`MIN_DELTA`.
* A step mixing both kinds (a method per bucket): the product of the two factors, each with its
  buckets' error over the whole gradient's norm (a stated heuristic: the bounds are for one compressor).

**Limits.** These are worst-case bounds' factors, not predictions of a training curve: the real
slowdown is usually smaller (top-k with memory often matches SGD after a delay, Stich et al.,
"Sparsified SGD with memory", NeurIPS 2018), so the model errs towards gentler methods. ε is measured
on one step's gradients, with the memory empty (a warm memory, or PowerSGD's warm start, does better
over the steps); a method's effect on generalization, momentum or the learning rate's tuning is not
modelled. ``rank_by="step"`` (:class:`gradpress.auto.AutoOptions`) ranks by step time alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

#: the smallest contraction δ the model takes (a method that keeps nothing would take forever)
MIN_DELTA = 1e-3


@dataclass(frozen=True)
class CompressionError:
    """One bucket's measured error under a method: Σ‖g − C(g)‖² (``squared_error``) and Σ‖g‖²
    (``squared_norm``) over its tensors; ``unbiased``: the method is unbiased and runs without memory
    (its error is variance, averaged down by the workers)."""

    squared_error: float
    squared_norm: float
    unbiased: bool

    @property
    def relative(self) -> float:
        """ε = ‖g − C(g)‖² / ‖g‖² (0 for a zero gradient)."""
        return self.squared_error / self.squared_norm if self.squared_norm > 0 else 0.0


def runs_unbiased(spec: str, feedback: str | None = None) -> bool:
    """Whether ``spec`` is unbiased and runs without error-feedback memory (``feedback``: the runtime's
    option, None for the method's default)."""
    from gradpress.core.compressor import make

    compressor = make(spec)
    memory = compressor.default_feedback if feedback is None else feedback
    return bool(compressor.unbiased) and memory == "none"


def compression_errors(spec: str, buckets: Sequence[Mapping[str, torch.Tensor]], *, seed: int = 0,
                       feedback: str | None = None) -> tuple[CompressionError, ...]:
    """``spec``'s :class:`CompressionError` on each bucket's gradients (``buckets``: key -> gradient),
    through one worker of :class:`gradpress.Simulator` (module doc)."""
    from gradpress.simulation import Simulator

    options = {} if feedback is None else {"feedback": feedback}
    simulator = Simulator(spec, 1, warm_up=False, seed=seed, **options)
    unbiased = runs_unbiased(spec, feedback)
    out = []
    for grads in buckets:
        if not grads:
            out.append(CompressionError(0.0, 0.0, unbiased))
            continue
        exact = {key: g.detach().double() for key, g in grads.items()}
        received = simulator.step([{key: g.detach().clone() for key, g in grads.items()}])
        error = sum(float((exact[key] - received[key].double()).pow(2).sum()) for key in grads)
        norm = sum(float(g.pow(2).sum()) for g in exact.values())
        out.append(CompressionError(error if math.isfinite(error) else math.inf, norm, unbiased))
    return tuple(out)


def steps_factor(errors: Sequence[CompressionError], n: int) -> float:
    """How many times more steps to a quality target than the exact mean (module doc): 1/δ for the
    biased or error-feedback buckets (δ = 1 − their error over the whole gradient's norm, at least
    :data:`MIN_DELTA`) times 1 + ω/n for the unbiased ones (ω their error over the whole norm),
    ``n`` the workers whose independent estimates are averaged."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer ≥ 1, got {n!r}")
    norm = sum(e.squared_norm for e in errors)
    if norm <= 0:
        return 1.0
    biased = sum(e.squared_error for e in errors if not e.unbiased) / norm
    variance = sum(e.squared_error for e in errors if e.unbiased) / norm
    delta = max(MIN_DELTA, 1.0 - biased) if math.isfinite(biased) else MIN_DELTA
    omega = variance if math.isfinite(variance) else 1.0 / MIN_DELTA
    return (1.0 / delta) * (1.0 + omega / n)
