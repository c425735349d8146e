"""exporter/values.py: value classes compare and hash by their fields as frozen dataclasses do, stay immutable, and
the snapshot and settings types built with it behave as values (equal when their fields are); record classes
construct, compare and print as plain dataclasses do. Each is checked against the dataclass it replaces."""

from __future__ import annotations

import dataclasses

import pytest

from exporter.config import PodsSettings, load_settings
from exporter.snapshot import Allocation
from exporter.values import record_class, value_class


@value_class
class Point:
    x: int
    y: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Reference:
    x: int
    y: tuple[int, ...] = ()


def test_equality_and_hash_are_those_of_a_frozen_dataclass():
    assert Point(1, (2,)) == Point(1, (2,)) and Point(1) != Point(2)
    assert hash(Point(1, (2,))) == hash(Reference(1, (2,)))
    assert len({Point(1), Point(1), Point(2)}) == 2
    assert Point(1).__eq__(Reference(1)) is NotImplemented and Point(1) != Reference(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Point(1).x = 2  # type: ignore[misc]
    assert repr(Point(1)) == "Point(x=1, y=())"


def test_settings_and_snapshot_types_are_values():
    assert load_settings(None, environ={}) == load_settings(None, environ={})
    assert PodsSettings() == PodsSettings() and PodsSettings(refresh_interval=5) != PodsSettings()
    fields = {field.name: "x" for field in dataclasses.fields(Allocation)}
    assert Allocation(**fields) == Allocation(**fields) and hash(Allocation(**fields)) == hash(Allocation(**fields))


@record_class
class Record:
    name: str
    count: int = 0
    seen: list[int] = dataclasses.field(default_factory=list)
    hidden: str = dataclasses.field(default="h", repr=False)
    derived: int = dataclasses.field(init=False, default=0)
    limit: float = dataclasses.field(default=1.0, kw_only=True)

    def __post_init__(self) -> None:
        self.derived = self.count * 2


@dataclasses.dataclass
class RecordReference:
    name: str
    count: int = 0
    seen: list[int] = dataclasses.field(default_factory=list)
    hidden: str = dataclasses.field(default="h", repr=False)
    derived: int = dataclasses.field(init=False, default=0)
    limit: float = dataclasses.field(default=1.0, kw_only=True)

    def __post_init__(self) -> None:
        self.derived = self.count * 2


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [(("a",), {}), (("a", 3), {}), (("a",), {"seen": [1], "limit": 2.0}), ((), {"name": "b", "hidden": "x"})],
)
def test_record_class_constructs_and_prints_as_a_dataclass(args, kwargs):
    made, reference = Record(*args, **kwargs), RecordReference(*args, **kwargs)
    assert dataclasses.asdict(made) == dataclasses.asdict(reference)
    assert repr(made).replace("Record", "RecordReference", 1) == repr(reference)
    assert made == Record(*args, **kwargs) and made != Record("other")
    made.count = 7  # mutable
    assert made.count == 7 and Record.__hash__ is None


def test_record_class_rejects_what_a_dataclass_rejects():
    for bad in (lambda: Record(), lambda: Record("a", 1, [], "h", 2.0), lambda: Record("a", derived=1)):
        with pytest.raises(TypeError):
            bad()
    assert Record("a").seen is not Record("a").seen  # one factory call per instance


def test_value_class_frozen_replace_and_unsupported_fields():
    point = Point(1, (2,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        del point.x
    with pytest.raises(dataclasses.FrozenInstanceError):
        point.z = 3  # type: ignore[attr-defined]
    assert dataclasses.replace(point, x=5) == Point(5, (2,)) and point == Point(1, (2,))
    assert dataclasses.is_dataclass(Point) and [f.name for f in dataclasses.fields(Point)] == ["x", "y"]
    with pytest.raises(TypeError, match="compare=False"):

        @value_class
        class Partial:
            x: int = dataclasses.field(default=0, compare=False)


def test_fields_named_like_the_generated_code_s_locals():
    @value_class
    class Odd:
        self: int
        d: str = "x"

    assert Odd(1, "y").self == 1 and Odd(1, "y").d == "y" and Odd(self=2).d == "x"
