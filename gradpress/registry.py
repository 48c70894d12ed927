"""Spec strings and registries: ``make("qsgd:levels=16,bucket=512")`` builds a compressor by name.

A spec is ``"name"`` or ``"name:key=value,key=value"``; the keys are the fields of the registered
dataclass, converted to the field's annotated type (``int``, ``float`` — fractions such as ``1/32``
allowed —, ``bool``, ``str``, ``Literal[...]`` and optional variants). Adding a method is one class and
one decorator. Unknown names and keys raise ``ValueError`` listing what exists.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from fractions import Fraction
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> dataclass type, with spec parsing."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._types: dict[str, type[T]] = {}

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

    def names(self) -> list[str]:
        return sorted(self._types)

    def get(self, name: str) -> type[T]:
        try:
            return self._types[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def make(self, spec: str, **overrides: Any) -> T:
        name, params = parse_spec(spec)
        cls = self.get(name)
        fields = spec_fields(cls)
        kwargs: dict[str, Any] = {}
        for key, value in {**params, **overrides}.items():
            if key not in fields:
                known = ", ".join(fields) or "none"
                raise ValueError(f"{self.kind} {name!r} has no parameter {key!r}; its parameters: {known}")
            kwargs[key] = convert(value, fields[key], f"{name}:{key}") if isinstance(value, str) else value
        return cls(**kwargs)


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"name:k=v,k2=v2"`` -> ``("name", {"k": "v", "k2": "v2"})``."""
    spec = spec.strip()
    name, _, rest = spec.partition(":")
    if not name:
        raise ValueError(f"empty name in spec {spec!r}")
    params: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"spec {spec!r}: expected key=value, got {item!r}")
        params[key.strip()] = value.strip()
    return name.strip(), params


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs whose own parameters are comma-separated too.

    A piece ``key=value`` without a name continues the spec before it:
    ``"topk:ratio=0.01,qsgd:levels=16,bucket=512,natural"`` ->
    ``["topk:ratio=0.01", "qsgd:levels=16,bucket=512", "natural"]``.
    """
    specs: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
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
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}


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


_POWER = re.compile(r"^(\d+)\s*(?:\^|\*\*)\s*(\d+)$")


def convert(text: str, annotation: Any, where: str) -> Any:
    """Convert spec text to ``annotation``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
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
            return float(Fraction(text))
        if annotation is str:
            return text
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{where}: cannot read {text!r} as {annotation.__name__}") from None
    raise TypeError(f"{where}: unsupported parameter type {annotation!r}")
