"""`value_class`: a frozen dataclass whose equality and hash come from its field values, as `dataclass(frozen=True)`
gives, without generating and compiling an `__eq__` and a `__hash__` for every class.

Why: the serving process defines ~40 frozen dataclasses at import, and the two generated methods were about half
of their creation cost (~15 ms of the exporter's ~200 ms to its first metrics on the GPU host, docs/benchmarks.md,
Footprint). Here every value class shares one `__eq__` and one `__hash__` over the instance's fields, which a
frozen dataclass without slots keeps in `__dict__` in declaration order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def _eq(self: Any, other: Any) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented
    return self.__dict__ == other.__dict__


def _hash(self: Any) -> int:
    return hash(tuple(self.__dict__.values()))


def value_class(cls: type[T]) -> type[T]:
    """`@dataclass(frozen=True)` with value equality and hashing shared across classes."""
    made = dataclasses.dataclass(frozen=True, eq=False)(cls)
    made.__eq__ = _eq  # type: ignore[method-assign,assignment]
    made.__hash__ = _hash  # type: ignore[method-assign,assignment]
    return made
