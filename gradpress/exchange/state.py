"""A pipeline's saved state, and the checks it passes before it loads (so that
compression state can't be restored into the wrong place).

:meth:`gradpress.exchange.pipeline.Pipeline.state_dict` records, beside the feedback memory, step counters and the
compressor's own state, what they belong to: the specs of the compressor, memory and master, the rank,
the world size and every exchanged tensor's shape. :func:`check` refuses a state of another method,
memory, rank or world size, and a tensor of the wrong shape or dtype or holding NaN/Inf, with a
``ValueError`` naming the key, before anything is loaded. A framework that writes one checkpoint file
from rank 0 saves every rank's state in one dict (:func:`gathered`), and each rank loads its own part.

An ``"auto"`` state (:mod:`gradpress.auto`) has the same keys, with ``spec`` ``"auto"``, plus an ``"auto"``
section: the choice per key, when it was made and is re-checked, and each method's own pipeline state
in this format; FORMAT is unchanged (a runtime of a fixed method refuses it by its spec).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from gradpress.core.compressor import Compressor

FORMAT = 2


_STATE_KEYS = ("format", "spec", "feedback_spec", "master_spec", "rank", "world_size", "shapes", "steps",
               "feedback", "compressor")


def gathered(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's :meth:`Pipeline.state_dict` in one dict (by rank), the form a framework that writes
    one checkpoint file from rank 0 saves; each rank's :meth:`Pipeline.load_state_dict` takes its own."""
    return {"format": FORMAT, "gathered": True, "world_size": len(states), "ranks": list(states)}


def own_state(state: Any, rank: int, world_size: int) -> dict[str, Any]:
    """``state`` checked for the keys a runtime state has: itself, or rank ``rank``'s part of a
    :func:`gathered` state (whose world size must be ``world_size``)."""
    if not isinstance(state, dict):
        raise ValueError(f"gradpress state: expected the dict state_dict() returned, got {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(f"gradpress state: not a state of this version (format {state.get('format')!r}, "
                         f"expected {FORMAT})")
    if state.get("gathered"):
        ranks = state.get("ranks")
        if not isinstance(ranks, list) or len(ranks) != world_size or state.get("world_size") != world_size:
            raise ValueError(f"gradpress state: a gathered state of {state.get('world_size')!r} ranks cannot "
                             f"load into a world of {world_size}")
        return own_state(ranks[rank], rank, world_size)
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"gradpress state: missing {', '.join(repr(k) for k in missing)}")
    return state


def _shapes(recorded: Any) -> dict[str, tuple[int, ...]]:
    if not isinstance(recorded, dict):
        raise ValueError("gradpress state: shapes must map each key to its shape")
    shapes = {}
    for key, shape in recorded.items():
        if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"gradpress state: shapes[{key!r}] must be a list of sizes, got {shape!r}")
        shapes[key] = tuple(shape)
    return shapes


def _check_tensors(where: str, value: Any) -> None:
    """Every tensor in ``value`` (nested dicts and lists) is finite; the error names where one is not."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(f"gradpress state: {where} holds NaN/Inf")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_tensors(f"{where}[{key!r}]", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_tensors(f"{where}[{i}]", item)


def _check_keyed(where: str, sections: Any, shapes: dict[str, tuple[int, ...]]) -> None:
    """A feedback memory's state: sections of float32 tensors keyed by tensor name, each of its key's
    shape where the state recorded one, finite."""
    if not isinstance(sections, dict):
        raise ValueError(f"gradpress state: {where} must be a dict, got {type(sections).__name__}")
    for name, keyed in sections.items():
        if not isinstance(keyed, dict):
            raise ValueError(f"gradpress state: {where}[{name!r}] must map keys to tensors")
        for key, tensor in keyed.items():
            at = f"{where}[{name!r}][{key!r}]"
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
                raise ValueError(f"gradpress state: {at} must be a float32 tensor, got {_kind(tensor)}")
            if key in shapes and tuple(tensor.shape) != shapes[key]:  # (else checked where it is used)
                raise ValueError(f"gradpress state: {at} has shape {tuple(tensor.shape)}, the tensor {shapes[key]}")
            _check_tensors(at, tensor)


def _kind(value: Any) -> str:
    return f"{value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__


def check(state: Any, expected: dict[str, Any], compressors: dict[str, Compressor | None]) -> dict[str, Any]:
    """``state`` (this rank's, or a :func:`gathered` one) checked against ``expected`` (spec,
    feedback_spec, master_spec, rank, world_size) and the ``compressors`` (section name -> the
    compressor whose state it holds); this rank's state, ready to load."""
    state = own_state(state, expected["rank"], expected["world_size"])
    for name, value in expected.items():
        if state[name] != value:
            hint = (" (a framework that saves one file from rank 0 needs every rank's state: save "
                    "state_dict(gathered=True))" if name == "rank" else "")
            raise ValueError(f"gradpress state: {name} is {state[name]!r}, this runtime's is {value!r}{hint}")
    shapes = _shapes(state["shapes"])
    steps = state["steps"]
    if not isinstance(steps, dict) or not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                              and v >= 0 for k, v in steps.items()):
        raise ValueError("gradpress state: steps must map each key to an integer >= 0")
    _check_keyed("feedback", state["feedback"], shapes)
    for name, compressor in compressors.items():
        if compressor is not None:
            section = state.get(name, {})
            _check_tensors(name, section)
            compressor.check_state(section, shapes)
    return state


def shapes_of(state: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensor shapes a checked state records (key -> shape)."""
    return _shapes(state["shapes"])
