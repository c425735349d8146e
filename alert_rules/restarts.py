"""Every page for a lasting fault through an exporter restart, at the shipped windows, as promtool tests; and
GpuwardenNvlinkDown on a Prometheus that has not written its first history record yet.

Two restart styles, each with a 2-minute scrape gap at 30 minutes:
- the same instance (a systemd restart; no `node` or `pod` label): the scrape fails, Prometheus marks the series
  stale, and they come back under the same labels;
- a new instance (a Kubernetes rollout): the old pod's target leaves service discovery (its series stale), and the
  new pod's series come back with a new `instance` and `pod`, the same `node`.

A hardware counter (the throttle time) keeps counting through the gap, as the driver's does. Each test asserts one
incident from the page's first firing to the end: one alert label set, firing at every evaluation, the same
`activeAt` (ALERTS and ALERTS_FOR_STATE, which promtool writes as Prometheus does). Written by
`python alert_rules/generate.py` into alert_rules/tests/gpuwarden.restarts.test.yaml (and gpuwarden.fresh.test.yaml
with fresh/gpuwarden.rules.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.health.rules import HISTORY_GROUP, build
from gpuwarden.health.rules_file import alert_rules_yaml

try:
    from alert_rules.agreement import Series
    from alert_rules.promtool_series import STALE, Run, expanding, selector
except ImportError:  # run as a script: its folder is on the path, the repository root is not
    from agreement import Series
    from promtool_series import STALE, Run, expanding, selector

INTERVAL_S = 15
RESTART_S = 30 * 60
GAP_S = 120
END_S = RESTART_S + GAP_S + 30 * 60  # half an hour after the restart: past every window, `for:` and hold
FIRING_BY_S = 25 * 60  # every lasting page fires by then (the longest: thermal throttling, a 10 m window + 10 m)
GPU = {"gpu": "0", "uuid": "GPU-0"}
OLD = {"job": "gpuwarden", "instance": "10.0.0.1:10045", "node": "n1", "pod": "gpuwarden-7xk2p"}
NEW = {"job": "gpuwarden", "instance": "10.0.0.2:10045", "node": "n1", "pod": "gpuwarden-q9m4d"}
HOST = {"job": "gpuwarden", "instance": "gpu-node-1:10045"}  # off Kubernetes: the host's address, no node label


@dataclass(frozen=True)
class Fault:
    """A page's fault: its series (held from `since_s`), the first and last evaluations it must fire at, and where
    it ends by itself (an XID's window) the first it must not."""

    alert: str
    series: tuple[Series, ...]
    since_s: int = 0
    first_firing_s: int = FIRING_BY_S
    last_firing_s: int = END_S
    resolved_s: int | None = None


# The pages not held across a restart, each with why (tests/test_alert_rules.py: every other page is in FAULTS).
NOT_HELD = {
    "GpuwardenNvmlDown": "it names the instance: the example Alertmanager config inhibits the node's GPU alerts by "
    "`instance` while NVML is down, and an alert without one would match every held alert of the fleet",
}
XID_AT_S = 25 * 60
FAULTS = [
    Fault("GpuwardenGpuLost", (Series("gpuwarden_gpu_up", 0),)),
    Fault("GpuwardenRecoveryActionNeeded", (Series("gpuwarden_recovery_action", 1),)),
    # the kernel log read again at the start gives the same record time; the page lasts xid_window_s (10 m) after it
    Fault(
        "GpuwardenXidCritical",
        (Series("gpuwarden_xid_last_timestamp_seconds", XID_AT_S, labels={"xid": "48"}),),
        since_s=XID_AT_S,
        first_firing_s=XID_AT_S + 2 * 60,  # xid_critical_for_s
        last_firing_s=XID_AT_S + 9 * 60,
        resolved_s=XID_AT_S + 10 * 60,
    ),
    Fault("GpuwardenEccUncorrectable", (Series("gpuwarden_ecc_errors_total", 2, labels={"type": "uncorrected"}),)),
    Fault("GpuwardenRowRemapFailure", (Series("gpuwarden_remapped_rows_failed", 1),)),
    Fault("GpuwardenRetiredPagesLimit", (Series("gpuwarden_retired_pages", 70, labels={"cause": "double_bit"}),)),
    Fault("GpuwardenTemperatureCritical", (Series("gpuwarden_temperature_celsius", 93),)),
    Fault(
        "GpuwardenThermalThrottling",
        (Series("gpuwarden_throttle_seconds_total", 5000, 1, labels={"reason": "hw_thermal_slowdown"}),),
    ),
    Fault("GpuwardenNvlinkDown", (Series("gpuwarden_nvlink_links", 18), Series("gpuwarden_nvlink_active_links", 17))),
    Fault("GpuwardenFabricNotReady", (Series("gpuwarden_fabric_state", 1, labels={"state": "not_started"}),)),
    Fault(
        "GpuwardenFabricUnhealthy",
        (
            Series("gpuwarden_fabric_state", 1, labels={"state": "completed"}),
            Series("gpuwarden_fabric_health", 1, labels={"condition": "route_unhealthy"}),
        ),
    ),
]


def _value(series: Series, t: int) -> float:
    return series.value + series.per_s * t


def _samples(series: Series, since_s: int, until_s: int) -> Run:
    """The series' samples from since_s to until_s inclusive (a counter keeps counting in between)."""
    return Run((until_s - since_s) // INTERVAL_S + 1, _value(series, since_s), series.per_s * INTERVAL_S)


def _missing(from_s: int, until_s: int) -> Run:
    return Run(max(0, (until_s - from_s) // INTERVAL_S + 1), None)


def _before_restart(fault: Fault, series: Series) -> list[Run]:
    return [_missing(0, fault.since_s - INTERVAL_S), _samples(series, fault.since_s, RESTART_S - INTERVAL_S)]


def same_instance(fault: Fault) -> list[dict[str, str]]:
    """One series each: scraped, stale at the first failed scrape, nothing for the gap, then scraped again."""
    back = RESTART_S + GAP_S
    return [
        {
            "series": selector(s.name, {**HOST, **GPU, **s.labels}),
            "values": expanding(
                [
                    *_before_restart(fault, s),
                    Run(1, STALE),
                    _missing(RESTART_S + INTERVAL_S, back - INTERVAL_S),
                    _samples(s, back, END_S),
                ]
            ),
        }
        for s in fault.series
    ]


def new_instance(fault: Fault) -> list[dict[str, str]]:
    """Two series each: the old pod's, stale when its target leaves; the new pod's from the end of the gap."""
    back = RESTART_S + GAP_S
    out = []
    for s in fault.series:
        old = expanding([*_before_restart(fault, s), Run(1, STALE)])
        new = expanding([_missing(0, back - INTERVAL_S), _samples(s, back, END_S)])
        out.append({"series": selector(s.name, {**OLD, **GPU, **s.labels}), "values": old})
        out.append({"series": selector(s.name, {**NEW, **GPU, **s.labels}), "values": new})
    return out


def _minutes(seconds: int) -> str:
    return f"{seconds // 60}m"


def one_incident(fault: Fault) -> list[dict[str, object]]:
    """From the first evaluation it must fire at to its last: one label set, firing at every evaluation (one a
    minute), one activeAt; and then resolved where the fault ends by itself."""
    first = fault.first_firing_s
    window = _minutes(fault.last_firing_s - first)
    at = _minutes(fault.last_firing_s)
    name = f'alertname="{fault.alert}"'
    evaluations = (fault.last_firing_s - first) // 60 + 1
    checks: list[dict[str, object]] = [
        {"expr": f"count(count_over_time(ALERTS{{{name}}}[{window}]))", "eval_time": at,
         "exp_samples": [{"labels": "{}", "value": 1}]},
        {"expr": f'sum(count_over_time(ALERTS{{{name},alertstate="firing"}}[{window}]))', "eval_time": at,
         "exp_samples": [{"labels": "{}", "value": evaluations}]},
        {"expr": f"max(max_over_time(ALERTS_FOR_STATE{{{name}}}[{window}])) - "
                 f"min(min_over_time(ALERTS_FOR_STATE{{{name}}}[{window}]))", "eval_time": at,
         "exp_samples": [{"labels": "{}", "value": 0}]},
    ]  # fmt: skip
    if fault.resolved_s is not None:
        checks.append(
            {
                "expr": f'count(ALERTS{{{name},alertstate="firing"}})',
                "eval_time": _minutes(fault.resolved_s),
                "exp_samples": [],
            }
        )
    return checks


def restart_tests() -> dict[str, object]:
    tests = []
    for fault in FAULTS:
        for style, series in (("the same instance", same_instance), ("a new instance and pod", new_instance)):
            tests.append(
                {
                    "name": f"{fault.alert}: one incident through a 2-minute gap, back as {style}",
                    "interval": f"{INTERVAL_S}s",
                    "input_series": series(fault),
                    "promql_expr_test": one_incident(fault),
                }
            )
    return {"rule_files": ["../gpuwarden.rules.yaml"], "evaluation_interval": "1m", "tests": tests}


FRESH_RULES = "fresh/gpuwarden.rules.yaml"  # beside the tests, in a folder: `tests/*.yaml` are test files
FRESH_HEADER = (
    "# Generated by `python alert_rules/generate.py`: do not edit. The shipped alert rules without the recording\n"
    f"# rules of {HISTORY_GROUP}: what a fresh Prometheus evaluates before that group's first evaluation (up to\n"
    "# its interval after the start). promtool evaluates every group every minute, so only this file shows that.\n"
)


def fresh_rules_yaml() -> str:
    groups = build()
    for group in groups:
        group.records = []
    return alert_rules_yaml([g for g in groups if g.rules], header=FRESH_HEADER)


def fresh_prometheus_tests() -> dict[str, object]:
    """GpuwardenNvlinkDown before any history record: it pages within its `for:` (5 m) and one evaluation."""
    gpu = {"job": "gpuwarden", "instance": "n1:10045", **GPU}
    links = selector("gpuwarden_nvlink_links", gpu)
    active = selector("gpuwarden_nvlink_active_links", gpu)
    firing = 'count(ALERTS{alertname="GpuwardenNvlinkDown",alertstate="firing"})'
    fires = [{"labels": "{}", "value": 1}]
    return {
        "rule_files": [FRESH_RULES],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": "one link of 18 down from the first scrape pages at for: + one evaluation",
                "interval": f"{INTERVAL_S}s",
                "input_series": [
                    {"series": links, "values": expanding([Run(41, 18)])},
                    {"series": active, "values": expanding([Run(41, 17)])},
                ],
                "promql_expr_test": [
                    {"expr": firing, "eval_time": "4m", "exp_samples": []},
                    {"expr": firing, "eval_time": "6m", "exp_samples": fires},
                ],
            },
            {
                "name": "every link down 3 minutes after the start pages at for: + one evaluation after the drop",
                "interval": f"{INTERVAL_S}s",
                "input_series": [
                    {"series": links, "values": expanding([Run(61, 18)])},
                    {"series": active, "values": expanding([Run(12, 18), Run(49, 0)])},
                ],
                "promql_expr_test": [{"expr": firing, "eval_time": "9m", "exp_samples": fires}],
            },
            {
                "name": "a card whose links were never active stays silent",
                "interval": f"{INTERVAL_S}s",
                "input_series": [
                    {"series": links, "values": expanding([Run(81, 4)])},
                    {"series": active, "values": expanding([Run(81, 0)])},
                ],
                "promql_expr_test": [{"expr": firing, "eval_time": "20m", "exp_samples": []}],
            },
        ],
    }
