"""A pipeline's saved state, and the checks it passes before it loads (so that
compression state can't be restored into the wrong place).

:meth:`gradpress.exchange.pipeline.Pipeline.state_dict` records, beside the feedback memory, step counters and the
compressor's own state, what they belong to: the specs of the compressor, memory and master, the rank,
the world size and every exchanged tensor's shape. :func:`check` refuses a state of another method,
memory, rank or world size, and a tensor of the wrong shape or dtype or holding NaN/Inf, with a
``ValueError`` naming the key, before anything is loaded. A framework that writes one checkpoint file
from rank 0 saves every rank's state in one dict (:func:`gathered`), and each rank loads its own part.
The state also holds the rank's statistics (``"stats"``: :class:`gradpress.exchange.pipeline.Stats`), which an
older state lacks (they then start from zero).

A state of another world size cannot load as it is: the error-feedback memory is each rank's own (what
its compression dropped and no step has sent yet). An elastic restart (``torchrun --nnodes 1:4``) loads
it with ``on_world_size_change="reset"``: :func:`resized` keeps what every rank holds alike (step
counters, shapes, a compressor's shared state such as PowerSGD's warm starts) and the rank's own
statistics where that rank was saved, drops the rest (the memory first), and :func:`warn_resized` says
what went.

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


#: what ``load_state_dict(state, on_world_size_change=…)`` does with a state saved at another world size:
#: ``"raise"`` a ``ValueError`` (the default), or ``"reset"`` (:func:`resized`)
WORLD_SIZE_CHANGES = ("raise", "reset")

_STATE_KEYS = ("format", "spec", "feedback_spec", "master_spec", "rank", "world_size", "shapes", "steps",
               "feedback", "compressor")


def gathered(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's :meth:`Pipeline.state_dict` in one dict (by rank), the form a framework that writes
    one checkpoint file from rank 0 saves; each rank's :meth:`Pipeline.load_state_dict` takes its own."""
    return {"format": FORMAT, "gathered": True, "world_size": len(states), "ranks": list(states)}


def check_world_size_change(value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is one of :data:`WORLD_SIZE_CHANGES`."""
    if not isinstance(value, str) or value not in WORLD_SIZE_CHANGES:
        raise ValueError(f"on_world_size_change must be one of {', '.join(map(repr, WORLD_SIZE_CHANGES))}, "
                         f"got {value!r}")


def own_state(state: Any, rank: int, world_size: int, on_world_size_change: str = "raise") -> dict[str, Any]:
    """``state`` checked for the keys a runtime state has: itself, or rank ``rank``'s part of a
    :func:`gathered` state (whose world size must be ``world_size``). With ``on_world_size_change``
    ``"reset"``, a gathered state of another world size gives the part of rank ``rank`` where it was
    saved, else rank 0's, as it was saved (:func:`resized` makes it one of this world)."""
    check_world_size_change(on_world_size_change)
    if not isinstance(state, dict):
        raise ValueError(f"gradpress state: expected the dict state_dict() returned, got {type(state).__name__}")
    if state.get("format") != FORMAT:
        raise ValueError(f"gradpress state: not a state of this version (format {state.get('format')!r}, "
                         f"expected {FORMAT})")
    if state.get("gathered"):
        ranks, saved = state.get("ranks"), state.get("world_size")
        if not isinstance(ranks, list) or not ranks or len(ranks) != saved:
            raise ValueError(f"gradpress state: a gathered state of {saved!r} ranks must hold one state per "
                             f"rank, got {len(ranks) if isinstance(ranks, list) else type(ranks).__name__}")
        if saved != world_size:
            if on_world_size_change != "reset":
                raise ValueError(f"gradpress state: a gathered state of {saved} ranks cannot load into a "
                                 f"world of {world_size}{RESET_HINT}")
            return own_state(ranks[rank] if rank < saved else ranks[0], rank, world_size)
        return own_state(ranks[rank], rank, world_size)
    missing = [key for key in _STATE_KEYS if key not in state]
    if missing:
        raise ValueError(f"gradpress state: missing {', '.join(repr(k) for k in missing)}")
    return state


RESET_HINT = (" (each rank's error-feedback memory is its own; to resume at another world size with it "
              "started afresh, as an elastic restart does, load with on_world_size_change='reset')")


def resized(state: dict[str, Any], rank: int, world_size: int,
            shared: dict[str, bool]) -> tuple[dict[str, Any], list[str], list[str]]:
    """``state`` (one rank's, checked by :func:`own_state`, saved at another world size) as the state of
    rank ``rank`` in a world of ``world_size``: ``(state, dropped, kept)``, the last two in words.

    Kept: the step counters and shapes (the same on every rank: a step exchanges the same tensors on
    all), the sections of ``shared`` marked True (``"compressor"``, ``"master"``: a state that every
    rank holds alike, formed from what they all decode, e.g. PowerSGD's warm starts), and the
    statistics where ``state`` is this rank's own. Dropped: the error-feedback memory (each rank's
    own: rank r's residual means nothing to a world where r is another share of the batch, or absent),
    any other compressor state, and another rank's statistics (this rank's then start from zero)."""
    out = {**state, "rank": rank, "world_size": world_size, "feedback": {}}
    dropped, kept = [], ["the step counters and shapes"]
    memory = state.get("feedback")
    keys = sorted({key for section in memory.values() if isinstance(section, dict) for key in section}) \
        if isinstance(memory, dict) else []
    if keys:
        dropped.append(f"the error-feedback memory ({state.get('feedback_spec')}) of {len(keys)} "
                       f"tensor{'s' if len(keys) > 1 else ''} ({', '.join(map(repr, keys[:4]))}"
                       f"{', …' if len(keys) > 4 else ''})")
    for name, owner in (("compressor", state.get("spec")), ("master", state.get("master_spec"))):
        section = state.get(name)
        if not _holds(section):
            continue
        names = ", ".join(map(repr, section)) if isinstance(section, dict) else "…"
        what = f"{owner}'s own state ({names})"
        if shared.get(name, False):
            kept.append(what)
        else:
            dropped.append(what)
            out[name] = {}
    if "stats" in state:
        if state.get("rank") == rank:
            kept.append("this rank's statistics")
        else:
            dropped.append(f"rank {state.get('rank')}'s statistics (rank {rank}'s start from zero)")
            del out["stats"]
    return out, dropped, kept


def _holds(value: Any) -> bool:
    """Whether ``value`` (nested dicts and lists) holds anything but empty containers."""
    if isinstance(value, dict):
        return any(_holds(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v) for v in value)
    return value is not None


def warn_resized(saved: int, world_size: int, dropped: Sequence[str], kept: Sequence[str]) -> None:
    """The ``UserWarning`` of a state of ``saved`` ranks loaded into a world of ``world_size``."""
    import warnings

    warnings.warn(f"gradpress: a state saved at world size {saved} loads into a world of {world_size} "
                  f"(on_world_size_change='reset'): error feedback starts afresh; dropped "
                  f"{'; '.join(dropped) if dropped else 'nothing (no memory was held)'}; kept "
                  f"{'; '.join(kept)}", UserWarning, stacklevel=4)


def own_part(state: Any, rank: int, world_size: int, shared: dict[str, bool],
             on_world_size_change: str = "raise") -> dict[str, Any]:
    """Rank ``rank``'s part of ``state`` (its own state, or its part of a gathered one). With
    ``on_world_size_change="reset"``, a state saved at another world size becomes one of this world
    (:func:`resized`: the step counters, shapes, shared compressor state — ``shared``, the sections
    the ranks hold alike — and this rank's statistics kept, the error-feedback memory dropped), with a
    ``UserWarning`` saying what was dropped; with ``"raise"`` (the default) it is refused when loaded."""
    part = own_state(state, rank, world_size, on_world_size_change)
    if on_world_size_change == "raise" or part["world_size"] == world_size:
        return part
    out, dropped, kept = resized(part, rank, world_size, shared)
    warn_resized(part["world_size"], world_size, dropped, kept)
    return out


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
            hint = {"rank": " (a framework that saves one file from rank 0 needs every rank's state: save "
                            "state_dict(gathered=True))", "world_size": RESET_HINT}.get(name, "")
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
