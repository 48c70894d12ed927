"""The README's methods table, generated from the registry (``gradpress list --markdown``; a test checks
the README holds it as printed)."""
from __future__ import annotations

import re
from typing import Any

import torch

from gradpress.core.compressor import Compressor, compressor_names, make
from gradpress.core.rng import Context

_ABBREVIATIONS = re.compile(r"(?:\bet al|\bApp|\bDef|\bThm|\bSec|\bEq|\bFig|\be\.g|\bi\.e|\bvs|\bcf|\bAlg)\.$")


def summary(cls: type) -> str:
    """The first sentence of a method's docstring, on one line (abbreviations such as "et al." and
    "App." do not end it)."""
    paragraph = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
    for match in re.finditer(r"\.(?=\s+[A-Z(`]|$)", paragraph):
        if not _ABBREVIATIONS.search(paragraph[:match.end()]):
            return paragraph[:match.end()]
    return paragraph


def markdown_table(numel: int = 1 << 20) -> str:
    """The README's compressor table, generated from the registry: each method's first sentence, its
    bits per value measured on ``numel`` N(0, 1) float32 values (``Packet.nbytes``, seed 0), and its
    facts. ``gradpress list --markdown`` prints it; a test checks the README holds it as printed."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    rows = ["| name | method (docstring's first sentence) | bits/value on 2^20 N(0,1) fp32 | unbiased | exchange "
            "| default feedback |", "|---|---|---:|---|---|---|"]
    for name in compressor_names():
        c = make(name)
        packet = c.compress(x, Context(seed=0, step=0, key="table"), **_alone(c, x))
        bits = f"{packet.nbytes * 8 / numel:.3g}"
        method = summary(type(c)).replace("|", "\\|")
        rows.append(f"| `{name}` | {method} | {bits} | {'yes' if c.unbiased else 'no'} | {c.exchange} "
                    f"| `{c.default_feedback}` |")
    return "\n".join(rows)


def _alone(c: Compressor, x: torch.Tensor) -> dict[str, Any]:
    """A one-worker preliminary exchange, for methods that have one."""
    if not c.prepares:
        return {}
    pre = c.prepare(x, Context(seed=0, step=0, key="table"), 1)
    return {"prepared": None if pre is None else pre.values}

