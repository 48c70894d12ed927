"""Every finite input gives a finite output or a clear error (issue 11, point 4), for every registered
compressor (the property suite's specs) and every gradient dtype.

Inputs near the dtype's largest value, where sums of squares, norms, scales, sketch buckets and
all-reduced sums overflow if a method forms them naively; and values of about 2^(E/2 + 4), whose squares
overflow although every value and every norm of them is far inside the range. A method must then decode
to a finite tensor, or raise an ``OverflowError``/``ValueError`` that says why (the value cannot be
represented on the wire, e.g. fp16 for 1e30) — never silent Inf/NaN, and never a
:class:`~gradpress.NonFiniteError`, which reports NaN/Inf in the *input*.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

import gradpress
from specs import SPECS

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NEAR_MAX = ["signs, max/2", "normal, max/2", "constant, max/2", "signs, max", "constant, max"]
SQUARES = ["signs, 2^(E/2+4)", "normal, 2^(E/2+4)", "constant, 2^(E/2+4)"]
# what a simulated all-reduce of two workers' copies may sum without the mean itself overflowing
SUMMABLE_INPUTS = [kind for kind in NEAR_MAX + SQUARES if not kind.endswith(", max")]
SAYS_WHY = re.compile(r"overflow|beyond|exceed|range|too close", re.IGNORECASE)


def large(kind: str, dtype: torch.dtype) -> torch.Tensor:
    """A finite tensor of ``dtype`` named by ``kind``: random signs, normal values scaled so that the
    largest magnitude is the target, or a constant (64 × 33, so block and row layouts see rows)."""
    shape, magnitude = kind.split(", ")
    largest = torch.finfo(dtype).max
    exponent = math.frexp(largest)[1]  # every finite value of dtype is below 2^E
    target = {"max/2": largest / 2, "max": largest, "2^(E/2+4)": 2.0 ** (exponent // 2 + 4)}[magnitude]
    g = torch.Generator().manual_seed(0)
    if shape == "constant":
        x = torch.full((64, 33), target, dtype=torch.float64)
    else:
        r = torch.randn(4096, generator=g, dtype=torch.float64)
        x = r.sign() * target if shape == "signs" else r / r.abs().max() * target
    x = x.clamp(-largest, largest).to(dtype)
    assert torch.isfinite(x).all()
    return x


def narrow_wire(spec: str, dtype: torch.dtype) -> bool:
    """Whether ``spec`` sends values in fp16, which cannot hold fp32/bf16 values beyond 65504."""
    return dtype != torch.float16 and any(part.partition(":")[0] == "fp16" for part in spec.split("+"))


def finite_or_clear_error(run, where: str, must_work: bool = False) -> None:
    try:
        y = run()
    except gradpress.NonFiniteError as error:
        pytest.fail(f"{where}: NonFiniteError for a finite input: {error}")
    except (OverflowError, ValueError) as error:
        if must_work:
            pytest.fail(f"{where}: every value and norm is in range, yet: {type(error).__name__}: {error}")
        assert SAYS_WHY.search(str(error)), f"{where}: {type(error).__name__} without a reason: {error}"
        return
    bad = int((~torch.isfinite(y)).sum())
    assert bad == 0, f"{where}: {bad} NaN/Inf of {y.numel()} from a finite input"


@pytest.mark.parametrize("kind", NEAR_MAX + SQUARES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_of_large_values_is_finite_or_a_clear_error(spec, dtype, kind):
    c = gradpress.make(spec)
    x = large(kind, dtype)
    must_work = kind in SQUARES and not narrow_wire(spec, dtype)
    finite_or_clear_error(lambda: c.decompress(c.compress(x)), f"{spec} {dtype} {kind}", must_work)


@pytest.mark.parametrize("kind", SUMMABLE_INPUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_mean_of_two_workers_of_large_values_is_finite_or_a_clear_error(spec, dtype, kind, request):
    """``gradpress.simulate(spec, [x, x])``: the runtime's own exchange (all-reduce of summands, or
    all-gather and mean), the mean x representable."""
    name = spec.partition(":")[0]
    x = large(kind, dtype)
    must_work = kind in SQUARES and not narrow_wire(spec, dtype)
    finite_or_clear_error(lambda: gradpress.simulate(spec, [x, x]), f"simulate {spec} {dtype} {kind}", must_work)
