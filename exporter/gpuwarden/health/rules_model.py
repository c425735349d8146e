"""The alert rules' building blocks: a rule as named data (what it reads of the thresholds, which verdict it mirrors),
and the PromQL shapes the rules share (a page held across exporter restarts, the `node` label everywhere).

A rule is its table in alerts.toml (severity, action, verdict, the thresholds it reads, its words) joined with its
expression from rules_hardware.py or rules_service.py (declared, below); health/rules.py assembles the groups.
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden.health.thresholds import Thresholds

# what health/rules.py re-exports to the rules' readers (the generator, the fleet, the tests)
__all__ = [
    "GPU",
    "HISTORY_GROUP",
    "HISTORY_INTERVAL_S",
    "HISTORY_WINDOW",
    "NODE",
    "NODE_GPUS_MAX",
    "NVLINK_ACTIVE_DAY_MAX",
    "NVLINK_ACTIVE_MAX",
    "RUNBOOK_BASE",
    "SELECTOR",
    "SUSTAINED_GROUP",
    "LONG_INTERVAL_S",
    "STEADY_INTERVAL_S",
    "SUSTAINED_INTERVAL_S",
    "Group",
    "Record",
    "Rule",
    "DeclarationError",
    "Query",
    "Queries",
    "declarations",
    "declared",
    "anchor",
    "condition_interval",
    "duration",
    "group",
    "held",
    "nodeish",
    "nodeish_over",
    "xid_regex",
]

RUNBOOK_BASE = "https://github.com/gpuwarden/gpuwarden/blob/main/docs/runbooks.md"
SELECTOR = 'job="gpuwarden"'

# The day-long windows read recorded maxima, not raw samples: at 10,000 nodes the raw [1d] of every GPU's active
# NVLinks was 461 M samples an evaluation, and every node's GPU count over [24h] 58 M (issue 38,
# docs/benchmarks.md, Rules). Each record keeps the most seen over HISTORY_WINDOW, written every
# HISTORY_INTERVAL_S: consecutive windows overlap, so no sample falls between two records, and an alert over the
# records sees the day as the raw series did, up to one interval late at its newest end and HISTORY_WINDOW longer
# at its oldest.
HISTORY_GROUP = "gpuwarden-history"
HISTORY_INTERVAL_S = 600
HISTORY_WINDOW = "15m"
NVLINK_ACTIVE_MAX = "gpuwarden:gpu_nvlink_active_links:max15m"
NODE_GPUS_MAX = "gpuwarden:node_gpus:max15m"
# The most active NVLinks over the last day, from the records above, written by the same group: NvlinkDown, which
# runs every minute, reads one or two of these instead of a day of records across every block Prometheus keeps
# (a day is several compacted blocks and the head: at 10,000 nodes the day's records were the costliest read of
# the rule manager, docs/benchmarks.md, Rules). It holds a day less one interval, and NvlinkDown reads the last
# interval of it (exactly one record, whatever the groups' offsets): the day ends where the records' [1d] did.
NVLINK_ACTIVE_DAY_MAX = "gpuwarden:gpu_nvlink_active_links:max1d"
# Tickets and information over windows of 15-30 minutes need no evaluation every minute: a fault they report lasts
# the window, so one evaluation in 5 minutes sees it (up to 5 minutes later than a minute's would).
SUSTAINED_GROUP = "gpuwarden-sustained"
SUSTAINED_INTERVAL_S = 300
# The longest tier: tickets whose conditions last 10 minutes or more (condition_interval: a ticket's condition holds
# one evaluation, a page's two) are evaluated every 10 minutes.
LONG_INTERVAL_S = 600
# Alerts whose conditions must hold 5 minutes (heat, throttling, NVLink, fabric set-up) are evaluated every 2: three
# evaluations fall in the condition, and the page comes at most a minute later than a minute's evaluation would
# bring it. At 10,000 nodes each evaluation of one of them selects 80,000 series: the every-minute groups were most
# of the rule manager's CPU (issue 51, docs/benchmarks.md, Rules). A threshold tuned shorter than two intervals
# puts its group back on the server's interval (condition_interval).
STEADY_INTERVAL_S = 120

# Pages name the node: the `node` label where the scrape config adds it (the chart does; `instance` is then a pod
# IP), else the instance.
NODE = "{{ with $labels.node }}{{ . }}{{ else }}{{ $labels.instance }}{{ end }}"
GPU = f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) on {NODE}"
_NAMES = {"GPU": GPU, "NODE": NODE}  # what an alert's words call them (alerts.toml)


@dataclass(frozen=True)
class Rule:
    """One alert, with what it reads of the thresholds declared: the generator's threshold map (which the chart
    reads), the docs and the generated tests read these declarations, and a test moves every field to prove them."""

    alert: str
    expr: str
    severity: str
    summary: str
    description: str
    for_s: int = 0
    action: str | None = None  # cordon, reset_gpu, reboot, rma: for automation on the receiving side
    keep_firing_s: int = 0  # `keep_firing_for`: how long it holds with no reading (see `held`)
    # what makes the node a cordon candidate (the fleet view), where that outlasts the page: default `expr`
    finding_expr: str | None = None
    threshold: str | None = None  # the Thresholds field whose value the expression ends on
    for_field: str | None = None  # the Thresholds field `for:` is
    keep_firing_field: str | None = None  # the Thresholds field `keep_firing_for` is
    reads: tuple[str, ...] = ()  # fields that shape the expression otherwise (windows, lists, sums of fields)
    verdict: str | None = None  # the exporter's check (health/checks.py) whose verdict this alert mirrors

    @property
    def finding(self) -> str:
        return self.finding_expr or self.expr


@dataclass(frozen=True)
class Query:
    """An alert's expression, with the cordon finding's where that outlasts the page (the fleet view's)."""

    expr: str
    finding: str | None = None


# what a group function returns for its alerts: each alert's expression (or Query) by name
Queries = dict[str, str | Query]

ALERTS_FILE = Path(__file__).with_name("alerts.toml")
# an alert's table in alerts.toml: what each key means is said at the top of that file
_KEYS = {"severity", "action", "verdict", "threshold", "for", "keep_firing", "reads", "summary", "description"}
# {field} or {field|duration} in an alert's words, not Prometheus' own {{ ... }}
_PLACEHOLDER = re.compile(r"(?<!\{)\{([A-Za-z_][A-Za-z0-9_]*)(\|duration)?\}(?!\})")


class DeclarationError(ValueError):
    """alerts.toml and the rules' expressions disagree (a development error: the file ships with the package)."""


@functools.cache
def declarations() -> dict[str, dict[str, Any]]:
    """The alerts' tables of alerts.toml by name, in the file's order."""
    with ALERTS_FILE.open("rb") as file:
        return tomllib.load(file)


def declared(t: Thresholds, name: str, table: dict[str, Any], query: str | Query) -> Rule:
    """A Rule from its table in alerts.toml and its expression: `threshold` names the field whose value is appended
    to the expression (which ends on its comparison), `for` and `keep_firing` a field or seconds; the words' fields
    are the thresholds'. The rendered numbers are then the declared fields' by construction."""
    unknown = sorted(set(table) - _KEYS)
    if unknown:
        raise DeclarationError(f"alerts.toml: {name}: unknown key {unknown[0]!r}; allowed: {', '.join(sorted(_KEYS))}")
    page = table["severity"] == "page"
    query = query if isinstance(query, Query) else Query(query)
    expr, threshold = query.expr, table.get("threshold")
    if threshold is not None:
        expr = f"{expr} {_field(t, name, threshold):g}"
    for_ = table.get("for", 0)
    keep_firing = table.get("keep_firing", "page_hold_s" if page else 0)
    for field_name in table.get("reads", ()):
        _field(t, name, field_name)
    return Rule(
        alert=name,
        expr=expr,
        severity="critical" if page else table["severity"],
        summary=_words(t, name, table["summary"]),
        description=_words(t, name, table["description"]),
        for_s=_seconds(t, name, for_),
        action=table.get("action"),
        keep_firing_s=_seconds(t, name, keep_firing),
        finding_expr=query.finding,
        threshold=threshold,
        for_field=for_ if isinstance(for_, str) else None,
        keep_firing_field=keep_firing if isinstance(keep_firing, str) else None,
        reads=tuple(table.get("reads", ())),
        verdict=table.get("verdict"),
    )


def _field(t: Thresholds, alert_name: str, field_name: str) -> Any:
    if not hasattr(t, field_name):
        raise DeclarationError(f"alerts.toml: {alert_name}: no threshold named {field_name!r}")
    return getattr(t, field_name)


def _seconds(t: Thresholds, alert_name: str, declared_s: str | int | list[str | int]) -> int:
    """Seconds from a field's name, a number, or a list of both (summed)."""
    if isinstance(declared_s, list):
        return sum(_seconds(t, alert_name, part) for part in declared_s)
    return _field(t, alert_name, declared_s) if isinstance(declared_s, str) else declared_s


def _words(t: Thresholds, alert_name: str, template: str) -> str:
    """An annotation from its template: {GPU}, {NODE}, {field} (its value, `:g`), {field|duration}."""

    def value(placeholder: re.Match[str]) -> str:
        word, as_duration = placeholder.group(1), placeholder.group(2)
        if word in _NAMES and not as_duration:
            return _NAMES[word]
        if not hasattr(t, word):
            raise DeclarationError(
                f"alerts.toml: {alert_name}: unknown placeholder {placeholder.group(0)}; use {{GPU}}, {{NODE}}, "
                "{field} or {field|duration} with a Thresholds field, and {{ ... }} for Prometheus' own"
            )
        return duration(getattr(t, word)) if as_duration else f"{getattr(t, word):g}"

    return _PLACEHOLDER.sub(value, template)


@dataclass(frozen=True)
class Record:
    """A recording rule that an alert reads instead of a day of raw samples."""

    record: str
    expr: str


@dataclass
class Group:
    name: str
    rules: list[Rule] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    interval_s: int | None = None  # None: the Prometheus server's global evaluation interval


def condition_interval(*condition_s: int, pages: bool = True) -> int | None:
    """The longest of the tiers (10, 5 and 2 minutes) of which the shortest of a group's conditions (windows and
    `for:`) holds two evaluations where the group pages, one where it only opens tickets or informs (a ticket up to
    an interval later is worked the same; a page is not), else None, the server's interval: a threshold tuned
    shorter is evaluated as often as the other alerts."""
    shortest = min(condition_s)
    needed = 2 if pages else 1
    tiers = (LONG_INTERVAL_S, SUSTAINED_INTERVAL_S, STEADY_INTERVAL_S)
    return next((every for every in tiers if shortest >= needed * every), None)


# (thresholds, selector, the alerts' declarations: None, alerts.toml's) → the group
GroupBuilder = Callable[[Thresholds, str, Mapping[str, dict[str, Any]] | None], Group]
GroupEntries = Callable[[Thresholds, str], Queries | list[Record]]


def group(
    name: str, *, conditions: tuple[str | int, ...] = (), interval_s: int | None = None
) -> Callable[[GroupEntries], GroupBuilder]:
    """Declares a rule group: the decorated function (thresholds, selector) returns its alerts' expressions by name
    (their declarations and words are alerts.toml's, and its order the rule file's), or its records. `conditions`
    are what its conditions last (Thresholds fields or seconds): the group is evaluated as often as they need
    (condition_interval); else every `interval_s`, None the server's interval."""

    def declare(entries: GroupEntries) -> GroupBuilder:
        @functools.wraps(entries)
        def built(t: Thresholds, selector: str, alerts: Mapping[str, dict[str, Any]] | None = None) -> Group:
            listed = entries(t, selector)
            if isinstance(listed, list):
                return Group(name, records=listed, interval_s=interval_s)
            tables = declarations() if alerts is None else alerts
            undeclared = [alert for alert in listed if alert not in tables]
            if undeclared:
                raise DeclarationError(f"alerts.toml: {undeclared[0]}: no table for this alert of group {name}")
            rules = [declared(t, alert, table, listed[alert]) for alert, table in tables.items() if alert in listed]
            every = interval_s
            if conditions:
                lasting = (getattr(t, c) if isinstance(c, str) else c for c in conditions)
                every = condition_interval(*lasting, pages=any(r.severity == "critical" for r in rules))
            return Group(name, rules=rules, interval_s=every)

        return built

    return declare


def duration(seconds: int) -> str:
    """300 → '5m', 3600 → '1h', 90 → '90s' (Prometheus duration syntax)."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def xid_regex(xids: tuple[int, ...]) -> str:
    return "|".join(str(x) for x in sorted(xids))


def nodeish(series: str) -> str:
    """`series` with a `node` label everywhere: kept where the scrape config set it, the instance where it did not.
    Rules that must outlive an exporter restart group by it: a restarted pod has a new instance, not a new node."""
    return f'(label_replace({series[:-1]},node=""}}, "node", "$1", "instance", "(.*)") or {series[:-1]},node!=""}})'


def nodeish_over(series: str, window: str) -> str:
    """max_over_time(`series`[window]) with a `node` label everywhere, as nodeish(): the range read from the raw
    series (a range over label_replace needs a subquery, which evaluates the relabelling at every step)."""
    return (
        f'(label_replace(max_over_time({series[:-1]},node=""}}[{window}]), "node", "$1", "instance", "(.*)") '
        f'or max_over_time({series[:-1]},node!=""}}[{window}]))'
    )


def held(expr: str) -> str:
    """`expr` as a page for a lasting fault: the same alert across an exporter restart.

    A restarted pod has a new `pod` and a new `instance`. The alert keeps `node` (the instance where the scrape
    gives no `node` label: a host's address, which a restart keeps) and drops both, aggregating over them, so the
    new series continue the firing alert rather than resolving it and opening another (aggregation, unlike a
    relabelled vector, cannot fail on two series that now look alike while old and new overlap).
    `keep_firing_for` (Thresholds.page_hold_s) bridges the scrapes between the two. Applied to a value rather than
    a comparison (`held(reading) > threshold`), the page keeps the threshold it ends on: the highest reading of the
    GPU's series, old and new, is compared."""
    joined = f'label_join({expr}, "node_or_instance", "@", "node", "instance")'
    named = f'label_replace({joined}, "node", "$1", "node_or_instance", "@(.+)")'
    return f"max without (pod, instance, node_or_instance) ({named})"


def anchor(alert_name: str) -> str:
    """The docs/runbooks.md heading anchor of an alert ('## GpuwardenGpuLost' → 'gpuwardengpulost')."""
    return alert_name.lower()
