"""The specs the shared property suite runs: every registered compressor, its declared examples, and
compositions of every value-keeping method with every other registered method that applies."""
from __future__ import annotations

import gradpress
from gradpress.compressor import registry

COMPOSITIONS = [
    "topk:ratio=0.1+natural",
    "randomk:ratio=0.25,scale=true+natural",
    "randomk:ratio=0.25,scale=true+qsgd",
    "topk:ratio=0.1+fp16",
]


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
