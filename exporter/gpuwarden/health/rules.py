"""The alert rules' model, from the thresholds: every rule's expression, severity, action and words.

One definition of every threshold and duration (exporter/gpuwarden/health/thresholds.toml) feeds both these rules and
the exporter's health gauges; each rule declares the fields it reads and the verdict it mirrors. The declarations
and words are data (health/alerts.toml), the expressions logic (rules_hardware.py, rules_service.py), joined into
rules by rules_model.py. The fleet service evaluates the cordon rules' expressions from here; the rule file is
written by a development tool outside the package (`python alert_rules/generate.py`), and tests/test_alert_rules.py
fails when the committed file differs from its output.
Severity: critical pages, warning opens a ticket, info is for dashboards (docs/alerting.md, Severities).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuwarden.health import rules_hardware, rules_model, rules_service
from gpuwarden.health.rules_model import *  # noqa: F403 - the model's names, re-exported for the rules' readers
from gpuwarden.health.rules_model import SELECTOR, DeclarationError, Group, declarations
from gpuwarden.health.thresholds import DEFAULT, Thresholds

__all__ = [*rules_model.__all__, "GROUPS", "build"]  # noqa: PLE0604 - the model's list, read at import


# every group, in the rule file's order
GROUPS = (
    rules_service.exporter, rules_hardware.availability, rules_hardware.memory_health, rules_hardware.thermal_critical,
    rules_hardware.thermal_power, rules_hardware.thermal_page, rules_service.capacity, rules_hardware.interconnect,
    rules_hardware.fabric_faults, rules_service.jobs, rules_service.sustained,
    rules_service.history, rules_service.configuration
)  # fmt: skip


def build(
    t: Thresholds = DEFAULT, selector: str = SELECTOR, alerts: Mapping[str, dict[str, Any]] | None = None
) -> list[Group]:
    """Every group, in the rule file's order; `alerts`: the alerts' declarations (default alerts.toml's).
    DeclarationError where an alert is declared and has no expression, or the other way round."""
    tables = declarations() if alerts is None else alerts
    groups = [builder(t, selector, tables) for builder in GROUPS]
    built = {rule.alert for g in groups for rule in g.rules}
    unbuilt = [name for name in tables if name not in built]
    if unbuilt:
        raise DeclarationError(f"alerts.toml: {unbuilt[0]}: declared, but no rule group has its expression")
    return groups
