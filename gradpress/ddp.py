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
(invariant: collective order, docs/design.md). DDP's bucket rebuild after the first iteration changes which
gradients share a
bucket, never their keys, so feedback memory carries over; ``no_sync()`` skips the hook and DDP
accumulates locally, as without one. A bucket whose exchange is, every step, one in-place all-reduce of
the whole bucket divided by n (``none``) is planned the first time it is exchanged
(:class:`gradpress.exchange.pipeline.FlatAllReduce`): later steps do the work alone, without forming the general
exchange's per-step objects around it.

A state that knows its model (``model=``, or :func:`register`) watches the model's training forward
passes until the first bucket reaches the hook: if a second forward pass that DDP will synchronize
starts and no bucket went through the hook, it warns once (the hook was never registered on the DDP
that trains the model: e.g. Lightning's own ``DDPStrategy`` registers comm hooks only on CUDA, and
Accelerate's ``comm_hook`` takes only its built-in hooks; see :mod:`gradpress.lightning` and
:mod:`gradpress.accelerate`).
"""
from __future__ import annotations

import re
import sys
import warnings
import weakref
from types import FrameType
from typing import Any, Callable

import torch

from gradpress import warmup
from gradpress.auto import AUTO, AutoOptions, AutoPipeline, is_auto
from gradpress.core.compressor import Compressor
from gradpress.exchange.distributed import (
    NodeExecutor,
    ProcessGroupExecutor,
    all_settled,
    chain,
    gather_objects,
    rank_and_size,
    spans_world,
)
from gradpress.exchange.distributed import process_group as resolve_group
from gradpress.exchange.driver import Driver, failed_future
from gradpress.exchange.hierarchy import HierarchicalPipeline, auto_layout, check_options, make_pipeline
from gradpress.exchange.pipeline import Options, Pipeline, Stats, build, describe, flat_stats
from gradpress.exchange.state import check_world_size_change, gathered, own_state, shapes_of

_PLAIN_KEY = re.compile(r"param\d+")  # the keys of a hook that does not know the module's names


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
        check_options(self.options, self.auto is not None)
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
        self._pipeline: Pipeline | AutoPipeline | HierarchicalPipeline | None = None
        self._driver: Driver | None = None
        self._talk: ProcessGroupExecutor | None = None
        self._loaded: dict[str, Any] | None = None
        self._hooked = False  # a bucket reached the hook
        self._sync_forwards = 0  # training forward passes seen (synchronized ones, where DDP is known)
        self._watch_handle: Any = None
        if model is not None:
            self._watch(model)
        warmup.for_training(self.compressor, self.options, self.auto, model=module, group=process_group)

    def __repr__(self) -> str:
        """``GradpressState('topk:ratio=0.01', seed=3, …)``: the spec and the options not at their default."""
        return f"{type(self).__name__}({describe(self.spec, self.options, self.auto)})"

    # -- the hook's work ----------------------------------------------------------------------------
    def _executor(self) -> ProcessGroupExecutor:
        """The executor on the group gradpress talks on (made once: with ``timeout``, a new group)."""
        if self._talk is None:
            self._talk = ProcessGroupExecutor(resolve_group(self._group, self.options.timeout), self._group)
        return self._talk

    def _setup(self) -> None:
        executor: ProcessGroupExecutor | NodeExecutor = self._executor()
        pipeline = self._pipeline = self._new_pipeline(executor.rank, executor.world_size)
        if isinstance(pipeline, HierarchicalPipeline) or (isinstance(pipeline, AutoPipeline)
                                                          and pipeline.layout is not None):
            # rounds inside the node and between nodes (auto's two-level candidates too)
            assert pipeline.layout is not None
            executor = NodeExecutor(self._executor(), pipeline.layout.local_size, self.options.timeout)
        self._driver = Driver(executor, pipeline.stats)
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
        """Start exchanging one DDP bucket; a future of the bucket's averaged gradients.

        Errors reach DDP through the future, never raised here: DDP's reducer, when a hook raises,
        is left expecting the rest of the backward pass, and its next forward or backward pass fails
        on its own assertion ("Expected to have finished reduction in the prior iteration", or an
        INTERNAL ASSERT in reducer.cpp) instead of gradpress's :class:`~gradpress.exchange.driver.ExchangeFailed`.
        DDP hands the buckets over in index order and, before the next backward pass, has waited for
        this one's futures in that order up to the first that failed: the first bucket is where every
        rank has seen the same failures, and where a failed exchange closes the hook (the buckets
        after a failure in the same pass are still exchanged, as every other rank does)."""
        self._hooked = True
        try:
            if self._pipeline is None:
                self._setup()
            assert self._driver is not None
            if bucket.index() == 0:
                self._driver.check()
            return self._exchange(bucket)
        except Exception as error:  # noqa: BLE001 - handed to DDP in the future
            if self._driver is not None:
                self._driver.stop(error)
            buffer = bucket.buffer()
            return failed_future(error, None if buffer.is_cpu else [buffer.device])

    def _exchange(self, bucket: Any) -> torch.futures.Future:
        driver, pipeline = self._driver, self._pipeline
        assert driver is not None and pipeline is not None
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
        items = [(self._key(p), g) for p, g in zip(bucket.parameters(), grads, strict=True)]
        devices = None if buffer.is_cpu else [buffer.device]
        agreement = pipeline.agreement(items)
        if agreement is not None:  # the first time these gradients are exchanged (blocking, once)
            driver.run(agreement.protocol, agreement.step, control=True)
        groups = pipeline.groups(items, bucket=buffer)
        planner = getattr(pipeline, "flat_allreduce", None)  # (auto's pipelines choose per step: no plans)
        self._plans[bucket.index()] = planner(items, buffer) if planner is not None else None

        def assemble(averages: list[list[torch.Tensor]]) -> torch.Tensor:
            for group, averaged in zip(groups, averages, strict=True):
                outputs = [group.flat] if group.flat is not None else [grads[i] for i in group.members]
                for output, average in zip(outputs, averaged, strict=True):
                    if average.data_ptr() != output.data_ptr() or average.dtype != output.dtype:
                        output.copy_(average.view(output.shape))
            return buffer

        if len(groups) == 1:  # decoding and assembling in one callback (see Driver)
            future = driver.start(groups[0].protocol, groups[0].step, devices, then=lambda one: assemble([one]))
        else:
            started = [driver.start(g.protocol, g.step, devices) for g in groups]
            # every group settled, then each waited for in start order: a failure is the first started
            # group's, as gradpress raised it (driver.wait), on every rank
            future = chain(all_settled(started, devices), lambda _: assemble([driver.wait(f) for f in started]))
        if bucket.is_last():
            driver.advance()
        return future

    # -- state and statistics ------------------------------------------------------------------------
    def state_dict(self, gathered: bool = False) -> dict[str, Any]:
        """This rank's feedback memory, per-parameter step counters and shapes, and the compressor's own
        state (warm starts). ``gathered=True`` (collective: every rank calls it): every rank's state in
        one dict, for a checkpoint written by one rank; each rank loads its own part of it (gathered on
        the group the exchanges use, so a peer that never joins makes it raise after ``timeout``)."""
        if self._pipeline is not None:
            state = self._pipeline.state_dict()
        elif self._loaded is not None:
            state = self._loaded
        else:
            state = self._local_pipeline().state_dict()
        return _gathered(state, self._executor().group) if gathered else state

    def load_state_dict(self, state: dict[str, Any], on_world_size_change: str | None = None) -> None:
        """Restore :meth:`state_dict` (this rank's, or a gathered one; before training resumes: it
        applies at the first bucket if the hook has not run yet). Checked at once: a state of another
        rank, method or shape raises ``ValueError``, and so does one keyed another way than this hook keys
        the parameters (by name with ``model=`` or :func:`register`, else ``"param<i>"``), and one of another
        world size unless ``on_world_size_change="reset"`` (default: the state's own, ``"raise"`` unless
        made otherwise): then the step counters, statistics and shared compressor state (PowerSGD's warm
        starts) are kept, and the error-feedback memory starts afresh, with a ``UserWarning`` naming what
        was dropped (:meth:`gradpress.exchange.pipeline.Pipeline.own_part`). The next exchange agrees on the
        loaded step counters (:mod:`gradpress.exchange.agreement`): ranks resumed from different steps
        raise there. Load tensors onto the gradients' device (``torch.load(map_location=…)``)."""
        mode = self.on_world_size_change if on_world_size_change is None else on_world_size_change
        pipeline = self._pipeline if self._pipeline is not None else self._local_pipeline()
        mine = pipeline.own_part(state, mode)  # this rank's part, of this world
        self._check_keys(mine)
        pipeline.load_state_dict(mine)  # checked before anything is loaded
        if self._pipeline is not None:
            self._plans.clear()  # the next step goes the general way, which checks the loaded shapes
        else:
            self._loaded = mine  # loaded at the first bucket (state_dict() returns it)

    def _check_keys(self, state: dict[str, Any]) -> None:
        """A state keyed as this hook keys the parameters (by name where it knows the module, else
        ``"param<i>"``): one keyed the other way would never apply, so it is refused, saying how to fix."""
        steps = state["steps"] if isinstance(state["steps"], dict) else {}
        recorded = list(dict.fromkeys([*shapes_of(state), *steps]))
        if self._names is not None:
            names = set(self._names.values())
            foreign = [key for key in recorded if key not in names]
            how = ("this hook keys the parameters by name (it was given the model): a state saved by a hook "
                   "made without model= is keyed 'param<i>'; make both hooks with model=<the module> (or "
                   "gradpress.register(ddp_model, …))")
        else:
            foreign = [key for key in recorded if not _PLAIN_KEY.fullmatch(key)]
            how = ("this hook keys the parameters 'param<i>' (it was made without model=): a state saved by "
                   "gradpress.register(ddp_model, …) or with model= is keyed by parameter names; pass "
                   "model=<the module> to ddp_comm_hook (or use gradpress.register(ddp_model, …))")
        if foreign:
            shown = ", ".join(repr(key) for key in foreign[:4]) + (f", … ({len(foreign)} in all)"
                                                                   if len(foreign) > 4 else "")
            raise ValueError(f"gradpress state: keys {shown} match no parameter of this hook; {how}")

    def _local_pipeline(self) -> Pipeline | AutoPipeline | HierarchicalPipeline:
        """A pipeline of this rank's, before the hook has run (for its state)."""
        return self._new_pipeline(*rank_and_size(self._group))

    def _new_pipeline(self, rank: int, world_size: int) -> Pipeline | AutoPipeline | HierarchicalPipeline:
        if self.auto is not None:
            found = auto_layout(self.options, rank, world_size, spans_world(self._group))
            return AutoPipeline(self.auto, self.options, rank, world_size, found)
        whole = self.options.hierarchy is None or spans_world(self._group)
        assert self.compressor is not None  # (a spec's, when not auto)
        return make_pipeline(self.compressor, self.options, rank, world_size, self.master, whole)

    @property
    def error(self) -> BaseException | None:
        """The error that ended this hook's exchanges, as gradpress raised it (e.g. the
        :class:`~gradpress.NonFiniteError` naming the faulty ranks); DDP hands an error of the hook's
        future on from ``backward()`` as a ``RuntimeError`` quoting it. None while all is well."""
        return None if self._driver is None else self._driver.failure

    def stats(self, flat: bool = False) -> dict[str, Any]:
        """This rank's per-step and cumulative bytes and times (see
        :class:`gradpress.exchange.pipeline.Stats`); with ``"auto"``, also ``"auto"``: what it chose and
        why (:mod:`gradpress.auto`). ``flat=True``: the same figures as one flat dict of numbers for a
        metrics logger (``"gradpress/sent_bytes"``, …: :func:`gradpress.flat_stats`)."""
        if self._pipeline is None:
            if self.auto is None and self._loaded is None:
                report = Stats().report()
            else:
                local = self._local_pipeline()  # what was loaded; auto: what it will do (measure, or a choice)
                if self._loaded is not None:
                    local.load_state_dict(self._loaded)
                report = local.report()
        else:
            report = self._pipeline.report()
        return flat_stats(report) if flat else report

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


def _unwrap_ddp(model: Any) -> Any:
    """The DistributedDataParallel ``model`` is or wraps (through Lightning Fabric's ``_FabricModule``,
    whose ``_forward_module`` it is, and ``torch.compile``'s ``_orig_mod``), or None. An object with
    ``register_comm_hook`` of its own counts as one."""
    for _ in range(4):
        if _is_ddp(model):
            return model
        inner = getattr(model, "_forward_module", None)
        if inner is None:
            inner = getattr(model, "_orig_mod", None)
        if inner is None:
            return model if hasattr(model, "register_comm_hook") else None
        model = inner
    return None


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
                "take another form than DDP's); use gradpress.fsdp.register(model, spec, mesh=mesh) on a "
                "model sharded with torch.distributed.fsdp.fully_shard (FSDP2, HSDP included)")
    hint = " (wrap it first: DistributedDataParallel(model))" if isinstance(model, torch.nn.Module) else ""
    return f"gradpress.register: expected a torch.nn.parallel.DistributedDataParallel, got {name}{hint}"


def _calling_ddp(module: torch.nn.Module, depth: int = 12) -> Any:
    """The DistributedDataParallel whose forward is calling ``module`` (a few frames up), or None."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and depth > 0:
        calling = frame.f_code.co_name in ("forward", "_run_ddp_forward")
        owner = frame.f_locals.get("self") if calling else None
        if owner is not None and _is_ddp(owner) and owner.module is module:
            return owner
        frame, depth = frame.f_back, depth - 1
    return None


def _check_options(spec: str | Compressor, options: dict[str, Any]) -> None:
    """Raise now for a bad spec or option, as :class:`GradpressState` would (a framework integration
    checks them before its workers start, without the model ``exclude`` will match)."""
    given = {name: value for name, value in options.items() if name not in ("process_group", "model")}
    auto = AutoOptions.pop_from(given) if is_auto(spec) else None
    checked = Options.of(**given)
    check_options(checked, auto is not None)
    if auto is None:
        build(spec)
        if checked.master is not None:
            build(checked.master)


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

    ``spec``: the method (``"topk:ratio=0.01"``, ``"auto"``, or a :class:`~gradpress.Compressor`).

    Options (keywords; checked at once, a bad one raises ``ValueError``/``TypeError`` here):

    * ``feedback`` (str): the error-feedback memory (``"residual"``, ``"none"``, …; default: the
      method's own, ``residual`` for biased methods and ``none`` for unbiased ones).
    * ``min_numel`` (int, default 0): tensors with fewer elements go uncompressed.
    * ``exclude`` (str or list of str): parameter-name patterns (``fnmatch``: ``"conv1.*"``,
      ``"*.bias"``) left uncompressed.
    * ``warmup_steps`` (int, default 0): each tensor's first steps go uncompressed.
    * ``seed`` (int, default 0): the seed of the shared and private random streams.
    * ``timeout`` (seconds or ``timedelta``): a stuck collective raises after it (gradpress then talks on
      a process group of its own with that timeout); default: the process group's.
    * ``mode`` (default ``"collective"``): all-reduce / all-gather; ``"ps"``: a parameter server at
      ``root``; ``"switch"``: integer-only aggregation at ``root``.
    * ``master`` (spec): ``ps`` mode: the compressor re-compressing the aggregate (bidirectional).
    * ``root`` (int, default 0): the rank of the parameter server / switch.
    * ``overflow`` (default ``"widen"``): integer sums widen to a dtype that holds them; ``"raise"``.
    * ``partial`` (float in (0, 1], default 1): ``ps``/``switch``: aggregate ⌈q·n⌉ workers per tensor
      (THC's partial aggregation for stragglers).
    * ``deterministic`` (bool, default True): float sums over 3+ workers in rank order (bit-reproducible);
      False: the backend's all-reduce.
    * ``hierarchy`` (default None): ``"node"``: several nodes, each summing its ranks' gradients
      uncompressed and compressing only what crosses between nodes, 1/k of it per rank
      (:mod:`gradpress.exchange.hierarchy`); ``root`` then names a node.
    * ``local_size`` (int): with ``hierarchy="node"``, the ranks of a node (default: torchrun's
      ``LOCAL_WORLD_SIZE``).
    * with spec ``"auto"`` (:mod:`gradpress.auto`): ``candidates`` (the specs it chooses among),
      ``measure_with`` (``"powersgd:rank=4"``: what the steps before the first decision run),
      ``settle_steps`` (2), ``measure_steps`` (5), ``recheck_every`` (500; 0: never) and ``margin``
      (0.05: the predicted gain a change of methods needs), ``rank_by`` (``"quality"``: time to a
      quality target; ``"step"``: step time alone) and ``intra_bandwidth`` (several nodes: the rate
      inside a node; default measured).
    * ``process_group``: the group to talk on (default: the default group; pass the DDP's own if it
      has another).
    * ``model``: the module DDP wraps, for parameter names (keys of the state; needed by ``exclude``).
    * ``on_world_size_change`` (default ``"raise"``): ``"reset"`` loads a state of another world size
      with the error-feedback memory started afresh (:class:`GradpressState`).

    The options are those of :class:`gradpress.exchange.pipeline.Options` and, for ``"auto"``,
    :class:`gradpress.auto.AutoOptions`.
    """
    return GradpressState(spec, **options), hook


def register(ddp_model: Any, spec: str | Compressor, **options: Any) -> GradpressState:
    """Register the gradpress hook on ``ddp_model`` and return its state (``stats()``, ``error``,
    ``state_dict()``), keyed by the module's parameter names and talking on the DDP's process group.

    ``ddp_model``: a DistributedDataParallel, or what wraps one: Lightning Fabric's module from
    ``fabric.setup`` with a DDP strategy, ``torch.compile``'s wrapper. ``spec``: the method
    (``"topk:ratio=0.01"``, ``"auto"``, or a :class:`~gradpress.Compressor`).

    Options (keywords; checked at once, a bad one raises ``ValueError``/``TypeError`` here):

    * ``feedback`` (str): the error-feedback memory (``"residual"``, ``"none"``, …; default: the
      method's own, ``residual`` for biased methods and ``none`` for unbiased ones).
    * ``min_numel`` (int, default 0): tensors with fewer elements go uncompressed.
    * ``exclude`` (str or list of str): parameter-name patterns (``fnmatch``: ``"conv1.*"``,
      ``"*.bias"``) left uncompressed.
    * ``warmup_steps`` (int, default 0): each tensor's first steps go uncompressed.
    * ``seed`` (int, default 0): the seed of the shared and private random streams.
    * ``timeout`` (seconds or ``timedelta``): a stuck collective raises after it (gradpress then talks on
      a process group of its own with that timeout); default: the process group's.
    * ``mode`` (default ``"collective"``): all-reduce / all-gather; ``"ps"``: a parameter server at
      ``root``; ``"switch"``: integer-only aggregation at ``root``.
    * ``master`` (spec): ``ps`` mode: the compressor re-compressing the aggregate (bidirectional).
    * ``root`` (int, default 0): the rank of the parameter server / switch.
    * ``overflow`` (default ``"widen"``): integer sums widen to a dtype that holds them; ``"raise"``.
    * ``partial`` (float in (0, 1], default 1): ``ps``/``switch``: aggregate ⌈q·n⌉ workers per tensor
      (THC's partial aggregation for stragglers).
    * ``deterministic`` (bool, default True): float sums over 3+ workers in rank order (bit-reproducible);
      False: the backend's all-reduce.
    * ``hierarchy`` (default None): ``"node"``: several nodes, each summing its ranks' gradients
      uncompressed and compressing only what crosses between nodes, 1/k of it per rank
      (:mod:`gradpress.exchange.hierarchy`); ``root`` then names a node.
    * ``local_size`` (int): with ``hierarchy="node"``, the ranks of a node (default: torchrun's
      ``LOCAL_WORLD_SIZE``).
    * with spec ``"auto"`` (:mod:`gradpress.auto`): ``candidates`` (the specs it chooses among),
      ``measure_with`` (``"powersgd:rank=4"``: what the steps before the first decision run),
      ``settle_steps`` (2), ``measure_steps`` (5), ``recheck_every`` (500; 0: never) and ``margin``
      (0.05: the predicted gain a change of methods needs), ``rank_by`` (``"quality"``: time to a
      quality target; ``"step"``: step time alone) and ``intra_bandwidth`` (several nodes: the rate
      inside a node; default measured).
    * ``process_group``: the group to talk on (default: the DDP's own).
    * ``on_world_size_change`` (default ``"raise"``): ``"reset"`` loads a state of another world size
      with the error-feedback memory started afresh (:class:`GradpressState`).

    FSDP's ``FullyShardedDataParallel`` and ``fully_shard`` modules raise ``TypeError`` (a model sharded
    with ``fully_shard``: :func:`gradpress.fsdp.register`).

    The options are those of :class:`gradpress.exchange.pipeline.Options` and, for ``"auto"``,
    :class:`gradpress.auto.AutoOptions`.
    """
    ddp_model = _ddp_of(ddp_model)
    options.setdefault("process_group", getattr(ddp_model, "process_group", None))
    state = GradpressState(spec, model=ddp_model.module, **options)
    ddp_model.register_comm_hook(state, hook)
    state._watch(ddp_model)
    return state


def _ddp_of(model: Any) -> Any:
    """The DistributedDataParallel ``model`` is or wraps; ``TypeError`` saying what it is otherwise (a
    Fabric module set up without DDP, an FSDP model, a plain module)."""
    found = _unwrap_ddp(model)
    if found is None:
        inner = getattr(model, "_forward_module", None)
        if inner is not None:  # Lightning Fabric's module, set up without DDP
            raise TypeError(f"expected a DistributedDataParallel model: this Fabric module wraps a "
                            f"{type(inner).__name__}, not a DistributedDataParallel (gradpress hooks DDP: "
                            f"Fabric(strategy='ddp') or gradpress.lightning.GradpressFabricStrategy, with "
                            f"several processes)")
        raise TypeError(_not_ddp(model))
    if _is_fsdp(found):
        raise TypeError(_not_ddp(found))
    return found
