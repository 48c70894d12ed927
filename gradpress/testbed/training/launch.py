"""The launcher of ``gradpress train``: the data fetched once, the emulated network built where asked for,
one process per worker (``python -m gradpress.testbed.train --worker``), each with the variables torchrun
would set on its node, and rank 0's :class:`~gradpress.testbed.results.Run` read back. If any worker fails
the others are stopped and :class:`~.config.TrainFailed` says which rank failed and why; the network is
deleted in every case."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from gradpress.testbed import arguments, netem
from gradpress.testbed.results import Run
from gradpress.testbed.training.config import TrainConfig, TrainFailed

PORT = 29511


def train(config: TrainConfig, json_path: str | Path | None = None, progress: bool = True) -> Run:
    """Run ``config`` on local worker processes and return rank 0's record (also saved to ``json_path``)."""
    from gradpress.testbed import data

    data.fetch(config.data)  # once, here: workers only load
    with tempfile.TemporaryDirectory(prefix="gradpress-train-") as scratch:
        result = Path(scratch) / "run.json"
        network = None
        if config.bandwidth is None:
            _launch(config, result, progress, address="127.0.0.1", port=_free_port(), star=None)
        else:
            # one node: every worker on a link of its own; several: the workers of a node share its link
            shape = (config.nodes, config.workers) if config.nodes > 1 else (config.workers, 1)
            with netem.emulated_star(shape[0], config.bandwidth, workers_per_node=shape[1]) as star:
                _launch(config, result, progress, address=star.addresses[0], port=PORT, star=star)
            network = star.settings()
        run = Run.from_json(result.read_text())
        if network is not None:  # the links' tbf settings, for the cost model's token bucket
            run = replace(run, info={**run.info, "network": network})
    if json_path is not None:
        run.save(json_path)
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_environment(rank: int, nodes: int, workers_per_node: int, address: str,
                         port: int) -> dict[str, str]:
    """The variables torchrun sets for worker ``rank`` of ``nodes`` nodes of ``workers_per_node``
    processes each (``--nnodes``, ``--nproc-per-node``; ranks numbered node by node)."""
    node, local = divmod(rank, workers_per_node)
    world = nodes * workers_per_node
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(workers_per_node), "GROUP_RANK": str(node),
            "GROUP_WORLD_SIZE": str(nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": address, "MASTER_PORT": str(port)}


def _launch(config: TrainConfig, result: Path, progress: bool, address: str, port: int,
            star: netem.Star | None) -> None:
    payload = json.dumps(asdict(config))
    processes = []
    for rank in range(config.world_size):
        argv = [sys.executable, "-m", "gradpress.testbed.train", "--worker", payload, str(rank), address,
                str(port), str(result)]
        env = {**os.environ, "OMP_NUM_THREADS": str(config.threads), "GRADPRESS_PROGRESS": str(int(progress)),
               **torchrun_environment(rank, config.nodes, config.workers, address, port)}
        if star is not None:
            argv = star.command(rank, argv)
            env.update(star.environment(rank))
            # no reverse DNS inside the namespaces: c10d would warn about it at every connection
            env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        else:
            env["GLOO_SOCKET_IFNAME"] = "lo"
        stderr = None if rank == 0 else subprocess.PIPE
        processes.append(subprocess.Popen(argv, env=env, stderr=stderr, stdin=subprocess.DEVNULL))
    try:
        _wait(processes, deadline=time.monotonic() + 24 * 3600, result=result)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def _wait(processes: list[subprocess.Popen], deadline: float, result: Path | None = None) -> None:
    """Wait for every worker; the first failure stops the others and raises :class:`TrainFailed`.

    ``result``: the run's result path, beside which a failing worker records its exception
    (:func:`_record_failure`). The message's first line names the worker and why it failed (the
    earliest recorded exception among the failed workers: a worker that fails first makes the others
    fail on the broken connection after it); the end of that worker's stderr follows, where captured."""
    while True:
        codes = [p.poll() for p in processes]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            reasons = {rank: _failure(result, rank) for rank, _ in failed} if result is not None else {}
            recorded = [(reason[0], rank, code) for rank, code in failed if (reason := reasons.get(rank))]
            rank, code = min(recorded)[1:] if recorded else failed[0]
            for p in processes:
                if p.poll() is None:
                    p.terminate()
            tail, stderr = "", processes[rank].stderr
            if stderr is not None:
                tail = stderr.read().decode(errors="replace")[-3000:]
            why = found[1] if (found := reasons.get(rank)) else ""
            raise TrainFailed(f"worker {rank} exited with status {code}" + (f": {why}" if why else "")
                              + (f"\n{tail}" if tail else ""))
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            raise TrainFailed("training did not finish in time")
        time.sleep(0.05)


def _failure_path(result: Path, rank: int) -> Path:
    return result.with_name(f"error-{rank}.txt")


def _record_failure(result: Path, rank: int, error: BaseException) -> None:
    """Leave ``error`` beside the result for the launcher (:func:`_wait` puts it in TrainFailed)."""
    try:
        _failure_path(result, rank).write_text(arguments.one_line(f"{type(error).__name__}: {error}")[:1000])
    except OSError:
        pass


def _failure(result: Path, rank: int) -> tuple[int, str] | None:
    """(when, why) worker ``rank`` failed, as it recorded it; None if it recorded nothing."""
    path = _failure_path(result, rank)
    try:
        return path.stat().st_mtime_ns, path.read_text().strip()
    except OSError:
        return None
