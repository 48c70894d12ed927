"""Compressed gradient averaging for custom training loops (no DDP): the same pipeline as the hook.

    comm = gradpress.Communicator("topk:ratio=0.01", seed=0)
    loss.backward()
    comm.reduce_gradients(model)          # every p.grad becomes the workers' average
    optimizer.step()

``reduce(tensor, key)`` averages one tensor; ``reduce_many({key: tensor})`` averages many at once,
packing their packets into as few collectives as the strategy allows. Every call is collective: all
ranks call it with the same keys, shapes and dtypes, in the same order.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from gradpress import warmup
from gradpress.auto import AutoOptions, AutoPipeline, is_auto
from gradpress.core.compressor import Compressor
from gradpress.exchange.distributed import NodeExecutor, ProcessGroupExecutor, gather_objects, spans_world
from gradpress.exchange.distributed import process_group as resolve_group
from gradpress.exchange.driver import Driver
from gradpress.exchange.hierarchy import HierarchicalPipeline, auto_layout, check_options, make_pipeline
from gradpress.exchange.pipeline import Options, Pipeline, build, describe, flat_stats
from gradpress.exchange.state import gathered as _gathered


class Communicator:
    """Averages tensors over ``process_group`` (default: the default group) with ``spec``'s compression
    (``"topk:ratio=0.01"``, ``"auto"``, or a :class:`~gradpress.Compressor`). Keys name the tensors:
    feedback memory, step counters and random streams follow them, and ``exclude`` matches them.

    Options (keywords; checked at once, a bad one raises ``ValueError``/``TypeError`` here):

    * ``feedback`` (str): the error-feedback memory (``"residual"``, ``"none"``, …; default: the
      method's own, ``residual`` for biased methods and ``none`` for unbiased ones).
    * ``min_numel`` (int, default 0): tensors with fewer elements go uncompressed.
    * ``exclude`` (str or list of str): key patterns (``fnmatch``: ``"conv1.*"``, ``"*.bias"``) left
      uncompressed.
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
    * with spec ``"auto"`` (:mod:`gradpress.auto`: a method per key, chosen by measuring the job):
      ``candidates`` (the specs it chooses among), ``measure_with`` (``"powersgd:rank=4"``: what the
      steps before the first decision run), ``settle_steps`` (2), ``measure_steps`` (5),
      ``recheck_every`` (500; 0: never), ``margin`` (0.05: the predicted gain a change of methods
      needs), ``rank_by`` (``"quality"``: time to a quality target; ``"step"``: step time alone) and
      ``intra_bandwidth`` (several nodes: the rate inside a node; default measured).

    The options are those of :class:`gradpress.exchange.pipeline.Options` and, for ``"auto"``,
    :class:`gradpress.auto.AutoOptions`.
    """

    def __init__(self, spec: str | Compressor, process_group: Any = None, **options: Any) -> None:
        auto = AutoOptions.pop_from(options) if is_auto(spec) else None
        self.options = Options.of(**options)
        check_options(self.options, auto is not None)
        compressor = build(spec) if auto is None else None  # a bad spec raises before any collective
        warmup.for_training(compressor, self.options, auto, group=process_group)  # before any collective
        executor = ProcessGroupExecutor(resolve_group(process_group, self.options.timeout), process_group)
        self.rank, self.world_size = executor.rank, executor.world_size
        self._pipeline: Pipeline | AutoPipeline | HierarchicalPipeline
        if auto is not None:  # a pipeline per chosen method (gradpress.auto)
            found = auto_layout(self.options, self.rank, self.world_size, spans_world(process_group))
            self._pipeline = AutoPipeline(auto, self.options, self.rank, self.world_size, found)
            self._spec = "auto"
        else:
            assert compressor is not None  # (built above)
            whole = self.options.hierarchy is None or spans_world(process_group)
            self._pipeline = make_pipeline(compressor, self.options, self.rank, self.world_size,
                                           whole_world=whole)
            self._spec = compressor.spec
        talk: ProcessGroupExecutor | NodeExecutor = executor
        pipeline = self._pipeline
        layout = pipeline.layout if isinstance(pipeline, (HierarchicalPipeline, AutoPipeline)) else None
        if layout is not None:  # rounds inside the node and between nodes (auto's two-level candidates too)
            talk = NodeExecutor(executor, layout.local_size, self.options.timeout)
        self._driver = Driver(talk, self._pipeline.stats)
        self._auto = auto

    def __repr__(self) -> str:
        """``Communicator('topk:ratio=0.01', seed=3, …)``: the spec and the options not at their default."""
        return f"{type(self).__name__}({describe(self._spec, self.options, self._auto)})"

    @property
    def compressor(self) -> Compressor | None:
        """The compressor (None for ``"auto"``, which runs one per chosen method)."""
        return self._pipeline.compressor

    def reduce(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        """The average of every rank's ``tensor`` (same shape, dtype and device); ``tensor`` is left as is."""
        return self.reduce_many({key: tensor})[key]

    def reduce_many(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The averages of many tensors in one exchange (their packets flattened into shared buffers)."""
        return self._reduce(list(tensors.items()))

    def _reduce(self, items: list[tuple[str, torch.Tensor]],
                writable: bool = False) -> dict[str, torch.Tensor]:
        """:meth:`reduce_many`; ``writable``: the tensors may be overwritten, and receive their averages
        where the method can decode into them."""
        self._driver.check()
        agreement = self._pipeline.agreement(items)
        if agreement is not None:  # the first time these tensors are exchanged
            self._driver.run(agreement.protocol, agreement.step, control=True)
        devices = sorted({t.device for _, t in items if t.device.type != "cpu"}, key=str) or None
        started = [(g.members, self._driver.start(g.protocol, g.step, devices))
                   for g in self._pipeline.groups(items, writable=writable)]
        self._driver.advance()
        out: list[torch.Tensor] = [None] * len(items)  # type: ignore[list-item]
        for members, future in started:
            for i, averaged in zip(members, self._driver.wait(future), strict=True):
                out[i] = averaged
        return {key: averaged for (key, _), averaged in zip(items, out, strict=True)}

    def reduce_gradients(self, parameters: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Replace the gradient of every parameter that requires one by the ranks' average, in one
        exchange. A parameter without a gradient (unused this step) counts as zeros, so every rank
        ends with the same gradients; parameters with ``requires_grad=False`` are left out. The
        gradients are the exchange's to overwrite, as a DDP bucket is: a method that can write the
        average into a gradient's own storage does (no copy after); after an error they may hold part
        of the exchange's work (divided by n, say), as a DDP bucket would."""
        named = parameters.named_parameters() if isinstance(parameters, torch.nn.Module) else parameters
        chosen = [(name, p) for name, p in named if p.requires_grad]
        grads = [(name, p.grad.detach() if p.grad is not None else torch.zeros_like(p))
                 for name, p in chosen]
        averaged = self._reduce(grads, writable=True)
        for name, p in chosen:
            if p.grad is None:
                p.grad = averaged[name]
            elif averaged[name].data_ptr() != p.grad.data_ptr() or averaged[name].dtype != p.grad.dtype:
                p.grad.copy_(averaged[name])

    def state_dict(self, gathered: bool = False) -> dict[str, Any]:
        """This rank's feedback memory, per-key step counters and shapes, and the compressor's own
        state (warm starts). ``gathered=True`` (collective): every rank's state in one dict, for a
        checkpoint written by one rank; each rank loads its own part of it."""
        state = self._pipeline.state_dict()
        return _gathered(gather_objects(state, self._driver.executor.group)) if gathered else state

    def load_state_dict(self, state: dict[str, Any], on_world_size_change: str = "raise") -> None:
        """Restore :meth:`state_dict` (this rank's, or a gathered one); ``ValueError`` if it is another
        rank's, method's or shape's, or another world size's unless ``on_world_size_change="reset"``:
        then error feedback starts afresh, with a ``UserWarning`` naming what was dropped
        (:meth:`gradpress.exchange.pipeline.Pipeline.own_part`). The next exchange agrees on the loaded
        step counters (:mod:`gradpress.exchange.agreement`): ranks resumed from different steps raise
        there."""
        self._pipeline.load_state_dict(state, on_world_size_change)

    def stats(self, flat: bool = False) -> dict[str, Any]:
        """This rank's per-step and cumulative bytes and times (see
        :class:`gradpress.exchange.pipeline.Stats`); with ``"auto"``, also ``"auto"``: what it chose and
        why (:mod:`gradpress.auto`). ``flat=True``: the same figures as one flat dict of numbers for a
        metrics logger (``"gradpress/sent_bytes"``, …: :func:`gradpress.flat_stats`)."""
        report = self._pipeline.report()
        return flat_stats(report) if flat else report

