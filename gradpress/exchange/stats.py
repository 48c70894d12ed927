"""One rank's statistics of the exchange (:class:`Stats`), saved with its state, and their flat form for a
metrics logger (:func:`flat_stats`)."""
from __future__ import annotations

import math
import threading
import time
from typing import Any

COUNTERS = ("raw_bytes", "packet_bytes", "sent_bytes", "received_bytes", "collectives",
            "compress_s", "decompress_s", "comm_s", "control_bytes",
            "intra_node_sent_bytes", "intra_node_received_bytes")


class Stats:
    """Per-step and cumulative figures of one rank (thread-safe: decoding runs on backend threads).

    * ``raw_bytes``: bytes of the gradients handed in; ``packet_bytes``: ``Packet.nbytes`` of this
      rank's packets (the compressor's output, GRACE's "data volume").
    * ``sent_bytes`` / ``received_bytes``: what the strategy's collectives move for this rank, from
      their traffic pattern (:func:`gradpress.exchange.strategy.traffic`): headers, widened integer sums and
      the downstream direction included.
    * ``control_bytes``: bytes sent and received for the ranks' agreement on what they exchange
      (:mod:`gradpress.exchange.agreement`, once per set of keys), not counted in the figures above.
    * with ``hierarchy="node"`` (:mod:`gradpress.exchange.hierarchy`): ``sent_bytes`` and
      ``received_bytes`` are the exchange between nodes (the compressed shards), and
      ``intra_node_sent_bytes`` / ``intra_node_received_bytes`` the uncompressed reduce-scatter and
      all-gather inside the node (zero in a one-level exchange); ``raw_bytes`` and ``packet_bytes``
      are those of this rank's shard.
    * ``compress_s`` (compensate, prepare, compress, feedback update), ``decompress_s`` (decoding and
      aggregation), ``comm_s`` (from issuing each round of collectives to its completion; rounds of
      different buckets overlap, so this is not wall time).

    The figures are saved with the pipeline's state (:meth:`state_dict`): after a resume ``total`` goes on
    from where it was, as the step counters do, so ``total`` over ``steps`` stays a mean per step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total: dict[str, float] = dict.fromkeys(COUNTERS, 0)
        self._steps: dict[int, dict[str, float]] = {}

    def add(self, step: int, **values: float) -> None:
        with self._lock:
            current = self._steps.get(step)
            if current is None:
                current = self._steps[step] = dict.fromkeys(COUNTERS, 0)
                while len(self._steps) > 2:
                    del self._steps[min(self._steps)]
            total = self._total
            for name, value in values.items():
                current[name] += value
                total[name] += value

    def add_traffic(self, step: int, scope: str, sent: int, received: int) -> None:
        """One collective's bytes, as :func:`gradpress.exchange.protocol.traffic` counts them, issued in a
        round of ``scope`` (:class:`gradpress.exchange.protocol.Round`): inside the node, or not."""
        if scope == "node":
            self.add(step, intra_node_sent_bytes=sent, intra_node_received_bytes=received, collectives=1)
        else:
            self.add(step, sent_bytes=sent, received_bytes=received, collectives=1)

    def timer(self, step: int, name: str) -> _Timer:
        """A context manager adding the seconds it encloses to ``name``."""
        return _Timer(self, step, name)

    def report(self, pattern: str = "") -> dict[str, Any]:
        """``{"pattern": traffic pattern, "steps": count, "step": index of the latest step, "last": its
        figures, "total": cumulative figures}``."""
        with self._lock:
            latest = max(self._steps) if self._steps else None
            return {
                "pattern": pattern,
                "steps": 0 if latest is None else latest + 1,
                "step": latest,
                "last": dict(self._steps[latest]) if latest is not None else dict.fromkeys(COUNTERS, 0),
                "total": dict(self._total),
            }

    def state_dict(self) -> dict[str, Any]:
        """``{"total": cumulative figures, "steps": {step: its figures}}`` (the latest steps kept)."""
        with self._lock:
            return {"total": dict(self._total), "steps": {step: dict(f) for step, f in self._steps.items()}}

    @staticmethod
    def check_state(state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` is a :meth:`state_dict`: figures named as :data:`COUNTERS`,
        each a finite number >= 0, and steps numbered by integers >= 0."""
        if not isinstance(state, dict) or not isinstance(state.get("total"), dict) \
                or not isinstance(state.get("steps"), dict):
            raise ValueError("gradpress state: stats must be a dict of 'total' and 'steps'")
        tables = [("stats['total']", state["total"])]
        for step, figures in state["steps"].items():
            if isinstance(step, bool) or not isinstance(step, int) or step < 0 \
                    or not isinstance(figures, dict):
                raise ValueError(f"gradpress state: stats['steps'] must map step numbers to figures, "
                                 f"got {step!r}")
            tables.append((f"stats['steps'][{step}]", figures))
        for where, figures in tables:
            for name, value in figures.items():
                if name not in COUNTERS:
                    raise ValueError(f"gradpress state: {where} names {name!r}, not one of "
                                     f"{', '.join(COUNTERS)}")
                if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                        or value < 0):
                    raise ValueError(f"gradpress state: {where}[{name!r}] must be a finite number >= 0, "
                                     f"got {value!r}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (checked by :meth:`check_state` first)."""
        self.check_state(state)
        with self._lock:
            self._total = {**dict.fromkeys(COUNTERS, 0), **state["total"]}
            self._steps = {step: {**dict.fromkeys(COUNTERS, 0), **figures}
                           for step, figures in sorted(state["steps"].items())[-2:]}


_SECONDS = ("compress_s", "decompress_s", "comm_s")


def flat_stats(report: dict[str, Any], prefix: str = "gradpress/") -> dict[str, float]:
    """A :meth:`Stats.report` (or a front end's ``stats()``) as one flat dict of numbers, ready for a
    metrics logger (TensorBoard, Weights & Biases, Lightning's ``log_dict``): the latest step's figures as
    ``<prefix><name>`` and the cumulative ones as ``<prefix>total/<name>``, times in milliseconds
    (``compress_ms``, ``decompress_ms``, ``comm_ms``), byte counts and ``collectives`` as counted, and
    ``compression_ratio``: the gradients' bytes over the packets' (``raw_bytes / packet_bytes``, the
    compressor's ratio; left out while nothing was compressed), plus ``<prefix>steps``."""
    flat: dict[str, float] = {f"{prefix}steps": float(report.get("steps", 0))}
    for part, head in (("last", prefix), ("total", f"{prefix}total/")):
        figures = report.get(part) or {}
        for name in COUNTERS:
            value = float(figures.get(name, 0))
            if name in _SECONDS:
                flat[f"{head}{name[:-2]}_ms"] = value * 1e3
            else:
                flat[f"{head}{name}"] = value
        if figures.get("packet_bytes"):
            flat[f"{head}compression_ratio"] = float(figures["raw_bytes"]) / float(figures["packet_bytes"])
    return flat


class _Timer:
    def __init__(self, stats: Stats, step: int, name: str) -> None:
        self.stats, self.step, self.name = stats, step, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *_: Any) -> None:
        self.stats.add(self.step, **{self.name: time.perf_counter() - self.start})
