"""Floating-point tolerances for the tests: from the dtype's epsilon and the problem's size and conditioning,
never from what one CPU printed.

BLAS libraries (OpenBLAS, MKL, …), SIMD widths and thread counts add the terms of a product or a reduction
in different orders, with or without fused multiply-adds, so a floating-point result is only as exact as
the worst of those orders allows. The bounds are Higham's (*Accuracy and Stability of Numerical
Algorithms*, 2nd ed., SIAM 2002), with u = eps/2 the unit roundoff (fl(a ∘ b) = (a ∘ b)(1 + δ), |δ| ≤ u):

* a sum or dot product of n terms, in any order: |fl(Σ) − Σ| ≤ γ_{n−1}·Σ|terms| (γ_n for a dot product),
  γ_n = n·u / (1 − n·u) (§3.1, Eq. 3.4–3.5; §4.2 for sums);
* a matrix product with inner dimension k: |fl(A·B) − A·B| ≤ γ_k·|A|·|B| elementwise (§3.5, Eq. 3.13).

Bit-exact promises (simulate == a real run, numba == torch) are checked with ``torch.equal``, not here.
"""
from __future__ import annotations

import math

import torch


def eps(dtype: torch.dtype = torch.float32) -> float:
    """Machine epsilon of ``dtype`` (2u: the gap between 1 and the next number)."""
    return torch.finfo(dtype).eps


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u = eps/2: the largest relative error of one rounding to nearest."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's γ_n = n·u / (1 − n·u): the relative error bound of n roundings in a row (Lemma 3.1)."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"gamma({n}) is unbounded in {dtype}: n·u = {nu} ≥ 1")
    return nu / (1 - nu)


def sum_error(terms: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound on the rounding error of Σ terms computed in ``dtype`` in any order:
    γ_{n−1}·Σ|terms| (Higham §4.2), as a float64 tensor."""
    magnitude = sum(t.double().abs() for t in terms)
    return gamma(max(len(terms) - 1, 1), dtype) * magnitude


def log2ceil(n: int) -> int:
    """⌈log2 n⌉ (0 for n ≤ 1): the depth of a pairwise sum or of a fast Walsh-Hadamard transform."""
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def mean_error(terms: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound on the rounding error of the mean of ``terms`` computed in ``dtype``: the sum in any
    order, then a division by n (or a product with a rounded 1/n), γ_{n+1}·Σ|terms| / n, as float64."""
    magnitude = sum(t.double().abs() for t in terms)
    return gamma(len(terms) + 1, dtype) * magnitude / len(terms)


def rht_residual_error(d: int, x: torch.Tensor, decoded: torch.Tensor) -> float:
    """A first-order bound on the 2-norm of the difference between two float32 evaluations of the residual
    x − R⁻¹(q̂) of a randomized Hadamard transform R with blocks of at most ``d`` = 2^L values, q̂ the
    dequantized codes and ``decoded`` = R⁻¹(q̂): THC's decoder (R⁻¹ of the centred codes, then the scale,
    then x minus that) and its compression's fused form (R(x), r' = R(x) − q̂, then R⁻¹(r')).

    An orthonormal transform of L butterfly stages and one scaling: each stage's roundings (at most u
    relative per value) add at most u·‖input‖₂ to the 2-norm error once scaled, (L + 1)·u·‖x‖₂ in all.
    The fused form: R(x), (L + 1)·u·‖x‖₂; r', u·‖r'‖₂ + u·‖q̂‖₂; R⁻¹(r'), (L + 1)·u·‖r'‖₂. The decoder:
    (L + 2)·u·‖q̂‖₂, then u·‖x − decoded‖₂. With ‖r'‖₂ ≤ ‖x‖₂ + ‖q̂‖₂ and ‖q̂‖₂ = ‖decoded‖₂ (up to its own
    rounding): (2L + 6)·u·(‖x‖₂ + ‖decoded‖₂). Each block's bound holds on its own, so their sum in
    quadrature holds for the whole vector."""
    stages = max(0, d.bit_length() - 1)
    return (2 * stages + 6) * unit_roundoff() * (float(x.double().norm()) + float(decoded.double().norm()))


def powersgd_step_error(deltas: list[torch.Tensor], qt: torch.Tensor) -> float:
    """A first-order bound, in Frobenius norm, on how far one float32 PowerSGD step from Qᵀ = ``qt`` on the
    workers' Δ_w lands from the same step in exact arithmetic, for each of the aggregate P̂ P̂ᵀ mean(Δ_w),
    the memories Δ_w − P̂ P̂ᵀ Δ_w and the mean Q, whatever order each sum is taken in. Higham's bounds,
    u = eps/2:

    * P = Σ_w Δ_w Q, n products and W workers per value (and Δ_w = g_w + e_w's own rounding):
      ‖δP‖_F ≤ γ_{n+W+1}·‖Σ_w |Δ_w||Q|‖_F; Householder QR adds a backward error γ_{2mr}·‖P‖₂ (Higham
      Thm 19.4; at rank 1 P / ‖P‖ adds less, γ_{m+2}·‖P‖₂). Together they turn span(P̂) by
      sin θ ≤ (‖δP‖ + γ_{2mr}‖P‖₂) / σ_r(P) (Wedin): the conditioning of the step, large when Q is nearly
      orthogonal to the row space (cancellation in Δ Q).
    * the products after it: Q_w = Δ_wᵀ P̂ (m products), their mean (W), P̂ Qᵀ (r) and the final rounding,
      γ_{m+W+r+1}·√r relative to the Δ_w (the columns of P̂ are orthonormal: ‖|P̂|‖₂ ≤ √r).
    """
    ds = [d.double().reshape(d.shape[0], -1) for d in deltas]
    w, (m, n), q = len(ds), ds[0].shape, qt.double().t()
    r = q.shape[1]
    p = sum(d @ q for d in ds)
    singular = torch.linalg.svdvals(p)
    rounded = gamma(n + w + 1) * float(sum(d.abs() @ q.abs() for d in ds).norm())
    sin_theta = (rounded + gamma(2 * m * r) * float(singular[0])) / float(singular[r - 1])
    return (sin_theta + gamma(m + w + r + 1) * r**0.5) * max(float(d.norm()) for d in ds)
