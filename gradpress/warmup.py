"""Compiling a method's kernels before training: ``gradpress.warm_up`` (also ``gradpress compile``).

The CPU kernels are compiled by numba the first time they meet a combination of argument types: tens of
seconds for some methods on an empty disk cache (THC's, PowerSGD's), a fraction of a second to load
them from it. The front ends do it when they are set up, on every rank before its first exchange, and
say so in one INFO line on the ``gradpress`` logger (:mod:`gradpress.log`): :func:`gradpress.register`
and :func:`gradpress.ddp_comm_hook` for the dtypes of the model's CPU parameters (every float dtype when
they do not know the model), :class:`gradpress.Communicator` for every float dtype, a
:class:`gradpress.Simulator` for float32; ``"auto"`` warms every candidate it may choose. Where the
gradients are on a GPU (the model's parameters, or an NCCL group), no CPU kernel runs, and nothing is
compiled. :func:`warm_up` does the same on demand, e.g. when a container image is built, so that the
kernels are in its disk cache (see the README's "Compiled kernels").
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from gradpress.auto import AutoOptions, is_auto
from gradpress.core.compressor import FLOAT_DTYPES, Compressor
from gradpress.exchange.pipeline import Options, build
from gradpress.simulation import warm_kernels


def warm_up(*specs: str | Compressor, dtypes: Sequence[torch.dtype] | None = None, workers: int = 2,
            **options: Any) -> None:
    """Compile the CPU kernels that ``specs`` need — or load them from the disk cache — now, for
    gradients of ``dtypes`` (default: float32, float16 and bfloat16) exchanged by ``workers`` ranks with
    ``options`` (those of :class:`gradpress.Communicator`; ``"auto"``: every one of its ``candidates``
    and its ``measure_with``).
    Each spec runs a few steps in a :class:`gradpress.Simulator` on small tensors, through every path of
    an exchange; one INFO line on the ``gradpress`` logger says what was compiled and how long it took.
    Settings warmed before in this process are skipped. A bad spec or option raises ``ValueError``."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    compressors, options = _compressors(specs, options)
    chosen = _dtypes(FLOAT_DTYPES if dtypes is None else dtypes)
    warm_kernels(compressors, workers, Options.of(**options), chosen)


def for_training(spec: str | Compressor | None, options: Options, auto: AutoOptions | None = None, *,
                 model: torch.nn.Module | None = None, group: Any = None) -> None:
    """What a front end calls when it is set up (see the module docstring): ``spec``'s kernels (``auto``'s
    candidates' and ``measure_with`` with ``auto``, and what its decision imports:
    :func:`gradpress.auto.measure.preload`) for the float dtypes of ``model``'s CPU parameters that need
    gradients (every float dtype without a ``model``), exchanged in ``group`` (its size where
    torch.distributed is initialized, else 2 workers, or enough for ``options.root``). Nothing where the
    gradients are not on the CPU."""
    import torch.distributed as dist

    if auto is not None:
        from gradpress.auto.measure import preload

        preload()
    initialized = dist.is_available() and dist.is_initialized()
    if initialized and dist.get_backend(group) == "nccl":
        return  # CUDA tensors: the torch implementations, nothing to compile
    if model is None:
        dtypes: Sequence[torch.dtype] = FLOAT_DTYPES
    else:
        dtypes = sorted({p.dtype for p in model.parameters() if p.requires_grad and p.is_cpu
                         and p.dtype in FLOAT_DTYPES}, key=FLOAT_DTYPES.index)
        if not dtypes:
            return
    if auto is not None:
        specs: Iterable[str | Compressor] = auto.methods
    else:
        assert spec is not None  # (a spec, or auto's options with the candidates)
        specs = [spec]
    compressors = [build(s) for s in specs]
    workers = dist.get_world_size(group) if initialized else max(2, options.root + 1)
    warm_kernels(compressors, workers, options, dtypes)


def _compressors(specs: Sequence[str | Compressor], options: dict[str, Any]) -> tuple[list[Compressor], dict]:
    """The compressors ``specs`` name (``auto``: its candidates and ``measure_with``, its own options
    taken from ``options``)."""
    if not specs:
        raise ValueError("warm_up needs at least one spec")
    options = dict(options)
    auto = AutoOptions.pop_from(options) if any(is_auto(s) for s in specs) else None
    compressors: list[Compressor] = []
    for spec in specs:
        for one in (auto.methods if is_auto(spec) and auto is not None else [spec]):
            compressor = build(one)
            if all(c.spec != compressor.spec for c in compressors):
                compressors.append(compressor)
    return compressors, options


def _dtypes(dtypes: Sequence[torch.dtype]) -> list[torch.dtype]:
    chosen = list(dict.fromkeys(dtypes))
    for dtype in chosen:
        if dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtypes: gradients are float32, float16 or bfloat16, got {dtype!r}")
    return chosen
