"""What ``gradpress train`` runs (:class:`TrainConfig`, also what the launcher hands every worker, as JSON),
and the error that a failed worker ends the run with (:class:`TrainFailed`)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gradpress.auto import is_auto
from gradpress.testbed import netem
from gradpress.testbed.results import REFERENCES, SHARDED, SHARDED_REFERENCES


class TrainFailed(RuntimeError):
    """A worker process failed; the message carries its exit status and the end of its output."""


@dataclass
class TrainConfig:
    """What ``gradpress train`` runs (also what the launcher hands every worker, as JSON)."""

    model: str = "mlp"
    data: str = "fashion-mnist"
    workers: int = 2  # per node
    compressor: str = "none"
    bandwidth: str | None = None
    epochs: int | None = None
    steps: int | None = None
    seconds: float | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    eval_every: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    timeout: float = 300.0
    threads: int = 1
    nodes: int = 1
    #: None: DDP; "fsdp"/"hsdp": the model sharded with FSDP2's fully_shard on that mesh (results.SHARDED)
    sharding: str | None = None

    def __post_init__(self) -> None:
        self._check_sharding()
        for name in ("workers", "nodes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.epochs is not None and self.steps is not None:
            raise ValueError("give --epochs or --steps, not both")
        if self.seconds is not None and not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"--seconds must be a positive number, got {self.seconds}")
        for name in ("epochs", "steps", "batch_size", "eval_every", "threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        for name in ("lr", "timeout"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and not (number and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.epochs is None and self.steps is None and self.seconds is None:
            self.epochs = 1
        if self.bandwidth is not None:
            netem.rate_bits_per_second(self.bandwidth)
        if self.compressor not in REFERENCES and not is_auto(self.compressor):
            import gradpress

            gradpress.make(self.compressor)  # unknown specs fail here, in the launcher

    def _check_sharding(self) -> None:
        """``sharding`` is a known mesh; FSDP2's reference rows set their own, DDP's take none."""
        meshes = sorted(set(SHARDED.values()))
        if self.sharding is not None and self.sharding not in meshes:
            raise ValueError(f"sharding must be one of {', '.join(meshes)} or None, got {self.sharding!r}")
        native = SHARDED_REFERENCES.get(self.compressor)
        if native is not None:
            if self.sharding not in (None, native):
                raise ValueError(f"{self.compressor} shards on the {native} mesh, not {self.sharding}")
            self.sharding = native
        elif self.sharding is not None and self.compressor in REFERENCES:
            raise ValueError(f"{self.compressor} is DDP's (PyTorch's hook): it trains no sharded model; "
                             f"FSDP2's own rows are {', '.join(SHARDED_REFERENCES)}")

    @property
    def world_size(self) -> int:
        """The ranks of the run: ``nodes`` × ``workers`` (a node's)."""
        return self.nodes * self.workers


def simulated_options(config: TrainConfig) -> dict[str, Any]:
    """The runtime options of ``config``'s workers for a :class:`gradpress.Simulator` of its world: its
    seed, and with ``hierarchy``, the node size the workers read from torchrun's ``LOCAL_WORLD_SIZE``
    (unless the options give ``local_size``)."""
    options = {"seed": config.seed, **config.options}
    if options.get("hierarchy") is not None:
        options.setdefault("local_size", config.workers)
    return options
