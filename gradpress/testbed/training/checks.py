"""What ``gradpress train`` and ``compare`` check before any worker starts: the model spec
(:func:`check_model`, :func:`model_spec`), and the data, the batch and the emulated network
(:func:`check_launch`)."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from gradpress.testbed import arguments, netem
from gradpress.testbed.training.config import TrainConfig


def check_model(spec: str, dataset: Any = None) -> Any:
    """The configuration of model ``spec`` (:func:`~gradpress.testbed.models.model_config`), checked: a known
    name and keys, ``dataset``'s task, values the model accepts (it is built on the meta device: no
    memory, no time). Raises ValueError."""
    from gradpress.testbed.models import model_config

    settings = model_config(spec, dataset)
    try:
        with torch.device("meta"):
            settings.build()
    except ValueError:
        raise
    except Exception:  # noqa: BLE001 - an operation the meta device lacks: the workers build it for real
        pass
    return settings


# -- argument types of the testbed's own values, as those of gradpress.testbed.arguments --------------------
def model_spec(text: str) -> str:
    """A testbed model spec (``mlp-wide:width=8192``): known name and keys, values the model accepts
    (:func:`check_model`)."""
    try:
        check_model(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(arguments.one_line(error)) from None
    return text


def check_launch(config: TrainConfig) -> Any:
    """What ``gradpress train`` and ``compare`` check before any worker starts, beyond each argument
    (:mod:`gradpress.testbed.arguments`): the data (fetched, as :func:`train` does, and loaded), the model for it, a
    batch that a worker's shard holds, the emulated network's needs. Raises
    :class:`~gradpress.testbed.arguments.UsageError`; returns the loaded dataset."""
    from gradpress.testbed import data

    try:
        data.fetch(config.data)
        dataset = data.load(config.data)
    except (data.DataUnavailable, ValueError) as error:
        raise arguments.UsageError(f"--data {config.data}: {error}") from None
    try:
        settings = check_model(config.model, dataset)
    except ValueError as error:
        raise arguments.UsageError(f"--model {config.model}: {error}") from None
    batch_size = config.batch_size or settings.batch_size
    shard = len(dataset.train) // config.world_size
    if shard < batch_size:
        raise arguments.UsageError(f"--batch-size {batch_size}: a worker's shard of {config.data} holds {shard} "
                                   f"samples ({len(dataset.train)} over {config.world_size} workers), "
                                   "not one batch")
    if config.bandwidth is not None:
        links = config.nodes if config.nodes > 1 else config.workers
        if links > netem.MAX_NODES:
            what = "nodes" if config.nodes > 1 else "workers"
            raise arguments.UsageError(f"--bandwidth {config.bandwidth}: the emulated network holds at most "
                                       f"{netem.MAX_NODES} {what}, got {links}")
        try:
            netem.check_available()
        except netem.NetworkUnavailable as error:
            raise arguments.UsageError(f"--bandwidth {config.bandwidth}: {error}") from None
    return dataset
