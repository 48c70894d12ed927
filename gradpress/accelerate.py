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

import os
import warnings
from typing import Any

import torch

from gradpress.core.compressor import Compressor
from gradpress.ddp import GradpressState, _own_part, _unwrap_ddp
from gradpress.ddp import register as register_ddp

# where launchers put the number of processes they started (torchrun, MPI); Accelerate reads the same
_WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")


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
    return _unwrap_ddp(model)


def launched_processes() -> int:
    """How many processes the launcher says it started (``WORLD_SIZE`` under ``torchrun`` and
    ``accelerate launch``, the MPI variables under ``mpirun``); 1 when none says."""
    for name in _WORLD_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.strip().isdigit():
            return int(value)
    return 1


def register(accelerator: Any, model: Any, spec: str | Compressor, **options: Any) -> GradpressState | None:
    """Register the gradpress hook on ``model`` (as ``accelerator.prepare`` returned it: a
    DistributedDataParallel when several processes run) and register its state for
    ``accelerator.save_state``/``load_state`` (call this before ``load_state``, in the same order
    relative to other ``register_for_checkpointing`` calls as when the checkpoint was saved).
    Options: those of :func:`gradpress.register`. Returns the :class:`~gradpress.ddp.GradpressState`
    (``stats()``, ``error``); None when one process was started alone, where there is nothing to
    exchange (it warns).

    A launcher that started several processes while Accelerate runs each alone (``torchrun`` on a
    machine without GPUs and an ``Accelerator()`` without ``cpu=True``: Accelerate then sets up no
    process group, and every process would train a model of its own) raises ``RuntimeError`` saying
    how to have Accelerate set up distributed training.
    """
    ddp = distributed_model(model)
    if ddp is None:
        if accelerator.num_processes > 1:
            raise TypeError(f"gradpress.accelerate.register: expected the DistributedDataParallel that "
                            f"accelerator.prepare() returns, got {type(model).__name__} (gradpress hooks "
                            f"DDP, not FSDP, DeepSpeed or Megatron-LM; pass the prepared model)")
        launched = launched_processes()
        if launched > 1:
            raise RuntimeError(
                f"gradpress.accelerate.register: the launcher started {launched} processes, but Accelerate "
                f"did not set up distributed training (distributed_type "
                f"{getattr(accelerator, 'distributed_type', 'NO')}, num_processes 1): each process would "
                f"train a model of its own and no gradients would be averaged. On the CPU Accelerate sets "
                f"up several processes only when told to use it: Accelerator(cpu=True), or "
                f"ACCELERATE_USE_CPU=1 in the environment (ACCELERATE_USE_CPU=1 accelerate launch "
                f"--multi_gpu --num_processes {launched} train.py, or torchrun with that variable set); "
                f"on GPUs, check that this process sees a GPU")
        warnings.warn("gradpress: a single process (the launcher started no others), no gradients to "
                      "exchange: the hook is not registered (to start 2 CPU processes: ACCELERATE_USE_CPU=1 "
                      "accelerate launch --multi_gpu --num_processes 2 train.py, or torchrun "
                      "--nproc-per-node 2 train.py with Accelerator(cpu=True))", RuntimeWarning, stacklevel=2)
        return None
    state = register_ddp(ddp, spec, **options)
    accelerator.register_for_checkpointing(Checkpointed(state, accelerator.device))
    return state
