"""``advise --local-workers K``: each candidate's real DDP step among K processes of this machine (see
:mod:`gradpress.testbed.advise`).

The K processes (one Gloo group over loopback, ``--threads`` torch threads each, as ``compare``'s workers)
each build the workload's model in DDP with the candidate's hook — gradpress's, or a reference row of
``compare`` (``torch-allreduce``, ``noop``) — train ``warmup`` steps on the workload's batches and time
``steps`` more, each as ``compare`` times its steps (:func:`gradpress.testbed.train.metered_step`). Rank 0's
medians are the method's :class:`~gradpress.costmodel.method.LocalStep`, which
:func:`~gradpress.testbed.advise.ranking.calibrated` prices the method with: the host's part of the step
measured on the machine as the workers will share it, the link modelled.

A machine shared with other work changes speed from one minute to the next (on the 2-core machine of the
README, ``noop``'s step moved between 19.6 and 27.9 ms within the hour), more than the methods of a
compute-bound model differ. So ``noop``'s model stays built and trains ``steps`` steps before the first
method and after each one, and each method's times are scaled by the median of those ``noop`` runs over
the mean of the two around it: every method is priced as if measured at the run's typical speed.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Mapping, Sequence

import torch

from gradpress.costmodel.method import LocalStep
from gradpress.testbed import arguments
from gradpress.testbed.advise.workload import workload_of


def measure_local_steps(settings: Mapping[str, Any], specs: Sequence[str], workers: int, *, steps: int = 20,
                        warmup: int = 8, timeout: float = 600.0) -> tuple[dict[str, LocalStep], dict[str, str]]:
    """Each of ``specs``' :class:`~gradpress.costmodel.method.LocalStep` among ``workers`` processes
    (module doc), and the reason for each spec that could not be measured. ``settings``: ``advise``'s
    arguments (``vars(args)``), from which each process builds the workload."""
    from gradpress.bench import spawn

    args = {"settings": dict(settings), "specs": list(specs), "steps": steps, "warmup": warmup}
    ranks = spawn(_worker, workers, args, timeout=timeout, threads=int(settings.get("threads") or 1))
    measured, failed = ranks[0]
    return {spec: LocalStep(**fields) for spec, fields in measured.items()}, failed


def _worker(rank: int, world: int, args: dict[str, Any]) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    settings = argparse.Namespace(**args["settings"])
    workload = workload_of(settings)
    generator = torch.Generator().manual_seed(settings.seed * 1009 + rank)
    batches = [workload.sample(generator) for _ in range(4)]
    noop = _Trainer(workload, "noop", world, settings, batches)
    noop.run(args["warmup"])
    noops = [_medians(noop.run(args["steps"]))]  # the machine's speed before each method and after the last
    measured: dict[str, tuple[float, ...]] = {}
    failed: dict[str, str] = {}
    for index, spec in enumerate(args["specs"]):
        if spec == "noop":
            continue
        try:
            trainer = _Trainer(workload, spec, world, settings, batches)
            trainer.run(args["warmup"])
            measured[spec] = _medians(trainer.run(args["steps"]))
            del trainer
        except Exception as error:  # noqa: BLE001 - every rank meets it at the same step; the rest stay unmeasured
            failed[spec] = f"{type(error).__name__}: {arguments.one_line(error)}"[:300]
            for rest in args["specs"][index + 1:]:
                failed[rest] = f"not measured: {spec}'s local run failed before it"
            break
        noops.append(_medians(noop.run(args["steps"])))
    steps = at_typical_speed(measured, noops)
    if "noop" not in args["specs"]:
        steps.pop("noop")
    fields = ("step_s", "compute_s", "compression_s", "communication_s")
    return {spec: {"workers": world, **dict(zip(fields, times, strict=True))}
            for spec, times in steps.items()}, failed


def at_typical_speed(measured: Mapping[str, Sequence[float]],
                     noops: Sequence[Sequence[float]]) -> dict[str, tuple[float, ...]]:
    """Each method's times (``measured``, in the order measured) scaled by the median ``noop`` step over the
    mean of the ``noop`` steps measured just before and after it (``noops[i]`` and ``noops[i + 1]``, each
    a ``noop`` run's times, its step first), and ``noop``'s: the run of ``noops`` whose step is nearest
    that median (module doc)."""
    if len(noops) != len(measured) + 1:
        raise ValueError(f"{len(measured)} methods need {len(measured) + 1} noop runs around them, got {len(noops)}")
    typical = statistics.median(n[0] for n in noops)
    steps = {spec: tuple(t * typical / ((noops[i][0] + noops[i + 1][0]) / 2) for t in times)
             for i, (spec, times) in enumerate(measured.items())}
    nearest: Sequence[float] = min(noops, key=lambda n: abs(n[0] - typical))
    steps["noop"] = tuple(nearest)
    return steps


def _medians(rows: list[tuple[float, float, float, float]]) -> tuple[float, ...]:
    return tuple(statistics.median(r[i] for r in rows) for i in range(4))


class _Trainer:
    """One method's DDP model on this rank, trained on the workload's batches through its hook."""

    def __init__(self, workload: Any, spec: str, world: int, settings: argparse.Namespace,
                 batches: list[tuple[Any, Any]]) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from gradpress.testbed.advise.workload import _optimizer
        from gradpress.testbed.train import TrainConfig, install_hook

        torch.manual_seed(settings.seed)
        model = workload.build()
        self.workload, self.batches, self.step = workload, batches, 0
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=settings.bucket_cap_mb)
        self.meter = install_hook(self.ddp, TrainConfig(workers=world, compressor=spec, seed=settings.seed))
        self.optimizer = _optimizer(workload.optimizer, [p for p in model.parameters() if p.requires_grad],
                                    workload.lr)

    def run(self, steps: int) -> list[tuple[float, float, float, float]]:
        """``steps`` steps: each one's time from its start to the next one's, compute, compression and
        time in collectives."""
        from gradpress.testbed.train import metered_step

        rows = []
        started = time.perf_counter()
        for _ in range(steps):
            x, y = self.batches[self.step % len(self.batches)]
            self.step += 1
            _, compute_s, spent = metered_step(self.ddp, self.meter, self.optimizer, self.workload.loss, x, y,
                                               self.workload.grad_clip)
            now = time.perf_counter()
            rows.append((now - started, compute_s, spent.compress_s, spent.comm_s))
            started = now
        return rows
