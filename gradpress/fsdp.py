"""Sharded models (FSDP2's ``fully_shard``, HSDP on a 2-D mesh): compressed gradient reduction.

``state = gradpress.fsdp.register(model, spec, mesh=mesh)`` on a model whose submodules and root were
wrapped with ``torch.distributed.fsdp.fully_shard``. FSDP reduces each module's gradients in one flat
buffer (its parameter group): it reduce-scatters the buffer over the shard group, each rank keeping
the averaged shard of every parameter, and on a 2-D ("replicate", "shard") mesh (HSDP) all-reduces
that shard over the replicate group. gradpress takes one of these places, with one pipeline
(:class:`gradpress.exchange.pipeline.Pipeline`: feedback, compression, strategy) for the whole model:

* HSDP: the reduce-scatter inside the shard group stays FSDP's; the average of each shard over the
  replicas is gradpress's compressed exchange on the replicate group, in place of FSDP's all-reduce
  (any method and mode; keys: the parameter names, each key one rank's shard of that parameter, so
  error feedback is kept per shard). gradpress turns FSDP's own all-reduce off for the model's
  parameter groups and receives each shard from ``FSDPModule.set_all_reduce_hook``, which FSDP then
  calls with the reduce-scatter's output, before it divides and hands the shards to the parameters.
* 1-D mesh: the reduce-scatter itself is compressed (``FSDPModule.set_custom_reduce_scatter``): each rank
  compresses the n rows of its flat buffer (row j: its part of rank j's shard), the rows' summands are
  reduce-scattered and each rank decodes its own row
  (:meth:`gradpress.exchange.pipeline.Pipeline.scatter_groups`). The summands must add element-wise
  over the ranks: a :attr:`~gradpress.core.compressor.Compressor.summable` method whose decode keeps no
  state every rank must share (not PowerSGD's warm starts, which only the row's owner would update);
  other methods raise ``ValueError`` naming the ones that can. Keys: ``"<parameter>[j]"``, this rank's
  contribution to rank j's shard; ``exclude`` matches the parameter names.

The exchange runs where FSDP calls it, to its end (FSDP reads the result when the call returns), one
parameter group after another in backward order, the same on every rank. Gradient accumulation with
``model.set_requires_gradient_sync(False)`` skips FSDP's reduction, and gradpress with it: only the
synchronized step is compressed. A NaN/Inf gradient on one rank raises :class:`~gradpress.NonFiniteError`
on every rank at the same parameter group (HSDP: a rank whose reduce-scatter input holds NaN/Inf
sends NaN in its whole buffer, so that every shard of its shard group, and through gradpress's flag
every replica of those shards, sees it). Tested on the CPU with Gloo.

Checkpoints: :meth:`FSDPState.state_dict` is this rank's state as one entry ``"rank<r>"`` (the global
rank), so that ``torch.distributed.checkpoint`` saves every rank's own entry (pass the state itself:
DCP calls ``state_dict``/``load_state_dict``, as for any ``Stateful``); resume on the same mesh.
"""
from __future__ import annotations

import io
import math
from typing import Any, Sequence

import torch

from gradpress import warmup
from gradpress.core.compressor import Compressor, NonFiniteError, any_nonfinite, compressor_names, make
from gradpress.exchange.distributed import ProcessGroupExecutor
from gradpress.exchange.distributed import process_group as resolve_group
from gradpress.exchange.driver import Driver
from gradpress.exchange.pipeline import Options, Pipeline, build, describe, flat_stats


def scatter_methods() -> list[str]:
    """The registered methods a compressed reduce-scatter (a 1-D mesh) can run: summable, with a decode
    that keeps no state shared by the ranks."""
    return [name for name in compressor_names() if _scatters(make(name))]


def _scatters(compressor: Compressor) -> bool:
    return compressor.summable and not compressor.stateful_decode


class FSDPState:
    """What :func:`register` returns: the pipeline reducing a sharded model's gradients, its statistics
    (:meth:`stats`), its failure (:attr:`error`) and its state (:meth:`state_dict`, per rank)."""

    def __init__(self, model: torch.nn.Module, spec: str | Compressor, mesh: Any = None,
                 **options: Any) -> None:
        if isinstance(spec, str) and spec.strip() == "auto":
            raise ValueError("gradpress.fsdp does not run 'auto': name a method")
        self.options = Options.of(**options)
        self.compressor = build(spec)
        self.spec = self.compressor.spec
        groups = _param_groups(model)
        info = _mesh_info(groups, mesh)
        self.hsdp = _is_hsdp(info)
        if not self.hsdp:
            if not _scatters(self.compressor):
                raise ValueError(
                    f"gradpress.fsdp on a 1-D mesh compresses FSDP's reduce-scatter, whose summands must add "
                    f"element-wise over the ranks; {self.spec} cannot (methods that can: "
                    f"{', '.join(scatter_methods())}). On a 2-D ('replicate', 'shard') mesh (HSDP) any "
                    "method compresses the exchange between the replicas")
            if self.options.mode != "collective":
                raise ValueError(f"gradpress.fsdp on a 1-D mesh reduce-scatters in mode 'collective', not "
                                 f"{self.options.mode!r} (the ps and switch modes run on an HSDP mesh)")
        group = info.replicate_process_group if self.hsdp else info.shard_process_group
        self._group = group
        warmup.for_training(self.compressor, self.options, model=model, group=group)  # before any collective
        executor = ProcessGroupExecutor(resolve_group(group, self.options.timeout), group)
        master = build(self.options.master) if self.options.master is not None else None
        self.pipeline = Pipeline(self.compressor, self.options, executor.rank, executor.world_size, master)
        self._driver = Driver(executor, self.pipeline.stats)
        self._global = [_global_rank(group, r) for r in range(executor.world_size)]
        self._device = torch.device(info.mesh.device_type)
        import torch.distributed as dist

        self._entry = f"rank{dist.get_rank()}"
        for _, group_ in groups:
            _check_unhooked(group_)
        for module, group_ in groups:
            reducer = _Reducer(self, group_)
            if self.hsdp:
                _stop_native_all_reduce(group_)
                module.set_all_reduce_hook(reducer.all_reduce_hook)
                module.set_custom_reduce_scatter(_checked_reduce_scatter())
            else:
                module.set_custom_reduce_scatter(_compressed_reduce_scatter(reducer))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({describe(self.spec, self.options)}, hsdp={self.hsdp})"

    # -- the exchanges (synchronous: FSDP reads the result when its call returns) -------------------------
    def _reduce(self, items: list[tuple[str, torch.Tensor]], bucket: torch.Tensor) -> None:
        """Average ``items`` (views of ``bucket``) over the group, in place."""
        driver, pipeline = self._driver, self.pipeline
        driver.check()
        agreement = pipeline.agreement(items)
        if agreement is not None:  # the first time these shards are exchanged
            driver.run(agreement.protocol, agreement.step, control=True)
        groups = pipeline.groups(items, bucket=bucket)
        started = [driver.start(g.protocol, g.step) for g in groups]
        driver.advance()
        for g, future in zip(groups, started, strict=True):
            outputs = [g.flat] if g.flat is not None else [items[i][1] for i in g.members]
            for output, average in zip(outputs, self._wait(future), strict=True):
                if average.data_ptr() != output.data_ptr() or average.dtype != output.dtype:
                    output.copy_(average.view(output.shape))

    def _scatter(self, rows: list[list[tuple[str, torch.Tensor]]], names: list[str]) -> list[torch.Tensor]:
        """The averages of this rank's row (see :meth:`Pipeline.scatter_groups`)."""
        driver, pipeline = self._driver, self.pipeline
        driver.check()
        agreement = pipeline.agreement([item for row in rows for item in row])
        if agreement is not None:
            driver.run(agreement.protocol, agreement.step, control=True)
        groups = pipeline.scatter_groups(rows, names)
        started = [driver.start(g.protocol, g.step) for g in groups]
        driver.advance()
        out: list[torch.Tensor] = [None] * len(names)  # type: ignore[list-item]
        for g, future in zip(groups, started, strict=True):
            for i, average in zip(g.members, self._wait(future), strict=True):
                out[i] = average
        return out

    def _wait(self, future: torch.futures.Future) -> Any:
        try:
            return self._driver.wait(future)
        except NonFiniteError as error:
            raise self._named(error) from None

    def _named(self, error: NonFiniteError) -> NonFiniteError:
        """``error`` with the group's ranks as global ranks (HSDP: the replicas whose shard held NaN/Inf)."""
        ranks = [self._global[r] for r in (error.ranks or [])]
        which = ", ".join(str(r) for r in ranks)
        if self.hsdp:
            text = (f"gradpress.fsdp: {error} of the replicate group; the reduce-scattered shard of global "
                    f"rank(s) {which} held NaN/Inf (a NaN/Inf gradient of any rank of their shard groups)")
        else:
            text = f"gradpress.fsdp: {error} of the shard group (global rank(s) {which})"
        named = NonFiniteError(text)
        named.ranks = ranks
        return named

    # -- state and statistics -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (feedback memory per key, step counters, the compressor's own state,
        statistics) as ``{"rank<r>": bytes}``, r the global rank: an entry of its own for
        ``torch.distributed.checkpoint`` (which keeps one copy of entries of the same name), saved
        as it is and restored bit for bit."""
        buffer = io.BytesIO()
        torch.save(_on_cpu(self.pipeline.state_dict()), buffer)
        return {self._entry: buffer.getvalue()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's entry of :meth:`state_dict` (before the next exchange; checked at once: an
        entry of another rank, method or world raises ``ValueError``, as
        :meth:`gradpress.exchange.pipeline.Pipeline.load_state_dict` says)."""
        if not isinstance(state, dict) or self._entry not in state:
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"gradpress.fsdp: the state holds no entry {self._entry!r} for this rank "
                             f"(found {found}); resume on the mesh it was saved on")
        value = state[self._entry]
        if isinstance(value, (bytes, bytearray)):
            value = torch.load(io.BytesIO(value), map_location=self._device, weights_only=True)
        self.pipeline.load_state_dict(value)

    @property
    def error(self) -> BaseException | None:
        """The exchange failure that stopped gradpress (raised on every rank where it happened), or None."""
        return self._driver.failure

    def stats(self, flat: bool = False) -> dict[str, Any]:
        """This rank's per-step and cumulative bytes and times
        (:class:`gradpress.exchange.pipeline.Stats`); ``flat=True``: one flat dict for a metrics logger."""
        report = self.pipeline.report()
        return flat_stats(report) if flat else report


class _Reducer:
    """One FSDP parameter group's side: the layout of its flat buffer, and the calls FSDP makes."""

    def __init__(self, state: FSDPState, group: Any) -> None:
        self.state, self.group = state, group
        self.partial: torch.Tensor | None = None  # HSDP: shards kept while set_requires_all_reduce(False)

    def layout(self, numel: int) -> list[tuple[str, int, int, torch.Size]]:
        """(name, offset, numel, padded shard shape) of each parameter in a buffer of ``numel`` per rank:
        FSDP reduces the parameters that have a gradient, in their order, each padded to equal shards."""
        params = list(self.group.fsdp_params)
        chosen = [p for p in params if p.sharded_param.requires_grad]
        if sum(p.padded_sharded_param_size.numel() for p in chosen) != numel:
            chosen = params
        if sum(p.padded_sharded_param_size.numel() for p in chosen) != numel:
            names = ", ".join(repr(p._param_fqn) for p in params)
            raise ValueError(f"gradpress.fsdp: FSDP reduces {numel} values per rank for the parameters "
                             f"{names}, not all of those that require a gradient: one of them got none this "
                             "step. gradpress needs them all on every rank "
                             "(model.set_reduce_scatter_unused_params(True))")
        out, offset = [], 0
        for p in chosen:
            size = p.padded_sharded_param_size
            out.append((p._param_fqn, offset, size.numel(), size))
            offset += size.numel()
        return out

    def all_reduce_hook(self, reduce_output: torch.Tensor) -> None:
        """HSDP: average this group's shard over the replicas, in place (FSDP's all-reduce hook)."""
        if not self.group.all_reduce_grads:  # set_requires_all_reduce(False): FSDP's own accumulation
            self.partial = reduce_output.clone() if self.partial is None else self.partial.add_(reduce_output)
            reduce_output.zero_()
            return
        if self.partial is not None:
            reduce_output += self.partial
            self.partial = None
        flat = reduce_output.view(-1)
        items = [(name, flat[offset:offset + numel].view(shape))
                 for name, offset, numel, shape in self.layout(flat.numel())]
        self.state._reduce(items, flat)
        factor = self.group.gradient_divide_factor
        if factor is not None:  # FSDP's all-reduce would sum over the replicas (set_gradient_divide_factor)
            reduce_output.mul_(self.state.pipeline.world_size)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: Any) -> None:
        """1-D: the compressed reduce-scatter of this group's buffer into ``output``."""
        import torch.distributed as dist

        n = self.state.pipeline.world_size
        rows = input.view(n, -1)
        layout = self.layout(rows.shape[1])
        names = [name for name, *_ in layout]
        items = [[(f"{name}[{j}]", rows[j, offset:offset + numel].view(shape))
                  for name, offset, numel, shape in layout] for j in range(n)]
        averages = self.state._scatter(items, names)
        out = output.view(-1)
        for (_, offset, numel, _), average in zip(layout, averages, strict=True):
            out[offset:offset + numel].copy_(average.reshape(-1))
        if op == dist.ReduceOp.AVG:
            return
        if op == dist.ReduceOp.SUM:  # (a reduce dtype FSDP divides itself, before and after)
            out.mul_(n)
        elif self.group.gradient_divide_factor is not None:  # a pre-multiplied sum: sum / factor
            out.mul_(n / self.group.gradient_divide_factor)
        else:
            raise ValueError(f"gradpress.fsdp: FSDP asked for a reduce-scatter with {op}, which gradpress "
                             "does not know")


def _reduce_scatter_base() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


class _Allocating:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


def _compressed_reduce_scatter(reducer: _Reducer) -> Any:
    """FSDP's ``ReduceScatter`` comm running :meth:`_Reducer.reduce_scatter` (1-D meshes; the class is made
    here, so that importing gradpress does not import FSDP)."""

    base: Any = _reduce_scatter_base()

    class CompressedReduceScatter(_Allocating, base):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> None:
            reducer.reduce_scatter(output_tensor, input_tensor, op)

    return CompressedReduceScatter()


def _checked_reduce_scatter() -> Any:
    """FSDP's reduce-scatter (HSDP), made to carry a rank's NaN/Inf gradient into every shard: the rank
    sends NaN in its whole buffer, so that every replicate group's exchange sees a faulty shard and
    every rank raises at the same parameter group (one pass over the buffer, the check)."""
    import torch.distributed as dist

    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # (FSDP's call)

    base: Any = _reduce_scatter_base()

    class CheckedReduceScatter(_Allocating, base):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            if any_nonfinite(input_tensor.view(-1)):
                input_tensor.fill_(math.nan)
            return scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return CheckedReduceScatter()


# -- FSDP's parameter groups --------------------------------------------------------------------------
def _param_groups(model: Any) -> list[tuple[Any, Any]]:
    """(module, parameter group) of every ``fully_shard`` module of ``model``."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError as error:  # (torch without distributed support)
        raise TypeError("gradpress.fsdp needs torch.distributed's FSDP") from error
    root: torch.nn.Module = model  # (fully_shard makes it an FSDPModule too)
    if isinstance(model, FullyShardedDataParallel):
        raise TypeError("gradpress.fsdp.register takes a model sharded with fully_shard (FSDP2), not "
                        "FullyShardedDataParallel (FSDP1)")
    if not isinstance(model, FSDPModule):
        raise TypeError(f"gradpress.fsdp.register: expected a model wrapped with "
                        f"torch.distributed.fsdp.fully_shard, got {type(model).__name__}")
    out: list[tuple[Any, Any]] = []
    for module in root.modules():
        if isinstance(module, FSDPModule):
            groups = module._get_fsdp_state()._fsdp_param_groups
            if len(groups) > 1:
                raise ValueError("gradpress.fsdp: a module with several parameter groups (per-parameter "
                                 "meshes from shard_placement_fn) is not supported")
            out.extend((module, group) for group in groups)
    if not out:
        raise ValueError("gradpress.fsdp: the model has no parameters sharded by fully_shard")
    return out


def _mesh_info(groups: list[tuple[Any, Any]], mesh: Any) -> Any:
    infos = [group.mesh_info for _, group in groups]
    first = infos[0]
    if any(info.mesh != first.mesh for info in infos[1:]):
        raise ValueError("gradpress.fsdp: the model's modules are sharded on different meshes")
    if mesh is not None and mesh != first.mesh:
        raise ValueError(f"gradpress.fsdp: mesh {mesh} is not the mesh the model was sharded on "
                         f"({first.mesh})")
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    if not isinstance(first, FSDPMeshInfo):
        raise TypeError("gradpress.fsdp: the model is replicated, not sharded: use gradpress.register on DDP")
    return first


def _is_hsdp(info: Any) -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    return isinstance(info, HSDPMeshInfo)


def _check_unhooked(group: Any) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    if group._all_reduce_hook is not None or type(group._reduce_scatter_comm) is not DefaultReduceScatter:
        raise ValueError(f"gradpress.fsdp: the parameter group of {group._module_fqn or 'the root'!r} has a "
                         "custom reduce-scatter or all-reduce hook already (registered twice?)")


def _stop_native_all_reduce(group: Any) -> None:
    """Make FSDP skip its all-reduce over the replicas for ``group`` (HSDP), so that its all-reduce hook
    receives the reduce-scatter's output: FSDP all-reduces where the group's mesh information is a
    replicated one, so the group gets the same information as a sharded-only one (the same mesh, shard
    group and dimensions); the parameters keep their own, and their (Replicate, Shard) placements."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    old = group.mesh_info
    new = FSDPMeshInfo(mesh=old.mesh, shard_mesh_dim=old.shard_mesh_dim,
                       replicate_mesh_dim=old.replicate_mesh_dim, dp_mesh_dims=old.dp_mesh_dims,
                       spmd_mesh=old.spmd_mesh)
    new.reduce_scatter_process_group = old.reduce_scatter_process_group
    if group.post_forward_mesh_info is old:
        group.post_forward_mesh_info = new
    group.mesh_info = new


def _global_rank(group: Any, rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def register(model: torch.nn.Module, spec: str | Compressor, *, mesh: Any = None,
             **options: Any) -> FSDPState:
    """Compress the gradient reduction of ``model``, wrapped with ``fully_shard`` (its submodules and
    its root), and return the state (``stats()``, ``error``, ``state_dict()``). See the module docstring.

    ``mesh``: the ``DeviceMesh`` the model was sharded on (checked; default: the model's). On a 2-D
    ("replicate", "shard") mesh (HSDP) gradpress averages each shard over the replicas in place of
    FSDP's all-reduce, with any method; on a 1-D mesh it compresses the reduce-scatter, with a summable
    method (:func:`scatter_methods`; others raise ``ValueError``).

    Options: those of :func:`gradpress.register` (:class:`gradpress.exchange.pipeline.Options`), but
    ``"auto"``; on a 1-D mesh ``mode`` is ``"collective"``. Keys (what ``exclude`` matches): the
    parameter names. Register before the first forward pass, once.
    """
    return FSDPState(model, spec, mesh, **options)
