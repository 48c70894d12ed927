"""Adaptive threshold SGD (Dryden, Moon, Jacobs and Van Essen, MLHPC 2016; GRACE §3.3 and §4.3).

Instead of 1-bit SGD's fixed threshold, two thresholds τ⁺ and τ⁻ are found for each tensor at each step
so that a proportion α of the positive elements and α of the negative elements are sent; each side
is then decoded to its mean, as in 1-bit SGD. GRACE's implementation sends the selected indices of
each side and the two means, and runs it with error feedback (the ``residual`` default), as Dryden et
al. do.

The thresholds come from a random sample (``sample_ratio``) as in the paper, one per side, with no
adjustment loop; the counts sent are therefore close to, not exactly, α of each side.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gradpress.compressors.onebit import as_float32, fixed_point_scale, mean_of, to_fixed
from gradpress.compressors.threshold import draw_sample
from gradpress.core.compressor import Compressor, register
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context
from gradpress.kernels.jit import as_numpy, jit, use_numba


@register("adaptive")
@dataclass(repr=False)
class Adaptive(Compressor):
    """Adaptive threshold SGD (Dryden et al., MLHPC 2016): the top α of the positive and of the negative
    elements, as int32 indices per side plus one float32 mean per side (variable size). Deterministic
    given the sample stream; biased."""

    alpha: float = param(0.01, "(0, 1]")
    sample_ratio: float = param(0.01, "(0, 1]")
    examples = ("adaptive:alpha=0.1",)

    def thresholds(self, x: torch.Tensor, ctx: Context) -> tuple[float, float]:
        """τ⁺ and τ⁻ (both ≥ 0): about α of the sampled positives lie above τ⁺, of the negatives below −τ⁻."""
        tau_pos, tau_neg = self._thresholds_and_extreme(x, ctx)[:2].tolist()
        return tau_pos, tau_neg

    def _thresholds_and_extreme(self, x: torch.Tensor, ctx: Context) -> torch.Tensor:
        """[τ⁺, τ⁻, min x, max x] on ``x``'s device, for one read by the host (on a GPU, one wait where
        masking the sample, two order statistics and the extreme each took their own). Each threshold
        is :func:`sample_threshold`'s: the (s − keep)-th smallest of the s sampled magnitudes of its
        side, keep = ⌈α·s⌉, or 0 when keep ≥ s."""
        generator = ctx.private_generator(x.device, "adaptive")
        sample = draw_sample(x, self.sample_ratio, generator, self.alpha / 2)  # both sides: about α/2 each
        ordered = sample.float().sort().values  # ascending: the negatives first, the positives last
        total = ordered.numel()
        positives = (ordered > 0).sum()
        negatives = (ordered < 0).sum()
        keep_pos = torch.ceil(positives.double() * self.alpha).long()  # (Python's ceil(α·s), the same double)
        keep_neg = torch.ceil(negatives.double() * self.alpha).long()
        # the positives' (s − keep)-th smallest is the keep-th largest of the sample, at total − 1 − keep;
        # the negatives' magnitudes in ascending order are the sample's first values reversed
        pos = ordered[(total - 1 - keep_pos).clamp(0, max(total - 1, 0))] if total else x.new_zeros(())
        neg = -ordered[keep_neg.clamp(0, max(total - 1, 0))] if total else x.new_zeros(())
        tau_pos = torch.where(keep_pos >= positives, 0.0, pos)
        tau_neg = torch.where(keep_neg >= negatives, 0.0, neg)
        low, high = torch.aminmax(x) if x.numel() else (x.new_zeros(()), x.new_zeros(()))
        return torch.stack([tau_pos, tau_neg, low, high]).float()

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        x = as_float32(flat)
        tau_pos, tau_neg, low, high = self._thresholds_and_extreme(x, ctx).tolist()
        tau_pos, tau_neg = np.float32(tau_pos), np.float32(tau_neg)
        scale = fixed_point_scale(abs(high if high >= -low else low), x.numel())
        if use_numba(x):
            positive = torch.empty(x.numel(), dtype=torch.int64)
            negative = torch.empty(x.numel(), dtype=torch.int64)
            n_pos, n_neg, sum_pos, sum_neg = _select_sides(
                as_numpy(x), tau_pos, tau_neg, scale, as_numpy(positive), as_numpy(negative))
            positive, negative = positive[:n_pos], negative[:n_neg]
        else:
            fixed = to_fixed(x, scale)
            pos_mask, neg_mask = x > float(tau_pos), x < -float(tau_neg)  # (float32 thresholds, exact as numbers)
            positive, negative = pos_mask.nonzero().squeeze(1), neg_mask.nonzero().squeeze(1)
            n_pos, n_neg = positive.numel(), negative.numel()
            zero = fixed.new_zeros(())
            sum_pos, sum_neg = torch.stack([torch.where(pos_mask, fixed, zero).sum(),
                                            torch.where(neg_mask, fixed, zero).sum()]).tolist()
        means = [mean_of(sum_pos, n_pos, scale), mean_of(sum_neg, n_neg, scale)]
        return Packet({"positive": positive.to(torch.int32), "negative": negative.to(torch.int32),
                       "means": torch.tensor(means, dtype=torch.float32, device=x.device)},
                      flat.shape, flat.dtype)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        out = torch.zeros(packet.numel, dtype=torch.float32, device=packet.device)
        means = packet["means"]
        out[packet["positive"].long()] = means[0]
        out[packet["negative"].long()] = means[1]
        return out


@jit
def _select_sides(x, tau_pos, tau_neg, scale, positive, negative):  # pragma: no cover - compiled
    """Indices of x > τ⁺ and of −x > τ⁻, and the fixed-point sums of each side. The branches are
    taken rarely (α small) and so predicted well; converting only the selected values saves time."""
    n_pos = n_neg = 0
    sum_pos = sum_neg = np.int64(0)
    for i in range(x.size):
        v = x[i]
        if v > tau_pos:
            positive[n_pos] = i
            n_pos += 1
            sum_pos += np.int64(np.float64(v) * scale)
        elif -v > tau_neg:
            negative[n_neg] = i
            n_neg += 1
            sum_neg += np.int64(np.float64(v) * scale)
    return n_pos, n_neg, sum_pos, sum_neg
