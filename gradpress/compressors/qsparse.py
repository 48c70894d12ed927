"""Qsparse-local-SGD's compressor (Basu, Data, Karakus and Diggavi, NeurIPS 2019; GRACE §3.3).

Basu et al. compose a sparsifier, top-k or random-k, with a quantizer applied to the k values kept:
QSGD's stochastic s-level quantizer (their QTop_k and QRand_k), or the scaled sign (SignTop_k), and run
it with error feedback. Here it is the registered composition ``topk:ratio=r+qsgd`` (see
:class:`gradpress.Compose`) under the paper's name, with residual feedback by default.

* ``levels`` is QSGD's s (QSGD's own default when unset); QSGD's ``bucket`` keeps its default too. For
  other QSGD settings write the composition itself, e.g. ``topk:ratio=0.01+qsgd:levels=4,bucket=0``.
* The paper's analysis scales the composed operator by 1/(1 + β_{k,s}) to make it a contraction; that
  constant factor per tensor is left out here, as in practical implementations; error feedback absorbs it.
* The local steps (H iterations between synchronizations) belong to the training loop, not the
  compressor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from gradpress.core.compressor import Compose, Compressor, make, register
from gradpress.core.packet import Packet
from gradpress.core.registry import param
from gradpress.core.rng import Context


@register("qsparse")
@dataclass(repr=False)
class QSparse(Compressor):
    """Qsparse-local-SGD (Basu et al., NeurIPS 2019): top-k or random-k (``sparsifier``, keeping a
    fraction ``ratio``), then QSGD with ``levels`` levels or the scaled sign (``quantizer``) on the kept
    values, with error feedback."""

    sparsifier: Literal["topk", "randomk"] = "topk"
    ratio: float = param(0.01, "(0, 1]")
    quantizer: Literal["qsgd", "efsignsgd"] = "qsgd"
    levels: int | None = param(None, "[1, 127]")  # qsgd's levels (none: its default)
    examples = ("qsparse:sparsifier=randomk,ratio=0.1", "qsparse:levels=4,ratio=0.25",
                "qsparse:quantizer=efsignsgd")
    _inner: Compose = field(init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        quantizer_keys: dict[str, Any] = {}
        if self.levels is not None:
            if self.quantizer != "qsgd":
                raise ValueError(f"qsparse: levels applies to the qsgd quantizer, not {self.quantizer}")
            quantizer_keys["levels"] = self.levels
        self._inner = Compose(make(self.sparsifier, ratio=self.ratio), make(self.quantizer, **quantizer_keys))

    @property
    def unbiased(self) -> bool:  # type: ignore[override]
        return self._inner.unbiased

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self._inner.summable

    @property
    def saturates(self) -> bool:  # type: ignore[override]
        return self._inner.saturates

    @property
    def default_feedback(self) -> str:
        return "residual"

    @property
    def composition(self) -> str:
        """The equivalent composition spec, e.g. ``topk:ratio=0.01+qsgd``."""
        return self._inner.spec

    def expected_nbytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int | None:
        return self._inner.expected_nbytes(numel, dtype)

    def _compress(self, flat: torch.Tensor, ctx: Context) -> Packet:
        return self._inner._compress(flat, ctx)

    def _decompress(self, packet: Packet) -> torch.Tensor:
        return self._inner._decompress(packet)
