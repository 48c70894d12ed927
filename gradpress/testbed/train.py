"""``gradpress train``: one model trained by N local worker processes with DDP and a gradient hook.

The launcher fetches the data once, optionally builds the emulated network (:mod:`.netem`), starts one
process per worker (``python -m gradpress.testbed.train --worker``), and returns rank 0's
:class:`~gradpress.testbed.results.Run`. If any worker fails the others are stopped and the error
says which rank failed and why; the network is deleted in every case. ``--nodes M`` emulates M nodes
of ``--workers`` k processes each (world size M·k): every worker gets the variables torchrun would set
on its node (:func:`torchrun_environment`), so ``hierarchy="node"`` finds k ranks a node; with
``--bandwidth``, the workers of a node share a namespace and only the links between nodes are limited.

The worker is a plain DDP training loop. The hook is the gradpress compressor named by the spec, or one
of the reference rows (GRACE Section 5's baselines): ``noop`` (no communication: the compute-only upper
bound), ``torch-allreduce`` (PyTorch's all-reduce hook), ``torch-fp16`` (``fp16_compress_hook``),
``torch-powersgd`` (``powerSGD_hook``, Vogels et al. 2019, rank 1). The sharded rows train the model
with FSDP2's ``fully_shard`` instead of DDP (:mod:`gradpress.testbed.training.sharded`): ``torch-fsdp``
and ``torch-hsdp`` (FSDP2's own reduction on a 1-D mesh of every rank, or on a ("replicate", "shard")
mesh of the nodes and a node's workers), and ``SPEC@fsdp``/``SPEC@hsdp`` (``gradpress.fsdp.register``
on those meshes; ``SPEC@node`` is ``--option hierarchy=node``: :mod:`gradpress.testbed.training.rows`).

Per step it records wall-clock (evaluation excluded), compute time, compression time, communication
time and the bytes this rank handed to collectives (``Packet.nbytes``; for the reference rows, the
sizes of the tensors their hooks communicate). Compression runs inside the backward pass, and after the
last bucket is handed to the hook, ``backward()`` only waits for communication: compute time is the
step's time minus compression time minus that wait. Communication overlaps the backward pass and is
reported as measured from issue to completion.

This module is the command (``add_parser``) and the worker processes' entry point; the parts live in
:mod:`gradpress.testbed.training` (the launcher, the worker loop, the hooks, the options and checks), and
their public names are importable from here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from gradpress.testbed import arguments
from gradpress.testbed.results import REFERENCES
from gradpress.testbed.training.checks import check_launch, check_model, model_spec
from gradpress.testbed.training.config import TrainConfig, TrainFailed, simulated_options
from gradpress.testbed.training.hooks import Spent, install_hook
from gradpress.testbed.training.launch import (
    PORT,
    _failure_path,
    _record_failure,
    _wait,
    torchrun_environment,
    train,
)
from gradpress.testbed.training.options import (
    DEDICATED,
    check_exchange,
    check_options,
    parse_options,
    runtime_option,
)
from gradpress.testbed.training.parser import add_arguments, config_from_args
from gradpress.testbed.training.rows import row, run_config
from gradpress.testbed.training.timing import copy_s, gradient_copy_s, last_level_cache_bytes
from gradpress.testbed.training.worker import _Clock, _optimizer, metered_step, warm_up, worker

__all__ = [
    "DEDICATED", "PORT", "Spent", "TrainConfig", "TrainFailed", "add_arguments", "add_parser",
    "check_exchange", "check_launch", "check_model", "check_options", "checked_config", "config_from_args",
    "copy_s", "gradient_copy_s", "install_hook", "last_level_cache_bytes", "metered_step", "model_spec",
    "parse_options", "runtime_option", "simulated_options", "torchrun_environment", "train", "warm_up",
    "worker",
    # the private helpers that other testbed modules and the tests reach through this module
    "_Clock", "_failure_path", "_optimizer", "_record_failure", "_wait",
]


def checked_config(args: argparse.Namespace, compressor: str) -> TrainConfig:
    """:func:`config_from_args` with :func:`check_launch`'s checks (UsageError)."""
    from gradpress.auto import AutoOptions
    from gradpress.exchange.pipeline import Options

    try:
        config = config_from_args(args, compressor)
    except ValueError as error:
        raise arguments.UsageError(str(error)) from None
    runtime = {key: value for key, value in config.options.items() if key not in AutoOptions.names()}
    try:  # the options alone (with a compressor: check_exchange)
        Options.of(**{"seed": config.seed, **runtime})
    except ValueError as error:
        raise arguments.UsageError(f"--option: {error}") from None
    check_launch(config)
    return config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train a model on local workers with a compressor",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--compressor", type=row, default="none",
                        help=f"gradpress spec or a reference: {', '.join(REFERENCES)} (torch-fsdp, torch-hsdp: "
                             "the model sharded with FSDP2's fully_shard, FSDP2's own reduction on a 1-D mesh "
                             "of every rank, or on an HSDP mesh of (--nodes, --workers), (--workers, 1) on "
                             "one node); a spec may end in @node (--option hierarchy=node), @hsdp (FSDP2 on "
                             "that HSDP mesh, gradpress.fsdp compressing the exchange between the replicas) "
                             "or @fsdp (FSDP2 on the 1-D mesh, gradpress compressing its reduce-scatter: "
                             "the methods of gradpress.fsdp.scatter_methods())")
    parser.add_argument("--json", type=arguments.output_file, help="write the run's record here")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = checked_config(args, "none")
    try:
        config = run_config(config, args.compressor)
        check_exchange(config)
    except ValueError as error:
        raise arguments.UsageError(f"--compressor {config.compressor}: {error}") from None
    try:
        run = train(config, args.json)
    except TrainFailed as error:
        print(f"{arguments.PREFIX}{error}", file=sys.stderr)
        return 1
    final = run.final_quality
    link = run.link_bytes_per_step
    print(f"{run.label}: {run.samples_per_s:.0f} samples/s, {run.bytes_per_step / 1e6:.3f} MB/step"
          + (f" ({link / 1e6:.3f} MB/step over node 0's link)" if link is not None else "")
          + f", {run.metric} {final:.4f}" + (f"; wrote {args.json}" if args.json else ""))
    return 0


def _exit(code: int) -> None:
    """End a worker process without Python's finalization.

    Gloo's worker threads release a finished collective's tensors after the waiting thread has moved
    on; when that tensor's Python object was already dropped, the release takes the GIL. During
    interpreter finalization that ends the thread with a forced unwind through a noexcept destructor,
    and the process aborts ("terminate called without an active exception", exit -6) after a run that
    succeeded: seen about once in 15 two-worker runs of a few steps. The worker has saved what it had
    to and flushed its output, so nothing is lost by skipping finalization (as multiprocessing's forked
    children do)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--worker":
    import traceback

    _, _, payload, rank_text, address_text, port_text, result_text = sys.argv
    try:
        worker(TrainConfig(**json.loads(payload)), int(rank_text), address_text, int(port_text),
               Path(result_text))
    except KeyboardInterrupt:  # Ctrl-C reaches the workers too: the launcher says "interrupted", once
        _exit(arguments.INTERRUPTED)
    except Exception as error:
        _record_failure(Path(result_text), int(rank_text), error)  # the launcher's TrainFailed says why
        traceback.print_exc()
        _exit(1)
    _exit(0)
