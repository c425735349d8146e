"""One table, two judges: every alert that mirrors an exporter verdict, with the readings that put a GPU one step past
its threshold, at it, and one step short of it.

From this table come both the promtool tests of the shipped rules (alert_rules/tests/gpuwarden.verdicts.test.yaml,
written by `python alert_rules/generate.py`) and the same readings fed to the exporter's own evaluator
(health/checks.py; tests/test_verdict_agreement.py). Both must say what the comparison says: the page fires where
the verdict reaches the page's severity, and the verdict is critical where the page is. Each reading is held from
the start until `at_s`, past every window and `for:` of both, at the shipped thresholds. An alert that declares a
verdict (Rule.verdict) without a row here, or declares none without a reason in NO_VERDICT, fails the tests.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

from gpuwarden.health.rules import build
from gpuwarden.health.thresholds import DEFAULT

try:
    from alert_rules.promtool_series import Run, expanding, selector
except ImportError:  # run as a script: its folder is on the path, the repository root is not
    from promtool_series import Run, expanding, selector

INTERVAL_S = 15  # the shipped scrape interval
GPU_LABELS = {"job": "gpuwarden", "instance": "n1:10045", "gpu": "0", "uuid": "GPU-0"}
NODE_LABELS = {"job": "gpuwarden", "instance": "n1:10045"}
MODEL = "NVIDIA H100 80GB HBM3"
MEMORY_TOTAL = 100 * 2**30  # bytes: used = ratio x total is then exact at whole percents
LINKS = 18
SWITCH = "0000:05:00.0"

# The alerts with no exporter verdict to agree with, each with why.
NO_VERDICT = {
    "GpuwardenExporterDown": "about the exporter itself: no exporter, no verdict",
    "GpuwardenExporterAbsent": "about the scrape configuration",
    "GpuwardenNvmlDown": "no NVML, no per-GPU verdict (npd-plugin and slurm-healthcheck report it as unknown)",
    "GpuwardenCollectionStale": "about the exporter's poller: a wedged poller publishes no new verdicts",
    "GpuwardenRecoveryActionNeeded": "the driver's own verdict, passed through as gpuwarden_recovery_action",
    "GpuwardenMemoryTemperatureHigh": "no HBM temperature check in the exporter (the die temperature is judged)",
    "GpuwardenCollectiveHang": "a job's finding (gpuwarden_job_finding), judged by the job view, not a GPU check",
    "GpuwardenGpuCountDropped": "about the node over a day of Prometheus' history: the exporter sees only now",
}


@dataclass(frozen=True)
class Series:
    """One series held from the start: `value` (a gauge) plus `per_s` a second (a counter)."""

    name: str
    value: float
    per_s: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    per_gpu: bool = True


@dataclass(frozen=True)
class Readings:
    """What the GPU shows: its series, whether it answers, its XIDs and its node's SXids (code, age in seconds at
    `at_s`: the exporter judges these from its event and kernel-log tables, Prometheus from timestamp series)."""

    series: tuple[Series, ...] = ()
    up: bool = True
    xids: tuple[tuple[int, int], ...] = ()
    sxids: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Row:
    alert: str
    readings: Callable[[float], Readings]
    at_s: int
    op: str = ">"  # the alert fires where `value op boundary`
    step: float = 1.0
    boundary: float | None = None  # default: the rule's declared threshold's shipped value
    values: tuple[float, ...] | None = None  # default: boundary + step, boundary, boundary - step

    def points(self) -> list[tuple[float, bool]]:
        """(value, whether the alert fires there) for each reading this row judges."""
        boundary = self.boundary if self.boundary is not None else getattr(DEFAULT, rule(self.alert).threshold or "")
        values = self.values or (boundary + self.step, boundary, boundary - self.step)
        compare = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}[self.op]
        return [(round(v, 10), compare(round(v, 10), boundary)) for v in values]


def rule(alert: str):  # noqa: ANN201 - a Rule
    return next(r for g in build() for r in g.rules if r.alert == alert)


def gauge(name: str, **labels: str) -> Callable[[float], Readings]:
    return lambda v: Readings((Series(name, v, labels=labels),))


def share(name: str, **labels: str) -> Callable[[float], Readings]:
    """A counter of seconds rising `v` seconds a second: a share of the time."""
    return lambda v: Readings((Series(name, 0, v, labels=labels),))


def throttled(reason: str) -> Callable[[float], Readings]:
    """Clocks held down for `reason` `v` of the time: its throttle-time counter, and its clock-event gauge reading
    active at the polls (a reason active most of the time)."""
    return lambda v: Readings(
        (
            Series("gpuwarden_throttle_seconds_total", 0, v, {"reason": reason}),
            Series("gpuwarden_clock_event_active", 1 if v >= 0.5 else 0, labels={"reason": reason}),
        )
    )


def nvlink_errors(kind: str) -> Callable[[float], Readings]:
    """`v` errors a second on link 0: the per-link counter the exporter sums, and the GPU's sum the rules read."""
    return lambda v: Readings(
        (
            Series("gpuwarden_nvlink_errors_total", 0, v, {"link": "0", "type": kind}),
            Series("gpuwarden_nvlink_gpu_errors_total", 0, v, {"type": kind}),
        )
    )


def busy(ratio: float, *extra: Series) -> Readings:
    return Readings(
        (
            Series("gpuwarden_busy_seconds_total", 0, ratio),
            Series("gpuwarden_utilization_sampled_seconds_total", 0, 1),
            *extra,
        )
    )


def fabric(state: str, *conditions: str) -> Readings:
    return Readings(
        (
            Series("gpuwarden_fabric_state", 1, labels={"state": state}),
            *(Series("gpuwarden_fabric_health", 1, labels={"condition": c}) for c in conditions),
        )
    )


def nvlinks(active: float) -> Readings:
    up = [Series("gpuwarden_nvlink_up", 1 if link < active else 0, labels={"link": str(link)}) for link in range(LINKS)]
    return Readings((Series("gpuwarden_nvlink_links", LINKS), Series("gpuwarden_nvlink_active_links", active), *up))


def xid_age(code: int) -> Callable[[float], Readings]:
    """An XID logged `v` seconds before the judgement."""
    return lambda v: Readings(xids=((code, int(v)),))


def power_limit(watts: float) -> Readings:
    return Readings((Series("gpuwarden_power_limit_watts", watts), Series("gpuwarden_power_default_limit_watts", 700)))


def memory_used(ratio: float) -> Readings:
    used = Series("gpuwarden_memory_used_bytes", round(ratio * MEMORY_TOTAL))
    return Readings((used, Series("gpuwarden_memory_total_bytes", MEMORY_TOTAL)))


def starved(ratio: float) -> Readings:
    return busy(ratio, Series("gpuwarden_processes", 1))


def pstate(state: float) -> Readings:
    """A busy GPU (90 %) of a datacenter model held in P`state`."""
    info = Series("gpuwarden_gpu_info", 1, labels={"name": MODEL})
    return busy(0.9, Series("gpuwarden_performance_state", state), info)


def pcie_replays(per_minute: float) -> Readings:
    return Readings((Series("gpuwarden_pcie_replay_errors_total", 0, per_minute / 60),))


def gpu_up(up: float) -> Readings:
    return Readings((Series("gpuwarden_gpu_up", up),), up=bool(up))


def sxid_age(seconds: float) -> Readings:
    """SXid 20034 logged `seconds` before the judgement, on a node whose fabric is set up."""
    return Readings(fabric("completed").series, sxids=((20034, int(seconds)),))


def fabric_fault(kind: str) -> Callable[[float], Readings]:
    """Fabric `kind` (a state, or a health condition) where `v`, else a set-up, healthy fabric."""
    if kind == "not_started":
        return lambda v: fabric("not_started" if v else "completed")
    return lambda v: fabric("completed", *([kind] if v else []))


STATE = (1, 0)  # a state alert: the fault present, then absent
# alert, readings for a value, when both judge (s: past the windows, `for:` and the exporter's own sustain), then how
# the fault compares with its boundary (default: the declared threshold's shipped value, one step each side)
TABLE = [
    Row("GpuwardenGpuLost", gpu_up, 180, "<", boundary=1, values=STATE),
    Row("GpuwardenXidCritical", xid_age(48), 600, "<"),
    Row("GpuwardenXidWarning", xid_age(94), 600, "<"),
    Row("GpuwardenEccUncorrectable", gauge("gpuwarden_ecc_errors_total", type="uncorrected"), 120, boundary=0,
        values=STATE),
    Row("GpuwardenRowRemapFailure", gauge("gpuwarden_remapped_rows_failed"), 120, boundary=0, values=STATE),
    Row("GpuwardenRowRemapPending", gauge("gpuwarden_remapped_rows_pending"), 120, boundary=0, values=STATE),
    Row("GpuwardenRetiredPagesPending", gauge("gpuwarden_retired_pages_pending"), 120, boundary=0, values=STATE),
    Row("GpuwardenRetiredPagesLimit", gauge("gpuwarden_retired_pages", cause="double_bit"), 120, ">="),
    Row("GpuwardenTemperatureHigh", gauge("gpuwarden_temperature_celsius"), 420),
    Row("GpuwardenTemperatureCritical", gauge("gpuwarden_temperature_celsius"), 240),
    Row("GpuwardenHwThermalSlowdown", throttled("hw_thermal_slowdown"), 720, step=0.01),
    Row("GpuwardenSwThermalSlowdown", throttled("sw_thermal_slowdown"), 720, step=0.01),
    Row("GpuwardenThermalThrottling", throttled("hw_thermal_slowdown"), 1320, step=0.01),
    Row("GpuwardenHwPowerBrake", throttled("hw_power_brake_slowdown"), 720, step=0.01),
    Row("GpuwardenPowerCapSustained", throttled("sw_power_cap"), 1920, step=0.01),
    Row("GpuwardenPowerLimitReduced", power_limit, 3720, "<", boundary=700),
    Row("GpuwardenMemoryNearlyFull", memory_used, 1020, step=0.01),
    Row("GpuwardenUnderutilized", starved, 2220, "<", 0.01, boundary=DEFAULT.utilization_low_ratio),
    Row("GpuwardenPerformanceStateDegraded", pstate, 1920, ">=", boundary=DEFAULT.pstate_degraded_min),
    Row("GpuwardenPersistenceModeOff", gauge("gpuwarden_persistence_mode_enabled"), 1020, "<", boundary=1,
        values=STATE),
    Row("GpuwardenPcieReplaysHigh", pcie_replays, 1320),
    Row("GpuwardenNvlinkCrcErrorsHigh", nvlink_errors("crc_flit"), 1320),
    Row("GpuwardenNvlinkReplayRecovery", nvlink_errors("replay"), 1020, boundary=0, values=(1 / 60, 0)),
    Row("GpuwardenNvlinkDown", nvlinks, 420, "<", boundary=LINKS, values=(LINKS - 1, LINKS)),
    Row("GpuwardenFabricNotReady", fabric_fault("not_started"), 420, boundary=0, values=STATE),
    Row("GpuwardenFabricUnhealthy", fabric_fault("route_unhealthy"), 120, boundary=0, values=STATE),
    Row("GpuwardenFabricDegraded", fabric_fault("degraded_bandwidth"), 420, boundary=0, values=STATE),
    Row("GpuwardenNvswitchSxid", sxid_age, 600, "<"),
]  # fmt: skip


def run(series: Series, at_s: int) -> Run:
    """The series sampled every INTERVAL_S from 0 to at_s."""
    return Run(at_s // INTERVAL_S + 1, series.value, series.per_s * INTERVAL_S)


def input_series(readings: Readings, at_s: int) -> list[dict[str, str]]:
    """promtool's input series for one reading: XIDs and SXids as the timestamp series the rules read (held from the
    start: the rules compare `time()` with the value)."""
    out = [
        {
            "series": selector(s.name, {**(GPU_LABELS if s.per_gpu else NODE_LABELS), **s.labels}),
            "values": expanding([run(s, at_s)]),
        }
        for s in readings.series
    ]
    for code, seconds in readings.xids:
        name = selector("gpuwarden_xid_last_timestamp_seconds", {**GPU_LABELS, "xid": str(code)})
        out.append({"series": name, "values": expanding([Run(at_s // INTERVAL_S + 1, at_s - seconds)])})
    for code, seconds in readings.sxids:
        labels = {**NODE_LABELS, "switch": SWITCH, "sxid": str(code)}
        name = selector("gpuwarden_kernel_sxid_last_timestamp_seconds", labels)
        out.append({"series": name, "values": expanding([Run(at_s // INTERVAL_S + 1, at_s - seconds)])})
    return out


def promtool_tests() -> dict[str, object]:
    """The promtool side: at each row's judgement time, the alert firing or not (ALERTS, so no annotations are
    needed: their wording is the shipped tests' business)."""
    tests = []
    for row in TABLE:
        for value, fires in row.points():
            query = f'count(ALERTS{{alertname="{row.alert}",alertstate="firing"}})'
            tests.append(
                {
                    "name": f"{row.alert} at {value:g}: {'fires' if fires else 'silent'}",
                    "interval": f"{INTERVAL_S}s",
                    "input_series": input_series(row.readings(value), row.at_s),
                    "promql_expr_test": [
                        {
                            "expr": query,
                            "eval_time": f"{row.at_s}s",
                            "exp_samples": [{"labels": "{}", "value": 1}] if fires else [],
                        }
                    ],
                }
            )
    return {"rule_files": ["../gpuwarden.rules.yaml"], "evaluation_interval": "1m", "tests": tests}
