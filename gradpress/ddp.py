"""DistributedDataParallel integration: a communication hook driving the gradpress pipeline.

``state, hook = gradpress.ddp_comm_hook(spec, **options)`` then ``ddp.register_comm_hook(state, hook)``,
or in one call ``state = gradpress.register(ddp, spec, **options)``. Lightning's own
``DDPStrategy(ddp_comm_state=…, ddp_comm_hook=…)`` registers such a pair only on CUDA and checkpoints
rank 0's state alone: use :class:`gradpress.lightning.GradpressStrategy`; with Accelerate,
:func:`gradpress.accelerate.register`.

DDP hands the hook one bucket at a time, in the same order on every rank; the hook compresses each of
the bucket's gradients (keyed by parameter name; element-wise methods such as ``none`` compress the
bucket as one tensor, with the same result), starts the exchange and returns a future of the averaged
bucket, decoded and written into the bucket in one callback on the backend's thread. Buckets overlap
as with DDP's own all-reduce: single-round exchanges complete asynchronously, and any later round
of a multi-round exchange (a preliminary exchange, a sizes header, the second half of a rank-order
sum) is issued at the next bucket or after the last one, points that are the same on every rank
(DESIGN invariant 3). DDP's bucket rebuild after the first iteration changes which gradients share a
bucket, never their keys, so feedback memory carries over; ``no_sync()`` skips the hook and DDP
accumulates locally, as without one. A bucket whose exchange is, every step, one in-place all-reduce of
the whole bucket divided by n (``none``) is planned the first time it is exchanged
(:class:`gradpress.runtime.FlatAllReduce`): later steps do the work alone, without forming the general
exchange's per-step objects around it.

A state that knows its model (``model=``, or :func:`register`) watches the model's training forward
passes until the first bucket reaches the hook: if a second forward pass that DDP will synchronize
starts and no bucket went through the hook, it warns once (the hook was never registered on the DDP
that trains the model: e.g. Lightning's own ``DDPStrategy`` registers comm hooks only on CUDA, and
Accelerate's ``comm_hook`` takes only its built-in hooks; see :mod:`gradpress.lightning` and
:mod:`gradpress.accelerate`).
"""
from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Callable

import torch

from gradpress.auto import AUTO, AutoOptions, AutoPipeline, is_auto
from gradpress.compressor import Compressor
from gradpress.driver import Driver
from gradpress.runtime import Options, Pipeline, Stats, build
from gradpress.state import check_world_size_change, gathered, own_state
from gradpress.distributed import ProcessGroupExecutor, gather_objects, rank_and_size
from gradpress.distributed import process_group as resolve_group


class GradpressState:
    """What the hook carries: the spec and options, and (from the first bucket on) the pipeline.
    With ``spec`` ``"auto"`` (and :class:`gradpress.auto.AutoOptions` among the options) the pipeline is an
    :class:`~gradpress.auto.AutoPipeline`: it measures the first steps and picks a method per bucket.

    Keys: parameter names when the module is known (``model=``, or :func:`register`); otherwise
    ``"param<i>"`` in the order parameters first reach the hook, which for DDP's first iteration is the
    same in every process, so saved states load into a fresh DDP.

    ``on_world_size_change``: what :meth:`load_state_dict` does by default with a state saved at another
    world size (``"raise"``, or ``"reset"``: see there); the way to choose it where a framework loads the
    state (``GradpressStrategy(spec, on_world_size_change="reset")``, ``gradpress.accelerate.register``).
    """

    def __init__(self, spec: str | Compressor, *, process_group: Any = None, model: torch.nn.Module | None = None,
                 on_world_size_change: str = "raise", **options: Any) -> None:
        check_world_size_change(on_world_size_change)
        self.on_world_size_change = on_world_size_change
        self.auto = AutoOptions.pop_from(options) if is_auto(spec) else None
        self.options = Options.of(**options)
        if self.auto is not None:  # a pipeline per chosen method (gradpress.auto)
            self.compressor, self.spec, self.master = None, AUTO, None
        else:
            self.compressor = build(spec)  # once; unknown specs raise here, not at the first backward
            self.spec = self.compressor.spec
            self.master = build(self.options.master) if self.options.master is not None else None
        self._group = process_group
        module = getattr(model, "module", model)
        self._names = None if module is None else {id(p): name for name, p in module.named_parameters()}
        if self.options.exclude and self._names is None:
            raise ValueError("exclude matches parameter names: pass model=<the module> to ddp_comm_hook, "
                             "or use gradpress.register(ddp_model, …)")
        self._keys: dict[int, str] = {}
        self._plans: dict[int, Any] = {}  # per bucket index: its FlatAllReduce, where its exchange has one
        self._pipeline: Pipeline | AutoPipeline | None = None
        self._driver: Driver | None = None
        self._loaded: dict[str, Any] | None = None
        self._hooked = False  # a bucket reached the hook
        self._sync_forwards = 0  # training forward passes seen (synchronized ones, where DDP is known)
        self._watch_handle: Any = None
        if model is not None:
            self._watch(model)

    # -- the hook's work ----------------------------------------------------------------------------
    def _setup(self) -> None:
        executor = ProcessGroupExecutor(resolve_group(self._group, self.options.timeout))
        self._pipeline = self._new_pipeline(executor.rank, executor.world_size)
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
        self._hooked = True
        if self._pipeline is None:
            self._setup()
        driver, pipeline = self._driver, self._pipeline
        assert driver is not None and pipeline is not None
        driver.check()
        driver.advance()
        buffer = bucket.buffer()
        plan = self._plans.get(bucket.index())
        if plan is not None and plan.fits(buffer):  # formed at an earlier step: only the work is left
            future = plan.start(driver, lambda mean: buffer)
            if bucket.is_last():
                driver.advance()
            return future
        if buffer.is_sparse:
            raise TypeError("gradpress compresses dense gradients; this bucket holds a sparse one")
        grads = bucket.gradients()
        items = [(self._key(p), g) for p, g in zip(bucket.parameters(), grads)]
        devices = None if buffer.is_cpu else [buffer.device]
        agreement = pipeline.agreement(items)
        if agreement is not None:  # the first time these gradients are exchanged (blocking, once)
            driver.run(agreement.protocol, agreement.step, control=True)
        groups = pipeline.groups(items, bucket=buffer)
        planner = getattr(pipeline, "flat_allreduce", None)  # (auto's pipelines choose per step: no plans)
        self._plans[bucket.index()] = planner(items, buffer) if planner is not None else None

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
    def state_dict(self, gathered: bool = False) -> dict[str, Any]:
        """This rank's feedback memory, per-parameter step counters and shapes, and the compressor's own
        state (warm starts). ``gathered=True`` (collective: every rank calls it): every rank's state in
        one dict, for a checkpoint written by one rank; each rank loads its own part of it."""
        if self._pipeline is not None:
            state = self._pipeline.state_dict()
        elif self._loaded is not None:
            state = self._loaded
        else:
            state = self._local_pipeline().state_dict()
        return _gathered(state, self._group) if gathered else state

    def load_state_dict(self, state: dict[str, Any], on_world_size_change: str | None = None) -> None:
        """Restore :meth:`state_dict` (this rank's, or a gathered one; before training resumes: it
        applies at the first bucket if the hook has not run yet). Checked at once: a state of another
        rank, method or shape raises ``ValueError``, and so does one of another world size unless
        ``on_world_size_change="reset"`` (default: the state's own, ``"raise"`` unless made otherwise):
        then the step counters, statistics and shared compressor state (PowerSGD's warm starts) are
        kept, and the error-feedback memory starts afresh, with a ``UserWarning`` naming what was
        dropped (:meth:`gradpress.runtime.Pipeline.own_part`). Load tensors onto the gradients' device
        (``torch.load(map_location=…)``)."""
        mode = self.on_world_size_change if on_world_size_change is None else on_world_size_change
        if self._pipeline is not None:
            self._pipeline.load_state_dict(state, mode)
            self._plans.clear()  # the next step goes the general way, which checks the loaded shapes
        else:
            local = self._local_pipeline()
            state = local.own_part(state, mode)  # this rank's part, of this world
            local.load_state_dict(state)  # validate now
            self._loaded = state  # state_dict() returns it

    def _local_pipeline(self) -> Pipeline | AutoPipeline:
        """A pipeline of this rank's, before the hook has run (for its state)."""
        return self._new_pipeline(*rank_and_size(self._group))

    def _new_pipeline(self, rank: int, world_size: int) -> Pipeline | AutoPipeline:
        if self.auto is not None:
            return AutoPipeline(self.auto, self.options, rank, world_size)
        return Pipeline(self.compressor, self.options, rank, world_size, self.master)

    @property
    def error(self) -> BaseException | None:
        """The error that ended this hook's exchanges, as gradpress raised it (e.g. the
        :class:`~gradpress.NonFiniteError` naming the faulty ranks); DDP hands an error of the hook's
        future on from ``backward()`` as a ``RuntimeError`` quoting it. None while all is well."""
        return None if self._driver is None else self._driver.failure

    def stats(self) -> dict[str, Any]:
        """This rank's per-step and cumulative bytes and times (see :class:`gradpress.runtime.Stats`); with
        ``"auto"``, also ``"auto"``: what it chose and why (:mod:`gradpress.auto`)."""
        if self._pipeline is None:
            if self.auto is None and self._loaded is None:
                return Stats().report()
            local = self._local_pipeline()  # what was loaded; auto: what it will do (measure, or a choice)
            if self._loaded is not None:
                local.load_state_dict(self._loaded)
            return local.report()
        return self._pipeline.report()

    # -- the no-op watch (see the module's docstring) --------------------------------------------------
    def _watch(self, module: torch.nn.Module) -> None:
        self._unwatch()
        self._watch_handle = module.register_forward_pre_hook(_Watch(self, module))

    def _unwatch(self) -> None:
        if self._watch_handle is not None:
            self._watch_handle.remove()
            self._watch_handle = None


NO_OP_WARNING = (
    "gradpress: a second training forward pass of this model started and no gradient bucket has gone "
    "through the gradpress hook: gradients are averaged without gradpress (or not at all). The hook was not "
    "registered on the DistributedDataParallel that trains this model: a framework may have skipped it "
    "(Lightning's DDPStrategy registers comm hooks only on CUDA; Accelerate's comm_hook option takes only "
    "its built-in hooks), or the state was made with ddp_comm_hook() and never passed to "
    "ddp.register_comm_hook(). Use gradpress.register(ddp_model, spec), "
    "gradpress.lightning.GradpressStrategy(spec) or gradpress.accelerate.register(accelerator, model, spec)."
)


class _Watch:
    """A forward pre-hook that warns once when a model trained under a gradpress state runs a second
    synchronized training forward pass and no bucket has reached the hook. Where it watches the wrapped
    module and finds the DDP calling it, it moves onto that DDP, whose ``require_backward_grad_sync``
    tells a ``no_sync()`` pass (the hook is not expected there) from a synchronized one. It removes
    itself at the first bucket or at the warning; copies and pickles of the model carry a no-op."""

    def __init__(self, state: GradpressState, module: torch.nn.Module) -> None:
        self._state = weakref.ref(state)
        self._ddp = module if _is_ddp(module) else None

    def __reduce__(self) -> tuple:
        return (_Inert, ())

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        state = self._state()
        if state is None or state._hooked:
            if state is not None:
                state._unwatch()
            return None
        if not (module.training and torch.is_grad_enabled()):
            return None
        ddp = self._ddp
        if ddp is None:
            ddp = _calling_ddp(module)
            if ddp is not None:  # watch the DDP from now on: it knows no_sync()
                state._watch(ddp)
        if ddp is not None and not ddp.require_backward_grad_sync:
            return None
        state._sync_forwards += 1
        if state._sync_forwards >= 2:
            state._unwatch()
            warnings.warn(NO_OP_WARNING, RuntimeWarning, stacklevel=2)
        return None


class _Inert:
    def __call__(self, *args: Any) -> None:
        return None


def _is_ddp(module: Any) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def _is_fsdp(module: Any) -> bool:
    """Whether ``module`` is sharded by FSDP: a ``FullyShardedDataParallel`` (FSDP1) or a module that
    ``fully_shard`` made (FSDP2)."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # (torch without distributed support)
        return False
    return isinstance(module, (FullyShardedDataParallel, FSDPModule))


def _not_ddp(model: Any) -> str:
    """Why :func:`register` refuses ``model``, which is not a DistributedDataParallel."""
    name = type(model).__name__
    if _is_fsdp(model):
        return (f"gradpress.register hooks DistributedDataParallel, got {name}: FSDP is not supported by "
                "register (FSDP reduce-scatters each rank's shard of the gradients, and its comm hooks "
                "take another form than DDP's); a sharded path is planned as gradpress.fsdp")
    hint = " (wrap it first: DistributedDataParallel(model))" if isinstance(model, torch.nn.Module) else ""
    return f"gradpress.register: expected a torch.nn.parallel.DistributedDataParallel, got {name}{hint}"


def _calling_ddp(module: torch.nn.Module, depth: int = 12) -> Any:
    """The DistributedDataParallel whose forward is calling ``module`` (a few frames up), or None."""
    frame = sys._getframe(2)
    while frame is not None and depth > 0:
        calling = frame.f_code.co_name in ("forward", "_run_ddp_forward")
        owner = frame.f_locals.get("self") if calling else None
        if _is_ddp(owner) and owner.module is module:
            return owner
        frame, depth = frame.f_back, depth - 1
    return None


def _moved(value: Any, device: torch.device | str) -> Any:
    """``value`` (nested dicts, lists and tuples of a state) with its tensors on ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, device) for v in value)
    return value


def _own_part(state: GradpressState, value: Any, device: torch.device | str) -> dict[str, Any]:
    """This rank's part of ``value`` (its own state or a gathered one), its tensors on ``device``: what a
    framework integration hands to :meth:`GradpressState.load_state_dict` after loading a checkpoint
    onto the CPU."""
    return _moved(own_state(value, *rank_and_size(state._group), state.on_world_size_change), device)


def _gathered(state: dict[str, Any], group: Any) -> dict[str, Any]:
    # on the CPU: one device-neutral file, whatever device each rank trains on (NCCL pickles through it)
    return gathered(gather_objects(_moved(state, "cpu"), group))


def hook(state, bucket):  # noqa: ANN001, ANN201 - DDP compares the annotations literally
    """The DDP communication hook: ``ddp.register_comm_hook(state, gradpress.ddp.hook)``
    (``state``: a :class:`GradpressState`; ``bucket``: a ``torch.distributed.GradBucket``; returns a
    ``torch.futures.Future`` of the averaged bucket)."""
    return state.run_bucket(bucket)


def ddp_comm_hook(spec: str | Compressor, **options: Any) -> tuple[GradpressState, Callable]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``.

    Options: those of :class:`gradpress.runtime.Options`, plus ``process_group`` (default: the default
    group; pass the DDP's own if it has another), ``model`` (the module, for parameter names; needed
    by ``exclude``) and ``on_world_size_change`` (:class:`GradpressState`); with ``spec`` ``"auto"``,
    those of :class:`gradpress.auto.AutoOptions`.
    """
    return GradpressState(spec, **options), hook


def register(ddp_model: Any, spec: str | Compressor, **options: Any) -> GradpressState:
    """Register the gradpress hook on ``ddp_model`` (a DistributedDataParallel) and return its state,
    keyed by the module's parameter names and talking on the DDP's process group. Anything else
    (FSDP's ``FullyShardedDataParallel`` or a ``fully_shard`` module among them) raises ``TypeError``."""
    if not _is_ddp(ddp_model):
        raise TypeError(_not_ddp(ddp_model))
    options.setdefault("process_group", getattr(ddp_model, "process_group", None))
    state = GradpressState(spec, model=ddp_model.module, **options)
    ddp_model.register_comm_hook(state, hook)
    state._watch(ddp_model)
    return state
