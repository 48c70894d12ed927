"""Spawn Gloo process groups on the CPU for multi-process tests.

``run_workers(fn, world_size, *args)`` starts ``world_size`` fresh processes (forked from a forkserver
that has imported torch and gradpress once, :data:`PRELOAD`, each with the caller's environment), joins
them in one Gloo group through a FileStore (no port to race for), calls ``fn(rank, world_size, *args)``
in each and returns the per-rank results. ``fn`` must be a module-level function of an importable module.
Every run has a deadline: processes still alive after ``timeout`` seconds are killed (only those this
call started) and the call raises, so a hang fails the test instead of blocking the suite.
"""
from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class WorkerFailed(AssertionError):
    """A worker raised, exited early or missed the deadline."""


def _entry(fn: Callable, rank: int, world_size: int, store: str, out: str, args: tuple, group_timeout: float,
           backend: str, environment: dict[str, str]) -> None:
    os.environ.clear()  # the caller's environment now, not the forkserver's when it started
    os.environ.update(environment)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=group_timeout))
        result = {"ok": fn(rank, world_size, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = {"error": traceback.format_exc()}
    torch.save(result, out)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the result is already saved
        pass


def _method_modules() -> list[str]:
    """The modules of gradpress's methods and feedback memories (imported when one of theirs is first made:
    ~2 s of a worker's CPU, their kernels' decoration included; their kernels are compiled or loaded
    from the disk cache in the worker still, as a fresh process does it)."""
    from gradpress.compressors import declared

    methods, feedbacks = declared()
    return sorted({*methods.values(), *feedbacks.values()})


#: what every worker imports before its test's function runs: the forkserver imports them once and forks
#: each worker from itself (a fresh process of its own, without the ~5 s of imports each spawn pays);
#: ``torch._dynamo`` is what DistributedDataParallel's constructor imports. (Names the forkserver can
#: import: it does not take the parent's ``sys.path``, and skips a name it cannot import.)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numba", "gradpress", *_method_modules()]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def without_warm_up() -> None:
    """The front ends' kernel warm-up off in this worker, for its scenarios that follow: it runs a method
    in a Simulator for each new setting and float dtype before its first exchange; each kernel is then
    loaded from the disk cache where first used, in the exchange. For a worker whose subject is not the
    warm-up (tests/test_warmup.py has its tests; tests/test_runtime_dist.py trains every method with it)
    and whose timeouts do not wait on a kernel's loading."""
    from gradpress import warmup

    warmup.for_training = lambda *args, **kwargs: None  # (this process's module: the worker exits after)


def run_workers(fn: Callable, world_size: int, *args: Any, timeout: float = 90.0, group_timeout: float = 60.0,
                may_exit: frozenset[int] = frozenset(), backend: str = "gloo") -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks; the list of their return values.

    Ranks in ``may_exit`` may end without a result (a test that kills a worker); theirs is None.
    ``backend="nccl"``: NCCL instead, rank r on GPU r (the GPU tests).
    """
    ctx = _context()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        outs = [str(Path(tmp) / f"rank{r}.pt") for r in range(world_size)]
        procs = [ctx.Process(target=_entry,
                             args=(fn, r, world_size, store, outs[r], args, group_timeout, backend,
                                   dict(os.environ)))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in stuck:
            procs[r].kill()
            procs[r].join(5)
        if stuck:
            raise WorkerFailed(f"ranks {stuck} still running after {timeout} s (killed)")
        results = []
        for r, out in enumerate(outs):
            if not os.path.exists(out):
                if r in may_exit:
                    results.append(None)
                    continue
                raise WorkerFailed(f"rank {r} exited with code {procs[r].exitcode} and no result")
            result = torch.load(out, weights_only=False)
            if "error" in result:
                raise WorkerFailed(f"rank {r} raised:\n{result['error']}")
            results.append(result["ok"])
        return results
