"""The alert rules about the service around the GPUs: the exporter itself, jobs, capacity and configuration, the
sustained tickets evaluated every 5 minutes, and the recorded maxima the day-long windows read.

Each group is a function declared by @group (rules_model.py); its rules are rows of named data, laid out by hand
(`fmt: off`): the alert's name, severity, action and verdict; the thresholds it reads; its expression; its words.
"""

from __future__ import annotations

from gpuwarden.health.rules_model import (
    GPU,
    HISTORY_GROUP,
    HISTORY_INTERVAL_S,
    HISTORY_WINDOW,
    HOLD_MARGIN_S,
    NODE,
    NODE_GPUS_MAX,
    NVLINK_ACTIVE_DAY_MAX,
    NVLINK_ACTIVE_MAX,
    SUSTAINED_GROUP,
    SUSTAINED_LONG_GROUP,
    Record,
    Rule,
    alert,
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
def exporter(t: Thresholds, s: str) -> list[Rule]:
    # fmt: off
    return [
        alert(t, name="GpuwardenExporterDown", severity="warning",
              for_="exporter_down_for_s",
              expr=f"up{{{s}}} == 0",
              summary="A gpuwarden exporter is down.",
              # no duration in the words: the chart tunes `for:` (thresholds.exporter_down_for_s), not descriptions
              description=f"gpuwarden on {NODE} has stopped answering scrapes, so its GPUs are unmonitored; check the "
              "pod or service and its logs."),
        alert(t, name="GpuwardenExporterAbsent", severity="warning",
              for_="exporter_absent_for_s",
              expr=f"absent(up{{{s}}})",
              summary="No gpuwarden exporter is scraped.",
              description="Prometheus has no gpuwarden target at all, so every GPU rule evaluates to nothing and looks "
              "healthy; check the ServiceMonitor or scrape config and the DaemonSet."),
        alert(t, name="GpuwardenNvmlDown", severity="critical", action="cordon",
              for_="nvml_down_for_s",
              expr=f"gpuwarden_nvml_up{{{s}}} == 0",
              summary="NVML is down on a GPU node.",
              description=f"gpuwarden on {NODE} cannot use NVML (see gpuwarden_nvml_error_info): the driver is not "
              "loaded, the library is missing or was upgraded; check the driver with nvidia-smi and reload or reboot."),
        alert(t, name="GpuwardenCollectionStale", severity="warning",
              threshold="collection_stale_s",
              expr=f'time() - gpuwarden_last_collect_timestamp_seconds{{{s},tier="fast"}} >',
              summary="GPU collection has stalled.",
              description=f"gpuwarden on {NODE} has not finished a poll for {{{{ $value | humanizeDuration }}}}: NVML "
              "is probably wedged in the driver (often a hung GPU, XID 119/120); check dmesg and nvidia-smi."),
    ]
    # fmt: on


@group("gpuwarden-capacity", conditions=("memory_for_s",))
def capacity(t: Thresholds, s: str) -> list[Rule]:
    # fmt: off
    return [
        alert(t, name="GpuwardenMemoryNearlyFull", severity="warning", verdict="memory_pressure",
              threshold="memory_warning_ratio", for_="memory_for_s",
              expr=f"gpuwarden_memory_used_bytes{{{s}}} / gpuwarden_memory_total_bytes{{{s}}} >",
              summary="A GPU's memory is nearly full.",
              description=f"{GPU} uses {{{{ $value | humanizePercentage }}}} of its memory; frameworks preallocate, so "
              "tell the job's owner: smaller batch, gradient checkpointing, sharding (ZeRO/FSDP) or bf16."),
    ]
    # fmt: on


@group("gpuwarden-jobs")
def jobs(t: Thresholds, s: str) -> list[Rule]:
    # fmt: off
    return [
        alert(t, name="GpuwardenCollectiveHang", severity="warning",
              keep_firing=t.collective_window_s + t.collective_hang_for_s + HOLD_MARGIN_S,
              reads=("collective_window_s", "collective_hang_for_s"),
              # held across an exporter restart: the new exporter needs the window and the hang's duration
              # again before it can say so (collective_window_s + collective_hang_for_s), plus a scrape or two
              expr=held(f'gpuwarden_job_finding{{{s},kind="collective_hang"}} == 1'),
              summary="A training job is hung in a collective.",
              description=f"Job {{{{ $labels.job_id }}}} on {NODE} spins in a collective and nothing has moved over "
              f"its links for collective_hang_for_s{{{{ if $labels.gpu }}}}; GPU {{{{ $labels.gpu }}}} (rank {{{{ "
              f"$labels.rank }}}}) stopped first{{{{ end }}}}. Tell the job's owner: dump every rank's stacks (py-spy "
              "dump), the odd one out first, and restart from the last checkpoint. The GPUs are fine."),
    ]
    # fmt: on


@group(
    SUSTAINED_GROUP,
    # what each rule's condition lasts, in the rules' order: PerformanceStateDegraded's window, NvlinkReplayRecovery's
    # [15m], GpuCountDropped's `for:`, the CRC and PCIe tickets' `for:`
    conditions=("pstate_for_s", 900, 600, "nvlink_crc_for_s", "pcie_replays_for_s"),
)
def sustained(t: Thresholds, s: str) -> list[Rule]:
    """Tickets and information over windows or `for:` of 10 minutes or more: evaluated every 5 minutes, not every
    minute (at 10,000 nodes they were a fifth of the alert rules' CPU; issue 38, docs/benchmarks.md)."""
    # fmt: off
    return [
        alert(t, name="GpuwardenPerformanceStateDegraded", severity="warning", verdict="performance_state",
              for_=300, reads=("pstate_for_s", "pstate_degraded_min", "pstate_busy_ratio", "pstate_exempt_name_regex"),
              expr=f"min_over_time(gpuwarden_performance_state{{{s}}}[{duration(t.pstate_for_s)}]) "
              f">= {t.pstate_degraded_min} and on (instance, uuid) {busy(s, t.pstate_for_s)} "
              f"> {t.pstate_busy_ratio:g} and on (instance, uuid) "
              f'gpuwarden_gpu_info{{{s},name!~"{t.pstate_exempt_name_regex}"}}',
              summary="A busy GPU is stuck in a low performance state.",
              description=f"{GPU} has been in P{{{{ $value }}}} or lower while busy; check clock-event reasons, power "
              "and thermals, and application clocks."),
        alert(t, name="GpuwardenNvlinkReplayRecovery", severity="warning", verdict="nvlink",
              expr=f'increase(gpuwarden_nvlink_gpu_errors_total{{{s},type=~"replay|recovery"}}[15m]) > 0',
              summary="A GPU's NVLinks needed replays or recovery.",
              description=f"The NVLinks of {GPU} logged {{{{ $labels.type }}}} errors; watch them and reset the GPU at "
              "the next maintenance window if they continue."),
        alert(t, name="GpuwardenGpuCountDropped", severity="warning",
              for_=600, reads=("gpu_count_memory_s",),
              # against the node's expected count where it is set (a fact that survives restarts), else
              # against the most GPUs the node showed in gpu_count_memory_s, grouped by node so that a
              # restarted exporter (a new instance) does not forget the GPUs it never saw
              # (the most seen: max_over_time of the raw series, then the node label, not a [24h:1m] subquery
              # of the relabelled one: 2.2x less CPU and 426x fewer points held at 1,000 nodes, issue 38)
              # (and over the recorded maxima, HISTORY_GROUP: 144 points a node a day, not 5,760)
              expr=f"(gpuwarden_gpus_expected{{{s}}} - gpuwarden_gpus{{{s}}} > 0) or on (node) ("
              f"max by (node) (max_over_time({NODE_GPUS_MAX}[{duration(t.gpu_count_memory_s)}]))"
              f" - max by (node) ({nodeish(f'gpuwarden_gpus{{{s}}}')}) "
              f"> 0 unless on (node) {nodeish(f'gpuwarden_gpus_expected{{{s}}}')})",
              summary="A GPU disappeared from a node.",
              description=f"{{{{ $value }}}} GPU(s) fewer are visible on {NODE} than it should have "
              f"(gpuwarden_gpus_expected, or the most seen in the last {duration(t.gpu_count_memory_s)}); check "
              "nvidia-smi and dmesg for a GPU that fell off the bus, then cordon and reseat it."),
        alert(t, name="GpuwardenNvlinkCrcErrorsHigh", severity="warning", verdict="nvlink",
              threshold="nvlink_crc_per_second", for_="nvlink_crc_for_s",
              expr=f'rate(gpuwarden_nvlink_gpu_errors_total{{{s},type="crc_flit"}}[5m]) >',
              summary="A GPU's NVLinks have a high CRC error rate.",
              description=f"The NVLinks of {GPU} have {{{{ $value }}}} CRC errors/s together; find the link "
              "(/api/v1/gpus or the nvlink_links group), schedule a reset and check it at the next maintenance "
              "window."),
        alert(t, name="GpuwardenPcieReplaysHigh", severity="warning", verdict="pcie",
              threshold="pcie_replays_per_minute", for_="pcie_replays_for_s",
              expr=f"rate(gpuwarden_pcie_replay_errors_total{{{s}}}[5m]) * 60 >",
              summary="A GPU's PCIe link is replaying packets.",
              description=f"{GPU} replays {{{{ $value | humanize }}}} PCIe packets per minute; check seating, risers "
              "and cables."),
    ]
    # fmt: on


@group(SUSTAINED_LONG_GROUP, conditions=("power_cap_for_s", "utilization_for_s", "power_limit_reduced_for_s"))
def sustained_long(t: Thresholds, s: str) -> list[Rule]:
    """Information and tickets over 30 minutes or more: evaluated every 10 minutes (Underutilized's 30-minute busy
    ratio of every GPU was the costliest rule of gpuwarden-sustained; issue 51, docs/benchmarks.md). Underutilized's
    `for: 5m` is then met at its second evaluation, as it was every 5 minutes."""
    # fmt: off
    return [
        alert(t, name="GpuwardenPowerCapSustained", severity="info", verdict="power",
              threshold="power_cap_ratio", reads=("power_cap_for_s",),
              expr=f'rate(gpuwarden_throttle_seconds_total{{{s},reason="sw_power_cap"}}'
              f"[{duration(t.power_cap_for_s)}]) >",
              summary="A GPU runs at its power cap.",
              description=f"{GPU} was power-capped {{{{ $value | humanizePercentage }}}} of the time; normal at full "
              "load, worth a look if the limit was lowered."),
        alert(t, name="GpuwardenUnderutilized", severity="info", verdict="utilization",
              for_=300, reads=("utilization_for_s", "utilization_low_ratio"),
              expr=f"{busy(s, t.utilization_for_s)} < {t.utilization_low_ratio:g} "
              f"and on (instance, uuid) gpuwarden_processes{{{s}}} > 0",
              summary="A GPU holding a job is mostly idle.",
              description=f"{GPU} ran kernels only {{{{ $value | humanizePercentage }}}} of the time while a job held "
              "it; the job starves on input (DataLoader workers, pin_memory, local caching), communication or "
              "checkpoints: profile it."),
        alert(t, name="GpuwardenPowerLimitReduced", severity="warning", verdict="power",
              for_="power_limit_reduced_for_s",
              expr=f"gpuwarden_power_limit_watts{{{s}}} < gpuwarden_power_default_limit_watts{{{s}}}",
              summary="A GPU's power limit is below its default.",
              description=f"{GPU} is limited to {{{{ $value }}}} W, below its default; restore it with nvidia-smi -pl "
              "or find the out-of-band limiter (BMC)."),
    ]
    # fmt: on


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
def configuration(t: Thresholds, s: str) -> list[Rule]:
    # fmt: off
    return [
        alert(t, name="GpuwardenPersistenceModeOff", severity="warning", verdict="persistence_mode",
              for_="persistence_off_for_s",
              expr=f"gpuwarden_persistence_mode_enabled{{{s}}} == 0",
              summary="A GPU runs without persistence mode.",
              description=f"{GPU} has persistence mode off, so driver state is torn down between jobs; enable "
              "nvidia-persistenced (or nvidia-smi -pm 1)."),
    ]
    # fmt: on
