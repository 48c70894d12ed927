"""The specs the shared property suite runs: every registered compressor, its declared examples, and
compositions ``A+B`` of every value-keeping method A (the ``kept`` fact: it hands a tensor of values to
a second stage) with natural compression (the paper's C_nat∘S, Table 1), plus a few other second stages."""
from __future__ import annotations

import gradpress
from gradpress.core.compressor import registry

#: second stages beyond natural compression, on a value-keeping method each
OTHER_SECOND_STAGES = [
    "randomk:ratio=0.25,scale=true+qsgd",
    "topk:ratio=0.1+fp16",
]


def value_keeping() -> list[str]:
    """The registered methods with a ``kept`` tensor of values, which a composition hands on, in a
    number of values fixed by the tensor's size (a data-dependent number, threshold's or DGC's,
    cannot be composed yet: :class:`gradpress.Compose` refuses it, tested in test_core)."""
    return [name for name in registry.names()
            if registry.get(name).kept and gradpress.make(name).expected_nbytes(1 << 16) is not None]


COMPOSITIONS = [f"{name}+natural" for name in value_keeping()] + OTHER_SECOND_STAGES


def _available(spec: str) -> bool:
    names = [part.partition(":")[0] for part in spec.split("+")]
    return all(name in registry.names() for name in names)


def all_specs() -> list[str]:
    specs: list[str] = []
    for name in gradpress.compressor_names():
        specs.append(name)
        specs.extend(registry.get(name).examples)
    specs.extend(s for s in COMPOSITIONS if _available(s))
    return specs


SPECS = all_specs()
UNBIASED = [s for s in SPECS if gradpress.make(s).unbiased]
SUMMABLE = [s for s in SPECS if gradpress.make(s).summable]
