"""The rows of ``gradpress compare`` (and ``train --compressor``): a spec or reference, and a suffix that
sets how that run alone exchanges (:func:`split_run`, :func:`run_config`).

- ``SPEC@node``: the two-level exchange under DDP (option ``hierarchy="node"``,
  :data:`~gradpress.testbed.results.HIERARCHICAL`);
- ``SPEC@hsdp``, ``SPEC@fsdp``: the model sharded with FSDP2's ``fully_shard`` instead of DDP, and
  ``gradpress.fsdp.register`` on its mesh (:data:`~gradpress.testbed.results.SHARDED`): HSDP's 2-D mesh
  (the exchange between the replicas compressed), or a 1-D mesh of every rank (the reduce-scatter
  compressed, for the methods of :func:`gradpress.fsdp.scatter_methods`).

FSDP2's own rows are references of their own (``torch-fsdp``, ``torch-hsdp``); PyTorch's rows take no
suffix.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from gradpress.testbed import arguments
from gradpress.testbed.results import HIERARCHICAL, REFERENCES, SHARDED, SHARDED_REFERENCES
from gradpress.testbed.training.config import TrainConfig

#: each suffix of a row -> what it changes in the run's :class:`TrainConfig` (``options`` merged)
SUFFIXES: dict[str, dict[str, Any]] = {
    HIERARCHICAL: {"options": {"hierarchy": "node"}},
    **{suffix: {"sharding": mesh} for suffix, mesh in SHARDED.items()},
}
#: what each suffix runs, in words (the messages and ``--help``)
MEANINGS = {HIERARCHICAL: "the two-level exchange under DDP, hierarchy=node",
            "@hsdp": "FSDP2 on a (nodes, workers) HSDP mesh, the replicas' exchange compressed",
            "@fsdp": "FSDP2 on a 1-D mesh, its reduce-scatter compressed"}


def split_run(item: str) -> tuple[str, dict[str, Any]]:
    """An item of ``--compressors`` as its spec and the changes its suffix makes to the run's config:
    ``"topk:ratio=0.01@node"`` -> ``("topk:ratio=0.01", {"options": {"hierarchy": "node"}})``,
    ``"topk@hsdp"`` -> ``("topk", {"sharding": "hsdp"})``, ``"topk"`` -> ``("topk", {})``. ValueError
    for another suffix, or a suffix on a reference row (PyTorch's own hooks and FSDP2's rows)."""
    spec, suffix = ending(item)
    if not suffix:
        return item, {}
    if suffix not in SUFFIXES:
        known = ", ".join(f"SPEC{s} ({meaning})" for s, meaning in MEANINGS.items())
        raise ValueError(f"{item}: expected {known}; got {suffix}")
    if spec in REFERENCES:
        what = ("FSDP2's own reduction, which takes no suffix" if spec in SHARDED_REFERENCES
                else f"PyTorch's own hook, which has no {suffix} variant")
        raise ValueError(f"{item}: {spec} is {what}; {suffix} is for gradpress methods (FSDP2's own rows: "
                         f"{', '.join(SHARDED_REFERENCES)})")
    return spec, SUFFIXES[suffix]


def run_config(base: TrainConfig, item: str) -> TrainConfig:
    """``base`` for the run of ``--compressors`` item ``item`` (:func:`split_run`)."""
    spec, changes = split_run(item)
    changes = dict(changes)
    options = {**base.options, **changes.pop("options", {})}
    return replace(base, compressor=spec, options=options, **changes)


def ending(item: str) -> tuple[str, str]:
    """``item``'s spec and its suffix, unchecked: ``"topk @ hsdp"`` -> ``("topk", "@hsdp")``,
    ``"topk"`` -> ``("topk", "")``."""
    spec, at, where = item.partition("@")
    return (spec.strip(), "@" + where.strip()) if at else (item, "")


def checked_ending(item: str) -> tuple[str, str]:
    """:func:`ending`, checked by :func:`split_run` (ValueError): the ``--compressors`` suffix rule."""
    split_run(item)
    return ending(item)


def row(text: str) -> str:
    """The ``train --compressor`` converter: a spec or reference, the spec perhaps with a suffix of
    :data:`SUFFIXES` (:func:`split_run`)."""
    import argparse

    try:
        spec, suffix = checked_ending(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(arguments.one_line(error)) from None
    return arguments.compressor_or_reference(REFERENCES)(spec) + suffix
