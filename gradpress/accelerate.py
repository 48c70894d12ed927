"""Hugging Face Accelerate integration: the gradpress hook on the prepared model, checkpointed with it.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = gradpress.accelerate.register(accelerator, model, "topk:ratio=0.01", seed=0)
    ...
    accelerator.save_state("checkpoint")      # every rank's compression state, in Accelerate's folder
    accelerator.load_state("checkpoint")      # each rank gets its own back

Why not Accelerate's own switches: ``DistributedDataParallelKwargs(comm_hook=…)`` looks the hook up in
its enum of PyTorch's built-in hooks, so a gradpress hook passed there registers nothing; and
``register_for_checkpointing(obj)`` saves ``obj.state_dict()`` once, from the main process, so a
per-rank state saved that way comes back as rank 0's on every rank. :func:`register` registers the hook
on the DistributedDataParallel that ``prepare`` made and registers for checkpointing an object whose
``state_dict()`` gathers every rank's state (Accelerate calls it on every rank in ``save_state``) and
whose ``load_state_dict()`` takes this rank's part (every rank calls it in ``load_state``).

Launching 2 processes on the CPU: ``accelerate launch --cpu --num_processes 2`` starts *one* process
(with ``--cpu`` Accelerate's launcher runs the script once unless an MPI hostfile is given). What
starts 2 Gloo processes is Accelerate's multi-process launcher with the CPU forced through the
environment, ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 train.py``, or
``torchrun --nproc-per-node 2 train.py`` with ``Accelerator(cpu=True)`` (or that variable set). On GPUs:
``accelerate launch --multi_gpu --num_processes 2 train.py`` (NCCL).
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from gradpress.core.compressor import Compressor
from gradpress.ddp import GradpressState, _is_ddp, _own_part, register as register_ddp


class Checkpointed:
    """What :func:`register` hands to ``accelerator.register_for_checkpointing``: ``state_dict()``
    is every rank's gradpress state (a collective; Accelerate calls it on every rank and writes the
    result from the main process), ``load_state_dict()`` loads this rank's part onto ``device``."""

    def __init__(self, state: GradpressState, device: torch.device | str) -> None:
        self.state = state
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict(gathered=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(_own_part(self.state, state, self.device))


def distributed_model(model: Any) -> Any:
    """The DistributedDataParallel inside what ``accelerator.prepare`` returned (itself, or under
    ``torch.compile``'s wrapper), or None."""
    for _ in range(4):
        if _is_ddp(model):
            return model
        model = getattr(model, "_orig_mod", None)
        if model is None:
            return None
    return None


def register(accelerator: Any, model: Any, spec: str | Compressor, **options: Any) -> GradpressState | None:
    """Register the gradpress hook on ``model`` (as ``accelerator.prepare`` returned it: a
    DistributedDataParallel when several processes run) and register its state for
    ``accelerator.save_state``/``load_state`` (call this before ``load_state``, in the same order
    relative to other ``register_for_checkpointing`` calls as when the checkpoint was saved).
    Options: those of :func:`gradpress.register`. Returns the :class:`~gradpress.ddp.GradpressState`
    (``stats()``, ``error``); None in a single process, where there is nothing to exchange (it warns).
    """
    ddp = distributed_model(model)
    if ddp is None:
        if accelerator.num_processes > 1:
            raise TypeError(f"gradpress.accelerate.register: expected the DistributedDataParallel that "
                            f"accelerator.prepare() returns, got {type(model).__name__} (gradpress hooks "
                            f"DDP, not FSDP, DeepSpeed or Megatron-LM; pass the prepared model)")
        warnings.warn("gradpress: a single process, no gradients to exchange: the hook is not registered "
                      "(to start 2 CPU processes: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
                      "--num_processes 2 train.py)", RuntimeWarning, stacklevel=2)
        return None
    state = register_ddp(ddp, spec, **options)
    accelerator.register_for_checkpointing(Checkpointed(state, accelerator.device))
    return state
