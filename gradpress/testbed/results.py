"""The result of one training run: what ``gradpress train --json FILE`` writes and ``compare`` aggregates.

GRACE (Xu et al.) Section 5.1 measures a compressor by throughput (training samples/s at steady
state), data volume (bytes handed to each collective, from the input size and the wire representation)
and model quality, against epochs, wall-clock and bytes. A :class:`Run` records the raw per-step and
per-evaluation numbers; the summary properties derive those metrics from them with one fixed rule each.

Schema (JSON object, ``"schema": 1``; ``results.json`` is a JSON array of such objects):

``compressor``  spec (``"topk:ratio=0.01"``) or reference name: ``noop`` (no communication at all, the
                compute-only upper bound), ``torch-allreduce``, ``torch-fp16``, ``torch-powersgd``,
                ``torch-fsdp``, ``torch-hsdp`` (FSDP2's own reduction, :data:`SHARDED_REFERENCES`)
``model``, ``data``  model spec and dataset name; ``workers`` (n ≥ 1: the ranks, all nodes together); ``seed``
``nodes``       the emulated nodes (``gradpress train --nodes``), ``workers / nodes`` ranks each; optional,
                1 when absent
``bandwidth``   tc rate of every emulated link (``"100mbit"``), or ``null`` for loopback
``steps``       one :class:`Step` per optimizer step, in order
``evals``       one :class:`Eval` per quality measurement, in order (step 0 = before training is allowed)
``info``        free-form facts (versions, batch size, …); not interpreted here, but for ``options``
                (the runtime options: ``hierarchy``, :attr:`Run.hierarchy`) and ``sharding``
                (``"fsdp"``/``"hsdp"``: the model trained with FSDP2's ``fully_shard`` on that mesh
                instead of DDP, :attr:`Run.sharding`)

Clocks: ``wall_s`` everywhere is training wall-clock since training start, **excluding time spent in
evaluation**, so that quality against wall-clock measures training only (GRACE Figure 1b).
Bytes: ``bytes_sent`` is GRACE's data volume: the sizes of the tensors this rank hands to collectives in
this step (``Packet.nbytes`` summed; 4 bytes per element for ``torch-allreduce``), not the bytes a
collective algorithm moves internally (a ring all-reduce moves 2(n−1)/n of its input;
:mod:`gradpress.costmodel` accounts for that). With ``hierarchy="node"`` these are the packets of this
rank's shard, exchanged between nodes; ``intra_node_bytes`` is what the rank sent inside its node,
uncompressed (:mod:`gradpress.exchange.hierarchy`). Over the emulated network, ``link_bytes`` is what
left rank 0's node over its link during the step, as the kernel counted it (all the node's ranks,
frame headers and the collectives' own traffic included): the bytes that crossed between nodes.
Sharded runs (FSDP2) count their gradients' reduction, not FSDP's all-gathers of the parameters (which
``link_bytes`` holds): on a 1-D mesh the reduce-scatter's input (``torch-fsdp``; gradpress: its packets);
on an HSDP mesh the shard exchanged between the replicas (``torch-hsdp``: the all-reduce's input;
gradpress: its packets), ``intra_node_bytes`` what FSDP's reduce-scatter sent inside the shard group,
(k−1)/k of its input.

Non-finite quality values (a diverged run: loss NaN, perplexity inf) are valid results and round-trip
through JSON as Python writes them (``NaN``, ``Infinity``).
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Sequence

from gradpress.costmodel import DEFAULT_LATENCY, Breakdown, Phase, predict_step_time
from gradpress.testbed.models import QUALITY
from gradpress.testbed.netem import rate_bits_per_second

#: what ends the name of a run that exchanged in two levels (``hierarchy="node"``): ``compare``'s
#: ``--compressors`` suffix, and ``advise``'s and ``sim cost``'s rows
HIERARCHICAL = "@node"
#: what ends the name of a gradpress run on a model sharded with FSDP2's ``fully_shard`` instead of DDP
#: (``compare``'s ``--compressors`` suffix) -> the mesh: ``fsdp`` a 1-D mesh of every rank (the
#: reduce-scatter compressed, :func:`gradpress.fsdp.scatter_methods`), ``hsdp`` a 2-D ("replicate",
#: "shard") mesh, the replicas the nodes (the exchange between them compressed)
SHARDED = {"@fsdp": "fsdp", "@hsdp": "hsdp"}
#: the reference rows of FSDP2 itself (its own reduce-scatter, and all-reduce between replicas) -> the mesh
SHARDED_REFERENCES = {"torch-fsdp": "fsdp", "torch-hsdp": "hsdp"}

SCHEMA = 1
#: reference rows of ``gradpress train`` that are not gradpress compressors
REFERENCES = ("noop", "torch-allreduce", "torch-fp16", "torch-powersgd", *SHARDED_REFERENCES)
#: metric -> whether higher is better (accuracy, perplexity, hit_rate@10), from the models' tasks
METRICS: dict[str, bool] = dict(QUALITY.values())
#: the fraction of a run's first steps left out of steady-state figures (see :func:`warmup_steps`)
WARMUP_FRACTION = 0.1


def warmup_steps(count: int) -> int:
    """How many of a run's first ``count`` steps are warm-up, left out of steady-state figures.

    GRACE Section 5.1 averages throughput over the last iterations, at steady state. Here: the first
    10 % of the steps, rounded up and at least one — the first step pays for process-group connection,
    DDP bucket building and numba compilation — but never all of them (one step: none is left out).
    """
    if count < 1:
        raise ValueError(f"a run has at least one step, got {count}")
    return min(count - 1, max(1, math.ceil(count * WARMUP_FRACTION)))


def reached(value: float, target: float, higher_is_better: bool) -> bool:
    """Whether quality ``value`` is at least as good as ``target`` (NaN never reaches anything)."""
    return value >= target if higher_is_better else value <= target


@dataclass(frozen=True)
class Step:
    """One optimizer step on the rank that records (rank 0).

    ``wall_s``: training wall-clock at the end of the step; ``compute_s``: forward, backward and
    optimizer on the training thread, outside the hooks and the wait for the exchange; ``compress_s``:
    compress + decompress (and feedback), on whichever thread; ``comm_s``: time in collectives;
    ``bytes_sent``: this rank's data volume this step (module doc); ``samples``: samples of all
    workers together this step; ``intra_node_bytes``: what this rank sent inside its node (0 in a
    one-level exchange); ``link_bytes``: what left rank 0's node over its emulated link (None on
    loopback). The last two are optional in the JSON.
    """

    step: int
    epoch: int
    wall_s: float
    compute_s: float
    compress_s: float
    comm_s: float
    bytes_sent: int
    samples: int
    intra_node_bytes: int = 0
    link_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("step", "epoch", "bytes_sent", "intra_node_bytes"):
            _check_int(self, name, minimum=0)
        if self.link_bytes is not None:
            _check_int(self, "link_bytes", minimum=0)
        _check_int(self, "samples", minimum=1)
        for name in ("wall_s", "compute_s", "compress_s", "comm_s"):
            _check_seconds(self, name)


@dataclass(frozen=True)
class Eval:
    """One quality measurement on the test split, taken after step ``step`` (0 = before training).

    ``bytes_total``: data volume one rank has sent so far; ``metric``: ``accuracy``, ``perplexity`` or
    ``hit_rate@10`` with its ``value``; ``loss``: the mean test loss.
    """

    epoch: int
    step: int
    wall_s: float
    bytes_total: int
    metric: str
    value: float
    higher_is_better: bool
    loss: float

    def __post_init__(self) -> None:
        for name in ("epoch", "step", "bytes_total"):
            _check_int(self, name, minimum=0)
        _check_seconds(self, "wall_s")
        if self.metric not in METRICS:
            raise ValueError(f"Eval.metric: unknown metric {self.metric!r}; known: {', '.join(METRICS)}")
        if not isinstance(self.higher_is_better, bool) or self.higher_is_better != METRICS[self.metric]:
            raise ValueError(f"Eval.higher_is_better must be {METRICS[self.metric]} for {self.metric}, "
                             f"got {self.higher_is_better!r}")
        for name in ("value", "loss"):
            _check_float(self, name)


@dataclass(frozen=True)
class Run:
    """One ``gradpress train`` run: its setting, every step and every evaluation (module doc)."""

    compressor: str
    model: str
    data: str
    workers: int
    bandwidth: str | None
    seed: int
    steps: tuple[Step, ...]
    evals: tuple[Eval, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)
    nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("compressor", "model", "data"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Run.{name} must be a non-empty string, got {value!r}")
        _check_int(self, "workers", minimum=1)
        _check_int(self, "nodes", minimum=1)
        if self.workers % self.nodes:
            raise ValueError(f"Run.workers ({self.workers}) must be a multiple of Run.nodes ({self.nodes}): "
                             "every node holds the same number of ranks")
        _check_int(self, "seed")
        if self.bandwidth is not None:
            if not isinstance(self.bandwidth, str):
                raise ValueError(f"Run.bandwidth must be a tc rate string or None, got {self.bandwidth!r}")
            rate_bits_per_second(self.bandwidth)
        if not isinstance(self.info, dict):
            raise ValueError(f"Run.info must be a dict, got {type(self.info).__name__}")
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "evals", tuple(self.evals))
        self._check_steps()
        self._check_evals()

    def _check_steps(self) -> None:
        if not self.steps:
            raise ValueError("Run.steps: a run has at least one step")
        for i, step in enumerate(self.steps):
            if not isinstance(step, Step):
                raise ValueError(f"Run.steps[{i}] is a {type(step).__name__}, not a Step")
        if self.steps[0].wall_s <= 0:
            raise ValueError("Run.steps[0].wall_s must be positive: a step takes time")
        for i, (a, b) in enumerate(zip(self.steps, self.steps[1:], strict=False), start=1):
            if b.step <= a.step or b.wall_s <= a.wall_s or b.epoch < a.epoch:
                raise ValueError(f"Run.steps[{i}]: step numbers and wall_s must increase and epochs must not "
                                 f"decrease; got step {a.step}->{b.step}, wall_s {a.wall_s}->{b.wall_s}, "
                                 f"epoch {a.epoch}->{b.epoch}")

    def _check_evals(self) -> None:
        for i, ev in enumerate(self.evals):
            if not isinstance(ev, Eval):
                raise ValueError(f"Run.evals[{i}] is a {type(ev).__name__}, not an Eval")
            if ev.step > self.steps[-1].step:
                raise ValueError(f"Run.evals[{i}]: step {ev.step} is after the last step "
                                 f"{self.steps[-1].step}")
            if ev.metric != self.evals[0].metric:
                raise ValueError(f"Run.evals[{i}]: metric {ev.metric!r} differs from "
                                 f"{self.evals[0].metric!r}")
        for i, (a, b) in enumerate(zip(self.evals, self.evals[1:], strict=False), start=1):
            if b.step < a.step or b.wall_s < a.wall_s or b.bytes_total < a.bytes_total:
                raise ValueError(f"Run.evals[{i}]: step, wall_s and bytes_total must not decrease")

    # ---------------------------------------------------------------------------------------------
    # Summary (GRACE Section 5.1's metrics)
    # ---------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The compressor's name without its parameters (``"topk:ratio=0.01"`` -> ``"topk"``)."""
        return self.compressor.partition(":")[0].strip()

    @property
    def workers_per_node(self) -> int:
        return self.workers // self.nodes

    @property
    def hierarchy(self) -> str | None:
        """The run's ``hierarchy`` option (``"node"``: the two-level exchange), None for one level; the
        reference rows (PyTorch's own hooks) take no gradpress option."""
        if self.compressor in REFERENCES:
            return None
        return (self.info.get("options") or {}).get("hierarchy")

    @property
    def sharding(self) -> str | None:
        """The mesh of a run on a model sharded with FSDP2 (``"fsdp"``, ``"hsdp"``: :data:`SHARDED`),
        None for DDP."""
        return self.info.get("sharding")

    @property
    def label(self) -> str:
        """The run as ``gradpress compare --compressors`` names it: the spec, ``@node`` added for the
        two-level exchange (``"topk:ratio=0.01@node"``), ``@hsdp``/``@fsdp`` for a gradpress method on
        a sharded model; a reference row by its name (``torch-hsdp``)."""
        if self.hierarchy is not None:
            return f"{self.compressor}@{self.hierarchy}"
        if self.sharding is not None and self.compressor not in REFERENCES:
            return f"{self.compressor}@{self.sharding}"
        return self.compressor

    @property
    def steady_steps(self) -> tuple[Step, ...]:
        """The steps after the warm-up (:func:`warmup_steps`)."""
        return self.steps[warmup_steps(len(self.steps)):]

    @property
    def steady_seconds(self) -> float:
        """Wall-clock of the steady-state steps: from the end of the last warm-up step to the end."""
        skipped = warmup_steps(len(self.steps))
        start = self.steps[skipped - 1].wall_s if skipped else 0.0
        return self.steps[-1].wall_s - start

    @property
    def samples_per_s(self) -> float:
        """Throughput (GRACE Section 5.1): global samples of the steady-state steps / their wall-clock."""
        return sum(s.samples for s in self.steady_steps) / self.steady_seconds

    @property
    def mean_step_s(self) -> float:
        """Mean wall-clock of a steady-state step."""
        return self.steady_seconds / len(self.steady_steps)

    @property
    def mean_compute_s(self) -> float:
        return _mean(s.compute_s for s in self.steady_steps)

    @property
    def mean_compress_s(self) -> float:
        return _mean(s.compress_s for s in self.steady_steps)

    @property
    def mean_comm_s(self) -> float:
        return _mean(s.comm_s for s in self.steady_steps)

    @property
    def bytes_per_step(self) -> float:
        """Mean data volume per step over *all* steps (bytes have no warm-up cost, and so
        ``bytes_per_step × len(steps)`` is the run's whole data volume)."""
        return _mean(s.bytes_sent for s in self.steps)

    @property
    def intra_node_bytes_per_step(self) -> float:
        """Mean bytes one rank sent inside its node per step, over all steps (0: one level)."""
        return _mean(s.intra_node_bytes for s in self.steps)

    @property
    def link_bytes_per_step(self) -> float | None:
        """Mean bytes that left rank 0's node over its emulated link per step, over all steps; None
        unless every step measured them (loopback measures none)."""
        measured = [s.link_bytes for s in self.steps if s.link_bytes is not None]
        return _mean(measured) if len(measured) == len(self.steps) else None

    @property
    def metric(self) -> str | None:
        return self.evals[0].metric if self.evals else None

    @property
    def higher_is_better(self) -> bool | None:
        return self.evals[0].higher_is_better if self.evals else None

    @property
    def final_quality(self) -> float | None:
        """The last evaluation's value (None without evaluations)."""
        return self.evals[-1].value if self.evals else None

    @property
    def best_quality(self) -> float | None:
        """The best finite evaluation value (max, or min for perplexity); None if there is none."""
        values = [ev.value for ev in self.evals if math.isfinite(ev.value)]
        if not values:
            return None
        return max(values) if self.higher_is_better else min(values)

    def first_reaching(self, target: float) -> Eval | None:
        """The first evaluation whose quality reaches ``target`` (None if none does)."""
        for ev in self.evals:
            if reached(ev.value, target, ev.higher_is_better):
                return ev
        return None

    def time_to_target(self, target: float) -> float | None:
        """Training wall-clock (s) when quality first reaches ``target``; None if it never does."""
        ev = self.first_reaching(target)
        return None if ev is None else ev.wall_s

    def bytes_to_target(self, target: float) -> int | None:
        """Data volume one rank had sent when quality first reached ``target``; None if never."""
        ev = self.first_reaching(target)
        return None if ev is None else ev.bytes_total

    # ---------------------------------------------------------------------------------------------
    # JSON
    # ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA}
        out.update({f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("steps", "evals")})
        out["steps"] = [asdict(s) for s in self.steps]
        out["evals"] = [asdict(e) for e in self.evals]
        return out

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> Run:
        if not isinstance(obj, dict):
            raise ValueError(f"a run is a JSON object, got {type(obj).__name__}")
        obj = dict(obj)
        schema = obj.pop("schema", None)
        if schema != SCHEMA:
            raise ValueError(f"run schema {schema!r} is not the supported schema {SCHEMA}")
        _check_keys(cls, obj)
        steps = [_build(Step, s, f"steps[{i}]") for i, s in enumerate(obj.pop("steps"))]
        evals = [_build(Eval, e, f"evals[{i}]") for i, e in enumerate(obj.pop("evals", []))]
        return cls(steps=tuple(steps), evals=tuple(evals), **obj)

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Run:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json() + "\n")
        return path


def save_runs(runs: Sequence[Run], path: str | Path) -> Path:
    """Write ``results.json``: a JSON array of runs."""
    path = Path(path)
    path.write_text(json.dumps([run.to_dict() for run in runs], indent=1) + "\n")
    return path


def load_runs(path: str | Path) -> list[Run]:
    """Read a ``results.json`` array, or a single run's file (``train --json``), as a list of runs."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    items = obj if isinstance(obj, list) else [obj]
    runs = []
    for i, item in enumerate(items):
        try:
            runs.append(Run.from_dict(item))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{path}: run {i}: {err}") from None
    return runs


# -------------------------------------------------------------------------------------------------
# Validation helpers
# -------------------------------------------------------------------------------------------------
def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)


def _check_int(obj: object, name: str, minimum: int | None = None) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{type(obj).__name__}.{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{type(obj).__name__}.{name} must be at least {minimum}, got {value}")


def _check_float(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{type(obj).__name__}.{name} must be a number, got {value!r}")
    object.__setattr__(obj, name, float(value))


def _check_seconds(obj: object, name: str) -> None:
    _check_float(obj, name)
    value = getattr(obj, name)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{type(obj).__name__}.{name} must be a finite number of seconds ≥ 0, got {value}")


def _check_keys(cls: type, obj: dict[str, Any]) -> None:
    """Raise unless ``obj``'s keys are ``cls``'s fields: each, or those with a default left out."""
    names = {f.name for f in fields(cls)}
    optional = {f.name for f in fields(cls) if f.default is not MISSING or f.default_factory is not MISSING}
    unknown = sorted(set(obj) - names)
    missing = sorted(names - set(obj) - optional)
    if unknown or missing:
        parts = [f"{what} keys {keys}" for what, keys in (("unknown", unknown), ("missing", missing)) if keys]
        raise ValueError(f"{cls.__name__}: {'; '.join(parts)}")


def _build(cls: type, obj: Any, where: str) -> Any:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    try:
        _check_keys(cls, obj)
        return cls(**obj)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def predict_from_run(run: Run, *, bandwidth: float | str, n: int, strategy: str,
                     latency: float = DEFAULT_LATENCY, overlap: bool = False,
                     nbytes_down: float | None = None) -> Breakdown:
    """Predict the step time of ``run``'s compressor at another ``bandwidth`` and ``n``.

    Uses the run's steady-state mean compute and compression times and its mean bytes per step
    (GRACE's data volume: the input size of the collectives, one worker's B) — per-worker batch and
    packet size do not depend on n. A multi-phase method's bytes are priced as one ``strategy``.
    """
    phase = Phase(strategy, run.bytes_per_step, nbytes_down)
    return predict_step_time(run.mean_compute_s, run.mean_compress_s, phase, n=n, bandwidth=bandwidth,
                             latency=latency, overlap=overlap)


def measured_breakdown(run: Run) -> Breakdown:
    """The run's own steady-state means, in the same shape as a prediction (total = mean step time)."""
    return Breakdown(run.mean_compute_s, run.mean_compress_s, run.mean_comm_s, run.mean_step_s)
