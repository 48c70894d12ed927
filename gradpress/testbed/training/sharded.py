"""The sharded rows of ``gradpress train``: the model wrapped with FSDP2's ``fully_shard`` instead of DDP.

The mesh (:func:`mesh_shape`): ``hsdp`` is 2-D ("replicate", "shard"), the replicas the nodes and the
shards a node's workers, as the README's example builds it from torchrun's variables ((workers, 1) on
one node: a single replica would leave nothing to exchange between replicas); ``fsdp`` is 1-D, every
rank. Every submodule holding parameters of its own (a layer) is sharded, then the root
(:func:`shard_model`). ``torch-fsdp``/``torch-hsdp`` keep FSDP2's own reduction; a gradpress method
runs through ``gradpress.fsdp.register`` on the mesh.

What the meter counts (:class:`_Reductions`), the reference hooks' rule: the tensors handed to the
gradients' reduction, not FSDP's all-gathers of the parameters. On a 1-D mesh FSDP's reduce-scatter
input (``torch-fsdp``) or gradpress's packets; on an HSDP mesh the shard exchanged between the replicas
(the all-reduce's input, or gradpress's packets), and as bytes inside the node what FSDP's
reduce-scatter sent in the shard group: (k−1)/k of its input. Every reduction runs on the training
thread inside ``backward()`` (FSDP waits for it on the CPU), so the time inside them is the step's
communication and compression, and the rest its compute.

Evaluation (:func:`gather_parameters`): every rank gathers each parameter's full tensor, and rank 0
evaluates an unsharded copy of the model holding them, as it evaluates the DDP model.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

import torch

from gradpress.auto import is_auto
from gradpress.testbed.results import REFERENCES
from gradpress.testbed.training.config import TrainConfig
from gradpress.testbed.training.hooks import Spent, _Meter


def mesh_shape(config: TrainConfig) -> tuple[int, ...]:
    """The mesh of ``config``'s sharded run: ``(world,)`` for ``fsdp``; for ``hsdp``, ``(nodes,
    workers)`` on several nodes, else ``(workers, 1)``."""
    if config.sharding == "fsdp":
        return (config.world_size,)
    return (config.nodes, config.workers) if config.nodes > 1 else (config.workers, 1)


def check_sharding(config: TrainConfig) -> None:
    """Raise ValueError unless ``config``'s method and options can run on its sharded model, as
    ``gradpress.fsdp.register`` would say at the workers' start: a named method (not ``auto``), no
    ``hierarchy`` (HSDP's mesh is its own two levels), and on a 1-D mesh a method whose summands add
    element-wise (:func:`gradpress.fsdp.scatter_methods`) in mode ``collective``."""
    if config.sharding is None:
        return
    if "hierarchy" in config.options or "local_size" in config.options:
        raise ValueError(f"@{config.sharding} takes no hierarchy option: the {config.sharding} mesh sets "
                         "where the exchange runs (SPEC@node is the two levels under DDP)")
    if config.compressor in REFERENCES:
        return
    if is_auto(config.compressor):
        raise ValueError("gradpress.fsdp does not run 'auto': name a method")
    if config.sharding == "fsdp":
        import gradpress
        from gradpress.fsdp import scatter_methods

        compressor = gradpress.make(config.compressor)
        if not (compressor.summable and not compressor.stateful_decode):
            raise ValueError(f"@fsdp compresses FSDP's reduce-scatter, whose summands must add element-wise "
                             f"over the ranks; {compressor.spec} cannot (methods that can: "
                             f"{', '.join(scatter_methods())}); @hsdp compresses the exchange between the "
                             "replicas with any method")
        if config.options.get("mode", "collective") != "collective":
            raise ValueError(f"@fsdp reduce-scatters in mode 'collective', not {config.options['mode']!r} "
                             "(the ps and switch modes run @hsdp)")


def exchange_size(config: TrainConfig) -> int:
    """The ranks among which gradpress exchanges in ``config``'s sharded run: the replicas (HSDP), or
    every rank (the 1-D mesh's reduce-scatter)."""
    return mesh_shape(config)[0]


def shard_model(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """``model`` sharded on ``mesh``: ``fully_shard`` on every submodule holding parameters of its own
    (children before their parents), then on the root, as the README's example does; a parameter shared
    by several modules (tied weights) is left to the root."""
    from torch.distributed.fsdp import fully_shard

    holders = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    for module in reversed(list(model.modules())[1:]):
        own = list(module.parameters(recurse=False))
        if own and all(holders[id(p)] == 1 for p in own):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_mesh(config: TrainConfig) -> Any:
    """The device mesh of ``config``'s sharded run (:func:`mesh_shape`), on the CPU."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(config)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def install(model: torch.nn.Module, config: TrainConfig) -> _Meter:
    """Shard ``model`` on ``config``'s mesh, set up its reduction (FSDP2's own, or gradpress's on the
    mesh) and return the meter that reads what the reduction spends (module doc)."""
    mesh = build_mesh(config)
    shard_model(model, mesh)
    hsdp = config.sharding == "hsdp"
    reductions = _Reductions(hsdp)
    if config.compressor in REFERENCES:
        meter = _Meter(reductions.spent)
        reductions.meter = meter
        for module, group in _param_groups(model):
            module.set_custom_reduce_scatter(reductions.counted(group._reduce_scatter_comm, own=True))
            if hsdp:
                module.set_all_reduce_hook(reductions.after_all_reduce)
        return meter
    import gradpress.fsdp

    state = gradpress.fsdp.register(model, config.compressor, mesh=mesh, seed=config.seed, **config.options)

    def read() -> Spent:
        total, own = state.stats()["total"], reductions.spent()
        return Spent(total["compress_s"] + total["decompress_s"], total["comm_s"] + own.comm_s,
                     total["packet_bytes"], own.intra_node)

    meter = _Meter(read)
    reductions.meter = meter
    for _, group in _param_groups(model):  # HSDP: FSDP's reduce-scatter counted, gradpress's hook timed
        group._reduce_scatter_comm = reductions.counted(group._reduce_scatter_comm, own=hsdp)
        if group._all_reduce_hook is not None:
            group._all_reduce_hook = reductions.timed(group._all_reduce_hook)
    return meter


class _Reductions:
    """The meter's view of FSDP's reductions: the bytes of the reduce-scatters and all-reduces that
    FSDP itself runs, their time, and the time inside gradpress's (added to the meter's ``in_hooks``,
    so that the step's compute leaves them out)."""

    def __init__(self, hsdp: bool) -> None:
        self.hsdp = hsdp
        self.comm_s = 0.0
        self.bytes = 0.0
        self.intra_node = 0.0
        self.since = 0.0  # when FSDP last allocated or reduce-scattered: the native all-reduce begins
        self.meter: _Meter | None = None

    def spent(self) -> Spent:
        return Spent(0.0, self.comm_s, self.bytes, self.intra_node)

    def _took(self, seconds: float, communicated: bool = True) -> None:
        """``seconds`` inside a reduction: the step's exchange; FSDP's own communication where
        ``communicated`` (gradpress's statistics time its own)."""
        if communicated:
            self.comm_s += seconds
        if self.meter is not None:
            self.meter.in_hooks += seconds

    def counted(self, inner: Any, own: bool) -> Any:
        """The reduce-scatter comm ``inner``, timed; where it is FSDP's ``own`` (not gradpress's compressed
        one), its time is communication and its bytes are counted: on a 1-D mesh its input, on an HSDP
        mesh (k−1)/k of it, sent inside the shard group."""
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        reductions = self

        class Counted(ReduceScatter):
            def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
                buffer = inner.allocate(size, dtype=dtype, device=device)
                reductions.since = time.perf_counter()
                return buffer

            def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                         async_op: bool = False) -> Any:
                began = time.perf_counter()
                work = inner(output_tensor, input_tensor, group, op, async_op)
                reductions.since = time.perf_counter()
                reductions._took(reductions.since - began, communicated=own)
                if own:
                    reductions.scattered(input_tensor, group.size())
                return work

        return Counted()

    def scattered(self, input_tensor: torch.Tensor, ranks: int) -> None:
        nbytes = input_tensor.numel() * input_tensor.element_size()
        if self.hsdp:
            self.intra_node += nbytes * (ranks - 1) / ranks
        else:
            self.bytes += nbytes

    def after_all_reduce(self, reduce_output: torch.Tensor) -> None:
        """FSDP's all-reduce hook (native HSDP: called when its all-reduce between the replicas is done):
        the shard's bytes, and the time since the reduce-scatter (or, on a shard group of one, since
        FSDP allocated the shard)."""
        self._took(time.perf_counter() - self.since)
        self.bytes += reduce_output.numel() * reduce_output.element_size()

    def timed(self, hook: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        """gradpress's all-reduce hook (HSDP), its time counted as the step's exchange."""

        def timed_hook(reduce_output: torch.Tensor) -> None:
            began = time.perf_counter()
            hook(reduce_output)
            self._took(time.perf_counter() - began, communicated=False)

        return timed_hook


def _param_groups(model: torch.nn.Module) -> list[tuple[Any, Any]]:
    """(module, FSDP parameter group) of every ``fully_shard`` module of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    return [(module, group) for module in model.modules() if isinstance(module, FSDPModule)
            for group in module._get_fsdp_state()._fsdp_param_groups]


@torch.no_grad()
def gather_parameters(model: torch.nn.Module, plain: torch.nn.Module | None) -> None:
    """Copy ``model``'s parameters (full tensors, gathered from their shards: every rank calls this,
    in the same order) and buffers into ``plain``, an unsharded model of the same structure (None on
    the ranks that do not evaluate)."""
    from torch.distributed.tensor import DTensor

    into = dict(plain.named_parameters()) if plain is not None else {}
    for name, parameter in model.named_parameters():
        full = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
        if plain is not None:
            into[name].copy_(full)
    if plain is not None:
        buffers = dict(plain.named_buffers())
        for name, buffer in model.named_buffers():
            buffers[name].copy_(buffer)
