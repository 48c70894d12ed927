"""Spec strings and registries: ``make("qsgd:levels=16,bucket=512")`` builds a compressor by name.

A spec is ``"name"`` or ``"name:key=value,key=value"``; the keys are the fields of the registered
dataclass, converted to the field's annotated type (``int`` — powers such as ``2^20`` allowed —,
``float`` — fractions such as ``1/32``, ``inf`` and ``nan`` read, to be rejected by a range —, ``bool``,
``str``, ``Literal[...]`` and optional variants). Adding a method is one class and one decorator.

Specs are strict: unknown names and keys raise ``ValueError`` listing what exists, and so do a key
given twice and an empty item (``"topk:ratio=0.1,,"``).

Parameter ranges are declared next to the field, in one place for every registry::

    ratio: float = param(0.01, "(0, 1]")
    rank: int = param(1, "[1, 1024]")
    clip: float | None = param(None, "(0, inf)")     # None is allowed besides the range

and checked centrally by :func:`check_params`: :meth:`Registry.make` calls it for every spec and
override, and ``Compressor.__post_init__`` (a feedback memory's own ``__post_init__``) through
:func:`check_params_of` for objects built directly. Messages read
``"topk:ratio must be in (0, 1], got 2.0"`` or ``"powersgd:rank must be an integer >= 1 and <= 1024,
got 1099511627776"``. A class keeps only checks that tie several fields together (CLT-k's
``per_chunk <= chunk``) in its ``__post_init__``. Every ``int`` and ``float`` parameter of a registered
compressor or feedback memory declares a range (tests/test_registry.py checks it, and that each
range rejects the values just outside it); ``bool`` and ``Literal`` parameters are checked by their
type.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import math
import numbers
import re
import types
import typing
from fractions import Fraction
from typing import Any, Callable, Generic, Iterable, TypeVar

T = TypeVar("T")

RANGE = "gradpress.range"  # the dataclass field metadata key of a parameter's declared range


class Registry(Generic[T]):
    """Name -> dataclass type, with spec parsing. A name may be declared with the module that registers
    it (:meth:`declare`): it is listed at once, and its module imported when the name is first looked up
    (so that importing gradpress imports no method's module, nor numba or scipy through them)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._types: dict[str, type[T]] = {}
        self._modules: dict[str, str] = {}  # declared names not registered yet -> their module

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def decorate(cls: type[T]) -> type[T]:
            if name in self._types:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            if not dataclasses.is_dataclass(cls):
                raise TypeError(f"{cls.__name__} must be a dataclass: its fields are the spec keys")
            cls.name = name  # type: ignore[attr-defined]
            self._types[name] = cls
            return cls

        return decorate

    def declare(self, modules: dict[str, str]) -> None:
        """Names (-> the module whose import registers each) listed by :meth:`names` and imported by
        :meth:`get` on first use."""
        self._modules.update(modules)

    def names(self) -> list[str]:
        return sorted({*self._types, *self._modules})

    def get(self, name: str) -> type[T]:
        cls = self._types.get(name)
        if cls is None and name in self._modules:
            module = self._modules[name]
            importlib.import_module(module)
            cls = self._types.get(name)
            if cls is None:
                raise RuntimeError(f"{self.kind} {name!r} is declared in {module}, "
                                   "which does not register it")
        if cls is None:
            raise ValueError(f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; "
                             f"known: {', '.join(self.names())}")
        return cls

    def make(self, spec: str, **overrides: Any) -> T:
        """The object ``spec`` names; ``overrides`` (Python values) replace the spec's keys of the same
        name. Every value is checked against its field's type and declared range before the class is
        built."""
        name, params = parse_spec(spec)
        cls = self.get(name)
        fields = spec_fields(cls)
        kwargs: dict[str, Any] = {}
        for key, value in {**params, **overrides}.items():
            if key not in fields:
                known = ", ".join(fields) or "none"
                raise ValueError(f"{self.kind} {name!r} has no parameter {key!r}{did_you_mean(key, fields)}; "
                                 f"its parameters: {known}")
            kwargs[key] = convert(value, fields[key], f"{name}:{key}") if isinstance(value, str) else value
        check_params(cls, kwargs, name)
        return cls(**kwargs)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``" (did you mean 'topk'?)"`` for the known name closest to a mistyped ``name`` (difflib's ratio
    of at least 0.6, as Python's own suggestions), ``""`` when none is close; a name with spaces that
    joins known names gets the list rule instead: ``" (lists are comma-separated: 'topk,qsgd')"``."""
    known = list(known)
    words = name.split()
    if len(words) > 1 and all(word.split(":")[0] in known for word in words):
        return f" (lists are comma-separated: {','.join(words)!r})"
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name:k=v,k2=v2"`` -> ``("name", {"k": "v", "k2": "v2"})``.

    Raises ``ValueError`` for an empty name, an item that is not ``key=value`` (an empty one included:
    ``"topk:ratio=0.1,,"``) and a key given twice (``"topk:ratio=0.1,ratio=0.2"``). ``"name:"`` is
    ``"name"``."""
    spec = spec.strip()
    name, colon, rest = spec.partition(":")
    if not name.strip():
        raise ValueError(f"empty name in spec {spec!r}")
    params: dict[str, str] = {}
    if colon and rest.strip():
        for item in (s.strip() for s in rest.split(",")):
            if not item:
                raise ValueError(f"spec {spec!r}: empty item (two commas in a row, or one at an end)")
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"spec {spec!r}: expected key=value, got {item!r}")
            if key in params:
                raise ValueError(f"spec {spec!r}: key {key!r} is given twice "
                                 f"({key}={params[key]} and {key}={value.strip()})")
            params[key] = value.strip()
    return name.strip(), params


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs whose own parameters are comma-separated too.

    A piece ``key=value`` without a name continues the spec before it:
    ``"topk:ratio=0.01,qsgd:levels=16,bucket=512,natural"`` ->
    ``["topk:ratio=0.01", "qsgd:levels=16,bucket=512", "natural"]``. An empty piece (two commas in a
    row, or one at an end) raises ``ValueError``, as in :func:`parse_spec`.
    """
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            raise ValueError(f"{text!r}: empty item (two commas in a row, or one at an end)")
        name_part = piece.split("+")[0]
        continues = "=" in name_part and ":" not in name_part
        if continues and not specs:
            raise ValueError(f"{text!r}: {piece!r} is a parameter without a compressor name before it")
        if continues:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def spec_fields(cls: type) -> dict[str, Any]:
    """Spec keys of a registered dataclass and their types (fields whose name starts with _ are not keys)."""
    return dict(_spec_fields(cls))


@functools.lru_cache(maxsize=None)
def _spec_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_"))


def format_spec(obj: Any) -> str:
    """The canonical spec of a registered object: its name and every parameter that differs from the default."""
    parts = []
    for f in dataclasses.fields(obj):
        if not f.init or f.name.startswith("_"):
            continue
        value = getattr(obj, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if value != default:
            parts.append(f"{f.name}={_format_value(value)}")
    return obj.name + (":" + ",".join(parts) if parts else "")


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# -- parameter ranges --------------------------------------------------------------------------------
_NUMBER = r"[-+]?(?:inf|\d+(?:\s*(?:\^|\*\*)\s*-?\d+)?(?:\.\d*)?(?:e[-+]?\d+)?(?:/\d+)?)"
_INTERVAL = re.compile(rf"^\s*([\[(])\s*({_NUMBER})\s*,\s*({_NUMBER})\s*([\])])\s*$", re.IGNORECASE)


def _bound(text: str) -> Fraction | float:
    """A range bound: an exact number (``2^-15``, ``1/32``, ``1e-3``, ``1024``) or ±inf."""
    text = text.strip().replace(" ", "")
    if text.lower().lstrip("+-") == "inf":
        return -math.inf if text.startswith("-") else math.inf
    power = re.match(r"^([-+]?\d+)(?:\^|\*\*)(-?\d+)$", text)
    if power:
        return Fraction(int(power[1])) ** int(power[2])
    return Fraction(text)


@dataclasses.dataclass(frozen=True)
class Range:
    """An interval of allowed values, written as in mathematics: ``"(0, 1]"``, ``"[1, 1024]"``,
    ``"[0, inf)"``, ``"[2^-15, 2^-7]"``. Bounds are exact (fractions), so ``2^-15`` is no rounded float;
    an infinite bound must be open, and NaN is in no range."""

    text: str
    low: Fraction | float
    high: Fraction | float
    low_open: bool
    high_open: bool

    @classmethod
    def parse(cls, text: str) -> Range:
        match = _INTERVAL.match(text)
        if not match:
            raise ValueError(f"range {text!r}: expected an interval such as '(0, 1]' or '[1, inf)'")
        low, high = _bound(match[2]), _bound(match[3])
        low_open, high_open = match[1] == "(", match[4] == ")"
        if (math.isinf(low) and not low_open) or (math.isinf(high) and not high_open):
            raise ValueError(f"range {text!r}: an infinite bound must be open")
        if not (low < high or (low == high and not low_open and not high_open)):
            raise ValueError(f"range {text!r} is empty")
        return cls(f"{match[1]}{match[2].strip()}, {match[3].strip()}{match[4]}", low, high, low_open, high_open)

    def __contains__(self, value: Any) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return bool(above and below)

    def describe(self, integer: bool = False) -> str:
        """``"in (0, 1]"``; for integers ``"an integer >= 1 and <= 1024"``."""
        if not integer:
            return f"in {self.text}"
        parts = []
        if not math.isinf(self.low):
            parts.append(f"{'>' if self.low_open else '>='} {_show(self.low)}")
        if not math.isinf(self.high):
            parts.append(f"{'<' if self.high_open else '<='} {_show(self.high)}")
        return "an integer " + " and ".join(parts) if parts else "an integer"

    def outside(self, integer: bool = False) -> list[Any]:
        """Values just outside the range, one beyond each bound (the bound itself when open; ±inf
        beyond an infinite bound of a float range), and NaN for a float range."""
        values: list[Any] = []
        for bound, is_open, step in ((self.low, self.low_open, -1), (self.high, self.high_open, +1)):
            if math.isinf(bound):
                if not integer:
                    values.append(float(bound))
                continue
            edge: float
            if integer:
                edge = math.floor(bound) if step < 0 else math.ceil(bound)
                edge = edge if edge not in self else edge + step
                values.append(int(edge))
            else:
                edge = float(bound)
                if is_open and edge == bound:
                    values.append(edge)
                else:  # the nearest float beyond the bound
                    while edge in self or (edge - bound) * step < 0:
                        edge = math.nextafter(edge, step * math.inf)
                    values.append(edge)
        if not integer:
            values.append(math.nan)
        return values


def _show(bound: Fraction | float) -> str:
    if isinstance(bound, Fraction) and bound.denominator == 1:
        return str(bound.numerator)
    return f"{float(bound):g}"


def param(default: Any, within: str | None = None, *, metadata: dict[str, Any] | None = None) -> Any:
    """A dataclass field for a spec parameter: its default and the range its values must lie in
    (``None``: only the type is checked, for ``bool``, ``Literal`` and ``str`` parameters)."""
    meta = dict(metadata or {})
    if within is not None:
        meta[RANGE] = Range.parse(within)
    return dataclasses.field(default=default, metadata=meta)


def param_range(cls: type, key: str) -> Range | None:
    """The range declared for parameter ``key`` of a registered dataclass (None if none)."""
    for f in dataclasses.fields(cls):
        if f.name == key:
            return f.metadata.get(RANGE)
    raise KeyError(key)


def check_params(cls: type, values: dict[str, Any], name: str) -> None:
    """Check ``values`` (spec key -> Python value) of ``cls`` against each field's type and declared
    range; raise ``ValueError`` naming ``name:key``, what is allowed and what was given."""
    fields = spec_fields(cls)
    for key, value in values.items():
        annotation = fields.get(key)
        if annotation is None:
            continue
        check_value(value, annotation, param_range(cls, key), f"{name}:{key}")


def check_params_of(obj: Any) -> None:
    """:func:`check_params` for every spec parameter of a registered object (built directly)."""
    cls = type(obj)
    try:
        fields = spec_fields(cls)
    except (NameError, TypeError):  # annotations that do not resolve here (a class of the user's): no spec keys
        return
    check_params(cls, {key: getattr(obj, key) for key in fields}, getattr(obj, "name", "") or cls.__name__)


def check_value(value: Any, annotation: Any, allowed: Range | None, where: str) -> None:
    """One parameter value against its annotation and range (see :func:`check_params`)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        optional = " or none" if type(None) in args else ""
        if len(inner) == 1:
            return _check_single(value, inner[0], allowed, where, optional)
        for candidate in inner:  # several types: the first that takes the value decides
            try:
                return _check_single(value, candidate, allowed, where, optional)
            except ValueError:
                continue
        raise ValueError(f"{where} must be one of {', '.join(map(_type_name, inner))}{optional}, got {value!r}")
    _check_single(value, annotation, allowed, where, "")


def _check_single(value: Any, annotation: Any, allowed: Range | None, where: str, optional: str) -> None:
    if typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
        if not any(value == choice and type(value) is type(choice) for choice in choices):
            raise ValueError(f"{where} must be one of {', '.join(map(str, choices))}{optional}, got {value!r}")
        return
    if annotation is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where} must be true or false{optional}, got {value!r}")
        return
    if annotation is int:
        described = allowed.describe(integer=True) if allowed else "an integer"
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
                allowed is not None and value not in allowed):
            raise ValueError(f"{where} must be {described}{optional}, got {value!r}")
        return
    if annotation is float:
        described = allowed.describe() if allowed else "a number"
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or (
                allowed is not None and value not in allowed):
            raise ValueError(f"{where} must be {described}{optional}, got {value!r}")
        return
    if annotation is str and not isinstance(value, str):
        raise ValueError(f"{where} must be a string{optional}, got {value!r}")


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


# -- spec text -> values -------------------------------------------------------------------------------
_POWER = re.compile(r"^(\d+)\s*(?:\^|\*\*)\s*(\d+)$")
_NON_FINITE = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "infinity": math.inf,
               "+infinity": math.inf, "-infinity": -math.inf, "nan": math.nan}


def convert(text: str, annotation: Any, where: str) -> Any:
    """Convert spec text to ``annotation``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if text.lower() == "none" and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for candidate in inner:
            try:
                return convert(text, candidate, where)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError("; ".join(errors))
    if origin is typing.Literal:
        for choice in args:
            if str(choice) == text:
                return choice
        raise ValueError(f"{where}: {text!r} is not one of {', '.join(map(str, args))}")
    try:
        if annotation is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if annotation is int:
            power = _POWER.match(text)
            return int(power[1]) ** int(power[2]) if power else int(text)
        if annotation is float:
            if text.strip().lower() in _NON_FINITE:  # read, so that the range check names the bound
                return _NON_FINITE[text.strip().lower()]
            return float(Fraction(text))
        if annotation is str:
            return text
    except (ValueError, ZeroDivisionError, OverflowError):
        raise ValueError(f"{where}: cannot read {text!r} as {annotation.__name__}") from None
    raise TypeError(f"{where}: unsupported parameter type {annotation!r}")
