"""The runtime's options (:class:`Options`: the keyword arguments every front end takes beside the
method) and how a front end's ``repr`` shows them (:func:`describe`)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

from gradpress.core.feedback import make_feedback
from gradpress.exchange.strategy import MODES, OVERFLOW, check_partial


@dataclass(frozen=True)
class Options:
    """Options shared by the DDP hook, the Communicator and ``simulate`` (keyword arguments).

    * ``feedback``: error-feedback memory spec (default: the compressor's ``default_feedback``:
      ``residual`` for biased methods, ``none`` for unbiased ones).
    * ``min_numel``: tensors with fewer elements go uncompressed.
    * ``exclude``: name patterns (``fnmatch``, e.g. ``"conv1.*"``, ``"*.bias"``) left uncompressed.
    * ``warmup_steps``: the first steps of each tensor go uncompressed.
    * ``seed``: seed of the shared and private random streams (invariant: explicit randomness,
      docs/design.md).
    * ``timeout``: seconds (or a timedelta) a collective waits for its peers before it raises;
      gradpress then talks on its own process group with that timeout: every round of every
      exchange, the ranks' agreement and a gathered state (``state_dict(gathered=True)``). Not bounded
      by it: ``auto``'s decision, where the other ranks wait for rank 0 to measure the candidates
      (once per decision; on the process group gradpress was given, under that group's timeout), the
      group's creation, and DDP's own collectives. Default: the process group's own.
    * ``mode``: ``"collective"`` (all-reduce / all-gather), ``"ps"`` (parameter server at ``root``) or
      ``"switch"`` (integer-only aggregation at ``root``, as a programmable switch).
    * ``master``: spec of the master compressor C_M re-compressing the aggregate in ``ps`` mode
      (bidirectional compression, Natural compression paper Algorithm 1).
    * ``root``: rank of the parameter server / switch.
    * ``overflow``: ``"widen"`` integer sums to a dtype that holds them, or ``"raise"``; never wrap.
    * ``partial``: q ∈ (0, 1], ``ps`` and ``switch`` modes only: partial aggregation for stragglers
      (THC Sections 6 and 8.4). The server combines ⌈q·n⌉ workers' packets per tensor and every
      worker divides by that count, not n. The "first arrivals" are drawn per tensor and step from
      the stream shared by every rank (Section 8.4's random stragglers), not timed, so every rank
      knows them and ``simulate`` equals a real run; the others' contributions are dropped for that
      step (their error-feedback memory is updated as if sent). Uncompressed tensors (``exclude``,
      ``min_numel``, warm-up) meet at the same server and are aggregated partially too.
    * ``deterministic``: float sums over 3+ workers in rank order (bit-reproducible, equal to
      ``simulate``); ``False`` uses the backend's all-reduce, whose order depends on the algorithm.
    * ``hierarchy``: ``None`` (one level: every rank exchanges its compressed gradients with every
      other) or ``"node"``: a two-level exchange that compresses only what crosses between nodes
      (:mod:`gradpress.exchange.hierarchy`); ``root`` then names the node of the servers.
    * ``local_size``: with ``hierarchy="node"``, the ranks of one node (default: torchrun's
      ``LOCAL_WORLD_SIZE``).
    """

    feedback: str | None = None
    min_numel: int = 0
    exclude: tuple[str, ...] = ()
    warmup_steps: int = 0
    seed: int = 0
    timeout: float | None = None
    mode: str = "collective"
    master: str | None = None
    root: int = 0
    overflow: str = "widen"
    deterministic: bool = True
    partial: float = 1.0
    hierarchy: str | None = None
    local_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.exclude, str):
            object.__setattr__(self, "exclude", (self.exclude,))
        else:
            object.__setattr__(self, "exclude", tuple(self.exclude))
        if isinstance(self.timeout, timedelta):
            object.__setattr__(self, "timeout", self.timeout.total_seconds())
        for name in ("min_numel", "warmup_steps", "root", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"option {name} must be an integer >= 0, got {value!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"option timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.mode not in MODES:
            raise ValueError(f"option mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.overflow not in OVERFLOW:
            raise ValueError(f"option overflow must be 'widen' or 'raise', got {self.overflow!r}")
        check_partial(self.partial, self.mode)
        if self.feedback is not None:
            make_feedback(self.feedback)  # unknown names raise here, listing the known ones
        if self.hierarchy not in HIERARCHIES:
            raise ValueError(f"option hierarchy must be None or 'node', got {self.hierarchy!r}")
        if self.local_size is not None:
            size = self.local_size
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"option local_size must be an integer >= 1, got {self.local_size!r}")
            if self.hierarchy is None:
                raise ValueError("option local_size (the ranks of a node) needs hierarchy='node'")

    @classmethod
    def of(cls, **options: Any) -> Options:
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are: {', '.join(known)}")
        return cls(**options)


#: the values of the ``hierarchy`` option
HIERARCHIES = (None, "node")


def changed_options(*option_sets: Any) -> dict[str, Any]:
    """The fields of option dataclasses (:class:`Options`, :class:`gradpress.auto.AutoOptions`) whose value
    differs from the class's default, in field order: what a front end's ``repr`` shows."""
    out: dict[str, Any] = {}
    for options in option_sets:
        if options is None:
            continue
        default = type(options)()
        out.update({f.name: getattr(options, f.name) for f in fields(options)
                    if getattr(options, f.name) != getattr(default, f.name)})
    return out


def describe(spec: Any, *option_sets: Any) -> str:
    """``'spec', name=value, …`` (the non-default options): the inside of a front end's ``repr``."""
    changed = changed_options(*option_sets)
    return ", ".join([repr(spec), *(f"{name}={value!r}" for name, value in changed.items())])
