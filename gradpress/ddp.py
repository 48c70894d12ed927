"""DistributedDataParallel integration: a communication hook driving the gradpress pipeline.

``state, hook = gradpress.ddp_comm_hook(spec, **options)`` then ``ddp.register_comm_hook(state, hook)``
(the pair Lightning's ``DDPStrategy(ddp_comm_state=…, ddp_comm_hook=…)`` takes as it is), or in one
call ``state = gradpress.register(ddp, spec, **options)``.

DDP hands the hook one bucket at a time, in the same order on every rank; the hook compresses each of
the bucket's gradients (keyed by parameter name; element-wise methods such as ``none`` compress the
bucket as one tensor, with the same result), starts the exchange and returns a future of the averaged
bucket, decoded and written into the bucket in one callback on the backend's thread. Buckets overlap
as with DDP's own all-reduce: single-round exchanges complete asynchronously, and any later round
of a multi-round exchange (a preliminary exchange, a sizes header, the second half of a rank-order
sum) is issued at the next bucket or after the last one, points that are the same on every rank
(DESIGN invariant 3). DDP's bucket rebuild after the first iteration changes which gradients share a
bucket, never their keys, so feedback memory carries over; ``no_sync()`` skips the hook and DDP
accumulates locally, as without one.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from gradpress.compressor import Compressor
from gradpress.runtime import Driver, Options, Pipeline, Stats, compressor_of
from gradpress.strategy import ProcessGroupExecutor, process_group as resolve_group


class GradpressState:
    """What the hook carries: the spec and options, and (from the first bucket on) the pipeline.

    Keys: parameter names when the module is known (``model=``, or :func:`register`); otherwise
    ``"param<i>"`` in the order parameters first reach the hook, which for DDP's first iteration is the
    same in every process, so saved states load into a fresh DDP.
    """

    def __init__(self, spec: str | Compressor, *, process_group: Any = None, model: torch.nn.Module | None = None,
                 **options: Any) -> None:
        self.spec = spec
        self.options = Options.of(**options)
        compressor_of(spec)  # unknown specs raise here, not at the first backward
        if self.options.master is not None:
            compressor_of(self.options.master)
        self._group = process_group
        module = getattr(model, "module", model)
        self._names = None if module is None else {id(p): name for name, p in module.named_parameters()}
        if self.options.exclude and self._names is None:
            raise ValueError("exclude matches parameter names: pass model=<the module> to ddp_comm_hook, "
                             "or use gradpress.register(ddp_model, …)")
        self._keys: dict[int, str] = {}
        self._pipeline: Pipeline | None = None
        self._driver: Driver | None = None
        self._loaded: dict[str, Any] | None = None

    # -- the hook's work ----------------------------------------------------------------------------
    def _setup(self) -> None:
        executor = ProcessGroupExecutor(resolve_group(self._group, self.options.timeout))
        self._pipeline = Pipeline(self.spec, self.options, executor.rank, executor.world_size)
        self._driver = Driver(executor, self._pipeline.stats)
        if self._loaded is not None:
            self._pipeline.load_state_dict(self._loaded)
            self._loaded = None

    def _key(self, parameter: torch.Tensor) -> str:
        key = self._keys.get(id(parameter))
        if key is None:
            if self._names is not None:
                if id(parameter) not in self._names:
                    raise ValueError("a bucket holds a parameter that is not in the module given to gradpress")
                key = self._names[id(parameter)]
            else:
                key = f"param{len(self._keys)}"
            self._keys[id(parameter)] = key
        return key

    def run_bucket(self, bucket: Any) -> torch.futures.Future:
        """Start exchanging one DDP bucket; a future of the bucket's averaged gradients."""
        if self._pipeline is None:
            self._setup()
        driver, pipeline = self._driver, self._pipeline
        assert driver is not None and pipeline is not None
        driver.check()
        driver.advance()
        buffer = bucket.buffer()
        if buffer.is_sparse:
            raise TypeError("gradpress compresses dense gradients; this bucket holds a sparse one")
        grads = bucket.gradients()
        items = [(self._key(p), g) for p, g in zip(bucket.parameters(), grads)]
        devices = [buffer.device] if buffer.device.type != "cpu" else None
        groups = pipeline.groups(items, bucket=buffer)

        def assemble(averages: list[list[torch.Tensor]]) -> torch.Tensor:
            for group, averaged in zip(groups, averages):
                outputs = [group.flat] if group.flat is not None else [grads[i] for i in group.members]
                for output, average in zip(outputs, averaged):
                    if average.data_ptr() != output.data_ptr() or average.dtype != output.dtype:
                        output.copy_(average.view(output.shape))
            return buffer

        if len(groups) == 1:  # decoding and assembling in one callback (see Driver)
            future = driver.start(groups[0].protocol, groups[0].step, devices, then=lambda one: assemble([one]))
        else:
            started = [driver.start(g.protocol, g.step, devices) for g in groups]
            future = torch.futures.collect_all(started).then(lambda done: assemble([f.value() for f in done.value()]))
        if bucket.is_last():
            driver.advance()
        return future

    # -- state and statistics ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Feedback memory, per-parameter step counters and the compressor's own state (warm starts)."""
        if self._pipeline is not None:
            return self._pipeline.state_dict()
        if self._loaded is not None:
            return self._loaded
        return Pipeline(self.spec, self.options, 0, 1).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (before training resumes; it applies at the first bucket if the
        hook has not run yet). Load tensors onto the gradients' device (``torch.load(map_location=…)``)."""
        if self._pipeline is not None:
            self._pipeline.load_state_dict(state)
        else:
            Pipeline(self.spec, self.options, 0, 1).load_state_dict(state)  # validate now
            self._loaded = state

    def stats(self) -> dict[str, Any]:
        """This rank's per-step and cumulative bytes and times (see :class:`gradpress.runtime.Stats`)."""
        if self._pipeline is None:
            return Stats().report()
        return self._pipeline.report()


def hook(state, bucket):  # noqa: ANN001, ANN201 - DDP compares the annotations literally
    """The DDP communication hook: ``ddp.register_comm_hook(state, gradpress.ddp.hook)``
    (``state``: a :class:`GradpressState`; ``bucket``: a ``torch.distributed.GradBucket``; returns a
    ``torch.futures.Future`` of the averaged bucket)."""
    return state.run_bucket(bucket)


def ddp_comm_hook(spec: str | Compressor, **options: Any) -> tuple[GradpressState, Callable]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``.

    Options: those of :class:`gradpress.runtime.Options`, plus ``process_group`` (default: the default
    group; pass the DDP's own if it has another) and ``model`` (the module, for parameter names; needed
    by ``exclude``).
    """
    return GradpressState(spec, **options), hook


def register(ddp_model: Any, spec: str | Compressor, **options: Any) -> GradpressState:
    """Register the gradpress hook on ``ddp_model`` (a DistributedDataParallel) and return its state,
    keyed by the module's parameter names and talking on the DDP's process group."""
    if not hasattr(ddp_model, "register_comm_hook"):
        raise TypeError(f"expected a DistributedDataParallel model, got {type(ddp_model).__name__}")
    options.setdefault("process_group", getattr(ddp_model, "process_group", None))
    state = GradpressState(spec, model=ddp_model.module, **options)
    ddp_model.register_comm_hook(state, hook)
    return state
