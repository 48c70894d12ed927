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
as if training had not stopped.
"""
from __future__ import annotations

import warnings
from dataclasses import fields
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import DDPStrategy

from gradpress.auto import AutoOptions
from gradpress.compressor import Compressor
from gradpress.ddp import GradpressState, _own_part, register
from gradpress.runtime import Options

CHECKPOINT_KEY = "gradpress"
_OPTIONS = frozenset({*(f.name for f in (*fields(Options), *fields(AutoOptions))),  # ("auto"'s own too)
                      "on_world_size_change"})
_REFUSED = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class GradpressStrategy(DDPStrategy):
    """Lightning's DDP strategy with gradpress compressing the gradients.

    ``spec``: the compressor (``"topk:ratio=0.01"``, or a :class:`~gradpress.Compressor`). Keyword
    arguments named like gradpress's options (``feedback``, ``min_numel``, ``exclude``, ``warmup_steps``,
    ``seed``, ``timeout``, ``mode``, ``master``, ``root``, ``overflow``, ``deterministic``, ``partial``;
    see :class:`gradpress.runtime.Options`) go to gradpress, and so does ``on_world_size_change``
    (``"reset"``: resuming a checkpoint of another world size starts error feedback afresh, see
    :class:`~gradpress.ddp.GradpressState`); ``exclude`` matches the LightningModule's
    parameter names. The others go to :class:`~lightning.pytorch.strategies.DDPStrategy` and from it to
    DistributedDataParallel (``find_unused_parameters``, ``static_graph``, ``bucket_cap_mb``,
    ``process_group_backend``, ``start_method``, …); Lightning's process-group timeout is
    ``process_group_timeout`` (``timeout`` is gradpress's). The comm-hook arguments of ``DDPStrategy``
    are refused: gradpress is the hook.

    After ``fit`` starts, :attr:`gradpress_state` is this rank's
    :class:`~gradpress.ddp.GradpressState` (``stats()``, ``error``).
    """

    def __init__(self, spec: str | Compressor, **kwargs: Any) -> None:
        refused = [name for name in _REFUSED if name in kwargs]
        if refused:
            raise TypeError(f"GradpressStrategy registers the gradpress hook itself; {', '.join(refused)} "
                            "cannot be combined with it")
        options = {name: kwargs.pop(name) for name in list(kwargs) if name in _OPTIONS}
        if "process_group_timeout" in kwargs:
            value = kwargs.pop("process_group_timeout")
            kwargs["timeout"] = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
        GradpressState(spec, **options)  # a bad spec or option raises here, not in the workers
        super().__init__(**kwargs)
        self._gradpress_spec = spec
        self._gradpress_options = options
        self.gradpress_state: GradpressState | None = None
        self._gradpress_pending: dict[str, Any] | None = None
        self._gradpress_missing = False  # a resumed checkpoint had no gradpress state

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
