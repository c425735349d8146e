"""exporter/values.py: value classes compare and hash by their fields as frozen dataclasses do, stay immutable, and
the snapshot and settings types built with it behave as values (equal when their fields are)."""

from __future__ import annotations

import dataclasses

import pytest

from exporter.config import PodsSettings, load_settings
from exporter.snapshot import Allocation
from exporter.values import value_class


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
