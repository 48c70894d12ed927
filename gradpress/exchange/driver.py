"""Runs protocols on an executor (a process group) in the order docs/design.md's
collective-order invariant needs.

The :class:`Driver` issues the rounds of many groups' protocols so that every rank issues the same
collectives in the same order (invariant: collective order, docs/design.md), also with several DDP buckets in
flight: a final
round (the last collectives of a group) completes asynchronously, and its continuation only decodes;
a non-final round is waited for and its protocol resumed only in :meth:`Driver.advance`, which the
integrations call at points that are the same on every rank (before starting the next bucket, after
the last one). PyTorch's own PowerSGD hook issues its second all-reduce from a completion callback,
whose timing differs between ranks, so with several buckets the ranks' collectives can interleave in
different orders; Gloo matches messages by order and aborts.

Failures follow the same rule. An exchange that fails (a NaN/Inf flagged in-band, an overflow, a
collective's error) is recorded when it is found, which for an asynchronous round is on a backend
thread, at a time that differs between ranks: it does not stop the exchanges started after it in the
same step, which every other rank starts too. The driver closes (:class:`ExchangeFailed` for any later
exchange) only at :meth:`Driver.check`, which the integrations call where every rank has seen the same
failures (before a step's first exchange), or at once for a failure found where it is called (in
:meth:`Driver.advance`, at points the same on every rank). Of several failures the driver keeps the
one of the exchange started first, which is the one a caller waiting for the exchanges in order meets
first, on every rank.
"""
from __future__ import annotations

import math
import threading
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
    order: int = 0  # runs started before it (the same on every rank)


def _same(value: Any) -> Any:
    return value


def _value(future: torch.futures.Future) -> Any:
    return future.value()


def failed_future(error: BaseException, devices: list[torch.device] | None = None) -> torch.futures.Future:
    """A future that fails with ``error`` as a collective's future does: its ``wait()`` raises a
    RuntimeError quoting ``error``, and a caller in C++ (DDP's reducer) sees an error. (Python's
    ``Future.set_exception`` keeps the exception as the future's *value*, which DDP would try to read
    as the bucket: "Unable to cast … to Tensor".)"""
    done: torch.futures.Future[None] = torch.futures.Future(devices=[*devices]) if devices \
        else torch.futures.Future()
    done.set_result(None)

    def fail(_: torch.futures.Future) -> None:
        raise error

    return done.then(fail)


class Driver:
    """Runs protocols on an executor in the order the collective-order invariant
    needs (docs/design.md; see the module docstring).

    A protocol whose first round is its last (most methods) completes in one callback on the
    backend's thread: the round's results, the decoding and ``then``, holding the GIL once. Python
    threads hand the GIL over at most every few milliseconds, so each further callback in a chain can
    wait that long behind the training loop's own Python (DDP's backward thread).
    """

    def __init__(self, executor: Any, stats: Stats) -> None:
        self.executor, self.stats = executor, stats
        self._pending: deque[_Run] = deque()
        self._lock = threading.Lock()
        self._started = 0
        self.failure: BaseException | None = None  # of the earliest started exchange that failed
        self._failed_at = math.inf
        self.closed = False

    def check(self) -> None:
        """Raise :class:`ExchangeFailed` if an exchange has failed, and close: no exchange starts after.
        Call it only where every rank has seen the same failures: before a step's first exchange, the
        exchanges of the step before waited for in order up to the first that failed (DDP waits for a
        backward pass's buckets so; the Communicator for each call's exchanges)."""
        if self.failure is not None:
            self.closed = True
        self._refuse()

    def _refuse(self) -> None:
        if self.closed:
            failure = self.failure
            raise ExchangeFailed(f"gradpress: an earlier exchange failed ({type(failure).__name__}: "
                                 f"{failure}); no exchange is attempted after a failure (the ranks may be "
                                 "out of step): restart from a checkpoint") from failure

    def stop(self, error: BaseException) -> None:
        """``error``, raised where the integration called the driver (at a point the same on every
        rank, when every rank raises it), ends the exchanges: it is recorded (if no exchange started
        before it failed), every pending exchange fails with it, and no exchange starts after."""
        if not isinstance(error, ExchangeFailed):
            self._record(error, self._started)
        self._fail(None, error)

    def start(self, protocol: Protocol, step: int, devices: list[torch.device] | None = None,
              then: Callable[[Any], Any] = _same, control: bool = False) -> torch.futures.Future:
        """Run ``protocol`` up to its first round and issue it; a future of ``then(its result)``
        (``then`` runs where the result is formed, on a backend thread for asynchronous rounds).
        ``control``: its traffic is the ranks' agreement, counted as ``control_bytes``. A failure
        reaches the future as an error (for DDP too, see :func:`failed_future`) and is recorded."""
        self._refuse()
        run = _Run(protocol, step, then, control=control, order=self._next())
        round_ = self._resume(run, None)
        if isinstance(round_, Round) and round_.final:
            return self._issue(run, round_).future(lambda results: self._finish(run, results),
                                                   lambda error: self._record(error, run.order))
        run.future = torch.futures.Future(devices=[*devices]) if devices else torch.futures.Future()
        if isinstance(round_, Round):
            run.handle = self._issue(run, round_)
            self._pending.append(run)
        else:
            self._complete(run, round_.value)
        return run.future.then(_value)  # (completed by set_exception on a failure: see failed_future)

    def start_round(self, round_: Round, step: int, then: Callable[[list], Any]) -> torch.futures.Future:
        """Issue one final ``round_`` of step ``step`` with no protocol around it (a plan's exchange, see
        :class:`gradpress.exchange.pipeline.FlatAllReduce`); a future of ``then(its results)``, run where the
        round completes, a failure of either recorded as the exchange's (:meth:`check` raises it)."""
        self._refuse()
        order = self._next()

        def finish(results: list) -> Any:
            try:
                return then(results)
            except BaseException as error:
                self._record(error, order)
                raise

        run = _Run(None, step, _same, order=order)  # type: ignore[arg-type]
        return self._issue(run, round_).future(finish, lambda error: self._record(error, order))

    def advance(self) -> None:
        """Wait for every pending non-final round, in start order, and issue what follows it. A failure
        (a collective's error, or the protocol's, e.g. a NaN/Inf flagged in the round) fails every
        pending exchange's future and closes the driver (see the module docstring); it is not raised
        here but where the futures are waited for."""
        while self._pending:
            run = self._pending.popleft()
            while run.handle is not None:
                handle, run.handle = run.handle, None
                try:
                    results = handle.wait()
                except BaseException as error:  # noqa: BLE001 - handed to the futures
                    self._record(error, run.order)
                    self._fail(run, error)
                    return
                try:
                    round_ = self._resume(run, results)
                except BaseException:  # noqa: BLE001 - recorded and handed to the futures by _resume
                    return
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

    def _next(self) -> int:
        self._started += 1
        return self._started - 1

    def _resume(self, run: _Run, results: list | None) -> Round | StopIteration:
        """The protocol's next round, or its StopIteration (whose ``value`` is the protocol's result)."""
        try:
            return run.protocol.send(results) if results is not None else next(run.protocol)
        except StopIteration as stop:
            return stop
        except BaseException as error:
            self._record(error, run.order)
            self._fail(run, error)
            raise

    def _issue(self, run: _Run, round_: Round) -> Any:
        step = run.step
        if run.control:
            return self.executor.issue(round_, lambda sent, received: self.stats.add(
                step, control_bytes=sent + received), lambda seconds: None)
        scope = round_.scope
        return self.executor.issue(
            round_,
            lambda sent, received: self.stats.add_traffic(step, scope, sent, received),
            lambda seconds: self.stats.add(step, comm_s=seconds))

    def _record(self, error: BaseException, order: int) -> None:
        """Keep ``error`` as the failure if no exchange started before the one it ends has failed."""
        with self._lock:
            if order < self._failed_at:
                self.failure, self._failed_at = error, order

    def _complete(self, run: _Run, value: Any) -> None:
        """Complete ``run.future`` with ``run.then(value)`` (on the calling thread)."""
        assert run.future is not None  # (a run that started with a non-final round has one)
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
            self._record(error, run.order)
            raise

    def _settle(self, run: _Run, results: list) -> None:
        """:meth:`_finish` for a run that started with a non-final round: completes its future."""
        assert run.future is not None  # (as for _complete)
        try:
            value = self._finish(run, results)
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the future
            self._abandon(run, error)
            return
        run.future.set_result(value)

    def _abandon(self, run: _Run, error: BaseException) -> None:
        """A run's final round failed (on a backend thread): record it, fail the run's future."""
        self._record(error, run.order)
        assert run.future is not None  # (as for _complete)
        if not run.future.done():
            run.future.set_exception(error)

    def _fail(self, run: _Run | None, error: BaseException) -> None:
        """A failure found where the driver was called: ``run``'s and every pending run's futures fail
        with it, and no exchange starts after (the same point on every rank, see :meth:`advance`)."""
        self.closed = True
        for other in [run, *self._pending]:
            if other is not None and other.future is not None and not other.future.done():
                other.future.set_exception(error)
        self._pending.clear()
