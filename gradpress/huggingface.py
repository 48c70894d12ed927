"""Hugging Face Transformers integration: a ``Trainer`` callback that trains through the gradpress hook.

    from transformers import Trainer
    from gradpress.huggingface import GradpressCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[GradpressCallback("topk:ratio=0.01", seed=0)])
    trainer.train()                                  # trainer.train(resume_from_checkpoint=True) resumes

What it does, and why a callback must do it this way: ``Trainer`` wraps the model in
DistributedDataParallel through Accelerate inside ``train()``, after the callbacks' ``on_init_end`` and
before ``on_train_begin``, and a callback is handed the unwrapped model only. At ``on_train_begin``
:class:`GradpressCallback` finds the ``Trainer`` calling it (on the call stack: a callback is handed
neither its Trainer nor the checkpoint ``train()`` resumes from) and registers the gradpress hook on
``trainer.model_wrapped``, the DDP, before the first step. Checkpoints: ``Trainer`` writes its own
from the main process, with each rank's random state in a file of its own (``rng_state_<rank>.pth``);
at ``on_save`` every rank likewise writes its compression state (error-feedback memory, step counters,
warm starts) into the same checkpoint folder as ``gradpress_rank<rank>.pt``, and
``train(resume_from_checkpoint=…)`` gives each rank its own back before the first step. A resumed run
then continues bit for bit as the uninterrupted one, as far as the Trainer's own resume does.
``save_only_model=True`` checkpoints, which hold no optimizer state, hold no gradpress state either.

``log_stats=True`` adds the hook's figures (:func:`gradpress.flat_stats`: ``gradpress/sent_bytes``,
``gradpress/compression_ratio``, ``gradpress/compress_ms``, …) to the Trainer's logs at its logging
steps (``logging_steps``), so its TensorBoard / Weights & Biases reporting shows them.
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from types import FrameType
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from gradpress.core.compressor import Compressor
from gradpress.ddp import GradpressState, _check_options, _moved, _own_part, _unwrap_ddp, register

CHECKPOINT_FILE = "gradpress_rank{rank}.pt"


class GradpressCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that compresses the Trainer's gradient exchange with ``spec``
    (``"topk:ratio=0.01"``, ``"auto"``, or a :class:`~gradpress.Compressor`) and keeps every rank's
    compression state in the Trainer's checkpoints.

    Options: those of :func:`gradpress.register` (``feedback``, ``min_numel``, ``exclude`` — matching
    the model's parameter names —, ``warmup_steps``, ``seed``, ``timeout``, ``mode``, ``master``,
    ``root``, ``overflow``, ``partial``, ``deterministic``; with ``"auto"`` also ``candidates``,
    ``measure_with``, ``settle_steps``, ``measure_steps``, ``recheck_every``, ``margin``), checked here. ``log_stats``:
    add :func:`gradpress.flat_stats` of this rank's figures to the Trainer's logs at its logging steps.

    After ``train()`` starts, :attr:`state` is this rank's :class:`~gradpress.ddp.GradpressState`
    (``stats()``, ``error``); it stays None in a single process, where there is nothing to exchange.
    """

    def __init__(self, spec: str | Compressor, *, log_stats: bool = False, **options: Any) -> None:
        _check_options(spec, options)  # a bad spec or option raises here, not in the workers
        self.spec = spec
        self.options = options
        self.log_stats = bool(log_stats)
        self.state: GradpressState | None = None
        self._ddp: Any = None  # a weak reference to the DDP the hook is registered on
        self._trainer: Any = None  # a weak reference to the Trainer calling this callback

    def __repr__(self) -> str:
        shown = [repr(self.spec if isinstance(self.spec, str) else self.spec.spec)]
        shown += [f"{name}={value!r}" for name, value in self.options.items()]
        return f"{type(self).__name__}({', '.join(shown + (['log_stats=True'] if self.log_stats else []))})"

    # -- the Trainer's events ------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Register the hook on the DDP the Trainer made, and load this rank's state from the checkpoint
        ``train()`` resumes from."""
        trainer = _calling_trainer(self)
        self._trainer = weakref.ref(trainer)
        ddp = _unwrap_ddp(trainer.model_wrapped)
        if ddp is None:
            if args.world_size > 1:
                raise TypeError(f"GradpressCallback: the Trainer trains a "
                                f"{type(trainer.model_wrapped).__name__}, not a DistributedDataParallel "
                                f"(gradpress hooks DDP, not FSDP or DeepSpeed)")
            warnings.warn("gradpress: a single process, no gradients to exchange: the hook is not registered "
                          "(start several with torchrun --nproc-per-node 2 train.py; on the CPU with "
                          "TrainingArguments(use_cpu=True))", RuntimeWarning, stacklevel=2)
            return
        carried = None
        if self._ddp is None or self._ddp() is not ddp:  # a new DDP (a later train() may wrap anew)
            previous = self.state
            self.state = register(ddp, self.spec, **self.options)
            self._ddp = weakref.ref(ddp)
            carried = previous.state_dict() if previous is not None else None
        resumed = _resumed_from(trainer, args, state)
        if resumed is not None:
            self._load(resumed, args.process_index, ddp)
        elif carried is not None:  # a second train() goes on from the first
            assert self.state is not None  # (registered with the new DDP above)
            self.state.load_state_dict(carried)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Write this rank's state into the checkpoint the Trainer has just written (every rank does)."""
        if self.state is None or args.save_only_model:
            return
        trainer = self._trainer() if self._trainer is not None else None
        run_dir = (trainer._get_output_dir(trial=getattr(trainer, "_trial", None))
                   if trainer is not None and hasattr(trainer, "_get_output_dir") else args.output_dir)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, CHECKPOINT_FILE.format(rank=args.process_index))
        torch.save(_moved(self.state.state_dict(), "cpu"), path + ".partial")
        os.replace(path + ".partial", path)  # never a half-written file under the final name

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """With ``log_stats``: at the Trainer's logging steps, its logs get this rank's figures."""
        if self.log_stats and self.state is not None and control.should_log and self._trainer is not None:
            trainer = self._trainer()
            if trainer is not None:
                trainer.log(self.state.stats(flat=True))

    # -- resuming ------------------------------------------------------------------------------------
    def _load(self, folder: str | os.PathLike[str], rank: int, ddp: Any) -> None:
        assert self.state is not None
        path = os.path.join(folder, CHECKPOINT_FILE.format(rank=rank))
        if not os.path.isfile(path):
            warnings.warn(f"gradpress: the checkpoint this run resumes from ({folder}) holds no gradpress "
                          f"state for rank {rank} ({os.path.basename(path)}; written without GradpressCallback, or "
                          f"with save_only_model?): compression state (error feedback, step counters) starts "
                          f"afresh", RuntimeWarning, stacklevel=3)
            return
        saved = torch.load(path, map_location="cpu", weights_only=True)
        device = next((p.device for p in ddp.module.parameters()), torch.device("cpu"))
        self.state.load_state_dict(_own_part(self.state, saved, device))


def _calling_trainer(callback: GradpressCallback) -> Trainer:
    """The ``transformers.Trainer`` whose event is calling ``callback`` (the innermost frame whose
    ``self`` is a Trainer holding it)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and any(c is callback for c in owner.callback_handler.callbacks):
            return owner
        frame = frame.f_back
    raise RuntimeError("GradpressCallback: no transformers.Trainer holding this callback is calling it; "
                       "pass it to Trainer(callbacks=[…]) or trainer.add_callback(…) and train with "
                       "trainer.train()")


def _resumed_from(trainer: Trainer, args: Any, state: Any) -> str | os.PathLike[str] | None:
    """The checkpoint folder ``trainer.train(resume_from_checkpoint=…)`` resumes from, or None: the
    argument of the ``train()`` call on the stack, which ``train`` has resolved to a folder by now
    (``True``: the last checkpoint in ``output_dir``)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "train" and frame.f_locals.get("self") is trainer:
            resume = frame.f_locals.get("resume_from_checkpoint")
            if resume is True:
                resume = get_last_checkpoint(args.output_dir)
            return resume if isinstance(resume, (str, os.PathLike)) and resume else None
        frame = frame.f_back
    if state.global_step > 0:  # a resumed TrainerState, and no train() call to say from where
        raise RuntimeError(f"GradpressCallback: training resumes at step {state.global_step}, but no "
                           f"trainer.train(resume_from_checkpoint=…) call is on the stack to say from which "
                           f"checkpoint: the compression state cannot be restored")
    return None
