"""``auto``'s spec, its constants and its own options (:class:`AutoOptions`)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterable

from gradpress.core.compressor import make

#: the spec that selects this module
AUTO = "auto"
#: the uncompressed method: the reference of every prediction (always a candidate)
UNCOMPRESSED = "none"
#: what the steps before the first decision run by default: PowerSGD at rank 4 sends a few rows and
#: columns of each matrix, so a slow link pays the measurement little, and loses little of the gradient
#: (a fifth on the testbed's ``mlp-wide``, where top-k 1 % loses four fifths), so the measured steps
#: train well; its memory carries what it held back
MEASURE_WITH = "powersgd:rank=4"
#: methods that pay in different regimes (GRACE Section 6; the README's demo set and sparser top-k).
#: PowerSGD at rank 4, not its default 1: rank 1 never reaches the testbed's target on ``mlp-wide``
#: (docs/choosing.md), though its one-step compression error, which the quality model reads, looks no
#: worse than top-k's; rank 4 loses a quarter of it and reached the target first there
DEFAULT_CANDIDATES = ("none", "fp16", "natural", "qsgd", "thc", "topk:ratio=0.01", "topk:ratio=0.001",
                      "powersgd:rank=4")
#: seconds per message when the observed sizes cannot separate it from the bandwidth
FALLBACK_LATENCY = 1e-4
#: arrivals kept per size of round (the fastest of them is the link's time for that size)
KEPT_ARRIVALS = 8
#: what rank 0 broadcasts at a decision point (the payload's last value)
NEED_GRADIENTS, DECIDED, KEPT = 0.0, 1.0, 2.0
#: the suffix of a candidate run in two levels (``hierarchy="node"``; ``compare``'s and ``advise``'s too)
NODE = "@node"
#: what ``rank_by`` accepts: time to a quality target (the default), or the step alone
RANK_BY = ("quality", "step")


def level_of(name: str) -> bool:
    """Whether the candidate ``name`` runs in two levels (it ends in :data:`NODE`)."""
    return name.endswith(NODE)


def method_of(name: str) -> str:
    """The method's spec of the candidate ``name`` (without :data:`NODE`)."""
    return name[:-len(NODE)] if level_of(name) else name


def is_auto(spec: Any) -> bool:
    return isinstance(spec, str) and spec.strip() == AUTO


@dataclass(frozen=True)
class AutoOptions:
    """``auto``'s own options (keyword arguments beside :class:`gradpress.exchange.pipeline.Options`).

    * ``candidates``: the specs it chooses among (``none``, the reference of every prediction, is always one).
    * ``measure_with``: the method the steps before the first decision run; what it held back is
      carried into the chosen method's memory or sent once. None (the default): :data:`MEASURE_WITH`,
      or ``none`` where the runtime's options cannot run it. Unless it is ``none``, the last measured
      step also all-reduces an eighth of the gradient uncompressed (the link's sustained rate and the
      exact average's estimate, :mod:`gradpress.auto`).
    * ``settle_steps``: steps before measuring (not measured: DDP rebuilds its buckets after the first
      step, and the first steps' gradients, of a model far from any minimum, are unlike the later ones:
      PowerSGD's rank 1, say, loses far less of them).
    * ``measure_steps``: steps measured before the first decision; on several nodes every other one
      runs in two levels (the rate inside a node).
    * ``recheck_every``: steps between decisions after the first (0: never re-check).
    * ``margin``: a change of methods must be predicted to shorten the objective by more than this fraction.
    * ``rank_by``: ``"quality"`` (the predicted time to a quality target: the step times the steps factor
      of each method's compression error measured on the job's gradients,
      :mod:`gradpress.costmodel.quality`) or ``"step"`` (the predicted step alone).
    * ``intra_bandwidth``: on several nodes, the rate inside a node (bits/s, or a tc rate such as
      ``"100gbit"``); None: measured on the all-gathers inside the node of the measurement steps run in
      two levels (:data:`gradpress.costmodel.DEFAULT_INTRA_BANDWIDTH` until one is measured).
    """

    candidates: tuple[str, ...] = DEFAULT_CANDIDATES
    measure_with: str | None = None
    settle_steps: int = 2
    measure_steps: int = 5
    recheck_every: int = 500
    margin: float = 0.05
    rank_by: str = "quality"
    intra_bandwidth: float | str | None = None

    def __post_init__(self) -> None:
        given = (self.candidates,) if isinstance(self.candidates, str) else self.candidates
        if not isinstance(given, Iterable) or not all(isinstance(c, str) for c in given):
            raise ValueError(f"option candidates must be spec strings, got {self.candidates!r}")
        specs: list[str] = []
        for text in [UNCOMPRESSED, *given]:
            if is_auto(text):
                raise ValueError("option candidates: 'auto' cannot be its own candidate")
            spec = make(text).spec  # an unknown spec raises ValueError here
            if spec not in specs:
                specs.append(spec)
        object.__setattr__(self, "candidates", tuple(specs))
        if self.measure_with is not None:
            if not isinstance(self.measure_with, str) or is_auto(self.measure_with):
                raise ValueError(f"option measure_with must be a method's spec (not 'auto'), got "
                                 f"{self.measure_with!r}")
            object.__setattr__(self, "measure_with", make(self.measure_with).spec)  # (unknown: ValueError)
        for name, low in (("settle_steps", 0), ("measure_steps", 1), ("recheck_every", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"option {name} must be an integer >= {low}, got {value!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise ValueError(f"option margin must be a number in [0, 1), got {self.margin!r}")
        if self.rank_by not in RANK_BY:
            raise ValueError(f"option rank_by must be one of {RANK_BY}, got {self.rank_by!r}")
        if self.intra_bandwidth is not None:
            from gradpress.costmodel.network import _bits_per_second

            try:
                _bits_per_second(self.intra_bandwidth)
            except (ValueError, TypeError) as error:
                raise ValueError(f"option intra_bandwidth: {error}") from None

    @property
    def methods(self) -> tuple[str, ...]:
        """Every method a run may use: the candidates and ``measure_with``."""
        return tuple(dict.fromkeys([*self.candidates, self.measure_with or MEASURE_WITH]))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The names of ``auto``'s own options (beside the runtime's)."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def pop_from(cls, options: dict[str, Any]) -> AutoOptions:
        """The auto options among ``options``, removed from it (the rest are the runtime's)."""
        return cls(**{name: options.pop(name) for name in cls.names() if name in options})

    def text(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
