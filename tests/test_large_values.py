"""Every finite input gives a finite output or a clear error, for every registered
compressor (the property suite's specs) and every gradient dtype.

Inputs near the dtype's largest value, where sums of squares, norms, scales, sketch buckets and
all-reduced sums overflow if a method forms them naively; and values of about 2^(E/2 + 4), whose squares
overflow although every value and every norm of them is far inside the range. A method must then decode
to a finite tensor, or raise an ``OverflowError``/``ValueError`` that says why (the value cannot be
represented on the wire, e.g. fp16 for 1e30) — never silent Inf/NaN, and never a
:class:`~gradpress.NonFiniteError`, which reports NaN/Inf in the *input*.
"""
from __future__ import annotations

import contextlib
import math
import re

import pytest
import torch

import gradpress
from gradpress.kernels.jit import numba_disabled
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
    x = large(kind, dtype)
    must_work = kind in SQUARES and not narrow_wire(spec, dtype)
    finite_or_clear_error(lambda: gradpress.simulate(spec, [x, x]), f"simulate {spec} {dtype} {kind}", must_work)


# -- error feedback and aggregation over several steps, near every dtype's largest value ----------------
def near_limit(kind: str, dtype: torch.dtype, rank: int) -> torch.Tensor:
    """Rank ``rank``'s finite gradient named by ``kind``: ``±max`` (random signs, on both ranks), ``max/4``
    (normal values scaled to it on rank 0, N(0, 1) on rank 1), ``one max`` and ``one -max/4`` (single
    elements, on both ranks), ``3 values`` (0.88·max, −1, 2 on both ranks, as ``[3e38, -1, 2]`` in fp32)."""
    largest = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(rank)
    r = torch.randn(64, generator=g, dtype=torch.float64)
    if kind == "±max":
        x = r.sign() * largest
    elif kind == "max/4":
        x = r / r.abs().max() * (largest / 4) if rank == 0 else r
    elif kind == "one max":
        x = torch.tensor([largest], dtype=torch.float64)
    elif kind == "one -max/4":
        x = torch.tensor([-largest / 4], dtype=torch.float64)
    else:
        x = torch.tensor([0.88 * largest, -1.0, 2.0], dtype=torch.float64)
    return x.to(dtype)


LIMIT_KINDS = ["±max", "max/4", "one max", "one -max/4", "3 values"]
# in fp16/bf16: what carries φ = m + g past the gradient's range, and an all-reduced sum past the wire's;
# the single elements find float32's edges (THC's truncation range, dithering's top level), which the
# tests below take to the other dtypes where a method has them
NARROW_KINDS = ["±max", "max/4", "3 values"]


def steps_finite_or_clear_error(spec: str, dtype: torch.dtype, kind: str, steps: int = 3, **options) -> None:
    """``steps`` steps of 2 simulated workers (error feedback carried over, an empty tensor beside):
    every average finite and of the input's shape, or an OverflowError/ValueError saying why."""
    sim = gradpress.Simulator(spec, 2, seed=0, **options)
    where = f"{spec} {options} {dtype} {kind}"
    for step in range(steps):
        worker_grads = [{"g": near_limit(kind, dtype, rank), "e": torch.zeros(0, dtype=dtype)}
                        for rank in range(2)]
        try:
            out = sim.step(worker_grads)
        except gradpress.NonFiniteError as error:
            pytest.fail(f"{where} step {step}: NonFiniteError for finite gradients: {error}")
        except (OverflowError, ValueError) as error:
            assert SAYS_WHY.search(str(error)), f"{where}: {type(error).__name__} without a reason: {error}"
            return
        assert out["e"].shape == (0,) and out["g"].shape == worker_grads[0]["g"].shape
        bad = int((~torch.isfinite(out["g"])).sum())
        assert bad == 0, f"{where} step {step}: {bad} NaN/Inf of {out['g'].numel()} from finite gradients"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_and_aggregation_near_the_limits(spec, dtype):
    """Every method with its own error feedback, over three steps, so that the memory carries what
    compression left near the dtype's largest value into φ = m + g."""
    for kind in LIMIT_KINDS if dtype == torch.float32 else NARROW_KINDS:
        steps_finite_or_clear_error(spec, dtype, kind)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", [s for s in SPECS if gradpress.make(s).default_feedback != "residual"])
def test_residual_feedback_near_the_limits(spec, dtype):
    """The methods whose own memory is another one, under the residual memory (GRACE Eq. 5)."""
    for kind in ("±max", "max/4"):
        steps_finite_or_clear_error(spec, dtype, kind, feedback="residual")


@pytest.mark.parametrize("spec", ["topk", "randomk", "qsparse", "qsparse:sparsifier=randomk,ratio=0.1"])
def test_fp16_gradients_of_20000_keep_training_with_residual_feedback(spec):
    """One rank's fp16 gradients of 20000 (a third of fp16's largest): φ = m + g grows past 65504 within
    a few steps where most of it stays behind. φ is formed in the float32 memory and compressed saturated
    at ±65504; the memory keeps the rest, so for the exact methods (top-k, random-k) what every rank
    received plus what both memories hold is what the ranks put in, to the roundings of the fp16 means."""
    sim = gradpress.Simulator(spec, 2, seed=0, feedback="residual")
    given, given_abs, received, slack = (torch.zeros(4096, dtype=torch.float64) for _ in range(4))
    for step in range(6):
        g = [torch.full((4096,), 20000.0, dtype=torch.float16),
             torch.randn(4096, generator=torch.Generator().manual_seed(step)).to(torch.float16)]
        out = sim.step([{"w": x} for x in g])["w"]
        assert out.dtype == torch.float16 and bool(torch.isfinite(out).all()), f"step {step}"
        given += g[0].double() + g[1].double()
        given_abs += g[0].double().abs() + g[1].double().abs()
        received += 2 * out.double()
        # twice the fp16 rounding of the mean (u = 2^-11 of it, 2^-25 below fp16's normal range), and per
        # rank float32's roundings of φ = m + g and m' = φ − sent (|φ| ≤ Σ|g|, |m'| ≤ |φ| + 65504)
        slack += 2 * (2.0**-11 * out.double().abs() + 2.0**-25) + 2.0**-24 * (4 * given_abs + 2 * 65504)
    if spec in ("topk", "randomk"):
        memory = sum(p.feedback.memory("w").double() for p in sim.pipelines)
        assert bool(((received + memory - given).abs() <= slack).all())
        assert float(memory.max()) > 65504  # what φ held beyond fp16's range waits in the memory


@pytest.mark.parametrize("spec", ["topk", "randomk", "qsparse"])
def test_fp32_gradients_near_a_quarter_of_the_largest_keep_training(spec):
    """float32 gradients of max/4 on one rank: φ = m + g passes float32's largest at the fourth step;
    it saturates there (what lies beyond float32 cannot be kept), and every average stays finite, or a
    method raises an OverflowError saying which of its values cannot be represented."""
    steps_finite_or_clear_error(spec, torch.float32, "max/4", steps=6, feedback="residual")


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [1.0, -1.0, 0.6, 0.25], ids=lambda v: f"{v}max")
def test_thc_single_element_near_the_largest(numba, dtype, value):
    """THC's truncation range ±t_p·ℓ/√d for one element is 2.15 times the value: beyond float32's range
    it raises OverflowError (before: −Inf, a bf16 max decoded as −max on the numba path, an IndexError on
    the torch one); below it the decode is finite and keeps the value's sign (top of the grid)."""
    largest = torch.finfo(dtype).max
    x = torch.tensor([value * largest], dtype=dtype)
    for spec in ("thc", "thc:bits=2,granularity=8"):
        with contextlib.nullcontext() if numba else numba_disabled():
            c = gradpress.make(spec)
            try:
                y = c.decompress(c.compress(x))
                mean = gradpress.simulate(spec, [x, x])
            except OverflowError as error:
                assert abs(value) * torch.finfo(dtype).max * c.t_p >= torch.finfo(torch.float32).max
                assert SAYS_WHY.search(str(error)), error
                continue
        for z in (y, mean):
            assert bool(torch.isfinite(z).all()) and float(z) * value >= 0, (spec, z)


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize("spec", ["qsgd:levels=127", "qsgd:levels=127,bucket=100", "qsgd:levels=3",
                                  "dither:partition=standard,levels=5,norm=1", "terngrad"])
def test_standard_dithering_decodes_the_largest_value_to_itself(numba, spec):
    """A value at its bucket's norm ν is level s: decoded ν·s/s = ν. In float32 fl32(ν/s)·s may round
    past ν, to Inf for ν = float32's largest; the decode is bounded by ν, on both paths, and within the
    two roundings of fl32(fl32(ν/s)·s) of it."""
    largest = torch.finfo(torch.float32).max
    with contextlib.nullcontext() if numba else numba_disabled():
        c = gradpress.make(spec)
        for x in (torch.tensor([largest]), torch.tensor([-largest]), torch.tensor([largest / 3])):
            for y in (c.decompress(c.compress(x)), gradpress.simulate(spec, [x, x])):
                assert bool(torch.isfinite(y).all()) and float(y.abs()) <= float(x.abs()), (spec, y)  # ≤ ν
                assert float(abs(y - x) / x.abs()) <= 2 * 2.0**-24, (spec, y)
        x = torch.tensor([largest / 2, -largest / 4, 1.0, 0.0])  # (norms within float32's range)
        assert bool(torch.isfinite(gradpress.simulate(spec, [x, x])).all())


@pytest.mark.parametrize("numba", [True, False], ids=["numba", "torch"])
@pytest.mark.parametrize("spec", ["randomk:ratio=1", "powersgd", "cltk", "cltk:chunk=1"])
def test_sums_beyond_the_range_raise_on_every_rank(numba, spec):
    """``simulate(spec, [t, t])``, t = [3e38, −1, 2]: the mean is 3e38, but the all-reduced sum of the
    two values is beyond float32's range (and the methods send them as they are): an OverflowError
    saying so, the same on every rank (they decode the same sums), not an Inf in the average."""
    t = torch.tensor([3e38, -1.0, 2.0])
    with contextlib.nullcontext() if numba else numba_disabled():
        with pytest.raises(OverflowError, match="overflow"):
            gradpress.simulate(spec, [t, t])
        half = torch.tensor([1e38, -1.0, 2.0])
        assert bool(torch.isfinite(gradpress.simulate(spec, [half, half])).all())
