"""Runs protocols on an executor (a process group) in the order DESIGN invariant 3 needs.

The :class:`Driver` issues the rounds of many groups' protocols so that every rank issues the same
collectives in the same order (DESIGN invariant 3), also with several DDP buckets in flight: a final
round (the last collectives of a group) completes asynchronously, and its continuation only decodes;
a non-final round is waited for and its protocol resumed only in :meth:`Driver.advance`, which the
integrations call at points that are the same on every rank (before starting the next bucket, after
the last one). PyTorch's own PowerSGD hook issues its second all-reduce from a completion callback,
whose timing differs between ranks, so with several buckets the ranks' collectives can interleave in
different orders; Gloo matches messages by order and aborts.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from gradpress.exchange.protocol import Protocol, Round

if TYPE_CHECKING:
    from gradpress.exchange.pipeline import Stats


class ExchangeFailed(RuntimeError):
    """An earlier exchange failed, so the ranks may be out of step: no further exchange is attempted."""


@dataclass
class _Run:
    protocol: Protocol
    step: int
    then: Callable[[Any], Any]
    future: torch.futures.Future | None = None
    handle: Any = None
    control: bool = False


def _same(value: Any) -> Any:
    return value


class Driver:
    """Runs protocols on an executor in the order DESIGN invariant 3 needs (see the module docstring).

    A protocol whose first round is its last (most methods) completes in one callback on the
    backend's thread: the round's results, the decoding and ``then``, holding the GIL once. Python
    threads hand the GIL over at most every few milliseconds, so each further callback in a chain can
    wait that long behind the training loop's own Python (DDP's backward thread).
    """

    def __init__(self, executor: Any, stats: Stats) -> None:
        self.executor, self.stats = executor, stats
        self._pending: deque[_Run] = deque()
        self.failure: BaseException | None = None

    def check(self) -> None:
        if self.failure is not None:
            raise ExchangeFailed(f"gradpress: an earlier exchange failed ({type(self.failure).__name__}: "
                                 f"{self.failure}); the ranks may be out of step") from self.failure

    def start(self, protocol: Protocol, step: int, devices: list[torch.device] | None = None,
              then: Callable[[Any], Any] = _same, control: bool = False) -> torch.futures.Future:
        """Run ``protocol`` up to its first round and issue it; a future of ``then(its result)``
        (``then`` runs where the result is formed, on a backend thread for asynchronous rounds).
        ``control``: its traffic is the ranks' agreement, counted as ``control_bytes``."""
        self.check()
        run = _Run(protocol, step, then, control=control)
        round_ = self._resume(run, None)
        if isinstance(round_, Round) and round_.final:
            return self._issue(run, round_).future(lambda results: self._finish(run, results), self._record)
        run.future = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
        if isinstance(round_, Round):
            run.handle = self._issue(run, round_)
            self._pending.append(run)
        else:
            self._complete(run, round_.value)
        return run.future

    def start_round(self, round_: Round, step: int, then: Callable[[list], Any]) -> torch.futures.Future:
        """Issue one final ``round_`` of step ``step`` with no protocol around it (a plan's exchange, see
        :class:`gradpress.exchange.pipeline.FlatAllReduce`); a future of ``then(its results)``, run where the
        round completes, a failure of either recorded as the exchange's (:meth:`check` raises it)."""
        self.check()

        def finish(results: list) -> Any:
            try:
                return then(results)
            except BaseException as error:
                self._record(error)
                raise

        return self._issue(_Run(None, step, _same), round_).future(finish, self._record)  # type: ignore[arg-type]

    def advance(self) -> None:
        """Wait for every pending non-final round, in start order, and issue what follows it."""
        while self._pending:
            run = self._pending.popleft()
            while run.handle is not None:
                handle, run.handle = run.handle, None
                try:
                    results = handle.wait()
                except BaseException as error:
                    self._fail(run, error)
                    raise
                round_ = self._resume(run, results)
                if not isinstance(round_, Round):
                    self._complete(run, round_.value)
                elif round_.final:
                    self._issue(run, round_).future(lambda results, run=run: self._settle(run, results),
                                                    lambda error, run=run: self._abandon(run, error))
                else:
                    run.handle = self._issue(run, round_)

    def run(self, protocol: Protocol, step: int, control: bool = False) -> Any:
        """Run ``protocol`` to its end (blocking) and return its result."""
        future = self.start(protocol, step, control=control)
        self.advance()
        return self.wait(future)

    def wait(self, future: torch.futures.Future) -> Any:
        """``future.wait()``, raising the exchange's own error: one raised in a backend callback
        reaches the future as a RuntimeError that only quotes it."""
        try:
            return future.wait()
        except RuntimeError as error:
            if self.failure is None or self.failure is error:
                raise
            raise self.failure from None

    def _resume(self, run: _Run, results: list | None) -> Round | StopIteration:
        """The protocol's next round, or its StopIteration (whose ``value`` is the protocol's result)."""
        try:
            return run.protocol.send(results)
        except StopIteration as stop:
            return stop
        except BaseException as error:
            self._fail(run, error)
            raise

    def _issue(self, run: _Run, round_: Round) -> Any:
        step = run.step
        if run.control:
            return self.executor.issue(round_, lambda sent, received: self.stats.add(
                step, control_bytes=sent + received), lambda seconds: None)
        return self.executor.issue(
            round_,
            lambda sent, received: self.stats.add(step, sent_bytes=sent, received_bytes=received, collectives=1),
            lambda seconds: self.stats.add(step, comm_s=seconds))

    def _record(self, error: BaseException) -> None:
        self.failure = self.failure or error

    def _complete(self, run: _Run, value: Any) -> None:
        """Complete ``run.future`` with ``run.then(value)`` (on the calling thread)."""
        try:
            result = run.then(value)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
            run.future.set_exception(error)
            return
        run.future.set_result(result)

    def _finish(self, run: _Run, results: list) -> Any:
        """Continuation of a final round (on a backend thread): decode, then ``run.then``."""
        try:
            try:
                run.protocol.send(results)
            except StopIteration as stop:
                return run.then(stop.value)
            raise RuntimeError("a protocol issued collectives after its final round")
        except BaseException as error:
            self._record(error)
            raise

    def _settle(self, run: _Run, results: list) -> None:
        """:meth:`_finish` for a run that started with a non-final round: completes its future."""
        try:
            value = self._finish(run, results)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
            self._abandon(run, error)
            return
        run.future.set_result(value)

    def _abandon(self, run: _Run, error: BaseException) -> None:
        """A run's final round failed (on a backend thread): record it, fail the run's future."""
        self._record(error)
        if not run.future.done():
            run.future.set_exception(error)

    def _fail(self, run: _Run, error: BaseException) -> None:
        self._record(error)
        for other in [run, *self._pending]:
            if other.future is not None and not other.future.done():
                other.future.set_exception(error)
        self._pending.clear()
