"""Specs are strict: malformed specs and out-of-range parameters are errors that
name the key and what it allows, checked by one mechanism (``gradpress.core.registry.param`` ranges)."""
from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest

import gradpress
from gradpress.compressors.sparsify import TopK
from gradpress.core.compressor import registry as compressor_registry
from gradpress.core.feedback import feedback_registry
from gradpress.core.registry import RANGE, Range, param_range, parse_spec, spec_fields, split_specs

REGISTRIES = {"compressor": compressor_registry, "feedback": feedback_registry}



def _numeric(annotation) -> type | None:
    """int or float for a (possibly optional) numeric annotation, else None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    numeric = [a for a in args if a in (int, float)]
    return numeric[0] if len(numeric) == 1 and len(args) == 1 else None


def _parameters():
    for kind, reg in REGISTRIES.items():
        for name in reg.names():
            cls = reg.get(name)
            for key, annotation in spec_fields(cls).items():
                yield kind, name, key, annotation, param_range(cls, key)


PARAMETERS = list(_parameters())
RANGED = [(kind, name, key, _numeric(annotation), allowed)
          for kind, name, key, annotation, allowed in PARAMETERS if allowed is not None]


def _make(kind: str, spec: str, **overrides):
    return gradpress.make(spec, **overrides) if kind == "compressor" else gradpress.make_feedback(spec, **overrides)


# -- the cases of the issue ----------------------------------------------------------------------------
def test_a_key_given_twice_is_an_error():
    with pytest.raises(ValueError, match="'ratio' is given twice"):
        gradpress.make("topk:ratio=0.1,ratio=0.2")
    with pytest.raises(ValueError, match="given twice"):
        parse_spec("topk:ratio=0.1, ratio =0.1")  # the same value twice is still a typo
    with pytest.raises(ValueError, match="'beta' is given twice"):
        gradpress.make_feedback("residual:beta=0.5,beta=0.9")


@pytest.mark.parametrize("spec", ["topk:ratio=0.1,,", "topk:ratio=0.1,", "topk:,ratio=0.1",
                                  "randomk:ratio=0.5,,scale=true", "topk: , "])
def test_an_empty_item_is_an_error(spec):
    with pytest.raises(ValueError, match="empty item"):
        gradpress.make(spec)


def test_an_empty_piece_of_a_spec_list_is_an_error():
    with pytest.raises(ValueError, match="empty item"):
        split_specs("topk:ratio=0.1,,natural")
    with pytest.raises(ValueError, match="empty item"):
        split_specs("topk,natural,")
    assert split_specs("topk:ratio=0.1,natural") == ["topk:ratio=0.1", "natural"]


def test_name_with_a_bare_colon_is_the_name():
    assert parse_spec("topk:") == ("topk", {})
    assert parse_spec(" qsgd : levels = 4 , bucket=0 ") == ("qsgd", {"levels": "4", "bucket": "0"})


def test_onebit_tau_below_zero():
    with pytest.raises(ValueError, match=re.escape("onebit:tau must be in [0, inf), got -1.0")):
        gradpress.make("onebit:tau=-1")


def test_an_absurd_powersgd_rank():
    with pytest.raises(ValueError, match=re.escape(
            "powersgd:rank must be an integer >= 1 and <= 1024, got 1099511627776")):
        gradpress.make("powersgd:rank=1099511627776")
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        gradpress.make("powersgd:rank=0")
    assert gradpress.make("powersgd:rank=1024").rank == 1024


def test_message_names_the_key_the_range_and_the_value():
    with pytest.raises(ValueError, match=re.escape("topk:ratio must be in (0, 1], got 2.0")):
        gradpress.make("topk:ratio=2")
    with pytest.raises(ValueError, match=re.escape("dgc:clip must be in (0, inf) or none, got -1.0")):
        gradpress.make_feedback("dgc:clip=-1")
    assert gradpress.make_feedback("dgc:clip=none").clip is None


@pytest.mark.parametrize("spec, match", [
    ("sketch:lam=inf", r"sketch:lam must be in \(0, 64\], got inf"),
    ("topk:ratio=nan", r"topk:ratio must be in \(0, 1\], got nan"),
    ("threshold:v=-inf", r"threshold:v must be in \[0, inf\), got -inf"),
    ("inceptionn:error_bound=1/4", r"inceptionn:error_bound must be in \[2\^-15, 2\^-7\], got 0.25"),
    ("inceptionn:error_bound=0.001", "power of two"),  # in range, but the method wants a power of two
    ("cltk:chunk=2,per_chunk=3", r"per_chunk \(3\) cannot exceed chunk \(2\)"),  # a cross-field check
    ("qsgd:levels=2^10", r"qsgd:levels must be an integer >= 1 and <= 127, got 1024"),
])
def test_spec_text_reaches_the_range_check(spec, match):
    with pytest.raises(ValueError, match=match):
        gradpress.make(spec)


def test_overrides_are_checked_by_type_and_range():
    for overrides, match in [({"rank": 2.5}, "powersgd:rank must be an integer"),
                             ({"rank": True}, "powersgd:rank must be an integer"),
                             ({"warm_start": 1}, "powersgd:warm_start must be true or false"),
                             ({"min_compression_rate": -0.5}, r"must be in \[0, inf\)")]:
        with pytest.raises(ValueError, match=match):
            gradpress.make("powersgd", **overrides)
    with pytest.raises(ValueError, match="cltk:select: 'sort' is not one of chunk, exact"):
        gradpress.make("cltk", select="sort")  # text, read as spec text is
    with pytest.raises(ValueError, match="cltk:select must be one of chunk, exact, got 3"):
        gradpress.make("cltk", select=3)
    with pytest.raises(ValueError, match=r"qsgd:bucket must be an integer >= 0 or none, got -1"):
        gradpress.make("qsgd", bucket=-1)
    assert gradpress.make("qsgd", bucket=None).bucket is None
    assert gradpress.make("topk", ratio=1).ratio == 1  # an int where a float is declared is a number


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match=re.escape("topk:ratio must be in (0, 1], got 0")):
        TopK(ratio=0)
    with pytest.raises(ValueError, match=re.escape("lowpass:beta must be in [0, 1], got 2")):
        type(gradpress.make_feedback("lowpass"))(beta=2)


# -- the mechanism, for every parameter -----------------------------------------------------------------
@pytest.mark.parametrize("kind, name, key, annotation, allowed", PARAMETERS,
                         ids=[f"{k}:{n}:{key}" for k, n, key, *_ in PARAMETERS])
def test_every_numeric_parameter_declares_a_range(kind, name, key, annotation, allowed):
    """One mechanism for every registered compressor and feedback memory: a numeric parameter without
    a declared range would accept nonsense (a negative threshold, an absurd rank)."""
    if _numeric(annotation) is not None:
        assert isinstance(allowed, Range), f"{kind} {name}:{key} ({annotation}) declares no range"
        default = next(f.default for f in dataclasses.fields(REGISTRIES[kind].get(name)) if f.name == key)
        assert default is None or default in allowed, f"{name}:{key}'s default {default} is outside {allowed.text}"
    else:
        assert allowed is None, f"{name}:{key} ({annotation}) is checked by its type, not a range"


@pytest.mark.parametrize("kind, name, key, number, allowed", RANGED,
                         ids=[f"{k}:{n}:{key}" for k, n, key, *_ in RANGED])
def test_every_declared_range_rejects_a_value_just_outside_it(kind, name, key, number, allowed):
    """Property: the nearest value beyond each bound (the bound itself when open, the next float or
    integer when closed, ±inf beyond an infinite bound, NaN) is rejected, as an override and as spec
    text, with a message naming ``name:key`` and the range."""
    integer = number is int
    described = re.escape(allowed.describe(integer))
    outside = allowed.outside(integer)
    assert outside, allowed
    for value in outside:
        assert value not in allowed
        with pytest.raises(ValueError, match=f"{re.escape(name)}:{key} must be {described}"):
            _make(kind, name, **{key: value})
        text = repr(value) if isinstance(value, float) and math.isfinite(value) else str(value)
        with pytest.raises(ValueError, match=f"{re.escape(name)}:{key} must be {described}"):
            _make(kind, f"{name}:{key}={text}")


@pytest.mark.parametrize("kind, name, key, number, allowed", RANGED,
                         ids=[f"{k}:{n}:{key}" for k, n, key, *_ in RANGED])
def test_the_closed_bounds_are_allowed(kind, name, key, number, allowed):
    """A closed bound is accepted by the range check (the method may still refuse it for a reason of
    its own, such as THC's g >= 2^b - 1 for g = 1, with another message); an open one is not."""
    for bound, is_open in ((allowed.low, allowed.low_open), (allowed.high, allowed.high_open)):
        if math.isinf(bound):
            continue
        value = int(bound) if number is int else float(bound)
        assert (value in allowed) is not is_open
        if is_open:
            continue
        try:
            _make(kind, name, **{key: value})
        except ValueError as error:
            assert f"{name}:{key} must be" not in str(error), error


def test_declared_ranges_sit_in_field_metadata():
    field = next(f for f in dataclasses.fields(TopK) if f.name == "ratio")
    assert field.metadata[RANGE] == Range.parse("(0, 1]")


@pytest.mark.parametrize("text", ["0, 1", "(0, 1", "[0, inf]", "[-inf, 0)", "(1, 1)", "[2, 1]", "(0; 1]"])
def test_malformed_ranges_are_refused(text):
    with pytest.raises(ValueError, match="range"):
        Range.parse(text)


def test_range_reading():
    r = Range.parse("[2^-15, 2^-7]")
    assert 2.0**-15 in r and 2.0**-7 in r and math.nextafter(2.0**-15, 0) not in r
    assert Range.parse("(0, 1]").outside() [:2] == [0.0, math.nextafter(1.0, 2.0)]
    assert Range.parse("[1, 1024]").outside(integer=True) == [0, 1025]
    assert Range.parse("[0, inf)").describe(integer=True) == "an integer >= 0"
    assert float("nan") not in Range.parse("(-inf, inf)")


def test_the_facts_of_a_method_are_one_list_in_the_docs_the_code_and_the_class():
    """docs/methods.md's checklist, ``FACTS`` and ``Compressor`` name the same class-level facts, and the
    class's docstring explains each."""
    from pathlib import Path

    from gradpress.core.compressor import FACTS, Compressor

    checklist = (Path(__file__).resolve().parents[1] / "docs" / "methods.md").read_text()
    item = checklist[checklist.index("3. The facts the runtime relies on"):]
    item = item[:item.index("(`gradpress.core.compressor.FACTS`")]
    listed = re.findall(r"`(\w+)`", item[item.index("refuses them):"):])
    assert sorted(listed) == sorted(FACTS) and len(set(FACTS)) == len(FACTS)
    declared = {name for name, kind in Compressor.__annotations__.items() if "ClassVar" in str(kind)}
    assert declared - {"name"} <= set(FACTS), declared - set(FACTS)
    for fact in FACTS:
        assert hasattr(Compressor, fact), fact
        assert f"``{fact}``" in Compressor.__doc__ or f":attr:`{fact}`" in Compressor.__doc__, fact
