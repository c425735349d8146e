"""Frozen-dataclass settings built from plain data (YAML, environment, flags), checked field by field.

Why not pydantic here: the exporter's settings and health thresholds are read by every node's serving process at
start, and pydantic with these models cost 9.6 MiB of resident memory and ~200 ms of start-up (docs/benchmarks.md,
Footprint) for ~90 scalar fields with bounds. This module knows exactly the types those fields use — bool, int,
float, str, Path, Literal choices, one type or None (`X | None`), tuples, mappings and nested sections — and says
what is wrong in the words the rest of the configuration uses ("Input should be ..."). The exporter's settings, the
health thresholds, the web-config file and the fleet service's settings (fleet/settings.py) are built here; models
with richer shapes (simulator scenarios, the JSON API) stay on pydantic, loaded only where used. A union of several
types is refused when a field declares it: which member a string from the environment means would be a guess.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


class SettingError(ValueError):
    """One field's problem: where (the keys leading to it), what is wrong, and the input (when it is a value)."""

    def __init__(self, loc: tuple[str, ...], message: str, value: Any = None, unknown: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.loc, self.message, self.value, self.unknown_allowed = loc, message, value, unknown

    def line(self, source: str) -> str:
        """The error as one line, prefixed by where the value came from."""
        key = ".".join(self.loc)
        if self.unknown_allowed:
            return f"{source}: unknown key '{key}'; allowed here: {', '.join(self.unknown_allowed)}"
        if not self.loc:
            return f"{source}: {self.message}"
        return f"{source}: {key}: {self.reason()}"

    def reason(self) -> str:
        """What is wrong and the input, without where: for a caller that names the field its own way (a flag)."""
        shown = "" if self.value is None or isinstance(self.value, Mapping) else f" (got {self.value!r})"
        return f"{self.message}{shown}"


def setting(
    default: Any = dataclasses.MISSING,
    description: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    check: Callable[[Any], Any] | None = None,
) -> Any:
    """A field with its description, bounds and an optional check (returns the value to keep, or raises
    ValueError with the message to show)."""
    bounds = {name: bound for name, bound in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if bound is not None}
    metadata = {"description": description, "bounds": bounds, "check": check}
    if dataclasses.is_dataclass(default):
        return dataclasses.field(default_factory=lambda: default, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def hints(cls: type) -> dict[str, Any]:
    """The resolved field types of a settings class (cached: resolving them is the slow part); TypeError for a
    union of several types (a bug in the model, not bad input: `int | str` from an environment string is a guess)."""
    cached = cls.__dict__.get("__resolved_hints__")
    if cached is None:
        cached = typing.get_type_hints(cls)
        for name, annotation in cached.items():
            if typing.get_origin(annotation) in (types.UnionType, typing.Union):
                members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
                if len(members) != 1:
                    raise TypeError(f"{cls.__name__}.{name}: a setting is one type or None, not {annotation!r}")
        cls.__resolved_hints__ = cached  # type: ignore[attr-defined]
    return cached


def fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """Each field of `cls` with its resolved type, in declaration order."""
    resolved = hints(cls)
    return [(field, resolved[field.name]) for field in dataclasses.fields(cls)]


def choices(annotation: Any) -> tuple[Any, ...]:
    """The allowed values of a Literal field, else ()."""
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else ()


def is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is tuple


def build(cls: type, data: Any, loc: tuple[str, ...] = ()) -> Any:
    """An instance of the dataclass `cls` from a mapping; SettingError on the first problem.

    Unknown keys are refused (naming the allowed ones); a class's `validate()` runs last, for checks across fields.
    """
    if not isinstance(data, Mapping):
        raise SettingError(loc, "Input should be a mapping of keys", data)
    known = [field.name for field in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise SettingError((*loc, str(key)), "unknown key", unknown=tuple(known))
    values = {}
    for field, annotation in fields(cls):
        if field.name in data:
            values[field.name] = _field_value(field, annotation, data[field.name], (*loc, field.name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SettingError((*loc, field.name), "Field required")
    instance = cls(**values)
    validate = getattr(instance, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as exc:
            raise SettingError(loc, str(exc)) from None
    return instance


def _field_value(field: dataclasses.Field[Any], annotation: Any, raw: Any, loc: tuple[str, ...]) -> Any:
    value = convert(annotation, raw, loc)
    for name, bound in field.metadata.get("bounds", {}).items():
        if not _within(name, value, bound):
            shown = f"{bound:g}" if isinstance(bound, float) else str(bound)  # 1073741824, not 1.07374e+09
            raise SettingError(loc, f"Input should be {_BOUND_WORDS[name]} {shown}", raw)
    check = field.metadata.get("check")
    if check is not None:
        try:
            value = check(value)
        except ValueError as exc:
            raise SettingError(loc, str(exc), raw) from None
    return value


_BOUND_WORDS = {
    "ge": "greater than or equal to",
    "gt": "greater than",
    "le": "less than or equal to",
    "lt": "less than",
}


def _within(name: str, value: float, bound: float) -> bool:
    return {"ge": value >= bound, "gt": value > bound, "le": value <= bound, "lt": value < bound}[name]


def convert(annotation: Any, raw: Any, loc: tuple[str, ...]) -> Any:
    """`raw` as the type `annotation` names, accepting the strings environment variables and flags give."""
    origin = typing.get_origin(annotation)
    if origin is types.UnionType or origin is typing.Union:
        options = [arg for arg in typing.get_args(annotation) if arg is not type(None)]  # one: fields() checked
        if raw is None:
            return None
        return convert(options[0], raw, loc)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if raw not in allowed:
            words = " or ".join(repr(choice) for choice in allowed)
            raise SettingError(loc, f"Input should be {words}", raw)
        return raw
    if origin is tuple:
        item_type = typing.get_args(annotation)[0]
        items = [part.strip() for part in raw.split(",") if part.strip()] if isinstance(raw, str) else raw
        if not isinstance(items, list | tuple):
            raise SettingError(loc, "Input should be a list", raw)
        return tuple(convert(item_type, item, (*loc, str(index))) for index, item in enumerate(items))
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        if not isinstance(raw, Mapping):
            raise SettingError(loc, "Input should be a mapping", raw)
        return {convert(key_type, key, loc): convert(value_type, value, (*loc, str(key))) for key, value in raw.items()}
    if dataclasses.is_dataclass(annotation):
        return build(annotation, raw, loc)
    scalar = _SCALARS.get(annotation)
    if scalar is None:  # a settings class declared a type this module does not know: a bug, not bad input
        raise TypeError(f"{'.'.join(loc)}: unsupported settings type {annotation!r}")
    return scalar(raw, loc)


def _bool(raw: Any, loc: tuple[str, ...]) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise SettingError(loc, "Input should be a valid boolean (true or false)", raw)


def _int(raw: Any, loc: tuple[str, ...]) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            pass
    raise SettingError(loc, "Input should be a valid integer", raw)


def _float(raw: Any, loc: tuple[str, ...]) -> float:
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise SettingError(loc, "Input should be a valid number", raw) from None
    else:
        raise SettingError(loc, "Input should be a valid number", raw)
    if value != value or value in (float("inf"), float("-inf")):
        raise SettingError(loc, "Input should be a finite number", raw)
    return value


def _str(raw: Any, loc: tuple[str, ...]) -> str:
    if isinstance(raw, str):
        return raw
    raise SettingError(loc, "Input should be a valid string", raw)


def _path(raw: Any, loc: tuple[str, ...]) -> Path:
    if isinstance(raw, Path):
        return raw
    if isinstance(raw, str) and raw and "\x00" not in raw:
        return Path(raw)
    raise SettingError(loc, "Input should be a valid path", raw)


_SCALARS: dict[Any, Callable[[Any, tuple[str, ...]], Any]] = {
    bool: _bool,
    int: _int,
    float: _float,
    str: _str,
    Path: _path,
}


def as_dict(instance: Any) -> dict[str, Any]:
    """Plain nested dict of a settings instance (to compare two configurations)."""
    return dataclasses.asdict(instance)
