"""The alert rules' expressions for the GPUs' hardware: availability and XIDs, memory health, heat and power, the
interconnect.

Most pages live here. A page for a lasting fault is `held` (rules_model.py): one alert across an exporter restart,
whichever way the exporter comes back (docs/alerting.md, One page across a restart). Each group returns its alerts'
expressions by name; their severity, thresholds and words are declared in alerts.toml.
"""

from __future__ import annotations

from gpuwarden.health.checks import FABRIC_DEGRADED, FABRIC_FAULTS
from gpuwarden.health.rules_model import (
    HISTORY_INTERVAL_S,
    NVLINK_ACTIVE_DAY_MAX,
    NVLINK_ACTIVE_MAX,
    STEADY_INTERVAL_S,
    Queries,
    Query,
    duration,
    group,
    held,
    xid_regex,
)
from gpuwarden.health.thresholds import Thresholds


@group("gpuwarden-availability")
def availability(t: Thresholds, s: str) -> Queries:
    def xid_since(window: int) -> str:
        """The age of the GPU's latest critical XID within `window` s, over Prometheus' history of it, by node."""
        last = f'gpuwarden_xid_last_timestamp_seconds{{{s},xid=~"{xid_regex(t.xid_critical)}"}}'
        return f"time() - {held(f'max_over_time({last}[{duration(window)}])')} <"

    warning = f'gpuwarden_xid_last_timestamp_seconds{{{s},xid=~"{xid_regex(t.xid_warning)}"}}'
    return {
        "GpuwardenGpuLost": held(f"gpuwarden_gpu_up{{{s}}} == 0"),
        "GpuwardenRecoveryActionNeeded": held(f"gpuwarden_recovery_action{{{s}}} > 0"),
        # over Prometheus' history, not only the running exporter's memory: a restarted exporter (which starts with
        # no XID history) must not resolve the page, and held by node, not instance, so its successor does not open
        # another; the page lasts the exporter's verdict window, the cordon finding the hold
        "GpuwardenXidCritical": Query(
            xid_since(t.xid_window_s), finding=f"{xid_since(t.xid_critical_hold_s)} {t.xid_critical_hold_s}"
        ),
        "GpuwardenXidWarning": f"time() - {warning} <",
    }


@group("gpuwarden-memory-health", interval_s=STEADY_INTERVAL_S)
def memory_health(t: Thresholds, s: str) -> Queries:
    """States that last until a reset or a replacement (an ECC count, a failed or pending remap, retired pages), on
    STEADY_INTERVAL_S: a page comes up to a minute later than a minute's evaluation would bring it, and the critical
    XID that accompanies an uncorrectable error pages from gpuwarden-availability every minute."""
    retired = f"sum without (cause) (gpuwarden_retired_pages{{{s}}})"
    return {
        "GpuwardenEccUncorrectable": held(f'gpuwarden_ecc_errors_total{{{s},type="uncorrected"}} > 0'),
        "GpuwardenRowRemapFailure": held(f"gpuwarden_remapped_rows_failed{{{s}}} == 1"),
        "GpuwardenRowRemapPending": f"gpuwarden_remapped_rows_pending{{{s}}} == 1",
        "GpuwardenRetiredPagesPending": f"gpuwarden_retired_pages_pending{{{s}}} == 1",
        "GpuwardenRetiredPagesLimit": f"{held(retired)} >=",
    }


@group("gpuwarden-thermal-critical")
def thermal_critical(t: Thresholds, s: str) -> Queries:
    """The page for a GPU past its slowdown point, on the server's interval: its condition lasts 2 minutes."""
    return {"GpuwardenTemperatureCritical": f"{held(f'gpuwarden_temperature_celsius{{{s}}}')} >"}


@group(
    "gpuwarden-thermal-power",
    conditions=("temperature_warning_for_s", "memory_temperature_for_s", "thermal_slowdown_for_s"),
)
def thermal_power(t: Thresholds, s: str) -> Queries:
    def slowdown(reason: str) -> str:
        """The share of time the GPU spent slowed down for `reason` over thermal_slowdown_for_s."""
        window = duration(t.thermal_slowdown_for_s)
        return f'rate(gpuwarden_throttle_seconds_total{{{s},reason="{reason}"}}[{window}]) >'

    memory_max = f'gpuwarden_temperature_threshold_celsius{{{s},threshold="memory_max"}}'
    return {
        "GpuwardenTemperatureHigh": f"gpuwarden_temperature_celsius{{{s}}} >",
        "GpuwardenMemoryTemperatureHigh": f"gpuwarden_memory_temperature_celsius{{{s}}} >= ignoring(threshold) "
        f"({memory_max} - {t.memory_temperature_margin_celsius:g})",
        "GpuwardenHwThermalSlowdown": slowdown("hw_thermal_slowdown"),
        "GpuwardenSwThermalSlowdown": slowdown("sw_thermal_slowdown"),
        "GpuwardenHwPowerBrake": slowdown("hw_power_brake_slowdown"),
    }


@group("gpuwarden-thermal-page", conditions=("thermal_page_window_s", "thermal_page_for_s"))
def thermal_page(t: Thresholds, s: str) -> Queries:
    """The page for a GPU throttled for heat most of a 10-minute window, 10 minutes long: evaluated as often as its
    conditions need (every 5 minutes as shipped), apart from the 5-minute tickets of gpuwarden-thermal-power."""
    thermal = (
        f"max without (reason) (rate(gpuwarden_throttle_seconds_total{{{s},"
        f'reason=~"hw_thermal_slowdown|sw_thermal_slowdown"}}[{duration(t.thermal_page_window_s)}]))'
    )
    return {"GpuwardenThermalThrottling": f"{held(thermal)} >"}


@group("gpuwarden-fabric-faults")
def fabric_faults(t: Thresholds, s: str) -> Queries:
    """The fabric's faults that page or ticket at once (no `for:`), on the server's interval."""
    return {
        "GpuwardenFabricUnhealthy": held(f'gpuwarden_fabric_health{{{s},condition=~"{"|".join(FABRIC_FAULTS)}"}} == 1'),
        # the kernel log's record time, so an SXid from before the exporter started counts, and a restart neither
        # repeats nor resolves it; as the fabric verdict, for xid_window_s
        "GpuwardenNvswitchSxid": f"time() - gpuwarden_kernel_sxid_last_timestamp_seconds{{{s}}} <",
    }


@group("gpuwarden-interconnect", conditions=("nvlink_down_for_s", "fabric_setup_for_s", "fabric_degraded_for_s"))
def interconnect(t: Thresholds, s: str) -> Queries:
    def nvlink_down(some_active: str) -> str:
        """Fewer links active than the GPU has, on a GPU with some active (by UUID, so under any instance)."""
        return held(
            f"gpuwarden_nvlink_active_links{{{s}}} < gpuwarden_nvlink_links{{{s}}} and on (uuid) ({some_active})"
        )

    # the last day from the recorded day's maximum (one or two points a GPU, not a day of records across every
    # block), the last two records for what the day's maximum may not hold yet (written in the same evaluation), and
    # the raw series over one history interval for what no record holds yet: on a fresh Prometheus the first record
    # is written up to HISTORY_INTERVAL_S after the start (a link that went down then paged 8 minutes late, issue 48)
    recent = f"max by (uuid) (max_over_time(gpuwarden_nvlink_active_links{{{s}}}[{duration(HISTORY_INTERVAL_S)}]))"
    day = (
        f"max_over_time({NVLINK_ACTIVE_DAY_MAX}[{duration(HISTORY_INTERVAL_S)}]) > 0"
        f" or max_over_time({NVLINK_ACTIVE_MAX}[{duration(2 * HISTORY_INTERVAL_S)}]) > 0"
    )
    return {
        # against the links the GPU has (static, so a restart does not forget them); a GPU with none active is a
        # fault only if some were active in the last day (a PCIe card without a bridge has links and none active),
        # under any exporter instance: joined on the GPU's UUID, so a GPU whose every link went down still pages
        # after the exporter restarted (the new instance has seen none active; joined on the instance too, the page
        # resolved). The fleet view evaluates its finding on the few instances it narrowed to, from the raw series:
        # it then works on a Prometheus that loads the fleet's recording rules without these
        "GpuwardenNvlinkDown": Query(
            nvlink_down(f"{day} or {recent} > 0"),
            finding=nvlink_down(f"max by (uuid) (max_over_time(gpuwarden_nvlink_active_links{{{s}}}[1d])) > 0"),
        ),
        # one page per node: Fabric Manager sets up the whole node's fabric, so eight GPUs not ready were eight
        # incidents for one cause (seen in the restart test with real Alertmanager)
        "GpuwardenFabricNotReady": held(
            f'count without (gpu, uuid) (gpuwarden_fabric_state{{{s},state!="completed"}} == 1)'
        ),
        "GpuwardenFabricDegraded": f'gpuwarden_fabric_health{{{s},condition=~"{"|".join(FABRIC_DEGRADED)}"}} == 1',
    }
