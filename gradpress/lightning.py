"""PyTorch Lightning integration: a DDP strategy that trains through the gradpress hook.

    import lightning as L
    from gradpress.lightning import GradpressStrategy

    trainer = L.Trainer(strategy=GradpressStrategy("topk:ratio=0.01", seed=0), accelerator="cpu", devices=2)

Why a strategy of its own: Lightning's ``DDPStrategy(ddp_comm_state=…, ddp_comm_hook=…)`` registers a comm
hook only when its root device is CUDA (``DDPStrategy._register_ddp_hooks``), so on the CPU (Gloo) the
pair does nothing, and Lightning writes its checkpoint from rank 0, which holds only rank 0's
compression state. :class:`GradpressStrategy` registers the hook itself, on every device, right after
Lightning wraps the module in DistributedDataParallel (:meth:`~GradpressStrategy.configure_ddp`), and
keeps every rank's compression state (error-feedback memory, step counters, warm starts) inside
Lightning's own checkpoint file under the key ``"gradpress"``: every rank gathers its state into the
checkpoint dict when Lightning saves (:meth:`~GradpressStrategy.save_checkpoint`, which Lightning calls
on every rank and which writes from rank 0), and on resume each rank loads its own part
(:meth:`~GradpressStrategy.load_checkpoint`). Resuming from such a checkpoint continues bit for bit
as if training had not stopped. ``GradpressStrategy(spec, log_stats=True)`` logs the hook's figures
(:func:`gradpress.flat_stats`: ``gradpress/sent_bytes``, ``gradpress/compression_ratio``, …) through the
LightningModule's ``log_dict`` at every optimizer step, so the Trainer's loggers record them.

Lightning Fabric takes strategies of its own kind (``lightning.fabric.strategies``):
:class:`GradpressFabricStrategy` does the same there,

    fabric = L.Fabric(strategy=GradpressFabricStrategy("topk:ratio=0.01"), accelerator="cpu", devices=2)
    model, optimizer = fabric.setup(model, optimizer)       # the hook is registered on the DDP
    fabric.save("ckpt.pt", {"model": model, "optimizer": optimizer})   # + every rank's state, "gradpress"
    fabric.load("ckpt.pt", {"model": model, "optimizer": optimizer})   # each rank gets its own back

and ``gradpress.register(fabric_model, spec)`` hooks a module Fabric set up with its own ``"ddp"``
strategy (a checkpoint then holds ``state.state_dict(gathered=True)``, and each rank's
``state.load_state_dict`` takes its own part of it).
"""
from __future__ import annotations

import warnings
from dataclasses import fields
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from gradpress.auto import AutoOptions
from gradpress.core.compressor import Compressor
from gradpress.ddp import GradpressState, _check_options, _own_part, register
from gradpress.exchange.pipeline import Options

CHECKPOINT_KEY = "gradpress"
_OPTIONS = frozenset({*(f.name for f in (*fields(Options), *fields(AutoOptions))),  # ("auto"'s own too)
                      "on_world_size_change"})
_REFUSED = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class GradpressStrategy(DDPStrategy):
    """Lightning's DDP strategy with gradpress compressing the gradients.

    ``spec``: the compressor (``"topk:ratio=0.01"``, or a :class:`~gradpress.Compressor`). Keyword
    arguments named like gradpress's options (``feedback``, ``min_numel``, ``exclude``, ``warmup_steps``,
    ``seed``, ``timeout``, ``mode``, ``master``, ``root``, ``overflow``, ``deterministic``, ``partial``;
    see :class:`gradpress.exchange.pipeline.Options`) go to gradpress, and so does ``on_world_size_change``
    (``"reset"``: resuming a checkpoint of another world size starts error feedback afresh, see
    :class:`~gradpress.ddp.GradpressState`); ``exclude`` matches the LightningModule's
    parameter names. The others go to :class:`~lightning.pytorch.strategies.DDPStrategy` and from it to
    DistributedDataParallel (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``,
    ``process_group_backend``, ``start_method``, …); Lightning's process-group timeout is
    ``process_group_timeout`` (``timeout`` is gradpress's). The comm-hook arguments of ``DDPStrategy``
    are refused: gradpress is the hook.

    ``log_stats=True``: log this rank's figures (:func:`gradpress.flat_stats`) with the LightningModule's
    ``log_dict`` at every optimizer step (the Trainer's loggers write rank 0's, every
    ``log_every_n_steps``).

    After ``fit`` starts, :attr:`gradpress_state` is this rank's
    :class:`~gradpress.ddp.GradpressState` (``stats()``, ``error``).
    """

    def __init__(self, spec: str | Compressor, *, log_stats: bool = False, **kwargs: Any) -> None:
        options = _split_options(type(self).__name__, spec, kwargs)
        super().__init__(**kwargs)
        self._gradpress_spec = spec
        self._gradpress_options = options
        self._gradpress_log_stats = bool(log_stats)
        self.gradpress_state: GradpressState | None = None
        self._gradpress_pending: dict[str, Any] | None = None
        self._gradpress_missing = False  # a resumed checkpoint had no gradpress state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_describe(self._gradpress_spec, self._gradpress_options)})"

    # -- registration ------------------------------------------------------------------------------
    def configure_ddp(self) -> None:
        """Wrap the module in DDP (Lightning's own step; on CUDA it registers no hook: none was given)
        and register gradpress's hook on it, on every device type."""
        previous = self.gradpress_state
        super().configure_ddp()
        self.gradpress_state = register(self.model, self._gradpress_spec, **self._gradpress_options)
        if self._gradpress_pending is None and previous is not None:
            self._gradpress_pending = previous.state_dict()  # a second fit goes on from the first
        elif self._gradpress_missing:
            warnings.warn("gradpress: the checkpoint this run resumes from holds no gradpress state (written "
                          "by another strategy?): compression state (error feedback, step counters) starts "
                          "afresh", RuntimeWarning, stacklevel=2)
        self._gradpress_missing = False
        self._load_pending()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Lightning's step; with ``log_stats``, then log the hook's figures (the step's exchange is done:
        the backward pass in ``closure`` waited for it)."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._gradpress_log_stats and self.gradpress_state is not None:
            figures = self.gradpress_state.stats(flat=True)
            module = self.lightning_module
            assert module is not None  # (set while it trains)
            module.log_dict(figures, on_step=True, on_epoch=False)
        return result

    # -- checkpoints -------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Add every rank's gradpress state to ``checkpoint`` (a collective: Lightning calls this on
        every rank), then let Lightning write it from rank 0. A weights-only checkpoint (no
        ``optimizer_states``) gets none, like the optimizers' state."""
        if (self.gradpress_state is not None and "optimizer_states" in checkpoint
                and torch.distributed.is_available() and torch.distributed.is_initialized()):
            checkpoint[CHECKPOINT_KEY] = self.gradpress_state.state_dict(gathered=True)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's load (every rank reads the file); this rank's part of the gradpress state is
        loaded into the hook's state (now, or when ``fit`` registers the hook)."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.get(CHECKPOINT_KEY)
        self._gradpress_pending = state
        self._gradpress_missing = state is None and "optimizer_states" in checkpoint
        if self.gradpress_state is not None and self._gradpress_pending is not None:
            self._load_pending()
        return checkpoint

    def _load_pending(self) -> None:
        if self._gradpress_pending is None or self.gradpress_state is None:
            return
        state, self._gradpress_pending = self._gradpress_pending, None
        self.gradpress_state.load_state_dict(_own_part(self.gradpress_state, state, self.root_device))

    def teardown(self) -> None:
        self._gradpress_pending = None
        self._gradpress_missing = False
        super().teardown()


class GradpressFabricStrategy(FabricDDPStrategy):
    """Lightning Fabric's DDP strategy with gradpress compressing the gradients:
    ``L.Fabric(strategy=GradpressFabricStrategy(spec, **options), …)``.

    ``spec`` and the keyword arguments as for :class:`GradpressStrategy`: those named like gradpress's
    options go to gradpress, the others to Fabric's ``DDPStrategy`` and DDP (``find_unused_parameters``,
    ``process_group_backend``, ``start_method``, …; ``process_group_timeout`` for its ``timeout``).

    ``fabric.setup`` (``setup_module``) wraps each module in DDP and registers the hook on it;
    :attr:`gradpress_states` holds their :class:`~gradpress.ddp.GradpressState` in setup order, and
    :attr:`gradpress_state` the first's. ``fabric.save(path, state)`` (called on every rank, as Fabric
    requires) adds every rank's gradpress state to the checkpoint under ``"gradpress"`` (a collective,
    then Fabric writes from rank 0); ``fabric.load(path, state)`` with a dict of objects to restore
    gives each rank its own part back (now, or at ``setup`` if the modules are not set up yet), and
    leaves ``"gradpress"`` out of what it returns. ``fabric.load(path)`` with no state returns the
    checkpoint as written, loading nothing. Log the figures with
    ``fabric.log_dict(strategy.gradpress_state.stats(flat=True))``.
    """

    def __init__(self, spec: str | Compressor, **kwargs: Any) -> None:
        options = _split_options(type(self).__name__, spec, kwargs)
        super().__init__(**kwargs)
        self._gradpress_spec = spec
        self._gradpress_options = options
        self.gradpress_states: list[GradpressState] = []
        self._gradpress_pending: list[dict[str, Any]] | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({_describe(self._gradpress_spec, self._gradpress_options)})"

    @property
    def gradpress_state(self) -> GradpressState | None:
        """The first module's :class:`~gradpress.ddp.GradpressState` (None before ``setup``)."""
        return self.gradpress_states[0] if self.gradpress_states else None

    def setup_module(self, module: torch.nn.Module) -> DistributedDataParallel:
        """Wrap ``module`` in DDP (Fabric's own step) and register gradpress's hook on it."""
        ddp = super().setup_module(module)
        self.gradpress_states.append(register(ddp, self._gradpress_spec, **self._gradpress_options))
        self._load_pending()
        return ddp

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Any] | None = None) -> None:
        """Add every rank's gradpress state to ``state`` under ``"gradpress"`` (a collective: every rank
        calls ``fabric.save``), then let Fabric write the checkpoint from rank 0."""
        if self.gradpress_states:
            if CHECKPOINT_KEY in state:
                raise ValueError(f"GradpressFabricStrategy saves the gradpress state under "
                                 f"{CHECKPOINT_KEY!r} itself; the state given to fabric.save has that key")
            gathered = [s.state_dict(gathered=True) for s in self.gradpress_states]
            state = {**state, CHECKPOINT_KEY: gathered}
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Fabric's load; with a dict of objects to restore, this rank's part of the gradpress state is
        loaded too (now, or when ``setup`` registers the hooks)."""
        remainder = super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        if not isinstance(state, dict) or not state:
            return remainder  # the checkpoint as written (no state), or a module's / optimizer's alone
        saved = remainder.pop(CHECKPOINT_KEY, None)
        if saved is None:
            if self.gradpress_states:
                warnings.warn("gradpress: the checkpoint loaded holds no gradpress state (written by another "
                              "strategy?): compression state (error feedback, step counters) starts afresh",
                              RuntimeWarning, stacklevel=2)
            return remainder
        if not isinstance(saved, list):
            raise ValueError(f"gradpress: the checkpoint's {CHECKPOINT_KEY!r} is not what "
                             f"GradpressFabricStrategy writes (a list of gathered states, one per module)")
        self._gradpress_pending = saved
        self._load_pending()
        return remainder

    def _load_pending(self) -> None:
        """Load the pending states into the hooks registered so far, in setup order; what is left waits
        for the next ``setup``."""
        pending = self._gradpress_pending
        if pending is None or not self.gradpress_states:
            return
        if len(pending) < len(self.gradpress_states):
            raise ValueError(f"gradpress: the checkpoint holds the state of {len(pending)} module(s), "
                             f"{len(self.gradpress_states)} are set up")
        for state, saved in zip(self.gradpress_states, pending, strict=False):  # (checked: not fewer)
            state.load_state_dict(_own_part(state, saved, self.root_device))
        done = len(self.gradpress_states)
        self._gradpress_pending = pending[done:] if len(pending) > done else None


def _split_options(strategy: str, spec: str | Compressor, kwargs: dict[str, Any]) -> dict[str, Any]:
    """gradpress's options, taken out of ``kwargs`` (a strategy's keyword arguments) and checked; the
    rest stay for the strategy (``process_group_timeout`` becomes its ``timeout``)."""
    refused = [name for name in _REFUSED if name in kwargs]
    if refused:
        raise TypeError(f"{strategy} registers the gradpress hook itself; {', '.join(refused)} "
                        "cannot be combined with it")
    options = {name: kwargs.pop(name) for name in list(kwargs) if name in _OPTIONS}
    if "process_group_timeout" in kwargs:
        value = kwargs.pop("process_group_timeout")
        kwargs["timeout"] = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
    _check_options(spec, options)  # a bad spec or option raises here, not in the workers
    return options


def _describe(spec: str | Compressor, options: dict[str, Any]) -> str:
    shown = spec if isinstance(spec, str) else spec.spec
    return ", ".join([repr(shown), *(f"{name}={value!r}" for name, value in options.items())])
