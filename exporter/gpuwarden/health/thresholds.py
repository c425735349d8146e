"""Every health threshold, defined once (thresholds.toml: each field's type, default, bounds and description).

The exporter's health gauges (exporter/gpuwarden/health/checks.py) and the Prometheus alert rules
(exporter/gpuwarden/health/rules.py → alert_rules/gpuwarden.rules.yaml) are both derived from this model;
tests/test_alert_rules.py fails when the committed rules drift from it. Operators override values with a YAML file
(`health.thresholds_file`); unknown keys or out-of-range values are rejected with one line, like the rest of the
configuration.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from gpuwarden.config.settings import ConfigError, read_yaml
from gpuwarden.config.typed import SettingError, build, setting

FIELDS_FILE = Path(__file__).with_name("thresholds.toml")
_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str, "list of int": tuple[int, ...]}


def _declared() -> list[tuple[str, Any, Any]]:
    """Each field of thresholds.toml as make_dataclass takes it: name, type, setting() (default, description,
    bounds). The defaults keep the file's own numbers (83, not 83.0: as written, so as rendered)."""
    with FIELDS_FILE.open("rb") as file:
        tables = tomllib.load(file)
    declared = []
    for name, table in tables.items():
        annotation = _TYPES.get(table["type"])
        if annotation is None:  # the file ships with the package: a development error, not an operator's
            raise TypeError(f"thresholds.toml: {name}: type {table['type']!r} is none of {', '.join(_TYPES)}")
        default = tuple(table["default"]) if isinstance(table["default"], list) else table["default"]
        declared.append((name, annotation, setting(default, table["description"], **table.get("bounds", {}))))
    return declared


def _validate(self: Any) -> None:
    """Checks across fields (typedconfig.build runs it last)."""
    if self.temperature_critical_celsius <= self.temperature_warning_celsius:
        raise ValueError("temperature_critical_celsius must be above temperature_warning_celsius")
    if self.memory_critical_ratio <= self.memory_warning_ratio:
        raise ValueError("memory_critical_ratio must be above memory_warning_ratio")
    lists = [set(self.xid_critical), set(self.xid_warning), set(self.xid_info)]
    if lists[0] & lists[1] or lists[0] & lists[2] or lists[1] & lists[2]:
        raise ValueError("xid_critical, xid_warning and xid_info must not share an XID")
    if self.xid_critical_for_s and self.xid_critical_for_s <= self.gpu_lost_for_s:
        raise ValueError(
            "xid_critical_for_s must be above gpu_lost_for_s (or 0), so that a GPU that falls off the bus pages "
            "once, as lost"
        )
    if self.xid_critical_for_s >= self.xid_window_s:
        raise ValueError("xid_critical_for_s must be below xid_window_s, or a critical XID never pages")


# Every health threshold and duration, with its default, bounds and description (thresholds.toml); operators
# override them by file. A frozen dataclass as the settings' others (config/typed.py builds and checks it).
Thresholds = dataclasses.make_dataclass(
    "Thresholds",
    _declared(),
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "Every health threshold and duration, with its default; operators override them by file.",
        "validate": _validate,
    },
)

DEFAULT = Thresholds()


def load_thresholds(path: Path | None, flag: str = "health.thresholds_file") -> Thresholds:
    """Defaults, overridden by a YAML mapping of the fields (thresholds.toml); ConfigError (one line, naming `flag`)
    on a bad file."""
    if path is None:
        return DEFAULT
    try:
        return build(Thresholds, read_yaml(path, "thresholds file", flag))
    except SettingError as exc:
        raise ConfigError(exc.line(f"thresholds file {path}")) from None
