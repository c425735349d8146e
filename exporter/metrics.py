"""The metric contract: every family gpuwarden exports, its type, labels and help.

Alerts, dashboards and deployment depend on these names; the README's metric reference is generated from
this table (tests/test_docs.py fails when it drifts). Per-GPU families get `gpu` and `uuid` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GPU_LABELS = ("gpu", "uuid")


@dataclass(frozen=True)
class Family:
    name: str
    type: Literal["gauge", "counter"]
    help: str
    labels: tuple[str, ...] = ()
    per_gpu: bool = True
    unit: str = ""

    @property
    def all_labels(self) -> tuple[str, ...]:
        return (GPU_LABELS + self.labels) if self.per_gpu else self.labels


def _f(
    name: str, type_: Literal["gauge", "counter"], help_: str, *labels: str, per_gpu: bool = True, unit: str = ""
) -> Family:
    return Family(name, type_, help_, tuple(labels), per_gpu, unit)


CLOCK_EVENT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock",
}

_FAMILIES = [
    # exporter and node
    _f(
        "gpuwarden_build_info",
        "gauge",
        "Build of this exporter; always 1.",
        "version",
        "nvml_python_version",
        per_gpu=False,
    ),
    _f(
        "gpuwarden_driver_info",
        "gauge",
        "NVIDIA driver, CUDA driver API and NVML versions; always 1.",
        "driver_version",
        "cuda_driver_version",
        "nvml_version",
        per_gpu=False,
    ),
    _f("gpuwarden_nvml_up", "gauge", "1 when NVML is initialised and answering, 0 otherwise.", per_gpu=False),
    _f(
        "gpuwarden_nvml_error_info",
        "gauge",
        "Why NVML is down (present only while gpuwarden_nvml_up is 0); always 1.",
        "error",
        per_gpu=False,
    ),
    _f("gpuwarden_gpus", "gauge", "GPUs currently visible to NVML.", per_gpu=False),
    _f(
        "gpuwarden_collect_duration_seconds",
        "gauge",
        "Wall time of the last poll of each tier.",
        "tier",
        per_gpu=False,
        unit="seconds",
    ),
    _f(
        "gpuwarden_last_collect_timestamp_seconds",
        "gauge",
        "Unix time the last poll of each tier finished.",
        "tier",
        per_gpu=False,
        unit="seconds",
    ),
    _f(
        "gpuwarden_collect_errors_total",
        "counter",
        "NVML errors by call and error; unsupported calls are counted once, then no longer tried.",
        "call",
        "error",
        per_gpu=False,
    ),
    _f(
        "gpuwarden_collect_timeouts_total",
        "counter",
        "GPU reads abandoned after the call deadline, by the call they were stuck in.",
        "call",
        per_gpu=False,
    ),
    _f(
        "gpuwarden_nvml_reinit_total",
        "counter",
        "Times NVML was re-initialised after a lifecycle error.",
        per_gpu=False,
    ),
    # health (exporter/health): derived from the readings below with the thresholds of the alert rules
    _f(
        "gpuwarden_health",
        "gauge",
        "Health verdict per check: 0 ok, 1 warning, 2 critical (sustained conditions judged over the exporter's own "
        "samples, with the alert rules' thresholds and durations).",
        "check",
    ),
    _f(
        "gpuwarden_health_since_timestamp_seconds",
        "gauge",
        "Unix time the current non-ok verdict of the check began, as this exporter saw it (present only while "
        "gpuwarden_health > 0; restarts with the exporter).",
        "check",
        unit="seconds",
    ),
    _f(
        "gpuwarden_health_status",
        "gauge",
        "The worst gpuwarden_health verdict of the GPU: 0 ok, 1 warning, 2 critical.",
    ),
    # pod attribution (exporter/podresources): kubelet pod-resources, refreshed in the background
    _f(
        "gpuwarden_pod_attribution_up",
        "gauge",
        "1 when the last kubelet pod-resources List succeeded; 0 when the socket is absent or the call fails "
        "(absent when pods.attribution is off).",
        per_gpu=False,
    ),
    _f(
        "gpuwarden_pod_attribution_unmatched_devices",
        "gauge",
        "Allocated GPU device IDs that name no GPU (nor MIG instance) visible to this exporter.",
        per_gpu=False,
    ),
    _f(
        "gpuwarden_gpu_allocation",
        "gauge",
        "1 for each container the kubelet allocated the GPU to (several under time-slicing, MPS or MIG); join with "
        "`* on(uuid) group_left(namespace, pod, container)`.",
        "namespace",
        "pod",
        "container",
    ),
    # per-GPU identity and state
    _f(
        "gpuwarden_gpu_info",
        "gauge",
        "Static identity of the GPU; always 1.",
        "name",
        "serial",
        "pci_bus_id",
        "vbios_version",
        "compute_capability",
    ),
    _f("gpuwarden_gpu_up", "gauge", "1 when the GPU answers; 0 when it is lost (off the bus, reset required)."),
    _f(
        "gpuwarden_gpu_stale",
        "gauge",
        "1 when the GPU's last read overran the call deadline and its values are from an earlier poll.",
    ),
    _f(
        "gpuwarden_gpu_hardware_error_info",
        "gauge",
        "A hardware error NVML reported for the GPU (corrupted InfoROM, IRQ issue, insufficient power).",
        "error",
    ),
    # utilization
    _f(
        "gpuwarden_utilization_ratio",
        "gauge",
        "Share of the driver's last sample period (~200 ms on H100) in which a kernel ran; a point sample. "
        "Use rate(gpuwarden_busy_seconds_total) / rate(gpuwarden_utilization_sampled_seconds_total) for averages.",
        unit="ratio",
    ),
    _f(
        "gpuwarden_busy_seconds_total",
        "counter",
        "Seconds in which a kernel ran, summed from the driver's utilization sample buffer.",
        unit="seconds",
    ),
    _f(
        "gpuwarden_utilization_sampled_seconds_total",
        "counter",
        "Seconds covered by the utilization samples counted in gpuwarden_busy_seconds_total.",
        unit="seconds",
    ),
    _f(
        "gpuwarden_utilization_source_info",
        "gauge",
        "Where utilization comes from: samples (driver sample buffer) or single_read (one read per poll; "
        "bursty load is misreported); always 1.",
        "source",
    ),
    _f(
        "gpuwarden_memory_bandwidth_utilization_ratio",
        "gauge",
        "Share of the last sample period in which device memory was read or written (not occupancy).",
        unit="ratio",
    ),
    # memory
    _f("gpuwarden_memory_total_bytes", "gauge", "Total device memory.", unit="bytes"),
    _f(
        "gpuwarden_memory_used_bytes",
        "gauge",
        "Device memory used by processes (v2: excludes the driver reserve).",
        unit="bytes",
    ),
    _f("gpuwarden_memory_free_bytes", "gauge", "Device memory free.", unit="bytes"),
    _f("gpuwarden_memory_reserved_bytes", "gauge", "Device memory reserved by the driver and firmware.", unit="bytes"),
    # thermal
    _f("gpuwarden_temperature_celsius", "gauge", "GPU die temperature.", unit="celsius"),
    _f("gpuwarden_memory_temperature_celsius", "gauge", "HBM temperature.", unit="celsius"),
    _f(
        "gpuwarden_temperature_threshold_celsius",
        "gauge",
        "Temperature thresholds (absolute): slowdown, shutdown, gpu_max, memory_max.",
        "threshold",
        unit="celsius",
    ),
    # power
    _f("gpuwarden_power_usage_watts", "gauge", "Power draw (1 s average on Ampere and newer).", unit="watts"),
    _f("gpuwarden_power_limit_watts", "gauge", "Enforced power limit.", unit="watts"),
    _f("gpuwarden_power_default_limit_watts", "gauge", "Default power limit of the board.", unit="watts"),
    _f("gpuwarden_energy_joules_total", "counter", "Energy consumed since the driver was loaded.", unit="joules"),
    # clocks and throttling
    _f("gpuwarden_performance_state", "gauge", "Performance state: 0 = P0 (maximum) ... 15; omitted if unknown."),
    _f("gpuwarden_clock_hertz", "gauge", "Current clock.", "clock", unit="hertz"),
    _f("gpuwarden_clock_max_hertz", "gauge", "Maximum clock.", "clock", unit="hertz"),
    _f(
        "gpuwarden_clock_event_active",
        "gauge",
        "1 while the clock-event (throttle) reason is active at the poll; a point sample.",
        "reason",
    ),
    _f(
        "gpuwarden_throttle_seconds_total",
        "counter",
        "Cumulative time the driver held clocks down for the reason.",
        "reason",
        unit="seconds",
    ),
    # ECC and memory health
    _f("gpuwarden_ecc_enabled", "gauge", "1 when ECC is enabled (current mode)."),
    _f("gpuwarden_ecc_errors_total", "counter", "ECC errors since the driver was loaded (volatile).", "type"),
    _f(
        "gpuwarden_ecc_lifetime_errors_total",
        "counter",
        "ECC errors over the board's life (InfoROM aggregate).",
        "type",
    ),
    _f("gpuwarden_remapped_rows", "gauge", "Memory rows remapped, by cause (Ampere and newer).", "cause"),
    _f("gpuwarden_remapped_rows_pending", "gauge", "1 when a row remap is pending (reset the GPU to apply)."),
    _f("gpuwarden_remapped_rows_failed", "gauge", "1 when a row remap failed (replace the GPU)."),
    _f("gpuwarden_retired_pages", "gauge", "Retired memory pages, by cause (pre-Ampere).", "cause"),
    _f("gpuwarden_retired_pages_pending", "gauge", "1 when a page retirement is pending (pre-Ampere)."),
    # XID
    _f(
        "gpuwarden_xid_errors_total",
        "counter",
        "XID critical-error events seen since this exporter started (NVML keeps no history).",
        "xid",
    ),
    _f(
        "gpuwarden_xid_last_timestamp_seconds",
        "gauge",
        "Unix time of the last event of each XID.",
        "xid",
        unit="seconds",
    ),
    # modes, processes, recovery
    _f("gpuwarden_persistence_mode_enabled", "gauge", "1 when persistence mode is on."),
    _f("gpuwarden_mig_mode_enabled", "gauge", "1 when MIG mode is on (current mode)."),
    _f("gpuwarden_processes", "gauge", "Compute processes running on the GPU."),
    _f(
        "gpuwarden_recovery_action",
        "gauge",
        "The driver's recommended recovery action: 0 none, 1 GPU reset, 2 node reboot, 3 drain P2P, 4 drain and reset.",
    ),
    # PCIe
    _f("gpuwarden_pcie_replay_errors_total", "counter", "PCIe replay counter."),
    _f(
        "gpuwarden_pcie_bytes_total",
        "counter",
        "PCIe bytes transferred (driver counters; R555+).",
        "direction",
        unit="bytes",
    ),
    _f("gpuwarden_pcie_link_generation", "gauge", "PCIe link generation.", "kind"),
    _f("gpuwarden_pcie_link_width", "gauge", "PCIe link width (lanes).", "kind"),
    _f("gpuwarden_fan_speed_ratio", "gauge", "Fan speed as a share of maximum (may exceed 1).", unit="ratio"),
    # NVLink and topology
    _f("gpuwarden_nvlink_up", "gauge", "1 when the NVLink link is active.", "link"),
    _f("gpuwarden_nvlink_errors_total", "counter", "NVLink errors per link.", "link", "type"),
    _f(
        "gpuwarden_nvlink_peer_links",
        "gauge",
        "Active NVLinks to the peer GPU (NV# in nvidia-smi topo -m).",
        "peer_gpu",
        "peer_uuid",
    ),
    _f(
        "gpuwarden_topology_info",
        "gauge",
        "Connection to the peer GPU as nvidia-smi topo -m shows it (NV#, PIX, PXB, PHB, NODE, SYS); always 1.",
        "peer_gpu",
        "level",
    ),
]

FAMILIES: dict[str, Family] = {family.name: family for family in _FAMILIES}
