"""What a method costs in steps: a slowdown in steps to a quality target, from its measured compression
error on real gradients (``auto``'s ranking by time to a target, :mod:`gradpress.auto`).

**The measure.** On each bucket's gradients g (one worker's, as the job produced them), a method's
relative compression error ε = ‖g − C(g)‖² / ‖g‖², C(g) being what one worker's exchange returns
(:class:`gradpress.Simulator` with one worker: the method's compression, decoding and, for a method
with error feedback, its first step, memory empty). Over several buckets, or a bucket per method, the
errors add: ε = Σ_b ‖g_b − C_b(g_b)‖² / Σ_b ‖g_b‖² (:class:`CompressionError` per bucket).

**The model** (:func:`steps_factor`): how many times more steps the method needs than the exact mean.

* An **unbiased** method without memory (QSGD, natural compression; E[C(g)] = g, E‖C(g) − g‖² ≤ ω‖g‖²)
  adds ω·E‖g‖² to the variance of each worker's estimate, where the exact mean has the minibatch noise
  σ² = E‖g − ∇f‖² alone; both are averaged over the n workers alike, so SGD's steps to a target, which
  grow with the variance bound (Alistarh et al., "QSGD", NeurIPS 2017, Theorem 3.4 and its corollaries),
  grow by **1 + ω·E‖g‖²/σ² = 1 + ω/(1 − ρ)**, ρ = ‖∇f‖²/E‖g‖² the gradient's signal fraction (the
  inverse of the "noise scale" of McCandlish et al., "An empirical model of large-batch training",
  2018). ω is estimated by the measured ε, ρ from one worker's gradient and the exact average of the n
  workers' of the same step (:func:`signal_fraction_of_mean`: the two batch sizes' estimate of ‖∇f‖²;
  ``auto`` reads ‖average‖² on an eighth of the values, scaled),
  and from two consecutive steps' gradients of one worker (:func:`signal_fraction`: ⟨g₁, g₂⟩ estimates
  ‖∇f‖² where their noises are independent); ``auto`` takes the mean of those it has. In two levels
  a node compresses the sum of its k ranks' gradients, whose noise is k times smaller:
  **1 + ω·(1 + k·ρ/(1 − ρ))**. Unknown ρ is taken as 0 (noise only: the smallest factor, 1 + ω).
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
over the steps), ρ on one pair of steps; a method's effect on generalization, momentum or the learning
rate's tuning is not modelled. ``rank_by="step"`` (:class:`gradpress.auto.AutoOptions`) ranks by step time alone.
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
        received = simulator.step([{key: g.detach() for key, g in grads.items()}]) if grads else {}
        out.append(error_of(grads, received, unbiased))
    return tuple(out)


def error_of(grads: Mapping[str, torch.Tensor], received: Mapping[str, torch.Tensor],
             unbiased: bool) -> CompressionError:
    """The :class:`CompressionError` of ``received`` (what one worker's exchange returned) against the
    gradients ``grads`` it was given (key -> tensor)."""
    error = sum(squares(g.detach() - received[key].to(g.dtype)) for key, g in grads.items())
    norm = sum(squares(g.detach()) for g in grads.values())
    return CompressionError(error if math.isfinite(error) else math.inf, norm, unbiased)


def _wide(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 or float64 (a narrower float, or an integer, as float32)."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """⟨a, b⟩, accumulated as :func:`squares`."""
    wide = _wide(a).flatten()
    dot = float(torch.dot(wide, _wide(b).flatten().to(wide.dtype)))
    return dot if math.isfinite(dot) else float(torch.dot(a.double().flatten(), b.double().flatten()))


def squares(tensor: torch.Tensor) -> float:
    """‖tensor‖², accumulated in float32 or float64 (float64 where float32 overflows)."""
    norm = float(torch.linalg.vector_norm(_wide(tensor)))
    if math.isinf(norm):
        norm = float(torch.linalg.vector_norm(tensor.double()))
    return norm * norm


def signal_fraction(first: Mapping[str, torch.Tensor], second: Mapping[str, torch.Tensor]) -> float:
    """ρ = ‖∇f‖²/E‖g‖² from two consecutive minibatch gradients of one worker (key -> gradient, the keys
    both hold): ⟨g₁, g₂⟩ over the mean of ‖g₁‖² and ‖g₂‖², clamped to [0, 1 − :data:`MIN_DELTA`]; 0 when
    they share no key or both are zero (module doc)."""
    keys = [key for key in first if key in second]
    dot = sum(_dot(first[k], second[k]) for k in keys)
    total = sum(squares(first[k]) + squares(second[k]) for k in keys) / 2
    if not keys or not total > 0 or not math.isfinite(dot / total):
        return 0.0
    return min(max(dot / total, 0.0), 1.0 - MIN_DELTA)


def signal_fraction_of_mean(own_squares: float, mean_squares: float, n: int) -> float:
    """ρ = ‖∇f‖²/E‖g‖² from one step: ``own_squares`` = ‖g‖² of one worker's minibatch gradient and
    ``mean_squares`` = ‖ḡ‖² of the exact average of the ``n`` workers' (a batch n times larger). Their
    expectations are ‖∇f‖² + tr Σ/b and ‖∇f‖² + tr Σ/(n·b), so ‖∇f‖² ≈ (n‖ḡ‖² − ‖g‖²)/(n − 1): the
    unbiased estimate from two batch sizes of McCandlish et al., "An empirical model of large-batch
    training", 2018, Appendix A.1, over ‖g‖²; clamped to [0, 1 − :data:`MIN_DELTA`]; 0 for one worker
    or a zero gradient."""
    if n < 2 or not own_squares > 0 or not math.isfinite(own_squares) or not math.isfinite(mean_squares):
        return 0.0
    signal = (n * mean_squares - own_squares) / ((n - 1) * own_squares)
    return min(max(signal, 0.0), 1.0 - MIN_DELTA)


def variance_factor(signal: float, local_size: int = 1) -> float:
    """E‖x‖²/σ² of what a method compresses against the exact mean's noise (module doc): 1/(1 − ρ) for a
    worker's gradient, 1 + k·ρ/(1 − ρ) for the sum of a node's k ranks (``local_size``)."""
    rho = min(max(signal, 0.0), 1.0 - MIN_DELTA)
    return 1.0 + local_size * rho / (1.0 - rho)


def steps_factor(errors: Sequence[CompressionError], *, signal: float = 0.0,
                 local_sizes: Sequence[int] | None = None) -> float:
    """How many times more steps to a quality target than the exact mean (module doc): 1/δ for the
    biased or error-feedback buckets (δ = 1 − their error over the whole gradient's norm, at least
    :data:`MIN_DELTA`) times 1 + ω for the unbiased ones, ω their error over the whole norm, each
    bucket's amplified by :func:`variance_factor` of the signal fraction ``signal`` and its node size
    (``local_sizes``, a bucket's k when it runs in two levels; default 1 each)."""
    sizes = list(local_sizes) if local_sizes is not None else [1] * len(errors)
    if len(sizes) != len(errors) or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in sizes):
        raise ValueError(f"local_sizes must hold an integer ≥ 1 per bucket, got {local_sizes!r}")
    norm = sum(e.squared_norm for e in errors)
    if norm <= 0:
        return 1.0
    biased = sum(e.squared_error for e in errors if not e.unbiased) / norm
    variance = sum(e.squared_error * variance_factor(signal, k) for e, k in zip(errors, sizes, strict=True)
                   if e.unbiased) / norm
    delta = max(MIN_DELTA, 1.0 - biased) if math.isfinite(biased) else MIN_DELTA
    omega = variance if math.isfinite(variance) else 1.0 / MIN_DELTA
    return (1.0 / delta) * (1.0 + omega)
