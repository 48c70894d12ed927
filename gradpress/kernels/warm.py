"""Compiling kernels ahead of their first use, in one timed step that logs one line.

numba compiles a kernel for each combination of argument types the first time it meets it (tens of
seconds for a method such as THC on an empty disk cache), or loads it from the disk cache (a fraction of
a second). A front end set up for training runs its method once on small tensors
(:func:`gradpress.warm_up`), inside :func:`warm`, so that this happens there, on every rank before its
first exchange, and is reported: not in the first exchange, where a rank still compiling keeps the others
waiting, possibly past their ``timeout``.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Hashable, Sequence

from gradpress.kernels.dispatch import numba_enabled
from gradpress.log import logger

_done: set[Hashable] = set()
_lock = threading.Lock()
_large_only: list[Callable[[], object]] = []


def large_only(run: Callable[[], object]) -> Callable[[], object]:
    """Register ``run`` (a decorator): it calls, on small inputs, a kernel that the code calls only for
    large tensors (the warm-up's small tensors would not reach it). :func:`warm` calls every registered
    one before its first run."""
    _large_only.append(run)
    return run


def warm(runs: Sequence[tuple[Hashable, str, str, Callable[[], object]]], setting: str) -> bool:
    """Call each ``(key, method, dtype, run)``'s ``run`` (which calls kernels on small inputs) whose key
    was not warmed in this process yet, then log one INFO line on the ``gradpress`` logger: the methods
    and dtypes run, ``setting``, how many kernel specializations were compiled and how many loaded from
    the disk cache, and the seconds it took. A run that returns False had nothing to run (a setting the
    method refuses, which the front end reports itself); one that raises is reported in a WARNING line
    and left to compile on first use (warming up never fails a set-up). Nothing is done with numba off
    (``GRADPRESS_NUMBA=0``: no kernel runs). Returns whether anything ran."""
    if not numba_enabled():
        return False
    with _lock:
        todo = [(key, method, dtype, run) for key, method, dtype, run in runs if key not in _done]
        if not todo:
            return False
        from gradpress.kernels.jit import compile_counts  # (loads numba)

        compiled, loaded = compile_counts()
        start = time.perf_counter()
        while _large_only:
            _large_only.pop()()
        ran: list[tuple[str, str]] = []
        for key, method, dtype, run in todo:
            try:
                if run() is not False:
                    ran.append((method, dtype))
            except Exception as error:  # noqa: BLE001 - reported; the method then compiles on first use
                logger.warning("gradpress: warming up %s (%s; %s) failed (%s: %s); its kernels compile when "
                               "first used", method, dtype, setting, type(error).__name__, error)
                continue
            _done.add(key)
        if not ran:
            return False
        seconds = time.perf_counter() - start
        now_compiled, now_loaded = compile_counts()
        methods = ", ".join(dict.fromkeys(method for method, _ in ran))
        dtypes = ", ".join(dict.fromkeys(dtype for _, dtype in ran))
        logger.info("gradpress: kernels for %s (%s; %s) ready in %.1f s (%d compiled, %d loaded from the "
                    "disk cache)", methods, dtypes, setting, seconds, now_compiled - compiled,
                    now_loaded - loaded)
        return True
