"""The alert rules for the GPUs' hardware: availability and XIDs, memory health, heat and power, the interconnect.

Most pages live here. A page for a lasting fault is `held` (rules_model.py): one alert across an exporter restart,
whichever way the exporter comes back (docs/alerting.md, One page across a restart); page() declares it so. The
rows are laid out as in rules_service.py.
"""

from __future__ import annotations

from typing import Any

from gpuwarden.health.checks import FABRIC_DEGRADED, FABRIC_FAULTS
from gpuwarden.health.rules_model import (
    GPU,
    HISTORY_INTERVAL_S,
    NODE,
    NVLINK_ACTIVE_DAY_MAX,
    NVLINK_ACTIVE_MAX,
    STEADY_INTERVAL_S,
    Rule,
    alert,
    duration,
    group,
    held,
    page,
    xid_regex,
)
from gpuwarden.health.thresholds import Thresholds


@group("gpuwarden-availability")
def availability(t: Thresholds, s: str) -> list[Rule]:
    def xid_since(window: int) -> str:
        """The age of the GPU's latest critical XID within `window` s, over Prometheus' history of it, by node."""
        last = f'gpuwarden_xid_last_timestamp_seconds{{{s},xid=~"{xid_regex(t.xid_critical)}"}}'
        return f"time() - {held(f'max_over_time({last}[{duration(window)}])')} <"

    # fmt: off
    return [
        page(t, name="GpuwardenGpuLost", action="cordon", verdict="gpu_lost",
             for_="gpu_lost_for_s",
             expr=held(f"gpuwarden_gpu_up{{{s}}} == 0"),
             summary="A GPU has fallen off the bus.",
             description=f"{GPU} does not answer NVML (lost or reset required); drain and cordon the node, then reset "
             "or power-cycle the GPU; RMA if it recurs."),
        page(t, name="GpuwardenRecoveryActionNeeded", action="reset_gpu",
             expr=held(f"gpuwarden_recovery_action{{{s}}} > 0"),
             summary="The driver asks for a GPU recovery action.",
             description=f"The driver recommends recovery action {{{{ $value }}}} for {GPU} (1 reset GPU, 2 reboot "
             "node, 3 drain P2P, 4 drain and reset); drain the node and carry it out."),
        alert(t, name="GpuwardenXidCritical", severity="critical", action="reset_gpu", verdict="xid",
              threshold="xid_window_s", for_="xid_critical_for_s", reads=("xid_window_s", "xid_critical"),
              # over Prometheus' history, not only the running exporter's memory: a restarted exporter (which
              # starts with no XID history) must not resolve the page, and held by node, not instance, so its
              # successor does not open another; the page lasts the exporter's verdict window, the cordon finding
              # the hold
              expr=xid_since(t.xid_window_s),
              summary="A GPU reported a critical XID.",
              description=f"{GPU} raised XID {{{{ $labels.xid }}}}; drain the node, reset the GPU and follow the "
              "runbook for that XID (the node stays a cordon candidate for a day).",
              finding_expr=f"{xid_since(t.xid_critical_hold_s)} {t.xid_critical_hold_s}"),
        alert(t, name="GpuwardenXidWarning", severity="warning", verdict="xid",
              threshold="xid_window_s", reads=("xid_warning",),
              expr=f'time() - gpuwarden_xid_last_timestamp_seconds{{{s},xid=~"{xid_regex(t.xid_warning)}"}} <',
              summary="A GPU reported a contained XID.",
              description=f"{GPU} raised XID {{{{ $labels.xid }}}}; restart the affected application and reset the GPU "
              "at the next maintenance window."),
    ]
    # fmt: on


@group("gpuwarden-memory-health", interval_s=STEADY_INTERVAL_S)
def memory_health(t: Thresholds, s: str) -> list[Rule]:
    """States that last until a reset or a replacement (an ECC count, a failed or pending remap, retired pages), on
    STEADY_INTERVAL_S: a page comes up to a minute later than a minute's evaluation would bring it, and the critical
    XID that accompanies an uncorrectable error pages from gpuwarden-availability every minute."""
    # fmt: off
    return [
        page(t, name="GpuwardenEccUncorrectable", action="cordon", verdict="ecc",
             expr=held(f'gpuwarden_ecc_errors_total{{{s},type="uncorrected"}} > 0'),
             summary="A GPU has uncorrectable ECC errors.",
             description=f"{GPU} has {{{{ $value }}}} uncorrectable ECC error(s) since the driver loaded; stop its "
             "workloads, cordon the node, reset the GPU, and request a replacement if it recurs."),
        page(t, name="GpuwardenRowRemapFailure", action="rma", verdict="row_remap",
             expr=held(f"gpuwarden_remapped_rows_failed{{{s}}} == 1"),
             summary="A GPU failed to remap a memory row.",
             description=f"{GPU} has no spare rows left for a failing memory row; drain it, run the NVIDIA field "
             "diagnostic and open an RMA."),
        alert(t, name="GpuwardenRowRemapPending", severity="warning", action="reset_gpu", verdict="row_remap",
              expr=f"gpuwarden_remapped_rows_pending{{{s}}} == 1",
              summary="A GPU has a memory row remap pending.",
              description=f"{GPU} has a row remap that takes effect at the next GPU reset; reset it at the next "
              "maintenance window."),
        alert(t, name="GpuwardenRetiredPagesPending", severity="warning", verdict="row_remap",
              expr=f"gpuwarden_retired_pages_pending{{{s}}} == 1",
              summary="A GPU has a page retirement pending.",
              description=f"{GPU} retired memory pages that take effect at the next driver reload; reload the driver "
              "or reboot at the next maintenance window."),
        page(t, name="GpuwardenRetiredPagesLimit", action="rma", verdict="row_remap",
             threshold="retired_pages_limit",
             expr=f"{held(f'sum without (cause) (gpuwarden_retired_pages{{{s}}})')} >=",
             summary="A GPU reached the retired-page limit.",
             description=f"{GPU} has {{{{ $value }}}} retired pages; drain it, run the field diagnostic and open an "
             "RMA."),
    ]
    # fmt: on


@group("gpuwarden-thermal-critical")
def thermal_critical(t: Thresholds, s: str) -> list[Rule]:
    """The page for a GPU past its slowdown point, on the server's interval: its condition lasts 2 minutes."""
    # fmt: off
    return [
        page(t, name="GpuwardenTemperatureCritical", action="cordon", verdict="temperature",
             threshold="temperature_critical_celsius", for_="temperature_critical_for_s",
             expr=f"{held(f'gpuwarden_temperature_celsius{{{s}}}')} >",
             summary="A GPU is in the thermal danger zone.",
             description=f"{GPU} is at {{{{ $value }}}} °C, past its slowdown point; drain the node and fix the "
             "cooling before the GPU shuts down."),
    ]
    # fmt: on


@group(
    "gpuwarden-thermal-power",
    conditions=("temperature_warning_for_s", "memory_temperature_for_s", "thermal_slowdown_for_s"),
)
def thermal_power(t: Thresholds, s: str) -> list[Rule]:
    def slowdown(reason: str, **rule: Any) -> Rule:
        """A ticket on the share of time the GPU spent slowed down for `reason` over thermal_slowdown_for_s."""
        window = duration(t.thermal_slowdown_for_s)
        expr = f'rate(gpuwarden_throttle_seconds_total{{{s},reason="{reason}"}}[{window}]) >'
        reads = ("thermal_slowdown_for_s",)
        return alert(t, severity="warning", for_="thermal_slowdown_for_s", reads=reads, expr=expr, **rule)

    # fmt: off
    return [
        alert(t, name="GpuwardenTemperatureHigh", severity="warning", verdict="temperature",
              threshold="temperature_warning_celsius", for_="temperature_warning_for_s",
              expr=f"gpuwarden_temperature_celsius{{{s}}} >",
              summary="A GPU is running hot.",
              description=f"{GPU} is at {{{{ $value }}}} °C; check airflow, fans and inlet temperature before it "
              "throttles."),
        alert(t, name="GpuwardenMemoryTemperatureHigh", severity="warning",
              for_="memory_temperature_for_s", reads=("memory_temperature_margin_celsius",),
              expr=f"gpuwarden_memory_temperature_celsius{{{s}}} >= ignoring(threshold) "
              f'(gpuwarden_temperature_threshold_celsius{{{s},threshold="memory_max"}} '
              f"- {t.memory_temperature_margin_celsius:g})",
              summary="A GPU's memory is running hot.",
              description=f"The HBM of {GPU} is at {{{{ $value }}}} °C, within {t.memory_temperature_margin_celsius:g} "
              "°C of its limit; check airflow and cooling."),
        slowdown("hw_thermal_slowdown", name="GpuwardenHwThermalSlowdown", verdict="thermal_throttling",
                 threshold="thermal_slowdown_ratio",
                 summary="A GPU is throttled for heat.",
                 description=f"{GPU} spent {{{{ $value | humanizePercentage }}}} of the time in hardware thermal "
                 "slowdown; check cooling and the chassis' fans."),
        slowdown("sw_thermal_slowdown", name="GpuwardenSwThermalSlowdown", verdict="thermal_throttling",
                 threshold="thermal_slowdown_ratio",
                 summary="A GPU is throttled by the driver for heat.",
                 description=f"{GPU} spent {{{{ $value | humanizePercentage }}}} of the time in software thermal "
                 "slowdown (the driver lowers clocks before the hardware has to); check cooling and the chassis' "
                 "fans."),
        slowdown("hw_power_brake_slowdown", name="GpuwardenHwPowerBrake", verdict="power",
                 threshold="power_brake_ratio",
                 summary="A GPU is held down by the power brake.",
                 description=f"{GPU} spent {{{{ $value | humanizePercentage }}}} of the time under the external "
                 "power brake; check the PSUs and the rack's power budget."),
    ]
    # fmt: on


@group("gpuwarden-thermal-page", conditions=("thermal_page_window_s", "thermal_page_for_s"))
def thermal_page(t: Thresholds, s: str) -> list[Rule]:
    """The page for a GPU throttled for heat most of a 10-minute window, 10 minutes long: evaluated as often as its
    conditions need (every 5 minutes as shipped), apart from the 5-minute tickets of gpuwarden-thermal-power."""
    thermal = (
        f"max without (reason) (rate(gpuwarden_throttle_seconds_total{{{s},"
        f'reason=~"hw_thermal_slowdown|sw_thermal_slowdown"}}[{duration(t.thermal_page_window_s)}]))'
    )
    # fmt: off
    return [
        page(t, name="GpuwardenThermalThrottling", action="cordon", verdict="thermal_throttling",
             threshold="thermal_page_ratio", for_="thermal_page_for_s",
             reads=("thermal_page_window_s",),
             expr=f"{held(thermal)} >",
             summary="A GPU is throttled for heat most of the time.",
             description=f"{GPU} spent {{{{ $value | humanizePercentage }}}} of the last "
             f"{duration(t.thermal_page_window_s)} in thermal slowdown (hardware or driver): its jobs run slower, and "
             "the GPU is at risk; drain the node and fix the cooling (fans, airflow, inlet temperature)."),
    ]
    # fmt: on


@group("gpuwarden-fabric-faults")
def fabric_faults(t: Thresholds, s: str) -> list[Rule]:
    """The fabric's faults that page or ticket at once (no `for:`), on the server's interval."""
    # fmt: off
    return [
        page(t, name="GpuwardenFabricUnhealthy", action="cordon", verdict="fabric",
             expr=held(f'gpuwarden_fabric_health{{{s},condition=~"{"|".join(FABRIC_FAULTS)}"}} == 1'),
             summary="A GPU's NVSwitch fabric is unhealthy: jobs that use it fail.",
             description=f"{GPU}: fabric {{{{ $labels.condition }}}} (route_unhealthy, incorrect_configuration or a "
             "failed registration with Fabric Manager). Drain the node, read /var/log/fabricmanager.log and "
             "`nvidia-smi -q` (Fabric), restart Fabric Manager, then reboot if it persists; an NVSwitch or baseboard "
             "fault needs the vendor."),
        alert(t, name="GpuwardenNvswitchSxid", severity="warning", verdict="fabric",
              threshold="xid_window_s",
              # the kernel log's record time, so an SXid from before the exporter started counts, and a
              # restart neither repeats nor resolves it; as the fabric verdict, for xid_window_s
              expr=f"time() - gpuwarden_kernel_sxid_last_timestamp_seconds{{{s}}} <",
              summary="An NVSwitch logged an SXid error.",
              description=f"NVSwitch {{{{ $labels.switch }}}} on {NODE} logged SXid {{{{ $labels.sxid }}}} (kernel "
              "log: `dmesg | grep SXid`). A non-fatal SXid is corrected by the switch; a fatal one makes Fabric "
              "Manager degrade or tear down the fabric, and GpuwardenFabricUnhealthy or GpuwardenFabricNotReady then "
              "pages. Read /var/log/fabricmanager.log and `nvidia-smi -q` (Fabric); the same SXid recurring on one "
              "switch needs the vendor at the next window."),
    ]
    # fmt: on


@group("gpuwarden-interconnect", conditions=("nvlink_down_for_s", "fabric_setup_for_s", "fabric_degraded_for_s"))
def interconnect(t: Thresholds, s: str) -> list[Rule]:
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
    # fmt: off
    return [
        page(t, name="GpuwardenNvlinkDown", action="cordon", verdict="nvlink",
             for_="nvlink_down_for_s",
             # against the links the GPU has (static, so a restart does not forget them); a GPU with none
             # active is a fault only if some were active in the last day (a PCIe card without a bridge has
             # links and none active), under any exporter instance: joined on the GPU's UUID, so a GPU whose
             # every link went down still pages after the exporter restarted (the new instance has seen none
             # active; joined on the instance too, the page resolved)
             expr=nvlink_down(f"{day} or {recent} > 0"),
             summary="An NVLink link is down.",
             description=f"{GPU} has {{{{ $value }}}} active NVLinks, fewer than it has (gpuwarden_nvlink_links): a "
             "link is down, which cripples multi-GPU training; drain the node, check nvidia-smi nvlink -s (which "
             "link: /api/v1/gpus or the nvlink_links group), reset or reboot, and replace the baseboard if it recurs.",
             # the fleet view evaluates it on the few instances it narrowed to, from the raw series: it then
             # works on a Prometheus that loads the fleet's recording rules without these
             finding_expr=nvlink_down(f"max by (uuid) (max_over_time(gpuwarden_nvlink_active_links{{{s}}}[1d])) > 0")),
        page(t, name="GpuwardenFabricNotReady", action="cordon", verdict="fabric",
             for_="fabric_setup_for_s",
             # one page per node: Fabric Manager sets up the whole node's fabric, so eight GPUs not ready were
             # eight incidents for one cause (seen in the restart test with real Alertmanager)
             expr=held(f'count without (gpu, uuid) (gpuwarden_fabric_state{{{s},state!="completed"}} == 1)'),
             summary="A node's NVSwitch fabric is not set up: CUDA cannot start on its GPUs.",
             description=f"{{{{ $value }}}} GPU(s) on {NODE}: their NVSwitch fabric is {{{{ $labels.state }}}}, so no "
             "CUDA job can start there, though every other reading looks healthy (which GPUs: /api/v1/health, check "
             "fabric). Check `systemctl status nvidia-fabricmanager` and /var/log/fabricmanager.log; start or restart "
             "Fabric Manager (its version must match the driver's); drain the node if the fabric does not complete."),
        alert(t, name="GpuwardenFabricDegraded", severity="warning", verdict="fabric",
              for_="fabric_degraded_for_s",
              expr=f'gpuwarden_fabric_health{{{s},condition=~"{"|".join(FABRIC_DEGRADED)}"}} == 1',
              summary="A GPU's NVSwitch fabric runs degraded.",
              description=f"{GPU}: fabric {{{{ $labels.condition }}}}: all-reduce over NVSwitch runs slower (degraded "
              "bandwidth: a trunk link lost) or recovers routes. Check /var/log/fabricmanager.log and `nvidia-smi "
              "nvlink -s`; plan a drain and an NVSwitch check at the next window."),
    ]
    # fmt: on
