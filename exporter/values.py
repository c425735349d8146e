"""`value_class` and `record_class`: dataclasses whose shared methods are written once here instead of generated and
compiled for every class.

Why: the serving process defines ~45 dataclasses at import, and `dataclasses.dataclass` compiles up to four methods
for each (`__init__`, `__repr__`, `__eq__`, and for frozen ones `__setattr__` and `__delattr__`): a quarter of the
exporter's own import time, on the path to its first metrics (docs/benchmarks.md, Footprint). Here only `__init__`
is compiled per class, from a short source that fills the instance's `__dict__`; equality, hashing, repr and
immutability are shared functions over the fields, which a class without slots keeps in `__dict__` in declaration
order. The classes stay dataclasses (`dataclasses.fields`, `replace`, `asdict` and `is_dataclass` work).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_HAS_FACTORY = object()  # the parameter default of a field with a default_factory: "not given, call the factory"


def _eq(self: Any, other: Any) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return self.__dict__ == other.__dict__


def _hash(self: Any) -> int:
    return hash(tuple(self.__dict__.values()))


def _repr(self: Any) -> str:
    shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__class__.__value_repr__)
    return f"{self.__class__.__qualname__}({shown})"


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


def _init_source(cls: type) -> tuple[str, dict[str, Any]]:
    """The source of `cls.__init__` and the names it refers to: parameters in dataclass order (keyword-only ones
    after `*`), every field written to `__dict__` directly (so a frozen class needs no object.__setattr__)."""
    fields = dataclasses.fields(cls)
    pseudo = set(cls.__dataclass_fields__) - {field.name for field in fields}  # ClassVar and InitVar
    if any("InitVar" in str(cls.__dataclass_fields__[name].type) for name in pseudo):
        raise TypeError(f"{cls.__qualname__}: InitVar fields are not supported by exporter.values")
    if any(not field.compare or field.hash is not None for field in fields):
        raise TypeError(f"{cls.__qualname__}: compare=False and hash= fields are not supported by exporter.values")
    names: dict[str, Any] = {"_HAS_FACTORY": _HAS_FACTORY}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
    for index, field in enumerate(fields):
        has_factory = field.default_factory is not dataclasses.MISSING
        if has_factory:
            names[f"_factory{index}"] = field.default_factory
            fallback: str | None = f"_factory{index}()"  # what the field holds when not given
        elif field.default is not dataclasses.MISSING:
            names[f"_default{index}"] = field.default
            fallback = f"_default{index}"
        else:
            fallback = None
        if field.init:
            default = "=_HAS_FACTORY" if has_factory else (f"={fallback}" if fallback else "")
            (keyword if field.kw_only else positional).append(f"{field.name}{default}")
            value = f"{fallback} if {field.name} is _HAS_FACTORY else {field.name}" if has_factory else field.name
        elif fallback is None:
            continue  # neither given nor defaulted: left unset, as dataclasses leave it
        else:
            value = fallback
        body.append(f" __value_dict__[{field.name!r}] = {value}")
    if hasattr(cls, "__post_init__"):
        body.append(" __value_self__.__post_init__()")
    # the instance and its __dict__ under names no field can have (a field may be called `self` or `d`)
    parameters = ", ".join(["__value_self__", *positional, *(["*", *keyword] if keyword else [])])
    head = f"def __init__({parameters}):\n __value_dict__ = __value_self__.__dict__\n"
    return head + "\n".join(body) + "\n", names


def _build(cls: type[T], frozen: bool) -> type[T]:
    made = dataclasses.dataclass(init=False, repr=False, eq=False)(cls)  # fields only: nothing compiled
    source, names = _init_source(made)
    exec(source, names)  # noqa: S102 - our own source, built from the class's field names as dataclasses does
    init = names["__init__"]
    init.__qualname__ = f"{made.__qualname__}.__init__"
    made.__init__ = init  # type: ignore[misc]
    made.__value_repr__ = tuple(field.name for field in dataclasses.fields(made) if field.repr)  # type: ignore[attr-defined]
    made.__repr__ = _repr  # type: ignore[method-assign,assignment]
    made.__eq__ = _eq  # type: ignore[method-assign,assignment]
    if frozen:
        made.__hash__ = _hash  # type: ignore[method-assign,assignment]
        made.__setattr__ = _frozen_setattr  # type: ignore[method-assign,assignment]
        made.__delattr__ = _frozen_delattr  # type: ignore[method-assign,assignment]
    else:
        made.__hash__ = None  # type: ignore[assignment] - mutable and compared by value: unhashable, as dataclasses
    return made


def value_class(cls: type[T]) -> type[T]:
    """`@dataclass(frozen=True)`: immutable, equal and hashed by its field values."""
    return _build(cls, frozen=True)


def record_class(cls: type[T]) -> type[T]:
    """`@dataclass`: mutable, equal by its field values, unhashable."""
    return _build(cls, frozen=False)
