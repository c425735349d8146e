"""The alert rules' expressions about the service around the GPUs: the exporter itself, jobs, capacity and
configuration, the sustained tickets evaluated every 5 minutes, and the recorded maxima the day-long windows read.

Each group is a function declared by @group (rules_model.py) that returns its alerts' expressions by name; their
severity, action, verdict, the thresholds they read and their words are declared in alerts.toml.
"""

from __future__ import annotations

from gpuwarden.health.rules_model import (
    HISTORY_GROUP,
    HISTORY_INTERVAL_S,
    HISTORY_WINDOW,
    NODE_GPUS_MAX,
    NVLINK_ACTIVE_DAY_MAX,
    NVLINK_ACTIVE_MAX,
    SUSTAINED_GROUP,
    Queries,
    Record,
    duration,
    group,
    held,
    nodeish,
    nodeish_over,
)
from gpuwarden.health.thresholds import Thresholds


def busy(s: str, window: int) -> str:
    """The share of `window` in which a kernel ran on the GPU (the sustained tickets' busy ratio)."""
    w = duration(window)
    busy_s = f"rate(gpuwarden_busy_seconds_total{{{s}}}[{w}])"
    return f"{busy_s} / rate(gpuwarden_utilization_sampled_seconds_total{{{s}}}[{w}])"


@group("gpuwarden-exporter")
def exporter(t: Thresholds, s: str) -> Queries:
    return {
        "GpuwardenExporterDown": f"up{{{s}}} == 0",
        "GpuwardenExporterAbsent": f"absent(up{{{s}}})",
        "GpuwardenNvmlDown": f"gpuwarden_nvml_up{{{s}}} == 0",
        "GpuwardenCollectionStale": f'time() - gpuwarden_last_collect_timestamp_seconds{{{s},tier="fast"}} >',
    }


@group("gpuwarden-capacity", conditions=("memory_for_s",))
def capacity(t: Thresholds, s: str) -> Queries:
    return {"GpuwardenMemoryNearlyFull": f"gpuwarden_memory_used_bytes{{{s}}} / gpuwarden_memory_total_bytes{{{s}}} >"}


@group("gpuwarden-jobs")
def jobs(t: Thresholds, s: str) -> Queries:
    # held across an exporter restart (its keep_firing_for: alerts.toml)
    return {"GpuwardenCollectiveHang": held(f'gpuwarden_job_finding{{{s},kind="collective_hang"}} == 1')}


@group(
    SUSTAINED_GROUP,
    # what each rule's condition lasts, in the rules' order: windows, PerformanceStateDegraded's window,
    # Underutilized's window, NvlinkReplayRecovery's [15m], GpuCountDropped's `for:`, the power limit's, CRC and PCIe
    # tickets' `for:`
    conditions=(
        "power_cap_for_s",
        "pstate_for_s",
        "utilization_for_s",
        900,
        600,
        "power_limit_reduced_for_s",
        "nvlink_crc_for_s",
        "pcie_replays_for_s",
    ),
)
def sustained(t: Thresholds, s: str) -> Queries:
    """Tickets and information over windows or `for:` of 10 minutes or more: evaluated every 10 minutes as shipped
    (condition_interval: a ticket's condition holds one evaluation), not every minute (at 10,000 nodes they were a
    fifth of the alert rules' CPU; issue 38; issue 51, docs/benchmarks.md). Underutilized's and
    PerformanceStateDegraded's `for: 5m` are met at their second evaluation."""
    expected = f"gpuwarden_gpus_expected{{{s}}}"
    return {
        "GpuwardenPowerCapSustained": f'rate(gpuwarden_throttle_seconds_total{{{s},reason="sw_power_cap"}}'
        f"[{duration(t.power_cap_for_s)}]) >",
        "GpuwardenPerformanceStateDegraded": f"min_over_time(gpuwarden_performance_state{{{s}}}"
        f"[{duration(t.pstate_for_s)}]) >= {t.pstate_degraded_min} and on (instance, uuid) {busy(s, t.pstate_for_s)} "
        f"> {t.pstate_busy_ratio:g} and on (instance, uuid) "
        f'gpuwarden_gpu_info{{{s},name!~"{t.pstate_exempt_name_regex}"}}',
        "GpuwardenUnderutilized": f"{busy(s, t.utilization_for_s)} < {t.utilization_low_ratio:g} "
        f"and on (instance, uuid) gpuwarden_processes{{{s}}} > 0",
        "GpuwardenNvlinkReplayRecovery": (
            f'increase(gpuwarden_nvlink_gpu_errors_total{{{s},type=~"replay|recovery"}}[15m]) > 0'
        ),
        # against the node's expected count where it is set (a fact that survives restarts), else against the most
        # GPUs the node showed in gpu_count_memory_s, grouped by node so that a restarted exporter (a new instance)
        # does not forget the GPUs it never saw (the most seen: max_over_time of the raw series, then the node
        # label, not a [24h:1m] subquery of the relabelled one: 2.2x less CPU and 426x fewer points held at 1,000
        # nodes, issue 38) (and over the recorded maxima, HISTORY_GROUP: 144 points a node a day, not 5,760)
        "GpuwardenGpuCountDropped": f"({expected} - gpuwarden_gpus{{{s}}} > 0) or on (node) ("
        f"max by (node) (max_over_time({NODE_GPUS_MAX}[{duration(t.gpu_count_memory_s)}]))"
        f" - max by (node) ({nodeish(f'gpuwarden_gpus{{{s}}}')}) > 0 unless on (node) {nodeish(expected)})",
        "GpuwardenPowerLimitReduced": (
            f"gpuwarden_power_limit_watts{{{s}}} < gpuwarden_power_default_limit_watts{{{s}}}"
        ),
        "GpuwardenNvlinkCrcErrorsHigh": f'rate(gpuwarden_nvlink_gpu_errors_total{{{s},type="crc_flit"}}[5m]) >',
        "GpuwardenPcieReplaysHigh": f"rate(gpuwarden_pcie_replay_errors_total{{{s}}}[5m]) * 60 >",
    }


@group(HISTORY_GROUP, interval_s=HISTORY_INTERVAL_S)
def history(t: Thresholds, s: str) -> list[Record]:
    return [
        Record(
            NVLINK_ACTIVE_MAX,
            f"max by (uuid) (max_over_time(gpuwarden_nvlink_active_links{{{s}}}[{HISTORY_WINDOW}]))",
        ),
        # after the record it reads: Prometheus evaluates a group's rules in order, each seeing the ones
        # before; where an evaluator does not (vmalert), NvlinkDown's read of the last records covers the gap.
        # A day less one interval: NvlinkDown reads the last interval of these, so its day ends where it did
        Record(
            NVLINK_ACTIVE_DAY_MAX,
            f"max by (uuid) (max_over_time({NVLINK_ACTIVE_MAX}[{duration(86400 - HISTORY_INTERVAL_S)}]))",
        ),
        Record(NODE_GPUS_MAX, f"max by (node) ({nodeish_over(f'gpuwarden_gpus{{{s}}}', HISTORY_WINDOW)})"),
    ]


@group("gpuwarden-configuration", conditions=("persistence_off_for_s",))
def configuration(t: Thresholds, s: str) -> Queries:
    return {"GpuwardenPersistenceModeOff": f"gpuwarden_persistence_mode_enabled{{{s}}} == 0"}
