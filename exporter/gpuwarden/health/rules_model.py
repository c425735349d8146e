"""The alert rules' building blocks: a rule as named data (what it reads of the thresholds, which verdict it mirrors),
and the PromQL shapes the rules share (a page held across exporter restarts, the `node` label everywhere).

The rules themselves are in rules_hardware.py and rules_service.py; health/rules.py assembles them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.health.thresholds import Thresholds

# what health/rules.py re-exports to the rules' readers (the generator, the fleet, the tests)
__all__ = [
    "GPU",
    "HISTORY_GROUP",
    "HISTORY_INTERVAL_S",
    "HISTORY_WINDOW",
    "HOLD_MARGIN_S",
    "NODE",
    "NODE_GPUS_MAX",
    "NVLINK_ACTIVE_DAY_MAX",
    "NVLINK_ACTIVE_MAX",
    "RUNBOOK_BASE",
    "SELECTOR",
    "SUSTAINED_GROUP",
    "SUSTAINED_LONG_GROUP",
    "SUSTAINED_LONG_INTERVAL_S",
    "STEADY_INTERVAL_S",
    "SUSTAINED_INTERVAL_S",
    "Group",
    "Record",
    "Rule",
    "alert",
    "anchor",
    "condition_interval",
    "duration",
    "group",
    "held",
    "nodeish",
    "nodeish_over",
    "page",
    "xid_regex",
]

RUNBOOK_BASE = "https://github.com/gpuwarden/gpuwarden/blob/main/docs/runbooks.md"
SELECTOR = 'job="gpuwarden"'
HOLD_MARGIN_S = 60  # past a finding's own warm-up after a restart: the new target found and scraped, a rule evaluated

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
# ... and those over 30 minutes or more (power cap, underutilization, a reduced power limit) every 10.
SUSTAINED_LONG_GROUP = "gpuwarden-sustained-long"
SUSTAINED_LONG_INTERVAL_S = 600
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


def alert(
    t: Thresholds,
    *,
    name: str,
    expr: str,
    severity: str,
    summary: str,
    description: str,
    threshold: str | None = None,
    for_: str | int = 0,
    keep_firing: str | int = 0,
    reads: tuple[str, ...] = (),
    action: str | None = None,
    finding_expr: str | None = None,
    verdict: str | None = None,
) -> Rule:
    """A Rule from its declarations: `threshold` names the field whose value is appended to `expr` (which ends on
    its comparison), `for_` and `keep_firing` a field or a fixed number of seconds. The rendered numbers are then
    the declared fields' by construction."""
    if threshold is not None:
        expr = f"{expr} {getattr(t, threshold):g}"
    return Rule(
        alert=name,
        expr=expr,
        severity=severity,
        summary=summary,
        description=description,
        for_s=getattr(t, for_) if isinstance(for_, str) else for_,
        action=action,
        keep_firing_s=getattr(t, keep_firing) if isinstance(keep_firing, str) else keep_firing,
        finding_expr=finding_expr,
        threshold=threshold,
        for_field=for_ if isinstance(for_, str) else None,
        keep_firing_field=keep_firing if isinstance(keep_firing, str) else None,
        reads=reads,
        verdict=verdict,
    )


def page(t: Thresholds, **rule: Any) -> Rule:
    """A critical alert for a lasting fault, its expression `held`: it keeps firing for page_hold_s with no reading,
    so an exporter restart neither resolves the page nor opens another (docs/alerting.md, One page across a
    restart)."""
    return alert(t, severity="critical", keep_firing="page_hold_s", **rule)


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


def condition_interval(*condition_s: int) -> int | None:
    """The longest of the tiers (10, 5 and 2 minutes) of which two evaluations fit in the shortest of a
    group's conditions (windows and `for:`), else None, the server's interval: a threshold tuned shorter is
    evaluated as often as the other alerts."""
    shortest = min(condition_s)
    tiers = (SUSTAINED_LONG_INTERVAL_S, SUSTAINED_INTERVAL_S, STEADY_INTERVAL_S)
    return next((every for every in tiers if shortest >= 2 * every), None)


GroupBuilder = Callable[[Thresholds, str], Group]


def group(
    name: str, *, conditions: tuple[str | int, ...] = (), interval_s: int | None = None
) -> Callable[[Callable[[Thresholds, str], list]], GroupBuilder]:
    """Declares a rule group: the decorated function (thresholds, selector) lists its alerts and records, in the
    file's order. `conditions` are what its conditions last (Thresholds fields or seconds): the group is evaluated
    as often as they need (condition_interval); else every `interval_s`, None the server's interval."""

    def declare(entries: Callable[[Thresholds, str], list]) -> GroupBuilder:
        @functools.wraps(entries)
        def built(t: Thresholds, selector: str) -> Group:
            listed = entries(t, selector)
            every = interval_s
            if conditions:
                every = condition_interval(*(getattr(t, c) if isinstance(c, str) else c for c in conditions))
            return Group(
                name,
                rules=[r for r in listed if isinstance(r, Rule)],
                records=[r for r in listed if isinstance(r, Record)],
                interval_s=every,
            )

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
