"""The alert rules' model, from the thresholds: every rule's expression, severity, action and words.

One definition of every threshold and duration (exporter/gpuwarden/health/thresholds.py) feeds both these rules and
the exporter's health gauges; each rule declares the fields it reads and the verdict it mirrors (rules_model.py).
The fleet service evaluates the cordon rules' expressions from here; the rule file is written by a development tool
outside the package (`python alert_rules/generate.py`), and tests/test_alert_rules.py fails when the committed file
differs from its output.
Severity: critical pages, warning opens a ticket, info is for dashboards (docs/alerting.md, Severities).
"""

from __future__ import annotations

from gpuwarden.health import rules_hardware, rules_model, rules_service
from gpuwarden.health.rules_model import *  # noqa: F403 - the model's names, re-exported for the rules' readers
from gpuwarden.health.rules_model import SELECTOR, Group
from gpuwarden.health.thresholds import DEFAULT, Thresholds

__all__ = [*rules_model.__all__, "build"]  # noqa: PLE0604 - the model's list, read at import


def build(t: Thresholds = DEFAULT, selector: str = SELECTOR) -> list[Group]:
    """Every group, in the rule file's order."""
    s = selector
    return [
        rules_service.exporter(t, s),
        rules_hardware.availability(t, s),
        rules_hardware.memory_health(t, s),
        rules_hardware.thermal_critical(t, s),
        rules_hardware.thermal_power(t, s),
        rules_hardware.thermal_page(t, s),
        rules_service.capacity(t, s),
        rules_hardware.interconnect(t, s),
        rules_hardware.fabric_faults(t, s),
        rules_service.jobs(t, s),
        rules_service.sustained(t, s),
        rules_service.sustained_long(t, s),
        rules_service.history(t, s),
        rules_service.configuration(t, s),
    ]
